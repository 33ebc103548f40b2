"""Files: writing so that a crash or a bad path never leaves half a file behind, and reading names
taken from files a user hands us (checkpoint manifests, dataset indexes) without leaving their directory.

New files and directories get the modes `open()` and `mkdir()` give under the process umask: we
create them with 0666/0777 and let the kernel apply the umask, so the umask is never read or
changed (setting it, even for an instant, races with every other thread creating files).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path, PurePosixPath

from autopar.errors import AutoparError

_CREATE_ATTEMPTS = 100


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
    staged: list[tuple[Path, Path]] = []
    try:
        for path, text in texts.items():
            staged.append((_stage(Path(path), text), Path(path)))
    except BaseException:
        for temporary, _ in staged:
            Path(temporary).unlink(missing_ok=True)
        raise
    for temporary, target in staged:
        _publish(temporary, target)


def _publish(temporary: Path, target: Path) -> None:
    try:
        os.replace(temporary, target)
    except OSError as error:
        Path(temporary).unlink(missing_ok=True)
        raise AutoparError(f"cannot write {target}: {error.strerror}; check the path and permissions") from None


def _stage(target: Path, text: str) -> Path:
    directory = target.parent if str(target.parent) else Path(".")
    try:
        handle, temporary = _create_beside(directory, target.name)
    except OSError as error:
        raise AutoparError(f"cannot write {target}: {error.strerror}; choose a writable location") from None
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise AutoparError(f"cannot write {target}: {error.strerror}; check free space and permissions") from None
        raise
    return temporary


def _create_beside(directory: Path, name: str) -> tuple[int, Path]:
    """A new hidden file in `directory`, mode 0666 less the umask (what a plain open() gives)."""
    for _ in range(_CREATE_ATTEMPTS):
        candidate = directory / f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {directory / name}")


def make_hidden_directory(parent: Path, name: str, suffix: str) -> Path:
    """A new directory `parent/.name.<random>suffix`, mode 0777 less the umask (what mkdir gives;
    tempfile.mkdtemp would make it 0700 and the result would need a chmod that ignores the umask)."""
    for _ in range(_CREATE_ATTEMPTS):
        candidate = parent / f".{name}.{secrets.token_hex(6)}{suffix}"
        try:
            candidate.mkdir(mode=0o777)
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary directory name in {parent}")


def contained_path(root: str | os.PathLike, name: object, what: str, fix: str) -> Path:
    """`root/name` for a relative `name` read from a file in `root` (a manifest, an index), refusing
    with one line a name that is not a relative path, climbs with `..`, or resolves (through a
    symlink) outside `root`: what a user hands us is read only inside its own directory.
    `what` names the file the name came from, `fix` says what to do instead."""
    root = Path(root)
    text = name if isinstance(name, str) else None
    parts = PurePosixPath(text).parts if text else ()
    if (not text or "\\" in text or "\0" in text or PurePosixPath(text).is_absolute()
            or any(part in ("..", ".") for part in parts) or Path(text).drive):
        raise AutoparError(f"{what} names {name!r}, not a relative path inside {root}: refusing to read outside "
                           f"its directory; {fix}")
    path = root / text
    try:
        real_root = root.resolve(strict=True)
        real = path.resolve(strict=False)
    except (OSError, RuntimeError) as error:  # RuntimeError: a symlink loop
        raise AutoparError(f"{what} names {text!r}, which cannot be resolved inside {root} ({error}); {fix}") from None
    if real != real_root and real_root not in real.parents:
        raise AutoparError(f"{what} names {text!r}, which leads outside {root} (to {real}, through a symlink): "
                           f"refusing to read outside its directory; {fix}")
    return path
