"""CPU checks of the NumPy references in plugins/reference.py against independent formulations
(explicit loops, sorting, a statistical test of losslessness).  Always runs; no GPU, no nvcc."""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtp_trt.plugins import reference as ref

from ._compare import assert_close, assert_equal


# ---------------------------------------------------------------------------------------------
# bfloat16 helpers
# ---------------------------------------------------------------------------------------------
def test_bf16_round_trip_known_values():
    x = np.array([0.0, -0.0, 1.0, -2.5, 1.00390625, 1.01171875, 3.0e38, np.inf, -np.inf], np.float32)
    bits = ref.f32_to_bf16_bits(x)
    # 1.00390625 = 1 + 2^-8 is a tie between 1 and 1 + 2^-7: rounds to even (1.0);
    # 1.01171875 = 1 + 3 * 2^-8 is a tie between 1 + 2^-7 and 1 + 2^-6: rounds to even (1 + 2^-6)
    assert_equal(bits, np.array([0x0000, 0x8000, 0x3F80, 0xC020, 0x3F80, 0x3F82, 0x7F62, 0x7F80, 0xFF80], np.uint16))
    assert_equal(ref.bf16_bits_to_f32(bits[:4]), x[:4])
    assert np.isnan(ref.bf16_bits_to_f32(ref.f32_to_bf16_bits(np.array([np.nan], np.float32))))[0]


def test_bf16_matches_ml_dtypes_when_available():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 10.0 ** np.random.default_rng(1).integers(
        -30, 30, 10000)
    want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert_equal(ref.f32_to_bf16_bits(x), want)


# ---------------------------------------------------------------------------------------------
# MLA decode
# ---------------------------------------------------------------------------------------------
def mla_loop(q, cache, past_len, dl, scale, new_rows, mask):
    """Per-query scalar loop: the definition written out plainly."""
    B, S, H, D = q.shape
    cache = [[list(map(float, r)) for r in cache[b]] for b in range(B)]
    T_max = len(cache[0])
    out = np.zeros((B, S, H, dl))
    for b in range(B):
        c = min(max(int(past_len[b]), 0), T_max)
        if new_rows is not None:
            for s in range(S):
                if c + s < T_max:
                    cache[b][c + s] = list(map(float, new_rows[b, s]))
        L = min(c + S, T_max)
        for s in range(S):
            vis = [t for t in range(L) if t < c or (mask[b, s, t - c] if mask is not None else t - c <= s)]
            for h in range(H):
                if not vis:
                    continue
                sc = [scale * sum(float(q[b, s, h, d]) * cache[b][t][d] for d in range(D)) for t in vis]
                m = max(sc)
                w = [math.exp(x - m) for x in sc]
                z = sum(w)
                for j in range(dl):
                    out[b, s, h, j] = sum(wi * cache[b][t][j] for wi, t in zip(w, vis)) / z
    return out


@pytest.mark.parametrize("use_mask", [False, True])
@pytest.mark.parametrize("commit", [False, True])
def test_mla_decode_matches_loop(use_mask, commit):
    rng = np.random.default_rng(1 + use_mask + 2 * commit)
    B, S, H, dl, dr, T = 3, 3, 2, 6, 3, 9
    q = rng.standard_normal((B, S, H, dl + dr))
    cache = rng.standard_normal((B, T, dl + dr))
    past_len = np.array([0, 4, 7], np.int32)  # empty; middle; the last clamps at T (7 + 3 > 9)
    new_rows = rng.standard_normal((B, S, dl + dr)) if commit else None
    mask = None
    if use_mask:
        mask = rng.integers(0, 2, (B, S, S)).astype(np.uint8)
        mask[0, 1, :] = 0  # query with no visible row at all (past_len 0): zeros
    got, new_cache = ref.mla_decode(q, cache, past_len, dl=dl, scale=0.3, new_rows=new_rows, mask=mask)
    want = mla_loop(q, cache, past_len, dl, 0.3, new_rows, mask)
    assert_close(got, want, atol=1e-12, rtol=1e-10, name="mla_decode")
    if use_mask:
        assert_equal(got[0, 1], np.zeros((H, dl)))
    if commit:
        assert_equal(new_cache[1, 4:7], new_rows[1])
        assert_equal(new_cache[2, 7:9], new_rows[2, :2])  # row 9 would be past T_max: skipped
        assert_equal(new_cache[0, 3:], cache[0, 3:])
    else:
        assert new_cache is cache or np.array_equal(new_cache, cache)


