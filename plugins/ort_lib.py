"""mtp-trt's CPU operators for ONNX Runtime (plugins/ort: the `mtp_trt.cpu` custom-op domain): finding, building
and registering the library.

The package ships a prebuilt library for x86-64 Linux (``prebuilt/libmtp_ort_ops.so``, with a record of the
sources it was built from), so a user needs no compiler and no ONNX Runtime headers.  Rebuilding needs a C++17
compiler and ONNX Runtime's C API headers (``onnxruntime_c_api.h``; its wheel ships none): point
``ONNXRUNTIME_INCLUDE_DIR`` at them and run ``python -m mtp_trt.plugins.ort_lib --ship``.
``MTP_TRT_ORT_OPS_LIB`` names another library to use instead.

The kernels run on the best instruction set the CPU has (kernels.h); ``MTP_TRT_CPU_ISA`` (one of CPU_ISAS) makes
every kernel of the process use one set, to compare sets on one machine.  A value that is not a set, or one this
CPU lacks, is refused by register() (one MtpTrtError line naming the variable and the value).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from mtp_trt.errors import MtpTrtError
from mtp_trt.fsutil import cache_dir

DOMAIN = "mtp_trt.cpu"
SOURCE_DIR = Path(__file__).resolve().parent / "ort"
SOURCES = ("kernels.h", "qkernels_impl.h", "kernels.cpp", "mtp_ort_ops.cpp")
PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"
PREBUILT_LIB, PREBUILT_INFO = PREBUILT_DIR / "libmtp_ort_ops.so", PREBUILT_DIR / "libmtp_ort_ops.json"
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden")
CPU_ISA_ENV = "MTP_TRT_CPU_ISA"
CPU_ISAS = ("scalar", "avx2", "avx-vnni", "avx512-vnni")  # its values: the library's (kernels.h kCpuIsaNames)


def source_hash() -> str:
    """Digest of the sources and the compiler flags (what the shipped record must match)."""
    h = hashlib.sha256(" ".join(FLAGS).encode())
    for name in SOURCES:
        h.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes())
    return h.hexdigest()[:20]


def prebuilt_info() -> dict | None:
    if not (PREBUILT_LIB.is_file() and PREBUILT_INFO.is_file()):
        return None
    return json.loads(PREBUILT_INFO.read_text())


def prebuilt_current() -> tuple[bool, str]:
    """(whether the shipped library was built from these sources and runs here, why not)."""
    info = prebuilt_info()
    if info is None:
        return False, f"{PREBUILT_LIB} is not shipped"
    if info["source_hash"] != source_hash():
        return False, (f"{PREBUILT_LIB} was built from other sources (digest {info['source_hash']}, now "
                       f"{source_hash()}); rebuild it: ONNXRUNTIME_INCLUDE_DIR=... python -m mtp_trt.plugins.ort_lib --ship")
    if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        return False, f"{PREBUILT_LIB} is built for x86-64 Linux, not {platform.system()} {platform.machine()}"
    return True, ""


def find_headers() -> Path | None:
    """ONNX Runtime's C API headers: $ONNXRUNTIME_INCLUDE_DIR (the folder holding onnxruntime_c_api.h)."""
    env = os.environ.get("ONNXRUNTIME_INCLUDE_DIR")
    if env and (Path(env) / "onnxruntime_c_api.h").is_file():
        return Path(env)
    return None


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def build_library(path: Path, include_dir: Path | None = None) -> Path:
    """Compile the library to `path` (an MtpTrtError naming what is missing: headers or a compiler)."""
    include_dir = include_dir or find_headers()
    if include_dir is None:
        raise MtpTrtError("building the mtp_trt.cpu operators needs ONNX Runtime's C API headers: set "
                          "ONNXRUNTIME_INCLUDE_DIR to the folder holding onnxruntime_c_api.h")
    cxx = compiler()
    if cxx is None:
        raise MtpTrtError("building the mtp_trt.cpu operators needs a C++17 compiler (g++ or clang++; or set CXX)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        cmd = [cxx, *FLAGS, f"-I{include_dir}", *(str(SOURCE_DIR / s) for s in SOURCES if s.endswith(".cpp")),
               "-o", str(out)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            raise MtpTrtError(f"compiling the mtp_trt.cpu operators failed:\n{' '.join(cmd)}\n{run.stderr[-4000:]}")
        os.replace(out, path)
    return path


def ship(include_dir: Path | None = None) -> Path:
    """Rebuild the shipped library and its record."""
    build_library(PREBUILT_LIB, include_dir)
    version = subprocess.run([compiler(), "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    info = {"source_hash": source_hash(), "compiler": version,
            "target": "x86-64 Linux (AVX2/FMA, AVX-VNNI, AVX512-VNNI at run time)",
            "note": "needs ONNX Runtime >= 1.18 (C API version 18)"}
    PREBUILT_INFO.write_text(json.dumps(info, indent=2) + "\n")
    return PREBUILT_LIB


def resolve_library() -> Path:
    """The library to register: $MTP_TRT_ORT_OPS_LIB; else the shipped one when it is current and runs here; else
    one built into the cache from these sources.  One MtpTrtError saying why where none can be had."""
    env = os.environ.get("MTP_TRT_ORT_OPS_LIB")
    if env:
        if not Path(env).is_file():
            raise MtpTrtError(f"MTP_TRT_ORT_OPS_LIB={env}: no such file")
        return Path(env)
    ok, why = prebuilt_current()
    if ok:
        return PREBUILT_LIB
    cached = cache_dir("ort-ops", f"libmtp_ort_ops-{source_hash()}.so")
    if cached.is_file():
        return cached
    try:
        return build_library(cached)
    except MtpTrtError as e:
        raise MtpTrtError(f"the mtp_trt.cpu operators are not available: {why}; and {e}") from None


@functools.cache
def _resolved() -> tuple[Path | None, str]:
    """resolve_library() once per process: (the library, or None and why not)."""
    try:
        return resolve_library(), ""
    except MtpTrtError as e:
        return None, str(e)


def available() -> tuple[bool, str]:
    """(whether the operators can be registered here, why not)."""
    path, why = _resolved()
    return path is not None, why


def cpu_isa(path: Path | None = None) -> tuple[str, str]:
    """(the instruction set the library's kernels run on in this process, why MTP_TRT_CPU_ISA cannot be had: ""
    where it can) -- from the library (`path`, else the one register() uses).  The library reads the variable
    once per process, the first time a kernel or this asks."""
    import ctypes

    lib = ctypes.CDLL(str(path or resolve_library()))
    if not hasattr(lib, "MtpOrtCpuIsaError"):  # (a library built before the switch: it ignores the variable)
        set_ = os.environ.get(CPU_ISA_ENV)
        return "", (f"{CPU_ISA_ENV}={set_}: {path} does not read it (built from older sources)" if set_ else "")
    lib.MtpOrtCpuIsa.restype = lib.MtpOrtCpuIsaError.restype = ctypes.c_char_p
    return lib.MtpOrtCpuIsa().decode(), lib.MtpOrtCpuIsaError().decode()


def register(session_options) -> None:
    """Register the operators with an onnxruntime.SessionOptions (an MtpTrtError where none is available, or
    where MTP_TRT_CPU_ISA names an instruction set the kernels or this CPU do not have)."""
    path, why = _resolved()
    if path is None:
        raise MtpTrtError(why)
    refused = cpu_isa(path)[1]
    if refused:
        raise MtpTrtError(refused)
    session_options.register_custom_ops_library(str(path))


# The session config entry that limits which weights the quantized operators pack (bytes; "0": none): at most
# the process's limit (MTP_ORT_PACK_MAX_BYTES, default 16 MiB per weight).  Read by ONNX Runtime >= 1.24.
PACK_MAX_BYTES_KEY = "mtp_trt.cpu.pack_max_bytes"


def float_dequantized_matmuls(options) -> None:
    """Have ONNX Runtime compute DequantizeLinear + MatMul (the quantized graphs for TensorRT) as written, in float:
    by default it fuses the pair into a MatMulNBits that rounds the activations to int8, which TensorRT's
    weight-only kernels do not."""
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")


def session(model, options=None):
    """An ONNX Runtime CPU session of a graph (a path, or the serialized model as bytes), with the operators
    registered where they are available (a graph that uses them and cannot have them fails in ONNX Runtime,
    naming the op)."""
    import onnxruntime as ort

    options = options or ort.SessionOptions()
    float_dequantized_matmuls(options)
    if available()[0]:
        register(options)
    return ort.InferenceSession(model if isinstance(model, bytes) else str(model), options,
                                providers=["CPUExecutionProvider"])


if __name__ == "__main__":  # python -m mtp_trt.plugins.ort_lib --ship
    import sys

    if sys.argv[1:] != ["--ship"]:
        sys.exit("usage: ONNXRUNTIME_INCLUDE_DIR=... python -m mtp_trt.plugins.ort_lib --ship   (rebuild the "
                 "shipped library)")
    print(ship())
