"""Does quantizing DeepSeek Sparse Attention's lightning indexer change what it selects?  For a random
DeepSeek-V3.2-layout checkpoint (benchmarks/dsa_decode.py's layout) and a prompt of random tokens, each layer's
indexer is run on the float model's own inputs (teacher-forced, one layer at a time) twice: with its float weights,
and with its three matrices (`wq_b`, `wk`, `weights_proj`) computed as mtp-trt's QMatMul computes them (weights on
the scheme's grid, activations rounded to int8 per 8 values: plugins/ort_reference.py qmatmul).  Printed per
scheme, over every query token that sees more than index_topk rows: the share whose top-k set is unchanged, and
the mean share of the k rows kept.  Not run in CI.

  python benchmarks/dsa_quant.py [--tokens 1024] [--topk 128] [--block-size 32]"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch


class QuantLinear(torch.nn.Module):
    """A linear layer computed as the QMatMul op computes it (exporters/quantize.py's rewrite of its MatMul)."""

    def __init__(self, linear: torch.nn.Linear, scheme):
        super().__init__()
        from mtp_trt import quant

        self.scheme, self.k = scheme, linear.weight.shape[1]
        self.data, self.scales = quant.quantize(linear.weight.detach().numpy(), scheme)

    def forward(self, x):
        from mtp_trt.plugins.ort_reference import qmatmul

        flat = x.detach().reshape(-1, self.k).numpy()
        y = qmatmul(flat, self.data, self.scales, k=self.k, bits=self.scheme.bits, block_size=self.scheme.block_size)
        return torch.from_numpy(y.astype(np.float32)).reshape(*x.shape[:-1], -1)


def selections(indexer, inputs, k: int) -> torch.Tensor:
    """The indexer's causal top-k [S, S] (bool) over one sequence's rows, from its recorded inputs."""
    from mtp_trt.exporters.model import select_topk

    x, c_q, cos, sin = inputs
    with torch.no_grad():
        scores = indexer(x, c_q, cos, sin, indexer.keys(x, cos, sin))
    s = x.shape[1]
    return select_topk(scores, torch.ones(s, s, dtype=torch.bool).tril()[None], k)[0]


def main():
    import transformers

    from mtp_trt import quant
    from mtp_trt.exporters import model as model_module
    from mtp_trt.exporters.loader import load_checkpoint

    import dsa_decode

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--topk", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=32)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        config = transformers.DeepseekV32Config(**dsa_decode.LAYOUT, index_topk=args.topk,
                                                max_position_embeddings=args.tokens)
        transformers.DeepseekV32ForCausalLM(config).save_pretrained(Path(tmp) / "dsa")
        model = load_checkpoint(Path(tmp) / "dsa", max_positions=args.tokens)
    recorded = {}
    forward = model_module.Indexer.forward

    def record(self, x, c_q, cos, sin, keys):
        recorded[id(self)] = (x, c_q, cos, sin)
        return forward(self, x, c_q, cos, sin, keys)

    model_module.Indexer.forward = record
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, config.vocab_size, (1, args.tokens)))
    with torch.no_grad():
        model(tokens)
    model_module.Indexer.forward = forward
    indexers = [layer.self_attn.indexer for layer in model.model.layers]
    print(f"{args.tokens} tokens, index_topk {args.topk}, {len(indexers)} layers; query tokens that see more than "
          f"index_topk rows: {args.tokens - args.topk} per layer")
    print(f"{'indexer weights':<22} {'same top-k set':>15} {'rows kept':>10}")
    for name in ("int8", "int4"):
        scheme = quant.Scheme(name, args.block_size)
        same, kept = [], []
        for ix in indexers:
            want = selections(ix, recorded[id(ix)], args.topk)[args.topk:]
            floats = (ix.wq_b, ix.wk, ix.weights_proj)
            ix.wq_b, ix.wk, ix.weights_proj = (QuantLinear(m, scheme) for m in floats)
            got = selections(ix, recorded[id(ix)], args.topk)[args.topk:]
            ix.wq_b, ix.wk, ix.weights_proj = floats
            same.append((got == want).all(-1).float())
            kept.append((got & want).sum(-1).float() / args.topk)
        print(f"{name + ', block ' + str(args.block_size):<22} {torch.cat(same).mean().item():>14.1%} "
              f"{torch.cat(kept).mean().item():>10.2%}")


if __name__ == "__main__":
    main()
