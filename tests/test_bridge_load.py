"""The bridge under load and attack: nothing is dropped silently.

A real Mosquitto (with the queue sizes of server_bridge/brokerconf.py) and a real Bridge;
boards are `tests/fakeboard.py` paho clients that publish valid events unpaced and answer
the bridge's replay requests from a ring, hosts are paho clients. Every wait is bounded;
no assertion is about how long something took.
"""

from __future__ import annotations

import collections
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from server_bridge import brokerconf
from server_bridge.bridge import Bridge
from server_bridge.config import BridgeConfig
from server_bridge.lanes import CONTROL, NOTICES_PER_TENANT, OVERHEAD, Budget, Outbox
from server_bridge.models.scripted import ScriptedProvider
from server_bridge.registry import Registry
from tests.fakeboard import FakeBoard, HostTally
from tests.test_bridge import SECRET, Peer, token, wait_for
from tools.broker import MosquittoProcess, start_mosquitto

# Bounded waits for a whole burst to arrive (seconds); generous for a slow CI machine.
BURST_WAIT = 120.0
OTHER = bytes(range(2, 34))


@pytest.fixture(scope="module")
def sized(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MosquittoProcess]:
    """A Mosquitto with the queue sizes the generated config gives production."""
    b = start_mosquitto(tmp_path_factory.mktemp("sized"), extra_conf=brokerconf.BROKER_QUEUES)
    yield b
    b.stop()


class Fleet:
    """A bridge for tenants demo and other, with their devices, on its own prefix."""

    def __init__(
        self, broker: MosquittoProcess, tmp: Path, devices: dict[str, str], **config: Any
    ) -> None:
        self.broker = broker
        self.p = f"wren-load-{uuid.uuid4().hex[:8]}/v1"
        self.registry = Registry(tmp / "registry.json")
        self.registry.add_tenant("demo", SECRET)
        self.registry.add_tenant("other", OTHER)
        for device, tenant in devices.items():
            self.registry.add_device(device, tenant, "x")
        config.setdefault("replay_retry_s", 0.2)
        config.setdefault("replay_retry_max_s", 1.0)
        cfg = BridgeConfig(
            host=broker.host,
            port=broker.port,
            username=None,
            password=None,
            prefix=self.p,
            client_id=f"wren-bridge-{uuid.uuid4().hex[:8]}",
            offline_grace_s=0,
            **config,
        )
        self.bridge = Bridge(cfg, self.registry, ScriptedProvider())
        self.bridge.start()
        self.closing: list[Any] = []

    def board(self, device: str, ring: int | None = None) -> FakeBoard:
        b = FakeBoard(self.broker.host, self.broker.port, self.p, device, ring=ring)
        self.closing.append(b)
        return b

    def tally(self) -> HostTally:
        t = HostTally(self.broker.host, self.broker.port, self.p)
        self.closing.append(t)
        return t

    def close(self) -> None:
        for c in self.closing:
            c.close()
        self.bridge.stop()
        self.registry.close()


def burst_all(boards: list[FakeBoard], n: int, text: str = "x" * 64) -> None:
    threads = [threading.Thread(target=b.burst, args=("r1", n, text)) for b in boards]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.parametrize(
    "config",
    [
        {},
        # Lanes so small that most of the burst is refused at first: deferred, then
        # fetched again by the intake's replay requests.
        {"device_queue_bytes": 2048, "max_inflight_messages": 4},
    ],
    ids=["defaults", "tight"],
)
def test_an_unpaced_burst_from_ten_boards_arrives_whole(
    sized: MosquittoProcess, tmp_path: Path, config: dict[str, Any]
) -> None:
    n = 400
    devices = {f"b{k}": "demo" for k in range(10)}
    f = Fleet(sized, tmp_path, devices, **config)
    try:
        tally = f.tally()
        boards = [f.board(d) for d in devices]
        burst_all(boards, n)
        want = {("demo", d, "r1"): n for d in devices}
        complete = tally.wait_complete(want, BURST_WAIT)
        holes = {d: tally.holes(("demo", d, "r1"), n)[:5] for d in devices}
        assert complete, f"holes (first 5 per board): {holes}; stats {f.bridge.stats}"
        stats = f.bridge.stats
        assert stats["evt.forwarded"] == 10 * n  # handed to paho: each event once
        assert stats["publish.queue_full"] == stats["publish.not_sent"] == 0
        if config:
            assert stats["evt.deferred"] > 0 and stats["evt.deferred.device"] > 0
            assert sum(b.replays for b in boards) > 0
        wait_for(lambda: f.bridge.outbox.depth()["budget_used"] == 0, "the budget to empty")
    finally:
        f.close()


