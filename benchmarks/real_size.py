"""Real-size random checkpoints: decode tokens/s and peak RSS of `mtp-trt` on ONNX Runtime,
static vs routed MoE (llama.cpp beside it on the same checkpoints: benchmarks/beside_llama_cpp.py).

The checkpoints (benchmarks/bench_common.py) are made on the fly from a config (random weights, the demo's
tokenizer, one MTP module), never shipped, and cached under mtp-trt's cache directory, in bench-real-size:

  85m  : hidden 768, 8 layers (1 dense), 16 experts top-2 (inter 256) + 1 shared, q_lora 384, kv_lora 128,
         8 heads: 85.5M parameters in the main model, 27.4M active per token (embeddings excluded)
  304m : hidden 1024, 16 layers (1 dense), 32 experts top-4 (inter 160) + 1 shared, groups 8/4, q_lora 512,
         kv_lora 256, 16 heads: 304.9M, 98.1M active

  python benchmarks/real_size.py                  # both sizes, static and routed, batch 1, nextn 0
  python benchmarks/real_size.py --sizes 85m --forms ort --nextn 0 1

Per size: each export is timed round-robin in one process (medians over rounds), and its peak RSS is
taken in a process of its own that loads and decodes it alone (VmHWM: ONNX Runtime sessions,
caches, Python).  Export peak RSS and wall time are measured the same way, once per export.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402
from bench_common import SIZES, cache_dir, decode_fn, make_checkpoint, peak_rss_mb, revision  # noqa: E402


def export_child(ckpt: str, out: str, form: str) -> dict:
    """(in a child process) export with MoE form `form` ("default": the lowering's choice) -> wall, peak RSS."""
    from mtp_trt.exporters.export import export

    t0 = time.perf_counter()
    export(ckpt, out, nextn=1, moe_form=None if form == "default" else form, max_seq_len=1024)
    return {"export_seconds": time.perf_counter() - t0, "export_peak_rss_mb": peak_rss_mb()}


def time_child(paths: list[str], nextn: list[int], tokens: int, rounds: int, threads: int | None) -> dict:
    """(in a child process) every (export, nextn) decoded round-robin: median tokens/s of each."""
    jobs = {(p, n): decode_fn(Path(p), n, tokens, threads) for p in paths for n in nextn}
    results = {k: fn() for k, fn in jobs.items()}  # warm-up (and session creation)
    times = {k: [] for k in jobs}
    for _ in range(rounds):
        for k, fn in jobs.items():
            t0 = time.perf_counter()
            results[k] = fn()
            times[k].append(time.perf_counter() - t0)
    out = {}
    for (p, n), ts in times.items():
        seqs, stats = results[(p, n)]
        new = len(seqs[0].generated)
        out[f"{p}|{n}"] = {"tokens_per_second": new / statistics.median(ts), "tokens": new,
                           "mean_acceptance_length": stats.mean_acceptance_length, "generated": seqs[0].generated}
    return out


def rss_child(path: str, nextn: int, tokens: int, threads: int | None) -> dict:
    """(in a child process) one export alone: peak RSS after loading it and decoding."""
    decode_fn(Path(path), nextn, tokens, threads)()
    return {"peak_rss_mb": peak_rss_mb()}


def child(*args) -> dict:
    """This script's `--child` entry in a fresh process (its memory is its own)."""
    return bench_common.child(*args, script=__file__)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--forms", nargs="+", default=["static", "default"],
                    help="MoE forms to export (exporters/moe.py FORMS, or default: the lowering's choice)")
    ap.add_argument("--nextn", type=int, nargs="+", default=[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        name, *args = json.loads(a.child)
        jobs = {"checkpoint": lambda size: str(make_checkpoint(size)), "export": export_child, "time": time_child,
                "rss": rss_child}
        print(json.dumps(jobs[name](*args)))
        return
    report = []
    for size in a.sizes:
        ckpt = child("checkpoint", size)  # in a child: this process stays small (its memory is not measured)
        paths, exports = [], {}
        for form in a.forms:
            out = cache_dir() / f"export-{size}-{form}-{revision()}"
            if not (out / "manifest.json").is_file():
                exports[form] = child("export", str(ckpt), str(out), form)
                print(f"{size} {form}: exported in {exports[form]['export_seconds']:.0f} s, "
                      f"peak RSS {exports[form]['export_peak_rss_mb']:.0f} MB", flush=True)
            paths.append(str(out))
        timed = child("time", paths, a.nextn, a.tokens, a.rounds, a.threads)
        weights_mb = {p: (Path(p) / "weights.bin").stat().st_size / 2**20 for p in paths}
        for form, p in zip(a.forms, paths):
            for n in a.nextn:
                rss = child("rss", p, n, a.tokens, a.threads)["peak_rss_mb"]
                row = {"size": size, "moe": form, "nextn": n, **timed[f"{p}|{n}"], "peak_rss_mb": rss,
                       "weights_bin_mb": weights_mb[p], **exports.get(form, {})}
                row.pop("generated")
                report.append(row)
                print(f"{size:5s} moe={form:7s} nextn {n}: {row['tokens_per_second']:7.1f} tokens/s, peak RSS "
                      f"{rss:6.0f} MB; weights.bin {weights_mb[p]:.0f} MB", flush=True)
        gens = {json.dumps(timed[f"{p}|{n}"]["generated"]) for p in paths for n in a.nextn}
        print(f"{size}: every export and nextn generated the same tokens: {len(gens) == 1}", flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
