"""Checkpoint loading: FP8 block-quantized weights, sharded files, streaming memory, and bad input."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import edit_config, make_hf_model, save_hf_model
from mtp_trt.errors import MtpTrtError
from mtp_trt.exporters.loader import dequantize_fp8, load_checkpoint, quantize_fp8


def _is_fp8_target(name: str, t: torch.Tensor) -> bool:
    """The official V3/R1 checkpoints quantize every linear weight but the router, embedding and head."""
    return t.dim() == 2 and name.endswith(("proj.weight", "proj_with_mqa.weight")) and "embed" not in name


def write_fp8_checkpoint(src, dst, block, shards: int = 1):
    """Rewrite an HF checkpoint in the official FP8 layout: float8_e4m3fn weight + float32 weight_scale_inv."""
    dst.mkdir()
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        if _is_fp8_target(name, t):
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(t, block)
        else:
            tensors[name] = t.to(torch.bfloat16)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, dst / "model.safetensors")
    else:
        # Put each weight and its scale in different shards, as can happen in real indices.
        weight_map = {n: f"model-{i % shards + 1:05d}-of-{shards:05d}.safetensors" for i, n in enumerate(names)}
        for f in set(weight_map.values()):
            save_file({n: tensors[n] for n in names if weight_map[n] == f}, dst / f)
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    return save_hf_model(make_hf_model("moe_qlora_yarn"), tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize("block,shards", [((128, 128), 1), ((16, 8), 3)])
def test_fp8_checkpoint_loads_dequantized(hf_ckpt, tmp_path, block, shards):
    """Each dequantized weight is within half an e4m3 step of the original (2^-4 of the element, or 2^-9 of
    the block scale near zero), and the logits equal transformers' on the same dequantized weights (made
    here with NumPy from the stored fp8 values and scales, independently of the loader)."""
    from transformers import DeepseekV3ForCausalLM

    fp8 = write_fp8_checkpoint(hf_ckpt, tmp_path / "fp8", block, shards)
    got = load_checkpoint(fp8)
    stored = {}
    for f in fp8.glob("*.safetensors"):
        stored.update(load_file(f))
    original = load_file(hf_ckpt / "model.safetensors")
    ours = got.state_dict()
    dequantized = {}
    for name, t in stored.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype != torch.float8_e4m3fn:
            dequantized[name] = t.float()  # stored in bf16
            continue
        scale = stored[name + "_scale_inv"].numpy()
        w = torch.from_numpy(np.kron(scale, np.ones(block, dtype=np.float32))[: t.shape[0], : t.shape[1]]
                             * t.float().numpy())
        orig = original[name]
        bound = torch.maximum(orig.abs() * 2.0**-4, torch.from_numpy(scale).max() * 2.0**-9) * 1.001
        assert ((ours[name] - orig).abs() <= bound).all(), f"{name}: error above half an e4m3 step"
        torch.testing.assert_close(ours[name], w, atol=0, rtol=0)
        dequantized[name] = w
    assert len(stored) - len(dequantized) >= 10, "too few tensors were quantized"
    deq = tmp_path / "dequantized"
    deq.mkdir()
    save_file(dequantized, deq / "model.safetensors")
    (deq / "config.json").write_text((hf_ckpt / "config.json").read_text())
    hf = DeepseekV3ForCausalLM.from_pretrained(deq).eval()
    tokens = torch.randint(0, got.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(got(tokens)[0], hf(tokens).logits, atol=1e-4, rtol=1e-4)


def test_fp8_logits_within_fp8_error_of_bf16_original(tmp_path):
    """At a realistic init scale (std 0.02) FP8 weights move the logits by a few percent of their norm."""
    path = save_hf_model(make_hf_model("moe_qlora_yarn", initializer_range=0.02), tmp_path / "hf")
    ref = load_checkpoint(path, dtype=torch.bfloat16).float()
    got = load_checkpoint(write_fp8_checkpoint(path, tmp_path / "fp8", (128, 128)))
    tokens = torch.randint(0, ref.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref(tokens)[0], got(tokens)[0]
    rel = ((a - b).norm() / a.norm()).item()
    assert 1e-3 < rel < 0.1, f"relative logits error {rel:.3g}"


def test_dequantize_handles_partial_blocks():
    w = torch.randn(40, 20) * 3
    q, s = quantize_fp8(w, (16, 16))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    assert torch.allclose(dequantize_fp8(q, s, (16, 16)), w, rtol=2**-4, atol=1e-6)


def test_streaming_load_peak_memory_is_about_model_size(tmp_path):
    """Loading a ~170 MB checkpoint raises the peak RSS by about the model's size, not twice it."""
    hf = make_hf_model("dense_no_qlora", vocab_size=48000, hidden_size=384, intermediate_size=768)
    path = save_hf_model(hf, tmp_path / "big")
    size = (path / "model.safetensors").stat().st_size
    del hf
    code = textwrap.dedent(f"""
        import resource, torch
        from mtp_trt.exporters.loader import load_checkpoint
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        m = load_checkpoint({str(path)!r}, max_positions=64)
        print(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    """)
    before, after = map(int, subprocess.check_output([sys.executable, "-c", code], text=True).split())
    grown = (after - before) * 1024
    assert grown < 1.35 * size, f"peak RSS grew {grown / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB checkpoint"


