"""Writing files so that a crash or a bad path never leaves half a file behind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from autopar.errors import AutoparError


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write to a temporary file beside `path`, fsync, then rename over it."""
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    if not directory.is_dir():
        raise AutoparError(f"cannot write {target}: directory {directory} does not exist; create it first")
    try:
        handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    except OSError as error:
        raise AutoparError(f"cannot write {target}: {error.strerror}; choose a writable location") from None
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
            os.fchmod(stream.fileno(), _default_mode())  # mkstemp makes 0600; a report or plan is for sharing
        os.replace(temporary, target)
    except BaseException as error:
        Path(temporary).unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise AutoparError(f"cannot write {target}: {error.strerror}; check free space and permissions") from None
        raise


def _default_mode() -> int:
    """0666 less the process umask: what open() would have given the file."""
    return 0o666 & ~_UMASK


_UMASK = os.umask(0)  # read once, at import (os.umask can only be read by setting it)
os.umask(_UMASK)
