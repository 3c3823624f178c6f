"""Files written whole or not at all, JSON files read with one clear error (one reader, with limits, and typed
field checks), and the one cache directory of mtp-trt.

Directories are written through a hidden `.NAME.partial-XXXX` directory beside the output, renamed into
place when complete.  Its owner holds an exclusive `flock` on the sibling `.NAME.partial-XXXX.lock` for as
long as it lives, so a later process can tell an abandoned partial directory (its owner was killed) from a
live one and remove only the former (`remove_stale_partials`).  `locked(path)` serializes processes that
write the same cache entry, so concurrent `mtp-trt run`s share one export.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no advisory locks; partial directories are then never judged abandoned
    fcntl = None

PARTIAL = ".partial-"
LEGACY_PARTIAL_AGE_S = 600  # a partial directory without a lock file (older mtp-trt) is abandoned after this


def cache_dir(*parts: str) -> Path:
    """`$MTP_TRT_CACHE_DIR`, else `$XDG_CACHE_HOME/mtp-trt`, else `~/.cache/mtp-trt`, else (no home directory:
    `HOME` unset for a user without a passwd entry, as in some containers) `mtp-trt-UID` in the temporary
    directory; joined with parts."""
    root = os.environ.get("MTP_TRT_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME")
        if not base:
            try:
                base = Path.home() / ".cache"
            except (RuntimeError, KeyError):
                import tempfile

                return Path(tempfile.gettempdir(), f"mtp-trt-{os.getuid() if hasattr(os, 'getuid') else 0}",
                            *parts)
        root = Path(base) / "mtp-trt"
    return Path(root).joinpath(*parts)


# Limits of the one JSON reader: no file mtp-trt reads nests deeper or needs wider integers (a safetensors
# header's byte offsets, the widest, fit in 20 digits).
MAX_JSON_DEPTH = 64
MAX_JSON_INT_DIGITS = 20


class _JsonLimit(ValueError):
    pass


def _int_token(token: str) -> int:
    if len(token.lstrip("-")) > MAX_JSON_INT_DIGITS:
        raise _JsonLimit(token)
    return int(token)


def _depth_exceeded(obj) -> bool:
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                return True
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return False


def too_deep(source: str):
    """The error of a document nested beyond MAX_JSON_DEPTH levels."""
    from mtp_trt.errors import MtpTrtError

    return MtpTrtError(f"{source}: nested more than {MAX_JSON_DEPTH} levels deep, more than mtp-trt reads")


def check_json_limits(value, source: str):
    """`value` (parsed JSON or YAML) nests at most MAX_JSON_DEPTH levels; returns it."""
    if _depth_exceeded(value):
        raise too_deep(source)
    return value


def parse_json(data: bytes | str, source: str):
    """The one JSON reader: `data` parsed, with every problem an MtpTrtError naming `source` — not JSON, not
    UTF-8, nested more than MAX_JSON_DEPTH levels, an integer of more than MAX_JSON_INT_DIGITS digits.  Types
    of fields are checked by the caller (check_fields)."""
    from mtp_trt.errors import MtpTrtError

    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as e:
        raise MtpTrtError(f"{source}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    try:
        value = json.loads(text, parse_int=_int_token)
    except _JsonLimit as e:
        token = str(e)
        line = text[: max(text.find(token), 0)].count("\n") + 1
        raise MtpTrtError(f"{source}: an integer of {len(token.lstrip('-'))} digits on line {line}; at most "
                          f"{MAX_JSON_INT_DIGITS} are read") from None
    except json.JSONDecodeError as e:
        raise MtpTrtError(f"{source}: not valid JSON ({e})") from None
    except RecursionError:
        raise too_deep(source) from None
    return check_json_limits(value, source)


def read_json(path: Path, schema=None, source: str | None = None):
    """The parsed contents of a JSON file through parse_json (its limits), checked against `schema` (see
    check_fields) when given; every problem is an MtpTrtError naming the file (`source`, default the path)."""
    from mtp_trt.errors import MtpTrtError

    try:
        data = path.read_bytes()
    except OSError as e:
        raise MtpTrtError(f"{path}: cannot read ({e.strerror})") from None
    value = parse_json(data, source or str(path))
    if schema is not None:
        check_fields(value, schema, source or str(path))
    return value


# ---------------------------------------------------------------------------------------- typed fields
class Int:
    """An integer (not a bool) in lo..hi (either bound optional)."""

    def __init__(self, lo: int | None = None, hi: int | None = None):
        self.lo, self.hi = lo, hi

    def describe(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"an integer in {self.lo}..{self.hi}"
        return f"an integer >= {self.lo}" if self.lo is not None else \
            f"an integer <= {self.hi}" if self.hi is not None else "an integer"

    def problem(self, v) -> bool:
        return not isinstance(v, int) or isinstance(v, bool) or (self.lo is not None and v < self.lo) or \
            (self.hi is not None and v > self.hi)


class Opt:
    """null, or a value of `spec`."""

    def __init__(self, spec):
        self.spec = spec


class OneOf:
    def __init__(self, *values):
        self.values = values


class Either:
    """A value of any of `specs` (a string or an object, say)."""

    def __init__(self, *specs):
        self.specs = specs


class Map:
    """An object of any keys whose values are each `spec`."""

    def __init__(self, spec):
        self.spec = spec


class Text:
    """A string matching `pattern` (re.fullmatch), described as `what`."""

    def __init__(self, pattern: str, what: str):
        import re

        self.pattern, self.what = re.compile(pattern), what


SHA256 = Text(r"[0-9a-f]{64}", "a SHA-256 hex digest")
FILE_NAME = Text(r"(?!\.\.?$)[^/\\\x00]+", "a plain file name")
NUMBER = float  # a finite number (an integer is one)


def describe(spec) -> str:
    if spec is int:
        return "an integer"
    if spec is float:
        return "a finite number"
    if spec is str:
        return "a string"
    if spec is bool:
        return "true or false"
    if spec is dict:
        return "an object"
    if spec is object:
        return "any value"
    if isinstance(spec, (Int, Text)):
        return spec.describe() if isinstance(spec, Int) else spec.what
    if isinstance(spec, Opt):
        return f"{describe(spec.spec)} or null"
    if isinstance(spec, OneOf):
        return "one of " + ", ".join(json.dumps(v) for v in spec.values)
    if isinstance(spec, Either):
        return " or ".join(describe(s) for s in spec.specs)
    if isinstance(spec, list):
        return f"a list, each {describe(spec[0])}" if len(spec) == 1 else \
            f"a list of {len(spec)}: " + ", ".join(describe(x) for x in spec)
    return "an object"


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def check_fields(value, spec, source: str, field: str = "") -> None:
    """`value` has the shape `spec` says, else an MtpTrtError naming `source` and the field (dotted path).
    spec: int, float (a finite number), str, bool, dict (any object), object (anything), Int(lo, hi), Text(pattern, what),
    Opt(spec), OneOf(*values), Either(*specs) (any of them), Map(spec) (an object of such values), [spec] (a list
    of such values),
    [spec, spec, ...] (a list of exactly those), or a dict {key: spec} (an object with those keys; a key
    ending in "?" may be absent or null; other keys are allowed)."""
    import math

    from mtp_trt.errors import MtpTrtError

    def bad(msg: str | None = None) -> MtpTrtError:
        where = f"field '{field}'" if field else "the file"
        return MtpTrtError(f"{source}: {where} must be {msg or describe(spec)}, got {_short(value)}")

    if isinstance(spec, Opt):
        if value is not None:
            check_fields(value, spec.spec, source, field)
    elif spec is object:
        pass
    elif spec is int or isinstance(spec, Int):
        if (Int() if spec is int else spec).problem(value):
            raise bad()
    elif spec is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad()
    elif spec in (str, bool, dict):
        if not isinstance(value, spec):
            raise bad()
    elif isinstance(spec, Text):
        if not isinstance(value, str) or not spec.pattern.fullmatch(value):
            raise bad()
    elif isinstance(spec, OneOf):
        if value not in spec.values or isinstance(value, bool) != any(isinstance(v, bool) for v in spec.values):
            raise bad()
    elif isinstance(spec, Either):
        for option in spec.specs:
            try:
                check_fields(value, option, source, field)
                return
            except MtpTrtError:
                pass
        raise bad()
    elif isinstance(spec, list):
        if not isinstance(value, list) or (len(spec) > 1 and len(value) != len(spec)):
            raise bad()
        for i, item in enumerate(value):
            check_fields(item, spec[0] if len(spec) == 1 else spec[i], source, f"{field}[{i}]")
    elif isinstance(spec, Map):
        if not isinstance(value, dict):
            raise bad()
        for k, item in value.items():
            check_fields(item, spec.spec, source, f"{field}.{k}" if field else k)
    elif isinstance(spec, dict):
        if not isinstance(value, dict):
            raise bad()
        for key, sub in spec.items():
            name = key.rstrip("?")
            where = f"{field}.{name}" if field else name
            if value.get(name) is None:
                if key.endswith("?"):
                    continue
                raise MtpTrtError(f"{source}: field '{where}' is missing" if name not in value else
                                  f"{source}: field '{where}' must be {describe(sub)}, got None")
            check_fields(value[name], sub, source, where)
    else:
        raise TypeError(f"unknown field spec {spec!r}")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary file's path beside `path`; when the block ends it replaces `path`, or on any error is
    removed (a full disk leaves no half-written file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same directory, then rename."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def _try_lock(fd: int, blocking: bool) -> bool:
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False


@contextlib.contextmanager
def locked(path: Path, waiting=None) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (created if need be) for the block; waits for other holders,
    calling `waiting()` first where there is one (to say so).  The lock file stays (removing it would race with a
    waiter); it is empty."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        if not _try_lock(fd, blocking=False):
            if waiting is not None:
                waiting()
            _try_lock(fd, blocking=True)
        yield
    finally:
        os.close(fd)  # releases the lock


def remove_stale_partials(parent: Path, name: str | None = None) -> list[Path]:
    """Remove the `.NAME.partial-*` directories in `parent` (any NAME when None) whose owner is gone: their
    lock file can be locked (the owner died, even by SIGKILL), or they have no lock file and are older than
    LEGACY_PARTIAL_AGE_S.  A live owner's directory is never touched.  Returns what was removed."""
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    prefix = f".{name}{PARTIAL}" if name is not None else "."
    for entry in entries:
        n = entry.name
        if not n.startswith(prefix) or PARTIAL not in n or n.endswith(".lock"):
            continue
        lock = entry.with_name(n + ".lock")
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                if time.time() - entry.lstat().st_mtime > LEGACY_PARTIAL_AGE_S:
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry)
            continue
        except OSError:
            continue
        try:
            if fcntl is not None and _try_lock(fd, blocking=False):
                shutil.rmtree(entry, ignore_errors=True)
                lock.unlink(missing_ok=True)
                removed.append(entry)
        finally:
            os.close(fd)
    for lock in parent.glob(f".{name or ''}*{PARTIAL}*.lock"):  # lock files whose directory is gone
        if not lock.with_name(lock.name[:-5]).exists():
            with contextlib.suppress(OSError):
                fd = os.open(lock, os.O_RDWR)
                try:
                    if fcntl is not None and _try_lock(fd, blocking=False):
                        lock.unlink(missing_ok=True)
                finally:
                    os.close(fd)
    return removed


