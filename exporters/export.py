"""`mtp-trt export`: checkpoint -> target.onnx + MTP graph(s) + manifest.json, written atomically.

Pipeline: check the request, the tokenizer files and every checkpoint tensor's name, dtype and shape (from
the headers), then every tensor's values in one streamed pass (NaN, infinities, FP8 scales), all before
anything is exported (within the caller's first stage of progress, `loading torch, checking the checkpoint`);
trace each graph on placeholder weights (TorchScript ONNX exporter, opset 18, dynamic B / S / T; the
weights as inputs), fold it as torch would and stream the weights it reads into the one weights.bin
shared by all graphs, each distinct tensor once (exporters/streaming.py: the model is never held, so
the peak memory is a few times the largest tensor, not the model's size); check each graph
(onnx.checker, strict shape inference), hash the files, write the manifest and the tokenizer files,
then rename the finished temporary directory into place.  A failure or an interrupt leaves nothing
at the output path.
"""

from __future__ import annotations

import contextlib
import io as io_module
import json
import shutil
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path

import onnx
import torch

from mtp_trt import ops, quant
from mtp_trt.config import ModelConfig
from mtp_trt.errors import MtpTrtError
from mtp_trt.fsutil import atomic_directory, read_json
from mtp_trt.exporters.graphs import MtpGraph, StepGraph, TargetGraph, VanillaStepGraph
from mtp_trt.exporters.lowering import LOWERINGS
from mtp_trt.exporters.moe import FORMS as MOE_FORMS
from mtp_trt.exporters.quantize import QuantValue, quantize_graph
from mtp_trt.exporters.tree import TreeStepGraph
from mtp_trt.exporters.tree_vanilla import VanillaTreeStepGraph
from mtp_trt.exporters.loader import CheckpointTensors, checkpoint_names, checkpoint_tensors
from mtp_trt.exporters.model import DeepseekV3, rope_tables
from mtp_trt.exporters.streaming import (WeightStore, evaluate, external_initializer, fold_graph, initializer,
                                         placeholder_model, freed_memory_returned)
from mtp_trt.tokenizer import chat_renderer, check_vocab, load_tokenizer, read_tokenizer_config
from mtp_trt.config import MAX_NEXTN
from mtp_trt.validate import (cache_bytes, check_dsa, check_export_memory, check_memory, check_mtp_modules,
                              check_output_dir)
from mtp_trt import contract as C
from mtp_trt.contract import DTYPES
from mtp_trt.manifest import FORMAT, FORMAT_VERSION, MTP_MODES, seal, sha256
OPSET = 18
DEFAULT_MAX_SEQ_LEN = 4096
WEIGHTS_FILE, INLINE_BYTES, WEIGHTS_ALIGN = "weights.bin", 1024, 4096
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
Progress = Callable[[str], None]


