"""One check of a GPU machine: python -m mtp_trt.gpu_check [--json FILE]

Runs from a checkout (installed or not) on a machine with an NVIDIA GPU, cuda-python and pytest; PyTorch, CuPy and
TensorRT are used where present.  In order:

1. the environment: the driver's CUDA version, the CUDA runtime of cuda-python, the GPU, TensorRT (or why not);
2. the kernel library the runtime would load (shipped, or built here for this driver) and its interface;
3. every test that needs a GPU (pytest marker `gpu`): those that need no TensorRT (the CUDA kernels against their
   NumPy references, the device layer's CUDA-graph capture and replay), and with TensorRT the engine tests too
   (engines against ONNX Runtime, `mtp-trt check` on them);
4. the kernel benchmarks (plugins/bench_kernels.py, quick shapes, against PyTorch where it has CUDA): the MLA decode
   bandwidth at batch 64, cache 4096, 128 heads, one new token, against the card's device-to-device copy bandwidth;
   DeepSeek Sparse Attention's top-2048 selection over 131072 cached rows at batch 1; acceptance at batch 1;

then prints one summary.  Exit status 0: everything ran and passed; 1: a failure; 3: skipped, no GPU here (each
step says why).  Nothing heavy is imported before it is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout (tests/ and plugins/ beside the package)
BENCH_SHAPE = {"B": 64, "T": 4096, "H": 128, "S": 1}
SKIPPED = 3


def environment() -> dict:
    """Versions and the GPU, each with the reason where it is absent."""
    from mtp_trt.errors import MtpTrtError
    from mtp_trt.plugins import cuda_lib
    from mtp_trt.trt import compat

    env: dict = {"python": sys.version.split()[0]}
    driver = cuda_lib.driver_cuda_version()
    env["driver_cuda"] = cuda_lib.format_cuda_version(driver) if driver else None
    cc, why = compat.gpu()
    env["compute_capability"], env["no_gpu"] = cc, why if cc is None else ""
    try:
        rt = cuda_lib.import_cudart()
        err, v = rt.cudaRuntimeGetVersion()
        env["cuda_runtime"] = cuda_lib.format_cuda_version(int(v)) if int(err) == 0 else f"error {int(err)}"
        if cc is not None:
            err, prop = rt.cudaGetDeviceProperties(0)
            name = prop.name.decode(errors="replace") if isinstance(prop.name, bytes) else str(prop.name)
            env["gpu"] = name.rstrip("\0")
    except MtpTrtError as e:
        env["cuda_runtime"] = f"none ({e})"
    try:
        api = compat.load("auto")
        env["tensorrt"] = f"{api.flavour} {api.version}"
    except MtpTrtError as e:
        env["tensorrt"], env["no_tensorrt"] = None, str(e)
    return env


def kernel_library() -> tuple[str, str]:
    """(which library the runtime loads, in words; why it cannot, or '')."""
    from mtp_trt.errors import MtpTrtError
    from mtp_trt.plugins import cuda_lib

    try:
        lib = cuda_lib.load_library()
    except (MtpTrtError, OSError) as e:
        return "", str(e)
    return cuda_lib.describe(lib.path), ""


def gpu_test_files(root: Path = ROOT) -> list[Path]:
    """The test files holding tests marked `gpu` (a decorator or a module's pytestmark)."""
    marked = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*\bpytest\.mark\.gpu\b)", re.M)
    return sorted(p for p in (root / "tests").rglob("test_*.py") if marked.search(p.read_text()))


def junit_counts(xml_text: str) -> dict:
    """{passed, failed, skipped, reasons: {skip reason: count}, failures: [test ids]} of a pytest JUnit report."""
    out: dict = {"passed": 0, "failed": 0, "skipped": 0, "reasons": {}, "failures": []}
    for case in ET.fromstring(xml_text).iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        if (skip := case.find("skipped")) is not None:
            out["skipped"] += 1
            reason = skip.get("message", "").removeprefix("got skip reason ")
            out["reasons"][reason] = out["reasons"].get(reason, 0) + 1
        elif case.find("failure") is not None or case.find("error") is not None:
            out["failed"] += 1
            out["failures"].append(test)
        else:
            out["passed"] += 1
    return out


TEST_NEEDS = ("pytest", "numpy", "onnx", "onnxruntime", "typer", "torch")  # what the GPU test files import


