"""Text in, text out: resolve the model (engine directory, export directory, checkpoint, or the bundled demo),
tokenize, decode.

A checkpoint is exported on first use into a cache directory keyed by the checkpoint's contents and
the export options (under `mtp_trt.fsutil.cache_dir("exports")`), so later runs start at once.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from mtp_trt.backend import Backend, OrtBackend
from mtp_trt.decode import DecodeOptions, Sequence, Stats, generate
from mtp_trt.errors import MtpTrtError
from mtp_trt.fsutil import cache_dir
from mtp_trt.manifest import EXPORTER_REVISION, Manifest, verify_export
from mtp_trt.quant import Scheme

# The bundled demo checkpoint: package data in an installed wheel (mtp_trt/demo_model), samples/demo-model in a
# source tree (an editable install); MTP_TRT_DEMO_MODEL overrides both.
CACHE_NAME_CHARS = 64  # of a checkpoint's directory name, in its cache entry's name
DEFAULT_MAX_BATCH = 8  # a checkpoint's export in the cache decodes this many sequences at once, or the batch asked
DEMO_MODEL_DIRS = (Path(__file__).resolve().parent / "demo_model",
                   Path(__file__).resolve().parent.parent / "samples" / "demo-model")


def demo_model() -> Path:
    env = os.environ.get("MTP_TRT_DEMO_MODEL")
    for path in [Path(env)] if env else DEMO_MODEL_DIRS:
        if (path / "config.json").is_file():
            return path
    where = env or " or ".join(str(p) for p in DEMO_MODEL_DIRS)
    raise MtpTrtError(f"{where}: the bundled demo checkpoint is missing (set MTP_TRT_DEMO_MODEL or pass a model)")


def checkpoint_key(ckpt: Path, **options) -> str:
    """Digest of the checkpoint's files (names and contents: manifest.file_digests, each file read again only
    when its size, times or inode change), the export options and the exporter revision."""
    from mtp_trt.manifest import file_digests

    h = hashlib.sha256(json.dumps(options | {"exporter_revision": EXPORTER_REVISION}, sort_keys=True).encode())
    for name, digest in file_digests(ckpt).items():
        h.update(f"{name}:{digest}".encode())
    return h.hexdigest()[:16]


# What `run`, `serve` and `bench` take, for messages.
MODELS = "an engine directory (engines.json), an export directory (manifest.json) or a checkpoint (config.json)"


def resolve_export(model: str | Path | None, mtp_mode: str | None, progress=None, verify: bool = False,
                   scheme: Scheme | None = None, batch: int = 1, bos: bool | None = None,
                   trees: bool = True) -> Manifest:
    """An export directory as is; a checkpoint exported (once) into the cache with all its MTP modules, the
    weights quantized as `scheme` says (default: not) and caches for `batch` sequences (at least the export's
    default), its BOS rule (with --bos/--no-bos: `bos`) checked before.  Either is checked against its manifest's
    hashes (once per change of its files; every time with `verify`).  `trees`: whether the caller may draft
    trees; a checkpoint's export without them (cache_entry's `trees`) leaves out the tree step graphs, a third of
    a first run's export, unless the cache already holds the export with them."""
    from mtp_trt.validate import directory

    path = directory(Path(model) if model else demo_model(), MODELS, hub=True)
    if (path / "manifest.json").is_file():
        m = Manifest.load(path)
        if mtp_mode and mtp_mode != m.mtp_mode:
            raise MtpTrtError(f"{path}: exported in {m.mtp_mode} mode, but --mtp-mode {mtp_mode} was asked; "
                              f"export again with --mtp-mode {mtp_mode} (or pass the checkpoint)")
        have = m.quant
        if scheme is not None and scheme != have:
            raise MtpTrtError(f"{path}: exported with --quant {have.name}"
                              f"{f' --group-size {have.block_size}' if have.quantized else ''}, but --quant "
                              f"{scheme.name} was asked; export again (or pass the checkpoint)")
        verify_export(m, force=verify)
        return m
    if not (path / "config.json").is_file():
        raise MtpTrtError(f"{path}: neither an export directory (manifest.json) nor a checkpoint (config.json)")
    mode = mtp_mode or "eagle"
    scheme = scheme or Scheme()
    max_batch = max(batch, DEFAULT_MAX_BATCH)
    trees = trees or (cache_entry(path, mode, scheme, max_batch) / "manifest.json").is_file()
    m = export_cached(path, cache_entry(path, mode, scheme, max_batch, trees), mode, progress or (lambda msg: None),
                      scheme, max_batch, bos, trees)
    verify_export(m, force=verify)
    return m


