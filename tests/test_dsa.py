"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): the reference model against transformers' classes.

Random checkpoints written by DeepseekV32ForCausalLM and GlmMoeDsaForCausalLM with a small index_topk, so that the
indexer's top-k selection decides what the attention reads on contexts longer than it: logits within 1e-4 (fp32)
in both attention forms, over a cache as well as in one pass; exact score ties (an indexer whose scores are all 0)
resolved as transformers resolves them; dense MLA exactly where the context is at most index_topk.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_models import make_model
from mtp_trt.config import ModelConfig
from mtp_trt.errors import MtpTrtError
from mtp_trt.exporters.loader import load_checkpoint
from mtp_trt.exporters.model import DeepseekV3

ATOL, RTOL = 1e-4, 1e-4  # fp32 both sides (as tests/test_hf_parity.py)
SMALL = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    max_position_embeddings=128, initializer_range=0.15, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    first_k_dense_replace=1, n_group=1, topk_group=1,
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}

# id -> (architecture, config over SMALL).  Enough indexer heads that random scores have no exact ties (a score is
# exactly 0 only where every head's ReLU is): tests/test_dsa.py::test_ties covers those.
DSA_CASES = {
    "v32-yarn": ("DeepseekV32ForCausalLM", dict(index_topk=4, index_n_heads=8, index_head_dim=16, rope_parameters=YARN,
                                                n_group=4, topk_group=2)),
    "v32-wide-index": ("DeepseekV32ForCausalLM", dict(index_topk=7, index_n_heads=8, index_head_dim=32,
                                                      mlp_layer_types=["sparse", "dense", "sparse"])),
    "glm5": ("GlmMoeDsaForCausalLM", dict(index_topk=5, index_n_heads=8, index_head_dim=16, rms_norm_eps=1e-5)),
    "glm5-shared": ("GlmMoeDsaForCausalLM", dict(index_topk=6, index_n_heads=8, index_head_dim=16,
                                                 indexer_types=["full", "shared", "full"])),
}
TOKENS = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))


def make_dsa_model(arch: str, seed: int = 0, **config):
    """make_model with the indexers' k_norm biases random too (transformers initializes them to 0)."""
    hf = make_model(arch, seed, **{**SMALL, **config})
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("k_norm.bias"):
                p.uniform_(-0.5, 0.5)
    return hf


@pytest.fixture(scope="module", params=sorted(DSA_CASES))
def pair(request, tmp_path_factory):
    arch, config = DSA_CASES[request.param]
    hf = make_dsa_model(arch, **config)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, load_checkpoint(path)


def test_config_maps_the_indexer(pair):
    hf, ours = pair
    cfg = ours.cfg
    assert cfg.dsa and (cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim) == (
        hf.config.index_topk, hf.config.index_n_heads, hf.config.index_head_dim)
    assert cfg.index_rope_interleave == (cfg.architecture == "GlmMoeDsaForCausalLM")
    assert [cfg.has_indexer(i) for i in range(cfg.num_hidden_layers)] == [
        layer.self_attn.indexer is not None for layer in hf.model.layers]
    assert cfg.cache_dim == cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim


@pytest.mark.parametrize("absorbed", [False, True])
def test_logits_match_transformers(pair, absorbed):
    """20 tokens, index_topk 4..7: most queries attend to a strict subset of what they see."""
    hf, ours = pair
    with torch.no_grad():
        ref = hf(TOKENS).logits
        got, _, rows = ours(TOKENS, absorbed=absorbed)
    assert ref.std() > 0.1
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)
    assert rows[0].shape == (*TOKENS.shape, ours.cfg.cache_dim)


def test_selection_matters(pair):
    """The same weights with index_topk >= the context (dense MLA) give other logits: the top-k is exercised."""
    hf, ours = pair
    dense = DeepseekV3(dataclasses.replace(ours.cfg, index_topk=TOKENS.shape[1])).eval()
    dense.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (dense(TOKENS)[0] - ours(TOKENS)[0]).abs().max() > 1e-2


def test_cached_decoding_matches_transformers(pair):
    """A prompt, then tokens one and three at a time over the cache (rows: latent then indexer key), against
    transformers' own cached forward."""
    hf, ours = pair
    with torch.no_grad():
        out = hf(TOKENS[:, :9], use_cache=True)
        cache = out.cache
        _, _, past = ours(TOKENS[:, :9])
        for lo, hi in [(9, 10), (10, 13), (13, 20)]:
            ref = hf(TOKENS[:, lo:hi], cache=cache, use_cache=True).logits
            got, _, rows = ours(TOKENS[:, lo:hi], past=past, absorbed=True)
            torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)
            past = [torch.cat([p, r], 1) for p, r in zip(past, rows)]


