"""`export --quant`: the graphs with block-quantized weights (mtp_trt/quant.py's format), rewritten after folding.

Once a graph is traced and folded (streaming.fold_graph), every weight it reads is a recipe over checkpoint
tensors.  `quantize_graph` rewrites the nodes that read large weights.  For ONNX Runtime:

* MatMul(x, W^T), W [N, K] a linear layer's weight (attention projections, dense MLPs, shared experts' and
  MTP modules' layers, `eh_proj`, the output head)  ->  `mtp_trt.cpu::QMatMul(x, data, scales)`;
* `mtp_trt.cpu::MoE` (router, routed and shared experts)  ->  `mtp_trt.cpu::QMoE`, the experts quantized, the
  router in float;
* Gather(embed_tokens, ids)  ->  `com.microsoft::GatherBlockQuantized` (where the hidden size is a multiple of
  the block size).

For TensorRT (the plugin lowering, or `--moe-form tensorrt`): MatMul(x, W^T) -> MatMul(x, DequantizeLinear(q,
s)), q W^T's signed INT4 or INT8 levels [K, N] and s [K / block, N] in the export's dtype (blocked
DequantizeLinear, opset 21), where K is a multiple of the block size: weight-only quantization, which
TensorRT fuses into the matmul.  That covers the dense layers and the `static` MoE form's stacked experts;
the `gather` form's experts and the embedding stay in the export's dtype.

Kept in float: the router, DeepSeek Sparse Attention's lightning indexer (`wq_b`, `wk`, `weights_proj`), norms,
biases, and products computed in the graph from several weights (small
models' W^UK / W^UV folded into the projections, exporters/graphs.py folded_mla).  Under int4 a few MatMul
weights take int8 (matmul_scheme): the output head, which decides every token; each layer's latent KV
down-projection (`kv_a_proj_with_mqa`, with `q_a_proj`, which the graphs fuse with it), from which every cached
key and value comes; and the first layer's dense MLP down-projection.  Chosen by measurement
(docs/quantization.md): of the tensors tried, these lift int4's agreement with the float model most for the
fewest bits.

The rewrite works on recipes: each quantized tensor is computed when weights.bin is written, from its
weight's recipe (one tensor at a time, so the export still never holds the model), and stored once however
many graphs read it (its key is the weight's recipe key and the scheme).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import onnx
import torch
from onnx import helper

from mtp_trt import quant
from mtp_trt.exporters.streaming import Packed, _Value, evaluate, evaluate_row
from mtp_trt.plugins.ort_lib import DOMAIN as CPU_DOMAIN

MS_DOMAIN = "com.microsoft"
DQ_OPSET = 21  # DequantizeLinear with block_size
MIN_ELEMENTS = 4096  # smaller weights stay in float (nothing to gain)
# the router, whose scores pick the experts, and DeepSeek Sparse Attention's lightning indexer, whose scores pick the
# rows attended to (quantized, it changes the selection: docs/quantization.md)
KEEP_FLOAT = ("mlp.gate.weight", "indexer.wq_b.weight", "indexer.wk.weight", "indexer.weights_proj.weight")
# MatMul weights kept at int8 under int4 (module docstring); a MatMul over embed_tokens is a tied output head
INT8_UNDER_INT4 = ("lm_head.weight", "embed_tokens.weight", "kv_a_proj_with_mqa.weight", "q_a_proj.weight",
                   ".layers.0.mlp.down_proj.weight")


def matmul_scheme(params: set[str], s: quant.Scheme) -> quant.Scheme:
    """The scheme of a MatMul weight computed from checkpoint parameters `params` under `s` (module docstring)."""
    if s.bits == 4 and any(p.endswith(INT8_UNDER_INT4) for p in params):
        return quant.Scheme("int8", s.block_size)
    return s


class QuantValue:
    """One tensor of a quantized weight (its data or its scales), computed from the weight's recipe `source`
    (transposed: the recipe gives W^T [K, N], as a MatMul reads it).  Layouts:
      "nbits": quant.py's, leading dims `rows` kept ([E, R, K] experts: data [E, R, blocks, blob]);
      "flat":  data as [rows, blocks * blob] (GatherBlockQuantized's);
      "dq":    ONNX DequantizeLinear's, for TensorRT: W^T's signed levels [K, N] (INT8, or INT4 two a byte) and
               scales [K / block, N] in `dtype` (K a multiple of the block size)."""

    def __init__(self, source: _Value, scheme: quant.Scheme, part: str, rows: tuple[int, ...], k: int,
                 transposed: bool, memo: dict, layout: str = "nbits", dtype: torch.dtype = torch.float32):
        dtype = dtype if layout == "dq" else torch.float32  # mtp-trt's operators take float32 scales
        self.source, self.scheme, self.part, self.rows, self.k = source, scheme, part, rows, k
        self.transposed, self.memo, self.layout, self.dtype = transposed, memo, layout, dtype
        h = hashlib.sha256(source.key + f"\0quant\0{scheme.tag}\0{int(transposed)}".encode())
        self.source_key = h.digest()  # the memo's key: both parts of one weight come from one quantization
        self.key = hashlib.sha256(self.source_key + f"{part}\0{layout}\0{dtype}".encode()).digest()
        n = int(np.prod(rows))
        data_shape, scale_shape = scheme.shapes(n, k)
        if layout == "dq":
            shape = (k, n) if part == "data" else (scale_shape[1], n)
            self.onnx_type = (onnx.TensorProto.INT4 if scheme.bits == 4 else onnx.TensorProto.INT8) \
                if part == "data" else None
        elif part == "data":
            shape = (*rows, int(np.prod(data_shape[1:]))) if layout == "flat" else (*rows, *data_shape[1:])
        else:
            shape = (*rows, *scale_shape[1:])
        meta_dtype = torch.uint8 if part == "data" else dtype
        self.tensor = torch.empty(shape if part != "data" or layout != "dq" or scheme.bits == 8
                                  else (k * n // 2,), dtype=meta_dtype, device="meta")
        self.shape = shape

    def _quantize(self, read: Callable[[str], torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
        """quant.quantize of the weight's rows [N, K]; stacked experts ([E, R, K]) one expert at a time."""
        if len(self.rows) < 2:
            w = evaluate(self.source, read).float()
            w = w.T if self.transposed else w
            return quant.quantize(w.reshape(-1, self.k).contiguous().numpy(), self.scheme)
        data_shape, scale_shape = self.scheme.shapes(int(np.prod(self.rows[1:])), self.k)
        data = np.empty((self.rows[0], *data_shape), np.uint8)
        scales = np.empty((self.rows[0], *scale_shape), np.float32)
        memo: dict = {}  # whatever cannot be taken row by row, evaluated once
        for e in range(self.rows[0]):
            w = evaluate_row(self.source, e, read, memo).float().reshape(-1, self.k)
            data[e], scales[e] = quant.quantize(w.contiguous().numpy(), self.scheme)
        return data.reshape(-1, *data_shape[1:]), scales.reshape(-1, scale_shape[1])

    def compute(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor | Packed:
        if self.memo.get("key") != self.source_key:
            self.memo.clear()
            data, scales = self._quantize(read)
            self.memo.update(key=self.source_key, data=data, scales=scales)
        out = self.memo[self.part]
        if self.layout != "dq":
            return torch.from_numpy(out).reshape(self.shape)
        if self.part == "scales":
            return torch.from_numpy(np.ascontiguousarray(out.T)).to(self.dtype)
        levels = quant.levels(out, self.k, self.scheme.bits).T  # [K, N] signed
        if self.scheme.bits == 8:
            return Packed(torch.from_numpy(np.ascontiguousarray(levels.astype(np.int8)).view(np.uint8)),
                          self.onnx_type, list(self.shape))
        flat = (levels.reshape(-1) & 0xF).astype(np.uint8)  # two's complement nibbles, first in the low half
        return Packed(torch.from_numpy(flat[0::2] | (flat[1::2] << 4)), self.onnx_type, list(self.shape))


def _params(v: _Value) -> set[str]:
    """The checkpoint parameters (graph input names) a recipe reads."""
    if v.param is not None:
        return {v.param}
    out: set[str] = set()
    for i in v.inputs:
        out |= _params(i)
    return out


def _quantizable(v: _Value | None, dims: int = 2) -> bool:
    return (v is not None and v.weights and v.tensor.is_floating_point() and v.tensor.dim() == dims
            and v.tensor.numel() >= MIN_ELEMENTS and not any(p.endswith(KEEP_FLOAT) for p in _params(v)))


def quantize_graph(model: onnx.ModelProto, needed: list[str], values: dict, scheme: quant.Scheme,
                   tensorrt: bool = False) -> tuple[list[str], dict]:
    """Rewrite `model` (folded; `needed`, `values` as fold_graph returned them) in place for `scheme` (module
    docstring); `tensorrt`: for TensorRT instead (each MatMul weight dequantized by a DequantizeLinear).
    -> (the initializer names it now reads, name -> _Value or QuantValue to compute each)."""
    graph, memo = model.graph, {}
    values = dict(values)
    nodes = []

    def add(name: str, source: _Value, s: quant.Scheme, rows: tuple[int, ...], k: int, transposed: bool,
            layout: str = "nbits") -> list[str]:
        out = []
        for part in ("data", "scales"):
            q = QuantValue(source, s, part, rows, k, transposed, memo, layout, source.tensor.dtype)
            form = "t" * transposed + ("" if layout == "nbits" else "-" + layout)
            qname = f"{name}.q{s.bits}g{s.block_size}{form}.{part}"
            values[qname] = q
            out.append(qname)
        return out

    for node in graph.node:
        weight = values.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        if node.domain == "" and node.op_type == "MatMul" and _quantizable(weight):
            k, n = weight.tensor.shape
            s = matmul_scheme(_params(weight), scheme)
            if not tensorrt:
                data, scales = add(node.input[1], weight, s, (n,), k, transposed=True)
                nodes.append(helper.make_node("QMatMul", [node.input[0], data, scales], list(node.output),
                                              name=node.name, domain=CPU_DOMAIN, K=k, N=n, bits=s.bits,
                                              block_size=s.block_size))
            elif k % s.block_size == 0:
                data, scales = add(node.input[1], weight, s, (n,), k, transposed=True, layout="dq")
                w = f"{data[:-len('.data')]}.dequantized"
                nodes.append(helper.make_node("DequantizeLinear", [data, scales], [w], name=f"{node.name}/dq",
                                              axis=0, block_size=s.block_size))
                nodes.append(helper.make_node("MatMul", [node.input[0], w], list(node.output), name=node.name))
            else:
                nodes.append(node)
        elif node.op_type == "MoE" and node.domain == CPU_DOMAIN:
            nodes.append(_qmoe(node, values, scheme, add))
        elif (not tensorrt and node.op_type == "Gather" and node.domain == ""
              and _quantizable(values.get(node.input[0])) and values[node.input[0]].tensor.shape[1] % scheme.block_size == 0
              and {a.name: helper.get_attribute_value(a) for a in node.attribute}.get("axis", 0) == 0):
            rows, k = values[node.input[0]].tensor.shape
            data, scales = add(node.input[0], values[node.input[0]], scheme, (rows,), k, transposed=False,
                               layout="flat")
            nodes.append(helper.make_node("GatherBlockQuantized", [data, node.input[1], scales], list(node.output),
                                          name=node.name, domain=MS_DOMAIN, gather_axis=0, quantize_axis=1,
                                          block_size=scheme.block_size, bits=scheme.bits))
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    if tensorrt:  # blocked DequantizeLinear: opset 21
        for o in model.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = max(o.version, DQ_OPSET)
    elif not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    read = {name for n in graph.node for name in n.input}
    kept = [name for name in needed if name in read]
    new = [name for name in values if isinstance(values[name], QuantValue) and name in read and name not in kept]
    return kept + new, values


def _qmoe(node: onnx.NodeProto, values: dict, scheme: quant.Scheme, add) -> onnx.NodeProto:
    """mtp_trt.cpu::MoE -> QMoE: each expert matrix input (fc1 [E, 2I, D], fc2 [E, D, I], shared [2Is, D] and
    [D, Is]) as its quantized data and scales."""
    ins = list(node.input)
    out = ins[:3]
    for name in ins[3:]:
        v = values.get(name)
        if name == "" or v is None:
            raise ValueError(f"{node.name}: MoE input {name!r} is not a weight")
        *rows, k = v.tensor.shape
        out += add(name, v, scheme, tuple(rows), k, transposed=False)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return helper.make_node("QMoE", out, list(node.output), name=node.name, domain=CPU_DOMAIN, bits=scheme.bits,
                            block_size=scheme.block_size, **attrs)
