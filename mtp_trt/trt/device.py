"""The CUDA device layer of the TensorRT runtime: device and pinned host memory, one stream, asynchronous
copies, CUDA-graph capture and replay, through cuda-python's runtime bindings (`cuda.bindings.runtime`).

Kept thin on purpose: every call is one CUDA runtime call and a status check.  `counts` records each
allocation and copy (number and bytes by kind), so tests can assert that a decode step allocates nothing
and copies no cache-sized data.  tests/trt_fakes.py has a host-memory stand-in with the same interface.
"""

from __future__ import annotations

import collections
import ctypes

import numpy as np

from mtp_trt.errors import MtpTrtError


class CudaError(MtpTrtError):
    """A CUDA runtime call failed."""


def _cudart():
    from mtp_trt.plugins.cuda_lib import import_cudart

    return import_cudart()


class Device:
    """GPU `index` with one non-blocking stream (the handle TensorRT and the kernels are given: `stream`)."""

    def __init__(self, index: int = 0):
        self.rt = rt = _cudart()
        self._check("cudaSetDevice", rt.cudaSetDevice(index))
        self.stream_obj = self._check("cudaStreamCreateWithFlags", rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking))
        self.stream = int(self.stream_obj)
        prop = self._check("cudaGetDeviceProperties", rt.cudaGetDeviceProperties(index))
        self.name = prop.name.decode(errors="replace").rstrip("\0") if isinstance(prop.name, bytes) else str(prop.name)
        self.counts: collections.Counter = collections.Counter()
        self._kinds = {"h2d": rt.cudaMemcpyKind.cudaMemcpyHostToDevice, "d2h": rt.cudaMemcpyKind.cudaMemcpyDeviceToHost,
                       "d2d": rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice}

    def _check(self, what: str, result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            msg = self.rt.cudaGetErrorString(err)[1]
            raise CudaError(f"{what}: CUDA error {int(err)} ({msg.decode() if isinstance(msg, bytes) else msg})")
        return rest[0] if len(rest) == 1 else tuple(rest) if rest else None

    # ---- memory
    def malloc(self, nbytes: int) -> int:
        self.counts["alloc"] += 1
        self.counts["alloc_bytes"] += nbytes
        return int(self._check("cudaMalloc", self.rt.cudaMalloc(max(nbytes, 1))))

    def free(self, ptr: int) -> None:
        self._check("cudaFree", self.rt.cudaFree(ptr))

    def malloc_host(self, nbytes: int) -> tuple[int, np.ndarray]:
        """Pinned host memory: (address, a uint8 NumPy view of it)."""
        self.counts["alloc_host"] += 1
        ptr = int(self._check("cudaMallocHost", self.rt.cudaMallocHost(max(nbytes, 1))))
        return ptr, np.frombuffer((ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr), np.uint8)

    def free_host(self, ptr: int) -> None:
        self._check("cudaFreeHost", self.rt.cudaFreeHost(ptr))

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        return self._check("cudaMemGetInfo", self.rt.cudaMemGetInfo())

    # ---- copies (asynchronous, on the stream)
    def copy(self, kind: str, dst: int, src: int, nbytes: int) -> None:
        if nbytes:
            self.counts[kind] += 1
            self.counts[kind + "_bytes"] += nbytes
            self._check("cudaMemcpyAsync", self.rt.cudaMemcpyAsync(dst, src, nbytes, self._kinds[kind], self.stream))

    def sync(self) -> None:
        self._check("cudaStreamSynchronize", self.rt.cudaStreamSynchronize(self.stream))

    # ---- CUDA graphs
    def begin_capture(self) -> None:
        mode = self.rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        self._check("cudaStreamBeginCapture", self.rt.cudaStreamBeginCapture(self.stream, mode))

    def end_capture(self):
        """-> an executable graph of everything enqueued on the stream since begin_capture."""
        graph = self._check("cudaStreamEndCapture", self.rt.cudaStreamEndCapture(self.stream))
        exe = self._check("cudaGraphInstantiate", self.rt.cudaGraphInstantiate(graph, 0))
        self._check("cudaGraphDestroy", self.rt.cudaGraphDestroy(graph))
        self.counts["graphs"] += 1
        return exe

    def abort_capture(self) -> None:
        """End a capture that failed midway (the partial graph is dropped)."""
        err, graph = self.rt.cudaStreamEndCapture(self.stream)
        if int(err) == 0 and graph:
            self.rt.cudaGraphDestroy(graph)

    def launch(self, exe) -> None:
        self.counts["graph_launches"] += 1
        self._check("cudaGraphLaunch", self.rt.cudaGraphLaunch(exe, self.stream))

    def destroy_graph(self, exe) -> None:
        self._check("cudaGraphExecDestroy", self.rt.cudaGraphExecDestroy(exe))
