"""Every CUDA kernel against its NumPy reference (plugins/reference.py), through cuda-python and the
ctypes library.  Marker `gpu`: skipped (with the reason) without cuda-python or a GPU.

Outputs are poisoned before each launch (floats: NaN; int32: 0x7F7F7F7F) so an element the kernel
does not write fails the comparison.  The error status of every launcher is checked, then
cudaDeviceSynchronize + cudaGetLastError.

Attention tolerances (|got - want| <= atol + rtol |want|, want = float64 reference on the same
rounded inputs; outputs are convex combinations of cache values ~ N(0, 1), |v| < ~5):
  float32  atol = rtol = 1e-4: fp32 accumulation over up to 32k rows and exp2f (2 ulp).
  float16  atol = rtol = 3e-3: output rounding 2^-11 relative, and P rounded to fp16 before P.V
           (each weight off by <= 2^-11 relative; the denominator sums the rounded weights) adds
           <= 2^-11 * sum p |v| ~ 2e-3 in the worst case.
  bfloat16 atol = rtol = 2e-2: the same with unit roundoff 2^-8 (8x fp16).
Acceptance and copies are compared exactly.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mtp_trt.plugins import cuda_lib
from mtp_trt.plugins import reference as ref

from ._compare import assert_close, assert_equal
from ._gpu import ESIZE, Gpu, from_storage, storage_dtype, to_storage

pytestmark = pytest.mark.gpu

TOL = {"float32": (1e-4, 1e-4), "float16": (3e-3, 3e-3), "bfloat16": (2e-2, 2e-2)}
POISON_F, POISON_I = 0xFF, 0x7F


@pytest.fixture(scope="module")
def lib():
    return cuda_lib.load_library()


@pytest.fixture()
def gpu():
    g = Gpu(cuda_lib.import_cudart())
    yield g
    g.free_all()


def ptr_or_0(gpu, arr):
    return 0 if arr is None else gpu.upload(arr)


# ---------------------------------------------------------------------------------------------
# MLA decode
# ---------------------------------------------------------------------------------------------
def run_mla(gpu, lib, *, B, S, H, Dl, Dr, T_max, past_len, dtype, mask=None, commit=True, num_splits=None,
            flags=0, seed=0, no_visible=False, huge_scores=False):
    rng = np.random.default_rng(seed)
    D = Dl + Dr
    past_len = np.asarray(past_len, np.int32)
    assert past_len.shape == (B,) and np.all(past_len + S <= T_max)
    q32 = rng.standard_normal((B, S, H, D), np.float32)
    c32 = rng.standard_normal((B, T_max, D), np.float32)
    n32 = rng.standard_normal((B, S, D), np.float32)
    if huge_scores:  # scores beyond the fp32 range: q . row = +inf in fp32 (3e38 * 2) for the rows holding 2 in
        # value 0, +-7.5e37 for the others; the even heads see them (the odd ones stay ordinary)
        q32[:, :, 0::2, 0] = 3e38
        c32[..., 0] = rng.choice(np.float32([2.0, 0.25, -0.25]), c32.shape[:-1])
        n32[..., 0] = 2.0  # every query sees at least one +inf row (its own)
    q_s, q = to_storage(q32, dtype)
    c_s, cache = to_storage(c32, dtype)
    n_s, new = to_storage(n32, dtype)
    if isinstance(mask, str) and mask == "causal":  # what no mask means, spelled out (then no causal cut is made)
        mask = np.broadcast_to(np.tril(np.ones((S, S), np.uint8)), (B, S, S)).copy()
    if isinstance(mask, str) and mask == "tree":
        mask = (np.tril(rng.integers(0, 2, (B, S, S))) | np.eye(S, dtype=np.int64)).astype(np.uint8)
        if no_visible:
            mask[0, 0, :] = 0  # with past_len[0] == 0: query 0 of sequence 0 sees nothing -> zeros
    if not commit:  # the new rows are already in the cache
        c_s = ref.mla_kv_commit(c_s, past_len, n_s)
        cache = from_storage(c_s, dtype)
    scale = 1.5 / math.sqrt(D)
    want, cache_after = ref.mla_decode(q, cache, past_len, dl=Dl, scale=scale, new_rows=new if commit else None,
                                       mask=mask)

    d_q, d_cache, d_len = gpu.upload(q_s), gpu.upload(c_s), gpu.upload(past_len)
    d_new = gpu.upload(n_s) if commit else 0
    d_mask = ptr_or_0(gpu, mask)
    ns = num_splits if num_splits is not None else lib.mla_decode_num_splits(B, S, H, T_max, gpu.num_sms())
    d_out, d_ws, ws_bytes = decode_buffers(gpu, lib, B, S, H, Dl, dtype, ns)
    lib.mla_decode(dtype, d_q, d_cache, d_len, d_new, d_mask, d_out, d_ws, ws_bytes, B, S, H, Dl, Dr, T_max, scale,
                   ns, flags)
    gpu.sync("mtp_mla_decode")
    check_decoded(gpu, dtype, d_out, d_cache, want, cache_after, f"mla_decode {dtype} B={B} S={S} H={H} splits={ns}",
                  "query with no visible row" if no_visible else None)
    return ns


def decode_buffers(gpu, lib, B, S, H, Dl, dtype, ns):
    """A decode kernel's output [B, S, H, Dl] and workspace for `ns` splits, both poisoned: (d_out, d_ws, bytes)."""
    out_bytes = B * S * H * Dl * ESIZE[dtype]
    d_out = gpu.alloc(out_bytes)
    gpu.poison(d_out, out_bytes, POISON_F)
    ws_bytes = lib.mla_decode_workspace_size(B, S, H, Dl, ns)
    d_ws = gpu.alloc(ws_bytes) if ws_bytes else 0
    gpu.poison(d_ws, ws_bytes, POISON_F)
    return d_out, d_ws, ws_bytes


