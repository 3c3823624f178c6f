"""The exported graphs' two custom operations, MLA generation attention and draft acceptance, in the two
lowerings: `onnx` decomposes them into standard ONNX operators (ONNX Runtime runs them anywhere);
`plugin` makes each one node in the `mtp_trt` domain (docs/architecture.md documents inputs,
attributes and outputs), implemented by the TensorRT plugins.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mtp_trt import ops
from mtp_trt.exporters.model import as_fp32

Tensor = torch.Tensor
LOWERINGS = ("onnx", "plugin")


class Dims:
    """A block group's batch B and token count S, traced once: every reshape built from them shares one
    shape computation (ONNX Runtime's common-subexpression elimination merges the copies), so a reshape
    costs one node instead of the four the tracer emits for `x.shape`-derived sizes."""

    def __init__(self, b, s):
        self.b, self.s = b, s

    def view(self, x: Tensor, *tail: int) -> Tensor:
        """x [B, S, ...] -> [B, S, *tail]."""
        return x.reshape(self.b, self.s, *tail)

    def rows(self, x: Tensor, width: int) -> Tensor:
        """x [B, S, ...] -> [B, S*..., width]."""
        return x.reshape(self.b, -1, width)


class Mask:
    """The onnx lowering's attention visibility for a block group, built once per group when first used.  For the
    decomposed attention (`attend`), additive float32 biases (0 visible, -inf hidden) per query row r = s*H + h:
    `past` [B, 1, T] over the cache buffer's T rows (valid: < past_len), `new` [B or 1, S*H, R + S] over
    `extra_rows` [B, R, Dl+Dr] (rows of this step that are not in the buffer, visible where extra_visible [B, R],
    or per query token [B, S, R]) and the S new rows: causally, or where new_visible [B, S, S] says (tree
    attention: each node sees its ancestors and itself).  With one new row and no extra rows `new` is None: the
    row sees itself, and no add is needed.  For the CPU attention node (exporters/ort_ops.py CpuMlaOp),
    `visible` [B or 1, S, R + S] bool per query token, None where it is causal with no extra rows (the node's
    default)."""

    def __init__(self, dims: Dims, heads: int, past_len: Tensor, t, extra: tuple[Tensor, Tensor] | None = None,
                 new_visible: Tensor | None = None):
        self.dims, self.heads, self.past_len, self.t = dims, heads, past_len, t
        self.extra_rows, self._extra_seen = (None, None) if extra is None else extra
        self._new_visible = new_visible

    @functools.cached_property
    def past(self) -> Tensor:
        return _bias(torch.arange(self.t) < self.past_len[:, None])[:, None, :]

    def _seen(self) -> Tensor:
        """Which rows each query token sees, [B or 1, S, R + S] bool: the extra rows, then the new rows (causally
        or as new_visible says)."""
        s = self.dims.s
        new = self._new_visible
        if new is None:
            new = (torch.arange(s)[None, :] <= torch.arange(s)[:, None])[None]  # [1, S, S]
        if self.extra_rows is None:
            return new
        seen = self._extra_seen
        seen = seen[:, None, :].expand(-1, s, -1) if seen.dim() == 2 else seen
        return torch.cat([seen, new.expand(self.dims.b, -1, -1)], -1)

    @functools.cached_property
    def new(self) -> Tensor | None:
        if self.dims.s == 1 and self.extra_rows is None and self._new_visible is None:
            return None  # one new row, which sees itself: nothing to add
        token = torch.arange(self.dims.s * self.heads) // self.heads  # query row -> its token
        return _bias(self._seen()[:, token])

    def seen_rows(self) -> Tensor:
        """Which rows each query token sees, [B, S, T + R + S] bool: the valid cache rows, then _seen's."""
        past = (torch.arange(self.t) < self.past_len[:, None])[:, None, :].expand(-1, self.dims.s, -1)
        return torch.cat([past, self._seen().expand(self.dims.b, -1, -1)], -1)

    @functools.cached_property
    def visible(self) -> Tensor | None:
        causal = self.extra_rows is None and self._new_visible is None  # the node's default
        return None if causal else self._seen()


def _bias(visible: Tensor) -> Tensor:
    return torch.where(visible, 0.0, float("-inf"))


# ----------------------------------------------------------------------- MLA generation attention
def attend(q: Tensor, new_rows: Tensor, cache: Tensor, mask: Mask, kv_lora_rank: int, scale: float,
           bias: Tensor | None = None) -> Tensor:
    """Absorbed MLA over a latent cache in standard operators.  q [B, S*H, Dl+Dr] (row s*H + h),
    new_rows [B, S, C], cache [B, T, C] (C >= Dl+Dr: rows may carry more after the latent) -> [B, S*H, Dl].

    Attends over the visible cached rows, the mask's extra rows and, causally, the new rows, without
    concatenating the cache: the two score blocks are softmaxed together and the value products summed.
    bias [B, S*H, T + R + S] (0 or -inf), if given, replaces the mask's (DeepSeek Sparse Attention's selection)."""
    rows = new_rows if mask.extra_rows is None else torch.cat([mask.extra_rows, new_rows], 1)
    width = q.shape[-1]
    if cache.shape[-1] != width:  # only the latent of each row
        cache, rows = cache[..., :width], rows[..., :width]
    qf, kc, kn = as_fp32(q), as_fp32(cache), as_fp32(rows)
    s_past = torch.matmul(qf, kc.transpose(1, 2)) * scale  # [B, S*H, T]
    s_new = torch.matmul(qf, kn.transpose(1, 2)) * scale  # [B, S*H, R + S]
    if bias is None:
        s_past = s_past + mask.past
        s_new = s_new if mask.new is None else s_new + mask.new
    else:
        s_past, s_new = s_past + bias[..., :mask.t], s_new + bias[..., mask.t:]
    p = torch.cat([s_past, s_new], -1).softmax(-1)
    p_past, p_new = p[..., :mask.t], p[..., mask.t:]  # (slices at the shared T: no per-layer shape ops)
    out = torch.matmul(p_past, kc) + torch.matmul(p_new, kn)  # [B, S*H, Dl+Dr]
    return out[..., :kv_lora_rank].to(q.dtype)


def mla_attention_decomposed(q: Tensor, new_rows: Tensor, cache: Tensor, past_len: Tensor, kv_lora_rank: int,
                             scale: float, tree_mask: Tensor | None = None) -> Tensor:
    """The MlaGenerationAttention contract on its own: q [B, S, H, Dl+Dr] (absorbed), new_rows [B, S, Dl+Dr],
    cache [B, T, Dl+Dr] with past_len [B] valid rows, tree_mask [B, S, S] (bool: which new rows each new row
    sees; None: causal) -> [B, S, H, Dl]."""
    b, s, h, c = q.shape
    mask = Mask(Dims(b, s), h, past_len, cache.shape[1], new_visible=tree_mask)
    return attend(q.reshape(b, s * h, c), new_rows, cache, mask, kv_lora_rank, scale).reshape(b, s, h, -1)


def commit_rows(cache: Tensor, new_rows: Tensor, past_len: Tensor) -> Tensor:
    """cache [B, T, C] with new_rows [B, S, C] written at rows past_len[b] .. past_len[b] + S - 1 (a copy; rows past
    the buffer land on its last row, where the kernel skips them: only tracing computes this)."""
    rows = (past_len[:, None].long() + torch.arange(new_rows.shape[1])[None, :]).clamp(max=cache.shape[1] - 1)
    return cache.scatter(1, rows[..., None].expand(-1, -1, cache.shape[-1]), new_rows)


class MlaGenerationAttentionOp(torch.autograd.Function):
    """Plugin lowering: one `mtp_trt::MlaGenerationAttention` node -> (out, kv_cache_out), the second output
    aliased to the cache input (the plugin writes the new rows in place); with a tree_mask [B, S, S] (bool) a
    fifth input.  When traced it computes the decomposed form and the committed cache, so later nodes that take
    kv_cache_out see the same values."""

    @staticmethod
    def forward(ctx, q, new_rows, cache, past_len, kv_lora_rank: int, scale: float, tree_mask=None):
        out = mla_attention_decomposed(q, new_rows, cache, past_len, kv_lora_rank, scale, tree_mask)
        return out, commit_rows(cache, new_rows, past_len)

    @staticmethod
    def symbolic(g, q, new_rows, cache, past_len, kv_lora_rank: int, scale: float, tree_mask=None):
        inputs = (q, new_rows, cache, past_len) + (() if tree_mask is None else (tree_mask,))
        return g.op("mtp_trt::MlaGenerationAttention", *inputs, kv_lora_rank_i=kv_lora_rank,
                    softmax_scale_f=scale, plugin_version_s=str(ops.VERSION), outputs=2)


def mla_sparse_decomposed(q: Tensor, new_rows: Tensor, cache: Tensor, past_len: Tensor, index_q: Tensor,
                          index_weights: Tensor, kv_lora_rank: int, scale: float, index_topk: int,
                          tree_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The MlaSparseAttention contract on its own: q [B, S, H, Dl+Dr], new_rows [B, S, C] (latent then indexer key),
    cache [B, T, C] with past_len [B] valid rows, index_q [B, S, Hi, Di], index_weights [B, S, Hi] (fp32), tree_mask
    [B, S, S] or None (causal) -> (out [B, S, H, Dl], the cache with the new rows written).  Each query attends to the
    index_topk visible rows of highest index score (ties: the earlier row)."""
    b, s, h, width = q.shape
    cache = commit_rows(cache, new_rows, past_len)
    keys = as_fp32(cache[..., width:])  # [B, T, Di]
    scores = F.relu(torch.matmul(as_fp32(index_q), keys[:, None].transpose(2, 3)) * keys.shape[-1]**-0.5)
    index = torch.matmul(index_weights[:, :, None], scores)[:, :, 0]  # [B, S, T]
    j = torch.arange(cache.shape[1])[None, None, :] - past_len[:, None, None].long()  # new row j of each row
    if tree_mask is None:
        new_seen = j <= torch.arange(s)[None, :, None]
    else:
        new_seen = tree_mask.gather(2, j.clamp(0, s - 1).expand(b, s, -1))
    visible = (j < 0) | ((j < s) & new_seen)  # [B, S, T]
    masked = torch.where(visible, index, float("-inf"))
    top = masked.sort(dim=-1, descending=True, stable=True).indices[..., :index_topk]  # ties: the earlier row
    picked = (torch.zeros_like(index).scatter(-1, top, 1.0) > 0) & visible
    rows = as_fp32(cache[..., :width])  # [B, T, Dl+Dr]
    att = torch.matmul(as_fp32(q), rows[:, None].transpose(2, 3)) * scale  # [B, S, H, T]
    att = att + torch.where(picked, 0.0, float("-inf"))[:, :, None]
    return torch.matmul(att.softmax(-1), rows[:, None, :, :kv_lora_rank]).to(q.dtype), cache


class MlaSparseAttentionOp(torch.autograd.Function):
    """Plugin lowering of DeepSeek Sparse Attention: one `mtp_trt::MlaSparseAttention` node -> (out, kv_cache_out),
    the indexer's selection and the attention over the selected rows in one plugin, the cache aliased as
    MlaGenerationAttention's; with a tree_mask [B, S, S] (bool) a seventh input.  When traced it computes
    mla_sparse_decomposed."""

    @staticmethod
    def forward(ctx, q, new_rows, cache, past_len, index_q, index_weights, kv_lora_rank: int, scale: float,
                index_topk: int, tree_mask=None):
        return mla_sparse_decomposed(q, new_rows, cache, past_len, index_q, index_weights, kv_lora_rank, scale,
                                     index_topk, tree_mask)

    @staticmethod
    def symbolic(g, q, new_rows, cache, past_len, index_q, index_weights, kv_lora_rank: int, scale: float,
                 index_topk: int, tree_mask=None):
        inputs = (q, new_rows, cache, past_len, index_q, index_weights) + (() if tree_mask is None else (tree_mask,))
        return g.op("mtp_trt::MlaSparseAttention", *inputs, kv_lora_rank_i=kv_lora_rank, softmax_scale_f=scale,
                    index_topk_i=index_topk, plugin_version_s=str(ops.VERSION), outputs=2)


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
    # flag after the accepted drafts = the flag before draft num_accepted; then the bonus token's effect
    after = flag_after(flag.gather(1, num_accepted.long()[:, None]), bonus, think_start_id, think_end_id)
    return accepted, num_accepted, after[:, 0].to(torch.int32)


def flag_after(flag: Tensor, token: Tensor, start_id: int, end_id: int) -> Tensor:
    """The thinking flag (bool) after `token`: on at `<think>`, off at `</think>`, else unchanged."""
    return (token == start_id) | (flag & (token != end_id))


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
                    think_start_id_i=think_start_id, think_end_id_i=think_end_id, plugin_version_s=str(ops.VERSION),
                    outputs=3)


def accept_op(lowering: str):
    return MtpAcceptOp.apply if lowering == "plugin" else accept_decomposed
