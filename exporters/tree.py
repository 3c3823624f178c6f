"""Tree drafting in one graph (eagle mode, both lowerings): verify a draft tree, accept its longest path, commit
that path's rows, and draft the next tree with the MTP module, EAGLE-2 style.

A tree of N drafts per sequence travels as two tensors: tokens [B, N] and parents [B, N], node i + 1's parent
(0 = the root, the newest accepted token `last`; node j's parent index < j).  The verify step feeds the root
and the nodes as one row of N + 1 tokens, each at position past_len + its depth and attending to the cache and
its ancestors (the tree mask).  Depths and ancestors are worked out here from the parents alone, so any
parents give a lossless step: a node is accepted only if every node on its path equals the target's argmax
at its parent (or passes relaxed acceptance while thinking), and a node not connected to the root within D
steps is never accepted.

Drafting (depth D, top-k, budget N): MTP depth 1 runs over the accepted path (true tokens, as in the chain)
and its row at the bonus gives the root's k children.  At each further depth the k most likely frontier
nodes -- ranked by the sum of draft log-probabilities along their path -- are expanded by the MTP module
(all k in one block call, each node's row seeing the committed cache, depth 1's accepted rows and its own
ancestors' rows: see TreeStepGraph.draft), giving k children each.  The N most likely of all candidates are
the next tree: each child scores at most its parent, and ties go to the lower candidate index (ONNX TopK),
which is the parent's, so the chosen nodes always include their parents.

Cost: every graph node is a kernel launch, and on small models the step is bound by their number, so the glue
is written as few nodes: the tree as small 0/1 float matrices (TreeMatrices) whose products give ancestors,
each node's parent's logits, the thinking flags and acceptance in one node each, one-hot products pick the
accepted path's rows, tokens and hidden states at once, and static sizes (S, V, D, k, N) are Python constants
(int() of a traced size), not shape computations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mtp_trt.exporters.graphs import _Graph, main_forward, mtp_block
from mtp_trt.exporters.model import DeepseekV3
from mtp_trt.exporters.ort_ops import cpu_norm

Tensor = torch.Tensor


def _clamped_parents(tree_parents: Tensor) -> Tensor:
    """tree_parents [B, N] of nodes 1..N -> [B, N + 1] (its dtype): node i's parent clamped to 0..i-1, the root's
    entry -1 (no parent).  Three nodes: a pad and two bounds against constant vectors."""
    n = int(tree_parents.shape[1])  # (static: a constant, not a traced size)
    lo = torch.tensor([-1] + [0] * n, dtype=tree_parents.dtype)
    hi = torch.tensor([-1] + list(range(n)), dtype=tree_parents.dtype)
    return torch.minimum(torch.maximum(F.pad(tree_parents, (1, 0), value=-1), lo), hi)


class TreeMatrices:
    """A tree of S nodes (node 0 the root) as small float matrices, computed once per step (each a few nodes):
    p0 [B, S, S] the parent one-hot (p0[i, j] = 1 iff j is i's parent; the root's row is zero), strict [B, S, S]
    the strict ancestors within `depth` parent links (p0 + p0^2 + ... + p0^depth: entries 0 or 1, each power
    a different ancestor), anc = strict + I, and depth_col [B, S, 1] each node's strict ancestors (its depth
    when it is connected to the root within `depth` links).  Matrix products on such 0/1 matrices are exact."""

    def __init__(self, p0: Tensor, depth: int):
        s = int(p0.shape[-1])
        eye = torch.eye(s)
        strict = p0
        for _ in range(depth - 1):  # Horner: p0 (I + p0 (I + ...))
            strict = torch.matmul(p0, strict + eye)
        self.p0, self.strict, self.anc = p0, strict, strict + eye
        self.depth_col = strict.sum(-1, keepdim=True)  # [B, S, 1]

    @classmethod
    def from_parents(cls, tree_parents: Tensor, depth: int) -> "TreeMatrices":
        """From tree_parents [B, N] (any values: clamped, see topological)."""
        pm = _clamped_parents(tree_parents)
        s = int(pm.shape[1])
        return cls((pm[..., None] == torch.arange(s, dtype=pm.dtype)).float(), depth)


def ancestors(parents: Tensor, depth: int) -> Tensor:
    """Ancestor-or-self matrix [B, S, S] (bool) of a tree with S = N + 1 nodes, node 0 the root, from
    parents [B, S] (the root's own entry 0), following at most `depth` parent links."""
    s = int(parents.shape[1])
    ids = torch.arange(s)
    p0 = ((parents[..., None] == ids) & (ids > 0)[:, None]).float()
    return TreeMatrices(p0, depth).anc > 0


def topological(parents: Tensor) -> Tensor:
    """parents [B, N] of nodes 1..N clamped to 0..i-1 for node i, with the root's entry 0 prepended -> [B, N + 1]
    int64 (a malformed tree stays a tree: drafting never makes one, but the verify step must not trust it)."""
    return _clamped_parents(parents).clamp(min=0).long()


def _tree_of(anc: Tensor, depth: Tensor, parents: Tensor) -> TreeMatrices:
    """The TreeMatrices behind verify's (anc, depth, parents): the ones verify made, else rebuilt from them."""
    t = getattr(anc, "_tree_matrices", None)
    if t is not None:
        return t
    s = int(parents.shape[1])
    ids = torch.arange(s)
    t = TreeMatrices.__new__(TreeMatrices)
    t.p0 = ((parents[..., None] == ids) & (ids > 0)[:, None]).float()
    t.anc = anc.float()
    t.strict = t.anc - torch.eye(s)
    t.depth_col = depth.float()[..., None]
    return t


def accept_tree(logits: Tensor, input_ids: Tensor, anc: Tensor, depth: Tensor, thinking: Tensor,
                relaxed_topk: Tensor, relaxed_delta: Tensor, think_ids: tuple[int, int], parents: Tensor):
    """The longest accepted root-to-node path of a verified tree.

    logits [B, S, V] at the S = N + 1 nodes, input_ids [B, S] (the root first), anc [B, S, S] (ancestors()),
    depth [B, S] (each node's ancestors but itself), parents [B, S].  Node i > 0 is ok if its token equals the
    argmax at its parent, or -- while the thinking flag after its strict ancestors' tokens (the root excluded:
    the previous step processed it) is on and relaxed_topk > 0 -- ranks among the parent's top relaxed_topk with
    p >= p(top-1) - relaxed_delta.  A node is accepted when it and all its ancestors are ok and the root is
    among them; the deepest accepted node wins (the lowest index among equals).
    -> (best [B]: the deepest accepted node, bonus [B, 1]: the target's argmax at best, thinking_out [B] int32:
    the flag after the path's tokens and the bonus)."""
    a = _accept(logits, input_ids, _tree_of(anc, depth, parents), thinking, relaxed_topk, relaxed_delta, think_ids)
    return a.best.reshape(-1), a.bonus.reshape(-1, 1).to(torch.int32), a.thinking_out.reshape(-1)


class _Accepted:
    """_accept's results, each [B, 1, 1]: best (int64), bonus (int64), num (float: best's depth),
    thinking_out (int32)."""

    def __init__(self, best, bonus, num, thinking_out):
        self.best, self.bonus, self.num, self.thinking_out = best, bonus, num, thinking_out


def _accept(logits: Tensor, input_ids: Tensor, t: TreeMatrices, thinking: Tensor, relaxed_topk: Tensor,
            relaxed_delta: Tensor, think_ids: tuple[int, int]) -> _Accepted:
    """accept_tree on the tree's matrices, every per-node quantity a column [B, S, 1]:
      - each node's parent's logits as one product p0 @ logits (the root's row is zero: it is never checked),
        and strict and relaxed acceptance as one comparison of the draft's rank there;
      - the thinking flag before node i from one product strict @ v, v_j = +-2^j at a <think> / </think> node j
        (0 elsewhere and at the root): node indices grow along a path, so the sign of the sum is the latest
        marker's (the powers of two dominate all lower ones), and the flag coming in (thinking) is added as 1,
        below every marker: flag = strict @ v + thinking > 0 (exact in float32 for S <= 24, float64 beyond);
      - acceptance from one product anc @ c, c_j = 0 for an ok node, 1 for a rejected one and -K at the root
        (K > S): a node is accepted iff its sum is exactly -K (connected to the root, no rejected ancestor)."""
    lg = logits.float()
    s, vocab = int(lg.shape[1]), int(lg.shape[2])  # static sizes: constants
    ft = torch.float32 if s <= 24 else torch.float64
    target = lg.argmax(-1, keepdim=True)  # [B, S, 1]
    at_parent = torch.matmul(t.p0, lg)  # [B, S, V]
    drafts = input_ids.long()[..., None]  # [B, S, 1]
    # the thinking flag before each node (strict ancestors, root excluded) and after it (itself included)
    start, end = think_ids
    w = 2.0 ** torch.arange(s, dtype=ft)
    w[0] = 0.0
    w = w[:, None]
    zero = torch.zeros((), dtype=ft)
    v = torch.where(drafts == start, w, torch.where(drafts == end, -w, zero))  # [B, S, 1]
    x = torch.matmul(t.strict.to(ft), v) + thinking.bool().to(ft).reshape(-1, 1, 1)
    before, after = x > 0, x + v  # after: > 0 where on
    # acceptance at the parent: the draft's rank there, ties to the lower token id (as accept_decomposed's relaxed
    # rank, per node); rank 0 is the argmax (its first maximum, as ArgMax's), so strict and relaxed acceptance are
    # one comparison: rank < relaxed_topk (at least 1) where relaxed acceptance applies, else rank < 1
    l_d = at_parent.gather(-1, drafts)
    ids = torch.arange(vocab)
    rank = ((at_parent > l_d) | ((at_parent == l_d) & (ids < drafts))).sum(-1, keepdim=True, dtype=torch.int32)
    probs = at_parent.softmax(-1)
    p_d = probs.gather(-1, drafts)
    relaxed = (p_d >= probs.amax(-1, keepdim=True) - relaxed_delta) & before
    ok = rank < torch.where(relaxed, torch.maximum(relaxed_topk, torch.ones((), dtype=relaxed_topk.dtype)), 1)
    big = float(s + 1)
    c = torch.where(ok, torch.tensor([-big] + [0.0] * (s - 1))[:, None],
                    torch.tensor([-big] + [1.0] * (s - 1))[:, None])  # the root: -K whatever ok says
    y = torch.matmul(t.anc, c)  # [B, S, 1]
    best = torch.where(y == -big, t.depth_col, -1.0).argmax(1, keepdim=True)  # [B, 1, 1] (first maximum)
    bonus = target.gather(1, best)
    flag = after.gather(1, best) > 0
    thinking_out = ((bonus == start) | (flag & (bonus != end))).to(torch.int32)
    return _Accepted(best, bonus, t.depth_col.gather(1, best), thinking_out)


def choose(scores: list[Tensor], toks: list[Tensor], fixed: list[int], sels: list[Tensor], offsets: list[int],
           k: int, budget: int) -> tuple[Tensor, Tensor]:
    """The next tree: the budget's likeliest of every level's candidates (scores, tokens [B, c] per level, numbered
    level by level) -> tree_tokens, tree_parents [B, N] int32, in candidate order (so parents come first).  Each
    candidate's parent candidate (or -1) is a constant up to depth 2 (`fixed`); deeper, the offset of the
    previous level's children (`offsets`, constants) plus the frontier node that made it (`sels` [B, k] per
    level: indices into those children)."""
    scores, toks = torch.cat(scores, 1), torch.cat(toks, 1)
    chosen = scores.topk(budget, -1).indices.topk(budget, -1, largest=False).values  # [B, N] sorted
    base = fixed + [offsets[i] for i in range(len(sels)) for _ in range(k * k)]
    parent = torch.tensor(base)[chosen]
    if sels:
        where = [0] * len(fixed) + [i * k + j // k for i in range(len(sels)) for j in range(k * k)]
        deep = parent + torch.cat(sels, 1).gather(1, torch.tensor(where)[chosen])
        parent = torch.where(chosen < len(fixed), parent, deep)
    # the parent is chosen too, and chosen is sorted: its node index is the number of chosen candidates <= it
    node = (chosen[:, None, :] <= parent[..., None]).sum(-1, dtype=torch.int32)
    return toks.gather(1, chosen).to(torch.int32), node


class TreeStepGraph(_Graph):
    """One greedy tree step in one call (see the module docstring): verify the tree, accept, commit the path's
    rows, draft the next tree.  Eagle mode (one MTP module), both lowerings.

    Inputs and outputs: contract.tree_io (mtp_trt/contract.py).  accepted_tokens holds the path's drafts, the
    bonus, then -1; tree_tokens and tree_parents_out the next tree.  The onnx lowering returns the path's rows in
    order (the runtime commits them at past_len like a chain's) and MTP depth 1's rows over the path; in the plugin
    lowering the attention nodes wrote the tree's rows at past_len + node, and path_kv_i (the graph's `commits`)
    are the path's rows, for the runtime to commit at past_len."""

    few_tokens = True

    def __init__(self, model: DeepseekV3, depth: int, topk: int, budget: int, lowering: str,
                 think_ids: tuple[int, int]):
        super().__init__(model, lowering, think_ids)
        self.depth, self.topk, self.budget = depth, topk, budget

    def verify(self, input_ids, tree_parents, past_len, caches):
        """The main model over the tree -> (hidden [B, S, D], logits [B, S, V], commits, new rows, anc, depth,
        parents); the commits are each layer's S new rows (onnx) or its cache with them written at past_len + node
        (plugin).  anc carries the tree's TreeMatrices (accept_tree reuses them)."""
        t = TreeMatrices.from_parents(tree_parents, self.depth)
        anc = t.anc > 0
        anc._tree_matrices = t
        depth = t.depth_col[..., 0].long()
        b, s = input_ids.shape[0], int(input_ids.shape[1])  # S static: constant masks and shapes
        group = self.group(b, s, past_len, past_len, caches[0], new_visible=anc,
                           positions=past_len[:, None].long() + depth)
        new_rows: list[Tensor] = []
        h, logits, commits = main_forward(self.model, group, input_ids, caches, self.lowering, new_rows)
        return h, logits, commits, new_rows, anc, depth, topological(tree_parents)

    def forward(self, input_ids, tree_parents, past_len, thinking, relaxed_topk, relaxed_delta, *caches):
        layers = len(self.model.model.layers)
        h, logits, commits, rows, anc, _, _ = self.verify(input_ids, tree_parents, past_len, caches[:layers])
        a, accepted, path_rows, h_path = self.accept_path(logits, input_ids, anc, rows, h, thinking, relaxed_topk,
                                                          relaxed_delta)
        tokens, parents_out, mtp = self.draft(h_path, accepted.clamp(min=0), a.num, past_len, caches[layers],
                                              input_ids.shape[0])
        outs = (accepted, a.num.reshape(-1).to(torch.int32), a.thinking_out.reshape(-1), tokens, parents_out)
        plugin = self.lowering == "plugin"
        return outs + ((*commits, mtp, *path_rows) if plugin else (*path_rows, mtp))

    def accept_path(self, logits, input_ids, anc, rows, h, thinking, relaxed_topk, relaxed_delta):
        """Acceptance on verify's outputs and the accepted path -> (_Accepted, accepted_tokens [B, D+1] int32: the
        path's drafts, the bonus, then -1; the path's rows [B, D+1, Dl+Dr] per layer; its hidden states
        [B, D+1, D]).  One-hot rows [B, D+1, S] pick best's ancestor at each depth 0..num (past num: the root,
        rows never committed), applied to every per-node tensor at once by one product."""
        layers, d_max, s = len(rows), self.depth, int(input_ids.shape[1])
        t: TreeMatrices = anc._tree_matrices
        a = _accept(logits, input_ids, t, thinking, relaxed_topk, relaxed_delta, self.think_ids)
        on_path = torch.matmul((torch.arange(s) == a.best).float(), t.anc)  # [B, 1, S]: best's ancestors
        levels = torch.arange(d_max + 1, dtype=torch.float32)[:, None]  # [D+1, 1]
        level = torch.where(levels <= a.num, levels, 0.0)  # [B, D+1, 1]
        pick = (t.depth_col.transpose(1, 2) == level).float() * on_path  # [B, D+1, S]
        width, dtype = int(rows[0].shape[-1]), h.dtype
        exact_ids = dtype == torch.float32  # token ids ride along in the product (exact below 2^24)
        ids_f = input_ids.float()[..., None]
        parts = [*rows, h] + ([ids_f] if exact_ids else [])
        picked = torch.matmul(pick.to(dtype), torch.cat(parts, -1)).split(
            [width] * layers + [int(h.shape[-1])] + ([1] if exact_ids else []), -1)
        tok = picked[-1] if exact_ids else torch.matmul(pick, ids_f)  # [B, D+1, 1] the path's tokens
        bonus = a.bonus.float()
        later = torch.cat([tok[:, 1:], bonus], 1)  # the token after each path node
        accepted = torch.where(levels < a.num, later, torch.where(levels == a.num, bonus, -1.0))
        return a, accepted.to(torch.int32)[..., 0], list(picked[:layers]), picked[layers]

    def draft(self, h_path, tokens, num, past_len, cache, b):
        """MTP depth 1 over the path, then the tree (module docstring) -> (tree_tokens, tree_parents) [B, N] and
        the MTP cache's commit: depth 1's new rows [B, D+1, Dl+Dr] (onnx) or the cache (plugin).  num [B, 1, 1]
        (float): the drafts accepted.

        Each level's expansion runs, for each of the k frontier nodes, the rows of its whole path below the root
        (depth 1 .. d-1; S = k (d-1) rows, each path causal within itself and blind to the others) at positions
        past_len + num + 1 .., over the committed cache and depth 1's accepted rows: a node's row sees exactly
        its ancestors' rows, with no cache rows to track between levels (the plugin attention's mask covers the
        new rows only).  A path's earlier rows repeat the previous level's computation.

        Candidates are numbered level by level (k at depth 1, k * k at each deeper one); each one's parent
        candidate is a constant up to depth 2 and the frontier's index deeper down."""
        m, k, d_max, width = self.model, self.topk, self.depth, self.model.cfg.hidden_size
        plugin = self.lowering == "plugin"
        group1 = self.group(b, d_max + 1, past_len, past_len, cache)
        h1, commit1 = mtp_block(m, 0, h_path, tokens, group1, cache, self.lowering)
        at_num = torch.arange(d_max + 1, dtype=torch.float32) == num  # [B, 1, D+1]
        h_row = torch.matmul(at_num.to(h1.dtype), h1)  # [B, 1, D] at the bonus
        score, token = self.log_probs(h_row).topk(k, -1)  # [B, 1, k]
        scores, toks = [score.reshape(-1, k)], [token.reshape(-1, k)]
        fixed = [-1] * k  # each candidate's parent candidate, while they are constants (depths 1 and 2)
        sels: list[Tensor] = []  # deeper: per level, the frontier that made its children [B, k] (indices into
        offsets: list[int] = []  # the previous level's children, which start at candidate offsets[i])
        f_score = score.reshape(-1, k)  # the frontier [B, k]
        # the frontier's paths: tokens [B, k, L] and hidden states [B, k, L*D] (rows flattened), L = d - 1
        f_tok, f_hid = token.reshape(-1, k, 1), h_row.expand(-1, k, -1)
        num_i = num.reshape(-1).to(torch.int32)
        write = past_len + num_i + 1  # the first row after depth 1's accepted rows
        seen1 = torch.arange(d_max + 1, dtype=torch.float32) <= num.reshape(-1, 1)  # depth 1's accepted rows (onnx)
        batch = (num >= 0)  # [B, 1, 1] all true: broadcasts a constant to the batch
        mtp_cache, count = commit1 if plugin else cache, k
        for d in range(2, d_max + 1):
            length = d - 1
            row_path, row_e = torch.arange(k * length) // length, torch.arange(k * length) % length
            visible = (row_path[:, None] == row_path[None, :]) & (row_e[None, :] <= row_e[:, None])
            pos = write[:, None].long() + row_e[None, :]  # [B, k L]
            group = self.group(b, k * length, write, past_len, mtp_cache, None if plugin else (commit1, seen1),
                               visible & batch, pos)
            rows_h = f_hid if length == 1 else f_hid.reshape(-1, k * length, width)
            rows_t = toks[0] if length == 1 else f_tok.reshape(-1, k * length)
            h_d, cache_d = mtp_block(m, 0, rows_h, rows_t, group, mtp_cache, self.lowering)
            h_last = h_d if length == 1 else h_d[:, length - 1::length]  # each frontier node's own row [B, k, D]
            s, t = self.log_probs(h_last).topk(k, -1)  # [B, k, k]
            child_score = (f_score[..., None] + s).reshape(-1, k * k)
            scores.append(child_score)
            toks.append(t.reshape(-1, k * k))
            if d == 2:
                fixed += [i for i in range(k) for _ in range(k)]
            if plugin:
                mtp_cache = cache_d
            if d == d_max:
                break
            f_score, sel = child_score.topk(k, -1)  # the next frontier [B, k] (indices into the children)
            row = (sel // k)[..., None]  # the frontier node that made each [B, k, 1]
            f_tok = torch.cat([f_tok.gather(1, row.expand(-1, -1, length)), toks[-1].gather(1, sel)[..., None]], 2)
            f_hid = torch.cat([f_hid, h_last], 2).gather(1, row.expand(-1, -1, (length + 1) * width))
            sels.append(sel)
            offsets.append(count)
            count += k * k
        return (*choose(scores, toks, fixed, sels, offsets, k, self.budget), mtp_cache if plugin else commit1)

    def log_probs(self, h: Tensor) -> Tensor:
        """The MTP module's log-probabilities [B, S, V] (fp32) from its output hidden states h [B, S, D]."""
        return self.model.lm_head(cpu_norm(self.model.mtp[0].shared_head.norm, h, self.cpu)).float().log_softmax(-1)