def test_dense_when_the_context_fits(pair):
    """Contexts of at most index_topk tokens: the same logits as MLA without the indexer (the same checkpoint read
    as dense)."""
    hf, ours = pair
    cfg = ours.cfg
    dense_cfg = dataclasses.replace(cfg, index_topk=None, index_n_heads=0, index_head_dim=0, indexer_types=None)
    dense = DeepseekV3(dense_cfg).eval()
    dense.load_state_dict({k: v for k, v in ours.state_dict().items() if ".indexer." not in k})
    tokens = TOKENS[:, :cfg.index_topk]
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens)[0], dense(tokens)[0], atol=0, rtol=0)
        torch.testing.assert_close(ours(tokens, absorbed=True)[0], dense(tokens, absorbed=True)[0], atol=0, rtol=0)


def test_ties(tmp_path):
    """Index scores tied exactly (one layer's indexer queries all zero: every score 0; two heads elsewhere: many
    exact zeros) are resolved as transformers resolves them: the same logits."""
    hf = make_dsa_model("DeepseekV32ForCausalLM", index_topk=4, index_n_heads=2, index_head_dim=16)
    with torch.no_grad():
        hf.model.layers[1].self_attn.indexer.wq_b.weight.zero_()
    hf.save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path)
    with torch.no_grad():
        ref = hf(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS)[0], ref, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(ours(TOKENS, absorbed=True)[0], ref, atol=ATOL, rtol=RTOL)


def test_mtp_layers_have_their_own_indexer():
    cfg = ModelConfig.from_dict({**SMALL, "architectures": ["GlmMoeDsaForCausalLM"], "index_topk": 4,
                                 "index_n_heads": 2, "index_head_dim": 16, "num_nextn_predict_layers": 1,
                                 "indexer_types": ["full", "shared", "shared"]})
    model = DeepseekV3(cfg)
    assert [hasattr(layer.self_attn, "indexer") for layer in model.model.layers] == [True, False, False]
    assert hasattr(model.mtp[0].self_attn, "indexer")


V32 = {**SMALL, "architectures": ["DeepseekV32ForCausalLM"], "index_topk": 4, "index_n_heads": 2,
       "index_head_dim": 16}


@pytest.mark.parametrize("change, message", [
    (dict(index_head_dim=4), "field 'index_head_dim' must be at least qk_rope_head_dim=8 (the indexer ropes its "
                             "first qk_rope_head_dim dims), got 4"),
    (dict(index_topk=0), "field 'index_topk' must be positive, got 0"),
    (dict(q_lora_rank=None), "field 'q_lora_rank' is missing: the lightning indexer of DeepseekV32ForCausalLM reads "
                             "the query's LoRA latent"),
    (dict(rope_interleave=False), "field 'rope_interleave' is False, but DeepseekV32ForCausalLM always rotates "
                                  "MLA's interleaved pairs; expected True or no such field"),
    (dict(indexer_types=["full"] * 3), "field 'indexer_types' is set, but DeepseekV32ForCausalLM runs an indexer in "
                                       "every layer"),
    (dict(architectures=["GlmMoeDsaForCausalLM"], indexer_types=["shared", "full", "full"]),
     "field 'indexer_types' starts with 'shared', but a shared layer reuses the previous full layer's selection"),
    (dict(architectures=["GlmMoeDsaForCausalLM"], indexer_types=["full", "sparse", "full"]),
     "field 'indexer_types' must be a list of num_hidden_layers=3 values 'full' or 'shared', got ['full', "
     "'sparse', 'full']"),
])
def test_config_errors_are_one_line(change, message):
    with pytest.raises(MtpTrtError) as e:
        ModelConfig.from_dict({**V32, **change})
    assert str(e.value) == f"config: {message}"


@pytest.mark.parametrize("fields, types", [
    ({}, None),
    ({"index_topk_pattern": "FSF"}, ("full", "shared", "full")),
    ({"index_topk_freq": 2, "index_skip_topk_offset": 1}, ("full", "shared", "full")),
])
def test_glm5_indexer_types_as_transformers_derives_them(fields, types):
    import transformers

    d = {**V32, "architectures": ["GlmMoeDsaForCausalLM"], **fields}
    assert ModelConfig.from_dict(d).indexer_types == types
    hf = transformers.GlmMoeDsaConfig(**{k: v for k, v in d.items() if k != "architectures"})
    assert tuple(hf.indexer_types) == (types or ("full",) * 3)
