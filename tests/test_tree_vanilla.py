"""Tree drafting in vanilla mode (exporters/tree_vanilla.py): greedy vanilla tree decoding equals plain
greedy decoding (PyTorch reference; transformers in test_tree.py) for several trees, batches of different prompts (one shorter
than the tree's depth: the loop drafts the chain until every window starts at row >= 0) and random or planted
trees; acceptance (strict and relaxed) matches the reference walk over the tree; the drafted trees equal a
cache-free PyTorch recomputation of vanilla EAGLE-2 expansion (every MTP module over whole sequences); the
plugin lowering computes the same step; the exported graphs' contract."""

from __future__ import annotations

import json

import pytest
import torch

from mtp_trt.backend import OrtBackend
from mtp_trt.decode import DecodeOptions, generate
from mtp_trt.errors import MtpTrtError
from mtp_trt.exporters.export import export
from mtp_trt.exporters.generate import greedy_generate
from mtp_trt.exporters.loader import load_checkpoint, save_checkpoint
from mtp_trt.exporters.tree_vanilla import VanillaTreeStepGraph
from mtp_trt.manifest import Manifest
from mtp_trt.tree import TreeShape, accept_tree_reference, parse_trees
from runtime_models import EOS, THINK, make_self_drafting
from test_tree import (PROMPTS, PlantedTrees, RandomTrees, _relaxed_reference, _verify_case, check_accepts_more,
                       check_greedy_tree, eagle2_reference)

K = 3
TREES = "3:2:6,3:3:12,2:3:5,2:2:3,1:2:2"
PROMPTS_V = PROMPTS + [[44]]  # one token: shorter than depth 3 - 1, so the first step drafts the chain
NEW = 24


def make_hidden_reading(root, nextn: int = K, scale: float = 0.1):
    """The self-drafting checkpoint (runtime_models.py), but each MTP module's eh_proj also reads its hidden input
    (random [I | W]): drafts still often right, and every hidden state the tree step passes along -- the carry,
    the windows, the expansions' paths -- changes the drafts, so the drafted-tree test sees a wrong one."""
    ckpt = make_self_drafting(root / "self", nextn=nextn)
    model = load_checkpoint(ckpt)
    torch.manual_seed(1)
    with torch.no_grad():
        for mtp in model.mtp:
            d = mtp.eh_proj.weight.shape[0]
            mtp.eh_proj.weight[:, d:] = torch.randn(d, d) * scale / d ** 0.5
    cfg = json.loads((ckpt / "config.json").read_text())
    return save_checkpoint(model, root / "ckpt", cfg, {"tokenizer.json": ckpt / "tokenizer.json"})


@pytest.fixture(scope="module")
def vanilla(tmp_path_factory):
    root = tmp_path_factory.mktemp("vtree")
    ckpt = make_hidden_reading(root)
    path = export(ckpt, root / "vanilla", nextn=K, mtp_mode="vanilla", max_seq_len=256, trees=TREES)
    model = load_checkpoint(ckpt)
    reference = [greedy_generate(model, p, NEW, eos_ids=(EOS,)) for p in PROMPTS_V]
    return model, OrtBackend(Manifest.load(path)), reference


def opts(tree: TreeShape | None, nextn: int = K, **kw) -> DecodeOptions:
    return DecodeOptions(nextn=tree.depth if tree else nextn, max_new_tokens=NEW, eos_ids=(EOS,), tree=tree, **kw)


@pytest.mark.parametrize("spec", TREES.split(","))
def test_greedy_vanilla_tree_equals_plain_greedy(vanilla, spec):
    _, be, reference = vanilla
    check_greedy_tree(be, PROMPTS_V, reference, parse_trees(spec)[0], opts)


def test_vanilla_trees_accept_more_than_the_chain(vanilla):
    check_accepts_more(vanilla[1], opts)