def check_decoded(gpu, dtype, d_out, d_cache, want, cache_after, name, empty_query=None):
    """A decode kernel's output against the reference's `want` [B, S, H, Dl] (query [0, 0] all zeros where
    `empty_query` names why), and the cache after its commit against `cache_after`, bit for bit."""
    got = from_storage(gpu.download(d_out, want.shape, storage_dtype(dtype)), dtype)
    atol, rtol = TOL[dtype]
    assert_close(got, want, atol=atol, rtol=rtol, name=name)
    if empty_query:
        assert_equal(got[0, 0], np.zeros(want.shape[2:], np.float32), name=empty_query)
    got_cache = from_storage(gpu.download(d_cache, cache_after.shape, storage_dtype(dtype)), dtype)
    assert_equal(got_cache, np.asarray(cache_after, np.float32), name="cache after commit")


MLA_CASES = [
    # id, kwargs
    ("empty-cache-S1-H16", dict(B=1, S=1, H=16, Dl=512, Dr=64, T_max=40, past_len=[0], dtype="float16")),
    ("ds-bf16-S4-B2", dict(B=2, S=4, H=16, Dl=512, Dr=64, T_max=131, past_len=[37, 127], dtype="bfloat16")),
    ("ds-H128-tree-bf16", dict(B=3, S=3, H=128, Dl=512, Dr=64, T_max=1100, past_len=[0, 517, 1001],
                               dtype="bfloat16", mask="tree", num_splits=4, no_visible=True)),
    ("ds-H128-fp16-1split", dict(B=2, S=2, H=128, Dl=512, Dr=64, T_max=300, past_len=[33, 298 - 2],
                                 dtype="float16", num_splits=1)),
    ("B64-H16-fp16", dict(B=64, S=1, H=16, Dl=512, Dr=64, T_max=333, past_len=list(range(0, 320, 5)),
                          dtype="float16")),
    ("B64-H16-bf16-S2", dict(B=64, S=2, H=16, Dl=512, Dr=64, T_max=97, past_len=[(7 * i) % 95 for i in range(64)],
                             dtype="bfloat16")),
    ("B1-T32k-H128-fp16", dict(B=1, S=1, H=128, Dl=512, Dr=64, T_max=32768, past_len=[32767], dtype="float16")),
    ("B1-T20k-H16-bf16-S2", dict(B=1, S=2, H=16, Dl=512, Dr=64, T_max=20011, past_len=[20001], dtype="bfloat16")),
    ("demo-64-16-fp32", dict(B=3, S=3, H=4, Dl=64, Dr=16, T_max=70, past_len=[0, 5, 67], dtype="float32")),
    ("demo-64-16-fp16", dict(B=3, S=3, H=4, Dl=64, Dr=16, T_max=70, past_len=[0, 5, 67], dtype="float16")),
    ("demo-128-32-bf16-tree", dict(B=2, S=5, H=8, Dl=128, Dr=32, T_max=260, past_len=[100, 255], dtype="bfloat16",
                                   mask="tree")),
    ("Dl32-Dr32-fp16", dict(B=2, S=1, H=3, Dl=32, Dr=32, T_max=50, past_len=[1, 49], dtype="float16")),
    ("Dl16-Dr0-bf16", dict(B=2, S=3, H=2, Dl=16, Dr=0, T_max=40, past_len=[0, 30], dtype="bfloat16")),
    ("D640-bf16", dict(B=2, S=2, H=16, Dl=512, Dr=128, T_max=150, past_len=[20, 140], dtype="bfloat16")),
    ("odd-48-8-fp16-simt", dict(B=2, S=2, H=5, Dl=48, Dr=8, T_max=45, past_len=[3, 40], dtype="float16")),
    ("odd-33-5-fp32", dict(B=2, S=3, H=3, Dl=33, Dr=5, T_max=100, past_len=[9, 90], dtype="float32", mask="tree")),
    ("odd-33-5-bf16", dict(B=2, S=1, H=3, Dl=33, Dr=5, T_max=100, past_len=[9, 90], dtype="bfloat16")),
    ("fp32-ds-dims", dict(B=2, S=2, H=16, Dl=512, Dr=64, T_max=200, past_len=[0, 150], dtype="float32")),
    ("force-simt-fp16", dict(B=2, S=2, H=16, Dl=512, Dr=64, T_max=200, past_len=[10, 150], dtype="float16",
                             flags=cuda_lib.MLA_FORCE_SIMT)),
    ("force-simt-bf16-tree", dict(B=2, S=4, H=16, Dl=512, Dr=64, T_max=200, past_len=[0, 150], dtype="bfloat16",
                                  flags=cuda_lib.MLA_FORCE_SIMT, mask="tree", no_visible=True)),
    ("single-stage-fp16", dict(B=2, S=3, H=16, Dl=512, Dr=64, T_max=500, past_len=[80, 490], dtype="float16",
                               flags=cuda_lib.MLA_FORCE_V1 | cuda_lib.MLA_SINGLE_STAGE)),
    ("v1-ds-bf16-tree", dict(B=3, S=4, H=16, Dl=512, Dr=64, T_max=700, past_len=[0, 333, 690], dtype="bfloat16",
                             mask="tree", flags=cuda_lib.MLA_FORCE_V1)),
    # v2 (DeepSeek's dims): 16 / 32 / 64 query rows per block, one and several blocks per sequence, ragged lengths
    # over the persistent grid, GLM-4.7-Flash's 20 heads
    ("v2-H128-S4-tree-ragged", dict(B=4, S=4, H=128, Dl=512, Dr=64, T_max=3000, past_len=[2990, 7, 1500, 640],
                                    dtype="bfloat16", mask="tree")),
    ("v2-B64-H128-S2-ragged", dict(B=64, S=2, H=128, Dl=512, Dr=64, T_max=4096,
                                   past_len=[(997 * i) % 4094 for i in range(64)], dtype="bfloat16")),
    ("v2-H20-S3-fp16", dict(B=5, S=3, H=20, Dl=512, Dr=64, T_max=2000, past_len=[0, 1997, 500, 64, 1200],
                            dtype="float16")),
    ("v2-H16-S2-one-part", dict(B=3, S=2, H=16, Dl=512, Dr=64, T_max=600, past_len=[598, 1, 300], dtype="float16",
                                num_splits=1)),
    ("v2-B1-T128k-H16", dict(B=1, S=1, H=16, Dl=512, Dr=64, T_max=131072, past_len=[131000], dtype="bfloat16")),
    ("precommitted-bf16", dict(B=2, S=3, H=16, Dl=256, Dr=64, T_max=128, past_len=[0, 64], dtype="bfloat16",
                               commit=False)),
    ("many-splits-fp16", dict(B=1, S=1, H=16, Dl=512, Dr=64, T_max=5000, past_len=[4000], dtype="float16",
                              num_splits=256)),
    ("splits-gt-rows-bf16", dict(B=2, S=2, H=16, Dl=512, Dr=64, T_max=64, past_len=[0, 3], dtype="bfloat16",
                                 num_splits=7)),
]


