"""pytest set-up: markers `gpu`, `trt` and `slow` skip cleanly, with the reason, where they cannot run."""

import functools
import importlib.util

import pytest


@functools.cache
def gpu_unavailable_reason() -> str | None:
    """None when an NVIDIA GPU is usable through cuda-python, else why not."""
    if importlib.util.find_spec("cuda") is None:
        return "cuda-python is not installed (pip install cuda-python)"
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # cuda-python < 12.6
        except ImportError as e:
            return f"cuda-python cannot be imported: {e}"
    err, count = cudart.cudaGetDeviceCount()
    if int(err) != 0 or count == 0:
        return "no NVIDIA GPU is visible to the CUDA runtime"
    return None


@functools.cache
def trt_unavailable_reason() -> str | None:
    """None when TensorRT or TensorRT for RTX can be imported and used, else why not."""
    from mtp_trt.errors import MtpTrtError
    from mtp_trt.trt import compat

    try:
        compat.load("auto")
    except MtpTrtError as e:
        return str(e)
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and (why := gpu_unavailable_reason()):
            item.add_marker(pytest.mark.skip(reason=f"gpu: {why}"))
        if "trt" in item.keywords and (why := trt_unavailable_reason()):
            item.add_marker(pytest.mark.skip(reason=f"trt: {why}"))
