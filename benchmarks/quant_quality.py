"""What weight quantization costs in accuracy on the demo checkpoint: mtp-trt --quant int8 / int4 against its
fp32 export, beside llama.cpp's Q8_0 / Q4_0 / Q4_K_M against its own f32 GGUF of the same checkpoint.  Not run
in CI.

  python benchmarks/quant_quality.py --llama-python LLAMA_VENV/bin/python [--sdist SDIST] \\
      [--quant none int8 int4] [--group-size 32] [--gguf f32 q8_0 q4_0 q4_k_m] [--windows N] [--tokens 128]

(LLAMA_VENV, SDIST: as in benchmarks/beside_llama_cpp.py; --sdist is needed while the demo's f32 GGUF is not cached.)

Held-out text: the demo model's own held-out split (samples/demo_data.py): the Python standard library files
(of the running Python; the model was trained on 3.11.7's) whose sha1(relative path) % 100 < 5, which
samples/train_demo.py leaves out of training.  They are tokenized with the demo tokenizer as the model card's
evaluation does (<bos> file <eos> ..., one stream) and cut into non-overlapping windows of --window tokens
(256, the training length; all of them unless --windows).  Both engines read the same token ids.

Figures, each quantization against its engine's unquantized model:

* teacher-forced top-1 agreement: the fraction of positions, over every position of every window, where the
  quantized model's argmax equals the unquantized one's.  mtp-trt: the export's target graph run over each
  window in --chunk-token pieces with its KV cache (OrtBackend.target, logits asked for); llama.cpp: one
  llama_decode of the whole window with every position's logits asked for (benchmarks/llama_api.py);
* perplexity: exp(mean next-token negative log-likelihood) over the windows (the last position of a window
  has no next token);
* greedy agreement, --tokens new tokens per prompt: the fraction of new tokens before each prompt's first
  divergence from the unquantized model's (summed over prompts), and how many sequences are identical; over
  mtp_trt/bench.py's 8 prompts (<bos> + ids) and, separately, over --heldout-prompts prompts cut from the
  held-out text (<bos> + the first --prompt-tokens tokens of evenly spaced windows: code neither the training
  nor the tests saw), where one near-tie moves the figure far less.  mtp-trt: plain greedy decoding (nextn 0);
  llama.cpp: its greedy sampler chain;
* MTP acceptance (mtp-trt only: llama.cpp has no MTP decoding of this model): mtp_trt.decode.generate in
  eagle mode at nextn 1..3 over the same prompts, one at a time: mean tokens per verify step, and per draft
  position the fraction of steps that accepted at least that many drafts (and that fraction given the previous
  position accepted), plus whether every nextn decoded the same tokens as nextn 0 (greedy MTP is lossless;
  where not, which prompt and from which new token).

One cross-engine line: mtp-trt fp32 against llama.cpp f32 (the same model in two engines: top-1 agreement,
both perplexities).  The quantization goals are checked and printed: int8's teacher-forced top-1 agreement >=
Q8_0's, int4's >= Q4_K_M's, and int8's MTP tokens per step within 3% of fp32's at every nextn.  The JSON
report goes to --json (default: quant-quality.json in mtp-trt's cache directory, bench-real-size).  Nothing here is
timed: both engines' threads wait without spinning (kinder to a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_common import DEMO, cache_dir  # noqa: E402
from llama_api import GGUF_LABELS, GGUF_TYPES, LlamaEngine, ensure_export, ensure_gguf  # noqa: E402

QUANTS = ("none", "int8", "int4")
NEXTN = 3  # the demo's MTP modules


# ---------------------------------------------------------------------------------------------------- inputs
def heldout_windows(window: int, max_windows: int | None) -> tuple[np.ndarray, list[str]]:
    """[n, window] token ids of the demo's held-out files (module docstring), and those files."""
    sys.path.insert(0, str(HERE.parent / "samples"))
    import demo_data as dd
    from tokenizers import Tokenizer

    _, held = dd.split_files(dd.list_files())
    texts = {f: dd.read_source(f) for f in held}
    texts = {f: t for f, t in texts.items() if t is not None}
    if not texts:
        raise SystemExit(f"no held-out files found under {dd.stdlib_root()}")
    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    stream = dd.encode_files(tok, list(texts.values()))
    windows = dd.eval_windows(stream, window, max_windows or len(stream))
    return windows, list(texts)


