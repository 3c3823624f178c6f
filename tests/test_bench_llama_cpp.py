"""benchmarks/beside_llama_cpp.py's llama.cpp MTP drafting peer (--llama-mtp-bin), without llama.cpp: the parser on a
real run of llama-speculative-simple (tests/data/draft-mtp-k2.*: `--spec-type draft-mtp --spec-draft-n-max 2
-n 16` on the demo's Q8_0 GGUF with its MTP block), the runner on a stand-in that replays that run, and the
flag checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_common import PROMPT  # noqa: E402
from beside_llama_cpp import DraftMtpRunner, first_difference, parse_draft_mtp  # noqa: E402

STDOUT = (DATA / "draft-mtp-k2.stdout").read_bytes()
STDERR = (DATA / "draft-mtp-k2.stderr").read_text()
ECHO = b"<bos>" + PROMPT.encode()  # what the binary prints for the prompt's tokens
NEW = b"\nThe user contains a list of"  # the 18 new tokens it printed (its own "\n\n\n\n" follow)


def test_parse_draft_mtp_reads_a_real_run():
    r = parse_draft_mtp(STDOUT, STDERR)
    assert r["text"] == ECHO + NEW + b"\n\n\n\n"
    assert (r["encoded"], r["decoded"]) == (52, 18)
    assert r["encoded_seconds"] == pytest.approx(52 / 5524.862, rel=1e-9)
    assert r["decoded_seconds"] == pytest.approx(18 / 1772.875, rel=1e-9)
    assert r["decoded_seconds"] == pytest.approx(0.010, abs=0.0005)  # the seconds it printed, 3 decimals
    assert (r["n_draft"], r["n_predict"], r["n_drafted"], r["n_accept"]) == (2, 18, 17, 9)
    assert r["mean_acceptance_length"] == 18 / (18 - 9)  # 9 verify steps made 18 tokens


@pytest.mark.parametrize("stdout, stderr, message", [
    (STDOUT[2:], STDERR, "standard output"),  # no blank line before the echo
    (STDOUT, STDERR.split("n_draft ")[0], "n_draft"),  # its last lines lost at exit
    (STDOUT, STDERR.replace("decoded", "decodes"), "decoded N tokens"),
    (STDOUT, STDERR.replace("n_predict = 18", "n_predict = 17"), "inconsistent"),
    (STDOUT, STDERR.replace("n_accept  = 9", "n_accept  = 18"), "inconsistent"),
])
def test_parse_draft_mtp_refuses_what_it_cannot_read(stdout, stderr, message):
    with pytest.raises(ValueError, match=message):
        parse_draft_mtp(stdout, stderr)


def test_first_difference():
    pieces = [b"\n", b"The", b" user", b" contains"]
    assert first_difference(NEW, pieces) is None
    assert first_difference(b"\nThe users", pieces) == 3
    assert first_difference(b"\nThe usex contains", pieces) == 2
    assert first_difference(b"\nThe", pieces) == 2  # it stopped early
    assert first_difference(b"\nTh", pieces) == 1
    assert first_difference(b"", pieces) == 0


def replaying_binary(tmp_path: Path, lose_first: int = 0, fail: bool = False) -> str:
    """A stand-in for llama-speculative-simple in a new folder `tmp_path`: `--help` names draft-mtp; a run prints
    the captured run (its first `lose_first` runs without their last stderr lines, as llama.cpp's log thread
    sometimes leaves them) and records its arguments."""
    tmp_path.mkdir()
    path = tmp_path / "llama-speculative-simple"
    path.write_text(f"""#!{sys.executable}
import json, sys
from pathlib import Path
here = Path({str(tmp_path)!r})
if sys.argv[1:] == ["--help"]:
    print("--spec-type none,draft-simple,draft-eagle3,draft-mtp")
    sys.exit(0)
if {fail}:
    sys.stderr.write("llama_model_load: error loading model: missing tensor 'blk.6.nextn.eh_proj.weight'\\n")
    sys.exit(1)
