"""Quantized-weight CPU operators on ONNX Runtime: mtp-trt's `mtp_trt.cpu::QMatMul` and `QMoE` against ONNX Runtime's
`com.microsoft::MatMulNBits` (accuracy_level 4: int8 activations; the same bytes) and `com.microsoft::QMoE`, and the
fp32 forms (`MatMul`, `mtp_trt.cpu::MoE`), on the shapes of the project's checkpoints: the 85M and 304M random
checkpoints (benchmarks/bench_common.py) and DeepSeek-V2-Lite (hidden 2048, 64 experts top-6 of width 1408, 2 shared).

  python benchmarks/quant_ops.py                       # every table, 2 threads
  python benchmarks/quant_ops.py --tables matmul --models v2-lite --rows 1 64

Tables (medians over --runs timed runs after warm-up, each run one session call):
  matmul : the dense MLP's two projections (gate/up [2I, D], down [D, I]) as a chain of `--chain` distinct
           (up, down) pairs in one graph, so a call is long enough to time and the weights (tens of MB at int4)
           come from the L3 cache rather than L1/L2; microseconds per pair.
  stream : M = 1 through a chain of 2048 x 2048 projections whose weights (--stream-mb of each form) do not fit
           in the last-level cache: GB/s of weight bytes read (the bandwidth-bound decode case).
  moe    : one MoE layer (routed experts only, so that ONNX Runtime's QMoE, which has no shared experts, does the
           same work), microseconds per call, random router inputs (different experts per run).  ONNX Runtime's
           QMoE routes by softmax top-k over a MatMul's logits, ours by the model's router (sigmoid, groups):
           other experts, as many per token.
Weights are random bytes with scales that keep activations near unit size, handed to the sessions in memory;
only the speed is measured here (the tests check the values).  With other processes on the machine's cores,
2-thread figures wait on descheduled threads: compare forms within a table (their calls alternate), and see
--threads 1.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import time

import numpy as np
from onnx import TensorProto, helper

from mtp_trt.plugins import ort_lib

MODELS = {  # hidden, dense MLP width, experts, top-k, expert width, groups (n_group, topk_group)
    "85m": dict(d=768, inter=2048, experts=16, k=2, moe_inter=256, groups=(4, 2)),
    "304m": dict(d=1024, inter=3072, experts=32, k=4, moe_inter=160, groups=(8, 4)),
    "v2-lite": dict(d=2048, inter=10944, experts=64, k=6, moe_inter=1408, groups=(1, 1)),
}
BLOCK = 32
F32, U8 = TensorProto.FLOAT, TensorProto.UINT8


def quant_path() -> str:
    """The instruction set the quantized kernels run on here."""
    lib = ctypes.CDLL(str(ort_lib.resolve_library()))
    lib.MtpOrtQuantPath.restype = ctypes.c_char_p
    return lib.MtpOrtQuantPath().decode()


def random_q(rng, n, k, bits):
    """Random quantized weight [N, K] (data, scales): levels uniform over the format's range."""
    nb = -(-k // BLOCK)
    data = rng.integers(0, 256, (n, nb, BLOCK * bits // 8), dtype=np.uint8)
    rms = 4.6 if bits == 4 else 74.0  # uniform levels' rms
    scales = np.full((n, nb), 1.0 / (rms * np.sqrt(k)), np.float32) * rng.uniform(0.5, 1.5, (n, nb)).astype(np.float32)
    return data, scales


def placeholder(name, a):
    """An initializer whose data the session gets from memory (SessionOptions.add_external_initializers): no
    2 GB protobuf limit, no copy of the weights in the serialized graph."""
    t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(a.dtype), dims=a.shape,
                    data_location=TensorProto.EXTERNAL)
    t.external_data.add(key="location", value=f"{name}.bin")
    return t


def model(nodes, inputs, weights: dict, output="y"):
    """(the serialized graph, its weights): `weights` name -> array, handed to the session in memory."""
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, t, None) for n, t in inputs],
                          [helper.make_tensor_value_info(output, F32, None)],
                          [placeholder(n, a) for n, a in weights.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1),
                                            helper.make_opsetid(ort_lib.DOMAIN, 1)])
    m.ir_version = 9
    return m.SerializeToString(), weights


def linear(form, name, x, y, n, k, rng):
    """One projection y = x W^T in `form` (fp32, ours-int4/8, ort-int4/8): (node, initializers)."""
    if form == "fp32":
        w = (rng.standard_normal((k, n), np.float32) / np.float32(np.sqrt(k)))
        return helper.make_node("MatMul", [x, name], [y]), {name: w}
    kind, bits = form.split("-int")
    data, scales = random_q(rng, n, k, int(bits))
    inits = {name: data, name + "_s": scales}
    attrs = dict(K=k, N=n, bits=int(bits), block_size=BLOCK)
    if kind == "ours":
        return helper.make_node("QMatMul", [x, name, name + "_s"], [y], domain=ort_lib.DOMAIN, **attrs), inits
    return helper.make_node("MatMulNBits", [x, name, name + "_s"], [y], domain="com.microsoft", accuracy_level=4,
                            **attrs), inits


