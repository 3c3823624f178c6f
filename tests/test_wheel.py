"""The package as a user installs it: `python -m build` makes the sdist and, from it, the wheel; the wheel
installed (not editable) into a fresh virtual environment runs the main job from a directory outside the
source tree, on the demo checkpoint it carries as package data.

The fresh environment sees this one's site-packages through a .pth file (torch, onnxruntime and the rest are
not downloaded again), but mtp_trt itself must come from the wheel."""

from __future__ import annotations

import os
import platform
import re
import runpy
import shutil
import site
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
import setuptools

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


# the shipped libraries: their architecture and the newest GLIBC_2.NN each one needs
PREBUILT = {"libmtp_ort_ops.so": ("x86_64", 34), "libmtp_kernels.so": ("x86_64", 34),
            "libmtp_ort_ops-aarch64.so": ("aarch64", 34)}


def expected_wheel(arch: str | None = None) -> tuple[str, set[str]]:
    """(the wheel's platform tag, the libraries it carries) for `arch` (None: this machine's): setup.py carries the
    prebuilt Linux libraries of that architecture (for this machine's, those that load here) and tags the wheel
    for them."""
    name, version = platform.libc_ver()
    native = arch in (None, platform.machine())
    arch = arch or platform.machine()
    if native and not (sys.platform.startswith("linux") and name == "glibc"):
        return "any", set()
    glibc = int(version.split(".")[1]) if native else 99
    libs = {lib for lib, (a, need) in PREBUILT.items() if a == arch and need <= glibc}
    if not libs:
        return "any", set()
    return f"manylinux_2_{max(PREBUILT[lib][1] for lib in libs)}_{arch}", libs


def setup_rule(monkeypatch, **env: str) -> tuple[set[str], str | None]:
    """setup.py's choice (the libraries' names, the platform tag; None: pure) under `env`, without building."""
    monkeypatch.chdir(ROOT)
    for var in ("MTP_TRT_WHEEL_ARCH", "MTP_TRT_PURE_WHEEL"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: None)
    ns = runpy.run_path(str(ROOT / "setup.py"))
    return {Path(lib).name for lib in ns["LIBS"]}, ns["PLATFORM_TAG"]


def test_prebuilt_libraries_are_the_architectures_listed():
    """Every shipped library is an ELF library of the architecture PREBUILT says, needing that glibc (read from
    the files, as setup.py does, by an independent reading of the ELF header)."""
    machines = {62: "x86_64", 183: "aarch64"}
    found = {}
    for lib in sorted((ROOT / "plugins" / "prebuilt").glob("*.so")):
        data = lib.read_bytes()
        assert data[:6] == b"\x7fELF\x02\x01", lib.name  # 64-bit little-endian
        found[lib.name] = (machines[int.from_bytes(data[18:20], "little")],
                           max(int(v) for v in re.findall(rb"GLIBC_2\.(\d+)", data)))
    assert found == PREBUILT


@pytest.mark.skipif(not (ROOT / ".git").exists() or shutil.which("git") is None, reason="not a git checkout")
def test_prebuilt_libraries_are_not_ignored_by_git():
    """A clone has every shipped library (.gitignore leaves out *.so but these)."""
    libs = [f"plugins/prebuilt/{lib}" for lib in PREBUILT]
    run = subprocess.run(["git", "check-ignore", "--no-index", *libs], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 1 and not run.stdout, f"ignored by git: {run.stdout}"


@pytest.mark.parametrize("arch", ["x86_64", "aarch64", None], ids=["x86_64", "aarch64", "native"])
def test_wheel_platform_rule(monkeypatch, arch):
    libs, tag = setup_rule(monkeypatch, **({"MTP_TRT_WHEEL_ARCH": arch} if arch else {}))
    want_tag, want_libs = expected_wheel(arch)
    assert (libs, tag or "any") == (want_libs, want_tag)


def test_aarch64_wheel_is_manylinux_2_34_with_the_arm_library(monkeypatch):
    assert setup_rule(monkeypatch, MTP_TRT_WHEEL_ARCH="aarch64") == ({"libmtp_ort_ops-aarch64.so"},
                                                                      "manylinux_2_34_aarch64")
    assert setup_rule(monkeypatch, MTP_TRT_WHEEL_ARCH="aarch64", MTP_TRT_PURE_WHEEL="1") == (set(), None)


def test_unknown_wheel_arch_is_one_clear_error(monkeypatch):
    with pytest.raises(SystemExit, match="MTP_TRT_WHEEL_ARCH=riscv64: not one of x86_64, aarch64"):
        setup_rule(monkeypatch, MTP_TRT_WHEEL_ARCH="riscv64")


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
        assert {Path(n).name for n in sdist.getnames() if n.endswith(".so")} == set(PREBUILT)

    # The pure fallback: without the libraries, tagged for any platform.
    pure = tmp_path / "pure"
    build(src, pure, "--wheel", env=clean_env(MTP_TRT_PURE_WHEEL="1"))
    (pure_wheel,) = pure.glob("*.whl")
    assert pure_wheel.name.endswith("-py3-none-any.whl")
    assert not any(n.endswith(".so") for n in zipfile.ZipFile(pure_wheel).namelist())

    # The aarch64 wheel, packaged here: the ARM library only, tagged for it.
    arm = tmp_path / "arm"
    build(src, arm, "--wheel", env=clean_env(MTP_TRT_WHEEL_ARCH="aarch64"))
    (arm_wheel,) = arm.glob("*.whl")
    tag, libs = expected_wheel("aarch64")
    assert arm_wheel.name.endswith(f"-py3-none-{tag}.whl") and tag == "manylinux_2_34_aarch64", arm_wheel.name
    assert {n for n in zipfile.ZipFile(arm_wheel).namelist() if n.endswith(".so")} == \
        {f"mtp_trt/plugins/prebuilt/{lib}" for lib in libs}

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
