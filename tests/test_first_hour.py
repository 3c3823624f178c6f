"""What a new user meets in the first hour, and the third round of bad input: a bare install (no extras), the
commands' defaults (`bench`), paths that do not exist, progress on a log, and input checked before any work
(the weight scan, the tokenizer files, FP8 scales), each case by family; the help texts, the documented
`--config` examples, `run --json`'s layout and `bench`'s word on the machine's load.  The server's cases are in
tests/test_serve.py; the shared checkpoint and export are test_robustness's."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cli_driver import run_cli
from test_robustness import ckpt, cli_batch, exp, expect_errors, mtp_trt  # noqa: F401 (ckpt, exp: fixtures)


# ------------------------------------------------------------------------------------------- --truncate
def test_truncate_leaves_room_for_the_new_tokens(exp, tmp_path, monkeypatch):
    """A prompt cut by --truncate keeps as many of its last tokens as leave room for --max-new-tokens: every
    count of new tokens that fits is generated in full (finish reason length, no "KV cache full") whatever the
    drafts' acceptance, and one prompt token more than was kept would not have left that room, at any nextn
    (near the end of the cache the steps verify fewer drafts, so every nextn ends where plain decoding does)."""
    from mtp_trt.manifest import Manifest
    from mtp_trt.runner import Runner

    monkeypatch.setenv("MTP_TRT_CACHE_DIR", str(tmp_path / "cache"))
    runner = Runner(Manifest.load(exp))
    rows = runner.manifest.max_seq_len
    long = "ab" * 200
    for nextn in (0, 1, 2):
        for new in (1, 2, 3, 4, 8, 20, rows - 2 * nextn - 3):
            opts = dataclasses.replace(runner.options(nextn, max_new_tokens=new), eos_ids=())  # no early EOS
            (kept,) = runner.fit([runner.encode(long)], nextn, truncate=True, new_tokens=new)
            r = runner.run([long], opts, truncate=True).results[0]
            assert (len(r.tokens), r.finish_reason, r.message) == (new, "length", ""), (nextn, new, len(kept))
            more = runner.encode(long)[-len(kept) - 1:]  # one token more than --truncate kept
            if len(more) <= rows - 2 * nextn - 2:  # a prompt the export takes
                from mtp_trt.decode import generate

                seqs, _ = generate(runner.backend, [more], opts)
                assert len(seqs[0].generated) < new and "KV cache full" in seqs[0].message, (nextn, new)
    r = mtp_trt("run", exp, "-p", "x" * 500, "--truncate", "--max-new-tokens", "8", "--json", cache=tmp_path / "c")
    out = json.loads(r.stdout)["results"][0]
    assert r.returncode == 0 and len(out["tokens"]) == 8 and out["message"] == "", out


# -------------------------------------------------------------------------------------------- a bare install
# The optional packages of the extras (pyproject.toml), made unimportable in the interpreter that runs the
# commands: what `pip install mtp-trt` without an extra gives.
OPTIONAL = ("torch", "onnx", "transformers", "matplotlib", "fastapi", "uvicorn", "prometheus_client", "jinja2",
            "onnxscript", "tensorrt", "tensorrt_rtx")

# `import name` fails and importlib.util.find_spec(name) is None: not installed
_HIDE = r"""
import json, sys
for name in json.loads(sys.argv[1]):
    sys.modules[name] = None
