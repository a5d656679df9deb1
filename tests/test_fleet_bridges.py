"""Fleet mode (DESIGN "Where scale goes"): two bridge processes on one prefix, each
device served by the one holding its partition's lease in PostgreSQL.

Real parts throughout: a Mosquitto of the test's own (the fleet's presence stays
`online` retained after the test, by design, which would make the session broker's
next single bridge refuse to start), two `python -m server_bridge --fleet-dsn ...`
processes with short rounds (0.3 s, lease 1.2 s), PostgreSQL of the tests' own, scripted
board peers that play a board's side of a demo turn (the request, the model call with
its chunk acks, the run's events) and a host that counts every event it is sent.

Bounds on time are derived from the lease settings and generous (a loaded machine):
what each test proves is who serves, and that nothing is served twice or lost.
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

from server_bridge.config import BridgeConfig
from server_bridge.fleet import partition_of
from server_bridge.links import PartitionPlan
from server_bridge.registry import DeviceRecord, Registry
from server_bridge.service import STOP_EXIT_CODE
from server_bridge.tokens import sign
from tests.model_server import ModelServer, Turn
from tests.test_cli import Proc
from tools.broker import MosquittoProcess, start_mosquitto

P = "wren/v1"
TENANT = "acme"
PARTS = 8
ROUND_S = 0.3
LEASE_S = 1.2
# How long a killed bridge's partitions may take to be served again: a lease and a few
# rounds, doubled for a loaded machine.
FAILOVER_BOUND_S = 2 * (LEASE_S + 4 * ROUND_S) + 2.0
ANSWER = "It is 21.5 °C in here."
WAIT_S = 20.0


def wait_until(what: Callable[[], bool], timeout: float, step: float = 0.05) -> float:
    start = time.monotonic()
    while not what():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(step)
    return time.monotonic() - start


def _client(client_id: str) -> mqtt.Client:
    return mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311)


def _subscribe(c: mqtt.Client, topics: list[str]) -> None:
    done = threading.Event()
    c.on_subscribe = lambda *a: done.set()
    c.subscribe([(t, 1) for t in topics])
    assert done.wait(WAIT_S), "subscription not acknowledged"


class BoardPeer:
    """A board's side of a demo turn: a `req` starts a run (run.started), one model call
    (llm.complete) whose text chunks are acknowledged and relayed as msg.delta events,
    and run.done on its final answer. Counts what it was asked, to show nothing twice."""

    def __init__(self, broker: MosquittoProcess, device: str) -> None:
        self.device = device
        self.boot = secrets.token_hex(4)
        self.reqs: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()  # run -> llm.complete calls made
        self.finals: Counter[str] = Counter()  # run -> final answers received
        self._lock = threading.Lock()
        self._runs = 0
        self._next_id: dict[str, int] = {}
        # Every event sent, by run: a board's ring, from which it answers the bridge's
        # replay (the bridge that takes a partition over asks for what it has not seen).
        self._sent: dict[str, list[bytes]] = {}
        self.c = _client(device)
        self.c.on_message = self._on_message
        self.c.will_set(self._t("status"), msgpack.packb({"st": "offline", "boot": self.boot}),
                        qos=1, retain=True)  # fmt: skip
        self.c.connect(broker.host, broker.port)
        self.c.loop_start()
        _subscribe(self.c, [self._t("req"), self._t("ctl"), self._t("rpc/res")])
        hello = {"agent": "thermostat", "ver": "0.1.0", "fw": "test", "boot": self.boot,
                 "tools": [], "limits": {"payload": 16384, "str": 4096}}  # fmt: skip
        self.c.publish(self._t("hello"), msgpack.packb(hello), qos=1, retain=True)
        status = {"st": "online", "boot": self.boot}
        self.c.publish(self._t("status"), msgpack.packb(status), qos=1, retain=True)

    def _t(self, leaf: str) -> str:
        return f"{P}/d/{self.device}/{leaf}"

    def _evt(self, run: str, t: str, d: dict[str, Any]) -> None:
        with self._lock:
            i = self._next_id[run] = self._next_id.get(run, 0) + 1
        env = msgpack.packb({"r": run, "i": i, "t": t, "ts": int(time.time() * 1000), "d": d})
        with self._lock:
            self._sent.setdefault(run, []).append(env)
        self.c.publish(self._t("evt"), env, qos=1)

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        obj = msgpack.unpackb(msg.payload, raw=False)
        if msg.topic.endswith("/ctl"):
            if obj.get("op") == "replay":
                with self._lock:
                    again = self._sent.get(obj.get("r"), [])[int(obj.get("after") or 0):]
                for env in again:
                    client.publish(self._t("evt"), env, qos=1)
            return
        if msg.topic.endswith("/req"):
            req = obj["req"]
            with self._lock:
                self.reqs[req] += 1
                if self.reqs[req] > 1:
                    return  # a board starts nothing for a repeated req id
                self._runs += 1
                run = f"{self.boot}.{self._runs}"
            self._evt(run, "run.started", {"agent": "thermostat", "ver": "0.1.0", "req": req,
                                           "usr": obj["usr"], "domain": "request",
                                           "input": obj["input"]})  # fmt: skip
            call = {"c": self._runs, "m": "llm.complete", "r": run,
                    "a": {"messages": [{"role": "user", "content": obj["input"]}]}}  # fmt: skip
            with self._lock:
                self.calls[run] += 1
            client.publish(self._t("rpc"), msgpack.packb(call), qos=1)
        elif msg.topic.endswith("/rpc/res"):
            run = f"{self.boot}.{obj['c']}"
            if "ch" in obj:
                client.publish(self._t("rpc"), msgpack.packb({"c": obj["c"], "ack": obj["s"]}),
                               qos=1)  # fmt: skip
                if "text" in obj["ch"]:
                    self._evt(run, "msg.delta", {"m": 1, "text": obj["ch"]["text"]})
            elif "ok" in obj:
                with self._lock:
                    self.finals[run] += 1
                self._evt(run, "run.done", {"usage": {}})
            else:
                with self._lock:
                    self.finals[run] += 1
                self._evt(run, "run.failed", {"err": {"kind": "llm", "msg": str(obj.get("err"))},
                                              "retryable": True})  # fmt: skip

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


class Host:
    """A watcher of tenant acme: sends requests and counts every event by (device, run,
    id), so an event relayed twice shows."""

    def __init__(self, broker: MosquittoProcess, token: str) -> None:
        self.token = token
        self._lock = threading.Lock()
        self.seen: Counter[tuple[str, str, int]] = Counter()
        self.runs: dict[str, tuple[str, str]] = {}  # req -> (device, run)
        self.text: dict[tuple[str, str], str] = {}
        self.ended: dict[tuple[str, str], str] = {}
        self.ended_at: dict[str, float] = {}  # req -> monotonic
        self.bridge_status: dict[str, dict[str, Any]] = {}
        self.c = _client(f"host-{secrets.token_hex(4)}")
        self.c.on_message = self._on_message
        self.c.connect(broker.host, broker.port)
        self.c.loop_start()
        _subscribe(self.c, [f"{P}/h/{TENANT}/+/evt", f"{P}/h/{TENANT}/+/u/+/evt", f"{P}/b/#"])

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        if msg.topic.startswith(f"{P}/b/"):
            if msg.payload:
                with self._lock:
                    self.bridge_status[msg.topic] = msgpack.unpackb(msg.payload, raw=False)
            return
        device = msg.topic.split("/")[4]
        env = msgpack.unpackb(msg.payload, raw=False)
        run, i, t, d = env["r"], env["i"], env["t"], env.get("d") or {}
        with self._lock:
            self.seen[device, run, i] += 1
            if t == "run.started":
                self.runs[d["req"]] = (device, run)
            elif t == "msg.delta" and self.seen[device, run, i] == 1:
                self.text[device, run] = self.text.get((device, run), "") + d["text"]
            elif t in ("run.done", "run.failed"):
                self.ended[device, run] = t
                for req, (dev, r) in self.runs.items():
                    if (dev, r) == (device, run):
                        self.ended_at.setdefault(req, time.monotonic())

    def ask(self, device: str, text: str = "How warm is it in here?") -> str:
        req = f"q{secrets.token_hex(4)}"
        body = {"req": req, "tok": self.token, "input": text}
        info = self.c.publish(f"{P}/h/{TENANT}/{device}/req", msgpack.packb(body), qos=1)
        info.wait_for_publish(WAIT_S)
        return req

    def done(self, req: str) -> bool:
        with self._lock:
            key = self.runs.get(req)
            return key is not None and self.ended.get(key) == "run.done"

    def answer(self, req: str) -> str:
        with self._lock:
            return self.text.get(self.runs[req], "")

    def twice(self) -> list[tuple[str, str, int]]:
        """Run events (not the bridges' own `_b` streams, whose ids are per process)
        the host was sent more than once."""
        with self._lock:
            return [k for k, n in self.seen.items() if n > 1 and not k[1].startswith("_")]

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def owners(dsn: str) -> dict[int, str]:
    """partition -> the bridge (client id) whose lease on it has not run out."""
    from server_bridge.pgstore import connect

    with connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT part, owner FROM wren_leases WHERE prefix = %s AND owner IS NOT NULL"
            " AND expires_at > now()",
            (P,),
        ).fetchall()
    # A keeper's id is `<name>-<8 hex>`, its name the bridge's client id.
    return {int(part): str(owner).rsplit("-", 1)[0] for part, owner in rows}


def devices_across(parts: int, per_part: int) -> list[str]:
    """Device ids, `per_part` in each of the partitions."""
    got: dict[int, list[str]] = {k: [] for k in range(parts)}
    i = 0
    while any(len(v) < per_part for v in got.values()):
        d = f"fleet{i}"
        k = partition_of(d, parts)
        if len(got[k]) < per_part:
            got[k].append(d)
        i += 1
    return [d for k in range(parts) for d in got[k]]


class Fleet:
    def __init__(self, broker: MosquittoProcess, dsn: str, tmp: Path) -> None:
        self.broker, self.dsn, self.tmp = broker, dsn, tmp
        self.devices = devices_across(PARTS, 1)
        secret = secrets.token_hex(32)
        registry = Registry(tmp / "registry.json")
        registry.add_tenant(TENANT, secret)
        for d in self.devices:
            registry.add_device(d, TENANT, "thermostat")
        registry.close()
        self.token = sign(bytes.fromhex(secret), TENANT, "alice")
        (tmp / "script.json").write_text(json.dumps([[{"text": ANSWER}]]))
        self.bridges: dict[str, Proc] = {}
        self.peers: dict[str, BoardPeer] = {}

    def start_bridge(self, name: str, model_url: str | None = None) -> Proc:
        cwd = self.tmp / name
        cwd.mkdir(exist_ok=True)
        model = (["--openai-base-url", model_url, "--model", "wren-test-model"]
                 if model_url else ["--script", str(self.tmp / "script.json")])  # fmt: skip
        proc = Proc(
            [sys.executable, "-m", "server_bridge", "--broker", self.broker.address,
             "--client-id", name, "--registry", str(self.tmp / "registry.json"),
             "--tenant", TENANT, *model,
             "--stats-file", str(cwd / "bridge.prom"),
             "--fleet-dsn", self.dsn, "--partitions", str(PARTS),
             "--fleet-round", str(ROUND_S), "--fleet-lease", str(LEASE_S)],
            cwd,
        )  # fmt: skip
        proc.wait_for("bridge: ")
        self.bridges[name] = proc
        return proc

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
        for proc in self.bridges.values():
            if proc.proc.poll() is None:
                proc.proc.kill()
                proc.proc.wait(10)


@pytest.fixture
def fleet(pg_dsn: str, tmp_path: Path) -> Iterator[Fleet]:
    broker = start_mosquitto(tmp_path / "mosquitto")
    f = Fleet(broker, pg_dsn, tmp_path)
    try:
        yield f
    finally:
        f.close()
        broker.stop()


def test_a_fleet_bridge_has_ids_of_its_own_and_partitions_shared_by_the_fleet() -> None:
    one = BridgeConfig(username="bridge", fleet_dsn="dbname=x", partitions=PARTS)
    two = BridgeConfig(username="bridge", fleet_dsn="dbname=x", partitions=PARTS)
    assert one.client_id != two.client_id and one.control_client_id != two.control_client_id
    assert one.partition_login(3) == two.partition_login(3) == ("bridge-p3", "bridge", None)
    assert BridgeConfig(username="bridge").client_id == "bridge"  # alone: as before
    with pytest.raises(ValueError):
        BridgeConfig(fleet_dsn="dbname=x", client_id="a/b")  # it names its will's topic
    with pytest.raises(ValueError):
        BridgeConfig(fleet_dsn="dbname=x", fleet_round_s=2, fleet_lease_s=1)
    with pytest.raises(ValueError):
        BridgeConfig(fleet_dsn="dbname=x", partitions=0)
    # Partition k reads its devices' board topics and their hosts' input, and no other's.
    records = [DeviceRecord(d, TENANT, "thermostat") for d in devices_across(PARTS, 2)]
    deal = PartitionPlan(P, PARTS).deal(records)
    for r in records:
        k = partition_of(r.device, PARTS)
        mine = {f"{P}/d/{r.device}/{leaf}" for leaf in ("rpc", "evt", "hello", "status")}
        mine |= {f"{P}/h/{TENANT}/{r.device}/{leaf}" for leaf in ("req", "ctl")}
        assert mine <= deal[k] and not any(mine & deal[j] for j in range(PARTS) if j != k)
    assert [len(topics) for topics in deal] == [12] * PARTS


def shares(dsn: str) -> list[int]:
    return sorted(Counter(owners(dsn).values()).values())


def test_two_bridges_share_a_prefix_and_a_killed_ones_devices_move_to_the_other(
    fleet: Fleet,
) -> None:
    a = fleet.start_bridge("fleet-a")
    fleet.start_bridge("fleet-b")  # no RivalBridge: the other is this fleet's
    settled = wait_until(lambda: shares(fleet.dsn) == [PARTS // 2, PARTS // 2], 15)
    print(f"\nshares settled 4/4 {settled:.1f} s after the second bridge started")
    own = owners(fleet.dsn)
    # One device per partition: four on each bridge.
    by_bridge = {name: [d for d in fleet.devices if own[partition_of(d, PARTS)] == name]
                 for name in ("fleet-a", "fleet-b")}  # fmt: skip
    assert sorted(map(len, by_bridge.values())) == [4, 4], by_bridge
    host = Host(fleet.broker, fleet.token)
    try:
        # The fleet's presence: online, with the fleet's id as boot.
        wait_until(lambda: f"{P}/b/status" in host.bridge_status, WAIT_S)
        fleet_boot = host.bridge_status[f"{P}/b/status"]["boot"]
        assert host.bridge_status[f"{P}/b/status"]["st"] == "online"
        for d in fleet.devices:
            fleet.peers[d] = BoardPeer(fleet.broker, d)
        # Hellos and statuses are in (a request to an unseen device is still served).
        time.sleep(0.5)

        # 1. Every device served, whichever bridge holds it.
        reqs = {d: host.ask(d) for d in fleet.devices}
        for d, req in reqs.items():
            wait_until(lambda req=req: host.done(req), WAIT_S)
            assert host.answer(req) == ANSWER, (d, host.answer(req))

        # 2. Kill one bridge without a word; ask its devices at once, while no bridge
        # holds their partitions: the requests wait in the partitions' sessions.
        victims = by_bridge["fleet-a"]
        killed_at = time.monotonic()
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(10)
        orphan_reqs = {d: host.ask(d) for d in victims}
        taken = wait_until(lambda: shares(fleet.dsn) == [PARTS], FAILOVER_BOUND_S, step=0.02)
        for d, req in orphan_reqs.items():
            wait_until(lambda req=req: host.done(req), WAIT_S)
            assert host.answer(req) == ANSWER, (d, host.answer(req))
        served = max(host.ended_at[r] for r in orphan_reqs.values()) - killed_at
        print(f"failover: the survivor held every partition {taken:.2f} s after the kill "
              f"(lease {LEASE_S} s, round {ROUND_S} s); the requests sent right after the "
              f"kill were all answered {served:.2f} s after it")  # fmt: skip
        assert served < FAILOVER_BOUND_S + WAIT_S

        # 3. And afterwards every device again, all on the survivor.
        again = {d: host.ask(d) for d in fleet.devices}
        for d, req in again.items():
            wait_until(lambda req=req: host.done(req), WAIT_S)
            assert host.answer(req) == ANSWER, (d, host.answer(req))

        # Nothing twice: each request reached its board once, each run made one model
        # call and had one final answer, and the host was sent each event once.
        for peer in fleet.peers.values():
            assert set(peer.reqs.values()) == {1}, (peer.device, peer.reqs)
            assert set(peer.calls.values()) == {1}, (peer.device, peer.calls)
            assert set(peer.finals.values()) == {1}, (peer.device, peer.finals)
        assert host.twice() == []
        # The killed bridge's will is its own; the fleet stays online, same boot.
        assert host.bridge_status[f"{P}/b/fleet-a/status"]["st"] == "offline"
        assert host.bridge_status[f"{P}/b/status"]["st"] == "online"
        assert host.bridge_status[f"{P}/b/status"]["boot"] == fleet_boot

        # 4. A clean stop (SIGTERM) gives the leases back at once and says only its own
        # status offline: with other bridges alive the fleet would serve on.
        assert fleet.bridges["fleet-b"].stop() == STOP_EXIT_CODE
        assert owners(fleet.dsn) == {}
        wait_until(lambda: host.bridge_status.get(f"{P}/b/fleet-b/status", {}).get("st")
                   == "offline", WAIT_S)  # fmt: skip
        assert host.bridge_status[f"{P}/b/status"]["st"] == "online"
    finally:
        host.close()


def test_a_model_call_in_flight_when_its_bridge_is_killed_ends_failed_retryable(
    fleet: Fleet,
) -> None:
    """The dead bridge's open call is a row in PostgreSQL (fleet/calls.py): the bridge
    that takes its partition answers it by id, retryable, so the board ends the run
    `run.failed` within a lease and a few rounds instead of at its call's timeout."""
    # A long answer at a model's pace: 600 characters, 4 at a time, 20 ms apart (3 s).
    slow = Turn(text="warm " * 120, chunk_chars=4, delay_s=0.02)
    with ModelServer([slow, slow, slow]) as model:
        a = fleet.start_bridge("fleet-a", model.url)
        fleet.start_bridge("fleet-b", model.url)
        wait_until(lambda: shares(fleet.dsn) == [PARTS // 2, PARTS // 2], 15)
        own = owners(fleet.dsn)
        victims = [d for d in fleet.devices if own[partition_of(d, PARTS)] == "fleet-a"]
        host = Host(fleet.broker, fleet.token)
        try:
            for d in fleet.devices:
                fleet.peers[d] = BoardPeer(fleet.broker, d)
            time.sleep(0.5)
            reqs = {d: host.ask(d) for d in victims}
            # Mid-answer: every victim's run has streamed some text.
            wait_until(lambda: all(host.runs.get(r) and host.text.get(host.runs[r])
                                   for r in reqs.values()), WAIT_S)  # fmt: skip
            killed_at = time.monotonic()
            a.proc.send_signal(signal.SIGKILL)
            a.proc.wait(10)
            for req in reqs.values():
                try:
                    wait_until(lambda req=req: req in host.ended_at, FAILOVER_BOUND_S + WAIT_S)
                except AssertionError:
                    b = fleet.bridges["fleet-b"]
                    said = "\n".join([*b.seen, *list(b.lines.queue)][-40:])
                    raise AssertionError(f"a run in flight did not end:\n{said}") from None
            ended = max(host.ended_at[r] for r in reqs.values()) - killed_at
            print(f"\nthe runs in flight at the kill ended {ended:.2f} s after it "
                  f"(lease {LEASE_S} s, round {ROUND_S} s)")  # fmt: skip
            for d, req in reqs.items():
                key = host.runs[req]
                # Ended honestly: failed, retryable (the board's run.failed on the
                # bridge_restarted answer), not left running, not done with half a text.
                assert host.ended[key] == "run.failed", (d, host.ended[key])
                peer = fleet.peers[d]
                assert set(peer.finals.values()) == {1}, (d, peer.finals)
            assert ended < FAILOVER_BOUND_S + WAIT_S
            # The new owner knows nothing of what the dead one relayed (the event log is
            # not yet shared between bridges), so it asks each open run's board for a
            # replay from the start: the host is sent those runs' earlier events again,
            # and applies each once (by run and id, as every host does): what it shows
            # is the answer's beginning, no chunk twice. No other run's event repeats.
            cut = {host.runs[r] for r in reqs.values()}
            assert {(d, run) for d, run, _ in host.twice()} <= cut
            for key in cut:
                assert (slow.text).startswith(host.text[key]) and host.text[key], key
            # The fleet's event log (PostgreSQL, both bridges wrote it) holds each cut
            # run whole: every id from 1 to its run.failed once, none missing.
            from server_bridge.pgstore.eventlog import PgEventLog

            shared = PgEventLog(fleet.dsn)
            try:
                for device, run in cut:
                    # The survivor's log writer flushes every 50 ms; on a loaded machine
                    # later: waited for, up to the ids the host was shown.
                    shown = max(i for (d, r, i) in host.seen if (d, r) == (device, run))

                    def logged(device: str = device, run: str = run) -> list[int]:
                        return [e.i for e in shared.events(TENANT, device, run)]

                    try:
                        wait_until(lambda shown=shown: len(logged()) >= shown, WAIT_S)
                    except AssertionError:
                        pass  # the assertion below says what the log holds
                    ids = logged()
                    assert ids == list(range(1, shown + 1)), (run, ids, shown)
            finally:
                shared.close()
            # And the devices are served by the survivor afterwards.
            for d in victims:
                req = host.ask(d)
                wait_until(lambda req=req: host.done(req), WAIT_S)
        finally:
            host.close()
