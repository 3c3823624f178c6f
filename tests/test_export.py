"""Exported graphs: ONNX Runtime reproduces the PyTorch reference through prefill and decode steps with
rejections and rewinds (both MTP modes); in-graph acceptance equals a plain-loop reference; the plugin
lowering's custom nodes carry their documented contract; bad requests fail cleanly, leaving nothing."""

import collections
import warnings

import numpy as np
import onnx
import pytest
import torch

from mtp_trt.errors import MtpTrtError
from mtp_trt.exporters import export as export_mod
from mtp_trt.exporters.export import export
from mtp_trt.exporters.lowering import accept_decomposed
from mtp_trt.exporters.loader import load_checkpoint
from runtime_models import THINK, make_random
from mtp_trt.manifest import Manifest
from mtp_trt import ops
from mtp_trt.ops import OPS
from mtp_trt.plugins import reference
from mtp_trt.plugins import ort_lib

# fp32 graphs vs the fp32 reference: the same math in another order (ORT's matmuls, the two-block
# softmax); observed ~5e-6, so 1e-4 catches any real difference.
ATOL, RTOL = 1e-4, 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_random(tmp_path_factory.mktemp("ckpt") / "model", nextn=2)


@pytest.fixture(scope="module")
def ckpt_folded(tmp_path_factory):
    """kv_lora_rank = 12 (<= the head dims): the exporter folds W^UK and W^UV into the projections
    (graphs.folded_mla); the default checkpoint's rank 32 keeps the per-head matmuls."""
    return make_random(tmp_path_factory.mktemp("ckpt") / "folded", nextn=2, kv_lora_rank=12)


@pytest.fixture(scope="module", params=[("eagle", "ckpt"), ("vanilla", "ckpt"), ("eagle", "ckpt_folded")],
                ids=["eagle", "vanilla", "eagle-folded"])
def exported(request, tmp_path_factory):
    mode, ckpt = request.param[0], request.getfixturevalue(request.param[1])
    out = export(ckpt, tmp_path_factory.mktemp("exp") / mode, nextn=2, mtp_mode=mode, max_seq_len=64)
    return Manifest.load(out, verify_hashes=True)


def _run(sess, feed):
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))


def test_manifest_records_the_contract(exported):
    m = exported
    assert m.nextn == 2 and m.lowering == "onnx" and m.think_ids == THINK
    assert set(m.graphs) == {"target", "mtp_0", "step_0", "step_1", "step_2", "tree_2_2_4"} | (
        {"mtp_1"} if m.mtp_mode == "vanilla" else set())  # the default tree up to depth 2
    assert m.mtp_graphs == (["mtp_0", "mtp_0"] if m.mtp_mode == "eagle" else ["mtp_0", "mtp_1"])
    for g in m.graphs.values():
        model = onnx.load(m.root / g.file)
        onnx.checker.check_model(model)
        assert [i.name for i in model.graph.input] == [t.name for t in g.inputs]
        assert [o.name for o in model.graph.output] == [t.name for t in g.outputs]
        assert len(g.kv_inputs) == len(g.kv_outputs)
    assert m.raw["cache"]["kv_lora_rank"] == m.config.kv_lora_rank
    assert (m.root / "tokenizer.json").is_file()


