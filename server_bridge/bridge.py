"""The server bridge process: MQTT link, identity, RPC, event intake, host requests.

Identity comes from the topic, never the payload: a device is the D level of P/d/D/...,
which the broker's ACL binds to the device's authenticated MQTT user; the registry maps
it to its tenant and agent. A host's request is on P/h/T/D/..., and the user is the one
its session token proves for tenant T. A `tenant`, `user`, `device`, `usr` or `ten` key
inside any payload is data and changes nothing.

Every input the bridge refuses is counted by kind (`stats["refused.<kind>"]`), kept in
a short list of recent refusals, logged with its kind, and answered where there is
someone to answer: a board's RPC call with an RPC error, a host's req or ctl with an
`error` event `{kind, msg, req?}` on that host's own user topic P/h/T/D/u/U/evt (the
device's P/h/T/D/evt when its token did not verify), in the bridge's stream for that
tenant and device (run id "_b", ids 1, 2, 3 ... kept in memory). A host acts on a run
only as its user or as a watcher (access.py; PROTOCOL.md "Who sees what"). Then the
bridge carries on with the next message. A retained message on any topic it reads but a
board's status is refused (`retained`, told to no one: whoever sent it is long gone) and
cleared at the broker; the bridge retains nothing but its own presence. Every paho
callback is wrapped so an exception in our code is logged with its traceback and the
network thread keeps running.

Everything the bridge publishes goes through its outbox (lanes.py): bounded lanes, a
fair scheduler and one forwarder thread that hands paho what it has room for, so paho's
network thread only decodes, validates and queues, and nothing the bridge took is
dropped. A tenant's host requests are refused `rate_limited` or `busy` (on `_b`) when it
is over its rate or its lane is full.

Two connections, two users (`config.username` and its control user, brokerconf.py):
the event connection reads boards' `evt`, `hello` and `status` and sends events to
hosts; the control connection reads boards' RPC calls (`P/d/+/rpc`) and hosts' `req`
and `ctl`, sends everything the bridge itself says to boards (RPC answers, `req`, `ctl`)
and to hosts on `_b`, and carries the bridge's presence and last will. Mosquitto keeps
one queue per connection: with one, a board's model call and a host's request waited
behind every event a flooding neighbour had queued (bench_bridge figure 4), tens of
thousands a second. A flood now fills only the event connection's queue. Presence
follows the control connection, because what boards and hosts read it for is whether
their calls and requests are served: its will says offline when it drops, and it says
online again when it is back. The event connection alone dropping changes nothing a
board acts on: what boards send meanwhile waits in its persistent session.

Two network threads now call _on_message. Everything they reach is shared under a lock
of its own, as it already was for the housekeeping thread and the RPC workers: the
intake's state (one lock, EventIntake._lock), the RPC server's calls (RpcServer._lock
and each call's own), the outbox (its condition), the registry's snapshot, the token
cache, the `_b` stream ids, the counters and refusals and `_told_offline` (self._lock),
the other bridges' presence (`_rivals_cond`). No lock is held while another is taken,
except each component's own in its order, so no new lock order arises. What the
threads do not share is order: a board's `status` (event connection) may be acted on
after an RPC call it sent later (control connection). The contract relies on no order
across topics (PROTOCOL.md "Order"): calls carry their run id, whose boot says whether
its board is still the one that made it.

Nothing is lost while the bridge or the broker is away. The bridge's MQTT session is
persistent (clean session off, a stable client id): what boards send while it is
stopped waits at the broker, and what it publishes while the broker is away paho keeps
and sends after reconnecting. It announces itself on P/b/status, retained — online on
every connect, offline as its last will and on a clean stop — so a board fails the RPC
calls it waits on at once instead of at their timeout. A host's `ctl replay` is
answered here, from the intake's window of the run's events, never by the board.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar, cast

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from server_bridge import access, metrics, tokens
from server_bridge.brokerconf import LINKS
from server_bridge.config import BridgeConfig
from server_bridge.conversations import History, Turns
from server_bridge.eventlog import EventStore
from server_bridge.fleet import LeaseKeeper
from server_bridge.fleet.calls import FleetCallRows, OpenCalls
from server_bridge.host.reducer import Reducer, RunSnapshot
from server_bridge.http.hub import EventHub
from server_bridge.http.views import event_json, snapshot_json
from server_bridge.intake import EventIntake
from server_bridge.knowledge import KnowledgeBase
from server_bridge.knowledge import calls as knowledge_calls
from server_bridge.knowledge.augment import Augmenter
from server_bridge.lanes import CONTROL, Budget, Kind, Outbox, event_channel
from server_bridge.links import LinkPlan, PartitionLinks, PartitionPlan, batches
from server_bridge.memory import calls as memory_calls
from server_bridge.memory.service import MemoryService
from server_bridge.metrics import prometheus_text
from server_bridge.mirror import JsonMirror, both
from server_bridge.models.base import Provider
from server_bridge.mqttclient import Client, connack_refusal
from server_bridge.redact import MASK, scrub
from server_bridge.registry import DeviceRecord, RegistryStore
from server_bridge.rpc import RpcServer
from server_bridge.tcp import no_delay
from server_bridge.tokens import TokenError
from server_bridge.topics import (
    UNOWNED,
    BadTopic,
    Topic,
    bridge_topic,
    device_topic,
    host_event_topic,
    host_topic,
    is_id,
    parse,
)
from server_bridge.wire import (
    BRIDGE_RUN,
    DEVICE_RUN,
    MAX_ERROR_MSG,
    MAX_ID,
    REFUSALS,
    RETAINED,
    BadEnvelope,
    DeviceOffline,
    Limits,
    NoScope,
    TooLarge,
    UnknownDevice,
    WireError,
    check_host_ctl,
    check_host_req,
    decode,
    encode,
)

__all__ = ["BRIDGE_RUN", "Bridge", "BridgeError", "LoginRefused", "Refusal", "RivalBridge"]

log = logging.getLogger("wren.bridge")

F = TypeVar("F", bound=Callable[..., Any])

# How often the housekeeping thread retries replay requests, expires slow RPC calls and
# sends RPC text held past merge_s (config.rpc_merge_s, 0.05 s: a slower tick would hold
# a stalled provider's text several times that). A pass costs ~4 us on an idle bridge and
# ~0.3 ms with 1024 runs all waiting on a replay and 64 calls in flight.
_TICK_S = 0.05
#: The most events one replay answer carries (from the log, a run may hold many more
#: than the window's): past them the answer ends with `replay_cut`, and the host asks
#: again after the last id it got.
REPLAY_MAX_EVENTS = 4096
# How often the event log's retention runs (whole segments go; a segment is 4 MiB).
_RETAIN_EVERY_S = 60.0
# Ended runs' snapshots kept folded, for listing conversations (Bridge._fold_run).
_FOLDED_RUNS = 1024
# How long a clean stop waits for the broker to take its offline status.
_STOP_STATUS_WAIT_S = 5.0
# How long a stop waits, once it has answered the calls in flight `bridge_stopping`, for
# their boards' runs to end (their run.failed goes out to hosts through this bridge):
# a board answers within a few ms; one that does not is left to the offline status.
_STOP_RUNS_WAIT_S = 1.5
_STOP_POLL_S = 0.02
# At start, how long another bridge's retained `online` may stand before this bridge
# believes it: a bridge that died without a word (its socket half open, or our own
# connection of the same user just took its over) is followed by its will, and a live
# one of the same user takes its connection back within its 1 s reconnect delay.
_RIVAL_GRACE_S = 2.5
# Messages a persistent session delivers while the start checks for another bridge,
# held and acted on once the check passes (a session keeps 1,000 at most in Mosquitto's
# default config; past this they are dropped, counted, and their senders time out).
_HELD_AT_START = 10_000
# An empty payload on an input topic within this long of the bridge clearing a retained
# message there is that clear coming back (MQTT 3.1.1 has no "no local"), or another
# bridge process's clear of the same message: ignored. Any other empty payload is input,
# refused like any malformed one. Topics remembered at most: one per retained message
# cleared, and they are few (nothing is published retained on these topics by contract).
_CLEAR_ECHO_S = 10.0
_CLEARS_KEPT = 1024
# Early SUBACKs remembered during one deal at most (others' SUBACKs land there too).
_DEAL_EARLY_MAX = 256
# Refusals are logged at most once per kind and tenant this often (Bridge._refuse), and
# that many (kind, tenant) pairs remembered, the least recent forgotten first.
_REFUSAL_LOG_S = 1.0
_REFUSAL_LOG_KEYS = 1024
# How often the registry is read again for devices the links should read (links.py).
_LINKS_CHECK_S = 1.0
# A subscription the broker refuses once the bridge serves (after a reconnect: a cluster
# node that cannot make it yet) is made again after _RESUBSCRIBE_S, then with doubling
# waits up to _MAX_RESUBSCRIBE_S, each refusal logged: the bridge would otherwise stay
# deaf on that connection, and offline to its boards, until the next reconnect.
_RESUBSCRIBE_S = 1.0
_MAX_RESUBSCRIBE_S = 30.0
_CONTROL = -1  # the control connection's key among the links' (0..) in _resubscribe


class _PahoLog(logging.LoggerAdapter):
    """paho's log, as `wren.bridge.paho`; once the bridge is stopping, what paho says at
    WARNING or above goes to DEBUG: paho 2.2's network thread may run once more after
    the disconnect closed the socket and log "Client is not connected" or "failed to
    receive on socket" at ERROR, the expected state of an orderly stop. Before the stop
    a real error is still an ERROR. (Detaching paho's logger at the stop instead raced
    paho's own check of it.) The same while a start that failed is undone (`undoing`:
    another bridge serves the prefix, say), whose one line must stand alone."""

    def __init__(self, stopping: threading.Event, undoing: threading.Event) -> None:
        super().__init__(logging.getLogger("wren.bridge.paho"), {})
        self._stopping = stopping
        self._undoing = undoing

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        if level >= logging.WARNING and (self._stopping.is_set() or self._undoing.is_set()):
            level = logging.DEBUG
        super().log(level, msg, *args, **kwargs)


class _BridgeStreams:
    """The next event id of each (tenant, device) bridge stream `_b`.

    In memory, like the board's device stream: a restart begins again at 1. Bounded,
    least recently used first out, since a host may name any device id in its topic; a
    stream pushed out also begins again at 1, as after a restart.
    """

    def __init__(self, max_streams: int = 4096) -> None:
        self._max = max_streams
        self._lock = threading.Lock()
        self._last: OrderedDict[tuple[str, str], int] = OrderedDict()

    def next_id(self, tenant: str, device: str) -> int:
        key = (tenant, device)
        with self._lock:
            i = self._last.pop(key, 0) + 1
            self._last[key] = i
            while len(self._last) > self._max:
                self._last.popitem(last=False)
        return i


class BridgeError(RuntimeError):
    """The bridge could not start (broker unreachable, refused, or no subscription)."""


class LoginRefused(BridgeError):
    """The broker was reached and refused a connection's CONNECT (CONNACK): its message
    names the user whose credentials were refused (`mqttclient.connack_refusal`)."""


class RivalBridge(BridgeError):
    """Another bridge process is online on the same broker and prefix: one bridge process
    per prefix (PROTOCOL.md "Bridge presence"); the message says which, in one line."""


class RunEvents(NamedTuple):
    """What the bridge holds of a run past some id (Bridge.run_events)."""

    found: list[tuple[int, bytes]]  # (id, the event as hosts were sent it), in id order
    last: int  # the highest id the run is known to have reached
    usr: str | None  # the run's user, when known
    cut: bool  # more than `found` is held: ask again after its last id


class Refusal(NamedTuple):
    kind: str
    topic: str
    msg: str


def _guarded(fn: F) -> F:
    """Log (with traceback) and count any exception of a callback; never let it escape.

    An exception escaping a paho callback would end paho's network thread and with it
    the whole bridge, for one bad message.
    """

    @functools.wraps(fn)
    def wrapper(self: Bridge, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except Exception:
            log.exception("bridge callback %s failed", fn.__name__)
            self._count("callback_errors")
            return None

    return wrapper  # type: ignore[return-value]


class Bridge:
    """One bridge process's link to the broker and everything behind it."""

    def __init__(
        self,
        config: BridgeConfig,
        registry: RegistryStore,
        provider: Provider,
        memory: MemoryService | None = None,
        knowledge: KnowledgeBase | None = None,
        events: EventStore | None = None,
        turns: Turns | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.provider = provider
        # Durable memory (state.*, mem.*, core.*): without it those methods are
        # unknown_method, as before the memory service existed.
        self.memory = memory
        # Document knowledge (kb.*): without it those methods are unknown_method too
        # (PROTOCOL "RPC"): a board cannot tell an old bridge from one without a store,
        # and needs to do the same in both cases.
        self.knowledge = knowledge
        # The durable event log (server_bridge/eventlog): every event hosts are sent is
        # appended to it, and a host's replay reads it where the in-memory window no
        # longer holds the run. None: replays reach only as far back as the window. The
        # caller opened it and closes it, after stop().
        self.events = events
        self._retained_at = 0.0
        self._folded: OrderedDict[tuple[str, str, str], tuple[int, RunSnapshot]] = OrderedDict()
        # Set while a failed start is undone (_abort): paho's errors then are expected.
        self._undoing = threading.Event()
        self._lock = threading.Lock()
        self._stats: Counter[str] = Counter()
        self._refusals: deque[Refusal] = deque(maxlen=config.refusals_kept)
        # (kind, tenant) -> [when last logged, refusals not logged since] (_refuse).
        self._refusal_log: OrderedDict[tuple[str, str | None], list[float]] = OrderedDict()
        # The input topics whose retained message the bridge cleared, and when (monotonic):
        # the empty publishes that come back are those clears (_CLEAR_ECHO_S).
        self._cleared: OrderedDict[str, float] = OrderedDict()
        # The control connection (presence, will, RPC calls, host input) and the event
        # connection (module docstring), each up or not on its own.
        self._client: mqtt.Client | None = None
        self._control_up = False
        # The links that read boards (links.py), link 0 the event connection: each one's
        # client, whether it is up, its first subscription's outcome, and the SUBACKs
        # that outcome waits for.
        # (In fleet mode the partitions are the links, below, and these stay unused.)
        n = 1 if config.fleet else config.tenant_links
        self._plan = LinkPlan(config.prefix, n, config.shared_subscription)
        self._links: list[mqtt.Client | None] = [None] * n
        self._links_up = [False] * n
        self._links_ready = [threading.Event() for _ in range(n)]
        self._links_error: list[str | None] = [None] * n
        self._links_sub_mids: list[set[int]] = [set() for _ in range(n)]
        # What each link reads (its board topics), the registry's devices they were
        # dealt from, and the SUBACKs a change of the deal waits for before it
        # unsubscribes what moved (_refresh_links).
        self._links_lock = threading.Lock()
        self._link_topics: list[set[str]] = [set() for _ in range(n)]
        self._linked_devices: set[str] = set()
        self._tenant_link: dict[str, int] = {}
        self._dealt_from: tuple[tuple[str, str], ...] | None = None
        self._undropped = False  # a refresh without `drop` left topics a link lost
        self._deal_mids: set[tuple[int, int]] = set()
        # SUBACKs read before subscribe() returned their mid to _refresh_links: the
        # SUBSCRIBE goes out on the calling thread at once (mqttclient.py), so the
        # broker's answer can be read first. Emptied at each deal.
        self._deal_early: set[tuple[int, int]] = set()
        self._deal_acked = threading.Event()
        self._links_checked = 0.0
        self._links_token: object = None
        self._ready = threading.Event()
        # Both connections subscribed once: from then on the control connection says
        # online at each (re)connect. Not before: at a first start an event a board sent
        # on the word "online" would find no subscription of the event connection yet.
        self._serving = False
        self._start_error: str | None = None
        # Connections whose subscriptions the broker refused while serving: key
        # (_CONTROL, or a link) -> (when to subscribe again, the wait after that).
        self._resubscribe: dict[int, tuple[float, float]] = {}
        self._resubscribe_lock = threading.Lock()
        # Whether a connection's CONNACK refused it (LoginRefused), either connection.
        self._login_refused = False
        self._sub_mid: int | None = None
        # The start's check for another bridge (_check_rivals): the other bridges' last
        # presence seen on P/b/status, by boot; the round trip that says the retained one
        # has arrived; what the session delivered meanwhile (None once checked).
        self._rivals: dict[str, dict[str, Any]] = {}
        self._rivals_cond = threading.Condition()
        self._probe_sub_mid: int | None = None
        self._probe_unsub_mid: int | None = None
        self._probed = threading.Event()
        self._early_subacks: dict[int, Any] = {}
        self._start_thread: threading.Thread | None = None
        self._lost_at_start = False
        self._gate = threading.Lock()
        # A fleet has no check for another bridge: nothing is held at start.
        self._held: deque[mqtt.MQTTMessage] | None = None if config.fleet else deque()
        self._stopping = threading.Event()
        self._housekeeper: threading.Thread | None = None
        self._streams = _BridgeStreams()
        # Devices whose hosts were told they are offline (a `presence` event on `_b`),
        # to be told when they are back.
        self._told_offline: set[str] = set()
        # Session tokens verified and scope tickets signed, kept for the next request.
        self._tokens = tokens.TokenCache()
        # Who sent each recent host request: a cancel by req id is its sender's (or a
        # watcher's) to make (access.py).
        self._req_owners = access.RequestOwners()
        # A host's act on a run whose user the bridge does not know yet (it met no event
        # of the run since its restart): held while the board replays the run, whose
        # run.paused or run.started names its user. (topic, host topic, the payload.)
        self._awaiting: access.AwaitingOwner[tuple[Topic, str, Any]] = access.AwaitingOwner()
        self._boot = uuid.uuid4().hex[:8]
        # Everything the bridge publishes goes through the outbox's lanes (lanes.py).
        self.outbox = Outbox(
            self._count,
            Budget(config.memory_budget_bytes),
            window=config.max_inflight_messages,
            device_queue_bytes=config.device_queue_bytes,
            tenant_queue_bytes=config.tenant_queue_bytes,
            host_lane=config.host_lane,
            host_rate=config.host_rate,
            host_burst=config.host_burst,
            board_lane=config.board_lane,
            event_links=1 if config.fleet else config.tenant_links,
        )
        # A tenant's events go out on the link that read them (lanes.py).
        self.outbox.link_of = self._link_of_tenant
        self.intake = EventIntake(
            config.prefix,
            self._publish,
            count=self._count,
            limits=config.limits,
            keep=config.events_per_run,
            window_bytes=config.window_bytes,
            hello_bytes=config.hello_bytes,
            hold=config.hold_per_run,
            max_runs=config.max_runs,
            max_runs_per_device=config.max_runs_per_device,
            replay_retry_s=config.replay_retry_s,
            replay_retry_max_s=config.replay_retry_max_s,
            on_device_reset=self._device_reset,
            offline_grace_s=config.offline_grace_s,
            run_probe_s=config.run_probe_s,
            event_log=events,
            run_probe_max_s=config.run_probe_max_s,
            lanes=self.outbox,
            budget=self.outbox.budget,
        )
        self.intake.on_ids_lost = self._ids_lost
        # The HTTP streams that follow runs live (http/hub.py); idle without followers.
        self.hub = EventHub()
        self.intake.on_delivered = self.hub.publish
        # The JSON mirror of the tenants that opted in (server_bridge/mirror/, `--json-mirror`):
        # its hooks only queue, its thread writes through the lanes. Its owner (service.py)
        # starts it before start() and stops it before stop().
        self.mirror: JsonMirror | None = None
        if config.json_mirror:
            self.mirror = JsonMirror.for_config(config, self.outbox, self._count)
            self.intake.on_delivered = both(self.hub.publish, self.mirror.delivered)
        self.rpc = RpcServer(
            provider,
            send=self._send_rpc,
            send_refusal=self._send_rpc_refusal,
            refuse=self._refuse,
            count=self._count,
            limits=config.limits,
            workers=config.rpc_workers,
            max_inflight=config.rpc_max_inflight,
            max_inflight_per_device=config.rpc_max_inflight_per_device,
            llm_timeout_s=config.llm_timeout_s,
            rpc_timeout_s=config.rpc_timeout_s,
            device_limits=self.intake.device_limits,
            merge_s=config.rpc_merge_s,
            llm_max_tokens=config.llm_max_tokens,
        )
        if memory is not None:
            memory_calls.register(self.rpc, memory, registry, self.hello, self.intake.device_limits)
        if knowledge is not None:
            knowledge_calls.register(
                self.rpc, knowledge, registry, self.intake.device_limits, self._count
            )
        # An agent's `before` knowledge rule, with or without a store (without one, its
        # on_error decides: knowledge/augment.py).
        self.rpc.augment = Augmenter(knowledge, registry, config.model_context_chars, self._count)
        # A conversation's earlier turns in its follow-ups' model calls (conversations/):
        # recorded in `turns`, a log the caller opened beside the event log.
        if turns is not None:
            self.rpc.history = History(turns, registry, config.model_context_chars, self._count)
        # Fleet mode (config.fleet_dsn; DESIGN "Where scale goes"): the lease keeper says
        # which partitions this bridge serves, and each one held is a link of its own
        # (links.py, PartitionLinks). Events to hosts go out on an event connection of
        # the bridge's own (_start_fleet says why).
        self.keeper: LeaseKeeper | None = None
        self._parts: PartitionLinks | None = None
        self._fleet_events: Client | None = None
        self._fleet_events_up = threading.Event()
        self._fleet_events_ready = threading.Event()
        self._call_rows: FleetCallRows | None = None
        if config.fleet:
            assert config.fleet_dsn is not None
            self._parts = PartitionLinks(
                PartitionPlan(config.prefix, config.partitions),
                self._new_partition_link,
                self._connect_async,
                self.registry.devices,
                self._holds,
                self._count,
            )
            # The calls this bridge serves, as rows the next owner of their partition
            # answers by id if this bridge dies (fleet/calls.py).
            self._call_rows = FleetCallRows(
                OpenCalls(config.fleet_dsn, config.prefix),
                config.partitions,
                self._holds,
                self.rpc.serving,
                self.rpc.answer_left_open,
            )
            self.rpc.call_rows = self._call_rows
            # Built here, so a round or lease it refuses is refused before anything runs.
            self.keeper = LeaseKeeper(
                config.fleet_dsn,
                config.prefix,
                partitions=config.partitions,
                name=config.client_id,
                round_s=config.fleet_round_s,
                lease_s=config.fleet_lease_s,
                on_gain=self._partition_taken,
                on_loss=self._parts.lose,
            )

    # ------------------------------------------------------------------ diagnostics

    @property
    def stats(self) -> dict[str, int]:
        """A snapshot of the counters; a missing key reads as 0."""
        with self._lock:
            return Counter(self._stats)

    @property
    def refusals(self) -> list[Refusal]:
        """The most recent refusals, oldest first (bounded by config.refusals_kept)."""
        with self._lock:
            return list(self._refusals)

    @property
    def connected(self) -> bool:
        """Every connection is up: the control connection and each link (in a fleet, the
        control and event connections: partitions come and go with their leases)."""
        if self.config.fleet:
            return self._control_up and self._fleet_events_up.is_set()
        return self._control_up and all(self._links_up)

    @property
    def control_connected(self) -> bool:
        return self._control_up

    @property
    def events_connected(self) -> bool:
        """The event connection (link 0; in a fleet, the bridge's own) is up."""
        if self.config.fleet:
            return self._fleet_events_up.is_set()
        return self._links_up[0]

    @property
    def _events(self) -> mqtt.Client | None:
        """The event connection: link 0 (in a fleet, the bridge's own)."""
        if self.config.fleet:
            return self._fleet_events
        return self._links[0]

    def reads_device(self, device: str) -> bool:
        """Whether a link reads `device`'s topics (always, with one link; in a fleet,
        while this bridge holds its partition and is connected as it)."""
        if self._parts is not None:
            return self._parts.reads(device)
        if self.config.tenant_links == 1:
            return True
        with self._links_lock:
            return device in self._linked_devices

    def held_partitions(self) -> list[int]:
        """The partitions this bridge serves now (fleet mode; [] otherwise)."""
        return self._parts.held() if self._parts is not None else []

    def link_topics(self, link: int) -> list[str]:
        """The board topics link `link` reads (links.py), sorted; in a fleet, partition
        `link`'s."""
        if self._parts is not None:
            return self._parts.topics(link)
        with self._links_lock:
            return sorted(self._link_topics[link])

    def hello(self, device: str) -> dict[str, Any] | None:
        """The capabilities a device last announced on P/d/D/hello (None before any)."""
        return self.intake.capabilities(device)

    def presence(self, device: str) -> dict[str, Any] | None:
        """A device's last P/d/D/status (`st` online/offline), None when unknown."""
        return self.intake.presence(device)

    def _ids_lost(
        self, tenant: str, device: str, run: str, lo: int, hi: int, why: str, usr: str | None
    ) -> None:
        """Events lo..hi of a run will never reach hosts through the bridge: say so on
        the tenant's `_b` stream of that device, as a gap naming the run (the form of a
        replay answer), so a host's transcript marks them missing instead of waiting.
        On the run's own host topic (`usr`, its user when known): only those who may see
        the run learn of it."""
        d = {"kind": "gap", "r": run, "from": lo, "to": hi, "msg": f"events {lo}..{hi}: {why}"}
        user = None if run == DEVICE_RUN else (usr or UNOWNED)
        self._device_notice(tenant, device, d, "error", user)
        self._count("host.gaps_told")
        self._count(f"tenant.{tenant}.host.gaps_told")

    def _device_reset(self, device: str, msg: str, new_boot: bool, boot: str | None) -> None:
        """A device restarted or went offline (the intake ended its runs): its calls in
        flight end — those of the boots that are gone — and after a reboot its call ids
        may be used again. Gone offline, past the grace: its tenant's hosts are told."""
        self.rpc.device_gone(device, msg, new_boot=new_boot, boot=boot)
        if not new_boot:
            self._tell_presence(device, "offline")

    def _tell_presence(self, device: str, st: str) -> None:
        """A `presence` event `{st, since}` on the device's `_b` stream for its tenant's
        hosts (PROTOCOL "Presence at the host"): offline once the status has said so for
        the grace (so a broker restart's wills do not flap a dashboard), online when a
        device told offline is back."""
        record = self.registry.device(device)
        presence = self.intake.presence(device)
        if record is None or presence is None or presence["st"] != st:
            return
        with self._lock:
            if (st == "offline") == (device in self._told_offline):
                return  # told already (offline), or never told offline (online)
            if st == "offline":
                self._told_offline.add(device)
            else:
                self._told_offline.discard(device)
        d = {"st": st, "since": int(presence["since"] * 1000)}
        self._device_notice(record.tenant, device, d, "presence")
        self._count(f"host.presence_{st}")
        if self.mirror is not None:
            self.mirror.presence(record.tenant, device, d)

    def _device_notice(
        self, tenant: str, device: str, d: dict[str, Any], type_: str, user: str | None = None
    ) -> None:
        """An event of `_b` about a device's own stream (its presence, events it lost),
        queued behind that device's events, on the event connection: on the device's host
        topic, or (`user`) on the topic of the run it is about (PROTOCOL "Who sees what").

        Not with the `_b` answers to hosts' requests on the control connection: a host
        reads a gap report only for a run it holds, and takes any event of a run as its
        device being back; a notice that overtook the events before it would be read
        past, or undone by them. Forced like the bridge's own run ends: a handful per
        run, each the one report of what it says."""
        topic, payload = self._bridge_event(Topic("h", device, "evt", tenant), d, type_, user)
        self.outbox.offer_event(tenant, device, topic, payload, force=True, kind=Kind.NOTICE)

    def metrics_text(self) -> str:
        """The counters and the bridge's present load in Prometheus text format
        (server_bridge/metrics.py): what `wren bridge --stats` and a scraper read."""
        depth = self.outbox.depth()
        gauges = [
            ("bridge.budget_bytes", self.outbox.budget.limit, "the memory budget for held events"),
            ("bridge.budget_used_bytes", depth["budget_used"], "bytes of events held now"),
            ("bridge.budget_peak_bytes", depth["budget_peak"], "most bytes ever held at once"),
            ("bridge.queued_events", depth["events"], "events waiting in the tenant lanes"),
            ("bridge.queued_host", depth["host"], "host requests and notices waiting"),
            ("bridge.queued_board", depth["board"], "messages to boards waiting"),
            ("bridge.unacked", depth["outstanding"], "publishes the broker has not acked"),
            ("bridge.connected", int(self.connected), "1 while both connections are up"),
            ("bridge.connected_control", int(self._control_up), "1 while the control one is"),
        ]
        if self._parts is not None:
            held = len(self._parts.held())
            gauges.append(("bridge.partitions_held", held, "fleet partitions this bridge serves"))
        return prometheus_text(self.stats, gauges)

    def _count(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                metrics.add(self._stats, name, n)

    def _refuse(self, kind: str, topic: str, msg: str) -> None:
        tenant = self._tenant_of(topic)
        now = time.monotonic()
        with self._lock:
            metrics.add(self._stats, "refused")
            metrics.add(self._stats, f"refused.{kind}")
            if tenant is not None:
                metrics.add(self._stats, f"tenant.{tenant}.refused.{kind}")
            self._refusals.append(Refusal(kind, topic, msg))
            # Logged once per kind and tenant each _REFUSAL_LOG_S, with how many were
            # not: a line per refusal was 40 % of what a flood of junk cost the network
            # thread (28 us a message, 17 without), and the input it reads behind a flood
            # is every tenant's (PROTOCOL.md "Fairness between tenants"). Every refusal
            # is still counted and kept in `refusals`.
            key = (kind, tenant)
            seen = self._refusal_log.get(key)
            untold = 0
            if seen is None or now - seen[0] >= _REFUSAL_LOG_S:
                untold = int(seen[1]) if seen is not None else 0
                self._refusal_log[key] = [now, 0]
                self._refusal_log.move_to_end(key)
                while len(self._refusal_log) > _REFUSAL_LOG_KEYS:
                    self._refusal_log.popitem(last=False)
                told = True
            else:
                seen[1] += 1
                told = False
        if told:
            more = f" ({untold} more of this kind not logged)" if untold else ""
            log.warning("refused %s on %s: %s%s", kind, topic, msg, more)

    def _tenant_of(self, topic: str) -> str | None:
        # Whose refusal it is, for the per-tenant counters: a host topic names its
        # tenant; a device's is the registry's (None for a device it does not know).
        try:
            t = parse(self.config.prefix, topic)
        except BadTopic:
            return None
        if t.tenant is not None:
            return t.tenant
        record = self.registry.device(t.device) if t.side == "d" else None
        return record.tenant if record is not None else None

    # ------------------------------------------------------------------ lifecycle

    def subscriptions(self) -> list[str]:
        """What the bridge reads, both connections together."""
        p = self.config.prefix
        # With several bridge processes the broker spreads RPC calls among them: a call
        # is complete in itself. Nothing else is shared. evt must reach one process per
        # run in full, as each tracks the ids of its runs to find gaps (a run's events
        # split over processes would be holes to each, and replay requests would follow);
        # hello and status feed each process's presence table and the board limits its
        # RPC answers are sized by. Host req and ctl are read by every process as well,
        # so with several processes a request reaches the board once per process (the
        # board starts one run per req id) and a ctl is applied once per process.
        share = "$share/bridge/" if self.config.shared_subscription else ""
        return [
            f"{share}{p}/d/+/rpc",
            f"{p}/d/+/evt",
            f"{p}/d/+/hello",
            f"{p}/d/+/status",
            f"{p}/h/+/+/req",
            f"{p}/h/+/+/ctl",
        ]

    def control_subscriptions(self) -> list[str]:
        """What the control connection reads: hosts' requests and ctl, and with one link
        boards' calls too (with links, each link reads its own boards' calls)."""
        all_ = self.subscriptions()
        if self.config.tenant_links > 1:
            return [all_[4], all_[5]]
        return [all_[0], all_[4], all_[5]]

    def event_subscriptions(self) -> list[str]:
        """What the event connection reads: with one link every board's events, hellos
        and statuses; with links, link 0's boards' topics (links.py)."""
        if self.config.tenant_links > 1:
            return self.link_topics(0)
        return self.subscriptions()[1:4]

    def _link_wants(self, link: int) -> tuple[list[str], list[str]]:
        """What link `link` subscribes at connect, and what it unsubscribes then (what a
        persistent session may hold that is not its own: links.py)."""
        if link == 0 and self.config.tenant_links == 1:
            deal = self._plan.deal(self.registry.devices())
            every = sorted({topic for topics in deal for topic in topics})
            return self.event_subscriptions(), [*self._not_for_events(), *every]
        with self._links_lock:
            wants = sorted(self._link_topics[link])
            stale = self._plan.not_for(link, self._link_topics)
        return wants, [*(self._not_for_events() if link == 0 else []), *stale]

    def _not_for_events(self) -> list[str]:
        """What the event connection's session must not read: the control topics, in
        either form, and the bridges' presence. A session of the one-connection bridge
        (the same user and client id) still holds them, and a message on both
        connections would be acted on twice."""
        p = self.config.prefix
        return [
            f"$share/bridge/{p}/d/+/rpc",
            f"{p}/d/+/rpc",
            f"{p}/h/+/+/req",
            f"{p}/h/+/+/ctl",
            bridge_topic(p),
        ]

    def _new_client(
        self,
        client_id: str,
        username: str | None,
        password: str | None,
        clean: bool = False,
        reconnect: bool = True,
    ) -> Client:
        cfg = self.config
        # A persistent session: what boards send while this bridge is away waits at the
        # broker for its client id, and the broker keeps its subscriptions (`clean`: a
        # fleet bridge's own connections, which read nothing).
        # paho's client, whose queue the outbox's threads write themselves
        # (server_bridge/mqttclient.py): an RPC chunk does not wait for the network thread.
        client = Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=mqtt.MQTTv311,
            clean_session=clean,
            reconnect_on_failure=reconnect,
        )
        # paho only calls the logger's log(); an adapter that knows about the stop.
        client.enable_logger(cast(logging.Logger, _PahoLog(self._stopping, self._undoing)))
        # The outbox hands paho at most max_inflight_messages unacknowledged messages,
        # all of which paho may have on the wire at once; paho's own bound is the
        # safety net above that (and what the few direct publishes, the presence, use).
        client.max_inflight_messages_set(cfg.max_inflight_messages)
        client.max_queued_messages_set(cfg.max_queued_messages)
        if username is not None:
            client.username_pw_set(username, password)
        if cfg.tls is not None:
            cfg.tls.apply(client)
        client.connect_timeout = cfg.connect_timeout_s
        client.reconnect_delay_set(1, 30)
        client.on_socket_open = no_delay
        client.on_message = self._on_message
        return client

    def _abort(self) -> None:
        """Undo a start that failed: a clean DISCONNECT of each connection (no will, so
        another bridge's presence stands) and no forwarders."""
        self._undoing.set()
        if self.keeper is not None:
            self.keeper.stop(release=True)
        if self._parts is not None:
            self._parts.close()
        self.outbox.stop(drain_s=0)
        for client in (*self._links, self._client, self._fleet_events):
            if client is not None:
                client.disconnect()
                client.loop_stop()
        self._client = None
        self._fleet_events = None
        self._links = [None] * len(self._links)
        self._undoing.clear()

    def start(self) -> None:
        """Connect, subscribe and return once subscribed; raise BridgeError if not in time."""
        if self._client is not None:
            raise BridgeError("bridge already started")
        if self._stopping.is_set():
            # stop() shut the RPC worker pool down; a restart is a new Bridge.
            raise BridgeError("a stopped bridge cannot be started again")
        cfg = self.config
        assert cfg.client_id is not None and cfg.control_client_id is not None
        if cfg.fleet:
            self._start_fleet()
            return
        # The control connection first: the check for another bridge, the presence and
        # the will are its own (module docstring).
        client = self._new_client(cfg.control_client_id, cfg.control_username, cfg.control_password)
        # Set before connecting: the broker publishes it if the bridge vanishes.
        client.will_set(
            bridge_topic(cfg.prefix), self._status_payload("offline"), qos=1, retain=True
        )
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_subscribe = self._on_subscribe
        client.on_publish = self._on_publish
        client.on_unsubscribe = self._on_unsubscribe
        links = [self._new_link(k) for k in range(cfg.tenant_links)]
        self._ready.clear()
        for ready in self._links_ready:
            ready.clear()
        self._start_error = None
        self._links_error = [None] * cfg.tenant_links
        self._login_refused = False
        if cfg.tenant_links > 1:
            self._refresh_links(drop=False)
        self._client = client
        try:
            client.connect(cfg.host, cfg.port, keepalive=cfg.keepalive_s)
        except OSError as e:
            self._client = None
            raise BridgeError(f"cannot reach the MQTT broker at {cfg.host}:{cfg.port}: {e}") from e
        self.outbox.start(links, client)
        client.loop_start()
        self._start_thread = threading.current_thread()
        try:
            self._check_rivals(client)
        except BridgeError:
            self._abort()
            raise
        if not self._ready.wait(cfg.connect_timeout_s) or self._start_error is not None:
            why = self._start_error or f"no CONNACK and SUBACK within {cfg.connect_timeout_s}s"
            self._abort()
            raise (LoginRefused if self._login_refused else BridgeError)(
                f"bridge could not start on {cfg.host}:{cfg.port} (control connection, user "
                f"{cfg.control_username or '(none)'}): {why}"
            )
        # Then the links, the event connection first, once this process is the one
        # serving the prefix: their sessions may hold what boards sent meanwhile, acted
        # on as it comes.
        for k, link in enumerate(links):
            self._links[k] = link
            _, user, _ = cfg.link_login(k)
            what = "event connection" if k == 0 else f"link {k}"
            try:
                link.connect(cfg.host, cfg.port, keepalive=cfg.keepalive_s)
            except OSError as e:
                self._abort()
                raise BridgeError(
                    f"cannot reach the MQTT broker at {cfg.host}:{cfg.port}: {e}"
                ) from e
            link.loop_start()
            came = self._links_ready[k].wait(cfg.connect_timeout_s)
            if not came or self._links_error[k] is not None:
                why = self._links_error[k] or (
                    f"no CONNACK and SUBACK within {cfg.connect_timeout_s}s"
                )
                self._abort()
                raise (LoginRefused if self._login_refused else BridgeError)(
                    f"bridge could not start on {cfg.host}:{cfg.port} ({what}, user "
                    f"{user or '(none)'}): {why}"
                )
        if cfg.tenant_links < LINKS:
            self._forget_unused_links()
        self._begin_serving()

    def _begin_serving(self) -> None:
        """Say online and start the background work: every connection a start waits for
        is up."""
        cfg = self.config
        self._serving = True
        self._say_online()
        self._housekeeper = threading.Thread(
            target=self._housekeeping, name="wren-bridge-housekeeping", daemon=True
        )
        self._housekeeper.start()
        if self.memory is not None and self.memory.index is not None:
            # The index is rebuilt from the store, never trusted across a restart; in the
            # background, since embedding many rows takes a while (recall answers from
            # what is indexed so far meanwhile).
            threading.Thread(target=self._reindex, name="wren-memory-reindex", daemon=True).start()
        log.info(
            "bridge %s serving %s on %s:%d with provider %s",
            cfg.client_id,
            cfg.prefix,
            cfg.host,
            cfg.port,
            getattr(self.provider, "name", "?"),
        )

    def _start_fleet(self) -> None:
        """Start as one bridge of a fleet (config.fleet_dsn; DESIGN "Where scale goes").

        Two connections of the bridge's own, then the partitions. The control connection
        is what it is alone: RPC answers and whatever else the bridge says to boards,
        its answers to hosts on `_b`, the presence and this bridge's will, but it reads
        nothing (the partitions' links read boards and hosts). The event connection is
        the outbox's one event channel: a run's events go to hosts on it whichever
        partition read them. Not on the partition's own link: that connection ends when
        the lease moves (on_loss), and an event read just before would wait in paho for
        a reconnect this bridge never makes; not on the control connection either, for
        the reason the two are apart in one process (a flood of events would queue the
        RPC answers behind it). Both have clean sessions and ids of this process's:
        they read nothing, and nothing in them is what another bridge needs (the
        partitions' sessions hold that).

        Then the lease keeper joins the fleet (applying the schema, learning the fleet's
        id) and takes this bridge's share in its rounds; each partition it takes connects
        as the partition's session (PartitionLinks.gain). No check for another bridge:
        the others on the prefix are this fleet's.
        """
        cfg = self.config
        assert self.keeper is not None and cfg.client_id is not None
        assert cfg.control_client_id is not None
        client = self._new_client(
            cfg.control_client_id, cfg.control_username, cfg.control_password, clean=True
        )
        # This bridge's own will, not the fleet's: one bridge dying is not the fleet
        # going offline (_say_online).
        client.will_set(
            self._own_status_topic(), self._status_payload("offline"), qos=1, retain=True
        )
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        events = self._new_client(cfg.client_id, cfg.username, cfg.password, clean=True)
        events.user_data_set(0)
        events.on_connect = self._on_fleet_events_connect
        events.on_disconnect = self._on_fleet_events_disconnect
        events.on_publish = self._on_events_publish
        self._ready.clear()
        self._fleet_events_ready.clear()
        self._start_error = None
        self._login_refused = False
        self._client = client
        self._fleet_events = events
        try:
            client.connect(cfg.host, cfg.port, keepalive=cfg.keepalive_s)
            events.connect(cfg.host, cfg.port, keepalive=cfg.keepalive_s)
        except OSError as e:
            self._abort()
            raise BridgeError(f"cannot reach the MQTT broker at {cfg.host}:{cfg.port}: {e}") from e
        self.outbox.start([events], client)
        client.loop_start()
        events.loop_start()
        deadline = time.monotonic() + cfg.connect_timeout_s
        came = self._ready.wait(cfg.connect_timeout_s) and self._fleet_events_ready.wait(
            max(0.0, deadline - time.monotonic())
        )
        if not came or self._start_error is not None:
            why = self._start_error or f"no CONNACK within {cfg.connect_timeout_s}s"
            self._abort()
            raise (LoginRefused if self._login_refused else BridgeError)(
                f"bridge could not start on {cfg.host}:{cfg.port} (user "
                f"{cfg.username or '(none)'}): {why}"
            )
        try:
            self.keeper.start()
        except Exception as e:  # PgUnavailable, PartitionCountMismatch, MigrationError ...
            self._abort()
            raise BridgeError(f"bridge could not join the fleet on {cfg.prefix}: {e}") from e
        self._begin_serving()

    def _own_status_topic(self) -> str:
        """P/b/<client id>/status: a fleet bridge's own presence and last will, apart
        from the fleet's P/b/status (boards read only that one)."""
        return f"{self.config.prefix}/b/{self.config.client_id}/status"

    def _new_partition_link(self, part: int) -> Client:
        """Partition `part`'s connection (fleet mode): its session's client id, and
        never reconnected by paho (PartitionLinks says why)."""
        client_id, user, password = self.config.partition_login(part)
        client = self._new_client(client_id, user, password, reconnect=False)
        client.user_data_set(part)
        client.on_connect = self._on_part_connect
        client.on_disconnect = self._on_part_disconnect
        client.on_subscribe = self._on_part_subscribe
        return client

    def _connect_async(self, client: mqtt.Client) -> None:
        # Called on the lease keeper's thread: a broker slow to answer must not hold up
        # the next renewal, so the TCP connect is the link's network thread's.
        cfg = self.config
        client.connect_async(cfg.host, cfg.port, keepalive=cfg.keepalive_s)
        client.loop_start()

    def _holds(self, part: int) -> int | None:
        return self.keeper.holds(part) if self.keeper is not None else None

    def _partition_taken(self, part: int, epoch: int) -> None:
        """The keeper took `part` (its thread): first the calls an earlier owner left
        open are answered by id (their boards end those runs failed, retryable), then the
        partition's session is connected and what waited in it is read. A failure to
        read the rows is logged and counted: the partition is served all the same, and
        those calls end at their boards' timeouts."""
        assert self._parts is not None and self._call_rows is not None
        try:
            n = self._call_rows.taken(part, epoch)
            self._count("fleet.calls_left_open_answered", n)
        except Exception:
            log.exception("partition %d: the calls an earlier owner left open were not read", part)
            self._count("fleet.calls_left_open_unread")
        self._parts.gain(part, epoch)

    def _check_rivals(self, client: mqtt.Client) -> None:
        """Refuse to start while another bridge process serves this prefix (RivalBridge).

        Connected but subscribed to P/b/status only (_on_connect): once the retained
        presence has come (an UNSUBSCRIBE round trip behind the SUBSCRIBE), another
        bridge's `online` is believed when no `offline` of its boot follows within
        _RIVAL_GRACE_S — a bridge killed with its socket still half open is followed by
        its will, once the broker closes that socket or our connection of the same user
        takes it over. A live bridge of the same user takes its connection back within a
        second: this connection is then lost during the check, which also refuses. A
        bridge that was SIGKILLed left its will, `offline`, retained: no wait at all.
        Passing, it subscribes to its topics and acts on what the session delivered
        meanwhile, in order.
        """
        cfg = self.config
        probed = self._probed.wait(cfg.connect_timeout_s)
        if self._start_error is not None:
            return  # refused or failed: said by start()'s own wait
        if not probed:
            raise BridgeError(
                f"bridge could not start on {cfg.host}:{cfg.port}: no CONNACK and SUBACK "
                f"within {cfg.connect_timeout_s}s"
            )
        deadline = time.monotonic() + _RIVAL_GRACE_S
        with self._rivals_cond:
            # Of our own client id and online when we connected: our connection has just
            # taken that one's over. Its will may follow; if it was alive it takes the
            # connection back within the grace, else it is gone and we serve.
            taken = {b for b, st in self._rivals.items()
                     if st.get("st") == "online" and st.get("id") == cfg.client_id}  # fmt: skip
            while True:
                online = [
                    st
                    for b, st in self._rivals.items()
                    if st.get("st") == "online" and b not in taken
                ]
                if self._lost_at_start:
                    raise RivalBridge(self._rival_msg(online[0] if online else None))
                left = deadline - time.monotonic()
                if left <= 0 or not (online or taken) or cfg.shared_subscription:
                    break
                self._rivals_cond.wait(left)
        # Processes configured to share the calls (shared_subscription, [planned] as a
        # deployment) know of each other.
        if online and not cfg.shared_subscription:
            raise RivalBridge(self._rival_msg(online[0]))
        self._subscribe(client)
        # What the session delivered meanwhile, in order, then the network thread's own:
        # one message at a time out of the gate, so no paho call is made under it (paho
        # holds its callback lock while it waits for the gate in _on_message).
        while True:
            with self._gate:
                if not self._held:
                    self._held = None
                    break
                msg = self._held.popleft()
            self._on_message(client, None, msg)

    def _rival_msg(self, st: dict[str, Any] | None) -> str:
        who = (
            f"client id {st.get('id')!s:.64}, boot {st.get('boot')!s:.16}"
            if st
            else f"the same MQTT user, {self.config.client_id}"
        )
        return (
            f"another bridge ({who}) is online on {self.config.host}:{self.config.port} for "
            f"prefix {self.config.prefix}: one bridge process per prefix; stop it first"
        )

    def _subscribe(self, client: mqtt.Client) -> None:
        if self.config.fleet:
            # A fleet bridge's control connection reads nothing (its partitions' links
            # read boards and hosts), and its session is clean: connected is ready.
            self._ready.set()
            if self._serving:
                self._say_online()
            return
        rc, mid = client.subscribe([(topic, 1) for topic in self.control_subscriptions()])
        if rc != mqtt.MQTT_ERR_SUCCESS or mid is None:
            self._start_error = f"subscribe failed: {mqtt.error_string(rc)}"
            self._ready.set()
            return
        # From start()'s thread the SUBACK may be read before subscribe() returns (the
        # SUBSCRIBE is written at once, mqttclient.py): then it waits in _early_subacks.
        with self._rivals_cond:
            self._sub_mid = mid
            early = self._early_subacks.pop(mid, None)
            self._early_subacks.clear()
        if early is not None:
            self._subscribed(early)
        if self.config.tenant_links > 1:
            # With links the boards' calls are the links' to read: a session of the
            # one-link layout still holds the control connection's wildcard, and a call
            # read on two connections would be served twice.
            client.unsubscribe([self._plan.wildcards()[0], f"{self.config.prefix}/d/+/rpc"])

    def _forget_unused_links(self) -> None:
        """Clear the persistent sessions of the link users this process does not use
        (`tenant_links` below LINKS): a session left from a run with more links would
        keep its boards' subscriptions and queue their messages at the broker for ever.
        A clean-session connect ends it; a broker that does not know the user (set up
        for fewer links) refuses it, which is fine and logged at debug."""
        cfg = self.config
        for link in range(cfg.tenant_links, LINKS):
            client_id, user, password = cfg.link_login(link)
            c = mqtt.Client(
                CallbackAPIVersion.VERSION2,
                client_id=client_id,
                protocol=mqtt.MQTTv311,
                clean_session=True,
            )
            if user is not None:
                c.username_pw_set(user, password)
            if cfg.tls is not None:
                cfg.tls.apply(c)
            done = threading.Event()
            c.on_connect = lambda *a, done=done: done.set()
            try:
                c.connect(cfg.host, cfg.port, keepalive=cfg.keepalive_s)
                c.loop_start()
                if done.wait(cfg.connect_timeout_s) and c.is_connected():
                    log.info("cleared the session of unused link %d (%s)", link, client_id)
            except OSError as e:
                log.debug("could not clear unused link %d's session: %s", link, e)
            finally:
                c.disconnect()
                c.loop_stop()

    def _reindex(self) -> None:
        assert self.memory is not None
        try:
            n = self.memory.reindex()
        except Exception:  # logged, not swallowed: recall then serves what it has
            log.exception("rebuilding the memory recall index failed")
            self._count("callback_errors")
            return
        log.info("memory recall index rebuilt: %d rows", n)

    def stop(self) -> None:
        """Fail the calls in flight, say offline, disconnect and stop the threads, in
        about a second or two whatever the model is doing (PROTOCOL.md "RPC", "Bridge
        presence").

        Each call in flight is answered `bridge_stopping` (a model call: kind `llm`,
        cause `unavailable`; retryable) and its model stream closed, so its board ends
        the run with that cause; the stop waits up to _STOP_RUNS_WAIT_S for those runs'
        ends to go out to hosts. The session stays at the broker (it is persistent): a
        bridge started again with the same client id gets what boards sent in between.
        """
        self._stopping.set()
        # New calls are refused `busy` from here; the ones in flight are answered now,
        # while the connection is up, and their streams cut (a worker blocked on a slow
        # model server returns at once instead of holding the process until it ends).
        answered = self.rpc.stop_calls()
        cancel = getattr(self.provider, "cancel", None)
        if callable(cancel):
            cancel()
        client, self._client = self._client, None
        links, self._links = self._links, [None] * len(self._links)
        if client is not None and answered and self.connected:
            self._await_runs(answered)
        if self.keeper is not None:
            # Once the runs' ends have come in on the partitions: each partition is
            # stopped (its link's DISCONNECT; the session stays) and its lease given back,
            # so the other bridges take it at their next round.
            self.keeper.stop(release=True)
        if self._parts is not None:
            self._parts.close()
        if client is not None:
            # What the lanes hold goes to paho first (bounded); paho sends it now, or
            # after the next connect of this persistent session.
            self.outbox.stop()
            if self._control_up:
                # A clean DISCONNECT suppresses the last will, so the bridge says it itself.
                self._say_offline(client)
            client.disconnect()
            client.loop_stop()
        for link in (*links, self._fleet_events):
            if link is not None:
                link.disconnect()
                link.loop_stop()
        self._fleet_events = None
        self._fleet_events_up.clear()
        if self._housekeeper is not None:
            self._housekeeper.join(timeout=5)
            self._housekeeper = None
        # The workers were told (their calls are done, their streams cut) and return in
        # a moment; queued calls are dropped.
        self.rpc.close(wait=False)
        if self._call_rows is not None:
            # A row a worker still deletes after this stays: the next owner answers
            # that call again, and the board drops an answer to a call it has ended.
            self._call_rows.calls.close()
        # A provider that keeps connections (the OpenAI one pools them) lets them go;
        # a call still running keeps its own and closes it when it ends.
        close = getattr(self.provider, "close", None)
        if callable(close):
            close()
        self._control_up = False
        self._links_up = [False] * len(self._links_up)

    def _await_runs(self, calls: list[tuple[str, str | None]]) -> None:
        """Wait (bounded) until the runs of the calls answered `bridge_stopping` have
        ended at the intake: the board's run.failed is then in the lanes, which the stop
        drains to the broker, and hosts see how the run ended and why."""
        runs = {(device, run) for device, run in calls if run is not None}
        deadline = time.monotonic() + _STOP_RUNS_WAIT_S
        while runs and time.monotonic() < deadline:
            runs = {k for k in runs if self.intake.finished(*k) is False}
            if runs:
                time.sleep(_STOP_POLL_S)
        if runs:
            log.info("stopping without the end of run(s) %s", sorted(r for _, r in runs))

    def __enter__(self) -> Bridge:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _housekeeping(self) -> None:
        while not self._stopping.wait(_TICK_S):
            try:
                self.intake.tick()
                self._settle_awaiting()
                self.rpc.expire()
                self.rpc.tick()
            except Exception:
                log.exception("bridge housekeeping failed")
                self._count("callback_errors")
            if self._resubscribe:
                try:
                    self._subscribe_again(time.monotonic())
                except Exception:
                    log.exception("subscribing again failed")
                    self._count("callback_errors")
            if self.events is not None and time.monotonic() - self._retained_at >= _RETAIN_EVERY_S:
                self._retained_at = time.monotonic()
                self._retain_events()
            if self._parts is not None:
                try:
                    self._parts.tick(time.monotonic())
                    # As the tenant links below: the registry's devices, by identity each
                    # tick and in full every _LINKS_CHECK_S.
                    token = self.registry.devices_token()
                    now = time.monotonic()
                    due = now - self._links_checked >= _LINKS_CHECK_S
                    if token is not self._links_token or due:
                        self._links_token = token
                        self._links_checked = now
                        self._parts.refresh()
                except Exception:
                    log.exception("dealing the boards to the partitions failed")
                    self._count("links.errors")
            elif self.config.tenant_links > 1:
                try:
                    # Each tick the registry's device table is compared by identity (it
                    # is parsed again only when its file changed, at most every
                    # RECHECK_S); a full check at least every _LINKS_CHECK_S also
                    # drops what a refresh without `drop` kept.
                    token = self.registry.devices_token()
                    now = time.monotonic()
                    due = now - self._links_checked >= _LINKS_CHECK_S
                    if token is not self._links_token or due:
                        self._links_token = token
                        self._links_checked = now
                        self._refresh_links(drop=True)
                except Exception:
                    # An unreadable registry, most likely: the links read what they read
                    # until it is readable again (checked again in a second).
                    log.exception("dealing the boards to the links failed")
                    self._count("links.errors")

    def _refused_while_serving(self, key: int) -> str:
        """Schedule the subscriptions of connection `key` again (a refusal once serving;
        at start, start() reports it); what to add to the refusal's log line."""
        if not self._serving or self._stopping.is_set():
            return ""
        with self._resubscribe_lock:
            _, wait = self._resubscribe.get(key, (0.0, _RESUBSCRIBE_S))
            self._resubscribe[key] = (time.monotonic() + wait, min(wait * 2, _MAX_RESUBSCRIBE_S))
        self._count("resubscribes")
        return f"; subscribing again in {wait:.0f} s"

    def _resubscribed(self, key: int) -> None:
        """Connection `key`'s subscription was granted: nothing more to make again."""
        with self._resubscribe_lock:
            if self._resubscribe.pop(key, None) is not None:
                log.info("the broker granted the bridge's subscriptions again (%s)",
                         "control connection" if key == _CONTROL else self._what(key))  # fmt: skip

    def _subscribe_again(self, now: float) -> None:
        """Housekeeping: make again the subscriptions of each connection whose refusal's
        wait is over, if it is up (a connection that dropped subscribes at its connect)."""
        with self._resubscribe_lock:
            due = [k for k, (at, _) in self._resubscribe.items() if at <= now]
            for k in due:
                _, wait = self._resubscribe[k]
                # Until its SUBACK says: refused again (a new wait) or granted (none).
                self._resubscribe[k] = (now + _MAX_RESUBSCRIBE_S, wait)
        for key in due:
            if key == _CONTROL:
                if self._control_up and self._client is not None:
                    # From this thread its SUBACK may be read before subscribe() returns:
                    # with no mid kept, it waits in _early_subacks (as at start).
                    with self._rivals_cond:
                        self._sub_mid = None
                    self._subscribe(self._client)
                continue
            client = self._links[key]
            if client is None or not self._links_up[key]:
                continue
            wants, _ = self._link_wants(key)
            for batch in batches(wants):
                client.subscribe([(topic, 1) for topic in batch])

    def _retain_events(self) -> None:
        """Drop each tenant's oldest segments of the event log past the configured age
        and bytes (BridgeConfig.event_log_max_age_s, event_log_max_bytes)."""
        logs = [self.events]
        if self.rpc.history is not None:
            logs.append(self.rpc.history.turns.log)  # the conversations' turns: the same
        for it in logs:
            if it is None:
                continue
            for tenant in it.tenants():
                try:
                    gone = it.retain(tenant, max_age_s=self.config.event_log_max_age_s,
                                     max_bytes=self.config.event_log_max_bytes)  # fmt: skip
                    if gone:
                        self._count("eventlog.segments_dropped", gone)
                except Exception:
                    log.exception("event log retention failed for tenant %s", tenant)
                    self._count("callback_errors")

    def _status_payload(self, st: str, at: int | None = None, boot: str | None = None) -> bytes:
        # `boot` is this process's (`boot`: a fleet's id, _say_online): a board that sees
        # it change knows the bridge restarted and lost every call in flight, whatever
        # the broker did meanwhile. `at` (Unix ms) says since when, for hosts; a last
        # will, written at connect, cannot know it.
        status: dict[str, Any] = {
            "st": st,
            "id": self.config.client_id,
            "boot": boot or self._boot,
        }
        if at is not None:
            status["at"] = at
        return encode(status)

    def _say_offline(self, client: mqtt.Client) -> None:
        # A fleet bridge says only its own presence offline: the others serve on, and
        # the fleet's P/b/status stays online (see _say_online).
        info = client.publish(
            self._own_status_topic() if self.config.fleet else bridge_topic(self.config.prefix),
            self._status_payload("offline", at=int(time.time() * 1000)),
            qos=1,
            retain=True,
        )
        try:
            info.wait_for_publish(_STOP_STATUS_WAIT_S)
        except (RuntimeError, ValueError):
            pass  # not queued (the connection just dropped): the will says it instead
        if not info.is_published():
            log.warning("the broker did not take the bridge's offline status before the stop")

    # ------------------------------------------------------------------ paho callbacks

    @_guarded
    def _on_connect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        if reason_code.is_failure:
            self._start_error = connack_refusal(
                f"{self.config.host}:{self.config.port}", self.config.control_username, reason_code
            )
            self._login_refused = True
            log.error("broker refused the bridge connection: %s", reason_code)
            self._ready.set()
            self._probed.set()
            return
        self._control_up = True
        self._count("control.connects")
        if flags.session_present:
            self._count("control.session.resumed")
        if self._held is not None:
            # Starting: first only the bridges' presence (_check_rivals).
            rc, mid = client.subscribe(bridge_topic(self.config.prefix), qos=1)
            if rc != mqtt.MQTT_ERR_SUCCESS:
                self._start_error = f"subscribe failed: {mqtt.error_string(rc)}"
                self._ready.set()
                self._probed.set()
                return
            self._probe_sub_mid = mid
            return
        # Subscribe on every connect: the session keeps the subscriptions, but a broker
        # that lost it (no persistence, or a first connect) must hear them again, and
        # the SUBACK is what start() waits for.
        self._subscribe(client)

    @_guarded
    def _on_subscribe(
        self, client: mqtt.Client, userdata: Any, mid: int, reason_codes: Any, properties: Any
    ) -> None:
        if mid == self._probe_sub_mid:
            # The retained presence comes right behind this SUBACK; an UNSUBSCRIBE of a
            # topic never subscribed is answered after it (the broker keeps the order).
            rc, unsub = client.unsubscribe(f"{self.config.prefix}/b/probe")
            if rc != mqtt.MQTT_ERR_SUCCESS:
                self._start_error = f"unsubscribe failed: {mqtt.error_string(rc)}"
                self._ready.set()
                self._probed.set()
            self._probe_unsub_mid = unsub
            return
        with self._rivals_cond:
            if mid != self._sub_mid:
                if self._sub_mid is None and len(self._early_subacks) < 8:
                    self._early_subacks[mid] = reason_codes
                return
        self._subscribed(reason_codes)

    def _subscribed(self, reason_codes: Any) -> None:
        refused = [str(rc) for rc in reason_codes if rc.is_failure]
        if refused:
            # The broker's ACL said no to something the bridge must read; serving on
            # half the topics would look healthy and lose messages.
            self._start_error = f"broker refused subscriptions: {', '.join(refused)}"
            again = self._refused_while_serving(_CONTROL)
            log.error("broker refused bridge subscriptions: %s%s", refused, again)
        elif self._serving:
            self._resubscribed(_CONTROL)
            # Online once it serves, on every (re)connect: after a dropped connection the
            # will left "offline" retained until the bridge says otherwise.
            self._say_online()
        self._ready.set()

    def _say_online(self) -> None:
        if self.keeper is not None:
            # A fleet's presence is the fleet's: every bridge says it online with the
            # fleet's id as `boot`, so one bridge starting or dying is no bridge restart
            # to boards (a board fails its calls in flight when `boot` changes); what a
            # board waits on from a dead bridge is failed by the partition's new owner
            # (DESIGN: planned) or times out. Nothing ever says the fleet offline: a
            # bridge cannot know it is the last one alive without asking the others, so
            # a clean stop says only its own status offline, and so does its will,
            # on P/b/<client id>/status. The price: with every bridge stopped, boards
            # learn it from their calls' timeouts rather than from the presence.
            self.outbox.board(
                bridge_topic(self.config.prefix),
                self._status_payload("online", boot=self.keeper.fleet_id),
                retain=True,
            )
            self.outbox.board(self._own_status_topic(), self._status_payload("online"), retain=True)
            return
        self.outbox.board(
            bridge_topic(self.config.prefix), self._status_payload("online"), retain=True
        )

    @_guarded
    def _on_unsubscribe(
        self, client: mqtt.Client, userdata: Any, mid: int, reason_codes: Any, properties: Any
    ) -> None:
        if mid == self._probe_unsub_mid:
            self._probed.set()

    @_guarded
    def _on_disconnect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        self._control_up = False
        if self._held is not None:
            with self._rivals_cond:
                self._lost_at_start = True
                self._rivals_cond.notify_all()
        # Starting (_check_rivals), a lost connection is a refusal, said by start().
        # Otherwise the will says offline until _subscribed says online again; the
        # intake's presence comes on the event connection, which has its own callback.
        if not self._stopping.is_set() and self._held is None:
            self._count("control.disconnects")
            log.warning(
                "bridge disconnected from the broker, control connection (%s); paho reconnects",
                reason_code,
            )

    @_guarded
    def _on_publish(
        self, client: mqtt.Client, userdata: Any, mid: int, reason_code: Any, properties: Any
    ) -> None:
        self.outbox.on_publish(mid, CONTROL)

    # The links' own callbacks (each on its network thread; userdata is the link's
    # number, 0 the event connection).

    def _new_link(self, link: int) -> Client:
        client_id, user, password = self.config.link_login(link)
        client = self._new_client(client_id, user, password)
        client.user_data_set(link)
        client.on_connect = self._on_link_connect
        client.on_disconnect = self._on_link_disconnect
        client.on_subscribe = self._on_link_subscribe
        # Its event channel's publisher (lanes.py): the events of the tenants it reads.
        client.on_publish = self._on_events_publish
        return client

    def _what(self, link: int) -> str:
        return "event connection" if link == 0 else f"link {link}"

    @_guarded
    def _on_link_connect(
        self, client: mqtt.Client, link: int, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        if reason_code.is_failure:
            _, user, _ = self.config.link_login(link)
            self._links_error[link] = connack_refusal(
                f"{self.config.host}:{self.config.port}", user, reason_code
            )
            self._login_refused = True
            log.error("broker refused the bridge's %s: %s", self._what(link), reason_code)
            self._links_ready[link].set()
            return
        self._links_up[link] = True
        self._count("connects" if link == 0 else "link.connects")
        if flags.session_present:
            self._count("session.resumed" if link == 0 else "link.session.resumed")
        # Subscribed on every connect, as the control connection is (_on_connect); from
        # this callback no SUBACK can be read before its mid is kept (one thread).
        wants, stale = self._link_wants(link)
        mids: set[int] = set()
        for batch in batches(wants):
            rc, mid = client.subscribe([(topic, 1) for topic in batch])
            if rc != mqtt.MQTT_ERR_SUCCESS or mid is None:
                self._links_error[link] = f"subscribe failed: {mqtt.error_string(rc)}"
                self._links_ready[link].set()
                return
            mids.add(mid)
        self._links_sub_mids[link] = mids
        # After the control connection has subscribed (start() connects the links then),
        # so nothing falls between: a message of the old session's may come on two
        # connections once, which every message the bridge reads survives (PROTOCOL.md
        # "At least once").
        for batch in batches(stale):
            client.unsubscribe(batch)
        if not mids:
            self._links_ready[link].set()  # no tenant of its own yet: nothing to wait for

    @_guarded
    def _on_link_subscribe(
        self, client: mqtt.Client, link: int, mid: int, reason_codes: Any, properties: Any
    ) -> None:
        refused = [str(rc) for rc in reason_codes if rc.is_failure]
        if refused:
            again = self._refused_while_serving(link)
            log.error(
                "broker refused the %s's subscriptions: %s%s", self._what(link), refused, again
            )
            self._count("link.refused_subscriptions")
        elif self._serving:
            self._resubscribed(link)
        with self._links_lock:
            if (link, mid) in self._deal_mids:
                self._deal_mids.discard((link, mid))
                if not self._deal_mids:
                    self._deal_acked.set()
            elif len(self._deal_early) < _DEAL_EARLY_MAX:
                self._deal_early.add((link, mid))
        pending = self._links_sub_mids[link]
        if mid not in pending:
            return
        pending.discard(mid)
        if refused and self._links_error[link] is None:
            self._links_error[link] = f"broker refused subscriptions: {', '.join(refused)}"
        if not pending:
            self._links_ready[link].set()

    @_guarded
    def _on_link_disconnect(
        self, client: mqtt.Client, link: int, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        self._links_up[link] = False
        # Offline statuses that arrived just now were most likely the wills of a broker
        # shutting down; what is true comes again, retained, after the reconnect.
        self.intake.broker_lost()
        if not self._stopping.is_set():
            self._count("disconnects" if link == 0 else "link.disconnects")
            log.warning(
                "bridge disconnected from the broker, %s (%s); paho reconnects",
                self._what(link),
                reason_code,
            )

    @_guarded
    def _on_events_publish(
        self, client: mqtt.Client, link: int, mid: int, reason_code: Any, properties: Any
    ) -> None:
        self.outbox.on_publish(mid, event_channel(link))

    # Fleet mode: the partitions' links (links.PartitionLinks), and the bridge's own
    # event connection (_start_fleet).

    @_guarded
    def _on_part_connect(
        self, client: mqtt.Client, part: int, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        assert self._parts is not None
        self._parts.on_connect(client, part, flags, reason_code, properties)

    @_guarded
    def _on_part_disconnect(
        self, client: mqtt.Client, part: int, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        assert self._parts is not None
        self._parts.on_disconnect(client, part, flags, reason_code, properties)

    @_guarded
    def _on_part_subscribe(
        self, client: mqtt.Client, part: int, mid: int, reason_codes: Any, properties: Any
    ) -> None:
        assert self._parts is not None
        self._parts.on_subscribe(client, part, mid, reason_codes, properties)

    @_guarded
    def _on_fleet_events_connect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        if reason_code.is_failure:
            self._start_error = connack_refusal(
                f"{self.config.host}:{self.config.port}", self.config.username, reason_code
            )
            self._login_refused = True
            log.error("broker refused the bridge's event connection: %s", reason_code)
        else:
            self._fleet_events_up.set()
            self._count("connects")
        self._fleet_events_ready.set()

    @_guarded
    def _on_fleet_events_disconnect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        self._fleet_events_up.clear()
        if not self._stopping.is_set():
            self._count("disconnects")
            log.warning("bridge disconnected from the broker, event connection (%s); paho "
                        "reconnects", reason_code)  # fmt: skip

    def _refresh_links(self, drop: bool) -> None:
        """Deal the registry's devices to the links again, if they changed, and subscribe
        each link to what it gained; with `drop`, once the broker has acknowledged those
        (bounded), unsubscribe what each lost, so a moved board is read on one link or
        both, never on none (links.py). Without `drop` (a host asking for a device the
        links do not read yet), what a link lost stays until the next check that drops."""
        devices = self.registry.devices()
        key = tuple(sorted((d.device, d.tenant) for d in devices))
        with self._links_lock:
            if key == self._dealt_from and not (drop and self._undropped):
                return
            deal = self._plan.deal(devices)
            old = self._link_topics
            self._link_topics = deal if drop else [o | d for o, d in zip(old, deal, strict=True)]
            self._dealt_from = key
            self._undropped = not drop
            self._linked_devices = {d.device for d in devices}
            self._tenant_link = self._plan.link_of(devices)
            self._deal_mids.clear()
            self._deal_early.clear()
            self._deal_acked.clear()
            gained = [sorted(d - o) for o, d in zip(old, deal, strict=True)]
            lost = [sorted(o - d) for o, d in zip(old, deal, strict=True)] if drop else []
        for link, topics in enumerate(gained):
            client = self._links[link]
            if not topics or client is None or not self._links_up[link]:
                continue  # a link not up subscribes to all it reads when it connects
            for batch in batches(topics):
                rc, mid = client.subscribe([(topic, 1) for topic in batch])
                if rc == mqtt.MQTT_ERR_SUCCESS and mid is not None:
                    with self._links_lock:
                        if (link, mid) in self._deal_early:
                            self._deal_early.discard((link, mid))
                        else:
                            self._deal_mids.add((link, mid))
        with self._links_lock:
            if not self._deal_mids:
                self._deal_acked.set()  # every SUBACK read already, or nothing to await
        if not any(lost):
            return
        with self._links_lock:
            waiting = bool(self._deal_mids)
        if waiting and not self._deal_acked.wait(self.config.connect_timeout_s):
            log.warning("the broker did not acknowledge the links' new subscriptions in time")
        for link, topics in enumerate(lost):
            client = self._links[link]
            if topics and client is not None:
                for batch in batches(topics):
                    client.unsubscribe(batch)
        count = sum(map(len, gained))
        if count:
            log.info("links dealt again: %d topic(s) moved or added", count)

    def _link_of_tenant(self, tenant: str) -> int:
        """The link that reads a tenant's boards (0 for one not dealt yet)."""
        return self._tenant_link.get(tenant, 0)

    def _ensure_linked(self, device: str) -> None:
        """Before a host's request reaches a board the links do not read yet (added to
        the registry since the last check), subscribe to it, so its answer is read. (In
        a fleet the request came on the device's partition, which reads its board.)"""
        if self.config.tenant_links == 1 or self.config.fleet:
            return
        with self._links_lock:
            linked = device in self._linked_devices
        if not linked:
            self._refresh_links(drop=False)

    @_guarded
    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        topic = msg.topic
        if topic == bridge_topic(self.config.prefix):
            self._bridge_status(bytes(msg.payload))
            return
        with self._gate:
            if self._held is not None and threading.current_thread() is not self._start_thread:
                # Starting: what the session delivers before the check has passed.
                if len(self._held) < _HELD_AT_START:
                    self._held.append(msg)
                else:
                    self._count("rx.dropped_at_start")
                return
        self._count("rx")
        payload = bytes(msg.payload)
        # Only presence and a board's hello are retained in the contract. Anything else
        # the broker holds retained would come back at every subscribe, so at every
        # bridge (re)start: a host's req run again, a board's rpc served again.
        if not _is_retained_by_contract(topic):
            if msg.retain:
                self._clear_retained(client, topic)
                return
            if not payload and self._clear_echo(topic):
                # A retained message being cleared (our own clear comes back to us too:
                # MQTT 3.1.1 has no "no local"). Nothing to act on and no one to answer.
                # Any other empty payload is refused as malformed input, and answered.
                self._count("rx.empty")
                return
        try:
            self._route(topic, payload)
        except REFUSALS as e:
            self._refuse(getattr(e, "kind", "bad_envelope"), topic, str(e))

    def _bridge_status(self, payload: bytes) -> None:
        """Another bridge's presence on P/b/status (ours is not another's)."""
        try:
            st = decode(payload, self.config.limits)
        except REFUSALS:
            return
        if not isinstance(st, dict) or st.get("boot") == self._boot:
            return
        with self._rivals_cond:
            self._rivals[str(st.get("boot"))] = st
            self._rivals_cond.notify_all()

    def _clear_retained(self, client: mqtt.Client, topic: str) -> None:
        """Refuse a retained message on a topic the bridge acts on, and clear it at the
        broker (an empty retained publish; the bridge may write all of P/#).

        Only what the broker delivers from its retained store carries the flag: a
        publish that is live when it arrives comes with the flag off (MQTT 3.1.1 has no
        retain-as-published), is indistinguishable from any other and is acted on once;
        its stored copy is refused and cleared at the next subscribe that delivers it.
        """
        self._refuse(RETAINED, topic, "a retained message on an input topic is never acted on")
        with self._lock:
            self._cleared[topic] = time.monotonic()
            self._cleared.move_to_end(topic)
            while len(self._cleared) > _CLEARS_KEPT:
                self._cleared.popitem(last=False)
        info = client.publish(topic, b"", qos=1, retain=True)
        if info.rc == mqtt.MQTT_ERR_SUCCESS:
            self._count("retained.cleared")
        else:
            log.warning("could not clear the retained message on %s: %s", topic, info.rc)

    def _clear_echo(self, topic: str) -> bool:
        """Whether an empty payload on `topic` is a clear of the retained message the
        bridge saw there a moment ago (its own clear, or another bridge process's)."""
        with self._lock:
            at = self._cleared.get(topic)
            if at is None:
                return False
            if time.monotonic() - at > _CLEAR_ECHO_S:
                del self._cleared[topic]
                return False
            return True

    # ------------------------------------------------------------------ routing

    def _route(self, topic: str, payload: bytes) -> None:
        t = parse(self.config.prefix, topic)
        if t.side == "h":
            if t.leaf not in ("req", "ctl"):
                raise BadTopic(f"the bridge does not read host leaf {t.leaf!r}")
            self._host_input(t, topic, payload)
            return
        if t.leaf not in ("rpc", "evt", "hello", "status"):
            raise BadTopic(f"the bridge does not read device leaf {t.leaf!r}")
        record = self.registry.device(t.device)
        if record is None:
            msg = f"device {t.device!r} is not in the registry"
            if t.leaf == "rpc":
                # Refused before its payload is read, so there is no call id to answer.
                self.rpc.answer_refusal(t.device, topic, UnknownDevice.kind, msg)
                return
            raise UnknownDevice(msg)
        if t.leaf == "rpc":
            self.rpc.handle(record, topic, payload)
        elif t.leaf == "evt":
            self.intake.handle_evt(record, payload)
        elif t.leaf == "hello":
            self.intake.handle_hello(record, payload)
            self._count("hello")
        else:
            presence = self.intake.handle_status(record, payload)
            self._count("status")
            if presence is not None and self.mirror is not None:
                self.mirror.status(record.tenant, t.device, presence)
            if presence is not None and presence["st"] == "online":
                self._tell_presence(t.device, "online")

    def _session(
        self, t: Topic, tok: object, asking: list[tokens.Session]
    ) -> tuple[DeviceRecord, tokens.Session, str]:
        """The user a host message speaks for, and the device, both checked against T;
        and T's secret (hex). The session, once verified, is added to `asking`: the
        refusals that follow go to that user's topic."""
        assert t.tenant is not None
        secret = self.registry.tenant_secret(t.tenant)
        if secret is None:
            raise TokenError(f"no tenant {t.tenant!r} to verify the session token against")
        session = self._tokens.verify(secret, tok, t.tenant)
        asking.append(session)
        record = self.registry.device(t.device)
        if record is None or record.tenant != t.tenant:
            raise UnknownDevice(f"device {t.device!r} is not tenant {t.tenant!r}'s")
        return record, session, secret

    def _host_input(self, t: Topic, topic: str, payload: bytes) -> None:
        """A host's req or ctl; a refusal is also told to the host (see _tell_host)."""
        obj: Any = None
        asking: list[tokens.Session] = []
        try:
            if not payload:
                raise BadEnvelope(f"an empty payload: a host {t.leaf} is a msgpack map")
            obj = decode(payload, self.config.limits)
            assert t.tenant is not None  # a host topic always has one
            # Slowed, then refused by name: a tenant over its request rate, or whose
            # lane is full, is told so (`rate_limited`, `busy`); nothing is dropped.
            self.outbox.admit_host(t.tenant)
            if t.leaf == "req":
                self._host_req(t, obj, asking)
            else:
                self._host_ctl(t, topic, obj, asking)
        except REFUSALS as e:
            self._host_refused(t, topic, e, obj, asking)

    def _host_refused(
        self, t: Topic, topic: str, e: Exception, obj: Any, asking: list[tokens.Session]
    ) -> None:
        """Count a refused host message and tell its sender (see _tell_host)."""
        kind = getattr(e, "kind", "bad_envelope")
        self._refuse(kind, topic, str(e))
        user = asking[0].user if asking else None
        detail = getattr(e, "detail", None)
        self._tell_host(t, kind, _host_msg(e, obj), _req_of(obj), detail, user)

    def _settle_awaiting(self) -> None:
        """Act on the held host acts whose run's user is now known, each as it would have
        been acted on when it came; refuse those whose wait is over (housekeeping)."""
        ready, expired = self._awaiting.settle(
            lambda device, run: self.intake.owner(device, run) is not None, time.monotonic()
        )
        for t, topic, obj in ready:
            asking: list[tokens.Session] = []
            try:
                self._host_ctl(t, topic, obj, asking, again=True)
            except REFUSALS as e:
                self._host_refused(t, topic, e, obj, asking)
        for t, topic, obj in expired:
            asking = []
            try:
                self._session(t, obj.get("tok"), asking)
                raise access.Forbidden(
                    f"run {obj.get('r')} is not known to be yours: its board did not say "
                    "whose it is; only a watcher may act on it"
                )
            except REFUSALS as e:
                self._host_refused(t, topic, e, obj, asking)

    def _tell_host(
        self,
        t: Topic,
        kind: str,
        msg: str,
        req: str | None,
        detail: dict[str, Any] | None = None,
        user: str | None = None,
    ) -> None:
        """Publish a refusal as an `error` event of the bridge stream `_b` of T and D
        (with the refusal's own fields, `detail`: a device_offline's `since`).

        On the topic's own tenant and device only (parse() has checked both levels), so
        it reaches the hosts of the tenant that sent the message, whoever owns D: on the
        sender's user topic once its token verified (`user`), else (a bad token, a
        payload read before any token) on the device's, the only one it could read.
        """
        d: dict[str, Any] = {**(detail or {}), "kind": kind, "msg": msg}
        if req is not None:
            d["req"] = req
        self._bridge_error(t, d, user)
        self._count("host.refusals_told")

    def _bridge_error(self, t: Topic, d: dict[str, Any], user: str | None) -> None:
        """An `error` event `d` on the bridge stream `_b` of the topic's T and D, on
        `user`'s host topic (None: the device's)."""
        assert t.tenant is not None  # a host topic always has one
        topic, payload = self._bridge_event(t, d, "error", user)
        self.outbox.notice(t.tenant, topic, payload)

    def _bridge_event(
        self, t: Topic, d: dict[str, Any], type_: str = "error", user: str | None = None
    ) -> tuple[str, bytes]:
        """The next event (an `error`, or `presence`) of the bridge stream `_b` of the
        topic's T and D, for `user`'s host topic (None: the device's; PROTOCOL.md "Who
        sees what"). One id sequence for all of them: hosts fold `_b` as it comes."""
        assert t.tenant is not None  # a host topic always has one
        env = {
            "r": BRIDGE_RUN,
            "i": self._streams.next_id(t.tenant, t.device),
            "t": type_,
            "ts": int(time.time() * 1000),
            "d": d,
        }
        topic = host_event_topic(self.config.prefix, t.tenant, t.device, user)
        return topic, encode(env)

    def _host_req(self, t: Topic, obj: Any, asking: list[tokens.Session]) -> None:
        req = check_host_req(obj)
        record, session, secret = self._session(t, req.tok, asking)
        self._ensure_linked(record.device)
        presence = self.intake.presence(record.device)
        if (
            presence is not None
            and presence["st"] == "offline"
            and time.time() - presence["since"] >= self.config.offline_grace_s
        ):
            # Offline past the grace in which the bridge ends its runs: not sent on to
            # wait in the board's session, where it would run when the board is back,
            # hours later maybe, with no one watching (a switch thrown late). Said by
            # name instead. Within the grace (a board restarting, a broker restart's
            # wills) it is sent on and waits for the board, as any message for it does.
            raise DeviceOffline(
                f"device {record.device} is offline; the request was not sent (ask again "
                "once it is back)",
                int(presence["since"] * 1000),
            )
        if req.conv is None:
            # A scope ticket without a conversation reaches no `session` field: the run's
            # state.load would be refused no_scope and the run fail (kind link). Said
            # here, by name, before anything reaches the board.
            kept = self._session_fields(record.device)
            if kept:
                raise NoScope(
                    f"device {record.device}'s agent keeps state per conversation "
                    f"({', '.join(kept[:4])}): the request needs a conv"
                )
        # Built from named fields only: the user is the token's, and no other key of the
        # host payload (usr, ten, device, tok ...) reaches the board.
        out: dict[str, Any] = {"req": req.req, "usr": session.user, "input": req.input}
        if req.conv is not None:
            out["conv"] = req.conv
        # The scope ticket: the board copies it into the run's memory calls, which then
        # reach this user's and conversation's memory and no one else's. (The device is
        # the token's tenant's: _session checked it, so the secret is that tenant's.)
        out["sc"] = self._tokens.scope(secret, record.tenant, record.device, session.user, req.conv)
        if req.ttl is not None:
            out["ttl"] = req.ttl
        limits = self.intake.device_limits(record.device)
        seed = self._state_seed(record, session.user, req.conv, presence)
        if seed is not None:
            out["state"] = seed
        payload = encode(out)
        if seed is not None and not _readable(payload, limits):
            # Past what the board reads (its payload, a string, an array or the depth
            # it announced): sent without, the run loads its state itself.
            del out["state"]
            payload = encode(out)
            seed = None
        self._count("host.req_seeded" if seed is not None else "host.req_unseeded")
        # The board says in hello how much it can receive. A request over that would be
        # read past on the board and refused there without its req id, so no host could
        # tell which request it was: refuse it here, by name, where the id is known.
        if limits is not None and (
            len(payload) > limits.max_payload or len(req.input.encode()) > limits.max_str
        ):
            raise TooLarge(
                f"the request is {len(payload)} bytes; device {record.device} takes at most "
                f"{limits.max_payload} (its text at most {limits.max_str})"
            )
        topic = device_topic(self.config.prefix, record.device, "req")
        self.outbox.host(record.tenant, [(topic, payload)], Kind.REQ)
        self._req_owners.note(record.device, req.req, session.user)
        self._count("host.req")
        if presence is None:
            # No status of the device has ever reached the bridge (none retained at the
            # broker either): it has never connected, or not since its status was
            # cleared. Sent on all the same (a bridge just started may not have read the
            # retained statuses yet), and the hosts told, so one waiting for the run can
            # say what it waits for and stop (PROTOCOL "Presence at the host").
            d = {"st": "unseen", "req": req.req}
            notice = self._bridge_event(t, d, "presence", session.user)
            self.outbox.notice(record.tenant, *notice)
            self._count("host.req_unseen")

    def _session_fields(self, device: str) -> list[str]:
        """The durable slot fields of `session` scope the device's last hello declares:
        what its runs load (state.load) with the request's conversation; [] without a
        hello (the run's own load then says what is wrong)."""
        if not self.intake.declares_fields(device):
            return []
        hello = self.hello(device)
        fields = hello.get("fields") if hello is not None else None
        return [
            f["name"]
            for f in (fields if isinstance(fields, list) else [])
            if isinstance(f, dict)
            and isinstance(f.get("name"), str)
            and f.get("dur") == "session"
            and f.get("kind") in (None, "slot")
            and not f.get("core")
        ]

    def _state_seed(
        self,
        record: DeviceRecord,
        user: str,
        conv: str | None,
        presence: dict[str, Any] | None,
    ) -> dict[str, Any] | None:
        """The run's durable state to send in its `req` (PROTOCOL.md "req", `state`), which
        spares the board a state.load round trip before its model call; None when there
        is none to send. Read now, as the run would read it at its start: only for a board
        that is online (a request waiting at the broker for one that is not would carry
        state read long before its run), and never waiting for another thread's write of
        the same scope (this is the control connection's network thread)."""
        if (
            self.memory is None
            or presence is None
            or presence["st"] != "online"
            or not self.intake.declares_fields(record.device)
        ):
            return None
        try:
            return memory_calls.state_seed(
                self.memory, self.registry, record, user, conv, self.hello(record.device)
            )
        except Exception:
            # The board's own state.load then reads it, and says why if it cannot.
            log.exception("reading the state of a request for device %s", record.device)
            return None

    def _host_ctl(
        self, t: Topic, topic: str, obj: Any, asking: list[tokens.Session], again: bool = False
    ) -> None:
        ctl = check_host_ctl(obj)
        record, session, _ = self._session(t, ctl.tok, asking)
        if ctl.op == "replay":
            self._host_replay(t, record, session, ctl.fields["r"], ctl.fields["after"])
            return
        # Only the run's (or the request's) own user, or a watcher, acts on it: a cancel,
        # a client tool's answer, an approval (access.py). Refused `forbidden`, nothing
        # sent to the board.
        run = ctl.fields.get("r")
        if run is not None:
            owner = self.intake.owner(record.device, run)
            if owner is None and not session.watch and not again:
                # Not known here yet (a paused run after the bridge's restart): held
                # while the board replays the run, which names its user; then checked.
                held = self._awaiting.hold(record.device, run, (t, topic, obj), time.monotonic())
                if held is None:
                    raise access.Forbidden(f"run {run} is not known to be yours (too many wait)")
                if held:
                    ask = {"op": "replay", "r": run, "after": 0}
                    ctl_topic = device_topic(self.config.prefix, record.device, "ctl")
                    self.outbox.host(record.tenant, [(ctl_topic, encode(ask))], Kind.CTL)
                self._count("host.ctl_awaiting_owner")
                return
            access.check_run(session, owner, f"run {run}")
        else:
            req = ctl.fields["req"]
            access.check_run(session, self._req_owners.owner(record.device, req), f"request {req}")
        out = dict(ctl.fields)
        if ctl.op == "approve":
            # Who approved is whoever the token proves, not what the payload claims.
            out["by"] = session.user
        topic = device_topic(self.config.prefix, record.device, "ctl")
        self.outbox.host(record.tenant, [(topic, encode(out))], Kind.CTL)
        self._count("host.ctl")

    def _host_replay(
        self, t: Topic, record: DeviceRecord, session: tokens.Session, run: str, after: int
    ) -> None:
        """Answer a host's replay from the intake's window, and from the event log for
        what the window no longer holds (or never held: before the bridge's restart);
        the board is not asked.

        The events go out on the run's host topic like the first time (hosts drop ids
        they have); ids past `after` that neither holds are a `gap` error on `_b` where
        they are missing, on the same topic; a run neither knows is `unknown_run` on
        `_b`, on the sender's topic. A run of another user is `forbidden` unless the
        session is a watcher's (access.py); the device stream "_" is on the device's
        topic, which every host of the tenant reads, so anyone's. At most
        REPLAY_MAX_EVENTS go in one answer: past them a `replay_cut` error names the id
        to ask again after. A `run` the bridge holds no run of may be a request id: the
        run that request started is answered (intake.run_of_request).
        """
        self._count("host.replay")
        known = self.run_events(record.tenant, record.device, run, after)
        started = None if known is not None else self.intake.run_of_request(record.device, run)
        if started is not None:
            # `r` names a request whose run.started the bridge has passed on: a host that
            # was away while that run started (and ended) knows no run id, only its req.
            # Checked under the intake's lock, as the run.started was taken: a run not
            # found here goes to hosts after this ask, which they sent subscribed.
            run = started
            known = self.run_events(record.tenant, record.device, run, after)
        if known is None:
            msg = "the bridge holds no events of this run"
            self._refuse("unknown_run", host_topic(self.config.prefix, *_levels(t), "ctl"), msg)
            self._bridge_error(t, {"kind": "unknown_run", "r": run, "msg": msg}, session.user)
            return
        user: str | None = None
        if run != DEVICE_RUN:
            access.check_run(session, known.usr, f"run {run}")
            user = known.usr or UNOWNED
        topic = host_event_topic(self.config.prefix, *_levels(t), user)
        # The answer is one unit in the tenant's lane: each gap where it is, the events.
        out: list[tuple[str, bytes]] = []
        expect = after + 1
        for i, payload in known.found:
            if i > expect:
                out.append(self._replay_gap(t, run, expect, i - 1, user))
            out.append((topic, payload))
            expect = i + 1
        if known.cut:
            out.append(self._bridge_event(
                t,
                {"kind": "replay_cut", "r": run, "after": expect - 1,
                 "msg": f"the replay stopped after id {expect - 1}: ask again after it"},
                "error",
                user,
            ))  # fmt: skip
        elif expect <= known.last:
            out.append(self._replay_gap(t, run, expect, known.last, user))
        self.outbox.host(record.tenant, out, Kind.REPLAY)
        self._count("host.replay_events", len(known.found))

    # ------------------------------------------------------------------ hosts over HTTP

    def session_of(self, token: object) -> tokens.Session:
        """The session a host's token proves, for the HTTP API (http/): the tenant named
        in its claims, verified with that tenant's secret. TokenError when it proves
        nothing (malformed, forged, expired, or a tenant the registry does not know);
        the message does not say which."""
        claims = tokens.peek(token)
        tenant = claims.get("ten") if claims is not None else None
        secret = None
        if is_id(tenant):
            assert isinstance(tenant, str)
            secret = self.registry.tenant_secret(tenant)
        if secret is None or not isinstance(tenant, str):
            raise TokenError("the session token proves no session")
        return self._tokens.verify(secret, token, tenant)

    def device_of(self, session: tokens.Session, device: str) -> DeviceRecord:
        """A device of the session's tenant; UnknownDevice for any other id, one of
        another tenant included, in the same words (nothing says which it was)."""
        record = self.registry.device(device) if is_id(device) else None
        if record is None or record.tenant != session.tenant:
            raise UnknownDevice(f"no device {device[:64]!r}")
        return record

    def devices_of(
        self, session: tokens.Session
    ) -> list[tuple[DeviceRecord, dict[str, Any] | None]]:
        """The session's tenant's devices with their presence (None: never seen)."""
        return [
            (r, self.intake.presence(r.device))
            for r in self.registry.devices()
            if r.tenant == session.tenant
        ]

    def http_request(self, token: str, device: str, body: dict[str, Any]) -> str:
        """Send a host's request to `device` as the MQTT path does (the same checks,
        admission and limits: _host_req), for the HTTP API; returns the req id. Raises
        the refusal (REFUSALS, with its `kind`), counted like any."""
        session = self.session_of(token)
        record = self.device_of(session, device)
        t = Topic("h", record.device, "req", session.tenant)
        obj = {**body, "tok": token}
        obj.setdefault("req", uuid.uuid4().hex)
        try:
            self.outbox.admit_host(session.tenant)
            self._host_req(t, obj, [session])
        except REFUSALS as e:
            self._refuse(getattr(e, "kind", "bad_envelope"), "http request", str(e))
            raise
        return str(obj["req"])

    def http_control(self, token: str, device: str, body: dict[str, Any]) -> None:
        """A host's cancel, tool answer or approval, as the MQTT path acts on it
        (_host_ctl: only the run's user or a watcher); for the HTTP API."""
        session = self.session_of(token)
        record = self.device_of(session, device)
        if body.get("op") == "replay":
            raise BadEnvelope("a replay over HTTP is a GET of the run's events")
        t = Topic("h", record.device, "ctl", session.tenant)
        topic = host_topic(self.config.prefix, session.tenant, record.device, "ctl")
        try:
            self.outbox.admit_host(session.tenant)
            self._host_ctl(t, topic, {**body, "tok": token}, [session])
        except REFUSALS as e:
            self._refuse(getattr(e, "kind", "bad_envelope"), "http control", str(e))
            raise

    def request_owner(self, device: str, req: str) -> str | None:
        """The user who sent a recent request (None: not known here)."""
        return self._req_owners.owner(device, req)

    def conversation_runs(self, tenant: str, user: str, conv: str) -> list[tuple[str, str]]:
        """The (device, run) of a user's conversation the log holds, in the order they
        began; [] without a log or for a conversation it holds none of."""
        if self.events is None:
            return []
        return [k for c, ks in self.events.conversations(tenant, user) if c == conv for k in ks]

    def conversations_of(
        self,
        tenant: str,
        user: str,
        device: str | None = None,
        agent: str | None = None,
        status: str | None = None,
        since_ms: int | None = None,
        until_ms: int | None = None,
    ) -> list[dict[str, Any]]:
        """A user's conversations from the event log, the most recently active first:
        each with its device, runs (oldest first), when it began and was last active
        (Unix ms), and its last run's agent and status (read from that run's events).
        Filters: its last run's device, agent and status; activity from `since_ms`
        (last active at or after) to `until_ms` (began at or before). [] without a
        log."""
        if self.events is None:
            return []
        out = []
        for conv, runs in self.events.conversations(tenant, user):
            if device is not None:
                runs = [k for k in runs if k[0] == device]
            if not runs:
                continue
            spans = [self.events.run(tenant, d, r) for d, r in runs]
            began = min((s.first_ms for s in spans if s is not None), default=0)
            active = max((s.last_ms for s in spans if s is not None), default=0)
            if since_ms is not None and active < since_ms:
                continue
            if until_ms is not None and began > until_ms:
                continue
            last_device, last_run = runs[-1]
            snap = self._fold_run(tenant, last_device, last_run)
            last_agent = snap.agent if snap is not None else None
            last_status = snap.status if snap is not None else None
            if agent is not None and last_agent != agent:
                continue
            if status is not None and last_status != status:
                continue
            out.append({
                "conv": conv,
                "device": last_device,
                "runs": [run for _, run in runs],
                "agent": last_agent,
                "status": last_status,
                "started": began,
                "updated": active,
            })  # fmt: skip
        return out

    def conversation_rows(
        self, tenant: str, user: str, conv: str
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
        """A conversation as rows, every run's in order (each row with its `run`), and
        its runs (id, device, status, tables); None when the log holds none of the
        user's runs in it."""
        runs = self.conversation_runs(tenant, user, conv)
        if not runs:
            return None
        rows: list[dict[str, Any]] = []
        about: list[dict[str, Any]] = []
        for dev, run in runs:
            snap = self._fold_run(tenant, dev, run)
            if snap is None:
                continue
            view = snapshot_json(snap)
            rows += [{**row, "run": run} for row in view["rows"]]
            about.append({"run": run, "device": dev, "status": view["status"],
                          "tables": view["tables"], "error": view["error"]})  # fmt: skip
        return rows, about

    def _fold_run(self, tenant: str, device: str, run: str) -> RunSnapshot | None:
        """A run's snapshot, folded from every event the bridge holds of it. A run that
        has ended is folded once while the log holds the same events of it (listing a
        user's conversations reads each one's last run; most have ended)."""
        key = (tenant, device, run)
        logged = self.events.run(tenant, device, run) if self.events is not None else None
        with self._lock:
            kept = self._folded.get(key)
            if kept is not None and logged is not None and kept[0] == logged.count:
                self._folded.move_to_end(key)
                return kept[1]
        snap = self._fold_events(tenant, device, run)
        if snap is not None and snap.terminal and logged is not None:
            with self._lock:
                self._folded[key] = (logged.count, snap)
                while len(self._folded) > _FOLDED_RUNS:
                    self._folded.popitem(last=False)
        return snap

    def _fold_events(self, tenant: str, device: str, run: str) -> RunSnapshot | None:
        reducer = Reducer(device)
        snap = None
        after = 0
        while True:
            held = self.run_events(tenant, device, run, after)
            if held is None:
                return snap
            for _, payload in held.found:
                snap = reducer.apply(event_json(payload))
            if not held.cut or not held.found:
                return snap
            after = held.found[-1][0]

    def run_events(
        self, tenant: str, device: str, run: str, after: int = 0, limit: int | None = None
    ) -> RunEvents | None:
        """A run's events past `after` as hosts were sent them, from the intake's window
        and, below it, from the event log (at most `limit`, REPLAY_MAX_EVENTS by
        default); None when neither knows the run. Reads files: not on a thread that
        must not wait."""
        cap = REPLAY_MAX_EVENTS if limit is None else limit
        window = self.intake.window(device, run, after)
        held_from = None
        if window is not None:
            held_from = window.first if window.first is not None else window.next
        logged = None
        if self.events is not None and (held_from is None or after + 1 < held_from):
            logged = self.events.run(tenant, device, run)
        if window is None and logged is None:
            return None
        owner = window.usr if window is not None else None
        if owner is None and logged is not None:
            owner = logged.usr
        # (id, payload) in id order: the log's part below the window, then the window's.
        found: list[tuple[int, bytes]] = []
        if logged is not None:
            assert self.events is not None
            found += [(e.i, e.payload)
                      for e in self.events.events(tenant, device, run, after)
                      if held_from is None or e.i < held_from]  # fmt: skip
            self._count("host.replay_logged", len(found))
        if window is not None and window.payloads:
            first = window.first if window.first is not None else window.next
            found += [(max(after + 1, first) + k, p) for k, p in enumerate(window.payloads)]
        last = window.next - 1 if window is not None else logged.last if logged else after
        return RunEvents(found[:cap], max(last, after), owner, len(found) > cap)

    def _replay_gap(
        self, t: Topic, run: str, lo: int, hi: int, user: str | None
    ) -> tuple[str, bytes]:
        self._count("host.replay_gap")
        return self._bridge_event(
            t,
            {"kind": "gap", "r": run, "from": lo, "to": hi,
             "msg": f"events {lo}..{hi} are no longer held by the bridge"},
            "error",
            user,
        )  # fmt: skip

    # ------------------------------------------------------------------ publishing

    def _send_rpc(
        self, device: str, answer: dict[str, Any], wait_until: float | None = None
    ) -> None:
        topic = device_topic(self.config.prefix, device, "rpc/res")
        self.outbox.board(topic, encode(answer), wait_until, tenant=self._tenant_of_device(device))

    def _send_rpc_refusal(self, device: str, answer: dict[str, Any]) -> bool:
        """A refusal of a call that never started, made on the network thread: not
        queued when the device's tenant's board lane is full (lanes.Outbox.board, counted
        there), so a tenant's flood of junk calls fills its own lane and no more."""
        topic = device_topic(self.config.prefix, device, "rpc/res")
        tenant = self._tenant_of_device(device)
        return self.outbox.board(topic, encode(answer), tenant=tenant, refusable=True)

    def _tenant_of_device(self, device: str) -> str | None:
        # Whose lane a message to a board waits in (lanes.py: tenants take turns). A
        # device the registry does not know (an answer to a call refused for that) has
        # no tenant: its tenant is not known, and it waits in the bridge's own lane.
        record = self.registry.device(device)
        return record.tenant if record is not None else None

    def _publish(self, topic: str, payload: bytes, wait_until: float | None = None) -> None:
        """Queue a message of the bridge's own to a board: the intake's replay and cancel
        requests, in the board lane of the board's tenant (first in that tenant's turn).
        Always taken, since what feeds it is bounded where it is made (one per run at a
        time; lanes.Outbox.board). Never dropped."""
        tenant = None
        head = f"{self.config.prefix}/d/"
        if topic.startswith(head):  # P/d/D/...: the device's tenant's lane
            tenant = self._tenant_of_device(topic[len(head) :].split("/", 1)[0])
        self.outbox.board(topic, payload, wait_until, tenant=tenant)


def _is_retained_by_contract(topic: str) -> bool:
    """P/d/D/status and P/d/D/hello: the topics the bridge reads that are retained by
    contract (it subscribes to nothing else ending so). A restarted bridge learns every
    board's presence and capabilities from the broker at once, even when a board has no
    heap to say hello again just then."""
    return topic.endswith("/status") or topic.endswith("/hello")


def _levels(t: Topic) -> tuple[str, str]:
    """The tenant and device levels of a host topic."""
    assert t.tenant is not None  # a host topic always has one
    return t.tenant, t.device


def _readable(payload: bytes, limits: Limits | None) -> bool:
    """Whether a board that announced `limits` can decode `payload` (no hello: unknown,
    so no)."""
    if limits is None:
        return False
    try:
        decode(payload, limits)
    except WireError:
        return False
    return True


def _req_of(obj: Any) -> str | None:
    """The req id of a decoded host payload, if it has a usable one to name a refusal by."""
    req = obj.get("req") if isinstance(obj, dict) else None
    return req if isinstance(req, str) and 0 < len(req) <= MAX_ID else None


def _host_msg(e: Exception, obj: Any) -> str:
    """A refusal's message as a host may see it: short, and with nothing secret in it.

    The messages are the bridge's own and name no secret, but some quote a piece of the
    payload (an unknown op); the session token is cut out wherever it appears, and the
    rest is scrubbed like a log line.
    """
    msg = str(e)
    tok = obj.get("tok") if isinstance(obj, dict) else None
    if isinstance(tok, str) and tok:
        msg = msg.replace(tok, MASK)
    return scrub(msg)[:MAX_ERROR_MSG]
