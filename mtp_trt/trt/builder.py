"""`mtp-trt build`: an export (`plugin` or `onnx` lowering) -> one TensorRT engine per graph + engines.json.

Pipeline: check the request (export format version, lowering, precision, sizes, target
architectures, custom ops) before any work; register the plugins; for each graph parse the ONNX,
check that every custom node became a layer of our plugin, add the optimization profiles
(generation: S = 1..K+1; prefill: S = 1..max_prefill; B = 1..max_batch and T = 1..max_seq_len in
both), build and hash the engine; then write engines.json and rename the finished temporary
directory into place, so a failure or an interrupt leaves no half-written engine directory.
"""

from __future__ import annotations

import collections
import datetime
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from mtp_trt import __version__, ops
from mtp_trt.errors import MtpTrtError
from mtp_trt.plugins.ort_lib import DOMAIN as ORT_CPU_DOMAIN
from mtp_trt.fsutil import atomic_directory, write_atomic
from mtp_trt import contract as C
from mtp_trt.contract import DTYPES, TENSOR_DTYPES
from mtp_trt.manifest import GraphSpec, Manifest, sha256
from mtp_trt.trt import manifest as em
from mtp_trt.trt import plan
from mtp_trt.validate import check_output_dir

DEFAULT_MAX_PREFILL = 512
KERNEL_MAX_BATCH = 65535  # mtp_mla_decode's limit
KERNEL_MIN_ARCH = (8, 0)
FP8_MIN_ARCH = (8, 9)  # FP8 (e4m3) weights: Ada, Hopper, Blackwell
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
ONNX_TYPES = {C.dtype(name).onnx: name for name in TENSOR_DTYPES}  # onnx.TensorProto elem types
Progress = Callable[[str], None]


# ------------------------------------------------------------------------------------- checks
def load_export(export_dir: str | Path) -> Manifest:
    """An export in either lowering: `plugin` (the mtp_trt plugins: in-place cache writes, fused acceptance)
    or `onnx` (standard operators only: engines any TensorRT application loads without our plugins)."""
    m = Manifest.load(export_dir, verify_hashes=True)  # checks format and format version
    if m.config.dsa and m.lowering != "plugin":
        raise MtpTrtError(f"{m.root}: {m.config.architecture} (DeepSeek Sparse Attention) runs in TensorRT engines "
                          "through the MlaSparseAttention plugin only: re-export with --lowering plugin")
    return m


def custom_nodes(model, file: str) -> collections.Counter:
    """Custom-domain nodes of an ONNX model by op name; one clear error for any op without a plugin."""
    versions = {o.domain: o.version for o in model.opset_import}
    if ops.DOMAIN in versions and versions[ops.DOMAIN] != ops.VERSION:
        raise MtpTrtError(f"{file}: custom domain {ops.DOMAIN!r} version {versions[ops.DOMAIN]}, but the plugins "
                          f"implement version {ops.VERSION}; re-export with this mtp-trt")
    found = collections.Counter()
    for node in model.graph.node:
        if node.domain in ("", "ai.onnx"):
            continue
        if node.domain in ("com.microsoft", ORT_CPU_DOMAIN):  # operators of graphs meant for ONNX Runtime
            whose = "ONNX Runtime's" if node.domain == "com.microsoft" else "mtp-trt's CPU operator"
            raise MtpTrtError(f"{file}: node {node.name!r} is {whose} {node.domain}::{node.op_type}, which "
                              f"TensorRT has no layer for; export with --moe-form tensorrt (standard operators only) "
                              f"or --lowering plugin")
        if node.domain != ops.DOMAIN or node.op_type not in ops.OPS:
            known = ", ".join(f"{ops.DOMAIN}::{n}" for n in ops.OPS)
            raise MtpTrtError(f"{file}: node {node.name!r} is the custom op {node.domain}::{node.op_type}, which has "
                              f"no TensorRT plugin (plugins exist for {known})")
        found[node.op_type] += 1
    return found