def _owned_lock(out: Path) -> tuple[int, str]:
    """A new `.NAME.partial-XXXX.lock` beside `out`, locked by this process until it ends.  A cleaner may
    unlink a lock file in the instant between its creation and its locking: then it is made again."""
    while True:
        fd, lock = tempfile.mkstemp(prefix=f".{out.name}{PARTIAL}", suffix=".lock", dir=out.parent)
        _try_lock(fd, blocking=True)
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                return fd, lock
        except FileNotFoundError:
            pass
        os.close(fd)


@contextlib.contextmanager
def atomic_directory(out: Path) -> Iterator[Path]:
    """Yield a temporary directory beside `out`; on success it replaces `out` (which must be absent or
    empty), on any error or interrupt it is removed, so `out` never holds a half-written result.  Abandoned
    partial directories of `out` left by killed processes are removed first (see remove_stale_partials)."""
    from mtp_trt.errors import MtpTrtError

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(out.parent, out.name)
        fd, lock = _owned_lock(out)
    except OSError as e:
        raise MtpTrtError(f"{out}: cannot create the output directory ({e.strerror or e})") from None
    tmp = Path(lock[: -len(".lock")])
    try:
        tmp.mkdir(mode=0o700)
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        with contextlib.suppress(FileNotFoundError, OSError):
            out.rmdir()  # an empty directory may be replaced
        try:
            os.replace(tmp, out)
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise MtpTrtError(f"{out}: was written by another process meanwhile (or is not an empty "
                                  f"directory); nothing was changed") from None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        Path(lock).unlink(missing_ok=True)
        os.close(fd)
