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


def test_inspect_defaults_to_the_demo_model():
    r = _run("from mtp_trt.cli import app\nsys.argv = ['mtp-trt', 'inspect']\napp()")
    assert r.returncode == 0, r.stderr
    assert "MTP modules" in r.stdout and "96 values per token" in r.stdout


def test_missing_demo_model_is_one_line(tmp_path):
    import os

    env = {**os.environ, "MTP_TRT_DEMO_MODEL": str(tmp_path / "nowhere")}
    r = subprocess.run(["mtp-trt", "inspect"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "nowhere: the bundled demo checkpoint is missing" in r.stderr


def test_one_cache_directory(monkeypatch, tmp_path):
    """$MTP_TRT_CACHE_DIR, else $XDG_CACHE_HOME/mtp-trt, else ~/.cache/mtp-trt; whatever computes a cache path
    asks mtp_trt.fsutil.cache_dir."""
    from pathlib import Path

    from mtp_trt.fsutil import cache_dir
    from mtp_trt.plugins import ort_lib

    monkeypatch.delenv("MTP_TRT_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir("exports") == tmp_path / "home" / ".cache" / "mtp-trt" / "exports"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "mtp-trt"
    monkeypatch.setenv("MTP_TRT_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir("locks", "x.lock") == tmp_path / "mine" / "locks" / "x.lock"

    # The CPU operators built from the sources (no prebuilt library) land in the same directory.
    monkeypatch.setattr(ort_lib, "prebuilt_current", lambda: (False, "test"))
    monkeypatch.setattr(ort_lib, "build_library", lambda path, include_dir=None: path)
    assert ort_lib.resolve_library().parent == tmp_path / "mine" / "ort-ops"

    root = Path(__file__).resolve().parents[1]
    computed = [str(p.relative_to(root)) for d in ("mtp_trt", "exporters", "plugins", "benchmarks", "samples")
                for p in (root / d).rglob("*.py") if "XDG_CACHE_HOME" in p.read_text() or '".cache"' in p.read_text()]
    assert computed == ["mtp_trt/fsutil.py"], computed


def test_ci_runs_the_readme_commands():
    """.ci/run installs and tests exactly as the README's set-up says."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    block = readme.split("## Set-up", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line.strip()]
    ci = [line for line in (root / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#") and not line.startswith(("set ", "cd ", "export "))]
    assert commands == ci and len(commands) == 2
