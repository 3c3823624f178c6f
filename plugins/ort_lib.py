"""mtp-trt's CPU operators for ONNX Runtime (plugins/ort: the `mtp_trt.cpu` custom-op domain): finding, building
and registering the library.

The package ships prebuilt libraries for x86-64 Linux (``prebuilt/libmtp_ort_ops.so``) and ARM64 Linux
(``prebuilt/libmtp_ort_ops-aarch64.so``), each with a record of the sources it was built from, so a user needs no
compiler and no ONNX Runtime headers; the one for the running machine is used.  Rebuilding needs a C++17 compiler
and ONNX Runtime's C API headers (``onnxruntime_c_api.h``; its wheel ships none): point ``ONNXRUNTIME_INCLUDE_DIR``
at them and run ``python -m mtp_trt.plugins.ort_lib --ship`` (this machine's library), or ``--ship --arch
aarch64`` on x86-64 (cross-compiled by ``aarch64-linux-gnu-g++``, or ``$MTP_TRT_AARCH64_CXX``).
``MTP_TRT_ORT_OPS_LIB`` names another library to use instead.

The kernels run on the best instruction set the CPU has (kernels.h); ``MTP_TRT_CPU_ISA`` (one of CPU_ISAS:
``scalar`` anywhere; x86-64 ``avx2``, ``avx-vnni``, ``avx512-vnni``; ARM64 ``neon``, ``neon-dotprod``,
``neon-i8mm``) makes every kernel of the process use one set, to compare sets on one machine.  A value that is not
a set, or one this CPU lacks (another architecture's included), is refused by register() (one MtpTrtError line
naming the variable and the value).
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
SOURCES = ("kernels.h", "qkernels_impl.h", "kernels_neon.h", "qkernels_neon.h", "kernels.cpp", "mtp_ort_ops.cpp")
PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden")
CPU_ISA_ENV = "MTP_TRT_CPU_ISA"
# its values: the library's (kernels.h kCpuIsaNames): scalar (any CPU), then x86-64's sets, then ARM64's
CPU_ISAS = ("scalar", "avx2", "avx-vnni", "avx512-vnni", "neon", "neon-dotprod", "neon-i8mm")

# The shipped libraries, by architecture (platform.machine()'s names for it, normalized): each a .so and its record.
ARCHS = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}
PREBUILT_STEMS = {"x86_64": "libmtp_ort_ops", "aarch64": "libmtp_ort_ops-aarch64"}
TARGETS = {"x86_64": "x86-64 Linux (AVX2/FMA, AVX-VNNI, AVX512-VNNI at run time)",
           "aarch64": "ARM64 Linux (NEON; SDOT, SMMLA at run time)"}
CROSS_COMPILERS = {"aarch64": ("MTP_TRT_AARCH64_CXX", "aarch64-linux-gnu-g++")}  # (variable, default) off that arch


def host_arch() -> str | None:
    """This machine's architecture as PREBUILT_STEMS names it (None: one no library is shipped for)."""
    return ARCHS.get(platform.machine().lower())


def prebuilt_paths(arch: str) -> tuple[Path, Path]:
    """(the shipped library, its record) for an architecture."""
    stem = PREBUILT_DIR / PREBUILT_STEMS[arch]
    return stem.with_suffix(".so"), stem.with_suffix(".json")


PREBUILT_LIB, PREBUILT_INFO = prebuilt_paths(host_arch() or "x86_64")  # this machine's


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
    if platform.system() != "Linux" or host_arch() is None:
        return False, (f"no library is shipped for {platform.system()} {platform.machine()} (only for Linux on "
                       f"{' and '.join(PREBUILT_STEMS)})")
    return True, ""


def find_headers() -> Path | None:
    """ONNX Runtime's C API headers: $ONNXRUNTIME_INCLUDE_DIR (the folder holding onnxruntime_c_api.h)."""
    env = os.environ.get("ONNXRUNTIME_INCLUDE_DIR")
    if env and (Path(env) / "onnxruntime_c_api.h").is_file():
        return Path(env)
    return None


def compiler(arch: str | None = None) -> str | None:
    """The C++ compiler for `arch` (None: this machine): $CXX, g++, c++ or clang++; for another architecture its
    cross compiler ($MTP_TRT_AARCH64_CXX, else aarch64-linux-gnu-g++)."""
    if arch is not None and arch != host_arch():
        var, default = CROSS_COMPILERS[arch]
        return os.environ.get(var) or shutil.which(default)
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def build_library(path: Path, include_dir: Path | None = None, arch: str | None = None) -> Path:
    """Compile the library to `path`, for `arch` (None: this machine); an MtpTrtError naming what is missing:
    headers or a compiler."""
    include_dir = include_dir or find_headers()
    if include_dir is None:
        raise MtpTrtError("building the mtp_trt.cpu operators needs ONNX Runtime's C API headers: set "
                          "ONNXRUNTIME_INCLUDE_DIR to the folder holding onnxruntime_c_api.h")
    cxx = compiler(arch)
    if cxx is None and arch is not None and arch != host_arch():
        var, default = CROSS_COMPILERS[arch]
        raise MtpTrtError(f"building the mtp_trt.cpu operators for {arch} here needs a cross compiler: {default} "
                          f"(Debian: apt-get install g++-aarch64-linux-gnu), or set {var}")
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


def ship(include_dir: Path | None = None, arch: str | None = None) -> Path:
    """Rebuild the shipped library for `arch` (None: this machine's) and its record."""
    arch = arch or host_arch()
    if arch not in PREBUILT_STEMS:
        raise MtpTrtError(f"no shipped library for the architecture {arch or platform.machine()!r} (one of: "
                          f"{', '.join(PREBUILT_STEMS)})")
    lib, record = prebuilt_paths(arch)
    build_library(lib, include_dir, arch)
    version = subprocess.run([compiler(arch), "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    info = {"source_hash": source_hash(), "compiler": version, "target": TARGETS[arch],
            "note": "needs ONNX Runtime >= 1.18 (C API version 18)"}
    record.write_text(json.dumps(info, indent=2) + "\n")
    return lib


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
# The session config entry that tells the operators the session's intra-op thread count (where it is "1" the
# attention keeps all of a token's heads in one work item).  Read by ONNX Runtime >= 1.24.
THREADS_KEY = "mtp_trt.cpu.intra_op_threads"


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


if __name__ == "__main__":  # python -m mtp_trt.plugins.ort_lib --ship [--arch aarch64]
    import sys

    args = sys.argv[1:]
    if args[:1] != ["--ship"] or len(args) not in (1, 3) or (len(args) == 3 and args[1] != "--arch"):
        sys.exit("usage: ONNXRUNTIME_INCLUDE_DIR=... python -m mtp_trt.plugins.ort_lib --ship [--arch "
                 f"{'|'.join(PREBUILT_STEMS)}]   (rebuild a shipped library: this machine's, or the one named)")
    try:
        print(ship(arch=args[2] if len(args) == 3 else None))
    except MtpTrtError as e:
        sys.exit(f"error: {e}")
