"""`mtp-trt bench`: tokens/s of MTP speculative decoding for nextn 0..K (and each export's trees), at one or
more batch sizes, beside Hugging Face transformers' greedy `generate` on the same checkpoint, in one run.

Two sweeps: QUICK, the default (eagle mode at batch 1, 128 tokens, 5 rounds: under a minute on the demo
checkpoint on a 2-core CPU, its export included), and FULL (`--full`: both modes at batches 1 and 8, 128 tokens,
9 rounds, transformers' generate beside).  Batch 1 decodes
each of the 8 prompts alone, in turn; batch b > 1 decodes b prompts together.  Figures are medians over
repeats, and the configurations of one batch size are timed round-robin; ratios are medians of per-round
ratios, so they compare runs made moments apart (these machines are shared and noisy).  A line per
configuration and per round says how long is left.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

from mtp_trt.decode import Stats, generate
from mtp_trt.fsutil import atomic_file, write_atomic
from mtp_trt.runner import Runner, demo_model, resolve_export
from mtp_trt.tree import parse_trees

# Code prompts in the demo model's domain (the Python standard library's style).
PROMPTS = [
    "def _get_default_tempdir():\n    \"\"\"Calculate the default directory to use for temporary files.\n",
    "class OrderedSet:\n    def __init__(self, iterable=None):\n        self._data = {}\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__,",
    "def isabs(s):\n    \"\"\"Test whether a path is absolute\"\"\"\n    s = os.fspath(s)\n",
    "        try:\n            f = open(filename, 'rb')\n        except OSError:\n",
    "    @property\n    def name(self):\n        \"\"\"Return the name of the",
    "for i in range(len(self.items)):\n    if self.items[i] is None:\n",
]


@dataclasses.dataclass(frozen=True)
class Sweep:
    """What `mtp-trt bench` times: the MTP modes, batch sizes, tokens per sequence, rounds, and whether
    transformers' generate is timed beside (where it is installed)."""

    modes: tuple[str, ...]
    batches: tuple[int, ...]
    max_new_tokens: int
    repeats: int
    transformers: bool


QUICK = Sweep(("eagle",), (1,), 128, 5, False)  # (transformers' generate alone would take minutes on a CPU)
FULL = Sweep(("eagle", "vanilla"), (1, 8), 128, 9, True)


def load_average() -> tuple[float, float, float] | None:
    """The machine's load average over 1, 5 and 15 minutes (busy or waiting threads), or None where the system
    does not say."""
    import os

    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except (AttributeError, OSError):
        return None


def load_line(start, end, cores: int, threads: int) -> str:
    """The line `bench` prints beside its figures: the 1-minute load average before and after the timing."""
    if start is None or end is None:
        return "load average: not available on this system"
    return (f"load average (1 minute): {start[0]:.2f} before, {end[0]:.2f} after the timing; {cores} usable "
            f"core{'s' if cores != 1 else ''}, {threads} thread{'s' if threads != 1 else ''} per graph")