"""


def bare(cases: list[list], cache: Path) -> list[tuple[int, str, str]]:
    return run_cli(cases, cache, _HIDE, json.dumps(OPTIONAL))


def test_a_bare_install_runs_exports_and_refuses_the_rest_in_one_line(ckpt, exp, tmp_path):
    """Without torch, onnx, TensorRT, transformers, matplotlib or the serve extra: an export directory runs;
    `inspect` reads a checkpoint; every command that needs an extra (a checkpoint to export, `export`, `build`,
    `bench`, `--plot`, `--transformers`, `serve`) is one line naming every missing package (TensorRT too) and the
    extras that install them, before any work."""
    cpu = 'needs torch and onnx, which are not installed: pip install "mtp-trt[cpu]"'
    cases = [
        (["run", "-p", "def f(x):"], cpu),
        (["run", ckpt, "-p", "x"], f'exporting the checkpoint {ckpt} into the cache (its first use) {cpu}'),
        (["export", "-o", tmp_path / "out"], f"mtp-trt export {cpu}"),
        (["build", exp, "-o", tmp_path / "engines"], 'mtp-trt build needs onnx and TensorRT, which are not '
                                                     'installed: pip install "mtp-trt[cpu]"; TensorRT: pip install '
                                                     '"mtp-trt[rtx]" (TensorRT for RTX, which builds without a GPU '
                                                     'too) or "mtp-trt[gpu]" (TensorRT for data-centre GPUs)'),
        (["bench"], cpu),
        (["bench", ckpt, "--plot", tmp_path / "b.png"], 'bench --plot needs matplotlib, which is not installed: '
                                                        'pip install "mtp-trt[dev]"'),
        (["bench", ckpt, "--transformers"], 'bench --transformers needs torch and transformers, which are not '
                                            'installed: pip install "mtp-trt[cpu,dev]"'),
        (["serve", exp], 'mtp-trt serve needs fastapi, uvicorn, prometheus_client and jinja2, which are not '
                         'installed: pip install "mtp-trt[serve]"'),
    ]
    results = bare([argv for argv, _ in cases] + [["run", exp, "-p", "ab", "--max-new-tokens", "4", "--json"],
                                                  ["inspect", ckpt]], tmp_path / "cache")
    for (argv, fragment), (code, err, out) in zip(cases, results):
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and fragment in err, (argv, err)
        assert out == ""
    (code, err, out), (code2, err2, out2) = results[-2:]
    assert code == 0 and len(json.loads(out)["results"][0]["tokens"]) == 4, err
    assert code2 == 0 and "MTP modules" in out2, err2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    assert not (tmp_path / "cache" / "exports").exists()


def test_an_optional_module_missing_midway_is_one_line(monkeypatch):
    """A job that reaches an optional package its checks did not foresee still ends in one line naming it."""
    from typer.testing import CliRunner

    from mtp_trt import cli

    def export_without_onnx(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'onnx.checker'", name="onnx.checker")

    monkeypatch.setattr("mtp_trt.exporters.export.export", export_without_onnx)
    r = CliRunner().invoke(cli.app, ["export", "-o", "/tmp/mtp-trt-never-written"])
    assert r.exit_code == 2 and checked_then_refused(r.output.strip(), staged=True), r.output
    assert r.output.strip().endswith('\nerror: mtp-trt export needs onnx, which is not installed: pip install '
                                     '"mtp-trt[cpu]"'), r.output


# ---------------------------------------------------------------------------------------- paths not there
def test_a_mistyped_path_is_named_as_such(ckpt, exp, tmp_path):
    """Every command that takes a directory: a path where nothing is says so (not that it is the wrong kind of
    directory), and a file where a directory belongs says that."""
    missing, a_file = tmp_path / "chekpoint", tmp_path / "notes.txt"
    a_file.write_text("x")
    cases = []
    for where, what in ((missing, "no such file or directory"), (a_file, "is a file, not a directory")):
        for argv in (["inspect", where], ["export", where, "-o", tmp_path / "out"], ["run", where, "-p", "x"],
                     ["bench", where], ["serve", where], ["build", where, "-o", tmp_path / "engines"],
                     ["check", where], ["check", exp, "--reference", where]):
            cases.append((argv, f"{where}: {what}; expected "))
    expect_errors(cases, tmp_path / "cache", ckpt, exp)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["notes.txt"]


# ------------------------------------------------------------------------------------- the weight scan
def _damaged_weights(ckpt: Path, fp8: Path):
    """(label, checkpoint, tensor name, change to its tensors, export flags, fragment): values that are not
    finite in every stored float type, FP8 NaN codes, block scales that are not finite, not positive or not
    floats, and values beyond the export's dtype."""
    import torch

    emb, norm = "model.embed_tokens.weight", "model.norm.weight"
    o_proj = "model.layers.0.self_attn.o_proj.weight"

    def poke(name, value, dtype=None):
        def change(t):
            t[name] = t[name].clone() if dtype is None else t[name].to(dtype)
            flat = t[name].view(-1)
            flat[min(3, flat.numel() - 1)] = value
        return change

    def codes(name, byte):
        def change(t):
            c = t[name].view(torch.uint8).clone()
            c.view(-1)[7] = byte
            t[name] = c.view(torch.float8_e4m3fn)
        return change

    def retype(name, dtype):
        def change(t):
            t[name] = t[name].to(dtype)
        return change

    nan = "holds 1 NaN or infinite value(s)"
    yield "fp32-nan", ckpt, emb, poke(emb, float("nan")), [], nan + " (as float32)"
    yield "fp32-inf", ckpt, norm, poke(norm, float("inf")), [], nan
    yield "bf16-nan", ckpt, norm, poke(norm, float("nan"), torch.bfloat16), [], nan + " (as bfloat16)"
    yield "fp16-ninf", ckpt, emb, poke(emb, float("-inf"), torch.float16), [], nan + " (as float16)"
    yield "fp8-nan-code", fp8, o_proj, codes(o_proj, 0x7F), [], nan + " (as float8_e4m3fn)"
    yield "fp8-neg-nan-code", fp8, o_proj, codes(o_proj, 0xFF), [], nan
    scale = o_proj + "_scale_inv"
    yield "scale-nan", fp8, scale, poke(scale, float("nan")), [], nan + " (as float32)"
    yield "scale-inf", fp8, scale, poke(scale, float("inf")), [], nan
    yield "scale-zero", fp8, scale, poke(scale, 0.0), [], "holds 1 block scale(s) <= 0"
    yield "scale-negative", fp8, scale, poke(scale, -0.5), [], "holds 1 block scale(s) <= 0"
    for dtype, shown in ((torch.int32, "int32"), (torch.int64, "int64"), (torch.float8_e4m3fn, "float8_e4m3fn")):
        yield f"scale-{shown}", fp8, scale, retype(scale, dtype), [], f"tensor '{scale}' has dtype {shown}, expected"
    yield "beyond-fp16", ckpt, norm, poke(norm, 1e5), ["--dtype", "fp16", "--no-cpu-ops"], \
        "holds 1 value(s) beyond 65504, the largest of the export's dtype"