def test_mla_causal_equals_lower_triangular_mask():
    rng = np.random.default_rng(5)
    B, S, H, dl, dr, T = 2, 4, 3, 8, 4, 20
    q = rng.standard_normal((B, S, H, dl + dr))
    cache = rng.standard_normal((B, T, dl + dr))
    cl = np.array([5, 11], np.int32)
    tri = np.broadcast_to(np.tril(np.ones((S, S), np.uint8)), (B, S, S))
    a, _ = ref.mla_decode(q, cache, cl, dl=dl, scale=0.2)
    b, _ = ref.mla_decode(q, cache, cl, dl=dl, scale=0.2, mask=tri)
    assert_close(a, b, atol=0, rtol=0)


def test_num_splits_rule():
    """Parts of the persistent grid: one wave of 64-row blocks, no more parts than fours of 32-row tiles, <= 256."""
    assert ref.mla_num_splits(1, 1, 128, 32768, 132) == 66      # 2 row blocks: 132 // 2
    assert ref.mla_num_splits(64, 1, 128, 4096, 132) == 66      # the same grid whatever B: the lengths are shared
    assert ref.mla_num_splits(64, 4, 128, 4096, 132) == 16      # 8 row blocks
    assert ref.mla_num_splits(1, 1, 16, 32768, 132) == 132
    assert ref.mla_num_splits(64, 4, 16, 4096, 132) == 132      # S = 4 at H = 16 is still one row block
    assert ref.mla_num_splits(1, 1, 16, 300, 132) == 3          # 10 tiles of 32 rows
    assert ref.mla_num_splits(1, 1, 16, 10**6, 1000) == 256
    assert ref.mla_num_splits(1, 128, 128, 4096, 132) == 1      # a prefill: 256 row blocks fill the GPU
    assert ref.mla_workspace_size(2, 3, 16, 512, 1) == 0
    rows = (5 + 2 - 1) * 3 * 16
    assert ref.mla_workspace_size(2, 3, 16, 512, 5) == (rows * 512 * 4 + rows * 8 + 256 + 256)


def test_schedule_cuts_the_tiles_into_equal_runs():
    runs, seqs = ref.mla_schedule([2, 5], 4, min_tiles=2)  # payload max(ceil(7 / 4), 2) = 2
    assert runs == [(0, 0, 0, 2), (1, 0, 1, 2), (1, 2, 1, 4), (1, 4, 1, 5)]
    assert seqs == [(0, 1), (1, 3)]
    runs, seqs = ref.mla_schedule([3, 1, 4], 3, min_tiles=2)  # payload 3: part 1 runs from sequence 1 into 2
    assert runs == [(0, 0, 0, 3), (1, 0, 2, 2), (2, 2, 2, 4)]
    assert seqs == [(0, 1), (1, 1), (1, 2)]
    runs, seqs = ref.mla_schedule([1], 8)  # more parts than tiles: the rest are empty
    assert runs == [(0, 0, 0, 1)] + [None] * 7 and seqs == [(0, 1)]
    runs, seqs = ref.mla_schedule([9], 8)  # at least 4 tiles a part
    assert runs == [(0, 0, 0, 4), (0, 4, 0, 8), (0, 8, 0, 9)] + [None] * 5 and seqs == [(0, 3)]


