"""What the HTTP API sends: a run's snapshot as JSON, an event as one SSE frame, and the
status of each refusal kind."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgpack

from server_bridge.host.reducer import Row, RunSnapshot, composites

__all__ = ["STATUS", "event_json", "sse_comment", "sse_frame", "snapshot_json"]

# A refusal's kind -> its HTTP status. Anything else is 400 (the caller's message).
STATUS = {
    "bad_token": 401,
    "forbidden": 403,
    "unknown_device": 404,
    "unknown_run": 404,
    "device_offline": 409,
    "too_large": 413,
    "rate_limited": 429,
    "busy": 503,
}


def event_json(payload: bytes) -> dict[str, Any]:
    """An event as hosts were sent it (msgpack), decoded for JSON."""
    env = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(env, dict):
        raise ValueError("an event is a map")
    return env


def _plain(value: Any) -> Any:
    # msgpack may carry bytes (a `bin`): JSON has no such thing; said as hex.
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((_plain(v) for v in value), key=str)
    return value


def sse_frame(run: str, env: dict[str, Any], event: str | None = None) -> bytes:
    """One SSE event: `id: <run>:<event id>` (none for the bridge's own notes), the
    type, and the envelope as JSON on one `data:` line (LF line ends only)."""
    lines = []
    i = env.get("i")
    if event is None and isinstance(i, int):
        lines.append(f"id: {run}:{i}")
    lines.append(f"event: {event or env.get('t', 'message')}")
    lines.append("data: " + json.dumps(_plain(env), separators=(",", ":"), ensure_ascii=False))
    return ("\n".join(lines) + "\n\n").encode()


def sse_comment(text: str) -> bytes:
    """A comment line: a heartbeat no client shows, which keeps proxies from closing
    an idle stream."""
    return f": {text}\n\n".encode()


def _row(row: Row) -> dict[str, Any]:
    # A field left at its empty value is left out (so `delivery`, `node` and `act` only
    # where known); host/reducer.mjs writes rows by the same rule.
    d = {k: v for k, v in dataclasses.asdict(row).items() if v not in (None, "", [], False, 0)}
    d["kind"] = row.kind
    return _plain(d)


def snapshot_json(snap: RunSnapshot) -> dict[str, Any]:
    """A run's snapshot as a UI renders it (public fields of host/reducer.py), with its
    composite rows (`composites`, derived, never stored). host/reducer.mjs
    `snapshotJson` gives the same, byte for byte once canonical (tests/test_reducer_fixtures.py)."""
    return _plain({
        "run": snap.run,
        "device": snap.device,
        "req": snap.req,
        "conv": snap.conv,
        "agent": snap.agent,
        "version": snap.version,
        "status": snap.status,
        "error": snap.error,
        "retryable": snap.retryable,
        "reason": snap.reason,
        "usage": dataclasses.asdict(snap.usage),
        "rows": [_row(r) for r in snap.rows],
        "pending": sorted(snap.pending),
        "tables": {name: [_row(r) for r in snap.table(name)] for name in snap.tables},
        "lastId": snap.last_id,
        "gaps": [list(g) for g in snap.gaps],
        "errors": snap.errors,
        "citations": snap.citations,
        "nodes": {path: dataclasses.asdict(n) for path, n in snap.nodes.items()},
        "edges": [{"from": a, "port": p, "to": b, "taken": n}
                  for (a, p, b), n in snap.edges.items()],  # fmt: skip
        "budgets": {k: dataclasses.asdict(b) for k, b in snap.budgets.items()},
        "composites": composites(snap),
    })
