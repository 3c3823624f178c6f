"""The custom operators of the `plugin` lowering (ONNX domain `mtp_trt`): the documented contract.

The exporter emits these nodes, the TensorRT plugins implement them, and the tests check every
exported node against this table.  Shapes use B batch, S new tokens, H heads, Dl kv_lora_rank,
Dr rope dims, T cache rows, V vocabulary.
"""

from __future__ import annotations

import dataclasses

DOMAIN = "mtp_trt"
# Every node also carries the string attribute `plugin_version` = str(VERSION): TensorRT's ONNX parser looks the
# plugin creator up by (op type, that attribute, default "1"; namespace "").  It is not a plugin field.
PLUGIN_VERSION_ATTRIBUTE = "plugin_version"
# 2: MlaGenerationAttention returns its cache as an output aliased to the cache input; 3: and takes an optional
# tree mask (tree drafting)
VERSION = 3


@dataclasses.dataclass(frozen=True)
class OpSpec:
    name: str
    doc: str
    inputs: tuple[tuple[str, str], ...]  # (name, "dtype [shape]: meaning")
    attributes: tuple[tuple[str, str], ...]  # (name, "type: meaning")
    outputs: tuple[tuple[str, str], ...]
    optional: int = 0  # the last `optional` inputs may be left out


MLA_GENERATION_ATTENTION = OpSpec(
    name="MlaGenerationAttention",
    doc="MLA attention over the compressed latent cache (absorbed form). Writes the S new latent rows into "
        "the cache at rows past_len[b] .. past_len[b]+S-1, then attends query s of sequence b over rows "
        "0 .. past_len[b]+s (causal among the new rows; with tree_mask, the rows 0 .. past_len[b]-1 and the new "
        "rows j where tree_mask[b, s, j]).  V is the first Dl values of each row.  The write is "
        "in place: output kv_cache_out is aliased to input kv_cache (TensorRT's aliased plugin I/O, "
        "IPluginV3OneBuildV2.get_aliased_input(1) == 2): both are bound to the same buffer.",
    inputs=(
        ("q", "fp32/fp16/bf16 [B, S, H, Dl+Dr]: q_nope absorbed through W^UK, then roped q_pe"),
        ("new_rows", "same dtype [B, S, Dl+Dr]: normed c_kv then roped k_pe of the new tokens"),
        ("kv_cache", "same dtype [B, T, Dl+Dr]: the persistent latent cache of this layer (written in place)"),
        ("past_len", "int32 [B]: valid cached rows of each sequence before this step"),
        ("tree_mask", "bool [B, S, S] (optional): new row j visible to new row s (tree attention; absent: causal)"),
    ),
    attributes=(
        ("kv_lora_rank", "int: Dl"),
        ("softmax_scale", "float: qk_head_dim^-0.5 times YaRN's mscale^2"),
    ),
    outputs=(("out", "same dtype [B, S, H, Dl]: softmax(scale q.row) @ row[:Dl]"),
             ("kv_cache_out", "same dtype [B, T, Dl+Dr]: kv_cache with the new rows written (aliased to input 2)")),
    optional=1,
)
MLA_SPARSE_ATTENTION = OpSpec(
    name="MlaSparseAttention",
    doc="DeepSeek Sparse Attention: MLA over the rows DSA's lightning indexer selects.  Writes the S new rows (latent "
        "then indexer key, C values each) into the cache at rows past_len[b] .. past_len[b]+S-1, scores every row "
        "query s of sequence b sees (as MlaGenerationAttention: the cached rows and the new rows causally or by "
        "tree_mask) with I = sum_j w[j] ReLU(index_q[j] . key / sqrt(Di)), keys being the last Di values of each "
        "row, selects the index_topk rows of highest I (every visible row when there are fewer; ties: the earlier "
        "row), and attends over those alone (V: the first Dl values of each row).  The write is in place: "
        "kv_cache_out is aliased to kv_cache.",
    inputs=(
        ("q", "fp32/fp16/bf16 [B, S, H, Dl+Dr]: q_nope absorbed through W^UK, then roped q_pe"),
        ("new_rows", "same dtype [B, S, C]: normed c_kv, roped k_pe, then the indexer key (C = Dl+Dr+Di)"),
        ("kv_cache", "same dtype [B, T, C]: the persistent cache of this layer (written in place)"),
        ("past_len", "int32 [B]: valid cached rows of each sequence before this step"),
        ("index_q", "same dtype [B, S, Hi, Di]: the indexer's queries, roped"),
        ("index_weights", "fp32 [B, S, Hi]: the indexer's head weights, weights_proj(x) / sqrt(Hi)"),
        ("tree_mask", "bool [B, S, S] (optional): new row j visible to new row s (tree attention; absent: causal)"),
    ),
    attributes=(
        ("kv_lora_rank", "int: Dl"),
        ("softmax_scale", "float: qk_head_dim^-0.5 times YaRN's mscale^2"),
        ("index_topk", "int: rows each query attends to"),
    ),
    outputs=(("out", "same dtype [B, S, H, Dl]: softmax(scale q.row) @ row[:Dl] over the selected rows"),
             ("kv_cache_out", "same dtype [B, T, C]: kv_cache with the new rows written (aliased to input 2)")),
    optional=1,
)
ALIASES = {"MlaGenerationAttention": {1: 2}, "MlaSparseAttention": {1: 2}, "MtpAccept": {}}  # op -> {output: input}

MTP_ACCEPT = OpSpec(
    name="MtpAccept",
    doc="Acceptance of the drafts input_ids[:, 1:] against the target logits: draft i is accepted if it "
        "equals the argmax at position i or, while the thinking flag in effect for position i is on and "
        "relaxed_topk > 0, if it ranks among the top relaxed_topk tokens (ties: lower id first) and "
        "p(draft) >= p(top-1) - relaxed_delta; accepted = longest accepted prefix, then the bonus token "
        "(argmax at the first unaccepted position).  The thinking flag is switched on by think_start_id "
        "and off by think_end_id as the accepted tokens are processed in order.",
    inputs=(
        ("logits", "fp32 [B, S, V]: target logits, S = K + 1"),
        ("input_ids", "int32 [B, S]: the last accepted token followed by the K drafts"),
        ("thinking", "int32 [B]: thinking flag before this step's drafts"),
        ("relaxed_topk", "int32 []: N of relaxed acceptance; 0 = strict"),
        ("relaxed_delta", "fp32 []: delta of relaxed acceptance"),
    ),
    attributes=(
        ("think_start_id", "int: id of <think> (-1: none)"),
        ("think_end_id", "int: id of </think> (-1: none)"),
    ),
    outputs=(
        ("accepted_tokens", "int32 [B, S]: accepted drafts, then the bonus token, then -1"),
        ("num_accepted", "int32 [B]: drafts accepted (0..K); new tokens = num_accepted + 1"),
        ("thinking_out", "int32 [B]: thinking flag after the accepted tokens"),
    ),
)

OPS = {op.name: op for op in (MLA_GENERATION_ATTENTION, MLA_SPARSE_ATTENTION, MTP_ACCEPT)}
