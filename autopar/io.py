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
    _publish(_stage(target, text), target)


def check_output_path(path: str | os.PathLike, what: str = "output") -> None:
    """Fail with one line, before any long work, when `path` cannot be written as a file."""
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise AutoparError(f"{what} {target} is a directory; give a file name inside it")
    if not directory.is_dir():
        raise AutoparError(f"cannot write {what} {target}: directory {directory} does not exist; create it first")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise AutoparError(f"cannot write {what} {target}: directory {directory} is not writable; choose another")
    if target.exists() and not os.access(target, os.W_OK):
        raise AutoparError(f"cannot write {what} {target}: the file is read-only; choose another name")


def write_all(texts: dict[str, str]) -> None:
    """Write several files, all or none: each path checked, each text staged beside its target and
    synced, and only then all renamed into place. A failure before the renames leaves nothing."""
    for path in texts:
        check_output_path(path)
    if len({Path(p).resolve() for p in texts}) != len(texts):
        raise AutoparError(f"two outputs name the same file ({', '.join(texts)}): give each its own path")
    staged: list[tuple[str, Path]] = []
    try:
        for path, text in texts.items():
            staged.append((_stage(Path(path), text), Path(path)))
    except BaseException:
        for temporary, _ in staged:
            Path(temporary).unlink(missing_ok=True)
        raise
    for temporary, target in staged:
        _publish(temporary, target)


def _publish(temporary: str, target: Path) -> None:
    try:
        os.replace(temporary, target)
    except OSError as error:
        Path(temporary).unlink(missing_ok=True)
        raise AutoparError(f"cannot write {target}: {error.strerror}; check the path and permissions") from None


def _stage(target: Path, text: str) -> str:
    directory = target.parent if str(target.parent) else Path(".")
    try:
        handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    except OSError as error:
        raise AutoparError(f"cannot write {target}: {error.strerror}; choose a writable location") from None
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
            os.fchmod(stream.fileno(), _default_mode())
    except BaseException as error:
        Path(temporary).unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise AutoparError(f"cannot write {target}: {error.strerror}; check free space and permissions") from None
        raise
    return temporary


def _default_mode() -> int:
    """0666 less the process umask: what open() would have given the file."""
    return 0o666 & ~_UMASK


_UMASK = os.umask(0)  # read once, at import (os.umask can only be read by setting it)
os.umask(_UMASK)
