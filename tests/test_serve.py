"""Continuous batching (mtp_trt/decode.py: admit, prefill_chunk, step) and `mtp-trt serve` (mtp_trt/serve.py,
mtp_trt/serve_http.py).

The decode core: a greedy sequence's tokens are the same whatever joins (prefilled in chunks) or leaves
(finished or cancelled) beside it, and equal a decode of its prompt alone (`Runner.run`, `generate`); a seeded
sampling sequence draws the same tokens alone or in a batch.  The server, on the demo checkpoint's export, with
the real `openai` client: completions and chat, streamed and not, several clients at once giving `mtp-trt run`'s
text; a stream closed mid-way cancels its request and leaves the others intact; bad requests get OpenAI's error
objects; a full queue 429; /metrics parses as Prometheus text with vLLM's counters; SIGTERM lets a running
request finish.  (The same schedules on the other MTP mode: tests/test_decode.py; on the TensorRT runtime:
tests/test_trt_runtime.py.)"""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from typer.testing import CliRunner

from mtp_trt.cli import app
from mtp_trt.decode import Sequence, generate, sequence_rng
from mtp_trt.runner import Detokenizer, detokenize, open_runner
from mtp_trt.sampling import SamplingParams
from runtime_models import drive

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from mtp_trt.serve import Engine, cut_at_stop, held_back  # noqa: E402
from mtp_trt.serve_http import serve  # noqa: E402

PROMPTS = ["The quick brown fox", "Once upon a time", "def main():", "In the beginning", "Hello, world"]
NEW = 40
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


# ------------------------------------------------------------------------------------------- the decode core
@pytest.fixture(scope="module")
def demo():
    return open_runner(None)


def test_greedy_tokens_do_not_depend_on_what_joins_or_leaves(demo):
    """Five prompts in three slots: joins in chunks of 3 tokens while others decode, one cancelled mid-way, a
    sampling request beside the greedy ones (their steps then run unfused): every greedy sequence gets exactly
    `Runner.run`'s tokens for its prompt alone, and the sampling one its own tokens alone with the same seed."""
    opts = demo.options(None, max_new_tokens=NEW)
    want = [demo.run([p], opts).results[0].tokens for p in PROMPTS]
    sampled = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)
    alone = demo.run([PROMPTS[4]], demo.options(None, max_new_tokens=NEW, sampling=sampled), seed=11).results[0]
    ids = [demo.encode(p) for p in PROMPTS]
    seqs = [Sequence(ids[i], max_new_tokens=NEW) for i in range(4)]
    seqs.append(Sequence(ids[4], sampling=sampled, max_new_tokens=NEW, rng=sequence_rng(11, 0)))
    schedule = {0: ("admit", [0, 1]), 2: ("admit", [2]), 4: ("cancel", [1]), 5: ("admit", [3, 4])}
    drive(demo.backend, opts, seqs, schedule, capacity=3, chunk=3)
    for i in (0, 2, 3):
        assert seqs[i].generated == want[i], PROMPTS[i]
        assert seqs[i].finish_reason == "length"
    assert seqs[1].finish_reason == "cancelled" and 0 < len(seqs[1].generated) < NEW
    assert seqs[4].generated == alone.tokens and alone.tokens != want[4]


def test_stop_strings_are_held_back_until_decided():
    assert cut_at_stop("abc STOP def", ("STOP", "c S")) == ("ab", True)
    assert cut_at_stop("abc", ("x",)) == ("abc", False)
    assert held_back("hello ST", ("STOP",)) == 2 and held_back("hello", ("STOP",)) == 0
    assert held_back("ab\ufffd", ()) == 1


TRICKY = "naïve café — 日本語のテキスト 🎉🚀 x\n\t  two  spaces, then ‘quotes’ and ≥ ≤ ∑ and ﬁn."


@pytest.mark.parametrize("chunks", [[1], [2, 1, 3], [5, 1, 1, 4]])
def test_incremental_detokenization_is_the_whole_decode(demo, chunks):
    """The text decoded a few tokens at a time (as steps accept them) is the text of all the tokens decoded at once,
    after every step: characters split across tokens, spaces, a final EOS."""
    tokens = demo.tokenizer.encode(TRICKY).ids + [demo.manifest.eos_ids[0]]
    assert any(demo.decode(tokens[:n]).endswith("\ufffd") for n in range(len(tokens))), "no split character"
    d, n, i = Detokenizer(), 0, 0
    while n < len(tokens):
        n = min(len(tokens), n + chunks[i % len(chunks)])
        i += 1
        assert demo.decode(tokens[:n], d) == demo.decode(tokens[:n]), n
    assert demo.decode(tokens, d) == TRICKY


def test_incremental_detokenization_with_a_decoder_that_strips_or_rewrites():
    pieces = {1: "\u2581a", 2: "\u2581b", 3: "c", 4: " ."}

    def strip_first(ids):  # sentencepiece's Metaspace: the leading space of the text is dropped
        return "".join(pieces[t] for t in ids).replace("\u2581", " ").removeprefix(" ")

    def cleanup(ids):  # a later token changes the text before it (" ." -> ".")
        return strip_first(ids).replace(" .", ".")

    for decode in (strip_first, cleanup):
        d, ids = Detokenizer(), [1, 2, 3, 4, 1, 4, 3]
        for n in range(1, len(ids) + 1):
            assert detokenize(decode, d, ids[:n]) == decode(ids[:n]), (decode.__name__, n)


