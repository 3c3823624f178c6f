"""Hugging Face checkpoints <-> the reference model: streaming safetensors load, FP8 block dequant, save.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`.  Tensor names are DeepSeek's; MTP module k (0-based) is stored as
`model.layers.{num_hidden_layers + k}.*`, with its copies of the shared embedding and output head
(`embed_tokens`, `shared_head.head`) skipped.  FP8 weights (`float8_e4m3fn` with a float32
`weight_scale_inv` per 128x128 block, as in the official V3/R1 checkpoints) are dequantized as they
are read.  Tensors are read one at a time straight into the model's preallocated parameters, so the
peak memory is the model's size plus one tensor.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch

from mtp_trt.config import ModelConfig
from mtp_trt.errors import MtpTrtError
from mtp_trt.fsutil import atomic_directory
from mtp_trt.exporters.model import DeepseekV3, rope_tables

Tensor = torch.Tensor
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# ----------------------------------------------------------------------------------------- FP8
def dequantize_fp8(weight: Tensor, scale_inv: Tensor, block: tuple[int, int] = (128, 128)) -> Tensor:
    """weight [O, I] fp8, scale_inv [ceil(O/bo), ceil(I/bi)] -> float32 [O, I] = weight * scale per block."""
    (o, i), (bo, bi) = weight.shape, block
    want = (-(-o // bo), -(-i // bi))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale_inv has shape {tuple(scale_inv.shape)}, expected {want} for a {o}x{i} weight")
    scale = scale_inv.float().repeat_interleave(bo, 0)[:o].repeat_interleave(bi, 1)[:, :i]
    return weight.float() * scale


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


def _shard_map(ckpt: Path) -> dict[str, Path]:
    """Tensor name -> file, from the index or the single file's header."""
    index = ckpt / "model.safetensors.index.json"
    single = ckpt / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise MtpTrtError(f"{index}: not a safetensors index (needs a 'weight_map' object): {e}") from None
        files = {name: ckpt / f for name, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise MtpTrtError(f"{index}: names shard '{f.name}', which is not in {ckpt}")
        return files
    if single.is_file():
        from safetensors import safe_open

        try:
            with safe_open(single, "pt") as f:
                return {name: single for name in f.keys()}
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise MtpTrtError(f"{single}: cannot read safetensors header: {e}") from None
    raise MtpTrtError(f"{ckpt}: no model.safetensors or model.safetensors.index.json")


def _read_tensors(files: dict[str, Path], names: list[str]) -> Iterator[tuple[str, Tensor, Path]]:
    """Yield (name, tensor, file) one at a time, file by file; fp8 tensors dequantized with their scale."""
    from safetensors import safe_open

    with ExitStack() as stack:
        handles = {}

        def handle(path: Path):
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, "pt"))
            return handles[path]

        for name in sorted(names, key=lambda n: (str(files[n]), n)):
            path = files[name]
            t = handle(path).get_tensor(name)
            if t.dtype in FP8_DTYPES:
                scale_name = name + "_scale_inv"
                if scale_name not in files:
                    raise MtpTrtError(f"{path}: FP8 tensor '{name}' has no '{scale_name}'")
                scale = handle(files[scale_name]).get_tensor(scale_name)
                yield name, (t, scale), path
            else:
                yield name, t, path


# ------------------------------------------------------------------------------------- load
def load_checkpoint(ckpt: str | Path, nextn: int | None = None, dtype: torch.dtype = torch.float32,
                    max_positions: int | None = None) -> DeepseekV3:
    """Load a Hugging Face DeepSeek-V3 checkpoint with `nextn` MTP modules (default: all it declares)."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise MtpTrtError(f"{ckpt}: checkpoint directory not found")
    cfg = ModelConfig.from_file(ckpt / "config.json")
    nextn = cfg.num_nextn_predict_layers if nextn is None else nextn
    if not 0 <= nextn <= cfg.num_nextn_predict_layers:
        raise MtpTrtError(f"{ckpt / 'config.json'}: asked for {nextn} MTP modules but num_nextn_predict_layers "
                          f"is {cfg.num_nextn_predict_layers}")
    files = _shard_map(ckpt)
    with torch.device("meta"):
        model = DeepseekV3(cfg, nextn=nextn, max_positions=1).to(dtype)
    try:
        model = model.to_empty(device="cpu")
        cos, sin = rope_tables(cfg, max_positions or cfg.max_position_embeddings)
    except (RuntimeError, MemoryError) as e:  # torch's allocator: a config far beyond this machine's memory
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise MtpTrtError(f"{ckpt / 'config.json'}: cannot allocate the model ({first[:200]})") from None
    model.rope_cos, model.rope_sin = cos, sin

    params = checkpoint_names(model)
    missing = [name for name in params if name not in files]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise MtpTrtError(f"{ckpt}: missing tensor(s) {shown}")
    block = cfg.fp8_block_size or (128, 128)
    with torch.no_grad():
        for name, t, path in _read_tensors(files, list(params)):
            p = params[name]
            if isinstance(t, tuple):
                w, scale = t
                try:
                    t = dequantize_fp8(w, scale, block)
                except ValueError as e:
                    raise MtpTrtError(f"{path}: tensor '{name}_scale_inv': {e}") from None
            elif not t.is_floating_point():
                raise MtpTrtError(f"{path}: tensor '{name}' has dtype {str(t.dtype).removeprefix('torch.')}, "
                                  f"expected a floating-point type (fp32, fp16, bf16 or fp8)")
            if tuple(t.shape) != tuple(p.shape):
                raise MtpTrtError(f"{path}: tensor '{name}' has shape {list(t.shape)}, expected {list(p.shape)} "
                                  f"from {ckpt / 'config.json'}")
            p.copy_(t)
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
