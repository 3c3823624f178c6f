"""The CPU operators' kernels (plugins/ort/kernels.cpp) on ARM64, through tests/cpp/kernels_driver.cpp built for
aarch64 and run under qemu-user -- one emulated CPU per instruction set: cortex-a53 (plain NEON), cortex-a76
(NEON with SDOT), `max` (SDOT and SMMLA), and the scalar path (MTP_TRT_CPU_ISA=scalar).  On an ARM64 machine the
driver runs natively, and each path the CPU lacks is skipped.

Each call's inputs go through every path, compared with:
* NumPy references, independent of the C++: the quantized products against ort_reference.qmatmul (the exact
  integer products, scales in float64) to 1e-5 of the output's largest magnitude, their int8 activations against
  ort_reference.quantize_activations byte for byte; the float kernels against float64 formulas (1e-5);
* the x86 build of the same driver on the same inputs (on an x86 host): the activation bytes equal, the products
  within the same tolerance;
* each other: the three NEON paths' quantized products are the same bits (their integer sums are exact and
  their float operations the same), and a call's rows have the same bits whether they come together or alone.

The slow tests also run the operator tests themselves (tests/test_ort_ops.py, test_ort_quant_ops.py,
test_ort_dsa.py) in ONNX Runtime's aarch64 build under qemu, on each path, with the shipped ARM64 library
(tests/qemu_arm64.py; skipped until `python tests/qemu_arm64.py setup` has made the aarch64 Python environment),
and `mtp-trt run` there on int8 and int4 exports of the demo made here: the same text as the x86 run.

The default run takes blocks of 16 and 32 (a row's last chunk cut short, and the common case); `-m slow` the
other block sizes.  Skipped, with the reason, where the cross compiler (aarch64-linux-gnu-g++, or $MTP_TRT_AARCH64_CXX) or
qemu-aarch64 is absent (Debian: apt-get install g++-aarch64-linux-gnu qemu-user)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mtp_trt.plugins import ort_reference as ref

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "plugins" / "ort"
DRIVER = ROOT / "tests" / "cpp" / "kernels_driver.cpp"
NATIVE_ARM = platform.machine() in ("aarch64", "arm64")
CROSS = os.environ.get("MTP_TRT_AARCH64_CXX") or shutil.which("aarch64-linux-gnu-g++")
QEMU = shutil.which("qemu-aarch64")
HOST_CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
CLANG = shutil.which("clang++") or next(iter(sorted(Path("/usr/bin").glob("clang++-[0-9]*"), reverse=True)), None)


def _why_not() -> str | None:
    if NATIVE_ARM:
        return None if HOST_CXX else "no C++ compiler (g++ or clang++; or set CXX)"
    if not CROSS:
        return "no aarch64 cross compiler (aarch64-linux-gnu-g++, or set MTP_TRT_AARCH64_CXX)"
    if not QEMU:
        return "no qemu-aarch64 (Debian: apt-get install qemu-user)"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=f"ARM64 kernels: {_why_not()}")

# path name -> (the emulated CPU, the environment that selects the path on it; the others are the CPU's best)
PATHS = {
    "scalar": ("max", {"MTP_TRT_CPU_ISA": "scalar"}),
    "neon": ("cortex-a53", {}),
    "neon-dotprod": ("cortex-a76", {}),
    "neon-i8mm": ("max", {}),
}
FORCED = {name: {"MTP_TRT_CPU_ISA": name} for name in ("neon", "neon-dotprod")}  # on a native CPU
NEON = ("neon", "neon-dotprod", "neon-i8mm")
TOL = 1e-5


def _compile(cxx: str, out: Path, *extra: str, warnings: bool = True) -> Path:
    """The driver and kernels.cpp; the ARM build with -Wall and no warning (GCC's own x86 intrinsics headers warn
    under -Wall, so the x86 build is compiled without it)."""
    cmd = [cxx, "-O3", "-std=c++17", *(["-Wall", "-Wextra"] if warnings else []), *extra, f"-I{KERNELS}", str(DRIVER),
           str(KERNELS / "kernels.cpp"), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-4000:]}"
    assert not warnings or "warning" not in proc.stderr, proc.stderr
    return out


@pytest.fixture(scope="module")
def drivers(tmp_path_factory):
    """{"arm": the aarch64 driver (GCC's), "x86": the host's (None on ARM), "arm-clang": the aarch64 driver built
    by clang (None where there is none)}."""
    d = tmp_path_factory.mktemp("arm64")
    if NATIVE_ARM:
        return {"arm": _compile(HOST_CXX, d / "driver-arm"), "x86": None,
                "arm-clang": _compile(CLANG, d / "driver-clang") if CLANG and CLANG != HOST_CXX else None}
    arm = _compile(CROSS, d / "driver-arm", "-static")  # (runs under qemu without an aarch64 sysroot)
    x86 = _compile(HOST_CXX, d / "driver-x86", warnings=False) if HOST_CXX and platform.machine() == "x86_64" else None
    clang = _compile(CLANG, d / "driver-clang", "--target=aarch64-linux-gnu", "-static") if CLANG else None
    return {"arm": arm, "x86": x86, "arm-clang": clang}


def _command(drivers, path: str | None, build: str = "arm") -> tuple[list[str], dict]:
    """The argv prefix and environment that run the driver `build` on `path` (None: the x86 build, natively)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTP_ORT_") and k != "MTP_TRT_CPU_ISA"}
    if path is None:
        return [str(drivers["x86"])], env
    cpu, extra = PATHS[path]
    if NATIVE_ARM:
        return [str(drivers[build])], env | extra | FORCED.get(path, {})
    return [QEMU, "-cpu", cpu, str(drivers[build])], env | extra


@pytest.fixture(scope="module")
def paths(drivers):
    """The ARM paths this machine can run (all of them under qemu), each checked to be the one its CPU reports."""
    usable = []
    for name in PATHS:
        argv, env = _command(drivers, name)
        out = subprocess.run([*argv, "paths"], capture_output=True, text=True, env=env, check=True).stdout.split()
        if NATIVE_ARM and out[0] != name:
            continue  # this CPU lacks it
        assert out == [name, "scalar" if name == "scalar" else "neon"], (name, out)
        usable.append(name)
    return usable


@pytest.mark.skipif(NATIVE_ARM, reason="needs qemu's emulated CPUs")
@pytest.mark.parametrize("want", ["neon-i8mm", "neon-dotprod", "neon", "scalar"])
def test_cpu_isa_selects_the_path(drivers, want):
    """On a CPU with SMMLA and SDOT (qemu's max), MTP_TRT_CPU_ISA selects each ARM64 set."""
    argv, base = _command(drivers, "neon-i8mm")
    out = subprocess.run([*argv, "paths"], capture_output=True, text=True, env=base | {"MTP_TRT_CPU_ISA": want},
                         check=True).stdout.split()
    assert out == [want, "scalar" if want == "scalar" else "neon"]


@pytest.mark.skipif(NATIVE_ARM, reason="needs qemu's emulated CPUs")
@pytest.mark.parametrize("cpu,value,why", [
    ("cortex-a53", "neon-dotprod", "this CPU lacks that instruction set (it has neon)"),
    ("cortex-a76", "neon-i8mm", "this CPU lacks that instruction set (it has neon-dotprod)"),
    ("max", "avx2", "this CPU lacks that instruction set (it has neon-i8mm)"),
    ("max", "sse", "is not an instruction set of mtp-trt's CPU kernels (scalar, avx2, avx-vnni, avx512-vnni, neon, "
                   "neon-dotprod, neon-i8mm)")])
def test_cpu_isa_refused_in_one_line(drivers, cpu, value, why):
    """A set the emulated CPU lacks (or another architecture's, or no set at all): one line naming the variable."""
    argv, env = _command(drivers, "neon")
    argv[argv.index("cortex-a53")] = cpu
    proc = subprocess.run([*argv, "paths"], capture_output=True, text=True, env=env | {"MTP_TRT_CPU_ISA": value})
    assert proc.returncode == 2 and not proc.stdout
    assert proc.stderr == f"kernels_driver: MTP_TRT_CPU_ISA={value}{':' if 'lacks' in why else ''} {why}\n"


def call(drivers, path, tmp_path, op, params, *arrays, build="arm") -> np.ndarray:
    """The driver's output bytes for one op on one path (None: the x86 build)."""
    head = np.zeros(8, np.int64)
    head[:len(params)] = params
    src, dst = tmp_path / f"{op}.in", tmp_path / f"{op}-{path}-{build}.out"
    src.write_bytes(head.tobytes() + b"".join(np.ascontiguousarray(a).tobytes() for a in arrays))
    argv, env = _command(drivers, path, build)
    proc = subprocess.run([*argv, op, str(src), str(dst)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    return np.frombuffer(dst.read_bytes(), np.uint8)


def close(got, want, tol=TOL):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    assert err <= tol, f"relative error {err:.3g} > {tol}"


# ----------------------------------------------------------------------------------- quantized products
def weight(rng, n, k, bits, block, half):
    """(data, scales) of a [N, K] weight in mtp_trt.quant's format: bytes over their whole range, row 0's first block
    at the lowest level and row 1's at the highest (the largest integer products), scales of both signs."""
    nb = -(-k // block)
    data = rng.integers(0, 256, (n, nb, block * bits // 8), dtype=np.uint8)
    data[0, 0], data[1, 0] = 0, 255
    scales = (rng.uniform(-1, 1, (n, nb)) / np.sqrt(k)).astype(np.float16 if half else np.float32)
    return data, scales


def activations(rng, m, k):
    """x [M, K]: row 1 starts with a zero block, row 2 with a constant one (q = 127), row 3 tiny."""
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[1, :32], x[2, :32] = 0, 3
    x[3] *= 1e-30
    return x


def activation_levels(qx, m, k_padded, bits):
    """The int8 levels q [M, K32] of the driver's quantized rows, in x's order (kernels.cpp QAct: groups of 128
    values; 4 bits: a group's even elements block by block, then its odd ones)."""
    k32 = -(-k_padded // 32) * 32
    groups = -(-k32 // 128)
    q = qx.reshape(m, -1)[:, :128 * groups].view(np.int8).reshape(m, groups, 128)
    if bits == 4:  # [half (even, odd), block in group, 16] -> [block, 16, half] -> x's order
        q = q.reshape(m, groups, 2, 4, 16).transpose(0, 1, 3, 4, 2).reshape(m, groups, 128)
    return q.reshape(m, -1)[:, :k32]


BLOCK_K = {16: 291, 32: 301, 64: 300, 128: 389, 256: 773}  # a few blocks, the last one partial (16: an odd count)


@pytest.mark.parametrize("half", [True, False], ids=["f16", "f32"])
@pytest.mark.parametrize("block", [16, 32, *(pytest.param(b, marks=pytest.mark.slow) for b in (64, 128, 256))])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_products(drivers, paths, tmp_path, bits, block, half):
    """7 activation rows (tiles of 2 and one left) by 11 weight rows (tiles of 4, of 2 and one left)."""
    m, n, k = 7, 11, BLOCK_K[block]
    rng = np.random.default_rng([bits, block, half])
    x = activations(rng, m, k)
    data, scales = weight(rng, n, k, bits, block, half)
    params, arrays = (bits, block, int(half), m, n, k), (x, data, scales)
    kp = data.shape[1] * block
    want = ref.qmatmul(x, data, scales.astype(np.float32), k=k, bits=bits, block_size=block)
    want_q = ref.quantize_activations(x, kp)[0]

    qbytes, ys = {}, {}
    for path in paths:
        qbytes[path] = call(drivers, path, tmp_path, "quantize", params, *arrays)
        np.testing.assert_array_equal(activation_levels(qbytes[path], m, kp, bits), want_q, err_msg=path)
        y = call(drivers, path, tmp_path, "qdot", params, *arrays).view(np.float32).reshape(2, m, n)
        np.testing.assert_array_equal(y[0], y[1], err_msg=f"{path}: rows together and alone")
        close(y[0], want)
        ys[path] = y[0]
    for path in paths:  # the same activation bytes (levels, scales, corrections) on every path
        np.testing.assert_array_equal(qbytes[path], qbytes[paths[0]], err_msg=path)
    neon = [p for p in paths if p in NEON]
    for path in neon[1:]:
        np.testing.assert_array_equal(ys[path], ys[neon[0]], err_msg=f"{path} and {neon[0]}")
    if drivers["x86"] is not None:
        np.testing.assert_array_equal(call(drivers, None, tmp_path, "quantize", params, *arrays), qbytes[paths[0]])
        y86 = call(drivers, None, tmp_path, "qdot", params, *arrays).view(np.float32).reshape(2, m, n)[0]
        for path in paths:
            close(ys[path], y86)


@pytest.mark.parametrize("bits,block", [(4, 16), (8, 32), (4, 128)])
def test_clang_build_gives_the_same_products(drivers, paths, tmp_path, bits, block):
    """The kernels built by clang (whose older versions need SDOT and SMMLA written out): the same activation bytes
    and the same bits of the quantized products as GCC's build, on every path."""
    if drivers["arm-clang"] is None:
        pytest.skip("no clang++")
    m, n, k = 5, 7, BLOCK_K[block]
    rng = np.random.default_rng([bits, block, 1])
    x = activations(rng, m, k)
    params, arrays = (bits, block, 1, m, n, k), (x, *weight(rng, n, k, bits, block, True))
    for path in paths:
        for op in ("quantize", "qdot"):
            np.testing.assert_array_equal(call(drivers, path, tmp_path, op, params, *arrays, build="arm-clang"),
                                          call(drivers, path, tmp_path, op, params, *arrays), err_msg=f"{path} {op}")


# ---------------------------------------------------------------------------------------- float kernels
def every_path(drivers, paths, tmp_path, op, params, *arrays, want, tol=TOL):
    """The op's float32 output on every ARM path (and the x86 build), each against `want` and the scalar one."""
    outs = {p: call(drivers, p, tmp_path, op, params, *arrays).view(np.float32) for p in paths}
    if drivers["x86"] is not None:
        outs["x86"] = call(drivers, None, tmp_path, op, params, *arrays).view(np.float32)
    for path, got in outs.items():
        close(got.reshape(want.shape), want, tol)
        close(got, outs[paths[0]], tol)
    return outs


@pytest.mark.parametrize("m,n,k", [(1, 13, 37), (3, 9, 64), (5, 6, 7)])
def test_rows_dot(drivers, paths, tmp_path, m, n, k):
    rng = np.random.default_rng([m, n, k])
    x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((n, k), np.float32)
    every_path(drivers, paths, tmp_path, "rows_dot", (m, n, k), x, w, want=x.astype(np.float64) @ w.T)


@pytest.mark.parametrize("m,n,dv", [(1, 5, 16), (3, 7, 37)])
def test_rows_axpy(drivers, paths, tmp_path, m, n, dv):
    rng = np.random.default_rng([m, n, dv])
    p, v, y = (rng.standard_normal(s, np.float32) for s in ((m, n), (n, dv), (m, dv)))
    every_path(drivers, paths, tmp_path, "rows_axpy", (m, n, dv), p, v, y,
               want=y + p.astype(np.float64) @ v.astype(np.float64))


def test_attention(drivers, paths, tmp_path):
    """Absorbed MLA for one token over cached rows and new rows, some hidden: softmax(scale q.k) v in float64."""
    heads, c, dl, n_cache, n_rows, scale = 4, 40, 32, 19, 5, 0.2
    rng = np.random.default_rng(7)
    q = rng.standard_normal((heads, c), np.float32)
    cache, rows = rng.standard_normal((n_cache, c), np.float32), rng.standard_normal((n_rows, c), np.float32)
    visible = np.array([1, 0, 1, 1, 0], np.uint8)
    keys = np.concatenate([cache, rows[visible == 1]]).astype(np.float64)
    s = scale * q.astype(np.float64) @ keys.T
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ keys[:, :dl]
    every_path(drivers, paths, tmp_path, "attend", (heads, c, dl, n_cache, n_rows), np.float32(scale), q, cache, rows,
               visible, want=want)


def test_swiglu(drivers, paths, tmp_path):
    m, units = 3, 21
    h = (3 * np.random.default_rng(3).standard_normal((m, 2 * units))).astype(np.float32)
    g, u = h[:, 0::2].astype(np.float64), h[:, 1::2].astype(np.float64)
    every_path(drivers, paths, tmp_path, "swiglu", (m, units), h, want=g / (1 + np.exp(-g)) * u)


@pytest.mark.parametrize("heads,di", [(8, 64), (3, 20)])
def test_index_scores(drivers, paths, tmp_path, heads, di):
    n, scale = 29, 0.125
    rng = np.random.default_rng([heads, di])
    q, w, keys = (rng.standard_normal(s, np.float32) for s in ((heads, di), (heads,), (n, di)))
    want = ref.index_scores(q.reshape(-1), w, keys, heads=heads, scale=scale)
    every_path(drivers, paths, tmp_path, "index", (heads, di, n), np.float32(scale), q, w, keys, want=want)


# ------------------------------------------------------------------------ the operators in ONNX Runtime
def qemu_env():
    """tests/qemu_arm64.py, where its aarch64 Python environment is ready and MTP_TRT_TEST_QEMU=1 asks for these
    runs (minutes each, so kept out of the README's test commands and CI); else the test skips, saying why."""
    if os.environ.get("MTP_TRT_TEST_QEMU") != "1":
        pytest.skip("ONNX Runtime under qemu takes minutes a run: set MTP_TRT_TEST_QEMU=1 to run it")
    sys.path.insert(0, str(Path(__file__).parent))
    import qemu_arm64

    why = qemu_arm64.ready()
    if why:
        pytest.skip(why)
    return qemu_arm64


@pytest.mark.slow
@pytest.mark.skipif(NATIVE_ARM, reason="on an ARM64 machine the operator tests run natively")
@pytest.mark.parametrize("path", list(PATHS))
def test_operator_tests_under_qemu(path):
    """ONNX Runtime's aarch64 wheel with plugins/prebuilt/libmtp_ort_ops-aarch64.so: the operator tests on `path`'s
    emulated CPU (the library reports the path first)."""
    qemu_arm64 = qemu_env()
    proc = subprocess.run([sys.executable, qemu_arm64.__file__, "run", "--path", path], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"== {path} (libmtp_ort_ops-aarch64.so on qemu" in proc.stdout and " passed" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(NATIVE_ARM, reason="compares an x86 run with an emulated ARM one")
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_demo_decodes_the_same_text_on_arm(tmp_path, quant):
    """The demo checkpoint exported here (--quant, mtp-trt's operators), then `mtp-trt run` on it under qemu with the
    ARM64 library: greedy MTP on neon-i8mm and neon, and plain greedy decoding (--nextn 0) on neon-dotprod, each
    give the text of the x86 run."""
    qemu_arm64 = qemu_env()
    pytest.importorskip("torch", reason="the export needs torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTP_ORT_") and k != "MTP_TRT_CPU_ISA"} | {
        "MTP_TRT_CACHE_DIR": str(tmp_path / "cache")}
    export = tmp_path / "export"
    proc = subprocess.run([sys.executable, "-m", "mtp_trt.cli", "export", "-o", str(export), "--quant", quant],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = ["-m", "mtp_trt.cli", "run", str(export), "-p", "def read_lines(path):", "--max-new-tokens", "40"]
    x86 = subprocess.run([sys.executable, *run], capture_output=True, text=True, cwd=ROOT, env=env)
    assert x86.returncode == 0 and "40 new tokens" in x86.stderr, x86.stderr[-3000:]
    for path, extra in (("neon-i8mm", []), ("neon", []), ("neon-dotprod", ["--nextn", "0"])):
        argv, arm_env = qemu_arm64.command(path, *run, *extra)
        arm = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT,
                             env=arm_env | {"MTP_TRT_CACHE_DIR": str(tmp_path / "cache-arm")})
        assert arm.returncode == 0, arm.stderr[-3000:]
        assert arm.stdout == x86.stdout, (path, extra, arm.stdout, x86.stdout)
