"""The graph contract (mtp_trt/contract.py) against what the documentation and the exported manifest say."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch

from mtp_trt import contract as C
from mtp_trt.backend import Backend

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
LAYERS = 3
# the documentation's symbols for the config's sizes and the export's dtype
CFG = SimpleNamespace(num_hidden_layers=LAYERS, cache_dim="Dl + Dr", hidden_size="D", vocab_size="V")


def doc_table(section: str, kind: str) -> list[tuple[str, str, list[str], str]]:
    """(name, dtype, shape, lowering or "") of each row of the table headed `| kind |` under `## section`, a row
    `x_0 …` expanded over the layers."""
    text = DOC.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    table = next(t for t in text.split("\n\n") if t.strip().startswith(f"| {kind} |"))
    rows = []
    for line in table.strip().splitlines()[2:]:
        name, dtype, shape, note = [c.strip() for c in line.strip().strip("|").split("|")][:4]
        lowering = m.group(1) if (m := re.match(r"`(onnx|plugin)` lowering", note)) else ""
        dims = [d.strip() for d in shape.strip("[]").split(",") if d.strip()]
        first = re.match(r"`(\w+)", name).group(1)
        if "…" in name:
            prefix, suffix = re.match(r"(\w*?)0(\w*)$", first).groups()
            rows += [(f"{prefix}{i}{suffix}", dtype, dims, lowering) for i in range(LAYERS)]
        else:
            rows.append((first, dtype, dims, lowering))
    return rows


@pytest.mark.parametrize("lowering", ["onnx", "plugin"])
@pytest.mark.parametrize("section,io", [("target.onnx", C.target_io), ("mtp_k.onnx", C.mtp_io)])
def test_docs_tables_are_the_contract(section, io, lowering):
    inputs, outputs = io(CFG, "dtype", lowering)
    for kind, specs in (("input", inputs), ("output", outputs)):
        documented = [(n, d, s) for n, d, s, low in doc_table(section, kind) if low in ("", lowering)]
        assert documented == [(t["name"], t["dtype"], [str(x) for x in t["shape"]]) for t in specs], (section, kind)


def test_cache_slots():
    assert C.cache_slot("kv_3") == C.CacheSlot("target", 3)
    assert C.cache_slot("kv", C.mtp_family(1)) == C.CacheSlot("mtp1", 0)
    assert C.cache_slot("mtp_kv") == C.CacheSlot("mtp0", 0)
    assert C.cache_slot("mtp_kv_2") == C.CacheSlot("mtp2", 0, -2)
    with pytest.raises(C.MtpTrtError, match="'hidden' is not a cache input"):
        C.cache_slot("hidden")


def test_dtype_table_agrees_with_the_libraries():
    for d in C.DTYPE_TABLE.values():
        if d.name in ("bf16", "fp8e4m3", "fp8e5m2"):  # no NumPy dtype: raw bits of the same size
            assert onnx.helper.tensor_dtype_to_np_dtype(d.onnx).itemsize == d.itemsize
            assert np.dtype(d.host).kind == "u"
        else:
            assert onnx.helper.tensor_dtype_to_np_dtype(d.onnx) == np.dtype(d.host)
        assert d.torch_dtype().itemsize == d.itemsize
    assert C.dtype("bf16").torch_dtype() == torch.bfloat16
    assert [C.dtype(t).kernel for t in C.DTYPES] == [0, 1, 2]  # the CUDA kernels' dtype codes
    assert C.BY_ONNX[onnx.TensorProto.FLOAT16].name == "fp16" and C.BY_ONNX[onnx.TensorProto.BFLOAT16].name == "bf16"
    assert C.BY_ONNX[onnx.TensorProto.FLOAT8E4M3FN].torch_dtype() == torch.float8_e4m3fn
    assert C.BY_SAFETENSORS["BF16"].torch_dtype() == torch.bfloat16 and C.BY_SAFETENSORS["F8_E5M2"].itemsize == 1


def test_graph_names():
    assert C.tree_dims(C.tree_graph(3, 2, 6)) == (3, 2, 6)
    assert [C.step_graph(2), C.mtp_graph(1), C.tree_graph(3, 2, 6)] == ["step_2", "mtp_1", "tree_3_2_6"]


class _Recorder(Backend):
    """A backend whose `run` records its calls and answers rows that say where they came from."""

    max_s = 3

    def __init__(self):
        self.manifest = SimpleNamespace(dtype="fp32")
        self.calls = []

    def allocate(self, batch, rows):
        pass

    def has_graph(self, graph):
        return True

    def swap_slots(self, i, j):
        pass

    def run(self, graph, n, feed, fetch, family=C.mtp_family(0), replay=False):
        self.calls.append((graph, family, {k: v.copy() for k, v in feed.items()}, replay))
        ids = feed[C.INPUT_IDS] if C.INPUT_IDS in feed else feed[C.NEXT_TOKENS]
        rows = ids + 100 * feed[C.PAST_LEN][:, None]  # each output row: its token and the call's past_len
        return {k: rows for k in fetch}


def test_base_runs_long_calls_in_chunks_at_past_len():
    b = _Recorder()
    ids = np.arange(14, dtype=np.int64).reshape(2, 7)
    out = b.target(2, ids, np.array([5, 9]), np.zeros(2, np.int32), 0, 0.0, logits=True)
    assert [c[0] for c in b.calls] == [C.TARGET] * 3
    assert [c[2][C.PAST_LEN].tolist() for c in b.calls] == [[5, 9], [8, 12], [11, 15]]
    assert [c[2][C.INPUT_IDS].shape[1] for c in b.calls] == [3, 3, 1]
    assert all(c[2][C.INPUT_IDS].dtype == np.int32 for c in b.calls)
    # per-row outputs joined along S (each row from the chunk that ran it), the others from the last chunk
    starts = np.array([5, 9])[:, None] + np.array([0, 0, 0, 3, 3, 3, 6])
    np.testing.assert_array_equal(out[C.TARGET_TOKENS], ids + 100 * starts)
    np.testing.assert_array_equal(out[C.LOGITS], out[C.TARGET_TOKENS])
    np.testing.assert_array_equal(out[C.ACCEPTED_TOKENS], ids[:, 6:] + 100 * np.array([[11], [15]]))
    assert set(out) == {*C.TARGET_OUTPUTS, C.LOGITS}

    b.calls.clear()
    hidden = np.zeros((1, 4, 8), np.float64)
    out = b.mtp(1, "mtp_1", 1, hidden, np.arange(4).reshape(1, 4), np.array([2]), logits=False)
    assert [(c[0], c[1]) for c in b.calls] == [("mtp_1", "mtp1")] * 2
    assert b.calls[0][2][C.HIDDEN].dtype == np.float32  # the export's dtype
    assert set(out) == set(C.MTP_OUTPUTS) and out[C.DRAFT_TOKENS].tolist() == [[200, 201, 202, 503]]


def test_base_step_feeds_the_inputs_a_step_graph_has():
    b = _Recorder()
    cfg = SimpleNamespace(num_hidden_layers=1, cache_dim=4, hidden_size=8, vocab_size=16)
    graphs = C.graph_contract(cfg, 2, 2, "vanilla", "fp32", "onnx", ((2, 2, 3),))
    b.manifest.graphs = {name: SimpleNamespace(inputs=[SimpleNamespace(**t) for t in g["inputs"]],
                                               outputs=[SimpleNamespace(**t) for t in g["outputs"]])
                         for name, g in graphs.items()}
    lens, flags = np.array([4]), np.zeros(1, np.int32)
    out = b.step(1, np.zeros((1, 1), np.int32), lens, flags, 3, 0.5, carry=None)
    # every input the graph has, none absent (no carry); run() leaves out the others (relaxed acceptance's)
    fed = b.calls[-1][2]
    assert b.calls[-1][0] == "step_0" and {C.INPUT_IDS, C.PAST_LEN, C.THINKING} <= set(fed) and C.CARRY not in fed
    assert set(fed) <= {C.INPUT_IDS, C.PAST_LEN, C.THINKING, C.RELAXED_TOPK, C.RELAXED_DELTA}
    assert all(v.dtype == np.int32 for k, v in fed.items() if k != C.RELAXED_DELTA)
    assert b.calls[-1][3], "step graphs run every step with the same shapes: worth capturing"
    assert set(out) == {C.ACCEPTED_TOKENS, C.NUM_ACCEPTED, C.THINKING_OUT}
    carry = np.zeros((1, 1, 8), np.float32)
    out = b.step(1, np.zeros((1, 3), np.int32), lens, flags, 3, 0.5, carry=carry)
    assert b.calls[-1][0] == "step_2" and b.calls[-1][2][C.RELAXED_TOPK] == 3 and C.CARRY in b.calls[-1][2]
    assert set(out) == {C.ACCEPTED_TOKENS, C.NUM_ACCEPTED, C.THINKING_OUT, C.DRAFTS, C.CARRY_OUT}
    out = b.tree_step("tree_2_2_3", 1, np.zeros((1, 4), np.int32), np.zeros((1, 3), np.int64), lens, flags, 0, 0.0,
                      carry=carry)
    assert b.calls[-1][0] == "tree_2_2_3" and b.calls[-1][2][C.TREE_PARENTS].dtype == np.int32
    assert set(out) == {C.ACCEPTED_TOKENS, C.NUM_ACCEPTED, C.THINKING_OUT, C.TREE_TOKENS, C.TREE_PARENTS_OUT,
                        C.CARRY_OUT}
