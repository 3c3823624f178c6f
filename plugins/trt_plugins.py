"""TensorRT IPluginV3 plugins (Python) for the custom ops of the `plugin` lowering (mtp_trt/ops.py).

`register(trt)` registers one IPluginCreatorV3One per op with the plugin registry of the given
TensorRT module (`tensorrt` or `tensorrt_rtx`), under the op's name, version `ops.VERSION` and the
empty namespace — what the ONNX parser looks up for a node of that op type.  The same creators
serve the builder (phase BUILD) and the runtime (phase RUNTIME, from the serialized fields).

Build-time logic needs no GPU: output shapes from input dims, types/formats (linear; fp32, fp16
or bf16 attention data with int32 lengths; fp32 logits with int32 ids), serialized attributes,
workspace sizes.  `enqueue` (GPU only) launches the CUDA kernels of plugins/kernels through the
ctypes library of plugins/cuda_lib.py (prebuilt and shipped, see cuda_lib.load_library), loaded when a
plugin is created for the runtime phase (engine deserialization), never inside enqueue:

* MlaGenerationAttention -> mtp_mla_decode with new_rows (the KV commit, written in place) and the
  optional fifth input, the tree mask (absent: NULL, causal); split-KV workspace from the TensorRT workspace.
  The write is legal: output 1, kv_cache_out, is declared aliased to input 2
  (IPluginV3OneBuildV2.get_aliased_input, builder preview feature ALIASED_PLUGIN_IO_10_03), so TensorRT gives
  both the same buffer (enqueue checks it).  The split count and workspace of each (B, S, H, T) are worked out
  once per plugin instance (one execution context, one device): a call is one ctypes call, the launch.
* MlaSparseAttention (DeepSeek Sparse Attention) -> mtp_mla_kv_commit (the new rows with their indexer keys, in
  place), mtp_dsa_select (the indexer's scores and top-k over the committed cache) and mtp_mla_sparse_decode over
  the selected rows; the scores, the selected rows and the split-KV partials share the TensorRT workspace.
* MtpAccept -> mtp_accept_relaxed_dev (kernel ABI 3; relaxed_topk <= 0 is strict), reading the
  drafts in place from input_ids + 1 with stride S and writing the flags to thinking_out: no
  workspace, no copies.  relaxed_topk and relaxed_delta stay device scalars that the kernels read
  themselves, so nothing in enqueue waits for the stream (the engines can be captured in a CUDA graph).
"""

from __future__ import annotations

import functools
import math
import threading
import traceback

import numpy as np

from mtp_trt import contract as C, ops
from mtp_trt.plugins.reference import MLA_MAX_SPLITS as MAX_SPLITS, MLA_ROW_BLOCK, mla_num_splits, mla_workspace_size

PLUGIN_VERSION = str(ops.VERSION)
PLUGIN_NAMESPACE = ""
MAX_SMS = 192  # workspace is reserved for GPUs with up to this many SMs; bigger ones get fewer parts
DSA_STATE_BYTES = 20992  # MTP_DSA_STATE_BYTES: mtp_dsa_select's histograms and counts per query token
DTYPE_CODES = {d.tensorrt: d.kernel for d in C.KERNEL_DTYPES.values()}  # mtp_dtype of mtp_kernels.h by trt.DataType name

errors: list[str] = []  # messages of exceptions raised inside plugin callbacks (TensorRT only sees a failure)
created: dict[str, int] = {}  # op name -> plugins created by the creators (any phase)
_lock = threading.Lock()


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


def mla_splits_bound(B: int, S: int, H: int, max_len: int) -> int:
    return mla_num_splits(B, S, H, max_len, MAX_SMS)


def mla_workspace_bound(b_range: tuple[int, int], s_range: tuple[int, int], H: int, Dl: int, max_len: int) -> int:
    """Workspace for every (B, S) of the ranges with splits_bound(B, S, H, max_len): enqueue never
    uses more, since it caps its part count at that bound (and the bound grows with max_len)."""
    b_lo, b_hi = max(1, b_range[0]), max(1, b_range[1])
    s_lo, s_hi = max(1, s_range[0]), max(1, s_range[1])
    best = 0
    for b in range(b_lo, b_hi + 1):
        for s in range(s_lo, s_hi + 1):
            if (s * H + MLA_ROW_BLOCK - 1) // MLA_ROW_BLOCK >= MAX_SMS:  # one part from here on (grows with s)
                break
            best = max(best, mla_workspace_size(b, s, H, Dl, mla_splits_bound(b, s, H, max_len)))
    return best


