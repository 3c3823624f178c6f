"""The MTP speculative decoding loop: prefill -> draft -> verify -> accept -> rewind, over explicit state.

Positions: the target cache holds rows 0..main_len-1 of each sequence; `last` is the newest accepted
token, not yet in the cache.  A verify step feeds [last, d_1..d_K] at positions main_len..main_len+K;
the target accepts n drafts and a bonus token, so the hidden state at row q = main_len + n predicted
the bonus, rows main_len..q are committed and the rest is rewound (main_len = q + 1: later steps
overwrite the rejected rows).  MTP row i takes (h_i, t_{i+1}) and predicts t_{i+2}.

  eagle   : one MTP module and cache.  Depth 1 runs rows main_len_old..q (true tokens) and drafts
            d_1 from row q; depth k > 1 runs one row at q + k - 1 on depth k-1's output hidden and
            d_{k-1} (those rows are speculative and overwritten next step).
  vanilla : module k at depth k, each with its own cache.  Depth k row i takes depth k-1's hidden at
            row i and t_{i+k}; rows up to q + 1 - k have true tokens and are committed, the rest use
            this step's drafts.  Each depth keeps the one hidden state of the previous depth that its
            next step needs (`carry`), TensorRT-LLM's "past tokens and hidden states".
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mtp_trt.backend import Backend
from mtp_trt.sampling import SamplingParams, probabilities, sample, speculative_accept
from mtp_trt.tree import TreeShape, chain_tree


@dataclasses.dataclass
class Sequence:
    """One request: its tokens (prompt + accepted) and result."""

    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)  # prompt + generated
    finish_reason: str | None = None
    message: str = ""
    steps: int = 0  # verify steps run for this sequence
    # (q, drafts) per step; a tree step logs (q, its tokens then its parents)
    draft_log: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]


@dataclasses.dataclass
class State:
    """Per-slot arrays; slot i holds sequence order[i]; slots 0..n-1 are the unfinished ones."""

    order: np.ndarray  # [B] sequence index of each slot
    n: int  # active slots
    main_len: np.ndarray  # [B] target cache rows
    last: np.ndarray  # [B] newest accepted token
    thinking: np.ndarray  # [B] thinking flag after `last`
    drafts: np.ndarray  # [B, K]
    q_dist: np.ndarray | None  # [B, K, V] drafter distributions (sampling only)
    mtp_len: np.ndarray  # [B, depths] committed rows of each MTP cache (eagle: 1 column)
    carry: np.ndarray | None  # [B, K, D] vanilla: depth k-1's hidden at row mtp_len[:, k-1]
    tree_tokens: np.ndarray | None = None  # [B, N] tree drafting: the next step's tree (mtp_trt/tree.py)
    tree_parents: np.ndarray | None = None  # [B, N]


@dataclasses.dataclass
class Stats:
    steps: int = 0  # batched verify steps
    seq_steps: int = 0  # sum over sequences of verify steps
    accepted_tokens: int = 0  # sum over sequence-steps of (drafts accepted + 1)
    proposed: np.ndarray | None = None  # [K] drafts proposed at each position
    accepted: np.ndarray | None = None  # [K] drafts accepted at each position

    @property
    def mean_accepted(self) -> float:
        """Mean tokens per verify step (accepted drafts + the bonus)."""
        return self.accepted_tokens / max(self.seq_steps, 1)

    @property
    def acceptance_rate(self) -> list[float]:
        return [float(a / p) if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    def __add__(self, other: Stats) -> Stats:
        """The figures of two decodes with the same nextn taken together."""
        return Stats(self.steps + other.steps, self.seq_steps + other.seq_steps,
                     self.accepted_tokens + other.accepted_tokens, self.proposed + other.proposed,
                     self.accepted + other.accepted)


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

    @property
    def tree_graph(self) -> str | None:
        """The tree graph this decode runs: `tree`'s when greedy with nextn > 0 (sampling drafts the chain)."""
        return self.tree.graph if self.tree is not None and self.sampling.greedy and self.nextn else None


def thinking_after(tokens, flag: int, think_ids: tuple[int, int]) -> int:
    """The thinking flag after `tokens`: on at <think>, off at </think>."""
    for t in tokens:
        flag = 1 if t == think_ids[0] else 0 if t == think_ids[1] else flag
    return flag


def _pick(out: dict, logits_key: str, tokens_key: str, rows: np.ndarray, opts: DecodeOptions, rng):
    """Token (and distribution, when sampling) at one row per sequence of a graph's output."""
    idx = np.arange(len(rows))
    if opts.sampling.greedy:
        return out[tokens_key][idx, rows], None
    p = probabilities(out[logits_key][idx, rows], opts.sampling)
    return sample(p, rng), p


