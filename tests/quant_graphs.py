"""Test helpers for quantized exports: checkpoints whose weights quantize without loss, and a quantized graph
turned back into a float one (each quantized node replaced by its float twin over the dequantized weights)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from mtp_trt import quant
from mtp_trt.exporters.loader import load_checkpoint, save_checkpoint
from mtp_trt.exporters.quantize import matmul_scheme
from runtime_models import write_char_tokenizer


def prerounded(src: Path, out: Path, scheme: quant.Scheme, keep: tuple[str, ...] = ("mlp.gate.weight",)) -> Path:
    """A copy of checkpoint `src` whose 2-D weights are already on `scheme`'s grid (each linear weight on the
    grid the exporter picks for it, exporters/quantize.py matmul_scheme; the embedding table on `scheme`'s; the
    weights whose names end with one of `keep`, which the exporter must keep in float, untouched): exporting it with `scheme` loses nothing more, so the quantized export must compute what
    the PyTorch reference computes on these weights."""
    import json

    config = json.loads((src / "config.json").read_text())
    model = load_checkpoint(src)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() != 2 or name.endswith(keep):
                continue
            if name.endswith("kv_b_proj.weight"):  # W^UK and W^UV, each head's matrix at int8 (exporters/quantize.py)
                p.copy_(_int8_heads(p, config["num_attention_heads"], config["qk_nope_head_dim"], scheme.block_size))
                continue
            p.copy_(_on_grid(p, scheme if name.endswith("embed_tokens.weight") else matmul_scheme({name}, scheme)))
    save_checkpoint(model, out, config)
    write_char_tokenizer(out / "tokenizer.json")
    return out


def _on_grid(w: torch.Tensor, s: quant.Scheme) -> torch.Tensor:
    """w [N, K] on s's grid (its rows quantized along K and dequantized)."""
    data, scales = quant.quantize(w.contiguous().numpy(), s)
    return torch.from_numpy(quant.dequantize(data, scales, w.shape[1], s.bits))


def _int8_heads(kv_b: torch.Tensor, heads: int, dn: int, block: int) -> torch.Tensor:
    """kv_b_proj.weight [H*(Dn+Dv), Dl] with each head's W^UK [Dn, Dl] on the int8 grid along Dn (its transpose's
    rows, as MlaSelfAttention's w_uk_q stores it) and W^UV [Dv, Dl] along Dl."""
    s = quant.Scheme("int8", block)
    w = kv_b.view(heads, -1, kv_b.shape[1]).clone()
    for h in range(heads):
        w[h, :dn] = _on_grid(w[h, :dn].T, s).T
        w[h, dn:] = _on_grid(w[h, dn:], s)
    return w.view_as(kv_b)


def dequantized_graph(path: Path) -> bytes:
    """The graph at `path` with QMatMul -> MatMul over W^T, QMoE -> MoE over float experts,
    GatherBlockQuantized -> Gather over the float table and MlaSelfAttention's int8 W^UK and W^UV -> float ones,
    each weight dequantized from the export's bytes (mtp_trt.quant.dequantize): what the quantized graph computes,
    but for its activations' int8 rounding."""
    from mtp_trt.manifest import Manifest

    dn = Manifest.load(path.parent).config.qk_nope_head_dim
    model = onnx.load(str(path))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    arrays = {name: numpy_helper.to_array(i) for name, i in inits.items()}
    new_inits, nodes = [], []

    def float_weight(data_name: str, scales_name: str, k: int, bits: int, transpose: bool) -> str:
        data, scales = arrays[data_name], arrays[scales_name]
        rows = data.shape[:-2]
        w = quant.dequantize(data.reshape(-1, *data.shape[-2:]), scales.reshape(-1, scales.shape[-1]), k, bits)
        w = w.reshape(*rows, k)
        name = f"{data_name}.float"
        w = np.swapaxes(w, -1, -2) if transpose else w  # (2-D: W^T; stacked: each matrix transposed)
        new_inits.append(numpy_helper.from_array(np.ascontiguousarray(w), name))
        return name

    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "QMatMul":
            w = float_weight(node.input[1], node.input[2], attrs["K"], attrs["bits"], transpose=True)
            nodes.append(helper.make_node("MatMul", [node.input[0], w], list(node.output), name=node.name))
        elif node.op_type == "QMoE":
            ins = list(node.input[:3])
            for i, (data, scales) in enumerate(zip(node.input[3::2], node.input[4::2])):
                bits = attrs.get("down_bits", attrs["bits"]) if i % 2 else attrs["bits"]  # fc1, fc2, shared fc1, fc2
                ins.append(data and float_weight(data, scales, _unpadded(node, data, arrays), bits, False))
            kept = {k: v for k, v in attrs.items() if k not in ("bits", "block_size", "down_bits")}
            nodes.append(helper.make_node("MoE", ins, list(node.output), name=node.name, domain=node.domain, **kept))
        elif node.op_type == "GatherBlockQuantized":
            data = arrays[node.input[0]]
            rows, k = data.shape[0], data.shape[1] * 8 // attrs["bits"]
            arrays[node.input[0]] = data.reshape(rows, k // attrs["block_size"], -1)
            w = float_weight(node.input[0], node.input[2], k, attrs["bits"], transpose=False)
            nodes.append(helper.make_node("Gather", [w, node.input[1]], list(node.output), name=node.name, axis=0))
        elif node.op_type == "MlaSelfAttention" and len(node.input) > 12:
            dl = arrays[node.input[12]].shape[1]  # w_uk_q [H, Dl, Dn/bs, bs]
            w_uk = float_weight(node.input[12], node.input[13], dn, 8, True)  # each head's W^UK^T back to [Dn, Dl]
            w_uv = float_weight(node.input[14], node.input[15], dl, 8, False)  # [H, Dv, Dl]
            ins = list(node.input[:10]) + [w_uk, w_uv]
            nodes.append(helper.make_node("MlaSelfAttention", ins, list(node.output), name=node.name,
                                          domain=node.domain, **attrs))
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(new_inits)
    return model.SerializeToString()


def _unpadded(node: onnx.NodeProto, data: str, arrays: dict) -> int:
    """An expert matrix's K: fc1's and shared fc1's is x's width D (= its fc2's rows), fc2's is its fc1's rows / 2
    (inputs fc1 3, fc2 5, shared fc1 7, shared fc2 9)."""
    ins = list(node.input)
    at = ins.index(data)
    fc1, fc2 = (arrays[ins[3]], arrays[ins[5]]) if at in (3, 5) else (arrays[ins[7]], arrays[ins[9]])
    return fc2.shape[-3] if at in (3, 7) else fc1.shape[-3] // 2