# ------------------------------------------------------------------------------------------- the server
class Reply:
    """An HTTP answer: status and body (the standard library's client, so that nothing but the server and the
    openai client is under test)."""

    def __init__(self, status: int, text: str):
        self.status_code, self.text = status, text

    def json(self):
        return json.loads(self.text)


def call(url: str, method: str, path: str, body=None, headers=None) -> Reply:
    host, port = url[7:].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    data = body if isinstance(body, (str, bytes, type(None))) else json.dumps(body)
    conn.request(method, path, data, {"content-type": "application/json", **(headers or {})})
    r = conn.getresponse()
    reply = Reply(r.status, r.read().decode())
    conn.close()
    return reply


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A server in a background thread."""

    def __init__(self, engine: Engine, name: str, api_key: str | None = None, max_request_bytes: int | None = None):
        self.port, ready = free_port(), threading.Event()
        self.server, self.engine = None, engine

        def on_ready(server):
            self.server = server
            ready.set()

        self.thread = threading.Thread(target=serve, args=(engine, name, "127.0.0.1", self.port, api_key, 5.0),
                                       kwargs={"log_level": "warning", "ready": on_ready,
                                               **({"max_request_bytes": max_request_bytes} if max_request_bytes
                                                  else {})}, daemon=True)
        self.thread.start()
        assert ready.wait(60), "the server did not start"
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none", max_retries=0)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory, demo):
    """The demo export, copied with a chat template, served with 4 slots."""
    root = tmp_path_factory.mktemp("served") / "demo-chat"
    shutil.copytree(demo.manifest.root, root)
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "<s>"}))
    runner = open_runner(root)
    s = Running(Engine(runner, runner.options(None), max_batch=4, max_queue=16, chunk=8), "demo-chat")
    yield s
    s.close()


def metrics(url: str) -> dict:
    """Every sample of /metrics: (name, sorted labels without model_name) -> value."""
    return metrics_with(url, None)


def metrics_with(url: str, headers: dict | None) -> dict:
    text = call(url, "GET", "/metrics", headers=headers).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out[(sample.name, labels)] = sample.value
    return out


def test_concurrent_clients_get_mtp_trt_runs_text(server):
    """Six clients at once (four slots: two wait in the queue), greedy, streamed and not: each text equals
    `mtp-trt run`'s for its prompt."""
    r = CliRunner().invoke(app, ["run", *[x for p in PROMPTS for x in ("-p", p)], "--max-new-tokens", str(NEW),
                                 "--json"])
    assert r.exit_code == 0, r.output
    want = [x["text"] for x in json.loads(r.stdout[r.stdout.index("{"):])["results"]]
    jobs = [(p, i % 2 == 0) for i, p in enumerate(PROMPTS + PROMPTS[:1])]

    def ask(job):
        prompt, streamed = job
        kw = {"model": "demo-chat", "prompt": prompt, "max_tokens": NEW, "temperature": 0}
        if not streamed:
            out = server.client.completions.create(**kw)
            return out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens
        text, reason, usage = "", None, None
        for chunk in server.client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            usage = chunk.usage or usage
        return text, reason, usage.completion_tokens

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(ask, jobs))
    assert [g[0] for g in got] == want + want[:1]
    assert all(g[1] == "length" and g[2] == NEW for g in got)


def test_chat_streamed_and_not(server, demo):
    """The chat template renders the messages; the reply is the greedy continuation of that text."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
    prompt = "<s><|system|>Be brief.\n<|user|>Tell me a story\n<|assistant|>"
    ids = demo.tokenizer.encode(prompt, add_special_tokens=False).ids
    seqs, _ = generate(demo.backend, [ids], demo.options(None, max_new_tokens=24))
    want = demo.decode(seqs[0].generated)
    out = server.client.chat.completions.create(model="demo-chat", messages=messages, max_tokens=24, temperature=0)
    assert out.choices[0].message.content == want and out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 24
    parts = list(server.client.chat.completions.create(model="demo-chat", messages=messages, max_tokens=24,
                                                       temperature=0, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == want
    assert parts[-1].choices[0].finish_reason == "length"


def test_stop_seed_and_mtp_figures(server, demo):
    """A stop string ends the text before it (finish_reason stop), streamed or not; a seed reproduces a sampled
    completion; the opt-in MTP figures count the request's steps."""
    full = server.client.completions.create(model="demo-chat", prompt=PROMPTS[0], max_tokens=NEW, temperature=0)
    text = full.choices[0].text
    stop = text[10:13]
    cut = text[:text.index(stop)]
    for streamed in (False, True):
        kw = dict(model="demo-chat", prompt=PROMPTS[0], max_tokens=NEW, temperature=0, stop=[stop, "\x01"])
        if streamed:
            chunks = list(server.client.completions.create(**kw, stream=True))
            got, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            out = server.client.completions.create(**kw)
            got, reason = out.choices[0].text, out.choices[0].finish_reason
        assert (got, reason) == (cut, "stop")
    kw = dict(model="demo-chat", prompt=PROMPTS[1], max_tokens=NEW, temperature=1.0, top_p=0.9, seed=3)
    a, b = (server.client.completions.create(**kw).choices[0].text for _ in range(2))
    c = server.client.completions.create(**{**kw, "seed": 4}).choices[0].text
    assert a == b != c
    alone = demo.run([PROMPTS[1]], demo.options(None, max_new_tokens=NEW, sampling=SamplingParams(1.0, 0, 0.9)), seed=3)
    assert alone.results[0].text == a  # `mtp-trt run --seed 3` draws the same
    r = call(server.url, "POST", "/v1/completions", {"model": "demo-chat", "prompt": PROMPTS[2], "max_tokens": NEW,
                                                     "temperature": 0, "mtp_stats": True}).json()
    steps, spec = r["mtp"]["steps"], r["usage"]["speculative_decoding"]  # (K chosen per step: K = 0 steps count too)
    assert 0 < steps <= NEW - 1 and r["mtp"]["mean_acceptance_length"] == pytest.approx((NEW - 1) / steps, abs=1e-4)
    assert NEW - 1 - steps <= spec["num_accepted_draft_tokens"] <= NEW - 1 - steps + 3  # the last step may be cut


