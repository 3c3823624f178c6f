"""The C++ plugins' contract table (plugins/cpp/op_contract.h) and workspace formulas
(plugins/cpp/workspace.h) against mtp_trt/ops.py and plugins/trt_plugins.py.  Needs no TensorRT:
the header is parsed; the workspace test compiles a small program with g++ (skipped without g++).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mtp_trt import ops
from mtp_trt.plugins import reference as ref
from mtp_trt.plugins import trt_plugins as tp

ROOT = Path(__file__).resolve().parents[1]
CPP = ROOT / "plugins" / "cpp"
HEADER = CPP / "op_contract.h"
FIELD_TYPES = {"int": "kInt32", "float": "kFloat32"}  # ops.py attribute type -> contract::FieldType


def parse_contract(text: str) -> dict:
    """{"version": int, "version_string", "namespace", "domain", "constants": {...},
    "ops": {name: {"inputs", "outputs", "fields", "aliases"}}} from op_contract.h."""
    def const(name):
        m = re.search(rf"\b{name}(?:\[\])?\s*=\s*([^;]+);", text)
        assert m, f"{name} not found in op_contract.h"
        return m.group(1).strip()

    out = {"version": int(const("kVersion")), "version_string": const("kVersionString").strip('"'),
           "namespace": const("kNamespace").strip('"'), "domain": const("kDomain").strip('"'),
           "constants": {k: int(const(k)) for k in ("kRowBlock", "kTileRows", "kMinTiles", "kMaxSplits", "kMaxSms",
                                                    "kDsaStateBytes")}, "ops": {}}
    for body in re.findall(r"namespace \w+ \{  // \w+\n(.*?)\n\}  // namespace", text, re.S):
        name = re.search(r'kName\[\] = "(\w+)";', body).group(1)
        strings = {k: re.findall(r'"(\w+)"', re.search(rf"{k}\[\] = \{{(.*?)\}};", body).group(1))
                   for k in ("kInputs", "kOutputs")}
        fields = re.findall(r'\{"(\w+)", FieldType::(\w+)\}', re.search(r"kFields\[\] = \{(.*?)\};", body).group(1))
        aliases = [int(x) for x in re.search(r"kAliasedInput\[\] = \{(.*?)\};", body).group(1).split(",")]
        enums = {k: re.findall(r"k\w+ = (\d+)", re.search(rf"enum {k} \{{(.*?)\}};", body).group(1))
                 for k in ("Input", "Output")}
        optional = int(re.search(r"kOptionalInputs = (\d+);", body).group(1))
        out["ops"][name] = {"inputs": strings["kInputs"], "outputs": strings["kOutputs"], "fields": fields,
                            "aliases": aliases, "enums": enums, "optional": optional}
    return out


@pytest.fixture(scope="module")
def contract():
    return parse_contract(HEADER.read_text())


def test_version_namespace_domain(contract):
    assert contract["version"] == ops.VERSION
    assert contract["version_string"] == tp.PLUGIN_VERSION == str(ops.VERSION)
    assert contract["namespace"] == tp.PLUGIN_NAMESPACE
    assert contract["domain"] == ops.DOMAIN


def test_ops_match_ops_py(contract):
    assert sorted(contract["ops"]) == sorted(ops.OPS)
    for name, spec in ops.OPS.items():
        got = contract["ops"][name]
        assert got["inputs"] == [n for n, _ in spec.inputs], name
        assert got["optional"] == spec.optional, name
        assert got["outputs"] == [n for n, _ in spec.outputs], name
        want_fields = [(n, FIELD_TYPES[doc.split(":")[0]]) for n, doc in spec.attributes]
        assert got["fields"] == want_fields, name
        want_alias = [ops.ALIASES[name].get(i, -1) for i in range(len(spec.outputs))]
        assert got["aliases"] == want_alias, name
        # the index enums count 0, 1, 2 ... in the order of the names
        assert got["enums"]["Input"] == [str(i) for i in range(len(spec.inputs))], name
        assert got["enums"]["Output"] == [str(i) for i in range(len(spec.outputs))], name


def test_workspace_constants(contract):
    assert contract["constants"] == {"kRowBlock": ref.MLA_ROW_BLOCK, "kTileRows": ref.MLA_TILE_ROWS,
                                     "kMinTiles": ref.MLA_MIN_TILES, "kMaxSplits": ref.MLA_MAX_SPLITS,
                                     "kMaxSms": tp.MAX_SMS, "kDsaStateBytes": tp.DSA_STATE_BYTES}


def test_parser_sees_an_edit():
    text = HEADER.read_text().replace('"kv_cache_out"', '"kv_cache_2"')
    assert parse_contract(text)["ops"]["MlaGenerationAttention"]["outputs"] == ["out", "kv_cache_2"]


PROBE = r"""
#include <cstdio>
#include "workspace.h"
int main() {
    long long b0, b1, s0, s1, H, Dl, T;
    while (std::scanf("%lld %lld %lld %lld %lld %lld %lld", &b0, &b1, &s0, &s1, &H, &Dl, &T) == 7)
        std::printf("%lld %d %lld %lld %d %lld\n",
                    static_cast<long long>(mtp_trt::mla_workspace_bound(b0, b1, s0, s1, H, Dl, T)),
                    mtp_trt::mla_splits_bound(b1, s1, H, T),
                    static_cast<long long>(mtp_trt::mla_workspace_size(b1, s1, H, Dl, mtp_trt::mla_num_splits(b1, s1, H, T, 132))),
                    static_cast<long long>(mtp_trt::sparse_workspace_bound(b0, b1, s0, s1, H, Dl, T, 2048)),
                    mtp_trt::sparse_splits_bound(b1, s1, H, 2048),
                    static_cast<long long>(mtp_trt::sparse_workspace_size(b1, s1, H, Dl, T, 2048, 3).total()));
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_workspace_formulas_match_python(tmp_path):
    src, exe = tmp_path / "probe.cpp", tmp_path / "probe"
    src.write_text(PROBE)
    subprocess.run(["g++", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-I", str(CPP), str(src), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    cases = [(1, 1, 1, 4, 16, 64, 512), (1, 8, 1, 4, 16, 512, 4096), (1, 1, 1, 1, 128, 512, 163840),
             (1, 64, 1, 17, 128, 512, 32768), (2, 2, 3, 3, 1, 16, 100), (1, 4, 1, 4, 16, 64, 1),
             (0, 3, 0, 2, 20, 48, 700)]
    lines = subprocess.run([str(exe)], input="\n".join(" ".join(map(str, c)) for c in cases), check=True,
                           capture_output=True, text=True).stdout.split("\n")
    for c, line in zip(cases, lines):
        b0, b1, s0, s1, H, Dl, T = c
        bound, splits, size, sparse_bound, sparse_splits, sparse_size = (int(x) for x in line.split())
        assert bound == tp.mla_workspace_bound((b0, b1), (s0, s1), H, Dl, T), c
        assert splits == tp.mla_splits_bound(b1, s1, H, T), c
        assert size == tp.mla_workspace_size(b1, s1, H, Dl, tp.mla_num_splits(b1, s1, H, T, 132)), c
        # MlaSparseAttention (index_topk 2048): scores, selected rows and split partials
        assert sparse_bound == tp.sparse_workspace_bound((b0, b1), (s0, s1), H, Dl, T, 2048), c
        assert sparse_splits == tp.sparse_splits_bound(b1, s1, H, 2048), c
        assert sparse_size == sum(tp.sparse_workspace_size(b1, s1, H, Dl, T, 2048, 3)), c
    assert any(int(line.split()[0]) > 0 for line in lines if line), "no case exercised a split workspace"


def test_runner_uses_tensorrt_10_15_calls_only_behind_a_version_guard():
    """The runner compiles against TensorRT 10.3-10.14 (no ICudaEngine::getAliasedInputTensor): its aliases
    come from engines.json, TensorRT's own report is read only where the headers are 10.15 or later, and headers
    outside 10.3-11.x stop the compile."""
    text = (ROOT / "samples" / "cpp" / "mtp_trt_runner.cpp").read_text()
    guarded = re.findall(r"#if NV_TENSORRT_VERSION >= 101500\b.*?#endif", text, re.S)
    assert text.count("getAliasedInputTensor") == sum(g.count("getAliasedInputTensor") for g in guarded) == 1
    assert 'e["aliases"]' in text and "#error" in text and "getInferLibVersion()" in text