# ------------------------------------------------------------------------------- bad input
def _config_only(ckpt, tmp_path):
    """A new checkpoint directory holding a copy of ckpt's config.json and nothing else yet."""
    d = tmp_path / "c"
    d.mkdir()
    (d / "config.json").write_text((ckpt / "config.json").read_text())
    return d


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(MtpTrtError, match="checkpoint directory not found"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MtpTrtError, match=r"empty/config.json: config file not found"):
        load_checkpoint(tmp_path / "empty")


def test_missing_weights_file(hf_ckpt, tmp_path):
    d = _config_only(hf_ckpt, tmp_path)
    with pytest.raises(MtpTrtError, match="no model.safetensors or model.safetensors.index.json"):
        load_checkpoint(d)


def test_missing_tensor_named(hf_ckpt, tmp_path):
    d = _config_only(hf_ckpt, tmp_path)
    t = load_file(hf_ckpt / "model.safetensors")
    del t["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(t, d / "model.safetensors")
    with pytest.raises(MtpTrtError, match=r"missing tensor\(s\) model.layers.1.mlp.experts.3.up_proj.weight"):
        load_checkpoint(d)


def test_wrong_shape_named(hf_ckpt, tmp_path):
    d = _config_only(hf_ckpt, tmp_path)
    t = load_file(hf_ckpt / "model.safetensors")
    t["model.layers.0.self_attn.kv_b_proj.weight"] = t["model.layers.0.self_attn.kv_b_proj.weight"][:, :-1].clone()
    save_file(t, d / "model.safetensors")
    with pytest.raises(MtpTrtError, match=r"model.safetensors: tensor 'model.layers.0.self_attn.kv_b_proj.weight' "
                                          r"has shape \[112, 31\], expected \[112, 32\]"):
        load_checkpoint(d)


def test_missing_shard_named(hf_ckpt, tmp_path):
    d = _config_only(hf_ckpt, tmp_path)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(MtpTrtError, match="names shard 'model-00001-of-00002.safetensors'"):
        load_checkpoint(d)


def test_fp8_without_scale_named(hf_ckpt, tmp_path):
    d = write_fp8_checkpoint(hf_ckpt, tmp_path / "fp8", (128, 128))
    t = load_file(d / "model.safetensors")
    del t["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(t, d / "model.safetensors")
    with pytest.raises(MtpTrtError, match="FP8 tensor 'model.layers.0.self_attn.o_proj.weight' has no "
                                          "'model.layers.0.self_attn.o_proj.weight_scale_inv'"):
        load_checkpoint(d)


@pytest.mark.parametrize("field,value,message", [
    ("scoring_func", "relu", "field 'scoring_func' has unknown value 'relu'; expected one of sigmoid, softmax"),
    ("topk_method", "best", "field 'topk_method' has unknown value 'best'"),
    ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}, "field 'rope_parameters.type' has unknown value 'longrope'"),
    ("hidden_act", "gelu", "field 'hidden_act' has unknown value 'gelu'"),
    ("kv_lora_rank", "32", "field 'kv_lora_rank' must be an integer, got '32'"),
    ("hidden_size", None, "field 'hidden_size' is missing"),
    ("n_group", 3, "field 'n_group' must divide n_routed_experts=8, got 3"),
    ("quantization_config", {"quant_method": "gptq"}, "field 'quantization_config.quant_method' has unsupported value 'gptq'"),
])
def test_bad_config_values_named(hf_ckpt, tmp_path, field, value, message):
    d = _config_only(hf_ckpt, tmp_path)
    (d / "model.safetensors").symlink_to(hf_ckpt / "model.safetensors")
    edit_config(d, **{field: value})
    with pytest.raises(MtpTrtError) as e:
        load_checkpoint(d)
    assert str(e.value) == f"{d / 'config.json'}: {message}" or message in str(e.value)
    assert str(d / "config.json") in str(e.value)


