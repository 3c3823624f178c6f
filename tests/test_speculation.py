"""Adaptive speculation: the policy's plain functions (acceptance decay, the cost EWMA and its interpolation, the
choice of K), and on the bundled demo model: whatever K is chosen step after step, greedy output is plain greedy
decoding's (nextn 0), and each sequence's speculative figures add up to the decode's."""

import copy
import dataclasses
import itertools
import json

import numpy as np
import pytest

from mtp_trt.decode import (Batch, DecodeOptions, Sequence, State, Stats, accept, auto_k, calibrate, chain_prior,
                            generate, join_k, open_batch)
from mtp_trt.sampling import SamplingParams
from mtp_trt.speculation import (CLIP, DOWN_ALPHA, PRIOR, PRIOR_WEIGHT, SHAPE_ALPHA, Acceptance, CostModel,
                                  acceptance_rates, batch_expected_tokens, choose_k, estimate_cost, expected_tokens,
                                  observe_acceptance, observe_cost)


# ----------------------------------------------------------------------------------------- plain functions
def test_expected_tokens_is_one_plus_the_chained_products():
    rates = np.array([0.8, 0.5, 0.25])
    assert expected_tokens(rates, 0) == 1.0
    assert expected_tokens(rates, 1) == pytest.approx(1.8)
    assert expected_tokens(rates, 2) == pytest.approx(1 + 0.8 + 0.4)
    assert expected_tokens(rates, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.1)


def test_batch_expected_tokens_sums_each_sequences():
    rates = np.array([[0.8, 0.5, 0.25], [0.3, 0.9, 0.1], [1.0, 1.0, 1.0]])
    want = [sum(expected_tokens(r, k) for r in rates) for k in range(4)]
    assert batch_expected_tokens(rates).tolist() == pytest.approx(want)
    assert batch_expected_tokens(np.zeros((2, 0))).tolist() == [2.0]


def test_acceptance_without_history_is_the_prior():
    a = Acceptance.empty(3)
    assert acceptance_rates(a).tolist() == [PRIOR] * 3
    assert acceptance_rates(a, np.array([0.9, 0.2, 0.1])).tolist() == pytest.approx([0.9, 0.2, 0.1])
    observe_acceptance(a, 0, 0)  # a step without drafts teaches nothing
    assert a.tried.tolist() == [0, 0, 0]


def test_acceptance_counts_tried_positions_and_decays():
    a = Acceptance.empty(3)
    observe_acceptance(a, 3, 1, decay=0.5)  # d1 accepted, d2 rejected, d3 never tried
    assert a.tried.tolist() == [1, 1, 0] and a.accepted.tolist() == [1, 0, 0]
    observe_acceptance(a, 3, 3, decay=0.5)  # all accepted
    assert a.tried.tolist() == [1.5, 1.5, 1] and a.accepted.tolist() == [1.5, 1, 1]
    observe_acceptance(a, 2, 0, decay=0.5)  # d1 rejected: only position 1 tried
    assert a.tried.tolist() == [1.75, 1.5, 1] and a.accepted.tolist() == [0.75, 1, 1]
    rates = acceptance_rates(a, np.zeros(3), weight=1.0)
    assert rates.tolist() == pytest.approx([0.75 / 2.75, 1 / 2.5, 1 / 2])
    for _ in range(50):  # recent history dominates: a long run of rejections drives position 1 towards 0
        observe_acceptance(a, 3, 0)
    assert acceptance_rates(a)[0] < 0.3 and acceptance_rates(a, weight=1.0)[0] < 0.1


