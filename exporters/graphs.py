"""The exported graphs: the target (main model + in-graph acceptance), the MTP module(s) and the one-call
decode steps, in two lowerings (exporters/lowering.py).  In the `onnx` lowering the new latent rows
are graph outputs that the runtime writes into its persistent cache; in the `plugin` lowering the
attention node writes them in place and every cache input has an output `<input>_out` aliased to it
(the cache after the graph's writes; TensorRT binds both to one buffer).  Each block returns what
its lowering commits: the new rows (`onnx`) or the updated cache (`plugin`).

Both lowerings share everything else with the reference model (exporters/model.py).  MoE
(exporters/moe.py): the `onnx` lowering routes every graph through ONNX Runtime's MoE node (only the
selected experts' weights are read); the `plugin` lowering gathers each token's experts in the step graphs
(few tokens, fixed S) and keeps the static form (every expert on every token) in the target and MTP
graphs, whose S can be a whole prompt.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp_trt.exporters.lowering import (Dims, Mask, MlaGenerationAttentionOp, MlaSparseAttentionOp, accept_op, attend,
                                         flag_after)
from mtp_trt.exporters.model import MLA, DecoderLayer, DeepseekV3, Indexer, MoE, as_fp32
from mtp_trt.exporters.moe import moe_forward, swiglu
from mtp_trt.exporters.ort_ops import (CpuAcceptOp, CpuIndexerOp, CpuMlaOp, CpuMlaSelfOp, RotaryOp, add_norm,
                                       cpu_mlp, cpu_norm)

Tensor = torch.Tensor


# ------------------------------------------------------------------- state shared by a graph's blocks
class Rope:
    """RoPE as one gather and two multiply-adds: rope(x) = x * cos2 + x[..., swap] * sin2, where cos2/sin2
    [P, Dr] hold each pair's cos / (-sin, +sin) in the layout's pair positions.  The same products and
    sums as model.apply_rope (x1*cos - x2*sin == x1*cos + x2*(-sin) exactly), in 4 nodes instead of ~16."""

    def __init__(self, model: DeepseekV3, interleave: bool | None = None):
        """interleave: the pair layout (default: the config's rope_interleave, MLA's)."""
        dtype = model.model.embed_tokens.weight.dtype
        cos, sin = model.rope_cos.to(dtype), model.rope_sin.to(dtype)  # [P, Dr/2], cast as model.rope does
        self.tables = (model.rope_cos.float().numpy(), model.rope_sin.float().numpy(), dtype)  # (exporters/ort_ops.py)
        self.interleave = model.cfg.rope_interleave if interleave is None else interleave
        half = cos.shape[-1]
        if self.interleave:  # pairs (2i, 2i+1)
            self.cos = torch.stack([cos, cos], -1).flatten(-2)
            self.sin = torch.stack([-sin, sin], -1).flatten(-2)
            self.swap = torch.arange(2 * half).view(half, 2).flip(-1).flatten()
        else:  # pairs (i, i + Dr/2)
            self.cos, self.sin = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
            self.swap = torch.arange(2 * half).roll(half)

    def at(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos2, sin2 [B, S, Dr] for positions [B, S]."""
        return self.cos[positions], self.sin[positions]

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return x * cos + x[..., self.swap] * sin

    def fused(self, x: Tensor, positions: Tensor, heads: int) -> Tensor:
        """x [B, S, heads*Dr] roped at positions [B, S] in one ONNX Runtime RotaryEmbedding node."""
        return RotaryOp.apply(x, positions, self.tables, heads, int(self.interleave))


