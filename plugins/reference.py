"""NumPy references of the CUDA kernels in ``plugins/kernels`` (see ``mtp_kernels.h``).

Readable, loop-level where that is clearer, float64 accumulation; NumPy only (no torch).  The
GPU tests compare every kernel with these, and ``tests/kernels/test_reference.py`` checks these
against independent formulations.

bfloat16 has no NumPy dtype: it travels as ``uint16`` bit patterns (``f32_to_bf16_bits`` /
``bf16_bits_to_f32``, round-to-nearest-even as ``__float2bfloat16_rn``).
"""

from __future__ import annotations

import numpy as np

# The relaxed kernel keeps a per-position flag in bit 30 of out_tokens; ids stay below it.
MAX_VOCAB = 1 << 30
# Rejection sampling: quantisation of the weights and of the uniform (mtp_kernels.h).
W_BITS = 40
U_BITS = 24


# ---------------------------------------------------------------------------------------------
# bfloat16 helpers
# ---------------------------------------------------------------------------------------------
def f32_to_bf16_bits(x) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    out[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)  # keep sign, force a quiet NaN
    return out


def bf16_bits_to_f32(bits) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    b = np.ascontiguousarray(bits, dtype=np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)


def round_to(x, dtype: str) -> np.ndarray:
    """Round float values to `dtype` ('float32' | 'float16' | 'bfloat16'), returned as float32."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        return x.copy()
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return bf16_bits_to_f32(f32_to_bf16_bits(x))
    raise ValueError(f"unknown dtype {dtype!r}")


# ---------------------------------------------------------------------------------------------
# 1. MLA generation attention
# ---------------------------------------------------------------------------------------------
def mla_kv_commit(kv_cache, past_len, new_rows) -> np.ndarray:
    """Copy of kv_cache [B, T_max, D] with new_rows [B, S, D] written at rows past_len[b] + s
    (rows at or past T_max are skipped; past_len is clamped to [0, T_max])."""
    cache = np.array(kv_cache, copy=True)
    B, T_max, _ = cache.shape
    S = new_rows.shape[1]
    for b in range(B):
        c = int(np.clip(past_len[b], 0, T_max))
        for s in range(S):
            if c + s < T_max:
                cache[b, c + s] = new_rows[b, s]
    return cache


def mla_visible(cache_len_b: int, L: int, S: int, mask_b=None) -> np.ndarray:
    """[S, L] bool: may new token s attend to cache row t (t < L)."""
    t = np.arange(L)[None, :]
    s = np.arange(S)[:, None]
    cached = t < cache_len_b
    j = t - cache_len_b
    if mask_b is None:
        new = j <= s
    else:
        mb = np.asarray(mask_b) != 0
        new = np.zeros((S, L), dtype=bool)
        cols = np.arange(cache_len_b, L)
        new[:, cols] = mb[:, cols - cache_len_b]
    return cached | new


def _decode_start(q, kv_cache, past_len, new_rows, dl: int):
    """A decode kernel's first steps: (q as an array, the cache after the commit of new_rows if given, zeroed
    out [B, S, H, dl] float64)."""
    q = np.asarray(q)
    cache = mla_kv_commit(kv_cache, past_len, new_rows) if new_rows is not None else np.asarray(kv_cache)
    return q, cache, np.zeros((*q.shape[:3], dl), dtype=np.float64)


_FP32_MAX = float(np.finfo(np.float32).max)


def _fp32_capped(scores):
    """Attention scores with those beyond the fp32 range (+inf included) taken as the largest fp32 value, as the
    kernels do (they accumulate in fp32): such rows share the weight equally instead of giving a NaN row."""
    return np.minimum(scores, _FP32_MAX)


def mla_decode(q, kv_cache, past_len, *, dl: int, scale: float, new_rows=None, mask=None):
    """MLA decode (mtp_mla_decode).

    q [B, S, H, D], kv_cache [B, T_max, D], past_len [B], new_rows [B, S, D] or None,
    mask [B, S, S] or None.  Returns (out [B, S, H, dl] float64, cache after the commit).
    out[b, s, h] = softmax(scale * q . row_t) @ row_t[:dl] over the visible rows t; zeros if none.
    """
    q, cache, out = _decode_start(q, kv_cache, past_len, new_rows, dl)
    B, S, H, D = q.shape
    T_max = cache.shape[1]
    for b in range(B):
        c = int(np.clip(past_len[b], 0, T_max))
        L = min(c + S, T_max)
        rows = cache[b, :L].astype(np.float64)                          # [L, D]
        scores = _fp32_capped(scale * np.einsum("shd,td->sht", q[b].astype(np.float64), rows))
        vis = mla_visible(c, L, S, None if mask is None else mask[b])   # [S, L]
        scores = np.where(vis[:, None, :], scores, -np.inf)
        mx = scores.max(axis=-1, keepdims=True)
        has = np.isfinite(mx)
        e = np.where(vis[:, None, :], np.exp(scores - np.where(has, mx, 0.0)), 0.0)
        den = e.sum(axis=-1, keepdims=True)
        p = np.divide(e, den, out=np.zeros_like(e), where=den > 0)
        out[b] = p @ rows[:, :dl]
    return out, cache


# The work split of mtp_mla_decode (mla_decode.cu), in Python: the TensorRT plugins reserve workspace with these and
# the tests check the kernels' schedule against them.
MLA_ROW_BLOCK = 64    # query rows per block that the num_splits rule counts (v2's largest block)
MLA_TILE_ROWS = 32    # KV rows per tile that the num_splits rule counts (v2's largest tile)
MLA_MIN_TILES = 4     # a part of the persistent grid takes at least this many tiles (V2_MIN_TILES)
MLA_MAX_SPLITS = 256  # MTP_MLA_MAX_SPLITS


def mla_num_splits(B: int, S: int, H: int, max_len: int, num_sms: int) -> int:
    """mtp_mla_decode_num_splits: the parts P of the persistent grid -- one wave of 64-row blocks, at most one part
    per MLA_MIN_TILES tiles of B * max_len rows, at most 256; 1 (one block per sequence) when the row blocks alone
    fill the GPU."""
    if min(B, S, H, max_len) <= 0:
        return 1
    mblocks = -(-S * H // MLA_ROW_BLOCK)
    by_len = -(-(B * -(-max_len // MLA_TILE_ROWS)) // MLA_MIN_TILES)
    return max(1, min(num_sms // mblocks, by_len, MLA_MAX_SPLITS))


def _align256(n: int) -> int:
    return -(-n // 256) * 256


def mla_workspace_size(B: int, S: int, H: int, Dl: int, num_splits: int) -> int:
    """mtp_mla_decode_workspace_size: P + B - 1 slots of S * H fp32 partial rows and their (max, sum), then the
    schedule (int32 [P][4], int32 [B * S][2]); 0 for one part."""
    if num_splits <= 1 or min(B, S, H, Dl) <= 0:
        return 0
    rows = (num_splits + B - 1) * S * H
    return _align256(rows * Dl * 4) + _align256(rows * 8) + _align256(num_splits * 16) + _align256(B * S * 8)


def mla_schedule(tiles, parts: int, min_tiles: int = MLA_MIN_TILES):
    """The persistent grid's schedule (mla_v2_schedule_kernel): the tiles of every sequence, in order, cut into
    `parts` runs of `payload = max(ceil(total / parts), min_tiles)` tiles.  Returns (runs, seqs): runs[p] =
    (first sequence, first tile, last sequence, end tile) or None for an empty part; seqs[b] = (first part, parts)."""
    tiles = [int(n) for n in tiles]
    total = sum(tiles)
    payload = max(-(-total // parts), min_tiles)
    starts = np.concatenate([[0], np.cumsum(tiles)]).astype(int)
    runs: list = [None] * parts
    for p in range(parts):
        g0, g1 = p * payload, min((p + 1) * payload, total)
        if g0 >= total:
            continue
        bf = int(np.searchsorted(starts, g0, side="right")) - 1
        bl = int(np.searchsorted(starts, g1, side="left")) - 1
        runs[p] = (bf, g0 - int(starts[bf]), bl, g1 - int(starts[bl]))
    seqs = [(int(starts[b]) // payload, (int(starts[b]) + n - 1) // payload - int(starts[b]) // payload + 1)
            for b, n in enumerate(tiles)]
    return runs, seqs


def mla_run_segments(run, tiles) -> list[int]:
    """The tiles of each sequence that a part's run (mla_schedule) covers, in order."""
    bf, tf, bl, tl = run
    return [(tl if b == bl else tiles[b]) - (tf if b == bf else 0) for b in range(bf, bl + 1)]


