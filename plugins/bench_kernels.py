"""Benchmark of the CUDA kernels against the GPU's copy bandwidth and the plain PyTorch form.

    python -m mtp_trt.plugins.bench_kernels [--dtype bf16] [--quick] [--uniform] [--data constant] [--json FILE]

Checked first: every timed kernel runs once on the row's data and its output is compared with the reference
(plugins/reference.py; attention on the first, the longest and the last sequence, with the tolerances of the GPU
tests; the selection up to near-ties; acceptance exactly).  A mismatch stops that kernel's row, printed as such, and
the exit status is 1: a broken or fallen-back path is never timed.

Timing: each measured call is captured into one CUDA graph at least --iters times (the launches run back to back, as
in the runtime's CUDA graphs, and no host time is counted), cycling through copies of its inputs; the graph is
replayed 5 times between CUDA events and the median per call is reported.  The copies are sized on the bytes the
kernel actually reads per call (the rows its lengths make visible; the indexer's keys, not the whole rows they sit
in; the listed rows of sparse MLA), so that between two uses of one copy more than 3 x L2 is read (column L2x: that
ratio as run); the calls per graph are whole cycles through the copies.  Where a stream cannot be captured,
back-to-back launches on a stream are timed instead.  Data: random values of magnitude 0.5 .. 1 with random signs
(seeded, --seed), so scores are distinct as in real use; --data constant fills every buffer with one value (every
indexer score ties: top-k's worst case).  Lengths: ragged by default (each sequence's cached rows uniform in
0 .. T - S, seeded), --uniform: every sequence at T - S.  Bytes are the minimum any implementation must move (the
rows read, the queries, the new rows, the outputs); FLOPs count multiply-adds as 2.

1. Device-to-device copy bandwidth: cudaMemcpyAsync of a large buffer, read + write bytes.
2. mtp_mla_decode with its KV commit (the S new rows written first, as the runtime calls it) on DeepSeek-V3 shapes
   (Dl 512, Dr 64; H = 128 and 16; S = 1, 2, 4; B x T from 4k to 256k cached rows): time, GB/s, % of the copy
   bandwidth, TFLOPS (2 S H L (576 + 512) per sequence of L rows), and with --uniform the ratio to the plain
   PyTorch form where torch has CUDA (bmm of q [B, S H, 576] with the cache, fp32 softmax, bmm with its first 512
   columns over every T rows).
3. DeepSeek Sparse Attention (DeepSeek-V3.2's shapes: 64 indexer heads of 128, index_topk 2048, rows of 576 latent
   values and a 128-value key; H = 128): mtp_dsa_select (bytes: the visible rows' keys, the queries and weights,
   the selection; FLOPs 2 S L 64 128; with --uniform against torch: bmm, ReLU, the weighted head sum, topk and a
   sort) and mtp_mla_sparse_decode over min(2048, T) listed rows per token, fresh on every call (each copy's lists
   name rows of a slab of the cache of their own; bytes: the distinct listed rows, q, the lists, out).
4. Acceptance of K = 3 drafts over V = 129280 (DeepSeek-V3's vocabulary): mtp_accept_strict and
   mtp_accept_relaxed_dev (bytes: every logits row) and mtp_accept_rejection (bytes: the p and q rows it samples
   from).

Needs cuda-python and an NVIDIA GPU (exits with a message otherwise); builds the kernels with nvcc on first use
(see cuda_lib).  The sizing and checking functions are plain Python, tested without a GPU (tests/kernels/test_bench.py,
and on the emulated kernels in tests/kernels/test_emulated.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import sys

import numpy as np

from mtp_trt.plugins import cuda_lib
from mtp_trt.plugins import reference as ref

DL, DR = 512, 64
CONFIGS_BT = [(1, 4096), (1, 32768), (1, 131072), (4, 8192), (8, 4096), (16, 4096), (32, 4096), (64, 4096),
              (8, 32768), (2, 131072)]
QUICK_BT = [(1, 4096), (1, 32768), (64, 4096), (8, 32768)]
REPLAYS = 5


class Bench:
    """Device buffers (freed together), seeded input data and the timing of captured launches."""

    def __init__(self, cudart, *, seed: int = 0, data: str = "random"):
        self.rt = cudart
        self.ptrs: list[int] = []
        self.rng = np.random.default_rng(seed)
        self.data = data
        self._stream = None
        self.ungraphed: dict[str, int] = {}  # why a timing fell back to stream launches -> how many did
        self.graphed = True  # the last timing ran as one CUDA graph

    def ck(self, res, what):
        err = res[0] if isinstance(res, tuple) else res
        if int(err) != 0:
            raise RuntimeError(f"{what}: {err}")
        return res[1] if isinstance(res, tuple) and len(res) > 1 else None

    def alloc(self, n: int) -> int:
        p = int(self.ck(self.rt.cudaMalloc(int(n)), f"cudaMalloc({n})"))
        self.ptrs.append(p)
        return p

    def free_all(self):
        for p in self.ptrs:
            self.rt.cudaFree(p)
        self.ptrs.clear()

    def upload(self, arr, ptr: int | None = None) -> int:
        arr = np.ascontiguousarray(arr)
        ptr = self.alloc(arr.nbytes) if ptr is None else ptr
        self.ck(self.rt.cudaMemcpy(ptr, arr.ctypes.data, arr.nbytes, self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice),
                "cudaMemcpy H2D")
        return ptr

    def download(self, ptr: int, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        self.ck(self.rt.cudaMemcpy(out.ctypes.data, ptr, out.nbytes, self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost),
                "cudaMemcpy D2H")
        return out

    def sync(self, what: str) -> None:
        self.ck(self.rt.cudaDeviceSynchronize(), what)

    def values(self, n: int, dtype: str, *, positive: bool = False) -> np.ndarray:
        """n values of `dtype` in its storage format (fp16 / bf16 as uint16 bits): magnitudes in [0.5, 1) with
        random signs (none when positive), or all 1.06 / 0.0115 / 1e-4-ish (--data constant: the bytes 0x3C)."""
        if self.data == "constant":
            return np.frombuffer(b"\x3c" * (n * (4 if dtype == "float32" else 2)),
                                 np.float32 if dtype == "float32" else np.uint16).copy()
        if dtype == "float32":
            x = self.rng.uniform(0.5, 1.0, n).astype(np.float32)
            return x if positive else np.where(self.rng.integers(0, 2, n, dtype=np.uint8) == 1, -x, x)
        bits = np.frombuffer(self.rng.bytes(2 * n), np.uint16)
        sign = 0 if positive else 0x8000
        keep, one_half = {"bfloat16": (0x007F, 0x3F00), "float16": (0x03FF, 0x3800)}[dtype]
        return (bits & (keep | sign)) | one_half

    def filled(self, count: int, n: int, dtype: str, *, positive: bool = False) -> tuple[np.ndarray, list[int]]:
        """n random values of `dtype` (storage format) and `count` device buffers holding them."""
        host = self.values(n, dtype, positive=positive)
        return host, [self.upload(host) for _ in range(count)]

    def past_lengths(self, B: int, T: int, S: int, ragged: bool) -> np.ndarray:
        """past_len [B]: uniform in 0 .. T - S (ragged), or T - S each."""
        if not ragged:
            return np.full(B, T - S, np.int32)
        return self.rng.integers(0, T - S + 1, B).astype(np.int32)

    def stream(self) -> int:
        if self._stream is None:
            self._stream = self.ck(self.rt.cudaStreamCreateWithFlags(self.rt.cudaStreamNonBlocking), "stream")
        return int(self._stream)

    def capture(self, fn, iters: int, stream: int):
        """(the graph, its executable) of iters calls of fn(i, stream) captured on `stream`, or (None, None) where a
        launch is refused inside the capture or the capture itself fails (the reason counted in self.ungraphed)."""
        rt, graph = self.rt, None
        try:
            self.ck(rt.cudaStreamBeginCapture(stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
                    "capture")
            try:
                for i in range(iters):
                    fn(i, stream)
            finally:
                graph = self.ck(rt.cudaStreamEndCapture(stream), "end capture")
            return graph, self.ck(rt.cudaGraphInstantiate(graph, 0), "instantiate")
        except (RuntimeError, cuda_lib.CudaKernelError) as e:
            rt.cudaGetLastError()
            if graph is not None:
                rt.cudaGraphDestroy(graph)
            self.ungraphed[str(e)] = self.ungraphed.get(str(e), 0) + 1
            return None, None

    def timed(self, fn, iters: int, warmup: int = 3, graph: bool = True) -> float:
        """Milliseconds per call of fn(i, stream) (i = 0, 1, ...): iters calls captured into one CUDA graph, replayed
        REPLAYS times between events, the median; back-to-back stream launches where capture fails or `graph` is
        False."""
        rt, stream = self.rt, self.stream()
        for i in range(warmup):
            fn(i, stream)
        self.ck(rt.cudaStreamSynchronize(stream), "sync")
        graph, launch = self.capture(fn, iters, stream) if graph else (None, None)
        self.graphed = launch is not None

        def run():
            if launch is not None:
                self.ck(rt.cudaGraphLaunch(launch, stream), "graph launch")
                return
            for i in range(iters):
                fn(i, stream)

        start, end = self.ck(rt.cudaEventCreate(), "event"), self.ck(rt.cudaEventCreate(), "event")
        times = []
        for _ in range(REPLAYS):
            self.ck(rt.cudaEventRecord(start, stream), "record")
            run()
            self.ck(rt.cudaEventRecord(end, stream), "record")
            self.ck(rt.cudaEventSynchronize(end), "sync")
            times.append(float(self.ck(rt.cudaEventElapsedTime(start, end), "elapsed")) / iters)
        for ev in (start, end):
            rt.cudaEventDestroy(ev)
        if launch is not None:
            rt.cudaGraphExecDestroy(launch)
            rt.cudaGraphDestroy(graph)
        return statistics.median(times)


# ---------------------------------------------------------------------------------------------------------------
# sizing: how many copies of a kernel's inputs to cycle through, from the bytes it actually reads
# ---------------------------------------------------------------------------------------------------------------
L2_FACTOR = 3  # the bytes read between two uses of one copy: at least this many times L2
MAX_COPIES = 1024  # a bound on the buffers (and the calls per graph) of one row


@dataclasses.dataclass(frozen=True)
class Rotation:
    """`copies` sets of inputs cycled through by `calls` calls per timed graph (a multiple of `copies`, so a replay
    ends where the next begins): between two uses of one copy, (copies - 1) * read_bytes are read."""

    copies: int
    calls: int
    read_bytes: int
    l2_bytes: int

    def sequence(self, replays: int = 2) -> list[int]:
        """The copy each timed call uses, over `replays` replays of the graph (warm-up calls first)."""
        return [i % self.copies for i in range(self.calls)] * replays

    @property
    def l2_ratio(self) -> float:
        """Bytes read between two uses of the same copy, over L2 (what the cache would have to hold to serve the
        second use: below 1 it could; the plan aims at L2_FACTOR)."""
        return reuse_bytes(self.sequence(), self.read_bytes) / self.l2_bytes


def reuse_bytes(sequence, read_bytes: int) -> float:
    """The fewest bytes read between two uses of one copy in `sequence` (the copy of each call; every call reads
    read_bytes): the other calls in between times read_bytes; infinite when no copy is used twice."""
    last: dict[int, int] = {}
    gap = math.inf
    for i, k in enumerate(sequence):
        if k in last:
            gap = min(gap, i - last[k] - 1)
        last[k] = i
    return gap * read_bytes


def plan_rotation(l2_bytes: int, read_bytes: int, alloc_bytes: int, iters: int, budget_bytes: int) -> Rotation:
    """Copies of a kernel's inputs so that the bytes it reads between two uses of one copy exceed L2 L2_FACTOR times:
    read_bytes are what one call reads (not the buffers' size: a kernel that reads a quarter of each row, or a
    ragged part of the cache, needs more copies), alloc_bytes what one copy takes in device memory; at most
    budget_bytes in all and at most MAX_COPIES (fewer copies then, and the row shows the ratio it got).  Calls per timed graph: iters,
    rounded up to whole cycles through the copies."""
    read_bytes = max(int(read_bytes), 1)
    want = L2_FACTOR * l2_bytes // read_bytes + 2  # (want - 1) * read_bytes > L2_FACTOR * l2
    copies = max(1, min(want, budget_bytes // max(int(alloc_bytes), 1), MAX_COPIES))
    calls = -(-max(iters, copies) // copies) * copies
    return Rotation(copies, calls, read_bytes, l2_bytes)


# ---------------------------------------------------------------------------------------------------------------
# checks: every timed kernel's output against the reference once, before timing
# ---------------------------------------------------------------------------------------------------------------
TOL = {"bfloat16": 2e-2, "float16": 3e-3}  # atol = rtol, as tests/kernels/test_gpu_kernels.py


def decode(bits, dtype: str) -> np.ndarray:
    """Storage values (fp16 / bf16 as uint16 bits, fp32 as is) -> float32."""
    bits = np.asarray(bits)
    if dtype == "bfloat16":
        return ref.bf16_bits_to_f32(bits)
    if dtype == "float16":
        return bits.view(np.float16).astype(np.float32)
    return bits.astype(np.float32)


def mismatch(got, want, tol: float) -> str | None:
    """None where |got - want| <= tol + tol |want| everywhere (NaN never passes), else the worst element in words."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.abs(got - want) - tol * (1 + np.abs(want))
    bad = np.isnan(got) | (err > 0)
    if not bad.any():
        return None
    worst = np.unravel_index(np.argmax(np.where(np.isnan(got), np.inf, err)), got.shape)
    return (f"{int(bad.sum())} of {bad.size} values off (tolerance {tol:g}); worst at {tuple(map(int, worst))}: "
            f"got {got[worst]:.6g}, want {want[worst]:.6g}")


