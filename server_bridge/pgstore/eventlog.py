"""The durable event log on PostgreSQL: `PgEventLog`, the log several bridges share.

It answers as `EventLog` (server_bridge/eventlog/log.py) does: `append`, `events`,
`run`, `conversations`, `runs_of`, `tenants`, `tenant_bytes`, `retain`, `sync`,
`close`, with the same records (`LoggedEvent`, `LoggedRun`) and refusals
(`EventLogError`, `RecordTooLarge`), so the bridge and the HTTP API take either.

Tables (migrations/0004_eventlog.sql):

    wren_events         (tenant, device, run, i) -> at_ms, rec    one row per event
    wren_event_runs     (tenant, device, run) -> usr, conv, ids, count, times, bytes
    wren_event_tenants  tenant -> bytes

`rec` is the msgpack record the file log frames on disk, `[ts_ms, device, run, i, usr,
conv, payload]`, as bytea. The runs table is what the file log's in-memory index
holds, kept in the transaction that inserts the events, so "events of run R after id
X" is a range of the primary key, and a run's span and a conversation's runs are
rows, not scans.

Once only. `(tenant, device, run, i)` is the primary key and a flush inserts with ON
CONFLICT DO NOTHING: an event that is already there is not stored again, whichever
bridge relays it (two bridges during a failover, one after a board's replay). The
first to commit is kept: an append under an id the log already holds, with another
payload, is dropped without an error (counted in `duplicates`), and reads go on
returning the first. Counts, bytes and a run's ids count each event once. A
conversation's runs are in the order they joined it and conversations the most
recently flushed first, by a sequence the database hands out (file log: append
order); a run's events come in id order (file log: append order, the same for a
bridge that appends a run in order).

Appends are queued, not written. `append` checks and encodes the record (what would be
refused is refused there, by name, and nothing is queued) and puts it on a bounded
in-memory queue; one thread writes the queue in batches, a multi-row INSERT per batch
in one transaction, when `batch_events` are waiting or `flush_s` after the first of
them, whichever comes first. A full queue (`queue_events` records or `queue_bytes`
bytes, the database behind or away) refuses the append with `LogBehind`, an
EventLogError, as a full disk makes the file log refuse: the bridge counts it and
hosts see a gap at their next replay, and the relay is not held up. A batch the
database cannot take for a lost connection stays at the head of the queue and is
written again once a new connection is made; one it refuses for a record is split
and only that record is dropped (counted in `dropped`, logged).

Durability and the loss window. Once a batch commits it is the server's (fsync on and
synchronous_commit on: a power cut of the database loses nothing committed). Until
then it is in this process only: a crash of the bridge loses what was queued, which
under a load the database keeps up with is at most the last `flush_s` (0.05 s) of
appends and one batch being written; with the database slower than the appends or
unreachable, up to the whole queue (`queue_events` events), after which appends are
refused. (The file log loses nothing on a crash of the process and at most 0.2 s on a
power cut.) `sync()` writes what is queued at once and returns once everything
appended before the call is committed; `close()` writes the queue out before it
returns (EventLogError when it cannot within CLOSE_TIMEOUT_S).

Reads see what has been committed: everything appended before a `sync()` that
returned, and otherwise what the writer thread has flushed, at most about `flush_s`
behind the appends when the database keeps up. The bridge reads the log only for what
its in-memory window of the run no longer holds, so that lag is not seen there.

Retention drops, per tenant, every event older than `max_age_s`, then the oldest
whole milliseconds of events until the tenant holds at most `max_bytes` (one range
DELETE on (tenant, at_ms)), and never the newest KEEP_NEWEST_S of its events, as the
file log never drops the segment it is writing: a tenant over its bytes keeps its
latest events, the runs in flight. `retain` returns the number of events dropped (the
file log: segments).

Measured (`python benchmarks/bench_eventlog_pg.py`, 200,000 stream-shaped events, the
server on the same shared 2-core machine with fsync on, load average 2-5, three runs):
written and committed at 29,000-37,000 events/s against the file log's 82,000-102,000
written and fsynced (0.29-0.44x), in batches of 2,000; an `append` call 6.9-7.7 us
against the file log's 9.6-11.5 us (0.6-0.8x: a queue put, the writing on another
thread); "run R after id X" (40 events) p50 0.12-0.13 ms against 0.07-0.08 ms
(1.5-1.8x), p99 2.6-4.7 ms against 2.9-4.2 ms (0.9-1.1x). A bridge relays 10,000-
20,000 events/s at most (bench_bridge), under the writer's rate.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from server_bridge.eventlog.log import (
    MAX_RECORD_BYTES,
    EventLogError,
    LoggedEvent,
    LoggedRun,
    RecordTooLarge,
)
from server_bridge.pgstore import migrate
from server_bridge.pgstore.connect import PgUnavailable, connect, open_pool
from server_bridge.topics import BadTopic, check_id

__all__ = [
    "CLOSE_TIMEOUT_S",
    "DEFAULT_BATCH_EVENTS",
    "DEFAULT_FLUSH_S",
    "DEFAULT_QUEUE_BYTES",
    "DEFAULT_QUEUE_EVENTS",
    "KEEP_NEWEST_S",
    "LogBehind",
    "PgEventLog",
]

log = logging.getLogger("wren.bridge.eventlog.pg")

#: The longest a record waits in the queue before its batch is written: the most a
#: crash of the bridge loses while the database keeps up (bench_eventlog_pg).
DEFAULT_FLUSH_S = 0.05
#: A batch is written as soon as this many records wait (one INSERT of them all).
DEFAULT_BATCH_EVENTS = 2_000
#: The queue's bounds: about 5-10 s of a busy bridge's events (10-20k/s relayed), so a
#: database restart or failover does not cost an event, while a database that is gone
#: for good cannot take the bridge's memory with it.
DEFAULT_QUEUE_EVENTS = 100_000
DEFAULT_QUEUE_BYTES = 64 << 20
#: Retention never drops a tenant's events this close to its newest one.
KEEP_NEWEST_S = 60.0
#: How long close() goes on writing the queue to a database that does not answer.
CLOSE_TIMEOUT_S = 10.0
#: How long sync() waits for the queue to be written before it raises.
SYNC_TIMEOUT_S = 30.0
# Readers at once (the HTTP API's threads reading runs); more wait for a connection.
_READERS = 4
# Reconnecting after a lost connection: first wait, doubling up to the last.
_RETRY_FIRST_S = 0.05
_RETRY_MAX_S = 2.0
_BIGINT = 1 << 63


class LogBehind(EventLogError):
    """The queue to the database is full (the database is slow or away): refused,
    nothing queued."""


# One queued record: the keys as stored (_key), the event's id and time, and the
# encoded msgpack record.
_Rec = tuple[str, str, str, int, int, str | None, str | None, bytes]

_FLUSH = """
WITH b AS (
    SELECT * FROM unnest(%b::text[], %b::text[], %b::text[], %b::int8[], %b::int8[],
                         %b::text[], %b::text[], %b::bytea[], %b::int8[])
        AS b(tenant, device, run, i, at_ms, usr, conv, rec, k)
), seq AS (
    -- One value a batch (volatile: evaluated once), and each record's place in the
    -- batch as appended (k) below it: the order runs joined their conversations and
    -- were last active is the order of the appends, across batches and bridges.
    SELECT nextval('wren_event_seq') << 20 AS base
), ins AS (
    INSERT INTO wren_events (tenant, device, run, i, at_ms, rec)
    SELECT tenant, device, run, i, at_ms, rec FROM b
    ON CONFLICT DO NOTHING
    RETURNING tenant, device, run, i, at_ms, octet_length(rec) AS size
), agg AS (
    -- Only what this statement inserted: an event another bridge stored first is
    -- counted by that bridge's flush, once.
    SELECT tenant, device, run, count(*) AS n, min(i) AS lo, max(i) AS hi,
           min(at_ms) AS t0, max(at_ms) AS t1, sum(size) AS bytes
    FROM ins GROUP BY tenant, device, run
), named AS (
    SELECT tenant, device, run,
           (array_agg(usr ORDER BY i) FILTER (WHERE usr IS NOT NULL))[1] AS usr,
           (array_agg(conv ORDER BY i) FILTER (WHERE conv IS NOT NULL))[1] AS conv,
           min(k) FILTER (WHERE conv IS NOT NULL) AS conv_k, max(k) AS last_k
    FROM b GROUP BY tenant, device, run
), runs AS (
    INSERT INTO wren_event_runs AS r
        (tenant, device, run, usr, conv, lo, hi, n, first_ms, last_ms, bytes, joined, active)
    SELECT a.tenant, a.device, a.run, m.usr, m.conv, a.lo, a.hi, a.n, a.t0, a.t1, a.bytes,
           s.base + m.conv_k, s.base + m.last_k
    FROM agg a JOIN named m USING (tenant, device, run) CROSS JOIN seq s
    -- Rows locked in one order by every bridge: two flushes never wait on each other
    -- in a circle.
    ORDER BY a.tenant, a.device, a.run
    ON CONFLICT (tenant, device, run) DO UPDATE SET
        usr = coalesce(r.usr, EXCLUDED.usr),
        conv = coalesce(r.conv, EXCLUDED.conv),
        joined = CASE WHEN r.conv IS NULL THEN EXCLUDED.joined ELSE r.joined END,
        lo = least(r.lo, EXCLUDED.lo),
        hi = greatest(r.hi, EXCLUDED.hi),
        n = r.n + EXCLUDED.n,
        first_ms = least(r.first_ms, EXCLUDED.first_ms),
        last_ms = greatest(r.last_ms, EXCLUDED.last_ms),
        bytes = r.bytes + EXCLUDED.bytes,
        active = EXCLUDED.active
)
SELECT tenant, sum(n)::bigint, sum(bytes)::bigint FROM agg GROUP BY tenant ORDER BY tenant
"""
# A statement of its own, after the runs: retention locks runs, then the tenant, and so
# does a flush.
_TENANTS = """
INSERT INTO wren_event_tenants AS t (tenant, bytes)
SELECT * FROM unnest(%s::text[], %s::int8[])
ON CONFLICT (tenant) DO UPDATE SET bytes = t.bytes + EXCLUDED.bytes
"""
_EVENTS = (
    "SELECT rec FROM wren_events WHERE tenant = %s AND device = %s AND run = %s AND i > %s"
    " ORDER BY i"
)
_RUN = (
    "SELECT usr, conv, lo, hi, n, first_ms, last_ms FROM wren_event_runs"
    " WHERE tenant = %s AND device = %s AND run = %s"
)
# Every run of every conversation, the conversation most recently active first, its
# runs in the order they joined it; the user filter is applied after the order is set
# (a conversation's activity counts every user's runs of it, as in the file log).
_CONVERSATIONS = """
SELECT conv, device, run, usr FROM wren_event_runs
WHERE tenant = %s AND conv IS NOT NULL
ORDER BY max(active) OVER (PARTITION BY conv) DESC, conv, joined
"""
_RUNS_OF = (
    "SELECT device, run FROM wren_event_runs WHERE tenant = %s AND conv = %s"
    " AND conv IS NOT NULL ORDER BY joined"
)
_NEWEST = "SELECT max(at_ms) FROM wren_events WHERE tenant = %s"
# The time at which the oldest events of a tenant add up to `excess` bytes: dropping
# everything up to and including it leaves at most the limit. Read in (tenant, at_ms)
# order and stopped there: it reads what it drops, not the tenant's log.
_BYTES_CUT = """
SELECT at_ms FROM (
    SELECT at_ms, sum(octet_length(rec)) OVER (ORDER BY at_ms ROWS UNBOUNDED PRECEDING) AS cum
    FROM wren_events WHERE tenant = %s AND at_ms < %s ORDER BY at_ms
) s WHERE cum >= %s LIMIT 1
"""
_DROP = """
WITH d AS (
    DELETE FROM wren_events WHERE tenant = %s AND at_ms < %s
    RETURNING device, run, octet_length(rec) AS size
)
SELECT device, run, count(*), sum(size)::bigint FROM d GROUP BY device, run
"""
_LOCK_RUNS = """
SELECT 1 FROM wren_event_runs
WHERE tenant = %s AND (device, run) IN (SELECT * FROM unnest(%s::text[], %s::text[]))
ORDER BY device, run FOR UPDATE
"""
# After the lock, a statement of its own: it sees every flush that committed to these
# runs before, and the flushes after it wait for the lock and add to what it wrote.
_RECOUNT = """
UPDATE wren_event_runs r SET lo = s.lo, hi = s.hi, n = s.n, first_ms = s.t0,
    last_ms = s.t1, bytes = s.bytes
