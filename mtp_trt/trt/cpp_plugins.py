"""The C++ plugins (libmtp_trt_plugins.so, plugins/cpp) from Python: find, load, choose.

The C++ library and the Python plugins (plugins/trt_plugins.py) implement the same two ops under
the same names, version and namespace, so a TensorRT plugin registry can hold only one of them at
a time; `use(trt, "cpp" | "python" | "auto")` makes the chosen one the registered one (switching
back and forth within a process) and returns which it is.  "auto" is the C++ library where it is
built and loads, else Python.

The library is looked for in `$MTP_TRT_PLUGIN_LIB`, then the CMake build folder
`plugins/cpp/build/`, then the cache (`mtp_trt.fsutil.cache_dir("plugins")`).  Build it with
`cmake -S plugins/cpp -B plugins/cpp/build -DTensorRT_ROOT=... && cmake --build plugins/cpp/build`
(docs/tensorrt.md, "Use the engines from C++").
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

from mtp_trt import ops
from mtp_trt.errors import MtpTrtError
from mtp_trt.fsutil import cache_dir

LIB_NAME = "libmtp_trt_plugins.so"
ENV = "MTP_TRT_PLUGIN_LIB"
BUILD_DIR = Path(__file__).resolve().parents[2] / "plugins" / "cpp" / "build"
IMPLEMENTATIONS = ("auto", "cpp", "python")
DESCRIPTIONS = {"cpp": f"{LIB_NAME} (C++ IPluginV3)", "python": "mtp_trt.plugins.trt_plugins (Python IPluginV3)"}


def candidates() -> list[Path]:
    """Where the library is looked for, in order."""
    env = os.environ.get(ENV)
    return ([Path(env)] if env else []) + [BUILD_DIR / LIB_NAME, cache_dir("plugins") / LIB_NAME]


def find_library() -> Path | None:
    """The first existing candidate; a set $MTP_TRT_PLUGIN_LIB that does not exist is an error."""
    env = os.environ.get(ENV)
    if env and not Path(env).is_file():
        raise MtpTrtError(f"${ENV}={env}: no such file")
    return next((p for p in candidates() if p.is_file()), None)


def require_library() -> Path:
    path = find_library()
    if path is None:
        where = ", ".join(str(p) for p in candidates())
        raise MtpTrtError(f"the C++ plugin library {LIB_NAME} is not built (looked in {where}); build it with "
                          f"`cmake -S plugins/cpp -B plugins/cpp/build -DTensorRT_ROOT=<TensorRT> && cmake --build "
                          f"plugins/cpp/build -j` (docs/tensorrt.md), set ${ENV}, or use --plugins python")
    return path


def _creator(registry, name: str):
    return registry.get_creator(name, str(ops.VERSION), "")


def _python_creators(trt) -> dict[str, object]:
    from mtp_trt.plugins import trt_plugins

    return {c.name: c for c in trt_plugins.register(trt)}  # registers them the first time


def _is_python(trt, creator) -> bool:
    from mtp_trt.plugins import trt_plugins

    return any(isinstance(creator, cls) for _, cls in trt_plugins.plugin_classes(trt).values())


class _Loaded:
    """The C++ library's state in one TensorRT module's registry: the handle of the loaded library
    (None when not loaded) and its path.  TensorRT deregisters a library's creators only all
    together, through that handle (IPluginRegistry.deregister_library).  `pinned` keeps every
    library loaded once mapped (a ctypes reference), so plugin objects that outlive a switch back to
    Python never point into unmapped code."""

    def __init__(self):
        self.handle = None
        self.path: str | None = None
        self.pinned: dict[str, ctypes.CDLL] = {}


@functools.cache
def _state(trt) -> _Loaded:
    return _Loaded()


def load(trt, path: str | Path | None = None) -> str:
    """Load the C++ library (found as above unless `path` is given) into trt's plugin registry as
    the registered implementation (the Python creators, if registered, are deregistered first:
    loadLibrary refuses duplicates).  Returns the library's path."""
    path = str(Path(path).resolve() if path else require_library().resolve())
    state, registry = _state(trt), trt.get_plugin_registry()
    if state.handle is not None and state.path == path:
        return path
    _unload(trt)
    for name in ops.OPS:
        existing = _creator(registry, name)
        if existing is not None and _is_python(trt, existing):
            registry.deregister_creator(existing)
    try:
        state.pinned.setdefault(path, ctypes.CDLL(path))
    except OSError as e:
        raise MtpTrtError(f"{path}: cannot load the plugin library ({e})") from None
    handle = registry.load_library(path)
    if handle is None:
        raise MtpTrtError(f"{path}: {trt.__name__} {trt.__version__} could not load the plugin library (built against "
                          f"another TensorRT? plugins of the same name registered by someone else?)")
    state.handle, state.path = handle, path
    missing = [n for n in ops.OPS if _creator(registry, n) is None]
    if missing:
        _unload(trt)
        raise MtpTrtError(f"{path}: the library has no creator for {', '.join(missing)} version {ops.VERSION}")
    return path


def _unload(trt) -> None:
    state = _state(trt)
    if state.handle is not None:
        trt.get_plugin_registry().deregister_library(state.handle)
        state.handle = state.path = None


def use(trt, implementation: str = "auto") -> str:
    """Make `implementation`'s creators the registered ones; returns "cpp" or "python"."""
    if implementation not in IMPLEMENTATIONS:
        raise MtpTrtError(f"--plugins must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}")
    if implementation == "auto":
        if find_library() is None:
            return use(trt, "python")
        try:
            load(trt)
            return "cpp"
        except MtpTrtError:
            return use(trt, "python")
    if implementation == "cpp":
        load(trt)
        return "cpp"
    _unload(trt)
    registry = trt.get_plugin_registry()
    for name, creator in _python_creators(trt).items():
        existing = _creator(registry, name)
        if existing is None and not registry.register_creator(creator, ""):
            raise MtpTrtError(f"TensorRT refused to register the Python {name} plugin creator")
        if existing is not None and not _is_python(trt, existing):
            raise MtpTrtError(f"a {name} plugin creator not from mtp-trt is registered; cannot use the Python plugins")
    return "python"


def plugin_identity(trt, plugin) -> tuple[str, str, str] | None:
    """(name, version, namespace) of a network layer's plugin object, Python or C++."""
    name = getattr(plugin, "plugin_name", None)  # a Python plugin object
    if name is not None:
        return name, plugin.plugin_version, plugin.plugin_namespace
    try:
        core = plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
        return core.plugin_name, core.plugin_version, core.plugin_namespace
    except Exception:  # noqa: BLE001 - not an IPluginV3 with a core capability
        return None


def is_ours(trt, plugin, op_name: str) -> bool:
    """Whether a network layer's plugin object is mtp-trt's plugin for op_name: a Python plugin of
    plugins/trt_plugins.py, or a C++ one with our name, version and namespace (only our library
    registers C++ creators under them: loadLibrary refuses duplicates)."""
    if getattr(plugin, "plugin_name", None) is not None:
        from mtp_trt.plugins import trt_plugins

        return trt_plugins.is_ours(trt, plugin, op_name)
    return plugin_identity(trt, plugin) == (op_name, str(ops.VERSION), "")
