"""The memory methods through a real Mosquitto and the real bridge: a board peer calls
state.*, mem.* and core.* on P/d/D/rpc with the scope ticket the bridge signed into its
request, and every scope comes from the registry, the hello and that ticket alone."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from server_bridge import tokens
from server_bridge.memory import MemoryService, TinyMemoryStore
from server_bridge.memory.recall import RecallIndex
from server_bridge.models.scripted import ScriptedProvider
from tests import test_memory_store
from tests.test_bridge import SECRET, Peer, World, token, wait_for
from tests.test_memory_store import Stores
from tools.broker import MosquittoProcess

FIELDS = [
    {"name": "usual_celsius", "vis": "public", "dur": "user", "fmt": "number"},
    {"name": "visits", "dur": "user", "merge": "sum"},
    {"name": "room_notes", "vis": "public", "dur": "subject", "kind": "collection"},
    {"name": "profile", "dur": "user", "core": True, "max": 200},
]
HELLO = {
    "agent": "thermostat",
    "ver": "0.1.0",
    "fw": "test",
    "boot": "b0000001",
    "fields": FIELDS,
    "tools": [],
    "limits": {"payload": 4096, "str": 4096, "window": 4, "chunk": 256},
}
_ids = itertools.count(1)


# The store fixtures: `mw_both` is the world over each backend (`[tiny]`, `[pg]`).
stores = test_memory_store.stores
memory_db = test_memory_store.memory_db


class MemoryWorld(World):
    def __init__(self, broker: MosquittoProcess, tmp: Path, store: Any = None) -> None:
        self.broker = broker
        self.service = MemoryService(
            store if store is not None else TinyMemoryStore(tmp / "memory"),
            index=RecallIndex(embedder=None),
        )
        super().__init__(broker, tmp, ScriptedProvider(), memory=self.service)
        self.board.send(self.d("hello"), HELLO)
        wait_for(lambda: self.bridge.hello("dev1") is not None, "dev1's hello")

    def ticket(self, user: str, conv: str = "c1") -> str:
        """The scope ticket of a request `user` sends to dev1, as the board receives it."""
        req = f"q{next(_ids)}"
        self.host.send(self.h("req"), {"req": req, "conv": conv, "input": "x", "tok": token(user)})
        got = self.board.get(self.d("req"))
        assert got["req"] == req
        return str(got["sc"])

    def rpc(self, method: str, args: dict[str, Any], device: str = "dev1") -> dict[str, Any]:
        """One call and its final answer (these methods stream no chunks)."""
        c = next(_ids)
        self.board.send(self.d("rpc", device), {"c": c, "m": method, "a": args, "r": "b0000001.1"})
        chunks, final = self.answers(device)
        assert chunks == [] and final["c"] == c
        return dict(final)


@pytest.fixture
def mw(broker: MosquittoProcess, tmp_path: Path) -> Iterator[MemoryWorld]:
    w = MemoryWorld(broker, tmp_path)
    yield w
    w.close()


@pytest.fixture
def mw_both(broker: MosquittoProcess, tmp_path: Path, stores: Stores) -> Iterator[MemoryWorld]:
    """The world with its memory on each backend: the bridge's calls reach either alike."""
    w = MemoryWorld(broker, tmp_path, stores())
    yield w
    w.close()


def ok(answer: dict[str, Any]) -> dict[str, Any]:
    assert "ok" in answer, answer
    return dict(answer["ok"])


def kind(answer: dict[str, Any]) -> str:
    assert "err" in answer, answer
    return str(answer["err"]["kind"])


