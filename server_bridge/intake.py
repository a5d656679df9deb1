"""Event intake from boards: validation, gap repair, fan-out to hosts, runs whose board is gone.

Per (device, run) the intake tracks the next id it expects and the highest id it has seen
(delivered, held, or dropped from a full hold buffer). An in-order event goes out at once
to its run's user's P/h/T/D/u/U/evt (one envelope per message, once: watchers read every
user's topic by a wildcard; the device stream "_" goes to P/h/T/D/evt; see _Run.usr and
PROTOCOL.md "Who sees what"); an event past a hole is held (a bounded buffer
per run). While any id below the highest seen is missing, the board is asked to resend,
`ctl {op:"replay", r, after}` on P/d/D/ctl: at once, then after replay_retry_s, the wait
doubling up to replay_retry_max_s, for as long as it takes. It never gives up: a hole
left open would keep the run unfinished for its hosts forever. The asking ends when the
events arrive, when the board reports them lost (an `error` event of kind "gap" naming
`from`..`to`: the intake steps past those ids and releases what it held; the report
itself is forwarded, so hosts see the hole), or when the run ends or is forgotten. A
full hold buffer drops its highest ids — the next resend brings them again — and the
highest-seen id keeps the asking going even when nothing is held. A duplicate (an id
already passed) is dropped and counted.

A run whose board is gone is ended here, since nobody else will: when a device's
`status` or `hello` carries a boot id other than the one last known (the board
restarted), or its `status` turns offline (its last will) and stays so for
`offline_grace_s`, every run of that device still open ends for hosts. The grace is
there because an offline status alone is ambiguous: a broker that shuts down publishes
the will of every client it had, so after a broker restart every board "went offline"
and came straight back, with its session and its runs intact. A board back online with
the same boot within the grace keeps its runs; so does every board when the bridge
itself lost the broker meanwhile (broker_lost). A run id begins with the boot that
started it (`<boot>.<n>`): a new boot ends the runs of other boots only, and a will
those of the boot it names, since what a board sends on different topics may arrive in
another order. The bridge owns the ids past the highest it has seen of such a run, and
forwards with them an `error` of kind "gap" for each hole no event filled and no report
covered, then `run.failed` (kind "device", retryable), so every id a host waits for is
accounted for. Later events of that run are dropped. On offline the board is also sent
`ctl cancel` for each such run (it waits in the board's persistent session); on a
restart the device stream "_" starts again at 1.

A run whose end was lost while its board stayed online (the broker dropped it: a
restart without persistence, a subscription not yet back) is found by liveness: an
open run of an online device that has sent nothing for run_probe_s is asked
`ctl {op:"replay", r, after}` from the last id passed, again with the wait doubling
up to run_probe_max_s while it stays quiet, and at once when a newer run of its device
starts (a board keeps its last finished run's ring only until its next run ends). The
board resends what followed (the end among it), says nothing for a run it still runs,
or answers `unknown_run`: then the run ends here as above, `run.failed` kind "device"
with RUN_NOT_HELD. Nothing is ever made up for the
streams "_" and "_b". Whoever else keeps per-device state (the RPC server) is told
through `on_device_reset`. An offline status naming a boot older than the one known is
the late will of an earlier connection and changes nothing: taken as news, it would end
the runs of the boot that is alive.

Backpressure (PROTOCOL.md "Replay"): an in-order event goes to the bridge's lanes
(`lanes`, lanes.Outbox), which may refuse it for want of room — its device's queue, its
tenant's, or the memory budget that also pays for the events held past holes. A refused
event is not taken: the run does not advance past it (it is "blocked", counted
`evt.deferred.<why>`), nothing is asked while the lanes are full, and `tick` asks the
board for it again once its device has room. Only the events the bridge makes itself
(a gone board's gaps and run.failed) are taken regardless. So nothing the intake has
advanced past is ever dropped.

Hosts may ask for the recent events of a run: the replay window, in memory. It keeps
each forwarded event as the bytes that went to hosts (a replay answer sends them again),
at most `keep` events per run, and all windows together at most `window_bytes` (each
event charged its length plus OVERHEAD), across every device and tenant: the window is
a cache of what already went out, so past its budget events are evicted, never refused.
Eviction goes down to 7/8 of the budget, so a full budget is not trimmed at every event:
first the finished runs' windows, least recently active first, down to their last event
(all their events went out; a host that missed the end still learns how the run ended);
then the oldest events of the largest windows, so a device flooding large events loses
its own replay history before a quiet device loses any of its. An evicted event is no
longer replayable from the bridge: a host asking for it is told `gap` on `_b`
(bridge.py). The durable event log is a later issue; until then a bridge restart forgets
past events.

Run state is bounded twice: per device (`max_runs_per_device`), so a device that opens
run after run only ever evicts its own oldest run states, never another tenant's; and in
total (`max_runs`), the memory bound of the process. What a run record holds is bounded
fleet-wide too: its window by `window_bytes`, its held events by the lanes' Budget (and
`hold`), its lost ranges by `hold`; the rest is ~1.4 KB a run (~1.4 MiB at max_runs).
Not bounded fleet-wide: the hello and status of every registered device, kept decoded
until the bridge stops (one each, up to max_payload encoded, ~130 KB decoded at worst).

Also kept here, in memory: each device's capabilities from P/d/D/hello (and the decode
limits they announce, which the RPC layer sizes its answers by), its presence from
P/d/D/status and its last known boot id.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, cast

import msgpack

from edge_runtime.events import MAX_ID, TERMINAL
from server_bridge.config import BridgeConfig
from server_bridge.eventlog import EventLogError, EventStore
from server_bridge.lanes import OVERHEAD, Budget
from server_bridge.privacy import LOOKED_AT as REDACTED
from server_bridge.privacy import Redactor
from server_bridge.registry import DeviceRecord
from server_bridge.topics import UNOWNED, device_topic, host_event_topic, is_user_id
from server_bridge.wire import (
    BRIDGE_RUN,
    DEFAULT_LIMITS,
    DEVICE_RUN,
    BadEnvelope,
    Limits,
    check_boot,
    check_events,
    decode,
    encode,
    is_bridge_run,
)

__all__ = [
    "DEVICE_OFFLINE",
    "DEVICE_RESTARTED",
    "RUN_NOT_HELD",
    "EventIntake",
    "EventLanes",
    "Window",
]

log = logging.getLogger("wren.bridge.intake")

Publish = Callable[[str, bytes], None]  # (topic, payload), QoS 1
Count = Callable[[str, int], None]
# (device, customer-safe message, new boot?, boot): a device restarted (boot: the new
# one) or went offline (boot: the one its will named), None when unknown.
DeviceReset = Callable[[str, str, bool, "str | None"], None]
# (tenant, device, run, first id, last id, why): ids hosts will never get from the bridge.
IdsLost = Callable[[str, str, str, int, int, str, "str | None"], None]


class EventLanes(Protocol):
    """Where events for hosts go (lanes.Outbox): they take an event or say why not."""

    def offer_event(
        self, tenant: str, device: str, topic: str, payload: bytes, force: bool = False
    ) -> str | None: ...

    def has_room(self, tenant: str, device: str) -> bool: ...


# Only the contract's envelope keys cross to hosts; anything else a board adds stays here.
_ENVELOPE_KEYS = ("r", "i", "t", "ts", "n", "a", "k", "d")
_PRESENCE = ("online", "offline")
# Rows one run may have `building` at once that a bridge-ended run shows failed.
_MAX_BUILDING = 32
# Streams that are not runs: nothing is synthesized for them, they never "end".
_STREAMS = (DEVICE_RUN, BRIDGE_RUN)
# What of a board's status the bridge keeps (PROTOCOL.md "Topics": presence).
_STATUS_KEYS = ("fw", "agent", "ver", "heap", "boot", "reset")
# The events that name their run's user (PROTOCOL.md "Event types").
_NAMES_USER = ("run.started", "run.paused")
# Requests whose run the intake remembers (run_of_request), the oldest forgotten first.
_REQ_RUNS = 65_536
# A paused run's probes are at most this many times run_probe_max_s apart (_first_wait).
_PAUSED_PROBE_FACTOR = 10
# The `run.failed` messages of runs the bridge ends (customer-safe, PROTOCOL.md).
DEVICE_RESTARTED = "the device restarted"
DEVICE_OFFLINE = "the device went offline"
RUN_NOT_HELD = "the device no longer holds the run: how it ended was lost"


def _unpack(payload: bytes) -> dict[str, Any]:
    """An envelope the intake encoded itself (a held event): no limits to check."""
    return cast(dict[str, Any], msgpack.unpackb(payload, raw=False))


class Window(NamedTuple):
    """What the intake still holds of a run, for a host's replay."""

    # The forwarded events with id > after, in id order, each the envelope encoded as it
    # went to hosts: a replay answer sends these bytes again.
    payloads: list[bytes]
    first: int | None  # the lowest id still held (None: nothing forwarded yet)
    next: int  # the next id the run will forward
    # The run's user, from its run.started (None: not seen, the run is watchers' only).
    usr: str | None = None


