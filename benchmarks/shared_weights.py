"""Decode speed with one shared copy of the weights (no pre-packing) against a pre-packed copy per session,
interleaved in one process: python benchmarks/shared_weights.py EXPORT_DIR [--nextn 0 1 3] [--tokens 128]"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("export", type=Path)
    ap.add_argument("--nextn", type=int, nargs="+", default=[0, 1, 3])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from mtp_trt.backend import OrtBackend
    from mtp_trt.decode import DecodeOptions, generate
    from mtp_trt.manifest import Manifest

    manifest = Manifest.load(a.export)
    backends = {name: OrtBackend(manifest, threads=a.threads, share_weights=share)
                for name, share in (("shared", True), ("pre-packed", False))}
    prompt = list(range(3, 40))
    for nextn in a.nextn:
        opts = DecodeOptions(nextn=nextn, max_new_tokens=a.tokens)
        for b in backends.values():
            generate(b, [prompt], opts)
        times = {name: [] for name in backends}
        for _ in range(a.rounds):
            for name, b in backends.items():
                t0 = time.perf_counter()
                generate(b, [prompt], opts)
                times[name].append(time.perf_counter() - t0)
        speed = {name: a.tokens / statistics.median(ts) for name, ts in times.items()}
        print(f"nextn {nextn}: " + ", ".join(f"{n} {s:.0f} tokens/s" for n, s in speed.items())
              + f"; shared / pre-packed {speed['shared'] / speed['pre-packed']:.2f}")


if __name__ == "__main__":
    main()
