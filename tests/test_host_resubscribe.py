"""A host client whose subscription is refused after a reconnect subscribes again, with
growing waits, and hears its runs once the broker grants it (server_bridge/host/client.py,
SUBSCRIBE_RETRY_S). Found on the NATS cluster (tests/test_fleet_cluster.py): after a
node's death the node a host reconnected to could not make its subscription in time
(`Unable to add JetStream consumer ... timeout`, a refused SUBACK), and the client stayed
connected but deaf, every request refused NotConnected, for good.

Mosquitto grants a subscription its ACL denies (2.0.11 filters at delivery instead), so
the refusal is made on the wire: a proxy in front of the real broker (tests/proxies.py)
rewrites the return codes of the SUBACKs it passes to 0x80 while told to, and cuts the
connection to make the client reconnect. The client is the real HostClient, the events
a real MQTT user's.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from server_bridge.host.client import HostClient, HostConnectError, NotConnected
from tests.proxies import SubackProxy, suback_read_first
from tests.test_host_client import run_events
from tests.waiting import wait_for

PREFIX = "wren/v1"
WAIT = 30.0  # every wait is bounded by this; none asserts on how long it took


def wait_until(check: Callable[[], bool], what: str) -> None:
    wait_for(check, what, timeout=WAIT)


def publish_run(broker: Any, tenant: str, run: str, req: str) -> None:
    """A run's events on the host topic, as the bridge publishes them."""
    pub = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
    pub.connect(broker.host, broker.port)
    pub.loop_start()
    try:
        for event in run_events(run, req):
            info = pub.publish(f"{PREFIX}/h/{tenant}/d1/evt", msgpack.packb(event), qos=1)
            info.wait_for_publish(WAIT)
            assert info.is_published()
    finally:
        pub.loop_stop()
        pub.disconnect()


class Behind:
    """A HostClient of a tenant of its own, not connected yet, reaching the broker
    through a SubackProxy; its warnings are captured."""

    def __init__(self, broker: Any) -> None:
        self.tenant = "t" + uuid.uuid4().hex[:10]
        self.proxy = SubackProxy((broker.host, broker.port))
        self.client = HostClient("127.0.0.1", self.proxy.port, self.tenant)


@pytest.fixture
def behind(broker: Any, caplog: pytest.LogCaptureFixture) -> Iterator[Behind]:
    caplog.set_level(logging.WARNING, logger="server_bridge.host.client")
    b = Behind(broker)
    try:
        yield b
    finally:
        b.client.close()
        b.proxy.close()


def test_a_subscription_refused_after_a_reconnect_is_made_again_until_it_is_granted(
    broker: Any, behind: Behind, caplog: pytest.LogCaptureFixture
) -> None:
    tenant, proxy, client = behind.tenant, behind.proxy, behind.client
    client.connect(timeout=WAIT)
    assert client.connected

    # The reconnect's subscription refused, and again when it is made again: the
    # client says so, subscribes again after a wait, and sends nothing meanwhile.
    proxy.refusing = True
    proxy.cut()
    wait_until(lambda: caplog.text.count("subscribing again") >= 2, "two refusals logged")
    assert "refused the subscription" in caplog.text
    assert "subscribing again in 1 s" in caplog.text
    assert "subscribing again in 2 s" in caplog.text  # the wait grows
    assert not client.connected
    with pytest.raises(NotConnected):
        client.request("d1", "tok", "How warm is it?")

    # Granted at its next try, on the same connection: it hears a run whole.
    refused = proxy.subacks
    proxy.refusing = False
    wait_until(lambda: client.connected, "the host subscribed again")
    assert proxy.subacks > refused
    publish_run(broker, tenant, "b00t.1", "req-after")
    snap = client.wait_run("req-after", timeout=WAIT)
    assert snap.status == "done"
    assert "".join(r.text for r in snap.rows if r.kind == "assistant") == "It is 21.5 °C."


def test_a_subscription_made_again_whose_suback_is_read_before_subscribe_returns_counts(
    broker: Any, behind: Behind, caplog: pytest.LogCaptureFixture
) -> None:
    # Made again from the repair thread, the SUBSCRIBE goes out at once and the broker's
    # SUBACK may be read on paho's network thread before subscribe() has returned its
    # mid. Forced here on every subscription made again: the real subscribe, then a
    # bounded wait until the real SUBACK has been handled, and only then the mid back.
    tenant, proxy, client = behind.tenant, behind.proxy, behind.client
    restore: Callable[[], None] | None = None
    try:
        client.connect(timeout=WAIT)
        proxy.refusing = True
        proxy.cut()
        wait_until(lambda: "subscribing again" in caplog.text, "a refusal logged")
        restore = suback_read_first(client._client, "wren-host-repair", WAIT)
        proxy.refusing = False
        wait_until(lambda: client.connected, "subscribed, its SUBACK read first")
        publish_run(broker, tenant, "b00t.2", "req-early")
        assert client.wait_run("req-early", timeout=WAIT).status == "done"
    finally:
        if restore is not None:
            restore()


def test_a_subscription_refused_at_connect_is_connects_error_and_not_made_again(
    behind: Behind, caplog: pytest.LogCaptureFixture
) -> None:
    # The first subscription is connect()'s to report (a wrong ACL is for the user to
    # fix): it raises, and nothing subscribes again behind the caller's back.
    behind.proxy.refusing = True
    with pytest.raises(HostConnectError, match="refused the subscription"):
        behind.client.connect(timeout=WAIT)
    assert not behind.client.connected
    assert "subscribing again" not in caplog.text
