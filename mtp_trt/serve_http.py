"""`mtp-trt serve`: an OpenAI-compatible HTTP API (FastAPI on uvicorn) over the serving engine (mtp_trt/serve.py).

POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events with `stream: true`),
GET /v1/models, GET /health, GET /metrics (Prometheus text, with vLLM's metric names).  Every 4xx and 5xx
answer is OpenAI's error object: {"error": {"message", "type", "param", "code"}}.

A request body is limited in size (checked against Content-Length before it is read, and while it is read)
and read on the event loop; parsing it (mtp-trt's JSON reader, with its limits), checking its fields, rendering
the chat template and tokenizing the prompt happen in a worker thread, with the GIL released while tokenizers
works, so that a large prompt does not hold up other clients (or /health).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from mtp_trt.errors import MtpTrtError
from mtp_trt.fsutil import parse_json
from mtp_trt.sampling import SamplingParams
from mtp_trt.serve import Engine, QueueFull, ShuttingDown
from mtp_trt.tokenizer import BosPolicy, chat_renderer, encode

# The default limit of a request body: 64 KiB for the fields, and 32 bytes per cache row for the prompt (a token
# is 4 characters of English on average; 32 bytes leave room for JSON escapes and long tokens).
REQUEST_BYTES_BASE, REQUEST_BYTES_PER_ROW = 64 << 10, 32
PREPARE_THREADS = 2  # requests parsed and tokenized at once, off the event loop


UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "StreamOptions", "ContentPart"}
TEMPLATE_PLACES_SPECIALS = BosPolicy(False, None, "the chat template", False)  # a chat prompt: no BOS added


class ApiError(Exception):
    """An error answered with OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=headers)


def invalid_field(e: ValidationError) -> ApiError:
    """pydantic's first complaint about a request body as a 400 naming the field (OpenAI's `param`)."""
    first = e.errors()[0]
    # the field's path, without pydantic's union member tags (`prompt.str`: `prompt`)
    loc = [str(x) for x in first.get("loc", ()) if not (isinstance(x, str) and (x in UNION_TAGS or "[" in x))]
    param = ".".join(loc) or None
    value = first.get("input")
    shown = "" if isinstance(value, dict) or value is None else f" (got {json.dumps(value)[:80]})"
    return ApiError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}{shown}", param)


def default_request_bytes(rows: int) -> int:
    """The largest request body a server of `rows` cache rows per sequence reads by default."""
    return REQUEST_BYTES_BASE + REQUEST_BYTES_PER_ROW * rows


