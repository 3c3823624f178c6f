"""DeepSeekMoE in the exported graphs (V3 §2.1.2), in three forms with the same router and the same outputs.

The router (`model.Gate`: sigmoid or softmax scores, `e_score_correction_bias`, group-limited top-k,
`norm_topk_prob`, `routed_scaling_factor`) is always the reference's own module, traced as is: the forms
differ only in how the selected experts' SwiGLUs are computed from its (weights [N, k], idx [N, k]).

* `static`: every routed expert on every token, weighted by the combine matrix (zero for unselected
  experts), in two matmuls over all stacked weights.  No data-dependent shapes or gathers, but it reads
  all E experts' weights whatever k is: E/k times the needed bytes in decode.
* `ort` (onnx lowering): one ONNX Runtime `com.microsoft::MoE` node, whose CPU kernel groups tokens by
  expert and reads only the selected experts' weights, in place (no copies).  Our router's choice is
  handed to it as router logits log(s) at the selected experts (s their scores) and -inf elsewhere: the
  node's softmax then gives s / sum(s) on exactly those k experts -- norm_topk_prob's normalization, done by
  the node -- and the output is scaled by routed_scaling_factor (and sum(s) where the weights are not
  normalized).
  The kernel hands each thread a contiguous block of experts and runs an expert's matmuls on one thread,
  so one token's k experts often land on one thread while the other idles.  Each expert is therefore
  given to it as PARTS experts over consecutive blocks of its intermediate units, part-major (part p of
  every expert in the p-th block): with up to PARTS threads every thread gets the same share of any
  selection.  SwiGLU is elementwise over the units, so the parts' outputs add up to the expert's
  (split_experts).  PARTS = 4, by measurement (benchmarks/moe_forms.py): one MoE layer of the 85M / 304M checkpoints at one
  token 1.19x / 1.40x faster than whole experts, prompts of 64-512 tokens 4-8% slower.
* `gather` (standard operators, for TensorRT): each token gathers its k experts' stacked weights
  (Gather) and multiplies them in batched MatMuls: reads N*k experts' weights (through a copy), with
  fixed shapes given k, so TensorRT's ONNX parser takes it.  Pays while N*k is well below E (decode
  and step graphs); the plugin lowering keeps `static` where S can be a whole prompt.

Stacked weights (`gather`; `ort` takes them split into parts, one layout per export):
  fc1 [E, 2I, D]: expert e's gate and up rows interleaved (row 2j = gate_j, 2j + 1 = up_j), the layout
      ORT's CPU kernel takes (swiglu_fusion = 1);
  fc2 [E, D, I]: down_proj.
The shared experts are a dense SwiGLU beside the routed ones in every form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mtp_trt.exporters.model import MLP, MoE
from mtp_trt.exporters.ort_ops import cpu_moe

Tensor = torch.Tensor
FORMS = ("static", "ort", "gather", "cpu")
PARTS = 4  # `ort`: each routed expert as up to this many experts (threads kept busy: module docstring)
SWIGLU_LIMIT = 3.0e38  # ORT's SwiGLU clamps its inputs at this limit: none here (silu(g) * u exactly)


def swiglu(m: MLP, x: Tensor) -> Tensor:
    """SwiGLU with gate and up in one matmul."""
    w = torch.cat([m.gate_proj.weight, m.up_proj.weight])
    g, u = F.linear(x, w).split(m.gate_proj.out_features, -1)
    return m.down_proj(F.silu(g) * u)


def stacked(moe: MoE) -> tuple[Tensor, Tensor]:
    """The routed experts' weights: fc1 [E, 2I, D] (gate/up rows interleaved), fc2 [E, D, I]."""
    gate = torch.stack([e.gate_proj.weight for e in moe.experts])  # [E, I, D]
    up = torch.stack([e.up_proj.weight for e in moe.experts])
    fc1 = torch.stack([gate, up], 2).flatten(1, 2)  # [E, I, 2, D] -> [E, 2I, D]
    return fc1, torch.stack([e.down_proj.weight for e in moe.experts])


def moe_forward(moe: MoE, x: Tensor, b, s, form: str) -> Tensor:
    """DeepSeekMoE on x [B, S, D] (B, S: the graph's traced sizes) -> [B, S, D], in one of FORMS."""
    if form == "cpu":  # router, routed and shared experts in one node
        return cpu_moe(moe, x)
    if form == "ort":
        y = routed_ort(moe, x, b, s)
    elif form in ("static", "gather"):
        weights, idx = moe.gate(x)  # [B, S, k] fp32, [B, S, k]
        y = routed_static(moe, x, weights, idx, b, s) if form == "static" else routed_gather(moe, x, weights, idx)
    else:
        raise ValueError(f"unknown MoE form {form!r}; expected one of {FORMS}")
    return y + swiglu(moe.shared_experts, x) if hasattr(moe, "shared_experts") else y


