"""Quantized weights (`--quant`): the format against a plain per-block reference; a quantized export computes what
the PyTorch reference computes on the same (dequantized) weights; greedy MTP decoding of a quantized export
equals plain greedy decoding of the same export; bad settings fail in one line."""

import numpy as np
import pytest
import torch

from mtp_trt import quant
from mtp_trt.backend import OrtBackend
from mtp_trt.decode import DecodeOptions, generate
from mtp_trt.errors import MtpTrtError
from mtp_trt.exporters.export import export
from mtp_trt.exporters.loader import load_checkpoint
from mtp_trt.manifest import Manifest
from mtp_trt.plugins import ort_lib
from quant_graphs import dequantized_graph, prerounded
from runtime_models import EOS, make_random, make_self_drafting
from test_ort_quant_ops import ops_library, packs_by_default

pytestmark = pytest.mark.skipif(not ort_lib.available()[0], reason="mtp-trt's CPU operators are not available here")


# ------------------------------------------------------------------------------------------- format
def reference_quantize(w: np.ndarray, bits: int, bs: int):
    """The format written out block by block (float64 scale search), independent of mtp_trt.quant's vectorized
    code, each candidate scale rounded to float16 before its levels: -> (levels q [N, blocks, bs] as signed ints,
    scales [N, blocks] float32 holding float16 values)."""
    n, k = w.shape
    nb = -(-k // bs)
    q, s = np.zeros((n, nb, bs), np.int64), np.zeros((n, nb), np.float32)
    hi = (1 << (bits - 1)) - 1
    for r in range(n):
        for b in range(nb):
            blk = np.zeros(bs, np.float32)
            part = w[r, b * bs:(b + 1) * bs]
            blk[:len(part)] = part
            if bits == 8:
                cands = [np.abs(blk).max() / np.float32(hi)]
            else:
                m = blk[np.abs(blk).argmax()]
                cands = [m / np.float32(t) for t in quant.INT4_DIVISORS]
            cands = [np.float32(np.float16(c)) for c in cands]
            best = None
            for c in cands:
                levels = np.clip(np.rint(blk / (c if c else np.float32(1))), -hi - 1, hi)
                err = float(np.square(levels * c - blk).sum())
                if best is None or err < best[0]:
                    best = (err, c, levels)
            s[r, b], q[r, b] = best[1], best[2]
    return q, s


def unpack(data: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return data.astype(np.int64) - 128
    out = np.empty((*data.shape[:-1], data.shape[-1] * 2), np.int64)
    out[..., 0::2], out[..., 1::2] = data & 0xF, data >> 4
    return out - 8


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("bs", quant.BLOCK_SIZES)
@pytest.mark.parametrize("k", [16, 96, 100, 257])
def test_quantize_matches_the_blockwise_reference(bits, bs, k):
    rng = np.random.default_rng(k * bs + bits)
    w = (rng.standard_normal((5, k)) * rng.uniform(0.01, 3, (5, 1))).astype(np.float32)
    w[1] = 0  # an all-zero row: scale 0, levels 0
    w[2, :min(k, 20)] *= 40  # one block dominated by outliers
    s = quant.Scheme("int8" if bits == 8 else "int4", bs)
    data, scales = quant.quantize(w, s)
    assert data.dtype == np.uint8 and scales.dtype == np.float16
    assert data.shape == (5, -(-k // bs), bs * bits // 8) and scales.shape == (5, -(-k // bs))
    q, ref_scales = reference_quantize(w, bits, bs)
    np.testing.assert_array_equal(unpack(data, bits), q)
    np.testing.assert_array_equal(scales.astype(np.float32), ref_scales)
    back = quant.dequantize(data, scales, k, bits)
    assert back.shape == w.shape and back.dtype == np.float32
    np.testing.assert_array_equal(back, (q * ref_scales[..., None]).reshape(5, -1)[:, :k].astype(np.float32))
    step = np.repeat(np.abs(ref_scales), bs, 1)[:, :k]
    # int8: half a level; int4: its scale search may clip (divisors down to -9: a value of the block's largest
    # magnitude lands up to 2 levels beyond the grid) to lower the block's squared error
    assert np.all(np.abs(back - w) <= step * (0.5 if bits == 8 else 2.0) * (1 + 1e-6) + 1e-6)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_tiny_weights_keep_subnormal_scales_and_huge_ones_are_refused(name):
    """Float16 scales: blocks of weights far below float16's normal range keep subnormal scales whose rounding
    moves each weight by at most |q| * 2^-25 beyond the levels' own rounding; a scale beyond float16's range is
    an error, not an infinity."""
    s = quant.Scheme(name, 32)
    w = np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32) * np.float32(1e-5)
    data, scales = quant.quantize(w, s)
    assert np.all(np.abs(scales.astype(np.float32)) < 6.2e-5) and np.any(scales != 0)
    back = quant.dequantize(data, scales, 64, s.bits)
    hi = (1 << (s.bits - 1))
    exact_step = np.repeat(np.abs(w).reshape(8, 2, 32).max(-1) / (hi - 1), 32, 1)  # the unrounded scales' step
    assert np.all(np.abs(back - w) <= exact_step * (0.5 if s.bits == 8 else 2.0) * 1.01 + hi * 2.0 ** -25)
    with pytest.raises(ValueError, match="beyond float16's 65504"):
        quant.quantize(np.full((1, 32), 1e9, np.float32), s)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_requantizing_quantized_weights_is_lossless(name):
    """What tests/quant_graphs.prerounded relies on: weights already on the grid come back unchanged (up to the
    rounding of a scale recomputed from them: one float ulp)."""
    s = quant.Scheme(name, 32)
    w = np.random.default_rng(1).standard_normal((64, 200)).astype(np.float32)
    once = quant.dequantize(*quant.quantize(w, s), 200, s.bits)
    np.testing.assert_allclose(quant.dequantize(*quant.quantize(once, s), 200, s.bits), once, rtol=3e-7, atol=0)


@pytest.mark.parametrize("name, size, message", [
    ("int3", None, "--quant: unknown scheme 'int3'; expected one of none, int8, int4"),
    ("int4", 48, "--group-size: must be one of 16, 32, 64, 128, 256, got 48"),
    ("int8", 0, "--group-size: must be one of"),
])
def test_bad_settings_name_the_flag(name, size, message):
    with pytest.raises(MtpTrtError, match=message.replace("(", r"\(").replace(")", r"\)")):
        quant.scheme(name, size)


# ------------------------------------------------------------------------------------------- exports
# per-head W^UK [4, 40, 64] and W^UV [4, 24, 64]: large enough to be quantized (exporters/quantize.py MIN_ELEMENTS),
# W^UK's K = 40 not a multiple of the block
WIDE_MLA = dict(kv_lora_rank=64, qk_nope_head_dim=40, v_head_dim=24)

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_random(tmp_path_factory.mktemp("q") / "model", nextn=1, **WIDE_MLA)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_export_computes_the_reference_on_the_dequantized_weights(ckpt, tmp_path, name):
    """Prefill logits of a quantized export of a checkpoint already on the grid: with its quantized nodes
    replaced by float ones over the dequantized bytes, equal to the PyTorch reference (fp32 tolerance: the
    rewrite places every weight right); as exported (int8 activations), close to it."""
    scheme = quant.Scheme(name, 32)
    rounded = prerounded(ckpt, tmp_path / "rounded", scheme)
    out = export(rounded, tmp_path / "exp", nextn=1, max_seq_len=64, trees="none", quant_scheme=name,
                 group_size=32)
    m = Manifest.load(out)
    assert m.raw["quant"]["scheme"] == name and m.raw["quant"]["block_size"] == 32
    ids, feed = _prefill_feed(m.config)
    with torch.no_grad():
        ref = load_checkpoint(rounded, max_positions=64)(torch.from_numpy(ids).long())[0].numpy()
    exact = ort_lib.session(dequantized_graph(out / "target.onnx")).run(["logits"], feed)[0]
    np.testing.assert_allclose(exact, ref, atol=1e-4, rtol=1e-4)
    # As exported, the activations are rounded to int8 per 8 values: on this random model most positions stay
    # close and a few drift (ONNX Runtime's own MatMulNBits with int8 activations drifts the same way).
    quantized = ort_lib.session(str(out / "target.onnx")).run(["logits"], feed)[0]
    assert np.median(np.abs(quantized - ref)) < 0.02 * np.abs(ref).max()
    assert (quantized.argmax(-1) == ref.argmax(-1)).mean() > 0.85


@pytest.mark.parametrize("param, int4_bits", [
    ("lm_head.weight", 8), ("model.embed_tokens.weight", 8),  # the output head (tied: over embed_tokens)
    ("model.layers.3.self_attn.kv_a_proj_with_mqa.weight", 8), ("model.layers.3.self_attn.q_a_proj.weight", 8),
    ("model.layers.0.mlp.down_proj.weight", 8),
    ("model.layers.10.mlp.down_proj.weight", 4), ("model.layers.0.mlp.up_proj.weight", 4),
    ("model.layers.0.mlp.shared_experts.down_proj.weight", 4), ("model.layers.3.self_attn.o_proj.weight", 4),
    ("model.layers.3.self_attn.q_b_proj.weight", 4), ("model.layers.3.mlp.experts.5.down_proj.weight", 4),
])
def test_int4_keeps_a_few_weights_at_int8(param, int4_bits):
    from mtp_trt.exporters.quantize import matmul_scheme

    assert matmul_scheme({param}, quant.Scheme("int4", 64)) == quant.Scheme(f"int{int4_bits}", 64)
    assert matmul_scheme({param}, quant.Scheme("int8", 64)) == quant.Scheme("int8", 64)


def test_int4_export_stores_the_kept_weights_at_int8(ckpt, tmp_path):
    """One int8 QMatMul per layer (q_a_proj fused with kv_a_proj_with_mqa) and the output head, the first layer's
    dense MLP (one QMoE node without routed experts) with its down-projection at int8, each attention's W^UK and
    W^UV at int8 (MlaSelfAttention's w_uk_q, w_uv_q: 32 bytes a block of 32, no float w_uk, w_uv); every other
    QMatMul and the QMoE nodes at int4."""
    import onnx

    out = export(ckpt, tmp_path / "exp", nextn=1, max_seq_len=64, trees="none", quant_scheme="int4")
    cfg = Manifest.load(out).config
    graph = onnx.load(str(out / "target.onnx"), load_external_data=False).graph
    attr = lambda n, name: next((a.i for a in n.attribute if a.name == name), None)  # noqa: E731
    bits = [(n.op_type, attr(n, "bits"), attr(n, "down_bits"), n.input[1] == "") for n in graph.node
            if n.op_type in ("QMatMul", "QMoE", "GatherBlockQuantized")]
    assert sum(b[:2] == ("QMatMul", 8) for b in bits) == cfg.num_hidden_layers + 1
    dense = [b for b in bits if b[0] == "QMoE" and b[3]]  # (no gate: a dense MLP)
    assert len(dense) == cfg.first_k_dense_replace and (not dense or dense[0][1:3] == (4, 8))
    assert all(b[1:3] == (4, None) for b in dense[1:])
    assert ("QMatMul", 4, None, False) in bits and ("QMoE", 4, None, False) in bits
    assert not any(b[0] == "QMoE" and b[1] == 8 for b in bits)
    shapes = {i.name: list(i.dims) for i in graph.initializer}
    mla = [n for n in graph.node if n.op_type == "MlaSelfAttention"]
    assert len(mla) == cfg.num_hidden_layers
    for n in mla:
        assert n.input[10:12] == ["", ""] and len(n.input) == 16
        h, dn, dl, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
        assert shapes[n.input[12]] == [h, dl, -(-dn // 32), 32] and shapes[n.input[14]] == [h, dv, -(-dl // 32), 32]


@pytest.mark.slow
def test_quantized_weights_are_smaller(ckpt, tmp_path):
    sizes = {name: Manifest.load(export(ckpt, tmp_path / name, nextn=1, max_seq_len=64, trees="none",
                                        quant_scheme=name)).raw["weights"]["bytes"] for name in ("none", "int8",
                                                                                                 "int4")}
    assert sizes["int4"] < sizes["int8"] < sizes["none"]


@pytest.fixture(scope="module")
def drafting(tmp_path_factory):
    root = tmp_path_factory.mktemp("qdecode")
    return make_self_drafting(root / "ckpt", nextn=3, **WIDE_MLA), root


PROMPTS = [[5, 17, 33, 2, 8, 41, 7, 19], [60, 3], [11, 12, 13, 14, 15]]


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("mode", ["eagle", pytest.param("vanilla", marks=pytest.mark.slow)])
def test_greedy_mtp_on_a_quantized_export_equals_its_plain_greedy_decoding(drafting, name, mode):
    ckpt, root = drafting
    out = export(ckpt, root / f"{mode}-{name}", nextn=3, mtp_mode=mode, max_seq_len=128, trees="none",
                 quant_scheme=name)
    lib = ops_library()
    packs = packs_by_default(lib)
    assert OrtBackend(Manifest.load(out)).pack_weights  # (a small export: packed by default)
    for pack in (False, True):  # the operators reading the weights as stored, then packed (the demo's default)
        before = lib.MtpOrtPackedBytes()
        backend = OrtBackend(Manifest.load(out), pack_weights=pack)
        plain, _ = generate(backend, PROMPTS, DecodeOptions(nextn=0, max_new_tokens=20, eos_ids=(EOS,)))
        for nextn in (1, 2, 3):
            seqs, stats = generate(backend, PROMPTS, DecodeOptions(nextn=nextn, max_new_tokens=20, eos_ids=(EOS,)))
            assert [s.generated for s in seqs] == [s.generated for s in plain]
            assert stats.mean_acceptance_length > 1.2, "drafts must be partly accepted for this test to bite"
        assert (lib.MtpOrtPackedBytes() > before) == (pack and packs)
        del backend


def test_quantized_export_for_onnx_runtime_needs_the_cpu_operators(ckpt, tmp_path):
    with pytest.raises(MtpTrtError, match="--quant int4: quantized weights run on mtp-trt's CPU operators; drop"):
        export(ckpt, tmp_path / "a", quant_scheme="int4", cpu_ops=False)
    with pytest.raises(MtpTrtError, match="--quant int8: .*--dtype fp32"):
        export(ckpt, tmp_path / "b", quant_scheme="int8", dtype="fp16")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ------------------------------------------------------------------------------------------- TensorRT
def _prefill_feed(cfg, b=2, t=64):
    ids = np.random.default_rng(0).integers(0, 90, (b, 9)).astype(np.int32)
    feed = {"input_ids": ids, "past_len": np.zeros(b, np.int32), "thinking": np.zeros(b, np.int32),
            "relaxed_topk": np.array(0, np.int32), "relaxed_delta": np.array(0, np.float32)}
    return ids, feed | {f"kv_{i}": np.zeros((b, t, cfg.latent_dim), np.float32) for i in range(cfg.num_hidden_layers)}


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_tensorrt_form_dequantizes_to_the_reference(ckpt, tmp_path, name):
    """Graphs for TensorRT carry each quantized weight as INT4/INT8 levels and a blocked DequantizeLinear before
    its matmul; ONNX Runtime runs that form too (in float: ort_lib.float_dequantized_matmuls), so on a checkpoint
    already on the grid its logits equal the PyTorch reference's at fp32 tolerance."""
    import onnx

    scheme = quant.Scheme(name, 32)
    rounded = prerounded(ckpt, tmp_path / "rounded", scheme)
    out = export(rounded, tmp_path / "exp", nextn=1, max_seq_len=64, trees="none", moe_form="tensorrt",
                 quant_scheme=name, group_size=32)
    graph = onnx.load(str(out / "target.onnx"), load_external_data=False).graph
    dq = [n for n in graph.node if n.op_type == "DequantizeLinear"]
    types = {i.name: i.data_type for i in graph.initializer}
    assert len(dq) >= 2 * Manifest.load(out).config.num_hidden_layers
    assert {types[n.input[0]] for n in dq} <= {onnx.TensorProto.INT4, onnx.TensorProto.INT8}
    ids, feed = _prefill_feed(Manifest.load(out).config)
    with torch.no_grad():
        ref = load_checkpoint(rounded, max_positions=64)(torch.from_numpy(ids).long())[0].numpy()
    logits = ort_lib.session(str(out / "target.onnx")).run(["logits"], feed)[0]  # (float activations)
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.trt
@pytest.mark.slow  # (tests/test_trt_build.py builds plugin engines by default)
def test_quantized_plugin_export_builds_engines(ckpt, tmp_path):
    from mtp_trt.trt import builder, compat
    from mtp_trt.trt import manifest as em

    exp = export(ckpt, tmp_path / "exp", nextn=1, lowering="plugin", dtype="fp16", max_seq_len=64, trees="none",
                 quant_scheme="int4")
    assert Manifest.load(exp).quant == quant.Scheme("int4", 32)
    api, cc = compat.load("auto"), compat.gpu()[0]
    arch = "native" if cc and cc in api.buildable_archs() else "8.9"
    m = em.EngineManifest.load(builder.build(exp, tmp_path / "engines", target_arch=arch), verify_hashes=True)
    assert set(m.engines) == {"target", "mtp_0", "step_0", "step_1"}


@pytest.mark.parametrize("axis", [-3, -1, 0, 1, 2, 3])
def test_the_exporter_folds_flatten_as_onnx_defines_it(axis):
    """Flatten over weights is folded by the exporter (q_b_proj's per-head parts become one 2-D matrix, which
    --quant quantizes), with ONNX's semantics."""
    from onnx import helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    from mtp_trt.exporters.streaming import FOLD

    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    node = helper.make_node("Flatten", ["x"], ["y"], axis=axis)
    graph = helper.make_graph([node], "g", [], [helper.make_tensor_value_info("y", 1, None)],
                              [numpy_helper.from_array(x, "x")])
    want = ReferenceEvaluator(helper.make_model(graph)).run(None, {})[0]
    got = FOLD["Flatten"]({"axis": axis}, [torch.from_numpy(x)]).numpy()
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)
