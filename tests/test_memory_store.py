"""The memory store: shards, atomic commits, the ledger, and durability under SIGKILL.

The tests taking `stores` run against both backends, `[tiny]` (TinyMemoryStore,
server_bridge/memory/store.py, over files in tmp_path) and `[pg]` (PgMemoryStore,
server_bridge/pgstore/memory.py, over a fresh database of the session's PostgreSQL,
skipped saying why on a machine without one); the others look at TinyDB's files. The
other memory test files take `stores` from here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from server_bridge.memory.store import SLOTS, ScopeRef, TinyMemoryStore, WouldWait, open_shard_db

ANN = ScopeRef("acme", "user", "kiosk/ann")
BOB = ScopeRef("acme", "user", "kiosk/bob")
PY = (
    "/work/main/.venv/bin/python"
    if os.path.exists("/work/main/.venv/bin/python")
    else sys.executable
)
ROOT = Path(__file__).resolve().parent.parent


class Stores:
    """Opens memory stores of one kind over one place (a directory, a database): each
    call is another instance over the same data, as a restart or a second bridge is."""

    def __init__(self, kind: str, directory: Path, dsn: str | None) -> None:
        self.kind = kind
        self.dir = directory
        self.dsn = dsn
        self._open: list[Any] = []

    def __call__(self, clock: Callable[[], float] = time.time, **kw: Any) -> Any:
        if self.kind == "tiny":
            return TinyMemoryStore(self.dir, clock, **kw)
        from server_bridge.pgstore.memory import PgMemoryStore

        assert self.dsn is not None
        store = PgMemoryStore(self.dsn, clock, **kw)
        self._open.append(store)
        return store

    def close(self) -> None:
        for store in self._open:
            store.close()

    def stored(self) -> Any:
        """Everything the stores hold, to compare: "nothing stored changed"."""
        if self.kind == "tiny":
            return {
                str(p.relative_to(self.dir)): p.read_bytes()
                for p in self.dir.rglob("*")
                if p.is_file()
            }
        import psycopg

        with psycopg.connect(str(self.dsn)) as conn:
            return {
                table: conn.execute(f"SELECT * FROM {table} ORDER BY 1, 2, 3").fetchall()
                for table in MEMORY_TABLES
            }

    def device_ledger(self, store: Any, tenant: str, device: str) -> dict[str, Any]:
        """The device's ledger document as stored."""
        if self.kind == "tiny":
            path = store.ledger_path(tenant, device)
            return dict(json.loads(path.read_text())) if path.exists() else {}
        return dict(store.device_ledger(tenant, device))

    def lose_device_ledger(self, store: Any, tenant: str, device: str) -> None:
        """The device's ledger gone, as a crash between a shard's write and its device
        ledger's leaves the TinyDB store (one transaction in PostgreSQL: done by hand)."""
        if self.kind == "tiny":
            store.ledger_path(tenant, device).unlink()
            return
        import psycopg

        with psycopg.connect(str(self.dsn)) as conn:
            conn.execute(
                "DELETE FROM wren_mem_devices WHERE tenant = %s AND device = %s", (tenant, device)
            )


MEMORY_TABLES = (
    "wren_mem_scopes",
    "wren_mem_shards",
    "wren_mem_records",
    "wren_mem_writes",
    "wren_mem_devices",
)


@pytest.fixture(scope="session")
def memory_db(pg_server: Any) -> Iterator[str]:
    """A database for the `[pg]` store tests of a module, emptied before each test (a
    fresh database per test, conftest's pg_dsn, costs 0.2-0.3 s; emptying, 10 ms)."""
    import uuid

    import psycopg
    import psycopg.conninfo

    from server_bridge.pgstore import migrate

    name = f"m_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    dsn = psycopg.conninfo.make_conninfo(pg_server.dsn, dbname=name)
    with psycopg.connect(dsn) as conn:
        migrate.apply(conn)
    yield dsn
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["tiny", "pg"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stores]:
    """Memory stores of each backend (ids `[tiny]`, `[pg]`); PostgreSQL's skip, saying
    why, when the machine has none. Other test files use it (and `memory_db`) by
    naming them in their module: `stores = test_memory_store.stores`."""
    dsn = None
    if request.param == "pg":
        import psycopg

        dsn = request.getfixturevalue("memory_db")
        with psycopg.connect(dsn) as conn:
            conn.execute(f"TRUNCATE {', '.join(MEMORY_TABLES)} RESTART IDENTITY")
    got = Stores(request.param, tmp_path / "mem", dsn)
    yield got
    got.close()


