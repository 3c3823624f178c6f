"""The plugins' enqueue glue without a GPU: host buffers stand in for device memory, and the kernel
library and the CUDA driver are replaced by host emulations (the kernels' NumPy references of
plugins/reference.py).  The op outputs must equal the op contract as the `onnx` lowering
computes it (exporters/lowering.py), the new rows must land in the cache in place, and the split-KV
workspace used must fit the one reserved at build time.  What this cannot check: the CUDA kernels
themselves on a GPU (tests/kernels), and TensorRT calling enqueue (needs a GPU)."""

import ctypes

import numpy as np
import pytest
import torch

from mtp_trt.exporters.lowering import accept_decomposed, mla_attention_decomposed
from mtp_trt.plugins import reference
from mtp_trt.plugins import trt_plugins as tp

pytestmark = pytest.mark.trt
NP = {0: np.float32, 1: np.float16}


def _view(ptr: int, shape, dtype) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = (ctypes.c_char * max(n, 1)).from_address(ptr)
    return np.frombuffer(buf, dtype=dtype, count=int(np.prod(shape))).reshape(shape)


class HostKernels:
    """KernelLib's methods on host memory, computed with the NumPy references."""

    def __init__(self, num_sms=132):
        self.num_sms, self.calls = num_sms, []

    def mla_decode_num_splits(self, B, S, H, max_len, num_sms=0):
        return reference.mla_num_splits(B, S, H, max_len, self.num_sms)

    def mla_decode_workspace_size(self, B, S, H, Dl, num_splits):
        return tp.mla_workspace_size(B, S, H, Dl, num_splits)

    def mla_decode(self, dtype, q, kv_cache, past_len, new_rows, mask, out, workspace, workspace_bytes, B, S, H,
                   Dl, Dr, T_max, scale, num_splits, flags=0, stream=0):
        self.calls.append(dict(splits=num_splits, workspace=workspace, workspace_bytes=workspace_bytes, mask=mask))
        dt, D = NP[dtype], Dl + Dr
        cache = _view(kv_cache, (B, T_max, D), dt)
        lens = _view(past_len, (B,), np.int32)
        o, committed = reference.mla_decode(_view(q, (B, S, H, D), dt), cache.copy(), lens.copy(), dl=Dl, scale=scale,
                                            new_rows=_view(new_rows, (B, S, D), dt) if new_rows else None)
        cache[...] = committed
        _view(out, (B, S, H, Dl), dt)[...] = o

    def accept_relaxed_dev(self, dtype, logits, drafts, draft_stride, thinking_in, thinking_out, out_tokens,
                           num_accepted, last_index, B, K, V, topk, delta, think_start_id, think_end_id, stream=0):
        """Kernel ABI 3: drafts[b * draft_stride + i] in place; topk / delta are device (here: host) pointers to
        scalars, read by the kernel itself; flags read from thinking_in, written to thinking_out."""
        topk, delta = int(_view(topk, (), np.int32)), float(_view(delta, (), np.float32))
        self.calls.append(dict(topk=topk, delta=delta, last_index=last_index))
        d = _view(drafts, (B, draft_stride), np.int32)[:, :K].copy() if K else np.zeros((B, 0), np.int32)
        toks, num, _, th_after = reference.accept_relaxed(  # topk <= 0: strict, as the kernel
            _view(logits, (B, K + 1, V), np.float32), d, _view(thinking_in, (B,), np.int32).copy(), topk=topk,
            delta=delta, think_start_id=think_start_id, think_end_id=think_end_id)
        _view(out_tokens, (B, K + 1), np.int32)[...] = toks
        _view(num_accepted, (B,), np.int32)[...] = num
        _view(thinking_out, (B,), np.int32)[...] = th_after


@pytest.fixture
def host(monkeypatch):
    from mtp_trt.trt import compat

    kernels = HostKernels()
    monkeypatch.setattr(tp, "_kernels", lambda: kernels)
    return compat.load("auto").trt, kernels


def _desc(trt, arr: np.ndarray):
    d = trt.PluginTensorDesc()
    d.dims = trt.Dims(list(arr.shape))
    d.type = {np.float32: trt.float32, np.float16: trt.float16, np.int32: trt.int32, np.bool_: trt.bool}[arr.dtype.type]
    d.format = trt.TensorFormat.LINEAR
    return d


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


