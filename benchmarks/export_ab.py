"""Two exports of one checkpoint side by side (e.g. two exporter revisions): their step graphs called round-robin at
batch 1 over a cache of realistic length, medians and the median per-call ratio B/A; then greedy decoding of the
bench prompts with each, tokens/s per round, medians.

  python benchmarks/export_ab.py EXPORT_A EXPORT_B [--graphs step_0,step_1,step_3,tree_2_2_4] [--calls 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

from tree_step import step_calls

from mtp_trt.bench import PROMPTS
from mtp_trt.decode import DecodeOptions, generate
from mtp_trt.manifest import Manifest
from mtp_trt.runner import Runner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--graphs", default="step_0,step_1,step_3")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--past", type=int, default=80, help="cache rows before the step")
    ap.add_argument("--rounds", type=int, default=3, help="decoding rounds (8 prompts, 128 tokens each)")
    args = ap.parse_args()
    names = args.graphs.split(",")
    runs = []
    for path in (args.a, args.b):
        runner = Runner(Manifest.load(path))
        runner.backend.allocate(1, args.past + 64)
        runs.append((runner, step_calls(runner.backend, names, args.past)))
    times = {(i, n): [] for i in range(2) for n in names}
    for _ in range(args.calls):
        for i, (_, calls) in enumerate(runs):
            for n in names:
                t0 = time.perf_counter()
                calls[n]()
                times[i, n].append(time.perf_counter() - t0)
    for n in names:
        a, b = times[0, n], times[1, n]
        print(f"{n:12s} A {statistics.median(a) * 1e3:.3f} ms  B {statistics.median(b) * 1e3:.3f} ms  "
              f"B/A {statistics.median(y / x for x, y in zip(a, b)):.3f}")
    ids = [runs[0][0].encode(p) for p in PROMPTS]
    for nextn in (0, 1):
        rates = [[], []]
        for _ in range(args.rounds):
            for i, (runner, _) in enumerate(runs):
                opts = DecodeOptions(nextn=nextn, max_new_tokens=128, think_ids=runner.manifest.think_ids)
                t0 = time.perf_counter()
                for x in ids:
                    generate(runner.backend, [x], opts)
                rates[i].append(128 * len(ids) / (time.perf_counter() - t0))
        a, b = (statistics.median(r) for r in rates)
        print(f"decode nextn {nextn}: A {a:.0f}  B {b:.0f} tokens/s  (B/A {b / a:.3f})")


if __name__ == "__main__":
    main()
