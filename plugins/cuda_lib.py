"""Build the CUDA kernels of ``plugins/kernels`` into a shared library with nvcc and load it
with ctypes.

Importable without a GPU, without nvcc and without cuda-python: nothing is compiled or loaded
until asked, and cuda-python is imported lazily (``import_cudart``).

* ``build_library(archs)`` compiles every ``.cu`` into one ``.so`` cached under
  ``mtp_trt.fsutil.cache_dir("kernels")`` (``$MTP_TRT_CACHE_DIR``, default ``~/.cache/mtp-trt``), keyed
  by a hash of the sources, the nvcc version, the flags and the archs; it builds into a temporary
  file in that folder and renames it into place, so concurrent builders never see a partial file.
* Archs: ``MTP_TRT_CUDA_ARCH`` (e.g. ``90a`` or ``sm_80,sm_90a`` or ``8.9``), else the current
  GPU's compute capability (cuda-python, then ``nvidia-smi``), else ``DEFAULT_ARCHS``.
* ``load_library()`` returns a ``KernelLib`` whose methods take device pointers (ints), sizes and
  a stream (int handle, 0 = default stream) and raise ``CudaKernelError`` on a non-zero status.
* Which library: ``resolve_library``.  A library links the CUDA runtime of the nvcc that built it statically,
  so it runs only under an NVIDIA driver of that CUDA major version or newer (``cuDriverGetVersion``): the
  shipped one (CUDA 13) where the driver allows, else one built here by an nvcc the driver can run (CUDA 12
  drivers with a CUDA 12 toolkit), else one error saying what to install.
* ``nvcc_command(...)`` lists the command line; ``compile_archs(...)`` compiles each source for a
  list of archs (no GPU needed; used by tests/kernels/test_compile.py).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from mtp_trt.errors import MtpTrtError
from mtp_trt.fsutil import cache_dir

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
SOURCES = ("mla_decode.cu", "dsa.cu", "accept.cu", "gather.cu", "api.cu")
HEADERS = ("mtp_kernels.h", "common.cuh", "hopper.cuh")
DEFAULT_ARCHS = ("80", "86", "89", "90a", "100", "120")
NVCC_FLAGS = ("-O3", "-std=c++17", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr")
ABI_VERSION = 5  # 4: DSA's kernels; 5: num_splits is the persistent grid's parts (workspace: P + B - 1 slots)

MLA_FORCE_SIMT = 1
MLA_SINGLE_STAGE = 2
MLA_FORCE_V1 = 4
MLA_FORCE_V2 = 8
MLA_SEESAW = 16


class CudaKernelError(MtpTrtError):
    """A kernel launcher returned a CUDA error status."""


class NvccError(MtpTrtError):
    """nvcc is missing or failed."""


# ---------------------------------------------------------------------------------------------
# nvcc
# ---------------------------------------------------------------------------------------------
def find_nvcc() -> str | None:
    """Path of nvcc: $NVCC, PATH, $CUDA_HOME/bin, /usr/local/cuda/bin; None if absent."""
    cands = [os.environ.get("NVCC"), shutil.which("nvcc")]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            cands.append(str(Path(root) / "bin" / "nvcc"))
    for c in cands:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    return None


def cuda_include_dir() -> Path | None:
    """The CUDA toolkit's include folder (cuda_runtime.h, cuda_fp16.h): beside nvcc, $CUDA_HOME, $CUDA_PATH or
    /usr/local/cuda; None if absent."""
    cands = []
    nvcc = find_nvcc()
    if nvcc:
        cands.append(Path(os.path.realpath(nvcc)).parent.parent / "include")
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            cands.append(Path(root) / "include")
    return next((c for c in cands if (c / "cuda_fp16.h").is_file() and (c / "cuda_runtime.h").is_file()), None)


def cuda_major(version: str) -> int:
    """'13.0.88' -> 13."""
    return int(version.split(".")[0])


@functools.cache
def driver_cuda_version() -> int | None:
    """The CUDA version the NVIDIA driver supports (cuDriverGetVersion: 12040 for 12.4), or None without a
    driver.  Needs no GPU and no toolkit."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    v = ctypes.c_int(0)
    return v.value if cuda.cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value > 0 else None


def format_cuda_version(v: int) -> str:
    """12040 -> '12.4'."""
    return f"{v // 1000}.{v % 1000 // 10}"


