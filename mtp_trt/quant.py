"""Weight-only block quantization: the one definition of the quantized weight format mtp-trt exports.

A weight W [N, K] (nn.Linear's [out, in] layout) is cut along K into blocks of `block_size` values (K is
zero-padded to a multiple of it).  Each block b of row n holds a float16 scale s[n, b] and signed integers
q in [-2^(bits-1), 2^(bits-1) - 1], with W ~ s * q.  Stored as two tensors, in ONNX Runtime's MatMulNBits
layout, so that ONNX Runtime's `com.microsoft::MatMulNBits` and mtp-trt's own CPU operators read the same
bytes:

* data    uint8 [N, blocks, block_size * bits / 8]: q + 2^(bits-1) (the zero point is implicit); with 4 bits
  two values per byte, element 2i in the low nibble and element 2i + 1 in the high nibble;
* scales  float16 [N, blocks] (2 bytes per block: 8.5 bits per weight at int8, 4.5 at int4, blocks of 32).

Scales: int8 takes the block's largest magnitude over 127.  int4 has only 16 levels, so the scale is the
one of a few candidates s = m / t (m the block's value of largest magnitude, sign kept; t from -9 to -6 in
quarter steps; t = -8 maps m onto the extra negative level, below -8 m is clipped) that gives the smallest
squared error over the block.  The integer divisors make quantization idempotent: weights already on the grid keep their values.
Each scale is rounded to float16 before the levels are computed from it, so the levels fit the stored scale; a
block whose scale falls below float16's normal range (weights under 6.1e-5 * 127 = 7.8e-3 at int8) keeps a
subnormal one, whose rounding moves each weight by at most |q| * 2^-25 (4e-6 at int8): less than the levels'
own rounding in any block of larger weights.  A weight too large for float16 scales (beyond 65504 * 127 at
int8) is refused.  mtp-trt's operators also read float32 scales (exports of earlier revisions).

FP8 (`fp8`, for TensorRT engines only): W^T [K, N] as float8 e4m3 values with one float32 scale per FP8_BLOCK
values along K of each column, scales [K / FP8_BLOCK, N]: ONNX's blocked DequantizeLinear, which blocks one
axis.  DeepSeek's FP8 checkpoints scale 128 x 128 blocks; their scales are repeated along N (exporters/quantize.py
keeps the stored e4m3 bytes and scales), which costs 4 bytes per 128 weights.

Everything here is NumPy: the exporter quantizes each tensor as it is read, the tests use it as the
reference, and the runtime needs no torch.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from mtp_trt.errors import MtpTrtError

SCHEMES = ("none", "int8", "int4", "fp8")
BITS = {"int8": 8, "int4": 4, "fp8": 8}
FP8_BLOCK = 128  # FP8 scales: one per 128 values along K (DeepSeek's FP8 blocks are 128 x 128)
FP8_MAX = 448.0  # e4m3's largest finite value
BLOCK_SIZES = (16, 32, 64, 128, 256)
DEFAULT_BLOCK_SIZE = 32
INT4_DIVISORS = (-9.0, -8.75, -8.5, -8.25, -8.0, -7.75, -7.5, -7.25, -7.0, -6.75, -6.5, -6.25, -6.0)
ROWS_PER_CHUNK = 4096  # rows quantized at a time: bounds the temporaries of the int4 scale search
_THREADS = max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 8))


@dataclass(frozen=True)
class Scheme:
    """A quantization setting: `name` in SCHEMES and the block size (meaningless for "none")."""

    name: str = "none"
    block_size: int = DEFAULT_BLOCK_SIZE

    @property
    def bits(self) -> int:
        return BITS[self.name]

    @property
    def quantized(self) -> bool:
        return self.name != "none"

    def blocks(self, k: int) -> int:
        return -(-k // self.block_size)

    def blob(self) -> int:
        """Bytes per block of one row."""
        return self.block_size * self.bits // 8

    def shapes(self, n: int, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(data shape, scales shape) of a quantized [N, K] weight."""
        return (n, self.blocks(k), self.blob()), (n, self.blocks(k))

    def as_dict(self) -> dict:
        if self.name == "fp8":
            return {"scheme": self.name, "bits": 8, "block_size": self.block_size,
                    "layout": f"DequantizeLinear: FLOAT8E4M3FN W^T [K, N], float32 scales [K/{self.block_size}, N]"}
        return {"scheme": self.name} if not self.quantized else {
            "scheme": self.name, "bits": self.bits, "block_size": self.block_size,
            "layout": "MatMulNBits: uint8 [N, K/block, block*bits/8] (q + 2^(bits-1); 4 bits: even element in the "
                      "low nibble), float16 scales [N, K/block]"}

    @property
    def tag(self) -> str:
        """A short name for caches and file names: 'fp', 'int8-g32', 'int4-g64'."""
        return "fp" if not self.quantized else f"{self.name}-g{self.block_size}"


def scheme(name: str, block_size: int | None = None, flag: str = "--quant") -> Scheme:
    """A checked Scheme (an MtpTrtError naming the flag and value for a bad one)."""
    if name not in SCHEMES:
        raise MtpTrtError(f"{flag}: unknown scheme {name!r}; expected one of {', '.join(SCHEMES)}")
    if name == "fp8":
        if block_size not in (None, FP8_BLOCK) or isinstance(block_size, bool):
            raise MtpTrtError(f"--group-size: --quant fp8 scales blocks of {FP8_BLOCK} weights (DeepSeek's FP8 "
                              f"blocks); leave it out, got {block_size!r}")
        return Scheme(name, FP8_BLOCK)
    if block_size is None:
        block_size = DEFAULT_BLOCK_SIZE
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size not in BLOCK_SIZES:
        raise MtpTrtError(f"--group-size: must be one of {', '.join(map(str, BLOCK_SIZES))}, got {block_size!r}")
    return Scheme(name, block_size)