# ------------------------------------------------------------------------------------------- steps
def prefill(backend: Backend, seqs: list[Sequence], opts: DecodeOptions, rng) -> tuple[State, np.ndarray]:
    """Run the prompts (right-padded) through the target; the first token; MTP caches filled; first drafts.
    Returns the state and each sequence's hidden states [B, L_max, D]."""
    b, k = len(seqs), opts.nextn
    lens = np.array([len(s.prompt) for s in seqs])
    ids = np.zeros((b, lens.max()), np.int32)
    for i, s in enumerate(seqs):
        ids[i, :lens[i]] = s.prompt
        s.tokens = list(s.prompt)
    thinking = np.array([thinking_after(s.prompt, 0, opts.think_ids) for s in seqs], np.int32)
    out = backend.target(b, ids, np.zeros(b, np.int32), thinking, 0, 0.0, logits=not opts.sampling.greedy)
    first, _ = _pick(out, "logits", "target_tokens", lens - 1, opts, rng)
    depths = 1 if backend.manifest.mtp_mode == "eagle" else max(k, 1)
    st = State(order=np.arange(b), n=b, main_len=lens.astype(np.int32), last=first.astype(np.int32),
               thinking=np.array([thinking_after([t], f, opts.think_ids) for t, f in zip(first, thinking)], np.int32),
               drafts=np.zeros((b, k), np.int32), q_dist=None, mtp_len=np.zeros((b, depths), np.int32),
               carry=None)
    for i, s in enumerate(seqs):
        s.tokens.append(int(first[i]))
    if k:
        draft(backend, st, seqs, out["hidden_states"], np.zeros(b, np.int32), opts, rng)
    return st, out["hidden_states"]


def draft(backend: Backend, st: State, seqs: list[Sequence], hidden: np.ndarray, start: np.ndarray,
          opts: DecodeOptions, rng) -> None:
    """Fill st.drafts (and st.q_dist) for the active slots.  `hidden` [n, S, D] is the target's output for
    rows start .. start+S-1; the last accepted position is q = main_len - 1 (main_len already advanced)."""
    n, k = st.n, opts.nextn
    q = st.main_len[:n] - 1
    mtp_graphs = backend.manifest.mtp_graphs
    qd = [] if not opts.sampling.greedy else None
    # Depth 1 (both modes): rows start..q, hidden h_i, tokens t_{i+1} (all accepted, true).
    rows = q - start + 1
    toks = np.zeros((n, rows.max()), np.int32)
    for i in range(n):
        seq = seqs[st.order[i]].tokens
        toks[i, :rows[i]] = seq[start[i] + 1: q[i] + 2]
    out = backend.mtp(0, mtp_graphs[0], n, hidden[:, :rows.max()], toks, start.astype(np.int32),
                      logits=not opts.sampling.greedy)
    d, p = _pick(out, "draft_logits", "draft_tokens", rows - 1, opts, rng)
    st.drafts[:n, 0] = d
    if qd is not None:
        qd.append(p)
    if backend.manifest.mtp_mode == "eagle":
        st.mtp_len[:n, 0] = q + 1
        h = out["hidden_out"][np.arange(n), rows - 1][:, None]
        for depth in range(2, k + 1):
            out = backend.mtp(0, mtp_graphs[0], n, h, st.drafts[:n, depth - 2, None],
                              (q + depth - 1).astype(np.int32), logits=not opts.sampling.greedy)
            d, p = _pick(out, "draft_logits", "draft_tokens", np.zeros(n, int), opts, rng)
            st.drafts[:n, depth - 1] = d
            h = out["hidden_out"]
            if qd is not None:
                qd.append(p)
    else:
        _draft_vanilla(backend, st, seqs, out, start, q, opts, rng, qd)
    if qd is not None:
        st.q_dist = np.stack(qd, 1)
    for i in range(n):
        seqs[st.order[i]].draft_log.append((int(q[i]), st.drafts[i].tolist()))


