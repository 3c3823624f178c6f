"""`--quant fp8`: FP8 weights with block scales for TensorRT.  An FP8 checkpoint's e4m3 bytes and scales reach the
export unchanged (checked against the safetensors files); the export computes what the PyTorch reference computes
on the dequantized weights; a float checkpoint is quantized as a NumPy reference does it; engines build with
TensorRT for RTX; bad combinations end in one line."""

import subprocess

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from safetensors.torch import load_file

from mtp_trt import quant
from mtp_trt.errors import MtpTrtError
from mtp_trt.exporters.export import export
from mtp_trt.exporters.loader import load_checkpoint
from mtp_trt.manifest import Manifest
from mtp_trt.plugins import ort_lib
from runtime_models import make_random
from test_loader import write_fp8_checkpoint
from test_quant import _prefill_feed

# Every linear layer's input width a multiple of 128 (hidden, q LoRA, experts, dense MLP, heads x v_head_dim), so
# that every weight the graphs multiply by has whole FP8 blocks along K; kv_a_proj_with_mqa (40 rows) and
# q_b_proj (96) have partial 128 x 128 blocks along their rows.
SHAPES = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, q_lora_rank=128, v_head_dim=32)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    ckpt = make_random(root / "float", nextn=1, **SHAPES)
    return ckpt, write_fp8_checkpoint(ckpt, root / "fp8", (128, 128))


@pytest.fixture(scope="module")
def fp8_export(ckpts, tmp_path_factory):
    """The FP8 checkpoint exported for TensorRT in fp32 (standard operators: ONNX Runtime runs it too), eagle nextn 2:
    step_2 reads the one MTP module's weights twice."""
    return export(ckpts[1], tmp_path_factory.mktemp("fp8x") / "exp", nextn=2, max_seq_len=64, trees="none",
                  moe_form="tensorrt", quant_scheme="fp8")


