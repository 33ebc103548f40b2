"""The files of a checkpoint: its manifest of sizes and sha256, verification, and durable writes.

Kept apart from the Checkpointer (the DCP save/load protocol) so that a checkpoint can be checked
without torch.distributed, e.g. by `benchmarks/fault_injection.py` or a storage audit.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from autopar.errors import AutoparError
from autopar.io import contained_path

MANIFEST = "manifest.json"
STATE_FILE = "state.json"
LATEST = "latest"
DCP_INDEX = ".metadata"
PUBLISHED_NAME = re.compile(r"step-(\d+)")
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
        manifest = json.loads(_inside(path, MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: it has no {MANIFEST} (the save did not finish)",
                              path, MANIFEST) from None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"checkpoint {path} is damaged: {MANIFEST} is unreadable ({error})", path,
                              MANIFEST) from None
    if not isinstance(files, dict) or not {DCP_INDEX, STATE_FILE} <= set(files):
        raise CheckpointError(f"checkpoint {path} is damaged: {MANIFEST} does not list {DCP_INDEX} and {STATE_FILE}",
                              path, MANIFEST)
    names = sorted(files)
    for name in names:
        file = _inside(path, name)
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is damaged: file {name} is missing", path, name)
        size_bytes = file.stat().st_size
        recorded = files[name].get("bytes") if isinstance(files[name], dict) else None
        if size_bytes != recorded:
            raise CheckpointError(f"checkpoint {path} is damaged: file {name} has {size_bytes} bytes, the manifest "
                                  f"records {recorded} (truncated or overwritten)", path, name)
    mine = names[part::parts]
    for name, digest in file_digests(path, [path / name for name in mine]).items():
        if digest["sha256"] != files[name]["sha256"]:
            raise CheckpointError(f"checkpoint {path} is damaged: file {name} does not match the sha256 in its "
                                  f"manifest (corrupted on disk)", path, name)
    return manifest


def _inside(checkpoint: Path, name: object) -> Path:
    """A file the manifest names, refused (CheckpointError) unless it lies inside the checkpoint."""
    try:
        return contained_path(checkpoint, name, f"checkpoint {checkpoint}: {MANIFEST}",
                              "the checkpoint was tampered with: delete it or resume from another")
    except CheckpointError:
        raise
    except AutoparError as error:
        raise CheckpointError(str(error), checkpoint, MANIFEST) from None


def file_digests(root: Path, files: list[Path]) -> dict[str, dict]:
    """{path relative to root: {bytes, sha256}}, files hashed in parallel (hashlib releases the GIL)."""
    files = [f for f in files if f.is_file()]
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(files)))) as pool:
        hashes = list(pool.map(_sha256, files))
    return {f.relative_to(root).as_posix(): {"bytes": f.stat().st_size, "sha256": h} for f, h in zip(files, hashes)}


def read_pointer(directory: Path) -> str | None:
    """The checkpoint name `latest` holds (None when there is no pointer). A pointer that is not a
    checkpoint name of this directory (`../x`, an absolute path, a symlink) is refused: it was not
    written by autopar, and following it would read outside the directory."""
    pointer = directory / LATEST
    if pointer.is_symlink():
        raise CheckpointError(f"{pointer} is a symlink: autopar writes `latest` as a file naming a checkpoint of "
                              f"{directory}; delete it (the newest checkpoint is then found without it)",
                              pointer, LATEST)
    try:
        text = pointer.read_text(encoding="utf-8", errors="replace").strip()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise CheckpointError(f"cannot read {pointer}: {error.strerror}; fix its permissions or delete it",
                              pointer, LATEST) from None
    if not text:
        return None
    if not PUBLISHED_NAME.fullmatch(text):
        raise CheckpointError(f"{pointer} names {text[:80]!r}, not a checkpoint of {directory} (step-NNNNNNNN): "
                              f"delete it (the newest checkpoint is then found without it)", pointer, LATEST)
    return text


def sha256_bytes_per_s(sample_bytes: int = 32 * 2**20) -> float:
    """This machine's sha256 throughput on one thread (how fast a rank hashes what it saved), measured
    on `sample_bytes` (about 20-60 ms)."""
    import time

    sample = bytes(sample_bytes)
    started = time.perf_counter()
    hashlib.sha256(sample).digest()
    return sample_bytes / max(time.perf_counter() - started, 1e-9)


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