@functools.cache
def nvcc_version(nvcc: str | None = None) -> str:
    nvcc = nvcc or find_nvcc()
    if not nvcc:
        raise NvccError("nvcc not found (install the CUDA toolkit or set NVCC / CUDA_HOME)")
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    m = re.search(r"release ([\d.]+), V([\d.]+)", out)
    return m.group(2) if m else out.strip().splitlines()[-1] if out.strip() else "unknown"


def parse_archs(spec: str | list[str] | tuple[str, ...]) -> list[str]:
    """'90a' / 'sm_90a' / 'compute_90a' / '9.0' / '80,86' / ['80', 'sm_90a'] -> ['90a', ...]."""
    items = spec.replace(";", ",").replace(" ", ",").split(",") if isinstance(spec, str) else list(spec)
    archs: list[str] = []
    for raw in items:
        a = str(raw).strip().lower()
        if not a:
            continue
        a = re.sub(r"^(sm_|compute_)", "", a)
        if re.fullmatch(r"\d+\.\d+", a):
            a = a.replace(".", "")
        if not re.fullmatch(r"\d{2,3}[af]?", a):
            raise NvccError(f"bad CUDA arch {raw!r} (expected e.g. 80, 90a, sm_120)")
        if a not in archs:
            archs.append(a)
    if not archs:
        raise NvccError(f"no CUDA arch in {spec!r}")
    return archs


def gencode_flags(archs) -> list[str]:
    """One -gencode per arch (SASS), e.g. -gencode=arch=compute_90a,code=sm_90a."""
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in parse_archs(archs)]


def nvcc_command(sources, output, archs, *, shared: bool = True, extra=(), nvcc: str | None = None,
                 threads: int = 0) -> list[str]:
    """The nvcc command line building `sources` into `output` (a .so when shared, else one .o
    per call with -c and a single source)."""
    nvcc = nvcc or find_nvcc() or "nvcc"
    cmd = [nvcc, *NVCC_FLAGS, "-I", str(KERNEL_DIR), *gencode_flags(archs)]
    if threads:
        cmd += ["--threads", str(threads)]
    cmd += ["-shared"] if shared else ["-c"]
    cmd += list(extra)
    cmd += [str(KERNEL_DIR / s) if not os.path.isabs(str(s)) else str(s) for s in sources]
    cmd += ["-o", str(output)]
    return cmd


def _run(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise NvccError(f"nvcc failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr}{proc.stdout}")
    return dt, proc.stderr + proc.stdout


@dataclass
class CompileResult:
    source: str
    command: list[str]
    seconds: float
    log: str


def compile_archs(archs, out_dir, *, sources=SOURCES, ptxas_verbose: bool = False, jobs: int | None = None,
                  extra=()) -> list[CompileResult]:
    """Compile each source to an object file for all `archs` (one nvcc per source, sources in
    parallel, nvcc --threads for the archs).  Needs nvcc only, no GPU.  Raises NvccError."""
    nvcc = find_nvcc()
    if not nvcc:
        raise NvccError("nvcc not found")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = jobs or max(1, min(len(sources), os.cpu_count() or 1))
    nthreads = max(1, (os.cpu_count() or 1) // jobs)
    flags = list(extra) + (["-Xptxas", "-v"] if ptxas_verbose else [])

    def one(src: str) -> CompileResult:
        cmd = nvcc_command([src], out_dir / (Path(src).stem + ".o"), archs, shared=False, extra=flags,
                           nvcc=nvcc, threads=nthreads)
        dt, log = _run(cmd)
        return CompileResult(src, cmd, dt, log)

    with ThreadPoolExecutor(max_workers=jobs) as ex:
        return list(ex.map(one, sources))


# ---------------------------------------------------------------------------------------------
# arch detection, cache, build
# ---------------------------------------------------------------------------------------------
def import_cudart():
    """cuda-python's runtime module (``cuda.bindings.runtime``, or ``cuda.cudart`` before 12.6)."""
    try:
        from cuda.bindings import runtime as cudart  # type: ignore
    except ImportError:
        try:
            from cuda import cudart  # type: ignore
        except ImportError as e:
            raise MtpTrtError("cuda-python is not installed (pip install cuda-python)") from e
    return cudart


def detect_archs() -> list[str]:
    """$MTP_TRT_CUDA_ARCH, else the current GPU (cuda-python, nvidia-smi), else DEFAULT_ARCHS."""
    env = os.environ.get("MTP_TRT_CUDA_ARCH")
    if env:
        return parse_archs(env)
    try:
        cudart = import_cudart()
        err, dev = cudart.cudaGetDevice()
        if int(err) == 0:
            err, major = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor, dev)
            err2, minor = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMinor, dev)
            if int(err) == 0 and int(err2) == 0:
                return [f"{major}{minor}"]
    except Exception:  # noqa: BLE001 - any failure: fall through to the next method
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=20, check=False).stdout.split()
            if out:
                return parse_archs(out[0])
        except (OSError, subprocess.SubprocessError, NvccError):
            pass
    return list(DEFAULT_ARCHS)




