"""TrtBackend (mtp_trt/trt/runtime.py) without a GPU: engine directories that TensorRT for RTX builds here, run by
the runtime over host-memory stand-ins of the device and the engines (tests/trt_fakes.py: each engine reads its
bound inputs, runs the onnx lowering of the same graph on ONNX Runtime and writes its bound outputs; plugin
engines also write their cache rows in place, as the attention plugin does).

What this checks: the planning (profiles, shapes, chunked prefill, the binding table, aliasing, commits, buffer
sizes, swaps) and the decode loop on it give exactly ONNX Runtime's tokens, in both lowerings and both MTP
modes, greedy, relaxed and sampling, with and without CUDA graphs; and a decode step allocates nothing and
copies nothing of a cache's size.  What needs a GPU (tests/test_trt_gpu.py): TensorRT running the engines,
the CUDA kernels inside them, cuda-python's device layer."""

import json
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

from mtp_trt.backend import OrtBackend, chunks
from mtp_trt.contract import CacheSlot, cache_slot
from mtp_trt.cli import app
from mtp_trt.decode import DecodeOptions, Sequence, generate, sequence_rng
from mtp_trt.errors import MtpTrtError
from mtp_trt.exporters.export import export
from mtp_trt.manifest import Manifest
from mtp_trt.sampling import SamplingParams
from mtp_trt.trt import manifest as em
from mtp_trt.trt import plan
from runtime_models import EOS, THINK, drive, make_self_drafting
from trt_fakes import fake_backend

