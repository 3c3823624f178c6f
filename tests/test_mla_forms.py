"""MLA's absorbed form over the latent cache equals the expanded form, token by token while decoding."""

import torch

from hf_models import BASE, CONFIGS
from mtp_trt.config import ModelConfig
from mtp_trt.exporters.model import DeepseekV3, attention_mask


def _model(name: str, nextn: int = 0) -> DeepseekV3:
    torch.manual_seed(0)
    cfg = ModelConfig.from_dict({**BASE, **CONFIGS[name], "num_nextn_predict_layers": nextn})
    return DeepseekV3(cfg).init_weights(std=0.15).eval()


def test_absorbed_equals_expanded_during_incremental_decoding():
    """Batch of 3 sequences with different cached lengths, several steps of S = 1..3 new tokens;
    the cache is a fixed buffer whose unused rows hold garbage that the mask must hide."""
    for name in ("moe_qlora_yarn", "dense_no_qlora"):
        model = _model(name)
        cfg = model.cfg
        g = torch.Generator().manual_seed(3)
        b, t_max = 3, 40
        cache = [torch.randn(b, t_max, cfg.latent_dim, generator=g) * 100 for _ in range(cfg.num_hidden_layers)]
        lens = torch.tensor([0, 5, 11])
        # Prefill each sequence's first rows from its own prompt with the expanded form.
        for i, n in enumerate(lens.tolist()):
            if n:
                _, _, lat = model(torch.randint(0, cfg.vocab_size, (1, n), generator=g))
                for layer, rows in zip(cache, lat):
                    layer[i, :n] = rows[0]
        worst = 0.0
        for s in (1, 3, 2, 1):
            tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
            with torch.no_grad():
                ref, h_ref, lat_ref = model(tokens, past=cache, past_len=lens, absorbed=False)
                got, h_got, lat_got = model(tokens, past=cache, past_len=lens, absorbed=True)
            torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)
            torch.testing.assert_close(h_got, h_ref, atol=2e-5, rtol=2e-5)
            worst = max(worst, (got - ref).abs().max().item())
            for layer, rows in zip(cache, lat_got):
                for i in range(b):
                    layer[i, lens[i]: lens[i] + s] = rows[i]
            lens = lens + s
        assert worst < 2e-4


def test_cached_decoding_equals_full_recompute():
    """Logits of the last token, decoded over the cache, equal a full forward of the whole sequence."""
    model = _model("moe_flat_halfrope")
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full, _, _ = model(tokens)
        _, _, past = model(tokens[:, :9])
        step, _, _ = model(tokens[:, 9:], past=past, absorbed=True)
    torch.testing.assert_close(step, full[:, 9:], atol=2e-4, rtol=2e-4)


def test_attention_mask_layout():
    m = attention_mask(torch.tensor([2, 0]), past_rows=3, new_rows=2)
    assert m.shape == (2, 2, 5)
    assert m[0].int().tolist() == [[1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]
    assert m[1].int().tolist() == [[0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]


def test_export_rope_is_bit_exact_with_the_reference():
    """The exporter's RoPE (one gather, two multiply-adds) makes the very same floats as model.apply_rope,
    for both pair layouts and in half precision too."""
    from mtp_trt.exporters.graphs import Rope
    from mtp_trt.exporters.model import apply_rope

    for name in ("moe_qlora_yarn", "moe_flat_halfrope"):
        for dtype in (torch.float32, torch.float16):
            model = _model(name).to(dtype)
            cfg, rope = model.cfg, Rope(model)
            positions = torch.tensor([[0, 7, 300], [511, 2, 64]])
            x = torch.randn(2, 3, cfg.num_attention_heads, cfg.qk_rope_head_dim).to(dtype) * 3
            cos, sin = model.rope(positions)
            want = apply_rope(x, cos[:, :, None], sin[:, :, None], cfg.rope_interleave)
            c2, s2 = rope.at(positions)
            assert torch.equal(rope(x, c2[:, :, None], s2[:, :, None]), want), (name, dtype)
