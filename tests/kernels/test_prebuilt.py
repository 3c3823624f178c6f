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
    assert lib.mla_decode_workspace_size(2, 4, 16, 512, 8) == (8 + 1) * 4 * 16 * (512 + 2) * 4 + 256 + 256


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


@pytest.mark.parametrize("driver,nvcc,want", [
    (13000, None, "shipped"), (None, None, "shipped"), (13020, "13.0.88", "shipped"),
    (12040, "12.4.131", "built"), (12080, None, "error: update the driver"),
    (12040, "13.0.88", "error: nvcc too new"), (11080, "12.4.131", "error: nvcc too new")])
def test_library_chosen_by_the_driver_version(no_toolkit, monkeypatch, tmp_path, driver, nvcc, want):
    """The shipped library links the CUDA 13 runtime statically: under a CUDA 12 driver it would fail every
    launch with error 35, so it is passed over for one built by a CUDA 12 nvcc, or one clear error is raised."""
    built = []
    monkeypatch.setattr(cuda_lib, "driver_cuda_version", lambda: driver)
    monkeypatch.setattr(cuda_lib, "find_nvcc", lambda: "/opt/cuda/bin/nvcc" if nvcc else None)
    monkeypatch.setattr(cuda_lib, "nvcc_version", lambda *a: nvcc)
    monkeypatch.setattr(cuda_lib, "build_library", lambda archs=None: built.append(archs) or tmp_path / "cu12.so")
    shipped_major = cuda_lib.cuda_major(cuda_lib.prebuilt_info()["nvcc"])
    assert shipped_major == 13
    if want == "shipped":
        assert cuda_lib.resolve_library() == cuda_lib.PREBUILT_LIB and not built
    elif want == "built":
        assert cuda_lib.resolve_library() == tmp_path / "cu12.so" and built == [None]
    else:
        with pytest.raises(MtpTrtError) as e:
            cuda_lib.resolve_library()
        msg = str(e.value)
        assert "\n" not in msg and not built
        assert f"supports CUDA {driver // 1000}.{driver % 1000 // 10}" in msg and "update the driver" in msg
        assert f"install a CUDA {driver // 1000} toolkit" in msg and "MTP_TRT_KERNEL_LIB" in msg
        if nvcc:
            assert f"nvcc {nvcc}" in msg or f"the nvcc here, {nvcc}" in msg


def test_driver_version_without_a_driver():
    """cuDriverGetVersion through libcuda.so.1 (no GPU, no toolkit needed); None where there is no driver."""
    v = cuda_lib.driver_cuda_version()
    assert v is None or v >= 11000
    assert cuda_lib.format_cuda_version(12040) == "12.4" and cuda_lib.format_cuda_version(13000) == "13.0"
