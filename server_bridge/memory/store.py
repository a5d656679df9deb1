"""Where durable memory lives: the persistence interface and its TinyDB default.

`MemoryStore` is a set of small documents, each a map of tables (table -> id -> record),
grouped by scope instance: a `ScopeRef` (tenant, scope, scope id) owns one *slots*
shard (its slot values, its core-memory backup, their tombstones and the ledger entries
of the writes that changed them) and one shard per collection field (its rows, their
tombstones, the ledger entries of the writes to it, a `meta` record). Every read and
write of a scope happens inside `scope(ref)`, which holds that scope's lock; a write is
`commit(shard, changes, ledger)`: all of it lands, in the file and the cache, or none.

Sharding (`TinyMemoryStore`), under one directory:

    <dir>/<tenant>/<scope>/<h[:2]>/<h>/slots.json        slots, core backup, tombstones, ledger
    <dir>/<tenant>/<scope>/<h[:2]>/<h>/c-<field>.json    one collection: rows, tombstones, ledger

with `h` the first 24 hex digits of sha256 of the scope id (ids are any strings; a hash
makes a safe, bounded file name, and the two-digit level keeps a directory to a few
thousand entries at a million scope instances). Each file records its own tenant,
scope, scope id and field, so a scan rebuilds an index from the files alone and a hash
collision is detected rather than merged.

Why this cut: TinyDB rewrites a whole file per write, so the cost of a write is the size
of its file. A file per collection per scope instance is bounded by the field's `max`
rows (4,096 by default) and the scope's byte limit, so a write rewrites at most one
field of one user (or agent, ...), never the tenant's data; a slot write rewrites only
its scope's slots. Finer (a file per row) would make listing and backlinks open
thousands of files; coarser (a file per tenant) makes every write cost the tenant's
whole memory. benchmarks/bench_memory_store.py measures it: the write cost grows with
the rows of the one collection written, not with the rows of the store.

The files are TinyDB documents (tables of documents) written by the crash-safe
`store.AtomicJSONStorage`: temp file, fsync, rename, directory fsync. Their document ids
are strings (a row's key, a slot's field name), so open one with `open_shard_db`.
Each write keeps its ledger entry in the same file as the data it changed: a crash
leaves both or neither, so a retried write is never applied twice and never answered
"done" for data that was lost.

Beside the shards, one file per device holds its per-device ledger (ledger.py):

    <dir>/<tenant>/@ledger/<d[:2]>/<d>.json      which write ids of the device were applied

with `d` the hash of the device id. It is written after the shard a write changed (so
a crash between the two leaves the id in the shard's ledger only), and an id the
shard's ledger lets go is recorded in it first if it is missing there: an applied write
id is always in one of the two.

Every parsed shard stays in memory (up to `max_scopes` scope instances, least recently
used let go): a read never parses JSON again, and a write serializes the new document,
renames it into place, and only then swaps it into the cache; records are never changed
in place, so a reader holding the old document sees a consistent one.

Locking: one lock per scope instance, covering all of its shards. A write checks the
scope's storage limit against the bytes of every shard of the scope, so the check and
the write must exclude other writes to the same scope; writes to different scopes
(different users, agents, devices) run in parallel, and their fsyncs overlap. A reader
that must not wait for a write's fsync (the bridge reading a run's state on its network
thread, service.state_seed) asks with `wait=False`: refused WouldWait instead of waiting
for the lock, and for any shard not yet in memory (the disk, a parse of up to the
ledger's 4,096 entries), which a reader that may wait then loads.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tinydb import TinyDB
from tinydb.table import Table

from server_bridge.memory import ledger as L
from server_bridge.store import AtomicJSONStorage

__all__ = [
    "LEDGER_CAP",
    "LEDGER_TTL_S",
    "WouldWait",
    "SLOTS",
    "SIZED_TABLES",
    "MemoryStore",
    "ScopeRef",
    "ScopeTxn",
    "TinyMemoryStore",
    "open_shard_db",
]

# The shard of a scope's slots and core backup; collection shards are named by their
# field, whose names are [a-z0-9_], so this cannot clash with one.
SLOTS = "@slots"

# Ledger entries live 7 days (PROTOCOL "Write ids"), as long as a scope ticket.
LEDGER_TTL_S = 7 * 24 * 3600
# At most this many ledger entries per shard, oldest let go first: the ledger is part of
# the file each write rewrites, so it must stay small next to the data. 4,096 covers a
# write every 2.5 minutes to the same shard for 7 days; past that the oldest write ids
# are forgotten early (counted in `ledger_evicted`).
LEDGER_CAP = 4096

# The tables whose records carry `sz`, the encoded bytes they hold against the scope's
# storage limit (ledger and tombstones are bookkeeping, not the scope's data).
SIZED_TABLES = ("slots", "rows", "core")

Doc = dict[str, dict[str, dict[str, Any]]]
# table -> id -> new record, or None to delete it.
Changes = Mapping[str, Mapping[str, dict[str, Any] | None]]


@dataclass(frozen=True)
class ScopeRef:
    """One scope instance: `scope` is agent, user, session, subject or tenant, and
    `scope_id` its id within the tenant (see service.py for how it is derived)."""

    tenant: str
    scope: str
    scope_id: str


@dataclass(frozen=True)
class LedgerHit:
    """A write id already applied: its content hash and, in its own shard, the answer."""

    h: str
    answer: dict[str, Any] | None


class ScopeTxn(Protocol):
    """A scope instance while its lock is held."""

    ref: ScopeRef

    def table(self, shard: str, table: str) -> Mapping[str, dict[str, Any]]:
        """A table of a shard (empty when none); records are read-only."""
        ...

    def meta(self, shard: str) -> Mapping[str, Any]: ...

    def collections(self) -> list[str]:
        """The fields with a collection shard in this scope (on disk or written)."""
        ...

    def usage(self) -> int:
        """The bytes the scope holds (`sz` of every record of SIZED_TABLES)."""
        ...

    def find_write(self, shard: str, device: str, w: str) -> LedgerHit | None: ...

    def device_write(self, device: str, w: str) -> str:
        """What the device's own ledger knows of `w`: ledger.NEW, APPLIED or STALE."""
        ...

    def commit(
        self,
        shard: str,
        changes: Changes,
        meta: Mapping[str, Any] | None = None,
        ledger: tuple[str, str, dict[str, Any]] | None = None,
    ) -> None:
        """Apply `changes` (and `meta` keys, and the ledger entry (device, w, entry))
        to `shard`, durably and atomically."""
        ...


