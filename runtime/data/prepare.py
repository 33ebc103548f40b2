"""Turning text into token shards on disk (`autopar data prepare`).

Training reads tokens through `numpy.memmap`, so preparing writes flat little-endian integer files
that need no parsing. A dataset is a directory: shards `tokens-00000.bin`, ... plus `index.json`.
It is built in a hidden temporary directory beside the target and renamed into place at the end,
so an interrupted or failed prepare never leaves a directory that looks like a dataset.

The default corpus (the standard library's own source) is in `runtime.data.corpus`.

Documents: a text file is one document; a JSONL line is one document (its `"text"` field). Empty
documents are skipped. After each document the end-of-document id is appended (byte-level: 256;
a tokenizer file: its EOS token if it has one, else nothing, so documents then run together).
A tokenizer's post-processor (e.g. a BOS token) is not applied: the EOS id alone separates
documents, GPT-style, so windows cut anywhere in the stream look like the training distribution.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from autopar.errors import AutoparError
from autopar.io import contained_path, make_hidden_directory

FORMAT = "autopar-tokens"
FORMAT_VERSION = 1
INDEX_NAME = "index.json"
SHARD_PATTERN = "tokens-{:05d}.bin"
BYTE_VOCAB_SIZE = 257  # 256 byte values + the end-of-document id
BYTE_EOS_ID = 256
DEFAULT_SHARD_TOKENS = 64 * 2**20
READ_CHUNK_BYTES = 16 * 2**20  # large text files are read (and tokenized) in pieces of this size
JSONL_BATCH_BYTES = 4 * 2**20  # JSONL documents are tokenized in batches of about this much text
JSONL_SUFFIXES = (".jsonl", ".ndjson")
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[EOS]", "<|eos|>")

Progress = Callable[[int, int, int], None]  # (files done, files in all, tokens so far)


@dataclass
class PrepareSummary:
    """What a prepare produced (the CLI prints it; `default_corpus` logs it)."""

    path: str
    num_documents: int
    num_tokens: int
    num_shards: int
    num_files: int
    skipped_files: int
    dtype: str
    vocab_size: int
    eos_id: int | None
    seconds: float


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type holding every id: uint16 up to 65,536 ids, else uint32."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


# Tokenizers: bytes (default) or a HuggingFace `tokenizers` JSON file.


class ByteTokenizer:
    vocab_size = BYTE_VOCAB_SIZE
    eos_id: int | None = BYTE_EOS_ID
    description: dict = {"kind": "bytes", "note": "token = byte value 0..255, 256 = end of document"}

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    def encode_texts(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8", "replace"), dtype=np.uint8) for t in texts]


class _FileTokenizer:
    """A user's `tokenizer.json`; the `tokenizers` package is imported only on this path."""

    def __init__(self, path: str, eos_token: str | None) -> None:
        file = Path(path)
        if not file.is_file():
            raise AutoparError(f"tokenizer file {path} does not exist: give the path of a HuggingFace tokenizer.json")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise AutoparError("--tokenizer needs the `tokenizers` package: pip install tokenizers") from None
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as error:  # the Rust side raises plain Exception on a bad file
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise AutoparError(f"cannot read tokenizer file {path} ({reason}): give a HuggingFace tokenizer.json, "
                               f"e.g. one saved with tokenizer.save()") from None
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(self.tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        if eos_token is not None:
            if eos_token not in vocab:
                raise AutoparError(f"EOS token {eos_token!r} is not in tokenizer {path}: give one of its tokens")
            self.eos_token: str | None = eos_token
        else:
            self.eos_token = next((name for name in EOS_CANDIDATES if name in vocab), None)
        self.eos_id = vocab[self.eos_token] if self.eos_token is not None else None
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        self.description = {"kind": "huggingface", "file": str(file.resolve()), "sha256": digest,
                            "eos_token": self.eos_token}

    def encode(self, data: bytes) -> np.ndarray:
        text = data.decode("utf-8", "replace")
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_texts(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]


# Finding input files.


def _is_binary(path: Path) -> bool:
    try:
        with path.open("rb") as stream:
            return b"\0" in stream.read(8192)
    except OSError as error:
        raise AutoparError(f"cannot read {path}: {error.strerror}; check that the file is readable") from None


def collect_files(inputs: list[str], skip_dirs: frozenset[str] = frozenset()) -> tuple[list[Path], int]:
    """Every file named or under a named directory (sorted, hidden entries skipped), and how many
    files under directories were skipped as binary. A named file that looks binary is an error."""
    if not inputs:
        raise AutoparError("no input given: name text/JSONL files or directories, e.g. --input corpus/")
    files: list[Path] = []
    skipped = 0
    for name in inputs:
        path = Path(name)
        if path.is_file():
            if _is_binary(path):
                raise AutoparError(f"{path} looks binary (it holds NUL bytes): give plain text or JSONL files")
            files.append(path)
        elif path.is_dir():
            found = []
            for directory, dirs, names in os.walk(path):
                if is_complete_dataset(Path(directory)):  # e.g. an earlier --out inside this input
                    dirs[:] = []
                    continue
                dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skip_dirs]
                found += [Path(directory, n) for n in names if not n.startswith(".")]
            found.sort(key=lambda p: p.relative_to(path).as_posix())
            kept = [p for p in found if p.is_file() and not _is_binary(p)]
            skipped += len(found) - len(kept)
            if not kept:
                raise AutoparError(f"no text files under {path}: give a directory holding .txt/.py/.md or .jsonl files")
            files += kept
        elif path.exists():
            raise AutoparError(f"{path} is neither a file nor a directory: give text/JSONL files or directories")
        else:
            raise AutoparError(f"data path {path} does not exist: check the path")
    return files, skipped


