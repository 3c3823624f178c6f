"""A real-size MLA model on a 24 GB machine: a random checkpoint with DeepSeek-V2-Lite's shapes (15.7B parameters)
plus one MTP layer, stored as the official FP8 block format stores DeepSeek-V3 (float8_e4m3fn linear weights with
one float32 scale per 128 x 128 block; embedding, head, norms and routers in bf16), made on the fly (never
shipped), exported with `--quant int4` and decoded; llama.cpp Q4_K_M of the same checkpoint beside it.  Not run
in CI.

  python benchmarks/v2_lite.py [--quant int4] [--tokens 32] [--rounds 3] [--threads 2] [--layers 27] \\
      [--llama-python /path/to/python-with-llama_cpp --sdist llama_cpp_python-0.3.36.tar.gz] [--reexport]

Every step runs in a process of its own, one after the other, and memory is that process's peak resident set
(VmHWM), in GiB (2^30 bytes); file sizes are in GiB too.  The steps:

* the checkpoint, made once (about 15.6 GiB at 27 layers);
* mtp-trt's export (nextn 1, max_seq_len 1024, no trees): its wall time and peak RSS, recorded beside the cached
  export and shown again while it is reused (--reexport: export and time it again);
* decoding, batch 1, greedy, --threads threads, --tokens new tokens (no stop at end-of-text): tokens/s over a
  whole generation (prompt included), the median of --rounds after a warm-up; the process's peak RSS after
  that, and its peak RSS once every page of its mappings of the weights file has been read (so both engines are
  measured with all their weights resident: mtp-trt maps weights.bin and reads only the pages a decode touches,
  llama.cpp reads its whole file in up front).  mtp-trt at nextn 0 and 1; with --llama-python, llama.cpp at
  each of its settings (llama_api.LLAMA_SETTINGS, as llama-cli's flags): its defaults (the GGUF memory-mapped,
  and the Q4_K weights also copied into the CPU backend's repacked layout), --no-repack, --load-mode none (no
  mmap: the file read into llama.cpp's own memory), and both.  The table ends with how many of the first new
  tokens each row shares with mtp-trt nextn 0's.

With random weights the logits are nearly flat and the two 4-bit formats round differently, so greedy tokens part
early; whether both engines compute the same model is told by their teacher-forced logits over the prompt (the
line before the table): their correlation, the share of positions whose top-1 tokens agree, and where mtp-trt's
top-1 token ranks in llama.cpp's logits.

llama.cpp's GGUF (with --llama-python, a Python with llama-cpp-python, and --sdist, its source distribution,
which carries llama.cpp's converter; --sdist is needed only until the Q4_K_M file is cached): the converter
writes Q8_0 straight from the FP8 checkpoint (an f32 GGUF would be 63 GB), `llama_model_quantize` requantizes
that to Q4_K_M (`--allow-requantize`; the Q8_0 file is then deleted), and the same prompt ids are decoded
through llama.cpp's C API (benchmarks/llama_api.py).  llama.cpp's deepseek2 loader takes a model without q LoRA
to be V2-Lite only at 26 or 27 layers, and otherwise reads `deepseek2.attention.q_lora_rank`, which the
converter writes only for a q LoRA; the quantizer is handed that key as 0 (`--override-kv`), so the Q4_K_M file
loads at any --layers.

Everything goes under $MTP_TRT_CACHE_DIR/bench-real-size: at 27 layers about 15.6 GiB for the checkpoint,
9.8 GiB for the int4 export, 9.7 GiB for the Q4_K_M file and, while it is made, 15.6 GiB for the Q8_0 one.

Shapes (DeepSeek-V2-Lite's config): 27 layers, hidden 2048, the first layer dense (width 10944), then 64 routed
experts top-6 of width 1408 and 2 shared, softmax routing without groups, 16 heads, no q LoRA, kv_lora_rank
512, qk_nope 128, rope 64 (YaRN, factor 40), v 128, vocabulary 102400.  The weights are random bytes of valid
FP8 values (so drafts mean nothing: nextn 1 measures the cost of a step, not a speed-up).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402
from bench_common import DEMO, PROMPT, cache_dir, decode_fn, peak_rss_mb, read_mapped, revision  # noqa: E402
from llama_api import LLAMA_SETTINGS, converter_dir, gguf_path, run_child  # noqa: E402

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
GIB = 2**30
# llama.cpp reads this key for a deepseek2 model at any depth but V2-Lite's (26, 27 layers); 0: no q LoRA
Q_LORA_RANK_KEY = "deepseek2.attention.q_lora_rank"


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
    """One export alone: median tokens/s over `rounds` decodes after a warm-up, the tokens, the peak RSS, and the
    peak RSS once every page of weights.bin's mapping has been read."""
    import statistics

    fn = decode_fn(Path(path), nextn, tokens, threads)
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        seqs, stats = fn()
        times.append(time.perf_counter() - t0)
    peak = peak_rss_mb()
    read_mapped(Path(path) / "weights.bin")
    return {"tokens_per_second": len(seqs[0].generated) / statistics.median(times), "peak_rss_mb": peak,
            "peak_rss_read_mb": peak_rss_mb(), "generated": seqs[0].generated,
            "mean_acceptance_length": stats.mean_acceptance_length}


