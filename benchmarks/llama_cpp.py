"""mtp-trt beside llama.cpp on the same checkpoints: HF -> GGUF f32 with llama.cpp's own converter,
greedy tokens compared, decode tokens/s interleaved and peak RSS, batch 1, same threads.  Not run in CI.

Needs llama-cpp-python (any Python: --llama-python) and its source distribution for the converter
(convert_hf_to_gguf.py, conversion/, gguf-py/ under vendor/llama.cpp):

  python -m venv LLAMA_VENV && LLAMA_VENV/bin/pip install llama-cpp-python==0.3.36
  pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d SDIST_DIR
  python benchmarks/llama_cpp.py --sdist SDIST_DIR/llama_cpp_python-0.3.36.tar.gz \
      --llama-python LLAMA_VENV/bin/python [--sizes demo 85m 304m] [--tokens 64] [--rounds 5] \
      [--threads 2] [--nextn 0 1 2 3] [--transformers]

Checkpoints: the demo (samples/demo-model) and benchmarks/real_size.py's random 85m / 304m (made on the fly).
Everything converted or exported goes under mtp-trt's cache directory, in bench-real-size (never into git).  The
converter needs the demo tokenizer's pre-tokenizer registered: it is byte-level BPE with GPT-2's split
regex, so this script answers "gpt-2" for its hash (llama.cpp only sees token ids here anyway: both engines
get the same prompt ids, starting with BOS, as llama.cpp expects).

Each engine configuration runs in a process of its own (a worker: llama.cpp, or mtp-trt at one nextn), so
that its peak RSS (VmHWM) is its own; the parent runs one timed decode per worker in turn, round-robin,
while the others wait, and prints medians of two rates: decode tokens/s = (new tokens - 1) / the time after the
first token (the prompt's pass excluded: for mtp-trt, the time of a one-token generation subtracted), and
new tokens / the whole generation's time (prompt included, as benchmarks/real_size.py reports); and the best
round's decode rate (the quietest moment of a shared machine).  Both engines run without busy-waiting
threads with --no-spin (OrtBackend(spin=False), OMP_WAIT_POLICY=PASSIVE for llama.cpp's OpenMP build: on a busy
2-core CPU it made llama.cpp's 2-thread decoding ~2x faster); by default both spin, as each does on its own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_size import DEMO, PROMPT, cache_dir, child, make_checkpoint, peak_rss_mb, revision  # noqa: E402

CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def converter_dir(sdist: Path) -> Path:
    """llama.cpp's converter unpacked (once) from the llama-cpp-python source distribution."""
    out = cache_dir() / f"llama-convert-{sdist.name.removesuffix('.tar.gz')}"
    if (out / "convert_hf_to_gguf.py").is_file():
        return out
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name.partition("/vendor/llama.cpp/")[2]
            if rel and rel.startswith(CONVERTER_PARTS) and (m.isfile() or m.isdir()):
                m.name = rel
                members.append(m)
        if not any(m.name == "convert_hf_to_gguf.py" for m in members):
            raise SystemExit(f"{sdist}: no vendor/llama.cpp/convert_hf_to_gguf.py inside; expected "
                             f"llama-cpp-python's source distribution")
        tar.extractall(out, members=members, filter="data")
    return out


def convert_child(src: str, ckpt: str, out: str) -> dict:
    """(in a child process) llama.cpp's convert_hf_to_gguf.py on `ckpt`, f32, the BPE pre-tokenizer registered."""
    import runpy

    sys.path[:0] = [src, str(Path(src) / "gguf-py")]
    import conversion.base as base

    plain = base.TextModel.get_vocab_base_pre

    def vocab_pre(self, tokenizer):
        try:
            return plain(self, tokenizer)
        except NotImplementedError:  # the demo's tokenizer: byte-level BPE, GPT-2's regex
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = vocab_pre
    sys.argv = ["convert_hf_to_gguf.py", ckpt, "--outtype", "f32", "--outfile", out]
    t0 = time.perf_counter()
    stdout, sys.stdout = sys.stdout, sys.stderr  # the converter's output must not mix with our JSON line
    try:
        runpy.run_path(str(Path(src) / "convert_hf_to_gguf.py"), run_name="__main__")
    finally:
        sys.stdout = stdout
    return {"seconds": time.perf_counter() - t0}


