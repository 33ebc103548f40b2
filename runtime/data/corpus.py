"""The default corpus: the Python standard library's own .py source, tokenized as bytes.

It exists offline on every machine that runs Python, so `autopar run` can train on real text with
no download: about 12 M tokens for Python 3.11, prepared on first use (0.2 s on a 2-CPU machine)
into a cache directory keyed by Python version, and shared: several processes (torchrun ranks on
one machine) may ask at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from autopar.errors import AutoparError
from autopar.runtime.data.prepare import (DEFAULT_SHARD_TOKENS, FORMAT_VERSION, ByteTokenizer, build_dataset, collect_files,
                                          is_complete_dataset, stderr_progress)

STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"})


def default_cache_dir() -> Path:
    return Path(os.environ.get("AUTOPAR_CACHE") or Path.home() / ".cache" / "autopar")


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock between processes where fcntl exists; elsewhere the first rename wins."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def default_corpus(cache_dir: str | None = None, source_dir: str | None = None) -> str:
    """The path of a byte-level dataset of the standard library's .py files (test directories and
    site-packages left out), prepared on first use and cached per Python version (3.11.7). `source_dir`
    replaces the standard library (tests use a small tree); `cache_dir` defaults to $AUTOPAR_CACHE,
    else ~/.cache/autopar.

    Several processes (torchrun ranks) may call this at once: a lock serializes them, and the
    atomic rename means a reader only ever sees a complete dataset."""
    source = Path(source_dir or sysconfig.get_paths()["stdlib"])
    version = ".".join(str(part) for part in sys.version_info[:3])  # patch releases change the stdlib too
    if source_dir is None:
        key = f"stdlib-py{version}-bytes-v{FORMAT_VERSION}"
    else:
        key = f"corpus-{hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:12]}-bytes-v{FORMAT_VERSION}"
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    out = cache / key
    if is_complete_dataset(out):
        return str(out)
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise AutoparError(f"cannot create the cache directory {cache}: {error.strerror}; set AUTOPAR_CACHE "
                           f"to a writable directory") from None
    with _file_lock(cache / f".{key}.lock"):
        if is_complete_dataset(out):  # another process built it while this one waited
            return str(out)
        if not source.is_dir():
            raise AutoparError(f"the standard library source {source} is missing: this Python ships without its "
                               f".py files; prepare a dataset with `autopar data prepare` instead")
        if out.exists():  # an incomplete or damaged cache (e.g. a shard deleted): rebuild it
            shutil.rmtree(out, ignore_errors=True)
        files, _ = collect_files([str(source)], skip_dirs=STDLIB_SKIP_DIRS)
        files = [f for f in files if f.suffix == ".py"]
        if not files:
            raise AutoparError(f"no .py files under {source}: prepare a dataset with `autopar data prepare` instead")
        print(f"autopar: preparing the default corpus ({len(files)} .py files of {source}) into {out} ...",
              file=sys.stderr, flush=True)
        try:
            summary = build_dataset(files, out, ByteTokenizer(), inputs=[str(source)], skipped=0,
                                    shard_tokens=DEFAULT_SHARD_TOKENS, text_field="text", overwrite=False,
                                    progress=stderr_progress())
        except AutoparError:
            if is_complete_dataset(out):  # lost the race to a process without the lock
                return str(out)
            raise
    print(f"autopar: default corpus ready: {summary.num_documents} documents, {summary.num_tokens:,} tokens "
          f"in {summary.seconds:.1f} s", file=sys.stderr, flush=True)
    return str(out)