class WouldWait(Exception):
    """`scope(ref, wait=False)` would have waited: for another thread holding the scope's
    lock, or for a shard to be read from disk."""


class MemoryStore(Protocol):
    """The persistence interface. A database-server backend implements `scope` as a
    transaction holding a row lock on the scope instance."""

    def scope(self, ref: ScopeRef, wait: bool = True) -> Any:
        """A context manager yielding the ScopeTxn of `ref`, its lock held; with `wait`
        false it raises WouldWait at once instead of waiting for another holder or for a
        shard to be read from disk."""
        ...

    def scan(self) -> Iterator[tuple[ScopeRef, str, Mapping[str, Any]]]:
        """Every shard on disk: (scope, shard name, its document), for rebuilding an index."""
        ...


class _StrIdTable(Table):
    document_id_class = str  # type: ignore[assignment]


def open_shard_db(path: str | os.PathLike[str]) -> TinyDB:
    """A shard file opened as a TinyDB database (for inspection and migration tools)."""
    db = TinyDB(path, storage=AtomicJSONStorage, create_dirs=False)
    db.table_class = _StrIdTable
    return db


def _scope_hash(scope_id: str) -> str:
    return hashlib.sha256(scope_id.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def _usage(doc: Doc) -> int:
    return sum(int(rec.get("sz", 0)) for t in SIZED_TABLES for rec in doc.get(t, {}).values())


class _Shard:
    __slots__ = ("doc", "storage", "usage")

    def __init__(self, storage: AtomicJSONStorage, doc: Doc):
        self.storage = storage
        self.doc = doc
        self.usage = _usage(doc)


class _Scope:
    __slots__ = ("complete", "dir", "lock", "ref", "shards", "users")

    def __init__(self, ref: ScopeRef, directory: Path):
        self.ref = ref
        self.dir = directory
        self.lock = threading.Lock()
        self.shards: dict[str, _Shard] = {}
        # Whether every shard on disk is loaded (needed for the scope's usage).
        self.complete = False
        # Threads inside `scope()` for it: a scope in use is never let go from the cache.
        self.users = 0


class _Device:
    """One device's ledger file, parsed; its lock guards `doc` and the file."""

    __slots__ = ("doc", "lock", "storage", "users")

    def __init__(self, storage: AtomicJSONStorage):
        self.storage = storage
        self.lock = threading.Lock()
        self.doc: dict[str, Any] | None = None  # read on first use, under `lock`
        # Threads using it: one in use is never let go (a second copy would have a
        # lock of its own, and two writers of the one file).
        self.users = 0


def _shard_file(shard: str) -> str:
    return "slots.json" if shard == SLOTS else f"c-{shard}.json"


class _Txn:
    def __init__(self, store: TinyMemoryStore, sc: _Scope, wait: bool = True):
        self.ref = sc.ref
        self._store = store
        self._sc = sc
        self._wait = wait

    def _shard(self, shard: str) -> _Shard:
        got = self._sc.shards.get(shard)
        if got is None:
            if not self._wait:
                raise WouldWait(f"shard {shard} of scope {self.ref.scope} is not in memory")
            got = self._store._load(self._sc, shard)
        return got

    def table(self, shard: str, table: str) -> Mapping[str, dict[str, Any]]:
        return self._shard(shard).doc.get(table, {})

    def meta(self, shard: str) -> Mapping[str, Any]:
        return self._shard(shard).doc.get("meta", {}).get("m", {})

    def collections(self) -> list[str]:
        self._load_all()
        return sorted(s for s in self._sc.shards if s != SLOTS)

    def usage(self) -> int:
        self._load_all()
        return sum(s.usage for s in self._sc.shards.values())

    def _load_all(self) -> None:
        if self._sc.complete:
            return
        try:
            names = os.listdir(self._sc.dir)
        except FileNotFoundError:
            names = []
        for name in names:
            if name.startswith("c-") and name.endswith(".json"):
                self._shard(name[2:-5])
        self._shard(SLOTS)
        self._sc.complete = True

    def find_write(self, shard: str, device: str, w: str) -> LedgerHit | None:
        entry = self._shard(shard).doc.get("w", {}).get(f"{device}/{w}")
        if entry is not None:
            return LedgerHit(str(entry["h"]), entry["ans"])
        # Applied to another shard: known when that shard was loaded in this process.
        seen = self._store._w_index.get((self.ref.tenant, device, w))
        return None if seen is None else LedgerHit(seen[0], None)

    def device_write(self, device: str, w: str) -> str:
        if L.parse(w) is None:
            return L.NEW
        return self._store._device_status(self.ref.tenant, device, w)

    def commit(
        self,
        shard: str,
        changes: Changes,
        meta: Mapping[str, Any] | None = None,
        ledger: tuple[str, str, dict[str, Any]] | None = None,
    ) -> None:
        self._store._commit(self._sc, self._shard(shard), shard, changes, meta, ledger)


class TinyMemoryStore:
    """`MemoryStore` on TinyDB files, one per collection per scope instance (see above)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        clock: Callable[[], float] = time.time,
        *,
        max_scopes: int = 10_000,
        ledger_cap: int = LEDGER_CAP,
    ):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self.max_scopes = max_scopes
        self.ledger_cap = ledger_cap
        self.ledger_evicted = 0
        # Guards `_scopes` and `_w_index`; never held while a file is read or written.
        self._lock = threading.Lock()
        self._scopes: OrderedDict[ScopeRef, _Scope] = OrderedDict()
        # (tenant, device, w) -> (content hash, at) of every ledger entry in a loaded
        # shard: lets a write id applied to one shard be refused `w_reused` when it comes
        # back with other content aimed at another shard.
        self._w_index: dict[tuple[str, str, str], tuple[str, float]] = {}
        self._commits = 0
        # (tenant, device) -> its ledger file, parsed; at most `max_scopes`, least
        # recently used let go (the file is the truth). Guarded by `_lock`.
        self._devices: OrderedDict[tuple[str, str], _Device] = OrderedDict()

    def ledger_path(self, tenant: str, device: str) -> Path:
        d = _scope_hash(device)
        return self.dir / tenant / "@ledger" / d[:2] / f"{d}.json"

    @contextmanager
    def _device(self, tenant: str, device: str) -> Iterator[_Device]:
        """The device's ledger, its lock held and its file read."""
        with self._lock:
            dv = self._devices.get((tenant, device))
            if dv is None:
                path = self.ledger_path(tenant, device)
                # Compact JSON: this file is rewritten with every write of the device.
                dv = self._devices[(tenant, device)] = _Device(
                    AtomicJSONStorage(path, create_dirs=False, separators=(",", ":"))
                )
                if len(self._devices) > self.max_scopes:
                    for key in [k for k, v in self._devices.items() if v.users == 0]:
                        if len(self._devices) <= self.max_scopes:
                            break
                        del self._devices[key]
            else:
                self._devices.move_to_end((tenant, device))
            dv.users += 1
        try:
            with dv.lock:
                if dv.doc is None:
                    dv.doc = dv.storage.read() or {}
                yield dv
        finally:
            with self._lock:
                dv.users -= 1

    def _device_status(self, tenant: str, device: str, w: str) -> str:
        with self._device(tenant, device) as dv:
            assert dv.doc is not None
            return L.status(dv.doc, w)

    def _device_record(self, tenant: str, device: str, w: str, at: float, *, missing: bool) -> None:
        """Record `w` as applied at `at` in the device's ledger file; with `missing`,
        only if the ledger does not know it yet (an id its shard's ledger lets go)."""
        with self._device(tenant, device) as dv:
            doc = dv.doc
            assert doc is not None
            if missing and L.status(doc, w) != L.NEW:
                return
            new = L.record(doc, w, at)
            if new is None:
                return
            new["meta"]["m"].update(tenant=tenant, device=device)
            dv.storage.path.parent.mkdir(parents=True, exist_ok=True)
            dv.storage.write(new)
            dv.doc = new

    def scope_dir(self, ref: ScopeRef) -> Path:
        h = _scope_hash(ref.scope_id)
        return self.dir / ref.tenant / ref.scope / h[:2] / h

    def shard_path(self, ref: ScopeRef, shard: str) -> Path:
        return self.scope_dir(ref) / _shard_file(shard)

    @contextmanager
    def scope(self, ref: ScopeRef, wait: bool = True) -> Iterator[ScopeTxn]:
        with self._lock:
            sc = self._scopes.get(ref)
            if sc is None:
                sc = self._scopes[ref] = _Scope(ref, self.scope_dir(ref))
            else:
                self._scopes.move_to_end(ref)
            sc.users += 1
            self._evict()
        try:
            if not sc.lock.acquire(blocking=wait):
                raise WouldWait(f"scope {ref.scope} of tenant {ref.tenant} is being written")
            try:
                yield _Txn(self, sc, wait)
            finally:
                sc.lock.release()
        finally:
            with self._lock:
                sc.users -= 1

    def _evict(self) -> None:  # under self._lock
        # The files are the truth and the cache only saves parsing: a scope nobody is
        # using can go, oldest use first, and is parsed again when next needed.
        if len(self._scopes) <= self.max_scopes:
            return
        for ref in list(self._scopes):
            if len(self._scopes) <= self.max_scopes:
                break
            if self._scopes[ref].users == 0:
                del self._scopes[ref]

    def _load(self, sc: _Scope, shard: str) -> _Shard:  # under sc.lock
        storage = AtomicJSONStorage(self.shard_path(sc.ref, shard), create_dirs=False)
        doc = storage.read() or {}
        m = doc.get("meta", {}).get("m")
        if m is not None and (m.get("scope"), m.get("scope_id")) != (sc.ref.scope, sc.ref.scope_id):
            raise ValueError(f"{storage.path} belongs to another scope instance")
        loaded = _Shard(storage, doc)
        sc.shards[shard] = loaded
        with self._lock:
            for wkey, entry in doc.get("w", {}).items():
                device, _, w = wkey.partition("/")
                self._w_index[(sc.ref.tenant, device, w)] = (str(entry["h"]), entry["at"])
        return loaded

    def _commit(
        self,
        sc: _Scope,
        sh: _Shard,
        shard: str,
        changes: Changes,
        meta: Mapping[str, Any] | None,
        ledger: tuple[str, str, dict[str, Any]] | None,
    ) -> None:  # under sc.lock
        now = self.clock()
        # Shallow copies of the tables this write changes: the cached document is left
        # as it is until the new one is on disk.
        doc: Doc = dict(sh.doc)
        delta = 0
        for table, recs in changes.items():
            t = doc[table] = dict(doc.get(table, {}))
            for rid, rec in recs.items():
                old = t.pop(rid, None)
                if table in SIZED_TABLES:
                    delta -= int(old.get("sz", 0)) if old else 0
                    delta += int(rec.get("sz", 0)) if rec else 0
                if rec is not None:
                    t[rid] = rec
        m = dict(doc.get("meta", {}).get("m", {}))
        m.update(scope=sc.ref.scope, scope_id=sc.ref.scope_id, tenant=sc.ref.tenant)
        if shard != SLOTS:
            m["field"] = shard
        m.update(meta or {})
        doc["meta"] = {"m": m}
        dropped: list[str] = []
        dropped_at: dict[str, float] = {}  # when each dropped ledger entry was written
        if ledger is not None or "w" in doc:
            wt = doc["w"] = dict(doc.get("w", {}))
            if ledger is not None:
                device, w, entry = ledger
                wt[f"{device}/{w}"] = entry
            # Expired entries go on the write that rewrites the file anyway; then the
            # oldest past the cap (dicts keep insertion order, and entries are added in
            # time order).
            dropped = [k for k, e in wt.items() if e["at"] < now - LEDGER_TTL_S]
            over = len(wt) - len(dropped) - self.ledger_cap
            if over > 0:
                gone = set(dropped)
                dropped += [k for k in wt if k not in gone][:over]
                self.ledger_evicted += over
            for k in dropped:
                dropped_at[k] = wt.pop(k)["at"]
        # An id this file's ledger lets go goes into its device's ledger first, if that
        # lacks it (a crash between the two writes of its own commit, below).
        for k in dropped:
            device, _, w = k.partition("/")
            if L.parse(w) is not None:
                self._device_record(sc.ref.tenant, device, w, dropped_at[k], missing=True)
        sh.storage.path.parent.mkdir(parents=True, exist_ok=True)
        sh.storage.write(doc)
        sh.doc = doc
        sh.usage += delta
        # The device's ledger after the data: a crash between leaves the id in this
        # file's ledger only (see the module docstring).
        if ledger is not None:
            self._device_record(sc.ref.tenant, ledger[0], ledger[1], now, missing=False)
        with self._lock:
            for k in dropped:
                device, _, w = k.partition("/")
                self._w_index.pop((sc.ref.tenant, device, w), None)
            if ledger is not None:
                self._w_index[(sc.ref.tenant, ledger[0], ledger[1])] = (
                    str(ledger[2]["h"]),
                    ledger[2]["at"],
                )
            self._commits += 1
            if self._commits % 4096 == 0:
                # Entries of shards no longer cached are pruned by age here.
                cut = now - LEDGER_TTL_S
                for key in [k for k, v in self._w_index.items() if v[1] < cut]:
                    del self._w_index[key]

    def scan(self) -> Iterator[tuple[ScopeRef, str, Mapping[str, Any]]]:
        for path in sorted(self.dir.glob("*/*/*/*/*.json")):
            if path.name.startswith("."):
                continue  # a temporary file a crash left behind
            doc = AtomicJSONStorage(path, create_dirs=False).read() or {}
            m = doc.get("meta", {}).get("m", {})
            ref = ScopeRef(str(m.get("tenant")), str(m.get("scope")), str(m.get("scope_id")))
            shard = SLOTS if path.name == "slots.json" else path.name[2:-5]
            yield ref, shard, doc
