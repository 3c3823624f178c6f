"""mtp-trt's CPU operators for ONNX Runtime (plugins/ort, domain mtp_trt.cpu) against their NumPy references
(plugins/ort_reference.py), one node at a time: MoE (router included), MLA attention and RmsNorm on random and
adversarial inputs -- sizes that are not multiples of the vector width, router ties, groups, extra rows, visibility
masks, cache lengths out of range -- the AVX2 and portable paths, any thread count giving the same bits, and bad input
as one error naming the op and the input.

Tolerances: float32 kernels against float64 references, relative to the output's largest magnitude: 2e-6 (MoE,
attention and RmsNorm), a few float32 ulps of accumulated rounding."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mtp_trt.plugins import ort_lib, ort_reference as ref

pytestmark = pytest.mark.skipif(not ort_lib.available()[0], reason=f"mtp_trt.cpu operators: {ort_lib.available()[1]}")

RTOL = 2e-6
TYPES = {np.float32: TensorProto.FLOAT, np.int32: TensorProto.INT32, np.bool_: TensorProto.BOOL,
         np.uint8: TensorProto.UINT8, np.int64: TensorProto.INT64}


def run_node(op: str, inputs: dict, attrs: dict, constants: dict = (), threads: int = 2, outputs: int = 1,
             out_type: int = TensorProto.FLOAT, say_threads: bool = True):
    """One mtp_trt.cpu node: `inputs` fed (name -> array, None: left out), `constants` as initializers -> its output
    (its `outputs` outputs, where more than one, all of `out_type`), on `threads` intra-op threads, which the
    session tells the operators as OrtBackend's do unless not `say_threads`."""
    constants = dict(constants)
    names = list(inputs)
    while names and inputs[names[-1]] is None:  # trailing optional inputs are simply absent
        names.pop()
    fed = {n: a for n, a in inputs.items() if a is not None and n not in constants}
    ys = ["y"] if outputs == 1 else [f"y{i}" for i in range(outputs)]
    graph = helper.make_graph(
        [helper.make_node(op, [n if inputs[n] is not None else "" for n in names], ys, domain=ort_lib.DOMAIN,
                          **attrs)], "g",
        [helper.make_tensor_value_info(n, TYPES[a.dtype.type], a.shape) for n, a in fed.items()],
        [helper.make_tensor_value_info(y, out_type, None) for y in ys],
        [numpy_helper.from_array(a, n) for n, a in constants.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(ort_lib.DOMAIN, 1)])
    model.ir_version = 9
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if say_threads:
        options.add_session_config_entry(ort_lib.THREADS_KEY, str(threads))
    out = ort_lib.session(model.SerializeToString(), options).run(None, fed)
    return out[0] if outputs == 1 else out


def close(y, want, rtol=RTOL):
    scale = max(np.abs(want).max(), 1e-30)
    err = np.abs(y - want).max() / scale
    assert err <= rtol, f"max |diff| / max |ref| = {err:.2e} > {rtol:.0e}"


# --------------------------------------------------------------------------------------------- MoE
def moe_inputs(rng, n, d, e, i, shared_i, bias=True, ties=False):
    gate = rng.standard_normal((e, d)).astype(np.float32) * 0.2
    if ties:  # pairs of experts with the same gate row: equal scores, so the lower index must win
        gate[1::2] = gate[0::2]
    return dict(
        x=rng.standard_normal((n, d)).astype(np.float32), gate=gate,
        bias=(rng.standard_normal(e) * 0.05).astype(np.float32) if bias else np.zeros(e, np.float32),
        fc1=(rng.standard_normal((e, 2 * i, d)) * 0.1).astype(np.float32),
        fc2=(rng.standard_normal((e, d, i)) * 0.1).astype(np.float32),
        shared_fc1=(rng.standard_normal((2 * shared_i, d)) * 0.1).astype(np.float32) if shared_i else None,
        shared_fc2=(rng.standard_normal((d, shared_i)) * 0.1).astype(np.float32) if shared_i else None)


