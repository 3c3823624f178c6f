"""Peak resident memory and wall time of `mtp-trt export`, per stage (reading the headers; per graph: tracing on
placeholder weights, folding, writing its weights to weights.bin, checking), sampled every 20 ms in a thread,
and the process's own peak (VmHWM) at the end.

  python benchmarks/export_memory.py CHECKPOINT OUT [--nextn 1] [--max-seq-len 1024]
  python benchmarks/export_memory.py 304m OUT       # the random 304M checkpoint (benchmarks/bench_common.py)

The export streams the weights (exporters/streaming.py): its peak is a fixed overhead (Python, torch,
the traced graphs) plus a few times the largest layer's tensors, not the model's size.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path


def status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) / 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", help="a checkpoint directory, or the size of a random checkpoint of "
                                       "benchmarks/bench_common.py (85m, 304m)")
    ap.add_argument("out")
    ap.add_argument("--nextn", type=int, default=1)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    a = ap.parse_args()
    ckpt = a.checkpoint
    if not Path(ckpt).is_dir():  # made (or found in the cache) by a process of its own: it holds the model
        code = f"import bench_common; print(bench_common.make_checkpoint({ckpt!r}))"
        ckpt = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, check=True,
                              capture_output=True, text=True).stdout.strip().splitlines()[-1]

    import onnx

    from mtp_trt.exporters import export as export_mod
    from mtp_trt.exporters import streaming

    stage, peaks, seconds, t0 = ["start"], {}, {}, time.perf_counter()
    started, graph = [t0], ["-"]

    def sample():
        while stage[0] != "done":
            peaks[stage[0]] = max(peaks.get(stage[0], 0.0), status_mb("VmRSS"))
            time.sleep(0.02)

    def enter(name: str) -> str:
        before, now = stage[0], time.perf_counter()
        seconds[before] = seconds.get(before, 0.0) + now - started[0]
        started[0] = now
        stage[0] = name
        return before

    def staged(name, fn):  # each call of fn counts to the stage "<graph>: name"
        def wrapped(*args, **kwargs):
            before = enter(f"{graph[0]}: {name}")
            try:
                return fn(*args, **kwargs)
            finally:
                enter(before)
        return wrapped

    def progress(msg):
        print(f"{time.perf_counter() - t0:7.1f} s  RSS {status_mb('VmRSS'):7.0f} MB  peak so far "
              f"{status_mb('VmHWM'):7.0f} MB  {msg}", flush=True)
        words = msg.split(" ")
        graph[0] = words[1] if words[0] == "exporting" else "-"
        enter(" ".join(words[:2]) if words[0] == "exporting" else words[0])

    export_mod._trace = staged("tracing (torch.onnx.export)", export_mod._trace)
    export_mod.fold_graph = staged("folding", export_mod.fold_graph)
    streaming.WeightStore.put = staged("writing weights", streaming.WeightStore.put)
    onnx.checker.check_model = staged("checking", onnx.checker.check_model)
    onnx.shape_inference.infer_shapes_path = staged("checking", onnx.shape_inference.infer_shapes_path)
    threading.Thread(target=sample, daemon=True).start()
    start_rss = status_mb("VmRSS")
    export_mod.export(ckpt, a.out, nextn=a.nextn, max_seq_len=a.max_seq_len, progress=progress)
    wall = time.perf_counter() - t0
    enter("done")
    weights = (Path(a.out) / "weights.bin").stat().st_size / 2**20
    print("\nstage                                         peak RSS MB   seconds")
    for name, peak in peaks.items():
        if seconds.get(name, 0) >= 0.05:
            print(f"{name:45s} {peak:11.0f} {seconds[name]:9.1f}")
    print(f"\nweights.bin {weights:.0f} MB; RSS before the export {start_rss:.0f} MB; peak RSS (VmHWM) "
          f"{status_mb('VmHWM'):.0f} MB; wall {wall:.1f} s")


if __name__ == "__main__":
    main()
