"""Bad and unusual input, as a user or an adversary gives it to the `mtp-trt` commands: each case
ends in one `error:` line naming the file, field, flag or value, exit status 2, and leaves no file or
directory behind.  Then integrity (tampered exports), concurrent exports into one cache entry, interrupted
exports, and the BOS convention.

One small checkpoint and one export (max_seq_len 64, nextn 2) are shared by every case; a case copies what
it damages into its own directory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_driver import run_cli
from runtime_models import make_self_drafting

ROOM = 64 - 2 * 2 - 2  # the longest prompt a 64-row cache takes with nextn 2 (one char = one token here)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_self_drafting(tmp_path_factory.mktemp("robust") / "ckpt", nextn=2)


@pytest.fixture(scope="module")
def exp(ckpt, tmp_path_factory):
    from mtp_trt.exporters.export import export

    return export(ckpt, tmp_path_factory.mktemp("robust-exp") / "exp", max_seq_len=64)


def mtp_trt(*args, cache: Path, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    args = [a if isinstance(a, bytes) else str(a) for a in args]
    return subprocess.run(["mtp-trt", *args], capture_output=True, timeout=timeout,
                          env={**os.environ, "MTP_TRT_CACHE_DIR": str(cache)}, **kw)


class Case:
    """What a case may build in its own directory: damaged copies of the checkpoint or the export."""

    def __init__(self, ckpt: Path, exp: Path, tmp: Path):
        self.ckpt, self.exp, self.tmp = ckpt, exp, tmp

    def checkpoint(self, config=None, **changes) -> Path:
        out = self.tmp / "ckpt"
        shutil.copytree(self.ckpt, out)
        raw = json.loads((out / "config.json").read_text()) | changes
        (out / "config.json").write_text(json.dumps(raw if config is None else config))
        return out

    def export(self, sealed: bool = True, **changes) -> Path:
        """A copy of the export with manifest fields changed; `sealed`: its digest made again (as if the exporter
        had written those fields), so that what is checked is the fields themselves."""
        from mtp_trt.manifest import seal

        out = self.tmp / "exp"
        shutil.copytree(self.exp, out)
        raw = json.loads((out / "manifest.json").read_text()) | changes
        (out / "manifest.json").write_text(json.dumps(seal(raw) if sealed else raw))
        return out

    def file(self, name: str, data: bytes | str) -> Path:
        path = self.tmp / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        return path


def _tampered_hash(c):
    from mtp_trt.manifest import seal

    e = c.export()
    raw = json.loads((e / "manifest.json").read_text())
    raw["graphs"]["step_1"]["sha256"] = "0" * 64
    (e / "manifest.json").write_text(json.dumps(seal(raw)))
    return ["run", e, "-p", "x"]


def _flipped_weights(c):
    e = c.export()
    data = bytearray((e / "weights.bin").read_bytes())
    data[len(data) // 2] ^= 1
    (e / "weights.bin").write_bytes(bytes(data))
    return ["run", e, "-p", "x"]


def _mixed_graph(c):
    e = c.export()
    shutil.copyfile(e / "step_1.onnx", e / "step_2.onnx")  # a graph of another export (or another nextn)
    return ["run", e, "-p", "x"]


def _int_tensor(c):
    import torch
    from safetensors.torch import load_file, save_file

    out = c.checkpoint()
    tensors = load_file(out / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    save_file(tensors, out / "model.safetensors")
    return ["export", out, "-o", c.tmp / "out"]


def _unused_tensor(command):
    def make(c):
        import torch
        from safetensors.torch import load_file, save_file

        out = c.checkpoint()
        tensors = load_file(out / "model.safetensors")
        tensors["model.layers.0.self_attn.indexer.wk.weight"] = torch.zeros(8, 64)  # DeepSeek-V3.2's, say
        save_file(tensors, out / "model.safetensors")
        return [command, out, *(["-o", c.tmp / "out"] if command == "export" else ["-p", "x"])]
    return make


def _fewer_mtp_layers(c):
    return ["export", c.checkpoint(num_nextn_predict_layers=5), "-o", c.tmp / "out", "--mtp-mode", "eagle"]


def _no_tokenizer(c):
    out = c.checkpoint()
    (out / "tokenizer.json").unlink()
    return ["run", out, "-p", "x"]


def _bad_tokenizer(command):
    def make(c):
        out = c.checkpoint()
        (out / "tokenizer.json").write_text('{"model": {"type": "Nope"}}')
        return [command, out, *(["-o", c.tmp / "out"] if command == "export" else ["-p", "x"])]
    return make


CASES = [
    # (id, argv builder, exit status, fragment of the message)
    ("config-list-inspect", lambda c: ["inspect", c.checkpoint(config=[1, 2, 3])], 2,
     "config.json: expected a JSON object of model fields, got a list"),
    ("config-list-export", lambda c: ["export", c.checkpoint(config=[1, 2, 3]), "-o", c.tmp / "out"], 2,
     "expected a JSON object of model fields"),
    ("vocab-1e12-inspect", lambda c: ["inspect", c.checkpoint(vocab_size=10**12)], 2,
     "field 'vocab_size' must be at most 2147483647"),
    ("vocab-1e12-export", lambda c: ["export", c.checkpoint(vocab_size=10**12), "-o", c.tmp / "out"], 2,
     "field 'vocab_size' must be at most"),
    ("vocab-beyond-memory", lambda c: ["export", c.checkpoint(vocab_size=2 * 10**9), "-o", c.tmp / "out"], 2,
     "GiB of memory"),
    ("max-position-0", lambda c: ["inspect", c.checkpoint(max_position_embeddings=0)], 2,
     "field 'max_position_embeddings' must be positive"),
    ("bos-out-of-vocab", lambda c: ["inspect", c.checkpoint(bos_token_id=500)], 2, "field 'bos_token_id'"),
    ("rms-norm-eps-nan", lambda c: ["inspect", c.checkpoint(rms_norm_eps=float("nan"))], 2,
     "field 'rms_norm_eps' must be a finite number > 0, got nan"),
    ("q-lora-rank-0", lambda c: ["inspect", c.checkpoint(q_lora_rank=0)], 2, "field 'q_lora_rank' must be positive"),
    ("tokenizer-not-a-tokenizer-export", _bad_tokenizer("export"), 2, "tokenizer.json: not a valid tokenizers file"),
    ("tokenizer-not-a-tokenizer-run", _bad_tokenizer("run"), 2, "tokenizer.json: not a valid tokenizers file"),
    ("no-tokenizer-run", _no_tokenizer, 2, "the checkpoint has no tokenizer.json"),
    ("mtp-layers-missing", _fewer_mtp_layers, 2, "field 'num_nextn_predict_layers' is 5, but the weights hold 2"),
    ("int32-tensor", _int_tensor, 2, "tensor 'model.norm.weight' has dtype int32"),
    ("unused-tensor-export", _unused_tensor("export"), 2, "1 tensor(s) that DeepseekV3ForCausalLM as mtp-trt reads it "
     "does not use: model.layers.0.self_attn.indexer.wk.weight; refusing rather than ignoring them"),
    ("unused-tensor-run", _unused_tensor("run"), 2, "does not use: model.layers.0.self_attn.indexer.wk.weight"),
    ("architecture-unknown", lambda c: ["inspect", c.checkpoint(architectures=["FooForCausalLM"])], 2,
     "config.json: architecture FooForCausalLM is not supported: mtp-trt has no mapping of it onto its reference "
     "model; supported architectures: DeepseekV3ForCausalLM (DeepSeek-V3/R1, Kimi-K2), DeepseekV2ForCausalLM"),
    ("architecture-dsa-run", lambda c: ["run", c.checkpoint(model_type="deepseek_v32"), "-p", "x"], 2,
     "missing tensor(s) model.layers.0.self_attn.indexer.wq_b.weight"),
    ("manifest-dtype", lambda c: ["run", c.export(dtype="fp16"), "-p", "x"], 2,
     "field 'dtype' is 'fp16', but cache.dtype is 'fp32'"),
    ("manifest-nextn", lambda c: ["run", c.export(nextn=9), "-p", "x"], 2, "field 'nextn' is 9"),
    ("manifest-max-seq-len", lambda c: ["run", c.export(max_seq_len=128), "-p", "x"], 2,
     "field 'max_seq_len' is 128, but cache.rows_per_sequence is 64"),
    ("manifest-hash", _tampered_hash, 2, "step_1.onnx: SHA-256 differs from manifest.json"),
    ("weights-flipped", _flipped_weights, 2, "weights.bin: SHA-256 differs from manifest.json"),
    ("graph-from-elsewhere", _mixed_graph, 2, "step_2.onnx: SHA-256 differs"),
    ("prompt-too-long", lambda c: ["run", c.exp, "-p", "a" * (ROOM + 1)], 2,
     f"prompt 0 has {ROOM + 1} tokens, but the export's cache (64 rows, max_seq_len) fits at most {ROOM}"),
    ("prompt-too-long-batch-json", lambda c: ["run", c.exp, "-p", "ok", "-p", "b" * 500, "--json"], 2,
     "prompt 1 has 500 tokens"),
    ("prompt-fits", lambda c: ["run", c.exp, "-p", "a" * ROOM, "--json"], 0, "KV cache full (64 rows"),
    ("prompt-fits-nextn0", lambda c: ["run", c.exp, "-p", "a" * 62, "--nextn", "0", "--json"], 0, '"length"'),
    ("prompt-truncated", lambda c: ["run", c.exp, "-p", "a" * 500, "--truncate", "--max-new-tokens", "2"], 0,
     "truncated to their last tokens"),
    ("prompt-not-utf8", lambda c: ["run", c.exp, "-p", b"abc\xff\xfedef"], 2,
     "--prompt b'abc\\xff\\xfedef': not valid UTF-8 (byte 0xff at offset 3)"),
    ("prompt-file-not-utf8", lambda c: ["run", c.exp, "--prompt-file", c.file("p.txt", b"ok\nab\xffc\n")], 2,
     "p.txt: not UTF-8 text (byte 0xff on line 2)"),
    ("prompt-file-directory", lambda c: ["run", c.exp, "--prompt-file", c.tmp], 2, "is a directory"),
    ("temperature-nan", lambda c: ["run", c.exp, "-p", "x", "--temperature", "nan"], 2,
     "--temperature must be a finite number"),
    ("seed-negative", lambda c: ["run", c.exp, "-p", "x", "--temperature", "0.5", "--seed", "-1"], 2,
     "--seed must be in 0.."),
    ("threads-100000", lambda c: ["run", c.exp, "-p", "x", "--threads", "100000"], 2,
     "(4 per usable core), got 100000"),
    ("stop-empty", lambda c: ["run", c.exp, "-p", "x", "--stop", ""], 2, "--stop must not be empty"),
    ("relaxed-delta-nan", lambda c: ["run", c.exp, "-p", "x", "--relaxed-delta", "nan"], 2,
     "--relaxed-delta must be a finite number"),
    ("top-p-greedy", lambda c: ["run", c.exp, "-p", "x", "--top-p", "0.9"], 2, "--top-p applies only when sampling"),
    ("relaxed-with-sampling", lambda c: ["run", c.exp, "-p", "x", "--relaxed-topk", "3", "--temperature", "1"], 2,
     "--relaxed-topk (relaxed acceptance) applies only to greedy decoding"),
    ("config-bad-json", lambda c: ["run", c.exp, "-p", "x", "--config", c.file("s.json", '{"method": [')], 2,
     "s.json: neither JSON (Expecting value at line 1 column 13) nor YAML"),
    ("config-contradicts-flag", lambda c: ["run", c.exp, "-p", "x", "--nextn", "2", "--config", c.file(
        "s.json", '{"method": "deepseek_mtp", "num_speculative_tokens": 1}')], 2, "--nextn 2 contradicts"),
    ("bos-without-id", lambda c: ["run", c.exp, "-p", "x", "--bos"], 2, "--bos:"),
    ("export-to-proc", lambda c: ["export", c.ckpt, "-o", "/proc/mtp-trt-test"], 2,
     "/proc/mtp-trt-test: cannot create the output directory"),
    ("export-onto-file", lambda c: ["export", c.ckpt, "-o", c.file("f", "x")], 2, "exists and is not a directory"),
    ("bench-batch-0", lambda c: ["bench", c.ckpt, "--batch", "0"], 2, "--batch must be >= 1"),
    ("bench-repeats-0", lambda c: ["bench", c.ckpt, "--repeats", "0"], 2, "--repeats must be >= 1"),
    ("bench-max-new-0", lambda c: ["bench", c.ckpt, "--max-new-tokens", "0"], 2, "--max-new-tokens must be >= 1"),
    ("bench-out-unwritable", lambda c: ["bench", c.ckpt, "--out", "/proc/bench.json"], 2,
     "--out /proc/bench.json: not writable"),
    ("bench-out-no-dir", lambda c: ["bench", c.ckpt, "-o", c.tmp / "no" / "b.json"], 2, "does not exist"),
    ("quant-unknown", lambda c: ["run", c.ckpt, "-p", "x", "--quant", "int3"], 2,
     "--quant: unknown scheme 'int3'; expected one of none, int8, int4"),
    ("group-size-48", lambda c: ["export", c.ckpt, "-o", c.tmp / "out", "--quant", "int4", "--group-size", "48"], 2,
     "--group-size: must be one of 16, 32, 64, 128, 256, got 48"),
    ("group-size-without-quant", lambda c: ["run", c.ckpt, "-p", "x", "--group-size", "64"], 2,
     "--group-size needs --quant int8 or --quant int4"),
    ("quant-of-an-export", lambda c: ["run", c.exp, "-p", "x", "--quant", "int8"], 2,
     "exported with --quant none, but --quant int8 was asked"),
    ("quant-without-cpu-ops", lambda c: ["export", c.ckpt, "-o", c.tmp / "out", "--quant", "int4", "--no-cpu-ops"],
     2, "--quant int4: quantized weights run on mtp-trt's CPU operators; drop --no-cpu-ops"),
    ("manifest-quant-int5", lambda c: ["run", c.export(quant={"scheme": "int5"}), "-p", "x"], 2,
     "field 'quant' is {'scheme': 'int5'}, not a quantization this mtp-trt reads"),
]


def assert_one_error(err: str) -> None:
    """stderr ends in one `error:` line, after at most the progress lines a non-terminal shows, no traceback."""
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), err
    assert "Traceback" not in err and sum(line.startswith("error") for line in lines) == 1, err


def _tree(*roots: Path) -> set[Path]:
    """Every path under the roots, but the cache's verification records and lock files (kept by design)."""
    out = set()
    for root in roots:
        for p in root.rglob("*"):
            if not ({"verified", "locks"} & set(p.relative_to(root).parts)):
                out.add(p)
    return out


