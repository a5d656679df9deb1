"""A board's settings.json, checked before anything writes it to a board.

The board reads its settings as it boots (edge_runtime/board.py, runs.py, wifi.py,
tls.py, demo.py) and takes a value it does not expect as it comes: a port given as text,
a misspelt key (`max_paylaod`, silently the default) or a missing device id shows only
on the board's console, if at all. `wren provision` and `wren flash --settings` check a
settings file against this table first and refuse it, writing nothing, with one named
error per problem.

The table: key -> Field (its kind, whether it is required, its range, what it is). A
key the table does not name is refused: the board would ignore it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server_bridge.topics import is_id


class SettingsProblem(ValueError):
    """One problem with a settings file; `key` is its path ("wifi.ssid")."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


class UnknownKey(SettingsProblem):
    """A key the board does not read (a misspelling, most often)."""


class MissingKey(SettingsProblem):
    """A key the board cannot start without."""


class WrongType(SettingsProblem):
    """A value of another JSON type than the key's."""


class OutOfRange(SettingsProblem):
    """A number outside the range the board works in."""


class BadValue(SettingsProblem):
    """A value of the right type the board cannot use (an id no topic can hold, an
    empty Wi-Fi name, a CA file name with a directory in it)."""


class SettingsInvalid(ValueError):
    """The settings were refused; `problems` holds every problem found, in key order."""

    def __init__(self, problems: list[SettingsProblem]) -> None:
        self.problems = problems
        shown = "; ".join(str(p) for p in problems)
        super().__init__(f"settings refused ({len(problems)} problem(s)): {shown}")


# The kinds of value, as JSON has them. An int is not a bool here, though Python says so.
STR, INT, BOOL, NUMBER, OBJECT, PAIR = "string", "integer", "boolean", "number", "object", "pair"


@dataclass(frozen=True)
class Field:
    kind: str
    what: str
    required: bool = False
    lo: int | None = None
    hi: int | None = None
    # An OBJECT's own table.
    fields: dict[str, Field] = field(default_factory=dict)
    # A STR's extra rule: "id" (a topic level: device ids), "file" (a file name on the
    # board's root), "nonempty".
    rule: str = ""


_MAX = 1 << 30

WIFI = {
    "ssid": Field(STR, "the network's name", required=True, rule="nonempty"),
    "password": Field(STR, "the network's password (absent: an open network)"),
    "try_ms": Field(INT, "how long one join may take", lo=1, hi=600_000),
    "backoff_ms": Field(PAIR, "[least, most] wait between joins, in ms", lo=1, hi=3_600_000),
}
TLS = {
    "ca": Field(STR, "the CA certificate's file on the board's flash", required=True, rule="file"),
    "server_hostname": Field(STR, "the name the broker's certificate must carry", rule="nonempty"),
}
SCHEMA: dict[str, Field] = {
    "device": Field(STR, "the device id: its MQTT user and client id", required=True, rule="id"),
    "password": Field(STR, "the device's MQTT password"),
    "user": Field(STR, "the MQTT user, when not the device id", rule="nonempty"),
    "client_id": Field(STR, "the MQTT client id, when not the device id", rule="nonempty"),
    "host": Field(STR, "the broker's host, as the board reaches it", rule="nonempty"),
    "port": Field(INT, "the broker's port (1883; 8883 with tls)", lo=1, hi=65535),
    "prefix": Field(STR, "the topic prefix", rule="nonempty"),
    "keepalive": Field(INT, "MQTT keepalive, seconds", lo=0, hi=65535),
    "tls": Field(OBJECT, "TLS to the broker", fields=TLS),
    "wifi": Field(OBJECT, "the Wi-Fi network to join at boot", fields=WIFI),
    "wdt_ms": Field(INT, "the watchdog's period", lo=1, hi=_MAX),
    "max_payload": Field(INT, "the largest message received", lo=512, hi=1 << 20),
    "max_send": Field(INT, "the largest message encoded", lo=512, hi=1 << 20),
    "max_str": Field(INT, "the longest string decoded", lo=1, hi=1 << 20),
    "max_items": Field(INT, "the most items in a decoded container", lo=1, hi=1 << 16),
    "max_depth": Field(INT, "the deepest decoded nesting", lo=1, hi=64),
    "window": Field(INT, "RPC chunks sent ahead of acks", lo=1, hi=256),
    "chunk": Field(INT, "text bytes per RPC chunk", lo=16, hi=1 << 16),
    "delta_chars": Field(INT, "streamed text per delta", lo=1, hi=1 << 16),
    "delta_ms": Field(INT, "the longest a delta waits", lo=1, hi=60_000),
    "ring": Field(INT, "events each run keeps for a resend", lo=1, hi=4096),
    "ring_bytes": Field(INT, "bytes of events each run keeps", lo=64, hi=1 << 20),
    "outbox": Field(INT, "messages waiting to be sent", lo=1, hi=4096),
    "inflight": Field(INT, "QoS 1 messages awaiting PUBACK", lo=1, hi=4096),
    "stall_ms": Field(INT, "how long a run may not send before it fails", lo=1, hi=_MAX),
    "bridge_grace_ms": Field(INT, "how long the bridge may be away", lo=0, hi=_MAX),
    "concurrency": Field(INT, "runs at once", lo=1, hi=64),
    "queue": Field(INT, "requests waiting", lo=0, hi=1024),
    "flash_dir": Field(STR, "the directory the board keeps its files in"),
    "memory": Field(BOOL, "the demo agent's memory field"),
    "sim_celsius": Field(NUMBER, "the demo's simulated temperature"),
}