SCALE_DTYPE = np.float16  # the stored scales of int8 / int4 weights (module docstring)
SCALE_MAX = float(np.finfo(np.float16).max)


def quantize(w: np.ndarray, s: Scheme) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] float -> (data uint8 [N, blocks, blob], scales float16 [N, blocks]) (module docstring)."""
    if w.ndim != 2:
        raise ValueError(f"quantize: expected a 2-D weight, got shape {w.shape}")
    n, k = w.shape
    data_shape, scale_shape = s.shapes(n, k)
    data, scales = np.empty(data_shape, np.uint8), np.empty(scale_shape, SCALE_DTYPE)
    step = max(64, min(ROWS_PER_CHUNK, -(-n // _THREADS)))

    def part(r: int) -> None:
        data[r:r + step], scales[r:r + step] = _quantize_rows(w[r:r + step], s)

    if n <= step:
        part(0)
    else:  # NumPy's loops release the GIL: row chunks on every core
        with ThreadPoolExecutor(_THREADS) as pool:
            list(pool.map(part, range(0, n, step)))
    return data, scales


def _quantize_rows(w: np.ndarray, s: Scheme) -> tuple[np.ndarray, np.ndarray]:
    n, k = w.shape
    nb, bs = s.blocks(k), s.block_size
    if k == nb * bs:
        blocks = np.asarray(w, np.float32).reshape(n, nb, bs)
    else:
        blocks = np.zeros((n, nb * bs), np.float32)
        blocks[:, :k] = w
        blocks = blocks.reshape(n, nb, bs)
    lo, hi = -(1 << (s.bits - 1)), (1 << (s.bits - 1)) - 1
    q = np.empty_like(blocks)
    if s.bits == 8:
        scale = _stored(np.abs(blocks).max(-1) / np.float32(hi))
    else:
        pos = np.abs(blocks).argmax(-1)[..., None]
        m = np.take_along_axis(blocks, pos, -1)[..., 0]  # the value of largest magnitude, signed
        best, err = None, np.empty_like(blocks)
        for t in INT4_DIVISORS:
            cand = _stored(m / np.float32(t))
            _levels(blocks, cand, lo, hi, q)
            np.multiply(q, cand[..., None], out=err)
            np.subtract(err, blocks, out=err)
            e = np.einsum("ijk,ijk->ij", err, err)  # the block's squared error
            if best is None:
                best, scale = e, cand
            else:
                better = e < best
                best, scale = np.where(better, e, best), np.where(better, cand, scale)
    _levels(blocks, scale, lo, hi, q)
    u = (q - lo).astype(np.uint8)  # + 2^(bits-1)
    if s.bits == 4:
        u = u[..., 0::2] | (u[..., 1::2] << 4)
    return u, scale.astype(SCALE_DTYPE)


def _stored(scale: np.ndarray) -> np.ndarray:
    """Scales as float16 stores them, in float32 (a ValueError where one is beyond float16's range)."""
    big = np.abs(scale) > SCALE_MAX
    if big.any():
        raise ValueError(f"a block's scale {float(np.abs(scale[big]).max()):.3g} is beyond float16's {SCALE_MAX:.0f}: "
                         f"weights this large cannot be block-quantized")
    return scale.astype(SCALE_DTYPE).astype(np.float32)


def _levels(blocks: np.ndarray, scale: np.ndarray, lo: int, hi: int, out: np.ndarray) -> np.ndarray:
    """out = round(blocks / scale) clipped to [lo, hi] (an all-zero block: 0), as floats."""
    safe = np.where(scale == 0, np.float32(1), scale)[..., None]
    np.divide(blocks, safe, out=out)
    np.rint(out, out=out)
    return np.clip(out, lo, hi, out=out)


def levels(data: np.ndarray, k: int, bits: int) -> np.ndarray:
    """data [N, blocks, blob] -> the signed levels q [N, K] (int16)."""
    n, nb, blob = data.shape
    if bits == 4:
        u = np.empty((n, nb, blob * 2), np.int16)
        u[..., 0::2], u[..., 1::2] = data & 0xF, data >> 4
    else:
        u = data.astype(np.int16)
    return (u - (1 << (bits - 1))).reshape(n, -1)[:, :k]


def dequantize(data: np.ndarray, scales: np.ndarray, k: int, bits: int) -> np.ndarray:
    """(data, scales) -> W [N, K] float32, the weight the quantized one stands for."""
    n, nb, _ = data.shape
    q = np.zeros((n, nb * (data.shape[2] * 8 // bits)), np.float32)
    q[:, :k] = levels(data, k, bits)
    return (q.reshape(n, nb, -1) * scales.astype(np.float32)[..., None]).reshape(n, -1)[:, :k]


def _e4m3_values() -> np.ndarray:
    """The float32 value of each of the 256 float8 e4m3fn codes (sign, 4 exponent bits biased by 7, 3 mantissa
    bits; exponent 0 subnormal; 0x7F and 0xFF NaN, no infinities)."""
    c = np.arange(256)
    e, m = (c >> 3) & 0xF, (c & 7).astype(np.float64)
    v = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    v = np.where(c & 0x80, -v, v)
    v[(c & 0x7F) == 0x7F] = np.nan
    return v.astype(np.float32)


E4M3 = _e4m3_values()


def fp8_dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """FP8 W^T (e4m3 codes uint8 [K, N], float32 scales [ceil(K / FP8_BLOCK), N]) -> float32 [K, N]: each value
    times its block's scale, as DequantizeLinear computes it."""
    k = codes.shape[0]
    return E4M3[codes] * np.repeat(scales.astype(np.float32), FP8_BLOCK, 0)[:k]