# ---------------------------------------------------------------------------------------- request bodies
class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class Body(BaseModel):
    """Fields of both endpoints.  Strict types (no "5" for 5) and no NaN or infinity; unknown fields are ignored,
    as OpenAI's API does for fields a server does not implement."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    mtp_stats: bool = False  # add this request's MTP figures ("mtp") to the response


class CompletionBody(Body):
    prompt: str | list[str]
    max_tokens: int | None = 16  # OpenAI's default for completions


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None


class ChatBody(Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None


# ---------------------------------------------------------------------------------------- the app
def create_app(engine: Engine, model_id: str, api_key: str | None = None, max_request_bytes: int | None = None
               ) -> FastAPI:
    """The API over a started engine, serving it as model `model_id`; request bodies of at most
    `max_request_bytes` (default: default_request_bytes)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    runner = engine.runner
    render_chat = chat_renderer(runner.manifest.root)
    app = FastAPI(title="mtp-trt", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    limit_bytes = max_request_bytes or default_request_bytes(engine.rows)
    workers = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="mtp-trt-request")

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):  # Starlette's own: an unknown path, a method not allowed
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", None, code,
                        kind).response(dict(e.headers or {}))

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):  # a fault of the server: logged by uvicorn, answered as 500
        return ApiError(500, f"internal error ({type(e).__name__}: {e})"[:500], None, None, "server_error").response()

    @app.middleware("http")
    async def check_key(request: HttpRequest, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return ApiError(401, "missing or incorrect API key (Authorization: Bearer KEY)", None,
                                "invalid_api_key").response()
        return await call_next(request)

    @app.get("/health")
    async def health():
        if not engine.admitting:
            raise ApiError(503, "the server is shutting down", kind="server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "mtp-trt"}]}

    registry = CollectorRegistry()
    registry.register(_Collector(engine, model_id, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily))

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    def sampling(body: Body) -> tuple[SamplingParams, int | None, tuple[str, ...]]:
        """The request's sampling, seed and stop strings, checked."""
        if body.model != model_id:
            raise ApiError(404, f"the model {body.model!r} does not exist (this server has {model_id!r})", "model",
                           "model_not_found")
        if body.n != 1:
            raise ApiError(400, f"n: only n = 1 is supported, got {body.n}", "n")
        if not 0 <= body.temperature <= 2:
            raise ApiError(400, f"temperature: must be in [0, 2], got {body.temperature}", "temperature")
        if not 0 < body.top_p <= 1:
            raise ApiError(400, f"top_p: must be in (0, 1], got {body.top_p}", "top_p")
        if body.top_k < -1:
            raise ApiError(400, f"top_k: must be >= 0 (or -1: off), got {body.top_k}", "top_k")
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stop) > 4 or not all(stop):
            raise ApiError(400, "stop: at most 4 non-empty strings", "stop")
        seed = body.seed % (1 << 64) if body.seed is not None else None
        return SamplingParams(body.temperature, max(body.top_k, 0), body.top_p), seed, tuple(stop)

    def limit(value: int | None, param: str, prompt: list[int], prompt_param: str) -> int:
        if value is not None and value < 1:
            raise ApiError(400, f"{param}: must be >= 1, got {value}", param)
        if len(prompt) > engine.max_prompt_tokens:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens, but this server fits at most "
                                f"{engine.max_prompt_tokens} (cache rows {engine.rows}, nextn {engine.opts.nextn})",
                           prompt_param, "context_length_exceeded")
        return value if value is not None else engine.rows

    async def read_body(request: HttpRequest) -> bytes:
        """The request's body, refused (413) beyond limit_bytes: by its Content-Length before a byte is read, or
        once that many bytes have come (a body sent in chunks)."""
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit_bytes):
            raise too_large(declared)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit_bytes:
                raise too_large(f"more than {limit_bytes}")
            chunks.append(chunk)
        return b"".join(chunks)

    def too_large(size: str) -> ApiError:
        return ApiError(413, f"the request body has {size} bytes, more than the {limit_bytes} this server reads "
                             f"(mtp-trt serve --max-request-bytes)", None, "request_too_large")

    def parse(data: bytes, schema: type[BaseModel]) -> BaseModel:
        """(worker thread) the body through mtp-trt's JSON reader (its limits: nesting, digits, UTF-8), then typed."""
        try:
            raw = parse_json(data, "the request body")
        except MtpTrtError as e:
            raise ApiError(400, str(e)) from None
        try:
            return schema.model_validate(raw)
        except ValidationError as e:
            raise invalid_field(e) from None

    def prepare_completion(data: bytes) -> tuple:
        """(worker thread) body, prompt ids, decoding, max tokens of a completion request, or an ApiError."""
        body = parse(data, CompletionBody)
        decoding = sampling(body)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            raise ApiError(400, f"prompt: one prompt per request is supported, got {len(prompts)}", "prompt")
        if not prompts[0]:
            raise ApiError(400, "prompt: empty", "prompt")
        ids = runner.encode(prompts[0])
        return body, ids, decoding, limit(body.max_tokens, "max_tokens", ids, "prompt")

    def prepare_chat(data: bytes) -> tuple:
        """(worker thread) body, prompt ids, decoding, max tokens of a chat request, or an ApiError."""
        body = parse(data, ChatBody)
        decoding = sampling(body)
        if render_chat is None:
            raise ApiError(400, f"the model {model_id!r} has no chat template (tokenizer_config.json "
                                f"chat_template); use /v1/completions", "messages")
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str) or m.content is None
                     else "".join(p.text for p in m.content)} for m in body.messages]
        try:
            text = render_chat(messages)
        except MtpTrtError as e:
            raise ApiError(400, str(e), "messages") from None
        ids = encode(runner.tokenizer, text, TEMPLATE_PLACES_SPECIALS)
        if not ids:
            raise ApiError(400, "messages: the chat template gives an empty prompt", "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        return body, ids, decoding, limit(max_tokens, param, ids, "messages")

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        data = await read_body(request)
        prepared = await asyncio.get_running_loop().run_in_executor(workers, prepare_completion, data)
        return await run(request, *prepared, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: HttpRequest):
        data = await read_body(request)
        prepared = await asyncio.get_running_loop().run_in_executor(workers, prepare_chat, data)
        return await run(request, *prepared, chat=True)

    async def run(request: HttpRequest, body: Body, ids: list[int], decoding: tuple, max_tokens: int, chat: bool):
        params, seed, stop = decoding
        try:
            r = engine.submit(ids, params, max_tokens, seed, stop, asyncio.get_running_loop())
        except QueueFull:
            raise ApiError(429, f"the server is busy ({engine.max_queue} requests waiting); retry later", None,
                           "queue_full", "rate_limit_error") from None
        except ShuttingDown:
            raise ApiError(503, "the server is shutting down", None, None, "server_error") from None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        shape = _Shape(rid, model_id, chat, int(time.time()))
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream(r, shape, usage, body.mtp_stats), media_type="text/event-stream")
        text, reason = [], None
        try:
            while reason is None:
                try:
                    event = await asyncio.wait_for(r.events.get(), 0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        engine.cancel(r)
                        return ApiError(499, "the client closed the connection", None, None,
                                        "invalid_request_error").response()
                    continue
                if event[0] == "text":
                    text.append(event[1])
                elif event[0] == "error":
                    raise ApiError(event[1], event[2], None, None, "server_error")
                else:
                    reason = event[1]
        except asyncio.CancelledError:
            engine.cancel(r)
            raise
        return shape.whole("".join(text), reason, _usage(r, engine.opts.nextn), _mtp(r) if body.mtp_stats else None)

    async def stream(r, shape: _Shape, usage: bool, mtp: bool):
        try:
            if shape.chat:
                yield shape.event(shape.chunk({"role": "assistant", "content": ""}, None), usage)
            while True:
                event = await r.events.get()
                if event[0] == "text":
                    yield shape.event(shape.chunk(event[1], None), usage)
                elif event[0] == "error":
                    error = {"message": event[2], "type": "server_error", "param": None, "code": None}
                    yield f"data: {json.dumps({'error': error})}\n\n"
                    break
                else:
                    last = shape.chunk("" if not shape.chat else {}, event[1])
                    if mtp:
                        last["mtp"] = _mtp(r)
                    yield shape.event(last, usage)
                    if usage:
                        yield shape.event({**shape.chunk(None, None), "choices": [],
                                           "usage": _usage(r, engine.opts.nextn)}, False)
                    break
            yield "data: [DONE]\n\n"
        finally:  # the client left (the generator is closed) or the stream ended: nothing more to decode
            engine.cancel(r)

    return app


class _Shape:
    """OpenAI's response objects for one request."""

    def __init__(self, rid: str, model: str, chat: bool, created: int):
        self.rid, self.model, self.chat, self.created = rid, model, chat, created

    def chunk(self, delta, reason) -> dict:
        if self.chat:
            content = delta if isinstance(delta, dict) else {} if delta is None else {"content": delta}
            choice = {"index": 0, "delta": content, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
        return {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}

    def event(self, chunk: dict, usage: bool) -> str:
        if usage:
            chunk = {**chunk, "usage": None}
        return f"data: {json.dumps(chunk)}\n\n"

    def whole(self, text: str, reason: str, usage: dict, mtp: dict | None) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        out = {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice], "usage": usage}
        return out | ({"mtp": mtp} if mtp is not None else {})


def _usage(r, nextn: int) -> dict:
    """OpenAI's usage, with the request's speculative figures under `speculative_decoding` (vLLM's per-request
    names, and the acceptance per draft position: Sequence.spec_usage)."""
    prompt, completion = len(r.seq.prompt), len(r.seq.generated)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "speculative_decoding": r.seq.spec_usage(nextn)}


