#!/usr/bin/env python
"""Evaluate the demo checkpoint on held-out standard-library files; print the model card's figures.

    python samples/eval_demo.py --model samples/demo-model [--json samples/demo-model/eval.json]

Figures (all on held-out files never trained on, windows of seq+K+1 tokens, no overlap):
  * main head: cross-entropy and top-1 accuracy (next token);
  * vanilla MTP (module k at depth k) and eagle MTP (module 1 reused at every depth, fed its own
    output hidden), teacher-forced as in training: depth k at row i reads depth k-1's hidden at row i
    and the true token t_{i+k}, and is scored on t_{i+k+1}.  For each depth: CE, top-1 against the
    text, and agreement with the main head's greedy token for the same position (what greedy
    verification checks), plus the chained agreement P(depths 1..k all agree);
  * real greedy speculative decoding (reference PyTorch model, no KV cache): continue held-out
    prompts, verify K drafts per step with the main model, and report acceptance per depth and the
    mean number of tokens per main-model forward, for both modes; the output is checked to be
    identical to plain greedy decoding.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_data as dd  # noqa: E402

from mtp_trt.exporters.loader import load_checkpoint  # noqa: E402


# ------------------------------------------------------------------------------ teacher-forced
@torch.no_grad()
def teacher_forced(model, windows: torch.Tensor, seq: int, batch: int = 8) -> dict:
    K = model.nextn
    agg = {"main": {"ce": 0.0, "top1": 0.0, "n": 0}}
    for mode in ("vanilla", "eagle"):
        for k in range(1, K + 1):
            agg[f"{mode}_{k}"] = {"ce": 0.0, "top1": 0.0, "n": 0, "agree": 0.0, "chain": 0.0, "n_agree": 0}
    for b0 in range(0, len(windows), batch):
        w = windows[b0:b0 + batch]
        logits, h_main, _ = model(w[:, :seq])
        tgt = w[:, 1:seq + 1]
        main_pred = logits.argmax(-1)  # [B, S] prediction for t_{i+1}
        a = agg["main"]
        a["ce"] += F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="sum").item()
        a["top1"] += (main_pred == tgt).sum().item()
        a["n"] += tgt.numel()
        for mode in ("vanilla", "eagle"):
            h = h_main
            chain = None
            for k in range(1, K + 1):
                lg, h, _ = model.mtp_forward(k - 1 if mode == "vanilla" else 0, h, w[:, k:seq + k])
                tgt_k = w[:, k + 1:seq + k + 1]
                pred = lg.argmax(-1)  # row i: prediction for t_{i+k+1}
                a = agg[f"{mode}_{k}"]
                a["ce"] += F.cross_entropy(lg.flatten(0, 1), tgt_k.flatten(), reduction="sum").item()
                a["top1"] += (pred == tgt_k).sum().item()
                a["n"] += tgt_k.numel()
                # main head's greedy token for t_{i+k+1} sits at main row i+k: compare rows i < S-K
                rows = seq - K
                agree = pred[:, :rows] == main_pred[:, k:k + rows]
                chain = agree if chain is None else chain & agree
                a["agree"] += agree.sum().item()
                a["chain"] += chain.sum().item()
                a["n_agree"] += agree.numel()
    out = {}
    for name, a in agg.items():
        r = {"ce": a["ce"] / a["n"], "top1": a["top1"] / a["n"]}
        if "agree" in a:
            r["agree_with_main"] = a["agree"] / a["n_agree"]
            r["chain_agree"] = a["chain"] / a["n_agree"]
        out[name] = {k: round(v, 4) for k, v in r.items()}
    for mode in ("vanilla", "eagle"):
        # expected tokens per verification step with greedy acceptance ~ 1 + sum_k P(depths 1..k accepted)
        out[f"{mode}_expected_tokens_per_step"] = round(
            1 + sum(out[f"{mode}_{k}"]["chain_agree"] for k in range(1, K + 1)), 3)
    return out


# ---------------------------------------------------------------------------- real spec decode
@torch.no_grad()
def greedy(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        logits, _, _ = model(torch.tensor([seq]))
        seq.append(int(logits[0, -1].argmax()))
        if seq[-1] == dd.EOS:
            break
    return seq[len(prompt):]


@torch.no_grad()
def speculative(model, prompt: list[int], n: int, mode: str, K: int) -> tuple[list[int], list[int]]:
    """Greedy MTP speculative decoding; returns (new tokens, drafts accepted per step)."""
    seq = list(prompt)
    logits, h, _ = model(torch.tensor([seq]))
    seq.append(int(logits[0, -1].argmax()))  # the first token comes from the main model
    accepted = []
    while len(seq) - len(prompt) < n and seq[-1] != dd.EOS:
        toks = torch.tensor([seq])
        nxt = toks[:, 1:]  # rows 0..L-1 (h's rows) read t_{i+1}
        hid, drafts = h, []
        for k in range(K):
            lg, hid, _ = model.mtp_forward(k if mode == "vanilla" else 0, hid, nxt)
            d = int(lg[0, -1].argmax())
            drafts.append(d)
            nxt = torch.cat([nxt[:, 1:], torch.tensor([[d]])], dim=1)  # depth k+2 reads t_{i+k+2}
        L = len(seq)
        logits, hv, _ = model(torch.tensor([seq + drafts]))
        preds = logits[0, L - 1:].argmax(-1).tolist()  # main's tokens after t_{L-1}, d1, ..., dK
        n_acc = 0
        while n_acc < K and drafts[n_acc] == preds[n_acc] and drafts[n_acc] != dd.EOS:
            n_acc += 1
        accepted.append(n_acc)
        seq += drafts[:n_acc] + [preds[n_acc]]
        h = hv[:, :len(seq) - 1]
    return seq[len(prompt):len(prompt) + n], accepted


def spec_decode_eval(model, stream: np.ndarray, prompts: int, prompt_len: int, new_tokens: int,
                     check_lossless: int) -> dict:
    K = model.nextn
    starts = [int(j * (len(stream) - prompt_len) / prompts) for j in range(prompts)]
    res = {"prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens}
    plain = {j: greedy(model, stream[s:s + prompt_len].tolist(), new_tokens)
             for j, s in enumerate(starts[:check_lossless])}
    for mode in ("vanilla", "eagle"):
        acc, steps, produced, lossless = [], 0, 0, True
        for j, s in enumerate(starts):
            prompt = stream[s:s + prompt_len].tolist()
            out, accepted = speculative(model, prompt, new_tokens, mode, K)
            acc += accepted
            steps += len(accepted) + 1  # +1: the prefill forward that gave the first token
            produced += len(out)
            if j < check_lossless:
                lossless &= out == plain[j][:len(out)]
        acc = np.array(acc)
        res[mode] = {
            "accept_rate_per_depth": [round(float((acc >= k).sum() / max(1, (acc >= k - 1).sum())), 4)
                                      for k in range(1, K + 1)],
            "mean_accepted_drafts_per_step": round(float(acc.mean()), 3),
            "tokens_per_main_forward": round(produced / steps, 3),
            "identical_to_greedy": bool(lossless),
        }
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(Path(__file__).resolve().parent / "demo-model"))
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--windows", type=int, default=1000, help="at most this many held-out windows")
    p.add_argument("--prompts", type=int, default=8, help="prompts for the real speculative-decoding run (0: skip)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--check-lossless", type=int, default=2, help="prompts also decoded plainly to compare")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    t0 = time.time()
    model = load_checkpoint(a.model)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(a.model) / "tokenizer.json"))
    info_path = Path(a.model) / "train_log.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    seq = info.get("args", {}).get("seq", 256)
    py = sys.version.split()[0]
    if info.get("python") and info["python"].rsplit(".", 1)[0] != py.rsplit(".", 1)[0]:
        print(f"warning: trained on Python {info['python']}'s stdlib, evaluating on {py}'s: the held-out "
              f"files differ", file=sys.stderr)
    _, held = dd.split_files(dd.list_files())
    texts = [t for t in (dd.read_source(f) for f in held) if t is not None]
    stream = dd.encode_files(tok, texts)
    windows = torch.from_numpy(dd.eval_windows(stream, seq + model.nextn + 1, a.windows).astype(np.int64))
    chars = sum(len(t) for t in texts)
    res = {"model": str(a.model), "python": py, "heldout_files": len(texts), "heldout_tokens": int(len(stream)),
           "heldout_chars": chars, "windows": len(windows), "seq": seq, "K": model.nextn}
    res["teacher_forced"] = teacher_forced(model, windows, seq)
    t1 = time.time()
    tf = res["teacher_forced"]
    # per character, so that checkpoints with different tokenizers compare (bits per character)
    tf["main"]["bits_per_char"] = round(tf["main"]["ce"] / math.log(2) * (len(stream) - 2 * len(texts)) / chars, 4)
    print(f"held-out: {len(texts)} files, {len(stream)} tokens ({chars / len(stream):.2f} characters per token), "
          f"{len(windows)} windows of {seq}")
    print(f"main head      CE {tf['main']['ce']:.4f}  top-1 {tf['main']['top1']:.2%}  "
          f"({tf['main']['bits_per_char']} bits per character)")
    for mode in ("vanilla", "eagle"):
        for k in range(1, model.nextn + 1):
            r = tf[f"{mode}_{k}"]
            print(f"{mode:7s} depth {k}  CE {r['ce']:.4f}  top-1 {r['top1']:.2%}  agrees with main "
                  f"{r['agree_with_main']:.2%}  chain 1..{k} {r['chain_agree']:.2%}")
        print(f"{mode:7s} expected tokens per verification step (teacher-forced estimate): "
              f"{tf[mode + '_expected_tokens_per_step']}")
    if a.prompts:
        res["speculative_decoding"] = spec_decode_eval(model, stream, a.prompts, a.prompt_len, a.new_tokens,
                                                       a.check_lossless)
        sd = res["speculative_decoding"]
        for mode in ("vanilla", "eagle"):
            r = sd[mode]
            print(f"spec-decode {mode:7s}: accept rate per depth {r['accept_rate_per_depth']}, "
                  f"{r['mean_accepted_drafts_per_step']} drafts accepted/step, "
                  f"{r['tokens_per_main_forward']} tokens per main forward, identical to greedy: "
                  f"{r['identical_to_greedy']}")
    res["seconds"] = {"teacher_forced": round(t1 - t0, 1), "total": round(time.time() - t0, 1)}
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