def test_cancelled_stream_leaves_the_others_intact(server):
    """A client closing its stream mid-way cancels its request (its slot freed, counted as cancelled); a request
    decoding beside it still gets its full greedy text."""
    want = server.client.completions.create(model="demo-chat", prompt=PROMPTS[3], max_tokens=NEW * 3,
                                            temperature=0).choices[0].text
    before = metrics(server.url)
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(lambda: server.client.completions.create(model="demo-chat", prompt=PROMPTS[3],
                                                                     max_tokens=NEW * 3, temperature=0))
        stream = server.client.completions.create(model="demo-chat", prompt=PROMPTS[0], max_tokens=2000,
                                                  temperature=0, stream=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        assert other.result().choices[0].text == want
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = metrics(server.url)
        if m[("vllm:num_requests_running", ())] == 0:
            break
        time.sleep(0.1)
    key = ("vllm:request_success_total", (("finished_reason", "cancelled"),))
    assert m[key] - before.get(key, 0) == 1
    assert m[("vllm:num_requests_running", ())] == 0
    assert m[("vllm:generation_tokens_total", ())] - before[("vllm:generation_tokens_total", ())] < 2000


def test_non_streamed_requests_whose_clients_leave_free_their_slots(server):
    """Four non-streamed requests fill the four slots; their clients leave: each request is cancelled (its slot
    freed, counted as cancelled), not decoded to its end."""
    before = metrics(server.url)
    body = json.dumps({"model": "demo-chat", "prompt": PROMPTS[2], "max_tokens": 4000, "temperature": 0}).encode()
    host, port = server.url[7:].split(":")
    socks = []
    for _ in range(4):
        sock = socket.create_connection((host, int(port)), timeout=30)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        socks.append(sock)
    deadline = time.monotonic() + 60
    while metrics(server.url)[("vllm:num_requests_running", ())] < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metrics(server.url)[("vllm:num_requests_running", ())] == 4
    for sock in socks:
        sock.close()
    deadline = time.monotonic() + 120
    while (m := metrics(server.url))[("vllm:num_requests_running", ())] and time.monotonic() < deadline:
        time.sleep(0.05)
    key = ("vllm:request_success_total", (("finished_reason", "cancelled"),))
    assert m[key] - before.get(key, 0) == 4
    assert m[("vllm:generation_tokens_total", ())] - before[("vllm:generation_tokens_total", ())] < 4 * 4000


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize("body, status, param", [
    ('{"model": "demo-chat", "prompt": "a", ', 400, None),  # malformed JSON
    ('{"model": "demo-chat", "prompt": "a", "max_tokens": "5"}', 400, "max_tokens"),  # wrong type
    ('{"model": "demo-chat", "prompt": 5}', 400, "prompt"),
    ('{"model": "demo-chat", "prompt": "a", "temperature": NaN}', 400, "temperature"),  # non-finite
    ('{"model": "demo-chat", "prompt": "a", "top_p": 1e999}', 400, "top_p"),
    ('{"model": "demo-chat", "prompt": "a", "max_tokens": 0}', 400, "max_tokens"),
    ('{"model": "demo-chat", "prompt": "a", "max_tokens": -3}', 400, "max_tokens"),
    ('{"model": "demo-chat", "prompt": "a", "n": 2}', 400, "n"),
    ('{"model": "demo-chat", "prompt": "a", "temperature": 3}', 400, "temperature"),
    ('{"model": "demo-chat", "prompt": ""}', 400, "prompt"),
    ('{"model": "other", "prompt": "a"}', 404, "model"),  # unknown model
    ('{"prompt": "a"}', 400, "model"),
    ('[1, 2]', 400, None),
    pytest.param("[" * 100_000, 400, None, id="100k-brackets"),  # nested beyond the JSON reader's 64 levels
    pytest.param('{"model": "demo-chat", "prompt": ' + '{"a": ' * 100 + "1" + "}" * 100 + "}", 400, None,
                 id="100-objects-deep"),
    pytest.param('{"model": "demo-chat", "prompt": "a", "max_tokens": ' + "9" * 5000 + "}", 400, None,
                 id="5000-digits"),
    pytest.param('{"model": "demo-chat", "prompt": "a", "seed": -' + "1" * 30 + "}", 400, None, id="30-digits"),
    pytest.param(b'{"model": "demo-chat", "prompt": "caf\xe9"}', 400, None, id="latin-1"),
    pytest.param(b'\xff\xfe{}', 400, None, id="utf-16-mark"),
    pytest.param("", 400, None, id="no-body"),
    pytest.param('{"model": "demo-chat", "prompt": "a"} trailing', 400, None, id="trailing-text"),
])
def test_bad_requests_get_openai_errors(server, body, status, param):
    r = call(server.url, "POST", "/v1/completions", body)
    assert r.status_code == status, r.text
    e = error_of(r)
    assert e["param"] == param and e["message"] and e["type"] == "invalid_request_error"


COMPLETION = {"model": "demo-chat", "prompt": "a", "max_tokens": 2}
CHAT = {"model": "demo-chat", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"max_token": 5}, "max_token"),  # a typo: OpenAI's "Unrecognized request argument"
    ("/v1/completions", {"repetition_penalty": 1.2}, "repetition_penalty"),
    ("/v1/chat/completions", {"max_token": 5}, "max_token"),
    ("/v1/chat/completions", {"echo": True}, "echo"),  # a completions field
    ("/v1/completions", {"logprobs": 2}, "logprobs"),
    ("/v1/completions", {"logprobs": 0}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"suffix": " return x"}, "suffix"),
    ("/v1/completions", {"logit_bias": {"50": 100}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"50": -100}}, "logit_bias"),
    ("/v1/completions", {"presence_penalty": 1.5}, "presence_penalty"),
    ("/v1/chat/completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("/v1/completions", {"frequency_penalty": 3}, "frequency_penalty"),  # out of OpenAI's range
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
     "tools"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "narrator", "content": "a"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "4", "tool_call_id": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a", "colour": "red"}]}, "messages.0.colour"),
])
def test_fields_that_would_change_the_output_are_honoured_or_refused(server, path, extra, param):
    """OpenAI's fields this server does not implement, unknown fields and unknown roles: 400 naming the field
    (never a 200 with the output of the request without them)."""
    r = call(server.url, "POST", path, {**(COMPLETION if "chat" not in path else CHAT), **extra})
    assert r.status_code == 400, r.text
    e = error_of(r)
    assert e["param"] == param and param.split(".")[-1] in e["message"], e
    if param == "max_token":
        assert e["message"] == "Unrecognized request argument supplied: max_token"