@pytest.mark.parametrize("name,make,code,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input(ckpt, exp, tmp_path, name, make, code, message):
    cache = tmp_path / "cache"
    work = tmp_path / "work"
    work.mkdir()
    argv = make(Case(ckpt, exp, work))
    before = _tree(work, exp, ckpt)
    r = mtp_trt(*argv, cache=cache)
    out, err = r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")
    assert r.returncode == code, err + out
    assert "Traceback" not in err
    if code == 2:
        assert_one_error(err)
        assert message in err, err
        assert out == "", out  # nothing printed, not even with --json
    else:
        assert message in err + out
    assert _tree(work, exp, ckpt) == before  # nothing written beside the inputs
    if cache.exists():  # nothing half-written in the cache either
        assert not [p for p in _tree(cache) if ".partial-" in p.name]
        assert code == 0 or not (cache / "exports").exists() or not any((cache / "exports").iterdir())


def test_inspect_reports_stored_mtp_modules_and_bos(ckpt, tmp_path):
    c = Case(ckpt, None, tmp_path)
    r = mtp_trt("inspect", c.checkpoint(num_nextn_predict_layers=5), cache=tmp_path / "cache", text=True)
    assert r.returncode == 0, r.stderr
    assert "MTP modules   5 in config.json, but 2 stored in the weights" in r.stdout
    assert "BOS           none (neither the tokenizer nor the config's bos_token_id names one)" in r.stdout


# ------------------------------------------------------------------------------------------ integrity
def test_verification_is_remembered_until_a_file_changes(exp, tmp_path, monkeypatch):
    """The first check hashes every file; later ones only stat them; a file rewritten with the same size and
    mtime (but a new ctime) is hashed again and the change found; --verify (force) hashes everything."""
    from mtp_trt.errors import MtpTrtError
    from mtp_trt.manifest import Manifest, verify_export

    monkeypatch.setenv("MTP_TRT_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "exp"
    shutil.copytree(exp, root)
    m = Manifest.load(root)
    first = verify_export(m)
    files = len(m.graphs) + 1 + len(m.raw["tokenizer_files"])  # graphs, weights.bin, tokenizer files
    assert files == 8  # target, mtp_0, step_0..2, tree_2_2_4, weights.bin, tokenizer.json
    assert first["hashed"] == first["files"] == files
    assert verify_export(m)["hashed"] == 0
    assert verify_export(m, force=True)["hashed"] == files
    w = root / "weights.bin"
    st = w.stat()
    data = bytearray(w.read_bytes())
    data[100] ^= 0xFF
    w.write_bytes(bytes(data))
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: only ctime tells
    with pytest.raises(MtpTrtError, match="weights.bin: SHA-256 differs from manifest.json"):
        verify_export(m)
    data[100] ^= 0xFF
    w.write_bytes(bytes(data))
    assert verify_export(m)["hashed"] == 1  # the restored file, once


def test_export_cache_key_follows_the_checkpoints_contents(ckpt, tmp_path, monkeypatch):
    """A checkpoint whose weights are replaced by a file of the same size and mtime gets a new cache entry (its
    export is not reused); a file touched without a change keeps the entry; the files are read again only when
    one of them changes."""
    import mtp_trt.manifest as manifest
    from mtp_trt.quant import Scheme
    from mtp_trt.runner import DEFAULT_MAX_BATCH, cache_entry

    monkeypatch.setenv("MTP_TRT_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "ckpt"
    shutil.copytree(ckpt, root)
    hashed = []
    real_sha = manifest.sha256
    monkeypatch.setattr(manifest, "sha256", lambda path: hashed.append(path.name) or real_sha(path))
    entry = cache_entry(root, "eagle", Scheme(), DEFAULT_MAX_BATCH)
    files = sorted(f.name for f in root.iterdir() if f.is_file())
    assert sorted(hashed) == files
    hashed.clear()
    assert cache_entry(root, "eagle", Scheme(), DEFAULT_MAX_BATCH) == entry and hashed == []
    w = next(root.glob("*.safetensors"))
    st = w.stat()
    data = bytearray(w.read_bytes())
    data[-1] ^= 0x01
    w.write_bytes(bytes(data))
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))  # same name, size and mtime
    changed = cache_entry(root, "eagle", Scheme(), DEFAULT_MAX_BATCH)
    assert changed != entry and hashed == [w.name]
    data[-1] ^= 0x01
    w.write_bytes(bytes(data))  # back as it was, with a new mtime
    assert cache_entry(root, "eagle", Scheme(), DEFAULT_MAX_BATCH) == entry


_WATCH_TOKENIZER = r"""
import mtp_trt.tokenizer as _t
_encode, _calls = _t.encode, [0]
def _watched(tokenizer, text, policy):
    _calls[0] += 1
    if len(text) > 1_000_000 or _calls[0] > 10_000:
        raise AssertionError(f"tokenized: {len(text)} characters, call {_calls[0]}")
    return _encode(tokenizer, text, policy)
_t.encode = _watched
"""


def test_huge_prompts_are_refused_before_they_are_tokenized(exp, tmp_path):
    """A 50 MB one-line prompt file is refused by its length in one line, not tokenized (which took gigabytes);
    with --truncate only its end is tokenized; two million prompts are refused for the export's batch before
    one is tokenized."""
    big, many = tmp_path / "big.txt", tmp_path / "many.txt"
    big.write_text("ab " * 17_000_000 + "\n")
    many.write_text("a\n" * 2_000_000)
    (code, err, _), (tcode, terr, tout), (mcode, merr, _) = run_cli(
        [["run", exp, "--prompt-file", big, "--max-new-tokens", "2"],
         ["run", exp, "--prompt-file", big, "--max-new-tokens", "2", "--truncate"],
         ["run", exp, "--prompt-file", many, "--max-new-tokens", "2"]],
        tmp_path / "cache", _LIMIT + _WATCH_TOKENIZER, str(MEMORY_LIMIT))
    assert code == 2 and "prompt 0 has 51000000 characters" in err and "--truncate" in err, err
    assert_one_error(err)
    assert tcode == 0 and "truncated to their last tokens" in terr, terr
    assert mcode == 2 and "2000000 prompts, but the export" in merr, merr
    assert_one_error(merr)


_TOKENIZER_IN_C = r"""
import ctypes, sys
import mtp_trt.tokenizer as t
def _encode_in_c(tokenizer, text, policy):
    # as a tokenizer's long call into native code: the GIL released, no signal handler run until it returns
    sys.stderr.write("tokenizing\n"); sys.stderr.flush()
    mutex, libc = ctypes.create_string_buffer(64), ctypes.CDLL(None)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)  # a second lock by its owner: blocks for good, and no signal interrupts it
t.encode = _encode_in_c
from mtp_trt.cli import entry
sys.argv = ["mtp-trt", *sys.argv[1:]]
sys.exit(entry())
"""


def test_sigterm_is_acted_on_while_a_prompt_is_tokenized(exp, tmp_path):
    """SIGTERM while the tokenizer works (in native code, as on a long prompt): the command ends at once (status
    143, no traceback), without waiting for the tokenizer to return."""
    p = subprocess.Popen([sys.executable, "-c", _TOKENIZER_IN_C, "run", str(exp), "-p", "abc", "--max-new-tokens",
                          "2"], stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "MTP_TRT_CACHE_DIR": str(tmp_path / "cache")})
    try:
        assert p.stderr.readline() == "tokenizing\n"
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 128 + signal.SIGTERM
        assert "Traceback" not in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_run_verify_flag_hashes_again(exp, tmp_path):
    cache = tmp_path / "cache"
    for extra in ((), ("--verify",)):
        r = mtp_trt("run", exp, "-p", "x", "--max-new-tokens", "2", *extra, cache=cache, text=True)
        assert r.returncode == 0, r.stderr
    assert len(list((cache / "verified").iterdir())) == 1


