"""mtp-trt: DeepSeek-V3/R1-style Multi-Token Prediction speculative decoding on ONNX and TensorRT.

Importing this package never imports torch or TensorRT; `mtp_trt.exporters` (torch) and the
TensorRT parts of `mtp_trt.plugins` are imported lazily by the commands that need them.
"""

__version__ = "0.1.0"


def _checkout_subpackages() -> None:
    """In a checkout, mtp_trt.exporters and mtp_trt.plugins are the top-level folders exporters/ and plugins/
    (pyproject.toml maps them when installing).  Where this package is imported from the checkout itself (run from
    its root, installed or not), let those names resolve there too."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if (root / "plugins" / "cuda_lib.py").is_file() and (root / "exporters" / "export.py").is_file() and \
            not (Path(__file__).parent / "plugins").exists():
        __path__.append(str(root))  # noqa: F821 - the package's own search path


_checkout_subpackages()
