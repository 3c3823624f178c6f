"""One thin layer over the two TensorRT flavours: `tensorrt` (data-centre GPUs) and TensorRT for RTX.

`load(flavour)` imports one and returns a `TrtApi`; everything flavour-specific the builder needs
goes through it: which target architectures can be built and how to ask for them, the network
flags, the logger.  `auto` picks `tensorrt` when it is importable and usable (it builds only for
the GPU it runs on, so a GPU must be present), else `tensorrt_rtx` (which also builds on a machine
without a GPU, for the compute capabilities it lists).  Importing this module imports neither.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib
import importlib.util
import re
from pathlib import Path
from types import ModuleType

from mtp_trt.errors import MtpTrtError

FLAVOURS = ("tensorrt", "tensorrt_rtx")
INSTALL = {
    "tensorrt": "pip install tensorrt cuda-python",
    "tensorrt_rtx": "pip install tensorrt-rtx-cu13-libs tensorrt-rtx-cu13-bindings tensorrt_rtx_cu13",
}
WHERE = {"tensorrt": "builds on an NVIDIA GPU", "tensorrt_rtx": "TensorRT for RTX, builds without a GPU too"}
MIN_DEFAULT_ARCH = (8, 0)  # no GPU + TensorRT for RTX: build for every listed arch from Ampere on
# The versions each flavour is supported at: [first, end).  TensorRT 10.3 brought aliased plugin I/O (the plugin
# lowering's in-place caches); TensorRT for RTX has had it from 1.0.
SUPPORTED = {"tensorrt": ((10, 3), (12, 0)), "tensorrt_rtx": ((1, 0), (2, 0))}


def version_problem(flavour: str, version: str) -> str | None:
    """Why `flavour` at `version` is not supported (one line naming the supported range), or None."""
    (lo, hi) = SUPPORTED[flavour]
    m = re.match(r"(\d+)\.(\d+)", version)
    if m and lo <= (int(m.group(1)), int(m.group(2))) < hi:
        return None
    return (f"{flavour} {version} is not supported: mtp-trt runs {flavour} {lo[0]}.{lo[1]} to {hi[0] - 1}.x; "
            f"install a version in that range")


def install_hint() -> str:
    return "; ".join(f"{f} ({WHERE[f]}): `{cmd}`" for f, cmd in INSTALL.items())


# ------------------------------------------------------------------------------------------ GPU
@functools.cache
def gpu() -> tuple[str | None, str]:
    """(compute capability "8.9" of device 0, or None; why not) through the CUDA driver, no toolkit."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None, "no NVIDIA driver (libcuda.so.1 cannot be loaded)"
    n, major, minor, dev = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
    if cuda.cuInit(0) != 0:
        return None, "the NVIDIA driver found no usable GPU (cuInit failed)"
    if cuda.cuDeviceGetCount(ctypes.byref(n)) != 0 or n.value == 0:
        return None, "no GPU is visible to the CUDA driver"
    cuda.cuDeviceGet(ctypes.byref(dev), 0)
    cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
    return f"{major.value}.{minor.value}", ""


# ------------------------------------------------------------------------------------- archs
def parse_arch(spec: str) -> str:
    """'8.9' / '89' / 'sm_89' / 'SM120' / '12.0' / 'sm_90a' -> '8.9', '12.0', '9.0'."""
    a = spec.strip().lower()
    a = re.sub(r"^(sm_?|compute_)", "", a)
    m = re.fullmatch(r"(\d+)\.(\d)", a) or re.fullmatch(r"(\d+)(\d)[af]?", a)
    if not m or not 1 <= int(m.group(1)) <= 99:
        raise MtpTrtError(f"--target-arch: {spec!r} is not a compute capability (e.g. 8.9, sm_89, 12.0)")
    return f"{int(m.group(1))}.{m.group(2)}"


def _arch_key(a: str) -> tuple[int, int]:
    major, minor = a.split(".")
    return int(major), int(minor)


