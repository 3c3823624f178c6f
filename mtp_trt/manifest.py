"""The export contract: `manifest.json` in an export directory, read and checked without torch.

The exporter writes it; the runtime, the TensorRT builder and the plugins read it.  It records the
model config, K, the MTP mode, dtypes, every graph's inputs and outputs (name, dtype, shape), the
latent cache layout, the tokenizer files and a SHA-256 of each ONNX file and of `weights.bin`.
docs/architecture.md describes the graphs and one decode step.

Integrity: `Manifest.load` checks that the manifest agrees with itself and with the files present (cheap);
`verify_files` / `verify_export` hash the files once and remember, per file, the (size, mtime, ctime, inode)
they had, in `cache_dir("verified")`; later calls re-hash only files whose stat changed (or all, forced).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from mtp_trt.config import ModelConfig
from mtp_trt.contract import DTYPES, TARGET, TENSOR_DTYPES, mtp_graph, step_graph
from mtp_trt.errors import MtpTrtError
from mtp_trt.fsutil import FILE_NAME, SHA256, Int, Map, OneOf, Opt, cache_dir, check_fields, parse_json, read_json, \
    write_atomic
from mtp_trt.quant import Scheme, scheme

FORMAT = "mtp-trt-export"
FORMAT_VERSION = 1
# Bumped whenever the exporter writes different graphs for the same checkpoint (CHANGELOG.md, "Exporter
# revisions", says what each changed), so exports cached by `mtp-trt run` are redone rather than reused.
EXPORTER_REVISION = 23
MTP_MODES = ("eagle", "vanilla")
MANIFEST_DIGEST = "manifest_sha256"  # the manifest's own digest (seal): every field that decides the output

# Every field of manifest.json the runtime reads, with its type (fsutil.check_fields); the config is checked by
# ModelConfig, the relations between fields by _check_consistency.
TENSOR_SCHEMA = {"name": str, "dtype": OneOf(*TENSOR_DTYPES), "shape": [object]}
GRAPH_SCHEMA = {"file": FILE_NAME, "sha256": SHA256, "inputs": [TENSOR_SCHEMA], "outputs": [TENSOR_SCHEMA],
                "kv_inputs": [str], "kv_outputs": [str], "commits?": Map(str)}
TABLE_ROW = [str, Int(0), Int(0), Int(0), [Int(0)]]  # name, offset, bytes, ONNX data type, dims
MANIFEST_SCHEMA = {
    "checkpoint?": str, "config": dict, "nextn": Int(0), "mtp_mode": OneOf(*MTP_MODES), "dtype": OneOf(*DTYPES),
    "lowering": OneOf("onnx", "plugin"), "max_batch": Int(1), "max_seq_len": Int(1), "trees?": [str],
    "quant?": {"scheme": str, "block_size?": Int(1)}, "graphs": Map(GRAPH_SCHEMA),
    "weights?": {"file": FILE_NAME, "sha256": SHA256, "bytes": Int(0), "initializers?": Map([TABLE_ROW])},
    "think_ids": [Int(-1), Int(-1)], "eos_ids": [Int(0)], "tokenizer?": FILE_NAME, "tokenizer_files?": Map(SHA256),
    "cache?": {"rows_per_sequence?": Int(1), "dtype?": str},
}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_digest(raw: dict[str, Any]) -> str:
    """SHA-256 of a manifest's canonical JSON without its own digest field."""
    body = {k: v for k, v in raw.items() if k != MANIFEST_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(raw: dict[str, Any]) -> dict[str, Any]:
    """The manifest with its digest (MANIFEST_DIGEST) set: written by the exporter, checked by verify_export."""
    return {**raw, MANIFEST_DIGEST: manifest_digest(raw)}


def check_seal(path: Path, raw: dict[str, Any]) -> None:
    """The manifest's fields are the ones the exporter wrote (its digest), else an MtpTrtError naming it."""
    if raw.get(MANIFEST_DIGEST) is None:
        raise MtpTrtError(f"{path}: has no field '{MANIFEST_DIGEST}' (written by an older mtp-trt, whose manifests "
                          f"are not covered by its integrity check); export again")
    if raw[MANIFEST_DIGEST] != manifest_digest(raw):
        raise MtpTrtError(f"{path}: SHA-256 of its fields differs from its field '{MANIFEST_DIGEST}'; the manifest "
                          f"was edited (export again)")


def read_manifest_json(path: Path, fmt: str, version: int, what: str, command: str) -> dict[str, Any]:
    """The JSON of an mtp-trt manifest, checked for its format and version (one clear error otherwise)."""
    from mtp_trt.validate import directory

    directory(path.parent, f"an mtp-trt {what} directory ({path.name})")
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


def check_files(manifest: Path, files: list[tuple[str, str]], verify_hashes: bool, origin: str) -> None:
    """Every (file, sha256) a manifest lists exists beside it and, if asked, still has that hash.  `origin`: what
    wrote the files ("export", "build"), for the message."""
    for name, digest in files:
        f = manifest.parent / name
        if not f.is_file():
            raise MtpTrtError(f"{manifest}: lists the file '{name}', which is missing")
        if verify_hashes and sha256(f) != digest:
            raise _changed(f, manifest, origin)


def _changed(f: Path, manifest: Path, origin: str) -> MtpTrtError:
    """A file whose hash is not its manifest's: named itself (a graph, weights.bin, a tokenizer file, an engine)."""
    return MtpTrtError(f"{f}: SHA-256 differs from {manifest.name}; {f.name} was modified, truncated or comes from "
                       f"another {origin}")


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _record_path(root: Path) -> Path:
    return cache_dir("verified", hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:24] + ".json")


