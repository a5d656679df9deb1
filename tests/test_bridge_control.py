"""The bridge's control connection, against a real Mosquitto with Wren's own access rules.

The bridge reads boards' RPC calls and hosts' requests on a connection of its own, apart
from the boards' events (server_bridge/bridge.py): Mosquitto queues per connection, so
on one connection a call waited behind every event a flooding neighbour had queued. Here
a neighbour floods while a board calls and a host asks; each connection is dropped in
turn and comes back; and the control user is only the bridge's.

Every wait is bounded; no assertion is about how long something took.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from server_bridge import brokerconf, tokens
from server_bridge.bridge import Bridge
from server_bridge.config import BridgeConfig
from server_bridge.models.scripted import ScriptedProvider
from server_bridge.registry import DeviceRecord, Registry
from tests.waiting import wait_for
from tools.broker import MosquittoProcess, start_mosquitto

P = "wren/v1"
SECRET = bytes(range(32))
WAIT = 10.0
USERS = {
    "bridge": "bridge-pw",
    "dev1": "dev1-pw",
    "flood1": "flood1-pw",
    "host-acme": "acme-pw",
}
CTL = brokerconf.control_user("bridge")
USER_TEXT = {"role": "user", "content": "What is the temperature?"}


class Peer:
    """A paho client logged in as one user: a board, a host or a watcher."""

    def __init__(
        self,
        broker: MosquittoProcess,
        user: str,
        password: str,
        subscribe: tuple[str, ...] = (),
        inflight: int = 20,
    ) -> None:
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self._subacks: queue.Queue[Any] = queue.Queue()
        connacks: queue.Queue[Any] = queue.Queue()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=user, protocol=mqtt.MQTTv311
        )
        self.client.username_pw_set(user, password)
        self.client.max_inflight_messages_set(inflight)
        self.client.max_queued_messages_set(1000)
        self.client.on_connect = lambda c, u, flags, rc, props: connacks.put(rc)
        self.client.on_subscribe = lambda c, u, mid, rcs, props: self._subacks.put(rcs)
        self.client.on_message = lambda c, u, msg: self.messages.put(msg)
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        self.rc = connacks.get(timeout=WAIT)
        if subscribe and not self.rc.is_failure:
            self.client.subscribe([(t, 1) for t in subscribe])
            self._subacks.get(timeout=WAIT)

    def send(self, topic: str, obj: Any) -> None:
        payload = msgpack.packb(obj, use_bin_type=True)
        self.client.publish(topic, payload, qos=1).wait_for_publish(WAIT)

    def next(self, topic: str | None = None) -> Any:
        """The next message (on `topic`, others skipped), decoded."""
        while True:
            try:
                msg = self.messages.get(timeout=WAIT)
            except queue.Empty:
                raise AssertionError(f"nothing arrived on {topic or 'any topic'}") from None
            if topic is None or msg.topic == topic:
                return msgpack.unpackb(msg.payload, raw=False)

    def until(self, pred: Callable[[str, Any], bool]) -> list[tuple[str, Any]]:
        """Every message up to and including the first `pred` accepts (topic, decoded)."""
        got = []
        while True:
            try:
                msg = self.messages.get(timeout=WAIT)
            except queue.Empty:
                raise AssertionError(f"the message waited for never came: {got}") from None
            got.append((msg.topic, msgpack.unpackb(msg.payload, raw=False)))
            if pred(*got[-1]):
                return got

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class Flood:
    """A device of another tenant sending valid runs (run.started, 48 msg.delta,
    run.done) on its own P/d/D/evt at QoS 1, as fast as the broker takes them: what a
    board in a loop, or a board under an attacker's control, does to the bridge."""

    def __init__(self, broker: MosquittoProcess) -> None:
        self.peer = Peer(broker, "flood1", USERS["flood1"], inflight=100)
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        topic = f"{P}/d/flood1/evt"
        n = 0
        while not self._stop.is_set():
            n += 1
            run = f"0badf00d.{n}"
            events = [("run.started", {"agent": "kiosk", "input": "x"})]
            events += [("msg.delta", {"m": "m1", "text": "x" * 64})] * 48
            events += [("run.done", {"usage": {}})]
            for i, (t, d) in enumerate(events, 1):
                env = {"r": run, "i": i, "t": t, "ts": i, "d": d}
                payload = msgpack.packb(env, use_bin_type=True)
                publish = self.peer.client.publish
                while publish(topic, payload, qos=1).rc == mqtt.MQTT_ERR_QUEUE_SIZE:
                    if self._stop.is_set():
                        return
                    time.sleep(0.0005)
                self.sent += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(WAIT)
        self.peer.close()


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[MosquittoProcess, Registry]]:
    """A broker of the test's own with Wren's acl_file (the bridge's control user's login
    is its password), and a registry: dev1 of tenant acme, flood1 of tenant globex."""
    acl = brokerconf.acl_text(P, "bridge", {"acme": "host-acme"})
    logins = brokerconf.with_control_users(USERS, ["bridge"])
    extra = brokerconf.secure_mosquitto_conf(tmp_path / "conf", logins, acl)
    broker = start_mosquitto(tmp_path / "mosquitto", extra_conf=extra, allow_anonymous=False)
    registry = Registry(tmp_path / "registry.json")
    registry.add_tenant("acme", SECRET)
    registry.add_tenant("globex")
    registry.add_device("dev1", "acme", "thermostat")
    registry.add_device("flood1", "globex", "kiosk")
    try:
        yield broker, registry
    finally:
        registry.close()
        broker.stop()


