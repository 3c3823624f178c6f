"""MLA decode v2 (DeepSeek's dims, the persistent grid) under the CPU emulation of CUDA (tests/kernels/emu):
every tile configuration against the NumPy reference, the schedule the device works out against
reference.mla_schedule, the bytes each block of query rows reads (the cp.async trace), and two block barriers per
KV tile.  The same launches run on a GPU in test_gpu_kernels.py."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest

from mtp_trt.plugins import cuda_lib
from mtp_trt.plugins import reference as ref

from . import test_gpu_kernels as G
from ._gpu import to_storage
from .test_emulated import _count, emu_lib, host, pytestmark  # noqa: F401 - fixtures and markers shared

D, DL = 576, 512
ROW_BYTES = D * 2
CHUNKS = D // 8  # 16-byte loads per row

# (opt-in shared memory, emulated device): the tile configurations v2 picks on each kind of GPU
SMEM = {"sm90": (232448, 20), "a100": (166912, 21), "99kb": (101376, 22)}


def v2_shape(smem: str, M: int) -> tuple[int, int]:
    """(rows per block R, KV rows per tile KT) v2 uses for M query rows per sequence (mla_decode.cu v2_config)."""
    KT = 32 if smem == "sm90" else 16
    R = 16 if M <= 16 else 32 if M <= 32 else 64
    return (min(R, 32) if smem == "99kb" else R), KT


@pytest.fixture()
def device(monkeypatch):
    def use(kind: str):
        optin, dev = SMEM[kind]
        monkeypatch.setenv("MTP_EMU_SMEM_OPTIN", str(optin))
        monkeypatch.setenv("MTP_EMU_DEVICE", str(dev))  # device facts are read once per device
    return use


CONFIG_CASES = [
    # kind, case: every (R, KT) of every kind of GPU, S = 1, 2, 4, causal and tree, one and several parts
    ("sm90", dict(B=2, S=1, H=16, T_max=90, past_len=[0, 80], dtype="bfloat16")),               # R 16, KT 32
    ("sm90", dict(B=2, S=2, H=16, T_max=90, past_len=[33, 70], dtype="float16", num_splits=3)),  # R 32
    ("sm90", dict(B=2, S=4, H=16, T_max=90, past_len=[5, 86], dtype="bfloat16", mask="tree")),   # R 64
    ("sm90", dict(B=1, S=1, H=128, T_max=100, past_len=[96], dtype="bfloat16", num_splits=1)),   # two row blocks
    ("sm90", dict(B=2, S=3, H=20, T_max=70, past_len=[0, 60], dtype="float16", mask="tree",
                  no_visible=True)),                                                              # 60 rows: R 64
    ("a100", dict(B=2, S=4, H=16, T_max=90, past_len=[5, 86], dtype="float16")),                 # R 64, KT 16
    ("a100", dict(B=3, S=1, H=16, T_max=40, past_len=[0, 17, 39], dtype="bfloat16", num_splits=4)),
    ("99kb", dict(B=2, S=4, H=16, T_max=90, past_len=[5, 86], dtype="bfloat16", mask="tree")),   # R 32 x 2, KT 16
    ("99kb", dict(B=1, S=2, H=16, T_max=50, past_len=[47], dtype="float16", num_splits=1)),      # R 32
]


@pytest.mark.parametrize("kind,case", CONFIG_CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CONFIG_CASES)])
def test_every_tile_configuration(emu_lib, host, device, kind, case):
    device(kind)
    G.run_mla(host, emu_lib, Dl=DL, Dr=D - DL, **case)


def test_ragged_lengths_over_many_parts(emu_lib, host):
    """Eight sequences of 1 to 300 rows over 7 parts: runs that end inside a sequence and go on in the next, a
    sequence run by one part (written directly) beside ones merged from several."""
    G.run_mla(host, emu_lib, B=8, S=2, H=16, Dl=DL, Dr=D - DL, T_max=300, dtype="bfloat16", num_splits=7,
              past_len=[0, 298, 7, 150, 31, 64, 1, 230])


def test_more_parts_than_tiles(emu_lib, host):
    """Parts of four tiles and empty parts beyond (their blocks leave at once)."""
    G.run_mla(host, emu_lib, B=1, S=1, H=16, Dl=DL, Dr=D - DL, T_max=70, past_len=[60], dtype="float16",
              num_splits=40)


def test_sparse_lists_over_parts(emu_lib, host):
    """mtp_mla_sparse_decode on v2: every query token a sequence of K slots (-1s and out-of-range rows skipped)."""
    G.run_mla_sparse(host, emu_lib, B=2, S=2, H=16, Dl=DL, Dr=D - DL, Di=128, T_max=200, past_len=[60, 190], K=100,
                     dtype="bfloat16", num_splits=5, empty_query=True)


@pytest.mark.parametrize("flags,dtype,splits", [(0, "bfloat16", 1), (0, "bfloat16", 5), (4, "bfloat16", 3),
                                                (1, "float32", 3)], ids=["v2", "v2-parts", "general-tc", "simt"])
def test_scores_beyond_fp32_range(emu_lib, host, device, flags, dtype, splits):
    """q . row = +inf in fp32 for some rows (3e38 * 2): those rows share the weight (the reference's float64 scores
    are finite and dwarf the others), no NaN row -- on v2 with and without the combine, the general kernels, SIMT."""
    device("sm90")
    G.run_mla(host, emu_lib, B=2, S=2, H=16, Dl=DL, Dr=D - DL, T_max=90, past_len=[20, 70], dtype=dtype,
              num_splits=splits, flags=flags, huge_scores=True)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_misaligned_workspace_is_refused(emu_lib, host, sparse):
    """The combine reads the workspace as float4 / float2: a workspace that is not 16-byte aligned is an invalid
    argument (nothing launched); the same buffer 16-byte aligned is accepted."""
    B, S, H, T, P = 1, 1, 16, 64, 3
    ws = emu_lib.mla_decode_workspace_size(B * S, 1, H, DL, P)
    d_q, d_cache, d_len = host.alloc(B * S * H * D * 2), host.alloc(B * T * D * 2), host.upload(np.int32([10]))
    d_sel, d_out, d_ws = host.upload(np.arange(8, dtype=np.int32)), host.alloc(B * S * H * DL * 2), host.alloc(ws + 16)
    host.poison(d_q, B * S * H * D * 2, 0x3C)
    host.poison(d_cache, B * T * D * 2, 0x3C)

    def call(w):
        if sparse:
            emu_lib.mla_sparse_decode("bfloat16", d_q, d_cache, d_len, 0, d_sel, d_out, w, ws, B, S, H, DL, D - DL, D,
                                      T, 8, 0.1, P, 0)
        else:
            emu_lib.mla_decode("bfloat16", d_q, d_cache, d_len, 0, 0, d_out, w, ws, B, S, H, DL, D - DL, T, 0.1, P, 0)
        host.sync("mla")

    for off in (4, 8):
        with pytest.raises(cuda_lib.CudaKernelError, match="invalid argument"):
            call(d_ws + off)
    call(d_ws + 16)


# ---------------------------------------------------------------------------------------------------------------
# The schedule, the bytes read and the barriers, from one launch
# ---------------------------------------------------------------------------------------------------------------
class Launch:
    """One mtp_mla_decode launch on random data with the cp.async trace on: the schedule it wrote (decoded from its
    workspace), the cache addresses each block read, the block barriers it took."""

    def __init__(self, lib, gpu, *, B, S, H, T_max, past_len, num_splits, dtype="bfloat16"):
        rng = np.random.default_rng(0)
        self.B, self.S, self.H, self.P = B, S, H, num_splits
        self.past_len = np.asarray(past_len, np.int32)
        q_s, q = to_storage(rng.standard_normal((B, S, H, D)), dtype)
        c_s, cache = to_storage(rng.standard_normal((B, T_max, D)), dtype)
        n_s, new = to_storage(rng.standard_normal((B, S, D)), dtype)
        scale = 1 / math.sqrt(D)
        self.want, _ = ref.mla_decode(q, cache, self.past_len, dl=DL, scale=scale, new_rows=new)
        self.d_cache, self.cache_bytes = gpu.upload(c_s), c_s.nbytes
        d_out, d_ws, ws_bytes = G.decode_buffers(gpu, lib, B, S, H, DL, dtype, num_splits)
        trace = lib.lib.mtp_emu_trace
        trace.restype, trace.argtypes = ctypes.c_long, [ctypes.c_int, ctypes.c_void_p, ctypes.c_long]
        barriers = _count(lib, "syncthreads")
        trace(1, None, 0)
        lib.mla_decode(dtype, gpu.upload(q_s), self.d_cache, gpu.upload(self.past_len), gpu.upload(n_s), 0, d_out,
                       d_ws, ws_bytes, B, S, H, DL, D - DL, T_max, scale, num_splits, 0)
        n = trace(0, None, 0)
        rows = np.zeros(2 * n, np.uint64)
        trace(0, rows.ctypes.data, n)
        self.barriers = _count(lib, "syncthreads") - barriers
        self.blocks, self.addrs = rows[0::2], rows[1::2].astype(np.int64)
        self.out = G.from_storage(gpu.download(d_out, self.want.shape, G.storage_dtype(dtype)), dtype)
        self.workspace = gpu.download(d_ws, (ws_bytes,), np.uint8) if ws_bytes else None

    def schedule(self):
        """(runs, seqs) as the device wrote them: the workspace's int4 per part and int2 per sequence."""
        M, P, align = self.S * self.H, self.P, lambda n: -(-n // 256) * 256
        slots = P + self.B - 1
        off = align(slots * M * DL * 4) + align(slots * M * 8)
        part = self.workspace[off:off + 16 * P].view(np.int32).reshape(P, 4)
        off += align(16 * P)
        seq = self.workspace[off:off + 8 * self.B].view(np.int32).reshape(self.B, 2)
        return [None if r[0] < 0 else tuple(int(x) for x in r) for r in part], [tuple(int(x) for x in s) for s in seq]

    def cache_rows_read(self, mblock: int) -> np.ndarray:
        """Cache rows (as b * T_max + t) read by every block of query rows `mblock`, one entry per 16-byte load."""
        in_cache = (self.addrs >= self.d_cache) & (self.addrs < self.d_cache + self.cache_bytes)
        mine = (self.blocks & ((1 << 21) - 1)) == mblock
        return (self.addrs[in_cache & mine] - self.d_cache) // ROW_BYTES


SCHEDULE_CASES = {
    "H16-S1-ragged": dict(B=5, S=1, H=16, T_max=200, past_len=[0, 199, 64, 100, 3], num_splits=6),
    "H16-S4-one-block": dict(B=2, S=4, H=16, T_max=130, past_len=[126, 40], num_splits=3),
    "H128-S1-two-blocks": dict(B=2, S=1, H=128, T_max=100, past_len=[99, 20], num_splits=3),
}


@pytest.mark.parametrize("name", list(SCHEDULE_CASES))
def test_schedule_bytes_and_barriers(emu_lib, host, device, name):
    device("sm90")
    case = SCHEDULE_CASES[name]
    run = Launch(emu_lib, host, **case)
    G.assert_close(run.out, run.want, atol=2e-2, rtol=2e-2, name=name)
    M = case["S"] * case["H"]
    R, KT = v2_shape("sm90", M)
    mblocks = -(-M // R)
    L = np.minimum(run.past_len + case["S"], case["T_max"])
    tiles = [-(-int(n) // KT) for n in L]

    # the schedule the device worked out from past_len is the reference's
    runs, seqs = ref.mla_schedule(tiles, case["num_splits"])
    assert run.schedule() == (runs, seqs)

    # each block of query rows reads every row of every sequence exactly once, and nothing else of the cache:
    # the cache is read mblocks times in all (not once per 32 query rows, not once per MTP token)
    for mb in range(mblocks):
        rows, loads = np.unique(run.cache_rows_read(mb), return_counts=True)
        want = np.concatenate([b * case["T_max"] + np.arange(n) for b, n in enumerate(L)])
        assert np.array_equal(rows, want) and np.all(loads == CHUNKS), name
    in_cache = (run.addrs >= run.d_cache) & (run.addrs < run.d_cache + run.cache_bytes)
    assert in_cache.sum() * 16 == mblocks * L.sum() * ROW_BYTES

    # two block barriers per KV tile: per segment (a sequence's share of a part) 2 n + 1 (the last P.V) + 2 (the
    # epilogue), per block of the schedule kernel 2 + 3 per chunk of 128 sequences
    segments = [n for r in runs if r is not None for n in ref.mla_run_segments(r, tiles)]
    want = mblocks * sum(2 * n + (n > 0) + 2 for n in segments) + 2 + 3 * -(-case["B"] // 128)
    assert run.barriers == want, (run.barriers, want)

