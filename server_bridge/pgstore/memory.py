"""Durable memory on PostgreSQL: `PgMemoryStore`, the `MemoryStore` several bridges share.

It keeps what `TinyMemoryStore` (server_bridge/memory/store.py) keeps, with the same
observable rules: shards of tables of records per scope instance, each shard's write-id
ledger capped at `ledger_cap` entries and LEDGER_TTL_S (oldest let go first, counted in
`ledger_evicted`, and recorded in its device's ledger first if that lacks it), the
per-device ledger of ledger.py, `usage()` over SIZED_TABLES, `scan()` of every shard.

Tables (migrations/0002_memory.sql):

    wren_mem_scopes    (tenant, scope, scope_id) -> sid, ver     one row per scope instance
    wren_mem_shards    (sid, shard) -> meta, usage, nw, w_min_at the shard's head
    wren_mem_records   (sid, shard, tbl, id) -> n, rec           every record of every table
    wren_mem_writes    (tenant, device, w, sid, shard) -> n, at, entry   shard ledgers
    wren_mem_devices   (tenant, device) -> ver, doc              per-device ledgers

Why this cut: a record per row, not a document per shard. TinyDB rewrites a whole file
per write, so its shards are kept small; here a write touches the rows it changes (an
upsert each), the shard's head and one ledger row, whatever the size of the collection,
so a collection's `max` is a policy, not a cost. The head keeps what a write must know
without reading the rows (the bytes the shard holds, its ledger's count and oldest
entry), and the ledger's key starts with (tenant, device, w), so a write id is found
whatever shard it went to, not only in shards this process has read. The per-device
ledger stays one document per device, read and written by ledger.py's own functions, as
the file it is in the TinyDB store. Values are JSON text, not jsonb: the text Python's
json wrote, as a shard file holds it (see the migration).

Concurrency is the database's. `scope(ref)` is one transaction holding a transaction-
level advisory lock keyed by the scope instance (pg_try_advisory_xact_lock for
`wait=False`, refused WouldWait at once); every bridge process takes the same lock
before it reads or writes the scope, and the database releases it at the transaction's
end, or when a dead bridge's connection goes. An advisory lock rather than a row lock
(`SELECT ... FOR UPDATE`): locking a row is a write (it needs the row to exist, so a
read of a new scope would insert one, and its transaction's commit waits for a WAL
flush), while a reader here writes nothing. A device's ledger is locked the same way by
the write that reads it (`device_write`) until that write's transaction ends, so one
write id of a device is applied once even when two bridges get it for two scopes.

`commit` runs in a savepoint of the scope's transaction: all of it (records, head,
ledger entry, entries let go, device ledgers, the scope's `ver`) or none. It is durable
when `scope()` exits: an exception out of the `with` block rolls back every commit made
in it, where the TinyDB store would keep the commits made before the exception.

Each process keeps the scopes it read (up to `max_scopes`, least recently used let go)
and the device ledgers, tagged with the `ver` they were read at; a transaction that
finds `ver` unchanged under the lock uses them, else reads again. So a scope served by
one bridge costs one round trip to lock and check, and `wait=False` refuses (WouldWait)
what it would have to read, as the TinyDB store refuses a shard not in memory.

psycopg's pipeline mode sends a transaction's statements together and waits only where
a result is needed (the lock and the scope's ver, a ledger lookup, the entries a commit
lets go). Measured by benchmarks/bench_store_pg.py (fsync on for both, a shared 2-core
machine, 1,000 calls of each through MemoryService): a `mem.remember` p50 of 1.9 ms at
10k rows and 2.4 ms at 100k, against TinyDB's 2.7 and 2.5 (the disk's flush dominates
both); a `mem.peek` 0.8-1.0 ms against TinyDB's 0.03-0.05 from its cache, since each of
the peek's two scope locks is a round trip to the database: the price of sharing it.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from server_bridge.memory import ledger as L
from server_bridge.memory.store import (
    LEDGER_CAP,
    LEDGER_TTL_S,
    SIZED_TABLES,
    SLOTS,
    Changes,
    LedgerHit,
    ScopeRef,
    ScopeTxn,
    WouldWait,
)
from server_bridge.pgstore.connect import POOL_MAX, store_pool

__all__ = ["PgMemoryStore"]

# How long `wait=False` waits for a free pooled connection: a reader that must not wait
# is refused rather than queued behind the pool's other users.
NOWAIT_POOL_S = 0.01
# A record's write order is (the scope's ver << _N_SHIFT) + its place in the commit: a
# commit changes far fewer than 2**20 records (two tables of a field's `max` at most).
_N_SHIFT = 20

Json = dict[str, Any]

# Text in PostgreSQL holds neither NUL nor a lone surrogate, which a Python str (a key
# from a board, a write id) may: those, and `%` itself, are written %00, %uD800, %25.
_ODD = re.compile("[%\x00\ud800-\udfff]")
_ESC = re.compile(r"%(25|00|u[0-9A-F]{4})")


def _enc(s: str) -> str:
    if _ODD.search(s) is None:
        return s

    def one(m: re.Match[str]) -> str:
        c = m[0]
        return "%25" if c == "%" else "%00" if c == "\x00" else f"%u{ord(c):04X}"

    return _ODD.sub(one, s)


def _dec(s: str) -> str:
    if "%" not in s:
        return s

    def one(m: re.Match[str]) -> str:
        code = m[1]
        return "%" if code == "25" else "\x00" if code == "00" else chr(int(code[1:], 16))

    return _ESC.sub(one, s)


def _dumps(value: Any) -> str:
    # ensure_ascii: a lone surrogate leaves as an escape, never as text PostgreSQL refuses.
    return json.dumps(value, separators=(",", ":"))


def _lock_keys(kind: str, *parts: str) -> tuple[int, int]:
    """The two int4 keys of pg_advisory_xact_lock(int, int) for a scope or a device: 64
    bits of sha256, in the two-key space (apart from migrate's one-bigint key)."""
    text = "\x00".join((kind, *parts)).encode("utf-8", "surrogatepass")
    d = hashlib.sha256(text).digest()
    return int.from_bytes(d[:4], "big", signed=True), int.from_bytes(d[4:8], "big", signed=True)


@dataclass(frozen=True)
class _Head:
    """A shard's row of wren_mem_shards."""

    meta: Json
    usage: int
    nw: int  # ledger entries
    wmin: float | None  # a lower bound of their `at`: none is older


class _Scope:
    """What this process holds of a scope instance, valid while the database's `ver`
    is `ver` (None: nothing held). Changed only by a transaction that holds the lock."""

    __slots__ = ("heads", "lock", "ref", "sid", "tables", "users", "ver")

    def __init__(self, ref: ScopeRef):
        self.ref = ref
        # Threads of this process take turns before asking the database: a waiting
        # thread holds no pooled connection, and `wait=False` is refused without one.
        self.lock = threading.Lock()
        self.users = 0
        self.ver: int | None = None
        self.sid: int | None = None
        self.heads: dict[str, _Head] | None = None
        self.tables: dict[tuple[str, str], dict[str, Json]] = {}


_SCOPE_ROW = (
    "SELECT sid, ver FROM wren_mem_scopes WHERE tenant = %s AND scope = %s AND scope_id = %s"
)
_DEVICE_ROW = (
    "SELECT ver, CASE WHEN ver = %s THEN NULL ELSE doc END FROM wren_mem_devices"
    " WHERE tenant = %s AND device = %s"
)
_PUT_RECORDS = (
    "INSERT INTO wren_mem_records (sid, shard, tbl, id, n, rec)"
    " SELECT %s, %s, t.tbl, t.id, %s + t.i, t.rec"
    " FROM unnest(%s::text[], %s::text[], %s::text[]) WITH ORDINALITY AS t(tbl, id, rec, i)"
    " ON CONFLICT (sid, shard, tbl, id) DO UPDATE SET n = EXCLUDED.n, rec = EXCLUDED.rec"
)
_DROP_RECORDS = (
    "DELETE FROM wren_mem_records WHERE sid = %s AND shard = %s"
    " AND (tbl, id) IN (SELECT * FROM unnest(%s::text[], %s::text[]))"
)
# RETURNING xmax = 0: true when the row was inserted, false when an entry of the same
# write id was replaced (it keeps its place in the ledger's order, as a dict key does).
_PUT_WRITE = (
    "INSERT INTO wren_mem_writes (tenant, device, w, sid, shard, n, at, entry)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"
    " ON CONFLICT (tenant, device, w, sid, shard)"
    " DO UPDATE SET at = EXCLUDED.at, entry = EXCLUDED.entry RETURNING xmax = 0"
)
_DROP_EXPIRED = (
    "DELETE FROM wren_mem_writes WHERE sid = %s AND shard = %s AND at < %s"
    " RETURNING n, device, w, at"
)
_DROP_OLDEST = (
    "DELETE FROM wren_mem_writes WHERE (tenant, device, w, sid, shard) IN ("
    " SELECT tenant, device, w, sid, shard FROM wren_mem_writes"
    " WHERE sid = %s AND shard = %s ORDER BY n LIMIT %s)"
    " RETURNING n, device, w, at"
)
_PUT_HEAD = (
    "INSERT INTO wren_mem_shards (sid, shard, meta, usage, nw, w_min_at)"
    " VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (sid, shard) DO UPDATE SET"
    " meta = EXCLUDED.meta, usage = EXCLUDED.usage, nw = EXCLUDED.nw,"
    " w_min_at = EXCLUDED.w_min_at"
)
_PUT_DEVICE = (
    "INSERT INTO wren_mem_devices (tenant, device, ver, doc) VALUES (%s, %s, %s, %s)"
    " ON CONFLICT (tenant, device) DO UPDATE SET ver = EXCLUDED.ver, doc = EXCLUDED.doc"
)
_SCAN = """
SELECT s.tenant, s.scope, s.scope_id, h.shard, h.meta, rr.t, rr.i, rr.r, ww.d, ww.w, ww.e
FROM wren_mem_shards h JOIN wren_mem_scopes s ON s.sid = h.sid
LEFT JOIN LATERAL (
    SELECT array_agg(tbl ORDER BY n) AS t, array_agg(id ORDER BY n) AS i,
           array_agg(rec ORDER BY n) AS r
    FROM wren_mem_records r WHERE r.sid = h.sid AND r.shard = h.shard) rr ON true
LEFT JOIN LATERAL (
    SELECT array_agg(device ORDER BY n) AS d, array_agg(w ORDER BY n) AS w,
           array_agg(entry ORDER BY n) AS e
    FROM wren_mem_writes x WHERE x.sid = h.sid AND x.shard = h.shard) ww ON true
ORDER BY s.tenant, s.scope, s.scope_id, h.shard
"""


class _Txn:
    """A scope instance inside its transaction, its lock held (the `ScopeTxn`)."""

    def __init__(self, store: PgMemoryStore, sc: _Scope, conn: Any, wait: bool):
        self.ref = sc.ref
        self._store = store
        self._conn = conn
        self._wait = wait
        self._tenant = _enc(sc.ref.tenant)
        k1, k2 = _lock_keys("scope", sc.ref.tenant, sc.ref.scope, sc.ref.scope_id)
        if wait:
            conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (k1, k2))
            took = None
        else:
            took = conn.execute("SELECT pg_try_advisory_xact_lock(%s, %s)", (k1, k2))
        # A statement of its own, after the lock: it reads what the last holder committed.
        cur = conn.execute(_SCOPE_ROW, (self._tenant, sc.ref.scope, _enc(sc.ref.scope_id)))
        if took is not None and not took.fetchone()[0]:
            raise WouldWait(f"scope {sc.ref.scope} of tenant {sc.ref.tenant} is being written")
        row = cur.fetchone()
        self.sid: int | None = None if row is None else int(row[0])
        self.ver: int = 0 if row is None else int(row[1])
        if sc.ver is not None and (sc.ver, sc.sid) == (self.ver, self.sid):
            self.heads = sc.heads
            self.tables = dict(sc.tables)
        else:
            # Nothing held is current: a scope never written has no shards to read.
            self.heads = {} if self.sid is None else None
            self.tables = {}
        # device -> (its row's ver when read, the document now) of the device ledgers
        # this transaction locked.
        self.devices: dict[str, tuple[int, Json]] = {}
        self.evicted = 0

    # ------------------------------------------------------------------ reads

    def _heads(self) -> dict[str, _Head]:
        if self.heads is None:
            if not self._wait:
                raise WouldWait(f"scope {self.ref.scope} is not in memory")
            rows = self._conn.execute(
                "SELECT shard, meta, usage, nw, w_min_at FROM wren_mem_shards WHERE sid = %s",
                (self.sid,),
            ).fetchall()
            self.heads = {
                shard: _Head(json.loads(meta), int(usage), int(nw), wmin)
                for shard, meta, usage, nw, wmin in rows
            }
        return self.heads

    def table(self, shard: str, table: str) -> Mapping[str, Json]:
        if table == "meta":
            head = self._heads().get(shard)
            return {} if head is None else {"m": head.meta}
        if table == "w":
            return self._ledger(shard)
        got = self.tables.get((shard, table))
        if got is not None:
            return got
        if shard not in self._heads():
            got = {}
        else:
            if not self._wait:
                raise WouldWait(f"shard {shard} of scope {self.ref.scope} is not in memory")
            rows = self._conn.execute(
                "SELECT id, rec FROM wren_mem_records WHERE sid = %s AND shard = %s"
                " AND tbl = %s ORDER BY n",
                (self.sid, shard, table),
            ).fetchall()
            got = {_dec(rid): json.loads(rec) for rid, rec in rows}
        self.tables[(shard, table)] = got
        return got

    def _ledger(self, shard: str) -> dict[str, Json]:
        # The ledger is not held in memory (find_write asks the database by key).
        if not self._wait:
            raise WouldWait(f"the ledger of {shard} is not in memory")
        if self.sid is None:
            return {}
        rows = self._conn.execute(
            "SELECT device, w, entry FROM wren_mem_writes WHERE sid = %s AND shard = %s ORDER BY n",
            (self.sid, shard),
        ).fetchall()
        return {f"{_dec(d)}/{_dec(w)}": json.loads(e) for d, w, e in rows}

    def meta(self, shard: str) -> Mapping[str, Any]:
        head = self._heads().get(shard)
        return {} if head is None else head.meta

    def collections(self) -> list[str]:
        return sorted(s for s in self._heads() if s != SLOTS)

    def usage(self) -> int:
        return sum(h.usage for h in self._heads().values())

    def find_write(self, shard: str, device: str, w: str) -> LedgerHit | None:
        row = self._conn.execute(
            "SELECT entry, sid = %s AND shard = %s AS here FROM wren_mem_writes"
            " WHERE tenant = %s AND device = %s AND w = %s ORDER BY here DESC LIMIT 1",
            (self.sid, shard, self._tenant, _enc(device), _enc(w)),
        ).fetchone()
        if row is None:
            return None
        entry = json.loads(row[0])
        # Applied to another shard: the hash, not the answer (as the TinyDB store).
        return LedgerHit(str(entry["h"]), entry["ans"] if row[1] else None)

    def device_write(self, device: str, w: str) -> str:
        if L.parse(w) is None:
            return L.NEW
        return L.status(self._device(device), w)

    def _device(self, device: str) -> Json:
        """The device's ledger, locked until this transaction ends."""
        got = self.devices.get(device)
        if got is not None:
            return got[1]
        conn = self._conn
        k1, k2 = _lock_keys("device", self.ref.tenant, device)
        if self._wait:
            conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (k1, k2))
            took = None
        else:
            took = conn.execute("SELECT pg_try_advisory_xact_lock(%s, %s)", (k1, k2))
        cached = self._store._device_cached(self.ref.tenant, device)
        cur = conn.execute(_DEVICE_ROW, (cached[0] if cached else -1, self._tenant, _enc(device)))
        if took is not None and not took.fetchone()[0]:
            raise WouldWait(f"the ledger of device {device} is being written")
        row = cur.fetchone()
        if row is None:
            ver, doc = 0, {}
        elif row[1] is None and cached is not None:
            ver, doc = int(row[0]), cached[1]
        else:
            ver, doc = int(row[0]), json.loads(row[1])
        self.devices[device] = (ver, doc)
        return doc

    def _device_record(
        self, device: str, w: str, at: float, changed: set[str], *, missing: bool
    ) -> None:
        """Record `w` as applied at `at` in the device's ledger (in memory, added to
        `changed`); with `missing`, only if the ledger does not know it yet."""
        if missing and device not in self.devices:
            # A write id once applied or stale stays so (ledger.py), so a copy read
            # earlier that knows it is enough, and the device is then not locked: the
            # ids a shard lets go are nearly always known to their device already (it
            # was recorded in the same transaction). Locking another device while this
            # write holds its own could meet a write holding them the other way round;
            # PostgreSQL then ends one of the two with a deadlock error (retryable).
            cached = self._store._device_cached(self.ref.tenant, device)
            if cached is not None and L.status(cached[1], w) != L.NEW:
                return
        doc = self._device(device)
        if missing and L.status(doc, w) != L.NEW:
            return
        new = L.record(doc, w, at)
        if new is None:
            return
        new["meta"]["m"].update(tenant=self.ref.tenant, device=device)
        self.devices[device] = (self.devices[device][0], new)
        changed.add(device)

    # ------------------------------------------------------------------ commit

    def commit(
        self,
        shard: str,
        changes: Changes,
        meta: Mapping[str, Any] | None = None,
        ledger: tuple[str, str, Json] | None = None,
    ) -> None:
        st = self._store
        now = st.clock()
        heads = self._heads()
        head = heads.get(shard)
        # Everything is encoded before the database sees any of it: a value JSON cannot
        # hold fails here, with nothing sent.
        put_t: list[str] = []
        put_i: list[str] = []
        put_r: list[str] = []
        drop_t: list[str] = []
        drop_i: list[str] = []
        tables: dict[tuple[str, str], dict[str, Json]] = {}
        delta = 0
        for table, recs in changes.items():
            # A sized table is read for the bytes its old records held; another is
            # changed in memory only if it was read (else it is read when needed).
            cur = (
                self.table(shard, table)
                if table in SIZED_TABLES
                else self.tables.get((shard, table))
            )
            t = None if cur is None else dict(cur)
            for rid, rec in recs.items():
                old = None if cur is None else cur.get(rid)
                if table in SIZED_TABLES:
                    delta -= int(old.get("sz", 0)) if old else 0
                    delta += int(rec.get("sz", 0)) if rec else 0
                if t is not None:
                    t.pop(rid, None)
                if rec is None:
                    drop_t.append(table)
                    drop_i.append(_enc(rid))
                else:
                    put_t.append(table)
                    put_i.append(_enc(rid))
                    put_r.append(_dumps(rec))
                    if t is not None:
                        t[rid] = rec
            if t is not None:
                tables[(shard, table)] = t
        m = dict(head.meta) if head is not None else {}
        m.update(scope=self.ref.scope, scope_id=self.ref.scope_id, tenant=self.ref.tenant)
        if shard != SLOTS:
            m["field"] = shard
        m.update(meta or {})
        meta_text = _dumps(m)
        entry_text = None if ledger is None else _dumps(ledger[2])
        entry_at = None if ledger is None else float(ledger[2]["at"])

        conn = self._conn
        devices = dict(self.devices)
        changed: set[str] = set()
        evicted = 0
        # A savepoint: a failure below leaves nothing of this commit, and the commits
        # made before it in this transaction stand.
        with conn.transaction():
            sid = self.sid
            if sid is None:
                sid = int(
                    conn.execute(
                        "INSERT INTO wren_mem_scopes (tenant, scope, scope_id) VALUES (%s, %s, %s)"
                        " RETURNING sid",
                        (self._tenant, self.ref.scope, _enc(self.ref.scope_id)),
                    ).fetchone()[0]
                )
            ver = self.ver + 1
            base = ver << _N_SHIFT
            if put_t:
                conn.execute(_PUT_RECORDS, (sid, shard, base, put_t, put_i, put_r))
            if drop_t:
                conn.execute(_DROP_RECORDS, (sid, shard, drop_t, drop_i))
            nw = 0 if head is None else head.nw
            wmin = None if head is None else head.wmin
            dropped: list[tuple[str, str, float]] = []
            if ledger is not None or nw > 0:
                if ledger is not None and entry_at is not None:
                    device, w, _ = ledger
                    fresh = conn.execute(
                        _PUT_WRITE,
                        (self._tenant, _enc(device), _enc(w), sid, shard, base, entry_at,
                         entry_text),
                    ).fetchone()[0]  # fmt: skip
                    nw += 1 if fresh else 0
                    wmin = entry_at if wmin is None else min(wmin, entry_at)
                # Expired entries go first, then the oldest past the cap (as the TinyDB
                # store: entries are added in time order, and `n` is that order).
                cut = now - LEDGER_TTL_S
                if wmin is not None and wmin < cut:
                    rows = conn.execute(_DROP_EXPIRED, (sid, shard, cut)).fetchall()
                    nw -= len(rows)
                    dropped += [(d, w, at) for _, d, w, at in sorted(rows)]
                    wmin = conn.execute(
                        "SELECT min(at) FROM wren_mem_writes WHERE sid = %s AND shard = %s",
                        (sid, shard),
                    ).fetchone()[0]
                over = nw - st.ledger_cap
                if over > 0:
                    rows = conn.execute(_DROP_OLDEST, (sid, shard, over)).fetchall()
                    nw -= len(rows)
                    evicted = len(rows)
                    dropped += [(d, w, at) for _, d, w, at in sorted(rows)]
            try:
                # An id the shard's ledger lets go goes into its device's ledger if that
                # lacks it, in this same transaction.
                for d, w, at in dropped:
                    if L.parse(_dec(w)) is not None:
                        self._device_record(_dec(d), _dec(w), at, changed, missing=True)
                if ledger is not None:
                    self._device_record(ledger[0], ledger[1], now, changed, missing=False)
                for device in sorted(changed):
                    dver, doc = self.devices[device]
                    conn.execute(_PUT_DEVICE, (self._tenant, _enc(device), dver + 1, _dumps(doc)))
                new_head = _Head(m, (0 if head is None else head.usage) + delta, nw, wmin)
                conn.execute(_PUT_HEAD, (sid, shard, meta_text, new_head.usage, nw, wmin))
                conn.execute("UPDATE wren_mem_scopes SET ver = %s WHERE sid = %s", (ver, sid))
            except BaseException:
                # What this commit changed of the device ledgers goes with its savepoint
                # (and so do the locks it took).
                self.devices = devices
                raise
        # Landed (in the transaction): the view of the rest of it.
        for device in changed:
            dver, doc = self.devices[device]
            self.devices[device] = (dver + 1, doc)
        self.sid, self.ver = sid, ver
        self.heads = {**heads, shard: new_head}
        self.tables.update(tables)
        self.evicted += evicted


