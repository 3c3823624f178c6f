"""mtp-trt's quantized-weight CPU operators (plugins/ort, domain mtp_trt.cpu: QMatMul, QMoE, MlaSelfAttention with
int8 W^UK and W^UV) against their NumPy references (plugins/ort_reference.py), one node at a time: 4- and 8-bit
weights in every block size, K not a multiple of the block, 1 to 64 rows, weight bytes over their whole range (the
int8 products that saturate int16 pairs), constant and all-zero activation blocks, shared experts on and off,
grouped routing; every
instruction set the CPU has (scalar, AVX2, AVX-VNNI, AVX512-VNNI), any thread count giving the same bits, and
bad input as one error naming the op and the input.

Tolerances, relative to the output's largest magnitude:
* against the reference that quantizes the activations as the op does (ort_reference.quantize_activations; the
  integer products exact, the scales applied in float64): 1e-5, the float32 sums of the scaled blocks (QMoE's
  SwiGLU activations are quantized again from float32 in the op and from float64 in the reference: an
  activation within rounding of a level boundary could take the neighbouring level, a difference of ~1e-3;
  none does on these inputs, on any path);
* against the float64 product with the dequantized weights, what int8 activations approximate: 1e-2 (QMatMul)
  and 3e-2 (QMoE and MlaSelfAttention, two products)."""

from __future__ import annotations

import ctypes
import itertools
import os
import platform
import shutil
import subprocess
import sys

import mmap

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from mtp_trt.plugins import ort_lib, ort_reference as ref
from mtp_trt.quant import Scheme, quantize

sys.path.insert(0, os.path.dirname(__file__))
from test_ort_ops import MLA_SELF_CASES, close, mla_self_inputs, moe_inputs  # noqa: E402

pytestmark = pytest.mark.skipif(not ort_lib.available()[0], reason=f"mtp_trt.cpu operators: {ort_lib.available()[1]}")

EXACT = 1e-5
APPROX, QMOE_APPROX = 1e-2, 3e-2
BLOCKS = (16, 32, 64, 128, 256)
ROWS = (1, 2, 3, 7, 64)


WEIGHTS = ("fed", "initializers")  # how session() gives a node its constants


def session(op: str, attrs: dict, constants: dict, fed: tuple = ("x",), threads: int = 2, weights: str = "fed",
            pack_max_bytes: int | None = None, outputs: int = 1):
    """A session of one mtp_trt.cpu node whose inputs are `constants` (name -> array, None: left out) and the
    float32 inputs `fed`, of any shape.  weights "fed": the constants are fed too, from memory that ends where an
    unreadable page begins (as the last tensor of weights.bin's mapping does): a kernel that reads past a weight
    or scale array faults here instead of passing unnoticed; the kernels read the weights as stored.
    "initializers": the constants are the graph's initializers, constant inputs to the node, which the VNNI paths
    pack once (kernels.h QPack) and read packed (those up to `pack_max_bytes`, the session's limit, where set).
    The node's outputs: y, or y0, y1, ... where it has `outputs` > 1."""
    names = list(constants)
    while names and constants[names[-1]] is None:
        names.pop()
    given = {n: a for n, a in constants.items() if n not in fed and a is not None}
    ys = ["y"] if outputs == 1 else [f"y{i}" for i in range(outputs)]
    graph = helper.make_graph(
        [helper.make_node(op, [n if n in fed or constants[n] is not None else "" for n in names], ys,
                          domain=ort_lib.DOMAIN, **attrs)], "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in fed]
        + [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
           for n, a in given.items() if weights == "fed"],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, None) for y in ys],
        [numpy_helper.from_array(a, n) for n, a in given.items()] if weights == "initializers" else None)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(ort_lib.DOMAIN, 1)])
    model.ir_version = 9
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if pack_max_bytes is not None:
        options.add_session_config_entry(ort_lib.PACK_MAX_BYTES_KEY, str(pack_max_bytes))
    return Guarded(ort_lib.session(model.SerializeToString(), options), given if weights == "fed" else {})


class Guarded:
    """A session fed its constants from guarded_copy's memory on every run."""

    def __init__(self, sess, constants: dict):
        self.sess, self.constants = sess, {n: guarded_copy(a) for n, a in constants.items()}

    def run(self, names, feed):
        return self.sess.run(names, feed | self.constants)


