"""PgMemoryStore (server_bridge/pgstore/memory.py) where PostgreSQL differs from a file:
several bridges on one database, a bridge killed while it holds a scope, a commit that
fails halfway. The behaviour both backends share is tested on both by
test_memory_store.py and the service-level memory tests (their `[pg]` ids).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from server_bridge.memory import Caller, MemoryService
from server_bridge.memory import ledger as L
from server_bridge.memory.store import SLOTS, ScopeRef, WouldWait
from server_bridge.pgstore.memory import PgMemoryStore

ANN = ScopeRef("acme", "user", "kiosk/ann")
ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv/bin/python") if (ROOT / ".venv/bin/python").exists() else sys.executable
FIELDS = [
    {"name": "count", "dur": "agent", "merge": "sum"},
    {"name": "notes", "dur": "agent", "kind": "collection", "max": 1 << 16},
]


@pytest.fixture
def bridges(pg_dsn: str) -> Iterator[tuple[PgMemoryStore, PgMemoryStore]]:
    """Two stores on one database, as two bridge processes have."""
    a, b = PgMemoryStore(pg_dsn), PgMemoryStore(pg_dsn)
    yield a, b
    a.close()
    b.close()


def run_threads(targets: list[Any]) -> None:
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)


def test_two_bridges_on_one_row_lose_no_update(
    bridges: tuple[PgMemoryStore, PgMemoryStore],
) -> None:
    # Read, add one, write back: the scope's lock is the database's, so the increments
    # of two stores (two caches, two pools) never overlap.
    errors: list[BaseException] = []

    def bump(store: PgMemoryStore) -> None:
        try:
            for _ in range(40):
                with store.scope(ANN) as tx:
                    n = tx.table(SLOTS, "slots").get("n", {"v": 0})["v"]
                    tx.commit(SLOTS, {"slots": {"n": {"v": n + 1, "sz": 1}}})
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    a, b = bridges
    run_threads([lambda: bump(a), lambda: bump(a), lambda: bump(b), lambda: bump(b)])
    assert errors == []
    for store in bridges:
        with store.scope(ANN) as tx:
            assert tx.table(SLOTS, "slots")["n"]["v"] == 160
            assert tx.usage() == 1


def test_two_bridges_apply_each_write_id_once(
    bridges: tuple[PgMemoryStore, PgMemoryStore],
) -> None:
    # A board's writes reach both bridges (a retry after a failover): each write id,
    # sent to both at once, is applied once, and answered the same by either.
    clock = time.time
    services = [MemoryService(store, clock=clock) for store in bridges]
    me = Caller("acme", "dev1", "kiosk", run="0a0b0c0d.1", fields=FIELDS)
    answers: dict[tuple[int, str], list[Any]] = {}
    lock = threading.Lock()

    def send(svc: MemoryService, who: int, wids: list[str]) -> None:
        for w in wids:
            write = {"field": "count", "value": 1, "w": w}
            [got] = svc.handle(me, "state.commit", {"writes": [write]})["results"]
            row = {"field": "notes", "key": f"k{w}", "value": w, "w": w.replace(".1:", ".2:")}
            put = svc.handle(me, "mem.remember", row)
            with lock:
                answers.setdefault((who, w), []).extend([got, put])

    wids = [f"0a0b0c0d.1:{i}" for i in range(1, 41)]
    run_threads(
        [
            lambda: send(services[0], 0, wids),
            lambda: send(services[1], 1, wids),
            lambda: send(services[0], 2, wids[::-1]),
        ]
    )
    for svc in services:
        got = svc.handle(me, "state.load", {"fields": ["count"]})
        assert got == {"values": {"count": 40}, "vers": {"count": 40}}
        listed = svc.handle(me, "mem.list", {"field": "notes", "limit": 100})["rows"]
        assert len(listed) == 40 and all(r["ver"] == 1 for r in listed)
    # Every answer to one write id is its first answer (ver n), never a second apply.
    for w in wids:
        firsts = [answers[(who, w)] for who in range(3)]
        assert firsts[0] == firsts[1] == firsts[2] and "ver" in firsts[0][0], firsts


def test_a_scope_held_by_another_bridge_refuses_a_reader_that_must_not_wait(
    bridges: tuple[PgMemoryStore, PgMemoryStore],
) -> None:
    a, b = bridges
    with b.scope(ANN) as tx:
        tx.commit(SLOTS, {"slots": {"mood": {"value": "calm", "sz": 6}}})
    with b.scope(ANN, wait=False) as tx:
        assert tx.table(SLOTS, "slots")["mood"]["value"] == "calm"
    with a.scope(ANN) as tx:
        held = time.monotonic()
        with pytest.raises(WouldWait):
            with b.scope(ANN, wait=False):
                pass
        assert time.monotonic() - held < 1.0  # at once, not after a lock timeout
        tx.commit(SLOTS, {"slots": {"mood": {"value": "glad", "sz": 6}}})
    # b's copy is behind the database now: refused until a reader that may wait reads.
    with pytest.raises(WouldWait), b.scope(ANN, wait=False) as tx:
        tx.table(SLOTS, "slots")
    with b.scope(ANN) as tx:
        assert tx.table(SLOTS, "slots")["mood"]["value"] == "glad"


def test_a_commit_that_fails_halfway_leaves_nothing(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PgMemoryStore(pg_dsn, lambda: 1_700_000_000.0)
    try:
        with store.scope(ANN) as tx:
            tx.commit("notes", {"rows": {"a": {"v": 1, "sz": 5}}}, ledger=_entry("r.1:1"))

        def boom(*args: Any, **kw: Any) -> None:
            raise RuntimeError("the device ledger cannot be written")

        # The device ledger is written after the records, the head and the shard's
        # ledger entry were sent: the failure is halfway through the commit.
        monkeypatch.setattr(L, "record", boom)
        before = _rows(pg_dsn)
        with store.scope(ANN) as tx:
            with pytest.raises(RuntimeError):
                tx.commit(
                    "notes",
                    {"rows": {"a": None, "b": {"v": 2, "sz": 7}}},
                    {"next": 2},
                    ledger=_entry("r.1:2"),
                )
            # Caught: the transaction goes on without any of it.
            assert tx.table("notes", "rows") == {"a": {"v": 1, "sz": 5}}
            assert tx.usage() == 5 and "next" not in tx.meta("notes")
            assert tx.find_write("notes", "dev1", "r.1:2") is None
            assert tx.device_write("dev1", "r.1:2") == L.NEW
        assert _rows(pg_dsn) == before
        # Not caught: the scope's transaction ends with nothing of it, earlier commits
        # of the same `with` included.
        with pytest.raises(RuntimeError), store.scope(ANN) as tx:
            tx.commit("notes", {"rows": {"c": {"v": 3, "sz": 1}}})
            tx.commit("notes", {"rows": {"d": {"v": 4, "sz": 1}}}, ledger=_entry("r.1:3"))
        assert _rows(pg_dsn) == before
        monkeypatch.undo()
        with store.scope(ANN) as tx:
            assert tx.table("notes", "rows") == {"a": {"v": 1, "sz": 5}}
            tx.commit("notes", {"rows": {"b": {"v": 2, "sz": 7}}}, ledger=_entry("r.1:2"))
            assert tx.usage() == 12
    finally:
        store.close()


def _entry(w: str) -> tuple[str, str, dict[str, Any]]:
    return "dev1", w, {"h": f"h-{w}", "ans": {"w": w}, "at": 1_700_000_000.0}


def _rows(dsn: str) -> dict[str, list[Any]]:
    with psycopg.connect(dsn) as conn:
        return {
            t: conn.execute(f"SELECT * FROM {t} ORDER BY 1, 2, 3").fetchall()
            for t in ("wren_mem_scopes", "wren_mem_shards", "wren_mem_records",
                      "wren_mem_writes", "wren_mem_devices")
        }  # fmt: skip


def test_data_and_the_ledgers_survive_closing_and_reopening(pg_dsn: str) -> None:
    now = [1_700_000_000.0]
    store = PgMemoryStore(pg_dsn, lambda: now[0], ledger_cap=2)
    svc = MemoryService(store, clock=lambda: now[0])
    me = Caller("acme", "dev1", "kiosk", run="0a0b0c0d.1", fields=FIELDS)
    for i in range(1, 5):
        row = {"field": "notes", "key": f"k{i}", "value": f"v{i}", "w": f"0a0b0c0d.1:{i}"}
        assert svc.handle(me, "mem.remember", row) == {"key": f"k{i}", "ver": 1}
        now[0] += 1
    assert store.ledger_evicted == 2
    store.close()
    again = PgMemoryStore(pg_dsn, lambda: now[0], ledger_cap=2)
    try:
        svc = MemoryService(again, clock=lambda: now[0])
        rows = svc.handle(me, "mem.list", {"field": "notes"})["rows"]
        assert [r["key"] for r in rows] == ["k4", "k3", "k2", "k1"]
        # The shard's ledger keeps the last two with their answers; the device's
        # ledger knows the two it let go.
        first = {"field": "notes", "key": "k1", "value": "v1", "w": "0a0b0c0d.1:1"}
        assert svc.handle(me, "mem.remember", first) == {"dup": True}
        last = {"field": "notes", "key": "k4", "value": "v4", "w": "0a0b0c0d.1:4"}
        assert svc.handle(me, "mem.remember", last) == {"key": "k4", "ver": 1}
        doc = again.device_ledger("acme", "dev1")
        assert doc["runs"]["1/0a0b0c0d"]["s"] == [[1, 4]]
    finally:
        again.close()


CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {root!r})
    from server_bridge.memory import Caller, MemoryService
    from server_bridge.memory.store import ScopeRef
    from server_bridge.pgstore.memory import PgMemoryStore
    store = PgMemoryStore(sys.argv[1])
    svc = MemoryService(store, scope_limit=1 << 30)
    fields = [{{"name": "notes", "dur": "agent", "kind": "collection", "max": 100000}}]
    me = Caller("acme", "dev1", "kiosk", run="b.1", fields=fields)
    for i in range(int(sys.argv[2]), 100000):
        row = {{"field": "notes", "key": f"k{{i}}", "value": i, "w": f"b.1:{{i + 1}}"}}
        assert svc.handle(me, "mem.remember", row) == {{"key": f"k{{i}}", "ver": 1}}
        print(i, flush=True)
        if i == int(sys.argv[3]):
            # Hold the scope's lock, as a bridge stopped mid-write does.
            with store.scope(ScopeRef("acme", "agent", "kiosk")):
                print("held", flush=True)
                time.sleep(60)
    """
)