def cache_entry(ckpt: Path, mode: str, scheme: Scheme, max_batch: int, trees: bool = True) -> Path:
    """Where a checkpoint's export with these options lives in the cache (its name: the checkpoint's, the mode, the
    quantization, `-chain` for an export without tree step graphs (`trees` False), and the checkpoint_key of its
    files and the options)."""
    from mtp_trt.plugins import ort_lib

    key = checkpoint_key(ckpt, mode=mode, cpu_ops=ort_lib.available()[0],  # (the default export uses them if it can)
                         **({"quant": scheme.tag} if scheme.quantized else {}),
                         **({"max_batch": max_batch} if max_batch != DEFAULT_MAX_BATCH else {}),
                         **({} if trees else {"trees": "none"}))
    from mtp_trt.hub import snapshot_name

    # the key tells entries apart; the name is for people (a Hugging Face snapshot's: its repo's name and commit),
    # cut short so that the names of the entry's lock and partial files stay within the file system's 255 bytes
    name = (snapshot_name(ckpt) or ckpt.name)[:CACHE_NAME_CHARS]
    return cache_dir("exports") / (f"{name}-{mode}{'-' + scheme.tag if scheme.quantized else ''}"
                                   f"{'' if trees else '-chain'}-{key}")


def export_cached(ckpt: Path, out: Path, mode: str, progress, scheme: Scheme = Scheme(),
                  max_batch: int = DEFAULT_MAX_BATCH, bos: bool | None = None, trees: bool = True) -> Manifest:
    """Export `ckpt` into the cache entry `out` unless it is there.  Any number of processes may ask at once:
    one exports (under a lock file in cache_dir("locks")), the others say that they wait, wait and reuse its
    result.  Partial directories left by killed processes are removed first (never a live one's: fsutil).  The
    export's stages are reported as `caching NAME: STAGE`, the first of them torch's import and the checks (the
    weight scan included), before anything is exported.  `trees`: the default tree step graphs, or none."""
    from mtp_trt.config import ModelConfig
    from mtp_trt.fsutil import locked, remove_stale_partials
    from mtp_trt.tokenizer import bos_policy, check_vocab, load_tokenizer
    from mtp_trt.validate import require

    remove_stale_partials(out.parent)
    if not (out / "manifest.json").is_file():
        cfg = ModelConfig.from_file(ckpt / "config.json")  # a checkpoint mtp-trt cannot run is named first
        if not (ckpt / "tokenizer.json").is_file():  # before the export, not after it
            raise MtpTrtError(f"{ckpt}: the checkpoint has no tokenizer.json; text prompts need one")
        tokenizer = load_tokenizer(ckpt / "tokenizer.json")
        check_vocab(tokenizer, cfg.vocab_size, ckpt / "tokenizer.json")
        bos_policy(ckpt, cfg.bos_token_id, tokenizer, bos)  # the rule the Runner will follow, named in the checkpoint
        require(f"exporting the checkpoint {ckpt} into the cache (its first use)", "torch", "onnx")
        try:
            cache_dir("locks").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MtpTrtError(f"{cache_dir()}: cannot write the cache directory ({e.strerror}); set "
                              f"MTP_TRT_CACHE_DIR to a writable directory") from None
        waiting = f"waiting for another mtp-trt process, which exports {ckpt.name} into the cache"
        with locked(cache_dir("locks", f"{out.name}.lock"), waiting=lambda: progress(waiting)):
            if not (out / "manifest.json").is_file():
                stage = lambda stage: progress(f"caching {ckpt.name}: {stage}")  # noqa: E731
                stage("loading torch, checking the checkpoint")  # as `mtp-trt export` says it (cli.CHECKING)
                from mtp_trt.exporters.export import export  # torch: only on first use

                try:
                    export(ckpt, out, mtp_mode=mode, progress=stage, trees=None if trees else "none",
                           quant_scheme=scheme.name, group_size=scheme.block_size, max_batch=max_batch)
                except OSError as e:  # the cache's file system is full (or over quota): the cache is the place
                    if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                        raise
                    raise MtpTrtError(f"{cache_dir()}: cannot write the export of {ckpt.name} into the cache "
                                      f"({e.strerror or e}); free space there, or set MTP_TRT_CACHE_DIR to a "
                                      f"directory with room") from None
    return Manifest.load(out)


