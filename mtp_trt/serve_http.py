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
import logging
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from mtp_trt.errors import MtpTrtError
from mtp_trt.fsutil import parse_json
from mtp_trt.sampling import SamplingParams
from mtp_trt.serve import Engine, QueueFull, ShuttingDown
from mtp_trt.tokenizer import BosPolicy, chat_renderer, encode

# The default limit of a request body: 64 KiB for the fields, and 32 bytes per cache row for the prompt (a token
# is 4 characters of English on average; 32 bytes leave room for JSON escapes and long tokens).
REQUEST_BYTES_BASE, REQUEST_BYTES_PER_ROW = 64 << 10, 32
PREPARE_THREADS = 2  # requests parsed and tokenized at once, off the event loop
REQUEST_TIMEOUT_S = 30.0  # a client's time to send a request's head, and again its body
SHUTDOWN_GRACE_S = 5.0  # after --shutdown-timeout, time for the requests' last events to reach their clients
FILES_KEPT = 64  # open files kept for the process itself below its limit (the rest: connections)


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
    """Fields of both endpoints.  Strict types (no "5" for 5) and no NaN or infinity.  A field OpenAI's API
    defines that would change the output and that this server does not implement is refused (400 naming it) when
    it asks for something other than its neutral value; a field OpenAI's API does not define is refused as
    OpenAI refuses it ("Unrecognized request argument supplied")."""

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
    # OpenAI's fields without an effect on the text (accepted, not used)
    user: str | None = None
    # OpenAI's fields this server does not implement: accepted at their neutral value only (see unsupported)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionBody(Body):
    prompt: str | list[str]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False  # the prompt before the completion's text
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # what OpenAI's client sends back of an earlier reply: accepted when empty
    refusal: str | None = None
    tool_calls: list | None = None
    tool_call_id: str | None = None
    function_call: dict | None = None
    audio: dict | None = None
    annotations: list | None = None


class ChatBody(Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    # accepted, without an effect on the text
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    prediction: dict | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # not implemented: accepted at their neutral value only
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict | None = None


CHAT_ROLES = ("system", "developer", "user", "assistant")


def unsupported(body: Body) -> ApiError | None:
    """The first field of `body` that asks for something this server does not do, as a 400 naming it."""
    def no(param: str, what: str) -> ApiError:
        return ApiError(400, f"{param}: {what} is not supported by this server", param, "unsupported_parameter")

    for param in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, param)
        if value is not None and not -2 <= value <= 2:
            return ApiError(400, f"{param}: must be in [-2, 2], got {value}", param)
        if value:
            return no(param, f"a non-zero {param}")
    if body.logit_bias:
        return no("logit_bias", "logit_bias")
    if isinstance(body, CompletionBody):
        if body.best_of is not None and body.best_of != 1:
            if body.best_of < 1:
                return ApiError(400, f"best_of: must be >= 1, got {body.best_of}", "best_of")
            return no("best_of", f"best_of = {body.best_of} (only 1)")
        if body.logprobs is not None:
            return no("logprobs", "logprobs")
        if body.suffix:
            return no("suffix", "suffix")
        return None
    if body.logprobs:
        return no("logprobs", "logprobs")
    if body.top_logprobs is not None:
        return no("top_logprobs", "top_logprobs")
    if body.response_format is not None and body.response_format.get("type") != "text":
        return no("response_format", f"response_format {json.dumps(body.response_format.get('type'))} (only "
                                     f"\"text\")")
    for param in ("tools", "functions"):
        if getattr(body, param):
            return no(param, "tool calling")
    for param in ("tool_choice", "function_call"):
        if getattr(body, param) not in (None, "none"):
            return no(param, "tool calling")
    if body.modalities is not None and body.modalities != ["text"]:
        return no("modalities", "output other than text")
    for param in ("audio", "reasoning_effort", "verbosity", "web_search_options"):
        if getattr(body, param) is not None:
            return no(param, param)
    for i, m in enumerate(body.messages):
        where = f"messages.{i}"
        if m.role not in CHAT_ROLES:
            if m.role in ("tool", "function"):
                return no(f"{where}.role", f"the role {m.role!r} (tool calling)")
            return ApiError(400, f"{where}.role: unknown role {m.role!r} (system, developer, user or assistant)",
                            f"{where}.role")
        if m.content is None and m.role != "assistant":
            return ApiError(400, f"{where}.content: a {m.role} message needs content", f"{where}.content")
        for field in ("tool_calls", "function_call", "audio"):
            if getattr(m, field):
                return no(f"{where}.{field}", field)
    return None


