"""Where the C++ tests find TensorRT's headers, the CUDA headers and g++ (helpers, not tests).

TensorRT's headers: $TENSORRT_INCLUDE_DIR, $TensorRT_ROOT/include, then the usual install paths.
None of TensorRT's Python wheels ships them; CI has none, so the C++ tests skip there
with the reason.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mtp_trt.plugins import cuda_lib

ROOT = Path(__file__).resolve().parents[1]
HEADER = "NvInferRuntime.h"


def tensorrt_include_dirs() -> list[Path]:
    """Every folder of $TENSORRT_INCLUDE_DIR (os.pathsep-separated: headers of several TensorRT versions, each
    compiled against) holding TensorRT's headers, else the first found of tensorrt_include_dir's candidates."""
    dirs = [Path(d) for d in os.environ.get("TENSORRT_INCLUDE_DIR", "").split(os.pathsep) if d]
    found = [d for d in dirs if (d / HEADER).is_file()]
    one = tensorrt_include_dir()
    return found or ([one] if one else [])


def tensorrt_include_dir() -> Path | None:
    cands = os.environ.get("TENSORRT_INCLUDE_DIR", "").split(os.pathsep)
    if os.environ.get("TensorRT_ROOT"):
        cands.append(str(Path(os.environ["TensorRT_ROOT"]) / "include"))
    cands += ["/usr/include/x86_64-linux-gnu", "/usr/include/aarch64-linux-gnu", "/usr/local/TensorRT/include",
              "/opt/tensorrt/include", "/usr/include"]
    return next((Path(c) for c in cands if c and (Path(c) / HEADER).is_file()), None)


cuda_include_dir = cuda_lib.cuda_include_dir


def unavailable_reason() -> str | None:
    """Why the C++ sources cannot be compiled here, or None."""
    if shutil.which("g++") is None:
        return "g++ not found"
    if tensorrt_include_dir() is None:
        return (f"TensorRT's C++ headers ({HEADER}) not found: set TENSORRT_INCLUDE_DIR or TensorRT_ROOT "
                f"(e.g. the include/ folder of github.com/NVIDIA/TensorRT)")
    if cuda_include_dir() is None:
        return "the CUDA toolkit's headers (cuda_runtime_api.h) not found"
    return None


def gxx(*args: str, tensorrt: Path | None = None) -> list[str]:
    """g++ with our warning flags and the include folders (TensorRT's, `tensorrt` or the first found, and CUDA's
    as system headers)."""
    return ["g++", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-isystem", str(tensorrt or tensorrt_include_dir()),
            "-isystem", str(cuda_include_dir()), *args]