@pytest.mark.parametrize("H,S", [(128, 1), (128, 2), (128, 4), (16, 1), (16, 4), (20, 3), (64, 2)])
def test_schedule_fills_one_wave_evenly(H, S):
    """On a 132-SM GPU: the grid is at most one wave, and over ragged lengths no part takes more than 1.15x the mean
    of the busy ones once each has at least 8 tiles (32 rows each)."""
    rng = np.random.default_rng(H * 10 + S)
    for B in (1, 2, 8, 64):
        for _ in range(5):
            T = int(rng.choice([4096, 32768, 131072]))
            lengths = rng.integers(1, T - S + 1, B) + S
            P = ref.mla_num_splits(B, S, H, T, 132)
            assert -(-S * H // 64) * P <= 132
            tiles = [-(-int(n) // 32) for n in lengths]
            runs, _ = ref.mla_schedule(tiles, P)
            work = [sum(ref.mla_run_segments(r, tiles)) for r in runs if r is not None]
            assert sum(work) == sum(tiles)
            if sum(tiles) >= 8 * P:
                assert max(work) <= 1.15 * np.mean(work), (B, T, lengths, work)



# ---------------------------------------------------------------------------------------------
# DeepSeek Sparse Attention
# ---------------------------------------------------------------------------------------------
def test_mla_sparse_over_every_visible_row_is_dense():
    """Listing exactly the rows a query sees (any order, padded with -1) gives mtp_mla_decode's dense output, and
    the latent's trailing indexer-key values are never attended."""
    rng = np.random.default_rng(8)
    B, S, H, dl, dr, di, T = 2, 3, 4, 8, 4, 5, 20
    q = rng.standard_normal((B, S, H, dl + dr))
    cache = rng.standard_normal((B, T, dl + dr + di))
    new = rng.standard_normal((B, S, dl + dr + di))
    cl = np.array([0, 9], np.int32)
    sel = np.full((B, S, 16), -1, np.int32)
    for b in range(B):
        for s in range(S):
            rows = rng.permutation(int(cl[b]) + s + 1)
            sel[b, s, :len(rows)] = rows
    got, cache_after = ref.mla_sparse_decode(q, cache, cl, sel, dl=dl, scale=0.3, new_rows=new)
    want, _ = ref.mla_decode(q, cache[..., :dl + dr], cl, dl=dl, scale=0.3, new_rows=new[..., :dl + dr])
    assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert_equal(cache_after, ref.mla_kv_commit(cache, cl, new))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=1, max_size=40), st.integers(1, 12), st.data())
def test_topk_rows_matches_sorting(values, k, data):
    """topk_rows against Python's sort on (score descending, row ascending), NaN first."""
    vis = data.draw(st.lists(st.booleans(), min_size=len(values), max_size=len(values)))
    scores = np.array(values, np.float32)
    if data.draw(st.booleans()):
        scores[data.draw(st.integers(0, len(values) - 1))] = np.nan
    ranked = sorted((t for t in range(len(values)) if vis[t]),
                    key=lambda t: (not np.isnan(scores[t]), -np.nan_to_num(scores[t]), t))
    want = sorted(ranked[:k]) + [-1] * (k - min(k, len(ranked)))
    assert ref.topk_rows(scores, vis, k).tolist() == want


def test_dsa_select_matches_the_indexer_formula():
    """dsa_select's scores against a per-row loop of I[s, t] = sum_j w[s, j] ReLU(q[s, j] . k[t] * scale) over the
    visible rows, and its selection against the loop's ranking."""
    rng = np.random.default_rng(9)
    B, S, hi, di, C, off, T, K = 1, 3, 4, 6, 10, 4, 30, 7
    q = rng.standard_normal((B, S, hi, di))
    w = rng.standard_normal((B, S, hi))
    cache = rng.standard_normal((B, T, C))
    cl = np.array([20], np.int32)
    sel, scores = ref.dsa_select(q, w, cache, cl, key_offset=off, k=K, scale=0.4, scores_dtype=np.float64)
    for s in range(S):
        seen = list(range(20 + s + 1))
        loop = {t: sum(w[0, s, j] * max(0.0, float(q[0, s, j] @ cache[0, t, off:off + di]) * 0.4) for j in range(hi))
                for t in seen}
        for t in seen:
            assert math.isclose(scores[0, s, t], loop[t], rel_tol=1e-12, abs_tol=1e-12)
        assert sel[0, s].tolist() == sorted(sorted(seen, key=lambda t: (-loop[t], t))[:K])


def test_selections_agree_tolerates_only_near_ties():
    scores = np.array([[5.0, 1.0, 3.0, 3.0 + 1e-7, 0.5]])
    want = np.array([[0, 3, -1]])
    assert ref.selections_agree(np.array([[0, 2, -1]]), want, scores, rtol=1e-6)[0]  # a near tie swapped
    ok, why = ref.selections_agree(np.array([[0, 1, -1]]), want, scores, rtol=1e-6)
    assert not ok and "row 1" in why
    assert not ref.selections_agree(np.array([[0, -1, -1]]), want, scores, rtol=1e-6)[0]  # a row missing
    assert not ref.selections_agree(np.array([[3, 0, -1]]), want, scores, rtol=1e-6)[0]  # not ascending


# ---------------------------------------------------------------------------------------------
# strict / relaxed acceptance
# ---------------------------------------------------------------------------------------------
def strict_loop(logits, drafts):
    B, K1, V = logits.shape
    out, nums = [], []
    for b in range(B):
        tgt = []
        for i in range(K1):
            best = 0
            for j in range(V):
                if logits[b, i, j] > logits[b, i, best]:
                    best = j
            tgt.append(best)
        toks = []
        for i in range(K1 - 1):
            if drafts[b][i] != tgt[i]:
                break
            toks.append(int(drafts[b][i]))
        n = len(toks)
        toks.append(tgt[n])
        out.append(toks + [-1] * (K1 - len(toks)))
        nums.append(n)
    return np.array(out, np.int32), np.array(nums, np.int32)


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 4), K=st.integers(0, 5), V=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_accept_strict_matches_loop(B, K, V, seed):
    rng = np.random.default_rng(seed)
    logits = rng.integers(0, 3, (B, K + 1, V)).astype(np.float32)  # few levels: many ties
    tgt = np.argmax(logits, -1)
    drafts = np.where(rng.random((B, K)) < 0.8, tgt[:, :K], rng.integers(0, V, (B, K))).astype(np.int32)
    out, num, last = ref.accept_strict(drafts, logits=logits)
    want_out, want_num = strict_loop(logits, drafts)
    assert_equal(out, want_out, name="tokens")
    assert_equal(num, want_num, name="num_accepted")
    assert_equal(last, want_num, name="last_index")
    out2, num2, _ = ref.accept_strict(drafts, target_ids=tgt.astype(np.int32))
    assert_equal(out2, out)
    assert_equal(num2, num)