CHECKING = "loading torch, checking the checkpoint"  # the first stage of an export (mtp_trt/cli.py, runner.py)


def checked_then_refused(err: str, staged: bool | None) -> bool:
    """stderr is one `error:` line, after (where `staged`: an export's checks failed; None: either) the line of
    the export's first stage, torch's import and the checks, and no other: no work was reported."""
    *before, last = err.splitlines()
    return last.startswith("error: ") and len(before) in ((0, 1) if staged is None else (int(staged),)) and \
        all(x.endswith(CHECKING) for x in before)


def test_the_weights_are_scanned_before_any_work(ckpt, tmp_path):
    """Each damaged tensor (_damaged_weights): `export` and `run` end in exactly one line naming the file and the
    tensor -- after the line of the checks' stage alone, none of work -- and write nothing, in the output or the
    cache."""
    import torch  # noqa: F401
    from safetensors.torch import load_file, save_file

    from test_loader import write_fp8_checkpoint

    fp8 = write_fp8_checkpoint(ckpt, tmp_path / "fp8", (128, 128))
    shutil.copyfile(ckpt / "tokenizer.json", fp8 / "tokenizer.json")
    cases = []
    for i, (label, source, name, change, flags, fragment) in enumerate(_damaged_weights(ckpt, fp8)):
        d = tmp_path / label
        shutil.copytree(source, d)
        tensors = load_file(d / "model.safetensors")
        change(tensors)
        save_file(tensors, d / "model.safetensors")
        named = (f"{d / 'model.safetensors'}: tensor '{name}", fragment)
        cases.append((["export", d, "-o", tmp_path / f"out-{label}", *flags], named))
        if i % 4 == 0:
            cases.append((["run", d, "-p", "x"], named))
    results = cli_batch([a for a, _ in cases], tmp_path / "cache")
    for (argv, fragments), (code, err, out) in zip(cases, results):
        assert code == 2 and checked_then_refused(err, staged=True), (argv, err)
        assert all(f in err for f in fragments), (argv, err)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out-")]
    assert not (tmp_path / "cache" / "exports").exists() or not any((tmp_path / "cache" / "exports").iterdir())