def guarded_copy(a: np.ndarray) -> np.ndarray:
    """A copy of `a` whose last byte is the last of a page, the next page unreadable."""
    page = mmap.PAGESIZE
    size = -(-max(a.nbytes, 1) // page) * page
    mem = mmap.mmap(-1, size + page)
    libc = ctypes.CDLL(None)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    assert libc.mprotect(ctypes.c_void_p(base + size), page, 0) == 0
    out = np.frombuffer(mem, np.uint8, count=a.nbytes, offset=size - a.nbytes).view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def random_weight(rng, n, k, bits, block, scale_dtype=np.float16):
    """(data, scales) of a [N, K] weight: bytes over the format's whole range, scales of both signs (float16 as
    exported, or float32); the first block of row 0 all at the lowest level and of row 1 all at the highest (the
    largest integer products)."""
    nb = -(-k // block)
    data = rng.integers(0, 256, (n, nb, block * bits // 8), dtype=np.uint8)
    data[0, 0], data[1 % n, 0] = 0, 255
    scales = (rng.uniform(-1, 1, (n, nb)) / (np.sqrt(k) * (4 if bits == 4 else 64))).astype(scale_dtype)
    return data, scales


def activations(rng, m, k):
    """x [M, K] with a zero block (row 1), a constant block (row 2: all +3, q = 127) and a tiny row (row 3)."""
    x = rng.standard_normal((m, k)).astype(np.float32)
    if m > 1:
        x[1, :32] = 0
    if m > 2:
        x[2, :32] = 3
    if m > 3:
        x[3] *= 1e-30
    return x


def qmatmul_case(block):
    """K for a block size: a few blocks, the last one partial; for 16 and 32 an odd number of blocks (the AVX2
    kernels' rows then end in half a step: 8-bit at 16, 4-bit at 32)."""
    return {16: 291, 32: 269, 64: 300, 128: 389, 256: 773}[block]


# ----------------------------------------------------------------------------------------- QMatMul
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("scale_dtype", [np.float16, np.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("bits", [4, 8])
def test_qmatmul_matches_reference(bits, block, scale_dtype, weights):
    k, n = qmatmul_case(block), 100  # (packed: a whole group of 64 rows (AVX512), then tiles, the last cut short)
    rng = np.random.default_rng([bits, block])
    data, scales = random_weight(rng, n, k, bits, block, scale_dtype)
    sess = session("QMatMul", dict(K=k, N=n, bits=bits, block_size=block), dict(x=None, w=data, scales=scales),
                   weights=weights)
    for m in ROWS:
        x = activations(rng, m, k)
        y = sess.run(None, {"x": x})[0]
        q = dict(k=k, bits=bits, block_size=block)
        close(y, ref.qmatmul(x, data, scales, **q), EXACT)
        close(y, ref.qmatmul_float(x, data, scales, **q), APPROX)
    x = rng.standard_normal((2, 3, k)).astype(np.float32)  # leading dimensions kept
    y = sess.run(None, {"x": x})[0]
    assert y.shape == (2, 3, n)
    close(y.reshape(6, n), ref.qmatmul(x.reshape(6, k), data, scales, **q), EXACT)


@pytest.mark.parametrize("bits", [4, 8])
def test_qmatmul_of_a_quantized_linear(bits):
    """Weights from mtp_trt.quant.quantize (the exporter's), decode-sized: the op is x W^T up to the weights'
    and the activations' quantization."""
    rng = np.random.default_rng(bits)
    k, n = 1024, 256
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    data, scales = quantize(w, Scheme(f"int{bits}", 32))
    sess = session("QMatMul", dict(K=k, N=n, bits=bits, block_size=32), dict(x=None, w=data, scales=scales))
    x = rng.standard_normal((3, k)).astype(np.float32)
    y = sess.run(None, {"x": x})[0]
    close(y, ref.qmatmul(x, data, scales, k=k, bits=bits, block_size=32), EXACT)
    close(y, x.astype(np.float64) @ w.T, 0.02 if bits == 8 else 0.15)


def test_weights_as_initializers_inputs_or_overridable_initializers():
    """A node's constant inputs (initializers) are read once, when its kernel is made; graph inputs, and
    initializers that a run may override (listed as graph inputs too), are read on every call: each run matches
    the reference for the weights it ran with."""
    rng = np.random.default_rng(5)
    k, n = 96, 40
    a, b = random_weight(rng, n, k, 8, 32, np.float16), random_weight(rng, n, k, 8, 32, np.float16)
    x = activations(rng, 3, k)

    def qmatmul_session(inputs: bool, initializers: bool):
        node = helper.make_node("QMatMul", ["x", "w", "scales"], ["y"], domain=ort_lib.DOMAIN, K=k, N=n, bits=8,
                                block_size=32)
        weights = dict(w=a[0], scales=a[1])
        graph = helper.make_graph(
            [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)]
            + [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
               for name, v in weights.items() if inputs],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            [numpy_helper.from_array(v, name) for name, v in weights.items() if initializers])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                        helper.make_opsetid(ort_lib.DOMAIN, 1)])
        model.ir_version = 9
        return ort_lib.session(model.SerializeToString(), ort.SessionOptions())

    q = dict(k=k, bits=8, block_size=32)
    constant = qmatmul_session(inputs=False, initializers=True)
    for _ in range(2):
        close(constant.run(None, {"x": x})[0], ref.qmatmul(x, *a, **q), EXACT)
    fed = qmatmul_session(inputs=True, initializers=False)
    overridable = qmatmul_session(inputs=True, initializers=True)
    for w in (a, b, a):
        close(fed.run(None, {"x": x, "w": w[0], "scales": w[1]})[0], ref.qmatmul(x, *w, **q), EXACT)
        close(overridable.run(None, {"x": x, "w": w[0], "scales": w[1]})[0], ref.qmatmul(x, *w, **q), EXACT)
    close(overridable.run(None, {"x": x})[0], ref.qmatmul(x, *a, **q), EXACT)


# -------------------------------------------------------------------------------------------- QMoE
def qmoe_inputs(rng, n, d, e, i, shared_i, bits, block):
    """moe_inputs with the experts' weights quantized (quant.quantize, so the weights are realistic)."""
    ins = moe_inputs(rng, n, d, e, i, shared_i)
    s = Scheme(f"int{bits}", block)
    out = dict(x=ins["x"], gate=ins["gate"], bias=ins["bias"])
    for name in ("fc1", "fc2"):
        q = [quantize(w, s) for w in ins[name]]
        out[name], out[name + "_scales"] = np.stack([a for a, _ in q]), np.stack([b for _, b in q])
    for name in ("shared_fc1", "shared_fc2"):
        out[name], out[name + "_scales"] = quantize(ins[name], s) if shared_i else (None, None)
    return out


QMOE_CASES = [  # n, d, e, i, shared_i, k, n_group, topk_group, softmax, group_top2, norm, scaling, bits, block
    (1, 256, 8, 64, 64, 2, 4, 2, False, True, True, 1.0, 4, 32),  # the demo's shape
    (2, 96, 16, 32, 32, 2, 1, 1, False, True, True, 2.5, 8, 16),
    (7, 72, 12, 24, 0, 3, 3, 2, False, True, False, 1.0, 4, 64),  # K padded (72, 24), no shared expert
    (3, 80, 8, 40, 48, 2, 4, 1, True, False, True, 1.0, 8, 128),  # softmax scores, group best
    (16, 48, 32, 16, 16, 4, 8, 4, False, True, True, 2.5, 4, 16),  # DeepSeek-V3's routing, scaled down
    (64, 64, 8, 32, 32, 2, 2, 1, False, True, True, 1.0, 4, 256),  # a prompt's rows
    (2, 40, 6, 20, 12, 6, 1, 1, True, False, False, 16.0, 8, 32),  # every expert selected
    (1, 128, 8, 160, 160, 2, 4, 2, False, True, True, 1.0, 4, 32),  # the 304M's experts: 5 blocks a down row
]


def qmoe_attrs(case):
    _, _, _, _, _, k, n_group, topk_group, softmax, top2, norm, scaling, bits, block = case
    return dict(top_k=k, n_group=n_group, topk_group=topk_group, softmax=int(softmax), group_top2=int(top2),
                norm_topk_prob=int(norm), routed_scaling_factor=scaling, bits=bits, block_size=block)


def qmoe_reference(ins, attrs, product=ref.qmatmul):
    a = dict(attrs)
    return ref.qmoe(**ins, top_k=a["top_k"], bits=a["bits"], block_size=a["block_size"], n_group=a["n_group"],
                    topk_group=a["topk_group"], softmax=bool(a["softmax"]), group_top2=bool(a["group_top2"]),
                    norm_topk_prob=bool(a["norm_topk_prob"]), scaling=a["routed_scaling_factor"], product=product)


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("case", QMOE_CASES,
                         ids=lambda c: "n{}-d{}-e{}-i{}-s{}-k{}-g{}-int{}-b{}".format(*c[:7], *c[12:]))
def test_qmoe_matches_reference(case, weights):
    n, d, e, i, shared_i = case[:5]
    attrs = qmoe_attrs(case)
    ins = qmoe_inputs(np.random.default_rng(list(case[:5]) + list(case[12:])), n, d, e, i, shared_i, attrs["bits"],
                      attrs["block_size"])
    y = session("QMoE", attrs, ins, weights=weights).run(None, {"x": ins["x"]})[0]
    exact = qmoe_reference(ins, attrs)
    # The down projection's activations are rounded to int8 from the op's float32 SwiGLU and the reference's
    # float64 one: an activation on a rounding boundary can land on the neighbouring level, which moves its
    # token's whole output row.  Every other row matches at EXACT; at most one row in eight may not.
    rows = np.abs(y - exact).reshape(-1, y.shape[-1]).max(-1) / np.abs(exact).max()
    assert (rows > EXACT).sum() <= max(1, len(rows) // 8), f"{(rows > EXACT).sum()} of {len(rows)} rows differ"
    close(y, qmoe_reference(ins, attrs, ref.qmatmul_float), QMOE_APPROX)


def test_qmoe_with_some_weights_packed_and_some_read_as_stored():
    """A session limit between the weights' sizes: the routed experts' fc1 (128 KB) read as stored, fc2 (64 KB)
    and the shared expert's packed, in one node; each matrix matches the reference whichever way it is read."""
    if tuple(int(v) for v in ort.__version__.split(".")[:2]) < (1, 24):
        pytest.skip("kernels see their session's config entries from ONNX Runtime 1.24")
    case = QMOE_CASES[0]
    attrs = qmoe_attrs(case)
    ins = qmoe_inputs(np.random.default_rng(21), *case[:5], attrs["bits"], attrs["block_size"])
    assert ins["fc1"].nbytes > 100_000 >= ins["fc2"].nbytes
    lib = ops_library()
    before = lib.MtpOrtPackedBytes()
    sess = session("QMoE", attrs, ins, weights="initializers", pack_max_bytes=100_000)
    close(sess.run(None, {"x": ins["x"]})[0], qmoe_reference(ins, attrs), EXACT)
    packed = lib.MtpOrtPackedBytes() - before
    if packs_by_default(lib):
        small = sum(ins[n].nbytes for n in ("fc2", "shared_fc1", "shared_fc2"))
        assert small <= packed < small + ins["fc1"].nbytes


@pytest.mark.parametrize("weights", WEIGHTS)
def test_qmoe_without_routed_experts_is_a_dense_mlp_with_its_own_down_bits(weights):
    """No gate and no routed weights: a dense SwiGLU MLP (the quantized graphs' dense layers), its down-projection
    at `down_bits` (8, as int4 exports keep the first layer's) while the up-projection takes `bits` (4)."""
    rng = np.random.default_rng(12)
    n, d, i, block = 3, 96, 40, 32
    x = activations(rng, n, d)
    (fc1, s1), (fc2, s2) = (quantize((rng.standard_normal(shape) * 0.1).astype(np.float32), Scheme(f"int{b}", block))
                            for shape, b in (((2 * i, d), 4), ((d, i), 8)))
    ins = dict(x=x, gate=None, bias=None, fc1=None, fc1_scales=None, fc2=None, fc2_scales=None, shared_fc1=fc1,
               shared_fc1_scales=s1, shared_fc2=fc2, shared_fc2_scales=s2)
    attrs = dict(top_k=0, n_group=1, topk_group=1, softmax=0, group_top2=0, norm_topk_prob=0,
                 routed_scaling_factor=1.0, bits=4, block_size=block, down_bits=8)
    y = session("QMoE", attrs, ins, weights=weights).run(None, {"x": x})[0]
    h = ref.qmatmul(x, fc1, s1, k=d, bits=4, block_size=block)
    a = (ref.silu(h[:, 0::2]) * h[:, 1::2]).astype(np.float32)
    close(y, ref.qmatmul(a, fc2, s2, k=i, bits=8, block_size=block), QMOE_APPROX)


def test_float32_scales_give_the_bits_of_the_same_float16_values():
    """Exports of earlier revisions store float32 scales: the ops read both, and a float16 scale widened to float32
    gives the same output bits (QMatMul at 1 and 3 rows; QMoE with routed and shared experts, one matrix in each
    dtype)."""
    rng = np.random.default_rng(21)
    data, scales = random_weight(rng, 37, 301, 4, 32)
    x = activations(rng, 3, 301)
    attrs = dict(K=301, N=37, bits=4, block_size=32)
    half = session("QMatMul", attrs, dict(x=None, w=data, scales=scales))
    single = session("QMatMul", attrs, dict(x=None, w=data, scales=scales.astype(np.float32)))
    for m in (1, 3):
        assert np.array_equal(half.run(None, {"x": x[:m]})[0], single.run(None, {"x": x[:m]})[0])
    case = QMOE_CASES[1]
    attrs = qmoe_attrs(case)
    ins = qmoe_inputs(rng, *case[:5], attrs["bits"], attrs["block_size"])
    mixed = ins | {n: ins[n].astype(np.float32) for n in ("fc2_scales", "shared_fc1_scales")}
    assert ins["fc1_scales"].dtype == np.float16 and mixed["fc2_scales"].dtype == np.float32
    assert np.array_equal(session("QMoE", attrs, ins).run(None, {"x": ins["x"]})[0],
                          session("QMoE", attrs, mixed).run(None, {"x": ins["x"]})[0])


# ------------------------------------------------------------------------------ threads and paths
@pytest.mark.parametrize("weights", WEIGHTS)
def test_any_thread_count_gives_the_same_bits(monkeypatch, weights):
    """Work is split by output rows (QMatMul) and by units and columns (QMoE), never within a sum: 1, 2 and 3
    threads agree exactly, whether every call is split (MTP_ORT_MIN_PARALLEL_WORK=0) or only large ones.  And a
    row of x gets the same bits whatever rows run beside it (what an MTP verify step relies on: its rows must be
    a one-token step's)."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((64, 200)).astype(np.float32)
    mm_weights = {bits: random_weight(rng, 70, 200, bits, 32) for bits in (4, 8)}
    case = QMOE_CASES[4]
    ins = qmoe_inputs(rng, *case[:5], 8, 16)
    attrs = qmoe_attrs(case) | dict(bits=8, block_size=16)
    outs = []
    for split, threads in itertools.product(("0", ""), (1, 2, 3)):
        monkeypatch.setenv("MTP_ORT_MIN_PARALLEL_WORK", split)  # read when a session makes its kernels
        out = [session("QMoE", attrs, ins, threads=threads, weights=weights).run(None, {"x": ins["x"]})[0]]
        for bits, (data, scales) in mm_weights.items():
            mm = session("QMatMul", dict(K=200, N=70, bits=bits, block_size=32), dict(x=None, w=data, scales=scales),
                         threads=threads, weights=weights)
            rows = mm.run(None, {"x": x})[0]
            for r0, r1 in ((0, 1), (5, 8), (9, 11), (60, 64)):
                assert np.array_equal(mm.run(None, {"x": x[r0:r1]})[0], rows[r0:r1]), (bits, r0, r1)
            out.append(rows)
        outs.append(out)
    for out in outs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(out, outs[0]))


# ----------------------------------------------------------------------- MlaSelfAttention, int8 W^UK / W^UV
def int8_heads(w, transpose, block):
    """A per-head weight w [H, A, B] as MlaSelfAttention's int8 input, quantized as the exporter does: each head's
    matrix (transposed: [B, A]) in quant.py's int8 format -> (data [H, N, K/bs, bs], scales [H, N, K/bs])."""
    w = w.transpose(0, 2, 1) if transpose else w
    h, n, k = w.shape
    data, scales = quantize(np.ascontiguousarray(w).reshape(h * n, k), Scheme("int8", block))
    return data.reshape(h, n, *data.shape[1:]), scales.reshape(h, n, -1)


def int8_mla_inputs(ins, block):
    """mla_self_inputs' inputs with w_uk and w_uv as int8 blocks (exporters/quantize.py _int8_mla's layout)."""
    uk, uv = int8_heads(ins["w_uk"], True, block), int8_heads(ins["w_uv"], False, block)
    return {**ins, "w_uk": None, "w_uv": None, "w_uk_q": uk[0], "w_uk_scales": uk[1], "w_uv_q": uv[0],
            "w_uv_scales": uv[1]}


def dequantized_heads(data, scales, k, transpose):
    h, n = data.shape[:2]
    w = ref.dequantize(data.reshape(h * n, *data.shape[2:]), scales.reshape(h * n, -1), k, 8).reshape(h, n, k)
    return w.transpose(0, 2, 1) if transpose else w


def mla_attrs(case):
    return dict(heads=case[2], scale=0.7 / np.sqrt(case[4] + case[5]), eps=1e-6, interleave=case[11])


INT8_MLA_CASES = [c for c in MLA_SELF_CASES if c[10]]  # the cases with W^UK and W^UV


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("block", [16, 32, 256])
@pytest.mark.parametrize("case", INT8_MLA_CASES,
                         ids=lambda c: "b{}-s{}-h{}-dn{}-dl{}-dr{}-dv{}-t{}-r{}-{}".format(*c[:10]))
def test_mla_self_attention_with_int8_products_matches_reference(case, block, weights):
    """W^UK and W^UV as int8 blocks: against the reference at the exact tolerance (the same int8 products), and
    against the float attention with the dequantized matrices, which they approximate.  The new rows do not
    depend on the products."""
    b, s, h, dn, dl, dr, dv, t, r, mask = case[:10]
    ins = int8_mla_inputs(mla_self_inputs(np.random.default_rng(list(case[:9])), *case[:11]), block)
    attrs = mla_attrs(case)
    out, rows = session("MlaSelfAttention", attrs, ins, fed=(), weights=weights, outputs=2).run(None, {})
    want, want_rows = ref.mla_self_attention(**ins, **attrs)
    close(rows, want_rows, 2e-6)
    close(out, want, EXACT)
    floats = {**ins, "w_uk_q": None, "w_uk_scales": None, "w_uv_q": None, "w_uv_scales": None,
              "w_uk": dequantized_heads(ins["w_uk_q"], ins["w_uk_scales"], dn, True),
              "w_uv": dequantized_heads(ins["w_uv_q"], ins["w_uv_scales"], dl, False)}
    close(out, ref.mla_self_attention(**floats, **attrs)[0], QMOE_APPROX)


@pytest.mark.parametrize("weights", WEIGHTS)
def test_mla_self_attention_with_int8_products_gives_each_token_the_same_bits(monkeypatch, weights):
    """A verify step's rows must be one-token steps' rows: token 2 of a 3-token call equals the same token alone
    with tokens 0 and 1 as committed cache rows; and 1 or 3 threads, every call split or not, agree exactly."""
    case = (1, 3, 4, 64, 64, 32, 64, 30, 0, None, True, 1)
    ins = int8_mla_inputs(mla_self_inputs(np.random.default_rng(5), *case[:11]), 32)
    ins["past_len"] = np.array([10], np.int32)
    attrs = mla_attrs(case)
    outs = []
    for split, threads in itertools.product(("0", ""), (1, 3)):
        monkeypatch.setenv("MTP_ORT_MIN_PARALLEL_WORK", split)
        outs.append(session("MlaSelfAttention", attrs, ins, fed=(), threads=threads, weights=weights,
                            outputs=2).run(None, {}))
    for got in outs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(got, outs[0]))
    out, rows = outs[0]
    one = dict(ins, cache=ins["cache"].copy(), q=ins["q"][:, 2:], kv=ins["kv"][:, 2:],
               positions=ins["positions"][:, 2:], past_len=np.array([12], np.int32))
    one["cache"][0, 10:12] = rows[0, :2]
    out1, rows1 = session("MlaSelfAttention", attrs, one, fed=(), weights=weights, outputs=2).run(None, {})
    assert np.array_equal(rows1[0, 0], rows[0, 2]) and np.array_equal(out1[0, 0], out[0, 2])


ISA = ort_lib.CPU_ISA_ENV
AVX512_VNNI = ("avx512_vnni", "avx512vl", "avx512bw", "avx512dq")
PATHS = {  # the path, the environment that forces it, the CPU flags it needs ("-flag": it must lack)
    "avx512-vnni": ({ISA: "avx512-vnni"}, AVX512_VNNI),
    "avx512-vnni-unpacked": ({ISA: "avx512-vnni", "MTP_ORT_PACK_MAX_BYTES": "0"}, AVX512_VNNI),
    "avx-vnni": ({ISA: "avx-vnni"}, ("avx_vnni",)),
    "avx512-vnni-256": ({ISA: "avx-vnni"}, (*AVX512_VNNI, "-avx_vnni")),
    "avx2": ({ISA: "avx2"}, ("avx2", "fma", "f16c")),
    "avx2-unpacked": ({ISA: "avx2", "MTP_ORT_PACK_MAX_BYTES": "0"}, ("avx2", "fma", "f16c")),
    "scalar": ({ISA: "scalar"}, ()),
}
PACKED = ("avx512-vnni", "avx-vnni", "avx512-vnni-256", "avx2")  # the paths that pack constant weights


def ops_library():
    """The operators' library through ctypes (the instance ONNX Runtime loaded): MtpOrtQuantPath, MtpOrtPackedBytes."""
    lib = ctypes.CDLL(str(ort_lib.resolve_library()))
    lib.MtpOrtQuantPath.restype, lib.MtpOrtPackedBytes.restype = ctypes.c_char_p, ctypes.c_size_t
    return lib


def packs_by_default(lib) -> bool:
    """Whether this process packs constant weights at the default limit: a path in PACKED, no
    MTP_ORT_PACK_MAX_BYTES."""
    return lib.MtpOrtQuantPath().decode() in PACKED and "MTP_ORT_PACK_MAX_BYTES" not in os.environ
PATH_CHILD = """
import ctypes, sys
import numpy as np
sys.path.insert(0, {tests!r})
import test_ort_quant_ops as t
from mtp_trt.plugins import ort_lib
lib = ctypes.CDLL(str(ort_lib.resolve_library()))
lib.MtpOrtQuantPath.restype = ctypes.c_char_p
lib.MtpOrtPackedBytes.restype = ctypes.c_size_t
outs = {{"path": np.array(lib.MtpOrtQuantPath().decode())}}
sessions = []  # (kept: their packed weights live as long as they do)
for name, y in t.path_outputs(sessions):
    outs[name] = y
outs["packed"] = np.array(lib.MtpOrtPackedBytes())
np.savez(sys.argv[1], **outs)
"""


def path_inputs():
    rng = np.random.default_rng(9)
    for bits in (4, 8):
        for block in (16, 32, 256):
            k = qmatmul_case(block)
            yield f"mm{bits}-{block}", (k, bits, block), random_weight(rng, 100, k, bits, block), \
                activations(rng, 7, k)
    k = qmatmul_case(32)  # float32 scales (exports of earlier revisions)
    yield "mm4-32-f32", (k, 4, 32), random_weight(rng, 100, k, 4, 32, np.float32), activations(rng, 7, k)
    yield "moe", QMOE_CASES[4], None, None
    yield "mla", INT8_MLA_CASES[-1], None, None  # Dn much narrower than Dl


def path_outputs(sessions: list):
    """The ops' outputs on fixed inputs, the weights fed and as initializers: QMatMul over bits, blocks and 1, 3
    and 7 rows; one QMoE; one MlaSelfAttention with int8 W^UK and W^UV.  The sessions are appended to
    `sessions`."""
    for (name, case, w, x), weights in itertools.product(path_inputs(), WEIGHTS):
        if w is not None:
            k, bits, block = case
            sessions.append(session("QMatMul", dict(K=k, N=100, bits=bits, block_size=block),
                                    dict(x=None, w=w[0], scales=w[1]), weights=weights))
            for m in (1, 3, 7):
                yield f"{name}-m{m}-{weights}", sessions[-1].run(None, {"x": x[:m]})[0]
        elif name == "mla":
            sessions.append(session("MlaSelfAttention", mla_attrs(case), path_mla_inputs(case), fed=(),
                                    weights=weights, outputs=2))
            yield f"{name}-{weights}", sessions[-1].run(None, {})[0]
        else:
            attrs = qmoe_attrs(case)
            ins = qmoe_inputs(np.random.default_rng(1), *case[:5], attrs["bits"], attrs["block_size"])
            sessions.append(session("QMoE", attrs, ins, weights=weights))
            yield f"{name}-{weights}", sessions[-1].run(None, {"x": ins["x"]})[0]


def path_mla_inputs(case):
    return int8_mla_inputs(mla_self_inputs(np.random.default_rng(2), *case[:11]), 16)


def cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        return set()


@pytest.mark.parametrize("path", list(PATHS))
def test_every_instruction_set_matches_the_reference(path, tmp_path):
    """Each path the CPU has, forced by its environment variable in a child process (the path is chosen once
    per process), against the reference at the exact tolerance: the same integer products everywhere, with the
    weights read as stored and, on every vector path (unless MTP_ORT_PACK_MAX_BYTES=0), constant weights packed."""
    env_vars, flags = PATHS[path]
    need, lack = {f for f in flags if f[0] != "-"}, {f[1:] for f in flags if f[0] == "-"}
    if not need <= cpu_flags():
        pytest.skip(f"this CPU lacks {', '.join(sorted(need - cpu_flags()))}")
    if lack & cpu_flags():
        pytest.skip(f"this CPU has {', '.join(sorted(lack & cpu_flags()))}, which the environment selects instead")
    env = {k: v for k, v in os.environ.items() if k not in (ISA, "MTP_ORT_PACK_MAX_BYTES")}
    out = tmp_path / "out.npz"
    run = subprocess.run([sys.executable, "-c", PATH_CHILD.format(tests=os.path.dirname(__file__)), str(out)],
                         env=env | env_vars, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    got = np.load(out)
    assert str(got["path"]) == path.removesuffix("-unpacked")
    assert (int(got["packed"]) > 0) == (path in PACKED), int(got["packed"])
    for (name, case, w, x), weights in itertools.product(path_inputs(), WEIGHTS):
        if w is not None:
            k, bits, block = case
            for m in (1, 3, 7):
                close(got[f"{name}-m{m}-{weights}"], ref.qmatmul(x[:m], *w, k=k, bits=bits, block_size=block), EXACT)
        elif name == "mla":
            close(got[f"{name}-{weights}"], ref.mla_self_attention(**path_mla_inputs(case), **mla_attrs(case))[0],
                  EXACT)
        else:
            attrs = qmoe_attrs(case)
            ins = qmoe_inputs(np.random.default_rng(1), *case[:5], attrs["bits"], attrs["block_size"])
            close(got[f"{name}-{weights}"], qmoe_reference(ins, attrs), EXACT)


ISA_CHILD = """
import sys
from mtp_trt.errors import MtpTrtError
from mtp_trt.plugins import ort_lib
class Options:  # (registering needs no ONNX Runtime here)
    def register_custom_ops_library(self, path):
        pass
print(ort_lib.cpu_isa()[0])
try:
    ort_lib.register(Options())
except MtpTrtError as e:
    print("refused:", e)
"""


def isa_child(value: str, *, qemu_cpu: str | None = None) -> list[str]:
    """The lines a child process prints with MTP_TRT_CPU_ISA=value: the set the kernels run on, then "refused: "
    and ort_lib.register's error where it refuses (under qemu-x86_64 -cpu qemu_cpu where given: a CPU without
    some of this one's sets)."""
    lib = str(ort_lib.resolve_library())  # (built here where needed, not under the emulator)
    env = {k: v for k, v in os.environ.items() if k != ISA} | {ISA: value, "MTP_TRT_ORT_OPS_LIB": lib}
    cmd = [sys.executable, "-c", ISA_CHILD]
    if qemu_cpu:
        cmd = [shutil.which("qemu-x86_64"), "-cpu", qemu_cpu, *cmd]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()


def test_cpu_isa_names_are_the_librarys():
    lib = ops_library()
    lib.MtpOrtCpuIsaNames.restype = ctypes.c_char_p
    assert tuple(lib.MtpOrtCpuIsaNames().decode().split()) == ort_lib.CPU_ISAS


@pytest.mark.parametrize("value", ["avx2", "scalar"])
def test_cpu_isa_switch_selects_every_kernel(value):
    """The quantized products, the float kernels' indexer and the reported set all follow MTP_TRT_CPU_ISA (the
    results: test_every_instruction_set_matches_the_reference)."""
    if value == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU lacks AVX2")
    code = ("import ctypes; from mtp_trt.plugins import ort_lib; lib = ctypes.CDLL(str(ort_lib.resolve_library())); "
            "lib.MtpOrtQuantPath.restype = lib.MtpOrtIndexPath.restype = lib.MtpOrtCpuIsa.restype = ctypes.c_char_p; "
            "print(lib.MtpOrtCpuIsa().decode(), lib.MtpOrtQuantPath().decode(), lib.MtpOrtIndexPath().decode())")
    env = {k: v for k, v in os.environ.items() if k != ISA} | {ISA: value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [value, value, value]


def test_unknown_cpu_isa_is_refused_in_one_line():
    """A value that names no set: register() raises one MtpTrtError naming the variable, the value and the sets
    (the kernels meanwhile run on the CPU's best set), and ONNX Runtime registering the library itself gets the
    same refusal, not a crash."""
    lines = isa_child("avx3")
    assert len(lines) == 2 and lines[0] in ort_lib.CPU_ISAS
    assert lines[1] == ("refused: MTP_TRT_CPU_ISA=avx3 is not an instruction set of mtp-trt's CPU kernels "
                        "(scalar, avx2, avx-vnni, avx512-vnni, neon, neon-dotprod, neon-i8mm)")
    code = ("import onnxruntime as ort, sys; o = ort.SessionOptions()\n"
            "try:\n    o.register_custom_ops_library(sys.argv[1])\nexcept Exception as e:\n    print(e)")
    env = {k: v for k, v in os.environ.items() if k != ISA} | {ISA: "avx3"}
    run = subprocess.run([sys.executable, "-c", code, str(ort_lib.resolve_library())], env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0 and "MTP_TRT_CPU_ISA=avx3 is not an instruction set" in run.stdout, run


@pytest.mark.skipif(platform.machine() != "x86_64", reason="an x86-64 CPU refusing ARM64's sets")
@pytest.mark.parametrize("value", ["neon", "neon-dotprod", "neon-i8mm"])
def test_cpu_isa_of_another_architecture_is_refused_in_one_line(value):
    """An ARM64 set on x86-64: a set this CPU lacks, refused in one line (the kernels on the CPU's best set)."""
    lines = isa_child(value)
    assert len(lines) == 2 and lines[0] in ort_lib.CPU_ISAS and not lines[0].startswith("neon")
    assert lines[1] == f"refused: MTP_TRT_CPU_ISA={value}: this CPU lacks that instruction set (it has {lines[0]})"


@pytest.mark.skipif(not shutil.which("qemu-x86_64"), reason="needs qemu-x86_64 (Debian's qemu-user)")
def test_cpu_isa_the_cpu_lacks_is_refused_in_one_line():
    """On an AVX2-only CPU (qemu-x86_64's Haswell model): MTP_TRT_CPU_ISA=avx512-vnni and avx-vnni are refused in
    one line, avx2 and scalar are had, and unset the kernels take AVX2."""
    for value in ("avx512-vnni", "avx-vnni"):
        assert isa_child(value, qemu_cpu="Haswell") == [
            "avx2", f"refused: MTP_TRT_CPU_ISA={value}: this CPU lacks that instruction set (it has avx2)"]
    for value in ("avx2", "scalar", ""):
        assert isa_child(value, qemu_cpu="Haswell") == [value or "avx2"]


def test_packed_weights_are_one_copy_per_process_freed_with_their_sessions():
    """Sessions handed the same weight memory (OrtBackend's shared weights.bin mapping) share one packed copy
    of each quantized weight; it is freed when the last session that uses it is.  A session's config entry
    ort_lib.PACK_MAX_BYTES_KEY limits the weights it packs."""
    lib = ops_library()
    if not packs_by_default(lib):
        pytest.skip("this process does not pack (the scalar path, or MTP_ORT_PACK_MAX_BYTES set)")
    rng = np.random.default_rng(3)
    k, n = 256, 128
    data, scales = random_weight(rng, n, k, 8, 32)
    node = helper.make_node("QMatMul", ["x", "w", "scales"], ["y"], domain=ort_lib.DOMAIN, K=k, N=n, bits=8,
                            block_size=32)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.zeros_like(data), "w"),
                               numpy_helper.from_array(np.zeros_like(scales), "scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(ort_lib.DOMAIN, 1)])
    model.ir_version = 9
    shared = {"w": ort.OrtValue.ortvalue_from_numpy(data), "scales": ort.OrtValue.ortvalue_from_numpy(scales)}

    def shared_session(limit: int | None = None):
        options = ort.SessionOptions()
        for name, value in shared.items():
            options.add_initializer(name, value)
        if limit is not None:
            options.add_session_config_entry(ort_lib.PACK_MAX_BYTES_KEY, str(limit))
        return ort_lib.session(model.SerializeToString(), options)

    x = activations(rng, 2, k)
    before = lib.MtpOrtPackedBytes()
    a = shared_session()
    close(a.run(None, {"x": x})[0], ref.qmatmul(x, data, scales, k=k, bits=8, block_size=32), EXACT)
    one = lib.MtpOrtPackedBytes() - before
    assert one >= data.nbytes + 4 * scales.size  # the bytes, and the scales as float32
    b = shared_session()
    assert np.array_equal(b.run(None, {"x": x})[0], a.run(None, {"x": x})[0])
    assert lib.MtpOrtPackedBytes() - before == one
    del a
    assert lib.MtpOrtPackedBytes() - before == one
    del b
    assert lib.MtpOrtPackedBytes() == before
    if tuple(int(v) for v in ort.__version__.split(".")[:2]) < (1, 24):
        return  # (kernels see their session's config entries from ONNX Runtime 1.24)
    for limit, packed in ((0, False), (data.nbytes - 1, False), (data.nbytes, True)):  # a session's own limit
        c = shared_session(limit)
        close(c.run(None, {"x": x})[0], ref.qmatmul(x, data, scales, k=k, bits=8, block_size=32), EXACT)
        assert lib.MtpOrtPackedBytes() - before == (one if packed else 0), limit
        del c


# ----------------------------------------------------------------------------------------- errors
def test_bad_input_is_one_error_naming_the_op_and_input():
    rng = np.random.default_rng(0)
    data, scales = random_weight(rng, 8, 40, 4, 16)  # 3 blocks of 16
    attrs = dict(K=40, N=8, bits=4, block_size=16)
    x = rng.standard_normal((2, 40)).astype(np.float32)
    invalid = ort.capi.onnxruntime_pybind11_state.InvalidArgument
    with pytest.raises(invalid, match=r"mtp_trt\.cpu::QMatMul: w \[8, 2, 8\] must be uint8 "
                                      r"\[N, ceil\(K / block_size\), block_size \* bits / 8\] = \[8, 3, 8\]"):
        session("QMatMul", attrs, dict(x=None, w=data[:, :2], scales=scales)).run(None, {"x": x})
    with pytest.raises(invalid, match=r"QMatMul: scales \[8, 2\] must be float16 \(or float32\) \[8, 3\]"):
        session("QMatMul", attrs, dict(x=None, w=data, scales=scales[:, :2])).run(None, {"x": x})
    with pytest.raises(invalid, match=r"QMatMul: x \[2, 39\] must be \[\.\.\., K\] with K = 40"):
        session("QMatMul", attrs, dict(x=None, w=data, scales=scales)).run(None, {"x": x[:, :39]})
    with pytest.raises(Exception, match=r"QMatMul: bits 3, block_size 16: expected bits 4 or 8"):
        session("QMatMul", attrs | dict(bits=3), dict(x=None, w=data, scales=scales))
    with pytest.raises(Exception, match=r"QMatMul: bits 4, block_size 48: expected"):
        session("QMatMul", attrs | dict(block_size=48), dict(x=None, w=data, scales=scales))

    case = QMOE_CASES[2]
    attrs = qmoe_attrs(case)
    ins = qmoe_inputs(rng, *case[:4], 8, attrs["bits"], attrs["block_size"])
    bad = ins | dict(fc2=ins["fc2"][:, :, :, :-1])
    with pytest.raises(invalid, match=r"QMoE: fc2 \[12, 72, 1, 31\] must be uint8 \[E, D, ceil\(I / block_size\), "
                                      r"block_size \* down_bits / 8\] .* = \[12, 72, 1, 32\]"):
        session("QMoE", attrs, bad).run(None, {"x": ins["x"]})
    bad = ins | dict(shared_fc2=None, shared_fc2_scales=None)
    with pytest.raises(invalid, match=r"QMoE: shared_fc1, shared_fc1_scales, shared_fc2 and shared_fc2_scales come "
                                      r"together"):
        session("QMoE", attrs, bad).run(None, {"x": ins["x"]})
    with pytest.raises(invalid, match=r"QMoE: fc1_scales \[12, 48, 2\] must be float16 \(or float32\) \[12, 48, 3\]"):
        session("QMoE", attrs | dict(block_size=32), ins | dict(fc1=np.zeros((12, 48, 3, 16), np.uint8))).run(
            None, {"x": ins["x"]})

    case = INT8_MLA_CASES[0]
    ins = int8_mla_inputs(mla_self_inputs(rng, *case[:11]), 32)
    mla = dict(fed=(), outputs=2)
    with pytest.raises(invalid, match=r"MlaSelfAttention: W\^UK and W\^UV each come once: in float32 \(w_uk, w_uv\) or "
                                      r"as int8 blocks"):
        session("MlaSelfAttention", mla_attrs(case), ins | dict(w_uv=np.zeros((4, 64, 64), np.float32)), **mla).run(
            None, {})
    with pytest.raises(invalid, match=r"W\^UK and W\^UV each come once"):
        session("MlaSelfAttention", mla_attrs(case), ins | dict(w_uk_scales=None), **mla).run(None, {})
    with pytest.raises(invalid, match=r"MlaSelfAttention: w_uv_q \[4, 64, 3, 32\] must be uint8 \[H, N, ceil\(K / "
                                      r"block\), block\] = \[4, 64, 2, 32\]"):
        session("MlaSelfAttention", mla_attrs(case), ins | dict(w_uv_q=np.zeros((4, 64, 3, 32), np.uint8)),
                **mla).run(None, {})
    with pytest.raises(invalid, match=r"MlaSelfAttention: w_uk_q \[4, 64, 2, 24\] must be uint8 \[H, N, ceil\(K / "
                                      r"block\), block\] with block 16, 32, 64, 128 or 256, K = 64, N = 64"):
        session("MlaSelfAttention", mla_attrs(case), ins | dict(w_uk_q=np.zeros((4, 64, 2, 24), np.uint8)),
                **mla).run(None, {})
