"""The `mtp-trt` command line: a thin typer layer over the library; heavy imports stay inside commands."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import typer

from mtp_trt import __version__
from mtp_trt.errors import MtpTrtError

app = typer.Typer(
    help="DeepSeek-V3/R1-style Multi-Token Prediction speculative decoding on ONNX and TensorRT.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)


def clear_errors(fn):
    """Bad input ends in one line naming the file, field or value, and exit status 2 — no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MtpTrtError as e:
            typer.secho(f"error: {e}", fg="red", err=True)
            raise typer.Exit(2) from None

    return wrapper


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mtp-trt {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """mtp-trt: export, build and run DeepSeek-V3 MTP speculative decoding."""


@app.command()
@clear_errors
def inspect(checkpoint: Path = typer.Argument(..., help="Hugging Face checkpoint directory (config.json).")) -> None:
    """Summarize a checkpoint's architecture: layers, MoE, MTP modules and the latent KV cache size."""
    from mtp_trt.config import ModelConfig

    cfg = ModelConfig.from_file(checkpoint)
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    rows = [
        ("layers", f"{cfg.num_hidden_layers} ({len(moe)} MoE, {cfg.num_hidden_layers - len(moe)} dense)"),
        ("hidden size", str(cfg.hidden_size)),
        ("attention", f"MLA, {cfg.num_attention_heads} heads, q LoRA {cfg.q_lora_rank}, kv LoRA {cfg.kv_lora_rank}, "
                      f"rope {cfg.qk_rope_head_dim} ({cfg.rope.type})"),
        ("experts", f"{cfg.n_routed_experts or 0} routed (top {cfg.num_experts_per_tok}, {cfg.n_group} groups, "
                    f"{cfg.scoring_func}), {cfg.n_shared_experts} shared" if cfg.n_routed_experts else "none"),
        ("MTP modules", str(cfg.num_nextn_predict_layers)),
        ("latent cache", f"{cfg.latent_dim} values per token and layer"),
        ("weights", f"FP8 blocks {cfg.fp8_block_size}" if cfg.fp8_block_size else "unquantized"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        typer.echo(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    sys.exit(app())