def test_neutral_values_of_unimplemented_fields_are_accepted(server):
    """What OpenAI's clients and frameworks send by default (penalties 0, no bias, no logprobs, text format, no
    tools, user, store, an assistant reply without content) is accepted and changes nothing."""
    want = call(server.url, "POST", "/v1/completions", {**COMPLETION, "temperature": 0}).json()["choices"][0]["text"]
    r = call(server.url, "POST", "/v1/completions", {**COMPLETION, "temperature": 0, "presence_penalty": 0,
                                                     "frequency_penalty": 0.0, "logit_bias": {}, "logprobs": None,
                                                     "best_of": 1, "echo": False, "suffix": None, "user": "u"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    r = call(server.url, "POST", "/v1/chat/completions", {**CHAT, "logprobs": False, "response_format": {"type": "text"},
                                                          "tools": [], "tool_choice": "none", "user": "u",
                                                          "parallel_tool_calls": True, "store": False,
                                                          "metadata": {"k": "v"}, "modalities": ["text"]})
    assert r.status_code == 200, r.text


def test_assistant_content_null_is_empty_not_none(server, demo):
    """An assistant message without content (as after a tool call) renders as empty text, not "None"."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "Again"}]
    prompt = "<s><|user|>Hi\n<|assistant|>\n<|user|>Again\n<|assistant|>"
    ids = demo.tokenizer.encode(prompt, add_special_tokens=False).ids
    r = call(server.url, "POST", "/v1/chat/completions", {**CHAT, "messages": messages})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids), r.text


def test_echo_puts_the_prompt_first(server):
    plain = server.client.completions.create(model="demo-chat", prompt=PROMPTS[1], max_tokens=12, temperature=0)
    out = server.client.completions.create(model="demo-chat", prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                           echo=True)
    assert out.choices[0].text == PROMPTS[1] + plain.choices[0].text
    assert out.usage.completion_tokens == plain.usage.completion_tokens
    chunks = list(server.client.completions.create(model="demo-chat", prompt=PROMPTS[1], max_tokens=12,
                                                   temperature=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text


def test_usage_counts_no_token_past_a_stop_string(server, demo):
    """A step may accept drafts beyond the token that completes a stop string: usage counts up to that token
    (the tokens whose text holds the stop string), streamed or not."""
    tokens = demo.run([PROMPTS[0]], demo.options(None, max_new_tokens=NEW)).results[0].tokens
    text = demo.decode(tokens)
    checked = 0
    for at in range(6, 30, 3):
        stop = text[at:at + 2]
        if not stop.strip() or text.index(stop) != at:
            continue
        want = next(n for n in range(1, len(tokens) + 1) if stop in demo.decode(tokens[:n]))
        kw = dict(model="demo-chat", prompt=PROMPTS[0], max_tokens=NEW, temperature=0, stop=[stop])
        out = server.client.completions.create(**kw)
        assert (out.choices[0].text, out.choices[0].finish_reason) == (text[:at], "stop")
        assert out.usage.completion_tokens == want, (stop, out.usage.completion_tokens, want)
        last = list(server.client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))[-1]
        assert last.usage.completion_tokens == want
        checked += 1
    assert checked >= 4


def test_every_error_status_is_an_openai_error_object(server, monkeypatch):
    """Not only the API's own refusals: an unknown path (404), a method a path does not take (405), a body beyond
    the size limit (413, before it is read) and a fault of the server (500) answer OpenAI's error object too."""
    for method, path, status, code in (("GET", "/nope", 404, "not_found"), ("GET", "/v1/completions", 405,
                                       "method_not_allowed"), ("POST", "/health", 405, "method_not_allowed"),
                                       ("DELETE", "/v1/models", 405, "method_not_allowed")):
        r = call(server.url, method, path, {"model": "demo-chat", "prompt": "a"})
        assert r.status_code == status and error_of(r)["code"] == code, (method, path, r.text)
    host, port = server.url[7:].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # Content-Length says 10 MB: refused first
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 10000000\r\n\r\n{\"model\": \"demo-chat\", \"prompt\": \"")
        head = b""
        while not head.endswith(b"}}") and (part := sock.recv(65536)):
            head += part
    head = head.decode()
    assert head.startswith("HTTP/1.1 413") and '"code":"request_too_large"' in head, head
    r = call(server.url, "POST", "/v1/completions", {"model": "demo-chat", "prompt": "a" * 300_000})
    assert r.status_code == 413 and "--max-request-bytes" in error_of(r)["message"]

    def fault(*args, **kwargs):
        raise RuntimeError("a fault of the engine")

    monkeypatch.setattr(server.engine, "submit", fault)
    r = call(server.url, "POST", "/v1/completions", {"model": "demo-chat", "prompt": "a"})
    e = error_of(r)
    assert r.status_code == 500 and e["type"] == "server_error" and "a fault of the engine" in e["message"]


def _health_delays(url: str, busy: threading.Event) -> list[float]:
    """Seconds each /health call took while `busy` is set (after it is first set)."""
    busy.wait(30)
    delays = []
    while busy.is_set():
        t0 = time.perf_counter()
        assert call(url, "GET", "/health").status_code == 200
        delays.append(time.perf_counter() - t0)
        time.sleep(0.05)
    return delays


def test_a_10_mb_prompt_does_not_hold_up_health(demo, server):
    """A 10 MB prompt: refused (413) before it is read by default; with a limit that admits it, read and parsed
    off the event loop -- /health answers within a second all along -- then refused as too long, from its
    characters alone (more than the cache's tokens can cover: not tokenized), within seconds."""
    prompt = "def f(x):\n    return x + 1\n" * 400_000  # 10.8 MB
    runner = open_runner(demo.manifest.root)
    big = Running(Engine(runner, runner.options(None), max_batch=2, max_queue=4, chunk=64), "demo",
                  max_request_bytes=64 << 20)
    try:
        for s, status, code in ((server, 413, "request_too_large"), (big, 400, "context_length_exceeded")):
            busy, answer = threading.Event(), {}

            def ask():
                busy.set()
                t0 = time.perf_counter()
                answer["reply"] = call(s.url, "POST", "/v1/completions", {"model": s.client.models.list().data[0].id,
                                                                           "prompt": prompt, "max_tokens": 4})
                answer["seconds"] = time.perf_counter() - t0
                busy.clear()

            with ThreadPoolExecutor(2) as pool:
                asked = pool.submit(ask)
                delays = pool.submit(_health_delays, s.url, busy).result(timeout=300)
                asked.result()
            assert answer["reply"].status_code == status and error_of(answer["reply"])["code"] == code
            assert delays and max(delays) < 1.0, (status, answer["seconds"], max(delays))
            assert answer["seconds"] < 5.0, answer["seconds"]  # (tokenizing it takes 10-25 s on 2 cores)
    finally:
        big.close()


def test_prompt_too_long_and_chat_errors(server, demo):
    long_prompt = "a" * 5000
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model="demo-chat", prompt=long_prompt, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded" and "at most" in e.value.body["message"]
    r = call(server.url, "POST", "/v1/chat/completions", {"model": "demo-chat", "messages": []})
    assert r.status_code == 400 and error_of(r)["param"] == "messages"
    r = call(server.url, "POST", "/v1/chat/completions", {"model": "demo-chat", "messages": [{"content": "x"}]})
    assert r.status_code == 400 and error_of(r)["param"] == "messages.0.role"
    with pytest.raises(openai.NotFoundError):
        server.client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    # the running batch is undisturbed: a good request still gets run's text
    assert server.client.completions.create(model="demo-chat", prompt=PROMPTS[0], max_tokens=NEW,
                                            temperature=0).choices[0].text == \
        demo.decode(demo.run([PROMPTS[0]], demo.options(None, max_new_tokens=NEW)).results[0].tokens)


def test_models_health_and_metrics(server):
    assert [m.id for m in server.client.models.list().data] == ["demo-chat"]
    assert call(server.url, "GET", "/health").json() == {"status": "ok"}
    before = metrics(server.url)
    r = call(server.url, "POST", "/v1/completions", {"model": "demo-chat", "prompt": PROMPTS[4], "max_tokens": 30,
                                                     "temperature": 0, "mtp_stats": True}).json()
    after = metrics(server.url)
    delta = {k: v - before.get(k, 0) for k, v in after.items()}
    k = 3  # the demo export's nextn
    steps = r["mtp"]["steps"]  # verify steps, with drafts (K chosen per step) or without
    spec = r["usage"]["speculative_decoding"]
    assert delta[("vllm:generation_tokens_total", ())] == r["usage"]["completion_tokens"] == 30
    assert delta[("vllm:prompt_tokens_total", ())] == r["usage"]["prompt_tokens"]
    assert delta[("vllm:spec_decode_num_drafts_total", ())] == spec["num_spec_steps"] <= steps
    assert delta[("vllm:spec_decode_num_draft_tokens_total", ())] == spec["num_draft_tokens"] <= steps * k
    accepted = delta[("vllm:spec_decode_num_accepted_tokens_total", ())]
    per_pos = [delta[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(j)),))] for j in range(k)]
    assert accepted == sum(per_pos) == spec["num_accepted_draft_tokens"]
    assert per_pos == spec["num_accepted_tokens_per_pos"]
    assert per_pos == sorted(per_pos, reverse=True)
    assert 29 - steps <= accepted <= 29 - steps + k  # 30 tokens = first + per step (accepted + 1), the last cut
    assert after[("vllm:num_requests_waiting", ())] == 0
    # the histograms: one K per batched step (this request ran alone: one per verify step), one accepted length per
    # verify step of a request; their sums are the draft tokens and the accepted ones
    assert delta[("mtp_trt:spec_decode_num_drafts_per_step_count", ())] == steps
    assert delta[("mtp_trt:spec_decode_num_drafts_per_step_sum", ())] == spec["num_draft_tokens"]
    assert delta[("mtp_trt:spec_decode_accepted_length_count", ())] == steps
    assert delta[("mtp_trt:spec_decode_accepted_length_sum", ())] == accepted
    assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"]
    costs = {key: v for key, v in after.items() if key[0] == "mtp_trt:step_cost_seconds"}
    assert {dict(labels)["k"] for _, labels in costs} == {str(j) for j in range(k + 1)}  # measured at start-up
    assert all(v > 0 for v in costs.values())


