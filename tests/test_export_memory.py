"""Exporting streams the weights: the export's peak memory grows by a small part of the
checkpoint's size, not by several times it, so a checkpoint larger than memory exports.

The checkpoint is random and made on the fly: 12 layers of 32 experts, ~300 MB of fp32 weights spread over
many tensors, none larger than ~17 MB (a layer's stacked experts).  The export runs in a process of its
own whose peak RSS (VmHWM, reset after the imports) is compared with its RSS before the export."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import onnx
import pytest
import torch

from mtp_trt import contract as C
from mtp_trt.exporters.export import export
from mtp_trt.exporters.streaming import fold_graph
from mtp_trt.manifest import Manifest
from runtime_models import make_random

BIG = dict(hidden_size=512, num_hidden_layers=12, n_routed_experts=32, moe_intermediate_size=128,
           intermediate_size=1024, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1)


def _export_in_child(small, ckpt, out, **options) -> dict:
    """Export `small` (the imports, torch's lazy set-up), then `ckpt` (with export `options`): RSS before, and the
    peak during, that."""
    code = textwrap.dedent(f"""
        import json, time
        from mtp_trt.exporters.export import export

        def status(key):
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith(key)) * 1024

        export({str(small)!r}, {str(out)!r} + "-small", nextn=0, max_seq_len=64, **{options!r})
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        before, t0 = status("VmRSS"), time.perf_counter()
        export({str(ckpt)!r}, {str(out)!r}, nextn=0, max_seq_len=64, **{options!r})
        print(json.dumps({{"before": before, "peak": status("VmHWM"), "seconds": time.perf_counter() - t0}}))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_export_peak_memory_stays_far_below_the_weights(tmp_path):
    ckpt = make_random(tmp_path / "big", nextn=0, **BIG)
    weights = (ckpt / "model.safetensors").stat().st_size
    assert weights > 250e6
    r = _export_in_child(make_random(tmp_path / "small", nextn=0), ckpt, tmp_path / "out")
    grown = r["peak"] - r["before"]
    print(f"export of {weights / 2**20:.0f} MiB of weights: peak RSS +{grown / 2**20:.0f} MiB, {r['seconds']:.1f} s")
    # measured: +77 MiB (0.27x); holding the model once would be 1x, the exporter before streaming reached ~5x
    assert grown < 0.45 * weights, f"export peak RSS grew {grown / 2**20:.0f} MiB for {weights / 2**20:.0f} MiB"
    m = Manifest.load(tmp_path / "out", verify_hashes=True)
    assert m.raw["weights"]["bytes"] >= 0.95 * weights  # every weight was written, once


@pytest.mark.slow
@pytest.mark.parametrize("options, weights", [
    (dict(quant_scheme="int8"), 0.4),
    # TensorRT's graphs hold the experts twice, in the static MoE form (prompts) and the gather form (step graphs):
    # about two bytes per expert weight
    (dict(quant_scheme="fp8", moe_form="tensorrt"), 0.55)])
def test_fp8_checkpoint_quantizes_without_a_float_copy(tmp_path, options, weights):
    """An FP8 block checkpoint exported with --quant int8 (or fp8): each tensor is dequantized as it is read and
    quantized at once (fp8: its stored bytes moved), a layer's experts one at a time, so the peak grows by a small
    part of the model's float32 size (holding it would be 1x; the bound is the float32 export's, whose fixed part is
    the traced graphs)."""
    from test_loader import write_fp8_checkpoint

    ckpt = make_random(tmp_path / "big", nextn=0, **BIG)
    as_fp32 = (ckpt / "model.safetensors").stat().st_size
    fp8 = write_fp8_checkpoint(ckpt, tmp_path / "fp8", (128, 128))
    small = write_fp8_checkpoint(make_random(tmp_path / "small", nextn=0), tmp_path / "small-fp8", (128, 128))
    r = _export_in_child(small, fp8, tmp_path / "out", **options)
    grown = r["peak"] - r["before"]
    print(f"{options['quant_scheme']} export of an FP8 checkpoint ({as_fp32 / 2**20:.0f} MiB as float32): peak RSS "
          f"+{grown / 2**20:.0f} MiB, {r['seconds']:.1f} s")
    # measured: int8 +95 MiB (0.34x), as the float32 export of the same model; fp8 +74 MiB (0.26x)
    assert grown < 0.45 * as_fp32, f"export peak RSS grew {grown / 2**20:.0f} MiB for {as_fp32 / 2**20:.0f} MiB"
    m = Manifest.load(tmp_path / "out", verify_hashes=True)
    assert m.quant.name == options["quant_scheme"] and m.raw["weights"]["bytes"] < weights * as_fp32