def file_digests(root: Path) -> dict[str, str]:
    """The sha256 of each file directly in `root`, by name.  A file whose (size, mtime, ctime, inode, device)
    equal those recorded when it was last hashed is not read again (the record: cache_dir("digests"), best
    effort), so that a checkpoint is read in full once per change of a file, not once per run."""
    record_path = cache_dir("digests", hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:24] + ".json")
    try:
        record = parse_json(record_path.read_bytes(), str(record_path))
    except (OSError, MtpTrtError):
        record = {}
    known = record.get("files") if isinstance(record, dict) and record.get("root") == str(root.resolve()) else {}
    known = known if isinstance(known, dict) else {}
    digests, seen, hashed = {}, {}, False
    for f in sorted(root.iterdir()):
        if not f.is_file():
            continue
        key = _stat_key(f)
        entry = known.get(f.name)
        if isinstance(entry, list) and entry[:-1] == key and isinstance(entry[-1], str):
            digests[f.name] = entry[-1]
        else:
            digests[f.name], hashed = sha256(f), True
            key = _stat_key(f)
        seen[f.name] = key + [digests[f.name]]
    if hashed or set(seen) != set(known):
        try:
            write_atomic(record_path, json.dumps({"root": str(root.resolve()), "files": seen}).encode())
        except OSError:
            pass
    return digests


def verify_files(manifest: Path, files: list[tuple[str, str]], origin: str, force: bool = False) -> dict:
    """Check that each (file, sha256) listed by `manifest` (a manifest file's path) has that hash.  A file
    whose (size, mtime, ctime, inode, device) equal those recorded when it last hashed to the same digest is
    not read again, unless `force`.  Returns {"files", "hashed", "bytes_hashed", "seconds"}; a mismatch is an
    MtpTrtError naming the file.  The record lives in cache_dir("verified") (best effort: an unwritable cache
    only means hashing again next time)."""
    t0 = time.perf_counter()
    root = manifest.parent
    record_path = _record_path(root)
    try:
        record = parse_json(record_path.read_bytes(), str(record_path)) if not force else {}
    except (OSError, MtpTrtError):
        record = {}
    known = record.get("files") if isinstance(record, dict) and record.get("root") == str(root.resolve()) else {}
    known = known if isinstance(known, dict) else {}
    check_files(manifest, files, False, origin)
    verified, hashed, nbytes = {}, 0, 0
    for name, digest in files:
        f = root / name
        key = _stat_key(f)
        if known.get(name) == key + [digest]:
            verified[name] = known[name]
            continue
        hashed, nbytes = hashed + 1, nbytes + key[0]
        if sha256(f) != digest:
            raise _changed(f, manifest, origin)
        verified[name] = _stat_key(f) + [digest]
    if hashed:
        try:
            write_atomic(record_path, json.dumps({"root": str(root.resolve()), "files": verified}).encode())
        except OSError:
            pass
    return {"files": len(files), "hashed": hashed, "bytes_hashed": nbytes,
            "seconds": round(time.perf_counter() - t0, 4)}


