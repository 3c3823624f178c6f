"""Checks of command-line values and input files made before any work: one MtpTrtError naming the flag,
file or value, so that nothing runs (or is written) on input that makes no sense.  No torch import.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from mtp_trt.contract import BY_SAFETENSORS
from mtp_trt.errors import MtpTrtError
from mtp_trt.fsutil import Int, Map, check_fields, parse_json, read_json

# The optional packages, each with the extra of pyproject.toml that installs it.
EXTRAS = {"torch": "cpu", "onnx": "cpu", "transformers": "dev", "matplotlib": "dev", "fastapi": "serve",
          "uvicorn": "serve", "prometheus_client": "serve", "jinja2": "serve"}
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


# TensorRT, either flavour (mtp_trt/trt/compat.py), and the extras that install it.
TENSORRT_MODULES = ("tensorrt", "tensorrt_rtx")
TENSORRT_EXTRAS = ('"mtp-trt[rtx]" (TensorRT for RTX, which builds without a GPU too) or "mtp-trt[gpu]" (TensorRT '
                   'for data-centre GPUs)')
# The valid values of run's, serve's and bench's --quant (fp8 exports are for TensorRT engines: `export --quant fp8`).
RUN_QUANT = ("none", "int8", "int4")


def words(items, last: str = "and") -> str:
    """'a', 'a and b', 'a, b and c'."""
    items = [str(x) for x in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {last} {items[-1]}"


def missing_extra(what: str, *modules: str, tensorrt: bool = False) -> MtpTrtError:
    """The error of a job that needs optional packages not installed (`modules`; with `tensorrt`, TensorRT too):
    every one of them, and the extras that install them."""
    modules = [m.split(".")[0] for m in modules]
    extras = list(dict.fromkeys(EXTRAS[m] for m in modules if m in EXTRAS))
    others = [m for m in modules if m not in EXTRAS]
    how = ([f'pip install "mtp-trt[{",".join(extras)}]"'] if extras else []) + \
          ([f"pip install {' '.join(others)}"] if others else []) + \
          ([f"TensorRT: pip install {TENSORRT_EXTRAS}"] if tensorrt else [])
    names = modules + (["TensorRT"] if tensorrt else [])
    return MtpTrtError(f"{what} needs {words(names)}, which {'is' if len(names) == 1 else 'are'} not installed: "
                       f"{'; '.join(how)}")


def require(what: str, *modules: str, tensorrt: bool = False) -> None:
    """Before any work: `what` (a job, in words) needs `modules` (and, with `tensorrt`, TensorRT or TensorRT for
    RTX); those missing are one MtpTrtError naming every one and the extras that install them (missing_extra)."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    no_tensorrt = tensorrt and not any(importlib.util.find_spec(m) for m in TENSORRT_MODULES)
    if missing or no_tensorrt:
        raise missing_extra(what, *missing, tensorrt=no_tensorrt)


def check_choice(flag: str, value, choices, what: str = "value") -> None:
    """`value` one of `choices`, else one MtpTrtError naming the flag and listing them (as the flag's help does)."""
    if value not in choices:
        raise MtpTrtError(f"{flag}: unknown {what} {value!r}; expected one of {', '.join(map(str, choices))}")


