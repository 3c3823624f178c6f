"""Hugging Face checkpoints <-> the reference model: streaming safetensors load, FP8 block dequant, save.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`.  Tensor names are DeepSeek's; MTP module k (0-based) is stored as
`model.layers.{num_hidden_layers + k}.*`.  Every tensor in the checkpoint is either read or one of the
documented skips (`skipped_tensor`): an MTP layer's copies of the shared embedding and output head
(`embed_tokens`, `shared_head.head`), the MTP layers beyond the modules loaded (up to
num_nextn_predict_layers), `lm_head.weight` when tie_word_embeddings, and `rotary_emb.inv_freq`
buffers; any other tensor is an error naming it (never dropped: it would be a part of the model that
mtp-trt does not compute, such as DeepSeek-V3.2's indexer).  FP8 weights (`float8_e4m3fn` with a float32
`weight_scale_inv` per 128x128 block, as in the official V3/R1 checkpoints) are dequantized as they
are read.  Tensors are read one at a time, by plain file reads (no memory map), checked against the
config from the files' headers first (CheckpointTensors): `load_checkpoint` copies each into the
model's preallocated parameters (peak: the model plus one tensor); the exporter asks for each tensor
when it writes what depends on it, holding no model at all (exporters/streaming.py).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from mtp_trt.config import ModelConfig
from mtp_trt.contract import BY_SAFETENSORS
from mtp_trt.errors import MtpTrtError
from mtp_trt.fsutil import atomic_directory
from mtp_trt.validate import safetensors_files, safetensors_header
from mtp_trt.exporters.model import DeepseekV3, rope_tables

Tensor = torch.Tensor
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what an FP8 weight's block scales may be stored as
ST_DTYPES = {name: d.torch_dtype() for name, d in BY_SAFETENSORS.items()}
# Each floating dtype as unsigned integers of its width, and the bits all set in a NaN or an infinity (the exponent;
# e4m3fn has no infinities and one NaN code per sign, S.1111.111): what the streamed scan looks for.
NON_FINITE_BITS = {torch.float64: (np.uint64, 0x7FF0_0000_0000_0000), torch.float32: (np.uint32, 0x7F80_0000),
                   torch.float16: (np.uint16, 0x7C00), torch.bfloat16: (np.uint16, 0x7F80),
                   torch.float8_e5m2: (np.uint8, 0x7C), torch.float8_e4m3fn: (np.uint8, 0x7F)}
SCAN_CHUNK = 1 << 24  # bytes read at a time by the scan


# ----------------------------------------------------------------------------------------- FP8
def dequantize_fp8(weight: Tensor, scale_inv: Tensor, block: tuple[int, int] = (128, 128)) -> Tensor:
    """weight [O, I] fp8, scale_inv [ceil(O/bo), ceil(I/bi)] -> float32 [O, I] = weight * scale per block."""
    (o, i), (bo, bi) = weight.shape, block
    problem = _scale_shape_problem(weight.shape, scale_inv.shape, block)
    if problem:
        raise ValueError(problem)
    scale = scale_inv.float().repeat_interleave(bo, 0)[:o].repeat_interleave(bi, 1)[:, :i]
    return weight.float() * scale


def _scale_shape_problem(weight_shape, scale_shape, block: tuple[int, int]) -> str | None:
    (o, i), (bo, bi) = weight_shape, block
    want = (-(-o // bo), -(-i // bi))
    if tuple(scale_shape) != want:
        return f"scale_inv has shape {tuple(scale_shape)}, expected {want} for a {o}x{i} weight"
    return None


def quantize_fp8(weight: Tensor, block: tuple[int, int] = (128, 128)) -> tuple[Tensor, Tensor]:
    """The official layout's inverse: float [O, I] -> (float8_e4m3fn [O, I], float32 scale_inv per block)."""
    (o, i), (bo, bi) = weight.shape, block
    w = weight.float()
    padded = torch.zeros(-(-o // bo) * bo, -(-i // bi) * bi)
    padded[:o, :i] = w
    amax = padded.unflatten(0, (-1, bo)).unflatten(2, (-1, bi)).abs().amax(dim=(1, 3))  # [O/bo, I/bi]
    scale_inv = (amax / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    full = scale_inv.repeat_interleave(bo, 0)[:o].repeat_interleave(bi, 1)[:, :i]
    return (w / full).to(torch.float8_e4m3fn), scale_inv


# ------------------------------------------------------------------------------------ names
def checkpoint_names(model: DeepseekV3) -> dict[str, Tensor]:
    """Checkpoint tensor name -> the model's parameter (MTP module k renamed to model.layers.{N+k})."""
    n = model.cfg.num_hidden_layers
    out = {}
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            k, rest = name[4:].split(".", 1)
            name = f"model.layers.{n + int(k)}.{rest}"
        out[name] = p
    return out


def skipped_tensor(cfg: ModelConfig, modules: int) -> Callable[[str], bool]:
    """Whether a checkpoint tensor the model does not read is a documented skip (module docstring) for a model
    with `modules` MTP modules loaded."""
    n, declared = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
    layer = re.compile(r"model\.layers\.(\d+)\.(.+)")

    def skip(name: str) -> bool:
        if name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            return True
        m = layer.fullmatch(name)
        k = int(m[1]) - n if m else -1
        if not 0 <= k < declared:
            return False
        return k >= modules or m[2].startswith(("embed_tokens.", "shared_head.head."))

    return skip


def _shard_map(ckpt: Path) -> dict[str, Path]:
    """Tensor name -> file, from the index or the single file's header (validate.safetensors_files)."""
    files = safetensors_files(ckpt)
    if files is None:
        raise MtpTrtError(f"{ckpt}: no model.safetensors or model.safetensors.index.json")
    index = ckpt / "model.safetensors.index.json"
    for f in sorted(set(files.values())):
        if not f.is_file():
            raise MtpTrtError(f"{index}: names shard '{f.name}', which is not in {ckpt}")
    return files


def _header(path: Path) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """A safetensors file's table (validate.safetensors_header) with torch dtypes."""
    return {name: (ST_DTYPES[dtype], shape, begin, end)
            for name, (dtype, shape, begin, end) in safetensors_header(path).items()}


def _read(path: Path, entry: tuple[torch.dtype, list[int], int, int]) -> Tensor:
    """One tensor by plain reads into fresh memory (no memory map: nothing stays resident once it is dropped)."""
    dtype, shape, begin, end = entry
    buf = torch.empty(end - begin, dtype=torch.uint8)
    view, done = memoryview(buf.numpy()), 0
    try:
        with open(path, "rb", buffering=0) as f:
            f.seek(begin)
            while done < len(view):
                got = f.readinto(view[done:])
                if not got:
                    raise OSError(f"file ends at byte {begin + done} (truncated?)")
                done += got
    except OSError as e:
        raise MtpTrtError(f"{path}: cannot read tensor bytes {begin}..{end}: {e}") from None
    return buf.view(dtype).reshape(shape)


def _scan(path: Path, name: str, entry: tuple[torch.dtype, list[int], int, int], positive: bool = False,
          limit: float | None = None) -> None:
    """CheckpointTensors.scan of one tensor: its bytes read SCAN_CHUNK at a time (never the whole tensor), each
    value's bits tested as unsigned integers; `positive`: every value > 0 (a block scale); `limit`: every
    magnitude at most this."""
    dtype, _, begin, end = entry
    uint, nan_bits = NON_FINITE_BITS[dtype]
    width = np.dtype(uint).itemsize
    sign = uint(1 << (8 * width - 1))
    buf = np.empty(SCAN_CHUNK // width, uint)
    bad = nonpositive = beyond = 0
    with open(path, "rb", buffering=0) as f:
        f.seek(begin)
        left = end - begin
        while left:
            view = buf[: min(left, SCAN_CHUNK) // width]
            got = f.readinto(memoryview(view).cast("B"))
            if got != view.nbytes:
                raise MtpTrtError(f"{path}: cannot read tensor '{name}': the file ends early (truncated?)")
            left -= got
            bad += int(np.count_nonzero(view & uint(nan_bits) == uint(nan_bits)))
            if positive:
                nonpositive += int(np.count_nonzero(((view & sign) != 0) | ((view & ~sign) == 0)))
            if limit is not None:
                values = torch.from_numpy(view.view(f"i{width}")).view(dtype)
                beyond += int((values.float().abs() > limit).sum())
    if bad:
        raise MtpTrtError(f"{path}: tensor '{name}' holds {bad} NaN or infinite value(s) (as "
                          f"{str(dtype).removeprefix('torch.')}); refusing a checkpoint whose weights are not finite")
    if nonpositive:
        raise MtpTrtError(f"{path}: tensor '{name}' holds {nonpositive} block scale(s) <= 0; an FP8 weight's scales "
                          f"must be positive (a zero scale would zero its block)")
    if beyond:
        raise MtpTrtError(f"{path}: tensor '{name}' holds {beyond} value(s) beyond {limit:g}, the largest of the "
                          f"export's dtype; export with a wider --dtype (fp32 or bf16)")


def _some(names: list[str], shown: int = 5) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


class CheckpointTensors:
    """A checkpoint's tensors by the model's names, each read when asked for (one at a time: the caller holds
    what it keeps), fp8 dequantized with its block scales and cast to `dtype`.  Every name, dtype and shape is
    checked against `expected` (name -> shape) from the headers alone, before anything is read; so is every
    tensor `expected` does not name: it must be an FP8 weight's scale or a documented skip (`skip`, from
    skipped_tensor), else it is an error naming it."""

    def __init__(self, ckpt: Path, expected: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 block: tuple[int, int] = (128, 128), skip: Callable[[str], bool] = lambda name: False,
                 architecture: str = "the model"):
        self.ckpt, self.dtype, self.block = ckpt, dtype, block
        files = _shard_map(ckpt)
        missing = [name for name in expected if name not in files]
        if missing:
            raise MtpTrtError(f"{ckpt}: missing tensor(s) {_some(missing)}")
        headers: dict[Path, dict] = {}
        self.entries: dict[str, tuple] = {}  # name -> (file, entry, (file, scale entry) or None)

        def entry(name: str):
            path = files[name]
            if path not in headers:
                headers[path] = _header(path)
            if name not in headers[path]:
                raise MtpTrtError(f"{path}: has no tensor '{name}' (the checkpoint's index puts it there)")
            return path, headers[path][name]

        for name, shape in expected.items():
            path, e = entry(name)
            scale = None
            if e[0] in FP8_DTYPES:
                if name + "_scale_inv" not in files:
                    raise MtpTrtError(f"{path}: FP8 tensor '{name}' has no '{name}_scale_inv'")
                scale = entry(name + "_scale_inv")
                if scale[1][0] not in SCALE_DTYPES:
                    raise MtpTrtError(f"{scale[0]}: tensor '{name}_scale_inv' has dtype "
                                      f"{str(scale[1][0]).removeprefix('torch.')}, expected float32, bf16 or fp16 "
                                      f"(the block scales of the FP8 weight '{name}')")
                problem = _scale_shape_problem(e[1], scale[1][1], block)
                if problem:
                    raise MtpTrtError(f"{path}: tensor '{name}_scale_inv': {problem}")
            elif not e[0].is_floating_point:
                raise MtpTrtError(f"{path}: tensor '{name}' has dtype {str(e[0]).removeprefix('torch.')}, "
                                  f"expected a floating-point type (fp32, fp16, bf16 or fp8)")
            if tuple(e[1]) != tuple(shape):
                raise MtpTrtError(f"{path}: tensor '{name}' has shape {list(e[1])}, expected {list(shape)} "
                                  f"from {ckpt / 'config.json'}")
            self.entries[name] = (path, e, scale)
        read = set(expected) | {name + "_scale_inv" for name, (_, _, scale) in self.entries.items() if scale}
        unused = sorted((name for name in files if name not in read and not skip(name)), key=_natural)
        if unused:
            raise MtpTrtError(f"{ckpt}: {len(unused)} tensor(s) that {architecture} as mtp-trt reads it does not "
                              f"use: {_some(unused, 3)}; refusing rather than ignoring them")

    def scan(self) -> None:
        """Read every tensor once, a chunk at a time, before any work: NaN or infinite values (FP8 NaN codes
        included), block scales that are not positive, and values beyond the range of this reader's dtype (a
        float32 weight of 1e5 read as fp16) are each an MtpTrtError naming the tensor."""
        for name, (path, e, scale) in self.entries.items():
            limit = None if e[0] in FP8_DTYPES or torch.finfo(e[0]).max <= torch.finfo(self.dtype).max else \
                torch.finfo(self.dtype).max
            _scan(path, name, e, limit=limit)
            if scale is not None:
                _scan(scale[0], name + "_scale_inv", scale[1], positive=True)

    def get(self, name: str, dtype: torch.dtype | None = None) -> Tensor:
        """The tensor in `dtype` (default: this reader's)."""
        path, e, scale = self.entries[name]
        t = _read(path, e)
        if scale is not None:
            t = dequantize_fp8(t, _read(*scale), self.block)
        return self._finite(name, path, t.to(dtype or self.dtype))

    def is_fp8(self, name: str) -> bool:
        """Whether the checkpoint stores the tensor as float8 e4m3fn with block scales (from the headers)."""
        path, e, scale = self.entries[name]
        return scale is not None and e[0] == torch.float8_e4m3fn

    def fp8(self, name: str) -> tuple[Tensor, Tensor] | None:
        """An FP8 tensor as stored: (float8 e4m3fn [O, I], float32 scale_inv per `self.block` block); None where the
        checkpoint stores it in float (or as e5m2)."""
        if not self.is_fp8(name):
            return None
        path, e, scale = self.entries[name]
        codes = _read(path, e)
        self._finite(name, path, codes.view(torch.uint8) & 0x7F != 0x7F)  # e4m3's NaN codes
        return codes, self._finite(name + "_scale_inv", scale[0], _read(*scale).float())

    @staticmethod
    def _finite(name: str, path: Path, t: Tensor) -> Tensor:
        """t, or an MtpTrtError where it holds NaN or infinite values (a bool t: where it is False)."""
        ok = t if t.dtype == torch.bool else torch.isfinite(t)
        if not ok.all():
            bad = int((~ok).sum())
            what = "float8_e4m3fn" if t.dtype == torch.bool else str(t.dtype).removeprefix("torch.")
            raise MtpTrtError(f"{path}: tensor '{name}' holds {bad} NaN or infinite value(s) (as {what}); "
                              f"refusing a checkpoint whose weights are not finite")
        return t


def _natural(name: str) -> list:
    """Sort key: layer numbers as numbers (model.layers.2 before model.layers.10)."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def checkpoint_tensors(ckpt: Path, cfg: ModelConfig, model: DeepseekV3, dtype: torch.dtype) -> CheckpointTensors:
    """The checkpoint's tensors for `model` (its MTP modules included), every other tensor a documented skip."""
    return CheckpointTensors(ckpt, {name: tuple(p.shape) for name, p in checkpoint_names(model).items()}, dtype,
                             cfg.fp8_block_size or (128, 128), skipped_tensor(cfg, model.nextn), cfg.architecture)


# ------------------------------------------------------------------------------------- load
def load_checkpoint(ckpt: str | Path, nextn: int | None = None, dtype: torch.dtype = torch.float32,
                    max_positions: int | None = None) -> DeepseekV3:
    """Load a Hugging Face checkpoint of a supported architecture (mtp_trt/config.py) with `nextn` MTP modules
    (default: all it declares)."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise MtpTrtError(f"{ckpt}: checkpoint directory not found")
    cfg = ModelConfig.from_file(ckpt / "config.json")
    nextn = cfg.num_nextn_predict_layers if nextn is None else nextn
    if not 0 <= nextn <= cfg.num_nextn_predict_layers:
        raise MtpTrtError(f"{ckpt / 'config.json'}: asked for {nextn} MTP modules but num_nextn_predict_layers "
                          f"is {cfg.num_nextn_predict_layers}")
    with torch.device("meta"):
        model = DeepseekV3(cfg, nextn=nextn, max_positions=1).to(dtype)
    tensors = checkpoint_tensors(ckpt, cfg, model, dtype)
    try:
        model = model.to_empty(device="cpu")
        if cfg.tie_word_embeddings:  # to_empty gives every module its own tensors: tie the head again
            model.lm_head.weight = model.model.embed_tokens.weight
        cos, sin = rope_tables(cfg, max_positions or cfg.max_position_embeddings)
    except (RuntimeError, MemoryError) as e:  # torch's allocator: a config far beyond this machine's memory
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise MtpTrtError(f"{ckpt / 'config.json'}: cannot allocate the model ({first[:200]})") from None
    model.rope_cos, model.rope_sin = cos, sin
    with torch.no_grad():
        for name, p in checkpoint_names(model).items():
            p.copy_(tensors.get(name))
    return model.eval()


# ------------------------------------------------------------------------------------- save
def save_checkpoint(model: DeepseekV3, out: str | Path, config: dict, extra_files: dict[str, Path] | None = None,
                    dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors (MTP modules as model.layers.{N+k}) atomically.

    `config` is the HF config dict to write (num_nextn_predict_layers is set to the model's nextn);
    `extra_files` maps names in the output directory to files copied beside the weights."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise MtpTrtError(f"{out}: output directory is not empty")
    tensors = {}
    for name, p in checkpoint_names(model).items():
        t = p.detach()
        tensors[name] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous().clone()
    with atomic_directory(out) as tmp:
        cfg = dict(config, num_nextn_predict_layers=model.nextn)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, tmp / name)
    return out
