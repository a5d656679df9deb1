"""The merge policies of declared fields, as one table of pure functions.

docs/PROTOCOL.md "Declared fields": a write combines with what is stored by its field's
`merge`. Each policy is `f(old, new) -> merged`, where `old` is `MISSING` when nothing
is stored yet. A function never changes its arguments (the store's cache hands out the
stored values themselves) and refuses values of the wrong type with `MergeTypeError`;
`merge()` turns that into a `bad_envelope` naming the field and the policy.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final

from server_bridge.memory.errors import BadEnvelope

__all__ = ["MISSING", "POLICIES", "MergeTypeError", "merge"]


class _Missing:
    """What `old` is when the field or row holds nothing yet."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final = _Missing()


class MergeTypeError(TypeError):
    """A value the policy does not take; the message says what it needed."""


def _is_number(v: object) -> bool:
    # bool is an int in Python but not a number in the contract: True + 1 is a bug.
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _replace(old: Any, new: Any) -> Any:
    return new


def _append(old: Any, new: Any) -> Any:
    if old is MISSING:
        old = new[:0] if isinstance(new, (str, list)) else None
    if isinstance(old, str) and isinstance(new, str):
        return old + new
    if isinstance(old, list) and isinstance(new, list):
        return old + new
    raise MergeTypeError("needs two strings or two lists")


def _numbers(name: str, pick: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def policy(old: Any, new: Any) -> Any:
        if not _is_number(new) or (old is not MISSING and not _is_number(old)):
            raise MergeTypeError("needs numbers (a bool is not one)")
        return new if old is MISSING else pick(old, new)

    policy.__name__ = f"_{name}"
    return policy


def _identity(v: Any) -> str:
    # Items compare by their JSON text with sorted keys: 1 and True (equal in Python)
    # stay distinct, two maps with the same items in another order are one item, and
    # the lookup is a hash, not a scan, so a union costs O(len(old) + len(new)).
    return json.dumps(v, sort_keys=True, separators=(",", ":"))


def _union(old: Any, new: Any) -> Any:
    if old is MISSING:
        old = []
    if not isinstance(old, list) or not isinstance(new, list):
        raise MergeTypeError("needs two lists")
    seen = {_identity(v) for v in old}
    out = list(old)
    for v in new:
        ident = _identity(v)
        if ident not in seen:
            seen.add(ident)
            out.append(v)
    return out


def _strip_nulls(m: dict[str, Any]) -> dict[str, Any]:
    # A null in a write means "delete this key"; into an empty place it deletes nothing,
    # and must not be stored as a value either.
    return {k: _strip_nulls(v) if isinstance(v, dict) else v for k, v in m.items() if v is not None}


def _deep(old: Any, new: Any) -> Any:
    if old is MISSING:
        old = {}
    if not isinstance(old, dict) or not isinstance(new, dict):
        raise MergeTypeError("needs two maps")
    out = dict(old)
    for k, v in new.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep(out[k], v)
        else:
            out[k] = _strip_nulls(v) if isinstance(v, dict) else v
    return out


# The policies of PROTOCOL "Declared fields", by their name in a field's `merge`.
POLICIES: Final[dict[str, Callable[[Any, Any], Any]]] = {
    "replace": _replace,
    "append": _append,
    "sum": _numbers("sum", lambda a, b: a + b),
    "max": _numbers("max", max),
    "min": _numbers("min", min),
    "union": _union,
    "deep": _deep,
}


def merge(policy: str, old: Any, new: Any, field: str = "?") -> Any:
    """`new` combined with `old` by `policy`; a wrong type is `bad_envelope` naming both."""
    fn = POLICIES.get(policy)
    if fn is None:
        raise BadEnvelope(f"field {field}: no merge policy {policy!r}")
    try:
        return fn(old, new)
    except MergeTypeError as e:
        raise BadEnvelope(f"field {field}: merge {policy} {e}") from e
