"""`mtp-trt serve` beside llama.cpp's server (llama-cpp-python's `python -m llama_cpp.server`) on the demo
checkpoint: N concurrent streaming clients of the bench prompts (mtp_trt/bench.py), greedy, 128 tokens each.
Not run in CI.

  python -m venv LLAMA_VENV && LLAMA_VENV/bin/pip install "llama-cpp-python[server]==0.3.36"
  python benchmarks/serve.py --llama-python LLAMA_VENV/bin/python [--clients 1 16] [--nextn 0 1 2 3 auto]
      [--tokens 128] [--rounds 3] [--threads 2] [--json FILE]
  python benchmarks/serve.py --no-llama --clients 1 4 16 32 --nextn 0 1 2 3 auto --threads 1   # mtp-trt only
  python benchmarks/serve.py --stress [--requests 200] [--clients 32]

Every server runs at once (started one after another), each in its own process (mtp-trt at each --nextn, `auto`
being --speculation auto, with --max-batch the most clients;
llama.cpp with its f32 GGUF of the checkpoint, made as benchmarks/beside_llama_cpp.py makes it, `--interrupt_requests
False` so that a new request waits instead of cutting the running one off); rounds visit them in turn (a shared
machine drifts alike for all).  With 1 client the client asks the 8 prompts one after another; with N > 1,
N clients each ask one prompt (prompt i mod 8), all at once.  Per configuration, medians over rounds of:
aggregate tokens/s (completion tokens of all requests / the wall time from the first request sent to the last
finished), time to first token (TTFT: request sent -> first streamed text), inter-token latency (ITL: the gaps
between streamed chunks; with MTP a chunk may carry several tokens) and time per output token (TPOT: (end -
first text) / (tokens - 1)) at p50/p90/p99 over all requests of the round.

--stress: nothing lost.  One mtp-trt server (--max-batch 16); --requests requests from --clients concurrent
clients, a mix of good ones (greedy, streamed or not, 64 tokens), streams closed after a few chunks, and
malformed ones (bad JSON, wrong types, max_tokens 0, unknown model): every good request must get the text the
same prompt gets alone, every bad one its 400/404 error object; the server's resident memory is read before
and after each of --passes passes (idle each time).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_api import ensure_gguf  # noqa: E402

from mtp_trt.bench import PROMPTS  # noqa: E402
from mtp_trt.runner import demo_model  # noqa: E402


STALL = 60  # seconds without text from a server: it hangs (the round fails, it runs no further rounds)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process and how to reach it."""

    def __init__(self, name: str, cmd: list[str], model: str, env: dict | None = None):
        self.name, self.model, self.port = name, model, free_port()
        self.proc = subprocess.Popen([*cmd, "--port", str(self.port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name}: the server exited: {self.proc.stderr.read()[-2000:]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/v1/models")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                time.sleep(0.5)
        raise SystemExit(f"{self.name}: not ready after {timeout} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def stream_one(port: int, model: str, prompt: str, tokens: int, usage: bool) -> dict:
    """One streamed greedy completion -> its timings (perf_counter seconds) and completion tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=STALL)
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise SystemExit(f"port {port}: HTTP {r.status}: {r.read()[:300]!r}")
    chunks, text, count = [], "", None
    while line := r.readline():
        if time.perf_counter() - (chunks[-1] if chunks else sent) > STALL:  # keep-alive comments only: stalled
            raise TimeoutError(f"no text for {STALL} s")
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            count = event["usage"]["completion_tokens"]
        for choice in event.get("choices") or []:
            if choice.get("text"):
                chunks.append(time.perf_counter())
                text += choice["text"]
    conn.close()
    return {"sent": sent, "chunks": chunks, "end": time.perf_counter(), "text": text, "tokens": count}


def run_clients(server: Server, clients: int, tokens: int, usage: bool, count_tokens) -> dict:
    """One round: `clients` concurrent clients (see the module docstring) -> aggregate and latency figures."""
    results: list[dict] = []
    lock = threading.Lock()

    errors: list[str] = []

    def client(prompts: list[str]) -> None:
        for p in prompts:
            try:
                out = stream_one(server.port, server.model, p, tokens, usage)
            except OSError as e:  # a timeout: the server stalled
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                return
            with lock:
                results.append(out)

    jobs = [PROMPTS] if clients == 1 else [[PROMPTS[i % len(PROMPTS)]] for i in range(clients)]
    threads = [threading.Thread(target=client, args=(j,)) for j in jobs]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        return {"failed": f"{len(errors)} of {len(jobs) if clients > 1 else len(PROMPTS)} requests: {errors[0]}"}
    for r in results:
        if r["tokens"] is None:  # a server without stream usage: count the text's tokens
            r["tokens"] = count_tokens(r["text"])
    ttft = [r["chunks"][0] - r["sent"] for r in results if r["chunks"]]
    itl = [b - a for r in results for a, b in zip(r["chunks"], r["chunks"][1:])]
    tpot = [(r["end"] - r["chunks"][0]) / (r["tokens"] - 1) for r in results if r["chunks"] and r["tokens"] > 1]
    total = sum(r["tokens"] for r in results)
    return {"tokens_per_second": total / wall, "tokens": total, "seconds": wall, "ttft": pct(ttft), "itl": pct(itl),
            "tpot": pct(tpot), "texts": sorted(r["text"] for r in results)}


def pct(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50": q[49], "p90": q[89], "p99": q[98]}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def call(port: int, body: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    r = conn.getresponse()
    out = (r.status, json.loads(r.read()))
    conn.close()
    return out


def stress(a) -> None:
    """See --stress in the module docstring."""
    s = Server("mtp-trt", [sys.executable, "-m", "mtp_trt.cli", "serve", "--threads", str(a.threads),
                           "--max-batch", "16", "--max-queue", "256"], demo_model().name)
    try:
        s.wait_ready()
        want = {p: call(s.port, json.dumps({"model": s.model, "prompt": p, "max_tokens": 64, "temperature": 0}))[1]
                ["choices"][0]["text"] for p in PROMPTS}
        idle = rss_mb(s.proc.pid)
        bad = ['{"model": "%s", "prompt": ' % s.model, json.dumps({"model": s.model, "prompt": "a", "max_tokens": "9"}),
               json.dumps({"model": s.model, "prompt": "a", "max_tokens": 0}), json.dumps({"model": "x", "prompt": "a"})]
        failures, counts, lock = [], {"good": 0, "bad": 0, "cancelled": 0}, threading.Lock()

        def one(i: int) -> None:
            p = PROMPTS[i % len(PROMPTS)]
            kind = "bad" if i % 8 == 3 else "cancelled" if i % 8 == 5 else "good"
            if kind == "bad":
                status, body = call(s.port, bad[i % len(bad)])
                ok = status in (400, 404) and set(body) == {"error"} and body["error"]["message"]
            elif kind == "cancelled":
                conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=600)
                conn.request("POST", "/v1/completions", json.dumps({"model": s.model, "prompt": p, "max_tokens": 2000,
                                                                    "temperature": 0, "stream": True}),
                             {"content-type": "application/json"})
                r = conn.getresponse()
                for _ in range(4):
                    r.readline()
                conn.close()  # the client leaves mid-stream
                ok = True
            elif i % 2:
                ok = "".join(stream_one(s.port, s.model, p, 64, False)["text"]) == want[p]
            else:
                status, body = call(s.port, json.dumps({"model": s.model, "prompt": p, "max_tokens": 64,
                                                        "temperature": 0}))
                ok = status == 200 and body["choices"][0]["text"] == want[p]
            with lock:
                counts[kind] += 1
                if not ok:
                    failures.append((i, kind))

        after = []
        for _ in range(a.passes):  # memory that grows pass after pass would be a leak
            t0 = time.perf_counter()
            work = iter(range(a.requests))
            lock_work = threading.Lock()

            def client() -> None:
                while True:
                    with lock_work:
                        i = next(work, None)
                    if i is None:
                        return
                    one(i)

            threads = [threading.Thread(target=client) for _ in range(max(a.clients))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            seconds = time.perf_counter() - t0
            deadline = time.monotonic() + 60  # the cancelled ones leave at the next step
            metrics = ""
            while time.monotonic() < deadline:
                conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
                conn.request("GET", "/metrics")
                metrics = conn.getresponse().read().decode()
                conn.close()
                if 'vllm:num_requests_running{model_name="%s"} 0.0' % s.model in metrics:
                    break
                time.sleep(0.2)
            after.append(rss_mb(s.proc.pid))
    finally:
        s.stop()
    cancelled = [line for line in metrics.splitlines() if line.startswith("vllm:request_success_total") and
                 "cancelled" in line]
    print(f"{a.passes} x {a.requests} requests from {max(a.clients)} clients (the last pass {seconds:.1f} s): "
          f"{counts}; failures: {failures or 'none'}; {cancelled[0] if cancelled else 'no cancellation counted'}; "
          f"resident memory idle {idle:.0f} MB before, then after each pass: "
          f"{', '.join(f'{m:.0f}' for m in after)} MB")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-python", help="Python of a venv with llama-cpp-python[server]")
    ap.add_argument("--stress", action="store_true", help="the nothing-lost run instead (see the docstring)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--passes", type=int, default=4, help="--stress: passes of --requests requests")
    ap.add_argument("--sdist", type=Path, help="llama-cpp-python's sdist (only if the demo's GGUF is not cached)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--nextn", nargs="+", default=["0", "1", "2", "3", "auto"],
                    help="fixed nextn values and/or `auto` (--speculation auto)")
    ap.add_argument("--no-llama", action="store_true", help="mtp-trt's servers only (no llama.cpp)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=Path("serve-bench.json"))
    a = ap.parse_args()
    if a.stress:
        return stress(a)
    if not a.llama_python and not a.no_llama:
        ap.error("--llama-python is required (or --no-llama, or --stress)")
    for k in a.nextn:
        if k != "auto" and not k.isdigit():
            ap.error(f"--nextn: {k!r} is neither a number nor auto")

    ckpt = demo_model()
    most = max(a.clients)
    servers = []
    for k in a.nextn:  # one after another: a server times its steps at start-up (--speculation auto), alone
        servers.append(Server(f"mtp-trt nextn {k}", [sys.executable, "-m", "mtp_trt.cli", "serve",
                                                     *(["--speculation", "auto"] if k == "auto" else ["--nextn", k]),
                                                     "--threads", str(a.threads), "--max-batch", str(most),
                                                     "--max-queue", str(most)], ckpt.name))
        servers[-1].wait_ready()
    if not a.no_llama:
        gguf = ensure_gguf("demo", ckpt, "f32", a.sdist, a.llama_python, a.threads)
        servers.append(Server("llama.cpp", [a.llama_python, "-m", "llama_cpp.server", "--model", str(gguf),
                                            "--model_alias", "demo", "--n_threads", str(a.threads), "--n_ctx", "2048",
                                            "--interrupt_requests", "False"], "demo",
                              env={"OMP_WAIT_POLICY": "PASSIVE"}))
    from mtp_trt.tokenizer import load_tokenizer

    tok = load_tokenizer(ckpt / "tokenizer.json")

    def count_tokens(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    try:
        for s in servers:
            s.wait_ready()
            stream_one(s.port, s.model, PROMPTS[0], 8, False)  # warm-up
        rounds = {(s.name, c): [] for s in servers for c in a.clients}
        failed: dict[str, str] = {}
        for r in range(a.rounds):
            for c in a.clients:
                for s in servers:
                    if s.name in failed:
                        continue
                    out = run_clients(s, c, a.tokens, s.name != "llama.cpp", count_tokens)
                    if "failed" in out:
                        failed[s.name] = f"round {r + 1}, {c} clients: {out['failed']}"
                        print(f"round {r + 1} {s.name:<16} {c:>2} clients: FAILED {out['failed']}", flush=True)
                        continue
                    rounds[(s.name, c)].append(out)
                    print(f"round {r + 1} {s.name:<16} {c:>2} clients: {out['tokens_per_second']:7.1f} tokens/s, "
                          f"TTFT p50 {out['ttft']['p50'] * 1e3:6.0f} ms", flush=True)
    finally:
        for s in servers:
            s.stop()
    report = []
    for (name, c), outs in rounds.items():
        if not outs:
            continue
        med = lambda f: statistics.median(f(o) for o in outs)  # noqa: E731
        report.append({"server": name, "clients": c, "rounds": len(outs), "tokens_per_second": med(lambda o: o["tokens_per_second"]),
                       **{f"{m}_{p}_ms": med(lambda o: o[m][p] * 1e3) for m in ("ttft", "itl", "tpot")
                          for p in ("p50", "p90", "p99")},
                       "same_texts_every_round": all(o["texts"] == outs[0]["texts"] for o in outs)})
    mtp = [x for x in report if x["server"].startswith("mtp-trt")]
    greedy_equal = {c: len({tuple(o["texts"]) for (n, cc), outs in rounds.items() if cc == c and n.startswith("mtp")
                            for o in outs}) == 1 for c in a.clients}
    print(f"\n{'server':<16} {'clients':>7} {'tokens/s':>9}  {'TTFT p50/p90/p99 ms':>22}  {'ITL p50/p90/p99 ms':>20}"
          f"  {'TPOT p50/p90/p99 ms':>20}")
    for x in report:
        f = lambda m: "/".join(f"{x[f'{m}_{p}_ms']:.0f}" for p in ("p50", "p90", "p99"))  # noqa: E731
        print(f"{x['server']:<16} {x['clients']:>7} {x['tokens_per_second']:9.1f}  {f('ttft'):>22}  {f('itl'):>20}"
              f"  {f('tpot'):>20}")
    for c in a.clients:
        best = max((x for x in mtp if x["clients"] == c), key=lambda x: x["tokens_per_second"])
        llama = next((x for x in report if x["server"] == "llama.cpp" and x["clients"] == c), None)
        ratio = f"{best['tokens_per_second'] / llama['tokens_per_second']:.2f}x llama.cpp's server" if llama else \
            "(no llama.cpp figure)"
        print(f"{c} clients: best {best['server']} {ratio}; mtp-trt texts equal across nextn: {greedy_equal[c]}")
    for c in a.clients[1:]:
        for x in mtp:
            if x["clients"] == c:
                one = next(y for y in mtp if y["server"] == x["server"] and y["clients"] == a.clients[0])
                print(f"{x['server']}: {c} clients {x['tokens_per_second'] / one['tokens_per_second']:.2f}x "
                      f"{a.clients[0]} client's tokens/s")
    zero = {x["clients"]: x for x in mtp if x["server"] == "mtp-trt nextn 0"}
    for x in mtp:
        if x["server"] != "mtp-trt nextn 0" and x["clients"] in zero:
            ratio = x['tokens_per_second'] / zero[x['clients']]['tokens_per_second']
            print(f"{x['server']}: {x['clients']} clients {ratio:.2f}x nextn 0's tokens/s")
    for name, why in failed.items():
        print(f"{name}: stalled ({why}); its figures are of the rounds before")
    a.json.write_text(json.dumps({"tokens": a.tokens, "rounds": a.rounds, "threads": a.threads, "report": report,
                                  "mtp_texts_equal_across_nextn": greedy_equal, "failed": failed}, indent=2))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
