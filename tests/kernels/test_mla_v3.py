"""MLA decode v3 (Hopper: wgmma, TMA, mbarriers; plugins/kernels/mla_decode.cu mla_v3_kernel) under the CPU
emulation, on an emulated compute capability 9.0 device: against the NumPy reference over the shapes v3 serves (one
and two 64-row blocks, S = 1 .. 4, tree masks, ragged lengths over many parts, empty parts, scores beyond fp32), with
TMA copies landing at issue and at the wait; the cache rows each block reads (the TMA trace); sparse lists (rows
gathered by cp.async onto the stages' mbarriers: the reference, unlisted NaN rows, the bytes read, the barriers); v2
still serving MTP_MLA_FORCE_V2 and MTP_TRT_MLA_PATH=v2.  The emulation implements the PTX ISA's layouts
(tests/kernels/emu/emu_hopper.h): it checks that the kernel uses them consistently, not the hardware's reading of them
(test_hopper.py's probes do that on a GPU)."""

from __future__ import annotations

import ctypes
import itertools
import math

import numpy as np
import pytest

from mtp_trt.plugins import cuda_lib
from mtp_trt.plugins import reference as ref

from . import test_gpu_kernels as G
from ._gpu import to_storage
from .test_emulated import _count, emu_lib, host, pytestmark  # noqa: F401 - fixtures and markers shared

D, DL = 576, 512
_devices = itertools.count(40)  # device facts are read once per device: each test its own emulated device


@pytest.fixture()
def hopper(monkeypatch):
    def use(tma: str = "immediate"):
        monkeypatch.setenv("MTP_EMU_CC", "90")
        monkeypatch.setenv("MTP_EMU_SMEM_OPTIN", "232448")
        monkeypatch.setenv("MTP_EMU_DEVICE", str(next(_devices)))
        monkeypatch.setenv("MTP_EMU_TMA", tma)
    return use


CASES = [
    ("H16-S1-one-part", dict(B=2, S=1, H=16, T_max=90, past_len=[0, 80], dtype="bfloat16", num_splits=1)),
    ("H16-S4-parts", dict(B=2, S=4, H=16, T_max=150, past_len=[5, 140], dtype="float16", num_splits=3)),
    ("H16-S3-tree-none-visible", dict(B=2, S=3, H=20, T_max=70, past_len=[0, 60], dtype="bfloat16", mask="tree",
                                      no_visible=True, num_splits=2)),
    ("H128-S1-two-blocks", dict(B=1, S=1, H=128, T_max=200, past_len=[190], dtype="bfloat16", num_splits=1)),
    ("H128-S2-tree-parts", dict(B=2, S=2, H=128, T_max=140, past_len=[70, 130], dtype="bfloat16", mask="tree",
                                num_splits=4)),
    ("ragged-many-parts", dict(B=6, S=2, H=16, T_max=300, past_len=[0, 298, 7, 150, 64, 230], dtype="bfloat16",
                               num_splits=7)),
    ("more-parts-than-tiles", dict(B=1, S=1, H=16, T_max=140, past_len=[130], dtype="float16", num_splits=12)),
]


@pytest.mark.parametrize("tma", ["immediate", "deferred"])
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_v3_against_the_reference(emu_lib, host, hopper, name, tma):
    hopper(tma)
    wgmma = _count(emu_lib, "wgmma")
    G.run_mla(host, emu_lib, Dl=DL, Dr=D - DL, **dict(CASES)[name])
    assert _count(emu_lib, "wgmma") > wgmma  # v3 ran


@pytest.mark.parametrize("tma", ["immediate", "deferred"])
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_seesaw_against_the_reference(emu_lib, host, hopper, name, tma):
    """MTP_MLA_SEESAW: v3's dense launches on the seesaw schedule (the warpgroups take alternate tiles' softmax, hand
    m, the rescale factors and P to each other by named barriers, and refill a buffer when both are done with it):
    every dense case, odd and even tile counts, the copies landing at issue and at the first wait."""
    hopper(tma)
    wgmma = _count(emu_lib, "wgmma")
    G.run_mla(host, emu_lib, Dl=DL, Dr=D - DL, flags=cuda_lib.MLA_SEESAW, **dict(CASES)[name])
    assert _count(emu_lib, "wgmma") > wgmma


