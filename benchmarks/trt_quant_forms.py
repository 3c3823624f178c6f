"""Which quantized weight forms TensorRT (for RTX) builds, for which compute capabilities, and how large the engines
are.  Not run in CI; builds without a GPU with TensorRT for RTX.

One K x N weight (default 1024 x 1024) in a one-matmul network, y = x @ W, strongly typed, for each form:

* float: W in the activations' dtype;
* fp8-block / fp8-channel / fp8-tensor: FLOAT8E4M3FN W behind a DequantizeLinear with float32 scales blocked by
  128 along K (what `--quant fp8` writes), per output column, or one for the tensor (cast to fp16 after it);
* fp8-block-act: fp8-block with an FP8 quantize/dequantize pair on the activations too;
* int4-block: INT4 W, fp16 scales blocked by 32 along K (what `--quant int4` writes);
* gather-fp8 / gather-int4: stacked experts [16, 256, K] behind a DequantizeLinear, then a Gather of 2 per token
  (the `gather` MoE form); gather-fp8-first: the Gather of the FP8 bytes first (refused by TensorRT).

  python benchmarks/trt_quant_forms.py [--archs 7.5,8.0,8.6,8.9,12.0] [--k 1024 --n 1024]

With --checkpoint 85m (or 304m, the random checkpoints of benchmarks/bench_common.py): that checkpoint exported with
`--lowering plugin --dtype fp16 --nextn 0 --trees none` and each of `--quant none int4 fp8` instead, built for
the first of --archs, and the sizes of its engines and weights.bin printed.

  python benchmarks/trt_quant_forms.py --checkpoint 85m --archs 8.9
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FORMS = ("float", "fp8-block", "fp8-channel", "fp8-tensor", "fp8-block-act", "int4-block", "gather-fp8", "gather-int4",
         "gather-fp8-first")


def network(form: str, k: int, n: int) -> bytes:
    """The one-matmul ONNX model of `form` (module docstring), fp16 activations."""
    import onnx
    import torch
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    half = TensorProto.FLOAT16
    experts = form.startswith("gather")
    shape = [16, 256, k] if experts else [k, n]
    fp8 = "fp8" in form
    if form == "float":
        w = numpy_helper.from_array(rng.standard_normal(shape).astype(np.float16), "w")
    elif fp8:
        codes = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(torch.float8_e4m3fn)
        raw = codes.view(torch.uint8).numpy().tobytes()
        w = helper.make_tensor("w", TensorProto.FLOAT8E4M3FN, shape, raw, raw=True)
    else:
        q = rng.integers(-8, 8, int(np.prod(shape))).astype(np.uint8) & 0xF
        w = helper.make_tensor("w", TensorProto.INT4, shape, (q[0::2] | (q[1::2] << 4)).tobytes(), raw=True)
    block, axis = (128 if fp8 else 32), (2 if experts else 0)
    scale_shape = {"fp8-channel": [n], "fp8-tensor": []}.get(form)
    if scale_shape is None:
        scale_shape = [*shape[:-1], k // block] if experts else [k // block, n]
    s = numpy_helper.from_array(rng.uniform(0.01, 0.1, scale_shape).astype(np.float32 if fp8 else np.float16), "s")
    attrs = ({} if form == "fp8-tensor" else {"axis": 1} if form == "fp8-channel" else
             {"axis": axis, "block_size": block})
    inits, nodes, x = [w, s], [], "x"
    if form == "float":
        weight = "w"
    elif form == "gather-fp8-first":
        nodes += [helper.make_node("Gather", ["w", "idx"], ["wg"], axis=0),
                  helper.make_node("Gather", ["s", "idx"], ["sg"], axis=0),
                  helper.make_node("DequantizeLinear", ["wg", "sg"], ["wd"], axis=-1, block_size=block)]
        weight = "wd"
    else:
        nodes.append(helper.make_node("DequantizeLinear", ["w", "s"], ["wd"], **attrs))
        weight = "wd"
    if fp8:
        nodes.append(helper.make_node("Cast", [weight], ["wc"], to=half))
        weight = "wc"
    if form == "fp8-block-act":
        inits += [numpy_helper.from_array(np.array(0.1, np.float16), "xs"),
                  helper.make_tensor("xz", TensorProto.FLOAT8E4M3FN, [], [0])]
        nodes += [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
                  helper.make_node("DequantizeLinear", ["xq", "xs"], ["xd"])]
        x = "xd"
    inputs = [helper.make_tensor_value_info("x", half, ["b", k])]
    if experts:
        if form != "gather-fp8-first":
            nodes.append(helper.make_node("Gather", [weight, "idx"], ["wgather"], axis=0))
            weight = "wgather"
        inits.append(numpy_helper.from_array(np.array([1, 3], np.int64), "axes"))
        nodes += [helper.make_node("Unsqueeze", [x, "axes"], ["xu"]), helper.make_node("MatMul", [weight, "xu"], ["y"])]
        inputs.append(helper.make_tensor_value_info("idx", TensorProto.INT32, ["b", 2]))
        out = helper.make_tensor_value_info("y", half, ["b", 2, 256, 1])
    else:
        nodes.append(helper.make_node("MatMul", [x, weight], ["y"]))
        out = helper.make_tensor_value_info("y", half, ["b", n])
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, [out], inits),
                              opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(model)
    return model.SerializeToString()


def build(api, builder, log, data: bytes, arch: str, k: int) -> str:
    """'OK <MB>' or the first error of parsing or building for `arch`."""
    trt = api.trt
    log.clear()
    net = builder.create_network(api.network_flags())
    parser = trt.OnnxParser(net, api.make_logger(lambda severity, msg: log.append(msg)))
    if not parser.parse(data):
        return "parse failed: " + str(parser.get_error(0)).splitlines()[0][:160]
    config = builder.create_builder_config()
    api.set_targets(config, [arch])
    profile = builder.create_optimization_profile()
    for i in range(net.num_inputs):
        t = net.get_input(i)
        width = k if t.name == "x" else 2
        profile.set_shape(t.name, (1, width), (4, width), (64, width))
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(net, config)
    if engine is None:
        errors = [m for m in log if "Error" in m] or log or ["no message"]
        return "build failed: " + errors[-1].splitlines()[0][:200]
    return f"OK {len(bytes(engine)) / 1e6:.2f} MB"


def checkpoint_engines(size: str, arch: str, schemes=("none", "int4", "fp8")) -> None:
    """--checkpoint: the engine sizes of one random checkpoint (bench_common.SIZES) under each scheme (module
    docstring)."""
    import json
    import tempfile

    from mtp_trt.exporters.export import export
    from mtp_trt.trt import builder
    from bench_common import make_checkpoint

    ckpt = make_checkpoint(size)
    with tempfile.TemporaryDirectory(prefix="trt-quant-forms-") as tmp:
        for q in schemes:
            exp = export(ckpt, f"{tmp}/exp-{q}", nextn=0, lowering="plugin", dtype="fp16", trees="none",
                         max_seq_len=1024, quant_scheme=q)
            eng = builder.build(exp, f"{tmp}/eng-{q}", target_arch=arch, flavour="tensorrt_rtx")
            engines = json.loads((eng / "engines.json").read_text())["engines"]
            weights = json.loads((exp / "manifest.json").read_text())["weights"]["bytes"]
            sizes = ", ".join(f"{g} {e['bytes'] / 1e6:.1f} MB" for g, e in engines.items())
            print(f"{size} --quant {q:5} ({arch}): {sizes}; weights.bin {weights / 1e6:.1f} MB", flush=True)
            shutil.rmtree(exp)
            shutil.rmtree(eng)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default="7.5,8.0,8.6,8.9,12.0")
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--checkpoint", choices=("85m", "304m"), help="engine sizes of this checkpoint instead")
    args = ap.parse_args()
    if args.checkpoint:
        return checkpoint_engines(args.checkpoint, args.archs.split(",")[0])
    from mtp_trt.trt import compat

    api = compat.load("tensorrt_rtx")
    log: list[str] = []
    builder = api.trt.Builder(api.make_logger(lambda severity, msg: log.append(msg)))
    print(f"{api.flavour} {api.version}; K = {args.k}, N = {args.n}")
    for form in args.forms.split(","):
        data = network(form, args.k, args.n)
        for arch in args.archs.split(","):
            print(f"{form:18} {arch:5} {build(api, builder, log, data, arch, args.k)}", flush=True)


if __name__ == "__main__":
    main()
