"""The shipped demo checkpoint (samples/demo-model) and its training script.

Fast checks only: nothing here retrains the shipped model.  The smoke run of the training script
uses --tiny (a 0.3M-parameter model on 10 files, a few seconds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtp_trt.config import ModelConfig
from mtp_trt.exporters.loader import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "samples"
DEMO = SAMPLES / "demo-model"
MAX_BYTES = 25 * 1024 * 1024
# Project model vs transformers' DeepseekV3ForCausalLM, both fp32 from the same bf16 weights:
# the same math in a different op order, so only float rounding separates them.
HF_ATOL = 2e-3

sys.path.insert(0, str(SAMPLES))
import demo_data as dd  # noqa: E402


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((DEMO / "config.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(DEMO / "tokenizer.json"))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_checkpoint(DEMO)


def _sample_tokens(tokenizer, n: int = 48) -> torch.Tensor:
    text = (dd.stdlib_root() / "functools.py").read_text()
    ids = tokenizer.encode(text).ids[:n]
    return torch.tensor([[dd.BOS] + ids])


# ------------------------------------------------------------------------------------- files
def test_files_present_and_small():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md"):
        assert (DEMO / name).is_file(), name
    total = sum(f.stat().st_size for f in DEMO.rglob("*") if f.is_file())
    assert total <= MAX_BYTES, f"{total / 2**20:.1f} MiB > 25 MiB"


def test_config_fields(config, tokenizer):
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["model_type"] == "deepseek_v3"
    cfg = ModelConfig.from_dict(config)
    assert cfg.num_nextn_predict_layers >= 3
    assert cfg.num_hidden_layers >= 2
    assert cfg.q_lora_rank  # MLA with q LoRA
    assert cfg.n_routed_experts and cfg.n_shared_experts >= 1
    assert cfg.n_group > 1 and cfg.topk_group < cfg.n_group
    assert cfg.topk_method == "noaux_tc" and cfg.scoring_func == "sigmoid"
    assert cfg.moe_layer_freq == 1  # HF's MoE rule ignores moe_layer_freq
    assert any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert cfg.vocab_size == tokenizer.get_vocab_size()
    assert cfg.bos_token_id == tokenizer.token_to_id("<bos>")
    assert cfg.eos_token_id == tokenizer.token_to_id("<eos>")
    gen = json.loads((DEMO / "generation_config.json").read_text())
    assert gen["bos_token_id"] == cfg.bos_token_id and gen["eos_token_id"] == cfg.eos_token_id


def test_mtp_tensors_named_as_extra_layers(config):
    from safetensors import safe_open

    n, k = config["num_hidden_layers"], config["num_nextn_predict_layers"]
    with safe_open(DEMO / "model.safetensors", "pt") as f:
        names = set(f.keys())
        for j in range(k):
            for leaf in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                         "self_attn.q_a_proj.weight", "mlp.gate.e_score_correction_bias"):
                assert f"model.layers.{n + j}.{leaf}" in names
        assert not any(name.startswith(f"model.layers.{n + k}.") for name in names)
        # the aux-loss-free balancing bias was trained, not left at zero
        bias = f.get_tensor(f"model.layers.{n - 1}.mlp.gate.e_score_correction_bias")
        assert bias.abs().max() > 0


# ---------------------------------------------------------------------------------- tokenizer
def test_tokenizer_specials_and_round_trip(tokenizer):
    for i, name in enumerate(dd.SPECIAL_TOKENS):
        assert tokenizer.token_to_id(name) == i
    text = 'def f(x):\n    """Add one."""\n    return x + 1  # ünïcode ✓\n\n\tprint(f"{x!r}")\n'
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    ids = tokenizer.encode("<think>add one</think>\ndef f(x):").ids
    assert ids[0] == dd.THINK and dd.END_THINK in ids
    assert tokenizer.decode(ids, skip_special_tokens=False).startswith("<think>add one</think>")


# ------------------------------------------------------------------------------------- models
def test_project_loader_runs_main_and_mtp(model, tokenizer, config):
    assert model.nextn == config["num_nextn_predict_layers"]
    x = _sample_tokens(tokenizer)
    with torch.no_grad():
        logits, h, _ = model(x)
        assert logits.shape == (1, x.shape[1], config["vocab_size"]) and torch.isfinite(logits).all()
        # a trained model: far better than uniform on ordinary stdlib code
        ce = torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:]).item()
        assert ce < 0.6 * torch.log(torch.tensor(float(config["vocab_size"]))).item()
        for k in range(model.nextn):
            lg, h, _ = model.mtp_forward(k, h, torch.roll(x, -(k + 1), 1))
            assert torch.isfinite(lg).all()


def test_transformers_logits_match(model, tokenizer):
    transformers = pytest.importorskip("transformers")
    hf, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        DEMO, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    x = _sample_tokens(tokenizer)
    with torch.no_grad():
        ours = model(x)[0]
        theirs = hf.eval()(x).logits.float()
    torch.testing.assert_close(theirs, ours, atol=HF_ATOL, rtol=0)
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean() > 0.97


@pytest.mark.slow
def test_card_figures_reproduce_on_a_heldout_sample(model, tokenizer):
    """The shipped eval.json (and so the card) agrees with the shipped weights: main-head and MTP depth-1
    top-1 recomputed on every 16th held-out window are within 3 points of the figures over all windows."""
    import eval_demo

    ev = json.loads((DEMO / "eval.json").read_text())
    if ev["python"].rsplit(".", 1)[0] != sys.version.split()[0].rsplit(".", 1)[0]:
        pytest.skip(f"eval.json is for Python {ev['python']}'s stdlib; this is {sys.version.split()[0]}")
    _, held = dd.split_files(dd.list_files())
    stream = dd.encode_files(tokenizer, [t for t in (dd.read_source(f) for f in held) if t is not None])
    assert len(stream) == ev["heldout_tokens"]
    windows = dd.eval_windows(stream, ev["seq"] + ev["K"] + 1, ev["windows"])[::16]
    got = eval_demo.teacher_forced(model, torch.from_numpy(windows.astype("int64")), ev["seq"])
    for key in ("main", "vanilla_1"):
        assert abs(got[key]["top1"] - ev["teacher_forced"][key]["top1"]) < 0.03, (key, got[key], ev["teacher_forced"][key])
    card = (DEMO / "README.md").read_text()
    assert f"top-1 accuracy {100 * ev['teacher_forced']['main']['top1']:.1f}%" in card


def test_model_card_states_figures():
    card = (DEMO / "README.md").read_text()
    for needle in ("held-out", "top-1", "eagle", "vanilla", "Python 3."):
        assert needle in card, needle


# -------------------------------------------------------------------------------------- data
def test_heldout_split_is_deterministic_and_disjoint():
    files = dd.list_files()
    train, held = dd.split_files(files)
    assert held and train and not set(train) & set(held)
    assert dd.split_files(list(reversed(files))) == (sorted(train, reverse=True), sorted(held, reverse=True))
    assert not any(f.startswith(("test/", "encodings/")) or "site-packages" in f for f in files)


def test_docstrings_become_think_blocks():
    src = 'import x\n\n@dec\ndef f(a):\n    """Do the\n    thing."""\n    def g():\n        """Inner."""\n        return 1\n    return a\n'
    out = dd.docstrings_as_think(src)
    assert out == ('import x\n\n<think>Do the thing.</think>\n@dec\ndef f(a):\n'
                   '    <think>Inner.</think>\n    def g():\n        return 1\n    return a\n')


# ------------------------------------------------------------------------------ training smoke
def test_training_script_tiny_smoke(tmp_path):
    out = tmp_path / "tiny"
    proc = subprocess.run(
        [sys.executable, str(SAMPLES / "train_demo.py"), "--out", str(out), "--tiny", "--max-steps", "3",
         "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    m = load_checkpoint(out)
    assert m.nextn == 3
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 3 and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 3 and len(log["heldout_ce_quick"]) == 4
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id("</think>") == dd.END_THINK
