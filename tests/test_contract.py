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
