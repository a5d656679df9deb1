"""The JSON mirror (server_bridge/mirror/; `wren bridge --json-mirror`; PROTOCOL.md "JSON
mirror"): each opted-in tenant's run events, device presence and status and each user's
last answer, as JSON beside the msgpack topics, under the same rights.

The parts alone first (topics, payloads, what is kept of a run, the mirror over fake
lanes: bounded, never silent, never in the relay's way); then with real parts
(tests/stack.py): Mosquitto with the ACL the tooling writes (both forms), the bridge
process, the board on the MicroPython unix port: who reads which JSON; then a real,
headless Node-RED (tests/nodered, `npm ci --prefix tests/nodered`) whose flow of
mqtt in -> json -> file receives a run's text and a device's presence change, and the
example dashboards in examples/dashboards/.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import pytest
import yaml

from server_bridge import brokerconf
from server_bridge.config import BridgeConfig
from server_bridge.mirror import JsonMirror, both, device_json_topic, payloads, user_json_topic
from server_bridge.mirror.runs import Runs
from server_bridge.service import bridge_config, build_parser
from server_bridge.topics import BadTopic
from tests.model_server import ModelServer, Turn
from tests.stack import DEVICE, PREFIX, TENANT, Stack, assistant_text
from tests.test_bridge import DEV, Sink, ev, intake
from tests.test_brokerconf import Client
from tests.test_privacy import FIELDS, call, result
from tools.broker import free_port

ROOT = Path(__file__).resolve().parent.parent
NODERED = ROOT / "tests" / "nodered"
DASHBOARDS = ROOT / "examples" / "dashboards"
TIMEOUT_S = 60.0
ANSWER = "It is a cosy 21 degrees in the hall."
OTHER = "other"
# Host users of the end-to-end tests, each connection a user of its own: bound to alice,
# bound to bob, a watcher, another tenant's; and Node-RED's, bound to alice.
ALICE, BOB, OPS, OUTSIDER, NODE_RED = (
    "host-alice", "host-bob", "host-ops", "host-other", "host-nodered"
)  # fmt: skip


# --- topics and payloads ---------------------------------------------------------------


def test_json_topics_sit_beside_the_event_topics_they_mirror() -> None:
    assert device_json_topic("p", "acme", "dev1") == "p/h/acme/dev1/json"
    assert device_json_topic("p", "acme", "dev1", "presence") == "p/h/acme/dev1/json/presence"
    assert device_json_topic("p", "acme", "dev1", "status") == "p/h/acme/dev1/json/status"
    assert user_json_topic("p", "acme", "dev1", "bob") == "p/h/acme/dev1/u/bob/json"
    assert user_json_topic("p", "acme", "dev1", "_", "answer") == "p/h/acme/dev1/u/_/json/answer"
    # No answer per device (it is its run's user's), no presence per user, no bad level.
    for bad in (
        lambda: device_json_topic("p", "acme", "dev1", "answer"),
        lambda: user_json_topic("p", "acme", "dev1", "bob", "presence"),
        lambda: user_json_topic("p", "acme", "dev1", "a/+"),
        lambda: device_json_topic("p", "Acme", "dev1"),
    ):
        with pytest.raises(BadTopic):
            bad()


def test_an_event_is_its_envelope_as_strict_compact_json_with_the_same_keys() -> None:
    env = {"r": "b.1", "i": 3, "t": "node.start", "ts": 9, "n": "/model", "a": 1, "k": 2,
           "d": {"kind": "model", "text": "héllo ☃"}}  # fmt: skip
    data = payloads.dumps(payloads.decode_event(msgpack.packb(env)))
    assert data == json.dumps(env, separators=(",", ":"), ensure_ascii=False).encode()
    assert list(json.loads(data)) == ["r", "i", "t", "ts", "n", "a", "k", "d"]
    # What JSON cannot hold: bytes as hex (as the HTTP API), non-finite floats as null,
    # keys as strings; the result parses strictly.
    odd = {"r": "b.1", "i": 1, "t": "x", "ts": 1,
           "d": {"b": b"\x01\xff", "nan": math.nan, "inf": -math.inf,
                 7: [b"\x00", 1.5]}}  # fmt: skip
    out = json.loads(payloads.dumps(payloads.decode_event(msgpack.packb(odd))),
                     parse_constant=lambda c: pytest.fail(f"{c} in strict JSON"))  # fmt: skip
    assert out["d"] == {"b": "01ff", "nan": None, "inf": None, "7": ["00", 1.5]}
    with pytest.raises(ValueError):
        payloads.decode_event(msgpack.packb([1, 2]))


def test_status_presence_and_answer_payloads() -> None:
    kept = {"st": "online", "fw": "1.2", "heap": 5000, "boot": "b1", "seen": 1.5, "since": 1.25,
            "other": "not shown"}  # fmt: skip
    assert json.loads(payloads.status(kept)) == {k: v for k, v in kept.items() if k != "other"}
    assert json.loads(payloads.presence("offline", 1700000000123)) == {
        "st": "offline", "since": 1700000000123
    }  # fmt: skip
    assert json.loads(payloads.answer("b.1", "hi", 55, 17, req="q1", input="?")) == {
        "r": "b.1", "text": "hi", "ts": 55, "at": 17, "req": "q1", "input": "?"
    }  # fmt: skip
    assert json.loads(payloads.answer("b.1", "x", None, 17, cut=True))["cut"] is True


# --- what is kept of a run -------------------------------------------------------------------


def _see(runs: Runs, *events: dict[str, Any], run: str = "r1") -> list[Any]:
    return [runs.see("acme", "dev1", run, e) for e in events]


def test_a_runs_user_is_learnt_as_the_intake_learns_it_and_unknown_is_nobodys() -> None:
    runs = Runs(max_runs=8)
    seen = _see(runs, ev(1, "run.started", req="q1", usr="alice"), ev(2))
    assert [usr for usr, _ in seen] == ["alice", "alice"]
    # Met mid-way, or naming a user no topic level can hold: nobody's (the watchers').
    assert _see(runs, ev(5), run="r2") == [(None, None)]
    assert _see(runs, ev(1, "run.started", usr="a/+/#"), run="r3")[0][0] is None
    # A later run.paused names it when nothing did before; never renames it.
    assert _see(runs, ev(6, "run.paused", usr="bob"), run="r2")[0][0] == "bob"
    assert _see(runs, ev(3, "run.paused", usr="mallory"))[0][0] == "alice"


def test_the_answer_is_the_last_assistant_text_of_a_run_that_ended_done() -> None:
    runs = Runs(max_runs=8, answer_chars=10)
    [*_, (usr, answer)] = _see(
        runs,
        ev(1, "run.started", req="q1", conv="c1", usr="alice", input="How warm?"),
        ev(2, "msg.start", m=1, role="assistant"),
        ev(3, "msg.delta", m=1, text="Let me "),
        ev(4, "msg.delta", m=1, text="look."),
        ev(5, "msg.end", m=1, finish="tool_calls"),
        ev(6, "msg.start", m=2, role="assistant"),  # a step that only calls a tool
        ev(7, "msg.end", m=2, finish="tool_calls"),
        ev(8, "reason.delta", m=3, text="thinking"),
        ev(9, "run.done", usage={}),
    )
    assert usr == "alice" and answer is not None
    assert (answer.text, answer.cut, answer.ts) == ("Let me loo", True, 1009)
    assert (answer.req, answer.conv, answer.input, answer.run) == ("q1", "c1", "How warm?", "r1")
    assert len(runs) == 0  # forgotten at its end
    # A run that failed or was cancelled leaves no answer; a bounded table of runs.
    failed = _see(runs, ev(1, "msg.delta", m=1, text="x"), ev(2, "run.failed"), run="r2")
    assert failed[-1] == (None, None)
    for n in range(12):
        _see(runs, ev(1), run=f"x{n}")
    assert len(runs) == 8 and runs.forgotten == 4


# --- the mirror over fake lanes --------------------------------------------------------------


class FakeLanes:
    """lanes.Outbox as the mirror uses it: records what is offered, says no on request."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, Any, str]] = []  # (tenant, topic, JSON, kind)
        self.retained: list[tuple[str, Any]] = []
        self.room = True
        self.refuse_event: str | None = None
        self.board_full = False
        self.changed = threading.Condition()

    def offer_event(self, tenant: str, device: str, topic: str, payload: bytes,
                    force: bool = False, kind: str = "evt") -> str | None:  # fmt: skip
        assert not force
        if self.refuse_event:
            return self.refuse_event
        with self.changed:
            self.events.append((tenant, topic, json.loads(payload), kind))
            self.changed.notify_all()
        return None

    def has_room(self, tenant: str, device: str) -> bool:
        return self.room

    def board(self, topic: str, payload: bytes, wait_until: float | None = None,
              retain: bool = False, tenant: str | None = None,
              refusable: bool = False) -> bool:  # fmt: skip
        assert retain and refusable and tenant is not None and wait_until is None
        if self.board_full:
            return False
        with self.changed:
            self.retained.append((topic, json.loads(payload)))
            self.changed.notify_all()
        return True

    def wait(self, pred: Any, timeout: float = 5.0) -> None:
        with self.changed:
            assert self.changed.wait_for(pred, timeout), (self.events, self.retained)


