"""Compile every kernel with nvcc for sm_80, sm_86, sm_89, sm_90a, sm_100 and sm_120 (no GPU needed),
check ptxas reports no spills / stack for the attention, indexer and acceptance kernels, and exercise the library's
host-only functions.  Skipped when nvcc is absent.  About a minute on 2 cores."""

from __future__ import annotations

import re
import time

import pytest

from mtp_trt.plugins import cuda_lib
from mtp_trt.plugins import reference as ref
from mtp_trt.plugins import trt_plugins as tp

ARCHS = ["80", "86", "89", "90a", "100", "120"]

pytestmark = pytest.mark.skipif(cuda_lib.find_nvcc() is None,
                                reason="nvcc not found (install the CUDA toolkit or set NVCC / CUDA_HOME)")

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_entries(log: str) -> list[tuple[str, str, int, int, int]]:
    """(kernel, arch, stack bytes, spill stores, spill loads) from an `-Xptxas -v` log."""
    out, cur = [], None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            cur = (m.group(1), m.group(2))
        elif (m := _FRAME.search(line)) and cur:
            out.append((*cur, int(m.group(1)), int(m.group(2)), int(m.group(3))))
            cur = None
    return out


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("objs")
    t0 = time.perf_counter()
    res = cuda_lib.compile_archs(ARCHS, out, ptxas_verbose=True)
    return res, time.perf_counter() - t0, out


@pytest.mark.slow
def test_every_kernel_compiles_for_every_arch(compiled):
    res, total, out = compiled
    assert {r.source for r in res} == set(cuda_lib.SOURCES)
    for r in res:
        obj = out / (r.source.rsplit(".", 1)[0] + ".o")
        assert obj.stat().st_size > 0, r.source
        assert "-gencode=arch=compute_90a,code=sm_90a" in r.command
        archs = {a for _, a, *_ in ptxas_entries(r.log)}
        if r.source != "api.cu":  # api.cu has no kernels
            assert archs == {f"sm_{a}" for a in ARCHS}, (r.source, archs)
        print(f"{r.source}: {r.seconds:.1f} s for {len(ARCHS)} archs")
    print(f"total wall time {total:.1f} s")


@pytest.mark.slow
def test_attention_kernels_do_not_spill(compiled):
    """Every MLA kernel on every shipped arch: no stack, no spills (v2 keeps 128 fp32 accumulators per thread at
    64 query rows and stays under 255 registers)."""
    res, _, _ = compiled
    log = next(r.log for r in res if r.source == "mla_decode.cu")
    entries = ptxas_entries(log)
    assert {e[1] for e in entries} == {f"sm_{a}" for a in ARCHS}
    on90 = [e[0] for e in entries if e[1] == "sm_90a"]
    assert sum("mla_tc_kernel" in n for n in on90) == 4  # the general tensor-core kernel: fp16/bf16 x 1/2 stages
    assert sum("mla_simt_kernel" in n for n in on90) == 3  # fp32/fp16/bf16
    assert sum("mla_v2_kernel" in n for n in on90) == 12  # fp16/bf16 x (rows, tile) 64/32/16 x 32/16
    assert sum("mla_v3_kernel" in n for n in on90) == 2  # fp16/bf16 (wgmma, TMA; a trap on the other archs)
    for name, arch, stack, st, ld in entries:
        assert (stack, st, ld) == (0, 0, 0), f"{name} on {arch}: {stack} B stack, {st}/{ld} B spill stores/loads"


@pytest.mark.slow
def test_indexer_kernels_do_not_spill(compiled):
    """DSA's kernels, every arch: the histogram clear, the tensor-core scoring (fp16/bf16: 16 rows x 64 heads of
    accumulators and a tile of keys in registers), the SIMT scoring (one accumulator per indexer head, three
    dtypes), the one-block selection and the four chunked selection passes."""
    res, _, _ = compiled
    entries = ptxas_entries(next(r.log for r in res if r.source == "dsa.cu"))
    assert {e[1] for e in entries} == {f"sm_{a}" for a in ARCHS}
    names = sorted(re.search(r"dsa_[a-z_]+_kernel", e[0]).group(0) for e in entries if e[1] == "sm_90a")
    assert names == ["dsa_score_simt_kernel"] * 3 + ["dsa_score_tc_kernel"] * 2 + ["dsa_select_one_kernel"] + \
        ["dsa_select_pass_kernel"] * 4 + ["dsa_zero_kernel"], names
    for name, arch, stack, st, ld in entries:
        assert (stack, st, ld) == (0, 0, 0), f"{name} on {arch}: {stack} B stack, {st}/{ld} B spill stores/loads"