calls = here / "calls"
n = len(calls.read_text().splitlines()) if calls.exists() else 0
calls.write_text((calls.read_text() if calls.exists() else "") + json.dumps(sys.argv[1:]) + "\\n")
sys.stdout.buffer.write(Path({str(DATA / "draft-mtp-k2.stdout")!r}).read_bytes())
err = Path({str(DATA / "draft-mtp-k2.stderr")!r}).read_text()
sys.stderr.write(err.split("n_draft ")[0] if n < {lose_first} else err)
""")
    path.chmod(0o755)
    return str(path)


def reference(new: bytes) -> dict:
    return {"prompt_text": ECHO.hex(), "pieces": [bytes([b]).hex() for b in new]}


def test_runner_replies_with_the_binarys_own_figures(tmp_path):
    binary = replaying_binary(tmp_path / "bin", lose_first=2)  # the warm-up run needs 3 tries
    ids = list(range(52))
    runner = DraftMtpRunner(binary, "demo-mtp-q8_0.gguf", ids, 16, 2, 2, reference(NEW))
    r = runner.ask("run")
    calls = (tmp_path / "bin" / "calls").read_text().splitlines()
    assert len(calls) == 4
    args = json.loads(calls[-1])
    assert args[:6] == ["-m", "demo-mtp-q8_0.gguf", "--spec-type", "draft-mtp", "--spec-draft-n-max", "2"]
    assert args[args.index("-p") + 1] == PROMPT and args[args.index("-n") + 1] == "16"
    assert args[args.index("-t") + 1] == "2" and args[args.index("-c") + 1] == str(52 + 16 + 2 + 16)
    # the harness's decode figure, (tokens - 1) / (seconds - first), is the binary's printed speed
    assert (16 - 1) / (r["seconds"] - r["first"]) == pytest.approx(1772.875, rel=1e-9)
    assert r["seconds"] == pytest.approx(52 / 5524.862 + 16 / 1772.875, rel=1e-9)
    assert r["first_difference"] is None and r["mean_acceptance_length"] == 2.0
    assert 1 < runner.close() < 500  # MB: the stand-in's own peak, not the test process's carried over
    other = DraftMtpRunner(binary, "demo-mtp-q8_0.gguf", ids, 16, 2, 2, reference(b"\nThe users"))
    assert other.ask("run")["first_difference"] == len(b"\nThe user")


def test_runner_refuses_in_one_line(tmp_path):
    lossy = replaying_binary(tmp_path / "lossy", lose_first=3)
    with pytest.raises(SystemExit, match=r"^error: --llama-mtp-bin .*: no 'n_draft = N' line .* \(3 runs\)$"):
        DraftMtpRunner(lossy, "demo-mtp-q8_0.gguf", list(range(52)), 16, 2, 2, reference(NEW))
    with pytest.raises(SystemExit, match=r"its prompt is not the harness's 51 tokens \(it encoded 52"):
        DraftMtpRunner(replaying_binary(tmp_path / "ok"), "x.gguf", list(range(51)), 16, 2, 2, reference(NEW))
    failing = replaying_binary(tmp_path / "failing", fail=True)
    with pytest.raises(SystemExit, match=r"^error: --llama-mtp-bin .* on x.gguf: exit 1; its last line: "
                                         r"llama_model_load: error loading model: missing tensor"):
        DraftMtpRunner(failing, "x.gguf", list(range(52)), 16, 2, 2, reference(NEW))


def test_llama_cpp_refuses_bad_mtp_flags_before_any_work(tmp_path):
    no_mtp = tmp_path / "llama-cli"
    no_mtp.write_text("#!/bin/sh\necho '--spec-type none,draft-simple'\n")
    no_mtp.chmod(0o755)
    cases = [
        (["--llama-mtp-bin", "/no/such/binary"], "error: --llama-mtp-bin /no/such/binary: no such executable file"),
        (["--llama-mtp-bin", str(no_mtp)], f"error: --llama-mtp-bin {no_mtp}: its --help offers no --spec-type "
                                           f"draft-mtp"),
        (["--sizes", "85m", "--llama-mtp-bin", str(no_mtp)], "error: --llama-mtp-bin: no --nextn above 0 to draft "
                                                             "with (--nextn is 0 on 85m)"),
        (["--nextn", "0", "--llama-mtp-bin", str(no_mtp)], "error: --llama-mtp-bin: no --nextn above 0 to draft "
                                                          "with (--nextn 0)"),
        (["--prompt-repeat", "0"], "error: --prompt-repeat 0: must be >= 1"),
    ]
    cache = tmp_path / "cache"
    for flags, message in cases:
        res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "beside_llama_cpp.py"), *flags],
                             capture_output=True, text=True, env={**os.environ, "MTP_TRT_CACHE_DIR": str(cache)},
                             timeout=120)
        assert res.returncode == 2, res.stderr
        assert res.stderr.strip().splitlines()[-1].startswith(f"beside_llama_cpp.py: {message}")
        assert "Traceback" not in res.stderr
    assert not cache.exists() or not any(cache.rglob("*"))  # no checkpoint, export or GGUF begun


# ------------------------------------------------------------------------------------------------ --isa
# llama_print_system_info() of llama-cpp-python 0.3.36 built with the docstring's AVX2 flags (GGML_NATIVE=OFF,
# no AVX-512, AVX-VNNI or AMX), and the same with the flags a native build on an AVX-512 VNNI + AMX CPU adds
AVX2_INFO = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | "
             "OPENMP = 1 | REPACK = 1 | ")
NATIVE_INFO = AVX2_INFO.replace("AVX2 = 1 |", "AVX_VNNI = 1 | AVX2 = 1 |").replace(
    "BMI2 = 1 |", "BMI2 = 1 | AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 |")


def test_llama_isa_reads_the_system_info():
    from beside_llama_cpp import llama_isa, llama_isa_problem

    assert llama_isa(AVX2_INFO) == "avx2" and llama_isa(NATIVE_INFO) == "avx512-vnni"
    assert llama_isa("CPU : SSE3 = 1 | LLAMAFILE = 1 | ") == "scalar"
    assert llama_isa_problem(AVX2_INFO, "avx2") is None
    assert llama_isa_problem(AVX2_INFO.replace("AVX2 = 1", "AVX2 = 0"), "avx2") == "its ggml was built without AVX2"
    assert llama_isa_problem(NATIVE_INFO, "avx2") == "its ggml was built with AVX512, AVX_VNNI, AVX512_VNNI, AMX_INT8"
    assert llama_isa_problem(AVX2_INFO, "avx512-vnni") == "its ggml was built without AVX512, AVX512_VNNI"
    assert llama_isa_problem(NATIVE_INFO, "avx512-vnni") == "its ggml was built with AMX_INT8"


def fake_llama_python(tmp_path: Path, info: str) -> str:
    """A stand-in for --llama-python: `import llama_cpp` works and its system info is `info`."""
    path = tmp_path / "python"
    path.write_text(f"#!{sys.executable}\nimport sys\n"
                    f"print({info!r} if 'system_info' in sys.argv[-1] else '0.3.36')\n")
    path.chmod(0o755)
    return str(path)


def bench(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "beside_llama_cpp.py"), *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_isa_is_one_of_the_kernels_sets():
    from mtp_trt.plugins import ort_lib
    from beside_llama_cpp import ISA_FEATURES

    # (--isa compares with llama.cpp on x86-64: scalar and the x86 sets, by the kernels' names)
    assert tuple(ISA_FEATURES) == tuple(i for i in ort_lib.CPU_ISAS if not i.startswith("neon"))
    run = bench("--isa", "avx3")
    assert run.returncode == 2 and "--isa: invalid choice: 'avx3'" in run.stderr


def test_isa_refuses_a_llama_cpp_built_for_other_sets(tmp_path):
    """--isa avx2 with a llama.cpp built natively on an AVX-512 machine: one line naming what it was built with,
    before any checkpoint is made."""
    native = fake_llama_python(tmp_path, NATIVE_INFO)
    run = bench("--isa", "avx2", "--llama-python", native, "--sizes", "demo")
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == (
        f"--isa avx2: --llama-python {native}: its ggml was built with AVX512, AVX_VNNI, AVX512_VNNI, AMX_INT8 "
        "(build llama-cpp-python for avx2: see benchmarks/beside_llama_cpp.py's docstring)")


def test_isa_sets_the_kernels_set_for_mtp_trt(tmp_path, monkeypatch):
    """check_isa: MTP_TRT_CPU_ISA for every process from then on (what a fresh process's kernels take), and
    llama.cpp's system info back where it is built for the set."""
    import beside_llama_cpp as bench_module

    monkeypatch.setenv("MTP_TRT_CPU_ISA", "")  # (restored after: check_isa sets it for the rest of the process)
    assert bench_module.check_isa("scalar", fake_llama_python(tmp_path, "CPU : SSE3 = 1 | ")) == "CPU : SSE3 = 1 |"
    assert os.environ["MTP_TRT_CPU_ISA"] == "scalar"
    assert bench_module.child_script("isa") == ["scalar", ""]


# ---------------------------------------------------------------------------------------------- --prefill
def test_prefill_prompts_have_the_asked_length():
    from bench_common import DEMO
    from beside_llama_cpp import prefill_ids, prompt_ids

    tok = DEMO / "tokenizer.json"
    one = prompt_ids(tok)
    for n in (2, len(one) - 1, len(one), 512, 2048):
        ids = prefill_ids(tok, n)
        assert len(ids) == n and ids[0] == 1
        assert ids[:min(n, len(one)) - 1] == one[:min(n, len(one)) - 1]  # the prompt's own tokens first


def test_prefill_exports_hold_the_longest_prompt():
    from beside_llama_cpp import prefill_rows
    from llama_api import EXPORT_ROWS, export_path

    assert prefill_rows("85m", [50, 512]) is None and prefill_rows("85m", [EXPORT_ROWS - 2]) is None
    assert prefill_rows("304m", [50, 2048]) == 2304 and prefill_rows("demo", [2048]) is None
    assert export_path("85m", 1, "int4", 32, 2304) != export_path("85m", 1, "int4", 32)
    assert export_path("85m", 1, "int4", 32, EXPORT_ROWS) == export_path("85m", 1, "int4", 32)


def test_prefill_table_times_the_first_token_and_pairs_equal_bits():
    from beside_llama_cpp import label, prefill_table

    runs = {("llama", "q8_0"): [{"first": 0.2}, {"first": 0.4}, {"first": 0.3}],
            ("llama", "q4_k_m"): [{"first": 0.5}, {"first": 0.5}, {"first": 0.5}],
            ("mtp", "int8", 0): [{"first": 0.1}, {"first": 0.1}, {"first": 0.2}]}
    rows = {r["engine"]: r for r in prefill_table("demo", 512, runs, label, {"llama": "avx2", "mtp": "avx2"})}
    assert rows["llama.cpp Q8_0"]["ttft_ms"] == pytest.approx(300)
    assert rows["llama.cpp Q8_0"]["prefill_tokens_per_second"] == pytest.approx(512 / 0.3)
    mtp = rows["mtp-trt int8 nextn 0"]
    assert mtp["ttft_ms"] == pytest.approx(100) and mtp["isa"] == "avx2"
    assert mtp["speed_ratio"] == {"Q8_0": pytest.approx(2.0)}  # per round 2, 4, 1.5: the median
    assert "speed_ratio" not in rows["llama.cpp Q4_K_M"]


def test_prefill_refuses_a_prompt_without_tokens():
    run = bench("--prefill", "50", "1")
    assert run.returncode == 2 and "--prefill 1: a prompt is BOS and at least one token (N >= 2)" in run.stderr


def test_mtp_worker_times_its_first_token_inside_the_timed_generation(tmp_path, monkeypatch):
    """The decode figure is (tokens - 1) / (seconds - first) for both engines: mtp-trt's `first` must come from
    the same generation as its seconds (as llama.cpp's does), not from a generation of its own, whose cold start
    would be subtracted from the warm one's time."""
    import beside_llama_cpp as bench_module
    from runtime_models import make_random

    from mtp_trt import decode
    from mtp_trt.backend import OrtBackend
    from mtp_trt.exporters.export import export
    from mtp_trt.manifest import Manifest

    out = export(make_random(tmp_path / "ckpt", nextn=1), tmp_path / "export", nextn=1, max_seq_len=64, trees="none")
    ids, calls, real = [1, 5, 9, 13], [], decode.generate
    monkeypatch.setattr(decode, "generate", lambda *a, **k: calls.append(k) or real(*a, **k))
    worker = bench_module.MtpWorker(str(out), ids, 6, 1, 1)
    generated = worker()
    assert len(calls) == 1 and 0 < worker.first  # one generation, its first token timed inside it
    seqs, _ = real(OrtBackend(Manifest.load(out), threads=1), [ids], decode.DecodeOptions(nextn=1, max_new_tokens=6))
    assert generated == seqs[0].generated


# ------------------------------------------------------------------------------------------ bytes per token
def test_graph_bytes_per_token_counts_routed_experts_and_gathered_rows():
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper
    from beside_llama_cpp import graph_bytes_per_token

    def init(name, shape, dtype=np.float32):
        return numpy_helper.from_array(np.zeros(shape, dtype), name)

    inits = [init("emb", (10, 6)), init("w", (6, 6)), init("gate", (4, 6)), init("fc1", (4, 8, 6), np.uint8),
             init("fc1s", (4, 8, 1), np.float16), init("fc2", (4, 6, 4), np.uint8), init("fc2s", (4, 6, 1), np.float16),
             init("sh", (8, 6), np.uint8)]
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["x"]),
             helper.make_node("MatMul", ["x", "w"], ["y"]),
             helper.make_node("MatMul", ["y", "w"], ["y2"]),  # (read twice, counted once)
             helper.make_node("QMoE", ["y2", "gate", "", "fc1", "fc1s", "fc2", "fc2s", "sh"], ["z"],
                              domain="mtp_trt.cpu", top_k=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, None)], inits)
    routed = (4 * 8 * 6 + 4 * 8 * 2 + 4 * 6 * 4 + 4 * 6 * 2) / 4  # 1 of 4 experts
    assert graph_bytes_per_token(helper.make_model(graph)) == 6 * 4 + 36 * 4 + 24 * 4 + routed + 48


def test_an_fp32_exports_bytes_per_token_are_the_checkpoints_active_weights(tmp_path):
    """The plain step of an fp32 export reads the checkpoint's active f32 weights (beside_llama_cpp.active_bytes,
    from the safetensors header) plus one embedding row and each layer's RoPE rows; int8 and int4 read less."""
    sys.path.insert(0, str(ROOT / "tests"))
    from runtime_models import make_random
    from beside_llama_cpp import active_bytes, export_bytes_per_token
    from mtp_trt.exporters.export import export

    ckpt = make_random(tmp_path / "ckpt", nextn=1)
    cfg = json.loads((ckpt / "config.json").read_text())
    rows = 4 * cfg["hidden_size"] + cfg["num_hidden_layers"] * 2 * 4 * cfg["qk_rope_head_dim"] // 2
    got = {q: export_bytes_per_token(export(ckpt, tmp_path / q, nextn=1, max_seq_len=64, trees="none",
                                            quant_scheme=q)) for q in ("none", "int8", "int4")}
    assert got["none"] == active_bytes(ckpt) + rows
    assert got["none"] / 4 < got["int8"] < got["none"] / 2 and got["int4"] < got["int8"]
