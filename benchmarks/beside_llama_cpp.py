"""mtp-trt beside llama.cpp on the same checkpoints: decode tokens/s and peak RSS, batch 1, greedy, same threads,
interleaved, at every weight type of each side (f32, Q8_0, Q4_0, Q4_K_M GGUFs; mtp-trt --quant none, int8,
int4).  Not run in CI.

  python -m venv LLAMA_VENV && LLAMA_VENV/bin/pip install llama-cpp-python==0.3.36
  pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d SDIST_DIR
  python benchmarks/beside_llama_cpp.py --llama-python LLAMA_VENV/bin/python \\
      --sdist SDIST_DIR/llama_cpp_python-0.3.36.tar.gz [--sizes demo 85m 304m] \\
      [--quant none int8 int4] [--group-size 32] [--gguf f32 q8_0 q4_0 q4_k_m] \\
      [--tokens 64] [--rounds 5] [--threads 2] [--nextn 0 1 2 3] [--prompt-repeat 1] [--no-spin] [--transformers]
      [--json FILE] [--isa scalar|avx2|avx-vnni|avx512-vnni] [--prefill 50 512 2048]
      [--llama-mtp-bin LLAMA_BUILD/bin/llama-speculative-simple]

(--sdist, llama-cpp-python's source distribution, is needed only while a checkpoint's f32 GGUF is not yet in
the cache: it carries llama.cpp's converter.)

Instruction sets: every row names the one its engine runs on (mtp-trt: its CPU kernels' set, ort_lib.cpu_isa;
llama.cpp: the widest set its ggml was compiled with, from llama_print_system_info).  --isa ISA runs both on one
set on any x86 machine that has it: mtp-trt with MTP_TRT_CPU_ISA=ISA, llama.cpp from a --llama-python built for
ISA alone (checked against its system info: refused where it has a wider set or lacks one ISA needs).  For
--isa avx2, a llama-cpp-python built without -march=native and without AVX-512, AVX-VNNI or AMX (about 15
minutes on 2 cores):

  python -m venv LLAMA_AVX2 && CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
      -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF \
      -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
      LLAMA_AVX2/bin/pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36
  python benchmarks/beside_llama_cpp.py --isa avx2 --llama-python LLAMA_AVX2/bin/python ...

(--llama-mtp-bin's binary is not checked: build it with the same flags.)

Prefill (--prefill N ...): for each prompt length N (BOS and the prompt's text repeated, cut at N tokens), fresh
workers of every llama.cpp type and of mtp-trt at nextn 0, round-robin over --rounds, each round one generation
of one token: time to the first token (the prompt's pass and the first token: llama.cpp's whole prompt in one
llama_decode) and prefill tokens/s = N / that time, medians; mtp-trt over llama.cpp at the same bits, the median
of per-round ratios.  The 85m / 304m exports hold 1024 rows a sequence: a longer prompt gets exports of its own
that hold it (the rows rounded up to 256, cached beside the others).

Checkpoints: the demo (samples/demo-model) and the random 85m / 304m of benchmarks/bench_common.py (made on the fly).
GGUFs: llama.cpp's converter (f32) and llama_model_quantize (Q8_0, Q4_0, Q4_K_M), benchmarks/llama_api.py.
mtp-trt: one export per --quant (the demo with all its MTP modules; 85m / 304m with nextn 1, max_seq_len 1024,
as real_size.py exports them).  Everything converted or exported goes under mtp-trt's cache directory, in
bench-real-size (never into git).

How llama.cpp is driven: through its C API (llama-cpp-python's ctypes bindings, not its Python `Llama` class):
the prompt in one `llama_decode` of a `llama_batch`, then one `llama_decode` per new token, each token picked
by llama.cpp's own sampler chain holding only the greedy sampler (`llama_sampler_chain_init`,
`llama_sampler_init_greedy`, `llama_sampler_sample(chain, ctx, -1)`), as llama-cli and llama-server decode:
no Python reads the logits (benchmarks/llama_api.py, LlamaEngine).  Both engines get the same prompt ids,
starting with BOS, and make `--tokens` new tokens (no stop at end-of-text).  --prompt-repeat K: the prompt's text
K times over (a longer context: each new token attends over K times as many rows; the 85m / 304m exports hold
1024 rows a sequence).

Each configuration runs in a worker process of its own (a GGUF type on llama.cpp, or an mtp-trt export at
one nextn), so that its peak RSS (VmHWM, after loading and decoding) is its own; the parent asks each worker
in turn, round-robin, for one timed generation while the others wait.  Decode tokens/s = (new tokens - 1) /
the time after the first token within the same generation (the prompt's pass excluded; mtp-trt's first token
is where `generate` first reports, after the prompt's pass); medians over rounds, the best round's beside them,
and "with prompt" = new tokens / the whole generation's time.  A ratio of two configurations is the median of
their per-round ratios (configurations timed moments apart; the machine is shared).  The table pairs each
mtp-trt quantization with llama.cpp at the same bits: none / f32, int8 / Q8_0, int4 / Q4_K_M and int4 / Q4_0,
at nextn 0 and, on the demo (the only checkpoint whose MTP modules are trained), at the fastest nextn.
--no-spin: neither engine's threads busy-wait (OrtBackend(spin=False); OMP_WAIT_POLICY=PASSIVE for llama.cpp's
OpenMP threads), for a machine busy with other work; by default both spin, as each does on its own.

llama.cpp's own MTP drafting (--llama-mtp-bin: llama.cpp's llama-speculative-simple, built from the llama.cpp
that llama-cpp-python vendors): for each --gguf type and each --nextn K above 0, "llama.cpp <type> draft-mtp K"
joins the round-robin, one process per generation (draft_mtp_command):

  llama-speculative-simple -m <size>-mtp-<type>.gguf --spec-type draft-mtp --spec-draft-n-max K -p PROMPT
      --no-escape --override-kv tokenizer.ggml.add_bos_token=bool:true -n TOKENS --temp 0 --top-k 1
      -t THREADS -ngl 0 -c N

on a GGUF that keeps the checkpoint's first MTP module (llama_api.keep_first_mtp_module: llama.cpp's converter
drops DeepSeek-V3's MTP layer; the harness keeps it as llama.cpp's V3.2 converter does).  llama.cpp's DeepSeek
MTP graph takes one block and drafts every depth with it.  Its decode tokens/s is the binary's own: `decoded N
tokens in S seconds`, N / S, where S is its decode loop from the prompt's last token on (the other prompt
tokens are its `encoded` pass), so the step that makes the first new token is inside it, where the other
configurations leave it out; N is TOKENS + 1 or a few more (its last step is not cut short).  Tokens/step:
n_predict / (n_predict - n_accept), each verify step's accepted drafts and one token of its own, as mtp-trt
counts them.  Peak RSS: the binary's ru_maxrss.  Its text is checked, byte for byte, against llama.cpp's plain
greedy tokens (LlamaEngine) on the same GGUF.
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
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import DEMO, PROMPT, make_checkpoint, peak_rss_mb  # noqa: E402
from llama_api import (EXPORT_ROWS, GGUF_LABELS, GGUF_TYPES, LlamaEngine, ensure_export, ensure_gguf,  # noqa: E402
                       run_child)

QUANTS = ("none", "int8", "int4")
PAIRS = (("none", "f32"), ("int8", "q8_0"), ("int4", "q4_k_m"), ("int4", "q4_0"))  # same bits: mtp-trt / llama.cpp


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


# Inputs of mtp-trt's MoE operators that hold the routed experts ([E, ...] each): a token reads top_k of E
ROUTED_INPUTS = {"MoE": (3, 4), "QMoE": (3, 4, 5, 6)}
# Inputs read one row per token (an embedding, RoPE's tables at the token's position): [rows, ...]
ROW_INPUTS = {"Gather": (0,), "GatherBlockQuantized": (0, 2), "MlaSelfAttention": (4, 5)}


def graph_bytes_per_token(model) -> int:
    """Bytes of constant weights (initializers) one token reads through an ONNX graph `model` (loaded without its
    external data): each initializer once, routed experts at top_k / E, a gathered table or RoPE table one row."""
    import onnx

    sizes = {t.name: (math.prod(t.dims) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize, list(t.dims))
             for t in model.graph.initializer}
    share: dict[str, float] = {}  # initializer -> the share of it a token reads (the largest any node reads)
    for node in model.graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        for i, name in enumerate(node.input):
            if name not in sizes:
                continue
            dims = sizes[name][1]
            if i in ROUTED_INPUTS.get(node.op_type, ()) and attrs.get("top_k") and dims:
                part = attrs["top_k"] / dims[0]
            elif i in ROW_INPUTS.get(node.op_type, ()) and dims:
                part = 1 / dims[0]
            else:
                part = 1.0
            share[name] = max(share.get(name, 0.0), part)
    return int(sum(sizes[n][0] * f for n, f in share.items()))


def export_bytes_per_token(export: Path) -> int:
    """graph_bytes_per_token of an export's plain decode step (its step graph at nextn 0)."""
    import onnx
    from mtp_trt.manifest import Manifest

    m = Manifest.load(export)
    return graph_bytes_per_token(onnx.load(str(m.root / m.graphs["step_0"].file), load_external_data=False))


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


