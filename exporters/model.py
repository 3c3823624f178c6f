"""DeepSeek-V3 and its Multi-Token Prediction (MTP) modules: the PyTorch reference model.

Every supported architecture (mtp_trt/config.py FAMILIES: DeepSeek-V3, DeepSeek-V2, GLM-4.7-Flash, DeepSeek-V3.2,
GLM-5) is this model with its config mapped onto ModelConfig's fields.

Read top-down, in dependency order: RMSNorm, RoPE, Indexer (DeepSeek Sparse Attention), MLA (Multi-head Latent
Attention), MLP, Gate, MoE, DecoderLayer, MTPLayer, DeepseekV3.  Module and parameter names are the checkpoint's
(Hugging Face / DeepSeek), so `state_dict()` keys are tensor names; the DeepSeek-V3 paper's symbols
are given beside them.  Shapes: B batch, S new tokens, T cached tokens, H heads, D hidden size,
Dn/Dr/Dv the nope/rope/value head dims, Dl = kv_lora_rank, V vocabulary, E routed experts.

The per-layer KV cache is the compressed latent of MLA: `Dl + Dr` values per token, the normed
c_kv followed by the roped k_pe (the rope dims in the checkpoint's own pair layout); with DeepSeek Sparse
Attention (DSA: DeepSeek-V3.2, GLM-5) each row continues with the lightning indexer's key (`Di` values;
zeros in a layer that shares the previous layer's selection), so that one row per token holds everything
a later token reads, written and rewound as one.  DSA: a query attends only to the `index_topk` visible
rows its layer's indexer scores highest (every visible row while there are at most `index_topk`: then
it is dense MLA exactly).  Attention
runs in two forms that compute the same function:
  * expanded (prefill): keys and values are expanded per head through W^UK and W^UV;
  * absorbed (generation): W^UK is absorbed into the query and W^UV applied after attention, so
    attention reads only the latent cache (the form the MLA generation plugin implements).

MTP convention (as vLLM and TensorRT-LLM run the official weights): MTP row i, at RoPE position
i, takes the hidden state h_i that predicted token t_{i+1} and the embedding of t_{i+1} (zeroed at
position 0) and predicts t_{i+2}:  h'_i = eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)]).  Depth 1
takes h_i from the main model *after* its final norm; deeper steps (eagle mode reuses one module)
take the MTP block's output before `shared_head.norm`.  Embedding and output head are shared
with the main model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mtp_trt.config import ModelConfig

Tensor = torch.Tensor
# q_a_layernorm and kv_a_layernorm keep RMSNorm's default eps whatever rms_norm_eps says, as transformers'
# DeepSeek-V2/V3 and GLM-4.7-Flash classes and DeepSeek's reference code build them.
LATENT_NORM_EPS = 1e-6


def as_fp32(x: Tensor) -> Tensor:
    """x in fp32; an fp32 tensor as is (.float() would return it too, but the tracer records a Cast node,
    and a plugin node after it would receive the Cast instead of the graph's input)."""
    return x if x.dtype == torch.float32 else x.float()


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back before the weight (as DeepSeek and HF do)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm's arithmetic (also traced inside exporters/ort_ops.py's fused add + norm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


# ---------------------------------------------------------------------------------------- RoPE
def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Inverse frequencies [Dr/2], YaRN-blended between interpolation and extrapolation."""
    rope, dim = cfg.rope, cfg.qk_rope_head_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if rope.type != "yarn":
        return inv_freq

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    return inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)


def rope_tables(cfg: ModelConfig, max_positions: int) -> tuple[Tensor, Tensor]:
    """cos, sin [max_positions, Dr/2], already multiplied by YaRN's attention factor."""
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * rope_inv_freq(cfg)[None, :]
    return freqs.cos() * cfg.rope.attention_factor, freqs.sin() * cfg.rope.attention_factor


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleave: bool) -> Tensor:
    """Rotate x [..., Dr] by cos/sin [..., Dr/2] (broadcast over heads by the caller).

    interleave=True: DeepSeek's layout, pairs (x[2i], x[2i+1]); False: halves (x[i], x[i + Dr/2]).
    The output keeps the input's layout, so q·k is the same whatever the layout."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention_mask(past_len: Tensor, past_rows: int, new_rows: int) -> Tensor:
    """Bool mask [B, S, T + S]: query s of sequence b sees cached rows < past_len[b] and new rows <= s."""
    b = past_len.shape[0]
    cached = torch.arange(past_rows)[None, None, :] < past_len[:, None, None]  # [B, 1, T]
    causal = torch.ones(new_rows, new_rows, dtype=torch.bool).tril()  # [S, S]
    return torch.cat([cached.expand(b, new_rows, past_rows), causal.expand(b, new_rows, new_rows)], dim=-1)


# ------------------------------------------------------------------------------------- Indexer
class Indexer(nn.Module):
    """The lightning indexer of DeepSeek Sparse Attention (DeepSeek-V3.2 §2.1): per query s and cached row t,
    I[s, t] = sum_j w[s, j] * ReLU(q[s, j] · k[t] / sqrt(Di)), with Hi indexer heads j:
      q = W^IQ c_q (wq_b, from MLA's query latent c_q) [B, S, Hi, Di], k = LayerNorm(W^IK h) (wk, k_norm) [B, T, Di],
      both roped on their first Dr dims (the pair layout: cfg.index_rope_interleave), w = weights_proj(h) / sqrt(Hi).
    Scores in fp32, as transformers and DeepSeek's reference code compute them (without its FP8 and Hadamard
    rotation, which leave q·k unchanged up to rounding)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, cfg.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [..., Di] with its first Dr dims roped (cos/sin already broadcast to x's leading dims)."""
        dr = self.cfg.qk_rope_head_dim
        return torch.cat([apply_rope(x[..., :dr], cos, sin, self.cfg.index_rope_interleave), x[..., dr:]], -1)

    def keys(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B, S, D] -> the rows' indexer keys [B, S, Di] (what the cache keeps)."""
        return self.rope(self.k_norm(self.wk(x)), cos, sin)

    def forward(self, x: Tensor, c_q: Tensor, cos: Tensor, sin: Tensor, keys: Tensor) -> Tensor:
        """x [B, S, D], c_q [B, S, Dq], keys [B, T, Di] -> index scores I [B, S, T] (fp32)."""
        cfg = self.cfg
        q = self.rope(self.wq_b(c_q).unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim)), cos[:, :, None],
                      sin[:, :, None])  # [B, S, Hi, Di]
        scores = F.relu(torch.einsum("bshd,btd->bsht", q.float(), keys.float()) * cfg.index_head_dim**-0.5)
        w = self.weights_proj(x).float() * cfg.index_n_heads**-0.5  # [B, S, Hi]
        return torch.einsum("bsh,bsht->bst", w, scores)


