"""One computation run in a forked child process while this process goes on with other work.

Planning runs two independent probes of the model: the pipeline probe (`torch.export` of shallow
twins, with its imports about a second for GPT-3 175B on this project's 2-core machine) and, after
the trace, the tp dry runs (about a second more). Neither reads the other's answer, so the CLI
starts the pipeline probe in a child forked before the trace, and the tp probe in one forked after
it, while this process searches on the answer most models give and searches again only when the
child answers otherwise (`autopar.api._searched_with_tp_answer`): on a machine with a second free
core their time comes off the wall clock (for a model answering otherwise, a second search is added).

The child computes exactly what this process would (the same function on the same model, copied
at the fork); its answer comes back pickled through a pipe. Anything else (the child raised, died,
or sent nothing) and `result` computes it here, as if no child had run, so the answer, and any
error, is the one the serial code gives. A forked child is used only where fork is safe and
cheap: Linux, and a process with no other Python threads.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import weakref
from typing import Any, Callable


class Forked:
    """`compute()`, started in a forked child at construction; `result()` its answer."""

    def __init__(self, compute: Callable[[], Any]) -> None:
        self._compute = compute
        self._pid: int | None = None
        self._read: int | None = None
        if not can_fork():
            return
        read, write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: compute, send, and leave without running the parent's exit handlers
            os.close(read)
            _child(compute, write)
        os.close(write)
        self._pid, self._read = pid, read
        # an error between here and `result` (the trace refused the model) drops this object: the child is
        # stopped and reaped then, not left running
        self._stop = weakref.finalize(self, _stop, pid, read)

    def result(self) -> Any:
        """The child's answer, or `compute()` here when the child gave none."""
        answer = self._collect()
        return answer[1] if answer is not None else self._compute()

    def cancel(self) -> None:
        """Stop the child, if any is left (its answer is not needed)."""
        if self._pid is not None:
            self._pid = self._read = None
            self._stop()

    def _collect(self) -> tuple[str, Any] | None:
        if self._pid is None or self._read is None:
            return None
        self._stop.detach()
        chunks = []
        with os.fdopen(self._read, "rb") as pipe:
            while chunk := pipe.read(1 << 16):
                chunks.append(chunk)
        os.waitpid(self._pid, 0)
        self._pid = self._read = None
        try:  # the pipe was made here and only the child forked from this process writes it: no user data
            status, value = pickle.loads(b"".join(chunks))
        except Exception:  # nothing (or half) sent: the child died
            return None
        return ("ok", value) if status == "ok" else None


def can_fork() -> bool:
    """Whether a child may be forked here: Linux (macOS's system libraries are not safe to use in a
    forked child), and no other Python thread that a fork would leave holding a lock in the child."""
    return sys.platform.startswith("linux") and threading.active_count() == 1


def _child(compute: Callable[[], Any], write: int) -> None:
    try:
        try:
            payload = pickle.dumps(("ok", compute()))
        except BaseException:  # the parent computes it again and meets the error itself
            payload = pickle.dumps(("error", None))
        with os.fdopen(write, "wb") as pipe:
            pipe.write(payload)
    finally:
        os._exit(0)


def _stop(pid: int, read: int) -> None:
    """Kill the child and reap it; close our end of its pipe."""
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
    os.close(read)