def test_a_flooding_tenant_loses_no_request_of_another(
    sized: MosquittoProcess, tmp_path: Path
) -> None:
    f = Fleet(
        sized,
        tmp_path,
        {"flood": "other", "quiet": "demo"},
        device_queue_bytes=4096,
        max_inflight_messages=8,
    )
    try:
        flood = f.board("flood", ring=16)  # a real board's ring: what it overwrote is a gap
        quiet = f.board("quiet")
        host = Peer(f.broker, [f"{f.p}/h/demo/quiet/evt"])
        f.closing.append(host)
        flooding = threading.Thread(target=flood.burst, args=("r1", 20000, "y" * 200))
        flooding.start()
        wait_for(lambda: f.bridge.stats["evt.deferred"] > 0, "the flood to be deferred", 30)
        tok = token("alice", tenant="demo")
        reqs = [f"q{k}" for k in range(30)]
        for req in reqs:
            host.send(f"{f.p}/h/demo/quiet/req", {"req": req, "input": "hi", "tok": tok})
        flooding.join()

        def accounted() -> bool:
            arrived = {r["req"] for r in quiet.reqs}
            # Refusals only: each request is also told `presence` unseen (a fake board
            # says no status, PROTOCOL "Presence at the host").
            refused = {
                e["d"].get("req")
                for e in _drain(host, f"{f.p}/h/demo/quiet/evt")
                if e["t"] == "error"
            }
            told.update(refused)
            return set(reqs) <= arrived | told

        told: set[Any] = set()
        wait_for(accounted, "every request to arrive or be refused by name", 60)
        # Here none is even refused: demo's lane is its own, ahead of every event.
        assert told == set() and sorted(r["req"] for r in quiet.reqs) == sorted(reqs)
        stats = f.bridge.stats
        assert stats["tenant.other.evt.deferred"] > 0
        assert stats["tenant.demo.evt.deferred"] == 0
        assert stats["publish.not_sent"] == 0
    finally:
        f.close()


def _drain(peer: Peer, topic: str) -> list[Any]:
    inbox = peer.inbox(topic)
    got = []
    while not inbox.empty():
        got.append(inbox.get_nowait())
    return got


def test_the_memory_budget_holds_under_a_flood(sized: MosquittoProcess, tmp_path: Path) -> None:
    budget = 64 * 1024
    devices = {"f1": "demo", "f2": "other", "f3": "other"}
    f = Fleet(
        sized,
        tmp_path,
        devices,
        memory_budget_bytes=budget,
        max_inflight_messages=4,
        hold_per_run=8,
    )
    try:
        tally = f.tally()
        boards = [f.board(d) for d in devices]
        n = 300
        burst_all(boards, n, "z" * 1000)
        want = {(tenant, d, "r1"): n for d, tenant in devices.items()}
        assert tally.wait_complete(want, BURST_WAIT), f.bridge.stats
        b = f.bridge.outbox.budget
        stats = f.bridge.stats
        assert stats["evt.deferred.budget"] > 0  # the budget was what held the flood back
        assert b.peak <= budget and b.forced == 0
        assert stats["evt.forwarded"] == len(devices) * n
    finally:
        f.close()


