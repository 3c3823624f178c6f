"""llama.cpp's own MTP drafting on the demo checkpoint, beside llama.cpp's plain greedy decoding and mtp-trt's MTP, in
one interleaved run.  Not run in CI.

  python benchmarks/llama_mtp.py --llama-python LLAMA_VENV/bin/python --sdist SDIST \\
      --llama-bin LLAMA_BUILD/bin/llama-speculative-simple [--nextn 1 2 3] [--threads 1] [--rounds 5] [--tokens 128]

llama.cpp: `llama-speculative-simple`, built from the llama.cpp that llama-cpp-python 0.3.36 vendors
(`cmake -S vendor/llama.cpp -B BUILD -DLLAMA_CURL=OFF && cmake --build BUILD --target llama-speculative-simple`),
run as its README runs MTP drafting: `-m GGUF --spec-type draft-mtp --spec-draft-n-max K -p PROMPT -n TOKENS
--temp 0 --top-k 1 -t THREADS`.  Its speed is the one it reports ("decoded N tokens in S seconds": the generation
after the prompt's pass), its acceptance its n_drafted / n_accept.  The GGUF: llama.cpp's converter drops
DeepSeek-V3's MTP layers (its DeepseekV2Model skips layers past num_hidden_layers), so the converter runs with
that class told to keep the first MTP layer as blk.N.nextn.* and to write nextn_predict_layers = 1, as its
DeepSeek-V3.2 class does (llama.cpp's MTP graph takes one MTP layer; the demo has three, mtp-trt's eagle mode
also drafts every depth with the first).  Plain greedy llama.cpp on the same GGUF through its C API
(llama_api.LlamaEngine: llama_decode and its greedy sampler), its decode tokens/s = (new tokens - 1) / the time
after the first; and its text is compared with draft-mtp's (greedy MTP must not change the output).
mtp-trt: the demo's fp32 export at nextn 0 and each K (eagle mode), in this process, decode tokens/s as
benchmarks/llama_cpp.py takes them.  Each engine gets the bench prompt as text through its own tokenizer (the
demo's GGUF adds no BOS; mtp-trt puts BOS first).  Each round runs every configuration once, in turn; medians.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from llama_api import cache_dir, converter_dir, ensure_export, run_child  # noqa: E402
from llama_cpp import prompt_ids  # noqa: E402
from real_size import DEMO, PROMPT  # noqa: E402

SPEC_PATTERNS = {"decoded": r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", "drafted": r"n_drafted\s*=\s*(\d+)",
                 "accepted": r"n_accept\s*=\s*(\d+)"}


def parse_spec(stderr: str) -> dict:
    """llama-speculative-simple's report (its stderr) -> decoded tokens, seconds, tokens/s, drafted, accepted and
    tokens per verify step (each step emits its accepted drafts and one token of its own)."""
    found = {k: re.search(p, stderr) for k, p in SPEC_PATTERNS.items()}
    missing = [k for k, m in found.items() if m is None]
    if missing:
        raise ValueError(f"llama-speculative-simple printed no {', '.join(missing)} line; its output ends: "
                         f"{stderr[-500:]!r}")
    decoded, seconds = int(found["decoded"].group(1)), float(found["decoded"].group(2))
    drafted, accepted = int(found["drafted"].group(1)), int(found["accepted"].group(1))
    steps = max(decoded - accepted, 1)
    return {"decoded": decoded, "seconds": seconds, "tokens_per_second": decoded / seconds if seconds else 0.0,
            "drafted": drafted, "accepted": accepted, "tokens_per_step": decoded / steps}


def generated_text(stdout: str, prompt: str) -> str:
    """The text llama-speculative-simple generated: what follows the prompt it echoes."""
    at = stdout.find(prompt)
    if at < 0:
        raise ValueError("llama-speculative-simple's output does not echo the prompt")
    return stdout[at + len(prompt):]


def common_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ------------------------------------------------------------------------------------------ children
def convert_mtp_child(src: str, ckpt: str, out: str) -> dict:
    """(in a child process) llama.cpp's converter keeping the first MTP layer (module docstring)."""
    sys.path[:0] = [src, str(Path(src) / "gguf-py")]
    import gguf
    from conversion import deepseek

    import llama_api

    model = deepseek.DeepseekV2Model
    n_main = json.loads((Path(ckpt) / "config.json").read_text())["num_hidden_layers"]
    init, keep, params = model.__init__, model.filter_tensors.__func__, model.set_gguf_parameters

    def with_mtp_block(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.block_count = n_main + 1
        self.tensor_map = gguf.get_tensor_name_map(self.model_arch, self.block_count)

    def first_mtp_layer_only(cls, item):
        item = keep(cls, item)
        m = item and re.match(r"model\.layers\.(\d+)\.", item[0])
        return None if m and int(m.group(1)) > n_main else item

    def nextn_one(self):
        params(self)
        self.gguf_writer.add_nextn_predict_layers(1)

    model.skip_mtp = False
    model.__init__, model.set_gguf_parameters = with_mtp_block, nextn_one
    model.filter_tensors = classmethod(first_mtp_layer_only)
    return llama_api.convert_child(src, ckpt, out)


def plain_child(gguf: str, prompt: str, tokens: int, threads: int) -> dict:
    """(in a child process, a Python with llama_cpp) one warm-up and one timed plain greedy generation of the
    prompt (tokenized by llama.cpp, as llama-speculative-simple does): decode tokens/s and the generated text."""
    from llama_api import LlamaEngine

    engine = LlamaEngine(gguf, n_ctx=4 * tokens + 64, threads=threads)
    ll = engine.ll
    vocab = ll.llama_model_get_vocab(engine.model)
    buf = (ll.llama_token * 1024)()
    n = ll.llama_tokenize(vocab, prompt.encode(), len(prompt.encode()), buf, 1024, True, True)
    ids = list(buf[:n])
    engine.generate(ids, tokens)
    t0 = time.perf_counter()
    out = engine.generate(ids, tokens)
    seconds = time.perf_counter() - t0 - engine.first
    piece, text = (ctypes.c_char * 256)(), b""
    for t in out:
        n = ll.llama_token_to_piece(vocab, t, piece, 256, 0, False)
        text += piece.raw[:n]
    return {"tokens_per_second": (len(out) - 1) / seconds, "text": text.decode("utf-8", "replace")}


def child_main() -> None:
    name, *args = json.loads(sys.argv[2])
    print(json.dumps({"convert_mtp": convert_mtp_child, "plain": plain_child}[name](*args)))


# ------------------------------------------------------------------------------------------ parent
def spec_run(binary: Path, gguf: Path, k: int, tokens: int, threads: int, tries: int = 3) -> dict:
    """One llama-speculative-simple generation.  Its log is written by a thread of its own, and now and then (2
    threads on 2 cores: 3 runs in 30) the process exits, status 0, before that thread has written the report: such
    a run is run again, up to `tries` times."""
    for attempt in range(tries):
        r = subprocess.run([str(binary), "-m", str(gguf), "--spec-type", "draft-mtp", "--spec-draft-n-max", str(k),
                            "-p", PROMPT, "-n", str(tokens), "--temp", "0", "--top-k", "1", "-t", str(threads)],
                           capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"{binary} (draft-mtp, K {k}) failed (exit {r.returncode}): {r.stderr[-1500:]}")
        try:
            return parse_spec(r.stderr) | {"text": generated_text(r.stdout, PROMPT)}
        except ValueError as e:
            if attempt == tries - 1:
                raise SystemExit(f"{binary} (draft-mtp, K {k}): {e}") from None


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        return child_main()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-python", required=True, help="a Python with llama_cpp (llama-cpp-python 0.3.36)")
    ap.add_argument("--llama-bin", type=Path, required=True, help="llama-speculative-simple, built from its source")
    ap.add_argument("--sdist", type=Path, help="llama-cpp-python's source distribution (its converter)")
    ap.add_argument("--nextn", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    if not a.llama_bin.is_file():
        raise SystemExit(f"--llama-bin {a.llama_bin}: no such file (llama-speculative-simple; see the module docstring)")
    if any(k < 1 or k > 3 for k in a.nextn) or a.threads < 1 or a.rounds < 1 or a.tokens < 2:
        raise SystemExit("--nextn takes 1 to 3; --threads, --rounds >= 1; --tokens >= 2")
    gguf = cache_dir() / "demo-mtp-f32.gguf"
    if not gguf.is_file():
        print(f"converting {DEMO} with its first MTP layer to {gguf} ...", flush=True)
        run_child(sys.executable, "convert_mtp", str(converter_dir(a.sdist)), str(DEMO), str(gguf), script=__file__)

    from mtp_trt.backend import OrtBackend
    from mtp_trt.decode import DecodeOptions, generate
    from mtp_trt.manifest import Manifest

    export = ensure_export("demo", DEMO, max(a.nextn), "none", 32)
    backend = OrtBackend(Manifest.load(export), threads=a.threads)
    ids = prompt_ids(export / "tokenizer.json")

    def mtp_trt(n: int) -> dict:
        t0 = time.perf_counter()
        generate(backend, [ids], DecodeOptions(nextn=n, max_new_tokens=1))
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        _, stats = generate(backend, [ids], DecodeOptions(nextn=n, max_new_tokens=a.tokens))
        return {"tokens_per_second": (a.tokens - 1) / (time.perf_counter() - t0 - first),
                "tokens_per_step": stats.mean_acceptance_length}

    for n in [0, *a.nextn]:
        mtp_trt(n)  # warm-up
    rows: dict[str, list] = {}
    for _ in range(a.rounds):
        rows.setdefault("llama.cpp plain greedy", []).append(run_child(a.llama_python, "plain", str(gguf), PROMPT, a.tokens,
                                                                         a.threads, script=__file__))
        for k in a.nextn:
            rows.setdefault(f"llama.cpp draft-mtp K {k}", []).append(spec_run(a.llama_bin, gguf, k, a.tokens, a.threads))
        for n in [0, *a.nextn]:
            rows.setdefault(f"mtp-trt fp32 nextn {n}", []).append(mtp_trt(n))
    plain = rows["llama.cpp plain greedy"][0]["text"]
    print(f"\ndemo, {a.threads} thread(s), {a.tokens} new tokens, median of {a.rounds} rounds\n")
    print("| engine | decode tokens/s | tokens per step | drafts accepted | text = llama.cpp plain greedy's |")
    print("|---|---|---|---|---|")
    for name, runs in rows.items():
        speed = statistics.median(r["tokens_per_second"] for r in runs)
        step = f"{runs[0]['tokens_per_step']:.2f}" if "tokens_per_step" in runs[0] else ""
        acc = f"{runs[0]['accepted']} of {runs[0]['drafted']}" if "drafted" in runs[0] else ""
        same = ""
        if "text" in runs[0] and name.startswith("llama.cpp draft"):
            n = common_prefix(runs[0]["text"], plain)
            same = "yes" if n >= min(len(plain), len(runs[0]["text"])) else f"no (from character {n})"
        print(f"| {name} | {speed:.0f} | {step} | {acc} | {same} |")


if __name__ == "__main__":
    main()