def dsa_workspace_size(B: int, S: int, T: int) -> int:
    """mtp_dsa_select_workspace_size of dsa.cu, in Python: the index scores as 32-bit keys [B*S, ceil4(T)], then
    DSA_STATE_BYTES per query token, each part 256-byte aligned."""
    if B <= 0 or S <= 0 or T <= 0:
        return 0
    return _align(B * S * _align(T, 4) * 4) + _align(B * S * DSA_STATE_BYTES)


def sparse_workspace_size(B: int, S: int, H: int, Dl: int, T: int, K: int, num_splits: int) -> tuple[int, int, int]:
    """MlaSparseAttention's workspace parts for one shape: (mtp_dsa_select's workspace, the selected rows int32
    [B*S, K], the split-KV partials of mtp_mla_sparse_decode), each 256-byte aligned."""
    return dsa_workspace_size(B, S, T), _align(B * S * K * 4), mla_workspace_size(B * S, 1, H, Dl, num_splits)


def sparse_splits_bound(B: int, S: int, H: int, K: int) -> int:
    """The split count MlaSparseAttention's enqueue may use at most: each query token is a sequence of K rows."""
    return mla_splits_bound(B * S, 1, H, K)


def sparse_workspace_bound(b_range: tuple[int, int], s_range: tuple[int, int], H: int, Dl: int, max_len: int,
                           K: int) -> int:
    """MlaSparseAttention's workspace for every (B, S) of the ranges: each part at its largest."""
    lo, hi = max(1, b_range[0]) * max(1, s_range[0]), max(1, b_range[1]) * max(1, s_range[1])
    scores, selected, _ = sparse_workspace_size(hi, 1, H, Dl, max_len, K, 1)
    return scores + selected + mla_workspace_bound((lo, hi), (1, 1), H, Dl, K)


def _field(fc, name: str, kind):
    for f in fc or ():
        if f.name == name:
            return kind(np.asarray(f.data).reshape(-1)[0])
    raise ValueError(f"missing attribute {name!r}")


def _reported(fn):
    """Record the message of an exception raised in a TensorRT callback (TensorRT prints only a code)."""

    @functools.wraps(fn)
    def wrapper(self, *args):
        try:
            return fn(self, *args)
        except Exception as e:
            with _lock:
                errors.append(f"{self.plugin_name} plugin, {fn.__name__}: {type(e).__name__}: {e}")
            traceback.print_exc()
            raise

    return wrapper


@functools.cache
def _kernels():
    from mtp_trt.plugins.cuda_lib import load_library

    return load_library()