class PgMemoryStore:
    """`MemoryStore` on PostgreSQL (see above). `dsn_or_pool`: a libpq connection string
    (the store opens a pool of its own, closed by `close()`) or a psycopg_pool pool the
    caller owns. The schema is brought up to date on open."""

    def __init__(
        self,
        dsn_or_pool: str | Any,
        clock: Callable[[], float] = time.time,
        *,
        max_scopes: int = 10_000,
        ledger_cap: int = LEDGER_CAP,
        pool_size: int = POOL_MAX,
    ):
        self._pool, self._own_pool = store_pool(dsn_or_pool, max_size=pool_size)
        self.clock = clock
        self.max_scopes = max_scopes
        self.ledger_cap = ledger_cap
        self.ledger_evicted = 0
        # Guards `_scopes`, `_devices` and `ledger_evicted`; never held over a query.
        self._lock = threading.Lock()
        self._scopes: OrderedDict[ScopeRef, _Scope] = OrderedDict()
        # (tenant, device) -> (row ver, document) of device ledgers read: at most
        # `max_scopes`, least recently used let go (the database is the truth).
        self._devices: OrderedDict[tuple[str, str], tuple[int, Json]] = OrderedDict()

    def close(self) -> None:
        if self._own_pool:
            self._pool.close()

    def __enter__(self) -> PgMemoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def device_ledger(self, tenant: str, device: str) -> Json:
        """The device's ledger document as stored (empty when none): for inspection."""
        with self._pool.connection() as conn:
            row = conn.execute(
                "SELECT doc FROM wren_mem_devices WHERE tenant = %s AND device = %s",
                (_enc(tenant), _enc(device)),
            ).fetchone()
        return {} if row is None else dict(json.loads(row[0]))

    def _device_cached(self, tenant: str, device: str) -> tuple[int, Json] | None:
        with self._lock:
            return self._devices.get((tenant, device))

    @contextmanager
    def scope(self, ref: ScopeRef, wait: bool = True) -> Iterator[ScopeTxn]:
        with self._lock:
            sc = self._scopes.get(ref)
            if sc is None:
                sc = self._scopes[ref] = _Scope(ref)
            else:
                self._scopes.move_to_end(ref)
            sc.users += 1
            self._evict()
        try:
            if not sc.lock.acquire(blocking=wait):
                raise WouldWait(f"scope {ref.scope} of tenant {ref.tenant} is being written")
            try:
                with self._transaction(sc, wait) as txn:
                    yield txn
            finally:
                sc.lock.release()
        finally:
            with self._lock:
                sc.users -= 1

    @contextmanager
    def _transaction(self, sc: _Scope, wait: bool) -> Iterator[_Txn]:
        if wait:
            conn = self._pool.getconn()
        else:
            try:
                conn = self._pool.getconn(timeout=NOWAIT_POOL_S)
            except Exception as e:  # psycopg_pool.PoolTimeout
                raise WouldWait("no free connection to the database") from e
        txn: _Txn | None = None
        entered = 0
        try:
            with conn.pipeline():
                txn = _Txn(self, sc, conn, wait)
                entered = txn.ver
                yield txn
                conn.commit()
        except BaseException:
            if txn is not None and txn.ver != entered:
                # It wrote, and none of it landed: what this process held of the scope
                # may be ahead of the database now.
                sc.ver = None
            try:
                conn.rollback()
            except Exception:
                pass  # a broken connection: the pool discards it
            raise
        finally:
            self._pool.putconn(conn)
        sc.ver, sc.sid, sc.heads, sc.tables = txn.ver, txn.sid, txn.heads, txn.tables
        with self._lock:
            self.ledger_evicted += txn.evicted
            for device, held in txn.devices.items():
                key = (sc.ref.tenant, device)
                self._devices[key] = held
                self._devices.move_to_end(key)
            while len(self._devices) > self.max_scopes:
                self._devices.popitem(last=False)

    def _evict(self) -> None:  # under self._lock
        # The database is the truth: a scope nobody here is using can go, oldest use
        # first, and is read again when next needed.
        if len(self._scopes) <= self.max_scopes:
            return
        for ref in list(self._scopes):
            if len(self._scopes) <= self.max_scopes:
                break
            if self._scopes[ref].users == 0:
                del self._scopes[ref]

    def scan(self) -> Iterator[tuple[ScopeRef, str, Mapping[str, Any]]]:
        """Every shard, from one snapshot of the database (a server-side cursor, so a
        large store is read a batch at a time)."""
        with self._pool.connection() as conn:
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            with conn.cursor(name="wren_mem_scan") as cur:
                cur.itersize = 64
                cur.execute(_SCAN)
                for tenant, scope, scope_id, shard, meta, t, i, r, d, w, e in cur:
                    doc: dict[str, dict[str, Any]] = {"meta": {"m": json.loads(meta)}}
                    for tbl, rid, rec in zip(t or [], i or [], r or [], strict=True):
                        doc.setdefault(tbl, {})[_dec(rid)] = json.loads(rec)
                    if d:
                        doc["w"] = {
                            f"{_dec(dv)}/{_dec(wv)}": json.loads(ev)
                            for dv, wv, ev in zip(d, w, e, strict=True)
                        }
                    ref = ScopeRef(_dec(tenant), scope, _dec(scope_id))
                    yield ref, shard, doc
