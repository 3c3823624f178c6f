"""plugins/bench_kernels.py's timing and data without a GPU: a stand-in CUDA runtime records what the benchmark
asks of it (tests/kernels/test_emulated.py runs its launches on the emulated kernels)."""

from __future__ import annotations

import numpy as np
import pytest

from mtp_trt.plugins import bench_kernels as bk
from mtp_trt.plugins import reference as ref


class Recorder:
    """The calls Bench.timed makes, each succeeding; each replay between two events takes 6 ms."""

    class cudaStreamCaptureMode:  # noqa: N801 - mirrors cuda-python
        cudaStreamCaptureModeThreadLocal = 1

    cudaStreamNonBlocking = 1

    def __init__(self, capture_ok: bool = True):
        self.capture_ok, self.log, self.capturing = capture_ok, [], False

    def __getattr__(self, name):
        def call(*args):
            self.log.append(name)
            if name == "cudaStreamBeginCapture":
                if not self.capture_ok:
                    return (1,)
                self.capturing = True
            if name == "cudaStreamEndCapture":
                self.capturing = False
            if name == "cudaEventElapsedTime":
                return (0, 6.0)
            return (0, 7) if name in ("cudaStreamCreateWithFlags", "cudaStreamEndCapture", "cudaGraphInstantiate",
                                      "cudaEventCreate") else (0,)
        return call


def test_timed_captures_the_calls_in_one_graph_and_replays_it():
    rt = Recorder()
    calls = []
    ms = bk.Bench(rt).timed(lambda i, stream: calls.append((i, stream, rt.capturing)), iters=10, warmup=2)
    assert ms == 6.0 / 10
    assert calls == [(0, 7, False), (1, 7, False)] + [(i, 7, True) for i in range(10)]  # warm-up, then captured
    assert rt.log.count("cudaGraphLaunch") == bk.REPLAYS and rt.log.count("cudaEventRecord") == 2 * bk.REPLAYS
    assert {"cudaGraphExecDestroy", "cudaGraphDestroy"} <= set(rt.log)


def test_timed_launches_back_to_back_where_capture_fails():
    rt = Recorder(capture_ok=False)
    calls = []
    ms = bk.Bench(rt).timed(lambda i, stream: calls.append(i), iters=4, warmup=1)
    assert ms == 6.0 / 4 and "cudaGraphLaunch" not in rt.log
    assert calls == [0] + list(range(4)) * bk.REPLAYS


def test_timed_falls_back_when_a_launch_fails_inside_the_capture():
    from mtp_trt.plugins import cuda_lib

    rt = Recorder()

    def fn(i, stream):
        if rt.capturing:
            raise cuda_lib.CudaKernelError("mtp_x: CUDA error 901 (operation not permitted when stream is capturing)")

    b = bk.Bench(rt)
    assert b.timed(fn, iters=3, warmup=1) == 6.0 / 3 and "cudaGraphLaunch" not in rt.log
    why = "mtp_x: CUDA error 901 (operation not permitted when stream is capturing)"
    assert not b.graphed and b.ungraphed == {why: 1}
    b.timed(lambda i, stream: None, iters=3, warmup=1)  # the next timing is graphed again; the reason stays counted
    assert b.graphed and len(b.ungraphed) == 1


def test_copy_ceiling_is_the_fastest_copy(monkeypatch):
    """The "% copy" columns divide by the strongest of three copies: cudaMemcpyAsync captured in a CUDA graph (a copy
    node can run far below the SMs' copy rate), the same launched on the stream, and PyTorch's copy kernel where
    PyTorch has CUDA."""
    class Rt(Recorder):
        class cudaMemcpyKind:  # noqa: N801 - mirrors cuda-python
            cudaMemcpyDeviceToDevice = 3

        def cudaMalloc(self, n):  # noqa: N802
            return (0, 4096)

    class FakeTorch:
        __version__ = "9.9"
        float32 = "float32"

        class cuda:  # noqa: N801
            empty_cache = staticmethod(lambda: None)

        @staticmethod
        def empty(n, dtype, device):
            return type("T", (), {"copy_": lambda self, other: None})()

    def bench(graph_ms: float, stream_ms: float):
        b = bk.Bench(Rt())
        b.timed = lambda fn, iters, warmup=3, graph=True: graph_ms if graph else stream_ms
        return b

    gbps = lambda ms: 2 * 4000 / (ms * 1e-3) / 1e9  # noqa: E731
    assert bk.copy_bandwidth(bench(2.0, 1.0), 4000, 4) == (gbps(1.0), "cudaMemcpyAsync, stream launches")
    assert bk.copy_bandwidth(bench(1.0, 2.0), 4000, 4) == (gbps(1.0), "cudaMemcpyAsync, CUDA graph")
    monkeypatch.setattr(bk, "torch_timed", lambda torch, fn, iters: 0.5)
    assert bk.copy_bandwidth(bench(2.0, 1.0), 4000, 4, FakeTorch) == (gbps(0.5), "torch 9.9 Tensor.copy_")
    monkeypatch.setattr(bk, "torch_timed", lambda torch, fn, iters: 3.0)
    assert bk.copy_bandwidth(bench(2.0, 1.0), 4000, 4, FakeTorch) == (gbps(1.0), "cudaMemcpyAsync, stream launches")


