"""plugins/kernels/hopper.cuh, the sm_90a building blocks of MLA decode v3: warpgroup MMA (wgmma) on operands in
shared memory addressed by descriptors in the 128-byte swizzle, through tests/kernels/hopper_probe.cu.

* under the host emulation (tests/kernels/emu/emu_hopper.h, the PTX ISA's layouts): the product equals a plain
  matrix product (K-major and MN-major B, fp16 and bf16, one to nine 64-wide slices), and an operand overwritten
  before the wait changes the result (the emulation runs wgmma when its group is waited for);
* TMA: a 3-D box lands 128-byte swizzled as the emulation assumes (inside the tensor, and zero-filled past its
  rows, columns and matrices), landing at issue and at the wait;
* cp.async onto an mbarrier (v3's sparse tiles): rows gathered by a list (-1: zeros) into the swizzled K-major
  layout and multiplied by wgmma equal the plain product, landing at issue and at the wait; a wgmma issued without
  waiting for the barrier, or without fence.proxy.async after the wait, aborts the emulation;
* nvcc for sm_90a: the probe assembles to HGMMA, with no spill;
* on a Hopper GPU (marker gpu): the same probe against the same plain product -- the check of the emulation's
  layouts against the hardware."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from mtp_trt.fsutil import cache_dir
from mtp_trt.plugins import cuda_lib
from mtp_trt.plugins import reference as ref

from .emu import build as emu_build

PROBE = Path(__file__).resolve().parent / "hopper_probe.cu"
CODES = {"float16": 1, "bfloat16": 2}


def storage(x, dtype):
    """(storage bits as uint16, the values they hold as float64)."""
    if dtype == "float16":
        h = x.astype(np.float16)
        return h.view(np.uint16), h.astype(np.float64)
    bits = ref.f32_to_bf16_bits(x.astype(np.float32))
    return bits, ref.bf16_bits_to_f32(bits).astype(np.float64)


def probe_case(call, *, K, trans_b, dtype, seed=0, overwrite=0):
    """Run the probe through `call(dtype_code, a_ptr, b_ptr, d_ptr, K, trans_b, overwrite)` on random data, ->
    (got [64, 64], want [64, 64])."""
    rng = np.random.default_rng(seed)
    a_s, a = storage(rng.standard_normal((64, K)), dtype)
    b_s, b = storage(rng.standard_normal((K, 64) if trans_b else (64, K)), dtype)
    want = a @ (b if trans_b else b.T)
    got = call(CODES[dtype], a_s, b_s, K, trans_b, overwrite)
    return got, want


TMA_ARGS = [ctypes.c_void_p] + [ctypes.c_int] * 8 + [ctypes.c_void_p, ctypes.c_void_p]
# (x, y, z) of boxes of 64 values x 64 rows in a [3][100][704] tensor: inside, past the last rows (zeros), past the
# last columns (zeros), the last matrix
TMA_BOXES = [(0, 0, 0), (128, 40, 1), (672, 70, 2), (640, 0, 2)]


def tma_case(call, x, y, z, seed=0):
    """A [3][100][704] tensor of random 16-bit values; the box at (x, y, z) through `call(tensor, x, y, z) -> [64][64]`
    against the slice, zeros outside the tensor."""
    rng = np.random.default_rng(seed)
    t = rng.integers(0, 1 << 16, (3, 100, 704), dtype=np.uint16)
    want = np.zeros((64, 64), np.uint16)
    part = t[z, y:y + 64, x:x + 64]
    want[:part.shape[0], :part.shape[1]] = part
    return call(t, x, y, z), want


GATHER_ARGS = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
               ctypes.c_int, ctypes.c_void_p]


def gather_case(call, *, K, dtype, seed=0, skip=0):
    """A [64, K] times 64 rows of b [100, K] picked by a list with -1 slots (zero rows), through
    `call(dtype_code, a, b, sel, K, skip) -> [64, 64]`: (got, want)."""
    rng = np.random.default_rng(seed)
    a_s, a = storage(rng.standard_normal((64, K)), dtype)
    b_s, b = storage(rng.standard_normal((100, K)), dtype)
    sel = rng.permutation(100)[:64].astype(np.int32)
    sel[[3, 17, 40, 63]] = -1
    b_sel = np.zeros((64, K))
    b_sel[sel >= 0] = b[sel[sel >= 0]]
    return call(CODES[dtype], a_s, b_s, sel, K, skip), a @ b_sel.T


@pytest.fixture(scope="module")
def emu_lib_probe():
    if (why := emu_build.unavailable_reason()) is not None:
        pytest.skip(f"kernel emulation: {why}")
    return ctypes.CDLL(str(emu_build.build_emulated_library(cache_dir("emu"), [PROBE], "libmtp_hopper_probe")))


@pytest.fixture(scope="module")
def emu_tma(emu_lib_probe):
    fn = emu_lib_probe.mtp_probe_tma
    fn.restype, fn.argtypes = ctypes.c_int, TMA_ARGS

    def call(t, x, y, z):
        out = np.full((64, 64), 0xFFFF, np.uint16)
        assert fn(t.ctypes.data, t.shape[2], t.shape[1], t.shape[0], t.shape[2] * 2, 64, x, y, z, out.ctypes.data,
                  None) == 0
        return out

    return call


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["immediate", "deferred"])
@pytest.mark.parametrize("box", TMA_BOXES, ids=["inside", "past-rows", "past-cols-and-rows", "last-matrix-last-cols"])
def test_emulated_tma_box_is_the_slice(emu_tma, monkeypatch, box, mode):
    monkeypatch.setenv("MTP_EMU_TMA", mode)
    got, want = tma_case(emu_tma, *box)
    assert np.array_equal(got, want)


@pytest.fixture(scope="module")
def emu_probe(emu_lib_probe):
    fn = emu_lib_probe.mtp_probe_wgmma
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int, ctypes.c_void_p]

    def call(code, a, b, K, trans_b, overwrite):
        d = np.full((64, 64), np.nan, np.float32)
        a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
        err = fn(code, a.ctypes.data, b.ctypes.data, d.ctypes.data, K, trans_b, overwrite, None)
        assert err == 0, f"mtp_probe_wgmma: error {err}"
        return d

    return call


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("trans_b", [0, 1], ids=["B-K-major", "B-MN-major"])
@pytest.mark.parametrize("K", [64, 576])
def test_emulated_wgmma_is_a_matrix_product(emu_probe, dtype, trans_b, K):
    """fp32 accumulation of exact products of 16-bit values: within 8e-5 sqrt(K) (the size of a . b for N(0, 1)
    rows) of the float64 product."""
    got, want = probe_case(emu_probe, K=K, trans_b=trans_b, dtype=dtype, seed=K + trans_b)
    assert not np.isnan(got).any()
    assert np.max(np.abs(got - want)) <= 1e-5 * np.sqrt(K) * 8, np.max(np.abs(got - want))  # |a . b| ~ sqrt(K)


def wide_case(call, *, dtype, seed=0):
    """A [64, 64] times B [64, 256] (MN-major: the seesaw's P . V as m64n256k16) through `call(dtype_code, a, b) ->
    [64, 256]`: (got, want)."""
    rng = np.random.default_rng(seed)
    a_s, a = storage(rng.standard_normal((64, 64)), dtype)
    b_s, b = storage(rng.standard_normal((64, 256)), dtype)
    return call(CODES[dtype], a_s, b_s), a @ b


WIDE_ARGS = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]


@pytest.fixture(scope="module")
def emu_wide(emu_lib_probe):
    fn = emu_lib_probe.mtp_probe_wgmma256
    fn.restype, fn.argtypes = ctypes.c_int, WIDE_ARGS

    def call(code, a, b):
        d = np.full((64, 256), np.nan, np.float32)
        a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
        assert fn(code, a.ctypes.data, b.ctypes.data, d.ctypes.data, None) == 0
        return d

    return call


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_emulated_wgmma256_is_a_matrix_product(emu_wide, dtype):
    got, want = wide_case(emu_wide, dtype=dtype, seed=3)
    assert not np.isnan(got).any()
    assert np.max(np.abs(got - want)) <= 1e-5 * 8 * 8, np.max(np.abs(got - want))  # K = 64: |a . b| ~ 8


@pytest.fixture(scope="module")
def emu_gather(emu_lib_probe):
    fn = emu_lib_probe.mtp_probe_gather
    fn.restype, fn.argtypes = ctypes.c_int, GATHER_ARGS

    def call(code, a, b, sel, K, skip):
        d = np.full((64, 64), np.nan, np.float32)
        a, b, sel = np.ascontiguousarray(a), np.ascontiguousarray(b), np.ascontiguousarray(sel)
        assert fn(code, a.ctypes.data, b.ctypes.data, sel.ctypes.data, d.ctypes.data, K, skip, None) == 0
        return d

    return call


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["immediate", "deferred"])
@pytest.mark.parametrize("dtype,K", [("bfloat16", 576), ("float16", 64)])
def test_emulated_cp_async_gather_onto_an_mbarrier(emu_gather, monkeypatch, mode, dtype, K):
    monkeypatch.setenv("MTP_EMU_TMA", mode)
    got, want = gather_case(emu_gather, K=K, dtype=dtype, seed=K)
    assert np.max(np.abs(got - want)) <= 1e-5 * np.sqrt(K) * 8, np.max(np.abs(got - want))


@pytest.mark.slow
@pytest.mark.parametrize("skip,message", [(1, "before its issuing thread waited"), (2, "without fence.proxy.async")],
                         ids=["no-wait", "no-fence"])
def test_emulation_refuses_wgmma_on_unwaited_or_unfenced_cp_async_data(emu_lib_probe, skip, message):
    """The emulation aborts (so the process, here a child) where wgmma reads cp.async data its thread has not waited
    for on the mbarrier, or reads it without fence.proxy.async after the wait."""
    import sys

    code = (f"import ctypes, numpy as np\n"
            f"from tests.kernels.test_hopper import GATHER_ARGS, gather_case\n"
            f"fn = ctypes.CDLL({emu_lib_probe._name!r}).mtp_probe_gather\n"
            f"fn.restype, fn.argtypes = ctypes.c_int, GATHER_ARGS\n"
            f"def call(code, a, b, sel, K, skip):\n"
            f"    d = np.zeros((64, 64), np.float32)\n"
            f"    fn(code, a.ctypes.data, b.ctypes.data, sel.ctypes.data, d.ctypes.data, K, skip, None)\n"
            f"    return d\n"
            f"gather_case(call, K=64, dtype='bfloat16', skip={skip})\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_emulated_wgmma_reads_its_operands_at_the_wait(emu_probe):
    """An operand overwritten between issue and wait changes the product under the emulation: a kernel that reuses
    a stage before waiting for the wgmma that reads it fails the emulated tests."""
    got, want = probe_case(emu_probe, K=128, trans_b=0, dtype="bfloat16", overwrite=1)
    assert np.all(got == 0) and np.abs(want).max() > 1


def nvcc_probe(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    nvcc = cuda_lib.find_nvcc()
    cmd = [str(nvcc), "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-gencode=arch=compute_90a,code=sm_90a",
           "-I", str(cuda_lib.KERNEL_DIR), *flags, str(PROBE)]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, check=False)


def find_cuobjdump() -> str | None:
    """$CUOBJDUMP, else cuobjdump on PATH or beside nvcc."""
    import os

    if (env := os.environ.get("CUOBJDUMP")) and Path(env).is_file():
        return env
    nvcc = cuda_lib.find_nvcc()
    beside = Path(os.path.realpath(nvcc)).with_name("cuobjdump") if nvcc else None
    return shutil.which("cuobjdump") or (str(beside) if beside and beside.is_file() else None)


@pytest.mark.slow
@pytest.mark.skipif(cuda_lib.find_nvcc() is None, reason="nvcc not found")
def test_probe_builds_for_sm90a_without_spills(tmp_path):
    proc = nvcc_probe(tmp_path, "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "probe.cubin"))
    assert proc.returncode == 0, proc.stderr
    spills = [ln for ln in proc.stderr.splitlines() if "bytes spill" in ln]
    assert len(spills) == 9 and all(ln.strip().startswith("0 bytes stack frame, 0 bytes spill stores") for ln in spills)
    ptx = nvcc_probe(tmp_path, "-ptx", "-o", str(tmp_path / "probe.ptx"))
    assert ptx.returncode == 0, ptx.stderr
    text = (tmp_path / "probe.ptx").read_text()
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in text and "fence.proxy.async" in text
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16" in text


@pytest.mark.slow
@pytest.mark.skipif(cuda_lib.find_nvcc() is None, reason="nvcc not found")
def test_probe_sass_has_hgmma(tmp_path):
    if (cuobjdump := find_cuobjdump()) is None:
        pytest.skip("cuobjdump not found (set CUOBJDUMP; pip's nvidia-cuda-cuobjdump carries one)")
    proc = nvcc_probe(tmp_path, "-cubin", "-o", str(tmp_path / "probe.cubin"))
    assert proc.returncode == 0, proc.stderr
    sass = subprocess.run([cuobjdump, "-sass", str(tmp_path / "probe.cubin")], capture_output=True, text=True)
    assert sass.returncode == 0, sass.stderr
    assert sass.stdout.count("HGMMA.64x64x16") >= 4, sass.stdout[-3000:]  # both dtypes x both layouts


@pytest.fixture(scope="module")
def gpu_probe(tmp_path_factory):
    """The probe built once for sm_90a and loaded, where a Hopper GPU and cuda-python are present (else skip)."""
    tmp_path = tmp_path_factory.mktemp("probe")
    try:
        rt = cuda_lib.import_cudart()
        err, major = rt.cudaDeviceGetAttribute(rt.cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor, 0)
        err2, minor = rt.cudaDeviceGetAttribute(rt.cudaDeviceAttr.cudaDevAttrComputeCapabilityMinor, 0)
    except Exception as e:  # noqa: BLE001 - no cuda-python, no driver
        pytest.skip(f"no CUDA runtime: {e}")
    if int(err) or int(err2) or (int(major), int(minor)) != (9, 0):
        pytest.skip("needs a compute capability 9.0 GPU (H100 / H200)")
    if cuda_lib.find_nvcc() is None:
        pytest.skip("nvcc not found")
    so = tmp_path / "probe.so"
    proc = nvcc_probe(tmp_path, "-shared", "-Xcompiler", "-fPIC", "-o", str(so))
    assert proc.returncode == 0, proc.stderr
    lib = ctypes.CDLL(str(so))
    fn = lib.mtp_probe_wgmma
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int, ctypes.c_void_p]

    def ck(res):
        e = res[0] if isinstance(res, tuple) else res
        assert int(e) == 0, res
        return res[1] if isinstance(res, tuple) and len(res) > 1 else None

    def run(invoke, inputs, out_dtype, shape=(64, 64)):
        """inputs copied to the device, an output of `shape` (0xFF bytes first), invoke(*input pointers, output)."""
        ptrs = []
        for arr in inputs:
            arr = np.ascontiguousarray(arr)
            p = ck(rt.cudaMalloc(arr.nbytes))
            ck(rt.cudaMemcpy(p, arr.ctypes.data, arr.nbytes, rt.cudaMemcpyKind.cudaMemcpyHostToDevice))
            ptrs.append(p)
        out = np.empty(shape, out_dtype)
        d = ck(rt.cudaMalloc(out.nbytes))
        ck(rt.cudaMemset(d, 0xFF, out.nbytes))
        assert invoke(*(int(p) for p in ptrs), int(d)) == 0
        ck(rt.cudaDeviceSynchronize())
        ck(rt.cudaMemcpy(out.ctypes.data, d, out.nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost))
        for p in (*ptrs, d):
            rt.cudaFree(p)
        return out

    def call(code, a, b, K, trans_b, overwrite):
        return run(lambda pa, pb, d: fn(code, pa, pb, d, K, trans_b, overwrite, None), (a, b), np.float32)

    def tma(t, x, y, z):
        ftma = lib.mtp_probe_tma
        ftma.restype, ftma.argtypes = ctypes.c_int, TMA_ARGS
        return run(lambda src, dst: ftma(src, t.shape[2], t.shape[1], t.shape[0], t.shape[2] * 2, 64, x, y, z, dst,
                                         None), (t,), np.uint16)

    def gather(code, a, b, sel, K, skip):
        fg = lib.mtp_probe_gather
        fg.restype, fg.argtypes = ctypes.c_int, GATHER_ARGS
        return run(lambda pa, pb, ps, d: fg(code, pa, pb, ps, d, K, skip, None), (a, b, sel), np.float32)

    def wide(code, a, b):
        fw = lib.mtp_probe_wgmma256
        fw.restype, fw.argtypes = ctypes.c_int, WIDE_ARGS
        return run(lambda pa, pb, d: fw(code, pa, pb, d, None), (a, b), np.float32, (64, 256))

    call.tma = tma
    call.gather = gather
    call.wide = wide
    return call


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("trans_b", [0, 1], ids=["B-K-major", "B-MN-major"])
@pytest.mark.parametrize("K", [64, 576])
def test_wgmma_layouts_on_hopper(gpu_probe, dtype, trans_b, K):
    got, want = probe_case(gpu_probe, K=K, trans_b=trans_b, dtype=dtype, seed=K + trans_b)
    assert not np.isnan(got).any()
    assert np.max(np.abs(got - want)) <= 1e-5 * np.sqrt(K) * 8, np.max(np.abs(got - want))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_wgmma256_layout_on_hopper(gpu_probe, dtype):
    got, want = wide_case(gpu_probe.wide, dtype=dtype, seed=3)
    assert not np.isnan(got).any()
    assert np.max(np.abs(got - want)) <= 1e-5 * 8 * 8, np.max(np.abs(got - want))


@pytest.mark.gpu
@pytest.mark.parametrize("box", TMA_BOXES, ids=["inside", "past-rows", "past-cols-and-rows", "last-matrix-last-cols"])
def test_tma_swizzle_on_hopper(gpu_probe, box):
    """The 128-byte swizzle TMA writes is the one the emulation (and v3's P and zeroed rows) assume."""
    got, want = tma_case(gpu_probe.tma, *box)
    assert np.array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,K", [("bfloat16", 576), ("float16", 64)])
def test_cp_async_gather_onto_an_mbarrier_on_hopper(gpu_probe, dtype, K):
    """v3's sparse tiles on the hardware: rows gathered by cp.async into the swizzled layout, completing on an
    mbarrier (cp.async.mbarrier.arrive.noinc), fenced for the async proxy and read by wgmma."""
    got, want = gather_case(gpu_probe.gather, K=K, dtype=dtype, seed=K)
    assert not np.isnan(got).any()
    assert np.max(np.abs(got - want)) <= 1e-5 * np.sqrt(K) * 8, np.max(np.abs(got - want))