def _mtp(r) -> dict:
    """A request's MTP figures: verify steps, and tokens per step (accepted drafts + the bonus)."""
    steps = r.seq.steps
    per_step = (len(r.seq.generated) - 1) / steps if steps else 0.0  # the first token comes from the prefill
    return {"steps": steps, "mean_acceptance_length": round(per_step, 4)}


class _Collector:
    """The engine's figures as Prometheus metrics, under vLLM's names (model_name label)."""

    def __init__(self, engine: Engine, model_id: str, counter, gauge, histogram):
        self.engine, self.model_id = engine, model_id
        self.counter, self.gauge, self.histogram = counter, gauge, histogram

    def collect(self):
        e, f, label = self.engine, self.engine.figures, [self.model_id]
        waiting, running = e.counts()

        def one(kind, name, doc, value):
            m = kind(name, doc, labels=["model_name"])
            m.add_metric(label, value)
            return m

        yield one(self.gauge, "vllm:num_requests_running", "Requests in the running batch.", running)
        yield one(self.gauge, "vllm:num_requests_waiting", "Requests waiting to join the batch.", waiting)
        yield one(self.counter, "vllm:prompt_tokens", "Prompt tokens prefilled.", f.prompt_tokens)
        yield one(self.counter, "vllm:generation_tokens", "Tokens generated.", f.generation_tokens)
        success = self.counter("vllm:request_success", "Requests finished, by finish reason.",
                               labels=["model_name", "finished_reason"])
        for reason, count in sorted(f.finished.items()):
            success.add_metric([self.model_id, reason], count)
        yield success
        yield one(self.gauge, "mtp_trt:generation_tokens_per_second", "Tokens generated per second, last 10 s.",
                  e.tokens_per_second())
        yield one(self.counter, "vllm:spec_decode_num_drafts", "Verify steps of a sequence with drafts.", f.num_drafts)
        yield one(self.counter, "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", f.num_draft_tokens)
        yield one(self.counter, "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                  int(f.num_accepted_tokens_per_pos.sum()))
        per_pos = self.counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position.",
                               labels=["model_name", "position"])
        for pos, count in enumerate(f.num_accepted_tokens_per_pos.tolist()):
            per_pos.add_metric([self.model_id, str(pos)], count)
        yield per_pos
        yield _histogram(self.histogram, "mtp_trt:spec_decode_num_drafts_per_step",
                         "Draft tokens K verified per decode step (chosen per step with --speculation auto).",
                         self.model_id, f.k_chosen)
        yield _histogram(self.histogram, "mtp_trt:spec_decode_accepted_length",
                         "Draft tokens accepted per verify step of a request.", self.model_id, f.accepted_length)
        cost = self.gauge("mtp_trt:step_cost_seconds", "The step cost model: measured seconds of a decode step with K "
                          "drafts over `rows` requests (EWMA).", labels=["model_name", "k", "rows"])
        for (k, rows), seconds in e.step_costs().items():
            cost.add_metric([self.model_id, str(k), str(rows)], seconds)
        yield cost