def verify_export(manifest: Manifest, force: bool = False) -> dict:
    """verify_files for an export: every graph, weights.bin and the tokenizer files (see verify_files for the
    cost), after the manifest's own fields (its seal: the config, the weight-offset table, the token ids...)."""
    check_seal(manifest.root / "manifest.json", manifest.raw)
    return verify_files(manifest.root / "manifest.json", manifest.files, "export", force)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # one of contract.TENSOR_DTYPES
    shape: list[int | str]  # symbolic dims by name: B, S, T, ...


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    name: str  # target | mtp_0 | mtp_1 ...
    file: str
    sha256: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    kv_inputs: list[str]  # the persistent cache inputs, one per layer of this graph
    kv_outputs: list[str]  # same order: onnx lowering, the new rows to write back; plugin, the aliased cache outputs
    # plugin lowering's tree graphs: cache input -> an output of rows the runtime writes at past_len after the call
    commits: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, name: str, g: dict) -> GraphSpec:
        """One entry of the manifest's "graphs" (KeyError / TypeError where it is malformed)."""
        return cls(name=name, file=g["file"], sha256=g["sha256"], inputs=[TensorSpec(**t) for t in g["inputs"]],
                   outputs=[TensorSpec(**t) for t in g["outputs"]], kv_inputs=g["kv_inputs"],
                   kv_outputs=g["kv_outputs"], commits=g.get("commits", {}))


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
        return [mtp_graph(0 if self.mtp_mode == "eagle" else k) for k in range(self.nextn)]

    @classmethod
    def load(cls, root: str | Path, verify_hashes: bool = False) -> Manifest:
        root = Path(root)
        path = root / "manifest.json"
        raw = read_manifest_json(path, FORMAT, FORMAT_VERSION, "export", "mtp-trt export")
        m = cls.from_raw(root, raw, str(path))
        if verify_hashes:
            check_seal(path, raw)
        check_files(path, m.files, verify_hashes, "export")
        return m

    @classmethod
    def from_raw(cls, root: Path, raw: Any, source: str) -> Manifest:
        """A manifest from its parsed JSON: every field typed (MANIFEST_SCHEMA) and consistent, else one
        MtpTrtError naming `source` and the field."""
        check_fields(raw, MANIFEST_SCHEMA, source)
        graphs = {name: GraphSpec.from_dict(name, g) for name, g in raw["graphs"].items()}
        m = cls(root=root, raw=raw, config=ModelConfig.from_dict(raw["config"], source=f"{source} (config)"),
                nextn=raw["nextn"], mtp_mode=raw["mtp_mode"], dtype=raw["dtype"], lowering=raw["lowering"],
                max_batch=raw["max_batch"], max_seq_len=raw["max_seq_len"], graphs=graphs,
                think_ids=tuple(raw["think_ids"]), eos_ids=tuple(raw["eos_ids"]), tokenizer=raw.get("tokenizer"))
        _check_consistency(Path(source), m)
        return m

    @property
    def quant(self) -> Scheme:
        """The weights' quantization (mtp_trt/quant.py; exports without the field: none)."""
        raw = self.raw.get("quant", {"scheme": "none"})
        try:
            return scheme(raw["scheme"], raw.get("block_size"))
        except (MtpTrtError, TypeError, KeyError) as e:
            raise MtpTrtError(f"{self.root / 'manifest.json'}: field 'quant' is {raw!r}, not a quantization this "
                              f"mtp-trt reads ({e}); export again") from None

    @property
    def files(self) -> list[tuple[str, str]]:
        """(file, sha256) of every graph, the shared weights.bin and the tokenizer files (older exports: fewer)."""
        weights = self.raw.get("weights")
        weights = [(weights["file"], weights["sha256"])] if isinstance(weights, dict) else []
        tokenizer = list((self.raw.get("tokenizer_files") or {}).items())
        return [(g.file, g.sha256) for g in self.graphs.values()] + weights + tokenizer


