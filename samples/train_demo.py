#!/usr/bin/env python
"""Train the demo checkpoint: a small DeepSeek-V3-architecture model with K MTP modules, on CPU.

    python samples/train_demo.py --out samples/demo-model            # the shipped model (~40 min, 2 cores)
    python samples/train_demo.py --out /tmp/t --tiny --max-steps 3   # smoke run, seconds

What it does, deterministically for a given --seed and Python version:
  1. corpus = the Python standard library's *.py files (see demo_data.py); ~5% of whole files held out;
  2. a byte-level BPE tokenizer (tokenizers) with <pad> <bos> <eos> <think> </think> specials;
  3. DeepSeek-V3 training with the MTP objective of the V3 paper (§2.2):
        L = CE(main) + lambda * mean_k CE(MTP depth k),
     teacher-forced: depth k at row i takes depth k-1's hidden at row i (the main model's post-norm
     hidden for k=1) and the embedding of t_{i+k}, and predicts t_{i+k+1}; computed with
     DeepseekV3.mtp_forward, i.e. exactly the runtime's convention;
     the routers' e_score_correction_bias is updated by the auxiliary-loss-free balancing rule
     (V3 §2.1.2): b_e += gamma * sign(mean_load - load_e) after every step;
  4. saves HF format (bf16) with the project's save_checkpoint, plus tokenizer.json,
     generation_config.json and train_log.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_data as dd  # noqa: E402

from mtp_trt.config import ModelConfig  # noqa: E402
from mtp_trt.exporters.loader import save_checkpoint  # noqa: E402
from mtp_trt.exporters.model import DeepseekV3, Gate  # noqa: E402


def hf_config(a, vocab_size: int) -> dict:
    """The HF DeepSeek-V3 config.json for the chosen sizes."""
    head = a.hidden // a.heads
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": a.hidden,
        "intermediate_size": a.inter,
        "moe_intermediate_size": a.moe_inter,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.heads,
        "q_lora_rank": a.q_lora,
        "kv_lora_rank": a.kv_lora,
        "qk_nope_head_dim": head,
        "qk_rope_head_dim": a.rope_dim,
        "v_head_dim": head,
        "n_routed_experts": a.experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": a.topk,
        "n_group": a.groups,
        "topk_group": a.topk_group,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": a.dense_layers,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": a.nextn,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rope_interleave": True,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": dd.BOS,
        "eos_token_id": dd.EOS,
        "pad_token_id": dd.PAD,
        "torch_dtype": "bfloat16",
    }


def mtp_losses(model: DeepseekV3, window: torch.Tensor, s: int, return_logits: bool = False):
    """window [B, S+K+1] -> (main CE, [CE per depth]) for the MTP objective (teacher-forced chain).

    Main: rows 0..S-1 read t_0..t_{S-1}, predict t_1..t_S.  Depth k (1-based) row i: hidden of
    depth k-1 at row i, embedding of t_{i+k}, predicts t_{i+k+1}."""
    logits, h, _ = model(window[:, :s])
    main = F.cross_entropy(logits.flatten(0, 1), window[:, 1:s + 1].flatten())
    per_depth = []
    for k in range(1, model.nextn + 1):
        logits_k, h, _ = model.mtp_forward(k - 1, h, window[:, k:s + k])
        per_depth.append(F.cross_entropy(logits_k.flatten(0, 1), window[:, k + 1:s + k + 1].flatten()))
    return main, per_depth


class LoadCounter:
    """Forward hooks on every router: tokens routed to each expert since the last reset."""

    def __init__(self, model: DeepseekV3):
        self.gates = [m for m in model.modules() if isinstance(m, Gate)]
        self.loads = [torch.zeros(g.weight.shape[0]) for g in self.gates]
        for g, load in zip(self.gates, self.loads):
            g.register_forward_hook(self._hook(load))

    @staticmethod
    def _hook(load: torch.Tensor):
        def hook(module, inputs, output) -> None:  # must return None: a value would replace the output
            load.add_(torch.bincount(output[1].flatten(), minlength=load.numel()).float())
        return hook

    @torch.no_grad()
    def update_bias(self, gamma: float) -> float:
        """b_e += gamma * sign(mean load - load_e); returns the worst max/mean load ratio seen."""
        worst = 0.0
        for g, load in zip(self.gates, self.loads):
            if load.sum() > 0:
                worst = max(worst, float(load.max() / load.mean()))
                g.e_score_correction_bias.add_(gamma * torch.sign(load.mean() - load))
            load.zero_()
        return worst


def lr_at(step: int, progress: float, a) -> float:
    """Linear warmup over the first `warmup` steps, then cosine decay over `progress` in [0, 1]."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    p = min(1.0, max(0.0, progress))
    return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def progress_at(step: int, elapsed: float, a, replay: list[float] | None) -> float:
    """Where the cosine stands: the larger of the step fraction and the wall-clock fraction (so a run on
    a slow or shared CPU still anneals fully within --minutes), or the recorded value when replaying."""
    if replay is not None:
        return replay[step] if step < len(replay) else 1.0
    by_steps = max(0, step - a.warmup) / max(1, a.max_steps - a.warmup)
    by_time = elapsed / (a.minutes * 60) if a.minutes > 0 else 0.0
    return max(by_steps, by_time)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output checkpoint directory (must not exist or be empty)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=42.0,
                   help="wall-clock budget of the training loop: the cosine schedule follows the larger of "
                        "step/max_steps and elapsed/budget and training stops when it ends (0: steps only)")
    p.add_argument("--replay-schedule", help="train_log.json of an earlier run: replay its schedule step by step "
                                             "(reproduces a run that the wall-clock budget shortened)")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="tiny model and corpus slice, for smoke tests")
    p.add_argument("--tokenizer", help="reuse this tokenizer.json instead of training one")
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--dense-layers", type=int, default=None, help="first_k_dense_replace: layers before the MoE ones")
    p.add_argument("--moe-inter", type=int, default=None, help="moe_intermediate_size (routed and shared experts)")
    p.add_argument("--nextn", type=int, default=3)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--mtp-lambda", type=float, default=0.3)
    p.add_argument("--bias-gamma", type=float, default=1e-2,
                   help="bias update speed (paper: 1e-3 over trillions of tokens; this run is ~1k steps)")
    p.add_argument("--think-fraction", type=float, default=0.25,
                   help="fraction of training files (by path hash) whose docstrings become <think> blocks")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 autocast for the forward pass (default on: ~20%% faster on AVX512-BF16 CPUs)")
    p.add_argument("--eval-windows", type=int, default=None, help="held-out windows for the final quick eval")
    p.add_argument("--log-every", type=int, default=25)
    a = p.parse_args(argv)
    if a.tiny:
        dflt = dict(vocab=384, hidden=64, layers=2, heads=2, seq=32, batch=2, max_steps=3, warmup=2, eval_windows=2,
                    dense_layers=1, moe_inter=32)
        a.q_lora, a.kv_lora, a.rope_dim, a.inter = 32, 16, 8, 128
        a.experts, a.groups, a.topk_group, a.topk = 4, 2, 1, 2
    else:
        # 6 layers (4 dense, 2 MoE) of width 256 and fine-grained experts (inter 64 = hidden / 4, as in
        # DeepSeek-V3's 2048 / 7168): a main model several times the cost of one MTP module, as in the
        # real model; a 384-token vocabulary keeps the four output heads cheap.
        dflt = dict(vocab=384, hidden=256, layers=6, heads=4, seq=256, batch=16, max_steps=1700, warmup=60,
                    eval_windows=64, dense_layers=4, moe_inter=64)
        a.q_lora, a.kv_lora, a.rope_dim, a.inter = 128, 64, 32, 768
        a.experts, a.groups, a.topk_group, a.topk = 8, 4, 2, 2
    for k, v in dflt.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    t_start = time.time()

    # ---- corpus + tokenizer
    files = dd.list_files()
    train_files, held_files = dd.split_files(files)
    if a.tiny:
        train_files, held_files = train_files[:8], held_files[:2]
    sources = {f: dd.read_source(f) for f in train_files + held_files}
    train_texts = [dd.render(f, sources[f], a.think_fraction) for f in train_files if sources[f] is not None]
    held_texts = [sources[f] for f in held_files if sources[f] is not None]
    if a.tokenizer:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(a.tokenizer)
    else:
        tok = dd.train_tokenizer(train_texts, a.vocab)
    vocab_size = tok.get_vocab_size()
    train_stream = torch.from_numpy(dd.encode_files(tok, train_texts).astype(np.int64))
    held_stream = dd.encode_files(tok, held_texts)
    t_data = time.time() - t_start
    print(f"corpus: {len(train_texts)} train files ({len(train_stream)} tokens), {len(held_texts)} held-out files "
          f"({len(held_stream)} tokens); vocab {vocab_size}; {t_data:.1f}s", flush=True)

    # ---- model
    config = hf_config(a, vocab_size)
    cfg = ModelConfig.from_dict(config)
    model = DeepseekV3(cfg, nextn=a.nextn, max_positions=a.seq + a.nextn + 1).init_weights(0.02)
    n_main = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp."))
    n_mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    print(f"params: main {n_main / 1e6:.2f}M, MTP {n_mtp / 1e6:.2f}M ({a.nextn} modules)", flush=True)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    loads = LoadCounter(model)

    # ---- data order: windows of S+K+1 tokens at seeded random offsets
    span = a.seq + a.nextn + 1
    gen = torch.Generator().manual_seed(a.seed)
    n_windows = len(train_stream) - span
    log = []
    model.train()
    t_train = time.time()
    step = 0
    stopped_early = False
    replay = None
    if a.replay_schedule:
        replay = json.loads(Path(a.replay_schedule).read_text())["schedule_progress"]
        a.max_steps = len(replay)
    progress_log = []
    for step in range(a.max_steps):
        progress = progress_at(step, time.time() - t_train, a, replay)
        if step >= a.warmup and progress >= 1.0 and step < a.max_steps - 1 and replay is None:
            stopped_early = True
            print(f"wall-clock budget of {a.minutes} min used up at step {step}/{a.max_steps}", flush=True)
            break
        progress_log.append(round(progress, 6))
        starts = torch.randint(0, n_windows, (a.batch,), generator=gen)
        window = torch.stack([train_stream[s:s + span] for s in starts.tolist()])
        lr = lr_at(step, progress, a)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
            main_ce, depth_ce = mtp_losses(model, window, a.seq)
        loss = main_ce + a.mtp_lambda * torch.stack(depth_ce).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        imbalance = loads.update_bias(a.bias_gamma)
        if step % a.log_every == 0 or step == a.max_steps - 1:
            el = time.time() - t_train
            rec = {"step": step, "loss": round(loss.item(), 4), "main_ce": round(main_ce.item(), 4),
                   "mtp_ce": [round(x.item(), 4) for x in depth_ce], "lr": round(lr, 7),
                   "grad_norm": round(float(gnorm), 3), "max_over_mean_load": round(imbalance, 2),
                   "elapsed_s": round(el, 1)}
            log.append(rec)
            print(json.dumps(rec), flush=True)
    steps_done = step + (0 if stopped_early else 1)
    train_seconds = time.time() - t_train

    # ---- quick held-out eval (full figures: eval_demo.py)
    model.eval()
    wins = torch.from_numpy(dd.eval_windows(held_stream, span, a.eval_windows).astype(np.int64))
    with torch.no_grad():
        tot = [0.0] * (a.nextn + 1)
        for i in range(0, len(wins), 8):
            m, ds = mtp_losses(model, wins[i:i + 8], a.seq)
            for j, x in enumerate([m] + ds):
                tot[j] += x.item() * len(wins[i:i + 8])
    held_ce = [round(x / max(1, len(wins)), 4) for x in tot]
    print(f"held-out CE main {held_ce[0]}, MTP depths {held_ce[1:]}", flush=True)

    # ---- save
    with tempfile.TemporaryDirectory() as tmp:
        tok_path = Path(tmp) / "tokenizer.json"
        tok.save(str(tok_path))
        gen_path = Path(tmp) / "generation_config.json"
        gen_path.write_text(json.dumps({"bos_token_id": dd.BOS, "eos_token_id": dd.EOS, "pad_token_id": dd.PAD,
                                        "do_sample": False, "max_new_tokens": 256}, indent=2) + "\n")
        info = {
            "args": {k: v for k, v in vars(a).items() if k != "out"},
            "python": sys.version.split()[0], "torch": torch.__version__,
            "threads": a.threads, "train_files": len(train_texts), "heldout_files": len(held_texts),
            "train_tokens_in_corpus": len(train_stream), "heldout_tokens_in_corpus": len(held_stream),
            "vocab_size": vocab_size, "params_main": n_main, "params_mtp": n_mtp,
            "steps": steps_done, "stopped_by_time_cap": stopped_early, "schedule_progress": progress_log,
            "tokens_seen": steps_done * a.batch * a.seq,
            "data_prep_seconds": round(t_data, 1), "train_seconds": round(train_seconds, 1),
            "heldout_ce_quick": held_ce, "log": log,
        }
        log_path = Path(tmp) / "train_log.json"
        log_path.write_text(json.dumps(info, indent=1) + "\n")
        out.parent.mkdir(parents=True, exist_ok=True)
        save_checkpoint(model, out, config, dtype=torch.bfloat16, extra_files={
            "tokenizer.json": tok_path, "generation_config.json": gen_path, "train_log.json": log_path})
        out.chmod(0o755)  # save_checkpoint's temporary directory (and safetensors file) are created 0700/0600
        for f in out.iterdir():
            f.chmod(0o644)
    print(f"saved {out} in {time.time() - t_start:.0f}s total "
          f"({steps_done} steps, {train_seconds:.0f}s training)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
