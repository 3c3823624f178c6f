"""Benchmark of the MLA decode and DeepSeek Sparse Attention kernels against the GPU's copy bandwidth.

    python -m mtp_trt.plugins.bench_kernels [--dtype bf16] [--json FILE] [--quick]

1. Device-to-device copy bandwidth: cudaMemcpy of a large buffer, counting read + write bytes,
   median of many.
2. mtp_mla_decode on DeepSeek-V3 shapes (Dl 512, Dr 64; H = 128 and 16; S = 1, 2, 4; B x T from 4k
   to 256k cached tokens, B = 1 T = 32k included): achieved bandwidth = (latent rows read + q +
   out bytes) / median kernel time (CUDA events around each launch; the launch includes the split
   combine).  Several cache buffers are rotated so that the working set exceeds L2 and every
   launch streams from memory.  The table shows the % of the copy bandwidth.
3. DeepSeek Sparse Attention (DeepSeek-V3.2's shapes: 64 indexer heads of 128, index_topk 2048, rows of 576 latent
   values and a 128-value key; H = 128; the S of the MLA table): mtp_dsa_select (bytes: every visible row's key,
   the fp32 scores written once and read by its five passes, the queries, the selected rows) and
   mtp_mla_sparse_decode over the 2048 selected rows (bytes: the selected latent rows, q, out), each timed alone.

Needs cuda-python and an NVIDIA GPU (exits with a message otherwise); builds the kernels with nvcc
on first use (see cuda_lib).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

from mtp_trt.plugins import cuda_lib

DL, DR = 512, 64
CONFIGS_BT = [(1, 4096), (1, 32768), (1, 131072), (4, 8192), (8, 4096), (16, 4096), (32, 4096), (64, 4096),
              (8, 32768), (2, 131072)]
QUICK_BT = [(1, 4096), (1, 32768), (64, 4096), (8, 32768)]


class Bench:
    def __init__(self, cudart):
        self.rt = cudart
        self.ptrs: list[int] = []

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

    def fill(self, p: int, n: int, byte: int = 0x3C):
        """0x3C3C is a small finite number in fp16 (1.06) and bf16 (0.0115)."""
        self.ck(self.rt.cudaMemset(p, byte, n), "cudaMemset")

    def timed(self, fn, iters: int, warmup: int) -> float:
        """Median milliseconds of fn(i) over iters launches (events around each)."""
        for i in range(warmup):
            fn(i)
        self.ck(self.rt.cudaDeviceSynchronize(), "sync")
        evs = [(self.ck(self.rt.cudaEventCreate(), "event"), self.ck(self.rt.cudaEventCreate(), "event"))
               for _ in range(iters)]
        for i, (a, b) in enumerate(evs):
            self.ck(self.rt.cudaEventRecord(a, 0), "record")
            fn(warmup + i)
            self.ck(self.rt.cudaEventRecord(b, 0), "record")
        self.ck(self.rt.cudaDeviceSynchronize(), "sync")
        times = [float(self.ck(self.rt.cudaEventElapsedTime(a, b), "elapsed")) for a, b in evs]
        for a, b in evs:
            self.rt.cudaEventDestroy(a)
            self.rt.cudaEventDestroy(b)
        return statistics.median(times)


def device_info(rt, b: Bench) -> dict:
    dev = b.ck(rt.cudaGetDevice(), "cudaGetDevice")
    prop = b.ck(rt.cudaGetDeviceProperties(dev), "cudaGetDeviceProperties")
    name = prop.name.decode() if isinstance(prop.name, bytes) else str(prop.name)
    return {"name": name.strip("\x00"), "sm_count": int(prop.multiProcessorCount),
            "compute_capability": f"{prop.major}.{prop.minor}", "l2_bytes": int(prop.l2CacheSize),
            "global_mem_bytes": int(prop.totalGlobalMem)}


def copy_bandwidth(b: Bench, nbytes: int, iters: int) -> float:
    src, dst = b.alloc(nbytes), b.alloc(nbytes)
    b.fill(src, nbytes)
    kind = b.rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
    ms = b.timed(lambda i: b.ck(b.rt.cudaMemcpyAsync(dst, src, nbytes, kind, 0), "cudaMemcpyAsync"), iters, 3)
    b.free_all()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def bench_mla(b: Bench, lib, info: dict, B: int, T: int, H: int, S: int, dtype: str, iters: int, flags: int) -> dict:
    es = 2
    D = DL + DR
    cache_bytes = B * T * D * es
    rot = max(1, min(16, math.ceil(3 * info["l2_bytes"] / cache_bytes)))
    caches = [b.alloc(cache_bytes) for _ in range(rot)]
    for c in caches:
        b.fill(c, cache_bytes)
    q_bytes, out_bytes = B * S * H * D * es, B * S * H * DL * es
    qs = [b.alloc(q_bytes) for _ in range(rot)]
    for q in qs:
        b.fill(q, q_bytes)
    out = b.alloc(out_bytes)
    import numpy as np

    lens = np.full(B, T - S, np.int32)
    d_len = b.alloc(lens.nbytes)
    b.ck(b.rt.cudaMemcpy(d_len, lens.ctypes.data, lens.nbytes, b.rt.cudaMemcpyKind.cudaMemcpyHostToDevice), "H2D")
    ns = lib.mla_decode_num_splits(B, S, H, T, info["sm_count"])
    ws_bytes = lib.mla_decode_workspace_size(B, S, H, DL, ns)
    ws = b.alloc(ws_bytes) if ws_bytes else 0
    scale = 1.0 / math.sqrt(192)

    def launch(i):
        k = i % rot
        lib.mla_decode(dtype, qs[k], caches[k], d_len, 0, 0, out, ws, ws_bytes, B, S, H, DL, DR, T, scale, ns, flags)

    ms = b.timed(launch, iters, 3)
    b.free_all()
    moved = B * T * D * es + q_bytes + out_bytes
    return {"B": B, "T": T, "H": H, "S": S, "splits": ns, "time_us": ms * 1e3, "bytes": moved,
            "GBps": moved / (ms * 1e-3) / 1e9}


HI, DI, TOPK, H_DSA = 64, 128, 2048, 128
DSA_BT = [(1, 4096), (1, 32768), (1, 131072), (8, 32768), (32, 8192)]
QUICK_DSA_BT = [(1, 32768), (8, 32768)]


def bench_dsa(b: Bench, lib, info: dict, B: int, T: int, H: int, S: int, dtype: str, iters: int) -> dict:
    import numpy as np

    es, D, C = 2, DL + DR, DL + DR + DI
    cache_bytes = B * T * C * es
    rot = max(1, min(8, math.ceil(3 * info["l2_bytes"] / cache_bytes)))
    caches = [b.alloc(cache_bytes) for _ in range(rot)]
    for c in caches:
        b.fill(c, cache_bytes)
    iq_bytes, q_bytes, out_bytes = B * S * HI * DI * es, B * S * H * D * es, B * S * H * DL * es
    iq, w, q, out = b.alloc(iq_bytes), b.alloc(B * S * HI * 4), b.alloc(q_bytes), b.alloc(out_bytes)
    for p, n in ((iq, iq_bytes), (w, B * S * HI * 4), (q, q_bytes)):
        b.fill(p, n)
    lens = np.full(B, T - S, np.int32)
    d_len = b.alloc(lens.nbytes)
    b.ck(b.rt.cudaMemcpy(d_len, lens.ctypes.data, lens.nbytes, b.rt.cudaMemcpyKind.cudaMemcpyHostToDevice), "H2D")
    sel = b.alloc(B * S * TOPK * 4)
    sel_ws_bytes = lib.dsa_select_workspace_size(B, S, T)
    sel_ws = b.alloc(sel_ws_bytes)
    ns = lib.mla_decode_num_splits(B * S, 1, H, TOPK, info["sm_count"])
    ws_bytes = lib.mla_decode_workspace_size(B, S, H, DL, ns)
    ws = b.alloc(ws_bytes) if ws_bytes else 0

    def select(i):
        lib.dsa_select(dtype, iq, w, caches[i % rot], d_len, 0, sel, sel_ws, sel_ws_bytes, B, S, HI, DI, C, D, T,
                       TOPK, DI**-0.5)

    select_ms = b.timed(select, iters, 3)  # leaves a valid selection in `sel` for the attention below

    def attend(i):
        lib.mla_sparse_decode(dtype, q, caches[i % rot], d_len, 0, sel, out, ws, ws_bytes, B, S, H, DL, DR, C, T,
                              TOPK, 1.0 / math.sqrt(192), ns)

    attend_ms = b.timed(attend, iters, 3)
    b.free_all()
    select_bytes = B * T * DI * es + 6 * B * S * T * 4 + iq_bytes + B * S * TOPK * 4
    attend_bytes = B * S * TOPK * D * es + q_bytes + out_bytes
    return {"B": B, "T": T, "H": H, "S": S, "topk": TOPK, "splits": ns,
            "select_us": select_ms * 1e3, "select_bytes": select_bytes, "select_GBps": select_bytes / select_ms / 1e6,
            "attend_us": attend_ms * 1e3, "attend_bytes": attend_bytes, "attend_GBps": attend_bytes / attend_ms / 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtp_trt.plugins.bench_kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--heads", default="128,16", help="comma-separated H values (default 128,16)")
    ap.add_argument("--seq", default="1,2,4", help="comma-separated S values (default 1,2,4)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="fewer (B, T) shapes")
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

    b = Bench(rt)
    info = device_info(rt, b)
    lib = cuda_lib.load_library()
    dtype = {"bf16": "bfloat16", "fp16": "float16"}[args.dtype]
    flags = (cuda_lib.MLA_FORCE_SIMT if args.simt else 0) | (cuda_lib.MLA_SINGLE_STAGE if args.single_stage else 0)
    copy_bytes = min(1 << 30, info["global_mem_bytes"] // 8)
    copy_gbps = copy_bandwidth(b, copy_bytes, 20)
    print(f"device: {info['name']} (sm_{info['compute_capability'].replace('.', '')}, {info['sm_count']} SMs, "
          f"L2 {info['l2_bytes'] >> 20} MiB)")
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write, {copy_bytes >> 20} MiB, median of 20)")
    print(f"mtp_mla_decode {dtype}, Dl={DL} Dr={DR}{' SIMT' if args.simt else ''}"
          f"{' single-stage' if args.single_stage else ''}:")
    hdr = f"{'B':>4} {'T':>7} {'B*T':>7} {'H':>4} {'S':>2} {'splits':>6} {'time us':>9} {'GB/s':>7} {'% copy':>7}"
    print(hdr)
    print("-" * len(hdr))
    results = []
    for H in [int(x) for x in args.heads.split(",")]:
        for S in [int(x) for x in args.seq.split(",")]:
            for B, T in QUICK_BT if args.quick else CONFIGS_BT:
                need = B * T * (DL + DR) * 2
                if need * 2 > info["global_mem_bytes"] * 0.8:
                    continue
                r = bench_mla(b, lib, info, B, T, H, S, dtype, args.iters, flags)
                r["pct_copy"] = 100.0 * r["GBps"] / copy_gbps
                results.append(r)
                print(f"{B:>4} {T:>7} {B * T:>7} {H:>4} {S:>2} {r['splits']:>6} {r['time_us']:>9.1f} "
                      f"{r['GBps']:>7.0f} {r['pct_copy']:>6.1f}%", flush=True)
    print(f"DeepSeek Sparse Attention {dtype}: mtp_dsa_select ({HI} heads x {DI}, top {TOPK}) and "
          f"mtp_mla_sparse_decode (H={H_DSA}, Dl={DL} Dr={DR}):")
    hdr = (f"{'B':>4} {'T':>7} {'S':>2} {'select us':>10} {'GB/s':>7} {'% copy':>7} {'attend us':>10} {'GB/s':>7} "
           f"{'% copy':>7}")
    print(hdr)
    print("-" * len(hdr))
    dsa = []
    for S in [int(x) for x in args.seq.split(",")]:
        for B, T in QUICK_DSA_BT if args.quick else DSA_BT:
            if B * T * (DL + DR + DI) * 2 * 2 + B * S * T * 4 > info["global_mem_bytes"] * 0.8:
                continue
            r = bench_dsa(b, lib, info, B, T, H_DSA, S, dtype, args.iters)
            dsa.append(r)
            print(f"{B:>4} {T:>7} {S:>2} {r['select_us']:>10.1f} {r['select_GBps']:>7.0f} "
                  f"{100 * r['select_GBps'] / copy_gbps:>6.1f}% {r['attend_us']:>10.1f} {r['attend_GBps']:>7.0f} "
                  f"{100 * r['attend_GBps'] / copy_gbps:>6.1f}%", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": info, "dtype": dtype, "flags": flags, "copy_GBps": copy_gbps, "mla_decode": results,
                       "dsa": dsa}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