@pytest.mark.parametrize("case", [c[1] for c in MLA_CASES], ids=[c[0] for c in MLA_CASES])
def test_mla_decode(gpu, lib, case):
    run_mla(gpu, lib, **case)


@pytest.mark.parametrize("seed", range(12))
def test_mla_decode_random_shapes(gpu, lib, seed):
    rng = np.random.default_rng(100 + seed)
    dtype = ["float32", "float16", "bfloat16"][seed % 3]
    Dl = int(rng.choice([16, 32, 64, 96, 128, 256, 512, 40, 24]))
    Dr = int(rng.choice([0, 16, 32, 64, 8]))
    B, S, H = int(rng.integers(1, 9)), int(rng.integers(1, 6)), int(rng.choice([1, 2, 16, 20, 128]))
    T_max = int(rng.integers(S, 700))
    past_len = rng.integers(0, T_max - S + 1, B)
    run_mla(gpu, lib, B=B, S=S, H=H, Dl=Dl, Dr=Dr, T_max=T_max, past_len=past_len, dtype=dtype,
            mask="tree" if seed % 4 == 1 else None, num_splits=None if seed % 2 else int(rng.integers(1, 40)),
            seed=seed)


def test_mla_kv_commit_alone(gpu, lib):
    rng = np.random.default_rng(7)
    for dtype, D in [("float16", 576), ("bfloat16", 7), ("float32", 3)]:
        B, S, T = 3, 4, 10
        c_s, _ = to_storage(rng.standard_normal((B, T, D)), dtype)
        n_s, _ = to_storage(rng.standard_normal((B, S, D)), dtype)
        cl = np.array([0, 3, 8], np.int32)  # the last only fits 2 of 4 rows: the rest is skipped
        d_c = gpu.upload(c_s)
        lib.mla_kv_commit(dtype, d_c, gpu.upload(cl), gpu.upload(n_s), B, S, D, T)
        gpu.sync("mtp_mla_kv_commit")
        got = gpu.download(d_c, c_s.shape, c_s.dtype)
        assert_equal(got, ref.mla_kv_commit(c_s, cl, n_s), name=f"kv_commit {dtype}")