def start_bridge(broker: MosquittoProcess, registry: Registry) -> Bridge:
    config = BridgeConfig(
        host=broker.host,
        port=broker.port,
        username="bridge",
        password=USERS["bridge"],
        prefix=P,
        offline_grace_s=0,
    )
    bridge = Bridge(config, registry, ScriptedProvider())
    bridge.start()
    return bridge


def call_llm(board: Peer, c: int) -> dict[str, Any]:
    """One llm.complete call of the board's, answered in full: its final answer."""
    board.send(f"{P}/d/dev1/rpc", {"c": c, "m": "llm.complete", "a": {"messages": [USER_TEXT]}})
    while True:
        msg: dict[str, Any] = board.next(f"{P}/d/dev1/rpc/res")
        if msg.get("c") == c and "ch" not in msg:
            return msg


def test_calls_and_requests_are_served_while_a_neighbour_floods_events(
    secured: tuple[MosquittoProcess, Registry],
) -> None:
    broker, registry = secured
    bridge = start_bridge(broker, registry)
    # The event connection's thread is held at the flood's first event, so what the
    # flood sends next is certainly queued at the broker for that connection, behind it:
    # the case of a flood faster than the bridge reads, without depending on speeds.
    real = bridge.intake.handle_evt
    stalled, release = threading.Event(), threading.Event()

    def held(device: DeviceRecord, payload: bytes) -> int:
        if device.device == "flood1" and not release.is_set():
            stalled.set()
            release.wait(WAIT * 3)
        return real(device, payload)

    bridge.intake.handle_evt = held  # type: ignore[method-assign]
    board = Peer(broker, "dev1", USERS["dev1"], (f"{P}/d/dev1/#",))
    # A watcher (PROTOCOL "Who sees what"): the device's topic and every user's.
    watched = (f"{P}/h/acme/dev1/evt", f"{P}/h/acme/dev1/u/+/evt")
    host = Peer(broker, "host-acme", USERS["host-acme"], watched)
    alices = f"{P}/h/acme/dev1/u/alice/evt"
    flood: Flood | None = None
    read = 0
    try:
        flood = Flood(broker)
        assert stalled.wait(WAIT), "the flood never reached the bridge"
        read = bridge.stats["evt.in"]
        sent = flood
        wait_for(lambda: sent.sent > read + 1000, "the flood to queue behind the held event")
        # A board's model call: answered in full, chunks and final answer.
        assert call_llm(board, 1)["ok"]["finish"] == "tool_calls"
        # A host's request and control reach the board, as the bridge builds them.
        tok = tokens.sign(SECRET, "acme", "alice")
        host.send(f"{P}/h/acme/dev1/req", {"req": "q1", "input": "hi", "tok": tok})
        req = board.next(f"{P}/d/dev1/req")
        assert (req["req"], req["usr"]) == ("q1", "alice")
        # No status of dev1 read (the event connection is held): the host that asked is
        # told the bridge has never seen it online (PROTOCOL "Presence at the host").
        unseen = host.next(alices)
        assert (unseen["r"], unseen["t"], unseen["d"]) == (
            "_b", "presence", {"st": "unseen", "req": "q1"}
        )  # fmt: skip
        # `req` first (PROTOCOL "Requests and control"): a board names a req it cannot
        # decode by the id in its first bytes.
        assert next(iter(req)) == "req"
        # A watcher's cancel: no event of the run has been read, so whose it is is unknown.
        ops = tokens.sign(SECRET, "acme", "ops", watch=True)
        host.send(f"{P}/h/acme/dev1/ctl", {"op": "cancel", "r": "0a0b0c0d.1", "tok": ops})
        assert board.next(f"{P}/d/dev1/ctl") == {"op": "cancel", "r": "0a0b0c0d.1"}
        # The bridge's answer to a host on `_b` goes out on the control connection too.
        host.send(f"{P}/h/acme/dev1/ctl", {"op": "replay", "r": "nope", "after": 0, "tok": tok})
        told = host.next(alices)
        assert (told["r"], told["d"]["kind"]) == ("_b", "unknown_run")
        # All of it while the event connection had not read past the flood's first event.
        assert not release.is_set() and bridge.stats["evt.in"] == read
        assert bridge.stats["callback_errors"] == 0
    finally:
        release.set()
        if flood is not None:
            flood.stop()
    try:
        # And the events that waited are read once the event connection moves again.
        wait_for(lambda: bridge.stats["evt.in"] > read, "the event connection to read on")
    finally:
        board.close()
        host.close()
        bridge.stop()