def routed_static(moe: MoE, x: Tensor, weights: Tensor, idx: Tensor, b, s) -> Tensor:
    """Every routed expert on every token, combine-weighted: [B, S, E * 2I] then [B, S, E * I] @ down."""
    n, inter = len(moe.experts), moe.experts[0].gate_proj.weight.shape[0]
    combine = torch.zeros(n, dtype=weights.dtype).expand(b, s, n).scatter(-1, idx, weights)  # [B, S, E]
    w_gate_up = torch.cat([e.gate_proj.weight for e in moe.experts] + [e.up_proj.weight for e in moe.experts])
    w_down = torch.cat([e.down_proj.weight for e in moe.experts], dim=1)  # [D, E * I]
    g, u = F.linear(x, w_gate_up).split(n * inter, -1)
    a = (F.silu(g) * u).reshape(b, s, n, inter) * combine[..., None].to(g.dtype)  # [B, S, E, I]
    return F.linear(a.reshape(b, s, n * inter), w_down)


def routed_gather(moe: MoE, x: Tensor, weights: Tensor, idx: Tensor) -> Tensor:
    """Each token's k experts: gathered fc1 [B, S, k, 2I, D] @ x, SwiGLU, gathered fc2 [B, S, k, D, I] @ a,
    summed over k.  Reads N*k experts' weights; shapes fixed given k (TensorRT)."""
    fc1, fc2 = stacked(moe)
    inter = fc2.shape[-1]
    h = torch.matmul(fc1[idx], x[:, :, None, :, None])  # [B, S, k, 2I, 1]
    gu = h.reshape(*idx.shape, inter, 2)  # interleaved gate/up
    a = F.silu(gu[..., 0]) * gu[..., 1] * weights[..., None].to(x.dtype)  # [B, S, k, I]
    return torch.matmul(fc2[idx], a[..., None]).sum((2, 4))  # [B, S, k, D, 1] -> [B, S, D]


class OrtMoEOp(torch.autograd.Function):
    """ONNX Runtime's com.microsoft::MoE over x [N, D] and router logits [N, E] (softmax, top k, SwiGLU
    experts).  Computes the same in PyTorch when traced (every expert, softmax-weighted)."""

    @staticmethod
    def forward(ctx, x, router, fc1, fc1_bias, fc2, k: int):
        p = router.softmax(-1)  # zero off the selected experts
        h = torch.einsum("nd,ejd->nej", x, fc1) + fc1_bias
        g, u = h[..., 0::2], h[..., 1::2]
        return torch.einsum("nei,edi->nd", F.silu(g) * u * p[..., None].to(x.dtype), fc2)

    @staticmethod
    def symbolic(g, x, router, fc1, fc1_bias, fc2, k: int):
        y = g.op("com.microsoft::MoE", x, router, fc1, fc1_bias, fc2, k_i=k, activation_type_s="swiglu",
                 swiglu_fusion_i=1, activation_alpha_f=1.0, activation_beta_f=0.0, swiglu_limit_f=SWIGLU_LIMIT,
                 normalize_routing_weights_i=0)
        return y.setType(x.type())  # (the exporter's shape inference does not know the op)


def split_experts(fc1: Tensor, fc2: Tensor, parts: int) -> tuple[Tensor, Tensor]:
    """stacked()'s fc1 [E, 2I, D], fc2 [E, D, I] as P = `parts` experts each over consecutive blocks of I/P
    intermediate units, part-major: fc1 [P*E, 2I/P, D], fc2 [P*E, D, I/P] (expert e's part p at p*E + e)."""
    e, two_i, d = fc1.shape
    i = fc2.shape[-1]
    fc1 = fc1.reshape(e, parts, two_i // parts, d).transpose(0, 1).reshape(parts * e, two_i // parts, d)
    fc2 = fc2.reshape(e, d, parts, i // parts).permute(2, 0, 1, 3).reshape(parts * e, d, i // parts)
    return fc1, fc2


def routed_ort(moe: MoE, x: Tensor, b, s, parts: int | None = None) -> Tensor:
    """The `ort` form: the router's choice idx with scores s_i as logits log(s_i) at idx, -inf elsewhere, repeated
    for each of the `parts` parts of every expert (default: the largest divisor of I up to PARTS), so that the
    node's softmax top-(k*parts) gives s_i / (parts * sum(s_idx)) on exactly the selected experts' parts:
    norm_topk_prob's weights over parts, so the output is scaled back by a constant (parts times
    routed_scaling_factor; without norm_topk_prob, times sum(s_idx) too).  Equal to the reference's weights
    s_i / (sum + 1e-20) but for that 1e-20."""
    cfg = moe.gate.cfg
    parts = parts or max(p for p in range(1, PARTS + 1) if cfg.moe_intermediate_size % p == 0)
    fc1, fc2 = split_experts(*stacked(moe), parts)
    n, d = cfg.n_routed_experts, cfg.hidden_size  # Python ints: constant reshapes, no shape nodes per layer
    scores, idx = moe.gate.select(x)
    chosen = scores.gather(-1, idx)  # [B, S, k]
    router = torch.full((n,), float("-inf")).expand(b, s, n).scatter(-1, idx, chosen.log())  # [B, S, E]
    router = torch.cat([router] * parts, -1)
    bias = torch.zeros(fc1.shape[:2], dtype=fc1.dtype)
    y = OrtMoEOp.apply(x.reshape(-1, d), router.reshape(-1, n * parts).to(x.dtype), fc1, bias, fc2,
                       cfg.num_experts_per_tok * parts).reshape(b, s, d)
    scale = parts * cfg.routed_scaling_factor
    if not cfg.norm_topk_prob:
        return y * (chosen.sum(-1, keepdim=True) * scale).to(x.dtype)
    return y if scale == 1.0 else y * scale