# ------------------------------------------------------------------------------ concurrency, interrupts
def _partials(*dirs: Path) -> list[Path]:
    return [p for d in dirs if d.exists() for p in d.iterdir() if ".partial-" in p.name]


def test_three_runs_share_one_export_of_an_empty_cache(ckpt, tmp_path):
    """Three `mtp-trt run`s on one checkpoint and an empty cache at once: one exports, the others wait for it
    and reuse its entry; all succeed with the same text and leave one entry, no partial directory."""
    cache = tmp_path / "cache"
    env = {**os.environ, "MTP_TRT_CACHE_DIR": str(cache)}
    procs = [subprocess.Popen(["mtp-trt", "run", str(ckpt), "-p", "def f(x):", "--max-new-tokens", "6",
                               "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(3)]
    results = [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs]
    for code, out, err in results:
        assert code == 0, err
    assert len({out for _, out, _ in results}) == 1
    assert sum("exporting target.onnx" in err for _, _, err in results) == 1
    entries = list((cache / "exports").iterdir())
    assert len(entries) == 1 and (entries[0] / "manifest.json").is_file(), entries


def _wait_for(predicate, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.05)


@pytest.mark.slow
def test_killed_export_is_cleaned_up_by_the_next_run(ckpt, tmp_path):
    """SIGKILL while the first run exports: its partial directory outlives it; the next run removes it,
    exports and succeeds, leaving one entry."""
    cache = tmp_path / "cache"
    exports = cache / "exports"
    env = {**os.environ, "MTP_TRT_CACHE_DIR": str(cache)}
    p = subprocess.Popen(["mtp-trt", "run", str(ckpt), "-p", "x"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env=env)
    _wait_for(lambda: any((d / "target.onnx").exists() for d in _partials(exports)))
    p.send_signal(signal.SIGKILL)
    p.wait()
    left = _partials(exports)
    assert left and not [e for e in exports.iterdir() if ".partial-" not in e.name]
    r = mtp_trt("run", ckpt, "-p", "x", "--max-new-tokens", "2", cache=cache, text=True)
    assert r.returncode == 0, r.stderr
    assert not _partials(exports) and not any(d.exists() for d in left)
    assert len(list(exports.iterdir())) == 1


@pytest.mark.slow
def test_terminated_export_leaves_nothing(ckpt, tmp_path):
    """SIGTERM midway through `mtp-trt export`: the partial directory goes with the process."""
    out = tmp_path / "out"
    p = subprocess.Popen(["mtp-trt", "export", str(ckpt), "-o", str(out)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    _wait_for(lambda: any((d / "target.onnx").exists() for d in _partials(tmp_path)))
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_a_live_partial_directory_is_never_removed(tmp_path):
    from mtp_trt.fsutil import LEGACY_PARTIAL_AGE_S, atomic_directory, remove_stale_partials

    with atomic_directory(tmp_path / "out") as tmp:
        (tmp / "x").write_text("x")
        # another process's view: its lock is held, so nothing is stale
        code = (f"from pathlib import Path; from mtp_trt.fsutil import remove_stale_partials as r; "
                f"print(len(r(Path({str(tmp_path)!r}))))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert r.stdout.strip() == "0" and tmp.is_dir(), r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    dead = tmp_path / ".again.partial-xyz"  # a killed owner's: its lock file is there, but nobody holds it
    dead.mkdir()
    (dead / "target.onnx").write_text("x")
    dead.with_name(dead.name + ".lock").touch()
    with atomic_directory(tmp_path / "again") as tmp:  # the next export to the same output removes it
        assert not dead.exists() and tmp.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "out"]
    legacy = tmp_path / ".old.partial-abc"  # an older mtp-trt's, without a lock file: removed once old
    legacy.mkdir()
    assert remove_stale_partials(tmp_path) == [] and legacy.exists()
    os.utime(legacy, (time.time() - LEGACY_PARTIAL_AGE_S - 1,) * 2)
    assert remove_stale_partials(tmp_path) == [legacy] and not legacy.exists()


# ------------------------------------------------------------------------------------------------ BOS
@pytest.mark.parametrize("tokenizer_config,post_processor,flag,expected,source", [
    (None, False, None, [94, 0], "config bos_token_id"),
    ({"add_bos_token": False}, False, None, [0], "tokenizer_config.json add_bos_token false"),
    ({"add_bos_token": True}, True, None, [94, 0], "tokenizer_config.json add_bos_token true"),
    (None, True, None, [94, 0], "post-processor"),
    ({"add_bos_token": True}, False, False, [0], "--no-bos"),
    (None, True, False, [0], "--no-bos"),
    ({"add_bos_token": False}, False, True, [94, 0], "--bos"),
])
def test_bos_follows_the_tokenizer(tmp_path, tokenizer_config, post_processor, flag, expected, source):
    """BOS as Hugging Face decides it: the flag, then tokenizer_config.json's add_bos_token, then the
    post-processor, then (neither says) the config's bos_token_id; never twice."""
    from tokenizers import processors

    from mtp_trt.tokenizer import bos_policy, encode, load_tokenizer
    from runtime_models import write_char_tokenizer

    write_char_tokenizer(tmp_path / "tokenizer.json")
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    if post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 94)])
        tok.save(str(tmp_path / "tokenizer.json"))
    if tokenizer_config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    policy = bos_policy(tmp_path, 94, tok, flag)
    assert encode(tok, "a", policy) == expected and source in policy.describe()


def test_inspect_and_run_follow_add_bos_token(ckpt, exp, tmp_path, monkeypatch):
    """A checkpoint whose tokenizer_config.json says add_bos_token false gets no BOS, though its config names
    one; inspect says so; --bos puts it back."""
    from mtp_trt.manifest import Manifest
    from mtp_trt.runner import Runner

    monkeypatch.setenv("MTP_TRT_CACHE_DIR", str(tmp_path / "cache"))  # the Runner records its verification

    c = Case(ckpt, exp, tmp_path)
    out = c.checkpoint(bos_token_id=94)
    (out / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    r = mtp_trt("inspect", out, cache=tmp_path / "cache", text=True)
    assert "BOS           none (tokenizer_config.json add_bos_token false)" in r.stdout, r.stdout + r.stderr
    raw = json.loads((exp / "manifest.json").read_text())
    e = c.export(config={**raw["config"], "bos_token_id": 94})  # as exported from that checkpoint
    runner = Runner(Manifest.load(e))
    assert runner.encode("ab") == [94, 0, 1]  # the config's BOS: the tokenizer says nothing
    long = runner.encode("a" * 100)
    assert runner.fit([long], 2, truncate=True) == [[94] + long[-(ROOM - 1):]]  # BOS first, then the last tokens
    shutil.copyfile(out / "tokenizer_config.json", e / "tokenizer_config.json")
    assert Runner(Manifest.load(e)).encode("ab") == [0, 1]
    assert Runner(Manifest.load(e), bos=True).encode("ab") == [94, 0, 1]


def test_an_unwritable_cache_is_named(ckpt, tmp_path):
    r = mtp_trt("run", ckpt, "-p", "x", cache=Path("/proc/mtp-trt-cache"), text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: /proc/mtp-trt-cache: cannot write the cache directory")


# ===================================================================== second round: families of bad input
# Each family is a generator of cases; every case must end in one `error:` line (exit status 2) naming the file,
# field, flag or value, leave nothing behind, and stay within a memory limit.  The cheap checks run in-process
# (their CLI path is one call away: clear_errors); a few cases of each family go through the CLI, batched into
# one interpreter under an address-space limit (RLIMIT_AS).
MEMORY_LIMIT = 6 << 30

_LIMIT = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]),) * 2)
"""


def cli_batch(cases: list[list], cache: Path, limit: int = MEMORY_LIMIT) -> list[tuple[int, str, str]]:
    """Run many `mtp-trt` command lines in one interpreter under RLIMIT_AS = limit: [(status, stderr, stdout)]."""
    return run_cli(cases, cache, _LIMIT, str(limit))


def expect_errors(cases: list[tuple[list, str]], cache: Path, *watched: Path) -> None:
    """Every (argv, fragment): status 2, one error line holding the fragment, nothing new under `watched`."""
    before = _tree(*watched)
    for (argv, fragment), (code, err, out) in zip(cases, cli_batch([a for a, _ in cases], cache)):
        assert code == 2, (argv, code, err, out)
        assert_one_error(err)
        assert fragment in err, (argv, err)
    assert _tree(*watched) == before
    assert not [p for p in _tree(cache) if ".partial-" in p.name] if cache.exists() else True


def _raises(fn, *fragments):
    from mtp_trt.errors import MtpTrtError

    with pytest.raises(MtpTrtError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg and all(f in msg for f in fragments), msg
    return msg


# ---------------------------------------------------------------------------------- 1. one JSON reader
DEEP = 200_000


def _malformed_documents():
    """(label, text, fragment): nesting, number size, non-JSON, non-UTF-8."""
    yield "array-deep", "[" * DEEP + "]" * DEEP, "nested more than 64 levels"
    yield "object-deep", '{"a":' * DEEP + "1" + "}" * DEEP, "nested more than 64 levels"
    yield "object-65", '{"a":' * 65 + "1" + "}" * 65, "nested more than 64 levels"
    for digits in (21, 400, 5000, 100_000):
        yield f"int-{digits}", '{"vocab_size": ' + "9" * digits + "}", f"an integer of {digits} digits on line 1"
    yield "neg-int", '{"x": [\n -' + "1" * 30 + "]}", "an integer of 30 digits on line 2"
    yield "truncated", '{"a": [1, 2', "not valid JSON"
    yield "latin-1", b'{"a": "\xe9"}', "not UTF-8 text (byte 0xe9"


def test_json_reader_limits(tmp_path):
    from mtp_trt.fsutil import read_json

    for label, text, fragment in _malformed_documents():
        f = tmp_path / f"{label}.json"
        f.write_bytes(text if isinstance(text, bytes) else text.encode())
        _raises(lambda: read_json(f), str(f), fragment)
    ok = tmp_path / "ok.json"
    ok.write_text('{"n": -99999999999999999999, "a": ' + "[" * 63 + "1" + "]" * 63 + "}")
    read_json(ok)  # 64 levels and 20 digits are read


# every JSON file the tool reads, and how to read it (the reader each command calls)
def _readers(ckpt: Path, exp: Path, tmp: Path):
    from mtp_trt.config import ModelConfig
    from mtp_trt.manifest import Manifest
    from mtp_trt.spec_config import load_spec_config
    from mtp_trt.tokenizer import bos_policy
    from mtp_trt.trt.manifest import EngineManifest, load_export_manifest
    from mtp_trt.validate import safetensors_files

    def place(name: str, root: Path, text: bytes, fmt: dict | None = None):
        if fmt is not None:  # a manifest: its format fields first, so that the damaged body is what is read
            head = json.dumps(fmt)[:-1].encode() + b', "x": '
            text = head + text + b"}"
        (root / name).write_bytes(text)
        return root / name

    def checkpoint_dir():
        d = tmp / f"ckpt-{len(list(tmp.iterdir()))}"
        shutil.copytree(ckpt, d)
        return d

    def export_dir():
        d = tmp / f"exp-{len(list(tmp.iterdir()))}"
        shutil.copytree(exp, d)
        return d

    export_fmt = {"format": "mtp-trt-export", "format_version": 1}
    engines_fmt = {"format": "mtp-trt-engines", "format_version": 2}

    def config(text):
        d = checkpoint_dir()
        return place("config.json", d, text), lambda: ModelConfig.from_file(d)

    def manifest(text):
        d = export_dir()
        return place("manifest.json", d, text, export_fmt), lambda: Manifest.load(d)

    def engines(text):
        d = export_dir()
        return place("engines.json", d, text, engines_fmt), lambda: EngineManifest.load(d)

    def export_manifest(text):
        d = export_dir()
        return place("export_manifest.json", d, text, export_fmt), lambda: load_export_manifest(d)

    def spec(text):
        f = place(f"spec-{len(list(tmp.iterdir()))}.json", tmp, text)
        return f, lambda: load_spec_config(f)

    def index(text):
        d = checkpoint_dir()
        return place("model.safetensors.index.json", d, text), lambda: safetensors_files(d)

    def header(text):
        d = checkpoint_dir()
        f = d / "model.safetensors"
        f.write_bytes(len(text).to_bytes(8, "little") + text + b"\0" * 64)
        return f, lambda: safetensors_files(d)

    def tokenizer_config(text):
        d = checkpoint_dir()
        return place("tokenizer_config.json", d, text), lambda: bos_policy(d, None)

    return {"config.json": config, "manifest.json": manifest, "engines.json": engines,
            "export_manifest.json": export_manifest, "--config": spec, "index": index, "safetensors-header": header,
            "tokenizer_config.json": tokenizer_config}


@pytest.mark.parametrize("reader", ["config.json", "manifest.json", "engines.json", "export_manifest.json", "--config",
                                    "index", "safetensors-header", "tokenizer_config.json"])
def test_every_json_file_goes_through_the_reader(ckpt, exp, tmp_path, reader):
    """Each file the tool reads: 200,000-deep nesting, 5,000-digit integers and broken JSON are one error naming
    the file, whichever file it is."""
    make = _readers(ckpt, exp, tmp_path)[reader]
    for label, text, fragment in _malformed_documents():
        if reader == "--config" and label == "truncated":
            fragment = "neither JSON"  # then tried as YAML
        if reader == "--config" and label == "latin-1":
            fragment = "not UTF-8 text"
        path, read = make(text if isinstance(text, bytes) else text.encode())
        _raises(read, str(path), fragment)


def _manifest_field_cases():
    """(label, change to the manifest, field named): wrong types, nulls, strings for numbers, non-finite."""
    yield "tokenizer-int", {"tokenizer": 5}, "field 'tokenizer' must be a plain file name"
    yield "weights-bytes-str", {"weights": {"file": "weights.bin", "sha256": "0" * 64, "bytes": "abc"}}, \
        "field 'weights.bytes' must be an integer >= 0"
    yield "think-ids-empty", {"think_ids": []}, "field 'think_ids' must be a list of 2"
    yield "eos-ids-str", {"eos_ids": "2"}, "field 'eos_ids' must be a list, each an integer >= 0"
    yield "eos-ids-beyond", {"eos_ids": [10**9]}, "field 'eos_ids' is [1000000000], but the config's vocab_size"
    yield "nextn-null", {"nextn": None}, "field 'nextn' must be an integer >= 0, got None"
    yield "nextn-float", {"nextn": 1.5}, "field 'nextn' must be an integer >= 0, got 1.5"
    yield "max-batch-bool", {"max_batch": True}, "field 'max_batch' must be an integer >= 1, got True"
    yield "max-seq-len-str", {"max_seq_len": "64"}, "field 'max_seq_len' must be an integer >= 1"
    yield "graphs-list", {"graphs": []}, "field 'graphs' must be an object"
    yield "mode-unknown", {"mtp_mode": "medusa"}, "field 'mtp_mode' must be one of"
    yield "trees-str", {"trees": "2:2:4"}, "field 'trees' must be a list"
    yield "config-null", {"config": None}, "field 'config' must be an object, got None"
    yield "quant-block-str", {"quant": {"scheme": "int8", "block_size": "32"}}, "field 'quant.block_size'"


def _config_field_cases():
    """(label, change to config.json, field named)."""
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    for key in ("factor", "beta_fast", "mscale", "mscale_all_dim"):
        yield f"yarn-{key}-null", {"rope_scaling": {**yarn, key: None}}, f"rope_scaling.{key}"
        yield f"yarn-{key}-str", {"rope_scaling": {**yarn, key: "1.0"}}, f"field 'rope_scaling.{key}' must be a number"
        yield f"yarn-{key}-inf", {"rope_scaling": {**yarn, key: float("inf")}}, f"rope_scaling.{key}' must be a finite"
    for v in ("4096", None, 1.5, True, 10**12):
        yield f"yarn-omax-{v!r}", {"rope_scaling": {**yarn, "original_max_position_embeddings": v}}, \
            "rope_scaling.original_max_position_embeddings"
    for v in ("big", [1], True, float("inf")):
        yield f"theta-{v!r}", {"rope_theta": v}, "field 'rope_theta' must be a finite number > 0"
    for field in ("hidden_size", "num_hidden_layers", "vocab_size", "kv_lora_rank"):
        yield f"{field}-str", {field: "8"}, f"field '{field}' must be an integer"
        yield f"{field}-float", {field: 8.5}, f"field '{field}' must be an integer"
    yield "eos-str", {"eos_token_id": "1"}, "field 'eos_token_id' must be a token id"
    yield "rms-inf", {"rms_norm_eps": float("inf")}, "field 'rms_norm_eps' must be a finite number > 0"


def test_manifest_fields_are_typed(exp, tmp_path):
    from mtp_trt.manifest import Manifest, seal

    raw = json.loads((exp / "manifest.json").read_text())
    for label, change, fragment in _manifest_field_cases():
        d = tmp_path / label
        d.mkdir()
        for f in exp.iterdir():
            (d / f.name).symlink_to(f)
        (d / "manifest.json").unlink()
        (d / "manifest.json").write_text(json.dumps(seal(raw | change)))
        _raises(lambda: Manifest.load(d), str(d / "manifest.json"), fragment)


def test_config_fields_are_typed(ckpt):
    from mtp_trt.config import ModelConfig

    raw = json.loads((ckpt / "config.json").read_text())
    raw.pop("rope_parameters")  # the official checkpoints' spelling: rope_theta + rope_scaling
    for label, change, fragment in _config_field_cases():
        _raises(lambda: ModelConfig.from_dict(raw | change, source="cfg.json"), "cfg.json", fragment)


def test_json_families_through_the_cli(ckpt, exp, tmp_path):
    """One case of each reader through the command that reads it, under the memory limit."""
    c = Case(ckpt, exp, tmp_path / "work")
    (tmp_path / "work").mkdir()
    deep = "[" * DEEP + "]" * DEEP
    cfg = tmp_path / "deepcfg"
    shutil.copytree(ckpt, cfg)
    (cfg / "config.json").write_text('{"vocab_size": ' + deep + "}")
    digits = tmp_path / "digits"
    shutil.copytree(ckpt, digits)
    (digits / "config.json").write_text('{"vocab_size": ' + "7" * 5000 + "}")
    yarn = tmp_path / "yarn"
    shutil.copytree(ckpt, yarn)
    raw = json.loads((ckpt / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": None}
    (yarn / "config.json").write_text(json.dumps(raw))
    spec = c.file("spec.json", deep)
    man = tmp_path / "man"
    shutil.copytree(exp, man)
    (man / "manifest.json").write_text(json.dumps(json.loads((exp / "manifest.json").read_text()) | {"tokenizer": 5}))
    cases = [(["inspect", cfg], "nested more than 64 levels"), (["inspect", digits], "an integer of 5000 digits"),
             (["inspect", yarn], "rope_parameters.factor' is missing"),
             (["run", exp, "-p", "x", "--config", spec], "spec.json: nested more than 64 levels"),
             (["run", man, "-p", "x"], "field 'tokenizer' must be a plain file name, got 5")]
    expect_errors(cases, tmp_path / "cache", tmp_path / "work", exp, ckpt)


# -------------------------------------------------------------------------------- 2. bounds before work
def _bounds_cases(c: Case):
    """Sizes from flags and configs far beyond what they imply: refused before any allocation or output."""
    out = c.tmp / "out"
    for trees, fragment in (("1:100000:100000", "top-k must be in 2..16"), ("1:2:100000", "budget must be in 1..2"),
                            ("3:16:1000", "at most 128 nodes"), ("99:2:4", "depth (--nextn) must be at most 16"),
                            ("1:" + "9" * 5000 + ":2", "expected DEPTH:TOPK:BUDGET")):
        yield ["export", c.ckpt, "-o", out, "--trees", trees], fragment
    for nextn in (17, 1000000):
        yield ["export", c.ckpt, "-o", out, "--nextn", nextn], f"--nextn must be in 0..16"
    yield ["export", c.ckpt, "-o", out, "--max-batch", 10**9], "--max-batch 1000000000 x --max-seq-len"
    yield ["export", c.ckpt, "-o", out, "--max-seq-len", 5, "--nextn", 2], "--max-seq-len 5 leaves no room"
    for field, value in (("num_hidden_layers", 10**9), ("n_routed_experts", 10**6), ("num_attention_heads", 10**5),
                         ("num_nextn_predict_layers", 1000)):
        yield ["inspect", _fresh(c, field, value)], f"field '{field}' is {value}, more than the"
    yield ["bench", c.ckpt, "--batch", 100000, "--repeats", 1], "--batch 100000 x --max-new-tokens 128"
    yield ["run", c.exp, *[a for i in range(9) for a in ("-p", f"p{i}")]], "9 prompts, but the export"
    yield ["run", c.exp, "-p", "x", "--relaxed-topk", 2**40], "must be in 0..2147483647"


def _fresh(c: Case, field: str, value) -> Path:
    out = c.tmp / f"ckpt-{field}"
    shutil.copytree(c.ckpt, out)
    raw = json.loads((out / "config.json").read_text()) | {field: value}
    (out / "config.json").write_text(json.dumps(raw))
    return out


def test_bounds_before_work(ckpt, exp, tmp_path):
    """Each case under a 6 GiB address-space limit: the bound is named before anything is allocated (a case that
    allocated first would end in MemoryError, not the message) and nothing is written."""
    (tmp_path / "work").mkdir()
    c = Case(ckpt, exp, tmp_path / "work")
    expect_errors(list(_bounds_cases(c)), tmp_path / "cache", tmp_path / "work", exp, ckpt)


def test_inspect_computes_its_figures(ckpt, tmp_path):
    """A config of 1000 layers (within bounds) is summarized by counting, as is_moe_layer would one by one."""
    from mtp_trt.config import ModelConfig

    raw = json.loads((ckpt / "config.json").read_text())
    for n, k, freq in ((1000, 3, 1), (1000, 0, 2), (7, 9, 3), (1, 0, 1)):
        cfg = ModelConfig.from_dict(raw | {"num_hidden_layers": n, "first_k_dense_replace": k, "moe_layer_freq": freq,
                                           "n_routed_experts": raw.get("n_routed_experts") or 4,
                                           "moe_intermediate_size": 8, "n_group": 1, "topk_group": 1,
                                           "num_experts_per_tok": 1})
        for layers in (0, 1, n, n + 3):
            assert cfg.moe_layers(layers) == sum(cfg.is_moe_layer(i) for i in range(layers))


# ------------------------------------------------------------------------------------------ 3. integrity
def _integrity_cases(c: Case, base: Path):
    """Every file or field that decides the output, changed after export: refused by run (and run --verify)."""
    from mtp_trt.manifest import seal

    def copy(label):
        d = base / label
        shutil.copytree(c.exp, d)
        return d

    def edit_manifest(d, fn, sealed=False):
        raw = json.loads((d / "manifest.json").read_text())
        fn(raw)
        (d / "manifest.json").write_text(json.dumps(seal(raw) if sealed else raw))
        return d

    d = copy("tokenizer-edited")
    tok = json.loads((d / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, other text
    (d / "tokenizer.json").write_text(json.dumps(tok))
    yield [d], "tokenizer.json: SHA-256 differs from manifest.json"
    d = copy("table-edited")

    def move_a_tensor(raw):  # another tensor's bytes for one of target.onnx's weights
        rows = raw["weights"]["initializers"]["target.onnx"]
        row = next(r for r in rows if r[1] > 0)
        row[1] = 0

    yield [edit_manifest(d, move_a_tensor)], "SHA-256 of its fields differs from its field 'manifest_sha256'"
    d = copy("eos-edited")
    yield [edit_manifest(d, lambda r: r.__setitem__("eos_ids", [3]))], "the manifest was edited"
    d = copy("config-edited")
    yield [edit_manifest(d, lambda r: r["config"].__setitem__("rms_norm_eps", 0.5))], "the manifest was edited"
    d = copy("unsealed")
    yield [edit_manifest(d, lambda r: r.pop("manifest_sha256"))], "has no field 'manifest_sha256'"
    d = copy("tokenizer-beyond-vocab")
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["model"]["vocab"]["<far>"] = 10**6
    (d / "tokenizer.json").write_text(json.dumps(tok))
    edit_manifest(d, lambda r: r["tokenizer_files"].__setitem__("tokenizer.json", sha256_of(d / "tokenizer.json")),
                  sealed=True)
    yield [d], "tokenizer.json: holds token ids up to 1000000, but the model's vocab_size is"
    k = base / "ckpt-tokenizer-beyond-vocab"  # and at export, from a checkpoint
    shutil.copytree(c.ckpt, k)
    shutil.copyfile(d / "tokenizer.json", k / "tokenizer.json")
    yield [k], "tokenizer.json: holds token ids up to 1000000"


def sha256_of(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_integrity_covers_everything_that_decides_the_output(ckpt, exp, tmp_path):
    (tmp_path / "work").mkdir()
    (tmp_path / "exps").mkdir()
    c = Case(ckpt, exp, tmp_path / "work")
    cases = []
    for argv, fragment in _integrity_cases(c, tmp_path / "exps"):
        cases += [(["run", *argv, "-p", "x"], fragment), (["run", *argv, "-p", "x", "--verify"], fragment)]
    expect_errors(cases, tmp_path / "cache", tmp_path / "work", exp, ckpt)


def test_non_finite_weights_are_refused_at_export(ckpt, tmp_path):
    """A NaN or an infinity in a tensor (the embedding, an attention projection, an MTP module's norm): the
    export names it and leaves no output."""
    from safetensors.torch import load_file, save_file

    c = Case(ckpt, None, tmp_path)
    out = c.checkpoint()
    tensors = load_file(out / "model.safetensors")
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
             f"model.layers.{json.loads((out / 'config.json').read_text())['num_hidden_layers']}.enorm.weight"]
    cases = []
    for i, (name, value) in enumerate(zip(names, (float("nan"), float("inf"), float("-inf")))):
        d = tmp_path / f"ckpt-{i}"
        shutil.copytree(out, d)
        damaged = dict(tensors)
        damaged[name] = tensors[name].clone()
        damaged[name].view(-1)[i] = value
        save_file(damaged, d / "model.safetensors")
        cases.append((["export", d, "-o", tmp_path / f"out-{i}"], f"tensor '{name}' holds 1 NaN or infinite value"))
    expect_errors(cases, tmp_path / "cache", *(tmp_path / f"ckpt-{i}" for i in range(len(names))))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out-") or ".partial-" in p.name]


# ------------------------------------------------------------------------------------------------ 4. paths
def test_paths_read_from_files_stay_inside_their_directory(ckpt, exp, tmp_path):
    from mtp_trt.manifest import Manifest, seal
    from mtp_trt.validate import safetensors_files

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "tokenizer.json").write_text("{}")
    (outside / "x.safetensors").write_bytes(b"")
    names = ["../outside/tokenizer.json", str(outside / "tokenizer.json"), "a/../../outside/x", "..", ".", "",
             "sub/tokenizer.json", "tok\x00.json"]
    raw = json.loads((exp / "manifest.json").read_text())
    for i, name in enumerate(names):  # the manifest's tokenizer, tokenizer files and graph files
        d = tmp_path / f"exp-files-{i}"
        shutil.copytree(exp, d)
        (d / "manifest.json").write_text(json.dumps(seal(raw | {"tokenizer_files": {name: "0" * 64}})))
        _raises(lambda: Manifest.load(d), "field 'tokenizer_files'")
        for field in ("tokenizer", "graph"):
            d = tmp_path / f"exp-{field}-{i}"
            shutil.copytree(exp, d)
            if field == "tokenizer":
                changed, named = raw | {"tokenizer": name}, "field 'tokenizer' must be a plain file name"
            else:
                graphs = {**raw["graphs"], "target": {**raw["graphs"]["target"], "file": name}}
                changed, named = raw | {"graphs": graphs}, "field 'graphs.target.file' must be a plain file name"
            (d / "manifest.json").write_text(json.dumps(seal(changed)))
            _raises(lambda: Manifest.load(d), named)
    link = tmp_path / "ckpt-link"  # an index whose shard is a link out of the checkpoint
    shutil.copytree(ckpt, link)
    (link / "out.safetensors").symlink_to(outside / "x.safetensors")
    for i, name in enumerate(["../outside/x.safetensors", str(outside / "x.safetensors"), "out.safetensors"]):
        d = link if name == "out.safetensors" else tmp_path / f"ckpt-index-{i}"
        if d != link:
            shutil.copytree(ckpt, d)
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": name}}))
        _raises(lambda: safetensors_files(d), "weight_map names shard", "refusing to read outside it")


# ------------------------------------------------------------------------------------------------ 5. output
def test_streamed_text_is_cut_as_json_text(exp, tmp_path, monkeypatch):
    """Every stop string drawn from the generated text (its prefixes, suffixes, overlaps): the streamed pieces
    join to exactly the result's text, which ends before the first occurrence of any stop string."""
    from mtp_trt.manifest import Manifest
    from mtp_trt.runner import Runner
    from mtp_trt.sampling import SamplingParams

    monkeypatch.setenv("MTP_TRT_CACHE_DIR", str(tmp_path / "cache"))
    runner = Runner(Manifest.load(exp))
    opts = runner.options(None, sampling=SamplingParams(0.0, 0, 1.0), max_new_tokens=24)
    full = runner.run(["ab"], opts).results[0].text
    assert len(full) >= 6, full
    stops = {(full[3:5],), (full[-2:],), (full[1:3], full[2:6]), (full[4:5] + "\x00never",), ("never",),
             (full[:1],), (full[2:4], full[2:3] + "\x01")}
    for stop in stops:
        pieces = []
        result = runner.run(["ab"], opts, stop=stop, on_text=lambda i, t: pieces.append(t)).results[0]
        first = min((full.find(s) for s in stop if s in full), default=len(full))
        assert "".join(pieces) == result.text == full[:first], (stop, pieces, result.text)
        if first < len(full):
            assert result.finish_reason == "stop"


def test_prompt_files_split_on_newlines_only(tmp_path):
    from mtp_trt.validate import read_prompt_file

    for data, want in ((b"a\nb\n", ["a", "b"]), (b"a\r\nb\r\n", ["a", "b"]), (b"\xef\xbb\xbfa\nb", ["a", "b"]),
                       ("a\u2028b\nc".encode(), ["a\u2028b", "c"]), (b"a\x0cb\x0bc\x1cd\n", ["a\x0cb\x0bc\x1cd"]),
                       ("x\u0085y\u2029z".encode(), ["x\u0085y\u2029z"]), (b"a\r\r\nb", ["a\r", "b"]),
                       (b"\n \n\t\nq", ["q"]), (b"a\rb", ["a\rb"])):
        f = tmp_path / "p.txt"
        f.write_bytes(data)
        assert read_prompt_file(f) == want, data


def test_output_errors_end_in_one_line(exp, ckpt, tmp_path):
    """stdout on a full device or closed; a bench plot format nothing writes; a full disk (RLIMIT_FSIZE) under an
    export: one line, exit 2, no partial output."""
    cache = tmp_path / "cache"
    env = {**os.environ, "MTP_TRT_CACHE_DIR": str(cache)}
    with open("/dev/full", "w") as full:
        r = subprocess.run(["mtp-trt", "run", str(exp), "-p", "ab", "--max-new-tokens", "3"], stdout=full,
                           stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: cannot write the output"), r.stderr
    assert_one_error(r.stderr)
    r = subprocess.run(["mtp-trt", "inspect", str(ckpt)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       env=env, preexec_fn=lambda: os.close(1), timeout=300)
    assert r.returncode == 2 and r.stderr.startswith("error: standard output is closed"), r.stderr
    out = tmp_path / "out"

    def small_files():
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    r = subprocess.run(["mtp-trt", "export", str(ckpt), "-o", str(out)], capture_output=True, text=True, env=env,
                       preexec_fn=small_files, timeout=300)
    assert r.returncode == 2 and "File too large" in r.stderr, r.stderr
    assert_one_error(r.stderr)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
    cases = [(["bench", ckpt, "--plot", tmp_path / f"b.{ext}", "-o", tmp_path / "b.json"], "unknown image format")
             for ext in ("bmp", "txt", "png2")]
    cases.append((["bench", ckpt, "--plot", tmp_path / "noext", "-o", tmp_path / "b.json"], "(no extension)"))
    expect_errors(cases, cache, exp, ckpt)
    assert not (tmp_path / "b.json").exists()
    raw = os.fsencode(tmp_path)  # output names that are not UTF-8 (they are printed once written): refused first
    for argv, flag in ((["export", ckpt, "-o", raw + b"/out\xff"], "--out"),
                       (["bench", ckpt, "-o", raw + b"/b\xfe.json"], "--out"),
                       (["bench", ckpt, "--plot", raw + b"/p\xfd.png"], "--plot")):
        r = mtp_trt(*argv, cache=cache)
        err = r.stderr.decode()
        assert r.returncode == 2 and err.startswith(f"error: {flag} b'") and "not valid UTF-8" in err, err
        assert_one_error(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


# ------------------------------------------------------------------------------------------------ 6. check
def _engine_dir(exp: Path, root: Path) -> Path:
    """An engine directory as `mtp-trt build` lays it out (engines.json, export_manifest.json, tokenizer files),
    its engine files stand-ins: what `check`'s static checks read."""
    from mtp_trt.trt import manifest as em

    root.mkdir()
    raw = json.loads((exp / "manifest.json").read_text())
    shutil.copyfile(exp / "manifest.json", root / em.EXPORT_MANIFEST)
    for f in raw["tokenizer_files"]:
        shutil.copyfile(exp / f, root / f)
    engines = {}
    for name, g in raw["graphs"].items():
        (root / f"{name}.engine").write_bytes(name.encode() * 10)
        engines[name] = {"file": f"{name}.engine", "sha256": sha256_of(root / f"{name}.engine"),
                         "bytes": 10 * len(name), "onnx": g["file"], "onnx_sha256": g["sha256"],
                         "plugin_layers": {}, "aliases": {}, "build_seconds": 1.0}
    dims = {"B": [1, 2, 2], "S": [1, 3, 3], "T": [1, 64, 64]}
    manifest = {"format": em.FORMAT, "format_version": em.FORMAT_VERSION,
                "tensorrt": {"flavour": "tensorrt_rtx", "version": "1.7", "module": "tensorrt_rtx"},
                "target_archs": ["8.9"], "precision": raw["dtype"], "max_batch": 2, "max_seq_len": 64,
                "max_prefill": 32, "lowering": raw["lowering"],
                "export": {"format_version": 1, "manifest_sha256": sha256_of(root / em.EXPORT_MANIFEST),
                           "dtype": raw["dtype"], "nextn": raw["nextn"], "mtp_mode": raw["mtp_mode"],
                           "lowering": raw["lowering"]},
                "profiles": [{"name": "generation", "dims": dims}, {"name": "prefill", "dims": dims}],
                "plugins": [], "engines": engines}
    (root / em.FILE).write_text(json.dumps(manifest))
    return root


def _damaged_engines():
    """(label, change to engines.json, fragment)."""
    def drop(m, name):
        del m["engines"][name]
    yield "step-engine-removed", lambda m: drop(m, "step_1"), "has no engine for graph(s) step_1"
    yield "unknown-precision", lambda m: m.__setitem__("precision", "fp8"), "field 'precision' must be one of"
    yield "other-precision", lambda m: m.__setitem__("precision", "fp16"), "field 'precision' is 'fp16', but the"
    yield "negative-bytes", lambda m: m["engines"]["target"].__setitem__("bytes", -5), \
        "field 'engines.target.bytes' must be an integer >= 1"
    yield "archs-string", lambda m: m.__setitem__("target_archs", "8.9"), "field 'target_archs' must be a list"
    yield "archs-empty", lambda m: m.__setitem__("target_archs", []), "name no GPU architecture"
    yield "archs-junk", lambda m: m.__setitem__("target_archs", ["sm_89"]), "a compute capability"
    yield "profile-inverted", lambda m: m["profiles"][0]["dims"].__setitem__("B", [2, 1, 1]), "profiles[0].dims.B"
    yield "profile-beyond", lambda m: m["profiles"][1]["dims"].__setitem__("T", [1, 64, 4096]), "max <= 64"
    yield "batch-beyond-export", lambda m: m.__setitem__("max_batch", 10**6), "beyond the export's"
    yield "engine-path", lambda m: m["engines"]["target"].__setitem__("file", "../target.engine"), \
        "field 'engines.target.file' must be a plain file name"
    yield "engine-abs-path", lambda m: m["engines"]["target"].__setitem__("file", "/etc/passwd"), "plain file name"
    yield "onnx-of-another", lambda m: m["engines"]["target"].__setitem__("onnx_sha256", "1" * 64), \
        "field 'engines.target.onnx_sha256'"
    yield "mode-other", lambda m: m["export"].__setitem__("mtp_mode", "vanilla"), "field 'export.mtp_mode'"
    yield "engines-list", lambda m: m.__setitem__("engines", []), "field 'engines' must be an object"


def test_check_validates_engines_json_against_its_export(exp, tmp_path):
    from mtp_trt.trt.check import static_checks

    good = _engine_dir(exp, tmp_path / "good")
    static_checks(good)  # the layout as built passes
    cases = []
    for label, change, fragment in _damaged_engines():
        d = tmp_path / label
        shutil.copytree(good, d)
        raw = json.loads((d / "engines.json").read_text())
        change(raw)
        (d / "engines.json").write_text(json.dumps(raw))
        _raises(lambda: static_checks(d), str(d / "engines.json"), fragment)
        cases.append((["check", d], fragment))
    tok = tmp_path / "tokenizer-edited"
    shutil.copytree(good, tok)
    (tok / "tokenizer.json").write_text((tok / "tokenizer.json").read_text().replace('"a"', '"b"', 1))
    _raises(lambda: static_checks(tok), "tokenizer.json: SHA-256 differs")
    expect_errors(cases[:3], tmp_path / "cache", exp)


# --------------------------------------------------------------------------------------- 7. small ones
_PAUSED_EXPORT = r"""
import sys, threading
import mtp_trt.exporters.export as x
_export = x.export
def _paused(*args, progress, **kwargs):
    def stage(text):
        if "mtp_0.onnx" in text:  # the target graph is written into the partial directory: wait there
            sys.stderr.write("paused\n"); sys.stderr.flush()
            threading.Event().wait()
        progress(text)
    return _export(*args, progress=stage, **kwargs)
x.export = _paused
from mtp_trt.cli import entry
sys.argv = ["mtp-trt", *sys.argv[1:]]
sys.exit(entry())
"""


@pytest.mark.slow
def test_ctrl_c_prints_interrupted(ckpt, tmp_path):
    """SIGINT while a checkpoint is exported into the cache (held mid-way, after its first graph, until the
    signal): "error: interrupted", status 130, no partial."""
    cache = tmp_path / "cache"
    p = subprocess.Popen([sys.executable, "-c", _PAUSED_EXPORT, "run", str(ckpt), "-p", "x"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "MTP_TRT_CACHE_DIR": str(cache)})
    try:
        lines = []
        while (line := p.stderr.readline()) and line != "paused\n":
            lines.append(line)
        assert line == "paused\n", lines
        assert any((d / "target.onnx").exists() for d in _partials(cache / "exports"))
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, err
    assert_one_error(err)
    assert err.strip().splitlines()[-1] == "error: interrupted"
    assert not _partials(cache / "exports")


def test_json_output_cut_by_a_closed_pipe_is_one_line(tmp_path):
    """`mtp-trt run --json | head -c 1000`: the reader leaves before the JSON is whole; the output lost is an
    error line and exit status 2, not a silent success."""
    import fcntl

    read, write = os.pipe()
    fcntl.fcntl(write, 1031, 4096)  # F_SETPIPE_SZ: a 4 KiB pipe, less than the JSON
    p = subprocess.Popen(["mtp-trt", "run", *[x for p in ("The quick", "Once upon", "def f(x):", "import") for x in
                                              ("-p", p)], "--max-new-tokens", "600", "--json"],
                         stdout=write, stderr=subprocess.PIPE, text=True)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as reader:
            head = reader.read(1000)  # the JSON has begun
        assert head.startswith(b"{")
        assert p.wait(300) == 2
        err = p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert_one_error(err)
    assert "cannot write the output" in err, err


def test_prompt_file_from_stdin_and_help_flags(exp, tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "MTP_TRT_CACHE_DIR": str(cache)}
    r = subprocess.run(["mtp-trt", "run", str(exp), "--prompt-file", "-", "--max-new-tokens", "2", "--json"],
                       input="\ufeffab\r\n\ncd\n", capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert [x["prompt"] for x in json.loads(r.stdout)["results"]] == ["ab", "cd"]
    r = subprocess.run(["mtp-trt", "run", "--help"], capture_output=True, text=True, env=env)
    assert "<bool>" not in r.stdout and "--verify / --no-verify" in r.stdout and "--json " in r.stdout, r.stdout
    r = subprocess.run(["mtp-trt", "bench", "--help"], capture_output=True, text=True, env=env)
    assert "--out" in r.stdout and "--json" not in r.stdout, r.stdout


_NO_HOME = r"""
import pwd, sys
def _unknown(uid):
    raise KeyError(f"getpwuid(): uid not found: {uid}")
pwd.getpwuid = _unknown  # a user without a passwd entry (HOME is unset too)
from mtp_trt.cli import entry
sys.argv = ["mtp-trt", *sys.argv[1:]]
sys.exit(entry())
"""


def test_no_home_directory(exp, tmp_path):
    """HOME unset for a user without a passwd entry: a run works, its cache in the temporary directory."""
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "MTP_TRT_CACHE_DIR", "XDG_CACHE_HOME")}
    r = subprocess.run([sys.executable, "-c", _NO_HOME, "run", str(exp), "-p", "ab", "--max-new-tokens", "2"],
                       capture_output=True, text=True, timeout=300, env={**env, "TMPDIR": str(tmp_path)})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert (tmp_path / f"mtp-trt-{os.getuid()}").is_dir()


def test_utf8_arguments_under_the_c_locale(exp, tmp_path):
    """LC_ALL=C without UTF-8 coercion: `-p 'café:'` and `--stop 'é'` reach Python as surrogate escapes of their
    UTF-8 bytes; they are read as the text they are (they were refused as "not valid UTF-8")."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LC_") and k != "LANG"}
    env |= {"LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0", "MTP_TRT_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "mtp_trt.cli", "run", str(exp), "-p", "café:", "--stop", "é",
                        "--max-new-tokens", "2", "--json"], capture_output=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-2000:]
    assert json.loads(r.stdout)["results"][0]["prompt"] == "café:"


def test_a_checkpoint_with_a_long_directory_name(ckpt, tmp_path):
    """A checkpoint directory of 240 characters (within the file system's 255): exported and run (its cache
    entry's lock file name was too long)."""
    long = tmp_path / ("m" * 240)
    shutil.copytree(ckpt, long)
    r = mtp_trt("run", long, "-p", "ab", "--max-new-tokens", "2", "--json", cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr.decode()[-2000:]


_FULL_DISK = r"""
import errno, os, sys
import mtp_trt.exporters.export as x
_export = x.export
def _full(*args, progress, **kwargs):
    def stage(text):
        if "mtp_0.onnx" in text:  # mid-way through the export: the cache's file system fills up
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        progress(text)
    return _export(*args, progress=stage, **kwargs)
x.export = _full
from mtp_trt.cli import entry
sys.argv = ["mtp-trt", *sys.argv[1:]]
sys.exit(entry())
"""


def test_a_full_cache_is_named(ckpt, tmp_path):
    """The cache's file system fills up during an export: one line naming the cache (not "cannot write the
    output"), status 2, no partial directory left."""
    cache = tmp_path / "cache"
    r = subprocess.run([sys.executable, "-c", _FULL_DISK, "run", str(ckpt), "-p", "x", "--max-new-tokens", "2"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "MTP_TRT_CACHE_DIR": str(cache)})
    assert r.returncode == 2, r.stderr[-2000:]
    assert_one_error(r.stderr)
    assert f"error: {cache}: cannot write the export of" in r.stderr and "No space left" in r.stderr, r.stderr
    assert not _partials(cache / "exports")


def test_a_url_is_named_as_given(tmp_path):
    """A model given as a URL is named as given (Path made `https://` into `https:/`), as a URL."""
    (code, err, _), = run_cli([["run", "https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite", "-p", "x"]],
                              tmp_path / "cache")
    assert code == 2 and err.startswith("error: https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite: a URL"), err
    assert_one_error(err)


# ------------------------------------------------------------------------------------------ models by repo id
def _hub_env(tmp_path: Path, endpoint: str, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return env | {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "MTP_TRT_CACHE_DIR": str(tmp_path / "cache"),
                  **extra}


def _cli(*args, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mtp_trt.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.slow
def test_models_by_hugging_face_repo_id(ckpt, tmp_path):
    """`run ORG/NAME` downloads the repo (only the files a model needs) from the Hub (a stand-in on 127.0.0.1)
    into HF_HOME and runs it, with run's text for the local copy; offline, the download is reused; ORG/NAME@REV
    takes a revision; an unknown repo, an unknown revision, a gated repo without a token, a download cut short
    and an unreachable Hub each end in one line naming the repo."""
    pytest.importorskip("huggingface_hub")
    from hub_standin import Hub

    files = {f.name: f.read_bytes() for f in ckpt.iterdir() if f.is_file()} | {"README.md": b"# a model\n",
                                                                              "extra.bin": b"\0" * 1000}
    commit = "c0ffee" + "0" * 34
    hub = Hub({"org/model": (commit, files), "org/gated": (commit, files), "org/cut": (commit, files)},
              gated={"org/gated"}, cut={"org/cut"})
    try:
        env = _hub_env(tmp_path, hub.url)
        r = _cli("run", "org/model", "-p", "ab", "--max-new-tokens", "4", "--json", env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        local = _cli("run", ckpt, "-p", "ab", "--max-new-tokens", "4", "--json", env=env)
        text = json.loads(r.stdout)["results"][0]["text"]
        assert text == json.loads(local.stdout)["results"][0]["text"]
        fetched = {path.rsplit("/", 1)[1] for method, path in hub.log if "/resolve/" in path}
        assert fetched == set(files) - {"README.md", "extra.bin"}, fetched
        assert (tmp_path / "hf" / "hub" / "models--org--model" / "snapshots" / commit / "config.json").is_file()
        assert any(e.name.startswith("model-c0ffee000000-eagle-") for e in (tmp_path / "cache" / "exports").iterdir())
        r = _cli("inspect", f"org/model@{commit}", env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        for args, extra, fragment in (
                (["inspect", "org/nope"], {}, "org/nope: no such directory, nor a repository on the Hugging Face Hub"),
                (["inspect", "org/model@v9"], {}, "org/model@v9: the Hugging Face repository has no revision 'v9'"),
                (["inspect", "org/gated"], {}, "org/gated: a gated repository"),
                (["inspect", "org/cut"], {}, "org/cut: cannot download it from the Hugging Face Hub"),
                (["inspect", "org/gated"], {"HF_TOKEN": "hf_test"}, None)):
            r = _cli(*args, env={**env, **extra})
            if fragment is None:
                assert r.returncode == 0, r.stderr[-2000:]
                continue
            assert r.returncode == 2 and fragment in r.stderr, (args, r.stderr[-2000:])
            assert_one_error(r.stderr)
    finally:
        hub.close()
    offline = _cli("run", "org/model", "-p", "ab", "--max-new-tokens", "4", "--json",  # the Hub gone: reused
                   env={**env, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 0, offline.stderr[-2000:]
    assert json.loads(offline.stdout)["results"][0]["text"] == text
    r = _cli("inspect", "org/other", env=_hub_env(tmp_path, hub.url))  # nothing listens there now
    assert r.returncode == 2 and "org/other: no such directory" in r.stderr and "cannot be reached" in r.stderr, \
        r.stderr[-2000:]
    assert_one_error(r.stderr)