@pytest.mark.slow
def test_acceptance_kernels_do_not_spill(compiled):
    """The acceptance kernels (a row read by a cluster of blocks with 16-byte loads, four in flight per thread), every
    arch: argmax rows (three dtypes x strict / relaxed), the per-sequence walk, rejection sampling (three dtypes)."""
    res, _, _ = compiled
    entries = ptxas_entries(next(r.log for r in res if r.source == "accept.cu"))
    assert {e[1] for e in entries} == {f"sm_{a}" for a in ARCHS}
    assert len([e for e in entries if e[1] == "sm_90a"]) == 10, entries
    for name, arch, stack, st, ld in entries:
        assert (stack, st, ld) == (0, 0, 0), f"{name} on {arch}: {stack} B stack, {st}/{ld} B spill stores/loads"


def test_nvcc_command_lists_the_sources_and_archs(tmp_path):
    cmd = cuda_lib.nvcc_command(cuda_lib.SOURCES, tmp_path / "x.so", "sm_80,90a")
    assert cmd[0].endswith("nvcc")
    assert "-gencode=arch=compute_80,code=sm_80" in cmd and "-gencode=arch=compute_90a,code=sm_90a" in cmd
    assert "-shared" in cmd and cmd[-2:] == ["-o", str(tmp_path / "x.so")]
    assert sum(c.endswith(".cu") for c in cmd) == len(cuda_lib.SOURCES)
    assert cuda_lib.parse_archs("8.9, sm_120 compute_90a") == ["89", "120", "90a"]
    with pytest.raises(cuda_lib.NvccError):
        cuda_lib.parse_archs("hopper")


