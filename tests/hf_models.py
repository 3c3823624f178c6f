"""Random-weight DeepSeek-V3 checkpoints made with Hugging Face transformers: the independent reference."""

from __future__ import annotations

import json
from pathlib import Path

import torch

BASE = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
    max_position_embeddings=512, rope_interleave=True, initializer_range=0.15, num_nextn_predict_layers=0,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, eos_token_id=95,
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}

# Name -> overrides of BASE.  Together they cover q LoRA on/off, YaRN on/off (and mscale != mscale_all_dim),
# MoE with groups and shared experts, dense-only, rope_interleave off and un-normalized top-k weights.
CONFIGS = {
    "moe_qlora_yarn": dict(rope_parameters=YARN),
    "dense_no_qlora": dict(q_lora_rank=None, first_k_dense_replace=3),
    "moe_no_qlora_yarn": dict(q_lora_rank=None, rope_parameters=YARN, n_shared_experts=2),
    "moe_flat_halfrope": dict(n_group=1, topk_group=1, norm_topk_prob=False, rope_interleave=False,
                              first_k_dense_replace=0, num_experts_per_tok=3),
}


def make_hf_model(name: str, seed: int = 0, **overrides):
    """A transformers DeepseekV3ForCausalLM with random weights, norms and routing biases included."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(**{**BASE, **CONFIGS[name], **overrides})
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    return model


def save_hf_model(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def edit_config(path: Path, **changes) -> None:
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    cfg_path.write_text(json.dumps(cfg))