def test_one_file_per_collection_per_scope_instance(tmp_path: Path) -> None:
    store = TinyMemoryStore(tmp_path)
    with store.scope(ANN) as tx:
        tx.commit("notes", {"rows": {"k": {"key": "k", "value": "v", "sz": 10}}})
        tx.commit(SLOTS, {"slots": {"mood": {"value": 1, "sz": 1}}})
    with store.scope(BOB) as tx:
        tx.commit("notes", {"rows": {"k": {"key": "k", "value": "w", "sz": 10}}})
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json"))
    assert len(files) == 3
    assert all(f.startswith("acme/user/") for f in files)
    assert sum(f.endswith("/c-notes.json") for f in files) == 2
    # The files are TinyDB documents.
    db = open_shard_db(store.shard_path(ANN, "notes"))
    assert db.table("rows").get(doc_id="k") == {"key": "k", "value": "v", "sz": 10}
    assert db.table("meta").get(doc_id="m")["scope_id"] == "kiosk/ann"


def test_commits_reach_cache_and_file_and_usage_sums_the_scope(stores: Stores) -> None:
    store = stores()
    with store.scope(ANN) as tx:
        tx.commit("notes", {"rows": {"a": {"v": 1, "sz": 100}, "b": {"v": 2, "sz": 50}}})
        tx.commit(SLOTS, {"slots": {"x": {"sz": 7}}, "core": {"doc": {"sz": 3}}})
        tx.commit("notes", {"rows": {"a": None}, "tomb": {"a": {"ver": 1}}})
        assert tx.usage() == 60 and tx.table("notes", "tomb") == {"a": {"ver": 1}}
    fresh = stores()
    with fresh.scope(ANN) as tx:
        assert tx.usage() == 60
        assert tx.collections() == ["notes"]
        assert tx.table("notes", "rows") == {"b": {"v": 2, "sz": 50}}


def test_a_failed_write_changes_neither_cache_nor_file(stores: Stores) -> None:
    store = stores()
    with store.scope(ANN) as tx:
        tx.commit("notes", {"rows": {"a": {"v": 1}}})
    before = stores.stored()
    with store.scope(ANN) as tx:
        with pytest.raises(TypeError):
            tx.commit("notes", {"rows": {"b": {"v": object()}}})
        assert tx.table("notes", "rows") == {"a": {"v": 1}}
    assert stores.stored() == before
    with stores().scope(ANN) as tx:
        assert tx.table("notes", "rows") == {"a": {"v": 1}}


def test_the_ledger_lives_in_the_shard_and_expires(stores: Stores) -> None:
    now = [1000.0]
    store = stores(lambda: now[0], ledger_cap=3)
    with store.scope(ANN) as tx:
        tx.commit(SLOTS, {}, ledger=("dev1", "r:1", {"h": "H1", "ans": {"ver": 1}, "at": now[0]}))
        hit = tx.find_write(SLOTS, "dev1", "r:1")
        assert hit is not None and hit.h == "H1" and hit.answer == {"ver": 1}
        assert tx.find_write(SLOTS, "dev2", "r:1") is None
        # Known in another shard of the process: the hash, not the answer.
        other = tx.find_write("notes", "dev1", "r:1")
        assert other is not None and other.answer is None
    with stores().scope(ANN) as tx:
        assert tx.find_write(SLOTS, "dev1", "r:1") is not None
    now[0] += 8 * 24 * 3600
    with store.scope(ANN) as tx:
        tx.commit(SLOTS, {}, ledger=("dev1", "r:2", {"h": "H2", "ans": {}, "at": now[0]}))
        assert tx.find_write(SLOTS, "dev1", "r:1") is None
        for i in range(3, 7):
            tx.commit(SLOTS, {}, ledger=("dev1", f"r:{i}", {"h": "H", "ans": {}, "at": now[0]}))
        assert sorted(tx.table(SLOTS, "w")) == ["dev1/r:4", "dev1/r:5", "dev1/r:6"]
    assert store.ledger_evicted == 2


