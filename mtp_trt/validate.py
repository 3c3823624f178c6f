"""Checks of command-line values and input files made before any work: one MtpTrtError naming the flag,
file or value, so that nothing runs (or is written) on input that makes no sense.  No torch import.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

from mtp_trt.errors import MtpTrtError

THREADS_PER_CORE = 4  # --threads beyond cores x this only oversubscribes (and 10^5 threads hang)
MAX_SEED = 2**63 - 1


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_threads(threads: int) -> None:
    top = usable_cores() * THREADS_PER_CORE
    if threads < 0:
        raise MtpTrtError(f"--threads must be >= 0 (0 = the usable cores), got {threads}")
    if threads > top:
        raise MtpTrtError(f"--threads must be at most {top} ({THREADS_PER_CORE} per usable core), got {threads}")


def check_number(flag: str, value: float, low: float | None = None, high: float | None = None) -> None:
    """A finite number within [low, high] (either bound optional)."""
    if not math.isfinite(value):
        raise MtpTrtError(f"{flag} must be a finite number, got {value}")
    if (low is not None and value < low) or (high is not None and value > high):
        span = f"in {low}..{high}" if low is not None and high is not None else \
            f">= {low}" if low is not None else f"<= {high}"
        raise MtpTrtError(f"{flag} must be {span}, got {value}")


def check_positive(flag: str, value: int) -> None:
    if value < 1:
        raise MtpTrtError(f"{flag} must be >= 1, got {value}")


def check_sampling(temperature: float, top_k: int, top_p: float, seed: int, relaxed_topk: int,
                   relaxed_delta: float, relaxed_source: str = "--relaxed-topk") -> None:
    """Sampling and acceptance flags: finite, in range, and not ones the chosen decoding would ignore."""
    check_number("--temperature", temperature, 0.0)
    check_number("--top-p", top_p)
    check_number("--relaxed-delta", relaxed_delta, 0.0)
    if not 0 <= seed <= MAX_SEED:
        raise MtpTrtError(f"--seed must be in 0..{MAX_SEED}, got {seed}")
    if temperature == 0 and (top_k or top_p != 1.0):
        flag = "--top-k" if top_k else "--top-p"
        raise MtpTrtError(f"{flag} applies only when sampling: give --temperature > 0 (greedy decoding, the "
                          f"default, takes the most likely token)")
    if temperature > 0 and relaxed_topk:
        raise MtpTrtError(f"{relaxed_source} (relaxed acceptance) applies only to greedy decoding; with "
                          f"--temperature > 0 drafts are accepted by lossless rejection sampling")


def text_arg(flag: str, text: str) -> str:
    """A command-line string that must be text: arguments with bytes that are not UTF-8 reach Python as
    surrogate escapes, which no tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raw = os.fsencode(text)
        try:
            raw.decode("utf-8")
            start = 0
        except UnicodeDecodeError as e:
            start = e.start
        raise MtpTrtError(f"{flag} {raw!r}: not valid UTF-8 (byte {raw[start]:#04x} at offset {start})") from None
    return text


