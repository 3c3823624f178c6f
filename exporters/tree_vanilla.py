"""Tree drafting in vanilla mode (one graph, both lowerings): verify the tree, accept its longest path and commit
it as the eagle tree does (exporters/tree.py), then draft the next tree with MTP modules 1..D, module k drafting
level k of the tree.

Rows, as VanillaStepGraph's: q = past_len + num_accepted (the row that predicted the bonus); module k's window
starts at start_k = past_len + 1 - k (its cache holds rows < start_k: mtp_past_len[k] = past_len + 1 - k), and module k
at row i takes module k-1's hidden at row i (module 0: the main model) and the token at position i + k.  Module k
runs once per step, over D + 1 window rows and (k >= 2) level k's expansion, in one block call:

* the window: rows start_k .. start_k + D, row j embedding the token at position past_len + 1 + j (the accepted
  path's, then the bonus; zeros past it) with module k-1's hidden at the same row: the carry for j = 0 (module
  k-1's hidden at row past_len - (k-1), kept from the previous step), then module k-1's window row j - 1 (module
  1: the main model's path rows).  Rows j <= num_accepted (up to q + 1 - k) hold only accepted tokens and are
  final: they are module k's commit, and row num_accepted's hidden is the next step's carry.  Later rows are
  padding: causal, seen by no other row, overwritten next step.
* level k's expansion: for each of the k' frontier nodes f (depth k-1: bonus, d_1 .. d_{k-1}; k' = top-k) the
  k - 1 rows of f's path that are speculative for module k: row q + 2 - k + i (i = 0 .. k-2) embeds d_{i+1} with
  module k-1's hidden at that row -- module k-1's window row num_accepted for i = 0, then the rows of module
  k-1's expansion of f's parent (the same path one token shorter).  A path's rows see module k's cache, its
  window rows 0 .. num_accepted and their own path causally (new_visible; the plugin's tree_mask) and sit at
  their true positions; f's last row (row q) gives f's children, the token at q + k + 1.

Level 1 is module 1's window row num_accepted (row q), as in the chain.  Ranking as the eagle tree: k' children
per frontier node, the k' likeliest children by summed log-probability the next frontier, the budget's N
likeliest candidates the next tree (in candidate order, so parents come first).
"""

from __future__ import annotations

import torch

from mtp_trt.exporters.graphs import mtp_block, row_at
from mtp_trt.exporters.ort_ops import cpu_norm
from mtp_trt.exporters.tree import TreeStepGraph, choose

Tensor = torch.Tensor