@dataclass(eq=False)
class _Run:
    device: str
    tenant: str
    run: str
    expected: int = 1
    # The highest id seen (delivered, held or dropped): while expected <= highest, ids
    # are missing and the board is asked for them.
    highest: int = 0
    # The board clock of that event: the events the bridge makes for the run carry it,
    # so `ts` never runs backwards within a run.
    last_ts: int = 0
    # Events past a hole, by id: each the encoded envelope as it will go to hosts
    # (bytes, charged to the memory budget, are a third of the decoded dict's size).
    held: dict[int, bytes] = field(default_factory=dict)
    # Ranges the board reported lost (inclusive), only those not yet passed.
    lost: list[tuple[int, int]] = field(default_factory=list)
    # The replay request in progress: the expected id it last asked from (None: not
    # asking), when, the wait before asking again, and how often it asked for this hole.
    replay_for: int | None = None
    replay_sent: float = 0.0
    replay_wait: float = 0.0
    replay_asks: int = 0
    replay_capped: bool = False
    # A terminal event went out (the board's, or the bridge's run.failed).
    finished: bool = False
    # The bridge ended the run (its device restarted or went offline): later events of
    # it are dropped.
    ended: bool = False
    # The lanes refused the event at `expected` (no room): not taken, and not asked for
    # again until the device's lanes have room (tick).
    blocked: bool = False
    # The replay window: (id, the envelope encoded as it went to hosts), oldest first,
    # and what it is charged against the intake's window budget.
    recent: deque[tuple[int, bytes]] = field(default_factory=deque)
    recent_bytes: int = 0
    # Table rows the run has shown `building` and not yet `final` or `failed` (field,
    # row), at most _MAX_BUILDING: a run the bridge ends shows them failed, so no row
    # stays building on a dashboard after its board is gone (PROTOCOL.md "Tables").
    building: dict[tuple[str, str], None] = field(default_factory=dict)
    # The run's latest run event was run.paused: its board keeps it in a checkpoint, so
    # neither a restart nor an absence of the board ends it (PROTOCOL.md "Runs that
    # pause"); the board resumes it.
    paused: bool = False
    # The run's user, as its run.started says it (the `usr` the bridge set in the req
    # from the session token), and the host topic its events go to: that user's, or the
    # watchers' alone (UNOWNED) while no run.started was seen (the bridge met the run
    # mid-way, after its own restart); the device stream "_" goes to the device's topic
    # (PROTOCOL.md "Who sees what"). Made once per run, not per event.
    usr: str | None = None
    topic: str = ""
    # The run's conversation, as its run.started says it: the event log groups the
    # runs of a conversation by it (server_bridge/eventlog).
    conv: str | None = None
    # Liveness: when the run's last event arrived (the intake's clock), and the probe in
    # progress while it stays quiet: when it was sent and the wait before the next
    # (0: none sent since the last event).
    heard: float = 0.0
    probe_sent: float = 0.0
    probe_wait: float = 0.0

    @property
    def missing(self) -> bool:
        return self.expected <= self.highest


def _holes(st: _Run) -> list[tuple[int, int]]:
    """The ranges of ids from `expected` to `highest` that are not held (walked by the
    held ids, at most `hold` of them: ids come from the board and may be huge)."""
    holes: list[tuple[int, int]] = []
    nxt = st.expected
    for i in sorted(h for h in st.held if h >= st.expected):
        if i > nxt:
            holes.append((nxt, i - 1))
        nxt = i + 1
    if nxt <= st.highest:
        holes.append((nxt, st.highest))
    return holes


