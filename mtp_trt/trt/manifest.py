"""The engine manifest `engines.json` of an engine directory, written by `mtp-trt build`, read by `check`.

It records the TensorRT flavour and version, the target architectures (and the GPU it was built on), the
export's lowering, the optimization profiles, each engine's aliased cache outputs,
the plugins (name, version, namespace, and how many layers of each every engine has), a SHA-256 of
each source ONNX file and of each engine, and the export it came from (directory, format version,
manifest hash).  The export's manifest.json is kept beside it as export_manifest.json.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtp_trt.errors import MtpTrtError
from mtp_trt.manifest import check_files, read_manifest_json

if TYPE_CHECKING:
    from mtp_trt.manifest import Manifest

FORMAT = "mtp-trt-engines"
FORMAT_VERSION = 2  # 2: lowering, built_on, per-engine aliases (plugin contract version 2)
FILE = "engines.json"
EXPORT_MANIFEST = "export_manifest.json"


def dumps(obj) -> str:
    """Indented JSON with lists of numbers (shapes) kept on one line."""
    text = json.dumps(obj, indent=2)
    return re.sub(r"\[\s+([-\d.,\s]+?)\s+\]", lambda mt: "[" + " ".join(mt.group(1).split()) + "]", text) + "\n"


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    name: str  # graph name: target | mtp_0 ...
    file: str
    sha256: str
    bytes: int
    onnx: str
    onnx_sha256: str
    plugin_layers: dict[str, int]  # op name -> plugin layers in the network (== custom nodes in the ONNX)
    build_seconds: float
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)  # output -> input bound to one buffer


@dataclasses.dataclass(frozen=True)
class EngineManifest:
    root: Path
    raw: dict[str, Any]
    flavour: str
    trt_version: str
    target_archs: list[str]
    precision: str
    export_format_version: int
    profiles: list[dict]
    plugins: list[dict]
    engines: dict[str, EngineSpec]

    @classmethod
    def load(cls, root: str | Path, verify_hashes: bool = False) -> EngineManifest:
        root = Path(root)
        path = root / FILE
        raw = read_manifest_json(path, FORMAT, FORMAT_VERSION, "engine", "mtp-trt build")
        try:
            engines = {n: EngineSpec(name=n, **e) for n, e in raw["engines"].items()}
            m = cls(root=root, raw=raw, flavour=raw["tensorrt"]["flavour"], trt_version=raw["tensorrt"]["version"],
                    target_archs=raw["target_archs"], precision=raw["precision"],
                    export_format_version=raw["export"]["format_version"], profiles=raw["profiles"],
                    plugins=raw["plugins"], engines=engines)
        except (KeyError, TypeError) as e:
            raise MtpTrtError(f"{path}: malformed engine manifest ({type(e).__name__}: {e})") from None
        check_files(path, [(e.file, e.sha256) for e in engines.values()], verify_hashes, "engine")
        return m


def load_export_manifest(engine_dir: Path) -> Manifest:
    """The export manifest kept in the engine directory (export_manifest.json), without its ONNX files."""
    from mtp_trt.config import ModelConfig
    from mtp_trt.manifest import GraphSpec, Manifest

    path = Path(engine_dir) / EXPORT_MANIFEST
    try:
        raw = json.loads(path.read_text())
        graphs = {n: GraphSpec.from_dict(n, g) for n, g in raw["graphs"].items()}
        return Manifest(root=engine_dir, raw=raw, config=ModelConfig.from_dict(raw["config"], source=str(path)),
                        nextn=raw["nextn"], mtp_mode=raw["mtp_mode"], dtype=raw["dtype"], lowering=raw["lowering"],
                        max_batch=raw["max_batch"], max_seq_len=raw["max_seq_len"], graphs=graphs,
                        think_ids=tuple(raw["think_ids"]), eos_ids=tuple(raw["eos_ids"]),
                        tokenizer=raw.get("tokenizer"))
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise MtpTrtError(f"{path}: unreadable export manifest ({type(e).__name__}: {e})") from None
