"""`export --quant`: the graphs with block-quantized weights (mtp_trt/quant.py's format), rewritten after folding.

Once a graph is traced and folded (streaming.fold_graph), every weight it reads is a recipe over checkpoint
tensors.  `quantize_graph` rewrites the nodes that read large weights.  For ONNX Runtime:

* MatMul(x, W^T), W [N, K] a linear layer's weight (attention projections, dense MLPs, shared experts' and
  MTP modules' layers, `eh_proj`, the output head)  ->  `mtp_trt.cpu::QMatMul(x, data, scales)`;
* `mtp_trt.cpu::MoE` (router, routed and shared experts)  ->  `mtp_trt.cpu::QMoE`, the experts quantized, the
  router in float;
* Gather(embed_tokens, ids)  ->  `com.microsoft::GatherBlockQuantized` (where the hidden size is a multiple of
  the block size);
* `mtp_trt.cpu::MlaSelfAttention`'s per-head W^UK and W^UV (views of `kv_b_proj`)  ->  its int8 inputs
  (w_uk_q, w_uv_q and their scales: each head's matrix in nn.Linear's layout, W^UK transposed), at int8 under
  int4 too: they sit in the attention's path as the latent KV down-projection does.

For TensorRT (the plugin lowering, or `--moe-form tensorrt`): MatMul(x, W^T) -> MatMul(x, DequantizeLinear(q,
s)), q W^T's signed INT4 or INT8 levels [K, N] and s [K / block, N] in the export's dtype (blocked
DequantizeLinear, opset 21), where K is a multiple of the block size: weight-only quantization, which
TensorRT fuses into the matmul.  That covers the dense layers and the `static` MoE form's stacked experts.
The `gather` form's stacked experts [E, R, K]: Gather(W, idx) -> Gather(DequantizeLinear(q, s), idx), q [E, R, K]
and s [E, R, K / block] (blocks along K; TensorRT takes quantized constants only straight into a
DequantizeLinear, never into a Gather).  The embedding stays in the export's dtype.

`fp8` (TensorRT only): q W^T's float8 e4m3 values [K, N], s float32 [K / 128, N] (exact for any FP8 checkpoint
scale), the DequantizeLinear's float32 output cast to the export's dtype where that is fp16 or bf16.  A weight
whose recipe only moves the values of FP8 checkpoint tensors (transposes, concatenations: `fp8_stored`) keeps
their e4m3 bytes and scales exactly, each 128 x 128 block's scale repeated over its 128 columns of W^T; where
the checkpoint stores a weight in float, or a block of 128 along K would straddle two stored blocks (blocks
not 128 wide along the input, experts narrower than 128 stacked along K), the weight is quantized from its
float value: one scale per 128 values along K of each column, its largest magnitude over 448 (`fp8_quantize`).
The output head stays in the export's dtype, as DeepSeek's FP8 checkpoints keep it.

Kept in float: the router, DeepSeek Sparse Attention's lightning indexer (`wq_b`, `wk`, `weights_proj`), norms,
biases, and products computed in the graph from several weights (W^UK / W^UV folded into the projections,
exporters/graphs.py folded_mla, which quantized exports do not do).  Under int4 a few MatMul
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
from mtp_trt.errors import MtpTrtError
from mtp_trt.exporters.streaming import ONNX_TYPES, Packed, _Value, evaluate, evaluate_row
from mtp_trt.plugins.ort_lib import DOMAIN as CPU_DOMAIN

FP8_TYPE = onnx.TensorProto.FLOAT8E4M3FN
MOVES_VALUES = ("Transpose", "Concat", "Reshape", "Flatten", "Slice", "Squeeze", "Unsqueeze", "Gather")
MS_DOMAIN = "com.microsoft"
DQ_OPSET = 21  # DequantizeLinear with block_size
MIN_ELEMENTS = 4096  # smaller weights stay in float (nothing to gain)
# the router, whose scores pick the experts, and DeepSeek Sparse Attention's lightning indexer, whose scores pick the
# rows attended to (quantized, it changes the selection: docs/quantization.md)
KEEP_FLOAT = ("mlp.gate.weight", "indexer.wq_b.weight", "indexer.wk.weight", "indexer.weights_proj.weight")
# MatMul weights kept at int8 under int4 (module docstring); a MatMul over embed_tokens is a tied output head
INT8_UNDER_INT4 = ("lm_head.weight", "embed_tokens.weight", "kv_a_proj_with_mqa.weight", "q_a_proj.weight",
                   ".layers.0.mlp.down_proj.weight")
HEAD = ("lm_head.weight", "embed_tokens.weight")  # a MatMul over embed_tokens is a tied output head


def matmul_scheme(params: set[str], s: quant.Scheme) -> quant.Scheme:
    """The scheme of a MatMul weight computed from checkpoint parameters `params` under `s` (module docstring;
    Scheme("none"): kept in the export's dtype)."""
    if s.name == "fp8" and any(p.endswith(HEAD) for p in params):
        return quant.Scheme()
    if s.bits == 4 and any(p.endswith(INT8_UNDER_INT4) for p in params):
        return quant.Scheme("int8", s.block_size)
    return s


def fp8_quantize(wt: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """W^T [K, N] float (K a multiple of FP8_BLOCK) -> (e4m3 codes uint8 [K, N], float32 scales [K / FP8_BLOCK, N]):
    each block of FP8_BLOCK values along K of a column scaled by its largest magnitude over FP8_MAX, rounded to
    the nearest e4m3 value (an all-zero block: scale 0)."""
    k, n = wt.shape
    blocks = wt.float().reshape(k // quant.FP8_BLOCK, quant.FP8_BLOCK, n)
    scales = blocks.abs().amax(1) / quant.FP8_MAX
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    codes = (blocks / safe[:, None]).clamp(-quant.FP8_MAX, quant.FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8).reshape(k, n).numpy(), scales.numpy()


def fp8_stored(value: Callable[[Callable[[str], torch.Tensor], str], torch.Tensor], read
               ) -> tuple[np.ndarray, np.ndarray] | None:
    """W^T [K, N] in fp8_quantize's form made of the checkpoint's FP8 tensors as stored (read.fp8): `value(leaf,
    what)` is the weight's recipe (one that only moves values: _moves_values) evaluated with each parameter p given
    by leaf(p) (`what`: "scales" or "codes", which leaf it is), so the e4m3 codes move as the values do; each
    block of FP8_BLOCK along K of a column takes the one stored scale all its values have.  None where some
    block's values have different stored scales."""
    stored: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    (bo, bi) = read.block

    def codes(p: str) -> torch.Tensor:
        if p not in stored:
            stored[p] = read.fp8(p)
        return stored[p][0]

    def scale_map(p: str) -> torch.Tensor:  # each stored value's scale, in the tensor's layout
        o, i = codes(p).shape
        return stored[p][1].repeat_interleave(bo, 0)[:o].repeat_interleave(bi, 1)[:, :i]

    scales = value(scale_map, "scales")
    k, n = scales.shape
    if k % quant.FP8_BLOCK:
        return None
    blocks = scales.reshape(k // quant.FP8_BLOCK, quant.FP8_BLOCK, n)
    if not torch.equal(blocks, blocks[:, :1].expand_as(blocks)):
        return None
    first = blocks[:, 0].contiguous().numpy()
    del scales, blocks
    return value(lambda p: codes(p).view(torch.uint8), "codes").contiguous().numpy(), first


def _moves_values(v: _Value) -> bool:
    """Whether a recipe only moves its parameters' values (ops in MOVES_VALUES over parameters and values known
    without the weights, such as their shapes)."""
    if v.param is not None or v.node is None or not v.tensor.is_meta:
        return True
    return v.node.op_type in MOVES_VALUES and all(_moves_values(i) for i in v.inputs)


class QuantValue:
    """One tensor of a quantized weight (its data or its scales), computed from the weight's recipe `source`
    (transposed: the recipe gives W^T [K, N], as a MatMul reads it).  Layouts:
      "nbits": quant.py's, leading dims `rows` kept ([E, R, K] experts: data [E, R, blocks, blob]);
      "flat":  data as [rows, blocks * blob] (GatherBlockQuantized's);
      "dq":    ONNX DequantizeLinear's, for TensorRT: W^T's signed levels [K, N] (INT8, or INT4 two a byte; fp8:
               e4m3 codes) and scales [K / block, N] in `dtype` (fp8: float32) (K a multiple of the block size);
      "dq-stacked": the same for stacked experts [E, R, K] (the `gather` MoE form's), blocks along K: levels
               [E, R, K], scales [E, R, K / block]."""

    def __init__(self, source: _Value, scheme: quant.Scheme, part: str, rows: tuple[int, ...], k: int,
                 transposed: bool, memo: dict, layout: str = "nbits", dtype: torch.dtype = torch.float32):
        fp8 = scheme.name == "fp8"  # float32 scales, exact for any FP8 checkpoint's (module docstring)
        dq = layout.startswith("dq")
        # the scales' dtype: TensorRT's DequantizeLinear, the export's; mtp-trt's operators, quant.py's float16;
        # GatherBlockQuantized, its output's (float32)
        dtype = dtype if dq and not fp8 else torch.float32 if fp8 or layout == "flat" else torch.float16
        self.source, self.scheme, self.part, self.rows, self.k = source, scheme, part, rows, k
        self.transposed, self.memo, self.layout, self.dtype = transposed, memo, layout, dtype
        h = hashlib.sha256(source.key + f"\0quant\0{scheme.tag}\0{int(transposed)}".encode())
        self.source_key = h.digest()  # the memo's key: both parts of one weight come from one quantization
        self.key = hashlib.sha256(self.source_key + f"{part}\0{layout}\0{dtype}".encode()).digest()
        n = int(np.prod(rows))
        data_shape, scale_shape = scheme.shapes(n, k)
        if dq:
            shape = ((k, n) if part == "data" else (scale_shape[1], n)) if layout == "dq" else \
                (*rows, k) if part == "data" else (*rows, scale_shape[1])
            self.onnx_type = (FP8_TYPE if fp8 else onnx.TensorProto.INT4 if scheme.bits == 4 else
                              onnx.TensorProto.INT8) if part == "data" else None
        elif part == "data":
            shape = (*rows, int(np.prod(data_shape[1:]))) if layout == "flat" else (*rows, *data_shape[1:])
        else:
            shape = (*rows, *scale_shape[1:])
        meta_dtype = torch.uint8 if part == "data" else dtype
        self.tensor = torch.empty(shape if part != "data" or not dq or scheme.bits == 8
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
        scales = np.empty((self.rows[0], *scale_shape), quant.SCALE_DTYPE)
        memo: dict = {}  # whatever cannot be taken row by row, evaluated once
        for e in range(self.rows[0]):
            w = evaluate_row(self.source, e, read, memo).float()
            w = (w.T if self.transposed else w).reshape(-1, self.k)
            data[e], scales[e] = quant.quantize(w.contiguous().numpy(), self.scheme)
        return data.reshape(-1, *data_shape[1:]), scales.reshape(-1, scale_shape[1])

    def _fp8(self, read) -> tuple[np.ndarray, np.ndarray]:
        """FP8 W^T [K, N] (fp8_quantize's form; stacked experts [E, R, K]: codes [E, R, K], scales [E, R, K / block],
        one expert at a time): the checkpoint's own bytes and scales where the recipe allows it, else quantized
        (module docstring)."""
        source = self.source
        kept = _moves_values(source) and all(read.is_fp8(p) for p in _params(source))
        if len(self.rows) < 2:
            return (kept and fp8_stored(lambda leaf, what: evaluate(source, leaf), read)) or \
                fp8_quantize(evaluate(source, read.float32))
        e, r = self.rows[0], int(np.prod(self.rows[1:]))
        codes = np.empty((e, r, self.k), np.uint8)
        scales = np.empty((e, r, self.k // quant.FP8_BLOCK), np.float32)
        memos: dict[str, dict] = {"codes": {}, "scales": {}, "float": {}}  # one per leaf reader, kept across rows

        def row(i: int, leaf, memo: str) -> torch.Tensor:  # expert i's [R, K] as W^T [K, R]
            return evaluate_row(source, i, leaf, memos[memo]).reshape(r, self.k).T

        for i in range(e):
            got = kept and fp8_stored(lambda leaf, what: row(i, leaf, what), read)
            c, s = got or fp8_quantize(row(i, read.float32, "float"))
            codes[i], scales[i] = c.T, s.T
        return codes, scales

    def compute(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor | Packed:
        if self.memo.get("key") != self.source_key:
            self.memo.clear()
            try:
                data, scales = self._fp8(read) if self.scheme.name == "fp8" else self._quantize(read)
            except ValueError as e:  # quant.quantize's: a weight its scales cannot hold
                raise MtpTrtError(f"{', '.join(sorted(_params(self.source)))}: {e}") from None
            self.memo.update(key=self.source_key, data=data, scales=scales)
        out = self.memo[self.part]
        if self.scheme.name == "fp8":
            return torch.from_numpy(out) if self.part == "scales" else Packed(torch.from_numpy(out.reshape(-1)),
                                                                              FP8_TYPE, list(self.shape))
        if not self.layout.startswith("dq"):
            return torch.from_numpy(out).reshape(self.shape).to(self.dtype if self.part == "scales" else torch.uint8)
        stacked = self.layout == "dq-stacked"  # [E, R, K]: rows kept, blocks along the last axis
        if self.part == "scales":
            out = out.reshape(self.shape) if stacked else out.T
            return torch.from_numpy(np.ascontiguousarray(out)).to(self.dtype)
        levels = quant.levels(out, self.k, self.scheme.bits)  # [N, K] signed
        levels = levels if stacked else levels.T  # W^T [K, N] for a MatMul
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


def _axis(node: onnx.NodeProto) -> int:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}.get("axis", 0)


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

    made = {}  # quantized data -> the weight its DequantizeLinear gives: a weight read twice is dequantized once

    def dequantized(node: onnx.NodeProto, parts: list[str], axis: int, s: quant.Scheme, dtype: torch.dtype) -> str:
        """DequantizeLinear(data, scales) blocked along `axis` (FP8's float32 output cast to the export's dtype):
        the name of the weight it gives (made once, before its first reader, for every node reading it; the MTP
        module of eagle mode is read once per draft in a step graph)."""
        data, scales = parts
        if data in made:
            return made[data]
        w = f"{data[:-len('.data')]}.dequantized"
        nodes.append(helper.make_node("DequantizeLinear", [data, scales], [w], name=f"{node.name}/dq", axis=axis,
                                      block_size=s.block_size))
        if s.name == "fp8" and dtype != torch.float32:
            nodes.append(helper.make_node("Cast", [w], [f"{w}.cast"], name=f"{node.name}/cast", to=ONNX_TYPES[dtype]))
            w = f"{w}.cast"
        made[data] = w
        return w

    for node in graph.node:
        weight = values.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        if node.domain == "" and node.op_type == "MatMul" and _quantizable(weight):
            k, n = weight.tensor.shape
            s = matmul_scheme(_params(weight), scheme)
            if not s.quantized:
                nodes.append(node)
            elif not tensorrt:
                data, scales = add(node.input[1], weight, s, (n,), k, transposed=True)
                nodes.append(helper.make_node("QMatMul", [node.input[0], data, scales], list(node.output),
                                              name=node.name, domain=CPU_DOMAIN, K=k, N=n, bits=s.bits,
                                              block_size=s.block_size))
            elif k % s.block_size == 0:
                w = dequantized(node, add(node.input[1], weight, s, (n,), k, transposed=True, layout="dq"), 0, s,
                                weight.tensor.dtype)
                nodes.append(helper.make_node("MatMul", [node.input[0], w], list(node.output), name=node.name))
            else:
                nodes.append(node)
        elif (tensorrt and node.op_type == "Gather" and node.domain == "" and _quantizable(values.get(node.input[0]), 3)
              and values[node.input[0]].tensor.shape[2] % scheme.block_size == 0 and _axis(node) == 0):
            # the `gather` MoE form's stacked experts [E, R, K]: dequantized, then each token's experts gathered
            # (TensorRT takes quantized constants only straight into a DequantizeLinear)
            v = values[node.input[0]]
            e, r, k = v.tensor.shape
            w = dequantized(node, add(node.input[0], v, scheme, (e, r), k, transposed=False, layout="dq-stacked"), 2,
                            scheme, v.tensor.dtype)
            nodes.append(helper.make_node("Gather", [w, node.input[1]], list(node.output), name=node.name, axis=0))
        elif node.op_type == "MoE" and node.domain == CPU_DOMAIN:
            nodes.append(_qmoe(node, values, scheme, add))
        elif node.op_type == "MlaSelfAttention" and node.domain == CPU_DOMAIN and not tensorrt:
            nodes.append(_int8_mla(node, values, scheme, add))
        elif (not tensorrt and node.op_type == "Gather" and node.domain == ""
              and _quantizable(values.get(node.input[0])) and values[node.input[0]].tensor.shape[1] % scheme.block_size == 0
              and _axis(node) == 0):
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
    [D, Is]) as its quantized data and scales.  A node without routed experts (a dense MLP) takes matmul_scheme's
    bits for each of its two matrices (`down_bits`: the down-projection's)."""
    ins = list(node.input)
    out = ins[:3]
    dense = ins[3] == ""
    bits = {}
    for i, name in enumerate(ins[3:]):
        if name == "":  # an absent input (no routed experts: a dense MLP)
            out += ["", ""]
            continue
        v = values.get(name)
        if v is None:
            raise ValueError(f"{node.name}: MoE input {name!r} is not a weight")
        *rows, k = v.tensor.shape
        s = matmul_scheme(_params(v), scheme) if dense else scheme
        bits["down" if i % 2 else "up"] = s.bits  # inputs fc1, fc2, shared_fc1, shared_fc2
        out += add(name, v, s, tuple(rows), k, transposed=False)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    down = {"down_bits": bits["down"]} if bits["down"] != bits["up"] else {}
    return helper.make_node("QMoE", out, list(node.output), name=node.name, domain=CPU_DOMAIN, bits=bits["up"],
                            block_size=scheme.block_size, **attrs, **down)


MLA_W_UK, MLA_W_UV = 10, 11  # MlaSelfAttention's float inputs w_uk [H, Dn, Dl], w_uv [H, Dv, Dl]; then w_uk_q,
# w_uk_scales, w_uv_q, w_uv_scales (plugins/ort/mtp_ort_ops.cpp)


def _int8_mla(node: onnx.NodeProto, values: dict, scheme: quant.Scheme, add) -> onnx.NodeProto:
    """mtp_trt.cpu::MlaSelfAttention with its float W^UK and W^UV as int8 blocks of the export's block size: w_uk
    [H, Dn, Dl] as each head's W^UK^T [Dl, Dn] (rows (H, Dl), K = Dn), w_uv [H, Dv, Dl] as is (rows (H, Dv), K = Dl).
    A node without them (folded into the projections) is returned as it is."""
    ins = list(node.input) + [""] * (MLA_W_UV + 1 - len(node.input))
    int8 = quant.Scheme("int8", scheme.block_size)
    quantized = []
    for i in (MLA_W_UK, MLA_W_UV):
        v = values.get(ins[i]) if ins[i] else None
        if not _quantizable(v, 3):
            quantized += ["", ""]
            continue
        h, a, b = v.tensor.shape
        quantized += add(ins[i], v, int8, (h, b), a, transposed=True) if i == MLA_W_UK else \
            add(ins[i], v, int8, (h, a), b, transposed=False)
        ins[i] = ""
    if not any(quantized):
        return node
    out = helper.make_node("MlaSelfAttention", ins[:MLA_W_UV + 1] + quantized, list(node.output), name=node.name,
                           domain=CPU_DOMAIN)
    out.attribute.extend(node.attribute)
    return out
