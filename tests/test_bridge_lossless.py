"""The bridge never gives up on an event and never leaves a dead run "running".

Against a real Mosquitto, with paho clients playing the board and the host (the helpers
of tests/test_bridge.py): gap repair that keeps asking, runs ended when their board
restarts (a new boot id) or goes offline, the bridge's own presence on P/b/status, its
persistent session across a bridge kill and a broker restart, and a host's replay
answered from the bridge's window. The intake rules are also checked without a broker,
with a clock the test moves. Every wait is bounded; no assertion is about how long
something took.
"""

from __future__ import annotations

import logging
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from server_bridge.bridge import Bridge
from server_bridge.config import BridgeConfig
from server_bridge.intake import DEVICE_OFFLINE, DEVICE_RESTARTED
from server_bridge.lanes import OVERHEAD
from server_bridge.models.scripted import ScriptedProvider
from server_bridge.registry import DeviceRecord, Registry
from tests.eventdata import fold
from tests.test_bridge import (
    DEV,
    OTHER_SECRET,
    USER,
    Peer,
    Sink,
    World,
    ev,
    intake,
    token,
    wait_for,
)
from tools.broker import MosquittoProcess, start_mosquitto

ROOT = Path(__file__).resolve().parents[1]
# Long enough for a bridge process to start, or for paho to reconnect (its backoff
# reaches a few seconds while the broker is away).
SLOW = 40.0
OLD_BOOT, NEW_BOOT = "0a1b2c3d", "99887766"


def gap(i: int, lo: int, hi: int, run: str = "r1") -> dict[str, Any]:
    """The board's report that events lo..hi are lost, as event i."""
    e = ev(i, "error", run=run, kind="gap", msg="lost")
    e["d"].update({"from": lo, "to": hi})
    return e


def host_events(w: World, n: int) -> list[dict[str, Any]]:
    return [w.host.get(w.h("evt")) for _ in range(n)]


def by_run(events: list[dict[str, Any]]) -> dict[str, list[tuple[int, str]]]:
    out: dict[str, list[tuple[int, str]]] = {}
    for e in events:
        out.setdefault(e["r"], []).append((e["i"], e["t"]))
    return out


def ctls(w: World) -> list[dict[str, Any]]:
    """The ctl messages the board has received so far (not waiting for more)."""
    inbox = w.board.inbox(w.d("ctl"))
    got = []
    while not inbox.empty():
        got.append(inbox.get_nowait())
    return got


@pytest.fixture
def fast(broker: MosquittoProcess, tmp_path: Path) -> Iterator[World]:
    """A world whose bridge retries replay requests quickly."""
    w = World(broker, tmp_path, ScriptedProvider(), replay_retry_s=0.05, replay_retry_max_s=0.2)
    yield w
    w.close()


@pytest.fixture
def world(broker: MosquittoProcess, tmp_path: Path) -> Iterator[World]:
    """A world whose replay retry never fires during a test: replay requests counted
    are the ones the events caused."""
    w = World(broker, tmp_path, ScriptedProvider(), replay_retry_s=60, replay_retry_max_s=60)
    yield w
    w.close()


# ---------------------------------------------------------------- gap repair


def test_gap_repair_keeps_asking_past_the_old_limit_until_the_events_arrive(
    fast: World,
) -> None:
    w = fast
    w.board.send(w.d("evt"), [ev(1), ev(4)])
    assert w.host.get(w.h("evt"))["i"] == 1
    # The old bridge asked 3 times and gave up; this one goes on.
    asks = [w.board.get(w.d("ctl")) for _ in range(6)]
    assert asks == [{"op": "replay", "r": "r1", "after": 1}] * 6
    w.board.send(w.d("evt"), [ev(2), ev(3), ev(4)])
    assert [e["i"] for e in host_events(w, 3)] == [2, 3, 4]
    sent = w.bridge.stats["replay.sent"]
    w.board.send(w.d("evt"), ev(5))  # in order: nothing is missing any more
    assert w.host.get(w.h("evt"))["i"] == 5
    assert w.bridge.stats["replay.sent"] == sent
    assert w.bridge.intake.held("dev1", "r1") == [] and w.bridge.stats["replay.gave_up"] == 0


def test_a_full_hold_buffer_still_asks(broker: MosquittoProcess, tmp_path: Path) -> None:
    w = World(
        broker,
        tmp_path,
        ScriptedProvider(),
        hold_per_run=2,
        replay_retry_s=0.05,
        replay_retry_max_s=0.2,
    )
    try:
        w.board.send(w.d("evt"), [ev(1), ev(4), ev(5), ev(6), ev(7)])  # 6 and 7 overflow
        assert w.host.get(w.h("evt"))["i"] == 1
        wait_for(lambda: w.bridge.stats["evt.hold_overflow"] == 2, "the overflow")
        assert w.bridge.intake.held("dev1", "r1") == [4, 5]
        assert w.board.get(w.d("ctl")) == {"op": "replay", "r": "r1", "after": 1}
        # The board resends only 2 and 3: 4 and 5 go out; nothing is held any more, but
        # 6 and 7 were seen, so the bridge asks on, from 5.
        w.board.send(w.d("evt"), [ev(2), ev(3)])
        assert [e["i"] for e in host_events(w, 4)] == [2, 3, 4, 5]
        assert w.bridge.intake.held("dev1", "r1") == []
        wait_for(lambda: {"op": "replay", "r": "r1", "after": 5} in ctls(w), "a request from 5")
        w.board.send(w.d("evt"), [ev(6), ev(7)])
        assert [e["i"] for e in host_events(w, 2)] == [6, 7]
        sent = w.bridge.stats["replay.sent"]
        w.board.send(w.d("evt"), ev(8))
        assert w.host.get(w.h("evt"))["i"] == 8
        assert w.bridge.stats["replay.sent"] == sent
    finally:
        w.close()