def load_warning(start, end, cores: int, threads: int) -> str | None:
    """A warning where the machine was busy: before the timing, the 1-minute load left fewer idle cores than the
    `threads` it needs (one busy core per thread, half a core of slack); after it, the load was above the cores
    (the benchmark's own threads and others' together).  Figures taken so run slow."""
    if start is None or end is None:
        return None
    if cores - start[0] < threads - 0.5:
        busy = f"before the timing the 1-minute load average was {start[0]:.2f} on {cores} usable cores"
    elif end[0] > cores + 0.5:
        busy = f"during the timing the 1-minute load average rose to {end[0]:.2f} on {cores} usable cores"
    else:
        return None
    return (f"warning: {busy}, so the benchmark's {threads} thread{'s' if threads != 1 else ''} per graph did not "
            f"have a core each: the figures are lower than on a quiet machine")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def _round_robin(jobs: dict, repeats: int, progress=lambda line: None, name=str, later: int = 0) -> dict:
    """{key: fn} -> {key: (seconds of each round, last result)}.  One warm-up call each, then `repeats` rounds
    that call every job once in turn, so a machine that drifts (shared, throttled) slows all alike; ratios are
    then taken within each round (see ratio).  `progress(line)`: a line per job once its warm-up is timed
    (`name(key)` names it) and one per round, each with an estimate of the time left (jobs not yet timed are taken
    to cost the mean of those timed; `later` more sets of jobs like these follow, each taken to cost as much)."""
    results, first = {}, {}
    for i, (key, fn) in enumerate(jobs.items()):
        t0 = time.perf_counter()
        results[key] = fn()  # warm-up
        first[key] = time.perf_counter() - t0
        per_round = sum(first.values()) * len(jobs) / len(first)
        left = per_round * (len(jobs) - i - 1) / len(jobs) + per_round * repeats + later * per_round * (repeats + 1)
        progress(f"[{i + 1}/{len(jobs)}] {name(key)}: {first[key]:.2f} s a call; about {_duration(left)} left")
    times = {key: [] for key in jobs}
    for r in range(repeats):
        t_round = time.perf_counter()
        for key, fn in jobs.items():
            t0 = time.perf_counter()
            results[key] = fn()
            times[key].append(time.perf_counter() - t0)
        per_round = time.perf_counter() - t_round
        left = per_round * (repeats - r - 1) + later * per_round * (repeats + 1)
        progress(f"round {r + 1} of {repeats} timed; about {_duration(left)} left")
    return {key: (times[key], results[key]) for key in jobs}


def ratio(a: dict, b: dict) -> float:
    """tokens/s of row a over row b: the median of the per-round ratios when both were timed in the same
    rounds (drift between rounds cancels), else the ratio of the medians."""
    ra, rb = a.get("round_seconds"), b.get("round_seconds")
    if ra and rb and len(ra) == len(rb):
        return statistics.median((a["tokens"] / x) / (b["tokens"] / y) for x, y in zip(ra, rb))
    return a["tokens_per_second"] / b["tokens_per_second"]


def _transformers_generate(checkpoint: Path, device: str = "cpu"):
    """A greedy-generate function of transformers' class for the checkpoint's architecture (main model) for a batch
    of prompts."""
    import torch
    import transformers
    from tokenizers import Tokenizer
    from transformers.utils import logging as hf_logging

    from mtp_trt.config import ModelConfig

    hf_logging.set_verbosity_error()  # the MTP layers are "unexpected" weights to transformers: expected here
    hf_logging.disable_progress_bar()  # (bench's own lines say how far along it is)
    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    model_class = getattr(transformers, ModelConfig.from_file(checkpoint).architecture)
    model = model_class.from_pretrained(checkpoint, dtype=torch.float32).eval().to(device)
    pad = model.config.pad_token_id or 0

    def make(prompts: list[str], max_new_tokens: int):
        ids = [tok.encode(p).ids for p in prompts]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)

        def run():
            with torch.no_grad():
                out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                     min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
            if device != "cpu":
                torch.cuda.synchronize()
            return out
        return run
    return make


def run(model: str | Path | None, batches: list[int], max_new_tokens: int, repeats: int, transformers: bool = True,
        progress=print, threads: int | None = None, scheme=None, modes: tuple[str, ...] = ("eagle", "vanilla"),
        note=lambda line: None) -> list[dict]:
    """tokens/s of every (mode, nextn) on ONNX Runtime (the weights quantized as `scheme` says) and of
    transformers' greedy `generate` (the main model, same prompts); per batch size, all of them are timed
    round-robin (see _round_robin).  `progress`: the figures, a line each; `note`: how far along it is."""
    ckpt = Path(model) if model else demo_model()
    runners = {("mtp-trt/onnxruntime", mode): Runner(resolve_export(ckpt, mode, progress=note, scheme=scheme,
                                                                    batch=max(batches)), threads=threads)
               for mode in modes}
    return time_runners(runners, _transformers_generate(ckpt) if transformers else None, batches, max_new_tokens,
                        repeats, progress, note)


