"""Decode step time against the context: DeepSeek Sparse Attention (top index_topk rows) beside dense MLA, on ONNX
Runtime, for one random DeepSeek-V3.2-layout checkpoint exported three times: as written, on mtp-trt's CPU operators
(DSA: LightningIndexer and MlaAttention over the selected rows) and in standard ONNX operators (`--no-cpu-ops`:
DSA std), and as DeepSeek-V3 with its indexer tensors dropped (dense: the same weights attending to every row, on
the CPU attention operator).  Each context's cache is filled with random rows and the plain decode step
(step_0.onnx, one token) timed, the exports interleaved; medians over --reps calls, three interleaved rounds; the
ratios are the medians of the rounds' ratios.

  python benchmarks/dsa_decode.py [--contexts 1024 4096 16384] [--topk 512] [--reps 20] [--threads 2]"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

# V3.2's layout at a small size: q LoRA, 16 heads, one dense layer then MoE layers, a 16-head indexer
LAYOUT = dict(vocab_size=2048, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=3,
              num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=256, q_lora_rank=384, qk_nope_head_dim=64,
              qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
              n_group=1, topk_group=1, first_k_dense_replace=1, index_n_heads=16, index_head_dim=64,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)


def checkpoints(root: Path, topk: int, max_positions: int) -> dict[str, Path]:
    """{"dsa": the V3.2 checkpoint, "dense": the same weights as DeepSeek-V3 without the indexer}."""
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    config = transformers.DeepseekV32Config(**LAYOUT, index_topk=topk, max_position_embeddings=max_positions)
    transformers.DeepseekV32ForCausalLM(config).save_pretrained(root / "dsa")
    dense = root / "dense"
    dense.mkdir()
    tensors = load_file(root / "dsa" / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".indexer." not in k}, dense / "model.safetensors",
              metadata={"format": "pt"})
    cfg = json.loads((root / "dsa" / "config.json").read_text())
    for key in ("index_topk", "index_n_heads", "index_head_dim", "layer_types", "mlp_layer_types"):
        cfg.pop(key)
    (dense / "config.json").write_text(json.dumps(cfg | {"architectures": ["DeepseekV3ForCausalLM"],
                                                         "model_type": "deepseek_v3"}))
    return {"dsa": root / "dsa", "dense": dense}


def step_time(backend, context: int, reps: int) -> float:
    """Median seconds of one plain decode step at past_len = context (rows before it random)."""
    one = np.ones(1, np.int32)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        backend.step(1, np.array([[7]], np.int32), one * context, one * 0, 0, 0.0)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    from mtp_trt.backend import OrtBackend
    from mtp_trt.exporters.export import export
    from mtp_trt.manifest import Manifest

    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    rows = max(args.contexts) + 1
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        backends = {}
        ckpts = checkpoints(root, args.topk, rows)
        for name, ckpt, cpu_ops in [("dsa", ckpts["dsa"], True), ("dsa std", ckpts["dsa"], False),
                                    ("dense", ckpts["dense"], True)]:
            out = export(ckpt, root / f"{name.replace(' ', '-')}-export", nextn=0, max_seq_len=rows, max_batch=1, trees="none",
                         cpu_ops=cpu_ops)
            backends[name] = OrtBackend(Manifest.load(out), threads=args.threads)
        rng = np.random.default_rng(0)
        print(f"index_topk {args.topk}; decode step (one token), median of {args.reps}, {args.threads} threads")
        print(f"{'context':>8}  {'DSA ms':>8}  {'DSA std ms':>10}  {'dense ms':>9}  {'dense/DSA':>9}  "
              f"{'dense/DSA std':>13}")
        for context in args.contexts:
            for b in backends.values():
                b.allocate(1, context + 1)
                for cache in b.caches["target"]:
                    cache[:] = rng.standard_normal(cache.shape, np.float32)
                step_time(b, context, 3)  # warm-up
            ms = {name: [] for name in backends}
            for _ in range(3):  # interleaved rounds
                for name, b in backends.items():
                    ms[name].append(step_time(b, context, args.reps) * 1e3)
            med = {name: statistics.median(v) for name, v in ms.items()}
            ratio = {name: statistics.median(d / s for d, s in zip(ms["dense"], ms[name]))  # per interleaved round
                     for name in ("dsa", "dsa std")}
            print(f"{context:>8}  {med['dsa']:>8.2f}  {med['dsa std']:>10.2f}  {med['dense']:>9.2f}  "
                  f"{ratio['dsa']:>9.2f}  {ratio['dsa std']:>13.2f}")


if __name__ == "__main__":
    main()