def test_cost_load_factor_and_interpolation():
    m = CostModel(alpha=0.5)
    assert estimate_cost(m, 1, 4) is None
    observe_cost(m, 1, 4, 2.0)
    assert estimate_cost(m, 1, 4) == 2.0  # the first observation is the estimate
    observe_cost(m, 1, 4, 2.5)  # 1.25x the estimate: the size's load factor by alpha, K's own cost by SHAPE_ALPHA
    assert m.load[4] == pytest.approx(1.125)
    assert estimate_cost(m, 1, 4) == pytest.approx(2.0 * (1 + SHAPE_ALPHA * 0.25) * 1.125)
    observe_cost(m, 1, 8, 4.5)  # a new size: its cost at the load there (the nearest size's)
    assert m.seconds[1][8] == pytest.approx(4.0) and estimate_cost(m, 1, 8) == pytest.approx(4.5)
    base4 = m.seconds[1][4]
    assert estimate_cost(m, 1, 6) == pytest.approx((base4 + 4.0) / 2 * 1.125)  # linear between measured sizes
    assert estimate_cost(m, 1, 16) == pytest.approx(8.0 * 1.125)  # beyond: proportional to the nearest
    assert estimate_cost(m, 1, 2) == pytest.approx(base4 / 2 * 1.125)
    assert estimate_cost(m, 0, 4) is None

    m = CostModel(alpha=0.5)
    observe_cost(m, 0, 1, 1.0)
    observe_cost(m, 1, 1, 2.0)
    observe_cost(m, 0, 1, 100.0)  # a preempted step: counted as CLIP x the estimate
    assert m.load[1] == pytest.approx(0.5 + 0.5 * CLIP)
    for _ in range(40):  # a lasting slow-down of the K running: every K's estimate follows, their ratio stays
        observe_cost(m, 0, 1, 3.0)
    assert estimate_cost(m, 0, 1) == pytest.approx(3.0, rel=1e-3)
    assert estimate_cost(m, 1, 1) / estimate_cost(m, 0, 1) == pytest.approx(2.0, rel=0.1)
    before, load = estimate_cost(m, 0, 1), m.load[1]
    observe_cost(m, 0, 1, 1.0)  # faster: DOWN_ALPHA's weight (an estimate taken while busy comes down at once)
    assert m.load[1] == pytest.approx(load * (1 - DOWN_ALPHA + DOWN_ALPHA / before))
    assert estimate_cost(m, 0, 1) < 0.7 * before


def test_a_busy_machine_does_not_turn_the_policy_from_the_k_running():
    """Steps of the K running timed on a busy machine (2x the calibrated cost, as when the server's other threads
    take the cores) do not make the other K look cheaper: with drafts that pay, auto keeps them."""
    m = CostModel()
    for k, c in enumerate((1.0, 1.2, 1.4, 1.6)):  # calibrated, quiet
        observe_cost(m, k, 1, c)
    rates = np.array([[0.85, 0.8, 0.6]])
    assert choose_k(rates, m, 3) == 3
    for _ in range(200):
        observe_cost(m, 3, 1, 3.2)
    assert choose_k(rates, m, 3, current=3) == 3


def _model(costs: dict) -> CostModel:
    m = CostModel()
    for (k, rows), s in costs.items():
        observe_cost(m, k, rows, s)
    return m


def test_choose_k_maximizes_tokens_per_second():
    rates = [np.array([0.8, 0.6, 0.5])]
    # one row: drafts almost free, so all of them (E = 1 + .8 + .48 + .24 = 2.52 tokens for 1.3x the cost)
    cheap = _model({(0, 1): 1.0, (1, 1): 1.1, (2, 1): 1.2, (3, 1): 1.3})
    assert choose_k(rates, cheap, 3) == 3
    # a verify row costs as much as a token: no K pays
    dear = _model({(0, 1): 1.0, (1, 1): 2.0, (2, 1): 3.0, (3, 1): 4.0})
    assert choose_k(rates, dear, 3) == 0
    # in between: K = 1 gives 1.8 / 1.2 = 1.5, K = 2 gives 2.28 / 1.7 = 1.34
    mid = _model({(0, 1): 1.0, (1, 1): 1.2, (2, 1): 1.7, (3, 1): 2.5})
    assert choose_k(rates, mid, 3) == 1
    assert choose_k(rates, mid, 0) == 0  # max_k bounds it
    # poor acceptance turns speculation off at the same costs
    assert choose_k([np.array([0.1, 0.1, 0.1])], cheap, 3) == 0


def test_choose_k_scales_with_the_batch_and_its_costs():
    # batch of 1 pays for drafts, batch of 16 does not: the cost of K grows with the rows
    m = _model({(0, 1): 1.0, (3, 1): 1.2, (0, 16): 4.0, (3, 16): 10.0})
    good = np.array([0.7, 0.6, 0.5])
    assert choose_k([good], m, 3) == 3
    assert choose_k([good] * 16, m, 3) == 0
    assert choose_k([good] * 8, m, 3) in (0, 3)  # interpolated: defined, whichever wins


