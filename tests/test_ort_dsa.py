"""DeepSeek Sparse Attention in mtp-trt's CPU operators (plugins/ort, domain mtp_trt.cpu) against their NumPy
references (plugins/ort_reference.py): LightningIndexer (the indexer's scores and top-k selection) and MlaAttention
over the selected rows, on random and adversarial inputs -- sizes off the vector widths, fewer visible rows than
index_topk and many more, rows past a tile's end, exact ties, keys after the latent in wider rows, a selection
shared by two attention nodes (GLM-5's `shared` layers) -- every instruction-set path, any thread count giving the
same bits, and bad input as one error naming the op and the input.

Tolerances: the selection must equal the reference's exactly (float32 scores against float64 ones: the inputs are
random, so no two scores are within rounding of each other at the k-th place, except the ties built on purpose,
which are exact in both); attention 2e-6 of the output's largest magnitude, as tests/test_ort_ops.py."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from mtp_trt.plugins import ort_lib, ort_reference as ref
from test_ort_ops import TYPES, close, mla_inputs

pytestmark = pytest.mark.skipif(not ort_lib.available()[0], reason=f"mtp_trt.cpu operators: {ort_lib.available()[1]}")


def run_graph(nodes: list, inputs: dict, outputs: dict, threads: int = 2) -> list[np.ndarray]:
    """A graph of mtp_trt.cpu nodes (op, input names, output name, attributes); `outputs`: name -> ONNX type."""
    fed = {n: a for n, a in inputs.items() if a is not None}
    graph = helper.make_graph(
        [helper.make_node(op, ins, [out], domain=ort_lib.DOMAIN, **attrs) for op, ins, out, attrs in nodes], "g",
        [helper.make_tensor_value_info(n, TYPES[a.dtype.type], a.shape) for n, a in fed.items()],
        [helper.make_tensor_value_info(n, t, None) for n, t in outputs.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(ort_lib.DOMAIN, 1)])
    model.ir_version = 9
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort_lib.session(model.SerializeToString(), options).run(list(outputs), fed)


def names(inputs: dict, order: list[str]) -> list[str]:
    """The node's input names in `order`, absent optional ones as "" (trailing ones dropped)."""
    out = [n if inputs.get(n) is not None else "" for n in order]
    while out and not out[-1]:
        out.pop()
    return out


INDEXER_INPUTS = ["iq", "iw", "rows", "cache", "past_len", "visible"]


def indexer(ins: dict, heads: int, topk: int, scale: float, threads: int = 2) -> np.ndarray:
    node = ("LightningIndexer", names(ins, INDEXER_INPUTS), "sel", dict(heads=heads, topk=topk, scale=scale))
    return run_graph([node], ins, {"sel": TensorProto.INT32}, threads)[0]


def dsa_inputs(rng, b, s, h, dl, dr, hi, di, t, r, mask=None, valid=None):
    """Inputs of both ops: MLA's (test_ort_ops.mla_inputs), the indexer's (iq, iw) and rows/cache [.., Dl + Dr + Di]
    (the indexer key last, as the DSA cache row); valid: the cached rows per sequence (default: random, some out of
    range)."""
    ins = mla_inputs(rng, b, s, h, dl, dr, t, r, mask)
    for name in ("rows", "cache"):
        keys = rng.standard_normal((*ins[name].shape[:2], di)).astype(np.float32)
        ins[name] = np.concatenate([ins[name], keys], -1)
    if valid is not None:
        ins["past_len"] = np.array(valid, np.int32)
    return ins | dict(iq=rng.standard_normal((b, s, hi * di)).astype(np.float32),
                      iw=rng.standard_normal((b, s, hi)).astype(np.float32))


def ref_indexer(ins, hi, topk, scale):
    return ref.lightning_indexer(ins["iq"], ins["iw"], ins["rows"], ins["cache"], ins["past_len"], ins["visible"],
                                 heads=hi, topk=topk, scale=scale)


INDEXER_CASES = [  # b, s, hi, di, t, r, topk, mask, valid
    (1, 1, 16, 64, 2000, 1, 512, None, [1999]),  # a decode step, rows >> topk (V3.2's indexer, scaled down)
    (1, 1, 16, 64, 300, 1, 512, None, [300]),  # fewer visible rows than topk: all of them, then -1
    (2, 4, 8, 32, 700, 4, 64, None, [700, 517]),  # verify 4 rows, the last tile partial
    (3, 3, 5, 20, 45, 3, 7, None, None),  # odd heads and dims (not multiples of 8 or 16), out-of-range lengths
    (2, 5, 3, 16, 33, 7, 9, "batch", [17, 33]),  # a tree mask per sequence, extra rows before the new ones
    (2, 2, 9, 24, 40, 6, 300, "shared", [0, 40]),  # an empty cache; topk beyond every row
    (1, 2, 64, 128, 1030, 2, 200, None, [1030]),  # V3.2's head count and dim
]


