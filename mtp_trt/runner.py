"""Text in, text out: resolve the model (engine directory, export directory, checkpoint, or the bundled demo),
tokenize, decode.

A checkpoint is exported on first use into a cache directory keyed by the checkpoint's contents and
the export options (under `mtp_trt.fsutil.cache_dir()`, default ~/.cache/mtp-trt), so later runs start at once.
"""

from __future__ import annotations

import dataclasses
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
from mtp_trt.manifest import EXPORTER_REVISION, Manifest

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL = REPO_ROOT / "samples" / "demo-model"


def demo_model() -> Path:
    path = Path(os.environ.get("MTP_TRT_DEMO_MODEL", DEMO_MODEL))
    if not (path / "config.json").is_file():
        raise MtpTrtError(f"{path}: the bundled demo checkpoint is missing (set MTP_TRT_DEMO_MODEL or pass a model)")
    return path


def checkpoint_key(ckpt: Path, **options) -> str:
    """Digest of the checkpoint's files (names, sizes, mtimes), the export options and the exporter revision."""
    h = hashlib.sha256(json.dumps(options | {"exporter_revision": EXPORTER_REVISION}, sort_keys=True).encode())
    for f in sorted(ckpt.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def resolve_export(model: str | Path | None, mtp_mode: str | None, progress=None) -> Manifest:
    """An export directory as is; a checkpoint exported (once) into the cache with all its MTP modules."""
    path = Path(model) if model else demo_model()
    if (path / "manifest.json").is_file():
        m = Manifest.load(path)
        if mtp_mode and mtp_mode != m.mtp_mode:
            raise MtpTrtError(f"{path}: exported in {m.mtp_mode} mode, but --mtp-mode {mtp_mode} was asked; "
                              f"export again with --mtp-mode {mtp_mode} (or pass the checkpoint)")
        return m
    if not (path / "config.json").is_file():
        raise MtpTrtError(f"{path}: neither an export directory (manifest.json) nor a checkpoint (config.json)")
    mode = mtp_mode or "eagle"
    out = cache_dir("exports") / f"{path.name}-{mode}-{checkpoint_key(path, mode=mode)}"
    if not (out / "manifest.json").is_file():
        from mtp_trt.exporters.export import export  # torch: only on first use

        export(path, out, mtp_mode=mode, progress=progress or (lambda msg: None))
    return Manifest.load(out)


def open_runner(model: str | Path | None, mtp_mode: str | None = None, threads: int | None = None,
                cuda_graphs: bool = True, progress=None) -> Runner:
    """A Runner for an engine directory (engines.json: TensorRT on the GPU, mtp_trt/trt/runtime.py), an export
    directory or a checkpoint (ONNX Runtime on the CPU)."""
    path = Path(model) if model else demo_model()
    if (path / "engines.json").is_file():
        from mtp_trt.trt import manifest as em
        from mtp_trt.trt.runtime import TrtBackend

        m = em.load_export_manifest(path)
        if mtp_mode and mtp_mode != m.mtp_mode:
            raise MtpTrtError(f"{path}: engines of a {m.mtp_mode}-mode export, but --mtp-mode {mtp_mode} was asked")
        return Runner(m, TrtBackend(path, cuda_graphs=cuda_graphs))
    return Runner(resolve_export(path, mtp_mode, progress=progress), threads=threads)


@dataclasses.dataclass
class Result:
    prompt: str
    text: str
    tokens: list[int]
    finish_reason: str
    message: str = ""


@dataclasses.dataclass
class RunReport:
    results: list[Result]
    stats: Stats
    seconds: float
    nextn: int

    @property
    def new_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.results)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict:
        return {"new_tokens": self.new_tokens, "seconds": round(self.seconds, 4),
                "tokens_per_second": round(self.tokens_per_second, 2), "nextn": self.nextn,
                "steps": self.stats.steps, "mean_accepted_tokens_per_step": round(self.stats.mean_accepted, 4),
                "acceptance_rate_per_position": [round(a, 4) for a in self.stats.acceptance_rate]}


class Runner:
    """A loaded export, its tokenizer and a backend."""

    def __init__(self, manifest: Manifest, backend: Backend | None = None, threads: int | None = None):
        from tokenizers import Tokenizer

        self.manifest = manifest
        if not manifest.tokenizer:
            raise MtpTrtError(f"{manifest.root}: the export has no tokenizer.json; text prompts need one")
        self.tokenizer = Tokenizer.from_file(str(manifest.root / manifest.tokenizer))
        self.backend = backend or OrtBackend(manifest, threads=threads)

    def options(self, nextn: int | None, **kwargs) -> DecodeOptions:
        m = self.manifest
        nextn = m.nextn if nextn is None else nextn
        if not 0 <= nextn <= m.nextn:
            raise MtpTrtError(f"--nextn must be in 0..{m.nextn} for this export ({m.root}), got {nextn}")
        return DecodeOptions(nextn=nextn, eos_ids=m.eos_ids, think_ids=m.think_ids, **kwargs)

    def encode(self, text: str) -> list[int]:
        """Prompt ids, starting with the model's BOS token when it has one and the tokenizer did not add it."""
        ids = self.tokenizer.encode(text).ids
        if not ids:
            raise MtpTrtError("empty prompt: give some text with --prompt")
        bos = self.manifest.config.bos_token_id
        return ids if bos is None or ids[0] == bos else [bos, *ids]

    def decode(self, tokens: list[int]) -> str:
        """Text of generated tokens; special tokens such as <think> are shown, the final EOS is not."""
        if tokens and tokens[-1] in self.manifest.eos_ids:
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def run(self, prompts: list[str], opts: DecodeOptions, seed: int = 0, stop: tuple[str, ...] = (),
            on_text: Callable[[int, str], None] | None = None) -> RunReport:
        """Decode the prompts as one batch.  on_text(i, new_text) streams each sequence's new text."""
        shown = [0] * len(prompts)

        def on_step(seqs: list[Sequence]) -> None:
            for i, s in enumerate(seqs):
                text = self.decode(s.generated)
                if stop and s.finish_reason is None and any(x in text for x in stop):
                    s.finish_reason = "stop"
                if on_text and len(text) > shown[i] and not text.endswith("\ufffd"):
                    on_text(i, text[shown[i]:])
                    shown[i] = len(text)

        ids = [self.encode(p) for p in prompts]
        self.backend.prepare(opts.nextn, opts.sampling.greedy)  # graph loading is not decoding time
        t0 = time.perf_counter()
        seqs, stats = generate(self.backend, ids, opts, seed=seed, on_step=on_step)
        seconds = time.perf_counter() - t0
        results = []
        for p, s in zip(prompts, seqs):
            text = self.decode(s.generated)
            for x in stop:
                if x in text:
                    text = text[: text.index(x)]
            results.append(Result(p, text, s.generated, s.finish_reason or "length", s.message))
        return RunReport(results, stats, seconds, opts.nextn)
