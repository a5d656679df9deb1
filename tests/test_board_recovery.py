"""The board never wedges (issue 24), end to end: the real bridge process, Mosquitto, and
the demo thermostat (with its memory field) on the MicroPython unix port at the README's
128K, from .mpy.

- A flood of junk `ctl` at QoS 1 at the broker's speed leaves the board online, and a
  valid request after it runs: refusals that wait for the link are folded into one
  event that counts them (`more`), not held one apiece by the link.
- A `req` the board cannot decode is refused by its id, read from its bytes, so the host
  that sent it ends at once instead of waiting out its timeout.
(The reset of a board whose link finds no heap to connect, four connections in a row,
has no test here yet: a hog task that takes every free block, tried this session, left
the board connected but without heap for presence under a loaded machine, a deaf state
the link's rule does not catch; see the issue 24 note.)
"""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import paho.mqtt.client as mqtt
import pytest

from server_bridge.host.client import RequestRefused
from tests.stack import DEVICE, PREFIX, Stack
from tests.waiting import wait_for

JUNK = "junk"
CTL = f"{PREFIX}/d/{DEVICE}/ctl"
REQ = f"{PREFIX}/d/{DEVICE}/req"


def _speaker(s: Stack) -> mqtt.Client:
    """A client with the bridge's rights (it may publish `req` and `ctl` to boards)."""
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=JUNK)
    c.username_pw_set(JUNK, s.users[JUNK])
    c.max_queued_messages_set(0)
    c.max_inflight_messages_set(1000)
    c.connect(s.host, s.port)
    c.loop_start()
    return c


def _device_errors(s: Stack) -> list[dict[str, object]]:
    """The error events of the board's device stream `_` that reached the host."""
    assert s.client is not None
    return [e["d"] for e in s.client.events if e["r"] == "_" and e["t"] == "error"]


def test_ten_thousand_junk_ctl_at_qos1_then_a_request_runs(tmp_path: Path) -> None:
    with Stack(tmp_path, extra_users={JUNK: "bridge"}) as s:
        assert s.ask("How warm is it in here?").status == "done", s.describe()
        c = _speaker(s)
        try:
            # Three kinds of junk: a cancel of no run, an unknown op, and bytes that are
            # not msgpack at all.
            sent = []
            for i in range(10_000):
                if i % 3 == 0:
                    payload = msgpack.packb({"op": "cancel", "r": f"x{i}"})
                elif i % 3 == 1:
                    payload = b"\xc1junk%d" % i
                else:
                    payload = msgpack.packb({"op": "no-such-op"})
                sent.append(c.publish(CTL, payload, qos=1))
            for info in sent:
                info.wait_for_publish(60)
        finally:
            c.loop_stop()
            c.disconnect()
        # Every junk message was refused on the board's console, and the board kept up.
        wait_for(
            lambda: sum("refused" in line for line in s.console) >= 10_000,
            timeout=120,
            what="the board refusing every junk ctl",
        )
        snap = s.ask("How warm is it in here?", timeout=60)
        assert snap.status == "done", s.describe()
        assert "link: down" not in "\n".join(s.console), s.describe()
        # Folded, not dropped: an error event stands for the refusals that waited.
        errors = _device_errors(s)
        folded = [e for e in errors if isinstance(e.get("more"), int) and e["more"] > 0]
        assert folded, errors[-5:]
        assert s.board_resets == 0


def test_a_req_the_board_cannot_decode_is_refused_by_its_id(tmp_path: Path) -> None:
    with Stack(tmp_path, extra_users={JUNK: "bridge"}) as s:
        c = _speaker(s)
        try:
            # A well-formed map up to its last value, which is a byte msgpack never uses.
            good = msgpack.packb({"req": "bad-req-1", "input": "How warm is it?"})
            payload = bytes([good[0] + 1]) + good[1:] + msgpack.packb("zz") + b"\xc1"
            c.publish(REQ, payload, qos=1).wait_for_publish(10)
        finally:
            c.loop_stop()
            c.disconnect()
        wait_for(
            lambda: any(e.get("req") == "bad-req-1" for e in _device_errors(s)),
            timeout=30,
            what="the refusal naming bad-req-1",
        )
        refusal = next(e for e in _device_errors(s) if e.get("req") == "bad-req-1")
        assert refusal["kind"] == "bad_type", refusal
        # The board goes on.
        assert s.ask("How warm is it in here?").status == "done", s.describe()


def test_a_long_request_the_board_has_no_heap_for_ends_at_once_by_its_id(
    tmp_path: Path,
) -> None:
    # 3,900 characters within the announced 4,096: on a heap fragmented by the runs
    # before it the decode may find no block of its size. Whether it runs or is refused
    # no_memory, the host learns it at once (by the req id), never by a timeout.
    with Stack(tmp_path) as s:
        for text in ("How warm is it?", "How warm is it? " * 125):
            assert s.ask(text).status == "done", s.describe()
        long_text = ("How warm is it? " * 300)[:3900]
        started = time.monotonic()
        try:
            snap = s.ask(long_text, timeout=60)
        except RequestRefused as e:
            assert e.kind == "no_memory", e
        else:
            assert snap.status == "done", s.describe()
        assert time.monotonic() - started < 60


@pytest.fixture(autouse=True)
def _no_leftover_reset_file(tmp_path: Path) -> None:
    # The reset file is read and removed by the next boot: none may outlive a test.
    yield
    leftover = tmp_path / "flash" / "wren_reset.txt"
    assert not leftover.exists()
