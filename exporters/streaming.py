"""Exporting without holding the model: graphs traced on placeholder weights, weights streamed to weights.bin.

The export's peak memory is a fixed overhead (Python, torch, one traced graph) plus a few times a layer's
largest tensors (a MoE layer's stacked experts, computed once while tracing and once while writing; the
embedding): not the model's size, so a checkpoint larger than memory exports.

1. `placeholder_model`: the reference model with every parameter a view of one anonymous zero mapping the
   size of the largest parameter.  Reading it maps the kernel's zero page, so tracing holds no weights,
   only the transient tensors a layer computes from them.  export.py traces each graph with the weights
   passed as inputs named as the model's parameters (torch then sees no weight values: its ONNX shape
   inference copies every parameter it is given) and without torch's constant folding.
2. `fold_graph` does torch's ONNX constant folding itself (torch/csrc/jit/passes/onnx/constant_fold.cpp:
   the same ops, the same conditions, the same aten functions, in the same node order), on shapes only:
   a node of an op in FOLD whose inputs are all parameters, Constant nodes or folded values is folded.
   As in torch, a fold of Constants only becomes a Constant node; a fold reading a parameter becomes an
   initializer, computed only when written: from the checkpoint tensors it depends on (read one at a time,
   loader.CheckpointTensors), then written to weights.bin and dropped.
3. `WeightStore` writes weights.bin for all the graphs of an export: each distinct tensor once (by
   content, page-aligned), and each initializer's recipe (its fold over named parameters) computed once,
   though every graph reads the main model's weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import mmap
from collections.abc import Callable
from pathlib import Path

import onnx
import torch
from onnx import numpy_helper

from mtp_trt.contract import DTYPE_TABLE
from mtp_trt.exporters.model import DeepseekV3

Tensor = torch.Tensor
# the dtypes of the tensors a graph stores (ONNX data types; fp8 is not one of them)
ONNX_TYPES = {d.torch_dtype(): d.onnx for d in DTYPE_TABLE.values() if not d.name.startswith("fp8")}
TORCH_TYPES = {v: k for k, v in ONNX_TYPES.items()}


# ------------------------------------------------------------------------------------ memory
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for its own sliding threshold (64-bit)


@contextlib.contextmanager
def freed_memory_returned():
    """While it lasts, glibc's malloc gives blocks of 1 MiB and more their own mappings, returned to the system
    when freed.  (By default the threshold slides up to 32 MiB once such a block is freed, after which freed
    tensors stay in the heap: tracing a large model's graphs then keeps hundreds of MB it no longer uses.)
    Afterwards the threshold is fixed at that 32 MiB ceiling, where the sliding one ends up, and the heap is
    trimmed.  No-op without glibc."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        libc = None
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
            libc.malloc_trim(0)


# ------------------------------------------------------------------------------------ placeholders
def placeholder_model(model: DeepseekV3) -> DeepseekV3:
    """Give a model built on the meta device placeholder parameters: views of one zero mapping, never written
    (shared parameters stay shared).  Its computations are meaningless; its traced graphs are the real ones."""
    params = [p for p in model.parameters()]
    size = max((p.numel() * p.element_size() for p in params), default=0)
    zero = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # pages appear when written
    base = torch.frombuffer(zero, dtype=torch.uint8)
    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                view = base[:p.numel() * p.element_size()].view(p.dtype).view(p.shape)
                done[id(p)] = torch.nn.Parameter(view, requires_grad=False)
            module._parameters[name] = done[id(p)]
    model._placeholder_mapping = zero  # lives as long as the model
    return model


# ----------------------------------------------------------------------- torch's folds, op by op
def _ints(t: Tensor) -> list[int] | None:
    return None if t.is_meta else [int(v) for v in t.reshape(-1).tolist()]


def _fold_slice(attrs, ins):
    if not 3 <= len(ins) <= 5 or ins[1].dim() != 1 or ins[2].dim() != 1 or len(ins[1]) != len(ins[2]):
        return None
    x, starts, ends = ins[0], _ints(ins[1]), _ints(ins[2])
    if len(ins) > 3:
        if ins[3].dim() != 1 or len(ins[3]) != len(starts):
            return None
        axes = [a + x.dim() if a < 0 else a for a in _ints(ins[3])]
    else:
        axes = [0] * len(starts)
    if len(ins) > 4 and (ins[4].dim() != 1 or len(ins[4]) != len(starts) or any(s != 1 for s in _ints(ins[4]))):
        return None
    for start, end, axis in zip(starts, ends, axes):
        n = x.shape[axis]
        start, end = start + n if start < 0 else start, end + n if end < 0 else end
        end = min(end, n)
        if end - start < 0 or start > n - (end - start):
            return None
        x = x.narrow(axis, start, end - start)
    return x


def _fold_div(attrs, ins):
    out = torch.div(ins[0], ins[1])
    return out.to(ins[0].dtype) if ins[0].dtype == ins[1].dtype else out


def _fold_unsqueeze(attrs, ins):
    if len(ins) != 2 or ins[1].dim() != 1:
        return None
    x = ins[0]
    for a in sorted(a + x.dim() + 1 if a < 0 else a for a in _ints(ins[1])):
        x = x.unsqueeze(a)
    return x


def _fold_squeeze(attrs, ins):
    x = ins[0]
    if len(ins) == 2:
        if ins[1].dim() != 1:
            return None
        for a in sorted(a + x.dim() if a < 0 else a for a in _ints(ins[1])):  # one after another, as torch's
            x = x.squeeze(a)
    return x


def _fold_reshape(attrs, ins):
    x, shape = ins[0], _ints(ins[1])
    zero_ok = attrs.get("allowzero", 0)
    return x.reshape([x.shape[i] if d == 0 and not zero_ok else d for i, d in enumerate(shape)])


def _fold_flatten(attrs, ins):
    x, axis = ins[0], attrs.get("axis", 1)
    axis = axis + x.dim() if axis < 0 else axis
    return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


def _fold_cast(attrs, ins):
    to = TORCH_TYPES.get(attrs.get("to"))
    return None if to is None else ins[0].to(to)


def _fold_reduce_prod(attrs, ins):
    x = ins[0]
    axes = sorted((a + x.dim() if a < 0 else a for a in attrs["axes"]), reverse=True) if "axes" in attrs \
        else list(range(x.dim()))[::-1]
    for a in axes:
        x = x.prod(a, keepdim=bool(attrs.get("keepdims", 1)))
    return x


def _fold_gather(attrs, ins):
    x, idx = ins
    axis = attrs.get("axis", 0)
    axis += x.dim() if axis < 0 else 0
    if idx.dim() > 1:
        return None
    idx = idx.to(x.device)
    out = x.index_select(axis, torch.where(idx < 0, idx + x.shape[axis], idx))
    return out.squeeze(axis) if idx.dim() < 1 else out


def _fold_range(attrs, ins):
    if ins[0].dtype not in (torch.float32, torch.float64, torch.int16, torch.int32, torch.int64):
        return None
    return torch.arange(*(t.item() for t in ins))


FOLD: dict[str, Callable[[dict, list[Tensor]], Tensor | None]] = {
    "Slice": _fold_slice,
    "Concat": lambda a, ins: torch.cat(ins, a["axis"]) if "axis" in a else None,
    "Sqrt": lambda a, ins: torch.sqrt(ins[0]),
    "Div": _fold_div,
    "Mul": lambda a, ins: torch.mul(ins[0], ins[1]),
    "Sub": lambda a, ins: torch.sub(ins[0], ins[1]),
    "Add": lambda a, ins: torch.add(ins[0], ins[1]),
    "Unsqueeze": _fold_unsqueeze,
    "Squeeze": _fold_squeeze,
    "Transpose": lambda a, ins: ins[0].permute(a["perm"]) if "perm" in a else None,
    "Cast": _fold_cast,
    "Reshape": _fold_reshape,
    "Flatten": _fold_flatten,
    "Shape": lambda a, ins: torch.tensor(list(ins[0].shape), dtype=torch.int64),
    "ReduceL1": lambda a, ins: torch.norm(ins[0], 1, a["axes"], bool(a["keepdims"]))
    if "axes" in a and "keepdims" in a else None,
    "ReduceL2": lambda a, ins: torch.norm(ins[0], 2, a["axes"], bool(a["keepdims"]))
    if "axes" in a and "keepdims" in a else None,
    "ReduceProd": _fold_reduce_prod,
    "Gather": _fold_gather,
    "Range": _fold_range,
    "Where": lambda a, ins: torch.where(ins[0], ins[1], ins[2]),
    "Equal": lambda a, ins: torch.eq(ins[0], ins[1]),
    "Greater": lambda a, ins: torch.greater(ins[0], ins[1]),
    "Less": lambda a, ins: torch.less(ins[0], ins[1]),
    "Neg": lambda a, ins: torch.neg(ins[0]),
    "Not": lambda a, ins: torch.ne(ins[0], torch.ones(ins[0].shape, dtype=ins[0].dtype, device=ins[0].device)),
    "Size": lambda a, ins: torch.tensor(ins[0].numel(), dtype=torch.int64),
    "Softmax": lambda a, ins: torch.softmax(ins[0], a.get("axis", -1)),
}
CONCRETE_INPUTS = {"Slice": (1, 2, 3, 4), "Unsqueeze": (1,), "Squeeze": (1,), "Reshape": (1,), "Gather": (1,),
                   "Range": (0, 1, 2)}  # read as values: must be known without the weights


def _apply(node: onnx.NodeProto, ins: list[Tensor]) -> Tensor | None:
    """torch's fold of `node` on `ins` (real, or meta where they depend on weights), or None where torch keeps
    the node.  Shape and Size read shapes only."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type in ("Shape", "Size"):
        return FOLD[node.op_type](attrs, ins)
    concrete = CONCRETE_INPUTS.get(node.op_type, ())
    if any(ins[i].is_meta for i in concrete if i < len(ins)):
        raise NotImplementedError(f"{node.op_type} node {node.name!r}: an input read as values depends on weights")
    if any(t.is_meta for t in ins):
        ins = [t if i in concrete or t.is_meta else t.to("meta") for i, t in enumerate(ins)]
    return FOLD[node.op_type](attrs, ins)


# ------------------------------------------------------------------------------------- folding
class _Value:
    """A foldable value: a parameter, a Constant node's tensor or a folded node's output.  `tensor` is real
    when known without the weights, else meta (shape and dtype only); `weights`: reads a parameter."""

    __slots__ = ("tensor", "weights", "node", "inputs", "param", "key")

    def __init__(self, tensor: Tensor, weights: bool, node=None, inputs=(), param: str | None = None):
        self.tensor, self.weights, self.node, self.inputs, self.param = tensor, weights, node, inputs, param
        h = hashlib.sha256()  # the recipe: equal keys, equal values
        if param is not None:
            h.update(b"param\0" + param.encode())
        elif node is None:
            h.update(f"const\0{tensor.dtype}\0{list(tensor.shape)}\0".encode())
            h.update(_raw(tensor))
        else:
            h.update(f"{node.domain}::{node.op_type}\0".encode())
            for a in node.attribute:
                h.update(a.SerializeToString() + b"\0")
            for v in inputs:
                h.update(v.key)
        self.key = h.digest()


def _raw(t: Tensor) -> memoryview:
    """The tensor's bytes as ONNX raw_data stores them (little-endian, row-major), without a copy where it is
    contiguous."""
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def fold_graph(model: onnx.ModelProto, params: dict[str, Tensor]) -> tuple[list[str], dict[str, _Value]]:
    """Fold `model` (traced with export_params=False; `params`: graph input name -> meta tensor of each
    parameter) in place as torch's constant folding would.  Constant-only folds become Constant nodes; the
    parameters and folds reading them leave the graph's inputs and nodes.  -> (the names the graph now reads
    as initializers, in first-use order; name -> _Value to compute each)."""
    graph = model.graph
    values: dict[str, _Value] = {}
    for i in graph.input:
        if i.name in params:
            values[i.name] = _Value(params[i.name], True, param=i.name)
    kept = []
    for node in graph.node:
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
            values[node.output[0]] = _Value(_from_proto(node.attribute[0].t), False)
            kept.append(node)
            continue
        ins = [values.get(name) for name in node.input]
        if (len(node.output) != 1 or not ins or any(v is None for v in ins) or node.op_type not in FOLD
                or node.domain not in ("", "ai.onnx")):
            kept.append(node)
            continue
        out = _apply(node, [v.tensor for v in ins])
        if out is None:
            kept.append(node)
            continue
        weights = any(v.weights for v in ins)
        value = _Value(out, weights, node, ins)
        values[node.output[0]] = value
        if not weights:  # torch: a new Constant node in the folded node's place
            const = onnx.helper.make_node("Constant", [], [node.output[0]], name=node.name,
                                          value=initializer(node.output[0], out))
            kept.append(const)
    used = _used_names(kept, graph)
    live = []
    for node in reversed(kept):  # dead-code elimination, as torch's pass after folding
        if any(o in used for o in node.output):
            live.append(node)
            used.update(node.input)
    live.reverse()
    needed = []
    seen = set()
    for node in live:
        for name in node.input:
            v = values.get(name)
            if v is not None and v.weights and name not in seen:
                seen.add(name)
                needed.append(name)
    for o in graph.output:
        if o.name in values and values[o.name].weights and o.name not in seen:
            seen.add(o.name)
            needed.append(o.name)
    del graph.node[:]
    graph.node.extend(live)
    inputs = [i for i in graph.input if i.name not in params]
    del graph.input[:]
    graph.input.extend(inputs)
    produced = {o for n in live for o in n.output}
    infos = [vi for vi in graph.value_info if vi.name in produced]
    del graph.value_info[:]
    graph.value_info.extend(infos)
    return needed, values


def _from_proto(t: onnx.TensorProto) -> Tensor:
    if t.data_type in TORCH_TYPES and t.raw_data:
        return torch.frombuffer(bytearray(t.raw_data), dtype=TORCH_TYPES[t.data_type]).reshape(list(t.dims))
    return torch.from_numpy(numpy_helper.to_array(t).copy())


def _used_names(nodes, graph: onnx.GraphProto) -> set[str]:
    used = {o.name for o in graph.output}
    for node in nodes:
        for a in node.attribute:  # subgraphs read outer names
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                used |= {name for n in g.node for name in n.input}
    return used


def evaluate(value: _Value, read: Callable[[str], Tensor], memo: dict | None = None) -> Tensor:
    """The real value: parameters read from the checkpoint, folds recomputed with torch's functions."""
    memo = {} if memo is None else memo
    if value.key in memo:
        return memo[value.key]
    if value.param is not None:
        out = read(value.param)
    elif value.node is None or not value.tensor.is_meta:
        out = value.tensor
    else:
        out = _apply(value.node, [evaluate(v, read, memo) for v in value.inputs])
    memo[value.key] = out
    return out


