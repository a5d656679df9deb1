"""HostClient against a real Mosquitto; a plain paho client plays the bridge."""

from __future__ import annotations

import logging
import queue
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from server_bridge import tokens, wire
from server_bridge.host.client import (
    HOST_LIMITS,
    HostClient,
    HostConnectError,
    RequestRefused,
    decode_events,
)
from server_bridge.host.reducer import RunSnapshot
from tools.broker import free_port

PREFIX = "wren/v1"
WAIT = 10.0  # every wait is bounded by this; none of them asserts on how long it took


class FakeBridge:
    """The bridge's side of the host topics: reads P/h/T/+/req, publishes P/h/T/D/evt."""

    def __init__(self, host: str, port: int, tenant: str) -> None:
        self.tenant = tenant
        self.requests: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self._subscribed: queue.Queue[bool] = queue.Queue()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda *a: self._subscribed.put(True)
        self.client.on_message = self._on_message
        self.client.connect(host, port)
        self.client.loop_start()
        assert self._subscribed.get(timeout=WAIT)

    def _on_connect(self, client: mqtt.Client, *args: Any) -> None:
        client.subscribe(f"{PREFIX}/h/{self.tenant}/+/req", qos=1)

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        self.requests.put((msg.topic, msgpack.unpackb(msg.payload)))

    def publish(self, device: str, payload: Any, raw: bool = False) -> None:
        data = payload if raw else msgpack.packb(payload)
        info = self.client.publish(f"{PREFIX}/h/{self.tenant}/{device}/evt", data, qos=1)
        info.wait_for_publish(WAIT)
        assert info.is_published()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def ev(run: str, i: int, t: str, **d: Any) -> dict[str, Any]:
    return {"r": run, "i": i, "t": t, "ts": i, "d": d}


def run_events(run: str, req: str) -> list[dict[str, Any]]:
    return [
        ev(
            run,
            1,
            "run.started",
            agent="thermo",
            ver="1",
            req=req,
            conv="c1",
            domain="request",
            input="How warm is it?",
        ),
        ev(run, 2, "msg.start", m=1, role="assistant"),
        ev(run, 3, "msg.delta", m=1, text="It is "),
        ev(run, 4, "msg.delta", m=1, text="21.5 °C."),
        ev(run, 5, "msg.end", m=1),
        ev(run, 6, "run.done", usage={"in": 12, "out": 8, "reason": 0}),
    ]


@pytest.fixture
def tenant() -> str:
    # A tenant of its own per test: the session broker is shared with other tests.
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def bridge(broker: Any, tenant: str) -> Iterator[FakeBridge]:
    b = FakeBridge(broker.host, broker.port, tenant)
    yield b
    b.close()


@pytest.fixture
def host(broker: Any, tenant: str) -> Iterator[HostClient]:
    with HostClient(broker.host, broker.port, tenant) as client:
        client.connect(timeout=WAIT)
        yield client


def test_request_is_published_with_token_and_run_is_folded(
    bridge: FakeBridge, host: HostClient, tenant: str
) -> None:
    token = tokens.sign(b"secret", tenant, "alice")
    req = host.request("thermo-1", token, "How warm is it?", conv="c1", ttl=30)
    topic, body = bridge.requests.get(timeout=WAIT)
    assert topic == f"{PREFIX}/h/{tenant}/thermo-1/req"
    assert body == {"req": req, "conv": "c1", "input": "How warm is it?", "ttl": 30, "tok": token}
    assert len(req) == 32 and int(req, 16) >= 0  # uuid4 hex
    assert tokens.verify(b"secret", body["tok"], tenant).user == "alice"

    for e in run_events("run-a", req):
        bridge.publish("thermo-1", e)
    snap = host.wait_run(req, timeout=WAIT)
    assert snap.status == "done" and snap.run == "run-a" and snap.device == "thermo-1"
    assert [(r.kind, r.text) for r in snap.rows] == [
        ("user", "How warm is it?"),
        ("assistant", "It is 21.5 °C."),
    ]
    assert (snap.usage.tokens_in, snap.usage.tokens_out) == (12, 8)
    assert [e["i"] for e in host.events] == [1, 2, 3, 4, 5, 6]


def test_request_with_given_req_and_no_optional_fields(
    bridge: FakeBridge, host: HostClient
) -> None:
    assert host.request("dev", "tok", "hi", req="my-req") == "my-req"
    _, body = bridge.requests.get(timeout=WAIT)
    assert body == {"req": "my-req", "input": "hi", "tok": "tok"}


