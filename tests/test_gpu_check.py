"""`python -m mtp_trt.gpu_check`, the one command for a GPU machine, without a GPU: it reports the environment and
the kernel library, skips the GPU tests and benchmarks with the reason (exit status 3), and runs from a checkout
that is not installed.  Its pieces (test selection, the JUnit tally, the benchmark headline) on stand-ins."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_trt import gpu_check
from mtp_trt.trt import compat

ROOT = Path(__file__).resolve().parents[1]
no_gpu = pytest.mark.skipif(compat.gpu()[0] is not None, reason="a GPU is present: the check would run on it")


@no_gpu
@pytest.mark.parametrize("installed", [True, False], ids=["installed", "plain-checkout"])
def test_runs_up_to_the_gpu_and_skips_with_reasons(tmp_path, installed):
    """Installed: as users run it.  Plain checkout: no site-packages at all (python -S), so mtp_trt and its
    mapped subpackages (plugins/, exporters/) come from the checkout's folders."""
    cmd = [sys.executable, *([] if installed else ["-S"]), "-m", "mtp_trt.gpu_check",
           "--json", str(tmp_path / "s.json")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    out = r.stdout
    assert "GPU tests: skipped: no GPU here (" in out and "kernel benchmarks: skipped: no GPU here (" in out
    assert "kernel library: shipped (libmtp_kernels.so, CUDA 13, sm_80" in out and out.rstrip().endswith("result: skipped")
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["status"] == 3 and data["environment"]["compute_capability"] is None
    if not installed:  # nothing but the checkout: no cuda-python, no TensorRT, each said so
        assert "cuda-python runtime: none (cuda-python is not installed" in out and "TensorRT: none (no usable" in out


def test_gpu_tests_are_found_by_their_marker():
    files = {p.relative_to(ROOT).as_posix() for p in gpu_check.gpu_test_files()}
    assert {"tests/kernels/test_gpu_kernels.py", "tests/test_trt_gpu.py", "tests/test_trt_build.py"} <= files
    assert "tests/test_gpu_check.py" not in files and "tests/test_trt_runtime.py" not in files


def test_pytest_outcomes_are_tallied(tmp_path):
    """run_tests on a stand-in checkout: the marker chooses (no TensorRT: `gpu and not trt`), and passes, failures
    and skips with their reasons are counted from pytest's own report."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import pytest\n"
        "pytestmark = pytest.mark.gpu\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2\n"
        "@pytest.mark.skip(reason='needs more memory')\n"
        "def test_skipped(): pass\n"
        "@pytest.mark.trt\n"
        "def test_engine(): pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: g\n    trt: t\n")
    got = gpu_check.run_tests(with_tensorrt=False, root=tmp_path)
    assert (got["passed"], got["failed"], got["skipped"]) == (1, 1, 1) and got["marker"] == "gpu and not trt"
    assert got["reasons"] == {"needs more memory": 1} and got["failures"] == ["tests.test_x::test_bad"]
    assert gpu_check.run_tests(with_tensorrt=True, root=tmp_path)["passed"] == 2


def test_bench_headline():
    bench = {"dtype": "bfloat16", "copy_GBps": 3000.0, "mla_decode": [
        {"B": 64, "T": 4096, "H": 16, "S": 1, "GBps": 100.0, "time_us": 1.0},
        {"B": 64, "T": 4096, "H": 128, "S": 1, "GBps": 2400.0, "time_us": 215.4}]}
    assert gpu_check.headline(bench) == ("MLA decode at batch 64, cache 4096, 128 heads, 1 new token (bfloat16): "
                                         "2400 GB/s = 80% of the 3000 GB/s device-to-device copy, 215.4 us")
    assert "not measured" in gpu_check.headline({"mla_decode": []})


def test_more_headlines():
    bench = {"dsa": [{"B": 1, "T": 32768, "S": 1}, {"B": 1, "T": 131072, "S": 1, "topk": 2048, "select_us": 61.23,
                                                    "select_TFLOPS": 35.1, "select_x_torch": 4.04, "attend_us": 20.0}],
             "accept": [{"B": 1, "K": 3, "V": 129280, "strict_us": 4.0, "relaxed_us": 5.25, "rejection_us": 6.0}]}
    assert gpu_check.more_headlines(bench) == [
        "DSA top-2048 selection at batch 1, cache 131072, 1 new token: 61.2 us (35 TFLOPS, 4.0x PyTorch); sparse MLA "
        "over the selected rows: 20.0 us",
        "acceptance at batch 1, 3 drafts, vocabulary 129280: strict 4.0 us, relaxed 5.2 us, rejection sampling 6.0 us"]
    assert gpu_check.more_headlines({"mla_decode": []}) == []


def test_summary_and_status_on_a_gpu_machine(monkeypatch):
    """With a GPU (stood in): a failed test or benchmark makes the status 1, all passing 0."""
    env = {"python": "3", "driver_cuda": "12.8", "compute_capability": "9.0", "no_gpu": "", "cuda_runtime": "12.8",
           "gpu": "NVIDIA H100 80GB HBM3", "tensorrt": None, "no_tensorrt": "no usable TensorRT"}
    monkeypatch.setattr(gpu_check, "environment", lambda: env)
    monkeypatch.setattr(gpu_check, "kernel_library", lambda: ("built here (/x/libmtp_kernels-cu12.so)", ""))
    bench = {"dtype": "bfloat16", "copy_GBps": 3000.0,
             "mla_decode": [{"B": 64, "T": 4096, "H": 128, "S": 1, "GBps": 2400.0, "time_us": 215.4}]}
    monkeypatch.setattr(gpu_check, "run_bench", lambda root=None: bench)
    tests = {"passed": 40, "failed": 0, "skipped": 1, "reasons": {"gpu: x": 1}, "failures": [], "marker": "gpu"}
    monkeypatch.setattr(gpu_check, "run_tests", lambda trt, root=None: tests)
    status, lines, _ = gpu_check.check()
    assert status == 0 and lines[0] == ("driver: CUDA 12.8; cuda-python runtime: 12.8; GPU: NVIDIA H100 80GB HBM3 "
                                        "(compute capability 9.0)")
    assert "GPU tests (kernels and device layer (no TensorRT)): 40 passed, 0 failed, 1 skipped" in lines
    tests |= {"failed": 1, "failures": ["tests/kernels/test_gpu_kernels.py::test_mla"]}
    status, lines, _ = gpu_check.check()
    assert status == 1 and "  failed: tests/kernels/test_gpu_kernels.py::test_mla" in lines
    tests |= {"passed": 0, "failed": 0, "failures": [], "skipped": 41,
              "reasons": {"gpu: cuda-python is not installed (pip install cuda-python)": 41}}
    status, lines, _ = gpu_check.check()  # everything skipped is not a pass
    assert status == 1 and "  no GPU test ran: see the reasons above" in lines


def test_missing_test_dependencies_are_named(monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in ("onnx", "typer") else find(n, *a))
    got = gpu_check.run_tests(with_tensorrt=False)
    assert got == {"error": "cannot run: onnx, typer not installed (pip install -e '.[cpu,dev]' installs them)"}


def test_kernel_session_runs_v2_first_then_the_default_path_then_the_seesaw(tmp_path):
    """--kernels DIR: v2 as it is (its GPU tests, its tables uniform and ragged at the target shapes), then the default
    path (v3 on Hopper) and v3's seesaw schedule, each with its tests, its tables and one Nsight Compute pass at H128
    B64 S1 with its text, then the other tables."""
    steps = gpu_check.kernel_session_steps(tmp_path)
    names = [name for name, _, _ in steps]
    assert names[:3] == ["v2: GPU kernel tests", "v2: MLA table, uniform lengths", "v2: MLA table, ragged lengths"]
    assert [n.split(":")[0] for n in names[3:8]] == ["default"] * 5
    assert [n.split(":")[0] for n in names[8:13]] == ["seesaw"] * 5
    for name, cmd, env in steps[:3]:
        assert env == {"MTP_TRT_MLA_PATH": "v2"}, name
        assert "pytest" in cmd or "--force-v2" in cmd, name
    for name, cmd, env in steps[3:8]:
        assert env == {} and "--force-v2" not in cmd and "--seesaw" not in cmd, name
    for name, cmd, env in steps[8:13]:
        assert env.get("MTP_TRT_MLA_PATH") == "seesaw" or cmd[1] == "--import", name
        assert cmd[0] == "ncu" or "pytest" in cmd or "--seesaw" in cmd, name
    for first in (3, 8):
        ncu = steps[first + 3][1]
        assert ncu[:3] == ["ncu", "--clock-control", "none"] and "64x4096" in ncu and "--uniform" in ncu
        assert steps[first + 4][1][:3] == ["ncu", "--import", f"{ncu[ncu.index('-o') + 1]}.ncu-rep"]
    assert ["--ragged" in cmd for _, cmd, _ in steps[1:3]] == [False, True]
    for _, cmd, _ in steps[1:3]:  # the target shapes: B64 T4096, B1 T4096, B1 T128k
        assert cmd[cmd.index("--shapes") + 1] == "64x4096,1x4096,1x131072"
    sweep = dict((name, cmd) for name, cmd, _ in steps)["default: batch-1 floor and split sweep"]
    assert sweep[sweep.index("--splits") + 1] == "8,16,32,66,132" and "1x64" in sweep[sweep.index("--shapes") + 1]
    assert not any(name.startswith("baseline") for name in names)


def test_kernel_session_runs_a_baseline_library_in_the_same_session(tmp_path):
    """--baseline LIB: the default path's uniform table again on another kernel library (an A/B in one GPU call)."""
    lib = tmp_path / "old.so"
    steps = gpu_check.kernel_session_steps(tmp_path, baseline=lib)
    (name, cmd, env), = [s for s in steps if s[0].startswith("baseline")]
    assert env == {"MTP_TRT_KERNEL_LIB": str(lib)} and "--uniform" in cmd and "--force-v2" not in cmd
    assert cmd[cmd.index("--shapes") + 1] == gpu_check.TARGET_SHAPES
    got = subprocess.run([sys.executable, "-m", "mtp_trt.gpu_check", "--kernels", str(tmp_path / "k"), "--baseline",
                          str(tmp_path / "missing.so")], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(gpu_check.ROOT)})
    assert got.returncode == 2 and "--baseline" in got.stderr and "missing.so: no such file" in got.stderr