def test_a_bridge_killed_mid_stream_loses_no_acknowledged_write_nor_holds_the_lock(
    pg_dsn: str, tmp_path: Path
) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=str(ROOT)))
    ref = ScopeRef("acme", "agent", "kiosk")
    store = PgMemoryStore(pg_dsn)
    try:
        acked = -1
        for rnd in range(3):
            hold = acked + 15 if rnd == 2 else 10**6
            child = subprocess.Popen(
                [PY, str(script), pg_dsn, str(acked + 1), str(hold)],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert child.stdout is not None
            for line in child.stdout:
                if line.strip() == "held":
                    break
                acked = int(line)
                if rnd < 2 and acked >= 10 * (rnd + 1):
                    time.sleep(0.001 * rnd)
                    break
            os.kill(child.pid, signal.SIGKILL)
            for line in child.stdout:
                if line.strip() != "held":
                    acked = int(line)
            child.wait()
            # The dead bridge's lock went with its connection.
            t0 = time.monotonic()
            with store.scope(ref) as tx:
                keys = set(tx.table("notes", "rows"))
            assert time.monotonic() - t0 < 5
            assert {f"k{i}" for i in range(acked + 1)} <= keys <= {
                f"k{i}" for i in range(acked + 2)
            }
            acked = len(keys) - 1
    finally:
        store.close()
