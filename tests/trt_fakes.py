"""Host-memory stand-ins for the TensorRT runtime's GPU side, so TrtBackend (mtp_trt/trt/runtime.py) runs on a
CPU: a device whose "device memory" is host memory (same interface and counters as mtp_trt.trt.device.Device,
stream work recorded during a capture and replayed by a launch), engines that read their bound input addresses,
run the same graph's `onnx` lowering on ONNX Runtime and write their bound outputs (for `plugin`-lowering
engines they also write the new cache rows in place, as the attention plugin does), and the one kernel the
runtime launches itself (the KV commit)."""

from __future__ import annotations

import collections
import ctypes

import numpy as np

from mtp_trt import contract as C
from mtp_trt.contract import cache_slot
from mtp_trt.manifest import Manifest
from mtp_trt.plugins import ort_lib
from mtp_trt.trt import plan
from mtp_trt.trt.runtime import EngineLoader



def view(ptr: int, shape, dtype) -> np.ndarray:
    count = int(np.prod(shape))
    buf = (ctypes.c_char * max(count * np.dtype(dtype).itemsize, 1)).from_address(ptr)
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


class HostDevice:
    """Device's interface on host memory.  Work on the stream runs at once, or is recorded while capturing."""

    def __init__(self, free_bytes: int = 1 << 34):
        self.stream, self.name, self.free_bytes = 7, "host stand-in", free_bytes
        self.counts: collections.Counter = collections.Counter()
        self.copies: list[tuple[str, int]] = []  # (kind, bytes) of every copy
        self.memory: dict[int, np.ndarray] = {}
        self.capturing: list | None = None

    def work(self, fn) -> None:
        if self.capturing is not None:
            self.capturing.append(fn)
        else:
            fn()

    def malloc(self, nbytes):
        self.counts["alloc"] += 1
        self.counts["alloc_bytes"] += nbytes
        a = np.full(max(nbytes, 1), 0xAB, np.uint8)  # garbage, as cudaMalloc's memory may hold
        self.memory[a.ctypes.data] = a
        return a.ctypes.data

    def free(self, ptr):
        del self.memory[ptr]

    def malloc_host(self, nbytes):
        self.counts["alloc_host"] += 1
        a = np.zeros(max(nbytes, 1), np.uint8)
        self.memory[a.ctypes.data] = a
        return a.ctypes.data, a

    def free_host(self, ptr):
        del self.memory[ptr]

    def mem_info(self):
        return self.free_bytes, self.free_bytes

    def copy(self, kind, dst, src, nbytes):
        if nbytes:
            self.counts[kind] += 1
            self.counts[kind + "_bytes"] += nbytes
            self.copies.append((kind, nbytes))
            self.work(lambda: ctypes.memmove(dst, src, nbytes))

    def sync(self):
        assert self.capturing is None, "sync inside a capture"

    def begin_capture(self):
        assert self.capturing is None
        self.capturing = []

    def end_capture(self):
        graph, self.capturing = self.capturing, None
        self.counts["graphs"] += 1
        return graph

    def abort_capture(self):
        self.capturing = None

    def launch(self, graph):
        self.counts["graph_launches"] += 1
        for fn in graph:
            fn()

    def destroy_graph(self, graph):
        pass


class HostKernels:
    """mtp_mla_kv_commit on host memory: cache[b, len[b] + s] = rows[b, s] (rows past the buffer skipped)."""

    def __init__(self, device: HostDevice, dtype: str):
        self.device, self.dtype, self.calls = device, C.dtype(dtype).host, 0

    def mla_kv_commit(self, dtype, kv_cache, past_len, new_rows, B, S, D, T_max, stream=0):
        self.calls += 1

        def run():
            lens = view(past_len, (B,), np.int32)
            write_rows(view(kv_cache, (B, T_max, D), self.dtype), view(new_rows, (B, S, D), self.dtype), lens)

        self.device.work(run)


def write_rows(cache: np.ndarray, rows: np.ndarray, start: np.ndarray) -> None:
    for b in range(rows.shape[0]):
        for s in range(rows.shape[1]):
            if 0 <= start[b] + s < cache.shape[1]:
                cache[b, start[b] + s] = rows[b, s]


