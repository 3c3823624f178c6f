"""`mtp-trt build` / `check` on a small random checkpoint: real engines built with the installed TensorRT
(TensorRT for RTX on a CPU-only machine), every custom node mapped to our IPluginV3 plugin, the engine
manifest, the plugins' shape/type logic on single-node graphs, and one clear error for each bad input,
leaving no half-written engine directory.  Running the engines needs a GPU: see `check`."""

import collections
import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

from mtp_trt import ops
from mtp_trt.cli import app
from mtp_trt.config import ModelConfig
from mtp_trt.errors import MtpTrtError
from mtp_trt.exporters.export import export
from runtime_models import make_random
from trt_fakes import fake_backend
from mtp_trt.manifest import FORMAT_VERSION, seal, sha256
from mtp_trt.plugins import ort_lib, trt_plugins
from mtp_trt.trt import builder, check, compat, cpp_plugins
from mtp_trt.trt import manifest as em

trt_mark = pytest.mark.trt


def target():
    """(--target-arch, the arch it resolves to): this GPU where there is one the flavour can build for,
    else 8.9 (one target keeps the build fast; TensorRT for RTX builds it without a GPU)."""
    api, cc = compat.load("auto"), compat.gpu()[0]
    return ("native", cc) if cc and cc in api.buildable_archs() else ("8.9", "8.9")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_random(tmp_path_factory.mktemp("ckpt") / "model", nextn=2)


@pytest.fixture(scope="module")
def exported(ckpt, tmp_path_factory):
    """Vanilla mode, K = 2: target.onnx, mtp_0.onnx, mtp_1.onnx, the step graphs and the default tree 2:2:4 in the
    plugin lowering."""
    return export(ckpt, tmp_path_factory.mktemp("exp") / "plugin", nextn=2, mtp_mode="vanilla", lowering="plugin",
                  max_batch=4, max_seq_len=64)


@pytest.fixture(scope="module")
def engines(exported, tmp_path_factory):
    out = tmp_path_factory.mktemp("eng") / "engines"
    r = CliRunner().invoke(app, ["build", str(exported), "-o", str(out), "--target-arch", target()[0],
                                 "--timing-cache", str(out.parent / "timing.cache")])
    assert r.exit_code == 0, r.output
    assert f"wrote {out}" in r.output
    return out


def _copy(exported, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(exported, dst)
    return dst


def _edit_manifest(root, **changes):
    p = root / "manifest.json"
    raw = json.loads(p.read_text())
    raw.update(changes)
    p.write_text(json.dumps(raw))


def _no_leftovers(parent, name):
    assert not (parent / name).exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(f".{name}.partial-")]


# ------------------------------------------------------------------------------------ engines
@trt_mark
def test_engine_manifest_records_the_build(engines, exported):
    api = compat.load("auto")
    m = em.EngineManifest.load(engines, verify_hashes=True)
    raw = m.raw
    assert (m.flavour, m.trt_version) == (api.flavour, api.version)
    assert m.target_archs == [target()[1]] and m.precision == "fp32"
    assert m.export_format_version == FORMAT_VERSION == raw["export"]["format_version"]
    assert raw["export"]["lowering"] == "plugin" and raw["export"]["manifest_sha256"] == sha256(exported / "manifest.json")
    assert (engines / em.EXPORT_MANIFEST).read_bytes() == (exported / "manifest.json").read_bytes()
    assert (engines / "tokenizer.json").is_file() and (engines / "build.log").is_file()
    assert [p["name"] for p in m.profiles] == ["generation", "prefill"]
    gen, pre = (p["dims"] for p in m.profiles)
    assert gen == {"B": [1, 4, 4], "S": [1, 3, 3], "T": [1, 64, 64]}
    assert pre["S"][2] == 64 and pre["B"][2] == 4
    assert m.profiles[0]["inputs"]["target"]["kv_0"] == [[1, 1, 40], [4, 64, 40], [4, 64, 40]]
    assert {(p["name"], p["version"], p["namespace"]) for p in m.plugins} == {(n, str(ops.VERSION), "") for n in ops.OPS}
    assert set(m.engines) == {"target", "mtp_0", "mtp_1", "step_0", "step_1", "step_2", "tree_2_2_4"}
    for name, e in m.engines.items():
        assert e.file == f"{name}.engine" and e.bytes == (engines / e.file).stat().st_size > 100_000
        assert e.sha256 == sha256(engines / e.file)
        assert e.onnx == f"{name}.onnx" and e.onnx_sha256 == sha256(exported / e.onnx)
    if api.is_rtx:  # timing caches are no-ops in TensorRT for RTX
        assert any("--timing-cache" in n for n in raw["notes"]) and not (engines.parent / "timing.cache").exists()
    else:
        assert (engines.parent / "timing.cache").is_file()