def test_seesaw_scores_beyond_fp32_range(emu_lib, host, hopper):
    hopper()
    G.run_mla(host, emu_lib, B=2, S=2, H=16, Dl=DL, Dr=D - DL, T_max=90, past_len=[20, 70], dtype="bfloat16",
              num_splits=3, huge_scores=True, flags=cuda_lib.MLA_SEESAW)


def test_v3_scores_beyond_fp32_range(emu_lib, host, hopper):
    hopper()
    G.run_mla(host, emu_lib, B=2, S=2, H=16, Dl=DL, Dr=D - DL, T_max=90, past_len=[20, 70], dtype="bfloat16",
              num_splits=3, huge_scores=True)


@pytest.mark.parametrize("flags,T", [(0, 130), (cuda_lib.MLA_SEESAW, 200)], ids=["v3", "seesaw"])
def test_v3_ignores_nan_rows_past_the_sequence(emu_lib, host, hopper, flags, T):
    """The cache rows past each sequence's end hold NaN (a caller's unused cache may hold anything): the 64-row tiles
    read them, the kernel must not let them into P . V (the seesaw: 1 and 2 tiles, the NaN rows in warpgroup 0's tile,
    then in warpgroup 1's)."""
    hopper()
    rng = np.random.default_rng(1)
    B, S, H = 2, 1, 16
    past = np.int32([40, 100])
    q_s, q = to_storage(rng.standard_normal((B, S, H, D)), "bfloat16")
    c32 = rng.standard_normal((B, T, D)).astype(np.float32)
    for b in range(B):
        c32[b, past[b] + S:] = np.nan
    c_s, cache = to_storage(c32, "bfloat16")
    n_s, new = to_storage(rng.standard_normal((B, S, D)), "bfloat16")
    want, after = ref.mla_decode(q, np.nan_to_num(cache), past, dl=DL, scale=0.05, new_rows=new)
    for splits in (1, 3):
        d_cache = host.upload(c_s)
        d_out, d_ws, ws = G.decode_buffers(host, emu_lib, B, S, H, DL, "bfloat16", splits)
        emu_lib.mla_decode("bfloat16", host.upload(q_s), d_cache, host.upload(past), host.upload(n_s), 0, d_out, d_ws,
                           ws, B, S, H, DL, D - DL, T, 0.05, splits, flags)
        got = G.from_storage(host.download(d_out, want.shape, np.uint16), "bfloat16")
        G.assert_close(got, want, atol=2e-2, rtol=2e-2, name=f"NaN past the end, {splits} parts")


SPARSE_CASES = [
    ("H16-S1-B3-empty-list", dict(B=3, S=1, H=16, T_max=100, past_len=[10, 90, 0], K=64, dtype="bfloat16",
                                  num_splits=1, empty_query=True)),
    ("H16-S3-long-lists-parts", dict(B=2, S=3, H=16, T_max=200, past_len=[150, 30], K=150, dtype="float16",
                                     num_splits=4)),
    ("H128-S2-parts-empty-list", dict(B=1, S=2, H=128, T_max=150, past_len=[140], K=100, dtype="bfloat16",
                                      num_splits=3, empty_query=True)),
    ("H128-S1-one-part", dict(B=2, S=1, H=128, T_max=90, past_len=[80, 5], K=70, dtype="bfloat16", num_splits=1)),
]


@pytest.mark.parametrize("tma", ["immediate", "deferred"])
@pytest.mark.parametrize("name", [c[0] for c in SPARSE_CASES])
def test_v3_sparse_against_the_reference(emu_lib, host, hopper, name, tma):
    """mtp_mla_sparse_decode on v3 (the listed rows gathered by cp.async into the swizzled stages, completing on the
    stage's mbarrier): random lists (1 .. K rows, then -1; an empty list and an out-of-range row with empty_query),
    lists of one and of several 64-slot tiles, one part per query token and the persistent parts with the combine;
    the copies landing at issue and at the first wait on the mbarrier."""
    hopper(tma)
    wgmma = _count(emu_lib, "wgmma")
    G.run_mla_sparse(host, emu_lib, Dl=DL, Dr=D - DL, Di=128, **dict(SPARSE_CASES)[name])
    assert _count(emu_lib, "wgmma") > wgmma  # v3 ran