def source_hash(archs, extra=()) -> str:
    """Digest of the kernel sources, the flags and the archs.  No nvcc call: a cached or shipped library is
    found without the toolkit (a library built by another nvcc of the same sources counts as the same)."""
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode())
        h.update((KERNEL_DIR / name).read_bytes())
    h.update(repr((NVCC_FLAGS, tuple(parse_archs(archs)), tuple(extra))).encode())
    return h.hexdigest()[:20]


def library_path(archs=None) -> Path:
    """Where build_library keeps the library for `archs` built by this nvcc (its CUDA major is in the name: a
    library runs only under drivers of that major or newer)."""
    archs = parse_archs(archs) if archs else detect_archs()
    cu = f"cu{cuda_major(nvcc_version())}-" if find_nvcc() else ""
    return cache_dir("kernels") / f"libmtp_kernels-{cu}{'-'.join(archs)}-{source_hash(archs)}.so"


def build_library(archs=None, *, force: bool = False, verbose: bool = False, path: Path | None = None,
                  extra=()) -> Path:
    """Build (or reuse from the cache) the shared library for `archs`; returns its path."""
    archs = parse_archs(archs) if archs else detect_archs()
    path = path or library_path(archs)
    if path.exists() and not force:
        return path
    if find_nvcc() is None:
        raise NvccError(f"nvcc not found: the CUDA kernels for sm_{', sm_'.join(archs)} are not built (install the "
                        f"CUDA toolkit, or use a GPU the shipped library covers: {', '.join(shipped_archs())})")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.so", dir=path.parent)
    os.close(fd)
    try:
        cmd = nvcc_command(SOURCES, tmp, archs, shared=True, threads=os.cpu_count() or 1, extra=extra)
        if verbose:
            print(" ".join(cmd))
        _run(cmd)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


# ---------------------------------------------------------------------------------------------
# ctypes wrappers
# ---------------------------------------------------------------------------------------------
_P, _I, _F, _Z = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_size_t
_SIGNATURES = {
    "mtp_kernels_abi_version": (_I, []),
    "mtp_error_string": (ctypes.c_char_p, [_I]),
    "mtp_get_last_error": (_I, []),
    "mtp_mla_decode_num_splits": (_I, [_I, _I, _I, _I, _I]),
    "mtp_mla_decode_workspace_size": (_Z, [_I, _I, _I, _I, _I]),
    "mtp_mla_decode": (_I, [_I, _P, _P, _P, _P, _P, _P, _P, _Z, _I, _I, _I, _I, _I, _I, _F, _I, _I, _P]),
    "mtp_mla_kv_commit": (_I, [_I, _P, _P, _P, _I, _I, _I, _I, _P]),
    "mtp_mla_sparse_decode": (_I, [_I, _P, _P, _P, _P, _P, _P, _P, _Z, _I, _I, _I, _I, _I, _I, _I, _I, _F, _I, _I,
                                   _P]),
    "mtp_dsa_select_workspace_size": (_Z, [_I, _I, _I]),
    "mtp_dsa_select": (_I, [_I, _P, _P, _P, _P, _P, _P, _P, _Z, _I, _I, _I, _I, _I, _I, _I, _I, _F, _P]),
    "mtp_accept_strict": (_I, [_I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _P]),
    "mtp_accept_relaxed": (_I, [_I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _F, _I, _I, _P]),
    "mtp_accept_relaxed_dev": (_I, [_I, _P, _P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _P, _P, _I, _I, _P]),
    "mtp_accept_rejection": (_I, [_I, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _P]),
    "mtp_gather_last_hidden": (_I, [_I, _P, _P, _P, _I, _I, _I, _P]),
    "mtp_window_update": (_I, [_I, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P]),
}


def dtype_code(dtype) -> int:
    if isinstance(dtype, int):
        if dtype not in (0, 1, 2):
            raise MtpTrtError(f"bad dtype code {dtype}")
        return dtype
    name = getattr(dtype, "name", str(dtype)).lower()
    from mtp_trt import contract as C  # here: the library loads where NumPy is absent (gpu_check in a bare checkout)

    codes = {alias: d.kernel for d in C.KERNEL_DTYPES.values() for alias in (d.name, d.torch)}  # fp32, float32 -> 0
    if name not in codes:
        raise MtpTrtError(f"unsupported dtype {dtype!r} (float32, float16 or bfloat16)")
    return codes[name]