def chain(form, shapes, reps, rng):
    """reps times the projections `shapes` [(N, K), ...] one after another, each with its own weights (where a
    projection's K is narrower than the one before it, the first K columns go on: the MLP's SwiGLU halving)."""
    nodes, inits, x, width = [], {}, "x", shapes[0][1]
    consts = {}
    for r in range(reps):
        for i, (n, k) in enumerate(shapes):
            if k < width:
                nodes.append(helper.make_node("Slice", [x, "zero", f"k{k}", "last"], [x + "_k"]))
                consts.update({"zero": 0, "last": -1, f"k{k}": k})
                x += "_k"
            y = "y" if (r == reps - 1 and i == len(shapes) - 1) else f"h{r}_{i}"
            node, w = linear(form, f"w{r}_{i}", x, y, n, k, rng)
            nodes.append(node)
            inits |= w
            x, width = y, n
    inits |= {name: np.array([v], np.int64) for name, v in consts.items()}
    return model(nodes, [("x", F32)], inits)


def session(graph, threads):
    """A session of model()'s (graph, weights) with the operators registered; it keeps its weights alive."""
    import onnxruntime as ort

    graph, weights = graph
    o = ort.SessionOptions()
    o.intra_op_num_threads = threads
    o.log_severity_level = 3
    values = [ort.OrtValue.ortvalue_from_numpy(a) for a in weights.values()]
    o.add_external_initializers(list(weights), values)
    sess = ort_lib.session(graph, o)
    sess.weights = values
    return sess


def timed(sessions: dict, feeds, runs, warmup=3):
    """{name: median seconds of one call} over `runs` rounds, each round one call of every session in turn (so
    that a change in the machine's load touches all alike); feeds: one dict, or a list cycled through."""
    feeds = feeds if isinstance(feeds, list) else [feeds]
    times = {name: [] for name in sessions}
    for i in range(warmup + runs):
        for name, sess in sessions.items():
            t = time.perf_counter()
            sess.run(None, feeds[i % len(feeds)])
            if i >= warmup:
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(t) for name, t in times.items()}


FORMS = ("fp32", "ort-int4", "ours-int4", "ort-int8", "ours-int8")


def matmul_table(a):
    print(f"\nmatmul: microseconds per (up, down) pair of the dense MLP, {a.threads} threads, block {BLOCK}, "
          f"median of {a.runs}")
    print(f"{'model':8} {'up [N,K]':>12} {'M':>4} " + " ".join(f"{f:>10}" for f in FORMS) + "   ours/ort int4, int8")
    for name in a.models:
        cfg = MODELS[name]
        d, inter = cfg["d"], cfg["inter"]
        shapes = [(2 * inter, d), (d, inter)]
        pair_mb = 3 * inter * d * 0.5 / 2**20  # int4 bytes of one pair
        reps = max(1, min(a.chain, int(48 / pair_mb)))
        sessions = {f: session(chain(f, shapes, reps, np.random.default_rng(0)), a.threads) for f in FORMS}
        for m in a.rows:
            x = np.random.default_rng(m).standard_normal((m, d)).astype(np.float32)
            us = {f: t / reps * 1e6 for f, t in timed(sessions, {"x": x}, a.runs).items()}
            print(f"{name:8} {f'[{2 * inter},{d}]':>12} {m:4} " + " ".join(f"{us[f]:10.1f}" for f in FORMS) +
                  f"   {us['ours-int4'] / us['ort-int4']:.2f}, {us['ours-int8'] / us['ort-int8']:.2f}")
        del sessions
        gc.collect()


