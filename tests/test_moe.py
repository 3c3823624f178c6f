"""Routed MoE (exporters/moe.py): every form, in PyTorch and on ONNX Runtime, equals the reference
DeepSeekMoE (model.MoE: a loop over the selected experts) within 1e-5, on random layers with several
expert counts, group settings, scoring functions and batch/sequence shapes, including exact ties in
router scores; and greedy decoding of exported HF checkpoints on ONNX Runtime equals transformers'."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from hf_models import BASE, CONFIGS, make_hf_model, save_hf_model
from mtp_trt.config import ModelConfig
from mtp_trt.exporters.model import MoE
from mtp_trt.exporters.moe import FORMS, moe_forward, routed_ort, swiglu
from mtp_trt.plugins import ort_lib

TOL = 1e-5
SHAPES = [(1, 1), (2, 1), (1, 4), (3, 5), (2, 40)]  # decode, batched decode, step graphs, prefill
# (experts, top-k, n_group, topk_group, scoring, norm_topk_prob, shared experts)
LAYERS = [(4, 1, 1, 1, "sigmoid", True, 1), (8, 2, 4, 2, "sigmoid", True, 1), (16, 3, 1, 1, "softmax", False, 0),
          (32, 4, 8, 4, "sigmoid", True, 2), (12, 12, 1, 1, "sigmoid", False, 1)]


def make_moe(experts, topk, n_group, topk_group, scoring, norm, shared, seed=0, tie=False) -> MoE:
    """A random MoE layer (hidden 48, expert width 16; outputs of order 1).  tie: experts 2k and 2k+1 get the
    same router row and bias, so their scores tie exactly (and only their SwiGLUs differ)."""
    cfg = ModelConfig.from_dict({**BASE, "hidden_size": 48, "moe_intermediate_size": 16, "n_routed_experts": experts,
                                 "num_experts_per_tok": topk, "n_group": n_group, "topk_group": topk_group,
                                 "scoring_func": scoring, "norm_topk_prob": norm, "n_shared_experts": shared,
                                 "topk_method": "noaux_tc" if scoring == "sigmoid" else "greedy"})
    torch.manual_seed(seed)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.15)  # outputs of order 1
        if tie:
            moe.gate.weight[1::2] = moe.gate.weight[0::2]
            if hasattr(moe.gate, "e_score_correction_bias"):
                moe.gate.e_score_correction_bias[1::2] = moe.gate.e_score_correction_bias[0::2]
    return moe


class Layer(torch.nn.Module):
    def __init__(self, moe: MoE, form: str):
        super().__init__()
        self.moe, self.form = moe, form

    def forward(self, x):
        b, s = x.shape[:2]
        return moe_forward(self.moe, x, b, s, self.form)


def ort_sessions(moe: MoE, tmp_path, forms=FORMS) -> dict:
    """Each form exported alone (dynamic B and S, traced at B=2, S=3) and loaded in ONNX Runtime."""
    sessions = {}
    for form in forms:
        path = tmp_path / f"{form}.onnx"
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(Layer(moe, form), (torch.randn(2, 3, 48),), str(path), dynamo=False, opset_version=18,
                              input_names=["x"], output_names=["y"],
                              dynamic_axes={"x": {0: "B", 1: "S"}, "y": {0: "B", 1: "S"}})
        sessions[form] = ort_lib.session(str(path))
    return sessions


def routed_share(moe: MoE, x: torch.Tensor) -> float:
    """How much of the output the routed experts carry (so that a wrong routing would show)."""
    with torch.no_grad():
        shared = moe.shared_experts(x) if hasattr(moe, "shared_experts") else 0
        return float((moe(x) - shared).abs().mean())


@pytest.mark.parametrize("layer", LAYERS, ids=lambda t: f"E{t[0]}k{t[1]}g{t[2]}-{t[3]}{t[4]}")
def test_every_form_equals_the_reference_moe(layer, tmp_path):
    moe = make_moe(*layer)
    sessions = ort_sessions(moe, tmp_path)
    for b, s in SHAPES:
        x = torch.randn(b, s, 48, generator=torch.Generator().manual_seed(b * 100 + s))
        with torch.no_grad():
            ref = moe(x)
            for form in FORMS:
                got = moe_forward(moe, x, b, s, form)
                torch.testing.assert_close(got, ref, atol=TOL, rtol=TOL, msg=lambda m: f"torch {form} {b}x{s}: {m}")
        for form, sess in sessions.items():
            got = torch.from_numpy(sess.run(None, {"x": x.numpy()})[0])
            torch.testing.assert_close(got, ref, atol=TOL, rtol=TOL, msg=lambda m: f"ORT {form} {b}x{s}: {m}")
        assert routed_share(moe, x) > 0.1


class SplitLayer(torch.nn.Module):
    def __init__(self, moe: MoE, parts: int):
        super().__init__()
        self.moe, self.parts = moe, parts

    def forward(self, x):
        return routed_ort(self.moe, x, *x.shape[:2], parts=self.parts) + swiglu(self.moe.shared_experts, x)


@pytest.mark.parametrize("parts", [1, 2, 8, 16])
def test_experts_split_in_parts_give_the_same_output(parts, tmp_path):
    """The `ort` form hands the MoE node each expert as `parts` experts over blocks of its units (default 4,
    tested above): any split of the 16 units gives the reference output, on ONNX Runtime."""
    moe = make_moe(8, 2, 4, 2, "sigmoid", True, 1)
    path = tmp_path / "split.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(SplitLayer(moe, parts), (torch.randn(2, 3, 48),), str(path), dynamo=False,
                          opset_version=18, input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "B", 1: "S"}, "y": {0: "B", 1: "S"}})
    sess = ort_lib.session(str(path))
    for b, s in SHAPES:
        x = torch.randn(b, s, 48, generator=torch.Generator().manual_seed(b * 7 + s))
        with torch.no_grad():
            ref = moe(x)
        got = torch.from_numpy(sess.run(None, {"x": x.numpy()})[0])
        torch.testing.assert_close(got, ref, atol=TOL, rtol=TOL, msg=lambda m: f"parts {parts} {b}x{s}: {m}")


@pytest.mark.parametrize("layer", [(8, 3, 1, 1, "sigmoid", True, 1), (16, 3, 4, 2, "sigmoid", True, 0),
                                   (8, 1, 1, 1, "softmax", False, 1)], ids=["flat", "groups", "softmax"])
def test_router_ties_choose_the_same_experts_in_every_form(layer, tmp_path):
    """Experts 2k, 2k+1 tie exactly in score but differ in weights, and k is odd, so the k-th choice falls
    inside a tied pair: every ORT form shares the router's TopK choice, so they agree with each other; a
    form that re-selected experts by itself could break the tie differently and would differ.  (PyTorch's
    topk may break ties otherwise, so the reference is not compared here.)"""
    moe = make_moe(*layer, tie=True)
    sessions = ort_sessions(moe, tmp_path)
    splits = 0
    for b, s in SHAPES:
        x = np.random.default_rng(b * 10 + s).standard_normal((b, s, 48)).astype(np.float32)
        outs = {form: sess.run(None, {"x": x})[0] for form, sess in sessions.items()}
        for form in FORMS[1:]:
            np.testing.assert_allclose(outs[form], outs["static"], atol=TOL, rtol=TOL, err_msg=f"{form} {b}x{s}")
        with torch.no_grad():  # the ties decide: some token takes one expert of a tied pair and not the other
            idx = moe.gate(torch.from_numpy(x))[1]
            split = ~(idx[..., :, None] == (idx ^ 1)[..., None, :]).any(-1)  # [B, S, k]: partner not chosen
            splits += int(split.any(-1).sum())
    assert splits > 0


@pytest.mark.parametrize("name", ["moe_qlora_yarn", pytest.param("moe_flat_halfrope", marks=pytest.mark.slow)])
def test_exported_greedy_decoding_equals_transformers(name, tmp_path):
    """transformers' DeepseekV3 `generate` vs `mtp-trt`'s exported graphs on ONNX Runtime (prefill in the target
    graph, then step_0), batch of two prompts of different lengths."""
    from mtp_trt.backend import OrtBackend
    from mtp_trt.decode import DecodeOptions, generate
    from mtp_trt.exporters.export import export
    from mtp_trt.manifest import Manifest

    hf = make_hf_model(name, n_routed_experts=16, num_experts_per_tok=CONFIGS[name].get("num_experts_per_tok", 2))
    ckpt = save_hf_model(hf, tmp_path / "ckpt")
    out = export(ckpt, tmp_path / "out", nextn=0)
    backend = OrtBackend(Manifest.load(out))
    prompts = [[5, 17, 33, 2, 8, 41, 7], [60, 3, 9]]
    eos = hf.generation_config.eos_token_id
    refs = []
    for p in prompts:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(p):]
        refs.append(ref.tolist())
    seqs, _ = generate(backend, prompts, DecodeOptions(nextn=0, max_new_tokens=16, eos_ids=(eos,)))
    assert [s.generated for s in seqs] == refs
