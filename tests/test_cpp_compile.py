"""Both C++ targets compile against TensorRT's public headers with -Wall -Wextra -Werror: the plugin
library's source (plugins/cpp/mtp_trt_plugins.cpp, without its CUDA kernels, which
tests/kernels/test_compile.py compiles) and the runner (samples/cpp).  Skipped, with the reason,
where TensorRT's headers are absent (CI); see tests/cpp_env.py for where they are looked for.
The `slow` test builds both through their CMakeLists for one arch (plugins: the real .so)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

import cpp_env
from mtp_trt.plugins import cuda_lib

pytestmark = pytest.mark.skipif(cpp_env.unavailable_reason() is not None,
                                reason=f"C++ compile: {cpp_env.unavailable_reason()}")
ROOT = cpp_env.ROOT


def _compile(tmp_path, *args, tensorrt=None):
    proc = subprocess.run(cpp_env.gxx(*args, tensorrt=tensorrt), capture_output=True, text=True, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("variant", [[], ["-DMTP_TRT_REGISTER_ON_LOAD"]], ids=["loadLibrary", "register-on-load"])
def test_plugin_library_source_compiles_without_warnings(tmp_path, variant):
    _compile(tmp_path, "-fPIC", "-c", *variant, "-I", "plugins/kernels", "-I", "plugins/cpp",
             "plugins/cpp/mtp_trt_plugins.cpp", "-o", str(tmp_path / "plugins.o"))
    symbols = subprocess.run(["nm", "-C", str(tmp_path / "plugins.o")], capture_output=True, text=True).stdout
    for entry in ("setLoggerFinder", "getCreators", "getPluginCreators"):  # extern "C", defined here
        assert any(line.endswith(f" T {entry}") for line in symbols.splitlines()), entry


@pytest.mark.parametrize("tensorrt", cpp_env.tensorrt_include_dirs(), ids=str)
def test_runner_compiles_without_warnings(tmp_path, tensorrt):
    """Against each TensorRT's headers given (TENSORRT_INCLUDE_DIR=/a/10.9/include:/b/11.1/include): the
    aliased-output lookup of 10.15+ is compiled only there."""
    _compile(tmp_path, "-c", "samples/cpp/mtp_trt_runner.cpp", "-o", str(tmp_path / "runner.o"), tensorrt=tensorrt)


def test_a_warning_fails_the_compile(tmp_path):
    src = tmp_path / "w.cpp"
    src.write_text("int f(int unused) { return 0; }\n")
    proc = subprocess.run(cpp_env.gxx("-c", str(src), "-o", str(tmp_path / "w.o")), capture_output=True, text=True)
    assert proc.returncode != 0 and "unused" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cmake") is None or cuda_lib.find_nvcc() is None, reason="cmake or nvcc not found")
def test_cmake_builds_both_targets(tmp_path):
    """plugins/cpp: the shared library for sm_80 (kernels included); samples/cpp: the runner, compile only
    where TensorRT's library is absent.  About a minute on 2 cores."""
    trt_root = str(cpp_env.tensorrt_include_dir().parent)
    for src, extra in (("plugins/cpp", ["-DCMAKE_CUDA_ARCHITECTURES=80"]), ("samples/cpp", ["-DMTP_TRT_COMPILE_ONLY=ON"])):
        build = tmp_path / src.replace("/", "_")
        for cmd in (["cmake", "-S", str(ROOT / src), "-B", str(build), f"-DTensorRT_ROOT={trt_root}",
                     "-DMTP_TRT_WERROR=ON", *extra], ["cmake", "--build", str(build), "-j2"]):
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lib = tmp_path / "plugins_cpp" / "libmtp_trt_plugins.so"
    exported = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    names = {line.split()[-1] for line in exported.splitlines() if " T " in line}
    assert names == {"setLoggerFinder", "getCreators", "getPluginCreators", "mtp_trt_plugins_kernel_abi"}