def test_choose_k_edge_cases():
    rates = [np.array([0.9, 0.9])]
    assert choose_k([], CostModel(), 2, current=1) == 1  # no sequence: keep what is held
    assert choose_k(rates, CostModel(), 2) == 2  # nothing measured: all drafts
    assert choose_k(rates, CostModel(), 2, current=0) == 0
    only = _model({(1, 1): 1.0})
    assert choose_k(rates, only, 2) == 1  # only measured K compete
    tie = _model({(0, 1): 1.0, (1, 1): 1.0 + 0.9})  # equal rates
    assert choose_k([np.array([0.9])], tie, 1) == 0  # ties: the smaller K
    close = _model({(0, 1): 1.0, (1, 1): 1.85})  # K = 1 is 2.7% better: not worth leaving K = 0
    assert choose_k([np.array([0.9])], close, 1, current=0) == 0
    assert choose_k([np.array([0.9])], close, 1, current=1) == 1
    up = _model({(0, 1): 1.0, (1, 1): 1.75})  # K = 1 is 8.6% better: not enough to go up, enough to stay
    assert choose_k([np.array([0.9])], up, 1, current=0) == 0
    assert choose_k([np.array([0.9])], up, 1, current=1) == 1
    assert choose_k([np.array([0.9])], _model({(0, 1): 1.0, (1, 1): 1.6}), 1, current=0) == 1  # 18.75%: up
    down = _model({(0, 1): 1.0, (1, 1): 2.0})  # K = 0 is 5% better: down
    assert choose_k([np.array([0.9])], down, 1, current=1) == 0


# ------------------------------------------------------------------------------------- the policy, simulated
def _stats(accepted, tried, drafts=None) -> Stats:
    return Stats(num_accepted_tokens_per_pos=np.array(accepted), num_tried_per_pos=np.array(tried),
                 num_drafts_per_pos=np.array(drafts if drafts is not None else tried))


def test_chain_prior_is_the_conditional_rate():
    # 10 steps at K = 3: draft 1 accepted 8 times, draft 2 (tried those 8 times) 4 times, draft 3 (tried 4) 2 times
    prior = chain_prior(_stats([8, 4, 2], [10, 8, 4], [10, 10, 10]), weight=0.0)
    assert prior.tolist() == pytest.approx([0.8, 0.5, 0.5])  # not 8/10, 4/10, 2/10: the chance given the ones before
    # untried positions take the previous position's rate; a position tried once and rejected is not zeroed
    assert chain_prior(_stats([0, 0, 0], [0, 0, 0])).tolist() == [PRIOR] * 3
    prior = chain_prior(_stats([9, 0, 0], [10, 1, 0]))
    w = PRIOR_WEIGHT
    assert prior[0] == pytest.approx((9 + w * PRIOR) / (10 + w)) and prior[1] == pytest.approx(w * prior[0] / (1 + w))
    assert prior[2] == prior[1]


def _sequences_drafting(rates, n, seed):
    """Whether each draft of a step is accepted, as a sequence whose draft j is accepted with probability rates[j]
    given the ones before it were: m = the drafts accepted out of `cap`."""
    rng = np.random.default_rng(seed)

    def accepted(cap: int) -> int:
        m = 0
        while m < cap and rng.random() < rates[m]:
            m += 1
        return m
    return accepted


