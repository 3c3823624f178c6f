"""The `mtp-trt` command line: a thin typer layer over the library; heavy imports stay inside commands."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import sys
from pathlib import Path

import typer
from typer.core import TyperCommand, TyperGroup

from mtp_trt import __version__
from mtp_trt.errors import MtpTrtError

click = sys.modules[TyperCommand.__mro__[1].__module__.rpartition(".")[0]]  # click, or the copy typer carries

_NO_BREAK = "\u2011"  # a non-breaking hyphen: stands in for "-" while the help is wrapped


class HelpFormatter(click.HelpFormatter):
    """Help wrapped at spaces only: a flag, a command or a default (`--tree-topk`, `mtp-trt`, `no-verify`) is never
    split across two lines at one of its hyphens."""

    def write_text(self, text: str) -> None:
        super().write_text(text.replace("-", _NO_BREAK))

    def write_dl(self, rows, *args, **kwargs) -> None:
        super().write_dl([(a.replace("-", _NO_BREAK), b.replace("-", _NO_BREAK)) for a, b in rows], *args, **kwargs)

    def getvalue(self) -> str:
        return super().getvalue().replace(_NO_BREAK, "-")


class HelpContext(click.Context):
    formatter_class = HelpFormatter


class Group(TyperGroup):
    context_class = HelpContext


class Command(TyperCommand):
    context_class = HelpContext


app = typer.Typer(
    help="DeepSeek-V3/R1-style Multi-Token Prediction speculative decoding on ONNX and TensorRT.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, cls=Group,
    rich_markup_mode=None,  # plain help: flags shown as flags (`--verify / --no-verify`), not as `<bool>` values
)


def command(summary: str):
    """app.command(), with the help formatter above and `summary`: the command's line in `mtp-trt --help`, shown
    whole (click would cut the docstring's first sentence off with "...")."""
    return app.command(cls=Command, short_help=summary)


# export --moe-form: the lowering's choice (auto), TensorRT's, or one of exporters/moe.py's FORMS in every graph.
MOE_FORMS = ("auto", "tensorrt", "static", "gather", "ort", "cpu")

# The first stage of an export: torch loads, then the request, the tokenizer files and every weight are checked.
CHECKING = "loading torch, checking the checkpoint"

# --verify in `run`, `serve` and `bench` (README.md says the same under "Integrity").
VERIFY_HELP = ("Hash every file of the export or engines again (default: only files whose size, mtime, ctime or "
               "inode changed since they were last verified).")


def clear_errors(fn):
    """Bad input ends in one line naming the file, field or value, and exit status 2 — no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MtpTrtError as e:
            typer.secho(f"error: {e}", fg="red", err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:  # Ctrl-C: partial outputs are gone (every `finally` ran), one line says so
            typer.secho("error: interrupted", fg="red", err=True)
            raise typer.Exit(130) from None
        except ModuleNotFoundError as e:  # an optional package a check before the work did not foresee
            from mtp_trt.validate import EXTRAS, missing_extra

            if (e.name or "").split(".")[0] not in EXTRAS:
                raise
            typer.secho(f"error: {missing_extra(f'mtp-trt {fn.__name__}', e.name)}", fg="red", err=True)
            raise typer.Exit(2) from None
        except OSError as e:  # a file the checks above did not foresee: still one line naming it
            if e.errno in WRITE_ERRORS and not e.filename:
                raise typer.Exit(_write_failed(e)) from None
            if not e.filename:
                raise
            typer.secho(f"error: {e.filename}: {e.strerror or e}", fg="red", err=True)
            raise typer.Exit(2) from None

    return wrapper


def _terminate(signum, frame):
    """SIGTERM ends the command as Ctrl-C does, through every `finally` (partial outputs are removed)."""
    raise SystemExit(128 + signum)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mtp-trt {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """mtp-trt: export, build and run DeepSeek-V3 MTP speculative decoding."""
    import signal

    signal.signal(signal.SIGTERM, _terminate)


@command("Summarize a checkpoint: architecture, layers, attention, MoE, MTP modules, cache size, BOS rule.")
@clear_errors
def inspect(checkpoint: Path = typer.Argument(None, help="Hugging Face checkpoint directory (config.json; "
                                                         "default: the bundled demo model).")) -> None:
    """Summarize a checkpoint's architecture (its family), layers, attention (dense MLA or DeepSeek Sparse
    Attention), MoE, MTP modules and the KV cache size (latent and indexer keys)."""
    from mtp_trt.config import FAMILIES, ModelConfig
    from mtp_trt.runner import demo_model
    from mtp_trt.validate import directory, stored_mtp_modules

    ckpt = directory(checkpoint or demo_model(), "a checkpoint directory (config.json)", hub=True)
    cfg = ModelConfig.from_file(ckpt)
    stored = stored_mtp_modules(ckpt, cfg.num_hidden_layers)
    mtp = str(cfg.num_nextn_predict_layers) if stored in (None, cfg.num_nextn_predict_layers) else \
        f"{cfg.num_nextn_predict_layers} in config.json, but {stored} stored in the weights"
    moe = cfg.moe_layers(cfg.num_hidden_layers)
    family = next(f for f in FAMILIES if f.architecture == cfg.architecture)
    rows = [
        ("architecture", f"{family.architecture} ({family.models})"),
        ("layers", f"{cfg.num_hidden_layers} ({moe} MoE, {cfg.num_hidden_layers - moe} dense)"),
        ("hidden size", str(cfg.hidden_size)),
        ("attention", f"MLA, {cfg.num_attention_heads} heads, q LoRA {cfg.q_lora_rank}, kv LoRA {cfg.kv_lora_rank}, "
                      f"rope {cfg.qk_rope_head_dim} ({cfg.rope.type}); " + _sparse_attention(cfg)),
        ("experts", f"{cfg.n_routed_experts or 0} routed (top {cfg.num_experts_per_tok}, {cfg.n_group} groups, "
                    f"{cfg.scoring_func}), {cfg.n_shared_experts} shared" if cfg.n_routed_experts else "none"),
        ("MTP modules", mtp),
        ("cache", f"{cfg.cache_dim} values per token and layer" + (
            f" ({cfg.latent_dim} latent, {cfg.index_head_dim} indexer key)" if cfg.dsa else " (latent)")
            + f", {cfg.cache_dim * 4 * cfg.num_hidden_layers} bytes per token in fp32 over the "
              f"{cfg.num_hidden_layers} layers"),
        ("weights", f"FP8 blocks {cfg.fp8_block_size}" if cfg.fp8_block_size else "unquantized"),
        ("BOS", _bos_row(ckpt, cfg)),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        typer.echo(f"{k:<{width}}  {v}")


def _sparse_attention(cfg) -> str:
    """inspect's word on the attention: dense, or DeepSeek Sparse Attention with its top-k and indexer."""
    if not cfg.dsa:
        return "dense"
    shared = sum(not cfg.has_indexer(i) for i in range(cfg.num_hidden_layers))
    return (f"DSA, top {cfg.index_topk} of the cached rows (lightning indexer: {cfg.index_n_heads} heads of "
            f"{cfg.index_head_dim}" + (f"; {shared} layers share the previous layer's selection" if shared else "")
            + ")")


