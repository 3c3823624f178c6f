"""The graph contract, defined once: the dtypes, every exported graph's inputs and outputs (name, dtype,
symbolic shape), the persistent cache each cache input binds, and the graph names.

The exporter writes these specs into `manifest.json` (each graph's `inputs`, `outputs`, `kv_inputs`,
`kv_outputs` and, for the plugin lowering's tree graphs, `commits`); the backends feed and read tensors by
these names; docs/architecture.md's tables are checked against them.  Tensor and graph names are part of the
exported files: they never change for an export that already exists.

Symbolic dims: B sequences, S new tokens, T cache rows (rows per sequence), D hidden size, V vocabulary,
C one cache row (ModelConfig.cache_dim), K drafts per step (nextn), N tree nodes (a tree's budget).

Lengths: `past_len` is the one name of a cache's committed length: rows 0 .. past_len-1 of a sequence's cache
hold committed tokens, and a graph call writes its S new rows at past_len .. past_len+S-1 (the decode loop
rewinds by moving past_len back).  The target's caches and each MTP module's keep their own: the decode loop
calls the latter `mtp_past_len`.  A distinct concept keeps its own name: `write_pos` in the exporters' graph
code, the row where a block group's first new row goes -- past_len for the rows a call commits, further on for
a step's speculative MTP rows (depth k of an eagle step: past_len + num_accepted + k - 1).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from mtp_trt.errors import MtpTrtError


# -------------------------------------------------------------------------------------------- dtypes
@dataclasses.dataclass(frozen=True)
class DType:
    """One tensor dtype under each library's name.  `host`: the NumPy dtype its bytes are read as (bf16 and fp8
    have none: their raw bits as unsigned ints); `onnx`: the TensorProto data type; `torch`: the torch attribute's
    name; `safetensors`: the checkpoint header's; `kernel`: the dtype code of mtp-trt's CUDA kernels (`mtp_dtype` of
    mtp_kernels.h); `tensorrt`: the name of TensorRT's DataType member."""

    name: str
    host: type
    onnx: int
    torch: str
    safetensors: str
    kernel: int | None = None
    tensorrt: str | None = None

    @property
    def itemsize(self) -> int:
        return np.dtype(self.host).itemsize

    def torch_dtype(self):
        import torch

        return getattr(torch, self.torch)


DTYPE_TABLE = {d.name: d for d in (
    DType("fp64", np.float64, 11, "float64", "F64"),
    DType("fp32", np.float32, 1, "float32", "F32", 0, "FLOAT"),
    DType("fp16", np.float16, 10, "float16", "F16", 1, "HALF"),
    DType("bf16", np.uint16, 16, "bfloat16", "BF16", 2, "BF16"),
    DType("fp8e4m3", np.uint8, 17, "float8_e4m3fn", "F8_E4M3", None, "FP8"),
    DType("fp8e5m2", np.uint8, 19, "float8_e5m2", "F8_E5M2"),
    DType("int64", np.int64, 7, "int64", "I64", None, "INT64"),
    DType("int32", np.int32, 6, "int32", "I32", None, "INT32"),
    DType("int16", np.int16, 5, "int16", "I16"),
    DType("int8", np.int8, 3, "int8", "I8", None, "INT8"),
    DType("uint8", np.uint8, 2, "uint8", "U8", None, "UINT8"),
    DType("bool", np.bool_, 9, "bool", "BOOL", None, "BOOL"),
)}
DTYPES = ("fp32", "fp16", "bf16")  # an export's (its weights, activations and caches)
TENSOR_DTYPES = (*DTYPES, "int32", "int64")  # a graph input's or output's
BY_ONNX = {d.onnx: d for d in DTYPE_TABLE.values()}
BY_SAFETENSORS = {d.safetensors: d for d in DTYPE_TABLE.values()}
KERNEL_DTYPES = {d.name: d for d in DTYPE_TABLE.values() if d.kernel is not None}  # the CUDA kernels' dtypes


def dtype(name: str) -> DType:
    return DTYPE_TABLE[name]


