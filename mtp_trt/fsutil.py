"""Files written whole or not at all, JSON files read with one clear error, and the one cache directory of mtp-trt."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """`$MTP_TRT_CACHE_DIR`, else `$XDG_CACHE_HOME/mtp-trt`, else `~/.cache/mtp-trt`; joined with parts."""
    root = os.environ.get("MTP_TRT_CACHE_DIR")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtp-trt"
    return Path(root).joinpath(*parts)


def read_json(path: Path):
    """The parsed contents of a JSON file; invalid JSON is an MtpTrtError naming the file."""
    from mtp_trt.errors import MtpTrtError

    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise MtpTrtError(f"{path}: not valid JSON ({e})") from None


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


@contextlib.contextmanager
def atomic_directory(out: Path) -> Iterator[Path]:
    """Yield a temporary directory beside `out`; on success it replaces `out` (which must be absent or
    empty), on any error or interrupt it is removed, so `out` never holds a half-written result."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        with contextlib.suppress(FileNotFoundError):
            out.rmdir()  # an empty directory may be replaced
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
