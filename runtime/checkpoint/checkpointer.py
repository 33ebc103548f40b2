"""Checkpoints that survive crashes, full disks and bit rot, and load under any plan.

`Checkpointer(directory)` saves a `ParallelModel`'s parameters, its optimizer's state and
hyperparameters, the caller's JSON "extra" state (step, LR scheduler, data loader, plan, config) and
every rank's random generators with `torch.distributed.checkpoint` (DCP), under plan-independent
names (see runtime/checkpoint/state.py): a checkpoint saved under one dp/tp/pp/ZeRO plan loads
under another, DCP resharding DTensors and plain tensors as the loading plan places them.

On disk (every rank must see the same directory: one node, or a shared filesystem):

    <directory>/latest                 "step-00000100": the last published checkpoint (os.replace'd)
    <directory>/step-00000100/         one published checkpoint
        .metadata, __<rank>_0.distcp   DCP's index and each writing rank's shards
        state.json                     extra, optimizer class and param groups, world size
        rng/rank-00000.json ...        each rank's generators
        manifest.json                  written last: size and sha256 of every other file
    <directory>/.step-00000200.tmp/    a save in progress (or left by a crash: removed by the next save)

Publication is atomic: every rank writes into the temporary directory; once DCP reports all ranks
done, each rank hashes the files it wrote, rank 0 writes the manifest, fsyncs, renames the directory
to its final name and replaces `latest`. So `latest` never names a partial checkpoint, a crash
mid-save leaves the previous one usable, and older checkpoints beyond `keep_last` are deleted only
after the new one is published. Loading verifies the manifest (the ranks share the hashing);
`load("latest")` falls back to the newest good checkpoint with a one-line warning on stderr.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from autopar.errors import AutoparError
from autopar.runtime.checkpoint import state as state_io
from autopar.runtime.checkpoint.files import (LATEST, MANIFEST, PUBLISHED_NAME, STATE_FILE, CheckpointError,
                                              file_digests, fsync_directory, read_pointer, step_name,
                                              verify_checkpoint, write_durably)

__all__ = ["Checkpointer", "CheckpointError", "CheckpointInfo", "check_writable_directory", "step_name",
           "verify_checkpoint"]

FORMAT_VERSION = 1


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path


@dataclass
class _PendingSave:
    step: int
    temporary: Path
    final: Path
    future: Future
    model_fingerprint: str


class Checkpointer:
    """Save, publish, verify and load checkpoints of a ParallelModel in `directory`.

    Every rank constructs it and calls save/wait/load in the same order (they are collectives, on a
    gloo group of their own so an async save's coordination can run beside training). `keep_last`
    published checkpoints are kept (None keeps all). With `async_save`, `save` returns once this
    rank's state is copied to host memory; the write continues in a background thread and is
    published by `wait()`, the next `save`, `load` or `close` (leaving a `with` block by an
    exception publishes nothing: the next save sweeps the temporary directory).
    """

    def __init__(self, directory: str | os.PathLike, *, keep_last: int | None = 3, async_save: bool = False) -> None:
        if keep_last is not None and keep_last < 1:
            raise AutoparError(f"keep_last={keep_last} would delete the checkpoint just written: give 1 or more")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.async_save = async_save
        self.loaded: CheckpointInfo | None = None
        self._group_handle: dist.ProcessGroup | None = None
        self._pending: _PendingSave | None = None

    # ---- saving -----------------------------------------------------------------------------
    def save(self, step: int, parallel, optimizer: torch.optim.Optimizer | None = None,
             extra: dict | None = None) -> Path:
        """Write step `step` and publish it (now, or at `wait()` when async); returns its final path.

        `extra` must be JSON-able (tuples come back as lists, dict keys as strings); rank 0's is kept.
        A failure raises the same one line on every rank (AutoparError for a full disk or another
        I/O error) after the temporary directory is removed; `latest` and older checkpoints stay.
        """
        self.wait()
        extra = dict(extra or {})
        try:
            json.dumps(extra)
            problem = None
        except (TypeError, ValueError) as error:
            problem = f"checkpoint extra state must be JSON-able: {error}; convert tensors with .tolist() or .item()"
        self._raise_if(self._agree(problem))
        final = self.directory / step_name(step)
        temporary = self.directory / f".{final.name}.tmp"
        fingerprint = parallel.plan.provenance.model_fingerprint

        if self._rank() == 0:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._remove_leftovers()
                temporary.mkdir()
            except OSError as failure:
                problem = self._io_message(failure, step)
        self._raise_if(self._agree(problem))

        failure_seen = None
        try:  # small files first: a full disk shows here before DCP starts
            (temporary / "rng").mkdir(exist_ok=True)
            write_durably(temporary / "rng" / f"rank-{self._rank():05d}.json", json.dumps(state_io.rng_state()))
            if self._rank() == 0:
                scale = getattr(parallel, "loss_scale", None)  # fp16's dynamic loss scale
                record = {"format": FORMAT_VERSION, "step": step, "world_size": self._world(),
                          "strategy": str(parallel.strategy),
                          "parameters": sorted(set(parallel.canonical.values())),
                          "optimizer": type(optimizer).__name__ if optimizer is not None else None,
                          "param_groups": state_io.param_group_hyperparameters(optimizer) if optimizer else None,
                          "loss_scale": scale.state_dict() if scale is not None else None,
                          "extra": extra}
                write_durably(temporary / STATE_FILE, json.dumps(record))
        except OSError as failure:
            failure_seen = (self._io_message(failure, step), True)
        self._fail_if(self._agree(failure_seen), temporary)

        state = state_io.model_entries(parallel).values
        if optimizer is not None:
            state.update(state_io.optimizer_entries(parallel, optimizer).values)
        writer = FileSystemWriter(temporary, single_file_per_rank=True, sync_files=True)
        if self.async_save:
            result = dcp.async_save(state, storage_writer=writer, process_group=self._group(),
                                    no_dist=not dist.is_initialized())
            future = getattr(result, "upload_completion", result)
            self._pending = _PendingSave(step, temporary, final, future, fingerprint)
            return final
        try:
            dcp.save(state, storage_writer=writer, process_group=self._group(), no_dist=not dist.is_initialized())
        except BaseException as failure:  # DCP raises CheckpointException, a BaseException
            if isinstance(failure, (KeyboardInterrupt, SystemExit)):
                raise
            failure_seen = self._describe(failure, step)
        self._publish_or_fail(step, temporary, final, fingerprint, failure_seen)
        return final

    def wait(self) -> Path | None:
        """Finish an async save and publish it; returns its path (None when nothing was pending)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        failure_seen = None
        try:
            pending.future.result()
        except BaseException as failure:
            if isinstance(failure, (KeyboardInterrupt, SystemExit)):
                raise
            failure_seen = self._describe(failure, pending.step)
        self._publish_or_fail(pending.step, pending.temporary, pending.final, pending.model_fingerprint,
                              failure_seen)
        return pending.final

    def close(self) -> None:
        self.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        if exc_info[0] is None:
            self.close()

    def _publish_or_fail(self, step: int, temporary: Path, final: Path, fingerprint: str,
                         failure_seen: tuple[str, bool] | None) -> None:
        """Each rank hashes the files it wrote; rank 0 publishes; any failure is raised everywhere."""
        digests = {}
        if failure_seen is None:
            own = [*temporary.glob(f"__{self._rank()}_*.distcp"), temporary / "rng" / f"rank-{self._rank():05d}.json"]
            try:
                digests = file_digests(temporary, own)
            except OSError as failure:
                failure_seen = (self._io_message(failure, step), True)
        gathered = self._gather((failure_seen, digests))
        failure_seen = next((seen for seen, _ in gathered if seen is not None), None)
        if failure_seen is None and self._rank() == 0:
            try:
                self._publish(step, temporary, final, fingerprint, {k: v for _, d in gathered for k, v in d.items()})
            except OSError as failure:
                failure_seen = (self._io_message(failure, step), True)
        self._fail_if(self._agree(failure_seen), temporary)

    def _fail_if(self, failure_seen: tuple[str, bool] | None, temporary: Path) -> None:
        """On a failure every rank raises the same line, after rank 0 removed the temporary directory."""
        if failure_seen is None:
            return
        if self._rank() == 0:
            shutil.rmtree(temporary, ignore_errors=True)
        self._agree(None)  # nobody returns before the temporary directory is gone
        message, io_failure = failure_seen
        raise AutoparError(message) if io_failure else RuntimeError(message)

    def _publish(self, step: int, temporary: Path, final: Path, fingerprint: str, digests: dict) -> None:
        rest = [p for p in temporary.rglob("*") if p.is_file() and p.name != MANIFEST
                and p.relative_to(temporary).as_posix() not in digests]
        files = dict(sorted({**digests, **file_digests(temporary, rest)}.items()))
        manifest = {"format": FORMAT_VERSION, "step": step, "model_fingerprint": fingerprint,
                    "world_size": self._world(), "created_unix_s": time.time(), "files": files}
        write_durably(temporary / MANIFEST, json.dumps(manifest, indent=1))
        fsync_directory(temporary / "rng")
        replaced = self.directory / f".{final.name}.replaced.tmp"
        if final.exists():  # the same step saved again: move the old one aside, removed below
            shutil.rmtree(replaced, ignore_errors=True)
            os.rename(final, replaced)
        os.rename(temporary, final)
        try:
            fsync_directory(self.directory)
            write_durably(self.directory / LATEST, final.name + "\n")
        except OSError:  # unpublish, so that the failure's "nothing was published" holds
            os.rename(final, temporary)
            if replaced.exists():
                os.rename(replaced, final)
            raise
        shutil.rmtree(replaced, ignore_errors=True)
        self._prune(keep=final)

    def _prune(self, keep: Path) -> None:
        """Delete published checkpoints beyond keep_last (never the one just published)."""
        if self.keep_last is None:
            return
        published = [info.path for info in self.list()]
        doomed = [p for p in published if p != keep][:max(0, len(published) - self.keep_last)]
        for path in doomed:
            trash = self.directory / f".{path.name}.deleting.tmp"
            try:
                os.rename(path, trash)  # no half-deleted directory ever looks published
            except OSError as error:  # the new checkpoint is published: a stale one left is no failure
                print(f"autopar: warning: cannot delete old checkpoint {path}: {error.strerror}", file=sys.stderr)
                continue
            shutil.rmtree(trash, ignore_errors=True)

    def _remove_leftovers(self) -> None:
        """What an interrupted save or publication left: temporary directories and pointer files."""
        for path in self.directory.glob(".step-*.tmp"):
            shutil.rmtree(path, ignore_errors=True)
        for path in self.directory.glob(f".{LATEST}.*.partial"):
            path.unlink(missing_ok=True)

    # ---- finding ----------------------------------------------------------------------------
    def list(self) -> list[CheckpointInfo]:
        """Published checkpoints (those with a manifest), oldest step first; not verified."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.iterdir():
            match = PUBLISHED_NAME.fullmatch(path.name)
            if match and not path.is_symlink() and (path / MANIFEST).is_file():
                found.append(CheckpointInfo(int(match.group(1)), path))
        return sorted(found, key=lambda info: info.step)

    def is_empty(self) -> bool:
        """No published checkpoint and no `latest` pointer: a run here starts fresh. A pointer with no
        checkpoint behind it is not empty (a run was here; `load("latest")` says what is missing)."""
        return not self.list() and not (self.directory / LATEST).exists() and not (self.directory / LATEST).is_symlink()

    def _candidates(self) -> list[Path]:
        """Where `latest` points first, then every published checkpoint, newest step first. A symlinked
        step directory is not followed (see `list`); a bad pointer raises CheckpointError."""
        pointer = read_pointer(self.directory)
        first = [self.directory / pointer] if pointer and not (self.directory / pointer).is_symlink() else []
        return first + [info.path for info in reversed(self.list()) if info.path not in first]

    def latest(self) -> Path | None:
        """The newest complete, verified checkpoint (see `_candidates`); each damaged one passed over
        is reported on stderr in one line. Local: this process reads every file."""
        skipped: list[str] = []
        for path in self._candidates():
            try:
                verify_checkpoint(path)
            except CheckpointError as error:
                skipped.append(str(error))
                continue
            _warn_skipped(skipped, path)
            return path
        _warn_skipped(skipped, None)
        return None

    # ---- loading ----------------------------------------------------------------------------
    def load(self, path_or_latest: str | os.PathLike | int = "latest", parallel=None,
             optimizer: torch.optim.Optimizer | None = None) -> dict:
        """Load a checkpoint into `parallel` (and `optimizer`) under the running plan; returns its extra.

        `path_or_latest`: "latest", a step number, a checkpoint's name in the directory, or a path.
        An explicit checkpoint that fails verification raises CheckpointError; "latest" falls back
        to the newest good one. Generators are restored on every rank the saving world had; ranks
        beyond it keep their own (seeded by the caller), which one line on stderr notes.
        """
        if parallel is None:
            raise AutoparError("Checkpointer.load needs the ParallelModel to load into")
        self.wait()
        resolved = self._choose(path_or_latest)
        manifest = json.loads((resolved / MANIFEST).read_text())
        record = json.loads((resolved / STATE_FILE).read_text())
        expected = parallel.plan.provenance.model_fingerprint
        if manifest.get("model_fingerprint") not in (None, expected):
            raise CheckpointError(f"checkpoint {resolved} is of model fingerprint {manifest['model_fingerprint']}, "
                                  f"this model is {expected}: load a checkpoint of this model", resolved)
        self._raise_if(self._agree(state_io.load_into(resolved, record, parallel, optimizer, self._group())))
        if self._rank() == 0 and (record["world_size"], record.get("strategy")) != (self._world(),
                                                                                  str(parallel.strategy)):
            print(f"autopar: note: resharded {resolved.name}, saved by {record['world_size']} process(es) under "
                  f"{record.get('strategy')}, onto {self._world()} under {parallel.strategy}", file=sys.stderr)
        rng_name = f"rng/rank-{self._rank():05d}.json"
        if rng_name in manifest["files"]:  # verified, so inside the checkpoint
            state_io.set_rng_state(json.loads((resolved / rng_name).read_text()))
        elif self._rank() == record["world_size"]:  # the first rank the saving world lacked says it once
            print(f"autopar: note: checkpoint {resolved} holds generator states for {record['world_size']} ranks; "
                  f"ranks {record['world_size']}-{self._world() - 1} keep their own", file=sys.stderr)
        scale = getattr(parallel, "loss_scale", None)
        if record.get("loss_scale") and scale is not None:  # fp16 resumes at the scale it reached
            scale.load_state_dict(record["loss_scale"])  # in place: a pipeline's loss reads this object
        self.loaded = CheckpointInfo(manifest["step"], resolved)
        return record["extra"]

    def _choose(self, path_or_latest) -> Path:
        """The checkpoint to load, the same on every rank: each candidate's files are verified by all
        ranks together (each hashes a share); the first that passes everywhere wins."""
        explicit = path_or_latest != LATEST
        chosen = (None, None, None)  # (candidates, what `latest` names, a problem finding them)
        if self._rank() == 0:
            try:
                chosen = (([self._explicit_path(path_or_latest)], None, None) if explicit
                          else (self._candidates(), read_pointer(self.directory), None))
            except CheckpointError as error:
                chosen = (None, None, (str(error), error.path, error.file))
        candidates, pointer, problem = self._broadcast(chosen)
        if problem is not None:
            raise CheckpointError(*problem)
        skipped: list[str] = []
        for path in candidates:
            try:
                verify_checkpoint(path, part=self._rank(), parts=self._world())
                problem = None
            except CheckpointError as error:
                problem = (str(error), error.path, error.file)
            problem = self._agree(problem)
            if problem is None:
                if self._rank() == 0:
                    _warn_skipped(skipped, path)
                return path
            if explicit:
                raise CheckpointError(*problem)
            skipped.append(problem[0])
        if self._rank() == 0:
            _warn_skipped(skipped, None)
        if pointer is not None:  # a run published here, and its checkpoint is gone: never a silent fresh start
            raise CheckpointError(f"{self.directory / LATEST} names {pointer}, which is missing or damaged, and "
                                  f"{self.directory} holds no other complete checkpoint: restore it, give a "
                                  f"checkpoint path, or start fresh deliberately (--resume none)",
                                  self.directory / LATEST, LATEST)
        raise CheckpointError(f"no complete checkpoint in {self.directory}: start from scratch or give a "
                              f"checkpoint path", self.directory)

    def _explicit_path(self, path_or_latest) -> Path:
        if isinstance(path_or_latest, int):
            return self.directory / step_name(path_or_latest)
        path = Path(path_or_latest)
        return path if path.is_absolute() or path.exists() else self.directory / path

    # ---- process-group helpers --------------------------------------------------------------
    def _group(self) -> dist.ProcessGroup | None:
        """A gloo group of all ranks, made at the first collective call (every rank makes it)."""
        if self._group_handle is None and dist.is_initialized():
            self._group_handle = dist.new_group(backend="gloo")
        return self._group_handle

    def _rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def _world(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def _gather(self, value) -> list:
        if self._world() == 1:
            return [value]
        gathered: list = [None] * self._world()
        dist.all_gather_object(gathered, value, group=self._group())
        return gathered

    def _agree(self, problem):
        """Every rank's problem gathered: all ranks see the first (so all raise, or none)."""
        return next((p for p in self._gather(problem) if p is not None), None)

    def _broadcast(self, value):
        if self._world() == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._group())
        return box[0]

    @staticmethod
    def _raise_if(problem: str | None) -> None:
        if problem is not None:
            raise AutoparError(problem)

    def _io_message(self, failure: OSError, step: int) -> str:
        where = f"checkpoint {step_name(step)} in {self.directory}"
        try:
            kept = read_pointer(self.directory)
        except CheckpointError:
            kept = None
        intact = f"nothing was published; {kept} and `latest` are intact" if kept else "nothing was published"
        if failure.errno == errno.ENOSPC:
            return f"disk full while writing {where}: free space or lower keep_last; {intact}"
        return f"cannot write {where}: {failure.strerror or failure}; check the path and permissions; {intact}"

    def _describe(self, failure: BaseException, step: int) -> tuple[str, bool]:
        """(one line, is an I/O failure) for what DCP raised: its failures name each rank's exception."""
        causes = [(rank, pair[0]) for rank, pair in sorted(getattr(failure, "failures", {}).items())]
        causes = causes or [(self._rank(), failure)]
        for rank, cause in causes:
            if isinstance(cause, OSError):
                return self._io_message(cause, step), True
        rank, cause = causes[0]
        first_line = (str(cause).strip().splitlines() or [""])[0]
        return (f"saving checkpoint {step_name(step)} in {self.directory} failed on rank {rank}: "
                f"{type(cause).__name__}: {first_line}; nothing was published"), False