@pytest.mark.parametrize("dtype,B,S,T", [(np.float32, 2, 3, 64), (np.float16, 3, 1, 512), (np.float32, 1, 17, 300)])
def test_attention_enqueue_matches_the_op_contract(host, dtype, B, S, T):
    trt, kernels = host
    H, Dl, Dr, scale = 4, 32, 8, 0.17
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, S, H, Dl + Dr)).astype(dtype)
    rows = rng.standard_normal((B, S, Dl + Dr)).astype(dtype)
    cache = rng.standard_normal((B, T, Dl + Dr)).astype(dtype)
    past = rng.integers(0, T - S + 1, B).astype(np.int32)
    before = cache.copy()
    out = np.full((B, S, H, Dl), np.nan, dtype)
    reserved = tp.mla_workspace_bound((1, B), (1, S), H, Dl, T)
    ws = np.zeros(max(reserved, 1), np.uint8)
    plugin = tp.plugin_classes(trt)["MlaGenerationAttention"][0]({"kv_lora_rank": Dl, "softmax_scale": scale})
    plugin.enqueue([_desc(trt, a) for a in (q, rows, cache, past)], [_desc(trt, out), _desc(trt, cache)],
                   [_ptr(q), _ptr(rows), _ptr(cache), _ptr(past)], [_ptr(out), _ptr(cache)], _ptr(ws), 0)
    call = kernels.calls[-1]
    assert call["mask"] is None and call["workspace_bytes"] <= reserved
    assert (call["splits"] > 1) == (call["workspace"] is not None)
    want = mla_attention_decomposed(torch.from_numpy(q.astype(np.float32)), torch.from_numpy(rows.astype(np.float32)),
                                    torch.from_numpy(before.astype(np.float32)), torch.from_numpy(past), Dl, scale)
    tol = 1e-5 if dtype == np.float32 else 2e-3
    np.testing.assert_allclose(out.astype(np.float32), want.numpy(), atol=tol, rtol=tol)
    for b in range(B):  # the KV commit, in place in the cache buffer (kv_cache_out, aliased to kv_cache)
        p = past[b]
        np.testing.assert_array_equal(cache[b, p:p + S], rows[b])
        np.testing.assert_array_equal(np.delete(cache[b], np.s_[p:p + S], 0), np.delete(before[b], np.s_[p:p + S], 0))


def test_split_count_is_capped_by_the_reserved_workspace(host):
    """A GPU with more SMs than the build-time bound asks for more splits; enqueue caps them."""
    trt, kernels = host
    kernels.num_sms = 10_000
    B, S, H, Dl, T = 1, 1, 2, 32, 4096
    q = np.zeros((B, S, H, Dl + 8), np.float32)
    rows, cache = np.zeros((B, S, Dl + 8), np.float32), np.zeros((B, T, Dl + 8), np.float32)
    past, out = np.zeros(B, np.int32), np.zeros((B, S, H, Dl), np.float32)
    reserved = tp.mla_workspace_bound((1, 1), (1, 1), H, Dl, T)
    ws = np.zeros(reserved, np.uint8)
    plugin = tp.plugin_classes(trt)["MlaGenerationAttention"][0]({"kv_lora_rank": Dl, "softmax_scale": 1.0})
    plugin.enqueue([_desc(trt, a) for a in (q, rows, cache, past)], [_desc(trt, out), _desc(trt, cache)],
                   [_ptr(q), _ptr(rows), _ptr(cache), _ptr(past)], [_ptr(out), _ptr(cache)], _ptr(ws), 0)
    assert kernels.calls[-1]["splits"] == tp.mla_splits_bound(B, S, H, T) < 256
    assert kernels.calls[-1]["workspace_bytes"] <= reserved