def evaluate_row(value: _Value, i: int, read: Callable[[str], Tensor], memo: dict) -> Tensor:
    """evaluate(value)[i] computed from the inputs' parts it needs where the recipe allows it (a stack of experts:
    Concat along axis 0 of one-row inputs, ops that keep axis 0 and act row by row), so that a layer's stacked
    experts can be quantized one expert at a time instead of held whole; else the whole value (kept in `memo`
    for the other rows), then its row."""
    node = value.node
    if value.param is not None or node is None or not value.tensor.is_meta:  # a leaf: read when its row is needed
        return evaluate(value, read)[i]
    if not value.tensor.dim():
        return evaluate(value, read, memo)[i]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    ins = value.inputs
    kept = value.tensor.shape[0] == ins[0].tensor.shape[0] if ins and ins[0].tensor.dim() else False
    if node.op_type == "Concat" and attrs.get("axis", 0) % value.tensor.dim() == 0 \
            and all(v.tensor.shape[0] == 1 for v in ins):
        return evaluate_row(ins[i], 0, read, memo)
    if node.op_type == "Concat" and attrs.get("axis", 0) % value.tensor.dim() != 0 and all(
            v.tensor.shape[0] == value.tensor.shape[0] for v in ins):
        return torch.cat([evaluate_row(v, i, read, memo) for v in ins], attrs["axis"] % value.tensor.dim() - 1)
    if node.op_type == "Unsqueeze" and _ints(ins[1].tensor) == [0]:  # row 0 of x[None] is x
        return evaluate(ins[0], read)
    if node.op_type == "Unsqueeze" and kept and 0 not in _ints(ins[1].tensor):
        return evaluate_row(ins[0], i, read, memo).reshape(value.tensor.shape[1:])
    if node.op_type in ("Reshape", "Cast") and kept:  # axis 0 kept: row i is input row i, reshaped (or cast)
        row = evaluate_row(ins[0], i, read, memo).reshape(value.tensor.shape[1:])
        return row.to(value.tensor.dtype) if node.op_type == "Cast" else row
    if node.op_type == "Transpose" and attrs.get("perm", [None])[0] == 0:
        return evaluate_row(ins[0], i, read, memo).permute([p - 1 for p in attrs["perm"][1:]])
    return evaluate(value, read, memo)[i]


