"""`mtp-trt run` and `mtp-trt export` end to end, as a user calls them."""

import json
import os
import subprocess

import pytest

from runtime_models import make_self_drafting


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_self_drafting(tmp_path_factory.mktemp("cli") / "ckpt", nextn=2)


def mtp_trt(*args, env=None):
    return subprocess.run(["mtp-trt", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def test_run_exports_a_checkpoint_on_first_use_then_reuses_it(ckpt, tmp_path):
    env = {"MTP_TRT_CACHE_DIR": str(tmp_path / "cache")}
    r = mtp_trt("run", ckpt, "-p", "def f(x):", "--max-new-tokens", "12", env=env)
    assert r.returncode == 0, r.stderr
    assert "exporting target.onnx" in r.stderr and "12 new tokens" in r.stderr
    assert r.stdout.startswith("def f(x):")
    assert "tokens per step, acceptance per draft position" in r.stderr
    again = mtp_trt("run", ckpt, "-p", "def f(x):", "--max-new-tokens", "12", env=env)
    assert again.returncode == 0 and "exporting" not in again.stderr
    assert again.stdout == r.stdout
    assert len(list((tmp_path / "cache" / "exports").iterdir())) == 1


def test_run_exports_tree_graphs_only_when_a_tree_is_drafted(ckpt, tmp_path):
    """A run drafting chains exports no tree step graphs (a third of the export); one with --tree-topk exports
    the checkpoint with them, which later runs of either kind reuse."""
    env = {"MTP_TRT_CACHE_DIR": str(tmp_path / "cache")}
    exports = tmp_path / "cache" / "exports"
    chain = mtp_trt("run", ckpt, "-p", "def f(x):", "--max-new-tokens", "12", env=env)
    assert chain.returncode == 0, chain.stderr
    assert "exporting step_2.onnx" in chain.stderr and "exporting tree_" not in chain.stderr
    [entry] = exports.iterdir()
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["trees"] == [] and not [g for g in manifest["graphs"] if g.startswith("tree_")]
    assert not list(entry.glob("tree_*"))
    tree = mtp_trt("run", ckpt, "-p", "def f(x):", "--max-new-tokens", "12", "--tree-topk", "2", env=env)
    assert tree.returncode == 0, tree.stderr
    assert "exporting tree_2_2_4.onnx" in tree.stderr and "tree 2:2:4" in tree.stderr
    assert tree.stdout == chain.stdout  # greedy: a tree drafts, the output is the model's
    assert len(list(exports.iterdir())) == 2
    for argv in ([], ["--tree-topk", "2"]):
        again = mtp_trt("run", ckpt, "-p", "def f(x):", "--max-new-tokens", "12", *argv, env=env)
        assert again.returncode == 0 and "exporting" not in again.stderr, again.stderr
        assert again.stdout == chain.stdout
    assert len(list(exports.iterdir())) == 2


def test_run_json_batch_and_nextn_zero_agree(ckpt, tmp_path):
    out = tmp_path / "exp"
    assert mtp_trt("export", ckpt, "-o", out, "--mtp-mode", "vanilla").returncode == 0
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n\nclass A:\n")
    runs = {}
    for nextn in (0, 2):
        r = mtp_trt("run", out, "--prompt-file", prompts, "-p", "import os", "--nextn", nextn, "--json",
                    "--max-new-tokens", "16")
        assert r.returncode == 0, r.stderr
        runs[nextn] = json.loads(r.stdout)
    assert [x["prompt"] for x in runs[2]["results"]] == ["import os", "def f(x):", "class A:"]
    assert [x["tokens"] for x in runs[0]["results"]] == [x["tokens"] for x in runs[2]["results"]]
    s = runs[2]["summary"]
    assert s["new_tokens"] == 48 and s["nextn"] == 2 and len(s["acceptance_rate_per_pos"]) == 2
    assert s["mean_acceptance_length"] > 1


def test_run_with_speculative_configs(ckpt, tmp_path):
    out = tmp_path / "exp"
    assert mtp_trt("export", ckpt, "-o", out).returncode == 0
    vllm = tmp_path / "vllm.json"
    vllm.write_text(json.dumps({"method": "deepseek_mtp", "num_speculative_tokens": 1}))
    r = mtp_trt("run", out, "-p", "x = 1", "--config", vllm, "--json", "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["summary"]["nextn"] == 1
    trt = tmp_path / "trtllm.json"
    trt.write_text(json.dumps({"speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 2,
                                                      "use_mtp_vanilla": True}}))
    r = mtp_trt("run", out, "-p", "x = 1", "--config", trt)
    assert r.returncode == 2 and "exported in eagle mode, but --mtp-mode vanilla was asked" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"method": "medusa", "num_speculative_tokens": 2}))
    r = mtp_trt("run", out, "-p", "x", "--config", bad)
    assert r.returncode == 2 and "valid methods: deepseek_mtp, mtp" in r.stderr