def _dq_weights(path, axis: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(e4m3 codes uint8, scales) of every DequantizeLinear of a graph blocked along `axis` (0: a MatMul's W^T
    [K, N]; 2: the gather MoE form's stacked experts [E, R, K]), with checks of their form."""
    model = onnx.load(str(path))
    inits = {i.name: i for i in model.graph.initializer}
    out = []
    for n in model.graph.node:
        if n.op_type != "DequantizeLinear":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs in ({"axis": 0, "block_size": 128}, {"axis": 2, "block_size": 128})
        if attrs["axis"] != axis:
            continue
        data, scales = inits[n.input[0]], inits[n.input[1]]
        assert data.data_type == onnx.TensorProto.FLOAT8E4M3FN and scales.data_type == onnx.TensorProto.FLOAT
        codes = np.frombuffer(numpy_helper.to_array(data).tobytes(), np.uint8).reshape(list(data.dims))
        out.append((codes, numpy_helper.to_array(scales)))
    return out


def _stored(ckpt) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    t = load_file(ckpt / "model.safetensors")
    return {name: (w.view(torch.uint8).numpy(), t[name + "_scale_inv"].numpy()) for name, w in t.items()
            if w.dtype == torch.float8_e4m3fn}


# --------------------------------------------------------------------------------------------------- format
def test_e4m3_table_decodes_every_code_as_torch_does():
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(quant.E4M3, want)  # NaN at 0x7F and 0xFF in both


def test_fp8_quantize_matches_a_numpy_reference():
    """Per block of 128 along K of each column: scale = largest magnitude / 448, each value the nearest e4m3 value
    of value / scale (found by search over the 256 codes); an all-zero block has scale 0."""
    from mtp_trt.exporters.quantize import fp8_quantize

    rng = np.random.default_rng(0)
    wt = (rng.standard_normal((256, 24)) * rng.uniform(0.01, 3, (1, 24))).astype(np.float32)
    wt[128:, 3] = 0
    codes, scales = fp8_quantize(torch.from_numpy(wt))
    assert codes.dtype == np.uint8 and scales.dtype == np.float32 and scales.shape == (2, 24)
    want = np.abs(wt).reshape(2, 128, 24).max(1) / np.float32(448)
    np.testing.assert_array_equal(scales, want)
    assert scales[1, 3] == 0 and not codes[128:, 3].any()
    finite = np.where(np.isnan(quant.E4M3), np.inf, quant.E4M3)
    x = wt / np.where(want == 0, 1, want).repeat(128, 0)
    nearest = np.abs(x[..., None] - finite).min(-1)
    np.testing.assert_array_equal(np.abs(x - quant.E4M3[codes]), nearest)  # a nearest value (ties: either)
    back = quant.fp8_dequantize(codes, scales)
    assert np.all(np.abs(back - wt) <= np.abs(wt) * 2.0 ** -4 + np.repeat(scales, 128, 0) * 2.0 ** -10)


@pytest.mark.parametrize("size, message", [
    (64, "--group-size: --quant fp8 scales blocks of 128 weights (DeepSeek's FP8 blocks); leave it out, got 64"),
    (None, None), (128, None)])
def test_fp8_blocks_are_128(size, message):
    if message is None:
        assert quant.scheme("fp8", size) == quant.Scheme("fp8", 128)
    else:
        with pytest.raises(MtpTrtError, match=message.replace("(", r"\(").replace(")", r"\)")):
            quant.scheme("fp8", size)


# --------------------------------------------------------------------------------------------------- exports
def test_fp8_export_keeps_the_checkpoints_bytes_and_scales(ckpts, fp8_export):
    """Every FP8 weight of the checkpoint is in the export's DequantizeLinear weights as stored: W^T's e4m3 codes
    byte for byte and each 128 x 128 block's scale repeated over its 128 columns -- alone (o_proj, q_b_proj,
    down-projections, eh_proj) or concatenated as the graphs multiply them (q_a_proj with kv_a_proj_with_mqa,
    gate with up, the static MoE form's stacked experts)."""
    stored = _stored(ckpts[1])
    dq = _dq_weights(fp8_export / "target.onnx") + _dq_weights(fp8_export / "mtp_0.onnx")

    def present(parts: list[str], axis: int = 0) -> bool:
        """W_i [O_i, I] concatenated along the output (axis 0) or the input (axis 1), as W^T [K, N]."""
        codes = np.concatenate([stored[p][0] for p in parts], axis).T
        rows = [np.repeat(stored[p][1], 128, 0)[:stored[p][0].shape[0]].T for p in parts]  # [I / 128, O_i] each
        scales = np.concatenate(rows, 1 - axis)
        return any(c.shape == codes.shape and np.array_equal(c, codes) and np.array_equal(s, scales)
                   for c, s in dq)

    layers = [f"model.layers.{i}" for i in range(4)]  # 3 layers, then the MTP module
    for i, layer in enumerate(layers):
        attn = f"{layer}.self_attn"
        assert present([f"{attn}.q_a_proj.weight", f"{attn}.kv_a_proj_with_mqa.weight"]), attn
        assert present([f"{attn}.q_b_proj.weight"]) and present([f"{attn}.o_proj.weight"]), attn
        mlp = f"{layer}.mlp"
        if i == 0:  # the dense layer
            assert present([f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"])
            assert present([f"{mlp}.down_proj.weight"])
            continue
        shared = f"{mlp}.shared_experts"
        assert present([f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight"]), shared
        assert present([f"{shared}.down_proj.weight"]), shared
        experts = [f"{mlp}.experts.{e}" for e in range(8)]
        assert present([f"{x}.gate_proj.weight" for x in experts] + [f"{x}.up_proj.weight" for x in experts]), mlp
        assert present([f"{x}.down_proj.weight" for x in experts], axis=1), mlp
    assert present(["model.layers.3.eh_proj.weight"])
    assert len(dq) == 5 + 2 * 7 + 8  # nothing else: the output head stays float
    m = Manifest.load(fp8_export)
    assert m.quant == quant.Scheme("fp8", 128) and m.raw["quant"]["scheme"] == "fp8"


def test_fp8_gather_form_keeps_the_experts_bytes_and_scales(ckpts, fp8_export):
    """The few-token step graphs' `gather` MoE form: each layer's stacked experts fc1 [E, 2I, D] (gate and up rows
    interleaved) and fc2 [E, D, I] as the checkpoint stores them, scales per row and block of 128 along the input,
    dequantized before the per-token Gather (never a Gather of the quantized bytes)."""
    stored = _stored(ckpts[1])
    dq = _dq_weights(fp8_export / "step_1.onnx", axis=2)
    for layer in ("model.layers.1", "model.layers.2", "model.layers.3"):
        ex = [f"{layer}.mlp.experts.{e}" for e in range(8)]
        gate = np.stack([stored[f"{x}.gate_proj.weight"][0] for x in ex])  # [E, I, D]
        up = np.stack([stored[f"{x}.up_proj.weight"][0] for x in ex])
        fc1 = np.stack([gate, up], 2).reshape(8, -1, gate.shape[-1])
        scale = lambda name: np.repeat(stored[name][1], 128, 0)[:stored[name][0].shape[0]]  # noqa: E731 [O, I / 128]
        s1 = np.stack([np.stack([scale(f"{x}.gate_proj.weight"), scale(f"{x}.up_proj.weight")], 1).reshape(-1, 1)
                       for x in ex])
        fc2 = np.stack([stored[f"{x}.down_proj.weight"][0] for x in ex])
        s2 = np.stack([scale(f"{x}.down_proj.weight") for x in ex])
        for codes, scales in ((fc1, s1), (fc2, s2)):
            assert any(np.array_equal(c, codes) and np.array_equal(s, scales) for c, s in dq), layer
    graph = onnx.load(str(fp8_export / "step_1.onnx"), load_external_data=False).graph
    quantized = {i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT8E4M3FN}
    assert all(n.op_type == "DequantizeLinear" for n in graph.node for i in n.input if i in quantized)


def test_fp8_export_computes_the_reference_on_the_dequantized_weights(ckpts, fp8_export):
    """ONNX Runtime runs the FP8 DequantizeLinear form on the CPU: its prefill logits equal the PyTorch reference
    model's on the checkpoint as the loader dequantizes it (fp32 tolerance)."""
    ids, feed = _prefill_feed(Manifest.load(fp8_export).config)
    with torch.no_grad():
        ref = load_checkpoint(ckpts[1], max_positions=64)(torch.from_numpy(ids).long())[0].numpy()
    logits = ort_lib.session(str(fp8_export / "target.onnx")).run(["logits"], feed)[0]
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=1e-4)


def _greedy(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    """The PyTorch reference model's greedy tokens (the whole sequence again at each step)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(new):
                ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
            out.append(ids[len(p):])
    return out


@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
def test_greedy_decoding_of_tensorrt_form_exports_equals_the_reference(ckpts, fp8_export, tmp_path, name):
    """The step graphs (their experts in the `gather` form, dequantized before the Gather) on ONNX Runtime: plain
    greedy decoding gives the PyTorch reference model's greedy tokens on the same weights (the FP8 checkpoint as the
    loader dequantizes it; for int8 / int4 a checkpoint already on their grid), and greedy MTP decoding (nextn 1, and
    nextn 2, whose step graph reads the eagle MTP module's weights twice: each dequantized once) the same tokens."""
    from mtp_trt.backend import OrtBackend
    from mtp_trt.decode import DecodeOptions, generate
    from quant_graphs import prerounded

    ckpt, out = ckpts[1], fp8_export
    if name != "fp8":
        ckpt = prerounded(ckpts[0], tmp_path / "rounded", quant.Scheme(name, 32))
        out = export(ckpt, tmp_path / "exp", nextn=2, max_seq_len=64, trees="none", moe_form="tensorrt",
                     quant_scheme=name, group_size=32)
    graph = onnx.load(str(out / "step_2.onnx"), load_external_data=False).graph
    assert any(n.op_type == "DequantizeLinear" and n.attribute[0].i == 2 for n in graph.node)  # the gather form's
    made = [o for n in graph.node for o in n.output]
    assert len(made) == len(set(made))  # each value made once (SSA), though two drafts read the MTP module
    prompts, new = [[5, 17, 33, 2, 8, 41, 7, 19], [60, 3]], 12
    want = _greedy(load_checkpoint(ckpt, max_positions=64), prompts, new)
    backend = OrtBackend(Manifest.load(out))
    for nextn in (0, 1, 2):
        seqs, _ = generate(backend, prompts, DecodeOptions(nextn=nextn, max_new_tokens=new, eos_ids=()))
        assert [s.generated for s in seqs] == want, nextn


@pytest.mark.parametrize("source", ["float", "fp8-16x8"])
def test_fp8_export_quantizes_what_the_checkpoint_does_not_store_in_fp8_blocks(ckpts, tmp_path, source):
    """A float checkpoint, and FP8 blocks narrower than 128 along the input (no 128 values along K share a stored
    scale): each weight quantized from its float32 value, as fp8_quantize's NumPy reference check does it; the
    same bytes in an fp16 export as in the fp32 one (quantized from float32 either way)."""
    from mtp_trt.exporters.quantize import fp8_quantize

    ckpt = ckpts[0] if source == "float" else write_fp8_checkpoint(ckpts[0], tmp_path / "fp8", (16, 8))
    out = export(ckpt, tmp_path / "exp", nextn=1, max_seq_len=64, trees="none", moe_form="tensorrt",
                 quant_scheme="fp8")
    half = export(ckpt, tmp_path / "half", nextn=1, max_seq_len=64, trees="none", moe_form="tensorrt",
                  quant_scheme="fp8", dtype="fp16")
    dq = _dq_weights(out / "target.onnx")
    for (c, s), (c16, s16) in zip(dq, _dq_weights(half / "target.onnx")):
        assert np.array_equal(c, c16) and np.array_equal(s, s16)
    model = load_checkpoint(ckpt)
    w = model.model.layers[1].self_attn.o_proj.weight.detach().T.contiguous()  # W^T, as the loader reads it
    codes, scales = fp8_quantize(w)
    assert any(np.array_equal(c, codes) and np.array_equal(s, scales) for c, s in dq)
    graph = onnx.load(str(half / "target.onnx"), load_external_data=False).graph
    casts = [n for n in graph.node if n.op_type == "Cast" and n.input[0].endswith(".dequantized")]
    assert len(casts) == len(dq)  # float32 scales, the dequantized weight cast to fp16


def test_fp8_nan_codes_are_one_error_naming_the_tensor(ckpts, tmp_path):
    """The stored e4m3 bytes are checked as they are kept: a NaN code (0x7F / 0xFF) is one error naming the file and
    tensor, and no output is left."""
    import shutil

    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    shutil.copytree(ckpts[1], bad)
    t = load_file(bad / "model.safetensors")
    name = "model.layers.1.self_attn.o_proj.weight"
    codes = t[name].view(torch.uint8).clone()
    codes[3, 5] = 0xFF
    t[name] = codes.view(torch.float8_e4m3fn)
    save_file(t, bad / "model.safetensors")
    with pytest.raises(MtpTrtError, match=rf"model.safetensors: tensor '{name}' holds 1 NaN or infinite value\(s\) "
                                          r"\(as float8_e4m3fn\)"):
        export(bad, tmp_path / "out", nextn=1, max_seq_len=64, trees="none", moe_form="tensorrt", quant_scheme="fp8")
    assert not (tmp_path / "out").exists()


def test_fp8_is_for_tensorrt_graphs_only(ckpts, tmp_path):
    """The CPU path (the onnx lowering with mtp-trt's operators) has no FP8 operators: one line saying what to use."""
    with pytest.raises(MtpTrtError, match=r"--quant fp8: FP8 weights are for TensorRT engines: export with "
                                          r"--lowering plugin or --moe-form tensorrt"):
        export(ckpts[1], tmp_path / "a", quant_scheme="fp8")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("args, message", [
    (["--quant", "fp8"], "error: --quant fp8: FP8 weights are for TensorRT engines"),
    (["--quant", "fp8", "--group-size", "32", "--lowering", "plugin"], "error: --group-size: --quant fp8 scales"),
])
def test_bad_fp8_requests_are_one_line(ckpts, tmp_path, args, message):
    r = subprocess.run(["mtp-trt", "export", str(ckpts[1]), "-o", str(tmp_path / "out"), *args],
                       capture_output=True, text=True)
    *before, last = r.stderr.strip().splitlines()
    # one line, after at most the line of the export's first stage (torch's import and the checks)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert last.startswith(message) and all(x.endswith("loading torch, checking the checkpoint") for x in before) \
        and len(before) <= 1, r.stderr
    assert not (tmp_path / "out").exists()


def test_fp8_engines_need_compute_capability_8_9():
    """Without a GPU the default architectures keep those FP8 can be built for; one named below 8.9 is refused."""
    from mtp_trt.trt.builder import quant_archs

    class Export:
        quant = quant.Scheme("fp8", 128)

    archs = ["8.0", "8.6", "8.9", "12.0", "12.1"]
    assert quant_archs(Export, archs, None) == ["8.9", "12.0", "12.1"]
    assert quant_archs(Export, archs, "auto") == ["8.9", "12.0", "12.1"]
    with pytest.raises(MtpTrtError, match=r"--target-arch 8.6: the export's FP8 weights \(--quant fp8\) need compute "
                                          r"capability 8.9 or newer"):
        quant_archs(Export, ["8.6", "8.9"], "8.6,8.9")
    Export.quant = quant.Scheme("int4", 32)
    assert quant_archs(Export, archs, "8.0,8.6,8.9,12.0,12.1") == archs


def test_check_compares_fp8_engines_with_the_same_fp8_weights(ckpts, tmp_path):
    """`mtp-trt check`'s reference for FP8 engines (a plugin-lowering fp16 export): the onnx-lowering export of the
    same checkpoint in the DequantizeLinear form, fp32, with the same FP8 bytes and scales."""
    from mtp_trt.trt.check import _reference

    plug = export(ckpts[1], tmp_path / "plug", nextn=1, lowering="plugin", dtype="fp16", max_seq_len=64,
                  trees="none", quant_scheme="fp8")
    ref = _reference(Manifest.load(plug), None, tmp_path, lambda msg: None)
    assert ref.lowering == "onnx" and ref.dtype == "fp32" and ref.quant == quant.Scheme("fp8", 128)
    for axis in (0, 2):
        want = _dq_weights(plug / "step_0.onnx", axis)
        got = _dq_weights(ref.root / "step_0.onnx", axis)
        assert len(want) == len(got) > 0
        for c, s in want:
            assert any(np.array_equal(c, c2) and np.array_equal(s, s2) for c2, s2 in got)


@pytest.mark.trt
@pytest.mark.slow
def test_fp8_plugin_export_builds_engines(ckpts, tmp_path):
    """TensorRT for RTX builds the FP8 engines (compute capability 8.9); their sizes beside fp16 and int4 engines of
    the same checkpoint are printed."""
    from mtp_trt.trt import builder
    from mtp_trt.trt import manifest as em

    sizes = {}
    for name in ("fp8", "none", "int4"):
        exp = export(ckpts[1], tmp_path / f"exp-{name}", nextn=1, lowering="plugin", dtype="fp16", max_seq_len=64,
                     trees="none", quant_scheme=name)
        m = em.EngineManifest.load(builder.build(exp, tmp_path / f"eng-{name}", target_arch="8.9",
                                                 flavour="tensorrt_rtx"), verify_hashes=True)
        assert set(m.engines) == {"target", "mtp_0", "step_0", "step_1"}
        sizes[name] = {g: e.bytes for g, e in m.engines.items()}
    print("engine bytes (8.9):", sizes)
    assert sizes["fp8"]["target"] < sizes["none"]["target"]