def test_argmax_nan_first_wins():
    x = np.array([[1.0, np.nan, 5.0, np.nan]], np.float32)
    assert ref.argmax_ids(x)[0] == 1


def relaxed_loop(logits, drafts, thinking, topk, delta, ts, te):
    """Independent formulation: explicit sort for the top-N set, math.exp softmax."""
    B, K1, V = logits.shape
    K = K1 - 1
    outs, nums, ths = [], [], []
    for b in range(B):
        th = int(thinking[b])
        toks = []
        for i in range(K1):
            row = [float(v) for v in logits[b, i]]
            order = sorted(range(V), key=lambda j: (-row[j], j))
            top1 = order[0]
            if i == K:
                toks.append(top1)
                th = 1 if top1 == ts else 0 if top1 == te else th
                break
            d = int(drafts[b, i])
            mx = row[top1]
            z = sum(math.exp(v - mx) for v in row)
            ok = d == top1
            if not ok and th and topk > 0 and 0 <= d < V:
                ok = d in order[:topk] and math.exp(row[d] - mx) / z >= 1.0 / z - delta
            if not ok:
                toks.append(top1)
                th = 1 if top1 == ts else 0 if top1 == te else th
                break
            toks.append(d)
            th = 1 if d == ts else 0 if d == te else th
        n = len(toks) - 1
        outs.append(toks + [-1] * (K1 - len(toks)))
        nums.append(n)
        ths.append(th)
    return np.array(outs, np.int32), np.array(nums, np.int32), np.array(ths, np.int32)


