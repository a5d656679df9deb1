"""A bridge whose subscriptions are refused after a reconnect subscribes again, with
growing waits, each refusal logged, until the broker grants them (server_bridge/bridge.py
_RESUBSCRIBE_S; fleet partitions: server_bridge/links.py RESUBSCRIBE_S). Before, a
refusal once serving was logged and left: the connection read nothing more until its
next reconnect, and a control connection never said the bridge online again, so its
boards and hosts saw it offline (its will) for good. Seen as a NATS node's refused
subscription of a host after another node's death (tests/test_fleet_cluster.py); a
bridge's link or partition on that node would have been refused the same way.

The refusal is made on the wire by tests/proxies.py in front of a real Mosquitto; the
bridge, its links and the fleet's partition connections are the real ones.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from server_bridge.bridge import Bridge
from server_bridge.config import BridgeConfig
from server_bridge.links import PartitionLinks, PartitionPlan
from server_bridge.models.scripted import ScriptedProvider
from server_bridge.registry import Registry
from server_bridge.topics import bridge_topic
from tests.proxies import SubackProxy, suback_read_first
from tests.waiting import wait_for
from tools.broker import mosquitto_binary, start_mosquitto

P = "wren/v1"
WAIT = 30.0  # every wait is bounded by this; none asserts on how long it took

pytestmark = pytest.mark.skipif(mosquitto_binary() is None, reason="mosquitto is not installed")


def wait_until(check: Callable[[], bool], what: str) -> None:
    wait_for(check, what, timeout=WAIT)


class StatusWatcher:
    """The bridge's presence as boards and hosts read it: the retained P/b/status."""

    def __init__(self, host: str, port: int) -> None:
        self.seen: list[str] = []
        self._lock = threading.Lock()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
        self.client.on_connect = lambda c, *a: c.subscribe(bridge_topic(P), 1)
        self.client.on_message = self._on_message
        self.client.connect(host, port)
        self.client.loop_start()

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        st = msgpack.unpackb(msg.payload, raw=False).get("st") if msg.payload else ""
        with self._lock:
            self.seen.append(str(st))

    def last(self) -> str | None:
        with self._lock:
            return self.seen[-1] if self.seen else None

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


class Rig:
    """A bridge started behind the proxy, online, and a watcher of its presence."""

    def __init__(self, tmp_path: Path) -> None:
        self.broker = start_mosquitto(tmp_path / "mosquitto")
        self.registry = Registry(tmp_path / "registry.json")
        self.registry.add_tenant("acme", "ab" * 16)
        self.registry.add_device("dev1", "acme", "thermostat")
        self.proxy = SubackProxy((self.broker.host, self.broker.port))
        self.watcher = StatusWatcher(self.broker.host, self.broker.port)
        config = BridgeConfig(host="127.0.0.1", port=self.proxy.port, prefix=P,
                              offline_grace_s=0)  # fmt: skip
        self.bridge = Bridge(config, self.registry, ScriptedProvider())

    def close(self) -> None:
        self.bridge.stop()
        self.watcher.close()
        self.proxy.close()
        self.registry.close()
        self.broker.stop()


