"""ONNX Runtime's fused CPU operators (`com.microsoft` domain) for the onnx lowering's graphs when they are
meant for ONNX Runtime only (the default; `--moe-form tensorrt` keeps standard operators, for TensorRT).

Each is a torch.autograd.Function that computes the reference's arithmetic when run and exports as one
ONNX Runtime node, to cut the kernels a decode step launches (docs/benchmarks.md).  While traced, the heavy
ones (MoE, MlaAttention, MlaSelfAttention) return zeros of their output's shape: the export traces them on
placeholder weights, where the values steer nothing, and computing them was a large share of the tracing.
  * RotaryEmbedding: RoPE on x [B, S, heads * Dr] at positions [B, S] from the cos/sin tables [P, Dr/2]
    (model.apply_rope's products; either pair layout) -- one node instead of a gather and two multiply-adds;
  * SkipSimplifiedLayerNormalization: a residual add and the RMSNorm after it, (norm(h + delta), h + delta) --
    one node instead of two (mtp-trt's RmsNorm below where `cpu_ops`);
and mtp-trt's own CPU operators (domain `mtp_trt.cpu`, the custom-op library of plugins/ort, registered by
plugins/ort_lib.py), used where the export's `cpu_ops` is on (export.check_cpu_ops):
  * MoE: DeepSeekMoE with its router and shared experts -- one node instead of ~25 router nodes and
    com.microsoft::MoE; reads only the selected experts' rows, in place;
  * MlaAttention: absorbed MLA over the cached and the new latent rows with their masks -- one node instead
    of ~13 -- or, with DeepSeek Sparse Attention, over the rows the indexer selected;
  * MlaSelfAttention: MLA from the projections' outputs to W^UV (the new rows' norm and RoPE, the queries' RoPE
    and W^UK, MlaAttention's attention, W^UV) -- one node instead of ~15 (without DeepSeek Sparse Attention);
  * MoE without routed experts: a dense SwiGLU MLP -- one node instead of five (quantized exports);
  * MtpAccept: the drafts' acceptance (exporters/lowering.py accept_decomposed) -- one node instead of ~100;
  * RmsNorm: RMSNorm, or a residual add and the RMSNorm after it -- as ONNX Runtime's
    (Skip)SimplifiedLayerNormalization, but splitting its rows over the threads only where they are many (ONNX
    Runtime's split any two rows: at a decode step's 2-4 rows, 1.5 us a norm more on 2 threads than on one);
  * LightningIndexer: DeepSeek Sparse Attention's indexer scores over every seen row and its top-k selection --
    one node instead of ~12, with no [heads x rows] product kept.
"""

from __future__ import annotations

import torch

from mtp_trt.exporters.model import RMSNorm, apply_rope, rms_norm, select_experts
from mtp_trt.plugins.ort_lib import DOMAIN as CPU_DOMAIN  # the custom-op library's domain

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


def add_norm(h: Tensor, delta: Tensor | None, norm: RMSNorm, fused: bool, cpu: bool = False) -> tuple[Tensor, Tensor]:
    """(norm(h + delta), h + delta); delta None: (norm(h), h).  fused: one SkipSimplifiedLayerNormalization node;
    cpu: one mtp_trt.cpu::RmsNorm node (for delta None too)."""
    if delta is None:
        return cpu_norm(norm, h, cpu), h
    if cpu:
        return CpuSkipRmsNormOp.apply(h, delta, norm.weight, norm.eps)
    if fused:
        return SkipRmsNormOp.apply(h, delta, norm.weight, norm.eps)
    h = h + delta
    return norm(h), h


def cpu_norm(norm: RMSNorm, x: Tensor, cpu: bool) -> Tensor:
    """norm(x), as one mtp_trt.cpu::RmsNorm node where `cpu`."""
    return CpuRmsNormOp.apply(x, norm.weight, norm.eps) if cpu else norm(x)