@settings(max_examples=80, deadline=None)
@given(B=st.integers(1, 4), K=st.integers(0, 5), V=st.integers(2, 8), topk=st.integers(0, 4),
       delta=st.sampled_from([0.0, 0.05, 0.2, 0.5, 1.0]), seed=st.integers(0, 2**32 - 1))
def test_accept_relaxed_matches_loop(B, K, V, topk, delta, seed):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((B, K + 1, V)) * 2).astype(np.float32)
    logits[rng.random((B, K + 1, V)) < 0.1] = 1.0  # some exact ties
    drafts = rng.integers(0, V, (B, K)).astype(np.int32)
    thinking = rng.integers(0, 2, B).astype(np.int32)
    ts, te = 0, 1
    _, margin = ref.relaxed_ok(logits, drafts, topk, delta)
    if np.any(np.abs(margin) < 1e-9):  # decision at the rounding edge: formulations may differ
        return
    got = ref.accept_relaxed(logits, drafts, thinking, topk=topk, delta=delta, think_start_id=ts, think_end_id=te)
    want = relaxed_loop(logits, drafts, thinking, topk, delta, ts, te)
    assert_equal(got[0], want[0], name="tokens")
    assert_equal(got[1], want[1], name="num_accepted")
    assert_equal(got[2], want[1], name="last_index")
    assert_equal(got[3], want[2], name="thinking")


def test_relaxed_thinking_flag_sequence():
    # V = 6, ids: 4 = <think>, 5 = </think>.  Drafts: [4, 2, 5, 3]; argmax everywhere 0 except
    # draft 0 which matches.  Flag off at the start: draft 0 (= <think>) accepted strictly and
    # turns relaxed acceptance on for position 1, so draft 1 (top-2, close) is accepted relaxed.
    V, K = 6, 4
    logits = np.zeros((1, K + 1, V), np.float32)
    logits[0, 0] = [0, 0, 0, 0, 5, 0]
    for i in range(1, K + 1):
        logits[0, i] = [3.0, 0, 2.9, 2.8, 0, 2.7]
    drafts = np.array([[4, 2, 5, 3]], np.int32)
    out, n, _, th = ref.accept_relaxed(logits, drafts, np.array([0], np.int32), topk=4, delta=0.5,
                                       think_start_id=4, think_end_id=5)
    # position 2: draft 5 (</think>) in top-4, close -> accepted, turns the flag off; position 3:
    # draft 3 would be fine relaxed but the flag is off -> rejected, bonus = argmax 0.
    assert_equal(out, np.array([[4, 2, 5, 0, -1]], np.int32))
    assert n[0] == 3 and th[0] == 0
    out, n, _, th = ref.accept_relaxed(logits, drafts, np.array([0], np.int32), topk=1, delta=0.5,
                                       think_start_id=4, think_end_id=5)
    assert_equal(out, np.array([[4, 0, -1, -1, -1]], np.int32))
    assert th[0] == 1


