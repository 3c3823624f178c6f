"""Peak resident memory of `mtp-trt export` per stage (loading, tracing each graph, sharing the weights),
sampled every 50 ms in a thread.  python benchmarks/export_memory.py CHECKPOINT OUT [--nextn 1]"""

from __future__ import annotations

import argparse
import threading
import time


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--nextn", type=int, default=1)
    a = ap.parse_args()
    from mtp_trt.exporters.export import export

    stage, peaks, t0 = ["start"], {}, time.perf_counter()

    def sample():
        while stage[0] != "done":
            peaks[stage[0]] = max(peaks.get(stage[0], 0.0), rss_mb())
            time.sleep(0.05)

    threading.Thread(target=sample, daemon=True).start()

    def progress(msg):
        print(f"{time.perf_counter() - t0:7.1f} s  RSS {rss_mb():7.0f} MB  peak of previous stage "
              f"{peaks.get(stage[0], 0):7.0f} MB  -> {msg}", flush=True)
        stage[0] = msg

    import onnx
    import torch

    def staged(name, fn):  # each call of fn is a stage of its own
        def wrapped(*args, **kwargs):
            before = stage[0]
            progress(f"  {name}")
            try:
                return fn(*args, **kwargs)
            finally:
                progress(f"  (after {name}) {before}")
        return wrapped

    torch.onnx.export = staged("torch.onnx.export", torch.onnx.export)
    onnx.load = staged("onnx.load", onnx.load)
    onnx.checker.check_model = staged("onnx.checker.check_model", onnx.checker.check_model)
    onnx.shape_inference.infer_shapes_path = staged("infer_shapes_path", onnx.shape_inference.infer_shapes_path)
    export(a.checkpoint, a.out, nextn=a.nextn, max_seq_len=1024, progress=progress)
    progress("done")
    print({k: round(v) for k, v in peaks.items()})


if __name__ == "__main__":
    main()