MOE_CASES = [  # n, d, e, i, shared_i, k, n_group, topk_group, softmax, group_top2, norm, scaling
    (1, 256, 8, 64, 64, 2, 4, 2, False, True, True, 1.0),  # the demo's shape
    (3, 96, 16, 32, 32, 2, 1, 1, False, True, True, 2.5),
    (7, 36, 12, 12, 0, 3, 3, 2, False, True, False, 1.0),  # widths off the vector width, no shared expert
    (5, 64, 8, 20, 20, 2, 4, 1, True, False, True, 1.0),  # softmax scores, group best (V2's group_limited_greedy)
    (16, 40, 32, 8, 16, 4, 8, 4, False, True, True, 2.5),  # DeepSeek-V3's routing, scaled down
    (2, 24, 6, 4, 8, 6, 1, 1, True, False, False, 16.0),  # every expert selected
]


@pytest.mark.parametrize("case", MOE_CASES, ids=lambda c: "n{}-d{}-e{}-i{}-k{}-g{}".format(*c[:4], c[5], c[6]))
def test_moe_matches_reference(case):
    n, d, e, i, shared_i, k, n_group, topk_group, softmax, top2, norm, scaling = case
    rng = np.random.default_rng(list(case[:6]))
    ins = moe_inputs(rng, n, d, e, i, shared_i)
    attrs = dict(top_k=k, n_group=n_group, topk_group=topk_group, softmax=int(softmax), group_top2=int(top2),
                 norm_topk_prob=int(norm), routed_scaling_factor=scaling)
    y = run_node("MoE", ins, attrs, constants={n_: a for n_, a in ins.items() if n_ != "x" and a is not None})
    close(y, ref.moe(**ins, top_k=k, n_group=n_group, topk_group=topk_group, softmax=softmax, group_top2=top2,
                     norm_topk_prob=norm, scaling=scaling))


@pytest.mark.parametrize("n_group", [1, 2])
def test_moe_router_ties_go_to_the_lower_expert(n_group):
    """Experts 2j and 2j+1 score alike for every token (and so do groups {0..3} and {4..7} of pairs); with k = 3
    one pair is split, and its lower expert must be the one chosen.  The tied experts' weights differ, so a pick
    of the higher index changes the output far beyond the tolerance."""
    rng = np.random.default_rng(7)
    ins = moe_inputs(rng, 6, 32, 8, 16, 0, bias=False, ties=True)
    attrs = dict(top_k=3, n_group=n_group, topk_group=n_group, softmax=0, group_top2=1, norm_topk_prob=1,
                 routed_scaling_factor=1.0)
    y = run_node("MoE", ins, attrs, constants={n_: a for n_, a in ins.items() if n_ != "x" and a is not None})
    idx, _ = ref.route(ins["x"].astype(np.float64) @ ins["gate"].T, 3, n_group, n_group)
    assert all(e % 2 == 0 or e - 1 in row for row in idx.tolist() for e in row)  # a lone pick is the lower one
    close(y, ref.moe(**ins, top_k=3, n_group=n_group, topk_group=n_group))


# --------------------------------------------------------------------------------------- attention
def mla_inputs(rng, b, s, h, dl, dr, t, r, mask):
    c = dl + dr
    visible = None
    if mask:
        visible = rng.random((b if mask == "batch" else 1, s, r)) < 0.5
        visible[:, np.arange(s), r - s + np.arange(s)] = True  # a token sees its own row
    return dict(q_lat=rng.standard_normal((b, s, h * dl)).astype(np.float32),
                q_pe=rng.standard_normal((b, s, h * dr)).astype(np.float32),
                rows=rng.standard_normal((b, r, c)).astype(np.float32),
                cache=rng.standard_normal((b, t, c)).astype(np.float32),
                past_len=rng.integers(-2, t + 3, b).astype(np.int32),  # out of range too: clamped to [0, T]
                visible=visible)


