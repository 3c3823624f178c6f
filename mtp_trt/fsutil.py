"""Files written whole or not at all, JSON files read with one clear error, and the one cache directory of mtp-trt.

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
    """`$MTP_TRT_CACHE_DIR`, else `$XDG_CACHE_HOME/mtp-trt`, else `~/.cache/mtp-trt`; joined with parts."""
    root = os.environ.get("MTP_TRT_CACHE_DIR")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtp-trt"
    return Path(root).joinpath(*parts)


def read_json(path: Path):
    """The parsed contents of a JSON file; invalid JSON (or text) is an MtpTrtError naming the file."""
    from mtp_trt.errors import MtpTrtError

    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except json.JSONDecodeError as e:
        raise MtpTrtError(f"{path}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise MtpTrtError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    except OSError as e:
        raise MtpTrtError(f"{path}: cannot read ({e.strerror})") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same directory, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _try_lock(fd: int, blocking: bool) -> bool:
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (created if need be) for the block; waits for other holders.
    The lock file stays (removing it would race with a waiter); it is empty."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
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
