"""Live events for the HTTP streams: the intake hands each event it sends hosts to the
hub (on paho's network thread, under its lock: never waits), and the hub hands it to the
SSE streams that follow that run, each a bounded queue read by the HTTP server's event
loop.

A stream whose reader is slower than its run is cut, not buffered without bound: past
QUEUE_EVENTS events waiting, its queue is marked cut (the stream then ends with an
`error` event saying so, and its reader resumes with Last-Event-ID, from the window or
the log). Nothing else is held for it.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass, field

__all__ = ["QUEUE_EVENTS", "EventHub", "Follower"]

#: Events a stream may have waiting before it is cut as too slow.
QUEUE_EVENTS = 4096

# (tenant, device, run); run "" follows every run of the device.
Key = tuple[str, str, str]


@dataclass(eq=False)
class Follower:
    """One stream's view of the hub: what came since it last read, or why it was cut."""

    key: Key
    loop: asyncio.AbstractEventLoop
    limit: int
    events: deque[tuple[str, int, bytes]] = field(default_factory=deque)
    cut: str | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def take(self) -> list[tuple[str, int, bytes]]:
        """What came since the last take (run, id, payload), oldest first. Read on the
        loop's thread; the deque's append and popleft are atomic."""
        out = []
        while self.events:
            out.append(self.events.popleft())
        self.wake.clear()
        if self.events:  # one came between the loop and the clear
            self.wake.set()
        return out

    async def wait(self, timeout_s: float) -> bool:
        """Until something came or it was cut (True), or `timeout_s` passed (False)."""
        if self.events or self.cut:
            return True
        try:
            await asyncio.wait_for(self.wake.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True


class EventHub:
    def __init__(self, limit: int = QUEUE_EVENTS) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._followers: dict[Key, set[Follower]] = {}
        self.cut = 0  # streams cut as too slow

    def follow(self, tenant: str, device: str, run: str) -> Follower:
        """Start following a run (run "": every run of the device). Call on the
        event loop that will read it."""
        f = Follower((tenant, device, run), asyncio.get_running_loop(), self.limit)
        with self._lock:
            self._followers.setdefault(f.key, set()).add(f)
        return f

    def leave(self, f: Follower) -> None:
        with self._lock:
            group = self._followers.get(f.key)
            if group is not None:
                group.discard(f)
                if not group:
                    del self._followers[f.key]

    @property
    def following(self) -> int:
        with self._lock:
            return sum(len(g) for g in self._followers.values())

    def publish(self, tenant: str, device: str, run: str, i: int, payload: bytes) -> None:
        """An event hosts are sent (the intake, on paho's thread): to each follower of
        its run and of its device. Never waits."""
        with self._lock:
            if not self._followers:
                return
            groups = [
                self._followers.get((tenant, device, run)),
                self._followers.get((tenant, device, "")),
            ]
            targets = [f for g in groups if g for f in g]
        for f in targets:
            if f.cut:
                continue
            if len(f.events) >= f.limit:
                f.cut = f"the stream fell {f.limit} events behind its run; resume it"
                self.cut += 1
            else:
                f.events.append((run, i, payload))
            if f.wake.is_set():
                continue  # woken already and not read since (Follower.take looks again)
            try:
                f.loop.call_soon_threadsafe(f.wake.set)
            except RuntimeError:  # its loop has closed: the stream is gone
                self.leave(f)
