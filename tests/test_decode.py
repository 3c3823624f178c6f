"""The MTP decode loop on ONNX Runtime: greedy output equals plain greedy decoding of the PyTorch
reference for every nextn and both modes, whatever the batch; wrong drafts are rewound; drafts equal
a from-scratch PyTorch recomputation of the MTP chain; relaxed acceptance and the thinking switch;
seeded sampling is reproducible; stop conditions; continuous batching (sequences joining in chunks and leaving
between steps) changes no sequence's tokens."""

import dataclasses
import os

import numpy as np
import pytest
import torch

from mtp_trt import contract as C
from mtp_trt import decode
from mtp_trt.backend import OrtBackend, commit, slot_rows
from mtp_trt.decode import DecodeOptions, Sequence, generate, sequence_rng, step
from mtp_trt.exporters.generate import greedy_generate
from mtp_trt.exporters.loader import load_checkpoint
from mtp_trt.manifest import Manifest
from mtp_trt.sampling import SamplingParams
from runtime_models import EOS, THINK, drive, export_both, make_self_drafting

K = 3
PROMPTS = [[5, 17, 33, 2, 8, 41, 7, 19], [60, 3], [11, 12, 13, 14, 15], [70, 71, 72, 9, 30, 31]]
NEW = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode")
    ckpt = make_self_drafting(root / "ckpt", nextn=K)
    exports = export_both(ckpt, root, nextn=K)
    model = load_checkpoint(ckpt)
    reference = [greedy_generate(model, p, NEW, eos_ids=(EOS,)) for p in PROMPTS]
    backends = {mode: OrtBackend(Manifest.load(path)) for mode, path in exports.items()}
    return model, backends, reference


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
@pytest.mark.parametrize("nextn", range(K + 1))
def test_greedy_mtp_equals_plain_greedy(setup, mode, nextn):
    model, backends, reference = setup
    seqs, stats = generate(backends[mode], PROMPTS, DecodeOptions(nextn=nextn, max_new_tokens=NEW, eos_ids=(EOS,)))
    assert [s.generated for s in seqs] == reference
    if nextn:
        assert 1.3 < stats.mean_acceptance_length < nextn + 1, "drafts must be partly accepted for this test to bite"
        assert 0 < stats.acceptance_rate_per_pos[0] < 1


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_output_does_not_depend_on_the_batch(setup, mode):
    _, backends, reference = setup
    opts = DecodeOptions(nextn=K, max_new_tokens=NEW, eos_ids=(EOS,))
    for i, p in enumerate(PROMPTS):
        alone, _ = generate(backends[mode], [p], opts)
        assert alone[0].generated == reference[i]
    mixed, _ = generate(backends[mode], [PROMPTS[3], PROMPTS[1], PROMPTS[3]], opts)
    assert [s.generated for s in mixed] == [reference[3], reference[1], reference[3]]


class RandomDrafts:
    """Wraps a backend; replaces every draft the MTP graphs propose with a random token."""

    def __init__(self, inner, seed=0):
        self.inner, self.rng, self.manifest = inner, np.random.default_rng(seed), inner.manifest

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def mtp(self, *args, **kwargs):
        out = self.inner.mtp(*args, **kwargs)
        out["draft_tokens"] = self.rng.integers(0, 90, out["draft_tokens"].shape).astype(np.int32)
        return out

    def step(self, *args, **kwargs):  # the fused eagle step drafts too
        out = self.inner.step(*args, **kwargs)
        out["drafts"] = self.rng.integers(0, 90, out["drafts"].shape).astype(np.int32)
        return out

    def bound_step(self, graph, n):  # every step through `step` above (decode.chain_steps runs none)
        return None


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_wrong_drafter_still_gives_greedy_output(setup, mode):
    _, backends, reference = setup
    seqs, stats = generate(RandomDrafts(backends[mode]), PROMPTS, DecodeOptions(nextn=K, max_new_tokens=NEW,
                                                                                 eos_ids=(EOS,)))
    assert [s.generated for s in seqs] == reference
    assert stats.mean_acceptance_length < 1.2, "random drafts should be rejected (and rewound) on nearly every step"