def active_bytes(ckpt: Path) -> int:
    """f32 bytes of the main model's weights one decoded token reads: every layer's tensors, the routed experts
    at k/E, the head; neither the embedding (one row) nor the MTP layers."""
    cfg = json.loads((ckpt / "config.json").read_text())
    with open(ckpt / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    total = 0.0
    for name, t in header.items():
        if name == "__metadata__" or "embed_tokens" in name:
            continue
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if layer and int(layer.group(1)) >= cfg["num_hidden_layers"]:
            continue
        n = 4 * math.prod(t["shape"])
        total += n * cfg["num_experts_per_tok"] / cfg["n_routed_experts"] if ".mlp.experts." in name else n
    return int(total)


def margins_child(ckpt: str, ids: list[int], runs: dict[str, list[int]]) -> dict:
    """(in a child process) transformers' greedy tokens on `ckpt`: where each engine's tokens first differ from
    them, and transformers' top-2 logit margin there (a near tie that float rounding can flip)."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    n = max(len(v) for v in runs.values())
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1:]
    report = {}
    for name, toks in runs.items():
        d = next((i for i, (x, y) in enumerate(zip(toks, out)) if x != y), None)
        top = logits[d].topk(2).values.tolist() if d is not None else None
        report[name] = {"first_difference": d, "top2_margin": None if top is None else top[0] - top[1]}
    return report


def prompt_ids(tokenizer_json: Path) -> list[int]:
    from tokenizers import Tokenizer

    return [1] + Tokenizer.from_file(str(tokenizer_json)).encode(PROMPT).ids  # BOS first


class LlamaWorker:
    """llama.cpp through llama-cpp-python: the prompt in one eval, then one eval per token, argmax of the logits."""

    def __init__(self, gguf: str, ids: list[int], tokens: int, threads: int):
        here = str(Path(__file__).resolve().parent)
        saved, sys.path[:] = sys.path[:], [p for p in sys.path if str(Path(p or ".").resolve()) != here]
        try:  # the package, not this script of the same name
            from llama_cpp import Llama
        except ImportError:
            raise SystemExit(f"{sys.executable}: llama_cpp is not installed; `pip install llama-cpp-python` "
                             f"(or pass --llama-python with a Python that has it)") from None
        finally:
            sys.path[:] = saved
        import numpy as np

        self.ids, self.tokens = ids, tokens
        self.llm = Llama(gguf, n_ctx=len(ids) + tokens + 16, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)
        n_vocab = self.llm.n_vocab()
        # eval() computes the last position's logits but no longer copies them to .scores: read llama.cpp's
        self.argmax = lambda: int(np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(n_vocab,)).argmax())

    def __call__(self) -> list[int]:
        llm = self.llm
        t0 = time.perf_counter()
        llm.reset()
        llm.eval(self.ids)
        out = [self.argmax()]
        self.first = time.perf_counter() - t0  # prompt + first token
        while len(out) < self.tokens:
            llm.eval(out[-1:])
            out.append(self.argmax())
        return out


class MtpWorker:
    """mtp-trt on ONNX Runtime at one nextn (greedy, eagle step graphs where exported)."""

    def __init__(self, export: str, ids: list[int], tokens: int, threads: int, nextn: int):
        from mtp_trt.backend import OrtBackend
        from mtp_trt.decode import DecodeOptions, generate
        from mtp_trt.manifest import Manifest

        backend = OrtBackend(Manifest.load(export), threads=threads, spin=os.environ.get("MTP_TRT_SPIN", "1") == "1")
        opts = DecodeOptions(nextn=nextn, max_new_tokens=tokens)  # no EOS: always `tokens` new tokens
        first = DecodeOptions(nextn=nextn, max_new_tokens=1)
        self.run = lambda: generate(backend, [ids], opts)
        self.run_first = lambda: generate(backend, [ids], first)

    def __call__(self) -> list[int]:
        t0 = time.perf_counter()
        self.run_first()
        self.first = time.perf_counter() - t0  # prompt + first token: a generation of its own
        seqs, self.stats = self.run()
        return list(seqs[0].generated)


def worker(kind: str, *args) -> None:
    """(in a worker process) load, warm up, then answer `run` with one timed generation and `exit` with VmHWM."""
    fn = (LlamaWorker if kind == "llama" else MtpWorker)(*args)
    fn()
    print(json.dumps({"ready": True, "rss_mb": peak_rss_mb()}), flush=True)
    for line in sys.stdin:
        if line.strip() == "run":
            t0 = time.perf_counter()
            out = fn()
            seconds = time.perf_counter() - t0 - (fn.first if kind == "mtp" else 0.0)
            extra = {"mean_accepted": fn.stats.mean_accepted} if kind == "mtp" else {}
            print(json.dumps({"seconds": seconds, "first": fn.first, "generated": out, **extra}), flush=True)
        else:
            print(json.dumps({"peak_rss_mb": peak_rss_mb()}), flush=True)
            return


class Worker:
    def __init__(self, python: str, kind: str, *args, spin: bool = True):
        cmd = [python, __file__, "--worker", json.dumps([kind, *args])]
        env = os.environ | ({} if spin else {"OMP_WAIT_POLICY": "PASSIVE", "MTP_TRT_SPIN": "0"})
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.ready = self.ask(None)

    def ask(self, line: str | None) -> dict:
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise SystemExit(f"worker {self.proc.args[-1][:80]} died (exit {self.proc.wait()}); see its stderr above")
        return json.loads(reply)

    def close(self) -> float:
        rss = self.ask("exit")["peak_rss_mb"]
        self.proc.wait()
        return rss


def prepare(size: str, sdist: Path, nextn: int) -> tuple[Path, Path]:
    """(GGUF, export) of one size, made once and kept in the cache."""
    ckpt = DEMO if size == "demo" else Path(child("checkpoint", size))
    gguf = cache_dir() / f"{size}-f32.gguf"
    if not gguf.is_file():
        src = converter_dir(sdist)
        print(f"{size}: converting to {gguf} ...", flush=True)
        child_script("convert", str(src), str(ckpt), str(gguf))
    rev = revision()
    export = cache_dir() / (f"export-{size}-n{nextn}-{rev}" if size == "demo" else f"export-{size}-default-{rev}")
    if not (export / "manifest.json").is_file():
        print(f"{size}: exporting to {export} ...", flush=True)
        if size == "demo":
            child_script("export_demo", str(ckpt), str(export), nextn)
        else:
            child("export", str(ckpt), str(export), "default")
    return gguf, export


def export_demo_child(ckpt: str, out: str, nextn: int) -> dict:
    from mtp_trt.exporters.export import export

    export(ckpt, out, nextn=nextn)
    return {}


def child_script(*args) -> dict:
    """Run this script's own `--child` entries in a fresh process (the converter and the demo export)."""
    res = subprocess.run([sys.executable, __file__, "--child", json.dumps(args)], stdout=subprocess.PIPE, text=True)
    if res.returncode:
        raise SystemExit(f"{args[0]} failed (exit {res.returncode}); see above")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["demo", "85m", "304m"], choices=["demo", "85m", "304m"])
    ap.add_argument("--sdist", type=Path, required=True,
                    help="llama-cpp-python's source distribution (pip download --no-binary :all:), for its converter")
    ap.add_argument("--llama-python", default=sys.executable, help="a Python with llama_cpp installed")
    ap.add_argument("--nextn", type=int, nargs="+", default=None,
                    help="mtp-trt configurations (default: 0 1 2 3 on the demo, 0 on the others)")
    ap.add_argument("--transformers", action="store_true",
                    help="also compare every engine's tokens with transformers' greedy decoding (slow at 304m)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-spin", action="store_true", help="neither engine's threads busy-wait (a busy machine)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(*json.loads(a.worker))
        return
    if a.child:
        name, *args = json.loads(a.child)
        print(json.dumps({"convert": convert_child, "export_demo": export_demo_child, "margins": margins_child}[name](*args)))
        return
    if not a.sdist.is_file():
        raise SystemExit(f"--sdist {a.sdist}: no such file (llama-cpp-python's .tar.gz source distribution)")
    report = []
    for size in a.sizes:
        nextns = a.nextn or ([0, 1, 2, 3] if size == "demo" else [0])
        gguf, export = prepare(size, a.sdist, max(nextns))
        ids = prompt_ids(export / "tokenizer.json")
        spin = not a.no_spin
        workers = {"llama.cpp": Worker(a.llama_python, "llama", str(gguf), ids, a.tokens, a.threads, spin=spin)}
        workers |= {f"mtp-trt nextn {n}": Worker(sys.executable, "mtp", str(export), ids, a.tokens, a.threads, n,
                                                spin=spin) for n in nextns}
        runs = {k: [] for k in workers}
        for _ in range(a.rounds):
            for k, w in workers.items():
                runs[k].append(w.ask("run"))
        rss = {k: w.close() for k, w in workers.items()}
        rate = {k: (a.tokens / statistics.median(r["seconds"] for r in rs),  # whole generation
                    (a.tokens - 1) / statistics.median(r["seconds"] - r["first"] for r in rs),  # after the first token
                    (a.tokens - 1) / min(r["seconds"] - r["first"] for r in rs))  # the best round's
                for k, rs in runs.items()}
        ref = runs["llama.cpp"][-1]["generated"]
        ckpt = DEMO if size == "demo" else make_checkpoint(size)
        streamed = active_bytes(ckpt)
        print(f"{size}: {streamed / 1e6:.1f} MB of f32 weights read per decoded token (active parameters)")
        for k, rs in runs.items():
            same = rs[-1]["generated"] == ref
            first_diff = next((i for i, (x, y) in enumerate(zip(rs[-1]["generated"], ref)) if x != y), None)
            row = {"size": size, "engine": k, "tokens_per_second": rate[k][0], "decode_tokens_per_second": rate[k][1],
                   "best_decode_tokens_per_second": rate[k][2],
                   "peak_rss_mb": rss[k], "same_tokens_as_llama_cpp": same, "first_difference": first_diff, "mean_accepted": rs[-1].get("mean_accepted"),
                   "runs": [{x: r[x] for x in ("seconds", "first")} for r in rs]}
            report.append(row)
            row["weights_gb_per_s"] = streamed * rate[k][1] / 1e9 / (row["mean_accepted"] or 1.0)
            print(f"{size:5s} {k:17s} decode {rate[k][1]:7.1f} tokens/s ({rate[k][1] / rate['llama.cpp'][1]:.2f}x "
                  f"llama.cpp; weights at {row['weights_gb_per_s']:.1f} GB/s; best round {rate[k][2]:.1f}, "
                  f"{rate[k][2] / rate['llama.cpp'][2]:.2f}x), with the prompt {rate[k][0]:7.1f} ({rate[k][0] / rate['llama.cpp'][0]:.2f}x); peak RSS "
                  f"{rss[k]:6.0f} MB ({rss[k] / rss['llama.cpp']:.2f}x); greedy tokens = llama.cpp's: {same}"
                  + (f" (first difference at new token {first_diff})" if not same else "")
                  + (f"; accepted/step {row['mean_accepted']:.2f}" if row["mean_accepted"] else ""), flush=True)
        if a.transformers:
            engines = {k: rs[-1]["generated"] for k, rs in runs.items()}
            for k, v in child_script("margins", str(ckpt), ids, engines).items():
                print(f"{size:5s} {k:17s} vs transformers' greedy tokens: " + (
                    "equal" if v["first_difference"] is None else
                    f"first difference at new token {v['first_difference']}, where transformers' top-2 logits are "
                    f"{v['top2_margin']:.1e} apart"), flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