def test_experts_are_read_one_at_a_time(tmp_path):
    """evaluate_row: a layer's stacked experts, row by row, equal the stacked tensor, each expert's weights read
    once and nothing kept between rows."""
    from mtp_trt.config import ModelConfig
    from mtp_trt.exporters import export as export_mod
    from mtp_trt.exporters.graphs import TargetGraph
    from mtp_trt.exporters.streaming import evaluate, evaluate_row

    ckpt = make_random(tmp_path / "ckpt", nextn=0)
    cfg = ModelConfig.from_file(ckpt / "config.json")
    model, params, read = export_mod._placeholders(ckpt, cfg, 0, torch.float32, 64)
    graph = export_mod.configure(TargetGraph(model, "onnx"), None, True).eval()
    traced = export_mod._trace(graph, C.target_io(cfg, "fp32", "onnx"), cfg, torch.float32, "onnx")
    _, values = fold_graph(traced, params)
    moe = next(n for n in traced.graph.node if n.op_type == "MoE")
    for name in moe.input[3:5]:  # fc1 [E, 2I, D] (gate/up interleaved), fc2 [E, D, I]
        whole, reads, memo = evaluate(values[name], read), [], {}
        rows = [evaluate_row(values[name], e, lambda n: reads.append(n) or read(n), memo)
                for e in range(whole.shape[0])]
        assert all(torch.equal(r, whole[e]) for e, r in enumerate(rows))
        assert len(reads) == len(set(reads)) == whole.shape[0] * (2 if name == moe.input[3] else 1)
        assert memo == {}


def test_streamed_initializers_equal_torchs_own_folding(tmp_path):
    """The streamed export and torch's exporter holding the real model (export_params, constant folding) give
    graphs with the same nodes, and each initializer torch folds has its value among the streamed ones."""
    from mtp_trt.exporters import export as export_mod
    from mtp_trt.exporters.graphs import TargetGraph
    from mtp_trt.exporters.loader import load_checkpoint

    ckpt = make_random(tmp_path / "ckpt", nextn=1, kv_lora_rank=12)  # kv_lora 12: folded MLA matrices too
    out = export(ckpt, tmp_path / "out", nextn=1, max_seq_len=32)
    streamed = onnx.load(str(out / "target.onnx"))  # external data resolved from weights.bin
    cfg_model = load_checkpoint(ckpt, nextn=1, max_positions=32)
    io = C.target_io(cfg_model.cfg, "fp32", "onnx")
    args = tuple(export_mod._example(s, cfg_model.cfg, torch.float32) for s in io[0])
    axes = {s["name"]: {i: d for i, d in enumerate(s["shape"]) if isinstance(d, str)} for s in io[0] + io[1]}
    ref_path = tmp_path / "ref.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer notices
        think_ids = export_mod.special_token_ids(ckpt)[0]
        graph = export_mod.configure(TargetGraph(cfg_model, "onnx", think_ids), None,
                                     export_mod.check_cpu_ops(None, "onnx", "fp32", None))  # as export() does
        torch.onnx.export(graph.eval(), args, str(ref_path), dynamo=False,
                          opset_version=export_mod.OPSET, do_constant_folding=True,
                          input_names=[s["name"] for s in io[0]], output_names=[s["name"] for s in io[1]],
                          dynamic_axes=axes)
    ref = onnx.load(str(ref_path))
    ops = lambda m: sorted(n.op_type for n in m.graph.node if n.op_type not in ("Constant", "Identity"))  # noqa: E731
    assert ops(streamed) == ops(ref)
    values = {}
    for t in streamed.graph.initializer:
        a = onnx.numpy_helper.to_array(t)
        values.setdefault((a.dtype.str, a.shape), []).append(a)
    for t in ref.graph.initializer:
        a = onnx.numpy_helper.to_array(t)
        assert any(np.array_equal(a, b) for b in values.get((a.dtype.str, a.shape), [])), t.name


def test_fold_graph_folds_only_what_reads_parameters_or_constants():
    """Constant-only folds become Constant nodes; folds reading a parameter become initializers, computed from
    the real parameter only when asked; nodes reading a graph input stay."""
    from onnx import TensorProto, helper

    w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [2, 3])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
             helper.make_node("Transpose", ["wt"], ["w2"], perm=[1, 0]),
             helper.make_node("Constant", [], ["c"], value=helper.make_tensor("c", TensorProto.FLOAT, [1], [2.0])),
             helper.make_node("Neg", ["c"], ["nc"]),
             helper.make_node("MatMul", ["x", "w2"], ["m"]),
             helper.make_node("Mul", ["m", "nc"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x, w], [y]))
    needed, values = fold_graph(model, {"w": torch.empty(2, 3, device="meta")})
    assert [i.name for i in model.graph.input] == ["x"]
    assert [n.op_type for n in model.graph.node] == ["Constant", "MatMul", "Mul"]  # Neg(c) became a Constant
    assert needed == ["w2"]
    real = torch.arange(6.0).reshape(2, 3)
    from mtp_trt.exporters.streaming import evaluate
    assert torch.equal(evaluate(values["w2"], {"w": real}.__getitem__), real)


@pytest.mark.parametrize("cut", ["data", "header"])
def test_truncated_checkpoint_is_one_error_naming_the_file(tmp_path, cut):
    """A checkpoint cut short (in its tensor data or in its header) fails before anything is written, with
    one error naming the file; no output directory is left."""
    from mtp_trt.errors import MtpTrtError

    ckpt = make_random(tmp_path / "ckpt", nextn=1)
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100] if cut == "data" else data[:50])
    with pytest.raises(MtpTrtError, match=r"model.safetensors: cannot read safetensors header"
                       + (": .*truncated" if cut == "data" else "")):
        export(ckpt, tmp_path / "out", nextn=1, max_seq_len=32)
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["ckpt"]