def _ptr(x) -> int | None:
    return int(x) if x else None


class KernelLib:
    """The loaded library; methods mirror mtp_kernels.h (pointers and streams as ints)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.lib = ctypes.CDLL(str(path))
        for name, (res, args) in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.restype, fn.argtypes = res, args
        got = self.lib.mtp_kernels_abi_version()
        if got != ABI_VERSION:
            raise MtpTrtError(f"{path}: kernel ABI {got}, expected {ABI_VERSION}")

    def _check(self, name: str, code: int) -> None:
        if code != 0:
            msg = self.lib.mtp_error_string(code).decode(errors="replace")
            raise CudaKernelError(f"{name}: CUDA error {code} ({msg})")

    def last_error(self) -> int:
        return int(self.lib.mtp_get_last_error())

    # ---- MLA
    def mla_decode_num_splits(self, B, S, H, max_len, num_sms=0) -> int:
        return int(self.lib.mtp_mla_decode_num_splits(B, S, H, max_len, num_sms))

    def mla_decode_workspace_size(self, B, S, H, Dl, num_splits) -> int:
        return int(self.lib.mtp_mla_decode_workspace_size(B, S, H, Dl, num_splits))

    def mla_decode(self, dtype, q, kv_cache, past_len, new_rows, mask, out, workspace, workspace_bytes, B, S, H,
                   Dl, Dr, T_max, scale, num_splits, flags=0, stream=0) -> None:
        self._check("mtp_mla_decode", self.lib.mtp_mla_decode(
            dtype_code(dtype), _ptr(q), _ptr(kv_cache), _ptr(past_len), _ptr(new_rows), _ptr(mask), _ptr(out),
            _ptr(workspace), int(workspace_bytes), B, S, H, Dl, Dr, T_max, float(scale), num_splits, flags,
            _ptr(stream)))

    def mla_kv_commit(self, dtype, kv_cache, past_len, new_rows, B, S, D, T_max, stream=0) -> None:
        self._check("mtp_mla_kv_commit", self.lib.mtp_mla_kv_commit(
            dtype_code(dtype), _ptr(kv_cache), _ptr(past_len), _ptr(new_rows), B, S, D, T_max, _ptr(stream)))

    def mla_sparse_decode(self, dtype, q, kv_cache, past_len, new_rows, selected, out, workspace, workspace_bytes,
                          B, S, H, Dl, Dr, C, T_max, K, scale, num_splits, flags=0, stream=0) -> None:
        self._check("mtp_mla_sparse_decode", self.lib.mtp_mla_sparse_decode(
            dtype_code(dtype), _ptr(q), _ptr(kv_cache), _ptr(past_len), _ptr(new_rows), _ptr(selected), _ptr(out),
            _ptr(workspace), int(workspace_bytes), B, S, H, Dl, Dr, C, T_max, K, float(scale), num_splits, flags,
            _ptr(stream)))

    # ---- DeepSeek Sparse Attention's indexer
    def dsa_select_workspace_size(self, B, S, T_max) -> int:
        return int(self.lib.mtp_dsa_select_workspace_size(B, S, T_max))

    def dsa_select(self, dtype, q_index, weights, kv_cache, past_len, mask, selected, workspace, workspace_bytes,
                   B, S, Hi, Di, C, key_offset, T_max, K, scale, stream=0) -> None:
        self._check("mtp_dsa_select", self.lib.mtp_dsa_select(
            dtype_code(dtype), _ptr(q_index), _ptr(weights), _ptr(kv_cache), _ptr(past_len), _ptr(mask),
            _ptr(selected), _ptr(workspace), int(workspace_bytes), B, S, Hi, Di, C, key_offset, T_max, K,
            float(scale), _ptr(stream)))

    # ---- acceptance
    def accept_strict(self, dtype, logits, target_ids, drafts, out_tokens, num_accepted, last_index, B, K, V,
                      stream=0) -> None:
        self._check("mtp_accept_strict", self.lib.mtp_accept_strict(
            dtype_code(dtype), _ptr(logits), _ptr(target_ids), _ptr(drafts), _ptr(out_tokens), _ptr(num_accepted),
            _ptr(last_index), B, K, V, _ptr(stream)))

    def accept_relaxed(self, dtype, logits, drafts, thinking, out_tokens, num_accepted, last_index, B, K, V, topk,
                       delta, think_start_id, think_end_id, stream=0) -> None:
        self._check("mtp_accept_relaxed", self.lib.mtp_accept_relaxed(
            dtype_code(dtype), _ptr(logits), _ptr(drafts), _ptr(thinking), _ptr(out_tokens), _ptr(num_accepted),
            _ptr(last_index), B, K, V, topk, float(delta), think_start_id, think_end_id, _ptr(stream)))

    def accept_relaxed_dev(self, dtype, logits, drafts, draft_stride, thinking_in, thinking_out, out_tokens,
                           num_accepted, last_index, B, K, V, topk, delta, think_start_id, think_end_id,
                           stream=0) -> None:
        """accept_relaxed with `topk` (int32) and `delta` (float32) as device pointers to scalars, drafts
        of sequence b at drafts[b * draft_stride + i], the flags read from thinking_in and written to
        thinking_out (may be the same), last_index optional (0/None: not written)."""
        self._check("mtp_accept_relaxed_dev", self.lib.mtp_accept_relaxed_dev(
            dtype_code(dtype), _ptr(logits), _ptr(drafts), int(draft_stride), _ptr(thinking_in), _ptr(thinking_out),
            _ptr(out_tokens), _ptr(num_accepted), _ptr(last_index), B, K, V, _ptr(topk), _ptr(delta),
            think_start_id, think_end_id, _ptr(stream)))

    def accept_rejection(self, dtype, p, q, drafts, uniforms, out_tokens, num_accepted, last_index, B, K, V,
                         stream=0) -> None:
        self._check("mtp_accept_rejection", self.lib.mtp_accept_rejection(
            dtype_code(dtype), _ptr(p), _ptr(q), _ptr(drafts), _ptr(uniforms), _ptr(out_tokens), _ptr(num_accepted),
            _ptr(last_index), B, K, V, _ptr(stream)))

    # ---- small kernels
    def gather_last_hidden(self, dtype, hidden, last_index, out, B, Kp1, D, stream=0) -> None:
        self._check("mtp_gather_last_hidden", self.lib.mtp_gather_last_hidden(
            dtype_code(dtype), _ptr(hidden), _ptr(last_index), _ptr(out), B, Kp1, D, _ptr(stream)))

    def window_update(self, dtype, win_tokens_in, win_hidden_in, new_tokens, new_hidden, num_accepted,
                      win_tokens_out, win_hidden_out, B, K, N, D, stream=0) -> None:
        self._check("mtp_window_update", self.lib.mtp_window_update(
            dtype_code(dtype), _ptr(win_tokens_in), _ptr(win_hidden_in), _ptr(new_tokens), _ptr(new_hidden),
            _ptr(num_accepted), _ptr(win_tokens_out), _ptr(win_hidden_out), B, K, N, D, _ptr(stream)))


@functools.cache
def _load(path: str) -> KernelLib:
    return KernelLib(path)


# ---------------------------------------------------------------------------------------------
# the shipped library (kernels compiled ahead: no nvcc or host compiler where the engines run)
# ---------------------------------------------------------------------------------------------
PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"
PREBUILT_LIB, PREBUILT_INFO = PREBUILT_DIR / "libmtp_kernels.so", PREBUILT_DIR / "libmtp_kernels.json"
PREBUILT_PTX = "80"  # PTX for compute_80 rides along: GPUs without their own SASS in the file JIT it once


def _ptx_flags() -> tuple[str, ...]:
    return (f"-gencode=arch=compute_{PREBUILT_PTX},code=compute_{PREBUILT_PTX}",)


def prebuilt_info() -> dict | None:
    """The shipped library's record (source digest, archs, nvcc), or None when none is shipped."""
    import json

    if not (PREBUILT_LIB.is_file() and PREBUILT_INFO.is_file()):
        return None
    return json.loads(PREBUILT_INFO.read_text())


