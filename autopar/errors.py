"""Errors a user can act on.

Every failure caused by input (a model name, a file, a shape) raises `AutoparError`: the CLI prints
its message as one line and exits with its `exit_code`, with no traceback unless `--debug` is given.
"""

from __future__ import annotations


class AutoparError(Exception):
    """A problem with the user's input: the message names the problem and the fix."""

    exit_code: int = 2

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class CaptureError(AutoparError):
    """The model could not be traced into an op graph. `in_model_code`: the model's own forward (or
    torch under it) failed, as opposed to the inputs or options handed to the trace."""

    in_model_code: bool = False