def _mirror(
    tenants: tuple[str, ...] = ("acme",), **kw: Any
) -> tuple[JsonMirror, FakeLanes, Counter[str]]:
    lanes, counts = FakeLanes(), Counter[str]()
    m = JsonMirror("p", tenants, lanes, lambda k, n: counts.update({k: n}), **kw)
    return m, lanes, counts


def _deliver(m: JsonMirror, tenant: str, device: str, e: dict[str, Any]) -> None:
    m.delivered(tenant, device, e["r"], e["i"], msgpack.packb(e))


def test_only_opted_in_tenants_are_mirrored_each_run_to_its_users_json_topic() -> None:
    m, lanes, counts = _mirror()
    m.start()
    try:
        run = [ev(1, "run.started", run="b.1", req="q1", usr="alice"),
               ev(2, "msg.start", run="b.1", m=1, role="assistant"),
               ev(3, "msg.delta", run="b.1", m=1, text=ANSWER),
               ev(4, "run.done", run="b.1")]  # fmt: skip
        for e in run:
            _deliver(m, "acme", "dev1", e)
            _deliver(m, "other", "dev9", e)  # not opted in: nothing of it
        _deliver(m, "acme", "dev1", ev(1, "error", run="_", kind="busy", msg="full"))
        _deliver(m, "acme", "dev1", ev(7, run="b.2"))  # met mid-way: the watchers'
        lanes.wait(lambda: len(lanes.events) == 6 and lanes.retained)
    finally:
        m.stop()
    topics = [t for _, t, _, _ in lanes.events]
    assert topics == ["p/h/acme/dev1/u/alice/json"] * 4 + ["p/h/acme/dev1/json",
                                                          "p/h/acme/dev1/u/_/json"]  # fmt: skip
    assert [e for _, _, e, _ in lanes.events[:4]] == run  # the envelope, the same keys
    assert {k for _, _, _, k in lanes.events} == {"json"}
    [(topic, answer)] = lanes.retained
    assert topic == "p/h/acme/dev1/u/alice/json/answer"
    assert (answer["r"], answer["text"], answer["req"]) == ("b.1", ANSWER, "q1")
    assert counts["mirror.events"] == 6 and counts["mirror.state"] == 1
    assert not [k for k in counts if "dropped" in k]