def _draft_vanilla(backend, st, seqs, out1, start1, q, opts, rng, qd) -> None:
    """Depths 2..K of vanilla mode (see the module docstring)."""
    n, k = st.n, opts.nextn
    if st.carry is None:
        st.carry = np.zeros((len(st.order), k, out1["hidden_out"].shape[-1]), out1["hidden_out"].dtype)
    st.mtp_len[:n, 0] = q + 1
    prev_out, prev_start = out1, start1  # depth d-1's outputs cover rows prev_start .. q
    for depth in range(2, k + 1):
        start = st.mtp_len[:n, depth - 1].copy()  # first uncommitted row of this depth
        rows = q - start + 1
        width = rows.max()
        hid = np.zeros((n, width, prev_out["hidden_out"].shape[-1]), prev_out["hidden_out"].dtype)
        toks = np.zeros((n, width), np.int32)
        for i in range(n):
            seq = seqs[st.order[i]].tokens
            for r in range(rows[i]):
                row = start[i] + r
                pos = row + depth  # the token this row embeds: t_{row + depth}
                toks[i, r] = seq[pos] if pos <= q[i] + 1 else st.drafts[i, pos - q[i] - 2]
                j = row - prev_start[i]
                hid[i, r] = prev_out["hidden_out"][i, j] if j >= 0 else st.carry[i, depth - 1]
        out = backend.mtp(depth - 1, backend.manifest.mtp_graphs[depth - 1], n, hid, toks,
                          start.astype(np.int32), logits=not opts.sampling.greedy)
        d, p = _pick(out, "draft_logits", "draft_tokens", rows - 1, opts, rng)
        st.drafts[:n, depth - 1] = d
        if qd is not None:
            qd.append(p)
        # Commit rows up to q + 1 - depth; keep depth d-1's hidden at the next step's first row.  A prompt
        # shorter than the depth commits nothing yet: the window starts at row 0 (there is no row before it).
        new_start = np.maximum(q + 2 - depth, 0)
        st.carry[np.arange(n), depth - 1] = prev_out["hidden_out"][np.arange(n), new_start - prev_start]
        st.mtp_len[:n, depth - 1] = new_start
        prev_out, prev_start = out, start