def _drop(client: mqtt.Client | None) -> None:
    """Cut a connection as a network would: the socket shut under paho (it reconnects)."""
    assert client is not None
    sock = client.socket()
    assert sock is not None
    getattr(sock, "_sock", sock).shutdown(socket.SHUT_RDWR)


def _status(topic: str, obj: Any) -> bool:
    return topic == f"{P}/b/status"


def test_a_drop_of_either_connection_recovers(secured: tuple[MosquittoProcess, Registry]) -> None:
    broker, registry = secured
    bridge = start_bridge(broker, registry)
    board = Peer(broker, "dev1", USERS["dev1"], (f"{P}/d/dev1/#", f"{P}/b/status"))
    host = Peer(
        broker,
        "host-acme",
        USERS["host-acme"],
        (f"{P}/h/acme/dev1/evt", f"{P}/h/acme/dev1/u/+/evt", f"{P}/b/status"),
    )
    evt = f"{P}/d/dev1/evt"
    try:
        assert board.next(f"{P}/b/status")["st"] == "online"
        assert host.next(f"{P}/b/status")["st"] == "online"

        # The event connection drops: nothing a board acts on changes (the presence
        # stands: it follows the control connection), and it comes back.
        _drop(bridge._events)
        wait_for(lambda: bridge.stats["disconnects"] == 1, "the bridge to notice")
        board.send(evt, {"r": "0a0b0c0d.1", "i": 1, "t": "run.started", "ts": 1, "d": {}})
        wait_for(lambda: bridge.stats["connects"] == 2, "the event connection to come back")
        # What the board sent meanwhile waited in the event connection's session. That it
        # comes after no status says that none came before it (one broker, one queue
        # per subscriber, handled in order): no offline went out.
        got = host.until(lambda topic, obj: topic.endswith("/evt") and obj["r"] != "_b")
        assert [o for t, o in got if t == f"{P}/b/status"] == []
        assert got[-1][1]["i"] == 1
        assert bridge.control_connected and bridge.stats["control.disconnects"] == 0
        assert call_llm(board, 1)["ok"]["finish"] == "tool_calls"

        # The control connection drops: its will says offline, and once back it says
        # online again and serves calls and events as before.
        _drop(bridge._client)
        said = board.until(lambda t, o: _status(t, o) and o["st"] == "online")
        assert [o["st"] for t, o in said if _status(t, o)] == ["offline", "online"]
        assert bridge.stats["control.disconnects"] == 1 and bridge.stats["disconnects"] == 1
        assert call_llm(board, 2)["ok"]["finish"] == "tool_calls"
        board.send(evt, {"r": "0a0b0c0d.1", "i": 2, "t": "msg.start", "ts": 2, "d": {"m": "m1"}})
        got = host.until(lambda topic, obj: topic.endswith("/evt") and obj["r"] != "_b")
        assert got[-1][1]["i"] == 2
        wait_for(lambda: bridge.connected, "both connections up")
    finally:
        board.close()
        host.close()
        bridge.stop()