def test_a_gap_report_ends_the_asking_and_the_held_events_go_out_in_order(
    fast: World,
) -> None:
    w = fast
    w.board.send(w.d("evt"), [ev(1), ev(4), ev(5)])
    assert w.host.get(w.h("evt"))["i"] == 1
    for _ in range(2):
        assert w.board.get(w.d("ctl")) == {"op": "replay", "r": "r1", "after": 1}
    w.board.send(w.d("evt"), gap(6, 2, 3))
    got = host_events(w, 3)
    assert [e["i"] for e in got] == [4, 5, 6]
    assert (got[2]["d"]["from"], got[2]["d"]["to"]) == (2, 3)
    sent = w.bridge.stats["replay.sent"]
    w.board.send(w.d("evt"), ev(7))
    assert w.host.get(w.h("evt"))["i"] == 7
    assert w.bridge.stats["replay.sent"] == sent
    assert w.bridge.stats["evt.lost"] == 2


def test_the_wait_doubles_to_its_cap_and_the_asking_never_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = Sink()
    it = intake(sink, replay_retry_s=2.0, replay_retry_max_s=30.0)
    with caplog.at_level(logging.WARNING, logger="wren.bridge.intake"):
        it.accept(DEV, [ev(1), ev(3)])
        times = [0.0]
        for _ in range(200):  # one tick a second for a long while
            sink.now += 1.0
            it.tick()
            if len(sink.ctls()) > len(times):
                times.append(sink.now)
    waits = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert waits[:6] == [2, 4, 8, 16, 30, 30]
    assert set(waits[4:]) == {30} and len(times) >= 10
    capped = [r for r in caplog.records if "still missing" in r.getMessage()]
    assert len(capped) == 1  # once per time the wait reaches its cap, not per request
    it.accept(DEV, [ev(2)])
    assert sink.evts() == [1, 2, 3]
    n = len(sink.ctls())
    sink.now += 1000
    it.tick()
    assert len(sink.ctls()) == n


def test_asking_goes_on_with_nothing_held() -> None:
    sink = Sink()
    it = intake(sink, hold=2, replay_retry_s=1.0, replay_retry_max_s=1.0)
    it.accept(DEV, [ev(1), ev(4), ev(5), ev(6), ev(7)])
    it.accept(DEV, [ev(2), ev(3)])
    assert sink.evts() == [1, 2, 3, 4, 5] and it.held("dev1", "r1") == []
    assert it.highest("dev1", "r1") == 7
    sink.now = 1.0
    it.tick()
    assert sink.ctls()[-1] == {"op": "replay", "r": "r1", "after": 5}


# ---------------------------------------------------------------- a board that restarted


def status(st: str, boot: str) -> bytes:
    return msgpack.packb({"st": st, "boot": boot})  # type: ignore[no-any-return]


def test_a_new_boot_in_hello_ends_the_open_runs(world: World) -> None:
    w = world
    one, two, done = f"{OLD_BOOT}.1", f"{OLD_BOOT}.2", f"{OLD_BOOT}.3"
    w.board.send(w.d("hello"), {"agent": "thermostat", "boot": OLD_BOOT})
    w.board.send(w.d("evt"), [ev(1, run="_"), ev(2, run="_")])
    w.board.send(w.d("evt"), [ev(1, run=one), ev(2, run=one), ev(5, run=one), ev(7, run=one)])
    w.board.send(w.d("evt"), [ev(1, run=two), ev(2, run=two)])
    w.board.send(w.d("evt"), [ev(1, run=done), ev(2, "run.done", run=done, usage={})])
    w.board.send(w.d("evt"), gap(8, 6, 6, run=one))  # the board reported 6 lost itself
    assert by_run(host_events(w, 8)) == {
        "_": [(1, "msg.delta"), (2, "msg.delta")],
        one: [(1, "msg.delta"), (2, "msg.delta")],
        two: [(1, "msg.delta"), (2, "msg.delta")],
        done: [(1, "msg.delta"), (2, "run.done")],
    }
    assert w.board.get(w.d("ctl")) == {"op": "replay", "r": one, "after": 2}

    w.board.send(w.d("hello"), {"agent": "thermostat", "boot": NEW_BOOT})
    got = host_events(w, 6)
    runs = by_run(got)
    # Run one: what was held goes out, the hole 3..4 is told (6 the board told itself),
    # and the run fails: ids 9 and 10, right after the highest seen (8).
    assert runs == {
        one: [(5, "msg.delta"), (7, "msg.delta"), (8, "error"), (9, "error"), (10, "run.failed")],
        two: [(3, "run.failed")],
    }
    told = {(e["r"], e["i"]): e for e in got}
    assert told[one, 9]["d"]["kind"] == "gap" and told[one, 9]["d"]["msg"]
    assert (told[one, 9]["d"]["from"], told[one, 9]["d"]["to"]) == (3, 4)
    # ts: the board clock of the run's last event seen (8 of one, 2 of two).
    for key, ts in (((one, 10), 1008), ((two, 3), 1002)):
        assert told[key]["d"] == {"err": {"kind": "device", "msg": DEVICE_RESTARTED},
                                  "retryable": True}  # fmt: skip
        assert told[key]["ts"] == ts
    assert w.bridge.intake.boot("dev1") == NEW_BOOT
    assert w.bridge.stats["runs.ended_by_bridge"] == 2
    assert w.bridge.stats["device.restarted"] == 1

    # Late events of the dead runs are dropped; the new boot's device stream starts at 1.
    w.board.send(w.d("evt"), [ev(3, run=one), ev(11, run=one), ev(3, run=two)])
    w.board.send(w.d("evt"), ev(1, "error", run="_", kind="busy", msg="full"))
    marker = w.host.get(w.h("evt"))
    assert (marker["r"], marker["i"], marker["t"]) == ("_", 1, "error")
    assert w.bridge.stats["evt.after_end"] == 3
    assert w.board.empty(w.d("ctl"))  # a restart cancels nothing: those runs are gone
    # A host's replay gets the bridge's events too.
    ids = [e["i"] for e in w.bridge.intake.events("dev1", one, after=8)]
    assert ids == [9, 10]