def simulate(rates, costs: dict, nextn: int = 3, n: int = 1, steps: int = 60, seed: int = 0,
             history: Acceptance | None = None) -> list[int]:
    """The K auto_k has `n` sequences verify step after step (as decode.step runs them: a step verifies the drafts
    the sequences hold, at most the K chosen, and drafts the K chosen), each sequence's drafts accepted with the
    conditional rates `rates`, at the fixed step costs `costs` {(k, rows): seconds}; no model.  `history`: what
    each sequence is taken to have learnt before (default nothing)."""
    opts = DecodeOptions(nextn=nextn, max_new_tokens=1 << 30, adaptive=True)
    zeros = lambda *shape: np.zeros((n, *shape), np.int64)  # noqa: E731
    st = State(order=np.arange(n), n=n, past_len=zeros(), last=zeros(), thinking=zeros(), drafts=zeros(nextn),
               q_dist=None, mtp_past_len=zeros(1), carry=None, avail=zeros())
    seqs = {i: Sequence([1], max_new_tokens=1 << 30, acceptance=copy.deepcopy(history) if history else
                        Acceptance.empty(nextn)) for i in range(n)}
    batch = Batch(st, seqs, Stats(num_accepted_tokens_per_pos=np.zeros(nextn, np.int64)), opts, rows=1 << 30,
                  cost=_model(costs))
    st.avail[:] = join_k(batch, n)
    draws = [_sequences_drafting(rates, n, [seed, i]) for i in range(n)]
    ks = []
    for _ in range(steps):
        want = auto_k(batch)
        caps = np.minimum(st.avail[:n], want)
        k = int(caps.max())
        num = np.array([d(int(c)) for d, c in zip(draws, caps)])
        accept(st, seqs, np.zeros((n, k + 1), np.int32), num, batch.stats, opts, batch.rows, k,
               None if caps.min() == k else caps.tolist())
        st.avail[:n] = want
        ks.append(k)
    return ks


DEMO = [0.83, 0.75, 0.4]  # the demo's conditional acceptance per position (mtp-trt run, fixed K = 3)


def _costs(per_k, rows=1):
    return {(k, rows): s for k, s in enumerate(per_k)}


@pytest.mark.parametrize("per_k, best", [
    ([1.0, 1.02, 1.04, 1.06], 3),  # drafts almost free: all of them
    ([1.0, 1.1, 1.2, 1.6], 2),  # the third draft (accepted 40%) costs more than it brings
    ([1.0, 1.5, 2.3, 3.1], 1),
    ([1.0, 2.0, 3.0, 4.0], 0),
])
def test_one_sequence_finds_the_best_k_within_a_few_steps_and_stays(per_k, best):
    ks = simulate(DEMO, _costs(per_k), steps=100)
    trace = "".join(map(str, ks))
    assert trace[3:16] == str(best) * 13, trace  # within 3 steps, then steady until the first exploration
    # after it the best K again, but for the explorations (at steps 16, 48: two steps each, one more to climb back)
    assert ks[16:].count(best) >= len(ks) - 16 - 2 * 3, trace


def test_a_sequence_whose_drafts_failed_is_tried_again():
    """Sixty first drafts rejected in a row (K = 0 follows), then drafts as good as the demo's: what was learnt
    fades over the steps without drafts, the sequence drafts again within a few dozen steps and keeps the best K."""
    failed = Acceptance(np.array([60.0, 0.0, 0.0]), np.zeros(3))
    ks = simulate(DEMO, _costs([1.0, 1.1, 1.2, 1.6]), steps=120, history=failed)
    trace = "".join(map(str, ks))
    assert trace[:10] == "0" * 10 and trace[:50].strip("0"), trace
    assert ks[60:].count(2) >= 60 - 2 * 3, trace


def test_a_large_batch_settles_on_no_drafts_within_a_few_steps():
    # step costs where the demo's fixed K = 3 gives 0.73x (16 rows) and 0.68x (32 rows) nextn 0's tokens per second:
    # a verify row costs about as much as a token, no draft pays
    costs = {**_costs([2.3 * (1 + 0.9 * k) for k in range(4)], 16), **_costs([4.1 * (1 + k) for k in range(4)], 32)}
    for n in (16, 32):
        ks = simulate(DEMO, costs, n=n, steps=600)
        # the first step may try every position (none tried yet: assumed accepted); then no drafts, and no
        # exploration either: K = 1 could not pay here even with every draft accepted
        assert ks[1:].count(0) == len(ks) - 1, "".join(map(str, ks))


def test_a_batch_where_one_draft_could_pay_still_explores_it():
    costs = _costs([2.3 * (1 + 0.5 * k) for k in range(4)], 16)  # K = 1 pays if nearly every draft is accepted
    ks = simulate([0.2, 0.2, 0.2], costs, n=16, steps=200)
    assert 0 < ks[1:].count(1) <= 8, "".join(map(str, ks))  # tried now and then, ever rarer; never kept