def test_usage_carries_each_requests_speculative_figures(server, demo):
    """Streamed (include_usage) and not, completions and chat: usage.speculative_decoding adds up (accepted drafts
    per position, the steps' histogram, tokens = the first + every verify step's accepted drafts + 1); the text is
    `mtp-trt run`'s at nextn 0."""
    want = demo.decode(demo.run([PROMPTS[2]], demo.options(0, max_new_tokens=NEW)).results[0].tokens)
    out = server.client.completions.create(model="demo-chat", prompt=PROMPTS[2], max_tokens=NEW, temperature=0,
                                           extra_body={"mtp_stats": True})
    assert out.choices[0].text == want
    chunks = list(server.client.completions.create(model="demo-chat", prompt=PROMPTS[2], max_tokens=NEW,
                                                   temperature=0, stream=True,
                                                   stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    chat = server.client.chat.completions.create(model="demo-chat", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=12, temperature=0)
    for usage in (out.usage, chunks[-1].usage, chat.usage):
        spec = usage.model_extra["speculative_decoding"]
        assert spec["num_spec_tokens"] == 3 and len(spec["acceptance_histogram"]) == 4
        assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"]
        assert sum(j * c for j, c in enumerate(spec["acceptance_histogram"])) == spec["num_accepted_draft_tokens"]
        assert sum(spec["num_accepted_tokens_per_pos"]) == spec["num_accepted_draft_tokens"] <= spec["num_draft_tokens"]
        if spec["num_spec_steps"]:
            assert spec["mean_acceptance_length"] == pytest.approx(
                1 + spec["num_accepted_draft_tokens"] / spec["num_spec_steps"], abs=1e-4)
    steps = out.model_extra["mtp"]["steps"]
    spec = out.usage.model_extra["speculative_decoding"]
    assert out.usage.completion_tokens - 1 - steps <= spec["num_accepted_draft_tokens"] <= \
        out.usage.completion_tokens - 1 - steps + 3


@pytest.fixture(scope="module")
def tight(demo):
    """The demo checkpoint served with one slot and one queue place, with an API key; no chat template."""
    runner = open_runner(demo.manifest.root)
    s = Running(Engine(runner, runner.options(1), max_batch=1, max_queue=1), "demo", api_key="sekret")
    yield s
    s.close()


def test_full_queue_api_key_and_no_chat_template(tight):
    """One running, one waiting: the third request gets 429 at once; once both streams are closed the server
    takes requests again.  A wrong key is 401; a checkpoint without a chat template answers chat with 400."""
    r = call(tight.url, "POST", "/v1/completions", {"model": "demo", "prompt": "a"})
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    kw = dict(model="demo", prompt=PROMPTS[0], max_tokens=3000, temperature=0)
    running = tight.client.completions.create(**kw, stream=True)
    next(iter(running))  # decoding
    waiting = tight.client.completions.create(**kw, stream=True)  # its headers come at once: it is queued
    deadline = time.monotonic() + 10
    while metrics(tight.url)[("vllm:num_requests_waiting", ())] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(openai.RateLimitError) as e:
        tight.client.completions.create(**kw)
    assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
    running.close()
    waiting.close()
    short = tight.client.completions.create(**{**kw, "max_tokens": 8})  # the slot and the queue place are free
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        tight.client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}])