class _NoStep:
    """A backend without the fused step graph: the loop runs target and MTP graphs separately."""

    def __init__(self, inner):
        self.inner, self.manifest = inner, inner.manifest

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def has_step(self, nextn):
        return False


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
@pytest.mark.parametrize("nextn", range(K + 1))
def test_fused_step_equals_separate_graphs(setup, mode, nextn):
    """The one-call step graphs (one per nextn, both modes) make the same tokens and drafts as the separate
    graphs (vanilla: carried hidden states and per-depth windows included)."""
    _, backends, reference = setup
    be = backends[mode]
    assert be.has_step(nextn) and not be.has_step(K + 1)
    opts = DecodeOptions(nextn=nextn, max_new_tokens=NEW, eos_ids=(EOS,))
    fused, _ = generate(be, PROMPTS, opts)
    separate, _ = generate(_NoStep(be), PROMPTS, opts)
    assert [s.generated for s in fused] == [s.generated for s in separate] == reference
    assert [s.draft_log for s in fused] == [s.draft_log for s in separate]


class _Unbound(OrtBackend):
    """An OrtBackend whose step calls convert their inputs and outputs on every call (no IOBinding)."""

    def run(self, graph, n, feed, fetch, family=C.mtp_family(0), replay=False):
        return super().run(graph, n, feed, fetch, family)


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_bound_step_calls_equal_unbound_ones(setup, mode):
    """Step calls bound once (the caches, inputs filled in place, outputs overwritten) give what calls that convert
    everything give, on one backend reused across cache sizes (each prompt alone: new caches) and batch sizes
    (sequences finishing: fewer slots), drafts included."""
    _, backends, reference = setup
    be = backends[mode]
    unbound = _Unbound(be.manifest)
    opts = DecodeOptions(nextn=K, max_new_tokens=NEW, eos_ids=(EOS,))
    for prompts in ([p] for p in PROMPTS), [PROMPTS, PROMPTS[::-1]]:
        for batch in prompts:
            bound, _ = generate(be, batch, opts)
            plain, _ = generate(unbound, batch, opts)
            assert [s.generated for s in bound] == [s.generated for s in plain]
            assert [s.draft_log for s in bound] == [s.draft_log for s in plain]
    assert be.bound and not unbound.bound


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
@pytest.mark.parametrize("nextn", [0, K])
def test_chained_steps_equal_one_step_at_a_time(setup, mode, nextn, monkeypatch):
    """decode.chain_steps (a greedy decode's fused steps back to back on the bound call) gives what `step` gives one
    step at a time: the tokens, the drafts, the finish reasons and every speculative figure, sequences finishing at
    different steps; and it runs most of the steps."""
    _, backends, reference = setup
    opts = DecodeOptions(nextn=nextn, max_new_tokens=NEW, eos_ids=(EOS,))
    chained, stats = generate(backends[mode], PROMPTS, opts)
    calls = []
    monkeypatch.setattr(decode, "chain_steps", lambda *a: calls.append(a) and False)
    stepped, one_by_one = generate(backends[mode], PROMPTS, opts)
    assert len(calls) >= one_by_one.steps
    assert [s.generated for s in chained] == [s.generated for s in stepped] == reference
    assert ([(s.draft_log, s.finish_reason, s.steps, s.spec_usage(nextn)) for s in chained]
            == [(s.draft_log, s.finish_reason, s.steps, s.spec_usage(nextn)) for s in stepped])
    assert dataclasses.asdict(stats) == dataclasses.asdict(one_by_one)
    monkeypatch.undo()
    steps = []
    monkeypatch.setattr(decode, "step", lambda *a: steps.append(a) or step(*a))
    generate(backends[mode], PROMPTS, opts)
    assert len(steps) < stats.steps / 2, "chain_steps should run most steps"


def test_a_decode_of_the_same_shape_reuses_the_caches_and_bound_calls(setup):
    """A second decode of as many sequences and rows runs on the first one's caches and bound step calls (as a
    llama.cpp context serves its next generation), zeroed where the first wrote, with the same tokens and drafts;
    another shape gets new ones."""
    _, backends, reference = setup
    be = backends["eagle"]
    opts = DecodeOptions(nextn=K, max_new_tokens=NEW, eos_ids=(EOS,))
    first, _ = generate(be, PROMPTS, opts)
    store, bound = be.store, list(be.bound.values())
    second, _ = generate(be, PROMPTS, opts)
    assert be.store is store and list(be.bound.values()) == bound
    assert [s.generated for s in second] == [s.generated for s in first] == reference
    assert [s.draft_log for s in second] == [s.draft_log for s in first]
    assert store.any()
    be.allocate(*store.shape[1:3])
    assert be.store is store and not store.any() and be.written == [0] * store.shape[1]
    be.allocate(store.shape[1], store.shape[2] - 1)
    assert be.store is not store and not be.bound