def prompt_ids(tokenizer_json: Path, text: str = PROMPT) -> list[int]:
    from tokenizers import Tokenizer

    return [1] + Tokenizer.from_file(str(tokenizer_json)).encode(text).ids  # BOS first


def prefill_ids(tokenizer_json: Path, n: int) -> list[int]:
    """n prompt ids, BOS first: the prompt's text repeated as often as it takes, cut at n tokens."""
    repeat = 1
    while len(ids := prompt_ids(tokenizer_json, PROMPT * repeat)) < n:
        repeat = repeat * 2
    return ids[:n]


def prefill_rows(size: str, lengths: list[int]) -> int | None:
    """The cache rows a sequence of the prefill exports of checkpoint `size` holds: None (the decode exports')
    where EXPORT_ROWS hold the longest prompt and its first token, else that rounded up to 256 (85m / 304m; the
    demo's exports hold 4096)."""
    need = max(lengths) + 2
    return None if size == "demo" or need <= EXPORT_ROWS else -(-need // 256) * 256


def prefill_table(size: str, n: int, runs: dict, label_of, isa_of: dict) -> list[dict]:
    """Rows of the prefill table for prompts of n tokens: each configuration's time to the first token (the
    prompt's pass and the first token's, median over rounds) and prefill tokens/s (n over it); mtp-trt's rows
    also the median of per-round ratios to each llama.cpp type at the same bits (speed, mtp-trt over it)."""
    out = []
    for k, rs in runs.items():
        ttft = statistics.median(r["first"] for r in rs)
        row = {"size": size, "prompt_tokens": n, "engine": label_of(k), "isa": isa_of[k[0]], "kind": k[0],
               "weights": k[1], "ttft_ms": ttft * 1e3, "prefill_tokens_per_second": n / ttft,
               "firsts": [r["first"] for r in rs]}
        if k[0] == "mtp":
            row["speed_ratio"] = {GGUF_LABELS[g]: statistics.median(y["first"] / x["first"]
                                                                    for x, y in zip(rs, runs[("llama", g)]))
                                  for q, g in PAIRS if q == k[1] and ("llama", g) in runs}
        out.append(row)
    return out


class LlamaWorker:
    """llama.cpp through its C API: llama_decode and its greedy sampler chain (llama_api.LlamaEngine)."""

    def __init__(self, gguf: str, ids: list[int], tokens: int, threads: int):
        self.ids, self.tokens = ids, tokens
        self.engine = LlamaEngine(gguf, n_ctx=len(ids) + tokens + 16, threads=threads)

    def __call__(self) -> list[int]:
        out = self.engine.generate(self.ids, self.tokens)
        self.first = self.engine.first  # prompt + first token
        return out


class MtpWorker:
    """mtp-trt on ONNX Runtime at one nextn (greedy, eagle step graphs where exported)."""

    def __init__(self, export: str, ids: list[int], tokens: int, threads: int, nextn: int):
        from mtp_trt.backend import OrtBackend
        from mtp_trt.decode import DecodeOptions, generate
        from mtp_trt.manifest import Manifest

        backend = OrtBackend(Manifest.load(export), threads=threads, spin=os.environ.get("MTP_TRT_SPIN", "1") == "1")
        opts = DecodeOptions(nextn=nextn, max_new_tokens=tokens)  # no EOS: always `tokens` new tokens
        self.run = lambda on_step: generate(backend, [ids], opts, on_step=on_step)

    def __call__(self) -> list[int]:
        marks = []  # when generate first reports: its first token, after the prompt's pass
        t0 = time.perf_counter()
        seqs, self.stats = self.run(lambda _: marks or marks.append(time.perf_counter()))
        self.first = marks[0] - t0  # prompt + first token, inside the timed generation (as llama.cpp's)
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
            seconds = time.perf_counter() - t0  # one whole generation
            extra = {"mean_acceptance_length": fn.stats.mean_acceptance_length} if kind == "mtp" else {}
            print(json.dumps({"seconds": seconds, "first": fn.first, "generated": out, **extra}), flush=True)
        else:
            print(json.dumps({"peak_rss_mb": peak_rss_mb()}), flush=True)
            return


def draft_mtp_command(binary: str, gguf: str, k: int, tokens: int, threads: int, n_ctx: int,
                      prompt: str = PROMPT) -> list[str]:
    """llama-speculative-simple drafting `k` tokens a step with the GGUF's MTP block, greedy, on the CPU.  The
    prompt goes in as text (-p; -f would drop its final newline), unescaped, llama.cpp adding BOS itself."""
    return [binary, "-m", gguf, "--spec-type", "draft-mtp", "--spec-draft-n-max", str(k), "-p", prompt,
            "--no-escape", "--override-kv", "tokenizer.ggml.add_bos_token=bool:true", "-n", str(tokens),
            "--temp", "0", "--top-k", "1", "-t", str(threads), "-ngl", "0", "-c", str(n_ctx)]


def parse_draft_mtp(stdout: bytes, stderr: str) -> dict:
    """llama-speculative-simple's output -> its text (the prompt echoed, the new tokens, then two or four
    newlines of its own: the last two are sometimes lost at its exit) and its figures:
    `encoded N tokens in S seconds, speed: R t/s` (N: the prompt's tokens; S: its pass over all but the last),
    `decoded ...` (N: the new tokens; S: the decode loop, from the prompt's last token on, every draft and
    verify step), n_draft / n_predict / n_drafted / n_accept.  Seconds are N / the printed speed (which has
    more digits than the printed seconds).  ValueError names what is missing."""
    if not stdout.startswith(b"\n\n") or not stdout.endswith(b"\n\n"):
        raise ValueError("its standard output is not '\\n\\n' + the text + '\\n\\n'")
    out = {"text": stdout[2:]}
    for name in ("encoded", "decoded"):
        m = re.search(name + r"\s+(\d+) tokens in\s+[\d.]+ seconds, speed:\s*([\d.]+) t/s", stderr)
        if m is None:
            raise ValueError(f"no '{name} N tokens in S seconds, speed: R t/s' line on its standard error")
        n, rate = int(m.group(1)), float(m.group(2))
        if rate <= 0:
            raise ValueError(f"its '{name}' line gives speed {rate}")
        out[name], out[f"{name}_seconds"] = n, n / rate
    for name in ("n_draft", "n_predict", "n_drafted", "n_accept"):
        m = re.search(r"\b" + name + r"\s*=\s*(\d+)", stderr)
        if m is None:
            raise ValueError(f"no '{name} = N' line on its standard error")
        out[name] = int(m.group(1))
    if out["n_predict"] != out["decoded"] or not 0 <= out["n_accept"] < out["n_predict"]:
        raise ValueError(f"inconsistent figures: decoded {out['decoded']}, n_predict {out['n_predict']}, "
                         f"n_accept {out['n_accept']}")
    # each verify step keeps its accepted drafts and one token of its own
    out["mean_acceptance_length"] = out["n_predict"] / (out["n_predict"] - out["n_accept"])
    return out


def first_difference(text: bytes, pieces: list[bytes]) -> int | None:
    """The first new token whose bytes `text` does not carry at its place (`pieces`: a reference's new tokens);
    None if `text` begins with all of them."""
    at = 0
    for i, p in enumerate(pieces):
        if text[at:at + len(p)] != p:
            return i
        at += len(p)
    return None


# Runs argv[1:] as a child of its own and reports the child's exit status and peak RSS on its last stderr line.
# A small process between them: Linux carries a process's peak RSS over fork and exec into its child's figure,
# so the harness's own (larger) peak would hide the binary's.
LAUNCHER = """import os, sys
pid = os.fork()
if pid == 0:
    try:
        os.execv(sys.argv[1], sys.argv[1:])
    except OSError as e:
        sys.stderr.write(f"cannot run it ({e.strerror})\\n")
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
sys.stderr.write(f"\\nlauncher: exit {os.waitstatus_to_exitcode(status)} peak_rss_kib {usage.ru_maxrss}\\n")
"""


class DraftMtpRunner:
    """llama.cpp's own MTP drafting: one llama-speculative-simple process per generation (draft_mtp_command),
    with the same ask / close protocol as Worker.  Each reply: `seconds` = its prompt pass + --tokens new tokens
    at its decode rate, `first` = its prompt pass + one token at that rate (so that the harness's decode figure
    is the binary's own), its text checked against llama.cpp's plain greedy tokens on the same GGUF."""

    def __init__(self, binary: str, gguf: str, ids: list[int], tokens: int, threads: int, k: int,
                 reference: dict, spin: bool = True, prompt: str = PROMPT):
        self.binary, self.gguf, self.tokens = binary, gguf, tokens
        self.cmd = draft_mtp_command(binary, gguf, k, tokens, threads, len(ids) + tokens + k + 16, prompt)
        self.env = os.environ | ({} if spin else {"OMP_WAIT_POLICY": "PASSIVE"})
        self.n_prompt = len(ids)
        self.prompt_text = bytes.fromhex(reference["prompt_text"])
        self.pieces = [bytes.fromhex(p) for p in reference["pieces"]]
        self.peak_rss = 0.0
        self.ready = self.ask(None)  # a warm-up run: the file read once, every failure seen before the rounds

    def fail(self, why: str) -> SystemExit:
        return SystemExit(f"error: --llama-mtp-bin {self.binary} on {self.gguf}: {why}")

    def run(self) -> tuple[bytes, str]:
        """One run of the binary -> its standard output and error (its peak RSS noted)."""
        with tempfile.TemporaryFile() as out:
            res = subprocess.run([sys.executable, "-S", "-c", LAUNCHER, *self.cmd], stdout=out,
                                 stderr=subprocess.PIPE, env=self.env)
            out.seek(0)
            stdout = out.read()
        lines = res.stderr.decode(errors="replace").rstrip().splitlines() or ["no output"]
        m = re.fullmatch(r"launcher: exit (-?\d+) peak_rss_kib (\d+)", lines[-1])
        if res.returncode or m is None or m.group(1) != "0":
            why = f"exit {m.group(1)}" if m else "failed"
            last = next((x.strip() for x in reversed(lines[:-1] if m else lines) if x.strip()), "no output")
            raise self.fail(f"{why}; its last line: {last}")
        self.peak_rss = max(self.peak_rss, int(m.group(2)) / 1024)  # KiB on Linux
        return stdout, "\n".join(lines[:-1])

    def ask(self, line: str | None) -> dict:
        for _ in range(3):  # llama.cpp's log thread sometimes loses its last lines at exit: run it again
            try:
                r = parse_draft_mtp(*self.run())
                break
            except ValueError as e:
                why = str(e)
        else:
            raise self.fail(f"{why} (3 runs)")
        if r["encoded"] != self.n_prompt or not r["text"].startswith(self.prompt_text):
            raise self.fail(f"its prompt is not the harness's {self.n_prompt} tokens (it encoded {r['encoded']}; "
                            f"its echo begins {r['text'][:40]!r})")
        generated = r["text"][len(self.prompt_text):]
        rate = r["decoded"] / r["decoded_seconds"]
        return {"seconds": r["encoded_seconds"] + self.tokens / rate, "first": r["encoded_seconds"] + 1 / rate,
                "first_difference": first_difference(generated, self.pieces),
                "mean_acceptance_length": r["mean_acceptance_length"],
                **{x: r[x] for x in ("decoded", "decoded_seconds", "n_drafted", "n_accept")}}

    def close(self) -> float:
        return self.peak_rss


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
            raise SystemExit(f"worker {self.proc.args[-1][:100]} died (exit {self.proc.wait()}); see its stderr above")
        return json.loads(reply)

    def close(self) -> float:
        rss = self.ask("exit")["peak_rss_mb"]
        self.proc.wait()
        return rss


def child_script(*args) -> dict:
    """Run this script's own `--child` entries in a fresh process of this Python (checkpoint, margins)."""
    res = subprocess.run([sys.executable, __file__, "--child", json.dumps(args)], stdout=subprocess.PIPE, text=True)
    if res.returncode:
        raise SystemExit(f"{args[0]} failed (exit {res.returncode}); see above")
    return json.loads(res.stdout.strip().splitlines()[-1])


def isa_child() -> list:
    """(in a child process: the library reads MTP_TRT_CPU_ISA once per process) [the instruction set mtp-trt's
    CPU kernels take in this environment, why MTP_TRT_CPU_ISA is refused or ""]; [None, why] where the
    operators are not available."""
    from mtp_trt.errors import MtpTrtError
    from mtp_trt.plugins import ort_lib

    try:
        return list(ort_lib.cpu_isa())
    except MtpTrtError as e:
        return [None, str(e)]


def check_llama_python(python: str) -> None:
    res = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
                         text=True, cwd="/")
    if res.returncode:
        why = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"--llama-python {python}: cannot import llama_cpp ({why}); pass a Python with "
                         f"llama-cpp-python installed")