@trt_mark
def test_every_custom_node_became_its_plugin(engines, exported):
    m = em.EngineManifest.load(engines)
    for name, e in m.engines.items():
        model = onnx.load(str(exported / e.onnx))
        nodes = collections.Counter(n.op_type for n in model.graph.node if n.domain == ops.DOMAIN)
        assert e.plugin_layers == dict(nodes) and sum(nodes.values()) >= 1
        data = (engines / e.file).read_bytes()
        for op in nodes:  # the plugin (and its attributes) are serialized into the engine
            assert op.encode() in data
    assert m.engines["target"].plugin_layers == {"MlaGenerationAttention": 3, "MtpAccept": 1}
    assert m.engines["mtp_1"].plugin_layers == {"MlaGenerationAttention": 1}
    assert m.engines["tree_2_2_4"].plugin_layers == {"MlaGenerationAttention": 3 + 2}  # the verify's, modules 1 and 2


def _node_model(op: str, inputs, outputs, **attrs):
    node = helper.make_node(op, [i.name for i in inputs], [o.name for o in outputs], domain=ops.DOMAIN, name=op,
                            plugin_version=str(ops.VERSION), **attrs)
    graph = helper.make_graph([node], op, inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                   helper.make_opsetid(ops.DOMAIN, ops.VERSION)])


def _parse(model):
    api = compat.load("auto")
    trt = api.trt
    cpp_plugins.use(trt, "python")  # these tests are about the Python plugins (test_cpp_plugins.py: the C++ ones)
    trt_plugins.errors.clear()
    b = trt.Builder(trt.Logger(trt.Logger.ERROR))
    net = b.create_network(api.network_flags())
    parser = trt.OnnxParser(net, trt.Logger(trt.Logger.ERROR))
    ok = parser.parse(model.SerializeToString())
    return api, b, net, ok


@trt_mark
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_attention_plugin_shapes_types_and_build(dtype):
    v = helper.make_tensor_value_info
    ins = [v("q", dtype, ["B", "S", 4, 40]), v("new_rows", dtype, ["B", "S", 40]), v("kv", dtype, ["B", "T", 40]),
           v("past_len", TensorProto.INT32, ["B"])]
    model = _node_model("MlaGenerationAttention", ins, [v("out", dtype, ["B", "S", 4, 32]),
                                                        v("kv_out", dtype, ["B", "T", 40])],
                        kv_lora_rank=32, softmax_scale=0.125)
    api, b, net, ok = _parse(model)
    assert ok
    out, kv_out = net.get_output(0), net.get_output(1)
    trt = api.trt
    want = {TensorProto.FLOAT: trt.float32, TensorProto.FLOAT16: trt.float16, TensorProto.BFLOAT16: trt.bfloat16}
    assert tuple(out.shape) == (-1, -1, 4, 32) and out.dtype == want[dtype]
    assert tuple(kv_out.shape) == (-1, -1, 40) and kv_out.dtype == want[dtype]  # the cache, aliased to input 2
    cfg = b.create_builder_config()
    api.set_targets(cfg, [target()[1]])
    api.enable_aliased_plugin_io(cfg)
    p = b.create_optimization_profile()
    p.set_shape("q", (1, 1, 4, 40), (2, 3, 4, 40), (4, 3, 4, 40))
    p.set_shape("new_rows", (1, 1, 40), (2, 3, 40), (4, 3, 40))
    p.set_shape("kv", (1, 1, 40), (2, 64, 40), (4, 64, 40))
    p.set_shape("past_len", (1,), (2,), (4,))
    cfg.add_optimization_profile(p)
    assert b.build_serialized_network(net, cfg) is not None and not trt_plugins.errors


