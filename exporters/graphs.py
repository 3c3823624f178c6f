"""The exported graphs: the target (main model + in-graph acceptance) and the MTP module(s), in two lowerings.

`onnx` lowering: MLA generation attention and acceptance decomposed into standard ONNX operators
(ONNX Runtime runs them anywhere); the new latent rows are graph outputs that the runtime writes
into its persistent cache.  `plugin` lowering: each is one node in the `mtp_trt` domain
(docs/architecture.md documents inputs, attributes and outputs), implemented by the TensorRT
plugins; the attention node writes the new rows into the cache in place.

Both lowerings share everything else with the reference model (exporters/model.py); MoE is
computed in a static form (every expert on every token, combine-weighted) so the graph has no
data-dependent control flow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp_trt.exporters.model import MLA, DecoderLayer, DeepseekV3, MoE

Tensor = torch.Tensor
LOWERINGS = ("onnx", "plugin")


# ----------------------------------------------------------------------- MLA generation attention
def mla_attention_decomposed(q: Tensor, new_rows: Tensor, cache: Tensor, past_len: Tensor, kv_lora_rank: int,
                             scale: float, extra: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """q [B, S, H, Dl+Dr] (absorbed), new_rows [B, S, Dl+Dr], cache [B, T, Dl+Dr] with past_len [B] valid rows.

    Attends over the valid cached rows and, causally, the new rows, without concatenating the cache:
    the score blocks are softmaxed together and the value products summed.  `extra` = (rows [B, R, Dl+Dr],
    visible [B, R] bool) adds rows that sit between the cache and the new rows but are not in the buffer
    (the step graph's earlier MTP rows of this step).  -> [B, S, H, Dl]."""
    b, s, h, _ = q.shape
    qf = q.reshape(b, s * h, -1).float()  # query rows r = s*H + h
    # No .float() on an fp32 cache: it returns the same tensor, which the tracer would then map to a Cast
    # node, and later plugin nodes would receive that Cast instead of the graph's cache input.
    cache = cache if cache.dtype == torch.float32 else cache.float()
    t = torch.arange(cache.shape[1], dtype=past_len.dtype)
    past_ok = (t[None, :] < past_len[:, None])[:, None, :]  # [B, 1, T]
    j = torch.arange(s)
    new_ok = (j[None, :] <= (torch.arange(s * h) // h)[:, None])[None]  # causal [1, S*H, S]
    if extra is not None:  # extra rows go in front of the new ones
        new_rows = torch.cat([extra[0], new_rows], 1)
        new_ok = torch.cat([extra[1][:, None, :].expand(b, s * h, -1), new_ok.expand(b, -1, -1)], -1)
    s_past = torch.matmul(qf, cache.transpose(1, 2)) * scale  # [B, S*H, T]
    s_new = torch.matmul(qf, new_rows.float().transpose(1, 2)) * scale  # [B, S*H, R + S]
    scores = torch.cat([s_past.masked_fill(~past_ok, float("-inf")), s_new.masked_fill(~new_ok, float("-inf"))], -1)
    p = scores.softmax(-1)
    t_rows = cache.shape[1]
    out = torch.matmul(p[..., :t_rows], cache) + torch.matmul(p[..., t_rows:], new_rows.float())
    return out[..., :kv_lora_rank].reshape(b, s, h, kv_lora_rank).to(q.dtype)


class MlaGenerationAttentionOp(torch.autograd.Function):
    """Plugin lowering: one `mtp_trt::MlaGenerationAttention` node (computes the decomposed form when traced)."""

    @staticmethod
    def forward(ctx, q, new_rows, cache, past_len, kv_lora_rank: int, scale: float):
        return mla_attention_decomposed(q, new_rows, cache, past_len, kv_lora_rank, scale)

    @staticmethod
    def symbolic(g, q, new_rows, cache, past_len, kv_lora_rank: int, scale: float):
        return g.op("mtp_trt::MlaGenerationAttention", q, new_rows, cache, past_len, kv_lora_rank_i=kv_lora_rank,
                    softmax_scale_f=scale)


# ------------------------------------------------------------------------------------ acceptance
def accept_decomposed(logits: Tensor, input_ids: Tensor, thinking: Tensor, relaxed_topk: Tensor,
                      relaxed_delta: Tensor, think_start_id: int, think_end_id: int):
    """In-graph acceptance of the drafts input_ids[:, 1:] against the target logits [B, S=K+1, V].

    Draft i is accepted if it equals the argmax at position i, or -- while the thinking flag in effect
    for position i is on and relaxed_topk > 0 -- if it ranks among the top `relaxed_topk` tokens and
    p(draft) >= p(top-1) - relaxed_delta.  Accepted = the longest prefix of accepted drafts, then the
    bonus token (argmax at the first unaccepted position).  The thinking flag turns on at
    `<think>` and off at `</think>` as accepted tokens are processed in order; the flag for position i
    is the one after drafts 0..i-1 (the step's first token was processed by the previous step).

    Returns accepted_tokens [B, S] (int32, -1 after the bonus), num_accepted [B] (drafts accepted),
    thinking_out [B] (int32)."""
    b, s, v = logits.shape
    lg = logits.float()
    target = lg.argmax(-1).to(torch.int32)  # [B, S]
    # Work on S columns (never zero-sized, even for K = 0): column i holds draft i; column K is a
    # placeholder (the target's own token) that can never be accepted.
    pos = torch.arange(s, dtype=torch.int32)[None, :]
    is_draft = pos < s - 1
    drafts = torch.cat([input_ids[:, 1:], target[:, -1:]], dim=1)  # [B, S]
    l_d = lg.gather(-1, drafts.long()[..., None])  # [B, S, 1]
    vocab = torch.arange(v, dtype=torch.int32)
    rank = ((lg > l_d) | ((lg == l_d) & (vocab < drafts[..., None]))).to(torch.int32).sum(-1)  # [B, S]
    probs = lg.softmax(-1)
    p_d = probs.gather(-1, drafts.long()[..., None])[..., 0]
    relaxed_ok = (rank < relaxed_topk) & (p_d >= probs.amax(-1) - relaxed_delta)
    # flag before draft i = after drafts 0..i-1 = after column i of [-1, drafts]
    flag = thinking_flags(torch.cat([torch.full_like(drafts[:, :1], -1), drafts[:, :-1]], 1), thinking,
                          think_start_id, think_end_id)  # [B, S]
    ok = ((drafts == target) | (relaxed_ok & flag)) & is_draft
    num_accepted = (torch.cumsum((~ok).to(torch.int32), -1) == 0).sum(-1).to(torch.int32)  # [B]
    bonus = target.gather(1, num_accepted.long()[:, None])  # [B, 1]
    accepted = torch.where(pos < num_accepted[:, None], drafts,
                           torch.where(pos == num_accepted[:, None], bonus, torch.full_like(bonus, -1)))
    after = thinking_flags(accepted, thinking, think_start_id, think_end_id)  # [B, S]
    return accepted, num_accepted, after[:, -1].to(torch.int32)


def thinking_flags(tokens: Tensor, thinking: Tensor, start_id: int, end_id: int) -> Tensor:
    """The thinking flag after each token of tokens [B, N], given the flag before them (thinking [B]):
    on after the latest `<think>`, off after the latest `</think>`, unchanged if neither appeared.

    Which came last is read from prefix sums of 2^j over the positions j of each kind: the two sets
    are disjoint, so the larger sum holds the latest position (exact for N <= 53 in float64, which
    covers every verify step; prefill's flags are computed by the runtime)."""
    w = torch.pow(2.0, torch.arange(tokens.shape[1], dtype=torch.float64))[None, :]
    starts = torch.cumsum((tokens == start_id).to(torch.float64) * w, -1)
    ends = torch.cumsum((tokens == end_id).to(torch.float64) * w, -1)
    seen = (starts + ends) > 0
    return (seen & (starts > ends)) | (~seen & (thinking[:, None] != 0))  # (no bool Where on ORT's CPU)


class MtpAcceptOp(torch.autograd.Function):
    """Plugin lowering: one `mtp_trt::MtpAccept` node (computes the decomposed form when traced)."""

    @staticmethod
    def forward(ctx, logits, input_ids, thinking, relaxed_topk, relaxed_delta, think_start_id: int,
                think_end_id: int):
        return accept_decomposed(logits, input_ids, thinking, relaxed_topk, relaxed_delta, think_start_id,
                                 think_end_id)

    @staticmethod
    def symbolic(g, logits, input_ids, thinking, relaxed_topk, relaxed_delta, think_start_id: int, think_end_id: int):
        return g.op("mtp_trt::MtpAccept", logits, input_ids, thinking, relaxed_topk, relaxed_delta,
                    think_start_id_i=think_start_id, think_end_id_i=think_end_id, outputs=3)


# ----------------------------------------------------------------------------------------- blocks
def moe_static(moe: MoE, x: Tensor) -> Tensor:
    """MoE with no data-dependent control flow: every routed expert on every token, weighted by the
    gate's combine matrix (zero for unselected experts), in three matmuls over stacked weights."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    weights, idx = moe.gate(x)
    one_hot = idx[..., None] == torch.arange(len(moe.experts))  # [N, k, E]
    combine = (weights[..., None] * one_hot.to(weights.dtype)).sum(1)  # [N, E]
    w_gate = torch.cat([e.gate_proj.weight for e in moe.experts])  # [E*I, D]
    w_up = torch.cat([e.up_proj.weight for e in moe.experts])
    w_down = torch.cat([e.down_proj.weight for e in moe.experts], dim=1)  # [D, E*I]
    a = (F.silu(x @ w_gate.T) * (x @ w_up.T)).unflatten(-1, (len(moe.experts), -1))  # [N, E, I]
    y = (a * combine[..., None].to(a.dtype)).flatten(1) @ w_down.T
    if hasattr(moe, "shared_experts"):
        y = y + moe.shared_experts(x)
    return y.view(shape)


def block_forward(layer: DecoderLayer, h: Tensor, cos: Tensor, sin: Tensor, cache: Tensor, past_len: Tensor,
                  lowering: str, extra: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """One decoder block with absorbed MLA over the persistent cache. -> (h [B, S, D], new rows [B, S, Dl+Dr]).

    past_len: the plugin lowering's write position (its rows are in the buffer); the onnx lowering's valid
    cached rows, with this step's other rows passed as `extra` (see mla_attention_decomposed)."""
    attn: MLA = layer.self_attn
    cfg = attn.cfg
    q_nope, q_pe, latent = attn.project(layer.input_layernorm(h), cos, sin)
    w_uk, w_uv = attn.w_uk_uv()
    # MatMul rather than Einsum: ONNX's Einsum has no bf16.
    q_lat = torch.matmul(q_nope.transpose(1, 2), w_uk).transpose(1, 2)  # q_nope absorbed through W^UK: [B, S, H, Dl]
    q_abs = torch.cat([q_lat, q_pe], dim=-1)  # [B, S, H, Dl+Dr]
    if lowering == "plugin":
        o_lat = MlaGenerationAttentionOp.apply(q_abs, latent, cache, past_len, cfg.kv_lora_rank, cfg.softmax_scale)
    else:
        o_lat = mla_attention_decomposed(q_abs, latent, cache, past_len, cfg.kv_lora_rank, cfg.softmax_scale, extra)
    o = torch.matmul(o_lat.transpose(1, 2), w_uv.transpose(1, 2)).transpose(1, 2)  # W^UV: [B, S, H, Dv]
    h = h + attn.o_proj(o.flatten(-2))
    x = layer.post_attention_layernorm(h)
    return h + (moe_static(layer.mlp, x) if isinstance(layer.mlp, MoE) else layer.mlp(x)), latent


def _rope(model: DeepseekV3, past_len: Tensor, s: int) -> tuple[Tensor, Tensor, Tensor]:
    positions = past_len[:, None].long() + torch.arange(s)[None, :]  # [B, S]
    return positions, *model.rope(positions)


# ----------------------------------------------------------------------------------------- graphs
def target_forward(m: DeepseekV3, input_ids, past_len, thinking, relaxed_topk, relaxed_delta, caches, lowering: str,
                   think_ids: tuple[int, int]):
    """The main model with acceptance: (accepted, num_accepted, thinking_out, hidden [B, S, D], logits, new rows)."""
    _, cos, sin = _rope(m, past_len, input_ids.shape[1])
    h = m.model.embed_tokens(input_ids)
    new_rows = []
    for layer, cache in zip(m.model.layers, caches):
        h, rows = block_forward(layer, h, cos, sin, cache, past_len, lowering)
        new_rows.append(rows)
    h = m.model.norm(h)
    logits = m.lm_head(h).float()
    accept = MtpAcceptOp.apply if lowering == "plugin" else accept_decomposed
    accepted, num_accepted, thinking_out = accept(logits, input_ids, thinking, relaxed_topk, relaxed_delta, *think_ids)
    return accepted, num_accepted, thinking_out, h, logits, new_rows


def mtp_block(m: DeepseekV3, k: int, hidden, next_tokens, write_pos, valid_len, cache, lowering: str,
              extra: tuple[Tensor, Tensor] | None = None):
    """MTP module k on rows at positions write_pos + 0..S-1: h' = eh_proj([enorm(emb); hnorm(hidden)]) then its
    block.  -> (hidden_out [B, S, D] before shared_head.norm, new rows).  See block_forward for valid_len/extra."""
    layer = m.mtp[k]
    positions, cos, sin = _rope(m, write_pos, next_tokens.shape[1])
    emb = m.model.embed_tokens(next_tokens) * (positions != 0)[..., None].to(hidden.dtype)
    h = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(hidden)], dim=-1))
    return block_forward(layer, h, cos, sin, cache, write_pos if lowering == "plugin" else valid_len, lowering, extra)