class FakeContext:
    """IExecutionContext's calls the runtime makes; execute runs the reference graph on ONNX Runtime.  As TensorRT
    requires, an enqueue captured into a CUDA graph must not be the first after a shape change (`captures_after_
    shape_change` counts those that were)."""

    def __init__(self, engine: FakeEngine):
        self.engine, self.shapes, self.addresses, self.executions = engine, {}, {}, 0
        self.reshaped, self.captures_after_shape_change = False, 0

    def set_input_shape(self, name, shape):
        self.reshaped |= self.shapes.get(name) != tuple(shape)
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, ptr):
        self.addresses[name] = ptr
        return True

    def execute_async_v3(self, stream):
        if self.engine.fail:  # (TensorRT's error line, the plugin's)
            self.engine.loader.errors.append(self.engine.fail[0])
            self.engine.loader.plugin_errors.append(self.engine.fail[1])
            return False
        self.captures_after_shape_change += self.reshaped and self.engine.device.capturing is not None
        self.reshaped = False
        shapes, addresses = dict(self.shapes), dict(self.addresses)  # as a captured graph keeps them
        self.engine.device.work(lambda: self.engine.run(shapes, addresses))
        self.executions += 1
        return True


class FakeEngine:
    def __init__(self, name: str, io: plan.EngineIO, reference: Manifest, device: HostDevice, lowering: str,
                 loader: FakeLoader):
        self.name, self.io, self.device, self.lowering, self.loader = name, io, device, lowering, loader
        self.ref = reference.graphs[name]
        self.session = ort_lib.session(str(reference.root / self.ref.file))
        self.fail: tuple[str, str] | None = None  # (TensorRT's error line, a plugin's): enqueues fail with them

    @property
    def device_memory_size_v2(self):
        return self.loader.activation_bytes_each

    def run(self, shapes: dict, addresses: dict) -> None:
        specs = self.io.specs
        feed = {n: view(addresses[n], shapes[n], C.dtype(specs[n].dtype).host).copy() for n in shapes}
        names = [o.name for o in self.session.get_outputs()]
        out = dict(zip(names, self.session.run(names, feed)))
        for name, value in out.items():
            if name in addresses:  # the data outputs, and new_kv_* of an onnx-lowering engine
                view(addresses[name], value.shape, value.dtype)[...] = value
        if self.lowering == "plugin":  # the attention plugin's in-place writes
            for cache, new in zip(self.ref.kv_inputs, self.ref.kv_outputs):
                assert addresses[cache + "_out"] == addresses[cache], "aliased output not bound to its input"
                start = feed["past_len"] + cache_slot(cache).offset
                rows = out[new]
                if cache in self.io.commits:  # a tree step: the path's rows are an output for the runtime to commit;
                    path = self.io.commits[cache]  # the plugin wrote the tree's nodes there, not the path: garbage
                    view(addresses[path], rows.shape, rows.dtype)[...] = rows  # here (finite: ONNX Runtime's masked
                    rows = np.full((rows.shape[0], feed["input_ids"].shape[1], rows.shape[2]), 1e3, rows.dtype)  # reads)
                write_rows(view(addresses[cache], shapes[cache], C.dtype(specs[cache].dtype).host), rows, start)


class FakeLoader(EngineLoader):
    """EngineLoader over FakeEngines (the onnx-lowering export `reference` of the same checkpoint); its error
    collection and activation-memory query are EngineLoader's own."""

    def __init__(self, ios: dict, reference: Manifest, device: HostDevice, lowering: str):
        self.ios, self.reference, self.device, self.lowering = ios, reference, device, lowering
        self.loaded: list[str] = []
        self.contexts: list[FakeContext] = []
        self.errors, self.plugin_errors = [], []
        self.activation_bytes_each = 1 << 20

    def load(self, path):
        name = path.stem
        self.loaded.append(name)
        return FakeEngine(name, self.ios[name], self.reference, self.device, self.lowering, self)

    def context(self, engine, profile, stream):
        self.contexts.append(FakeContext(engine))
        return self.contexts[-1]

    @staticmethod
    def aliases(engine):
        return dict(engine.io.aliases)


def fake_backend(engine_dir, reference: Manifest, cuda_graphs: bool = True, free_bytes: int = 1 << 34):
    """A TrtBackend over an engine directory whose engines run on the host (see the module docstring)."""
    from mtp_trt.trt import manifest as em
    from mtp_trt.trt.runtime import TrtBackend

    device = HostDevice(free_bytes)
    exp = em.load_export_manifest(engine_dir)
    ios = {n: plan.engine_io(exp.graphs[n], exp.lowering) for n in exp.graphs}
    loader = FakeLoader(ios, reference, device, exp.lowering)
    return TrtBackend(engine_dir, device=device, loader=loader, kernels=HostKernels(device, exp.dtype),
                      cuda_graphs=cuda_graphs)