def _bos_row(ckpt: Path, cfg) -> str:
    """Which BOS convention `mtp-trt run` will follow for this checkpoint (mtp_trt.tokenizer)."""
    from mtp_trt.tokenizer import bos_policy, load_tokenizer

    tok = ckpt / "tokenizer.json"
    try:
        return bos_policy(ckpt, cfg.bos_token_id, load_tokenizer(tok) if tok.is_file() else None).describe()
    except MtpTrtError as e:  # inspect still shows the rest
        return f"unknown ({e})"


class StageDisplay:
    """Progress display for multi-stage jobs: a spinner on the current stage, a tick and its time when done."""

    def __init__(self, title: str):
        from rich.console import Console

        self.console = Console(stderr=True, soft_wrap=True)  # a line is one line in a log, whatever its length
        self.title, self.stage, self.status, self.t0, self.stages = title, None, None, 0.0, 0

    def __enter__(self):
        import time

        self.start = time.perf_counter()
        self.status = self.console.status(self.title)
        self.status.__enter__()
        return self

    def __call__(self, stage: str) -> None:
        import time

        self._finish_stage()
        self.stage, self.t0, self.stages = stage, time.perf_counter(), self.stages + 1
        self.status.update(f"{self.title}: {stage}")
        if not self.console.is_terminal:  # no spinner in a log: say what starts, as it starts
            self.console.print(f"{self.title}: {stage}", highlight=False)

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
        if kind is None and self.stages:
            self.console.print(f"[bold]{self.title}[/] done in {time.perf_counter() - self.start:.1f} s")
        return False