def directory(path: Path, what: str, hub: bool = False) -> Path:
    """`path`, a directory: else one MtpTrtError saying that nothing is there or that it is a file, and what was
    expected (a mistyped path reads as one, not as a directory of the wrong kind).  With `hub`, a path where
    nothing is that reads as a Hugging Face repo id (ORG/NAME, ORG/NAME@REVISION) is its downloaded snapshot
    (mtp_trt.hub)."""
    if hub:
        from mtp_trt import hub as hf

        if (named := hf.repo_id(path)) is not None:
            return hf.download(*named)
    if not path.exists():
        shown = str(path)
        url = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):/(?!/)", shown)  # a URL, its "//" made one by Path
        if url and url.group(1).lower() in ("http", "https", "hf", "s3", "gs", "ftp", "file"):
            shown = f"{url.group(1)}://{shown[url.end():]}"
            raise MtpTrtError(f"{shown}: a URL; mtp-trt reads a local directory, expected {what}")
        raise MtpTrtError(f"{shown}: no such file or directory; expected {what}")
    if not path.is_dir():
        raise MtpTrtError(f"{path}: is a file, not a directory; expected {what}")
    return path


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
    for flag, value in (("--top-k", top_k), (relaxed_source, relaxed_topk)):
        if not 0 <= value <= 2**31 - 1:
            raise MtpTrtError(f"{flag} must be in 0..{2**31 - 1}, got {value}")
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
    """A command-line string that must be text, as text: the bytes of an argument Python could not decode (they
    reach it as surrogate escapes: under LC_ALL=C, any byte beyond ASCII) are read as UTF-8; bytes that are not
    UTF-8 are an error naming the first."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raw = os.fsencode(text)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise MtpTrtError(f"{flag} {raw!r}: not valid UTF-8 (byte {raw[e.start]:#04x} at offset {e.start})"
                              ) from None
    return text


def read_prompt_file(path: Path) -> list[str]:
    """The prompts of a UTF-8 text file (`-`: standard input), one per line: lines end at "\\n" alone (a "\\r"
    before it, from a Windows file, is dropped; form feeds, U+2028 and other Unicode line breaks stay inside
    their prompt), a byte-order mark at the start is dropped, blank lines are skipped."""
    import sys

    if str(path) == "-":
        data, where = sys.stdin.buffer.read(), "<stdin>"
    else:
        if not path.exists():
            raise MtpTrtError(f"{path}: prompt file not found")
        if not path.is_file():
            raise MtpTrtError(f"{path}: --prompt-file must be a file, but this is a directory"
                              if path.is_dir() else f"{path}: --prompt-file must be a regular file")
        try:
            data, where = path.read_bytes(), str(path)
        except OSError as e:
            raise MtpTrtError(f"{path}: cannot read the prompt file ({e.strerror})") from None
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise MtpTrtError(f"{where}: not UTF-8 text (byte {data[e.start]:#04x} on line {line})") from None
    lines = (line.removesuffix("\r") for line in text.split("\n"))
    return [line for line in lines if line.strip()]


def check_stop(stop: list[str]) -> list[str]:
    """The stop strings, as text (text_arg)."""
    for s in stop:
        if not s:
            raise MtpTrtError("--stop must not be empty (an empty string would stop before any text)")
    return [text_arg("--stop", s) for s in stop]


def check_writable_file(path: Path, flag: str) -> None:
    """`path` can be written (created or replaced) by this process: checked before a long job, not after, by
    creating (and removing) a file beside it."""
    import tempfile

    text_arg(flag, str(path))  # its name is printed when written
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


def check_plot_format(path: Path, flag: str = "--plot") -> None:
    """`path`'s extension names an image format matplotlib writes (checked before a benchmark, not after)."""
    formats = ("png", "svg", "pdf", "jpg", "jpeg", "eps", "ps", "webp", "tif", "tiff")
    ext = path.suffix.lower().lstrip(".")
    if ext not in formats:
        raise MtpTrtError(f"{flag} {path}: unknown image format {ext or '(no extension)'!r}; give a file name "
                          f"ending in one of {', '.join('.' + f for f in formats)}")


def check_output_dir(out: Path, flag: str = "--out") -> None:
    """An output directory that may be created: absent or empty, under a parent that can be written, with a name
    that can be printed (UTF-8)."""
    text_arg(flag, str(out))
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


def check_dsa(cfg, ckpt: Path, lowering: str, moe_form: str | None, scheme) -> None:
    """DeepSeek Sparse Attention runs in the onnx lowering (ONNX Runtime: mtp-trt's CPU operators, or standard operators
    without them; quantized weights too, its indexer in float) and, unquantized, in the plugin lowering's
    MlaSparseAttention nodes (TensorRT) where every layer has its own indexer: the other requests are refused in one
    line (never exported with dense attention)."""
    if not cfg.dsa:
        return
    what = f"{ckpt / 'config.json'}: {cfg.architecture} (DeepSeek Sparse Attention)"
    shared = [i for i in range(cfg.num_hidden_layers) if not cfg.has_indexer(i)]
    if lowering == "plugin" and shared:
        raise MtpTrtError(f"--lowering plugin: {what}: layer(s) {', '.join(map(str, shared[:4]))} share the previous "
                          "layer's selection (indexer_types \"shared\"), which the TensorRT plugin does not take; "
                          "export with --lowering onnx")
    if moe_form == "tensorrt":
        raise MtpTrtError(f"--moe-form tensorrt: {what} is not supported in TensorRT engines; leave --moe-form out")
    if lowering == "plugin" and scheme.quantized:
        raise MtpTrtError(f"--quant {scheme.name} --lowering plugin: {what} has TensorRT engines with unquantized "
                          "weights only; leave --quant out, or export with --lowering onnx")


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
ST_ITEMSIZE = {name: d.itemsize for name, d in BY_SAFETENSORS.items()}
ST_ENTRY = {"dtype": str, "shape": [Int(0)], "data_offsets": [Int(0), Int(0)]}


def safetensors_header(path: Path) -> dict[str, tuple[str, list[int], int, int]]:
    """A .safetensors file's table, read without torch: name -> (dtype, shape, first byte, end byte) in the file,
    every entry typed and checked against the file's size (a truncated file is named here, not when its last
    tensor is read)."""
    source = f"{path}: safetensors header"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= min(size - 8, 100_000_000):
                raise MtpTrtError(f"{path}: cannot read safetensors header: header length {n} does not fit a "
                                  f"{size}-byte file")
            raw = parse_json(f.read(n), source)
    except OSError as e:
        raise MtpTrtError(f"{path}: cannot read safetensors header ({e.strerror or e})") from None
    check_fields(raw, Map(object), source)
    raw.pop("__metadata__", None)
    table = {}
    for name, e in raw.items():
        check_fields(e, ST_ENTRY, source, name)
        if e["dtype"] not in ST_ITEMSIZE:
            raise MtpTrtError(f"{source}: field '{name}.dtype' is {e['dtype']!r}, not a safetensors dtype "
                              f"({', '.join(ST_ITEMSIZE)})")
        (begin, end), nbytes = e["data_offsets"], math.prod(e["shape"]) * ST_ITEMSIZE[e["dtype"]]
        if end - begin != nbytes or 8 + n + end > size:
            raise MtpTrtError(f"{path}: cannot read safetensors header: tensor '{name}': bytes {begin}..{end} do "
                              f"not hold {e['shape']} {e['dtype']} within the file ({size} bytes; truncated?)")
        table[name] = (e["dtype"], e["shape"], 8 + n + begin, 8 + n + end)
    return table


