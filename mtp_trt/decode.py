"""The MTP speculative decoding loop: prefill -> draft -> verify -> accept -> rewind, over explicit state.

Positions: the target cache holds rows 0..past_len-1 of each sequence; `last` is the newest accepted
token, not yet in the cache.  A verify step feeds [last, d_1..d_K] at positions past_len..past_len+K;
the target accepts n drafts and a bonus token, so the hidden state at row q = past_len + n predicted
the bonus, rows past_len..q are committed and the rest is rewound (past_len = q + 1: later steps
overwrite the rejected rows).  MTP row i takes (h_i, t_{i+1}) and predicts t_{i+2}.

  eagle   : one MTP module and cache.  Depth 1 runs rows past_len_old..q (true tokens) and drafts
            d_1 from row q; depth k > 1 runs one row at q + k - 1 on depth k-1's output hidden and
            d_{k-1} (those rows are speculative and overwritten next step).
  vanilla : module k at depth k, each with its own cache.  Depth k row i takes depth k-1's hidden at
            row i and t_{i+k}; rows up to q + 1 - k have true tokens and are committed, the rest use
            this step's drafts.  Each depth keeps the one hidden state of the previous depth that its
            next step needs (`carry`), TensorRT-LLM's "past tokens and hidden states".
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable

import numpy as np

from mtp_trt import contract as C
from mtp_trt.backend import Backend, relaxed_inputs
from mtp_trt.sampling import SamplingParams, probabilities, sample, speculative_accept
from mtp_trt.speculation import (PRIOR, PRIOR_WEIGHT, Acceptance, CostModel, acceptance_rates, choose_k, could_pay,
                                  observe_acceptance, observe_cost, remembered)
from mtp_trt.tree import TreeShape, chain_tree


@dataclasses.dataclass
class Sequence:
    """One request: its tokens (prompt + accepted), its own sampling and length limit, and its result."""

    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)  # prompt + generated
    finish_reason: str | None = None
    message: str = ""
    steps: int = 0  # verify steps run for this sequence
    # (q, drafts) per step; a tree step logs (q, its tokens then its parents)
    draft_log: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 128
    rng: np.random.Generator | None = None  # this sequence's draws (sampling only): sequence_rng
    # its speculative figures (vLLM's names): verify steps with drafts, draft tokens, accepted drafts per position
    num_drafts: int = 0
    num_draft_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)
    drafts_per_pos: list[int] = dataclasses.field(default_factory=list)  # drafts that had position j
    accepted_hist: list[int] = dataclasses.field(default_factory=list)  # [j]: steps that accepted j drafts
    acceptance: Acceptance | None = None  # its recent acceptance per position (adaptive speculation)
    # every step with all drafts while it runs (adaptive speculation): a sampling sequence's draws (and so its text)
    # depend on the K of each step, lossless either way but reproducible only at a fixed K.  None: whether it samples
    # (a server passes False for a sampling request without a seed)
    fixed_k: bool | None = None

    @property
    def keeps_k(self) -> bool:
        return (not self.sampling.greedy) if self.fixed_k is None else self.fixed_k

    def spec_usage(self, nextn: int) -> dict:
        """This sequence's speculative figures under vLLM's per-request names (`--per-request-spec-decode-metrics`),
        with the acceptance per draft position: num_spec_steps are its verify steps with drafts, nextn the most
        drafts a step may have; a position no draft of it had has no acceptance rate (None)."""
        accepted = sum(self.accepted_per_pos)
        hist = self.accepted_hist + [0] * (nextn + 1 - len(self.accepted_hist))
        return {"mean_acceptance_length": round(1 + accepted / self.num_drafts, 4) if self.num_drafts else 1.0,
                "draft_acceptance_rate": round(accepted / self.num_draft_tokens, 4) if self.num_draft_tokens else 0.0,
                "acceptance_histogram": hist, "num_spec_steps": self.num_drafts,
                "num_accepted_draft_tokens": accepted, "num_draft_tokens": self.num_draft_tokens,
                "num_spec_tokens": nextn,
                "num_accepted_tokens_per_pos": self.accepted_per_pos + [0] * (nextn - len(self.accepted_per_pos)),
                "acceptance_rate_per_pos": [round(a / d, 4) if d else None for a, d in
                                            zip(self.accepted_per_pos + [0] * nextn, self.drafts_per_pos + [0] * nextn)
                                            ][:nextn]}

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def num_generated(self) -> int:
        """len(generated), without the copy."""
        return len(self.tokens) - len(self.prompt)


def sequence_rng(seed: int, index: int = 0) -> np.random.Generator:
    """The random draws of sequence `index` of a decode seeded with `seed`: its own stream, so that what it
    samples does not depend on the sequences decoded beside it."""
    return np.random.default_rng([seed, index])


@dataclasses.dataclass
class State:
    """Per-slot arrays; slot i holds sequence order[i]; slots 0..n-1 are the unfinished ones."""

    order: np.ndarray  # [B] sequence index of each slot
    n: int  # active slots
    past_len: np.ndarray  # [B] target cache rows
    last: np.ndarray  # [B] newest accepted token
    thinking: np.ndarray  # [B] thinking flag after `last`
    drafts: np.ndarray  # [B, K]
    q_dist: np.ndarray | None  # [B, K, V] drafter distributions (sampling only)
    mtp_past_len: np.ndarray  # [B, depths] committed rows of each MTP cache (eagle: 1 column)
    carry: np.ndarray | None  # [B, K, D] vanilla: depth k-1's hidden at row mtp_past_len[:, k-1]
    tree_tokens: np.ndarray | None = None  # [B, N] tree drafting: the next step's tree (mtp_trt/tree.py)
    tree_parents: np.ndarray | None = None  # [B, N]
    avail: np.ndarray | None = None  # [B] drafts each slot holds for its next step (adaptive speculation)
    ids: np.ndarray = dataclasses.field(init=False)  # [B, 1 + K]: last, then the drafts (a chain step's input_ids)

    def __post_init__(self):
        # `last` and `drafts` are the columns of `ids`: a step feeds [last, d_1..d_K] without gathering them
        self.ids = np.concatenate([self.last[:, None], self.drafts], 1).astype(np.int32)
        self.last, self.drafts = self.ids[:, 0], self.ids[:, 1:]


@dataclasses.dataclass
class Stats:
    """A decode's speculative-decoding figures, under vLLM's names: a draft is the K tokens one sequence's verify
    step checks (K = 0: plain steps); accepted tokens are accepted drafts, without the bonus token each step adds."""

    steps: int = 0  # batched verify steps
    num_drafts: int = 0  # verify steps with drafts (K > 0) summed over the sequences
    # per draft position (Python lists: counted on every step, see accept)
    num_accepted_tokens_per_pos: list[int] | None = None  # [K] drafts accepted at each position
    num_drafts_per_pos: list[int] | None = None  # [K] drafts that had position j (K varies: adaptive speculation)
    num_tried_per_pos: list[int] | None = None  # [K] drafts that had position j with positions 1..j-1 accepted
    draft_tokens: int = 0  # draft tokens verified
    seq_steps: int = 0  # verify steps summed over the sequences, with drafts or without
    k_chosen: list = dataclasses.field(default_factory=list)  # the K of each batched step
    last_accepted: list = dataclasses.field(default_factory=list)  # the drafts each sequence accepted, last step

    def __post_init__(self):
        if self.num_accepted_tokens_per_pos is not None:
            width = len(self.num_accepted_tokens_per_pos)
            for name in ("num_accepted_tokens_per_pos", "num_drafts_per_pos", "num_tried_per_pos"):
                counts = getattr(self, name)
                setattr(self, name, [0] * width if counts is None else [int(c) for c in counts])

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.num_accepted_tokens_per_pos)

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens verified: K per draft (a tree's depth: one path's)."""
        return self.draft_tokens

    @property
    def num_emitted_tokens(self) -> int:
        """Tokens the verify steps emitted: the accepted drafts and each step's bonus token."""
        return self.num_accepted_tokens + self.seq_steps

    @property
    def mean_acceptance_length(self) -> float:
        """Mean tokens per verify step of a sequence (accepted drafts + the bonus; 1 for steps without drafts)."""
        return self.num_emitted_tokens / max(self.seq_steps, 1)

    @property
    def acceptance_rate_per_pos(self) -> list[float | None]:
        """The share of the drafts at each position that were accepted (vLLM's: of all drafts that had position
        j); None for a position no draft had (adaptive speculation may never run that many drafts)."""
        return [float(a / d) if d else None for a, d in zip(self.num_accepted_tokens_per_pos, self.num_drafts_per_pos)]

    def __add__(self, other: Stats) -> Stats:
        """The figures of two decodes with the same nextn taken together."""
        add = lambda a, b: [x + y for x, y in zip(a, b)]  # noqa: E731
        return Stats(self.steps + other.steps, self.num_drafts + other.num_drafts,
                     add(self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos),
                     add(self.num_drafts_per_pos, other.num_drafts_per_pos),
                     add(self.num_tried_per_pos, other.num_tried_per_pos), self.draft_tokens + other.draft_tokens,
                     self.seq_steps + other.seq_steps, self.k_chosen + other.k_chosen)


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    nextn: int
    sampling: SamplingParams = SamplingParams()
    relaxed_topk: int = 0  # > 0: relaxed acceptance while thinking (greedy only)
    relaxed_delta: float = 0.0
    max_new_tokens: int = 128
    eos_ids: tuple[int, ...] = ()
    think_ids: tuple[int, int] = (-1, -1)
    tree: TreeShape | None = None  # greedy tree drafting of depth nextn, either mode (sampling runs the chain)
    adaptive: bool = False  # choose K in 0..nextn before every step (mtp_trt/speculation.py); eagle chains only

    @property
    def tree_graph(self) -> str | None:
        """The tree graph this decode runs: `tree`'s when greedy with nextn > 0 (sampling drafts the chain)."""
        return self.tree.graph if self.tree is not None and self.sampling.greedy and self.nextn else None