def test_legacy_rope_scaling_spelling(hf_ckpt, tmp_path):
    """The official checkpoints' `rope_theta` + `rope_scaling: {"type": "yarn"}` parse like `rope_parameters`."""
    d = _config_only(hf_ckpt, tmp_path)
    (d / "model.safetensors").symlink_to(hf_ckpt / "model.safetensors")
    params = json.loads((d / "config.json").read_text())["rope_parameters"]
    legacy = {k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")} | {"type": "yarn"}
    edit_config(d, rope_parameters=None, rope_scaling=legacy, rope_theta=params["rope_theta"])
    a, b = load_checkpoint(hf_ckpt), load_checkpoint(d)
    assert a.cfg.rope == b.cfg.rope and a.cfg.softmax_scale == b.cfg.softmax_scale


# ------------------------------------------------------------------------ tensors the model does not use
def _with_tensors(ckpt, tmp_path, add=None, config=None):
    """A copy of ckpt with tensors added (name -> tensor) and config.json fields changed."""
    d = _config_only(ckpt, tmp_path)
    save_file(load_file(ckpt / "model.safetensors") | (add or {}), d / "model.safetensors")
    if config:
        edit_config(d, **config)
    return d


def test_unused_tensor_is_an_error_naming_it(hf_ckpt, tmp_path):
    d = _with_tensors(hf_ckpt, tmp_path, {"model.layers.2.mlp.foo.weight": torch.zeros(2),
                                          "model.layers.10.self_attn.bar": torch.zeros(2),
                                          "model.layers.0.input_layernorm.weight_scale_inv": torch.ones(1, 1),
                                          "extra": torch.zeros(1)})
    with pytest.raises(MtpTrtError) as e:
        load_checkpoint(d)
    assert str(e.value) == (f"{d}: 4 tensor(s) that DeepseekV3ForCausalLM as mtp-trt reads it does not use: extra, "
                            "model.layers.0.input_layernorm.weight_scale_inv, model.layers.2.mlp.foo.weight and 1 "
                            "more; refusing rather than ignoring them")


def test_documented_skips_are_accepted(hf_ckpt, tmp_path):
    """rotary inv_freq buffers, a stored copy of a tied head, and MTP layers: their copies of the embedding and
    head, and whole layers beyond the modules loaded (up to num_nextn_predict_layers) -- but not beyond it."""
    from mtp_trt.config import ModelConfig
    from mtp_trt.exporters.loader import checkpoint_names
    from mtp_trt.exporters.model import DeepseekV3

    t = load_file(hf_ckpt / "model.safetensors")
    cfg = json.loads((hf_ckpt / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    mtp = {name: torch.rand(p.shape) for name, p in checkpoint_names(
        DeepseekV3(ModelConfig.from_dict(cfg | {"num_nextn_predict_layers": 2}))).items()
        if name.startswith(f"model.layers.{n}.") or name.startswith(f"model.layers.{n + 1}.")}
    for k in (n, n + 1):
        mtp[f"model.layers.{k}.embed_tokens.weight"] = t["model.embed_tokens.weight"].clone()
        mtp[f"model.layers.{k}.shared_head.head.weight"] = t["lm_head.weight"].clone()
    extra = mtp | {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}
    d = _with_tensors(hf_ckpt, tmp_path, extra, {"num_nextn_predict_layers": 2})
    for nextn in (0, 1, 2):
        assert load_checkpoint(d, nextn=nextn).nextn == nextn
    edit_config(d, num_nextn_predict_layers=1)  # layer n + 1 is now beyond what the config declares
    unused = rf"c: {len(mtp) // 2} tensor\(s\) .* does not use: model.layers.{n + 1}.eh_proj"
    with pytest.raises(MtpTrtError, match=unused):
        load_checkpoint(d, nextn=0)
    (tmp_path / "tied").mkdir()
    tied = _with_tensors(hf_ckpt, tmp_path / "tied", config={"tie_word_embeddings": True})  # lm_head stored, unused
    model = load_checkpoint(tied)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, t["model.embed_tokens.weight"])


# ------------------------------------------------------------------------------- families in config.json
def _family_config(**changes):
    from hf_models import BASE

    return {k: v for k, v in {**BASE, "architectures": ["DeepseekV3ForCausalLM"], **changes}.items() if v is not None}


V2 = dict(architectures=["DeepseekV2ForCausalLM"], topk_method=None, norm_topk_prob=None, rope_interleave=None)
GLM = dict(architectures=["Glm4MoeLiteForCausalLM"], first_k_dense_replace=None)


@pytest.mark.parametrize("changes,message", [
    (V2 | dict(scoring_func="sigmoid"), "field 'scoring_func' is 'sigmoid', but DeepseekV2ForCausalLM always scores "
                                        "experts with softmax; expected 'softmax' or no such field"),
    (V2 | dict(topk_method="noaux_tc"), "field 'topk_method' has unknown value 'noaux_tc'; expected one of greedy, "
                                        "group_limited_greedy"),
    (V2 | dict(norm_topk_prob=True), "field 'norm_topk_prob' is true, which DeepseekV2ForCausalLM does not support"),
    (V2 | dict(rope_interleave=False), "field 'rope_interleave' is False, but DeepseekV2ForCausalLM always rotates "
                                       "interleaved pairs"),
    (GLM | dict(topk_method="greedy"), "field 'topk_method' is 'greedy', but Glm4MoeLiteForCausalLM always routes "
                                       "as noaux_tc"),
    (GLM | dict(first_k_dense_replace=2), "field 'first_k_dense_replace' is 2, but mlp_layer_types (by default) makes "
                                          "layers [0] dense; the two must agree"),
    (GLM | dict(mlp_layer_types=["dense", "moe", "sparse"]), "field 'mlp_layer_types' must be a list of "
                                                             "num_hidden_layers=3 values 'dense' or 'sparse'"),
    (GLM | dict(mlp_layer_types=["dense"] * 2 + ["sparse"], n_routed_experts=0), "field 'mlp_layer_types' names "
                                                                                 "sparse (MoE) layers, but"),
    (dict(partial_rotary_factor=0.5), "field 'partial_rotary_factor' must be 1 (RoPE on all qk_rope_head_dim dims)"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "truncate": False}),
     "field 'rope_parameters.truncate' must be true"),
    (dict(mlp_bias=True), "field 'mlp_bias' is true; biases on the MLP projections are not supported"),
    (dict(num_experts_per_tok=5), "field 'num_experts_per_tok' is 5, more than the 4 experts of the topk_group=2 "
                                  "groups routing keeps"),
    (dict(architectures="DeepseekV3ForCausalLM"), "field 'architectures' must be a list of class names"),
    (dict(architectures=["DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM"]), "which are different families"),
    (dict(model_type="glm4_moe_lite"), "field 'model_type' is 'glm4_moe_lite', a Glm4MoeLiteForCausalLM type, but "
                                        "'architectures' names DeepseekV3ForCausalLM; the two must agree"),
])
def test_family_fields_are_checked(changes, message):
    from mtp_trt.config import ModelConfig

    with pytest.raises(MtpTrtError) as e:
        ModelConfig.from_dict(_family_config(**changes), source="c.json")
    assert str(e.value).startswith("c.json: ") and message in str(e.value), str(e.value)


