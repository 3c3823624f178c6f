"""Every supported architecture against its own transformers class, through the exported graphs; the refused ones.

For each family (DeepseekV3ForCausalLM, DeepseekV2ForCausalLM, Glm4MoeLiteForCausalLM) random checkpoints written
by transformers' class in several configs: the prefill logits of the exported target graph (ONNX Runtime, fp32)
within 1e-4 of the class's, greedy decoding (nextn 0) equal to its `generate` token for token, and, where the
checkpoint has MTP layers (DeepSeek-V3's convention, which GLM-4.x MoE checkpoints share; transformers' classes
have no MTP module), greedy MTP decoding (eagle, vanilla, trees) equal to it as well (DeepSeek-V3.2 and GLM-5:
tests/test_dsa.py, tests/test_dsa_export.py).  An unknown architecture ends in one line, from the loader and from
the CLI; so do DeepSeek Sparse Attention fields in another family's config, and a DeepSeek-V3.2 checkpoint whose
config has been made to claim DeepSeek-V3 (its indexer weights are named).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_models import append_mtp_layers, edit_config, make_draftable, make_model, prefill_logits
from mtp_trt.backend import OrtBackend
from mtp_trt.config import ModelConfig
from mtp_trt.decode import DecodeOptions, generate
from mtp_trt.errors import MtpTrtError
from mtp_trt.exporters.export import export
from mtp_trt.exporters.loader import load_checkpoint
from mtp_trt.manifest import Manifest
from mtp_trt.tree import TreeShape

ATOL, RTOL = 1e-4, 1e-4  # fp32 both sides, same math in another order (as tests/test_hf_parity.py)
NEW = 16
PROMPTS = [[5, 17, 33, 2, 8, 41, 7, 19, 60, 3, 11, 12], [70, 71, 72, 9, 30, 31, 44]]

SMALL = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    max_position_embeddings=128, initializer_range=0.15, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}

# id -> (architecture, config over SMALL, config.json edits after saving, MTP layers appended, export modes).
# Together: q LoRA on/off, YaRN on/off, interleaved and half RoPE, v_head_dim != qk_nope_head_dim, one and several
# expert groups, sigmoid/noaux_tc and softmax/greedy/group_limited_greedy routing, shared experts, tied
# embeddings, mlp_layer_types with a dense layer between MoE ones, Kimi-K2's model_type, MTP in both modes; and
# rms_norm_eps far from 1e-6, which transformers' classes use for every norm but q_a_layernorm and kv_a_layernorm.
CASES = {
    "deepseek_v3-kimi_k2": ("DeepseekV3ForCausalLM", dict(
        n_group=1, topk_group=1, num_experts_per_tok=3, first_k_dense_replace=1, routed_scaling_factor=2.827,
        rope_parameters=YARN, num_nextn_predict_layers=0), {"model_type": "kimi_k2"}, 0, ("eagle",)),
    "deepseek_v3-mtp": ("DeepseekV3ForCausalLM", dict(
        q_lora_rank=None, n_group=4, topk_group=2, first_k_dense_replace=1, rope_interleave=False, v_head_dim=12,
        routed_scaling_factor=2.5), {}, 2, ("vanilla",)),
    "deepseek_v2-lite": ("DeepseekV2ForCausalLM", dict(
        q_lora_rank=None, topk_method="greedy", first_k_dense_replace=1, n_shared_experts=2, num_experts_per_tok=3,
        rope_parameters=YARN | {"mscale_all_dim": 0.707}, rms_norm_eps=0.02), {"scoring_func": "softmax"}, 0,
        ("eagle",)),
    "deepseek_v2-grouped": ("DeepseekV2ForCausalLM", dict(
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=4.0,
        first_k_dense_replace=0), {}, 1, ("eagle",)),
    "glm4_moe_lite-flash": ("Glm4MoeLiteForCausalLM", dict(
        rms_norm_eps=1e-5, routed_scaling_factor=1.8, num_experts_per_tok=3,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        {"first_k_dense_replace": 1, "topk_method": "noaux_tc", "partial_rotary_factor": 1.0}, 2, ("eagle", "vanilla")),
    "glm4_moe_lite-pattern": ("Glm4MoeLiteForCausalLM", dict(
        mlp_layer_types=["sparse", "dense", "sparse"], rope_interleave=False, rope_parameters=YARN, n_group=2,
        topk_group=1, q_lora_rank=None, tie_word_embeddings=True, rms_norm_eps=0.05), {}, 0, ("eagle",)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """(architecture, transformers model, checkpoint, MTP layers, {mode: export}, transformers' greedy tokens)."""
    arch, config, edits, mtp, modes = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf = make_model(arch, **{**SMALL, **config})
    if mtp:
        make_draftable(hf)
    ckpt = root / "ckpt"
    hf.save_pretrained(ckpt)
    edit_config(ckpt, **edits)
    if mtp:
        append_mtp_layers(ckpt, mtp)
    nextn = 2 if mtp else 0
    exports = {mode: export(ckpt, root / mode, nextn=nextn, mtp_mode=mode, max_seq_len=64,
                            trees=None if mode == "eagle" and arch.startswith("Glm") else "none")
               for mode in modes}
    with torch.no_grad():
        reference = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, len(p):]
                     .tolist() for p in PROMPTS]
    return arch, hf, ckpt, mtp, exports, reference