def verify_engines(engine_dir: Path, force: bool = False) -> dict:
    """manifest.verify_files for the engines an engine directory's engines.json lists (remembered likewise)."""
    from mtp_trt.manifest import verify_files
    from mtp_trt.trt import manifest as em

    m = em.EngineManifest.load(engine_dir)
    exp = em.load_export_manifest(Path(engine_dir))
    m.check_export(exp)
    files = [(e.file, e.sha256) for e in m.engines.values()] + [(em.EXPORT_MANIFEST, m.raw["export"]["manifest_sha256"])]
    files += list((exp.raw.get("tokenizer_files") or {}).items())
    return verify_files(Path(engine_dir) / em.FILE, files, "build", force=force)


def open_runner(model: str | Path | None, mtp_mode: str | None = None, threads: int | None = None,
                cuda_graphs: bool = True, progress=None, bos: bool | None = None, verify: bool = False,
                scheme: Scheme | None = None, batch: int = 1, command: str = "run", trees: bool = True) -> Runner:
    """A Runner for an engine directory (engines.json: TensorRT on the GPU, mtp_trt/trt/runtime.py), an export
    directory or a checkpoint (ONNX Runtime on the CPU).  The files are checked against their manifest's hashes
    (once per change of the files; every time with `verify`); `bos`: see mtp_trt.tokenizer; `scheme`: the
    quantization a checkpoint is exported with (resolve_export); `command`: the mtp-trt command asking (run or
    serve), for the message of engines this machine cannot run; `trees`: whether the caller may draft trees
    (resolve_export)."""
    from mtp_trt.validate import directory

    path = directory(Path(model) if model else demo_model(), MODELS, hub=True)
    if (path / "engines.json").is_file():
        from mtp_trt.trt import manifest as em
        from mtp_trt.trt.runtime import TrtBackend

        m = em.load_export_manifest(path)
        if mtp_mode and mtp_mode != m.mtp_mode:
            raise MtpTrtError(f"{path}: engines of a {m.mtp_mode}-mode export, but --mtp-mode {mtp_mode} was asked")
        if scheme is not None:
            raise MtpTrtError(f"{path}: --quant applies to a checkpoint (engines are built from an export)")
        verify_engines(path, force=verify)
        return Runner(m, TrtBackend(path, cuda_graphs=cuda_graphs, command=command), bos=bos)
    return Runner(resolve_export(path, mtp_mode, progress=progress, verify=verify, scheme=scheme, batch=batch,
                                 bos=bos, trees=trees), threads=threads, bos=bos)


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """`text` up to the earliest occurrence of any stop string, and whether one occurred."""
    at = min((i for i in (text.find(x) for x in stop) if i >= 0), default=-1)
    return (text, False) if at < 0 else (text[:at], True)


def held_back(text: str, stop: tuple[str, ...]) -> int:
    """How many characters at the end of `text` not to show until decided: a character still incomplete (U+FFFD
    from a partial UTF-8 sequence, waiting for its next tokens) and, before it, the longest suffix that could
    begin a stop string."""
    body = text.rstrip("\ufffd")
    return len(text) - len(body) + max(
        (n for x in stop for n in range(min(len(x) - 1, len(body)), 0, -1) if body.endswith(x[:n])), default=0)


DETOKENIZE_CONTEXT = 5  # tokens before the new ones that incremental detokenization decodes again with them


@dataclasses.dataclass
class Detokenizer:
    """Incremental detokenization of one sequence's tokens (`detokenize`): the text of tokens[:read], final, and
    where the tokens decoded again for context start."""

    text: str = ""
    prefix: int = 0
    read: int = 0


def detokenize(decode: Callable[[list[int]], str], d: Detokenizer, tokens: list[int]) -> str:
    """decode(tokens), decoding only the tokens added since the last call with a few before them (vLLM's
    incremental detokenizer): the new text is decode(context + new) less decode(context), so a token whose text
    depends on its neighbours (byte-level pieces, a leading space a decoder strips at the start) comes out as in the
    whole text.  A text ending in an incomplete character (U+FFFD: a UTF-8 sequence split across tokens) is
    returned but not kept: its tokens are decoded again next time.  A decoder whose text of earlier tokens changes
    with later ones gets the whole decode."""
    if len(tokens) < d.read:  # not the same sequence's tokens grown: start again
        d.text, d.prefix, d.read = "", 0, 0
    if len(tokens) == d.read:
        return d.text
    before = decode(tokens[d.prefix:d.read]) if d.read > d.prefix else ""
    window = decode(tokens[d.prefix:])
    if not window.startswith(before):
        return decode(tokens)
    new = window[len(before):]
    if new.endswith("\ufffd"):
        return d.text + new
    d.text += new
    d.read = len(tokens)
    d.prefix = max(0, d.read - DETOKENIZE_CONTEXT)
    return d.text


