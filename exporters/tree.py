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
"""

from __future__ import annotations

import torch

from mtp_trt.exporters.graphs import _Graph, main_forward, mtp_block, row_at
from mtp_trt.exporters.lowering import flag_after
from mtp_trt.exporters.model import DeepseekV3

Tensor = torch.Tensor


def ancestors(parents: Tensor, depth: int) -> Tensor:
    """Ancestor-or-self matrix [B, S, S] (bool) of a tree with S = N + 1 nodes, node 0 the root, from
    parents [B, S] (the root's own entry 0), following at most `depth` parent links."""
    s = parents.shape[1]
    ids = torch.arange(s)
    cur = ids[None, :].expand_as(parents)
    seen = cur[..., None] == ids
    for _ in range(depth):
        cur = parents.gather(1, cur)
        seen = seen | (cur[..., None] == ids)
    return seen


def topological(parents: Tensor) -> Tensor:
    """parents [B, N] of nodes 1..N clamped to 0..i-1 for node i, with the root's entry 0 prepended -> [B, N + 1]
    int64 (a malformed tree stays a tree: drafting never makes one, but the verify step must not trust it)."""
    n = parents.shape[1]
    limit = torch.arange(n)[None, :]
    clamped = torch.minimum(parents.long().clamp(min=0), limit)
    return torch.cat([torch.zeros_like(clamped[:, :1]), clamped], 1)


def accept_tree(logits: Tensor, input_ids: Tensor, anc: Tensor, depth: Tensor, thinking: Tensor,
                relaxed_topk: Tensor, relaxed_delta: Tensor, think_ids: tuple[int, int], parents: Tensor):
    """The longest accepted root-to-node path of a verified tree.

    logits [B, S, V] at the S = N + 1 nodes, input_ids [B, S] (the root first), anc [B, S, S] (ancestors()),
    depth [B, S] (each node's ancestors but itself), parents [B, S].  Node i > 0 is ok if its token equals the argmax at its parent, or -- while the thinking
    flag after its strict ancestors' tokens (the root excluded: the previous step processed it) is on and
    relaxed_topk > 0 -- ranks among the parent's top relaxed_topk with p >= p(top-1) - relaxed_delta.  A node is
    accepted when it and all its ancestors are ok and the root is among them; the deepest accepted node wins
    (the lowest index among equals).
    -> (best [B]: the deepest accepted node, bonus [B, 1]: the target's argmax at best, thinking_out [B] int32:
    the flag after the path's tokens and the bonus)."""
    lg = logits.float()
    target = lg.argmax(-1).to(torch.int32)  # [B, S]
    at_parent = lg.gather(1, parents[..., None].expand_as(lg))  # each node's parent's logits [B, S, V]
    drafts = input_ids
    ok = drafts == target.gather(1, parents)
    # the thinking flag before each node: after its strict ancestors' tokens, the root excluded
    ids = torch.arange(anc.shape[1])
    strict = anc & (ids[:, None] != ids[None, :])[None] & (ids > 0)
    weight = torch.pow(2.0, depth.float())  # exact: depths are small
    starts = (strict.float() * ((drafts == think_ids[0]).float() * weight)[:, None, :]).sum(-1)
    ends = (strict.float() * ((drafts == think_ids[1]).float() * weight)[:, None, :]).sum(-1)
    seen = (starts + ends) > 0
    flag = (seen & (starts > ends)) | (~seen & (thinking[:, None] != 0))  # [B, S]
    l_d = at_parent.gather(-1, drafts.long()[..., None])  # [B, S, 1]
    vocab = torch.arange(lg.shape[-1], dtype=torch.int32)
    rank = ((at_parent > l_d) | ((at_parent == l_d) & (vocab < drafts[..., None]))).to(torch.int32).sum(-1)
    probs = at_parent.softmax(-1)
    p_d = probs.gather(-1, drafts.long()[..., None])[..., 0]
    ok = ok | ((rank < relaxed_topk) & (p_d >= probs.amax(-1) - relaxed_delta) & flag)
    ok = ok | (torch.arange(anc.shape[1]) == 0)[None]  # the root
    accepted = ~(anc & ~ok[:, None, :]).any(-1) & anc[..., 0]  # [B, S]
    best = torch.where(accepted, depth, torch.full_like(depth, -1)).argmax(-1)  # [B] (first maximum)
    bonus = target.gather(1, best[:, None])  # [B, 1]
    before = flag.gather(1, best[:, None])
    after_best = torch.where(best[:, None] == 0, (thinking[:, None] != 0).to(torch.int32),  # (no bool Where in ORT)
                             flag_after(before, drafts.gather(1, best[:, None]), *think_ids).to(torch.int32))
    thinking_out = flag_after(after_best != 0, bonus, *think_ids)[:, 0].to(torch.int32)
    return best, bonus, thinking_out


class TreeStepGraph(_Graph):
    """One greedy tree step in one call (see the module docstring): verify the tree, accept, commit the path's
    rows, draft the next tree.  Eagle mode (one MTP module), both lowerings.

    inputs : input_ids [B, N+1] int32 (the root `last`, then the nodes), tree_parents [B, N] int32, past_len [B],
             thinking [B], relaxed_topk [], relaxed_delta [], kv_0 .. kv_{L-1}, mtp_kv [B, T, Dl+Dr]
    outputs: accepted_tokens [B, D+1] (the path's drafts, the bonus, then -1), num_accepted [B], thinking_out [B],
             tree_tokens [B, N], tree_parents_out [B, N] (the next tree), then in the onnx lowering new_kv_0 ..
             new_kv_{L-1} [B, D+1, Dl+Dr] (the path's rows in order: the runtime commits them at past_len like a
             chain's) and mtp_new_kv [B, D+1, Dl+Dr] (MTP depth 1's rows over the path); in the plugin lowering
             kv_0_out .. kv_{L-1}_out and mtp_kv_out (aliased: the attention nodes wrote the tree's rows at
             past_len + node) and path_kv_0 .. path_kv_{L-1} [B, D+1, Dl+Dr] (the path's rows, for the runtime to
             commit at past_len: the graph's `commits`)."""

    few_tokens = True

    def __init__(self, model: DeepseekV3, depth: int, topk: int, budget: int, lowering: str,
                 think_ids: tuple[int, int]):
        super().__init__(model, lowering, think_ids)
        self.depth, self.topk, self.budget = depth, topk, budget

    def verify(self, input_ids, tree_parents, past_len, caches):
        """The main model over the tree -> (hidden [B, S, D], logits [B, S, V], commits, new rows, anc, depth,
        parents); the commits are each layer's S new rows (onnx) or its cache with them written at past_len + node
        (plugin)."""
        parents = topological(tree_parents)
        anc = ancestors(parents, self.depth)
        depth = anc.to(torch.int64).sum(-1) - 1
        b, s = input_ids.shape
        group = self.group(b, s, past_len, past_len, caches[0], new_visible=anc,
                           positions=past_len[:, None].long() + depth)
        new_rows: list[Tensor] = []
        h, logits, commits = main_forward(self.model, group, input_ids, caches, self.lowering, new_rows)
        return h, logits, commits, new_rows, anc, depth, parents

    def forward(self, input_ids, tree_parents, past_len, thinking, relaxed_topk, relaxed_delta, *caches):
        layers, d_max = len(self.model.model.layers), self.depth
        b = input_ids.shape[0]
        h, logits, commits, rows, anc, depth, parents = self.verify(input_ids, tree_parents, past_len,
                                                                    caches[:layers])
        best, bonus, thinking_out = accept_tree(logits, input_ids, anc, depth, thinking, relaxed_topk, relaxed_delta,
                                                self.think_ids, parents)
        num = depth.gather(1, best[:, None])[:, 0]  # [B] drafts accepted
        # the path: the ancestor of `best` at each depth 0..D (past the end: the root, rows never committed)
        on_path = anc.gather(1, best[:, None, None].expand(-1, 1, anc.shape[2]))[:, 0]  # [B, S]
        levels = torch.arange(d_max + 1)
        pick = on_path[:, None, :] & (depth[:, None, :] == levels[None, :, None])  # [B, D+1, S]
        path = (pick.long() * torch.arange(anc.shape[2])).sum(-1)  # [B, D+1]
        col = levels[None, :]
        later = torch.cat([input_ids.gather(1, path)[:, 1:], bonus], 1)  # the token after each path node
        accepted = torch.where(col < num[:, None], later,
                               torch.where(col == num[:, None], bonus, torch.full_like(bonus, -1)))
        width = rows[0].shape[-1]
        plugin = self.lowering == "plugin"
        path_rows = [r.gather(1, path[..., None].expand(-1, -1, width)) for r in rows]  # the runtime commits them
        h_path = h.gather(1, path[..., None].expand(-1, -1, h.shape[-1]))
        tokens, parents_out, mtp = self.draft(h_path, accepted.clamp(min=0), num, past_len, caches[layers], b)
        outs = (accepted, num.to(torch.int32), thinking_out, tokens, parents_out)
        return outs + ((*commits, mtp, *path_rows) if plugin else (*path_rows, mtp))

    def draft(self, h_path, tokens, num, past_len, cache, b):
        """MTP depth 1 over the path, then the tree (module docstring) -> (tree_tokens, tree_parents) [B, N] and
        the MTP cache's commit: depth 1's new rows [B, D+1, Dl+Dr] (onnx) or the cache (plugin).

        Each level's expansion runs, for each of the k frontier nodes, the rows of its whole path below the root
        (depth 1 .. d-1; S = k (d-1) rows, each path causal within itself and blind to the others) at positions
        past_len + num + 1 .., over the committed cache and depth 1's accepted rows: a node's row sees exactly
        its ancestors' rows, with no cache rows to track between levels (the plugin attention's mask covers the
        new rows only).  A path's earlier rows repeat the previous level's computation."""
        m, k, d_max, width = self.model, self.topk, self.depth, self.model.cfg.hidden_size
        plugin = self.lowering == "plugin"
        group1 = self.group(b, d_max + 1, past_len, past_len, cache)
        h1, commit1 = mtp_block(m, 0, h_path, tokens, group1, cache, self.lowering)
        h_row = row_at(h1, num.long(), width)  # [B, 1, D] at the bonus
        score, token = self.log_probs(h_row).topk(k, -1)  # [B, 1, k]
        scores, toks = [score[:, 0]], [token[:, 0]]
        parents = [torch.full((b, k), -1, dtype=torch.int64)]  # candidate index of each candidate's parent
        f_score, f_idx = score[:, 0], torch.arange(k)[None, :].expand(b, -1)  # the frontier [B, k]
        f_tok, f_hid = token[:, 0, :, None], h_row[:, None].expand(-1, k, -1, -1)  # its paths [B, k, L], [B, k, L, D]
        write = (past_len + num + 1).to(torch.int32)  # the first row after depth 1's accepted rows
        seen1 = torch.arange(d_max + 1)[None, :] <= num[:, None]  # depth 1's accepted rows [B, D+1] (onnx)
        mtp_cache, count = commit1 if plugin else cache, k
        for d in range(2, d_max + 1):
            length = d - 1
            row_path, row_e = torch.arange(k * length) // length, torch.arange(k * length) % length
            visible = (row_path[:, None] == row_path[None, :]) & (row_e[None, :] <= row_e[:, None])
            pos = write[:, None].long() + row_e[None, :]  # [B, k L]
            group = self.group(b, k * length, write, past_len, mtp_cache, None if plugin else (commit1, seen1),
                               visible[None].expand(b, -1, -1), pos)
            h_d, cache_d = mtp_block(m, 0, f_hid.reshape(b, k * length, width), f_tok.reshape(b, k * length), group,
                                     mtp_cache, self.lowering)
            h_last = h_d.reshape(b, k, length, width)[:, :, length - 1]  # each frontier node's own row [B, k, D]
            s, t = self.log_probs(h_last).topk(k, -1)  # [B, k, k]
            child_score = (f_score[..., None] + s).reshape(b, k * k)
            scores.append(child_score)
            toks.append(t.reshape(b, k * k))
            parents.append(f_idx[..., None].expand(-1, -1, k).reshape(b, k * k))
            if plugin:
                mtp_cache = cache_d
            if d == d_max:
                break
            f_score, sel = child_score.topk(k, -1)  # the next frontier [B, k] (indices into the children)
            row = sel // k  # the frontier node that made each

            def pick(x):
                return x.gather(1, row.view(b, k, *[1] * (x.dim() - 2)).expand(-1, -1, *x.shape[2:]))
            f_tok = torch.cat([pick(f_tok), toks[-1].gather(1, sel)[..., None]], 2)
            f_hid = torch.cat([pick(f_hid), pick(h_last[:, :, None])], 2)
            f_idx = count + sel
            count += k * k
        scores, toks, parents = torch.cat(scores, 1), torch.cat(toks, 1), torch.cat(parents, 1)
        chosen = scores.topk(self.budget, -1).indices.sort(-1).values  # [B, N], candidate order
        parent = parents.gather(1, chosen)  # candidate index or -1
        match = (parent[..., None] == chosen[:, None, :]).long()  # [B, N, N]
        node = torch.where(parent < 0, torch.zeros_like(parent), match.argmax(-1) + 1)
        return toks.gather(1, chosen).to(torch.int32), node.to(torch.int32), mtp_cache if plugin else commit1

    def log_probs(self, h: Tensor) -> Tensor:
        """The MTP module's log-probabilities [B, S, V] (fp32) from its output hidden states h [B, S, D]."""
        return self.model.lm_head(self.model.mtp[0].shared_head.norm(h)).float().log_softmax(-1)
