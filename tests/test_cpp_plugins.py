"""The C++ plugins (libmtp_trt_plugins.so) against the Python ones, through TensorRT: the creators'
names, versions, namespaces and fields, the serialized fields, and single-node engines (output
shapes and types, the aliased cache output) built with each implementation and deserialized with
the other.  Marker `trt`; skipped without TensorRT or without the built library (build it with
`cmake -S plugins/cpp -B plugins/cpp/build -DTensorRT_ROOT=...`, docs/tensorrt.md).  TensorRT
for RTX builds these engines without a GPU; nothing here runs an engine (that needs a GPU).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from mtp_trt import ops
from mtp_trt.errors import MtpTrtError
from mtp_trt.plugins import trt_plugins
from mtp_trt.trt import compat, cpp_plugins

pytestmark = pytest.mark.trt
FIELDS = {"MlaGenerationAttention": {"kv_lora_rank": 32, "softmax_scale": 0.125},
          "MlaSparseAttention": {"kv_lora_rank": 32, "softmax_scale": 0.125, "index_topk": 16},
          "MtpAccept": {"think_start_id": 90, "think_end_id": 91}}


@pytest.fixture(scope="module")
def api():
    try:
        a = compat.load("auto")
    except MtpTrtError as e:
        pytest.skip(f"TensorRT: {e}")
    if cpp_plugins.find_library() is None:
        pytest.skip(f"{cpp_plugins.LIB_NAME} is not built (cmake -S plugins/cpp -B plugins/cpp/build)")
    yield a
    cpp_plugins.use(a.trt, "python")  # leave the registry as the other tests expect it


def _fc(trt, op: str):
    return trt.PluginFieldCollection([
        trt.PluginField(n, np.array([v], np.int32 if isinstance(v, int) else np.float32),
                        trt.PluginFieldType.INT32 if isinstance(v, int) else trt.PluginFieldType.FLOAT32)
        for n, v in FIELDS[op].items()])


def test_use_switches_the_registered_implementation(api):
    trt = api.trt
    reg = trt.get_plugin_registry()
    for impl in ("cpp", "python", "cpp", "auto"):
        got = cpp_plugins.use(trt, impl)
        assert got == ("cpp" if impl == "auto" else impl)
        for op in ops.OPS:
            creator = reg.get_creator(op, str(ops.VERSION), "")
            assert cpp_plugins._is_python(trt, creator) == (got == "python"), (impl, op)
    with pytest.raises(MtpTrtError, match="--plugins must be one of"):
        cpp_plugins.use(trt, "rust")


def test_creators_and_fields_match_python(api):
    trt = api.trt
    cpp_plugins.use(trt, "cpp")
    reg = trt.get_plugin_registry()
    for op in ops.OPS:
        c = reg.get_creator(op, str(ops.VERSION), "")
        p = trt_plugins.plugin_classes(trt)[op][1]()  # the Python creator, not registered
        assert (c.name, c.plugin_version, c.plugin_namespace) == (p.name, p.plugin_version, p.plugin_namespace)
        assert [(f.name, f.type) for f in c.field_names] == [(f.name, f.type) for f in p.field_names]
        cp, pp = (x.create_plugin(op, _fc(trt, op), trt.TensorRTPhase.BUILD) for x in (c, p))
        core = cp.get_capability_interface(trt.PluginCapabilityType.CORE)
        assert (core.plugin_name, core.plugin_version, core.plugin_namespace) == (op, str(ops.VERSION), "")
        build = cp.get_capability_interface(trt.PluginCapabilityType.BUILD)
        assert build.num_outputs == pp.num_outputs == len(ops.OPS[op].outputs)
        del cp, core, build  # (serialized fields, aliases, workspace: test_cpp_probe.py)
    bad = trt.PluginFieldCollection([trt.PluginField("kv_lora_rank", np.array([0], np.int32), trt.PluginFieldType.INT32),
                                     trt.PluginField("softmax_scale", np.array([1.0], np.float32),
                                                     trt.PluginFieldType.FLOAT32)])
    assert reg.get_creator("MlaGenerationAttention", str(ops.VERSION), "").create_plugin("x", bad, trt.TensorRTPhase.BUILD) is None


def _model(op: str, dtype=TensorProto.FLOAT16, tree_mask: bool = False):
    v = helper.make_tensor_value_info
    if op == "MlaGenerationAttention":
        ins = [v("q", dtype, ["B", "S", 4, 40]), v("new_rows", dtype, ["B", "S", 40]), v("kv", dtype, ["B", "T", 40]),
               v("past_len", TensorProto.INT32, ["B"])] + [v("tree_mask", TensorProto.BOOL, ["B", "S", "S"])] * tree_mask
        outs = [v("out", dtype, ["B", "S", 4, 32]), v("kv_out", dtype, ["B", "T", 40])]
    elif op == "MlaSparseAttention":  # rows of 40 latent values and a 16-value indexer key; 2 indexer heads
        ins = [v("q", dtype, ["B", "S", 4, 40]), v("dsa_rows", dtype, ["B", "S", 56]), v("dsa_kv", dtype, ["B", "T", 56]),
               v("past_len", TensorProto.INT32, ["B"]), v("index_q", dtype, ["B", "S", 2, 16]),
               v("index_weights", TensorProto.FLOAT, ["B", "S", 2])] + \
            [v("tree_mask", TensorProto.BOOL, ["B", "S", "S"])] * tree_mask
        outs = [v("out", dtype, ["B", "S", 4, 32]), v("kv_out", dtype, ["B", "T", 56])]
    else:
        ins = [v("logits", TensorProto.FLOAT, ["B", "S", 96]), v("input_ids", TensorProto.INT32, ["B", "S"]),
               v("thinking", TensorProto.INT32, ["B"]), v("relaxed_topk", TensorProto.INT32, []),
               v("relaxed_delta", TensorProto.FLOAT, [])]
        outs = [v("accepted", TensorProto.INT32, ["B", "S"]), v("num", TensorProto.INT32, ["B"]),
                v("thinking_out", TensorProto.INT32, ["B"])]
    # plugin_version: the ONNX parser looks for version "1" unless the node names another
    node = helper.make_node(op, [i.name for i in ins], [o.name for o in outs], domain=ops.DOMAIN, name=op,
                            plugin_version=str(ops.VERSION), **FIELDS[op])
    return helper.make_model(helper.make_graph([node], op, ins, outs),
                             opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(ops.DOMAIN, ops.VERSION)])


SHAPES = {"q": [(1, 1, 4, 40), (2, 3, 4, 40), (4, 3, 4, 40)], "new_rows": [(1, 1, 40), (2, 3, 40), (4, 3, 40)],
          "kv": [(1, 1, 40), (2, 64, 40), (4, 2048, 40)], "past_len": [(1,), (2,), (4,)],
          "logits": [(1, 1, 96), (2, 3, 96), (4, 3, 96)], "input_ids": [(1, 1), (2, 3), (4, 3)],
          "thinking": [(1,), (2,), (4,)], "relaxed_topk": [(), (), ()], "relaxed_delta": [(), (), ()],
          "tree_mask": [(1, 1, 1), (2, 3, 3), (4, 3, 3)], "dsa_rows": [(1, 1, 56), (2, 3, 56), (4, 3, 56)],
          "dsa_kv": [(1, 1, 56), (2, 64, 56), (4, 2048, 56)], "index_q": [(1, 1, 2, 16), (2, 3, 2, 16), (4, 3, 2, 16)],
          "index_weights": [(1, 1, 2), (2, 3, 2), (4, 3, 2)]}


def _build(api, model: onnx.ModelProto, impl: str):
    """(network outputs [(name, shape, dtype)], serialized engine) with `impl`'s plugins."""
    trt = api.trt
    cpp_plugins.use(trt, impl)
    logger = trt.Logger(trt.Logger.ERROR)
    b = trt.Builder(logger)
    net = b.create_network(api.network_flags())
    parser = trt.OnnxParser(net, logger)
    assert parser.parse(model.SerializeToString()), [str(parser.get_error(i)) for i in range(parser.num_errors)]
    outs = [(net.get_output(i).name, tuple(net.get_output(i).shape), net.get_output(i).dtype)
            for i in range(net.num_outputs)]
    cfg = b.create_builder_config()
    api.set_targets(cfg, ["8.9"] if api.is_rtx else [api.resolve_archs("auto")[0]])
    cfg.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    p = b.create_optimization_profile()
    for i in range(net.num_inputs):
        name = net.get_input(i).name
        p.set_shape(name, *SHAPES[name])
    cfg.add_optimization_profile(p)
    engine = b.build_serialized_network(net, cfg)
    assert engine is not None, f"{impl} plugins: the build failed"
    return outs, bytes(engine)


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_attention_engine_with_cpp_plugins(api, dtype):
    trt = api.trt
    want = {TensorProto.FLOAT: trt.float32, TensorProto.FLOAT16: trt.float16, TensorProto.BFLOAT16: trt.bfloat16}[dtype]
    outs, engine = _build(api, _model("MlaGenerationAttention", dtype), "cpp")
    assert outs == [("out", (-1, -1, 4, 32), want), ("kv_out", (-1, -1, 40), want)]
    assert b"MlaGenerationAttention" in engine
    _check_engine(api, engine, {"kv_out": "kv"})