def test_a_corrupt_shard_is_refused_not_emptied(tmp_path: Path) -> None:
    store = TinyMemoryStore(tmp_path)
    with store.scope(ANN) as tx:
        tx.commit("notes", {"rows": {"a": {"v": 1}}})
    path = store.shard_path(ANN, "notes")
    path.write_text("{not json")
    with pytest.raises(ValueError), TinyMemoryStore(tmp_path).scope(ANN) as tx:
        tx.table("notes", "rows")
    assert path.read_text() == "{not json"


def test_scopes_are_locked_one_by_one_and_evicted_when_idle(stores: Stores) -> None:
    store = stores(max_scopes=2)
    counts = {ANN: 0, BOB: 0}

    def bump(ref: ScopeRef) -> None:
        for _ in range(50):
            with store.scope(ref) as tx:
                n = tx.table(SLOTS, "slots").get("n", {"v": 0})["v"]
                tx.commit(SLOTS, {"slots": {"n": {"v": n + 1}}})
                counts[ref] += 1

    threads = [threading.Thread(target=bump, args=(r,)) for r in (ANN, ANN, BOB, BOB)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for ref in (ANN, BOB):
        with store.scope(ref) as tx:
            assert tx.table(SLOTS, "slots")["n"]["v"] == 100
    for i in range(5):
        with store.scope(ScopeRef("acme", "agent", f"a{i}")):
            pass
    assert len(store._scopes) == 2
    with store.scope(ANN) as tx:
        assert tx.table(SLOTS, "slots")["n"]["v"] == 100


def test_scan_yields_every_shard(stores: Stores) -> None:
    store = stores()
    for ref in (ANN, BOB):
        with store.scope(ref) as tx:
            tx.commit("notes", {"rows": {"k": {"v": ref.scope_id}}})
    got = {(ref, shard) for ref, shard, _ in store.scan()}
    assert got == {(ANN, "notes"), (BOB, "notes")}
    docs = {ref: doc for ref, _, doc in stores().scan()}
    assert docs[BOB]["rows"] == {"k": {"v": "kiosk/bob"}}
    assert docs[BOB]["meta"]["m"]["field"] == "notes"


def test_records_come_back_as_they_went_in_and_in_write_order(stores: Stores) -> None:
    # What a JSON file holds: NaN, a map's key order, NUL and a lone surrogate in a key.
    odd = "k\x00%25\ud800é"
    value = {"z": float("nan"), "a": [1.5, -0.0, 10**18, "\x00"], "m": {"y": None, "b": True}}
    store = stores()
    with store.scope(ANN) as tx:
        tx.commit("notes", {"rows": {"a": {"v": 1}, odd: {"v": value}, "c": {"v": 3}}})
        tx.commit("notes", {"rows": {"a": {"v": 2}}})
    for s in (store, stores()):
        with s.scope(ANN) as tx:
            rows = tx.table("notes", "rows")
            # A rewritten record moves to the end, as in a dict (and a TinyDB table).
            assert list(rows) == [odd, "c", "a"]
            assert json.dumps(rows[odd]["v"]) == json.dumps(value)


def test_a_reader_that_must_not_wait_is_refused_would_wait(stores: Stores) -> None:
    store = stores()
    with store.scope(ANN) as tx:
        tx.commit(SLOTS, {"slots": {"mood": {"value": "calm", "sz": 6}}})
    fresh = stores()
    # Not in this instance's memory: refused rather than read (a file, or a query).
    with pytest.raises(WouldWait), fresh.scope(ANN, wait=False) as tx:
        tx.table(SLOTS, "slots")
    with fresh.scope(ANN) as tx:
        assert tx.table(SLOTS, "slots")["mood"]["value"] == "calm"
    with fresh.scope(ANN, wait=False) as tx:
        assert tx.table(SLOTS, "slots")["mood"]["value"] == "calm"
    held, release = threading.Event(), threading.Event()

    def writer() -> None:
        with fresh.scope(ANN) as tx:
            held.set()
            release.wait(10)
            tx.commit(SLOTS, {"slots": {"mood": {"value": "glad", "sz": 6}}})

    t = threading.Thread(target=writer)
    t.start()
    try:
        assert held.wait(10)
        with pytest.raises(WouldWait), fresh.scope(ANN, wait=False):
            pass
    finally:
        release.set()
        t.join(10)
    with fresh.scope(ANN, wait=False) as tx:
        assert tx.table(SLOTS, "slots")["mood"]["value"] == "glad"


CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    from server_bridge.memory import Caller, MemoryService, TinyMemoryStore
    fields = [
        {{"name": "count", "dur": "agent", "merge": "sum"}},
        {{"name": "log", "dur": "user", "kind": "collection", "max": 100000}},
    ]
    svc = MemoryService(TinyMemoryStore(sys.argv[1]), scope_limit=1 << 30)
    me = Caller("acme", "dev1", "kiosk", user="ann", fields=fields)
    start = int(sys.argv[2])
    for i in range(start, start + 100000):
        write = {{"field": "count", "value": 1, "w": f"c:{{i}}"}}
        r = svc.handle(me, "state.commit", {{"writes": [write]}})
        assert "err" not in r["results"][0], r
        row = {{"field": "log", "key": f"k{{i}}", "value": i, "w": f"l:{{i}}"}}
        svc.handle(me, "mem.remember", row)
        print(i, flush=True)
    """
)


def test_acknowledged_writes_survive_sigkill(tmp_path: Path) -> None:
    from server_bridge.memory import Caller, MemoryService, TinyMemoryStore

    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=str(ROOT)))
    data = tmp_path / "mem"
    fields = [
        {"name": "count", "dur": "agent", "merge": "sum"},
        {"name": "log", "dur": "user", "kind": "collection", "max": 100000},
    ]
    me = Caller("acme", "dev1", "kiosk", user="ann", fields=fields)
    acked = -1
    for rnd in range(20):
        child = subprocess.Popen(
            [PY, str(script), str(data), str(acked + 1)], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None
        # Kill it mid-stream, after a few acknowledged writes, at a moment that varies.
        target = 3 + rnd % 7
        seen = 0
        for line in child.stdout:
            acked = int(line)
            seen += 1
            if seen >= target:
                time.sleep((rnd % 5) * 0.0007)
                break
        child.send_signal(signal.SIGKILL)
        for line in child.stdout:  # lines printed before the kill was delivered
            acked = int(line)
        child.wait()
        svc = MemoryService(TinyMemoryStore(data), scope_limit=1 << 30)
        got = svc.handle(me, "state.load", {"fields": ["count"]})["values"]["count"]
        # Every acknowledged write is there; the one in flight at the kill may be too.
        assert got in (acked + 1, acked + 2), (rnd, got, acked)
        keys: set[str] = set()
        cursor = None
        while True:
            page = svc.handle(me, "mem.list", {"field": "log", "limit": 100, "cursor": cursor})
            keys |= {r["key"] for r in page["rows"]}
            cursor = page["cursor"]
            if cursor is None:
                break
        assert {f"k{i}" for i in range(acked + 1)} <= keys
        if got == acked + 2:
            # The in-flight counter write landed; its row write may not have: retry both
            # as the board would, with the same write ids, so the next round starts even.
            svc.handle(
                me,
                "state.commit",
                {"writes": [{"field": "count", "value": 1, "w": f"c:{acked + 1}"}]},
            )
            svc.handle(
                me,
                "mem.remember",
                {"field": "log", "key": f"k{acked + 1}", "value": acked + 1, "w": f"l:{acked + 1}"},
            )
            acked += 1
            assert (
                svc.handle(me, "state.load", {"fields": ["count"]})["values"]["count"] == acked + 1
            )
    assert acked > 40
