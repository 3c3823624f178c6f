"""Benchmark of the CUDA kernels against the GPU's copy bandwidth and the plain PyTorch form.

    python -m mtp_trt.plugins.bench_kernels [--dtype bf16] [--quick] [--ragged] [--data constant] [--json FILE]

Timing: each measured call is captured --iters times into one CUDA graph (the launches run back to back, as in the
runtime's CUDA graphs, and no host time is counted), cycling through several copies of its inputs so that the
working set exceeds L2 and every launch streams from memory; the graph is replayed 5 times between CUDA events and
the median per call is reported.  Where a stream cannot be captured, back-to-back launches on a stream are timed
instead.  Data: random values of magnitude 0.5 .. 1 with random signs (seeded, --seed), so scores are distinct as
in real use; --data constant fills every buffer with one value (every indexer score ties: top-k's worst case).
Lengths: every sequence at T - S cached rows, or with --ragged uniform in 0 .. T - S (seeded).  Bytes are the
minimum any implementation must move (the rows read, the queries, the outputs); FLOPs count multiply-adds as 2.

1. Device-to-device copy bandwidth: cudaMemcpyAsync of a large buffer, read + write bytes.
2. mtp_mla_decode on DeepSeek-V3 shapes (Dl 512, Dr 64; H = 128 and 16; S = 1, 2, 4; B x T from 4k to 256k cached
   rows): time, GB/s, % of the copy bandwidth, TFLOPS (2 S H L (576 + 512) per sequence of L rows), and the ratio
   to the plain PyTorch form where torch has CUDA (bmm of q [B, S H, 576] with the cache, fp32 softmax, bmm with
   its first 512 columns; every T rows; not with --ragged).
3. DeepSeek Sparse Attention (DeepSeek-V3.2's shapes: 64 indexer heads of 128, index_topk 2048, rows of 576 latent
   values and a 128-value key; H = 128): mtp_dsa_select (bytes: the visible rows' keys, the queries and weights,
   the selection; FLOPs 2 S L 64 128; against torch: bmm, ReLU, the weighted head sum, topk and a sort) and
   mtp_mla_sparse_decode over the 2048 selected rows (bytes: the selected latent rows, q, out).
4. Acceptance of K = 3 drafts over V = 129280 (DeepSeek-V3's vocabulary): mtp_accept_strict and
   mtp_accept_relaxed_dev (bytes: every logits row) and mtp_accept_rejection (bytes: the p and q rows it samples
   from).

Needs cuda-python and an NVIDIA GPU (exits with a message otherwise); builds the kernels with nvcc on first use
(see cuda_lib).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import numpy as np

from mtp_trt.plugins import cuda_lib

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

    def filled(self, count: int, n: int, dtype: str, *, positive: bool = False) -> list[int]:
        """`count` device buffers holding the same n random values of `dtype`."""
        host = self.values(n, dtype, positive=positive)
        return [self.upload(host) for _ in range(count)]

    def past_lengths(self, B: int, T: int, S: int, ragged: bool) -> np.ndarray:
        """past_len [B]: T - S each, or uniform in 0 .. T - S (ragged)."""
        if not ragged:
            return np.full(B, T - S, np.int32)
        return self.rng.integers(0, T - S + 1, B).astype(np.int32)

    def stream(self) -> int:
        if self._stream is None:
            self._stream = self.ck(self.rt.cudaStreamCreateWithFlags(self.rt.cudaStreamNonBlocking), "stream")
        return int(self._stream)

    def timed(self, fn, iters: int, warmup: int = 3) -> float:
        """Milliseconds per call of fn(i, stream) (i = 0, 1, ...): iters calls captured into one CUDA graph, replayed
        REPLAYS times between events, the median; back-to-back stream launches where capture fails."""
        rt, stream = self.rt, self.stream()
        for i in range(warmup):
            fn(i, stream)
        self.ck(rt.cudaStreamSynchronize(stream), "sync")
        graph = None
        try:
            self.ck(rt.cudaStreamBeginCapture(stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
                    "capture")
            try:
                for i in range(iters):
                    fn(i, stream)
            finally:
                graph = self.ck(rt.cudaStreamEndCapture(stream), "end capture")
            launch = self.ck(rt.cudaGraphInstantiate(graph, 0), "instantiate")
            run = lambda: self.ck(rt.cudaGraphLaunch(launch, stream), "graph launch")  # noqa: E731
        except (RuntimeError, cuda_lib.CudaKernelError):  # a launch refused inside the capture, or the capture itself
            rt.cudaGetLastError()
            launch = None

            def run():
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
        if graph is not None:
            rt.cudaGraphDestroy(graph)
        return statistics.median(times)


def rotation(info: dict, nbytes: int, most: int = 16) -> int:
    """Copies of a buffer of nbytes to cycle through so that they exceed L2 three times (at most `most`)."""
    return max(1, min(most, math.ceil(3 * info["l2_bytes"] / max(nbytes, 1))))


def device_info(rt, b: Bench) -> dict:
    dev = b.ck(rt.cudaGetDevice(), "cudaGetDevice")
    prop = b.ck(rt.cudaGetDeviceProperties(dev), "cudaGetDeviceProperties")
    name = prop.name.decode() if isinstance(prop.name, bytes) else str(prop.name)
    return {"name": name.strip("\x00"), "sm_count": int(prop.multiProcessorCount),
            "compute_capability": f"{prop.major}.{prop.minor}", "l2_bytes": int(prop.l2CacheSize),
            "global_mem_bytes": int(prop.totalGlobalMem)}


def copy_bandwidth(b: Bench, nbytes: int, iters: int) -> float:
    src, dst = b.alloc(nbytes), b.alloc(nbytes)
    kind = b.rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
    ms = b.timed(lambda i, s: b.ck(b.rt.cudaMemcpyAsync(dst, src, nbytes, kind, s), "cudaMemcpyAsync"), iters)
    b.free_all()
    return 2 * nbytes / (ms * 1e-3) / 1e9


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
def bench_mla(b: Bench, lib, info: dict, B: int, T: int, H: int, S: int, dtype: str, iters: int, flags: int,
              ragged: bool = False, torch=None) -> dict:
    es, D = 2, DL + DR
    cache_bytes = B * T * D * es
    rot = rotation(info, cache_bytes)
    caches = b.filled(rot, B * T * D, dtype)
    q_bytes, out_bytes = B * S * H * D * es, B * S * H * DL * es
    qs = b.filled(rot, B * S * H * D, dtype)
    out = b.alloc(out_bytes)
    lens = b.past_lengths(B, T, S, ragged)
    d_len = b.upload(lens)
    ns = lib.mla_decode_num_splits(B, S, H, T, info["sm_count"])
    ws_bytes = lib.mla_decode_workspace_size(B, S, H, DL, ns)
    ws = b.alloc(ws_bytes) if ws_bytes else 0
    scale = 1.0 / math.sqrt(192)

    def launch(i, stream):
        k = i % rot
        lib.mla_decode(dtype, qs[k], caches[k], d_len, 0, 0, out, ws, ws_bytes, B, S, H, DL, DR, T, scale, ns, flags,
                       stream)

    ms = b.timed(launch, iters)
    b.free_all()
    rows = int((lens.astype(np.int64) + S).sum())
    moved = rows * D * es + q_bytes + out_bytes
    r = {"B": B, "T": T, "H": H, "S": S, "ragged": ragged, "rows": rows, "splits": ns, "time_us": ms * 1e3,
         "bytes": moved, "GBps": moved / (ms * 1e-3) / 1e9, "flops": 2 * S * H * rows * (D + DL)}
    r["TFLOPS"] = r["flops"] / (ms * 1e-3) / 1e12
    if torch is not None and not ragged:
        r["torch_us"] = torch_mla_ms(torch, B, T, H, S, dtype, iters, rot) * 1e3
        r["x_torch"] = r["torch_us"] / r["time_us"]
    return r


HI, DI, TOPK, H_DSA = 64, 128, 2048, 128
DSA_BT = [(1, 4096), (1, 32768), (1, 131072), (8, 32768), (32, 8192)]
QUICK_DSA_BT = [(1, 32768), (1, 131072), (8, 32768)]


def bench_dsa(b: Bench, lib, info: dict, B: int, T: int, H: int, S: int, dtype: str, iters: int,
              ragged: bool = False, torch=None) -> dict:
    es, D, C = 2, DL + DR, DL + DR + DI
    rot = rotation(info, B * T * C * es, most=8)
    caches = b.filled(rot, B * T * C, dtype)
    iq_bytes, w_bytes = B * S * HI * DI * es, B * S * HI * 4
    q_bytes, out_bytes = B * S * H * D * es, B * S * H * DL * es
    iq = b.filled(1, B * S * HI * DI, dtype)[0]
    w = b.filled(1, B * S * HI, "float32", positive=True)[0]
    q = b.filled(1, B * S * H * D, dtype)[0]
    out = b.alloc(out_bytes)
    lens = b.past_lengths(B, T, S, ragged)
    d_len = b.upload(lens)
    sel = b.alloc(B * S * TOPK * 4)
    sel_ws_bytes = lib.dsa_select_workspace_size(B, S, T)
    sel_ws = b.alloc(sel_ws_bytes)
    ns = lib.mla_decode_num_splits(B * S, 1, H, TOPK, info["sm_count"])
    ws_bytes = lib.mla_decode_workspace_size(B * S, 1, H, DL, ns)
    ws = b.alloc(ws_bytes) if ws_bytes else 0

    def select(i, stream):
        lib.dsa_select(dtype, iq, w, caches[i % rot], d_len, 0, sel, sel_ws, sel_ws_bytes, B, S, HI, DI, C, D, T,
                       TOPK, DI**-0.5, stream)

    select_ms = b.timed(select, iters)  # leaves a valid selection in `sel` for the attention below

    def attend(i, stream):
        lib.mla_sparse_decode(dtype, q, caches[i % rot], d_len, 0, sel, out, ws, ws_bytes, B, S, H, DL, DR, C, T,
                              TOPK, 1.0 / math.sqrt(192), ns, 0, stream)

    attend_ms = b.timed(attend, iters)
    b.free_all()
    rows = int((lens.astype(np.int64) + S).sum())  # visible rows of the sequences' last tokens
    r = {"B": B, "T": T, "H": H, "S": S, "topk": TOPK, "ragged": ragged, "rows": rows, "splits": ns}
    rates(r, "select", select_ms, rows * DI * es + iq_bytes + w_bytes + B * S * TOPK * 4, 2 * S * rows * HI * DI)
    rates(r, "attend", attend_ms, B * S * min(TOPK, T) * D * es + q_bytes + out_bytes,
          2 * B * S * H * min(TOPK, T) * (D + DL))
    if torch is not None and not ragged:
        r["select_torch_us"] = torch_dsa_select_ms(torch, B, T, S, dtype, iters, rot) * 1e3
        r["select_x_torch"] = r["select_torch_us"] / r["select_us"]
    return r


V_ACCEPT, K_ACCEPT = 129280, 3
ACCEPT_B = [1, 8, 64]


def bench_accept(b: Bench, lib, info: dict, B: int, K: int, V: int, dtype: str, iters: int) -> dict:
    es = 2
    rot = rotation(info, B * (K + 1) * V * es)
    logits = b.filled(rot, B * (K + 1) * V, dtype)
    ps = b.filled(rot, B * (K + 1) * V, dtype, positive=True)
    qs = b.filled(rot, B * K * V, dtype, positive=True)
    drafts = b.upload(b.rng.integers(0, V, (B, K)).astype(np.int32))
    uniforms = b.upload(b.rng.random((B, K + 1)).astype(np.float32))
    thinking = b.upload(np.ones(B, np.int32))
    topk, delta = b.upload(np.array(10, np.int32)), b.upload(np.array(0.1, np.float32))
    toks, num, last, th_out = b.alloc(B * (K + 1) * 4), b.alloc(B * 4), b.alloc(B * 4), b.alloc(B * 4)

    def strict(i, stream):
        lib.accept_strict(dtype, logits[i % rot], 0, drafts, toks, num, last, B, K, V, stream)

    def relaxed(i, stream):
        lib.accept_relaxed_dev(dtype, logits[i % rot], drafts, K, thinking, th_out, toks, num, 0, B, K, V, topk,
                               delta, 1, 2, stream)

    def rejection(i, stream):
        lib.accept_rejection(dtype, ps[i % rot], qs[i % rot], drafts, uniforms, toks, num, last, B, K, V, stream)

    r = {"B": B, "K": K, "V": V}
    rates(r, "strict", b.timed(strict, iters), B * (K + 1) * V * es)
    rates(r, "relaxed", b.timed(relaxed, iters), B * (K + 1) * V * es)
    rates(r, "rejection", b.timed(rejection, iters), B * 2 * V * es)
    b.free_all()
    return r


def fmt_x(row: dict, key: str) -> str:
    return f"{row[key]:>7.2f}x" if key in row else f"{'-':>8}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtp_trt.plugins.bench_kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--heads", default="128,16", help="comma-separated H values (default 128,16)")
    ap.add_argument("--seq", default="1,2,4", help="comma-separated S values (default 1,2,4)")
    ap.add_argument("--iters", type=int, default=30, help="calls per timed CUDA graph (default 30)")
    ap.add_argument("--quick", action="store_true", help="fewer (B, T) shapes")
    ap.add_argument("--ragged", action="store_true", help="cached rows per sequence uniform in 0 .. T - S")
    ap.add_argument("--data", choices=["random", "constant"], default="random",
                    help="random values (default) or one constant (every indexer score ties)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparisons")
    ap.add_argument("--simt", action="store_true", help="force the SIMT attention path")
    ap.add_argument("--single-stage", action="store_true", help="no cp.async double buffering")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)

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
    flags = (cuda_lib.MLA_FORCE_SIMT if args.simt else 0) | (cuda_lib.MLA_SINGLE_STAGE if args.single_stage else 0)
    copy_bytes = min(1 << 30, info["global_mem_bytes"] // 8)
    copy_gbps = copy_bandwidth(b, copy_bytes, 20)
    print(f"device: {info['name']} (sm_{info['compute_capability'].replace('.', '')}, {info['sm_count']} SMs, "
          f"L2 {info['l2_bytes'] >> 20} MiB)")
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write, {copy_bytes >> 20} MiB)")
    print(f"data: {args.data} (seed {args.seed}); lengths: {'ragged' if args.ragged else 'T - S each'}; timing: "
          f"{args.iters} calls per CUDA graph, median of {REPLAYS} replays; PyTorch: "
          f"{'torch ' + torch.__version__ if torch is not None else 'not compared'}")
    print(f"mtp_mla_decode {dtype}, Dl={DL} Dr={DR}{' SIMT' if args.simt else ''}"
          f"{' single-stage' if args.single_stage else ''}:")
    hdr = (f"{'B':>4} {'T':>7} {'B*T':>7} {'H':>4} {'S':>2} {'splits':>6} {'time us':>9} {'GB/s':>7} {'% copy':>7} "
           f"{'TFLOPS':>7} {'torch us':>9} {'vs torch':>8}")
    print(hdr)
    print("-" * len(hdr))
    results = []
    for H in [int(x) for x in args.heads.split(",")]:
        for S in [int(x) for x in args.seq.split(",")]:
            for B, T in QUICK_BT if args.quick else CONFIGS_BT:
                need = B * T * (DL + DR) * 2
                if need * 2 > info["global_mem_bytes"] * 0.8:
                    continue
                r = bench_mla(b, lib, info, B, T, H, S, dtype, args.iters, flags, args.ragged, torch)
                r["pct_copy"] = 100.0 * r["GBps"] / copy_gbps
                results.append(r)
                torch_us = f"{r['torch_us']:>9.1f}" if "torch_us" in r else f"{'-':>9}"
                print(f"{B:>4} {T:>7} {B * T:>7} {H:>4} {S:>2} {r['splits']:>6} {r['time_us']:>9.1f} "
                      f"{r['GBps']:>7.0f} {r['pct_copy']:>6.1f}% {r['TFLOPS']:>7.1f} {torch_us} {fmt_x(r, 'x_torch')}",
                      flush=True)
    print(f"DeepSeek Sparse Attention {dtype}: mtp_dsa_select ({HI} heads x {DI}, top {TOPK}) and "
          f"mtp_mla_sparse_decode (H={H_DSA}, Dl={DL} Dr={DR}):")
    hdr = (f"{'B':>4} {'T':>7} {'S':>2} {'select us':>10} {'GB/s':>6} {'% copy':>7} {'TFLOPS':>7} {'vs torch':>8} "
           f"{'attend us':>10} {'GB/s':>6} {'% copy':>7} {'TFLOPS':>7}")
    print(hdr)
    print("-" * len(hdr))
    dsa = []
    for S in [int(x) for x in args.seq.split(",")]:
        for B, T in QUICK_DSA_BT if args.quick else DSA_BT:
            if B * T * (DL + DR + DI) * 2 * 2 + B * S * T * 4 > info["global_mem_bytes"] * 0.8:
                continue
            r = bench_dsa(b, lib, info, B, T, H_DSA, S, dtype, args.iters, args.ragged, torch)
            dsa.append(r)
            print(f"{B:>4} {T:>7} {S:>2} {r['select_us']:>10.1f} {r['select_GBps']:>6.0f} "
                  f"{100 * r['select_GBps'] / copy_gbps:>6.1f}% {r['select_TFLOPS']:>7.1f} "
                  f"{fmt_x(r, 'select_x_torch')} {r['attend_us']:>10.1f} {r['attend_GBps']:>6.0f} "
                  f"{100 * r['attend_GBps'] / copy_gbps:>6.1f}% {r['attend_TFLOPS']:>7.1f}", flush=True)
    print(f"acceptance {dtype}, K={K_ACCEPT} drafts, V={V_ACCEPT}:")
    hdr = (f"{'B':>4} {'strict us':>10} {'GB/s':>6} {'% copy':>7} {'relaxed us':>11} {'GB/s':>6} {'% copy':>7} "
           f"{'rejection us':>13} {'GB/s':>6}")
    print(hdr)
    print("-" * len(hdr))
    accept = []
    for B in ACCEPT_B:
        r = bench_accept(b, lib, info, B, K_ACCEPT, V_ACCEPT, dtype, args.iters)
        accept.append(r)
        print(f"{B:>4} {r['strict_us']:>10.1f} {r['strict_GBps']:>6.0f} {100 * r['strict_GBps'] / copy_gbps:>6.1f}% "
              f"{r['relaxed_us']:>11.1f} {r['relaxed_GBps']:>6.0f} {100 * r['relaxed_GBps'] / copy_gbps:>6.1f}% "
              f"{r['rejection_us']:>13.1f} {r['rejection_GBps']:>6.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": info, "dtype": dtype, "flags": flags, "data": args.data, "seed": args.seed,
                       "ragged": args.ragged, "iters": args.iters, "torch": torch.__version__ if torch else None,
                       "copy_GBps": copy_gbps, "mla_decode": results, "dsa": dsa, "accept": accept}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
