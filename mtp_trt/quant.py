"""Weight-only block quantization: the one definition of the quantized weight format mtp-trt exports.

A weight W [N, K] (nn.Linear's [out, in] layout) is cut along K into blocks of `block_size` values (K is
zero-padded to a multiple of it).  Each block b of row n holds a float32 scale s[n, b] and signed integers
q in [-2^(bits-1), 2^(bits-1) - 1], with W ~ s * q.  Stored as two tensors, in ONNX Runtime's MatMulNBits
layout, so that ONNX Runtime's `com.microsoft::MatMulNBits` and mtp-trt's own CPU operators read the same
bytes:

* data    uint8 [N, blocks, block_size * bits / 8]: q + 2^(bits-1) (the zero point is implicit); with 4 bits
  two values per byte, element 2i in the low nibble and element 2i + 1 in the high nibble;
* scales  float32 [N, blocks].

Scales: int8 takes the block's largest magnitude over 127.  int4 has only 16 levels, so the scale is the
one of a few candidates s = m / t (m the block's value of largest magnitude, sign kept; t from -8 to -6 in
quarter steps; t = -8 maps m onto the extra negative level) that gives the smallest squared error over the
block.  The integer divisors make quantization idempotent: weights already on the grid keep their values.

Everything here is NumPy: the exporter quantizes each tensor as it is read, the tests use it as the
reference, and the runtime needs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mtp_trt.errors import MtpTrtError

SCHEMES = ("none", "int8", "int4")
BITS = {"int8": 8, "int4": 4}
BLOCK_SIZES = (16, 32, 64, 128, 256)
DEFAULT_BLOCK_SIZE = 32
INT4_DIVISORS = (-8.0, -7.75, -7.5, -7.25, -7.0, -6.75, -6.5, -6.25, -6.0)
ROWS_PER_CHUNK = 4096  # rows quantized at a time: bounds the temporaries of the int4 scale search


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
        return {"scheme": self.name} if not self.quantized else {
            "scheme": self.name, "bits": self.bits, "block_size": self.block_size,
            "layout": "MatMulNBits: uint8 [N, K/block, block*bits/8] (q + 2^(bits-1); 4 bits: even element in the "
                      "low nibble), float32 scales [N, K/block]"}

    @property
    def tag(self) -> str:
        """A short name for caches and file names: 'fp', 'int8-g32', 'int4-g64'."""
        return "fp" if not self.quantized else f"{self.name}-g{self.block_size}"


def scheme(name: str, block_size: int | None = None, flag: str = "--quant") -> Scheme:
    """A checked Scheme (an MtpTrtError naming the flag and value for a bad one)."""
    if name not in SCHEMES:
        raise MtpTrtError(f"{flag}: unknown scheme {name!r}; expected one of {', '.join(SCHEMES)}")
    if block_size is None:
        block_size = DEFAULT_BLOCK_SIZE
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size not in BLOCK_SIZES:
        raise MtpTrtError(f"--group-size: must be one of {', '.join(map(str, BLOCK_SIZES))}, got {block_size!r}")
    return Scheme(name, block_size)


def quantize(w: np.ndarray, s: Scheme) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] float -> (data uint8 [N, blocks, blob], scales float32 [N, blocks]) (module docstring)."""
    if w.ndim != 2:
        raise ValueError(f"quantize: expected a 2-D weight, got shape {w.shape}")
    n, k = w.shape
    data_shape, scale_shape = s.shapes(n, k)
    data, scales = np.empty(data_shape, np.uint8), np.empty(scale_shape, np.float32)
    for r in range(0, n, ROWS_PER_CHUNK):
        data[r:r + ROWS_PER_CHUNK], scales[r:r + ROWS_PER_CHUNK] = _quantize_rows(w[r:r + ROWS_PER_CHUNK], s)
    return data, scales


def _quantize_rows(w: np.ndarray, s: Scheme) -> tuple[np.ndarray, np.ndarray]:
    n, k = w.shape
    nb, bs = s.blocks(k), s.block_size
    blocks = np.zeros((n, nb * bs), np.float32)
    blocks[:, :k] = w
    blocks = blocks.reshape(n, nb, bs)
    lo, hi = -(1 << (s.bits - 1)), (1 << (s.bits - 1)) - 1
    if s.bits == 8:
        scale = np.abs(blocks).max(-1) / hi
        q = _levels(blocks, scale, lo, hi)
    else:
        pos = np.abs(blocks).argmax(-1)[..., None]
        m = np.take_along_axis(blocks, pos, -1)[..., 0]  # the value of largest magnitude, signed
        best_err, scale, q = None, None, None
        for t in INT4_DIVISORS:
            cand = m / np.float32(t)
            qc = _levels(blocks, cand, lo, hi)
            err = np.square(qc * cand[..., None] - blocks).sum(-1)
            if best_err is None:
                best_err, scale, q = err, cand, qc
            else:
                better = err < best_err
                best_err = np.where(better, err, best_err)
                scale = np.where(better, cand, scale)
                q = np.where(better[..., None], qc, q)
    u = (q.astype(np.int16) - lo).astype(np.uint8)  # + 2^(bits-1)
    if s.bits == 4:
        u = u[..., 0::2] | (u[..., 1::2] << 4)
    return u, scale.astype(np.float32)


def _levels(blocks: np.ndarray, scale: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """round(blocks / scale) clipped to [lo, hi] (an all-zero block: 0)."""
    safe = np.where(scale == 0, np.float32(1), scale)[..., None]
    return np.clip(np.rint(blocks / safe), lo, hi).astype(np.int8)


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
    return (q.reshape(n, nb, -1) * scales[..., None]).reshape(n, -1)[:, :k]