def shipped_archs() -> list[str]:
    info = prebuilt_info()
    return [f"sm_{a}" for a in info["archs"]] + [f"compute_{info['ptx']}+"] if info else []


def prebuilt_current() -> tuple[bool, str]:
    """(whether the shipped library was built from these sources, why not)."""
    info = prebuilt_info()
    if info is None:
        return False, f"{PREBUILT_LIB} is not shipped"
    want = source_hash(info["archs"], _ptx_flags())
    if info["source_hash"] != want or info["abi"] != ABI_VERSION:
        return False, (f"{PREBUILT_LIB} was built from other kernel sources (digest {info['source_hash']}, now "
                       f"{want}); rebuild it: python -m mtp_trt.plugins.cuda_lib --ship")
    return True, ""


def ship() -> Path:
    """Build the library shipped in the package (DEFAULT_ARCHS as SASS + compute_80 PTX) and its record."""
    import json

    build_library(DEFAULT_ARCHS, force=True, path=PREBUILT_LIB, extra=_ptx_flags())
    info = {"source_hash": source_hash(DEFAULT_ARCHS, _ptx_flags()), "abi": ABI_VERSION,
            "archs": list(DEFAULT_ARCHS), "ptx": PREBUILT_PTX, "nvcc": nvcc_version(),
            "note": "CUDA runtime linked statically: needs an NVIDIA driver of this nvcc's CUDA major version or newer"}
    PREBUILT_INFO.write_text(json.dumps(info, indent=2) + "\n")
    return PREBUILT_LIB


