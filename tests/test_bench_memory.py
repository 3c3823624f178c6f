"""The real-size benchmarks' memory measure and flags: `read_mapped` makes every page of a file's mappings
resident (what benchmarks/v2_lite.py's "all weights read" peak counts), and v2_lite.py refuses bad flags in one
line before any work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_common import read_mapped  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs Linux's /proc")
def test_read_mapped_makes_the_mapping_resident(tmp_path):
    path = tmp_path / "weights.bin"
    np.full(48 << 20, 7, np.uint8).tofile(path)
    other = tmp_path / "other.bin"
    other.write_bytes(b"\0" * 4096)
    mapped = np.memmap(path, np.uint8, mode="r")
    before = rss_mib()
    assert read_mapped(other) == 0  # not mapped here: nothing read
    assert rss_mib() - before < 8
    assert read_mapped(path) == -(-path.stat().st_size // 4096) * 4096
    assert rss_mib() - before > 44  # the 48 MiB now resident
    del mapped


@pytest.mark.parametrize("flags, message", [
    (["--layers", "0"], "error: --layers 0: must be at least 1"),
    (["--rounds", "0"], "error: --rounds 0: must be at least 1"),
    (["--llama-python", "/no/such/python"], "error: --llama-python /no/such/python: no such file"),
    (["--llama-python", sys.executable, "--sdist", "/no/such.tar.gz"], "error: --sdist /no/such.tar.gz: no such file"),
    (["--llama-python", sys.executable], "error: --sdist: llama-cpp-python's source distribution is needed"),
])
def test_v2_lite_refuses_bad_flags_before_any_work(tmp_path, flags, message):
    cache = tmp_path / "cache"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "v2_lite.py"), *flags], capture_output=True,
                         text=True, env={**os.environ, "MTP_TRT_CACHE_DIR": str(cache)}, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith(f"v2_lite.py: {message}")
    assert "Traceback" not in res.stderr
    assert not cache.exists() or not any(cache.rglob("*"))  # no checkpoint, export or GGUF begun


def test_compare_logits_against_numpy():
    from v2_lite import compare_logits

    rng = np.random.default_rng(0)
    a = rng.standard_normal((6, 50)).astype(np.float32)
    same = compare_logits(a, a.copy())
    assert same == {"correlation": pytest.approx(1.0), "top1_agreement": 1.0, "rank": 0.0}
    b = a.copy()
    top = a.argmax(1)
    b[np.arange(3), top[:3]] = b[:3].min(1) - 1  # positions 0..2: a's top-1 is now b's last
    r = compare_logits(a, b)
    assert r["top1_agreement"] == 0.5
    assert r["rank"] == np.median([49, 49, 49, 0, 0, 0])
    assert r["correlation"] == pytest.approx(np.median([np.corrcoef(x, y)[0, 1] for x, y in zip(a, b)]))
