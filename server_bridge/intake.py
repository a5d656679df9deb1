"""Event intake from boards: validation, gap detection, replay requests, fan-out to hosts.

Per (device, run) the intake tracks the next id it expects. An in-order event goes out
at once to P/h/T/D/evt (one envelope per message); an event past a hole is held (a
bounded buffer per run) and the board is asked once — then, with no progress, a bounded
number of times more — to resend: `ctl {op:"replay", r, after}` on P/d/D/ctl. A duplicate
(an id already passed) is dropped and counted. When the board's ring no longer holds
the missing events it says so with an `error` event of kind "gap" naming `from`..`to`;
the intake then marks those ids lost, steps past them and releases what it held. The
gap event itself is forwarded like any event, so hosts see the hole; nothing is made up
to cover it.

Hosts may ask for the recent events of a run (a bounded in-memory window per run). The
durable event log is a later issue; until then a bridge restart forgets past events.

Run state is bounded twice: per device (`max_runs_per_device`), so a device that opens
run after run only ever evicts its own oldest run states, never another tenant's; and in
total (`max_runs`), the memory bound of the process.

Also kept here, in memory: each device's capabilities from P/d/D/hello (and the decode
limits they announce, which the RPC layer sizes its answers by) and its presence from
P/d/D/status.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from edge_runtime.events import TERMINAL
from server_bridge.registry import DeviceRecord
from server_bridge.topics import device_topic, host_topic
from server_bridge.wire import (
    DEFAULT_LIMITS,
    BadEnvelope,
    Limits,
    check_events,
    decode,
    encode,
)

__all__ = ["EventIntake"]

log = logging.getLogger("wren.bridge.intake")

Publish = Callable[[str, bytes], None]  # (topic, payload), QoS 1
Count = Callable[[str, int], None]

# Only the contract's envelope keys cross to hosts; anything else a board adds stays here.
_ENVELOPE_KEYS = ("r", "i", "t", "ts", "n", "a", "k", "d")
_PRESENCE = ("online", "offline")


@dataclass(eq=False)
class _Run:
    device: str
    tenant: str
    run: str
    recent: deque[dict[str, Any]]
    expected: int = 1
    held: dict[int, dict[str, Any]] = field(default_factory=dict)
    # Ranges the board reported lost (inclusive), only those not yet passed.
    lost: list[tuple[int, int]] = field(default_factory=list)
    # The pending replay request: the expected id it asked from, when, how often.
    replay_for: int | None = None
    replay_sent: float = 0.0
    replay_attempts: int = 0
    gave_up: bool = False
    finished: bool = False


class EventIntake:
    """Accepts board events and hello/status; publishes host fan-out and replay requests."""

    def __init__(
        self,
        prefix: str,
        publish: Publish,
        count: Count | None = None,
        limits: Limits = DEFAULT_LIMITS,
        keep: int = 256,
        hold: int = 64,
        max_runs: int = 1024,
        max_runs_per_device: int = 16,
        replay_retry_s: float = 2.0,
        replay_max_attempts: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prefix = prefix
        self._publish = publish
        self._count: Count = count or (lambda name, n: None)
        self._limits = limits
        self._keep = keep
        self._hold = hold
        self._max_runs = max_runs
        self._max_runs_per_device = max_runs_per_device
        self._retry_s = replay_retry_s
        self._max_attempts = replay_max_attempts
        self._clock = clock
        # paho's network thread feeds events; the bridge's housekeeping thread ticks
        # replay retries; hosts read. One lock guards all run state. Publishing happens
        # after it is released, so no paho lock is ever taken while holding it.
        self._lock = threading.Lock()
        # Both in least-recently-used order: every event moves its run to the end.
        self._runs: OrderedDict[tuple[str, str], _Run] = OrderedDict()
        self._by_device: dict[str, OrderedDict[str, _Run]] = {}
        self._hello: dict[str, dict[str, Any]] = {}
        self._device_limits: dict[str, Limits] = {}
        self._presence: dict[str, dict[str, Any]] = {}

    # ------------------------------------------------------------------ events

    def handle_evt(self, device: DeviceRecord, payload: bytes) -> int:
        """Decode, validate and accept one `evt` payload; returns events forwarded.

        Raises a WireError (nothing of the payload is accepted) when any envelope in it
        is refused.
        """
        envelopes = check_events(decode(payload, self._limits))
        return self.accept(device, envelopes)

    def accept(self, device: DeviceRecord, envelopes: Iterable[dict[str, Any]]) -> int:
        """Accept already-validated envelopes of one device, in the order given."""
        out: list[tuple[str, bytes]] = []
        now = self._clock()
        with self._lock:
            for env in envelopes:
                self._count("evt.in", 1)
                self._accept_one(device, env, now, out)
        return self._send(out)

    def _accept_one(
        self, device: DeviceRecord, env: dict[str, Any], now: float, out: list[tuple[str, bytes]]
    ) -> None:
        st = self._run(device, env["r"])
        i: int = env["i"]
        d = env["d"]
        if i < st.expected or i in st.held:
            # A duplicate gap event among them was recorded when it first arrived.
            self._count("evt.duplicate", 1)
            self._advance(st, now, out)
            return
        if env["t"] == "error" and d.get("kind") == "gap":
            # Recorded whatever the gap event's own id: the board emits it after it
            # resends what it still had, so it usually arrives past the hole it reports.
            self._record_lost(st, int(d["from"]), int(d["to"]))
        if i == st.expected:
            self._deliver(st, env, out)
        elif len(st.held) < self._hold:
            st.held[i] = env
            self._count("evt.held", 1)
        elif i < max(st.held):
            # Full: keep the ids nearest the hole; the one dropped is resent by the replay.
            st.held.pop(max(st.held))
            st.held[i] = env
            self._count("evt.hold_overflow", 1)
        else:
            self._count("evt.hold_overflow", 1)
        self._advance(st, now, out)

    def _record_lost(self, st: _Run, lo: int, hi: int) -> None:
        """Add lo..hi (inclusive) to the run's lost ranges, merged with any it overlaps.

        Merged, so the list stays a set of disjoint ranges however often the board
        reports the same or overlapping holes, and bounded like the hold buffer: the
        list only ever covers ids past `expected`, and a board reporting more separate
        holes than it may hold events is not believed past that.
        """
        lo = max(lo, st.expected)
        if hi < lo:
            return  # all of it already passed
        log.warning("device %s run %s: board reports events %d..%d lost", st.device, st.run, lo, hi)
        merged: list[tuple[int, int]] = []
        for a, b in sorted([*st.lost, (lo, hi)]):
            if merged and a <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        if len(merged) > self._hold:
            self._count("evt.lost_ranges_dropped", len(merged) - self._hold)
            merged = merged[: self._hold]
        st.lost = merged

    def _advance(self, st: _Run, now: float, out: list[tuple[str, bytes]]) -> None:
        while True:
            nxt = st.held.pop(st.expected, None)
            if nxt is not None:
                self._deliver(st, nxt, out)
                continue
            rng = next((r for r in st.lost if r[0] <= st.expected <= r[1]), None)
            if rng is None:
                break
            # Step over the lost ids, but stop at any of them that did arrive after all:
            # an event the board managed to send is delivered, not declared lost.
            target = min((h for h in st.held if st.expected < h <= rng[1]), default=rng[1] + 1)
            self._count("evt.lost", target - st.expected)
            st.expected = target
        st.lost = [r for r in st.lost if r[1] >= st.expected]
        if st.held:
            self._maybe_replay(st, now, out)
        else:
            st.replay_for, st.replay_attempts, st.gave_up = None, 0, False

    def _deliver(self, st: _Run, env: dict[str, Any], out: list[tuple[str, bytes]]) -> None:
        clean = {k: env[k] for k in _ENVELOPE_KEYS if k in env}
        st.recent.append(clean)
        st.expected = clean["i"] + 1
        if clean["t"] in TERMINAL:
            st.finished = True
        out.append((host_topic(self.prefix, st.tenant, st.device, "evt"), encode(clean)))

    def _maybe_replay(self, st: _Run, now: float, out: list[tuple[str, bytes]]) -> None:
        # One request per hole. The board answers a request by resending its whole ring
        # past `after`, usually one message per event, so while that resend is arriving
        # the hole shrinks step by step: asking again at every step would only multiply
        # resends. So a pending request is left alone for replay_retry_s; past that it
        # is repeated — with a fresh count if the hole moved since (the board is
        # answering, just not all of it yet), up to replay_max_attempts if it did not.
        if st.replay_for is not None:
            if now - st.replay_sent < self._retry_s:
                return
            if st.expected > st.replay_for:
                st.replay_attempts, st.gave_up = 0, False
            elif st.replay_attempts >= self._max_attempts:
                if not st.gave_up:
                    st.gave_up = True
                    self._count("replay.gave_up", 1)
                    log.warning(
                        "device %s run %s: no resend of events from %d after %d replay "
                        "requests; holding %d later events",
                        st.device,
                        st.run,
                        st.expected,
                        st.replay_attempts,
                        len(st.held),
                    )
                return
        st.replay_for = st.expected
        st.replay_attempts += 1
        st.replay_sent = now
        self._count("replay.sent", 1)
        ctl = {"op": "replay", "r": st.run, "after": st.expected - 1}
        out.append((device_topic(self.prefix, st.device, "ctl"), encode(ctl)))

    def _run(self, device: DeviceRecord, run: str) -> _Run:
        key = (device.device, run)
        own = self._by_device.setdefault(device.device, OrderedDict())
        st = self._runs.get(key)
        if st is not None:
            self._runs.move_to_end(key)
            own.move_to_end(run)
            return st
        st = _Run(device.device, device.tenant, run, deque(maxlen=self._keep))
        self._runs[key] = st
        own[run] = st
        # A device over its own cap makes room among its own runs: a device that opens
        # run after run (a bug, or a hostile board) cannot push out other tenants' state.
        while len(own) > self._max_runs_per_device:
            self._evict(self._oldest(own), f"over {self._max_runs_per_device} runs of one device")
        # The process-wide memory bound; with the per-device cap it is reached only when
        # many devices are busy at once.
        while len(self._runs) > self._max_runs:
            self._evict(next(iter(self._runs.values())), f"over {self._max_runs} runs tracked")
        return st

    @staticmethod
    def _oldest(own: OrderedDict[str, _Run]) -> _Run:
        # A finished run with nothing held loses nothing when forgotten, so it goes
        # first; only a device with no such run loses the state of a live one.
        for st in own.values():
            if st.finished and not st.held:
                return st
        return next(iter(own.values()))

    def _evict(self, old: _Run, why: str) -> None:
        del self._runs[(old.device, old.run)]
        own = self._by_device[old.device]
        del own[old.run]
        if not own:
            del self._by_device[old.device]
        self._count("runs.evicted", 1)
        if old.held or not old.finished:
            log.warning(
                "forgetting unfinished run %s of %s (%d held events): %s",
                old.run,
                old.device,
                len(old.held),
                why,
            )

    def _send(self, out: list[tuple[str, bytes]]) -> int:
        forwarded = 0
        for topic, payload in out:
            self._publish(topic, payload)
            if topic.endswith("/evt"):
                forwarded += 1
        self._count("evt.forwarded", forwarded)
        return forwarded

    def tick(self, now: float | None = None) -> None:
        """Retry replay requests of runs still waiting on a hole (housekeeping thread)."""
        now = self._clock() if now is None else now
        out: list[tuple[str, bytes]] = []
        with self._lock:
            for st in self._runs.values():
                if st.held:
                    self._maybe_replay(st, now, out)
        self._send(out)

    # ------------------------------------------------------------------ readers

    def events(self, device: str, run: str, after: int = 0) -> list[dict[str, Any]]:
        """The recent forwarded events of a run with id > after (bounded window)."""
        with self._lock:
            st = self._runs.get((device, run))
            return [dict(e) for e in st.recent if e["i"] > after] if st else []

    def expected(self, device: str, run: str) -> int | None:
        with self._lock:
            st = self._runs.get((device, run))
            return st.expected if st else None

    def held(self, device: str, run: str) -> list[int]:
        with self._lock:
            st = self._runs.get((device, run))
            return sorted(st.held) if st else []

    def lost(self, device: str, run: str) -> list[tuple[int, int]]:
        """The ranges the board reported lost that the run has not yet stepped past."""
        with self._lock:
            st = self._runs.get((device, run))
            return list(st.lost) if st else []

    def runs(self, device: str) -> list[str]:
        with self._lock:
            return list(self._by_device.get(device, ()))

    # ------------------------------------------------------------------ hello, status

    def handle_hello(self, device: DeviceRecord, payload: bytes) -> dict[str, Any]:
        obj = decode(payload, self._limits)
        if not isinstance(obj, dict):
            raise BadEnvelope("hello must be a map")
        for key in ("agent", "ver", "fw"):
            if key in obj and not isinstance(obj[key], str):
                raise BadEnvelope(f"hello {key} must be a str")
        for key in ("fields", "tools"):
            if key in obj and not isinstance(obj[key], list):
                raise BadEnvelope(f"hello {key} must be a list")
        if "limits" in obj and not isinstance(obj["limits"], dict):
            raise BadEnvelope("hello limits must be a map")
        limits = Limits.from_hello(obj.get("limits") or {})
        if isinstance(obj.get("agent"), str) and obj["agent"] != device.agent:
            # The registry is the authority on which agent a device runs; a mismatch is
            # worth a log line, not a refusal (a re-flashed board says hello first).
            log.warning(
                "device %s says it runs agent %r; the registry says %r",
                device.device,
                obj["agent"],
                device.agent,
            )
        with self._lock:
            self._hello[device.device] = obj
            self._device_limits[device.device] = limits
        return obj

    def handle_status(self, device: DeviceRecord, payload: bytes) -> dict[str, Any] | None:
        if not payload:
            # An empty retained message clears the status: presence unknown.
            with self._lock:
                self._presence.pop(device.device, None)
            return None
        obj = decode(payload, self._limits)
        if not isinstance(obj, dict) or obj.get("st") not in _PRESENCE:
            raise BadEnvelope('status must be a map with st "online" or "offline"')
        presence = dict(obj)
        presence["seen"] = time.time()
        with self._lock:
            self._presence[device.device] = presence
        return presence

    def device_limits(self, device: str) -> Limits | None:
        """The decode limits a device announced in its last hello (None before any)."""
        with self._lock:
            return self._device_limits.get(device)

    def capabilities(self, device: str) -> dict[str, Any] | None:
        with self._lock:
            return self._hello.get(device)

    def presence(self, device: str) -> dict[str, Any] | None:
        with self._lock:
            return self._presence.get(device)
