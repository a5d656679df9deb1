"""The memory methods (server_bridge/memory/service.py) over a real store: TinyDB files in
tmp_path (`[tiny]`) and a PostgreSQL database (`[pg]`), through test_memory_store's
`stores`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from server_bridge.memory import Caller, MemoryFault, MemoryService, TinyMemoryStore
from server_bridge.memory.grants import ALL_FIELDS, NO_GRANTS, READ, WRITE, Grants
from server_bridge.memory.recall import RecallIndex
from server_bridge.memory.service import FieldDecl, parse_fields
from tests import test_memory_store
from tests.test_memory_store import Stores

# The store fixtures, each test of both backends (`[tiny]`, `[pg]`).
stores = test_memory_store.stores
memory_db = test_memory_store.memory_db

FIELDS: list[dict[str, Any]] = [
    {"name": "visits", "dur": "agent", "merge": "sum"},
    {"name": "seen", "dur": "agent", "merge": "append", "max": 1 << 16},
    {"name": "tags", "dur": "user", "merge": "union"},
    {"name": "prefs", "dur": "user", "merge": "deep"},
    {"name": "mood", "dur": "session"},
    {"name": "note", "dur": "subject", "max": 64},
    {"name": "status", "dur": "agent"},
    {"name": "notes", "dur": "user", "kind": "collection", "key": "id", "max": 5},
    {"name": "facts", "dur": "agent", "kind": "collection", "merge": "deep"},
    {"name": "temp", "dur": "agent", "kind": "collection", "ttl": 60},
    {"name": "hint", "dur": "agent", "ttl": 60},
    {"name": "shared", "dur": "tenant", "kind": "collection", "vis": "public"},
    {"name": "secret", "dur": "tenant", "vis": "private"},
    {"name": "persona", "dur": "agent", "core": True, "max": 20},
    {"name": "profile", "dur": "user", "core": True, "max": 100},
    {"name": "scratch"},
]


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def caller(**kw: Any) -> Caller:
    base: dict[str, Any] = dict(
        tenant="acme",
        device="dev1",
        agent="kiosk",
        user="ann",
        conv="c1",
        run="run1",
        fields=FIELDS,
        grants=Grants({ALL_FIELDS: WRITE}),
    )
    base.update(kw)
    return Caller(**base)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def svc(stores: Stores, clock: Clock) -> MemoryService:
    return MemoryService(stores(clock), clock=clock)


def fault(svc: MemoryService, who: Caller, method: str, args: dict[str, Any]) -> MemoryFault:
    with pytest.raises(MemoryFault) as e:
        svc.handle(who, method, args)
    return e.value


def commit(svc: MemoryService, who: Caller, field: str, value: Any, w: str) -> dict[str, Any]:
    return svc.handle(who, "state.commit", {"writes": [{"field": field, "value": value, "w": w}]})[
        "results"
    ][0]


def load(svc: MemoryService, who: Caller, *names: str) -> dict[str, Any]:
    return svc.handle(who, "state.load", {"fields": list(names)})


def test_field_declarations_parse_with_defaults_and_skip_bad_ones() -> None:
    decls, skipped = parse_fields(
        [
            {"name": "a"},
            {"name": "Bad"},
            {"name": "b", "merge": "multiply"},
            {"name": "c", "core": True, "dur": "session"},
            {"name": "a", "dur": "user"},
            "nope",
            {"name": "d", "max": True},
            {"name": "e", "dur": "user", "kind": "collection", "ttl": 5, "extra": 1},
        ]
    )
    assert decls["a"] == FieldDecl("a")
    assert decls["a"].vis == "private" and decls["a"].dur == "run" and decls["a"].max == 4096
    assert decls["e"].ttl == 5 and decls["e"].kind == "collection"
    assert set(decls) == {"a", "e"} and skipped == 6
    assert caller(fields=[{"name": "x"}, 3]).skipped_fields == 1


def test_slots_merge_by_their_policy_and_load_with_versions(svc: MemoryService) -> None:
    me = caller()
    assert commit(svc, me, "visits", 2, "r:1") == {"field": "visits", "w": "r:1", "ver": 1}
    assert commit(svc, me, "visits", 3, "r:2")["ver"] == 2
    commit(svc, me, "tags", ["a", "b"], "r:3")
    commit(svc, me, "tags", ["b", "c"], "r:4")
    commit(svc, me, "prefs", {"lang": "en", "tz": "utc"}, "r:5")
    commit(svc, me, "prefs", {"tz": None, "units": "si"}, "r:6")
    got = load(svc, me, "visits", "tags", "prefs", "mood")
    assert got["values"] == {
        "visits": 5,
        "tags": ["a", "b", "c"],
        "prefs": {"lang": "en", "units": "si"},
    }
    assert got["vers"] == {"visits": 2, "tags": 2, "prefs": 2}
    bad = commit(svc, me, "visits", "x", "r:7")
    assert bad["err"]["kind"] == "bad_envelope" and "visits" in bad["err"]["msg"]
    assert load(svc, me, "visits")["values"] == {"visits": 5}


def test_commit_results_are_each_their_own(svc: MemoryService) -> None:
    res = svc.handle(
        caller(),
        "state.commit",
        {
            "writes": [
                {"field": "visits", "value": 1, "w": "a:1"},
                {"field": "nope", "value": 1, "w": "a:2"},
                {"field": "note", "value": "x" * 100, "w": "a:3"},
                {"field": "visits", "value": 1},
                {"field": "status", "value": "ok", "w": "a:5"},
            ]
        },
    )["results"]
    assert [r.get("ver") or r["err"]["kind"] for r in res] == [
        1,
        "unknown_field",
        "over_limit",
        "bad_envelope",
        1,
    ]


def test_scopes_come_from_the_caller_only(svc: MemoryService) -> None:
    ann, bob = caller(), caller(user="bob", device="dev2")
    commit(svc, ann, "tags", ["ann"], "r:1")
    commit(svc, ann, "visits", 1, "r:2")
    assert load(svc, bob, "tags")["values"] == {}
    assert load(svc, bob, "visits")["values"] == {"visits": 1}  # the agent's, shared
    # Forged identity keys in the arguments are data: they change nothing.
    forged = {
        "fields": ["tags"],
        "tenant": "acme",
        "user": "ann",
        "device": "dev1",
        "agent": "kiosk",
    }
    assert svc.handle(bob, "state.load", forged)["values"] == {}
    other = caller(tenant="globex")
    assert svc.handle(other, "state.load", {**forged, "fields": ["visits"]})["values"] == {}
    hits = svc.handle(other, "mem.recall", {"query": "ann", "tenant": "acme", "user": "ann"})
    assert hits == {"hits": []}
    svc.handle(
        ann,
        "mem.remember",
        {"field": "notes", "value": {"id": "n1", "t": "ann likes tea"}, "w": "r:3"},
    )
    assert svc.handle(other, "mem.recall", {"query": "tea", "tenant": "acme"})["hits"] == []
    assert svc.handle(bob, "mem.recall", {"query": "tea", "user": "ann"})["hits"] == []
    assert [h["key"] for h in svc.handle(ann, "mem.recall", {"query": "tea"})["hits"]] == ["n1"]


def test_missing_scopes_grants_and_private_tenant_fields(svc: MemoryService) -> None:
    anon = caller(user=None, conv=None)
    assert fault(svc, anon, "state.load", {"fields": ["tags"]}).kind == "no_scope"
    assert fault(svc, anon, "state.load", {"fields": ["mood"]}).kind == "no_scope"
    assert fault(svc, anon, "state.load", {"fields": ["scratch"]}).kind == "no_scope"
    assert load(svc, anon, "visits") == {"values": {}, "vers": {}}
    ungranted = caller(grants=NO_GRANTS)
    assert fault(svc, ungranted, "state.load", {"fields": ["secret"]}).kind == "forbidden"
    assert commit(svc, caller(), "secret", "s3", "r:1")["ver"] == 1
    other_agent = caller(agent="till", device="dev9")
    assert fault(svc, other_agent, "state.load", {"fields": ["secret"]}).kind == "forbidden"
    assert commit(svc, other_agent, "secret", "mine", "t:1")["err"]["kind"] == "forbidden"
    assert load(svc, caller(), "secret")["values"] == {"secret": "s3"}
    # A public tenant collection is shared by the tenant's agents.
    svc.handle(other_agent, "mem.remember", {"field": "shared", "value": "hello all", "w": "t:2"})
    assert len(svc.handle(caller(), "mem.list", {"field": "shared"})["rows"]) == 1


def files(directory: Path) -> dict[str, bytes]:
    """Every file of a store, as bytes: what "nothing stored changed" compares."""
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


# Every method that names a tenant field, as a write or a read (FIELDS' `shared` is a
# public tenant collection, `board` a public tenant slot).
TENANT_WRITES: list[tuple[str, dict[str, Any]]] = [
    ("state.commit", {"writes": [{"field": "board", "value": "x", "w": "g:1"}]}),
    ("mem.remember", {"field": "shared", "key": "k", "value": "x", "w": "g:2"}),
    ("mem.forget", {"field": "shared", "key": "k", "w": "g:3"}),
    ("mem.forget", {"field": "board", "w": "g:4"}),
    ("mem.append", {"field": "shared", "key": "k", "text": "x", "w": "g:5"}),
    ("mem.replace", {"field": "board", "old": "o", "text": "x", "w": "g:6"}),
    ("mem.cas", {"field": "shared", "key": "k", "value": "x", "if_ver": 1, "w": "g:7"}),
    (
        "mem.link",
        {
            "field": "shared",
            "key": "k",
            "label": "l",
            "to_field": "facts",
            "to_key": "f",
            "w": "g:8",
        },
    ),  # fmt: skip
    (
        "mem.unlink",
        {
            "field": "shared",
            "key": "k",
            "label": "l",
            "to_field": "facts",
            "to_key": "f",
            "w": "g:9",
        },
    ),  # fmt: skip
]
TENANT_READS: list[tuple[str, dict[str, Any]]] = [
    ("state.load", {"fields": ["board"]}),
    ("mem.list", {"field": "shared"}),
    ("mem.peek", {"field": "shared", "key": "k"}),
    ("mem.recall", {"query": "menu", "field": "shared"}),
]
GRANT_FIELDS = [*FIELDS, {"name": "board", "dur": "tenant", "vis": "public"}]


def _refused(svc: MemoryService, who: Caller, method: str, args: dict[str, Any]) -> str:
    """The kind a call is refused with (a state.commit's write refused on its own)."""
    if method == "state.commit":
        [result] = svc.handle(who, method, args)["results"]
        return str(result["err"]["kind"])
    return fault(svc, who, method, args).kind


def test_a_tenant_field_without_a_grant_is_forbidden_and_nothing_changes(
    stores: Stores, clock: Clock
) -> None:
    svc = MemoryService(stores(clock), index=RecallIndex(embedder=None), clock=clock)
    owner = caller(fields=GRANT_FIELDS)
    commit(svc, owner, "board", "the menu: soup", "o:1")
    svc.handle(owner, "mem.remember", {"field": "shared", "key": "k", "value": "menu", "w": "o:2"})
    svc.handle(owner, "mem.remember", {"field": "facts", "key": "f", "value": {"t": 1}, "w": "o:3"})
    # Another agent of the tenant: a grant of another field only, or none at all.
    for grants in (NO_GRANTS, Grants({"prices": WRITE})):
        till = caller(agent="till", device="dev9", fields=GRANT_FIELDS, grants=grants)
        svc.handle(till, "mem.remember", {"field": "facts", "key": "f", "value": {"t": 2},
                                          "w": "t:0"})  # fmt: skip
        before = stores.stored()
        for method, args in TENANT_WRITES + TENANT_READS:
            assert _refused(svc, till, method, args) == "forbidden", (grants, method)
        assert stores.stored() == before
        # Recall over every field skips the tenant fields; the agent's own still answer.
        hits = svc.handle(till, "mem.recall", {"query": "menu", "k": 20})["hits"]
        assert hits == []
    # A refused write was not recorded: granted, the same write id applies.
    till = caller(agent="till", device="dev9", fields=GRANT_FIELDS, grants=Grants({"*": WRITE}))
    assert commit(svc, till, "board", "the menu: stew", "g:1")["ver"] == 2
    assert load(svc, owner, "board")["values"] == {"board": "the menu: stew"}


def test_a_read_only_grant_reads_and_is_refused_every_write(stores: Stores, clock: Clock) -> None:
    svc = MemoryService(stores(clock), index=RecallIndex(embedder=None), clock=clock)
    owner = caller(fields=GRANT_FIELDS)
    commit(svc, owner, "board", "o menu", "o:1")
    svc.handle(owner, "mem.remember", {"field": "shared", "key": "k", "value": "menu", "w": "o:2"})
    for grants in (Grants({"*": READ}), Grants({"*": WRITE, "shared": READ, "board": READ})):
        till = caller(agent="till", device="dev9", fields=GRANT_FIELDS, grants=grants)
        svc.handle(till, "mem.remember", {"field": "facts", "key": "f", "value": {"t": 2},
                                          "w": "t:0"})  # fmt: skip
        before = stores.stored()
        for method, args in TENANT_WRITES:
            assert _refused(svc, till, method, args) == "forbidden", (grants, method)
        assert stores.stored() == before
        assert load(svc, till, "board")["values"] == {"board": "o menu"}
        assert [r["key"] for r in svc.handle(till, "mem.list", {"field": "shared"})["rows"]] == [
            "k"
        ]
        assert svc.handle(till, "mem.peek", {"field": "shared", "key": "k"})["row"]["value"] == (
            "menu"
        )
        hits = svc.handle(till, "mem.recall", {"query": "menu"})["hits"]
        assert [(h["field"], h["key"]) for h in hits] == [("shared", "k")]
    # A field's own grant widens a read-only `*` for that field alone.
    till = caller(agent="till", device="dev9", fields=GRANT_FIELDS,
                  grants=Grants({"*": READ, "board": WRITE}))  # fmt: skip
    assert commit(svc, till, "board", "t menu", "t:1")["ver"] == 2
    assert _refused(svc, till, *TENANT_WRITES[1]) == "forbidden"


def test_a_grant_never_comes_from_the_arguments(svc: MemoryService) -> None:
    ungranted = caller(grants=NO_GRANTS)
    forged = {"grant": "*", "grants": {"*": "write"}, "access": "write", "tenant": "acme"}
    args = {"field": "shared", "value": "x", "w": "f:1", **forged}
    assert fault(svc, ungranted, "mem.remember", args).kind == "forbidden"
    assert fault(svc, ungranted, "mem.list", {"field": "shared", **forged}).kind == "forbidden"
    write = {"field": "secret", "value": "x", "w": "f:2", **forged}
    [got] = svc.handle(ungranted, "state.commit", {"writes": [write], **forged})["results"]
    assert got["err"]["kind"] == "forbidden"


def test_a_grant_does_not_open_another_agents_private_tenant_field(svc: MemoryService) -> None:
    # The owner rule stands on top of the grant: `secret` is private, first written by
    # kiosk; till's read-write `*` grant does not reach it, nor does recall.
    commit(svc, caller(), "secret", "s3", "r:1")
    till = caller(agent="till", device="dev9", grants=Grants({"*": WRITE, "secret": WRITE}))
    assert fault(svc, till, "state.load", {"fields": ["secret"]}).kind == "forbidden"
    assert commit(svc, till, "secret", "mine", "t:1")["err"]["kind"] == "forbidden"
    assert load(svc, caller(), "secret")["values"] == {"secret": "s3"}


def test_links_into_a_tenant_field_need_a_grant_to_read_it(svc: MemoryService) -> None:
    me = caller()
    svc.handle(me, "mem.remember", {"field": "shared", "key": "s", "value": "S", "w": "1"})
    svc.handle(me, "mem.remember", {"field": "facts", "key": "f", "value": {"t": 1}, "w": "2"})
    link = {"field": "shared", "key": "s", "label": "see", "to_field": "facts", "to_key": "f"}
    svc.handle(me, "mem.link", {**link, "w": "3"})
    # Another device of kiosk whose grant was taken back: the backlink from the tenant
    # field is not shown, and a link to a row there is refused.
    gone = caller(device="dev2", grants=NO_GRANTS)
    assert svc.handle(gone, "mem.peek", {"field": "facts", "key": "f"})["backlinks"] == []
    to_shared = {"field": "facts", "key": "f", "label": "l", "to_field": "shared", "to_key": "s"}
    assert fault(svc, gone, "mem.link", {**to_shared, "w": "4"}).kind == "forbidden"
    assert svc.handle(me, "mem.peek", {"field": "facts", "key": "f"})["backlinks"] == [
        {"field": "shared", "key": "s", "label": "see"}
    ]


def test_write_ids_apply_once_and_answer_the_same(stores: Stores, svc: MemoryService) -> None:
    me = caller()
    n = 1000 if stores.kind == "tiny" else 300  # the same rule, in a quarter of the time
    for i in range(n):
        for _ in range(2):
            assert commit(svc, me, "visits", 1, f"r:{i}")["ver"] == i + 1
            assert commit(svc, me, "seen", [i], f"s:{i}")["ver"] == i + 1
    got = load(svc, me, "visits", "seen")["values"]
    assert got["visits"] == n and got["seen"] == list(range(n))


def test_a_reused_write_id_is_refused_and_changes_nothing(svc: MemoryService) -> None:
    me = caller()
    commit(svc, me, "visits", 1, "r:1")
    assert commit(svc, me, "visits", 2, "r:1")["err"]["kind"] == "w_reused"
    assert commit(svc, me, "status", "x", "r:1")["err"]["kind"] == "w_reused"
    args = {"field": "facts", "value": {"a": 1}, "w": "r:1"}
    assert fault(svc, me, "mem.remember", args).kind == "w_reused"
    assert load(svc, me, "visits", "status") == {"values": {"visits": 1}, "vers": {"visits": 1}}
    assert svc.handle(me, "mem.list", {"field": "facts"})["rows"] == []


def test_limits_leave_the_store_unchanged(stores: Stores, clock: Clock) -> None:
    store = stores(clock)
    svc = MemoryService(store, clock=clock, scope_limit=2000)
    me = caller()
    assert commit(svc, me, "note", "x" * 40, "r:1")["ver"] == 1
    assert commit(svc, me, "note", "x" * 80, "r:2")["err"]["kind"] == "over_limit"
    assert load(svc, me, "note")["values"] == {"note": "x" * 40}
    for i in range(5):
        svc.handle(me, "mem.remember", {"field": "notes", "value": {"id": f"k{i}"}, "w": f"n:{i}"})
    assert (
        fault(svc, me, "mem.remember", {"field": "notes", "value": {"id": "k5"}, "w": "n:5"}).kind
        == "over_limit"
    )
    # An upsert of an existing key does not add a row.
    svc.handle(me, "mem.remember", {"field": "notes", "value": {"id": "k0", "v": 1}, "w": "n:6"})
    assert len(svc.handle(me, "mem.list", {"field": "notes"})["rows"]) == 5
    # The scope's byte limit: the agent scope holds at most 2000 bytes.
    before = stores.stored()
    big = {"field": "facts", "value": {"t": "y" * 1500}, "w": "f:1"}
    svc.handle(me, "mem.remember", big)
    e = fault(svc, me, "mem.remember", {**big, "w": "f:2"})
    assert e.kind == "over_limit"
    assert len(svc.handle(me, "mem.list", {"field": "facts"})["rows"]) == 1
    assert commit(svc, me, "status", "z" * 600, "r:3")["err"]["kind"] == "over_limit"
    assert before != stores.stored()
    # A fresh store over the same files agrees.
    again = MemoryService(stores(clock), clock=clock)
    assert len(again.handle(me, "mem.list", {"field": "facts"})["rows"]) == 1
    assert load(again, me, "status")["values"] == {}


def test_remember_upserts_by_key_and_inserts_without(svc: MemoryService) -> None:
    me = caller(run="run7")
    a = svc.handle(
        me,
        "mem.remember",
        {"field": "notes", "value": {"id": "x", "t": "one"}, "w": "1", "tool": "memory.remember"},
    )
    assert a == {"key": "x", "ver": 1}
    b = svc.handle(
        me, "mem.remember", {"field": "notes", "value": {"id": "x", "t": "two"}, "w": "2"}
    )
    assert b == {"key": "x", "ver": 2}
    c = svc.handle(me, "mem.remember", {"field": "notes", "key": "y", "value": "plain", "w": "3"})
    assert c == {"key": "y", "ver": 1}
    d = svc.handle(me, "mem.remember", {"field": "facts", "value": {"a": 1}, "w": "4"})
    e = svc.handle(me, "mem.remember", {"field": "facts", "value": {"a": 1}, "w": "5"})
    assert d["key"] != e["key"] and d["ver"] == e["ver"] == 1
    # A deep collection merges an upsert into the row.
    svc.handle(me, "mem.remember", {"field": "facts", "key": d["key"], "value": {"b": 2}, "w": "6"})
    row = svc.handle(me, "mem.peek", {"field": "facts", "key": d["key"]})["row"]
    assert row["value"] == {"a": 1, "b": 2} and row["ver"] == 2
    x = svc.handle(me, "mem.peek", {"field": "notes", "key": "x"})["row"]
    assert x["value"] == {"id": "x", "t": "two"}
    assert x["prov"] == {
        "dev": "dev1",
        "run": "run7",
        "tool": None,
        "at": 1_700_000_000.0,
        "agent": "kiosk",
        "ver": 2,
    }
    assert set(x) == {"key", "value", "ver", "links", "prov", "at"}


def test_links_and_backlinks(svc: MemoryService) -> None:
    me = caller()
    svc.handle(me, "mem.remember", {"field": "notes", "key": "a", "value": "A", "w": "1"})
    svc.handle(me, "mem.remember", {"field": "facts", "key": "f", "value": {"t": 1}, "w": "2"})
    link = {"field": "facts", "key": "f", "label": "about", "to_field": "notes", "to_key": "a"}
    assert svc.handle(me, "mem.link", {**link, "w": "3"}) == {"ver": 2}
    assert svc.handle(me, "mem.link", {**link, "w": "3"}) == {"ver": 2}
    assert svc.handle(me, "mem.peek", {"field": "notes", "key": "a"})["backlinks"] == [
        {"field": "facts", "key": "f", "label": "about"}
    ]
    assert svc.handle(me, "mem.peek", {"field": "facts", "key": "f"})["row"]["links"] == [
        {"label": "about", "to_field": "notes", "to_key": "a"}
    ]
    assert fault(svc, me, "mem.link", {**link, "to_key": "zz", "w": "4"}).kind == "not_found"
    assert fault(svc, me, "mem.link", {**link, "key": "zz", "w": "5"}).kind == "not_found"
    assert (
        fault(svc, me, "mem.link", {**link, "to_field": "nope", "w": "6"}).kind == "unknown_field"
    )
    svc.handle(me, "mem.unlink", {**link, "w": "7"})
    assert svc.handle(me, "mem.peek", {"field": "notes", "key": "a"})["backlinks"] == []
    # Backlinks are not stored on the target.
    assert svc.handle(me, "mem.peek", {"field": "notes", "key": "a"})["row"]["links"] == []


def test_list_is_most_recent_first_with_a_cursor(svc: MemoryService, clock: Clock) -> None:
    me = caller()
    for i in range(7):
        svc.handle(
            me, "mem.remember", {"field": "facts", "key": f"k{i}", "value": {"i": i}, "w": f"{i}"}
        )
    svc.handle(me, "mem.remember", {"field": "facts", "key": "k2", "value": {"j": 1}, "w": "again"})
    seen: list[str] = []
    cursor = None
    while True:
        page = svc.handle(me, "mem.list", {"field": "facts", "limit": 3, "cursor": cursor})
        seen += [r["key"] for r in page["rows"]]
        cursor = page["cursor"]
        if cursor is None:
            break
    assert seen == ["k2", "k6", "k5", "k4", "k3", "k1", "k0"]
    assert fault(svc, me, "mem.list", {"field": "facts", "cursor": "x1"}).kind == "bad_envelope"
    assert fault(svc, me, "mem.list", {"field": "facts", "limit": 0}).kind == "bad_envelope"


def test_ttl_expires_rows_and_values(svc: MemoryService, clock: Clock) -> None:
    me = caller()
    svc.handle(
        me, "mem.remember", {"field": "temp", "key": "t", "value": "teapot soon gone", "w": "1"}
    )
    commit(svc, me, "hint", "soon gone", "2")
    clock.now += 59
    assert len(svc.handle(me, "mem.list", {"field": "temp"})["rows"]) == 1
    assert load(svc, me, "hint")["values"] == {"hint": "soon gone"}
    clock.now += 2
    assert svc.handle(me, "mem.list", {"field": "temp"})["rows"] == []
    assert fault(svc, me, "mem.peek", {"field": "temp", "key": "t"}).kind == "not_found"
    assert svc.handle(me, "mem.recall", {"query": "teapot"})["hits"] == []
    assert load(svc, me, "hint")["values"] == {}
    # The next write sweeps it from the file; the key comes back at a new version.
    assert (
        svc.handle(me, "mem.remember", {"field": "temp", "key": "t", "value": "new", "w": "3"})[
            "ver"
        ]
        == 2
    )
    assert commit(svc, me, "hint", "again", "4")["ver"] == 2


def test_forget_leaves_a_tombstone(stores: Stores, svc: MemoryService) -> None:
    me = caller()
    put = {"field": "notes", "key": "k", "value": "remember me", "w": "1"}
    svc.handle(me, "mem.remember", put)
    assert svc.handle(me, "mem.forget", {"field": "notes", "key": "k", "w": "2"}) == {
        "key": "k",
        "forgotten": True,
    }
    # A replayed write (same w) answers as before and brings nothing back.
    assert svc.handle(me, "mem.remember", put) == {"key": "k", "ver": 1}
    assert fault(svc, me, "mem.peek", {"field": "notes", "key": "k"}).kind == "not_found"
    assert svc.handle(me, "mem.recall", {"query": "remember"})["hits"] == []
    assert (
        svc.handle(me, "mem.forget", {"field": "notes", "key": "k", "w": "3"})["forgotten"] is False
    )
    # A new write of the key is a new row, past the forgotten version.
    assert svc.handle(me, "mem.remember", {**put, "w": "4"})["ver"] == 2
    # Core: a backup older than the forget does not bring the field back.
    assert svc.handle(me, "core.sync", {"scope": "agent", "ver": 1, "doc": "kind", "w": "5"}) == {
        "ver": 1
    }
    assert svc.handle(me, "mem.forget", {"field": "persona", "w": "6"})["forgotten"] is True
    assert svc.handle(me, "core.load", {"scope": "agent"}) == {"ver": 2, "doc": ""}
    e = fault(svc, me, "core.sync", {"scope": "agent", "ver": 2, "doc": "kind", "w": "7"})
    assert e.kind == "conflict" and e.extra == {"ver": 2, "doc": ""}
    assert svc.handle(me, "core.load", {"scope": "agent"}) == {"ver": 2, "doc": ""}
    # Same after a restart.
    again = MemoryService(stores(svc.clock), clock=svc.clock)
    assert again.handle(me, "mem.remember", put) == {"key": "k", "ver": 1}
    assert again.handle(me, "mem.peek", {"field": "notes", "key": "k"})["row"]["ver"] == 2


def test_core_sync_and_load(svc: MemoryService) -> None:
    me = caller()
    assert svc.handle(me, "core.load", {"scope": "user"}) == {"ver": 0}
    assert svc.handle(me, "core.sync", {"scope": "user", "ver": 3, "doc": "x", "w": "1"}) == {
        "ver": 3
    }
    assert svc.handle(me, "core.load", {"scope": "user"}) == {"ver": 3, "doc": "x"}
    assert svc.handle(caller(user="bob"), "core.load", {"scope": "user"}) == {"ver": 0}
    assert (
        fault(svc, me, "core.sync", {"scope": "user", "ver": 3, "doc": "", "w": "2"}).kind
        == "conflict"
    )
    assert (
        fault(
            svc,
            me,
            "core.sync",
            {"scope": "agent", "ver": 1, "doc": "p" * 21, "w": "3"},
        ).kind
        == "over_limit"
    )
    assert fault(svc, caller(user=None), "core.load", {"scope": "user"}).kind == "no_scope"
    assert fault(svc, me, "core.load", {"scope": "tenant"}).kind == "bad_envelope"


def test_cas(svc: MemoryService) -> None:
    me = caller()
    commit(svc, me, "status", "a", "1")
    assert svc.handle(me, "mem.cas", {"field": "status", "value": "b", "if_ver": 1, "w": "2"}) == {
        "ver": 2,
        "value": "b",
    }
    e = fault(svc, me, "mem.cas", {"field": "status", "value": "c", "if_ver": 1, "w": "3"})
    assert e.kind == "conflict" and e.extra == {"value": "b", "ver": 2}
    assert e.to_error()["kind"] == "conflict" and e.to_error()["value"] == "b"
    commit(svc, me, "visits", 5, "4")
    assert svc.handle(me, "mem.cas", {"field": "visits", "value": 2, "if_ver": 0, "w": "5"}) == {
        "ver": 2,
        "value": 7,
        "merged": True,
    }
    assert (
        fault(svc, me, "mem.cas", {"field": "mood", "value": 1, "if_ver": 1, "w": "6"}).kind
        == "not_found"
    )
    assert (
        fault(
            svc, me, "mem.cas", {"field": "notes", "key": "nope", "value": 1, "if_ver": 1, "w": "7"}
        ).kind
        == "not_found"
    )
    svc.handle(me, "mem.remember", {"field": "notes", "key": "r", "value": "v1", "w": "8"})
    assert svc.handle(
        me, "mem.cas", {"field": "notes", "key": "r", "value": "v2", "if_ver": 1, "w": "9"}
    ) == {"ver": 2, "value": "v2"}


def test_append_and_replace_text(svc: MemoryService) -> None:
    me = caller()
    assert svc.handle(me, "mem.append", {"field": "status", "text": "hello", "w": "1"}) == {
        "ver": 1
    }
    svc.handle(me, "mem.append", {"field": "status", "text": " world", "w": "2"})
    svc.handle(me, "mem.replace", {"field": "status", "old": "world", "text": "there", "w": "3"})
    assert load(svc, me, "status")["values"] == {"status": "hello there"}
    svc.handle(me, "mem.replace", {"field": "status", "old": " there", "text": "", "w": "4"})
    assert load(svc, me, "status")["values"] == {"status": "hello"}
    assert (
        fault(svc, me, "mem.replace", {"field": "status", "old": "zzz", "text": "", "w": "5"}).kind
        == "not_found"
    )
    svc.handle(
        me, "mem.remember", {"field": "facts", "key": "d", "value": {"text": "ab"}, "w": "6"}
    )
    svc.handle(me, "mem.append", {"field": "facts", "key": "d", "text": "c", "w": "7"})
    assert svc.handle(me, "mem.peek", {"field": "facts", "key": "d"})["row"]["value"] == {
        "text": "abc"
    }
    assert (
        fault(
            svc,
            me,
            "mem.replace",
            {"field": "facts", "key": "no", "old": "a", "text": "", "w": "8"},
        ).kind
        == "not_found"
    )
    commit(svc, me, "visits", 1, "9")
    assert (
        fault(svc, me, "mem.append", {"field": "visits", "text": "x", "w": "10"}).kind
        == "bad_envelope"
    )


def test_recall_fallback_ranks_by_word_overlap(svc: MemoryService) -> None:
    me = caller()
    svc.handle(
        me,
        "mem.remember",
        {"field": "facts", "key": "a", "value": {"t": "Ann drinks green tea"}, "w": "1"},
    )
    svc.handle(me, "mem.remember", {"field": "notes", "key": "b", "value": "tea at noon", "w": "2"})
    svc.handle(me, "mem.remember", {"field": "notes", "key": "c", "value": "coffee", "w": "3"})
    hits = svc.handle(me, "mem.recall", {"query": "green TEA"})["hits"]
    assert [(h["field"], h["key"], h["score"]) for h in hits] == [
        ("facts", "a", 1.0),
        ("notes", "b", 0.5),
    ]
    assert hits[0]["prov"]["dev"] == "dev1"
    assert [
        h["key"] for h in svc.handle(me, "mem.recall", {"query": "tea", "field": "notes"})["hits"]
    ] == ["b"]
    assert len(svc.handle(me, "mem.recall", {"query": "tea", "k": 1})["hits"]) == 1
    assert fault(svc, me, "mem.recall", {"query": "tea", "k": 21}).kind == "bad_envelope"


def test_recall_through_an_index(stores: Stores, clock: Clock) -> None:
    # The real index, keyword mode (the embedding model is exercised in test_recall.py).
    index = RecallIndex(embedder=None)
    svc = MemoryService(stores(clock), index=index, clock=clock)
    ann, bob = caller(), caller(user="bob", device="dev2")
    svc.handle(ann, "mem.remember", {"field": "notes", "key": "a/b", "value": "tea", "w": "1"})
    svc.handle(bob, "mem.remember", {"field": "notes", "key": "c", "value": "tea", "w": "1"})
    assert len(index) == 2
    assert [h["key"] for h in svc.handle(ann, "mem.recall", {"query": "tea"})["hits"]] == ["a/b"]
    svc.handle(ann, "mem.forget", {"field": "notes", "key": "a/b", "w": "2"})
    assert len(index) == 1
    assert svc.handle(ann, "mem.recall", {"query": "tea"})["hits"] == []
    index.rebuild([])
    assert len(index) == 0 and svc.reindex() == 1
    assert [h["key"] for h in svc.handle(bob, "mem.recall", {"query": "tea"})["hits"]] == ["c"]


@pytest.mark.parametrize(
    ("method", "args", "kind"),
    [
        ("mem.nope", {}, "unknown_method"),
        ("state.load", {"fields": ["ghost"]}, "unknown_field"),
        ("state.load", {"fields": "visits"}, "bad_envelope"),
        ("state.load", {"fields": ["facts"]}, "bad_envelope"),
        ("state.commit", {"writes": []}, "bad_envelope"),
        ("mem.remember", {"field": "facts", "w": "1"}, "bad_envelope"),
        ("mem.remember", {"field": "facts", "value": 1}, "bad_envelope"),
        ("mem.remember", {"field": "facts", "value": b"bin", "w": "1"}, "bad_envelope"),
        ("mem.remember", {"field": "facts", "value": {1: 2}, "w": "1"}, "bad_envelope"),
        ("mem.remember", {"field": "facts", "value": 1, "w": "x" * 161}, "bad_envelope"),
        (
            "mem.remember",
            {"field": "facts", "key": "k" * 129, "value": 1, "w": "1"},
            "bad_envelope",
        ),
        ("mem.remember", {"field": "visits", "value": 1, "w": "1"}, "bad_envelope"),
        ("mem.remember", {"field": 3, "value": 1, "w": "1"}, "bad_envelope"),
        ("mem.list", {"field": "ghost"}, "unknown_field"),
        ("mem.peek", {"field": "facts"}, "bad_envelope"),
        ("mem.peek", {"field": "facts", "key": "none"}, "not_found"),
        (
            "mem.cas",
            {"field": "facts", "key": "none", "value": 1, "if_ver": 1, "w": "1"},
            "not_found",
        ),
        ("mem.cas", {"field": "status", "value": 1, "if_ver": "1", "w": "1"}, "bad_envelope"),
        ("mem.recall", {"query": ""}, "bad_envelope"),
        ("core.sync", {"scope": "agent", "ver": 0, "doc": "", "w": "1"}, "bad_envelope"),
        ("core.sync", {"scope": "agent", "ver": 1, "doc": {}, "w": "1"}, "bad_envelope"),
    ],
)
def test_refusals_name_their_kind(
    tmp_path: Path, clock: Clock, method: str, args: dict[str, Any], kind: str
) -> None:
    # Refused before any store is opened: one backend says it for both.
    svc = MemoryService(TinyMemoryStore(tmp_path / "mem", clock), clock=clock)
    assert fault(svc, caller(), method, args).kind == kind
