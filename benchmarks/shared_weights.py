"""OrtBackend's weight and thread settings compared, interleaved in one process (medians and best runs):
python benchmarks/shared_weights.py EXPORT_DIR [--nextn 0 1 3] [--tokens 128] [--variants shared step-packed ...]

Variants (each an OrtBackend over the same export, greedy decoding, batch 1):
  shared       one shared copy of the weights, no pre-packing anywhere
  step-packed  shared, the step graphs pre-packing a private copy of their dense weights (the default)
  copies       every session its own pre-packed copy (share_weights=False)
  spinning     step-packed, with ONNX Runtime's threads spinning between kernels (allow_spinning 1)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

VARIANTS = {"shared": dict(share_weights=True, prepack=()), "step-packed": dict(share_weights=True),
            "copies": dict(share_weights=False), "spinning": dict(share_weights=True)}


def backend(manifest, threads: int, variant: str):
    from mtp_trt.backend import OrtBackend

    b = OrtBackend(manifest, threads=threads, **VARIANTS[variant])
    b.spin = variant == "spinning"
    return b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("export", type=Path)
    ap.add_argument("--nextn", type=int, nargs="+", default=[0, 1, 3])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    a = ap.parse_args()
    from mtp_trt.decode import DecodeOptions, generate
    from mtp_trt.manifest import Manifest

    manifest = Manifest.load(a.export)
    backends = {name: backend(manifest, a.threads, name) for name in a.variants}
    prompt = list(range(3, 40))
    for nextn in a.nextn:
        opts = DecodeOptions(nextn=nextn, max_new_tokens=a.tokens)
        tokens = {name: generate(b, [prompt], opts)[0][0].generated for name, b in backends.items()}
        times = {name: [] for name in backends}
        for _ in range(a.rounds):
            for name, b in backends.items():
                t0 = time.perf_counter()
                generate(b, [prompt], opts)
                times[name].append(time.perf_counter() - t0)
        same = len({tuple(t) for t in tokens.values()}) == 1
        print(f"nextn {nextn} (same tokens: {same}): " + ", ".join(
            f"{n} {a.tokens / statistics.median(ts):.0f} tokens/s (best {a.tokens / min(ts):.0f})"
            for n, ts in times.items()), flush=True)


if __name__ == "__main__":
    main()
