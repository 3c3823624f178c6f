"""The CPU-operator libraries shipped in the package (plugins/prebuilt/libmtp_ort_ops.so for x86-64 Linux,
libmtp_ort_ops-aarch64.so for ARM64 Linux): built from exactly these sources, the running machine's found and
registered with no compiler and no ONNX Runtime headers (as on CI and a user's machine), and one clear error where
neither the shipped library nor a build can serve."""

import json
import platform
import subprocess
import sys

import onnxruntime as ort
import pytest

from mtp_trt.errors import MtpTrtError
from mtp_trt.plugins import ort_lib

shipped_here = pytest.mark.skipif(platform.system() != "Linux" or ort_lib.host_arch() is None,
                                  reason=f"no library is shipped for {platform.system()} {platform.machine()}")


@shipped_here
def test_shipped_library_is_built_from_these_sources():
    ok, why = ort_lib.prebuilt_current()
    assert ok, why


@pytest.mark.parametrize("arch", sorted(ort_lib.PREBUILT_STEMS))
def test_every_architecture_is_shipped_from_these_sources(arch):
    lib, record = ort_lib.prebuilt_paths(arch)
    info = json.loads(record.read_text())
    assert info["source_hash"] == ort_lib.source_hash(), f"{lib.name}: rebuild it (--ship --arch {arch})"
    elf = lib.read_bytes()[:20]
    assert elf[:4] == b"\x7fELF" and int.from_bytes(elf[18:20], "little") == {"x86_64": 62, "aarch64": 183}[arch]


def _as_machine(system: str, machine: str) -> tuple[str, bool, str]:
    """ort_lib's shipped library and its verdict in a process where platform says (system, machine)."""
    code = (f"import json, platform; platform.system = lambda: {system!r}; platform.machine = lambda: {machine!r}\n"
            "from mtp_trt.plugins import ort_lib\n"
            "print(json.dumps([ort_lib.PREBUILT_LIB.name, *ort_lib.prebuilt_current()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return tuple(json.loads(out))


@pytest.mark.parametrize("machine,lib", [("x86_64", "libmtp_ort_ops.so"), ("aarch64", "libmtp_ort_ops-aarch64.so"),
                                         ("arm64", "libmtp_ort_ops-aarch64.so")])
def test_the_running_machines_library_is_chosen(machine, lib):
    assert _as_machine("Linux", machine) == (lib, True, "")


@pytest.mark.parametrize("system,machine", [("Darwin", "arm64"), ("Linux", "riscv64"), ("Windows", "AMD64")])
def test_no_shipped_library_elsewhere_says_why(system, machine):
    _, ok, why = _as_machine(system, machine)
    assert not ok and why == (f"no library is shipped for {system} {machine} (only for Linux on x86_64 and "
                              "aarch64)")


@pytest.fixture
def no_toolchain(monkeypatch, tmp_path):
    """No headers, no compiler, no subprocess and an empty cache: only what the package ships."""
    monkeypatch.delenv("ONNXRUNTIME_INCLUDE_DIR", raising=False)
    monkeypatch.delenv("MTP_TRT_ORT_OPS_LIB", raising=False)
    monkeypatch.setenv("MTP_TRT_CACHE_DIR", str(tmp_path / "cache"))

    def refuse(*args, **kwargs):
        raise AssertionError(f"a subprocess was started: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)


@shipped_here
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
