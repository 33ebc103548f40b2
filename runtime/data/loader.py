"""Training data: a prepared token dataset (`TokenDataset`) and the loader that feeds each dp rank
its rows of every global batch (`TokenLoader`).

A sample is a non-overlapping window of `seq_len` tokens of the concatenated token stream (it may
cross a shard boundary or a document's end: documents are separated by the EOS id). A training
step consumes one global batch; rank r of dp takes rows [r*rows, (r+1)*rows), the block that
`ParallelModel.local_batch` gives it, so the loader and the runtime agree on who trains on what.

Order: each epoch is a permutation of all sample ids drawn from (seed, epoch); an epoch ends when
fewer than a global batch of samples remain (the tail is dropped). The loader's position is
counted in samples, not steps or ranks, so a saved state resumes exactly under another dp degree,
and under another global batch too (it continues at the same sample of the same permutation).
Preparing datasets lives in `runtime.data.prepare`, the default corpus in `runtime.data.corpus`.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autopar.errors import AutoparError
from autopar.io import contained_path
from autopar.runtime.data.prepare import FORMAT, FORMAT_VERSION, INDEX_NAME, dataset_fingerprint

__all__ = ["TokenDataset", "TokenLoader"]

STATE_FORMAT = "autopar-token-loader"
STATE_VERSION = 1
_PREPARE_AGAIN = "re-run `autopar data prepare` to rebuild the dataset"
_SCAN_TOKENS = 2**24  # tokens per vectorized max when scanning a shard (32-64 MiB of memory-mapped data)


class TokenDataset:
    """A prepared dataset, memory-mapped: reading a sample touches only its pages."""

    def __init__(self, path: str | Path) -> None:
        root = Path(path)
        if root.name == INDEX_NAME and root.is_file():
            root = root.parent
        if not root.exists():
            raise AutoparError(f"dataset {root} does not exist: prepare one with "
                               f"`autopar data prepare --input TEXT_FILES --out {root}`")
        index_path = root / INDEX_NAME
        if not index_path.is_file():
            raise AutoparError(f"{root} is not a prepared dataset (no {INDEX_NAME}): {_PREPARE_AGAIN}, "
                               f"`autopar data prepare --input TEXT_FILES --out {root}`")
        try:
            index = json.loads(index_path.read_text())
            self.dtype = np.dtype(index["dtype"]).newbyteorder("<")
            shards = [(str(s["file"]), int(s["num_tokens"]), str(s["sha256"])) for s in index["shards"]]
            num_tokens, vocab_size = int(index["num_tokens"]), int(index["vocab_size"])
            fmt, version = index["format"], int(index["format_version"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise AutoparError(f"{index_path} is unreadable or incomplete ({type(error).__name__}: {error}): "
                               f"{_PREPARE_AGAIN}") from None
        if self.dtype.name not in ("uint16", "uint32"):
            raise AutoparError(f"{index_path} names token type {self.dtype.name}, not uint16 or uint32: {_PREPARE_AGAIN}")
        if fmt != FORMAT:
            raise AutoparError(f"{index_path} is not an autopar token index (format {fmt!r}): {_PREPARE_AGAIN}")
        if version > FORMAT_VERSION:
            raise AutoparError(f"{root} was prepared by a newer autopar (format version {version}, this one reads "
                               f"up to {FORMAT_VERSION}): upgrade autopar or {_PREPARE_AGAIN}")
        if sum(n for _, n, _ in shards) != num_tokens or num_tokens <= 0:
            raise AutoparError(f"{index_path}: shard token counts do not add up to num_tokens {num_tokens}: "
                               f"{_PREPARE_AGAIN}")
        for name, count, _ in shards:
            file = contained_path(root, name, f"dataset index {index_path}", _PREPARE_AGAIN)
            if not file.is_file():
                raise AutoparError(f"shard {file} of dataset {root} is missing: {_PREPARE_AGAIN}")
            size = file.stat().st_size
            if size != count * self.dtype.itemsize:
                raise AutoparError(f"shard {file} has {size} bytes, {INDEX_NAME} says {count} {self.dtype.name} "
                                   f"tokens ({count * self.dtype.itemsize} bytes): it is truncated or was replaced; "
                                   f"{_PREPARE_AGAIN}")
        self.path = root
        self.index: dict[str, Any] = index
        self.vocab_size = vocab_size
        self.num_tokens = num_tokens
        self.eos_id: int | None = index.get("eos_id")
        self.fingerprint: str = index.get("fingerprint") or dataset_fingerprint(self.dtype.name, num_tokens,
                                                                                 index["shards"])
        self._shards = shards
        self._starts = np.cumsum([0] + [n for _, n, _ in shards], dtype=np.int64)
        self._maps: list[np.memmap | None] = [None] * len(shards)  # opened on first read

    def __repr__(self) -> str:
        return f"TokenDataset({str(self.path)!r}, {self.num_tokens} tokens, vocab {self.vocab_size})"

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    def max_token_id(self) -> int:
        """The largest id in the data, measured while preparing (no scan)."""
        if "max_token_id" in self.index:
            return int(self.index["max_token_id"])
        return max(self.scan_max_token_id(i) for i in range(self.num_shards))

    def scan_max_token_id(self, shard: int) -> int:
        """The largest id shard `shard` holds now: one sequential, vectorized read of the shard."""
        mapped = self._shard(shard)
        return max((int(mapped[start:start + _SCAN_TOKENS].max()) for start in range(0, mapped.size, _SCAN_TOKENS)),
                   default=-1)

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse a model whose embedding has no row for some id in the data, before any step.

        The index's recorded maximum is not enough: a shard overwritten at the same size keeps its
        index entry. So every shard is scanned at open (a vectorized max in blocks of 16M tokens:
        10-18 GB/s from the page cache on this project's 2-core VM, 2026-11-24, so a 10 GB dataset
        costs about a second per process, more when it must come from disk), and a shard holding an
        id the model cannot embed is named, with what it held when prepared."""
        recorded = self.max_token_id()
        if recorded >= vocab_size:
            raise AutoparError(f"dataset {self.path} holds token ids up to {recorded}, the model's vocabulary has "
                               f"{vocab_size} entries: give the model vocab ≥ {recorded + 1} (e.g. --model-config "
                               f"vocab={self.vocab_size}) or prepare the data with the model's tokenizer")
        for number, (name, _, _) in enumerate(self._shards):
            highest = self.scan_max_token_id(number)
            if highest >= vocab_size:
                entry = self.index["shards"][number]
                prepared = int(entry.get("max_token_id", recorded)) if isinstance(entry, dict) else recorded
                raise AutoparError(f"shard {self.path / name} holds token id {highest}, beyond the model's vocabulary "
                                   f"of {vocab_size} (it held ids up to {prepared} when prepared: it was modified "
                                   f"since); {_PREPARE_AGAIN}")

    def num_samples(self, seq_len: int) -> int:
        if seq_len <= 0:
            raise AutoparError(f"sequence length must be positive, got {seq_len}")
        return self.num_tokens // seq_len

    def read(self, start: int, num_tokens: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens [start, start + num_tokens) of the concatenated stream, into `out` (int64 by default)."""
        if start < 0 or start + num_tokens > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + num_tokens}) outside a dataset of {self.num_tokens}")
        if out is None:
            out = np.empty(num_tokens, dtype=np.int64)
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        filled = 0
        while filled < num_tokens:
            offset = start + filled - int(self._starts[shard])
            take = min(num_tokens - filled, self._shards[shard][1] - offset)
            out[filled:filled + take] = self._shard(shard)[offset:offset + take]
            filled += take
            shard += 1
        return out

    def sample(self, index: int, seq_len: int) -> np.ndarray:
        """Sample `index`: tokens [index*seq_len, (index+1)*seq_len), as int64."""
        if not 0 <= index < self.num_samples(seq_len):
            raise IndexError(f"sample {index} outside 0..{self.num_samples(seq_len) - 1} for seq_len {seq_len}")
        return self.read(index * seq_len, seq_len)

    def verify(self) -> None:
        """Re-hash every shard against the index (reads all the data; the constructor checks sizes only)."""
        for name, _, expected in self._shards:
            digest = hashlib.sha256()
            with open(self.path / name, "rb") as stream:
                for block in iter(lambda: stream.read(2**24), b""):
                    digest.update(block)
            if digest.hexdigest() != expected:
                raise AutoparError(f"shard {self.path / name} does not match its sha256 in {INDEX_NAME}: the file "
                                   f"was modified or damaged; {_PREPARE_AGAIN}")

    def _shard(self, number: int) -> np.memmap:
        mapped = self._maps[number]
        if mapped is None:
            name, count, _ = self._shards[number]
            mapped = np.memmap(self.path / name, dtype=self.dtype, mode="r", shape=(count,))
            self._maps[number] = mapped
        return mapped


class _BatchMaker:
    """Builds this rank's rows of the global batch at a position. The prefetch thread holds this,
    not the loader, so dropping the loader lets it be collected (and its thread stopped)."""

    def __init__(self, dataset: TokenDataset, seq_len: int, global_batch: int, dp_rank: int, rows: int,
                 seed: int, pin_memory: bool) -> None:
        self.dataset, self.seq_len, self.global_batch = dataset, seq_len, global_batch
        self.dp_rank, self.rows, self.seed, self.pin_memory = dp_rank, rows, seed, pin_memory
        self.num_samples = dataset.num_samples(seq_len)
        self._cached: tuple[int, np.ndarray] | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_samples))
        return self._cached[1]

    def make(self, epoch: int, offset: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        if self.num_samples - offset < self.global_batch:  # the tail: drop it, start the next epoch
            epoch, offset = epoch + 1, 0
        start = offset + self.dp_rank * self.rows
        sample_ids = self.permutation(epoch)[start:start + self.rows].copy()
        tokens = torch.empty((self.rows, self.seq_len), dtype=torch.long, pin_memory=self.pin_memory)
        rows = tokens.numpy()
        for row, sample in enumerate(sample_ids.tolist()):
            self.dataset.read(sample * self.seq_len, self.seq_len, rows[row])
        return tokens, torch.from_numpy(sample_ids), (epoch, offset + self.global_batch)


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _produce(maker: _BatchMaker, position: tuple[int, int], items: queue.Queue, stop: threading.Event,
             filled: threading.Condition) -> None:
    """The prefetch thread: make batches in order until stopped; an error is queued for the consumer."""

    def put(item: Any) -> None:
        while not stop.is_set():  # a bounded wait, so close() never waits on a full queue for long
            try:
                items.put(item, timeout=0.05)
                break
            except queue.Full:
                continue
        with filled:
            filled.notify_all()

    try:
        while not stop.is_set():
            item = maker.make(*position)
            position = item[2]
            put(item)
    except BaseException as error:
        put(_Failure(error))


class TokenLoader:
    """This dp rank's rows of each global batch, prefetched in a background thread.

    `next()` returns (tokens: LongTensor [global_batch // dp_size, seq_len] on `device`,
    sample_ids: LongTensor on the CPU). On CUDA the batch is built in pinned memory and copied
    with non_blocking=True. `state_dict()` records the batches handed out (never the prefetched
    ones) and does not depend on the dp rank or degree."""

    def __init__(self, dataset: TokenDataset | str | Path, seq_len: int, global_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, device: torch.device | str | None = None, prefetch: int = 2) -> None:
        if not isinstance(dataset, TokenDataset):
            dataset = TokenDataset(dataset)
        if seq_len <= 0 or global_batch <= 0:
            raise AutoparError(f"seq_len and global batch must be positive, got {seq_len} and {global_batch}")
        if dp_size <= 0 or not 0 <= dp_rank < dp_size:
            raise AutoparError(f"dp rank {dp_rank} of {dp_size} is not a valid data-parallel position")
        if global_batch % dp_size:
            raise AutoparError(f"global batch {global_batch} does not split evenly over dp={dp_size} ranks: "
                               f"use a multiple of {dp_size}")
        if seed < 0 or prefetch < 0:
            raise AutoparError(f"seed and prefetch must be 0 or more, got {seed} and {prefetch}")
        num_samples = dataset.num_samples(seq_len)
        if num_samples < global_batch:
            raise AutoparError(f"dataset {dataset.path} has {dataset.num_tokens:,} tokens = {num_samples} samples of "
                               f"{seq_len}, fewer than one global batch of {global_batch}: use more data or a "
                               f"smaller global batch or sequence length")
        self.dataset, self.seq_len, self.global_batch, self.seed = dataset, seq_len, global_batch, seed
        self.dp_rank, self.dp_size, self.rows_per_rank = dp_rank, dp_size, global_batch // dp_size
        self.num_samples, self.prefetch = num_samples, prefetch
        self.device = torch.device(device) if device is not None else None
        pin = self.device is not None and self.device.type == "cuda"
        if pin and not torch.cuda.is_available():
            raise AutoparError(f"token loader device {self.device} but this machine has no usable CUDA GPU: "
                               f"load to the CPU (device=None)")
        self._maker = _BatchMaker(dataset, seq_len, global_batch, dp_rank, self.rows_per_rank, seed, pin)
        self._epoch, self._offset = 0, 0  # the next batch handed out starts here
        self._thread: threading.Thread | None = None
        self._items: queue.Queue | None = None
        self._stop = threading.Event()
        self._filled = threading.Condition()

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def samples_in_epoch(self) -> int:
        """Samples of the current epoch's permutation handed out (to all ranks together)."""
        return self._offset

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next()

    whole_batch = False  # for the training loop: `next_batch` returns this dp rank's rows only

    def next_batch(self) -> torch.Tensor:
        """This rank's rows of the next global batch (the training loop's batch source)."""
        return self.next()[0]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the next global batch and their sample ids."""
        if self.prefetch == 0:
            tokens, sample_ids, position = self._maker.make(self._epoch, self._offset)
        else:
            tokens, sample_ids, position = self._take()
        self._epoch, self._offset = position
        if self.device is not None:
            tokens = tokens.to(self.device, non_blocking=True)
        return tokens, sample_ids

    def _take(self) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        if self._thread is None:
            self._items = queue.Queue(maxsize=self.prefetch)
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=_produce, args=(self._maker, (self._epoch, self._offset), self._items, self._stop, self._filled),
                name="autopar-token-loader", daemon=True)
            self._thread.start()
        while True:
            try:
                item = self._items.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the token loader's prefetch thread stopped without a batch") from None
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def wait_prefetched(self, timeout_s: float = 30.0) -> int:
        """Block until the prefetch queue is full (or `timeout_s` passed); returns the batches queued.
        For measuring steady state, and for tests that the state ignores prefetched batches."""
        if self.prefetch == 0 or self._thread is None:
            return 0
        with self._filled:
            self._filled.wait_for(lambda: self._items.full() or not self._thread.is_alive(), timeout=timeout_s)
        return self._items.qsize()

    def close(self) -> None:
        """Stop the prefetch thread and drop what it queued; a later `next()` starts it again."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join()
        self._items = None

    def __enter__(self) -> TokenLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed out: JSON-able and the same on every dp rank."""
        return {"format": STATE_FORMAT, "format_version": STATE_VERSION, "seed": self.seed, "epoch": self._epoch,
                "samples_in_epoch": self._offset, "seq_len": self.seq_len, "global_batch": self.global_batch,
                "dataset": {"fingerprint": self.dataset.fingerprint, "num_tokens": self.dataset.num_tokens}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where the state's loader stopped: the same sample of the same epoch permutation,
        whatever this loader's dp rank and degree. A different global batch continues from that
        sample too (the epoch then ends when fewer than the new global batch remain)."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise AutoparError(f"not a token loader state (no format {STATE_FORMAT!r}): pass the dict that "
                               f"TokenLoader.state_dict() returned")
        if int(state.get("format_version", 0)) > STATE_VERSION:
            raise AutoparError(f"token loader state has format version {state['format_version']}, this autopar "
                               f"reads up to {STATE_VERSION}: upgrade autopar")
        try:
            saved = state["dataset"]
            fingerprint, num_tokens = saved["fingerprint"], int(saved["num_tokens"])
            seed, seq_len = int(state["seed"]), int(state["seq_len"])
            epoch, offset = int(state["epoch"]), int(state["samples_in_epoch"])
        except (KeyError, TypeError, ValueError) as error:
            raise AutoparError(f"token loader state is incomplete ({type(error).__name__}: {error}): pass the dict "
                               f"that TokenLoader.state_dict() returned") from None
        if fingerprint != self.dataset.fingerprint:
            raise AutoparError(f"token loader state belongs to another dataset (fingerprint {fingerprint}, "
                               f"{num_tokens:,} tokens), this one is {self.dataset.fingerprint} "
                               f"({self.dataset.num_tokens:,} tokens): resume on the same data")
        if seq_len != self.seq_len:
            raise AutoparError(f"token loader state was saved with seq_len {seq_len}, this loader has {self.seq_len}: "
                               f"resume with sequence length {seq_len} (sample ids depend on it)")
        if seed != self.seed:
            raise AutoparError(f"token loader state was saved with seed {seed}, this loader has {self.seed}: resume "
                               f"with seed {seed} (the sample order depends on it)")
        if epoch < 0 or not 0 <= offset <= self.num_samples:
            raise AutoparError(f"token loader state position (epoch {epoch}, sample {offset}) is outside the "
                               f"dataset's {self.num_samples} samples: the state is damaged")
        self.close()
        self._epoch, self._offset = epoch, offset
