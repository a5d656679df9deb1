"""Building blocks for host-side tests: event envelopes and folding them."""

from __future__ import annotations

from typing import Any

from server_bridge.host.reducer import Reducer, RunSnapshot


def ev(i: int, t: str, run: str = "r1", /, **d: Any) -> dict[str, Any]:
    """One envelope of run `run` with id `i`, type `t` and fields `d`."""
    return {"r": run, "i": i, "t": t, "ts": 1000 + i, "d": d}


def fold(events: list[dict[str, Any]]) -> RunSnapshot:
    """The snapshot a fresh reducer holds after applying `events` in order."""
    reducer = Reducer()
    snap = None
    for e in events:
        snap = reducer.apply(e)
    assert snap is not None, "no events to fold"
    return snap
