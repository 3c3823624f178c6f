"""The export contract: `manifest.json` in an export directory, read and checked without torch.

The exporter writes it; the runtime, the TensorRT builder and the plugins read it.  It records the
model config, K, the MTP mode, dtypes, every graph's inputs and outputs (name, dtype, shape), the
latent cache layout, the tokenizer files and a SHA-256 of each ONNX file.  docs/architecture.md
describes the graphs and one decode step.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from mtp_trt.config import ModelConfig
from mtp_trt.errors import MtpTrtError
from mtp_trt.fsutil import read_json

FORMAT = "mtp-trt-export"
FORMAT_VERSION = 1
# Bumped whenever the exporter writes different graphs for the same checkpoint (2: one step graph per nextn;
# 3: fewer glue nodes: shared shapes and masks, gather RoPE, fused projections, folded MLA weights;
# 4: step_0, plain decoding without acceptance, in both modes; 5: vanilla step graphs; 6: weights.bin;
# 7: routed MoE), so exports cached by `mtp-trt run` are redone rather than reused.
EXPORTER_REVISION = 7
MTP_MODES = ("eagle", "vanilla")
DTYPES = ("fp32", "fp16", "bf16")
NUMPY_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int32": "int32", "int64": "int64"}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest_json(path: Path, fmt: str, version: int, what: str, command: str) -> dict[str, Any]:
    """The JSON of an mtp-trt manifest, checked for its format and version (one clear error otherwise)."""
    if not path.is_file():
        raise MtpTrtError(f"{path.parent}: not an mtp-trt {what} directory (no {path.name}); run `{command}`")
    raw = read_json(path)
    if not isinstance(raw, dict) or raw.get("format") != fmt:
        raise MtpTrtError(f"{path}: field 'format' is {raw.get('format') if isinstance(raw, dict) else raw!r}, "
                          f"expected {fmt!r}")
    if raw.get("format_version") != version:
        raise MtpTrtError(f"{path}: {what} format version {raw.get('format_version')!r} is not the version {version} "
                          f"this mtp-trt reads; run `{command}` again")
    return raw


def check_files(manifest: Path, files: list[tuple[str, str]], verify_hashes: bool, what: str) -> None:
    """Every (file, sha256) a manifest lists exists beside it and, if asked, still has that hash."""
    for name, digest in files:
        f = manifest.parent / name
        if not f.is_file():
            raise MtpTrtError(f"{manifest}: {what} file '{name}' is missing")
        if verify_hashes and sha256(f) != digest:
            raise MtpTrtError(f"{f}: SHA-256 differs from {manifest.name}; the {what} file was modified or truncated")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # fp32 | fp16 | bf16 | int32
    shape: list[int | str]  # symbolic dims by name: B, S, T, ...


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    name: str  # target | mtp_0 | mtp_1 ...
    file: str
    sha256: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    kv_inputs: list[str]  # the persistent cache inputs, one per layer of this graph
    kv_outputs: list[str]  # onnx lowering: the new rows to write back (same order); plugin lowering: []


@dataclasses.dataclass(frozen=True)
class Manifest:
    root: Path
    raw: dict[str, Any]
    config: ModelConfig
    nextn: int
    mtp_mode: str
    dtype: str
    lowering: str
    max_batch: int
    max_seq_len: int
    graphs: dict[str, GraphSpec]
    think_ids: tuple[int, int]  # (<think>, </think>) token ids, -1 where the tokenizer has none
    eos_ids: tuple[int, ...]
    tokenizer: str | None  # file name of tokenizer.json in the export directory

    @property
    def mtp_graphs(self) -> list[str]:
        """Graph used for each draft depth: eagle reuses mtp_0 K times, vanilla uses mtp_k at depth k."""
        return ["mtp_0" if self.mtp_mode == "eagle" else f"mtp_{k}" for k in range(self.nextn)]

    @classmethod
    def load(cls, root: str | Path, verify_hashes: bool = False) -> Manifest:
        root = Path(root)
        path = root / "manifest.json"
        raw = read_manifest_json(path, FORMAT, FORMAT_VERSION, "export", "mtp-trt export")
        try:
            graphs = {}
            for name, g in raw["graphs"].items():
                graphs[name] = GraphSpec(
                    name=name, file=g["file"], sha256=g["sha256"],
                    inputs=[TensorSpec(**t) for t in g["inputs"]], outputs=[TensorSpec(**t) for t in g["outputs"]],
                    kv_inputs=g["kv_inputs"], kv_outputs=g["kv_outputs"])
            m = cls(root=root, raw=raw, config=ModelConfig.from_dict(raw["config"], source=f"{path} (config)"),
                    nextn=raw["nextn"], mtp_mode=raw["mtp_mode"], dtype=raw["dtype"], lowering=raw["lowering"],
                    max_batch=raw["max_batch"], max_seq_len=raw["max_seq_len"], graphs=graphs,
                    think_ids=tuple(raw["think_ids"]), eos_ids=tuple(raw["eos_ids"]), tokenizer=raw.get("tokenizer"))
        except (KeyError, TypeError) as e:
            raise MtpTrtError(f"{path}: malformed manifest ({type(e).__name__}: {e})") from None
        weights = raw.get("weights")  # one file of weights shared by the graphs (older exports: none)
        shared = [(weights["file"], weights["sha256"])] if isinstance(weights, dict) and "file" in weights else []
        check_files(path, [(g.file, g.sha256) for g in graphs.values()] + shared, verify_hashes, "graph")
        return m