def _example(spec: dict, cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    """A small example input (B=2, S=3, T=8) for tracing, the same on every export (seeded by its name: the
    traced values steer nothing, but an export that differs run to run would be hard to compare)."""
    dims = {"B": 2, "S": 3, "T": 8}
    shape = [dims.get(d, d) for d in spec["shape"]]  # fixed dims (the step graph's K + 1) stay as they are
    gen = torch.Generator().manual_seed(zlib.crc32(spec["name"].encode()))
    if spec["name"] in (C.INPUT_IDS, C.NEXT_TOKENS):
        return torch.randint(0, cfg.vocab_size, shape, dtype=torch.int32, generator=gen)
    if spec["name"] == C.PAST_LEN:
        return torch.tensor([5, 2], dtype=torch.int32)
    if spec["name"] == C.RELAXED_TOPK:
        return torch.tensor(3, dtype=torch.int32)
    if spec["name"] == C.RELAXED_DELTA:
        return torch.tensor(0.5, dtype=torch.float32)
    if spec["dtype"] == "int32":
        return torch.zeros(shape, dtype=torch.int32)
    return torch.randn(shape, dtype=dtype, generator=gen)


class _WeightsAsInputs(torch.nn.Module):
    """A graph module whose parameters are passed as trailing inputs: torch then sees no parameter values at all
    (its ONNX shape inference would copy each), only inputs of fixed shapes.  (torch.func.functional_call does
    this swap too, but refuses to run under the tracer.)"""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.inner = [module]  # a list: not a submodule, so this wrapper has no parameters of its own
        named = dict(module.named_parameters())  # shared parameters once, under their first name
        self.names = list(named)
        index = {id(p): i for i, p in enumerate(named.values())}
        self.slots = [(m, key, index[id(p)]) for m in module.modules() for key, p in m._parameters.items()
                      if p is not None]

    def forward(self, *args):
        n = len(args) - len(self.names)
        weights, saved = args[n:], [m._parameters[key] for m, key, _ in self.slots]
        try:
            for m, key, i in self.slots:
                m._parameters[key] = weights[i]
            return self.inner[0](*args[:n])
        finally:
            for (m, key, _), p in zip(self.slots, saved):
                m._parameters[key] = p


@contextlib.contextmanager
def _one_thread():
    """torch on one thread while it lasts.  Tracing runs thousands of tiny operators (the example inputs are
    B=2, S=3, the weights placeholders) and torch's exporter passes; on several threads each operator pays for
    waking and joining the others, which costs several times the work itself (on a busy machine, tens of
    milliseconds an operator).  The weights are computed afterwards, on all threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _trace(module: torch.nn.Module, io: tuple[list[dict], list[dict]], cfg: ModelConfig, dtype: torch.dtype,
           lowering: str) -> onnx.ModelProto:
    """The graph as torch.onnx traces it on the placeholder weights: parameters as inputs named as the
    module's parameters, nothing folded (streaming.fold_graph folds); on one thread (_one_thread)."""
    inputs, outputs = io
    wrapper = _WeightsAsInputs(module)
    args = tuple(_example(s, cfg, dtype) for s in inputs) + tuple(p for _, p in module.named_parameters())
    axes = {s["name"]: {i: d for i, d in enumerate(s["shape"]) if isinstance(d, str)} for s in inputs + outputs}
    buf = io_module.BytesIO()
    with warnings.catch_warnings(), torch.no_grad(), _one_thread():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer notices
        torch.onnx.export(wrapper, args, buf, dynamo=False, opset_version=OPSET, do_constant_folding=False,
                          input_names=[s["name"] for s in inputs] + wrapper.names,
                          output_names=[s["name"] for s in outputs], dynamic_axes=axes,
                          custom_opsets={ops.DOMAIN: ops.VERSION} if lowering == "plugin" else None)
    return onnx.load_from_string(buf.getvalue())


def _export_graph(module: torch.nn.Module, io: tuple[list[dict], list[dict]], path: Path, cfg: ModelConfig,
                  dtype: torch.dtype, lowering: str, params: dict[str, torch.Tensor],
                  read: Callable[[str], torch.Tensor], store: WeightStore, scheme: quant.Scheme) -> list:
    """Trace, fold (streaming.fold_graph), write the weights it reads into `store`, save, check.  Initializers
    and Constant values of at least INLINE_BYTES go to weights.bin, at page-aligned offsets; smaller ones (shapes,
    indices) stay in the graph file.  -> the manifest's table for this file: [name, offset, bytes, ONNX data
    type, dims] of each tensor it reads from weights.bin (OrtBackend maps weights.bin once for all sessions)."""
    model = _trace(module, io, cfg, dtype, lowering)
    needed, values = fold_graph(model, params)
    if scheme.quantized:
        needed, values = quantize_graph(model, needed, values, scheme, tensorrt=not module.fused)
    graph, table = model.graph, []
    if [i.name for i in graph.input] != [s["name"] for s in io[0]]:  # every parameter recognized as one
        raise RuntimeError(f"{path.name}: graph inputs {[i.name for i in graph.input]} after folding")

    def external(name: str, key, compute) -> onnx.TensorProto:
        entry = store.put(key, compute)
        table.append([name, *entry])
        return external_initializer(name, WEIGHTS_FILE, *entry)

    for name in needed:
        v = values[name]
        compute = ((lambda v=v: v.compute(read)) if isinstance(v, QuantValue)  # noqa: E731
                   else lambda v=v: evaluate(v, read))
        small = v.tensor.numel() * v.tensor.element_size() < INLINE_BYTES
        graph.initializer.append(initializer(name, compute()) if small else external(name, v.key, compute))
    for node in [n for n in graph.node if n.op_type == "Constant" and n.attribute[0].name == "value"]:
        if len(node.attribute[0].t.raw_data) >= INLINE_BYTES:  # a large constant becomes an initializer
            v = values[node.output[0]]
            graph.initializer.append(external(node.output[0], v.key, lambda v=v: v.tensor))
            graph.node.remove(node)
    path.write_bytes(model.SerializeToString())
    onnx.checker.check_model(str(path))
    inferred = path.with_suffix(".inferred")  # strict shape inference as a check; the graph is kept as written
    try:
        onnx.shape_inference.infer_shapes_path(str(path), str(inferred), check_type=True, strict_mode=True)
    finally:
        inferred.unlink(missing_ok=True)
    return table


def special_token_ids(ckpt: Path) -> tuple[tuple[int, int], str | None]:
    """(<think>, </think>) ids from tokenizer.json (-1 when absent) and the tokenizer file name."""
    tok = ckpt / "tokenizer.json"
    if not tok.is_file():
        return (-1, -1), None
    raw = read_json(tok, {"added_tokens?": [{"content": str, "id": int}]})
    added = {t["content"]: t["id"] for t in raw.get("added_tokens") or []}
    return (added.get("<think>", -1), added.get("</think>", -1)), tok.name


def eos_token_ids(ckpt: Path, cfg: ModelConfig) -> tuple[int, ...]:
    gen = ckpt / "generation_config.json"
    raw = read_json(gen) if gen.is_file() else {}
    if not isinstance(raw, dict):
        raise MtpTrtError(f"{gen}: expected a JSON object, got a {type(raw).__name__}")
    eos = raw.get("eos_token_id")
    if eos is None:
        return cfg.eos_token_ids
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < cfg.vocab_size for i in ids):
        raise MtpTrtError(f"{gen}: field 'eos_token_id' must be token ids in 0..{cfg.vocab_size - 1}, got {eos!r}")
    return tuple(ids)