def test_a_users_durable_field_is_theirs_across_requests(mw_both: MemoryWorld) -> None:
    mw = mw_both
    ann = mw.ticket("ann")
    got = ok(mw.rpc("state.commit", {"sc": ann, "writes": [
        {"field": "usual_celsius", "value": 22, "w": "r1:1"},
        {"field": "visits", "value": 1, "w": "r1:2"},
    ]}))  # fmt: skip
    assert [r.get("err") for r in got["results"]] == [None, None]
    # A later request of ann's (another conversation) loads it; bob's does not.
    later = mw.ticket("ann", conv="c2")
    loaded = ok(mw.rpc("state.load", {"sc": later, "fields": ["usual_celsius", "visits"]}))
    assert loaded["values"] == {"usual_celsius": 22, "visits": 1}
    bob = mw.ticket("bob")
    assert ok(mw.rpc("state.load", {"sc": bob, "fields": ["usual_celsius"]}))["values"] == {}


def test_a_retried_commit_applies_once(mw_both: MemoryWorld) -> None:
    mw = mw_both
    ann = mw.ticket("ann")
    write = {"sc": ann, "writes": [{"field": "visits", "value": 1, "w": "r7:1"}]}
    first = ok(mw.rpc("state.commit", write))
    again = ok(mw.rpc("state.commit", write))
    assert again == first
    assert ok(mw.rpc("state.load", {"sc": ann, "fields": ["visits"]}))["values"] == {"visits": 1}
    other = {"sc": ann, "writes": [{"field": "visits", "value": 5, "w": "r7:1"}]}
    assert ok(mw.rpc("state.commit", other))["results"][0]["err"]["kind"] == "w_reused"


def test_forged_identity_in_arguments_changes_nothing(mw: MemoryWorld) -> None:
    ann = mw.ticket("ann")
    ok(mw.rpc("state.commit", {"sc": ann, "writes": [
        {"field": "usual_celsius", "value": 19, "w": "r2:1"}]}))  # fmt: skip
    bob = mw.ticket("bob")
    forged = {"sc": bob, "fields": ["usual_celsius"], "user": "ann", "usr": "ann",
              "tenant": "globex", "device": "dev2"}  # fmt: skip
    assert ok(mw.rpc("state.load", forged))["values"] == {}


def test_a_ticket_proves_nothing_for_another_device_or_when_forged(mw: MemoryWorld) -> None:
    ann = mw.ticket("ann")
    # dev2 (globex's) presenting dev1's ticket: bound to dev1.
    dev2 = Peer(mw.broker, [mw.d("rpc/res", "dev2")])
    try:
        dev2.send(mw.d("hello", "dev2"), HELLO)
        wait_for(lambda: mw.bridge.hello("dev2") is not None, "dev2's hello")
        dev2.send(mw.d("rpc", "dev2"), {"c": 1, "m": "state.load", "r": "b0000001.1",
                                        "a": {"sc": ann, "fields": ["usual_celsius"]}})  # fmt: skip
        assert kind(dev2.get(mw.d("rpc/res", "dev2"))) == "bad_token"
    finally:
        dev2.close()
    forged = tokens.sign_scope(b"x" * 32, "acme", "dev1", "ann", "c1")
    assert kind(mw.rpc("state.load", {"sc": forged, "fields": ["usual_celsius"]})) == "bad_token"
    # No ticket: the user's fields are out of reach, the device's own are not.
    assert kind(mw.rpc("state.load", {"fields": ["usual_celsius"]})) == "no_scope"
    got = ok(
        mw.rpc("mem.remember", {"field": "room_notes", "value": "radiator is loud", "w": "n1"})
    )
    assert got["key"]


def test_rows_recall_and_forget_through_the_bridge(mw_both: MemoryWorld) -> None:
    mw = mw_both
    sc = mw.ticket("ann")
    for n, text in enumerate(["the radiator is loud at night", "window faces north"]):
        ok(mw.rpc("mem.remember", {"sc": sc, "field": "room_notes", "key": f"k{n}",
                                   "value": text, "w": f"m{n}"}))  # fmt: skip
    hits = ok(mw.rpc("mem.recall", {"sc": sc, "query": "noisy radiator", "k": 2}))["hits"]
    assert hits[0]["key"] == "k0" and hits[0]["value"] == "the radiator is loud at night"
    assert hits[0]["prov"]["dev"] == "dev1"
    ok(mw.rpc("mem.forget", {"sc": sc, "field": "room_notes", "key": "k0", "w": "f0"}))
    # The same remember again (a replayed write): answered as before, nothing comes back.
    ok(mw.rpc("mem.remember", {"sc": sc, "field": "room_notes", "key": "k0",
                               "value": "the radiator is loud at night", "w": "m0"}))  # fmt: skip
    keys = [h["key"] for h in ok(mw.rpc("mem.recall", {"sc": sc, "query": "radiator"}))["hits"]]
    assert "k0" not in keys
    assert kind(mw.rpc("mem.peek", {"sc": sc, "field": "room_notes", "key": "k0"})) == "not_found"