class VanillaTreeStepGraph(TreeStepGraph):
    """One greedy vanilla tree step in one call (see the module docstring): verify, accept and commit as
    TreeStepGraph, then draft the next tree with modules 1..D.

    Inputs and outputs: contract.tree_io (mtp_trt/contract.py), vanilla: module k's cache holds rows
    < past_len + 1 - k, carry (D > 1) module k's hidden at row past_len - k (k = 1..D-1), carry_out module k's
    window row num_accepted; the onnx lowering commits module k's window rows at past_len + 1 - k (the first
    num_accepted + 1 are final); the plugin lowering writes module k's window at past_len + 1 - k, its expansion
    after it."""

    def forward(self, input_ids, tree_parents, past_len, thinking, relaxed_topk, relaxed_delta, *rest):
        layers, d_max = len(self.model.model.layers), self.depth
        caches, mtp_caches = rest[:layers], rest[layers:layers + d_max]
        carry = rest[layers + d_max] if d_max > 1 else None
        h, logits, commits, rows, anc, _, _ = self.verify(input_ids, tree_parents, past_len, caches)
        a, accepted, path_rows, h_path = self.accept_path(logits, input_ids, anc, rows, h, thinking, relaxed_topk,
                                                          relaxed_delta)
        num = a.num.reshape(-1)  # [B] float
        tokens, parents_out, carry_out, mtp_commits = self.draft_vanilla(h_path, accepted.clamp(min=0), num.long(),
                                                                         past_len, mtp_caches, carry)
        outs = (accepted, num.to(torch.int32), a.thinking_out.reshape(-1), tokens, parents_out)
        outs += (carry_out,) if d_max > 1 else ()
        if self.lowering == "plugin":
            return outs + (*commits, *mtp_commits, *path_rows)
        return outs + (*path_rows, *mtp_commits)

    def draft_vanilla(self, h_path, tokens, num, past_len, mtp_caches, carry):
        """Modules 1..D over their windows and the tree's levels (module docstring).  h_path [B, D+1, H] (the main
        model's path rows), tokens [B, D+1] (positions past_len + 1 ..) -> (tree_tokens, tree_parents) [B, N],
        carry_out [B, D-1, H] (or None) and each module's commit: its window rows [B, D+1, Dl+Dr] (onnx) or its
        cache (plugin)."""
        m, k, d_max, width = self.model, self.topk, self.depth, self.model.cfg.hidden_size
        b, win = h_path.shape[0], d_max + 1
        plugin = self.lowering == "plugin"
        n = num.long()
        q = past_len.long() + n  # [B]: the bonus's row
        hidden, mtp_commits, carry_out = h_path, [], []
        scores = toks = f_score = f_tok = f_hid = None  # (set by level 1)
        fixed, sels, offsets, count = [-1] * k, [], [], k  # candidates' parents (choose) and their count
        for level in range(1, d_max + 1):
            cache, start = mtp_caches[level - 1], past_len + 1 - level  # start [B]: the window's first row
            if level == 1:
                group, x_hid, x_tok = self.group(b, win, start, start, cache), hidden, tokens
            else:  # the window (the carry, then module level-1's window rows 0 .. D-1), then the frontier's paths
                hidden = torch.cat([carry[:, level - 2:level - 1], hidden[:, :win - 1]], 1)
                visible, pos = self.layout(win, k, level - 1, start, q, n)
                group = self.group(b, visible.shape[1], start, start, cache, None, visible, pos)
                x_hid = torch.cat([hidden, f_hid.reshape(b, -1, width)], 1)
                x_tok = torch.cat([tokens, f_tok.reshape(b, -1).to(tokens.dtype)], 1)
            h_out, commit = mtp_block(m, level - 1, x_hid, x_tok, group, cache, self.lowering)
            h_win = h_out[:, :win]
            mtp_commits.append(commit if plugin else commit[:, :win])
            w_row = row_at(h_win, n, width)  # [B, 1, H]: the window's row num (row q + 1 - level)
            if level < d_max:
                carry_out.append(w_row)
            if level == 1:
                score, token = self.level_log_probs(0, w_row).topk(k, -1)  # [B, 1, k]
                scores, toks, f_score = [score[:, 0]], [token[:, 0]], score[:, 0]
                f_tok, f_hid = token[:, 0, :, None], w_row[:, None].expand(-1, k, -1, -1)  # [B, k, 1], [B, k, 1, H]
                hidden = h_win
                continue
            length = level - 1
            h_x = h_out[:, win:].reshape(b, k, length, width)  # each frontier path's rows
            s_c, t_c = self.level_log_probs(level - 1, h_x[:, :, length - 1]).topk(k, -1)  # [B, k, k]
            child_score = (f_score[..., None] + s_c).reshape(b, k * k)
            scores.append(child_score)
            toks.append(t_c.reshape(b, k * k))
            if level == 2:
                fixed += [i for i in range(k) for _ in range(k)]
            hidden = h_win
            if level == d_max:
                break
            f_score, sel = child_score.topk(k, -1)  # the next frontier [B, k] (indices into the children)
            row = sel // k  # the frontier node that made each

            def pick(x):
                return x.gather(1, row.view(b, k, *[1] * (x.dim() - 2)).expand(-1, -1, *x.shape[2:]))
            f_tok = torch.cat([pick(f_tok), toks[-1].gather(1, sel)[..., None]], 2)
            f_hid = torch.cat([w_row[:, None].expand(-1, k, -1, -1), pick(h_x)], 2)  # module `level`'s hidden rows
            sels.append(sel)
            offsets.append(count)
            count += k * k
        tree_tokens, tree_parents = choose(scores, toks, fixed, sels, offsets, k, self.budget)
        return tree_tokens, tree_parents, (torch.cat(carry_out, 1) if carry_out else None), mtp_commits

    @staticmethod
    def layout(win: int, paths: int, length: int, start: Tensor, q: Tensor, num: Tensor) -> tuple[Tensor, Tensor]:
        """Which rows each row of a module's call sees, and where the rows sit: `win` window rows (causal, at
        start + j), then `paths` paths of `length` rows (row i of a path at q + 1 - length + i, seeing the window's
        rows 0 .. num and its own path's rows 0 .. i).  start, q, num [B] -> visible [B, S, S] bool, positions
        [B, S] int64 (S = win + paths * length)."""
        b, rows = start.shape[0], paths * length
        wj, e = torch.arange(win), torch.arange(rows)
        own = (e[:, None] // length == e[None, :] // length) & (e[None, :] % length <= e[:, None] % length)
        top = torch.cat([wj[None, :] <= wj[:, None], torch.zeros(win, rows, dtype=torch.bool)], 1)  # [W, S]
        seen = (wj[None, :] <= num[:, None])[:, None, :].expand(-1, rows, -1)  # the window's accepted rows
        visible = torch.cat([top[None].expand(b, -1, -1), torch.cat([seen, own[None].expand(b, -1, -1)], 2)], 1)
        pos = torch.cat([start[:, None].long() + wj[None, :], q[:, None] + 1 - length + e[None, :] % length], 1)
        return visible, pos

    def level_log_probs(self, module: int, h: Tensor) -> Tensor:
        """MTP module `module`'s (0-based) log-probabilities [B, ..., V] (fp32) from its output hidden h."""
        norm = cpu_norm(self.model.mtp[module].shared_head.norm, h, self.cpu)
        return self.model.lm_head(norm).float().log_softmax(-1)