# ------------------------------------------------------------------------------------- the tokenizer files
def _damaged_tokenizer_files():
    """(label, file, text, fragment): every file the export copies beside the graphs, each way it can be wrong
    (not JSON, not an object, a field of the wrong type, a value that makes no sense; "bos" labels: a rule that
    `run` cannot follow, though an export may be made and run with --bos or --no-bos)."""
    tc = "tokenizer_config.json"
    yield "config-not-json", tc, "{add_bos_token: yes}", "not valid JSON"
    yield "config-list", tc, "[1, 2]", "the file must be an object"
    yield "config-bos-yes", tc, '{"add_bos_token": "yes"}', "field 'add_bos_token' must be true or false, got 'yes'"
    yield "config-bos-1", tc, '{"add_bos_token": 1}', "field 'add_bos_token' must be true or false, got 1"
    yield "config-template-5", tc, '{"chat_template": 5}', "field 'chat_template' must be a string or a list"
    yield "config-template-entry", tc, '{"chat_template": [{"name": "default"}]}', "field 'chat_template'"
    yield "config-bos-token-list", tc, '{"bos_token": ["<s>"]}', "field 'bos_token' must be a string or an object"
    yield "config-bos-content-int", tc, '{"bos_token": {"content": 3}}', "field 'bos_token'"
    yield "config-template-broken", tc, '{"chat_template": "{% for m in messages %}"}', \
        "field 'chat_template' does not compile"
    yield "bos-without-id", tc, '{"add_bos_token": true}', "add_bos_token is true but no BOS id is known"
    gc = "generation_config.json"
    yield "generation-not-json", gc, '{"eos_token_id": [1,}', "not valid JSON"
    yield "generation-eos-beyond", gc, '{"eos_token_id": [95, 4000]}', "field 'eos_token_id' must be token ids"
    yield "generation-eos-str", gc, '{"eos_token_id": "95"}', "field 'eos_token_id' must be token ids"
    yield "tokenizer-not-json", "tokenizer.json", "{", "not a valid tokenizers file"


def test_the_tokenizer_files_are_checked_in_the_checkpoint_before_any_work(ckpt, tmp_path):
    """Each damaged file (_damaged_tokenizer_files): `run` of the checkpoint and `export` end in one line naming
    the checkpoint's own file (not a copy in the cache) and the field, before any line of progress but the
    checks' own (export); nothing is exported, into the cache or elsewhere."""
    cases = []
    for label, name, text, fragment in _damaged_tokenizer_files():
        d = tmp_path / label
        shutil.copytree(ckpt, d)
        (d / name).write_text(text)
        exports = [] if label.startswith("bos") else [["export", d, "-o", tmp_path / f"out-{label}"]]
        for argv in (["run", d, "-p", "x"], *exports):
            cases.append((argv, (f"error: {d / name}: ", fragment)))
    results = cli_batch([a for a, _ in cases], tmp_path / "cache")
    for (argv, fragments), (code, err, out) in zip(cases, results):
        # run checks most tokenizer files before it caches an export (the chat template, in it); export, after its
        # first line
        assert code == 2 and checked_then_refused(err, staged=True if argv[0] == "export" else None), (argv, err)
        assert all(f in err for f in fragments), (argv, err)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out-")]
    assert not (tmp_path / "cache" / "exports").exists() or not any((tmp_path / "cache" / "exports").iterdir())


def test_an_export_s_tokenizer_config_is_typed_too(ckpt, exp, tmp_path, monkeypatch):
    """An export whose tokenizer_config.json says add_bos_token "yes" (written by hand, or by an older mtp-trt) is
    refused by run, naming the field; inspect of such a checkpoint shows the BOS rule as unknown, and why."""
    from mtp_trt.errors import MtpTrtError
    from mtp_trt.manifest import Manifest, seal
    from mtp_trt.runner import Runner
    from test_robustness import sha256_of

    monkeypatch.setenv("MTP_TRT_CACHE_DIR", str(tmp_path / "cache"))
    d = tmp_path / "exp"
    shutil.copytree(exp, d)
    (d / "tokenizer_config.json").write_text('{"add_bos_token": "yes"}')
    raw = json.loads((d / "manifest.json").read_text())
    raw["tokenizer_files"]["tokenizer_config.json"] = sha256_of(d / "tokenizer_config.json")
    (d / "manifest.json").write_text(json.dumps(seal(raw)))
    with pytest.raises(MtpTrtError, match="field 'add_bos_token' must be true or false, got 'yes'"):
        Runner(Manifest.load(d))
    k = tmp_path / "ckpt"
    shutil.copytree(ckpt, k)
    shutil.copyfile(d / "tokenizer_config.json", k / "tokenizer_config.json")
    r = mtp_trt("inspect", k, cache=tmp_path / "cache", text=True)
    assert r.returncode == 0 and "BOS           unknown (" in r.stdout and "'add_bos_token'" in r.stdout, r.stdout


