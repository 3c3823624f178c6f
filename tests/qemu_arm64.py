"""ONNX Runtime's own aarch64 build running mtp-trt's operator tests under qemu-user, on an x86-64 Debian/Ubuntu
machine (a helper, not a test; tests/test_ort_arm64.py runs it, marked slow).

    python tests/qemu_arm64.py setup          # once: an aarch64 Python and its wheels in $MTP_TRT_QEMU_ARM64_DIR
    python tests/qemu_arm64.py run [--path P] [pytest arguments]   # P: neon-i8mm (default), neon-dotprod, neon,
                                                                    # scalar or all
`setup` needs apt-get (Debian's arm64 packages of Python 3.11, downloaded into a private apt state and unpacked,
nothing installed on the system), pip (aarch64 wheels of this machine's versions of onnxruntime, onnx, numpy and
mtp-trt's other runtime dependencies, and pytest), aarch64-linux-gnu-gcc and qemu-aarch64 (apt-get install g++-aarch64-linux-gnu qemu-user).  The folder
defaults to ~/.cache/mtp-trt/qemu-arm64.

qemu-user shows the guest the host's /proc/cpuinfo, which ONNX Runtime's CPU detection (cpuinfo) cannot parse on
ARM (it crashes on import); a small LD_PRELOAD library built here makes /proc/cpuinfo read as an ARM64 one.  Each
path runs on an emulated CPU that has it (cortex-a53: NEON; cortex-a76: SDOT; max: SMMLA; scalar:
MTP_TRT_CPU_ISA=scalar), and the library reports the path before the tests start.

Left out under qemu, with the reason: the tests that start a child Python (qemu-user cannot exec an aarch64
binary without binfmt_misc: the per-path comparisons, which this script's --path does instead) and those that
compare with PyTorch (no CPU-only aarch64 torch wheel on PyPI)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIR = Path(os.environ.get("MTP_TRT_QEMU_ARM64_DIR") or Path.home() / ".cache" / "mtp-trt" / "qemu-arm64")
PYTHON = "usr/bin/python3.11"
DEBS = ("python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libc6 libstdc++6 libgcc-s1 libexpat1 zlib1g "
        "libbz2-1.0 libcrypt1 libffi8 liblzma5 libncursesw6 libnsl2 libreadline8 libsqlite3-0 libtinfo6 libtirpc3 "
        "libuuid1 libssl3 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1 "
        "libdb5.3").split()
# at this machine's versions: the operator tests' and mtp-trt's runtime (tests/test_ort_arm64.py decodes exports)
WHEELS = ("onnxruntime", "onnx", "numpy", "tokenizers", "safetensors", "typer", "rich")
PATHS = {"neon-i8mm": ("max", {}), "neon-dotprod": ("cortex-a76", {}), "neon": ("cortex-a53", {}),
         "scalar": ("max", {"MTP_TRT_CPU_ISA": "scalar"})}
TESTS = ("tests/test_ort_ops.py", "tests/test_ort_quant_ops.py", "tests/test_ort_dsa.py")
LEFT_OUT = ("not portable_path_agrees and not every_instruction_set and not is_mla_attention_after_the_projections "
            "and not mtp_accept_matches_the_decomposed and not cpu_isa_switch_selects and not unknown_cpu_isa "
            "and not cpu_isa_the_cpu_lacks")

SHIM = r"""
// /proc/cpuinfo reads as $FAKE_CPUINFO (qemu-user shows the guest the host's).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static const char* swap(const char* p) {
    const char* fake = getenv("FAKE_CPUINFO");
    return fake && p && strcmp(p, "/proc/cpuinfo") == 0 ? fake : p;
}
#define OPEN(name)                                                        \
    int name(const char* p, int flags, ...) {                             \
        va_list ap; va_start(ap, flags); int mode = va_arg(ap, int); va_end(ap); \
        int (*real)(const char*, int, ...) = dlsym(RTLD_NEXT, #name);     \
        return real(swap(p), flags, mode);                                \
    }
OPEN(open)
OPEN(open64)
int openat(int dir, const char* p, int flags, ...) {
    va_list ap; va_start(ap, flags); int mode = va_arg(ap, int); va_end(ap);
    int (*real)(int, const char*, int, ...) = dlsym(RTLD_NEXT, "openat");
    return real(dir, swap(p), flags, mode);
}
FILE* fopen(const char* p, const char* m) { FILE* (*real)(const char*, const char*) = dlsym(RTLD_NEXT, "fopen"); return real(swap(p), m); }
FILE* fopen64(const char* p, const char* m) { FILE* (*real)(const char*, const char*) = dlsym(RTLD_NEXT, "fopen64"); return real(swap(p), m); }
"""
CPUINFO = "".join(
    f"processor\t: {i}\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid "
    "asimdrdm lrcpc dcpop asimddp\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\n"
    "CPU part\t: 0xd0c\nCPU revision\t: 1\n\n" for i in range(2))


def missing() -> str | None:
    """Why this machine cannot run the set-up or the tests (None: it can)."""
    for tool, pkg in (("qemu-aarch64", "qemu-user"), ("aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu")):
        if not shutil.which(tool):
            return f"no {tool} (apt-get install {pkg})"
    return None


def ready() -> str | None:
    """Why the aarch64 environment is not there (None: it is)."""
    why = missing()
    if why:
        return why
    for need in (PYTHON, "site", "shim.so", "cpuinfo"):
        if not (DIR / need).exists():
            return f"no aarch64 Python environment in {DIR} (python tests/qemu_arm64.py setup)"
    return None


def setup() -> None:
    why = missing()
    if why:
        sys.exit(f"error: {why}")
    DIR.mkdir(parents=True, exist_ok=True)
    apt, debs, sysroot = DIR / "apt", DIR / "debs", DIR
    for d in (apt / "lists" / "partial", apt / "cache" / "archives" / "partial", debs):
        d.mkdir(parents=True, exist_ok=True)
    (apt / "status").touch()
    opts = ["-o", "APT::Architecture=arm64", "-o", "APT::Architectures::=arm64", "-o", f"Dir::State::Lists={apt}/lists",
            "-o", f"Dir::Cache={apt}/cache", "-o", f"Dir::State::status={apt}/status"]
    subprocess.run(["apt-get", *opts, "update", "-qq"], check=True)
    subprocess.run(["apt-get", *opts, "download", "-qq", *DEBS], check=True, cwd=debs)
    for deb in sorted(debs.glob("*.deb")):
        subprocess.run(["dpkg", "-x", str(deb), str(sysroot)], check=True)
    wheels = [f"{name}=={metadata.version(name)}" for name in WHEELS] + ["pytest"]
    plats = [a for p in ("manylinux_2_28_aarch64", "manylinux2014_aarch64") for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(DIR / "site"), "--upgrade", *plats,
                    "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311", "--only-binary=:all:",
                    *wheels], check=True)
    (DIR / "shim.c").write_text(SHIM)
    subprocess.run(["aarch64-linux-gnu-gcc", "-O2", "-shared", "-fPIC", str(DIR / "shim.c"), "-o", str(DIR / "shim.so"),
                    "-ldl"], check=True)
    (DIR / "cpuinfo").write_text(CPUINFO)
    print(f"aarch64 Python environment ready in {DIR}")


def command(path: str, *args: str) -> tuple[list[str], dict]:
    """(argv, environment) running the aarch64 Python with `args` on `path`'s emulated CPU."""
    cpu, extra = PATHS[path]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTP_ORT_") and k != "MTP_TRT_CPU_ISA"} | extra
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(DIR / "site")])
    argv = ["qemu-aarch64", "-cpu", cpu, "-E", f"LD_PRELOAD={DIR / 'shim.so'}", "-E", f"FAKE_CPUINFO={DIR / 'cpuinfo'}",
            "-L", str(DIR), str(DIR / PYTHON), *args]
    return argv, env