def round_ratio(a: list[dict], b: list[dict], tokens: int) -> float:
    """Decode tokens/s of runs `a` over runs `b`: the median of the per-round ratios."""
    return statistics.median((y["seconds"] - y["first"]) / (x["seconds"] - x["first"]) for x, y in zip(a, b))


def label(key: tuple) -> str:
    if key[0] == "llama-mtp":
        return f"llama.cpp {GGUF_LABELS[key[1]]} draft-mtp {key[2]}"
    return f"llama.cpp {GGUF_LABELS[key[1]]}" if key[0] == "llama" else f"mtp-trt {key[1]} nextn {key[2]}"


# llama.cpp's CPU features (llama_print_system_info's `NAME = 1` flags: those its ggml was compiled with) that an
# --isa needs, and those it must lack, so that both engines run one instruction set.
ISA_FEATURES = {
    "scalar": ((), ("AVX", "AVX2", "FMA", "F16C", "AVX512", "AVX_VNNI", "AVX512_VNNI", "AMX_INT8")),
    "avx2": (("AVX2", "FMA", "F16C"), ("AVX512", "AVX_VNNI", "AVX512_VNNI", "AMX_INT8")),
    "avx-vnni": (("AVX2", "FMA", "F16C", "AVX_VNNI"), ("AVX512", "AVX512_VNNI", "AMX_INT8")),
    "avx512-vnni": (("AVX2", "FMA", "F16C", "AVX512", "AVX512_VNNI"), ("AMX_INT8",)),
}