def select_topk(scores: Tensor, visible: Tensor, k: int) -> Tensor:
    """DSA's selection: of the visible rows (visible [B, S, T] bool), the k with the highest index scores
    [B, S, T] (all of them where at most k are visible) -> [B, S, T] bool.  torch.topk breaks exact ties, as
    transformers' classes do."""
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.topk(min(k, scores.shape[-1]), -1).indices
    return visible & torch.zeros_like(visible).scatter(-1, top, True)


# ----------------------------------------------------------------------------------------- MLA
class MLA(nn.Module):
    """Multi-head Latent Attention (DeepSeek-V2 §2.1, V3 §2.1.1).

    queries: c_q = RMSNorm(W^DQ h)    (q_a_proj, q_a_layernorm)    [B, S, Dq]
             [q_nope; q_pe] = W^UQ c_q (q_b_proj; or q_proj from h when q_lora_rank is None)
    latent:  [c_kv; k_pe] = W^DKV h    (kv_a_proj_with_mqa); c_kv normed (kv_a_layernorm), k_pe roped
    per head W^UK [Dn, Dl], W^UV [Dv, Dl] (kv_b_proj rows, head-major); output W^O (o_proj).
    DSA: the indexer (in a layer that has its own) picks the rows each query attends to; see Indexer.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int = 0):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.num_attention_heads, cfg.hidden_size
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.latent_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, d, bias=cfg.attention_bias)
        if cfg.has_indexer(layer_id):
            self.indexer = Indexer(cfg)

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [B, S, D], cos/sin [B, S, Dr/2] -> q_nope [B, S, H, Dn], q_pe [B, S, H, Dr], latent [B, S, Dl+Dr] and
        the query latent c_q [B, S, Dq] (x itself without q LoRA)."""
        cfg = self.cfg
        c_q = x if cfg.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(c_q)
        q = q.unflatten(-1, (cfg.num_attention_heads, cfg.qk_head_dim))
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos[:, :, None], sin[:, :, None], cfg.rope_interleave)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), apply_rope(k_pe, cos, sin, cfg.rope_interleave)], dim=-1)
        return q_nope, q_pe, latent, c_q

    def w_uk_uv(self) -> tuple[Tensor, Tensor]:
        """W^UK [H, Dn, Dl] and W^UV [H, Dv, Dl], views of kv_b_proj.weight."""
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim:]

    def attend_expanded(self, q_nope: Tensor, q_pe: Tensor, kv: Tensor, mask: Tensor | None) -> Tensor:
        """Expanded form. kv [B, T, Dl+Dr] (all visible rows), mask [B, S, T] or None (causal) -> [B, S, H, Dv]."""
        cfg = self.cfg
        c_kv, k_pe = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        k_nope, v = self.kv_b_proj(c_kv).unflatten(-1, (cfg.num_attention_heads, -1)).split(
            [cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)  # [B, T, H, Dn], [B, T, H, Dv]
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)  # [B, H, S, Dn+Dr]
        k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, cfg.num_attention_heads, -1)], dim=-1).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v.transpose(1, 2), attn_mask=None if mask is None else mask[:, None],
            is_causal=mask is None, scale=cfg.softmax_scale)
        return out.transpose(1, 2)

    def attend_absorbed(self, q_nope: Tensor, q_pe: Tensor, kv: Tensor, mask: Tensor) -> Tensor:
        """Absorbed form over the latent rows only. kv [B, T, Dl+Dr], mask [B, S, T] -> [B, S, H, Dv]."""
        cfg = self.cfg
        w_uk, w_uv = self.w_uk_uv()
        q_lat = torch.einsum("bshd,hdc->bshc", q_nope, w_uk)  # q_nope absorbed through W^UK: [B, S, H, Dl]
        q_abs = torch.cat([q_lat, q_pe], dim=-1)  # [B, S, H, Dl+Dr]: what the generation plugin takes
        o_lat = latent_attention(q_abs, kv, mask, cfg.kv_lora_rank, cfg.softmax_scale)  # [B, S, H, Dl]
        return torch.einsum("bshc,hvc->bshv", o_lat, w_uv)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, past: Tensor | None = None,
                mask: Tensor | None = None, absorbed: bool = False,
                selected: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """x [B, S, D]; past [B, T, C] cached rows (C = cfg.cache_dim); mask [B, S, T+S] (None: causal, no past);
        selected [B, S, T+S]: the rows the previous layer's indexer picked (DSA, for a layer that shares them).

        Returns the attention output [B, S, D], the new cache rows [B, S, C] and (DSA) the rows this layer's
        queries attended to [B, S, T+S]."""
        cfg = self.cfg
        q_nope, q_pe, latent, c_q = self.project(x, cos, sin)
        if cfg.dsa:
            keys = self.indexer.keys(x, cos, sin) if hasattr(self, "indexer") else \
                latent.new_zeros(*latent.shape[:2], cfg.index_head_dim)
            latent = torch.cat([latent, keys], -1)
        kv = latent if past is None else torch.cat([past, latent], dim=1)
        if mask is None and (absorbed or cfg.dsa):
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril().expand(x.shape[0], -1, -1)
        if hasattr(self, "indexer"):
            selected = select_topk(self.indexer(x, c_q, cos, sin, kv[..., cfg.latent_dim:]), mask, cfg.index_topk)
        if cfg.dsa:
            mask = selected
        rows = kv[..., :cfg.latent_dim]
        attend = self.attend_absorbed if absorbed else self.attend_expanded
        o = attend(q_nope, q_pe, rows, mask)
        return self.o_proj(o.flatten(-2)), latent, selected