def test_queued_requests_whose_clients_leave_are_counted(tight):
    """Two streams closed, one running and one still queued: both are counted as cancelled in /metrics."""
    headers = {"authorization": "Bearer sekret"}

    def cancelled():
        m = metrics_with(tight.url, headers)
        return m.get(("vllm:request_success_total", (("finished_reason", "cancelled"),)), 0), m

    before, _ = cancelled()
    kw = dict(model="demo", prompt=PROMPTS[0], max_tokens=3000, temperature=0)
    running = tight.client.completions.create(**kw, stream=True)
    next(iter(running))
    waiting = tight.client.completions.create(**kw, stream=True)
    deadline = time.monotonic() + 10
    while cancelled()[1][("vllm:num_requests_waiting", ())] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    waiting.close()
    running.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        count, m = cancelled()
        if m[("vllm:num_requests_running", ())] == 0 and m[("vllm:num_requests_waiting", ())] == 0 \
                and count - before == 2:
            break
        time.sleep(0.05)
    assert count - before == 2, (before, count)


def test_sigterm_finishes_the_running_request(demo, tmp_path):
    """`mtp-trt serve`: after SIGTERM the streaming request still completes (and ends with [DONE]), new
    and the process exits as on any SIGTERM, without a traceback."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mtp_trt.cli", "serve", str(demo.manifest.root), "--port", str(port),
                             "--shutdown-timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if call(url, "GET", "/health").status_code == 200:
                    break
            except OSError:
                time.sleep(0.2)
        body = {"model": demo.manifest.root.name, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0,
                "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        r = conn.getresponse()
        lines = []
        while line := r.readline():
            if line.strip():
                lines.append(line.decode().strip())
                if len(lines) == 3:  # one signal (a second one means: stop at once)
                    proc.send_signal(signal.SIGTERM)
        conn.close()
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 128 + signal.SIGTERM  # as every mtp-trt command ends on SIGTERM
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_options_and_a_busy_port_are_one_line(demo):
    r = CliRunner().invoke(app, ["serve", "--max-batch", "0"])
    assert r.exit_code == 2 and "--max-batch" in r.output
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = CliRunner().invoke(app, ["serve", str(demo.manifest.root), "--port", str(s.getsockname()[1])])
        assert r.exit_code == 2 and "cannot listen there" in r.output and "Traceback" not in r.output
        # an empty host is not "every interface" without a word (the busy port keeps a server from starting)
        r = CliRunner().invoke(app, ["serve", str(demo.manifest.root), "--host", "", "--port", str(s.getsockname()[1])])
        assert r.exit_code == 2 and "--host: empty" in r.output and "Traceback" not in r.output


def test_the_printed_url_is_the_one_listened_on(demo):
    """`--port 0` prints the port the system chose, `--host ::1` the address in brackets: the URL printed works."""
    proc = subprocess.Popen([sys.executable, "-m", "mtp_trt.cli", "serve", str(demo.manifest.root), "--host", "::1",
                             "--port", "0", "--max-batch", "1"], stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        for line in proc.stderr:
            if " on http" in line:
                break
        url = line.split(" on ")[-1].strip()
        assert url.startswith("http://[::1]:") and url.endswith("/v1") and not url.startswith("http://[::1]:0/"), line
        port = int(url[len("http://[::1]:"):-3])
        conn = http.client.HTTPConnection("::1", port, timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def _serve_process(root, *args, files: int | None = None) -> tuple[subprocess.Popen, int]:
    """`mtp-trt serve ROOT --port 0 ARGS` in a process (at most `files` open files), and the port it printed.  Ctrl-C
    reaches it as from a terminal, even where these tests run with SIGINT ignored (a shell's background job)."""
    def limit():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if files is not None:
            import resource
            resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))

    proc = subprocess.Popen([sys.executable, "-m", "mtp_trt.cli", "serve", str(root), "--port", "0", *map(str, args)],
                            stderr=subprocess.PIPE, text=True, preexec_fn=limit)
    for line in proc.stderr:
        if " on http://" in line:
            return proc, int(line.rsplit(":", 1)[1].split("/")[0])
    proc.wait(30)
    raise AssertionError(f"the server did not start (exit {proc.returncode})")


