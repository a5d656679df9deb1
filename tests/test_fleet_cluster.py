"""A fleet on a broker cluster, through a bridge's death and a node's (issue "Past one
machine", DESIGN "Where scale goes", "Failover"): three NATS nodes speaking MQTT
(tools/nats_cluster.py), two fleet bridges (`python -m server_bridge --fleet-dsn ...`)
on nodes 1 and 2, PostgreSQL of the tests' own for the leases, eight scripted board
peers (one a partition) spread over the three nodes, and a host (the real HostClient,
whose reducer applies an event at most once by (run, id)) on node 2.

Requests run the whole time, each answered by the scripted model with a long text that
the board takes in small chunks, acknowledging each after a pause, so that runs are in
flight when, first, the bridge on node 1 is killed (`kill -9`) and then node 3 is
stopped (its boards move to node 1, as a board whose broker went away connects to
another). Every run must end at the host, done or failed retryable, and what the host
shows of each must be whole: no id applied twice, no hole in a done run.

What ends a run the dead bridge was serving: the next owner answers the calls it left
open (`bridge_restarted`, fleet/calls.py) within a lease and a round; where it does not,
the board's call timeout (a real board's is 120 s of silence; the peers here wait
CALL_TIMEOUT_S). The bound a run must end within is stated from those, generously.

Skipped, saying why, where nats-server or PostgreSQL is missing.
"""

from __future__ import annotations

import json
import secrets
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from server_bridge.fleet import partition_of
from server_bridge.host.client import HostClient
from server_bridge.host.reducer import RunSnapshot
from server_bridge.registry import Registry
from server_bridge.tokens import sign
from tests.stack import assistant_text
from tests.test_cli import Proc
from tests.test_fleet_bridges import devices_across, owners
from tools.nats_cluster import (
    NatsCluster,
    bridge_user,
    device_user,
    host_user,
    nats_binary,
    start_nats_cluster,
)

P = "wren/v1"
TENANT = "acme"
BRIDGE = "bridge"
HOST = "host-acme"
PARTS = 8
ROUND_S = 0.5
LEASE_S = 2.0
# The peers' call timeout: a call that heard nothing this long fails (the board's
# rpc.py does so after 120 s; shorter here, to stay in the test's time).
CALL_TIMEOUT_S = 10.0
# Where a run in flight at the kill must have ended: the new owner holds the partition
# within a lease and a round and answers the dead one's calls at once; without that,
# the board's call timeout ends the call. Doubled, plus slack, for a loaded machine.
END_BOUND_S = 2 * (LEASE_S + ROUND_S + CALL_TIMEOUT_S) + 10.0
# A long answer in chunks of at most CHUNK bytes, WINDOW unacknowledged, each acked
# ACK_DELAY_S after it came: a run lasts seconds.
ANSWER = " ".join(f"word{k:03d}" for k in range(120))
CHUNK = 64
WINDOW = 2
ACK_DELAY_S = 0.06
SUBSCRIBE_S = 60.0  # QoS 1 subscriptions on NATS are JetStream consumers: seconds each batch
SETTLE_S = 60.0

pytestmark = pytest.mark.skipif(
    nats_binary() is None, reason="nats-server is not installed (apt-get install nats-server)"
)


def wait_until(what: Callable[[], bool], timeout: float, why: str, step: float = 0.05) -> float:
    start = time.monotonic()
    while not what():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{why}: not within {timeout:.0f} s")
        time.sleep(step)
    return time.monotonic() - start