def default_batches(model: Path, sweep: Sweep = QUICK) -> list[int]:
    """`mtp-trt bench`'s batch sizes when none are given: the sweep's, within an engine directory's max_batch."""
    if (model / "engines.json").is_file():
        from mtp_trt.trt import manifest as em

        top = em.EngineManifest.load(model).max_batch
        return sorted({min(b, top) for b in sweep.batches})
    return list(sweep.batches)


def check_batches(model: Path, batches: list[int], max_new_tokens: int) -> None:
    """--batch against what it implies, before any work: an engine directory's export decodes at most its
    max_batch; a checkpoint's caches (exported for the largest batch) must fit this machine's memory."""
    from mtp_trt.config import ModelConfig
    from mtp_trt.errors import MtpTrtError
    from mtp_trt.validate import cache_bytes, check_memory

    if (model / "engines.json").is_file():
        from mtp_trt.trt import manifest as em

        top = em.EngineManifest.load(model).max_batch
        if max(batches) > top:
            raise MtpTrtError(f"--batch {max(batches)}: the engines ({model}) decode at most max_batch {top} "
                              f"sequences at once")
        return
    cfg = ModelConfig.from_file(model)
    rows = min(cfg.max_position_embeddings, max(map(len, PROMPTS)) + max_new_tokens + 2 * cfg.num_nextn_predict_layers + 2)
    check_memory(cache_bytes(cfg, cfg.num_hidden_layers + max(cfg.num_nextn_predict_layers, 1), max(batches), rows, 4),
                 f"--batch {max(batches)} x --max-new-tokens {max_new_tokens}: the caches of {model}")


def run_engines(engine_dir: Path, batches: list[int], max_new_tokens: int, repeats: int, transformers: bool = True,
                progress=print, threads: int | None = None, note=lambda line: None) -> list[dict]:
    """An engine directory's TensorRT engines (with and without CUDA graphs) beside ONNX Runtime on the onnx
    export of the same checkpoint and transformers' `generate` on the GPU, in the same round-robin rounds."""
    from mtp_trt.trt import manifest as em
    from mtp_trt.trt.runtime import TrtBackend

    exp = em.load_export_manifest(engine_dir)
    ckpt = Path(exp.raw.get("checkpoint") or "")
    graphs = TrtBackend(engine_dir, command="bench")
    plain = TrtBackend(engine_dir, cuda_graphs=False, share=graphs)  # the same engines, loaded once
    runners = {("mtp-trt/tensorrt", exp.mtp_mode): Runner(exp, graphs),
               ("mtp-trt/tensorrt (no CUDA graphs)", exp.mtp_mode): Runner(exp, plain)}
    if (ckpt / "config.json").is_file():
        runners[("mtp-trt/onnxruntime", exp.mtp_mode)] = Runner(resolve_export(ckpt, exp.mtp_mode, progress=note,
                                                                               batch=max(batches)), threads=threads)
    else:
        note(f"the export's checkpoint {ckpt} is not here: no ONNX Runtime or transformers rows")
    hf = _transformers_generate(ckpt, device="cuda") if transformers and (ckpt / "config.json").is_file() else None
    return time_runners(runners, hf, batches, max_new_tokens, repeats, progress, note)


def one_at_a_time(backend, prompts: list[list[int]], opts) -> tuple[list, Stats]:
    """Batch 1 over several prompts: each decoded alone, in turn -> (the sequences, their figures together)."""
    seqs, total = [], None
    for p in prompts:
        s, stats = generate(backend, [p], opts)
        seqs += s
        total = stats if total is None else total + stats
    return seqs, total