MLA_CASES = [  # b, s, h, dl, dr, t, r, mask
    (1, 1, 4, 64, 32, 100, 1, None),  # the demo's decode step
    (2, 4, 8, 128, 64, 300, 4, None),  # verify 4 rows, 85M's shape
    (3, 3, 1, 20, 12, 17, 3, None),  # widths off the vector width, one head
    (2, 5, 16, 40, 8, 9, 5, "batch"),  # a tree mask per sequence
    (2, 2, 3, 24, 8, 30, 6, "shared"),  # extra rows before the new ones, one mask for the batch
    (1, 3, 2, 8, 8, 0, 3, None),  # an empty cache
    (1, 1, 16, 256, 32, 200, 1, None),  # 304M's decode step: tiles of 4 heads, the keys in blocks
    (2, 3, 7, 40, 8, 140, 3, None),  # 7 heads: a tile of 4 and 3 more; 40 columns: 24 + 16
]


@pytest.mark.parametrize("case", MLA_CASES, ids=lambda c: "b{}-s{}-h{}-dl{}-dr{}-t{}-r{}-{}".format(*c))
def test_mla_attention_matches_reference(case):
    b, s, h, dl, dr, t, r, mask = case
    ins = mla_inputs(np.random.default_rng(list(case[:7])), b, s, h, dl, dr, t, r, mask)
    scale = 0.7 / np.sqrt(dl + dr)
    y = run_node("MlaAttention", ins, dict(heads=h, scale=scale))
    close(y, ref.mla_attention(**ins, heads=h, scale=scale))


def test_mla_attention_equals_the_gpu_kernels_reference():
    """Independent cross-check: with the new rows as the rows and no extra ones, the op is the CUDA decode
    kernel's reference (plugins/reference.py mla_decode: rows committed to the cache, then attended causally)."""
    from mtp_trt.plugins import reference

    b, s, h, dl, dr, t = 2, 3, 4, 16, 8, 20
    ins = mla_inputs(np.random.default_rng(3), b, s, h, dl, dr, t, s, None)
    ins["past_len"] = np.array([5, 11], np.int32)
    q = np.concatenate([ins["q_lat"].reshape(b, s, h, dl), ins["q_pe"].reshape(b, s, h, dr)], -1)
    want, _ = reference.mla_decode(q, ins["cache"], ins["past_len"], dl=dl, scale=0.3, new_rows=ins["rows"])
    close(run_node("MlaAttention", ins, dict(heads=h, scale=0.3)), want.reshape(b, s, h * dl))


def test_moe_without_routed_experts_is_a_dense_mlp():
    """No gate and no routed weights: the shared experts alone, i.e. a dense SwiGLU MLP (the fused graphs' dense
    layers)."""
    ins = moe_inputs(np.random.default_rng(2), 3, 40, 4, 12, 24)
    ins.update(gate=None, bias=None, fc1=None, fc2=None)
    attrs = dict(top_k=0, n_group=1, topk_group=1, softmax=0, group_top2=0, norm_topk_prob=0, routed_scaling_factor=1.0)
    y = run_node("MoE", ins, attrs, constants={n: a for n, a in ins.items() if n != "x" and a is not None})
    close(y, ref.swiglu(ins["x"], ins["shared_fc1"], ins["shared_fc2"]))


