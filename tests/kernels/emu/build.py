"""Build the CUDA kernels as a host shared library for the CPU emulation (tests only).

The .cu sources are copied with two mechanical rewrites -- `K<<<cfg>>>(args)` becomes
`emu::launcher(K, cfg)(args)` and the `extern __shared__` dynamic buffer becomes a pointer to the
emulated block's shared memory -- and compiled by g++ with cuda_emu.h force-included and
MTP_EMULATE_DEVICE pointing common.cuh at emu_device.h.  The result exports the same C functions
as the real library, so mtp_trt.plugins.cuda_lib.KernelLib loads it unchanged; "device pointers"
are host addresses.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

from mtp_trt.plugins import cuda_lib

EMU_DIR = Path(__file__).resolve().parent
_LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^;(){}<>]*>)?)\s*<<<(.*?)>>>\s*\(", re.S)
_DYN_SMEM = re.compile(r"extern\s+__shared__\s+__align__\(\d+\)\s+unsigned\s+char\s+(\w+)\[\];")


cuda_include_dir = cuda_lib.cuda_include_dir


def unavailable_reason() -> str | None:
    if shutil.which("g++") is None:
        return "g++ not found"
    if cuda_include_dir() is None:
        return "CUDA headers (cuda_runtime.h, cuda_fp16.h) not found"
    return None


def rewrite(src: str) -> str:
    out, n = _LAUNCH.subn(lambda m: f"emu::launcher({m.group(1)}, {m.group(2)})(", src)
    out = _DYN_SMEM.sub(r"unsigned char* \1 = emu::dyn_smem();", out)
    return out


def build_emulated_library(out_dir: str | os.PathLike, sources=None, name: str = "libmtp_emu") -> Path:
    """Compile (cached by content hash inside out_dir) and return the .so path: the library's sources, or `sources`
    (paths of other .cu files that include the kernels' headers, e.g. a test probe)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    inc = cuda_include_dir()
    h = hashlib.sha256()
    paths = [cuda_lib.KERNEL_DIR / n for n in cuda_lib.SOURCES] if sources is None else [Path(p) for p in sources]
    for p in sorted(cuda_lib.KERNEL_DIR.iterdir()) + sorted(EMU_DIR.glob("*.[ch]*")) + paths:
        if p.is_file():
            h.update(p.name.encode() + p.read_bytes())
    lib = out_dir / f"{name}-{h.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    srcs = []
    for path in paths:
        dst = out_dir / f"{name}-{path.stem}_emu.cpp"
        dst.write_text(rewrite(path.read_text()))
        srcs.append(str(dst))
    srcs.append(str(EMU_DIR / "emu_runtime.cpp"))
    tmp = lib.with_suffix(".tmp.so")
    cmd = ["g++", "-std=c++20", "-O1", "-g", "-fPIC", "-shared", "-pthread", "-w",
           "-include", str(EMU_DIR / "cuda_emu.h"), '-DMTP_EMULATE_DEVICE="emu_device.h"',
           "-I", str(EMU_DIR), "-I", str(cuda_lib.KERNEL_DIR), "-I", str(inc), *srcs, "-o", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"emulation build failed:\n{' '.join(cmd)}\n{proc.stderr[-6000:]}")
    os.replace(tmp, lib)
    return lib
