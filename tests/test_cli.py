"""The CLI: importable and usable without torch or TensorRT; bad input is one clear line, exit status 2."""

import subprocess
import sys

BLOCK_HEAVY = (
    "import sys\n"
    "for m in ('torch', 'tensorrt', 'tensorrt_rtx', 'onnxruntime', 'transformers'):\n"
    "    sys.modules[m] = None  # any import of them now raises ImportError\n"
)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_HEAVY + code], capture_output=True, text=True)


def test_help_without_torch():
    r = _run("from mtp_trt.cli import app\nsys.argv = ['mtp-trt', '--help']\napp()")
    assert r.returncode == 0, r.stderr
    assert "inspect" in r.stdout and "Usage" in r.stdout


def test_package_imports_without_torch():
    r = _run("import mtp_trt, mtp_trt.config, mtp_trt.cli, mtp_trt.errors\nprint('ok')")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_inspect_without_torch(tmp_path):
    import json

    from hf_models import BASE

    (tmp_path / "config.json").write_text(json.dumps({**BASE, "num_nextn_predict_layers": 2}))
    r = _run(f"from mtp_trt.cli import app\nsys.argv = ['mtp-trt', 'inspect', {str(tmp_path)!r}]\napp()")
    assert r.returncode == 0, r.stderr
    assert "MTP modules   2" in r.stdout and "40 values per token" in r.stdout


def test_bad_input_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 10, "scoring_func": "relu"}')
    r = subprocess.run(["mtp-trt", "inspect", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
    assert str(tmp_path / "config.json") in r.stderr


def test_bad_command_line_syntax_is_one_line():
    """Unknown options, commands and values of the wrong type: one `error:` line naming the command, exit 2 (not
    click's usage box); the help and the version still print as before."""
    for args, fragment in ((["run", "--foo"], "error: mtp-trt run: No such option: --foo"),
                           (["run", "-p", "x", "--seed", "abc"], "error: mtp-trt run: Invalid value for '--seed'"),
                           (["nosuchcmd"], "error: mtp-trt: No such command 'nosuchcmd'")):
        r = subprocess.run(["mtp-trt", *args], capture_output=True, text=True)
        assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
        assert fragment in r.stderr and "--help" in r.stderr and not r.stdout
    r = subprocess.run(["mtp-trt"], capture_output=True, text=True)
    assert r.returncode == 2 and "Usage: mtp-trt" in r.stdout
    r = subprocess.run(["mtp-trt", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("mtp-trt ")