class TargetGraph(nn.Module):
    """Main model for prefill (S prompt tokens) and verification (S = K + 1), with acceptance in-graph.

    inputs : input_ids [B, S] int32, past_len [B] int32, thinking [B] int32, relaxed_topk [] int32,
             relaxed_delta [] float32, kv_0 .. kv_{L-1} [B, T, Dl+Dr]
    outputs: accepted_tokens [B, S] int32, num_accepted [B] int32, thinking_out [B] int32,
             target_tokens [B, S] int32 (argmax), hidden_states [B, S, D], logits [B, S, V] float32,
             and in the onnx lowering new_kv_0 .. new_kv_{L-1} [B, S, Dl+Dr]."""

    def __init__(self, model: DeepseekV3, lowering: str, think_ids: tuple[int, int]):
        super().__init__()
        self.model, self.lowering, self.think_ids = model, lowering, think_ids

    def forward(self, input_ids, past_len, thinking, relaxed_topk, relaxed_delta, *caches):
        accepted, num, thinking_out, h, logits, new_rows = target_forward(
            self.model, input_ids, past_len, thinking, relaxed_topk, relaxed_delta, caches, self.lowering,
            self.think_ids)
        outs = (accepted, num, thinking_out, logits.argmax(-1).to(torch.int32), h, logits)
        return outs + (tuple(new_rows) if self.lowering == "onnx" else ())