@pytest.mark.parametrize("stacked", [False, True])
def test_commit_writes_each_slots_rows_inside_the_buffer(stacked):
    """commit: slot b's S new rows land at rows past_len[b] .. + S - 1 of its cache, those outside the buffer (a
    window starting before row 0 or running past the end) dropped, against a row-by-row reference; `written`
    holds each slot's highest row written, as swap_slots and allocate read it."""
    rng = np.random.default_rng(0)
    t, c = 8, 4
    for s in (1, 2, 3):
        for past in ([-4, 0], [-1, 3], [5, 6], [7, 8], [0, 10]):
            shape = (2, 3, t, c) if stacked else (2, t, c)
            cache, new = np.zeros(shape), rng.normal(size=shape[:-2] + (s, c))
            want, written = cache.copy(), [0, 0]
            for b, p in enumerate(past):
                for r in range(s):
                    if 0 <= p + r < t:
                        want[b, ..., p + r, :] = new[b, ..., r, :]
            commit(slot_rows([cache], [new]), past, written)
            np.testing.assert_array_equal(cache, want)
            assert written == [min(p + s, t) if max(p, 0) < min(p + s, t) else 0 for p in past]


def _reference_drafts(model, tokens, q, mode):
    """Recompute from scratch, in PyTorch with no cache, the K drafts made after position q."""
    with torch.no_grad():
        _, h, _ = model(torch.tensor([tokens[:q + 1]]))
        seq = torch.tensor([tokens[1:q + 2]])
        logits, h1, _ = model.mtp_forward(0, h, seq)
        drafts = [int(logits[0, q].argmax())]
        if mode == "eagle":  # rows q+1.. append (the previous row's output hidden, the previous draft)
            out_h, rows_h, rows_t = h1, h[0], seq[0]
            for _ in range(1, K):
                rows_h = torch.cat([rows_h, out_h[0, -1:]], 0)
                rows_t = torch.cat([rows_t, torch.tensor([drafts[-1]])], 0)
                logits, out_h, _ = model.mtp_forward(0, rows_h[None], rows_t[None])
                drafts.append(int(logits[0, -1].argmax()))
        else:
            prev = h1
            for depth in range(2, K + 1):
                toks = [tokens[i + depth] if i + depth <= q + 1 else drafts[i + depth - q - 2] for i in range(q + 1)]
                logits, prev, _ = model.mtp_forward(depth - 1, prev, torch.tensor([toks]))
                drafts.append(int(logits[0, q].argmax()))
    return drafts


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_drafts_equal_pytorch_recomputation(setup, mode):
    """Every step's K drafts equal an independent, cache-free PyTorch recomputation of the MTP chain --
    this checks the loop's cache bookkeeping, rewinds and (vanilla) carried hidden states."""
    model, backends, _ = setup
    # [60]: a prompt shorter than K - 1, whose deeper windows would start before row 0
    seqs, _ = generate(backends[mode], PROMPTS[:2] + [[60]], DecodeOptions(nextn=K, max_new_tokens=NEW,
                                                                           eos_ids=(EOS,)))
    for s in seqs:
        assert len(s.draft_log) >= 4
        for q, drafts in s.draft_log:
            assert drafts == _reference_drafts(model, s.tokens, q, mode), f"q={q}"


def test_relaxed_acceptance_follows_the_thinking_flag(setup):
    """Relaxed acceptance with N = V, delta = 1 accepts every draft, but only while thinking: a prompt with
    an open <think> is relaxed from the first step, one whose think block is closed decodes as greedy."""
    _, backends, reference = setup
    be = backends["eagle"]
    relaxed = DecodeOptions(nextn=K, max_new_tokens=NEW, relaxed_topk=96, relaxed_delta=1.0, think_ids=THINK)
    closed = [THINK[0], 5, 6, THINK[1], *PROMPTS[0]]
    seqs, stats = generate(be, [closed], relaxed)
    plain, _ = generate(be, [closed], DecodeOptions(nextn=0, max_new_tokens=NEW))
    assert seqs[0].generated == plain[0].generated
    open_ = [5, THINK[0], *PROMPTS[0]]
    seqs, stats = generate(be, [open_], relaxed)
    generated = seqs[0].generated
    if THINK[1] not in generated:
        assert stats.mean_acceptance_length == K + 1, "every draft is accepted while thinking"
    else:  # the flag switched off at </think>: from there on acceptance is strict again
        assert stats.mean_acceptance_length > 1