def logits_child(path: str, ids: list[int], threads: int, out: str) -> dict:
    """(in a child process) the export's teacher-forced logits of `ids` (its target graph), saved at `out`."""
    import numpy as np

    from mtp_trt.backend import OrtBackend
    from mtp_trt.manifest import Manifest

    backend = OrtBackend(Manifest.load(Path(path)), threads=threads)
    backend.allocate(1, len(ids))
    zero = np.zeros(1, np.int32)
    res = backend.target(1, np.array([ids], np.int32), zero, zero, 0, 0.0, logits=True)
    np.save(out, res["logits"][0])
    return {"file": out}


def compare_logits(a, b) -> dict:
    """Two engines' teacher-forced logits [positions, vocab]: the median over positions of their correlation, the
    share of positions whose top-1 tokens agree, and the median rank in b of a's top-1 token (0: b's top-1 too)."""
    import numpy as np

    top = a.argmax(1)
    return {"correlation": float(np.median([np.corrcoef(x, y)[0, 1] for x, y in zip(a, b)])),
            "top1_agreement": float((top == b.argmax(1)).mean()),
            "rank": float(np.median((b > b[np.arange(len(b)), top][:, None]).sum(1)))}


def child(*args) -> dict:
    """This script's `--child` entry in a fresh process (its memory is its own)."""
    return bench_common.child(*args, script=__file__)


