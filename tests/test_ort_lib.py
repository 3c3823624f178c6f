"""The CPU-operator library shipped in the package (plugins/prebuilt/libmtp_ort_ops.so): built from exactly these
sources, found and registered with no compiler and no ONNX Runtime headers (as on CI and a user's machine), and
one clear error where neither the shipped library nor a build can serve."""

import platform
import subprocess

import onnxruntime as ort
import pytest

from mtp_trt.errors import MtpTrtError
from mtp_trt.plugins import ort_lib

x86_linux = pytest.mark.skipif((platform.system(), platform.machine()) != ("Linux", "x86_64"),
                               reason="the shipped library is built for x86-64 Linux")


@x86_linux
def test_shipped_library_is_built_from_these_sources():
    ok, why = ort_lib.prebuilt_current()
    assert ok, why


@pytest.fixture
def no_toolchain(monkeypatch, tmp_path):
    """No headers, no compiler, no subprocess and an empty cache: only what the package ships."""
    monkeypatch.delenv("ONNXRUNTIME_INCLUDE_DIR", raising=False)
    monkeypatch.delenv("MTP_TRT_ORT_OPS_LIB", raising=False)
    monkeypatch.setenv("MTP_TRT_CACHE_DIR", str(tmp_path / "cache"))

    def refuse(*args, **kwargs):
        raise AssertionError(f"a subprocess was started: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)


@x86_linux
def test_registered_without_headers_or_compiler(no_toolchain):
    assert ort_lib.resolve_library() == ort_lib.PREBUILT_LIB
    options = ort.SessionOptions()
    ort_lib.register(options)  # ONNX Runtime loads it and calls RegisterCustomOps


def test_override_by_environment(no_toolchain, monkeypatch, tmp_path):
    monkeypatch.setenv("MTP_TRT_ORT_OPS_LIB", str(tmp_path / "missing.so"))
    with pytest.raises(MtpTrtError, match="missing.so: no such file"):
        ort_lib.resolve_library()


def test_stale_shipped_library_and_no_headers_is_one_clear_error(no_toolchain, monkeypatch, tmp_path):
    monkeypatch.setattr(ort_lib, "PREBUILT_INFO", tmp_path / "absent.json")
    with pytest.raises(MtpTrtError, match=r"not available: .*is not shipped; and .*set ONNXRUNTIME_INCLUDE_DIR"):
        ort_lib.resolve_library()
