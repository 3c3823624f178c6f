"""ONNX Runtime's fused CPU operators (`com.microsoft` domain) for the onnx lowering's graphs when they are
meant for ONNX Runtime only (the default; `--moe-form tensorrt` keeps standard operators, for TensorRT).

Each is a torch.autograd.Function that computes the reference's arithmetic when traced and exports as one
ONNX Runtime node, to cut the kernels a decode step launches (README, "Per-step overhead"):
  * RotaryEmbedding: RoPE on x [B, S, heads * Dr] at positions [B, S] from the cos/sin tables [P, Dr/2]
    (model.apply_rope's products; either pair layout) -- one node instead of a gather and two multiply-adds;
  * SkipSimplifiedLayerNormalization: a residual add and the RMSNorm after it, (norm(h + delta), h + delta) --
    one node instead of two.
"""

from __future__ import annotations

import torch

from mtp_trt.exporters.model import RMSNorm, apply_rope, rms_norm

Tensor = torch.Tensor


class RotaryOp(torch.autograd.Function):
    """x [B, S, heads*Dr], positions [B, S] (int64), tables (cos, sin) [P, Dr/2] -> x roped per head, same shape.
    The tables are constants, handed over as fp32 NumPy arrays with the dtype to cast them to (a tensor in an
    argument would be taken for a traced value); heads must be a Python int."""

    @staticmethod
    def forward(ctx, x, positions, tables: tuple, heads: int, interleave: int):
        *tables, dtype = tables
        cos, sin = (torch.from_numpy(t).to(dtype)[positions][:, :, None] for t in tables)
        return apply_rope(x.unflatten(-1, (heads, -1)), cos, sin, bool(interleave)).flatten(-2)

    @staticmethod
    def symbolic(g, x, positions, tables: tuple, heads: int, interleave: int):
        *tables, dtype = tables
        cos, sin = (g.op("Constant", value_t=torch.from_numpy(t).to(dtype)) for t in tables)
        y = g.op("com.microsoft::RotaryEmbedding", x, positions, cos, sin, interleaved_i=interleave, num_heads_i=heads)
        return y.setType(x.type())  # (the exporter's shape inference does not know the op)


class SkipRmsNormOp(torch.autograd.Function):
    """(h [.., D], delta [.., D], weight [D], eps) -> (RMSNorm(h + delta), h + delta)."""

    @staticmethod
    def forward(ctx, h, delta, weight, eps: float):
        s = h + delta
        return rms_norm(s, weight, eps), s

    @staticmethod
    def symbolic(g, h, delta, weight, eps: float):
        y, _, _, s = g.op("com.microsoft::SkipSimplifiedLayerNormalization", h, delta, weight, epsilon_f=eps,
                          outputs=4)
        return y.setType(h.type()), s.setType(h.type())  # (the exporter's shape inference does not know the op)


def add_norm(h: Tensor, delta: Tensor | None, norm: RMSNorm, fused: bool) -> tuple[Tensor, Tensor]:
    """(norm(h + delta), h + delta); delta None: (norm(h), h).  fused: one SkipSimplifiedLayerNormalization."""
    if delta is None:
        return norm(h), h
    if fused:
        return SkipRmsNormOp.apply(h, delta, norm.weight, norm.eps)
    h = h + delta
    return norm(h), h