def test_attention_enqueue_is_one_library_call_and_checks_the_alias(host, monkeypatch):
    """The split count and workspace of a shape are asked of the library (which queries the device) once per
    plugin instance: every later call at that shape is the launch alone.  A kv_cache_out not bound to kv_cache's
    buffer (aliasing not honoured) is refused before the kernel writes anywhere."""
    trt, kernels = host
    calls = []

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(kernels, name)

    monkeypatch.setattr(tp, "_kernels", lambda: Counting())
    B, S, H, Dl, T = 2, 2, 4, 32, 256
    q = np.zeros((B, S, H, Dl + 8), np.float32)
    rows, cache = np.zeros((B, S, Dl + 8), np.float32), np.zeros((B, T, Dl + 8), np.float32)
    past, out = np.zeros(B, np.int32), np.zeros((B, S, H, Dl), np.float32)
    ws = np.zeros(max(tp.mla_workspace_bound((1, B), (1, S), H, Dl, T), 1), np.uint8)
    plugin = tp.plugin_classes(trt)["MlaGenerationAttention"][0]({"kv_lora_rank": Dl, "softmax_scale": 1.0})
    descs = [_desc(trt, a) for a in (q, rows, cache, past)], [_desc(trt, out), _desc(trt, cache)]
    for _ in range(3):
        plugin.enqueue(*descs, [_ptr(q), _ptr(rows), _ptr(cache), _ptr(past)], [_ptr(out), _ptr(cache)], _ptr(ws), 0)
    assert calls == ["mla_decode_num_splits", "mla_decode_workspace_size", "mla_decode", "mla_decode", "mla_decode"]
    assert plugin.clone().launches == {}  # a new context (attach_to_context clones) may be on another device
    other = cache.copy()
    n = len(tp.errors)
    with pytest.raises(RuntimeError, match="kv_cache_out is bound to .*not to kv_cache's buffer"):
        plugin.enqueue(*descs, [_ptr(q), _ptr(rows), _ptr(cache), _ptr(past)], [_ptr(out), _ptr(other)], _ptr(ws), 0)
    assert calls.count("mla_decode") == 3 and "kv_cache_out is bound" in tp.errors[n]


@pytest.mark.parametrize("topk,delta", [(0, 0.0), (3, 0.3), (50, 1.0)])
@pytest.mark.parametrize("K", [0, 1, 3])
def test_accept_enqueue_matches_the_op_contract(host, topk, delta, K):
    trt, kernels = host
    B, V, start, end = 5, 40, 7, 8
    rng = np.random.default_rng(K * 10 + topk)
    logits = (rng.standard_normal((B, K + 1, V)) * 2).astype(np.float32)
    top = np.argsort(-logits, -1)
    ids = np.empty((B, K + 1), np.int32)  # drafts: the argmax, a near miss, or think tokens
    ids[:, 0] = rng.integers(0, V, B)
    for i in range(K):
        choice = rng.integers(0, 4, B)
        ids[:, i + 1] = np.where(choice == 0, top[:, i, 0], np.where(choice == 1, top[:, i, 1],
                                 np.where(choice == 2, start, end)))
    thinking = rng.integers(0, 2, B).astype(np.int32)
    topk_a, delta_a = np.array(topk, np.int32), np.array(delta, np.float32)
    acc, num, th_out = np.full((B, K + 1), -7, np.int32), np.full(B, -7, np.int32), np.full(B, -7, np.int32)
    ws = np.zeros(1, np.uint8)  # MtpAccept needs no workspace
    thinking_before = thinking.copy()
    plugin = tp.plugin_classes(trt)["MtpAccept"][0]({"think_start_id": start, "think_end_id": end})
    ins = (logits, ids, thinking, topk_a, delta_a)
    plugin.enqueue([_desc(trt, a) for a in ins], [_desc(trt, a) for a in (acc, num, th_out)],
                   [_ptr(a) for a in ins], [_ptr(acc), _ptr(num), _ptr(th_out)], _ptr(ws), 0)
    assert kernels.calls[-1] == {"topk": topk, "delta": pytest.approx(delta), "last_index": None}
    want = accept_decomposed(torch.from_numpy(logits), torch.from_numpy(ids), torch.from_numpy(thinking),
                             torch.tensor(topk, dtype=torch.int32), torch.tensor(delta), start, end)
    np.testing.assert_array_equal(acc, want[0].numpy())
    np.testing.assert_array_equal(num, want[1].numpy())
    np.testing.assert_array_equal(th_out, want[2].numpy())
    np.testing.assert_array_equal(thinking, thinking_before)  # the input is not modified