def unrecognized(raw, schema: type[BaseModel]) -> ApiError | None:
    """OpenAI's 400 for a field no endpoint of its API has (a typo such as `max_token`)."""
    if isinstance(raw, dict):
        for name in raw:
            if name not in schema.model_fields:
                return ApiError(400, f"Unrecognized request argument supplied: {name}", name)
    return None


# ---------------------------------------------------------------------------------------- the app
def create_app(engine: Engine, model_id: str, api_key: str | None = None, max_request_bytes: int | None = None,
               request_timeout: float | None = None) -> FastAPI:
    """The API over a started engine, serving it as model `model_id`; request bodies of at most
    `max_request_bytes` (default: default_request_bytes), read within `request_timeout` seconds (default
    REQUEST_TIMEOUT_S)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    runner = engine.runner
    render_chat = chat_renderer(runner.manifest.root)
    app = FastAPI(title="mtp-trt", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    limit_bytes = max_request_bytes or default_request_bytes(engine.rows)
    body_timeout = request_timeout or REQUEST_TIMEOUT_S
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

    if api_key is not None:
        app.add_middleware(_CheckKey, api_key=api_key)

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

    def fits_as_text(text: str, prompt_param: str) -> None:
        """A prompt of more characters than the cache can hold as tokens (runner.prompt_chars) is refused before
        it is tokenized: tokenizing megabytes takes seconds, and their ids hold the interpreter while they are made."""
        if len(text) > runner.prompt_chars():
            raise ApiError(400, f"the prompt has {len(text)} characters, more than this server's "
                                f"{engine.max_prompt_tokens} prompt tokens can cover (cache rows {engine.rows}, nextn "
                                f"{engine.opts.nextn})", prompt_param, "context_length_exceeded")

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

        async def gather() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit_bytes:
                    raise too_large(f"more than {limit_bytes}")
                chunks.append(chunk)

        try:
            await asyncio.wait_for(gather(), body_timeout)
        except ClientDisconnect:  # the client left before its body was whole: nobody to answer
            raise ApiError(499, "the client closed the connection before its request body was whole", None,
                           None) from None
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {body_timeout:g} s ({size} bytes came)",
                           None, "request_timeout") from None
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
        if (e := unrecognized(raw, schema)) is not None:
            raise e
        try:
            body = schema.model_validate(raw)
        except ValidationError as e:
            raise invalid_field(e) from None
        if (e := unsupported(body)) is not None:
            raise e
        return body

    def prepare_completion(data: bytes) -> tuple:
        """(worker thread) body, prompt ids, decoding, max tokens of a completion request, or an ApiError."""
        body = parse(data, CompletionBody)
        decoding = sampling(body)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            raise ApiError(400, f"prompt: one prompt per request is supported, got {len(prompts)}", "prompt")
        if not prompts[0]:
            raise ApiError(400, "prompt: empty", "prompt")
        fits_as_text(prompts[0], "prompt")
        ids = runner.encode(prompts[0])
        return body, ids, decoding, limit(body.max_tokens, "max_tokens", ids, "prompt")

    def prepare_chat(data: bytes) -> tuple:
        """(worker thread) body, prompt ids, decoding, max tokens of a chat request, or an ApiError."""
        body = parse(data, ChatBody)
        decoding = sampling(body)
        if render_chat is None:
            raise ApiError(400, f"the model {model_id!r} has no chat template (tokenizer_config.json "
                                f"chat_template); use /v1/completions", "messages")
        messages = [{"role": m.role, "content": "" if m.content is None else m.content if isinstance(m.content, str)
                     else "".join(p.text for p in m.content)} | ({"name": m.name} if m.name is not None else {})
                    for m in body.messages]
        try:
            text = render_chat(messages)
        except MtpTrtError as e:
            raise ApiError(400, str(e), "messages") from None
        for i, m in enumerate(messages):  # a template that knows no such role may leave a message out
            shown = m["content"].split("</think>")[-1].strip()
            if shown and shown not in text:
                raise ApiError(400, f"messages.{i}: the model's chat template leaves this {m['role']} message out "
                                    f"of the prompt (it does not render the role {m['role']!r})", f"messages.{i}.role")
        fits_as_text(text, "messages")
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
        echo = ""
        if isinstance(body, CompletionBody) and body.echo:  # the prompt's text before the completion's
            echo = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream(r, shape, usage, body.mtp_stats, echo), media_type="text/event-stream")
        text, reason = [echo], None
        watcher = asyncio.ensure_future(watch_disconnect(request, r))
        try:
            while reason is None:
                event = await r.events.get()
                if event[0] == "gone":  # the client left: its slot is freed at the next step
                    engine.cancel(r)
                    return ApiError(499, "the client closed the connection", None, None,
                                    "invalid_request_error").response()
                if event[0] == "text":
                    text.append(event[1])
                elif event[0] == "error":
                    raise ApiError(event[1], event[2], None, None, "server_error")
                else:
                    reason = event[1]
        except asyncio.CancelledError:
            engine.cancel(r)
            raise
        finally:
            watcher.cancel()
        return shape.whole("".join(text), reason, _usage(r, engine.opts.nextn), _mtp(r) if body.mtp_stats else None)

    async def watch_disconnect(request: HttpRequest, r) -> None:
        """(beside a non-streamed request, its body read) wait for its client to leave; then say so to the handler."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        r.events.put_nowait(("gone",))

    async def stream(r, shape: _Shape, usage: bool, mtp: bool, echo: str = ""):
        try:
            if shape.chat:
                yield shape.event(shape.chunk({"role": "assistant", "content": ""}, None), usage)
            elif echo:
                yield shape.event(shape.chunk(echo, None), usage)
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