def test_config_maps_onto_the_family(case):
    arch, hf, ckpt, mtp, _, _ = case
    cfg = ModelConfig.from_file(ckpt)
    assert cfg.architecture == arch and cfg.num_nextn_predict_layers == mtp
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)] == [
        type(layer.mlp).__name__.endswith(("MoE", "Moe")) for layer in hf.model.layers]
    assert cfg.v_head_dim == hf.config.v_head_dim and cfg.qk_nope_head_dim == hf.config.qk_nope_head_dim
    r = subprocess.run(["mtp-trt", "inspect", str(ckpt)], capture_output=True, text=True)
    models = {"DeepseekV3ForCausalLM": "DeepSeek-V3/R1, Kimi-K2", "DeepseekV2ForCausalLM": "DeepSeek-V2",
              "Glm4MoeLiteForCausalLM": "GLM-4.7-Flash"}[arch]
    assert r.returncode == 0 and r.stdout.startswith(f"architecture  {arch} ({models})\n"), r.stderr + r.stdout


def test_prefill_logits_match_transformers(case):
    """The target graph on a right-padded batch of two prompts: logits of every real row within 1e-4."""
    _, hf, _, _, exports, _ = case
    logits = prefill_logits(Manifest.load(next(iter(exports.values()))), PROMPTS)
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].numpy()
        assert ref.std() > 0.1, "logits too flat for the comparison to mean anything"
        np.testing.assert_allclose(logits[i, :len(p)], ref, atol=ATOL, rtol=RTOL)


def test_greedy_decoding_matches_transformers_generate(case):
    _, _, _, _, exports, reference = case
    for path in exports.values():
        seqs, _ = generate(OrtBackend(Manifest.load(path)), PROMPTS, DecodeOptions(nextn=0, max_new_tokens=NEW))
        assert [s.generated for s in seqs] == reference


def test_greedy_mtp_matches_transformers_generate(case):
    """MTP drafting (nextn 1 and 2, and the exported tree) changes nothing in the greedy output, and drafts are
    accepted (the MTP path is exercised, not bypassed)."""
    _, _, _, mtp, exports, reference = case
    if not mtp:
        pytest.skip("no MTP layers in this checkpoint")
    for mode, path in exports.items():
        backend = OrtBackend(Manifest.load(path))
        options = [DecodeOptions(nextn=n, max_new_tokens=NEW) for n in (1, 2)]
        if "tree_2_2_4" in backend.manifest.graphs:
            options.append(DecodeOptions(nextn=2, max_new_tokens=NEW, tree=TreeShape(2, 2, 4)))
        for opts in options:
            seqs, stats = generate(backend, PROMPTS, opts)
            assert [s.generated for s in seqs] == reference, (mode, opts.nextn, opts.tree)
            assert stats.mean_acceptance_length > 1, (mode, opts.nextn, opts.tree)


def test_loader_reads_what_transformers_wrote(case):
    """The reference model loaded from the checkpoint (every tensor read or a documented skip) gives transformers'
    logits, with and without its MTP modules."""
    _, hf, ckpt, mtp, _, _ = case
    tokens = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        ref = hf(tokens).logits
        for nextn in sorted({0, mtp}):
            model = load_checkpoint(ckpt, nextn=nextn)
            assert model.nextn == nextn
            torch.testing.assert_close(model(tokens)[0], ref, atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------------------------------------------ refused
DSA = dict(index_topk=4, index_head_dim=8, index_n_heads=2, first_k_dense_replace=1, n_group=1, topk_group=1)
SUPPORTED = ("supported architectures: DeepseekV3ForCausalLM (DeepSeek-V3/R1, Kimi-K2), DeepseekV2ForCausalLM "
             "(DeepSeek-V2), Glm4MoeLiteForCausalLM (GLM-4.7-Flash), DeepseekV32ForCausalLM (DeepSeek-V3.2), "
             "GlmMoeDsaForCausalLM (GLM-5)")
REFUSED = {
    "FooForCausalLM": "architecture FooForCausalLM is not supported: mtp-trt has no mapping of it onto its reference "
                      "model",
}


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """architecture -> a checkpoint of it: V3.2 and GLM-5 written by transformers' classes (indexer weights
    included), Foo a DeepSeek-V3 checkpoint whose config names FooForCausalLM."""
    root = tmp_path_factory.mktemp("refused")
    out = {}
    for arch in ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "DeepseekV3ForCausalLM"):
        extra = DSA if arch != "DeepseekV3ForCausalLM" else dict(first_k_dense_replace=1, n_group=4, topk_group=2)
        make_model(arch, **{**SMALL, **extra}).save_pretrained(root / arch)
        out[arch] = root / arch
    out["FooForCausalLM"] = out.pop("DeepseekV3ForCausalLM")
    edit_config(out["FooForCausalLM"], architectures=["FooForCausalLM"], model_type="foo")
    return out


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_refused_architecture_is_one_line(refused, arch):
    with pytest.raises(MtpTrtError) as e:
        load_checkpoint(refused[arch])
    assert str(e.value) == f"{refused[arch] / 'config.json'}: {REFUSED[arch]}; {SUPPORTED}"