@pytest.fixture
def rig(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Iterator[Rig]:
    caplog.set_level(logging.INFO, logger="wren.bridge")
    r = Rig(tmp_path)
    try:
        r.bridge.start()
        wait_until(lambda: r.watcher.last() == "online", "the bridge online")
        yield r
    finally:
        r.close()


def test_a_bridge_refused_its_subscriptions_after_a_reconnect_subscribes_again_and_is_online(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    bridge, proxy, watcher = rig.bridge, rig.proxy, rig.watcher
    # What the bridge itself says, counted: paho may send an earlier "online" again
    # after the cut (its PUBACK lost with the connection), behind the will.
    said_online: list[float] = []
    say_online = bridge._say_online

    def counted() -> None:
        said_online.append(time.monotonic())
        say_online()

    bridge._say_online = counted  # type: ignore[method-assign]

    # Every connection of the bridge cut: the broker says its will (offline), and
    # the subscriptions of each reconnect are refused, and again when made again.
    proxy.refusing = True
    proxy.cut()
    wait_until(lambda: "offline" in watcher.seen, "the bridge's will")
    wait_until(
        lambda: (
            "refused bridge subscriptions" in caplog.text
            and caplog.text.count("subscribing again in 2 s") >= 2
        ),
        "the control connection's and a link's second refusals logged",
    )
    assert "subscribing again in 1 s" in caplog.text
    assert "broker refused the event connection's subscriptions" in caplog.text
    assert said_online == []  # not online while it reads nothing

    # Granted at a next try, on the same connections: online again, every link read.
    proxy.refusing = False
    wait_until(lambda: said_online, "the bridge saying it is online again")
    wait_until(lambda: watcher.last() == "online", "the bridge online again")
    wait_until(
        lambda: (
            "granted the bridge's subscriptions again (control connection)" in caplog.text
            and "granted the bridge's subscriptions again (event connection)" in caplog.text
        ),
        "the grants logged",
    )
    assert bridge.stats["resubscribes"] >= 4


def test_a_control_subscription_made_again_whose_suback_is_read_first_says_online(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    # Made again from the housekeeping thread, the SUBSCRIBE goes out at once and its
    # SUBACK may be read on the network thread before subscribe() has returned the mid.
    # Forced: the real subscribe, then a bounded wait until that SUBACK is handled.
    control = rig.bridge._client
    assert control is not None
    restore = suback_read_first(control, "wren-bridge-housekeeping", WAIT)
    try:
        rig.proxy.refusing = True
        rig.proxy.cut()
        wait_until(lambda: "refused bridge subscriptions" in caplog.text, "a refusal logged")
        rig.proxy.refusing = False
        wait_until(lambda: rig.watcher.last() == "online", "online, its SUBACK read first")
    finally:
        restore()


def test_a_fleet_partition_refused_its_subscriptions_subscribes_again_until_granted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A partition's connection as a fleet bridge makes it (never reconnected by paho,
    # subscribed at CONNACK), held by PartitionLinks, whose tick is the bridge's
    # housekeeping: here called by the test, as the lease keeper is not needed.
    caplog.set_level(logging.INFO, logger="wren.bridge.links")
    broker = start_mosquitto(tmp_path / "mosquitto")
    registry = Registry(tmp_path / "registry.json")
    registry.add_tenant("acme", "ab" * 16)
    for k in range(6):
        registry.add_device(f"dev{k}", "acme", "thermostat")
    proxy = SubackProxy((broker.host, broker.port))
    counted: list[str] = []
    parts: PartitionLinks | None = None

    def make(part: int) -> mqtt.Client:
        assert parts is not None
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=f"part-{part}", protocol=mqtt.MQTTv311,
            clean_session=False, reconnect_on_failure=False,
        )  # fmt: skip
        client.user_data_set(part)
        client.on_connect = parts.on_connect
        client.on_disconnect = parts.on_disconnect
        client.on_subscribe = parts.on_subscribe
        return client

    def connect(client: mqtt.Client) -> None:
        client.connect_async("127.0.0.1", proxy.port)
        client.loop_start()

    parts = PartitionLinks(
        PartitionPlan(P, 1), make, connect, registry.devices, lambda part: 1, counted.append
    )
    ticking = threading.Event()

    def tick() -> None:
        assert parts is not None
        while not ticking.wait(0.05):
            parts.tick(time.monotonic())

    ticker = threading.Thread(target=tick, daemon=True)
    try:
        proxy.refusing = True
        parts.gain(0, 1)
        ticker.start()
        wait_until(lambda: caplog.text.count("refused partition 0's subscriptions") >= 2,
                   "two refusals of the partition's subscriptions")  # fmt: skip
        assert "subscribing again in 1 s" in caplog.text
        assert "subscribing again in 2 s" in caplog.text
        refused = proxy.subacks
        proxy.refusing = False
        wait_until(lambda: "granted partition 0's subscriptions again" in caplog.text,
                   "the partition's subscriptions granted")  # fmt: skip
        assert proxy.subacks > refused
        assert parts.up(0)
        # What it was refused is what it reads: every board's topics and its host input.
        assert sorted(parts.topics(0)) == sorted(
            t for d in registry.devices() for t in parts.plan.device_topics(d)
        )
    finally:
        ticking.set()
        parts.close()
        proxy.close()
        registry.close()
        broker.stop()
