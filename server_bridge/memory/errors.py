"""The refusals of the memory methods, one exception per error kind of the contract.

docs/PROTOCOL.md "Errors": every refusal names its kind. A `MemoryFault` carries that
kind, a short customer-safe message and `extra`, the fields that ride in the RPC error
map beside `kind` and `msg` (a `conflict` carries the current `value`/`doc` and `ver`,
so the caller can retry without another read).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BadEnvelope",
    "Conflict",
    "Forbidden",
    "MemoryFault",
    "NoScope",
    "NotFound",
    "OverLimit",
    "UnknownField",
    "UnknownMethod",
    "WReused",
    "WStale",
]

# The bridge's error messages are short (server_bridge.wire.MAX_ERROR_MSG); repeated here
# rather than imported so this module stays free of the wire codec.
_MAX_MSG = 200


class MemoryFault(Exception):
    """A memory call refused by the contract; `kind` is its name in PROTOCOL "Errors"."""

    kind = "bad_envelope"

    def __init__(self, msg: str, **extra: Any):
        super().__init__(msg)
        self.msg = msg[:_MAX_MSG]
        self.extra: dict[str, Any] = extra

    def to_error(self) -> dict[str, Any]:
        """The RPC error map: `{kind, msg, **extra}`."""
        return {**self.extra, "kind": self.kind, "msg": self.msg}


class UnknownField(MemoryFault):
    kind = "unknown_field"


class NoScope(MemoryFault):
    kind = "no_scope"


class Forbidden(MemoryFault):
    kind = "forbidden"


class NotFound(MemoryFault):
    kind = "not_found"


class Conflict(MemoryFault):
    kind = "conflict"


class WReused(MemoryFault):
    kind = "w_reused"


class WStale(MemoryFault):
    """A write id of a run or boot the device's ledger has closed (ledger.py): it may
    have been applied long ago, and applying it now could bring back what was since
    forgotten, so it is never applied."""

    kind = "w_stale"


class OverLimit(MemoryFault):
    kind = "over_limit"


class BadEnvelope(MemoryFault):
    """Arguments missing, of the wrong type or over their size."""

    kind = "bad_envelope"


class UnknownMethod(MemoryFault):
    kind = "unknown_method"
