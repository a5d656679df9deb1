"""tools/embedded_broker.py spoken to by paho-mqtt 2.x (the bridge's client), by raw
sockets where a test needs exact bytes or an abrupt close, and by the board's Link."""

from __future__ import annotations

import asyncio
import queue
import socket
from collections.abc import Callable, Iterator
from typing import Any

import paho.mqtt.client as paho
import pytest

from edge_runtime import mqtt
from edge_runtime.link import Link
from tools.embedded_broker import EmbeddedBroker, topic_matches, valid_filter

TIMEOUT_S = 10.0


class Client:
    """A paho client whose messages land in a queue, for tests that wait on them."""

    def __init__(
        self,
        broker: EmbeddedBroker,
        name: str,
        user: str | None = None,
        password: str | None = None,
        will: tuple[str, bytes, int, bool] | None = None,
    ) -> None:
        self.messages: queue.Queue[paho.MQTTMessage] = queue.Queue()
        self.connacks: queue.Queue[Any] = queue.Queue()
        self.subacks: queue.Queue[Any] = queue.Queue()
        self.c = paho.Client(
            paho.CallbackAPIVersion.VERSION2, client_id=name, protocol=paho.MQTTv311
        )
        if user is not None:
            self.c.username_pw_set(user, password)
        if will is not None:
            self.c.will_set(will[0], will[1], will[2], will[3])
        self.c.on_connect = lambda c, u, flags, rc, props: self.connacks.put(rc)
        self.c.on_subscribe = lambda c, u, mid, rcs, props: self.subacks.put(rcs)
        self.c.on_message = lambda c, u, msg: self.messages.put(msg)
        self.c.connect(broker.host, broker.port, keepalive=30)
        self.c.loop_start()

    def connack(self) -> Any:
        return self.connacks.get(timeout=TIMEOUT_S)

    def connected(self) -> Client:
        rc = self.connack()
        assert not rc.is_failure, rc
        return self

    def subscribe(self, topic: str, qos: int = 1) -> list[Any]:
        self.c.subscribe(topic, qos)
        return list(self.subacks.get(timeout=TIMEOUT_S))

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> None:
        info = self.c.publish(topic, payload, qos, retain)
        info.wait_for_publish(TIMEOUT_S)  # QoS 1: until the broker's PUBACK

    def next(self) -> paho.MQTTMessage:
        return self.messages.get(timeout=TIMEOUT_S)

    def until(self, topic: str) -> list[paho.MQTTMessage]:
        """Every message up to and including the first on `topic`."""
        got = []
        while True:
            msg = self.next()
            got.append(msg)
            if msg.topic == topic:
                return got

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


@pytest.fixture
def ebroker() -> Iterator[EmbeddedBroker]:
    b = EmbeddedBroker().start()
    yield b
    b.stop()