@trt_mark
def test_accept_plugin_shapes_and_types():
    v = helper.make_tensor_value_info
    ins = [v("logits", TensorProto.FLOAT, ["B", "S", 96]), v("input_ids", TensorProto.INT32, ["B", "S"]),
           v("thinking", TensorProto.INT32, ["B"]), v("relaxed_topk", TensorProto.INT32, []),
           v("relaxed_delta", TensorProto.FLOAT, [])]
    outs = [v("accepted", TensorProto.INT32, ["B", "S"]), v("num", TensorProto.INT32, ["B"]),
            v("thinking_out", TensorProto.INT32, ["B"])]
    api, _, net, ok = _parse(_node_model("MtpAccept", ins, outs, think_start_id=90, think_end_id=91))
    assert ok
    got = [(tuple(net.get_output(i).shape), net.get_output(i).dtype) for i in range(3)]
    assert got == [((-1, -1), api.trt.int32), ((-1,), api.trt.int32), ((-1,), api.trt.int32)]


@trt_mark
def test_plugin_attribute_problem_is_reported():
    v = helper.make_tensor_value_info
    f = TensorProto.FLOAT
    ins = [v("q", f, ["B", "S", 4, 40]), v("new_rows", f, ["B", "S", 40]), v("kv", f, ["B", "T", 40]),
           v("past_len", TensorProto.INT32, ["B"])]
    _, _, _, ok = _parse(_node_model("MlaGenerationAttention", ins, [v("out", f, None), v("kv_out", f, None)],
                                     kv_lora_rank=40, softmax_scale=0.125))
    assert not ok
    assert any("must exceed kv_lora_rank 40" in e for e in trt_plugins.errors)


# --------------------------------------------------------------------------------- bad input
@trt_mark
def test_target_arch_the_flavour_cannot_build(exported, tmp_path):
    api = compat.load("auto")
    if not api.is_rtx:
        pytest.skip("TensorRT for RTX's target list")
    with pytest.raises(MtpTrtError, match=r"cannot build for compute capability 9.0 \(it can: .*8.9"):
        builder.build(exported, tmp_path / "out", target_arch="9.0")
    _no_leftovers(tmp_path, "out")


@trt_mark
def test_turing_is_refused_before_any_work(exported, tmp_path):
    """The kernels need sm_80 (cp.async, ldmatrix, bf16 mma): 7.5 is refused up front, whatever the flavour."""
    with pytest.raises(MtpTrtError, match=r"--target-arch 7.5: the mtp-trt kernels need compute capability 8.0"):
        builder.build(exported, tmp_path / "out", target_arch="7.5" if "7.5" in compat.load("auto").buildable_archs()
                      else "8.0,7.5")
    _no_leftovers(tmp_path, "out")


@trt_mark
def test_failed_build_leaves_nothing(exported, tmp_path, monkeypatch):
    """TensorRT returning no engine for the second graph (after the first was written) is one clear error, and
    nothing is left behind.  (TensorRT for RTX used to fail this way for fp32 on Turing; Turing is now refused
    up front, and with aliased plugin I/O that build aborts the process instead.)"""
    real, calls = builder.build_graph, []

    def fail_second(api, b, *args):
        calls.append(1)
        if len(calls) == 2:
            monkeypatch.setattr(b, "build_serialized_network", lambda *a: None, raising=False)
        return real(api, b, *args)

    class Builder:  # the real builder, whose build_serialized_network the test can replace
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

    api = compat.load("auto")
    monkeypatch.setattr(api.trt, "Builder", lambda logger, real_cls=api.trt.Builder: Builder(real_cls(logger)))
    monkeypatch.setattr(builder, "build_graph", fail_second)
    with pytest.raises(MtpTrtError, match=r"\.onnx: tensorrt(_rtx)? .* could not build the engine for compute capabilit"):
        builder.build(exported, tmp_path / "out", target_arch=target()[0])
    _no_leftovers(tmp_path, "out")