def check_seqs(B: int, lens) -> list[int]:
    """The sequences whose outputs are checked: the first, the longest and the last."""
    return sorted({0, int(np.argmax(lens)), B - 1})


def mla_expected(q, cache, past_len, S: int, scale: float, seqs) -> np.ndarray:
    """reference.mla_decode's output (causal, the new rows already in `cache`) for sequences `seqs` only, through
    float64 matrix products: q [B, S, H, D], cache [B, T, D] float32 -> [len(seqs), S, H, DL] float64."""
    out = []
    for b in seqs:
        _, _, H, D = q.shape
        T = cache.shape[1]
        c = int(np.clip(past_len[b], 0, T))
        L = min(c + S, T)
        rows = cache[b, :L].astype(np.float64)
        sc = np.minimum(scale * (q[b].reshape(S * H, D).astype(np.float64) @ rows.T), np.finfo(np.float32).max)
        t = np.arange(L)
        vis = t[None, :] <= c + np.arange(S)[:, None]            # [S, L]: causal
        sc = np.where(np.repeat(vis, H, axis=0), sc, -np.inf)
        mx = sc.max(axis=1, keepdims=True)
        e = np.where(np.isfinite(sc), np.exp(sc - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
        den = e.sum(axis=1, keepdims=True)
        p = np.divide(e, den, out=np.zeros_like(e), where=den > 0)
        out.append((p @ rows[:, :DL]).reshape(S, H, DL))
    return np.stack(out)


def sparse_lists(rng, B: int, S: int, K: int, n: int, slab: int, copy: int) -> np.ndarray:
    """Index lists [B, S, K] for copy `copy` of a sparse-decode rotation: each token n distinct rows, ascending, drawn
    from the copy's own slab of rows copy * slab .. (copy + 1) * slab - 1 (so no call re-reads another's rows),
    then -1."""
    sel = np.full((B, S, K), -1, np.int32)
    for b in range(B):
        for s in range(S):
            sel[b, s, :n] = np.sort(rng.choice(slab, n, replace=False)) + copy * slab
    return sel


def device_info(rt, b: Bench) -> dict:
    dev = b.ck(rt.cudaGetDevice(), "cudaGetDevice")
    prop = b.ck(rt.cudaGetDeviceProperties(dev), "cudaGetDeviceProperties")
    name = prop.name.decode() if isinstance(prop.name, bytes) else str(prop.name)
    return {"name": name.strip("\x00"), "sm_count": int(prop.multiProcessorCount),
            "compute_capability": f"{prop.major}.{prop.minor}", "l2_bytes": int(prop.l2CacheSize),
            "global_mem_bytes": int(prop.totalGlobalMem)}


def copy_bandwidth(b: Bench, nbytes: int, iters: int, torch=None) -> tuple[float, str]:
    """(the device-to-device copy's GB/s counting bytes read and written, by what): the fastest of cudaMemcpyAsync
    captured in a CUDA graph, cudaMemcpyAsync launched on the stream (a graph's copy node can be much slower) and, where
    PyTorch has CUDA, its copy kernel: the strongest ceiling, so that the kernels' "% copy" does not flatter them."""
    src, dst = b.alloc(nbytes), b.alloc(nbytes)
    kind = b.rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
    copy = lambda i, s: b.ck(b.rt.cudaMemcpyAsync(dst, src, nbytes, kind, s), "cudaMemcpyAsync")  # noqa: E731
    best = max((2 * nbytes / (b.timed(copy, iters, graph=g) * 1e-3) / 1e9, f"cudaMemcpyAsync, {how}")
               for g, how in ((True, "CUDA graph"), (False, "stream launches")))
    b.free_all()
    if torch is not None:
        x, y = (torch.empty(nbytes // 4, dtype=torch.float32, device="cuda") for _ in range(2))
        gbps = 2 * nbytes / (torch_timed(torch, lambda i: y.copy_(x), iters) * 1e-3) / 1e9
        del x, y
        torch.cuda.empty_cache()
        best = max(best, (gbps, f"torch {torch.__version__} Tensor.copy_"))
    return best


def rates(row: dict, prefix: str, ms: float, nbytes: int, flops: int = 0) -> dict:
    """row + {prefix}_us, {prefix}_bytes, {prefix}_GBps (and _flops, _TFLOPS when flops) for a call of ms."""
    row |= {f"{prefix}_us": ms * 1e3, f"{prefix}_bytes": nbytes, f"{prefix}_GBps": nbytes / (ms * 1e-3) / 1e9}
    if flops:
        row |= {f"{prefix}_flops": flops, f"{prefix}_TFLOPS": flops / (ms * 1e-3) / 1e12}
    return row


# ---------------------------------------------------------------------------------------------------------------
# the plain PyTorch forms
# ---------------------------------------------------------------------------------------------------------------
def torch_cuda():
    """torch where it is installed with CUDA and sees a GPU, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def torch_timed(torch, fn, iters: int) -> float:
    """Milliseconds per call of fn(i), timed as Bench.timed (iters calls in one CUDA graph, median of replays)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            fn(i)
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    del graph
    torch.cuda.empty_cache()
    return statistics.median(times)


def torch_dtype(torch, dtype: str):
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def torch_mla_ms(torch, B: int, T: int, H: int, S: int, dtype: str, iters: int, rot: int) -> float:
    """The plain form of MLA decode: softmax(scale q K^T) in fp32, then P V with V the first 512 columns."""
    dt, gen = torch_dtype(torch, dtype), torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, S * H, DL + DR, device="cuda", dtype=dt, generator=gen)
    caches = [torch.randn(B, T, DL + DR, device="cuda", dtype=dt, generator=gen) for _ in range(rot)]
    scale = 1.0 / math.sqrt(192)

    def fn(i):
        kv = caches[i % rot]
        p = torch.softmax(torch.bmm(q, kv.transpose(1, 2)).float() * scale, dim=-1).to(dt)
        return torch.bmm(p, kv[..., :DL])

    return torch_timed(torch, fn, iters)


def torch_dsa_select_ms(torch, B: int, T: int, S: int, dtype: str, iters: int, rot: int) -> float:
    """The plain form of the indexer: ReLU(scale q K^T) in fp32, the weighted sum over heads, top-k, rows sorted."""
    dt, gen = torch_dtype(torch, dtype), torch.Generator(device="cuda").manual_seed(0)
    iq = torch.randn(B, S * HI, DI, device="cuda", dtype=dt, generator=gen)
    w = torch.rand(B, S, HI, 1, device="cuda", generator=gen)
    caches = [torch.randn(B, T, DL + DR + DI, device="cuda", dtype=dt, generator=gen) for _ in range(rot)]

    def fn(i):
        keys = caches[i % rot][..., DL + DR:]
        s = torch.relu(torch.bmm(iq, keys.transpose(1, 2)).float() * DI**-0.5).view(B, S, HI, T)
        return (s * w).sum(2).topk(min(TOPK, T), dim=-1, sorted=False).indices.sort(-1).values

    return torch_timed(torch, fn, iters)


# ---------------------------------------------------------------------------------------------------------------
# the kernels
# ---------------------------------------------------------------------------------------------------------------
def budget(info: dict) -> int:
    """Device memory the copies of one row's inputs may take: half the card (the kernels' own buffers and the
    PyTorch comparison need the rest)."""
    return int(info.get("global_mem_bytes", 1 << 40)) // 2


def mla_bytes(rows: int, B: int, S: int, H: int) -> tuple[int, int]:
    """(bytes one MLA decode call reads, bytes it moves in all): the visible cache rows (the new ones among them),
    the queries, the new rows (read and written by the commit), the output."""
    es, D = 2, DL + DR
    read = rows * D * es + B * S * H * D * es + B * S * D * es
    return read, read + B * S * D * es + B * S * H * DL * es


def mla_rotation(info: dict, B: int, T: int, H: int, S: int, lens, iters: int) -> Rotation:
    """Copies of MLA decode's inputs (cache, queries, new rows) for lengths `lens`: sized on the visible rows."""
    rows = int(np.minimum(np.asarray(lens, np.int64) + S, T).sum())
    return plan_rotation(info["l2_bytes"], mla_bytes(rows, B, S, H)[0],
                         (B * T * (DL + DR) + B * S * H * (DL + DR) + B * S * (DL + DR)) * 2, iters, budget(info))


def bench_mla(b: Bench, lib, info: dict, B: int, T: int, H: int, S: int, dtype: str, iters: int, flags: int,
              ragged: bool = True, torch=None, splits: int | None = None) -> dict:
    """One row of the MLA table: the decode with its KV commit (the S new rows written first, as the runtime calls
    it), checked once against the reference, then timed over copies sized on the rows the lengths make it read."""
    es, D = 2, DL + DR
    lens = b.past_lengths(B, T, S, ragged)
    rows = int(np.minimum(lens.astype(np.int64) + S, T).sum())
    read, moved = mla_bytes(rows, B, S, H)
    rot = mla_rotation(info, B, T, H, S, lens, iters)
    r = {"B": B, "T": T, "H": H, "S": S, "ragged": ragged, "rows": rows, "copies": rot.copies,
         "l2_ratio": rot.l2_ratio, "bytes": moved, "flops": 2 * S * H * rows * (D + DL)}
    cache_h, caches = b.filled(rot.copies, B * T * D, dtype)
    q_h, qs = b.filled(rot.copies, B * S * H * D, dtype)
    new_h, news = b.filled(rot.copies, B * S * D, dtype)
    out = b.alloc(B * S * H * DL * es)
    d_len = b.upload(lens)
    ns = splits or lib.mla_decode_num_splits(B, S, H, T, info["sm_count"])
    ws_bytes = lib.mla_decode_workspace_size(B, S, H, DL, ns)
    ws = b.alloc(ws_bytes) if ws_bytes else 0
    scale = 1.0 / math.sqrt(192)
    r["splits"] = ns

    def launch(i, stream):
        k = i % rot.copies
        lib.mla_decode(dtype, qs[k], caches[k], d_len, news[k], 0, out, ws, ws_bytes, B, S, H, DL, DR, T, scale, ns,
                       flags, stream)

    launch(0, 0)
    b.sync("mtp_mla_decode")
    seqs = check_seqs(B, lens)
    got = decode(b.download(out, (B, S, H, DL), np.uint16), dtype)[seqs]
    cache = ref.mla_kv_commit(decode(cache_h, dtype).reshape(B, T, D), lens, decode(new_h, dtype).reshape(B, S, D))
    want = mla_expected(decode(q_h, dtype).reshape(B, S, H, D), cache, lens, S, scale, seqs)
    if why := mismatch(got, want, TOL[dtype]):
        b.free_all()
        return r | {"mismatch": f"sequences {seqs}: {why}"}
    ms = b.timed(launch, rot.calls)
    b.free_all()
    r |= {"graph": b.graphed, "time_us": ms * 1e3, "GBps": moved / (ms * 1e-3) / 1e9,
          "TFLOPS": r["flops"] / (ms * 1e-3) / 1e12}
    if torch is not None and not ragged:
        r["torch_us"] = torch_mla_ms(torch, B, T, H, S, dtype, rot.calls, rot.copies) * 1e3
        r["x_torch"] = r["torch_us"] / r["time_us"]
    return r


HI, DI, TOPK, H_DSA = 64, 128, 2048, 128
DSA_BT = [(1, 4096), (1, 32768), (1, 131072), (8, 32768), (32, 8192)]
QUICK_DSA_BT = [(1, 32768), (1, 131072), (8, 32768)]


def select_expected(iq, w, keys, lens, S: int, seqs) -> tuple[np.ndarray, np.ndarray]:
    """reference.dsa_select (causal) for sequences `seqs`, scores through float64 matrix products: iq [B, S, HI, DI],
    w [B, S, HI], keys [B, T, DI] float32 -> (selected [n, S, TOPK], scores [n, S, T] NaN-padded)."""
    T = keys.shape[1]
    sel = np.full((len(seqs), S, TOPK), -1, np.int32)
    scores = np.full((len(seqs), S, T), np.nan)
    for j, b in enumerate(seqs):
        c = int(np.clip(lens[b], 0, T))
        L = min(c + S, T)
        kb = keys[b, :L].astype(np.float64)
        for s in range(S):
            qk = np.maximum(iq[b, s].astype(np.float64) @ kb.T * DI**-0.5, 0.0)          # [HI, L]
            sc = (w[b, s].astype(np.float64) @ qk).astype(np.float32)                    # the kernel's are fp32
            sel[j, s] = ref.topk_rows(sc, np.arange(L) <= c + s, TOPK)
            scores[j, s, :L] = sc
    return sel, scores


def select_rotation(info: dict, B: int, T: int, S: int, lens, iters: int) -> Rotation:
    """Copies of the indexer's inputs (rows of C values, queries, weights): sized on the keys of the visible rows
    (DI of the row's C values) and the queries and weights, not on the whole rows."""
    es, C = 2, DL + DR + DI
    rows = int(np.minimum(np.asarray(lens, np.int64) + S, T).sum())
    small = B * S * HI * DI * es + B * S * HI * 4
    return plan_rotation(info["l2_bytes"], rows * DI * es + small, B * T * C * es + small, iters, budget(info))


def sparse_rotation(info: dict, B: int, S: int, H: int, distinct: int, slab: int, iters: int) -> Rotation:
    """Copies of sparse MLA's index lists, each naming rows of a slab of `slab` rows per sequence of its own: sized
    on the distinct rows one call's lists name (their latent values), the queries and the lists."""
    es, D, C = 2, DL + DR, DL + DR + DI
    sel_bytes = B * S * TOPK * 4
    return plan_rotation(info["l2_bytes"], distinct * D * es + B * S * H * D * es + sel_bytes,
                         B * slab * C * es + sel_bytes, iters, budget(info))


def bench_dsa(b: Bench, lib, info: dict, B: int, T: int, H: int, S: int, dtype: str, iters: int,
              ragged: bool = True, torch=None) -> dict:
    """One row of the DSA table: the selection (copies sized on the keys it reads, not on whole rows) and sparse MLA
    over lists of fresh rows on every call (each copy's lists name rows of a slab of their own), each checked once
    against the reference before it is timed."""
    es, D, C = 2, DL + DR, DL + DR + DI
    lens = b.past_lengths(B, T, S, ragged)
    rows = int(np.minimum(lens.astype(np.int64) + S, T).sum())  # visible rows of the sequences' last tokens
    r = {"B": B, "T": T, "H": H, "S": S, "topk": TOPK, "ragged": ragged, "rows": rows}

    # ---- the selection: reads each visible row's key (DI values of the C-value row), the queries and weights
    sel_bytes = B * S * TOPK * 4
    rot = select_rotation(info, B, T, S, lens, iters)
    select_read = rot.read_bytes
    r |= {"select_copies": rot.copies, "select_l2_ratio": rot.l2_ratio}
    cache_h, caches = b.filled(rot.copies, B * T * C, dtype)
    iq_h, iqs = b.filled(rot.copies, B * S * HI * DI, dtype)
    w_h, ws_ = b.filled(rot.copies, B * S * HI, "float32", positive=True)
    d_len = b.upload(lens)
    sel = b.alloc(sel_bytes)
    sel_ws_bytes = lib.dsa_select_workspace_size(B, S, T)
    sel_ws = b.alloc(sel_ws_bytes)

    def select(i, stream):
        k = i % rot.copies
        lib.dsa_select(dtype, iqs[k], ws_[k], caches[k], d_len, 0, sel, sel_ws, sel_ws_bytes, B, S, HI, DI, C, D, T,
                       TOPK, DI**-0.5, stream)

    select(0, 0)
    b.sync("mtp_dsa_select")
    seqs = check_seqs(B, lens)
    got = b.download(sel, (B, S, TOPK), np.int32)[seqs]
    keys = decode(cache_h, dtype).reshape(B, T, C)[:, :, D:]
    want, scores = select_expected(decode(iq_h, dtype).reshape(B, S, HI, DI), w_h.reshape(B, S, HI), keys, lens, S,
                                   seqs)
    ok, why = ref.selections_agree(got, want, scores, rtol=1e-5 * HI)
    if not ok:
        r["select_mismatch"] = f"sequences {seqs}: {why}"
    else:
        rates(r, "select", b.timed(select, rot.calls), select_read + sel_bytes, 2 * S * rows * HI * DI)
    b.free_all()
    if torch is not None and not ragged and "select_us" in r:
        r["select_torch_us"] = torch_dsa_select_ms(torch, B, T, S, dtype, rot.calls, rot.copies) * 1e3
        r["select_x_torch"] = r["select_torch_us"] / r["select_us"]

    # ---- sparse MLA: n = min(TOPK, T) listed rows per token (what a selection over T rows names); the rows of each
    # call's lists are fresh: copy k's lists draw from rows k * slab .. (k + 1) * slab - 1 of a longer cache
    n, slab = min(TOPK, T), 2 * min(TOPK, T)
    q_bytes, out_bytes = B * S * H * D * es, B * S * H * DL * es
    lists0 = sparse_lists(b.rng, B, S, TOPK, n, slab, 0)
    distinct = sum(len(np.unique(lists0[bb][lists0[bb] >= 0])) for bb in range(B))  # rows one call reads
    rot = sparse_rotation(info, B, S, H, distinct, slab, iters)
    attend_read = rot.read_bytes
    r |= {"attend_rows": distinct, "attend_copies": rot.copies, "attend_l2_ratio": rot.l2_ratio}
    T_sp = rot.copies * slab
    slab_h = b.values(B * slab * C, dtype).reshape(B, slab, C)
    cache = b.alloc(B * T_sp * C * es)
    for bb in range(B):
        for k in range(rot.copies):
            b.upload(slab_h[bb], cache + ((bb * T_sp) + k * slab) * C * es)
    lists = [b.upload(lists0)] + [b.upload(sparse_lists(b.rng, B, S, TOPK, n, slab, k)) for k in range(1, rot.copies)]
    q_h, (q,) = b.filled(1, B * S * H * D, dtype)
    zeros = b.upload(np.zeros(B, np.int32))
    out = b.alloc(out_bytes)
    ns = lib.mla_decode_num_splits(B * S, 1, H, TOPK, info["sm_count"])
    ws_bytes = lib.mla_decode_workspace_size(B * S, 1, H, DL, ns)
    ws = b.alloc(ws_bytes) if ws_bytes else 0
    r["splits"] = ns
    scale = 1.0 / math.sqrt(192)

    def attend(i, stream):
        lib.mla_sparse_decode(dtype, q, cache, zeros, 0, lists[i % rot.copies], out, ws, ws_bytes, B, S, H, DL, DR, C,
                              T_sp, TOPK, scale, ns, 0, stream)

    attend(0, 0)
    b.sync("mtp_mla_sparse_decode")
    got = decode(b.download(out, (B, S, H, DL), np.uint16), dtype)[seqs]
    want, _ = ref.mla_sparse_decode(decode(q_h, dtype).reshape(B, S, H, D)[seqs], decode(slab_h, dtype)[seqs],
                                    np.zeros(len(seqs), np.int32), lists0[seqs], dl=DL, scale=scale)
    if why := mismatch(got, want, TOL[dtype]):
        r["attend_mismatch"] = f"sequences {seqs}: {why}"
    else:
        rates(r, "attend", b.timed(attend, rot.calls), attend_read + out_bytes, 2 * B * S * H * n * (D + DL))
    b.free_all()
    return r


V_ACCEPT, K_ACCEPT = 129280, 3
ACCEPT_B = [1, 8, 64]


def accept_rotation(info: dict, B: int, K: int, V: int, iters: int) -> Rotation:
    """Copies of the acceptance inputs (logits, p, q): sized on the fewest bytes any of the three kernels reads
    (rejection sampling's p and q rows: 2 V values per sequence), so they serve all three."""
    return plan_rotation(info["l2_bytes"], B * 2 * V * 2, (B * (K + 1) * V * 2 + B * K * V) * 2, iters, budget(info))


def bench_accept(b: Bench, lib, info: dict, B: int, K: int, V: int, dtype: str, iters: int) -> dict:
    """One row of the acceptance table: strict and relaxed acceptance (read every logits row) and rejection
    sampling (reads the p and q rows it samples from), each checked once against the reference (exactly) first."""
    es = 2
    rot = accept_rotation(info, B, K, V, iters)
    read = rot.read_bytes
    r = {"B": B, "K": K, "V": V, "copies": rot.copies, "l2_ratio": rot.l2_ratio}
    logits_h, logits = b.filled(rot.copies, B * (K + 1) * V, dtype)
    p_h, ps = b.filled(rot.copies, B * (K + 1) * V, dtype, positive=True)
    q_h, qs = b.filled(rot.copies, B * K * V, dtype, positive=True)
    drafts_h = b.rng.integers(0, V, (B, K)).astype(np.int32)
    uniforms_h = b.rng.random((B, K + 1)).astype(np.float32)
    drafts, uniforms = b.upload(drafts_h), b.upload(uniforms_h)
    thinking = b.upload(np.ones(B, np.int32))
    topk, delta = b.upload(np.array(10, np.int32)), b.upload(np.array(0.1, np.float32))
    toks, num, last, th_out = b.alloc(B * (K + 1) * 4), b.alloc(B * 4), b.alloc(B * 4), b.alloc(B * 4)
    lg = decode(logits_h, dtype).reshape(B, K + 1, V)

    def strict(i, stream):
        lib.accept_strict(dtype, logits[i % rot.copies], 0, drafts, toks, num, last, B, K, V, stream)

    def relaxed(i, stream):
        lib.accept_relaxed_dev(dtype, logits[i % rot.copies], drafts, K, thinking, th_out, toks, num, 0, B, K, V,
                               topk, delta, 1, 2, stream)

    def rejection(i, stream):
        lib.accept_rejection(dtype, ps[i % rot.copies], qs[i % rot.copies], drafts, uniforms, toks, num, last, B, K,
                             V, stream)

    expected = {
        "strict": lambda: ref.accept_strict(drafts_h, logits=lg)[:2],
        "relaxed": lambda: ref.accept_relaxed_dev(lg, drafts_h.reshape(-1), K, np.ones(B, np.int32), topk=10,
                                                  delta=0.1, think_start_id=1, think_end_id=2)[:2],
        "rejection": lambda: ref.accept_rejection(decode(p_h, dtype).reshape(B, K + 1, V),
                                                  decode(q_h, dtype).reshape(B, K, V), drafts_h, uniforms_h)[:2],
    }
    for name, fn, nbytes in [("strict", strict, B * (K + 1) * V * es), ("relaxed", relaxed, B * (K + 1) * V * es),
                             ("rejection", rejection, read)]:
        fn(0, 0)
        b.sync(f"acceptance ({name})")
        got = (b.download(toks, (B, K + 1), np.int32), b.download(num, (B,), np.int32))
        want_toks, want_num = expected[name]()
        if not (np.array_equal(got[0], want_toks) and np.array_equal(got[1], want_num)):
            bad = int(np.flatnonzero((got[0] != want_toks).any(1) | (got[1] != want_num))[0])
            r[f"{name}_mismatch"] = (f"sequence {bad}: tokens {got[0][bad].tolist()} accepted {int(got[1][bad])}, "
                                     f"want {want_toks[bad].tolist()} accepted {int(want_num[bad])}")
        else:
            rates(r, name, b.timed(fn, rot.calls), nbytes)
    b.free_all()
    return r


def fmt_x(row: dict, key: str) -> str:
    return f"{row[key]:>7.2f}x" if key in row else f"{'-':>8}"


def mla_line(r: dict) -> str:
    """A row of the MLA table: the figures, or the check that stopped it."""
    head = f"{r['B']:>4} {r['T']:>7} {r['B'] * r['T']:>7} {r['H']:>4} {r['S']:>2} {r['splits']:>6} {r['l2_ratio']:>5.1f}"
    if "mismatch" in r:
        return f"{head}  OUTPUT MISMATCH, not timed: {r['mismatch']}"
    torch_us = f"{r['torch_us']:>9.1f}" if "torch_us" in r else f"{'-':>9}"
    return (f"{head} {r['time_us']:>9.1f} {r['GBps']:>7.0f} {r['pct_copy']:>6.1f}% {r['TFLOPS']:>7.1f} {torch_us} "
            f"{fmt_x(r, 'x_torch')}{'' if r.get('graph', True) else '  (stream launches)'}")


def dsa_line(r: dict, copy_gbps: float) -> str:
    def part(name: str, torch: bool) -> str:
        if f"{name}_mismatch" in r:
            return f"MISMATCH, not timed: {r[name + '_mismatch']}"
        x = f" {fmt_x(r, name + '_x_torch')}" if torch else ""
        return (f"{r[name + '_us']:>10.1f} {r[name + '_GBps']:>6.0f} {100 * r[name + '_GBps'] / copy_gbps:>6.1f}% "
                f"{r[name + '_TFLOPS']:>7.1f}{x} {r[name + '_l2_ratio']:>5.1f}")

    return f"{r['B']:>4} {r['T']:>7} {r['S']:>2} {part('select', True)} | {part('attend', False)}"


def accept_line(r: dict, copy_gbps: float) -> str:
    def part(name: str) -> str:
        if f"{name}_mismatch" in r:
            return f"MISMATCH, not timed: {r[name + '_mismatch']}"
        return f"{r[name + '_us']:>10.1f} {r[name + '_GBps']:>6.0f} {100 * r[name + '_GBps'] / copy_gbps:>6.1f}%"

    return f"{r['B']:>4} {r['l2_ratio']:>5.1f} {part('strict')} | {part('relaxed')} | {part('rejection')}"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mtp_trt.plugins.bench_kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--heads", default="128,16", help="comma-separated H values (default 128,16)")
    ap.add_argument("--seq", default="1,2,4", help="comma-separated S values (default 1,2,4)")
    ap.add_argument("--iters", type=int, default=30,
                    help="calls per timed CUDA graph, at least (rounded up to whole cycles through the copies)")
    ap.add_argument("--quick", action="store_true", help="fewer (B, T) shapes")
    lengths = ap.add_mutually_exclusive_group()
    lengths.add_argument("--ragged", dest="uniform", action="store_false",
                         help="cached rows per sequence uniform in 0 .. T - S (the default)")
    lengths.add_argument("--uniform", dest="uniform", action="store_true",
                         help="every sequence at T - S cached rows (the PyTorch comparison needs this)")
    ap.set_defaults(uniform=False)
    ap.add_argument("--data", choices=["random", "constant"], default="random",
                    help="random values (default) or one constant (every indexer score ties)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparisons")
    ap.add_argument("--simt", action="store_true", help="force the SIMT attention path")
    ap.add_argument("--force-v2", action="store_true", help="MLA decode on v2 where v3 (Hopper) would serve it")
    ap.add_argument("--seesaw", action="store_true", help="MLA decode's dense launches on v3's seesaw schedule "
                    "(Hopper)")
    ap.add_argument("--shapes", metavar="BxT,...", help="only these (batch, cache) shapes of the MLA table, e.g. 64x4096")
    ap.add_argument("--mla-only", action="store_true", help="only the MLA decode table")
    ap.add_argument("--splits", metavar="N,...", help="MLA decode rows at these KV split counts instead of the "
                    "library's choice (a sweep of its rule)")
    ap.add_argument("--single-stage", action="store_true", help="no cp.async double buffering")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    ragged = not args.uniform

    try:
        rt = cuda_lib.import_cudart()
        err, count = rt.cudaGetDeviceCount()
        if int(err) != 0 or count == 0:
            raise RuntimeError("no NVIDIA GPU is visible to the CUDA runtime")
    except Exception as e:  # noqa: BLE001 - report any reason plainly
        print(f"bench_kernels: needs an NVIDIA GPU and cuda-python: {e}", file=sys.stderr)
        return 2

    b = Bench(rt, seed=args.seed, data=args.data)
    info = device_info(rt, b)
    lib = cuda_lib.load_library()
    torch = None if args.no_torch else torch_cuda()
    dtype = {"bf16": "bfloat16", "fp16": "float16"}[args.dtype]
    flags = (cuda_lib.MLA_FORCE_SIMT if args.simt else 0) | (cuda_lib.MLA_SINGLE_STAGE if args.single_stage else 0) | \
        (cuda_lib.MLA_FORCE_V2 if args.force_v2 else 0) | (cuda_lib.MLA_SEESAW if args.seesaw else 0)
    shapes = QUICK_BT if args.quick else CONFIGS_BT
    if args.shapes:
        shapes = [tuple(int(v) for v in bt.lower().split("x")) for bt in args.shapes.split(",")]
    copy_bytes = min(1 << 30, info["global_mem_bytes"] // 8)
    copy_gbps, copy_by = copy_bandwidth(b, copy_bytes, 20, torch)
    print(f"device: {info['name']} (sm_{info['compute_capability'].replace('.', '')}, {info['sm_count']} SMs, "
          f"L2 {info['l2_bytes'] >> 20} MiB)")
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write, {copy_bytes >> 20} MiB, {copy_by})")
    print(f"data: {args.data} (seed {args.seed}); lengths: {'ragged' if ragged else 'T - S each'}; timing: at least "
          f"{args.iters} calls per CUDA graph over copies of the inputs (L2x: bytes read between two uses of a copy "
          f"over L2), median of {REPLAYS} replays; every output checked against the reference once first; PyTorch: "
          f"{'torch ' + torch.__version__ if torch is not None and not ragged else 'not compared'}")
    hopper = info["compute_capability"] == "9.0"
    path = "SIMT" if args.simt else "v2 forced" if args.force_v2 else ("v3 seesaw" if args.seesaw else "v3") if hopper \
        else "v2"
    print(f"mtp_mla_decode with its KV commit, {dtype}, Dl={DL} Dr={DR}, {path}"
          f"{' single-stage' if args.single_stage else ''}:")
    hdr = (f"{'B':>4} {'T':>7} {'B*T':>7} {'H':>4} {'S':>2} {'splits':>6} {'L2x':>5} {'time us':>9} {'GB/s':>7} "
           f"{'% copy':>7} {'TFLOPS':>7} {'torch us':>9} {'vs torch':>8}")
    print(hdr)
    print("-" * len(hdr))
    results = []
    sweep = [int(x) for x in args.splits.split(",")] if args.splits else [None]
    for H in [int(x) for x in args.heads.split(",")]:
        for S in [int(x) for x in args.seq.split(",")]:
            for (B, T), splits in itertools.product(shapes, sweep):
                if B * T * (DL + DR) * 2 * 2 > info["global_mem_bytes"] * 0.8:
                    continue
                r = bench_mla(b, lib, info, B, T, H, S, dtype, args.iters, flags, ragged, torch, splits)
                if "GBps" in r:
                    r["pct_copy"] = 100.0 * r["GBps"] / copy_gbps
                results.append(r)
                print(mla_line(r), flush=True)
    if args.mla_only:
        return finish(args, b, info, dtype, flags, ragged, torch, copy_gbps, results, [], [])
    print(f"DeepSeek Sparse Attention {dtype}: mtp_dsa_select ({HI} heads x {DI}, top {TOPK}) | "
          f"mtp_mla_sparse_decode over {TOPK} fresh rows per token (H={H_DSA}, Dl={DL} Dr={DR}):")
    hdr = (f"{'B':>4} {'T':>7} {'S':>2} {'select us':>10} {'GB/s':>6} {'% copy':>7} {'TFLOPS':>7} {'vs torch':>8} "
           f"{'L2x':>5} | {'attend us':>10} {'GB/s':>6} {'% copy':>7} {'TFLOPS':>7} {'L2x':>5}")
    print(hdr)
    print("-" * len(hdr))
    dsa = []
    for S in [int(x) for x in args.seq.split(",")]:
        for B, T in QUICK_DSA_BT if args.quick else DSA_BT:
            if B * T * (DL + DR + DI) * 2 * 2 + B * S * T * 4 > info["global_mem_bytes"] * 0.8:
                continue
            r = bench_dsa(b, lib, info, B, T, H_DSA, S, dtype, args.iters, ragged, torch)
            dsa.append(r)
            print(dsa_line(r, copy_gbps), flush=True)
    print(f"acceptance {dtype}, K={K_ACCEPT} drafts, V={V_ACCEPT}:")
    hdr = (f"{'B':>4} {'L2x':>5} {'strict us':>10} {'GB/s':>6} {'% copy':>7} | {'relaxed us':>10} {'GB/s':>6} "
           f"{'% copy':>7} | {'rejection us':>10} {'GB/s':>6} {'% copy':>7}")
    print(hdr)
    print("-" * len(hdr))
    accept = []
    for B in ACCEPT_B:
        r = bench_accept(b, lib, info, B, K_ACCEPT, V_ACCEPT, dtype, args.iters)
        accept.append(r)
        print(accept_line(r, copy_gbps), flush=True)
    return finish(args, b, info, dtype, flags, ragged, torch, copy_gbps, results, dsa, accept)


def finish(args, b, info, dtype, flags, ragged, torch, copy_gbps, results, dsa, accept) -> int:
    mismatches = sum(any(k.endswith("mismatch") for k in r) for r in results + dsa + accept)
    if mismatches:
        print(f"{mismatches} row(s) with an output that does not match the reference: those kernels were not timed")
    for why, n in b.ungraphed.items():
        print(f"{n} timing(s) on back-to-back stream launches, not one CUDA graph (host time included), because: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": info, "dtype": dtype, "flags": flags, "data": args.data, "seed": args.seed,
                       "ragged": ragged, "iters": args.iters, "torch": torch.__version__ if torch else None,
                       "copy_GBps": copy_gbps, "mla_decode": results, "dsa": dsa, "accept": accept,
                       "mismatches": mismatches, "ungraphed": b.ungraphed}, f, indent=2)
        print(f"wrote {args.json}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
