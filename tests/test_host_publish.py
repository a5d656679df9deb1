"""HostClient says truly what became of what it publishes (issue 25, item 6), and a host
cancels a request's run (item 1).

While disconnected, `request` used to raise "could not publish" while paho kept the QoS 1
message and sent it after reconnecting: the request ran all the same, and a caller that
retried got two runs. Now it refuses before handing anything to paho (NotConnected), and
what paho took and the broker has not acknowledged is Unacknowledged, naming the req id
under which a resend still runs once.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from server_bridge import tokens
from server_bridge.host.client import (
    HostClient,
    HostConnectError,
    NotConnected,
    RequestRefused,
    Unacknowledged,
)
from tests.stack import Stack, assistant_text
from tests.test_host_client import FakeBridge, ev, run_events

WAIT = 10.0  # every wait is bounded by this; none asserts on how long it took


def test_a_request_while_disconnected_is_not_sent_and_the_retry_runs_once(
    tmp_path: Path,
) -> None:
    with Stack(tmp_path) as s:
        client = s.client
        assert client is not None
        offset, mark = s._broker_log_size(), s.console_mark()
        s._stop_broker()
        deadline = time.monotonic() + WAIT
        while client.connected:
            assert time.monotonic() < deadline, "the host did not see the broker go"
            time.sleep(0.05)
        away = "asked-while-away"
        with pytest.raises(HostConnectError) as refused:
            s.request("How warm is it in here?", req=away)
        s._start_broker()
        s.wait_clients(offset, mark)

        # The caller retries under a new id, as one told "not sent" may. Had the first
        # been sent after the reconnect (paho sends what it kept before anything this
        # test publishes, and the board runs requests in order), its run would have
        # started before this one's.
        snap = s.ask("How warm is it in here?")
        assert snap.status == "done" and assistant_text(snap).endswith("It is 21.5 °C in here.")
        assert client.find_run(away) is None, "the request said not sent ran"
        assert [r.req for r in client.runs(s.device)] == [snap.req]
        assert isinstance(refused.value, NotConnected), refused.value


def test_a_request_before_connecting_is_refused_as_not_connected() -> None:
    host = HostClient("127.0.0.1", 1, "acme")  # never connected
    with pytest.raises(NotConnected, match="request r1 not sent: not connected"):
        host.request("dev", "tok", "Hello?", req="r1")
    with pytest.raises(NotConnected, match="ctl cancel not sent"):
        host.cancel("dev", "tok", "b.1")


def test_a_request_the_connection_drops_as_it_goes_is_unacknowledged_by_its_id() -> None:
    # The connection went between the client's check and paho's publish: paho keeps the
    # message for the reconnect, so it may still run, and the error says under which id
    # it may be sent again.
    host = HostClient("127.0.0.1", 1, "acme")
    host._connected = host._subscribed = True  # as the client saw it just before
    with pytest.raises(Unacknowledged) as e:
        host.request("dev", "tok", "Hello?", req="r2")
    assert e.value.req == "r2" and isinstance(e.value, TimeoutError)
    assert "request r2 is not acknowledged: the connection dropped" in str(e.value)


# --- cancel_request against a real broker, a plain paho client playing the bridge --------


@pytest.fixture
def tenant() -> str:
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


def test_cancel_request_cancels_the_run_once_it_has_started(
    bridge: FakeBridge, host: HostClient, tenant: str
) -> None:
    token = tokens.sign(b"secret", tenant, "alice")
    req = host.request("dev", token, "How warm is it?")
    bridge.requests.get(timeout=WAIT)
    for e in run_events("b.1", req)[:3]:  # running
        bridge.publish("dev", e)
    host.wait_for(req, lambda snap: snap.status == "running", WAIT)  # the host knows its run

    cancels: list[tuple[str, dict[str, Any]]] = []

    def board() -> None:  # the cancel reaches the board, which ends the run
        cancels.append(bridge.ctls.get(timeout=WAIT))
        bridge.publish("dev", ev("b.1", 4, "run.cancelled", reason="enough"))

    t = threading.Thread(target=board, daemon=True)
    t.start()
    snap = host.cancel_request("dev", token, req, "enough", timeout=WAIT)
    t.join(WAIT)
    assert snap.status == "cancelled" and snap.reason == "enough"
    assert cancels == [
        (
            f"wren/v1/h/{tenant}/dev/ctl",
            {"op": "cancel", "r": "b.1", "reason": "enough", "tok": token},
        )
    ]


def test_cancel_request_before_its_run_started_cancels_the_request(
    bridge: FakeBridge, host: HostClient, tenant: str
) -> None:
    # No run started yet (queued on the board, say): cancelled by its id, and the
    # board's answer, `cancelled` naming the request, ends it: no run starts for it.
    token = tokens.sign(b"secret", tenant, "alice")
    req = host.request("dev", token, "How warm is it?")
    cancels: list[tuple[str, dict[str, Any]]] = []

    def board() -> None:
        cancels.append(bridge.ctls.get(timeout=WAIT))
        bridge.publish("dev", ev("_", 1, "error", kind="cancelled", msg="cancelled", req=req))

    t = threading.Thread(target=board, daemon=True)
    t.start()
    with pytest.raises(RequestRefused) as e:
        host.cancel_request("dev", token, req, "gave up", timeout=WAIT)
    t.join(WAIT)
    assert e.value.kind == "cancelled"
    assert cancels == [
        (
            f"wren/v1/h/{tenant}/dev/ctl",
            {"op": "cancel", "req": req, "reason": "gave up", "tok": token},
        )
    ]


def test_cancel_request_no_board_answers_times_out(
    bridge: FakeBridge, host: HostClient, tenant: str
) -> None:
    token = tokens.sign(b"secret", tenant, "alice")
    req = host.request("dev", token, "How warm is it?")
    with pytest.raises(TimeoutError):
        host.cancel_request("dev", token, req, timeout=0.5)
    assert bridge.ctls.get(timeout=WAIT)[1]["req"] == req  # sent, never answered


def test_cancel_request_of_a_refused_request_is_the_refusal(
    bridge: FakeBridge, host: HostClient, tenant: str
) -> None:
    token = tokens.sign(b"secret", tenant, "alice")
    req = host.request("dev", token, "How warm is it?")
    bridge.publish("dev", ev("_", 1, "error", kind="busy", msg="busy", req=req))
    with pytest.raises(RequestRefused) as e:
        host.cancel_request("dev", token, req, timeout=WAIT)
    assert e.value.kind == "busy"


def test_cancel_request_of_a_finished_run_returns_it(
    bridge: FakeBridge, host: HostClient, tenant: str
) -> None:
    token = tokens.sign(b"secret", tenant, "alice")
    req = host.request("dev", token, "How warm is it?")
    for e in run_events("b.2", req):
        bridge.publish("dev", e)
    host.wait_run(req, timeout=WAIT)
    assert host.cancel_request("dev", token, req, timeout=WAIT).status == "done"
    assert bridge.ctls.empty()