def thinking_after(tokens, flag: int, think_ids: tuple[int, int]) -> int:
    """The thinking flag after `tokens`: on at <think>, off at </think>."""
    for t in tokens:
        flag = 1 if t == think_ids[0] else 0 if t == think_ids[1] else flag
    return flag


def _samples(active: list[Sequence]) -> bool:
    """Whether any of these sequences samples (the graphs must then return logits)."""
    return any(not s.sampling.greedy for s in active)


def _pick(out: dict, logits_key: str, tokens_key: str, rows: np.ndarray, active: list[Sequence]):
    """Token at one row per sequence of a graph's output: the graph's argmax for greedy sequences, a draw from
    its own filtered distribution (with its own rng) for sampling ones.  Returns the tokens and, when any
    sequence samples, the distributions [n, V] (zero rows for greedy sequences)."""
    idx = np.arange(len(rows))
    tokens = out[tokens_key][idx, rows].astype(np.int32)
    if not _samples(active):
        return tokens, None
    logits = out[logits_key][idx, rows]
    p = np.zeros(logits.shape, np.float64)
    for i, s in enumerate(active):
        if not s.sampling.greedy:
            p[i] = probabilities(logits[i], s.sampling)
            tokens[i] = sample(p[i], s.rng)
    return tokens, p


def _active(st: State, seqs) -> list[Sequence]:
    """The sequences in slots 0..n-1 (`seqs`: a list or a dict by sequence id)."""
    return [seqs[o] for o in st.order[:st.n].tolist()]


# ------------------------------------------------------------------------------------------- steps
def draft(backend: Backend, st: State, seqs, hidden: np.ndarray, start: np.ndarray, opts: DecodeOptions,
          k: int | None = None) -> None:
    """Fill st.drafts[:, :k] (and st.q_dist) for the active slots (k: default opts.nextn).  `hidden` [n, S, D] is
    the target's output for rows start .. start+S-1; the last accepted position is q = past_len - 1 (past_len
    already advanced)."""
    n, k = st.n, opts.nextn if k is None else k
    if k == 0:
        return
    q = st.past_len[:n] - 1
    active = _active(st, seqs)
    logits = _samples(active)
    mtp_graphs = backend.manifest.mtp_graphs
    qd = [] if logits else None
    # Depth 1 (both modes): rows start..q, hidden h_i, tokens t_{i+1} (all accepted, true).
    rows = q - start + 1
    toks = np.zeros((n, rows.max()), np.int32)
    for i, s in enumerate(active):
        toks[i, :rows[i]] = s.tokens[start[i] + 1: q[i] + 2]
    out = backend.mtp(0, mtp_graphs[0], n, hidden[:, :rows.max()], toks, start.astype(np.int32), logits=logits)
    d, p = _pick(out, C.DRAFT_LOGITS, C.DRAFT_TOKENS, rows - 1, active)
    st.drafts[:n, 0] = d
    if qd is not None:
        qd.append(p)
    if backend.manifest.mtp_mode == "eagle":
        st.mtp_past_len[:n, 0] = q + 1
        h = out[C.HIDDEN_OUT][np.arange(n), rows - 1][:, None]
        for depth in range(2, k + 1):
            out = backend.mtp(0, mtp_graphs[0], n, h, st.drafts[:n, depth - 2, None],
                              (q + depth - 1).astype(np.int32), logits=logits)
            d, p = _pick(out, C.DRAFT_LOGITS, C.DRAFT_TOKENS, np.zeros(n, int), active)
            st.drafts[:n, depth - 1] = d
            h = out[C.HIDDEN_OUT]
            if qd is not None:
                qd.append(p)
    else:
        _draft_vanilla(backend, st, active, out, start, q, opts, qd)
    if qd is not None:
        dist = np.stack(qd, 1)
        width = st.drafts.shape[1]
        if st.q_dist is None or st.q_dist.shape[2:] != dist.shape[2:]:
            st.q_dist = np.zeros((len(st.order), width, *dist.shape[2:]), dist.dtype)
        st.q_dist[:n, :k] = dist
    for i, s in enumerate(active):
        s.draft_log.append((int(q[i]), st.drafts[i, :k].tolist()))


