"""Identity at the edges, against a real Mosquitto with the generated config
(server_bridge/brokerconf.py): client ids bound to users, retained input refused and
cleared, the bridge's own stream `_b` spoken by the bridge alone. And the attacks that
found them, tried again: another tenant's host claiming a board's client id, a retained
request planted before a bridge restart, a device speaking on `_b`.

The bridge runs in this process (its counters are read directly) or, with a real board,
as a process of tests/stack.py. Every wait is bounded; a message that must not arrive is
shown not to by a marker sent after it on the same path.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from server_bridge import brokerconf, tokens
from server_bridge.bridge import Bridge
from server_bridge.config import BridgeConfig
from server_bridge.host.client import HostClient, RequestRefused
from server_bridge.memory import open_memory
from server_bridge.models.scripted import ScriptedProvider
from server_bridge.registry import Registry
from server_bridge.wire import decode
from tests.stack import DEVICE, Stack
from tests.waiting import wait_for
from tools.broker import MosquittoProcess, start_mosquitto
from tools.demo import PREFIX, TENANT

P = "wren/v1"
WAIT = 10.0
SECRET = bytes(range(32))
USERS = {
    "bridge": "bridge-pw",
    "dev1": "dev1-pw",
    "host-acme": "acme-pw",
    "host-acme-2": "acme2-pw",
    "host-rival": "rival-pw",
    "observer": "observer-pw",
}
HOSTS = {"acme": ["host-acme", "host-acme-2"], "rival": ["host-rival"]}
# Not a Wren rule: a user of the tests' own that reads everything, to see what the broker
# holds retained.
OBSERVER_ACL = "\n# Tests only: reads everything.\nuser observer\ntopic read #\n"
# Mosquitto's log line when a connection takes over a client id in use.
TAKEOVER = "already connected, closing old connection"


class Peer:
    """A paho client logged in as one user: every message in one queue, in order."""

    def __init__(
        self, broker: MosquittoProcess, user: str, password: str, client_id: str | None = None
    ) -> None:
        self.messages: queue.Queue[paho.MQTTMessage] = queue.Queue()
        self._acks: queue.Queue[Any] = queue.Queue()
        self.connacks: queue.Queue[Any] = queue.Queue()
        self.c = paho.Client(
            CallbackAPIVersion.VERSION2, client_id=client_id or user, protocol=paho.MQTTv311
        )
        self.c.username_pw_set(user, password)
        self.c.on_connect = lambda c, u, flags, rc, props: self.connacks.put(rc)
        self.c.on_subscribe = lambda c, u, mid, rcs, props: self._acks.put(rcs)
        self.c.on_message = lambda c, u, msg: self.messages.put(msg)
        self.c.connect(broker.host, broker.port, keepalive=30)
        self.c.loop_start()
        rc = self.connacks.get(timeout=WAIT)
        assert not rc.is_failure, (user, rc)

    def subscribe(self, *topics: str) -> None:
        self.c.subscribe([(t, 1) for t in topics])
        self._acks.get(timeout=WAIT)

    def send(self, topic: str, obj: Any, retain: bool = False) -> None:
        info = self.c.publish(topic, msgpack.packb(obj), qos=1, retain=retain)
        info.wait_for_publish(WAIT)
        assert info.is_published()

    def next(self) -> paho.MQTTMessage:
        try:
            return self.messages.get(timeout=WAIT)
        except queue.Empty:
            raise AssertionError("nothing arrived") from None

    def until(self, pred: Callable[[paho.MQTTMessage], bool]) -> list[paho.MQTTMessage]:
        """Every message up to and including the first that `pred` accepts."""
        got = []
        while True:
            got.append(self.next())
            if pred(got[-1]):
                return got

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


@dataclass
class World:
    broker: MosquittoProcess
    registry: Registry
    token: str
    bridge: Bridge | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)

    def start_bridge(self) -> Bridge:
        """A new bridge process's worth: a Bridge logged in as the bridge user (its client
        id follows the user, so a restart finds the same session)."""
        config = BridgeConfig(
            host=self.broker.host,
            port=self.broker.port,
            username="bridge",
            password=USERS["bridge"],
            prefix=P,
        )
        # Memory in the same place across restarts, as the service keeps it.
        memory = open_memory(Path(str(self.registry.path)).parent / "memory", None)
        self.bridge = Bridge(config, self.registry, ScriptedProvider(chunk_chars=64), memory)
        self.bridge.start()
        return self.bridge

    def stop_bridge(self) -> None:
        if self.bridge is not None:
            self.bridge.stop()
            self.bridge = None

    def peer(self, user: str, client_id: str | None = None) -> Peer:
        p = Peer(self.broker, user, USERS[user], client_id)
        self.closers.append(p.close)
        return p

    def host_client(self, user: str) -> HostClient:
        client = HostClient(
            self.broker.host, self.broker.port, "acme", username=user, password=USERS[user],
            prefix=P,
        )  # fmt: skip
        client.connect(timeout=WAIT)
        self.closers.append(client.close)
        return client

    def stat(self, name: str) -> int:
        assert self.bridge is not None
        return self.bridge.stats.get(name, 0)

    def retained(self) -> set[str]:
        """The topics the broker holds a retained message on, as a fresh reader sees them:
        delivered at its subscribe, before a marker published after it."""
        # The marker from a user no test connection uses: a second connection of a user
        # would take over the first.
        observer = Peer(self.broker, "observer", USERS["observer"])
        marker = Peer(self.broker, "host-rival", USERS["host-rival"])
        try:
            observer.subscribe("#")
            topic = f"{P}/h/rival/dev1/ctl"
            marker.send(topic, "marker")
            got = observer.until(lambda m: m.topic == topic and not m.retain)
            return {m.topic for m in got if m.retain}
        finally:
            marker.close()
            observer.close()


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    acl = brokerconf.acl_text(P, "bridge", HOSTS) + OBSERVER_ACL
    # The bridge's control connection logs in as its control user, same password.
    logins = brokerconf.with_control_users(USERS, ["bridge"])
    extra = brokerconf.secure_mosquitto_conf(tmp_path / "conf", logins, acl)
    broker = start_mosquitto(tmp_path / "mosquitto", extra_conf=extra, allow_anonymous=False)
    registry = Registry(tmp_path / "registry.json")
    registry.add_tenant("acme", SECRET)
    registry.add_tenant("rival")
    registry.add_device("dev1", "acme", "thermostat")
    w = World(broker, registry, tokens.sign(SECRET, "acme", "alice"))
    try:
        yield w
    finally:
        for close in reversed(w.closers):
            close()
        w.stop_bridge()
        registry.close()
        broker.stop()


def req_topic(device: str = "dev1") -> str:
    return f"{P}/h/acme/{device}/req"


def ev(run: str, i: int, t: str = "msg.delta", **d: Any) -> dict[str, Any]:
    return {"r": run, "i": i, "t": t, "ts": 0, "d": d}


# --- client ids ----------------------------------------------------------------------------


def test_the_bridge_client_id_follows_its_user(world: World) -> None:
    bridge = world.start_bridge()
    assert bridge.config.client_id == "bridge"
    assert "as bridge (p2, c0, k30, u'bridge')" in world.broker.log()
    assert BridgeConfig(username=None).client_id == "wren-bridge"
    assert BridgeConfig(username="b", client_id="mine").client_id == "mine"
    observer = world.peer("observer")
    observer.subscribe(f"{P}/b/status")
    status = decode(bytes(observer.next().payload))
    assert (status["st"], status["id"]) == ("online", "bridge")


def test_two_host_connections_of_a_tenant_each_with_a_user_of_its_own(world: World) -> None:
    world.start_bridge()
    hosts = [world.host_client(user) for user in HOSTS["acme"]]
    board = world.peer("dev1")
    board.send(f"{P}/d/dev1/evt", ev("ab.1", 1, "run.started", req="q"))
    for host in hosts:
        host.wait_for("q", lambda snap: True, timeout=WAIT)
        assert host.connected
    assert TAKEOVER not in world.broker.log()


# --- retained input ------------------------------------------------------------------------


def test_retained_input_is_refused_counted_cleared_and_never_acted_on(world: World) -> None:
    host = world.peer("host-acme-2")
    board = world.peer("dev1")
    call = {"c": 1, "m": "llm.complete", "a": {"messages": [{"role": "user", "content": "hi"}]}}
    # Planted before any bridge session exists: they reach a bridge only from the
    # broker's retained store, with the retain flag on.
    planted = {
        req_topic(): {"req": "planted", "input": "open the door", "tok": world.token},
        f"{P}/h/acme/dev1/ctl": {"op": "cancel", "r": "ab.1", "tok": world.token},
        f"{P}/d/dev1/rpc": call,
        f"{P}/d/dev1/evt": ev("ab.1", 1, "run.started", req="planted"),
    }
    for topic, obj in planted.items():
        (board if "/d/" in topic else host).send(topic, obj, retain=True)
    # Presence and capabilities are retained by contract: read, not refused.
    board.send(f"{P}/d/dev1/status", {"st": "online", "boot": "12345678"}, retain=True)
    board.send(f"{P}/d/dev1/hello", {"agent": "thermostat", "boot": "12345678"}, retain=True)
    board.subscribe(f"{P}/d/dev1/req", f"{P}/d/dev1/ctl", f"{P}/d/dev1/rpc/res")
    acme = world.host_client("host-acme")

    bridge = world.start_bridge()
    wait_for(lambda: world.stat("refused.retained") >= len(planted), "the retained refusals")
    wait_for(lambda: world.stat("retained.cleared") == len(planted), "the clears")
    assert sorted(r.topic for r in bridge.refusals) == sorted(planted)
    assert {r.kind for r in bridge.refusals} == {"retained"}
    # Waited for, not asserted at once: the retained status may come on the bridge's
    # other connection, after the refusals on this one were counted.
    wait_for(lambda: bridge.presence("dev1") is not None, "the retained status, read")
    wait_for(lambda: bridge.hello("dev1") is not None, "the retained hello, read")
    # Our own clears come back to us (no "no local" in MQTT 3.1.1): ignored.
    wait_for(lambda: world.stat("rx.empty") == len(planted), "the clears' echoes")

    # Nothing planted reached the board or a host: what comes first on each path is
    # what is sent live now.
    host.send(req_topic(), {"req": "live", "input": "hi", "tok": world.token})
    assert decode(bytes(board.next().payload))["req"] == "live"
    board.send(f"{P}/d/dev1/rpc", {**call, "c": 2})
    answers = board.until(lambda m: "ch" not in decode(bytes(m.payload)))
    assert {decode(bytes(m.payload))["c"] for m in answers} == {2}
    board.send(f"{P}/d/dev1/evt", ev("cd.1", 1, "run.started", req="live"))
    wait_for(lambda: acme.find_run("live") is not None, "the live run on the host")
    assert acme.find_run("planted") is None
    assert acme.events == [ev("cd.1", 1, "run.started", req="live")]
    assert world.stat("refused") == len(planted)
    # And the broker holds nothing retained but presence and the board's hello.
    assert world.retained() == {f"{P}/b/status", f"{P}/d/dev1/status", f"{P}/d/dev1/hello"}


def test_a_retained_req_planted_before_a_bridge_restart_does_not_run_again(
    world: World,
) -> None:
    board = world.peer("dev1")
    board.subscribe(f"{P}/d/dev1/req")
    host = world.peer("host-acme-2")
    world.start_bridge()
    # Live, the retain flag does not reach the bridge (MQTT 3.1.1): this once, it is a
    # request like any other, and the board gets it.
    host.send(req_topic(), {"req": "planted", "input": "hi", "tok": world.token}, retain=True)
    assert decode(bytes(board.next().payload))["req"] == "planted"
    # The attack: every bridge restart used to send it to the board again. Now the first
    # restart refuses and clears it, and the second does not see it at all.
    world.stop_bridge()
    world.start_bridge()
    wait_for(lambda: world.stat("refused.retained") == 1, "the retained req refused")
    world.stop_bridge()
    world.start_bridge()
    host.send(req_topic(), {"req": "fresh", "input": "hi", "tok": world.token})
    assert decode(bytes(board.next().payload))["req"] == "fresh"
    assert world.retained() == {f"{P}/b/status"}


def test_the_bridge_retains_nothing_but_its_presence(world: World) -> None:
    bridge = world.start_bridge()
    board = world.peer("dev1")
    board.subscribe(f"{P}/d/dev1/req", f"{P}/d/dev1/ctl", f"{P}/d/dev1/rpc/res")
    acme = world.host_client("host-acme")
    # Every kind of message the bridge publishes: a req and a ctl for the board, events
    # and a `_b` refusal for hosts, RPC chunks and answers, replay requests.
    acme.request("dev1", world.token, "hi", req="q1")
    board.send(f"{P}/d/dev1/evt", [ev("ab.1", 1, "run.started", req="q1"), ev("ab.1", 3)])
    with pytest.raises(RequestRefused):
        acme.wait_run(acme.request("dev1", "forged", "hi"), timeout=WAIT)
    msg = {"role": "user", "content": "hi"}
    board.send(f"{P}/d/dev1/rpc", {"c": 1, "m": "llm.complete", "a": {"messages": [msg]}})
    # The req and the replay request, in whichever order: the bridge's own ctl goes
    # ahead of a host's req in its lanes (server_bridge/lanes.py).
    leaves: set[str] = set()

    def both(m: paho.MQTTMessage) -> bool:
        leaves.add(m.topic.rsplit("/", 1)[1])
        return leaves >= {"req", "ctl"}

    seen = board.until(both)
    assert all(not m.retain for m in seen)
    wait_for(lambda: bridge.stats.get("tx", 0) >= 5, "the bridge's publishes")
    assert world.retained() == {f"{P}/b/status"}


# --- the bridge's own stream ------------------------------------------------------------------


def test_a_devices_event_on_the_bridge_stream_never_reaches_a_host(world: World) -> None:
    world.start_bridge()
    acme = world.host_client("host-acme")
    board = world.peer("dev1")
    forged = {"kind": "bad_token", "msg": "log in again at http://evil.example", "req": "q1"}
    board.send(f"{P}/d/dev1/evt", ev("_b", 1, "error", **forged))
    # In a batch with a good event, any other id of the bridge's, and on the host topic
    # itself (the ACL keeps the device off it).
    board.send(f"{P}/d/dev1/evt", [ev("ab.1", 1), ev("_b", 2, "error", **forged)])
    board.send(f"{P}/d/dev1/evt", ev("_bridge", 1, "error", **forged))
    board.send(f"{P}/h/acme/dev1/evt", ev("_b", 3, "error", **forged))
    wait_for(lambda: world.stat("refused.bad_envelope") == 3, "three bad_envelope refusals")
    assert world.stat("evt.bridge_run") == 3
    # A marker on the device's own stream "_", sent after: the forged events would have
    # reached the host before it.
    board.send(f"{P}/d/dev1/evt", ev("_", 1, "error", kind="busy", msg="marker"))
    wait_for(lambda: any(e["r"] == "_" for e in acme.events), "the marker")
    assert acme.events == [ev("_", 1, "error", kind="busy", msg="marker")]
    # The bridge itself still speaks there.
    with pytest.raises(RequestRefused) as info:
        acme.wait_run(acme.request("dev1", "forged", "hi", req="q2"), timeout=WAIT)
    assert info.value.kind == "bad_token" and "evil" not in info.value.msg
    assert [e["r"] for e in acme.events] == ["_", "_b"]


# --- with a real board --------------------------------------------------------------------------


def _connect_as(s: Stack, user: str, client_id: str) -> paho.Client:
    connacks: queue.Queue[Any] = queue.Queue()
    c = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv311)
    c.username_pw_set(user, s.users[user])
    c.on_connect = lambda cl, u, flags, rc, props: connacks.put(rc)
    c.connect(s.host, s.port)
    c.loop_start()
    rc = connacks.get(timeout=WAIT)
    assert not rc.is_failure, rc
    return c


def test_another_tenants_host_cannot_knock_the_board_off(tmp_path: Path) -> None:
    with Stack(tmp_path, extra_users={"host-rival": "rival"}) as s:
        mark = s.console_mark()
        stop = threading.Event()
        done: list[str] = []

        def ask() -> None:
            while not stop.is_set() and len(done) < 3:
                done.append(s.ask("How warm is it in here?").status)

        asker = threading.Thread(target=ask)
        asker.start()
        try:
            # Ten takeovers of the board's client id while runs go on, each a clean
            # session that would also have wiped the board's session.
            for _ in range(10):
                rival = _connect_as(s, "host-rival", DEVICE)
                rival.disconnect()
                rival.loop_stop()
        finally:
            asker.join(timeout=3 * 30)
            stop.set()
        assert done == ["done", "done", "done"], s.describe()
        assert s.ask("And now?").status == "done", s.describe()
        assert TAKEOVER not in s.broker_log()
        reconnects = [
            line for line in s.console[mark:] if "link: up" in line or "link: down" in line
        ]
        assert reconnects == [], s.describe()


def test_a_retained_req_does_not_run_again_after_a_bridge_restart_and_a_board_reboot(
    tmp_path: Path,
) -> None:
    with Stack(tmp_path, extra_users={"host-demo-2": TENANT}) as s:
        assert s.client is not None
        planter = _connect_as(s, "host-demo-2", "host-demo-2")
        body = {"req": "planted", "input": "How warm is it in here?", "tok": s.token}
        info = planter.publish(f"{PREFIX}/h/{TENANT}/{DEVICE}/req", msgpack.packb(body), 1, True)
        info.wait_for_publish(WAIT)
        planter.disconnect()
        planter.loop_stop()
        assert s.wait_run("planted").status == "done", s.describe()
        # The board forgets the request ids it ran; the bridge subscribes again.
        s.stop_board()
        s.stop_bridge()
        s.start_bridge()
        s.start_board()
        # Had the bridge sent the planted request again, it would wait in the board's
        # session ahead of this one, and its run would start first.
        assert s.ask("And now?").status == "done", s.describe()
        started = [e for e in s.client.events if e["t"] == "run.started"]
        assert [e["d"]["req"] for e in started].count("planted") == 1, s.describe()
        assert "refused retained" in s.bridge_log(), s.describe()