@command("Export a checkpoint's main model and MTP modules to ONNX, with a manifest.")
@clear_errors
def export(
    checkpoint: Path = typer.Argument(None, help="Hugging Face checkpoint directory (default: the bundled demo model)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory (new or empty)."),
    nextn: int = typer.Option(None, help="Draft tokens per step K (default: the checkpoint's MTP layer count)."),
    mtp_mode: str = typer.Option("eagle", help="eagle (one MTP module reused K times) or vanilla (K modules)."),
    dtype: str = typer.Option("fp32", help="fp32, fp16 or bf16 (ONNX Runtime's CPU path wants fp32)."),
    max_batch: int = typer.Option(8, help="Largest batch the runtime will allocate caches for."),
    max_seq_len: int = typer.Option(None, help="Cache rows per sequence (default: min(4096, max_position_embeddings))."),
    lowering: str = typer.Option("onnx", help="onnx (standard operators) or plugin (mtp_trt custom nodes for TensorRT)."),
    moe_form: str = typer.Option("auto", help="MoE layers: auto (onnx lowering: ONNX Runtime's MoE node and its "
                                              "fused RoPE and add+norm nodes; plugin: TensorRT's forms), tensorrt "
                                              "(standard operators only, for plugin-free TensorRT engines), or one "
                                              "form in every graph: static, gather, ort or cpu (mtp-trt's CPU "
                                              "operator)."),
    trees: str = typer.Option(None, help="Tree step graphs DEPTH:TOPK:BUDGET,... for `run --tree-topk` (either "
                                         "mode; default: the trees `mtp-trt bench` found best, up to "
                                         "--nextn; none for none)."),
    cpu_ops: bool = typer.Option(None, "--cpu-ops/--no-cpu-ops", help="mtp-trt's CPU operators for ONNX Runtime "
                                 "(MLA attention and MoE as one node each; default: where they apply and the "
                                 "operator library is available)."),
    quant: str = typer.Option("none", help="Weights: none, int8 or int4 (block-quantized, for mtp-trt's CPU "
                                           "operators and TensorRT; the output head stays int8), or fp8 (TensorRT "
                                           "only, with --lowering plugin or --moe-form tensorrt: an FP8 "
                                           "checkpoint's e4m3 weights and block scales as stored)."),
    group_size: int = typer.Option(None, help="Weights per quantization block along a row: 16, 32, 64, 128 or 256 "
                                              "(default 32; fp8: 128, fixed)."),
) -> None:
    """Export the main model and the MTP module(s) to ONNX with a manifest (see docs/architecture.md)."""
    from mtp_trt.config import ModelConfig
    from mtp_trt.contract import DTYPES
    from mtp_trt.manifest import MTP_MODES
    from mtp_trt.quant import scheme
    from mtp_trt.runner import demo_model
    from mtp_trt.validate import check_choice, check_dsa, check_output_dir, directory, require

    checkpoint = directory(checkpoint or demo_model(), "a checkpoint directory (config.json)", hub=True)
    # the flags' values and the output first, in one line before any other (the exporter checks them again)
    check_output_dir(out)
    check_choice("--mtp-mode", mtp_mode, MTP_MODES, "mode")
    check_choice("--dtype", dtype, DTYPES, "dtype")
    check_choice("--lowering", lowering, ("onnx", "plugin"), "lowering")
    check_choice("--moe-form", moe_form, MOE_FORMS, "form")
    # and what the checkpoint's config.json says against them (its architecture, DeepSeek Sparse Attention's limits)
    check_dsa(ModelConfig.from_file(checkpoint / "config.json"), checkpoint, lowering,
              None if moe_form == "auto" else moe_form, scheme(quant, group_size))
    require("mtp-trt export", "torch", "onnx")

    with StageDisplay(f"export {checkpoint}") as show:
        show(CHECKING)  # seconds (torch's import) to minutes (a large checkpoint's weights read): said as it starts
        from mtp_trt.exporters.export import export as run_export

        path = run_export(checkpoint, out, nextn=nextn, mtp_mode=mtp_mode, dtype=dtype, lowering=lowering,
                          max_batch=max_batch, max_seq_len=max_seq_len, progress=show,
                          moe_form=None if moe_form == "auto" else moe_form, trees=trees, cpu_ops=cpu_ops,
                          quant_scheme=quant, group_size=group_size)
    typer.echo(f"wrote {path}")


@command("Build TensorRT engines from an export (--lowering plugin, or plugin-free: --moe-form tensorrt).")
@clear_errors
def build(
    export_dir: Path = typer.Argument(..., help="Export directory made with `mtp-trt export --lowering plugin`."),
    out: Path = typer.Option(..., "--out", "-o", help="Engine directory (new or empty)."),
    precision: str = typer.Option(None, help="fp32, fp16 or bf16; must be the export's dtype (default: it)."),
    max_batch: int = typer.Option(None, help="Largest batch of the profiles (default: the export's max_batch)."),
    max_seq_len: int = typer.Option(None, help="Cache rows T of the profiles (default: the export's max_seq_len)."),
    max_prefill: int = typer.Option(None, help="Longest prompt chunk of the prefill profile (default: min(512, T))."),
    target_arch: str = typer.Option("auto", help="Compute capabilities, comma-separated (8.9,12.0), native, all; "
                                                 "auto = this GPU, or without one every arch from 8.0 (RTX)."),
    timing_cache: Path = typer.Option(None, help="Timing cache file: read if present, written after the build."),
    flavour: str = typer.Option("auto", help="auto, tensorrt or tensorrt_rtx (auto: tensorrt if usable)."),
    plugins: str = typer.Option("auto", help="cpp (libmtp_trt_plugins.so), python, or auto: cpp where built and "
                                             "loadable, else python.  Either's engines run with the other."),
) -> None:
    """Build TensorRT engines (one per graph) with the MLA attention and acceptance plugins (docs/tensorrt.md)."""
    from mtp_trt.contract import DTYPES
    from mtp_trt.trt.compat import FLAVOURS
    from mtp_trt.trt.cpp_plugins import IMPLEMENTATIONS
    from mtp_trt.validate import check_choice, directory, require

    directory(export_dir, "an export directory (manifest.json)")
    if precision is not None:
        check_choice("--precision", precision, DTYPES, "precision")
    check_choice("--flavour", flavour, ("auto", *FLAVOURS), "flavour")
    check_choice("--plugins", plugins, IMPLEMENTATIONS, "implementation")
    require("mtp-trt build", "onnx", tensorrt=True)  # every missing piece in one line, before any work
    from mtp_trt.trt.builder import build as run_build

    with StageDisplay(f"build {export_dir}") as show:
        path = run_build(export_dir, out, precision=precision, max_batch=max_batch, max_seq_len=max_seq_len,
                         max_prefill=max_prefill, target_arch=target_arch, timing_cache=timing_cache,
                         flavour=flavour, plugins=plugins, progress=show)
    typer.echo(f"wrote {path}")


