"""The files of a checkpoint: its manifest of sizes and sha256, verification, and durable writes.

Kept apart from the Checkpointer (the DCP save/load protocol) so that a checkpoint can be checked
without torch.distributed, e.g. by `benchmarks/fault_injection.py` or a storage audit.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from autopar.errors import AutoparError

MANIFEST = "manifest.json"
STATE_FILE = "state.json"
LATEST = "latest"
_HASH_CHUNK_BYTES = 8 * 2**20


class CheckpointError(AutoparError):
    """A checkpoint that cannot be used: incomplete, damaged, or from another model."""

    def __init__(self, message: str, path: Path | None = None, file: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.file = file


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def verify_checkpoint(path: str | os.PathLike, *, part: int = 0, parts: int = 1) -> dict:
    """The manifest of a complete checkpoint whose files have their recorded sizes and sha256;
    otherwise CheckpointError naming the checkpoint and the file. Sizes are checked for every file,
    hashes for the files of index `part` modulo `parts` (so ranks can share the reading)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist", path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: it has no {MANIFEST} (the save did not finish)",
                              path, MANIFEST) from None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"checkpoint {path} is damaged: {MANIFEST} is unreadable ({error})", path,
                              MANIFEST) from None
    names = sorted(files)
    for name in names:
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is damaged: file {name} is missing", path, name)
        size_bytes = file.stat().st_size
        if size_bytes != files[name]["bytes"]:
            raise CheckpointError(f"checkpoint {path} is damaged: file {name} has {size_bytes} bytes, the manifest "
                                  f"records {files[name]['bytes']} (truncated or overwritten)", path, name)
    mine = names[part::parts]
    for name, digest in file_digests(path, [path / name for name in mine]).items():
        if digest["sha256"] != files[name]["sha256"]:
            raise CheckpointError(f"checkpoint {path} is damaged: file {name} does not match the sha256 in its "
                                  f"manifest (corrupted on disk)", path, name)
    return manifest


def file_digests(root: Path, files: list[Path]) -> dict[str, dict]:
    """{path relative to root: {bytes, sha256}}, files hashed in parallel (hashlib releases the GIL)."""
    files = [f for f in files if f.is_file()]
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(files)))) as pool:
        hashes = list(pool.map(_sha256, files))
    return {f.relative_to(root).as_posix(): {"bytes": f.stat().st_size, "sha256": h} for f, h in zip(files, hashes)}


def read_pointer(directory: Path) -> str | None:
    try:
        return (directory / LATEST).read_text().strip() or None
    except OSError:
        return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def write_durably(path: Path, text: str) -> None:
    """Write to a temporary name, fsync, rename over `path`: readers see the old file or the new."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(temporary, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def fsync_directory(path: Path) -> None:
    """Make a rename or a new file in `path` durable (a no-op where directories cannot be opened)."""
    try:
        handle = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)