def inside(root: Path, name: str, source: str, what: str) -> Path:
    """`root / name` where `name` (read from `source`) stays inside `root` once resolved (no absolute path, no
    `..`, no link out of it), else an MtpTrtError naming both."""
    path = root / name
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts or \
            not path.resolve().is_relative_to(root.resolve()):
        raise MtpTrtError(f"{source}: {what} {name!r} is not a file inside {root}; refusing to read outside it")
    return path


def safetensors_files(ckpt: Path) -> dict[str, Path] | None:
    """Tensor name -> the file holding it, from model.safetensors.index.json (its file names kept inside the
    checkpoint) or the single model.safetensors's header; None when the checkpoint has neither."""
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        raw = read_json(index, {"weight_map": Map(str)})
        files = {f: inside(ckpt, f, str(index), "weight_map names shard") for f in set(raw["weight_map"].values())}
        return {name: files[f] for name, f in raw["weight_map"].items()}
    single = ckpt / "model.safetensors"
    return dict.fromkeys(safetensors_header(single), single) if single.is_file() else None


def stored_tensor_names(ckpt: Path) -> set[str] | None:
    """Names of the tensors a checkpoint stores (index or single file); None when it has no weights file."""
    files = safetensors_files(ckpt)
    return None if files is None else set(files)


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


def machine_memory() -> int | None:
    """Bytes of memory this process may use: the machine's physical memory, or less where an address-space limit
    (ulimit -v, RLIMIT_AS) is set; None where the system says neither."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            limits.append(soft)
    except (ImportError, OSError, ValueError):
        pass
    return min(limits, default=None)


def check_memory(need: int, what: str) -> None:
    """Refuse, before anything is allocated, work that needs more memory at once than the machine has; `what`
    names the values that imply `need` bytes."""
    total = machine_memory()
    if total is not None and need > total:
        raise MtpTrtError(f"{what}: needs about {need / 2**30:,.1f} GiB at once, more than the "
                          f"{total / 2**30:,.1f} GiB of memory this process may use")


def cache_bytes(cfg, caches: int, batch: int, rows: int, bytes_per_value: int) -> int:
    """Bytes of `caches` persistent caches (one per layer: the latent and, DSA, the indexer's key) of `batch`
    sequences x `rows` rows (the runtime's, allocated once)."""
    return caches * batch * rows * cfg.cache_dim * bytes_per_value


def check_export_memory(cfg, bytes_per_value: int, what: str) -> None:
    """Refuse a model whose largest tensors cannot be held: the export streams the weights (streaming.py), holding
    at most about three copies of its largest tensor at once (the embedding, a MoE layer's stacked experts, a
    dense MLP's gate and up projections or an attention projection), whatever the model's total size."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    largest = max(cfg.vocab_size * d, 2 * cfg.intermediate_size * d,
                  2 * (cfg.n_routed_experts or 0) * cfg.moe_intermediate_size * d,
                  (cfg.q_lora_rank or d) * h * cfg.qk_head_dim, cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim +
                                                                                      cfg.v_head_dim),
                  h * cfg.v_head_dim * d, d * cfg.latent_dim)
    check_memory(3 * largest * bytes_per_value,
                 f"{what}: exporting its largest tensors (vocab_size {cfg.vocab_size}, hidden_size {d}, intermediate "
                 f"sizes {cfg.intermediate_size} / {cfg.moe_intermediate_size}, {h} heads)")


def quant_scheme(name: str | None, group_size: int | None):
    """`run`/`serve`/`bench`'s --quant (RUN_QUANT) and --group-size: a checked mtp_trt.quant.Scheme, or None where
    neither was given (a checkpoint is then exported unquantized; an export is used as it is)."""
    from mtp_trt import quant

    if name is None:
        if group_size is not None:
            raise MtpTrtError("--group-size needs --quant int8 or --quant int4")
        return None
    if name == "fp8":
        raise MtpTrtError(f"--quant fp8: FP8 weights are for TensorRT engines (mtp-trt export --quant fp8 --lowering "
                          f"plugin, then mtp-trt build); expected one of {', '.join(RUN_QUANT)}")
    check_choice("--quant", name, RUN_QUANT, "scheme")
    return quant.scheme(name, group_size)