def llama_features(system_info: str) -> set[str]:
    """The CPU features llama_print_system_info() says its ggml was built with (`AVX2 = 1 | ...`)."""
    return {name for name, on in re.findall(r"\b([A-Z][A-Z0-9_]*) = (\d+)", system_info) if on != "0"}


def llama_isa(system_info: str) -> str:
    """The instruction set (ort_lib.CPU_ISAS' names) of a llama.cpp build: the widest of ISA_FEATURES whose
    features it has ("scalar" where none)."""
    have = llama_features(system_info)
    return next(isa for isa in reversed(ISA_FEATURES) if set(ISA_FEATURES[isa][0]) <= have)


def llama_isa_problem(system_info: str, isa: str) -> str | None:
    """Why a llama.cpp build with this system info is not built for `isa` alone, or None."""
    need, lack = ISA_FEATURES[isa]
    have = llama_features(system_info)
    missing, extra = [f for f in need if f not in have], [f for f in lack if f in have]
    if not missing and not extra:
        return None
    return "its ggml was built " + "; ".join(
        ([f"without {', '.join(missing)}"] if missing else []) + ([f"with {', '.join(extra)}"] if extra else []))


def llama_system_info(python: str) -> str:
    res = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"],
                         capture_output=True, text=True, cwd="/")
    if res.returncode:
        raise SystemExit(f"--llama-python {python}: cannot read llama.cpp's system info "
                         f"({(res.stderr.strip().splitlines() or ['no output'])[-1]})")
    return res.stdout.strip()


