"""Adaptive speculation: how many draft tokens K (0 .. the export's nextn) the next decode step verifies.

Plain functions over explicit state (gpt-fast style), used by mtp_trt/decode.py before every step:

* each sequence keeps its recent acceptance per draft position, exponentially decayed (`Acceptance`): position j
  is *tried* when drafts 1..j-1 were accepted, and its rate a_j is accepted / tried (the chance that draft j is
  accepted given the ones before it were);
* a `CostModel` holds the measured seconds of one step per (K, batch rows): timed at start-up (`calibrate` in
  decode.py), interpolated in the rows between measured sizes, times a load factor per batch size that every K
  shares, which follows the steps actually run (so that steps timed while the machine is busy make every K dearer
  alike, not only the K running);
* `choose_k` picks the K maximizing expected accepted tokens per second of the batch:
  sum over the sequences of E_K = 1 + sum_{i<=K} prod_{j<=i} a_j, divided by the step's cost at (rows, K).
"""

from __future__ import annotations

import dataclasses

import numpy as np

DECAY = 0.9  # weight of an acceptance observation after each later step of the same sequence
FORGET = 0.95  # ... after each later step that tried none of its drafts (K = 0): what was learnt fades back to the
# prior, so that a sequence whose drafts once failed is tried again (after about 20 such steps at the demo's rates)
PRIOR = 1.0  # acceptance assumed of a position no sequence has tried yet: optimistic, so that it is tried (its first
PRIOR_WEIGHT = 4.0  # observations soon outweigh it: this many pseudo-observations; one rejected draft is no verdict)
COST_ALPHA = 0.1  # EWMA weight of a newly timed step in the load factor
SHAPE_ALPHA = 0.002  # ... and in its own K's cost beside the others' (slow: a K seldom run keeps its calibrated cost)
CLIP = 1.5  # a slower timed step counts as at most this factor above the estimate
DOWN_ALPHA = 0.5  # EWMA weight of a step faster than the estimate
MARGIN = 0.03  # a smaller K must promise this much more than the current one
UP_MARGIN = 0.10  # a larger one this much (going up costs a step that drafts more, unfused)


@dataclasses.dataclass
class Acceptance:
    """Decayed counts per draft position: tried[j], accepted[j] (position j + 1); `at`: the sequence's step count
    when they were last observed."""

    tried: np.ndarray
    accepted: np.ndarray
    at: int = 0

    @classmethod
    def empty(cls, k: int) -> Acceptance:
        return cls(np.zeros(k), np.zeros(k))


def observe_acceptance(a: Acceptance, k: int, m: int, step: int | None = None, decay: float = DECAY) -> None:
    """One verify step (the sequence's `step`-th) with `k` drafts, `m` of them accepted: positions 1..min(m + 1, k)
    were tried, 1..m accepted.  Older observations decay by `decay` (only the positions this step tried: a position
    not tried keeps what was last learnt about it), and by FORGET for each step without drafts since the last."""
    if k <= 0:
        return
    if step is not None:
        a.tried[:], a.accepted[:] = remembered(a, step - 1)
        a.at = step
    tried = min(m + 1, k)
    a.tried[:tried] = a.tried[:tried] * decay + 1
    a.accepted[:tried] *= decay
    a.accepted[:m] += 1


