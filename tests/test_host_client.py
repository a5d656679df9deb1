"""HostClient against a real Mosquitto; a plain paho client plays the bridge."""

from __future__ import annotations

import logging
import queue
import threading
import time
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
    BrokerRefused,
    HostClient,
    HostConnectError,
    RequestRefused,
    decode_events,
)
from server_bridge.host.reducer import RunSnapshot
from server_bridge.host.terminal import render
from tests.stack import forget_bridge_status
from tools.broker import free_port

PREFIX = "wren/v1"
WAIT = 10.0  # every wait is bounded by this; none of them asserts on how long it took


class FakeBridge:
    """The bridge's side of the host topics: reads P/h/T/+/req and P/h/T/+/ctl,
    publishes P/h/T/D/evt, and answers a host's replay like the bridge: the events of
    the run past `after` from what it published (its window), a gap on its stream `_b`
    for ids it never had, `unknown_run` for the runs in `unknown`."""

    def __init__(self, host: str, port: int, tenant: str) -> None:
        self.tenant = tenant
        self.requests: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self.ctls: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self.unknown: set[str] = set()
        self.answer_replays = True
        # (device, run) -> id -> envelope: every event published, or withheld.
        self.window: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
        self._bridge_ids: dict[str, int] = {}
        self._lock = threading.Lock()
        self._subscribed: queue.Queue[bool] = queue.Queue()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda *a: self._subscribed.put(True)
        self.client.on_message = self._on_message
        self.client.connect(host, port)
        self.client.loop_start()
        assert self._subscribed.get(timeout=WAIT)

    def _on_connect(self, client: mqtt.Client, *args: Any) -> None:
        client.subscribe(
            [(f"{PREFIX}/h/{self.tenant}/+/req", 1), (f"{PREFIX}/h/{self.tenant}/+/ctl", 1)]
        )

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        body = msgpack.unpackb(msg.payload)
        if msg.topic.endswith("/req"):
            self.requests.put((msg.topic, body))
            return
        self.ctls.put((msg.topic, body))
        if body.get("op") == "replay" and self.answer_replays:
            self._replay(msg.topic.split("/")[-2], body["r"], body["after"])

    def _replay(self, device: str, run: str, after: int) -> None:
        # On paho's network thread: publish without waiting for the acknowledgement.
        topic = f"{PREFIX}/h/{self.tenant}/{device}/evt"
        if run in self.unknown:
            self._publish_bridge_error(device, {"kind": "unknown_run", "r": run, "msg": "?"})
            return
        with self._lock:
            held = dict(self.window.get((device, run), {}))
        start = None
        for i in range(after + 1, max(held, default=after) + 1):
            if i in held:
                self.client.publish(topic, msgpack.packb(held[i]), qos=1)
                if start is not None:
                    self._publish_gap(device, run, start, i - 1)
                    start = None
            elif start is None:
                start = i

    def _publish_gap(self, device: str, run: str, lo: int, hi: int) -> None:
        d = {"kind": "gap", "r": run, "from": lo, "to": hi, "msg": "no longer held"}
        self._publish_bridge_error(device, d)

    def _publish_bridge_error(self, device: str, d: dict[str, Any]) -> None:
        with self._lock:
            i = self._bridge_ids[device] = self._bridge_ids.get(device, 0) + 1
        envelope = {"r": "_b", "i": i, "t": "error", "ts": 0, "d": d}
        self.client.publish(
            f"{PREFIX}/h/{self.tenant}/{device}/evt", msgpack.packb(envelope), qos=1
        )

    def publish(self, device: str, payload: Any, raw: bool = False, withhold: bool = False) -> None:
        """Publish an event (or a batch, or raw bytes) on the device's evt topic. With
        `withhold` it is only kept for a replay, as if a host had missed it."""
        if not raw:
            with self._lock:
                for e in payload if isinstance(payload, list) else [payload]:
                    if isinstance(e, dict) and isinstance(e.get("i"), int):
                        self.window.setdefault((device, str(e.get("r"))), {})[e["i"]] = e
        if withhold:
            return
        data = payload if raw else msgpack.packb(payload)
        info = self.client.publish(f"{PREFIX}/h/{self.tenant}/{device}/evt", data, qos=1)
        info.wait_for_publish(WAIT)
        assert info.is_published()

    def next_replay(self) -> tuple[str, dict[str, Any]]:
        """The next replay request a host sent (other ctl ops are skipped)."""
        while True:
            topic, body = self.ctls.get(timeout=WAIT)
            if body.get("op") == "replay":
                return topic, body

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
        # Reached, and refused: the error says whose credentials, not "cannot reach".
        with pytest.raises(BrokerRefused, match="refused the credentials for user 'eve'"):
            client.connect(timeout=WAIT)
        assert not client.connected
        client.close()
    finally:
        locked.stop()


# --- holes: the client asks the bridge to replay ----------------------------------------


