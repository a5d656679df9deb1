"""Who sees what (PROTOCOL.md "Who sees what"; issue 25, item 2).

A run's events go to its user's host topic, P/h/T/D/u/<usr>/evt; a host user bound to
bob reads bob's and the device's topics only, a watcher every user's; the bridge acts on
a host's replay, cancel, tool answer or approval only for the run's own user or a
watcher's token, and refuses anyone else `forbidden` on their own `_b`.

End to end with real parts (tests/stack.py): Mosquitto with the ACL the tooling writes
(both forms), the bridge process, the board on the MicroPython unix port, the test model
server answering slowly; then the rules at the intake and the tokens alone.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import queue
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

from server_bridge import tokens
from server_bridge.access import AwaitingOwner, RequestOwners, check_run, may_act
from server_bridge.brokerconf import hash_password
from server_bridge.host.client import HostClient
from server_bridge.registry import BRIDGE, HOST, DeviceRecord, Registry, RegistryError
from server_bridge.tokens import Session, TokenError
from server_bridge.topics import BadTopic, host_event_topic, parse
from tests.model_server import ModelServer, Turn
from tests.stack import PREFIX, TENANT, Stack, assistant_text
from tests.test_bridge import ev, intake
from tests.test_brokerconf import Client

TIMEOUT_S = 60.0
ALICE_ASKS = "Tell me the long story of the kiln."
# About 60 s at the model's pace: still streaming while bob tries everything.
ALICE_HEARS = Turn(text="kiln " * 300, chunk_chars=5, delay_s=0.2)
BOB_HEARS = "It is a cosy 21 degrees."
# Two connections bound to end user bob (each connection a user of its own), a watcher.
BOB, BOB_2, OPS = "host-bob", "host-bob-2", "host-ops"


def _drain(c: Client, until: float) -> list[tuple[str, Any]]:
    """What `c` received until time `until` (monotonic), decoded."""
    got = []
    while (left := until - time.monotonic()) > 0:
        try:
            msg = c.messages.get(timeout=left)
        except queue.Empty:
            break
        got.append((msg.topic, msgpack.unpackb(msg.payload, raw=False)))
    return got


def _until(c: Client, pred: Any, seen: list[tuple[str, Any]]) -> None:
    """Read `c` into `seen` until an envelope `pred` accepts arrives (bounded)."""
    deadline = time.monotonic() + TIMEOUT_S
    while not any(pred(t, e) for t, e in seen):
        try:
            msg = c.messages.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"what was waited for never came; came: {seen}") from None
        seen.append((msg.topic, msgpack.unpackb(msg.payload, raw=False)))


@pytest.mark.parametrize("access", ["acl_file", "dynsec"])
def test_a_host_bound_to_bob_cannot_read_replay_or_act_on_alices_run(
    tmp_path: Path, access: str
) -> None:
    with (
        ModelServer([ALICE_HEARS]) as server,
        Stack(
            tmp_path,
            model_url=server.url,
            extra_users={BOB: TENANT, BOB_2: TENANT, OPS: TENANT},
            bound_users={BOB: "bob", BOB_2: "bob"},
            access=access,
        ) as s,
    ):
        assert s.client is not None
        with Registry(s.registry_path) as registry:
            secret = bytes.fromhex(registry.tenant_secret(TENANT) or "")
        bob_tok = tokens.sign(secret, TENANT, "bob")
        ops_tok = tokens.sign(secret, TENANT, "ops", watch=True)
        h = f"{PREFIX}/h/{TENANT}"
        ctl = f"{h}/{s.device}/ctl"

        # Bob's connection subscribes to everything it might: under the acl_file the
        # broker grants each and delivers only what bob may read; the plugin refuses
        # the wider filters in SUBACK.
        bob = Client(s.host, s.port, BOB, s.users[BOB])
        ops = Client(s.host, s.port, OPS, s.users[OPS])
        try:
            wide = [f"{h}/#", f"{h}/+/u/+/evt", f"{h}/+/u/alice/evt", f"{h}/{s.device}/req"]
            refused = [bob.subscribe(t)[0].is_failure for t in wide]
            assert refused == [access == "dynsec"] * len(wide)
            for own in (f"{h}/+/evt", f"{h}/+/u/bob/evt"):
                assert not bob.subscribe(own)[0].is_failure
            assert not ops.subscribe(f"{h}/+/u/+/evt")[0].is_failure

            # Alice's run (the stack's host, a watcher, asks with alice's token), mid-answer.
            req = s.request(ALICE_ASKS)
            s.client.wait_for(req, lambda x: "kiln kiln" in assistant_text(x), TIMEOUT_S)
            found = s.client.find_run(req)
            assert found is not None and found.run is not None
            run = found.run

            # Bob, with his own token, tries everything on alice's run.
            tries = [
                {"op": "replay", "r": run, "after": 0},
                {"op": "cancel", "r": run, "reason": "bob ended it"},
                {"op": "cancel", "req": req, "reason": "bob ended it"},
                {"op": "approve", "r": run, "call": "c1", "ok": True},
                {"op": "tool", "r": run, "call": "c1", "output": "x", "failed": False},
            ]
            for body in tries:
                bob.publish(ctl, msgpack.packb({**body, "tok": bob_tok}))
            seen: list[tuple[str, Any]] = []

            def forbidden(t: str, e: Any) -> bool:
                return e["r"] == "_b" and e["d"].get("kind") == "forbidden"

            deadline = time.monotonic() + TIMEOUT_S
            while sum(forbidden(t, e) for t, e in seen) < len(tries):
                assert time.monotonic() < deadline, seen
                _until(bob, forbidden, seen)
                seen += _drain(bob, time.monotonic() + 0.2)
            # Each refusal on bob's own topic, none naming alice's run or request.
            told = [(t, e["d"]) for t, e in seen if forbidden(t, e)]
            assert {t for t, _ in told} == {f"{h}/{s.device}/u/bob/evt"}
            assert all("only its own user or a watcher" in d["msg"] for _, d in told), told

            # Nothing was acted on: alice's run streams on, and the watcher sees it.
            time.sleep(1.0)
            snap = s.client.find_run(req)
            assert snap is not None and not snap.terminal, s.describe()
            assert any(e["r"] == run for t, e in _drain(ops, time.monotonic() + 1.0))

            # The watcher may replay it (the answer comes on alice's topic) and cancel it.
            ops.publish(ctl, msgpack.packb({"op": "replay", "r": run, "after": 0, "tok": ops_tok}))
            again: list[tuple[str, Any]] = []
            _until(ops, lambda t, e: e["r"] == run and e["i"] == 1, again)
            assert {t for t, e in again if e["r"] == run} == {f"{h}/{s.device}/u/alice/evt"}
            reason = "ops ended it"
            cancel = {"op": "cancel", "r": run, "reason": reason, "tok": ops_tok}
            ops.publish(ctl, msgpack.packb(cancel))
            ended = s.wait_run(req, TIMEOUT_S)
            assert ended.status == "cancelled", s.describe()
            # The watcher's cancel reached the board; bob's, sent first, never did.
            _until(ops, lambda t, e: e["r"] == run and e["t"] == "run.cancelled", again)
            [by] = [e["d"]["reason"] for t, e in again if e["t"] == "run.cancelled"]
            assert by == reason

            # Bob's own request, through a HostClient holding bob's token: it runs, and it
            # sees bob's run alone (under the plugin too: it subscribes to bob's topic).
            server.override_next(Turn(text=BOB_HEARS))
            with HostClient(
                s.host, s.port, TENANT, BOB_2, s.users[BOB_2], PREFIX, token=bob_tok
            ) as mine:
                mine.connect(timeout=TIMEOUT_S)
                bobs = mine.request(s.device, bob_tok, "How warm is it?")
                done = mine.wait_run(bobs, TIMEOUT_S)
                assert done.status == "done" and assistant_text(done) == BOB_HEARS
                assert [r.req for r in mine.runs(s.device) if r.run not in ("_", "_b")] == [bobs]
            # Bob's raw connection got bob's run to its end, the device topic's traffic,
            # and nothing at all of alice's run, neither live nor replayed.
            _until(bob, lambda t, e: e["t"] == "run.done", seen)
            seen += _drain(bob, time.monotonic() + 0.5)
            assert not [x for x in seen if x[1]["r"] == run or "/u/alice/" in x[0]], seen
            assert not [x for x in seen if x[1]["t"] == "run.started" and x[1]["d"]["req"] == req]
            assert len([e for t, e in seen if e["t"] == "run.done"]) == 1
        finally:
            bob.close()
            ops.close()


# --- the rules alone ----------------------------------------------------------------------

DEV = DeviceRecord("dev1", "acme", "thermostat")


class _Topics:
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def publish(self, topic: str, payload: bytes) -> None:
        self.sent.append((topic, msgpack.unpackb(payload, raw=False)))

    def of(self, run: str) -> list[tuple[str, int]]:
        return [(t, e["i"]) for t, e in self.sent if t.endswith("/evt") and e["r"] == run]


def _intake(sink: _Topics) -> Any:
    class _Wrap:
        now = 0.0

        def publish(self, topic: str, payload: bytes) -> None:
            sink.publish(topic, payload)

    return intake(_Wrap())  # type: ignore[arg-type]


def test_each_run_goes_to_its_users_topic_and_an_unknown_users_to_the_watchers() -> None:
    sink = _Topics()
    it = _intake(sink)
    it.accept(DEV, [ev(1, "run.started", run="b.1", req="q1", usr="alice"), ev(2, run="b.1")])
    it.accept(DEV, [ev(1, "run.started", run="b.2", req="q2", usr="bob.b@example.com")])
    # No run.started (the bridge met the run mid-way), or one naming no usable user.
    it.accept(DEV, [ev(1, run="b.3")])
    it.accept(DEV, [ev(1, "run.started", run="b.4", req="q4", usr="a/+/#")])
    it.accept(DEV, [ev(1, "run.started", run="b.5", req="q5")])
    it.accept(DEV, [ev(1, "error", run="_", kind="busy", msg="full", req="q6")])
    assert sink.of("b.1") == [("p/h/acme/dev1/u/alice/evt", 1), ("p/h/acme/dev1/u/alice/evt", 2)]
    assert sink.of("b.2") == [("p/h/acme/dev1/u/bob.b@example.com/evt", 1)]
    for unowned in ("b.3", "b.4", "b.5"):
        assert sink.of(unowned) == [("p/h/acme/dev1/u/_/evt", 1)]
    assert sink.of("_") == [("p/h/acme/dev1/evt", 1)]
    assert (it.owner("dev1", "b.1"), it.owner("dev1", "b.3"), it.owner("dev1", "zz")) == (
        "alice", None, None
    )  # fmt: skip
    window = it.window("dev1", "b.1")
    assert window is not None and window.usr == "alice"


def test_a_run_met_mid_way_learns_its_user_from_the_replayed_run_started() -> None:
    # A restarted bridge sees a run from id 3: it holds those, asks the board, and the
    # ring's run.started (the board keeps the last 16 events) says whose run it is before
    # anything of it goes out. Had the board lost it, the run would be the watchers'.
    sink = _Topics()
    it = _intake(sink)
    it.accept(DEV, [ev(3, run="b.1"), ev(4, run="b.1")])
    assert sink.of("b.1") == []
    it.accept(DEV, [ev(1, "run.started", run="b.1", req="q1", usr="alice"), ev(2, run="b.1")])
    assert sink.of("b.1") == [("p/h/acme/dev1/u/alice/evt", i) for i in (1, 2, 3, 4)]
    lost = ev(3, "error", run="b.2", kind="gap", msg="lost")
    lost["d"].update({"from": 1, "to": 2})
    it.accept(DEV, [lost, ev(4, run="b.2")])
    assert sink.of("b.2") == [("p/h/acme/dev1/u/_/evt", 3), ("p/h/acme/dev1/u/_/evt", 4)]


def test_a_run_may_be_acted_on_by_its_own_user_or_a_watcher_only() -> None:
    alice, bob = Session("acme", "alice", 0), Session("acme", "bob", 0)
    ops = Session("acme", "ops", 0, watch=True)
    assert may_act(alice, "alice") and not may_act(bob, "alice")
    assert may_act(ops, "alice") and may_act(ops, None)
    assert not may_act(alice, None)  # not knowing whose it is lets no one in
    with pytest.raises(ValueError) as e:
        check_run(bob, "alice", "run b.1")
    assert getattr(e.value, "kind", None) == "forbidden"
    owners = RequestOwners(max_entries=2)
    owners.note("dev1", "q1", "alice")
    owners.note("dev1", "q1", "bob")  # the same req id again: the first sender keeps it
    assert owners.owner("dev1", "q1") == "alice"
    owners.note("dev1", "q2", "bob")
    owners.note("dev1", "q3", "bob")
    assert owners.owner("dev1", "q1") is None  # bounded: the oldest forgotten


def test_tokens_name_only_users_a_topic_level_can_hold_and_say_a_watcher() -> None:
    secret = bytes(range(32))
    for bad in ("a/b", "+", "#", "_x", "-x", "a b", "b" * 65, ""):
        with pytest.raises(ValueError):
            tokens.sign(secret, "acme", bad)
    watcher = tokens.verify(secret, tokens.sign(secret, "acme", "ops", watch=True), "acme")
    assert watcher.watch and watcher.user == "ops"
    assert not tokens.verify(secret, tokens.sign(secret, "acme", "Bob.B@x-y_z"), "acme").watch
    # Signed with the tenant's secret but naming a user no topic can hold, or a role this
    # bridge does not know: refused, never read as a plain user's.
    def forged(claims: dict[str, Any]) -> str:
        body = msgpack.packb(claims)
        mac = hmac.new(secret, body, hashlib.sha256).digest()
        enc = [base64.urlsafe_b64encode(x).rstrip(b"=").decode() for x in (body, mac)]
        return ".".join(enc)

    exp = int(time.time()) + 60
    for claims in (
        {"ten": "acme", "usr": "a/#", "exp": exp},
        {"ten": "acme", "usr": "bob", "exp": exp, "role": "admin"},
    ):
        with pytest.raises(TokenError):
            tokens.verify(secret, forged(claims), "acme")
    assert tokens.peek(tokens.sign(secret, "acme", "ops", watch=True)) is not None


def test_user_topics_are_built_and_parsed_only_for_valid_user_levels() -> None:
    assert host_event_topic("p", "acme", "dev1", "bob") == "p/h/acme/dev1/u/bob/evt"
    assert host_event_topic("p", "acme", "dev1", None) == "p/h/acme/dev1/evt"
    assert parse("p", "p/h/acme/dev1/u/bob/evt").user == "bob"
    assert parse("p", "p/h/acme/dev1/u/_/evt").user == "_"
    for bad in ("p/h/acme/dev1/u/+/evt", "p/h/acme/dev1/u/bob/req", "p/h/acme/dev1/x/bob/evt"):
        with pytest.raises(BadTopic):
            parse("p", bad)
    with pytest.raises(BadTopic):
        host_event_topic("p", "acme", "dev1", "a/b")


def test_the_registry_keeps_whose_runs_each_host_user_reads(tmp_path: Path) -> None:
    entry = hash_password("pw", salt=b"\x01" * 12)
    with Registry(tmp_path / "registry.json") as registry:
        registry.add_tenant("acme", host_password_hash=entry)
        registry.add_user("host-bob", HOST, "acme", entry, usr="bob")
        for bad in ("a/b", "+", "_x"):
            with pytest.raises(ValueError):
                registry.add_user("host-x", HOST, "acme", entry, usr=bad)
        with pytest.raises(RegistryError):
            registry.add_user("bridge", BRIDGE, None, entry, usr="bob")
        # A new password keeps the binding.
        registry.set_password_hash("host-bob", hash_password("pw2", salt=b"\x02" * 12))
    with Registry(tmp_path / "registry.json") as again:
        bob, watcher = again.user("host-bob"), again.user("host-acme")
        assert bob is not None and watcher is not None
        assert (bob.usr, watcher.usr) == ("bob", None)  # `tenant add`'s host user watches


def test_acts_on_a_run_of_no_known_user_wait_for_it_and_no_longer() -> None:
    # After a bridge restart a paused run is unknown until its board replays it: an act
    # on it waits (bounded in runs and in time), then goes on when the run's user is
    # known, or is refused once the wait is over.
    held: AwaitingOwner[str] = AwaitingOwner(max_runs=2, wait_s=10.0)
    assert held.hold("dev1", "r1", "approve", now=0.0) is True  # the first: ask the board
    assert held.hold("dev1", "r1", "answer", now=1.0) is False  # asked already
    assert held.hold("dev1", "r2", "cancel", now=2.0) is True
    assert held.hold("dev1", "r3", "cancel", now=2.0) is None  # full: refuse at once
    known = {("dev1", "r1")}
    ready, expired = held.settle(lambda d, r: (d, r) in known, now=5.0)
    assert (ready, expired) == (["approve", "answer"], [])
    ready, expired = held.settle(lambda d, r: False, now=11.9)
    assert (ready, expired) == ([], [])
    ready, expired = held.settle(lambda d, r: False, now=12.0)
    assert (ready, expired) == ([], ["cancel"])
    assert held.hold("dev1", "r3", "cancel", now=12.0) is True  # room again