@pytest.mark.slow
def test_slow_and_idle_clients_are_cut_off(demo):
    """With 256 open files: 300 idle connections leave the server reachable (/health answers while they are open,
    well before --request-timeout would close them: a new connection closes the oldest idle one); a half-sent
    request head is closed with a 408 after --request-timeout, a half-sent body answered 408; the log has no
    traceback and no flood of "Too many open files"."""
    timeout = 15
    proc, port = _serve_process(demo.manifest.root, "--max-batch", "1", "--request-timeout", timeout, files=256)
    idle = []
    try:
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=60))
        health = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout / 2)  # (before the idle ones time out)
        health.request("GET", "/health")
        assert health.getresponse().status == 200
        health.close()
        url = f"http://127.0.0.1:{port}"
        head = socket.create_connection(("127.0.0.1", port), timeout=60)
        head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        body = socket.create_connection(("127.0.0.1", port), timeout=60)
        body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
        for sock in (head, body):
            answer = b""
            while part := sock.recv(65536):  # until the server closes the connection
                answer += part
            sock.close()
            assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer
        assert call(url, "GET", "/health").status_code == 200
    finally:
        for sock in idle:
            sock.close()
        proc.send_signal(signal.SIGTERM)
        err = proc.stderr.read()
        proc.wait(60)
    assert "Traceback" not in err and err.count("open files") <= 3 and len(err) < 20_000, err[-3000:]


