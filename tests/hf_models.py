"""Random-weight checkpoints made with Hugging Face transformers' classes (DeepSeek-V3, and any other architecture
through make_model): the independent reference."""

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
    return make_model("DeepseekV3ForCausalLM", seed, **{**BASE, **CONFIGS[name], **overrides})


def make_model(architecture: str, seed: int = 0, **config):
    """transformers' `architecture` class (its config class: the same name ending in Config) with random weights,
    norms and routing biases included."""
    import transformers

    torch.manual_seed(seed)
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    model = getattr(transformers, architecture)(config_class(**config)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    return model


def make_draftable(model, factor: float = 0.01):
    """Scale every attention output (o_proj) and every MLP output but the last layer's (down_proj) by `factor`: the
    model is then mostly its embedding and last MLP, which a copy of its last layer (append_mtp_layers) drafts well,
    while every part still moves the logits far beyond the parity tests' tolerance."""
    last = f"model.layers.{model.config.num_hidden_layers - 1}."
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("o_proj.weight") or ("down_proj" in n and not n.startswith(last)):
                p.mul_(factor)
    return model


def append_mtp_layers(path: Path, k: int) -> Path:
    """Give a saved checkpoint `k` MTP layers in DeepSeek-V3's convention (`model.layers.{N + i}`, as DeepSeek-V3
    and GLM-4.x MoE checkpoints store them, with their copies of the embedding and output head), and set
    num_nextn_predict_layers.  Each copies the last layer's block (which must be MoE, as MTP layers are) and reads
    the embedding alone, at the embedding's scale (eh_proj = [I | 0], enorm = the embedding's RMS; shared_head.norm =
    the final norm): a 1-layer drafter of the main model, often right."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((path / "config.json").read_text())
    n, d = cfg["num_hidden_layers"], cfg["hidden_size"]
    t = load_file(path / "model.safetensors")
    last = f"model.layers.{n - 1}."
    assert f"{last}mlp.gate.weight" in t, "the last layer must be MoE to be copied into an MTP layer"
    for i in range(k):
        mtp = f"model.layers.{n + i}."
        t |= {mtp + name[len(last):]: v.clone() for name, v in t.items() if name.startswith(last)}
        t[mtp + "eh_proj.weight"] = torch.cat([torch.eye(d), torch.zeros(d, d)], 1)
        t[mtp + "enorm.weight"] = t["model.embed_tokens.weight"].pow(2).mean().sqrt().expand(d).clone()
        t[mtp + "hnorm.weight"] = torch.ones(d)
        t[mtp + "shared_head.norm.weight"] = t["model.norm.weight"].clone()
        t[mtp + "embed_tokens.weight"] = t["model.embed_tokens.weight"].clone()
        t[mtp + "shared_head.head.weight"] = t.get("lm_head.weight", t["model.embed_tokens.weight"]).clone()
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})
    edit_config(path, num_nextn_predict_layers=k)
    return path


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


def prefill_logits(m, prompts: list[list[int]], graph: bytes | None = None):
    """An export's (Manifest m) target graph (or `graph`, a serialized variant of it) on a right-padded batch of the
    prompts over empty caches of max_seq_len rows -> its logits [B, S, V] (NumPy)."""
    import numpy as np

    from mtp_trt.plugins import ort_lib

    lens = [len(p) for p in prompts]
    ids = np.zeros((len(prompts), max(lens)), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    feed = {"input_ids": ids, "past_len": np.zeros(len(prompts), np.int32),
            "thinking": np.zeros(len(prompts), np.int32), "relaxed_topk": np.array(0, np.int32),
            "relaxed_delta": np.array(0, np.float32)}
    feed |= {f"kv_{i}": np.zeros((len(prompts), m.max_seq_len, m.config.cache_dim), np.float32)
             for i in range(m.config.num_hidden_layers)}
    sess = ort_lib.session(graph if graph is not None else m.root / m.graphs["target"].file)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))["logits"]
