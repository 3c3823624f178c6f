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

    def export(self, **changes) -> Path:
        out = self.tmp / "exp"
        shutil.copytree(self.exp, out)
        raw = json.loads((out / "manifest.json").read_text()) | changes
        (out / "manifest.json").write_text(json.dumps(raw))
        return out

    def file(self, name: str, data: bytes | str) -> Path:
        path = self.tmp / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        return path


def _tampered_hash(c):
    e = c.export()
    raw = json.loads((e / "manifest.json").read_text())
    raw["graphs"]["step_1"]["sha256"] = "0" * 64
    (e / "manifest.json").write_text(json.dumps(raw))
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
    ("bench-json-unwritable", lambda c: ["bench", c.ckpt, "--json", "/proc/bench.json"], 2,
     "--json /proc/bench.json: not writable"),
    ("bench-json-no-dir", lambda c: ["bench", c.ckpt, "--json", c.tmp / "no" / "b.json"], 2, "does not exist"),
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
        assert err.startswith("error: ") and err.strip().count("\n") == 0, err
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
    assert first["hashed"] == first["files"] == 7  # target, mtp_0, step_0..2, tree_2_2_4, weights.bin
    assert verify_export(m)["hashed"] == 0
    assert verify_export(m, force=True)["hashed"] == 7
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