@pytest.fixture
def repairing(broker: Any, tenant: str) -> Iterator[HostClient]:
    """A host client that asks for a replay soon after a hole appears (the pace is not
    what these tests check; every wait is still bounded)."""
    with HostClient(broker.host, broker.port, tenant, replay_after_s=0.1) as client:
        client.connect(timeout=WAIT)
        yield client


def test_a_hole_is_repaired_by_the_clients_replay_request(
    bridge: FakeBridge, repairing: HostClient, tenant: str
) -> None:
    seen: list[tuple[int, str]] = []
    repairing.on_event = lambda e, snap: seen.append((e["i"], snap.rows[-1].text))
    token = tokens.sign(b"secret", tenant, "alice")
    req = repairing.request("dev", token, "How warm is it?")
    for e in run_events("run-h", req):
        bridge.publish("dev", e, withhold=e["i"] == 3)  # "It is " stays with the bridge
    topic, body = bridge.next_replay()
    assert topic == f"{PREFIX}/h/{tenant}/dev/ctl"
    assert body == {"op": "replay", "r": "run-h", "after": 2, "tok": token}
    snap = repairing.wait_run(req, timeout=WAIT)
    assert snap.status == "done" and snap.complete and snap.gaps == [] and snap.held == []
    assert snap.rows[1].text == "It is 21.5 °C."
    # The callback saw every event once, in order, each with the snapshot as of it.
    assert seen == [
        (1, "How warm is it?"),
        (2, ""),
        (3, "It is "),
        (4, "It is 21.5 °C."),
        (5, "It is 21.5 °C."),
        (6, "It is 21.5 °C."),
    ]


def test_after_a_reconnect_the_open_runs_are_replayed(
    broker: Any, bridge: FakeBridge, tenant: str
) -> None:
    client_id = "host-" + uuid.uuid4().hex[:8]
    token = tokens.sign(b"secret", tenant, "bob")
    with HostClient(broker.host, broker.port, tenant, client_id=client_id, token=token) as host:
        host.connect(timeout=WAIT)
        bridge.publish("dev", ev("_", 1, "error", kind="busy", msg="busy", req="other"))
        for e in run_events("run-finished", "req-f"):
            bridge.publish("dev", e)
        for e in run_events("run-open", "req-o"):
            bridge.publish("dev", e, withhold=e["i"] > 3)  # published while it is away
        host.wait_for("req-o", lambda s: s.last_id == 3, timeout=WAIT)
        assert host.wait_run("req-f", timeout=WAIT).complete
        assert bridge.ctls.empty()  # no hole it knows of: nothing asked yet

        # Another client with the same id takes the session over: the broker closes
        # this one's connection, and paho connects it again.
        kicked = threading.Event()
        kicker = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311
        )
        kicker.on_connect = lambda *a: kicked.set()
        kicker.connect(broker.host, broker.port)
        kicker.loop_start()
        assert kicked.wait(WAIT)
        kicker.disconnect()
        kicker.loop_stop()

        # The first ask after the reconnect is for the open run: not for the finished
        # one, nor the device stream, which it saw first.
        topic, body = bridge.next_replay()
        assert body == {"op": "replay", "r": "run-open", "after": 3, "tok": token}
        snap = host.wait_run("req-o", timeout=WAIT)
        assert snap.complete and snap.rows[1].text == "It is 21.5 °C."


def test_a_gap_answer_declares_the_hole_lost_and_the_run_ends_incomplete(
    bridge: FakeBridge, repairing: HostClient
) -> None:
    repairing.set_token("watch-token")  # this client only watches the device
    for e in run_events("run-g", "req-g"):
        if e["i"] != 4:  # "21.5 °C." never reached the bridge's window
            bridge.publish("dev", e)
    _, body = bridge.next_replay()
    assert (body["r"], body["after"], body["tok"]) == ("run-g", 3, "watch-token")
    snap = repairing.wait_run("req-g", timeout=WAIT)
    assert snap.status == "done" and not snap.complete and snap.gaps == [(4, 4)]
    assert render(snap) == [
        "you: How warm is it?",
        "assistant: It is ",
        "[missing: events 4..4]",
        "status: done (in 12, out 8 tokens) (incomplete: events 4..4 missing)",
    ]


def test_unknown_run_with_events_held_declares_the_hole_lost(
    bridge: FakeBridge, repairing: HostClient
) -> None:
    repairing.set_token("tok", device="dev")
    bridge.unknown.add("run-u")
    for e in run_events("run-u", "req-u"):
        bridge.publish("dev", e, withhold=e["i"] in (2, 3))
    snap = repairing.wait_run("req-u", timeout=WAIT)
    assert snap.status == "done" and not snap.complete and snap.gaps == [(2, 3)]
    assert [(r.kind, r.text) for r in snap.rows] == [
        ("user", "How warm is it?"),
        ("missing", "[missing: events 2..3]"),
        ("assistant", "21.5 °C."),
    ]


def test_unknown_run_without_events_held_changes_nothing(
    bridge: FakeBridge, host: HostClient
) -> None:
    events = run_events("run-n", "req-n")
    bridge.publish("dev", events[0])
    bridge.publish("dev", ev("_b", 1, "error", kind="unknown_run", r="run-n", msg="?"))
    bridge.publish("dev", events[1])  # after the answer on the same topic: it was read
    snap = host.wait_for("req-n", lambda s: s.last_id == 2, timeout=WAIT)
    assert snap.status == "running" and snap.gaps == [] and snap.held == []


