"""TensorRT engines for an mtp-trt export: flavour compatibility layer, builder, engine manifest, check.

`compat` imports TensorRT or TensorRT for RTX on demand; nothing here imports either at package
import time.  docs/tensorrt.md describes the commands and the engine directory.
"""
