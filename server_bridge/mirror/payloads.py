"""What the JSON mirror publishes, as bytes (PROTOCOL.md "JSON mirror").

An event is its envelope as hosts were sent it, decoded from msgpack and written as
JSON with the same keys in the same order (`r`, `i`, `t`, `ts`, `n`, `a`, `k`, `d`):
no key is added, none renamed. JSON has no bytes: a msgpack `bin` (which no event of
the contract carries) is written as its hex digits, as the HTTP API writes it; a float
JSON cannot hold (NaN, an infinity) as null, so every payload is strict JSON that any
parser takes (Python's json would write `NaN`, which JavaScript's JSON.parse refuses).
UTF-8, compact (no spaces).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import msgpack

__all__ = ["answer", "decode_event", "dumps", "presence", "status"]

# What of a kept status the mirror shows: what the HTTP API's device list shows as a
# device's `presence` (intake.py keeps exactly these: the board's fields, and `seen` and
# `since`, Unix seconds).
_STATUS_KEYS = ("st", "fw", "agent", "ver", "heap", "boot", "reset", "seen", "since")


def _hex(value: object) -> str:
    # json's `default`: called for what it cannot write, which from msgpack is bytes.
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    raise TypeError(f"{type(value).__name__} is not JSON")


def _plain(value: Any) -> Any:
    """`value` with what JSON cannot hold made so: bytes as hex, keys as str, NaN and
    infinities as None. Only for the rare payload the fast path refused; its depth is
    bounded by the bridge's decode limits, which every event passed."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {_key(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _key(key: object) -> str:
    if isinstance(key, bytes | bytearray | memoryview):
        return bytes(key).hex()
    return key if isinstance(key, str) else json.dumps(_plain(key))


def dumps(obj: Any) -> bytes:
    """`obj` as compact, strict JSON in UTF-8."""
    try:
        text = json.dumps(
            obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=_hex
        )
    except (TypeError, ValueError):  # a key JSON cannot hold, or NaN: the slow path
        text = json.dumps(_plain(obj), separators=(",", ":"), ensure_ascii=False)
    return text.encode()


def decode_event(payload: bytes) -> dict[str, Any]:
    """An event as hosts were sent it (msgpack) as a dict; ValueError if it is not a
    map (the intake encoded it, so only a bug of ours gets there)."""
    env = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(env, dict):
        raise ValueError("an event is a map")
    return env


def presence(st: str, since_ms: int | None) -> bytes:
    """`{"st", "since"}`: the device's presence as the bridge tells hosts on `_b`
    (PROTOCOL.md "Presence at the host"), `since` Unix ms."""
    out: dict[str, Any] = {"st": st}
    if since_ms is not None:
        out["since"] = since_ms
    return dumps(out)


def status(kept: Mapping[str, Any]) -> bytes:
    """The device's last status as the bridge keeps it: the map the HTTP API's device
    list gives as its `presence` (`seen`, `since`: Unix seconds)."""
    return dumps({k: kept[k] for k in _STATUS_KEYS if k in kept})


def answer(
    run: str,
    text: str,
    ts: object,
    at_ms: int,
    *,
    cut: bool = False,
    req: str | None = None,
    conv: str | None = None,
    input: str | None = None,
) -> bytes:
    """`{"r", "text", "ts", "at", "req", "conv", "input", "cut"}`: the answer of a run
    that ended `run.done` (its last assistant message with text), `ts` its run.done's
    (the board's clock, as in every event) and `at` when the bridge saw it (Unix ms),
    with what was asked (run.started's `input`, which the board cuts to 512
    characters); `cut` true only when the text was cut to the mirror's bound. Absent
    keys were unknown."""
    out: dict[str, Any] = {"r": run, "text": text}
    if isinstance(ts, int) and not isinstance(ts, bool):
        out["ts"] = ts
    out["at"] = at_ms
    for key, value in (("req", req), ("conv", conv), ("input", input)):
        if value is not None:
            out[key] = value
    if cut:
        out["cut"] = True
    return dumps(out)