@pytest.mark.parametrize("args,message", [
    ((), "no prompt: give --prompt TEXT or --prompt-file FILE"),
    (("-p", "x", "--nextn", "5"), "--nextn must be in 0..2"),
    (("-p", "x", "--temperature", "-1"), "--temperature must be >= 0"),
    (("-p", "x", "--prompt-file", "/nonexistent"), "/nonexistent: prompt file not found"),
    (("-p", "x", "--threads", "-1"), "--threads must be >= 0"),
])
def test_run_bad_input_is_one_line(ckpt, tmp_path, args, message):
    env = {"MTP_TRT_CACHE_DIR": str(tmp_path / "cache")}
    r = mtp_trt("run", ckpt, *args, env=env)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_run_stops_at_the_cache_limit(ckpt, tmp_path):
    """`run` at the cache limit: finish reason length with its message, and MTP (the export's nextn, K chosen per
    step or fixed) gives plain decoding's tokens up to it."""
    out = tmp_path / "exp"
    assert mtp_trt("export", ckpt, "-o", out, "--max-seq-len", "24").returncode == 0
    results = []
    for args in (["--nextn", "0"], [], ["--speculation", "fixed"]):
        r = mtp_trt("run", out, "-p", "def f(x): return x", "--max-new-tokens", "50", "--json", "--threads", "1",
                    *args)
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)["results"][0]
        assert res["finish_reason"] == "length" and "KV cache full (24 rows per sequence)" in res["message"]
        results.append((res["tokens"], res["text"]))
    assert results[1] == results[0] and results[2] == results[0]


def test_bench_times_every_configuration_and_writes_json_and_plot(ckpt, tmp_path):
    """`mtp-trt bench --full` on a small checkpoint: every (mode, nextn, batch) and transformers' generate are timed,
    every nextn generates the same greedy tokens as nextn 0, and the summary relates them."""
    out = tmp_path / "bench.json"
    r = mtp_trt("bench", ckpt, "--full", "--batch", 1, "--batch", 2, "--max-new-tokens", 6, "--repeats", 1, "--out",
                out, "--plot", tmp_path / "bench.png", env={"MTP_TRT_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr + r.stdout
    data = json.loads(out.read_text())
    mine = [x for x in data["runs"] if x["engine"] == "mtp-trt/onnxruntime"]
    assert sorted((x["mode"], x["batch"], x["nextn"], x["tree"] or "") for x in mine) == sorted(
        [(m, b, n, "") for m in ("eagle", "vanilla") for b in (1, 2) for n in range(3)]
        + [(m, b, 2, "2:2:4") for m in ("eagle", "vanilla") for b in (1, 2)])  # the default tree up to depth 2
    assert all(x["same_tokens_as_nextn0"] and x["tokens_per_second"] > 0 for x in mine)
    assert all(1 <= x["mean_acceptance_length"] <= x["nextn"] + 1 for x in mine)
    assert {x["batch"] for x in data["runs"] if x["engine"] == "transformers.generate"} == {1, 2}
    assert len(data["summary"]) == 4 and all(s["nextn0_over_transformers"] > 0 for s in data["summary"])
    assert {s["mode"]: s.get("best_tree") for s in data["summary"]} == {"eagle": "2:2:4", "vanilla": "2:2:4"}
    assert "best tree 2:2:4" in r.stdout
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_bench_summary_judges_the_fastest_drafting_nextn():
    """The speedup-per-accepted-token figure is the fastest nextn >= 1's, even when nextn 0 is faster."""
    from mtp_trt.bench import summarize

    def row(nextn, tps, accepted):
        return {"engine": "mtp-trt/onnxruntime", "mode": "vanilla", "batch": 8, "nextn": nextn,
                "tokens_per_second": tps, "mean_acceptance_length": accepted}
    rows = [row(0, 100.0, 1.0), row(1, 90.0, 1.8), row(2, 80.0, 2.4),
            {"engine": "transformers.generate", "mode": "-", "batch": 8, "nextn": 0, "tokens_per_second": 20.0}]
    (s,) = summarize(rows)
    assert (s["best_nextn"], s["nextn0_over_transformers"]) == (1, 5.0)
    assert s["speedup_over_nextn0"] == pytest.approx(0.9) and s["speedup_over_mean_acceptance_length"] == pytest.approx(0.5)
    assert s["step_cost_over_plain_step"] == pytest.approx(2.0)  # a step of nextn 1 costs two plain steps


def test_bench_summary_sets_the_best_tree_against_the_chains():
    from mtp_trt.bench import summarize

    def row(nextn, tps, accepted, tree=None):
        return {"engine": "mtp-trt/onnxruntime", "mode": "eagle", "batch": 1, "nextn": nextn, "tree": tree,
                "tokens_per_second": tps, "mean_acceptance_length": accepted}
    rows = [row(0, 100.0, 1.0), row(1, 120.0, 1.8), row(3, 110.0, 2.8), row(3, 132.0, 3.3, "3:2:6"),
            row(3, 125.0, 3.4, "3:3:8")]
    (s,) = summarize(rows)
    assert (s["best_nextn"], s["best_tree"]) == (1, "3:2:6")  # the chains' best is judged without the trees
    assert s["tree_over_best_chain"] == pytest.approx(1.1) and s["tree_speedup_over_nextn0"] == pytest.approx(1.32)
    assert s["tree_acceptance_length_over_chain_same_depth"] == pytest.approx(0.5)  # against nextn 3's chain


def test_bench_ratios_pair_the_runs_of_each_round():
    """A machine whose speed swings between rounds: per-round ratios see the true 2x, medians' ratio does not."""
    from mtp_trt.bench import ratio

    a = {"tokens": 100, "round_seconds": [1.0, 4.0, 4.1], "tokens_per_second": 100 / 4.0}
    b = {"tokens": 100, "round_seconds": [2.0, 2.1, 8.2], "tokens_per_second": 100 / 2.1}
    assert ratio(a, b) == pytest.approx(2.0)  # a was twice as fast in two rounds of three
    assert a["tokens_per_second"] / b["tokens_per_second"] < 1  # the medians come from different rounds
    assert ratio(a, {"tokens": 100, "tokens_per_second": 50.0}) == pytest.approx(0.5)  # no rounds: medians