def verify(backend: Backend, st: State, opts: DecodeOptions, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run the target on [last, drafts] and accept.  Returns accepted tokens [n, K+1] (then -1), the number
    of drafts accepted [n], and the hidden states [n, K+1, D]."""
    n = st.n
    ids = np.concatenate([st.last[:n, None], st.drafts[:n]], 1).astype(np.int32)
    greedy = opts.sampling.greedy
    out = backend.target(n, ids, st.main_len[:n], st.thinking[:n], opts.relaxed_topk if greedy else 0,
                         opts.relaxed_delta, logits=not greedy)
    if greedy:
        tokens, num = out["accepted_tokens"], out["num_accepted"]
        st.thinking[:n] = out["thinking_out"]
    else:
        p = probabilities(out["logits"], opts.sampling)
        q = st.q_dist if st.q_dist is not None else np.zeros((n, 0, p.shape[-1]))
        tokens, num = speculative_accept(p, q[:n], st.drafts[:n], rng)
        st.thinking[:n] = [thinking_after(t[:m + 1], f, opts.think_ids) for t, m, f in zip(tokens, num, st.thinking[:n])]
    return tokens, num, out["hidden_states"]


def fused_step(backend: Backend, st: State, seqs: list[Sequence], stats: Stats, opts: DecodeOptions,
               rows: int) -> None:
    """Greedy: verify, accept and draft in one backend call: the export's `step_K` graph, or with
    opts.tree_graph its tree graph (verify the tree, accept its longest path, commit it, draft the next tree:
    exporters/tree.py, exporters/tree_vanilla.py).  Vanilla passes and keeps the carried hidden states of
    depths 1..K-1 (st.carry[:, 1:]); every MTP cache k then holds rows < main_len + 1 - k, as after the
    separate graphs."""
    n, k, tree = st.n, opts.nextn, opts.tree_graph
    ids = np.concatenate([st.last[:n, None], (st.tree_tokens if tree else st.drafts)[:n]], 1).astype(np.int32)
    carry = st.carry[:n, 1:] if st.carry is not None and k > 1 else None
    rest = (st.main_len[:n], st.thinking[:n], opts.relaxed_topk, opts.relaxed_delta, carry)
    out = backend.tree_step(tree, n, ids, st.tree_parents[:n], *rest) if tree else backend.step(n, ids, *rest)
    st.thinking[:n] = out["thinking_out"]
    accept(st, seqs, out["accepted_tokens"], out["num_accepted"], stats, opts, rows)
    if not k:
        return
    if tree:
        st.tree_tokens[:n], st.tree_parents[:n] = out["tree_tokens"], out["tree_parents_out"]
    else:
        st.drafts[:n] = out["drafts"]
        st.mtp_len[:n] = st.main_len[:n, None] + 1 - np.arange(1, st.mtp_len.shape[1] + 1)
    if "carry_out" in out:
        st.carry[:n, 1:] = out["carry_out"]
    for i in range(n):
        if seqs[st.order[i]].finish_reason is None:  # a tree step logs its tokens, then its parents
            drafts = st.tree_tokens[i].tolist() + st.tree_parents[i].tolist() if tree else st.drafts[i].tolist()
            seqs[st.order[i]].draft_log.append((int(st.main_len[i]) - 1, drafts))


def accept(st: State, seqs: list[Sequence], tokens: np.ndarray, num: np.ndarray, stats: Stats,
           opts: DecodeOptions, rows: int) -> np.ndarray:
    """Append the accepted tokens, advance (and so rewind) the lengths, apply the stop conditions.
    Returns the start rows of this step (the old main_len) for the MTP depth-1 update."""
    n = st.n
    start = st.main_len[:n].copy()
    st.main_len[:n] += num + 1
    st.last[:n] = tokens[np.arange(n), num]
    stats.steps += 1
    stats.seq_steps += n
    stats.accepted_tokens += int((num + 1).sum())
    stats.proposed += n
    stats.accepted += (num[:, None] > np.arange(opts.nextn)).sum(0)
    for i in range(n):
        s = seqs[st.order[i]]
        s.steps += 1
        new = tokens[i, :num[i] + 1].tolist()
        room = opts.max_new_tokens - len(s.generated)
        for j, t in enumerate(new[:room]):
            s.tokens.append(t)
            if t in opts.eos_ids:
                s.finish_reason = "stop"
                break
        if s.finish_reason is None and len(s.generated) >= opts.max_new_tokens:
            s.finish_reason = "length"
        if s.finish_reason is None and st.main_len[i] + 2 * opts.nextn + 2 > rows:
            s.finish_reason, s.message = "length", f"KV cache full ({rows} rows per sequence)"
    return start


def retire(backend: Backend, st: State, seqs: list[Sequence], *extra: np.ndarray) -> None:
    """Move finished sequences behind the active ones (swapping one slot's cache rows per finish); `extra`
    per-slot arrays of this step (hidden states, start rows) are permuted alike."""
    i = 0
    while i < st.n:
        if seqs[st.order[i]].finish_reason is None:
            i += 1
            continue
        j = st.n - 1
        if i != j:
            backend.swap_slots(i, j)
            for arr in (st.order, st.main_len, st.last, st.thinking, st.drafts, st.mtp_len, st.q_dist, st.carry,
                        st.tree_tokens, st.tree_parents, *extra):
                if arr is not None:
                    arr[[i, j]] = arr[[j, i]]
        st.n -= 1


def generate(backend: Backend, prompts: list[list[int]], opts: DecodeOptions, seed: int = 0,
             on_step=None) -> tuple[list[Sequence], Stats]:
    """Decode a batch of prompts.  `on_step(seqs)` is called after every verify step (for streaming)."""
    backend.prepare(opts.nextn, opts.sampling.greedy, opts.tree_graph)
    rng = np.random.default_rng(seed)
    seqs = [Sequence(prompt=list(p)) for p in prompts]
    rows = min(backend.manifest.max_seq_len,
               max(len(p) for p in prompts) + opts.max_new_tokens + 2 * opts.nextn + 2)
    backend.allocate(len(seqs), rows)
    stats = Stats(proposed=np.zeros(opts.nextn, np.int64), accepted=np.zeros(opts.nextn, np.int64))
    st, _ = prefill(backend, seqs, opts, rng)
    for s, first in zip(seqs, st.last):
        if first in opts.eos_ids:
            s.finish_reason = "stop"
        elif opts.max_new_tokens <= 1:
            s.finish_reason = "length"
        elif len(s.tokens) + 2 * opts.nextn + 2 > rows:
            s.finish_reason, s.message = "length", f"KV cache full ({rows} rows per sequence)"
    retire(backend, st, seqs)
    fused = opts.sampling.greedy and backend.has_step(opts.nextn)
    vanilla = backend.manifest.mtp_mode == "vanilla"
    if opts.tree_graph:
        st.tree_tokens, st.tree_parents = chain_tree(st.drafts, opts.tree.budget)
    while st.n:
        # vanilla's step and tree graphs need every depth's window to start at row >= 0 (main_len >= K - 1)
        early = vanilla and st.main_len[:st.n].min() < opts.nextn - 1
        if not early and (opts.tree_graph or fused):
            fused_step(backend, st, seqs, stats, opts, rows)
            if on_step:
                on_step(seqs)
            retire(backend, st, seqs)
            continue
        tokens, num, hidden = verify(backend, st, opts, rng)
        start = accept(st, seqs, tokens, num, stats, opts, rows)
        if on_step:
            on_step(seqs)
        retire(backend, st, seqs, hidden, start)
        if opts.nextn and st.n:
            draft(backend, st, seqs, hidden[:st.n], start[:st.n], opts, rng)
            if opts.tree_graph:  # the chain's drafts are the next tree step's tree
                st.tree_tokens, st.tree_parents = chain_tree(st.drafts, opts.tree.budget)
    return seqs, stats