def test_every_tenant_with_a_star() -> None:
    m, lanes, _ = _mirror(("*",))
    assert m.mirrors("acme") and m.mirrors("zz")
    m2, _, _ = _mirror(("acme", "b"))
    assert m2.mirrors("b") and not m2.mirrors("c")


def test_presence_is_retained_once_per_change_and_status_each_time() -> None:
    m, lanes, counts = _mirror()
    m.start()

    def sent(n: int) -> None:
        lanes.wait(lambda: len(lanes.retained) == n)

    try:
        online = {"st": "online", "boot": "b1", "seen": 10.0, "since": 10.0}
        m.status("acme", "dev1", online)
        sent(2)
        m.status("acme", "dev1", {**online, "seen": 11.0})  # the retained copy again
        sent(3)
        # Offline: the status at once; the presence only once the bridge tells its hosts,
        # past its grace (so a broker restart's wills do not flap a dashboard).
        m.status("acme", "dev1", {"st": "offline", "boot": "b1", "seen": 12.0, "since": 12.0})
        sent(4)
        m.presence("acme", "dev1", {"st": "offline", "since": 12000})
        sent(5)
        m.presence("acme", "dev1", {"st": "online", "since": 13000})  # back
        sent(6)
        m.status("acme", "dev1", {"st": "online", "boot": "b1", "seen": 13.0, "since": 13.0})
        m.status("other", "dev9", online)
        sent(7)
        time.sleep(0.1)
    finally:
        m.stop()
    presence = [p for t, p in lanes.retained if t == "p/h/acme/dev1/json/presence"]
    assert presence == [{"st": "online", "since": 10000}, {"st": "offline", "since": 12000},
                        {"st": "online", "since": 13000}]  # fmt: skip
    statuses = [p["st"] for t, p in lanes.retained if t == "p/h/acme/dev1/json/status"]
    assert statuses == ["online", "online", "offline", "online"]
    assert len(lanes.retained) == 7 and counts["mirror.state"] == 7
    assert not [t for t, _ in lanes.retained if "/other/" in t]