@trt_mark
def test_interrupted_build_leaves_nothing(exported, tmp_path, monkeypatch):
    real, calls = builder.build_graph, []

    def interrupt_second(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(builder, "build_graph", interrupt_second)
    with pytest.raises(KeyboardInterrupt):
        builder.build(exported, tmp_path / "out", target_arch=target()[0])
    _no_leftovers(tmp_path, "out")


@trt_mark
@pytest.mark.slow  # (tests/test_trt_runtime.py builds such engines too)
def test_onnx_lowering_export_builds_plugin_free_engines(ckpt, tmp_path):
    """Standard operators only: engines any TensorRT application loads without our plugins; the runtime commits
    their new_kv outputs itself, so nothing is aliased."""
    ort = export(ckpt, tmp_path / "onnx", nextn=1, lowering="onnx", max_seq_len=32)  # ONNX Runtime's MoE node
    with pytest.raises(MtpTrtError, match=r"target.onnx: node .* is (ONNX Runtime.s com.microsoft|mtp-trt.s CPU operator mtp_trt.cpu)::\w+, which "
                                          r"TensorRT has no layer for; export with --moe-form tensorrt"):
        builder.build(ort, tmp_path / "out", target_arch=target()[0])
    _no_leftovers(tmp_path, "out")
    exp = export(ckpt, tmp_path / "plain", nextn=1, lowering="onnx", max_seq_len=32, moe_form="tensorrt")
    out = builder.build(exp, tmp_path / "out", target_arch=target()[0])
    m = em.EngineManifest.load(out, verify_hashes=True)
    assert m.raw["lowering"] == "onnx" and set(m.engines) == {"target", "mtp_0", "step_0", "step_1"}
    for e in m.engines.values():
        assert e.plugin_layers == {} and e.aliases == {}
        assert b"MlaGenerationAttention" not in (out / e.file).read_bytes()


def test_incompatible_export_format_version(exported, tmp_path):
    root = _copy(exported, tmp_path)
    _edit_manifest(root, format_version=FORMAT_VERSION + 1)
    with pytest.raises(MtpTrtError, match=f"export format version {FORMAT_VERSION + 1} is not the version"):
        builder.build(root, tmp_path / "out")


@pytest.mark.parametrize("domain,op", [(ops.DOMAIN, "MlaPrefillAttention"), ("com.example", "MtpAccept")])
def test_unknown_custom_op(exported, tmp_path, domain, op):
    root = _copy(exported, tmp_path)
    model = onnx.load(str(root / "target.onnx"))
    node = next(n for n in model.graph.node if n.op_type == "MtpAccept")
    node.op_type, node.domain = op, domain
    onnx.save(model, str(root / "target.onnx"))
    raw = json.loads((root / "manifest.json").read_text())
    raw["graphs"]["target"]["sha256"] = sha256(root / "target.onnx")
    (root / "manifest.json").write_text(json.dumps(seal(raw)))  # as an exporter of that graph would write it
    with pytest.raises(MtpTrtError, match=rf"target.onnx: node .* is the custom op {domain}::{op}, which has no "
                                          rf"TensorRT plugin"):
        builder.build(root, tmp_path / "out")
    _no_leftovers(tmp_path, "out")


@pytest.mark.parametrize("kwargs,message", [
    ({"precision": "fp16"}, "--precision fp16: the export is fp32.*--dtype fp16 --lowering plugin"),
    ({"precision": "int8"}, "--precision: unknown precision 'int8'"),
    ({"max_batch": 5}, r"--max-batch must be in 1..4"),
    ({"max_seq_len": 65}, r"--max-seq-len must be in 1..64"),
    ({"max_seq_len": 2}, "shorter than one verification step"),
    ({"max_prefill": 100}, r"--max-prefill must be in 1..64"),
])
def test_bad_request(exported, tmp_path, kwargs, message):
    with pytest.raises(MtpTrtError, match=message):
        builder.build(exported, tmp_path / "out", **kwargs)
    _no_leftovers(tmp_path, "out")


def test_output_directory_not_empty(exported, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    with pytest.raises(MtpTrtError, match="exists and is not empty"):
        builder.build(exported, tmp_path / "out")


def test_edited_onnx_is_refused(exported, tmp_path):
    root = _copy(exported, tmp_path)
    with open(root / "mtp_0.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(MtpTrtError, match="mtp_0.onnx: SHA-256 differs from manifest.json"):
        builder.build(root, tmp_path / "out")


# -------------------------------------------------------------------------------------- check
@trt_mark
def test_check_without_gpu_is_skipped(engines):
    if compat.gpu()[0] is not None:
        pytest.skip("a GPU is present: check runs the engines")
    r = CliRunner().invoke(app, ["check", str(engines)])
    assert r.exit_code == 3, r.output
    assert "skipped: no GPU" in r.output and "SHA-256 of every engine verified" in r.output
    assert "MlaGenerationAttention x3, MtpAccept x1" in r.output


@trt_mark
@pytest.mark.gpu
def test_check_runs_the_engines_on_a_gpu(engines):
    """Where a GPU is present: the engines (CUDA kernels through the plugins, the shipped kernel library) against
    ONNX Runtime, graph by graph and by greedy decoding."""
    result = check.check(engines, seed=0)
    assert result.status == "passed", f"{result.reason}\n" + "\n".join(result.lines)


@trt_mark
def test_check_refuses_a_modified_engine(engines, tmp_path):
    root = tmp_path / "eng"
    shutil.copytree(engines, root)
    data = bytearray((root / "mtp_0.engine").read_bytes())
    data[len(data) // 2] ^= 1
    (root / "mtp_0.engine").write_bytes(bytes(data))
    r = CliRunner().invoke(app, ["check", str(root)])
    assert r.exit_code == 2 and "mtp_0.engine: SHA-256 differs from engines.json" in r.output


@trt_mark
@pytest.mark.parametrize("perturb", [pytest.param(0.0, marks=pytest.mark.slow), 1e-2])
def test_check_compares_engines_with_onnxruntime(engines, monkeypatch, perturb):
    """The comparison path with a stand-in for the engines (ONNX Runtime on the onnx lowering, as the
    engines would compute): identical outputs pass, perturbed logits fail with exit code 1."""
    def fake_runner(m):
        ref = em.load_export_manifest(engines)
        sessions = {}

        def run(engine_path, profile, feed):
            name = engine_path.stem
            if name not in sessions:
                sessions[name] = ort_lib.session(fake_runner.ref_root / ref.graphs[name].file)
            s = sessions[name]
            out = dict(zip([o.name for o in s.get_outputs()], s.run(None, feed)))
            for k in ("logits", "draft_logits"):
                if k in out:
                    out[k] = out[k] + perturb
            return out

        return run

    real_reference = check._reference

    def reference(exp, reference, workdir, progress):
        ref = real_reference(exp, reference, workdir, progress)
        fake_runner.ref_root = ref.root
        return ref

    monkeypatch.setattr(check, "runtime_unavailable", lambda m: None)
    monkeypatch.setattr(check, "engine_runner", fake_runner)
    monkeypatch.setattr(check, "_reference", reference)
    monkeypatch.setattr(check, "engine_backend", lambda root, ref: fake_backend(root, ref))
    result = check.check(engines, seed=1)
    assert result.status == ("passed" if perturb == 0 else "failed"), "\n".join(result.lines)
    assert sum("tokens equal ONNX Runtime's" in line for line in result.lines) == 3  # nextn 0..2 decoded
    assert any("target/generation logits: max |diff|" in line for line in result.lines)
    assert any("mtp_1/prefill draft_tokens" in line for line in result.lines)
    assert result.exit_code == (0 if perturb == 0 else 1)


def test_random_inputs_are_valid(exported):
    from mtp_trt.manifest import Manifest

    m = Manifest.load(exported)
    rng = np.random.default_rng(0)
    for _ in range(20):
        feed = check.make_inputs(m.graphs["target"], {"B": 3, "S": 5, "T": 8}, 96, rng)
        assert feed["input_ids"].shape == (3, 5) and feed["input_ids"].max() < 96
        assert (feed["past_len"] + 5 <= 8).all() and feed["kv_0"].shape == (3, 8, 40)
        step = check.make_inputs(m.graphs["step_2"], {"B": 3, "S": 3, "T": 8}, 96, rng)  # vanilla, K = 2
        assert (step["past_len"] >= 1).all() and (step["past_len"] + 3 <= 8).all()  # windows start at >= 0
        assert step["carry"].shape == (3, 1, 64) and step["mtp_kv_1"].shape == (3, 8, 40)


@trt_mark
@pytest.mark.slow
def test_demo_checkpoint_builds_engines(tmp_path):
    """The bundled demo checkpoint (eagle, K = 3, fp16) builds into engines with every custom node on its plugin."""
    from mtp_trt.runner import demo_model

    exported = export(demo_model(), tmp_path / "plugin", mtp_mode="eagle", dtype="fp16", lowering="plugin",
                      max_batch=8, max_seq_len=512)
    out = tmp_path / "engines"
    r = CliRunner().invoke(app, ["build", str(exported), "-o", str(out), "--precision", "fp16",
                                 "--target-arch", target()[0]])
    assert r.exit_code == 0, r.output
    m = em.EngineManifest.load(out, verify_hashes=True)
    cfg = ModelConfig.from_file(demo_model())
    k = cfg.num_nextn_predict_layers
    trees = {"tree_2_2_4": 2, "tree_3_2_6": 3, "tree_3_3_8": 3}  # the default trees (tree.DEFAULT_TREES): depth
    assert set(m.engines) == {"target", "mtp_0"} | {f"step_{n}" for n in range(k + 1)} | set(trees)
    for name, depth in trees.items():  # the tree mask goes into the plugin; acceptance is standard operators
        assert m.engines[name].plugin_layers == {"MlaGenerationAttention": cfg.num_hidden_layers + depth}
    assert m.engines["target"].plugin_layers == {"MlaGenerationAttention": cfg.num_hidden_layers, "MtpAccept": 1}
    assert m.engines["step_0"].plugin_layers == {"MlaGenerationAttention": cfg.num_hidden_layers}
    assert m.engines["mtp_0"].plugin_layers == {"MlaGenerationAttention": 1}
    for n in range(1, k + 1):
        assert m.engines[f"step_{n}"].plugin_layers == {"MlaGenerationAttention": cfg.num_hidden_layers + n,
                                                        "MtpAccept": 1}


@pytest.mark.parametrize("domain, whose", [("com.microsoft", "ONNX Runtime's"),
                                           (ort_lib.DOMAIN, "mtp-trt's CPU operator")])
def test_operators_meant_for_onnx_runtime_are_one_error_with_the_export_to_use(domain, whose):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    node = helper.make_node("MoE", ["x"], ["x"], name="moe_0", domain=domain)
    model = helper.make_model(helper.make_graph([node], "g", [x], [x]))
    with pytest.raises(MtpTrtError, match=rf"step_0.onnx: node 'moe_0' is {whose} {domain}::MoE, which TensorRT "
                                          r"has no layer for; export with --moe-form tensorrt"):
        builder.custom_nodes(model, "step_0.onnx")