def onnx_for_parser(path: Path, graph: GraphSpec) -> tuple[bytes, collections.Counter]:
    """The ONNX model as the parser gets it, and its custom nodes.

    Every output must have the type manifest.json declares: the op contract's types are what the
    plugins produce and what TensorRT checks.  Weights in external data stay on disk (the parser
    reads them relative to `path`)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    nodes = custom_nodes(model, path.name)
    declared = {t.name: t.dtype for t in graph.outputs}
    for out in model.graph.output:
        tt = out.type.tensor_type
        want, have = declared.get(out.name), ONNX_TYPES.get(tt.elem_type, str(tt.elem_type))
        if want is not None and want != have:
            raise MtpTrtError(f"{path.name}: output {out.name!r} is {have} in the ONNX file but {want} in "
                              f"manifest.json; export again with this version of mtp-trt")
    return model.SerializeToString(), nodes


def profiles(m: Manifest, max_batch: int, max_seq_len: int, max_prefill: int) -> list[dict]:
    """Optimization profiles: {"name", "dims": {dim: [min, opt, max]}} for the symbolic dims B, S, T."""
    k1 = m.nextn + 1
    return [
        {"name": "generation", "dims": {"B": [1, max_batch, max_batch], "S": [1, k1, k1],
                                        "T": [1, max_seq_len, max_seq_len]}},
        {"name": "prefill", "dims": {"B": [1, 1, max_batch], "S": [1, min(128, max_prefill), max_prefill],
                                     "T": [1, max_seq_len, max_seq_len]}},
    ]


def input_shapes(graph: GraphSpec, profile: dict) -> dict[str, list[list[int]]]:
    """{input: [min, opt, max] shapes} of one graph under a profile."""
    shapes = {}
    for t in graph.inputs:
        shapes[t.name] = [[profile["dims"][d][i] if isinstance(d, str) else d for d in t.shape] for i in range(3)]
    return shapes


def check_request(m: Manifest, precision: str | None, max_batch: int | None, max_seq_len: int | None,
                  max_prefill: int | None) -> tuple[str, int, int, int]:
    precision = precision or m.dtype
    if precision not in DTYPES:
        raise MtpTrtError(f"--precision: unknown precision {precision!r}; expected one of {', '.join(DTYPES)}")
    if precision != m.dtype:
        raise MtpTrtError(f"--precision {precision}: the export is {m.dtype}, and engines are built strongly typed "
                          f"(the types of the ONNX graph, so the plugins' in-place cache writes reach the caller's "
                          f"buffer); re-export with `--dtype {precision} --lowering plugin`")
    max_batch = m.max_batch if max_batch is None else max_batch
    max_seq_len = m.max_seq_len if max_seq_len is None else max_seq_len
    if not 1 <= max_batch <= min(m.max_batch, KERNEL_MAX_BATCH):
        raise MtpTrtError(f"--max-batch must be in 1..{min(m.max_batch, KERNEL_MAX_BATCH)} (the export's max_batch), "
                          f"got {max_batch}; re-export with a larger --max-batch")
    if not 1 <= max_seq_len <= m.max_seq_len:
        raise MtpTrtError(f"--max-seq-len must be in 1..{m.max_seq_len} (the export's max_seq_len), got {max_seq_len}")
    if max_seq_len < m.nextn + 1:
        raise MtpTrtError(f"--max-seq-len {max_seq_len} is shorter than one verification step (K + 1 = {m.nextn + 1})")
    max_prefill = min(DEFAULT_MAX_PREFILL, max_seq_len) if max_prefill is None else max_prefill
    if not 1 <= max_prefill <= max_seq_len:
        raise MtpTrtError(f"--max-prefill must be in 1..{max_seq_len} (--max-seq-len), got {max_prefill}")
    return precision, max_batch, max_seq_len, max_prefill


def check_archs(archs: list[str]) -> None:
    """The kernels need compute capability 8.0+ (cp.async, ldmatrix, bf16 mma.sync)."""
    old = [a for a in archs if a != "ampere+" and tuple(map(int, a.split("."))) < KERNEL_MIN_ARCH]
    if old:
        raise MtpTrtError(f"--target-arch {', '.join(old)}: the mtp-trt kernels need compute capability "
                          f"{'.'.join(map(str, KERNEL_MIN_ARCH))} or newer (cp.async, ldmatrix, bf16 tensor cores)")


# -------------------------------------------------------------------------------------- build
def quant_archs(m: Manifest, archs: list[str], spec: str | None) -> list[str]:
    """The architectures an export's weights can be built for: FP8 weights need compute capability 8.9 or newer
    (TensorRT for RTX refuses FP8 below it).  The default without a GPU (`auto`: every buildable architecture)
    keeps those; any other request naming an older one is refused in one line."""
    if m.quant.name != "fp8":
        return archs
    old = [a for a in archs if a == "ampere+" or tuple(map(int, a.split("."))) < FP8_MIN_ARCH]
    if old and (spec or "auto").strip().lower() == "auto" and len(old) < len(archs):
        return [a for a in archs if a not in old]
    if old:
        raise MtpTrtError(f"--target-arch {', '.join(old)}: the export's FP8 weights (--quant fp8) need compute "
                          f"capability {'.'.join(map(str, FP8_MIN_ARCH))} or newer; build for 8.9 or later, or "
                          f"export with --quant int4 or int8")
    return archs


class _Log:
    """TensorRT's log: kept in memory, written to build.log, errors quoted in exceptions."""

    def __init__(self):
        self.lines: list[str] = []
        self.errors: list[str] = []

    def __call__(self, severity: str, msg: str) -> None:
        self.lines.append(f"[{severity}] {msg}")
        if severity in ("ERROR", "INTERNAL_ERROR"):
            self.errors.append(msg.strip())

    def failure(self, what: str) -> MtpTrtError:
        from mtp_trt.plugins import trt_plugins

        why = [*trt_plugins.errors, *self.errors] or ["no error message from TensorRT"]
        first = " | ".join(dict.fromkeys(w.splitlines()[0] if w else w for w in why[:3]))
        return MtpTrtError(f"{what}: {first[:1500]}")


