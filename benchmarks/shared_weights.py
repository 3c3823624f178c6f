"""OrtBackend's weight and thread settings compared, interleaved in one process (medians and best runs):
python benchmarks/shared_weights.py EXPORT_DIR [--nextn 0 1 3] [--tokens 128] [--variants shared step-packed ...]
python benchmarks/shared_weights.py --chain [--chain-tokens 1]   # MLAS alone: unpacked against pre-packed weights

Variants (each an OrtBackend over the same export, greedy decoding, batch 1):
  shared       one shared copy of the weights, no pre-packing anywhere
  step-packed  shared, the step graphs pre-packing a private copy of their dense weights (the default)
  copies       every session its own pre-packed copy (share_weights=False)
  spinning     step-packed, with ONNX Runtime's threads spinning between kernels (allow_spinning 1)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

VARIANTS = {"shared": dict(share_weights=True, prepack=()), "step-packed": dict(share_weights=True),
            "copies": dict(share_weights=False), "spinning": dict(share_weights=True)}


def backend(manifest, threads: int, variant: str):
    from mtp_trt.backend import OrtBackend

    b = OrtBackend(manifest, threads=threads, **VARIANTS[variant])
    b.spin = variant == "spinning"
    return b


def matmul_chain(threads: int, rounds: int, tokens: int) -> None:
    """One ONNX graph of 32 MatMuls shaped like the 85m checkpoint's projections (102 MB of fp32 weights, over
    the L3 cache), each weight a constant [K, N], run with and without ONNX Runtime's pre-packing."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    shapes = [(768, 4096), (2048, 768), (768, 544), (384, 768), (512, 768), (768, 384), (768, 160), (128, 1024)] * 4
    rng = np.random.default_rng(0)
    ks = sorted({k for k, _ in shapes})
    nodes = [helper.make_node("MatMul", [f"x{k}", f"w{i}"], [f"y{i}"]) for i, (k, _) in enumerate(shapes)]
    weights = [numpy_helper.from_array((0.02 * rng.standard_normal(kn)).astype(np.float32), f"w{i}")
               for i, kn in enumerate(shapes)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [tokens, k])
                                               for k in ks],
                              [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(len(shapes))],
                              weights)
    blob = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
    sessions = {}
    for name, packed in (("unpacked", False), ("pre-packed", True)):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if not packed:
            options.add_session_config_entry("session.disable_prepacking", "1")
        sessions[name] = ort.InferenceSession(blob, options, providers=["CPUExecutionProvider"])
    feed = {f"x{k}": rng.standard_normal((tokens, k)).astype(np.float32) for k in ks}
    gb = sum(k * n for k, n in shapes) * 4 / 1e9
    times = {name: [] for name in sessions}
    for _ in range(rounds):
        for name, sess in sessions.items():
            t0 = time.perf_counter()
            sess.run(None, feed)
            times[name].append(time.perf_counter() - t0)
    print(f"{len(shapes)} MatMuls, {gb * 1e3:.0f} MB of weights, {tokens} token(s), {threads} threads: " + ", ".join(
        f"{n} {gb / statistics.median(ts):.1f} GB/s (best {gb / min(ts):.1f})" for n, ts in times.items()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("export", type=Path, nargs="?")
    ap.add_argument("--chain", action="store_true", help="time MLAS on a chain of MatMuls instead of an export")
    ap.add_argument("--chain-tokens", type=int, default=1)
    ap.add_argument("--nextn", type=int, nargs="+", default=[0, 1, 3])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    a = ap.parse_args()
    if a.chain:
        return matmul_chain(a.threads, 4 * a.rounds, a.chain_tokens)
    if a.export is None:
        ap.error("EXPORT_DIR is required (or --chain)")
    from mtp_trt.decode import DecodeOptions, generate
    from mtp_trt.manifest import Manifest

    manifest = Manifest.load(a.export)
    backends = {name: backend(manifest, a.threads, name) for name in a.variants}
    prompt = list(range(3, 40))
    for nextn in a.nextn:
        opts = DecodeOptions(nextn=nextn, max_new_tokens=a.tokens)
        tokens = {name: generate(b, [prompt], opts)[0][0].generated for name, b in backends.items()}
        times = {name: [] for name in backends}
        for _ in range(a.rounds):
            for name, b in backends.items():
                t0 = time.perf_counter()
                generate(b, [prompt], opts)
                times[name].append(time.perf_counter() - t0)
        same = len({tuple(t) for t in tokens.values()}) == 1
        print(f"nextn {nextn} (same tokens: {same}): " + ", ".join(
            f"{n} {a.tokens / statistics.median(ts):.0f} tokens/s (best {a.tokens / min(ts):.0f})"
            for n, ts in times.items()), flush=True)


if __name__ == "__main__":
    main()