class Group:
    """What every block of a group (the target's layers; one MTP depth) shares, computed once: dims, RoPE
    tables at the group's positions write_pos + 0..S-1 [B, S, Dr] (and broadcast over heads) and, in the onnx
    lowering, the attention Mask (the plugin attention node takes write_pos instead).  A tree's nodes sit at
    their own `positions` [B, S] (the root's position plus their depth) instead.  `fused`: ONNX Runtime's
    fused operators (exporters/ort_ops.py) for RoPE and the residual adds with their norms."""

    def __init__(self, rope: Rope, dims: Dims, write_pos: Tensor, mask: Mask | None, moe: str = "static",
                 positions: Tensor | None = None, tree_mask: Tensor | None = None, fused: bool = False,
                 cpu: bool = False, fold: bool = True, index_rope: Rope | None = None, gather: bool = False,
                 cpu_mlp: bool = False):
        self.rope, self.dims, self.write_pos, self.mask, self.fused = rope, dims, write_pos, mask, fused
        self.index_rope = index_rope  # DSA: the indexer's RoPE (its own pair layout)
        self.selection = None  # DSA: the last indexer's selection (sparse_selection), for layers that share it
        self.gather = gather  # DSA: attend to the selected rows gathered (few tokens) rather than masked
        self.fold = fold  # W^UK / W^UV folded into the projections where smaller (folded_mla)
        self.cpu = cpu  # mtp-trt's CPU operators (plugins/ort) for the attention (and, by self.moe, the MoE)
        self.cpu_mlp = cpu_mlp  # and for the dense MLPs (quantized exports: fp32 ones keep ONNX Runtime's MatMul)
        assert fused or not cpu, "the CPU operators take the fused graphs' flat queries"
        self.tree_mask = tree_mask  # plugin lowering: which new rows each new row sees [B, S, S] (None: causal)
        self.moe = moe  # the MoE form (exporters/moe.py FORMS)
        if positions is None:
            positions = write_pos[:, None].long() + torch.arange(dims.s)[None, :]
        self.positions = positions  # [B, S]
        if not fused:
            self.cos, self.sin = rope.at(self.positions)
            self.cos_h, self.sin_h = self.cos[:, :, None], self.sin[:, :, None]  # [B, S, 1, Dr]

    def rope_heads(self, x: Tensor, heads: int) -> Tensor:
        """x [B, S, H = heads, Dr] roped at the group's positions (heads: a Python int, not a traced size)."""
        if self.fused:
            return self.dims.view(self.rope.fused(x.flatten(2), self.positions, heads), heads, -1)
        return self.rope(x, self.cos_h, self.sin_h)

    def rope_rows(self, x: Tensor) -> Tensor:
        """x [B, S, Dr] (one head: k_pe) roped at the group's positions."""
        return self.rope.fused(x, self.positions, 1) if self.fused else self.rope(x, self.cos, self.sin)


# ------------------------------------------------------------------------- DeepSeek Sparse Attention
class TopK(torch.autograd.Function):
    """The min(k, n) largest of x [..., n] along its last axis -> (values, indices): one ONNX TopK whose K is
    computed from x's traced width (torch.topk's k would be fixed at the traced example's).  ONNX TopK keeps the
    earlier index among equal values."""

    @staticmethod
    def forward(ctx, x: Tensor, k: int) -> tuple[Tensor, Tensor]:
        return tuple(x.topk(min(k, x.shape[-1]), -1))

    @staticmethod
    def symbolic(g, x, k: int):
        n = g.op("Shape", x, start_i=-1)  # [1]
        kk = g.op("Min", n, g.op("Constant", value_t=torch.tensor([k], dtype=torch.int64)))
        return g.op("TopK", x, kk, axis_i=-1, largest_i=1, sorted_i=1, outputs=2)


def indexer_queries(indexer: Indexer, x: Tensor, c_q: Tensor, group: Group) -> tuple[Tensor, Tensor]:
    """The indexer's queries q [B, S, Hi, Di] (wq_b of the query latent c_q, roped on its first Dr dims at the group's
    positions) and head weights w [B, S, Hi] (weights_proj of the block's normed input x, times Hi^-1/2; fp32)."""
    cfg, dims = indexer.cfg, group.dims
    hi, di, dr = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    cos, sin = group.index_rope.at(group.positions)
    q = dims.view(indexer.wq_b(c_q), hi, di)  # [B, S, Hi, Di]
    q = torch.cat([group.index_rope(q[..., :dr], cos[:, :, None], sin[:, :, None]), q[..., dr:]], -1)
    return q, as_fp32(indexer.weights_proj(x)) * hi**-0.5


def sparse_selection(indexer: Indexer, x: Tensor, c_q: Tensor, keys: Tensor, cache: Tensor, group: Group):
    """DSA's selection for the group's queries (the model's Indexer and select_topk in standard operators) over the
    rows `attend` reads: the cache buffer's T, the mask's R extra rows, the S new rows.  x [B, S, D] the block's
    normed input, c_q [B, S, Dq] the query latent, keys [B, S, Di] the new rows' indexer keys, cache [B, T, C]
    (indexer keys after the latent).  -> the attention bias [B, S*H, T + R + S] (0 on the selected rows, -inf
    elsewhere), or, where the group gathers (few tokens: group.gather), the selected rows' indices [B, S, K] and
    whether each is visible [B, S, K] (K = min(index_topk, T + R + S))."""
    cfg, dims, mask = indexer.cfg, group.dims, group.mask
    hi, di, lat = cfg.index_n_heads, cfg.index_head_dim, cfg.latent_dim
    parts = [cache[..., lat:]] + ([] if mask.extra_rows is None else [mask.extra_rows[..., lat:]]) + [keys]
    k_all = as_fp32(torch.cat(parts, 1))  # [B, T + R + S, Di]
    q, w = indexer_queries(indexer, x, c_q, group)
    scores = F.relu(torch.matmul(as_fp32(dims.rows(q, di)), k_all.transpose(1, 2)) * di**-0.5)  # [B, S*Hi, T+R+S]
    index = torch.matmul(dims.view(w, 1, hi), dims.view(scores, hi, -1)).reshape(dims.b, dims.s, -1)  # [B, S, T+R+S]
    visible = mask.seen_rows()
    values, top = TopK.apply(torch.where(visible, index, float("-inf")), cfg.index_topk)  # [B, S, K]
    if group.gather:
        return top, values > float("-inf")
    picked = torch.zeros_like(index).scatter(-1, top, 1.0) > 0
    bias = torch.where(picked & visible, 0.0, float("-inf"))  # [B, S, T + R + S]
    token = torch.arange(dims.s * cfg.num_attention_heads) // cfg.num_attention_heads  # query row -> its token
    return bias[:, token]