def latent_attention(q: Tensor, kv: Tensor, mask: Tensor, kv_lora_rank: int, scale: float) -> Tensor:
    """MLA generation attention: q [B, S, H, Dl+Dr] · rows kv [B, T, Dl+Dr]; V = rows[..., :Dl].

    mask [B, S, T] (True: visible) -> [B, S, H, Dl], softmax in fp32."""
    scores = torch.einsum("bshc,btc->bsht", q.float(), kv.float()) * scale
    scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
    return torch.einsum("bsht,btc->bshc", scores.softmax(-1), kv[..., :kv_lora_rank].float()).to(q.dtype)


# ----------------------------------------------------------------------------------- MLP / MoE
class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)); dense layers, experts and shared experts."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter_dim, bias=False)
        self.up_proj = nn.Linear(dim, inter_dim, bias=False)
        self.down_proj = nn.Linear(inter_dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    """Routing (V3 §2.1.2): s = sigmoid(u·e) (or softmax for V2-style configs); top-k over s + b
    (b = e_score_correction_bias, noaux_tc) restricted to the top `topk_group` of `n_group` groups;
    gating weights from s (not s + b), normalized if norm_topk_prob, times routed_scaling_factor."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts), requires_grad=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [..., D] -> weights [..., k] (fp32), expert indices [..., k]."""
        cfg = self.cfg
        scores, idx = self.select(x)
        weights = scores.gather(-1, idx)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights if cfg.routed_scaling_factor == 1.0 else weights * cfg.routed_scaling_factor, idx

    def select(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [..., D] -> scores s [..., E] (fp32), the selected experts [..., k]."""
        bias = self.e_score_correction_bias if self.cfg.topk_method == "noaux_tc" else None
        return select_experts(x, self.weight, bias, *self.routing())

    def routing(self) -> tuple[int, int, int, bool, bool]:
        """select_experts' (k, n_group, topk_group, softmax, group_top2) for this config."""
        cfg = self.cfg
        grouped = cfg.n_group > 1 and cfg.topk_method != "greedy"
        return (cfg.num_experts_per_tok, cfg.n_group if grouped else 1, cfg.topk_group if grouped else 1,
                cfg.scoring_func != "sigmoid", cfg.topk_method == "noaux_tc")


def select_experts(x: Tensor, weight: Tensor, bias: Tensor | None, k: int, n_group: int, topk_group: int,
                   softmax: bool, group_top2: bool) -> tuple[Tensor, Tensor]:
    """The router's choice (Gate): scores s = sigmoid(x W^T) (softmax if `softmax`) [..., E] fp32; the top k of
    s + bias among the experts of the top `topk_group` of `n_group` groups (a group's score: the sum of its two
    best if group_top2, else its best) [..., k]."""
    logits = F.linear(as_fp32(x), as_fp32(weight))  # [..., E]
    scores = logits.softmax(-1) if softmax else logits.sigmoid()
    choice = scores if bias is None else scores + as_fp32(bias)
    if n_group > 1:
        experts = torch.arange(weight.shape[0])
        grouped = choice[..., experts.view(n_group, -1)]  # [..., G, E/G] (a gather: no reshape)
        group_of = experts // (weight.shape[0] // n_group)  # [E]
        group_scores = grouped.topk(2, -1)[0].sum(-1) if group_top2 else grouped.amax(-1)
        top = group_scores.topk(topk_group, -1)[1]  # [..., topk_group]
        keep = (top[..., None] == torch.arange(n_group)).any(-2)  # [..., G] (one-hot: traces to ONNX)
        choice = choice.masked_fill(~keep[..., group_of], float("-inf"))
    return scores, choice.topk(k, -1)[1]


class MoE(nn.Module):
    """DeepSeekMoE: shared experts on every token plus the gated top-k of the routed experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Gate(cfg)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size)
                                     for _ in range(cfg.n_routed_experts))
        if cfg.n_shared_experts:
            self.shared_experts = MLP(cfg.hidden_size, cfg.n_shared_experts * cfg.moe_intermediate_size)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, idx = self.gate(x)
        y = torch.zeros_like(x)
        for e in idx.unique().tolist():
            token, slot = torch.where(idx == e)
            y.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None].to(x.dtype))
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(x)
        return y.view(shape)


# -------------------------------------------------------------------------------------- blocks
class DecoderLayer(nn.Module):
    """Pre-norm block: h += MLA(norm(h)); h += FFN(norm(h)), FFN dense or MoE as ModelConfig.is_moe_layer says."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = MLA(cfg, layer_id)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_id) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, past: Tensor | None, mask: Tensor | None,
                absorbed: bool, selected: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """-> (h, the new cache rows, DSA's selected rows: see MLA.forward)."""
        a, latent, selected = self.self_attn(self.input_layernorm(h), cos, sin, past, mask, absorbed, selected)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h)), latent, selected