@pytest.mark.parametrize("case", INDEXER_CASES, ids=lambda c: "b{}-s{}-hi{}-di{}-t{}-r{}-k{}-{}".format(*c[:8]))
def test_indexer_selects_the_reference_rows(case):
    b, s, hi, di, t, r, topk, mask, valid = case
    rng = np.random.default_rng(list(case[:7]))
    ins = dsa_inputs(rng, b, s, 2, 8, 8, hi, di, t, r, mask, valid)
    scale = di ** -0.5
    got = indexer(ins, hi, topk, scale)
    want = ref_indexer(ins, hi, topk, scale)
    assert got.shape == want.shape == (b, s, min(topk, t + r))
    np.testing.assert_array_equal(got, want)


def test_indexer_ties_keep_the_earlier_rows():
    """Rows in pairs with equal keys (2j and 2j + 1 score alike), and a token whose queries are all zero (every
    score 0): the k-th place splits a pair, or a run of equal scores, and the earlier rows must win."""
    rng = np.random.default_rng(4)
    ins = dsa_inputs(rng, 1, 3, 4, 8, 8, 6, 16, 90, 3, valid=[90])
    ins["cache"][:, 1::2] = ins["cache"][:, 0::2]
    ins["iq"][0, 1] = 0.0
    for topk in (7, 31, 60):
        got = indexer(ins, 6, topk, 0.25)
        np.testing.assert_array_equal(got, ref_indexer(ins, 6, topk, 0.25))
        np.testing.assert_array_equal(got[0, 1], np.arange(topk))  # all tied: the first topk rows
        for row in got[0, [0, 2]]:
            assert all(i % 2 == 0 or i - 1 in row for i in row if i < 90)  # a lone pick of a pair is its earlier row


# ---------------------------------------------------------------------------- attention over the selection
def mla(ins: dict, heads: int, scale: float, threads: int = 2) -> np.ndarray:
    order = ["q_lat", "q_pe", "rows", "cache", "past_len", "visible", "selected"]
    return run_graph([("MlaAttention", names(ins, order), "y", dict(heads=heads, scale=scale))], ins,
                     {"y": TensorProto.FLOAT}, threads)[0]


@pytest.mark.parametrize("case", [(1, 1, 16, 64, 32, 900, 1, 128), (2, 3, 3, 20, 12, 50, 5, 9),
                                  (2, 4, 8, 40, 8, 30, 4, 64)], ids=lambda c: "b{}-s{}-h{}-t{}-k{}".format(*c[:3], *c[5:6], c[7]))