class ClusterBoard:
    """A board's side of a run on the cluster, logged in as its device user with a
    persistent session: a `req` starts a run (run.started) with one llm.complete call,
    whose chunks it acknowledges ACK_DELAY_S after each came and relays as msg.delta;
    its final answer ends the run (run.done, or run.failed with the answer's
    retryable). Chunks are taken in order of `s`, as the board takes them
    (edge_runtime/rpc.py): one that comes before an earlier one, or a final answer whose
    `s` says more chunks than came, fails the call `gap`, retryable, and never ends the
    run done with text missing. A call that heard nothing for CALL_TIMEOUT_S fails the
    run retryable, as the board's call timeout does. It keeps every event it sent and
    answers the bridge's `ctl {op: replay}` from them. When its node goes away it connects to the
    next node (the session, at the cluster, goes with it) and says hello again."""

    def __init__(self, device: str, password: str, ports: list[int], node: int) -> None:
        self.device, self.ports, self.node = device, ports, node
        self.boot = secrets.token_hex(4)
        self.reqs: Counter[str] = Counter()
        self.calls: dict[int, list[Any]] = {}  # open call -> [run, last heard, last seq]
        self.ended: dict[str, tuple[str, float]] = {}  # run -> its terminal event, when
        self.sent: dict[str, list[bytes]] = {}  # run -> its events by id - 1
        self.moved = 0
        self.gaps: list[str] = []  # calls failed for a chunk that did not come in order
        self._lock = threading.Lock()
        self._runs = 0
        self._down_since: float | None = None
        self._stop = threading.Event()
        self.c = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=device,
            protocol=mqtt.MQTTv311,
            clean_session=False,
        )
        self.c.username_pw_set(device, password)
        self.c.will_set(
            self._t("status"),
            msgpack.packb({"st": "offline", "boot": self.boot}),
            qos=1,
            retain=True,
        )
        self.c.on_connect = self._on_connect
        self.c.on_disconnect = self._on_disconnect
        self.c.on_message = self._on_message
        self.subscribed = threading.Event()
        self.c.on_subscribe = lambda *a: self.subscribed.set()
        self.c.connect("127.0.0.1", ports[node])
        self.c.loop_start()
        self._watch = threading.Thread(target=self._watchdog, daemon=True)
        self._watch.start()

    def _t(self, leaf: str) -> str:
        return f"{P}/d/{self.device}/{leaf}"

    def _on_connect(self, c: mqtt.Client, u: Any, flags: Any, rc: Any, p: Any) -> None:
        if rc.is_failure:
            return
        with self._lock:
            self._down_since = None
        c.subscribe([(self._t("req"), 1), (self._t("ctl"), 1), (self._t("rpc/res"), 1)])
        hello = {
            "agent": "thermostat",
            "ver": "0.1.0",
            "fw": "test",
            "boot": self.boot,
            "tools": [],
            "limits": {"payload": 16384, "str": 4096, "window": WINDOW, "chunk": CHUNK},
        }
        c.publish(self._t("hello"), msgpack.packb(hello), qos=1, retain=True)
        c.publish(
            self._t("status"),
            msgpack.packb({"st": "online", "boot": self.boot}),
            qos=1,
            retain=True,
        )

    def _on_disconnect(self, c: mqtt.Client, u: Any, flags: Any, rc: Any, p: Any) -> None:
        with self._lock:
            if self._down_since is None:
                self._down_since = time.monotonic()

    def _watchdog(self) -> None:
        while not self._stop.wait(0.2):
            now = time.monotonic()
            with self._lock:
                stale = [
                    c for c, (run, heard, _) in self.calls.items() if now - heard > CALL_TIMEOUT_S
                ]
                down = self._down_since is not None and now - self._down_since > 3.0
            for c in stale:
                self._end_call(
                    c,
                    "run.failed",
                    {"err": {"kind": "timeout", "msg": "no answer"}, "retryable": True},
                )
            if down and not self._stop.is_set():
                # Its node is gone: the next one (paho would retry the same port only).
                self.c.loop_stop()
                self.node = (self.node + 1) % len(self.ports)
                self.moved += 1
                try:
                    self.c.connect("127.0.0.1", self.ports[self.node])
                except OSError:
                    pass
                with self._lock:
                    self._down_since = time.monotonic()
                self.c.loop_start()

    def _evt(self, run: str, t: str, d: dict[str, Any]) -> None:
        with self._lock:
            events = self.sent.setdefault(run, [])
            env = {"r": run, "i": len(events) + 1, "t": t, "ts": int(time.time() * 1000), "d": d}
            events.append(msgpack.packb(env))
            self.c.publish(self._t("evt"), events[-1], qos=1)

    def _end_call(self, c: int, t: str, d: dict[str, Any]) -> None:
        with self._lock:
            call = self.calls.pop(c, None)
        if call is None:
            return  # ended already (an answer after the timeout, say)
        self._evt(call[0], t, d)
        with self._lock:
            self.ended[call[0]] = (t, time.monotonic())

    def _gap(self, c: int, msg: str) -> None:
        # As the board does (edge_runtime/rpc.py, PROTOCOL "RPC"): a chunk missing fails
        # the call `gap`, retryable, rather than the run ending with text missing; and
        # the bridge is told to stop the stream (`ack` with `stop`).
        with self._lock:
            call = self.calls.get(c)
            got = call[2] if call is not None else 0
        self.gaps.append(msg)
        self.c.publish(self._t("rpc"), msgpack.packb({"c": c, "ack": got, "stop": True}), qos=1)
        self._end_call(c, "run.failed", {"err": {"kind": "gap", "msg": msg}, "retryable": True})

    def _ack(self, c: int, s: int) -> None:
        with self._lock:
            if c not in self.calls:
                return
        self.c.publish(self._t("rpc"), msgpack.packb({"c": c, "ack": s}), qos=1)

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        obj = msgpack.unpackb(msg.payload, raw=False)
        if msg.topic.endswith("/req"):
            req = obj["req"]
            with self._lock:
                self.reqs[req] += 1
                if self.reqs[req] > 1:
                    return  # a board starts nothing for a repeated req id
                self._runs += 1
                run, c = f"{self.boot}.{self._runs}", self._runs
            self._evt(
                run,
                "run.started",
                {
                    "agent": "thermostat",
                    "ver": "0.1.0",
                    "req": req,
                    "usr": obj["usr"],
                    "domain": "request",
                    "input": obj["input"],
                },
            )
            with self._lock:
                self.calls[c] = [run, time.monotonic(), 0]
            body = {
                "c": c,
                "m": "llm.complete",
                "r": run,
                "a": {"messages": [{"role": "user", "content": obj["input"]}]},
            }
            client.publish(self._t("rpc"), msgpack.packb(body), qos=1)
        elif msg.topic.endswith("/ctl"):
            if obj.get("op") != "replay":
                return
            with self._lock:
                again = list(self.sent.get(obj.get("r"), ())[int(obj.get("after", 0)) :])
                for payload in again:
                    client.publish(self._t("evt"), payload, qos=1)
        elif msg.topic.endswith("/rpc/res"):
            c = obj["c"]
            with self._lock:
                call = self.calls.get(c)
                if call is not None:
                    call[1] = time.monotonic()
            if call is None:
                return
            if "ch" in obj:
                s = obj.get("s")
                with self._lock:
                    # A chunk sent again (the bridge resends what was not acknowledged,
                    # after a reconnect, say) is acknowledged again but not used twice.
                    seen = isinstance(s, int) and s <= call[2]
                    # Past the next one: an earlier chunk has not come (yet). A broker
                    # may deliver it late: NATS 2.9 may give a session a QoS 1 message
                    # its dead node had delivered unacknowledged only after its ack wait
                    # (30 s), behind what came since. Taken, the earlier one would then
                    # be dropped as seen and the run end done without its text.
                    ahead = isinstance(s, int) and s > call[2] + 1
                    if isinstance(s, int) and not seen and not ahead:
                        call[2] = s
                    got = call[2]
                if ahead:
                    self._gap(c, f"chunk {s} came after chunk {got}")
                    return
                if isinstance(s, int):
                    threading.Timer(ACK_DELAY_S, self._ack, (c, s)).start()
                if "text" in obj["ch"] and not seen:
                    self._evt(call[0], "msg.delta", {"m": 1, "text": obj["ch"]["text"]})
            elif isinstance(obj.get("s"), int) and obj["s"] > call[2]:
                # A final answer says how many chunks went before it: fewer came.
                self._gap(c, f"{call[2]} of {obj['s']} chunks arrived")
            elif "ok" in obj:
                self._end_call(c, "run.done", {"usage": {}})
            else:
                err = obj.get("err") if isinstance(obj.get("err"), dict) else {}
                retry = err.get("retryable", True) is not False
                self._end_call(
                    c,
                    "run.failed",
                    {
                        "err": {"kind": str(err.get("kind")), "msg": str(err.get("msg"))},
                        "retryable": retry,
                    },
                )

    def open_runs(self) -> list[str]:
        with self._lock:
            return [call[0] for call in self.calls.values()]

    def close(self) -> None:
        self._stop.set()
        self._watch.join(5)
        self.c.disconnect()
        self.c.loop_stop()