def test_random_and_planted_trees_are_lossless(vanilla):
    """Random (even malformed) trees are rejected on nearly every step and stay exact -- the windows and the carry
    follow whatever was accepted; a planted correct branch is found at any node indices."""
    _, be, reference = vanilla
    seqs, stats = generate(RandomTrees(be), PROMPTS_V, opts(TreeShape(3, 3, 12)))
    assert [s.generated for s in seqs] == reference
    assert stats.mean_acceptance_length < 1.3
    seqs, stats = generate(PlantedTrees(be, PROMPTS[0] + reference[0]), PROMPTS[:1], opts(TreeShape(3, 3, 12)))
    assert seqs[0].generated == reference[0]
    assert stats.mean_acceptance_length > 1.5


def _step_inputs(model, depth: int, t: int = 32, seed: int = 0):
    """MTP caches with random rows below each module's window (past_len + 1 - k; zeros above, never read before
    written) and a random carry, for one tree step of depth `depth` at _verify_case's past_len."""
    g = torch.Generator().manual_seed(seed)
    past_len = torch.tensor([6, 4])
    mtp = []
    for k in range(1, depth + 1):
        c = torch.randn(2, t, model.cfg.latent_dim, generator=g) * 0.1
        for b in range(2):
            c[b, int(past_len[b]) + 1 - k:] = 0.0
        mtp.append(c)
    carry = [torch.randn(2, depth - 1, model.cfg.hidden_size, generator=g)] if depth > 1 else []
    return mtp, carry


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
@pytest.mark.parametrize("relaxed", [(0, 0.0), (4, 0.3)])
def test_vanilla_tree_acceptance_matches_a_walk_over_the_tree(vanilla, seed, relaxed):
    """The vanilla tree step's acceptance (strict; relaxed while thinking) against the reference walk over
    cache-free logits: the shared verify and accept_tree, fed through the vanilla graph's inputs."""
    model = vanilla[0]
    graph = VanillaTreeStepGraph(model, 3, 2, 6, "onnx", THINK)
    ids, parents, past_len, caches, expected, paths, depth = _verify_case(model, seed, thinking_tokens=True)
    mtp, carry = _step_inputs(model, 3)
    for thinking in (0, 1):
        with torch.no_grad():
            out = graph(ids, parents, past_len, torch.full((2,), thinking, dtype=torch.int32),
                        torch.tensor(relaxed[0], dtype=torch.int32), torch.tensor(relaxed[1]), *caches, *mtp, *carry)
        accepted, num = out[0], out[1]
        for b in range(2):
            d, node = _relaxed_reference(expected[b], ids[b], parents[b], depth, bool(thinking), *relaxed)
            assert int(num[b]) == d
            want = [int(ids[b, i]) for i in paths[b][node]] + [int(expected[b, node].argmax())]
            assert accepted[b, :d + 1].tolist() == want
            if relaxed[0] == 0:
                target = expected[b].argmax(-1).numpy()
                assert accept_tree_reference(target, ids[b, 1:].numpy(), parents[b].numpy(), depth)[0] == d