def driver_problem(driver: int | None, built_with: str, what: str) -> str | None:
    """Why a library built by nvcc `built_with` (e.g. '13.0.88') cannot run under a driver supporting CUDA
    `driver` (cuDriverGetVersion; None: unknown, no driver), or None."""
    if driver is None or driver // 1000 >= cuda_major(built_with):
        return None
    return (f"{what} links the CUDA {cuda_major(built_with)} runtime, but the NVIDIA driver supports CUDA "
            f"{format_cuda_version(driver)}: update the driver (CUDA {cuda_major(built_with)}: R"
            f"{DRIVER_FOR_CUDA.get(cuda_major(built_with), '?')} or newer), or install a CUDA "
            f"{driver // 1000} toolkit (nvcc) so the kernels are built for this driver, or set MTP_TRT_KERNEL_LIB "
            f"to a kernel library built for it")


DRIVER_FOR_CUDA = {12: 525, 13: 580}  # the first Linux driver branch of each CUDA major version


def resolve_library(archs=None) -> Path:
    """The library to load, without compiling when avoidable: $MTP_TRT_KERNEL_LIB; else (no archs asked) the
    shipped library when it is current and the driver runs its CUDA version; else one built for `archs` (default:
    this GPU's) in the cache by the nvcc here, built now if missing (an NvccError naming what to do where there is
    no nvcc, one MtpTrtError where the driver is older than both the shipped library's CUDA and nvcc's)."""
    env = os.environ.get("MTP_TRT_KERNEL_LIB")
    if env:
        if not Path(env).is_file():
            raise MtpTrtError(f"MTP_TRT_KERNEL_LIB={env}: no such file")
        return Path(env)
    driver = driver_cuda_version()
    shipped = prebuilt_info() if archs is None and prebuilt_current()[0] else None
    too_old = driver_problem(driver, shipped["nvcc"], f"the shipped kernel library ({PREBUILT_LIB.name})") \
        if shipped else None
    if shipped and not too_old:
        return PREBUILT_LIB
    if find_nvcc() is None:
        if too_old:
            raise MtpTrtError(too_old)
    elif problem := driver_problem(driver, nvcc_version(), f"a kernel library built by nvcc {nvcc_version()}"):
        raise MtpTrtError(f"{too_old} (the nvcc here, {nvcc_version()}, builds for CUDA {cuda_major(nvcc_version())} "
                          f"too)" if too_old else problem)
    return build_library(archs)


def describe(path: Path) -> str:
    """Which kernel library `path` is, in words (for reports)."""
    if Path(path) == PREBUILT_LIB and (info := prebuilt_info()):
        return f"shipped ({PREBUILT_LIB.name}, CUDA {cuda_major(info['nvcc'])}, sm_{', sm_'.join(info['archs'])})"
    origin = "MTP_TRT_KERNEL_LIB" if os.environ.get("MTP_TRT_KERNEL_LIB") else "built here"
    return f"{origin} ({path})"


def load_library(archs=None, *, force_build: bool = False) -> KernelLib:
    """Load the kernels library (resolve_library; cached per path within the process)."""
    return _load(str(build_library(archs, force=True) if force_build else resolve_library(archs)))


if __name__ == "__main__":  # python -m mtp_trt.plugins.cuda_lib --ship
    import sys

    if sys.argv[1:] != ["--ship"]:
        sys.exit("usage: python -m mtp_trt.plugins.cuda_lib --ship   (rebuild the shipped kernel library)")
    print(ship())
