"""NumPy references of mtp-trt's CPU operators for ONNX Runtime (plugins/ort/mtp_ort_ops.cpp, domain `mtp_trt.cpu`).

Loop-level where that is clearer, float64 accumulation, NumPy only.  tests/test_ort_ops.py runs each operator in
ONNX Runtime on random and adversarial inputs and compares it with these; the exported graphs that use them are
compared with the PyTorch reference model and transformers elsewhere (tests/test_export.py, tests/test_moe.py).
"""

from __future__ import annotations

import numpy as np

from mtp_trt.quant import dequantize


def silu(x):
    return x / (1.0 + np.exp(-x))


def swiglu(x, fc1, fc2):
    """x [N, D], fc1 [2I, D] (gate/up rows interleaved), fc2 [D, I] -> [N, D]."""
    h = x.astype(np.float64) @ fc1.T.astype(np.float64)
    return (silu(h[:, 0::2]) * h[:, 1::2]) @ fc2.T.astype(np.float64)


def top_k(v, k):
    """Indices of the k largest of v [n], ties to the lower index (ONNX TopK)."""
    return np.argsort(-np.asarray(v), kind="stable")[:k]


def route(logits, k, n_group=1, topk_group=1, softmax=False, bias=None, group_top2=True, norm_topk_prob=True,
          scaling=1.0):
    """DeepSeek-V3's router for logits [N, E] -> (experts [N, k], gates [N, k]): scores s = sigmoid (softmax)
    of the logits; choice = s + bias; with n_group > 1 only the experts of the top_group groups (a group's score:
    the sum of its two best choices if group_top2, else its best) compete; the top k of choice; gates s at them,
    divided by their sum (+1e-20) if norm_topk_prob, times scaling."""
    logits = np.asarray(logits, np.float64)
    n, e = logits.shape
    idx, gates = np.zeros((n, k), np.int64), np.zeros((n, k))
    for t in range(n):
        if softmax:
            s = np.exp(logits[t] - logits[t].max())
            s /= s.sum()
        else:
            s = 1.0 / (1.0 + np.exp(-logits[t]))
        choice = s + (0.0 if bias is None else np.asarray(bias, np.float64))
        if n_group > 1:
            groups = choice.reshape(n_group, -1)
            best = np.sort(groups, -1)[:, ::-1]
            score = best[:, 0] + best[:, 1] if group_top2 else best[:, 0]
            keep = np.zeros(n_group, bool)
            keep[top_k(score, topk_group)] = True
            choice = np.where(np.repeat(keep, e // n_group), choice, -np.inf)
        idx[t] = top_k(choice, k)
        g = s[idx[t]]
        gates[t] = (g / (g.sum() + 1e-20) if norm_topk_prob else g) * scaling
    return idx, gates


def moe(x, gate, bias, fc1, fc2, shared_fc1=None, shared_fc2=None, *, top_k, n_group=1, topk_group=1, softmax=False,
        group_top2=True, norm_topk_prob=True, scaling=1.0):
    """x [N, D], gate [E, D], bias [E] or None, fc1 [E, 2I, D], fc2 [E, D, I], shared [2Is, D], [D, Is] -> [N, D]."""
    x = np.asarray(x, np.float64)
    idx, gates = route(x @ gate.T.astype(np.float64), top_k, n_group, topk_group, softmax, bias, group_top2,
                       norm_topk_prob, scaling)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, g in zip(idx[t], gates[t]):
            y[t] += g * swiglu(x[t:t + 1], fc1[e], fc2[e])[0]
    return y if shared_fc1 is None else y + swiglu(x, shared_fc1, shared_fc2)


# ------------------------------------------------------------------------------------ quantized weights
ACT_BLOCK = 8  # activation values per int8 scale


def quantize_activations(x, k_padded):
    """x [M, K] float32 -> (q int8 [M, K32], scales float32 [M, K32 / ACT_BLOCK]), K zero-padded to k_padded and
    then to K32, a multiple of 32: per ACT_BLOCK values scale = max|x| / 127 and q = round-half-even(x / scale), in
    float32 (a block of zeros: scale 0, q 0)."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    k32 = -(-k_padded // 32) * 32
    blocks = np.zeros((m, k32), np.float32)
    blocks[:, :k] = x
    blocks = blocks.reshape(m, -1, ACT_BLOCK)
    scale = np.abs(blocks).max(-1) / np.float32(127)
    safe = np.where(scale > 0, scale, np.float32(1))[..., None]
    q = np.where(scale[..., None] > 0, np.clip(np.rint(blocks / safe), -127, 127), 0).astype(np.int8)
    return q.reshape(m, k32), scale.astype(np.float32)


def weight_levels(data, k_padded, bits):
    """The stored integers q [N, K_padded] of a quantized weight (mtp_trt.quant's format)."""
    return dequantize(data, np.ones(data.shape[:2], np.float32), k_padded, bits).astype(np.int64)


def qmatmul(x, data, scales, *, k, bits, block_size):
    """The QMatMul op: x [M, K] float32, data uint8 [N, K/bs, bs*bits/8], scales [N, K/bs] -> [M, N] (float64):
    x quantized as quantize_activations, then per ACT_BLOCK values (each inside one activation block and one
    weight block) the exact integer dot product times both scales, summed."""
    n, nb, _ = data.shape
    kp = nb * block_size
    xq, xs = quantize_activations(x, kp)
    wq = weight_levels(data, kp, bits)  # [N, Kp]
    groups = kp // ACT_BLOCK
    xg = xq[:, :kp].astype(np.int64).reshape(len(xq), groups, ACT_BLOCK)
    dots = np.einsum("mgi,ngi->mng", xg, wq.reshape(n, groups, ACT_BLOCK))  # exact, int64
    g = np.arange(groups)
    scale = xs[:, g].astype(np.float64)[:, None, :] * \
        scales[:, g * ACT_BLOCK // block_size].astype(np.float64)[None, :, :]
    return (dots * scale).sum(-1)


def qmatmul_float(x, data, scales, *, k, bits, block_size):
    """x times the dequantized weight, in float64 (what the quantized product approximates)."""
    return np.asarray(x, np.float64) @ dequantize(data, scales, k, bits).T.astype(np.float64)


def qswiglu(x, fc1, fc2, *, bits, block_size, product=qmatmul):
    """swiglu with quantized weights fc1 = (data, scales) [2I, D], fc2 [D, I]: each product by `product`, the
    SwiGLU activations rounded to float32 before they are quantized (as the op's)."""
    d = x.shape[-1]
    h = product(x, *fc1, k=d, bits=bits, block_size=block_size)
    a = (silu(h[:, 0::2]) * h[:, 1::2]).astype(np.float32)
    return product(a, *fc2, k=a.shape[-1], bits=bits, block_size=block_size)


def qmoe(x, gate, bias, fc1, fc1_scales, fc2, fc2_scales, shared_fc1=None, shared_fc1_scales=None, shared_fc2=None,
         shared_fc2_scales=None, *, top_k, bits, block_size, n_group=1, topk_group=1, softmax=False, group_top2=True,
         norm_topk_prob=True, scaling=1.0, product=qmatmul):
    """The QMoE op: moe's routing (fp32 router) with each expert's SwiGLU by qswiglu -> [N, D]."""
    x = np.asarray(x, np.float32)
    idx, gates = route(x.astype(np.float64) @ gate.T.astype(np.float64), top_k, n_group, topk_group, softmax, bias,
                       group_top2, norm_topk_prob, scaling)
    q = dict(bits=bits, block_size=block_size, product=product)
    y = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for e, g in zip(idx[t], gates[t]):
            y[t] += g * qswiglu(x[t:t + 1], (fc1[e], fc1_scales[e]), (fc2[e], fc2_scales[e]), **q)[0]
    if shared_fc1 is not None:
        y += qswiglu(x, (shared_fc1, shared_fc1_scales), (shared_fc2, shared_fc2_scales), **q)
    return y


def mla_attention(q_lat, q_pe, rows, cache, past_len, visible=None, selected=None, *, heads, scale):
    """Absorbed MLA: q_lat [B, S, H*Dl], q_pe [B, S, H*Dr], rows [B, R, C], cache [B, T, C] (C >= Dl+Dr: the keys
    are each row's first Dl+Dr values), past_len [B], visible [B or 1, S, R] bool or None (causal over the last S
    rows, all rows before them seen) -> [B, S, H*Dl]: each head of each query token attends to the cached rows
    t < past_len and the rows it sees; where selected [B, S, K] (indices into the T cache rows then the R rows,
    -1: none) is given, to exactly the rows it names instead."""
    b, s, _ = q_lat.shape
    r, t_len = rows.shape[1], cache.shape[1]
    q = np.concatenate([q_lat.reshape(b, s, heads, -1), q_pe.reshape(b, s, heads, -1)], -1).astype(np.float64)
    dl, c = q_lat.shape[-1] // heads, q.shape[-1]
    out = np.zeros((b, s, heads, dl))
    for bi in range(b):
        n = int(np.clip(past_len[bi], 0, t_len))
        every = np.concatenate([cache[bi], rows[bi]])[:, :c].astype(np.float64)  # [T + R, C]
        for si in range(s):
            if selected is not None:
                keys = every[[i for i in selected[bi, si] if i >= 0]]
            else:
                seen = (np.arange(r) <= si + r - s) if visible is None else np.asarray(visible[bi % len(visible), si])
                keys = np.concatenate([every[:n], every[t_len:][seen]])
            for h in range(heads):
                if not len(keys):
                    continue
                z = scale * keys @ q[bi, si, h]
                p = np.exp(z - z.max())
                out[bi, si, h] = (p / p.sum()) @ keys[:, :dl]
    return out.reshape(b, s, heads * dl)


def rms_norm(x, w, eps):
    """x [..., n] -> w * x / sqrt(mean(x^2) + eps), float64."""
    x = np.asarray(x, np.float64)
    return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def rope(x, cos, sin, interleave):
    """x [..., Dr] rotated by cos/sin [..., Dr/2] (broadcast): pairs (2i, 2i+1) if interleave, else (i, i + Dr/2)."""
    x = np.asarray(x, np.float64)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return np.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).reshape(x.shape)
    x1, x2 = np.split(x, 2, -1)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def per_head_qmatmul(x, data, scales):
    """x [B, S, H, K] float32 against each head's int8 weight (data uint8 [H, N, K/bs, bs], scales [H, N, K/bs]:
    MlaSelfAttention's w_uk_q, w_uv_q) -> [B, S, H, N] (float64): head by head, qmatmul."""
    b, s, h, k = x.shape
    bs = data.shape[-1]
    return np.stack([qmatmul(x[:, :, i].reshape(b * s, k), data[i], scales[i], k=k, bits=8, block_size=bs)
                     for i in range(h)], 1).reshape(b, s, h, -1)


def mla_self_attention(q, kv, kv_norm, positions, cos, sin, cache, past_len, extra=None, visible=None, w_uk=None,
                       w_uv=None, w_uk_q=None, w_uk_scales=None, w_uv_q=None, w_uv_scales=None, *, heads, scale, eps,
                       interleave):
    """MlaSelfAttention: q [B, S, H*F + H*Dr] (every head's nope part, absorbed through w_uk [H, Dn, Dl], or its
    absorbed latent part without w_uk; then every head's rope part), kv [B, S, Dl+Dr] (c_kv, k_pe before norm and
    RoPE), kv_norm [Dl], positions [B, S], cos/sin [P, Dr/2], cache [B, T, Dl+Dr], past_len [B], extra [B, R, Dl+Dr]
    or None, visible [B or 1, S, R+S] or None (causal), w_uv [H, Dv, Dl] or None -> (out [B, S, H*Dv or H*Dl], the
    new rows [B, S, Dl+Dr]): the new rows' c_kv normed and k_pe roped, each head's query absorbed and roped, then
    mla_attention over the cache, the extra rows and the new rows, then W^UV.  W^UK and W^UV may come as int8 blocks
    instead (w_uk_q [H, Dl, Dn/bs, bs], w_uv_q [H, Dv, Dl/bs, bs] and their scales): per_head_qmatmul of the
    float32 input (the attention's output rounded to float32 first, as the op's)."""
    b, s, _ = q.shape
    dl, dr = len(kv_norm), 2 * cos.shape[1]
    c, sn = cos[positions].astype(np.float64), sin[positions].astype(np.float64)  # [B, S, Dr/2]
    rows = np.concatenate([rms_norm(kv[..., :dl], kv_norm, eps), rope(kv[..., dl:], c, sn, interleave)], -1)
    first = q[..., :q.shape[-1] - heads * dr].reshape(b, s, heads, -1)
    q_pe = rope(q[..., q.shape[-1] - heads * dr:].reshape(b, s, heads, dr), c[:, :, None], sn[:, :, None], interleave)
    if w_uk_q is not None:
        q_lat = per_head_qmatmul(first, w_uk_q, w_uk_scales)
    else:
        first = first.astype(np.float64)
        q_lat = first if w_uk is None else np.einsum("bshn,hnc->bshc", first, w_uk)
    every = rows if extra is None else np.concatenate([extra, rows], 1)
    out = mla_attention(q_lat.reshape(b, s, -1), q_pe.reshape(b, s, -1), every, cache, past_len, visible,
                        heads=heads, scale=scale)
    if w_uv_q is not None:
        out = per_head_qmatmul(out.reshape(b, s, heads, dl).astype(np.float32), w_uv_q, w_uv_scales).reshape(b, s, -1)
    elif w_uv is not None:
        out = np.einsum("bshc,hvc->bshv", out.reshape(b, s, heads, dl), w_uv).reshape(b, s, -1)
    return out, rows


# ------------------------------------------------------------------------------- DeepSeek Sparse Attention
def index_scores(q, weights, keys, *, heads, scale):
    """The lightning indexer for one query token: q [Hi*Di], weights [Hi], keys [N, Di] -> I [N] (float64),
    I[t] = sum_j weights[j] * max(0, scale * q_j . k_t)."""
    q = np.asarray(q, np.float64).reshape(heads, -1)
    dots = np.asarray(keys, np.float64) @ q.T  # [N, Hi]
    return np.maximum(scale * dots, 0.0) @ np.asarray(weights, np.float64)


def lightning_indexer(q, weights, rows, cache, past_len, visible=None, *, heads, topk, scale):
    """The LightningIndexer op: q [B, S, Hi*Di] (roped), weights [B, S, Hi], rows [B, R, C], cache [B, T, C] (the
    indexer key: each row's last Di values), past_len [B], visible as mla_attention -> selected [B, S, K] int32,
    K = min(topk, T + R): for each query token the visible rows (cached rows < past_len, then the rows it sees)
    with the topk highest index_scores, the earlier row first among equal scores, as indices into the T cache rows
    then the R rows, in ascending order, -1 after them where fewer rows are visible."""
    b, s, _ = q.shape
    r, t_len = rows.shape[1], cache.shape[1]
    di = q.shape[-1] // heads
    k = min(topk, t_len + r)
    out = np.full((b, s, k), -1, np.int32)
    for bi in range(b):
        n = int(np.clip(past_len[bi], 0, t_len))
        every = np.concatenate([cache[bi], rows[bi]])[:, -di:]  # [T + R, Di]
        for si in range(s):
            seen = (np.arange(r) <= si + r - s) if visible is None else np.asarray(visible[bi % len(visible), si])
            index = np.concatenate([np.arange(n), t_len + np.flatnonzero(seen)])
            scores = index_scores(q[bi, si], weights[bi, si], every[index], heads=heads, scale=scale)
            picked = np.sort(index[top_k(scores, k)])  # ties: the earlier row
            out[bi, si, :len(picked)] = picked
    return out