@pytest.fixture
def clients(ebroker: EmbeddedBroker) -> Iterator[Callable[..., Client]]:
    made: list[Client] = []

    def make(name: str, **kw: Any) -> Client:
        c = Client(ebroker, name, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def raw_connect(broker: EmbeddedBroker, packet: bytes) -> tuple[socket.socket, bytes]:
    s = socket.create_connection((broker.host, broker.port), timeout=TIMEOUT_S)
    s.sendall(packet)
    return s, recv_exactly(s, 4)


def recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def test_topic_filters_match_as_the_spec_says() -> None:
    assert topic_matches("a/b", "a/b")
    assert not topic_matches("a/b", "a/c")
    assert topic_matches("a/+/c", "a/b/c")
    assert not topic_matches("a/+/c", "a/b/d/c")
    assert topic_matches("a/#", "a/b/c")
    assert topic_matches("a/#", "a")  # '#' includes the parent level (4.7.1.2)
    assert topic_matches("+", "a") and not topic_matches("+", "a/b")
    assert topic_matches("+/+", "/a")  # an empty level is a level
    assert topic_matches("#", "a/b")
    assert not topic_matches("#", "$SYS/x") and not topic_matches("+/x", "$SYS/x")
    assert topic_matches("$SYS/#", "$SYS/x")
    assert valid_filter("a/+/#") and valid_filter("#") and valid_filter("+")
    assert not valid_filter("a/#/b") and not valid_filter("a/b#") and not valid_filter("a+")
    assert not valid_filter("")


def test_publish_subscribe_qos0_and_qos1(clients: Callable[..., Client]) -> None:
    sub = clients("sub").connected()
    assert sub.subscribe("t/#", 1) == [1]
    pub = clients("pub").connected()
    pub.publish("t/zero", b"0", 0)
    pub.publish("t/one", b"1", 1)
    got = {m.topic: m for m in (sub.next(), sub.next())}
    assert got["t/zero"].payload == b"0" and got["t/zero"].qos == 0
    assert got["t/one"].payload == b"1" and got["t/one"].qos == 1
    assert not got["t/one"].retain


def test_wildcards_route_only_what_matches(
    ebroker: EmbeddedBroker, clients: Callable[..., Client]
) -> None:
    plus = clients("plus").connected()
    assert plus.subscribe("w/+/c", 0) == [0]
    hash_ = clients("hash").connected()
    assert hash_.subscribe("w/a/#", 0) == [0]
    # A filter the grammar forbids is refused in the SUBACK, not silently taken (paho
    # would not even send it, hence the raw socket); QoS 2 is granted as 1.
    s, _ = raw_connect(ebroker, mqtt.encode_connect("raw", True, 30))
    s.sendall(mqtt.encode_subscribe(7, [("w/#/x", 0), ("w/ok", 2)]))
    assert recv_exactly(s, 6) == bytes.fromhex("90 04 00 07 80 01")
    s.close()
    pub = clients("pub").connected()
    for topic in ("w/a/c", "w/b/c", "w/a", "w/a/b/c", "x/a/c", "w/end"):
        pub.publish(topic, topic.encode(), 1)
    assert [m.topic for m in plus.until("w/b/c")] == ["w/a/c", "w/b/c"]
    assert [m.topic for m in hash_.until("w/a/b/c")] == ["w/a/c", "w/a", "w/a/b/c"]
    # Nothing else was routed to them: a marker both see arrives next.
    pub.publish("w/a/c", b"marker", 1)
    assert plus.next().payload == b"marker" and hash_.next().payload == b"marker"


def test_retained_message_reaches_later_subscribers_until_cleared(
    clients: Callable[..., Client],
) -> None:
    pub = clients("pub").connected()
    pub.publish("r/state", b"on", 1, retain=True)
    late = clients("late").connected()
    late.subscribe("r/#", 1)
    msg = late.next()
    assert (msg.topic, msg.payload, msg.retain) == ("r/state", b"on", True)
    # Live messages go out with RETAIN cleared, even when published retained.
    pub.publish("r/state", b"off", 1, retain=True)
    msg = late.next()
    assert (msg.payload, msg.retain) == (b"off", False)
    pub.publish("r/state", b"", 1, retain=True)  # an empty retained message clears it
    assert late.next().payload == b""
    later = clients("later").connected()
    later.subscribe("r/#", 1)
    pub.publish("r/marker", b"m", 1)
    # Retained messages come right after the SUBACK, so none came before the marker.
    assert [m.topic for m in later.until("r/marker")] == ["r/marker"]


def test_will_on_abnormal_disconnect_only(
    ebroker: EmbeddedBroker, clients: Callable[..., Client]
) -> None:
    watch = clients("watch").connected()
    watch.subscribe("dev/+/status", 1)
    will = ("dev/a/status", b"offline", 1, False)
    s, connack = raw_connect(ebroker, mqtt.encode_connect("dev-a", True, 30, will=will))
    assert connack == b"\x20\x02\x00\x00"
    s.close()  # no DISCONNECT: the broker publishes the will
    msg = watch.next()
    assert (msg.topic, msg.payload) == ("dev/a/status", b"offline")

    will_b = ("dev/b/status", b"offline", 1, False)
    s, connack = raw_connect(ebroker, mqtt.encode_connect("dev-b", True, 30, will=will_b))
    assert connack == b"\x20\x02\x00\x00"
    s.sendall(mqtt.DISCONNECT_PACKET)
    assert s.recv(1) == b""  # the broker closed its side after handling DISCONNECT
    s.close()
    marker = clients("marker").connected()
    marker.publish("dev/marker/status", b"m", 1)
    assert [m.topic for m in watch.until("dev/marker/status")] == ["dev/marker/status"]


def test_paho_will_and_ping(ebroker: EmbeddedBroker, clients: Callable[..., Client]) -> None:
    watch = clients("watch").connected()
    watch.subscribe("p/status", 1)
    # PINGREQ is answered with PINGRESP, byte for byte.
    s, connack = raw_connect(ebroker, mqtt.encode_connect("pinger", True, 30))
    s.sendall(mqtt.PINGREQ_PACKET)
    assert recv_exactly(s, 2) == b"\xd0\x00"
    s.close()
    dev = clients("dev", will=("p/status", b"gone", 1, True)).connected()
    sock = dev.c.socket()
    assert isinstance(sock, socket.socket)
    sock.shutdown(socket.SHUT_RDWR)  # the network goes away under paho
    msg = watch.next()
    assert (msg.topic, msg.payload) == ("p/status", b"gone")


def test_credentials_are_checked() -> None:
    with EmbeddedBroker(users={"dev1": "right"}) as b:
        ok = Client(b, "ok", user="dev1", password="right")
        wrong = Client(b, "wrong", user="dev1", password="wrong")
        stranger = Client(b, "stranger", user="nobody", password="right")
        anon = Client(b, "anon")
        try:
            assert not ok.connack().is_failure
            for c in (wrong, stranger, anon):
                assert c.connack().is_failure
        finally:
            for c in (ok, wrong, stranger, anon):
                c.close()
        # The exact refusals, on the wire.
        s, connack = raw_connect(b, mqtt.encode_connect("w", True, 30, "dev1", "nope"))
        assert connack == b"\x20\x02\x00\x04"  # bad user name or password
        s.close()
        s, connack = raw_connect(b, mqtt.encode_connect("a", True, 30))
        assert connack == b"\x20\x02\x00\x05"  # not authorized
        s.close()


def test_wrong_protocol_level_is_refused(ebroker: EmbeddedBroker) -> None:
    packet = bytearray(mqtt.encode_connect("old", True, 30))
    packet[8] = 3  # protocol level 3 (MQTT 3.1) instead of 4
    s, connack = raw_connect(ebroker, bytes(packet))
    assert connack == b"\x20\x02\x00\x01"
    s.close()


def test_acl_callback_filters_writes_and_reads() -> None:
    def acl(user: str | None, topic: str, write: bool) -> bool:
        if write:
            return not topic.startswith("locked/") or user == "admin"
        return not topic.startswith("private/") or user == "admin"

    with EmbeddedBroker(users={"admin": "a", "dev": "d"}, acl=acl) as b:
        admin = Client(b, "admin", user="admin", password="a").connected()
        dev = Client(b, "dev", user="dev", password="d").connected()
        try:
            admin.subscribe("#", 1)
            dev.subscribe("#", 1)
            dev.publish("locked/x", b"no", 1)  # acknowledged but dropped
            dev.publish("private/x", b"admin only", 1)
            dev.publish("open/x", b"all", 1)
            assert [m.payload for m in admin.until("open/x")] == [b"admin only", b"all"]
            assert [m.payload for m in dev.until("open/x")] == [b"all"]
            admin.publish("locked/x", b"yes", 1)
            assert admin.next().payload == b"yes" and dev.next().payload == b"yes"
        finally:
            admin.close()
            dev.close()


def test_board_link_round_trip(ebroker: EmbeddedBroker) -> None:
    async def main() -> None:
        got: list[tuple[str, bytes]] = []
        sub = Link("sub", ebroker.host, ebroker.port, on_message=lambda t, p: got.append((t, p)))
        sub.subscribe("b/+", 1)
        pub = Link("pub", ebroker.host, ebroker.port, will=("b/will", b"bye", 1, False))
        tasks = [asyncio.create_task(k.run()) for k in (sub, pub)]
        try:
            assert await sub.wait_connected(10000) and await pub.wait_connected(10000)
            pub.publish("b/x", b"hello", 1)
            for _ in range(500):
                if got:
                    break
                await asyncio.sleep(0.01)
            assert got == [("b/x", b"hello")]
            pub.reconnect("test: cut")  # gone without DISCONNECT: the will goes out
            for _ in range(500):
                if len(got) == 2:
                    break
                await asyncio.sleep(0.01)
            assert got[1] == ("b/will", b"bye")
        finally:
            sub.stop()
            pub.stop()
            await asyncio.wait_for(asyncio.gather(*tasks), 10)

    asyncio.run(main())