def test_accept_engine_with_cpp_plugins(api):
    i32 = api.trt.int32
    outs, engine = _build(api, _model("MtpAccept"), "cpp")
    assert outs == [("accepted", (-1, -1), i32), ("num", (-1,), i32), ("thinking_out", (-1,), i32)]
    _check_engine(api, engine, {})


def _check_engine(api, engine: bytes, aliases: dict[str, str], impl: str = "cpp"):
    """Deserialize with `impl`'s plugins registered; check which outputs alias which inputs.  Needs a
    GPU (TensorRT for RTX builds engines without one but does not deserialize them)."""
    trt = api.trt
    cpp_plugins.use(trt, impl)
    if compat.gpu()[0] is None:
        return
    eng = trt.Runtime(trt.Logger(trt.Logger.ERROR)).deserialize_cuda_engine(engine)
    assert eng is not None, f"the engine did not deserialize with the {impl} plugins"
    names = [eng.get_tensor_name(i) for i in range(eng.num_io_tensors)]
    got = {n: eng.get_aliased_input_tensor(n) for n in names if eng.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT}
    assert {n: a for n, a in got.items() if a} == aliases


@pytest.mark.parametrize("op", list(ops.OPS))
def test_engines_cross_implementations(api, op):
    """The same node built with either implementation: same outputs; each engine loads with the other."""
    model = _model(op)
    outs_cpp, eng_cpp = _build(api, model, "cpp")
    outs_py, eng_py = _build(api, model, "python")
    assert outs_cpp == outs_py
    aliases = {"MlaGenerationAttention": {"kv_out": "kv"}, "MlaSparseAttention": {"kv_out": "dsa_kv"}}.get(op, {})
    _check_engine(api, eng_cpp, aliases, impl="python")
    _check_engine(api, eng_py, aliases, impl="cpp")