pytestmark = pytest.mark.trt
K = 2
PROMPTS = [[1, 5, 9, 13, 2, 7, 30, 31, 4, 8, 12], [3, 4], [11, 12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_self_drafting(tmp_path_factory.mktemp("rt") / "ckpt", nextn=K)


def _build(export_dir, out, **kwargs):
    r = CliRunner().invoke(app, ["build", str(export_dir), "-o", str(out), "--target-arch", "8.9",
                                 *[x for k, v in kwargs.items() for x in (f"--{k.replace('_', '-')}", str(v))]])
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module", params=["eagle", pytest.param("vanilla", marks=pytest.mark.slow)])
def setup(request, ckpt, tmp_path_factory):
    """(reference onnx export, {lowering: engine dir}) for one MTP mode; the prefill profile takes 8 rows, so
    the 11-token prompt runs in chunks."""
    mode, root = request.param, tmp_path_factory.mktemp(request.param)
    ref = export(ckpt, root / "onnx", nextn=K, mtp_mode=mode, max_batch=4, max_seq_len=64)
    plug = export(ckpt, root / "plugin", nextn=K, mtp_mode=mode, lowering="plugin", max_batch=4, max_seq_len=64)
    plain = export(ckpt, root / "onnx-trt", nextn=K, mtp_mode=mode, max_batch=4, max_seq_len=64, moe_form="tensorrt")
    engines = {"plugin": _build(plug, root / "eng-plugin", max_prefill=8),
               "onnx": _build(plain, root / "eng-onnx", max_prefill=8)}
    return Manifest.load(ref), engines


def _opts(nextn, **kw):
    return DecodeOptions(nextn=nextn, eos_ids=(EOS,), think_ids=THINK, max_new_tokens=kw.pop("max_new_tokens", 24), **kw)


def _tokens(backend, prompts, opts, seed=0):
    seqs, stats = generate(backend, prompts, opts, seed=seed)
    return [s.generated for s in seqs], stats


@pytest.fixture(scope="module")
def greedy(setup):
    """ONNX Runtime's greedy tokens for nextn 0..K (all equal: greedy MTP is lossless)."""
    ref, _ = setup
    want = {n: _tokens(OrtBackend(ref), PROMPTS, _opts(n))[0] for n in range(K + 1)}
    assert all(w == want[0] for w in want.values())
    return want


@pytest.mark.parametrize("lowering", ["plugin", "onnx"])
@pytest.mark.parametrize("graphs", [True, False])
def test_greedy_decode_equals_onnxruntime(setup, greedy, lowering, graphs):
    ref, engines = setup
    want = greedy
    for n in range(K + 1):
        backend = fake_backend(engines[lowering], ref, cuda_graphs=graphs)
        got, stats = _tokens(backend, PROMPTS, _opts(n))
        assert got == want[n], f"nextn {n}"
        if n:
            assert stats.mean_acceptance_length > 1
        launches = backend.device.counts["graph_launches"]
        assert (launches > 0) == graphs, "the fused steps replay captured graphs exactly when asked"


@pytest.mark.parametrize("lowering", ["plugin", "onnx"])
def test_tree_decoding_equals_onnxruntime(setup, greedy, lowering):
    """Tree drafting (both modes, the export's default tree): the tree step's tensors bound (vanilla: the carry and
    one cache per module, committed at past_len + 1 - k in the onnx lowering: the same trees drafted as on ONNX
    Runtime) and its accepted path's
    rows committed by the runtime (both lowerings: the plugin engine's stand-in leaves garbage where it wrote
    the tree's nodes, so a missing commit shows) give ONNX Runtime's greedy tokens, with and without CUDA graphs; a
    tree the engines lack is one error."""
    from mtp_trt.tree import TreeShape

    ref, engines = setup
    opts = _opts(K, tree=TreeShape(2, 2, 4))
    trees = [s.draft_log for s in generate(OrtBackend(ref), PROMPTS, opts)[0]]
    for graphs in (True, False):
        backend = fake_backend(engines[lowering], ref, cuda_graphs=graphs)
        seqs, stats = generate(backend, PROMPTS, opts)
        assert [s.generated for s in seqs] == greedy[0] and stats.mean_acceptance_length > 1
        assert [s.draft_log for s in seqs] == trees  # the same trees: every MTP cache row where ONNX Runtime has it
        assert (backend.device.counts["graph_launches"] > 0) == graphs
        assert backend.kernels.calls > 0  # the path's rows were committed by the runtime
    with pytest.raises(MtpTrtError, match="no tree_2_3_5.engine .*--trees 2:3:5"):
        _tokens(fake_backend(engines[lowering], ref), PROMPTS, _opts(K, tree=TreeShape(2, 3, 5)))


def test_relaxed_acceptance_and_sampling_equal_onnxruntime(setup):
    ref, engines = setup
    think = THINK[0]
    prompts = [[think, 5, 9, 13], [3, 4, think, 6]]
    relaxed = _opts(K, relaxed_topk=3, relaxed_delta=0.5)
    assert _tokens(fake_backend(engines["plugin"], ref), prompts, relaxed)[0] == \
        _tokens(OrtBackend(ref), prompts, relaxed)[0]
    sampled = _opts(K, sampling=SamplingParams(temperature=0.9, top_k=20, top_p=0.95))
    for seed in (0, 1):
        assert _tokens(fake_backend(engines["onnx"], ref), prompts, sampled, seed)[0] == \
            _tokens(OrtBackend(ref), prompts, sampled, seed)[0]


def test_forced_rejections_rewind(setup, greedy):
    """Random drafts (almost all rejected) still give the greedy tokens: rewinds by length are right."""
    ref, engines = setup
    backend = fake_backend(engines["plugin"], ref, cuda_graphs=False)
    real_step = backend.step
    rng = np.random.default_rng(0)

    def scrambled(n, input_ids, *args, **kw):
        ids = input_ids.copy()
        ids[:, 1:] = rng.integers(0, 90, ids[:, 1:].shape)
        return real_step(n, ids, *args, **kw)

    backend.step = scrambled
    got, stats = _tokens(backend, PROMPTS, _opts(K))
    assert got == greedy[0]
    assert stats.mean_acceptance_length < 1.5


def test_a_decode_step_allocates_nothing_and_copies_no_cache(setup):
    ref, engines = setup
    backend = fake_backend(engines["plugin"], ref)
    dev = backend.device
    backend.prepare(K, True)
    backend.allocate(3, 60)
    allocs = dev.counts["alloc"]
    caches = sum(map(len, backend.caches.values()))
    assert allocs == caches + len(backend.buffers) + 2  # caches, one per input name, the outputs, the swap slot
    ids = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], np.int32)
    zeros = np.zeros(3, np.int32)
    backend.target(3, np.array(PROMPTS[0][:4] * 3, np.int32).reshape(3, 4), zeros, zeros, 0, 0.0, False)
    carry = np.zeros((3, K - 1, ref.config.hidden_size), np.float32) if ref.mtp_mode == "vanilla" else None
    dev.copies.clear()
    for step in range(6):
        out = backend.step(3, ids, np.full(3, 4 + 3 * step, np.int32), zeros, 0, 0.0, carry)
        assert set(out) >= {"accepted_tokens", "num_accepted", "thinking_out", "drafts"}
    assert dev.counts["alloc"] == allocs and dev.counts["alloc_host"] == len(backend.buffers) + 1
    slot = backend.slot_bytes
    assert dev.copies and max(b for _, b in dev.copies) < slot / 4, "only small inputs and outputs move"
    assert {k for k, _ in dev.copies} == {"h2d", "d2h"}
    assert dev.counts["graphs"] == 1 and dev.counts["graph_launches"] == 5  # step 1 eager, 2 captured, 3..6 replayed


