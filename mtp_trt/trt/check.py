"""`mtp-trt check`: run the engines of an engine directory and compare them with ONNX Runtime.

Always: the static checks (engines.json, the SHA-256 of every engine, the export manifest it was
built from, the plugin versions it needs).  Where a GPU and the engine's TensorRT flavour are
present: for every engine and profile, random inputs of a representative shape (seeded; lengths
valid for the cache), the engine (polygraphy's TrtRunner, plugins registered) and ONNX Runtime
on the `onnx`-lowering export of the same checkpoint (fp32), compared with polygraphy's
Comparator on the outputs both graphs have; then greedy decoding end to end (TrtBackend against
OrtBackend, nextn 0..K): fp32 engines must give the same tokens, fp16/bf16 report the agreement.
Elsewhere the result is "skipped" with the reason.

Exit codes (CLI): 0 passed, 1 outputs differ, 2 bad input, 3 skipped (static checks passed, but
nothing could be run here).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mtp_trt import contract as C
from mtp_trt.errors import MtpTrtError
from mtp_trt.manifest import Manifest, check_files, check_seal, sha256
from mtp_trt.trt import manifest as em
from mtp_trt.plugins import ort_lib

EXIT_CODES = {"passed": 0, "failed": 1, "skipped": 3}
# (atol, rtol) of float outputs by engine precision.  fp32: the same math in another order;
# fp16/bf16 engines against the fp32 reference: rounding of weights and activations.
TOLERANCES = {"fp32": (1e-3, 1e-3), "fp16": (5e-2, 5e-2), "bf16": (2e-1, 1e-1)}


@dataclasses.dataclass
class CheckResult:
    status: str  # passed | failed | skipped
    reason: str = ""
    lines: list[str] = dataclasses.field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]


def static_checks(engine_dir: Path) -> tuple[em.EngineManifest, list[str]]:
    from mtp_trt.plugins import trt_plugins

    m = em.EngineManifest.load(engine_dir, verify_hashes=True)
    lines = [f"{em.FILE}: {len(m.engines)} engines, {m.flavour} {m.trt_version}, {m.precision}, "
             f"targets {', '.join(m.target_archs)}; SHA-256 of every engine verified"]
    exp = engine_dir / em.EXPORT_MANIFEST
    if not exp.is_file():
        raise MtpTrtError(f"{engine_dir}: {em.EXPORT_MANIFEST} is missing")
    if sha256(exp) != m.raw["export"]["manifest_sha256"]:
        raise MtpTrtError(f"{exp}: SHA-256 differs from {em.FILE}; the engine directory was modified")
    export = em.load_export_manifest(engine_dir)
    check_seal(exp, export.raw)
    m.check_export(export)
    check_files(exp, list((export.raw.get("tokenizer_files") or {}).items()), True, "export")
    for p in m.plugins:
        if p["version"] != trt_plugins.PLUGIN_VERSION:
            raise MtpTrtError(f"{em.FILE}: the engines use plugin {p['name']} version {p['version']}, this mtp-trt "
                              f"provides version {trt_plugins.PLUGIN_VERSION}; build the engines again")
    for e in m.engines.values():
        lines.append(f"  {e.file}: {e.bytes / 2**20:.1f} MiB, plugin layers "
                     f"{', '.join(f'{k} x{v}' for k, v in e.plugin_layers.items()) or 'none'}")
    return m, lines


def runtime_unavailable(m: em.EngineManifest) -> str | None:
    """Why the engines cannot be run here, or None."""
    from mtp_trt.trt import compat

    cc, why = compat.gpu()
    if cc is None:
        return f"no GPU: {why}; the engines were not run (static checks only)"
    if m.flavour == "tensorrt_rtx" and cc not in m.target_archs:
        return f"this GPU has compute capability {cc}, not among the engines' targets {', '.join(m.target_archs)}"
    try:
        api = compat.load(m.flavour)
    except MtpTrtError as e:
        return f"the engines need {m.flavour}: {e}"
    if api.version != m.trt_version:
        return f"the engines were built with {m.flavour} {m.trt_version}, this machine has {api.version}"
    return None


@dataclasses.dataclass(frozen=True)
class Regime:
    """One comparison of a graph's outputs: past_len at most `max_past`; `enforced`: a difference fails the check
    (else it is reported only)."""
    label: str
    max_past: int
    enforced: bool


def regimes(config, t: int, s: int, precision: str) -> list[Regime]:
    """The per-graph comparisons of check for caches of T rows and S new tokens.  Dense MLA: one, past_len anywhere
    in the cache.  DeepSeek Sparse Attention: `dense`, past_len + 2 S <= index_topk, where every visible row is
    selected (also by the MTP depths a step graph runs after its S rows) and the outputs must agree as dense MLA's;
    then `sparse`, past_len anywhere, where the indexer picks
    rows: enforced for fp32 engines only, since fp16/bf16 engines score keys rounded to their type and may pick
    other rows near the top-k threshold than the fp32 reference (the end-to-end decode comparison follows)."""
    if not getattr(config, "dsa", False):
        return [Regime("", t - s, True)]
    dense = Regime("dense", max(0, min(t - s, config.index_topk - 2 * s)), True)
    if t <= config.index_topk:
        return [dense]
    return [dense, Regime("sparse", t - s, precision == "fp32")]


def make_inputs(graph, dims: dict[str, int], vocab: int, rng: np.random.Generator,
                max_past: int | None = None) -> dict:
    """Random, valid inputs of one graph: ids in the vocabulary, past_len + S <= T (and past_len <= max_past), and
    past_len >= K - 1 for a vanilla step graph (K MTP caches; depth k's window starts at past_len + 1 - k)."""
    b, s, t = dims["B"], dims["S"], dims["T"]
    top = t - s if max_past is None else min(t - s, max_past)
    low = max(sum(spec.name.startswith(C.VANILLA_KV) for spec in graph.inputs) - 1, 0)
    feed = {}
    for spec in graph.inputs:
        shape = [dims[d] if isinstance(d, str) else d for d in spec.shape]
        if spec.name in (C.INPUT_IDS, C.NEXT_TOKENS):
            feed[spec.name] = rng.integers(0, vocab, shape, dtype=np.int32)
        elif spec.name == C.PAST_LEN:
            feed[spec.name] = rng.integers(min(low, top), top + 1, b, dtype=np.int32)
        elif spec.name == C.THINKING:
            feed[spec.name] = rng.integers(0, 2, b, dtype=np.int32)
        elif spec.name == C.RELAXED_TOPK:
            feed[spec.name] = np.array(3, dtype=np.int32)
        elif spec.name == C.RELAXED_DELTA:
            feed[spec.name] = np.array(0.3, dtype=np.float32)
        elif spec.dtype == "int32":
            feed[spec.name] = np.zeros(shape, np.int32)
        else:
            feed[spec.name] = rng.standard_normal(shape, dtype=np.float32)
    return feed


def _to_engine_dtype(feed: dict, graph) -> dict:
    out = {}
    for spec in graph.inputs:
        x = feed[spec.name]
        if spec.dtype == "bf16":
            import torch

            x = torch.from_numpy(x).to(torch.bfloat16)
        else:
            x = x.astype(C.dtype(spec.dtype).host)
        out[spec.name] = x
    return out


def compare(got: dict, ref: dict, precision: str, label: str) -> tuple[bool, list[str]]:
    """polygraphy's Comparator on the outputs both have; ints exactly in fp32 (else reported only)."""
    from polygraphy.comparator import Comparator, CompareFunc, RunResults
    from polygraphy.comparator import compare as compare_mod
    from polygraphy.comparator.struct import IterationResult
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR
    names = [n for n in got if n in ref]
    a = {n: np.asarray(got[n], dtype=np.float32 if np.asarray(got[n]).dtype.kind == "f" else np.int64) for n in names}
    b = {n: np.asarray(ref[n], dtype=a[n].dtype) for n in names}
    atol, rtol = TOLERANCES[precision]
    strict = {n for n in names if a[n].dtype.kind == "f" or precision == "fp32"}
    results = RunResults([("tensorrt", [IterationResult(outputs={n: a[n] for n in strict}, runner_name="tensorrt")]),
                          ("onnxruntime", [IterationResult(outputs={n: b[n] for n in strict},
                                                           runner_name="onnxruntime")])])
    tol = {n: (atol if a[n].dtype.kind == "f" else 0.0) for n in strict}
    rtl = {n: (rtol if a[n].dtype.kind == "f" else 0.0) for n in strict}
    simple = getattr(compare_mod, "SimpleCompareFunc", None) or CompareFunc.simple  # polygraphy < 0.50: .simple
    with np.errstate(divide="ignore", invalid="ignore"):  # relative errors where the reference is 0
        ok = bool(Comparator.compare_accuracy(results, compare_func=simple(atol=tol, rtol=rtl)))
    lines = []
    for n in names:
        if a[n].shape != b[n].shape:
            lines.append(f"  {label} {n}: shape {a[n].shape} vs {b[n].shape}")
            ok = False
        elif a[n].dtype.kind == "f":
            lines.append(f"  {label} {n}: max |diff| {float(np.max(np.abs(a[n] - b[n]), initial=0)):.3g}")
        else:
            lines.append(f"  {label} {n}: {int(np.sum(a[n] != b[n]))}/{a[n].size} differ"
                         + ("" if n in strict else " (not checked below fp32)"))
    return ok, lines


def _reference(exp: Manifest, reference: Path | None, workdir: Path,
               progress: Callable[[str], None]) -> Manifest:
    if reference is not None:
        ref = Manifest.load(reference)
    else:
        ckpt = exp.raw.get("checkpoint")
        if not ckpt or not (Path(ckpt) / "config.json").is_file():
            raise MtpTrtError(f"no reference: the checkpoint {ckpt!r} of the export is not here; pass --reference "
                              f"with an `onnx`-lowering export of it")
        from mtp_trt.exporters.export import export

        progress(f"exporting the onnx-lowering reference of {ckpt}")
        q = exp.quant  # quantized engines: the same quantized weights, in the form TensorRT reads (DequantizeLinear)
        ref = Manifest.load(export(ckpt, workdir / "reference", nextn=exp.nextn, mtp_mode=exp.mtp_mode, dtype="fp32",
                                   lowering="onnx", max_batch=exp.max_batch, max_seq_len=exp.max_seq_len,
                                   moe_form="tensorrt" if q.quantized else None, quant_scheme=q.name,
                                   group_size=q.block_size))
    if ref.lowering != "onnx":
        raise MtpTrtError(f"--reference {ref.root}: needs the onnx lowering (ONNX Runtime cannot run plugin nodes)")
    if ref.raw["config"] != exp.raw["config"] or ref.nextn != exp.nextn or ref.mtp_mode != exp.mtp_mode:
        raise MtpTrtError(f"--reference {ref.root}: not an export of the same checkpoint, K and MTP mode")
    if ref.quant != exp.quant:
        raise MtpTrtError(f"--reference {ref.root}: weights quantized as {ref.quant.tag}, the engines' as "
                          f"{exp.quant.tag}; export the reference with the same --quant and --group-size")
    return ref


def engine_runner(m: em.EngineManifest) -> Callable[[Path, int, dict], dict]:
    """run(engine file, profile index, inputs) -> outputs, with the engines' TensorRT flavour and plugins."""
    from mtp_trt.trt import compat, cpp_plugins

    api = compat.load(m.flavour)
    if api.is_rtx:
        os.environ["POLYGRAPHY_USE_TENSORRT_RTX"] = "1"
        sys.modules.setdefault("tensorrt_rtx", api.trt)  # polygraphy imports it by this name
        import polygraphy.config

        polygraphy.config.USE_TENSORRT_RTX = True
    cpp_plugins.use(api.trt, "auto")
    return functools.partial(_run_engine, api)


def _run_engine(api, engine_path: Path, profile: int, feed: dict) -> dict:
    from polygraphy.backend.trt import TrtRunner

    runtime = api.trt.Runtime(api.trt.Logger(api.trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(engine_path.read_bytes())
    if engine is None:
        raise MtpTrtError(f"{engine_path}: {api.flavour} could not deserialize the engine")
    with TrtRunner(engine, optimization_profile=profile) as runner:
        return {k: host_array(v) for k, v in runner.infer(feed).items()}


def host_array(v) -> np.ndarray:
    """An engine output as NumPy: torch tensors (polygraphy returns them for bf16) go to the host, bf16 as fp32."""
    if hasattr(v, "cpu"):
        import torch

        v = v.detach().cpu()
        return (v.float() if v.dtype == torch.bfloat16 else v).numpy()
    return np.asarray(v)


def engine_backend(engine_dir: Path, ref: Manifest):
    """The TrtBackend that check's end-to-end decoding runs on (tests substitute a host stand-in)."""
    from mtp_trt.trt.runtime import TrtBackend

    return TrtBackend(engine_dir)


def decode_comparison(engines, ref: Manifest, precision: str, seed: int = 0, max_new_tokens: int = 32,
                      progress: Callable[[str], None] = lambda msg: None) -> tuple[bool, list[str]]:
    """Greedy decoding end to end on the engines (a TrtBackend) against ONNX Runtime on the reference export, for
    nextn 0..K, on a small batch of random prompts of different lengths: fp32 engines must give exactly the same
    tokens; fp16/bf16 engines report the share of equal tokens (rounding may flip a near tie)."""
    from mtp_trt.backend import OrtBackend
    from mtp_trt.decode import DecodeOptions, generate

    rng = np.random.default_rng(seed)
    lens = [7, 3, 12][:max(1, min(3, ref.max_batch))]
    prompts = [rng.integers(0, ref.config.vocab_size, n).tolist() for n in lens]
    ok, lines, ort = True, [], OrtBackend(ref)
    for nextn in range(ref.nextn + 1):
        progress(f"greedy decoding, nextn {nextn}: engines and ONNX Runtime")
        opts = DecodeOptions(nextn=nextn, max_new_tokens=max_new_tokens, think_ids=ref.think_ids)
        got, stats = generate(engines, prompts, opts)
        want, _ = generate(ort, prompts, opts)
        pairs = [(a, b) for g, w in zip(got, want) for a, b in zip(g.generated, w.generated)]
        same = sum(a == b for a, b in pairs)
        equal = [g.generated for g in got] == [w.generated for w in want]
        ok &= equal or precision != "fp32"
        lines.append(f"  decode nextn {nextn}: {same}/{max(len(pairs), 1)} tokens equal ONNX Runtime's"
                     f"{'' if equal else ' (differ)'}, {stats.mean_acceptance_length:.2f} tokens per step")
    return ok, lines


def check(engine_dir: str | Path, reference: str | Path | None = None, seed: int = 0,
          progress: Callable[[str], None] = lambda msg: None) -> CheckResult:
    engine_dir = Path(engine_dir)
    progress("static checks")
    m, lines = static_checks(engine_dir)
    if why := runtime_unavailable(m):
        return CheckResult("skipped", why, lines)

    run_engine = engine_runner(m)
    exp = em.load_export_manifest(engine_dir)
    rng = np.random.default_rng(seed)
    ok_all = True
    with tempfile.TemporaryDirectory(prefix="mtp-trt-check-") as work:
        ref = _reference(exp, Path(reference) if reference else None, Path(work), progress)
        for name, e in m.engines.items():
            graph = exp.graphs[name]
            sess = ort_lib.session(str(ref.root / ref.graphs[name].file))
            for i, prof in enumerate(m.profiles):
                d = prof["dims"]
                dims = {"B": min(2, d["B"][2]), "S": d["S"][2] if prof["name"] == "generation" else min(16, d["S"][2]),
                        "T": d["T"][2]}
                for regime in regimes(exp.config, dims["T"], dims["S"], m.precision):
                    label = "/".join(x for x in (name, prof["name"], regime.label) if x)
                    progress(f"{e.file}, {label} (B={dims['B']}, S={dims['S']}, T={dims['T']})")
                    feed = make_inputs(graph, dims, exp.config.vocab_size, rng, regime.max_past)
                    got = run_engine(engine_dir / e.file, i, _to_engine_dtype(feed, graph))
                    ref_out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))
                    ok, out = compare(got, ref_out, m.precision, label)
                    ok_all &= ok or not regime.enforced
                    lines += out if ok or regime.enforced else out + [f"  {label}: differs (reported, not checked "
                                                                      f"below fp32: the selection near the top-k)"]
        ok, out = decode_comparison(engine_backend(engine_dir, ref), ref, m.precision, seed, progress=progress)
        ok_all &= ok
        lines += out
    return CheckResult("passed" if ok_all else "failed", "" if ok_all else "engine outputs differ from ONNX Runtime",
                       lines)