def test_a_board_or_host_cannot_log_in_as_the_control_user(
    secured: tuple[MosquittoProcess, Registry],
) -> None:
    broker, _ = secured
    for password in (USERS["dev1"], USERS["host-acme"], "guess"):
        peer = Peer(broker, CTL, password)
        try:
            assert peer.rc.is_failure
        finally:
            peer.close()
    # A device's own login with the control user's client id is its own connection under
    # its own name (client ids are bound to users), and a bridge one is not disturbed.
    bridge = Peer(broker, CTL, USERS["bridge"], (f"{P}/d/+/rpc",))
    board = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=CTL, protocol=mqtt.MQTTv311)
    board.username_pw_set("dev1", USERS["dev1"])
    board.connect(broker.host, broker.port)
    board.loop_start()
    try:
        board.publish(f"{P}/d/dev1/rpc", msgpack.packb({"c": 1}), qos=1).wait_for_publish(WAIT)
        assert bridge.next(f"{P}/d/dev1/rpc") == {"c": 1}
    finally:
        board.disconnect()
        board.loop_stop()
        bridge.close()


def test_the_control_user_is_the_bridge_users_in_the_registry(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "registry.json")
    try:
        registry.add_tenant("acme")
        entry = brokerconf.hash_password("pw")
        registry.add_user("bridge", "bridge", None, entry)
        # Nobody else may take its name: with it they would log in with the bridge's rights.
        with pytest.raises(ValueError, match="control user"):
            registry.add_user(CTL, "host", "acme", entry)
        with pytest.raises(ValueError, match="control user"):
            registry.add_user(CTL, "bridge", None, entry)
        # Nor may a bridge user come whose control user's name is taken already.
        registry.add_user("b2.ctl", "host", "acme", entry)
        with pytest.raises(ValueError, match="already exists"):
            registry.add_user("b2", "bridge", None, entry)
        # A name too long to have a control user is refused whole.
        with pytest.raises(ValueError):
            registry.add_user("b" * 126, "bridge", None, entry)
    finally:
        registry.close()


def test_the_bridge_says_which_login_the_broker_refused(
    secured: tuple[MosquittoProcess, Registry], tmp_path: Path
) -> None:
    broker, registry = secured
    config = BridgeConfig(
        host=broker.host,
        port=broker.port,
        username="bridge",
        password=USERS["bridge"],
        control_password="not-it",
        prefix=P,
        connect_timeout_s=3,
        client_id=f"bridge-{uuid.uuid4().hex[:6]}",
    )
    bridge = Bridge(config, registry, ScriptedProvider())
    with pytest.raises(Exception, match=r"control connection, user bridge\.ctl"):
        bridge.start()
    bridge.stop()
