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


class StageDisplay:
    """Progress display for multi-stage jobs: a spinner on the current stage, a tick and its time when done."""

    def __init__(self, title: str):
        from rich.console import Console

        self.console = Console(stderr=True)
        self.title, self.stage, self.status, self.t0 = title, None, None, 0.0

    def __enter__(self):
        import time

        self.start = time.perf_counter()
        self.status = self.console.status(self.title)
        self.status.__enter__()
        return self

    def __call__(self, stage: str) -> None:
        import time

        self._finish_stage()
        self.stage, self.t0 = stage, time.perf_counter()
        self.status.update(f"{self.title}: {stage}")

    def _finish_stage(self) -> None:
        import time

        if self.stage:
            self.console.print(f"  [green]✓[/] {self.stage} [dim]({time.perf_counter() - self.t0:.1f} s)[/]")
            self.stage = None

    def __exit__(self, kind, value, tb):
        import time

        if kind is None:
            self._finish_stage()
        self.status.__exit__(kind, value, tb)
        if kind is None:
            self.console.print(f"[bold]{self.title}[/] done in {time.perf_counter() - self.start:.1f} s")
        return False


@app.command()
@clear_errors
def export(
    checkpoint: Path = typer.Argument(..., help="Hugging Face checkpoint directory."),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory (new or empty)."),
    nextn: int = typer.Option(None, help="Draft tokens per step K (default: the checkpoint's MTP layer count)."),
    mtp_mode: str = typer.Option("eagle", help="eagle (one MTP module reused K times) or vanilla (K modules)."),
    dtype: str = typer.Option("fp32", help="fp32, fp16 or bf16 (ONNX Runtime's CPU path wants fp32)."),
    max_batch: int = typer.Option(8, help="Largest batch the runtime will allocate caches for."),
    max_seq_len: int = typer.Option(None, help="Cache rows per sequence (default: min(4096, max_position_embeddings))."),
    lowering: str = typer.Option("onnx", help="onnx (standard operators) or plugin (mtp_trt custom nodes for TensorRT)."),
) -> None:
    """Export the main model and the MTP module(s) to ONNX with a manifest (see docs/architecture.md)."""
    from mtp_trt.exporters.export import export as run_export

    with StageDisplay(f"export {checkpoint}") as show:
        path = run_export(checkpoint, out, nextn=nextn, mtp_mode=mtp_mode, dtype=dtype, lowering=lowering,
                          max_batch=max_batch, max_seq_len=max_seq_len, progress=show)
    typer.echo(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(app())