def mla_sparse_decode(q, kv_cache, past_len, selected, *, dl: int, scale: float, new_rows=None):
    """Sparse MLA (mtp_mla_sparse_decode).  q [B, S, H, D], kv_cache [B, T_max, C] (C >= D: the first D values of
    a row are its latent), selected [B, S, K] cache rows (-1 or out of range: skipped), new_rows [B, S, C] or None.
    Returns (out [B, S, H, dl] float64, cache after the commit): softmax over the listed rows only."""
    q, cache, out = _decode_start(q, kv_cache, past_len, new_rows, dl)
    B, S, H, D = q.shape
    T_max = cache.shape[1]
    for b in range(B):
        for s in range(S):
            rows = [int(r) for r in selected[b, s] if 0 <= r < T_max]
            if not rows:
                continue
            kv = cache[b, rows, :D].astype(np.float64)  # [n, D]
            scores = _fp32_capped(scale * (q[b, s].astype(np.float64) @ kv.T))  # [H, n]
            e = np.exp(scores - scores.max(-1, keepdims=True))
            out[b, s] = (e / e.sum(-1, keepdims=True)) @ kv[:, :dl]
    return out, cache


# ---------------------------------------------------------------------------------------------
# 1b. DeepSeek Sparse Attention's lightning indexer
# ---------------------------------------------------------------------------------------------
def dsa_scores(q_index, weights, keys, *, scale: float) -> np.ndarray:
    """Index scores I [S, T] of one sequence: I[s, t] = sum_j w[s, j] max(0, scale q[s, j] . k[t]), in float64.
    q_index [S, Hi, Di], weights [S, Hi], keys [T, Di]."""
    qk = np.einsum("sjd,td->sjt", np.asarray(q_index, np.float64), np.asarray(keys, np.float64)) * scale
    return np.einsum("sj,sjt->st", np.asarray(weights, np.float64), np.maximum(qk, 0.0))