# ---------------------------------------------------------------------------------- MlaSelfAttention
def mla_self_inputs(rng, b, s, h, dn, dl, dr, dv, t, r, mask, absorb):
    """MlaSelfAttention's inputs: queries before W^UK (absorb) or already absorbed, kv before norm and RoPE, random
    tables, positions anywhere in them; r extra rows."""
    c, p = dl + dr, 50
    visible = None
    if mask:
        visible = rng.random((b if mask == "batch" else 1, s, r + s)) < 0.5
        visible[:, np.arange(s), r + np.arange(s)] = True  # a token sees its own row
    angles = rng.uniform(0, 6, (p, dr // 2))
    return dict(q=rng.standard_normal((b, s, h * ((dn if absorb else dl) + dr))).astype(np.float32),
                kv=(rng.standard_normal((b, s, c)) * 3).astype(np.float32),
                kv_norm=rng.uniform(0.5, 1.5, dl).astype(np.float32),
                positions=rng.integers(0, p, (b, s)).astype(np.int64),
                cos=np.cos(angles).astype(np.float32), sin=np.sin(angles).astype(np.float32),
                cache=rng.standard_normal((b, t, c)).astype(np.float32),
                past_len=rng.integers(-2, t + 3, b).astype(np.int32),
                extra=rng.standard_normal((b, r, c)).astype(np.float32) if r else None, visible=visible,
                w_uk=(rng.standard_normal((h, dn, dl)) / np.sqrt(dn)).astype(np.float32) if absorb else None,
                w_uv=(rng.standard_normal((h, dv, dl)) / np.sqrt(dl)).astype(np.float32) if absorb else None)


MLA_SELF_CASES = [  # b, s, h, dn, dl, dr, dv, t, r, mask, absorb, interleave
    (1, 1, 4, 64, 64, 32, 64, 100, 0, None, True, 1),  # the demo's decode step, quantized export (W^UK, W^UV)
    (1, 1, 4, 64, 64, 32, 64, 100, 0, None, False, 1),  # folded into the projections (fp32 export)
    (2, 4, 8, 24, 40, 16, 20, 30, 0, None, True, 0),  # verify 4 rows, RoPE in halves
    (2, 3, 3, 12, 20, 8, 12, 17, 2, "shared", True, 1),  # extra rows (a step's deeper MTP depths)
    (2, 5, 2, 8, 8, 8, 16, 9, 0, "batch", False, 0),  # a tree mask per sequence
    (1, 3, 1, 10, 12, 4, 6, 0, 0, None, True, 1),  # an empty cache, one head, widths off the vector width
    (1, 2, 4, 40, 200, 16, 24, 30, 0, None, True, 1),  # Dn much narrower than Dl (int8: rows of other sizes)
]


@pytest.mark.parametrize("case", MLA_SELF_CASES,
                         ids=lambda c: "b{}-s{}-h{}-dl{}-dr{}-t{}-r{}-{}-absorb{}-il{}".format(*c[:3], *c[4:6], *c[7:]))
def test_mla_self_attention_matches_reference(case):
    b, s, h, dn, dl, dr, dv, t, r, mask, absorb, interleave = case
    ins = mla_self_inputs(np.random.default_rng(list(case[:9])), b, s, h, dn, dl, dr, dv, t, r, mask, absorb)
    attrs = dict(heads=h, scale=0.7 / np.sqrt(dl + dr), eps=1e-6, interleave=interleave)
    consts = {n: ins[n] for n in ("kv_norm", "cos", "sin", "w_uk", "w_uv") if ins[n] is not None}
    out, rows = run_node("MlaSelfAttention", ins, attrs, consts, outputs=2)
    want_out, want_rows = ref.mla_self_attention(**ins, **attrs)
    close(rows, want_rows)
    close(out, want_out, 1e-5)  # (W^UK, the attention and W^UV in float32: three sums deep)


def test_mla_self_attention_is_mla_attention_after_the_projections():
    """Independent of the reference above: norm and RoPE by the exporter's own PyTorch functions
    (exporters/model.py rms_norm, apply_rope), W^UK by einsum, then the MlaAttention op itself."""
    import torch

    from mtp_trt.exporters.model import apply_rope, rms_norm

    b, s, h, dn, dl, dr, dv = 2, 3, 4, 16, 24, 8, 12
    ins = mla_self_inputs(np.random.default_rng(9), b, s, h, dn, dl, dr, dv, 20, 0, None, True)
    attrs = dict(heads=h, scale=0.2, eps=1e-6, interleave=1)
    out, rows = run_node("MlaSelfAttention", ins, attrs, outputs=2)
    cos, sin = (torch.from_numpy(ins[k])[torch.from_numpy(ins["positions"])] for k in ("cos", "sin"))
    kv = torch.from_numpy(ins["kv"])
    want_rows = torch.cat([rms_norm(kv[..., :dl], torch.from_numpy(ins["kv_norm"]), 1e-6),
                           apply_rope(kv[..., dl:], cos, sin, True)], -1).numpy()
    q = torch.from_numpy(ins["q"])
    q_lat = torch.einsum("bshn,hnc->bshc", q[..., :h * dn].unflatten(-1, (h, dn)), torch.from_numpy(ins["w_uk"]))
    q_pe = apply_rope(q[..., h * dn:].unflatten(-1, (h, dr)), cos[:, :, None], sin[:, :, None], True)
    o_lat = run_node("MlaAttention", dict(q_lat=q_lat.flatten(-2).numpy(), q_pe=q_pe.flatten(-2).numpy(),
                                          rows=want_rows, cache=ins["cache"], past_len=ins["past_len"]),
                     dict(heads=h, scale=0.2))
    want = np.einsum("bshc,hvc->bshv", o_lat.reshape(b, s, h, dl), ins["w_uv"]).reshape(b, s, h * dv)
    close(rows, want_rows, 1e-6)
    close(out, want, 1e-5)


@pytest.mark.parametrize("h, dl, past", [(4, 24, 10), (16, 72, 100)])
def test_mla_self_attention_rows_do_not_depend_on_their_neighbours(h, dl, past):
    """A token's outputs carry the same bits whether it runs alone or after others in the same call (a verify step's
    rows equal a one-token step's): token 2 of a 3-token call against the same token alone with tokens 0 and 1
    as committed cache rows (also with 16 heads and more cached rows than a block of keys)."""
    b, s, dn, dr, dv, t = 1, 3, 16, 8, 12, past + 20
    ins = mla_self_inputs(np.random.default_rng(4), b, s, h, dn, dl, dr, dv, t, 0, None, True)
    ins["past_len"] = np.array([past], np.int32)
    attrs = dict(heads=h, scale=0.2, eps=1e-6, interleave=1)
    out, rows = run_node("MlaSelfAttention", ins, attrs, outputs=2)
    one = {k: v for k, v in ins.items()}
    one["cache"] = ins["cache"].copy()
    one["cache"][0, past:past + 2] = rows[0, :2]
    one.update(q=ins["q"][:, 2:], kv=ins["kv"][:, 2:], positions=ins["positions"][:, 2:],
               past_len=np.array([past + 2], np.int32))
    out1, rows1 = run_node("MlaSelfAttention", one, attrs, outputs=2)
    assert np.array_equal(rows1[0, 0], rows[0, 2]) and np.array_equal(out1[0, 0], out[0, 2])


def test_mla_attention_reads_no_row_after_the_last_visible_one():
    """A token's attention stops at its last visible row (a prompt's token does not read the rows of the tokens
    after it): those rows set to NaN leave every output finite and the same bits as with the rows there."""
    b, s, h, dl, dr, t, r = 2, 6, 4, 32, 16, 10, 6
    ins = mla_inputs(np.random.default_rng(7), b, s, h, dl, dr, t, r, None)
    want = run_node("MlaAttention", ins, dict(heads=h, scale=0.2))
    masked = dict(ins, visible=np.tril(np.ones((1, s, r), bool)))  # causal, as without a mask
    for last in range(s):  # token `last` sees rows 0..last; rows after it NaN
        poisoned = dict(masked, rows=ins["rows"].copy())
        poisoned["rows"][:, last + 1:] = np.nan
        got = run_node("MlaAttention", poisoned, dict(heads=h, scale=0.2))
        assert np.array_equal(got[:, last], want[:, last]), last
    q = mla_self_inputs(np.random.default_rng(8), 1, 5, 4, 16, 24, 8, 12, 12, 0, None, True)
    attrs = dict(heads=4, scale=0.2, eps=1e-6, interleave=1)
    out, _ = run_node("MlaSelfAttention", q, attrs, outputs=2)
    assert np.isfinite(out).all()
    poisoned = dict(q, kv=q["kv"].copy())
    poisoned["kv"][:, 3:] = np.nan  # tokens 3, 4 (NaN rows); tokens 0..2 must not see them
    out_p, _ = run_node("MlaSelfAttention", poisoned, attrs, outputs=2)
    assert np.array_equal(out_p[:, :3], out[:, :3])


# ------------------------------------------------------------------------------------------ MtpAccept
ACCEPT_CASES = [  # b, s, v, relaxed_topk, relaxed_delta
    (1, 1, 384, None, None),  # a plain step: the argmax and its flag
    (3, 4, 50, 0, 0.0),  # strict
    (4, 5, 30, 3, 0.3),  # relaxed while thinking
    (2, 3, 7, 7, 1.0),  # relaxed: every draft in range passes while thinking
]


@pytest.mark.parametrize("case", ACCEPT_CASES, ids=lambda c: "b{}-s{}-v{}-topk{}-delta{}".format(*c))
def test_mtp_accept_matches_the_decomposed_acceptance(case):
    """Against exporters/lowering.py accept_decomposed (the onnx lowering's own acceptance), with drafts that match
    the argmax, ties in the logits (the first maximum wins), the think tokens among the drafts (0: <think>, 1:
    </think>) and flags on and off."""
    import torch

    from mtp_trt.exporters.lowering import accept_decomposed

    b, s, v, topk, delta = case
    rng = np.random.default_rng(list(case[:3]))
    logits = rng.standard_normal((b, s, v)).astype(np.float32)
    logits[:, :, 5] = logits.max(-1)  # a tie with the maximum: the lower id is the argmax
    ids = rng.integers(0, v, (b, s)).astype(np.int32)
    best = logits.argmax(-1)
    for bi in range(b):  # accept a prefix of varying length; think tokens inside it
        n = bi % s
        ids[bi, 1:n + 1] = best[bi, :n]
    if s > 2:
        ids[0, 1] = 0
        logits[0, 0, 0] = logits[0, 0].max() + 1  # <think> accepted
    thinking = (np.arange(b) % 2).astype(np.int32)
    ins = dict(logits=logits, input_ids=ids, thinking=thinking,
               relaxed_topk=None if topk is None else np.array(topk, np.int32),
               relaxed_delta=None if delta is None else np.array(delta, np.float32))
    got = run_node("MtpAccept", ins, dict(think_start_id=0, think_end_id=1), outputs=3, out_type=TensorProto.INT32)
    t = torch.from_numpy
    want = accept_decomposed(t(logits), t(ids), t(thinking), torch.tensor(topk or 0, dtype=torch.int32),
                             torch.tensor(delta or 0.0), 0, 1)
    for g, w in zip(got, want):
        assert np.array_equal(g, w.numpy())


# ------------------------------------------------------------------------------------------ RmsNorm
@pytest.mark.parametrize("rows,d,skip,sum_out", [(1, 256, True, True), (2, 256, True, False), (4, 37, False, False),
                                                 (300, 512, True, True), (3, 5, False, False)])
def test_rms_norm_matches_reference(rows, d, skip, sum_out):
    """norm(x) or norm(x + skip) with its sum (output 1, where the node has it), at widths off the vector width and
    row counts that run on one thread and split over threads."""
    rng = np.random.default_rng(rows * d)
    x = (rng.standard_normal((1, rows, d)) * 3).astype(np.float32)
    k = rng.standard_normal((1, rows, d)).astype(np.float32) if skip else None
    w = rng.uniform(0.5, 1.5, d).astype(np.float32)
    out = run_node("RmsNorm", dict(x=x, weight=w, skip=k), dict(epsilon=1e-5), dict(weight=w),
                   outputs=2 if sum_out else 1)
    s = x + k if skip else x
    y = out[0] if sum_out else out
    close(y, ref.rms_norm(s.astype(np.float64), w, 1e-5))
    if sum_out:
        assert np.array_equal(out[1], s)


# ------------------------------------------------------------------------------ threads and paths
def test_any_thread_count_gives_the_same_bits(monkeypatch):
    """Work is split by output columns, heads and tokens, never within a sum: 1, 2 and 3 threads agree exactly,
    whether every call is split (MTP_ORT_MIN_PARALLEL_WORK=0) or only large ones, and whether the session tells the
    operators its thread count (on one thread the attention keeps a token's heads together) or not."""
    rng = np.random.default_rng(11)
    moe = moe_inputs(rng, 5, 72, 16, 24, 24)
    consts = {n: a for n, a in moe.items() if n != "x"}
    attrs = dict(top_k=2, n_group=4, topk_group=2, softmax=0, group_top2=1, norm_topk_prob=1,
                 routed_scaling_factor=2.5)
    mla = mla_inputs(rng, 1, 2, 8, 32, 16, 50, 2, None)
    norm = dict(x=rng.standard_normal((3, 5, 40)).astype(np.float32), weight=rng.standard_normal(40).astype(np.float32),
                skip=rng.standard_normal((3, 5, 40)).astype(np.float32))
    outs = []
    for split, n, say in itertools.product(("0", ""), (1, 2, 3), (True, False)):
        monkeypatch.setenv("MTP_ORT_MIN_PARALLEL_WORK", split)  # read when a session makes its kernels
        outs.append((run_node("MoE", moe, attrs, consts, threads=n),
                     run_node("MlaAttention", mla, dict(heads=8, scale=0.2), threads=n, say_threads=say),
                     *run_node("RmsNorm", norm, dict(epsilon=1e-6), threads=n, outputs=2)))
    for out in outs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(out, outs[0]))


def test_portable_path_agrees_with_avx2():
    """MTP_TRT_CPU_ISA=scalar runs the scalar kernels: the same results up to float rounding (a child process,
    since the path is chosen once per process)."""
    code = (
        "import numpy as np, sys; sys.path.insert(0, %r); import test_ort_ops as t; "
        "rng = np.random.default_rng(5); ins = t.moe_inputs(rng, 3, 40, 8, 12, 12); "
        "m = t.run_node('MoE', ins, dict(top_k=2, n_group=2, topk_group=1, softmax=0, group_top2=1, norm_topk_prob=1, "
        "routed_scaling_factor=1.0), {n: a for n, a in ins.items() if n != 'x'}); "
        "a = t.mla_inputs(rng, 2, 3, 4, 20, 12, 30, 5, 'batch'); y = t.run_node('MlaAttention', a, dict(heads=4, scale=0.3)); "
        "np.save(sys.argv[1], np.concatenate([m.ravel(), y.ravel()]))") % os.path.dirname(__file__)
    outs = []
    for portable in (False, True):
        env = {k: v for k, v in os.environ.items() if k != "MTP_TRT_CPU_ISA"} | \
            ({"MTP_TRT_CPU_ISA": "scalar"} if portable else {})
        path = f"{os.environ.get('TMPDIR', '/tmp')}/ort_ops_{os.getpid()}_{int(portable)}.npy"
        subprocess.run([sys.executable, "-c", code, path], check=True, env=env, capture_output=True)
        outs.append(np.load(path))
        os.remove(path)
    close(outs[1], outs[0], 1e-6)


# ----------------------------------------------------------------------------------------- errors
def test_bad_shapes_are_one_error_naming_the_op_and_input():
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    mla = mla_inputs(rng, 1, 2, 4, 16, 8, 10, 2, None)
    mla["q_pe"] = mla["q_pe"][..., :-1]  # not H * Dr wide
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match=r"mtp_trt\.cpu::MlaAttention: q_lat"):
        run_node("MlaAttention", mla, dict(heads=4, scale=0.1))
    mla = mla_inputs(rng, 1, 2, 4, 16, 8, 10, 2, "batch")
    mla["visible"] = mla["visible"][:, :, :1]
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match=r"visible \[1, 2, 1\] must be"):
        run_node("MlaAttention", mla, dict(heads=4, scale=0.1))
    x = np.ones((2, 8), np.float32)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                       match=r"RmsNorm: x \[2, 8\] must be \[\.\.\., D\] with D = 6"):
        run_node("RmsNorm", dict(x=x, weight=np.ones(6, np.float32)), dict(epsilon=1e-6))
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match=r"RmsNorm: skip \[2, 4\] must be"):
        run_node("RmsNorm", dict(x=x, weight=np.ones(8, np.float32), skip=x[:, :4].copy()), dict(epsilon=1e-6))
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match=r"RmsNorm: output 1 .* the skip"):
        run_node("RmsNorm", dict(x=x, weight=np.ones(8, np.float32)), dict(epsilon=1e-6), outputs=2)
    moe = moe_inputs(rng, 2, 16, 4, 8, 0)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match=r"MoE: top_k 5.*4 experts"):
        run_node("MoE", moe, dict(top_k=5, n_group=1, topk_group=1, softmax=0, group_top2=0, norm_topk_prob=1,
                                  routed_scaling_factor=1.0), {n: a for n, a in moe.items() if n != "x" and a is not None})