def remembered(a: Acceptance, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(tried, accepted) as of the sequence's `step`-th step: faded by FORGET for each step since they were
    observed (steps that verified no draft)."""
    f = FORGET ** max(0, step - a.at)
    return a.tried * f, a.accepted * f


def acceptance_rates(a: Acceptance, prior: np.ndarray | None = None, weight: float = PRIOR_WEIGHT) -> np.ndarray:
    """a_j per position: (accepted + weight * prior) / (tried + weight); `prior` (default PRIOR) stands in for a
    position with little history (a new sequence: the batch's rates).  Counts [n, K] (n sequences' stacked) give
    rates [n, K]."""
    p = np.full(a.tried.shape[-1], PRIOR) if prior is None else np.asarray(prior, float)
    return (a.accepted + weight * p) / (a.tried + weight)


def expected_tokens(rates: np.ndarray, k: int) -> float:
    """Tokens one step with k drafts emits on average: 1 + sum_{i<=k} prod_{j<=i} a_j."""
    return 1.0 + float(np.cumprod(np.asarray(rates[:k], float)).sum()) if k > 0 else 1.0


@dataclasses.dataclass
class CostModel:
    """Seconds of one decode step by (k, rows): each K's cost as timed, times a load factor per batch size shared by
    every K, both following the timed steps (`observe_cost`)."""

    seconds: dict = dataclasses.field(default_factory=dict)  # k -> {rows: seconds at load 1}
    alpha: float = COST_ALPHA
    load: dict = dataclasses.field(default_factory=dict)  # rows -> how much slower steps run now than `seconds` says


def observe_cost(model: CostModel, k: int, rows: int, seconds: float) -> None:
    """A step of `rows` sequences with `k` drafts took `seconds`: the first time at that size, its cost (at the
    current load); after that its ratio to the estimate moves the load factor of that size, which every K shares
    (weight `alpha`), and slowly this K's cost beside the others' (SHAPE_ALPHA).  A slower step counts as at most
    CLIP x the estimate (one step the process was preempted in moves it little; a lasting change still gets there);
    a faster one with weight DOWN_ALPHA (a step is never faster than the work allows: an estimate taken while the
    machine was busy comes down at once)."""
    table = model.seconds.setdefault(k, {})
    load = _interpolate(model.load, rows, flat=True) or 1.0
    base = table.get(rows)
    if base is None:
        table[rows] = seconds / load
        return
    ratio = seconds / (base * load)
    ratio, weight = (min(ratio, CLIP), model.alpha) if ratio >= 1 else (ratio, DOWN_ALPHA)
    model.load[rows] = load * (1 - weight + weight * ratio)
    table[rows] = base * (1 - SHAPE_ALPHA + SHAPE_ALPHA * ratio)


def estimate_cost(model: CostModel, k: int, rows: int) -> float | None:
    """Estimated seconds of a step of `rows` sequences with `k` drafts: measured, else linear between the nearest
    measured row counts (beyond them: proportional to the rows from the nearest), times the load factor at that
    size (likewise between sizes; beyond them the nearest's); None when k was never timed."""
    cost = _interpolate(model.seconds.get(k), rows)
    return None if cost is None else cost * (_interpolate(model.load, rows, flat=True) or 1.0)


def _interpolate(table: dict | None, rows: int, flat: bool = False) -> float | None:
    """table[rows], else linear between the nearest sizes; beyond them the nearest's value (flat) or that value
    scaled by the rows (a cost)."""
    if not table:
        return None
    if rows in table:
        return table[rows]
    below = [r for r in table if r < rows]
    above = [r for r in table if r > rows]
    if below and above:
        lo, hi = max(below), min(above)
        return table[lo] + (table[hi] - table[lo]) * (rows - lo) / (hi - lo)
    near = max(below) if below else min(above)
    return table[near] if flat else table[near] * rows / near


def batch_expected_tokens(rates) -> np.ndarray:
    """[K + 1]: for k = 0..K, the tokens a step with k drafts emits over sequences with these rates [n, K] (the sum
    of their expected_tokens), at once."""
    rates = np.asarray(rates, float).reshape(len(rates), -1)
    per_k = np.cumprod(rates, axis=1).sum(axis=0)  # [K]: sum over sequences of prod_{j<=i} a_j
    return len(rates) + np.concatenate([[0.0], np.cumsum(per_k)])


def could_pay(rates, model: CostModel, k: int, current: int, up_margin: float = UP_MARGIN) -> bool:
    """Whether exploring k could find it better than the current K over sequences with these rates [n, K]: above,
    if with every draft accepted it would beat the current K by `up_margin`; below, if the estimates put it within
    `up_margin` of the current K (where they may be wrong).  True where either cost is unknown."""
    n = len(rates)
    c_k, c_now = estimate_cost(model, k, n), estimate_cost(model, current, n)
    if not c_k or not c_now:
        return True
    tokens = batch_expected_tokens(rates)
    now = float(tokens[current]) / c_now
    if k > current:
        return n * (1 + k) / c_k > (1 + up_margin) * now
    return float(tokens[k]) / c_k > now / (1 + up_margin)


def choose_k(rates: list[np.ndarray], model: CostModel, max_k: int, current: int | None = None,
             margin: float = MARGIN, up_margin: float = UP_MARGIN) -> int:
    """The K in 0..max_k maximizing expected tokens per second of a step over these sequences (their acceptance
    rates per position): its tokens over its cost; a K whose cost was never measured is not chosen (`current`, else
    max_k, when none was).  Ties go to the smaller K; `current` (the K the sequences hold drafts for) stays unless a
    smaller K beats it by `margin`, a larger one by `up_margin` (timing noise should not flip K every step, and
    going up costs a step that verifies the drafts held and drafts more, unfused)."""
    fallback = max_k if current is None else current
    if len(rates) == 0:
        return fallback
    tokens = batch_expected_tokens(rates)
    costs = [(k, estimate_cost(model, k, len(rates))) for k in range(max_k + 1)]
    scored = [(k, float(tokens[k]) / c) for k, c in costs if c is not None and c > 0]
    if not scored:
        return fallback
    best, best_rate = scored[0]
    for k, r in scored[1:]:
        if r > best_rate * (1 + 1e-9):
            best, best_rate = k, r
    here = dict(scored).get(current)
    if here is not None and best_rate <= here * (1 + (up_margin if best > current else margin)):
        return current
    return best


def cost_summary(model: CostModel) -> dict[tuple[int, int], float]:
    """{(k, rows): seconds} of every measured step (for /metrics)."""
    return {(k, rows): estimate_cost(model, k, rows) for k, table in sorted(model.seconds.items())
            for rows in sorted(table)}