# ------------------------------------------------------------------------------------------ progress on a log
def test_progress_on_a_log_is_whole_lines_in_order(ckpt, tmp_path, monkeypatch):
    """Without a terminal (a CI log): a run waiting for another process's export of the same checkpoint says so
    at once; each stage is one line however long (no wrapping at 80 columns); a stage is ticked after the work it
    names, and only the export's own stages are (no tick for the export as a whole before it starts)."""
    import threading

    from mtp_trt.fsutil import locked
    from mtp_trt.quant import Scheme
    from mtp_trt.runner import DEFAULT_MAX_BATCH, cache_entry

    long = tmp_path / ("a-checkpoint-whose-name-is-longer-than-a-terminal-line-" * 2).rstrip("-")
    shutil.copytree(ckpt, long)
    cache = tmp_path / "cache"
    monkeypatch.setenv("MTP_TRT_CACHE_DIR", str(cache))
    entry = cache_entry(long, "eagle", Scheme(), DEFAULT_MAX_BATCH, trees=False)  # a run that drafts no tree
    lines, waiting = [], threading.Event()
    with locked(cache / "locks" / f"{entry.name}.lock"):  # another process exporting it, as far as run can tell
        p = subprocess.Popen(["mtp-trt", "run", str(long), "-p", "x", "--max-new-tokens", "2"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "80"})

        def read():
            for line in p.stderr:
                lines.append(line.rstrip("\n"))
                if "waiting for another mtp-trt process" in line:
                    waiting.set()

        reader = threading.Thread(target=read)
        reader.start()
        said = waiting.wait(120)
    assert p.wait(300) == 0 and said, lines
    reader.join()
    title = "preparing the model: "
    assert lines[0] == f"{title}waiting for another mtp-trt process, which exports {long.name} into the cache"
    stages = [x[len(title):] for x in lines if x.startswith(title)]
    ticked = [x[4:x.rindex(" (")] for x in lines if x.startswith("  ✓ ")]
    assert ticked == stages, lines  # each stage ticked once, in order, before the next begins
    export_stages = stages[1:]
    assert export_stages[:2] == [f"caching {long.name}: {CHECKING}",
                                 f"caching {long.name}: exporting target.onnx"], lines
    assert all(s.startswith(f"caching {long.name}: exporting ") and s.endswith(".onnx") for s in export_stages[1:-2])
    assert export_stages[-2:] == [f"caching {long.name}: hashing weights.bin", f"caching {long.name}: writing {entry}"]
    others = [x for x in lines if not x.startswith((title, "  ✓ ")) and x.strip()]
    assert len(others) == 2 and others[0].startswith("preparing the model done in ") and "new tokens" in others[1], \
        lines  # nothing else: no line is the wrapped rest of another


