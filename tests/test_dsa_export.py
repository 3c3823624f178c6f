"""DeepSeek Sparse Attention through the exported graphs on ONNX Runtime: mtp-trt's CPU operators (LightningIndexer,
MlaAttention over the selected rows) where they are available, as exports have them by default, and the onnx
lowering's standard operators without them.

Random DeepseekV32ForCausalLM and GlmMoeDsaForCausalLM checkpoints (MTP layers appended in DeepSeek's convention,
each with its own indexer) with a small index_topk, so that the top-k decides what prompts and outputs longer than
it attend to: the target graph's prefill logits within 1e-4 of transformers' class; greedy decoding with nextn 0,
MTP (eagle, vanilla) and a tree equal to transformers' `generate` token for token; the rows left in the runtime's
caches (latent and indexer key) those of the reference model over the decoded text, so that the indexer keys are
written and rewound with the latent; exact ties in the graph's index scores resolved towards the earlier row, as a
NumPy reference of the selection says; quantized exports (`--quant int8|int4`, the indexer kept in float) computing
the reference model on the dequantized weights, and their greedy MTP decoding equal to their plain greedy decoding;
the requests DSA cannot run refused in one line.
"""

from __future__ import annotations

import subprocess

import numpy as np
import onnx
import pytest
import torch

from hf_models import append_mtp_layers, make_draftable, prefill_logits
from mtp_trt.backend import OrtBackend
from mtp_trt.decode import DecodeOptions, generate
from mtp_trt.errors import MtpTrtError
from mtp_trt.exporters import model as model_module
from mtp_trt.exporters.export import export
from mtp_trt.exporters.loader import load_checkpoint
from mtp_trt.manifest import Manifest
from mtp_trt.tree import TreeShape
from test_dsa import YARN, make_dsa_model

ATOL, RTOL = 1e-4, 1e-4
NEW = 16
PROMPTS = [[5, 17, 33, 2, 8, 41, 7, 19, 60, 3, 11, 12], [70, 71, 72, 9, 30, 31, 44]]

# id -> (architecture, config over test_dsa.SMALL, MTP mode)
CASES = {
    "v32-eagle": ("DeepseekV32ForCausalLM", dict(index_topk=5, index_n_heads=8, index_head_dim=16,
                                                 rope_parameters=YARN), "eagle"),
    "glm5-shared-vanilla": ("GlmMoeDsaForCausalLM", dict(index_topk=6, index_n_heads=8, index_head_dim=16,
                                                         indexer_types=["full", "shared", "full"]), "vanilla"),
}


def greedy(hf, prompts=PROMPTS):
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, len(p):]
                .tolist() for p in prompts]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """(transformers model, checkpoint, export, transformers' greedy tokens)."""
    arch, config, mode = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf = make_draftable(make_dsa_model(arch, **config), 0.1)
    ckpt = root / "ckpt"
    hf.save_pretrained(ckpt)
    append_mtp_layers(ckpt, 2)
    out = export(ckpt, root / "export", nextn=2, mtp_mode=mode, max_seq_len=64, trees="2:2:4")
    return hf, ckpt, out, greedy(hf)


def test_graphs_select_with_the_cpu_operators(case):
    """Where mtp-trt's CPU operators are available (the default export), every graph's DSA layers run them: one
    LightningIndexer per layer with its own indexer, and every MlaAttention node attends to a selection."""
    from mtp_trt.plugins import ort_lib

    if not ort_lib.available()[0]:
        pytest.skip(f"mtp_trt.cpu operators: {ort_lib.available()[1]}")
    _, _, out, _ = case
    m = Manifest.load(out)
    assert m.raw["cpu_ops"]
    indexers = sum(m.config.has_indexer(i) for i in range(m.config.num_hidden_layers))
    for name, graph in m.raw["graphs"].items():
        nodes = onnx.load(out / graph["file"], load_external_data=False).graph.node
        ops = [n for n in nodes if n.domain == "mtp_trt.cpu" and n.op_type in ("LightningIndexer", "MlaAttention")]
        attention = [n for n in ops if n.op_type == "MlaAttention"]
        assert attention and all(len(n.input) == 7 and n.input[6] for n in attention), name
        selections = sum(n.op_type == "LightningIndexer" for n in ops)
        assert selections == indexers if name == "target" else selections >= 1, name


