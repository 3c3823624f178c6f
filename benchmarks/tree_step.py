"""What one decode step costs, chain against tree (issue #15): every step and tree graph of an eagle export called
round-robin at batch 1 over a cache of realistic length, medians, each against step_0 (plain decoding) in the
same round; then each configuration's mean accepted tokens per step over the bench prompts, and the speedup
over step_0 those two figures predict (tokens per step / step cost).

  python benchmarks/tree_step.py EXPORT_DIR [--rounds 200] [--past 80] [--new 128]

An export with several trees: mtp-trt export samples/demo-model -o out/trees --nextn 4 --trees 2:2:4,3:2:6,...
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from mtp_trt.backend import OrtBackend
from mtp_trt.bench import PROMPTS
from mtp_trt.decode import DecodeOptions, generate
from mtp_trt.manifest import Manifest
from mtp_trt.runner import Runner
from mtp_trt.tree import parse_trees


def step_calls(be: OrtBackend, names: list[str], past: int, seed: int = 0) -> dict:
    """{graph: a zero-argument call of it on slot 0 at past_len = past} with random tokens and a chain-shaped
    tree (the cost of a step does not depend on the values); "target_N": prefill of N tokens."""
    rng = np.random.default_rng(seed)
    vocab, zero = be.manifest.config.vocab_size, np.zeros(1, np.int32)
    pos = np.array([past], np.int32)
    calls = {}
    for name in names:
        if name.startswith("target_"):  # prefill: the target graph over a prompt of N tokens at past_len 0
            ids = rng.integers(0, vocab, (1, int(name[7:]))).astype(np.int32)
            calls[name] = lambda ids=ids: be.target(1, ids, zero, zero, 0, 0.0, False)
        elif name.startswith("step_"):
            ids = rng.integers(0, vocab, (1, int(name[5:]) + 1)).astype(np.int32)
            calls[name] = lambda ids=ids: be.step(1, ids, pos, zero, 0, 0.0)
        else:
            budget = int(name.split("_")[3])
            ids = rng.integers(0, vocab, (1, budget + 1)).astype(np.int32)
            parents = np.arange(budget, dtype=np.int32)[None]
            calls[name] = lambda n=name, ids=ids, p=parents: be.tree_step(n, 1, ids, p, pos, zero, 0, 0.0)
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--past", type=int, default=80, help="cache rows before the step")
    ap.add_argument("--new", type=int, default=128, help="tokens per prompt for the tokens-per-step figures")
    args = ap.parse_args()
    m = Manifest.load(args.export)
    runner = Runner(m)
    be = runner.backend
    trees = list(m.raw.get("trees") or [])
    names = [f"step_{n}" for n in range(m.nextn + 1)] + [parse_trees(t)[0].graph for t in trees]
    be.allocate(1, args.past + 64)
    calls = step_calls(be, names, args.past)
    for fn in calls.values():  # sessions made, warm
        fn()
    times = {n: [] for n in names}
    for _ in range(args.rounds):
        for n, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[n].append(time.perf_counter() - t0)
    ids = [runner.encode(p) for p in PROMPTS]
    print(f"{m.root}: batch 1, past_len {args.past}, {args.rounds} rounds; tokens/step over {len(ids)} prompts")
    print(f"{'graph':12s} {'ms':>7s} {'x step_0':>9s} {'tokens/step':>12s} {'predicted speedup':>18s}")
    for n in names:
        cost = statistics.median(a / b for a, b in zip(times[n], times["step_0"]))
        if n.startswith("step_"):
            opts = DecodeOptions(nextn=int(n[5:]), max_new_tokens=args.new, think_ids=m.think_ids)
        else:
            shape = parse_trees(n[5:].replace("_", ":"))[0]
            opts = DecodeOptions(nextn=shape.depth, max_new_tokens=args.new, think_ids=m.think_ids, tree=shape)
        steps = accepted = 0
        for x in ids:
            _, stats = generate(be, [x], opts)
            steps, accepted = steps + stats.seq_steps, accepted + stats.accepted_tokens
        per_step = accepted / steps
        print(f"{n:12s} {statistics.median(times[n]) * 1e3:7.3f} {cost:9.2f} {per_step:12.2f} {per_step / cost:18.2f}")


if __name__ == "__main__":
    main()