def test_thinking_flag_switches_off_at_end_token(setup):
    """Once </think> is among the accepted tokens, later drafts are judged strictly again."""
    _, backends, _ = setup
    seqs, stats = generate(_ForceEndThink(backends["eagle"]), [[THINK[0], *PROMPTS[1]]],
                           DecodeOptions(nextn=K, max_new_tokens=NEW, relaxed_topk=96, relaxed_delta=1.0,
                                         think_ids=THINK))
    s = seqs[0]
    assert THINK[1] in s.generated
    assert stats.mean_acceptance_length < K + 1, "after </think> not every (wrong) draft may be accepted"


class _ForceEndThink(RandomDrafts):
    """Random drafts, except that the first draft made after the first verify step is </think>."""

    steps = 0

    def step(self, *args, **kwargs):
        out = super().step(*args, **kwargs)
        type(self).steps += 1
        if type(self).steps == 1:
            out["drafts"][:, 0] = THINK[1]
        return out


def test_seeded_sampling_is_reproducible(setup):
    _, backends, _ = setup
    opts = DecodeOptions(nextn=K, max_new_tokens=NEW, sampling=SamplingParams(temperature=0.8, top_k=20, top_p=0.9))
    a, _ = generate(backends["vanilla"], PROMPTS, opts, seed=7)
    b, _ = generate(backends["vanilla"], PROMPTS, opts, seed=7)
    c, _ = generate(backends["vanilla"], PROMPTS, opts, seed=8)
    assert [s.generated for s in a] == [s.generated for s in b]
    assert [s.generated for s in a] != [s.generated for s in c]


def test_stop_conditions(setup):
    _, backends, reference = setup
    be = backends["eagle"]
    seqs, _ = generate(be, PROMPTS, DecodeOptions(nextn=K, max_new_tokens=5))
    assert all(len(s.generated) == 5 and s.finish_reason == "length" for s in seqs)
    assert [s.generated for s in seqs] == [r[:5] for r in reference]
    eos = reference[0][3]
    seqs, _ = generate(be, PROMPTS[:1], DecodeOptions(nextn=K, max_new_tokens=NEW, eos_ids=(eos,)))
    assert seqs[0].generated == reference[0][:reference[0].index(eos) + 1] and seqs[0].finish_reason == "stop"


def test_on_step_reports_the_first_tokens_then_every_step(setup):
    """Streaming: the first call comes after the prompts' pass with one token each (reference's first), then one
    per verify step, each with a prefix of the reference; a stop set in the first call ends that sequence there."""
    _, backends, reference = setup
    opts = DecodeOptions(nextn=K, max_new_tokens=NEW, eos_ids=(EOS,))
    calls = []
    seqs, stats = generate(backends["eagle"], PROMPTS, opts, on_step=lambda ss: calls.append([s.generated for s in ss]))
    assert calls[0] == [r[:1] for r in reference]
    assert len(calls) == 1 + stats.steps
    assert all(g == r[:len(g)] for call in calls for g, r in zip(call, reference))
    assert calls[-1] == reference

    def stop_first(ss):
        if ss[1].finish_reason is None and ss[1].num_generated == 1:
            ss[1].finish_reason = "stop"

    seqs, _ = generate(backends["eagle"], PROMPTS, opts, on_step=stop_first)
    assert seqs[1].generated == reference[1][:1] and [s.generated for s in seqs[::2]] == reference[::2]


def test_backend_loads_only_the_graphs_a_decode_runs(setup, tmp_path):
    """Sessions are made on first use (prepare() makes a decode's before it starts); an unreadable graph
    is one clear error naming its file, raised when a decode needs it."""
    import shutil

    from mtp_trt.errors import MtpTrtError

    _, backends, reference = setup
    root = tmp_path / "eagle"
    shutil.copytree(backends["eagle"].manifest.root, root)
    (root / "step_1.onnx").write_bytes(b"not an onnx file")
    be = OrtBackend(Manifest.load(root))
    seqs, _ = generate(be, PROMPTS[:1], DecodeOptions(nextn=K, max_new_tokens=NEW, eos_ids=(EOS,)))
    assert seqs[0].generated == reference[0]
    assert set(be.sessions) == {"target", "mtp_0", f"step_{K}"}
    with pytest.raises(MtpTrtError, match=r"step_1\.onnx: ONNX Runtime cannot load this graph"):
        be.prepare(1, greedy=True)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a second core (a pool thread)")