FROM (
    SELECT device, run, min(i) AS lo, max(i) AS hi, count(*) AS n, min(at_ms) AS t0,
           max(at_ms) AS t1, sum(octet_length(rec)) AS bytes
    FROM wren_events
    WHERE tenant = %s AND (device, run) IN (SELECT * FROM unnest(%s::text[], %s::text[]))
    GROUP BY device, run
) s
WHERE r.tenant = %s AND r.device = s.device AND r.run = s.run
"""
_DROP_EMPTY_RUNS = """
DELETE FROM wren_event_runs r
WHERE tenant = %s AND (device, run) IN (SELECT * FROM unnest(%s::text[], %s::text[]))
AND NOT EXISTS (SELECT 1 FROM wren_events e
                WHERE e.tenant = r.tenant AND e.device = r.device AND e.run = r.run)
"""
_UNCOUNT = "UPDATE wren_event_tenants SET bytes = bytes - %s WHERE tenant = %s"


class PgEventLog:
    """The event log on PostgreSQL (see the module docstring). Thread-safe.

    `dsn`: a libpq connection string. The schema is brought up to date on open. The log
    holds a connection for its writer thread and a pool of up to `readers` for reads
    and retention, closed by `close()`.
    """

    def __init__(
        self,
        dsn: str,
        *,
        clock: Callable[[], float] = time.time,
        flush_s: float = DEFAULT_FLUSH_S,
        batch_events: int = DEFAULT_BATCH_EVENTS,
        queue_events: int = DEFAULT_QUEUE_EVENTS,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
        readers: int = _READERS,
    ) -> None:
        if flush_s <= 0:
            raise ValueError("flush_s must be > 0")
        if not 0 < batch_events <= min(queue_events, 1 << 20):
            # 1 << 20: a record's place in its batch is the low 20 bits of its order.
            raise ValueError("batch_events must be > 0 and at most queue_events and 2**20")
        if queue_bytes < MAX_RECORD_BYTES:
            raise ValueError(f"queue_bytes must be >= {MAX_RECORD_BYTES}")
        self.dsn = dsn
        self.flush_s = flush_s
        self.batch_events = batch_events
        self.queue_events = queue_events
        self.queue_bytes = queue_bytes
        self._clock = clock
        # Counters (for tests and stats), written by the writer thread or under _cv.
        self.flushes = 0  # batches committed
        self.duplicates = 0  # records the log already held: not stored again
        self.refused = 0  # appends refused for a full queue (LogBehind)
        self.dropped = 0  # records the database refused at a flush
        self.lost = 0  # records close() could not write
        self.last_error: str | None = None  # the writer's last failure, for sync()'s
        self._readers = readers
        self._pool = open_pool(dsn, max_size=readers)
        try:
            with self._pool.connection() as conn:
                migrate.apply(conn)
            import psycopg

            self._pg: Any = psycopg
            self._writer: Any = connect(dsn, autocommit=True)
        except BaseException:
            self._pool.close()
            raise
        # Guards the queue and the counts below; never held over a query.
        self._cv = threading.Condition()
        self._queue: collections.deque[_Rec] = collections.deque()
        self._held = 0  # records queued or being written
        self._held_bytes = 0
        self._appended = 0  # records ever queued: sync's target
        self._settled = 0  # of them, written (or dropped) by the writer
        self._taken = 0  # of them, taken off the queue by the writer
        self._sync_to = 0  # sync() wants everything up to here written now
        self._oldest = 0.0  # when the oldest queued record came (monotonic)
        self._closed = False
        self._give_up_at: float | None = None  # set by close()
        self._thread = threading.Thread(target=self._write_loop, name="wren-eventlog-pg",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    # ------------------------------------------------------------------ writing

    def append(
        self,
        tenant: str,
        device: str,
        run: str,
        i: int,
        payload: bytes,
        *,
        usr: str | None = None,
        conv: str | None = None,
        ts_ms: int | None = None,
    ) -> None:
        """Queue one event for the next batch (raises RecordTooLarge, LogBehind or
        EventLogError; nothing is queued then)."""
        _check_tenant(tenant)
        ts = int(self._clock() * 1000) if ts_ms is None else ts_ms
        if not (-_BIGINT <= i < _BIGINT and -_BIGINT <= ts < _BIGINT):
            raise EventLogError(f"event id {i} or time {ts} out of the log's range")
        try:
            body = msgpack.packb([ts, device, run, i, usr, conv, bytes(payload)],
                                 use_bin_type=True)  # fmt: skip
        except (TypeError, ValueError, OverflowError) as e:
            raise EventLogError(f"an event the log cannot encode: {e}") from None
        if len(body) > MAX_RECORD_BYTES:
            raise RecordTooLarge(
                f"an event record of {len(body):,} bytes: at most {MAX_RECORD_BYTES:,}"
            )
        rec: _Rec = (tenant, _key(device), _key(run), i, ts, _opt_key(usr), _opt_key(conv),
                     body)  # fmt: skip
        with self._cv:
            if self._closed:
                raise EventLogError("the event log is closed")
            if self._held >= self.queue_events or self._held_bytes + len(body) > self.queue_bytes:
                self.refused += 1
                raise LogBehind(
                    f"the event log's queue is full ({self._held:,} events,"
                    f" {self._held_bytes:,} bytes): the database is behind"
                    + (f" ({self.last_error})" if self.last_error else "")
                )
            if not self._queue:
                self._oldest = time.monotonic()
                self._cv.notify_all()  # the writer sleeps while the queue is empty
            self._queue.append(rec)
            self._held += 1
            self._held_bytes += len(body)
            self._appended += 1
            if len(self._queue) == self.batch_events:
                self._cv.notify_all()

    def sync(self, timeout: float = SYNC_TIMEOUT_S) -> None:
        """Write what is queued now, and return once everything appended before this
        call is committed (EventLogError when it is not within `timeout`)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            target = self._appended
            if self._settled >= target:
                return
            self._sync_to = max(self._sync_to, target)
            self._cv.notify_all()
            while self._settled < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    raise EventLogError(
                        f"the event log could not write {target - self._settled:,} events"
                        f" in {timeout:g} s" + (f": {self.last_error}" if self.last_error else "")
                    )
                self._cv.wait(min(left, 0.5))

    @property
    def queued(self) -> int:
        """Records appended and not yet committed."""
        with self._cv:
            return self._held

    # ------------------------------------------------------------------ reading

    def events(self, tenant: str, device: str, run: str, after: int = 0) -> list[LoggedEvent]:
        """The run's committed events with ids above `after`, in id order."""
        _check_tenant(tenant)
        if after >= _BIGINT:
            return []
        rows = self._read(_EVENTS, (tenant, _key(device), _key(run), max(after, -_BIGINT)),
                          binary=True)  # fmt: skip
        return [_decode(bytes(r[0])) for r in rows]

    def run(self, tenant: str, device: str, run: str) -> LoggedRun | None:
        """What the log holds of a run, or None when it holds none of its events."""
        _check_tenant(tenant)
        rows = self._read(_RUN, (tenant, _key(device), _key(run)))
        if not rows:
            return None
        usr, conv, lo, hi, n, first_ms, last_ms = rows[0]
        return LoggedRun(_opt_unkey(usr), _opt_unkey(conv), int(lo), int(hi), int(n),
                         int(first_ms), int(last_ms))  # fmt: skip

    def conversations(
        self, tenant: str, usr: str | None = None
    ) -> list[tuple[str, list[tuple[str, str]]]]:
        """The tenant's conversations, the most recently active first, each with its
        (device, run) in the order they joined it; with `usr`, only that user's runs
        (and conversations with any)."""
        _check_tenant(tenant)
        want = _opt_key(usr)
        out: list[tuple[str, list[tuple[str, str]]]] = []
        last: str | None = None
        for conv, device, run, who in self._read(_CONVERSATIONS, (tenant,)):
            if usr is not None and who != want:
                continue
            if conv != last:
                out.append((_unkey(conv), []))
                last = conv
            out[-1][1].append((_unkey(device), _unkey(run)))
        return out

    def runs_of(self, tenant: str, conv: str) -> list[tuple[str, str]]:
        """The (device, run) of a conversation, in the order they joined it."""
        _check_tenant(tenant)
        rows = self._read(_RUNS_OF, (tenant, _key(conv)))
        return [(_unkey(d), _unkey(r)) for d, r in rows]

    def tenants(self) -> list[str]:
        rows = self._read("SELECT tenant FROM wren_event_tenants ORDER BY tenant", ())
        return [str(r[0]) for r in rows]

    def tenant_bytes(self, tenant: str) -> int:
        """The bytes of the tenant's committed records (the msgpack records; the file
        log counts its 8-byte frames too)."""
        rows = self._read("SELECT bytes FROM wren_event_tenants WHERE tenant = %s", (tenant,))
        return int(rows[0][0]) if rows else 0

    # ------------------------------------------------------------------ retention

    def retain(self, tenant: str, *, max_age_s: float | None = None,
               max_bytes: int | None = None) -> int:  # fmt: skip
        """Drop the tenant's events older than `max_age_s`, then its oldest until it
        holds at most `max_bytes`; never those within KEEP_NEWEST_S of its newest.
        Returns how many events went."""
        _check_tenant(tenant)
        now_ms = int(self._clock() * 1000)

        def work(conn: Any) -> int:
            with conn.transaction():
                return self._retain(conn, tenant, now_ms, max_age_s, max_bytes)

        gone = int(self._pooled(work, f"event log retention for tenant {tenant}"))
        if gone:
            log.info("event log of tenant %s: dropped %d event(s)", tenant, gone)
        return gone

    def _retain(self, conn: Any, tenant: str, now_ms: int, max_age_s: float | None,
                max_bytes: int | None) -> int:  # fmt: skip
        newest = conn.execute(_NEWEST, (tenant,)).fetchone()[0]
        if newest is None:
            return 0
        keep_from = int(newest) - int(KEEP_NEWEST_S * 1000)  # drop only below this
        # device, run -> [events, bytes] dropped.
        dropped: dict[tuple[str, str], list[int]] = {}
        if max_age_s is not None:
            self._drop(conn, tenant, min(keep_from, now_ms - int(max_age_s * 1000)), dropped)
        if max_bytes is not None:
            row = conn.execute("SELECT bytes FROM wren_event_tenants WHERE tenant = %s",
                               (tenant,)).fetchone()  # fmt: skip
            total = (int(row[0]) if row else 0) - sum(b for _, b in dropped.values())
            if total > max_bytes:
                cut = conn.execute(_BYTES_CUT, (tenant, keep_from, total - max_bytes)).fetchone()
                self._drop(conn, tenant, keep_from if cut is None else int(cut[0]) + 1, dropped)
        if not dropped:
            return 0
        keys = sorted(dropped)
        devices, runs = [d for d, _ in keys], [r for _, r in keys]
        conn.execute(_LOCK_RUNS, (tenant, devices, runs))
        conn.execute(_RECOUNT, (tenant, devices, runs, tenant))
        conn.execute(_DROP_EMPTY_RUNS, (tenant, devices, runs))
        conn.execute(_UNCOUNT, (sum(b for _, b in dropped.values()), tenant))
        return sum(n for n, _ in dropped.values())

    @staticmethod
    def _drop(conn: Any, tenant: str, before_ms: int,
              dropped: dict[tuple[str, str], list[int]]) -> None:  # fmt: skip
        for device, run, n, size in conn.execute(_DROP, (tenant, before_ms)).fetchall():
            got = dropped.setdefault((device, run), [0, 0])
            got[0] += int(n)
            got[1] += int(size)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Write the queue out (for up to CLOSE_TIMEOUT_S) and let the database go;
        appends are refused from the call on."""
        with self._cv:
            if self._closed and not self._thread.is_alive():
                return
            self._closed = True
            if self._give_up_at is None:
                self._give_up_at = time.monotonic() + CLOSE_TIMEOUT_S
            self._cv.notify_all()
        self._thread.join(timeout=CLOSE_TIMEOUT_S + 5)
        for closing in (self._writer.close, self._pool.close):
            try:
                closing()
            except Exception:
                log.exception("closing the event log's database connections failed")
        if self.lost:
            raise EventLogError(f"the event log closed with {self.lost:,} events not written")

    def __enter__(self) -> PgEventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ inside

    def _read(self, sql: str, params: Sequence[Any], *, binary: bool = False) -> list[Any]:
        return list(self._pooled(lambda conn: conn.execute(sql, params, binary=binary)
                                 .fetchall(), "reading the event log"))  # fmt: skip

    def _pooled(self, work: Callable[[Any], Any], what: str) -> Any:
        """`work(conn)` on a pooled connection in autocommit (one round trip a read: no
        transaction to open and commit around it). A connection the server dropped
        while it sat in the pool (a restart, a failover) fails at its first use and is
        discarded by the pool: the work is tried again on another, at most once per
        connection the pool can hold."""
        for attempt in range(self._readers + 1):
            conn: Any = None
            try:
                with self._pool.connection() as conn:
                    conn.autocommit = True
                    return work(conn)
            except self._pg.Error as e:
                if conn is not None and conn.broken and attempt < self._readers:
                    continue
                raise EventLogError(f"{what}: {e}") from e
        raise AssertionError("unreachable")

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return  # closed, and everything written
                # Wait for a full batch, the oldest record's flush_s, a sync or close.
                while (
                    len(self._queue) < self.batch_events
                    and self._taken >= self._sync_to
                    and not self._closed
                ):
                    left = self._oldest + self.flush_s - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                batch = [self._queue.popleft()
                         for _ in range(min(len(self._queue), self.batch_events))]  # fmt: skip
                self._taken += len(batch)
                # What stays waits from now: a close estimate of its oldest's arrival.
                self._oldest = time.monotonic()
            try:
                self._write(batch)
            except Exception:  # a bug: the batch is counted lost, the writer goes on
                log.exception("the event log's writer failed on %d events", len(batch))
                self.lost += len(batch)
            with self._cv:
                self._settled += len(batch)
                self._held -= len(batch)
                self._held_bytes -= sum(len(r[7]) for r in batch)
                self._cv.notify_all()

    def _write(self, batch: list[_Rec]) -> None:
        """Commit a batch, reconnecting as long as it takes (or until close gives up)."""
        pg = self._pg
        delay = _RETRY_FIRST_S
        # Every bridge inserts in this order (stable: the first appended of two equal
        # keys is the one kept), so two flushes of overlapping events never wait on
        # each other in a circle.
        ordered = sorted(enumerate(batch), key=lambda kr: kr[1][:4])
        while True:
            try:
                if self._writer is None or self._writer.closed:
                    self._writer = connect(self.dsn, autocommit=True)
                self._insert(self._writer, ordered)
                self.last_error = None
                return
            except pg.errors.TransactionRollback as e:
                # A deadlock or serialization failure: rolled back, tried again at once.
                self.last_error = str(e)
                continue
            except (pg.OperationalError, pg.InterfaceError, PgUnavailable) as e:
                # The connection or the server (gone, restarting, out of disk): the batch
                # is kept and written again on a new connection.
                self.last_error = str(e).strip() or type(e).__name__
                log.warning("event log: writing %d events failed, retrying: %s",
                            len(batch), self.last_error)  # fmt: skip
                try:
                    self._writer.close()
                except Exception:
                    pass
            except pg.Error as e:
                # The database refused something in the batch: find the records it
                # refuses, drop those alone.
                if len(batch) == 1:
                    self.dropped += 1
                    self.last_error = str(e)
                    log.error("event log: event %s of run %s/%s refused by the database: %s",
                              batch[0][3], batch[0][1], batch[0][2], e)  # fmt: skip
                    return
                for rec in batch:
                    self._write([rec])
                return
            give_up = self._give_up_at
            if give_up is not None and time.monotonic() >= give_up:
                self.lost += len(batch)
                log.error("event log: %d events not written at close: %s", len(batch),
                          self.last_error)  # fmt: skip
                return
            if give_up is not None:
                delay = min(delay, max(0.0, give_up - time.monotonic()))
            time.sleep(delay)
            delay = min(delay * 2, _RETRY_MAX_S)

    def _insert(self, conn: Any, ordered: list[tuple[int, _Rec]]) -> None:
        """One transaction: the events, their runs (one statement), then the tenants'
        bytes; `ordered`: (place as appended, record) in key order."""
        batch = [r for _, r in ordered]
        cols: list[list[Any]] = [list(c) for c in zip(*batch, strict=True)]
        cols.append([k for k, _ in ordered])
        with conn.transaction():
            rows = conn.execute(_FLUSH, cols).fetchall()
            if rows:
                conn.execute(_TENANTS, ([r[0] for r in rows], [int(r[2]) for r in rows]))
        self.flushes += 1
        self.duplicates += len(batch) - sum(int(r[1]) for r in rows)


def _check_tenant(tenant: str) -> None:
    try:
        check_id(tenant, "tenant")
    except BadTopic as e:
        raise EventLogError(str(e)) from None


def _key(s: str) -> str:
    """A name as a text key: PostgreSQL's text holds no NUL, so a name with a NUL (or a
    '%', to keep the mapping one to one) is stored with those escaped."""
    if not isinstance(s, str):
        raise EventLogError(f"a name must be a str, not {type(s).__name__}")
    if "%" not in s and "\x00" not in s:
        return s
    return s.replace("%", "%25").replace("\x00", "%00")


def _unkey(s: str) -> str:
    if "%" not in s:
        return s
    return s.replace("%00", "\x00").replace("%25", "%")


def _opt_key(s: str | None) -> str | None:
    return None if s is None else _key(s)


def _opt_unkey(s: str | None) -> str | None:
    return None if s is None else _unkey(s)


def _decode(body: bytes) -> LoggedEvent:
    try:
        ts, device, run, i, usr, conv, payload = msgpack.unpackb(body, raw=False)
    except (ValueError, TypeError, msgpack.ExtraData) as e:
        raise EventLogError(f"an event log record is damaged: {e}") from None
    return LoggedEvent(ts, device, run, i, usr, conv, payload)