class Fleet:
    def __init__(self, cluster: NatsCluster, dsn: str, tmp: Path, pw: dict[str, str]) -> None:
        self.cluster, self.dsn, self.tmp, self.pw = cluster, dsn, tmp, pw
        self.bridges: dict[str, Proc] = {}
        self.boards: dict[str, ClusterBoard] = {}

    def start_bridge(self, name: str, node: int) -> Proc:
        cwd = self.tmp / name
        cwd.mkdir(exist_ok=True)
        port = self.cluster.mqtt_ports[node]
        proc = Proc(
            [
                sys.executable,
                "-m",
                "server_bridge",
                "--broker",
                f"127.0.0.1:{port}",
                "--user",
                BRIDGE,
                "--password",
                self.pw[BRIDGE],
                "--client-id",
                name,
                "--registry",
                str(self.tmp / "registry.json"),
                "--tenant",
                TENANT,
                "--script",
                str(self.tmp / "script.json"),
                "--no-event-log",
                "--fleet-dsn",
                self.dsn,
                "--partitions",
                str(PARTS),
                "--fleet-round",
                str(ROUND_S),
                "--fleet-lease",
                str(LEASE_S),
            ],
            cwd,
        )
        proc.wait_for("bridge: ")
        self.bridges[name] = proc
        return proc

    def close(self) -> None:
        for board in self.boards.values():
            board.close()
        for proc in self.bridges.values():
            if proc.proc.poll() is None:
                proc.proc.kill()
                proc.proc.wait(10)


