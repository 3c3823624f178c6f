"""Wheel tags for the shared libraries the wheel carries (everything else is in pyproject.toml).

`plugins/prebuilt/*.so` (the CPU operators for ONNX Runtime for x86-64 and for aarch64, the CUDA kernels for
x86-64) are ELF libraries, each for one architecture.  A wheel is for one architecture: this machine's, or the one
MTP_TRT_WHEEL_ARCH names (x86_64 or aarch64: an aarch64 wheel packaged on x86-64).  It carries that
architecture's libraries and is tagged for them (`py3-none-manylinux_2_NN_<arch>`, NN the newest glibc symbol
version they need; they link only libc, libm, libstdc++ and libgcc_s) -- for this machine's architecture, those
that load here (not newer than this glibc).  Where none is carried (another OS, an architecture without
libraries, an older glibc), or with MTP_TRT_PURE_WHEEL=1, the wheel is pure (`py3-none-any`): the operators are
optional, and mtp-trt runs without them.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from pathlib import Path

import setuptools
from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

PREBUILT = Path("plugins") / "prebuilt"
ELF_MACHINES = {62: "x86_64", 183: "aarch64"}  # e_machine -> the wheel platform's architecture


def elf_platform(lib: Path) -> tuple[str, int] | None:
    """(architecture, newest GLIBC_2.NN minor version it needs) of a little-endian 64-bit ELF library."""
    data = lib.read_bytes()
    if data[:6] != b"\x7fELF\x02\x01":
        return None
    arch = ELF_MACHINES.get(int.from_bytes(data[18:20], "little"))
    needs = [int(m) for m in re.findall(rb"GLIBC_2\.(\d+)", data)]
    return (arch, max(needs, default=17)) if arch else None


def host_glibc_minor() -> int | None:
    name, version = platform.libc_ver()
    return int(version.split(".")[1]) if name == "glibc" and version.count(".") >= 1 else None


def wheel_arch() -> str:
    """The architecture the wheel is for: $MTP_TRT_WHEEL_ARCH, else this machine's."""
    arch = os.environ.get("MTP_TRT_WHEEL_ARCH") or platform.machine()
    if os.environ.get("MTP_TRT_WHEEL_ARCH") and arch not in ELF_MACHINES.values():
        sys.exit(f"error: MTP_TRT_WHEEL_ARCH={arch}: not one of {', '.join(ELF_MACHINES.values())}")
    return arch


def shipped_libraries() -> tuple[list[Path], str | None]:
    """(the prebuilt libraries this build carries, the wheel's platform tag; None: a pure wheel)."""
    libs = sorted(PREBUILT.glob("*.so"))
    arch = wheel_arch()
    if os.environ.get("MTP_TRT_PURE_WHEEL") == "1" or not libs:
        return [], None
    native = arch == platform.machine()
    if native and not sys.platform.startswith("linux"):
        return [], None
    plats = {lib: elf_platform(lib) for lib in libs}
    glibc = host_glibc_minor() if native else None
    if native and glibc is None:
        return [], None
    keep = [lib for lib, plat in plats.items() if plat and plat[0] == arch and (glibc is None or plat[1] <= glibc)]
    if not keep:
        return [], None
    need = max(plats[lib][1] for lib in keep)
    return keep, f"manylinux_2_{max(need, 17)}_{arch}"


LIBS, PLATFORM_TAG = shipped_libraries()


class BuildPy(build_py):
    """Package data without the prebuilt libraries this wheel does not carry (the sdist carries them all)."""

    def run(self):
        keep = {str(lib) for lib in LIBS}
        self.data_files = [(package, src, build, [f for f in files if not self._dropped(Path(src) / f, keep)])
                           for package, src, build, files in self.data_files]
        super().run()

    @staticmethod
    def _dropped(path: Path, keep: set[str]) -> bool:
        return path.suffix == ".so" and path.parent == PREBUILT and str(path) not in keep


class BdistWheel(bdist_wheel):
    """A platform wheel when it carries libraries, a pure one otherwise; either for any Python 3 (the libraries are
    loaded with ctypes or by ONNX Runtime, not imported)."""

    def get_tag(self):
        return ("py3", "none", PLATFORM_TAG) if PLATFORM_TAG else ("py3", "none", "any")


class Distribution(setuptools.Distribution):
    def has_ext_modules(self):  # a platform wheel's files install into platlib
        return PLATFORM_TAG is not None


setup(distclass=Distribution, cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel})