# ---------------------------------------------------------------------------------- flavours
@dataclasses.dataclass
class TrtApi:
    flavour: str
    trt: ModuleType
    version: str
    module: str  # the imported module's name
    libfix: str = ""  # what was done about libtensorrt_rtx.so (TensorRT for RTX)

    @property
    def is_rtx(self) -> bool:
        return self.flavour == "tensorrt_rtx"

    def buildable_archs(self) -> list[str]:
        """Compute capabilities this flavour can build for on this machine."""
        if self.is_rtx:
            names = [n for n in self.trt.ComputeCapability.__members__ if re.fullmatch(r"SM\d+", n)]
            return sorted((parse_arch(n) for n in names), key=_arch_key)
        cc, _ = gpu()
        return [cc] if cc else []

    def resolve_archs(self, spec: str | None) -> list[str]:
        """--target-arch (comma-separated; 'auto', 'native', 'all' or compute capabilities) -> the
        concrete list recorded in the manifest ('native' resolves to the GPU's, e.g. '8.9').  The
        tensorrt flavour also takes 'ampere+' (hardware-compatible engine, TensorRT's own level)."""
        cc, why = gpu()
        items = [s.strip() for s in (spec or "auto").split(",") if s.strip()] or ["auto"]
        can = self.buildable_archs()
        out: list[str] = []
        for item in items:
            low = item.lower()
            if low == "auto":
                if not self.is_rtx or cc in can:
                    low = "native"
                else:
                    out += [a for a in can if _arch_key(a) >= MIN_DEFAULT_ARCH]
                    continue
            if low in ("native", "current"):
                if not cc:
                    raise MtpTrtError(f"--target-arch {item}: {why}; name the compute capabilities to build for "
                                      f"({self.flavour} can build for {', '.join(can) or 'none here'})")
                if cc not in can:
                    raise MtpTrtError(f"--target-arch {item}: this GPU has compute capability {cc}, which "
                                      f"{self.flavour} {self.version} cannot build for (it can: {', '.join(can)})")
                out.append(cc)
            elif low == "all" and self.is_rtx:
                out += can
            elif low in ("ampere+", "ampere_plus") and not self.is_rtx:
                out.append("ampere+")
            else:
                a = parse_arch(item)
                if a not in can:
                    extra = ("; it builds only for the GPU it runs on — use --flavour tensorrt_rtx to build for "
                             "other architectures" if not self.is_rtx else "")
                    raise MtpTrtError(f"--target-arch {item}: {self.flavour} {self.version} cannot build for compute "
                                      f"capability {a} (it can: {', '.join(can) or 'none on this machine'}){extra}")
                out.append(a)
        return list(dict.fromkeys(out))

    def set_targets(self, config, archs: list[str]) -> None:
        """Point a builder config at the resolved architectures."""
        trt = self.trt
        if self.is_rtx:
            cc, _ = gpu()
            if archs == [cc]:
                values = [trt.ComputeCapability.CURRENT]  # never without a GPU: TensorRT for RTX aborts then
            else:
                values = [getattr(trt.ComputeCapability, "SM" + a.replace(".", "")) for a in archs]
            config.num_compute_capabilities = len(values)
            for i, v in enumerate(values):
                if not config.set_compute_capability(v, i):
                    raise MtpTrtError(f"{self.flavour} refused target compute capability {archs[i]}")
        elif archs == ["ampere+"]:
            config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
        elif len(archs) != 1:
            raise MtpTrtError("the tensorrt flavour builds for one target: native or ampere+")

    def enable_aliased_plugin_io(self, config) -> None:
        """Let plugins declare outputs aliased to inputs (MlaGenerationAttention's in-place cache): a preview
        feature from TensorRT 10.3 (ALIASED_PLUGIN_IO_10_03); versions that no longer list it have it on."""
        feature = getattr(self.trt.PreviewFeature, "ALIASED_PLUGIN_IO_10_03", None)
        if feature is not None:
            config.set_preview_feature(feature, True)

    def network_flags(self) -> int:
        flag = getattr(self.trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
        return 0 if flag is None else 1 << int(flag)

    def make_logger(self, sink):
        """A trt.ILogger passing (severity name, message) to sink for INFO and above."""
        trt = self.trt

        class Logger(trt.ILogger):
            def __init__(self):
                trt.ILogger.__init__(self)

            def log(self, severity, msg):
                if int(severity) <= int(trt.ILogger.Severity.INFO):
                    sink(severity.name, msg)

        return Logger()


def _rtx_libdir() -> Path | None:
    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _import(flavour: str) -> tuple[TrtApi | None, str]:
    names = ("tensorrt",) if flavour == "tensorrt" else ("tensorrt_rtx", "tensorrt_rtx_bindings")
    why = "not installed"
    for name in names:
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except (ImportError, ValueError, AttributeError):  # e.g. a module entry set to None
            continue
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a broken or stub install: say what happened
            why = f"`import {name}` failed ({type(e).__name__}: {e})"
            continue
        if not hasattr(mod, "Builder") or not hasattr(mod, "OnnxParser"):
            why = f"`{name}` is installed but is not a usable TensorRT (no Builder/OnnxParser: a stub package?)"
            continue
        api = TrtApi(flavour=flavour, trt=mod, version=str(getattr(mod, "__version__", "?")), module=name)
        if problem := version_problem(flavour, api.version):
            why = problem
            continue
        if flavour == "tensorrt_rtx" and (libdir := _rtx_libdir()) is not None:
            from mtp_trt.trt.libfix import ensure_unversioned_rtx_library

            api.libfix = ensure_unversioned_rtx_library(libdir)
        return api, ""
    return None, why


@functools.cache
def load(flavour: str = "auto") -> TrtApi:
    """Import a TensorRT flavour: 'auto', 'tensorrt' or 'tensorrt_rtx'.  Raises MtpTrtError with the
    install command of each flavour when none can be used."""
    if flavour not in ("auto", *FLAVOURS):
        raise MtpTrtError(f"--flavour: unknown flavour {flavour!r}; expected auto, {', '.join(FLAVOURS)}")
    problems = []
    for f in (FLAVOURS if flavour == "auto" else (flavour,)):
        api, why = _import(f)
        if api is None:
            problems.append(f"{f}: {why}")
            continue
        if f == "tensorrt" and gpu()[0] is None:
            if flavour == "auto":
                problems.append(f"tensorrt {api.version}: installed, but it builds only on a GPU ({gpu()[1]})")
                continue
            raise MtpTrtError(f"--flavour tensorrt: TensorRT {api.version} builds engines only for the GPU it runs "
                              f"on, and {gpu()[1]}; use --flavour tensorrt_rtx (builds without a GPU)")
        return api
    raise MtpTrtError(f"no usable TensorRT ({'; '.join(problems)}); install one — {install_hint()}")