def test_a_new_boot_in_status_ends_the_open_runs_too() -> None:
    sink = Sink()
    it = intake(sink)
    it.handle_status(DEV, status("online", OLD_BOOT))
    it.accept(DEV, [ev(1, run="x")])
    it.handle_status(DEV, status("online", OLD_BOOT))  # the same boot: nothing happens
    assert it.events("dev1", "x")[-1]["t"] == "msg.delta"
    it.handle_status(DEV, status("online", NEW_BOOT))
    assert [(e["i"], e["t"]) for e in it.events("dev1", "x")] == [
        (1, "msg.delta"),
        (2, "run.failed"),
    ]
    assert [c["op"] for c in sink.ctls()] == []


def test_a_bad_boot_is_refused(world: World) -> None:
    world.board.send(world.d("hello"), {"agent": "thermostat", "boot": "NOT-HEX"})
    world.board.send(world.d("status"), {"st": "online", "boot": 12345678})
    world.board.send(world.d("status"), {"st": "online", "boot": "f" * 17})
    world.refused("bad_envelope", 3)
    assert world.bridge.intake.boot("dev1") is None
    assert world.bridge.hello("dev1") is None and world.bridge.presence("dev1") is None


class _Held:
    """A provider that streams one chunk, then holds its call open until released."""

    name = "held"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.returned = threading.Event()

    def complete(
        self,
        messages: Any,
        tools: Any,
        emit: Any,
        model: Any = None,
        max_tokens: Any = None,
        *,
        deadline: float | None = None,
    ) -> dict[str, Any]:
        try:
            emit({"text": "thinking"})
            self.started.set()
            self.release.wait(SLOW)
            emit({"text": " more"})  # held for merging, then dropped: the call is over
            return {"usage": {}, "finish": "stop"}
        finally:
            self.returned.set()


@pytest.mark.parametrize("status", ["offline", "new_boot"])
def test_a_call_in_flight_ends_when_its_device_goes_offline_or_restarts(
    broker: MosquittoProcess, tmp_path: Path, status: str
) -> None:
    provider = _Held()
    w = World(broker, tmp_path, provider, replay_retry_s=60, replay_retry_max_s=60)
    try:
        w.board.send(w.d("status"), {"st": "online", "boot": OLD_BOOT})
        w.call(1, "llm.complete", {"messages": [USER]})
        assert provider.started.wait(SLOW)
        # The stalled provider's text goes out after merge_s (the housekeeping tick).
        assert w.board.get(w.d("rpc/res")) == {"c": 1, "s": 1, "ch": {"text": "thinking"}}
        assert w.bridge.rpc.inflight_of("dev1") == 1
        if status == "offline":
            w.board.send(w.d("status"), {"st": "offline", "boot": OLD_BOOT})
        else:
            w.board.send(w.d("hello"), {"agent": "thermostat", "boot": NEW_BOOT})
        wait_for(lambda: w.bridge.rpc.inflight_of("dev1") == 0, "the call ended")
        assert w.bridge.stats["rpc.device_gone"] == 1
        provider.release.set()
        assert provider.returned.wait(SLOW)
        # A fence: the next call's whole answer. Anything sent for call 1 after it ended
        # would be among what arrives before that answer's end.
        provider.started.clear()
        provider.returned.clear()
        w.call(2, "llm.complete", {"messages": [USER]})
        got = []
        while not got or got[-1].get("c") != 2 or "ch" in got[-1]:
            got.append(w.board.get(w.d("rpc/res")))
            if "ch" in got[-1]:
                w.board.send(w.d("rpc"), {"c": got[-1]["c"], "ack": got[-1]["s"]})
        assert got[-1]["ok"]["finish"] == "stop"
        # Nothing more for call 1 after its device went: no more text, no final answer.
        assert [m for m in got if m["c"] == 1] == []
        if status == "new_boot":
            # A new boot numbers its calls afresh: call 1 of the new boot is a new call.
            w.call(1, "llm.complete", {"messages": [USER]})
            _, final = w.answers()
            assert final["c"] == 1 and final["ok"]["finish"] == "stop"
    finally:
        provider.release.set()
        w.close()


