"""Tree drafting: greedy tree decoding equals plain greedy decoding (PyTorch reference, transformers)
for several trees, batches and random trees; the tree step's positions and mask match a cache-free PyTorch
recomputation of every node; acceptance (strict and relaxed) matches a reference walk over the tree; the
drafted trees equal a cache-free PyTorch recomputation of EAGLE-2's expansion; sampling runs the chain."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtp_trt.backend import OrtBackend
from mtp_trt.decode import DecodeOptions, generate
from mtp_trt.errors import MtpTrtError
from mtp_trt.exporters.export import export
from mtp_trt.exporters.generate import greedy_generate
from mtp_trt.exporters.loader import load_checkpoint
from mtp_trt.exporters.tree import TreeStepGraph
from mtp_trt.manifest import Manifest
from mtp_trt.sampling import SamplingParams
from mtp_trt.tree import TreeShape, accept_tree_reference, chain_tree, parse_trees, tree_shape, tree_spec
from runtime_models import EOS, THINK, make_self_drafting

K = 3
TREES = "3:2:6,3:3:12,2:3:5,1:2:2"
PROMPTS = [[5, 17, 33, 2, 8, 41, 7, 19], [60, 3], [11, 12, 13, 14, 15], [70, 71, 72, 9, 30, 31]]
NEW = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    ckpt = make_self_drafting(root / "ckpt", nextn=K)
    path = export(ckpt, root / "eagle", nextn=K, mtp_mode="eagle", max_seq_len=256, trees=TREES)
    model = load_checkpoint(ckpt)
    reference = [greedy_generate(model, p, NEW, eos_ids=(EOS,)) for p in PROMPTS]
    return model, OrtBackend(Manifest.load(path)), reference


def opts(tree: TreeShape | None, **kw) -> DecodeOptions:
    return DecodeOptions(nextn=tree.depth if tree else K, max_new_tokens=NEW, eos_ids=(EOS,), tree=tree, **kw)


def check_greedy_tree(be, prompts, reference, tree: TreeShape, options) -> None:
    """Tree decoding of `prompts` gives the reference's tokens, with part of each tree accepted, alone or in a
    batch (both modes' tests)."""
    seqs, stats = generate(be, prompts, options(tree))
    assert [s.generated for s in seqs] == reference
    assert 1.3 < stats.mean_acceptance_length <= tree.depth + 1, "trees must be partly accepted for this test to bite"
    alone, _ = generate(be, [prompts[1]], options(tree))  # the batch does not change a sequence's output
    assert alone[0].generated == reference[1]


def check_accepts_more(be, options) -> None:
    """A 3:3:12 tree accepts more tokens per step than the chain of depth 3 (both modes' tests)."""
    _, chain = generate(be, PROMPTS, options(None))
    _, tree = generate(be, PROMPTS, options(TreeShape(3, 3, 12)))
    assert tree.mean_acceptance_length > chain.mean_acceptance_length


@pytest.mark.parametrize("spec", TREES.split(","))
def test_greedy_tree_equals_plain_greedy(setup, spec):
    _, be, reference = setup
    check_greedy_tree(be, PROMPTS, reference, parse_trees(spec)[0], opts)


def test_trees_accept_more_than_the_chain(setup):
    check_accepts_more(setup[1], opts)


class RandomTrees:
    """Wraps a backend; every tree step verifies a random tree instead of the drafted one: random tokens and
    random parents, some out of range (the graph clamps them: a malformed tree must still be lossless)."""

    def __init__(self, inner, seed=0):
        self.inner, self.rng, self.manifest = inner, np.random.default_rng(seed), inner.manifest

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def tree_step(self, graph, n, input_ids, tree_parents, *args):
        ids = input_ids.copy()
        ids[:, 1:] = self.rng.integers(0, 90, ids[:, 1:].shape)
        parents = self.rng.integers(-2, tree_parents.shape[1] + 2, tree_parents.shape).astype(np.int32)
        return self.inner.tree_step(graph, n, ids, parents, *args)


def test_random_trees_are_lossless(setup):
    _, be, reference = setup
    seqs, stats = generate(RandomTrees(be), PROMPTS, opts(TreeShape(3, 3, 12)))
    assert [s.generated for s in seqs] == reference
    assert stats.mean_acceptance_length < 1.3, "random trees should be rejected on nearly every step"


class PlantedTrees(RandomTrees):
    """Random trees with the true continuation (`truth`: prompt + reference output of one sequence) planted as a
    branch of random depth 1..3 at random, increasing node indices: the verify graph must find it anywhere."""

    def __init__(self, inner, truth, seed=0):
        super().__init__(inner, seed)
        self.truth = truth

    def tree_step(self, graph, n, input_ids, tree_parents, past_len, *args):
        ids, budget, p = input_ids.copy(), tree_parents.shape[1], int(past_len[0])
        ids[0, 1:] = self.rng.integers(0, 90, budget)
        parents = np.array([[self.rng.integers(0, j + 1) for j in range(budget)]], np.int32)
        node = 0
        for pos in range(p + 1, min(len(self.truth), p + 1 + int(self.rng.integers(1, 4)))):
            if node >= budget:
                break
            child = int(self.rng.integers(node + 1, budget + 1))
            parents[0, child - 1], ids[0, child] = node, self.truth[pos]
            node = child
        return self.inner.tree_step(graph, n, ids, parents, past_len, *args)


def test_tree_step_finds_the_correct_path_anywhere(setup):
    """Decoding stays exact and accepts more than one token per step: the planted branch is found at whatever
    node indices it sits."""
    _, be, reference = setup
    seqs, stats = generate(PlantedTrees(be, PROMPTS[0] + reference[0]), PROMPTS[:1], opts(TreeShape(3, 3, 12)))
    assert seqs[0].generated == reference[0]
    assert stats.mean_acceptance_length > 1.5


# ------------------------------------------------------------------ the verify graph, node by node
def _verify_case(model, seed: int, thinking_tokens: bool = False):
    """A prompt in the cache (computed by the reference model), a random tree of 8 nodes per sequence (two
    sequences, different shapes) and the cache-free logits of every node: the reference model over the
    prompt + the node's path."""
    g = torch.Generator().manual_seed(seed)
    prompts = [[5, 17, 33, 2, 8, 41, 7], [60, 3, 9, 12, 70]]
    n, depth = 8, 3
    lens = torch.tensor([len(p) for p in prompts])
    t = 32
    caches = [torch.zeros(2, t, model.cfg.latent_dim) for _ in model.model.layers]
    for b, p in enumerate(prompts):
        with torch.no_grad():
            _, _, latents = model(torch.tensor([p[:-1]]))
        for c, lat in zip(caches, latents):
            c[b, :len(p) - 1] = lat[0]
    past_len = (lens - 1).to(torch.int32)  # the last prompt token is the root
    vocab = 90
    tokens = torch.randint(0, vocab, (2, n), generator=g)
    if thinking_tokens:
        tokens[0, 0], tokens[1, 2] = THINK[0], THINK[1]
    parents = torch.stack([torch.tensor([int(torch.randint(0, j + 1, (1,), generator=g)) for j in range(n)])
                           for _ in range(2)])
    ids = torch.cat([torch.tensor([[p[-1]] for p in prompts]), tokens], 1).to(torch.int32)
    expected = torch.zeros(2, n + 1, model.cfg.vocab_size)
    paths = []
    for b in range(2):
        rows = []
        for node in range(n + 1):
            path, j = [], node
            while j:
                path.append(j)
                j = int(parents[b, j - 1])
            rows.append(path[::-1])
            with torch.no_grad():
                logits, _, _ = model(torch.tensor([prompts[b] + [int(ids[b, i]) for i in path[::-1]]]))
            expected[b, node] = logits[0, -1]
        paths.append(rows)
    return ids, parents.to(torch.int32), past_len, caches, expected, paths, depth


def test_tree_positions_and_mask_match_cache_free_recomputation(setup):
    """Every node's logits from the tree step's verify (one call over the tree, depth-based positions, tree
    mask) equal the reference model run from scratch over the prompt and that node's path (1e-4)."""
    model = setup[0]
    graph = TreeStepGraph(model, 3, 2, 6, "onnx", THINK)
    ids, parents, past_len, caches, expected, paths, depth = _verify_case(model, 0)
    deep = [[len(p) <= depth for p in rows] for rows in paths]  # nodes within the graph's depth
    with torch.no_grad():
        _, logits, _, _, anc, _, _ = graph.verify(ids, parents, past_len, caches)
    for b in range(2):
        for node in range(ids.shape[1]):
            if deep[b][node]:
                torch.testing.assert_close(logits[b, node], expected[b, node], atol=1e-4, rtol=1e-4)


def _relaxed_reference(logits, ids, parents, depth, thinking, topk, delta):
    """Relaxed tree acceptance written out by walking the tree: node j follows node p when its token is the
    argmax at p, or -- while the flag after the path's tokens (the root excluded) is on -- among the top
    `topk` at p with p(token) >= p(top-1) - delta.  The deepest accepted node (lowest index among equals)."""
    n = ids.shape[0] - 1
    probs = torch.softmax(logits.double(), -1)
    best = (0, 0)

    def walk(node, d, flag):
        nonlocal best
        if (d, -node) > (best[0], -best[1]):
            best = (d, node)
        if d == depth:
            return
        for j in range(1, n + 1):
            if int(parents[j - 1]) != node:
                continue
            tok = int(ids[j])
            lg = logits[node]
            rank = int(((lg > lg[tok]) | ((lg == lg[tok]) & (torch.arange(len(lg)) < tok))).sum())
            ok = tok == int(lg.argmax()) or (flag and rank < topk and probs[node, tok] >= probs[node].max() - delta)
            if ok:
                walk(j, d + 1, True if tok == THINK[0] else False if tok == THINK[1] else flag)

    walk(0, 0, thinking)
    return best


@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.slow) for s in range(1, 4))])
@pytest.mark.parametrize("relaxed", [(0, 0.0), (4, 0.3), (90, 1.0)])
def test_tree_acceptance_matches_a_walk_over_the_tree(setup, seed, relaxed):
    """Acceptance in the graph (strict, and relaxed while thinking: <think>/</think> inside the tree switch it)
    against a reference walk over the cache-free logits; the bonus and the committed path follow."""
    model = setup[0]
    graph = TreeStepGraph(model, 3, 2, 6, "onnx", THINK)
    ids, parents, past_len, caches, expected, paths, depth = _verify_case(model, seed, thinking_tokens=True)
    for thinking in (0, 1):
        with torch.no_grad():
            out = graph(ids, parents, past_len, torch.full((2,), thinking, dtype=torch.int32),
                        torch.tensor(relaxed[0], dtype=torch.int32), torch.tensor(relaxed[1]), *caches,
                        torch.zeros(2, 32, model.cfg.latent_dim))
        accepted, num = out[0], out[1]
        for b in range(2):
            d, node = _relaxed_reference(expected[b], ids[b], parents[b], depth, bool(thinking), *relaxed)
            assert int(num[b]) == d
            path = paths[b][node]
            want = [int(ids[b, i]) for i in path] + [int(expected[b, node].argmax())]
            assert accepted[b, :d + 1].tolist() == want
            if relaxed[0] == 0:
                target = expected[b].argmax(-1).numpy()
                assert accept_tree_reference(target, ids[b, 1:].numpy(), parents[b].numpy(), depth) == (d, [0] + path)


