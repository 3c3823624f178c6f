"""The built C++ plugin library, driven on the host by tests/cpp/plugin_probe.cpp (no TensorRT library,
no GPU), against the contract (mtp_trt/ops.py) and the Python plugins' rules and workspace bound
(plugins/trt_plugins.py): creators, field names and types, serialized fields, aliases, output types,
supported type combinations, and the split-KV workspace reserved for several profiles.

Skipped where TensorRT's headers are absent (tests/cpp_env.py) or the library is not built
(`cmake -S plugins/cpp -B plugins/cpp/build ...`, docs/tensorrt.md)."""

from __future__ import annotations

import json
import subprocess

import pytest

import cpp_env
from mtp_trt import ops
from mtp_trt.plugins import trt_plugins as tp
from mtp_trt.trt import cpp_plugins

LIB = cpp_plugins.find_library()
pytestmark = [pytest.mark.skipif(cpp_env.unavailable_reason() is not None, reason=f"C++: {cpp_env.unavailable_reason()}"),
              pytest.mark.skipif(LIB is None, reason=f"{cpp_plugins.LIB_NAME} is not built")]
F32, F16, BF16, I32 = 0, 1, 7, 3  # nvinfer1::DataType values
FIELDS = {"MlaGenerationAttention": [["kv_lora_rank", "INT32", 1, 32], ["softmax_scale", "FLOAT32", 1, 0.125]],
          "MtpAccept": [["think_start_id", "INT32", 1, 90], ["think_end_id", "INT32", 1, 91]]}
TYPE = {"int": "INT32", "float": "FLOAT32"}


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    exe = tmp_path_factory.mktemp("probe") / "plugin_probe"
    proc = subprocess.run(cpp_env.gxx(str(cpp_env.ROOT / "tests" / "cpp" / "plugin_probe.cpp"), "-o", str(exe), "-ldl"),
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr

    def run(*args):
        out = subprocess.run([str(exe), str(LIB), *map(str, args)], capture_output=True, text=True, check=True)
        return out.stdout
    return run


@pytest.fixture(scope="module")
def report(probe):
    lines = [json.loads(line) for line in probe().splitlines()]
    return {d["op"]: d for d in lines if "op" in d}, lines[-1]


def test_creators_fields_and_serialization(report):
    by_op, _ = report
    assert sorted(by_op) == sorted(ops.OPS)
    for name, spec in ops.OPS.items():
        d = by_op[name]
        assert (d["version"], d["namespace"]) == (tp.PLUGIN_VERSION, tp.PLUGIN_NAMESPACE)
        assert d["core"] == [name, tp.PLUGIN_VERSION, tp.PLUGIN_NAMESPACE]
        assert [f[:2] for f in d["field_names"]] == [[n, TYPE[doc.split(":")[0]]] for n, doc in spec.attributes]
        assert d["serialized"] == FIELDS[name]  # what the runtime copy would write into the engine


def test_outputs_and_aliases(report):
    by_op, _ = report
    for name, spec in ops.OPS.items():
        d = by_op[name]
        assert d["num_outputs"] == len(spec.outputs)
        assert d["aliases"] == [ops.ALIASES[name].get(i, -1) for i in range(len(spec.outputs))]
    mla, acc = by_op["MlaGenerationAttention"], by_op["MtpAccept"]
    assert mla["output_types"] == [[0, t, t] for t in (F32, F16, BF16)]  # out and kv_cache_out: the input's type
    assert acc["output_types"] == [[0, I32, I32, I32]] * 3


def test_type_combinations(report):
    """Each position tried with fp32, fp16, bf16, int32 (the others valid): the Python plugins' rules."""
    by_op, _ = report
    # attention: q any float type; past_len int32; new_rows, kv_cache, out, kv_cache_out: q's type (fp16 here)
    assert by_op["MlaGenerationAttention"]["formats"] == [[1, 1, 1, 0], [0, 1, 0, 0], [0, 1, 0, 0], [0, 0, 0, 1],
                                                          [0, 1, 0, 0], [0, 1, 0, 0]]
    acc_types = ["float32", "int32", "int32", "int32", "float32", "int32", "int32", "int32"]  # MtpAccept.TYPES
    column = {"float32": 0, "int32": 3}
    assert by_op["MtpAccept"]["formats"] == [[int(i == column[t]) for i in range(4)] for t in acc_types]


def test_bad_attributes_are_refused(report):
    _, last = report
    assert last == {"bad_kv_lora_rank": 1, "missing_field": 1}


@pytest.mark.parametrize("b0,b1,s0,s1,H,Dl,T", [(1, 8, 1, 4, 16, 512, 4096), (1, 1, 1, 1, 128, 512, 163840),
                                                (1, 64, 1, 17, 128, 512, 32768), (1, 4, 1, 3, 4, 32, 2048),
                                                (1, 4, 1, 512, 16, 64, 512), (2, 2, 3, 3, 1, 16, 100)])
def test_workspace_matches_python(probe, b0, b1, s0, s1, H, Dl, T):
    got = int(probe("ws", b0, b1, s0, s1, H, Dl, T))
    assert got == tp.mla_workspace_bound((b0, b1), (s0, s1), H, Dl, T)