def test_an_offline_status_ends_runs_only_after_the_grace(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    # A broker that shuts down sends every client's will: an offline status followed by
    # the same boot back online is a board that kept its session and its runs.
    w = World(
        broker,
        tmp_path,
        ScriptedProvider(),
        offline_grace_s=1.0,
        replay_retry_s=60,
        replay_retry_max_s=60,
    )
    try:
        w.board.send(w.d("status"), {"st": "online", "boot": OLD_BOOT})
        w.board.send(w.d("evt"), [ev(1, run="a"), ev(2, run="a")])
        assert [e["i"] for e in host_events(w, 2)] == [1, 2]
        w.board.send(w.d("status"), {"st": "offline", "boot": OLD_BOOT})
        w.board.send(w.d("status"), {"st": "online", "boot": OLD_BOOT})
        # Twice the grace: nothing was ended, and the run goes on to its own end.
        with pytest.raises(queue.Empty):
            w.host.inbox(w.h("evt")).get(timeout=2.0)
        assert w.bridge.stats["runs.ended_by_bridge"] == 0
        w.board.send(w.d("evt"), ev(3, "run.done", run="a", usage={}))
        assert [(e["i"], e["t"]) for e in host_events(w, 1)] == [(3, "run.done")]
        # Offline and not back: the open run ends once the grace has passed.
        w.board.send(w.d("evt"), ev(1, run="b"))
        host_events(w, 1)
        w.board.send(w.d("status"), {"st": "offline", "boot": OLD_BOOT})
        ended = host_events(w, 1)
        assert [(e["r"], e["i"], e["t"]) for e in ended] == [("b", 2, "run.failed")]
        assert ended[0]["d"]["err"] == {"kind": "device", "msg": DEVICE_OFFLINE}
    finally:
        w.close()


# ---------------------------------------------------------------- a board that went offline


def test_offline_ends_the_open_runs_and_the_board_finds_the_cancels(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    w = World(broker, tmp_path, ScriptedProvider(), replay_retry_s=60, replay_retry_max_s=60)
    # A board with a persistent session, as a real board connects.
    board_id = f"dev1-{uuid.uuid4().hex[:8]}"
    board = Peer(broker, [w.d("ctl")], client_id=board_id, clean_session=False)
    try:
        board.send(w.d("status"), {"st": "online", "boot": OLD_BOOT})
        board.send(w.d("evt"), [ev(1, run="a"), ev(2, run="a")])
        board.send(w.d("evt"), [ev(1, run="b"), ev(3, run="b")])  # 2 missing
        board.send(w.d("evt"), [ev(1, run="c"), ev(2, "run.cancelled", run="c", reason="x")])
        board.send(w.d("evt"), ev(1, run="_"))
        assert len(host_events(w, 6)) == 6
        assert board.get(w.d("ctl")) == {"op": "replay", "r": "b", "after": 1}
        board.close()  # cut off; its session stays at the broker
        # Its last will, as the broker would publish it.
        w.board.send(w.d("status"), {"st": "offline", "boot": OLD_BOOT})
        assert by_run(host_events(w, 4)) == {
            "a": [(3, "run.failed")],
            "b": [(3, "msg.delta"), (4, "error"), (5, "run.failed")],
        }
        assert (w.bridge.presence("dev1") or {}).get("st") == "offline"
        # Its hosts are told, after the runs' ends (a dashboard's presence).
        told = w.host.get(w.h("evt"))
        assert (told["r"], told["t"], told["d"]["st"]) == ("_b", "presence", "offline")
        # The board comes back with the same boot: the cancels waited in its session.
        board = Peer(broker, client_id=board_id, clean_session=False)
        cancels = [board.get(w.d("ctl")) for _ in range(2)]
        assert sorted(cancels, key=lambda c: c["r"]) == [
            {"op": "cancel", "r": "a", "reason": DEVICE_OFFLINE},
            {"op": "cancel", "r": "b", "reason": DEVICE_OFFLINE},
        ]
        # The same boot: the device stream goes on (1 again is a repeat), and the dead
        # runs stay dead.
        board.send(w.d("evt"), [ev(3, run="a"), ev(1, run="_"), ev(2, run="_")])
        marker = w.host.get(w.h("evt"))
        assert (marker["r"], marker["i"]) == ("_", 2)
        assert w.bridge.stats["evt.after_end"] == 1
        assert w.bridge.stats["ctl.cancel_sent"] == 2
        assert w.bridge.stats["device.offline"] == 1
    finally:
        board.close()
        w.close()


def test_rows_left_building_by_a_board_that_went_offline_are_shown_failed(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    # PROTOCOL.md "Tables": a dashboard never keeps a row `building` whose board is gone.
    w = World(broker, tmp_path, ScriptedProvider())
    try:
        row = "row"
        # The table is declared (public, streamed), or the bridge would show none of it.
        shop = {"name": "shop", "vis": "public", "kind": "collection", "stream": True}
        w.board.send(w.d("hello"), {"agent": "thermostat", "boot": OLD_BOOT, "fields": [shop]})
        wait_for(lambda: w.bridge.hello("dev1"), "the hello")
        w.board.send(w.d("status"), {"st": "online", "boot": OLD_BOOT})
        w.board.send(
            w.d("evt"),
            [
                ev(1, run="a"),
                ev(2, row, run="a", field="shop", row="milk", status="building", value="2"),
                ev(3, row, run="a", field="shop", row="tea", status="building"),
                ev(4, row, run="a", field="shop", row="milk", status="final", value="2", ver=1),
            ],
        )
        first = host_events(w, 4)
        w.board.send(w.d("status"), {"st": "offline", "boot": OLD_BOOT})
        swept, failed = host_events(w, 2)
        assert (swept["i"], swept["t"], failed["i"], failed["t"]) == (5, "row", 6, "run.failed")
        assert swept["d"] == {
            "field": "shop",
            "row": "tea",
            "status": "failed",
            "err": {"kind": "device", "msg": DEVICE_OFFLINE},
        }
        snap = fold([*first, swept, failed])
        table = [(r.key, r.status, r.output) for r in snap.table("shop")]
        assert table == [("tea", "failed", None), ("milk", "final", "2")]
    finally:
        w.close()


def test_offline_and_restart_rules_without_a_broker() -> None:
    sink = Sink()
    heard: list[tuple[str, str, bool]] = []
    it = intake(sink)

    def hook(device: str, msg: str, new_boot: bool, boot: str | None) -> None:
        # Called outside the intake's lock: the hook may read the intake.
        assert it._lock.acquire(blocking=False)
        it._lock.release()
        heard.append((device, msg, new_boot))
        boots.append(boot)

    boots: list[str | None] = []

    it.on_device_reset = hook
    it.handle_status(DEV, status("online", OLD_BOOT))
    it.accept(DEV, [ev(1, run="x"), ev(1, run="_"), ev(1, run="_b")])
    assert heard == []
    it.handle_status(DEV, status("online", NEW_BOOT))
    assert heard == [("dev1", DEVICE_RESTARTED, True)]
    assert it.runs("dev1") == ["x", "_b"]  # "_" forgotten; nothing made for "_b"
    assert [(e["i"], e["t"]) for e in it.events("dev1", "x")] == [
        (1, "msg.delta"),
        (2, "run.failed"),
    ]
    assert it.events("dev1", "_b") == [ev(1, run="_b")]
    # A late will of the older boot changes nothing: not the boot, not the presence.
    n = len(sink.sent)
    it.handle_status(DEV, status("offline", OLD_BOOT))
    assert len(sink.sent) == n and len(heard) == 1 and it.boot("dev1") == NEW_BOOT
    assert it.counts["status.stale_offline"] == 1  # type: ignore[attr-defined]
    assert (it.presence("dev1") or {}).get("st") == "online"
    # Offline with no run open ends nothing, but is told all the same.
    it.handle_status(DEV, status("offline", NEW_BOOT))
    assert len(sink.sent) == n and heard[-1] == ("dev1", DEVICE_OFFLINE, False)
    # The hook learns the boot: the new one after a restart, the will's after an offline.
    assert boots == [NEW_BOOT, NEW_BOOT]


def test_a_boot_ends_only_the_runs_of_other_boots_and_a_will_only_its_own() -> None:
    # Run ids begin with their boot. The runs of a new boot can reach the bridge before
    # that boot's status does (a retained status comes again at each subscribe).
    sink = Sink()
    it = intake(sink)
    old, new = f"{OLD_BOOT}.1", f"{NEW_BOOT}.1"
    it.handle_status(DEV, status("online", OLD_BOOT))
    it.accept(DEV, [ev(1, run=old), ev(1, run=new)])
    it.handle_status(DEV, status("online", NEW_BOOT))
    assert [e["t"] for e in it.events("dev1", old)] == ["msg.delta", "run.failed"]
    assert [e["t"] for e in it.events("dev1", new)] == ["msg.delta"]
    # A will names the boot it is of: it ends that boot's runs, not another's.
    third = f"{OLD_BOOT[::-1]}.1"
    it.accept(DEV, [ev(1, run=third)])
    it.handle_status(DEV, status("offline", NEW_BOOT))
    assert [e["t"] for e in it.events("dev1", new)] == ["msg.delta", "run.failed"]
    assert [e["t"] for e in it.events("dev1", third)] == ["msg.delta"]


def test_the_offline_grace_with_a_clock_the_test_moves() -> None:
    sink = Sink()
    heard: list[tuple[str, str, bool]] = []
    it = intake(sink, offline_grace_s=5.0)
    it.on_device_reset = lambda device, msg, new_boot, boot: heard.append((device, msg, new_boot))
    it.handle_status(DEV, status("online", OLD_BOOT))
    it.accept(DEV, [ev(1, run="x")])
    it.handle_status(DEV, status("offline", OLD_BOOT))
    sink.now += 4.9
    it.tick()
    assert heard == [] and [e["i"] for e in it.events("dev1", "x")] == [1]
    # Back with the same boot: the offline is forgotten, however long it then takes.
    it.handle_status(DEV, status("online", OLD_BOOT))
    sink.now += 60
    it.tick()
    assert heard == []
    # Offline again, and the bridge itself loses the broker: those were wills of a
    # broker going down, not news.
    it.handle_status(DEV, status("offline", OLD_BOOT))
    it.broker_lost()
    sink.now += 60
    it.tick()
    assert heard == []
    # Offline and not back: the run ends at the first tick past the grace.
    it.handle_status(DEV, status("offline", OLD_BOOT))
    sink.now += 5.0
    it.tick()
    assert heard == [("dev1", DEVICE_OFFLINE, False)]
    assert [(e["i"], e["t"]) for e in it.events("dev1", "x")] == [
        (1, "msg.delta"),
        (2, "run.failed"),
    ]
    # A new boot ends what is open at once, grace or not.
    it.accept(DEV, [ev(1, run="y")])
    it.handle_status(DEV, status("online", NEW_BOOT))
    assert heard[-1] == ("dev1", DEVICE_RESTARTED, True)


def test_a_terminal_event_held_behind_a_hole_is_not_failed_again() -> None:
    sink = Sink()
    it = intake(sink)
    it.accept(DEV, [ev(1), ev(3, "run.done", usage={})])
    it.handle_status(DEV, status("offline", OLD_BOOT))
    assert [(e["i"], e["t"]) for e in it.events("dev1", "r1")] == [
        (1, "msg.delta"),
        (3, "run.done"),
        (4, "error"),
    ]
    # The board ended that run itself: no cancel for it.
    assert [c["op"] for c in sink.ctls()] == ["replay"]


# ---------------------------------------------------------------- bridge presence


def status_of(peer: Peer, p: str) -> Any:
    """The bridge's next status, its process boot id checked and left out."""
    status = peer.get(f"{p}/b/status", timeout=SLOW)
    boot = status.pop("boot")
    assert isinstance(boot, str) and len(boot) == 8
    return status


def test_presence_online_retained_and_offline_on_a_clean_stop(
    world: World, broker: MosquittoProcess
) -> None:
    w = world
    me = w.bridge.config.client_id
    first = Peer(broker, [f"{w.p}/b/status"])
    try:
        assert status_of(first, w.p) == {"st": "online", "id": me}  # retained
        before = int(time.time() * 1000)
        w.bridge.stop()
        said = status_of(first, w.p)
        # A clean stop says when (hosts print "the bridge is offline since ...").
        at = said.pop("at")
        assert said == {"st": "offline", "id": me}
        assert before <= at <= int(time.time() * 1000)
    finally:
        first.close()
    later = Peer(broker, [f"{w.p}/b/status"])
    try:
        assert status_of(later, w.p) == {"st": "offline", "id": me, "at": at}  # retained
    finally:
        later.close()


class BridgeProcess:
    """The bridge service (`python -m server_bridge`, what `wren bridge` runs) in a process
    of its own (prefix wren/v1, tenant acme, device dev1)."""

    P = "wren/v1"

    def __init__(self, broker: MosquittoProcess, tmp: Path, client_id: str) -> None:
        self.log = tmp / f"bridge-{uuid.uuid4().hex[:6]}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "server_bridge", "--broker", broker.address,
                 "--registry", str(tmp / "registry.json"), "--tenant", "acme",
                 "--device", "dev1:thermostat", "--client-id", client_id],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=SLOW)

    def wait_online(self, watcher: Peer) -> None:
        try:
            got = status_of(watcher, self.P)
        except AssertionError:
            raise AssertionError(f"the bridge did not start:\n{self.output()}") from None
        assert got["st"] == "online", got

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[MosquittoProcess]:
    """A broker of the test's own, with persistence: a bridge process uses the prefix wren/v1,
    and restarting the shared one would disturb every other test."""
    b = start_mosquitto(tmp_path / "mosquitto", persistence=True)
    yield b
    b.stop()


def test_a_killed_bridge_process_leaves_offline_retained(
    own_broker: MosquittoProcess, tmp_path: Path
) -> None:
    p = BridgeProcess.P
    watcher = Peer(own_broker, [f"{p}/b/status"])
    bridge = BridgeProcess(own_broker, tmp_path, "wren-bridge-a")
    try:
        bridge.wait_online(watcher)
        bridge.kill()
        assert status_of(watcher, p) == {"st": "offline", "id": "wren-bridge-a"}  # its will
        later = Peer(own_broker, [f"{p}/b/status"])
        try:
            assert status_of(later, p) == {"st": "offline", "id": "wren-bridge-a"}  # retained
        finally:
            later.close()
    finally:
        bridge.kill()
        watcher.close()


# ---------------------------------------------------------------- persistent session


def test_what_boards_send_while_the_bridge_is_dead_is_forwarded_when_it_is_back(
    own_broker: MosquittoProcess, tmp_path: Path
) -> None:
    p = BridgeProcess.P
    evt, host_evt = f"{p}/d/dev1/evt", f"{p}/h/acme/dev1/evt"
    watcher = Peer(own_broker, [f"{p}/b/status"])
    host = Peer(own_broker, [host_evt])
    board = Peer(own_broker)
    bridge = BridgeProcess(own_broker, tmp_path, "wren-bridge")
    again: Bridge | None = None
    registry: Registry | None = None
    try:
        bridge.wait_online(watcher)
        board.send(evt, ev(1, run="before"))
        assert host.get(host_evt, timeout=SLOW) == ev(1, run="before")
        bridge.kill()
        assert status_of(watcher, p)["st"] == "offline"
        board.send(evt, [ev(1), ev(2)])
        board.send(evt, ev(3, "run.done", usage={}))
        # A bridge with the same client id: the broker kept what came in between.
        registry = Registry(tmp_path / "registry.json")
        cfg = BridgeConfig(
            host=own_broker.host, port=own_broker.port, username=None, password=None,
            prefix=p, client_id="wren-bridge",
        )  # fmt: skip
        again = Bridge(cfg, registry, ScriptedProvider())
        again.start()
        got: list[Any] = []
        while len([e for e in got if e["r"] == "r1"]) < 3 and len(got) < 10:
            got.append(host.get(host_evt, timeout=SLOW))
        # At least once: the killed bridge may have died before it acknowledged "before";
        # then the broker delivers it again (hosts drop the repeat by id).
        assert [e for e in got if e["r"] != "r1"] in ([], [ev(1, run="before")])
        assert [e for e in got if e["r"] == "r1"] == [ev(1), ev(2), ev(3, "run.done", usage={})]
        assert again.stats["session.resumed"] == 1
        assert status_of(watcher, p) == {"st": "online", "id": "wren-bridge"}
    finally:
        if again is not None:
            again.stop()
        if registry is not None:
            registry.close()
        bridge.kill()
        for peer in (watcher, host, board):
            peer.close()


def test_the_bridge_rides_out_a_broker_restart(
    own_broker: MosquittoProcess, tmp_path: Path
) -> None:
    w = World(own_broker, tmp_path, ScriptedProvider(), replay_retry_s=60, replay_retry_max_s=60)
    # Board and host with persistent sessions, which the broker saves and restores.
    tag = uuid.uuid4().hex[:6]
    board = Peer(own_broker, [w.d("rpc/res")], client_id=f"board-{tag}", clean_session=False)
    host = Peer(own_broker, [w.h("evt")], client_id=f"host-{tag}", clean_session=False)
    try:
        board.send(w.d("evt"), ev(1, run="x"))
        assert host.get(w.h("evt")) == ev(1, run="x")

        def while_down() -> None:
            # Both connections: `connected` is false once either has noticed, and paho
            # takes a publish as sent (not kept for the reconnect) while its socket is
            # open still.
            wait_for(
                lambda: not (w.bridge.control_connected or w.bridge.events_connected),
                "the bridge to notice",
                SLOW,
            )
            wait_for(lambda: not (board.connected or host.connected), "the peers to notice", SLOW)
            # Forwarding an event while the broker is away: paho keeps it (handed over
            # by the forwarder thread).
            w.bridge.intake.accept(DEV, [ev(2, run="x")])
            wait_for(lambda: w.bridge.stats["publish.queued_offline"] == 1, "paho to keep it")
            assert w.bridge.stats["publish.not_sent"] == 0

        own_broker.restart(down=while_down)
        # At least once: the broker may deliver event 1 again after its restart (QoS 1);
        # hosts drop a repeat by its id.
        got = host.get(w.h("evt"), timeout=SLOW)
        while got == ev(1, run="x"):
            got = host.get(w.h("evt"), timeout=SLOW)
        assert got == ev(2, run="x")
        wait_for(lambda: w.bridge.connected, "the bridge to reconnect", SLOW)
        assert w.bridge.stats["session.resumed"] >= 1  # the broker restored its session
        wait_for(lambda: board.connected and host.connected, "the peers to reconnect", SLOW)
        # The next RPC call and the next event are served.
        board.send(w.d("rpc"), {"c": 7, "m": "llm.complete", "a": {"messages": [USER]}})
        msg = board.get(w.d("rpc/res"))
        while "ch" in msg:
            msg = board.get(w.d("rpc/res"))
        assert msg["c"] == 7 and msg["ok"]["finish"] == "tool_calls"
        board.send(w.d("evt"), ev(3, run="x"))
        got = host.get(w.h("evt"))
        while got in (ev(1, run="x"), ev(2, run="x")):
            got = host.get(w.h("evt"))
        assert got == ev(3, run="x")
    finally:
        board.close()
        host.close()
        w.close()


# ---------------------------------------------------------------- host replay


def test_a_host_replay_is_answered_from_the_bridges_window(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    w = World(
        broker,
        tmp_path,
        ScriptedProvider(),
        events_per_run=3,
        replay_retry_s=60,
        replay_retry_max_s=60,
    )
    try:
        # A watcher's token: the run has no run.started, so no user the bridge knows of,
        # and only a watcher may replay it (server_bridge/access.py).
        tok = token("ops", watch=True)
        w.board.send(w.d("evt"), [ev(i) for i in range(1, 6)])
        assert [e["i"] for e in host_events(w, 5)] == [1, 2, 3, 4, 5]

        w.host.send(w.h("ctl"), {"op": "replay", "r": "r1", "after": 0, "tok": tok})
        told, *again = host_events(w, 4)
        assert (told["r"], told["i"], told["t"]) == ("_b", 1, "error")
        assert {k: told["d"][k] for k in ("kind", "r", "from", "to")} == {
            "kind": "gap", "r": "r1", "from": 1, "to": 2
        }  # fmt: skip
        assert told["d"]["msg"]
        assert again == [ev(3), ev(4), ev(5)]

        w.host.send(w.h("ctl"), {"op": "replay", "r": "r1", "after": 3, "tok": tok})
        assert host_events(w, 2) == [ev(4), ev(5)]  # all held: no gap
        w.host.send(w.h("ctl"), {"op": "replay", "r": "r1", "after": 5, "tok": tok})
        w.host.send(w.h("ctl"), {"op": "replay", "r": "nope", "after": 0, "tok": tok})
        unknown = w.host.get(w.h("evt"))  # nothing came for after=5
        assert (unknown["r"], unknown["i"]) == ("_b", 2)
        assert unknown["d"]["kind"] == "unknown_run" and unknown["d"]["r"] == "nope"

        forged = token("mallory", secret=OTHER_SECRET)
        w.host.send(w.h("ctl"), {"op": "replay", "r": "r1", "after": 0, "tok": forged})
        w.host.send(w.h("ctl"), {"op": "replay", "r": "r1", "after": -1, "tok": tok})
        refused = host_events(w, 2)
        assert [(e["r"], e["i"], e["d"]["kind"]) for e in refused] == [
            ("_b", 3, "bad_token"),
            ("_b", 4, "bad_envelope"),
        ]
        assert forged not in refused[0]["d"]["msg"]
        # Another tenant's device: refused like any host ctl.
        w.host.send(w.h("ctl", "acme", "dev2"), {"op": "replay", "r": "r1", "after": 0, "tok": tok})
        w.refused("unknown_device")

        # None of it reached the board: the first ctl it gets is the cancel sent after.
        w.host.send(w.h("ctl"), {"op": "cancel", "r": "r1", "tok": tok})
        assert w.board.get(w.d("ctl")) == {"op": "cancel", "r": "r1"}
        stats = w.bridge.stats
        assert (stats["host.replay"], stats["host.replay_events"], stats["host.replay_gap"]) == (
            4, 5, 1
        )  # fmt: skip
        assert stats["refused.unknown_run"] == 1
    finally:
        w.close()


def test_the_window_reader() -> None:
    sink = Sink()
    it = intake(sink, keep=2)
    assert it.window("dev1", "r1") is None
    it.accept(DEV, [ev(2)])  # held: nothing forwarded yet
    assert it.window("dev1", "r1") == ([], None, 1, None)
    it.accept(DEV, [ev(1), ev(3)])
    window = it.window("dev1", "r1", after=1)
    assert window is not None
    events = [msgpack.unpackb(p, raw=False) for p in window.payloads]
    assert (events, window.first, window.next) == ([ev(2), ev(3)], 2, 4)
    assert [e["i"] for e in it.events("dev1", "r1")] == [2, 3]  # events() unchanged


# ---------------------------------------------------------------- the window's budget


def window_bytes(it: Any, devices: list[str]) -> int:
    """What the windows of these devices' runs hold, counted from what a replay gets."""
    total = 0
    for device in devices:
        for run in it.runs(device):
            window = it.window(device, run)
            total += sum(len(p) + OVERHEAD for p in window.payloads)
    return total


def test_the_window_budget_holds_under_a_flood_from_several_devices() -> None:
    budget = 64 * 1024
    it = intake(Sink(), window_bytes=budget)
    quiet = DeviceRecord("quiet", "calm", "x")
    floods = [DeviceRecord(f"f{k}", f"t{k}", "x") for k in range(3)]
    # The quiet device's run first: the oldest window of all, and the smallest.
    it.accept(quiet, [ev(i) for i in range(1, 11)])
    for i in range(1, 201):
        for dev in floods:
            for run in ("a", "b", "c", "d"):
                it.accept(dev, [ev(i, run=run, m=1, text="z" * 1000)])
                assert it.window_used <= budget
    devices = ["quiet", *(d.device for d in floods)]
    # The account matches what the windows hold, and never went over the budget.
    assert window_bytes(it, devices) == it.window_used
    assert it.window_peak <= budget
    assert it.counts["window.evicted"] > 0
    # The floods lost their oldest events, not the quiet device.
    assert [e["i"] for e in it.events("quiet", "r1")] == list(range(1, 11))
    for dev in floods:
        for run in ("a", "b", "c", "d"):
            window = it.window(dev.device, run)
            assert window is not None and window.first is not None and window.first > 1
            assert [e["i"] for e in it.events(dev.device, run)] == list(range(window.first, 201))


def test_finished_runs_are_trimmed_first_down_to_their_end() -> None:
    cost = len(msgpack.packb(ev(1, run="b", m=1, text="z" * 500))) + OVERHEAD
    budget = 20 * cost
    it = intake(Sink(), window_bytes=budget)
    it.accept(DEV, [ev(i, run="a", m=1, text="z" * 500) for i in range(1, 6)])
    it.accept(DEV, [ev(6, "run.done", run="a")])
    # A live run fills the budget: the finished run loses its oldest events first.
    it.accept(DEV, [ev(i, run="b", m=1, text="z" * 500) for i in range(1, 18)])
    assert [e["i"] for e in it.events("dev1", "b")] == list(range(1, 18))
    a = [e["i"] for e in it.events("dev1", "a")]
    assert a == list(range(a[0], 7)) and a[0] > 1
    # Then the live run's own oldest; the finished run keeps its end while larger
    # windows remain: a host that missed it still learns how the run ended.
    it.accept(DEV, [ev(i, run="b", m=1, text="z" * 500) for i in range(18, 41)])
    assert [(e["i"], e["t"]) for e in it.events("dev1", "a")] == [(6, "run.done")]
    window = it.window("dev1", "a")
    assert window is not None and (window.first, window.next) == (6, 7)
    b = [e["i"] for e in it.events("dev1", "b")]
    assert b == list(range(b[0], 41)) and b[0] > 1
    assert it.window_peak <= budget and window_bytes(it, ["dev1"]) == it.window_used


def test_an_event_larger_than_the_window_budget_is_not_kept() -> None:
    sink = Sink()
    it = intake(sink, window_bytes=100)
    it.accept(DEV, [ev(1, m=1, text="z" * 200), ev(2, "run.done")])
    assert sink.evts() == [1, 2]  # forwarded all the same: the window is only a cache
    assert it.window("dev1", "r1") == ([], None, 3, None)
    assert it.window_used == 0 and it.window_peak <= 100


def test_a_forgotten_run_gives_its_window_back() -> None:
    it = intake(Sink(), max_runs_per_device=2)
    for run in ("a", "b", "c"):
        it.accept(DEV, [ev(1, run=run), ev(2, "run.done", run=run)])
    assert it.runs("dev1") == ["b", "c"]
    assert window_bytes(it, ["dev1"]) == it.window_used > 0


def test_a_host_replay_of_evicted_events_is_told_gap(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    big = "z" * 1000
    cost = len(msgpack.packb(ev(10, m=1, text=big))) + OVERHEAD
    w = World(
        broker,
        tmp_path,
        ScriptedProvider(),
        window_bytes=4 * cost,
        replay_retry_s=60,
        replay_retry_max_s=60,
    )
    try:
        tok = token("ops", watch=True)  # a watcher's: the run's user is not known
        sent = [ev(i, m=1, text=big) for i in range(1, 11)]
        w.board.send(w.d("evt"), sent)
        assert host_events(w, 10) == sent
        window = w.bridge.intake.window("dev1", "r1")
        assert window is not None and window.first is not None
        first = window.first
        assert 1 < first <= 10 and w.bridge.intake.window_peak <= 4 * cost

        w.host.send(w.h("ctl"), {"op": "replay", "r": "r1", "after": 0, "tok": tok})
        told, *again = host_events(w, 1 + 11 - first)
        assert (told["r"], told["i"], told["t"]) == ("_b", 1, "error")
        assert {k: told["d"][k] for k in ("kind", "r", "from", "to")} == {
            "kind": "gap", "r": "r1", "from": 1, "to": first - 1
        }  # fmt: skip
        assert again == sent[first - 1 :]  # the same envelopes as the first time

        # Recent events still come back whole, with no gap.
        w.host.send(w.h("ctl"), {"op": "replay", "r": "r1", "after": 8, "tok": tok})
        assert host_events(w, 2) == sent[8:]
        assert w.bridge.stats["host.replay_gap"] == 1
    finally:
        w.close()


def test_a_restarted_bridge_knows_a_boards_hello_from_the_broker(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    # PROTOCOL.md "Topics": a board's hello is retained, so a bridge that starts after it
    # has the board's fields and limits even when the board cannot say hello again.
    w = World(broker, tmp_path, ScriptedProvider())
    second: Bridge | None = None
    hello = {
        "agent": "thermostat",
        "ver": "1",
        "boot": OLD_BOOT,
        "tools": [],
        "fields": [{"name": "usual_celsius", "dur": "user"}],
        "limits": {"payload": 2048},
    }
    try:
        w.board.client.publish(w.d("hello"), msgpack.packb(hello), qos=1, retain=True)
        wait_for(lambda: w.bridge.intake.capabilities("dev1"), "the first bridge's hello")
        w.bridge.stop()
        cfg = w.bridge.config
        second = Bridge(
            BridgeConfig(**{**cfg.__dict__, "client_id": f"second-{uuid.uuid4().hex[:8]}"}),
            w.registry,
            ScriptedProvider(),
        )
        second.start()
        caps = wait_for(lambda: second.intake.capabilities("dev1"), "the retained hello")
        assert caps["fields"] == hello["fields"]
        assert second.stats.get("refused.retained", 0) == 0
    finally:
        w.board.client.publish(w.d("hello"), b"", qos=1, retain=True).wait_for_publish(5)
        if second is not None:
            second.stop()
        w.close()
