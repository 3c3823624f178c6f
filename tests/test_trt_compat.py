"""TensorRT layer without TensorRT: flavour choice and install messages, target-arch parsing, the
libtensorrt_rtx.so fix (ELF shim loaded by the real dynamic loader, symlink, failure), and the
plugins' workspace arithmetic against the kernel library's formulas."""

import struct
import subprocess
import sys
import textwrap

import pytest

from mtp_trt.errors import MtpTrtError
from mtp_trt.plugins import trt_plugins as tp
from mtp_trt.trt import compat, libfix


@pytest.fixture
def fresh_load():
    compat.load.cache_clear()
    compat.gpu.cache_clear()
    yield
    compat.load.cache_clear()
    compat.gpu.cache_clear()


@pytest.mark.parametrize("spec,want", [("8.9", "8.9"), ("89", "8.9"), ("sm_89", "8.9"), ("SM120", "12.0"),
                                       ("12.1", "12.1"), ("sm_90a", "9.0"), ("compute_75", "7.5"), ("100", "10.0")])
def test_parse_arch(spec, want):
    assert compat.parse_arch(spec) == want


@pytest.mark.parametrize("spec", ["ampere", "8", "sm_", "8.9.1", ""])
def test_parse_arch_rejects(spec):
    with pytest.raises(MtpTrtError, match="--target-arch"):
        compat.parse_arch(spec)


def test_no_tensorrt_installed_names_both_install_commands(fresh_load, monkeypatch):
    real = compat.importlib.util.find_spec
    hidden = {"tensorrt", "tensorrt_rtx", "tensorrt_rtx_bindings"}
    monkeypatch.setattr(compat.importlib.util, "find_spec", lambda n, *a: None if n in hidden else real(n, *a))
    with pytest.raises(MtpTrtError) as e:
        compat.load("auto")
    msg = str(e.value)
    assert "no usable TensorRT" in msg and "tensorrt: not installed" in msg and "tensorrt_rtx: not installed" in msg
    assert compat.INSTALL["tensorrt"] in msg and compat.INSTALL["tensorrt_rtx"] in msg
    assert "\n" not in msg


def test_unknown_flavour(fresh_load):
    with pytest.raises(MtpTrtError, match="--flavour: unknown flavour 'trt'"):
        compat.load("trt")


def test_stub_tensorrt_is_not_usable(fresh_load, monkeypatch):
    """A `tensorrt` that imports but has no Builder (the index's stub) is skipped with the reason."""
    stub = type(sys)("tensorrt")
    monkeypatch.setitem(sys.modules, "tensorrt", stub)
    monkeypatch.setattr(compat.importlib.util, "find_spec", lambda n, *a: object() if n == "tensorrt" else None)
    with pytest.raises(MtpTrtError, match="stub package"):
        compat.load("tensorrt")


def test_tensorrt_flavour_needs_a_gpu(fresh_load, monkeypatch):
    fake = compat.TrtApi(flavour="tensorrt", trt=type(sys)("tensorrt"), version="10.9", module="tensorrt")
    monkeypatch.setattr(compat, "_import", lambda f: (fake, "") if f == "tensorrt" else (None, "not installed"))
    monkeypatch.setattr(compat, "gpu", lambda: (None, "no NVIDIA driver"))
    with pytest.raises(MtpTrtError, match="builds engines only for the GPU it runs on.*--flavour tensorrt_rtx"):
        compat.load("tensorrt")
    with pytest.raises(MtpTrtError, match="installed, but it builds only on a GPU"):
        compat.load("auto")  # and no RTX either


def test_tensorrt_flavour_targets_only_its_gpu(monkeypatch):
    api = compat.TrtApi(flavour="tensorrt", trt=type(sys)("tensorrt"), version="10.9", module="tensorrt")
    monkeypatch.setattr(compat, "gpu", lambda: ("9.0", ""))
    assert api.resolve_archs("auto") == ["9.0"] and api.resolve_archs("native") == ["9.0"]
    assert api.resolve_archs("sm_90") == ["9.0"] and api.resolve_archs("ampere+") == ["ampere+"]
    with pytest.raises(MtpTrtError, match="cannot build for compute capability 8.9.*--flavour tensorrt_rtx"):
        api.resolve_archs("8.9")


