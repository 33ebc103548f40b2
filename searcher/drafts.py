"""Completions checked as drafts before any is built: the search's enumeration without a pydantic
object for each of the completions it rejects.

`candidates.valid_strategies` tries every completion of the fixed keys (78,168 for GPT-3 175B on 1,024
GPUs), and the runtime's table or a rule rejects most of them (64,086 there). Each was a `Strategy`, its
fields validated one by one, before it was looked at. A draft is a plain namespace of the same values:
the schema's model validator (`Strategy._consistent`) runs on it, so a draft exists exactly when the
Strategy would; the table and the rules read its attributes; only a draft that passes becomes a
`Strategy`, validated. That needs every value to be one the schema's fields keep as they are, so drafts
are used only when each fixed value is (`drafts_allowed`): the enumeration's own values are whole
numbers, booleans and the schema's literals. Otherwise `valid_strategies` builds each completion as
before. tests/test_planning_speed.py compares the two on fixed keys of every kind.
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace
from typing import Annotated, Any

from pydantic import TypeAdapter

from autopar.plan_schema import Strategy

_FIELDS = Strategy.model_fields
_DEFAULTS = {name: info.default for name, info in _FIELDS.items() if not info.is_required()}
_REQUIRED = _FIELDS.keys() - _DEFAULTS.keys()


@lru_cache(maxsize=None)
def _field_adapter(name: str) -> TypeAdapter:
    """A validator of one field of `Strategy`: its type with its constraints (ge, le, ...)."""
    info = _FIELDS[name]
    return TypeAdapter(Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation)


def kept_as_is(name: str, value: Any) -> bool:
    """Whether `Strategy`'s field `name` accepts `value` unchanged (valid, and not coerced)."""
    try:
        checked = _field_adapter(name).validate_python(value)
    except ValueError:
        return False
    return type(checked) is type(value) and checked == value


def drafts_allowed(fixed: dict[str, Any], world_size: Any, global_batch: Any) -> bool:
    """Whether every value a completion of `fixed` takes is one the schema keeps as it is: each fixed
    key a Strategy field whose value is `kept_as_is`, and whole numbers to derive the others from."""
    return type(world_size) is int and type(global_batch) is int and all(
        name in _FIELDS and kept_as_is(name, value) for name, value in fixed.items())


def draft(values: dict[str, Any]) -> SimpleNamespace | None:
    """The completion `values` as a namespace with the schema's defaults filled in, or None when the
    schema's model validator refuses it (as `Strategy(**values)` would)."""
    if values.keys() == _FIELDS.keys():  # every field given (the enumeration gives them all)
        namespace = SimpleNamespace(**values)
    elif _REQUIRED <= values.keys() <= _FIELDS.keys():
        namespace = SimpleNamespace(**{**_DEFAULTS, **values})
    else:  # a required field missing, or a key the schema does not have: Strategy(**values) raises
        return None
    try:
        Strategy._consistent(namespace)
    except ValueError:
        return None
    return namespace
