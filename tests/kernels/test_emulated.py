"""The CUDA kernels run on the CPU under a host emulation of the CUDA execution model
(tests/kernels/emu: std::thread per CUDA thread, barriers, emulated warp shuffles, mma and
cp.async), driven by the same test functions as test_gpu_kernels.py on a subset of small shapes.

This catches indexing, masking, split, synchronisation-order (cp.async groups are copied only when
their wait retires them) and tensor-core fragment-consistency bugs without a GPU.  It cannot check
the hardware's mma fragment layout itself, performance, or races that a real GPU would expose;
test_gpu_kernels.py does that where a GPU is present.

Needs g++ and the CUDA headers; skipped otherwise.  The emulated library is cached in
the cache directory's emu/ (mtp_trt.fsutil.cache_dir; keyed by the sources' hash); the first build takes ~20 s.
"""

from __future__ import annotations

import ctypes
import os

import pytest

from mtp_trt.fsutil import cache_dir
from mtp_trt.plugins import cuda_lib

from . import test_gpu_kernels as G
from ._gpu import Gpu, HostRuntime
from .emu import build as emu_build

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(emu_build.unavailable_reason() is not None,
                                 reason=f"kernel emulation: {emu_build.unavailable_reason()}")]


@pytest.fixture(scope="module")
def emu_lib():
    os.environ["MTP_EMU_CP_ASYNC"] = "deferred"  # read once, at the first cp.async of the process
    path = emu_build.build_emulated_library(cache_dir("emu"))
    return cuda_lib.KernelLib(path)


@pytest.fixture()
def host():
    g = Gpu(HostRuntime(num_sms=132))
    yield g
    g.free_all()


MLA = ["empty-cache-S1-H16", "demo-64-16-fp32", "demo-64-16-fp16", "demo-128-32-bf16-tree", "Dl32-Dr32-fp16",
       "Dl16-Dr0-bf16", "D640-bf16", "odd-48-8-fp16-simt", "odd-33-5-fp32", "odd-33-5-bf16", "precommitted-bf16", "splits-gt-rows-bf16",
       "ds-bf16-S4-B2", "force-simt-bf16-tree"]


@pytest.mark.parametrize("name", MLA)
def test_mla_decode_emulated(emu_lib, host, name):
    G.run_mla(host, emu_lib, **dict(G.MLA_CASES)[name])


def test_mla_decode_emulated_single_stage_small_smem(emu_lib, host, monkeypatch):
    # an sm_86/89-sized shared memory (99 KB): the general tensor-core kernel without double buffering
    monkeypatch.setenv("MTP_EMU_SMEM_OPTIN", "101376")
    monkeypatch.setenv("MTP_EMU_DEVICE", "3")  # device facts are read once per device: a device of its own
    G.run_mla(host, emu_lib, B=2, S=2, H=20, Dl=512, Dr=64, T_max=90, past_len=[7, 88], dtype="float16",
              num_splits=3, flags=cuda_lib.MLA_FORCE_V1)


def _count(lib, which: str) -> int:
    fn = lib.lib.mtp_emu_count
    fn.restype, fn.argtypes = ctypes.c_long, [ctypes.c_int]
    return fn({"attribute": 0, "func_attribute": 1, "cp_async": 2, "syncthreads": 3, "wgmma": 4}[which])