class EventIntake:
    """Accepts board events and hello/status; publishes host fan-out, replay requests, and
    the end of the runs of a board that restarted or went offline."""

    def __init__(
        self,
        prefix: str,
        publish: Publish,
        count: Count | None = None,
        limits: Limits = DEFAULT_LIMITS,
        keep: int = BridgeConfig.events_per_run,
        hold: int = BridgeConfig.hold_per_run,
        max_runs: int = BridgeConfig.max_runs,
        max_runs_per_device: int = BridgeConfig.max_runs_per_device,
        replay_retry_s: float = BridgeConfig.replay_retry_s,
        replay_retry_max_s: float = BridgeConfig.replay_retry_max_s,
        clock: Callable[[], float] = time.monotonic,
        on_device_reset: DeviceReset | None = None,
        offline_grace_s: float = BridgeConfig.offline_grace_s,
        run_probe_s: float = BridgeConfig.run_probe_s,
        run_probe_max_s: float = BridgeConfig.run_probe_max_s,
        lanes: EventLanes | None = None,
        budget: Budget | None = None,
        window_bytes: int = BridgeConfig.window_bytes,
        hello_bytes: int = BridgeConfig.hello_bytes,
        event_log: EventStore | None = None,
    ) -> None:
        self.prefix = prefix
        # Every event hosts are sent is appended here too, as sent (server_bridge/eventlog):
        # what a replay reads once the window has let the run go, and after a restart.
        self._event_log = event_log
        # Told of every event handed to hosts (device, run, id, payload), under the lock.
        self.on_delivered: Callable[[str, str, str, int, bytes], None] | None = None
        # The bridge's own redaction of private fields, by each device's hello.
        self._privacy = Redactor()
        self._redacted_devices: set[str] = set()  # those logged once already
        # The run each recent request started, by (device, req), from run.started.
        self._req_runs: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._publish = publish
        self._count: Count = count or (lambda name, n: None)
        self._limits = limits
        self._keep = keep
        self._hold = hold
        self._max_runs = max_runs
        self._max_runs_per_device = max_runs_per_device
        self._retry_s = replay_retry_s
        self._retry_max_s = max(replay_retry_max_s, replay_retry_s)
        self._offline_grace_s = offline_grace_s
        self._probe_s = run_probe_s
        self._probe_max_s = max(run_probe_max_s, run_probe_s)
        self._clock = clock
        # Without lanes (tests of the rules alone) events are published like the rest,
        # always taken; without a budget held events are bounded by `hold` alone.
        self._lanes = lanes
        self._budget = budget
        # The replay windows' budget is the intake's own, apart from the lanes' Budget:
        # that one refuses (what it pays for must never be dropped), this one evicts.
        # Sharing one would let a cache of what already went out defer new events.
        self._window_bytes = window_bytes
        self._window_used = 0
        self.window_peak = 0
        # Runs whose next event the lanes refused, waiting for room (tick).
        self._blocked: dict[tuple[str, str], _Run] = {}
        self._taken = 0
        # Called outside the lock, after what the reset published is on its way.
        self.on_device_reset = on_device_reset
        # Told (outside the lock) of ids hosts will never get from the bridge: those of a
        # run it stopped tracking, or that the board no longer holds. The bridge says so
        # on `_b` as a gap naming the run, so no loss is silent.
        self.on_ids_lost: IdsLost | None = None
        self._lost_notices: list[tuple[str, str, str, int, int, str, str | None]] = []
        # paho's network thread feeds events; the bridge's housekeeping thread ticks
        # replay retries; hosts read. One lock guards all run state. Publishing happens
        # after it is released, so no paho lock is ever taken while holding it.
        self._lock = threading.Lock()
        # Both in least-recently-used order: every event moves its run to the end.
        self._runs: OrderedDict[tuple[str, str], _Run] = OrderedDict()
        self._by_device: dict[str, OrderedDict[str, _Run]] = {}
        # Each device's last hello as the bytes it came in (at most a payload, where the
        # decoded form of a hello at the size limit takes ~130 KB), least recently
        # announced first, all of them within hello_bytes: past it the oldest go (the
        # bridge reads a hello's tools and fields only on request, capabilities()). Its
        # limits, which every answer to the board is sized by, are kept apart, small.
        self._hello: OrderedDict[str, bytes] = OrderedDict()
        # Each device's hello tools, parsed once per hello (tools()): (its payload, them).
        self._tools: dict[str, tuple[bytes, list[dict[str, Any]]]] = {}
        self._hello_bytes = hello_bytes
        self._hello_used = 0
        self._device_limits: dict[str, Limits] = {}
        # Devices whose last hello declares fields: only their requests may carry state
        # (Bridge._state_seed), and the others' are not held up decoding a hello to see.
        self._with_fields: set[str] = set()
        self._presence: dict[str, dict[str, Any]] = {}
        self._boot: dict[str, str] = {}
        # Devices whose status said offline: since when (the clock's time) and the boot
        # it named. That boot's runs end once the grace has passed without it coming back.
        self._offline_since: dict[str, tuple[float, str | None]] = {}

    # ------------------------------------------------------------------ events

    def handle_evt(self, device: DeviceRecord, payload: bytes) -> int:
        """Decode, validate and accept one `evt` payload; returns events taken for hosts.

        Raises a WireError (nothing of the payload is accepted) when any envelope in it
        is refused.
        """
        envelopes = check_events(decode(payload, self._limits))
        for env in envelopes:
            if is_bridge_run(env["r"]):
                # Hosts read `_b` as the bridge speaking (its refusals, its replay
                # answers): a board writing there could tell a host anything in the
                # bridge's name. The whole payload is refused, like any bad envelope.
                self._count("evt.bridge_run", 1)
                raise BadEnvelope(f"run id {env['r']!r} is the bridge's own stream")
        return self.accept(device, envelopes)

    def accept(self, device: DeviceRecord, envelopes: Iterable[dict[str, Any]]) -> int:
        """Accept already-validated envelopes of one device, in the order given."""
        out: list[tuple[str, bytes]] = []
        now = self._clock()
        with self._lock:
            before = self._taken
            for env in envelopes:
                self._count("evt.in", 1)
                self._accept_one(device, env, now, out)
            taken = self._taken - before
            notices, self._lost_notices = self._lost_notices, []
        self._send(out)
        hook = self.on_ids_lost
        for notice in notices:
            if hook is not None:
                hook(*notice)
        return taken

    def _accept_one(
        self, device: DeviceRecord, env: dict[str, Any], now: float, out: list[tuple[str, bytes]]
    ) -> None:
        if env["r"] == DEVICE_RUN and env["t"] == "error":
            self._board_refused(device, env["d"], now, out)
        st = self._run(device, env["r"], now)
        st.heard, st.probe_wait = now, 0.0
        if env["t"] == "run.started" and st.highest == 0:
            self._probe_older(st, now, out)
        if st.ended:
            # The bridge ended this run for hosts and took the ids past what it had seen.
            self._count("evt.after_end", 1)
            return
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
            # It can only report ids below its own: a `to` past that (up to 2**64 on
            # the wire) is not believed, so one event cannot claim to lose the ids to come.
            self._record_lost(st, int(d["from"]), min(int(d["to"]), i - 1))
        if i > st.highest:
            st.highest, st.last_ts = i, env["ts"]
        clean = {k: env[k] for k in _ENVELOPE_KEYS if k in env}
        if i == st.expected:
            self._deliver(st, clean, out)
        elif len(st.held) < self._hold:
            self._hold_one(st, i, encode(clean))
        elif i < max(st.held):
            # Full: keep the ids nearest the hole; the one dropped is resent by the replay
            # (st.highest remembers it was sent, so the asking goes on until it is back).
            self._unhold(st, max(st.held))
            self._hold_one(st, i, encode(clean))
            self._count("evt.hold_overflow", 1)
        else:
            self._count("evt.hold_overflow", 1)
        self._advance(st, now, out)

    def _hold_one(self, st: _Run, i: int, payload: bytes) -> None:
        """Hold an event past a hole, if the memory budget has room; else it is deferred
        like one the lanes refused (st.highest has it: a replay brings it again)."""
        if self._budget is not None and not self._budget.take(len(payload) + OVERHEAD):
            self._deferred(st, "budget")
            self._block(st)
            return
        st.held[i] = payload
        self._count("evt.held", 1)

    def _unhold(self, st: _Run, i: int) -> bytes | None:
        payload = st.held.pop(i, None)
        if payload is not None and self._budget is not None:
            self._budget.give(len(payload) + OVERHEAD)
        return payload

    def _unhold_all(self, st: _Run) -> None:
        for i in list(st.held):
            self._unhold(st, i)

    def _deferred(self, st: _Run, why: str) -> None:
        self._count("evt.deferred", 1)
        self._count(f"evt.deferred.{why}", 1)
        self._count(f"tenant.{st.tenant}.evt.deferred", 1)

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
        while not st.blocked:
            nxt = st.held.get(st.expected)
            if nxt is not None:
                # Released from the budget first: queued, the same bytes are charged
                # again by the lanes; refused, they go back to the hold (taken before).
                self._unhold(st, st.expected)
                if not self._deliver(st, _unpack(nxt), out, nxt):
                    if self._budget is not None:
                        self._budget.force(len(nxt) + OVERHEAD)
                    st.held[st.expected] = nxt
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
        if st.blocked:
            # Asked for again once the lanes have room (tick), not now: the board's
            # answer would only be refused again.
            pass
        elif st.missing:
            self._maybe_replay(st, now, out)
        else:
            st.replay_for, st.replay_asks, st.replay_capped = None, 0, False

    def _deliver(
        self,
        st: _Run,
        clean: dict[str, Any],
        out: list[tuple[str, bytes]],
        payload: bytes | None = None,
        force: bool = False,
    ) -> bool:
        """Hand an in-order event to the lanes (or `out`); False when the lanes refused
        it: then the run does not advance, and is blocked until they have room.

        `force` is for the events the bridge makes itself, which must go out."""
        if clean["t"] in REDACTED:
            shown = self._privacy.redact(st.device, clean)
            if shown is not None:
                # Blanked here (privacy.py): the board showed what its hello keeps private.
                self._count(f"redacted.{clean['t']}", 1)
                if st.device not in self._redacted_devices and len(self._redacted_devices) < 10_000:
                    self._redacted_devices.add(st.device)
                    log.warning("device %s showed private field data in a %s event "
                                "(redacted; its firmware or app is at fault)", st.device,
                                clean["t"])  # fmt: skip
                clean, payload = shown, None
        if payload is None:
            payload = encode(clean)
        if clean["t"] in _NAMES_USER and st.usr is None:
            # run.paused names it too: a bridge that restarted meets a paused run there.
            usr = clean["d"].get("usr")
            if is_user_id(usr):
                # A usr no topic level can hold (a board's bug) leaves the run to the
                # watchers, never on a topic it could break out of.
                st.usr, st.topic = usr, ""
            conv = clean["d"].get("conv")
            if isinstance(conv, str) and conv:
                st.conv = conv
        topic = st.topic
        if not topic:
            user = None if st.run == DEVICE_RUN else (st.usr or UNOWNED)
            topic = st.topic = host_event_topic(self.prefix, st.tenant, st.device, user)
        if self._lanes is None:
            out.append((topic, payload))
        else:
            why = self._lanes.offer_event(st.tenant, st.device, topic, payload, force)
            if why is not None:
                self._deferred(st, why)
                self._block(st)
                return False
        if st.blocked:
            self._unblock(st)  # taken after all (the lanes had room again)
        self._remember(st, clean["i"], payload)
        if self._event_log is not None:
            self._log_event(st, clean["i"], payload)
        if self.on_delivered is not None:
            # The HTTP streams that follow the run (http/hub.py: never waits).
            self.on_delivered(st.tenant, st.device, st.run, clean["i"], payload)
        if clean["t"] == "run.started":
            req = clean["d"].get("req")
            if isinstance(req, str):
                self._req_runs[(st.device, req)] = st.run
                self._req_runs.move_to_end((st.device, req))
                while len(self._req_runs) > _REQ_RUNS:
                    self._req_runs.popitem(last=False)
        st.expected = clean["i"] + 1
        if clean["t"] in TERMINAL:
            st.finished = True
        elif clean["t"] == "row":
            self._track_row(st, clean["d"])
        elif clean["t"] == "run.paused":
            st.paused = True
        elif clean["t"] == "run.resumed":
            st.paused = False
        self._taken += 1
        return True

    def _log_event(self, st: _Run, i: int, payload: bytes) -> None:
        """Append a delivered event to the durable log. A log that cannot take it (a full
        disk) does not hold up the live stream: the event has gone to hosts; the miss is
        logged and counted (`eventlog.failed`), and a later replay of the run says the
        ids it lacks as a gap, as for any event the bridge no longer holds."""
        assert self._event_log is not None
        try:
            self._event_log.append(st.tenant, st.device, st.run, i, payload,
                                   usr=st.usr, conv=st.conv)  # fmt: skip
        except (EventLogError, OSError) as e:
            self._count("eventlog.failed", 1)
            log.error("event log: event %s of run %s/%s not logged: %s", i, st.device,
                      st.run, e)  # fmt: skip

    def _track_row(self, st: _Run, d: dict[str, Any]) -> None:
        row = (d.get("field"), d.get("row"))
        if not all(isinstance(x, str) for x in row):
            return
        key = cast(tuple[str, str], row)
        if d.get("status") != "building":
            st.building.pop(key, None)
        elif len(st.building) < _MAX_BUILDING:
            st.building[key] = None
        else:
            # A board keeps one row building per write it has out; past the bound it is
            # not believed, and the row is left to the board's own ending.
            self._count("rows.untracked", 1)

    # ------------------------------------------------------------------ replay window

    def _remember(self, st: _Run, i: int, payload: bytes) -> None:
        """Keep a forwarded event in its run's window, within `keep` events per run and
        `window_bytes` in all (module docstring). While the lanes still queue it, the
        window holds the same bytes object, not a copy (charged to both: conservative)."""
        cost = len(payload) + OVERHEAD
        st.recent.append((i, payload))
        st.recent_bytes += cost
        self._window_used += cost
        if len(st.recent) > self._keep:
            self._drop_oldest(st)
        if self._window_used > self._window_bytes:
            self._trim_windows()
        self.window_peak = max(self.window_peak, self._window_used)

    def _drop_oldest(self, st: _Run) -> None:
        _, payload = st.recent.popleft()
        cost = len(payload) + OVERHEAD
        st.recent_bytes -= cost
        self._window_used -= cost

    def _trim_windows(self) -> None:
        """Evict window events until the windows use at most 7/8 of their budget.

        The slack makes a trim rare (once per budget/8 of new events, not at every
        event of a flood), so its scan over every run (at most max_runs) costs little.
        """
        target = self._window_bytes - self._window_bytes // 8
        evicted = 0
        # Finished runs first, least recently active first (self._runs is in LRU order),
        # each down to its last event (normally its terminal one).
        for st in self._runs.values():
            if self._window_used <= target:
                break
            if st.finished:
                while len(st.recent) > 1 and self._window_used > target:
                    self._drop_oldest(st)
                    evicted += 1
        if self._window_used > target:
            # Then the largest windows lose their oldest events, largest first, each
            # trimmed back into the heap: windows shrink towards a common size, and the
            # small ones of quiet devices are the last to lose anything.
            tie = itertools.count()
            heap = [(-st.recent_bytes, next(tie), st) for st in self._runs.values() if st.recent]
            heapq.heapify(heap)
            while heap and self._window_used > target:
                _, _, st = heapq.heappop(heap)
                self._drop_oldest(st)
                evicted += 1
                if st.recent:
                    heapq.heappush(heap, (-st.recent_bytes, next(tie), st))
        if evicted:
            self._count("window.evicted", evicted)

    def _forget_window(self, st: _Run) -> None:
        self._window_used -= st.recent_bytes
        st.recent.clear()
        st.recent_bytes = 0

    @property
    def window_used(self) -> int:
        """Bytes the replay windows are charged, in all (at most window_bytes)."""
        with self._lock:
            return self._window_used

    # ------------------------------------------------------------------ gap repair

    def _maybe_replay(self, st: _Run, now: float, out: list[tuple[str, bytes]]) -> None:
        # One request per hole at a time. The board answers a request by resending its
        # whole ring past `after`, usually one message per event, so while that resend is
        # arriving the hole shrinks step by step: asking again at every step would only
        # multiply resends. So a pending request is left alone for its wait; past that it
        # is repeated, the wait doubling up to replay_retry_max_s — or back to
        # replay_retry_s if the hole moved since (the board is answering, just not all of
        # it yet). Never abandoned: the board may be away for minutes and then answer.
        if st.replay_for is None:
            wait = self._retry_s
        elif now - st.replay_sent < st.replay_wait:
            return
        elif st.expected > st.replay_for:
            wait = self._retry_s
            st.replay_asks, st.replay_capped = 0, False
        else:
            wait = min(st.replay_wait * 2, self._retry_max_s)
        st.replay_for = st.expected
        st.replay_sent = now
        st.replay_wait = wait
        st.replay_asks += 1
        self._count("replay.sent", 1)
        if wait >= self._retry_max_s and st.replay_asks > 1 and not st.replay_capped:
            st.replay_capped = True
            log.warning(
                "device %s run %s: events from %d (of %d seen) still missing after %d "
                "replay requests; asking every %gs until they arrive or are reported lost",
                st.device,
                st.run,
                st.expected,
                st.highest,
                st.replay_asks,
                wait,
            )
        ctl = {"op": "replay", "r": st.run, "after": st.expected - 1}
        out.append((device_topic(self.prefix, st.device, "ctl"), encode(ctl)))

    def _end(self, st: _Run, msg: str, out: list[tuple[str, bytes]]) -> bool:
        """End an open run for hosts: its board restarted, went offline, or no longer
        holds it (`msg` says which).

        What is held goes out in order; each hole below the highest id seen that no event
        filled and no gap report covered is told with an `error` of kind "gap", and the
        run fails with kind "device", retryable — each with the next id after the
        highest seen, which the bridge owns from now on. A run whose own terminal event
        was among the held ones is finished by it and gets no run.failed. Returns
        whether the bridge failed the run (rather than the board's own end).
        """
        holes: list[tuple[int, int]] = []
        failed = False
        self._unblock(st)
        while st.missing:
            nxt = self._unhold(st, st.expected)
            if nxt is not None:
                self._deliver(st, _unpack(nxt), out, nxt, force=True)
                continue
            rng = next((r for r in st.lost if r[0] <= st.expected <= r[1]), None)
            if rng is not None:
                # Reported lost by the board: its own report is (or will be) forwarded.
                target = min((h for h in st.held if st.expected < h <= rng[1]), default=rng[1] + 1)
                self._count("evt.lost", target - st.expected)
                st.expected = target
                continue
            # A hole up to the next id held, or reported lost, or the highest seen.
            end = min([*st.held, *(a for a, _ in st.lost if a > st.expected), st.highest + 1])
            holes.append((st.expected, end - 1))
            self._count("evt.lost", end - st.expected)
            st.expected = end
        self._unhold_all(st)
        st.lost.clear()
        for lo, hi in holes:
            d = {
                "kind": "gap",
                "from": lo,
                "to": hi,
                "msg": f"events {lo}..{hi} never arrived: {msg}",
            }
            self._deliver(st, self._made(st, "error", d), out, force=True)
        if not st.finished:
            for name, row in list(st.building):
                err = {"kind": "device", "msg": msg}
                d = {"field": name, "row": row, "status": "failed", "err": err}
                self._deliver(st, self._made(st, "row", d), out, force=True)
            st.building.clear()
            d = {"err": {"kind": "device", "msg": msg}, "retryable": True}
            self._deliver(st, self._made(st, "run.failed", d), out, force=True)
            failed = True
        st.highest = st.expected - 1
        st.finished = st.ended = True
        st.replay_for, st.replay_asks, st.replay_capped = None, 0, False
        self._count("runs.ended_by_bridge", 1)
        return failed

    def _made(self, st: _Run, t: str, d: dict[str, Any]) -> dict[str, Any]:
        """An event the bridge makes for a run: the run's next id, its board clock."""
        self._count("evt.made", 1)
        return {"r": st.run, "i": st.expected, "t": t, "ts": st.last_ts, "d": d}

    def _run(self, device: DeviceRecord, run: str, now: float) -> _Run:
        key = (device.device, run)
        own = self._by_device.setdefault(device.device, OrderedDict())
        st = self._runs.get(key)
        if st is not None:
            self._runs.move_to_end(key)
            own.move_to_end(run)
            return st
        st = _Run(device.device, device.tenant, run, heard=now)
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

    def _block(self, st: _Run) -> None:
        st.blocked = True
        self._blocked[st.device, st.run] = st

    def _unblock(self, st: _Run) -> None:
        st.blocked = False
        self._blocked.pop((st.device, st.run), None)

    def _forget(self, old: _Run) -> None:
        self._unblock(old)
        self._unhold_all(old)
        self._forget_window(old)
        del self._runs[(old.device, old.run)]
        own = self._by_device[old.device]
        del own[old.run]
        if not own:
            del self._by_device[old.device]

    def _evict(self, old: _Run, why: str) -> None:
        held = len(old.held)
        self._forget(old)
        self._count("runs.evicted", 1)
        if old.missing:
            # Ids it had seen but not yet passed to hosts (held, deferred or still being
            # asked for): nobody will ask the board for them now, so hosts are told.
            self._count("evt.lost", old.highest - old.expected + 1)
            self._ids_lost(
                old, old.expected, old.highest, f"the bridge stopped tracking the run ({why})"
            )
        if old.missing or not old.finished:
            log.warning(
                "forgetting unfinished run %s of %s (%d held events): %s",
                old.run,
                old.device,
                held,
                why,
            )

    def _ids_lost(self, st: _Run, lo: int, hi: int, why: str) -> None:
        # Counted in evt.lost where the ids are passed over; this counts the telling.
        self._count("evt.lost_told", hi - lo + 1)
        # With the run's user: the run itself may be forgotten before the notice goes.
        self._lost_notices.append((st.tenant, st.device, st.run, lo, hi, why, st.usr))

    def _board_refused(
        self, device: DeviceRecord, d: dict[str, Any], now: float, out: list[tuple[str, bytes]]
    ) -> None:
        # The board answers a replay (or a cancel) for a run it no longer holds with
        # `unknown_run` naming it: what the bridge was asking for is gone for good, and
        # a run still open here will never send its end. Without this the bridge would
        # go on asking, and hosts wait, for ever.
        run = d.get("r")
        if d.get("kind") != "unknown_run" or not isinstance(run, str) or run in _STREAMS:
            return
        st = self._runs.get((device.device, run))
        if st is None or st.ended:
            return
        if st.missing and st.replay_for is not None:
            holes = _holes(st)
            for lo, hi in holes:
                self._record_lost(st, lo, hi)
            self._advance(st, now, out)
            for lo, hi in holes:
                self._ids_lost(st, lo, hi, "the board no longer holds these events")
        if not st.finished:
            # Its board ran it and let it go, and its end never arrived: it is over, and
            # the bridge says so (PROTOCOL.md "Runs that end without their board").
            log.warning("device %s: run %s is no longer held; ending it", st.device, st.run)
            self._count("runs.ended_not_held", 1)
            self._end(st, RUN_NOT_HELD, out)

    # ------------------------------------------------------------------ run liveness

    def _online(self, device: str) -> bool:
        presence = self._presence.get(device)
        return presence is not None and presence["st"] == "online"

    def _probe_due(self, st: _Run, now: float) -> bool:
        # An open run of an online device with nothing to ask for already (a hole has its
        # own replay requests; a blocked run waits for room), quiet past its wait.
        if st.finished or st.ended or st.missing or st.blocked or st.run in _STREAMS:
            return False
        if not self._online(st.device) or st.device in self._offline_since:
            return False
        return now - max(st.heard, st.probe_sent) >= (st.probe_wait or self._first_wait(st))

    def _first_wait(self, st: _Run) -> float:
        # A paused run waits, quiet, for as long as its answer takes, and a board answers
        # a replay of it from its checkpoint on flash (read and restored on its heap):
        # such a run is asked only every run_probe_max_s at first, and up to ten times
        # that apart.
        return self._probe_max_s if st.paused else self._probe_s

    def _probe(self, st: _Run, now: float, out: list[tuple[str, bytes]]) -> None:
        # A replay from the last id passed: the board resends whatever followed it (the
        # run's lost end among it), answers nothing for a run it still runs, and
        # `unknown_run` for one it no longer holds (_board_refused ends it).
        most = self._probe_max_s * (_PAUSED_PROBE_FACTOR if st.paused else 1)
        st.probe_wait = min((st.probe_wait or self._first_wait(st)) * 2, most)
        st.probe_sent = now
        self._count("runs.probed", 1)
        ctl = {"op": "replay", "r": st.run, "after": st.expected - 1}
        out.append((device_topic(self.prefix, st.device, "ctl"), encode(ctl)))

    def _probe_older(self, new: _Run, now: float, out: list[tuple[str, bytes]]) -> None:
        # A board keeps the ring of its last finished run only until its next run ends
        # (edge_runtime/runs.py _RECENT_RUNS): a new run's start is the moment to ask for
        # an open older run's lost end, while the board still has it to send. A run
        # still running answers nothing and costs one message.
        for st in self._by_device.get(new.device, {}).values():
            if st is new or st.paused:
                continue  # a paused run waits for its answer whatever else runs
            if not (st.finished or st.ended or st.missing or st.blocked):
                if st.run not in _STREAMS and not st.probe_wait:  # not asked since it spoke
                    self._probe(st, now, out)

    def _send(self, out: list[tuple[str, bytes]]) -> int:
        forwarded = 0
        for topic, payload in out:
            self._publish(topic, payload)
            if topic.endswith("/evt"):
                forwarded += 1
        self._count("evt.forwarded", forwarded)
        return forwarded

    def tick(self, now: float | None = None) -> None:
        """Retry replay requests of runs still waiting on a hole, probe the quiet open runs
        of online devices, and fetch again what the lanes refused once they have room
        (housekeeping thread)."""
        now = self._clock() if now is None else now
        out: list[tuple[str, bytes]] = []
        gone: list[tuple[str, str | None, list[str]]] = []
        with self._lock:
            lanes = self._lanes
            if lanes is not None:
                # Runs the lanes refused, once their device has room again: what is
                # held goes out and the rest is asked for at once.
                for st in list(self._blocked.values()):
                    if lanes.has_room(st.tenant, st.device):
                        self._unblock(st)
                        st.replay_for, st.replay_asks, st.replay_capped = None, 0, False
                        self._advance(st, now, out)
            for st in self._runs.values():
                if st.missing and not st.blocked:
                    self._maybe_replay(st, now, out)
                elif self._probe_due(st, now):
                    self._probe(st, now, out)
            for device, (since, boot) in list(self._offline_since.items()):
                if now - since >= self._offline_grace_s:
                    del self._offline_since[device]
                    gone.append((device, boot, self._end_runs(device, False, out, only=boot)))
        self._send(out)
        for device, boot, ended in gone:
            self._told(device, False, boot, ended)

    # ------------------------------------------------------------------ readers

    def events(self, device: str, run: str, after: int = 0) -> list[dict[str, Any]]:
        """The recent forwarded events of a run with id > after (bounded window), decoded."""
        with self._lock:
            st = self._runs.get((device, run))
            payloads = [p for i, p in st.recent if i > after] if st else []
        return [_unpack(p) for p in payloads]

    def window(self, device: str, run: str, after: int = 0) -> Window | None:
        """What a host's replay of a run can get: None when the run is unknown here."""
        with self._lock:
            st = self._runs.get((device, run))
            if st is None:
                return None
            # Ids are ascending in the window: what an eviction left is its newest part,
            # so `first` is where the bridge's part of the run begins again.
            payloads = [p for i, p in st.recent if i > after]
            first = st.recent[0][0] if st.recent else None
            return Window(payloads, first, st.expected, st.usr)

    def run_of_request(self, device: str, req: str) -> str | None:
        """The run a recent request started, once its run.started went to hosts."""
        with self._lock:
            return self._req_runs.get((device, req))

    def owner(self, device: str, run: str) -> str | None:
        """The user of a run, as its run.started or run.paused said; None when the run or
        its user is unknown here (server_bridge/access.py: then it is the watchers' alone)."""
        with self._lock:
            st = self._runs.get((device, run))
            return st.usr if st else None

    def highest(self, device: str, run: str) -> int | None:
        """The highest event id seen of a run (0 before any), None when unknown."""
        with self._lock:
            st = self._runs.get((device, run))
            return st.highest if st else None

    def finished(self, device: str, run: str) -> bool | None:
        """Whether a run's terminal event went out (the board's, or the bridge's
        run.failed); None when the run is unknown here."""
        with self._lock:
            st = self._runs.get((device, run))
            return st.finished if st else None

    def boot(self, device: str) -> str | None:
        """The device's last known boot id (from status or hello), None before any."""
        with self._lock:
            return self._boot.get(device)

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
        boot = check_boot(obj, "hello")
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
            self._keep_hello(device.device, bytes(payload))
            self._privacy.declare(device.device, obj.get("fields"))
            self._device_limits[device.device] = limits
            if obj.get("fields"):
                self._with_fields.add(device.device)
            else:
                self._with_fields.discard(device.device)
        self._presence_changed(device.device, boot, None)
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
        # Only what presence is: a status is up to a payload of anything, kept for every
        # device; the fields the contract names, the strings cut to an id's length.
        presence: dict[str, Any] = {"st": obj["st"], "seen": time.time()}
        for key in _STATUS_KEYS:
            value = obj.get(key)
            if isinstance(value, str):
                presence[key] = value[:MAX_ID]
            elif isinstance(value, int) and not isinstance(value, bool):
                presence[key] = value
        if not self._presence_changed(device.device, check_boot(obj, "status"), presence):
            return None
        return presence

    def _presence_changed(
        self, device: str, boot: str | None, presence: dict[str, Any] | None
    ) -> bool:
        """Take a hello's boot (presence None) or a status; end the device's open runs if
        it restarted (a new boot) or went offline. False for a status ignored as stale."""
        out: list[tuple[str, bytes]] = []
        offline = presence is not None and presence["st"] == "offline"
        deferred = False
        with self._lock:
            known = self._boot.get(device)
            if offline and boot is not None and known is not None and boot != known:
                # The last will of a connection older than the boot already seen (a will
                # can only arrive late): neither that boot nor its absence is news.
                stale = True
            else:
                stale = False
                if presence is not None:
                    # `since`: when the bridge saw the device turn online or offline; a
                    # status repeating the last one (a retained copy delivered again at
                    # a subscribe) keeps it.
                    before = self._presence.get(device)
                    same = before is not None and before["st"] == presence["st"]
                    presence["since"] = before["since"] if before and same else presence["seen"]
                    self._presence[device] = presence
                if boot is not None:
                    self._boot[device] = boot
            restarted = not stale and known is not None and boot is not None and boot != known
            ended: list[str] = []
            if stale:
                pass
            elif restarted or not offline:
                # A new boot is certain news; the same boot (a hello, an online status)
                # means a device that was only away is back, with its runs.
                self._offline_since.pop(device, None)
                if restarted:
                    ended = self._end_runs(device, True, out, keep=boot)
            elif self._offline_grace_s > 0:
                self._offline_since.setdefault(device, (self._clock(), boot))
                deferred = True
            else:
                ended = self._end_runs(device, False, out, only=boot)
        if stale:
            self._count("status.stale_offline", 1)
            log.info("device %s: ignoring the offline status of its older boot %s", device, boot)
            return False
        if not (restarted or offline) or deferred:
            return True
        self._send(out)
        self._told(device, restarted, boot, ended)
        return True

    def _told(self, device: str, restarted: bool, boot: str | None, ended: list[str]) -> None:
        """Outside the lock, once what ended the runs is sent: count, log, tell the hook."""
        msg = DEVICE_RESTARTED if restarted else DEVICE_OFFLINE
        self._count("device.restarted" if restarted else "device.offline", 1)
        if ended:
            log.warning("device %s: %s; ended its runs %s", device, msg, ", ".join(ended))
        hook = self.on_device_reset
        if hook is not None:
            hook(device, msg, restarted, boot)

    def broker_lost(self) -> None:
        """The bridge lost the broker: the offline statuses pending their grace were
        (or may have been) the wills a shutting-down broker sent; the devices' real
        presence comes again, retained, once the bridge is back."""
        with self._lock:
            self._offline_since.clear()

    def _end_runs(
        self,
        device: str,
        restarted: bool,
        out: list[tuple[str, bytes]],
        keep: str | None = None,
        only: str | None = None,
    ) -> list[str]:
        """End the open runs of the device (the caller holds the lock); returns them.

        A run id begins with the boot that started it (`<boot>.<n>`): a new boot's own
        runs are kept (`keep`), and a will that names its boot ends that boot's runs
        (`only`). What a board sends on different topics may arrive in another order (a
        retained status is delivered again at every subscribe, after what waited in the
        bridge's session), so a new boot's first runs can come before its status does.
        """
        msg = DEVICE_RESTARTED if restarted else DEVICE_OFFLINE
        ended, failed = [], []
        for st in list(self._by_device.get(device, {}).values()):
            if st.run in _STREAMS or st.finished or st.paused:
                continue
            boot = st.run.split(".", 1)[0] if "." in st.run else None
            if keep is not None and boot == keep or only is not None and boot not in (only, None):
                continue
            ended.append(st.run)
            if self._end(st, msg, out):
                failed.append(st.run)
        if restarted:
            # The new boot's device stream starts again at 1.
            stream = self._runs.get((device, DEVICE_RUN))
            if stream is not None:
                self._forget(stream)
        else:
            # A board that was only cut off stops these runs when it is back: the cancel
            # waits for it in its persistent session. (A run whose own end was held
            # behind a hole has stopped already.)
            for run in failed:
                ctl = {"op": "cancel", "r": run, "reason": msg}
                out.append((device_topic(self.prefix, device, "ctl"), encode(ctl)))
            self._count("ctl.cancel_sent", len(failed))
        return ended

    def device_limits(self, device: str) -> Limits | None:
        """The decode limits a device announced in its last hello (None before any)."""
        with self._lock:
            return self._device_limits.get(device)

    def declares_fields(self, device: str) -> bool:
        """Whether the device's last hello declared any field (False before any)."""
        with self._lock:
            return device in self._with_fields

    def capabilities(self, device: str) -> dict[str, Any] | None:
        """The device's last hello, decoded (None before any, or once the hello budget
        let it go)."""
        with self._lock:
            payload = self._hello.get(device)
        return None if payload is None else cast(dict[str, Any], decode(payload, self._limits))

    def tools(self, device: str) -> list[dict[str, Any]]:
        """The tools of the device's last hello (name, description, args, client,
        approval), read once per hello: the HTTP device list asks for every device of a
        tenant on each poll of a dashboard."""
        with self._lock:
            payload = self._hello.get(device)
            kept = self._tools.get(device)
            if kept is not None and kept[0] is payload:
                return kept[1]
        hello = {} if payload is None else decode(payload, self._limits)
        listed = hello.get("tools") if isinstance(hello, dict) else None
        tools = [{k: t[k] for k in ("name", "description", "args", "client", "approval") if k in t}
                 for t in listed or () if isinstance(t, dict)]  # fmt: skip
        with self._lock:
            if payload is not None and self._hello.get(device) is payload:
                self._tools[device] = (payload, tools)
        return tools

    def _keep_hello(self, device: str, payload: bytes) -> None:
        self._tools.pop(device, None)
        old = self._hello.pop(device, None)
        if old is not None:
            self._hello_used -= len(old)
        self._hello[device] = payload
        self._hello_used += len(payload)
        while self._hello_used > self._hello_bytes and len(self._hello) > 1:
            gone_device, gone = self._hello.popitem(last=False)
            self._tools.pop(gone_device, None)
            self._hello_used -= len(gone)
            self._count("hello.evicted", 1)

    @property
    def hello_used(self) -> int:
        with self._lock:
            return self._hello_used

    def presence(self, device: str) -> dict[str, Any] | None:
        """The device's last status as kept (`st`, the contract's fields, `seen` and
        `since`: Unix times of its arrival and of the change to `st`), None when none
        came or an empty retained status cleared it."""
        with self._lock:
            return self._presence.get(device)
