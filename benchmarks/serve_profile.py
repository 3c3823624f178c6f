"""Where a served request's time goes: `mtp-trt serve` on the demo under N concurrent greedy streaming clients,
sampled by py-spy (`pip install py-spy`), every thread's busy samples sorted into the HTTP layer and event loop,
tokenizing, detokenizing (the text streamed), prefill (graph time and Python), the decode step's graph calls
(ONNX Runtime), the decode step's Python, the adaptive policy, and the rest.  Shares of the sampled busy time,
so that a busy machine still gives a fair split (its absolute speed does not matter here).  Not run in CI.

  python benchmarks/serve_profile.py [--clients 1 16] [--serve-args "--nextn 0"] [--seconds 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import collections
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import Server, stream_one  # noqa: E402

from mtp_trt.bench import PROMPTS  # noqa: E402
from mtp_trt.runner import demo_model  # noqa: E402

# (category, frame substrings: the first category any frame of a sample matches, innermost first)
CATEGORIES = [
    ("policy (auto K)", ("auto_k", "choose_k")),
    ("tokenize", ("encode (mtp_trt/tokenizer.py", "prepare_completion", "prepare_chat")),
    ("detokenize + stop strings", ("_text (mtp_trt/serve.py", "held_back", "cut_at_stop")),
    ("prefill: graphs", ("prefill_chunk+run", )),
    ("prefill: Python", ("prefill_chunk", "_start (mtp_trt/decode.py")),
    ("step: graphs", ("step+run", )),
    ("step: Python", ("step (mtp_trt/decode.py", "fused_step", "verify (mtp_trt/decode.py", "accept (mtp_trt/decode",
                      "draft (mtp_trt/decode.py", "retire")),
    ("engine: events", ("_events (mtp_trt/serve.py", "_flush (mtp_trt/serve.py", "_count_drafts (mtp_trt/serve")),
    ("HTTP + event loop", ("uvicorn", "starlette", "fastapi", "asyncio", "h11", "serve_http")),
]
GRAPH = ("run_with_iobinding", "onnxruntime_inference_collection")


def categorize(stack: str) -> str:
    frames = stack.split(";")
    in_graph = any(g in f for f in frames for g in GRAPH)
    for name, keys in CATEGORIES:
        for key in keys:
            if key.endswith("+run"):
                if in_graph and any(key[:-4] in f for f in frames):
                    return name
            elif any(key in f for f in frames):
                return name
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--serve-args", default="", help="extra `mtp-trt serve` arguments, e.g. \"--nextn 0\"")
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--show-other", type=int, default=0, help="list this many stack tails of category --detail")
    ap.add_argument("--detail", default="other", help="the category --show-other lists")
    a = ap.parse_args()
    ckpt = demo_model()
    for clients in a.clients:
        s = Server(f"serve {a.serve_args}", [sys.executable, "-m", "mtp_trt.cli", "serve", "--threads",
                                             str(a.threads), "--max-batch", str(max(clients, 1)),
                                             *shlex.split(a.serve_args)], ckpt.name)
        try:
            s.wait_ready()
            stream_one(s.port, s.model, PROMPTS[0], 8, False)
            out = Path(tempfile.mkdtemp()) / "stacks.txt"
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(s.proc.pid), "--format", "raw", "--rate", "200",
                                    "--duration", str(int(a.seconds)), "--output", str(out), "--threads"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            stop, done = time.monotonic() + a.seconds, [0]

            def client(i: int) -> None:
                while time.monotonic() < stop:
                    stream_one(s.port, s.model, PROMPTS[i % len(PROMPTS)], a.tokens, False)
                    done[0] += 1

            threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            spy.wait(timeout=a.seconds + 60)
        finally:
            s.stop()
        shares, other = collections.Counter(), collections.Counter()
        for line in out.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            shares[categorize(stack)] += int(count)
            if categorize(stack) == a.detail:
                other[";".join(stack.split(";")[-2:])] += int(count)
        total = sum(shares.values()) or 1
        print(f"{clients} clients, serve {a.serve_args or '(defaults)'}: {done[0]} requests, {total} busy samples")
        for name, n in shares.most_common():
            print(f"  {name:<28} {100 * n / total:5.1f}%")
        for stack, n in other.most_common(a.show_other):
            print(f"    other: {100 * n / total:4.1f}% {stack[-150:]}")


if __name__ == "__main__":
    main()