# --------------------------------------------------------------- mtp-trt's own CPU operators (plugins/ort)
class CpuRmsNormOp(torch.autograd.Function):
    """RMSNorm as one `mtp_trt.cpu::RmsNorm` node: x [.., D], weight [D] -> norm(x)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        return rms_norm(x, weight, eps)

    @staticmethod
    def symbolic(g, x, weight, eps: float):
        return g.op(f"{CPU_DOMAIN}::RmsNorm", x, weight, epsilon_f=eps).setType(x.type())


class CpuSkipRmsNormOp(SkipRmsNormOp):
    """SkipRmsNormOp as one `mtp_trt.cpu::RmsNorm` node."""

    @staticmethod
    def symbolic(g, h, delta, weight, eps: float):
        y, s = g.op(f"{CPU_DOMAIN}::RmsNorm", h, weight, delta, epsilon_f=eps, outputs=2)
        return y.setType(h.type()), s.setType(h.type())


def _interleaved(gate: Tensor, up: Tensor) -> Tensor:
    """gate, up [..., I, D] -> [..., 2I, D] with rows (gate_j, up_j) adjacent (the ops' fc1 layout)."""
    return torch.stack([gate, up], -2).flatten(-3, -2)


def _unsqueeze(g, x, axis: int):
    return g.op("Unsqueeze", x, g.op("Constant", value_t=torch.tensor([axis])))


class StackedExperts(torch.autograd.Function):
    """torch.stack of the experts' weights -> [E, R, D] that, when traced, writes nothing: the export traces on
    placeholder weights, whose stack would be real memory (a DeepSeek-V2-Lite layer's: 2.2 GB) for values nobody
    reads, since the graph records only this op's ONNX form (Unsqueeze and Concat over the weights: the recipe
    streaming.fold_graph folds)."""

    @staticmethod
    def forward(ctx, *weights):
        if torch.jit.is_tracing():
            return torch.empty((len(weights), *weights[0].shape), dtype=weights[0].dtype)  # never written
        return torch.stack(weights)

    @staticmethod
    def symbolic(g, *weights):
        return g.op("Concat", *[_unsqueeze(g, w, 0) for w in weights], axis_i=0)


class InterleavedExperts(torch.autograd.Function):
    """StackedExperts of the gates then the ups given: [E, 2I, D], rows (gate_j, up_j) adjacent (_interleaved)."""

    @staticmethod
    def forward(ctx, *weights):
        e, (rows, d) = len(weights) // 2, weights[0].shape
        if torch.jit.is_tracing():
            return torch.empty((e, 2 * rows, d), dtype=weights[0].dtype)  # never written
        return torch.stack([_interleaved(a, b) for a, b in zip(weights[:e], weights[e:])])

    @staticmethod
    def symbolic(g, *weights):
        e = len(weights) // 2
        shape = g.op("Constant", value_t=torch.tensor([-1, weights[0].type().sizes()[1]]))
        pairs = [g.op("Reshape", g.op("Concat", _unsqueeze(g, a, 1), _unsqueeze(g, b, 1), axis_i=1), shape)
                 for a, b in zip(weights[:e], weights[e:])]
        return g.op("Concat", *[_unsqueeze(g, w, 0) for w in pairs], axis_i=0)


class CpuMoEOp(torch.autograd.Function):
    """DeepSeekMoE, router included, as one `mtp_trt.cpu::MoE` node: x [.., D], gate [E, D], bias [E], fc1 [E, 2I, D]
    (gate/up interleaved), fc2 [E, D, I], shared_fc1 [2Is, D], shared_fc2 [D, Is] (or neither) -> [.., D].
    attrs (cpu_moe_attrs): model.select_experts' routing, then norm_topk_prob and routed_scaling_factor."""

    @staticmethod
    def forward(ctx, x, gate, bias, fc1, fc2, shared_fc1, shared_fc2, attrs: tuple):
        if torch.jit.is_tracing():  # the output's shape is all a trace needs
            return torch.zeros_like(x)
        *routing, norm, scaling = attrs
        scores, idx = select_experts(x, gate, bias, *routing)
        w = scores.gather(-1, idx)
        w = (w / (w.sum(-1, keepdim=True) + 1e-20) if norm else w) * scaling  # Gate.forward's weights
        flat, idx, w = x.reshape(-1, x.shape[-1]), idx.reshape(-1, idx.shape[-1]), w.reshape(-1, w.shape[-1])
        y = torch.zeros_like(flat)
        for e in idx.unique().tolist():  # expert by expert (never every token's experts gathered at once)
            token, slot = torch.where(idx == e)
            y.index_add_(0, token, _swiglu(flat[token], fc1[e], fc2[e]) * w[token, slot, None].to(x.dtype))
        y = y.reshape(x.shape)
        return y if shared_fc1 is None else y + _swiglu(x, shared_fc1, shared_fc2)

    @staticmethod
    def symbolic(g, x, gate, bias, fc1, fc2, shared_fc1, shared_fc2, attrs: tuple):
        top_k, n_group, topk_group, softmax, group_top2, norm, scaling = attrs
        shared = () if shared_fc1 is None else (shared_fc1, shared_fc2)
        y = g.op(f"{CPU_DOMAIN}::MoE", x, gate, bias, fc1, fc2, *shared, top_k_i=top_k, n_group_i=n_group,
                 topk_group_i=topk_group, softmax_i=int(softmax), group_top2_i=int(group_top2), norm_topk_prob_i=norm,
                 routed_scaling_factor_f=scaling)
        return y.setType(x.type())


class CpuMlpOp(torch.autograd.Function):
    """A dense SwiGLU MLP as one `mtp_trt.cpu::MoE` node without routed experts: x [.., D], fc1 [2I, D] (gate/up
    interleaved), fc2 [D, I] -> [.., D]."""

    @staticmethod
    def forward(ctx, x, fc1, fc2):
        return _swiglu(x, fc1, fc2)

    @staticmethod
    def symbolic(g, x, fc1, fc2):
        none = _absent(g)
        y = g.op(f"{CPU_DOMAIN}::MoE", x, none, none, none, none, fc1, fc2, top_k_i=0, n_group_i=1, topk_group_i=1,
                 softmax_i=0, group_top2_i=0, norm_topk_prob_i=0, routed_scaling_factor_f=1.0)
        return y.setType(x.type())


def cpu_mlp(mlp, x: Tensor) -> Tensor:
    """The dense MLP `mlp` (exporters/model.py MLP) on x [B, S, D] as one node."""
    return CpuMlpOp.apply(x, _interleaved(mlp.gate_proj.weight, mlp.up_proj.weight), mlp.down_proj.weight)


def _swiglu(x: Tensor, fc1: Tensor, fc2: Tensor) -> Tensor:
    """x [.., D] through fc1 [.., 2I, D] (gate/up interleaved), silu(gate) * up, fc2 [.., D, I] -> [.., D]."""
    h = (fc1 @ x[..., None])[..., 0]
    return (fc2 @ (torch.nn.functional.silu(h[..., 0::2]) * h[..., 1::2])[..., None])[..., 0]


def cpu_moe_attrs(gate) -> tuple:
    """The op's attributes for a model.Gate: its routing, norm_topk_prob, routed_scaling_factor."""
    return (*gate.routing(), int(gate.cfg.norm_topk_prob), float(gate.cfg.routed_scaling_factor))


def cpu_moe(moe, x: Tensor) -> Tensor:
    """The MoE layer `moe` (exporters/model.py MoE, shared experts included) on x [B, S, D] as one node."""
    gate = moe.gate
    bias = gate.e_score_correction_bias if gate.cfg.topk_method == "noaux_tc" else torch.zeros(gate.weight.shape[0])
    fc1 = InterleavedExperts.apply(*(e.gate_proj.weight for e in moe.experts), *(e.up_proj.weight for e in moe.experts))
    fc2 = StackedExperts.apply(*(e.down_proj.weight for e in moe.experts))
    shared = getattr(moe, "shared_experts", None)
    sfc1 = None if shared is None else _interleaved(shared.gate_proj.weight, shared.up_proj.weight)
    sfc2 = None if shared is None else shared.down_proj.weight
    return CpuMoEOp.apply(x, gate.weight, bias.float(), fc1, fc2, sfc1, sfc2, cpu_moe_attrs(gate))


def _seen(past_len: Tensor, visible: Tensor | None, b: int, s: int, r: int, t: int) -> Tensor:
    """Which of the T cache rows then the R rows each query token sees, [B, S, T + R] bool: cached rows < past_len,
    and `visible` [B or 1, S, R] (None: causal over the last S rows, the rows before them all seen)."""
    if visible is None:
        visible = (torch.arange(r)[None, :] <= torch.arange(s)[:, None] + (r - s))[None]
    return torch.cat([(torch.arange(t)[None, :] < past_len[:, None])[:, None, :].expand(b, s, t),
                      visible.expand(b, s, r)], -1)


def _absent(g):
    """An optional input left out (an empty name in the ONNX node)."""
    return g.op("prim::Constant").setType(torch._C.OptionalType.ofTensor())


class CpuMlaOp(torch.autograd.Function):
    """Absorbed MLA as one `mtp_trt.cpu::MlaAttention` node: q_lat [B, S, H*Dl] (queries absorbed through W^UK),
    q_pe [B, S, H*Dr] (roped), rows [B, R, C] (C >= Dl + Dr: the latent first), cache [B, T, C], past_len [B] int32
    (cached rows < past_len are seen), visible [B or 1, S, R] bool (which rows each query token sees; None: causal
    over the last S rows, the rows before them all seen), selected [B, S, K] int32 or None (DeepSeek Sparse
    Attention: the rows each query token attends to, indices into the T cache rows then the R rows, -1: none; it
    replaces past_len and visible) -> [B, S, H*Dl]: per head, softmax(scale * [q_lat; q_pe] . k) over the seen rows
    k, times their first Dl dims."""

    @staticmethod
    def forward(ctx, q_lat, q_pe, rows, cache, past_len, visible, selected, heads: int, scale: float):
        if torch.jit.is_tracing():  # (as CpuMoEOp)
            return torch.zeros_like(q_lat)
        b, s, _ = q_lat.shape
        r, t = rows.shape[1], cache.shape[1]
        q = torch.cat([q_lat.unflatten(-1, (heads, -1)), q_pe.unflatten(-1, (heads, -1))], -1).float()
        if selected is None:
            seen = _seen(past_len, visible, b, s, r, t)
        else:
            picked = selected.long()
            picked = torch.where(picked < 0, t + r, picked)  # -1: a column past the rows, dropped
            seen = torch.zeros(b, s, t + r + 1, dtype=torch.bool).scatter(-1, picked, torch.ones_like(picked) > 0)
            seen = seen[..., :t + r]
        keys = torch.cat([cache, rows], 1)[..., :q.shape[-1]].float()[:, None]  # [B, 1, T+R, Dl+Dr]
        p = torch.where(seen[:, :, None, :], q @ keys.transpose(-1, -2) * scale, float("-inf")).softmax(-1)
        dl = q_lat.shape[-1] // heads
        return (p @ keys[..., :dl]).flatten(-2).to(q_lat.dtype)

    @staticmethod
    def symbolic(g, q_lat, q_pe, rows, cache, past_len, visible, selected, heads: int, scale: float):
        ins = (q_lat, q_pe, rows, cache, past_len)
        if selected is not None:
            ins += (_absent(g) if visible is None else visible, selected)
        elif visible is not None:
            ins += (visible,)
        y = g.op(f"{CPU_DOMAIN}::MlaAttention", *ins, heads_i=heads, scale_f=scale)
        return y.setType(q_lat.type())


class CpuMlaSelfOp(torch.autograd.Function):
    """MLA from the projections to W^UV as one `mtp_trt.cpu::MlaSelfAttention` node -> (o [B, S, H*Dv], or
    [B, S, H*Dl] without w_uv; the new cache rows [B, S, Dl+Dr]).  q [B, S, H*F + H*Dr]: every head's first part
    (its nope part, F = Dn, absorbed through w_uk [H, Dn, Dl]; or, without w_uk, already absorbed: F = Dl), then
    every head's rope part, not yet roped; kv [B, S, Dl+Dr]: kv_a_proj_with_mqa's output (c_kv not yet normed, k_pe
    not yet roped); kv_norm [Dl] (kv_a_layernorm's weight, eps); positions [B, S] int64 (RoPE's, into the tables
    (cos, sin [P, Dr/2] as NumPy arrays, and the dtype) with `interleave`); cache [B, T, Dl+Dr], past_len [B] int32;
    extra [B, R, Dl+Dr] or None (rows of this step before the new ones); visible [B or 1, S, R+S] bool or None
    (causal: CpuMlaOp's); w_uv [H, Dv, Dl] or None (folded into the output projection)."""

    @staticmethod
    def forward(ctx, q, kv, kv_norm, positions, cache, past_len, extra, visible, w_uk, w_uv, tables: tuple,
                heads: int, scale: float, eps: float, interleave: int):
        if torch.jit.is_tracing():  # (as CpuMoEOp)
            width = heads * (kv_norm.shape[0] if w_uv is None else w_uv.shape[1])
            return q.new_zeros((*q.shape[:-1], width)), torch.zeros_like(kv)
        *tables, dtype = tables
        cos, sin = (torch.from_numpy(t).to(dtype)[positions] for t in tables)  # [B, S, Dr/2]
        dl, dr = kv_norm.shape[0], 2 * cos.shape[-1]
        c_kv, k_pe = kv.split([dl, dr], -1)
        rows = torch.cat([rms_norm(c_kv, kv_norm, eps), apply_rope(k_pe, cos, sin, bool(interleave))], -1)
        first, q_pe = q.split([q.shape[-1] - heads * dr, heads * dr], -1)
        q_pe = apply_rope(q_pe.unflatten(-1, (heads, dr)), cos[:, :, None], sin[:, :, None], bool(interleave))
        q_lat = first.unflatten(-1, (heads, -1))
        if w_uk is not None:
            q_lat = torch.einsum("bshn,hnc->bshc", q_lat, w_uk)
        every = rows if extra is None else torch.cat([extra, rows], 1)
        o = CpuMlaOp.forward(ctx, q_lat.flatten(-2), q_pe.flatten(-2), every, cache, past_len, visible, None, heads,
                             scale)
        if w_uv is not None:
            o = torch.einsum("bshc,hvc->bshv", o.unflatten(-1, (heads, dl)), w_uv).flatten(-2)
        return o, rows

    @staticmethod
    def symbolic(g, q, kv, kv_norm, positions, cache, past_len, extra, visible, w_uk, w_uv, tables: tuple,
                 heads: int, scale: float, eps: float, interleave: int):
        *tables, dtype = tables
        cos, sin = (g.op("Constant", value_t=torch.from_numpy(t).to(dtype)) for t in tables)
        optional = [extra, visible, w_uk, w_uv]
        while optional and optional[-1] is None:  # trailing absent inputs left out
            optional.pop()
        optional = [_absent(g) if t is None else t for t in optional]
        o, rows = g.op(f"{CPU_DOMAIN}::MlaSelfAttention", q, kv, kv_norm, positions, cos, sin, cache, past_len,
                       *optional, heads_i=heads, scale_f=scale, eps_f=eps, interleave_i=interleave, outputs=2)
        width = kv.type().sizes()[-1] if kv.type().sizes() else None
        return o.setType(q.type().with_sizes([None] * 3)), rows.setType(kv.type().with_sizes([None, None, width]))


class CpuAcceptOp(torch.autograd.Function):
    """Draft acceptance as one `mtp_trt.cpu::MtpAccept` node: logits [B, S, V] (fp32), input_ids [B, S], thinking [B],
    relaxed_topk [] and relaxed_delta [] (None, None: strict, a plain step) -> (accepted_tokens [B, S],
    num_accepted [B], thinking_out [B]), int32: exporters/lowering.py accept_decomposed."""

    @staticmethod
    def forward(ctx, logits, input_ids, thinking, relaxed_topk, relaxed_delta, think_start_id: int,
                think_end_id: int):
        from mtp_trt.exporters.lowering import accept_decomposed

        if relaxed_topk is None:
            relaxed_topk, relaxed_delta = torch.tensor(0, dtype=torch.int32), torch.tensor(0.0)
        return accept_decomposed(logits, input_ids, thinking, relaxed_topk, relaxed_delta, think_start_id,
                                 think_end_id)

    @staticmethod
    def symbolic(g, logits, input_ids, thinking, relaxed_topk, relaxed_delta, think_start_id: int,
                 think_end_id: int):
        relaxed = () if relaxed_topk is None else (relaxed_topk, relaxed_delta)
        outs = g.op(f"{CPU_DOMAIN}::MtpAccept", logits, input_ids, thinking, *relaxed, think_start_id_i=think_start_id,
                    think_end_id_i=think_end_id, outputs=3)
        return tuple(o.setType(input_ids.type().with_sizes([None] * r)) for o, r in zip(outs, (2, 1, 1)))


class CpuIndexerOp(torch.autograd.Function):
    """DeepSeek Sparse Attention's lightning indexer and top-k selection as one `mtp_trt.cpu::LightningIndexer` node:
    q [B, S, Hi*Di] (the indexer's queries, roped), weights [B, S, Hi] (its head weights), rows [B, R, C] and cache
    [B, T, C] (each row's indexer key its last Di values), past_len, visible as CpuMlaOp -> selected [B, S, K] int32,
    K = min(topk, T + R): per query token the topk seen rows of highest I[t] = sum_j weights[j] * ReLU(scale *
    q_j . k_t), the earlier row among equal scores, in ascending order, -1 after them where fewer are seen."""

    @staticmethod
    def forward(ctx, q, weights, rows, cache, past_len, visible, heads: int, topk: int, scale: float):
        b, s, _ = q.shape
        r, t = rows.shape[1], cache.shape[1]
        keys = torch.cat([cache, rows], 1)[..., -(q.shape[-1] // heads):].float()[:, None]  # [B, 1, T+R, Di]
        scores = torch.relu(q.unflatten(-1, (heads, -1)).float() @ keys.transpose(-1, -2) * scale)  # [B, S, Hi, T+R]
        index = torch.where(_seen(past_len, visible, b, s, r, t), (weights.float()[..., None] * scores).sum(-2),
                            float("-inf"))
        values, order = torch.sort(index, stable=True, dim=-1, descending=True)  # (ties: the earlier row first)
        k = min(topk, t + r)
        picked = torch.where(values[..., :k] > float("-inf"), order[..., :k], t + r).sort(-1).values
        return torch.where(picked < t + r, picked, -1).to(torch.int32)

    @staticmethod
    def symbolic(g, q, weights, rows, cache, past_len, visible, heads: int, topk: int, scale: float):
        ins = (q, weights, rows, cache, past_len) + (() if visible is None else (visible,))
        y = g.op(f"{CPU_DOMAIN}::LightningIndexer", *ins, heads_i=heads, topk_i=topk, scale_f=scale)
        return y.setType(q.type().with_dtype(torch.int32).with_sizes([None] * 3))