def test_onnxruntime_matches_torch_through_decode_with_rewinds(exported):
    """Two sequences (prompts of 7 and 4 tokens, right-padded); then 5 verify steps with K = 2 drafts
    chosen so that some steps accept all, some part, some none; the caches are rewound by moving
    the lengths back.  At every step ORT's logits, hidden states, new cache rows, acceptance and MTP
    outputs match the PyTorch reference run on its own caches."""
    m = exported
    model = load_checkpoint(m.raw["checkpoint"], nextn=2 if m.mtp_mode == "vanilla" else 1, max_positions=64)
    cfg, b, t = m.config, 2, 64
    target = ort_lib.session(str(m.root / "target.onnx"))
    mtps = {n: ort_lib.session(str(m.root / m.graphs[n].file))
            for n in set(m.mtp_graphs)}
    g = np.random.default_rng(0)
    ort_kv = [np.zeros((b, t, cfg.latent_dim), np.float32) for _ in range(cfg.num_hidden_layers)]
    ref_kv = [torch.zeros(b, t, cfg.latent_dim) for _ in range(cfg.num_hidden_layers)]
    lens = np.array([7, 4])
    ids = g.integers(0, 90, (b, 7)).astype(np.int32)
    feed = {"input_ids": ids, "past_len": np.zeros(b, np.int32), "thinking": np.zeros(b, np.int32),
            "relaxed_topk": np.array(0, np.int32), "relaxed_delta": np.array(0, np.float32)}
    out = _run(target, feed | {f"kv_{i}": c for i, c in enumerate(ort_kv)})
    for i in range(b):
        with torch.no_grad():
            logits, hidden, lat = model(torch.from_numpy(ids[i:i + 1, :lens[i]]).long())
        np.testing.assert_allclose(out["logits"][i, :lens[i]], logits[0], atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(out["hidden_states"][i, :lens[i]], hidden[0], atol=ATOL, rtol=RTOL)
        for layer in range(cfg.num_hidden_layers):
            ort_kv[layer][i, :lens[i]] = out[f"new_kv_{layer}"][i, :lens[i]]
            ref_kv[layer][i, :lens[i]] = lat[layer][0]
    last = out["target_tokens"][np.arange(b), lens - 1]
    plans = [(2, 2), (0, 1), (1, 0), (2, 0), (0, 2)]  # drafts that follow the target for this many tokens
    accepted_counts = []
    for step, plan in enumerate(plans):
        truth = []  # the reference's greedy continuation tells which drafts are right
        for i in range(b):
            seq = [int(last[i])]
            with torch.no_grad():
                for _ in range(2):
                    seq_logits, _, _ = model(torch.tensor([seq]), past=[c[i:i + 1] for c in ref_kv],
                                             past_len=torch.tensor([lens[i]]), absorbed=True)
                    seq.append(int(seq_logits[0, -1].argmax()))
            truth.append(seq[1:])
        drafts = np.array([[truth[i][j] if j < plan[i] else (truth[i][j] + 1) % 90 for j in range(2)]
                           for i in range(b)], np.int32)
        ids = np.concatenate([last[:, None], drafts], 1).astype(np.int32)
        feed |= {"input_ids": ids, "past_len": lens.astype(np.int32)}
        out = _run(target, feed | {f"kv_{i}": c for i, c in enumerate(ort_kv)})
        with torch.no_grad():
            ref_logits, ref_hidden, ref_lat = model(torch.from_numpy(ids).long(), past=ref_kv,
                                                    past_len=torch.from_numpy(lens), absorbed=True)
        np.testing.assert_allclose(out["logits"], ref_logits, atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(out["hidden_states"], ref_hidden, atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(out["new_kv_0"], ref_lat[0], atol=ATOL, rtol=RTOL)
        toks, n, _, _ = reference.accept_relaxed(ref_logits.numpy(), drafts, np.zeros(b, np.int32), topk=0,
                                                 delta=0.0, think_start_id=-1, think_end_id=-1)
        np.testing.assert_array_equal(out["num_accepted"], n)
        np.testing.assert_array_equal(out["accepted_tokens"], toks)
        accepted_counts += n.tolist()
        # MTP depth 1 over the newly accepted rows: (h_i, t_{i+1}) at rows lens .. lens + n.
        mtp_name = m.mtp_graphs[0]
        mtp_kv = np.zeros((b, t, cfg.latent_dim), np.float32)
        mtp_out = _run(mtps[mtp_name], {"hidden": out["hidden_states"], "next_tokens": out["accepted_tokens"].clip(0),
                                        "past_len": lens.astype(np.int32), "kv": mtp_kv})
        with torch.no_grad():
            mlog, mh, mlat = model.mtp_forward(0, ref_hidden, torch.from_numpy(toks.clip(0)).long(),
                                               past=torch.from_numpy(mtp_kv), past_len=torch.from_numpy(lens),
                                               absorbed=True)
        np.testing.assert_allclose(mtp_out["draft_logits"], mlog, atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(mtp_out["hidden_out"], mh, atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(mtp_out["new_kv"], mlat, atol=ATOL, rtol=RTOL)
        np.testing.assert_array_equal(mtp_out["draft_tokens"], mlog.argmax(-1).numpy())
        np.testing.assert_allclose(mtp_out["draft_probs"], mlog.softmax(-1).amax(-1), atol=1e-6, rtol=1e-5)
        if m.mtp_mode == "vanilla":
            out2 = _run(mtps["mtp_1"], {"hidden": mtp_out["hidden_out"], "next_tokens": mtp_out["draft_tokens"],
                                        "past_len": lens.astype(np.int32), "kv": mtp_kv})
            with torch.no_grad():
                mlog2, _, _ = model.mtp_forward(1, mh, mlog.argmax(-1), past=torch.from_numpy(mtp_kv),
                                                past_len=torch.from_numpy(lens), absorbed=True)
            np.testing.assert_allclose(out2["draft_logits"], mlog2, atol=ATOL, rtol=RTOL)
        # Commit the accepted rows, rewind the rest (they stay in the buffers, beyond the lengths).
        for layer in range(cfg.num_hidden_layers):
            for i in range(b):
                ort_kv[layer][i, lens[i]: lens[i] + 3] = out[f"new_kv_{layer}"][i]
                ref_kv[layer][i, lens[i]: lens[i] + 3] = ref_lat[layer][i]
        last = out["accepted_tokens"][np.arange(b), n]
        lens = lens + n + 1
    assert set(accepted_counts) == {0, 1, 2}, "the plan must exercise full, partial and no acceptance"


# ------------------------------------------------------------------------------------- acceptance
class _Accept(torch.nn.Module):
    def forward(self, logits, input_ids, thinking, topk, delta):
        return accept_decomposed(logits, input_ids, thinking, topk, delta, *THINK)


@pytest.fixture(scope="module")
def accept_graph(tmp_path_factory):
    path = tmp_path_factory.mktemp("acc") / "accept.onnx"
    args = (torch.randn(2, 4, 16), torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
            torch.tensor(2, dtype=torch.int32), torch.tensor(0.1))
    names = ["logits", "input_ids", "thinking", "topk", "delta"]
    axes = {"logits": {0: "B", 1: "S", 2: "V"}, "input_ids": {0: "B", 1: "S"}, "thinking": {0: "B"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(_Accept(), args, str(path), dynamo=False, opset_version=18, input_names=names,
                          output_names=["tokens", "n", "thinking_out"], dynamic_axes=axes)
    return ort_lib.session(str(path))


def test_in_graph_acceptance_equals_plain_loop_reference(accept_graph):
    """600 random cases: K from 0 to 6, logits with planted ties and near-ties, drafts that follow the
    argmax or the runner-up for a while, think tokens among the drafts, relaxed top-N and delta on/off."""
    g = np.random.default_rng(0)
    v = 92
    relaxed_hits = 0
    for case in range(600):
        b, k = int(g.integers(1, 4)), int(g.integers(0, 7))
        logits = g.normal(size=(b, k + 1, v)).astype(np.float32) * g.choice([0.5, 3.0])
        if case % 3 == 0:
            logits = np.round(logits)  # many exact ties
        logits = logits.astype(np.float32)
        order = np.argsort(-logits, -1, kind="stable")
        drafts = np.where(g.random((b, k)) < 0.7, order[:, :k, 0], order[:, :k, 1]).astype(np.int32)
        drafts = np.where(g.random((b, k)) < 0.1, g.integers(0, v, (b, k)), drafts).astype(np.int32)
        drafts = np.where(g.random((b, k)) < 0.1, g.choice(THINK, (b, k)), drafts).astype(np.int32)
        ids = np.concatenate([g.integers(0, v, (b, 1)), drafts], 1).astype(np.int32)
        thinking = g.integers(0, 2, b).astype(np.int32)
        topk, delta = int(g.choice([0, 1, 2, 5])), float(g.choice([0.0, 0.05, 0.3, 1.0]))
        got = accept_graph.run(None, {"logits": logits, "input_ids": ids, "thinking": thinking,
                                      "topk": np.array(topk, np.int32), "delta": np.array(delta, np.float32)})
        toks, n, _, th = reference.accept_relaxed(logits, drafts, thinking, topk=topk, delta=delta,
                                                  think_start_id=THINK[0], think_end_id=THINK[1])
        strict_n = reference.accept_strict(drafts, logits=logits)[1]
        relaxed_hits += int((n > strict_n).sum())
        np.testing.assert_array_equal(got[0], toks, err_msg=f"case {case}")
        np.testing.assert_array_equal(got[1], n, err_msg=f"case {case}")
        np.testing.assert_array_equal(got[2], th, err_msg=f"case {case}")
    assert relaxed_hits > 50, "the sweep must exercise relaxed acceptance"


# ------------------------------------------------------------------------------------ plugin lowering
@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
def test_plugin_lowering_nodes_carry_the_documented_contract(ckpt, tmp_path, mode):
    m = Manifest.load(export(ckpt, tmp_path / "plugin", nextn=2, mtp_mode=mode, lowering="plugin",
                             max_seq_len=64))
    cfg = m.config
    attention_nodes = {"target": cfg.num_hidden_layers} | {f"step_{n}": cfg.num_hidden_layers + n
                                                            for n in range(m.nextn + 1)}
    trees = m.raw["trees"]
    assert trees == ["2:2:4"]  # the default tree up to depth 2 (eagle: depth 1 and one expansion; vanilla: modules
    attention_nodes |= {f"tree_{t.replace(':', '_')}": cfg.num_hidden_layers + int(t[0]) for t in trees}  # 1, 2)
    for name, g in m.graphs.items():
        model = onnx.load(m.root / g.file)
        onnx.checker.check_model(model)
        assert any(o.domain == "mtp_trt" and o.version == ops.VERSION for o in model.opset_import)
        custom = [n for n in model.graph.node if n.domain == "mtp_trt"]
        attn = [n for n in custom if n.op_type == "MlaGenerationAttention"]
        accept = [n for n in custom if n.op_type == "MtpAccept"]
        assert len(attn) == attention_nodes.get(name, 1)
        assert len(accept) == (1 if name == "target" or name.startswith("step_") and name != "step_0" else 0)
        # (a tree's acceptance is standard operators; its attention nodes take the tree mask, an optional input)
        assert {n.op_type for n in custom} <= set(OPS)
        for node in custom:
            spec = OPS[node.op_type]
            assert len(spec.inputs) - spec.optional <= len(node.input) <= len(spec.inputs)
            assert len(node.output) == len(spec.outputs)
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert set(attrs) == {a for a, _ in spec.attributes} | {ops.PLUGIN_VERSION_ATTRIBUTE}
            assert attrs[ops.PLUGIN_VERSION_ATTRIBUTE] == str(ops.VERSION).encode()
            if node.op_type == "MlaGenerationAttention":
                assert attrs["kv_lora_rank"] == cfg.kv_lora_rank
                assert attrs["softmax_scale"] == pytest.approx(cfg.softmax_scale, rel=1e-6)
            else:
                assert (attrs["think_start_id"], attrs["think_end_id"]) == THINK
        # Each cache runs through a chain of attention nodes (kv_cache -> kv_cache_out -> the next node's
        # kv_cache ...) that ends in the graph output <cache>_out, and nothing else reads it: TensorRT then
        # aliases the whole chain to the one buffer bound to the input and the output.
        by_cache = {n.input[2]: n for n in attn}
        readers = collections.Counter(i for n in model.graph.node for i in n.input)
        outputs = {o.name for o in model.graph.output}
        chained = 0
        assert g.kv_outputs == [c + "_out" for c in g.kv_inputs]
        for cache, out in zip(g.kv_inputs, g.kv_outputs):
            value = cache
            while value in by_cache:
                assert readers[value] == 1, f"{name}: {value} is read by more than its attention node"
                value, chained = by_cache[value].output[1], chained + 1
            assert value == out and out in outputs, f"{name}: {cache}'s chain ends in {value}, not {out}"
        assert chained == len(attn), f"{name}: attention nodes outside the cache chains"
        assert not any(o.name.startswith("new_kv") for o in model.graph.output)


# ------------------------------------------------------------------------------------ bad requests
@pytest.mark.parametrize("kwargs,message", [
    (dict(nextn=3, mtp_mode="vanilla"), "--nextn 3 needs 3 MTP modules in vanilla mode"),
    (dict(dtype="int8"), "--dtype: unknown dtype 'int8'; expected one of fp32, fp16, bf16"),
    (dict(lowering="tensorrt"), "--lowering: unknown lowering 'tensorrt'; expected one of onnx, plugin"),
    (dict(mtp_mode="medusa"), "--mtp-mode: unknown mode 'medusa'"),
    (dict(max_seq_len=10**6), "--max-seq-len must be in 1..512"),
])
def test_bad_requests(ckpt, tmp_path, kwargs, message):
    with pytest.raises(MtpTrtError, match=message.replace("(", r"\(")):
        export(ckpt, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_output_directory_with_other_content(ckpt, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(MtpTrtError, match="exists and is not empty"):
        export(ckpt, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]


def test_interrupted_export_leaves_nothing(ckpt, tmp_path):
    def interrupt(msg):
        if "mtp_0" in msg:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export(ckpt, tmp_path / "out", progress=interrupt)
    assert list(tmp_path.iterdir()) == [], "no partial output may remain"


def test_graphs_share_one_weights_file(ckpt, tmp_path):
    """Every weight is stored once in weights.bin, though the step graphs repeat the main model's; the
    graph files hold none (the export streams them there); the manifest hashes it."""
    m = Manifest.load(export(ckpt, tmp_path / "out", nextn=1, max_seq_len=64), verify_hashes=True)
    assert sorted(p.name for p in m.root.iterdir() if p.suffix not in (".onnx", ".json")) == ["weights.bin"]
    sizes, distinct = 0, set()
    for g in m.graphs.values():
        model = onnx.load(m.root / g.file)  # external data resolved from weights.bin
        big = [t for t in model.graph.initializer if len(t.raw_data) >= export_mod.INLINE_BYTES]
        sizes += sum(len(t.raw_data) for t in big)
        distinct |= {t.raw_data for t in big}
        assert (m.root / g.file).stat().st_size < 200_000
    assert len(distinct) == m.raw["weights"]["tensors"]
    assert sum(map(len, distinct)) <= m.raw["weights"]["bytes"] < sizes / 2  # stored once, not per graph
    sess = ort_lib.session(str(m.root / "step_1.onnx"))
    assert [o.name for o in sess.get_outputs()][:2] == ["accepted_tokens", "num_accepted"]
    again = export(ckpt, tmp_path / "again", nextn=1, max_seq_len=64)  # the same files, byte for byte
    assert {p.name: p.read_bytes() for p in again.iterdir()} == {p.name: p.read_bytes() for p in m.root.iterdir()}
    with open(m.root / "weights.bin", "r+b") as f:
        f.seek(5000)
        f.write(b"x")
    with pytest.raises(MtpTrtError, match="weights.bin: SHA-256 differs"):
        Manifest.load(m.root, verify_hashes=True)


@pytest.mark.parametrize("dtype,onnx_type", [("fp16", onnx.TensorProto.FLOAT16), ("bf16", onnx.TensorProto.BFLOAT16)])
def test_half_precision_exports(ckpt, tmp_path, dtype, onnx_type):
    """fp16/bf16 graphs (for TensorRT) pass the checker and strict shape inference (done by export) with
    caches and hidden states in that dtype and logits in fp32; fp16 runs on ORT's CPU close to fp32."""
    m = Manifest.load(export(ckpt, tmp_path / dtype, nextn=1, dtype=dtype, lowering="plugin", max_seq_len=64))
    model = onnx.load(m.root / "target.onnx")
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
    assert types["kv_0"] == types["hidden_states"] == onnx_type
    assert types["logits"] == onnx.TensorProto.FLOAT
    if dtype == "fp16":
        m = Manifest.load(export(ckpt, tmp_path / "ort16", nextn=1, dtype=dtype, max_seq_len=64))
        sess = ort_lib.session(str(m.root / "target.onnx"))
        ids = np.arange(8, dtype=np.int32)[None] * 7 % 90
        feed = {"input_ids": ids, "past_len": np.zeros(1, np.int32), "thinking": np.zeros(1, np.int32),
                "relaxed_topk": np.array(0, np.int32), "relaxed_delta": np.array(0, np.float32)}
        feed |= {f"kv_{i}": np.zeros((1, 64, m.config.latent_dim), np.float16) for i in range(m.config.num_hidden_layers)}
        got = _run(sess, feed)["logits"]
        with torch.no_grad():
            ref = load_checkpoint(ckpt, nextn=0)(torch.from_numpy(ids).long())[0].numpy()
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-2


def test_tracing_runs_on_one_thread_and_restores_torch_threads(ckpt, tmp_path, monkeypatch):
    """Tracing's thousands of tiny operators run on one thread (on several, each paid for waking the others: most
    of a first run's time on a busy machine); the weights are computed, and torch left, on the threads it had --
    also when the export stops in the middle of a trace."""
    seen, trace, cut = [], torch.onnx.export, []

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        if cut:
            raise KeyboardInterrupt
        return trace(*args, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", recording)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        export(ckpt, tmp_path / "out", nextn=1, max_seq_len=64)
        assert len(seen) == 4 and set(seen) == {1}  # target, mtp_0, step_0, step_1
        assert torch.get_num_threads() == 2
        cut.append(True)
        with pytest.raises(KeyboardInterrupt):
            export(ckpt, tmp_path / "cut", nextn=1, max_seq_len=64)
        assert torch.get_num_threads() == 2
        assert not (tmp_path / "cut").exists()
    finally:
        torch.set_num_threads(before)