def test_malformed_payloads_are_counted_and_the_client_keeps_working(
    bridge: FakeBridge, host: HostClient
) -> None:
    bridge.publish("dev", b"\xc1", raw=True)  # a reserved msgpack byte
    bridge.publish("dev", b"\x92\x01", raw=True)  # an array that ends early
    bridge.publish("dev", msgpack.packb({"r": "x"}) + b"\x00", raw=True)  # trailing bytes
    bridge.publish("dev", "just a string")  # msgpack, but not an envelope
    bridge.publish("dev", {"r": "run-b", "i": "one", "t": "run.started", "ts": 1, "d": {}})
    bridge.publish("dev", b"\xd4\x01\x00", raw=True)  # an ext type, which the contract lacks
    # A batch (a list of envelopes), duplicates and an unknown event type are fine.
    events = run_events("run-b", "req-b")
    bridge.publish("dev", events[:3])
    for e in events:
        bridge.publish("dev", e)
    bridge.publish("dev", ev("run-b", 7, "hologram.beam"))  # a type newer than this host
    snap = host.wait_for("req-b", lambda s: s.last_id == 7, timeout=WAIT)
    assert snap.status == "done" and snap.rows[1].text == "It is 21.5 °C."
    assert host.malformed == 6


def test_the_host_decodes_with_the_bridges_codec_and_checks() -> None:
    # The same refusals, with the same kinds, as the bridge's wire module.
    cases = [
        (b"\xc1", wire.BadType),
        (b"\x92\x01", wire.Truncated),
        (b"\x91" * 40 + b"\x01", wire.TooDeep),
        (msgpack.packb({"r": "x", "i": 1, "t": "msg.delta", "d": {}}), wire.BadEnvelope),  # no ts
        (msgpack.packb([]), wire.BadEnvelope),
    ]
    for payload, error in cases:
        with pytest.raises(error):
            decode_events(payload)
    big = ev("r", 1, "msg.delta", m=1, text="x" * 100_000)  # over the bridge's 8 KiB
    assert decode_events(msgpack.packb(big)) == [big]
    assert HOST_LIMITS.max_str > wire.Limits().max_str