def read_prompt_file(path: Path) -> list[str]:
    """The non-blank lines of a UTF-8 text file."""
    if not path.exists():
        raise MtpTrtError(f"{path}: prompt file not found")
    if not path.is_file():
        raise MtpTrtError(f"{path}: --prompt-file must be a file, but this is a directory"
                          if path.is_dir() else f"{path}: --prompt-file must be a regular file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise MtpTrtError(f"{path}: cannot read the prompt file ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise MtpTrtError(f"{path}: not UTF-8 text (byte {data[e.start]:#04x} on line {line})") from None
    return [line for line in text.splitlines() if line.strip()]


def check_stop(stop: list[str]) -> None:
    for s in stop:
        if not s:
            raise MtpTrtError("--stop must not be empty (an empty string would stop before any text)")
        text_arg("--stop", s)


def check_writable_file(path: Path, flag: str) -> None:
    """`path` can be written (created or replaced) by this process: checked before a long job, not after, by
    creating (and removing) a file beside it."""
    import tempfile

    if path.is_dir():
        raise MtpTrtError(f"{flag} {path}: is a directory; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise MtpTrtError(f"{flag} {path}: directory {parent} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", dir=parent)
        os.close(fd)
        os.unlink(probe)
        if path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise MtpTrtError(f"{flag} {path}: not writable ({e.strerror or e})") from None


def check_output_dir(out: Path, flag: str = "--out") -> None:
    """An output directory that may be created: absent or empty, under a parent that can be written."""
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise MtpTrtError(f"{out}: exists and is not a directory; choose another {flag} or remove it")
        if any(out.iterdir()):
            raise MtpTrtError(f"{out}: output directory exists and is not empty; choose another or remove it")
    import tempfile

    parent = out.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise MtpTrtError(f"{out}: cannot create the output directory ({parent} is not a directory)")
    try:  # a directory made and removed at once: what the export will do, tried before the work
        os.rmdir(tempfile.mkdtemp(prefix=".mtp-trt-probe-", dir=parent))
    except OSError as e:
        raise MtpTrtError(f"{out}: cannot create the output directory ({e.strerror or e})") from None


def merge_spec_config(spec, source: Path, nextn: int | None, mtp_mode: str | None, relaxed_topk: int,
                      relaxed_delta: float) -> tuple[int | None, str | None, int, float]:
    """Flags and a --config file together: a flag that contradicts the file is an error, not a silent choice."""
    pairs = (("--nextn", nextn, None, spec.nextn), ("--mtp-mode", mtp_mode, None, spec.mtp_mode),
             ("--relaxed-topk", relaxed_topk, 0, spec.relaxed_topk),
             ("--relaxed-delta", relaxed_delta, 0.0, spec.relaxed_delta))
    for flag, given, unset, from_file in pairs:
        if given != unset and from_file not in (None, 0, 0.0) and given != from_file:
            raise MtpTrtError(f"{flag} {given} contradicts {source}, which asks for {from_file}; give one of them")
    return (spec.nextn if nextn is None else nextn, mtp_mode or spec.mtp_mode, relaxed_topk or spec.relaxed_topk,
            relaxed_delta or spec.relaxed_delta)


# ------------------------------------------------------------------------------ checkpoint files
def safetensors_header(path: Path) -> dict:
    """The JSON header of a .safetensors file (tensor name -> {dtype, shape, data_offsets}), read without torch."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                raise ValueError(f"header length {n}")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise MtpTrtError(f"{path}: cannot read safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise MtpTrtError(f"{path}: cannot read safetensors header (not an object)")
    header.pop("__metadata__", None)
    return header


def stored_tensor_names(ckpt: Path) -> set[str] | None:
    """Names of the tensors a checkpoint stores (index or single file); None when it has no weights file."""
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        from mtp_trt.fsutil import read_json

        raw = read_json(index)
        if not isinstance(raw, dict) or not isinstance(raw.get("weight_map"), dict):
            raise MtpTrtError(f"{index}: not a safetensors index (needs a 'weight_map' object)")
        return set(raw["weight_map"])
    single = ckpt / "model.safetensors"
    return set(safetensors_header(single)) if single.is_file() else None


def stored_mtp_modules(ckpt: Path, num_hidden_layers: int) -> int | None:
    """How many consecutive MTP layers (model.layers.{N}, {N+1}, ...) the checkpoint stores; None: no weights."""
    names = stored_tensor_names(ckpt)
    if names is None:
        return None
    k = 0
    while any(n.startswith(f"model.layers.{num_hidden_layers + k}.") for n in names):
        k += 1
    return k


def check_mtp_modules(ckpt: Path, cfg) -> None:
    """The config's num_nextn_predict_layers must not promise more MTP modules than the weights hold."""
    stored = stored_mtp_modules(ckpt, cfg.num_hidden_layers)
    if stored is not None and stored < cfg.num_nextn_predict_layers:
        raise MtpTrtError(f"{ckpt / 'config.json'}: field 'num_nextn_predict_layers' is "
                          f"{cfg.num_nextn_predict_layers}, but the weights hold {stored} MTP layer(s) "
                          f"(model.layers.{cfg.num_hidden_layers}..); fix the config or the checkpoint")


def check_export_memory(cfg, bytes_per_value: int, what: str) -> None:
    """Refuse a model whose largest tensors cannot be held: the export streams the weights (streaming.py), holding
    at most about three copies of its largest tensor at once (the embedding, a MoE layer's stacked experts or
    a dense MLP's gate and up projections), whatever the model's total size."""
    largest = max(cfg.vocab_size * cfg.hidden_size, 2 * cfg.intermediate_size * cfg.hidden_size,
                  2 * (cfg.n_routed_experts or 0) * cfg.moe_intermediate_size * cfg.hidden_size)
    need = 3 * largest * bytes_per_value
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if need > total:
        raise MtpTrtError(f"{what}: exporting needs about {need / 2**30:,.1f} GiB at once for its largest tensors "
                          f"(vocab_size {cfg.vocab_size}, hidden_size {cfg.hidden_size}, intermediate sizes "
                          f"{cfg.intermediate_size} / {cfg.moe_intermediate_size}), more than this machine's "
                          f"{total / 2**30:,.1f} GiB of memory")


def quant_scheme(name: str | None, group_size: int | None):
    """`run`/`bench`'s --quant and --group-size: a checked mtp_trt.quant.Scheme, or None where neither was given
    (a checkpoint is then exported unquantized; an export is used as it is)."""
    from mtp_trt import quant

    if name is None:
        if group_size is not None:
            raise MtpTrtError("--group-size needs --quant int8 or --quant int4")
        return None
    return quant.scheme(name, group_size)