def test_the_replay_window_budget_holds_under_a_flood(
    sized: MosquittoProcess, tmp_path: Path
) -> None:
    budget = 256 * 1024
    devices = {"f1": "demo", "f2": "other", "f3": "other"}
    f = Fleet(sized, tmp_path, devices, window_bytes=budget)
    try:
        tally = f.tally()
        boards = [f.board(d) for d in devices]
        n = 400
        burst_all(boards, n, "z" * 1000)  # ~1.1 MiB of windows per board without the bound
        want = {(tenant, d, "r1"): n for d, tenant in devices.items()}
        assert tally.wait_complete(want, BURST_WAIT), f.bridge.stats
        intake = f.bridge.intake
        assert intake.window_peak <= budget and intake.window_used <= budget
        stats = f.bridge.stats
        assert stats["window.evicted"] > 0
        assert stats["evt.forwarded"] == len(devices) * n  # the window evicts, never defers

        # A host's replay: what the window still holds comes back, the rest is a gap.
        window = intake.window("f1", "r1")
        assert window is not None and window.first is not None
        first = window.first
        assert 1 < first <= n
        evt = f"{f.p}/h/demo/f1/evt"
        host = Peer(f.broker, [evt])
        f.closing.append(host)
        # A watcher's token: a fake board's run says no user, so it is a watcher's alone.
        tok = token("ops", tenant="demo", watch=True)
        host.send(f"{f.p}/h/demo/f1/ctl", {"op": "replay", "r": "r1", "after": 0, "tok": tok})
        told = host.get(evt)
        assert (told["r"], told["d"]["kind"], told["d"]["from"], told["d"]["to"]) == (
            "_b", "gap", 1, first - 1
        )  # fmt: skip
        again = [host.get(evt) for _ in range(first, n + 1)]
        assert [(e["r"], e["i"]) for e in again] == [("r1", i) for i in range(first, n + 1)]
    finally:
        f.close()


def test_a_full_host_lane_refuses_busy_by_name(sized: MosquittoProcess, tmp_path: Path) -> None:
    f = Fleet(
        sized,
        tmp_path,
        {"quiet": "demo"},
        host_lane=1,
        max_inflight_messages=1,
        events_per_run=1000,
    )
    try:
        quiet = f.board("quiet")
        host = Peer(f.broker, [f"{f.p}/h/demo/quiet/evt"])
        f.closing.append(host)
        quiet.burst("r1", 1000, "w" * 32)
        wait_for(lambda: f.bridge.intake.expected("quiet", "r1") == 1001, "the run", 60)
        evt = f"{f.p}/h/demo/quiet/evt"
        # A watcher's token: a fake board's run says no user, so it is a watcher's alone.
        tok = token("ops", tenant="demo", watch=True)
        # The answer to this replay is 1,000 events in demo's lane, one at a time on the
        # wire (max_inflight_messages 1): requests right behind it find the lane full.
        host.send(f"{f.p}/h/demo/quiet/ctl", {"op": "replay", "r": "r1", "after": 0, "tok": tok})
        reqs = [f"q{k}" for k in range(5)]
        for req in reqs:
            host.send(f"{f.p}/h/demo/quiet/req", {"req": req, "input": "hi", "tok": tok})
        busy: dict[str, Any] = {}

        def accounted() -> bool:
            for e in _drain(host, evt):
                # (A fake board says no status: each request sent on is told `presence`
                # unseen too, PROTOCOL "Presence at the host".)
                if e["r"] == "_b" and e["t"] == "error":
                    busy[e["d"].get("req")] = e["d"]
            return set(reqs) <= {r["req"] for r in quiet.reqs} | set(busy)

        wait_for(accounted, "every request to arrive or be refused", 60)
        assert busy, "no request found the lane full"
        assert {d["kind"] for d in busy.values()} == {"busy"}
        assert all(d["msg"] for d in busy.values())
        stats = f.bridge.stats
        assert stats["refused.busy"] == len(busy) == stats["tenant.demo.busy"]
    finally:
        f.close()


def test_a_tenant_over_its_rate_is_refused_rate_limited(
    sized: MosquittoProcess, tmp_path: Path
) -> None:
    f = Fleet(sized, tmp_path, {"quiet": "demo"}, host_rate=0.001, host_burst=2)
    try:
        quiet = f.board("quiet")
        host = Peer(f.broker, [f"{f.p}/h/demo/quiet/evt"])
        f.closing.append(host)
        tok = token("alice", tenant="demo")
        for req in ("a", "b", "c", "d"):
            host.send(f"{f.p}/h/demo/quiet/req", {"req": req, "input": "hi", "tok": tok})
        # The two sent on are told `presence` unseen (a fake board says no status).
        told = [host.get(f"{f.p}/h/demo/quiet/evt") for _ in range(4)]
        assert sorted((e["r"], e["t"], e["d"].get("kind"), e["d"]["req"]) for e in told) == [
            ("_b", "error", "rate_limited", "c"),
            ("_b", "error", "rate_limited", "d"),
            ("_b", "presence", None, "a"),
            ("_b", "presence", None, "b"),
        ]
        wait_for(lambda: len(quiet.reqs) == 2, "the two within the burst")
        assert [r["req"] for r in quiet.reqs] == ["a", "b"]
        assert f.bridge.stats["tenant.demo.rate_limited"] == 2
    finally:
        f.close()