def topk_rows(scores, visible, k: int) -> np.ndarray:
    """The selection rule of mtp_dsa_select on one query: of the visible rows (visible [T] bool), the k with the
    highest scores [T] -- all of them when at most k are visible -- ties to the earlier row (ONNX TopK's rule), a
    NaN above every number; -> [k] int32, the rows ascending, then -1."""
    scores, visible = np.asarray(scores), np.asarray(visible, bool)
    rows = np.flatnonzero(visible)
    key = np.where(np.isnan(scores[rows]), np.inf, scores[rows])
    nan = np.isnan(scores[rows])
    order = np.lexsort((rows, -key, ~nan))  # NaN first, then score descending, then the earlier row
    out = np.full(k, -1, np.int32)
    pick = np.sort(rows[order[:k]])
    out[:len(pick)] = pick
    return out


def dsa_select(q_index, weights, kv_cache, past_len, *, key_offset: int, k: int, scale: float, mask=None,
               scores_dtype=np.float32):
    """mtp_dsa_select: q_index [B, S, Hi, Di], weights [B, S, Hi], kv_cache [B, T_max, C] (the new rows already
    committed), past_len [B], mask [B, S, S] or None (causal).  -> (selected [B, S, k] int32, scores [B, S, L] with
    L = min(past_len + S, T_max) per sequence padded with NaN).  The scores are rounded to `scores_dtype` before
    the selection (the kernel's are fp32)."""
    q_index = np.asarray(q_index)
    B, S, Hi, Di = q_index.shape
    T_max = kv_cache.shape[1]
    selected = np.full((B, S, k), -1, np.int32)
    all_scores = np.full((B, S, T_max), np.nan)
    for b in range(B):
        c = int(np.clip(past_len[b], 0, T_max))
        L = min(c + S, T_max)
        keys = np.asarray(kv_cache[b, :L, key_offset:key_offset + Di])
        sc = dsa_scores(q_index[b], weights[b], keys, scale=scale).astype(scores_dtype)  # [S, L]
        vis = mla_visible(c, L, S, None if mask is None else mask[b])
        for s in range(S):
            selected[b, s] = topk_rows(sc[s], vis[s], k)
        all_scores[b, :, :L] = sc
    return selected, all_scores


