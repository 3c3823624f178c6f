"""The kernel library shipped in the package (plugins/prebuilt): built from exactly these sources, found and
loaded with no nvcc and no host compiler (where the engines run), and one clear error where neither the shipped
library nor nvcc can serve."""

import subprocess

import pytest

from mtp_trt.errors import MtpTrtError
from mtp_trt.plugins import cuda_lib


def test_shipped_library_is_built_from_these_sources():
    ok, why = cuda_lib.prebuilt_current()
    assert ok, why
    info = cuda_lib.prebuilt_info()
    assert set(cuda_lib.DEFAULT_ARCHS) <= set(info["archs"]) and info["ptx"] == "80"


def test_shipped_library_exports_the_kernel_interface():
    lib = cuda_lib.KernelLib(cuda_lib.PREBUILT_LIB)  # checks every symbol of the interface and the ABI version
    assert lib.mla_decode_workspace_size(2, 4, 16, 512, 8) == 2 * 4 * 16 * 8 * (512 + 2) * 4


@pytest.fixture
def no_toolkit(monkeypatch):
    """nvcc and subprocesses are unavailable, as on a machine with only the driver, TensorRT and pip packages."""
    monkeypatch.setattr(cuda_lib, "find_nvcc", lambda: None)
    monkeypatch.delenv("MTP_TRT_KERNEL_LIB", raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError(f"a subprocess was started: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)


def test_resolved_without_nvcc(no_toolkit):
    assert cuda_lib.resolve_library() == cuda_lib.PREBUILT_LIB


def test_override_by_environment(no_toolkit, monkeypatch, tmp_path):
    monkeypatch.setenv("MTP_TRT_KERNEL_LIB", str(cuda_lib.PREBUILT_LIB))
    assert cuda_lib.resolve_library() == cuda_lib.PREBUILT_LIB
    monkeypatch.setenv("MTP_TRT_KERNEL_LIB", str(tmp_path / "missing.so"))
    with pytest.raises(MtpTrtError, match="missing.so: no such file"):
        cuda_lib.resolve_library()


def test_stale_shipped_library_and_no_nvcc_is_one_clear_error(no_toolkit, monkeypatch, tmp_path):
    monkeypatch.setattr(cuda_lib, "PREBUILT_INFO", tmp_path / "absent.json")
    monkeypatch.setattr(cuda_lib, "cache_dir", lambda *parts: tmp_path.joinpath(*parts))
    with pytest.raises(cuda_lib.NvccError, match=r"nvcc not found: the CUDA kernels for sm_90a are not built"):
        cuda_lib.resolve_library(["90a"])
    monkeypatch.setattr(cuda_lib, "detect_archs", lambda: ["89"])
    with pytest.raises(cuda_lib.NvccError, match=r"sm_89 are not built"):
        cuda_lib.resolve_library()
