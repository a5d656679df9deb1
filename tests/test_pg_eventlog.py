"""PgEventLog (server_bridge/pgstore/eventlog.py) where PostgreSQL differs from files:
several bridges appending the same events, batched appends and their bounded queue, a
connection the server drops, retention recounting what it cuts. What both backends
share is tested on both by test_eventlog.py (its `[pg]` ids). A fresh database on the
session's server each test; skipped, with the reason, without PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import msgpack
import psycopg
import pytest

from server_bridge.eventlog import MAX_RECORD_BYTES, EventLogError, RecordTooLarge
from server_bridge.pgstore.eventlog import LogBehind, PgEventLog

TS = 1_765_000_000_000


def env(run: str, i: int, text: str = "x") -> bytes:
    return msgpack.packb({"r": run, "i": i, "t": "msg.delta", "ts": i, "d": {"m": 1, "text": text}})


def record_bytes(device: str, run: str, i: int, payload: bytes, usr: str | None = None,
                 conv: str | None = None, ts: int = TS) -> int:  # fmt: skip
    """The size of the record the log keeps for an event (what tenant_bytes counts)."""
    return len(msgpack.packb([ts, device, run, i, usr, conv, payload], use_bin_type=True))


@pytest.fixture
def bridges(pg_dsn: str) -> Iterator[tuple[PgEventLog, PgEventLog]]:
    """Two logs on one database, as two bridge processes have; small batches, so their
    flushes interleave."""
    a = PgEventLog(pg_dsn, batch_events=64, flush_s=0.005)
    b = PgEventLog(pg_dsn, batch_events=64, flush_s=0.005)
    yield a, b
    a.close()
    b.close()


def test_two_bridges_relaying_the_same_events_store_each_once_in_id_order(
    bridges: tuple[PgEventLog, PgEventLog],
) -> None:
    # A failover: both bridges relay overlapping stretches of the same runs at once,
    # each in its own order. Every event is stored once, counted once.
    a, b = bridges
    runs = [f"r{k}" for k in range(4)]
    n = 1_500
    errors: list[BaseException] = []

    def relay(lg: PgEventLog, ids: range) -> None:
        try:
            for i in ids:
                for run in runs:
                    lg.append("acme", "dev1", run, i, env(run, i), usr="ann", conv="c",
                              ts_ms=TS)  # fmt: skip
            lg.sync()
        except BaseException as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=relay, args=(a, range(1, 1_001))),
               threading.Thread(target=relay, args=(b, range(501, n + 1)))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert a.duplicates + b.duplicates == 500 * len(runs)
    for lg in (a, b):
        for run in runs:
            got = lg.events("acme", "dev1", run)
            assert [e.i for e in got] == list(range(1, n + 1))
            assert all(e.payload == env(run, e.i) for e in got)
            span = lg.run("acme", "dev1", run)
            assert span is not None and (span.first, span.last, span.count) == (1, n, n)
        assert lg.runs_of("acme", "c") == [("dev1", r) for r in runs]
        want = sum(record_bytes("dev1", r, i, env(r, i), "ann", "c")
                   for r in runs for i in range(1, n + 1))  # fmt: skip
        assert lg.tenant_bytes("acme") == want


def test_an_event_already_held_keeps_its_first_payload(
    bridges: tuple[PgEventLog, PgEventLog],
) -> None:
    a, b = bridges
    a.append("acme", "dev1", "r", 1, b"first", usr="ann", conv="c")
    a.sync()
    b.append("acme", "dev1", "r", 1, b"second", usr="bob", conv="other")
    b.append("acme", "dev1", "r", 2, b"two")
    b.sync()
    assert [(e.i, e.payload, e.usr) for e in b.events("acme", "dev1", "r")] == [
        (1, b"first", "ann"),
        (2, b"two", None),
    ]
    assert b.duplicates == 1
    span = a.run("acme", "dev1", "r")
    assert span is not None and (span.usr, span.conv, span.count) == ("ann", "c", 2)
    assert a.runs_of("acme", "other") == []


def test_the_log_survives_close_and_reopen(pg_dsn: str) -> None:
    with PgEventLog(pg_dsn, flush_s=3600) as lg:
        for i in range(1, 101):
            lg.append("acme", "dev1", "r", i, env("r", i), usr="ann", conv="c", ts_ms=TS + i)
        lg.append("globex", "dev9", "s", 1, b"x")
        # No sync: close writes what is queued before it returns.
    with PgEventLog(pg_dsn) as lg:
        assert [e.i for e in lg.events("acme", "dev1", "r", after=90)] == list(range(91, 101))
        assert lg.run("acme", "dev1", "r") is not None
        assert lg.conversations("acme") == [("c", [("dev1", "r")])]
        assert lg.tenants() == ["acme", "globex"]
        lg.append("acme", "dev1", "r", 101, env("r", 101), usr="ann", conv="c")
        lg.sync()
        span = lg.run("acme", "dev1", "r")
        assert span is not None and (span.first_ms, span.last, span.count) == (TS + 1, 101, 101)


def test_a_bad_record_is_refused_by_name_and_nothing_else_is_lost(pg_dsn: str) -> None:
    with PgEventLog(pg_dsn, flush_s=3600) as lg:
        for i in range(1, 11):
            lg.append("acme", "dev1", "r", i, env("r", i))
        with pytest.raises(RecordTooLarge):
            lg.append("acme", "dev1", "r", 11, b"x" * (MAX_RECORD_BYTES + 1))
        with pytest.raises(EventLogError):
            lg.append("acme", "dev1", "r", 1 << 63, b"x")  # past the column's range
        with pytest.raises(EventLogError):
            lg.append("acme", "dev1", "r", 11, object())  # type: ignore[arg-type]
        with pytest.raises(EventLogError):
            lg.append("../etc", "dev1", "r", 11, b"x")
        # A NUL in a name (text cannot hold one) is stored escaped, not refused.
        lg.append("acme", "dev\x00%", "r%00", 1, b"odd", conv="c\x00")
        for i in range(11, 21):
            lg.append("acme", "dev1", "r", i, env("r", i))
        assert lg.queued == 21
        lg.sync()
        assert lg.queued == 0 and lg.dropped == 0 and lg.refused == 0
        assert [e.i for e in lg.events("acme", "dev1", "r")] == list(range(1, 21))
        (odd,) = lg.events("acme", "dev\x00%", "r%00")
        assert (odd.device, odd.run, odd.conv, odd.payload) == ("dev\x00%", "r%00", "c\x00", b"odd")
        assert lg.runs_of("acme", "c\x00") == [("dev\x00%", "r%00")]
        assert lg.events("acme", "dev%00%25", "r%2500") == []


def test_appends_are_written_in_batches_and_sync_forces_one(pg_dsn: str) -> None:
    with PgEventLog(pg_dsn, flush_s=3600, batch_events=1_000) as lg:
        for i in range(1, 101):
            lg.append("acme", "dev1", "r", i, env("r", i))
        # Queued, not yet written: reads see what the database holds.
        assert lg.events("acme", "dev1", "r") == [] and lg.flushes == 0
        lg.sync()
        lg.sync()  # nothing new: no second batch
        assert lg.flushes == 1 and len(lg.events("acme", "dev1", "r")) == 100
        # A full batch goes without waiting for its time.
        for i in range(101, 1_101):
            lg.append("acme", "dev1", "r", i, env("r", i))
        for _ in range(200):
            if lg.queued == 0:
                break
            threading.Event().wait(0.02)
        assert lg.queued == 0 and lg.flushes == 2


def test_a_full_queue_refuses_appends_by_name_until_the_database_takes_them(
    pg_dsn: str,
) -> None:
    with PgEventLog(pg_dsn, flush_s=0.01, batch_events=50, queue_events=50) as lg:
        lg.append("acme", "dev1", "r", 0, b"warm")  # the tables' first rows
        lg.sync()
        with psycopg.connect(pg_dsn) as blocker:
            # The database stops taking writes to the log (a long lock, a stalled disk).
            blocker.execute("LOCK TABLE wren_events IN ACCESS EXCLUSIVE MODE")
            for i in range(1, 51):
                lg.append("acme", "dev1", "r", i, env("r", i))
            with pytest.raises(LogBehind, match="queue is full"):
                lg.append("acme", "dev1", "r", 51, env("r", 51))
            assert lg.refused == 1
            blocker.rollback()
        lg.sync()
        lg.append("acme", "dev1", "r", 52, env("r", 52))
        lg.sync()
        assert [e.i for e in lg.events("acme", "dev1", "r", after=-1)] == [*range(0, 51), 52]


def test_a_dropped_connection_loses_nothing(pg_dsn: str) -> None:
    with PgEventLog(pg_dsn, flush_s=0.01) as lg:
        for i in range(1, 51):
            lg.append("acme", "dev1", "r", i, env("r", i))
        lg.sync()
        assert len(lg.events("acme", "dev1", "r")) == 50
        # The server ends every session of the log (a restart, a failover): the writer
        # connects again and writes its batch, the readers' pooled connections are
        # replaced at their next use.
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        for i in range(51, 101):
            lg.append("acme", "dev1", "r", i, env("r", i))
        lg.sync(timeout=30)
        assert [e.i for e in lg.events("acme", "dev1", "r")] == list(range(1, 101))
        assert lg.dropped == 0


def test_retention_by_bytes_drops_the_oldest_time_and_recounts_what_stays(pg_dsn: str) -> None:
    now = [1_000_000.0]
    with PgEventLog(pg_dsn, clock=lambda: now[0]) as lg:
        # Ten minutes of one run, 100 events a minute, and a second run in minute 0 only.
        for m in range(10):
            for k in range(100):
                i = m * 100 + k + 1
                lg.append("acme", "dev1", "long", i, env("long", i, "z" * 200), usr="ann",
                          conv="c")  # fmt: skip
            if m == 0:
                lg.append("acme", "dev2", "short", 1, env("short", 1), usr="bob", conv="c")
            now[0] += 60
        lg.sync()
        minute = lg.tenant_bytes("acme") // 10
        gone = lg.retain("acme", max_bytes=3 * minute)
        held = lg.events("acme", "dev1", "long")
        # The oldest minutes went whole, until at most the limit was left.
        assert lg.tenant_bytes("acme") <= 3 * minute
        assert len(held) in (200, 300) and held[-1].i == 1_000 and held[0].i % 100 == 1
        assert gone == 1_000 - len(held) + 1
        span = lg.run("acme", "dev1", "long")
        assert span is not None
        assert (span.first, span.last, span.count) == (held[0].i, 1_000, len(held))
        assert span.first_ms == held[0].ts_ms and span.last_ms == held[-1].ts_ms
        assert lg.run("acme", "dev2", "short") is None
        assert lg.runs_of("acme", "c") == [("dev1", "long")]
        assert lg.tenant_bytes("acme") == sum(
            record_bytes("dev1", "long", e.i, e.payload, "ann", "c", e.ts_ms) for e in held
        )
        # Appends after retention count on from what stays.
        lg.append("acme", "dev1", "long", 1_001, b"x", usr="ann", conv="c")
        lg.sync()
        span = lg.run("acme", "dev1", "long")
        assert span is not None and span.count == len(held) + 1
