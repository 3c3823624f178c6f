"""The package as a user installs it: `python -m build` makes the sdist and, from it, the wheel; the wheel
installed (not editable) into a fresh virtual environment runs the main job from a directory outside the
source tree, on the demo checkpoint it carries as package data.

The fresh environment sees this one's site-packages through a .pth file (torch, onnxruntime and the rest are
not downloaded again), but mtp_trt itself must come from the wheel."""

from __future__ import annotations

import os
import platform
import shutil
import site
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IGNORE = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "out", ".venv", ".whl",
                                ".pytest_cache", ".hypothesis", "bench.json", "bench.png")
DEMO_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")


def build(src: Path, out: Path, *flags: str, env: dict | None = None) -> None:
    run = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), *flags, str(src)],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # every folder of package data is a listed package (pyproject.toml): setuptools has nothing to warn about
    said = run.stdout + run.stderr
    assert "would be ignored" not in said and "absent from the `packages`" not in said, said[-3000:]


PREBUILT_GLIBC = {"libmtp_ort_ops.so": 27, "libmtp_kernels.so": 34}  # the newest GLIBC_2.NN each one needs


def expected_wheel() -> tuple[str, set[str]]:
    """(the wheel's platform tag here, the libraries it carries): setup.py carries the prebuilt x86-64 Linux
    libraries that load here and tags the wheel for them."""
    name, version = platform.libc_ver()
    if not (sys.platform.startswith("linux") and platform.machine() == "x86_64" and name == "glibc"):
        return "any", set()
    libs = {lib for lib, need in PREBUILT_GLIBC.items() if need <= int(version.split(".")[1])}
    if not libs:
        return "any", set()
    return f"manylinux_2_{max(PREBUILT_GLIBC[lib] for lib in libs)}_x86_64", libs


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MTP_TRT_DEMO_MODEL", "VIRTUAL_ENV")}
    return env | extra


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_source_tree(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=IGNORE)
    dist = tmp_path / "dist"
    build(src, dist)  # sdist, then the wheel from the sdist: the sdist holds all the wheel needs
    sdists, wheels = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(p.name for p in dist.iterdir())
    wheel = wheels[0]
    tag, libs = expected_wheel()
    assert wheel.name.endswith(f"-py3-none-{tag}.whl"), wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"mtp_trt/demo_model/{f}" for f in DEMO_FILES} <= names
    assert not any("train_log" in n or "eval.json" in n for n in names)
    assert {n for n in names if n.endswith(".so")} == {f"mtp_trt/plugins/prebuilt/{lib}" for lib in libs}
    with tarfile.open(sdists[0]) as sdist:  # the sdist carries every library, whatever the wheel built here does
        assert {Path(n).name for n in sdist.getnames() if n.endswith(".so")} == set(PREBUILT_GLIBC)

    # The pure fallback: without the libraries, tagged for any platform.
    pure = tmp_path / "pure"
    build(src, pure, "--wheel", env=clean_env(MTP_TRT_PURE_WHEEL="1"))
    (pure_wheel,) = pure.glob("*.whl")
    assert pure_wheel.name.endswith("-py3-none-any.whl")
    assert not any(n.endswith(".so") for n in zipfile.ZipFile(pure_wheel).namelist())

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    parents = dict.fromkeys(site.getsitepackages() + [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(purelib) / "parent-site-packages.pth").write_text("\n".join(parents) + "\n")
    pip = subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
                          "--disable-pip-version-check", str(wheel)], capture_output=True, text=True, env=clean_env())
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = clean_env(MTP_TRT_CACHE_DIR=str(tmp_path / "cache"))
    where = subprocess.run([python, "-c", "import mtp_trt, mtp_trt.runner as r; print(mtp_trt.__file__); "
                            "print(r.demo_model())"], capture_output=True, text=True, cwd=work, env=env, check=True)
    package, demo = where.stdout.split("\n")[:2]
    assert Path(package).is_relative_to(venv) and Path(demo).is_relative_to(venv), where.stdout

    run = subprocess.run([venv / "bin" / "mtp-trt", "run", "-p", "def f(x):", "--max-new-tokens", "8"],
                         capture_output=True, text=True, cwd=work, env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.startswith("def f(x):") and run.stdout.strip() != "def f(x):", run.stdout
    assert "8 new tokens" in run.stderr, run.stderr[-3000:]
    assert list((tmp_path / "cache" / "exports").iterdir()), "the export went somewhere else than the cache dir"
    assert not list(work.iterdir())