def test_rtx_targets(monkeypatch):
    import types

    members = {"NONE": 0, "CURRENT": 1, "SM75": 75, "SM80": 80, "SM89": 89, "SM120": 120}
    fake = types.SimpleNamespace(ComputeCapability=types.SimpleNamespace(__members__=members))
    api = compat.TrtApi(flavour="tensorrt_rtx", trt=fake, version="1.7", module="tensorrt_rtx")
    monkeypatch.setattr(compat, "gpu", lambda: (None, "no NVIDIA driver"))
    assert api.buildable_archs() == ["7.5", "8.0", "8.9", "12.0"]
    assert api.resolve_archs("auto") == api.resolve_archs(None) == ["8.0", "8.9", "12.0"]  # no GPU: Ampere on
    assert api.resolve_archs("all") == ["7.5", "8.0", "8.9", "12.0"]
    assert api.resolve_archs("89, sm_120,8.9") == ["8.9", "12.0"]
    with pytest.raises(MtpTrtError, match="native: no NVIDIA driver; name the compute capabilities"):
        api.resolve_archs("native")
    with pytest.raises(MtpTrtError, match=r"cannot build for compute capability 9.0 \(it can: 7.5, 8.0, 8.9, 12.0\)"):
        api.resolve_archs("9.0")
    monkeypatch.setattr(compat, "gpu", lambda: ("8.9", ""))
    assert api.resolve_archs("auto") == api.resolve_archs("native") == ["8.9"]
    monkeypatch.setattr(compat, "gpu", lambda: ("9.0", ""))  # a GPU TensorRT for RTX does not support
    assert api.resolve_archs("auto") == ["8.0", "8.9", "12.0"]
    with pytest.raises(MtpTrtError, match="this GPU has compute capability 9.0, which tensorrt_rtx 1.7 cannot"):
        api.resolve_archs("native")


# --------------------------------------------------------------------------- libtensorrt_rtx.so
def _run(code: str, **env):
    import os

    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_elf_shim_layout():
    data = libfix.elf_shim("libx.so", "/abs/libx.so.1", 62)
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1
    e_type, e_machine = struct.unpack_from("<HH", data, 16)
    phoff, phnum = struct.unpack_from("<Q", data, 32)[0], struct.unpack_from("<H", data, 56)[0]
    assert (e_type, e_machine, phoff, phnum) == (3, 62, 64, 3)
    types = [struct.unpack_from("<I", data, 64 + 56 * i)[0] for i in range(3)]
    assert types == [1, 2, 0x6474E551]  # PT_LOAD, PT_DYNAMIC, PT_GNU_STACK
    assert b"\0/abs/libx.so.1\0libx.so\0" in data


def test_elf_shim_is_found_by_soname_and_forwards_symbols(tmp_path):
    """The mechanism on any glibc: a shim named by SONAME answers dlopen(soname), and dlsym through
    its handle reaches its dependency (here libc for strlen).  In a subprocess: nothing stays loaded."""
    out = _run(f"""
        import ctypes, struct
        from mtp_trt.trt.libfix import elf_shim
        machine = struct.unpack_from("<H", open("/proc/self/exe", "rb").read(20), 18)[0]
        p = "{tmp_path}/shim.so"
        open(p, "wb").write(elf_shim("libmtp-shim-test.so", "libc.so.6", machine))
        ctypes.CDLL(p)
        h = ctypes.CDLL("libmtp-shim-test.so")  # by SONAME only: no such file on any search path
        print(h.strlen(b"hello"))
    """)
    assert out.strip() == "5"


def _fake_libdir(tmp_path):
    """A folder with a loadable stand-in for libtensorrt_rtx.so.1 (itself a shim onto libc)."""
    machine = struct.unpack_from("<H", open("/proc/self/exe", "rb").read(20), 18)[0]
    libdir = tmp_path / "tensorrt_rtx_libs"
    libdir.mkdir()
    (libdir / "libtensorrt_rtx.so.1").write_bytes(libfix.elf_shim("libtensorrt_rtx.so.1", "libc.so.6", machine))
    return libdir


def test_rtx_libfix_shim_in_cache_dir(tmp_path):
    libdir = _fake_libdir(tmp_path)
    out = _run(f"""
        import ctypes
        from mtp_trt.trt.libfix import ensure_unversioned_rtx_library
        print(ensure_unversioned_rtx_library("{libdir}"))
        print(ctypes.CDLL("libtensorrt_rtx.so").strlen(b"abc"))
    """, MTP_TRT_CACHE_DIR=str(tmp_path / "cache"))
    how, n = out.split("\n")[:2]
    assert how.startswith(f"shim {tmp_path / 'cache' / 'trt'}") and n == "3"
    assert not (libdir / "libtensorrt_rtx.so").exists()  # the installation is left as it was


