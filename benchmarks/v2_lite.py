"""A real-size MLA model on a 24 GB machine: a random checkpoint with DeepSeek-V2-Lite's shapes (15.7B parameters)
plus one MTP layer, stored as the official FP8 block format stores DeepSeek-V3 (float8_e4m3fn linear weights with
one float32 scale per 128 x 128 block; embedding, head, norms and routers in bf16), made on the fly (never
shipped), exported with `--quant int4` and decoded.  Not run in CI.

  python benchmarks/v2_lite.py [--quant int4] [--tokens 32] [--layers 27] \\
      [--llama-python /path/to/python-with-llama_cpp --sdist llama_cpp_python-0.3.36.tar.gz]

Prints the export's wall time and peak RSS (a process of its own: VmHWM), then decode tokens/s (nextn 0 and 1,
batch 1, 2 threads, the median of --rounds) and the decoding process's peak RSS.  Everything goes under
$MTP_TRT_CACHE_DIR/bench-real-size (about 16 GB for the checkpoint, 10 GB for the int4 export).

With --llama-python (a Python with llama-cpp-python) and --sdist (its source distribution, which carries
llama.cpp's converter), llama.cpp Q4_K_M of the same checkpoint beside it: the converter writes Q8_0 straight
from the FP8 checkpoint (an f32 GGUF would be 63 GB), `llama_model_quantize` makes Q4_K_M from that
(`--allow-requantize`), and the same prompt is decoded through llama.cpp's C API (benchmarks/llama_api.py),
the same way: new tokens over a whole generation's time, the median of --rounds, and the process's peak RSS.
About 17 + 10 GB more on disk.

Shapes (DeepSeek-V2-Lite's config): 27 layers, hidden 2048, the first layer dense (width 10944), then 64 routed
experts top-6 of width 1408 and 2 shared, softmax routing without groups, 16 heads, no q LoRA, kv_lora_rank
512, qk_nope 128, rope 64 (YaRN, factor 40), v 128, vocabulary 102400.  The weights are random bytes of valid
FP8 values (so drafts mean nothing: nextn 1 measures the cost of a step, not a speed-up).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_size  # noqa: E402
from real_size import DEMO, cache_dir, decode_fn, peak_rss_mb, revision  # noqa: E402

V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
    intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
    num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6, n_group=1,
    topk_group=1, topk_method="greedy", scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0,
    first_k_dense_replace=1, moe_layer_freq=1, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    attention_bias=False, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, num_nextn_predict_layers=1,
    torch_dtype="bfloat16",
    quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "weight_block_size": [128, 128]},
)
SHARD_BYTES = 2 << 30


def make_checkpoint(layers: int) -> str:
    """(in a child process) the FP8 checkpoint, written shard by shard (never held whole)."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from mtp_trt.config import ModelConfig
    from mtp_trt.exporters.loader import checkpoint_names
    from mtp_trt.exporters.model import DeepseekV3

    config = {**V2_LITE, "num_hidden_layers": layers}
    out = cache_dir() / f"ckpt-v2-lite-{layers}"
    if (out / "model.safetensors.index.json").is_file():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = DeepseekV3(ModelConfig.from_dict(config), max_positions=1)
    rng = np.random.default_rng(0)
    weight_map, shard, size, index = {}, {}, 0, 1

    def flush():
        nonlocal shard, size, index
        name = f"model-{index:05d}.safetensors"
        save_file(shard, str(out / name))
        weight_map.update({k: name for k in shard})
        shard, size, index = {}, 0, index + 1

    for name, p in checkpoint_names(model).items():
        o = p.shape
        if len(o) == 2 and name.endswith("proj.weight"):  # FP8 values: random bytes, exponent kept below 8
            raw = rng.integers(0, 256, o, dtype=np.uint8) & 0xBF
            shard[name] = torch.from_numpy(raw).view(torch.float8_e4m3fn)
            blocks = (-(-o[0] // 128), -(-o[1] // 128))
            shard[name + "_scale_inv"] = torch.from_numpy(rng.uniform(0.005, 0.015, blocks).astype(np.float32))
        elif name.endswith("norm.weight"):
            shard[name] = torch.ones(o, dtype=torch.bfloat16)
        else:
            shard[name] = (torch.from_numpy(rng.standard_normal(o, dtype=np.float32)) * 0.02).to(torch.bfloat16)
        size += shard[name].numel() * shard[name].element_size()
        if size >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in ("tokenizer.json", "generation_config.json"):
        (out / f).write_bytes((DEMO / f).read_bytes())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(out)


def export_child(ckpt: str, out: str, quant: str) -> dict:
    from mtp_trt.exporters.export import export

    t0 = time.perf_counter()
    export(ckpt, out, nextn=1, max_seq_len=1024, trees="none", quant_scheme=quant)
    return {"export_seconds": time.perf_counter() - t0, "export_peak_rss_mb": peak_rss_mb()}


def decode_child(path: str, nextn: int, tokens: int, rounds: int, threads: int) -> dict:
    """One export alone: median tokens/s over `rounds` decodes after a warm-up, and the peak RSS."""
    import statistics

    fn = decode_fn(Path(path), nextn, tokens, threads)
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        seqs, stats = fn()
        times.append(time.perf_counter() - t0)
    return {"tokens_per_second": len(seqs[0].generated) / statistics.median(times), "peak_rss_mb": peak_rss_mb(),
            "mean_acceptance_length": stats.mean_acceptance_length}


def child(*args) -> dict:
    """This script's `--child` entry in a fresh process (its memory is its own)."""
    return real_size.child(*args, script=__file__)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant", default="int4", choices=["int8", "int4"])
    ap.add_argument("--layers", type=int, default=27, help="fewer for a quick try of the pipeline")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-python", help="a Python with llama_cpp: decode llama.cpp Q4_K_M of the same checkpoint")
    ap.add_argument("--sdist", type=Path, help="llama-cpp-python's source distribution (its converter)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        name, *args = json.loads(a.child)
        jobs = {"checkpoint": make_checkpoint, "export": export_child, "decode": decode_child}
        print(json.dumps(jobs[name](*args)))
        return
    t0 = time.perf_counter()
    ckpt = child("checkpoint", a.layers)
    gb = sum(f.stat().st_size for f in Path(ckpt).glob("*.safetensors")) / 1e9
    print(f"checkpoint {ckpt}: {gb:.1f} GB (made in {time.perf_counter() - t0:.0f} s, or found)", flush=True)
    out = cache_dir() / f"export-v2-lite-{a.layers}-{a.quant}-{revision()}"  # a new exporter revision re-exports
    if not (out / "manifest.json").is_file():
        e = child("export", ckpt, str(out), a.quant)
        print(f"export --quant {a.quant}: {e['export_seconds']:.0f} s, peak RSS {e['export_peak_rss_mb']:.0f} MB",
              flush=True)
    print(f"weights.bin: {(out / 'weights.bin').stat().st_size / 1e9:.2f} GB", flush=True)
    for nextn in (0, 1):
        d = child("decode", str(out), nextn, a.tokens, a.rounds, a.threads)
        print(f"decode nextn {nextn}: {d['tokens_per_second']:.2f} tokens/s, peak RSS {d['peak_rss_mb']:.0f} MB "
              f"(mean accepted {d['mean_acceptance_length']:.2f})", flush=True)
    if a.llama_python:
        llama_q4_k_m(ckpt, a)


def llama_q4_k_m(ckpt: str, a) -> None:
    """llama.cpp Q4_K_M of the checkpoint (module docstring): made once, then decoded alone."""
    from llama_api import converter_dir, gguf_path, run_child
    from tokenizers import Tokenizer

    q8, q4 = gguf_path(f"v2-lite-{a.layers}", "q8_0"), gguf_path(f"v2-lite-{a.layers}", "q4_k_m")
    if not q4.is_file():
        if not q8.is_file():
            t = run_child(sys.executable, "convert", str(converter_dir(a.sdist)), ckpt, str(q8), "q8_0")
            print(f"llama.cpp converter -> Q8_0: {t['seconds']:.0f} s, {q8.stat().st_size / 1e9:.2f} GB", flush=True)
        t = run_child(a.llama_python, "quantize", str(q8), str(q4), "q4_k_m", a.threads, True)
        print(f"llama_model_quantize Q8_0 -> Q4_K_M: {t['seconds']:.0f} s, {q4.stat().st_size / 1e9:.2f} GB",
              flush=True)
    ids = [1] + Tokenizer.from_file(str(Path(ckpt) / "tokenizer.json")).encode(real_size.PROMPT).ids
    d = run_child(a.llama_python, "decode", str(q4), ids, a.tokens, a.rounds, a.threads)
    print(f"llama.cpp Q4_K_M decode: {d['tokens_per_second']:.2f} tokens/s, peak RSS {d['peak_rss_mb']:.0f} MB",
          flush=True)


if __name__ == "__main__":
    main()