@pytest.fixture
def fleet(pg_dsn: str, tmp_path: Path) -> Iterator[tuple[Fleet, str]]:
    devices = devices_across(PARTS, 1)
    pw = {name: secrets.token_hex(8) for name in (BRIDGE, HOST, *devices)}
    # The fleet's logins: every partition session, and each bridge's event connection,
    # as the bridge user (client ids `<user>-p<k>`, `<user>-<hex>`: NATS does not bind
    # ids to users), and each bridge's control connection as `<user>.ctl`.
    users = [bridge_user(BRIDGE, pw[BRIDGE]), bridge_user(f"{BRIDGE}.ctl", pw[BRIDGE])]
    users += [device_user(P, d, pw[d]) for d in devices]
    users += [host_user(P, TENANT, HOST, pw[HOST])]
    cluster = start_nats_cluster(tmp_path / "nats", users)
    secret = secrets.token_hex(32)
    registry = Registry(tmp_path / "registry.json")
    registry.add_tenant(TENANT, secret)
    for d in devices:
        registry.add_device(d, TENANT, "thermostat")
    registry.close()
    script = {"turns": [[{"text": ANSWER}]], "chunk_chars": CHUNK}
    (tmp_path / "script.json").write_text(json.dumps(script))
    f = Fleet(cluster, pg_dsn, tmp_path, pw)
    try:
        yield f, sign(bytes.fromhex(secret), TENANT, "alice")
    finally:
        f.close()
        cluster.stop()