def test_rtx_libfix_symlink_and_present(tmp_path):
    libdir = _fake_libdir(tmp_path)
    out = _run(f"""
        from mtp_trt.trt.libfix import ensure_unversioned_rtx_library
        print(ensure_unversioned_rtx_library("{libdir}"))
    """, MTP_TRT_RTX_LIBFIX="symlink")
    assert out.strip() == f"symlink {libdir / 'libtensorrt_rtx.so'}"
    assert (libdir / "libtensorrt_rtx.so").resolve() == (libdir / "libtensorrt_rtx.so.1").resolve()
    assert libfix.ensure_unversioned_rtx_library(libdir) == "present"


def test_rtx_libfix_failure_is_one_clear_error(tmp_path, monkeypatch):
    libdir = _fake_libdir(tmp_path)
    monkeypatch.setenv("MTP_TRT_RTX_LIBFIX", "symlink")
    monkeypatch.setattr(libfix.os, "symlink", lambda *a: (_ for _ in ()).throw(PermissionError("read-only")))
    with pytest.raises(MtpTrtError, match=r"needs .*libtensorrt_rtx.so.*read-only.*ln -s"):
        libfix.ensure_unversioned_rtx_library(libdir)
    monkeypatch.setenv("MTP_TRT_RTX_LIBFIX", "bogus")
    libfix._done.clear()
    with pytest.raises(MtpTrtError, match="MTP_TRT_RTX_LIBFIX"):
        libfix.ensure_unversioned_rtx_library(libdir)


# ----------------------------------------------------------------------------- plugin arithmetic
def test_workspace_bound_covers_every_shape_of_the_profile():
    H, Dl, T = 16, 512, 4096
    bound = tp.mla_workspace_bound((1, 8), (1, 64), H, Dl, T)
    for b in range(1, 9):
        for s in range(1, 65):
            for t in (1, 128, 1000, T):  # enqueue caps its parts at splits_bound(B, S, H, T)
                assert tp.mla_workspace_size(b, s, H, Dl, tp.mla_splits_bound(b, s, H, t)) <= bound
    assert bound <= 64 << 20  # tens of MiB, not B*S*H*256 rows


def test_plugins_import_without_gpu_or_tensorrt():
    out = _run("""
        import sys
        import mtp_trt.plugins.trt_plugins, mtp_trt.trt.builder, mtp_trt.trt.check, mtp_trt.trt.compat
        print(sorted(m for m in sys.modules if m.startswith(("tensorrt", "mtp_trt.plugins.cuda_lib"))))
    """)
    assert out.strip() == "[]"


@pytest.mark.parametrize("flavour,version,ok", [("tensorrt", "10.3.0", True), ("tensorrt", "10.9.0.34", True),
                                                ("tensorrt", "11.1.0", True), ("tensorrt", "10.2.0", False),
                                                ("tensorrt", "8.6.1", False), ("tensorrt", "12.0.0", False),
                                                ("tensorrt_rtx", "1.7.1.116", True), ("tensorrt_rtx", "2.0", False)])
def test_supported_tensorrt_range_is_checked_at_load(fresh_load, monkeypatch, flavour, version, ok):
    """An installed TensorRT outside the supported range is one line naming the range, at load."""
    mod = type(sys)(flavour)
    mod.Builder, mod.OnnxParser, mod.__version__ = object, object, version
    monkeypatch.setitem(sys.modules, flavour, mod)
    monkeypatch.setattr(compat.importlib.util, "find_spec", lambda n, *a: object() if n == flavour else None)
    monkeypatch.setattr(compat, "_rtx_libdir", lambda: None)
    monkeypatch.setattr(compat, "gpu", lambda: ("9.0", ""))
    if ok:
        assert compat.load(flavour).version == version
    else:
        with pytest.raises(MtpTrtError, match=rf"{flavour} {version} is not supported: mtp-trt runs {flavour} "
                                              rf"(10\.3 to 11|1\.0 to 1)\.x") as e:
            compat.load(flavour)
        assert "\n" not in str(e.value)