def test_standard_operators_decode_alike(tmp_path_factory):
    """Without the CPU operators (`--no-cpu-ops`, or where the library is absent) DSA runs in standard operators:
    greedy decoding, nextn 0 and MTP, equal to transformers' generate."""
    arch, config, mode = CASES["v32-eagle"]
    root = tmp_path_factory.mktemp("standard")
    hf = make_draftable(make_dsa_model(arch, **config), 0.1)
    hf.save_pretrained(root / "ckpt")
    append_mtp_layers(root / "ckpt", 2)
    out = export(root / "ckpt", root / "export", nextn=2, mtp_mode=mode, max_seq_len=64, trees="none", cpu_ops=False)
    assert not Manifest.load(out).raw["cpu_ops"]
    backend = OrtBackend(Manifest.load(out))
    reference = greedy(hf)
    for nextn in (0, 2):
        seqs, _ = generate(backend, PROMPTS, DecodeOptions(nextn=nextn, max_new_tokens=NEW))
        assert [s.generated for s in seqs] == reference, nextn


def test_selection_matters(case):
    """The same weights attending densely decode other tokens: the top-k is exercised by these prompts."""
    hf, _, _, reference = case
    saved = [layer.self_attn.indexer.index_topk for layer in hf.model.layers if layer.self_attn.indexer is not None]
    try:
        for layer in hf.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.index_topk = 1000
        assert greedy(hf) != reference
    finally:
        for layer, k in zip([la for la in hf.model.layers if la.self_attn.indexer is not None], saved):
            layer.self_attn.indexer.index_topk = k


def test_prefill_logits_match_transformers(case):
    hf, _, out, _ = case
    m = Manifest.load(out)
    assert m.raw["cache"]["index_head_dim"] == m.config.index_head_dim
    logits = prefill_logits(m, PROMPTS)
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].numpy()
        np.testing.assert_allclose(logits[i, :len(p)], ref, atol=ATOL, rtol=RTOL)


def test_greedy_decoding_matches_transformers_generate(case):
    hf, ckpt, out, reference = case
    backend = OrtBackend(Manifest.load(out))
    seqs, _ = generate(backend, PROMPTS, DecodeOptions(nextn=0, max_new_tokens=NEW))
    assert [s.generated for s in seqs] == reference


def test_greedy_mtp_matches_transformers_generate(case):
    """MTP drafting (nextn 1 and 2, and the tree) decodes transformers' tokens, with drafts accepted; the caches
    then hold the reference model's rows (latent and indexer key) for every committed token: rejected drafts'
    rows were rewound."""
    hf, ckpt, out, reference = case
    backend = OrtBackend(Manifest.load(out))
    model = load_checkpoint(ckpt, nextn=0)
    for opts in [DecodeOptions(nextn=n, max_new_tokens=NEW) for n in (1, 2)] + [
            DecodeOptions(nextn=2, max_new_tokens=NEW, tree=TreeShape(2, 2, 4))]:
        seqs, stats = generate(backend, PROMPTS, opts)
        assert [s.generated for s in seqs] == reference, (opts.nextn, opts.tree)
        assert stats.mean_acceptance_length > 1, (opts.nextn, opts.tree)
        caches = backend.caches["target"]
        for s in seqs:  # (slots are reordered as sequences finish)
            text = s.prompt + s.generated[:-1]  # the last token is not yet in the cache
            with torch.no_grad():
                rows = torch.stack(model(torch.tensor([text]))[2]).numpy()[:, 0]  # [L, len, C]
            cached = np.stack([c[:, :len(text)] for c in caches], 1)  # [slots, L, len, C]
            assert min(np.abs(c - rows).max() for c in cached) < ATOL * 10