@command("Compare the engines with ONNX Runtime (needs a GPU).")
@clear_errors
def check(
    engine_dir: Path = typer.Argument(..., help="Engine directory made with `mtp-trt build`."),
    reference: Path = typer.Option(None, help="An `onnx`-lowering export of the same checkpoint for ONNX Runtime "
                                              "(default: exported from the checkpoint into a temporary folder)."),
    seed: int = typer.Option(0, help="Seed of the random inputs."),
) -> None:
    """Run the engines and compare them with ONNX Runtime (needs a GPU; exit 3 = skipped, see docs/tensorrt.md)."""
    from mtp_trt.trt.check import check as run_check
    from mtp_trt.validate import directory

    directory(engine_dir, "an engine directory (engines.json)")
    if reference is not None:
        directory(reference, "an export directory (manifest.json) for --reference")

    with StageDisplay(f"check {engine_dir}") as show:
        result = run_check(engine_dir, reference=reference, seed=seed, progress=show)
    for line in result.lines:
        typer.echo(line)
    if result.status != "passed":
        typer.secho(f"{result.status}: {result.reason}", fg="yellow" if result.status == "skipped" else "red",
                    err=True)
    raise typer.Exit(result.exit_code)


SPECULATION_HELP = ("auto: choose the draft tokens K (0 .. the export's nextn) before every step, for the most "
                    "expected tokens per second from each request's recent acceptance and the step times measured at "
                    "start-up and while decoding; fixed: --nextn (default all exported) every step.  Default: auto, "
                    "unless --nextn, --config, a tree or a vanilla-mode export fixes K.")


def _speculation(config: Path | None, nextn: int | None, mtp_mode: str | None, relaxed_topk: int,
                 relaxed_delta: float, speculation: str | None = None) -> tuple:
    """The MTP options of `run` and `serve`, merged with a speculative config file (--config), checked; and the
    source of relaxed_topk for messages."""
    from mtp_trt import validate as v

    if speculation is not None:
        v.check_choice("--speculation", speculation, ("auto", "fixed"), "mode")
        if speculation == "auto" and (nextn is not None or config):
            fixing = "--nextn" if nextn is not None else "--config"
            raise MtpTrtError(f"--speculation auto chooses K per step, but {fixing} fixes it; give one of them")
    relaxed_source = "--relaxed-topk"
    if config:
        from mtp_trt.spec_config import load_spec_config

        spec = load_spec_config(config)
        nextn, mtp_mode, relaxed_topk, relaxed_delta = v.merge_spec_config(spec, config, nextn, mtp_mode,
                                                                           relaxed_topk, relaxed_delta)
        relaxed_source = f"{config} (relaxed_topk)" if spec.relaxed_topk else relaxed_source
    if mtp_mode is not None:
        v.check_choice("--mtp-mode", mtp_mode, ("eagle", "vanilla"), "mode")
    if relaxed_topk < 0 or relaxed_delta < 0:
        raise MtpTrtError("--relaxed-topk and --relaxed-delta must be >= 0")
    return nextn, mtp_mode, relaxed_topk, relaxed_delta, relaxed_source