# --------------------------------------------------------------------------------------------- integrity
def test_integrity_errors_name_the_file_that_changed(exp, tmp_path, monkeypatch):
    """Every file an export's manifest lists (graphs, weights.bin, tokenizer files), changed or removed: the
    message names that file, never another kind ("the graph file" for weights.bin); an engine likewise."""
    from mtp_trt.errors import MtpTrtError
    from mtp_trt.manifest import Manifest, verify_export
    from mtp_trt.runner import verify_engines
    from test_robustness import _engine_dir

    monkeypatch.setenv("MTP_TRT_CACHE_DIR", str(tmp_path / "cache"))
    names = [name for name, _ in Manifest.load(exp).files]
    assert {"weights.bin", "tokenizer.json", "target.onnx"} <= set(names)
    for name in names:
        for how in ("changed", "removed"):
            d = tmp_path / f"{how}-{name}"
            shutil.copytree(exp, d)
            if how == "removed":
                (d / name).unlink()
                want = f"{d / 'manifest.json'}: lists the file '{name}', which is missing"
            else:
                data = bytearray((d / name).read_bytes())
                data[len(data) // 2] ^= 1
                (d / name).write_bytes(bytes(data))
                want = (f"{d / name}: SHA-256 differs from manifest.json; {name} was modified, truncated or comes "
                        f"from another export")
            with pytest.raises(MtpTrtError) as e:
                verify_export(Manifest.load(d) if how == "changed" else Manifest.from_raw(
                    d, json.loads((d / "manifest.json").read_text()), "manifest.json"))
            assert str(e.value) == want
    engines = _engine_dir(exp, tmp_path / "engines")
    (engines / "step_1.engine").write_bytes(b"another build's engine")
    with pytest.raises(MtpTrtError) as e:
        verify_engines(engines)
    assert str(e.value) == (f"{engines / 'step_1.engine'}: SHA-256 differs from engines.json; step_1.engine was "
                            f"modified, truncated or comes from another build")


# --------------------------------------------------------------------------------------------------- bench
def test_bench_defaults_are_quick_say_what_is_left_and_write_nothing_unasked(ckpt, tmp_path):
    """`mtp-trt bench` with no options: eagle mode at batch 1 (every nextn and tree of the export), a line per
    configuration and per round with the time left, the table on stdout, and no file written anywhere (the
    figures go to files with -o and --plot only)."""
    work = tmp_path / "work"
    work.mkdir()
    r = subprocess.run(["mtp-trt", "bench", str(ckpt)], capture_output=True, text=True, cwd=work, timeout=600,
                       env={**os.environ, "MTP_TRT_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    assert list(work.iterdir()) == []
    configs = ["eagle batch 1 nextn 0", "eagle batch 1 nextn 1", "eagle batch 1 nextn 2",
               "eagle batch 1 nextn 2 tree 2:2:4"]
    for i, name in enumerate(configs):
        assert f"[{i + 1}/{len(configs)}] {name}: " in r.stderr and " s left" in r.stderr, r.stderr
    assert "round 5 of 5 timed; about 0 s left" in r.stderr
    assert [x.split(":")[0] for x in r.stdout.splitlines() if " tokens/s, " in x] == \
        [f"eagle   batch 1 nextn {n}" for n in (0, 1, 2)] + ["eagle   batch 1 nextn 2 tree 2"]
    assert "transformers batch" not in r.stdout and "wrote" not in r.stdout and "vanilla" not in r.stdout
    assert "mtp-trt bench --full" in r.stderr


def test_bench_plot_legend_covers_no_data():
    """The plot's legend lies outside every panel (where the points are) and inside the figure."""
    from mtp_trt.bench import figure

    rows = [{"engine": "mtp-trt/onnxruntime", "mode": mode, "batch": batch, "nextn": n, "tree": tree,
             "tokens_per_second": 100.0 * (1 + n) * batch, "round_seconds": [1.0]}
            for mode in ("eagle", "vanilla") for batch in (1, 8) for n, tree in
            ((0, None), (1, None), (2, None), (3, None), (2, "2:2:4"), (3, "3:2:6"), (3, "3:3:8"))]
    rows += [{"engine": "transformers.generate", "mode": "-", "batch": b, "nextn": 0, "tokens_per_second": 50.0}
             for b in (1, 8)]
    fig = figure(rows)
    fig.canvas.draw()
    (legend,) = fig.legends
    box = legend.get_window_extent()
    assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent()), (box, ax.get_window_extent())
    assert len(legend.get_texts()) == 2 + 2 * 3 + 1  # each line once, though it is in both panels


# ------------------------------------------------------------------------------------------------- help texts
COMMANDS = ("inspect", "export", "build", "check", "run", "serve", "bench")
ROOT = Path(__file__).resolve().parents[1]

_COLUMNS = r"""
import os, sys
os.environ["COLUMNS"] = sys.argv[1]
"""


def helps(columns: int, tmp_path: Path) -> dict[str, str]:
    """`mtp-trt --help` ("") and each command's --help, rendered `columns` wide: {command: text}."""
    argvs = [["--help"]] + [[c, "--help"] for c in COMMANDS]
    results = run_cli(argvs, tmp_path / "cache", _COLUMNS, str(columns))
    assert all(code == 0 for code, _, _ in results), results
    return {name: out for name, (_, _, out) in zip(("",) + COMMANDS, results)}


def option_help(text: str, flag: str) -> str:
    """The help of one option in a command's --help, its wrapped lines joined."""
    lines = text.splitlines()
    start = next(i for i, x in enumerate(lines) if re.match(rf"\s+(-\w, )?{flag}\b", x))
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"\s+-", lines[i])), len(lines))
    return " ".join(x.strip() for x in lines[start:end])


