"""argparse types shared by the subcommands (autopar's own and the profiler's `profile`).

Kept apart from `commands` so that a subcommand's module can use them without importing the
parser that imports it.
"""

from __future__ import annotations

import argparse


def whole_number(minimum: int):
    """An argparse type: a whole number of at least `minimum` (a size or count of 0 or less is refused
    here rather than read as "the default" or met later as a torch error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"whole number ≥ {minimum}"
    return parse


POSITIVE = whole_number(1)
NON_NEGATIVE = whole_number(0)
