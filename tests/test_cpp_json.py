"""The C++ runner's JSON reader (samples/cpp/json.h) against Python's json, on documents shaped like
engines.json (written by mtp_trt.trt.manifest.dumps) and export_manifest.json, plus the escapes,
literals and numbers JSON allows.  Needs g++ only."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from mtp_trt.trt import manifest as em

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")

DOCS = {
    "engines": {"format": em.FORMAT, "format_version": em.FORMAT_VERSION, "max_prefill": 32, "max_seq_len": 64,
                "export": {"nextn": 2, "mtp_mode": "eagle", "checkpoint": None, "dtype": "bf16"},
                "profiles": [{"name": "generation", "dims": {"B": [1, 4, 4], "S": [1, 3, 3]}}],
                "engines": {"target": {"file": "target.engine", "bytes": 16267004, "build_seconds": 6.91,
                                       "plugin_layers": {"MlaGenerationAttention": 3, "MtpAccept": 1}}},
                "notes": [], "ok": True, "off": False},
    "export": {"eos_ids": [95, 1], "think_ids": [-1, -1], "config": {"rope_theta": 10000.0, "eps": 1e-06,
                                                                     "scale": -2.5e-3, "name": "a \"quoted\" \\ path\n"}},
    "scalars": [0, -0.5, 1e300, 12345678901, "tab\there", "\u00e9", [], {}, [[1, [2, [3]]]]],
}


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    exe = tmp_path_factory.mktemp("json") / "json_probe"
    proc = subprocess.run(["g++", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-I", str(ROOT / "samples" / "cpp"),
                           str(ROOT / "tests" / "cpp" / "json_probe.cpp"), "-o", str(exe)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return exe


@pytest.mark.parametrize("name", list(DOCS))
def test_reads_what_python_wrote(probe, tmp_path, name):
    doc = DOCS[name]
    path = tmp_path / "doc.json"
    path.write_text(em.dumps(doc) if name == "engines" else json.dumps(doc, indent=1))
    out = subprocess.run([str(probe), str(path)], capture_output=True, text=True, check=True).stdout
    want = json.loads(json.dumps(doc).replace("\\u00e9", "?"))  # json.h reads a non-ASCII \\u escape as "?"
    assert json.loads(out) == want


@pytest.mark.parametrize("text", ['{"a": 1,}', '[1 2]', '{"a" 1}', '"unterminated', 'tru', '{"a": 1} x'])
def test_malformed_json_is_an_error(probe, tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    proc = subprocess.run([str(probe), str(path)], capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stdout.startswith("error: JSON:")
