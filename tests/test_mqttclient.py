"""server_bridge.mqttclient: paho's queue written by the thread that filled it, against a
real broker: packets whole and in order whoever writes them, never written by a flush on
the network thread or after a disconnect."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from server_bridge import mqttclient
from server_bridge.mqttclient import Client
from tools.broker import MosquittoProcess

WAIT = 10.0


def _connected(c: mqtt.Client, broker: MosquittoProcess, subs: tuple[str, ...] = ()) -> None:
    ready = threading.Event()

    def on_connect(cl: mqtt.Client, u: Any, flags: Any, rc: Any, p: Any) -> None:
        if subs:
            cl.subscribe([(s, 1) for s in subs])
        else:
            ready.set()

    c.on_connect = on_connect
    c.on_subscribe = lambda *a: ready.set()
    c.connect(broker.host, broker.port, keepalive=30)
    c.loop_start()
    assert ready.wait(WAIT), "not connected"


@pytest.fixture
def pair(broker: MosquittoProcess) -> Iterator[tuple[Client, mqtt.Client, str]]:
    """A flushing client and a plain subscriber to the topic it publishes on."""
    topic = f"wren-test/flush/{uuid.uuid4().hex[:8]}"
    sender = Client(CallbackAPIVersion.VERSION2, client_id=f"s-{uuid.uuid4().hex[:8]}")
    sender.max_inflight_messages_set(64)
    sub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"r-{uuid.uuid4().hex[:8]}")
    _connected(sub, broker, (topic,))
    _connected(sender, broker)
    yield sender, sub, topic
    for c in (sender, sub):
        c.disconnect()
        c.loop_stop()


def test_paho_still_has_the_writer_flush_calls() -> None:
    # An upgrade of paho that renamed it would quietly end every flush (flush() returns
    # False and the network thread writes, as before): fail here instead.
    c = Client(CallbackAPIVersion.VERSION2)
    assert callable(getattr(c, "_packet_write", None))
    assert hasattr(c, "_out_packet")
    # And what Client._handle_pubackcomp takes over for MQTT 3.1.1.
    for name in ("_handle_pubackcomp", "_do_on_publish"):
        assert callable(getattr(mqtt.Client, name, None)), name
    for name in ("_in_packet", "_out_messages", "_out_message_mutex", "_protocol"):
        assert hasattr(c, name), name


def test_a_flush_writes_on_the_calling_thread(pair: tuple[Client, mqtt.Client, str]) -> None:
    sender, sub, topic = pair
    got = threading.Event()
    sub.on_message = lambda *a: got.set()
    writers: list[int] = []
    send = sender._sock_send

    def spy(buf: Any) -> int:
        writers.append(threading.get_ident())
        return send(buf)

    sender._sock_send = spy  # type: ignore[method-assign]
    # The network thread, which paho wakes for the packet too, writes nothing meanwhile:
    # otherwise it may write first and leave the flush nothing to do.
    loop_write = sender.loop_write
    sender.loop_write = lambda: mqtt.MQTT_ERR_SUCCESS  # type: ignore[method-assign]
    try:
        info = sender.publish(topic, b"hello", qos=1)
        assert sender.flush()
        assert writers == [threading.get_ident()]
        assert got.wait(WAIT)
    finally:
        sender.loop_write = loop_write  # type: ignore[method-assign]
    info.wait_for_publish(WAIT)
    assert info.is_published()


def test_packets_stay_whole_and_in_order_with_many_writers(
    pair: tuple[Client, mqtt.Client, str],
) -> None:
    # Four threads publish and flush while the network thread writes acks and whatever a
    # flush leaves: a packet interleaved with another would make the broker drop the
    # connection, and per publisher the broker keeps our order.
    sender, sub, topic = pair
    per_thread, threads = 300, 4
    got: dict[int, list[int]] = {k: [] for k in range(threads)}
    done = threading.Event()
    lock = threading.Lock()

    def on_message(cl: mqtt.Client, u: Any, msg: mqtt.MQTTMessage) -> None:
        k, n, pad = msg.payload.split(b":", 2)
        assert len(pad) == int(n) % 700  # whole: sizes vary, some past one segment
        with lock:
            got[int(k)].append(int(n))
            if sum(map(len, got.values())) == per_thread * threads:
                done.set()

    sub.on_message = on_message
    order = threading.Lock()  # a thread's publish and flush together, so its order holds

    def publisher(k: int) -> None:
        for n in range(per_thread):
            with order:
                info = sender.publish(topic, b"%d:%d:" % (k, n) + b"x" * (n % 700), qos=1)
                assert info.rc == mqtt.MQTT_ERR_SUCCESS
            sender.flush()

    workers = [threading.Thread(target=publisher, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(WAIT)
    assert done.wait(WAIT), {k: len(v) for k, v in got.items()}
    assert all(v == list(range(per_thread)) for v in got.values())
    assert sender.is_connected()


def test_no_flush_on_the_network_thread_or_after_disconnect(
    pair: tuple[Client, mqtt.Client, str],
) -> None:
    sender, sub, topic = pair
    answers: list[bool] = []
    seen = threading.Event()

    def on_publish(*a: Any) -> None:  # runs on the sender's network thread
        answers.append(sender.flush())
        seen.set()

    sender.on_publish = on_publish
    sender.publish(topic, b"one", qos=1)
    assert seen.wait(WAIT)
    assert answers == [False]
    sender.disconnect()
    sender.publish(topic, b"two", qos=1)
    assert not sender.flush()


class _Inbox:
    """A client's on_message that keeps the payloads, and `done` once n have come."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.got: list[bytes] = []
        self.done = threading.Event()

    def on_message(self, cl: mqtt.Client, u: Any, msg: mqtt.MQTTMessage) -> None:
        self.got.append(msg.payload)
        if len(self.got) == self.n:
            self.done.set()


