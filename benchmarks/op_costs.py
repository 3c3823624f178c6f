"""What one node of a decode step costs: one-node ONNX Runtime sessions of mtp-trt's CPU operators at the demo
checkpoint's shapes and the 304M's attention (and a trivial ONNX Runtime node), each the minimum over --calls calls
less an empty session's run (the Python binding's and the session's fixed cost), so that a busy machine hardly moves
the figures.  Not run in CI.

  python benchmarks/op_costs.py [--threads 1] [--calls 3000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from mtp_trt.plugins import ort_lib
from mtp_trt.quant import Scheme, quantize

D, HEADS, DN, DL, DR, DV, CACHED = 256, 4, 64, 64, 32, 64, 140  # the demo's attention, a cache of 140 rows
CHAIN = 50  # trivial nodes timed together (one alone is below the timer's noise)


def model(nodes, inputs: dict, outputs: list[str], weights: dict, out_type: int = TensorProto.FLOAT):
    """A graph of `nodes` fed `inputs` (name -> array), `weights` as initializers, `outputs` of `out_type`."""
    types = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int32): TensorProto.INT32,
             np.dtype(np.int64): TensorProto.INT64}
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, types[a.dtype], a.shape) for n, a in inputs.items()],
        [helper.make_tensor_value_info(n, out_type, None) for n in outputs],
        [numpy_helper.from_array(a, n) for n, a in weights.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(ort_lib.DOMAIN, 1)])
    m.ir_version = 9
    return m


def best_call(m, feed: dict, threads: int, calls: int) -> float:
    """The fastest of `calls` runs of model `m`, microseconds."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry(ort_lib.THREADS_KEY, str(threads))  # (as OrtBackend's sessions)
    session = ort_lib.session(m.SerializeToString(), options)
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        session.run(None, feed)
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def cases(rng) -> dict:
    """name -> (model, feed)."""
    op = lambda name, ins, outs, **attrs: helper.make_node(name, ins, outs, domain=ort_lib.DOMAIN, **attrs)  # noqa: E731
    x = {"x": rng.standard_normal((1, D)).astype(np.float32)}
    relu = [helper.make_node("Relu", [f"y{i}" if i else "x"], [f"y{i + 1}"]) for i in range(CHAIN)]
    out = {"empty session (Identity)": (model([helper.make_node("Identity", ["x"], ["y"])], x, ["y"], {}), x),
           f"trivial ONNX Runtime node (Relu), per node of a chain of {CHAIN}": (
               model(relu, x, [f"y{CHAIN}"], {}), x)}
    feed = {"l": rng.standard_normal((1, 1, 8)).astype(np.float32), "i": np.zeros((1, 1), np.int32),
            "t": np.zeros(1, np.int32)}
    accept = [op("MtpAccept", ["l", "i", "t"], [f"a{i}", f"n{i}", f"f{i}"], think_start_id=-1, think_end_id=-1)
              for i in range(CHAIN)]
    out[f"trivial mtp-trt node (MtpAccept, 8 logits), per node of {CHAIN}"] = (
        model(accept, feed, [f"a{i}" for i in range(CHAIN)], {}, TensorProto.INT32), feed)
    for n, k in ((D + DL + DR - 64, D), (HEADS * (DN + DR), 128), (D, HEADS * DV), (6 * D, D)):
        data, scales = quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), Scheme("int8", 32))
        feed = {"x": rng.standard_normal((1, k)).astype(np.float32)}
        out[f"QMatMul int8 [{n}, {k}] ({data.nbytes // 1000} KB)"] = (
            model([op("QMatMul", ["x", "w", "s"], ["y"], K=k, N=n, bits=8, block_size=32)], feed, ["y"],
                  {"w": data, "s": scales}), feed)
    fc1 = quantize((rng.standard_normal((6 * D, D)) * 0.05).astype(np.float32), Scheme("int8", 32))
    fc2 = quantize((rng.standard_normal((D, 3 * D)) * 0.05).astype(np.float32), Scheme("int8", 32))
    out[f"QMoE int8, a dense MLP [{6 * D}, {D}] + [{D}, {3 * D}]"] = (
        model([op("QMoE", ["x", "", "", "", "", "", "", "a", "as", "b", "bs"], ["y"], top_k=0, n_group=1, topk_group=1,
                  softmax=0, group_top2=0, norm_topk_prob=0, routed_scaling_factor=1.0, bits=8, block_size=32)],
              x, ["y"], {"a": fc1[0], "as": fc1[1], "b": fc2[0], "bs": fc2[1]}), x)
    angles = rng.uniform(0, 6, (512, DR // 2))
    weights = {"norm": np.ones(DL, np.float32), "cos": np.cos(angles).astype(np.float32),
               "sin": np.sin(angles).astype(np.float32),
               "w_uk": (rng.standard_normal((HEADS, DN, DL)) / 8).astype(np.float32),
               "w_uv": (rng.standard_normal((HEADS, DV, DL)) / 8).astype(np.float32)}
    feed = {"q": rng.standard_normal((1, 1, HEADS * (DN + DR))).astype(np.float32),
            "kv": rng.standard_normal((1, 1, DL + DR)).astype(np.float32), "pos": np.array([[CACHED]], np.int64),
            "cache": rng.standard_normal((1, CACHED + 10, DL + DR)).astype(np.float32),
            "past_len": np.array([CACHED], np.int32)}
    out[f"MlaSelfAttention, {HEADS} heads, {CACHED} cached rows, W^UK and W^UV"] = (
        model([op("MlaSelfAttention", ["q", "kv", "norm", "pos", "cos", "sin", "cache", "past_len", "", "", "w_uk",
                                       "w_uv"], ["o", "rows"], heads=HEADS, scale=0.1, eps=1e-6, interleave=1)],
              feed, ["o", "rows"], weights), feed)
    # the attention alone at the 304M checkpoint's shapes (16 heads, Dl 256, Dr 32; the query given in the latent
    # space, no W^UK, W^UV), over a short, a middling and a long context
    h, dl, dr = 16, 256, 32
    angles = rng.uniform(0, 6, (4096, dr // 2))
    tables = {"norm": np.ones(dl, np.float32), "cos": np.cos(angles).astype(np.float32),
              "sin": np.sin(angles).astype(np.float32)}
    for cached in (90, 500, 2000):
        feed = {"q": rng.standard_normal((1, 1, h * (dl + dr))).astype(np.float32),
                "kv": rng.standard_normal((1, 1, dl + dr)).astype(np.float32), "pos": np.array([[cached]], np.int64),
                "cache": rng.standard_normal((1, cached + 1, dl + dr)).astype(np.float32),
                "past_len": np.array([cached], np.int32)}
        out[f"MlaSelfAttention, 304M's 16 heads (Dl {dl}), {cached} cached rows, no W^UK, W^UV"] = (
            model([op("MlaSelfAttention", ["q", "kv", "norm", "pos", "cos", "sin", "cache", "past_len"], ["o", "rows"],
                      heads=h, scale=0.05, eps=1e-6, interleave=1)], feed, ["o", "rows"], tables), feed)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=3000)
    a = ap.parse_args()
    ok, why = ort_lib.available()
    if not ok:
        raise SystemExit(f"mtp-trt's CPU operators are not available here: {why}")
    models = cases(np.random.default_rng(0))
    times = {name: best_call(m, feed, a.threads, a.calls) for name, (m, feed) in models.items()}
    empty = next(iter(times.values()))
    print(f"{a.threads} thread(s), the fastest of {a.calls} calls; an empty session's run: {empty:.1f} us")
    for name, us in list(times.items())[1:]:
        print(f"  {name:66s} {(us - empty) / (CHAIN if 'per node' in name else 1):6.2f} us")


if __name__ == "__main__":
    main()