def check_isa(isa: str, llama_python: str) -> str:
    """--isa: mtp-trt's kernels (MTP_TRT_CPU_ISA, set for every process from here on) and llama.cpp's build both
    on `isa`, else SystemExit in one line; returns llama.cpp's system info."""
    from mtp_trt.plugins import ort_lib

    os.environ[ort_lib.CPU_ISA_ENV] = isa
    refused = child_script("isa")[1]
    if refused:
        raise SystemExit(f"--isa {isa}: {refused}")
    info = llama_system_info(llama_python)
    why = llama_isa_problem(info, isa)
    if why:
        raise SystemExit(f"--isa {isa}: --llama-python {llama_python}: {why} (build llama-cpp-python for {isa}: "
                         f"see benchmarks/beside_llama_cpp.py's docstring)")
    return info


def check_draft_mtp_binary(binary: str) -> str | None:
    """Why `binary` cannot be llama.cpp's llama-speculative-simple with MTP drafting, or None."""
    if not Path(binary).is_file() or not os.access(binary, os.X_OK):
        return "no such executable file (llama.cpp's llama-speculative-simple)"
    try:
        res = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run it ({e})"
    if "--spec-type" not in res.stdout + res.stderr or "draft-mtp" not in res.stdout + res.stderr:
        return "its --help offers no --spec-type draft-mtp (llama.cpp's llama-speculative-simple with MTP drafting)"
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["demo", "85m", "304m"], choices=["demo", "85m", "304m"])
    ap.add_argument("--sdist", type=Path, help="llama-cpp-python's source distribution (pip download --no-binary "
                    ":all:), for its converter; needed while a checkpoint's f32 GGUF is not cached")
    ap.add_argument("--llama-python", default=sys.executable, help="a Python with llama_cpp installed")
    ap.add_argument("--quant", nargs="+", default=["none"], choices=QUANTS, help="mtp-trt weight quantizations")
    ap.add_argument("--group-size", type=int, default=32, help="mtp-trt's quantization block (default 32)")
    ap.add_argument("--gguf", nargs="+", default=["f32"], choices=list(GGUF_TYPES), help="llama.cpp GGUF types")
    ap.add_argument("--nextn", type=int, nargs="+", default=None,
                    help="mtp-trt configurations (default: 0 1 2 3 on the demo, 0 on the others)")
    ap.add_argument("--transformers", action="store_true",
                    help="also compare every engine's tokens with transformers' greedy decoding (slow at 304m)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-repeat", type=int, default=1, help="the prompt's text this many times over")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-spin", action="store_true", help="neither engine's threads busy-wait (a busy machine)")
    ap.add_argument("--llama-mtp-bin", help="llama.cpp's llama-speculative-simple: also run llama.cpp's own MTP "
                    "drafting (--spec-type draft-mtp) at every --nextn K above 0, on GGUFs that keep the MTP block")
    ap.add_argument("--prefill", type=int, nargs="+", metavar="N",
                    help="also time the first token after prompts of N tokens (BOS first; the prompt's text "
                         "repeated): time to first token and prefill tokens/s, mtp-trt at nextn 0")
    ap.add_argument("--isa", choices=ISA_FEATURES, help="both engines on one instruction set: mtp-trt with "
                    "MTP_TRT_CPU_ISA=ISA, and a --llama-python whose llama.cpp is built for ISA alone (checked)")
    ap.add_argument("--json", type=Path, help="also write the report here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(*json.loads(a.worker))
        return
    if a.child:
        name, *args = json.loads(a.child)
        jobs = {"checkpoint": lambda size: str(make_checkpoint(size)), "margins": margins_child, "isa": isa_child}
        print(json.dumps(jobs[name](*args)))
        return
    if a.tokens < 2 or a.rounds < 1:
        raise SystemExit("--tokens must be >= 2 and --rounds >= 1")
    if a.prompt_repeat < 1:
        ap.error(f"--prompt-repeat {a.prompt_repeat}: must be >= 1")
    if a.prefill and min(a.prefill) < 2:
        ap.error(f"--prefill {min(a.prefill)}: a prompt is BOS and at least one token (N >= 2)")
    nextn_of = {size: a.nextn or ([0, 1, 2, 3] if size == "demo" else [0]) for size in a.sizes}
    if a.llama_mtp_bin:
        if not any(n > 0 for ns in nextn_of.values() for n in ns):
            given = f"--nextn {' '.join(map(str, a.nextn))}" if a.nextn else f"--nextn is 0 on {' '.join(a.sizes)}"
            ap.error(f"--llama-mtp-bin: no --nextn above 0 to draft with ({given})")
        why = check_draft_mtp_binary(a.llama_mtp_bin)
        if why:
            ap.error(f"--llama-mtp-bin {a.llama_mtp_bin}: {why}")
    if any(q != "none" for q in a.quant):
        from mtp_trt.errors import MtpTrtError
        from mtp_trt.plugins import ort_lib
        from mtp_trt.quant import scheme

        try:
            scheme("int8", a.group_size, "--group-size")
        except MtpTrtError as e:
            raise SystemExit(str(e)) from None
        ok, why = ort_lib.available()
        if not ok:
            raise SystemExit(f"--quant {' '.join(a.quant)}: quantized exports run on mtp-trt's CPU operators, "
                             f"which are not available here ({why})")
    check_llama_python(a.llama_python)
    llama_info = check_isa(a.isa, a.llama_python) if a.isa else llama_system_info(a.llama_python)
    isa_of = {"llama": llama_isa(llama_info), "llama-mtp": None,  # (the binary's set: not read)
              "mtp": a.isa or child_script("isa")[0]}
    print(f"instruction sets: mtp-trt {isa_of['mtp']}, llama.cpp {isa_of['llama']} ({llama_info})", flush=True)
    report, tables, drafting_tables, prefill, quant_ratios = [], [], [], [], []
    for size, nextns in nextn_of.items():
        ckpt = DEMO if size == "demo" else Path(child_script("checkpoint", size))
        progress = lambda m: print(m, flush=True)  # noqa: E731
        ggufs = {k: ensure_gguf(size, ckpt, k, a.sdist, a.llama_python, a.threads, progress) for k in a.gguf}
        draft_ks = [n for n in nextns if n > 0] if a.llama_mtp_bin else []
        mtp_ggufs = {k: ensure_gguf(size, ckpt, k, a.sdist, a.llama_python, a.threads, progress, mtp=True)
                     for k in a.gguf} if draft_ks else {}
        exports = {q: ensure_export(size, ckpt, max(nextns), q, a.group_size, progress) for q in a.quant}
        text = PROMPT * a.prompt_repeat
        ids = prompt_ids(ckpt / "tokenizer.json", text)
        from mtp_trt.manifest import Manifest

        for e in exports.values():  # every sequence must fit the export's cache
            rows = len(ids) + a.tokens + 2 * max(nextns) + 2
            if rows > (cap := Manifest.load(e).max_seq_len):
                raise SystemExit(f"--prompt-repeat {a.prompt_repeat}: {size} needs {rows} cache rows a sequence "
                                 f"({len(ids)} prompt tokens, --tokens {a.tokens}), its export {e} holds {cap}")
        spin = not a.no_spin
        workers = {("llama", k): Worker(a.llama_python, "llama", str(g), ids, a.tokens, a.threads, spin=spin)
                   for k, g in ggufs.items()}
        workers |= {("mtp", q, n): Worker(sys.executable, "mtp", str(e), ids, a.tokens, a.threads, n, spin=spin)
                    for q, e in exports.items() for n in nextns}
        plain = {k: run_child(a.llama_python, "greedy", str(g), ids, a.tokens, a.threads) for k, g in mtp_ggufs.items()}
        workers |= {("llama-mtp", k, n): DraftMtpRunner(a.llama_mtp_bin, str(g), ids, a.tokens, a.threads, n, plain[k],
                                                        spin=spin, prompt=text)
                    for k, g in mtp_ggufs.items() for n in draft_ks}
        runs = {k: [] for k in workers}
        for _ in range(a.rounds):
            for k, w in workers.items():
                runs[k].append(w.ask("run"))
        rss = {k: w.close() for k, w in workers.items()}
        rate = {k: {"decode": (a.tokens - 1) / statistics.median(r["seconds"] - r["first"] for r in rs),
                    "best": (a.tokens - 1) / min(r["seconds"] - r["first"] for r in rs),
                    "with_prompt": a.tokens / statistics.median(r["seconds"] for r in rs)}
                for k, rs in runs.items()}
        ref_key = ("llama", "f32") if ("llama", "f32") in runs else next(iter(runs))
        ref = runs[ref_key][-1]["generated"]
        streamed = active_bytes(ckpt)
        print(f"\n{size}: {streamed / 1e6:.1f} MB of f32 weights read per decoded token (active parameters); "
              f"{a.rounds} rounds, {a.tokens} new tokens, {a.threads} threads")
        per_token = {q: export_bytes_per_token(e) for q, e in exports.items()}
        for q, n in per_token.items():
            print(f"{size}: mtp-trt {q}: {n / 1e6:.1f} MB of weights read per token by a plain decode step", flush=True)
        for k, rs in runs.items():
            if k[0] == "llama-mtp":  # its text against llama.cpp's plain greedy tokens on its own GGUF
                first_diff, against = rs[-1]["first_difference"], f"llama.cpp {GGUF_LABELS[k[1]]} plain greedy"
            else:
                gen = rs[-1]["generated"]
                first_diff = next((i for i, (x, y) in enumerate(zip(gen, ref)) if x != y), None)
                against = label(ref_key)
            row = {"size": size, "engine": label(k), "isa": isa_of[k[0]], "kind": k[0], "weights": k[1],
                   "nextn": k[2] if k[0] != "llama" else None, "decode_tokens_per_second": rate[k]["decode"],
                   "best_decode_tokens_per_second": rate[k]["best"], "tokens_per_second": rate[k]["with_prompt"],
                   "peak_rss_mb": rss[k], "first_difference_from": against, "first_difference": first_diff,
                   "mean_acceptance_length": rs[-1].get("mean_acceptance_length"),
                   "runs": [{x: r[x] for x in ("seconds", "first")} for r in rs]}
            if k[0] == "mtp" and k[2] == 0:  # the weights' stream: bytes a token reads times tokens/s
                row["weights_gb_per_second"] = per_token[k[1]] * rate[k]["decode"] / 1e9
            report.append(row)
            print(f"{size:5s} {label(k):30s} [{row['isa'] or '?'}] decode {rate[k]['decode']:8.1f} tokens/s "
                  f"(best round "
                  f"{rate[k]['best']:8.1f}; with the prompt {rate[k]['with_prompt']:8.1f}), peak RSS {rss[k]:6.0f} MB"
                  + (f", {row['mean_acceptance_length']:.2f} tokens/step" if row["nextn"] else "")
                  + (f", weights at {row['weights_gb_per_second']:.1f} GB/s" if "weights_gb_per_second" in row else "")
                  + ("" if k == ref_key else f"; tokens = {against}'s: "
                     + ("yes" if first_diff is None else f"no (first difference at new token {first_diff})")),
                  flush=True)
        if ("mtp", "int4", 0) in runs and ("mtp", "int8", 0) in runs:  # what int4 gains over int8, and could
            ratio = round_ratio(runs[("mtp", "int4", 0)], runs[("mtp", "int8", 0)], a.tokens)
            fewer = per_token["int8"] / per_token["int4"]
            quant_ratios.append({"size": size, "int4_over_int8": ratio, "int8_bytes_over_int4": fewer})
            print(f"{size}: mtp-trt int4 over int8 at nextn 0: {ratio:.2f}x tokens/s, reading {fewer:.2f}x fewer "
                  f"weight bytes per token", flush=True)
        for q, g in PAIRS:
            if ("llama", g) not in runs or q not in exports:
                continue
            configs = [("nextn 0", ("mtp", q, 0))] if 0 in nextns else []
            drafting = [("mtp", q, n) for n in nextns if n > 0]
            if size == "demo" and drafting:
                best = max(drafting, key=lambda k: rate[k]["decode"])
                configs.append((f"best nextn ({best[2]})", best))
            for what, k in configs:
                tables.append({"size": size, "pair": f"{q} / {GGUF_LABELS[g]}", "config": what,
                               "isa": f"{isa_of['mtp']} / {isa_of['llama']}",
                               "mtp_tokens_per_second": rate[k]["decode"],
                               "llama_tokens_per_second": rate[("llama", g)]["decode"],
                               "speed_ratio": round_ratio(runs[k], runs[("llama", g)], a.tokens),
                               "mtp_rss_mb": rss[k], "llama_rss_mb": rss[("llama", g)],
                               "rss_ratio": rss[k] / rss[("llama", g)]})
            if drafting:  # mtp-trt's fastest nextn beside llama.cpp's own MTP drafting at each K, same bits
                best = max(drafting, key=lambda k: rate[k]["decode"])
                for n in draft_ks:
                    k = ("llama-mtp", g, n)
                    drafting_tables.append({
                        "size": size, "pair": f"{q} / {GGUF_LABELS[g]}", "nextn": best[2],
                        "mtp_acceptance_length": runs[best][-1]["mean_acceptance_length"],
                        "mtp_tokens_per_second": rate[best]["decode"], "draft_mtp_k": n,
                        "llama_acceptance_length": runs[k][-1]["mean_acceptance_length"],
                        "llama_tokens_per_second": rate[k]["decode"],
                        "speed_ratio": round_ratio(runs[best], runs[k], a.tokens),
                        "llama_over_plain": round_ratio(runs[k], runs[("llama", g)], a.tokens)})
        if a.prefill:  # each prompt length its own workers: llama.cpp's types, mtp-trt at nextn 0
            rows = prefill_rows(size, a.prefill)
            pexports = exports if rows is None else {
                q: ensure_export(size, ckpt, max(nextns), q, a.group_size, progress, rows=rows) for q in a.quant}
            for e in pexports.values():
                if max(a.prefill) + 2 > (cap := Manifest.load(e).max_seq_len):
                    raise SystemExit(f"--prefill {max(a.prefill)}: {size}'s export {e} holds {cap} cache rows")
            for n in a.prefill:
                pids = prefill_ids(ckpt / "tokenizer.json", n)
                pw = {("llama", k): Worker(a.llama_python, "llama", str(g), pids, 1, a.threads, spin=spin)
                      for k, g in ggufs.items()}
                pw |= {("mtp", q, 0): Worker(sys.executable, "mtp", str(e), pids, 1, a.threads, 0, spin=spin)
                       for q, e in pexports.items()}
                pruns = {k: [] for k in pw}
                for _ in range(a.rounds):
                    for k, w in pw.items():
                        pruns[k].append(w.ask("run"))
                for w in pw.values():
                    w.close()
                for row in prefill_table(size, n, pruns, label, isa_of):
                    prefill.append(row)
                    ratios = ", ".join(f"{v:.2f}x {g}" for g, v in row.get("speed_ratio", {}).items())
                    print(f"{size:5s} prefill {n:5d} tokens  {row['engine']:30s} [{row['isa'] or '?'}] first token "
                          f"{row['ttft_ms']:8.1f} ms, {row['prefill_tokens_per_second']:8.0f} tokens/s"
                          + (f"; speed over llama.cpp: {ratios}" if ratios else ""), flush=True)
        if a.transformers:
            engines = {label(k): rs[-1]["generated"] for k, rs in runs.items() if k[0] != "llama-mtp"}
            for k, v in child_script("margins", str(ckpt), ids, engines).items():
                print(f"{size:5s} {k:30s} vs transformers' greedy tokens: " + (
                    "equal" if v["first_difference"] is None else
                    f"first difference at new token {v['first_difference']}, where transformers' top-2 logits are "
                    f"{v['top2_margin']:.1e} apart"), flush=True)
    print_tables(report, tables, drafting_tables, prefill)
    out = {"report": report, "pairs": tables} | ({"int4_over_int8": quant_ratios} if quant_ratios else {}) | \
        ({"draft_mtp": drafting_tables} if a.llama_mtp_bin else {}) | \
        ({"prefill": prefill} if a.prefill else {})
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


def print_tables(report: list[dict], tables: list[dict], drafting: list[dict] = (),
                 prefill: list[dict] = ()) -> None:
    print("\n| checkpoint | engine | instruction set | decode tokens/s (median) | best round | peak RSS MB | "
          "tokens/step |")
    print("|---|---|---|---|---|---|---|")
    for r in report:
        acc = f"{r['mean_acceptance_length']:.2f}" if r["nextn"] else ""
        print(f"| {r['size']} | {r['engine']} | {r.get('isa') or '?'} | {r['decode_tokens_per_second']:.1f} | "
              f"{r['best_decode_tokens_per_second']:.1f} | {r['peak_rss_mb']:.0f} | {acc} |")
    if tables:
        print("\n| checkpoint | mtp-trt / llama.cpp | instruction sets | mtp-trt config | mtp-trt tokens/s | "
              "llama.cpp tokens/s | speed ratio | mtp-trt RSS MB | llama.cpp RSS MB | RSS ratio |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for t in tables:
            print(f"| {t['size']} | {t['pair']} | {t.get('isa', '?')} | {t['config']} | "
                  f"{t['mtp_tokens_per_second']:.1f} | "
                  f"{t['llama_tokens_per_second']:.1f} | {t['speed_ratio']:.2f}x | {t['mtp_rss_mb']:.0f} | "
                  f"{t['llama_rss_mb']:.0f} | {t['rss_ratio']:.2f}x |")
    if drafting:
        print("\n| checkpoint | mtp-trt / llama.cpp | mtp-trt nextn | tokens/step | tokens/s | llama.cpp draft-mtp K | "
              "tokens/step | tokens/s | speed ratio | llama.cpp draft-mtp over plain |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for t in drafting:
            print(f"| {t['size']} | {t['pair']} | {t['nextn']} (fastest) | {t['mtp_acceptance_length']:.2f} | "
                  f"{t['mtp_tokens_per_second']:.1f} | {t['draft_mtp_k']} | {t['llama_acceptance_length']:.2f} | "
                  f"{t['llama_tokens_per_second']:.1f} | {t['speed_ratio']:.2f}x | {t['llama_over_plain']:.2f}x |")
    if prefill:
        print("\n| checkpoint | prompt tokens | engine | instruction set | time to first token ms | prefill tokens/s | "
              "speed ratio |")
        print("|---|---|---|---|---|---|---|")
        for r in prefill:
            ratio = ", ".join(f"{v:.2f}x {g}" for g, v in r.get("speed_ratio", {}).items())
            print(f"| {r['size']} | {r['prompt_tokens']} | {r['engine']} | {r['isa'] or '?'} | {r['ttft_ms']:.1f} | "
                  f"{r['prefill_tokens_per_second']:.0f} | {ratio} |")
    print("(speed ratio: median of per-round ratios of decode tokens/s, mtp-trt over llama.cpp; RSS ratio: peak "
          "RSS, mtp-trt over llama.cpp" + ("; prefill: of the times to the first token, llama.cpp's over mtp-trt's at "
                                           "the same bits" if prefill else "") + ")", flush=True)


if __name__ == "__main__":
    main()
