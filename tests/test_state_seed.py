"""A run's durable state sent with its request (PROTOCOL.md "req", `state`): the bridge
reads what the run would load and puts it in the `req`, so the board starts its model
call without a state.load round trip. Read for the token's user and the request's
conversation only, for an online board, within what the board can decode, and never by
waiting on another thread's write; else the req goes without and the board loads.

Only what the bridge holds in memory is read (a file to read would hold up its network
thread): a user's first request after the bridge starts goes without. A real Mosquitto,
the real bridge with its memory service on disk; paho peers play the
board and the host (tests/test_bridge.py). firmware_tests/test_memory.py has the board's
side on both runtimes, tests/test_memory_boards.py the demo thermostat end to end.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from server_bridge.memory import open_memory
from server_bridge.memory.service import Caller, MemoryService
from server_bridge.memory.store import ScopeRef
from server_bridge.models.scripted import ScriptedProvider
from tests.test_bridge import World, token
from tests.waiting import wait_for
from tools.broker import MosquittoProcess

FIELDS = [
    {"name": "usual", "vis": "public", "dur": "user", "fmt": "number"},
    {"name": "mood", "dur": "agent"},
    {"name": "visits", "dur": "user", "merge": "sum"},
    {"name": "scratch"},  # run-scoped: never leaves the board, never read
    {"name": "notes", "dur": "agent", "kind": "collection", "key": "k"},
    {"name": "persona", "dur": "agent", "core": True},
]
LIMITS = {"payload": 8192, "str": 2048, "items": 64, "depth": 8, "ring": 8}


@pytest.fixture
def world(broker: MosquittoProcess, tmp_path: Path) -> Iterator[World]:
    w = World(broker, tmp_path, ScriptedProvider(), open_memory(tmp_path / "memory", None))
    yield w
    w.close()


def board_up(
    w: World, fields: list[dict[str, Any]] = FIELDS, limits: dict[str, int] = LIMITS
) -> None:
    hello: dict[str, Any] = {"agent": "thermostat", "limits": limits}
    if fields:
        hello["fields"] = fields
    w.board.send(w.d("hello"), hello)
    w.board.send(w.d("status"), {"st": "online", "boot": "0a0b0c0d"})

    def known() -> bool:
        got = w.bridge.hello("dev1")
        return got is not None and got.get("fields") == hello.get("fields")

    wait_for(lambda: known() and w.bridge.presence("dev1"), "hello and status")


def ask(
    w: World, req: str, user: str = "alice", conv: str | None = None, **extra: Any
) -> dict[str, Any]:
    msg: dict[str, Any] = {"req": req, "input": "Set it to my usual.", "tok": token(user), **extra}
    if conv is not None:
        msg["conv"] = conv
    w.host.send(w.h("req"), msg)
    got: dict[str, Any] = w.board.get(w.d("req"))
    assert got["req"] == req
    return got


def commit(w: World, c: int, sc: str, run: str, **values: Any) -> dict[str, Any]:
    writes = [
        {"field": k, "value": v, "w": f"{run}:{n}"} for n, (k, v) in enumerate(values.items(), 1)
    ]
    w.call(c, "state.commit", {"writes": writes, "sc": sc}, run=run)
    _, final = w.answers()
    assert final["c"] == c and "ok" in final, final
    return dict(final["ok"])


def load(w: World, c: int, sc: str, fields: list[str]) -> dict[str, Any]:
    """The board's own state.load, as a run whose req came without state makes it."""
    w.call(c, "state.load", {"fields": fields, "sc": sc}, run=f"b.{c}")
    _, final = w.answers()
    assert final["c"] == c
    return dict(final)


DURABLE = ["usual", "mood", "visits"]


def test_the_req_carries_what_the_run_would_load_for_the_tokens_user(world: World) -> None:
    board_up(world)
    # Nothing of this user or agent in the bridge's memory yet: the network thread reads
    # no file, so the first req goes without, and its run loads (bringing them in).
    first = ask(world, "q1")
    assert "state" not in first
    assert load(world, 1, first["sc"], DURABLE)["ok"] == {"values": {}, "vers": {}}
    # Every durable slot field named, no value: not the run-scoped, the collection or
    # the core field, which the board never loads.
    assert ask(world, "q2")["state"] == {"fields": DURABLE, "values": {}}
    commit(world, 2, first["sc"], "b.2", usual=22, mood="sunny", visits=1)
    # The next request of the same user brings what the last run wrote, as a load would.
    assert ask(world, "q3")["state"] == {
        "fields": DURABLE,
        "values": {"usual": 22, "mood": "sunny", "visits": 1},
    }
    # Another user of the tenant: the token's user, whatever the payload says about who
    # is asking (or brings as state); once their scope is in memory, the agent's fields
    # and none of alice's.
    forged = {"fields": DURABLE, "values": {"usual": 99}}
    bob = ask(world, "q4", user="bob", usr="alice", user_id="alice", state=forged)
    assert bob["usr"] == "bob" and "state" not in bob
    load(world, 3, bob["sc"], DURABLE)
    again = ask(world, "q5", user="bob", usr="alice")
    assert again["state"]["values"] == {"mood": "sunny"}
    assert world.bridge.stats["host.req_seeded"] == 3
    assert world.bridge.stats["host.req_unseeded"] == 2
    assert world.bridge.stats["rpc.calls.state.load"] == 2
    assert world.bridge.stats["rpc.calls.state.commit"] == 1


