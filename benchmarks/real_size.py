"""Real-size random checkpoints: decode tokens/s and peak RSS of `mtp-trt` on ONNX Runtime,
static vs routed MoE (llama.cpp beside it on the same checkpoints: benchmarks/llama_cpp.py).

The checkpoints are made on the fly from a config (random weights, the demo's tokenizer, one MTP
module), never shipped, and cached under mtp-trt's cache directory, in bench-real-size:

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
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "samples" / "demo-model"
SIZES = {
    "85m": dict(hidden_size=768, num_hidden_layers=8, n_routed_experts=16, num_experts_per_tok=2,
                moe_intermediate_size=256, q_lora_rank=384, kv_lora_rank=128, num_attention_heads=8,
                num_key_value_heads=8, first_k_dense_replace=1, intermediate_size=2048, n_group=4, topk_group=2),
    "304m": dict(hidden_size=1024, num_hidden_layers=16, n_routed_experts=32, num_experts_per_tok=4,
                 moe_intermediate_size=160, q_lora_rank=512, kv_lora_rank=256, num_attention_heads=16,
                 num_key_value_heads=16, n_group=8, topk_group=4, first_k_dense_replace=1, intermediate_size=3072),
}
PROMPT = "def _get_default_tempdir():\n    \"\"\"Calculate the default directory to use for temporary files.\n"


def cache_dir() -> Path:
    """mtp-trt's cache directory (mtp_trt.fsutil.cache_dir), bench-real-size in it."""
    from mtp_trt.fsutil import cache_dir as mtp_trt_cache_dir

    return mtp_trt_cache_dir("bench-real-size")


def revision() -> str:
    """'r<exporter revision>', in the names of cached exports: a new revision re-exports.  (Imported here:
    llama.cpp's workers run in a Python without mtp_trt.)"""
    from mtp_trt.manifest import EXPORTER_REVISION

    return f"r{EXPORTER_REVISION}"


def peak_rss_mb() -> float:
    """This process's peak resident memory: VmHWM (ru_maxrss can carry the parent's figure over a fork)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def read_mapped(path: str | Path) -> int:
    """Read one byte of every page of this process's mappings of the file `path` (Linux: /proc/self/maps), so that
    all of them are resident, as once every weight has been read; returns the bytes mapped (0: none)."""
    import ctypes
    import mmap

    target = str(Path(path).resolve())
    with open("/proc/self/maps") as f:
        regions = [line.split(maxsplit=5) for line in f]
    mapped = 0
    for r in regions:
        if len(r) == 6 and r[5].rstrip("\n") == target and r[1].startswith("r"):
            lo, hi = (int(x, 16) for x in r[0].split("-"))
            for addr in range(lo, hi, mmap.PAGESIZE):
                ctypes.string_at(addr, 1)
            mapped += hi - lo
    return mapped


def make_checkpoint(size: str) -> Path:
    """Random weights (N(0, 0.02), unit norms, zero routing bias) for SIZES[size], with the demo's tokenizer."""
    out = cache_dir() / f"ckpt-{size}"
    if (out / "model.safetensors").is_file():
        return out
    import torch

    from mtp_trt.config import ModelConfig
    from mtp_trt.exporters.loader import save_checkpoint
    from mtp_trt.exporters.model import DeepseekV3

    config = {**json.loads((DEMO / "config.json").read_text()), **SIZES[size], "num_nextn_predict_layers": 1}
    torch.manual_seed(0)
    model = DeepseekV3(ModelConfig.from_dict(config)).init_weights(0.02)
    extra = {f: DEMO / f for f in ("tokenizer.json", "generation_config.json")}
    save_checkpoint(model, out, config, extra_files=extra)
    return out


def export_child(ckpt: str, out: str, form: str) -> dict:
    """(in a child process) export with MoE form `form` ("default": the lowering's choice) -> wall, peak RSS."""
    from mtp_trt.exporters.export import export

    t0 = time.perf_counter()
    export(ckpt, out, nextn=1, moe_form=None if form == "default" else form, max_seq_len=1024)
    return {"export_seconds": time.perf_counter() - t0, "export_peak_rss_mb": peak_rss_mb()}


def decode_fn(path: Path, nextn: int, tokens: int, threads: int | None):
    from mtp_trt.backend import OrtBackend
    from mtp_trt.decode import DecodeOptions, generate
    from mtp_trt.manifest import Manifest
    from tokenizers import Tokenizer

    manifest = Manifest.load(path)
    backend = OrtBackend(manifest, threads=threads)
    ids = [1] + Tokenizer.from_file(str(path / "tokenizer.json")).encode(PROMPT).ids  # BOS, as llama.cpp
    opts = DecodeOptions(nextn=nextn, max_new_tokens=tokens)  # no EOS: always `tokens` new tokens
    return lambda: generate(backend, [ids], opts)


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


def child(*args, script: str = __file__) -> dict:
    """Run `script`'s `--child` entry (this script's by default) in a fresh process; its last stdout line is
    JSON."""
    cmd = [sys.executable, script, "--child", json.dumps(args)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


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