@pytest.mark.slow
def test_library_host_functions_without_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_TRT_CACHE_DIR", str(tmp_path / "cache"))
    path = cuda_lib.build_library(["90a"])
    assert path.exists() and path.parent == tmp_path / "cache" / "kernels"
    assert cuda_lib.build_library(["90a"]) == path  # cached: same key, no rebuild
    assert not list(path.parent.glob("*.tmp.so"))
    lib = cuda_lib.KernelLib(path)
    for B, S, H, T, sms in [(1, 1, 128, 32768, 132), (64, 1, 128, 4096, 132), (1, 4, 16, 300, 108),
                            (8, 2, 128, 65536, 78), (1, 1, 16, 10**6, 1000), (3, 1, 1, 1, 132)]:
        assert lib.mla_decode_num_splits(B, S, H, T, sms) == ref.mla_num_splits(B, S, H, T, sms)
    for B, S, H, Dl, P in [(2, 3, 16, 512, 5), (1, 1, 128, 512, 66), (64, 1, 16, 512, 132), (2, 3, 16, 512, 1)]:
        assert lib.mla_decode_workspace_size(B, S, H, Dl, P) == ref.mla_workspace_size(B, S, H, Dl, P)
    # argument checks happen before any CUDA call: invalid-argument errors with no GPU
    with pytest.raises(cuda_lib.CudaKernelError, match="invalid argument"):
        lib.mla_decode("float16", 16, 16, 16, 0, 0, 16, 0, 0, 1, 1, 16, 512, 64, 64, 0.1, num_splits=0)
    with pytest.raises(cuda_lib.CudaKernelError, match="invalid argument"):  # workspace missing
        lib.mla_decode("bfloat16", 16, 16, 16, 0, 0, 16, 0, 0, 1, 1, 16, 512, 64, 64, 0.1, num_splits=4)
    with pytest.raises(cuda_lib.CudaKernelError, match="invalid argument"):
        lib.accept_strict("float32", 16, 0, 16, 16, 16, 16, 1, 3, 0)
    with pytest.raises(cuda_lib.CudaKernelError, match="invalid argument"):
        lib.accept_rejection("float32", 16, 16, 16, 16, 16, 16, 16, 1, 3, 1 << 24)
    lib.gather_last_hidden("float16", 0, 0, 0, 0, 4, 8)  # B = 0: nothing to do, success
    # DeepSeek Sparse Attention: workspace sizes and argument checks
    for B, S, T in [(2, 3, 1000), (1, 1, 131071), (64, 4, 33), (3, 1, 1)]:  # the plugins' replica of the formula
        assert lib.dsa_select_workspace_size(B, S, T) == tp.dsa_workspace_size(B, S, T)
    assert lib.dsa_select_workspace_size(2, 3, 1000) == -(-2 * 3 * 1000 * 4 // 256) * 256 + 2 * 3 * 20992
    assert lib.dsa_select_workspace_size(0, 3, 1000) == 0
    for bad in (dict(Hi=65), dict(Di=0), dict(K=0), dict(C=100)):  # > 64 heads, no key, no slot, key past the row
        args = dict(B=1, S=2, Hi=64, Di=128, C=704, key_offset=576, T_max=100, K=16) | bad
        with pytest.raises(cuda_lib.CudaKernelError, match="invalid argument"):
            lib.dsa_select("bfloat16", 16, 16, 16, 16, 0, 16, 16, 1 << 20, scale=0.1, **args)
    with pytest.raises(cuda_lib.CudaKernelError, match="invalid argument"):  # workspace missing
        lib.dsa_select("bfloat16", 16, 16, 16, 16, 0, 16, 0, 0, 1, 2, 64, 128, 704, 576, 100, 16, 0.1)
    with pytest.raises(cuda_lib.CudaKernelError, match="invalid argument"):  # C < Dl + Dr
        lib.mla_sparse_decode("bfloat16", 16, 16, 16, 0, 16, 16, 0, 0, 1, 1, 16, 512, 64, 500, 100, 8, 0.1, 1)
    with pytest.raises(cuda_lib.CudaKernelError, match="invalid argument"):  # B * S > 65535 sequences
        lib.mla_sparse_decode("bfloat16", 16, 16, 16, 0, 16, 16, 0, 0, 40000, 2, 16, 512, 64, 704, 100, 8, 0.1, 1)
    lib.mla_sparse_decode("bfloat16", 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 16, 512, 64, 704, 100, 8, 0.1, 1)  # B = 0

_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


@pytest.mark.slow
@pytest.mark.parametrize("kernel,bytes_line", [
    ("mla_v3_kernel", r"V3_BYTES = 1024 \+ V3_M_OFF \+ 256;\s*// ([\d,]+) bytes"),
    ("mla_seesaw_kernel", r"SS_BYTES = 1024 \+ SS_L_OFF \+ 512;\s*// ([\d,]+) bytes")], ids=["v3", "seesaw"])
def test_v3_fits_one_block_per_sm(compiled, kernel, bytes_line):
    """v3 on sm_90a (dense and sparse launches, one kernel) and its seesaw schedule: their 256 threads' registers fit
    the SM's 65,536 and their shared memory (the dynamic bytes mla_decode.cu states, plus any static) the 227 KB one
    block may opt in to."""
    res, _, _ = compiled
    log = next(r.log for r in res if r.source == "mla_decode.cu")
    regs, cur = {}, None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            cur = m.group(1) if m.group(2) == "sm_90a" and kernel in m.group(1) else None
        elif cur and (m := _USED.search(line)):
            regs[cur] = (int(m.group(1)), int(m.group(2) or 0))
            cur = None
    assert len(regs) == 2, regs
    src = (cuda_lib.KERNEL_DIR / "mla_decode.cu").read_text()
    dyn = int(re.search(bytes_line, src).group(1).replace(",", ""))
    for name, (r, static) in regs.items():
        print(f"{name}: {r} registers, {static} + {dyn} bytes of shared memory")
        assert r * 256 <= 65536 and r <= 255, name
        assert static + dyn <= 227 * 1024, name


@pytest.mark.slow
def test_wgmma_chains_are_not_fenced_or_serialized_by_ptxas(compiled):
    """ptxas says nothing of the MLA kernels' wgmma: no product serialized (C7514, C7520: an accumulator touched while
    its wgmma may run) and no warpgroup.arrive injected (C7519: registers used by wgmma without the kernel's own
    fence, e.g. after a wait loop or where two branches' products join)."""
    res, _, _ = compiled
    log = next(r.log for r in res if r.source == "mla_decode.cu")
    notes = [ln for ln in log.splitlines() if re.search(r"\(C75(14|19|20)\)", ln)]
    assert not notes, "\n".join(notes[:5])


@pytest.mark.slow
def test_v3_runs_on_warpgroup_mma_and_tma(compiled):
    """sm_90a SASS of the MLA kernels: v3's products are HGMMA (64x64x16) and its loads UTMALDG (TMA; a sparse list's
    rows LDGSTS, cp.async), with no local memory; needs cuobjdump (set CUOBJDUMP; pip's nvidia-cuda-cuobjdump carries
    one, with nvidia-cuda-nvdisasm)."""
    import subprocess

    from .test_hopper import find_cuobjdump

    if (cuobjdump := find_cuobjdump()) is None:
        pytest.skip("cuobjdump not found")
    _, _, out = compiled
    sass = subprocess.run([cuobjdump, "-sass", "-arch", "sm_90a", str(out / "mla_decode.o")], capture_output=True,
                          text=True)
    assert sass.returncode == 0, sass.stderr
    v3 = [blk for blk in sass.stdout.split("Function : ")[1:] if "mla_v3_kernel" in blk.splitlines()[0]]
    assert len(v3) == 2
    for blk in v3:
        assert blk.count("HGMMA.64x64x16.F32") >= 8 and "UTMALDG.3D" in blk, blk.splitlines()[0]
        assert "LDGSTS" in blk, blk.splitlines()[0]  # sparse lists: the listed rows by cp.async
        assert "LDL" not in blk and "STL" not in blk
