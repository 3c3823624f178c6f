"""DeepSeek Sparse Attention in the plugin lowering: the MlaSparseAttention contract's torch form against the CUDA
kernels' NumPy references (plugins/reference.py: the indexer's selection, then sparse MLA), the exported graphs'
plugin nodes, and engines built from them with the installed TensorRT (TensorRT for RTX builds without a GPU;
marker `trt`).  Running the engines needs a GPU (tests/kernels/test_gpu_kernels.py for the kernels)."""

from __future__ import annotations

import collections
import json
import subprocess

import numpy as np
import onnx
import pytest
import torch
from typer.testing import CliRunner

from mtp_trt import ops
from mtp_trt.cli import app
from mtp_trt.exporters.export import export
from mtp_trt.exporters.lowering import mla_sparse_decomposed
from mtp_trt.manifest import Manifest
from mtp_trt.plugins import reference as ref
from test_dsa import make_dsa_model
from hf_models import append_mtp_layers, make_draftable


@pytest.mark.parametrize("tree", [False, True])
def test_decomposed_contract_matches_the_kernel_references(tree):
    """mla_sparse_decomposed (what the exporter traces for the plugin node) equals reference.dsa_select followed by
    reference.mla_sparse_decode: the new rows committed, each query's index_topk rows of highest score (causal or
    tree visibility), attention over those alone.  Integer-valued indexer inputs make many scores tie exactly."""
    rng = np.random.default_rng(3 + tree)
    B, S, H, dl, dr, hi, di, T, k = 2, 3, 4, 16, 8, 4, 8, 24, 6
    q = rng.standard_normal((B, S, H, dl + dr)).astype(np.float32)
    cache = np.concatenate([rng.standard_normal((B, T, dl + dr)), rng.integers(-1, 2, (B, T, di))], -1)
    new = np.concatenate([rng.standard_normal((B, S, dl + dr)), rng.integers(-1, 2, (B, S, di))], -1)
    cache, new = cache.astype(np.float32), new.astype(np.float32)
    iq = rng.integers(-1, 2, (B, S, hi, di)).astype(np.float32)
    iw = rng.integers(0, 3, (B, S, hi)).astype(np.float32)
    past = np.array([2, 15], np.int32)
    mask = (np.tril(rng.integers(0, 2, (B, S, S))) | np.eye(S, dtype=np.int64)).astype(bool) if tree else None
    out, committed = mla_sparse_decomposed(*(torch.from_numpy(a) for a in (q, new, cache, past, iq, iw)), dl, 0.3, k,
                                           None if mask is None else torch.from_numpy(mask))
    want_cache = ref.mla_kv_commit(cache, past, new)
    sel, _ = ref.dsa_select(iq, iw, want_cache, past, key_offset=dl + dr, k=k, scale=di**-0.5,
                            mask=None if mask is None else mask.astype(np.uint8))
    assert (sel[0, 0] == -1).sum() == k - 3  # 2 cached rows and the new one: fewer than k, all taken
    want, _ = ref.mla_sparse_decode(q, want_cache, past, sel, dl=dl, scale=0.3)
    np.testing.assert_array_equal(committed.numpy(), want_cache)
    np.testing.assert_allclose(out.numpy(), want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def dsa_ckpt(tmp_path_factory):
    """A DeepSeek-V3.2 checkpoint (index_topk 4) with two MTP layers."""
    root = tmp_path_factory.mktemp("dsa-ckpt")
    hf = make_draftable(make_dsa_model("DeepseekV32ForCausalLM", index_topk=4, index_n_heads=2, index_head_dim=16),
                        0.1)
    hf.save_pretrained(root / "ckpt")
    append_mtp_layers(root / "ckpt", 2)
    return root / "ckpt"


@pytest.fixture(scope="module")
def plugin_export(dsa_ckpt, tmp_path_factory):
    """The checkpoint exported in the plugin lowering: eagle, K = 2, one tree."""
    return export(dsa_ckpt, tmp_path_factory.mktemp("dsa-plugin") / "export", nextn=2, mtp_mode="eagle",
                  lowering="plugin", max_batch=2, max_seq_len=64, trees="2:2:4")


@pytest.fixture(scope="module")
def python_engines(plugin_export, tmp_path_factory):
    """The export's engines, built with the Python plugins (TensorRT for RTX needs no GPU)."""
    return _build(plugin_export, tmp_path_factory.mktemp("dsa-engines") / "engines", "python")


def test_plugin_lowering_emits_sparse_attention_nodes(plugin_export):
    """Every attention of every graph is one MlaSparseAttention node (none of the dense plugin) with the checkpoint's
    index_topk; the tree graph's nodes take the tree mask; the caches are the latent plus the indexer key."""
    m = Manifest.load(plugin_export)
    cfg, layers = m.config, m.config.num_hidden_layers
    want = {"target": layers, "mtp_0": 1, "step_0": layers, "step_1": layers + 1, "step_2": layers + 2,
            "tree_2_2_4": layers + 2}
    assert set(m.graphs) == set(want)
    for name, g in m.graphs.items():
        model = onnx.load(str(plugin_export / g.file), load_external_data=False)
        counts = collections.Counter(n.op_type for n in model.graph.node if n.domain == ops.DOMAIN)
        assert counts["MlaSparseAttention"] == want[name] and "MlaGenerationAttention" not in counts, (name, counts)
        nodes = [n for n in model.graph.node if n.op_type == "MlaSparseAttention"]
        for n in nodes:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            assert attrs["index_topk"] == cfg.index_topk and attrs["kv_lora_rank"] == cfg.kv_lora_rank
            assert attrs["plugin_version"] == str(ops.VERSION).encode()
        masked = sum(len(n.input) == 7 for n in nodes)  # the tree's verification and MTP depth 1 take the tree mask
        assert masked == (layers + 1 if name.startswith("tree_") else 0), name
        cache = next(t for t in g.inputs if t.name in ("kv_0", "kv"))
        assert cache.shape[-1] == cfg.cache_dim == cfg.latent_dim + cfg.index_head_dim


def test_shared_indexer_layers_are_refused_in_the_plugin_lowering(tmp_path):
    hf = make_dsa_model("GlmMoeDsaForCausalLM", index_topk=4, index_n_heads=2, index_head_dim=16,
                        indexer_types=["full", "shared", "full"])
    hf.save_pretrained(tmp_path / "ckpt")
    r = subprocess.run(["mtp-trt", "export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "out"), "--lowering",
                        "plugin"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (f"error: --lowering plugin: {tmp_path / 'ckpt' / 'config.json'}: GlmMoeDsaForCausalLM (DeepSeek "
                        "Sparse Attention): layer(s) 1 share the previous layer's selection (indexer_types \"shared\"), "
                        "which the TensorRT plugin does not take; export with --lowering onnx\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.trt
@pytest.mark.slow
@pytest.mark.parametrize("plugins", ["python", "cpp"])
def test_build_engines_with_the_sparse_plugin(request, plugin_export, tmp_path, plugins):
    """`mtp-trt build` of the export: every graph's MlaSparseAttention nodes become our plugin layers (the builder
    counts them per op) and the engines build, with the Python plugins and with the C++ ones where
    libmtp_trt_plugins.so is built."""
    from mtp_trt.trt import compat, cpp_plugins

    if plugins == "cpp" and cpp_plugins.find_library() is None:
        pytest.skip(f"{cpp_plugins.LIB_NAME} is not built (cmake -S plugins/cpp -B plugins/cpp/build)")
    engines = request.getfixturevalue("python_engines") if plugins == "python" else \
        _build(plugin_export, tmp_path / "engines", plugins)
    _check_engines(plugin_export, engines)


@pytest.mark.trt
@pytest.mark.slow
def test_runtime_decodes_dsa_engines_as_onnxruntime(dsa_ckpt, python_engines, tmp_path):
    """TrtBackend on the DSA engines, over the host stand-ins of tests/trt_fakes.py (each engine runs its graph's
    onnx lowering on ONNX Runtime and writes the cache rows -- latent and indexer key -- in place, as the plugin
    does): caches of the wider rows, their bindings, chunked prefill and the tree path's commits give ONNX Runtime's
    greedy tokens for nextn 0..2 and a tree, on prompts longer than index_topk."""
    from mtp_trt.backend import OrtBackend
    from mtp_trt.decode import DecodeOptions, generate
    from mtp_trt.tree import TreeShape
    from trt_fakes import fake_backend

    ref = Manifest.load(export(dsa_ckpt, tmp_path / "onnx", nextn=2, mtp_mode="eagle", max_batch=2, max_seq_len=64,
                               trees="2:2:4"))
    prompts = [[5, 17, 33, 2, 8, 41, 7, 19, 60, 3, 11], [70, 71, 72, 9, 30]]
    for opts in [DecodeOptions(nextn=n, max_new_tokens=12) for n in range(3)] + \
            [DecodeOptions(nextn=2, max_new_tokens=12, tree=TreeShape(2, 2, 4))]:
        want = [s.generated for s in generate(OrtBackend(ref), prompts, opts)[0]]
        got = [s.generated for s in generate(fake_backend(python_engines, ref), prompts, opts)[0]]
        assert got == want, opts


def _build(export_dir, out, plugins: str):
    from mtp_trt.trt import compat

    api, cc = compat.load("auto"), compat.gpu()[0]
    arch = "native" if cc and cc in api.buildable_archs() else "8.9"
    r = CliRunner().invoke(app, ["build", str(export_dir), "-o", str(out), "--target-arch", arch, "--plugins",
                                 plugins, "--max-prefill", "8"])
    assert r.exit_code == 0, r.output
    return out


def _check_engines(plugin_export, out):
    info = json.loads((out / "engines.json").read_text())
    m = Manifest.load(plugin_export)
    for name, e in info["engines"].items():
        assert e["plugin_layers"].get("MlaSparseAttention", 0) >= 1 and "MlaGenerationAttention" not in \
            e["plugin_layers"], (name, e["plugin_layers"])
    assert set(info["engines"]) == set(m.graphs)


def test_check_compares_dense_and_sparse_regimes():
    """mtp-trt check's comparisons of DSA engines: a dense regime (every visible row selected, enforced at every
    precision) and, where the cache is longer than index_topk, a sparse one enforced for fp32 engines only; dense
    MLA keeps its one comparison over the whole cache.  make_inputs keeps past_len within the regime."""
    from types import SimpleNamespace

    from mtp_trt.trt import check

    dsa = SimpleNamespace(dsa=True, index_topk=32)
    assert check.regimes(SimpleNamespace(dsa=False), 64, 3, "bf16") == [check.Regime("", 61, True)]
    assert check.regimes(dsa, 64, 3, "fp32") == [check.Regime("dense", 26, True), check.Regime("sparse", 61, True)]
    assert check.regimes(dsa, 64, 3, "bf16") == [check.Regime("dense", 26, True), check.Regime("sparse", 61, False)]
    assert check.regimes(dsa, 20, 3, "fp16") == [check.Regime("dense", 17, True)]  # the cache never exceeds top-k
    graph = SimpleNamespace(inputs=[SimpleNamespace(name="input_ids", shape=["B", "S"], dtype="int32"),
                                    SimpleNamespace(name="past_len", shape=["B"], dtype="int32")])
    rng = np.random.default_rng(0)
    for max_past in (0, 5, None):
        for _ in range(20):
            feed = check.make_inputs(graph, {"B": 4, "S": 3, "T": 64}, 10, rng, max_past)
            assert feed["past_len"].max() <= (61 if max_past is None else max_past)


def test_sparse_workspace_bound_covers_every_shape_of_the_profile():
    """The workspace MlaSparseAttention reserves at build time (sparse_workspace_bound) holds what enqueue lays out
    for every (B, S) of the profile on GPUs of any SM count: the index scores, the selected rows and the split-KV
    partials at the split count enqueue uses (the kernel library's, capped at sparse_splits_bound)."""
    from mtp_trt.plugins import trt_plugins as tp

    for b_range, s_range, H, Dl, T, K in [((1, 8), (1, 4), 128, 512, 4096, 2048), ((1, 2), (1, 64), 16, 64, 64, 4),
                                          ((2, 3), (3, 3), 1, 16, 100, 7)]:
        bound = tp.sparse_workspace_bound(b_range, s_range, H, Dl, T, K)
        for b in range(b_range[0], b_range[1] + 1):
            for s in range(s_range[0], s_range[1] + 1):
                for sms in (1, 46, 108, 132, 192):
                    splits = min(tp.mla_num_splits(b * s, 1, H, K, sms), tp.sparse_splits_bound(b, s, H, K))
                    assert sum(tp.sparse_workspace_size(b, s, H, Dl, T, K, splits)) <= bound, (b, s, sms)
