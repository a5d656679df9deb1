"""The JSON mirror: the events, presence and status of the tenants that opt in, as JSON.

`wren bridge --json-mirror TENANT` (repeatable; `*` for every tenant) republishes, for
those tenants, what their hosts already get as msgpack, as JSON on topics beside it
(topics.py), for the dashboards people already run (Node-RED, Home Assistant): each
event of a run as delivered to hosts, the device stream, each device's presence and
last status, and each user's last answer on each device (retained). PROTOCOL.md "JSON
mirror" has the table.

What it mirrors is what the intake delivered: after the bridge's redaction of private
fields (privacy.py runs before the intake's hook), and only what hosts were sent.

It never holds up the relay. The intake's hook (`delivered`, on paho's network thread,
under the intake's lock) only puts the event's bytes in a bounded queue of the mirror's
own and wakes its thread when that thread waits; a full queue refuses the event,
counted (`mirror.dropped.queue`, `tenant.T.mirror.dropped`) and logged once per
episode, never silently. The mirror's thread decodes, writes the JSON and offers it to
the bridge's lanes as one more message of the event's device (lanes.Outbox.offer_event:
the tenant's link, in the device's turn), only while that device's queue, its tenant's
and the memory budget are at most half full (`has_room`, the intake's own measure for
fetching deferred events again); otherwise it is dropped, counted
(`mirror.dropped.lanes`). So the mirror takes at most half the room the relay has, and
never an event's place: the relay's events are refused only where they would be
without it, less the half the mirror may hold. The retained messages (presence,
status, answers) are few (a status change, a finished run) and must not be lost: each
is kept by topic until the tenant's board lane takes it (the one lane that publishes
retained, lanes.Outbox.board, refusable so it never waits), a newer value replacing
an older one not yet sent, and retried every RETRY_S while that lane is full.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Mapping
from typing import Any

from server_bridge.config import EVERY_TENANT, BridgeConfig
from server_bridge.lanes import Outbox
from server_bridge.mirror import payloads
from server_bridge.mirror.runs import Runs
from server_bridge.mirror.topics import (
    ANSWER,
    PRESENCE,
    STATUS,
    device_json_topic,
    user_json_topic,
)
from server_bridge.topics import UNOWNED
from server_bridge.wire import DEVICE_RUN

__all__ = [
    "KIND",
    "QUEUE_BYTES",
    "QUEUE_EVENTS",
    "STATE_TOPICS",
    "Delivered",
    "JsonMirror",
    "both",
]

log = logging.getLogger("wren.bridge.mirror")

Count = Callable[[str, int], None]
# The intake's hook: (tenant, device, run, id, payload as hosts were sent it).
Delivered = Callable[[str, str, str, int, bytes], None]

#: The mirror's messages in the lanes' counters (lanes.Kind: `evt.forwarded` counts
#: the relay's events alone).
KIND = "json"
#: The mirror's queue: events delivered and not yet written as JSON, at most this many
#: and this many bytes (each payload and OVERHEAD). 8,192 events is half a second of the
#: bridge's highest lossless relay (about 18,000 events/s, DESIGN.md); 8 MiB is 512
#: events at the 16 KiB size limit. Past either the event is not mirrored (counted).
QUEUE_EVENTS = 8192
QUEUE_BYTES = 8 << 20
OVERHEAD = 128  # a queued tuple's own bytes, as lanes.OVERHEAD
#: Retained messages waiting for the board lane, one per topic (a newer value replaces
#: an older): two per device and one per (device, user) with an answer; past this many
#: the oldest waiting is dropped, counted (`mirror.state.dropped`).
STATE_TOPICS = 65_536
#: How often a retained message the board lane refused is offered again.
RETRY_S = 0.05
# Events taken from the queue at once (one lock round trip for a batch under a flood).
_BATCH = 256
# The thread's longest sleep with nothing to do (it is woken for work; this only bounds
# a missed wake-up).
_IDLE_S = 0.5
# How long stop() lets the thread hand what is queued to the lanes.
_DRAIN_S = 2.0


def both(first: Delivered, then: Delivered) -> Delivered:
    """One intake hook that calls `first`, then `then`."""

    def delivered(tenant: str, device: str, run: str, i: int, payload: bytes) -> None:
        first(tenant, device, run, i, payload)
        then(tenant, device, run, i, payload)

    return delivered


class JsonMirror:
    """The mirror of one bridge (module docstring). `tenants`: the tenant ids that opted
    in, or EVERY_TENANT among them for all. Its hooks: `delivered` (the intake's),
    `status` (a device's status the bridge took) and `presence` (the bridge told a
    device's hosts it is offline, or back). start() before the bridge, stop() before
    it stops (its queue drained into the lanes, which the bridge's stop hands to the
    broker); what is delivered after stop() is counted `mirror.dropped.stopped`."""

    def __init__(
        self,
        prefix: str,
        tenants: Collection[str],
        lanes: Outbox,
        count: Count,
        *,
        max_runs: int = BridgeConfig.max_runs,
        queue_events: int = QUEUE_EVENTS,
        queue_bytes: int = QUEUE_BYTES,
        state_topics: int = STATE_TOPICS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prefix = prefix
        self.every = EVERY_TENANT in tenants
        self.tenants = frozenset(t for t in tenants if t != EVERY_TENANT)
        self._lanes = lanes
        self._count = count
        self._clock = clock
        self._max_events = queue_events
        self._max_bytes = queue_bytes
        self._max_state = state_topics
        # The hooks' side and the thread's, under one condition: the queue, the retained
        # messages waiting, and whether the thread waits for work.
        self._cond = threading.Condition()
        self._queue: deque[tuple[str, str, str, bytes]] = deque()
        self._queued_bytes = 0
        self._state: OrderedDict[str, tuple[str, bytes]] = OrderedDict()
        self._state_at = 0.0  # no retry of the board lane before this (clock)
        self._idle = False
        self._started = False
        self._stopping = False
        self._stopped = False
        self._drain_until = 0.0
        self._thread: threading.Thread | None = None
        # A drop episode: logged at its first drop, and at its end with how many.
        self._dropping = 0
        # The presence each device was last told as (under the condition, bounded like
        # the retained messages); what the mirror keeps of each run (its thread's alone).
        self._presence: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._runs = Runs(max_runs)

    @classmethod
    def for_config(cls, config: BridgeConfig, lanes: Outbox, count: Count) -> JsonMirror:
        """The mirror of `config.json_mirror`'s tenants."""
        return cls(config.prefix, config.json_mirror, lanes, count, max_runs=config.max_runs)

    def mirrors(self, tenant: str) -> bool:
        """Whether `tenant` opted in."""
        return self.every or tenant in self.tenants

    # ------------------------------------------------------------------ the hooks

    def delivered(self, tenant: str, device: str, run: str, i: int, payload: bytes) -> None:
        """The intake's hook (paho's network thread, the intake's lock held): queue the
        event, or count it dropped. Never raises, never waits."""
        if not (self.every or tenant in self.tenants):
            return
        try:
            cost = len(payload) + OVERHEAD
            first = False
            with self._cond:
                if self._stopped or not self._started:
                    why = "stopped"
                elif (
                    len(self._queue) >= self._max_events
                    or self._queued_bytes + cost > self._max_bytes
                ):
                    why = "queue"
                    self._dropping += 1
                    first = self._dropping == 1
                else:
                    why = ""
                    self._queue.append((tenant, device, run, payload))
                    self._queued_bytes += cost
                    if self._idle:
                        self._cond.notify()
            if why:
                self._dropped(why, tenant)
                if why == "queue" and first:
                    log.warning(
                        "the JSON mirror is behind: its queue holds %d events; events are "
                        "not mirrored until it catches up (counted mirror.dropped.queue)",
                        self._max_events,
                    )
        except Exception:
            # Our bug: logged, counted, and never the relay's problem.
            log.exception("the JSON mirror failed to queue an event of %s/%s", tenant, device)
            self._count("callback_errors", 1)

    def status(self, tenant: str, device: str, kept: Mapping[str, Any]) -> None:
        """A status of `device` the bridge took (intake.handle_status's map): retained on
        `json/status`, and, online, the device's presence (online since when it came)."""
        if not (self.every or tenant in self.tenants):
            return
        try:
            self._put(tenant, device_json_topic(self.prefix, tenant, device, STATUS),
                      payloads.status(kept))  # fmt: skip
            if kept.get("st") == "online":
                since = kept.get("since")
                ms = int(since * 1000) if isinstance(since, int | float) else None
                self._tell(tenant, device, "online", ms)
        except Exception:
            log.exception("the JSON mirror failed to take a status of %s/%s", tenant, device)
            self._count("callback_errors", 1)

    def presence(self, tenant: str, device: str, d: Mapping[str, Any]) -> None:
        """The bridge's `presence` report `{st, since}` to the device's hosts (offline
        past the grace, or back): retained on `json/presence`."""
        if not (self.every or tenant in self.tenants):
            return
        try:
            since = d.get("since")
            self._tell(tenant, device, str(d.get("st")), since if isinstance(since, int) else None)
        except Exception:
            log.exception("the JSON mirror failed to take the presence of %s/%s", tenant, device)
            self._count("callback_errors", 1)

    def _tell(self, tenant: str, device: str, st: str, since_ms: int | None) -> None:
        """The device's presence, when it changed since the mirror last said it."""
        key = (tenant, device)
        with self._cond:
            if self._presence.get(key) == st:
                return
            self._presence[key] = st
            self._presence.move_to_end(key)
            while len(self._presence) > self._max_state:
                self._presence.popitem(last=False)
        self._put(tenant, device_json_topic(self.prefix, tenant, device, PRESENCE),
                  payloads.presence(st, since_ms))  # fmt: skip

    def _put(self, tenant: str, topic: str, payload: bytes) -> None:
        """A retained message to send, replacing any older one of its topic still
        waiting."""
        dropped = False
        with self._cond:
            self._state.pop(topic, None)
            self._state[topic] = (tenant, payload)
            if len(self._state) > self._max_state:
                self._state.popitem(last=False)
                dropped = True
            if self._idle:
                self._cond.notify()
        if dropped:
            self._count("mirror.state.dropped", 1)
            log.warning("the JSON mirror dropped a retained message: %d wait already",
                        self._max_state)  # fmt: skip

    def _dropped(self, why: str, tenant: str) -> None:
        self._count(f"mirror.dropped.{why}", 1)
        self._count(f"tenant.{tenant}.mirror.dropped", 1)

    # ------------------------------------------------------------------ the thread

    def start(self) -> None:
        with self._cond:
            if self._started:
                return
            self._started = True
        self._thread = threading.Thread(target=self._loop, name="wren-bridge-mirror", daemon=True)
        self._thread.start()

    def stop(self, drain_s: float = _DRAIN_S) -> int:
        """Hand what is queued to the lanes (for up to drain_s), then stop; returns how
        many events and retained messages were left (counted `mirror.unsent_at_stop`)."""
        with self._cond:
            self._stopping = True
            self._drain_until = self._clock() + drain_s
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(drain_s + 1.0)
            self._thread = None
        with self._cond:
            self._stopped = True
            left = len(self._queue) + len(self._state)
            self._queue.clear()
            self._queued_bytes = 0
            self._state.clear()
        if left:
            self._count("mirror.unsent_at_stop", left)
            log.warning("the JSON mirror stopped with %d messages not handed to the lanes", left)
        return left

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    now = self._clock()
                    if self._stopping and (now >= self._drain_until or not self._pending(now)):
                        return
                    if self._pending(now):
                        break
                    wait = _IDLE_S
                    if self._state:
                        wait = max(0.0, min(wait, self._state_at - now))
                    self._idle = True
                    try:
                        self._cond.wait(wait)
                    finally:
                        self._idle = False
                batch = [self._queue.popleft() for _ in range(min(_BATCH, len(self._queue)))]
                self._queued_bytes -= sum(len(p) + OVERHEAD for *_, p in batch)
                ended = self._dropping if batch and self._dropping else 0
                if ended:
                    self._dropping = 0
            if ended:
                log.info("the JSON mirror caught up: %d events were not mirrored", ended)
            for tenant, device, run, payload in batch:
                try:
                    self._mirror(tenant, device, run, payload)
                except Exception:
                    log.exception("the JSON mirror failed on an event of %s/%s", tenant, device)
                    self._count("callback_errors", 1)
            try:
                self._send_state()
            except Exception:
                log.exception("the JSON mirror failed to send a retained message")
                self._count("callback_errors", 1)

    def _pending(self, now: float) -> bool:
        """Work for the thread (the lock is held)."""
        return bool(self._queue) or (bool(self._state) and now >= self._state_at)

    def _mirror(self, tenant: str, device: str, run: str, payload: bytes) -> None:
        """One event: its JSON to its topic, through the lanes while they have room."""
        env = payloads.decode_event(payload)
        if run == DEVICE_RUN:
            topic = device_json_topic(self.prefix, tenant, device)
        else:
            forgotten = self._runs.forgotten
            usr, answer = self._runs.see(tenant, device, run, env)
            if self._runs.forgotten != forgotten:
                self._count("mirror.runs_forgotten", 1)
            topic = user_json_topic(self.prefix, tenant, device, usr or UNOWNED)
            if answer is not None:
                at = int(time.time() * 1000)
                self._put(tenant, user_json_topic(self.prefix, tenant, device,
                                                  usr or UNOWNED, ANSWER),
                          payloads.answer(answer.run, answer.text, answer.ts, at,
                                          cut=answer.cut, req=answer.req, conv=answer.conv,
                                          input=answer.input))  # fmt: skip
        data = payloads.dumps(env)
        lanes = self._lanes
        if not lanes.has_room(tenant, device) or lanes.offer_event(
            tenant, device, topic, data, kind=KIND
        ):
            self._dropped("lanes", tenant)
        else:
            self._count("mirror.events", 1)

    def _send_state(self) -> None:
        """Hand the retained messages waiting to the board lane, oldest first, until it
        refuses one (then again after RETRY_S)."""
        while True:
            with self._cond:
                if not self._state or self._clock() < self._state_at:
                    return
                topic, (tenant, payload) = next(iter(self._state.items()))
            if not self._lanes.board(topic, payload, retain=True, tenant=tenant,
                                     refusable=True):  # fmt: skip
                self._count("mirror.state.deferred", 1)
                with self._cond:
                    self._state_at = self._clock() + RETRY_S
                return
            self._count("mirror.state", 1)
            with self._cond:
                if self._state.get(topic, (None, None))[1] is payload:
                    del self._state[topic]  # not replaced meanwhile by a newer value
