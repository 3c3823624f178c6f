"""Backends run the exported graphs over persistent latent KV caches; ONNX Runtime on the CPU is the default.

A backend owns one cache per graph family, allocated once for `batch x rows`: the target's
(one buffer per layer) and one per MTP module (eagle: one; vanilla: K).  Running a graph commits
its S new latent rows of every sequence at rows past_len .. past_len+S-1 (the plugin lowering's
attention node does it in place; for the onnx lowering the backend copies the graph's `new_kv`
outputs).  Rewinding is the decode loop's business: it moves lengths back and later steps
overwrite the rejected rows.  Sequences run on the first `n` slots; `swap_slots` lets the loop
keep the unfinished ones first so finished ones cost nothing.
"""

from __future__ import annotations

import functools
import os
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from mtp_trt import contract as C
from mtp_trt.contract import cache_slot, mtp_family
from mtp_trt.errors import MtpTrtError
from mtp_trt.manifest import Manifest
from mtp_trt.tree import tree_spec
from mtp_trt.validate import cache_bytes, check_memory, machine_memory


class Backend(ABC):
    """What the decode loop needs from an execution engine.  The graphs' calls (target, mtp, step, tree_step:
    their inputs by the contract's names, what they return) are built here once, over one call each backend
    implements: `run` (one graph on slots 0..n-1, its cache rows committed).  A backend whose graphs take at most
    `max_s` new tokens per call (TensorRT's optimization profiles) runs longer target and MTP calls as chunks."""

    manifest: Manifest
    max_s: int | None = None  # the most new tokens one call takes (None: any)

    @abstractmethod
    def allocate(self, batch: int, rows: int) -> None:
        """(Re)allocate every cache for `batch` sequences of `rows` tokens (a decode of the same shape as the last one
        may run on its caches, zeroed)."""

    @abstractmethod
    def run(self, graph: str, n: int, feed: dict[str, np.ndarray], fetch: list[str], family: str = mtp_family(0),
            replay: bool = False) -> dict[str, np.ndarray]:
        """Run graph `graph` on slots 0..n-1 with the inputs in `feed` that it has (+ its caches: `family`, the
        persistent cache of an MTP graph's `kv`) and commit its new rows at past_len; returns the outputs `fetch`.
        replay: the call repeats every step with the same shapes (the step and tree graphs: worth capturing or
        binding once); its returned dict and arrays may then be the backend's own, overwritten by the next call of
        the same graph (read them, do not change them)."""

    @abstractmethod
    def has_graph(self, graph: str) -> bool:
        """Whether this backend can run graph `graph`."""

    def target(self, n: int, input_ids: np.ndarray, past_len: np.ndarray, thinking: np.ndarray,
               relaxed_topk: int, relaxed_delta: float, logits: bool) -> dict[str, np.ndarray]:
        """Run the target graph on slots 0..n-1 and commit its rows.  Returns TARGET_OUTPUTS (+ logits)."""
        feed = verify_feed(input_ids, past_len, thinking, relaxed_topk, relaxed_delta)
        fetch = [*C.TARGET_OUTPUTS, *[C.LOGITS] * logits]
        return self.chunked(C.TARGET, n, feed, (C.INPUT_IDS,), fetch, {C.TARGET_TOKENS, C.HIDDEN_STATES, C.LOGITS})

    def mtp(self, cache: int, graph: str, n: int, hidden: np.ndarray, next_tokens: np.ndarray,
            past_len: np.ndarray, logits: bool) -> dict[str, np.ndarray]:
        """Run MTP graph `graph` over MTP cache `cache` on slots 0..n-1 and commit its rows.
        Returns hidden_out, draft_tokens, draft_probs (+ draft_logits)."""
        feed = {C.HIDDEN: hidden.astype(C.dtype(self.manifest.dtype).host, copy=False),
                C.NEXT_TOKENS: next_tokens.astype(np.int32, copy=False),
                C.PAST_LEN: past_len.astype(np.int32, copy=False)}
        fetch = [*C.MTP_OUTPUTS, *[C.DRAFT_LOGITS] * logits]
        return self.chunked(graph, n, feed, (C.HIDDEN, C.NEXT_TOKENS), fetch, set(fetch), C.mtp_family(cache))

    def chunked(self, graph: str, n: int, feed: dict, split: tuple[str, ...], fetch: list[str], concat: set[str],
                family: str = mtp_family(0)) -> dict[str, np.ndarray]:
        """`run`, as chunks at past_len + start where S exceeds max_s: the inputs in `split` are cut along S, the
        outputs in `concat` joined along S, the others come from the last chunk."""
        s = feed[split[0]].shape[1]
        if self.max_s is None or s <= self.max_s:
            return self.run(graph, n, feed, fetch, family)
        parts = []
        for start, length in chunks(s, self.max_s):
            piece = feed | {k: feed[k][:, start:start + length] for k in split}
            piece[C.PAST_LEN] = (feed[C.PAST_LEN] + start).astype(np.int32)
            parts.append(self.run(graph, n, piece, fetch, family))
        return {k: np.concatenate([p[k] for p in parts], 1) if k in concat else parts[-1][k] for k in fetch}

    def prepare(self, nextn: int, greedy: bool, tree: str | None = None) -> None:
        """Load everything a decode with these options runs (called before it, so that timings exclude it)."""

    def graphs_for(self, nextn: int, greedy: bool, tree: str | None = None) -> list[str]:
        """The graphs a decode with these options runs: the target (prefill), the MTP graphs (the first
        drafts; every step's when not fused), the step graph when there is one, or the tree graph `tree`
        (DecodeOptions.tree_graph)."""
        graphs = [C.TARGET, *dict.fromkeys(self.manifest.mtp_graphs[:nextn])]
        if tree:
            return graphs + [tree]
        return graphs + ([C.step_graph(nextn)] if greedy and self.has_step(nextn) else [])

    def has_step(self, nextn: int) -> bool:
        """Whether `step` can run a whole greedy decode step with `nextn` drafts in one call (the export has
        a `step_{nextn}` graph)."""
        return self.has_graph(C.step_graph(nextn))

    def bound_step(self, graph: str, n: int) -> BoundCall | None:
        """Step graph `graph`'s call on slots 0..n-1 as the backend keeps it bound once a step has run (ONNX
        Runtime: BoundCall, whose `inputs` a decode loop may write in place before its `run`); None where there is
        none (yet), or the backend binds no call."""
        return None

    def step(self, n: int, input_ids: np.ndarray, past_len: np.ndarray, thinking: np.ndarray, relaxed_topk: int,
             relaxed_delta: float, carry: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Verify, accept and draft the next K tokens in one call (the `step_K` graph, K = input_ids' width - 1),
        committing the target's rows and the MTP caches'.  carry [n, K-1, D]: vanilla's hidden states kept
        from the previous step.  Returns accepted_tokens, num_accepted, thinking_out and (K > 0) drafts and
        (vanilla, K > 1) carry_out."""
        feed = verify_feed(input_ids, past_len, thinking, relaxed_topk, relaxed_delta)
        if carry is not None:
            feed[C.CARRY] = carry
        return self._step(C.step_graph(input_ids.shape[1] - 1), n, feed)

    def tree_step(self, graph: str, n: int, input_ids: np.ndarray, tree_parents: np.ndarray, past_len: np.ndarray,
                  thinking: np.ndarray, relaxed_topk: int, relaxed_delta: float,
                  carry: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """One greedy tree step (tree graph `graph`, exporters/tree.py, exporters/tree_vanilla.py): input_ids
        [n, N+1] (last, then the tree), tree_parents [n, N], carry [n, D-1, H] (vanilla, D > 1: as `step`).
        Commits the accepted path's rows (and vanilla's window rows of every module).  Returns accepted_tokens,
        num_accepted, thinking_out, the next tree: tree_tokens, tree_parents_out, and (vanilla, D > 1)
        carry_out."""
        feed = verify_feed(input_ids, past_len, thinking, relaxed_topk, relaxed_delta)
        feed[C.TREE_PARENTS] = tree_parents.astype(np.int32, copy=False)
        if carry is not None:
            feed[C.CARRY] = carry
        return self._step(graph, n, feed)

    def _step(self, graph: str, n: int, feed: dict) -> dict[str, np.ndarray]:
        """A step or tree graph: the STEP_OUTPUTS it has (worked out once per graph: a step runs on every decode
        step); `run` feeds the inputs it has."""
        fetch = self.__dict__.setdefault("_step_fetch", {}).get(graph)
        if fetch is None:
            outputs = {t.name for t in self.manifest.graphs[graph].outputs}
            fetch = self._step_fetch[graph] = [k for k in C.STEP_OUTPUTS if k in outputs]
        return self.run(graph, n, feed, fetch, replay=True)

    @abstractmethod
    def swap_slots(self, i: int, j: int) -> None:
        """Exchange the cached rows of slots i and j (used when a sequence finishes)."""


def chunks(s: int, size: int) -> list[tuple[int, int]]:
    """(start, length) pieces of S rows, each at most `size` rows."""
    return [(i, min(size, s - i)) for i in range(0, s, size)]


def verify_feed(input_ids: np.ndarray, past_len: np.ndarray, thinking: np.ndarray, relaxed_topk: int,
                relaxed_delta: float) -> dict[str, np.ndarray]:
    """The inputs of a verifying graph (target, step, tree) that the decode loop passes."""
    topk, delta = relaxed_inputs(relaxed_topk, relaxed_delta)
    return {C.INPUT_IDS: int32(input_ids), C.PAST_LEN: int32(past_len), C.THINKING: int32(thinking),
            C.RELAXED_TOPK: topk, C.RELAXED_DELTA: delta}


INT32 = np.dtype(np.int32)


def int32(a: np.ndarray) -> np.ndarray:
    """`a` as int32, itself where it is (the decode loop's arrays are: no NumPy call on every step)."""
    return a if a.dtype is INT32 else a.astype(np.int32)


@functools.lru_cache(maxsize=16)
def relaxed_inputs(relaxed_topk: int, relaxed_delta: float) -> tuple[np.ndarray, np.ndarray]:
    """The relaxed-acceptance inputs as arrays, made once per setting and read-only (a bound call copies a
    read-only input again only when it is another array: BoundCall)."""
    topk, delta = np.array(relaxed_topk, np.int32), np.array(relaxed_delta, np.float32)
    topk.flags.writeable = delta.flags.writeable = False
    return topk, delta


@functools.cache
def bounded_spin() -> bool:
    """Whether this ONNX Runtime bounds how long idle threads spin (`session.intra_op.spin_duration_us`, 1.26 on;
    earlier versions spin for tens of milliseconds and ignore the key)."""
    import onnxruntime as ort

    major, minor = (int(x) for x in ort.__version__.split(".")[:2])
    return (major, minor) >= (1, 26)


def default_threads() -> int:
    """The cores this process may use, capped at 8: the graphs' ops are small, so more threads would mostly
    wait (measured on 2 cores only, where 2 threads are 6-20% faster than 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, 8))


# OrtBackend shares one copy of the weights (no pre-packing) from this size of weights.bin up (measured:
# demo 23 MB, pre-packed copies 1.2-1.7x faster and small; 85M checkpoint 374 MB, copies 1.8x the memory for
# ~1.1x speed).
SHARE_WEIGHTS_BYTES = 128 << 20
# OrtBackend has mtp-trt's quantized operators pack their weights (a second copy, made once per process) below
# this size of weights.bin, by the export's bits (about 100M parameters either way): decode steps 1.26-1.39x faster
# on the demo (7 MB, cache-resident, int8 and int4); from memory, packed int8 products still gain (1.04-1.11x at
# 85M, 103 MB); int4 at 85M (57 MB) prefills a 512-token prompt 1.4x faster packed and decodes 1.05-1.07x faster
# on AVX2, alike on AVX512-VNNI; at 304M (190-357 MB) packing gained 0.98-1.04x in decode and 1.4x in prefill (int4),
# not worth twice the memory.
PACK_WEIGHTS_BYTES = {8: 128 << 20, 4: 64 << 20}
# How long a session's idle threads spin after its run before they sleep (ONNX Runtime >= 1.26,
# `session.intra_op.spin_duration_us`): longer than the Python between two decode steps (~0.07-0.11 ms on the
# demo), so the next step finds them awake, and short enough that a pool left idle (the prefill graph's, the
# last step's) takes a core from the next session's work or another process for at most this long.  Waking a
# sleeping thread at every step cost the demo 7-10% at nextn 0 and 2 threads (2026-11-29, 2-core Intel Xeon).
SPIN_BETWEEN_RUNS_US = 500
# ONNX data type -> numpy dtype of the weights a session can be handed (others load the usual way)
ONNX_NUMPY = {C.dtype(t).onnx: C.dtype(t).host for t in ("fp32", "uint8", "fp16", "int32", "int64", "bool", "fp64")}


class BoundCall:
    """A graph call that repeats with the same shapes (a step or tree graph, on every decode step): its inputs
    and outputs bound once (ONNX Runtime's IOBinding) to arrays of the backend's -- the cache views, input arrays
    that each call fills in place, output arrays that each call overwrites -- so that a call converts, allocates
    and looks up nothing.  Made by the first call of its shape, which runs unbound and gives the outputs' shapes.
    `result`: the `fetch` outputs (the next call overwrites them: the caller reads, never changes, the dict);
    `slots`: per window offset from past_len, each slot's cache rows and the graph's new rows for them.  An input
    fed the same read-only array as last time (relaxed_inputs) is not copied again."""

    def __init__(self, backend: OrtBackend, graph: str, n: int, feed: dict[str, np.ndarray],
                 views: dict[str, np.ndarray], fetch: list[str], kv_outputs: list[str], groups):
        import onnxruntime as ort

        names, session = fetch + kv_outputs, backend.session(graph)
        self.inputs = {k: np.array(v, copy=True, order="C") for k, v in feed.items()}
        self.fed = dict(feed)  # the array each input was last copied from
        outs = dict(zip(names, session.run(names, self.inputs | views)))
        commits = []  # per window offset: the caches and the graph's new rows for them
        for offset, entries in groups:
            layers = [backend.layer_of[fam, i] for _, fam, i, _ in entries]
            if (len(layers) > 1 and layers == list(range(layers[0], layers[0] + len(layers)))
                    and len({outs[new].shape for *_, new in entries}) == 1):
                # consecutive layers of the store: their new rows side by side, committed in one copy
                stack = np.stack([outs[new] for *_, new in entries])
                outs |= {new: stack[j] for j, (*_, new) in enumerate(entries)}
                store = backend.store[layers[0]:layers[-1] + 1, :n]
                commits.append((offset, [store.transpose(1, 0, 2, 3)], [stack.transpose(1, 0, 2, 3)]))
            else:
                outs |= {new: np.array(outs[new], copy=True, order="C") for *_, new in entries}
                commits.append((offset, [views[kv] for kv, *_ in entries], [outs[new] for *_, new in entries]))
        outs |= {k: np.array(outs[k], copy=True, order="C") for k in fetch}
        self.session, self.binding = session, session.io_binding()
        for k, v in (self.inputs | views).items():
            self.binding.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(v))
        for k, v in outs.items():
            self.binding.bind_ortvalue_output(k, ort.OrtValue.ortvalue_from_numpy(v))
        self.result = {k: outs[k] for k in fetch}
        # the run itself: ONNX Runtime's low-level call where its Python API has one (the public method checks
        # its arguments on every call for WebGPU graph capture)
        low, raw = getattr(session, "_sess", None), getattr(self.binding, "_iobinding", None)
        self.execute = (functools.partial(low.run_with_iobinding, raw, None) if low is not None and raw is not None
                        else functools.partial(session.run_with_iobinding, self.binding))
        self.slots = [(offset, slot_rows(caches, rows)) for offset, caches, rows in commits]

        self.backend = backend  # (its `written`, which allocate replaces)

    def replay(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run again: `load`, then `run`."""
        self.load(feed)
        self.run(feed[C.PAST_LEN].tolist())
        return self.result

    def load(self, feed: dict[str, np.ndarray]) -> None:
        """`feed`'s arrays copied into the bound inputs (those the graph has; a read-only array fed last time is
        not copied again)."""
        fed, inputs = self.fed, self.inputs
        for k, v in feed.items():
            if (v is not fed.get(k) or v.flags.writeable) and (bound := inputs.get(k)) is not None:
                bound[...] = v
                fed[k] = v

    def run(self, past_len: list[int]) -> None:
        """Run on the bound inputs as they are (`inputs`: the caller may write them in place) and commit the new rows
        at `past_len` (the past_len input's values, as a list) into the caches."""
        self.execute()
        for offset, slots in self.slots:
            commit(slots, [p + offset for p in past_len] if offset else past_len, self.backend.written)


def slot_rows(caches: list[np.ndarray], new_rows: list[np.ndarray]) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(b, cache rows of slot b [L, T, C], its new rows [L, S, C]) for each cache and slot b < n: caches [B, T, C]
    with new rows [n, S, C] (L = 1), or [B, L, T, C] with [n, L, S, C] (L consecutive layers of the store)."""
    return [(b, cache[b], new[b]) if cache.ndim == 4 else (b, cache[b, None], new[b, None])
            for cache, new in zip(caches, new_rows) for b in range(new.shape[0])]


def commit(slots: list[tuple[int, np.ndarray, np.ndarray]], past_len: list[int], written: list[int]) -> None:
    """Each slot's S new rows into its cache rows past_len[b] .. + S - 1, clipped to the buffer (one slice copy per
    slot and cache: cheaper than fancy indexing at the few sequences of a decode); written[b]: the rows of slot b
    ever written (swap_slots, allocate)."""
    for b, cache, new in slots:
        p, s, t = past_len[b], new.shape[1], cache.shape[1]
        if 0 <= p and p + s <= t:
            cache[:, p:p + s] = new
        elif max(p, 0) < min(p + s, t):  # the rows inside the buffer only
            cache[:, max(p, 0):p + s] = new[:, max(-p, 0):t - p]
        else:
            continue
        if p + s > written[b]:
            written[b] = min(p + s, t)


IN_MEMORY_SHARE = 4  # read_weights: weights.bin up to 1 / IN_MEMORY_SHARE of the machine's memory is read in


def read_weights(path: Path) -> np.ndarray:
    """weights.bin as the sessions read it (bytes, read-only): read once into anonymous memory that the kernel may
    back with 2 MiB transparent huge pages (madvise MADV_HUGEPAGE) where it takes at most 1 / IN_MEMORY_SHARE of the
    machine's memory (validate.machine_memory), else memory-mapped (the page cache's pages, read as the products
    reach them: a model larger than memory streams).  Weights read in place by the products on every step (the
    quantized ones not packed, `pack_weights`; float32 ones) stream far faster from memory of the process's own
    than from the page cache's 4 KiB pages: on a 2-core Intel Xeon under KVM, 304M `--quant int8` decoded 51-56
    tokens/s from the mapping, 89-101 from anonymous memory and 103-108 from huge pages, on one thread."""
    import mmap

    size = path.stat().st_size
    total = machine_memory()
    if not size or total is None or size > total // IN_MEMORY_SHARE:
        return np.memmap(path, np.uint8, mode="r")
    private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)  # (shared memory gets no huge pages)
    buf = mmap.mmap(-1, size, flags=private) if private else mmap.mmap(-1, size)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(buf)
    with open(path, "rb") as f:
        done = 0
        while done < size and (got := f.readinto(view[done:])):
            done += got
    view.release()
    if done != size:
        raise MtpTrtError(f"{path}: read {done} of its {size} bytes (the file changed while being read?)")
    weights = np.frombuffer(buf, np.uint8)
    weights.flags.writeable = False
    return weights


class OrtBackend(Backend):
    """ONNX Runtime, CPU execution provider, running the `onnx` lowering, `threads` intra-op threads per
    session (default: default_threads()).

    A decode runs several sessions (prefill, step graphs), each with its own pool.  After a run a pool's idle
    threads spin for SPIN_BETWEEN_RUNS_US (`session.intra_op.spin_duration_us`) and then sleep: the next decode
    step finds them awake, and a pool left idle takes a core from the next session's run for at most that
    long (ONNX Runtime's own default, tens of milliseconds, made 2 cores 2-4x slower).  Before ONNX Runtime
    1.26, which cannot bound it, a pool stops spinning when its run ends (`session.force_spinning_stop`).
    Between the kernels of a run the threads spin, as ONNX Runtime's do by default (`spin`;
    `session.intra_op.allow_spinning`): on a quiet machine
    that is 1.7x faster on the demo (1068 against 615 tokens/s at nextn 0, 2 threads) and up to 1.2x at
    85M; on a machine busy with other work a spinning thread takes the core from the one doing the work,
    and spin=False is faster there (85M, 2 threads on 2 cores shared with test runs: 80 against 45
    tokens/s; benchmarks/shared_weights.py).

    One copy of the weights per process (`share_weights`; where the export lists its initializers):
    weights.bin is read once (read_weights: into memory, or memory-mapped where it is large), and every session
    is handed the same memory for each of its weights (`SessionOptions.add_initializer` with an OrtValue over it,
    made once per tensor), with ONNX Runtime's pre-packing of MatMul weights turned off (a pre-packed copy is per
    session, and ONNX Runtime's Python API cannot share one) -- except in the graphs named by `prepack`
    (prefixes; default the step and tree graphs, one of which runs on every greedy decode step): those pre-pack a
    private copy of their dense MatMul weights (the MoE node's experts are not pre-packed: they stay shared).  MLAS
    streams a pre-packed matrix 1.3-1.4x faster than an unpacked one at one token and 2x at two, where it
    packs the unpacked one on every call (benchmarks/shared_weights.py --chain); a greedy decode runs one
    step graph, so one copy of its dense weights (+69 MB at 85M parameters, +229 MB at 304M) buys 1.05-1.1x
    per step at nextn 0 and 1.55x at nextn 1 (85M;
    benchmarks/shared_weights.py).  Without sharing every session holds its own pre-packed copy: 1.2-1.7x
    faster than sharing everything on the demo (23 MB, cache-resident).  share_weights=None (default)
    shares from SHARE_WEIGHTS_BYTES of weights up, where the copies cost more than the packing saves, and
    always for quantized weights (mtp-trt's quantized operators read them from the shared memory, and pack one
    copy per process of those they pack, whatever the number of sessions).

    `pack_weights`: whether the quantized operators pack their weights (docs/architecture.md, "CPU operators");
    None (default) from weights.bin's size below PACK_WEIGHTS_BYTES[bits].  Every session of a backend packs or not
    alike, so its steps of any nextn give the same bits for the same rows."""

    def __init__(self, manifest: Manifest, threads: int | None = None, share_weights: bool | None = None,
                 prepack: tuple[str, ...] = (C.STEP_PREFIX, C.TREE_PREFIX), spin: bool = True,
                 pack_weights: bool | None = None):
        import onnxruntime as ort

        if manifest.lowering != "onnx":
            raise MtpTrtError(f"{manifest.root}: exported with --lowering {manifest.lowering}; ONNX Runtime needs "
                              f"--lowering onnx (the plugin lowering is for `mtp-trt build`)")
        if manifest.dtype == "bf16":
            raise MtpTrtError(f"{manifest.root}: bf16 graphs do not run on ONNX Runtime's CPU provider; "
                              f"export with --dtype fp32")
        self.manifest = manifest
        if manifest.raw.get("cpu_ops"):  # MTP_TRT_CPU_ISA refused before anything runs (ort_lib.register's line)
            from mtp_trt.plugins import ort_lib

            if ort_lib.available()[0] and (refused := ort_lib.cpu_isa()[1]):
                raise MtpTrtError(refused)
        self.threads = threads or default_threads()
        weights = manifest.raw.get("weights")
        weights = weights if isinstance(weights, dict) else {}
        if share_weights is None:  # quantized weights are read in place by mtp-trt's operators: nothing to pre-pack
            share_weights = weights.get("bytes", 0) >= SHARE_WEIGHTS_BYTES or manifest.quant.quantized
        self.tables = weights.get("initializers") if share_weights else None
        if pack_weights is None:
            bits = manifest.quant.bits if manifest.quant.quantized else 0
            pack_weights = weights.get("bytes", 0) < PACK_WEIGHTS_BYTES.get(bits, 0)
        self.pack_weights = pack_weights
        self.prepack = prepack  # graphs (name prefixes) that pre-pack a private copy even when sharing
        self.spin = spin  # whether ONNX Runtime's threads spin between the kernels of a run (above)
        self.mapped: np.ndarray | None = None  # weights.bin, read or mapped on first use (read_weights)
        self.shared: dict[tuple, object] = {}  # (offset, ONNX type, dims) -> its OrtValue over the mapping
        self.sessions: dict[str, ort.InferenceSession] = {}  # created on first use: a run needs only some
        self.plans: dict[tuple[str, str], tuple] = {}  # (graph, MTP cache family) -> how to feed and commit it
        self.np_dtype = C.dtype(manifest.dtype).host
        self.caches: dict[str, list[np.ndarray]] = {}  # per family, its layers: views of `store` (allocate)
        self.store = np.zeros(0, self.np_dtype)
        self.layer_of: dict[tuple[str, int], int] = {}  # (family, index) -> its layer of `store`
        self.views: dict[tuple, dict[str, np.ndarray]] = {}
        self.bound: dict[tuple, BoundCall] = {}
        self.written: list[int] = []  # allocate

    def session(self, name: str):
        """The ONNX Runtime session of graph `name`, created the first time it is asked for."""
        if name not in self.sessions:
            import onnxruntime as ort

            g = self.manifest.graphs[name]
            path = self.manifest.root / g.file
            try:
                options = self.session_options(g.file, name.startswith(self.prepack))
                self.sessions[name] = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            except MtpTrtError:  # (already one line: the CPU operators not available, MTP_TRT_CPU_ISA refused)
                raise
            except Exception as e:  # ORT's message is a long C++ trace: keep its first line
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise MtpTrtError(f"{path}: ONNX Runtime cannot load this graph ({first[:300]})") from None
        return self.sessions[name]

    def session_options(self, file: str, prepack: bool = False):
        """The options of one graph's session: threads, spinning and, when sharing, its weights (without
        pre-packing unless `prepack`)."""
        import onnxruntime as ort

        options = ort.SessionOptions()
        from mtp_trt.plugins import ort_lib

        ort_lib.float_dequantized_matmuls(options)
        if self.manifest.raw.get("cpu_ops"):
            ok, why = ort_lib.available()
            if not ok:
                raise MtpTrtError(f"{self.manifest.root}: exported with mtp-trt's CPU operators, which are not "
                                  f"available here ({why}); re-export with --no-cpu-ops")
            ort_lib.register(options)
            if not self.pack_weights:
                options.add_session_config_entry(ort_lib.PACK_MAX_BYTES_KEY, "0")
            options.add_session_config_entry(ort_lib.THREADS_KEY, str(self.threads))
        options.intra_op_num_threads = self.threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.spin else "0")
        if self.spin and bounded_spin():
            options.add_session_config_entry("session.intra_op.spin_duration_us", str(SPIN_BETWEEN_RUNS_US))
        else:
            options.add_session_config_entry("session.force_spinning_stop", "1")
        if self.tables is None or file not in self.tables:
            return options
        if not prepack:
            options.add_session_config_entry("session.disable_prepacking", "1")
        if self.mapped is None:
            self.mapped = read_weights(self.manifest.root / self.manifest.raw["weights"]["file"])
        for name, offset, length, onnx_type, dims in self.tables[file]:
            if onnx_type not in ONNX_NUMPY:
                continue
            key = (offset, onnx_type, tuple(dims))
            if key not in self.shared:
                array = self.mapped[offset:offset + length].view(ONNX_NUMPY[onnx_type]).reshape(dims)
                self.shared[key] = ort.OrtValue.ortvalue_from_numpy(array)
            options.add_initializer(name, self.shared[key])
        return options

    def prepare(self, nextn, greedy, tree=None):
        if tree and tree not in self.manifest.graphs:
            raise MtpTrtError(f"{self.manifest.root}: the export has no tree graph {tree} (trees: "
                              f"{', '.join(self.manifest.raw.get('trees') or []) or 'none'}); export with --trees "
                              f"{tree_spec(tree)}")
        for name in self.graphs_for(nextn, greedy, tree):
            self.session(name)

    def allocate(self, batch: int, rows: int) -> None:
        m = self.manifest
        if rows > m.max_seq_len:
            raise MtpTrtError(f"{m.root}: {rows} cache rows per sequence needed, but the export allows "
                              f"max_seq_len = {m.max_seq_len}; re-export with a larger --max-seq-len")
        if self.store.shape[1:3] == (batch, rows):  # the same caches serve the next decode, and its bound calls
            for b, written in enumerate(self.written):
                self.store[:, b, :written] = 0  # as new: zero wherever the last decode wrote (swap_slots)
            self.written = [0] * batch
            return
        shape = (batch, rows, m.config.cache_dim)
        n_mtp = len(set(m.mtp_graphs))
        check_memory(cache_bytes(m.config, m.config.num_hidden_layers + n_mtp, batch, rows,
                                 np.dtype(self.np_dtype).itemsize),
                     f"{m.root}: the caches of {batch} sequences x {rows} rows")
        layers = m.config.num_hidden_layers
        # every cache one layer of one array: a step's new rows of all its layers are committed in one copy
        self.store = np.zeros((layers + n_mtp, *shape), self.np_dtype)
        self.caches = {C.TARGET_FAMILY: list(self.store[:layers])}
        self.caches |= {C.mtp_family(k): [self.store[layers + k]] for k in range(n_mtp)}
        self.layer_of = {(C.TARGET_FAMILY, i): i for i in range(layers)}
        self.layer_of |= {(C.mtp_family(k), 0): layers + k for k in range(n_mtp)}
        self.views = {}  # (graph, family, n) -> its cache inputs (_cache_views)
        self.bound = {}  # (graph, family, n, outputs) -> its BoundCall
        self.written = [0] * batch  # per slot: rows below this were ever written (swap_slots)

    def has_graph(self, graph):
        return graph in self.manifest.graphs

    def bound_step(self, graph, n):
        fetch = self.__dict__.get("_step_fetch", {}).get(graph)
        return None if fetch is None else self.bound.get((graph, mtp_family(0), n, tuple(fetch)))

    def _plan(self, graph: str, family: str):
        """How to feed and commit graph `graph` over MTP cache `family`, worked out on first use: its input names
        and, per window offset from past_len, its caches as (input name, cache family, index, new-rows output):
        kv_i (target), kv (an MTP graph's own: `family`), mtp_kv (eagle step), mtp_kv_j (vanilla depth j + 1,
        whose window starts j rows earlier)."""
        if (graph, family) not in self.plans:
            g = self.manifest.graphs[graph]
            groups: dict[int, list[tuple[str, str, int, str]]] = {}
            for kv, new in zip(g.kv_inputs, g.kv_outputs):
                slot = cache_slot(kv, family)
                groups.setdefault(slot.offset, []).append((kv, slot.family, slot.index, new))
            self.plans[graph, family] = ({t.name for t in g.inputs} - set(g.kv_inputs), g.kv_outputs,
                                         sorted(groups.items()))
        return self.plans[graph, family]

    def _cache_views(self, graph: str, family: str, n: int, groups) -> dict[str, np.ndarray]:
        """The cache inputs of graph `graph` over slots 0..n-1: views made once per (graph, family, n) until the
        caches are reallocated."""
        key = (graph, family, n)
        if key not in self.views:
            self.views[key] = {kv: self.caches[fam][i][:n] for _, entries in groups for kv, fam, i, _ in entries}
        return self.views[key]

    def run(self, graph, n, feed, fetch, family=mtp_family(0), replay=False):
        if replay and (call := self.bound.get((graph, family, n, tuple(fetch)))) is not None:
            return call.replay(feed)  # a step: nothing else looked up
        inputs, kv_outputs, groups = self._plan(graph, family)
        views = self._cache_views(graph, family, n, groups)
        feed = {k: v for k, v in feed.items() if k in inputs}
        past = feed[C.PAST_LEN].tolist()
        if replay:  # (its first run, unbound, gives the outputs' shapes)
            call = self.bound[graph, family, n, tuple(fetch)] = BoundCall(self, graph, n, feed, views, fetch,
                                                                          kv_outputs, groups)
            slots, out = call.slots, dict(call.result)
        else:
            names = fetch + kv_outputs
            out = dict(zip(names, self.session(graph).run(names, feed | views)))
            slots = [(offset, slot_rows([views[kv] for kv, *_ in entries], [out.pop(new) for *_, new in entries]))
                     for offset, entries in groups]
        for offset, rows in slots:
            commit(rows, [p + offset for p in past], self.written)
        return out

    def swap_slots(self, i, j):
        rows = max(self.written[i], self.written[j])  # beyond: never written, zero in both
        for caches in self.caches.values():
            for c in caches:
                c[[i, j], :rows] = c[[j, i], :rows]
        self.written[i], self.written[j] = self.written[j], self.written[i]