def test_a_full_board_lane_defers_retained_messages_and_sends_the_newest() -> None:
    m, lanes, counts = _mirror()
    lanes.board_full = True
    m.start()
    try:
        for n in range(5):
            m.status("acme", "dev1", {"st": "offline", "seen": float(n)})
        time.sleep(0.3)
        assert lanes.retained == [] and counts["mirror.state.deferred"] >= 2
        lanes.board_full = False
        lanes.wait(lambda: len(lanes.retained) == 1)
    finally:
        m.stop()
    assert lanes.retained == [("p/h/acme/dev1/json/status", {"st": "offline", "seen": 4.0})]


def test_a_full_queue_or_lanes_without_room_drop_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    m, lanes, counts = _mirror(queue_events=3)
    m.start()
    with m._cond:  # the thread held up: the hook must neither wait nor grow the queue
        for i in range(1, 6):
            with caplog.at_level(logging.WARNING, "wren.bridge.mirror"):
                _deliver(m, "acme", "dev1", ev(i))
    assert counts["mirror.dropped.queue"] == 2 and counts["tenant.acme.mirror.dropped"] == 2
    assert len([r for r in caplog.records if "behind" in r.message]) == 1  # once an episode
    lanes.wait(lambda: len(lanes.events) == 3)
    lanes.room = False
    _deliver(m, "acme", "dev1", ev(6))
    lanes.room, lanes.refuse_event = True, "device"
    _deliver(m, "acme", "dev1", ev(7))
    deadline = time.monotonic() + 5
    while counts["mirror.dropped.lanes"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert counts["mirror.dropped.lanes"] == 2
    m.stop()
    _deliver(m, "acme", "dev1", ev(8))
    assert counts["mirror.dropped.stopped"] == 1


def test_the_hooks_never_raise_into_the_relay(caplog: pytest.LogCaptureFixture) -> None:
    m, lanes, counts = _mirror()
    m.start()
    try:
        with caplog.at_level(logging.ERROR, "wren.bridge.mirror"):
            m.delivered("acme", "dev1", "r1", 1, b"\xc1 not msgpack")
            m.status("acme", "dev1", None)  # type: ignore[arg-type]
            _deliver(m, "acme", "dev1", ev(1))
            lanes.wait(lambda: len(lanes.events) == 1)
    finally:
        m.stop()
    assert counts["callback_errors"] == 2
    assert len([r for r in caplog.records if r.exc_info]) == 2


def test_the_mirror_gets_events_after_the_bridges_redaction() -> None:
    sink = Sink()
    it = intake(sink)
    m, lanes, _ = _mirror()
    it.on_delivered = both(lambda *a: None, m.delivered)
    m.start()
    try:
        it.handle_hello(DEV, msgpack.packb({"agent": "thermostat", "fields": FIELDS}))
        args = {"field": "diary", "key": "d1", "value": "secret"}
        it.accept(DEV, [ev(1, "run.started", req="q1", usr="alice"),
                        call(2, "c1", "memory.remember", args), result(3, "c1", "stored secret"),
                        ev(4, "row", field="diary", row="d1", status="final",
                           value="secret")])  # fmt: skip
        lanes.wait(lambda: len(lanes.events) == 4)
    finally:
        m.stop()
    mirrored = [e for _, _, e, _ in lanes.events]
    assert mirrored == [obj for leaf, obj in sink.sent if leaf == "evt"]
    assert "secret" not in json.dumps(mirrored)
    assert mirrored[3]["d"] == {"redacted": True}


# --- the command line and the broker's rights ------------------------------------------------


def test_the_flag_is_repeatable_and_star_is_every_tenant(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parse = build_parser().parse_args
    assert bridge_config(parse([])).json_mirror == frozenset()
    config = bridge_config(parse(["--json-mirror", "demo", "--json-mirror", "acme"]))
    assert config.json_mirror == {"demo", "acme"}
    assert bridge_config(parse(["--json-mirror", "*"])).json_mirror == {"*"}
    for bad in ("Demo", "a/b", "", "#"):
        with pytest.raises(SystemExit):
            parse(["--json-mirror", bad])
    assert "tenant id" in capsys.readouterr().err
    with pytest.raises(ValueError):
        BridgeConfig(json_mirror=frozenset({"a+b"}))


def test_host_users_read_the_json_of_what_they_read_as_events() -> None:
    text = brokerconf.acl_text(PREFIX, "bridge", {"acme": ["host-acme", "host-bob"]},
                               {"host-bob": "bob"})  # fmt: skip
    for line in ("topic read wren/v1/h/acme/+/json/#", "topic read wren/v1/h/acme/+/u/+/json/#",
                 "topic read wren/v1/h/acme/+/u/bob/json/#"):  # fmt: skip
        assert line in text.splitlines(), line
    entries = {u: brokerconf.hash_password(u) for u in ("bridge", "host-acme", "host-bob")}
    doc = brokerconf.dynsec_config(PREFIX, "bridge", {"acme": ["host-acme", "host-bob"]},
                                   entries, {"host-bob": "bob"})  # fmt: skip
    roles = {r["rolename"]: {a["topic"] for a in r["acls"]} for r in doc["roles"]}
    assert "wren/v1/h/acme/+/json/#" in roles["tenant-acme"]
    assert roles["watch-acme"] == {"wren/v1/h/acme/+/u/+/evt", "wren/v1/h/acme/+/u/+/json/#"}
    assert roles["user-acme-bob"] == {"wren/v1/h/acme/+/u/bob/evt",
                                      "wren/v1/h/acme/+/u/bob/json/#"}  # fmt: skip


# --- with real parts: who reads which JSON ------------------------------------------------


def _json_drain(c: Client, until: float) -> list[tuple[str, Any, bool]]:
    got = []
    while (left := until - time.monotonic()) > 0:
        try:
            msg = c.messages.get(timeout=left)
        except queue.Empty:
            break
        got.append((msg.topic, msg.payload, msg.retain))
    return got


def _json_until(c: Client, pred: Any, seen: list[tuple[str, Any, bool]]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not any(pred(t, p) for t, p, _ in seen):
        try:
            msg = c.messages.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"what was waited for never came; came: {seen}") from None
        seen.append((msg.topic, msg.payload, msg.retain))


@pytest.mark.parametrize("access", ["acl_file", "dynsec"])
def test_a_bound_host_user_reads_its_users_json_alone_and_another_tenant_none(
    tmp_path: Path, access: str
) -> None:
    with (
        ModelServer([Turn(text=ANSWER)]) as server,
        Stack(
            tmp_path,
            model_url=server.url,
            extra_users={ALICE: TENANT, BOB: TENANT, OPS: TENANT, OUTSIDER: OTHER},
            bound_users={ALICE: "alice", BOB: "bob"},
            access=access,
            bridge_args=["--json-mirror", TENANT],
        ) as s,
    ):
        h = f"{PREFIX}/h/{TENANT}"
        clients = {u: Client(s.host, s.port, u, s.users[u]) for u in (ALICE, BOB, OPS, OUTSIDER)}
        try:
            # Each subscribes to everything it might: under the acl_file the broker grants
            # each and delivers only what the user may read; the plugin refuses the wider.
            wide = [f"{PREFIX}/#", f"{h}/+/u/+/json/#", f"{h}/+/u/alice/json/#"]
            for user, c in clients.items():
                refused = [c.subscribe(t)[0].is_failure for t in wide]
                if access == "acl_file":
                    assert refused == [False] * 3, user
                own = {ALICE: ["alice"], BOB: ["bob"], OPS: ["+"], OUTSIDER: []}[user]
                for usr in own:
                    assert not c.subscribe(f"{h}/+/u/{usr}/json/#")[0].is_failure
                dev = c.subscribe(f"{h}/+/json/#")[0].is_failure
                assert dev == (user == OUTSIDER and access == "dynsec"), user
            assert "json mirror: tenant demo" in s.bridge_log()
            snap = s.ask("How warm is it?")  # alice's run (the stack's host has her token)
            assert snap.status == "done" and assistant_text(snap) == ANSWER, s.describe()

            user_json = f"{h}/{DEVICE}/u/alice/json"
            seen = {u: [] for u in clients}  # type: dict[str, list[tuple[str, Any, bool]]]
            for user in (ALICE, OPS):
                _json_until(clients[user], lambda t, p: t == f"{user_json}/answer", seen[user])
                _json_until(clients[user], lambda t, p: t == f"{h}/{DEVICE}/json/presence",
                            seen[user])  # fmt: skip
            for user, c in clients.items():
                seen[user] += _json_drain(c, time.monotonic() + 1.0)
            # Alice's host user and the watcher: her run as JSON, and her answer.
            for user in (ALICE, OPS):
                # By id: a user's overlapping subscriptions may bring a message twice.
                by_id = {e["i"]: e for e in (json.loads(p) for t, p, _ in seen[user]
                                             if t == user_json)}  # fmt: skip
                events = [by_id[i] for i in sorted(by_id)]
                assert sorted(by_id) == list(range(1, len(events) + 1))
                assert events[0]["t"] == "run.started" and events[-1]["t"] == "run.done"
                text = "".join(e["d"]["text"] for e in events if e["t"] == "msg.delta")
                assert text == ANSWER
                answers = [json.loads(p) for t, p, _ in seen[user] if t == f"{user_json}/answer"]
                answer = answers[-1]
                assert answer["text"] == ANSWER and answer["input"] == "How warm is it?"
                assert answer["r"] == events[0]["r"]
            # Bob's: the device's JSON (presence, status) and nothing of alice's run.
            assert seen[BOB] and not [t for t, _, _ in seen[BOB] if "/u/" in t], seen[BOB]
            presence = [json.loads(p) for t, p, r in seen[BOB] if t.endswith("/json/presence")]
            assert presence and presence[-1]["st"] == "online"
            statuses = [json.loads(p) for t, p, r in seen[BOB] if t.endswith("/json/status")]
            assert statuses and statuses[-1]["st"] == "online"
            # Another tenant's host user: nothing of this tenant at all (only the bridge's
            # presence, which every device and host reads).
            assert not [t for t, _, _ in seen[OUTSIDER] if t.startswith(f"{PREFIX}/h/")]
            # A connection that comes later gets the retained state at once.
            late = Client(s.host, s.port, ALICE, s.users[ALICE])
            clients[ALICE].close()
            try:
                late.subscribe(f"{h}/+/u/alice/json/#")
                late.subscribe(f"{h}/+/json/#")
                got = _json_drain(late, time.monotonic() + 2.0)
            finally:
                late.close()
            retained = {t for t, _, r in got if r}
            assert retained == {f"{user_json}/answer", f"{h}/{DEVICE}/json/presence",
                                f"{h}/{DEVICE}/json/status"}, got  # fmt: skip
        finally:
            for c in clients.values():
                c.close()


# --- a real Node-RED ---------------------------------------------------------------------------


def _node_red() -> Path:
    """Node-RED's launcher in tests/nodered. Skipped only where `node` is missing (the
    issue's one reason); where node runs, a Node-RED not installed is the set-up left
    undone, and a skip would hide it: fail, saying how to install it."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed (Node-RED needs it): apt-get install nodejs npm")
    red = NODERED / "node_modules" / "node-red" / "red.js"
    if not red.is_file():
        how = ("run `sh tools/setup.sh` (or `npm ci --prefix tests/nodered`)"
               if shutil.which("npm") is not None
               else "install npm (apt-get install npm), then run `sh tools/setup.sh`")  # fmt: skip
        pytest.fail(f"node is installed but Node-RED is not ({red} is missing): {how}",
                    pytrace=False)  # fmt: skip
    return red


def test_node_red_is_skipped_only_where_node_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where node and npm run but tests/nodered has no node_modules: a failure that says
    # how to install it, never a skip.
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(f"{__name__}.NODERED", tmp_path / "nodered")
    # (Caught as BaseException: a skip raised here must fail this test, not skip it.)
    with pytest.raises(BaseException) as ended:
        _node_red()
    assert ended.type is pytest.fail.Exception, ended.value
    assert re.search(r"sh tools/setup\.sh.*npm ci", str(ended.value)), ended.value
    # Without node: a skip, with its reason.
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(BaseException) as ended:
        _node_red()
    assert ended.type is pytest.skip.Exception, ended.value
    assert "node is not installed" in str(ended.value)
    # Where it is installed: its launcher.
    red = tmp_path / "nodered" / "node_modules" / "node-red" / "red.js"
    red.parent.mkdir(parents=True)
    red.write_text("")
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    assert _node_red() == red


def _flow(port: int, user: str, out: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The example flow (examples/dashboards/node-red-flow.json) with its broker pointed at
    the test's Mosquitto, and a flow of the test's own beside it: mqtt in -> json -> file,
    for alice's events, the device's presence and alice's answer. The credentials, as
    Node-RED keeps them with `credentialSecret: false`."""
    nodes: list[dict[str, Any]] = json.loads((DASHBOARDS / "node-red-flow.json").read_text())
    [broker] = [n for n in nodes if n["type"] == "mqtt-broker"]
    broker.update(broker="127.0.0.1", port=str(port))
    nodes.append({"id": "test-tab", "type": "tab", "label": "test", "disabled": False})
    h = f"{PREFIX}/h/{TENANT}"
    for name, topic in (("events", f"{h}/+/u/alice/json"), ("presence", f"{h}/+/json/presence"),
                        ("answer", f"{h}/+/u/alice/json/answer")):  # fmt: skip
        nodes += [
            {"id": f"in-{name}", "type": "mqtt in", "z": "test-tab", "name": name,
             "topic": topic, "qos": "1", "datatype": "utf8", "broker": broker["id"], "nl": False,
             "rap": True, "rh": 0, "inputs": 0, "wires": [[f"json-{name}"]]},
            {"id": f"json-{name}", "type": "json", "z": "test-tab", "name": "",
             "property": "payload", "action": "obj", "pretty": False,
             "wires": [[f"file-{name}"]]},
            {"id": f"file-{name}", "type": "file", "z": "test-tab", "name": "",
             "filename": str(out / f"{name}.jsonl"), "filenameType": "str",
             "appendNewline": True, "createDir": True, "overwriteFile": "false",
             "encoding": "utf8", "wires": [[]]},
        ]  # fmt: skip
    return nodes, {broker["id"]: {"user": user, "password": ""}}


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_for(what: str, pred: Any, red: subprocess.Popen[str], log: list[str]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not pred():
        if red.poll() is not None:
            raise AssertionError(f"Node-RED exited ({red.returncode}):\n" + "".join(log[-40:]))
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {TIMEOUT_S}s; Node-RED said:\n"
                                 + "".join(log[-40:]))  # fmt: skip
        time.sleep(0.1)


def test_node_red_receives_a_runs_text_and_a_device_presence_change(tmp_path: Path) -> None:
    red_js = _node_red()
    out = tmp_path / "out"
    with (
        ModelServer([Turn(text=ANSWER)]) as server,
        Stack(
            tmp_path / "stack",
            model_url=server.url,
            extra_users={NODE_RED: TENANT},
            bound_users={NODE_RED: "alice"},
            bridge_args=["--json-mirror", TENANT],
        ) as s,
    ):
        nodes, creds = _flow(s.port, NODE_RED, out)
        for c in creds.values():
            c["password"] = s.users[NODE_RED]
        user_dir = tmp_path / "nodered"
        user_dir.mkdir()
        (user_dir / "flows.json").write_text(json.dumps(nodes, indent=1))
        (user_dir / "flows_cred.json").write_text(json.dumps(creds))
        ui_port = free_port()
        # Headless: no editor, no admin API, nothing fetched from outside.
        (user_dir / "settings.js").write_text(
            "module.exports = {\n"
            f"  uiHost: '127.0.0.1', uiPort: {ui_port}, flowFile: 'flows.json',\n"
            "  credentialSecret: false, disableEditor: true, httpAdminRoot: false,\n"
            "  diagnostics: {enabled: false}, telemetry: {enabled: false},\n"
            "  externalModules: {autoInstall: false},\n"
            "  logging: {console: {level: 'info', metrics: false, audit: false}},\n"
            "};\n"
        )
        env = {**os.environ, "NODE_RED_HOME": str(user_dir)}
        red = subprocess.Popen(
            ["node", str(red_js), "--settings", str(user_dir / "settings.js"),
             "--userDir", str(user_dir)],
            cwd=user_dir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        log: list[str] = []
        pump = threading.Thread(target=lambda: log.extend(iter(red.stdout.readline, "")),  # type: ignore[union-attr]
                                daemon=True)  # fmt: skip
        pump.start()
        try:
            answers = re.escape(f"{PREFIX}/h/{TENANT}/+/u/alice/json/answer")
            subscribed = re.compile(rf"^\d+: \S+ 1 {answers}$", re.M)
            _wait_for("Node-RED subscribed", lambda: subscribed.search(s.broker_log()), red, log)
            # The retained presence (online) came at its subscribe.
            _wait_for("the retained presence", lambda: _lines(out / "presence.jsonl"), red, log)
            assert _lines(out / "presence.jsonl")[-1]["st"] == "online"

            snap = s.ask("How warm is it?")
            assert snap.status == "done" and assistant_text(snap) == ANSWER, s.describe()

            def ended() -> bool:
                return any(e["t"] == "run.done" for e in _lines(out / "events.jsonl"))

            _wait_for("the run's events", ended, red, log)
            events = _lines(out / "events.jsonl")
            assert "".join(e["d"]["text"] for e in events if e["t"] == "msg.delta") == ANSWER
            _wait_for("the answer", lambda: _lines(out / "answer.jsonl"), red, log)
            assert _lines(out / "answer.jsonl")[-1]["text"] == ANSWER
            # The example flow's own function node folded the same answer (its debug node
            # writes to Node-RED's log too).
            _wait_for("the example flow's answer", lambda: any(ANSWER in x for x in log), red, log)

            # The board is gone (killed: its will says offline) past the bridge's grace,
            # then back.
            s.kill_board()

            def now(st: str) -> bool:
                return _lines(out / "presence.jsonl")[-1]["st"] == st

            _wait_for("presence offline", lambda: now("offline"), red, log)
            s.start_board()
            _wait_for("presence online", lambda: now("online"), red, log)
            sts = [p["st"] for p in _lines(out / "presence.jsonl")]
            assert sts[-3:] == ["online", "offline", "online"], sts
            offline = _lines(out / "presence.jsonl")[-2]
            assert isinstance(offline["since"], int)
        finally:
            os.killpg(red.pid, signal.SIGTERM)
            try:
                red.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(red.pid, signal.SIGKILL)
                red.wait(10)
            pump.join(5)


# --- the example dashboards --------------------------------------------------------------------


def test_the_example_dashboards_read_the_mirrors_topics_and_keys() -> None:
    nodes = json.loads((DASHBOARDS / "node-red-flow.json").read_text())
    ins = [n for n in nodes if n["type"] == "mqtt in"]
    h = f"{PREFIX}/h/{TENANT}"
    assert {n["topic"] for n in ins} == {f"{h}/+/u/alice/json", f"{h}/+/json/presence",
                                         f"{h}/+/u/alice/json/answer"}  # fmt: skip
    ids = {n["id"] for n in nodes}
    assert all(w in ids for n in nodes for port in n.get("wires", []) for w in port)
    assert not any("credentials" in n for n in nodes)  # no password in an example
    ha = yaml.safe_load((DASHBOARDS / "home_assistant_discovery.yaml").read_text())
    by_kind = {m["topic"].split("/")[1]: m for m in ha["messages"]}
    presence, answer = by_kind["binary_sensor"]["payload"], by_kind["sensor"]["payload"]
    assert presence["state_topic"] == device_json_topic(PREFIX, TENANT, DEVICE, "presence")
    assert (presence["payload_on"], presence["payload_off"]) == ("online", "offline")
    assert "value_json.st" in presence["value_template"]
    assert answer["state_topic"] == user_json_topic(PREFIX, TENANT, DEVICE, "alice", "answer")
    assert "value_json.text" in answer["value_template"]
    assert all(m["topic"].startswith("homeassistant/") and m["topic"].endswith("/config")
               for m in ha["messages"])  # fmt: skip
