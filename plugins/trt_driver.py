"""The few CUDA driver calls the TensorRT plugins make around the kernels (ctypes on libcuda.so.1).

Loaded on first use, from a plugin's enqueue on a GPU machine; importing this module loads nothing.
All copies are asynchronous on TensorRT's stream; nothing here waits for it.
"""

from __future__ import annotations

import ctypes
import functools

from mtp_trt.errors import MtpTrtError

_MEMORYTYPE_DEVICE = 2


class _Memcpy2D(ctypes.Structure):  # CUDA_MEMCPY2D
    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]


class Driver:
    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise MtpTrtError(f"the TensorRT plugins need the NVIDIA driver (libcuda.so.1): {e}") from None
        u64, sz, vp = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
        sig = {
            "cuMemcpyDtoDAsync_v2": [u64, u64, sz, vp],
            "cuMemcpy2DAsync_v2": [ctypes.POINTER(_Memcpy2D), vp],
            "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        }
        for name, args in sig.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int

    def _check(self, name: str, code: int) -> None:
        if code != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(code, ctypes.byref(msg))
            raise MtpTrtError(f"{name}: CUDA driver error {code} ({(msg.value or b'?').decode()})")

    def copy_d2d(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        if nbytes:
            self._check("cuMemcpyDtoDAsync", self.lib.cuMemcpyDtoDAsync_v2(dst, src, nbytes, stream or None))

    def copy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                stream: int) -> None:
        """Row-strided device-to-device copy of `height` rows of `width` bytes."""
        if not width or not height:
            return
        p = _Memcpy2D(srcMemoryType=_MEMORYTYPE_DEVICE, srcDevice=src, srcPitch=src_pitch,
                      dstMemoryType=_MEMORYTYPE_DEVICE, dstDevice=dst, dstPitch=dst_pitch,
                      WidthInBytes=width, Height=height)
        self._check("cuMemcpy2DAsync", self.lib.cuMemcpy2DAsync_v2(ctypes.byref(p), stream or None))


@functools.cache
def driver() -> Driver:
    return Driver()