def heldout_prompts(windows: np.ndarray, count: int, length: int) -> list[list[int]]:
    """<bos> + the first `length` tokens of `count` evenly spaced held-out windows."""
    picks = np.linspace(0, len(windows) - 1, min(count, len(windows))).astype(int) if count else []
    return [[1] + windows[i, :length].tolist() for i in picks]


def bench_prompts() -> list[list[int]]:
    from tokenizers import Tokenizer

    from mtp_trt.bench import PROMPTS

    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    return [[1] + tok.encode(p).ids for p in PROMPTS]  # BOS first, as training saw every file


# ------------------------------------------------------------------------------------------- figures of a run
def nll_and_argmax(logits: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """logits [W, V] of a window `ids` [W] -> (negative log-likelihood of ids[1:] [W - 1], argmax [W])."""
    x = logits.astype(np.float64)
    m = x.max(1, keepdims=True)
    logz = (m[:, 0] + np.log(np.exp(x - m).sum(1)))
    nll = logz[:-1] - x[np.arange(len(ids) - 1), ids[1:]]
    return nll, logits.argmax(1).astype(np.int32)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def greedy_agreement(ref: list[list[int]], other: list[list[int]]) -> dict:
    """Greedy sequences `other` against `ref`: the fraction of ref's tokens before each first divergence, the
    identical sequences, and where each first diverges."""
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ref, other)]
    return {"prefix_fraction": sum(prefix) / max(sum(len(g) for g in ref), 1),
            "identical": sum(p == len(a) for p, a in zip(prefix, ref)), "first_divergence": prefix}


def compare(ref: dict, other: dict, bench: int) -> dict:
    """The figures of run `other` against reference run `ref` (both from mtp_run / llama_run); their greedy
    sequences: the first `bench` over the bench prompts, the rest over the held-out prompts."""
    b, h = (greedy_agreement(ref["greedy"][sl], other["greedy"][sl]) for sl in (slice(bench), slice(bench, None)))
    return {"top1_agreement": float((ref["argmax"] == other["argmax"]).mean()),
            "perplexity": float(np.exp(other["nll"].mean())),
            "greedy_prefix_fraction": b["prefix_fraction"], "greedy_identical": b["identical"],
            "greedy_first_divergence": b["first_divergence"],
            "heldout_greedy_prefix_fraction": h["prefix_fraction"], "heldout_greedy_identical": h["identical"],
            "heldout_greedy_first_divergence": h["first_divergence"]}


# ------------------------------------------------------------------------------------------------ mtp-trt side
def mtp_run(export: Path, windows: np.ndarray, prompts: list[list[int]], tokens: int, chunk: int,
            threads: int, progress) -> dict:
    """Teacher-forced argmax and NLL over `windows`, greedy tokens at nextn 0 and MTP acceptance at 1..NEXTN."""
    from mtp_trt.backend import OrtBackend
    from mtp_trt.bench import one_at_a_time
    from mtp_trt.decode import DecodeOptions
    from mtp_trt.manifest import Manifest

    backend = OrtBackend(Manifest.load(export), threads=threads, spin=False)  # untimed (as the llama.cpp child)
    n, w = windows.shape
    t0 = time.perf_counter()
    backend.allocate(1, w)
    zero = np.zeros(1, np.int32)
    argmax, nll = np.empty((n, w), np.int32), np.empty((n, w - 1))
    for i, ids in enumerate(windows):
        logits = []
        for c in range(0, w, chunk):
            out = backend.target(1, ids[None, c:c + chunk].astype(np.int32), np.array([c], np.int32), zero, 0, 0.0,
                                 logits=True)
            logits.append(out["logits"][0])
        nll[i], argmax[i] = nll_and_argmax(np.concatenate(logits), ids)
    tf_seconds = time.perf_counter() - t0
    greedy, stats = one_at_a_time(backend, prompts, DecodeOptions(nextn=0, max_new_tokens=tokens))
    greedy = [list(s.generated) for s in greedy]
    mtp = {}
    for k in range(1, NEXTN + 1):
        seqs, st = one_at_a_time(backend, prompts, DecodeOptions(nextn=k, max_new_tokens=tokens))
        rate = st.acceptance_rate_per_pos
        mtp[k] = {"tokens_per_step": st.mean_acceptance_length, "position_rates": rate,
                  "position_rates_given_previous": [r / p if p else 0.0 for r, p in zip(rate, [1.0] + rate[:-1])],
                  "same_tokens_as_nextn0": [list(s.generated) for s in seqs] == greedy,
                  "differences_from_nextn0": [[i, d] for i, (s, g) in enumerate(zip(seqs, greedy))
                                              if (d := first_difference(list(s.generated), g)) is not None]}
    per_step = ", ".join(f"nextn {k} {v['tokens_per_step']:.2f}" for k, v in mtp.items())
    progress(f"  {export.name}: teacher-forced {n} x {w} tokens in {tf_seconds:.1f} s; {per_step} tokens/step")
    return {"argmax": argmax.ravel(), "nll": nll.ravel(), "greedy": greedy, "mtp": mtp}