def test_help_summaries_are_whole_and_nothing_is_split_at_a_hyphen(tmp_path):
    """`mtp-trt --help` lists each command with its whole summary (no "..."), at any width; no help wraps a flag,
    a command or a default at one of its hyphens (`no-` / `verify`); metavars are written one way; --verify says
    what README.md says."""
    from typer.main import get_command

    from mtp_trt.cli import app

    summaries = {name: cmd.short_help for name, cmd in get_command(app).commands.items()}
    assert sorted(summaries) == sorted(COMMANDS)
    readme = " ".join((ROOT / "README.md").read_text().split())
    for columns in (60, 80, 132):
        texts = helps(columns, tmp_path)
        listed: dict[str, str] = {}  # command -> its summary, the wrapped lines joined
        for line in texts[""].split("Commands:\n")[1].splitlines():
            entry = re.match(r"  (\w+)  +(.*)", line)
            if entry:
                name = entry.group(1)
            listed[name] = f"{listed.get(name, '')} {entry.group(2) if entry else line.strip()}".strip()
        assert listed == summaries, (columns, listed)
        assert all(x.endswith(".") and "..." not in x for x in listed.values()), listed
        for name, text in texts.items():
            split = [x for x in text.splitlines() if re.search(r"[A-Za-z0-9]-$", x)]
            assert not split, (columns, name, split)
            assert not re.findall(r"--[a-z-]+ [A-Z]+\b", text), (columns, name)  # `<int>`, `<text>`: not `N`, `TEXT`
        for name in ("run", "serve", "bench"):
            verify = option_help(texts[name], "--verify")
            assert "whose size, mtime, ctime or inode changed" in verify and "[default: no-verify]" in verify, verify
        assert "--batch <int>" in texts["bench"]
    assert "only files whose size, mtime, ctime or inode changed" in readme


# (command line before the flag, flag, every value the flag takes in any command)
CHOICES = [
    (["export", "-o", "OUT"], "--mtp-mode", {"eagle", "vanilla"}),
    (["export", "-o", "OUT"], "--dtype", {"fp32", "fp16", "bf16"}),
    (["export", "-o", "OUT"], "--lowering", {"onnx", "plugin"}),
    (["export", "-o", "OUT"], "--moe-form", {"auto", "tensorrt", "static", "gather", "ort", "cpu"}),
    (["export", "-o", "OUT"], "--quant", {"none", "int8", "int4", "fp8"}),
    (["export", "-o", "OUT", "--quant", "int8"], "--group-size", {"16", "32", "64", "128", "256"}),
    (["build", "DIR", "-o", "OUT"], "--precision", {"fp32", "fp16", "bf16"}),
    (["build", "DIR", "-o", "OUT"], "--flavour", {"auto", "tensorrt", "tensorrt_rtx"}),
    (["build", "DIR", "-o", "OUT"], "--plugins", {"auto", "cpp", "python"}),
    *[(argv, flag, values) for argv in (["run", "-p", "x"], ["serve"], ["bench"]) for flag, values in (
        ("--quant", {"none", "int8", "int4", "fp8"}),
        ("--group-size", {"16", "32", "64", "128", "256"}))],
    *[(argv, "--mtp-mode", {"eagle", "vanilla"}) for argv in (["run", "-p", "x"], ["serve"])],
]


def test_each_command_lists_the_values_it_takes(tmp_path):
    """Each flag that takes one of a set of values: its help in each command names exactly the values that command
    accepts, as its error for a value it refuses lists them (run's --quant: not fp8, which run refuses)."""
    texts = helps(200, tmp_path)
    argvs = []
    for argv, flag, _ in CHOICES:
        bad = "48" if flag == "--group-size" else "fp8" if flag == "--quant" and argv[0] != "export" else "nope"
        extra = ["--quant", "int4"] if flag == "--group-size" and argv[0] != "export" else []
        argvs.append([str(tmp_path / "OUT") if a == "OUT" else str(tmp_path) if a == "DIR" else a for a in argv]
                     + extra + [flag, bad])
    for (argv, flag, values), (code, err, _) in zip(CHOICES, run_cli(argvs, tmp_path / "cache")):
        last = err.strip().splitlines()[-1]
        listed = re.search(r"(?:expected|must be) one of ([\w, ]+?)(?:, got |$)", last)
        assert code == 2 and last.startswith(f"error: {flag}") and listed, (argv, flag, err)
        accepted = set(listed.group(1).split(", "))
        named = set(re.findall(r"[\w.]+", option_help(texts[argv[0]], flag))) & values
        assert accepted <= values and named == accepted, (argv[0], flag, named, accepted)
    assert not (tmp_path / "OUT").exists()