def test_runs_end_whole_through_a_bridge_killed_and_a_node_stopped(
    fleet: tuple[Fleet, str],
) -> None:
    f, token = fleet
    ports = f.cluster.mqtt_ports
    f.start_bridge("fleet-a", 0)
    f.start_bridge("fleet-b", 1)
    wait_until(
        lambda: sorted(Counter(owners(f.dsn).values()).values()) == [4, 4], SETTLE_S, "shares 4/4"
    )
    devices = devices_across(PARTS, 1)
    for k, d in enumerate(devices):
        f.boards[d] = ClusterBoard(d, f.pw[d], ports, k % 3)
    for board in f.boards.values():
        assert board.subscribed.wait(SUBSCRIBE_S), f"{board.device}: not subscribed"
    # The host on node 2 (the survivor's), a raw watcher of the bridges' own presence too.
    client = HostClient(
        "127.0.0.1", ports[1], TENANT, username=HOST, password=f.pw[HOST], token=token
    )
    client.connect(timeout=30)
    wills: dict[str, str] = {}
    spy = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="host-spy", protocol=mqtt.MQTTv311)
    spy.username_pw_set(HOST, f.pw[HOST])
    spy.on_message = lambda c, u, m: wills.__setitem__(
        m.topic, msgpack.unpackb(m.payload, raw=False).get("st") if m.payload else ""
    )
    spy.connect("127.0.0.1", ports[1])
    spy.loop_start()
    spy.subscribe(f"{P}/b/+/status", 1)

    reqs: dict[str, list[str]] = {d: [] for d in devices}
    sent_at: dict[str, float] = {}  # req -> when it was published (monotonic)
    asking = threading.Event()
    asking.set()
    errors: list[BaseException] = []

    def ask_loop() -> None:
        # One request at a time per device, the next once the host saw the last end.
        try:
            while asking.is_set():
                for d in devices:
                    last = reqs[d][-1] if reqs[d] else None
                    snap = client.find_run(last) if last else None
                    if last is None or (snap is not None and snap.terminal):
                        at = time.monotonic()
                        req = client.request(d, token, "Say a long thing.", timeout=30)
                        sent_at[req] = at
                        reqs[d].append(req)
                time.sleep(0.1)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    asker = threading.Thread(target=ask_loop, daemon=True)
    try:
        # The partitions subscribe their devices' topics as they come (each a JetStream
        # consumer on NATS): the first answers may take seconds.
        # A request published before its partition's subscription is made reaches no
        # one (a broker keeps nothing for a topic no session reads), and nothing says
        # when a fleet bridge's partitions are subscribed: asked again until one runs.
        for d in devices:
            deadline = time.monotonic() + SUBSCRIBE_S
            while True:
                req = client.request(d, token, "Warm up.", timeout=30)
                try:
                    client.wait_for(req, lambda snap: True, 5.0)
                    break
                except TimeoutError:
                    assert time.monotonic() < deadline, f"{d}: no run for a request"
            snap = client.wait_run(req, SUBSCRIBE_S)
            assert snap.status == "done" and snap.complete, snap
        asker.start()
        own = owners(f.dsn)
        victims = [d for d in devices if own[partition_of(d, PARTS)] == "fleet-a"]
        assert victims, own
        # 1. kill -9 the bridge on node 1 while runs of its devices are in flight.
        wait_until(
            lambda: all(f.boards[d].open_runs() for d in victims[:2]),
            30,
            "runs in flight on the doomed bridge's devices",
        )
        in_flight = {d: f.boards[d].open_runs() for d in devices}
        killed_at = time.monotonic()
        f.bridges["fleet-a"].proc.send_signal(signal.SIGKILL)
        f.bridges["fleet-a"].proc.wait(10)
        taken = wait_until(
            lambda: Counter(owners(f.dsn).values()) == {"fleet-b": PARTS},
            2 * (LEASE_S + 4 * ROUND_S) + 5,
            "the survivor holding all",
        )
        # 2. Stop node 3 (no bridge's; a third of the boards') mid-run.
        on_node3 = [d for d in devices if f.boards[d].node == 2]
        wait_until(
            lambda: any(f.boards[d].open_runs() for d in on_node3),
            30,
            "runs in flight on node 3's boards",
        )
        in_flight_node = {d: f.boards[d].open_runs() for d in on_node3}
        f.cluster.nodes[2].stop(kill=True)
        time.sleep(4.0)
        asking.clear()
        asker.join(40)
        assert not errors, errors
        # Every run asked for ends at the host: done, or failed retryable.
        snaps: dict[str, RunSnapshot] = {}
        slow: list[str] = []
        # A host request the doomed bridge read and acknowledged but had not yet passed
        # to its board when it died is lost (DESIGN "Where scale goes": not built, the
        # forward is not tied to the acknowledgement); its host is told no run started
        # and asks again. Allowed only for the doomed bridge's devices, for requests
        # sent in the second before the kill, and said; any other is a failure.
        unstarted: list[str] = []
        for d in devices:
            for req in reqs[d]:
                try:
                    snaps[req] = client.wait_run(req, END_BOUND_S)
                except TimeoutError as e:
                    near_kill = killed_at - 1.0 <= sent_at.get(req, 0.0) <= killed_at + 0.2
                    if d in victims and near_kill and "no run started" in str(e):
                        unstarted.append(req)
                    else:
                        slow.append(f"{d} {req}: {e}")
        ended_at = time.monotonic()
        print(
            f"\nkill -> survivor holding all {taken:.2f} s; runs in flight at the kill "
            f"{sum(map(len, in_flight.values()))}, at the node's stop "
            f"{sum(map(len, in_flight_node.values()))}; requests {len(snaps)}; all ended "
            f"{ended_at - killed_at:.1f} s after the kill; boards moved "
            f"{sum(b.moved for b in f.boards.values())}; requests lost with the bridge "
            f"(no run started) {len(unstarted)}"
        )
        assert not slow, f"runs not ended within {END_BOUND_S:.0f} s:\n" + "\n".join(slow)
        statuses = Counter(
            (s.status, s.retryable, (s.error or {}).get("kind")) for s in snaps.values()
        )
        print(f"runs: {dict(statuses)}")
        # Chunks a board had out of order (the broker's late redelivery at a node's
        # death): each failed its call `gap`, retryable, never a run done without text.
        print(f"calls failed gap: {[g for b in f.boards.values() for g in b.gaps]}")
        for snap in snaps.values():
            if snap.status != "done":
                board = f.boards[str(snap.device)]
                when = board.ended.get(snap.run, ("?", killed_at))[1] - killed_at
                print(
                    f"  {snap.device} (node {board.node + 1}, "
                    f"{own[partition_of(str(snap.device), PARTS)]}'s) run {snap.run}: "
                    f"{snap.error}, ended by the board {when:.1f} s after the kill; in flight "
                    f"at the kill: {snap.run in in_flight.get(str(snap.device), [])}, at the "
                    f"node's stop: {snap.run in in_flight_node.get(str(snap.device), [])}"
                )
        for req, snap in snaps.items():
            assert snap.status == "done" or (snap.status == "failed" and snap.retryable), (
                req,
                snap.status,
                snap.error,
                snap.retryable,
            )
        # Whole: no id applied twice (the reducer's de-dup), and a done run has every id
        # from 1 to its last, its text the answer exactly once.
        raw = Counter((e["r"], e["i"]) for e in client.events if not e["r"].startswith("_"))
        repeats = sum(n - 1 for n in raw.values())
        holes = {req: s.gaps for req, s in snaps.items() if s.gaps}
        print(
            f"events the host was sent twice (dropped by (run, id)): {repeats}; runs with "
            f"holes: {len(holes)}"
        )
        assert holes == {}, holes
        for req, snap in snaps.items():
            ids = sorted(i for (r, i) in raw if r == snap.run)
            assert ids == list(range(1, snap.last_id + 1)), (req, ids[-5:], snap.last_id)
            if snap.status == "done":
                assert assistant_text(snap) == ANSWER, (req, assistant_text(snap)[:80])
        # A request may reach its board twice across the kill (at least once: the dead
        # bridge may have passed it on before the broker had its acknowledgement, and
        # the next owner reads it again from the partition's session), never more; the
        # board starts one run per req id (PROTOCOL "Sessions, presence and duplicates"),
        # so each request is one run of its own.
        for board in f.boards.values():
            assert set(board.reqs.values()) <= {1, 2}, (board.device, board.reqs)
        assert len({snap.run for snap in snaps.values()}) == len(snaps)
        # The killed bridge's will, read by a host user; the survivor still online.
        assert wills.get(f"{P}/b/fleet-a/status") == "offline", wills
        assert wills.get(f"{P}/b/fleet-b/status") == "online", wills
    finally:
        asking.clear()
        spy.loop_stop()
        spy.disconnect()
        client.close()