def _draft_vanilla(backend, st, active, out1, start1, q, opts, qd) -> None:
    """Depths 2..K of vanilla mode (see the module docstring)."""
    n, k = st.n, opts.nextn
    if st.carry is None:
        st.carry = np.zeros((len(st.order), k, out1[C.HIDDEN_OUT].shape[-1]), out1[C.HIDDEN_OUT].dtype)
    st.mtp_past_len[:n, 0] = q + 1
    prev_out, prev_start = out1, start1  # depth d-1's outputs cover rows prev_start .. q
    for depth in range(2, k + 1):
        start = st.mtp_past_len[:n, depth - 1].copy()  # first uncommitted row of this depth
        rows = q - start + 1
        width = rows.max()
        hid = np.zeros((n, width, prev_out[C.HIDDEN_OUT].shape[-1]), prev_out[C.HIDDEN_OUT].dtype)
        toks = np.zeros((n, width), np.int32)
        for i, s in enumerate(active):
            for r in range(rows[i]):
                row = start[i] + r
                pos = row + depth  # the token this row embeds: t_{row + depth}
                toks[i, r] = s.tokens[pos] if pos <= q[i] + 1 else st.drafts[i, pos - q[i] - 2]
                j = row - prev_start[i]
                hid[i, r] = prev_out[C.HIDDEN_OUT][i, j] if j >= 0 else st.carry[i, depth - 1]
        out = backend.mtp(depth - 1, backend.manifest.mtp_graphs[depth - 1], n, hid, toks,
                          start.astype(np.int32), logits=qd is not None)
        d, p = _pick(out, C.DRAFT_LOGITS, C.DRAFT_TOKENS, rows - 1, active)
        st.drafts[:n, depth - 1] = d
        if qd is not None:
            qd.append(p)
        # Commit rows up to q + 1 - depth; keep depth d-1's hidden at the next step's first row.  A prompt
        # shorter than the depth commits nothing yet: the window starts at row 0 (there is no row before it).
        new_start = np.maximum(q + 2 - depth, 0)
        st.carry[np.arange(n), depth - 1] = prev_out[C.HIDDEN_OUT][np.arange(n), new_start - prev_start]
        st.mtp_past_len[:n, depth - 1] = new_start
        prev_out, prev_start = out, start