def _histogram(kind, name: str, doc: str, model_id: str, counts: list[int]):
    """A Prometheus histogram of small integers: counts[j] observations of value j (buckets le=0, 1, ...)."""
    m = kind(name, doc, labels=["model_name"])
    buckets = [(str(j), c) for j, c in zip(range(len(counts)), itertools.accumulate(counts))] + \
        [("+Inf", sum(counts))]
    m.add_metric([model_id], buckets, sum_value=sum(j * c for j, c in enumerate(counts)))
    return m


def serve(engine: Engine, model_id: str, host: str, port: int, api_key: str | None, shutdown_timeout: float,
          log_level: str = "info", ready=None, max_request_bytes: int | None = None) -> None:
    """Run the API until SIGTERM or Ctrl-C: then admit nothing more, let running requests finish for up to
    `shutdown_timeout` seconds, and cancel the rest.  `ready(server)` is called once it listens."""
    import uvicorn

    app = create_app(engine, model_id, api_key, max_request_bytes)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.close_admission()
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if ready is not None:
                ready(self)

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:  # in use, or not an address of this machine: one line, before anything starts
        sock.close()
        raise MtpTrtError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                            lifespan="off")
    server = Server(config)
    engine.start()
    try:
        server.run(sockets=[sock])
    finally:  # uvicorn has let the requests in flight finish (or cancelled them): the engine stops at once
        engine.stop(0)