def _traced(emu_lib, launch) -> tuple[np.ndarray, np.ndarray, int]:
    """launch() with the emulation's load trace on: each traced load's block and address, and the block barriers
    passed."""
    trace = emu_lib.lib.mtp_emu_trace
    trace.restype, trace.argtypes = ctypes.c_long, [ctypes.c_int, ctypes.c_void_p, ctypes.c_long]
    barriers = _count(emu_lib, "syncthreads")
    trace(1, None, 0)
    launch()
    n = trace(0, None, 0)
    barriers = _count(emu_lib, "syncthreads") - barriers
    rows = np.zeros(2 * n, np.uint64)
    trace(0, rows.ctypes.data, n)
    return rows[0::2], rows[1::2].astype(np.int64), barriers


def _sparse_problem(rng, B, S, H, T, K, past, Di=128, holes=True):
    """q, cache [B, T, D + Di], new rows and lists whose -1 slots lie anywhere in the list (holes), as storage."""
    C = D + Di
    q_s, q = to_storage(rng.standard_normal((B, S, H, D)), "bfloat16")
    c32 = rng.standard_normal((B, T, C)).astype(np.float32)
    n_s, new = to_storage(rng.standard_normal((B, S, C)), "bfloat16")
    sel = np.full((B, S, K), -1, np.int32)
    for b in range(B):
        for s in range(S):
            n_vis = int(past[b]) + s + 1
            m = int(rng.integers(1, min(K, n_vis) + 1))
            rows = rng.choice(n_vis, size=m, replace=False)
            slots = rng.choice(K, size=m, replace=False) if holes else np.arange(m)
            sel[b, s, slots] = rows
    return q_s, q, c32, n_s, new, sel


def test_v3_sparse_ignores_unlisted_nan_rows(emu_lib, host, hopper):
    """Every cache row no list names holds NaN (the indexer's key part too), and the -1 slots lie anywhere in the
    lists: a -1 slot never contributes, unlisted rows are never read into P . V."""
    hopper()
    rng = np.random.default_rng(3)
    B, S, H, T, K = 2, 2, 16, 160, 130
    past = np.int32([100, 150])
    q_s, q, c32, n_s, new, sel = _sparse_problem(rng, B, S, H, T, K, past)
    for b in range(B):
        listed = set(int(r) for r in sel[b].ravel() if r >= 0)
        for t in range(T):
            if t not in listed and not past[b] <= t < past[b] + S:
                c32[b, t] = np.nan
    c_s, cache = to_storage(c32, "bfloat16")
    scale = 1.5 / math.sqrt(D)
    want, _ = ref.mla_sparse_decode(q, np.nan_to_num(cache), past, sel, dl=DL, scale=scale, new_rows=new)
    for splits in (1, 3):
        wgmma = _count(emu_lib, "wgmma")
        d_cache = host.upload(c_s)
        d_out, d_ws, ws = G.decode_buffers(host, emu_lib, B * S, 1, H, DL, "bfloat16", splits)
        emu_lib.mla_sparse_decode("bfloat16", host.upload(q_s), d_cache, host.upload(past), host.upload(n_s),
                                  host.upload(sel), d_out, d_ws, ws, B, S, H, DL, D - DL, D + 128, T, K, scale,
                                  splits, 0)
        got = G.from_storage(host.download(d_out, want.shape, np.uint16), "bfloat16")
        G.assert_close(got, want, atol=2e-2, rtol=2e-2, name=f"unlisted NaN rows, {splits} parts")
        assert _count(emu_lib, "wgmma") > wgmma


@pytest.mark.parametrize("B,S,H,T,K,P", [(2, 2, 16, 120, 100, 3), (1, 2, 128, 90, 70, 2)],
                         ids=["H16-parts", "H128-two-blocks"])