def test_plugin_lowering_computes_the_same_step(vanilla):
    """The plugin lowering's vanilla tree step (each module's window and expansion written in place at its window
    start, the expansion's mask into the attention node) computes what the onnx lowering's does (PyTorch: traced,
    each attention node runs its decomposed form): outputs, carry, the path's rows, and each module's final
    window rows in its cache = the onnx rows to commit at past_len + 1 - k."""
    model = vanilla[0]
    ids, parents, past_len, caches, _, _, _ = _verify_case(model, 5)
    args = (ids, parents, past_len, torch.zeros(2, dtype=torch.int32), torch.tensor(0, dtype=torch.int32),
            torch.tensor(0.0))
    layers = model.cfg.num_hidden_layers
    for shape in (TreeShape(3, 2, 6), TreeShape(3, 3, 8), TreeShape(2, 3, 5), TreeShape(1, 2, 2)):
        d = shape.depth
        mtp, carry = _step_inputs(model, d, seed=d)
        with torch.no_grad():
            onnx_out = VanillaTreeStepGraph(model, *vars(shape).values(), "onnx", THINK)(*args, *caches, *mtp, *carry)
            plug_out = VanillaTreeStepGraph(model, *vars(shape).values(), "plugin", THINK)(
                *args, *caches, *[c.clone() for c in mtp], *carry)
        n_out = 5 + (d > 1)  # accepted, num, thinking, tree tokens, tree parents, (carry)
        for a, b in zip(onnx_out[:5], plug_out[:5]):
            assert torch.equal(a, b)
        if d > 1:
            torch.testing.assert_close(onnx_out[5], plug_out[5], atol=1e-5, rtol=1e-5)
        for a, b in zip(onnx_out[n_out:n_out + layers], plug_out[n_out + layers + d:]):  # the path's rows
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        num = plug_out[1]
        for k in range(1, d + 1):
            rows, cache = onnx_out[n_out + layers + k - 1], plug_out[n_out + layers + k - 1]
            assert rows.shape[1] == d + 1
            for b in range(2):
                start, n = int(past_len[b]) + 1 - k, int(num[b]) + 1
                torch.testing.assert_close(cache[b, start:start + n], rows[b, :n], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(cache[b, :start], mtp[k - 1][b, :start])  # the committed rows untouched


# ------------------------------------------------------------------ the drafted trees
def _reference_vanilla_tree(model, tokens, q, shape: TreeShape):
    """Vanilla EAGLE-2 expansion recomputed from scratch, without caches: a node with draft path P (depth m) gets
    its children from MTP module m + 1 at row q, every module j = 1..m+1 run over the whole rows 0..q of the
    sequence tokens[:q + 2] + P (row i: module j-1's hidden at row i, the token at i + j; module 0 the main model);
    k children per expanded node, the k likeliest of a level's children expanded next, the N likeliest candidates
    kept (ties: the lower candidate index), in candidate order.  -> [(token, parent node)]."""
    with torch.no_grad():
        _, h0, _ = model(torch.tensor([tokens[:q + 1]]))

        def expand(path):
            ext, h = tokens[:q + 2] + path, h0
            for j in range(1, len(path) + 2):
                logits, h, _ = model.mtp_forward(j - 1, h, torch.tensor([ext[j:q + j + 1]]))
            return logits[0, -1].log_softmax(-1)

        return eagle2_reference(expand, shape)


@pytest.mark.parametrize("spec", [pytest.param("3:2:6", marks=pytest.mark.slow), "2:3:5",
                                  pytest.param("3:3:12", marks=pytest.mark.slow)])
def test_drafted_vanilla_trees_equal_pytorch_recomputation(vanilla, spec):
    model, be, _ = vanilla
    shape = parse_trees(spec)[0]
    seqs, _ = generate(be, PROMPTS[:2], opts(shape))
    checked = 0
    for s in seqs:
        for q, tree in s.draft_log:
            if len(tree) != 2 * shape.budget:  # prefill's chain
                continue
            got = list(zip(tree[:shape.budget], tree[shape.budget:]))
            assert got == _reference_vanilla_tree(model, s.tokens, q, shape), f"q={q}"
            checked += 1
    assert checked >= 6


def test_trees_drafted_after_chain_steps_equal_pytorch_recomputation(vanilla):
    """Near the end of the cache a tree decode runs chain steps (decode.fits_tree); the trees it drafts when tree
    steps resume after them (here: the longer sequence has left the batch at its limit) are EAGLE-2's expansion
    from the state the chain steps left, and both sequences end at the limit with plain greedy decoding's tokens."""
    from mtp_trt.decode import Sequence, admit, open_batch, prefill_chunk, step

    model, be, _ = vanilla
    shape, rows = TreeShape(2, 3, 5), 40
    prompts = [PROMPTS[0] + PROMPTS[2] + PROMPTS[3], PROMPTS[1]]  # 19 and 2 tokens
    batch = open_batch(be, opts(shape), 2, rows)
    seqs = {i: Sequence(list(p), max_new_tokens=100) for i, p in enumerate(prompts)}
    admit(batch, seqs)
    prefill_chunk(be, batch)
    while batch.st.n:
        step(be, batch)
    resumed = 0
    for s in seqs.values():
        assert s.generated == greedy_generate(model, s.prompt, rows - len(s.prompt), eos_ids=(EOS,))
        assert (s.finish_reason, s.message) == ("length", f"KV cache full ({rows} rows per sequence)")
        chain_q = [q for q, d in s.draft_log[1:] if len(d) != 2 * shape.budget]  # (after the prefill's chain)
        for q, tree in s.draft_log:
            if len(tree) == 2 * shape.budget:
                got = list(zip(tree[:shape.budget], tree[shape.budget:]))
                assert got == _reference_vanilla_tree(model, s.tokens, q, shape), f"q={q}"
                resumed += any(c < q for c in chain_q)
    assert resumed, "tree steps must follow chain steps for this test to bite"


# ------------------------------------------------------------------ export, runner, CLI
def test_vanilla_tree_graph_contract(vanilla, tmp_path):
    """The manifest's vanilla tree graphs: the vanilla step's caches and carry, each module's D + 1 window rows to
    commit (onnx); in the plugin lowering one attention node per verify layer and per module (module 1 causal,
    modules 2..D with the expansion's mask), the path's rows as the graph's commits.  A tree deeper than --nextn
    is one error."""
    import onnx

    _, be, _ = vanilla
    g = be.manifest.graphs["tree_3_2_6"]
    layers = be.manifest.config.num_hidden_layers
    assert g.kv_inputs == [f"kv_{i}" for i in range(layers)] + ["mtp_kv_0", "mtp_kv_1", "mtp_kv_2"]
    specs = {t.name: t.shape for t in g.inputs + g.outputs}
    assert specs["carry"] == ["B", 2, be.manifest.config.hidden_size] and specs["carry_out"] == specs["carry"]
    assert [specs[f"mtp_new_kv_{k}"][1] for k in range(3)] == [4, 4, 4]
    assert "carry" not in {t.name for t in be.manifest.graphs["tree_1_2_2"].inputs}
    ckpt = be.manifest.raw["checkpoint"]
    m = Manifest.load(export(ckpt, tmp_path / "p", nextn=2, mtp_mode="vanilla", lowering="plugin", max_seq_len=64,
                             trees="2:2:4"))
    g = m.graphs["tree_2_2_4"]
    assert g.commits == {f"kv_{i}": f"path_kv_{i}" for i in range(layers)}
    assert g.kv_outputs == [f"kv_{i}_out" for i in range(layers)] + ["mtp_kv_0_out", "mtp_kv_1_out"]
    model = onnx.load(m.root / g.file, load_external_data=False)
    attn = [n for n in model.graph.node if n.op_type == "MlaGenerationAttention"]
    assert [len(n.input) for n in attn] == [5] * layers + [4, 5]
    with pytest.raises(MtpTrtError, match="at most --nextn"):
        export(ckpt, tmp_path / "d", nextn=2, mtp_mode="vanilla", trees="3:2:4")
    assert not (tmp_path / "d").exists()


def test_runner_picks_the_vanilla_tree(vanilla):
    from mtp_trt.runner import Runner

    _, be, reference = vanilla
    runner = Runner(be.manifest, backend=be)
    assert runner.options(3, tree_topk=3).tree == TreeShape(3, 3, 12)
    assert runner.options(2, tree_topk=2).tree == TreeShape(2, 2, 3)
    with pytest.raises(MtpTrtError, match=r"no tree of depth \(--nextn\) 1, top-k 3 .*--trees 1:3:6"):
        runner.options(1, tree_topk=3)
    seqs, _ = generate(be, PROMPTS_V[:1], runner.options(2, tree_topk=3, max_new_tokens=NEW))
    assert seqs[0].generated == reference[0]


def test_cli_run_drafts_a_vanilla_tree(vanilla):
    """`mtp-trt run --tree-topk/--tree-budget` on a vanilla export: the chain's text, the tree in the report."""
    import subprocess

    exp = vanilla[1].manifest.root
    runs = {}
    for topk, budget in ((1, None), (3, None), (2, 6)):
        args = ["mtp-trt", "run", str(exp), "-p", "ab(cd)", "--max-new-tokens", "16", "--nextn", "3", "--json",
                "--threads", "1", "--tree-topk", str(topk)] + (["--tree-budget", str(budget)] if budget else [])
        r = subprocess.run(args, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        runs[(topk, budget)] = json.loads(r.stdout)
    texts = {k: [x["text"] for x in v["results"]] for k, v in runs.items()}
    assert len({tuple(t) for t in texts.values()}) == 1
    assert [runs[k]["summary"]["tree"] for k in runs] == [None, "3:3:12", "3:2:6"]
