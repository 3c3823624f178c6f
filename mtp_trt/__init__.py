"""mtp-trt: DeepSeek-V3/R1-style Multi-Token Prediction speculative decoding on ONNX and TensorRT.

Importing this package never imports torch or TensorRT; `mtp_trt.exporters` (torch) and the
TensorRT parts of `mtp_trt.plugins` are imported lazily by the commands that need them.
"""

__version__ = "0.1.0"
