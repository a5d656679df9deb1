"""Issue 25, item 4: a forgotten row stays forgotten, however late a replay comes.

The per-device ledger (server_bridge/memory/ledger.py) over both stores: real TinyDB files
in tmp_path (`[tiny]`) and PostgreSQL (`[pg]`), through test_memory_store's `stores`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from server_bridge.memory import Caller, MemoryFault, MemoryService, TinyMemoryStore
from server_bridge.memory import ledger as L
from server_bridge.memory.grants import ALL_FIELDS, WRITE, Grants
from server_bridge.memory.store import LEDGER_CAP
from server_bridge.store import AtomicJSONStorage
from tests import test_memory_store
from tests.test_memory_store import Stores

# The store fixtures, each test of both backends (`[tiny]`, `[pg]`).
stores = test_memory_store.stores
memory_db = test_memory_store.memory_db

FIELDS: list[dict[str, Any]] = [
    {"name": "notes", "dur": "agent", "kind": "collection", "max": 1 << 16},
    {"name": "count", "dur": "agent", "merge": "sum"},
]
BOOT = "0a0b0c0d"


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def caller(run: str = f"{BOOT}.1") -> Caller:
    return Caller(
        tenant="acme",
        device="dev1",
        agent="kiosk",
        run=run,
        fields=FIELDS,
        grants=Grants({ALL_FIELDS: WRITE}),
    )


def service(stores: Stores, clock: Clock, ledger_cap: int = LEDGER_CAP) -> MemoryService:
    """A service over a new store instance on `stores`' data (a restart)."""
    return MemoryService(stores(clock, ledger_cap=ledger_cap), clock=clock, scope_limit=1 << 26)


def remember(svc: MemoryService, run: str, seq: int, key: str, value: Any) -> dict[str, Any]:
    args = {"field": "notes", "key": key, "value": value, "w": f"{run}:{seq}"}
    return svc.handle(caller(run), "mem.remember", args)


def fault(svc: MemoryService, who: Caller, method: str, args: dict[str, Any]) -> MemoryFault:
    with pytest.raises(MemoryFault) as e:
        svc.handle(who, method, args)
    return e.value


def peek(svc: MemoryService, key: str) -> dict[str, Any] | None:
    try:
        row: dict[str, Any] = svc.handle(caller(), "mem.peek", {"field": "notes", "key": key})[
            "row"
        ]
    except MemoryFault as e:
        assert e.kind == "not_found"
        return None
    return row


REMEMBER = {"field": "notes", "key": "door", "value": "the code is 1234", "w": f"{BOOT}.1:1"}


def test_a_replay_after_the_ledger_evicted_it_brings_nothing_back(stores: Stores) -> None:
    # The report: forget, 4,100 writes to the same collection (past the 4,096 entries a
    # file's ledger keeps), then the original remember again. The writes go to eight
    # rows, not 4,100: the ledger keeps write ids whatever rows they wrote, and a file
    # of eight rows is rewritten in a fraction of the time one of thousands is.
    clock = Clock()
    svc = service(stores, clock)
    me = caller()
    assert svc.handle(me, "mem.remember", REMEMBER) == {"key": "door", "ver": 1}
    forget = {"field": "notes", "key": "door", "w": f"{BOOT}.1:2"}
    assert svc.handle(me, "mem.forget", forget) == {"key": "door", "forgotten": True}
    other = caller(f"{BOOT}.2")
    for n in range(LEDGER_CAP + 4):
        w = f"{BOOT}.2:{n + 1}"
        row = {"field": "notes", "key": f"k{n % 8}", "value": n, "w": w}
        svc.handle(other, "mem.remember", row)
        clock.now += 0.01
    assert svc.store.ledger_evicted >= 4  # type: ignore[attr-defined]
    # Answered as a write already applied, and nothing comes back.
    assert svc.handle(me, "mem.remember", REMEMBER) == {"dup": True}
    assert peek(svc, "door") is None
    # Nor after a restart, nor with the forget replayed too.
    again = service(stores, clock)
    assert again.handle(me, "mem.remember", REMEMBER) == {"dup": True}
    assert again.handle(me, "mem.forget", forget) == {"dup": True}
    assert peek(again, "door") is None


