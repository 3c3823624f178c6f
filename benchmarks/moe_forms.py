"""Time one MoE layer in each form (exporters/moe.py) on ONNX Runtime, interleaved, medians over 16 different
inputs per token count (each routes its tokens differently): which form pays at which token count.
`ort:P` is the MoE node with each expert split in P parts (`ort` is the exporter's default, moe.PARTS).

  python benchmarks/moe_forms.py [--hidden 768 --experts 16 --topk 2 --inter 256] [--forms static ort ort:1 gather]"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from mtp_trt.config import ModelConfig
from mtp_trt.exporters.model import MoE
from mtp_trt.exporters.moe import moe_forward, routed_ort, swiglu


class Layer(torch.nn.Module):
    def __init__(self, moe, form):
        super().__init__()
        self.moe, self.form = moe, form

    def forward(self, x):
        b, s = x.shape[:2]
        if ":" not in self.form:
            return moe_forward(self.moe, x, b, s, self.form)
        return routed_ort(self.moe, x, b, s, int(self.form.split(":")[1])) + swiglu(self.moe.shared_experts, x)  # ort:P


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--inter", type=int, default=256)
    ap.add_argument("--groups", type=int, nargs=2, default=(1, 1))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 32, 128, 512])
    ap.add_argument("--forms", nargs="+", default=["static", "ort", "ort:1", "gather"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import onnxruntime as ort

    cfg = ModelConfig.from_dict(dict(
        vocab_size=64, hidden_size=a.hidden, intermediate_size=a.inter, moe_intermediate_size=a.inter,
        num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, kv_lora_rank=16, q_lora_rank=None,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=a.experts, n_shared_experts=1,
        num_experts_per_tok=a.topk, n_group=a.groups[0], topk_group=a.groups[1], norm_topk_prob=True,
        routed_scaling_factor=2.5, max_position_embeddings=64))
    torch.manual_seed(0)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.05)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = a.threads
    opts.add_session_config_entry("session.force_spinning_stop", "1")
    if "cpu" in a.forms:
        from mtp_trt.plugins import ort_lib

        ort_lib.register(opts)
    sessions = {}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for form in a.forms:
            path = Path(tmp) / f"{form}.onnx"
            torch.onnx.export(Layer(moe, form), (torch.randn(2, 3, a.hidden),), str(path), dynamo=False,
                              opset_version=18, input_names=["x"], output_names=["y"],
                              dynamic_axes={"x": {0: "B", 1: "S"}, "y": {0: "B", 1: "S"}})
            sessions[form] = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    print(f"D={a.hidden} E={a.experts} k={a.topk} I={a.inter}: ms per MoE layer (median of {a.repeats} x 16 inputs)")
    print("tokens " + " ".join(f"{f:>9}" for f in a.forms) + "   max|diff| vs the first")
    for n in a.tokens:
        xs = [np.random.default_rng([n, i]).standard_normal((1, n, a.hidden)).astype(np.float32) for i in range(16)]
        times = {f: [] for f in a.forms}
        outs = {f: s.run(None, {"x": xs[0]})[0] for f, s in sessions.items()}
        for _ in range(a.repeats):
            for x in xs:
                for f, s in sessions.items():
                    t0 = time.perf_counter()
                    s.run(None, {"x": x})
                    times[f].append(time.perf_counter() - t0)
        diff = {f: float(np.abs(outs[f] - outs[a.forms[0]]).max()) for f in a.forms}
        print(f"{n:6d} " + " ".join(f"{1e3 * statistics.median(times[f]):9.3f}" for f in a.forms)
              + "   " + " ".join(f"{d:.1e}" for d in diff.values()))


if __name__ == "__main__":
    main()