def test_idle_pool_threads_stop_spinning_soon_after_a_decode(setup):
    """Between decode steps the pools' threads spin (the next step finds them awake), but a backend left idle
    stops taking CPU within about a millisecond: ONNX Runtime's own default spins on for tens of milliseconds
    (30-65 ms of CPU in the 200 ms below, measured), which takes a core from the next session or process."""
    import time

    be = OrtBackend(Manifest.load(setup[1]["eagle"].manifest.root), threads=2)
    for _ in range(2):
        generate(be, PROMPTS[:1], DecodeOptions(nextn=K, max_new_tokens=8, eos_ids=(EOS,)))
        t0 = time.process_time()
        time.sleep(0.2)
        assert time.process_time() - t0 < 0.015


def test_backend_refuses_an_instruction_set_in_one_line(setup):
    """MTP_TRT_CPU_ISA naming no set: OrtBackend raises ort_lib.register's one line when it is made, before any
    graph is loaded (a child process: the library reads the variable once per process)."""
    import subprocess
    import sys

    root = setup[1]["eagle"].manifest.root
    code = ("import sys\nfrom mtp_trt.backend import OrtBackend\nfrom mtp_trt.errors import MtpTrtError\n"
            "from mtp_trt.manifest import Manifest\ntry:\n    OrtBackend(Manifest.load(sys.argv[1]))\n"
            "except MtpTrtError as e:\n    print(e)")
    env = {k: v for k, v in os.environ.items() if k != "MTP_TRT_CPU_ISA"} | {"MTP_TRT_CPU_ISA": "avx3"}
    run = subprocess.run([sys.executable, "-c", code, str(root)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == ("MTP_TRT_CPU_ISA=avx3 is not an instruction set of mtp-trt's CPU kernels "
                                  "(scalar, avx2, avx-vnni, avx512-vnni, neon, neon-dotprod, neon-i8mm)")


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_joining_and_leaving_change_no_sequence(setup, mode):
    """Continuous batching, greedy and sampling mixed: prompts join in chunks of 2 tokens while others decode
    (vanilla: early unfused steps while a short prompt's windows fill), one is cancelled mid-way, others finish
    and free their slots: each sequence's tokens equal `generate` of its prompt alone (the greedy ones plain
    greedy decoding of the PyTorch reference), the sampling one with its seed."""
    _, backends, reference = setup
    backend = backends[mode]
    opts = DecodeOptions(nextn=K, max_new_tokens=NEW, eos_ids=(EOS,), think_ids=THINK)
    sampled = dataclasses.replace(opts, sampling=SamplingParams(temperature=0.9, top_k=20))
    alone = generate(backend, [PROMPTS[2]], sampled, seed=5)[0][0].generated
    seqs = [Sequence(p, max_new_tokens=NEW) for p in PROMPTS] + [Sequence(PROMPTS[0], max_new_tokens=NEW)]
    seqs[2] = Sequence(PROMPTS[2], sampling=sampled.sampling, max_new_tokens=NEW, rng=sequence_rng(5, 0))
    schedule = {0: ("admit", [1]), 1: ("admit", [0, 4]), 3: ("admit", [2, 3]), 5: ("cancel", [4])}
    drive(backend, opts, seqs, schedule, capacity=3, chunk=2, rows=128)
    assert [seqs[i].generated for i in (0, 1, 3)] == [reference[i] for i in (0, 1, 3)]
    assert seqs[2].generated == alone and alone != reference[2]
    assert seqs[4].finish_reason == "cancelled" and len(seqs[4].generated) < len(reference[0])


# ------------------------------------------------------------------------------------------- the cache limit
LIMIT = 40  # the demo export's max_seq_len: every prompt below runs into it


@pytest.fixture(scope="module")
def demo_limit(tmp_path_factory):
    """The bundled demo (3 MTP modules, whose drafts are mostly accepted) exported in both modes with a
    40-row cache and the tree 3:3:8, and again with room (for the drafts' reference), and its prompts."""
    from mtp_trt.exporters.export import export
    from mtp_trt.runner import Runner, demo_model

    root, demo = tmp_path_factory.mktemp("limit"), demo_model()
    runners = {(mode, rows): Runner(Manifest.load(export(demo, root / f"{mode}-{rows}", nextn=K, mtp_mode=mode,
                                                         max_seq_len=rows, trees="3:3:8" if rows == LIMIT else "none")))
               for mode in ("eagle", "vanilla") for rows in (LIMIT, 128)}
    r = runners["eagle", LIMIT]
    prompts = [r.encode(t) for t in ("def read_lines(path):\n    \"\"\"Return the lines of a file.", "class Stack:\n",
                                     "import os\n")]
    return runners, prompts


def _limit_configs(mode: str) -> list[dict]:
    """Every way of drafting a greedy decode: nextn 1..3 fixed, the tree, and (eagle) K chosen per step."""
    fixed = [dict(nextn=n, speculation="fixed") for n in range(1, K + 1)] + [dict(nextn=K, tree_topk=3)]
    return fixed + ([dict(nextn=None, speculation="auto")] if mode == "eagle" else [])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_mtp_gives_plain_decodings_tokens_up_to_the_cache_limit(demo_limit, mode):
    """At the cache limit greedy MTP (nextn 1..3, fixed and auto, the chain and the tree) ends where plain greedy
    decoding (nextn 0) does, with its tokens, finish reason and message: the last steps verify fewer drafts,
    down to none.  Each prompt alone and the three together; every sequence ends at max_seq_len tokens."""
    runners, prompts = demo_limit
    r = runners[mode, LIMIT]
    for batch in [[p] for p in prompts] + [prompts]:
        plain, _ = generate(r.backend, batch, r.options(0, max_new_tokens=100))
        want = [(s.generated, s.finish_reason, s.message) for s in plain]
        assert all(len(s.tokens) == LIMIT and s.message == f"KV cache full ({LIMIT} rows per sequence)"
                   for s in plain), want
        for kw in _limit_configs(mode):
            opts = r.options(max_new_tokens=100, **kw)
            seqs, stats = generate(r.backend, batch, opts)
            assert [(s.generated, s.finish_reason, s.message) for s in seqs] == want, (batch, kw)
            assert stats.mean_acceptance_length > 1.3, "drafts must be accepted for this test to bite"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_drafts_near_the_cache_limit_equal_those_with_room(demo_limit, mode):
    """The MTP caches stay whole while the last steps verify fewer drafts: every draft made near the cache limit
    (and after, in a batch, for the sequences that were held back by another one's limit) equals the draft made
    at the same position by a decode with room in the cache.  Continuous batching too (serve's loop: sequences
    joining in chunks, beside others at their limit): plain decoding's tokens."""
    from runtime_models import drive

    runners, prompts = demo_limit
    r, room = runners[mode, LIMIT], runners[mode, 128]
    for kw in _limit_configs(mode):
        if kw.get("tree_topk"):
            continue  # (a tree step logs its tree)
        opts = r.options(max_new_tokens=100, **kw)
        seqs, _ = generate(r.backend, prompts, opts)
        ref, _ = generate(room.backend, prompts, room.options(max_new_tokens=100, **kw))
        near = 0
        for s, t in zip(seqs, ref):
            drafts = dict(t.draft_log)
            for q, d in s.draft_log:
                assert q not in drafts or d[:len(drafts[q])] == drafts[q][:len(d)], (kw, q, d, drafts.get(q))
                near += q in drafts and q + 2 + K > LIMIT
        assert near >= len(prompts), "the comparison must reach the steps that verify fewer drafts"
    plain, _ = generate(r.backend, prompts, r.options(0, max_new_tokens=100))
    for kw in _limit_configs(mode):
        opts = r.options(max_new_tokens=100, **kw)
        joining = [Sequence(p, max_new_tokens=100) for p in prompts]
        drive(r.backend, opts, joining, {0: ("admit", [0]), 3: ("admit", [1, 2])}, capacity=2, chunk=4, rows=LIMIT)
        assert [s.generated for s in joining] == [s.generated for s in plain], kw
        assert all(s.finish_reason == "length" and "KV cache full" in s.message for s in joining)