def test_a_loss_notice_is_queued_past_the_refusal_notices_cap() -> None:
    """Refusal notices to a tenant's hosts are bounded (a flood of bad input must not
    pin memory); a loss notice is the one report of events hosts will never get, so it
    is always queued, and paid for from the memory budget until it is sent."""
    counts: collections.Counter[str] = collections.Counter()
    budget = Budget(1 << 20)
    outbox = Outbox(lambda name, n: counts.update({name: n}), budget)
    topic, payload = "p/h/demo/dev1/evt", b"\x80" * 40
    told = [outbox.notice("demo", topic, payload) for _ in range(NOTICES_PER_TENANT + 3)]
    assert told.count(True) == NOTICES_PER_TENANT and counts["host.untold"] == 3
    assert budget.used == 0  # refusal notices are bounded by count, not charged
    assert outbox.notice("demo", topic, payload, loss=True)
    assert budget.used == len(payload) + OVERHEAD
    assert outbox.depth()["host"] == NOTICES_PER_TENANT + 1


class _CountingCondition(threading.Condition):
    notified = 0

    def notify(self, n: int = 1) -> None:
        # notify_all() comes here too: one count either way.
        self.notified += 1
        super().notify(n)


class _Info:
    def __init__(self, mid: int) -> None:
        self.rc, self.mid = 0, mid


class _Paho:
    """What the outbox calls of paho's client: publish, and nothing else on this path."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> _Info:
        self.sent.append(topic)
        return _Info(len(self.sent))


def test_the_forwarder_is_woken_only_when_it_has_something_to_do() -> None:
    # Every hand-over and every acknowledgement used to wake it: twice an event, each
    # taking the interpreter's lock from the thread relaying the next one. And each
    # channel's forwarder is woken by its own channel only: an ack of the flood's events
    # woke the idle control forwarder too.
    outbox = Outbox(lambda name, n: None, Budget(1 << 20), window=2)
    lock = threading.Lock()
    workers = outbox._cond = _CountingCondition(lock)
    events = outbox._events.cond = _CountingCondition(lock)
    control = outbox._control.cond = _CountingCondition(lock)
    paho, paho_ctl = _Paho(), _Paho()
    # No forwarder threads: direct only.
    outbox._events.client = paho  # type: ignore[assignment]
    outbox._control.client = paho_ctl  # type: ignore[assignment]
    assert outbox.offer_event("demo", "dev1", "t/1", b"x") is None
    outbox.on_publish(1)
    assert paho.sent == ["t/1"] and events.notified == 0  # nothing queued: nobody woken
    for k in (2, 3, 4):  # the window is 2: the third waits in its lane
        outbox.offer_event("demo", "dev1", f"t/{k}", b"x")
    assert paho.sent == ["t/1", "t/2", "t/3"] and outbox.depth()["events"] == 1
    woken = events.notified
    outbox.on_publish(2)  # room again, and a message waits: the forwarder must hear it
    assert events.notified == woken + 1
    assert control.notified == 0 and workers.notified == 0
    # An RPC worker waits for the board lane: the control channel's acks wake it, the
    # events channel's do not (they free no room there).
    outbox._board_waiting = 1
    assert outbox._events.turn is not None
    outbox._events.turn.clear()
    outbox.on_publish(3)
    assert workers.notified == 0 and control.notified == 0
    outbox.board("d/dev1/rpc/res", b"y")
    assert paho_ctl.sent == ["d/dev1/rpc/res"] and workers.notified == 1
    outbox.on_publish(1, CONTROL)
    assert workers.notified == 2 and events.notified == woken + 1