# ---------------------------------------------------------------------------------------------
# DeepSeek Sparse Attention: the indexer's selection and sparse MLA
# ---------------------------------------------------------------------------------------------
def run_mla_sparse(gpu, lib, *, B, S, H, Dl, Dr, Di, T_max, past_len, K, dtype, num_splits=None, flags=0, seed=0,
                   empty_query=False):
    """mtp_mla_sparse_decode on random index lists (rows of the cache after the commit, some slots -1, any order);
    rows are [latent | indexer key] (C = Dl + Dr + Di), only the latent is attended."""
    rng = np.random.default_rng(seed)
    D, C = Dl + Dr, Dl + Dr + Di
    past_len = np.asarray(past_len, np.int32)
    q_s, q = to_storage(rng.standard_normal((B, S, H, D), np.float32), dtype)
    c_s, cache = to_storage(rng.standard_normal((B, T_max, C), np.float32), dtype)
    n_s, new = to_storage(rng.standard_normal((B, S, C), np.float32), dtype)
    sel = np.full((B, S, K), -1, np.int32)
    for b in range(B):
        for s in range(S):
            rows = rng.permutation(int(past_len[b]) + s + 1)[:int(rng.integers(1, K + 1))]
            sel[b, s, :len(rows)] = rows
    if empty_query:
        sel[0, 0] = -1  # a query token with no row: zeros
        sel[-1, -1, -1] = T_max + 5  # out of range: skipped
    scale = 1.5 / math.sqrt(D)
    want, cache_after = ref.mla_sparse_decode(q, cache, past_len, sel, dl=Dl, scale=scale, new_rows=new)
    d_cache = gpu.upload(c_s)
    ns = num_splits if num_splits is not None else lib.mla_decode_num_splits(B * S, 1, H, K, gpu.num_sms())
    d_out, d_ws, ws_bytes = decode_buffers(gpu, lib, B * S, 1, H, Dl, dtype, ns)
    lib.mla_sparse_decode(dtype, gpu.upload(q_s), d_cache, gpu.upload(past_len), gpu.upload(n_s), gpu.upload(sel),
                          d_out, d_ws, ws_bytes, B, S, H, Dl, Dr, C, T_max, K, scale, ns, flags)
    gpu.sync("mtp_mla_sparse_decode")
    check_decoded(gpu, dtype, d_out, d_cache, want, cache_after, f"mla_sparse_decode {dtype} B={B} S={S} H={H} K={K}",
                  "query with no selected row" if empty_query else None)


MLA_SPARSE_CASES = [
    ("v32-bf16-S4", dict(B=2, S=4, H=16, Dl=512, Dr=64, Di=128, T_max=300, past_len=[0, 290], K=64,
                         dtype="bfloat16", empty_query=True)),
    ("v32-fp16-H128-splits", dict(B=1, S=2, H=128, Dl=512, Dr=64, Di=128, T_max=3000, past_len=[2900], K=2048,
                                  dtype="float16", num_splits=8)),
    ("small-fp32", dict(B=3, S=3, H=4, Dl=64, Dr=16, Di=32, T_max=70, past_len=[0, 5, 60], K=8, dtype="float32",
                        empty_query=True)),
    ("small-fp16-tc", dict(B=2, S=2, H=8, Dl=64, Dr=16, Di=16, T_max=90, past_len=[3, 80], K=40, dtype="float16",
                           num_splits=3)),
    ("odd-bf16-simt", dict(B=2, S=1, H=3, Dl=33, Dr=5, Di=7, T_max=50, past_len=[9, 40], K=12, dtype="bfloat16")),
    ("force-simt-bf16", dict(B=1, S=3, H=16, Dl=128, Dr=32, Di=64, T_max=200, past_len=[150], K=100,
                             dtype="bfloat16", flags=cuda_lib.MLA_FORCE_SIMT, num_splits=2)),
    ("B32-S2-K512-bf16", dict(B=32, S=2, H=16, Dl=512, Dr=64, Di=128, T_max=1030, past_len=[(31 * i) % 1000
                                                                                             for i in range(32)],
                              K=512, dtype="bfloat16")),
]


@pytest.mark.parametrize("case", [c[1] for c in MLA_SPARSE_CASES], ids=[c[0] for c in MLA_SPARSE_CASES])
def test_mla_sparse_decode(gpu, lib, case):
    run_mla_sparse(gpu, lib, **case)


