"""What the benchmark scripts share: the checkpoints they run (the bundled demo and the random 85m / 304m, made
on the fly), the prompt, mtp-trt's cache directory for what they make, how they measure memory, and how they run
a worker process.  It imports no benchmark script; the scripts (and benchmarks/llama_api.py) import it.
"""

from __future__ import annotations

import json
import subprocess
import sys
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


def decode_fn(path: Path, nextn: int, tokens: int, threads: int | None):
    """A function that decodes PROMPT (after BOS) greedily on the export at `path`: `tokens` new tokens at `nextn`."""
    from mtp_trt.backend import OrtBackend
    from mtp_trt.decode import DecodeOptions, generate
    from mtp_trt.manifest import Manifest
    from tokenizers import Tokenizer

    manifest = Manifest.load(path)
    backend = OrtBackend(manifest, threads=threads)
    ids = [1] + Tokenizer.from_file(str(path / "tokenizer.json")).encode(PROMPT).ids  # BOS, as llama.cpp
    opts = DecodeOptions(nextn=nextn, max_new_tokens=tokens)  # no EOS: always `tokens` new tokens
    return lambda: generate(backend, [ids], opts)


def child(*args, script: str) -> dict:
    """Run `script`'s `--child` entry in a fresh process (its memory is its own); its last stdout line is
    JSON."""
    cmd = [sys.executable, script, "--child", json.dumps(args)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])