def test_timed_on_stream_launches_when_asked():
    rt = Recorder()
    b = bk.Bench(rt)
    calls = []
    assert b.timed(lambda i, stream: calls.append(i), iters=3, warmup=1, graph=False) == 6.0 / 3
    assert "cudaStreamBeginCapture" not in rt.log and not b.graphed and b.ungraphed == {}
    assert calls == [0] + [0, 1, 2] * bk.REPLAYS

def test_random_values_are_seeded_bounded_and_distinct():
    for dtype in ("bfloat16", "float16", "float32"):
        a = bk.Bench(None, seed=3).values(50_000, dtype)
        assert np.array_equal(a, bk.Bench(None, seed=3).values(50_000, dtype))
        x = {"bfloat16": ref.bf16_bits_to_f32, "float16": lambda v: v.view(np.float16).astype(np.float32),
             "float32": lambda v: v}[dtype](a)
        assert np.all((np.abs(x) >= 0.5) & (np.abs(x) < 1)), dtype
        assert 0.45 < np.mean(x < 0) < 0.55 and len(np.unique(x)) >= (128 if dtype == "bfloat16" else 1000), dtype
    pos = ref.bf16_bits_to_f32(bk.Bench(None).values(1000, "bfloat16", positive=True))
    assert np.all(pos > 0)
    const = bk.Bench(None, data="constant").values(8, "bfloat16")
    assert np.all(const == 0x3C3C)


def test_ragged_lengths_are_seeded_and_in_range():
    b = bk.Bench(None, seed=5)
    assert np.array_equal(b.past_lengths(4, 100, 2, False), [98] * 4)
    lens = b.past_lengths(1000, 100, 2, True)
    assert lens.min() >= 0 and lens.max() <= 98 and len(np.unique(lens)) > 50
    assert np.array_equal(lens, bk.Bench(None, seed=5).past_lengths(1000, 100, 2, True))


H200 = {"l2_bytes": 60 << 20, "global_mem_bytes": 141 * 10**9, "sm_count": 132}  # as cudaGetDeviceProperties


def test_plan_rotation_reads_three_l2_between_two_uses_of_a_copy():
    for read in (1 << 20, (60 << 20) // 3, 60 << 20, 1 << 30):
        rot = bk.plan_rotation(60 << 20, read, read, 30, 1 << 40)
        assert rot.calls % rot.copies == 0 and rot.calls >= 30
        # the ratio from the sequence of copies the timed calls use, two replays of the graph, warm-up aside
        assert bk.reuse_bytes(rot.sequence(), read) > 3 * (60 << 20), read
        assert rot.l2_ratio == bk.reuse_bytes(rot.sequence(), read) / (60 << 20)
    # 1 MiB read per call: 182 copies, and a graph of 182 calls (30 calls would re-read 30 MiB, within L2)
    rot = bk.plan_rotation(60 << 20, 1 << 20, 1 << 20, 30, 1 << 40)
    assert (rot.copies, rot.calls) == (182, 182) and rot.l2_ratio == 181 / 60
    # a budget that holds fewer copies gives fewer, and the ratio says so
    rot = bk.plan_rotation(60 << 20, 1 << 20, 1 << 20, 30, 50 << 20)
    assert rot.copies == 50 and rot.l2_ratio < 1
    rot = bk.plan_rotation(60 << 20, 1 << 10, 1 << 10, 30, 1 << 40)  # and at most MAX_COPIES
    assert rot.copies == bk.MAX_COPIES and rot.l2_ratio < 1


def test_reuse_bytes_counts_the_calls_between_two_uses():
    assert bk.reuse_bytes([0, 1, 2, 0, 1, 2], 10) == 20
    assert bk.reuse_bytes([0, 1, 0, 2], 10) == 10
    assert bk.reuse_bytes([0, 0], 10) == 0
    assert bk.reuse_bytes([0, 1], 10) == float("inf")


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "uniform"])
def test_every_benchmarked_kernel_reads_three_l2_between_two_uses_of_a_copy(ragged):
    """Every row the benchmark times, on an H200's L2 and memory: the bytes each kernel reads between two uses of one
    copy of its inputs (from the sequence of copies its calls use) exceed L2 three times."""
    b = bk.Bench(None, seed=0)
    for H in (128, 16):
        for S in (1, 2, 4):
            for B, T in bk.CONFIGS_BT:
                lens = b.past_lengths(B, T, S, ragged)
                rot = bk.mla_rotation(H200, B, T, H, S, lens, 30)
                assert rot.l2_ratio > 3, ("mla", B, T, H, S, rot)
    for S in (1, 2, 4):
        for B, T in bk.DSA_BT:
            lens = b.past_lengths(B, T, S, ragged)
            rot = bk.select_rotation(H200, B, T, S, lens, 30)
            assert rot.l2_ratio > 3, ("select", B, T, S, rot)
            n = min(bk.TOPK, T)
            lists = bk.sparse_lists(b.rng, B, S, bk.TOPK, n, 2 * n, 0)
            distinct = sum(len(np.unique(lists[i][lists[i] >= 0])) for i in range(B))
            rot = bk.sparse_rotation(H200, B, S, bk.H_DSA, distinct, 2 * n, 30)
            assert rot.l2_ratio > 3, ("sparse", B, T, S, rot)
    for B in bk.ACCEPT_B:
        assert bk.accept_rotation(H200, B, bk.K_ACCEPT, bk.V_ACCEPT, 30).l2_ratio > 3, ("accept", B)