@pytest.mark.parametrize("K,skip,stride", [(3, 1, 4), (3, 0, 6), (0, 1, 1), (5, 2, 9)])
def test_accept_relaxed_dev_strided_drafts(K, skip, stride):
    """ABI 3: drafts read at drafts[b * stride + i] from a buffer with garbage in the gaps (skip = 1,
    stride = K+1 is the plugin's input_ids + 1), thinking_in left alone, thinking_out returned."""
    rng = np.random.default_rng(K * 100 + stride)
    B, V = 4, 12
    logits = (rng.standard_normal((B, K + 1, V)) * 2).astype(np.float32)
    drafts = ref.argmax_ids(logits)[:, :K].copy()
    drafts[:, K // 2:] = rng.integers(0, V, (B, K - K // 2))
    buf = np.full((B, stride + skip), 99, np.int32).reshape(-1)  # 99 >= V: accepting garbage would show
    for b in range(B):
        buf[skip + b * stride: skip + b * stride + K] = drafts[b]
    assert_equal(ref.strided_drafts(buf[skip:], B, K, stride), drafts, name="strided_drafts")
    thinking = np.array([0, 1, 0, 1], np.int32)
    got = ref.accept_relaxed_dev(logits, buf[skip:], stride, thinking, topk=3, delta=0.5, think_start_id=0,
                                 think_end_id=1)
    want = ref.accept_relaxed(logits, drafts, thinking.copy(), topk=3, delta=0.5, think_start_id=0, think_end_id=1)
    for name, g, w in zip(("tokens", "num_accepted", "last_index", "thinking_out"), got, want):
        assert_equal(g, w, name=name)
    assert_equal(thinking, np.array([0, 1, 0, 1], np.int32), name="thinking_in")
    with pytest.raises(ValueError):
        ref.strided_drafts(buf, B, K + 1, K)


# ---------------------------------------------------------------------------------------------
# rejection sampling
# ---------------------------------------------------------------------------------------------
def sample_loop(w, u):
    """Integer inverse CDF written with Python ints."""
    W = [int(math.floor(min(max(float(np.float32(x)), 0.0), 1.0) * 2**40)) if not math.isnan(x) else 0 for x in w]
    tot = sum(W)
    if tot == 0:
        return None
    U = min(int(math.floor(max(float(np.float32(u)), 0.0) * 2**24)), 2**24 - 1)
    thr = U * tot // 2**24
    cum = 0
    for j, x in enumerate(W):
        cum += x
        if cum > thr:
            return j
    raise AssertionError("unreachable")


@settings(max_examples=100, deadline=None)
@given(V=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
def test_sample_exact_matches_python_ints(V, seed):
    rng = np.random.default_rng(seed)
    w = rng.random(V).astype(np.float32) * (rng.random(V) < 0.7)
    w[rng.random(V) < 0.1] = np.float32(np.nan)
    for u in [0.0, 0.5, float(np.nextafter(np.float32(1), np.float32(0))), float(rng.random())]:
        assert ref.sample_exact(w, u) == sample_loop(w, u)


def test_rejection_deterministic_cases():
    p = np.array([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]], np.float32)  # K = 1
    q = np.array([[[0.25, 0.75, 0.0]]], np.float32)
    d = np.array([[1]], np.int32)
    # draft 1: p/q = 2/3.  u0 = 0.5 < 2/3 -> accepted; bonus from p_1 -> token 2.
    out, n, _ = ref.accept_rejection(p, q, d, np.array([[0.5, 0.3]], np.float32))
    assert_equal(out, np.array([[1, 2]], np.int32))
    assert n[0] == 1
    # u0 = 0.7 -> rejected; residual max(p - q, 0) = [0.25, 0, 0] -> token 0 whatever u1.
    out, n, _ = ref.accept_rejection(p, q, d, np.array([[0.7, 0.99]], np.float32))
    assert_equal(out, np.array([[0, -1]], np.int32))
    assert n[0] == 0
    # residual all zero (p == q) -> sample from p
    out, n, _ = ref.accept_rejection(p[:, :1].repeat(2, 1), p[:, :1], np.array([[1]], np.int32),
                                     np.array([[1.0 - 1e-7, 0.75]], np.float32))
    assert n[0] == 1  # p/q = 1 > u: always accepted
    out, n, _ = ref.accept_rejection(np.concatenate([q, q], 1), q, np.array([[2]], np.int32),
                                     np.array([[0.5, 0.9]], np.float32))
    assert n[0] == 0 and out[0, 0] == 1  # draft 2 has q = 0, p = 0: rejected; residual empty -> p


def test_rejection_preserves_target_distribution():
    """Lossless: token 0 ~ p_0 and, when draft 0 was accepted, token 1 ~ p_1.  Chi-square test with
    significance 1e-3 per check (fixed seed, so the outcome is deterministic)."""
    rng = np.random.default_rng(1234)
    V, K, N = 5, 2, 20000
    p_rows = np.array([[0.4, 0.3, 0.15, 0.1, 0.05], [0.05, 0.05, 0.1, 0.3, 0.5], [0.2] * 5], np.float32)
    q_rows = np.array([[0.1, 0.1, 0.2, 0.3, 0.3], [0.3, 0.3, 0.2, 0.1, 0.1]], np.float32)
    p = np.broadcast_to(p_rows, (N, K + 1, V))
    q = np.broadcast_to(q_rows, (N, K, V))
    cdf = np.cumsum(q_rows.astype(np.float64), -1)
    drafts = np.stack([np.minimum(np.searchsorted(cdf[i], rng.random(N), side="right"), V - 1)
                       for i in range(K)], 1).astype(np.int32)
    u = rng.random((N, K + 1)).astype(np.float32)
    out, n, _ = ref.accept_rejection(p, q, drafts, u)
    crit = 18.467  # chi-square, 4 degrees of freedom, upper 0.1 %

    def chi2(tokens, probs):
        counts = np.bincount(tokens, minlength=V)
        expct = probs.astype(np.float64) * len(tokens)
        return float(((counts - expct) ** 2 / expct).sum())

    assert chi2(out[:, 0], p_rows[0]) < crit
    sel = n >= 1
    assert sel.sum() > 1000
    assert chi2(out[sel, 1], p_rows[1]) < crit
    # and the draft distribution alone would fail (the test has power)
    assert chi2(drafts[:, 0], p_rows[0]) > crit


# ---------------------------------------------------------------------------------------------
# gather / window
# ---------------------------------------------------------------------------------------------
def test_gather_last_hidden():
    rng = np.random.default_rng(3)
    h = rng.standard_normal((4, 5, 7)).astype(np.float32)
    idx = np.array([0, 4, 2, 9], np.int32)  # 9 clamps to 4
    got = ref.gather_last_hidden(h, idx)
    want = np.stack([h[0, 0], h[1, 4], h[2, 2], h[3, 4]])
    assert_equal(got, want)


@pytest.mark.parametrize("K", [1, 3, 4])
def test_window_update_matches_deque(K):
    rng = np.random.default_rng(K)
    B, N, D = 5, 4, 3
    wt = rng.integers(0, 100, (B, K)).astype(np.int32)
    wh = rng.standard_normal((B, K, D)).astype(np.float32)
    nt = rng.integers(100, 200, (B, N)).astype(np.int32)
    nh = rng.standard_normal((B, N, D)).astype(np.float32)
    na = np.array([0, 1, 2, 3, -1], np.int32)  # n = 1, 2, 3, 4, 0
    got_t, got_h = ref.window_update(wt, wh, nt, nh, na)
    for b in range(B):
        dq = deque(zip(wt[b].tolist(), [tuple(r) for r in wh[b]]), maxlen=K)
        for j in range(max(0, min(int(na[b]) + 1, N))):
            dq.append((int(nt[b, j]), tuple(nh[b, j])))
        assert_equal(got_t[b], np.array([t for t, _ in dq], np.int32))
        assert_equal(got_h[b], np.array([h for _, h in dq], np.float32))
