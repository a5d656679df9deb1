"""Fairness between tenants: a neighbour's flood does not make a quiet tenant wait for it.

The report (issue 25, item 9): while another tenant's devices flooded the bridge with a
mix of junk RPC calls and junk events, a quiet tenant's request waited 13-19 s for its
first words instead of 0.1 s; nothing was lost, everything waited. Measured: the answers
to the junk calls queued in the bridge's one board lane, first in line on the control
connection, and every other tenant's request and model text waited behind all of them
(283,000 queued in 81 s; the quiet tenant's requests went out only once the flood ended).

Here, as reported: a real Mosquitto with production's queue sizes, a real Bridge, two
boards of tenant `other` flooding junk RPC calls and junk events, and tenant `demo`'s
board (a fake board that makes the model call a request makes and sends its first text
as an event) with its host asking. No assertion is about time: the quiet tenant's first
delta must reach its host while the flood is still being processed (fewer of the flood's
messages counted by the bridge than the flood sent in all), and the flood's answers must
all be accounted for (answered, or not queued and counted by name).

What made the quiet tenant wait in the end was the broker: it queues each connection's
input in arrival order, and one connection read every board, so a flood the machine
could not read as fast as it was offered filled that queue. The tenants' boards are now
read on links of their own (server_bridge/links.py); that a neighbour's queue at the
broker is not the quiet tenant's is checked deterministically by stopping the
neighbour's link from reading while its board sends, as a flood the bridge cannot keep
up with does.

The lane order and the RPC workers' turns are also checked directly, deterministically,
on the Outbox and the RPC server's pool, and the links' deal on LinkPlan.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from server_bridge import brokerconf
from server_bridge.lanes import Budget, Kind, Outbox
from server_bridge.links import BATCH, LinkPlan, batches
from server_bridge.registry import DeviceRecord
from server_bridge.rpc import _FairPool, tenant_share
from tests.test_bridge import token, wait_for
from tests.test_bridge_load import Fleet
from tools.broker import MosquittoProcess, start_mosquitto

WAIT = 10.0
# The flood's size: its junk calls and junk events in all (half each). Large enough that
# the bridge is still at it when the quiet tenant's request has long been served (a few
# thousand messages in), and bounded so that, without fairness, the test ends.
FLOOD = 120_000
REQUESTS = 3


@pytest.fixture(scope="module")
def sized(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MosquittoProcess]:
    b = start_mosquitto(tmp_path_factory.mktemp("fair"), extra_conf=brokerconf.BROKER_QUEUES)
    yield b
    b.stop()


def _client(broker: MosquittoProcess, name: str, flood: bool = False) -> mqtt.Client:
    c = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id=f"{name}-{uuid.uuid4().hex[:8]}",
        protocol=mqtt.MQTTv311,
    )
    if flood:
        # As fast as the broker takes it, paho's own queue bounded.
        c.max_inflight_messages_set(100)
        c.max_queued_messages_set(1000)
    connected = threading.Event()
    c.on_connect = lambda *a: connected.set()
    c.connect(broker.host, broker.port)
    c.loop_start()
    assert connected.wait(WAIT), f"{name} did not connect"
    return c


def _subscribe(c: mqtt.Client, topics: list[str]) -> None:
    done = threading.Event()
    c.on_subscribe = lambda *a: done.set()
    c.subscribe([(t, 1) for t in topics])
    assert done.wait(WAIT), "subscription not acknowledged"


class QuietBoard:
    """Tenant demo's board: a request starts a run whose model call (llm.complete) is
    made at once; the call's first chunk becomes the run's first `msg.delta` event, as
    the real board sends a turn's first words at once."""

    def __init__(self, broker: MosquittoProcess, prefix: str, device: str) -> None:
        self.p, self.device = prefix, device
        self.reqs: list[str] = []
        self.c = _client(broker, device)
        self.c.on_message = self._on_message
        _subscribe(self.c, [self._t("req"), self._t("rpc/res")])

    def _t(self, leaf: str) -> str:
        return f"{self.p}/d/{self.device}/{leaf}"

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        obj = msgpack.unpackb(msg.payload, raw=False)
        if msg.topic.endswith("/req"):
            req = obj["req"]
            self.reqs.append(req)
            call = {
                "c": req,
                "m": "llm.complete",
                "a": {"messages": [{"role": "user", "content": obj["input"]}]},
                "r": f"0000000a.{req}",
            }
            client.publish(self._t("rpc"), msgpack.packb(call), qos=1)
        elif "ch" in obj:
            req = obj["c"]
            client.publish(self._t("rpc"), msgpack.packb({"c": req, "ack": obj["s"]}), qos=1)
            if obj["s"] == 1 and "text" in obj["ch"]:
                env = {
                    "r": f"0000000a.{req}",
                    "i": 1,
                    "t": "msg.delta",
                    "ts": 1,
                    "d": {"m": 1, "text": obj["ch"]["text"]},
                }
                client.publish(self._t("evt"), msgpack.packb(env), qos=1)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


