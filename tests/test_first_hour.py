"""What a new user meets in the first hour, and the third round of bad input: a bare install (no extras), the
commands' defaults (`bench`), paths that do not exist, progress on a log, and input checked before any work
(the weight scan, the tokenizer files, FP8 scales), each case by family.  The server's cases are in
tests/test_serve.py; the shared checkpoint and export are test_robustness's."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_robustness import Case, assert_one_error, ckpt, cli_batch, exp, expect_errors, mtp_trt  # noqa: F401


# ------------------------------------------------------------------------------------------- --truncate
def test_truncate_leaves_room_for_the_new_tokens(exp, tmp_path, monkeypatch):
    """A prompt cut by --truncate keeps as many of its last tokens as leave room for --max-new-tokens: every
    count of new tokens that fits is generated in full (finish reason length, no "KV cache full") whatever the
    drafts' acceptance, and (plain decoding, one token per step) one prompt token more than was kept would not
    have left that room."""
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
            if nextn == 0 and len(more) <= rows - 2:
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
            "onnxscript")

_BARE_DRIVER = r"""
import contextlib, io, json, sys
for name in json.loads(sys.argv[1]):
    sys.modules[name] = None  # `import name` fails and importlib.util.find_spec(name) is None: not installed
from mtp_trt.cli import entry
out = []
for argv in json.loads(sys.stdin.read()):
    sys.argv = ["mtp-trt", *argv]
    err, std = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
        try:
            code = entry()
        except SystemExit as e:
            code = e.code
        except BaseException:
            import traceback
            code, err = -1, io.StringIO(traceback.format_exc())
    out.append([code, err.getvalue(), std.getvalue()])
sys.__stdout__.write(json.dumps(out))
"""


def bare(cases: list[list], cache: Path) -> list[tuple[int, str, str]]:
    r = subprocess.run([sys.executable, "-c", _BARE_DRIVER, json.dumps(OPTIONAL)],
                       input=json.dumps([[str(a) for a in argv] for argv in cases]), capture_output=True, text=True,
                       timeout=600, env={**os.environ, "MTP_TRT_CACHE_DIR": str(cache)})
    assert r.returncode == 0, r.stderr[-3000:]
    return [tuple(x) for x in json.loads(r.stdout)]


def test_a_bare_install_runs_exports_and_refuses_the_rest_in_one_line(ckpt, exp, tmp_path):
    """Without torch, onnx, transformers, matplotlib or the serve extra: an export directory runs; `inspect`
    reads a checkpoint; every command that needs an extra (a checkpoint to export, `export`, `bench`, `--plot`,
    `--transformers`, `serve`) is one line naming the package and the extra that installs it, before any
    work."""
    cases = [
        (["run", "-p", "def f(x):"], 'needs torch, which is not installed: pip install "mtp-trt[cpu]"'),
        (["run", ckpt, "-p", "x"], 'needs torch, which is not installed: pip install "mtp-trt[cpu]"; an export'),
        (["export", "-o", tmp_path / "out"], 'mtp-trt export needs torch, which is not installed: pip install '
                                             '"mtp-trt[cpu]"'),
        (["bench"], 'needs torch, which is not installed: pip install "mtp-trt[cpu]"'),
        (["bench", ckpt, "--plot", tmp_path / "b.png"], 'bench --plot needs matplotlib, which is not installed: '
                                                        'pip install "mtp-trt[dev]"'),
        (["bench", ckpt, "--transformers"], 'bench --transformers needs torch'),
        (["serve", exp], 'mtp-trt serve needs fastapi, which is not installed: pip install "mtp-trt[serve]"'),
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
    assert r.exit_code == 2 and r.output.strip() == ('error: mtp-trt export needs onnx, which is not installed: '
                                                     'pip install "mtp-trt[cpu]"'), r.output


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


def test_the_weights_are_scanned_before_any_work(ckpt, tmp_path):
    """Each damaged tensor (_damaged_weights): `export` and `run` end in exactly one line naming the file and the
    tensor -- no progress line before it -- and write nothing, in the output or the cache."""
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
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), (argv, err)
        assert all(f in err for f in fragments), (argv, err)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out-")]
    assert not (tmp_path / "cache" / "exports").exists() or not any((tmp_path / "cache" / "exports").iterdir())
