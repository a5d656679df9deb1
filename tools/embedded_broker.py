"""A small MQTT 3.1.1 broker in Python, for `wren demo` when Mosquitto is not installed.

It serves what Wren uses and no more: CONNECT with an optional user/password table,
SUBSCRIBE/UNSUBSCRIBE with `+` and `#` wildcards, PUBLISH at QoS 0 and 1 (PUBACK),
retained messages, the last will on an abnormal disconnect, keepalive, PINGREQ and
DISCONNECT, and an optional ACL callback `acl(user, topic, write) -> bool`.

Deliberate limits (it is a demo broker, not a production one):
- every session is clean: `clean session = 0` is accepted but nothing is kept for an
  absent client, and CONNACK always says "no session present";
- QoS 2 is not supported: a QoS 2 PUBLISH closes the connection, and a QoS 2
  subscription is granted as QoS 1;
- QoS 1 messages to subscribers are sent once (TCP carries them; with no persistent
  sessions a retransmission could only go to the same connection);
- the read side of the ACL is checked per delivered message, the write side per
  PUBLISH (a refused QoS 1 PUBLISH is still acknowledged, as Mosquitto does, and
  dropped).

Packet encoding and decoding come from `edge_runtime/mqtt.py`, the board's own MQTT
code, which runs unchanged on CPython; the broker-only parsers (CONNECT, SUBSCRIBE,
UNSUBSCRIBE) are here because the board never needs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edge_runtime import mqtt

log = logging.getLogger("wren.broker")

Acl = Callable[[str | None, str, bool], bool]
"""acl(user, topic, write): may `user` (None when anonymous) publish (write=True) to
or receive (write=False) messages on `topic`?"""

MAX_PACKET = 1 << 20  # the same limit tools/broker.py gives Mosquitto
CONNECT_TIMEOUT_S = 10.0  # a client that opens a socket has this long to say CONNECT
SLOW_CLIENT_BYTES = 4 << 20  # unsent bytes past which a subscriber is disconnected
_ID_COUNTER = itertools.count(1)

# CONNACK return codes (MQTT 3.1.1, 3.2.2.3).
ACCEPTED = 0
REFUSED_PROTOCOL = 1
REFUSED_IDENTIFIER = 2
REFUSED_CREDENTIALS = 4
REFUSED_NOT_AUTHORIZED = 5
SUBACK_FAILURE = 0x80
REFUSALS = (
    "accepted",
    "bad protocol version",
    "identifier rejected",
    "server unavailable",
    "bad user name or password",
    "not authorized",
)
# Packet types only a broker reads or sends (edge_runtime/mqtt.py names those a client
# needs: on a board each name costs heap).
CONNECT = 1
UNSUBSCRIBE = 10
UNSUBACK = 11
PINGREQ = 12
DISCONNECT = 14


class BrokerStartError(RuntimeError):
    """The broker could not listen on the requested address."""


# --- broker-side packet parsing -------------------------------------------------------


@dataclass
class ConnectRequest:
    client_id: str
    clean: bool
    keepalive: int
    will: tuple[str, bytes, int, bool] | None
    user: str | None
    password: bytes | None


def parse_connect(body: bytes) -> ConnectRequest:
    """Decode a CONNECT body (3.1). A protocol level other than 4 raises
    mqtt.ConnectRefused(1) so the caller can answer CONNACK 1 before closing."""
    name, off = mqtt.read_bytes(body, 0)
    if name != b"MQTT":
        raise mqtt.MalformedPacket("protocol name is not MQTT")
    if off + 4 > len(body):
        raise mqtt.MalformedPacket("CONNECT header truncated")
    level, flags = body[off], body[off + 1]
    keepalive = body[off + 2] << 8 | body[off + 3]
    off += 4
    if level != 4:
        raise mqtt.ConnectRefused(REFUSED_PROTOCOL)
    if flags & 0x01:
        raise mqtt.MalformedPacket("CONNECT reserved flag set")  # MQTT-3.1.2-3
    client_id, off = mqtt.read_text(body, off)
    will = None
    will_qos = flags >> 3 & 3
    if flags & 0x04:
        if will_qos == 3:
            raise mqtt.MalformedPacket("will QoS 3")
        will_topic, off = mqtt.read_text(body, off)
        will_payload, off = mqtt.read_bytes(body, off)
        will = (will_topic, bytes(will_payload), will_qos, bool(flags & 0x20))
    elif will_qos or flags & 0x20:
        raise mqtt.MalformedPacket("will QoS or retain without a will")  # MQTT-3.1.2-11
    user = None
    password = None
    if flags & 0x80:
        user, off = mqtt.read_text(body, off)
    if flags & 0x40:
        if user is None:
            raise mqtt.MalformedPacket("password without a user name")  # MQTT-3.1.2-22
        raw, off = mqtt.read_bytes(body, off)
        password = bytes(raw)
    if off != len(body):
        raise mqtt.MalformedPacket("bytes after the CONNECT payload")
    return ConnectRequest(client_id, bool(flags & 0x02), keepalive, will, user, password)


def parse_subscribe(body: bytes) -> tuple[int, list[tuple[str, int]]]:
    pid, off = mqtt.read_u16(body, 0)
    topics: list[tuple[str, int]] = []
    while off < len(body):
        topic, off = mqtt.read_text(body, off)
        if off >= len(body):
            raise mqtt.MalformedPacket("SUBSCRIBE filter without its QoS byte")
        qos = body[off]
        off += 1
        if qos > 2:
            raise mqtt.MalformedPacket("SUBSCRIBE QoS byte over 2")  # MQTT-3.8.3-4
        topics.append((topic, qos))
    if not topics:
        raise mqtt.MalformedPacket("SUBSCRIBE without a filter")  # MQTT-3.8.3-3
    return pid, topics


def parse_unsubscribe(body: bytes) -> tuple[int, list[str]]:
    pid, off = mqtt.read_u16(body, 0)
    topics: list[str] = []
    while off < len(body):
        topic, off = mqtt.read_text(body, off)
        topics.append(topic)
    if not topics:
        raise mqtt.MalformedPacket("UNSUBSCRIBE without a filter")  # MQTT-3.10.3-2
    return pid, topics


def encode_connack(session_present: bool, code: int) -> bytes:
    return bytes((mqtt.CONNACK << 4, 2, 1 if session_present else 0, code))


def encode_suback(pid: int, codes: list[int]) -> bytes:
    body = bytes((pid >> 8, pid & 0xFF, *codes))
    return bytes((mqtt.SUBACK << 4,)) + mqtt.encode_length(len(body)) + body


def encode_unsuback(pid: int) -> bytes:
    return bytes((UNSUBACK << 4, 2, pid >> 8, pid & 0xFF))


# --- topics ------------------------------------------------------------------------------


def valid_filter(topic_filter: str) -> bool:
    """4.7.1: `#` only as the whole last level, `+` only as a whole level."""
    if not topic_filter:
        return False
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            return False
        if "+" in level and level != "+":
            return False
    return True


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Does `topic` (a name, no wildcards) match `topic_filter` (4.7)?"""
    # A wildcard at the first level never matches a topic starting with $ (4.7.2).
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    f_levels = topic_filter.split("/")
    t_levels = topic.split("/")
    for i, level in enumerate(f_levels):
        if level == "#":
            return True  # this level and everything below, the parent itself included
        if i >= len(t_levels):
            return False
        if level != "+" and level != t_levels[i]:
            return False
    return len(f_levels) == len(t_levels)