class MTPLayer(DecoderLayer):
    """MTP module k (V3 §2.2), stored as `model.layers.{N + k - 1}`: enorm, hnorm, eh_proj (M_k),
    one decoder block (TRM_k), and shared_head.norm before the shared output head."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__(cfg, layer_id)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: Tensor, emb: Tensor, cos: Tensor, sin: Tensor, past: Tensor | None,
                mask: Tensor | None, absorbed: bool) -> tuple[Tensor, Tensor]:
        """h [B, S, D] previous depth's hidden, emb [B, S, D] embedding of the shifted tokens -> (h, new cache
        rows); with DSA the block runs its own indexer."""
        h = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        return super().forward(h, cos, sin, past, mask, absorbed)[:2]


class Backbone(nn.Module):
    """`model.*` in the checkpoint: embed_tokens, layers, norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3(nn.Module):
    """The main model plus `nextn` MTP modules (default: all the config declares).

    Caches are lists of per-layer rows [B, T, C] (C = cfg.cache_dim: the latent, then DSA's indexer key);
    `past_len` [B] says how many of the T rows are valid for each sequence, and the S new tokens sit at positions
    past_len + 0..S-1.
    """

    def __init__(self, cfg: ModelConfig, nextn: int | None = None, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.nextn = cfg.num_nextn_predict_layers if nextn is None else nextn
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = nn.ModuleList(MTPLayer(cfg, cfg.num_hidden_layers + k) for k in range(self.nextn))
        cos, sin = rope_tables(cfg, max_positions or cfg.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self, std: float = 0.02) -> DeepseekV3:
        """Random init for training from scratch: N(0, std) matrices, unit norms, zero biases."""
        for name, p in self.named_parameters():
            if name.endswith("e_score_correction_bias") or p.dim() == 1 and "norm" not in name:
                nn.init.zeros_(p)
            elif p.dim() == 1:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=std)
        return self

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [B, S, Dr/2] for positions [B, S], in the model's dtype (computed in fp32, as HF does)."""
        dtype = self.model.embed_tokens.weight.dtype
        return self.rope_cos[positions].to(dtype), self.rope_sin[positions].to(dtype)

    @staticmethod
    def _positions_mask(tokens: Tensor, past: list[Tensor] | None, past_len: Tensor | None):
        b, s = tokens.shape
        if past is None:
            return torch.arange(s).expand(b, s), None
        if past_len is None:
            past_len = torch.full((b,), past[0].shape[1], dtype=torch.long)
        return past_len[:, None] + torch.arange(s), attention_mask(past_len, past[0].shape[1], s)

    def forward(self, tokens: Tensor, past: list[Tensor] | None = None, past_len: Tensor | None = None,
                absorbed: bool = False) -> tuple[Tensor, Tensor, list[Tensor]]:
        """tokens [B, S] -> logits [B, S, V] (fp32), hidden [B, S, D] after the final norm, new cache rows
        per layer [B, S, C].  With past=None the S tokens start at position 0."""
        positions, mask = self._positions_mask(tokens, past, past_len)
        cos, sin = self.rope(positions)
        h = self.model.embed_tokens(tokens)
        latents, selected = [], None
        for i, layer in enumerate(self.model.layers):
            h, latent, selected = layer(h, cos, sin, None if past is None else past[i], mask, absorbed, selected)
            latents.append(latent)
        h = self.model.norm(h)
        return self.lm_head(h).float(), h, latents

    def mtp_forward(self, k: int, hidden: Tensor, next_tokens: Tensor, past: Tensor | None = None,
                    past_len: Tensor | None = None, absorbed: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """MTP module k (0-based) on rows i = past_len + 0..S-1: hidden h_i [B, S, D] and next_tokens
        t_{i+1} [B, S] -> logits [B, S, V] for t_{i+2}, the block's output hidden [B, S, D] (before
        shared_head.norm: the next depth's input), and the new cache rows [B, S, C]."""
        layer = self.mtp[k]
        positions, mask = self._positions_mask(next_tokens, None if past is None else [past], past_len)
        cos, sin = self.rope(positions)
        emb = self.model.embed_tokens(next_tokens) * (positions != 0)[..., None].to(hidden.dtype)
        h, latent = layer(hidden, emb, cos, sin, past, mask, absorbed)
        return self.lm_head(layer.shared_head.norm(h)).float(), h, latent