def test_bad_calls_are_refused_by_name_and_change_nothing(mw: MemoryWorld) -> None:
    sc = mw.ticket("ann")
    before = ok(mw.rpc("mem.list", {"sc": sc, "field": "room_notes"}))
    cases = [
        ("mem.nope", {"sc": sc}, "unknown_method"),
        ("mem.remember", {"sc": sc, "field": "ghost", "value": 1, "w": "g"}, "unknown_field"),
        ("mem.remember", {"sc": sc, "field": "room_notes", "w": "g2"}, "bad_envelope"),
        ("mem.list", {"sc": sc, "field": "room_notes", "limit": "ten"}, "bad_envelope"),
        (
            "mem.cas",
            {"sc": sc, "field": "room_notes", "key": "none", "value": 1, "if_ver": 1, "w": "g3"},
            "not_found",
        ),  # fmt: skip
    ]
    for method, args, want in cases:
        assert kind(mw.rpc(method, args)) == want, (method, args)
    # A value over its field's max (4096 bytes by default) is refused, the rest applied.
    got = ok(mw.rpc("state.commit", {"sc": sc, "writes": [
        {"field": "usual_celsius", "value": "x" * 5000, "w": "g4"},
        {"field": "visits", "value": 1, "w": "g5"},
    ]}))  # fmt: skip
    assert got["results"][0]["err"]["kind"] == "over_limit" and "err" not in got["results"][1]
    assert ok(mw.rpc("state.load", {"sc": sc, "fields": ["usual_celsius"]}))["values"] == {}
    assert ok(mw.rpc("mem.list", {"sc": sc, "field": "room_notes"})) == before


def test_an_answer_over_the_boards_payload_is_refused_too_large(mw: MemoryWorld) -> None:
    sc = mw.ticket("ann")
    for n in range(12):
        ok(mw.rpc("mem.remember", {"sc": sc, "field": "room_notes", "key": f"big{n}",
                                   "value": "y" * 400, "w": f"b{n}"}))  # fmt: skip
    got = mw.rpc("mem.list", {"sc": sc, "field": "room_notes", "limit": 12})
    assert kind(got) == "too_large" and "fewer rows" in got["err"]["msg"]
    assert len(ok(mw.rpc("mem.list", {"sc": sc, "field": "room_notes", "limit": 3}))["rows"]) == 3


def test_core_backup_and_restore(mw: MemoryWorld) -> None:
    sc = mw.ticket("ann")
    assert ok(mw.rpc("core.load", {"sc": sc, "scope": "user"})) == {"ver": 0}
    doc = "Prefers 22 C. Wakes at 7."
    assert ok(mw.rpc("core.sync", {"sc": sc, "scope": "user", "ver": 1, "doc": doc, "w": "s1"}))
    old = mw.rpc("core.sync", {"sc": sc, "scope": "user", "ver": 1, "doc": "older",
                               "w": "s2"})  # fmt: skip
    assert kind(old) == "conflict" and old["err"]["doc"] == doc
    assert ok(mw.rpc("core.load", {"sc": sc, "scope": "user"}))["doc"] == doc


def test_the_tickets_user_is_the_session_tokens(mw: MemoryWorld) -> None:
    sc = mw.ticket("ann")
    scope = tokens.verify_scope(SECRET, sc, "acme", "dev1")
    assert scope.user == "ann" and scope.conv == "c1"