def _plugin_layers(api, network, file: str) -> collections.Counter:
    """Plugin layers of the parsed network by op name, each checked to hold our plugin object."""
    from mtp_trt.trt import cpp_plugins

    trt, found = api.trt, collections.Counter()
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type in (trt.LayerType.PLUGIN_V2, getattr(trt.LayerType, "PLUGIN", None)):
            raise MtpTrtError(f"{file}: layer {layer.name!r} is a non-V3 plugin layer; expected only mtp_trt plugins")
        if layer.type != trt.LayerType.PLUGIN_V3:
            continue
        layer.__class__ = trt.IPluginV3Layer
        plugin = layer.plugin
        name = (cpp_plugins.plugin_identity(trt, plugin) or (None,))[0]
        if name not in ops.OPS or not cpp_plugins.is_ours(trt, plugin, name):
            raise MtpTrtError(f"{file}: layer {layer.name!r} holds plugin {name!r}, not an mtp-trt plugin")
        found[name] += 1
    return found


def build_graph(api, builder, graph: GraphSpec, path: Path, profs: list[dict], archs: list[str], cache,
                log: _Log, notes: list[str]) -> tuple[bytes, dict[str, int]]:
    trt = api.trt
    data, nodes = onnx_for_parser(path, graph)
    network = builder.create_network(api.network_flags())
    parser = trt.OnnxParser(network, api.make_logger(log))
    if not parser.parse(data, str(path)):
        errs = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        log.errors[:0] = errs
        raise log.failure(f"{path.name}: the TensorRT ONNX parser failed")
    layers = _plugin_layers(api, network, path.name)
    if layers != nodes:
        raise MtpTrtError(f"{path.name}: custom nodes {dict(nodes)} but plugin layers {dict(layers)} in the network; "
                          f"some node was not mapped to its plugin")
    config = builder.create_builder_config()
    api.set_targets(config, archs)
    api.enable_aliased_plugin_io(config)
    for prof in profs:
        p = builder.create_optimization_profile()
        for name, (lo, opt, hi) in input_shapes(graph, prof).items():
            p.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(p)
    if cache is not None:
        config.set_timing_cache(cache, False)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise log.failure(f"{path.name}: {api.flavour} {api.version} could not build the engine for "
                          f"compute capabilit{'ies' if len(archs) > 1 else 'y'} {', '.join(archs)}")
    return bytes(engine), dict(sorted(layers.items()))