# ------------------------------------------------------------------------------------------- the demo model
PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "The quick brown fox", "class Stack:"]
NEW = 40


@pytest.fixture(scope="module")
def demo():
    from mtp_trt.runner import open_runner

    runner = open_runner(None, threads=1)
    ids = [runner.encode(p) for p in PROMPTS]
    base = DecodeOptions(nextn=0, max_new_tokens=NEW, eos_ids=runner.manifest.eos_ids)
    plain, _ = generate(runner.backend, ids, base)
    return runner, ids, [s.generated for s in plain]


def cycling(ks):
    """A policy that asks for these K in turn (every transition: down, up, to and from 0)."""
    it = itertools.cycle(ks)
    return lambda batch: next(it)


@pytest.mark.parametrize("ks", [[3, 0, 2, 1, 3, 3, 0, 0, 1, 2], [0, 3, 3], [1, 0, 0, 2, 3, 1]])
def test_greedy_output_is_plain_greedy_whatever_k(demo, ks):
    runner, ids, plain = demo
    nextn = runner.manifest.nextn
    opts = DecodeOptions(nextn=nextn, max_new_tokens=NEW, eos_ids=runner.manifest.eos_ids, adaptive=True)
    seqs, stats = generate(runner.backend, ids, opts, policy=cycling([min(k, nextn) for k in ks]))
    assert [s.generated for s in seqs] == plain
    assert len(set(stats.k_chosen)) > 1, "K must vary for this test to bite"
    # each sequence's figures add up to the decode's
    assert sum(s.num_drafts for s in seqs) == stats.num_drafts
    assert sum(s.num_draft_tokens for s in seqs) == stats.num_draft_tokens
    per_pos = np.sum([s.accepted_per_pos for s in seqs if s.accepted_per_pos], 0)
    assert per_pos.tolist() == stats.num_accepted_tokens_per_pos
    assert stats.num_accepted_tokens > 0, "drafts must be accepted for this test to bite"


def test_auto_greedy_output_is_plain_greedy(demo):
    runner, ids, plain = demo
    opts = DecodeOptions(nextn=runner.manifest.nextn, max_new_tokens=NEW, eos_ids=runner.manifest.eos_ids,
                         adaptive=True)
    batch = open_batch(runner.backend, opts, len(ids), 256)
    calibrate(runner.backend, batch, ids[0], [1, len(ids)], steps=2)
    assert {k for k, _ in [(k, r) for k, t in batch.cost.seconds.items() for r in t]} == set(range(opts.nextn + 1))
    seqs, stats = generate(runner.backend, ids, opts, cost=batch.cost)
    assert [s.generated for s in seqs] == plain
    assert stats.k_chosen and all(0 <= k <= opts.nextn for k in stats.k_chosen)


def test_sampling_with_varying_k_is_reproducible(demo):
    runner, ids, _ = demo
    opts = DecodeOptions(nextn=runner.manifest.nextn, max_new_tokens=24, eos_ids=runner.manifest.eos_ids,
                         adaptive=True, sampling=SamplingParams(temperature=0.8))
    ks = [min(k, opts.nextn) for k in [2, 0, 3, 1]]
    a, sa = generate(runner.backend, ids, opts, seed=7, policy=cycling(ks))
    b, _ = generate(runner.backend, ids, opts, seed=7, policy=cycling(ks))
    assert [s.generated for s in a] == [s.generated for s in b]
    assert len(set(sa.k_chosen)) > 1 and sa.num_drafts > 0
    fixed, _ = generate(runner.backend, ids, dataclasses.replace(opts, adaptive=False), seed=7)
    assert all(len(s.generated) > 0 for s in fixed)