def run_tests(with_tensorrt: bool, root: Path = ROOT) -> dict:
    """pytest over the GPU tests (the engine tests only with TensorRT), in a child process of this Python."""
    import importlib.util

    if missing := [m for m in TEST_NEEDS if importlib.util.find_spec(m) is None]:
        return {"error": f"cannot run: {', '.join(missing)} not installed (pip install -e '.[cpu,dev]' installs them)"}
    files = gpu_test_files(root)
    marker = "gpu" if with_tensorrt else "gpu and not trt"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider", "-m", marker,
               f"--junitxml={report}", *map(str, files)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run(cmd, cwd=root, env=env, text=True, capture_output=True)
        sys.stdout.write(proc.stdout[-20000:])
        if not report.is_file():
            return {"error": f"pytest did not run ({proc.stderr.strip().splitlines()[-1:] or proc.returncode})"}
        return junit_counts(report.read_text()) | {"marker": marker}


def run_bench(root: Path = ROOT) -> dict:
    """plugins/bench_kernels.py --quick in a child process -> its JSON (copy bandwidth, MLA decode rows)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-m", "mtp_trt.plugins.bench_kernels", "--quick", "--seq", "1",
                               "--json", str(out)], cwd=root, env=env, text=True, capture_output=True)
        sys.stdout.write(proc.stdout)
        if proc.returncode != 0 or not out.is_file():
            return {"error": (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]}
        return json.loads(out.read_text())


def headline(bench: dict) -> str:
    """The MLA decode row of BENCH_SHAPE against the copy bandwidth, in words."""
    row = next((r for r in bench.get("mla_decode", []) if all(r[k] == v for k, v in BENCH_SHAPE.items())), None)
    if row is None:
        return "MLA decode at batch 64, cache 4096, 128 heads: not measured (does not fit this GPU)"
    return (f"MLA decode at batch 64, cache 4096, 128 heads, 1 new token ({bench['dtype']}): {row['GBps']:.0f} GB/s "
            f"= {100 * row['GBps'] / bench['copy_GBps']:.0f}% of the {bench['copy_GBps']:.0f} GB/s device-to-device "
            f"copy, {row['time_us']:.1f} us")


def more_headlines(bench: dict) -> list[str]:
    """The DSA selection at batch 1 over 131072 rows and the acceptance kernels at batch 1, in words (where measured)."""
    lines = []
    if row := next((r for r in bench.get("dsa", []) if (r["B"], r["T"], r["S"]) == (1, 131072, 1)), None):
        vs = f", {row['select_x_torch']:.1f}x PyTorch" if "select_x_torch" in row else ""
        lines.append(f"DSA top-{row['topk']} selection at batch 1, cache 131072, 1 new token: {row['select_us']:.1f} us "
                     f"({row['select_TFLOPS']:.0f} TFLOPS{vs}); sparse MLA over the selected rows: "
                     f"{row['attend_us']:.1f} us")
    if row := next((r for r in bench.get("accept", []) if r["B"] == 1), None):
        lines.append(f"acceptance at batch 1, {row['K']} drafts, vocabulary {row['V']}: strict {row['strict_us']:.1f} "
                     f"us, relaxed {row['relaxed_us']:.1f} us, rejection sampling {row['rejection_us']:.1f} us")
    return lines


def check(root: Path = ROOT) -> tuple[int, list[str], dict]:
    """Run every step -> (exit status, the summary's lines, everything as data)."""
    env = environment()
    gpu = env["compute_capability"] is not None
    lines = [f"driver: CUDA {env['driver_cuda'] or 'none (no NVIDIA driver)'}; cuda-python runtime: "
             f"{env['cuda_runtime']}; GPU: "
             + (f"{env.get('gpu', '?')} (compute capability {env['compute_capability']})" if gpu else
                f"none ({env['no_gpu']})"),
             f"TensorRT: {env['tensorrt'] or 'none (' + env['no_tensorrt'] + ')'}"]
    library, why = kernel_library()
    lines.append(f"kernel library: {library}" if library else f"kernel library: cannot be loaded: {why}")
    data: dict = {"environment": env, "kernel_library": library or None, "kernel_library_problem": why or None}
    if not gpu:
        reason = f"skipped: no GPU here ({env['no_gpu']})"
        lines += [f"GPU tests: {reason}", f"kernel benchmarks: {reason}"]
        return SKIPPED, lines, data
    status = 0 if library else 1
    if not (tests_dir := root / "tests").is_dir():
        lines.append(f"GPU tests: skipped: no {tests_dir} (run from a checkout of the repository)")
    else:
        tests = data["tests"] = run_tests(env["tensorrt"] is not None, root)
        if "error" in tests:
            lines.append(f"GPU tests: {tests['error']}")
            status = 1
        else:
            scope = "kernels, device layer and engines" if env["tensorrt"] else "kernels and device layer (no TensorRT)"
            lines.append(f"GPU tests ({scope}): {tests['passed']} passed, {tests['failed']} failed, "
                         f"{tests['skipped']} skipped")
            lines += [f"  failed: {t}" for t in tests["failures"]]
            lines += [f"  skipped ({n}): {r}" for r, n in tests["reasons"].items()]
            if not tests["passed"]:
                lines.append("  no GPU test ran: see the reasons above")
            status = status or (1 if tests["failed"] or not tests["passed"] else 0)
    bench = data["bench"] = run_bench(root) if library else {"error": "no kernel library"}
    if "error" in bench:
        lines.append(f"kernel benchmarks: failed: {bench['error']}")
        status = 1
    else:
        lines += [headline(bench), *more_headlines(bench)]
    return status, lines, data


TARGET_SHAPES = "64x4096,1x4096,1x131072"  # the (batch, cache) shapes of the GPU issue's targets
SWEEP_SHAPES = "1x64,1x4096,1x131072,64x4096"  # 1x64: what a call costs with next to no attention
SWEEP_SPLITS = "8,16,32,66,132"
STEP_LIMIT_S = {"tests": 120, "table": 80, "ncu": 90, "report": 30}


def kernel_session_steps(out: Path, root: Path = ROOT, baseline: Path | None = None) -> list[tuple[str, list[str],
                                                                                                dict]]:
    """The MLA kernel session on a GPU, in order: (name, command, extra environment).  v2 as it is first (its GPU
    tests, its tables with lengths uniform and ragged at the target shapes), then the default path (v3 on compute
    capability 9: the wgmma layout probe runs among the tests, before any table) and v3's seesaw schedule
    (MTP_TRT_MLA_PATH=seesaw), each with its tests, its tables and one Nsight Compute pass on its main kernel at
    H 128, B 64, T 4096, S 1 printed as text; the batch-1 floor and a split-count sweep, with `baseline` (a kernel
    library) the default path's uniform table on it in the same run, then the DSA and acceptance tables."""
    py = sys.executable
    tests = [py, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider", "-m", "gpu and not trt",
             str(root / "tests" / "kernels")]
    steps = []
    paths = (("v2", {"MTP_TRT_MLA_PATH": "v2"}, ["--force-v2"]), ("default", {}, []),
             ("seesaw", {"MTP_TRT_MLA_PATH": "seesaw"}, ["--seesaw"]))
    for path, env, force in paths:
        steps.append((f"{path}: GPU kernel tests", tests, env))
        for lengths in ("uniform", "ragged"):
            steps.append((f"{path}: MLA table, {lengths} lengths",
                          [py, "-m", "mtp_trt.plugins.bench_kernels", "--mla-only", "--shapes", TARGET_SHAPES,
                           f"--{lengths}", *force, "--json", str(out / f"mla-{path}-{lengths}.json")], env))
        if path == "v2":  # its profile is known; the session's time goes to v3's two schedules
            continue
        rep = out / f"ncu-{path}"
        steps.append((f"{path}: Nsight Compute, main kernel at H128 B64 T4096 S1",
                      ["ncu", "--clock-control", "none", "-k", "regex:mla_(v3|seesaw)_kernel", "-c", "1", "--set", "full",
                       "-o", str(rep), "-f", py, "-m", "mtp_trt.plugins.bench_kernels", "--mla-only",
                       "--heads", "128", "--seq", "1", "--shapes", "64x4096", "--iters", "1", "--no-torch",
                       "--uniform", *force], env))
        steps.append((f"{path}: Nsight Compute report as text",
                      ["ncu", "--import", f"{rep}.ncu-rep", "--page", "details", "--print-units", "base"], {}))
    steps.append(("default: batch-1 floor and split sweep",
                  [py, "-m", "mtp_trt.plugins.bench_kernels", "--mla-only", "--heads", "128,16", "--seq", "1",
                   "--shapes", SWEEP_SHAPES, "--splits", SWEEP_SPLITS, "--uniform", "--no-torch", "--json",
                   str(out / "sweep.json")], {}))
    if baseline is not None:
        steps.append(("baseline: MLA table, uniform lengths",
                      [py, "-m", "mtp_trt.plugins.bench_kernels", "--mla-only", "--shapes", TARGET_SHAPES, "--uniform",
                       "--no-torch", "--json", str(out / "mla-baseline-uniform.json")],
                      {"MTP_TRT_KERNEL_LIB": str(baseline)}))
    steps.append(("default: DSA and acceptance tables (ragged)",
                  [py, "-m", "mtp_trt.plugins.bench_kernels", "--quick", "--seq", "1,2", "--json",
                   str(out / "all-ragged.json")], {}))
    return steps


def step_limit(cmd: list[str]) -> int:
    """Seconds a kernel-session step may run (a hung kernel must not eat the session)."""
    if cmd[0] == "ncu":
        return STEP_LIMIT_S["report" if "--import" in cmd else "ncu"]
    return STEP_LIMIT_S["tests" if "pytest" in cmd else "table"]


def run_step(cmd: list[str], env: dict, cwd: Path, limit: float) -> tuple[int | None, str]:
    """(exit status, or None when it ran past `limit` seconds and was killed with its children; its output)."""
    import signal

    proc = subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        text = proc.communicate(timeout=limit)[0]
        return proc.returncode, text
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None, proc.communicate()[0]


def kernel_session(out: Path, root: Path = ROOT, deadline_s: float = 540.0, baseline: Path | None = None) -> int:
    """Run kernel_session_steps, each step's output to out/<n>.log and its tail to stdout, each within its own limit
    and all within `deadline_s` seconds (later steps are skipped, saying so); 1 if any step failed."""
    import shutil
    import time

    out.mkdir(parents=True, exist_ok=True)
    status, end = 0, time.monotonic() + deadline_s
    for n, (name, cmd, env) in enumerate(kernel_session_steps(out, root, baseline)):
        if cmd[0] == "ncu" and shutil.which("ncu") is None:
            print(f"== {name}: skipped (ncu not found)")
            continue
        if "--import" in cmd and not Path(cmd[cmd.index("--import") + 1]).is_file():
            print(f"== {name}: skipped (no report)")
            continue
        if (left := end - time.monotonic()) < 10:
            print(f"== {name}: skipped (the session's {deadline_s:.0f} s are spent)")
            status = 1
            continue
        full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        t0 = time.monotonic()
        code, text = run_step(cmd, full_env, root, min(step_limit(cmd), left))
        took = time.monotonic() - t0
        (out / f"{n:02d}.log").write_text(f"$ {' '.join(cmd)}\n{text}")
        print(f"== {name}: " + (f"exit status {code}" if code is not None else "killed: ran past its limit")
              + f" ({took:.0f} s)")
        print("\n".join(text.strip().splitlines()[-40:]), flush=True)
        status = status or (1 if code != 0 else 0)
    return status


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtp_trt.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE", help="also write everything measured as JSON")
    ap.add_argument("--kernels", metavar="DIR",
                    help="instead: the MLA kernel session (v2, then the default path: GPU tests, tables uniform and "
                         "ragged, one Nsight Compute pass each), logs and JSON in DIR")
    ap.add_argument("--deadline", type=float, default=540.0, metavar="SECONDS",
                    help="with --kernels: the whole session's time; steps left when it is spent are skipped")
    ap.add_argument("--baseline", metavar="LIB",
                    help="with --kernels: also the default path's uniform table on this kernel library, in the same "
                         "run (an A/B of a kernel change)")
    args = ap.parse_args(argv)
    if args.baseline and not Path(args.baseline).is_file():
        ap.error(f"--baseline {args.baseline}: no such file")
    if args.kernels:
        return kernel_session(Path(args.kernels), deadline_s=args.deadline,
                              baseline=Path(args.baseline).resolve() if args.baseline else None)
    status, lines, data = check()
    print("\n== mtp-trt GPU check ==")
    for line in lines:
        print(line)
    print(f"result: {'passed' if status == 0 else 'skipped' if status == SKIPPED else 'FAILED'}")
    if args.json:
        Path(args.json).write_text(json.dumps(data | {"summary": lines, "status": status}, indent=2) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
