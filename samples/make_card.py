#!/usr/bin/env python
"""Write samples/demo-model/README.md (the model card) from train_log.json and eval.json.

    python samples/eval_demo.py --model samples/demo-model --json samples/demo-model/eval.json
    python samples/make_card.py --model samples/demo-model
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def card(model_dir: Path, machine: str, note: str = "") -> str:
    cfg = json.loads((model_dir / "config.json").read_text())
    log = json.loads((model_dir / "train_log.json").read_text())
    ev = json.loads((model_dir / "eval.json").read_text())
    a, tf, K = log["args"], ev["teacher_forced"], cfg["num_nextn_predict_layers"]
    size = sum(f.stat().st_size for f in model_dir.iterdir() if f.is_file() and f.name != "README.md")
    rows = []
    for k in range(1, K + 1):
        v, e = tf[f"vanilla_{k}"], tf[f"eagle_{k}"]
        rows.append(f"| {k} | {v['ce']:.3f} | {pct(v['top1'])} | {pct(v['agree_with_main'])} | {pct(v['chain_agree'])} "
                    f"| {e['ce']:.3f} | {pct(e['top1'])} | {pct(e['agree_with_main'])} | {pct(e['chain_agree'])} |")
    sd = ev.get("speculative_decoding")
    sd_text = ""
    if sd:
        sd_rows = []
        for mode in ("vanilla", "eagle"):
            r = sd[mode]
            sd_rows.append(f"| {mode} | {', '.join(pct(x) for x in r['accept_rate_per_depth'])} | "
                           f"{r['mean_accepted_drafts_per_step']} | {r['tokens_per_main_forward']} | "
                           f"{'yes' if r['identical_to_greedy'] else 'NO'} |")
        sd_text = f"""
### Real greedy speculative decoding