class _CheckKey:
    """`Authorization: Bearer KEY` on /v1/ (a plain ASGI middleware: Starlette's BaseHTTPMiddleware would hide a
    client's disconnection from the handlers)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if given != self.expected:
                response = ApiError(401, "missing or incorrect API key (Authorization: Bearer KEY)", None,
                                    "invalid_api_key").response()
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


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
    prompt, completion = len(r.seq.prompt), r.completion_tokens
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
        with e.lock:  # (the engine and the handlers count requests ended)
            finished = sorted(f.finished.items())
        for reason, count in finished:
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


def raise_open_file_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit (as vLLM does: a server holds a file per
    connection); the soft limit now."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            want = 1 << 20 if hard == resource.RLIM_INFINITY else hard
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
                soft = want
            except (OSError, ValueError):
                pass
        return soft if soft != resource.RLIM_INFINITY else 1 << 20
    except ImportError:  # not POSIX
        return 1 << 16


def _error_bytes(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 answer with OpenAI's error object, closing the connection (for the protocol's own
    answers, given before any handler runs)."""
    from http import HTTPStatus

    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def _protocol(request_timeout: float, max_connections: int):
    """uvicorn's HTTP/1.1 protocol with limits for clients that send slowly or not at all: a request's head must
    arrive within `request_timeout` seconds of the connection (or of the last answer on it), else the
    connection is closed (with a 408 if part of a head came); beyond `max_connections` connections a new one
    closes the oldest that is waiting for a request head, so that idle connections cannot use up the process's
    open files.  A request line or head it cannot parse is answered with OpenAI's error object."""
    import itertools

    from uvicorn.protocols.http.h11_impl import H11Protocol

    opened = itertools.count()

    class Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            self.order, self.head_timer, self.head_bytes = next(opened), None, 0
            super().connection_made(transport)
            self.arm()
            if len(self.connections) > max_connections:
                idle = [c for c in self.connections if c is not self and getattr(c, "order", None) is not None
                        and c.waiting_for_head() and not c.transport.is_closing()]
                if idle:
                    min(idle, key=lambda c: c.order).transport.close()

        def waiting_for_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def arm(self) -> None:
            self.disarm()
            self.head_bytes = 0
            self.head_timer = self.loop.call_later(request_timeout, self.head_timed_out)

        def disarm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def data_received(self, data: bytes) -> None:
            self.head_bytes += len(data)
            super().data_received(data)
            if not self.waiting_for_head():
                self.disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.waiting_for_head():
                self.arm()

        def connection_lost(self, exc) -> None:
            self.disarm()
            super().connection_lost(exc)

        def head_timed_out(self) -> None:
            self.head_timer = None
            if self.waiting_for_head() and not self.transport.is_closing():
                if self.head_bytes:
                    self.transport.write(_error_bytes(408, f"the request head did not arrive within "
                                                           f"{request_timeout:g} s", "request_timeout"))
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            self.transport.write(_error_bytes(400, f"not an HTTP/1.1 request ({msg.rstrip('.')})",
                                              "invalid_http_request"))
            self.transport.close()

    return Protocol