def test_nats_gives_a_dead_nodes_unacknowledged_message_again_in_either_order(
    tmp_path: Path,
) -> None:
    """The broker's part in a rehearsal of the test above whose run ended `done` without
    its first 64 characters: a QoS 1 message that a node delivered to a board's session
    and that the board had not acknowledged when the node died is not lost, and neither
    is one published while the node was down; but their order on the board's next node
    is not the order they were published in every time. Two orders are seen here: the
    first message again at once and then the second (the node died before the
    delivery was recorded elsewhere), or the second at once and the first only after
    NATS's ack wait (30 s) ran out. A board must take chunks by `s` (the test below)."""
    pw = secrets.token_hex(8)
    device = "fleet-order"
    cluster = start_nats_cluster(
        tmp_path / "nats", [bridge_user(BRIDGE, pw), device_user(P, device, pw)]
    )
    topic = f"{P}/d/{device}/rpc/res"
    got: list[tuple[bytes | bytearray, bool]] = []
    came = threading.Condition()
    acking = threading.Event()  # not on the first node: its delivery stays unacknowledged

    def on_message(c: mqtt.Client, u: Any, m: mqtt.MQTTMessage) -> None:
        with came:
            got.append((m.payload, bool(m.dup)))
            came.notify_all()
        if acking.is_set():
            c.ack(m.mid, m.qos)

    board = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id=device,
        protocol=mqtt.MQTTv311,
        clean_session=False,
        manual_ack=True,
    )
    board.username_pw_set(device, pw)
    board.on_message = on_message
    subscribed = threading.Event()
    board.on_subscribe = lambda *a: subscribed.set()
    sender = mqtt.Client(
        CallbackAPIVersion.VERSION2, client_id="order-bridge", protocol=mqtt.MQTTv311
    )
    sender.username_pw_set(BRIDGE, pw)
    try:
        board.connect("127.0.0.1", cluster.mqtt_ports[2])
        board.loop_start()
        board.subscribe(topic, 1)
        assert subscribed.wait(SUBSCRIBE_S)
        sender.connect("127.0.0.1", cluster.mqtt_ports[1])
        sender.loop_start()
        sender.publish(topic, b"s1", qos=1).wait_for_publish(30)
        with came:
            assert came.wait_for(lambda: len(got) == 1, 30), got
        cluster.nodes[2].stop(kill=True)
        board.loop_stop()
        # Published once the node is gone (its store may wait for a new stream leader).
        sender.publish(topic, b"s2", qos=1).wait_for_publish(60)
        acking.set()
        board.connect("127.0.0.1", cluster.mqtt_ports[0])
        board.loop_start()

        def again() -> list[bytes | bytearray]:
            return [payload for payload, _ in got[1:]]

        # The ack wait (30 s) runs from the first delivery, before the kill: 45 s
        # from here bounds the late order with room on a loaded machine.
        with came:
            assert came.wait_for(lambda: {b"s1", b"s2"} <= set(again()), 45), got
            assert set(again()) == {b"s1", b"s2"}, got
    finally:
        for c in (board, sender):
            c.loop_stop()
            c.disconnect()
        cluster.stop()