class Flooder:
    """A board of tenant other sending junk as fast as the broker takes it: calls of a
    method that does not exist (each refused and answered) and events that are not
    envelopes (each refused), alternately, `n` in all unless stopped first."""

    def __init__(self, broker: MosquittoProcess, prefix: str, device: str, n: int) -> None:
        self.c = _client(broker, device, flood=True)
        self.answers = 0
        self.c.on_message = self._on_answer
        _subscribe(self.c, [f"{prefix}/d/{device}/rpc/res"])
        self._rpc = f"{prefix}/d/{device}/rpc"
        self._evt = f"{prefix}/d/{device}/evt"
        self._n = n
        self.sent = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._flood, daemon=True)

    def _on_answer(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        self.answers += 1

    def _flood(self) -> None:
        junk_evt = msgpack.packb({"r": "zz", "i": "no", "t": "msg.delta"})
        for k in range(self._n):
            if self.stop.is_set():
                return
            if k % 2:
                topic, payload = self._evt, junk_evt
            else:
                topic, payload = self._rpc, msgpack.packb({"c": k, "m": "no.such", "a": {}})
            while self.c.publish(topic, payload, qos=1).rc == mqtt.MQTT_ERR_QUEUE_SIZE:
                if self.stop.is_set():
                    return
                time.sleep(0.001)
            self.sent += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(WAIT)
        self.c.disconnect()
        self.c.loop_stop()


def _flood_seen(stats: dict[str, int]) -> int:
    """The flood's messages the bridge has processed: each is refused by kind."""
    return stats["tenant.other.refused.unknown_method"] + stats["tenant.other.refused.bad_envelope"]


def test_a_quiet_tenant_is_served_during_a_neighbours_mixed_flood(
    sized: MosquittoProcess, tmp_path: Path
) -> None:
    f = Fleet(sized, tmp_path, {"quiet": "demo", "f1": "other", "f2": "other"})
    flooders: list[Flooder] = []
    try:
        quiet = QuietBoard(sized, f.p, "quiet")
        f.closing.append(quiet)
        host = _client(sized, "host-demo")
        deltas: dict[str, int] = {}  # req -> flood messages processed when it arrived
        got = threading.Condition()

        def on_host(client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
            env = msgpack.unpackb(msg.payload, raw=False)
            if env.get("t") == "msg.delta":
                with got:
                    deltas.setdefault(env["r"].split(".", 1)[1], _flood_seen(f.bridge.stats))
                    got.notify_all()

        host.on_message = on_host
        # Every host topic of the device: where a run's events go is the host side's.
        _subscribe(host, [f"{f.p}/h/demo/quiet/#"])
        f.closing.append(_Closer(host))
        flooders = [Flooder(sized, f.p, d, FLOOD // 2) for d in ("f1", "f2")]
        for fl in flooders:
            fl.thread.start()
        # The flood under way at the bridge before the first request.
        wait_for(lambda: _flood_seen(f.bridge.stats) >= 2000, "the flood to reach the bridge", 60)
        tok = token("alice", tenant="demo")
        reqs = [f"q{k}" for k in range(REQUESTS)]
        for req in reqs:
            host.publish(
                f"{f.p}/h/demo/quiet/req",
                msgpack.packb({"req": req, "input": "hi", "tok": tok}),
                qos=1,
            )
            # Each request waits for the one before it (a user asking again), at most
            # as long as the whole flood takes to be processed.
            with got:
                while req not in deltas and any(fl.thread.is_alive() for fl in flooders):
                    got.wait(0.2)
        for fl in flooders:
            fl.thread.join(300)
        sent = sum(fl.sent for fl in flooders)
        assert sent == FLOOD, "the flood did not finish sending"
        # Every flood message processed (each refused by name, counted per tenant).
        wait_for(lambda: _flood_seen(f.bridge.stats) == FLOOD, "the flood to be processed", 300)
        with got:
            at = dict(deltas)
        assert set(at) == set(reqs), f"first deltas: {at}; stats {f.bridge.stats}"
        # Served while the flood was still being processed, each one: not after it.
        assert all(n < FLOOD for n in at.values()), at
        stats = f.bridge.stats
        # The flood's calls: each answered, or its answer not queued for a full lane of
        # its own tenant, counted by name; nothing of tenant demo's was ever refused.
        calls = stats["tenant.other.refused.unknown_method"]
        wait_for(
            lambda: sum(fl.answers for fl in flooders) + stats["rpc.refusal_unsent"] == calls,
            "every junk call answered or counted unsent",
            120,
        )
        assert stats["rpc.refusal_unsent"] == stats["tenant.other.board_full"]
        assert stats["tenant.demo.board_full"] == 0
        assert not [k for k in stats if k.startswith("tenant.demo.refused")]
        assert quiet.reqs == reqs
    finally:
        for fl in flooders:
            fl.close()
        f.close()


def test_a_neighbours_queue_at_the_broker_is_not_the_quiet_tenants(
    sized: MosquittoProcess, tmp_path: Path
) -> None:
    f = Fleet(sized, tmp_path, {"quiet": "demo", "f1": "other"})
    flooder: Flooder | None = None
    try:
        bridge = f.bridge
        # demo and other, sorted, on links 0 and 1: each its own queue at the broker.
        assert f"{f.p}/d/quiet/rpc" in bridge.link_topics(0)
        assert f"{f.p}/d/f1/rpc" in bridge.link_topics(1)
        assert not any("/f1/" in t for t in bridge.link_topics(0))
        quiet = QuietBoard(sized, f.p, "quiet")
        f.closing.append(quiet)
        host = _client(sized, "host-demo")
        f.closing.append(_Closer(host))
        first = threading.Event()
        host.on_message = lambda c, u, m: first.set()
        _subscribe(host, [f"{f.p}/h/demo/quiet/#"])
        # other's link stops reading, as a link does that a flood outruns: whatever f1
        # sends waits in that link's queue at the broker.
        other_link = bridge._links[1]
        assert other_link is not None
        other_link.loop_stop()
        flooder = Flooder(sized, f.p, "f1", 2000)
        flooder.thread.start()
        flooder.thread.join(WAIT * 3)
        assert flooder.sent == 2000
        req = msgpack.packb({"req": "q1", "input": "hi", "tok": token("alice", tenant="demo")})
        host.publish(f"{f.p}/h/demo/quiet/req", req, qos=1)
        # The quiet tenant's request is served, its model call read on its own link and
        # its first words at its host, while nothing of the neighbour's has been read.
        assert first.wait(WAIT), "the quiet tenant waited for its neighbour's queue"
        assert _flood_seen(bridge.stats) == 0
        # The neighbour's link reads again: all it was sent is there, none of it lost.
        other_link.loop_start()
        wait_for(lambda: _flood_seen(bridge.stats) == 2000, "the queued flood to be read", 60)
    finally:
        if flooder is not None:
            flooder.close()
        f.close()


def _device(name: str, tenant: str) -> DeviceRecord:
    return DeviceRecord(name, tenant, "x")


def test_links_deal_tenants_in_turn_and_each_drops_only_what_is_not_its_own() -> None:
    plan = LinkPlan("P", 2, share=False)
    devices = [_device("a1", "acme"), _device("g1", "globex"), _device("i1", "initech")]
    deal = plan.deal(devices)
    # Sorted tenants in turn: acme on 0, globex on 1, initech on 0 again.
    assert deal[0] == {*plan.device_topics("a1"), *plan.device_topics("i1")}
    assert deal[1] == set(plan.device_topics("g1"))
    assert plan.device_topics("a1") == ["P/d/a1/rpc", "P/d/a1/evt", "P/d/a1/hello", "P/d/a1/status"]
    # At connect a link drops the one-link layout's wildcards and the others' boards.
    stale = plan.not_for(1, deal)
    assert stale[:5] == plan.wildcards()
    assert set(stale[5:]) == deal[0]
    # A tenant added ahead of the others shifts the deal: globex moves to link 0.
    moved = plan.deal([*devices, _device("0", "aaa")])
    assert set(plan.device_topics("g1")) <= moved[0]
    # Shared calls read through the shared group.
    assert LinkPlan("P", 2, share=True).device_topics("a1")[0] == "$share/bridge/P/d/a1/rpc"
    assert [len(b) for b in batches([str(i) for i in range(BATCH * 2 + 1)])] == [BATCH, BATCH, 1]
    with pytest.raises(ValueError):
        LinkPlan("P", 0, share=False)


def test_a_board_moved_between_links_is_read_throughout(
    sized: MosquittoProcess, tmp_path: Path
) -> None:
    # Tenant "aaa" added while the bridge runs sorts first: demo moves from link 0 to 1
    # and other from 1 to 2. The boards are subscribed on their new link before they are
    # unsubscribed from the old, so events sent all along reach the host, none missing.
    f = Fleet(sized, tmp_path, {"quiet": "demo"})
    try:
        board = f.board("quiet")
        tally = f.tally()
        run = "0000000b.1"
        sent = 0

        def send(n: int) -> None:
            nonlocal sent
            board.burst(run, n, first=sent + 1)
            sent += n

        send(50)
        assert f"{f.p}/d/quiet/evt" in f.bridge.link_topics(0)
        f.registry.add_tenant("aaa", "aa" * 32)
        f.registry.add_device("aaa1", "aaa", "x")
        deadline = time.monotonic() + WAIT
        while f"{f.p}/d/quiet/evt" not in f.bridge.link_topics(1):
            assert time.monotonic() < deadline, "demo's boards never moved to link 1"
            send(5)
            time.sleep(0.05)
        wait_for(
            lambda: f"{f.p}/d/quiet/evt" not in f.bridge.link_topics(0), "the old link to let go"
        )
        send(50)
        assert tally.wait_complete({("demo", "quiet", run): sent}, 30), tally.holes(
            ("demo", "quiet", run), sent
        )
        assert f.bridge.stats["host.gaps_told"] == 0
        print(f"moved during {sent} events; replays asked of the board: {board.replays}")
    finally:
        f.close()


class _Closer:
    def __init__(self, c: mqtt.Client) -> None:
        self.c = c

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


# --------------------------------------------------------------------------- the lanes


class _Info:
    def __init__(self, mid: int) -> None:
        self.mid, self.rc = mid, mqtt.MQTT_ERR_SUCCESS


class _Paho:
    """A paho client that takes everything and is never connected: what the outbox
    hands it is recorded in order; nothing is acknowledged unless the test says so."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self._mid = 0

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> _Info:
        self._mid += 1
        self.sent.append(topic)
        return _Info(self._mid)

    def is_connected(self) -> bool:
        return True


def test_a_tenants_events_go_out_on_the_link_that_reads_it() -> None:
    # Each link is an event channel of its own (its client, window and forwarder): the
    # events of a tenant on link 1 never wait in link 0's window, and are written by the
    # client whose network thread read them.
    ob = Outbox(lambda name, n: None, Budget(1 << 20), window=2, event_links=2)
    ob.link_of = {"demo": 0, "other": 1}.get  # type: ignore[assignment]
    first, second = _Paho(), _Paho()
    ob._event_chs[0].client, ob._event_chs[1].client = first, second  # type: ignore[assignment]
    ob._control.client = _Paho()  # type: ignore[assignment]
    for k in range(4):  # other's window fills; demo's is its own
        ob.offer_event("other", "f1", f"other/{k}", b"x")
    ob.offer_event("demo", "q1", "demo/0", b"x")
    assert first.sent == ["demo/0"] and second.sent == ["other/0", "other/1"]
    ob.on_publish(1, "events1")  # link 1's ack: room on link 1 only
    assert ob._event_chs[1].outstanding == 1 and ob._event_chs[0].outstanding == 1
    with pytest.raises(ValueError):
        ob.start(first, ob._control.client)  # type: ignore[arg-type]  # two channels, one client


def test_the_control_channel_gives_tenants_turns_and_bounds_a_tenants_board_lane() -> None:
    counts: collections.Counter[str] = collections.Counter()
    ob = Outbox(lambda name, n: counts.update({name: n}), Budget(1 << 20), window=1, board_lane=8)
    events, control = _Paho(), _Paho()
    # Not started: the clients are set by hand and _next is read in order, as the
    # forwarder reads it, so the order is the scheduler's alone.
    ob._events.client, ob._control.client = events, control  # type: ignore[assignment]
    ob._control.outstanding = 1  # the window is full: everything queues
    for k in range(8):
        assert ob.board(f"P/d/f1/rpc/res#{k}", b"x", tenant="other", refusable=True)
    # The other tenant's lane is full: a refusal made on the network thread is not
    # queued, and says so; a worker's chunk or the intake's request still is.
    assert not ob.board("P/d/f1/rpc/res#late", b"x", tenant="other", refusable=True)
    assert counts["lanes.board_full"] == 1 and counts["tenant.other.board_full"] == 1
    assert ob.board("P/d/f1/ctl#replay", b"x", tenant="other")
    ob.admit_host("demo")
    ob.host("demo", [("P/d/quiet/req", b"r")], Kind.REQ)
    ob.board("P/d/quiet/rpc/res", b"c", tenant="demo")
    ob.board("P/b/status", b"s", retain=True)  # the bridge's own: first of all
    order = []
    while (msg := ob._next(ob._control)) is not None:
        order.append(msg.topic)
    assert order[0] == "P/b/status"
    # Demo waits for one message of the other tenant, not for its nine: its board
    # lane (the model's text) first in its turn, then its host lane, each a turn.
    assert order[1:5] == ["P/d/f1/rpc/res#0", "P/d/quiet/rpc/res", "P/d/f1/rpc/res#1",
                          "P/d/quiet/req"]  # fmt: skip
    assert order[5:] == [f"P/d/f1/rpc/res#{k}" for k in range(2, 8)] + ["P/d/f1/ctl#replay"]
    assert ob.depth()["board"] == 0


# --------------------------------------------------------------------------- RPC workers


def test_rpc_workers_take_tenants_in_turn_and_keep_room_for_others() -> None:
    pool = _FairPool(4)
    assert pool.cap == tenant_share(4) == 3
    release = threading.Event()
    ran: list[str] = []
    lock = threading.Lock()
    started = threading.Semaphore(0)

    def job(name: str) -> None:
        with lock:
            ran.append(name)
        started.release()
        release.wait(WAIT)

    try:
        # A busy tenant's ten slow calls: it holds at most its share of the workers.
        for k in range(10):
            pool.submit("busy", job, f"busy{k}")
        for _ in range(3):
            assert started.acquire(timeout=WAIT)
        # The fourth worker is kept for others: idle, with seven busy calls waiting.
        wait_for(lambda: pool._idle == 1, "the fourth worker to wait")
        assert pool._running["busy"] == 3 and len(pool._queues["busy"]) == 7
        # A quiet tenant's call runs at once on the worker kept free, though seven of
        # the busy tenant's calls came before it.
        pool.submit("quiet", job, "quiet0")
        assert started.acquire(timeout=WAIT)
        with lock:
            assert ran == ["busy0", "busy1", "busy2", "quiet0"]
    finally:
        release.set()
        pool.shutdown(wait=True, cancel_futures=False)  # what waits still runs
    assert sorted(ran) == sorted([f"busy{k}" for k in range(10)] + ["quiet0"])
