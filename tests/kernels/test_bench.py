"""plugins/bench_kernels.py's timing and data without a GPU: a stand-in CUDA runtime records what the benchmark
asks of it (tests/kernels/test_emulated.py runs its launches on the emulated kernels)."""

from __future__ import annotations

import numpy as np

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

    assert bk.Bench(rt).timed(fn, iters=3, warmup=1) == 6.0 / 3 and "cudaGraphLaunch" not in rt.log


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


def test_rotation_exceeds_l2_three_times():
    assert bk.rotation({"l2_bytes": 60 << 20}, 4 << 20) == 16
    assert bk.rotation({"l2_bytes": 60 << 20}, 50 << 20) == 4
    assert bk.rotation({"l2_bytes": 60 << 20}, 1 << 30) == 1