def test_v3_sparse_bytes_read_and_two_barriers_per_tile(emu_lib, host, hopper, B, S, H, T, K, P):
    """The cp.async trace of a sparse launch: every block of 64 query rows reads the 576 latent values (72 chunks of
    16 bytes, not the indexer key) of every row each list names, once per listing, and no other cache byte; the
    schedule's tiles are the lists' 64-slot tiles; two block barriers per tile, as for dense launches."""
    hopper()
    rng = np.random.default_rng(5)
    past = np.int32(rng.integers(T // 2, T - S, size=B))
    q_s, _, c32, _, _, sel = _sparse_problem(rng, B, S, H, T, K, past)
    sel[0, 0, 3] = T + 7  # out of range: never read
    c_s, _ = to_storage(c32, "bfloat16")
    d_cache = host.upload(c_s)
    d_out, d_ws, ws = G.decode_buffers(host, emu_lib, B * S, 1, H, DL, "bfloat16", P)
    blocks, addrs, barriers = _traced(emu_lib, lambda: emu_lib.mla_sparse_decode(
        "bfloat16", host.upload(q_s), d_cache, host.upload(past), 0, host.upload(sel), d_out, d_ws, ws, B, S, H, DL,
        D - DL, D + 128, T, K, 1 / math.sqrt(D), P, 0))
    in_cache = (addrs >= d_cache) & (addrs < d_cache + c_s.nbytes)
    row_bytes = (D + 128) * 2
    listed = np.sort(np.concatenate([b * T + sel[b, s][(sel[b, s] >= 0) & (sel[b, s] < T)]
                                     for b in range(B) for s in range(S)]))
    for mb in range(-(-H // 64)):
        mine = in_cache & ((blocks & ((1 << 21) - 1)) == mb)
        off = addrs[mine] - d_cache
        assert np.all(off % row_bytes < D * 2)  # the latent only
        got_rows = off // row_bytes
        assert len(got_rows) == len(listed) * (D * 2 // 16)
        got, loads = np.unique(got_rows, return_counts=True)
        want, listings = np.unique(listed, return_counts=True)
        assert np.array_equal(got, want) and np.array_equal(loads, listings * (D * 2 // 16)), mb
    tiles = [-(-K // 64)] * (B * S)
    runs, _ = ref.mla_schedule(tiles, P)
    per_block = [1 + sum(2 * n_ + 2 for n_ in ref.mla_run_segments(r, tiles)) if r is not None else 1 for r in runs]
    assert barriers == -(-H // 64) * sum(per_block) + 2 + 3 * -(-(B * S) // 128), barriers


def test_force_v2_stays_on_v2(emu_lib, host, hopper):
    hopper()
    wgmma = _count(emu_lib, "wgmma")
    G.run_mla_sparse(host, emu_lib, B=1, S=2, H=16, Dl=DL, Dr=D - DL, Di=128, T_max=200, past_len=[150], K=64,
                     dtype="bfloat16", num_splits=3, flags=cuda_lib.MLA_FORCE_V2)
    G.run_mla(host, emu_lib, B=1, S=1, H=16, Dl=DL, Dr=D - DL, T_max=90, past_len=[60], dtype="bfloat16",
              num_splits=2, flags=cuda_lib.MLA_FORCE_V2)
    assert _count(emu_lib, "wgmma") == wgmma


def test_mla_path_v2_keeps_sparse_and_dense_on_v2():
    """MTP_TRT_MLA_PATH=v2 (read once per process: a child process) keeps sparse and dense launches on v2 on an
    emulated compute capability 9.0 device."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("from mtp_trt.fsutil import cache_dir\n"
            "from mtp_trt.plugins import cuda_lib\n"
            "from tests.kernels import test_gpu_kernels as G\n"
            "from tests.kernels._gpu import Gpu, HostRuntime\n"
            "from tests.kernels.emu import build\n"
            "from tests.kernels.test_emulated import _count\n"
            "lib = cuda_lib.KernelLib(build.build_emulated_library(cache_dir('emu')))\n"
            "host = Gpu(HostRuntime(num_sms=132))\n"
            "G.run_mla_sparse(host, lib, B=1, S=2, H=16, Dl=512, Dr=64, Di=128, T_max=200, past_len=[150], K=100,\n"
            "                 dtype='bfloat16', num_splits=3)\n"
            "G.run_mla(host, lib, B=1, S=1, H=16, Dl=512, Dr=64, T_max=90, past_len=[60], dtype='bfloat16',\n"
            "          num_splits=2)\n"
            "print('wgmma', _count(lib, 'wgmma'))\n")
    env = dict(os.environ, MTP_TRT_MLA_PATH="v2", MTP_EMU_CC="90", MTP_EMU_SMEM_OPTIN="232448", MTP_EMU_DEVICE="7",
               MTP_EMU_CP_ASYNC="deferred")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wgmma 0" in proc.stdout, proc.stdout


@pytest.mark.parametrize("B,S,H,T,past,P", [(3, 1, 16, 200, [0, 199, 64], 4), (2, 1, 128, 150, [149, 20], 3)],
                         ids=["H16-ragged", "H128-two-blocks"])
def test_v3_schedule_bytes_read_and_two_barriers_per_tile(emu_lib, host, hopper, B, S, H, T, past, P):
    """The schedule the device wrote (64-row tiles) is reference.mla_schedule's; the TMA trace: every block of 64 query
    rows reads the rows of every sequence's tiles (64 rows each, the last one's rows past the sequence's end included
    up to its T_max rows, never the next sequence's) exactly once, all 576 values, and no other cache row; two block
    barriers per tile."""
    hopper()
    rng = np.random.default_rng(0)
    past = np.int32(past)
    q_s, _ = to_storage(rng.standard_normal((B, S, H, D)), "bfloat16")
    c_s, _ = to_storage(rng.standard_normal((B, T, D)), "bfloat16")
    d_cache = host.upload(c_s)
    d_out, d_ws, ws = G.decode_buffers(host, emu_lib, B, S, H, DL, "bfloat16", P)
    blocks, addrs, barriers = _traced(emu_lib, lambda: emu_lib.mla_decode(
        "bfloat16", host.upload(q_s), d_cache, host.upload(past), 0, 0, d_out, d_ws, ws, B, S, H, DL, D - DL, T,
        1 / math.sqrt(D), P, 0))
    in_cache = (addrs >= d_cache) & (addrs < d_cache + c_s.nbytes)
    L = np.minimum(past + S, T)
    for mb in range(-(-S * H // 64)):
        mine = in_cache & ((blocks & ((1 << 21) - 1)) == mb)
        got, loads = np.unique((addrs[mine] - d_cache) // (D * 2), return_counts=True)
        want = np.concatenate([b * T + np.arange(min(-(-int(n_) // 64) * 64, T)) for b, n_ in enumerate(L)])
        assert np.array_equal(got, want) and np.all(loads == D * 2 // 16), (mb, np.unique(loads, return_counts=True))
    # the schedule the prologue wrote (64-row tiles) is the reference's
    tiles = [-(-int(n_) // 64) for n_ in L]
    runs, seqs = ref.mla_schedule(tiles, P)
    wsb = host.download(d_ws, (ws,), np.uint8)
    M, align = S * H, lambda v: -(-v // 256) * 256
    off = align((P + B - 1) * M * DL * 4) + align((P + B - 1) * M * 8)
    part = wsb[off:off + 16 * P].view(np.int32).reshape(P, 4)
    seq = wsb[off + align(16 * P):off + align(16 * P) + 8 * B].view(np.int32).reshape(B, 2)
    assert [None if r[0] < 0 else tuple(int(x) for x in r) for r in part] == runs
    assert [tuple(int(x) for x in r) for r in seq] == seqs
    # block barriers: one after the mbarriers' init, two per 64-row tile, two per segment (a sequence's share of a
    # part: the epilogue); the schedule block: 2 + 3 per chunk of 128 sequences
    per_block = [1 + sum(2 * n_ + 2 for n_ in ref.mla_run_segments(r, tiles)) if r is not None else 1 for r in runs]
    assert barriers == -(-S * H // 64) * sum(per_block) + 2 + 3 * -(-B // 128), barriers