def test_the_same_with_a_small_file_ledger_and_a_new_write_after_the_forget(
    stores: Stores,
) -> None:
    # The same story in a few writes: each file's ledger keeps 8 entries here.
    clock = Clock()
    svc = service(stores, clock, ledger_cap=8)
    me = caller()
    svc.handle(me, "mem.remember", REMEMBER)
    forget = {"field": "notes", "key": "door", "w": f"{BOOT}.1:2"}
    svc.handle(me, "mem.forget", forget)
    for n in range(12):
        remember(svc, f"{BOOT}.2", n + 1, f"k{n}", n)
    assert svc.handle(me, "mem.remember", REMEMBER) == {"dup": True}
    assert svc.handle(me, "mem.forget", forget) == {"dup": True}
    assert peek(svc, "door") is None
    # Forget is no ban on the key: a new write (a later run, or the next seq of the same
    # run) makes the row again, above the forgotten version.
    assert remember(svc, f"{BOOT}.3", 1, "door", "the code is 9999") == {"key": "door", "ver": 2}
    assert svc.handle(me, "mem.forget", {**forget, "w": f"{BOOT}.1:3"})["forgotten"] is True
    assert remember(svc, f"{BOOT}.1", 4, "door", "the code is 4321") == {"key": "door", "ver": 3}
    again = service(stores, clock, ledger_cap=8)
    assert again.handle(me, "mem.remember", REMEMBER) == {"dup": True}
    row = peek(again, "door")
    assert row is not None and (row["ver"], row["value"]) == (3, "the code is 4321")


def test_a_slot_forgotten_stays_forgotten(stores: Stores) -> None:
    clock = Clock()
    svc = service(stores, clock, ledger_cap=4)
    me = caller()
    write = {"writes": [{"field": "count", "value": 5, "w": f"{BOOT}.1:1"}]}
    assert svc.handle(me, "state.commit", write)["results"][0]["ver"] == 1
    svc.handle(me, "mem.forget", {"field": "count", "w": f"{BOOT}.1:2"})
    for n in range(6):  # the slots file's ledger lets both ids go
        svc.handle(me, "mem.forget", {"field": "count", "w": f"{BOOT}.1:{n + 3}"})
    got = svc.handle(me, "state.commit", write)["results"][0]
    assert got == {"field": "count", "w": f"{BOOT}.1:1", "dup": True}
    assert svc.handle(me, "state.load", {"fields": ["count"]}) == {"values": {}, "vers": {}}


def test_a_write_id_of_a_closed_run_is_refused_w_stale(stores: Stores) -> None:
    # Past 7 days the run's seqs are let go, its boot's floor keeps it closed: a replay
    # then is refused (nothing can tell whether it was applied) and applies nothing.
    clock = Clock()
    svc = service(stores, clock)
    me = caller()
    svc.handle(me, "mem.remember", REMEMBER)
    svc.handle(me, "mem.forget", {"field": "notes", "key": "door", "w": f"{BOOT}.1:2"})
    clock.now += L.RUN_TTL_S + 60
    remember(svc, f"{BOOT}.2", 1, "other", "x")  # the write that closes run 1
    doc = stores.device_ledger(svc.store, "acme", "dev1")
    assert list(doc["runs"]) == [f"2/{BOOT}"] and doc["boots"][BOOT]["floor"] == 1
    # Every file's ledger also let the ids go by now (7 days): the device's one decides.
    for who in (svc, service(stores, clock)):
        e = fault(who, me, "mem.remember", REMEMBER)
        assert e.kind == "w_stale"
        assert peek(who, "door") is None
    # A run of the boot that never wrote before run 1 closed is closed with it.
    early = {**REMEMBER, "w": f"{BOOT}.0:1"}
    assert fault(svc, caller(f"{BOOT}.0"), "mem.remember", early).kind == "w_stale"
    # A later run is new, even after a long quiet spell of the same boot.
    clock.now += 30 * 24 * 3600
    assert remember(svc, f"{BOOT}.3", 1, "door", "new") == {"key": "door", "ver": 2}


def test_a_boot_closes_after_the_device_booted_again(stores: Stores) -> None:
    clock = Clock()
    svc = service(stores, clock)
    remember(svc, "aaaa0001.1", 1, "a", 1)
    clock.now += 60
    remember(svc, "bbbb0002.1", 1, "b", 1)  # the device booted again
    clock.now += L.RUN_TTL_S + 60
    remember(svc, "bbbb0002.2", 1, "b", 2)
    doc = stores.device_ledger(svc.store, "acme", "dev1")
    assert list(doc["closed"]) == ["aaaa0001"] and list(doc["boots"]) == ["bbbb0002"]
    for run in ("aaaa0001.1", "aaaa0001.7"):  # any run of a closed boot
        args = {"field": "notes", "key": "a", "value": 1, "w": f"{run}:1"}
        assert fault(svc, caller(run), "mem.remember", args).kind == "w_stale"
    # The latest boot is never closed: its next run, however late, is new.
    clock.now += 90 * 24 * 3600
    assert remember(svc, "bbbb0002.3", 1, "b", 3)["ver"] == 3
    assert remember(svc, "cccc0003.1", 1, "c", 1)["ver"] == 1