def test_plugin_lowering_computes_the_same_step(setup):
    """The plugin lowering's tree step (tree mask into the attention node; expansions over the MTP cache it
    writes in place; the path's rows as outputs for the runtime to commit) computes what the onnx lowering's does:
    traced, each attention node runs its decomposed form, so the two modules are compared in PyTorch."""
    model = setup[0]
    ids, parents, past_len, caches, _, _, _ = _verify_case(model, 5)
    mtp = torch.randn(2, 32, model.cfg.latent_dim) * 0.1
    mtp[0, 6:], mtp[1, 4:] = 0.0, 0.0  # rows past past_len: never read before they are written
    args = (ids, parents, past_len, torch.zeros(2, dtype=torch.int32), torch.tensor(0, dtype=torch.int32),
            torch.tensor(0.0))
    layers = model.cfg.num_hidden_layers
    for shape in (TreeShape(3, 2, 6), TreeShape(3, 3, 8), TreeShape(2, 3, 5)):
        with torch.no_grad():
            onnx_out = TreeStepGraph(model, *vars(shape).values(), "onnx", THINK)(*args, *caches, mtp)
            plug_out = TreeStepGraph(model, *vars(shape).values(), "plugin", THINK)(*args, *caches, mtp)
        for a, b in zip(onnx_out[:5], plug_out[:5]):  # accepted, num, thinking, tree tokens, tree parents
            assert torch.equal(a, b)
        for a, b in zip(onnx_out[5:5 + layers], plug_out[6 + layers:]):  # the path's rows
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        num = plug_out[1]
        for b in range(2):  # the MTP cache: depth 1's accepted rows written in place = onnx's rows to commit
            p, n = int(past_len[b]), int(num[b]) + 1
            torch.testing.assert_close(plug_out[5 + layers][b, p:p + n], onnx_out[-1][b, :n], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ the drafted trees
def _reference_tree(model, tokens, q, shape: TreeShape):
    """EAGLE-2's expansion recomputed from scratch in PyTorch with no cache: the MTP module over the true rows
    0..q, then for a node, rows appended along its path (previous row's output hidden, the node's token);
    k children per expanded node, the k likeliest nodes of a level expanded, the N likeliest candidates kept
    (ties: the lower candidate index), in candidate order.  -> [(token, parent node)]."""
    with torch.no_grad():
        _, h, _ = model(torch.tensor([tokens[:q + 1]]))
        seq = torch.tensor([tokens[1:q + 2]])

        def expand(path):  # log-probs after the node with this path of draft tokens
            rows_h, rows_t = h[0], seq[0]
            logits, out_h, _ = model.mtp_forward(0, rows_h[None], rows_t[None])
            for tok in path:
                rows_h = torch.cat([rows_h, out_h[0, -1:]], 0)
                rows_t = torch.cat([rows_t, torch.tensor([tok])], 0)
                logits, out_h, _ = model.mtp_forward(0, rows_h[None], rows_t[None])
            return logits[0, -1].log_softmax(-1)

        return eagle2_reference(expand, shape)


def eagle2_reference(expand, shape: TreeShape) -> list[tuple[int, int]]:
    """EAGLE-2's expansion over `expand(path)` (a node's draft path -> its children's log-probs [V]): k children per
    expanded node, the k likeliest of a level's children expanded next, the N likeliest candidates kept (ties:
    the lower candidate index), in candidate order -> [(token, parent node)] (both modes' references)."""
    k = shape.topk
    cands = []  # (score, token, parent candidate index, path)
    s, t = expand([]).topk(k)
    frontier = []
    for i in range(k):
        cands.append((float(s[i]), int(t[i]), -1, [int(t[i])]))
        frontier.append(len(cands) - 1)
    for _ in range(2, shape.depth + 1):
        children = []
        for f in frontier:
            s, t = expand(cands[f][3]).topk(k)
            for i in range(k):
                cands.append((cands[f][0] + float(s[i]), int(t[i]), f, cands[f][3] + [int(t[i])]))
                children.append(len(cands) - 1)
        frontier = sorted(children, key=lambda c: (-cands[c][0], c))[:k]
    chosen = sorted(sorted(range(len(cands)), key=lambda c: (-cands[c][0], c))[:shape.budget])
    return [(cands[c][1], 0 if cands[c][2] < 0 else chosen.index(cands[c][2]) + 1) for c in chosen]


@pytest.mark.parametrize("spec", [pytest.param("3:2:6", marks=pytest.mark.slow), "2:3:5"])
def test_drafted_trees_equal_pytorch_recomputation(setup, spec):
    model, be, _ = setup
    shape = parse_trees(spec)[0]
    seqs, _ = generate(be, PROMPTS[:2], opts(shape))
    checked = 0
    for s in seqs:
        for q, tree in s.draft_log[1:]:  # the first entry is prefill's chain
            got = list(zip(tree[:shape.budget], tree[shape.budget:]))
            assert got == _reference_tree(model, s.tokens, q, shape), f"q={q}"
            checked += 1
    assert checked >= 6


# ------------------------------------------------------------------ sampling, options, helpers
def test_sampling_runs_the_chain(setup):
    _, be, _ = setup
    sampling = SamplingParams(temperature=0.8, top_k=20)
    chain, _ = generate(be, PROMPTS, opts(None, sampling=sampling), seed=3)
    tree, _ = generate(be, PROMPTS, DecodeOptions(nextn=K, max_new_tokens=NEW, eos_ids=(EOS,), sampling=sampling,
                                                  tree=TreeShape(3, 2, 6)), seed=3)
    assert [s.generated for s in tree] == [s.generated for s in chain]


def test_chain_tree_and_reference_walk():
    tokens, parents = chain_tree(np.array([[7, 8, 9]]), 5)
    assert tokens.tolist() == [[7, 8, 9, 7, 7]] and parents.tolist() == [[0, 1, 2, 0, 0]]
    tokens, parents = chain_tree(np.array([[7, 8, 9]]), 2)
    assert tokens.tolist() == [[7, 8]] and parents.tolist() == [[0, 1]]
    # root target 7 -> node 1 (7) or node 4 (7); node 1's target 8 -> node 2; node 2's target 5 != 9
    assert accept_tree_reference(np.array([7, 8, 5, 0, 0, 0]), tokens[0].tolist() + [9, 7, 7][1:], [0, 1, 2, 0, 0],
                                 3)[0] in (1, 2)
    assert accept_tree_reference(np.array([7, 8, 5, 0, 0, 0]), [7, 8, 9, 7, 7], [0, 1, 2, 0, 0], 3) == (2, [0, 1, 2])
    assert accept_tree_reference(np.array([7, 8, 5, 0, 0, 0]), [7, 8, 9, 7, 7], [0, 1, 2, 0, 0], 1) == (1, [0, 1])


@pytest.mark.parametrize("text, message", [
    ("3:1:4", "top-k must be in 2..16"), ("0:2:2", "--nextn >= 1"), ("3:2:11", "budget must be in 1..10"),
    ("2:17:4", "top-k must be in 2..16"), ("17:2:4", "at most 16"), ("3:16:129", "budget must be in 1..128"),
    ("3:2", "DEPTH:TOPK:BUDGET"), ("a:b:c", "DEPTH:TOPK:BUDGET")])
def test_bad_tree_shapes_are_one_error(text, message):
    with pytest.raises(MtpTrtError, match=message):
        parse_trees(text)


def test_export_refuses_trees_it_cannot_run(setup, tmp_path):
    ckpt = setup[1].manifest.raw["checkpoint"]
    with pytest.raises(MtpTrtError, match="at most --nextn"):
        export(ckpt, tmp_path / "d", nextn=2, trees="3:2:4")
    assert not any(tmp_path.iterdir())


def test_plugin_lowering_tree_graph(setup, tmp_path):
    """The plugin lowering's tree graph: every attention node of the tree's rows takes the tree mask (bool [B, S, S])
    as its fifth input; the path's rows are outputs that the manifest names as the runtime's commits."""
    import onnx

    ckpt = setup[1].manifest.raw["checkpoint"]
    m = Manifest.load(export(ckpt, tmp_path / "p", nextn=2, lowering="plugin", max_seq_len=64, trees="2:2:4"))
    g = m.graphs["tree_2_2_4"]
    layers = m.config.num_hidden_layers
    assert g.commits == {f"kv_{i}": f"path_kv_{i}" for i in range(layers)}
    assert g.kv_outputs == [f"kv_{i}_out" for i in range(layers)] + ["mtp_kv_out"]
    model = onnx.load(m.root / g.file, load_external_data=False)
    attn = [n for n in model.graph.node if n.op_type == "MlaGenerationAttention"]
    assert len(attn) == layers + 2  # the verify's layers, MTP depth 1, one expansion
    assert [len(n.input) for n in attn] == [5] * layers + [4, 5]  # depth 1 over the path is causal
    assert not [n for n in model.graph.node if n.op_type == "MtpAccept"]  # tree acceptance is standard operators


def test_runner_picks_the_exported_tree(setup):
    from mtp_trt.runner import Runner

    _, be, _ = setup
    runner = Runner(be.manifest, backend=be)
    assert runner.options(3, tree_topk=3).tree == TreeShape(3, 3, 12)
    assert runner.options(3, tree_topk=1).tree is None
    with pytest.raises(MtpTrtError, match=r"no tree of depth \(--nextn\) 2, top-k 2 .*--trees 2:2:4"):
        runner.options(2, tree_topk=2)
    with pytest.raises(MtpTrtError, match="needs --tree-topk"):
        runner.options(3, tree_budget=6)
    assert tree_shape(3, 2, 6).graph in be.manifest.graphs


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_demo_tree_decoding_equals_transformers_generate(tmp_path, mode):
    """The bundled demo checkpoint (3 MTP modules): tree decoding of its export in either mode (depth 3, top-k 3,
    budget 8) gives the tokens of transformers' DeepseekV3ForCausalLM greedy `generate`, and accepts more per
    step than the chain."""
    transformers = pytest.importorskip("transformers")
    from mtp_trt.runner import Runner, demo_model

    demo = demo_model()
    runner = Runner(Manifest.load(export(demo, tmp_path / "demo", nextn=3, mtp_mode=mode, max_seq_len=256,
                                         trees="3:3:8")))
    ids = [runner.encode("def read_lines(path):\n    \"\"\"Return the lines of a file."),
           runner.encode("class Stack:\n    def __init__(self):\n")]
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(demo, dtype=torch.float32).eval()
    new = 40
    want = []
    for x in ids:
        with torch.no_grad():
            out = hf.generate(torch.tensor([x]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0)
        want.append(out[0, len(x):].tolist())
    seqs, tree = generate(runner.backend, ids, runner.options(3, tree_topk=3, max_new_tokens=new))
    assert [s.generated for s in seqs] == want
    _, chain = generate(runner.backend, ids, runner.options(3, max_new_tokens=new))
    assert tree.mean_acceptance_length > chain.mean_acceptance_length


@pytest.mark.parametrize("shape", [TreeShape(2, 2, 4), TreeShape(3, 3, 8), TreeShape(16, 16, 128), TreeShape(12, 10, 99)])
def test_tree_spec_inverts_the_graph_name(shape):
    assert tree_spec(shape.graph) == shape.spec and parse_trees(tree_spec(shape.graph)) == (shape,)
