"""Weight-level error of mtp-trt's quantization (mtp_trt/quant.py), and what re-quantizing an official FP8 block
checkpoint costs.  Not run in CI.

For every 2-D weight of a checkpoint (default: the demo, samples/demo-model) that `--quant` quantizes, the
relative RMS error ||W' - W|| / ||W|| of each scheme and block size, summed over the weights:

* against the checkpoint's own weights (fp32 / bf16);
* for FP8 checkpoints: the weights first stored as the official DeepSeek-V3 FP8 layout does (float8_e4m3fn with
  one float32 scale per 128 x 128 block, exporters/loader.py quantize_fp8), then quantized by mtp-trt from those
  FP8 values (what `export --quant` does with an FP8 checkpoint: each tensor dequantized as it is read, then
  quantized) -- the error against the FP8 weights (what re-quantizing adds) and against the original weights
  (FP8's own error plus that).

  python benchmarks/quant_error.py [--checkpoint DIR] [--block-sizes 32 64 128]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def weights(ckpt: Path):
    """(name, W [N, K] float32) of every 2-D weight `--quant` quantizes (not the router)."""
    import torch
    from safetensors import safe_open as open_st

    files = sorted(ckpt.glob("*.safetensors"))
    for f in files:
        with open_st(str(f), framework="pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                if t.dim() == 2 and t.is_floating_point() and not name.endswith("mlp.gate.weight") \
                        and t.numel() >= 4096 and "scale_inv" not in name:
                    yield name, t.to(torch.float32).numpy()


def main() -> None:
    import torch

    from mtp_trt import quant
    from mtp_trt.exporters.loader import dequantize_fp8, quantize_fp8

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "samples" / "demo-model")
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[32, 64, 128])
    args = ap.parse_args()
    schemes = [quant.Scheme(n, b) for n in ("int8", "int4") for b in args.block_sizes]
    err = {s: [0.0, 0.0, 0.0] for s in schemes}  # squared error vs W, vs FP8(W); FP8's own vs W in [2]
    total = fp8_err = 0.0
    count = 0
    for name, w in weights(args.checkpoint):
        count += w.size
        total += float(np.square(w, dtype=np.float64).sum())
        fp8 = dequantize_fp8(*quantize_fp8(torch.from_numpy(w))).numpy()
        fp8_err += float(np.square(fp8 - w, dtype=np.float64).sum())
        for s in schemes:
            back = quant.dequantize(*quant.quantize(w, s), w.shape[1], s.bits)
            again = quant.dequantize(*quant.quantize(fp8, s), w.shape[1], s.bits)
            err[s][0] += float(np.square(back - w, dtype=np.float64).sum())
            err[s][1] += float(np.square(again - fp8, dtype=np.float64).sum())
            err[s][2] += float(np.square(again - w, dtype=np.float64).sum())
    print(f"{args.checkpoint}: {count / 1e6:.1f}M weights quantized; relative RMS error ||W' - W|| / ||W||")
    print(f"FP8 e4m3, 128x128 block scales (the official layout), against the weights: {np.sqrt(fp8_err / total):.4f}")
    print(f"{'scheme':<10} {'bits/weight':>11} {'from the weights':>17} {'from FP8: vs FP8':>17} {'vs the weights':>15}")
    for s in schemes:
        bpw = s.bits + 32 / s.block_size
        print(f"{s.tag:<10} {bpw:>11.2f} {np.sqrt(err[s][0] / total):>17.4f} {np.sqrt(err[s][1] / total):>17.4f} "
              f"{np.sqrt(err[s][2] / total):>15.4f}")


if __name__ == "__main__":
    main()