def test_a_step_past_its_limit_is_killed_with_its_children(tmp_path):
    """A hung kernel must not eat the session: the step and every process it started are killed at its limit."""
    import time

    pidfile = tmp_path / "child.pid"
    script = (f"import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pidfile)!r}, 'w').write(str(c.pid)); print('started', flush=True); c.wait()")
    t0 = time.monotonic()
    code, text = gpu_check.run_step([sys.executable, "-c", script], dict(os.environ), tmp_path, 3)
    assert code is None and "started" in text and time.monotonic() - t0 < 30
    child = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"child {child} still running")
    assert gpu_check.run_step([sys.executable, "-c", "print('ok'); raise SystemExit(4)"], dict(os.environ),
                              tmp_path, 30) == (4, "ok\n")


def test_kernel_session_skips_what_the_deadline_leaves_no_time_for(tmp_path, monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(gpu_check, "kernel_session_steps",
                        lambda out, root=None, baseline=None: [("one", [sys.executable, "-c", "print(1)"], {}),
                                                ("two", [sys.executable, "-c", "import time; time.sleep(30)"], {}),
                                                ("three", [sys.executable, "-c", "print(3)"], {})])
    real = gpu_check.run_step
    monkeypatch.setattr(gpu_check, "run_step", lambda cmd, env, cwd, limit: ran.append(limit) or real(cmd, env, cwd,
                                                                                                    limit))
    assert gpu_check.kernel_session(tmp_path, deadline_s=15) == 1
    out = capsys.readouterr().out
    assert "== one: exit status 0" in out and "== two: killed: ran past its limit" in out
    assert "== three: skipped (the session's 15 s are spent)" in out
    assert len(ran) == 2 and ran[1] <= 15 and (tmp_path / "00.log").read_text().endswith("1\n")
