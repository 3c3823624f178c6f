"""The MTP module computes DeepSeek-V3's formula, checked on hand-built weights; MTP weights round-trip."""

import pytest
import torch
from safetensors.torch import load_file

from hf_models import BASE, CONFIGS
from mtp_trt.config import ModelConfig
from mtp_trt.errors import MtpTrtError
from mtp_trt.exporters.loader import load_checkpoint, save_checkpoint
from mtp_trt.exporters.model import DeepseekV3


def rms(x, w, eps=1e-6):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _model(nextn: int) -> DeepseekV3:
    torch.manual_seed(0)
    cfg = ModelConfig.from_dict({**BASE, **CONFIGS["moe_qlora_yarn"], "num_nextn_predict_layers": nextn})
    return DeepseekV3(cfg).init_weights(std=0.15).eval()


def test_mtp_formula_on_hand_built_weights():
    """With the block's residual branches zeroed (o_proj, experts' and shared experts' down_proj = 0) the
    block is the identity, so the module's output hidden must be exactly
        h' = W_e · enorm(emb(t_{i+1})) + W_h · hnorm(h_i)   with emb zeroed at position 0,
    and its logits lm_head(shared_head.norm(h'))."""
    model = _model(nextn=1)
    layer, d = model.mtp[0], model.cfg.hidden_size
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        layer.self_attn.o_proj.weight.zero_()
        for mlp in [*layer.mlp.experts, layer.mlp.shared_experts]:
            mlp.down_proj.weight.zero_()
        layer.enorm.weight.copy_(torch.rand(d, generator=g) + 0.5)
        layer.hnorm.weight.copy_(torch.rand(d, generator=g) + 0.5)
        layer.shared_head.norm.weight.copy_(torch.rand(d, generator=g) + 0.5)
        w_e, w_h = torch.randn(d, d, generator=g) / d**0.5, torch.randn(d, d, generator=g) / d**0.5
        layer.eh_proj.weight.copy_(torch.cat([w_e, w_h], dim=1))

        h = torch.randn(2, 6, d, generator=g)
        nxt = torch.randint(0, model.cfg.vocab_size, (2, 6), generator=g)
        logits, h_out, latent = model.mtp_forward(0, h, nxt)

        emb = model.model.embed_tokens.weight[nxt]
        emb[:, 0] = 0  # position 0 has no previous token
        expected = rms(emb, layer.enorm.weight) @ w_e.T + rms(h, layer.hnorm.weight) @ w_h.T
        torch.testing.assert_close(h_out, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits, rms(expected, layer.shared_head.norm.weight) @ model.lm_head.weight.T,
                                   atol=1e-5, rtol=1e-5)
        assert latent.shape == (2, 6, model.cfg.latent_dim)
    # Embedding and output head are the main model's, not copies.
    names = {n for n, _ in model.mtp.named_parameters()}
    assert not any("embed_tokens" in n or "shared_head.head" in n for n in names)


def test_mtp_layers_saved_as_official_layer_indices(tmp_path):
    model = _model(nextn=2)
    n = model.cfg.num_hidden_layers
    out = save_checkpoint(model, tmp_path / "ckpt", {**BASE, **CONFIGS["moe_qlora_yarn"]})
    keys = set(load_file(out / "model.safetensors"))
    assert f"model.layers.{n}.eh_proj.weight" in keys and f"model.layers.{n + 1}.enorm.weight" in keys
    assert f"model.layers.{n + 1}.shared_head.norm.weight" in keys
    assert f"model.layers.{n + 1}.mlp.gate.e_score_correction_bias" in keys
    assert not any(k.startswith("mtp.") for k in keys)

    back = load_checkpoint(out, nextn=1)
    assert back.nextn == 1
    for (name, p), (_, q) in zip(model.state_dict().items(), back.state_dict().items()):
        if not name.startswith("mtp.1"):
            assert torch.equal(p, q), name
    with pytest.raises(MtpTrtError, match="num_nextn_predict_layers is 2"):
        load_checkpoint(out, nextn=3)


def test_mtp_decoding_with_cache_equals_full_forward():
    """MTP rows decoded over the MTP's own latent cache equal one pass over all rows."""
    model = _model(nextn=1)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(1, 9, model.cfg.hidden_size, generator=g)
    nxt = torch.randint(0, model.cfg.vocab_size, (1, 9), generator=g)
    with torch.no_grad():
        full, hfull, _ = model.mtp_forward(0, h, nxt)
        _, _, past = model.mtp_forward(0, h[:, :6], nxt[:, :6])
        step, hstep, _ = model.mtp_forward(0, h[:, 6:], nxt[:, 6:], past=past, absorbed=True)
    torch.testing.assert_close(step, full[:, 6:], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(hstep, hfull[:, 6:], atol=2e-5, rtol=2e-5)