def test_a_board_without_durable_fields_or_not_online_gets_no_state(world: World) -> None:
    world.board.send(world.d("hello"), {"agent": "thermostat", "limits": LIMITS, "fields": FIELDS})
    wait_for(lambda: world.bridge.hello("dev1"), "hello")
    sc = ask(world, "q1")["sc"]
    load(world, 1, sc, DURABLE)
    # No status yet: the board may be away, and a req waiting at the broker for it
    # would bring state read long before its run.
    assert "state" not in ask(world, "q2")
    # Online, but only run-scoped and core fields: nothing to load, nothing added.
    board_up(world, fields=[{"name": "scratch"}, FIELDS[-1]])
    assert "state" not in ask(world, "q3")
    # No fields at all (the plain thermostat); then a new hello that declares some.
    board_up(world, fields=[])
    assert "state" not in ask(world, "q4")
    board_up(world)
    assert ask(world, "q5")["state"]["fields"] == DURABLE
    assert world.bridge.stats["host.req_seeded"] == 1
    assert world.bridge.stats["host.req_unseeded"] == 4


def test_state_the_board_could_not_decode_is_left_for_it_to_load(world: World) -> None:
    # The board reads strings of at most 256 bytes: a longer stored value would make
    # the whole req undecodable there, so the req goes without it.
    small = {**LIMITS, "str": 256}
    board_up(world, limits=small)
    sc = ask(world, "q1")["sc"]
    commit(world, 1, sc, "b.1", mood="x" * 300)
    second = ask(world, "q2")
    assert "state" not in second
    assert second["input"] == "Set it to my usual." and second["usr"] == "alice"
    # The board's own load is then answered as before: the value, within the payload.
    assert load(world, 2, second["sc"], DURABLE)["ok"]["values"] == {"mood": "x" * 300}
    # A value the board can read goes in the req again.
    commit(world, 3, sc, "b.3", mood="calm")
    assert ask(world, "q3")["state"]["values"] == {"mood": "calm"}
    assert world.bridge.stats["host.req_unseeded"] == 2


def test_state_at_the_boards_limits_goes_and_past_them_it_does_not(world: World) -> None:
    # Sizes at the limits a board announces: a string of exactly its `str` goes, one
    # byte more does not; state that would take the whole req past its `payload` stays
    # behind while the request itself still goes (it is not refused too_large).
    notes = [{"name": f"n{k}", "dur": "agent"} for k in range(4)]
    limits = {**LIMITS, "payload": 1024, "str": 256}
    board_up(world, fields=notes, limits=limits)
    sc = ask(world, "q1")["sc"]
    names = [f["name"] for f in notes]
    load(world, 1, sc, names)
    commit(world, 2, sc, "b.2", n0="m" * 256)
    assert ask(world, "q2")["state"]["values"] == {"n0": "m" * 256}
    commit(world, 3, sc, "b.3", n0="m" * 257)
    assert "state" not in ask(world, "q3")
    commit(world, 4, sc, "b.4", n0="a" * 250, n1="b" * 250, n2="c" * 250, n3="d" * 250)
    over = ask(world, "q4")
    assert "state" not in over and over["input"] == "Set it to my usual."
    commit(world, 5, sc, "b.5", n0="a" * 100, n1="b" * 100, n2="c" * 100, n3="d" * 100)
    fits = ask(world, "q5")
    assert fits["state"]["values"] == {f"n{k}": ch * 100 for k, ch in enumerate("abcd")}
    assert world.bridge.stats["refused.too_large"] == 0
    assert world.bridge.stats["host.req_seeded"] == 2
    assert world.bridge.stats["host.req_unseeded"] == 3


def test_a_refused_read_sends_no_state_and_the_boards_load_says_why(world: World) -> None:
    # A tenant field the agent has no grant for: the bridge's read is refused, so the
    # req goes without, and the board's own state.load gets the named refusal.
    board_up(world, fields=[FIELDS[0], {"name": "budget", "dur": "tenant"}])
    sc = ask(world, "q1")["sc"]
    load(world, 1, sc, ["usual"])  # alice's scope in memory: only the refusal is left
    assert "state" not in ask(world, "q2")
    assert load(world, 2, sc, ["usual", "budget"])["err"]["kind"] == "forbidden"


def test_a_read_that_would_wait_is_declined(tmp_path: Path) -> None:
    # The bridge reads on its network thread: neither a file to read nor a write holding
    # the scope (its fsync) may stall it, so the read is declined and the board loads;
    # state.load, on a worker, waits.
    memory: MemoryService = open_memory(tmp_path / "memory", None)
    caller = Caller(tenant="acme", device="dev1", agent="thermostat", fields=[FIELDS[1]])
    assert memory.state_seed(caller) is None  # not in memory yet
    assert memory.state_load(caller, {"fields": ["mood"]}) == {"values": {}, "vers": {}}
    assert memory.state_seed(caller) == {"fields": ["mood"], "values": {}}
    ref = ScopeRef("acme", "agent", "thermostat")
    held, release = threading.Event(), threading.Event()

    def writer() -> None:
        with memory.store.scope(ref):
            held.set()
            release.wait(10)

    t = threading.Thread(target=writer)
    t.start()
    try:
        assert held.wait(10)
        assert memory.state_seed(caller) is None
        loaded: list[dict[str, Any]] = []
        reader = threading.Thread(
            target=lambda: loaded.append(memory.state_load(caller, {"fields": ["mood"]}))
        )
        reader.start()
        reader.join(0.2)
        assert reader.is_alive() and loaded == []  # waiting for the writer
    finally:
        release.set()
        t.join(10)
    reader.join(10)
    assert loaded == [{"values": {}, "vers": {}}]
    assert memory.state_seed(caller) == {"fields": ["mood"], "values": {}}