# --------------------------------------------------------------------------------- --config and --json
def spec_config_examples() -> list[tuple[str, str]]:
    """The example speculative configs of docs/speculative_config.md: [(json or yaml, text)]."""
    text = (ROOT / "docs" / "speculative_config.md").read_text()
    return re.findall(r"```(json|yaml)\n(.*?)```", text, re.S)


def test_every_example_speculative_config_runs_and_json_is_compact(exp, tmp_path):
    """Each example of docs/speculative_config.md (TensorRT-LLM's and vLLM's forms, JSON and YAML: four) runs with
    `mtp-trt run --config`, at the nextn it asks for; `--json` puts each list of token ids on one line."""
    yaml = pytest.importorskip("yaml")
    examples = spec_config_examples()
    forms = {(lang, "decoding_type" in body) for lang, body in examples}
    assert len(examples) == 4 and forms == {("json", True), ("json", False), ("yaml", True), ("yaml", False)}
    argvs, wanted = [], []
    for i, (lang, body) in enumerate(examples):
        path = tmp_path / f"spec{i}.{lang}"
        path.write_text(body)
        data = json.loads(body) if lang == "json" else yaml.safe_load(body)
        data = data.get("speculative_config", data)
        wanted.append(data.get("num_nextn_predict_layers", data.get("num_speculative_tokens")))
        argvs.append(["run", exp, "-p", "def f(x):", "--max-new-tokens", "40", "--json", "--config", path])
    longest = 0
    for argv, nextn, (code, err, out) in zip(argvs, wanted, run_cli(argvs, tmp_path / "cache")):
        assert code == 0, (argv, err)
        result = json.loads(out)
        assert result["summary"]["nextn"] == nextn and result["mtp_mode"] == "eagle", (argv, result["summary"])
        tokens = result["results"][0]["tokens"]
        longest = max(longest, len(tokens))
        assert f'"tokens": {json.dumps(tokens)},' == out.splitlines()[5].strip(), out
        assert len(out.splitlines()) < 40, out  # lists on one line each: not a line per token
    assert longest >= 30  # a long answer, in a few lines


# ------------------------------------------------------------------------------------------- bench and load
# os.getloadavg made to answer, in turn, the loads of sys.argv[1] (a JSON list of 1-minute loads, with the
# machine's usable cores added to each)
_LOADS = r"""
import json, os, sys
cores = len(os.sched_getaffinity(0))
loads = [x + cores for x in json.loads(sys.argv[1])]
os.getloadavg = lambda: (loads.pop(0), 0.0, 0.0)
"""


def test_bench_prints_the_load_average_and_warns_when_the_machine_is_busy(ckpt, tmp_path):
    """`bench` prints the 1-minute load average before and after its timing beside the figures (and writes it to
    the JSON); it warns where, before, fewer cores were idle than the threads it runs (one each), or where, after,
    the load was above the cores: a quiet machine gets no warning."""
    cores = len(os.sched_getaffinity(0))
    # (before, after) per run, less the cores: quiet (one thread each), busy before, busy during
    runs = [(-cores + 0.2, -cores + 1.0), (1.0, 2.0), (-cores + 0.1, 3.0)]
    argvs = [["bench", ckpt, "--threads", "1", "--repeats", "1", "--max-new-tokens", "4", "-o", tmp_path / f"b{i}.json"]
             for i in range(len(runs))]
    results = run_cli(argvs, tmp_path / "cache", _LOADS, json.dumps([x for run in runs for x in run]))
    for i, ((before, after), (code, err, out)) in enumerate(zip(runs, results)):
        assert code == 0, err
        line = (f"load average (1 minute): {before + cores:.2f} before, {after + cores:.2f} after the timing; "
                f"{cores} usable core{'s' if cores > 1 else ''}, 1 thread per graph")
        assert line in out.splitlines(), out
        meta = json.loads((tmp_path / f"b{i}.json").read_text())["meta"]
        assert meta["load_average"] == {"before": [round(before + cores, 2), 0.0, 0.0],
                                        "after": [round(after + cores, 2), 0.0, 0.0]}
        warnings = [x for x in err.splitlines() if x.startswith("warning: ")]
        if i == 0:
            assert not warnings, err
        else:
            assert len(warnings) == 1 and ("before the timing" if i == 1 else "during the timing") in warnings[0]
            assert "the figures are lower than on a quiet machine" in warnings[0], err