# ------------------------------------------------------------------------------------- tensor names
INPUT_IDS, PAST_LEN, THINKING = "input_ids", "past_len", "thinking"
RELAXED_TOPK, RELAXED_DELTA = "relaxed_topk", "relaxed_delta"
ACCEPTED_TOKENS, NUM_ACCEPTED, THINKING_OUT = "accepted_tokens", "num_accepted", "thinking_out"
TARGET_TOKENS, HIDDEN_STATES, LOGITS = "target_tokens", "hidden_states", "logits"
HIDDEN, NEXT_TOKENS = "hidden", "next_tokens"
HIDDEN_OUT, DRAFT_TOKENS, DRAFT_PROBS, DRAFT_LOGITS = "hidden_out", "draft_tokens", "draft_probs", "draft_logits"
DRAFTS, CARRY, CARRY_OUT = "drafts", "carry", "carry_out"
TREE_PARENTS, TREE_TOKENS, TREE_PARENTS_OUT = "tree_parents", "tree_tokens", "tree_parents_out"
# cache inputs: kv_i (target layer i), kv (an MTP graph's own cache), mtp_kv (the eagle step's MTP cache),
# mtp_kv_j (the vanilla step's module j)
TARGET_KV, MTP_GRAPH_KV, EAGLE_KV, VANILLA_KV = "kv_", "kv", "mtp_kv", "mtp_kv_"
PLUGIN_OUT = "_out"  # plugin lowering: cache input X's output X_out (the cache after the writes, aliased to X)
PATH_KV = "path_kv_"  # plugin lowering's tree graphs: the accepted path's rows of target layer i

# what the decode loop reads of each graph (logits only when sampling)
TARGET_OUTPUTS = (ACCEPTED_TOKENS, NUM_ACCEPTED, THINKING_OUT, TARGET_TOKENS, HIDDEN_STATES)
MTP_OUTPUTS = (HIDDEN_OUT, DRAFT_TOKENS, DRAFT_PROBS)
STEP_OUTPUTS = (ACCEPTED_TOKENS, NUM_ACCEPTED, THINKING_OUT, DRAFTS, TREE_TOKENS, TREE_PARENTS_OUT, CARRY_OUT)
SAMPLED_OUTPUTS = (LOGITS, DRAFT_LOGITS)


def target_kv(i: int) -> str:
    return f"{TARGET_KV}{i}"


def vanilla_kv(j: int) -> str:
    return f"{VANILLA_KV}{j}"


def path_kv(i: int) -> str:
    return f"{PATH_KV}{i}"


# -------------------------------------------------------------------------------------- graph names
TARGET = "target"


def mtp_graph(k: int) -> str:
    return f"mtp_{k}"


STEP_PREFIX, TREE_PREFIX = "step_", "tree_"


def step_graph(nextn: int) -> str:
    return f"{STEP_PREFIX}{nextn}"


def tree_graph(depth: int, topk: int, budget: int) -> str:
    return f"{TREE_PREFIX}{depth}_{topk}_{budget}"


def tree_dims(graph: str) -> tuple[int, int, int]:
    """(depth, top-k, budget) of tree graph `graph` (tree_graph's inverse)."""
    depth, topk, budget = graph.removeprefix(TREE_PREFIX).split("_")
    return int(depth), int(topk), int(budget)


# ------------------------------------------------------------------------------------------ caches
TARGET_FAMILY = "target"


def mtp_family(k: int) -> str:
    return f"mtp{k}"


@dataclasses.dataclass(frozen=True)
class CacheSlot:
    """Where a graph's cache input lives: persistent cache `family` (target | mtp0 | mtp1 ...), buffer `index`
    of it, and the row offset of the graph's window from past_len (vanilla step depth j + 1: -j)."""

    family: str
    index: int
    offset: int = 0


@functools.cache
def cache_slot(name: str, family: str = mtp_family(0)) -> CacheSlot:
    """kv_i -> target[i]; kv (an MTP graph's own cache) -> `family`; mtp_kv -> mtp0 (eagle step);
    mtp_kv_j -> mtp{j} at offset -j (vanilla step: depth j + 1's window starts j rows earlier)."""
    if name == MTP_GRAPH_KV:
        return CacheSlot(family, 0)
    if name == EAGLE_KV:
        return CacheSlot(mtp_family(0), 0)
    if name.startswith(VANILLA_KV):
        j = int(name.removeprefix(VANILLA_KV))
        return CacheSlot(mtp_family(j), 0, -j)
    if name.startswith(TARGET_KV):
        return CacheSlot(TARGET_FAMILY, int(name.removeprefix(TARGET_KV)))
    raise MtpTrtError(f"{name!r} is not a cache input of the graph contract (kv_i, kv, mtp_kv, mtp_kv_j)")


# ------------------------------------------------------------------------------ graphs' inputs/outputs
def spec(name: str, dtype: str, shape: list) -> dict:
    """One tensor as the manifest records it."""
    return {"name": name, "dtype": dtype, "shape": shape}