def test_a_chunk_before_an_earlier_one_fails_the_run_and_never_ends_it_done(
    tmp_path: Path,
) -> None:
    """The board of the test above takes chunks as a board does: a chunk that comes
    before an earlier one (NATS's late redelivery, the test before this one) or a final
    answer whose `s` says more chunks than came fails the call `gap`, retryable, with a
    `stop` to the bridge. Taken as it came, the first ended the run `done` with its
    first chunk's text missing (the rehearsal's failure), since the earlier chunk, when
    it came, was dropped as one already seen."""
    pw = secrets.token_hex(8)
    device = "fleet-gap"
    cluster = start_nats_cluster(
        tmp_path / "nats", [bridge_user(BRIDGE, pw), device_user(P, device, pw)]
    )
    calls: list[dict[str, Any]] = []
    came = threading.Condition()

    def on_message(c: mqtt.Client, u: Any, m: mqtt.MQTTMessage) -> None:
        with came:
            calls.append(msgpack.unpackb(m.payload, raw=False))
            came.notify_all()

    bridge = mqtt.Client(
        CallbackAPIVersion.VERSION2, client_id="gap-bridge", protocol=mqtt.MQTTv311
    )
    bridge.username_pw_set(BRIDGE, pw)
    bridge.on_message = on_message
    subscribed = threading.Event()
    bridge.on_subscribe = lambda *a: subscribed.set()
    board: ClusterBoard | None = None
    try:
        bridge.connect("127.0.0.1", cluster.mqtt_ports[0])
        bridge.loop_start()
        bridge.subscribe(f"{P}/d/{device}/rpc", 1)
        assert subscribed.wait(SUBSCRIBE_S)
        board = ClusterBoard(device, pw, cluster.mqtt_ports, 0)
        assert board.subscribed.wait(SUBSCRIBE_S)

        def call_for(req: str) -> dict[str, Any]:
            body = {"req": req, "usr": "alice", "input": "Say a long thing."}
            bridge.publish(f"{P}/d/{device}/req", msgpack.packb(body), qos=1).wait_for_publish(30)
            with came:
                assert came.wait_for(lambda: any("m" in x for x in calls), 30), calls
                call = next(x for x in calls if "m" in x)
                calls.remove(call)
            return call

        def answer(on: ClusterBoard, run: str, *answers: dict[str, Any]) -> list[dict[str, Any]]:
            for a in answers:
                bridge.publish(f"{P}/d/{device}/rpc/res", msgpack.packb(a), qos=1)
            wait_until(lambda: run in on.ended, 30, f"run {run} ended")
            return [msgpack.unpackb(e, raw=False) for e in on.sent[run]]

        # 1. Chunk 2 before chunk 1, then the final answer: not done without chunk 1.
        call = call_for("r1")
        c, run = call["c"], call["r"]
        first, second = ANSWER[:CHUNK], ANSWER[CHUNK : 2 * CHUNK]
        events = answer(
            board,
            run,
            {"c": c, "s": 2, "ch": {"text": second}},
            {"c": c, "s": 1, "ch": {"text": first}},
            {"c": c, "s": 2, "ok": {"usage": {}}},
        )
        end = events[-1]
        assert end["t"] == "run.failed", events
        assert end["d"]["err"]["kind"] == "gap" and end["d"]["retryable"] is True, end
        assert [e for e in events if e["t"] == "run.done"] == [], events
        with came:
            assert came.wait_for(lambda: {"c": c, "ack": 0, "stop": True} in calls, 30), calls
        # 2. Chunk 1 only, and a final answer that says 2 went: a gap too.
        call = call_for("r2")
        c, run = call["c"], call["r"]
        events = answer(
            board, run, {"c": c, "s": 1, "ch": {"text": first}}, {"c": c, "s": 2, "ok": {}}
        )
        assert [e["t"] for e in events] == ["run.started", "msg.delta", "run.failed"], events
        assert events[-1]["d"]["err"]["kind"] == "gap", events
        # 3. In order (a chunk sent again among them): done, the text whole and once.
        call = call_for("r3")
        c, run = call["c"], call["r"]
        events = answer(
            board,
            run,
            {"c": c, "s": 1, "ch": {"text": first}},
            {"c": c, "s": 1, "ch": {"text": first}},
            {"c": c, "s": 2, "ch": {"text": second}},
            {"c": c, "s": 2, "ok": {"usage": {}}},
        )
        assert events[-1]["t"] == "run.done", events
        text = "".join(e["d"]["text"] for e in events if e["t"] == "msg.delta")
        assert text == first + second
    finally:
        if board is not None:
            board.close()
        bridge.loop_stop()
        bridge.disconnect()
        cluster.stop()
