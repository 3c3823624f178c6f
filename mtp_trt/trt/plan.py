"""The TensorRT runtime's planning, as plain functions (no GPU, no TensorRT): which engine and optimization
profile serve a call, the shape of every tensor, which persistent cache each cache input binds, the device
buffers a decode needs and their sizes, and why engines cannot run on this machine.

Everything here reads `engines.json` and the export manifest kept beside the engines
(`export_manifest.json`), so it is tested on CPU machines against real engine directories.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from mtp_trt import validate
from mtp_trt.errors import MtpTrtError
from mtp_trt import contract as C
from mtp_trt.manifest import GraphSpec, Manifest, TensorSpec
from mtp_trt.trt import manifest as em

GENERATION, PREFILL = "generation", "prefill"


def cache_families(m: Manifest) -> dict[str, int]:
    """{family: buffers}: the target's one per layer, then one per MTP cache (eagle: 1; vanilla: K)."""
    return {C.TARGET_FAMILY: m.config.num_hidden_layers} | {C.mtp_family(k): 1 for k in range(len(set(m.mtp_graphs)))}


@dataclasses.dataclass(frozen=True)
class EngineIO:
    """One engine's tensors and how the runtime binds them."""

    name: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    kv_inputs: list[str]
    kv_outputs: list[str]  # same order: onnx lowering, the new rows to commit; plugin, aliased cache outputs
    aliases: dict[str, str]  # output -> input bound to the same buffer (plugin lowering's caches)
    commits: dict[str, str]  # cache input -> output of rows the runtime writes into it at past_len after the call

    @property
    def data_inputs(self) -> list[TensorSpec]:
        return [t for t in self.inputs if t.name not in self.kv_inputs]

    @property
    def data_outputs(self) -> list[TensorSpec]:
        return [t for t in self.outputs if t.name not in self.aliases]

    @functools.cached_property
    def specs(self) -> dict[str, TensorSpec]:
        """Every tensor of the engine by name."""
        return {t.name: t for t in self.inputs + self.outputs}


def engine_io(graph: GraphSpec, lowering: str) -> EngineIO:
    """The onnx lowering commits every cache's new rows; the plugin lowering writes them in place, except the rows
    of a tree step's accepted path (graph.commits)."""
    if lowering == "plugin":
        aliases, commits = dict(zip(graph.kv_outputs, graph.kv_inputs)), dict(graph.commits)
    else:
        aliases, commits = {}, dict(zip(graph.kv_inputs, graph.kv_outputs))
    return EngineIO(graph.name, graph.inputs, graph.outputs, graph.kv_inputs, graph.kv_outputs, aliases, commits)


def check_aliases(io: EngineIO, recorded: dict[str, str]) -> None:
    """engines.json's aliases for an engine must be the graph contract's (a plugin-lowering engine whose cache
    outputs are not aliased would write its caches into scratch memory)."""
    if recorded != io.aliases:
        raise MtpTrtError(f"{em.FILE}: engine {io.name!r} aliases {recorded}, but the graph contract needs "
                          f"{io.aliases}; build the engines again with this mtp-trt")


def reported_alias_problem(reported: dict[str, str] | None, contract: dict[str, str]) -> str | None:
    """Whether what TensorRT reports of an engine's aliased outputs agrees with the graph contract (the runtime
    binds the contract's, which engines.json records and check_aliases verifies).  reported None: this TensorRT
    has no way to say (before 10.15); an output it does not report is taken from the contract; an alias it reports
    must be the contract's."""
    wrong = {o: i for o, i in (reported or {}).items() if contract.get(o) != i}
    if not wrong:
        return None
    return f"TensorRT binds {wrong} to one buffer, the graph contract {contract or 'no outputs'}"


def choose_profile(profiles: list[dict], s: int, batch: int) -> int:
    """Index of the optimization profile serving a call of S rows per sequence for `batch` sequences: the
    generation profile where S fits it (verify and step calls), else the prefill profile."""
    order = sorted(range(len(profiles)), key=lambda i: profiles[i]["name"] != GENERATION)
    for i in order:
        d = profiles[i]["dims"]
        if d["S"][0] <= s <= d["S"][2] and d["B"][0] <= batch <= d["B"][2]:
            return i
    best = max(p["dims"]["S"][2] for p in profiles)
    raise MtpTrtError(f"no optimization profile of the engines takes {batch} sequences of {s} new tokens "
                      f"(longest: {best}; the runtime splits longer prompts into chunks of that size)")


def max_chunk(profiles: list[dict]) -> int:
    """The most rows one call may carry (the prefill profile's S max): longer prompts run in chunks."""
    return max(p["dims"]["S"][2] for p in profiles)


