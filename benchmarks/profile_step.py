"""Where one decode step's time goes: ONNX Runtime's profiler (time per operator type in the step graph, node
count) and Python's (the decode loop around the graph calls: alone, inside the decode, and profiled), batch 1,
greedy.

  python benchmarks/profile_step.py EXPORT_DIR [--nextn 0] [--tokens 64] [--prompt-tokens 57] [--threads 2]
                                   [--pack auto|on|off]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import tempfile
import time
from pathlib import Path

import numpy as np

PROMPT = list(range(3, 60))  # (--prompt-tokens N: these ids repeated to N tokens)


class Timed:
    """An InferenceSession whose run() and run_with_iobinding() add up their wall time and, in `gaps` (shared by
    every Timed), the wall time from the end of the last graph call (of any session) to the start of this one."""

    gaps: list[float] = []
    last_end: list[float | None] = [None]

    def __init__(self, session):
        self.session, self.seconds = session, 0.0

    def io_binding(self):
        return self.session.io_binding()

    def _start(self) -> float:
        t0 = time.perf_counter()
        if self.last_end[0] is not None:
            self.gaps.append(t0 - self.last_end[0])
        return t0

    def _end(self, t0: float) -> None:
        self.last_end[0] = time.perf_counter()
        self.seconds += self.last_end[0] - t0

    def run(self, *args, **kwargs):
        t0 = self._start()
        out = self.session.run(*args, **kwargs)
        self._end(t0)
        return out

    def run_with_iobinding(self, *args, **kwargs):
        t0 = self._start()
        self.session.run_with_iobinding(*args, **kwargs)
        self._end(t0)


class Recorded:
    """A stand-in for an InferenceSession: its first run's outputs for every later run with the same outputs asked
    (a bound call's outputs stay as its first run left them)."""

    def __init__(self, session):
        self.session, self.outputs = session, {}

    def io_binding(self):
        return self.session.io_binding()

    def run(self, names, feed, *args):
        if tuple(names) not in self.outputs:
            self.outputs[tuple(names)] = self.session.run(names, feed, *args)
        return list(self.outputs[tuple(names)])

    def run_with_iobinding(self, *args):
        pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("export", type=Path)
    ap.add_argument("--nextn", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=len(PROMPT),
                    help="prompt length (a long one: the attention over a long cache)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-share", action="store_true", help="OrtBackend(share_weights=False); default: its own choice")
    ap.add_argument("--pack", choices=["auto", "on", "off"], default="auto",
                    help="OrtBackend(pack_weights=...): the quantized operators pack their weights; "
                         "auto: its own choice")
    a = ap.parse_args()
    from mtp_trt.backend import OrtBackend
    from mtp_trt.decode import DecodeOptions, generate
    from mtp_trt.manifest import Manifest

    manifest = Manifest.load(a.export)
    prompt = [PROMPT[i % len(PROMPT)] for i in range(a.prompt_tokens)]
    pack = {"auto": None, "on": True, "off": False}[a.pack]

    def make_backend():
        return OrtBackend(manifest, threads=a.threads, share_weights=False if a.no_share else None,
                          pack_weights=pack)

    opts = DecodeOptions(nextn=a.nextn, max_new_tokens=a.tokens)
    step = f"step_{a.nextn}"

    # 0. Python alone: the sessions replaced by stand-ins that return one real run's outputs (CPU time, so that
    #    other work on the machine hardly moves it)
    backend = make_backend()
    generate(backend, [prompt], opts)
    real = dict(backend.sessions)
    backend.bound.clear()  # bind the stand-ins' calls afresh
    backend.sessions.update({name: Recorded(s) for name, s in real.items()})
    per_step = []
    for _ in range(7):
        t0 = time.process_time()
        _, stats = generate(backend, [prompt], opts)
        per_step.append((time.process_time() - t0) / stats.steps)
    backend.sessions.update(real)
    backend.bound.clear()
    print(f"Python around the graph calls (stand-in sessions, CPU time, best of 7 decodes): {min(per_step) * 1e6:.1f} "
          f"us per step")

    # 1. wall time of whole decodes, the share spent outside ONNX Runtime, Python in the decode itself (from the end
    #    of one graph call to the start of the next: more than the stand-ins' figure, as a graph call streams the
    #    weights through the CPU's caches and the Python after it runs with its code and data out of them), and
    #    Python's profile
    timed = {name: Timed(s) for name, s in backend.sessions.items()}
    backend.sessions.update(timed)
    backend.bound.clear()
    graph_seconds = lambda: sum(s.seconds for s in timed.values())  # noqa: E731
    walls, outside, between = [], [], []
    for _ in range(5):
        for s in timed.values():
            s.seconds = 0.0
        Timed.last_end[0] = None
        Timed.gaps.clear()
        t0 = time.perf_counter()
        seqs, stats = generate(backend, [prompt], opts)
        walls.append(time.perf_counter() - t0)
        outside.append(walls[-1] - graph_seconds())
        between += Timed.gaps[1:]  # (the first: from the prompt's pass to the first step)
    print(f"Python around the graph calls in the decode (wall time between two graph calls, median of "
          f"{len(between)}): {np.median(between) * 1e6:.1f} us per step")
    wall, steps = sorted(walls)[2], stats.steps
    print(f"outside ONNX Runtime (no profiler, median of 5 decodes): {sorted(outside)[2] * 1e3 / steps:.3f} ms per "
          f"step of {wall * 1e3 / steps:.3f} ms")
    backend.sessions.update({name: s.session for name, s in timed.items()})
    backend.bound.clear()
    prof = cProfile.Profile()
    prof.enable()
    generate(backend, [prompt], opts)
    prof.disable()
    ps = pstats.Stats(prof)
    run_time = sum(v[3] for k, v in ps.stats.items() if k[2] in ("run", "run_with_iobinding")
                   and "onnxruntime" in k[0])
    total = sum(v[2] for v in ps.stats.values())  # self time of everything
    print(f"decode of {a.tokens} tokens (prompt {len(prompt)}): {wall * 1e3:.1f} ms wall, "
          f"{len(seqs[0].generated) / wall:.1f} tokens/s; steps {steps}")
    print(f"Python profile: {total * 1e3:.1f} ms in all, of which ONNX Runtime's runs {run_time * 1e3:.1f} ms: "
          f"{(total - run_time) * 1e3 / a.tokens:.3f} ms per token outside ONNX Runtime (profiler overhead included)")
    ps.sort_stats("tottime").print_stats(8)

    # 2. ONNX Runtime's profile of the step graph
    with tempfile.TemporaryDirectory() as tmp:
        prof_backend = make_backend()
        base = prof_backend.session_options

        def profiled(file, *args):
            o = base(file, *args)
            if file == manifest.graphs[step].file:
                o.enable_profiling = True
                o.profile_file_prefix = str(Path(tmp) / "ort")
            return o

        prof_backend.session_options = profiled
        generate(prof_backend, [prompt], opts)
        path = prof_backend.session(step).end_profiling()
        events = json.loads(Path(path).read_text())
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    by_type, count, weight_bytes = collections.Counter(), collections.Counter(), collections.Counter()
    per_run_nodes = collections.Counter()
    cfg = manifest.config
    import onnx
    from onnx import helper

    graph = onnx.load(str(manifest.root / manifest.graphs[step].file), load_external_data=False).graph
    const = {t.name: helper.tensor_dtype_to_np_dtype(t.data_type).itemsize * int(np.prod(t.dims))
             for t in graph.initializer}
    # the share of each constant input a step reads: the routed experts' (MoE: fc1, fc2; QMoE: fc1, its scales,
    # fc2, its scales) at the share of experts the step's tokens select, MLA's rope tables (cos, sin) one row of
    # thousands (none), everything else whole
    routed = min(1.0, (a.nextn + 1) * cfg.num_experts_per_tok / max(cfg.n_routed_experts, 1))
    shares = {"MoE": {3: routed, 4: routed}, "QMoE": {i: routed for i in range(3, 7)},
              "MlaSelfAttention": {4: 0.0, 5: 0.0}}
    node_weights = {n.name: sum(const.get(x, 0) * shares.get(n.op_type, {}).get(i, 1.0) for i, x in enumerate(n.input))
                    for n in graph.node}
    for e in nodes:
        op = e["args"]["op_name"]
        by_type[op] += e["dur"]
        # constant inputs: all of a MatMul's weights; the MoE node's experts at the share its tokens select
        # (from the ONNX file where the node kept its name: a pre-packed weight is no longer the kernel's input)
        size = node_weights.get(e["name"].removesuffix("_kernel_time"), int(e["args"].get("parameter_size", 0)))
        weight_bytes[op] += size
        per_run_nodes[e["name"]] += 1
    n_runs = max(len(runs), 1)
    for name in per_run_nodes:
        count[name] = 1
    run_us = sorted(e["dur"] for e in runs)
    print(f"\nONNX Runtime profile of {step}: {len(per_run_nodes)} kernels per run, {n_runs} runs, "
          f"median run {run_us[len(run_us) // 2] / 1e3:.3f} ms; kernel time by operator type (per run):")
    total_us = sum(by_type.values())
    for op, us in by_type.most_common(15):
        rate = f"  weights {weight_bytes[op] / n_runs / 1e6:6.1f} MB at {weight_bytes[op] / us / 1e3:5.1f} GB/s" \
            if weight_bytes[op] > 1e6 * n_runs else ""
        print(f"  {op:24s} {us / n_runs / 1e3:8.3f} ms  {100 * us / total_us:5.1f}%{rate}")
    print(f"  {'(sum of kernels)':24s} {total_us / n_runs / 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