def check_writable_directory(directory: str | os.PathLike) -> None:
    """Refuse (one line) a checkpoint directory this process could not create or write into, before
    any training: a probe file (or directory) with a name of its own is made and removed, in the
    directory or, when it does not exist yet, in its nearest existing parent. Nothing is left behind,
    and ranks probing one directory together do not disturb each other."""
    directory = Path(directory)
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise AutoparError(f"cannot create checkpoint directory {directory}: {existing} is not a directory; "
                           f"give a directory path for --checkpoint-dir")
    probe = existing / f".autopar-write-probe-{os.getpid()}-{time.monotonic_ns()}"
    try:
        if existing == directory:
            probe.touch(exist_ok=False)
            probe.unlink()
        else:
            probe.mkdir()
            probe.rmdir()
    except OSError as error:
        verb = "write checkpoints in" if existing == directory else "create checkpoint directory"
        raise AutoparError(f"cannot {verb} {directory}: {error.strerror} (in {existing}); give a writable "
                           f"--checkpoint-dir") from None


def _warn_skipped(skipped: list[str], chosen: Path | None) -> None:
    instead = f"; loading {chosen.name} instead" if chosen is not None else ""
    for problem in skipped:
        print(f"autopar: warning: skipping {problem}{instead}", file=sys.stderr)


