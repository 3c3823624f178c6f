"""What one decode step costs, chain against tree: every step and tree graph of an export called
round-robin at batch 1 over a cache of realistic length, medians, each against step_0 (plain decoding) in the
same round; then each configuration's mean accepted tokens per step over the bench prompts, and the speedup
over step_0 those two figures predict (tokens per step / step cost).

The bound: what a tree would predict if everything it does beyond the chain of its depth were free except
verifying its extra rows -- step_D's cost plus the target graph's extra cost for N + 1 rows against D + 1 at the
same past_len (`verify_R`: the main model over R rows, timed in the same rounds).  A tree whose bound is below
the best chain's predicted speedup cannot beat the chain on the machine measured, however cheap its drafting and glue.

  python benchmarks/tree_step.py EXPORT_DIR [--rounds 200] [--past 80] [--new 128]   (--new 0: costs only)

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
        if name.startswith(("target_", "verify_")):  # the target graph over N tokens: prefill or at `past`
            ids = rng.integers(0, vocab, (1, int(name[7:]))).astype(np.int32)
            start = zero if name.startswith("target_") else pos
            calls[name] = lambda ids=ids, start=start: be.target(1, ids, start, zero, 0, 0.0, False)
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
    shapes = {t.graph: t for t in (parse_trees(spec)[0] for spec in trees)}  # tree graph -> its shape
    names = [f"step_{n}" for n in range(m.nextn + 1)] + list(shapes)
    verify = sorted({r for t in shapes.values() for r in (t.depth + 1, t.budget + 1)})
    names += [f"verify_{r}" for r in verify]
    be.allocate(1, args.past + 64)
    calls = step_calls(be, names, args.past)
    for fn in calls.values():  # sessions made, warm
        fn()
    times = {n: [] for n in names}
    for _ in range(args.rounds):
        for n, fn in calls.items():
            if n.startswith("verify_"):  # the verify calls share a session: each follows another session's run,
                calls["step_0"]()  # as every step and tree call does (waking a pool costs the same for all)
            t0 = time.perf_counter()
            fn()
            times[n].append(time.perf_counter() - t0)
    ids = [runner.encode(p) for p in PROMPTS]
    cost = {n: statistics.median(a / b for a, b in zip(times[n], times["step_0"])) for n in names}
    print(f"{m.root}: batch 1, past_len {args.past}, {args.rounds} rounds; tokens/step over {len(ids)} prompts, "
          f"{args.new} tokens each")
    print(f"{'graph':12s} {'ms':>7s} {'x step_0':>9s} {'tokens/step':>12s} {'predicted speedup':>18s} {'bound':>6s}")
    per_step, speed, bound = {}, {}, {}
    for n in names:
        if n.startswith("verify_"):
            continue
        shape = shapes.get(n)
        depth = int(n[5:]) if shape is None else shape.depth
        per_step[n] = tokens_per_step(be, ids, m, depth, shape, args.new) if args.new else float("nan")
        speed[n] = per_step[n] / cost[n]
        if shape is not None:  # the tree's extra verified rows are all it pays beyond step_D
            ideal = cost[f"step_{depth}"] + cost[f"verify_{shape.budget + 1}"] - cost[f"verify_{depth + 1}"]
            bound[n] = per_step[n] / ideal
        extra = f"{bound[n]:6.2f}" if n in bound else ""
        print(f"{n:12s} {statistics.median(times[n]) * 1e3:7.3f} {cost[n]:9.2f} {per_step[n]:12.2f} {speed[n]:18.2f} "
              f"{extra}")
    print(f"target graph over R rows at past_len {args.past} (x step_0): "
          + " ".join(f"{r}: {cost[f'verify_{r}']:.2f}" for r in verify))
    if args.new and bound:
        chain = max((n for n in speed if n.startswith("step_")), key=speed.get)
        gain = {n: per_step[n] - per_step[f"step_{shapes[n].depth}"] for n in bound}
        print(f"best chain {chain} {speed[chain]:.2f}; trees accepting >= 0.4 more tokens per step than the chain "
              f"of their depth: " + (", ".join(f"{n} {speed[n]:.2f} (bound {bound[n]:.2f}, +{gain[n]:.2f})"
                                               for n in bound if gain[n] >= 0.4) or "none"))


def tokens_per_step(be: OrtBackend, ids: list, m: Manifest, depth: int, shape, new: int) -> float:
    """Mean accepted tokens per step of greedy decoding (the chain of `depth`, or tree `shape`) over prompts ids."""
    opts = DecodeOptions(nextn=depth, max_new_tokens=new, think_ids=m.think_ids, tree=shape)
    steps = accepted = 0
    for x in ids:
        _, stats = generate(be, [x], opts)
        steps, accepted = steps + stats.num_drafts, accepted + stats.num_emitted_tokens
    return accepted / steps


if __name__ == "__main__":
    main()