def commit_spec(cache: str, dtype: str, cfg, lowering: str, rows="S") -> dict:
    """The output that commits cache input `cache`: its new rows (`onnx`: new_kv_i / mtp_new_kv..., [B, rows, C],
    written back by the runtime) or the cache itself after the graph's writes (`plugin`: <cache>_out [B, T, C],
    aliased to the input: TensorRT binds both to one buffer)."""
    if lowering == "plugin":
        return spec(cache + PLUGIN_OUT, dtype, ["B", "T", cfg.cache_dim])
    name = "mtp_new_" + cache[4:] if cache.startswith("mtp_") else "new_" + cache
    return spec(name, dtype, ["B", rows, cfg.cache_dim])


def _fixed_s(specs: list[dict], s: int) -> list[dict]:
    return [{**t, "shape": [s if d == "S" else d for d in t["shape"]]} for t in specs]


def target_io(cfg, dtype: str, lowering: str) -> tuple[list[dict], list[dict]]:
    """target.onnx: prefill and verification, with acceptance in the graph."""
    kv = [spec(target_kv(i), dtype, ["B", "T", cfg.cache_dim]) for i in range(cfg.num_hidden_layers)]
    inputs = [spec(INPUT_IDS, "int32", ["B", "S"]), spec(PAST_LEN, "int32", ["B"]),
              spec(THINKING, "int32", ["B"]), spec(RELAXED_TOPK, "int32", []),
              spec(RELAXED_DELTA, "fp32", []), *kv]
    outputs = [spec(ACCEPTED_TOKENS, "int32", ["B", "S"]), spec(NUM_ACCEPTED, "int32", ["B"]),
               spec(THINKING_OUT, "int32", ["B"]), spec(TARGET_TOKENS, "int32", ["B", "S"]),
               spec(HIDDEN_STATES, dtype, ["B", "S", cfg.hidden_size]),
               spec(LOGITS, "fp32", ["B", "S", cfg.vocab_size])]
    outputs += [commit_spec(t["name"], dtype, cfg, lowering) for t in kv]
    return inputs, outputs


def mtp_io(cfg, dtype: str, lowering: str) -> tuple[list[dict], list[dict]]:
    """mtp_k.onnx: MTP module k over its own cache."""
    inputs = [spec(HIDDEN, dtype, ["B", "S", cfg.hidden_size]), spec(NEXT_TOKENS, "int32", ["B", "S"]),
              spec(PAST_LEN, "int32", ["B"]), spec(MTP_GRAPH_KV, dtype, ["B", "T", cfg.cache_dim])]
    outputs = [spec(HIDDEN_OUT, dtype, ["B", "S", cfg.hidden_size]), spec(DRAFT_TOKENS, "int32", ["B", "S"]),
               spec(DRAFT_PROBS, "fp32", ["B", "S"]), spec(DRAFT_LOGITS, "fp32", ["B", "S", cfg.vocab_size]),
               commit_spec(MTP_GRAPH_KV, dtype, cfg, lowering)]
    return inputs, outputs


def step_io(cfg, dtype: str, lowering: str, nextn: int) -> tuple[list[dict], list[dict]]:
    """step_K.onnx (plain decoding and eagle): S is K + 1, fixed at export; step_0 (plain decoding) has no
    relaxed-acceptance inputs, no MTP cache and no drafts."""
    t_in, t_out = target_io(cfg, dtype, lowering)
    mtp = nextn > 0
    inputs = [t for t in t_in if mtp or t["name"] not in (RELAXED_TOPK, RELAXED_DELTA)]
    inputs += [spec(EAGLE_KV, dtype, ["B", "T", cfg.cache_dim])] * mtp
    outputs = t_out[:3] + [spec(DRAFTS, "int32", ["B", nextn])] * mtp
    outputs += t_out[6:] + [commit_spec(EAGLE_KV, dtype, cfg, lowering)] * mtp
    return _fixed_s(inputs, nextn + 1), _fixed_s(outputs, nextn + 1)


