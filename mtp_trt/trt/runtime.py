"""TrtBackend: the decode loop (mtp_trt/decode.py) on TensorRT engines, through cuda-python.

What a decode costs on the device, and when:
* once per process: each engine it runs is deserialized (only those: `prepare`), one execution context per
  engine and optimization profile;
* once per (batch, rows): every persistent latent cache; one device buffer and pinned host twin per input name,
  shared by the engines (sized for the largest call); one device region for the engines' outputs, which
  overlap one another (each lives only until the copy or commit that reads it, on the same stream), and one
  pinned region for the outputs the loop reads (logits only when sampling); the memory check counts TensorRT's
  activation memory of the contexts still to be created (`allocate`);
* per call: the inputs are written into the pinned buffers and copied to the device asynchronously on the
  one stream, the engine runs, and only the outputs the loop reads come back (accepted tokens, counts, the
  thinking flags, drafts, vanilla's carry; hidden states on the separate-graph path; logits only when
  sampling).  Nothing of a cache's size is allocated or copied; rewinding is the loop's lengths;
  `swap_slots` swaps one slot's rows by device copies when a sequence finishes.
* Lowerings: `plugin` engines write their cache rows in place (each cache output is aliased to its input and
  bound to the same buffer); `onnx` engines (no plugins: any TensorRT application loads them) return the new
  rows, committed by the `mtp_mla_kv_commit` kernel on the same stream (a device copy, no host round trip).
* CUDA graphs: the fused step (`step_K` engine) at each batch size runs eagerly once, is captured on its
  next call made right after an eager run of the same shapes on the same execution context (input copies,
  engine, commits, output copies; never right after a shape change, whose first enqueue TensorRT may not run
  inside a capture) and replayed from then on.
* Errors: TensorRT's error lines and the plugins' are collected and shown in the error of a failed load,
  context or enqueue.

The device layer (mtp_trt/trt/device.py), the engine loader (`EngineLoader`, TensorRT) and the kernel library
are injected, so tests run this whole module on a CPU with host-memory stand-ins (tests/trt_fakes.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mtp_trt import contract as C
from mtp_trt.backend import Backend
from mtp_trt.errors import MtpTrtError
from mtp_trt.trt import manifest as em
from mtp_trt.trt import plan
from mtp_trt.tree import tree_spec

# the outputs the decode loop reads (those of them an engine has; logits only when sampling)
READ_OUTPUTS = set(C.TARGET_OUTPUTS) | set(C.MTP_OUTPUTS) | set(C.STEP_OUTPUTS)


class EngineLoader:
    """Deserializes engines with the flavour they were built with and the plugins registered."""

    def __init__(self, m: em.EngineManifest, plugins: str = "auto"):
        from mtp_trt.trt import compat, cpp_plugins

        self.api = api = compat.load(m.flavour)
        self.errors: list[str] = []  # TensorRT's error lines (the C++ plugins log theirs through TensorRT too)
        self.plugins = cpp_plugins.use(api.trt, plugins)  # either implementation runs engines built with either
        if self.plugins == "python":
            from mtp_trt.plugins import trt_plugins

            self.plugin_errors = trt_plugins.errors  # the Python plugins' exceptions (TensorRT sees only a failure)
        else:
            self.plugin_errors = []
        self.runtime = api.trt.Runtime(api.make_logger(lambda sev, msg: self.errors.append(msg)
                                                       if sev in ("ERROR", "INTERNAL_ERROR") else None))

    def mark(self) -> tuple[int, int]:
        """Where the error lines stand now (for `messages` after a call that may fail)."""
        return len(self.errors), len(self.plugin_errors)

    def messages(self, mark: tuple[int, int], limit: int = 600) -> str:
        """TensorRT's and the plugins' error lines since `mark`, on one line (the last ones where too long)."""
        lines = [ln.strip() for msg in self.errors[mark[0]:] + self.plugin_errors[mark[1]:]
                 for ln in str(msg).splitlines() if ln.strip()]
        text = " | ".join(dict.fromkeys(lines))
        return text if len(text) <= limit else "..." + text[-limit:]

    def load(self, path: Path):
        mark = self.mark()
        engine = self.runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            why = self.messages(mark) or "no message from TensorRT"
            raise MtpTrtError(f"{path}: {self.api.flavour} {self.api.version} cannot load this engine: {why}")
        return engine

    def context(self, engine, profile: int, stream: int):
        mark = self.mark()
        ctx = engine.create_execution_context()
        if ctx is None:
            raise MtpTrtError(f"{engine.name}: TensorRT could not create an execution context: "
                              f"{self.messages(mark) or 'no message from TensorRT (out of GPU memory?)'}")
        if not ctx.set_optimization_profile_async(profile, stream):
            raise MtpTrtError(f"{engine.name}: TensorRT refused optimization profile {profile}: "
                              f"{self.messages(mark) or 'no message from TensorRT'}")
        return ctx

    @staticmethod
    def activation_bytes(engine) -> int:
        """Device memory TensorRT allocates for each execution context of `engine` (its activations: a context
        made with the default, static allocation takes the largest over the engine's profiles)."""
        return int(getattr(engine, "device_memory_size_v2", None) or engine.device_memory_size)

    @staticmethod
    def aliases(engine) -> dict[str, str] | None:
        """{output: input} TensorRT reports bound to one buffer (aliased plugin I/O), or None where this TensorRT
        cannot say (before 10.15: the graph contract recorded in engines.json is then the only record)."""
        lookup = getattr(engine, "get_aliased_input_tensor", None)
        if lookup is None:
            return None
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        return {n: a for n in names if (a := lookup(n))}


class Buffer:
    """One device buffer and its pinned host twin (an input's)."""

    def __init__(self, device, nbytes: int):
        self.nbytes = nbytes
        self.dev = device.malloc(nbytes)
        self.host_ptr, self.host = device.malloc_host(nbytes)

    def stage(self, a: np.ndarray) -> int:
        """Write `a` into the pinned buffer; returns its byte count."""
        raw = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        if raw.size > self.nbytes:
            raise MtpTrtError(f"internal: {raw.size} bytes staged into a buffer of {self.nbytes}")
        self.host[:raw.size] = raw
        return raw.size

    def read(self, dtype, shape) -> np.ndarray:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.host[:n].view(dtype).reshape(shape).copy()


def onnx_runtime_instead(export: dict, command: str = "run") -> str:
    """What ONNX Runtime can run in place of engines (engines.json's "export" record), as the same mtp-trt
    `command` (run, serve or bench) on it: the export they were built from where it is an onnx-lowering export
    still on this machine (not for bench, which takes checkpoints), else its checkpoint (an export for TensorRT,
    --lowering plugin or --moe-form tensorrt, does not run on ONNX Runtime's CPU operators)."""
    exp, ckpt = export.get("dir"), export.get("checkpoint")
    if command != "bench" and exp and export.get("lowering") == "onnx" and (Path(exp) / "manifest.json").is_file():
        return f"ONNX Runtime runs their export instead: mtp-trt {command} {exp}"
    if ckpt and (Path(ckpt) / "config.json").is_file():
        return f"ONNX Runtime runs their checkpoint instead: mtp-trt {command} {ckpt}"
    return (f"ONNX Runtime runs the checkpoint they come from instead ({ckpt or 'not recorded'}, not on this "
            f"machine): mtp-trt {command} CHECKPOINT")


class TrtBackend(Backend):
    """Runs an engine directory (`mtp-trt build`) on the GPU.  See the module docstring."""

    def __init__(self, engine_dir: str | Path, *, device=None, loader=None, kernels=None, cuda_graphs: bool = True,
                 plugins: str = "auto", share: TrtBackend | None = None, command: str = "run"):
        """share: another TrtBackend of the same engine directory whose device, loader and deserialized engines
        this one uses too (its own contexts, caches and buffers), so a process holds each engine once; command: the
        mtp-trt command running them (run, serve or bench), for the message of a machine that cannot."""
        self.command = command
        if share is not None:
            device, loader, kernels = share.device, share.loader, share._kernels
        self.em = em.EngineManifest.load(engine_dir)
        self.manifest = em.load_export_manifest(Path(engine_dir))
        m, self.root = self.manifest, Path(engine_dir)
        if device is None:
            device = self._default_device()
        self.device, self.cuda_graphs = device, cuda_graphs
        self._loader, self._plugins, self._kernels = loader, plugins, kernels
        self.lowering = m.lowering
        self.ios = {name: plan.engine_io(m.graphs[name], m.lowering) for name in self.em.engines}
        for name, io in self.ios.items():
            plan.check_aliases(io, self.em.engines[name].aliases)
        self.offsets = {name: self._commit_offsets(io) for name, io in self.ios.items()}  # past_len - j commits
        self.max_s = plan.max_chunk(self.em.profiles)
        self.engines: dict[str, object] = share.engines if share is not None else {}
        self.contexts: dict[tuple[str, int], object] = {}
        self.captured: dict[tuple, object] = {}  # (engine, n, s) -> its CUDA graph (a captured step)
        self.last_run: dict[tuple[str, int], tuple] = {}  # context -> (engine, n, s) of its last enqueue or replay
        self.bound: dict[tuple[str, int], dict] = {}  # context -> {tensor: address or shape} last set
        self.caches: dict[str, list[int]] = {}
        self.buffers: dict[str, Buffer] = {}  # input name -> device buffer and pinned twin
        self.out_dev = self.out_host_ptr = 0  # the outputs' shared device region and pinned region of those read
        self.out_at: dict[str, dict[str, int]] = {}  # engine -> {output: offset in the device region}
        self.host_at: dict[str, dict[str, int]] = {}  # engine -> {output read: offset in the pinned region}
        self.sampling = False  # whether the decode being prepared reads logits
        self.shape_key: tuple | None = None
        self.itemsize = C.dtype(m.dtype).itemsize

    def _default_device(self):
        from mtp_trt.trt import compat
        from mtp_trt.trt.device import Device

        cc, why = compat.gpu()
        try:
            version = compat.load(self.em.flavour).version
        except MtpTrtError:
            version = None
        problem = plan.runtime_problem(self.em, cc, why, version, onnx_runtime_instead(self.em.raw["export"],
                                                                                      self.command))
        if problem:
            raise MtpTrtError(problem)
        return Device()

    # ------------------------------------------------------------------------------- loading
    @property
    def loader(self):
        if self._loader is None:
            self._loader = EngineLoader(self.em, self._plugins)
        return self._loader

    @property
    def kernels(self):
        if self._kernels is None:
            from mtp_trt.plugins.cuda_lib import load_library

            self._kernels = load_library()
        return self._kernels

    def engine(self, name: str):
        if name not in self.engines:
            if name not in self.em.engines:
                raise MtpTrtError(f"{self.root}: no {name}.engine in this engine directory (engines.json lists "
                                  f"{', '.join(self.em.engines)})")
            engine = self.loader.load(self.root / self.em.engines[name].file)
            if problem := plan.reported_alias_problem(self.loader.aliases(engine), self.ios[name].aliases):
                raise MtpTrtError(f"{self.root / self.em.engines[name].file}: {problem}; build the engines again")
            self.engines[name] = engine
        return self.engines[name]

    def context(self, name: str, profile: int):
        key = (name, profile)
        if key not in self.contexts:
            self.contexts[key] = self.loader.context(self.engine(name), profile, self.device.stream)
            self.bound[key] = {}
        return self.contexts[key]

    def prepare(self, nextn, greedy, tree=None):
        if tree and tree not in self.em.engines:
            raise MtpTrtError(f"{self.root}: no {tree}.engine (engines.json lists {', '.join(self.em.engines)}); "
                              f"build engines of an export made with --trees {tree_spec(tree)}")
        for name in self.graphs_for(nextn, greedy, tree):
            self.engine(name)
        self.sampling = not greedy

    # ---------------------------------------------------------------------------- allocation
    def allocate(self, batch: int, rows: int) -> None:
        m = self.manifest
        if rows > self.em.raw["max_seq_len"]:
            raise MtpTrtError(f"{self.root}: {rows} cache rows per sequence needed, but the engines were built for "
                              f"--max-seq-len {self.em.raw['max_seq_len']}")
        if batch > self.em.raw["max_batch"]:
            raise MtpTrtError(f"{self.root}: {batch} sequences, but the engines were built for --max-batch "
                              f"{self.em.raw['max_batch']}")
        if self.shape_key == (batch, rows, self.sampling):
            return  # the same caches serve the next decode: lengths start at 0 again
        self.release()
        ios, s_max = list(self.ios.values()), max(self.max_s, m.nextn + 1)
        sizes = plan.buffer_sizes(ios, batch, rows, s_max)
        offsets = {j for js in self.offsets.values() for j in js}
        sizes |= {past_len_minus(j): 4 * batch for j in offsets}  # vanilla step commits at past_len - j (onnx)
        read = READ_OUTPUTS | (set(C.SAMPLED_OUTPUTS) if self.sampling else set())
        self.out_at, out_bytes = plan.output_layout(ios, batch, rows, s_max)
        self.host_at, host_bytes = plan.output_layout(ios, batch, rows, s_max, read)
        slot = rows * m.config.cache_dim * self.itemsize
        activations = plan.activation_bytes(
            {(n, p): self.loader.activation_bytes(e) for n, e in self.engines.items()
             for p in range(len(self.em.profiles))}, set(self.contexts))
        need = plan.cache_bytes(m, batch, rows) + sum(sizes.values()) + out_bytes + slot + activations
        if problem := plan.memory_problem(need, self.device.mem_info()[0]):
            raise MtpTrtError(problem)
        self.caches = {fam: [self.device.malloc(batch * slot) for _ in range(count)]
                       for fam, count in plan.cache_families(m).items()}
        self.buffers = {name: Buffer(self.device, n) for name, n in sizes.items()}
        self.out_dev = self.device.malloc(out_bytes)
        self.out_host_ptr, self.out_host = self.device.malloc_host(host_bytes)
        self.scratch = self.device.malloc(slot)  # swap_slots
        self.shape_key, self.rows, self.slot_bytes = (batch, rows, self.sampling), rows, slot

    def release(self) -> None:
        """Free the caches and buffers (the captured CUDA graphs use their addresses: dropped too)."""
        for exe in self.captured.values():
            self.device.destroy_graph(exe)
        self.captured, self.last_run = {}, {}
        for bufs in self.caches.values():
            for p in bufs:
                self.device.free(p)
        for b in self.buffers.values():
            self.device.free(b.dev)
            self.device.free_host(b.host_ptr)
        if self.shape_key is not None:
            self.device.free(self.scratch)
            self.device.free(self.out_dev)
            self.device.free_host(self.out_host_ptr)
        self.caches, self.buffers, self.shape_key = {}, {}, None
        for bound in self.bound.values():
            bound.clear()

    def _commit_offsets(self, io: plan.EngineIO) -> list[int]:
        """j > 0 where a cache's rows are committed at past_len - j (vanilla step depths, onnx lowering)."""
        if self.lowering != "onnx":
            return []
        return sorted({-C.cache_slot(k).offset for k in io.kv_inputs if k != C.MTP_GRAPH_KV} - {0})

    # --------------------------------------------------------------------------------- calls
    def _bind(self, key, ctx, io: plan.EngineIO, dims: dict, family: str) -> None:
        """Shapes and addresses of every tensor of a call (TensorRT calls only where they changed)."""
        bound = self.bound[key]

        def put(what, name, value, fn):
            if bound.get((what, name)) != value:
                if not fn(name, value):
                    raise MtpTrtError(f"{io.name}.engine: TensorRT refused {what} {value} for tensor {name!r}")
                bound[(what, name)] = value

        addr = {}
        for t in io.inputs:
            slot = C.cache_slot(t.name, family) if t.name in io.kv_inputs else None
            addr[t.name] = self.caches[slot.family][slot.index] if slot else self.buffers[t.name].dev
            put("shape", t.name, plan.shape(t, dims), ctx.set_input_shape)
            put("address", t.name, addr[t.name], ctx.set_tensor_address)
        for t in io.outputs:
            put("address", t.name, addr[io.aliases[t.name]] if t.name in io.aliases else self.output(io.name, t.name),
                ctx.set_tensor_address)

    def output(self, engine: str, name: str) -> int:
        """Device address of an engine's (non-aliased) output in the shared region."""
        return self.out_dev + self.out_at[engine][name]

    def _enqueue(self, ctx, io: plan.EngineIO, staged: dict[str, int], dims: dict, family: str,
                 fetch: list[str]) -> None:
        """Everything one call puts on the stream: input copies, the engine, the commits (onnx lowering), the
        copies of the fetched outputs."""
        dev = self.device
        for name, n in staged.items():
            dev.copy("h2d", self.buffers[name].dev, self.buffers[name].host_ptr, n)
        mark = self.loader.mark()
        if not ctx.execute_async_v3(dev.stream):
            raise MtpTrtError(f"{io.name}.engine: TensorRT could not enqueue the engine: "
                              f"{self.loader.messages(mark) or 'no message from TensorRT'}")
        for cache, new in io.commits.items():
            slot = C.cache_slot(cache, family)
            s_new = plan.shape(io.specs[new], dims)[1]
            lens = self.buffers[C.PAST_LEN if slot.offset == 0 else past_len_minus(-slot.offset)].dev
            self.kernels.mla_kv_commit(C.dtype(self.manifest.dtype).kernel, self.caches[slot.family][slot.index], lens,
                                       self.output(io.name, new), dims["B"], s_new, self.manifest.config.cache_dim,
                                       self.rows, dev.stream)
        for name in fetch:
            dev.copy("d2h", self.out_host_ptr + self.host_at[io.name][name], self.output(io.name, name),
                     plan.nbytes(io.specs[name], dims))

    def run(self, graph, n, feed, fetch, family=C.mtp_family(0), replay=False):
        """Stages the inputs, binds the call's shapes and addresses, and enqueues it: eagerly, or (replay) captured
        into a CUDA graph and replayed (the module docstring)."""
        io = self.ios[graph]
        s = next(feed[k].shape[1] for k in (C.INPUT_IDS, C.NEXT_TOKENS) if k in feed)
        profile = plan.choose_profile(self.em.profiles, s, n)
        ctx = self.context(graph, profile)
        dims = {"B": n, "S": s, "T": self.rows}
        past_len = feed[C.PAST_LEN]
        for j in self.offsets[graph]:
            feed = feed | {past_len_minus(j): (past_len - j).astype(np.int32)}
        wanted = {t.name for t in io.data_inputs} | {past_len_minus(j) for j in self.offsets[graph]}
        staged = {k: self.buffers[k].stage(v) for k, v in feed.items() if k in wanted and v is not None}
        if missing := [k for k in fetch if k not in self.host_at[graph]]:
            raise MtpTrtError(f"internal: {graph}.engine's {', '.join(missing)} read, but prepare() was told the decode "
                              f"is greedy")
        key, ctx_key = (graph, n, s), (graph, profile)
        self._bind(ctx_key, ctx, io, dims, family)  # replays too: the context's shapes as at capture
        if replay and key in self.captured:
            self.device.launch(self.captured[key])
        else:
            # capture only right after an eager run of these shapes on this context: the first enqueue after a
            # shape change may do set-up work that a CUDA graph cannot hold
            capture = replay and self.cuda_graphs and self.last_run.get(ctx_key) == key
            if capture:
                self.device.begin_capture()
                try:
                    self._enqueue(ctx, io, staged, dims, family, fetch)
                    self.captured[key] = self.device.end_capture()
                except BaseException:
                    self.device.abort_capture()
                    raise
                self.device.launch(self.captured[key])
            else:
                self._enqueue(ctx, io, staged, dims, family, fetch)
        self.last_run[ctx_key] = key  # the context's shapes are this call's now, and have run
        self.device.sync()
        return {k: self._read(graph, k, dims) for k in fetch}

    def _read(self, engine: str, name: str, dims: dict) -> np.ndarray:
        spec = self.ios[engine].specs[name]
        shape, at = plan.shape(spec, dims), self.host_at[engine][name]
        n = plan.nbytes(spec, dims)
        return self.out_host[at:at + n].view(C.dtype(spec.dtype).host).reshape(shape).copy()

    # ------------------------------------------------------------------------------- Backend
    def has_graph(self, graph):
        return graph in self.em.engines

    def swap_slots(self, i, j):
        for bufs in self.caches.values():
            for base in bufs:
                a, b = base + i * self.slot_bytes, base + j * self.slot_bytes
                self.device.copy("d2d", self.scratch, a, self.slot_bytes)
                self.device.copy("d2d", a, b, self.slot_bytes)
                self.device.copy("d2d", b, self.scratch, self.slot_bytes)


def past_len_minus(j: int) -> str:
    """The staging buffer of past_len - j: where a vanilla step's depth j + 1 commits (onnx lowering)."""
    return f"{C.PAST_LEN}_minus{j}"