@dataclasses.dataclass
class Result:
    prompt: str
    text: str
    tokens: list[int]
    finish_reason: str
    message: str = ""
    speculative_decoding: dict | None = None  # its speculative figures (Sequence.spec_usage)


@dataclasses.dataclass
class RunReport:
    results: list[Result]
    stats: Stats
    seconds: float
    nextn: int
    tree: str | None = None  # DEPTH:TOPK:BUDGET when a tree was drafted
    speculation: str = "fixed"  # auto: K chosen per step (the steps per K: k_steps; each step's: k_per_step)

    @property
    def new_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.results)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict:
        return {"new_tokens": self.new_tokens, "seconds": round(self.seconds, 4),
                "tokens_per_second": round(self.tokens_per_second, 2), "nextn": self.nextn,
                "tree": self.tree, "steps": self.stats.steps, "num_drafts": self.stats.num_drafts,
                "num_draft_tokens": self.stats.num_draft_tokens, "num_accepted_tokens": self.stats.num_accepted_tokens,
                "mean_acceptance_length": round(self.stats.mean_acceptance_length, 4),
                "acceptance_rate_per_pos": [a if a is None else round(a, 4) for a in self.stats.acceptance_rate_per_pos],
                "speculation": self.speculation,
                "k_steps": {str(k): self.stats.k_chosen.count(k) for k in sorted(set(self.stats.k_chosen))},
                "k_per_step": self.stats.k_chosen}