# Writing shards.


class _ShardWriter:
    """Appends token arrays, cutting shards at `shard_tokens` and hashing each as it is written."""

    def __init__(self, directory: Path, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.dtype, self.shard_tokens = directory, dtype, shard_tokens
        self.shards: list[dict] = []
        self.num_tokens = 0
        self.max_token_id = -1
        self._stream = None
        self._hash = None
        self._in_shard = 0
        self._shard_max = -1

    def write(self, tokens: np.ndarray) -> None:
        if tokens.size == 0:
            return
        self.max_token_id = max(self.max_token_id, int(tokens.max()))
        if self.max_token_id >= 2 ** (8 * self.dtype.itemsize):
            raise AutoparError(f"token id {self.max_token_id} does not fit {self.dtype.name}: the tokenizer's "
                               f"vocabulary size is wrong; check the tokenizer file")
        tokens = tokens.astype(self.dtype, copy=False)
        while tokens.size:
            if self._stream is None:
                self._open()
            take = min(tokens.size, self.shard_tokens - self._in_shard)
            part = np.ascontiguousarray(tokens[:take])
            self._shard_max = max(self._shard_max, int(part.max()))
            self._stream.write(memoryview(part).cast("B"))
            self._hash.update(memoryview(part).cast("B"))
            self._in_shard += take
            self.num_tokens += take
            tokens = tokens[take:]
            if self._in_shard == self.shard_tokens:
                self._close()

    def _open(self) -> None:
        name = SHARD_PATTERN.format(len(self.shards))
        self._stream = open(self.directory / name, "wb")
        self._hash = hashlib.sha256()
        self._in_shard = 0
        self._shard_max = -1
        self.shards.append({"file": name, "num_tokens": 0, "sha256": ""})

    def _close(self) -> None:
        self._stream.flush()
        os.fsync(self._stream.fileno())
        self._stream.close()
        self.shards[-1].update(num_tokens=self._in_shard, sha256=self._hash.hexdigest(),
                               max_token_id=self._shard_max)
        self._stream = None

    def finish(self) -> None:
        if self._stream is not None:
            self._close()

    def abort(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def dataset_fingerprint(dtype: str, num_tokens: int, shards: list[dict]) -> str:
    """A short hash of the content (not the path): the same tokens prepared anywhere match."""
    text = json.dumps([dtype, num_tokens, [(s["num_tokens"], s["sha256"]) for s in shards]])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# Reading documents.


def _piece_end(data: bytes) -> int:
    """How much of `data` to tokenize now (0: read more first). Text is cut after a newline; a line
    longer than 4 chunks is cut after a space, else before a UTF-8 character the cut would split."""
    newline = data.rfind(b"\n")
    if newline >= 0:
        return newline + 1
    if len(data) < 4 * READ_CHUNK_BYTES:
        return 0
    space = data.rfind(b" ")
    if space >= 0:
        return space + 1
    lead = len(data) - 1
    while lead > 0 and len(data) - lead < 4 and data[lead] & 0xC0 == 0x80:  # continuation bytes: 10xxxxxx
        lead -= 1
    first = data[lead]
    length = 2 if 0xC0 <= first < 0xE0 else 3 if 0xE0 <= first < 0xF0 else 4 if 0xF0 <= first < 0xF8 else 1
    return lead if lead + length > len(data) else len(data)


def _text_documents(path: Path, tokenizer) -> Iterator[np.ndarray]:
    """Yields the token pieces of one text file (one document), reading it in bounded chunks cut
    after a newline, so a multi-GB file never sits in memory whole."""
    carry = b""
    with path.open("rb") as stream:
        while True:
            chunk = stream.read(READ_CHUNK_BYTES)
            if not chunk:
                break
            data = carry + chunk
            cut = _piece_end(data) if isinstance(tokenizer, _FileTokenizer) else len(data)
            carry = data[cut:]
            if cut:
                yield tokenizer.encode(data[:cut])
    if carry:
        yield tokenizer.encode(carry)


def _jsonl_batches(path: Path, text_field: str, tokenizer) -> Iterator[list[np.ndarray]]:
    """Yields the token arrays of a JSONL file's documents, in batches (one array per document)."""
    texts: list[str] = []
    size = 0
    with path.open("rb") as stream:
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise AutoparError(f"{path}:{number}: not valid JSON ({error}): each line of a JSONL file must be "
                                   f"one object like {{\"{text_field}\": \"...\"}}") from None
            if not isinstance(record, dict) or text_field not in record:
                keys = ", ".join(list(record)[:8]) if isinstance(record, dict) else type(record).__name__
                raise AutoparError(f"{path}:{number}: JSONL record has no \"{text_field}\" field (it has: {keys}): "
                                   f"each line must be an object like {{\"{text_field}\": \"...\"}}, or name the "
                                   f"field with --text-field")
            text = record[text_field]
            if not isinstance(text, str):
                raise AutoparError(f"{path}:{number}: field \"{text_field}\" is a {type(text).__name__}, not a string: "
                                   f"store the document's text as a JSON string")
            if text:
                texts.append(text)
                size += len(text)
            if size >= JSONL_BATCH_BYTES:
                yield tokenizer.encode_texts(texts)
                texts, size = [], 0
    if texts:
        yield tokenizer.encode_texts(texts)


# Building and publishing a dataset.


def is_complete_dataset(path: Path) -> bool:
    """A directory whose index.json is ours and whose shards all have the size the index says."""
    try:
        index = json.loads((path / INDEX_NAME).read_text())
        itemsize = np.dtype(index["dtype"]).itemsize
        return index.get("format") == FORMAT and all(
            contained_path(path, s["file"], INDEX_NAME, "").stat().st_size == s["num_tokens"] * itemsize
            for s in index["shards"])
    except (OSError, ValueError, KeyError, TypeError, AutoparError):  # a shard outside `path`: not a dataset of ours
        return False


def _check_target(out: Path, overwrite: bool) -> None:
    if out.is_file():
        raise AutoparError(f"output {out} is a file: give a directory path for the dataset")
    if out.is_dir() and any(out.iterdir()):
        if not is_complete_dataset(out):
            raise AutoparError(f"output directory {out} is not empty and is not a prepared dataset: "
                               f"give a new or empty directory")
        if not overwrite:
            raise AutoparError(f"output directory {out} already holds a prepared dataset: pass --overwrite "
                               f"(overwrite=True) to replace it, or give another directory")


def _publish(temporary: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished dataset into place; an old complete dataset is replaced only with overwrite."""
    _check_target(out, overwrite)
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if out.is_dir():  # a complete dataset, and overwrite is set
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.replace(out, old / "data")
        try:
            os.rename(temporary, out)
        except OSError:
            os.replace(old / "data", out)  # put the old dataset back rather than leave nothing
            raise
        finally:
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(temporary, out)  # fails if another process published first: that one wins


def build_dataset(files: list[Path], out: Path, tokenizer, *, inputs: list[str], skipped: int, shard_tokens: int,
                  text_field: str, overwrite: bool, progress: Progress | None) -> PrepareSummary:
    """Tokenize `files` in order into a temporary directory beside `out`, then rename it to `out`."""
    started = time.perf_counter()
    _check_target(out, overwrite)  # fail before the work, and again at the rename
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        temporary = make_hidden_directory(out.parent, out.name, ".tmp")  # mode 0777 less the user's umask
    except OSError as error:
        raise AutoparError(f"cannot create the dataset beside {out}: {error.strerror}; "
                           f"choose a writable location") from None
    dtype = token_dtype(tokenizer.vocab_size)
    writer = _ShardWriter(temporary, dtype, shard_tokens)
    eos = np.array([tokenizer.eos_id if tokenizer.eos_id is not None else 0], dtype=np.int64)
    num_documents = 0
    try:
        for done, file in enumerate(files):
            if file.suffix.lower() in JSONL_SUFFIXES:
                for batch in _jsonl_batches(file, text_field, tokenizer):
                    pieces = []
                    for tokens in batch:
                        if tokens.size:
                            pieces += [tokens, eos] if tokenizer.eos_id is not None else [tokens]
                            num_documents += 1
                    if pieces:
                        writer.write(np.concatenate([p.astype(np.int64, copy=False) for p in pieces]))
            else:
                before = writer.num_tokens
                for tokens in _text_documents(file, tokenizer):
                    writer.write(tokens)
                if writer.num_tokens > before:
                    num_documents += 1
                    if tokenizer.eos_id is not None:
                        writer.write(eos)
            if progress is not None:
                progress(done + 1, len(files), writer.num_tokens)
        writer.finish()
        if writer.num_tokens == 0:
            raise AutoparError(f"no text found in {', '.join(inputs)}: the files are empty (or JSONL records have "
                               f"empty \"{text_field}\" fields); give files that hold text")
        index = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "dtype": dtype.name, "byte_order": "little",
            "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id, "tokenizer": tokenizer.description,
            "num_tokens": writer.num_tokens, "num_documents": num_documents, "max_token_id": writer.max_token_id,
            "shard_tokens": shard_tokens, "num_files": len(files), "skipped_files": skipped,
            "inputs": [str(i) for i in inputs], "text_field": text_field,
            "fingerprint": dataset_fingerprint(dtype.name, writer.num_tokens, writer.shards),
            "shards": writer.shards,
        }
        (temporary / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        _publish(temporary, out, overwrite)
    except BaseException as error:
        writer.abort()
        shutil.rmtree(temporary, ignore_errors=True)
        if isinstance(error, OSError):
            raise AutoparError(f"cannot prepare {out}: {error.filename or out}: {error.strerror}; check "
                               f"permissions and free space") from None
        raise
    return PrepareSummary(path=str(out), num_documents=num_documents, num_tokens=writer.num_tokens,
                          num_shards=len(writer.shards), num_files=len(files), skipped_files=skipped,
                          dtype=dtype.name, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
                          seconds=time.perf_counter() - started)


def prepare_tokens(inputs: list[str], out_dir: str, tokenizer: str | None = None, progress: Progress | None = None,
                   *, overwrite: bool = False, shard_tokens: int = DEFAULT_SHARD_TOKENS, text_field: str = "text",
                   eos_token: str | None = None) -> PrepareSummary:
    """Tokenize text/JSONL files or directories (recursively) into a memory-mappable dataset at `out_dir`.

    `tokenizer`: None for byte-level ids (vocab 257, EOS 256), or a HuggingFace tokenizer.json
    (EOS: `eos_token`, else the first of EOS_CANDIDATES it has, else none). `progress(files_done,
    files_total, tokens)` is called after each file."""
    if shard_tokens <= 0:
        raise AutoparError(f"shard size must be a positive number of tokens, got {shard_tokens}")
    inputs = [str(i) for i in ([inputs] if isinstance(inputs, (str, os.PathLike)) else inputs)]
    files, skipped = collect_files(inputs)
    encoder = _FileTokenizer(tokenizer, eos_token) if tokenizer else ByteTokenizer()
    return build_dataset(files, Path(out_dir), encoder, inputs=inputs, skipped=skipped, shard_tokens=shard_tokens,
                  text_field=text_field, overwrite=overwrite, progress=progress)


def stderr_progress(every_s: float = 0.5) -> Progress:
    """A progress callback printing at most every `every_s` seconds (and at the end) to stderr."""
    last = [time.perf_counter()]

    def report(done: int, total: int, num_tokens: int) -> None:
        now = time.perf_counter()
        if done == total or now - last[0] >= every_s:
            last[0] = now
            print(f"  {done}/{total} files, {num_tokens:,} tokens", file=sys.stderr, flush=True)

    return report
