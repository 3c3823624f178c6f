"""What an int4 weight format and an activation grouping would cost in accuracy, before any kernel is written for
them: the demo checkpoint in transformers' DeepseekV3 (float32) with its weights replaced by their quantized values
and each quantized product's input by its int8 values, against the float model over the held-out windows
(benchmarks/quant_quality.py's: teacher-forced top-1 agreement and perplexity).  Not run in CI.

  python benchmarks/int4_formats.py [--windows N] [--only TEXT ...]

Rows (each a weight format for the matrices `--quant int4` writes at int4, and the group of values one int8
activation scale covers in those products):

* mtp-trt's int4 (mtp_trt/quant.py: blocks of 32, a float16 scale each, the divisor search), activations per 8
  values as the CPU operators quantize them -- the emulation of `--quant int4`: it reproduces quant_quality.py's
  figure for the export (96.09% on the whole held-out set);
* the same weights with activations per 32 and per 256 values;
* "sub-scaled": 32-value sub-blocks whose scales are signed integers of 8 (or 6) bits times one float16 scale per
  256 values (4.31 / 4.25 bits per weight against 4.5), each sub-block's scale searched as mtp-trt's (its largest
  magnitude over each divisor) on that integer grid, with activations per 256 values: the form whose products fold
  the sub-scales into the integer sums (one float step per 256 values, as ggml's K-quants), and the same weights
  with finer activation groups.

Everything else as `--quant int4` exports it: the output head, `q_a_proj`, `kv_a_proj_with_mqa`, the first layer's
MLP down-projection and W^UK / W^UV (`kv_b_proj`) at int8 (activations per 8 values; `kv_b_proj`'s inputs kept in
float, its products being inside the attention; each head's W^UK and W^UV quantized as the export stores them for
`MlaSelfAttention`: W^UK transposed, [Dl, Dn] in blocks along Dn, and W^UV [Dv, Dl] in blocks along Dl), the
embedding at int4, the router and norms in float32.  A last row puts W^UK / W^UV at int4 as well (mtp-trt's int4
blocks; a 304M int4 decode step would read 6% fewer bytes).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_common import DEMO  # noqa: E402
from quant_quality import heldout_windows, nll_and_argmax  # noqa: E402

from mtp_trt.quant import INT4_DIVISORS, Scheme, dequantize, quantize  # noqa: E402

INT8_MATRICES = ("q_a_proj", "kv_a_proj_with_mqa")  # (and layers.0.mlp.down_proj, lm_head; kv_b_proj: kv_b_format)
SUPER = 256  # values under one float16 scale in the sub-scaled format
SUB = 32  # values under one integer sub-scale


def mtp_trt_format(w: torch.Tensor, bits: int) -> torch.Tensor:
    """w [N, K] as mtp-trt's int8 / int4 blocks of 32 dequantize it."""
    data, scales = quantize(w.detach().numpy().astype(np.float32), Scheme(f"int{bits}", 32))
    return torch.from_numpy(dequantize(data, scales, w.shape[1], bits)[:, :w.shape[1]].copy())