# ------------------------------------------------------------------------------------------- quantized
@pytest.fixture(scope="module")
def quantizable(tmp_path_factory):
    """A GLM-5 checkpoint with a shared layer and two MTP layers that draft well, and its transformers greedy tokens."""
    arch, config, _ = CASES["glm5-shared-vanilla"]
    root = tmp_path_factory.mktemp("quant")
    hf = make_draftable(make_dsa_model(arch, **config), 0.1)
    hf.save_pretrained(root / "ckpt")
    append_mtp_layers(root / "ckpt", 2)
    return root


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_export_computes_the_reference_on_the_dequantized_weights(quantizable, name):
    """Prefill logits of a quantized export of a checkpoint already on the grid (its indexer left as it is: the export
    keeps it in float), with the quantized nodes replaced by float ones over the dequantized bytes: the reference
    model's on the same weights, within fp32 tolerance -- which also says the indexer was not quantized (at int4 its
    quantized scores select other rows on these prompts)."""
    from mtp_trt import quant
    from mtp_trt.plugins import ort_lib
    from quant_graphs import dequantized_graph, prerounded

    if not ort_lib.available()[0]:
        pytest.skip(f"mtp_trt.cpu operators: {ort_lib.available()[1]}")
    keep = ("mlp.gate.weight", "indexer.wq_b.weight", "indexer.wk.weight", "indexer.weights_proj.weight")
    rounded = prerounded(quantizable / "ckpt", quantizable / f"rounded-{name}", quant.Scheme(name, 32), keep)
    out = export(rounded, quantizable / f"exact-{name}", nextn=1, max_seq_len=64, trees="none", quant_scheme=name,
                 group_size=32)
    m = Manifest.load(out)
    assert m.raw["quant"]["scheme"] == name
    nodes = onnx.load(out / "target.onnx", load_external_data=False).graph.node
    assert {"QMatMul", "QMoE", "LightningIndexer"} <= {n.op_type for n in nodes}
    ids = np.zeros((len(PROMPTS), max(map(len, PROMPTS))), np.int64)
    for i, p in enumerate(PROMPTS):
        ids[i, :len(p)] = p
    exact = prefill_logits(m, PROMPTS, dequantized_graph(out / "target.onnx"))
    with torch.no_grad():
        ref = load_checkpoint(rounded, max_positions=64)(torch.from_numpy(ids))[0].numpy()
    for i, p in enumerate(PROMPTS):
        np.testing.assert_allclose(exact[i, :len(p)], ref[i, :len(p)], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["int8", pytest.param("int4", marks=pytest.mark.slow)])
def test_greedy_mtp_on_a_quantized_export_equals_its_plain_greedy_decoding(quantizable, name):
    """Every MTP form decodes plain greedy decoding's tokens.  At int8 some drafts are accepted (the acceptance path
    runs); at int4 this random checkpoint's target agrees with its float self at about half the positions, so its
    drafts are accepted by chance only, and the check is the verify and rejection path's."""
    from mtp_trt.plugins import ort_lib

    if not ort_lib.available()[0]:
        pytest.skip(f"mtp_trt.cpu operators: {ort_lib.available()[1]}")
    out = export(quantizable / "ckpt", quantizable / f"decode-{name}", nextn=2, mtp_mode="vanilla", max_seq_len=64,
                 trees="2:2:4", quant_scheme=name)
    backend = OrtBackend(Manifest.load(out))
    plain, _ = generate(backend, PROMPTS, DecodeOptions(nextn=0, max_new_tokens=NEW))
    for opts in [DecodeOptions(nextn=n, max_new_tokens=NEW) for n in (1, 2)] + [
            DecodeOptions(nextn=2, max_new_tokens=NEW, tree=TreeShape(2, 2, 4))]:
        seqs, stats = generate(backend, PROMPTS, opts)
        assert [s.generated for s in seqs] == [s.generated for s in plain], (opts.nextn, opts.tree)
        assert stats.mean_acceptance_length > 1 or name == "int4", (opts.nextn, opts.tree)


