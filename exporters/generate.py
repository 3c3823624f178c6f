"""Plain greedy decoding with the reference model and its latent cache: the baseline MTP must equal."""

from __future__ import annotations

import torch

from mtp_trt.exporters.model import DeepseekV3


@torch.no_grad()
def greedy_generate(model: DeepseekV3, prompt: list[int], max_new_tokens: int, absorbed: bool = True,
                    eos_ids: tuple[int, ...] = ()) -> list[int]:
    """Prefill the prompt (expanded attention), then decode one token per step over the latent cache
    (absorbed attention unless `absorbed=False`).  Returns the new tokens only."""
    tokens = torch.tensor([prompt])
    logits, _, past = model(tokens)
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        if nxt in eos_ids:
            break
        logits, _, new = model(torch.tensor([[nxt]]), past=past, absorbed=absorbed)
        past = [torch.cat([p, n], dim=1) for p, n in zip(past, new)]
    return out