def time_runners(runners: dict, hf, batches: list[int], max_new_tokens: int, repeats: int, progress,
                 note=lambda line: None) -> list[dict]:
    """{(engine label, mode): Runner} and transformers' generate (or None), timed round-robin per batch size.
    Batch 1 decodes every prompt of PROMPTS alone, one after another (one prompt's acceptance is not
    typical); batch b > 1 decodes b prompts together.  `progress`: each figure; `note`: how far along."""
    rows = []

    def config_name(key) -> str:
        engine, mode, nextn, tree = key
        if engine == "transformers.generate":
            return f"transformers batch {batch}"
        prefix = "" if engine == "mtp-trt/onnxruntime" else f"{engine[8:]} "
        return f"{prefix}{mode} batch {batch} nextn {nextn}{f' tree {tree}' if tree else ''}"

    for at, batch in enumerate(batches):
        texts = PROMPTS if batch == 1 else (PROMPTS * batch)[:batch]
        decode = one_at_a_time if batch == 1 else generate
        jobs = {}
        for (engine, mode), runner in runners.items():
            prompts = runner.fit([runner.encode(p) for p in texts], runner.manifest.nextn)  # or one clear error
            trees = parse_trees(",".join(runner.manifest.raw.get("trees") or []))
            configs = [(nextn, None) for nextn in range(runner.manifest.nextn + 1)] + [(t.depth, t) for t in trees]
            for nextn, tree in configs:
                opts = runner.options(nextn, max_new_tokens=max_new_tokens, tree_topk=tree and tree.topk,
                                      tree_budget=tree and tree.budget)
                runner.backend.prepare(nextn, True, opts.tree_graph)
                key = (engine, mode, nextn, tree and tree.spec)
                jobs[key] = lambda r=runner, p=prompts, o=opts: decode(r.backend, p, o)
        if hf:
            calls = [hf([t], max_new_tokens) for t in texts] if batch == 1 else [hf(texts, max_new_tokens)]
            jobs[("transformers.generate", "-", 0, None)] = lambda calls=calls: [run() for run in calls]
        baseline = {}  # (engine, mode) -> nextn 0's tokens: every nextn must produce the same (greedy is lossless)
        timed = _round_robin(jobs, repeats, note, config_name, later=len(batches) - at - 1)
        for (engine, mode, nextn, tree), (rounds, result) in timed.items():
            seconds = statistics.median(rounds)
            if engine == "transformers.generate":
                tokens = len(texts) * max_new_tokens
                rows.append({"engine": engine, "mode": mode, "batch": batch, "nextn": 0,
                             "tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
                             "round_seconds": rounds})
                progress(f"transformers batch {batch}: {tokens / seconds:8.1f} tokens/s")
                continue
            seqs, stats = result
            tokens = sum(len(s.generated) for s in seqs)
            generated = baseline.setdefault((engine, mode), [s.generated for s in seqs])
            rows.append({"engine": engine, "mode": mode, "batch": batch, "nextn": nextn, "tree": tree,
                         "tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
                         "round_seconds": rounds,
                         "mean_acceptance_length": stats.mean_acceptance_length,
                         "acceptance_rate_per_pos": stats.acceptance_rate_per_pos,
                         "same_tokens_as_nextn0": [s.generated for s in seqs] == generated})
            label = "" if engine == "mtp-trt/onnxruntime" else f"{engine[8:]} "
            shape = f" tree {tree}" if tree else ""
            progress(f"{label}{mode:7s} batch {batch} nextn {nextn}{shape}: {tokens / seconds:8.1f} tokens/s, "
                     f"{stats.mean_acceptance_length:.2f} tokens/step")
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per batch and mode: nextn=0 over transformers, and the fastest nextn >= 1's speedup over nextn=0 against
    its mean accepted tokens, whose inverse is what one of its steps costs in plain decode steps; where trees
    ran, the fastest tree against that fastest chain (tokens/s) and against the chain of its depth (mean
    accepted tokens per step)."""
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        hf = next((r for r in rows if r["engine"] == "transformers.generate" and r["batch"] == batch), None)
        pairs = dict.fromkeys((r["engine"], r["mode"]) for r in rows if r["engine"] != "transformers.generate")
        for engine, mode in pairs:
            mine = [r for r in rows if (r["engine"], r["mode"]) == (engine, mode) and r["batch"] == batch]
            if not mine:
                continue
            base = next(r for r in mine if r["nextn"] == 0)
            drafting = [r for r in mine if r["nextn"] > 0 and not r.get("tree")]
            if not drafting:
                continue
            best = max(drafting, key=lambda r: ratio(r, base))  # the fastest nextn >= 1, even if < 1x
            speedup = ratio(best, base)
            row = {"batch": batch, "engine": engine, "mode": mode,
                   "nextn0_over_transformers": ratio(base, hf) if hf else None,
                   "best_nextn": best["nextn"], "speedup_over_nextn0": speedup,
                   "mean_acceptance_length": best["mean_acceptance_length"],
                   "speedup_over_mean_acceptance_length": speedup / best["mean_acceptance_length"],
                   "step_cost_over_plain_step": best["mean_acceptance_length"] / speedup}
            trees = [r for r in mine if r.get("tree")]
            if trees:
                tree = max(trees, key=lambda r: ratio(r, base))
                chain = next((r for r in drafting if r["nextn"] == tree["nextn"]), best)
                length = tree["mean_acceptance_length"]
                row |= {"best_tree": tree["tree"], "tree_speedup_over_nextn0": ratio(tree, base),
                        "tree_over_best_chain": ratio(tree, best), "tree_mean_acceptance_length": length,
                        "tree_acceptance_length_over_chain_same_depth": length - chain["mean_acceptance_length"]}
            out.append(row)
    return out


def figure(rows: list[dict]):
    """The plot of the rows: tokens/s against nextn, a panel per batch size, one legend for all below the panels
    (never over a point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4.5), squeeze=False, layout="constrained")
    legend = {}
    for ax, batch in zip(axes[0], batches):
        pairs = dict.fromkeys((r["engine"], r["mode"]) for r in rows if r["engine"] != "transformers.generate")
        for engine, mode in pairs:
            mine = [r for r in rows if (r["engine"], r["mode"]) == (engine, mode) and r["batch"] == batch]
            pts = sorted((r["nextn"], r["tokens_per_second"]) for r in mine if not r.get("tree"))
            if pts:
                ax.plot(*zip(*pts), "o-" if mode == "eagle" else "s--", label=f"{engine} {mode}")
            for r in (r for r in mine if r.get("tree")):
                ax.plot(r["nextn"], r["tokens_per_second"], "^", label=f"{engine} {mode} tree {r['tree']}")
        hf = [r for r in rows if r["engine"] == "transformers.generate" and r["batch"] == batch]
        if hf:
            ax.axhline(hf[0]["tokens_per_second"], color="gray", ls=":", label="transformers generate")
        ax.set(title=f"batch {batch}", xlabel="nextn (draft tokens per step)", ylabel="tokens/s",
               xticks=sorted({r["nextn"] for r in rows}))
        ax.grid(alpha=0.3)
        for handle, text in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(text, handle)
    fig.legend(list(legend.values()), list(legend), loc="outside lower center", ncols=min(3, len(legend)),
               fontsize="small", frameon=False)
    return fig


def plot(rows: list[dict], path: Path) -> None:
    """figure(rows) written to `path` (its extension names the format), whole or not at all (a full disk)."""
    fig = figure(rows)
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=120, format=path.suffix.lower().lstrip("."))


def write_json(rows: list[dict], path: Path, meta: dict) -> None:
    write_atomic(path, (json.dumps({"meta": meta, "runs": rows, "summary": summarize(rows)}, indent=2) + "\n").encode())