def run_dsa_select(gpu, lib, *, B, S, Hi, Di, T_max, past_len, K, dtype, mask=None, ties=False, equal=False,
                   nan_rows=(), seed=0):
    """mtp_dsa_select against reference.dsa_select.  ties: small integer queries, keys and weights (every score
    exact in fp32 whatever the summation order, many equal): the selection must be identical, ties to the earlier
    row.  equal: every key the same (all scores tie: the first K visible rows).  nan_rows: cache rows whose key gets
    a NaN (their scores are NaN, above every number).  Otherwise N(0, 1) data: rows may differ from the reference
    only where the two scores of the exchanged rows lie within the fp32 summation error of each other
    (reference.selections_agree)."""
    rng = np.random.default_rng(seed)
    C, off = 24 + Di, 24  # a row: 24 latent values, then the indexer key
    past_len = np.asarray(past_len, np.int32)
    if ties or equal:
        qv = rng.integers(-1, 2, (B, S, Hi, Di)).astype(np.float32)
        cv = np.ones((B, T_max, C), np.float32) if equal else rng.integers(-1, 2, (B, T_max, C)).astype(np.float32)
        wv = rng.integers(0, 3, (B, S, Hi)).astype(np.float32)
        scale = 0.25
    else:
        qv = rng.standard_normal((B, S, Hi, Di), np.float32)
        cv = rng.standard_normal((B, T_max, C), np.float32)
        wv = rng.standard_normal((B, S, Hi)).astype(np.float32)
        scale = Di**-0.5
    if isinstance(mask, str) and mask == "tree":
        mask = (np.tril(rng.integers(0, 2, (B, S, S))) | np.eye(S, dtype=np.int64)).astype(np.uint8)
    for r in nan_rows:
        cv[:, r, off + Di // 2] = np.nan
    q_s, q = to_storage(qv, dtype)
    c_s, cache = to_storage(cv, dtype)  # the new rows are committed already
    want, scores = ref.dsa_select(q, wv, cache, past_len, key_offset=off, k=K, scale=scale, mask=mask)
    ws = lib.dsa_select_workspace_size(B, S, T_max)
    d_ws = gpu.alloc(ws)
    gpu.poison(d_ws, ws, POISON_F)
    d_sel = gpu.alloc(B * S * K * 4)
    gpu.poison(d_sel, B * S * K * 4, POISON_I)
    lib.dsa_select(dtype, gpu.upload(q_s), gpu.upload(wv), gpu.upload(c_s), gpu.upload(past_len),
                   ptr_or_0(gpu, mask), d_sel, d_ws, ws, B, S, Hi, Di, C, off, T_max, K, scale)
    gpu.sync("mtp_dsa_select")
    got = gpu.download(d_sel, (B, S, K), np.int32)
    if ties or equal:
        assert_equal(got, want, name=f"dsa_select {dtype} (exact scores)")
    else:
        ok, why = ref.selections_agree(got, want, scores, rtol=1e-5 * Hi)
        assert ok, f"dsa_select {dtype}: {why}"


DSA_SELECT_CASES = [
    ("fewer-rows-than-K", dict(B=2, S=2, Hi=4, Di=16, T_max=40, past_len=[0, 30], K=64, dtype="float32")),
    ("ties-bf16", dict(B=2, S=3, Hi=8, Di=32, T_max=700, past_len=[100, 690], K=50, dtype="bfloat16", ties=True)),
    ("ties-tree-fp16", dict(B=2, S=4, Hi=4, Di=16, T_max=300, past_len=[20, 290], K=17, dtype="float16", ties=True,
                            mask="tree")),
    ("random-fp32", dict(B=3, S=2, Hi=16, Di=64, T_max=2000, past_len=[0, 1000, 1990], K=256, dtype="float32")),
    ("v32-bf16", dict(B=1, S=4, Hi=64, Di=128, T_max=20000, past_len=[19990], K=2048, dtype="bfloat16")),
    ("glm5-fp16-tree", dict(B=2, S=5, Hi=32, Di=128, T_max=5000, past_len=[700, 4990], K=512, dtype="float16",
                            mask="tree")),
    ("nan-rows-bf16", dict(B=2, S=2, Hi=8, Di=32, T_max=600, past_len=[50, 590], K=40, dtype="bfloat16", ties=True,
                           nan_rows=[3, 17, 400, 401])),
    ("all-equal-fp16-tree", dict(B=2, S=3, Hi=12, Di=64, T_max=900, past_len=[0, 897], K=100, dtype="float16",
                                 equal=True, mask="tree")),
    # T_max > 32768: several blocks per query token select, each over a chunk of the rows
    ("chunks-ties-bf16-ragged", dict(B=2, S=1, Hi=8, Di=32, T_max=33000, past_len=[100, 32990], K=300,
                                     dtype="bfloat16", ties=True)),
    ("chunks-nan-tree-fp16", dict(B=1, S=2, Hi=16, Di=64, T_max=33000, past_len=[32990], K=2048, dtype="float16",
                                  ties=True, mask="tree", nan_rows=[5, 9000, 32900])),
    ("chunks-equal-bf16", dict(B=1, S=1, Hi=8, Di=32, T_max=33000, past_len=[32990], K=777, dtype="bfloat16",
                               equal=True)),
    ("chunks-simt-fp32", dict(B=1, S=1, Hi=4, Di=16, T_max=33000, past_len=[32000], K=100, dtype="float32",
                              ties=True)),
    ("chunks-B4-S3-bf16-tree", dict(B=4, S=3, Hi=64, Di=128, T_max=70000, past_len=[69990, 40000, 1000, 33000],
                                    K=2048, dtype="bfloat16", ties=True, mask="tree", nan_rows=[7, 60000])),
    ("v32-T128k-bf16", dict(B=1, S=1, Hi=64, Di=128, T_max=131072, past_len=[131071], K=2048, dtype="bfloat16")),
]


@pytest.mark.parametrize("case", [c[1] for c in DSA_SELECT_CASES], ids=[c[0] for c in DSA_SELECT_CASES])
def test_dsa_select(gpu, lib, case):
    run_dsa_select(gpu, lib, **case)


# ---------------------------------------------------------------------------------------------
# acceptance
# ---------------------------------------------------------------------------------------------
def alloc_accept_outputs(gpu, B, K):
    d_out, d_num, d_last = gpu.alloc(B * (K + 1) * 4), gpu.alloc(B * 4), gpu.alloc(B * 4)
    for p, n in [(d_out, B * (K + 1) * 4), (d_num, B * 4), (d_last, B * 4)]:
        gpu.poison(p, n, POISON_I)
    return d_out, d_num, d_last


def download_accept(gpu, d_out, d_num, d_last, B, K):
    return (gpu.download(d_out, (B, K + 1), np.int32), gpu.download(d_num, (B,), np.int32),
            gpu.download(d_last, (B,), np.int32))


def drafts_with_prefix(rng, tgt, K, V):
    """Drafts that match the target for a random prefix length, then (usually) differ."""
    B = tgt.shape[0]
    drafts = rng.integers(0, V, (B, K)).astype(np.int32)
    for b in range(B):
        a = int(rng.integers(0, K + 1))
        drafts[b, :a] = tgt[b, :a]
        if a < K and V > 1:
            drafts[b, a] = (tgt[b, a] + 1 + int(rng.integers(0, V - 1))) % V
    return drafts


STRICT_CASES = [(1, 0, 17, "float32"), (7, 3, 1000, "float16"), (4, 16, 129280, "bfloat16"),
                (64, 3, 129280, "float16"), (64, 16, 1, "float32"), (33, 5, 4096, "float32"),
                (2, 16, 129280, "float32"), (16, 8, 513, "bfloat16"), (1, 3, 129280, "bfloat16"),
                (2, 3, 20001, "float16")]


@pytest.mark.parametrize("B,K,V,dtype", STRICT_CASES)
def test_accept_strict(gpu, lib, B, K, V, dtype):
    rng = np.random.default_rng(B * 1000 + K * 10 + V)
    x = rng.standard_normal((B, K + 1, V), np.float32)
    if V > 3:  # explicit ties at the maximum, lowest index must win; a row with two NaNs: the first wins
        rows = rng.random((B, K + 1)) < 0.3
        j1, j2 = rng.integers(0, V, 2)
        x[rows, j1] = x[rows, j2] = 10.0
        x[-1, -1, [V - 1, V // 2 + 1]] = np.nan
    x_s, x_r = to_storage(x, dtype)
    tgt = ref.argmax_ids(x_r)
    drafts = drafts_with_prefix(rng, tgt, K, V)
    want = ref.accept_strict(drafts, logits=x_r)
    d_x, d_d = gpu.upload(x_s), gpu.upload(drafts) if K else 0
    outs = alloc_accept_outputs(gpu, B, K)
    lib.accept_strict(dtype, d_x, 0, d_d, *outs, B, K, V)
    gpu.sync("mtp_accept_strict")
    for name, g, w in zip(("tokens", "num_accepted", "last_index"), download_accept(gpu, *outs, B, K), want):
        assert_equal(g, w, name=f"strict {name}")
    # the same from target ids
    outs = alloc_accept_outputs(gpu, B, K)
    lib.accept_strict(dtype, 0, gpu.upload(tgt), d_d, *outs, B, K, V)
    gpu.sync("mtp_accept_strict (ids)")
    for name, g, w in zip(("tokens", "num_accepted", "last_index"), download_accept(gpu, *outs, B, K), want):
        assert_equal(g, w, name=f"strict from ids {name}")


RELAXED_CASES = [(5, 3, 50, "float32", 3, 0.3), (16, 16, 1000, "float16", 8, 0.1), (2, 7, 129280, "bfloat16", 10, 0.05),
                 (64, 4, 4096, "float32", 5, 0.5), (3, 16, 129280, "float32", 1, 0.9), (8, 5, 300, "bfloat16", 0, 0.5)]


@pytest.mark.parametrize("scalars", ["host", "device-plugin", "device-gap"])
@pytest.mark.parametrize("B,K,V,dtype,topk,delta", RELAXED_CASES)
def test_accept_relaxed(gpu, lib, B, K, V, dtype, topk, delta, scalars):
    """mtp_accept_relaxed (scalars="host"), or mtp_accept_relaxed_dev (topk/delta in device memory, ABI 3):
    "device-plugin" as the MtpAccept plugin calls it -- drafts read in place from input_ids [B, K+1]
    (pointer + 1 element, stride K+1; column 0 holds garbage), thinking_out separate from thinking_in,
    last_index NULL; "device-gap" -- drafts at stride K+3 with garbage in the gaps, thinking in place."""
    rng = np.random.default_rng(B + K + V + topk)
    ts, te = 1, 2
    x = rng.standard_normal((B, K + 1, V), np.float32)
    cand = rng.integers(0, V, (B, K + 1, 6))
    cand[..., 0] = np.where(rng.random((B, K + 1)) < 0.2, ts, cand[..., 0])
    cand[..., 1] = np.where(rng.random((B, K + 1)) < 0.2, te, cand[..., 1])
    for b in range(B):
        for i in range(K + 1):
            x[b, i, cand[b, i]] = 6.0 + rng.standard_normal(6) * 0.7  # a few close leaders
    x_s, x_r = to_storage(x, dtype)
    pick = rng.integers(0, 6, (B, K))
    drafts = np.take_along_axis(cand[:, :K], pick[..., None], -1)[..., 0].astype(np.int32)
    drafts[rng.random((B, K)) < 0.1] = int(rng.integers(0, V))
    thinking = rng.integers(0, 2, B).astype(np.int32)
    for _ in range(50):  # keep every probability test away from the rounding edge
        _, margin = ref.relaxed_ok(x_r, drafts, topk, delta)
        if not np.any(np.abs(margin) < 1e-4):
            break
        delta += 1.3e-3
    want = ref.accept_relaxed(x_r, drafts, thinking, topk=topk, delta=delta, think_start_id=ts, think_end_id=te)
    d_th = gpu.upload(thinking)
    outs = alloc_accept_outputs(gpu, B, K)
    d_th_out, last = d_th, outs[2]
    if scalars == "host":
        lib.accept_relaxed(dtype, gpu.upload(x_s), gpu.upload(drafts) if K else 0, d_th, *outs, B, K, V, topk, delta,
                           ts, te)
    else:
        # garbage = the target argmax (a draft read from the wrong place would often be accepted)
        skip, stride = (1, K + 1) if scalars == "device-plugin" else (0, K + 3)
        buf = np.repeat(ref.argmax_ids(x_r)[:, :1], stride, 1).astype(np.int32)  # [B, stride]
        buf[:, skip:skip + K] = drafts
        assert_equal(ref.strided_drafts(buf.reshape(-1)[skip:], B, K, stride), drafts, name="test layout")
        if scalars == "device-plugin":
            d_th_out, last = gpu.alloc(B * 4), 0
            gpu.poison(d_th_out, B * 4, POISON_I)
        lib.accept_relaxed_dev(dtype, gpu.upload(x_s), gpu.upload(buf) + 4 * skip, stride, d_th, d_th_out, outs[0],
                               outs[1], last, B, K, V, gpu.upload(np.array(topk, np.int32)),
                               gpu.upload(np.array(delta, np.float32)), ts, te)
    gpu.sync(f"mtp_accept_relaxed ({scalars})")
    got = (*download_accept(gpu, *outs, B, K), gpu.download(d_th_out, (B,), np.int32))
    for name, g, w in zip(("tokens", "num_accepted", "last_index", "thinking"), got, want):
        if name == "last_index" and not last:  # NULL: left alone
            w = np.full(B, int.from_bytes(bytes([POISON_I] * 4), "little"), np.int32)
        assert_equal(g, w, name=f"relaxed {name}")
    if d_th_out != d_th:  # thinking_in is read only
        assert_equal(gpu.download(d_th, (B,), np.int32), thinking, name="thinking_in")


def softmax_rows(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


REJECTION_CASES = [(1, 0, 10, "float32"), (8, 3, 1000, "float32"), (3, 16, 129280, "float32"),
                   (64, 3, 4096, "float16"), (5, 4, 129280, "bfloat16"), (64, 16, 7, "float32"),
                   (1, 3, 129280, "bfloat16"), (3, 2, 20001, "float16")]


@pytest.mark.parametrize("B,K,V,dtype", REJECTION_CASES)
def test_accept_rejection(gpu, lib, B, K, V, dtype):
    rng = np.random.default_rng(B * 7 + K * 3 + V)
    p = softmax_rows(rng.standard_normal((B, K + 1, V)) * 2)
    q = 0.5 * p[:, :K] + 0.5 * softmax_rows(rng.standard_normal((B, K, V)) * 2)
    if B >= 3 and K >= 1:  # residual-free row: p == q, draft with q = p = 0 -> rejected, sample from p
        p[2, 0] = q[2, 0] = 0.0
        p[2, 0, :3] = q[2, 0, :3] = [0.5, 0.25, 0.25]
    p_s, p_r = to_storage(p, dtype)
    q_s, q_r = to_storage(q, dtype)
    drafts = np.zeros((B, K), np.int32)
    for b in range(B):
        for i in range(K):
            c = np.cumsum(q_r[b, i].astype(np.float64))
            drafts[b, i] = min(int(np.searchsorted(c, rng.random() * c[-1], side="right")), V - 1)
    if B >= 3 and K >= 1:
        drafts[2, 0] = 5 if V > 5 else V - 1
    u = rng.random((B, K + 1)).astype(np.float32)
    u[0, -1] = 0.0
    u[-1, 0] = np.nextafter(np.float32(1), np.float32(0))
    want = ref.accept_rejection(p_r, q_r, drafts, u)
    outs = alloc_accept_outputs(gpu, B, K)
    lib.accept_rejection(dtype, gpu.upload(p_s), gpu.upload(q_s) if K else 0, gpu.upload(drafts) if K else 0,
                         gpu.upload(u), *outs, B, K, V)
    gpu.sync("mtp_accept_rejection")
    for name, g, w in zip(("tokens", "num_accepted", "last_index"), download_accept(gpu, *outs, B, K), want):
        assert_equal(g, w, name=f"rejection {name}")


# ---------------------------------------------------------------------------------------------
# gather / window
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("B,Kp1,D,dtype", [(1, 1, 7168, "bfloat16"), (64, 17, 7168, "float16"), (5, 4, 7, "float16"),
                                           (3, 2, 3, "float32"), (64, 4, 129, "bfloat16")])
def test_gather_last_hidden(gpu, lib, B, Kp1, D, dtype):
    rng = np.random.default_rng(B + Kp1 + D)
    h_s, _ = to_storage(rng.standard_normal((B, Kp1, D)), dtype)
    idx = rng.integers(0, Kp1, B).astype(np.int32)
    idx[0] = Kp1 + 3  # clamped
    d_out = gpu.alloc(B * D * ESIZE[dtype])
    gpu.poison(d_out, B * D * ESIZE[dtype], POISON_F)
    lib.gather_last_hidden(dtype, gpu.upload(h_s), gpu.upload(idx), d_out, B, Kp1, D)
    gpu.sync("mtp_gather_last_hidden")
    assert_equal(gpu.download(d_out, (B, D), h_s.dtype), ref.gather_last_hidden(h_s, idx), name="gather")


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("B,K,N,D,dtype", [(1, 1, 2, 7168, "bfloat16"), (64, 3, 4, 7168, "float16"),
                                           (7, 16, 17, 33, "float32"), (5, 4, 2, 5, "float16")])
def test_window_update(gpu, lib, in_place, B, K, N, D, dtype):
    rng = np.random.default_rng(B + K + N + D + in_place)
    wt = rng.integers(0, 1000, (B, K)).astype(np.int32)
    wh_s, _ = to_storage(rng.standard_normal((B, K, D)), dtype)
    nt = rng.integers(1000, 2000, (B, N)).astype(np.int32)
    nh_s, _ = to_storage(rng.standard_normal((B, N, D)), dtype)
    na = rng.integers(-1, N, B).astype(np.int32)  # n = 0 .. N, covering n >= K
    na[0] = N + 5  # clamped to N
    want_t, want_h = ref.window_update(wt, wh_s, nt, nh_s, na)
    d_wt, d_wh = gpu.upload(wt), gpu.upload(wh_s)
    if in_place:
        o_t, o_h = d_wt, d_wh
    else:
        o_t, o_h = gpu.alloc(wt.nbytes), gpu.alloc(wh_s.nbytes)
        gpu.poison(o_t, wt.nbytes, POISON_I)
        gpu.poison(o_h, wh_s.nbytes, POISON_F)
    lib.window_update(dtype, d_wt, d_wh, gpu.upload(nt), gpu.upload(nh_s), gpu.upload(na), o_t, o_h, B, K, N, D)
    gpu.sync("mtp_window_update")
    assert_equal(gpu.download(o_t, (B, K), np.int32), want_t, name="window tokens")
    assert_equal(gpu.download(o_h, (B, K, D), wh_s.dtype), want_h, name="window hidden")