def _is(kind: str, value: Any) -> bool:
    if kind == STR:
        return isinstance(value, str)
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == OBJECT:
        return isinstance(value, dict)
    # PAIR: [least, most], integers.
    return isinstance(value, list) and len(value) == 2 and all(_is(INT, v) for v in value)


def _range(f: Field, key: str, value: int | float) -> SettingsProblem | None:
    if (f.lo is not None and value < f.lo) or (f.hi is not None and value > f.hi):
        return OutOfRange(key, f"{value} is outside {f.lo}..{f.hi} ({f.what})")
    return None


def _rule(f: Field, key: str, value: str) -> SettingsProblem | None:
    if f.rule == "id" and not is_id(value):
        return BadValue(key, f"{value!r} cannot be a device id (a topic level: letters, "
                        "digits, '-', '_', '.')")  # fmt: skip
    if f.rule == "file" and (not value or "/" in value or value.startswith(".")):
        return BadValue(key, f"{value!r} is not a file name on the board's root")
    if f.rule == "nonempty" and not value:
        return BadValue(key, "is empty")
    return None


def problems(doc: Any, table: dict[str, Field] = SCHEMA, at: str = "") -> list[SettingsProblem]:
    """Every problem of `doc` against `table`, in key order (none: valid)."""
    if not isinstance(doc, dict):
        return [WrongType(at or "settings", f"must be a JSON object, not {type(doc).__name__}")]
    found: list[SettingsProblem] = []
    for key in sorted(doc):
        if key not in table:
            found.append(UnknownKey(at + key, "the board reads no such key"))
    for key, f in table.items():
        name = at + key
        if key not in doc:
            if f.required:
                found.append(MissingKey(name, f"required ({f.what})"))
            continue
        value = doc[key]
        if not _is(f.kind, value):
            got = "null" if value is None else type(value).__name__
            a = "an" if f.kind[0] in "aeiou" else "a"
            found.append(WrongType(name, f"must be {a} {f.kind}, not {got} ({f.what})"))
            continue
        problem: SettingsProblem | None = None
        if f.kind == OBJECT:
            found += problems(value, f.fields, name + ".")
        elif f.kind in (INT, NUMBER):
            problem = _range(f, name, value)
        elif f.kind == PAIR:
            problem = _range(f, name, value[0]) or _range(f, name, value[1])
            if problem is None and value[0] > value[1]:
                problem = BadValue(name, f"least {value[0]} is above most {value[1]}")
        elif f.kind == STR:
            problem = _rule(f, name, value)
        if problem is not None:
            found.append(problem)
    return found


def check(doc: Any) -> dict[str, Any]:
    """`doc` when it is valid settings, else SettingsInvalid naming every problem."""
    found = problems(doc)
    if found:
        raise SettingsInvalid(found)
    return dict(doc)


def load(path: Path) -> dict[str, Any]:
    """A settings file read and checked; SettingsInvalid for one that is not JSON."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise SettingsInvalid([BadValue(str(path), f"cannot be read: {e}")]) from None
    except json.JSONDecodeError as e:
        raise SettingsInvalid([WrongType(str(path), f"is not JSON: {e}")]) from None
    return check(doc)


def dumps(doc: dict[str, Any]) -> str:
    """The file's text, checked: what is written is what was validated."""
    return json.dumps(check(doc), indent=1, sort_keys=True) + "\n"