@command("Generate text with MTP speculative decoding.")
@clear_errors
def run(
    model: Path = typer.Argument(None, help="Engine directory (TensorRT, GPU), export directory or checkpoint "
                                            "(ONNX Runtime; default: the bundled demo model)."),
    prompt: list[str] = typer.Option(None, "--prompt", "-p", metavar="<text>", help="Prompt text; repeat for a batch."),
    prompt_file: Path = typer.Option(None, help="UTF-8 file with one prompt per line, `-` for standard input (added "
                                                "to --prompt; lines end at \\n, a \\r before it is dropped)."),
    nextn: int = typer.Option(None, help="Draft tokens per step K, 0 = plain decoding (default: all exported)."),
    mtp_mode: str = typer.Option(None, help="eagle or vanilla (default: the export's; eagle for checkpoints)."),
    max_new_tokens: int = typer.Option(128, help="Tokens to generate per prompt at most."),
    temperature: float = typer.Option(0.0, help="0 = greedy; > 0 samples, with lossless rejection sampling."),
    top_k: int = typer.Option(0, help="Sample among the k most likely tokens (0 = all)."),
    top_p: float = typer.Option(1.0, help="Sample among the smallest set of tokens with this mass."),
    seed: int = typer.Option(0, help="Random seed for sampling."),
    relaxed_topk: int = typer.Option(0, help="Relaxed acceptance while thinking: top-N (0 = strict)."),
    relaxed_delta: float = typer.Option(0.0, help="Relaxed acceptance: p(draft) >= p(top-1) - delta."),
    tree_topk: int = typer.Option(None, help="Draft a tree of depth --nextn, expanding the k likeliest nodes per "
                                             "level by k children (greedy; 1 = the chain; see --trees)."),
    tree_budget: int = typer.Option(None, help="Tree nodes verified per step (default: the export's tree for "
                                               "this depth and top-k)."),
    stop: list[str] = typer.Option(None, metavar="<text>", help="Stop string; repeat for several."),
    config: Path = typer.Option(None, help="TensorRT-LLM or vLLM speculative config, JSON or YAML (examples: "
                                           "docs/speculative_config.md)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    speculation: str = typer.Option(None, help=SPECULATION_HELP),
    threads: int = typer.Option(0, help="ONNX Runtime threads per graph (0 = the usable cores, at most 8)."),
    cuda_graphs: bool = typer.Option(True, help="TensorRT engines: replay each decode step as a CUDA graph."),
    bos: bool = typer.Option(None, "--bos/--no-bos", help="Start prompts with BOS or not (default: as the "
                                                          "checkpoint's tokenizer does; `mtp-trt inspect` shows it)."),
    truncate: bool = typer.Option(False, help="Keep the last tokens of a prompt too long for the cache "
                                              "(default: refuse it)."),
    verify: bool = typer.Option(False, help=VERIFY_HELP),
    quant: str = typer.Option(None, help="Quantize a checkpoint's weights: none, int8 or int4 (exported once per "
                                         "setting into the cache; default none)."),
    group_size: int = typer.Option(None, help="Weights per quantization block: 16, 32, 64, 128 or 256 (with "
                                              "--quant; default 32)."),
) -> None:
    """Generate text with MTP speculative decoding (TensorRT engines on a GPU, or ONNX Runtime on the CPU)."""
    import json

    from mtp_trt import validate as v
    from mtp_trt.runner import open_runner
    from mtp_trt.sampling import SamplingParams

    prompts = [v.text_arg("--prompt", p) for p in prompt or []]
    if prompt_file:
        prompts += v.read_prompt_file(prompt_file)
    if not prompts:
        raise MtpTrtError("no prompt: give --prompt TEXT or --prompt-file FILE")
    nextn, mtp_mode, relaxed_topk, relaxed_delta, relaxed_source = _speculation(config, nextn, mtp_mode, relaxed_topk,
                                                                                relaxed_delta, speculation)
    if max_new_tokens < 1:
        raise MtpTrtError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    v.check_sampling(temperature, top_k, top_p, seed, relaxed_topk, relaxed_delta, relaxed_source)
    stop = v.check_stop(list(stop or ()))
    v.check_threads(threads)
    with StageDisplay("preparing the model") as show:
        runner = open_runner(model, mtp_mode, threads=threads or None, cuda_graphs=cuda_graphs, progress=show,
                             bos=bos, verify=verify, scheme=v.quant_scheme(quant, group_size), batch=len(prompts),
                             trees=bool(tree_topk and tree_topk >= 2))  # (a checkpoint's export)
    manifest = runner.manifest
    opts = runner.options(nextn, sampling=SamplingParams(temperature, top_k, top_p), max_new_tokens=max_new_tokens,
                          relaxed_topk=relaxed_topk, relaxed_delta=relaxed_delta, tree_topk=tree_topk,
                          tree_budget=tree_budget, speculation=speculation)
    if opts.tree is not None and not opts.sampling.greedy:
        typer.secho("note: sampling drafts a chain (tree drafting is greedy only)", fg="yellow", err=True)
    encoded = runner.encode_prompts(prompts, truncate)  # too many, or too long to tokenize: refused before
    ids = runner.fit(encoded, opts.nextn, truncate, max_new_tokens)  # a prompt too long: refused before any output
    stream = not json_out and len(prompts) == 1
    if stream:
        typer.echo(prompts[0], nl=False)

    def on_text(i: int, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    report = runner.run(prompts, opts, seed=seed, stop=tuple(stop or ()), on_text=on_text if stream else None,
                        truncate=truncate, ids=encoded)
    truncated = [i for i, (a, b) in enumerate(zip(encoded, ids)) if len(b) < len(a)]
    if truncated:
        typer.secho(f"note: prompt(s) {', '.join(map(str, truncated))} truncated to their last tokens (--truncate)",
                    fg="yellow", err=True)
    if json_out:
        out = {"results": [r.__dict__ for r in report.results], "summary": report.summary(),
               "model": str(manifest.root), "mtp_mode": manifest.mtp_mode}
        _emit(compact_json(out))
        return
    if stream:
        typer.echo()
    else:
        for i, r in enumerate(report.results):
            typer.secho(f"--- [{i}] {r.finish_reason}", fg="cyan")
            typer.echo(r.prompt + r.text)
    for r in report.results:
        if r.message:
            typer.secho(f"note: {r.message}", fg="yellow", err=True)
    s = report.summary()
    rates = " ".join("-" if a is None else f"{a:.2f}" for a in s["acceptance_rate_per_pos"]) or "-"
    tree = f" tree {s['tree']} (depth:top-k:budget)" if s.get("tree") else ""
    auto = f" (auto, steps per K: {' '.join(f'{k}:{n}' for k, n in s['k_steps'].items())})" \
        if s["speculation"] == "auto" else ""
    typer.secho(f"\n{s['new_tokens']} new tokens in {s['seconds']:.2f} s ({s['tokens_per_second']:.1f} tokens/s), "
                f"{manifest.mtp_mode} nextn={s['nextn']}{auto}{tree}: {s['mean_acceptance_length']:.2f} tokens per "
                f"step, acceptance per draft {'depth' if tree else 'position'}: {rates}", fg="green", err=True)


def compact_json(value, level: int = 0) -> str:
    """JSON for `run --json`: an object's fields one per line, indented, and a list of numbers or strings (the token
    ids, the acceptance rates) and a small object deeper in (a result's speculative figures) on one line, so that a
    long answer stays a few lines."""
    import json

    pad, inner = "  " * level, "  " * (level + 1)
    flat = lambda v: not isinstance(v, (dict, list)) or (isinstance(v, list) and not any(  # noqa: E731
        isinstance(x, (dict, list)) for x in v))
    if isinstance(value, dict) and level >= 2 and all(not isinstance(v, (dict, list)) for v in value.values()) or \
            isinstance(value, dict) and level >= 3 and all(flat(v) for v in value.values()):
        return json.dumps(value, separators=(", ", ": "))  # a result's speculative figures, the steps per K: one line
    if isinstance(value, dict) and value:
        fields = [f"{inner}{json.dumps(str(k))}: {compact_json(v, level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(fields) + f"\n{pad}}}"
    if isinstance(value, list) and any(isinstance(x, (dict, list)) for x in value):
        return "[\n" + ",\n".join(f"{inner}{compact_json(x, level + 1)}" for x in value) + f"\n{pad}]"
    return json.dumps(value, separators=(", ", ": "))


@command("Serve an OpenAI-compatible API with continuous batching and MTP.")
@clear_errors
def serve(
    model: Path = typer.Argument(None, help="Engine directory (TensorRT, GPU), export directory or checkpoint "
                                            "(ONNX Runtime; default: the bundled demo model)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, help="Port to listen on."),
    max_batch: int = typer.Option(16, help="Requests decoded together at most; more wait in the queue."),
    max_queue: int = typer.Option(64, help="Requests waiting at most; more are answered 429."),
    prefill_chunk: int = typer.Option(256, help="Prompt tokens per request prefilled between two decode steps."),
    nextn: int = typer.Option(None, help="Draft tokens per step K, 0 = plain decoding (default: all exported)."),
    mtp_mode: str = typer.Option(None, help="eagle or vanilla (default: the export's; eagle for checkpoints)."),
    relaxed_topk: int = typer.Option(0, help="Relaxed acceptance while thinking: top-N (0 = strict; greedy requests)."),
    relaxed_delta: float = typer.Option(0.0, help="Relaxed acceptance: p(draft) >= p(top-1) - delta."),
    tree_topk: int = typer.Option(None, help="Draft a tree of depth --nextn (greedy requests; see `run`)."),
    tree_budget: int = typer.Option(None, help="Tree nodes verified per step (default: the export's tree)."),
    config: Path = typer.Option(None, help="TensorRT-LLM or vLLM speculative config, JSON or YAML (examples: "
                                           "docs/speculative_config.md)."),
    speculation: str = typer.Option(None, help=SPECULATION_HELP),
    api_key: str = typer.Option(None, help="Require `Authorization: Bearer KEY` on /v1/ endpoints."),
    served_model_name: str = typer.Option(None, help="The model id clients name (default: the model directory's "
                                                     "name)."),
    shutdown_timeout: float = typer.Option(30.0, help="On SIGTERM, seconds running requests may take to finish."),
    request_timeout: float = typer.Option(30.0, help="Seconds a client has to send a request's head, and again its "
                                                     "body; slower ones are answered 408 and disconnected."),
    max_request_bytes: int = typer.Option(None, help="Largest request body read; larger ones are answered 413 "
                                                     "before they are read (default: 64 KiB + 32 bytes per cache "
                                                     "row)."),
    threads: int = typer.Option(0, help="ONNX Runtime threads per graph (0 = the usable cores, at most 8)."),
    cuda_graphs: bool = typer.Option(True, help="TensorRT engines: replay each decode step as a CUDA graph."),
    bos: bool = typer.Option(None, "--bos/--no-bos", help="Start completion prompts with BOS or not (default: as "
                                                          "the checkpoint's tokenizer does)."),
    verify: bool = typer.Option(False, help=VERIFY_HELP),
    quant: str = typer.Option(None, help="Quantize a checkpoint's weights: none, int8 or int4 (exported once per "
                                         "setting into the cache; default none)."),
    group_size: int = typer.Option(None, help="Weights per quantization block: 16, 32, 64, 128 or 256 (with "
                                              "--quant; default 32)."),
) -> None:
    """Serve an OpenAI-compatible API (completions, chat, streaming, /metrics) with continuous batching and MTP."""
    from mtp_trt import validate as v

    v.require("mtp-trt serve", "fastapi", "uvicorn", "prometheus_client", "jinja2")
    from mtp_trt.runner import demo_model, open_runner
    from mtp_trt.serve_http import serve as run_server
    from mtp_trt.serve import Engine

    nextn, mtp_mode, relaxed_topk, relaxed_delta, _ = _speculation(config, nextn, mtp_mode, relaxed_topk,
                                                                   relaxed_delta, speculation)
    for flag, value in (("--max-batch", max_batch), ("--max-queue", max_queue), ("--prefill-chunk", prefill_chunk)):
        v.check_positive(flag, value)
    if not 0 <= port <= 65535:
        raise MtpTrtError(f"--port must be in 0..65535, got {port}")
    if not host.strip():
        raise MtpTrtError("--host: empty (0.0.0.0 listens on every interface, 127.0.0.1 on this machine only)")
    v.check_number("--shutdown-timeout", shutdown_timeout, 0)
    v.check_number("--request-timeout", request_timeout, 0)
    if request_timeout <= 0:
        raise MtpTrtError(f"--request-timeout must be > 0, got {request_timeout:g}")
    if max_request_bytes is not None:
        v.check_positive("--max-request-bytes", max_request_bytes)
    v.check_threads(threads)
    if api_key is not None and not api_key.strip():
        raise MtpTrtError("--api-key: empty")
    with StageDisplay("preparing the model") as show:
        runner = open_runner(model, mtp_mode, threads=threads or None, cuda_graphs=cuda_graphs, progress=show,
                             bos=bos, verify=verify, scheme=v.quant_scheme(quant, group_size), command="serve")
        opts = runner.options(nextn, relaxed_topk=relaxed_topk, relaxed_delta=relaxed_delta, tree_topk=tree_topk,
                              tree_budget=tree_budget, speculation=speculation)
        engine = Engine(runner, opts, max_batch=max_batch, max_queue=max_queue, chunk=prefill_chunk)
    name = served_model_name or (model or demo_model()).resolve().name

    def ready(server) -> None:
        k = f"K auto 0..{opts.nextn}" if opts.adaptive else f"nextn {opts.nextn}"
        typer.secho(f"serving {name} ({runner.manifest.mtp_mode}, {k}, up to {max_batch} requests at "
                    f"once) on {server.url}", fg="green", err=True)

    run_server(engine, name, host, port, api_key, shutdown_timeout, ready=ready, max_request_bytes=max_request_bytes,
               request_timeout=request_timeout)


@command("Time tokens/s of MTP decoding (nextn 0..K and trees) against transformers' generate.")
@clear_errors
def bench(
    model: Path = typer.Argument(None, help="Checkpoint (default: the bundled demo model), or an engine directory "
                                            "(TensorRT beside ONNX Runtime and transformers on the GPU)."),
    full: bool = typer.Option(False, "--full", help="The full sweep: both MTP modes at batches 1 and 8, 128 new "
                                                    "tokens, 9 rounds, transformers' generate beside (default: "
                                                    "eagle mode at batch 1, 128 new tokens, 5 rounds; under a minute "
                                                    "on the demo model)."),
    batch: list[int] = typer.Option(None, metavar="<int>", help="Batch sizes; repeat the option for several (default: "
                                                            "the sweep's, within an engine directory's max_batch)."),
    max_new_tokens: int = typer.Option(None, help="Tokens generated per sequence (default: the sweep's)."),
    repeats: int = typer.Option(None, help="Timed rounds per batch size (medians; ratios: medians of per-round "
                                           "ratios; default: the sweep's)."),
    transformers: bool = typer.Option(None, "--transformers/--no-transformers",
                                      help="Also time transformers' greedy generate in the same rounds (default: "
                                           "with --full, where transformers is installed)."),
    json_path: Path = typer.Option(None, "--out", "-o", help="JSON file to write all figures to."),
    plot_path: Path = typer.Option(None, "--plot", help="PNG (or SVG, PDF...) file to plot the figures to."),
    threads: int = typer.Option(0, help="ONNX Runtime threads per graph (0 = the usable cores, at most 8)."),
    verify: bool = typer.Option(False, help=VERIFY_HELP),
    quant: str = typer.Option(None, help="Quantize a checkpoint's weights: none, int8 or int4 (exported once per "
                                         "setting into the cache; default none)."),
    group_size: int = typer.Option(None, help="Weights per quantization block: 16, 32, 64, 128 or 256 (with "
                                              "--quant; default 32)."),
) -> None:
    """Benchmark tokens/s for nextn 0..K (and each export's trees) against transformers' generate: eagle mode at
    batch 1 by default, both modes at batches 1 and 8 with --full.  Figures are printed; files are written where
    -o and --plot say."""
    import importlib.util
    import platform

    from mtp_trt import bench as b
    from mtp_trt import quant as quant_mod
    from mtp_trt import validate as v
    from mtp_trt.backend import default_threads
    from mtp_trt.runner import demo_model, resolve_export

    sweep = b.FULL if full else b.QUICK
    for size in batch or ():
        v.check_positive("--batch", size)
    repeats = sweep.repeats if repeats is None else repeats
    max_new_tokens = sweep.max_new_tokens if max_new_tokens is None else max_new_tokens
    v.check_positive("--repeats", repeats)
    v.check_positive("--max-new-tokens", max_new_tokens)
    v.check_threads(threads)
    if json_path is not None:
        v.check_writable_file(json_path, "--out")  # before the benchmark, not after it
    if plot_path is not None:
        v.check_plot_format(plot_path)
        v.check_writable_file(plot_path, "--plot")
        v.require("bench --plot", "matplotlib")
    if transformers:
        v.require("bench --transformers", "torch", "transformers")
    elif transformers is None:
        transformers = sweep.transformers and all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
    scheme = v.quant_scheme(quant, group_size)
    ckpt = v.directory(model or demo_model(), "a checkpoint (config.json) or an engine directory (engines.json)",
                       hub=True)
    engines = (ckpt / "engines.json").is_file()
    if (ckpt / "manifest.json").is_file():
        raise MtpTrtError(f"{ckpt}: bench takes a checkpoint (it exports it in each MTP mode it times, and runs "
                          f"transformers on it) or an engine directory")

    def note(line: str) -> None:
        typer.secho(line, dim=True, err=True)

    cores, per_graph = v.usable_cores(), threads or default_threads()
    load_before = b.load_average()  # others' load: before this process's own exports and threads
    if engines:
        from mtp_trt.runner import verify_engines

        if scheme is not None:
            raise MtpTrtError(f"{ckpt}: --quant applies to a checkpoint (engines are built from an export)")
        verify_engines(ckpt, force=verify)
        batch = batch or b.default_batches(ckpt, sweep)
        b.check_batches(ckpt, batch, max_new_tokens)
        rows = b.run_engines(ckpt, batch, max_new_tokens, repeats, transformers, progress=typer.echo,
                             threads=threads or None, note=note)
    else:
        batch = batch or b.default_batches(ckpt, sweep)
        b.check_batches(ckpt, batch, max_new_tokens)
        with StageDisplay("preparing exports") as show:
            for mode in sweep.modes:
                resolve_export(ckpt, mode, progress=show, verify=verify, scheme=scheme, batch=max(batch))
        rows = b.run(ckpt, batch, max_new_tokens, repeats, transformers, progress=typer.echo, threads=threads or None,
                     scheme=scheme, modes=sweep.modes, note=note)
    load_after = b.load_average()
    meta = {"checkpoint": str(ckpt), "quant": (scheme or quant_mod.Scheme()).as_dict(), "max_new_tokens": max_new_tokens,
            "repeats": repeats, "sweep": "full" if full else "quick",
            "machine": f"{platform.machine()} {platform.processor()}".strip(), "cpus": os.cpu_count(),
            "onnxruntime_threads": per_graph, "usable_cores": cores,
            "load_average": {"before": load_before, "after": load_after}}
    typer.echo("\nbatch  engine                      mode     nextn0/transformers  best nextn  speedup  mean accepted"
               "  speedup/accepted  step/plain step")
    for r in b.summarize(rows):
        hf = f"{r['nextn0_over_transformers']:.2f}x" if r["nextn0_over_transformers"] else "-"
        typer.echo(f"{r['batch']:>5}  {r['engine'][8:]:<26}  {r['mode']:<7}  {hf:>19}  {r['best_nextn']:>10}  {r['speedup_over_nextn0']:6.2f}x"
                   f"  {r['mean_acceptance_length']:13.2f}  {r['speedup_over_mean_acceptance_length']:16.2f}"
                   f"  {r['step_cost_over_plain_step']:14.2f}x")
    for r in b.summarize(rows):
        if r.get("best_tree"):
            typer.echo(f"batch {r['batch']} {r['engine'][8:]} {r['mode']}: best tree {r['best_tree']} "
                       f"(depth:top-k:budget) {r['tree_speedup_over_nextn0']:.2f}x nextn 0, "
                       f"{r['tree_over_best_chain']:.2f}x the best chain; "
                       f"{r['tree_mean_acceptance_length']:.2f} tokens/step, "
                       f"{r['tree_acceptance_length_over_chain_same_depth']:+.2f} over the chain of its depth")
    typer.echo(b.load_line(load_before, load_after, cores, per_graph))
    busy = b.load_warning(load_before, load_after, cores, per_graph)
    if busy:
        typer.secho(busy, fg="yellow", err=True)
    differ = [f"{r['mode']} batch {r['batch']} nextn {r['nextn']}{' tree ' + r['tree'] if r.get('tree') else ''}"
              for r in rows if r.get("same_tokens_as_nextn0") is False]
    if differ:
        typer.secho(f"warning: tokens differ from nextn 0 (greedy MTP must be lossless): {', '.join(differ)}",
                    fg="red", err=True)
    written = []
    if json_path is not None:  # after the table: output that cannot be printed leaves no file behind
        b.write_json(rows, json_path, meta)
        written.append(str(json_path))
    if plot_path is not None:
        b.plot(rows, plot_path)
        written.append(str(plot_path))
    if written:
        typer.echo(f"wrote {' and '.join(written)}")
    if not full:
        note("the full sweep (both MTP modes, batches 1 and 8, 128 tokens, 9 rounds, transformers' generate): "
             "mtp-trt bench --full")


# A write that fails (standard output or a file: a full disk or device, a closed pipe, a file-size limit): one line.
WRITE_ERRORS = (errno.EPIPE, errno.ENOSPC, errno.EBADF, errno.EIO, errno.EDQUOT, errno.EFBIG)


def _closed_stdout() -> bool:
    """Whether file descriptor 1 is closed; then it is held on /dev/null, so that no file mtp-trt opens gets it."""
    try:
        os.fstat(1)
        return False
    except OSError:
        os.open(os.devnull, os.O_WRONLY)  # the lowest free descriptor: 1
        return True


def _emit(text: str) -> None:
    """Print `text` and a newline to standard output, every byte accounted for: Python's buffered stdout reports
    a large write that a closed pipe cut short as written; written here to the descriptor, it is an EPIPE."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (captured output)
        typer.echo(text)
        return
    sys.stdout.flush()
    data = memoryview((text + "\n").encode(sys.stdout.encoding or "utf-8", sys.stdout.errors or "strict"))
    while data:
        data = data[os.write(fd, data):]


def _write_failed(e: OSError) -> int:
    """A write that failed: one line; stdout onto /dev/null, so that its final flush at exit cannot fail again
    (what was being written is removed by the writer: atomic files and directories).  -> exit status 2."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    typer.secho(f"error: cannot write the output: {e.strerror or e}", fg="red", err=True)
    return 2


def entry() -> int:
    """The `mtp-trt` command: the app, with bad command-line syntax (an unknown option, a value of the wrong
    type) also one `error:` line and exit status 2, instead of click's usage box."""
    errors = sys.modules[typer.BadParameter.__module__]  # click's exceptions (typer may vendor its own click)
    if _closed_stdout():
        typer.secho("error: standard output is closed; mtp-trt writes its results there", fg="red", err=True)
        return 2
    try:
        code = app(standalone_mode=False)
    except OSError as e:
        if e.errno not in WRITE_ERRORS:
            raise
        return _write_failed(e)
    except KeyboardInterrupt:
        typer.secho("error: interrupted", fg="red", err=True)
        return 130
    except getattr(errors, "NoArgsIsHelpError", ()) as e:  # `mtp-trt` alone: the help, as before
        typer.echo(e.ctx.get_help())
        return 2
    except errors.UsageError as e:
        where = f"{e.ctx.command_path}: " if e.ctx else ""
        hint = f"; see {e.ctx.command_path} --help" if e.ctx else ""
        typer.secho(f"error: {where}{e.format_message().rstrip('.')}{hint}", fg="red", err=True)
        return 2
    except typer.Abort:
        typer.secho("error: interrupted", fg="red", err=True)
        return 130
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(entry())