def test_a_malformed_request_line_gets_an_openai_error(server):
    host, port = server.url[7:].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"NOT AN HTTP REQUEST\r\n\r\n")
        answer = b""
        while part := sock.recv(65536):
            answer += part
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


def _sse(response) -> list[str]:
    """The non-empty lines of a server-sent event stream, to its end."""
    lines = []
    try:
        while line := response.readline():
            if line.strip():
                lines.append(line.decode().strip())
    except http.client.IncompleteRead:  # cut mid-body
        lines.append("<cut>")
    return lines


def test_shutdown_timeout_ends_every_stream_with_an_event(demo):
    """SIGTERM with a request still decoding past --shutdown-timeout and two queued: the running stream and the
    queued stream each end with an error event and `data: [DONE]`, the queued non-streamed request gets a 503; a
    client that left mid-body before that left no traceback in the log."""
    proc, port = _serve_process(demo.manifest.root, "--max-batch", "1", "--shutdown-timeout", "1")
    url = f"http://127.0.0.1:{port}"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # leaves mid-body
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\": ")
        body = {"model": demo.manifest.root.name, "prompt": PROMPTS[0], "max_tokens": 4000, "temperature": 0}

        def open_stream():
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                         {"content-type": "application/json"})
            return conn.getresponse()

        running = open_stream()
        assert running.readline().startswith(b"data: {")  # decoding
        queued = open_stream()
        assert queued.status == 200
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(call, url, "POST", "/v1/completions", body)
            deadline = time.monotonic() + 30
            while metrics(url)[("vllm:num_requests_waiting", ())] < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert metrics(url)[("vllm:num_requests_waiting", ())] == 2
            proc.send_signal(signal.SIGTERM)
            for lines in (_sse(running), _sse(queued)):
                assert lines[-1] == "data: [DONE]", lines[-3:]
                last = json.loads(lines[-2][6:])
                assert last.get("error", {}).get("message") == "the server is shutting down" or \
                    last["choices"][0]["finish_reason"] is not None, lines[-3:]
            reply = whole.result(timeout=60)
        assert reply.status_code == 503 and error_of(reply)["type"] == "server_error"
        assert proc.wait(60) == 128 + signal.SIGTERM
        err = proc.stderr.read()
        assert "Traceback" not in err and "ClientDisconnect" not in err, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctrl_c_twice_stops_at_once_without_tracebacks(demo):
    """Ctrl-C once starts the graceful shutdown (the server stops listening); Ctrl-C again, with a stream running
    and a request queued, stops it at once: status 130, "error: interrupted", no traceback in the log."""
    proc, port = _serve_process(demo.manifest.root, "--max-batch", "1", "--shutdown-timeout", "60")
    try:
        body = {"model": demo.manifest.root.name, "prompt": PROMPTS[0], "max_tokens": 4000, "temperature": 0}
        running = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        running.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                        {"content-type": "application/json"})
        stream = running.getresponse()
        assert stream.readline().startswith(b"data: {")
        queued = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        queued.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        deadline = time.monotonic() + 30
        while metrics(f"http://127.0.0.1:{port}")[("vllm:num_requests_waiting", ())] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while True:  # until the server no longer listens: shutting down
            assert time.monotonic() < deadline
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                time.sleep(0.05)
            except OSError:
                break
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
        err = proc.stderr.read()
        assert "Traceback" not in err and err.strip().splitlines()[-1] == "error: interrupted", err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
