"""Many `mtp-trt` command lines in one fresh interpreter (tests/test_robustness.py, tests/test_first_hour.py): a
preamble sets the process up (a memory limit, packages hidden), then each argv runs through `mtp_trt.cli.entry`
with its exit status, stderr and stdout captured; a traceback counts as status -1 with the traceback as stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_LOOP = r"""
import contextlib, io, json, sys
from mtp_trt.cli import entry
out = []
for argv in json.loads(sys.stdin.read()):
    sys.argv = ["mtp-trt", *argv]
    err, std = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
        try:
            code = entry()
        except SystemExit as e:
            code = e.code
        except BaseException:
            import traceback
            code, err = -1, io.StringIO(traceback.format_exc())
    out.append([code, err.getvalue(), std.getvalue()])
sys.__stdout__.write(json.dumps(out))
"""


def run_cli(cases: list[list], cache: Path, preamble: str = "", arg: str = "") -> list[tuple[int, str, str]]:
    """Each argv of `cases` (items turned to str) run after `preamble` (which may read `arg` as sys.argv[1]), with
    MTP_TRT_CACHE_DIR = cache: [(status, stderr, stdout)]."""
    argvs = [[str(a) for a in argv] for argv in cases]
    r = subprocess.run([sys.executable, "-c", preamble + _LOOP, arg], input=json.dumps(argvs), capture_output=True,
                       text=True, timeout=600, env={**os.environ, "MTP_TRT_CACHE_DIR": str(cache)})
    assert r.returncode == 0, r.stderr[-3000:]
    return [tuple(x) for x in json.loads(r.stdout)]
