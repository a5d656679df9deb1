"""What the bridge sends: bounded lanes, a fair scheduler, and a publisher that never drops.

Every message the bridge publishes goes through an `Outbox`. The thread that makes a
message (paho's network threads for events and host input, the housekeeping thread for
replay retries, RPC workers for answers) only puts it in a lane; a forwarder thread per
connection takes messages out and hands them to that connection's paho client.

The bridge has a control connection and its links (bridge.py, links.py), so the outbox
has a control channel and an event channel per link, each with its own client, window
of unacknowledged messages and forwarder:

- CONTROL: 1. the bridge's own lane, first: its presence (and anything it sends for
  no tenant); 2. then the tenants, round robin, one message per turn: each tenant's
  board lane (what the bridge sends that tenant's boards: RPC answers and chunks,
  replay and cancel `ctl`; first within the tenant, because a board's run waits on it),
  else its host lane (host `req` and `ctl` on their way to a board, the bridge's
  answers on `_b`, replay answers). Per tenant, not one board lane for all: with one,
  the answers to a neighbour's flood of junk calls (283,000 queued in 81 s, from two
  devices sending junk calls and junk events) stood ahead of every other tenant's
  request and model text, and a quiet tenant's request waited for the flood to end.
  Now a message of a quiet tenant waits for at most one message of each other tenant
  with something queued (and the window), whatever those tenants have queued;
- EVENTS (one per link, `event_channel(k)`): the event lanes of the tenants that link
  reads (`link_of`), round robin across tenants, then across that tenant's devices, one
  message per turn, so a flooding device slows only itself and its own tenant. A
  tenant's events go out on the connection that read them: written by the thread that
  read them, on its own client, they cost what they cost on the event connection (from
  link 1 on another link's client, 140 us of CPU per relayed event against 92-101,
  bench_bridge --tenant-link 1, figure 3), and a neighbour's flood never fills a
  quiet tenant's window.

Apart, because a window shared with a flood of events is full whenever the flood is on:
a board's RPC chunk, first in line, still waited for the broker to acknowledge one of
the flood's events before it could go. Nothing needs an order across the channels: the
broker keeps order per topic and connection, and what both write to one topic (a host's
P/h/T/D/evt) is told apart by run and id: a run's events (and a replay answer's copies
of them, which hosts drop by id) and the bridge's stream `_b`, which hosts fold as it
comes. What the bridge says on `_b` about a device's own stream (its presence, events
it lost) is queued behind that device's events (`offer_event` with kind NOTICE), so it
does not overtake them (bridge.py `_device_notice`).

When every lane of a channel is empty and nothing is being handed to its paho client,
the thread that made a message hands it to paho itself (`_direct`) instead of waking the
forwarder for it: it would be next in any order, and a thread's wake-up is a good share
of a relay's latency (paho's own network thread then writes it, as it writes
everything). One message is
handed to a channel's client at a time, by its forwarder or by such a producer
(`handing`), so the lanes' order holds. For the same reason the forwarder is woken only when it has
something to do (`_wake`): a message queued, or one waiting for the window or the
handing turn. Woken at every hand-over and acknowledgement, it took the interpreter's
lock from the thread relaying the next event twice per event.

The publisher respects paho's capacity: it keeps at most `window` QoS 1 messages that
a client holds and the broker has not acknowledged (counted by `on_publish`, per
channel: message ids are a client's own), and otherwise
waits (bounded waits, woken by each acknowledgement). A message it took is never
dropped: one paho refuses for a full queue goes back to the front and is tried again.

Nothing is taken that there is no room for. An event is offered (`offer_event`) and
refused, with the reason, when its device's queue, its tenant's queue or the global
memory `Budget` is full; the intake then does not advance past it and fetches it again
with its gap repair once `has_room` says so (intake.py). A host request that finds its
tenant's lane full is refused `busy` (`host`), by name, on the tenant's `_b` stream. A
tenant's board lane holds at most `board_lane` messages: an RPC worker waits for room
(its model is slowed), and an answer made on paho's network thread (a refusal of a
junk call) that finds it full is not queued (`board` returns False): counted
`lanes.board_full` and `tenant.T.board_full`, logged once per episode, and its call,
never started, is one its board times out on. What else the bridge sends a board
(replay and cancel requests, bounded per run where they are made) is always taken.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, cast

import paho.mqtt.client as mqtt

from server_bridge.config import BridgeConfig
from server_bridge.mqttclient import Client
from server_bridge.wire import WireError

__all__ = ["CONTROL", "EVENTS", "Budget", "Busy", "Kind", "Outbox", "RateLimited", "event_channel"]

log = logging.getLogger("wren.bridge.lanes")

Count = Callable[[str, int], None]

# What a queued message costs besides its payload: the bytes object's header, the tuple
# and the deque slot that hold it (CPython 3.11, 64-bit: 33 + 72 + 8, rounded up).
OVERHEAD = 128
# How long the forwarder sleeps at most between looks, should a wake-up be missed; and
# how long it waits before trying again a message paho refused for a full queue.
_IDLE_S = 0.5
_RETRY_S = 0.01
# How long stop() lets the forwarder drain the lanes into paho (connected or not, paho
# keeps what it took for the next connection of this persistent session).
_DRAIN_S = 5.0
# Acknowledgements seen before their publish() returned (paho's network thread can read
# the PUBACK first): few at any time; the bound only guards against a mid that is never
# claimed (a publish made outside the outbox).
_EARLY_MAX = 1024
# `_b` notices queued per tenant, over what else its host lane holds. Each answers one
# host message, which the tenant's rate (host_burst, host_rate) already bounds: this is
# the room for the refusals of a burst, beyond which a host that keeps sending is not
# told again (counted `host.untold`).
NOTICES_PER_TENANT = 256
# The outbox's channels (module docstring): the connection a message goes out on.
EVENTS = "events"


def event_channel(link: int) -> str:
    """The name of link `link`'s event channel (on_publish's `channel`)."""
    return EVENTS if link == 0 else f"{EVENTS}{link}"


def _event_index(channel: str) -> int:
    return int(channel[len(EVENTS) :] or 0)
CONTROL = "control"


class Kind:
    """What a message is, for the counters: `evt.forwarded` counts EVT only."""

    EVT = "evt"  # a run event on its way to hosts (the board's, or one the bridge made)
    BOARD = "board"  # RPC answers, replay and cancel ctl, the bridge's presence
    REQ = "req"  # a host's request on its way to a board
    CTL = "ctl"  # a host's ctl on its way to a board
    NOTICE = "notice"  # the bridge's `_b` stream: refusals and replay answers' gaps
    REPLAY = "replay"  # a host replay's answer, from the intake's window


class Busy(WireError):
    """A tenant's host lane is full: the request was not taken (send it again later)."""

    kind = "busy"


