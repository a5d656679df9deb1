"""A Python host client: start runs on a tenant's devices and watch their events.

It is what scripts and hardware-in-loop tests use in place of a dashboard. It speaks the
host side of the contract (docs/PROTOCOL.md): it publishes `{req, conv, input, ttl, tok}`
on `P/h/T/D/req` and subscribes to the tenant's device topics `P/h/T/+/evt` and to the
user topics it may read (PROTOCOL.md "Who sees what"): `P/h/T/+/u/<usr>/evt` for the user
its session token names, or every user's, `P/h/T/+/u/+/evt`, for a watcher's token (or
with no token and no user given: then the broker delivers what this MQTT user may read,
under an `acl_file`), folding every event into one Reducer per device. Payloads are
decoded and checked by server_bridge.wire, the same code the bridge reads boards with, so
a host accepts what the bridge accepts (with larger limits, see HOST_LIMITS, and any
event type, see wire.check_envelope).

A request that never becomes a run is refused somewhere, and said so: by the bridge on
its stream `_b` (bad token, unknown device, malformed request) or by the board on its
device stream `_` (busy), each as an `error` event naming the `req`. wait_run and
wait_for raise RequestRefused as soon as one arrives instead of waiting out their
timeout.

Presence: the bridge's comes from `P/b/status` (retained), which the client reads with
its events (bridge_presence()); a device's from the bridge, on its stream `_b`: a
`presence` event when it has been offline past the bridge's grace and when it is back,
and a request refused `device_offline` (device_presence()). See PROTOCOL.md "Presence
at the host".

What it publishes (a request, a ctl) it publishes only while connected and subscribed,
and then waits for the broker's acknowledgement, so a failure says what happened:
NotConnected, nothing was sent (paho would have kept a QoS 1 message and sent it after
reconnecting, so a request "not sent" ran all the same); Unacknowledged, it was handed
over and may arrive (a request sent again under the same req id still runs once).
cancel_request() cancels a request by its run once that has started, and before that
by its id (the board then never starts it).

It repairs holes itself, because the reducer applies a run's events only in id order
and a run is finished only when every id below its terminal event is there or declared
lost (so a partial answer is never shown as a whole one). When a run holds events above
a hole for `replay_after_s` without progress, the client asks the bridge to replay the
run (`ctl {op:"replay", r, after, tok}` on P/h/T/D/ctl), again with doubling waits up
to `max_replay_wait_s` while the hole stays; and after every (re)connect it asks the
same for every run it tracks that is not finished, since its session is clean and what
was published while it was away is gone; and for every request it sent whose run it
has not seen start (nor a refusal of), by the request's id (`r` the req id: a run that
started and went by while it was away is one it knows no id of). The bridge resends
what its window holds and
answers on its stream `_b` for the rest: a gap `{kind:"gap", r, from, to}` (declared
lost with Reducer.mark_lost) or `{kind:"unknown_run", r}` (then a hole below held events
can never fill, and is declared lost). A replay needs a session token: the one last used
in request() for that device, else the one given to the constructor or set_token().

A reconnect's subscription that the broker refuses (a cluster node that cannot make it
yet) or leaves unanswered for SUBACK_WAIT_S is made again by the repair thread, after
waits doubling from SUBSCRIBE_RETRY_S to MAX_SUBSCRIBE_RETRY_S, each refusal logged;
until one is granted nothing is sent (NotConnected). The first subscription is
connect()'s: refused, connect() raises and nothing is made again.

Client tools (server_bridge/host/tools.py): given `tools` (a ToolHandlers) or handlers
added with on_tool(), the client answers each pending call of a handled tool as its
run's snapshot shows it, once per call, on the runner's worker threads (never on paho's
network thread), with the device's session token (see set_token); deliveries() says how
each answer is getting to the board, and the run's snapshot says the same
(Row.delivery, Reducer.set_delivery).

Threading: paho's network thread delivers messages; one repair thread (started by
connect, stopped by close) asks for replays and makes refused subscriptions again; every
piece of shared state is guarded by one condition variable, and what is handed to
callers (snapshots, events) is a copy, so a caller never sees a snapshot change under it.
Nothing is published while holding it, and the tool runner is called only without it
(the runner's workers take it to mirror a delivery into the reducer).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode

from server_bridge.host.reducer import (
    BRIDGE_RUN,
    DEVICE_RUN,
    STREAMS,
    OnApply,
    Presence,
    Reducer,
    RunSnapshot,
)
from server_bridge.host.tools import (
    Delivery,
    Handler,
    ToolHandlers,
    ToolOffer,
    ToolRunner,
    offer_of,
)
from server_bridge.mqttclient import Client, connack_refusal
from server_bridge.tcp import no_delay
from server_bridge.tls import BrokerTLS
from server_bridge.tokens import WATCH, peek
from server_bridge.topics import (
    DEFAULT_PREFIX,
    BadTopic,
    bridge_topic,
    check_id,
    check_user_id,
    host_topic,
    parse,
)
from server_bridge.wire import BadEnvelope, Limits, WireError, check_events, decode, encode

log = logging.getLogger(__name__)

# Decode limits for events from the bridge. A bridge forwards what it accepted from a
# board under its own limits (16 KiB payloads by default, configurable), one envelope per
# message; these are well above any of that, and still bound what a misbehaving peer on
# the topic can make this process allocate (checked before allocating, as on the bridge).
HOST_LIMITS = Limits(max_payload=1 << 20, max_str=256 * 1024, max_items=4096, max_depth=32)

# Refusals of a request arrive on the bridge's stream BRIDGE_RUN ("_b", host input it
# refused) and on the board's device stream DEVICE_RUN ("_", input it refused, e.g. busy).
# Refusals remembered by req id, for wait_run; the oldest are forgotten first.
MAX_REFUSALS = 1000
# Replay requests for a hole: the first after REPLAY_AFTER_S without progress, then with
# doubling waits up to MAX_REPLAY_WAIT_S (the bridge asks its boards the same way).
REPLAY_AFTER_S = 2.0
MAX_REPLAY_WAIT_S = 30.0
# Requests sent whose run has not been seen to start, asked for by their id after a
# reconnect (the newest this many: each ask is one host message for the bridge's rate).
MAX_PENDING = 64
# After a reconnect, a subscription the broker refused (a cluster node that could not
# make it yet, an ACL being rewritten) is made again after SUBSCRIBE_RETRY_S, then with
# doubling waits up to MAX_SUBSCRIBE_RETRY_S, and one it has not answered within
# SUBACK_WAIT_S is made again: a client left connected but deaf would never recover.
SUBSCRIBE_RETRY_S = 1.0
MAX_SUBSCRIBE_RETRY_S = 30.0
SUBACK_WAIT_S = 10.0
# The repair thread looks at the holes (and at the subscription) at least this often.
_REPAIR_TICK_S = 0.5

EventCallback = Callable[[dict[str, Any], RunSnapshot], None]


class HostConnectError(ConnectionError):
    """The broker could not be reached, refused the connection, or refused the
    subscription (an ACL that does not give this user the tenant's topics)."""


class BrokerRefused(HostConnectError):
    """The broker was reached and refused this client's CONNECT (CONNACK): the message
    says so, naming the user for refused credentials (`mqttclient.connack_refusal`)."""


class NotConnected(HostConnectError):
    """Nothing was sent: the client was not connected and subscribed when called (the
    broker away, a reconnect under way). Sending it again, under any id, is safe."""


class Unacknowledged(TimeoutError):
    """A message was handed to the connection but the broker has not acknowledged it:
    it may have reached the broker, or it is sent when the connection is back (QoS 1,
    kept by this client until close()). `what` says which message; `req` names the
    request, for a request: sent again only under this same id it still starts one run
    (the board starts nothing for a req id it has), under a new id it may run twice."""

    def __init__(self, what: str, why: str, req: str | None = None) -> None:
        super().__init__(f"{what} is not acknowledged: {why}")
        self.what = what
        self.req = req


class RequestRefused(RuntimeError):
    """A request was refused before any run started for it: `kind` is the contract's
    error kind (bad_token, unknown_device, device_offline, bad_envelope, busy, ...),
    `msg` the customer-safe text, `req` the request id, `detail` the refusal's other
    fields (a device_offline's `since`, Unix ms)."""

    def __init__(self, kind: str, msg: str, req: str, detail: dict[str, Any] | None = None) -> None:
        super().__init__(f"request {req} was refused: {kind}: {msg}")
        self.kind = kind
        self.msg = msg
        self.req = req
        self.detail = detail or {}


def decode_events(payload: bytes | bytearray) -> list[dict[str, Any]]:
    """Decode one evt payload (one envelope or a batch) exactly as the bridge checks
    board events, within HOST_LIMITS; raises wire.WireError naming the kind."""
    return check_events(decode(payload, HOST_LIMITS), strict_types=False)


@dataclass
class _Repair:
    """A run holding events above a hole: when to ask for a replay next."""

    last_id: int  # the run's last_id when the hole was seen or last moved on
    due: float  # monotonic time of the next ask
    wait: float  # the wait after the next ask
    asked: int = 0


def _ids_text(ids: list[int]) -> str:
    """Sorted ids as ranges: [3, 4, 5, 9] -> "3..5, 9"."""
    ranges: list[list[int]] = []
    for i in ids:
        if ranges and i == ranges[-1][1] + 1:
            ranges[-1][1] = i
        else:
            ranges.append([i, i])
    return ", ".join(f"{lo}..{hi}" if hi > lo else str(lo) for lo, hi in ranges)


def _keep_copy(
    into: list[tuple[dict[str, Any], RunSnapshot]], e: dict[str, Any], snap: RunSnapshot
) -> None:
    into.append((e, snap.copy()))


# The fields of a refusal that are not its own detail.
_REFUSAL_KEYS = ("req", "kind", "msg")


def _refusal(event: dict[str, Any]) -> tuple[str, str, str, dict[str, Any]] | None:
    """(req, kind, msg, detail) of an error event that refuses a request, else None."""
    if event["r"] not in (BRIDGE_RUN, DEVICE_RUN) or event["t"] != "error":
        return None
    d = event["d"]
    req, kind, msg = d.get("req"), d.get("kind"), d.get("msg")
    if not isinstance(req, str) or not isinstance(kind, str):
        return None
    detail = {k: v for k, v in d.items() if k not in _REFUSAL_KEYS}
    return req, kind, msg if isinstance(msg, str) else "", detail


def _bridge_presence(payload: bytes | bytearray, retained: bool) -> Presence | None:
    """The bridge's presence from its `P/b/status` payload `{st, id, boot, at?}`.

    Since when: its `at` (Unix ms, on the offline status of a clean stop), else the time
    it arrives when the broker sends it live; a retained copy without `at` (a last will
    published before this client connected) says no time."""
    try:
        obj = decode(payload, HOST_LIMITS)
    except WireError:
        return None
    if not isinstance(obj, dict) or obj.get("st") not in ("online", "offline"):
        return None
    now = time.time()
    at = obj.get("at")
    if isinstance(at, int) and not isinstance(at, bool) and at > 0:
        return Presence(obj["st"], at / 1000, now)
    return Presence(obj["st"], None if retained else now, now)


class HostClient:
    """One MQTT connection for one tenant's host stream.

    `on_event(envelope, snapshot)` is called (on paho's network thread) for every event
    applied, in id order per run, with a copy of the snapshot as of that event (when a
    hole fills, the events it held are applied, and called back, one after the other).
    An exception it raises is logged with its traceback and counted in
    `callback_errors`, and never stops the network thread.

    `token` is the session token for replay requests of devices this client only
    watches (see set_token); `replay_after_s` and `max_replay_wait_s` pace them. Its
    claims (read, not verified: the bridge and the broker decide) also say which user
    topics to subscribe to: its user's, or every user's when its role is "watch". `user`
    and `watch` say it without a token (a token's claims win); with neither, every
    user's topic is subscribed to, which under a dynamic-security broker only a watching
    MQTT user may do. The topics are chosen once, here: a request made with another
    user's token runs, but its events come on that user's topic, which this client
    reads only as a watcher.

    `tools` answers client tools by name (module docstring; on_tool adds one).

    `tls` connects over TLS (server_bridge/tls.py: a CA, and a client certificate and key
    for a broker that asks for one).

    A broker configured by server_bridge/brokerconf.py replaces `client_id` with the
    user name (client ids bound to users, PROTOCOL.md "Identity"): each HostClient that
    runs alongside another needs a host user of its own, or the two knock each other
    off the broker.
    """

    def __init__(
        self,
        host: str,
        port: int,
        tenant: str,
        username: str | None = None,
        password: str | None = None,
        prefix: str = DEFAULT_PREFIX,
        client_id: str | None = None,
        *,
        max_events: int = 10_000,
        on_event: EventCallback | None = None,
        token: str | None = None,
        replay_after_s: float = REPLAY_AFTER_S,
        max_replay_wait_s: float = MAX_REPLAY_WAIT_S,
        user: str | None = None,
        watch: bool | None = None,
        tools: ToolHandlers | None = None,
        tls: BrokerTLS | None = None,
    ) -> None:
        if not 0 < replay_after_s <= max_replay_wait_s:
            raise ValueError("need 0 < replay_after_s <= max_replay_wait_s")
        claims = peek(token) if token is not None else None
        if claims is not None:
            user = claims.get("usr") if isinstance(claims.get("usr"), str) else user
            watch = claims.get("role") == WATCH
        if user is not None:
            check_user_id(user)
        self.host = host
        self.port = port
        self.tenant = check_id(tenant, "tenant")
        self.prefix = prefix
        self.on_event: EventCallback | None = on_event
        self.malformed = 0
        self.callback_errors = 0
        self._events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._reducers: dict[str, Reducer] = {}
        # req id -> (kind, msg) of the refusal that named it. Kept apart from the
        # reducers: it must survive a bridge restart, after which `_b` ids begin at 1
        # again and the reducer would skip them as already seen.
        self._refused: OrderedDict[str, tuple[str, str, dict[str, Any]]] = OrderedDict()
        # The bridge's presence from P/b/status (None until one arrives; none arrives
        # from a broker no bridge ever used).
        self._bridge: Presence | None = None
        # Session tokens for replay requests: per device (the last used in request()),
        # and one for any other device.
        self._tokens: dict[str, str] = {}
        self._token = token
        self._no_token: set[str] = set()  # devices already logged as having none
        # Requests sent whose run.started (or refusal) has not come yet: req id ->
        # (device, its token). After a reconnect each is asked for by its id, since its
        # run may have started, and gone by, while this client was away.
        self._pending: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self.replay_after_s = replay_after_s
        self.max_replay_wait_s = max_replay_wait_s
        # (device, run) -> its hole's repair; at most one per run the reducers keep.
        self._repairs: dict[tuple[str, str], _Repair] = {}
        self._stop = threading.Event()
        self._repairer: threading.Thread | None = None
        self._cond = threading.Condition()
        # The requests wait_for() is waiting on (how many waits each): an event wakes
        # the waiters only when it is about one of them, not at every event of every run.
        self._waiting: dict[str, int] = {}
        self._connected = False
        self._connect_error: str | None = None
        # Whether _connect_error is the broker's CONNACK refusal (BrokerRefused).
        self._connect_refused = False
        self._subscribed = False
        self._sub_mid: int | None = None
        # SUBACKs read while _subscribe() had not kept its mid yet: mid -> reason codes.
        self._early_subacks: dict[int, Any] = {}
        # Once connect() has been subscribed, the repair thread makes the subscription of
        # a later connection again when it is refused or unanswered (_sub_due, monotonic),
        # with the next wait after a refusal in _sub_wait.
        self._ever_subscribed = False
        self._sub_due: float | None = None
        self._sub_wait = SUBSCRIBE_RETRY_S
        # paho's client, whose queue the thread that publishes writes itself
        # (server_bridge/mqttclient.py): a request leaves when request() sends it, not
        # when paho's network thread is next woken and scheduled.
        self._client = Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id or f"wren-host-{uuid.uuid4().hex[:12]}",
            protocol=mqtt.MQTTv311,
        )
        self._username = username
        if username is not None:
            self._client.username_pw_set(username, password)
        if tls is not None:
            tls.apply(self._client)
        self._client.on_socket_open = no_delay
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.on_subscribe = self._on_subscribe
        self._client.on_message = self._on_message
        # The device topics (each device's stream "_", the bridge's presence reports),
        # and the user topics this client reads: all of them for a watcher, else its
        # user's (PROTOCOL.md "Who sees what").
        self.user = user
        self.watch = bool(watch) or user is None
        mine = "+" if self.watch else user
        self._evt_filters = [
            f"{prefix}/h/{self.tenant}/+/evt",
            f"{prefix}/h/{self.tenant}/+/u/{mine}/evt",
        ]
        self._status_topic = bridge_topic(prefix)
        self._started = False
        self.tools: ToolHandlers | None = None
        self._runner: ToolRunner | None = None
        if tools is not None:
            self._use_tools(tools)

    # --- connection ---------------------------------------------------------------

    def connect(self, timeout: float = 10) -> None:
        """Connect and subscribe; returns once the subscription is acknowledged, so no
        event published after this returns is missed, and the bridge's retained status
        (if any) has been read (bridge_presence()). Raises HostConnectError."""
        deadline = time.monotonic() + timeout
        if self._runner is not None:
            self._runner.reopen()  # closed by an earlier close()
        self._client.connect_timeout = timeout
        try:
            self._client.connect(self.host, self.port, keepalive=30)
        except OSError as e:
            raise HostConnectError(
                f"could not reach the MQTT broker at {self.host}:{self.port}: {e}"
            ) from e
        self._client.loop_start()
        self._started = True
        if self._repairer is None:
            self._stop.clear()
            self._repairer = threading.Thread(
                target=self._repair_loop, name="wren-host-repair", daemon=True
            )
            self._repairer.start()
        with self._cond:
            while not self._subscribed and self._connect_error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            error, ok, refused = self._connect_error, self._subscribed, self._connect_refused
        if not ok:
            self.close()
            if refused and error is not None:
                raise BrokerRefused(error)
            raise HostConnectError(
                error
                or f"no CONNACK/SUBACK from the MQTT broker at {self.host}:{self.port} "
                f"within {timeout}s"
            )

    def close(self) -> None:
        self._stop.set()
        if self._runner is not None:
            # First, while the connection is up: an answer being sent gets its try.
            self._runner.close()
        repairer, self._repairer = self._repairer, None
        if repairer is not None:
            repairer.join(timeout=5)
        if self._started:
            self._client.disconnect()
            self._client.loop_stop()
            self._started = False

    def __enter__(self) -> HostClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def connected(self) -> bool:
        """Connected and subscribed (on this connection: after a reconnect, once its
        subscription is acknowledged): what request() needs to send anything."""
        return self._ready()

    def _ready(self) -> bool:
        """Connected and subscribed on this connection: what is published now is sent
        now, and the events it brings are read."""
        with self._cond:
            return self._connected and self._subscribed

    def _on_connect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        if reason_code.is_failure:
            with self._cond:
                self._connect_error = connack_refusal(
                    f"{self.host}:{self.port}", self._username, reason_code
                )
                self._connect_refused = True
                self._cond.notify_all()
            # Do not retry with credentials the broker has refused.
            client.disconnect()
            return
        with self._cond:
            self._connected = True
        # Subscribe here, not in connect(): after an automatic reconnect the session is
        # clean and the subscription must be made again.
        self._subscribe(client)

    def _subscribe(self, client: mqtt.Client) -> None:
        """Make this connection's subscriptions (paho's network thread, or the repair
        thread making a refused or unanswered one again). The bridge's status first, on
        its own: the broker sends a subscription's retained messages after its SUBACK and
        handles a client's packets in order, so by the events' SUBACK (what connect()
        waits for) the bridge's retained status has arrived."""
        with self._cond:
            # Until subscribe() returns the mid: from the repair thread the SUBACK may be
            # read first (paho writes the SUBSCRIBE at once), and then waits here.
            self._sub_mid = None
            self._early_subacks.clear()
        client.subscribe(self._status_topic, qos=1)
        _, mid = client.subscribe([(f, 1) for f in self._evt_filters])
        with self._cond:
            self._sub_mid = mid
            self._sub_due = time.monotonic() + SUBACK_WAIT_S
            early = self._early_subacks.pop(mid, None) if mid is not None else None
            self._early_subacks.clear()
        if mid is not None and early is not None:
            self._on_subscribe(client, None, mid, early, None)

    def _on_subscribe(
        self, client: mqtt.Client, userdata: Any, mid: int, reason_codes: Any, properties: Any
    ) -> None:
        asks: list[tuple[str, str, int, str | None]] = []
        with self._cond:
            if mid != self._sub_mid:
                if self._sub_mid is None and len(self._early_subacks) < 4:
                    self._early_subacks[mid] = reason_codes  # read before its mid was kept
                return  # the bridge's status: hosts may read it (PROTOCOL "Broker ACL")
            again: float | None = None
            if any(rc.is_failure for rc in reason_codes):
                refused = [
                    f
                    for f, rc in zip(self._evt_filters, reason_codes, strict=False)
                    if rc.is_failure
                ]
                self._connect_error = (
                    f"the MQTT broker refused the subscription to {', '.join(refused)} "
                    "(check this user's ACL: a host user bound to one end user reads that "
                    "user's topic only; give HostClient its token or user)"
                )
                if self._ever_subscribed:
                    # A reconnect's: nobody waits on connect() to say so, and without
                    # the subscription nothing reaches this client. Made again later.
                    again = self._sub_wait
                    self._sub_due = time.monotonic() + again
                    self._sub_wait = min(again * 2, MAX_SUBSCRIBE_RETRY_S)
                else:
                    self._sub_due = None  # connect() says it and gives up
            else:
                self._subscribed = True
                self._ever_subscribed = True
                self._sub_due = None
                self._sub_wait = SUBSCRIBE_RETRY_S
                if not self._connect_refused:
                    self._connect_error = None
                # Subscribed again after a (re)connect: what was published while this
                # client was away is lost (its session is clean), so every run not yet
                # finished is asked for again; the answers come on the subscription.
                asks = [
                    (device, snap.run, snap.last_id, None)
                    for device, reducer in self._reducers.items()
                    for snap in reducer.runs()
                    if snap.run not in STREAMS and not snap.terminal
                ]
                # So is every request whose run has not been seen to start, by its id:
                # a run that started while this client was away, and ended before it was
                # subscribed again, is one it knows no id of (the bridge answers with
                # the run that request started, or unknown_run before it has started,
                # and then its events come on the subscription made now).
                asks += [(device, req, 0, token) for req, (device, token) in self._pending.items()]
            self._cond.notify_all()
            error = self._connect_error
        if again is not None:
            log.warning("host client: %s; subscribing again in %.0f s", error, again)
        for ask in asks:
            self._ask_replay(*ask)

    def _on_disconnect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        with self._cond:
            self._connected = False
            # Subscribed again only by the next connection's SUBACK: until then nothing
            # is published (_publish), and connect() waits for it as at the start.
            self._subscribed = False
            self._sub_due = None
            self._cond.notify_all()
        if reason_code is not None and getattr(reason_code, "is_failure", False):
            log.warning(
                "host client disconnected from %s:%s: %s", self.host, self.port, reason_code
            )

    # --- requests -----------------------------------------------------------------

    def request(
        self,
        device: str,
        token: str,
        text: str,
        conv: str | None = None,
        req: str | None = None,
        ttl: int | None = None,
        *,
        timeout: float = 10,
    ) -> str:
        """Ask `device` to start a run with the user text `text`; returns the req id
        (the idempotency key: publishing the same req twice starts one run) once the
        broker has acknowledged it.

        What a failure means, so that a caller never retries into a second run:
        NotConnected (raised before anything is handed to the connection): nothing
        was sent, and nothing will be; sending it again is safe. Unacknowledged (a
        TimeoutError; `e.req` is the id): it was handed over and may run, now or when
        the connection is back; send it again only with `req=e.req` (a repeat starts
        nothing), and wait_run(e.req) sees its run if it comes."""
        topic = host_topic(self.prefix, self.tenant, device, "req")
        req_id = req or uuid.uuid4().hex
        body: dict[str, Any] = {"req": req_id, "input": text, "tok": token}
        # Absent rather than nil: an optional key the caller did not give is not sent.
        if conv is not None:
            body["conv"] = conv
        if ttl is not None:
            body["ttl"] = ttl
        with self._cond:
            # A new attempt (a resend with a fresh token, say, after a refusal): only a
            # refusal of this attempt may end a wait on it.
            self._refused.pop(req_id, None)
            self._tokens[device] = token  # for replays of this device's runs
            # Before it is sent: its run.started may come before the acknowledgement.
            self._pending[req_id] = (device, token)
            self._pending.move_to_end(req_id)
            while len(self._pending) > MAX_PENDING:
                self._pending.popitem(last=False)
        try:
            # Written by this thread's flush, without waking paho's network thread for it.
            self._publish(topic, body, f"request {req_id}", timeout, req_id, quiet=True)
        except HostConnectError:
            with self._cond:  # not sent (NotConnected, paho's queue full): no run comes
                self._pending.pop(req_id, None)
            raise
        return req_id

    def answer(
        self,
        device: str,
        token: str,
        run: str,
        call: str,
        output: str,
        failed: bool = False,
        *,
        timeout: float = 10,
    ) -> None:
        """Answer a client tool call a paused run waits on (PROTOCOL "Runs that pause")."""
        body = {"op": "tool", "r": run, "call": call, "output": output, "failed": failed}
        self._ctl(device, token, body, timeout)

    def approve(
        self, device: str, token: str, run: str, call: str, ok: bool, *, timeout: float = 10
    ) -> None:
        """Grant (`ok`) or deny a call that waits for approval. Who approved is the
        token's user: the bridge sets it, nothing sent here can."""
        self._ctl(device, token, {"op": "approve", "r": run, "call": call, "ok": ok}, timeout)

    def cancel(
        self, device: str, token: str, run: str, reason: str | None = None, *, timeout: float = 10
    ) -> None:
        """Cancel a running or paused run; it ends `run.cancelled`."""
        body: dict[str, Any] = {"op": "cancel", "r": run}
        if reason is not None:
            body["reason"] = reason
        self._ctl(device, token, body, timeout)

    def cancel_request(
        self, device: str, token: str, req: str, reason: str | None = None, *, timeout: float = 5
    ) -> RunSnapshot:
        """Cancel request `req` and wait, `timeout` in all, for it to end; returns a copy
        of its run's snapshot: `cancelled`, or how it ended before the cancel reached it.

        A request whose run has started (its `run.started` is here) is cancelled by its
        run; one with no run yet by its id (PROTOCOL.md "Requests and control"): the
        board cancels its run if it has one, takes it out of its queue, or starts
        nothing when it comes, and says so. RequestRefused: no run starts for it (kind
        `cancelled`: this cancel took it before its run started; another kind: it was
        refused before). NotConnected / Unacknowledged: the cancel was not sent / not
        acknowledged. TimeoutError: no end within `timeout` (an offline board answers
        when it is back)."""
        deadline = time.monotonic() + timeout
        try:
            snap: RunSnapshot | None = self.wait_for(req, lambda _snap: True, 0)
        except TimeoutError:
            snap = None
        if snap is not None and snap.terminal:
            return snap
        # The broker's acknowledgement gets a second even past the deadline: a cancel
        # that was sent is not to read as one that may not have been.
        left = max(deadline - time.monotonic(), 1.0)
        if snap is not None:
            self.cancel(device, token, snap.run, reason, timeout=left)
        else:
            body: dict[str, Any] = {"op": "cancel", "req": req}
            if reason:
                body["reason"] = reason
            self._ctl(device, token, body, left)
        return self.wait_run(req, max(deadline - time.monotonic(), 0))

    # --- client tools -------------------------------------------------------------

    def on_tool(self, name: str, fn: Handler) -> None:
        """Answer the client tool `name` with `fn` (sync or async; see tools.py): each
        of its pending calls, in the runs this client sees, from now on."""
        if self.tools is None:
            self._use_tools(ToolHandlers())
        assert self.tools is not None
        self.tools.add(name, fn)
        # Calls already waiting are offered now, not at their run's next event (a
        # paused run has none until it is answered).
        with self._cond:
            offers = [
                offer
                for device, reducer in self._reducers.items()
                for snap in reducer.runs()
                if (offer := offer_of(device, snap, self.tools)) is not None and not offer.ended
            ]
        for offer in offers:
            self._take(offer)

    def deliveries(self, run: str, device: str | None = None) -> dict[str, Delivery]:
        """How the answers of this client's tool handlers to `run`'s calls are getting
        to the board: call id -> pending, submitting, submitted, failed or cancelled
        (tools.py). Calls of tools it has no handler for are not in it: they wait for
        whoever answers them (answer())."""
        if self._runner is None:
            return {}
        for dev, r in self._runner.runs():
            if r == run and (device is None or dev == device):
                return self._runner.deliveries(dev, run)
        return {}

    def _use_tools(self, tools: ToolHandlers) -> None:
        self.tools = tools
        self._runner = ToolRunner(
            tools,
            self._send_answer,
            retryable=lambda e: isinstance(e, (NotConnected, Unacknowledged)),
            on_state=self._mirror_delivery,
            name="wren-host-tool",
        )

    def _tool_offers(
        self, device: str, reducer: Reducer, event: dict[str, Any], snap: RunSnapshot
    ) -> list[ToolOffer]:
        """What the runner is to see of an event: its run's snapshot, and the run a
        bridge's answer on `_b` names (a gap it declared may end that run). Every time,
        a repeat included: the runner takes a call once, and takes again one it refused
        for want of room. Called under the lock."""
        assert self.tools is not None
        snaps = [snap]
        named = event["d"].get("r")
        if event["r"] == BRIDGE_RUN and isinstance(named, str):
            other = reducer.get(named)
            if other is not None:
                snaps.append(other)
        return [o for s in snaps if (o := offer_of(device, s, self.tools)) is not None]

    def _take(self, offer: ToolOffer) -> None:
        if self._runner is not None:
            self._runner.take(offer)  # never waits: the handlers run elsewhere

    def _send_answer(self, device: str, run: str, call: str, output: str, failed: bool) -> None:
        """A tool handler's answer, on a runner's worker: with the device's session
        token (the last used in request() for it, else the constructor's)."""
        with self._cond:
            token = self._tokens.get(device, self._token)
        if token is None:
            raise ValueError(f"no session token for device {device}: give one with set_token")
        self.answer(device, token, run, call, output, failed)

    def _mirror_delivery(self, device: str, run: str, call: str) -> None:
        """The runner's word on a call into its run's snapshot (Row.delivery). Reads the
        state now, under the lock, so whichever thread mirrors last mirrors the latest."""
        runner = self._runner
        if runner is None:
            return
        with self._cond:
            state = runner.state(device, run, call)
            reducer = self._reducers.get(device)
            if state is not None and reducer is not None:
                reducer.set_delivery(run, call, state)
                if self._waiting:
                    self._cond.notify_all()  # a wait_for may be waiting on the delivery

    def _ctl(self, device: str, token: str, body: dict[str, Any], timeout: float) -> None:
        topic = host_topic(self.prefix, self.tenant, device, "ctl")
        self._publish(topic, {**body, "tok": token}, f"ctl {body['op']}", timeout)

    def _publish(
        self,
        topic: str,
        body: dict[str, Any],
        what: str,
        timeout: float,
        req: str | None = None,
        *,
        quiet: bool = False,
    ) -> None:
        """Publish `body` at QoS 1 and wait for the broker's acknowledgement. Raises
        NotConnected, having handed nothing to paho, unless connected and subscribed;
        Unacknowledged when it was handed over but not acknowledged within `timeout`.

        Refused rather than queued while disconnected: paho keeps a QoS 1 message it
        cannot send and sends it after reconnecting, whenever that is, so a request
        "not sent" used to run later all the same, and a caller that retried got two
        runs. A request that runs minutes after its caller gave up is what the bridge
        will not do either (a device offline past its grace, PROTOCOL.md "Presence at
        the host"): a caller that wants it sent later sends it again then. What paho
        took stays at least once: the connection may drop with it unacknowledged, and
        paho sends it again (DUP) on the next connection; Unacknowledged says so."""
        if not self._ready():
            raise NotConnected(
                f"{what} not sent: not connected to the MQTT broker at {self.host}:{self.port}"
            )
        payload = encode(body)
        if quiet:
            info = self._client.publish_quiet(topic, payload, qos=1)
            self._client.flush()
        else:
            info = self._client.publish(topic, payload, qos=1)
        if info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN:
            # The connection went between the check above and the publish: paho keeps
            # the message and sends it when it is back (paho's info then never reads
            # as published, so it is not waited on).
            why = "the connection dropped as it was sent; it goes when the connection is back"
            raise Unacknowledged(what, why, req)
        if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            # Not kept by paho (its queue is full): not sent at all.
            raise HostConnectError(f"{what} not sent: {mqtt.error_string(info.rc)}")
        info.wait_for_publish(timeout)
        if not info.is_published():
            why = (
                f"no acknowledgement from the broker within {timeout}s (it may have "
                "arrived, or it goes again when the connection is back)"
            )
            raise Unacknowledged(what, why, req)

    # --- events -------------------------------------------------------------------

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        # Everything is caught here: an exception escaping a paho callback would stop
        # the network thread, and with it every later event.
        try:
            self._handle(msg.topic, msg.payload, bool(msg.retain))
        except Exception:
            log.exception("host client: unexpected error handling a message on %s", msg.topic)

    def _handle(self, topic_name: str, payload: bytes | bytearray, retained: bool = False) -> None:
        if topic_name == self._status_topic:
            presence = _bridge_presence(payload, retained)
            if presence is None:
                self._count_malformed(topic_name, BadEnvelope("not a bridge status"))
                return
            with self._cond:
                self._bridge = presence
                self._cond.notify_all()
            return
        try:
            topic = parse(self.prefix, topic_name)
            if topic.side != "h" or topic.leaf != "evt" or topic.tenant != self.tenant:
                raise BadTopic(f"not this tenant's evt topic: {topic_name!r}")
            events = decode_events(payload)
        except (BadTopic, WireError) as e:
            self._count_malformed(topic_name, e)
            return
        for event in events:
            # (event, copy of its run's snapshot as of it) for each event applied.
            views: list[tuple[dict[str, Any], RunSnapshot]] = []
            again: tuple[str, str, int] | None = None
            offers: list[ToolOffer] = []
            with self._cond:
                refusal = _refusal(event)
                if refusal is not None:
                    req, kind, msg, detail = refusal
                    self._pending.pop(req, None)
                    self._refused[req] = (kind, msg, detail)
                    self._refused.move_to_end(req)
                    while len(self._refused) > MAX_REFUSALS:
                        self._refused.popitem(last=False)
                reducer = self._reducers.get(topic.device)
                if reducer is None:
                    reducer = self._reducers[topic.device] = Reducer(topic.device)
                # Copies for the callback, taken under the lock, so they are consistent.
                on_apply: OnApply | None = None
                if self.on_event is not None:
                    on_apply = functools.partial(_keep_copy, views)
                # Checked by decode_events already, so fold() cannot refuse it.
                snap, _ = reducer.fold(event, on_apply)
                if snap.req is not None and self._pending:
                    self._pending.pop(snap.req, None)  # its run has started
                self._events.append(event)
                self._track(topic.device, snap)
                if event["r"] == BRIDGE_RUN and event["t"] == "error":
                    # Read on arrival, not through the reducer's repeat check: the
                    # bridge's stream starts again at 1 when it restarts.
                    again = self._bridge_answer(topic.device, reducer, event["d"], on_apply)
                if self.tools is not None:
                    offers = self._tool_offers(topic.device, reducer, event, snap)
                if self._waiting and (snap.req in self._waiting or event["r"] in STREAMS):
                    # What a wait reads is its own run's snapshot and its refusals, which
                    # come on the streams (as do the bridge's gap answers, which may end
                    # a run): woken for those only. At every event, a waiting thread took
                    # the interpreter's lock from this one, which in a host process that
                    # serves more than this client (the benchmark's model server) is
                    # what that work waited for.
                    self._cond.notify_all()
            if again is not None:
                self._ask_replay(*again)  # the rest of a replay cut short (replay_cut)
            for offer in offers:
                self._take(offer)
            for applied, view in views:
                callback = self.on_event
                if callback is None:
                    break
                try:
                    callback(applied, view)
                except Exception:
                    with self._cond:
                        self.callback_errors += 1
                    log.exception("host client: on_event callback raised")

    def _bridge_answer(
        self, device: str, reducer: Reducer, d: dict[str, Any], on_apply: OnApply | None
    ) -> tuple[str, str, int] | None:
        """The bridge's answer to a replay, on its stream `_b`: ids it no longer holds
        (`gap`), a run it does not know (`unknown_run`), or a replay it cut at its cap
        (`replay_cut`: returned, the replay to ask for next, after the lock is let go).
        Called under the lock."""
        run = d.get("r")
        if not isinstance(run, str) or run in STREAMS:
            return None
        kind = d.get("kind")
        snap = reducer.get(run)
        after = d.get("after")
        if kind == "replay_cut" and isinstance(after, int) and after >= 0:
            return (device, run, after)
        if kind == "gap":
            # from/to are ints 1 <= from <= to: decode_events checked the gap report.
            reducer.mark_lost(run, d["from"], d["to"], on_apply)
        elif kind == "unknown_run" and snap is not None and snap.held and not snap.terminal:
            # Nothing will ever fill the hole below what this run holds.
            reducer.mark_lost(run, snap.last_id + 1, snap.held[-1] - 1, on_apply)
        else:
            return None
        if snap is not None:
            self._track(device, snap)
        return None

    # --- replay -------------------------------------------------------------------

    def set_token(self, token: str | None, device: str | None = None) -> None:
        """The session token for replay requests: of `device`, or (device None) of any
        device without one of its own. request() sets its device's token too."""
        with self._cond:
            if device is None:
                self._token = token
            elif token is None:
                self._tokens.pop(device, None)
            else:
                self._tokens[device] = token
            self._no_token.clear()

    def _track(self, device: str, snap: RunSnapshot) -> None:
        """Note whether `snap` waits on a hole, and since when. Called under the lock."""
        key = (device, snap.run)
        if snap.run in STREAMS or snap.terminal or not snap.held:
            self._repairs.pop(key, None)
            return
        repair = self._repairs.get(key)
        if repair is None or repair.last_id != snap.last_id:
            # A new hole, or progress on the old one: wait again before asking.
            now = time.monotonic()
            self._repairs[key] = _Repair(
                snap.last_id, now + self.replay_after_s, self.replay_after_s
            )

    def _repair_loop(self) -> None:
        tick = min(_REPAIR_TICK_S, self.replay_after_s)
        while not self._stop.is_set():
            asks: list[tuple[str, str, int]] = []
            with self._cond:
                now = time.monotonic()
                resubscribe = (
                    self._ever_subscribed
                    and self._connected
                    and not self._subscribed
                    and self._sub_due is not None
                    and self._sub_due <= now
                )
                if resubscribe:
                    self._sub_due = None  # set again by _subscribe
                for key, repair in list(self._repairs.items()):
                    reducer = self._reducers.get(key[0])
                    snap = reducer.get(key[1]) if reducer is not None else None
                    if snap is None or snap.terminal or not snap.held:
                        del self._repairs[key]  # filled, finished or forgotten
                    elif repair.due <= now:
                        asks.append((key[0], key[1], snap.last_id))
                        repair.asked += 1
                        repair.due = now + repair.wait
                        repair.wait = min(repair.wait * 2, self.max_replay_wait_s)
                due = min((r.due for r in self._repairs.values()), default=now + tick)
            if resubscribe:
                self._subscribe(self._client)
            for ask in asks:
                self._ask_replay(*ask)
            self._stop.wait(min(max(due - time.monotonic(), 0.01), tick))

    def replay(self, device: str, run: str, after: int = 0) -> None:
        """Ask the bridge for a run's events past `after`: from its window, or from its
        event log for a run it no longer holds in memory (an hour ago, before its
        restart). They come like live ones and fold into the run's snapshot; wait for
        it with wait_for / wait_run (by the run's request id) or read runs(). A reply
        the bridge cut at its cap is asked on by itself. Not waited for: sent when
        connected (with the device's token, set_token), else not sent and logged."""
        self._ask_replay(device, run, after)

    def _ask_replay(self, device: str, run: str, after: int, token: str | None = None) -> None:
        """Publish a replay request for `run` past `after` (with `token`, else the
        device's). Never under the lock, and never waits: it may run on paho's network
        thread."""
        with self._cond:
            token = token or self._tokens.get(device, self._token)
            warn = token is None and device not in self._no_token
            if warn:
                self._no_token.add(device)
        if token is None:
            if warn:
                log.warning(
                    "host client: no session token for device %s, so run %s cannot be "
                    "replayed (give one with set_token)",
                    device,
                    run,
                )
            return
        body = {"op": "replay", "r": run, "after": after, "tok": token}
        topic = host_topic(self.prefix, self.tenant, device, "ctl")
        if not self._ready():
            # Not handed to paho, which would send it after the reconnect, next to the
            # reconnect's own asks: the (re)connect asks for every open run anyway.
            log.info("host client: replay request for %s/%s not sent: not connected", device, run)
            return
        # Not waited for: an ask the connection loses is asked again (the repair loop's
        # next turn, the next connection's).
        self._client.publish(topic, encode(body), qos=1)

    def _count_malformed(self, topic_name: str, err: Exception) -> None:
        with self._cond:
            self.malformed += 1
        log.warning("host client: dropped a malformed event on %s: %s", topic_name, err)

    def bridge_presence(self) -> Presence | None:
        """The bridge's presence from its status on `P/b/status`; None before any came
        (no bridge has used this broker, or its retained status was cleared)."""
        with self._cond:
            return self._bridge

    def device_presence(self, device: str) -> Presence | None:
        """The device's presence as the bridge last told it on `_b` (a `presence`
        event, or a request refused `device_offline`); None when it has not, or since an
        event of one of its runs showed it back."""
        with self._cond:
            reducer = self._reducers.get(device)
            return reducer.presence if reducer is not None else None

    @property
    def events(self) -> list[dict[str, Any]]:
        """The envelopes received (the last `max_events` of them), oldest first."""
        with self._cond:
            return list(self._events)

    def runs(self, device: str | None = None) -> list[RunSnapshot]:
        """Copies of the snapshots of every run seen (of one device, if given)."""
        with self._cond:
            if device is None:
                reducers = list(self._reducers.values())
            else:
                reducers = [self._reducers[device]] if device in self._reducers else []
            return [s.copy() for r in reducers for s in r.runs()]

    def find_run(self, req_id: str) -> RunSnapshot | None:
        """A copy of the snapshot of the run started for request `req_id`, if seen."""
        with self._cond:
            snap = self._find(req_id)
            return snap.copy() if snap is not None else None

    def _find(self, req_id: str) -> RunSnapshot | None:
        for reducer in self._reducers.values():
            for snap in reducer.runs():
                if snap.req == req_id:
                    return snap
        return None

    def wait_run(self, req_id: str, timeout: float) -> RunSnapshot:
        """Wait until the run started for `req_id` is done, failed or cancelled — its
        terminal event applied, so every id below it is there or declared lost — and
        return a copy of its snapshot (`complete` False when some were lost). Raises
        RequestRefused as soon as the bridge or the board refuses the request,
        TimeoutError (describing what was seen, held and missing) past `timeout`."""
        return self.wait_for(req_id, lambda snap: snap.terminal, timeout)

    def wait_for(
        self, req_id: str, until: Callable[[RunSnapshot], bool], timeout: float
    ) -> RunSnapshot:
        """Wait until the run started for `req_id` satisfies `until` (called under the
        client's lock, with the live snapshot: keep it quick, do not keep the snapshot);
        return a copy. Raises RequestRefused when the request was refused and no run
        started for it, TimeoutError describing what was seen past `timeout`. Useful to
        wait for a pause on a client tool, say."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._waiting[req_id] = self._waiting.get(req_id, 0) + 1
            try:
                while True:
                    snap = self._find(req_id)
                    if snap is not None and until(snap):
                        return snap.copy()
                    refused = self._refused.get(req_id)
                    if snap is None and refused is not None:
                        # Only while no run exists: a refusal of a repeat of a request
                        # that did start a run (a resend with a stale token) does not end
                        # that run.
                        raise RequestRefused(*refused[:2], req_id, refused[2])
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(self._describe_wait(req_id, snap, timeout))
                    self._cond.wait(left)
            finally:
                if self._waiting[req_id] > 1:
                    self._waiting[req_id] -= 1
                else:
                    del self._waiting[req_id]

    def _describe_wait(self, req_id: str, snap: RunSnapshot | None, timeout: float) -> str:
        if snap is not None:
            holes = ""
            if snap.held:
                repair = self._repairs.get((snap.device or "", snap.run))
                asked = repair.asked if repair is not None else 0
                holes += (
                    f", ids {_ids_text(snap.held)} held waiting on ids "
                    f"{snap.last_id + 1}..{snap.held[0] - 1}"
                    f" (replay asked {asked} times)"
                )
            if snap.gaps:
                missing = ", ".join(f"{lo}..{hi}" for lo, hi in snap.gaps)
                holes += f", events {missing} missing"
            return (
                f"run {snap.run} for request {req_id} is still {snap.status} after "
                f"{timeout}s (last event id {snap.last_id}{holes}, {len(snap.rows)} rows, "
                f"pending client tools: {sorted(snap.pending) or 'none'})"
            )
        seen = sorted({f"{d}/{s.run}" for d, r in self._reducers.items() for s in r.runs()})
        # Errors that belong to no run are usually why a run never started: the bridge's
        # refusals of host input come on its stream "_b" (those naming this req have
        # raised RequestRefused already; these name another req or none), the board's
        # refusals (busy, bad input) on its device stream "_".
        refusals = [
            f"{d}/{run}: {e.get('kind')}: {e.get('msg')}"
            for d, r in self._reducers.items()
            for run in (BRIDGE_RUN, DEVICE_RUN)
            if (stream := r.get(run)) is not None
            for e in stream.errors[-5:]
        ]
        return (
            f"no run started for request {req_id} within {timeout}s "
            f"(connected: {self._connected}; {len(self._events)} events received from "
            f"runs {seen or 'none'}; {self.malformed} malformed"
            + (f"; errors outside runs: {refusals}" if refusals else "")
            + ")"
        )
