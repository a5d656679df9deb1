"""What of a run's events may reach hosts: the bridge's own redaction of private fields.

The board already shows a memory tool call that touches a private field (or core
memory) by its name only, and sends no `mem.*`, `row` or `output` event about one
(PROTOCOL "Events", "Memory tools the model sees"). The bridge applies the same rules
again to every event before hosts, the event log or the HTTP streams see it, from the
fields the device's hello declares: a board with a bug, an old firmware or an app
handler of its own that emits a private value gets it blanked here, counted and logged,
rather than shown to a dashboard and kept for a month in the log. A field the hello
does not declare is private (as on the board); a device whose hello the bridge does
not hold has no public fields, so its memory tool calls are all shown by name only.

Only the event types below are looked at; every other event passes untouched (and
without being copied).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LOOKED_AT", "Declared", "Redactor", "declared"]

#: The event types that can carry a field's data to hosts.
LOOKED_AT = frozenset({"tool.call", "tool.result", "mem.write", "mem.recall", "row",
                       "row.delete", "output"})  # fmt: skip

# Devices whose declarations are kept; past it the least recently declared is let go
# (its calls are then shown by name only until its next hello).
_DEVICES = 100_000
# Memory calls shown by name only whose result is still to come, across all runs: their
# results are blanked too. Past it the oldest is let go (its result, long overdue, then
# goes by the rule for results: see Redactor.redact).
_BLANKED_CALLS = 4096


@dataclass(frozen=True)
class Declared:
    """What a hello says may be shown: `public` the names of public fields that are not
    core memory, `tables` those of them that are streamed collections, and whether
    any collection is private (a recall over every collection may touch one)."""

    public: frozenset[str] = frozenset()
    tables: frozenset[str] = frozenset()
    private_collections: bool = False


NOTHING_PUBLIC = Declared()


def declared(fields: Any) -> Declared:
    """The declarations of a hello's `fields`, read as the board reads them: a
    malformed entry declares nothing public."""
    public, tables, private_collections = set(), set(), False
    for f in fields if isinstance(fields, list) else ():
        if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
            continue
        collection = f.get("kind") == "collection"
        if f.get("vis") == "public" and f.get("core") is not True:
            public.add(f["name"])
            if collection and f.get("stream") is True:
                tables.add(f["name"])
        elif collection:
            private_collections = True
    return Declared(frozenset(public), frozenset(tables), private_collections)


class Redactor:
    """The bridge's redaction (module docstring). Called by the intake under its lock,
    on paho's network thread: nothing here waits."""

    def __init__(self) -> None:
        self._devices: OrderedDict[str, Declared] = OrderedDict()
        self._blanked: OrderedDict[tuple[str, str, str], None] = OrderedDict()

    def declare(self, device: str, fields: Any) -> None:
        """A device's hello came: its fields are what its events are read by."""
        self._devices.pop(device, None)
        self._devices[device] = declared(fields)
        while len(self._devices) > _DEVICES:
            self._devices.popitem(last=False)

    def redact(self, device: str, event: dict[str, Any]) -> dict[str, Any] | None:
        """The event as hosts may see it, or None when it may be shown as it is. `event`
        is a checked envelope; it is not changed (a copy is returned)."""
        t, d = event["t"], event["d"]
        if t not in LOOKED_AT:
            return None
        decl = self._devices.get(device, NOTHING_PUBLIC)
        if t == "tool.call":
            name = d.get("name")
            if not isinstance(name, str) or not name.startswith("memory."):
                return None
            key = (device, event["r"], str(d.get("call")))
            if not self._private_call(decl, name, d.get("input")):
                return None
            self._blanked[key] = None
            while len(self._blanked) > _BLANKED_CALLS:
                self._blanked.popitem(last=False)
            if d.get("input") in ("{}", "", None):
                return None  # shown by name only already, as the board should
            return {**event, "d": {**d, "input": "{}"}}
        if t == "tool.result":
            key = (device, event["r"], str(d.get("call")))
            if key not in self._blanked:
                return None
            del self._blanked[key]
            if d.get("output") in ("", None):
                return None
            return {**event, "d": {**d, "output": ""}}
        field = d.get("field") if t != "output" else d.get("name")
        if t in ("row", "row.delete"):
            shown = field in decl.tables
        elif t == "mem.recall" and field is None:
            shown = not decl.private_collections
        else:
            shown = field in decl.public
        if shown:
            return None
        return {**event, "d": {"redacted": True}}

    @staticmethod
    def _private_call(decl: Declared, name: str, text: Any) -> bool:
        # The board's rule (edge_runtime/memtools.py, MemoryTools.private): arguments
        # that are not a JSON object name no field, and no field is not a public one.
        try:
            args = json.loads(text) if isinstance(text, str) and text else {}
        except ValueError:
            args = None
        field = args.get("field") if isinstance(args, dict) else None
        if name == "memory.recall" and field is None and isinstance(args, dict):
            return decl.private_collections
        return field not in decl.public