class Runner:
    """A loaded export, its tokenizer and a backend."""

    def __init__(self, manifest: Manifest, backend: Backend | None = None, threads: int | None = None,
                 bos: bool | None = None):
        from mtp_trt.tokenizer import bos_policy, check_vocab, load_tokenizer

        self.manifest = manifest
        if not manifest.tokenizer:
            raise MtpTrtError(f"{manifest.root}: the export has no tokenizer.json; text prompts need one")
        self.tokenizer = load_tokenizer(manifest.root / manifest.tokenizer)
        check_vocab(self.tokenizer, manifest.config.vocab_size, manifest.root / manifest.tokenizer)
        self.bos = bos_policy(manifest.root, manifest.config.bos_token_id, self.tokenizer, bos)
        if backend is None:  # the graphs ONNX Runtime will load; a given backend checks its own files
            verify_export(manifest)  # remembered: a stat per file unless one changed since it was last hashed
        self.backend = backend or OrtBackend(manifest, threads=threads)

    def options(self, nextn: int | None, tree_topk: int | None = None, tree_budget: int | None = None,
                speculation: str | None = None, **kwargs) -> DecodeOptions:
        """Decode options for this export; tree_topk >= 2 drafts a tree of depth nextn (mtp_trt/tree.py).
        speculation: `auto` chooses K in 0..the export's nextn before every step (eagle chains), `fixed` runs
        nextn (default: the export's) every step; None: auto where it applies (no --nextn, no tree, an eagle
        export with drafts), else fixed."""
        m = self.manifest
        if speculation not in (None, "auto", "fixed"):
            raise MtpTrtError(f"--speculation must be auto or fixed, got {speculation!r}")
        if speculation == "auto":
            why = ("--nextn fixes K" if nextn is not None else "trees are drafted at a fixed depth (--tree-topk)"
                   if tree_topk not in (None, 1) else f"the export is in {m.mtp_mode} mode (auto needs eagle)"
                   if m.mtp_mode != "eagle" else "the export has no MTP drafts" if not m.nextn else None)
            if why:
                raise MtpTrtError(f"--speculation auto chooses K per step, but {why}; drop one of them")
        adaptive = speculation == "auto" or (speculation is None and nextn is None and tree_topk in (None, 1)
                                             and m.mtp_mode == "eagle" and m.nextn > 0)
        nextn = m.nextn if nextn is None else nextn
        if not 0 <= nextn <= m.nextn:
            raise MtpTrtError(f"--nextn must be in 0..{m.nextn} for this export ({m.root}), got {nextn}")
        opts = DecodeOptions(nextn=nextn, eos_ids=m.eos_ids, think_ids=m.think_ids, adaptive=adaptive, **kwargs)
        tree = self.tree(nextn, tree_topk, tree_budget)
        return opts if tree is None else dataclasses.replace(opts, tree=tree)

    def tree(self, nextn: int, topk: int | None, budget: int | None):
        """The tree shape --tree-topk / --tree-budget ask for, among the export's tree graphs (None: the chain)."""
        from mtp_trt.tree import tree_shape

        if topk is None or topk == 1:
            if budget is not None:
                raise MtpTrtError("--tree-budget needs --tree-topk >= 2 (top-k 1 is the chain)")
            return None
        m = self.manifest
        have = [t for t in m.raw.get("trees") or [] if t.startswith(f"{nextn}:{topk}:")]
        tree_shape(nextn, topk, 1)  # depth and top-k in range
        if budget is None and have:
            budget = int(have[0].split(":")[2])
        shape = tree_shape(nextn, topk, budget) if budget is not None else None
        if shape is None or shape.spec not in have:
            listed = ", ".join(m.raw.get("trees") or []) or "none"
            raise MtpTrtError(f"{m.root}: the export has no tree of depth (--nextn) {nextn}, top-k {topk}"
                              f"{'' if budget is None else f', budget {budget}'} (its trees, DEPTH:TOPK:BUDGET: "
                              f"{listed}); export one with --trees {nextn}:{topk}:{budget or 2 * topk}")
        return shape

    def encode(self, text: str) -> list[int]:
        """Prompt ids, with BOS first as the checkpoint's tokenizer (or --bos/--no-bos) says: mtp_trt.tokenizer."""
        from mtp_trt.tokenizer import encode

        ids = encode(self.tokenizer, text, self.bos)
        if not ids:
            raise MtpTrtError("empty prompt: give some text with --prompt")
        return ids

    def prompt_chars(self) -> int:
        """More characters than a prompt that fits the cache can have: every token covers at most as many
        characters as the vocabulary's longest token, and normalization is allowed to remove three in four."""
        if getattr(self, "_prompt_chars", None) is None:
            longest = max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)), default=1)
            self._prompt_chars = 4 * max(longest, 1) * self.manifest.max_seq_len + 64
        return self._prompt_chars

    def encode_prompts(self, prompts: list[str], truncate: bool = False) -> list[list[int]]:
        """Prompt ids of a batch, judged before any tokenizing where they can be: more prompts than the export's
        max_batch, or a prompt of more characters than the cache could hold as tokens (prompt_chars), is an
        MtpTrtError naming it (with `truncate`, such a prompt is cut to its last prompt_chars characters first).
        The tokenizer works in a thread: the main thread stays free for SIGTERM and Ctrl-C."""
        import threading

        self.check_batch(len(prompts))
        limit = self.prompt_chars()
        texts = []
        for i, p in enumerate(prompts):
            if len(p) > limit and not truncate:
                raise MtpTrtError(f"prompt {i} has {len(p)} characters, more than the export's cache "
                                  f"({self.manifest.max_seq_len} rows, max_seq_len) can hold as tokens; shorten it, "
                                  f"or give --truncate to keep its last tokens")
            texts.append(p[-limit:] if len(p) > limit else p)
        done, out = threading.Event(), {}

        def work():
            try:
                out["ids"] = [self.encode(t) for t in texts]
            except BaseException as e:  # handed to the main thread
                out["error"] = e
            done.set()

        threading.Thread(target=work, name="mtp-trt-tokenize", daemon=True).start()
        while not done.wait(0.5):  # (a wait a signal handler interrupts)
            pass
        if "error" in out:
            raise out["error"]
        return out["ids"]

    def check_batch(self, n: int) -> None:
        if n > self.manifest.max_batch:
            raise MtpTrtError(f"{n} prompts, but the export ({self.manifest.root}) decodes at most max_batch "
                              f"{self.manifest.max_batch} at once; give fewer, or export with --max-batch {n}")

    def fit(self, ids: list[list[int]], nextn: int, truncate: bool = False, new_tokens: int = 1) -> list[list[int]]:
        """Prompts that fit the export's cache by README's rule (prompt + 2 nextn + 2 rows); a
        longer one is an error naming it, or with `truncate` keeps its last tokens (and its BOS): as many as
        leave room for `new_tokens` to be generated (at least one token, where `new_tokens` alone fills the
        cache)."""
        rows = self.manifest.max_seq_len
        room = rows - 2 * nextn - 2
        self.check_batch(len(ids))
        if room < 1:
            raise MtpTrtError(f"{self.manifest.root}: max_seq_len {rows} leaves no room for a prompt with --nextn "
                              f"{nextn}")
        # decode.accept: a sequence ends at `rows` tokens, prompt included, whatever nextn (the steps verify fewer
        # drafts near the end)
        keep = room if new_tokens <= 1 else max(1, min(room, rows - new_tokens))
        out = []
        for i, x in enumerate(ids):
            if len(x) <= (keep if truncate else room):
                out.append(x)
                continue
            if not truncate:
                raise MtpTrtError(f"prompt {i} has {len(x)} tokens, but the export's cache "
                                  f"({rows} rows, max_seq_len) fits at most {room} with --nextn "
                                  f"{nextn}; shorten it, or give --truncate to keep its last tokens")
            head = x[:1] if self.bos.add and self.bos.token_id in (None, x[0]) and keep > 1 else []  # BOS stays first
            out.append(head + x[len(x) - keep + len(head):])
        return out

    def decode(self, tokens: list[int], d: Detokenizer | None = None) -> str:
        """Text of generated tokens; special tokens such as <think> are shown, the final EOS is not.  `d`: the
        sequence's incremental detokenization (its tokens so far, one call per step: `detokenize`)."""
        if tokens and tokens[-1] in self.manifest.eos_ids:
            tokens = tokens[:-1]
        if d is not None:
            return detokenize(self._decode, d, tokens)
        return self._decode(tokens)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def run(self, prompts: list[str], opts: DecodeOptions, seed: int = 0, stop: tuple[str, ...] = (),
            on_text: Callable[[int, str], None] | None = None, truncate: bool = False,
            ids: list[list[int]] | None = None) -> RunReport:
        """Decode the prompts as one batch.  on_text(i, new_text) streams each sequence's new text.  Prompts
        that do not fit the cache are refused before any decoding (or truncated: see fit).  `ids`: the prompts'
        ids where the caller has them (encode_prompts)."""
        shown = [0] * len(prompts)
        detok = [Detokenizer() for _ in prompts]

        def show(i: int, text: str) -> None:
            if on_text and len(text) > shown[i]:
                on_text(i, text[shown[i]:])
                shown[i] = len(text)

        def on_step(seqs: list[Sequence]) -> None:
            for i, s in enumerate(seqs):
                text, stopped = cut_at_stop(self.decode(s.generated, detok[i]), stop)
                if stopped and s.finish_reason is None:
                    s.finish_reason = "stop"
                show(i, text if stopped else text[: len(text) - held_back(text, stop)])

        ids = self.fit(ids or self.encode_prompts(prompts, truncate), opts.nextn, truncate, opts.max_new_tokens)
        self.backend.prepare(opts.nextn, opts.sampling.greedy, opts.tree_graph)  # loading is not decoding time
        cost = self.calibrate(opts, ids) if opts.adaptive else None  # neither is timing the steps
        t0 = time.perf_counter()
        seqs, stats = generate(self.backend, ids, opts, seed=seed, on_step=on_step, cost=cost)
        seconds = time.perf_counter() - t0
        results = []
        for i, (p, s) in enumerate(zip(prompts, seqs)):
            text, stopped = cut_at_stop(self.decode(s.generated), stop)
            show(i, text)  # what was held back as a possible stop string's start
            reason = "stop" if stopped else s.finish_reason or "length"  # (a stop string in the last step's tokens)
            results.append(Result(p, text, s.generated, reason, s.message, s.spec_usage(opts.nextn)))
        return RunReport(results, stats, seconds, opts.nextn, opts.tree.spec if opts.tree_graph else None,
                         "auto" if opts.adaptive else "fixed")

    def calibrate(self, opts: DecodeOptions, ids: list[list[int]], steps: int = 4):
        """The step costs of adaptive speculation for this batch size: `steps` timed steps of each K (decode.calibrate)
        on sequences of the first prompt's first tokens."""
        from mtp_trt.decode import calibrate, open_batch

        prompt = ids[0][:16]
        rows = min(self.manifest.max_seq_len, len(prompt) + 2 * steps * (opts.nextn + 1) ** 2 + 2 * opts.nextn + 8)
        batch = open_batch(self.backend, opts, len(ids), rows)
        calibrate(self.backend, batch, prompt, [len(ids)], steps)
        return batch.cost
