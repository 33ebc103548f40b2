"""`python -m autopar` is the same CLI as `autopar` (torchrun launches it this way).

A torchrun worker (WORLD_SIZE > 1) leaves with `os._exit` once the CLI returns, after flushing its
streams. `destroy_process_group()` does not stop gloo's transport and worker threads: the process
groups stay referenced from C++ and die only in the interpreter's finalizer, with their threads
still running. A C++ thread that needs the GIL then is ended by pthread_exit, and its unwinding
through noexcept code aborts with "terminate called without an active exception" (seen rarely on
a loaded machine; pytorch/pytorch#65513, #179291 describe the same teardown). By the time the CLI
returns, the run has closed everything it owns: metrics written, checkpoints published, the
group destroyed; nothing is left for the finalizer to do.
"""

import os
import sys

from autopar.cli import main


def _worker_exit(code: object) -> None:
    if isinstance(code, str):  # SystemExit("message") prints the message, as Python would
        print(code, file=sys.stderr)
        code = 1
    code = 0 if code is None else code if isinstance(code, int) else 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if os.environ.get("WORLD_SIZE", "1").strip() not in ("", "0", "1"):
    try:
        returned = main()
    except SystemExit as stop:
        returned = stop.code
    _worker_exit(returned)
raise SystemExit(main())