# --- sessions ------------------------------------------------------------------------------


@dataclass(eq=False)
class _Session:
    client_id: str
    user: str | None
    writer: asyncio.StreamWriter
    will: tuple[str, bytes, int, bool] | None
    keepalive: int = 0
    subs: dict[str, int] = field(default_factory=dict)
    next_pid: int = 0
    closed: bool = False

    def send(self, data: bytes) -> None:
        # Never awaits: one slow subscriber must not hold up delivery to the others.
        # A subscriber that stops reading is cut off past SLOW_CLIENT_BYTES instead.
        if self.closed:
            return
        self.writer.write(data)
        if self.writer.transport.get_write_buffer_size() > SLOW_CLIENT_BYTES:
            log.warning("client %s is not reading; disconnecting it", self.client_id)
            self.abort()

    def new_pid(self) -> int:
        self.next_pid = self.next_pid % 0xFFFF + 1
        return self.next_pid

    def abort(self) -> None:
        self.closed = True
        self.writer.transport.abort()


class EmbeddedBroker:
    """An MQTT 3.1.1 broker on a background thread with its own event loop.

    >>> broker = EmbeddedBroker().start()
    >>> broker.address  # "127.0.0.1:<port>"
    >>> broker.stop()
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        users: dict[str, str] | None = None,
        acl: Acl | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.users = users
        self.acl = acl
        self._sessions: dict[str, _Session] = {}
        self._retained: dict[str, tuple[bytes, int]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # --- lifecycle ----------------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> EmbeddedBroker:
        """Listen on a background thread; returns once connections are accepted."""
        if self._thread is not None:
            raise RuntimeError("broker already started")
        self._thread = threading.Thread(target=self._thread_main, name="wren-broker", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise BrokerStartError(f"broker did not start within {timeout_s}s")
        if self._error is not None:
            self._thread.join(timeout_s)
            self._thread = None
            raise BrokerStartError(f"cannot listen on {self.address}: {self._error}")
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        loop, stopping, thread = self._loop, self._stopping, self._thread
        if thread is None:
            return
        if loop is not None and stopping is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended on its own
                loop.call_soon_threadsafe(stopping.set)
        thread.join(timeout_s)
        self._thread = None

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:  # reported to start(), which is waiting for us
            self._error = e
        finally:
            self._ready.set()
            loop.close()

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = int(server.sockets[0].getsockname()[1])
        self._ready.set()
        log.info("embedded MQTT broker listening on %s", self.address)
        await self._stopping.wait()
        server.close()
        for session in list(self._sessions.values()):
            session.abort()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 5)

    # --- one client ------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        session: _Session | None = None
        clean_exit = False
        try:
            session = await self._handshake(reader, writer)
            if session is not None:
                clean_exit = await self._serve_client(session, reader)
        except (OSError, EOFError, asyncio.TimeoutError, mqtt.MqttError) as e:
            log.debug("client %s: connection ended: %r", session.client_id if session else "?", e)
        except asyncio.CancelledError:
            clean_exit = True  # the broker is shutting down: no wills for that
            raise
        finally:
            if session is not None:
                self._end_session(session, clean_exit)
            writer.transport.abort()
            if task is not None:
                self._tasks.discard(task)

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> _Session | None:
        t, _, body = await asyncio.wait_for(
            mqtt.read_packet(reader, MAX_PACKET, mqtt.FROM_CLIENT), CONNECT_TIMEOUT_S
        )
        if t != CONNECT:
            raise mqtt.MalformedPacket("first packet is not CONNECT")  # MQTT-3.1.0-1
        try:
            req = parse_connect(body)
        except mqtt.ConnectRefused as e:
            writer.write(encode_connack(False, e.code))
            await writer.drain()
            return None
        code = self._admit(req)
        if code != ACCEPTED:
            log.info("refused client %r (user %r): %s", req.client_id, req.user, REFUSALS[code])
            writer.write(encode_connack(False, code))
            await writer.drain()
            return None
        client_id = req.client_id or f"wren-auto-{next(_ID_COUNTER)}"
        old = self._sessions.get(client_id)
        if old is not None:
            # MQTT-3.1.4-2: the older connection with this client id is dropped.
            old.abort()
        session = _Session(client_id, req.user, writer, req.will, req.keepalive)
        self._sessions[client_id] = session
        session.send(encode_connack(False, ACCEPTED))
        return session

    def _admit(self, req: ConnectRequest) -> int:
        if not req.client_id and not req.clean:
            return REFUSED_IDENTIFIER  # MQTT-3.1.3-8
        if self.users is not None:
            if req.user is None or req.password is None:
                return REFUSED_NOT_AUTHORIZED
            expected = self.users.get(req.user)
            if expected is None or not hmac.compare_digest(req.password, expected.encode()):
                return REFUSED_CREDENTIALS
        return ACCEPTED

    async def _serve_client(self, session: _Session, reader: asyncio.StreamReader) -> bool:
        # Returns True for a clean DISCONNECT (no will), raises or returns False otherwise.
        # 3.1.2.10: silence past one and a half keepalives means the client is gone.
        idle_s = session.keepalive * 1.5 if session.keepalive else None
        while True:
            t, flags, body = await asyncio.wait_for(
                mqtt.read_packet(reader, MAX_PACKET, mqtt.FROM_CLIENT), idle_s
            )
            if session.closed:
                return False
            if t == mqtt.PUBLISH:
                topic, payload, qos, retain, _, pid = mqtt.parse_publish(flags, body)
                if qos > 1:
                    raise mqtt.MalformedPacket("QoS 2 is not supported by this broker")
                if qos:
                    session.send(mqtt.encode_puback(pid))
                if self._may(session.user, topic, True):
                    self._route(topic, bytes(payload), qos, retain)
                else:
                    log.info("ACL: %r may not publish to %s", session.user, topic)
            elif t == mqtt.PUBACK:
                pass  # QoS 1 deliveries are not retransmitted, so nothing to clear
            elif t == mqtt.SUBSCRIBE:
                self._subscribe(session, body)
            elif t == UNSUBSCRIBE:
                pid, topics = parse_unsubscribe(body)
                for topic in topics:
                    session.subs.pop(topic, None)
                session.send(encode_unsuback(pid))
            elif t == PINGREQ:
                session.send(mqtt.PINGRESP_PACKET)
            elif t == DISCONNECT:
                return True
            else:
                # CONNECT twice (MQTT-3.1.0-2) or a QoS 2 flow packet.
                raise mqtt.MalformedPacket(f"unexpected {mqtt.packet_name(t)}")

    def _subscribe(self, session: _Session, body: bytes) -> None:
        pid, topics = parse_subscribe(body)
        codes: list[int] = []
        granted: list[tuple[str, int]] = []
        for topic_filter, qos in topics:
            if not valid_filter(topic_filter):
                codes.append(SUBACK_FAILURE)
                continue
            qos = min(qos, 1)
            session.subs[topic_filter] = qos
            codes.append(qos)
            granted.append((topic_filter, qos))
        session.send(encode_suback(pid, codes))
        # Retained messages follow the SUBACK, with RETAIN set (3.3.1.3).
        for topic, (payload, msg_qos) in list(self._retained.items()):
            best = max((q for f, q in granted if topic_matches(f, topic)), default=None)
            if best is not None and self._may(session.user, topic, False):
                self._deliver(session, topic, payload, min(msg_qos, best), True)

    def _end_session(self, session: _Session, clean: bool) -> None:
        session.closed = True
        if self._sessions.get(session.client_id) is session:
            del self._sessions[session.client_id]
        if not clean and session.will is not None:
            topic, payload, qos, retain = session.will
            if self._may(session.user, topic, True):
                log.info("publishing the will of %s on %s", session.client_id, topic)
                self._route(topic, payload, min(qos, 1), retain)

    # --- routing ---------------------------------------------------------------------------

    def _may(self, user: str | None, topic: str, write: bool) -> bool:
        if self.acl is None:
            return True
        try:
            return bool(self.acl(user, topic, write))
        except Exception:  # a broken ACL callback denies, it does not crash the broker
            log.exception("ACL callback failed for %r on %s", user, topic)
            return False

    def _route(self, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        if retain:
            # An empty retained message deletes the one kept (3.3.1.3).
            if payload:
                self._retained[topic] = (payload, qos)
            else:
                self._retained.pop(topic, None)
        for session in list(self._sessions.values()):
            best = max(
                (q for f, q in session.subs.items() if topic_matches(f, topic)), default=None
            )
            if best is None or not self._may(session.user, topic, False):
                continue
            # A live message goes out with RETAIN cleared, whatever it was published with.
            self._deliver(session, topic, payload, min(qos, best), False)

    def _deliver(
        self, session: _Session, topic: str, payload: bytes, qos: int, retain: bool
    ) -> None:
        pid = session.new_pid() if qos else 0
        session.send(mqtt.encode_publish(topic, payload, qos, retain, False, pid))