def vanilla_step_io(cfg, dtype: str, lowering: str, nextn: int) -> tuple[list[dict], list[dict]]:
    """step_K.onnx (vanilla): S = K + 1 fixed; one MTP cache per depth; depth k's new rows are K + k wide."""
    t_in, t_out = target_io(cfg, dtype, lowering)
    carry = nextn > 1
    inputs = t_in + [spec(vanilla_kv(k), dtype, ["B", "T", cfg.cache_dim]) for k in range(nextn)]
    inputs += [spec(CARRY, dtype, ["B", nextn - 1, cfg.hidden_size])] * carry
    outputs = t_out[:3] + [spec(DRAFTS, "int32", ["B", nextn])]
    outputs += [spec(CARRY_OUT, dtype, ["B", nextn - 1, cfg.hidden_size])] * carry
    outputs += t_out[6:] + [commit_spec(vanilla_kv(k), dtype, cfg, lowering, nextn + k + 1) for k in range(nextn)]
    return _fixed_s(inputs, nextn + 1), _fixed_s(outputs, nextn + 1)


def tree_io(cfg, dtype: str, lowering: str, tree: tuple[int, int, int],
            mtp_mode: str = "eagle") -> tuple[list[dict], list[dict]]:
    """tree_D_k_N.onnx (exporters/tree.py, exporters/tree_vanilla.py) of depth D, top-k and budget N: N + 1 tokens
    in (the root, then the tree), the path's D + 1 rows out; the next tree's tokens and parents replace the chain's
    drafts.  Vanilla: the vanilla step's caches and carry, each module's D + 1 window rows out."""
    d, _, n = tree
    if mtp_mode == "vanilla":
        inputs, outputs = vanilla_step_io(cfg, dtype, lowering, d)
        news = {commit_spec(vanilla_kv(k), dtype, cfg, "onnx")["name"] for k in range(d)}
        outputs = [{**o, "shape": ["B", d + 1, o["shape"][2]]} if o["name"] in news else o for o in outputs]
    else:
        inputs, outputs = step_io(cfg, dtype, lowering, d)
    ids = {**inputs[0], "shape": ["B", n + 1]}
    inputs = [ids, spec(TREE_PARENTS, "int32", ["B", n]), *inputs[1:]]
    tree_out = [spec(TREE_TOKENS, "int32", ["B", n]), spec(TREE_PARENTS_OUT, "int32", ["B", n])]
    outputs = [o for o in outputs if o["name"] != DRAFTS]
    outputs = outputs[:3] + tree_out + outputs[3:]
    if lowering == "plugin":  # the verified nodes' rows sit at past_len + node: the runtime commits the path's
        outputs += [spec(path_kv(i), dtype, ["B", d + 1, cfg.cache_dim]) for i in range(cfg.num_hidden_layers)]
    return inputs, outputs


def graph_contract(cfg, nextn: int, modules: int, mtp_mode: str, dtype: str, lowering: str,
                   trees: tuple[tuple[int, int, int], ...] = ()) -> dict[str, dict]:
    """Every graph of an export, in export order: {name: {"inputs", "outputs", "kv_inputs", "kv_outputs"
    (+ "commits": the plugin lowering's tree graphs)}}, as the manifest records them.  modules: the MTP
    modules exported (eagle: 1; vanilla: nextn); trees: (depth, top-k, budget) of each tree graph."""
    layers = [target_kv(i) for i in range(cfg.num_hidden_layers)]
    jobs = [(TARGET, target_io(cfg, dtype, lowering), layers)]
    jobs += [(mtp_graph(k), mtp_io(cfg, dtype, lowering), [MTP_GRAPH_KV]) for k in range(modules)]
    for n in range(nextn + 1):  # the whole greedy step in one call, for every nextn 0..K
        if mtp_mode == "vanilla" and n > 0:
            jobs.append((step_graph(n), vanilla_step_io(cfg, dtype, lowering, n),
                         layers + [vanilla_kv(k) for k in range(n)]))
        else:
            jobs.append((step_graph(n), step_io(cfg, dtype, lowering, n), layers + [EAGLE_KV] * (n > 0)))
    for d, k, b in trees:
        jobs.append((tree_graph(d, k, b), tree_io(cfg, dtype, lowering, (d, k, b), mtp_mode),
                     layers + ([EAGLE_KV] if mtp_mode == "eagle" else [vanilla_kv(j) for j in range(d)])))
    graphs = {}
    for name, (inputs, outputs), kv_inputs in jobs:
        graphs[name] = {"inputs": inputs, "outputs": outputs, "kv_inputs": kv_inputs,
                        "kv_outputs": [commit_spec(kv, dtype, cfg, lowering)["name"] for kv in kv_inputs]}
        if name.startswith(TREE_PREFIX) and lowering == "plugin":  # rows the runtime writes after the engine
            graphs[name]["commits"] = {kv: path_kv(i) for i, kv in enumerate(layers)}
    return graphs