@functools.cache
def plugin_classes(trt) -> dict[str, tuple[type, type]]:
    """{op name: (plugin class, creator class)} for one TensorRT module."""
    F, I32 = trt.PluginFieldType.FLOAT32, trt.PluginFieldType.INT32
    floats = (trt.float32, trt.float16, trt.bfloat16)

    class Base(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuildV2, trt.IPluginV3OneRuntime):
        OP: ops.OpSpec
        FIELDS: tuple[tuple[str, object, type], ...]  # (name, PluginFieldType, python type)

        def __init__(self, values: dict):
            trt.IPluginV3.__init__(self)
            trt.IPluginV3OneCore.__init__(self)
            trt.IPluginV3OneBuildV2.__init__(self)
            trt.IPluginV3OneRuntime.__init__(self)
            self.plugin_name, self.plugin_version, self.plugin_namespace = self.OP.name, PLUGIN_VERSION, PLUGIN_NAMESPACE
            self.num_outputs = len(self.OP.outputs)
            self.timing_cache_id = ""
            self.values = dict(values)

        def get_capability_interface(self, kind):
            return self

        def get_aliased_input(self, output_index: int) -> int:
            return ops.ALIASES[self.OP.name].get(output_index, -1)

        def clone(self):
            return type(self)(self.values)

        def get_fields_to_serialize(self):
            return trt.PluginFieldCollection([
                trt.PluginField(n, np.array([self.values[n]], dtype=np.int32 if t is I32 else np.float32), t)
                for n, t, _ in self.FIELDS])

        def configure_plugin(self, inp, out):
            pass

        def on_shape_change(self, inp, out):
            pass

        def get_valid_tactics(self):
            return []

        def set_tactic(self, tactic):
            pass

        def attach_to_context(self, context):
            return self.clone()

        def destroy(self):
            pass

    def attention_format(pos: int, in_out, num_inputs: int, fixed: dict, mask_at: int) -> bool:
        """The attention plugins' formats: linear; q one of fp32/fp16/bf16; the inputs in `fixed` of that type; the
        optional tree mask (input mask_at) bool; every other tensor q's type."""
        d = in_out[pos].desc
        if d.format != trt.TensorFormat.LINEAR:
            return False
        if pos == 0:
            return d.type in floats
        if pos in fixed:
            return d.type == fixed[pos]
        if pos == mask_at and num_inputs == mask_at + 1:
            return d.type == trt.bool  # the tree mask: one byte per entry, as the kernels read it
        return d.type == in_out[0].desc.type

    class MlaGenerationAttention(Base):
        OP = ops.MLA_GENERATION_ATTENTION
        FIELDS = (("kv_lora_rank", I32, int), ("softmax_scale", F, float))

        @_reported
        def get_output_data_types(self, input_types):
            return [input_types[0], input_types[2]]

        @_reported
        def get_output_shapes(self, inputs, shape_inputs, exprs):
            q, rows, cache = inputs[0], inputs[1], inputs[2]
            if len(inputs) not in (4, 5) or (len(q), len(rows), len(cache), len(inputs[3])) != (4, 3, 3, 1) or \
                    (len(inputs) == 5 and len(inputs[4]) != 3):
                raise ValueError("expected q [B, S, H, D], new_rows [B, S, D], kv_cache [B, T, D], past_len [B] "
                                 "and optionally tree_mask [B, S, S]")
            dl = self.values["kv_lora_rank"]
            for name, d in (("q", q[3]), ("new_rows", rows[2]), ("kv_cache", cache[2])):
                if d.is_constant() and d.get_constant_value() <= dl:
                    raise ValueError(f"{name}'s last dim {d.get_constant_value()} must exceed kv_lora_rank {dl}")
            return [trt.DimsExprs([q[0], q[1], q[2], exprs.constant(dl)]), trt.DimsExprs([cache[0], cache[1], cache[2]])]

        @_reported
        def supports_format_combination(self, pos, in_out, num_inputs):
            return attention_format(pos, in_out, num_inputs, {3: trt.int32}, 4)

        @_reported
        def get_workspace_size(self, inp, out):
            q, cache = inp[0], inp[2]
            return mla_workspace_bound((q.min[0], q.max[0]), (q.min[1], q.max[1]), q.max[2],
                                       self.values["kv_lora_rank"], cache.max[1])

        def __init__(self, values: dict):
            super().__init__(values)
            self.launches: dict[tuple, tuple] = {}  # (B, S, H, T) -> (splits, workspace bytes) on this device

        def launch_plan(self, B: int, S: int, H: int, T: int) -> tuple[int, int]:
            """(split count, workspace bytes) of a shape: asked of the kernel library once per shape (the device's
            SM count), capped at the bound the build-time workspace was reserved for."""
            if (plan := self.launches.get((B, S, H, T))) is None:
                dl, lib = self.values["kv_lora_rank"], _kernels()
                splits = min(lib.mla_decode_num_splits(B, S, H, T, 0), mla_splits_bound(B, S, H, T))
                ws = lib.mla_decode_workspace_size(B, S, H, dl, splits)
                if ws != mla_workspace_size(B, S, H, dl, splits):  # the reserved size was computed with the latter
                    raise RuntimeError(f"the kernel library's split-KV workspace ({ws} bytes) differs from "
                                       f"plugins/trt_plugins.py's formula; update mla_workspace_size")
                plan = self.launches[(B, S, H, T)] = (splits, ws)
            return plan

        @_reported
        def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
            B, S, H, D = input_desc[0].dims
            T = input_desc[2].dims[1]
            if outputs[1] != inputs[2]:
                raise RuntimeError(f"kv_cache_out is bound to {outputs[1]:#x}, not to kv_cache's buffer "
                                   f"{inputs[2]:#x}: TensorRT did not alias them (build with aliased plugin I/O)")
            splits, ws = self.launch_plan(B, S, H, T)
            dl = self.values["kv_lora_rank"]
            _kernels().mla_decode(DTYPE_CODES[input_desc[0].type.name], inputs[0], outputs[1], inputs[3], inputs[1],
                                  inputs[4] if len(input_desc) == 5 else None,  # the tree mask, else causal
                                  outputs[0], workspace if ws else None, ws, B, S, H, dl, D - dl, T,
                                  self.values["softmax_scale"], splits, 0, stream)

    class MlaSparseAttention(Base):
        OP = ops.MLA_SPARSE_ATTENTION
        FIELDS = (("kv_lora_rank", I32, int), ("softmax_scale", F, float), ("index_topk", I32, int))

        @_reported
        def get_output_data_types(self, input_types):
            return [input_types[0], input_types[2]]

        @_reported
        def get_output_shapes(self, inputs, shape_inputs, exprs):
            q, rows, cache, _, iq, iw = inputs[:6]
            ranks = [len(x) for x in inputs]
            if ranks[:6] != [4, 3, 3, 1, 4, 3] or ranks[6:] not in ([], [3]):
                raise ValueError("expected q [B, S, H, D], new_rows [B, S, C], kv_cache [B, T, C], past_len [B], "
                                 "index_q [B, S, Hi, Di], index_weights [B, S, Hi] and optionally tree_mask [B, S, S]")
            dims = [d.get_constant_value() if d.is_constant() else None for d in (q[3], iq[3], rows[2], cache[2])]
            d, di = dims[0], dims[1]
            if d is not None and d <= self.values["kv_lora_rank"]:
                raise ValueError(f"q's last dim {d} must exceed kv_lora_rank {self.values['kv_lora_rank']}")
            if None not in (d, di) and any(c is not None and c != d + di for c in dims[2:]):
                raise ValueError(f"new_rows and kv_cache rows must hold q's {d} values and the {di}-value indexer "
                                 f"key, got {dims[2:]}")
            return [trt.DimsExprs([q[0], q[1], q[2], exprs.constant(self.values["kv_lora_rank"])]),
                    trt.DimsExprs([cache[0], cache[1], cache[2]])]

        @_reported
        def supports_format_combination(self, pos, in_out, num_inputs):
            return attention_format(pos, in_out, num_inputs, {3: trt.int32, 5: trt.float32}, 6)

        @_reported
        def get_workspace_size(self, inp, out):
            q, cache = inp[0], inp[2]
            return sparse_workspace_bound((q.min[0], q.max[0]), (q.min[1], q.max[1]), q.max[2],
                                          self.values["kv_lora_rank"], cache.max[1], self.values["index_topk"])

        def __init__(self, values: dict):
            super().__init__(values)
            self.launches: dict[tuple, tuple] = {}  # (B, S, H, T) -> (splits, workspace parts) on this device

        def launch_plan(self, B: int, S: int, H: int, T: int) -> tuple[int, tuple[int, int, int]]:
            """(split count, workspace parts) of a shape, asked of the kernel library once per shape."""
            if (plan := self.launches.get((B, S, H, T))) is None:
                dl, k, lib = self.values["kv_lora_rank"], self.values["index_topk"], _kernels()
                splits = min(lib.mla_decode_num_splits(B * S, 1, H, k, 0), sparse_splits_bound(B, S, H, k))
                parts = sparse_workspace_size(B, S, H, dl, T, k, splits)
                if (lib.dsa_select_workspace_size(B, S, T), lib.mla_decode_workspace_size(B * S, 1, H, dl, splits)) != \
                        (parts[0], parts[2]):
                    raise RuntimeError("the kernel library's workspace sizes differ from plugins/trt_plugins.py's "
                                       "sparse_workspace_size")
                plan = self.launches[(B, S, H, T)] = (splits, parts)
            return plan

        @_reported
        def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
            B, S, H, D = input_desc[0].dims
            T, C = input_desc[2].dims[1], input_desc[2].dims[2]
            hi, di = input_desc[4].dims[2], input_desc[4].dims[3]
            if outputs[1] != inputs[2]:
                raise RuntimeError(f"kv_cache_out is bound to {outputs[1]:#x}, not to kv_cache's buffer "
                                   f"{inputs[2]:#x}: TensorRT did not alias them (build with aliased plugin I/O)")
            splits, (scores, selected, partials) = self.launch_plan(B, S, H, T)
            dl, k, lib = self.values["kv_lora_rank"], self.values["index_topk"], _kernels()
            dtype, cache, sel = DTYPE_CODES[input_desc[0].type.name], outputs[1], workspace + scores
            lib.mla_kv_commit(dtype, cache, inputs[3], inputs[1], B, S, C, T, stream)  # the new rows and their keys
            lib.dsa_select(dtype, inputs[4], inputs[5], cache, inputs[3], inputs[6] if len(input_desc) == 7 else None,
                           sel, workspace, scores, B, S, hi, di, C, D, T, k, di**-0.5, stream)
            lib.mla_sparse_decode(dtype, inputs[0], cache, inputs[3], None, sel, outputs[0],
                                  sel + selected if partials else None, partials, B, S, H, dl, D - dl, C, T, k,
                                  self.values["softmax_scale"], splits, 0, stream)

    class MtpAccept(Base):
        OP = ops.MTP_ACCEPT
        FIELDS = (("think_start_id", I32, int), ("think_end_id", I32, int))
        TYPES = (trt.float32, trt.int32, trt.int32, trt.int32, trt.float32, trt.int32, trt.int32, trt.int32)

        @_reported
        def get_output_data_types(self, input_types):
            return [trt.int32] * 3

        @_reported
        def get_output_shapes(self, inputs, shape_inputs, exprs):
            logits = inputs[0]
            if [len(x) for x in inputs] != [3, 2, 1, 0, 0]:
                raise ValueError("expected logits [B, S, V], input_ids [B, S], thinking [B], relaxed_topk [], "
                                 "relaxed_delta []")
            b, s = logits[0], logits[1]
            return [trt.DimsExprs([b, s]), trt.DimsExprs([b]), trt.DimsExprs([b])]

        @_reported
        def supports_format_combination(self, pos, in_out, num_inputs):
            d = in_out[pos].desc
            return d.format == trt.TensorFormat.LINEAR and d.type == self.TYPES[pos]

        @_reported
        def get_workspace_size(self, inp, out):
            return 0

        @_reported
        def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
            B, S, V = (int(x) for x in input_desc[0].dims)
            # kernel ABI 3: the drafts read in place (input_ids + 1, stride S), thinking -> thinking_out; no copies
            _kernels().accept_relaxed_dev(0, inputs[0], inputs[1] + 4 if S > 1 else None, S, inputs[2], outputs[2],
                                          outputs[0], outputs[1], None, B, S - 1, V, inputs[3], inputs[4],
                                          self.values["think_start_id"], self.values["think_end_id"], stream)

    def creator_for(plugin: type) -> type:
        class Creator(trt.IPluginCreatorV3One):
            def __init__(self):
                trt.IPluginCreatorV3One.__init__(self)
                self.name, self.plugin_version, self.plugin_namespace = plugin.OP.name, PLUGIN_VERSION, PLUGIN_NAMESPACE
                self.field_names = trt.PluginFieldCollection(
                    [trt.PluginField(n, np.array([]), t) for n, t, _ in plugin.FIELDS])

            def create_plugin(self, name, fc, phase):
                try:
                    values = {n: kind(_field(fc, n, kind)) for n, _, kind in plugin.FIELDS}
                    if plugin is not MtpAccept and not (values["kv_lora_rank"] > 0 and values.get("index_topk", 1) > 0
                                                        and math.isfinite(values["softmax_scale"])):
                        raise ValueError(f"bad attributes {values}")
                except Exception as e:
                    with _lock:
                        errors.append(f"{plugin.OP.name} plugin for node {name!r}: {e}")
                    raise
                if phase == trt.TensorRTPhase.RUNTIME:
                    try:
                        _kernels()  # ready before the first enqueue: nothing is loaded or built there
                    except Exception as e:
                        with _lock:
                            errors.append(f"{plugin.OP.name} plugin: the CUDA kernels cannot be loaded: {e}")
                        raise
                with _lock:
                    created[plugin.OP.name] = created.get(plugin.OP.name, 0) + 1
                return plugin(values)

        Creator.__name__ = plugin.__name__ + "Creator"
        return Creator

    return {p.OP.name: (p, creator_for(p)) for p in (MlaGenerationAttention, MlaSparseAttention, MtpAccept)}


_registered: dict[int, list] = {}  # id(trt module) -> creators (kept alive: the registry holds raw pointers)


def register(trt) -> list:
    """Register the creators of the plugins with trt's plugin registry (once per module)."""
    with _lock:
        if id(trt) in _registered:
            return _registered[id(trt)]
        registry = trt.get_plugin_registry()
        creators = []
        for name, (_, creator_cls) in plugin_classes(trt).items():
            existing = registry.get_creator(name, PLUGIN_VERSION, PLUGIN_NAMESPACE)
            if existing is not None and not isinstance(existing, creator_cls):
                registry.deregister_creator(existing)
            creator = creator_cls()
            if not registry.register_creator(creator, PLUGIN_NAMESPACE):
                raise RuntimeError(f"TensorRT refused to register the {name} plugin creator")
            creators.append(creator)
        _registered[id(trt)] = creators
        return creators


def is_ours(trt, plugin, op_name: str) -> bool:
    """Whether a network layer's plugin object is this module's plugin for op_name."""
    cls = plugin_classes(trt)[op_name][0]
    return isinstance(plugin, cls) and plugin.plugin_name == op_name