# ------------------------------------------------------------------------------------- weights.bin
class Packed:
    """A tensor of an ONNX type torch has no dtype for (INT4: two values a byte): its bytes, type and dims."""

    def __init__(self, data: Tensor, onnx_type: int, dims: list[int]):
        self.data, self.onnx_type, self.dims = data, onnx_type, dims


def _typed(t: Tensor | Packed) -> tuple[memoryview, int, list[int]]:
    """(raw bytes, ONNX data type, dims) of a tensor to store."""
    if isinstance(t, Packed):
        return _raw(t.data), t.onnx_type, t.dims
    return _raw(t), ONNX_TYPES[t.dtype], list(t.shape)


class WeightStore:
    """weights.bin, written once for all the graphs of an export: each distinct tensor (by content) once,
    at a page-aligned offset; each recipe (a _Value's key) computed once."""

    def __init__(self, path: Path, align: int):
        self.path, self.align = path, align
        self.file = open(path, "wb")
        self.by_content: dict[bytes, tuple[int, int]] = {}
        self.by_key: dict[bytes, tuple[int, int, int, list[int]]] = {}

    def put(self, key: bytes, compute: Callable[[], Tensor | Packed]) -> tuple[int, int, int, list[int]]:
        """-> (offset, bytes, ONNX data type, dims) of the tensor `compute` gives, stored once."""
        if key not in self.by_key:
            raw, onnx_type, dims = _typed(compute())
            digest = hashlib.sha256(raw).digest() + bytes([onnx_type])
            if digest not in self.by_content:
                self.file.write(b"\0" * (-self.file.tell() % self.align))
                self.by_content[digest] = (self.file.tell(), len(raw))
                self.file.write(raw)
            self.by_key[key] = (*self.by_content[digest], onnx_type, dims)
        return self.by_key[key]

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> WeightStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tensors(self) -> int:
        return len(self.by_content)


def initializer(name: str, t: Tensor | Packed) -> onnx.TensorProto:
    """An inline initializer (raw_data)."""
    raw, onnx_type, dims = _typed(t)
    proto = onnx.TensorProto(name=name, data_type=onnx_type, dims=dims)
    proto.raw_data = bytes(raw)
    return proto


def external_initializer(name: str, location: str, offset: int, nbytes: int, data_type: int,
                         dims: list[int]) -> onnx.TensorProto:
    proto = onnx.TensorProto(name=name, data_type=data_type, dims=dims)
    proto.data_location = onnx.TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(nbytes))):
        proto.external_data.add(key=k, value=v)
    return proto