def test_attention_over_selected_rows(case):
    """MlaAttention with `selected` attends exactly to the named rows (cache rows and new rows, -1 skipped), the
    rows wider than the latent (the indexer key after it)."""
    b, s, h, dl, dr, t, r, topk = case
    rng = np.random.default_rng(list(case))
    ins = dsa_inputs(rng, b, s, h, dl, dr, 4, 16, t, r, valid=rng.integers(t // 2, t + 1, b))
    ins["selected"] = indexer(ins, 4, topk, 0.25)
    scale = 0.7 / np.sqrt(dl + dr)
    close(mla(ins, h, scale), ref.mla_attention(**{k: v for k, v in ins.items() if k not in ("iq", "iw")}, heads=h,
                                                 scale=scale))


def test_selection_of_every_visible_row_is_dense_attention():
    """Where index_topk covers every visible row, sparse attention is dense MLA: the same output as the op without
    a selection (up to the order of the sums)."""
    rng = np.random.default_rng(8)
    ins = dsa_inputs(rng, 2, 3, 4, 24, 8, 4, 16, 40, 5, "batch", [40, 23])
    ins["selected"] = indexer(ins, 4, 64, 0.25)
    dense = {k: v for k, v in ins.items() if k != "selected"}
    close(mla(ins, 4, 0.2), mla(dense, 4, 0.2), 1e-6)


def test_a_shared_layer_reuses_the_selection():
    """GLM-5's `shared` layers: one LightningIndexer feeding two MlaAttention nodes (each its own queries) in one
    graph, as the exported graphs wire it."""
    rng = np.random.default_rng(12)
    ins = dsa_inputs(rng, 1, 2, 4, 16, 8, 8, 32, 400, 2, valid=[400])
    ins2 = dict(ins, q_lat=rng.standard_normal(ins["q_lat"].shape).astype(np.float32))
    feeds = dict(ins, q_lat2=ins2["q_lat"])
    rows = ["rows", "cache", "past_len"]
    nodes = [("LightningIndexer", ["iq", "iw", *rows], "sel", dict(heads=8, topk=50, scale=0.2)),
             ("MlaAttention", ["q_lat", "q_pe", *rows, "", "sel"], "y1", dict(heads=4, scale=0.3)),
             ("MlaAttention", ["q_lat2", "q_pe", *rows, "", "sel"], "y2", dict(heads=4, scale=0.3))]
    sel, y1, y2 = run_graph(nodes, feeds, {"sel": TensorProto.INT32, "y1": TensorProto.FLOAT, "y2": TensorProto.FLOAT})
    want = ref_indexer(ins, 8, 50, 0.2)
    np.testing.assert_array_equal(sel, want)
    for q, y in ((ins, y1), (ins2, y2)):
        close(y, ref.mla_attention(q["q_lat"], q["q_pe"], q["rows"], q["cache"], q["past_len"], selected=want,
                                   heads=4, scale=0.3))


# ------------------------------------------------------------------------------ threads and paths
def test_any_thread_count_gives_the_same_bits(monkeypatch):
    """1, 2 and 3 threads agree exactly, whether every call is split (MTP_ORT_MIN_PARALLEL_WORK=0) or only large
    ones."""
    rng = np.random.default_rng(13)
    ins = dsa_inputs(rng, 1, 2, 8, 32, 16, 16, 64, 1500, 2, valid=[1500])
    outs = []
    for split, n in itertools.product(("0", ""), (1, 2, 3)):
        monkeypatch.setenv("MTP_ORT_MIN_PARALLEL_WORK", split)  # read when a session makes its kernels
        sel = indexer(ins, 16, 100, 0.125, threads=n)
        outs.append((sel, mla(dict(ins, selected=sel), 8, 0.2, threads=n)))
    for sel, y in outs[1:]:
        assert np.array_equal(sel, outs[0][0]) and np.array_equal(y, outs[0][1])


PATHS = {"avx512": ({}, "avx512f"), "avx2": ({"MTP_TRT_CPU_ISA": "avx2"}, "avx2"),
         "scalar": ({"MTP_TRT_CPU_ISA": "scalar"}, "")}
PATH_CHILD = """
import ctypes, sys
import numpy as np
sys.path.insert(0, {tests!r})
import test_ort_dsa as t
from mtp_trt.plugins import ort_lib
lib = ctypes.CDLL(str(ort_lib.resolve_library()))
lib.MtpOrtIndexPath.restype = ctypes.c_char_p
outs = {{"path": np.array(lib.MtpOrtIndexPath().decode())}}
for hi in (12, 32):  # (AVX-512: rows across the lanes, or heads across them where they are a multiple of 16)
    ins = t.dsa_inputs(np.random.default_rng(21), 2, 3, 4, 24, 8, hi, 40, 333, 3, "batch", [333, 100])
    sel = outs[f"sel{{hi}}"] = t.indexer(ins, hi, 45, 0.15)
    outs[f"want{{hi}}"] = t.ref_indexer(ins, hi, 45, 0.15)
    outs[f"y{{hi}}"] = t.mla(dict(ins, selected=sel), 4, 0.2)
np.savez(sys.argv[1], **outs)
"""


def cpu_flags() -> set:
    from test_ort_quant_ops import cpu_flags as flags

    return flags()


@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_instruction_set_path_selects_the_same_rows(path, tmp_path):
    """Each path (forced by its environment variable, where the CPU has it) selects the reference's rows and
    attends to them alike (a child process each: the path is chosen once per process)."""
    env, flag = PATHS[path]
    if flag and flag not in cpu_flags():
        pytest.skip(f"this CPU has no {flag}")
    clean = {k: v for k, v in os.environ.items() if k != "MTP_TRT_CPU_ISA"}
    code = PATH_CHILD.format(tests=os.path.dirname(__file__))
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "out.npz")], check=True, env=clean | env)
    out = np.load(tmp_path / "out.npz")
    assert str(out["path"]) == path
    for hi in (12, 32):
        np.testing.assert_array_equal(out[f"sel{hi}"], out[f"want{hi}"])
    if path != "avx512":
        return
    for other in ("avx2", "scalar"):  # (the first run's values against each other path, in this process)
        subprocess.run([sys.executable, "-c", code, str(tmp_path / f"{other}.npz")], check=True,
                       env=clean | PATHS[other][0])
        for hi in (12, 32):
            close(np.load(tmp_path / f"{other}.npz")[f"y{hi}"], out[f"y{hi}"], 1e-6)


# ----------------------------------------------------------------------------------------- errors
def test_bad_input_is_one_error_naming_the_op_and_input():
    import onnxruntime as ort

    bad = ort.capi.onnxruntime_pybind11_state.InvalidArgument
    rng = np.random.default_rng(0)
    ins = dsa_inputs(rng, 1, 2, 4, 16, 8, 4, 16, 10, 2, valid=[10])
    with pytest.raises(bad, match=r"mtp_trt\.cpu::LightningIndexer: q \[1, 2, 64\] and weights \[1, 2, 3\] must be"):
        indexer(dict(ins, iw=ins["iw"][..., :3]), 4, 5, 0.1)
    with pytest.raises(bad, match=r"LightningIndexer: rows \[1, 2, 40\] and cache \[1, 10, 40\] must be .*C >= Di = 64"):
        indexer(dict(ins, iq=np.zeros((1, 2, 256), np.float32)), 4, 5, 0.1)
    with pytest.raises(bad, match=r"MlaAttention: selected holds row 12, outside -1 \.\. T \+ R - 1 = 11"):
        mla(dict(ins, selected=np.array([[[0, 12]], [[1, 2]]], np.int32).reshape(1, 2, 2)), 4, 0.1)
    with pytest.raises(bad, match=r"MlaAttention: selected \[2, 2\] must be int32 \[B, S, K\]"):
        mla(dict(ins, selected=np.zeros((2, 2), np.int32)), 4, 0.1)