def test_callback_errors_are_logged_and_do_not_stop_delivery(
    bridge: FakeBridge, host: HostClient, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[tuple[int, str]] = []

    def on_event(envelope: dict[str, Any], snap: RunSnapshot) -> None:
        seen.append((envelope["i"], snap.status))
        if envelope["i"] == 2:
            raise RuntimeError("dashboard bug")

    host.on_event = on_event
    with caplog.at_level(logging.ERROR, logger="server_bridge.host.client"):
        for e in run_events("run-c", "req-c"):
            bridge.publish("dev", e)
        snap = host.wait_run("req-c", timeout=WAIT)
    assert snap.status == "done"
    assert [i for i, _ in seen] == [1, 2, 3, 4, 5, 6] and seen[-1][1] == "done"
    assert host.callback_errors == 1
    assert any("dashboard bug" in (r.exc_text or "") for r in caplog.records)


def test_wait_run_times_out_with_what_was_seen(bridge: FakeBridge, host: HostClient) -> None:
    bridge.publish("dev", ev("_", 1, "error", kind="bad_token", msg="session token has expired"))
    events = run_events("run-d", "req-d")
    for e in events[:3]:
        bridge.publish("dev", e)
    # Ordered on one topic: once run-d has its third event, the device error is in too.
    host.wait_for("req-d", lambda snap: snap.last_id >= 3, timeout=WAIT)
    with pytest.raises(TimeoutError, match="run run-d for request req-d is still running"):
        host.wait_run("req-d", timeout=0.2)
    with pytest.raises(TimeoutError) as info:
        host.wait_run("req-never", timeout=0.2)
    assert "no run started for request req-never" in str(info.value)
    assert "session token has expired" in str(info.value)


def test_a_refusal_naming_the_request_ends_the_wait_at_once(
    bridge: FakeBridge, host: HostClient
) -> None:
    req = host.request("dev", "stale-token", "hi")
    bridge.requests.get(timeout=WAIT)
    # Another request's refusal, and one naming no request, do not end this wait ...
    bridge.publish("dev", ev("_b", 1, "error", kind="bad_token", msg="other", req="other-req"))
    bridge.publish("dev", ev("_b", 2, "error", kind="bad_envelope", msg="no req"))
    with pytest.raises(TimeoutError):
        host.wait_run(req, timeout=0.3)
    # ... this one does, as RequestRefused, well before the timeout.
    bridge.publish(
        "dev", ev("_b", 3, "error", kind="bad_token", msg="session token has expired", req=req)
    )
    with pytest.raises(RequestRefused) as info:
        host.wait_run(req, timeout=60)
    assert (info.value.kind, info.value.msg, info.value.req) == (
        "bad_token",
        "session token has expired",
        req,
    )


def test_a_busy_board_refuses_on_its_device_stream(bridge: FakeBridge, host: HostClient) -> None:
    req = host.request("dev", "tok", "hi")
    bridge.publish("dev", ev("_", 1, "error", kind="busy", msg="the board is busy", req=req))
    with pytest.raises(RequestRefused, match="busy"):
        host.wait_run(req, timeout=60)


def test_a_resent_request_forgets_the_old_refusal(bridge: FakeBridge, host: HostClient) -> None:
    req = host.request("dev", "tok", "hi", req="again")
    bridge.publish("dev", ev("_b", 1, "error", kind="bad_token", msg="expired", req=req))
    with pytest.raises(RequestRefused):
        host.wait_run(req, timeout=60)
    host.request("dev", "fresh-tok", "hi", req="again")  # the same req, a new attempt
    for e in run_events("run-again", "again"):
        bridge.publish("dev", e)
    assert host.wait_run("again", timeout=WAIT).status == "done"


def test_a_refusal_after_the_run_started_does_not_end_the_wait(
    bridge: FakeBridge, host: HostClient
) -> None:
    events = run_events("run-r", "req-r")
    bridge.publish("dev", events[0])
    host.wait_for("req-r", lambda s: True, timeout=WAIT)
    # A repeat of req-r with a stale token was refused; the run it started goes on.
    bridge.publish("dev", ev("_b", 1, "error", kind="bad_token", msg="expired", req="req-r"))
    for e in events[1:]:
        bridge.publish("dev", e)
    assert host.wait_run("req-r", timeout=WAIT).status == "done"


def test_wait_for_a_pause_on_a_client_tool(bridge: FakeBridge, host: HostClient) -> None:
    bridge.publish("dev", ev("run-p", 1, "run.started", req="req-p", input="Water them?"))
    bridge.publish(
        "dev", ev("run-p", 2, "tool.call", call="k1", name="confirm", input="{}", client=True)
    )
    bridge.publish("dev", ev("run-p", 3, "run.paused", reason="client", calls=["k1"]))
    snap = host.wait_for("req-p", lambda s: s.status == "paused", timeout=WAIT)
    assert list(snap.pending) == ["k1"]


def test_events_of_several_devices_are_kept_apart(bridge: FakeBridge, host: HostClient) -> None:
    # Two boards may use the same run id; they are different runs.
    for e in run_events("same", "req-1"):
        bridge.publish("dev-one", e)
    for e in run_events("same", "req-2"):
        bridge.publish("dev-two", e)
    assert host.wait_run("req-1", timeout=WAIT).device == "dev-one"
    assert host.wait_run("req-2", timeout=WAIT).device == "dev-two"
    assert sorted(s.device or "" for s in host.runs()) == ["dev-one", "dev-two"]
    assert [s.req for s in host.runs("dev-two")] == ["req-2"]


def test_connect_to_nothing_raises_a_clear_error() -> None:
    port = free_port()
    client = HostClient("127.0.0.1", port, "acme")
    with pytest.raises(HostConnectError, match=f"127.0.0.1:{port}"):
        client.connect(timeout=5)
    client.close()


def test_bad_device_id_is_refused_before_publishing(host: HostClient) -> None:
    from server_bridge.topics import BadTopic

    with pytest.raises(BadTopic):
        host.request("Bad/Device", "tok", "hi")


def test_refused_credentials_raise_a_clear_error(tmp_path: Any) -> None:
    from tools.broker import start_mosquitto

    # A broker that admits no one: every CONNECT is answered "not authorized".
    locked = start_mosquitto(tmp_path, allow_anonymous=False)
    try:
        client = HostClient(locked.host, locked.port, "acme", username="eve", password="x")
        with pytest.raises(HostConnectError, match="refused the connection"):
            client.connect(timeout=WAIT)
        assert not client.connected
        client.close()
    finally:
        locked.stop()