def shape(spec: TensorSpec, dims: dict[str, int]) -> tuple[int, ...]:
    """A tensor's concrete shape: symbolic dims (B, S, T) from `dims`, fixed dims as they are."""
    return tuple(dims[d] if isinstance(d, str) else int(d) for d in spec.shape)


def nbytes(spec: TensorSpec, dims: dict[str, int]) -> int:
    return math.prod(shape(spec, dims)) * C.dtype(spec.dtype).itemsize


ALIGN = 256  # byte alignment of every tensor placed in a shared region


def buffer_sizes(ios: list[EngineIO], batch: int, rows: int, s_max: int) -> dict[str, int]:
    """Bytes of the one device buffer (and pinned host twin) each non-cache input name gets, shared by every engine
    that has an input of that name (calls run one after another on one stream), sized for the largest call:
    `batch` sequences, S up to s_max rows, T = rows."""
    dims = {"B": batch, "S": s_max, "T": rows}
    sizes: dict[str, int] = {}
    for io in ios:
        for t in io.data_inputs:
            sizes[t.name] = max(sizes.get(t.name, 0), nbytes(t, dims))
    return sizes


def output_layout(ios: list[EngineIO], batch: int, rows: int, s_max: int,
                  names: set[str] | None = None) -> tuple[dict[str, dict[str, int]], int]:
    """({engine: {output: byte offset}}, region bytes): where each engine's data outputs (those in `names`, else
    all) lie in one region that every engine shares.  An output lives only from its engine's call to the copy
    that reads it (or the commit that consumes it) on the same stream, so the engines' outputs overlap one another
    and the region is the largest engine's outputs, not the sum over tensor names."""
    dims = {"B": batch, "S": s_max, "T": rows}
    layout, size = {}, 0
    for io in ios:
        at, offsets = 0, {}
        for t in io.data_outputs:
            if names is None or t.name in names:
                offsets[t.name] = at
                at += -(-nbytes(t, dims) // ALIGN) * ALIGN
        layout[io.name], size = offsets, max(size, at)
    return layout, size


def cache_bytes(m: Manifest, batch: int, rows: int) -> int:
    """Device memory of every persistent cache for `batch` sequences of `rows` rows."""
    return validate.cache_bytes(m.config, sum(cache_families(m).values()), batch, rows, C.dtype(m.dtype).itemsize)


def runtime_problem(m: em.EngineManifest, cc: str | None, why_no_gpu: str, flavour_version: str | None,
                    instead: str) -> str | None:
    """Why these engines cannot run here, in one line, or None.  cc: this GPU's compute capability (None: no
    GPU, because why_no_gpu); flavour_version: the installed version of the engines' TensorRT flavour (None:
    not installed); instead: what ONNX Runtime can run in their place, as a phrase (runtime.onnx_runtime_instead)."""
    if cc is None:
        return f"running engines needs an NVIDIA GPU ({why_no_gpu}); {instead}"
    built_on = m.raw.get("built_on")
    if m.flavour == "tensorrt_rtx" and cc not in m.target_archs:
        return (f"{m.root}: the engines were built for compute capabilit{'ies' if len(m.target_archs) > 1 else 'y'} "
                f"{', '.join(m.target_archs)}, this GPU is {cc}; build them again with --target-arch {cc}")
    if m.flavour == "tensorrt" and built_on and m.target_archs != ["ampere+"] and built_on != cc:
        return f"{m.root}: the engines were built on a GPU of compute capability {built_on}, this GPU is {cc}; build them here"
    if flavour_version is None:
        return f"{m.root}: the engines need {m.flavour} {m.trt_version}, which is not installed"
    if flavour_version != m.trt_version:
        return (f"{m.root}: the engines were built with {m.flavour} {m.trt_version}, this machine has "
                f"{flavour_version}; build them again")
    return None


def activation_bytes(per_context: dict[tuple[str, int], int], created: set[tuple[str, int]]) -> int:
    """TensorRT's activation memory still to be allocated: that of every (engine, profile) context a decode may
    create (per_context), less those already created (their memory is already out of the free figure)."""
    return sum(n for key, n in per_context.items() if key not in created)


def memory_problem(need: int, free: int) -> str | None:
    """One line when `need` bytes of device memory do not fit in `free`."""
    if need <= free:
        return None
    gib = 2 ** 30
    return (f"the engines' activations, caches and buffers need about {need / gib:.2f} GiB of GPU memory, "
            f"{free / gib:.2f} GiB is free; use fewer sequences, a shorter --max-new-tokens or a smaller --max-seq-len")