def cpu_selection(indexer: Indexer, x: Tensor, c_q: Tensor, rows: Tensor, cache: Tensor, group: Group) -> Tensor:
    """DSA's selection as one mtp_trt.cpu::LightningIndexer node (exporters/ort_ops.py CpuIndexerOp) over the cache
    buffer's T rows and `rows` [B, R + S, C] (the mask's extra rows, then the new ones) -> [B, S, K] int32: indices
    into those T + R + S rows, -1 where fewer are visible (K = min(index_topk, T + R + S))."""
    cfg, mask = indexer.cfg, group.mask
    q, w = indexer_queries(indexer, x, c_q, group)
    return CpuIndexerOp.apply(group.dims.view(q, cfg.index_n_heads * cfg.index_head_dim), w, rows, cache,
                              mask.past_len, mask.visible, cfg.index_n_heads, cfg.index_topk,
                              cfg.index_head_dim**-0.5)


def attend_selected(q: Tensor, new_rows: Tensor, cache: Tensor, group: Group, top: Tensor, ok: Tensor,
                    kv_lora_rank: int, scale: float) -> Tensor:
    """Absorbed MLA over the selected rows only (DSA where the group gathers): each query token's K rows are
    gathered from the cache buffer, the mask's extra rows and the new rows, so the cost grows with K, not with T.
    q [B, S*H, Dl+Dr], new_rows [B, S, C], cache [B, T, C], top [B, S, K] (indices into T + R + S), ok [B, S, K]
    (visible) -> [B, S*H, Dl]."""
    dims, mask, width = group.dims, group.mask, q.shape[-1]
    rows = new_rows if mask.extra_rows is None else torch.cat([mask.extra_rows, new_rows], 1)  # [B, R + S, C]
    flat = top.reshape(dims.b, -1)  # [B, S*K]
    t, n_new = torch._shape_as_tensor(cache)[1], torch._shape_as_tensor(rows)[1]  # (traced sizes, as tensors)
    batch = torch.arange(dims.b)[:, None]
    in_cache = flat < t
    from_cache = cache[..., :width].reshape(-1, width)[batch * t + torch.where(in_cache, flat, 0)]
    from_rows = rows[..., :width].reshape(-1, width)[batch * n_new + torch.where(in_cache, 0, flat - t)]
    picked = torch.where(in_cache[..., None], from_cache, from_rows)  # [B, S*K, Dl+Dr]
    picked = as_fp32(picked).reshape(dims.b, dims.s, -1, width)  # [B, S, K, Dl+Dr]
    qf = as_fp32(q).reshape(dims.b, dims.s, -1, width)  # [B, S, H, Dl+Dr]
    scores = torch.matmul(qf, picked.transpose(2, 3)) * scale + torch.where(ok, 0.0, float("-inf"))[:, :, None]
    out = torch.matmul(scores.softmax(-1), picked[..., :kv_lora_rank])  # [B, S, H, Dl]
    return out.reshape(dims.b, -1, kv_lora_rank).to(q.dtype)


def indexer_keys(indexer: Indexer, x: Tensor, group: Group) -> Tensor:
    """The new rows' indexer keys [B, S, Di]: LayerNorm(wk x), roped on its first Dr dims (Indexer.keys)."""
    dr = indexer.cfg.qk_rope_head_dim
    k = indexer.k_norm(indexer.wk(x))
    cos, sin = group.index_rope.at(group.positions)
    return torch.cat([group.index_rope(k[..., :dr], cos, sin), k[..., dr:]], -1)


# ----------------------------------------------------------------------------------------- blocks
def linear_cat(x: Tensor, *layers: nn.Linear) -> Tensor:
    """Several linear layers on the same input as one matmul (outputs concatenated in order)."""
    bias = None if layers[0].bias is None else torch.cat([m.bias for m in layers])
    return F.linear(x, torch.cat([m.weight for m in layers]), bias)