def measured(label: str, run) -> tuple[str, str, dict]:
    """(label, the 1-minute load average before and after, run()'s result), printed as it ends."""
    before = os.getloadavg()[0]
    d = run()
    load = f"{before:.1f}, {os.getloadavg()[0]:.1f}"
    print(f"{label}: {d['tokens_per_second']:.2f} tokens/s (load average {load})", flush=True)
    return label, load, d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant", default="int4", choices=["int8", "int4"])
    ap.add_argument("--layers", type=int, default=27, help="fewer for a quick try of the pipeline")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-python", type=Path,
                    help="a Python with llama_cpp: decode llama.cpp Q4_K_M of the same checkpoint")
    ap.add_argument("--sdist", type=Path, help="llama-cpp-python's source distribution (its converter)")
    ap.add_argument("--reexport", action="store_true", help="export again (and time it) even if cached")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        name, *args = json.loads(a.child)
        jobs = {"checkpoint": make_checkpoint, "export": export_child, "decode": decode_child, "logits": logits_child}
        print(json.dumps(jobs[name](*args)))
        return
    for flag in ("layers", "tokens", "rounds", "threads"):
        if getattr(a, flag) < 1:
            ap.error(f"--{flag} {getattr(a, flag)}: must be at least 1")
    q4 = gguf_path(f"v2-lite-{a.layers}", "q4_k_m")
    if a.llama_python and not a.llama_python.is_file():
        ap.error(f"--llama-python {a.llama_python}: no such file (a Python with llama-cpp-python)")
    if a.sdist and not a.sdist.is_file():
        ap.error(f"--sdist {a.sdist}: no such file (llama-cpp-python's source distribution, a .tar.gz)")
    if a.llama_python and not a.sdist and not q4.is_file():
        ap.error(f"--sdist: llama-cpp-python's source distribution is needed to make {q4}")

    t0 = time.perf_counter()
    ckpt = child("checkpoint", a.layers)
    size = sum(f.stat().st_size for f in Path(ckpt).glob("*.safetensors")) / GIB
    print(f"checkpoint {ckpt}: {size:.2f} GiB (made in {time.perf_counter() - t0:.0f} s, or found)", flush=True)
    out = cache_dir() / f"export-v2-lite-{a.layers}-{a.quant}-{revision()}"  # a new exporter revision re-exports
    record = out.with_name(out.name + ".json")  # the export's wall time and peak, as measured when it was made
    if a.reexport or not (out / "manifest.json").is_file():
        print(f"exporting --quant {a.quant} ...", flush=True)
        before = os.getloadavg()[0]
        e = child("export", ckpt, str(out), a.quant)
        record.write_text(json.dumps({**e, "load_before": before, "load_after": os.getloadavg()[0]}))
    e = json.loads(record.read_text()) if record.is_file() else None
    if e:
        print(f"export --quant {a.quant}: {e['export_seconds']:.0f} s, peak RSS {e['export_peak_rss_mb'] / 1024:.2f} "
              f"GiB (load average {e['load_before']:.1f}, {e['load_after']:.1f})", flush=True)
    print(f"weights.bin: {(out / 'weights.bin').stat().st_size / GIB:.2f} GiB", flush=True)
    rows = []
    for nextn in (0, 1):
        rows.append(measured(f"mtp-trt --quant {a.quant}, nextn {nextn}",
                             lambda: child("decode", str(out), nextn, a.tokens, a.rounds, a.threads)))
    if a.llama_python:
        from tokenizers import Tokenizer

        make_q4_k_m(ckpt, q4, a)
        print(f"llama.cpp Q4_K_M: {q4.stat().st_size / GIB:.2f} GiB", flush=True)
        ids = [1] + Tokenizer.from_file(str(Path(ckpt) / "tokenizer.json")).encode(PROMPT).ids
        for settings in LLAMA_SETTINGS:
            rows.append(measured(f"llama.cpp Q4_K_M, {settings}", lambda: run_child(
                str(a.llama_python), "decode", str(q4), ids, a.tokens, a.rounds, a.threads, settings)))
    agreement = None
    if a.llama_python:  # teacher-forced over the prompt: do the two engines compute the same model?
        import numpy as np

        files = [str(cache_dir() / f"logits-v2-lite-{a.layers}-{k}.npy") for k in ("mtp-trt", "llama.cpp")]
        child("logits", str(out), ids, a.threads, files[0])
        run_child(str(a.llama_python), "logits", str(q4), ids, a.threads, files[1])
        agreement = compare_logits(*(np.load(f) for f in files))
        print(f"teacher-forced over the {len(ids)} prompt positions, mtp-trt --quant {a.quant} against llama.cpp "
              f"Q4_K_M: logits' correlation {agreement['correlation']:.3f} (median), top-1 tokens equal at "
              f"{agreement['top1_agreement']:.0%} of the positions, mtp-trt's top-1 llama.cpp's number "
              f"{agreement['rank'] + 1:.0f} (median)", flush=True)
    reference = rows[0][2]["generated"]
    print(f"\nbatch 1, {a.threads} threads, {a.tokens} new tokens, median of {a.rounds}; peak RSS in GiB; 'same': "
          f"first new tokens equal to {rows[0][0]}'s")
    w = max(len(r[0]) for r in rows)
    print(f"| {'':{w}s} | tokens/s | peak RSS | peak RSS, all weights read | same | load average before, after |")
    print(f"|{'-' * (w + 2)}|----------|----------|----------------------------|------|---------------------------|")
    for label, load, d in rows:
        same = next((i for i, (x, y) in enumerate(zip(d["generated"], reference)) if x != y), len(reference))
        print(f"| {label:{w}s} | {d['tokens_per_second']:8.2f} | {d['peak_rss_mb'] / 1024:8.2f} | "
              f"{d['peak_rss_read_mb'] / 1024:26.2f} | {same:4d} | {load:>25s} |")
    print(json.dumps({"export": e, "teacher_forced": agreement, "rows": [{"label": r[0], **{k: v for k, v in r[2].items() if k != "generated"}}
                                            for r in rows]}))


def make_q4_k_m(ckpt: str, q4: Path, a) -> None:
    """llama.cpp Q4_K_M of the checkpoint (module docstring), made once."""
    if q4.is_file():
        return
    q8 = gguf_path(f"v2-lite-{a.layers}", "q8_0")
    if not q8.is_file():
        t = run_child(sys.executable, "convert", str(converter_dir(a.sdist)), ckpt, str(q8), "q8_0")
        print(f"llama.cpp converter -> Q8_0: {t['seconds']:.0f} s, {q8.stat().st_size / GIB:.2f} GiB", flush=True)
    t = run_child(str(a.llama_python), "quantize", str(q8), str(q4), "q4_k_m", a.threads, True, {Q_LORA_RANK_KEY: 0})
    print(f"llama_model_quantize Q8_0 -> Q4_K_M: {t['seconds']:.0f} s", flush=True)
    q8.unlink()


if __name__ == "__main__":
    main()