class RateLimited(WireError):
    """A tenant sent more host requests than its configured rate allows."""

    kind = "rate_limited"


class Budget:
    """Bytes of events the bridge holds — queued in the outbox, held by the intake past
    a hole — in total, across every tenant: the process's memory bound for them.

    `take` says no once the budget is spent (the event is deferred), except for a first
    event into an empty budget, so one event as large as the budget still moves.
    `force` is for the few events the bridge makes itself (a run's gap and run.failed
    when its board is gone), which must go out: counted apart, in `forced`.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._used = 0
        self.peak = 0
        self.forced = 0

    @property
    def used(self) -> int:
        return self._used

    def take(self, n: int) -> bool:
        with self._lock:
            if self._used and self._used + n > self.limit:
                return False
            self._used += n
            self.peak = max(self.peak, self._used)
            return True

    def force(self, n: int) -> None:
        with self._lock:
            self._used += n
            self.forced += n

    def give(self, n: int) -> None:
        with self._lock:
            self._used -= n

    def low(self) -> bool:
        """At most half spent: room enough to fetch deferred events again."""
        return self._used * 2 <= self.limit


class _Msg(NamedTuple):
    topic: str
    payload: bytes
    kind: str
    tenant: str | None
    cost: int  # bytes charged to the budget (events), released once paho has it
    retain: bool = False


class _Channel:
    """One connection's side of the outbox: its client and forwarder, and what it has
    handed that client (all under the outbox's lock)."""

    def __init__(self, name: str, window: int, lock: threading.Lock) -> None:
        self.name = name
        self.window = window
        # Its forwarder waits here, on the outbox's one lock: a channel's acks and
        # messages wake its own forwarder only. With one condition for both, each ack
        # of a flood's events woke the idle control forwarder too, to find nothing
        # (bench_bridge figure 3: a fifth more CPU per relayed event from 10 boards).
        self.cond = threading.Condition(lock)
        self.client: mqtt.Client | None = None
        self.thread: threading.Thread | None = None
        # QoS 1 messages the client holds that the broker has not acknowledged, by mid.
        self.outstanding = 0
        self.mids: set[int] = set()
        self.early: set[int] = set()
        # A message is being handed to the client (by the forwarder, or by its producer
        # on the direct path): nobody else hands one over meanwhile, so order holds.
        self.handing = False
        # The forwarder waits for a message (not for room in the window): only then does
        # a producer's new message wake it. Woken for every event while it waited for
        # the broker's acks, it took the lock, found no room and slept again: under a
        # flood the wake-ups alone were a tenth of the network thread's time.
        self.idle = False
        # What the client refused, first in line for another try.
        self.retry: deque[_Msg] = deque()
        self.full_episode = False
        # An event channel's tenants with events queued, in turn order; None for the
        # control channel.
        self.turn: OrderedDict[str, _Tenant] | None = None


@dataclass(eq=False)
class _Tenant:
    name: str
    host: deque[_Msg] = field(default_factory=deque)
    # What the bridge sends this tenant's boards (module docstring): its turn on the
    # control channel serves this lane first.
    board: deque[_Msg] = field(default_factory=deque)
    # Devices with queued events, in turn order (the one served goes to the end).
    devices: OrderedDict[str, deque[_Msg]] = field(default_factory=OrderedDict)
    device_bytes: dict[str, int] = field(default_factory=dict)
    bytes: int = 0
    # `_b` notices among `host`: bounded apart, so a lane full of requests (or of one
    # long replay answer) still has room to say so.
    notices: int = 0
    # The host request rate: a token bucket.
    tokens: float = 0.0
    stamp: float = 0.0


class Outbox:
    """Lanes, their scheduler and the publisher; see the module docstring."""

    def __init__(
        self,
        count: Count,
        budget: Budget,
        *,
        window: int = BridgeConfig.max_inflight_messages,
        device_queue_bytes: int = BridgeConfig.device_queue_bytes,
        tenant_queue_bytes: int = BridgeConfig.tenant_queue_bytes,
        host_lane: int = BridgeConfig.host_lane,
        host_rate: float = BridgeConfig.host_rate,
        host_burst: int = BridgeConfig.host_burst,
        board_lane: int = BridgeConfig.board_lane,
        max_tenants: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        event_links: int = 1,
    ) -> None:
        self._count = count
        self.budget = budget
        self._device_cap = device_queue_bytes
        self._tenant_cap = tenant_queue_bytes
        self._host_cap = host_lane
        self._rate = host_rate
        self._burst = host_burst
        self._board_cap = board_lane
        self._max_tenants = max_tenants
        self._clock = clock
        # One lock for every lane; the forwarder waits on it for work and for room. It
        # is never held while paho is called, and paho's callbacks (on_publish) take it
        # only briefly, so no lock order with paho's own locks arises.
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        # The bridge's own messages, for no tenant (its presence): first in line.
        self._board: deque[_Msg] = deque()
        # One event channel per link (bridge.py, links.py): a tenant's events go out on
        # the connection that read them, each with its own window and forwarder.
        self._event_chs = [_Channel(event_channel(k), window, lock) for k in range(event_links)]
        for ch in self._event_chs:
            ch.turn = OrderedDict()
        # Which link reads a tenant's boards (the bridge sets it; 0 without links).
        self.link_of: Callable[[str], int] = lambda tenant: 0
        self._control = _Channel(CONTROL, window, lock)
        # Tenants in least-recently-used order, bounded (a tenant's state is its lanes
        # and its rate bucket; one with nothing queued is forgotten first).
        self._tenants: OrderedDict[str, _Tenant] = OrderedDict()
        # Tenants with board or host messages queued, in turn order (control channel).
        self._control_turn: OrderedDict[str, _Tenant] = OrderedDict()
        self._stopping = False
        self._draining_until = 0.0
        self._untold_episode = False
        self._board_full_episode = False
        # RPC workers waiting in board() for room in a board lane.
        self._board_waiting = 0

    @property
    def _events(self) -> _Channel:
        """The event connection's channel (link 0)."""
        return self._event_chs[0]

    def _event_channel(self, tenant: str) -> _Channel:
        link = self.link_of(tenant)
        return self._event_chs[link if 0 <= link < len(self._event_chs) else 0]

    # ------------------------------------------------------------------ producers

    def offer_event(
        self,
        tenant: str,
        device: str,
        topic: str,
        payload: bytes,
        force: bool = False,
        kind: str = Kind.EVT,
    ) -> str | None:
        """Queue an event for hosts; None when taken, else why not: "device", "tenant"
        (that queue is full) or "budget" (the memory budget is spent).

        A queue that is empty always takes one event, however large, so the caps never
        stop a device for good. `force` takes it whatever the caps say (the events the
        bridge makes itself, a handful per run). `kind` NOTICE is a `_b` notice that must
        keep its place behind the device's events (a loss the bridge tells of them).
        """
        cost = len(payload) + OVERHEAD
        with self._cond:
            ten = self._tenant(tenant)
            dev_bytes = ten.device_bytes.get(device, 0)
            if force:
                self.budget.force(cost)
            elif dev_bytes and dev_bytes + cost > self._device_cap:
                return "device"
            elif ten.bytes and ten.bytes + cost > self._tenant_cap:
                return "tenant"
            elif not self.budget.take(cost):
                return "budget"
            msg = _Msg(topic, payload, kind, tenant, cost)
            ch = self._event_channel(tenant)
            direct = self._direct(ch)
            if direct is None:
                lane = ten.devices.get(device)
                if lane is None:
                    lane = ten.devices[device] = deque()
                lane.append(msg)
                ten.device_bytes[device] = dev_bytes + cost
                ten.bytes += cost
                assert ch.turn is not None
                if tenant not in ch.turn:
                    ch.turn[tenant] = ten
                self._queued(ch)
        if direct is not None:
            self._publish(ch, direct, msg)
        return None

    def has_room(self, tenant: str, device: str) -> bool:
        """Room to fetch a device's deferred events again: its queue, its tenant's and
        the budget each at most half full (so one replay brings a good share at once)."""
        with self._cond:
            ten = self._tenants.get(tenant)
            if ten is not None and (
                ten.device_bytes.get(device, 0) * 2 > self._device_cap
                or ten.bytes * 2 > self._tenant_cap
            ):
                return False
        return self.budget.low()

    def admit_host(self, tenant: str) -> None:
        """Take one host request of `tenant` against its rate; raise RateLimited past it
        and Busy when its lane is full (nothing is queued by this call)."""
        with self._cond:
            ten = self._tenant(tenant)
            now = self._clock()
            ten.tokens = min(float(self._burst), ten.tokens + (now - ten.stamp) * self._rate)
            ten.stamp = now
            if ten.tokens < 1.0:
                self._count(f"tenant.{tenant}.rate_limited", 1)
                raise RateLimited(
                    f"tenant {tenant} is over its rate of {self._rate:g} requests a second"
                )
            if len(ten.host) - ten.notices >= self._host_cap:
                self._count(f"tenant.{tenant}.busy", 1)
                raise Busy(
                    f"the bridge has {len(ten.host) - ten.notices} messages of tenant "
                    f"{tenant} waiting to go out; send it again later"
                )
            ten.tokens -= 1.0

    def host(self, tenant: str, messages: list[tuple[str, bytes]], kind: str) -> None:
        """Queue a host request's messages (admitted by admit_host) in its tenant's lane,
        in order. A replay answer is up to a run's window of events: the lane's bound is
        counted in requests, each bringing at most that many messages."""
        ch = self._control
        with self._cond:
            ten = self._tenant(tenant)
            direct = self._direct(ch) if len(messages) == 1 else None
            if direct is None:
                ten.host.extend(
                    _Msg(topic, payload, kind, tenant, 0) for topic, payload in messages
                )
                if messages and tenant not in self._control_turn:
                    self._control_turn[tenant] = ten
                self._queued(ch)
        if direct is not None:
            self._publish(ch, direct, _Msg(*messages[0], kind, tenant, 0))

    def notice(self, tenant: str, topic: str, payload: bytes, loss: bool = False) -> bool:
        """Queue an `error` of the bridge's `_b` stream for a tenant's hosts.

        Notices have a bound of their own, NOTICES_PER_TENANT of them queued per tenant, over
        whatever else the lane holds (refusals are what a full lane causes); past that
        one is not queued, counted `host.untold` and logged once per episode: the
        refusal itself is still counted and kept in Bridge.refusals. A `loss` notice
        (events hosts will never get) is the one report of that loss, so it is always
        queued, charged to the memory budget like an event until it is sent: each stands
        for a run the bridge gave up, which events it took paid for.
        """
        with self._cond:
            ten = self._tenant(tenant)
            if ten.notices >= NOTICES_PER_TENANT and not loss:
                self._count("host.untold", 1)
                first, self._untold_episode = not self._untold_episode, True
            else:
                cost = 0
                if loss:
                    cost = len(payload) + OVERHEAD
                    self.budget.force(cost)
                ten.host.append(_Msg(topic, payload, Kind.NOTICE, tenant, cost))
                ten.notices += 1
                if tenant not in self._control_turn:
                    self._control_turn[tenant] = ten
                self._queued(self._control)
                self._untold_episode = False
                return True
        if first:
            log.warning("tenant %s's host lane is full: refusals are not told to its hosts", tenant)
        return False

    def board(
        self,
        topic: str,
        payload: bytes,
        wait_until: float | None = None,
        retain: bool = False,
        tenant: str | None = None,
        refusable: bool = False,
    ) -> bool:
        """Queue a message of the bridge's own to a board of `tenant` (None: the bridge's
        own lane, first of all: its presence, and an answer to a device the registry does
        not know), first in that tenant's turn; True when queued.

        A caller that may wait (an RPC worker, `wait_until` a time.monotonic() value)
        waits while the tenant's lane holds `board_lane` messages or more, so a model
        streaming faster than the broker takes it is slowed, not queued without end; past
        its time it is queued all the same (counted `lanes.board_over`: the call's own
        deadline bounds it). A `refusable` message (an answer made on paho's network
        thread, which never waits) that finds the lane full is not queued: counted, logged
        once per episode, and False (module docstring). Anything else is always taken:
        what feeds it is bounded where it is made (one replay or cancel request per run).
        """
        ch = self._control
        first = False
        with self._cond:
            ten = self._tenant(tenant) if tenant is not None else None
            lane = ten.board if ten is not None else self._board
            while (
                wait_until is not None
                and ten is not None
                and len(lane) >= self._board_cap
                and not self._stopping
            ):
                left = wait_until - time.monotonic()
                if left <= 0:
                    self._count("lanes.board_over", 1)
                    break
                self._board_waiting += 1
                try:
                    self._cond.wait(min(left, _IDLE_S))
                finally:
                    self._board_waiting -= 1
            if refusable and len(lane) >= self._board_cap:
                self._count("lanes.board_full", 1)
                if tenant is not None:
                    self._count(f"tenant.{tenant}.board_full", 1)
                first, self._board_full_episode = not self._board_full_episode, True
                direct = None
                queued = False
            else:
                msg = _Msg(topic, payload, Kind.BOARD, tenant, 0, retain)
                direct = self._direct(ch)
                if direct is None:
                    lane.append(msg)
                    if ten is not None and tenant not in self._control_turn:
                        self._control_turn[ten.name] = ten
                    self._queued(ch)
                queued = True
                if refusable and len(lane) * 2 <= self._board_cap:
                    self._board_full_episode = False
        if first:
            log.warning(
                "tenant %s's board lane holds %d messages: answers made on the network "
                "thread are not queued (counted lanes.board_full)",
                tenant,
                self._board_cap,
            )
        if direct is not None:
            self._publish(ch, direct, msg)
        return queued

    def _tenant(self, name: str) -> _Tenant:
        ten = self._tenants.get(name)
        if ten is None:
            ten = _Tenant(name, tokens=float(self._burst), stamp=self._clock())
            self._tenants[name] = ten
            if len(self._tenants) > self._max_tenants:
                self._forget_idle_tenant()
        else:
            self._tenants.move_to_end(name)
        return ten

    def _forget_idle_tenant(self) -> None:
        # The oldest with nothing queued; a tenant forgotten starts with a full bucket.
        for name, ten in self._tenants.items():
            if not ten.host and not ten.devices and not ten.board:
                del self._tenants[name]
                return

    # ------------------------------------------------------------------ readers

    def depth(self) -> dict[str, int]:
        """How much waits in the lanes now, and the budget: for stats and tests."""
        with self._cond:
            events = sum(len(q) for t in self._tenants.values() for q in t.devices.values())
            boards = sum(len(t.board) for t in self._tenants.values())
            return {
                "board": len(self._board) + boards + len(self._control.retry),
                "host": sum(len(t.host) for t in self._tenants.values()),
                "events": events + sum(len(ch.retry) for ch in self._event_chs),
                "event_bytes": sum(t.bytes for t in self._tenants.values()),
                "outstanding": sum(ch.outstanding for ch in self._event_chs)
                + self._control.outstanding,
                "outstanding_control": self._control.outstanding,
                "budget_used": self.budget.used,
                "budget_peak": self.budget.peak,
            }

    def queued_bytes(self, tenant: str, device: str | None = None) -> int:
        with self._cond:
            ten = self._tenants.get(tenant)
            if ten is None:
                return 0
            return ten.bytes if device is None else ten.device_bytes.get(device, 0)

    # ------------------------------------------------------------------ the forwarder

    def start(self, events: mqtt.Client | Sequence[mqtt.Client], control: mqtt.Client) -> None:
        """Start a forwarder for each channel: events on `events` (one client per link,
        link 0 first), the board and host lanes on `control` (each client's on_publish
        must call on_publish with its channel). A client each, never one for two: the
        channels count message ids apart."""
        clients: list[mqtt.Client] = (
            list(events) if isinstance(events, (list, tuple)) else [cast(mqtt.Client, events)]
        )
        if len(clients) != len(self._event_chs):
            raise ValueError(f"the outbox has {len(self._event_chs)} event channels")
        if control in clients or len(set(map(id, clients))) != len(clients):
            raise ValueError("the outbox's channels need a client each")
        with self._cond:
            for ch, client in zip(self._event_chs, clients, strict=True):
                ch.client = client
            self._control.client = control
            self._stopping = False
        names = ["wren-bridge-forwarder" + ("" if k == 0 else f"-l{k}")
                 for k in range(len(self._event_chs))]  # fmt: skip
        for ch, name in (*zip(self._event_chs, names, strict=True),
                         (self._control, "wren-bridge-forwarder-ctl")):  # fmt: skip
            ch.thread = threading.Thread(target=self._forward, args=(ch,), name=name, daemon=True)
            ch.thread.start()

    def stop(self, drain_s: float = _DRAIN_S) -> int:
        """Let the forwarder hand paho what is queued (for up to drain_s), then stop it;
        returns how many messages were left unsent (counted `lanes.unsent_at_stop`)."""
        with self._cond:
            self._draining_until = time.monotonic() + drain_s
            self._stopping = True
            self._cond.notify_all()
            for ch in (*self._event_chs, self._control):
                ch.cond.notify_all()
        for ch in (*self._event_chs, self._control):
            if ch.thread is not None:
                # Both drain at once: the second waits only for what the first left.
                ch.thread.join(max(0.0, self._draining_until - time.monotonic()) + 1.0)
                ch.thread = None
        with self._cond:
            left = len(self._board)
            for ch in (*self._event_chs, self._control):
                ch.client = None
                left += len(ch.retry)
            for ten in self._tenants.values():
                left += len(ten.host) + len(ten.board)
                left += sum(len(q) for q in ten.devices.values())
        if left:
            self._count("lanes.unsent_at_stop", left)
            log.warning("stopping with %d messages not handed to the broker", left)
        return left

    def on_publish(self, mid: int, channel: str = EVENTS) -> None:
        """paho's on_publish of a channel's client (its network thread, with paho's locks
        held): the broker has a message. Only counts and wakes the forwarder; never
        calls paho."""
        ch = self._control if channel == CONTROL else self._event_chs[_event_index(channel)]
        with self._cond:
            if mid in ch.mids:
                ch.mids.discard(mid)
                ch.outstanding -= 1
                self._wake(ch)
            elif len(ch.early) < _EARLY_MAX:
                ch.early.add(mid)

    def _forward(self, ch: _Channel) -> None:
        while True:
            with self._cond:
                msg = None
                while True:
                    # Draining at a stop only while connected: what paho keeps for a
                    # reconnect dies with the process anyway.
                    draining = (
                        self._stopping
                        and time.monotonic() < self._draining_until
                        and ch.client is not None
                        and ch.client.is_connected()
                    )
                    if self._stopping and not draining:
                        return
                    idle = False
                    if ch.client is not None and ch.outstanding < ch.window and not ch.handing:
                        msg = self._next(ch)
                        if msg is not None:
                            break
                        if self._stopping:
                            return  # drained
                        idle = True
                    ch.idle = idle
                    try:
                        ch.cond.wait(_IDLE_S if not self._stopping else _RETRY_S)
                    finally:
                        ch.idle = False
                ch.outstanding += 1
                ch.handing = True
                client = ch.client
            assert client is not None
            if not self._publish(ch, client, msg):
                time.sleep(_RETRY_S)

    def _waiting(self, ch: _Channel) -> bool:
        """Something of this channel waits in its lanes (the lock is held)."""
        if ch.retry:
            return True
        if ch.turn is None:
            return bool(self._board or self._control_turn)
        return bool(ch.turn)

    def _direct(self, ch: _Channel) -> mqtt.Client | None:
        """The channel's client, when the caller may hand its message to paho itself:
        nothing of the channel queued, nothing being handed over, room in its window
        (the lock is held). The caller then holds the handing turn and must call
        _publish; else None."""
        if (
            ch.handing
            or ch.client is None
            or self._stopping
            or ch.outstanding >= ch.window
            or self._waiting(ch)
        ):
            return None
        ch.outstanding += 1
        ch.handing = True
        return ch.client

    def _publish(self, ch: _Channel, client: mqtt.Client, msg: _Msg) -> bool:
        """Hand one message to paho, then give the handing turn back (the lock not
        held); False when it failed and waits in the retry lane."""
        ok = True
        try:
            self._send(ch, client, msg)
        except Exception:
            # Our bug, or paho's: logged and counted, and the message is not lost.
            log.exception("the bridge failed to publish to %s", msg.topic)
            self._count("callback_errors", 1)
            ok = False
        with self._cond:
            if not ok:
                ch.outstanding -= 1
                ch.retry.appendleft(msg)
            ch.handing = False
            self._wake(ch)
        if isinstance(client, Client):
            # Written now by this thread, not when paho's network thread gets to it
            # (server_bridge/mqttclient.py): an RPC worker's chunk, the forwarder's next.
            # After the handing turn is given back: paho has the message in its order
            # already, and a producer that found the turn taken would queue its own
            # for the forwarder to wake up for. Also when the send failed: a message
            # queued quietly before the failure is then the network thread's.
            client.flush()
        return ok

    def _queued(self, ch: _Channel) -> None:
        """A message was queued for a channel: wake its forwarder if it waits for one
        (the lock is held). Waiting for room instead, it is woken when room comes."""
        if ch.idle:
            ch.cond.notify()

    def _wake(self, ch: _Channel) -> None:
        """Wake the channel's forwarder (and, for the control channel, the RPC workers
        waiting for the board lane) after its window or handing turn freed up, when
        someone can use it: a message of the channel is queued, a worker waits, or the
        outbox is stopping. The lock is held."""
        if self._waiting(ch) or self._stopping:
            ch.cond.notify()
        if ch is self._control and self._board_waiting:
            self._cond.notify_all()

    def _next(self, ch: _Channel) -> _Msg | None:
        """The channel's next message by the lanes' order (module docstring); the lock
        is held."""
        if ch.retry:
            return ch.retry.popleft()
        if ch.turn is not None:
            return self._next_event(ch.turn)
        if self._board:
            return self._board.popleft()
        if self._control_turn:
            name, ten = next(iter(self._control_turn.items()))
            if ten.board:
                msg = ten.board.popleft()
            else:
                msg = ten.host.popleft()
                if msg.kind == Kind.NOTICE:
                    ten.notices -= 1
            del self._control_turn[name]
            if ten.board or ten.host:
                self._control_turn[name] = ten  # to the back of the round
            return msg
        return None

    def _next_event(self, turn: OrderedDict[str, _Tenant]) -> _Msg | None:
        """The next event of a channel, round robin (module docstring); the lock is
        held."""
        if turn:
            name, ten = next(iter(turn.items()))
            device, lane = next(iter(ten.devices.items()))
            msg = lane.popleft()
            del ten.devices[device]
            left = ten.device_bytes[device] - msg.cost
            if lane:
                ten.devices[device] = lane  # to the back of its tenant's round
                ten.device_bytes[device] = left
            else:
                del ten.device_bytes[device]
            ten.bytes -= msg.cost
            del turn[name]
            if ten.devices:
                turn[name] = ten
            return msg
        return None

    def _send(self, ch: _Channel, client: mqtt.Client | None, msg: _Msg) -> None:
        assert client is not None
        if isinstance(client, Client):
            # Written by this thread's flush (_publish): the network thread is not woken.
            info = client.publish_quiet(msg.topic, msg.payload, qos=1, retain=msg.retain)
        else:
            info = client.publish(msg.topic, msg.payload, qos=1, retain=msg.retain)
        rc = info.rc
        with self._cond:
            if rc in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
                # Taken: NO_CONN means paho keeps it and sends it once connected again.
                if info.mid in ch.early:
                    ch.early.discard(info.mid)
                    ch.outstanding -= 1
                else:
                    ch.mids.add(info.mid)
                if msg.cost:
                    self.budget.give(msg.cost)
                if ch.full_episode:
                    ch.full_episode = False
                    log.info("paho takes messages again")
            elif rc == mqtt.MQTT_ERR_QUEUE_SIZE:
                # paho's own bound (max_queued_messages) is above the window, so only a
                # publish made outside the outbox gets here: wait, then the same message.
                ch.outstanding -= 1
                ch.retry.appendleft(msg)
                first, ch.full_episode = not ch.full_episode, True
            else:
                ch.outstanding -= 1
                if msg.cost:
                    self.budget.give(msg.cost)
        if rc in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            self._count("tx", 1)
            if rc == mqtt.MQTT_ERR_NO_CONN:
                self._count("publish.queued_offline", 1)
            if msg.kind == Kind.EVT:
                self._count("evt.forwarded", 1)
                self._count(f"tenant.{msg.tenant}.evt.forwarded", 1)
        elif rc == mqtt.MQTT_ERR_QUEUE_SIZE:
            self._count("publish.queue_full", 1)
            if first:
                log.warning("paho's outgoing queue is full: waiting, first for %s", msg.topic)
            time.sleep(_RETRY_S)
        else:
            # Nothing else is expected; what could not be sent must be visible.
            self._count("publish.not_sent", 1)
            log.warning("publish to %s returned %s", msg.topic, mqtt.error_string(rc))