def test_indexer_copies_are_sized_on_the_keys_it_reads():
    """The selection reads 128 of each row's 704 values: its copies are sized on those 256 bytes per row, so at
    B 1, T 4096 they are many more than whole rows would need."""
    lens = np.int32([4095])
    rot = bk.select_rotation(H200, 1, 4096, 1, lens, 30)
    assert rot.read_bytes == 4096 * 128 * 2 + 64 * 128 * 2 + 64 * 4
    assert (rot.copies - 1) * rot.read_bytes > 3 * (60 << 20)
    assert rot.copies > 5 * 3 * (60 << 20) / (4096 * 704 * 2)  # whole rows would have given a fifth as many


def test_sparse_lists_name_fresh_rows_on_every_copy():
    rng = np.random.default_rng(0)
    seen = set()
    for k in range(4):
        sel = bk.sparse_lists(rng, 2, 3, 40, 30, 60, k)
        assert sel.shape == (2, 3, 40) and np.all(sel[..., 30:] == -1)
        rows = sel[..., :30]
        assert np.all(np.diff(rows, axis=-1) > 0) and rows.min() >= 60 * k and rows.max() < 60 * (k + 1)
        assert not seen & set(rows.ravel().tolist())
        seen |= set(rows.ravel().tolist())


def test_lengths_are_ragged_unless_uniform_is_asked():
    assert not bk.parser().parse_args([]).uniform
    assert bk.parser().parse_args(["--uniform"]).uniform and not bk.parser().parse_args(["--ragged"]).uniform


def test_mla_expected_is_the_reference():
    rng = np.random.default_rng(2)
    B, S, H, T, D = 3, 2, 4, 50, bk.DL + bk.DR
    q, cache, new = rng.standard_normal((B, S, H, D)), rng.standard_normal((B, T, D)), rng.standard_normal((B, S, D))
    lens = np.int32([0, 17, 48])
    want, after = ref.mla_decode(q, cache, lens, dl=bk.DL, scale=0.05, new_rows=new)
    got = bk.mla_expected(q, after, lens, S, 0.05, [0, 2])
    assert np.allclose(got, want[[0, 2]], rtol=1e-12, atol=1e-12)


def test_select_expected_is_the_reference(monkeypatch):
    for name, value in {"HI": 4, "DI": 16, "TOPK": 8}.items():
        monkeypatch.setattr(bk, name, value)
    rng = np.random.default_rng(3)
    B, S, T = 2, 2, 30
    iq, w = rng.standard_normal((B, S, 4, 16)), rng.random((B, S, 4))
    cache = rng.standard_normal((B, T, 20))
    lens = np.int32([5, 28])
    want, want_scores = ref.dsa_select(iq, w, cache, lens, key_offset=4, k=8, scale=16**-0.5)
    got, scores = bk.select_expected(iq, w, cache[..., 4:], lens, S, [0, 1])
    assert np.array_equal(got, want)
    assert np.allclose(scores, want_scores, equal_nan=True, rtol=1e-6)


def test_mismatch_names_the_worst_value_and_never_passes_nan():
    want = np.ones((2, 3))
    assert bk.mismatch(want + 0.01, want, 2e-2) is None
    got = want.copy()
    got[1, 2] = 1.5
    assert "1 of 6 values off" in bk.mismatch(got, want, 2e-2) and "(1, 2)" in bk.mismatch(got, want, 2e-2)
    got[0, 0] = np.nan
    assert "(0, 0)" in bk.mismatch(got, want, 2e-2)
