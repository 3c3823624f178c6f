"""Tree drafting on the runtime side: tree shapes (depth D, top-k, budget N), their graph names, the first tree
of a decode, and a NumPy reference of tree acceptance (the graph's own is exporters/tree.py).

A tree of N draft nodes travels as tokens [N] and parents [N]: node i + 1's parent, 0 being the root (the
newest accepted token), always a lower index.  `--tree-topk 1` is the chain: the decode loop runs the chain's
step graphs for it.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from mtp_trt.config import MAX_NEXTN
from mtp_trt.contract import tree_dims, tree_graph
from mtp_trt.errors import MtpTrtError


@dataclasses.dataclass(frozen=True)
class TreeShape:
    depth: int  # D: levels below the root (the MTP module runs D times)
    topk: int  # k: children per expanded node, and nodes expanded per level
    budget: int  # N: draft nodes verified per step

    @property
    def graph(self) -> str:
        return tree_graph(self.depth, self.topk, self.budget)

    @property
    def spec(self) -> str:
        return f"{self.depth}:{self.topk}:{self.budget}"

    @property
    def candidates(self) -> int:
        """Nodes drafted before the budget picks: k at depth 1, k * k at each deeper level."""
        return self.topk + (self.depth - 1) * self.topk ** 2


def tree_spec(graph: str) -> str:
    """DEPTH:TOPK:BUDGET of tree graph `graph` (TreeShape.graph's inverse), as --trees takes it."""
    return "{}:{}:{}".format(*tree_dims(graph))


# The trees an export carries by default, in either mode (each one step graph), as DEPTH:TOPK:BUDGET; chosen by
# `mtp-trt bench` on the demo checkpoint (docs/benchmarks.md).
DEFAULT_TREES = (TreeShape(2, 2, 4), TreeShape(3, 2, 6), TreeShape(3, 3, 8))
# A tree step's attention and acceptance grow with the budget squared: bounded before any graph is traced.
MAX_TREE_TOPK, MAX_TREE_BUDGET, MAX_TREES = 16, 128, 16


def tree_shape(depth: int, topk: int, budget: int, what: str = "--tree-topk/--tree-budget") -> TreeShape:
    """A checked shape: one error naming the value that is out of range."""
    if depth < 1:
        raise MtpTrtError(f"{what}: tree drafting needs --nextn >= 1 (the tree's depth), got {depth}")
    if depth > MAX_NEXTN:
        raise MtpTrtError(f"{what}: the tree's depth (--nextn) must be at most {MAX_NEXTN}, got {depth}")
    if not 2 <= topk <= MAX_TREE_TOPK:
        raise MtpTrtError(f"{what}: the tree's top-k must be in 2..{MAX_TREE_TOPK} (top-k 1 is the chain), got {topk}")
    shape = TreeShape(depth, topk, budget)
    top = min(shape.candidates, MAX_TREE_BUDGET)
    if not 1 <= budget <= top:
        raise MtpTrtError(f"{what}: a tree of depth {depth} and top-k {topk} drafts {shape.candidates} candidates, "
                          f"and a step verifies at most {MAX_TREE_BUDGET} nodes; the budget must be in 1..{top}, "
                          f"got {budget}")
    return shape


def parse_trees(text: str) -> tuple[TreeShape, ...]:
    """'D:k:N,D:k:N' (the export's --trees; '' or 'none' for none) -> shapes."""
    if text.strip().lower() in ("", "none"):
        return ()
    shapes = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3 or not all(re.fullmatch(r"[0-9]{1,9}", p.strip()) for p in parts):
            raise MtpTrtError(f"--trees: expected DEPTH:TOPK:BUDGET items separated by commas (e.g. 3:2:6), "
                              f"got {item.strip()!r}")
        shapes.append(tree_shape(*(int(p) for p in parts), what=f"--trees {item.strip()}"))
    shapes = tuple(dict.fromkeys(shapes))
    if len(shapes) > MAX_TREES:
        raise MtpTrtError(f"--trees: {len(shapes)} trees, each a graph of the whole model; at most {MAX_TREES}")
    return shapes


def chain_tree(drafts: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """The first step's tree from chain drafts [B, K] (what prefill drafts): the chain as the first nodes, the
    rest of the budget filled with copies of the first draft under the root (never better than the chain, and
    harmless: any accepted node is a correct token).  -> tokens, parents [B, budget] int32."""
    b, k = drafts.shape
    tokens = np.repeat(drafts[:, :1], budget, 1).astype(np.int32)
    parents = np.zeros((b, budget), np.int32)
    m = min(k, budget)
    tokens[:, :m] = drafts[:, :m]
    parents[:, :m] = np.arange(m)
    return tokens, parents


def accept_tree_reference(target: np.ndarray, tokens: np.ndarray, parents: np.ndarray, depth: int
                          ) -> tuple[int, list[int]]:
    """Greedy tree acceptance for one sequence, by walking the tree: target [N+1] (argmax at each node, the root
    first), tokens / parents [N], paths of at most `depth` drafts.  -> (drafts accepted, the accepted path's node
    indices from the root); a child whose token equals its parent's target is followed, the deepest such path
    wins (the lowest node index among equals).  A parent out of range is clamped into 0..j for node j + 1."""
    n = len(tokens)
    children: dict[int, list[int]] = {i: [] for i in range(n + 1)}
    for j in range(n):
        children[min(max(int(parents[j]), 0), j)].append(j + 1)
    best: list[int] = [0]

    def walk(node: int, path: list[int]) -> None:
        nonlocal best
        if len(path) > len(best) or (len(path) == len(best) and path[-1] < best[-1]):
            best = list(path)
        for c in children[node] if len(path) <= depth else ():
            if tokens[c - 1] == target[node]:
                walk(c, path + [c])

    walk(0, [0])
    return len(best) - 1, best