def test_wait_run_times_out_naming_the_held_and_missing_ids(
    bridge: FakeBridge, repairing: HostClient
) -> None:
    bridge.answer_replays = False  # a bridge that never answers
    repairing.set_token("tok")
    events = run_events("run-w", "req-w")
    for e in events[:1] + events[3:]:
        bridge.publish("dev", e)
    repairing.wait_for("req-w", lambda s: s.held == [4, 5, 6], timeout=WAIT)
    with pytest.raises(TimeoutError) as info:
        repairing.wait_run("req-w", timeout=0.2)
    message = str(info.value)
    assert "run run-w for request req-w is still running" in message
    assert "ids 4..6 held waiting on ids 2..3" in message
    # It keeps asking while the hole stays (then with doubling waits, up to 30 s).
    assert bridge.next_replay()[1]["after"] == 1
    assert bridge.next_replay()[1]["after"] == 1


def test_a_replay_needs_a_token(bridge: FakeBridge, repairing: HostClient) -> None:
    for e in run_events("run-t", "req-t"):
        bridge.publish("dev", e, withhold=e["i"] == 2)
    repairing.wait_for("req-t", lambda s: s.held == [3, 4, 5, 6], timeout=WAIT)
    repairing.set_token("late-token", device="dev")
    _, body = bridge.next_replay()
    assert body["tok"] == "late-token"
    assert repairing.wait_run("req-t", timeout=WAIT).complete


def test_replay_pace_must_be_sane() -> None:
    with pytest.raises(ValueError):
        HostClient("127.0.0.1", 1, "acme", replay_after_s=0)
    with pytest.raises(ValueError):
        HostClient("127.0.0.1", 1, "acme", replay_after_s=40, max_replay_wait_s=30)


def test_wren_ask_exits_non_zero_for_an_incomplete_run(
    broker: Any,
    bridge: FakeBridge,
    tenant: str,
    tmp_path: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from server_bridge.registry import provision
    from tools import demo
    from tools.cli import build_parser

    monkeypatch.delenv("WREN_HOST_USER", raising=False)
    monkeypatch.delenv("WREN_HOST_PASSWORD", raising=False)
    forget_bridge_status(broker)  # the fake bridge here says no status of its own
    registry = tmp_path / "registry.json"
    provision(registry, tenant, [("dev", "thermostat")])

    def play_the_board() -> None:
        _, body = bridge.requests.get(timeout=WAIT)
        for e in run_events("run-cli", body["req"]):
            if e["i"] != 4:  # lost before it reached the bridge
                bridge.publish("dev", e)

    board = threading.Thread(target=play_the_board, daemon=True)
    board.start()
    args = build_parser().parse_args(
        ["ask", "--broker", broker.address, "--registry", str(registry), "--tenant", tenant,
         "--device", "dev", "--timeout", str(WAIT), "How warm is it?"]
    )  # fmt: skip
    code = demo.run_ask(args)
    board.join(WAIT)
    out, err = capsys.readouterr()
    assert code == 1
    status = "status: done (in 12, out 8 tokens) (incomplete: events 4..4 missing)"
    lines = out.splitlines()
    # The bridge's answer ("error gap: ...", on its stream _b) may be printed in between.
    assert [x for x in lines if not x.startswith("error ")][:4] == [
        "you: How warm is it?",
        "assistant: It is ",
        "[missing: events 4..4]",
        status,
    ]
    assert f"wren ask: {status}" in err


def test_a_wait_is_woken_by_its_own_run_and_the_streams_not_by_every_event() -> None:
    # In a host process that serves more than this client, every needless wake-up took
    # the interpreter's lock from the work it serves (the benchmark's model server).
    host = HostClient("127.0.0.1", 1, "acme")  # never connected: events handed in
    notified: list[int] = []
    notify_all = host._cond.notify_all

    def counting() -> None:
        notified.append(1)
        notify_all()

    host._cond.notify_all = counting  # type: ignore[method-assign]
    topic = f"{host.prefix}/h/acme/dev/evt"
    got: list[RunSnapshot] = []
    waiter = threading.Thread(target=lambda: got.append(host.wait_run("req-a", timeout=WAIT)))
    waiter.start()
    deadline = time.monotonic() + WAIT
    while "req-a" not in host._waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    for e in run_events("run-b", "req-b"):
        host._handle(topic, msgpack.packb(e))
    assert notified == []
    host._handle(topic, msgpack.packb(ev("_", 1, "error", kind="busy", msg="x", req="req-z")))
    assert len(notified) == 1  # a stream's event: it may refuse a request waited for
    for e in run_events("run-a", "req-a"):
        host._handle(topic, msgpack.packb(e))
    waiter.join(WAIT)
    assert got and got[0].status == "done" and len(notified) == 7
    assert host._waiting == {}