def folded_mla(attn: MLA) -> tuple[Tensor | None, Tensor | None]:
    """W^UK folded into the query up-projection and W^UV into W^O, each only where the folded matrix is no
    larger than the two it replaces (a latent rank Dl no larger than the head dims, as in small models;
    DeepSeek-V3's Dl = 512 keeps the per-head matmuls).  Folded in fp32, cast to the weights' dtype.
      wq [H*(Dl+Dr), Dq]: per head, Dl absorbed-nope rows then the Dr rope rows (RoPE follows);
      wo [D, H*Dl]: attention output, heads concatenated -> the block's residual branch.
    -> (wq or None, wo or None)."""
    cfg = attn.cfg
    h, dn, dr, dl, dv = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
                         cfg.v_head_dim)
    w_uk, w_uv = (as_fp32(w) for w in attn.w_uk_uv())  # [H, Dn, Dl], [H, Dv, Dl]
    w_up = attn.q_proj.weight if cfg.q_lora_rank is None else attn.q_b_proj.weight  # [H*(Dn+Dr), Dq]
    dq, d = w_up.shape[1], cfg.hidden_size
    wq = wo = None
    if dq * dl <= dq * dn + dn * dl:
        w = as_fp32(w_up).view(h, dn + dr, dq)
        wq = torch.cat([w_uk.transpose(1, 2) @ w[:, :dn], w[:, dn:]], 1).reshape(h * (dl + dr), dq).to(w_up.dtype)
    if dl * d <= dv * d + dv * dl:
        w_o = as_fp32(attn.o_proj.weight).view(d, h, dv).transpose(0, 1)  # [H, D, Dv]
        wo = (w_o @ w_uv).transpose(0, 1).reshape(d, h * dl).to(attn.o_proj.weight.dtype)
    return wq, wo


def block_forward(layer: DecoderLayer, h: Tensor, group: Group, cache: Tensor, lowering: str,
                  new_rows: list | None = None) -> tuple[Tensor, Tensor]:
    """One decoder block with absorbed MLA over the persistent cache.  -> (h [B, S, D], commit): the new rows
    [B, S, Dl+Dr] in the onnx lowering, the cache with them written [B, T, Dl+Dr] in the plugin lowering.
    `new_rows`, if given, gets the new rows appended (either lowering)."""
    h, ffn, commit = block_parts(layer, h, None, group, cache, lowering, new_rows)
    return h + ffn, commit