def sub_scaled_format(w: torch.Tensor, sub_bits: int) -> torch.Tensor:
    """w [N, K] in the sub-scaled int4 format (module docstring), dequantized."""
    n, k = w.shape
    kp = -(-k // SUPER) * SUPER
    blocks = torch.nn.functional.pad(w.detach(), (0, kp - k)).reshape(n, kp // SUB, SUB)
    m = torch.gather(blocks, -1, blocks.abs().argmax(-1, keepdim=True))[..., 0]  # largest magnitude, signed
    top = (1 << (sub_bits - 1)) - 1
    largest = (m.abs() / min(abs(t) for t in INT4_DIVISORS)).reshape(n, kp // SUPER, SUPER // SUB)
    d = (largest.amax(-1, keepdim=True) / top).half().float()  # the float16 scale of 256 values
    d = torch.where(d == 0, torch.ones_like(d), d).expand_as(largest).reshape(n, kp // SUB)
    best, out = None, None
    for t in INT4_DIVISORS:
        scale = (torch.round(m / t / d).clamp(-top, top) * d)[..., None]
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round(blocks / safe).clamp(-8, 7) * scale
        err = ((q - blocks) ** 2).sum(-1)
        if best is None:
            best, out = err, q
        else:
            out = torch.where((err < best)[..., None], q, out)
            best = torch.minimum(err, best)
    return out.reshape(n, kp)[:, :k]


def kv_b_format(w: torch.Tensor, config, bits: int) -> torch.Tensor:
    """kv_b_proj's weight [H * (Dn + Dv), Dl] with each head's W^UK and W^UV as mtp-trt's blocks of `bits` in the
    layouts the export stores them in (module docstring), dequantized."""
    h, dn, dv = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    heads = w.detach().reshape(h, dn + dv, w.shape[1])
    uk = torch.stack([mtp_trt_format(heads[i, :dn].T.contiguous(), bits).T for i in range(h)])
    uv = torch.stack([mtp_trt_format(heads[i, dn:].contiguous(), bits) for i in range(h)])
    return torch.cat([uk, uv], 1).reshape(w.shape)


def int8_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x's int8 values, one scale (largest magnitude / 127) per `group` values along the last axis."""
    k = x.shape[-1]
    kp = -(-k // group) * group
    g = torch.nn.functional.pad(x, (0, kp - k)).reshape(*x.shape[:-1], kp // group, group)
    s = g.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s == 0, torch.ones_like(s), s)
    return (torch.round(g / s).clamp(-127, 127) * s).reshape(*x.shape[:-1], kp)[..., :k]


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """DeepseekV3Experts.forward with each expert product's input at int8 (groups of self.group)."""
    out = torch.zeros_like(hidden_states)
    for e in range(self.num_experts):
        token, slot = torch.where(top_k_index == e)
        if token.numel():
            x = int8_activations(hidden_states[token], self.group)
            gate, up = torch.nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            h = int8_activations(self.act_fn(gate) * up, self.group)
            y = torch.nn.functional.linear(h, self.down_proj[e]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y)
    return out


def quantized_model(int4, group: int, kv_b_bits: int = 8):
    """The demo model with the int4 matrices in format `int4` (a function of a weight), their inputs at int8 per
    `group` values, W^UK / W^UV at `kv_b_bits`, the rest as --quant int4 exports them."""
    from transformers import AutoModelForCausalLM
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()

    def inputs_at(g):
        return lambda module, args: (int8_activations(args[0], g),) + args[1:]

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.endswith("kv_b_proj"):
                module.weight.copy_(kv_b_format(module.weight, model.config, kv_b_bits))
            elif isinstance(module, torch.nn.Linear) and ".layers." in name:
                int8 = name.endswith(INT8_MATRICES) or name == "model.layers.0.mlp.down_proj"
                module.weight.copy_(mtp_trt_format(module.weight, 8) if int8 else int4(module.weight))
                module.register_forward_pre_hook(inputs_at(8 if int8 else group))
            elif isinstance(module, hf.DeepseekV3Experts):
                for p in (module.gate_up_proj, module.down_proj):
                    p.copy_(torch.stack([int4(e) for e in p]))
                module.group = group
                module.forward = experts_forward.__get__(module)
        model.lm_head.weight.copy_(mtp_trt_format(model.lm_head.weight, 8))
        model.model.embed_tokens.weight.copy_(mtp_trt_format(model.model.embed_tokens.weight, 4))
    model.lm_head.register_forward_pre_hook(inputs_at(8))
    return model


def scored(model, windows: np.ndarray, batch: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """(every window's next-token negative log-likelihoods, every position's argmax) of `model`, as
    quant_quality.py scores them."""
    nll, top = [], []
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            logits = model(torch.from_numpy(windows[i:i + batch]).long()).logits.float().numpy()
            for lg, ids in zip(logits, windows[i:i + batch]):
                n, t = nll_and_argmax(lg, ids)
                nll.append(n)
                top.append(t)
    return np.concatenate(nll), np.concatenate(top)


ROWS = {  # name: (the int4 matrices' format, their activation group, W^UK / W^UV's bits)
    "mtp-trt int4, activations per 8 (--quant int4)": (lambda w: mtp_trt_format(w, 4), 8, 8),
    "mtp-trt int4, activations per 32": (lambda w: mtp_trt_format(w, 4), 32, 8),
    "mtp-trt int4, activations per 256": (lambda w: mtp_trt_format(w, 4), 256, 8),
    "sub-scaled, 8-bit sub-scales, activations per 256": (lambda w: sub_scaled_format(w, 8), 256, 8),
    "sub-scaled, 6-bit sub-scales, activations per 256": (lambda w: sub_scaled_format(w, 6), 256, 8),
    "sub-scaled, 8-bit sub-scales, activations per 32": (lambda w: sub_scaled_format(w, 8), 32, 8),
    "sub-scaled, 8-bit sub-scales, activations per 8": (lambda w: sub_scaled_format(w, 8), 8, 8),
    "--quant int4 with W^UK / W^UV at int4 too": (lambda w: mtp_trt_format(w, 4), 8, 4),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=None, help="held-out windows of 256 tokens (default: all)")
    ap.add_argument("--only", nargs="+", metavar="TEXT", help="only the rows whose name holds one of these")
    a = ap.parse_args()
    rows = {k: v for k, v in ROWS.items() if not a.only or any(t in k for t in a.only)}
    if not rows:
        raise SystemExit(f"--only {' '.join(a.only)}: no row's name holds it; the rows: {'; '.join(ROWS)}")
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    windows, _ = heldout_windows(256, a.windows)
    ref_nll, ref_top = scored(AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval(), windows)
    print(f"{len(windows)} held-out windows, {ref_top.size} positions; the float model's perplexity "
          f"{np.exp(ref_nll.mean()):.4f}")
    for name, (int4, group, kv_b_bits) in rows.items():
        t0 = time.perf_counter()
        nll, top = scored(quantized_model(int4, group, kv_b_bits), windows)
        print(f"  {name:52s} top-1 agreement {100 * float((top == ref_top).mean()):6.2f}%  perplexity "
              f"{np.exp(nll.mean()):.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