def test_swap_slots_moves_rows_on_the_device(setup):
    ref, engines = setup
    backend = fake_backend(engines["onnx"], ref)
    backend.allocate(3, 16)
    from trt_fakes import view

    d = ref.config.latent_dim
    caches = [view(p, (3, 16, d), np.float32) for bufs in backend.caches.values() for p in bufs]
    for c in caches:
        c[...] = np.arange(c.size, dtype=np.float32).reshape(c.shape)
    before = [c.copy() for c in caches]
    backend.device.copies.clear()
    backend.swap_slots(0, 2)
    for c, b in zip(caches, before):
        np.testing.assert_array_equal(c[[2, 1, 0]], b)
    assert {k for k, _ in backend.device.copies} == {"d2d"}


def test_planning_from_real_engine_directories(setup):
    ref, engines = setup
    for lowering, root in engines.items():
        m = em.EngineManifest.load(root, verify_hashes=True)
        assert m.raw["lowering"] == lowering and m.raw["built_on"] is None  # no GPU here
        exp = em.load_export_manifest(root)
        for name, e in m.raw["engines"].items():
            io = plan.engine_io(exp.graphs[name], lowering)
            assert e["aliases"] == io.aliases
            if lowering == "plugin":
                assert sorted(io.aliases.values()) == sorted(io.kv_inputs) and len(io.aliases) == len(io.kv_inputs)
            else:
                assert io.aliases == {} and all(o.startswith(("new_kv", "mtp_new_kv")) for o in io.kv_outputs)
        assert plan.choose_profile(m.profiles, K + 1, 4) == 0 and plan.choose_profile(m.profiles, 5, 1) == 1
        assert plan.max_chunk(m.profiles) == 8
        with pytest.raises(MtpTrtError, match="no optimization profile .* 9 new tokens"):
            plan.choose_profile(m.profiles, 9, 1)
        ios = [plan.engine_io(g, lowering) for g in exp.graphs.values()]
        sizes = plan.buffer_sizes(ios, 4, 64, 8)
        assert sizes["input_ids"] == 4 * 8 * 4 and "logits" not in sizes  # inputs only
        assert not any(n.startswith("kv") for n in sizes)
        layout, size = plan.output_layout(ios, 4, 64, 8)
        logits = 4 * 8 * ref.config.vocab_size * 4
        assert layout["target"]["logits"] % plan.ALIGN == 0 and size >= logits
        per_engine = [sum(-(-plan.nbytes(t, {"B": 4, "S": 8, "T": 64}) // 256) * 256 for t in io.data_outputs)
                      for io in ios]
        assert size == max(per_engine) < sum(per_engine)  # the engines' outputs overlap
        read, host = plan.output_layout(ios, 4, 64, 8, {"target_tokens", "accepted_tokens"})
        assert read["target"].keys() == {"target_tokens", "accepted_tokens"} and host < logits


def test_plan_helpers():
    assert cache_slot("kv_3") == CacheSlot("target", 3)
    assert cache_slot("mtp_kv") == CacheSlot("mtp0", 0)
    assert cache_slot("mtp_kv_2") == CacheSlot("mtp2", 0, -2)
    assert cache_slot("kv", "mtp1") == CacheSlot("mtp1", 0)
    assert chunks(11, 8) == [(0, 8), (8, 3)] and chunks(8, 8) == [(0, 8)]
    assert "1.00 GiB" in plan.memory_problem(2 ** 30, 2 ** 29) and plan.memory_problem(1, 2) is None


def test_too_little_device_memory_is_one_clear_error(setup):
    ref, engines = setup
    backend = fake_backend(engines["plugin"], ref, free_bytes=1 << 16)
    with pytest.raises(MtpTrtError, match=r"need about .* GiB of GPU memory, .* GiB is free"):
        backend.allocate(4, 64)


def test_check_decode_comparison(setup):
    """`mtp-trt check`'s end-to-end part: the engines' greedy tokens against ONNX Runtime for nextn 0..K."""
    from mtp_trt.trt.check import decode_comparison

    ref, engines = setup
    ok, lines = decode_comparison(fake_backend(engines["plugin"], ref), ref, "fp32", max_new_tokens=12)
    assert ok and len(lines) == K + 1 and all("tokens equal ONNX Runtime's, " in x for x in lines)
    backend = fake_backend(engines["plugin"], ref)
    real = backend.step

    def off_by_one(*args, **kw):  # a wrong engine: every accepted token shifted
        out = real(*args, **kw)
        out["accepted_tokens"] = np.where(out["accepted_tokens"] >= 0, (out["accepted_tokens"] + 1) % 90, -1)
        return out

    backend.step = off_by_one
    ok, lines = decode_comparison(backend, ref, "fp32", max_new_tokens=12)
    assert not ok and "(differ)" in lines[1]
    ok, _ = decode_comparison(backend, ref, "fp16", max_new_tokens=12)
    assert ok, "below fp32 the agreement is reported, not failed"


def test_engines_without_a_gpu_are_one_line(setup, tmp_path):
    from mtp_trt.trt import compat

    if compat.gpu()[0] is not None:
        pytest.skip("a GPU is present")
    ref, engines = setup
    env = {"MTP_TRT_CACHE_DIR": str(tmp_path / "cache")}
    gone = tmp_path / "moved"  # engines whose checkpoint is no longer where they were built from
    shutil.copytree(engines["plugin"], gone)
    raw = json.loads((gone / "engines.json").read_text())
    raw["export"]["checkpoint"] = str(tmp_path / "nowhere")
    (gone / "engines.json").write_text(json.dumps(raw))
    # what ONNX Runtime can run instead, as the message names it, with the command asked: an onnx-lowering export
    # (plugin-free engines; not for bench, which takes checkpoints), or the checkpoint (a plugin-lowering export does
    # not run on ONNX Runtime)
    ckpt, plain = ref.raw["checkpoint"], ref.root.parent.resolve() / "onnx-trt"
    commands = ("run", "serve", "bench")
    checkpoint = {c: f"ONNX Runtime runs their checkpoint instead: mtp-trt {c} {ckpt}" for c in commands}
    onnx_export = {c: f"ONNX Runtime runs their export instead: mtp-trt {c} {plain}" for c in ("run", "serve")}
    nowhere = {c: f"ONNX Runtime runs the checkpoint they come from instead ({tmp_path / 'nowhere'}, not on this "
                  f"machine): mtp-trt {c} CHECKPOINT" for c in commands}
    for engine_dir, instead in ((engines["plugin"], checkpoint), (engines["onnx"], {**checkpoint, **onnx_export}),
                                (gone, nowhere)):
        for args in (["run", str(engine_dir), "-p", "x"], ["serve", str(engine_dir)],
                     ["bench", str(engine_dir), "--repeats", "1"]):
            r = CliRunner().invoke(app, args, env=env)
            assert r.exit_code == 2, r.output
            assert "running engines needs an NVIDIA GPU" in r.output, r.output
            assert r.output.rstrip().endswith(instead[args[0]]), r.output
            assert "Traceback" not in r.output and r.output.count("error:") == 1
    import subprocess  # the installed command passes check's own exit codes through (3: skipped)

    r = subprocess.run(["mtp-trt", "check", str(engines["plugin"])], capture_output=True, text=True, env={
        **__import__("os").environ, **env})
    assert r.returncode == 3 and "skipped: no GPU" in r.stderr, r.stderr


def test_tampered_engines_are_found_before_they_run(setup, tmp_path, monkeypatch):
    """`run` and `bench` check the engines against engines.json's hashes once (remembered, like exports): an
    engine changed afterwards is one error naming it, before TensorRT (or the GPU check) is reached."""
    from mtp_trt.runner import verify_engines

    monkeypatch.setenv("MTP_TRT_CACHE_DIR", str(tmp_path / "cache"))
    _, engines = setup
    root = tmp_path / "eng"
    shutil.copytree(engines["onnx"], root)
    first = verify_engines(root)
    assert first["hashed"] == first["files"] > 0 and verify_engines(root)["hashed"] == 0
    with open(root / "step_1.engine", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    r = CliRunner().invoke(app, ["run", str(root), "-p", "x"], env={"MTP_TRT_CACHE_DIR": str(tmp_path / "cache")})
    assert r.exit_code == 2 and "step_1.engine: SHA-256 differs from engines.json" in r.output, r.output


def test_two_backends_share_the_deserialized_engines(setup):
    """bench runs the engines with and without CUDA graphs side by side: each engine is deserialized once."""
    from mtp_trt.trt.runtime import TrtBackend

    ref, engines = setup
    first = fake_backend(engines["plugin"], ref)
    second = TrtBackend(engines["plugin"], cuda_graphs=False, share=first)
    assert _tokens(first, PROMPTS, _opts(K))[0] == _tokens(second, PROMPTS, _opts(K))[0]
    assert sorted(first.loader.loaded) == sorted(set(first.loader.loaded))  # none loaded twice
    assert second.engines is first.engines and second.caches is not first.caches


def test_aliases_on_every_supported_tensorrt(setup, greedy):
    """TensorRT 10.3-10.14 cannot report an engine's aliased outputs (no get_aliased_input_tensor), and a newer
    one may leave a plugin's alias unreported: the runtime binds the graph contract's aliases either way (the
    stand-in plugin engine asserts each cache output is bound to its input's buffer); an alias TensorRT reports
    that contradicts the contract is one error."""
    from mtp_trt.trt.runtime import EngineLoader

    class Old:  # ICudaEngine of TensorRT 10.9
        num_io_tensors = 2

        def get_tensor_name(self, i):
            return ["kv_0", "kv_0_out"][i]

    class New(Old):
        def get_aliased_input_tensor(self, name):
            return "kv_0" if name == "kv_0_out" else None

    assert EngineLoader.aliases(Old()) is None and EngineLoader.aliases(New()) == {"kv_0_out": "kv_0"}
    contract = {"kv_0_out": "kv_0"}
    assert plan.reported_alias_problem(None, contract) is None and plan.reported_alias_problem({}, contract) is None
    assert "TensorRT binds {'kv_0_out': 'kv_1'}" in plan.reported_alias_problem({"kv_0_out": "kv_1"}, contract)
    assert plan.reported_alias_problem({"x": "y"}, {}) is not None
    ref, engines = setup
    for reported in (None, {}):
        backend = fake_backend(engines["plugin"], ref)
        backend.loader.aliases = lambda engine, r=reported: r
        assert _tokens(backend, PROMPTS, _opts(K))[0] == greedy[0]
    backend = fake_backend(engines["plugin"], ref)
    backend.loader.aliases = lambda engine: {"kv_0_out": "input_ids"}
    with pytest.raises(MtpTrtError, match=r"target.engine: TensorRT binds \{'kv_0_out': 'input_ids'\}"):
        backend.prepare(K, True)


def test_capture_never_follows_a_shape_change(setup):
    """One execution context serves an engine's profile at every batch size: a step at batch 3 run eagerly, then
    one at batch 2, then batch 3 again must run eagerly once more (TensorRT's first enqueue after a shape change
    may not be captured) before batch 3 is captured; replays in between change nothing of that."""
    ref, engines = setup
    backend = fake_backend(engines["plugin"], ref)
    backend.prepare(K, True)
    backend.allocate(3, 60)
    zeros = np.zeros(3, np.int32)
    carry = np.zeros((3, K - 1, ref.config.hidden_size), np.float32) if ref.mtp_mode == "vanilla" else None
    ids = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], np.int32)
    for n in (3, 2, 3, 3, 2, 2, 3, 2, 3):
        backend.step(n, ids[:n], np.full(n, 4, np.int32), zeros[:n], 0, 0.0, None if carry is None else carry[:n])
    # 3 eager, 2 eager, 3 eager (shapes changed), 3 captured, 2 eager, 2 captured, then 3, 2, 3 replayed
    assert backend.device.counts["graphs"] == 2 and backend.device.counts["graph_launches"] == 5
    assert sum(c.captures_after_shape_change for c in backend.loader.contexts) == 0


def test_pinned_memory_only_for_outputs_read(setup):
    """A greedy decode reads no logits: no pinned twin of them (a sampling decode has one); the outputs share one
    device region the size of the largest engine's outputs."""
    ref, engines = setup
    vocab = ref.config.vocab_size
    for greedy in (True, False):
        backend = fake_backend(engines["onnx"], ref)
        backend.prepare(K, greedy)
        backend.allocate(4, 64)
        assert ("logits" in backend.host_at["target"]) != greedy
        logits = 4 * backend.max_s * vocab * 4
        assert (backend.out_host.nbytes < logits) == greedy
        ios = list(backend.ios.values())
        assert backend.device.memory[backend.out_dev].nbytes == plan.output_layout(ios, 4, 64, backend.max_s)[1]
    seqs, _ = generate(backend, PROMPTS, _opts(K, sampling=SamplingParams(temperature=0.9)))  # still allocated
    assert all(s.generated for s in seqs)


def test_memory_check_counts_the_contexts_activations(setup):
    ref, engines = setup
    backend = fake_backend(engines["plugin"], ref)
    backend.prepare(K, True)
    backend.loader.activation_bytes_each = 1 << 40  # 1 TiB per context: each engine loaded, each profile
    contexts = len(backend.engines) * len(backend.em.profiles)
    with pytest.raises(MtpTrtError, match=rf"activations, caches and buffers need about {1024 * contexts}\.\d\d GiB"):
        backend.allocate(2, 32)
    for name in backend.engines:  # contexts already created: their memory is already out of the free figure
        for p in range(len(backend.em.profiles)):
            backend.context(name, p)
    backend.allocate(2, 32)


def test_tensorrt_error_lines_are_in_the_error(setup):
    ref, engines = setup
    backend = fake_backend(engines["plugin"], ref, cuda_graphs=False)
    backend.prepare(K, True)
    backend.loader.errors.append("an earlier error, not this call's")
    backend.engines["target"].fail = ("[pluginV3Runner.cpp::execute::89] Error Code 2: Internal Error (plugin failed)",
                                      "MlaGenerationAttention plugin, enqueue: CudaKernelError: error 35")
    mark = (1, 0)
    with pytest.raises(MtpTrtError) as e:
        generate(backend, PROMPTS, _opts(K))
    msg = str(e.value)
    assert msg.startswith("target.engine: TensorRT could not enqueue the engine: [pluginV3Runner.cpp") and \
        "Error Code 2" in msg and "| MlaGenerationAttention plugin, enqueue: CudaKernelError: error 35" in msg
    assert "earlier" not in msg
    assert "\n" not in msg and backend.loader.messages(mark, limit=20).startswith("...")


def test_continuous_batching_equals_onnxruntime(setup, greedy):
    """Sequences joining between steps (prefilled in chunks of 4, swapped to the front slots for it) and leaving
    (one cancelled): the runtime gives ONNX Runtime's greedy tokens for the others."""
    ref, engines = setup
    backend = fake_backend(engines["plugin"], ref)
    seqs = [Sequence(p, max_new_tokens=24) for p in PROMPTS + PROMPTS[:1]]
    drive(backend, _opts(K), seqs, {0: ("admit", [1, 3]), 2: ("admit", [0]), 3: ("cancel", [3]), 4: ("admit", [2])},
          capacity=3, chunk=4, rows=64)
    assert [s.generated for s in seqs[:3]] == greedy[0]
    assert seqs[3].finish_reason == "cancelled"


def test_continuous_batching_mixes_greedy_and_sampling(setup, greedy):
    """A batch opened for requests with their own sampling (as the server opens it) on greedy options: the
    engines' logits are read for the sampling sequence (it draws as `generate` does alone with its seed),
    the greedy ones still give ONNX Runtime's greedy tokens through the fused step."""
    ref, engines = setup
    sampled = _opts(K, sampling=SamplingParams(temperature=0.9, top_k=20))
    alone = generate(fake_backend(engines["plugin"], ref), [PROMPTS[2]], sampled, seed=5)[0][0].generated
    backend = fake_backend(engines["plugin"], ref)
    seqs = [Sequence(p, max_new_tokens=24) for p in PROMPTS[:3]]
    seqs[2] = Sequence(PROMPTS[2], sampling=sampled.sampling, max_new_tokens=24, rng=sequence_rng(5, 0))
    drive(backend, _opts(K), seqs, {0: ("admit", [0, 2]), 2: ("admit", [1])}, capacity=3, chunk=4, rows=64,
          mixed=True)
    assert [s.generated for s in seqs[:2]] == greedy[0][:2]
    assert seqs[2].generated == alone and alone != greedy[0][2]