class MtpGraph(nn.Module):
    """One MTP module over its own latent cache.

    inputs : hidden [B, S, D], next_tokens [B, S] int32, past_len [B] int32, kv [B, T, Dl+Dr]
    outputs: hidden_out [B, S, D], draft_tokens [B, S] int32, draft_probs [B, S] float32 (softmax
             probability of the draft), draft_logits [B, S, V] float32, and new_kv [B, S, Dl+Dr]
             in the onnx lowering."""

    def __init__(self, model: DeepseekV3, k: int, lowering: str):
        super().__init__()
        self.model, self.k, self.lowering = model, k, lowering

    def forward(self, hidden, next_tokens, past_len, cache):
        m = self.model
        h, rows = mtp_block(m, self.k, hidden, next_tokens, past_len, past_len, cache, self.lowering)
        logits = m.lm_head(m.mtp[self.k].shared_head.norm(h)).float()
        probs, tokens = logits.softmax(-1).max(-1)
        outs = (h, tokens.to(torch.int32), probs, logits)
        return outs + ((rows,) if self.lowering == "onnx" else ())


class StepGraph(nn.Module):
    """One whole eagle decode step, greedy, in one call: verify and accept, then MTP depth 1 over the K + 1
    verified rows and depths 2..K one row each, drafting the next step's K tokens.

    inputs : as TargetGraph (S = K + 1 exactly), then mtp_kv [B, T, Dl+Dr] (the MTP module's cache)
    outputs: accepted_tokens, num_accepted, thinking_out (as TargetGraph), drafts [B, K] int32, and in the
             onnx lowering new_kv_0 .. new_kv_{L-1} and mtp_new_kv [B, K+1, Dl+Dr] (depth 1's rows; the
             deeper rows are speculative and need no commit).  In the plugin lowering every attention node
             writes its rows in place, depth k at row past_len + num_accepted + k - 1."""

    def __init__(self, model: DeepseekV3, nextn: int, lowering: str, think_ids: tuple[int, int]):
        super().__init__()
        self.model, self.nextn, self.lowering, self.think_ids = model, nextn, lowering, think_ids

    def forward(self, input_ids, past_len, thinking, relaxed_topk, relaxed_delta, *caches):
        m, layers = self.model, len(self.model.model.layers)
        accepted, num, thinking_out, h, _, new_rows = target_forward(
            m, input_ids, past_len, thinking, relaxed_topk, relaxed_delta, caches[:layers], self.lowering,
            self.think_ids)
        cache, head_norm = caches[layers], m.mtp[0].shared_head.norm
        h1, rows1 = mtp_block(m, 0, h, accepted.clamp(min=0), past_len, past_len, cache, self.lowering)
        h_prev = h1.gather(1, num.long()[:, None, None].expand(-1, 1, h1.shape[-1]))  # row q = past_len + num
        d = m.lm_head(head_norm(h_prev)).float().argmax(-1).to(torch.int32)  # [B, 1]
        drafts = [d]
        extra = (rows1, torch.arange(input_ids.shape[1])[None, :] <= num[:, None])  # depth 1's accepted rows
        for k in range(2, self.nextn + 1):
            pos = past_len + num + (k - 1)
            h_prev, rows = mtp_block(m, 0, h_prev, d, pos, past_len, cache, self.lowering, extra)
            d = m.lm_head(head_norm(h_prev)).float().argmax(-1).to(torch.int32)
            drafts.append(d)
            extra = (torch.cat([extra[0], rows], 1), torch.cat([extra[1], torch.ones_like(d, dtype=torch.bool)], 1))
        outs = (accepted, num, thinking_out, torch.cat(drafts, 1))
        return outs + ((*new_rows, rows1) if self.lowering == "onnx" else ())