def verify(backend: Backend, st: State, seqs, opts: DecodeOptions, k: int | None = None,
           caps: list[int] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run the target on [last, the first k drafts] (k: default opts.nextn) and accept: greedy sequences as the
    graph does (relaxed while thinking when asked), sampling ones by lossless rejection sampling with their own
    parameters.  caps[i]: sequence i's drafts (<= k; the others in its row are not its own: never accepted).
    Returns accepted tokens [n, K+1] (then -1), the number of drafts accepted [n], and the hidden states
    [n, K+1, D]."""
    n, k = st.n, opts.nextn if k is None else k
    active = _active(st, seqs)
    ids = np.concatenate([st.last[:n, None], st.drafts[:n, :k]], 1).astype(np.int32)
    before = st.thinking[:n].copy()
    out = backend.target(n, ids, st.past_len[:n], before, opts.relaxed_topk, opts.relaxed_delta,
                         logits=_samples(active))
    tokens, num = out[C.ACCEPTED_TOKENS].copy(), out[C.NUM_ACCEPTED].copy()
    st.thinking[:n] = out[C.THINKING_OUT]
    for i, s in enumerate(active):
        c = k if caps is None else caps[i]
        if s.sampling.greedy:
            if num[i] > c:  # drafts c+1.. were accepted, so token c is the target's own: the bonus
                num[i] = c
                tokens[i, c + 1:] = -1
                st.thinking[i] = thinking_after(tokens[i, :c + 1].tolist(), before[i], opts.think_ids)
            continue
        p = probabilities(out[C.LOGITS][i:i + 1, :c + 1], s.sampling)
        q = st.q_dist[i:i + 1, :c] if st.q_dist is not None and c else np.zeros((1, 0, p.shape[-1]))
        t, m = speculative_accept(p, q, st.drafts[i:i + 1, :c], s.rng)
        tokens[i] = -1
        tokens[i, :c + 1], num[i] = t[0], m[0]
        st.thinking[i] = thinking_after(t[0, :m[0] + 1], before[i], opts.think_ids)
    return tokens, num, out[C.HIDDEN_STATES]


def fused_step(backend: Backend, st: State, seqs, stats: Stats, opts: DecodeOptions, rows: int,
               k: int | None = None, active: list[Sequence] | None = None) -> None:
    """Greedy: verify, accept and draft in one backend call: the export's `step_K` graph, or with
    opts.tree_graph its tree graph (verify the tree, accept its longest path, commit it, draft the next tree:
    exporters/tree.py, exporters/tree_vanilla.py).  Vanilla passes and keeps the carried hidden states of
    depths 1..K-1 (st.carry[:, 1:]); every MTP cache k then holds rows < past_len + 1 - k, as after the
    separate graphs.  `active`: the sequences in slots 0..n-1 where the caller has them.
    (A step's Python runs after the graph's run has taken the caches: a NumPy ufunc costs ~10 microseconds then,
    so the work here is whole-array copies and Python lists.)"""
    n, k, tree = st.n, opts.nextn if k is None else k, opts.tree_graph
    active = _active(st, seqs) if active is None else active
    if tree:  # [last, the tree]
        ids = np.empty((n, 1 + st.tree_tokens.shape[1]), np.int32)
        ids[:, 0], ids[:, 1:] = st.last[:n], st.tree_tokens[:n]
    else:
        ids = st.ids[:n, :k + 1]
    carry = st.carry[:n, 1:] if st.carry is not None and k > 1 else None
    rest = (st.past_len[:n], st.thinking[:n], opts.relaxed_topk, opts.relaxed_delta, carry)
    out = backend.tree_step(tree, n, ids, st.tree_parents[:n], *rest) if tree else backend.step(n, ids, *rest)
    st.thinking[:n] = out[C.THINKING_OUT]
    accept(st, seqs, out[C.ACCEPTED_TOKENS], out[C.NUM_ACCEPTED], stats, opts, rows, k, active=active)
    if not k:
        return
    if tree:
        st.tree_tokens[:n], st.tree_parents[:n] = out[C.TREE_TOKENS], out[C.TREE_PARENTS_OUT]
        drafts = [t + p for t, p in zip(out[C.TREE_TOKENS].tolist(), out[C.TREE_PARENTS_OUT].tolist())]
    else:
        st.drafts[:n, :k] = out[C.DRAFTS]
        drafts = out[C.DRAFTS].tolist()
    # both graphs commit module k's rows below past_len + 1 - k (an unfused step drafts on from there): module
    # j + 1's past_len - j (lists, not a NumPy ufunc: see the docstring)
    past = st.past_len[:n].tolist()
    st.mtp_past_len[:n] = [[p - j for j in range(st.mtp_past_len.shape[1])] for p in past]
    if C.CARRY_OUT in out:
        st.carry[:n, 1:] = out[C.CARRY_OUT]
    for s, p, d in zip(active, past, drafts):
        if s.finish_reason is None:  # a tree step logs its tokens, then its parents
            s.draft_log.append((p - 1, d))


def accept(st: State, seqs, tokens: np.ndarray, num: np.ndarray, stats: Stats, opts: DecodeOptions,
           rows: int, k: int | None = None, caps: list[int] | None = None,
           active: list[Sequence] | None = None) -> list[int]:
    """Append the accepted tokens, advance (and so rewind) the lengths, apply the stop conditions, count the
    step's drafts (k: the drafts verified, default opts.nextn; a tree's depth; caps: each sequence's, when fewer).
    `active`: the sequences in slots 0..n-1 where the caller has them.  Returns the start rows of this step (the
    old past_len) for the MTP depth-1 update."""
    n, k = st.n, opts.nextn if k is None else k
    # (One loop over the sequences, on Python lists: after the graph's run the step's code is out of the caches, and
    # every NumPy ufunc, comprehension or generator costs microseconds to bring back)
    accepted, nums, start = tokens.tolist(), num.tolist(), st.past_len[:n].tolist()
    after, last, width = [], [], len(stats.num_accepted_tokens_per_pos)
    stats.steps += 1
    stats.seq_steps += n
    stats.k_chosen.append(k)
    stats.last_accepted = nums
    for i, s in enumerate(_active(st, seqs) if active is None else active):
        row, m, c = accepted[i], nums[i], k if caps is None else caps[i]
        past = start[i] + m + 1
        after.append(past)
        last.append(row[m])
        s.steps += 1
        if c:
            _count_drafts(stats, s, c, m, width)
        _take(s, row, m, past, rows, opts.eos_ids)
    st.past_len[:n] = after
    st.last[:n] = last
    return start


def _take(s: Sequence, row: list[int], m: int, past_len: int, rows: int, eos_ids: tuple[int, ...]) -> None:
    """Append sequence s's accepted tokens row[:m + 1] (as many as max_new_tokens leaves room for) and apply the stop
    conditions: an EOS token, max_new_tokens, the cache's `rows` (past_len: the sequence's after this step)."""
    room = s.max_new_tokens - s.num_generated
    for t in row[:min(m + 1, room)]:
        s.tokens.append(t)
        if t in eos_ids:
            s.finish_reason = "stop"
            break
    if s.finish_reason is None and s.num_generated >= s.max_new_tokens:
        s.finish_reason = "length"
    if s.finish_reason is None and past_len + 2 > rows:  # as plain decoding: the next token would not fit
        s.finish_reason, s.message = "length", f"KV cache full ({rows} rows per sequence)"


def _count_drafts(stats: Stats, s: Sequence, k: int, m: int, width: int) -> None:
    """The decode's and sequence s's figures after a verify step of s with k > 0 drafts, m accepted (width: the
    most drafts a step has): the drafts at positions 0..k-1, those tried (all before them accepted), the accepted
    ones."""
    stats.num_drafts += 1
    stats.draft_tokens += k
    for j in range(k):
        stats.num_drafts_per_pos[j] += 1
        if j <= m:
            stats.num_tried_per_pos[j] += 1
        if j < m:
            stats.num_accepted_tokens_per_pos[j] += 1
    if len(s.accepted_per_pos) < width:
        s.accepted_per_pos += [0] * (width - len(s.accepted_per_pos))
        s.drafts_per_pos += [0] * (width - len(s.drafts_per_pos))
        s.accepted_hist += [0] * (width + 1 - len(s.accepted_hist))
    s.accepted_hist[m] += 1
    s.num_drafts += 1
    s.num_draft_tokens += k
    for j in range(k):
        s.drafts_per_pos[j] += 1
    for j in range(m):
        s.accepted_per_pos[j] += 1
    if s.acceptance is not None:
        observe_acceptance(s.acceptance, k, m, s.steps)


def _swap(backend: Backend, st: State, i: int, j: int, *extra: np.ndarray) -> None:
    """Exchange slots i and j: their cache rows and every per-slot array (and `extra` ones)."""
    if i == j:
        return
    backend.swap_slots(i, j)
    for arr in (st.order, st.past_len, st.last, st.thinking, st.drafts, st.mtp_past_len, st.q_dist, st.carry,
                st.tree_tokens, st.tree_parents, st.avail, *extra):
        if arr is not None:
            arr[[i, j]] = arr[[j, i]]


def retire(backend: Backend, st: State, seqs, *extra: np.ndarray) -> None:
    """Move finished sequences behind the active ones (swapping one slot's cache rows per finish, none for those
    already last); `extra` per-slot arrays of this step (hidden states, start rows) are permuted alike."""
    if all(seqs[o].finish_reason is None for o in st.order[:st.n].tolist()):
        return
    done = lambda i: seqs[int(st.order[i])].finish_reason is not None  # noqa: E731
    i = 0
    while i < st.n:
        while st.n > i and done(st.n - 1):
            st.n -= 1
        if i < st.n and done(i):
            _swap(backend, st, i, st.n - 1, *extra)
            st.n -= 1
        i += 1


# --------------------------------------------------------------------------------- continuous batching
FORGET_EVERY = 8  # auto_k: steps the K chosen for unchanged sequences at K = 0 stands (what was learnt fades)
EXPLORE_FIRST = 16  # steps before a decode's first exploration (two steps at another K: auto_k)
EXPLORE_EVERY = 256  # the most steps between two (the interval doubles after each)


@dataclasses.dataclass
class Join:
    """Sequences being prefilled, chunk by chunk, in the free slots first .. first+m-1 (behind the active ones)."""

    ids: list[int]  # their sequence ids
    first: int  # their first slot
    done: np.ndarray  # [m] prompt tokens already in the cache
    hidden: list[list[np.ndarray]]  # per sequence, the target's hidden states of its prompt, chunk by chunk
    last: np.ndarray  # [m] the first generated token (valid once its prompt is done)


@dataclasses.dataclass
class Batch:
    """A running decode: up to `capacity` sequences in the backend's slots, new ones joining between steps
    (their prompts prefilled in chunks, so that the running ones wait at most one chunk), finished and
    cancelled ones leaving (gpt-fast's generate.py style: functions over this explicit state)."""

    st: State
    seqs: dict  # sequence id -> Sequence: the active ones and those joining
    stats: Stats
    opts: DecodeOptions
    rows: int  # cache rows per sequence
    joining: Join | None = None
    k: int = 0  # drafts joining sequences get (opts.nextn unless adaptive: the K of the last step)
    cost: CostModel = dataclasses.field(default_factory=CostModel)  # measured step seconds (adaptive)
    policy: Callable | None = None  # policy(batch) -> K wanted for the next step (adaptive; default auto_k)
    explore: int = EXPLORE_FIRST  # auto_k: steps until the next exploring steps
    explore_gap: int = EXPLORE_FIRST  # auto_k: the steps between the last two explorations
    held: int | None = None  # auto_k: the K it chose last (explorations aside)
    explored: int = 0  # auto_k: the K those steps ran last
    explored_turn: int = 0  # auto_k: explorations so far (below and above the current K in turn)
    chosen_for: tuple | None = None  # auto_k: what `held` was chosen from (the slots' sequences, drafts verified)
    chain_limits: tuple[int, int] | None = None  # plain_step: (the most past_len, the least)

    @property
    def capacity(self) -> int:
        return len(self.st.order)

    @property
    def free(self) -> int:
        """Slots a new sequence may join now."""
        return 0 if self.joining else self.capacity - self.st.n


def open_batch(backend: Backend, opts: DecodeOptions, capacity: int, rows: int, mixed: bool = False) -> Batch:
    """Load the graphs, allocate `capacity` slots of `rows` cache rows, no sequence yet.  `mixed`: sequences
    bring their own sampling (a server), so both the greedy graphs (the fused step) and what sampling reads
    (the logits) are prepared, whatever opts.sampling says."""
    for k in range(opts.nextn + 1) if opts.adaptive else [opts.nextn]:
        backend.prepare(k, opts.sampling.greedy or mixed, opts.tree_graph)
    if mixed:
        backend.prepare(opts.nextn, False, opts.tree_graph)
    backend.allocate(capacity, rows)
    k = opts.nextn
    depths = 1 if backend.manifest.mtp_mode == "eagle" else max(k, 1)
    zeros = lambda *shape: np.zeros((capacity, *shape), np.int32)  # noqa: E731
    st = State(order=np.full(capacity, -1, np.int64), n=0, past_len=zeros(), last=zeros(), thinking=zeros(),
               drafts=zeros(k), q_dist=None, mtp_past_len=zeros(depths), carry=None)
    if opts.tree_graph:
        st.tree_tokens, st.tree_parents = zeros(opts.tree.budget), zeros(opts.tree.budget)
    stats = Stats(num_accepted_tokens_per_pos=[0] * k)
    st.avail = np.full(capacity, k, np.int64)
    return Batch(st, {}, stats, opts, rows, k=k)


def admit(batch: Batch, new: dict) -> None:
    """Start prefilling `new` (sequence id -> Sequence, at most batch.free) into the free slots; prefill_chunk
    runs their prompts and makes them active."""
    st = batch.st
    if not new or len(new) > batch.free:
        raise ValueError(f"admit: {len(new)} sequences for {batch.free} free slots")
    for s in new.values():
        s.tokens = list(s.prompt)
        if batch.opts.adaptive and s.acceptance is None:
            s.acceptance = Acceptance.empty(batch.opts.nextn)
    batch.seqs.update(new)
    m = len(new)
    st.order[st.n:st.n + m] = list(new)
    batch.joining = Join(list(new), st.n, np.zeros(m, np.int64), [[] for _ in range(m)], np.zeros(m, np.int32))


def prefill_chunk(backend: Backend, batch: Batch, chunk: int | None = None) -> bool:
    """Run the next `chunk` prompt tokens (None: all) of every joining sequence through the target; when every
    prompt is done, pick the first tokens, fill the MTP caches, draft, and make the sequences active.  The
    joining slots are swapped to the front for the call (the backend runs slots 0..m-1) and back.  Returns
    whether they joined."""
    st, opts, j = batch.st, batch.opts, batch.joining
    seqs = [batch.seqs[i] for i in j.ids]
    m, n = len(seqs), st.n
    lens = np.array([len(s.prompt) for s in seqs])
    width = int((lens - j.done).max()) if chunk is None else min(chunk, int((lens - j.done).max()))
    ids = np.zeros((m, width), np.int32)
    for i, s in enumerate(seqs):
        part = s.prompt[j.done[i]: j.done[i] + width]
        ids[i, :len(part)] = part
    thinking = np.array([thinking_after(s.prompt, 0, opts.think_ids) for s in seqs], np.int32)
    ends = (j.done < lens) & (j.done + width >= lens)  # prompts that end in this chunk
    logits = _samples([s for s, e in zip(seqs, ends) if e])
    for i in range(m):
        _swap(backend, st, i, j.first + i)
    st.n = m
    out = backend.target(m, ids, np.minimum(j.done, lens).astype(np.int32), thinking, 0, 0.0, logits=logits)
    for i, s in enumerate(seqs):
        take = min(width, lens[i] - j.done[i])
        if take > 0:
            j.hidden[i].append(out[C.HIDDEN_STATES][i, :take])
        if ends[i]:
            row = {key: out[key][i:i + 1] for key in (C.TARGET_TOKENS, C.LOGITS) if key in out}
            j.last[i] = _pick(row, C.LOGITS, C.TARGET_TOKENS, np.array([take - 1]), [s])[0][0]
    j.done = np.minimum(j.done + width, lens)
    joined = bool((j.done == lens).all())
    if joined:
        _start(backend, batch, seqs, lens, thinking, n)
    for i in reversed(range(m)):
        _swap(backend, st, i, j.first + i)
    st.n = n
    if joined:
        for i in range(m):  # behind the active ones (which may have shrunk meanwhile)
            _swap(backend, st, st.n + i, j.first + i)
        st.n += m
        batch.joining = None
        retire(backend, st, batch.seqs)
    return joined


def _start(backend: Backend, batch: Batch, seqs: list[Sequence], lens: np.ndarray, thinking: np.ndarray,
           active: int = 0) -> None:
    """The joining sequences (in slots 0..m-1, st.n = m) with their prompts done: the first token, the state,
    the first drafts, the first stop conditions.  `active`: the sequences decoding beside them (adaptive
    speculation drafts the K the policy would choose for all of them together)."""
    st, opts, j = batch.st, batch.opts, batch.joining
    m = len(seqs)
    st.past_len[:m], st.last[:m], st.mtp_past_len[:m] = lens, j.last, 0
    st.thinking[:m] = [thinking_after([t], f, opts.think_ids) for t, f in zip(j.last.tolist(), thinking)]
    for s, t in zip(seqs, j.last.tolist()):
        s.tokens.append(t)
    if opts.nextn:
        hidden = np.zeros((m, lens.max(), j.hidden[0][0].shape[-1]), j.hidden[0][0].dtype)
        for i, parts in enumerate(j.hidden):
            hidden[i, :lens[i]] = np.concatenate(parts)
        # a sequence that keeps every draft (Sequence.keeps_k) gets them from its first step
        k = opts.nextn if any(s.keeps_k for s in seqs) else join_k(batch, m + active) if opts.adaptive else batch.k
        k = min(k, drafts_room(backend, int(lens.max()), batch.rows))  # (a prompt that nearly fills the cache)
        draft(backend, st, batch.seqs, hidden, np.zeros(m, np.int32), opts, k)
        st.avail[:m] = k
        if opts.tree_graph:  # the chain's drafts are the first tree step's tree
            st.tree_tokens[:m], st.tree_parents[:m] = chain_tree(st.drafts[:m], opts.tree.budget)
    for s in seqs:
        if s.finish_reason is not None:  # cancelled while joining
            continue
        if s.tokens[-1] in opts.eos_ids:
            s.finish_reason = "stop"
        elif s.max_new_tokens <= 1:
            s.finish_reason = "length"
        elif len(s.tokens) >= batch.rows:  # as accept: past_len (the prompt) + 2 > rows
            s.finish_reason, s.message = "length", f"KV cache full ({batch.rows} rows per sequence)"


def auto_k(batch: Batch) -> int:
    """The K (0..nextn) of the next step that maximizes expected tokens per second (mtp_trt/speculation.py): each
    active sequence's decayed acceptance per position (a new one: the batch's so far), the measured step costs."""
    st, stats, nextn = batch.st, batch.stats, batch.opts.nextn
    active = _active(st, batch.seqs)
    if any(s.keeps_k for s in active):
        return nextn
    batch.explore -= 1
    key = (st.order[:st.n].tobytes(), stats.num_drafts, stats.steps // FORGET_EVERY)
    if batch.explore >= 0 and key == batch.chosen_for:  # the same sequences, no draft verified since (a batch at
        return batch.held  # K = 0), but for the load (every K shares it) and a few steps of fading (remembered)
    counts = [remembered(s.acceptance, s.steps) for s in active]
    history = Acceptance(np.array([c[0] for c in counts]), np.array([c[1] for c in counts]))
    rates = acceptance_rates(history, chain_prior(stats))  # [n, nextn] at once
    # the K the policy chose last stays unless another beats it by a margin (not the K an exploration left)
    current = int(st.avail[:st.n].min()) if batch.held is None else batch.held
    if batch.explore == -1:  # now and then two steps at a neighbouring K, one below and one above the current K in
        # turn (the first step may draft them, the second is timed): what it costs (and, going up, what one more
        # draft accepts) is learnt again, at the price of a step or two of a K near the best; the policy then climbs
        # one K at a time where that pays.  A K that could not be better is not tried: above, one that could not
        # pay even with every draft accepted (a large batch, where drafts cost more than they can bring); below,
        # one the estimates put well below the current K (one sequence whose drafts are mostly accepted).
        near = [k for k in (current - 1, current + 1) if 0 <= k <= nextn and could_pay(rates, batch.cost, k, current)]
        if near:
            batch.explored = near[batch.explored_turn % len(near)]
            batch.explored_turn += 1
        else:
            batch.explore = -3
    if batch.explore < -2:  # the first soon, then ever rarer (EXPLORE_FIRST, twice that, ... up to EXPLORE_EVERY
        # steps apart): a K left on a few unlucky steps is retried early
        batch.explore_gap = min(2 * batch.explore_gap, EXPLORE_EVERY)
        batch.explore = batch.explore_gap
    elif batch.explore < 0:
        return batch.explored
    batch.held = choose_k(rates, batch.cost, nextn, current=current)
    batch.chosen_for = key
    return batch.held


def join_k(batch: Batch, rows: int) -> int:
    """The drafts sequences joining a batch of `rows` sequences (them included) get: the K auto_k would choose for
    `rows` sequences of the decode's acceptance so far, with its margins about the K it holds (no drafts made that
    the next step would not verify); batch.k under another policy, or before any cost is known."""
    if batch.policy is not None or not batch.cost.seconds:
        return batch.k
    prior = chain_prior(batch.stats)
    return choose_k(np.tile(prior, (rows, 1)), batch.cost, batch.opts.nextn, current=batch.held)


def chain_prior(stats: Stats, weight: float = PRIOR_WEIGHT) -> np.ndarray:
    """The acceptance per position a sequence is assumed to have before its own history: the decode's conditional
    rate a_j = accepted at j / tried at j (drafts that reached position j with 1..j-1 accepted), each pulled
    towards the rate of the position before it (PRIOR for the first) by `weight` pseudo-observations: a position
    never tried takes the previous one's rate, and a few rejections lower a position's rate without zeroing it."""
    rates = np.empty(len(stats.num_tried_per_pos))
    last = PRIOR
    for j, (a, t) in enumerate(zip(stats.num_accepted_tokens_per_pos, stats.num_tried_per_pos)):
        last = rates[j] = (a + weight * last) / (t + weight)
    return rates


def step(backend: Backend, batch: Batch, on_accept=None) -> None:
    """One decode step of the active sequences: cancelled ones leave first; verify, accept (`on_accept()` then
    may finish sequences, e.g. at a stop string), retire the finished ones, draft.  Fused into one graph call
    when every active sequence is greedy and the export has the step (or tree) graph.

    Adaptive speculation (opts.adaptive): K is chosen before the step (batch.policy, default auto_k).  Fewer drafts
    than the sequences hold: the step verifies the first K (a chain's first K drafts are what K drafts would be).
    More: this step verifies the K it has and drafts the K wanted (target and MTP graphs, unfused).  Fused steps are
    timed into batch.cost.

    Near the end of the cache (either policy) a step verifies at most the drafts whose tokens fit (fitting_drafts),
    down to none, so that sequences end where plain decoding does with its tokens; it runs unfused where the step
    graph's rows would not fit (fits_step), and still drafts (within the cache: drafts_room)."""
    st, seqs, opts = batch.st, batch.seqs, batch.opts
    active = _active(st, seqs)
    if any(s.finish_reason is not None for s in active):
        retire(backend, st, seqs)
        active = _active(st, seqs)
    if not st.n:
        return
    greedy = not _samples(active)
    past = st.past_len[:st.n].tolist()
    top = max(past)  # the longest sequence's cache rows
    if greedy and plain_step(backend, batch, past):
        fused_step(backend, st, seqs, batch.stats, opts, batch.rows, opts.nextn, active)
        st.avail[:st.n], batch.k = opts.nextn, opts.nextn
        if on_accept:
            on_accept()
        if any(s.finish_reason is not None for s in active):
            retire(backend, st, seqs)
        return
    k = k_next = opts.nextn
    caps = None
    fit = fitting_drafts(top, batch.rows, opts.nextn)
    if opts.adaptive:
        k_next = max(0, min(opts.nextn, int((batch.policy or auto_k)(batch))))
    chain = bool(opts.tree_graph) and not fits_tree(top, batch.rows, opts.tree)
    if opts.adaptive or fit < k or chain:
        if chain:  # the tree step does not fit the cache: a chain step verifies a path of the tree each holds
            caps = tree_path(st, fit)
        else:  # each sequence verifies the drafts it holds, at most K, at most what fits the cache
            caps = np.minimum(st.avail[:st.n], min(k_next, fit)).tolist()
        k = max(caps)
        caps = None if min(caps) == k else caps
    # vanilla's step and tree graphs need every depth's window to start at row >= 0 (past_len >= K - 1)
    early = backend.manifest.mtp_mode == "vanilla" and min(past) < opts.nextn - 1
    if (greedy and not early and k == k_next and caps is None and (opts.tree_graph or backend.has_step(k))
            and fits_step(backend, top, batch.rows, k, opts.tree_graph and opts.tree)):
        n, t0 = st.n, time.perf_counter()
        fused_step(backend, st, seqs, batch.stats, opts, batch.rows, k, active)
        if opts.adaptive:
            observe_cost(batch.cost, k, n, time.perf_counter() - t0)
        st.avail[:n], batch.k = k, k
        if on_accept:
            on_accept()
        if any(s.finish_reason is not None for s in active):
            retire(backend, st, seqs)
        return
    tokens, num, hidden = verify(backend, st, seqs, opts, k, caps)
    start = np.array(accept(st, seqs, tokens, num, batch.stats, opts, batch.rows, k, caps))
    st.avail[:st.n], batch.k = k_next, k_next
    if on_accept:
        on_accept()
    retire(backend, st, seqs, hidden, start)
    if k_next and st.n:
        k_next = min(k_next, drafts_room(backend, int(st.past_len[:st.n].max()), batch.rows))
        st.avail[:st.n] = k_next
        draft(backend, st, seqs, hidden[:st.n], start[:st.n], opts, k_next)
        if opts.tree_graph:  # the chain's drafts are the next tree step's tree
            st.tree_tokens[:st.n], st.tree_parents[:st.n] = chain_tree(st.drafts[:st.n], opts.tree.budget)


def chain_steps(backend: Backend, batch: Batch, on_accept=None) -> bool:
    """`step`'s plain fused steps (greedy sequences, no adaptive speculation, no tree: the step_K graph with K =
    nextn) back to back on the backend's bound call (Backend.bound_step), until a sequence finishes or the cache's end
    nears: each step writes the next one's inputs into the call's own arrays and keeps the lengths, tokens and
    figures in Python lists, the State and the figures brought up to date when the steps end.  The same tokens,
    drafts and figures as that many `step` calls, without their per-step bookkeeping, which after each graph run
    costs more than the work itself (the step's code is out of the caches by then).  `on_accept()` runs after each
    step's tokens, as in `step`.  Returns False, having run nothing, where `step` must run the next step (no bound
    call yet, a sequence that samples or has finished, another kind of step)."""
    st, seqs, opts, k, n = batch.st, batch.seqs, batch.opts, batch.opts.nextn, batch.st.n
    call = backend.bound_step(C.step_graph(k), n) if n else None
    if call is None:
        return False
    active, past = _active(st, seqs), st.past_len[:n].tolist()
    if _samples(active) or any(s.finish_reason is not None for s in active) or not plain_step(backend, batch, past):
        return False
    ids, out, carry = call.inputs[C.INPUT_IDS], call.result, C.CARRY in call.inputs
    topk, delta = relaxed_inputs(opts.relaxed_topk, opts.relaxed_delta)
    call.load({C.INPUT_IDS: st.ids[:n, :k + 1], C.PAST_LEN: st.past_len[:n], C.THINKING: st.thinking[:n],
               C.RELAXED_TOPK: topk, C.RELAXED_DELTA: delta} | ({C.CARRY: st.carry[:n, 1:]} if carry else {}))
    limit, rows, eos = batch.chain_limits[0], batch.rows, opts.eos_ids
    taken = []  # each step's accepted drafts per sequence
    while True:
        call.run(past)
        accepted, nums, last = out[C.ACCEPTED_TOKENS].tolist(), out[C.NUM_ACCEPTED].tolist(), []
        for i, s in enumerate(active):  # accept's lengths, tokens and stop conditions
            row, m = accepted[i], nums[i]
            past[i] += m + 1
            last.append(row[m])
            _take(s, row, m, past[i], rows, eos)
        taken.append(nums)
        if k:
            for s, p, d in zip(active, past, out[C.DRAFTS].tolist()):
                if s.finish_reason is None:
                    s.draft_log.append((p - 1, d))
        if on_accept:
            on_accept()
        done = any(s.finish_reason is not None for s in active)
        if done or max(past) > limit:
            break
        ids[:, 0] = last  # the next step's inputs
        if k:
            ids[:, 1:] = out[C.DRAFTS]
        call.inputs[C.PAST_LEN][...] = past
        call.inputs[C.THINKING][...] = out[C.THINKING_OUT]
        if carry:
            call.inputs[C.CARRY][...] = out[C.CARRY_OUT]
    st.past_len[:n], st.last[:n], st.thinking[:n] = past, last, out[C.THINKING_OUT]
    if k:
        st.drafts[:n, :k] = out[C.DRAFTS]
        st.mtp_past_len[:n] = [[p - j for j in range(st.mtp_past_len.shape[1])] for p in past]
    if carry:
        st.carry[:n, 1:] = out[C.CARRY_OUT]
    st.avail[:n], batch.k = k, k
    stats, width = batch.stats, len(batch.stats.num_accepted_tokens_per_pos)
    stats.steps += len(taken)
    stats.seq_steps += n * len(taken)
    stats.k_chosen += [k] * len(taken)
    stats.last_accepted = taken[-1]
    for nums in taken:
        for s, m in zip(active, nums):
            s.steps += 1
            if k:
                _count_drafts(stats, s, k, m, width)
    if done:
        retire(backend, st, seqs)
    return True


def plain_step(backend: Backend, batch: Batch, past_len: list[int]) -> bool:
    """Whether `step` runs the export's step_K graph with K = nextn for greedy sequences of these past_lens (no adaptive
    speculation, no tree; fitting_drafts and fits_step allow K; vanilla's windows start at row >= 0), decided from
    figures worked out once per batch (batch.chain_limits: the longest past_len allowed, -1 where that step never
    runs, and the shortest one's least)."""
    if batch.chain_limits is None:
        opts, k, rows = batch.opts, batch.opts.nextn, batch.rows
        eagle = backend.manifest.mtp_mode == "eagle"
        plain = not opts.adaptive and not opts.tree_graph and backend.has_step(k)
        limit = min(rows - 2 - k, rows - 2 * k if eagle else rows) if plain else -1
        batch.chain_limits = (limit, 0 if eagle else k - 1)
    return max(past_len) <= batch.chain_limits[0] and min(past_len) >= batch.chain_limits[1]


def fitting_drafts(past_len: int, rows: int, nextn: int) -> int:
    """The most drafts (0..nextn) a step may verify where the longest sequence holds `past_len` cache rows: K drafts
    and the bonus token must fit its `rows` tokens (past_len + K + 2 <= rows; a sequence ends at `rows` tokens, as
    in plain decoding), so that near the end of the cache the steps verify fewer drafts, down to plain steps, and
    give plain decoding's tokens."""
    return max(0, min(nextn, rows - 2 - past_len))


def drafts_room(backend: Backend, past_len: int, rows: int) -> int:
    """The most drafts the MTP graphs may draft within the `rows` cache rows where the longest sequence holds
    `past_len` rows (after accepting): eagle's depth d writes row past_len + d - 2; vanilla's depths write rows
    below past_len only."""
    return rows + 1 - past_len if backend.manifest.mtp_mode == "eagle" else 1 << 30


def tree_rows(tree: TreeShape) -> int:
    """The cache rows a tree step (exporters/tree.py, exporters/tree_vanilla.py) needs past a sequence's past_len:
    the tree's rows at past_len + node, its drafting's at past_len + the path + 1 .. (topk rows per level below
    depth 1), and its tokens' room (2 nextn + 2 for a chain's)."""
    return max(2 * tree.depth, tree.budget, tree.depth + 1 + tree.topk * (tree.depth - 1)) + 2


def fits_tree(past_len: int, rows: int, tree: TreeShape) -> bool:
    """Whether a tree step fits the cache at `past_len` rows (tree_rows)."""
    return past_len + tree_rows(tree) <= rows


def fits_step(backend: Backend, past_len: int, rows: int, k: int, tree: TreeShape | None) -> bool:
    """Whether the fused step (or tree) graph fits the cache at `past_len` rows: eagle's step drafts K more after
    accepting up to K (MTP rows up to past_len + 2K - 1); vanilla's writes no row past its verify rows."""
    if tree:
        return fits_tree(past_len, rows, tree)
    return backend.manifest.mtp_mode != "eagle" or past_len + 2 * k <= rows


def tree_path(st: State, fit: int) -> list[int]:
    """A tree decode's step that runs as a chain (the tree step does not fit the cache): st.drafts become a path
    of the tree each active sequence holds (from the root, each node's first child), at most `fit` drafts;
    returns each sequence's path length."""
    caps = []
    for i in range(st.n):
        tokens, parents = st.tree_tokens[i].tolist(), st.tree_parents[i].tolist()
        node, path = 0, []
        while len(path) < fit:
            child = next((j for j in range(node, len(tokens)) if parents[j] == node), None)
            if child is None:
                break
            path.append(tokens[child])
            node = child + 1
        st.drafts[i, :len(path)] = path
        caps.append(len(path))
    return caps


WARM = 3  # calibrate: steps of a K before the one timed


def calibrate(backend: Backend, batch: Batch, prompt: list[int], sizes: list[int], steps: int = 4) -> None:
    """Time greedy steps of each K (0..nextn) at each batch size in `sizes` (dummy sequences of `prompt`) into
    batch.cost, the fastest per (K, rows) of `steps` rounds; each round visits every K (so that a burst of load on
    the machine falls on all of them alike) with WARM + 1 steps, the last timed: the first may draft more, or be the
    first call of a shape, and the next ones find the caches holding another K's graph (a decode that keeps its K
    runs warm: timed after one such step, K = 3 of the demo came out 1.3-1.5x its cost in a steady decode, where
    K = 0 came out 1.1x).  The batch must be empty; it is left empty, its figures (and so the acceptance the
    policy assumes of new sequences) as they were."""
    opts, policy, model, stats = batch.opts, batch.policy, batch.cost, copy.deepcopy(batch.stats)
    want = [0]
    batch.policy = lambda b: want[0]  # noqa: E731
    batch.cost = CostModel()  # the steps run here are not observed twice
    try:
        for n in sorted(set(min(x, batch.capacity) for x in sizes)):
            seqs = {-1 - i: Sequence(list(prompt), max_new_tokens=1 << 30) for i in range(n)}
            admit(batch, seqs)
            while batch.joining:
                prefill_chunk(backend, batch)
            times: dict[int, list[float]] = {k: [] for k in range(opts.nextn + 1)}
            for _ in range(steps):
                for k in range(opts.nextn, -1, -1):
                    want[0] = k
                    for i in range(WARM + 1):
                        retire(backend, batch.st, batch.seqs)
                        rows, t0 = batch.st.n, time.perf_counter()
                        if rows:
                            step(backend, batch)
                        if i == WARM and rows == n:
                            times[k].append(time.perf_counter() - t0)
            for k, t in times.items():
                if t:  # the fastest: other work on the machine only ever slows a step
                    observe_cost(model, k, n, float(np.min(t)))
            for s in seqs.values():
                s.finish_reason = s.finish_reason or "cancelled"
            retire(backend, batch.st, batch.seqs)
            batch.seqs.clear()
    finally:
        batch.policy, batch.cost, batch.stats = policy, model, stats


def generate(backend: Backend, prompts: list[list[int]], opts: DecodeOptions, seed: int = 0,
             on_step=None, cost: CostModel | None = None,
             policy: Callable | None = None) -> tuple[list[Sequence], Stats]:
    """Decode a batch of prompts: all join at once, then steps until every one has finished.  Sequence i
    samples with sequence_rng(seed, i).  `on_step(seqs)` is called after the prompts' pass (their first tokens)
    and after every verify step (for streaming).
    Adaptive speculation: `cost` the measured step costs (calibrate), `policy` overrides auto_k.  Each slot gets
    the rows of its tokens and of a fused step (a tree's: tree_rows), as far as the export's max_seq_len allows."""
    seqs = [Sequence(prompt=list(p), sampling=opts.sampling, max_new_tokens=opts.max_new_tokens,
                     rng=sequence_rng(seed, i)) for i, p in enumerate(prompts)]
    step_rows = max(2 * opts.nextn + 2, tree_rows(opts.tree) if opts.tree_graph else 0)
    rows = min(backend.manifest.max_seq_len, max(len(p) for p in prompts) + opts.max_new_tokens + step_rows)
    batch = open_batch(backend, opts, len(seqs), rows)
    batch.cost, batch.policy = cost or batch.cost, policy
    admit(batch, dict(enumerate(seqs)))
    prefill_chunk(backend, batch)
    if on_step:
        on_step(seqs)
    while batch.st.n:
        on_accept = (lambda: on_step(seqs)) if on_step else None
        if not chain_steps(backend, batch, on_accept):
            step(backend, batch, on_accept)
    return seqs, batch.stats