def test_family_defaults():
    """What each family's transformers class implies where config.json says nothing."""
    from mtp_trt.config import ModelConfig

    v2 = ModelConfig.from_dict(_family_config(**V2))
    assert (v2.architecture, v2.scoring_func, v2.topk_method, v2.norm_topk_prob, v2.rope_interleave) == (
        "DeepseekV2ForCausalLM", "softmax", "greedy", False, True)
    glm = ModelConfig.from_dict(_family_config(**GLM))
    assert (glm.architecture, glm.scoring_func, glm.topk_method, glm.mlp_layer_types) == (
        "Glm4MoeLiteForCausalLM", "sigmoid", "noaux_tc", ("dense", "sparse", "sparse"))
    glm = ModelConfig.from_dict(_family_config(**GLM, num_nextn_predict_layers=1, mlp_layer_types=[
        "sparse", "dense", "sparse"]))
    assert [glm.is_moe_layer(i) for i in range(4)] == [True, False, True, True]  # MTP layer 3: MoE
    v3 = ModelConfig.from_dict(_family_config(architectures=None))  # neither architectures nor model_type
    assert (v3.architecture, v3.scoring_func, v3.topk_method, v3.mlp_layer_types) == (
        "DeepseekV3ForCausalLM", "sigmoid", "noaux_tc", None)
