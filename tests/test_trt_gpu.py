"""The TensorRT runtime on a real GPU (markers `gpu`, and `trt` where engines run).  Skipped elsewhere, with the
reason.  tests/test_trt_runtime.py runs the same runtime on a CPU over host stand-ins; these tests check what
only a GPU can: cuda-python's device layer with the project's own kernels captured in a CUDA graph and
replayed, and TensorRT running the engines (plugins, CUDA kernels, aliased caches, CUDA graphs) end to end."""

import numpy as np
import pytest
from typer.testing import CliRunner

from mtp_trt.backend import OrtBackend
from mtp_trt.cli import app
from mtp_trt.decode import DecodeOptions, generate
from mtp_trt.exporters.export import export
from mtp_trt.manifest import Manifest
from mtp_trt.plugins import reference
from runtime_models import EOS, THINK, make_self_drafting

K = 2
PROMPTS = [[1, 5, 9, 13, 2, 7, 30, 31, 4, 8, 12], [3, 4], [11, 12, 13, 14, 15, 16, 17]]


# ------------------------------------------------------------------------------- device layer
@pytest.mark.gpu
def test_device_layer_captures_and_replays_the_kernels():
    """Pinned staging, async copies, and a CUDA graph of the KV-commit and gather kernels, replayed with new
    inputs written into the same pinned buffers; results equal the NumPy references."""
    from mtp_trt.plugins.cuda_lib import load_library
    from mtp_trt.trt.device import Device
    from mtp_trt.trt.runtime import Buffer

    dev, lib = Device(), load_library()
    B, S, T, D = 3, 4, 32, 40
    rng = np.random.default_rng(0)
    cache = Buffer(dev, B * T * D * 4)
    rows, lens = Buffer(dev, B * S * D * 4), Buffer(dev, B * 4)
    last, gathered = Buffer(dev, B * 4), Buffer(dev, B * D * 4)
    host_cache = rng.standard_normal((B, T, D)).astype(np.float32)
    dev.copy("h2d", cache.dev, cache.host_ptr, cache.stage(host_cache))

    def enqueue():
        dev.copy("h2d", rows.dev, rows.host_ptr, rows.nbytes)
        dev.copy("h2d", lens.dev, lens.host_ptr, lens.nbytes)
        dev.copy("h2d", last.dev, last.host_ptr, last.nbytes)
        lib.mla_kv_commit(0, cache.dev, lens.dev, rows.dev, B, S, D, T, dev.stream)
        lib.gather_last_hidden(0, rows.dev, last.dev, gathered.dev, B, S, D, dev.stream)
        dev.copy("d2h", cache.host_ptr, cache.dev, cache.nbytes)
        dev.copy("d2h", gathered.host_ptr, gathered.dev, gathered.nbytes)

    graph = None
    for step in range(4):
        new = rng.standard_normal((B, S, D)).astype(np.float32)
        at = rng.integers(0, T - S + 1, B).astype(np.int32)
        pick = rng.integers(0, S, B).astype(np.int32)
        rows.stage(new), lens.stage(at), last.stage(pick)
        if step == 0:
            enqueue()
        elif graph is None:
            dev.begin_capture()
            enqueue()
            graph = dev.end_capture()
            dev.launch(graph)
        else:
            dev.launch(graph)
        dev.sync()
        for b in range(B):
            host_cache[b, at[b]:at[b] + S] = new[b]
        np.testing.assert_array_equal(cache.read(np.float32, (B, T, D)), host_cache)
        np.testing.assert_array_equal(gathered.read(np.float32, (B, D)), reference.gather_last_hidden(new, pick))
    assert dev.counts["graphs"] == 1 and dev.counts["graph_launches"] == 3
    dev.destroy_graph(graph)


# ------------------------------------------------------------------------------------ engines
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_self_drafting(tmp_path_factory.mktemp("gpu") / "ckpt", nextn=K)


@pytest.fixture(scope="module")
def built(ckpt, tmp_path_factory):
    """{(mode, lowering, dtype): (engine dir, fp32 onnx reference)}, built on first use."""
    root, cache = tmp_path_factory.mktemp("engines"), {}

    def get(mode, lowering, dtype):
        if (mode, lowering, dtype) not in cache:
            ref = cache.get((mode, "ref")) or Manifest.load(export(ckpt, root / f"{mode}-ref", nextn=K, mtp_mode=mode,
                                                                   max_batch=4, max_seq_len=96))
            cache[(mode, "ref")] = ref
            exp = export(ckpt, root / f"{mode}-{lowering}-{dtype}", nextn=K, mtp_mode=mode, lowering=lowering,
                         dtype=dtype, max_batch=4, max_seq_len=96, moe_form="tensorrt" if lowering == "onnx" else None)
            out = root / f"eng-{mode}-{lowering}-{dtype}"
            r = CliRunner().invoke(app, ["build", str(exp), "-o", str(out), "--max-prefill", "8"])
            assert r.exit_code == 0, r.output
            cache[(mode, lowering, dtype)] = out, ref
        return cache[(mode, lowering, dtype)]

    return get


def _decode(backend, nextn, **kw):
    opts = DecodeOptions(nextn=nextn, eos_ids=(EOS,), think_ids=THINK, max_new_tokens=24, **kw)
    seqs, stats = generate(backend, PROMPTS, opts)
    return [s.generated for s in seqs], stats


@pytest.mark.gpu
@pytest.mark.trt
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("lowering", ["plugin", "onnx"])
@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_engines_decode_like_onnxruntime(built, mode, lowering, dtype):
    from mtp_trt.trt.runtime import TrtBackend

    engines, ref = built(mode, lowering, dtype)
    want = _decode(OrtBackend(ref), 0)[0]
    for graphs in (True, False):
        backend = TrtBackend(engines, cuda_graphs=graphs)
        for nextn in range(K + 1):
            got, stats = _decode(backend, nextn)
            if dtype == "fp32":
                assert got == want, f"nextn {nextn}, CUDA graphs {graphs}"
            else:  # rounding may flip a near tie; most tokens must agree
                pairs = [(a, b) for g, w in zip(got, want) for a, b in zip(g, w)]
                assert sum(a == b for a, b in pairs) >= 0.8 * len(pairs), f"nextn {nextn}, CUDA graphs {graphs}"
            if nextn:
                assert stats.mean_acceptance_length > 1
        assert (backend.device.counts["graph_launches"] > 0) == graphs


@pytest.mark.gpu
@pytest.mark.trt
def test_engine_step_allocates_nothing_and_rewinds(built):
    from mtp_trt.trt.runtime import TrtBackend

    engines, ref = built("eagle", "plugin", "fp32")
    backend = TrtBackend(engines)
    want = _decode(OrtBackend(ref), 0)[0]
    assert _decode(backend, K)[0] == want
    counts = dict(backend.device.counts)
    assert _decode(backend, K)[0] == want  # same batch and rows: nothing reallocated, graphs replayed
    assert backend.device.counts["alloc"] == counts["alloc"]
    assert backend.device.counts["alloc_host"] == counts["alloc_host"]
    real, rng = backend.step, np.random.default_rng(0)

    def scrambled(n, input_ids, *args, **kw):  # forced rejections: random drafts
        ids = input_ids.copy()
        ids[:, 1:] = rng.integers(0, 90, ids[:, 1:].shape)
        return real(n, ids, *args, **kw)

    backend.step = scrambled
    got, stats = _decode(backend, K)
    assert got == want and stats.mean_acceptance_length < 1.5
