"""One copy of the weights per process (OrtBackend): the second session of an export (target after step_0,
which repeat the whole main model) adds far less resident memory than the weights it reads, while
without sharing it adds about a copy; and both decode the same tokens.  By default the backend shares
from SHARE_WEIGHTS_BYTES of weights up."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_trt import backend
from mtp_trt.exporters.export import export
from mtp_trt.manifest import Manifest
from runtime_models import make_random

# Run in a fresh process: resident memory (VmRSS) after step_0's first run (and the shared mapping made
# resident), then after target's.
PROBE = """
import json, sys
import numpy as np
from mtp_trt.backend import OrtBackend
from mtp_trt.manifest import Manifest

def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))

b = OrtBackend(Manifest.load(sys.argv[1]), threads=1, share_weights=sys.argv[2] == "1")
b.allocate(1, 16)
one = np.ones(1, np.int32)
out0 = b.step(1, np.full((1, 1), 7, np.int32), 0 * one, 0 * one, 0, 0.0)
if b.mapped is not None:  # fault the whole mapping in: step_0 read only its selected experts' pages of it
    int(np.asarray(b.mapped)[::4096].sum())
r1 = rss()
out1 = b.target(1, np.array([[7, 8, 9]], np.int32), one, 0 * one, 0, 0.0, logits=False)
r2 = rss()
print(json.dumps({"growth": r2 - r1, "tokens": out1["target_tokens"].tolist() + out0["accepted_tokens"].tolist()}))
"""


@pytest.fixture(scope="module")
def big_export(tmp_path_factory):
    """A random checkpoint with ~36 MB of routed-expert weights (2 MoE layers x 16 experts of 384 x 256)."""
    root = tmp_path_factory.mktemp("shared")
    ckpt = make_random(root / "ckpt", nextn=0, hidden_size=384, moe_intermediate_size=256, n_routed_experts=16,
                       num_hidden_layers=2, first_k_dense_replace=0)
    return export(ckpt, root / "out", nextn=0, max_seq_len=64)


def probe(path: Path, share: bool) -> dict:
    res = subprocess.run([sys.executable, "-c", PROBE, str(path), "1" if share else "0"], capture_output=True,
                         text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmRSS from /proc")
def test_second_session_shares_the_weights(big_export):
    tables = json.loads((big_export / "manifest.json").read_text())["weights"]["initializers"]
    target_bytes = sum(entry[2] for entry in tables["target.onnx"])
    assert target_bytes > 30e6
    shared, copied = probe(big_export, True), probe(big_export, False)
    assert shared["tokens"] == copied["tokens"]
    assert shared["growth"] < 0.15 * target_bytes, (shared["growth"], target_bytes)
    assert copied["growth"] > 0.6 * target_bytes, (copied["growth"], target_bytes)  # the probe sees copies


def test_default_shares_from_the_threshold_up(big_export, monkeypatch):
    manifest = Manifest.load(big_export)
    size = json.loads((big_export / "manifest.json").read_text())["weights"]["bytes"]
    monkeypatch.setattr(backend, "SHARE_WEIGHTS_BYTES", size + 1)
    assert backend.OrtBackend(manifest).tables is None  # below: each session pre-packs its own copy
    monkeypatch.setattr(backend, "SHARE_WEIGHTS_BYTES", size)
    assert set(backend.OrtBackend(manifest).tables) == {g.file for g in manifest.graphs.values()}


@pytest.mark.parametrize("mode", ["eagle", pytest.param("vanilla", marks=pytest.mark.slow)])
def test_shared_weights_decode_the_same_tokens(tmp_path, mode):
    """Every graph a decode runs (target, MTP graphs, step graphs), shared (step graphs pre-packed or not) or
    not: the same greedy tokens."""
    from mtp_trt.decode import DecodeOptions, generate

    ckpt = make_random(tmp_path / "ckpt", nextn=2)
    manifest = Manifest.load(export(ckpt, tmp_path / "out", nextn=2, mtp_mode=mode, max_seq_len=64))
    prompts = [[5, 17, 33, 2, 8, 41, 7], [60, 3]]
    for nextn in range(3):
        opts = DecodeOptions(nextn=nextn, max_new_tokens=12)
        variants = [dict(share_weights=True), dict(share_weights=True, prepack=()), dict(share_weights=False)]
        runs = [generate(backend.OrtBackend(manifest, **v), prompts, opts)[0] for v in variants]
        assert [q.generated for q in runs[0]] == [q.generated for q in runs[1]] == [q.generated for q in runs[2]]


def test_weights_are_read_into_memory_up_to_a_share_of_it(tmp_path, monkeypatch):
    """read_weights: the file's bytes, read-only; in memory of the process's own up to 1 / IN_MEMORY_SHARE of the
    machine's memory, memory-mapped above it (a model larger than memory streams from the page cache)."""
    import numpy as np

    path = tmp_path / "weights.bin"
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    monkeypatch.setattr(backend, "machine_memory", lambda: 4 * data.size)
    read = backend.read_weights(path)
    assert type(read) is np.ndarray and not read.flags.writeable and np.array_equal(read, data)
    monkeypatch.setattr(backend, "machine_memory", lambda: 4 * data.size - 1)
    mapped = backend.read_weights(path)
    assert isinstance(mapped, np.memmap) and np.array_equal(mapped, data)
