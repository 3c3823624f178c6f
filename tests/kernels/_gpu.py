"""Device-memory helpers for the GPU kernel tests (cuda-python runtime API), and host-side
storage conversions for float32 / float16 / bfloat16 tensors."""

from __future__ import annotations

import numpy as np

from mtp_trt.plugins import reference as ref

ESIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def to_storage(x, dtype: str):
    """float values -> (host array in the kernel's storage format, float32 values it represents)."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        s = np.ascontiguousarray(x)
        return s, s
    if dtype == "float16":
        s = np.ascontiguousarray(x.astype(np.float16))
        return s, s.astype(np.float32)
    if dtype == "bfloat16":
        s = ref.f32_to_bf16_bits(x)
        return s, ref.bf16_bits_to_f32(s)
    raise ValueError(dtype)


def storage_dtype(dtype: str):
    return {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[dtype]


def from_storage(a, dtype: str) -> np.ndarray:
    a = np.asarray(a)
    if dtype == "bfloat16":
        return ref.bf16_bits_to_f32(a.view(np.uint16))
    return a.astype(np.float32)


class Gpu:
    """cudaMalloc'd buffers freed together; every runtime call checked."""

    def __init__(self, cudart):
        self.rt = cudart
        self.ptrs: list[int] = []

    def check(self, res, what: str):
        err = res[0] if isinstance(res, tuple) else res
        if int(err) != 0:
            name = self.rt.cudaGetErrorString(err)[1] if hasattr(self.rt, "cudaGetErrorString") else ""
            raise AssertionError(f"{what} failed: {err} {name!r}")
        if isinstance(res, tuple) and len(res) == 2:
            return res[1]
        return None

    def alloc(self, nbytes: int) -> int:
        ptr = int(self.check(self.rt.cudaMalloc(max(int(nbytes), 1)), "cudaMalloc"))
        self.ptrs.append(ptr)
        return ptr

    def upload(self, arr) -> int:
        arr = np.ascontiguousarray(arr)
        ptr = self.alloc(arr.nbytes)
        if arr.nbytes:
            self.check(self.rt.cudaMemcpy(ptr, arr.ctypes.data, arr.nbytes,
                                          self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice), "cudaMemcpy H2D")
        return ptr

    def download(self, ptr: int, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        if out.nbytes:
            self.check(self.rt.cudaMemcpy(out.ctypes.data, ptr, out.nbytes,
                                          self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost), "cudaMemcpy D2H")
        return out

    def poison(self, ptr: int, nbytes: int, byte: int) -> None:
        """Fill with `byte`: 0xFF makes every float16/bfloat16/float32 a NaN; 0x7F makes int32
        0x7F7F7F7F (never a valid token, count or flag)."""
        if nbytes:
            self.check(self.rt.cudaMemset(ptr, byte, nbytes), "cudaMemset")

    def sync(self, what: str = "kernel") -> None:
        self.check(self.rt.cudaDeviceSynchronize(), f"cudaDeviceSynchronize after {what}")
        self.check(self.rt.cudaGetLastError(), f"cudaGetLastError after {what}")

    def num_sms(self) -> int:
        dev = self.check(self.rt.cudaGetDevice(), "cudaGetDevice")
        return int(self.check(self.rt.cudaDeviceGetAttribute(
            self.rt.cudaDeviceAttr.cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute"))

    def free_all(self) -> None:
        for p in self.ptrs:
            self.rt.cudaFree(p)
        self.ptrs.clear()


class HostRuntime:
    """A stand-in for cuda-python's runtime over host memory (ctypes buffers), with the calls Gpu
    uses.  Lets the GPU tests drive the CPU emulation of the kernels (tests/kernels/emu)."""

    class cudaMemcpyKind:  # noqa: N801 - mirrors cuda-python
        cudaMemcpyHostToDevice = 1
        cudaMemcpyDeviceToHost = 2

    class cudaDeviceAttr:  # noqa: N801
        cudaDevAttrMultiProcessorCount = 16

    def __init__(self, num_sms: int = 132):
        import ctypes

        self._ct = ctypes
        self._bufs: dict[int, object] = {}
        self._sms = num_sms

    def cudaMalloc(self, n):  # noqa: N802
        buf = self._ct.create_string_buffer(int(n))
        addr = self._ct.addressof(buf)
        self._bufs[addr] = buf
        return (0, addr)

    def cudaFree(self, p):  # noqa: N802
        self._bufs.pop(int(p), None)
        return (0,)

    def cudaMemcpy(self, dst, src, n, kind):  # noqa: N802
        self._ct.memmove(dst, src, n)
        return (0,)

    def cudaMemset(self, p, v, n):  # noqa: N802
        self._ct.memset(p, v, n)
        return (0,)

    def cudaDeviceSynchronize(self):  # noqa: N802
        return (0,)

    def cudaGetLastError(self):  # noqa: N802
        return (0,)

    def cudaGetDevice(self):  # noqa: N802
        return (0, 0)

    def cudaDeviceGetAttribute(self, attr, dev):  # noqa: N802
        return (0, self._sms)
