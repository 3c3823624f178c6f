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
from mtp_trt.fsutil import FILE_NAME, SHA256, Int, Map, OneOf, Text, check_fields
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
        check_fields(raw, SCHEMA, str(path))
        engines = {n: EngineSpec(name=n, **{k.rstrip("?"): e[k.rstrip("?")] for k in ENGINE_SCHEMA
                                           if k.rstrip("?") in e}) for n, e in raw["engines"].items()}
        m = cls(root=root, raw=raw, flavour=raw["tensorrt"]["flavour"], trt_version=raw["tensorrt"]["version"],
                target_archs=raw["target_archs"], precision=raw["precision"],
                export_format_version=raw["export"]["format_version"], profiles=raw["profiles"],
                plugins=raw["plugins"], engines=engines)
        _check_sizes(path, m)
        check_files(path, [(e.file, e.sha256) for e in engines.values()], verify_hashes, "build")
        return m

    @property
    def max_batch(self) -> int:
        return self.raw["max_batch"]

    def check_export(self, exp: Manifest) -> None:
        """The engines are those of `exp`, the export they were built from (export_manifest.json): one engine for
        every graph the decode loop may run, each built from that graph's ONNX file, at the export's precision,
        mode and K, with profiles within the export's max_batch and max_seq_len.  One error naming the field."""
        path = self.root / FILE

        def bad(field: str, msg: str) -> MtpTrtError:
            return MtpTrtError(f"{path}: field '{field}' {msg}; the engine directory was edited or is incomplete "
                               f"(build again)")

        missing = [g for g in exp.graphs if g not in self.engines]
        if missing:
            raise bad("engines", f"has no engine for graph(s) {', '.join(missing)} of {EXPORT_MANIFEST}")
        extra = [g for g in self.engines if g not in exp.graphs]
        if extra:
            raise bad("engines", f"lists {', '.join(extra)}, which {EXPORT_MANIFEST} has no graph for")
        for name, e in self.engines.items():
            g = exp.graphs[name]
            if (e.onnx, e.onnx_sha256) != (g.file, g.sha256):
                raise bad(f"engines.{name}.onnx_sha256", f"names {e.onnx} {e.onnx_sha256[:12]}.., but the export's "
                                                         f"graph is {g.file} {g.sha256[:12]}..")
        built = self.raw["export"]
        for field, value in (("dtype", exp.dtype), ("nextn", exp.nextn), ("mtp_mode", exp.mtp_mode),
                             ("lowering", exp.lowering), ("format_version", exp.raw["format_version"])):
            if field in built and built[field] != value:
                raise bad(f"export.{field}", f"is {built[field]!r}, but {EXPORT_MANIFEST} says {value!r}")
        if self.precision != exp.dtype:
            raise bad("precision", f"is {self.precision!r}, but the export's dtype is {exp.dtype!r}")
        if self.max_batch > exp.max_batch or self.raw["max_seq_len"] > exp.max_seq_len:
            raise bad("max_batch", f"and max_seq_len are {self.max_batch} and {self.raw['max_seq_len']}, beyond the "
                                   f"export's {exp.max_batch} and {exp.max_seq_len}")


ARCH = Text(r"[0-9]{1,2}\.[0-9]{1,2}", "a compute capability such as 8.9")
ENGINE_SCHEMA = {"file": FILE_NAME, "sha256": SHA256, "bytes": Int(1), "onnx": FILE_NAME, "onnx_sha256": SHA256,
                 "plugin_layers": Map(Int(0)), "build_seconds": float, "aliases?": Map(str)}
DIMS = [Int(1), Int(1), Int(1)]  # min, opt, max
SCHEMA = {
    "tensorrt": {"flavour": OneOf("tensorrt", "tensorrt_rtx"), "version": str}, "target_archs": [ARCH],
    "precision": OneOf("fp32", "fp16", "bf16"), "max_batch": Int(1), "max_seq_len": Int(1), "max_prefill?": Int(1),
    "export": {"format_version": Int(1), "manifest_sha256": SHA256, "dtype?": str, "nextn?": Int(0),
               "mtp_mode?": str, "lowering?": str},
    "profiles": [{"name": OneOf("generation", "prefill"), "dims": {"B": DIMS, "S": DIMS, "T": DIMS}}],
    "plugins": [{"name": str, "version": str}], "engines": Map(ENGINE_SCHEMA),
}


def _check_sizes(path: Path, m: EngineManifest) -> None:
    """Sizes that make sense: profiles min <= opt <= max within max_batch and max_seq_len, at least one target."""
    if not m.target_archs:
        raise MtpTrtError(f"{path}: field 'target_archs' is empty; the engines name no GPU architecture")
    for i, prof in enumerate(m.profiles):
        for dim, (lo, opt, hi) in prof["dims"].items():
            top = {"B": m.raw["max_batch"], "T": m.raw["max_seq_len"]}.get(dim, hi)
            if not lo <= opt <= hi <= top:
                raise MtpTrtError(f"{path}: field 'profiles[{i}].dims.{dim}' is {[lo, opt, hi]}, not min <= opt <= "
                                  f"max <= {top}")


def load_export_manifest(engine_dir: Path) -> Manifest:
    """The export manifest kept in the engine directory (export_manifest.json), without its ONNX files."""
    from mtp_trt.manifest import FORMAT as EXPORT_FORMAT
    from mtp_trt.manifest import FORMAT_VERSION as EXPORT_VERSION
    from mtp_trt.manifest import Manifest

    path = Path(engine_dir) / EXPORT_MANIFEST
    raw = read_manifest_json(path, EXPORT_FORMAT, EXPORT_VERSION, "export", "mtp-trt export")
    return Manifest.from_raw(Path(engine_dir), raw, str(path))