def test_an_id_the_device_ledger_missed_is_recorded_before_its_file_lets_it_go(
    stores: Stores,
) -> None:
    # A crash between the shard's rename and the device ledger's leaves the id in the
    # shard's ledger only: the device ledger file is lost here the same way.
    clock = Clock()
    svc = service(stores, clock, ledger_cap=4)
    me = caller()
    svc.handle(me, "mem.remember", REMEMBER)
    svc.handle(me, "mem.forget", {"field": "notes", "key": "door", "w": f"{BOOT}.1:2"})
    stores.lose_device_ledger(svc.store, "acme", "dev1")
    svc = service(stores, clock, ledger_cap=4)
    for n in range(6):
        remember(svc, f"{BOOT}.2", n + 1, f"k{n}", n)
    assert svc.handle(me, "mem.remember", REMEMBER) == {"dup": True}
    assert peek(svc, "door") is None


def test_the_ledger_keeps_exact_seqs_and_its_bounds() -> None:
    doc: dict[str, Any] = {}
    for seq in (1, 2, 4, 3, 7):  # out of order, with a hole at 5 and 6
        got = L.record(doc, f"b.1:{seq}", 0.0)
        assert got is not None
        doc = got
    assert doc["runs"]["1/b"]["s"] == [[1, 4], [7, 7]]
    assert [L.status(doc, f"b.1:{s}") for s in (1, 4, 5, 6, 7, 8)] == [
        L.APPLIED, L.APPLIED, L.NEW, L.NEW, L.APPLIED, L.NEW,
    ]  # fmt: skip
    assert L.status(doc, "b.2:1") == L.NEW and L.status(doc, "c.1:1") == L.NEW
    assert L.record(doc, "no-seq", 0.0) is None and L.status(doc, "no-seq") == L.NEW
    assert L.parse("0a0b0c0d.12:3") == ("0a0b0c0d", 12, 3)
    assert L.parse("r7:1") == ("r7", 0, 1) and L.parse("a:b") is None
    # Past the ranges cap the runs written longest ago close early (counted) and stay
    # closed; past the closed-boots cap the oldest boot ids go (counted).
    for n in range(2, 6):
        got = L.record(doc, f"b.{n}:1", float(n), ranges_cap=3, closed_cap=2)
        assert got is not None
        doc = got
    assert sorted(doc["runs"]) == ["3/b", "4/b", "5/b"]
    assert doc["meta"]["m"]["closed_early"] == 2
    assert L.status(doc, "b.1:5") == L.STALE and L.status(doc, "b.2:1") == L.STALE
    t = 0.0
    for boot in ("c", "d", "e", "f"):
        t += L.RUN_TTL_S + 1
        got = L.record(doc, f"{boot}.1:1", t, closed_cap=2)
        assert got is not None
        doc = got
    assert list(doc["closed"]) == ["d", "e"] and doc["meta"]["m"]["closed_dropped"] == 2
    assert L.status(doc, "d.9:1") == L.STALE and L.status(doc, "f.1:1") == L.APPLIED


def test_ledger_file_size_at_its_bounds(tmp_path: Path) -> None:
    # The figure in ledger.py's docstring: a device at both caps, in bytes on disk.
    doc: dict[str, Any] = {}
    for b in range(L.CLOSED_CAP):
        doc["closed"] = {**doc.get("closed", {}), f"{b:08x}": {"at": 1_700_000_000 + b}}
    t = 1_800_000_000.0
    for n in range(L.RANGES_CAP):
        got = L.record(doc, f"ffffffff.{n + 1000}:{n % 40 + 1}", t + n)
        assert got is not None
        doc = got
    store = TinyMemoryStore(tmp_path, lambda: t)
    path = store.ledger_path("acme", "dev1")
    path.parent.mkdir(parents=True)
    AtomicJSONStorage(path, create_dirs=False, separators=(",", ":")).write(doc)
    size = path.stat().st_size
    print(f"device ledger at its caps: {size} bytes")
    assert size < 320 * 1024  # 313,636 bytes when measured