def build(export_dir: str | Path, out: str | Path, precision: str | None = None, max_batch: int | None = None,
          max_seq_len: int | None = None, max_prefill: int | None = None, target_arch: str | None = None,
          timing_cache: str | Path | None = None, flavour: str = "auto", plugins: str = "auto",
          progress: Progress = lambda msg: None) -> Path:
    """Build the engines of an export; returns the engine directory.  See the module docstring."""
    from mtp_trt.plugins import trt_plugins
    from mtp_trt.trt import compat, cpp_plugins

    out = Path(out)
    m = load_export(export_dir)
    precision, max_batch, max_seq_len, max_prefill = check_request(m, precision, max_batch, max_seq_len, max_prefill)
    check_output_dir(out)  # absent or empty, and creatable: before any TensorRT work
    import onnx

    for g in m.graphs.values():  # unknown custom ops: before any TensorRT work
        custom_nodes(onnx.load(str(m.root / g.file), load_external_data=False), g.file)
    api = compat.load(flavour)
    archs = quant_archs(m, api.resolve_archs(target_arch), target_arch)
    check_archs(archs)
    impl = cpp_plugins.use(api.trt, plugins)  # "cpp" or "python"
    progress(f"{api.flavour} {api.version}: {impl} plugins")
    trt_plugins.errors.clear()
    log = _Log()
    builder = api.trt.Builder(api.make_logger(log))
    if builder is None:
        raise log.failure(f"{api.flavour} {api.version} could not create a builder")
    timing_cache, cache, notes = Path(timing_cache) if timing_cache else None, None, []
    if timing_cache and api.is_rtx:
        notes.append(f"--timing-cache {timing_cache}: ignored, timing caches are no-ops in TensorRT for RTX")
        timing_cache = None
    elif timing_cache:
        data = timing_cache.read_bytes() if timing_cache.is_file() else b""
        cache = builder.create_builder_config().create_timing_cache(data)
    profs = profiles(m, max_batch, max_seq_len, max_prefill)
    with atomic_directory(out) as tmp:
        engines = {}
        for name, g in m.graphs.items():
            progress(f"building {name}.engine ({', '.join(archs)}; {len(profs)} profiles)")
            t0 = time.perf_counter()
            data, layers = build_graph(api, builder, g, m.root / g.file, profs, archs, cache, log, notes)
            (tmp / f"{name}.engine").write_bytes(data)
            engines[name] = {"file": f"{name}.engine", "sha256": sha256(tmp / f"{name}.engine"), "bytes": len(data),
                             "onnx": g.file, "onnx_sha256": g.sha256, "plugin_layers": layers,
                             "aliases": plan.engine_io(g, m.lowering).aliases,
                             "build_seconds": round(time.perf_counter() - t0, 2)}
        progress(f"writing {out}")
        manifest = {
            "format": em.FORMAT, "format_version": em.FORMAT_VERSION, "mtp_trt_version": __version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "tensorrt": {"flavour": api.flavour, "version": api.version, "module": api.module},
            "target_archs": archs, "built_on": compat.gpu()[0], "lowering": m.lowering,
            "precision": precision, "max_batch": max_batch, "max_seq_len": max_seq_len,
            "max_prefill": max_prefill,
            "export": {"dir": str(m.root.resolve()), "format_version": m.raw["format_version"],
                       "manifest_sha256": sha256(m.root / "manifest.json"), "lowering": m.lowering, "dtype": m.dtype,
                       "nextn": m.nextn, "mtp_mode": m.mtp_mode, "checkpoint": m.raw.get("checkpoint")},
            "profiles": [{**p, "inputs": {g: input_shapes(m.graphs[g], p) for g in m.graphs}} for p in profs],
            "plugins": [{"name": op.name, "version": trt_plugins.PLUGIN_VERSION,
                         "namespace": trt_plugins.PLUGIN_NAMESPACE, "onnx_domain": ops.DOMAIN,
                         "implementation": cpp_plugins.DESCRIPTIONS[impl]} for op in ops.OPS.values()],
            "engines": engines, "notes": notes,
        }
        (tmp / em.FILE).write_text(em.dumps(manifest))
        shutil.copyfile(m.root / "manifest.json", tmp / em.EXPORT_MANIFEST)
        for f in TOKENIZER_FILES:
            if (m.root / f).is_file():
                shutil.copyfile(m.root / f, tmp / f)
        (tmp / "build.log").write_text("\n".join(log.lines) + "\n")
        if timing_cache:
            write_atomic(timing_cache, bytes(cache.serialize()))
    return out