def _check_consistency(path: Path, m: Manifest) -> None:
    """The manifest agrees with itself (its fields' types are MANIFEST_SCHEMA's): every graph that nextn and the
    mode need is listed; the caches' dtype is the manifest's dtype; token ids within the vocabulary; the
    weight-offset table within weights.bin.  One error naming the field otherwise."""
    def bad(field: str, msg: str) -> MtpTrtError:
        return MtpTrtError(f"{path}: field '{field}' {msg}; the manifest was edited or the export is incomplete "
                           f"(export again)")

    cache = m.raw.get("cache")
    for field, key, value in (("max_seq_len", "rows_per_sequence", m.max_seq_len), ("dtype", "dtype", m.dtype)):
        if isinstance(cache, dict) and key in cache and cache[key] != value:
            raise bad(field, f"is {value!r}, but cache.{key} is {cache[key]!r}")
    if m.max_seq_len > m.config.max_position_embeddings:
        raise bad("max_seq_len", f"is {m.max_seq_len}, beyond the config's max_position_embeddings "
                                 f"{m.config.max_position_embeddings}")
    if m.nextn >= len(m.graphs):  # at least target and step_0..step_nextn
        raise bad("nextn", f"is {m.nextn}, but only {len(m.graphs)} graphs are listed")
    need = [TARGET, *dict.fromkeys(m.mtp_graphs), *(step_graph(n) for n in range(m.nextn + 1))]
    missing = [g for g in need if g not in m.graphs]
    if missing:
        raise bad("nextn", f"is {m.nextn} ({m.mtp_mode}), but graph(s) {', '.join(missing)} are not listed")
    vocab = m.config.vocab_size
    for field, ids in (("think_ids", [i for i in m.think_ids if i != -1]), ("eos_ids", m.eos_ids)):
        if any(i >= vocab for i in ids):
            raise bad(field, f"is {list(getattr(m, field))}, but the config's vocab_size is {vocab}")
    tokenizer_files = m.raw.get("tokenizer_files")
    for name in tokenizer_files or {}:
        if not FILE_NAME.pattern.fullmatch(name):
            raise bad("tokenizer_files", f"names {name!r}, which is not a plain file name in the export directory")
    if m.tokenizer is not None and tokenizer_files is not None and m.tokenizer not in tokenizer_files:
        raise bad("tokenizer", f"is {m.tokenizer!r}, which tokenizer_files does not list (nor hash)")
    weights = m.raw.get("weights") or {}
    for file, rows in (weights.get("initializers") or {}).items():
        if file not in {g.file for g in m.graphs.values()}:
            raise bad("weights.initializers", f"lists {file!r}, which is not a graph of the export")
        for name, offset, nbytes, *_ in rows:
            if offset + nbytes > weights["bytes"]:
                raise bad("weights.initializers", f"puts {file} tensor {name!r} at bytes {offset}..{offset + nbytes}, "
                                                  f"beyond weights.bytes {weights['bytes']}")
    m.quant  # noqa: B018 (an unreadable 'quant' field fails here, naming it)
    for g in m.graphs.values():
        for t in g.inputs:
            if t.name in g.kv_inputs and t.dtype != m.dtype:
                raise bad("dtype", f"is {m.dtype!r}, but graph {g.name!r} input {t.name!r} is {t.dtype}")