`eval_demo.py` also runs MTP speculative decoding with the reference PyTorch model: {sd['prompts']} prompts
of {sd['prompt_len']} held-out tokens, {sd['new_tokens']} new tokens each, K = {K} drafts per step verified
greedily by the main model (accept while draft = main model's argmax, then one bonus token).
"Accept rate at depth k" is P(draft k accepted | draft k-1 accepted).  The first prompts are also
decoded plainly to check the output is identical (speculative decoding is lossless).

| mode | accept rate at depth 1..{K} | drafts accepted / step | tokens per main-model forward | identical to greedy |
|---|---|---|---|---|
{chr(10).join(sd_rows)}
"""
    met = (tf["main"]["top1"] >= 0.5, tf["vanilla_1"]["top1"] >= 0.4)
    verdict = {(True, True): "meets both", (False, False): "misses both"}.get(
        met, f"{'meets' if met[0] else 'misses'} the first and {'meets' if met[1] else 'misses'} the second")
    bpc = ""
    if "bits_per_char" in tf["main"]:
        bpc = (f"\nPer character (to compare tokenizers): about {tf['main']['bits_per_char']:.2f} bits; the held-out text is "
               f"{ev['heldout_chars'] / ev['heldout_tokens']:.2f} characters per token.  Top-1 accuracy is per token, so it "
               f"depends on the vocabulary: a smaller vocabulary makes shorter, more predictable tokens.\n")
    capped = " (stopped by the wall-clock cap before the schedule ended)" if log["stopped_by_time_cap"] else ""
    status = ""
    if log["stopped_by_time_cap"]:
        status = f"""
> **Note: stopped by the wall-clock budget.**  The {a['minutes']} min budget ended the run after {log['steps']} of
> the {a['max_steps']} planned steps, on {log['tokens_seen']:,} tokens; the cosine schedule follows elapsed time
> too, so it annealed fully.  A faster or idler machine runs more steps in the same budget; to repeat this
> run step for step anywhere, add `--replay-schedule` with this directory's `train_log.json` (below).
"""
    return f"""# mtp-trt demo model: a tiny DeepSeek-V3 with {K} MTP modules, trained on the Python standard library

A small model with the DeepSeek-V3 architecture (MLA with q LoRA, DeepSeekMoE with a shared
expert, sigmoid routing with `noaux_tc` grouped top-k and the auxiliary-loss-free balancing bias)
and **{K} Multi-Token Prediction modules**, trained from scratch on a 2-core CPU so that MTP
speculative decoding can be tried on any machine, with no downloads.  It is meant to write Python in
the style of the standard library; it is a demo, not a useful code model.
{status}
Files: `config.json` (Hugging Face DeepSeek-V3 fields, `num_nextn_predict_layers = {K}`),
`model.safetensors` (bf16, {size / 2**20:.1f} MiB in all with the other files; MTP module k stored as
`model.layers.{{{cfg['num_hidden_layers']}+k}}.*`, as in the official checkpoints), `tokenizer.json`,
`generation_config.json`, `train_log.json` (arguments and loss curve), `eval.json` (the figures below).

It loads with the project (`mtp_trt.exporters.loader.load_checkpoint`) and, for the main model,
with transformers' `DeepseekV3ForCausalLM.from_pretrained` (the MTP layers are reported as unused
weights; logits agree with the project's model to float rounding, see `tests/test_demo_checkpoint.py`).

## Architecture

| | |
|---|---|
| layers | {cfg['num_hidden_layers']} (layers 0..{cfg['first_k_dense_replace'] - 1} dense, layers >= {cfg['first_k_dense_replace']} MoE) + {K} MTP modules (MoE) |
| hidden / heads | {cfg['hidden_size']} / {cfg['num_attention_heads']} (qk_nope {cfg['qk_nope_head_dim']}, qk_rope {cfg['qk_rope_head_dim']}, v {cfg['v_head_dim']}) |
| MLA ranks | q_lora_rank {cfg['q_lora_rank']}, kv_lora_rank {cfg['kv_lora_rank']} |
| MoE | {cfg['n_routed_experts']} routed experts (inter {cfg['moe_intermediate_size']}) in {cfg['n_group']} groups, top-{cfg['topk_group']} groups, {cfg['num_experts_per_tok']} experts per token, {cfg['n_shared_experts']} shared expert; dense FFN inter {cfg['intermediate_size']} |
| vocabulary | {cfg['vocab_size']} (byte-level BPE; specials `<pad>`=0 `<bos>`=1 `<eos>`=2 `<think>`=3 `</think>`=4) |
| parameters | main model {log['params_main'] / 1e6:.2f} M, MTP modules {log['params_mtp'] / 1e6:.2f} M (embedding and output head shared) |

Why these sizes (the defaults of `train_demo.py`): the main model is several times the cost of one MTP
module, as in DeepSeek-V3 (61 layers beside one MTP block), so that drafting is cheap next to
verification; the experts are fine-grained (inter = hidden / 4, like V3's 2048 / 7168); and a small
vocabulary keeps the four output heads (main + 3 MTP depths) cheap in training.

The tokenizer adds no special tokens by itself: prepend `<bos>` (id {cfg['bos_token_id']}) to a prompt, as training did
(every file was `<bos> source <eos>`).

## Training

* Corpus: the `.py` files of Python {log['python']}'s standard library (`sysconfig.get_paths()["stdlib"]`),
  without site-packages, test directories (`test/`, `tests/`, `idle_test/`) and two generated-data
  trees (`encodings/`, `pydoc_data/`).  Whole files are held out when `sha1(relative path) % 100 < 5`:
  {log['train_files']} training files ({log['train_tokens_in_corpus']:,} tokens), {log['heldout_files']} held-out files
  ({log['heldout_tokens_in_corpus']:,} tokens).  Another Python version has different files, hence slightly different figures.
* Thinking: in {pct(a['think_fraction'])} of the training files (by path hash), each function's docstring is
  moved in front of its `def` as one line `<think>docstring</think>`, so the model learns to open and close think blocks.
  Held-out files are evaluated as they are.
* Objective (DeepSeek-V3 §2.2): `CE(main) + {a['mtp_lambda']} * mean_k CE(depth k)`, teacher-forced: depth k at
  row i reads depth k-1's hidden at row i (the main model's post-norm hidden for k = 1) and the embedding
  of t_(i+k), and predicts t_(i+k+1), through `DeepseekV3.mtp_forward` (the runtime's convention).
* Router balancing: aux-loss-free, `bias_e += {a['bias_gamma']} * sign(mean load - load_e)` after every step.
* {log['steps']} steps{capped} of {a['batch']} windows x {a['seq']} tokens = **{log['tokens_seen']:,} tokens seen**
  (~{log['tokens_seen'] / log['train_tokens_in_corpus']:.1f} epochs); AdamW (0.9, 0.95, wd 0.1), lr {a['lr']} with {a['warmup']} warmup
  steps and cosine decay to {a['min_lr_frac']}x, grad clip 1.0, bf16 autocast {'on' if a['bf16'] else 'off'}, seed {a['seed']}.
* Time: {log['train_seconds'] / 60:.1f} min of training (+{log['data_prep_seconds']:.0f} s tokenizer and data) on {machine},
  torch {log['torch']}, {log['threads']} threads.{(' ' + note) if note else ''}

Reproduce: `python samples/train_demo.py --out /tmp/demo-model --max-steps {a['max_steps']} --minutes {a['minutes']}`
(same seed, same data order; add `--replay-schedule samples/demo-model/train_log.json` to replay this run's
schedule step for step; bf16 autocast and thread scheduling make the result equal within noise rather
than bit for bit), then
`python samples/eval_demo.py --model /tmp/demo-model --json /tmp/demo-model/eval.json` and
`python samples/make_card.py --model /tmp/demo-model`.

## Evaluation (held-out files)

{ev['windows']} non-overlapping windows of {ev['seq']} tokens from the {ev['heldout_files']} held-out files ({ev['heldout_tokens']:,} tokens).

**Main head: held-out loss {tf['main']['ce']:.3f} nats/token (perplexity {2.718281828 ** tf['main']['ce']:.2f}), top-1 accuracy {pct(tf['main']['top1'])}.**
{bpc}
The project's targets are main-head top-1 >= 50% and MTP depth-1 top-1 >= 40%; this checkpoint
{verdict}.

MTP modules, teacher-forced as in training (true tokens as inputs).  *vanilla*: module k drafts depth k
(as `num_nextn_predict_layers` modules are meant to be used); *eagle*: module 1 reused at every depth, fed its
own output hidden.  "agrees" compares the draft with the main head's greedy token for the same position (what
greedy verification checks); "chain" is the fraction of rows where depths 1..k all agree, so
`1 + sum_k chain_k` estimates the tokens gained per verification step.

| depth | vanilla CE | vanilla top-1 | vanilla agrees | vanilla chain | eagle CE | eagle top-1 | eagle agrees | eagle chain |
|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Expected tokens per verification step (teacher-forced estimate): **vanilla {tf['vanilla_expected_tokens_per_step']}**,
**eagle {tf['eagle_expected_tokens_per_step']}** (depth 1 is the same module in both modes).
{sd_text}
Check these figures: `python samples/eval_demo.py --model samples/demo-model --windows {ev['windows']}`
(a few minutes on 2 cores).
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(Path(__file__).resolve().parent / "demo-model"))
    p.add_argument("--machine", default=f"a 2-core {platform.machine()} CPU (AMD EPYC, AVX-512 BF16), 24 GiB RAM")
    p.add_argument("--note", default="", help="a sentence on the run's conditions (e.g. whether the machine was idle)")
    a = p.parse_args(argv)
    d = Path(a.model)
    (d / "README.md").write_text(card(d, a.machine, a.note))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