def test_serialized_fields_round_trip(host):
    trt, _ = host
    for name, values in (("MlaGenerationAttention", {"kv_lora_rank": 512, "softmax_scale": 0.0723}),
                         ("MtpAccept", {"think_start_id": 128798, "think_end_id": -1})):
        plugin_cls, creator_cls = tp.plugin_classes(trt)[name]
        fields = plugin_cls(values).get_fields_to_serialize()
        again = creator_cls().create_plugin("n", fields, trt.TensorRTPhase.RUNTIME)
        assert again.values == pytest.approx(values) and again.plugin_name == name
        assert again.clone().values == again.values


@pytest.mark.parametrize("dtype,tree", [(np.float32, False), (np.float16, True)])
def test_sparse_attention_enqueue_runs_the_kernels(monkeypatch, dtype, tree):
    """MlaSparseAttention's enqueue on the CUDA kernels themselves, compiled for the CPU under the host emulation
    (tests/kernels/emu): the KV commit of rows with their indexer keys, the indexer's top-k and sparse MLA, in the
    workspace reserved at build time, equal the op contract's torch form (mla_sparse_decomposed) on integer-valued
    indexer inputs (exact scores, many ties: the earlier row wins on both sides)."""
    from kernels.emu import build as emu_build

    from mtp_trt.exporters.lowering import mla_sparse_decomposed
    from mtp_trt.fsutil import cache_dir
    from mtp_trt.plugins import cuda_lib
    from mtp_trt.trt import compat

    if why := emu_build.unavailable_reason():
        pytest.skip(f"kernel emulation: {why}")
    lib = cuda_lib.KernelLib(emu_build.build_emulated_library(cache_dir("emu")))
    monkeypatch.setattr(tp, "_kernels", lambda: lib)
    trt = compat.load("auto").trt
    B, S, H, Dl, Dr, Hi, Di, T, K, scale = 2, 3, 4, 32, 8, 2, 16, 40, 6, 0.17
    rng = np.random.default_rng(1)
    q = rng.standard_normal((B, S, H, Dl + Dr)).astype(dtype)
    rows = np.concatenate([rng.standard_normal((B, S, Dl + Dr)), rng.integers(-1, 2, (B, S, Di))], -1).astype(dtype)
    cache = np.concatenate([rng.standard_normal((B, T, Dl + Dr)), rng.integers(-1, 2, (B, T, Di))], -1).astype(dtype)
    iq = rng.integers(-1, 2, (B, S, Hi, Di)).astype(dtype)
    iw = rng.integers(0, 3, (B, S, Hi)).astype(np.float32)
    past = np.array([2, 30], np.int32)
    mask = (np.tril(rng.integers(0, 2, (B, S, S))) | np.eye(S, dtype=np.int64)).astype(np.bool_) if tree else None
    before = cache.copy()
    out = np.full((B, S, H, Dl), np.nan, dtype)
    ws = np.zeros(tp.sparse_workspace_bound((1, B), (1, S), H, Dl, T, K), np.uint8)
    plugin = tp.plugin_classes(trt)["MlaSparseAttention"][0]({"kv_lora_rank": Dl, "softmax_scale": scale,
                                                              "index_topk": K})
    ins = [q, rows, cache, past, iq, iw] + ([mask] if tree else [])
    plugin.enqueue([_desc(trt, a) for a in ins], [_desc(trt, out), _desc(trt, cache)], [_ptr(a) for a in ins], [_ptr(out), _ptr(cache)],
                   _ptr(ws), 0)
    t = (lambda a: torch.from_numpy(a.astype(np.float32)))
    want, committed = mla_sparse_decomposed(t(q), t(rows), t(before), torch.from_numpy(past), t(iq), t(iw), Dl, scale,
                                            K, None if mask is None else torch.from_numpy(mask))
    tol = 1e-5 if dtype == np.float32 else 2e-3
    np.testing.assert_allclose(out.astype(np.float32), want.numpy(), atol=tol, rtol=tol)
    np.testing.assert_array_equal(cache.astype(np.float32), committed.numpy())  # in place, keys included