def block_parts(layer: DecoderLayer, h: Tensor, delta: Tensor | None, group: Group, cache: Tensor, lowering: str,
                new_rows: list | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """block_forward on h + delta (the previous block's FFN branch, not yet added, so that the add and this
    block's input norm can be one node), its own FFN branch returned unadded: -> (h, ffn, commit)."""
    attn: MLA = layer.self_attn
    cfg, dims = attn.cfg, group.dims
    x, h = add_norm(h, delta, layer.input_layernorm, group.fused, group.cpu)
    if lowering == "onnx" and group.cpu and not cfg.dsa:  # one MlaSelfAttention node from the projections to W^UV
        o, latent = cpu_attention(attn, x, group, cache)
        if new_rows is not None:
            new_rows.append(latent)
    else:
        o, latent = attention(attn, x, group, cache, lowering, new_rows)
    x, h = add_norm(h, o, layer.post_attention_layernorm, group.fused, group.cpu)
    if isinstance(layer.mlp, MoE):
        ffn = moe_forward(layer.mlp, x, dims.b, dims.s, group.moe)
    else:
        ffn = cpu_mlp(layer.mlp, x) if group.cpu_mlp else swiglu(layer.mlp, x)
    return h, ffn, latent


def q_up(attn: MLA, wq: Tensor | None) -> tuple[Tensor, int]:
    """The query up-projection with its rows reordered for the fused graphs: every head's absorbed latent rows (wq,
    folded) or nope rows, then every head's rope rows (RoPE follows) -> (the matrix, the first part's rows per head)."""
    cfg = attn.cfg
    w_up = wq if wq is not None else attn.q_proj.weight if cfg.q_lora_rank is None else attn.q_b_proj.weight
    first = cfg.kv_lora_rank if wq is not None else cfg.qk_nope_head_dim
    w = w_up.view(cfg.num_attention_heads, first + cfg.qk_rope_head_dim, -1)
    return torch.cat([w[:, :first].flatten(0, 1), w[:, first:].flatten(0, 1)]), first


def cpu_attention(attn: MLA, x: Tensor, group: Group, cache: Tensor) -> tuple[Tensor, Tensor]:
    """MLA on the CPU operators (onnx lowering, no DeepSeek Sparse Attention): the projections, then one
    MlaSelfAttention node (exporters/ort_ops.py CpuMlaSelfOp) -> (the residual branch [B, S, D], the new rows)."""
    cfg, mask = attn.cfg, group.mask
    dl, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    if cfg.q_lora_rank is None:
        c_q, kv = x, attn.kv_a_proj_with_mqa(x)
    else:  # W^DQ and W^DKV in one matmul
        c_q, kv = linear_cat(x, attn.q_a_proj, attn.kv_a_proj_with_mqa).split([cfg.q_lora_rank, dl + dr], -1)
        c_q = cpu_norm(attn.q_a_layernorm, c_q, group.cpu)
    wq, wo = folded_mla(attn) if group.fold else (None, None)
    w_uk, w_uv = attn.w_uk_uv()
    q = F.linear(c_q, q_up(attn, wq)[0])
    o, latent = CpuMlaSelfOp.apply(q, kv, attn.kv_a_layernorm.weight, group.positions, cache, mask.past_len,
                                   mask.extra_rows, mask.visible, None if wq is not None else w_uk,
                                   None if wo is not None else w_uv, group.rope.tables, cfg.num_attention_heads,
                                   cfg.softmax_scale, attn.kv_a_layernorm.eps, int(group.rope.interleave))
    return (attn.o_proj(o) if wo is None else F.linear(o, wo, attn.o_proj.bias)), latent


def attention(attn: MLA, x: Tensor, group: Group, cache: Tensor, lowering: str,
              new_rows: list | None = None) -> tuple[Tensor, Tensor]:
    """MLA in the graphs' other forms (either lowering; DeepSeek Sparse Attention's included) -> (the residual
    branch [B, S, D], the lowering's commit: the new rows, or the cache with them written); `new_rows`: see
    block_forward."""
    cfg, dims = attn.cfg, group.dims
    nh, dn, dr, dl = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank is None:
        c_q, (c_kv, k_pe) = x, attn.kv_a_proj_with_mqa(x).split([dl, dr], -1)
    else:  # W^DQ and W^DKV in one matmul
        c_q, c_kv, k_pe = linear_cat(x, attn.q_a_proj, attn.kv_a_proj_with_mqa).split([cfg.q_lora_rank, dl, dr], -1)
        c_q = cpu_norm(attn.q_a_layernorm, c_q, group.cpu)
    wq, wo = folded_mla(attn) if group.fold else (None, None)
    w_uk, w_uv = attn.w_uk_uv()  # [H, Dn, Dl], [H, Dv, Dl] (unused where folded)
    if group.fused:  # rows reordered: every head's latent (folded) or nope rows, then every head's rope rows
        w_up, first = q_up(attn, wq)
        q_first, q_pe = F.linear(c_q, w_up).split([nh * first, nh * dr], -1)  # RoPE on q_pe as it comes
        q_pe = group.rope.fused(q_pe, group.positions, nh)
        q_lat = q_first if wq is not None else dims.view(torch.matmul(dims.view(q_first, nh, 1, dn), w_uk), nh * dl)
    else:
        if wq is not None:
            q_lat, q_pe = dims.view(F.linear(c_q, wq), nh, dl + dr).split([dl, dr], -1)
        else:  # per-head matmuls broadcast over B and S (MatMul rather than Einsum: ONNX's Einsum has no bf16)
            q = attn.q_proj(c_q) if cfg.q_lora_rank is None else attn.q_b_proj(c_q)
            q_nope, q_pe = dims.view(q, nh, dn + dr).split([dn, dr], -1)  # [B, S, H, Dn], [B, S, H, Dr]
            q_lat = torch.matmul(q_nope[..., None, :], w_uk)[..., 0, :]  # q_nope absorbed through W^UK
        q_pe = group.rope_heads(q_pe, nh)  # q_lat [B, S, H, Dl], q_pe [B, S, H, Dr]
    latent = torch.cat([attn.kv_a_layernorm(c_kv), group.rope_rows(k_pe)], -1)  # [B, S, Dl+Dr]
    indexer = getattr(attn, "indexer", None)  # DSA: this layer's own (None where it shares the previous selection)
    if cfg.dsa:  # the row continues with the indexer's key (zeros where the layer shares the previous selection)
        keys = indexer_keys(indexer, x, group) if indexer is not None else \
            torch.zeros_like(x[..., :1]).expand(-1, -1, cfg.index_head_dim)
        latent = torch.cat([latent, keys], -1)  # [B, S, C]
        if lowering == "plugin":  # the plugin selects (export refuses layers without their own indexer)
            index_qw = indexer_queries(indexer, x, c_q, group)
    if new_rows is not None:
        new_rows.append(latent)
    flat = lowering == "onnx" and group.cpu  # the CPU attention node: o_lat [B, S, H*Dl]
    if flat:
        mask = group.mask
        rows = latent if mask.extra_rows is None else torch.cat([mask.extra_rows, latent], 1)
        if indexer is not None:
            group.selection = cpu_selection(indexer, x, c_q, rows, cache, group)
        o_lat = CpuMlaOp.apply(q_lat, q_pe, rows, cache, mask.past_len, mask.visible, group.selection, nh,
                               cfg.softmax_scale)
    else:
        if indexer is not None and lowering != "plugin":
            group.selection = sparse_selection(indexer, x, c_q, keys, cache, group)
        q_abs = torch.cat([dims.view(q_lat, nh, dl), dims.view(q_pe, nh, dr)], -1)  # [B, S, H, Dl+Dr]
        if lowering == "plugin" and cfg.dsa:
            o_lat, latent = MlaSparseAttentionOp.apply(q_abs, latent, cache, group.write_pos, *index_qw, dl,
                                                       cfg.softmax_scale, cfg.index_topk, group.tree_mask)
        elif lowering == "plugin":
            o_lat, latent = MlaGenerationAttentionOp.apply(q_abs, latent, cache, group.write_pos, dl,
                                                           cfg.softmax_scale, group.tree_mask)
        else:
            q_rows = dims.rows(q_abs, dl + dr)
            if cfg.dsa and group.gather:
                o_lat = attend_selected(q_rows, latent, cache, group, *group.selection, dl, cfg.softmax_scale)
            else:  # [B, S*H, Dl]
                o_lat = attend(q_rows, latent, cache, group.mask, dl, cfg.softmax_scale, group.selection)
    if wo is not None:
        o = F.linear(o_lat if flat else dims.view(o_lat, nh * dl), wo, attn.o_proj.bias)
    else:
        o = torch.matmul(dims.view(o_lat, nh, 1, dl), w_uv.transpose(1, 2))  # W^UV: [B, S, H, 1, Dv]
        o = attn.o_proj(dims.view(o, nh * cfg.v_head_dim))
    return o, latent


# ----------------------------------------------------------------------------------------- graphs
def main_forward(m: DeepseekV3, group: Group, input_ids, caches, lowering: str, new_rows: list | None = None):
    """The main model: (hidden [B, S, D] after the final norm, logits [B, S, V] fp32, commit per layer);
    `new_rows`: see block_forward."""
    h, ffn = m.model.embed_tokens(input_ids), None
    commits = []
    for layer, cache in zip(m.model.layers, caches):
        h, ffn, commit = block_parts(layer, h, ffn, group, cache, lowering, new_rows)
        commits.append(commit)
    h = add_norm(h, ffn, m.model.norm, group.fused, group.cpu)[0]
    return h, m.lm_head(h).float(), commits


def mtp_block(m: DeepseekV3, k: int, hidden, next_tokens, group: Group, cache, lowering: str,
              first_row: bool = True):
    """MTP module k on the group's rows: h' = eh_proj([enorm(emb); hnorm(hidden)]) then its block.
    -> (hidden_out [B, S, D] before shared_head.norm, commit).  first_row: whether a row may sit at position 0,
    whose embedding is zeroed (not in an eagle step or tree, whose rows start at past_len >= 1)."""
    layer = m.mtp[k]
    emb = m.model.embed_tokens(next_tokens)
    if first_row:
        emb = emb * (group.positions != 0)[..., None].to(hidden.dtype)
    normed = [cpu_norm(layer.enorm, emb, group.cpu), cpu_norm(layer.hnorm, hidden, group.cpu)]
    h = layer.eh_proj(torch.cat(normed, dim=-1))
    return block_forward(layer, h, group, cache, lowering)


def row_at(h: Tensor, index: Tensor, width: int) -> Tensor:
    """h [B, S, width] at one row per sequence, index [B] -> [B, 1, width]."""
    return h.gather(1, index[:, None, None].expand(-1, 1, width))


def draft_token(m: DeepseekV3, k: int, h: Tensor, cpu: bool = False) -> Tensor:
    """MTP module k's greedy draft from its output hidden state h [B, 1, D] -> [B, 1] int32 (cpu: its norm as
    mtp-trt's RmsNorm node)."""
    return m.lm_head(cpu_norm(m.mtp[k].shared_head.norm, h, cpu)).float().argmax(-1).to(torch.int32)


class _Graph(nn.Module):
    few_tokens = False  # S is small and fixed (the step graphs): the plugin lowering's MoE gathers experts

    def __init__(self, model: DeepseekV3, lowering: str, think_ids: tuple[int, int] = (-1, -1)):
        super().__init__()
        self.model, self.lowering, self.think_ids, self.rope = model, lowering, think_ids, Rope(model)
        self.index_rope = Rope(model, model.cfg.index_rope_interleave) if model.cfg.dsa else None
        self.moe = "ort" if lowering == "onnx" else "gather" if self.few_tokens else "static"
        self.fused = lowering == "onnx"  # ONNX Runtime's fused operators (exporters/ort_ops.py); off for TensorRT
        self.cpu = False  # mtp-trt's CPU operators (plugins/ort) for attention; export.py sets it with the MoE form
        self.cpu_mlp = False  # and for the dense MLPs (export.py: quantized exports)
        # folded_mla where it is smaller; off for quantized weights (export.configure), whose projections are then
        # all quantized matmuls that give every row the same bits however many rows run
        self.fold = True

    def group(self, b, s, write_pos: Tensor, past_len: Tensor, cache: Tensor,
              extra: tuple[Tensor, Tensor] | None = None, new_visible: Tensor | None = None,
              positions: Tensor | None = None) -> Group:
        """The block group of S rows per sequence at write_pos + 0..S-1 (or `positions`) over `cache` (past_len
        committed rows); extra / new_visible: see Mask."""
        dims = Dims(b, s)
        heads = self.model.cfg.num_attention_heads
        if self.lowering == "onnx":
            return Group(self.rope, dims, write_pos, Mask(dims, heads, past_len, cache.shape[1], extra, new_visible),
                         self.moe, positions, fused=self.fused, cpu=self.cpu, fold=self.fold,
                         index_rope=self.index_rope, gather=self.few_tokens, cpu_mlp=self.cpu_mlp)
        return Group(self.rope, dims, write_pos, None, self.moe, positions, new_visible, fold=self.fold,
                     index_rope=self.index_rope)

    def main(self, input_ids: Tensor, past_len: Tensor, caches) -> tuple[Group, Tensor, Tensor, list[Tensor]]:
        """The main model over the S rows at past_len (one block group) -> (group, hidden, logits, new rows)."""
        group = self.group(*input_ids.shape, past_len, past_len, caches[0])
        return (group, *main_forward(self.model, group, input_ids, caches, self.lowering))

    def accept(self, logits, input_ids, thinking, relaxed_topk, relaxed_delta):
        """In-graph acceptance of input_ids[:, 1:] -> (accepted_tokens, num_accepted, thinking_out); relaxed_topk
        and relaxed_delta None: strict (the CPU operators' node only)."""
        if self.lowering == "onnx" and self.cpu:
            return CpuAcceptOp.apply(logits, input_ids, thinking, relaxed_topk, relaxed_delta, *self.think_ids)
        return accept_op(self.lowering)(logits, input_ids, thinking, relaxed_topk, relaxed_delta, *self.think_ids)


class TargetGraph(_Graph):
    """Main model for prefill (S prompt tokens) and verification (S = K + 1), with acceptance in-graph.
    Inputs and outputs: contract.target_io (mtp_trt/contract.py)."""

    def forward(self, input_ids, past_len, thinking, relaxed_topk, relaxed_delta, *caches):
        _, h, logits, commits = self.main(input_ids, past_len, caches)
        accepted, num, thinking_out = self.accept(logits, input_ids, thinking, relaxed_topk, relaxed_delta)
        return (accepted, num, thinking_out, logits.argmax(-1).to(torch.int32), h, logits, *commits)


class MtpGraph(_Graph):
    """One MTP module over its own latent cache.  Inputs and outputs: contract.mtp_io (mtp_trt/contract.py);
    draft_probs is the softmax probability of the draft."""

    def __init__(self, model: DeepseekV3, k: int, lowering: str):
        super().__init__(model, lowering)
        self.k = k

    def forward(self, hidden, next_tokens, past_len, cache):
        m = self.model
        group = self.group(*next_tokens.shape, past_len, past_len, cache)
        h, commit = mtp_block(m, self.k, hidden, next_tokens, group, cache, self.lowering)
        logits = m.lm_head(cpu_norm(m.mtp[self.k].shared_head.norm, h, group.cpu)).float()
        probs, tokens = logits.softmax(-1).max(-1)
        return h, tokens.to(torch.int32), probs, logits, commit


class StepGraph(_Graph):
    """One whole greedy decode step in one call.  K > 0 (eagle): verify and accept, then MTP depth 1 over
    the K + 1 verified rows and depths 2..K one row each, drafting the next step's K tokens.  K = 0 (both
    modes): plain decoding, the main model and its argmax, with no acceptance to compute.

    Inputs and outputs: contract.step_io (mtp_trt/contract.py); the onnx lowering commits depth 1's rows of the
    MTP cache (the deeper rows are speculative and need no commit).  In the plugin lowering every attention node
    writes its rows in place, depth k at row past_len + num_accepted + k - 1, the MTP depths one after another
    through the cache (depth k's cache input is depth k-1's kv_cache_out)."""

    few_tokens = True

    def __init__(self, model: DeepseekV3, nextn: int, lowering: str, think_ids: tuple[int, int]):
        super().__init__(model, lowering, think_ids)
        self.nextn = nextn

    def forward(self, input_ids, past_len, thinking, *rest):
        m, layers = self.model, len(self.model.model.layers)
        (relaxed_topk, relaxed_delta), caches = (rest[:2], rest[2:]) if self.nextn else ((None, None), rest)
        b, s = input_ids.shape
        group, h, logits, commits = self.main(input_ids, past_len, caches[:layers])  # MTP depth 1's group too
        if self.nextn == 0 and self.lowering == "onnx" and self.cpu:  # the argmax and its flag in one node
            return (*self.accept(logits, input_ids, thinking, None, None), *commits)
        if self.nextn == 0:
            token = logits.argmax(-1).to(torch.int32)  # [B, 1]
            flag = flag_after(thinking[:, None] != 0, token, *self.think_ids)[:, 0].to(torch.int32)
            return (token, torch.zeros_like(past_len), flag, *commits)
        accepted, num, thinking_out = self.accept(logits, input_ids, thinking, relaxed_topk, relaxed_delta)
        cache = caches[layers]
        h1, commit1 = mtp_block(m, 0, h, accepted.clamp(min=0), group, cache, self.lowering, first_row=False)
        h_prev = row_at(h1, num.long(), m.cfg.hidden_size)  # row past_len + num
        d = draft_token(m, 0, h_prev, self.cpu)  # [B, 1]
        drafts = [d]
        plugin = self.lowering == "plugin"
        mtp_cache = commit1 if plugin else cache  # plugin: each depth writes into the previous depth's output
        extra = None if plugin else (commit1, torch.arange(s)[None, :] <= num[:, None])  # depth 1's accepted rows
        for k in range(2, self.nextn + 1):
            group_k = self.group(b, 1, past_len + num + (k - 1), past_len, cache, extra)
            h_prev, commit = mtp_block(m, 0, h_prev, d, group_k, mtp_cache, self.lowering, first_row=False)
            d = draft_token(m, 0, h_prev, self.cpu)
            drafts.append(d)
            if plugin:
                mtp_cache = commit
            else:
                extra = (torch.cat([extra[0], commit], 1),
                         torch.cat([extra[1], torch.ones_like(d, dtype=torch.bool)], 1))
        return (accepted, num, thinking_out, torch.cat(drafts, 1), *commits, mtp_cache if plugin else commit1)


class VanillaStepGraph(_Graph):
    """One whole greedy vanilla decode step in one call: verify and accept, then MTP module k (k = 1..K) over
    its window of K + k rows, each module with its own cache.

    Window of depth k: rows start_k = past_len + 1 - k onwards (its cache holds rows < start_k: the
    runtime's invariant mtp_past_len[k] = past_len + 1 - k), row j embedding the token at position
    past_len + 1 + j -- an accepted token for j <= num_accepted, else the draft of depth j - num_accepted
    made earlier in this step -- with depth k-1's hidden state at the same row: `carry` for the first row
    (kept from the previous step), then depth k-1's window.  Depth k drafts from row
    q = past_len + num_accepted (window row num_accepted + k - 1); rows up to q + 1 - k (window rows
    0..num_accepted) hold only accepted tokens: the next step starts after them.

    Inputs and outputs: contract.vanilla_step_io (mtp_trt/contract.py): carry (K > 1) holds, for k = 1..K-1,
    depth k's hidden at row past_len - k (the first row of depth k+1's window, from the previous step), carry_out
    depth k's hidden at window row num_accepted (the next step's carry); the onnx lowering's rows of depth k are
    committed from start_k: the first num_accepted + 1 are final, later ones are overwritten next step."""

    few_tokens = True

    def __init__(self, model: DeepseekV3, nextn: int, lowering: str, think_ids: tuple[int, int]):
        super().__init__(model, lowering, think_ids)
        self.nextn = nextn

    def forward(self, input_ids, past_len, thinking, relaxed_topk, relaxed_delta, *rest):
        m, layers, k_max = self.model, len(self.model.model.layers), self.nextn
        caches, mtp_caches = rest[:layers], rest[layers:layers + k_max]
        carry = rest[layers + k_max] if k_max > 1 else None
        b = input_ids.shape[0]
        _, h, logits, commits = self.main(input_ids, past_len, caches)
        accepted, num, thinking_out = self.accept(logits, input_ids, thinking, relaxed_topk, relaxed_delta)
        a, n = accepted.clamp(min=0), num.long()[:, None]  # tokens at positions past_len + 1 ..
        hidden, drafts, carry_out, mtp_commits = h, [], [], []
        for k in range(1, k_max + 1):
            j = torch.arange(k_max + k)[None, :]  # window rows
            if k == 1:
                tokens = a
            else:  # accepted tokens, then this step's drafts (a's tail only pads: those rows are never read)
                later = torch.cat(drafts, 1).gather(1, (j - n - 1).clamp(0, k - 2))
                tokens = torch.where(j <= n, torch.cat([a, a[:, :k - 1]], 1), later)
                hidden = torch.cat([carry[:, k - 2:k - 1], hidden], 1)
            start = past_len + 1 - k
            mtp_group = self.group(b, k_max + k, start, start, mtp_caches[k - 1])
            h_k, commit = mtp_block(m, k - 1, hidden, tokens, mtp_group, mtp_caches[k - 1], self.lowering)
            drafts.append(draft_token(m, k - 1, row_at(h_k, n[:, 0] + k - 1, m.cfg.hidden_size), self.cpu))  # row q
            if k < k_max:
                carry_out.append(row_at(h_k, n[:, 0], m.cfg.hidden_size))
            hidden = h_k
            mtp_commits.append(commit)
        outs = (accepted, num, thinking_out, torch.cat(drafts, 1)) + ((torch.cat(carry_out, 1),) if carry_out else ())
        return outs + (*commits, *mtp_commits)