@pytest.mark.parametrize("command", ["inspect", "export", "run"])
@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_refused_architecture_through_the_cli(refused, arch, command, tmp_path):
    argv = {"inspect": [], "export": ["-o", tmp_path / "out"], "run": ["-p", "x"]}[command]
    r = subprocess.run(["mtp-trt", command, refused[arch], *map(str, argv)], capture_output=True, text=True,
                       env={**os.environ, "MTP_TRT_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 2, r.stderr + r.stdout
    assert r.stderr == f"error: {refused[arch] / 'config.json'}: {REFUSED[arch]}; {SUPPORTED}\n"
    assert r.stdout == "" and not (tmp_path / "out").exists()


def test_model_type_without_architectures(refused, tmp_path):
    """Older configs name only model_type: a supported one is read as its family, an unknown one is refused."""
    for arch in ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"):
        ckpt = tmp_path / arch
        shutil.copytree(refused[arch], ckpt)
        edit_config(ckpt, architectures=None)
        assert ModelConfig.from_file(ckpt).architecture == arch
    cfg = json.loads((refused["FooForCausalLM"] / "config.json").read_text())
    for model_type, arch in [("glm4_moe_lite", "Glm4MoeLiteForCausalLM"), ("deepseek_v2", "DeepseekV2ForCausalLM"),
                             ("kimi_k2", "DeepseekV3ForCausalLM"), (None, "DeepseekV3ForCausalLM")]:
        d = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "topk_method", "scoring_func",
                                                       "norm_topk_prob")}
        assert ModelConfig.from_dict(d | {"model_type": model_type}).architecture == arch
    with pytest.raises(MtpTrtError, match=r"model_type 'foo' \(and no 'architectures'\) is not supported"):
        ModelConfig.from_dict({k: v for k, v in cfg.items() if k != "architectures"})


def test_dsa_fields_are_refused_in_other_families(refused):
    cfg = json.loads((refused["DeepseekV32ForCausalLM"] / "config.json").read_text())
    with pytest.raises(MtpTrtError, match=r"field 'model_type' is 'deepseek_v32', a DeepseekV32ForCausalLM type, but "
                                          r"'architectures' names DeepseekV3ForCausalLM"):
        ModelConfig.from_dict(cfg | {"architectures": ["DeepseekV3ForCausalLM"]})
    with pytest.raises(MtpTrtError) as e:
        ModelConfig.from_dict(cfg | {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"})
    assert str(e.value) == (
        "config: architecture DeepseekV3ForCausalLM with field 'index_topk' (DeepSeek Sparse Attention) is not "
        "supported: that family has no lightning indexer; DeepSeek Sparse Attention checkpoints name "
        f"DeepseekV32ForCausalLM or GlmMoeDsaForCausalLM; {SUPPORTED}")


def test_indexer_weights_are_named_when_the_config_hides_them(refused, tmp_path):
    """A DeepSeek-V3.2 checkpoint whose config has been made to claim DeepSeek-V3 (no index_* fields) would decode
    with dense attention; its indexer weights are refused by name instead."""
    ckpt = tmp_path / "v32-as-v3"
    shutil.copytree(refused["DeepseekV32ForCausalLM"], ckpt)
    edit_config(ckpt, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", index_topk=None,
                index_head_dim=None, index_n_heads=None)
    with pytest.raises(MtpTrtError) as e:
        load_checkpoint(ckpt)
    assert str(e.value) == (
        f"{ckpt}: 15 tensor(s) that DeepseekV3ForCausalLM as mtp-trt reads it does not use: "
        "model.layers.0.self_attn.indexer.k_norm.bias, model.layers.0.self_attn.indexer.k_norm.weight, "
        "model.layers.0.self_attn.indexer.weights_proj.weight and 12 more; refusing rather than ignoring them")