class _NoCancelledTracebacks:
    """A logging filter: a handler cancelled as the server is forced to stop (Ctrl-C twice) is no fault to report."""

    def filter(self, record) -> bool:
        e = record.exc_info[1] if record.exc_info else None
        return not isinstance(e, (asyncio.CancelledError, KeyboardInterrupt))


def _quiet_resource_errors(loop) -> None:
    """Log running out of open files (or other resources) while accepting connections as one line at most every
    10 s, not a traceback per attempt."""

    last = [0.0]
    default = loop.get_exception_handler()

    def handler(loop, context):
        e = context.get("exception")
        if isinstance(e, OSError) and "out of system resource" in context.get("message", ""):
            if time.monotonic() - last[0] >= 10:
                last[0] = time.monotonic()
                logging.getLogger("uvicorn.error").warning(
                    "cannot accept more connections (%s); retrying", e.strerror or e)
            return
        if default is not None:
            default(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def listen_url(host: str, port: int) -> str:
    """The API's base URL at host:port (an IPv6 address in brackets)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def serve(engine: Engine, model_id: str, host: str, port: int, api_key: str | None, shutdown_timeout: float,
          log_level: str = "info", ready=None, max_request_bytes: int | None = None,
          request_timeout: float = REQUEST_TIMEOUT_S) -> None:
    """Run the API until SIGTERM or Ctrl-C: then admit nothing more, let running requests finish for up to
    `shutdown_timeout` seconds, and cancel the rest.  `ready(server)` is called once it listens.  A client has
    `request_timeout` seconds to send a request's head, and as long again for its body."""
    import uvicorn

    app = create_app(engine, model_id, api_key, max_request_bytes, request_timeout)
    max_connections = max(8, raise_open_file_limit() - FILES_KEPT)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # the first signal: running requests have shutdown_timeout seconds, then the engine ends every
            # request left (running or queued) with an error: streams get their error event and [DONE], the
            # others a 503, before uvicorn closes what is still open; a second one (Ctrl-C again): at once
            timeout = shutdown_timeout if engine.admitting else 0.0
            engine.close_admission()
            threading.Thread(target=engine.stop, args=(timeout,), name="mtp-trt-shutdown", daemon=True).start()
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            _quiet_resource_errors(asyncio.get_running_loop())
            logging.getLogger("uvicorn.error").addFilter(_NoCancelledTracebacks())
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
    Server.url = listen_url(host, sock.getsockname()[1])  # the port bound (--port 0: one the system chose)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout + SHUTDOWN_GRACE_S,
                            lifespan="off", http=_protocol(request_timeout, max_connections))
    server = Server(config)
    engine.start()
    try:
        server.run(sockets=[sock])
    finally:  # uvicorn has let the requests in flight finish (or cancelled them): the engine stops at once
        engine.stop(0)