def stable_select(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """NumPy reference of the graphs' selection: the k visible rows with the highest scores, the earlier row first
    among equal scores."""
    s = np.where(visible.numpy(), scores.numpy().astype(np.float64), -np.inf)
    order = np.argsort(-s, axis=-1, kind="stable")[..., :k]
    picked = np.zeros(s.shape, bool)
    np.put_along_axis(picked, order, True, -1)
    return torch.from_numpy(picked) & visible


def test_ties_keep_the_earlier_rows(tmp_path, monkeypatch):
    """One layer's indexer queries all zero (every score 0: a tie across all rows) and two heads elsewhere (many
    exact zeros): the target graph's logits are the reference model's with the NumPy selection above."""
    hf = make_dsa_model("DeepseekV32ForCausalLM", index_topk=4, index_n_heads=2, index_head_dim=16)
    with torch.no_grad():
        hf.model.layers[1].self_attn.indexer.wq_b.weight.zero_()
    hf.save_pretrained(tmp_path / "ckpt")
    out = export(tmp_path / "ckpt", tmp_path / "export", nextn=0, max_seq_len=32, trees="none")
    logits = prefill_logits(Manifest.load(out), PROMPTS[:1])
    monkeypatch.setattr(model_module, "select_topk", stable_select)
    with torch.no_grad():
        ref = load_checkpoint(tmp_path / "ckpt")(torch.tensor(PROMPTS[:1]))[0]
    np.testing.assert_allclose(logits, ref.numpy(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("option, message", [
    (["--quant", "int8", "--lowering", "plugin"],
     "--quant int8 --lowering plugin: {cfg}: DeepseekV32ForCausalLM (DeepSeek Sparse Attention) has TensorRT engines "
     "with unquantized weights only; leave --quant out, or export with --lowering onnx"),
    (["--moe-form", "tensorrt"], "--moe-form tensorrt: {cfg}: DeepseekV32ForCausalLM (DeepSeek Sparse Attention) is "
                                 "not supported in TensorRT engines; leave --moe-form out"),
])
def test_unsupported_requests_are_refused(tmp_path, option, message):
    hf = make_dsa_model("DeepseekV32ForCausalLM", index_topk=4, index_n_heads=2, index_head_dim=16)
    hf.save_pretrained(tmp_path / "ckpt")
    r = subprocess.run(["mtp-trt", "export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "out"), *option],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"error: {message.format(cfg=tmp_path / 'ckpt' / 'config.json')}\n"
    assert not (tmp_path / "out").exists()


def test_inspect_shows_the_sparse_attention(case):
    _, ckpt, _, _ = case
    r = subprocess.run(["mtp-trt", "inspect", str(ckpt)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = dict(line.split("  ", 1) for line in r.stdout.splitlines())
    cfg = Manifest.load(case[2]).config
    assert f"DSA, top {cfg.index_topk} of the cached rows" in rows["attention"]
    values = cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim
    assert rows["cache"].strip().startswith(f"{values} values per token and layer")
    layers = cfg.num_hidden_layers
    assert f"{values * 4 * layers} bytes per token in fp32" in rows["cache"]


def test_tensorrt_build_is_refused(case):
    from mtp_trt.trt.builder import load_export

    out = case[2]
    with pytest.raises(MtpTrtError, match=r"\(DeepSeek Sparse Attention\) runs in TensorRT engines through the "
                                          r"MlaSparseAttention plugin only: re-export with --lowering plugin"):
        load_export(out)
