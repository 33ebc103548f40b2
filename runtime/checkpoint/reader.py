"""Reading a DCP checkpoint without executing anything it contains.

DCP's index (`.metadata`) is a pickle, and `FileSystemReader.read_metadata` unpickles it with the
standard unpickler: a crafted index runs any code it names, and the manifest's sha256 is no defence
(whoever can write the file can rewrite the manifest). DCP also `torch.load`s every non-tensor
value with `weights_only=False`. So every checkpoint load goes through the two classes here:

- `SafeFileSystemReader` unpickles the index with an allow-list: the classes DCP's metadata is
  made of (its dataclasses, `torch.Size`, dtypes, the layout and memory-format encodings, a path)
  and nothing else: a pickle naming `os.system` or any other global is refused before anything is
  built. It then checks the index's shape and that every file it points into is a plain name inside
  the checkpoint (no `../`, no absolute path, no symlink leading out).
- `SafeLoadPlanner` loads non-tensor values with `torch.load(weights_only=True)` (plain Python
  values and tensors only). Tensors DCP already loads that way.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata, _MEM_FORMAT_ENCODING)

from autopar.errors import AutoparError
from autopar.runtime.checkpoint.files import CheckpointError

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS: dict[tuple[str, str], object] = {
    **{(_METADATA_MODULE, cls.__name__): cls for cls in (
        Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata, BytesStorageMetadata,
        ChunkStorageMetadata, _MEM_FORMAT_ENCODING)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a lookup by name in a dict
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
    # the path DCP stores as `checkpoint_id`: building one does no I/O (3.13 moved them to pathlib._local)
    **{(module, name): getattr(pathlib, name) for module in ("pathlib", "pathlib._local")
       for name in ("PosixPath", "PurePosixPath", "PureWindowsPath")},
}

_REFUSE_FIX = "it was not written by autopar (or was tampered with): delete it, or resume from another checkpoint"


class _AllowListUnpickler(pickle.Unpickler):
    """Builds only the classes on the allow-list; any other global ends the load unbuilt."""

    def find_class(self, module: str, name: str):
        allowed = _ALLOWED_GLOBALS.get((module, name))
        if allowed is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a DCP index never holds")
        return allowed

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it holds a persistent id, which a DCP index never holds")


def read_safe_metadata(path: str | os.PathLike) -> Metadata:
    """The DCP index of checkpoint directory `path`, unpickled under the allow-list and checked;
    CheckpointError (one line) for anything else. Nothing in the file is executed."""
    path = Path(path)
    file = path / ".metadata"
    where = f"checkpoint {path}: its index .metadata"
    if file.is_symlink():
        raise CheckpointError(f"refusing {where}: it is a symlink (it may lead outside the checkpoint); {_REFUSE_FIX}",
                              path, ".metadata")
    try:
        with open(file, "rb") as stream:
            metadata = _AllowListUnpickler(stream).load()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is damaged: file .metadata is missing", path, ".metadata") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, KeyError, TypeError,
            ValueError, RuntimeError, OSError, MemoryError) as error:  # what a damaged pickle can raise
        raise CheckpointError(f"refusing {where}: {_one_line(error)} (nothing in it was run); {_REFUSE_FIX}",
                              path, ".metadata") from None
    _check_shape(metadata, path, where)
    return metadata


def _check_shape(metadata: object, path: Path, where: str) -> None:
    """The index is DCP's Metadata, and its storage records point at plain files inside `path`."""
    def refuse(problem: str):
        raise CheckpointError(f"refusing {where}: {problem}; {_REFUSE_FIX}", path, ".metadata")

    if not isinstance(metadata, Metadata):
        refuse(f"it holds a {type(metadata).__name__}, not DCP Metadata")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict) or not all(
            isinstance(key, str) and isinstance(value, (TensorStorageMetadata, BytesStorageMetadata))
            for key, value in entries.items()):
        refuse("its entries are not a table of tensor and object records")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        refuse("it has no table of storage records")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            refuse("its storage table holds something other than DCP storage records")
        if not (isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0
                and info.length >= 0):
            refuse(f"the storage record of {index.fqn!r} has offset {info.offset!r} and length {info.length!r}")
        if info.transform_descriptors:
            refuse(f"the storage record of {index.fqn!r} asks for transforms {list(info.transform_descriptors)!r}, "
                   f"which autopar never writes")
        name = info.relative_path
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            refuse(f"the storage record of {index.fqn!r} points at {name!r}, not a file of the checkpoint")
        file = path / name
        if file.is_symlink() or (file.exists() and file.resolve().parent != path.resolve()):
            refuse(f"its file {name} is a symlink (it may lead outside the checkpoint)")
    planner_data = metadata.planner_data
    if planner_data is not None and not (isinstance(planner_data, dict) and all(
            isinstance(key, str) and isinstance(value, (tuple, list))
            and all(isinstance(part, (str, int)) for part in value) for key, value in planner_data.items())):
        refuse("its planner data is not a table of key paths")


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:200]


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose index is read by `read_safe_metadata` (see the module docstring)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank indexes: autopar saves with one shared index
            raise CheckpointError(f"checkpoint {self.path} has per-rank DCP indexes, which autopar never writes",
                                  Path(self.path))
        metadata = read_safe_metadata(self.path)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _load_value(value: io.BytesIO):
    try:
        return torch.load(value, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as error:
        raise AutoparError(f"refusing a non-tensor value of the checkpoint: {_one_line(error)} (nothing in it was "
                           f"run); {_REFUSE_FIX}") from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor values load with torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = _load_value(value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def read_checkpoint_state(path: str | os.PathLike) -> dict:
    """Everything a checkpoint's DCP files hold, {key: tensor or value}, in this process alone (for
    comparing checkpoints: benchmarks, tests). Read as safely as `Checkpointer.load` reads: the
    entries to fill come from the allow-listed index."""
    import warnings

    import torch.distributed.checkpoint as dcp

    entries = read_safe_metadata(path).state_dict_metadata
    state: dict = {key: torch.empty(tuple(record.size), dtype=record.properties.dtype)
                   if isinstance(record, TensorStorageMetadata) else None for key, record in entries.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=True)
    return state