class _CountingPair:
    """Stands in for paho's wake-up socket (its write end): counts the wake-ups, which
    paho makes by `send` alone, and passes them on."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.sends: list[int] = []

    def send(self, data: bytes) -> int:
        self.sends.append(threading.get_ident())
        return int(self.sock.send(data))

    def close(self) -> None:
        self.sock.close()


def test_the_network_thread_queues_without_waking_itself(broker: MosquittoProcess) -> None:
    # A relay: what comes in on `a` is published on `b` from the network thread's own
    # callback, with a PUBACK for each message read. Those packets reach the broker
    # without a wake-up byte (only another thread's publish needs one), and every one
    # of them gets there.
    a, b = (f"wren-test/relay/{uuid.uuid4().hex[:8]}/{leaf}" for leaf in "ab")
    relay = Client(CallbackAPIVersion.VERSION2, client_id=f"relay-{uuid.uuid4().hex[:8]}")
    relay.max_inflight_messages_set(64)
    net: list[int] = []

    def relay_it(cl: mqtt.Client, u: Any, msg: mqtt.MQTTMessage) -> None:
        net.append(threading.get_ident())
        cl.publish(b, msg.payload, qos=1)

    relay.on_message = relay_it
    sink = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"sink-{uuid.uuid4().hex[:8]}")
    n = 200
    inbox = _Inbox(n)
    got, done = inbox.got, inbox.done
    sink.on_message = inbox.on_message
    source = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"src-{uuid.uuid4().hex[:8]}")
    _connected(sink, broker, (b,))
    _connected(relay, broker, (a,))
    _connected(source, broker)
    pair = _CountingPair(relay._sockpairW)
    relay._sockpairW = pair  # type: ignore[assignment]
    try:
        for k in range(n):
            source.publish(a, b"%d" % k, qos=1)
        assert done.wait(WAIT), len(got)
        assert got == [b"%d" % k for k in range(n)]
        assert set(net) == {relay._flush_net}
        assert pair.sends == []
        # Another thread's publish still wakes the network thread, which writes it.
        relay.publish(b, b"from the main thread", qos=1).wait_for_publish(WAIT)
        assert pair.sends == [threading.get_ident()]
    finally:
        for c in (source, relay, sink):
            c.disconnect()
            c.loop_stop()


def test_paho_debug_lines_are_dropped_unless_debug_is_on(
    pair: tuple[Client, mqtt.Client, str], caplog: pytest.LogCaptureFixture
) -> None:
    sender, sub, topic = pair
    logger = logging.getLogger(f"wren-test.paho.{uuid.uuid4().hex[:8]}")
    sender.enable_logger(logger)
    with caplog.at_level(logging.INFO, logger=logger.name):
        sender.publish(topic, b"quiet", qos=1).wait_for_publish(WAIT)
    assert not [r for r in caplog.records if r.name == logger.name]
    with caplog.at_level(logging.DEBUG, logger=logger.name):
        sender.publish(topic, b"loud", qos=1).wait_for_publish(WAIT)
    assert any("PUBLISH" in r.getMessage() for r in caplog.records if r.name == logger.name)


def test_the_broker_stream_is_read_in_blocks_and_nothing_waits_in_them(
    broker: MosquittoProcess,
) -> None:
    # A burst of small messages: the receiving client's network thread reads them a
    # block at a time rather than three reads a packet, and the last packets of a block
    # are handled at once (paho's loop sees them pending), not when more data comes.
    topic = f"wren-test/blocks/{uuid.uuid4().hex[:8]}"
    receiver = Client(CallbackAPIVersion.VERSION2, client_id=f"rx-{uuid.uuid4().hex[:8]}")
    n = 500
    inbox = _Inbox(n)
    got, done = inbox.got, inbox.done
    receiver.on_message = inbox.on_message
    _connected(receiver, broker, (topic,))
    sock = receiver.socket()
    assert isinstance(sock, mqttclient._BufferedSocket)
    reads: list[int] = []
    inner = sock._sock
    recv = inner.recv

    class Counting:
        def recv(self, size: int) -> bytes:
            data = recv(size)
            reads.append(len(data))
            return data

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

    sock._sock = Counting()  # type: ignore[assignment]
    source = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"tx-{uuid.uuid4().hex[:8]}")
    _connected(source, broker)
    try:
        # One publish after the burst, alone: it must arrive without anything after it.
        for k in range(n - 1):
            source.publish(topic, b"%d:" % k + b"z" * (k % 90), qos=1)
        assert wait_until(lambda: len(got) == n - 1), len(got)
        source.publish(topic, b"last", qos=1)
        assert done.wait(WAIT), len(got)
        assert got[:-1] == [b"%d:" % k + b"z" * (k % 90) for k in range(n - 1)]
        assert got[-1] == b"last"
        assert sum(reads) > 0
        assert len(reads) < n  # paho alone: at least three reads for each of the n
    finally:
        for c in (source, receiver):
            c.disconnect()
            c.loop_stop()


def wait_until(pred: Any, timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return bool(pred())


def test_a_quiet_publish_is_written_by_its_flush_and_wakes_no_one(
    pair: tuple[Client, mqtt.Client, str],
) -> None:
    # publish_quiet() and flush() on one thread: the message reaches the subscriber
    # without a wake-up byte for the network thread. When the flush cannot write (the
    # lock held past its wait, as by a network thread stuck mid-write), the network
    # thread is woken for the message and writes it.
    sender, sub, topic = pair
    inbox = _Inbox(2)
    sub.on_message = inbox.on_message
    wake = _CountingPair(sender._sockpairW)
    sender._sockpairW = wake  # type: ignore[assignment]
    first = sender.publish_quiet(topic, b"written by its flush", qos=1)
    assert sender.flush()
    first.wait_for_publish(WAIT)
    assert first.is_published()
    assert wake.sends == []
    held = threading.Event()
    release = threading.Event()

    def hold_the_lock() -> None:
        with sender._flush_lock:
            held.set()
            release.wait(WAIT)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    try:
        assert held.wait(WAIT)
        second = sender.publish_quiet(topic, b"left to the network thread", qos=1)
        assert not sender.flush()  # gave up waiting for the lock
        assert wake.sends == [threading.get_ident()]
    finally:
        release.set()
        holder.join(WAIT)
    second.wait_for_publish(WAIT)
    assert second.is_published()
    assert inbox.done.wait(WAIT)
    assert inbox.got == [b"written by its flush", b"left to the network thread"]


@pytest.mark.parametrize("protocol", [mqtt.MQTTv311, mqtt.MQTTv5])
def test_pubacks_reach_on_publish_as_success(
    broker: MosquittoProcess, protocol: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under MQTT 3.1.1 Client reads a PUBACK's packet id itself (paho's own handler
    # builds a reason code and properties for each); under MQTT 5 paho's handler runs.
    # Either way on_publish hears of each message once, as a success (under MQTT 5 the
    # broker may say 16, no subscriber matched, which is one), and it counts as published.
    paho_calls: list[str] = []
    handle = mqtt.Client._handle_pubackcomp

    def counted(self: mqtt.Client, cmd: Any) -> mqtt.MQTTErrorCode:
        paho_calls.append(cmd)
        return handle(self, cmd)

    monkeypatch.setattr(mqtt.Client, "_handle_pubackcomp", counted)
    topic = f"wren-test/ack/{uuid.uuid4().hex[:8]}"
    sender = Client(
        CallbackAPIVersion.VERSION2, client_id=f"a-{uuid.uuid4().hex[:8]}", protocol=protocol
    )
    acks: list[tuple[int, int, bool, str]] = []

    def on_publish(cl: mqtt.Client, u: Any, mid: int, rc: Any, props: Any) -> None:
        acks.append((mid, rc.value, rc.is_failure, type(props).__name__))

    sender.on_publish = on_publish
    _connected(sender, broker)
    try:
        infos = [sender.publish(topic, b"%d" % k, qos=1) for k in range(5)]
        for info in infos:
            info.wait_for_publish(WAIT)
            assert info.is_published()
        ok = 0 if protocol == mqtt.MQTTv311 else 16
        assert sorted(acks) == [(info.mid, ok, False, "Properties") for info in infos]
        assert len(paho_calls) == (0 if protocol == mqtt.MQTTv311 else 5)
    finally:
        sender.disconnect()
        sender.loop_stop()


def test_a_reconnect_sends_what_was_left_before_what_another_thread_publishes(
    pair: tuple[Client, mqtt.Client, str],
) -> None:
    # What was published while the connection was down goes out first after the
    # reconnect, even when another thread publishes while paho handles the CONNACK (here
    # held open by on_connect): before, that publish overtook them (an RPC worker's next
    # chunk, and the board failed its call with `gap`).
    sender, sub, topic = pair
    got: list[bytes] = []
    sub.on_message = lambda c, u, msg: got.append(bytes(msg.payload))
    in_connack = threading.Event()
    reconnected = threading.Event()

    def on_connect(cl: mqtt.Client, u: Any, flags: Any, rc: Any, p: Any) -> None:
        if not reconnected.is_set():
            return
        in_connack.set()
        time.sleep(0.3)  # a window for the other thread's publish to fall in

    sender.on_connect = on_connect
    sock = sender.socket()
    assert sock is not None
    sock.shutdown(2)  # the connection drops; paho reconnects within a second
    deadline = time.monotonic() + WAIT
    while sender.is_connected() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not sender.is_connected()
    for n in range(5):
        assert sender.publish(topic, b"left %d" % n, qos=1).rc == mqtt.MQTT_ERR_NO_CONN
    reconnected.set()
    assert in_connack.wait(WAIT), "no reconnect"
    later = sender.publish(topic, b"later", qos=1)
    assert later.rc in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN)
    sender.flush()
    deadline = time.monotonic() + WAIT
    while len(got) < 6 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert got == [b"left 0", b"left 1", b"left 2", b"left 3", b"left 4", b"later"], got
