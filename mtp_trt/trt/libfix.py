"""Makes TensorRT for RTX's ONNX parser find `libtensorrt_rtx.so` (the wheels ship only `.so.1`).

TensorRT for RTX 1.7's ONNX parser `dlopen`s the unversioned name `libtensorrt_rtx.so` when it
imports a custom node as a plugin; the `tensorrt-rtx-cu13-libs` wheel installs only
`libtensorrt_rtx.so.1`, so the parser fails (and the process aborts) at the first plugin node.
`LD_LIBRARY_PATH` is read once at process start, so changing it here would not help.  Fixes, in
order (`MTP_TRT_RTX_LIBFIX=shim|symlink|off` forces one):

1. `shim`: write a tiny ELF shared object whose SONAME is `libtensorrt_rtx.so` and whose only
   dependency is the real library (by absolute path) into a user cache folder and load it.  The
   dynamic loader answers a later `dlopen("libtensorrt_rtx.so")` with the loaded object of that
   SONAME, and symbol look-ups through that handle reach the real library (its dependency).
   Nothing in the installation changes and nothing is compiled.
2. `symlink`: create `libtensorrt_rtx.so -> libtensorrt_rtx.so.1` beside the library (the parser's
   RPATH is `$ORIGIN`), when that folder is writable.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import struct
from pathlib import Path

from mtp_trt.errors import MtpTrtError
from mtp_trt.fsutil import cache_dir, write_atomic

UNVERSIONED = "libtensorrt_rtx.so"
_done: dict[str, str] = {}  # library folder -> how it was fixed


def elf_shim(soname: str, needed: str, machine: int) -> bytes:
    """A minimal ELF64 little-endian shared object: SONAME `soname`, DT_NEEDED `needed`, no symbols.

    One read-write PT_LOAD segment (the loader of older glibc writes into the dynamic section),
    PT_DYNAMIC, and PT_GNU_STACK (non-executable stack; without it glibc would try to make the
    stack executable).  `machine` is e_machine of the library it stands for."""
    needed_b, soname_b = needed.encode(), soname.encode()
    strtab = b"\0" + needed_b + b"\0" + soname_b + b"\0"
    ehsize, phentsize, phnum = 64, 56, 3
    hash_off = ehsize + phentsize * phnum
    hash_tab = struct.pack("<4I", 1, 1, 0, 0)  # SysV hash: one bucket, one chain, the null symbol
    sym_off = hash_off + len(hash_tab)
    str_off = sym_off + 24  # one null Elf64_Sym
    dyn_off = (str_off + len(strtab) + 7) & ~7
    dt_needed, dt_hash, dt_strtab, dt_symtab, dt_strsz, dt_syment, dt_soname = 1, 4, 5, 6, 10, 11, 14
    dynamic = b"".join(struct.pack("<qQ", tag, val) for tag, val in (
        (dt_needed, 1), (dt_soname, 2 + len(needed_b)), (dt_hash, hash_off), (dt_strtab, str_off),
        (dt_symtab, sym_off), (dt_strsz, len(strtab)), (dt_syment, 24), (0, 0)))
    size = dyn_off + len(dynamic)
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)  # ELFCLASS64, little-endian, version 1
    ehdr = ident + struct.pack("<HHIQQQIHHHHHH", 3, machine, 1, 0, ehsize, 0, 0, ehsize, phentsize, phnum,
                               64, 0, 0)  # ET_DYN, no entry, no section headers
    pf_rw = 4 | 2
    phdrs = (struct.pack("<IIQQQQQQ", 1, pf_rw, 0, 0, 0, size, size, 0x1000)  # PT_LOAD: the whole file
             + struct.pack("<IIQQQQQQ", 2, pf_rw, dyn_off, dyn_off, dyn_off, len(dynamic), len(dynamic), 8)
             + struct.pack("<IIQQQQQQ", 0x6474E551, pf_rw, 0, 0, 0, 0, 0, 16))  # PT_GNU_STACK
    out = ehdr + phdrs + hash_tab + bytes(24) + strtab
    return out + bytes(dyn_off - len(out)) + dynamic


def _load_shim(real: Path) -> str:
    with open(real, "rb") as f:
        head = f.read(20)
    if len(head) < 20 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        raise OSError(f"{real}: not a 64-bit little-endian ELF file")
    machine = struct.unpack_from("<H", head, 18)[0]
    data = elf_shim(UNVERSIONED, str(real), machine)
    path = cache_dir("trt") / f"libtensorrt_rtx-shim-{hashlib.sha256(data).hexdigest()[:16]}.so"
    if not path.is_file() or path.read_bytes() != data:
        write_atomic(path, data)
    ctypes.CDLL(str(path))  # kept loaded for the life of the process
    return f"shim {path}"


def _symlink(libdir: Path) -> str:
    link = libdir / UNVERSIONED
    tmp = libdir / f".{UNVERSIONED}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(f"{UNVERSIONED}.1", tmp)
    os.replace(tmp, link)
    return f"symlink {link}"


def ensure_unversioned_rtx_library(libdir: str | Path) -> str:
    """Make `dlopen("libtensorrt_rtx.so")` from the RTX ONNX parser succeed in this process.

    libdir: the folder of `libtensorrt_rtx.so.1` (the `tensorrt_rtx_libs` package).  Returns what
    was done ("present", "shim PATH" or "symlink PATH"); raises MtpTrtError if nothing worked."""
    libdir = Path(libdir)
    if str(libdir) in _done:
        return _done[str(libdir)]
    real = libdir / f"{UNVERSIONED}.1"
    mode = os.environ.get("MTP_TRT_RTX_LIBFIX", "auto").lower()
    if mode == "off" or (libdir / UNVERSIONED).exists() or not real.is_file():
        _done[str(libdir)] = "present" if (libdir / UNVERSIONED).exists() else "not needed"
        return _done[str(libdir)]
    steps = {"auto": (_load_shim, _symlink), "shim": (_load_shim,), "symlink": (_symlink,)}.get(mode)
    if steps is None:
        raise MtpTrtError(f"MTP_TRT_RTX_LIBFIX={mode!r}: expected auto, shim, symlink or off")
    problems = []
    for step in steps:
        try:
            _done[str(libdir)] = step(real if step is _load_shim else libdir)
            return _done[str(libdir)]
        except OSError as e:
            problems.append(f"{step.__name__.strip('_')}: {e}")
    raise MtpTrtError(f"TensorRT for RTX's ONNX parser needs {libdir / UNVERSIONED}, which the wheel does not "
                      f"ship, and it could not be provided ({'; '.join(problems)}); create it with "
                      f"`ln -s {UNVERSIONED}.1 {libdir / UNVERSIONED}`")