@pytest.mark.parametrize("op, cache, width", [("MlaGenerationAttention", "kv", 40), ("MlaSparseAttention", "dsa_kv", 56)])
def test_tree_masked_attention_builds_with_either_implementation(api, op, cache, width):
    """The optional last input, the tree mask (bool [B, S, S]), is accepted by both implementations' format and
    shape checks and gives the same outputs and aliasing as the node without it."""
    model = _model(op, TensorProto.FLOAT, tree_mask=True)
    outs_cpp, eng_cpp = _build(api, model, "cpp")
    outs_py, eng_py = _build(api, model, "python")
    f32 = api.trt.float32
    assert outs_cpp == outs_py == [("out", (-1, -1, 4, 32), f32), ("kv_out", (-1, -1, width), f32)]
    _check_engine(api, eng_cpp, {"kv_out": cache}, impl="python")
    _check_engine(api, eng_py, {"kv_out": cache}, impl="cpp")


@pytest.mark.slow
def test_eagle_export_builds_with_cpp_plugins(api, tmp_path):
    """Every engine of a small eagle export (K = 2, plugin lowering) builds with the C++ plugins: the real
    graphs' shapes, types and chains of aliased caches.  About 30 s; TensorRT for RTX needs no GPU."""
    from runtime_models import make_random

    from mtp_trt.exporters.export import export
    from mtp_trt.manifest import Manifest
    from mtp_trt.trt import builder

    ex = export(make_random(tmp_path / "ckpt", nextn=2), tmp_path / "exp", nextn=2, mtp_mode="eagle",
                lowering="plugin", max_batch=2, max_seq_len=64)
    m, trt = Manifest.load(ex), api.trt
    assert cpp_plugins.use(trt, "cpp") == "cpp"
    logger = trt.Logger(trt.Logger.ERROR)
    b = trt.Builder(logger)
    for name, g in m.graphs.items():
        model = onnx.load(str(ex / g.file), load_external_data=False)
        for n in model.graph.node:  # the parser looks for plugin version "1" unless the node says otherwise
            if n.domain == ops.DOMAIN and not any(a.name == "plugin_version" for a in n.attribute):
                n.attribute.append(helper.make_attribute("plugin_version", str(ops.VERSION)))
        net = b.create_network(api.network_flags())
        parser = trt.OnnxParser(net, logger)
        assert parser.parse(model.SerializeToString(), str(ex / g.file)), (name, parser.get_error(0))
        layers = builder._plugin_layers(api, net, g.file)
        assert sum(layers.values()) >= 1 and set(layers) <= set(ops.OPS)
        assert sorted(net.get_output(i).name for i in range(net.num_outputs)) == sorted(t.name for t in g.outputs)
        cfg = b.create_builder_config()
        api.set_targets(cfg, ["8.9"] if api.is_rtx else [api.resolve_archs("auto")[0]])
        cfg.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
        for prof in builder.profiles(m, 2, 64, 32):
            p = b.create_optimization_profile()
            for n, (lo, opt, hi) in builder.input_shapes(g, prof).items():
                p.set_shape(n, lo, opt, hi)
            cfg.add_optimization_profile(p)
        assert b.build_serialized_network(net, cfg) is not None, name
