"""The serving engine: one thread runs the decode loop (mtp_trt.decode's continuous batching) over a Runner;
requests join the running batch between steps, stream their text back, and leave when finished or cancelled.

Callers (the HTTP layer, mtp_trt/serve_http.py) never block the engine: `submit` and `cancel` take a lock for
a moment, and each request's events (new text, the end) are handed to the caller's asyncio loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import itertools
import threading
import time
from collections import deque

import numpy as np

from mtp_trt.decode import (Batch, DecodeOptions, Sequence, admit, calibrate, open_batch, prefill_chunk, sequence_rng,
                            step)
from mtp_trt.runner import Detokenizer, Runner, cut_at_stop, held_back
from mtp_trt.sampling import SamplingParams


def _deliver(items: list) -> None:
    """(on a request's event loop) put a round's events into their queues."""
    for queue, event in items:
        queue.put_nowait(event)


class QueueFull(Exception):
    """The waiting queue is at --max-queue."""


class ShuttingDown(Exception):
    """The server no longer admits requests."""


@dataclasses.dataclass(eq=False)
class Request:
    """One request in the engine: its sequence, its stop strings, what has been streamed, where events go.
    Events are ("text", str) and, last, ("end", finish_reason) or ("error", HTTP status, message)."""

    id: int
    seq: Sequence
    stop: tuple[str, ...]
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    text: str = ""  # the generated text so far, cut at a stop string
    sent: int = 0  # characters of `text` already sent
    decoded: int = -1  # generated tokens `text` was decoded from
    detokenizer: Detokenizer = dataclasses.field(default_factory=Detokenizer)  # its text, decoded incrementally
    counted: int = 0  # generated tokens counted in the engine's figures
    ended: bool = False
    stopped_at: int | None = None  # with a stop string: the tokens up to the one that completes it

    @property
    def completion_tokens(self) -> int:
        """The tokens of the completion (usage): those generated, but not past the one that completes a stop
        string (a step may accept drafts beyond it)."""
        return self.stopped_at if self.stopped_at is not None else len(self.seq.generated)



@dataclasses.dataclass
class EngineFigures:
    """What the engine has done, for /metrics (counters only grow)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict = dataclasses.field(default_factory=dict)  # finish reason -> requests
    num_drafts: int = 0  # verify steps of a sequence with drafts (decode.Stats)
    num_draft_tokens: int = 0
    num_accepted_tokens_per_pos: np.ndarray | None = None
    recent: deque = dataclasses.field(default_factory=lambda: deque(maxlen=256))  # (time, tokens) per step
    k_chosen: list = dataclasses.field(default_factory=list)  # [k]: decode steps that verified k drafts
    accepted_length: list = dataclasses.field(default_factory=list)  # [j]: sequence steps that accepted j drafts


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim) when the batch runs dry: the
    decode's buffers for a full batch are freed between bursts, and without this the process keeps them."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class Engine:
    """Continuous batching over `runner`: up to `max_batch` sequences decode together, up to `max_queue` wait.
    `opts` holds what every request shares (nextn, relaxed acceptance, EOS and thinking tokens); each request
    brings its sampling, length limit, seed and stop strings.  `chunk`: prompt tokens per sequence prefilled
    between two decode steps."""

    def __init__(self, runner: Runner, opts: DecodeOptions, max_batch: int = 16, max_queue: int = 64,
                 chunk: int = 256, rows: int | None = None):
        self.runner, self.opts, self.chunk = runner, opts, chunk
        self.max_batch, self.max_queue = max_batch, max_queue
        self.rows = rows or runner.manifest.max_seq_len
        self.batch: Batch = open_batch(runner.backend, opts, max_batch, self.rows, mixed=True)
        self.ids = itertools.count()
        self.lock = threading.Condition()
        self.waiting: deque[Request] = deque()
        self.requests: dict[int, Request] = {}  # in the batch (joining or active)
        self.cancelled: set[int] = set()
        self.admitting = True
        self.stopping = False
        self.outbox: dict[asyncio.AbstractEventLoop, list] = {}  # this round's events, by the loop they go to
        self.figures = EngineFigures(num_accepted_tokens_per_pos=np.zeros(opts.nextn, np.int64),
                                     k_chosen=[0] * (opts.nextn + 1), accepted_length=[0] * (opts.nextn + 1))
        self.thread = threading.Thread(target=self._loop, name="mtp-trt-engine", daemon=True)

    # ------------------------------------------------------------------ called from any thread
    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt a request may bring (room for one decode step after it)."""
        return self.rows - 2 * self.opts.nextn - 2

    def start(self) -> None:
        self._warm_up()
        self.thread.start()

    def _warm_up(self) -> None:
        """Decode a few tokens of `max_batch` short sequences before the first request, so that requests do not
        pay for the backend's first-use allocations at full batch."""
        backend, batch = self.runner.backend, self.batch
        prompt = self.runner.encode("warm up")
        admit(batch, {-1 - i: Sequence(prompt, max_new_tokens=4) for i in range(self.max_batch)})
        while batch.joining:
            prefill_chunk(backend, batch, self.chunk)
        while batch.st.n:
            step(backend, batch)
        batch.seqs.clear()
        if self.opts.adaptive:  # the step costs of each K at batch sizes 1, 2, 4, ... max_batch
            sizes = [1 << i for i in range(self.max_batch.bit_length()) if 1 << i < self.max_batch] + [self.max_batch]
            calibrate(backend, batch, prompt, sizes)

    def step_costs(self) -> dict[tuple[int, int], float]:
        """The adaptive policy's step cost model: {(K, rows): seconds} measured so far."""
        from mtp_trt.speculation import cost_summary

        return cost_summary(self.batch.cost)

    def submit(self, prompt: list[int], sampling: SamplingParams, max_new_tokens: int, seed: int | None,
               stop: tuple[str, ...], loop: asyncio.AbstractEventLoop) -> Request:
        """Queue a request (prompt ids that fit: max_prompt_tokens); its events arrive on the returned Request's
        queue, on `loop`.  Raises QueueFull or ShuttingDown."""
        rng = sequence_rng(seed) if seed is not None else np.random.default_rng()
        seq = Sequence(prompt=list(prompt), sampling=sampling, max_new_tokens=max_new_tokens, rng=rng,
                       fixed_k=None if seed is not None else False)  # seeded: its text reproducible (decode.Sequence)
        with self.lock:
            if not self.admitting:
                raise ShuttingDown()
            if len(self.waiting) >= self.max_queue:
                raise QueueFull()
            r = Request(next(self.ids), seq, stop, asyncio.Queue(), loop)
            self.waiting.append(r)
            self.lock.notify()
        return r

    def cancel(self, r: Request) -> None:
        """Drop a request (its client left): from the queue, or from the batch at the next step boundary."""
        with self.lock:
            if r in self.waiting:
                self.waiting.remove(r)
                r.ended = True
                self._finished("cancelled")
            elif not r.ended:
                self.cancelled.add(r.id)
                self.lock.notify()

    def counts(self) -> tuple[int, int]:
        """(waiting, running) requests."""
        with self.lock:
            return len(self.waiting), len(self.requests)

    def stop(self, timeout: float) -> None:
        """Admit nothing more, let the running requests finish for up to `timeout` seconds, cancel the rest,
        and end the engine thread."""
        with self.lock:
            self.admitting = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(self.counts()):
            time.sleep(0.02)
        with self.lock:
            self.stopping = True
            self.lock.notify()
        if self.thread.is_alive():
            self.thread.join()

    def close_admission(self) -> None:
        with self.lock:
            self.admitting = False

    # ------------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        while True:
            with self.lock:
                if not (self.waiting or self.requests or self.stopping):
                    release_free_memory()
                while not (self.waiting or self.requests or self.stopping):
                    self.lock.wait()
                if self.stopping:
                    leaving, self.requests = list(self.requests.values()) + list(self.waiting), {}
                    self.waiting.clear()
                    break
                cancelled, self.cancelled = self.cancelled, set()
                new = []
                while self.waiting and len(new) < self.batch.free:
                    new.append(self.waiting.popleft())
                self.requests |= {r.id: r for r in new}
            try:
                self._turn(new, cancelled)
            except Exception as e:  # a backend failure fails the requests in flight, not the server
                self._fail(f"{type(e).__name__}: {e}")
        for r in leaving:
            if not r.ended:
                r.ended = True
                self._finished("cancelled")
                self._post(r, "error", 503, "the server is shutting down")
        self._flush()

    def _turn(self, new: list[Request], cancelled: set[int]) -> None:
        """One round: cancellations, admissions, one prefill chunk, one decode step, the requests' events."""
        backend, batch = self.runner.backend, self.batch
        for i in cancelled:
            if i in batch.seqs and batch.seqs[i].finish_reason is None:
                batch.seqs[i].finish_reason = "cancelled"
                self.requests[i].ended = True
                self._finished("cancelled")
        if new:
            admit(batch, {r.id: r.seq for r in new})
            self.figures.prompt_tokens += sum(len(r.seq.prompt) for r in new)
        if batch.joining:
            prefill_chunk(backend, batch, self.chunk)
        before = (batch.stats.num_drafts, batch.stats.num_draft_tokens, batch.stats.num_accepted_tokens_per_pos.copy())
        steps = batch.stats.steps
        if batch.st.n:
            step(backend, batch, self._stop_strings)
        self._count_drafts(*before)
        if batch.stats.steps > steps:
            self.figures.k_chosen[batch.stats.k_chosen[-1]] += 1
            if len(batch.stats.k_chosen) > 4096:  # the figures are kept here; the batch's list would only grow
                del batch.stats.k_chosen[:]
            for m in batch.stats.last_accepted:
                self.figures.accepted_length[m] += 1
        self._events()
        self._flush()

    def _stop_strings(self) -> None:
        """After a step's tokens are accepted: decode the active sequences' text, finishing those at a stop string."""
        st = self.batch.st
        for i in st.order[:st.n].tolist():
            self._text(self.requests[i])

    def _text(self, r: Request) -> None:
        if r.decoded == len(r.seq.generated):
            return
        before, r.decoded = max(r.decoded, 0), len(r.seq.generated)
        r.text, hit = cut_at_stop(self.runner.decode(r.seq.generated, r.detokenizer), r.stop)
        if hit and r.seq.finish_reason is None:
            r.seq.finish_reason = "stop"
            # the fewest tokens whose text holds the stop string (those before this step's did not)
            r.stopped_at = next((n for n in range(before + 1, r.decoded)
                                 if cut_at_stop(self.runner.decode(r.seq.generated[:n]), r.stop)[1]), r.decoded)

    def _count_drafts(self, drafts: int, draft_tokens: int, accepted_per_pos: list[int]) -> None:
        s, f = self.batch.stats, self.figures
        f.num_drafts += s.num_drafts - drafts
        f.num_draft_tokens += s.num_draft_tokens - draft_tokens
        f.num_accepted_tokens_per_pos += np.subtract(s.num_accepted_tokens_per_pos, accepted_per_pos)

    def _events(self) -> None:
        """Send each request its new text; end the finished ones and let them go."""
        batch, st = self.batch, self.batch.st
        joining = set(batch.joining.ids) if batch.joining else set()
        active = set(st.order[:st.n].tolist())
        for i, r in list(self.requests.items()):
            if i in joining:
                continue
            tokens = len(r.seq.generated) - r.counted  # counted before the request hears of them (/metrics)
            if tokens:
                r.counted += tokens
                self.figures.generation_tokens += tokens
                self.figures.recent.append((time.monotonic(), tokens))
            if not r.ended:
                self._text(r)
                done = r.seq.finish_reason is not None
                upto = len(r.text) if done else len(r.text) - held_back(r.text, r.stop)
                if upto > r.sent:
                    self._post(r, "text", r.text[r.sent:upto])
                    r.sent = upto
                if done:
                    r.ended = True
                    self._finished(r.seq.finish_reason)
                    self._post(r, "end", r.seq.finish_reason)
            if r.seq.finish_reason is not None and i not in active:
                del batch.seqs[i]
                with self.lock:
                    del self.requests[i]

    def _finished(self, reason: str) -> None:
        """Count a request ended (/metrics), from the engine thread or a caller's."""
        with self.lock:
            self.figures.finished[reason] = self.figures.finished.get(reason, 0) + 1

    def _post(self, r: Request, *event) -> None:
        """Queue an event for a request; _flush hands a round's events over, one wake-up per event loop."""
        self.outbox.setdefault(r.loop, []).append((r.events, event))

    def _flush(self) -> None:
        for loop, items in self.outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed (the server was forced to stop): nobody to tell
                pass
        self.outbox = {}

    def _fail(self, message: str) -> None:
        """End every request in the batch with an error and start a fresh batch."""
        with self.lock:
            failed, self.requests = list(self.requests.values()), {}
        for r in failed:
            if not r.ended:
                r.ended = True
                self._post(r, "error", 500, message)
        self._flush()
        cost, self.batch = self.batch.cost, open_batch(self.runner.backend, self.opts, self.max_batch, self.rows,
                                                       mixed=True)
        self.batch.cost = cost

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Generated tokens per second over the last `window` seconds."""
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self.figures.recent) if now - t <= window]
        return sum(n for _, n in recent) / window if recent else 0.0