def selections_agree(got, want, scores, *, rtol: float) -> tuple[bool, str]:
    """Whether two selections [..., K] (ascending rows, then -1) of the same queries agree up to rounding: the same
    number of rows, and every row in one but not the other scored within rtol * max |score| of the query's
    threshold (the lowest score `want` selected), so only near-ties were broken differently.  scores [..., T]
    are `want`'s.  -> (ok, the first disagreement in words)."""
    got, want, scores = np.asarray(got), np.asarray(want), np.asarray(scores, np.float64)
    for idx in np.ndindex(*want.shape[:-1]):
        g, w, sc = got[idx], want[idx], scores[idx]
        g_rows, w_rows = g[g >= 0], w[w >= 0]
        where = f"query {tuple(int(i) for i in idx)}"
        if len(g_rows) != len(w_rows) or np.any(g[len(g_rows):] != -1):
            return False, f"{where}: {len(g_rows)} rows selected, expected {len(w_rows)}"
        if len(set(g_rows.tolist())) != len(g_rows) or np.any(np.diff(g_rows) <= 0):
            return False, f"{where}: rows not strictly ascending: {g_rows.tolist()[:8]} ..."
        extra = np.setdiff1d(g_rows, w_rows)
        if extra.size == 0:
            continue
        if np.any(extra >= sc.shape[0]) or np.any(np.isnan(sc[extra])):
            return False, f"{where}: row(s) {extra.tolist()[:4]} are not visible"
        thr = sc[w_rows].min()
        tol = rtol * max(np.nanmax(np.abs(sc)), 1e-30)
        swapped = np.concatenate([extra, np.setdiff1d(w_rows, g_rows)])
        off = np.abs(sc[swapped] - thr) > tol
        if off.any():
            r = int(swapped[off][0])
            return False, f"{where}: row {r} (score {sc[r]!r}) differs, threshold {thr!r}, tolerance {tol:.3g}"
    return True, ""


# ---------------------------------------------------------------------------------------------
# 2. Acceptance
# ---------------------------------------------------------------------------------------------
def argmax_ids(logits) -> np.ndarray:
    """[..., V] -> [...] int32; ties -> lowest index, first NaN wins (numpy.argmax)."""
    return np.argmax(np.asarray(logits, dtype=np.float32), axis=-1).astype(np.int32)


def _finish(drafts_b, n: int, bonus: int, K: int) -> np.ndarray:
    row = np.full(K + 1, -1, dtype=np.int32)
    row[:n] = drafts_b[:n]
    row[n] = bonus
    return row


def accept_strict(drafts, logits=None, target_ids=None):
    """Strict acceptance.  drafts [B, K]; logits [B, K+1, V] or target_ids [B, K+1].
    Returns (out_tokens [B, K+1], num_accepted [B], last_index [B]), all int32."""
    tgt = argmax_ids(logits) if logits is not None else np.asarray(target_ids, dtype=np.int32)
    drafts = np.asarray(drafts, dtype=np.int32).reshape(tgt.shape[0], -1)
    B, K = drafts.shape
    out = np.empty((B, K + 1), dtype=np.int32)
    num = np.empty(B, dtype=np.int32)
    for b in range(B):
        n = 0
        while n < K and drafts[b, n] == tgt[b, n]:
            n += 1
        out[b] = _finish(drafts[b], n, int(tgt[b, n]), K)
        num[b] = n
    return out, num, num.copy()