def stream_table(a):
    n = k = 2048
    print(f"\nstream: M = 1 through 2048 x 2048 projections, about {a.stream_mb} MB of weights per form (beyond "
          f"the last-level cache), {a.threads} threads, median of {max(5, a.runs // 4)}: GB/s of weight bytes read, "
          f"ms per call")
    sessions, size = {}, {}
    for form in FORMS:
        per = n * k * (4 if form == "fp32" else int(form[-1]) / 8) + (0 if form == "fp32" else n * k / BLOCK * 4)
        reps = max(1, int(a.stream_mb * 2**20 / per))
        sessions[form] = session(chain(form, [(n, k)], reps, np.random.default_rng(1)), a.threads)
        size[form] = per * reps
    x = np.random.default_rng(0).standard_normal((1, k)).astype(np.float32)
    for form, t in timed(sessions, {"x": x}, max(5, a.runs // 4)).items():
        print(f"  {form:10} {size[form] / 2**20:6.0f} MB  {size[form] / t / 1e9:6.2f} GB/s  {t * 1e3:8.2f} ms")
    del sessions
    gc.collect()


def moe_graph(form, cfg, rng):
    """One routed-experts MoE layer: `fp32` (mtp_trt.cpu::MoE), `ours-intB` (mtp_trt.cpu::QMoE), `ort-intB`
    (com.microsoft::QMoE: softmax top-k over router_probs, SwiGLU with interleaved gate/up rows)."""
    e, d, i, k = cfg["experts"], cfg["d"], cfg["moe_inter"], cfg["k"]
    gate = (rng.standard_normal((e, d)) * 0.05).astype(np.float32)
    route = dict(top_k=k, n_group=cfg["groups"][0], topk_group=cfg["groups"][1], softmax=0, group_top2=1,
                 norm_topk_prob=1, routed_scaling_factor=1.0)
    if form == "fp32":
        fc1 = rng.standard_normal((e, 2 * i, d), np.float32) / np.float32(np.sqrt(d))
        fc2 = rng.standard_normal((e, d, i), np.float32) / np.float32(np.sqrt(i))
        inits = dict(gate=gate, fc1=fc1, fc2=fc2)
        node = helper.make_node("MoE", ["x", "gate", "", "fc1", "fc2"], ["y"], domain=ort_lib.DOMAIN, **route)
        return model([node], [("x", F32)], inits)
    kind, bits = form.split("-int")
    bits = int(bits)
    q1 = [random_q(rng, 2 * i, d, bits) for _ in range(e)]
    q2 = [random_q(rng, d, i, bits) for _ in range(e)]
    fc1, fc1s = np.stack([q[0] for q in q1]), np.stack([q[1] for q in q1])
    fc2, fc2s = np.stack([q[0] for q in q2]), np.stack([q[1] for q in q2])
    if kind == "ours":
        inits = dict(gate=gate, fc1=fc1, fc1_s=fc1s, fc2=fc2, fc2_s=fc2s)
        node = helper.make_node("QMoE", ["x", "gate", "", "fc1", "fc1_s", "fc2", "fc2_s"], ["y"],
                                domain=ort_lib.DOMAIN, bits=bits, block_size=BLOCK, **route)
        return model([node], [("x", F32)], inits)
    # ONNX Runtime's QMoE: weights [E, N, K * bits / 8] (our blocks flattened), scales [E, N, K / block], the
    # implicit zero point 2^(bits-1) as ours; the router's logits come from a MatMul with the gate
    inits = dict(gate_t=gate.T.copy(), fc1=fc1.reshape(e, 2 * i, -1), fc1_s=fc1s, fc2=fc2.reshape(e, d, -1), fc2_s=fc2s)
    nodes = [helper.make_node("MatMul", ["x", "gate_t"], ["logits"]),
             helper.make_node("QMoE", ["x", "logits", "fc1", "fc1_s", "", "fc2", "fc2_s"], ["y"],
                              domain="com.microsoft", k=k, expert_weight_bits=bits, block_size=BLOCK,
                              activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0,
                              normalize_routing_weights=1, accuracy_level=4)]
    return model(nodes, [("x", F32)], inits)


MOE_FORMS = FORMS


def moe_table(a):
    print(f"\nmoe: microseconds per routed-experts MoE layer, {a.threads} threads, block {BLOCK}, median of "
          f"{a.runs} (16 inputs cycled)")
    print(f"{'model':8} {'M':>4} " + " ".join(f"{f:>10}" for f in MOE_FORMS) + "   ours/ort int4, int8")
    for name in a.models:
        cfg = MODELS[name]
        sessions = {}
        for f in MOE_FORMS:
            try:
                sessions[f] = session(moe_graph(f, cfg, np.random.default_rng(2)), a.threads)
            except Exception as e:  # (ONNX Runtime's QMoE where its CPU kernel refuses the configuration)
                print(f"  {f}: no session: {str(e).splitlines()[0][:160]}")
        for m in a.rows:
            rng = np.random.default_rng(m)
            feeds = [{"x": rng.standard_normal((m, cfg["d"])).astype(np.float32)} for _ in range(16)]
            for f, s in list(sessions.items()):
                try:
                    s.run(None, feeds[0])
                except Exception as e:  # (ditto)
                    print(f"  {f}: run failed: {str(e).splitlines()[0][:160]}")
                    del sessions[f]
            us = {f: t * 1e6 for f, t in timed(sessions, feeds, a.runs).items()}
            cell = {f: f"{us[f]:10.1f}" if f in us else f"{'-':>10}" for f in MOE_FORMS}
            ratio = ", ".join(f"{us[f'ours-int{b}'] / us[f'ort-int{b}']:.2f}" if f"ort-int{b}" in us else "-"
                              for b in (4, 8))
            print(f"{name:8} {m:4} " + " ".join(cell[f] for f in MOE_FORMS) + f"   {ratio}")
        del sessions
        gc.collect()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tables", nargs="+", default=["matmul", "stream", "moe"], choices=["matmul", "stream", "moe"])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 64])
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--chain", type=int, default=8, help="most (up, down) pairs per matmul graph")
    ap.add_argument("--stream-mb", type=int, default=320)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import onnxruntime as ort

    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"onnxruntime {ort.__version__}; mtp_trt.cpu quantized kernels: {quant_path()}; load average {load} "
          f"on {os.cpu_count()} CPUs (other processes share them: medians)")
    for t in a.tables:
        {"matmul": matmul_table, "stream": stream_table, "moe": moe_table}[t](a)


if __name__ == "__main__":
    main()