def test_mla_prefill_reads_only_the_causal_prefix(emu_lib, host):
    """A prefill (128 new tokens, 2 heads: 8 query tiles of 16 tokens) without a mask: each query tile reads the
    rows up to its last token's, not all 128, so it loads about 30% less than the same visibility as an explicit
    mask (which may open any new row); both equal the NumPy reference."""
    case = dict(B=1, S=128, H=2, Dl=64, Dr=16, T_max=160, past_len=[0], dtype="float16", num_splits=1)
    loads = []
    for mask in (None, "causal"):
        before = _count(emu_lib, "cp_async")
        G.run_mla(host, emu_lib, mask=mask, **case)
        loads.append(_count(emu_lib, "cp_async") - before)
    q_tiles, row_tiles = 8, 0
    for i in range(8):  # rows of tile i: up to token 16 i + 15, in tiles of 32 rows
        row_tiles += -(-(16 * i + 16) // 32)
    chunks = (64 + 16) // 8  # 16-byte loads per row
    assert loads == [(q_tiles * 32 + row_tiles * 32) * chunks, (q_tiles * 32 + 8 * 4 * 32) * chunks]


def test_mla_device_attributes_are_read_once_per_device(emu_lib, host, monkeypatch):
    """The SM count and the opt-in shared memory are queried, and the kernel's shared-memory limit raised, on the
    first launch on a device, not on later ones."""
    monkeypatch.setenv("MTP_EMU_DEVICE", "7")  # a device no other test used in this process
    case = dict(B=1, S=1, H=16, Dl=512, Dr=64, T_max=40, past_len=[0], dtype="float16", num_splits=1)
    counts = []
    for _ in range(3):
        G.run_mla(host, emu_lib, **case)
        emu_lib.mla_decode_num_splits(1, 1, 16, 40, 0)
        counts.append((_count(emu_lib, "attribute"), _count(emu_lib, "func_attribute")))
    assert counts[0] != (0, 0) and counts[0] == counts[1] == counts[2]


@pytest.mark.parametrize("name", ["small-fp32", "small-fp16-tc", "odd-bf16-simt", "force-simt-bf16"])
def test_mla_sparse_decode_emulated(emu_lib, host, name):
    G.run_mla_sparse(host, emu_lib, **dict(G.MLA_SPARSE_CASES)[name])


def test_mla_sparse_decode_emulated_deepseek_dims(emu_lib, host):
    G.run_mla_sparse(host, emu_lib, B=1, S=2, H=16, Dl=512, Dr=64, Di=128, T_max=100, past_len=[60], K=48,
                     dtype="bfloat16", num_splits=2, empty_query=True)


@pytest.mark.parametrize("name", ["fewer-rows-than-K", "ties-bf16", "ties-tree-fp16", "random-fp32", "nan-rows-bf16",
                                  "all-equal-fp16-tree", "chunks-ties-bf16-ragged", "chunks-nan-tree-fp16",
                                  "chunks-equal-bf16", "chunks-simt-fp32"])
def test_dsa_select_emulated(emu_lib, host, name):
    G.run_dsa_select(host, emu_lib, **dict(G.DSA_SELECT_CASES)[name])


def test_dsa_select_emulated_deepseek_heads(emu_lib, host):
    G.run_dsa_select(host, emu_lib, B=1, S=2, Hi=64, Di=128, T_max=300, past_len=[290], K=64, dtype="bfloat16")


def test_kv_commit_emulated(emu_lib, host):
    G.test_mla_kv_commit_alone(host, emu_lib)


# Rows of 129280 or 20001 values are read by clusters of 4 or 8 blocks (the emulated GPU has 132 SMs and sm_90's
# clusters); 20001 fp16 values make rows that start off 16-byte boundaries, and p and q rows aligned differently.
@pytest.mark.parametrize("B,K,V,dtype", [(1, 0, 17, "float32"), (7, 3, 1000, "float16"), (2, 16, 129280, "float32"),
                                         (1, 3, 129280, "bfloat16"), (2, 3, 20001, "float16")])
def test_accept_strict_emulated(emu_lib, host, B, K, V, dtype):
    G.test_accept_strict(host, emu_lib, B, K, V, dtype)


def test_accept_without_clusters_emulated(emu_lib, host, monkeypatch):
    """Code built for GPUs before sm_90 (no clusters): one block per row, the same results."""
    monkeypatch.setenv("MTP_EMU_PTX", "80")
    monkeypatch.setenv("MTP_EMU_DEVICE", "5")  # launch facts are read once per device: a device of its own
    G.test_accept_strict(host, emu_lib, 1, 3, 129280, "bfloat16")
    G.test_accept_relaxed(host, emu_lib, 2, 3, 20001, "float16", 4, 0.3, "device-plugin")
    G.test_accept_rejection(host, emu_lib, 3, 2, 20001, "float16")


@pytest.mark.parametrize("B,K,V,dtype,topk,delta,scalars", [(5, 3, 50, "float32", 3, 0.3, "host"),
                                                             (2, 7, 129280, "bfloat16", 10, 0.05, "host"),
                                                             (5, 3, 50, "float32", 3, 0.3, "device-plugin"),
                                                             (6, 4, 200, "float16", 4, 0.4, "device-gap"),
                                                             (3, 0, 40, "float32", 3, 0.3, "device-plugin"),
                                                             (2, 3, 20001, "float16", 4, 0.3, "device-gap"),
                                                             (8, 5, 300, "bfloat16", 0, 0.5, "device-gap")])
def test_accept_relaxed_emulated(emu_lib, host, B, K, V, dtype, topk, delta, scalars):
    G.test_accept_relaxed(host, emu_lib, B, K, V, dtype, topk, delta, scalars)


@pytest.mark.parametrize("B,K,V,dtype", [(1, 0, 10, "float32"), (8, 3, 1000, "float32"), (3, 16, 129280, "float32"),
                                         (5, 4, 129280, "bfloat16"), (3, 2, 20001, "float16")])
def test_accept_rejection_emulated(emu_lib, host, B, K, V, dtype):
    G.test_accept_rejection(host, emu_lib, B, K, V, dtype)


@pytest.mark.parametrize("B,Kp1,D,dtype", [(1, 1, 7168, "bfloat16"), (5, 4, 7, "float16"), (3, 2, 3, "float32")])
def test_gather_emulated(emu_lib, host, B, Kp1, D, dtype):
    G.test_gather_last_hidden(host, emu_lib, B, Kp1, D, dtype)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("B,K,N,D,dtype", [(1, 1, 2, 7168, "bfloat16"), (7, 16, 17, 33, "float32"), (5, 4, 2, 5, "float16")])
def test_window_emulated(emu_lib, host, in_place, B, K, N, D, dtype):
    G.test_window_update(host, emu_lib, in_place, B, K, N, D, dtype)


@pytest.fixture()
def small_bench(monkeypatch):
    """plugins/bench_kernels.py on small dims, each timed call made once and taken as 0.5 ms."""
    from mtp_trt.plugins import bench_kernels as bk

    for name, value in {"HI": 4, "DI": 16, "TOPK": 8, "DL": 64, "DR": 16}.items():
        monkeypatch.setattr(bk, name, value)
    monkeypatch.setattr(bk.Bench, "timed", lambda self, fn, iters, warmup=3: (fn(0, 0), 0.5)[1])
    return bk


def test_mla_benchmark_launches_emulated(emu_lib, small_bench):
    """The MLA table's launches are valid (the kernel library checks every argument), their output matched the
    reference before timing, and bytes and FLOPs count the rows each sequence reads (T rows, or its ragged length +
    S), the new rows the commit reads and writes."""
    bk = small_bench
    b = bk.Bench(HostRuntime(), seed=1)
    info = {"l2_bytes": 1 << 16, "sm_count": 132}
    r = bk.bench_mla(b, emu_lib, info, 2, 40, 4, 2, "bfloat16", 1, 0, ragged=False)
    assert "mismatch" not in r, r.get("mismatch")
    assert r["bytes"] == 2 * 40 * 80 * 2 + 2 * 2 * 4 * 80 * 2 + 2 * (2 * 2 * 80 * 2) + 2 * 2 * 4 * 64 * 2
    assert r["flops"] == 2 * 2 * 4 * (2 * 40) * (80 + 64) and r["GBps"] == r["bytes"] / 0.5e6
    assert r["TFLOPS"] == r["flops"] / 0.5e9 and "torch_us" not in r
    assert r["rows"] == 2 * 40 and r["l2_ratio"] > 3
    r = bk.bench_mla(bk.Bench(HostRuntime(), seed=1), emu_lib, info, 2, 40, 4, 2, "bfloat16", 1, 0)  # ragged
    assert "mismatch" not in r, r.get("mismatch")
    assert r["ragged"] and 2 * 2 <= r["rows"] < 2 * 40 and r["flops"] == 2 * 2 * 4 * r["rows"] * (80 + 64)
    r = bk.bench_mla(bk.Bench(HostRuntime(), seed=1), emu_lib, info, 2, 40, 4, 2, "bfloat16", 1, 0, splits=5)
    assert "mismatch" not in r and r["splits"] == 5  # --splits: the sweep's count, not the library's rule


def test_mla_benchmark_does_not_time_a_wrong_output(emu_lib, small_bench, monkeypatch):
    bk = small_bench
    monkeypatch.setattr(bk.Bench, "timed", lambda *a, **k: pytest.fail("a mismatched kernel was timed"))
    right = bk.mla_expected
    monkeypatch.setattr(bk, "mla_expected", lambda *a: right(*a) + 0.5)
    r = bk.bench_mla(bk.Bench(HostRuntime(), seed=1), emu_lib, {"l2_bytes": 1 << 16, "sm_count": 132}, 2, 40, 4, 2,
                     "bfloat16", 1, 0)
    assert "values off" in r["mismatch"] and "time_us" not in r
    assert "OUTPUT MISMATCH, not timed" in bk.mla_line(r)


def test_dsa_benchmark_launches_emulated(emu_lib, small_bench):
    """The DSA table: valid launches whose outputs matched the reference, sparse MLA over lists of fresh rows, and
    the byte and FLOP counts as documented."""
    bk = small_bench
    r = bk.bench_dsa(bk.Bench(HostRuntime()), emu_lib, {"l2_bytes": 1 << 16, "sm_count": 132}, 1, 40, 4, 2,
                     "bfloat16", 1, ragged=False)
    assert not [k for k in r if k.endswith("mismatch")], r
    assert r["select_bytes"] == 40 * 16 * 2 + 2 * 4 * 16 * 2 + 2 * 4 * 4 + 2 * 8 * 4
    assert r["select_flops"] == 2 * 2 * 40 * 4 * 16
    assert 8 <= r["attend_rows"] <= 16  # two tokens of 8 rows each from one slab of 16
    assert r["attend_bytes"] == r["attend_rows"] * 80 * 2 + 2 * 4 * 80 * 2 + 2 * 8 * 4 + 2 * 4 * 64 * 2
    assert r["select_GBps"] == r["select_bytes"] / 0.5e6
    assert r["select_l2_ratio"] > 3 and r["attend_l2_ratio"] > 3 and r["attend_copies"] > 1
    r = bk.bench_dsa(bk.Bench(HostRuntime(), seed=4), emu_lib, {"l2_bytes": 1 << 16, "sm_count": 132}, 3, 40, 4, 2,
                     "bfloat16", 1)  # ragged
    assert not [k for k in r if k.endswith("mismatch")], r


def test_accept_benchmark_launches_emulated(emu_lib, small_bench):
    bk = small_bench
    r = bk.bench_accept(bk.Bench(HostRuntime()), emu_lib, {"l2_bytes": 1 << 16, "sm_count": 132}, 2, 3, 5000,
                        "bfloat16", 1)
    assert not [k for k in r if k.endswith("mismatch")], r
    assert r["strict_bytes"] == r["relaxed_bytes"] == 2 * 4 * 5000 * 2 and r["rejection_bytes"] == 2 * 2 * 5000 * 2
    assert r["strict_GBps"] == r["strict_bytes"] / 0.5e6


def test_accept_benchmark_does_not_time_a_wrong_output(emu_lib, small_bench, monkeypatch):
    bk = small_bench
    timed = []
    monkeypatch.setattr(bk.Bench, "timed", lambda self, fn, iters, warmup=3: (timed.append(fn), 0.5)[1])
    right = bk.ref.accept_strict
    monkeypatch.setattr(bk.ref, "accept_strict", lambda *a, **k: (lambda t: (t[0] + 1, *t[1:]))(right(*a, **k)))
    r = bk.bench_accept(bk.Bench(HostRuntime()), emu_lib, {"l2_bytes": 1 << 16, "sm_count": 132}, 2, 3, 5000,
                        "bfloat16", 1)
    assert "strict_mismatch" in r and "strict_us" not in r and "relaxed_us" in r and len(timed) == 2
    assert "MISMATCH, not timed" in bk.accept_line(r, 1000.0)