def test_auto_follows_the_costs_and_keeps_seeded_sampling_at_all_drafts(demo):
    runner, ids, plain = demo
    nextn = runner.manifest.nextn
    opts = DecodeOptions(nextn=nextn, max_new_tokens=NEW, eos_ids=runner.manifest.eos_ids, adaptive=True)
    dear = CostModel()  # drafts that cost far more than they can bring: auto stops drafting (but to explore)
    for k in range(nextn + 1):
        for rows in (1, len(ids)):
            observe_cost(dear, k, rows, 1.0 + 10.0 * k)
    seqs, stats = generate(runner.backend, ids, opts, cost=dear)
    assert [s.generated for s in seqs] == plain
    assert stats.k_chosen.count(0) > len(stats.k_chosen) // 2
    # a seeded sampling decode keeps every draft (its text then is that of --speculation fixed with the same seed)
    sampled = dataclasses.replace(opts, sampling=SamplingParams(temperature=0.8), max_new_tokens=16)
    a, sa = generate(runner.backend, ids, sampled, seed=5, cost=dear)
    b, _ = generate(runner.backend, ids, dataclasses.replace(sampled, adaptive=False), seed=5)
    assert set(sa.k_chosen) == {nextn}
    assert [s.generated for s in a] == [s.generated for s in b]


# ------------------------------------------------------------------------------------------- the command line
def _cli(*args):
    from typer.testing import CliRunner

    from mtp_trt.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("args, says", [
    (["--speculation", "auto", "--nextn", "1"], "--speculation auto chooses K per step, but --nextn fixes it"),
    (["--speculation", "auto", "--tree-topk", "2"], "trees are drafted at a fixed depth"),
    (["--speculation", "sometimes"], "--speculation: unknown mode 'sometimes'; expected one of auto, fixed"),
])
def test_contradictory_speculation_flags_are_one_line(args, says):
    r = _cli("run", "-p", "x", *args)
    assert r.exit_code == 2  # (mtp-trt's status for a refused command line)
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], r.output


def test_run_json_auto_reports_per_result_figures_and_plain_greedy_text(demo):
    runner, ids, plain = demo
    r = _cli("run", *[x for p in PROMPTS for x in ("-p", p)], "--max-new-tokens", NEW, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout[r.stdout.index("{"):])
    assert [x["tokens"] for x in out["results"]] == plain
    s = out["summary"]
    assert s["speculation"] == "auto" and sum(s["k_steps"].values()) == s["steps"]
    specs = [x["speculative_decoding"] for x in out["results"]]
    assert sum(x["num_accepted_draft_tokens"] for x in specs) == s["num_accepted_tokens"]
    assert sum(x["num_draft_tokens"] for x in specs) == s["num_draft_tokens"]
    assert all(x["num_spec_tokens"] == runner.manifest.nextn for x in specs)
    fixed = _cli("run", "-p", PROMPTS[0], "--max-new-tokens", NEW, "--json", "--speculation", "fixed")
    f = json.loads(fixed.stdout[fixed.stdout.index("{"):])
    assert f["summary"]["speculation"] == "fixed" and f["summary"]["k_steps"] == {str(runner.manifest.nextn):
                                                                                  f["summary"]["steps"]}
    assert f["results"][0]["tokens"] == plain[0]


def test_one_sequence_with_cheap_drafts_reaches_all_drafts(demo):
    runner, ids, plain = demo
    nextn = runner.manifest.nextn
    opts = DecodeOptions(nextn=nextn, max_new_tokens=64, eos_ids=runner.manifest.eos_ids, adaptive=True)
    cheap = _model(_costs([1.0 + 0.01 * k for k in range(nextn + 1)]))
    seqs, stats = generate(runner.backend, ids[:1], opts, cost=cheap)
    assert seqs[0].generated[:len(plain[0])] == plain[0]
    ks = stats.k_chosen
    assert ks[2:16] == [nextn] * 14, ks  # from the third step, until the first exploration


def test_joining_sequences_draft_what_the_batch_they_join_will_run(demo):
    from mtp_trt.decode import join_k

    runner, ids, _ = demo
    nextn = runner.manifest.nextn
    opts = DecodeOptions(nextn=nextn, max_new_tokens=8, eos_ids=runner.manifest.eos_ids, adaptive=True)
    batch = open_batch(runner.backend, opts, 4, 128)
    assert join_k(batch, 4) == batch.k  # nothing measured: as before
    for k in range(nextn + 1):  # drafts cheap alone, dear at 4 rows
        observe_cost(batch.cost, k, 1, 1.0 + 0.05 * k)
        observe_cost(batch.cost, k, 4, 4.0 + 4.0 * k)
    assert join_k(batch, 1) == nextn
    assert join_k(batch, 4) == 0
