"""Turning pydantic's multi-line validation reports into the one line a user error must be."""

from __future__ import annotations

from pydantic import ValidationError

_MESSAGES = {
    "missing": "missing (required)",
    "extra_forbidden": "unknown field (check its spelling)",
}


def one_line(text: str, max_chars: int = 300) -> str:
    """Collapse whitespace and newlines, and cut long text, so an error stays one readable line."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= max_chars else flat[: max_chars - 3] + "..."


def condense_validation_error(error: ValidationError) -> str:
    """The first problem as `field.path: what is wrong (got X)`, plus how many more there are."""
    problems = error.errors(include_url=False)
    if not problems:
        return one_line(str(error))
    first = problems[0]
    location = ".".join(str(part) for part in first.get("loc", ()))
    message = _MESSAGES.get(first.get("type", ""), first.get("msg", "invalid"))
    message = message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    received = first.get("input")
    # Our own validators already name the input; a missing or unknown field has none worth showing.
    quiet = first.get("type") in ("value_error", "assertion_error", *_MESSAGES)
    if not quiet and received is not None and not isinstance(received, (dict, list)):
        message += f" (got {received!r})"
    text = f"{location}: {message}" if location else message
    if len(problems) > 1:
        text += f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})"
    return one_line(text)