def relaxed_ok(logits, drafts, topk: int, delta: float):
    """Per draft position [B, K]: (ok, margin).  ok = rank(d) < topk and p(d) >= p1 - delta;
    margin = p(d) - (p1 - delta) (float64 softmax), for tests to avoid razor-thin decisions."""
    x = np.asarray(logits, dtype=np.float32)
    drafts = np.asarray(drafts, dtype=np.int64)
    B, K = drafts.shape
    V = x.shape[-1]
    ok = np.zeros((B, K), dtype=bool)
    margin = np.full((B, K), -np.inf)
    for b in range(B):
        for i in range(K):
            d = int(drafts[b, i])
            if not 0 <= d < V or topk <= 0:
                continue
            row = x[b, i]
            ld = row[d]
            rank = int(np.count_nonzero(row > ld) + np.count_nonzero(row[:d] == ld))
            r64 = row.astype(np.float64)
            mx = r64.max()
            e = np.exp(r64 - mx)
            z = e.sum()
            margin[b, i] = e[d] / z - (1.0 / z - delta)
            ok[b, i] = rank < topk and margin[b, i] >= 0
    return ok, margin


def think_update(flag: int, tok: int, start_id: int, end_id: int) -> int:
    if tok == start_id:
        return 1
    if tok == end_id:
        return 0
    return flag


def accept_relaxed(logits, drafts, thinking, *, topk: int, delta: float, think_start_id: int,
                   think_end_id: int):
    """Relaxed acceptance (mtp_accept_relaxed).
    Returns (out_tokens [B, K+1], num_accepted [B], last_index [B], thinking_after [B])."""
    tgt = argmax_ids(logits)
    drafts = np.asarray(drafts, dtype=np.int32).reshape(tgt.shape[0], -1)
    B, K = drafts.shape
    ok, _ = relaxed_ok(logits, drafts, topk, delta)
    out = np.empty((B, K + 1), dtype=np.int32)
    num = np.empty(B, dtype=np.int32)
    th_out = np.empty(B, dtype=np.int32)
    for b in range(B):
        th = 1 if thinking[b] else 0
        n = 0
        while n < K:
            d = int(drafts[b, n])
            if not (d == tgt[b, n] or (th and ok[b, n])):
                break
            th = think_update(th, d, think_start_id, think_end_id)
            n += 1
        bonus = int(tgt[b, n])
        th = think_update(th, bonus, think_start_id, think_end_id)
        out[b] = _finish(drafts[b], n, bonus, K)
        num[b] = n
        th_out[b] = th
    return out, num, num.copy(), th_out


def strided_drafts(drafts, B: int, K: int, draft_stride: int) -> np.ndarray:
    """The [B, K] drafts a kernel reads from a flat buffer at drafts[b * draft_stride + i]
    (e.g. input_ids [B, K+1] with the pointer moved by one and draft_stride = K+1)."""
    if draft_stride < K:
        raise ValueError(f"draft_stride {draft_stride} < K {K}")
    flat = np.asarray(drafts, dtype=np.int32).reshape(-1)
    return flat[np.arange(B)[:, None] * draft_stride + np.arange(K)[None, :]].reshape(B, K)


def accept_relaxed_dev(logits, drafts, draft_stride: int, thinking_in, *, topk: int, delta: float,
                       think_start_id: int, think_end_id: int):
    """mtp_accept_relaxed_dev (ABI 3): drafts read with a stride from a flat buffer, the flags in
    thinking_in left alone.  Returns (out_tokens [B, K+1], num_accepted [B], last_index [B],
    thinking_out [B])."""
    B, S = np.asarray(logits).shape[:2]
    d = strided_drafts(drafts, B, S - 1, draft_stride)
    return accept_relaxed(logits, d, np.array(thinking_in, copy=True), topk=topk, delta=delta,
                          think_start_id=think_start_id, think_end_id=think_end_id)


def quantize_weights(w) -> np.ndarray:
    """W_j = floor(min(max(w_j, 0), 1) * 2^40) as uint64 (NaN -> 0), w taken as float32."""
    w = np.fmin(np.fmax(np.asarray(w, dtype=np.float32), np.float32(0)), np.float32(1))
    return np.floor(w.astype(np.float64) * 2.0**W_BITS).astype(np.uint64)