def check_request(ckpt: Path, out: Path, nextn: int | None, mtp_mode: str, dtype: str, lowering: str,
                  max_batch: int, max_seq_len: int | None) -> tuple[ModelConfig, int, int]:
    """Validate everything before any work: one clear error per bad value.  -> (config, nextn, max_seq_len)."""
    if not ckpt.is_dir():
        raise MtpTrtError(f"{ckpt}: checkpoint directory not found")
    cfg = ModelConfig.from_file(ckpt / "config.json")
    check_mtp_modules(ckpt, cfg)  # before --nextn is judged against the config's count
    if max_seq_len is None:
        max_seq_len = min(DEFAULT_MAX_SEQ_LEN, cfg.max_position_embeddings)
    if mtp_mode not in MTP_MODES:
        raise MtpTrtError(f"--mtp-mode: unknown mode {mtp_mode!r}; expected one of {', '.join(MTP_MODES)}")
    if dtype not in DTYPES:
        raise MtpTrtError(f"--dtype: unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    if lowering not in LOWERINGS:
        raise MtpTrtError(f"--lowering: unknown lowering {lowering!r}; expected one of {', '.join(LOWERINGS)}")
    have = cfg.num_nextn_predict_layers
    nextn = have if nextn is None else nextn
    if not 0 <= nextn <= MAX_NEXTN:
        raise MtpTrtError(f"--nextn must be in 0..{MAX_NEXTN} (one step graph per value up to it), got {nextn}")
    if mtp_mode == "vanilla" and nextn > have:
        raise MtpTrtError(f"--nextn {nextn} needs {nextn} MTP modules in vanilla mode, but {ckpt / 'config.json'} "
                          f"has num_nextn_predict_layers = {have}; use --nextn <= {have} or --mtp-mode eagle")
    if nextn > 0 and have == 0:
        raise MtpTrtError(f"--nextn {nextn}: {ckpt / 'config.json'} has no MTP modules (num_nextn_predict_layers = 0)")
    if max_batch < 1:
        raise MtpTrtError(f"--max-batch must be >= 1, got {max_batch}")
    if not 1 <= max_seq_len <= cfg.max_position_embeddings:
        raise MtpTrtError(f"--max-seq-len must be in 1..{cfg.max_position_embeddings} (max_position_embeddings), "
                          f"got {max_seq_len}")
    if max_seq_len < 2 * nextn + 3:
        raise MtpTrtError(f"--max-seq-len {max_seq_len} leaves no room for a prompt with --nextn {nextn} (a decode "
                          f"step needs 2 nextn + 2 rows)")
    size = C.dtype(dtype).itemsize
    check_memory(cache_bytes(cfg, cfg.num_hidden_layers + max(nextn, 1), max_batch, max_seq_len, size) +
                 8 * max_seq_len * cfg.qk_rope_head_dim,
                 f"--max-batch {max_batch} x --max-seq-len {max_seq_len}: the caches the export is made for")
    check_output_dir(out)
    check_tokenizer_files(ckpt, cfg)
    check_export_memory(cfg, C.dtype(dtype).itemsize, str(ckpt / "config.json"))
    return cfg, nextn, max_seq_len


def check_tokenizer_files(ckpt: Path, cfg: ModelConfig) -> None:
    """Every file the export copies beside the graphs (TOKENIZER_FILES) read as `run` and `serve` will read it,
    so that a broken one is named in the checkpoint now, not in the export later: tokenizer.json (its ids within
    vocab_size), tokenizer_config.json (its fields' types; the chat template compiling where jinja2, the serve
    extra's, is installed) and generation_config.json (its EOS ids)."""
    import importlib.util

    tok = ckpt / "tokenizer.json"
    if tok.is_file():
        check_vocab(load_tokenizer(tok), cfg.vocab_size, tok)
    read_tokenizer_config(ckpt)
    if importlib.util.find_spec("jinja2") is not None:
        chat_renderer(ckpt)
    eos_token_ids(ckpt, cfg)


def tree_shapes(trees: str | None, nextn: int) -> tuple:
    """The tree step graphs an export carries (see export)."""
    from mtp_trt import tree

    if trees is None:
        return tuple(t for t in tree.DEFAULT_TREES if t.depth <= nextn)
    shapes = tree.parse_trees(trees)
    deep = [t.spec for t in shapes if t.depth > nextn]
    if deep:
        raise MtpTrtError(f"--trees {','.join(deep)}: a tree's depth must be at most --nextn ({nextn})")
    return shapes


class ParamReader:
    """A checkpoint's parameters by graph input name: `read(name)` in the export's dtype (FP8 dequantized), and
    `read.fp8(name)` an FP8 parameter as stored (loader.CheckpointTensors.fp8; None for a float one; `is_fp8`
    says which from the headers), and `read.float32(name)`."""

    def __init__(self, tensors: CheckpointTensors, by_input: dict[str, str]):
        self.tensors, self.by_input = tensors, by_input

    def __call__(self, name: str) -> torch.Tensor:
        return self.tensors.get(self.by_input[name])

    def fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.tensors.fp8(self.by_input[name])

    def is_fp8(self, name: str) -> bool:
        return self.tensors.is_fp8(self.by_input[name])

    def float32(self, name: str) -> torch.Tensor:
        """The parameter in float32 whatever the export's dtype (what --quant fp8 quantizes, the same for every
        dtype)."""
        return self.tensors.get(self.by_input[name], torch.float32)

    @property
    def block(self) -> tuple[int, int]:
        """The checkpoint's FP8 block shape (rows, columns)."""
        return self.tensors.block


def _placeholders(ckpt: Path, cfg: ModelConfig, modules: int, dtype: torch.dtype, max_seq_len: int
                  ) -> tuple[DeepseekV3, dict[str, torch.Tensor], ParamReader]:
    """The model to trace, on placeholder weights (streaming.py); its parameters by graph input name (meta); and
    a reader of each by graph input name from the checkpoint, for when the graphs' weights are written (every
    name, dtype and shape is checked now, from the headers)."""
    with torch.device("meta"):
        model = DeepseekV3(cfg, nextn=modules, max_positions=1).to(dtype)
    names = {id(p): name for name, p in checkpoint_names(model).items()}
    tensors = checkpoint_tensors(ckpt, cfg, model, dtype)
    # graph input name (the graph modules hold the model as `model`) -> checkpoint name, via the parameter
    by_input = {f"model.{name}": names[id(p)] for name, p in model.named_parameters()}
    params = {name: torch.empty(p.shape, dtype=p.dtype, device="meta") for name, p in model.named_parameters()}
    model = placeholder_model(model)
    model.rope_cos, model.rope_sin = rope_tables(cfg, max_seq_len)
    return model, {f"model.{n}": t for n, t in params.items()}, ParamReader(tensors, by_input)


def export(ckpt: str | Path, out: str | Path, nextn: int | None = None, mtp_mode: str = "eagle",
           dtype: str = "fp32", lowering: str = "onnx", max_batch: int = 8, max_seq_len: int | None = None,
           progress: Progress = lambda msg: None, moe_form: str | None = None, trees: str | None = None,
           cpu_ops: bool | None = None, quant_scheme: str = "none", group_size: int | None = None) -> Path:
    """Export a checkpoint; returns the output directory.  See the module docstring.  moe_form: one of
    exporters/moe.py FORMS for every graph (benchmarks compare them), or "tensorrt" (standard operators only:
    gather in the few-token step graphs, static elsewhere, as the plugin lowering does; for plugin-free
    TensorRT engines of an onnx-lowering export), instead of the lowering's choice.  trees: the tree step graphs
    to export, 'D:k:N,...' (mtp_trt/tree.py; default: tree.DEFAULT_TREES up to depth nextn).  cpu_ops: mtp-trt's
    CPU operators (plugins/ort: MLA attention and MoE as one node each) in every graph; None: where they can be
    used (onnx lowering, fp32, the lowering's MoE form) and the operator library is available here.
    quant_scheme, group_size: block-quantized weights (mtp_trt/quant.py, exporters/quantize.py), which run on those
    operators; "fp8" for TensorRT's graphs only (an FP8 checkpoint's e4m3 bytes and block scales kept)."""
    if moe_form not in (None, "tensorrt", *MOE_FORMS):
        raise MtpTrtError(f"--moe-form: unknown form {moe_form!r}; expected tensorrt, {', '.join(MOE_FORMS)}")
    ckpt, out = Path(ckpt), Path(out)
    scheme = quant.scheme(quant_scheme, group_size)
    cfg, nextn, max_seq_len = check_request(ckpt, out, nextn, mtp_mode, dtype, lowering, max_batch, max_seq_len)
    check_dsa(cfg, ckpt, lowering, moe_form, scheme)
    cpu_ops = check_cpu_ops(cpu_ops, lowering, dtype, moe_form, scheme)
    shapes = tree_shapes(trees, nextn)
    modules = (nextn if mtp_mode == "vanilla" else min(nextn, 1))
    tdtype = C.dtype(dtype).torch_dtype()
    with freed_memory_returned():
        return _export(ckpt, out, cfg, nextn, modules, mtp_mode, dtype, tdtype, lowering, max_batch, max_seq_len,
                       progress, moe_form, shapes, cpu_ops, scheme)


def check_cpu_ops(cpu_ops: bool | None, lowering: str, dtype: str, moe_form: str | None,
                  scheme: quant.Scheme = quant.Scheme()) -> bool:
    """Whether the export uses mtp-trt's CPU operators (export's `cpu_ops`); an MtpTrtError where asked for and
    not possible.  Quantized weights need them, unless the graphs are for TensorRT."""
    from mtp_trt.plugins import ort_lib

    why = ("they run on ONNX Runtime: --lowering onnx" if lowering != "onnx" else
           "they compute in float32: --dtype fp32" if dtype != "fp32" else
           f"--moe-form {moe_form} asks for another MoE" if moe_form not in (None, "cpu") else
           ort_lib.available()[1])
    if scheme.quantized and (lowering == "plugin" or moe_form == "tensorrt"):
        return False  # graphs for TensorRT: weights dequantized by DequantizeLinear nodes (exporters/quantize.py)
    if scheme.name == "fp8":
        raise MtpTrtError("--quant fp8: FP8 weights are for TensorRT engines: export with --lowering plugin or "
                          "--moe-form tensorrt (on ONNX Runtime's CPU path use --quant int8 or int4)")
    if scheme.quantized:
        if cpu_ops is False:
            raise MtpTrtError(f"--quant {scheme.name}: quantized weights run on mtp-trt's CPU operators; drop "
                              f"--no-cpu-ops")
        if why:
            raise MtpTrtError(f"--quant {scheme.name}: quantized weights run on mtp-trt's CPU operators, which cannot "
                              f"be used here: {why}")
        return True
    if cpu_ops is None:
        return not why
    if cpu_ops and why:
        raise MtpTrtError(f"--cpu-ops: mtp-trt's CPU operators cannot be used: {why}")
    return cpu_ops


def configure(module, moe_form: str | None, cpu_ops: bool, scheme: quant.Scheme = quant.Scheme()):
    """A graph module (exporters/graphs.py) set up for the export's MoE form, operators and quantization; returns
    it."""
    module.fold = not scheme.quantized  # quantized: every projection a quantized matmul (graphs._Graph.fold)
    module.moe = ("gather" if module.few_tokens else "static") if moe_form == "tensorrt" else moe_form or module.moe
    module.fused = module.fused and moe_form != "tensorrt"  # ONNX Runtime's fused operators: not in TensorRT
    if cpu_ops:  # mtp-trt's CPU operators: MoE (unless another form was asked for) and attention (DSA's included)
        module.cpu, module.moe = True, moe_form or "cpu"
        # the dense MLPs too where quantized (a float MLP keeps ONNX Runtime's MatMul over pre-packed weights)
        module.cpu_mlp = scheme.quantized and module.moe == "cpu"
    return module


def graph_module(model: DeepseekV3, name: str, mtp_mode: str, lowering: str, think_ids) -> torch.nn.Module:
    """The module traced for graph `name` of the contract (mtp_trt/contract.py)."""
    if name == C.TARGET:
        return TargetGraph(model, lowering, think_ids)
    kind, _, index = name.partition("_")
    if kind == "mtp":
        return MtpGraph(model, int(index), lowering)
    if kind == "step":
        n = int(index)
        if mtp_mode == "vanilla" and n > 0:
            return VanillaStepGraph(model, n, lowering, think_ids)
        return StepGraph(model, n, lowering, think_ids)
    tree_graph = VanillaTreeStepGraph if mtp_mode == "vanilla" else TreeStepGraph
    return tree_graph(model, *C.tree_dims(name), lowering, think_ids)


def _export(ckpt: Path, out: Path, cfg: ModelConfig, nextn: int, modules: int, mtp_mode: str, dtype: str,
            tdtype: torch.dtype, lowering: str, max_batch: int, max_seq_len: int, progress: Progress,
            moe_form: str | None, shapes: tuple, cpu_ops: bool, scheme: quant.Scheme) -> Path:
    model, params, read = _placeholders(ckpt, cfg, modules, tdtype, max_seq_len)  # every tensor's header checked
    read.tensors.scan()  # and every value, streamed: all before the first graph's line of progress
    think_ids, tokenizer = special_token_ids(ckpt)
    with atomic_directory(out) as tmp, WeightStore(tmp / WEIGHTS_FILE, WEIGHTS_ALIGN) as store:
        contract = C.graph_contract(cfg, nextn, modules, mtp_mode, dtype, lowering,
                                    tuple((t.depth, t.topk, t.budget) for t in shapes))
        graphs, tables = {}, {}
        for name, io in contract.items():
            progress(f"exporting {name}.onnx")
            module = configure(graph_module(model, name, mtp_mode, lowering, think_ids), moe_form, cpu_ops,
                               scheme).eval()
            table = _export_graph(module, (io["inputs"], io["outputs"]), tmp / f"{name}.onnx", cfg, tdtype, lowering,
                                  params, read, store, scheme)
            tables[f"{name}.onnx"] = table
            graphs[name] = {"file": f"{name}.onnx", **io}
        progress(f"hashing {WEIGHTS_FILE}")
        store.close()
        weights = {"file": WEIGHTS_FILE, "sha256": sha256(tmp / WEIGHTS_FILE), "bytes": (tmp / WEIGHTS_FILE).stat().st_size,
                   "tensors": store.tensors, "initializers": tables}
        for g in graphs.values():
            g["sha256"] = sha256(tmp / g["file"])
        tokenizer_files = {}
        for f in TOKENIZER_FILES:
            if (ckpt / f).is_file():
                shutil.copyfile(ckpt / f, tmp / f)
                tokenizer_files[f] = sha256(tmp / f)
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "checkpoint": str(ckpt.resolve()),
            "config": read_json(ckpt / "config.json"), "nextn": nextn, "mtp_mode": mtp_mode,
            "dtype": dtype, "lowering": lowering, "moe_form": moe_form or "auto", "cpu_ops": cpu_ops,
            "quant": scheme.as_dict(),
            "max_batch": max_batch, "max_seq_len": max_seq_len, "trees": [t.spec for t in shapes],
            "opset": OPSET, "graphs": graphs, "weights": weights, "think_ids": list(think_ids),
            "eos_ids": list(eos_token_ids(ckpt, cfg)), "tokenizer": tokenizer, "tokenizer_files": tokenizer_files,
            "cache": {"layout": "[B, T, kv_lora_rank + qk_rope_head_dim]: normed c_kv then roped k_pe" if not cfg.dsa
                      else "[B, T, kv_lora_rank + qk_rope_head_dim + index_head_dim]: normed c_kv, roped k_pe, then "
                           "the lightning indexer's key",
                      "kv_lora_rank": cfg.kv_lora_rank, "rope_dim": cfg.qk_rope_head_dim, "dtype": dtype,
                      "target_layers": cfg.num_hidden_layers,
                      **({"index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk} if cfg.dsa else {}),
                      "mtp_caches": modules, "rows_per_sequence": max_seq_len},
        }
        (tmp / "manifest.json").write_text(json.dumps(seal(manifest), indent=2) + "\n")
        progress(f"writing {out}")
    return out