REPORT = ("from mtp_trt.plugins import ort_lib; import ctypes; lib = ctypes.CDLL(str(ort_lib.resolve_library())); "
          "lib.MtpOrtQuantPath.restype = ctypes.c_char_p; print(ort_lib.resolve_library().name, "
          "lib.MtpOrtQuantPath().decode())")


def run(path: str, pytest_args: list[str]) -> int:
    """The operator tests on one path: 0 where they pass (the library reporting the path first)."""
    argv, env = command(path, "-c", REPORT)
    lib, got = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, cwd=ROOT).stdout.split()
    if got != path:
        print(f"error: {lib} reports {got} on {PATHS[path][0]}, not {path}", file=sys.stderr)
        return 1
    print(f"== {path} ({lib} on qemu -cpu {PATHS[path][0]})", flush=True)
    args = pytest_args or ["-q", "-p", "no:cacheprovider", *TESTS, "-k", LEFT_OUT]
    argv, env = command(path, "-m", "pytest", *args)
    return subprocess.run(argv, env=env, cwd=ROOT).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("setup", "run"))
    parser.add_argument("--path", default="neon-i8mm", choices=(*PATHS, "all"))
    args, rest = parser.parse_known_args()
    if args.action == "setup":
        setup()
        return 0
    why = ready()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    paths = list(PATHS) if args.path == "all" else [args.path]
    return max(run(p, rest) for p in paths)


if __name__ == "__main__":
    sys.exit(main())