def sample_exact(w, u) -> int | None:
    """Exact integer inverse-CDF draw from weights w with uniform u; None if all W_j are 0."""
    W = quantize_weights(w)
    tot = int(W.sum(dtype=np.uint64))
    if tot == 0:
        return None
    uf = float(np.float32(u))
    if not uf >= 0.0:  # negative or NaN
        uf = 0.0
    U = min(int(np.floor(uf * 2.0**U_BITS)), 2**U_BITS - 1)
    thr = (U * tot) >> U_BITS
    cum = np.cumsum(W, dtype=np.uint64)
    return int(np.searchsorted(cum, np.uint64(thr), side="right"))


def accept_rejection(p, q, drafts, uniforms):
    """Rejection sampling (mtp_accept_rejection), reproducing the kernel's tokens exactly.
    p [B, K+1, V], q [B, K, V] (any float dtype, used as float32), drafts [B, K], uniforms
    [B, K+1] float32.  Returns (out_tokens [B, K+1], num_accepted [B], last_index [B])."""
    p = np.asarray(p, dtype=np.float32)
    B, K1, V = p.shape
    K = K1 - 1
    q = np.asarray(q, dtype=np.float32).reshape(B, K, V) if K > 0 else np.zeros((B, 0, V), np.float32)
    drafts = np.asarray(drafts, dtype=np.int32).reshape(B, K)
    u = np.asarray(uniforms, dtype=np.float32).reshape(B, K1)
    out = np.empty((B, K1), dtype=np.int32)
    num = np.empty(B, dtype=np.int32)
    for b in range(B):
        n = 0
        while n < K:
            d = int(drafts[b, n])
            if not 0 <= d < V:
                break
            pd, qd = p[b, n, d], q[b, n, d]
            with np.errstate(all="ignore"):
                acc = bool(u[b, n] < np.float32(pd / qd)) if qd > 0 else bool(pd > 0)
            if not acc:
                break
            n += 1
        if n < K:
            with np.errstate(invalid="ignore"):
                w = p[b, n] - q[b, n]  # float32 subtraction, clamped in quantize_weights
            tok = sample_exact(w, u[b, K])
            if tok is None:
                tok = sample_exact(p[b, n], u[b, K])
        else:
            tok = sample_exact(p[b, K], u[b, K])
        out[b] = _finish(drafts[b], n, 0 if tok is None else tok, K)
        num[b] = n
    return out, num, num.copy()


# ---------------------------------------------------------------------------------------------
# 3. Small per-step kernels
# ---------------------------------------------------------------------------------------------
def gather_last_hidden(hidden, last_index) -> np.ndarray:
    """hidden [B, K+1, D], last_index [B] -> [B, D] (index clamped to [0, K])."""
    hidden = np.asarray(hidden)
    idx = np.clip(np.asarray(last_index, dtype=np.int64), 0, hidden.shape[1] - 1)
    return hidden[np.arange(hidden.shape[0]), idx]


def window_update(win_tokens, win_hidden, new_tokens, new_hidden, num_accepted):
    """Past-K window update (mtp_window_update).  Returns (tokens [B, K], hidden [B, K, D]).
    n = clamp(num_accepted + 1, 0, N) new pairs are appended and the last K kept."""
    win_tokens = np.asarray(win_tokens)
    win_hidden = np.asarray(win_hidden)
    B, K = win_tokens.shape
    N = np.asarray(new_tokens).shape[1]
    tok_out = np.empty_like(win_tokens)
    hid_out = np.empty_like(win_hidden)
    for b in range(B):
        n = int(np.clip(int(num_accepted[b]) + 1, 0, N))
        seq_t = np.concatenate([win_tokens[b], np.asarray(new_tokens)[b, :n]])
        seq_h = np.concatenate([win_hidden[b], np.asarray(new_hidden)[b, :n]])
        tok_out[b] = seq_t[len(seq_t) - K:]
        hid_out[b] = seq_h[len(seq_h) - K:]
    return tok_out, hid_out