# ---------------------------------------------------------------------------------------------- llama.cpp side
def llama_child(ggufs: dict[str, str], windows_file: str, prompts: list[list[int]], tokens: int, threads: int,
                out_file: str) -> dict:
    """(in a Python with llama_cpp) every GGUF's teacher-forced argmax and NLL (into `out_file`, .npz) and greedy
    tokens (returned)."""
    windows = np.load(windows_file)
    n, w = windows.shape
    arrays, greedy = {}, {}
    for kind, path in ggufs.items():
        eng = LlamaEngine(path, n_ctx=max(w, max(map(len, prompts)) + tokens + 16), threads=threads)
        argmax, nll = np.empty((n, w), np.int32), np.empty((n, w - 1))
        t0 = time.perf_counter()
        for i, ids in enumerate(windows):
            nll[i], argmax[i] = nll_and_argmax(eng.logits(ids.tolist()), ids)
        arrays[f"{kind}.argmax"], arrays[f"{kind}.nll"] = argmax.ravel(), nll.ravel()
        greedy[kind] = [eng.generate(p, tokens) for p in prompts]
        eng.close()
        print(f"  llama.cpp {GGUF_LABELS[kind]}: teacher-forced {n} x {w} tokens in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
    np.savez(out_file, **arrays)
    return greedy


def llama_runs(python: str, ggufs: dict[str, Path], windows: np.ndarray, prompts, tokens: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "windows.npy", windows)
        args = [{k: str(v) for k, v in ggufs.items()}, str(Path(tmp) / "windows.npy"), prompts, tokens, threads,
                str(Path(tmp) / "out.npz")]
        env = os.environ | {"OMP_WAIT_POLICY": "PASSIVE"}  # untimed: no spinning threads on a shared machine
        res = subprocess.run([python, __file__, "--llama-child", json.dumps(args)], stdout=subprocess.PIPE, text=True,
                             env=env)
        if res.returncode:
            raise SystemExit(f"the llama.cpp child ({python}) failed (exit {res.returncode}); see above")
        greedy = json.loads(res.stdout.strip().splitlines()[-1])
        arrays = np.load(Path(tmp) / "out.npz")
        return {k: {"argmax": arrays[f"{k}.argmax"], "nll": arrays[f"{k}.nll"], "greedy": greedy[k]} for k in ggufs}


# ------------------------------------------------------------------------------------------------------ report
def diffs(where: list[list[int]]) -> str:
    return ", ".join(f"prompt {p} from new token {i}" for p, i in where)


def print_report(rows: list[dict], mtp: dict, cross: dict | None, goals: list[tuple[str, bool | None, str]]) -> None:
    print("\n| engine | weights | against | teacher-forced top-1 agreement | perplexity | greedy tokens before "
          "first divergence (bench prompts) | identical | greedy tokens before first divergence (held-out "
          "prompts) | identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['weights']} | {r['reference']} | {100 * r['top1_agreement']:.2f}% | "
              f"{r['perplexity']:.4f} | {100 * r['greedy_prefix_fraction']:.1f}% | {r['greedy_identical']}/"
              f"{len(r['greedy_first_divergence'])} | {100 * r['heldout_greedy_prefix_fraction']:.1f}% | "
              f"{r['heldout_greedy_identical']}/{len(r['heldout_greedy_first_divergence'])} |")
    if mtp:
        print("\n| mtp-trt weights | nextn | tokens/step | vs fp32 | accepted at position 1, 2, 3 (of steps) | "
              "given the previous | same tokens as nextn 0 |")
        print("|---|---|---|---|---|---|---|")
        base = mtp.get("none")
        for q, by_k in mtp.items():
            for k, v in by_k.items():
                rel = f"{100 * (v['tokens_per_step'] / base[k]['tokens_per_step'] - 1):+.1f}%" if base else ""
                print(f"| {q} | {k} | {v['tokens_per_step']:.3f} | {rel} | "
                      f"{', '.join(f'{100 * x:.1f}%' for x in v['position_rates'])} | "
                      f"{', '.join(f'{100 * x:.1f}%' for x in v['position_rates_given_previous'])} | "
                      f"{'yes' if v['same_tokens_as_nextn0'] else 'NO: ' + diffs(v['differences_from_nextn0'])} |")
    if cross:
        print(f"\nmtp-trt fp32 vs llama.cpp f32 (same checkpoint, two engines): teacher-forced top-1 agreement "
              f"{100 * cross['top1_agreement']:.2f}%, perplexity {cross['mtp_perplexity']:.4f} vs "
              f"{cross['llama_perplexity']:.4f}; greedy tokens before first divergence "
              f"{100 * cross['greedy_prefix_fraction']:.1f}% (bench prompts), "
              f"{100 * cross['heldout_greedy_prefix_fraction']:.1f}% (held-out prompts)")
    for name, ok, detail in goals:
        print(f"goal: {name}: {'met' if ok else 'NOT met' if ok is not None else 'not measured'} ({detail})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", nargs="+", default=list(QUANTS), choices=QUANTS,
                    help="mtp-trt quantizations (none, the fp32 reference, is always run)")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--gguf", nargs="+", default=list(GGUF_TYPES), choices=list(GGUF_TYPES),
                    help="llama.cpp types (f32, the reference, is always run); none with --no-llama")
    ap.add_argument("--no-llama", action="store_true", help="mtp-trt only")
    ap.add_argument("--llama-python", default=sys.executable, help="a Python with llama_cpp installed")
    ap.add_argument("--sdist", type=Path, help="llama-cpp-python's source distribution (llama.cpp's converter)")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--windows", type=int, default=None, help="at most this many held-out windows (default all)")
    ap.add_argument("--chunk", type=int, default=64, help="mtp-trt: tokens per target-graph call")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per prompt (greedy, MTP)")
    ap.add_argument("--heldout-prompts", type=int, default=64, help="greedy prompts cut from the held-out text")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="tokens of each held-out prompt (after <bos>)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="where the report goes (default: quant-quality.json in the cache)")
    ap.add_argument("--llama-child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.llama_child:
        print(json.dumps(llama_child(*json.loads(a.llama_child))))
        return
    progress = lambda msg: print(msg, flush=True)  # noqa: E731
    quants = ["none"] + [q for q in a.quant if q != "none"]
    kinds = [] if a.no_llama else ["f32"] + [k for k in a.gguf if k != "f32"]
    from mtp_trt.errors import MtpTrtError
    from mtp_trt.plugins import ort_lib
    from mtp_trt.quant import scheme

    try:
        scheme("int8", a.group_size, "--group-size")
    except MtpTrtError as e:
        raise SystemExit(str(e)) from None
    if len(quants) > 1 and not ort_lib.available()[0]:
        raise SystemExit(f"--quant {' '.join(quants[1:])}: quantized exports run on mtp-trt's CPU operators, which "
                         f"are not available here ({ort_lib.available()[1]})")
    if kinds:
        res = subprocess.run([a.llama_python, "-c", "import llama_cpp"], capture_output=True, text=True, cwd="/")
        if res.returncode:
            raise SystemExit(f"--llama-python {a.llama_python}: cannot import llama_cpp; pass a Python with "
                             f"llama-cpp-python installed (or --no-llama)")
    windows, files = heldout_windows(a.window, a.windows)
    prompts = bench_prompts()
    bench = len(prompts)
    prompts += heldout_prompts(windows, a.heldout_prompts, a.prompt_tokens)
    progress(f"held-out text: {len(files)} files of the demo's held-out split ({', '.join(files)}); "
             f"{windows.shape[0]} windows of {windows.shape[1]} tokens = {windows.size} positions")
    exports = {q: ensure_export("demo", DEMO, NEXTN, q, a.group_size, progress) for q in quants}
    ggufs = {k: ensure_gguf("demo", DEMO, k, a.sdist, a.llama_python, a.threads, progress) for k in kinds}
    mtp_runs = {}
    for q, e in exports.items():
        try:
            mtp_runs[q] = mtp_run(e, windows, prompts, a.tokens, a.chunk, a.threads, progress)
        except MtpTrtError as err:
            raise SystemExit(f"mtp-trt --quant {q}: {err}") from None
    llama = llama_runs(a.llama_python, ggufs, windows, prompts, a.tokens, a.threads) if ggufs else {}
    rows = []
    for q, run in mtp_runs.items():
        rows.append({"engine": "mtp-trt", "weights": "fp32" if q == "none" else f"{q} (group {a.group_size})",
                     "quant": q, "reference": "mtp-trt fp32", **compare(mtp_runs["none"], run, bench)})
    for k, run in llama.items():
        rows.append({"engine": "llama.cpp", "weights": GGUF_LABELS[k], "gguf": k, "reference": "llama.cpp f32",
                     **compare(llama["f32"], run, bench)})
    cross = None
    if "f32" in llama:
        c = compare(mtp_runs["none"], llama["f32"], bench)
        cross = {"top1_agreement": c["top1_agreement"], "llama_perplexity": c["perplexity"],
                 "mtp_perplexity": float(np.exp(mtp_runs["none"]["nll"].mean())),
                 "greedy_prefix_fraction": c["greedy_prefix_fraction"], "greedy_identical": c["greedy_identical"],
                 "heldout_greedy_prefix_fraction": c["heldout_greedy_prefix_fraction"]}
    by = {(r["engine"], r.get("quant") or r.get("gguf")): r for r in rows}
    goals = []
    for q, g in (("int8", "q8_0"), ("int4", "q4_k_m")):
        for what, key in (("top-1 agreement", "top1_agreement"),
                          ("greedy agreement over the held-out prompts", "heldout_greedy_prefix_fraction"),
                          ("greedy agreement over the bench prompts", "greedy_prefix_fraction")):
            mine, theirs = (by[e, t][key] if (e, t) in by else None for e, t in (("mtp-trt", q), ("llama.cpp", g)))
            ok = None if mine is None or theirs is None else mine >= theirs
            goals.append((f"{q} {what} with fp32 >= llama.cpp {GGUF_LABELS[g]}'s with f32", ok,
                          f"{'-' if mine is None else f'{100 * mine:.2f}%'} vs "
                          f"{'-' if theirs is None else f'{100 * theirs:.2f}%'}"))
    mtp = {q: r["mtp"] for q, r in mtp_runs.items()}
    if "int8" in mtp:
        rel = {k: mtp["int8"][k]["tokens_per_step"] / mtp["none"][k]["tokens_per_step"] - 1 for k in mtp["none"]}
        goals.append(("int8 MTP tokens/step within 3% of fp32's", all(abs(v) <= 0.03 for v in rel.values()),
                      ", ".join(f"nextn {k} {100 * v:+.1f}%" for k, v in rel.items())))
    else:
        goals.append(("int8 MTP tokens/step within 3% of fp32's", None, "no int8 run"))
    print_report(rows, mtp, cross, goals)
    report = {"heldout_files": files, "windows": list(windows.shape), "chunk": a.chunk, "prompts": bench,
              "heldout_prompts": len(prompts) - bench, "prompt_tokens": a.prompt_tokens,
              "new_tokens": a.tokens, "threads": a.threads, "rows": rows, "mtp": mtp, "cross_engine": cross,
              "goals": [{"goal": n, "met": ok, "figures": d} for n, ok, d in goals]}
    a.json = a.json or cache_dir() / "quant-quality.json"
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(report, indent=1))
    print(f"JSON: {a.json}")


if __name__ == "__main__":
    main()
