"""The durable event log: appends, reads by run after an id and by conversation, a reopen
that rebuilds the index, retention by bytes and age, and the refusals, on both backends:
`[file]` (server_bridge/eventlog/: real files in a temporary directory) and `[pg]`
(server_bridge/pgstore/eventlog.py: a fresh database on the session's PostgreSQL, skipped
with the reason on a machine without one). A torn tail, segments and fsync batches are
the file log's own; what only PostgreSQL does is in test_pg_eventlog.py. Nothing is
mocked.

A PostgreSQL log's reads see what it has written (its appends are batched), so the
shared tests `sync()` before they read; for the file log that is an fsync."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest

from server_bridge.eventlog import (
    MAX_RECORD_BYTES,
    EventLog,
    EventLogError,
    LoggedRun,
    RecordTooLarge,
)

# Either backend: the tests use the interface both implement.
Log = Any


def env(run: str, i: int, text: str = "x") -> bytes:
    return msgpack.packb({"r": run, "i": i, "t": "msg.delta", "ts": i, "d": {"m": 1, "text": text}})


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Backend:
    name: str
    make: Callable[..., Log]
    # The file log's directory (None for PostgreSQL): for assertions on its segments.
    root: Path | None

    def open(self, **kw: Any) -> Log:
        """A log on the test's storage; reopened on the same storage by another call.
        File-only options (segment_bytes, sync_s) are dropped for PostgreSQL."""
        if self.root is None:
            kw.pop("segment_bytes", None)
            kw.pop("sync_s", None)
        return self.make(**kw)

    def segments(self, tenant: str) -> int | None:
        """How many segment files the tenant has (None: not a file log)."""
        return None if self.root is None else len(list((self.root / tenant).glob("*.seg")))


@pytest.fixture(params=["file", "pg"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "pg":
        from server_bridge.pgstore.eventlog import PgEventLog

        dsn = request.getfixturevalue("pg_dsn")
        return Backend("pg", lambda **kw: PgEventLog(dsn, **kw), None)
    root = tmp_path / "log"
    return Backend("file", lambda **kw: EventLog(root, **kw), root)


def test_a_runs_events_read_back_after_an_id_and_a_conversations_runs_in_order(
    backend: Backend,
) -> None:
    with backend.open() as lg:
        for i in range(1, 6):
            lg.append("acme", "dev1", "b1.1", i, env("b1.1", i), usr="alice", conv="c1")
        lg.append("acme", "dev1", "b1.2", 1, env("b1.2", 1), usr="alice", conv="c1")
        lg.append("acme", "dev2", "b2.1", 1, env("b2.1", 1), usr="bob", conv="c2")
        lg.append("globex", "dev1", "b1.1", 1, env("b1.1", 1))  # another tenant, same ids
        lg.sync()
        got = lg.events("acme", "dev1", "b1.1", after=2)
        assert [e.i for e in got] == [3, 4, 5]
        assert got[0].payload == env("b1.1", 3) and got[0].usr == "alice" and got[0].conv == "c1"
        assert lg.runs_of("acme", "c1") == [("dev1", "b1.1"), ("dev1", "b1.2")]
        assert lg.runs_of("acme", "c2") == [("dev2", "b2.1")]
        # Tenants are apart: globex's run is its own, and acme's conversations are not.
        assert [e.i for e in lg.events("globex", "dev1", "b1.1")] == [1]
        assert lg.runs_of("globex", "c1") == []
        assert lg.events("acme", "dev9", "nope") == []


def test_a_runs_span_and_the_conversations_most_recently_active_first(
    backend: Backend,
) -> None:
    clock = Clock()
    with backend.open(clock=clock) as lg:
        for i in (1, 2):
            lg.append("acme", "dev1", "A", i, env("A", i), usr="alice", conv="c1")
        clock.now += 1
        lg.append("acme", "dev2", "B", 1, env("B", 1), usr="bob", conv="c2")
        lg.append("acme", "dev1", "C", 1, env("C", 1), usr="bob", conv="c1")
        # A run whose first event names no one joins its conversation with the first
        # event that names it.
        lg.append("acme", "dev3", "D", 1, env("D", 1))
        lg.sync()
        assert lg.runs_of("acme", "c1") == [("dev1", "A"), ("dev1", "C")]
        lg.append("acme", "dev3", "D", 2, env("D", 2), usr="carol", conv="c2")
        clock.now += 1
        lg.append("acme", "dev1", "A", 3, env("A", 3), usr="alice", conv="c1")
        lg.sync()
        assert lg.conversations("acme") == [
            ("c1", [("dev1", "A"), ("dev1", "C")]),
            ("c2", [("dev2", "B"), ("dev3", "D")]),
        ]
        assert lg.conversations("acme", "bob") == [("c1", [("dev1", "C")]), ("c2", [("dev2", "B")])]
        assert lg.conversations("acme", "carol") == [("c2", [("dev3", "D")])]
        assert lg.conversations("acme", "nobody") == [] and lg.conversations("globex") == []
        lg.append("acme", "dev2", "B", 2, env("B", 2), usr="bob", conv="c2")
        lg.sync()
        assert [c for c, _ in lg.conversations("acme")] == ["c2", "c1"]
        t0 = 1_000_000_000
        assert lg.run("acme", "dev1", "A") == LoggedRun("alice", "c1", 1, 3, 3, t0, t0 + 2000)
        assert lg.run("acme", "dev3", "D") == LoggedRun("carol", "c2", 1, 2, 2, t0 + 1000,
                                                        t0 + 1000)  # fmt: skip
        assert lg.run("acme", "dev1", "nope") is None and lg.run("globex", "dev1", "A") is None
        assert lg.tenants() == ["acme"] and lg.tenant_bytes("acme") > 0
        assert lg.tenant_bytes("globex") == 0


def test_a_reopened_log_has_every_record_and_appends_after_them(backend: Backend) -> None:
    with backend.open(segment_bytes=MAX_RECORD_BYTES) as lg:
        for i in range(1, 301):  # several segments
            lg.append("acme", "dev1", "r", i, env("r", i, "y" * 300), conv="c")
        assert backend.segments("acme") in (None, *range(2, 100))
        # No sync: closing writes everything appended.
    with backend.open(segment_bytes=MAX_RECORD_BYTES) as lg:
        assert [e.i for e in lg.events("acme", "dev1", "r")] == list(range(1, 301))
        lg.append("acme", "dev1", "r", 301, env("r", 301))
        lg.sync()
        assert [e.i for e in lg.events("acme", "dev1", "r", after=299)] == [300, 301]
        assert lg.runs_of("acme", "c") == [("dev1", "r")]


def test_a_torn_last_record_is_cut_and_logging_goes_on(tmp_path: Path) -> None:
    with EventLog(tmp_path / "log") as lg:
        for i in range(1, 4):
            lg.append("acme", "dev1", "r", i, env("r", i))
    (seg,) = sorted((tmp_path / "log" / "acme").glob("*.seg"))
    whole = seg.stat().st_size
    with open(seg, "ab") as f:  # a power cut in the middle of the 4th record
        f.write(b"\x00\x00\x01\x00\xde\xad")
    with EventLog(tmp_path / "log") as lg:
        assert lg.truncated == 6 and seg.stat().st_size == whole
        lg.append("acme", "dev1", "r", 4, env("r", 4))
        assert [e.i for e in lg.events("acme", "dev1", "r")] == [1, 2, 3, 4]
    # A damaged byte inside a record: the segment is cut before it (what follows in that
    # segment cannot be trusted), and the log still opens and serves the rest.
    data = bytearray(seg.read_bytes())
    data[-3] ^= 0xFF
    seg.write_bytes(bytes(data))
    with EventLog(tmp_path / "log") as lg:
        assert [e.i for e in lg.events("acme", "dev1", "r")] == [1, 2, 3]


def test_retention_drops_the_oldest_by_bytes_and_by_age(backend: Backend) -> None:
    # The file log drops whole segments, PostgreSQL whole milliseconds of events; each
    # keeps the newest (the current segment; the newest minute).
    clock = Clock()
    with backend.open(segment_bytes=MAX_RECORD_BYTES, clock=clock) as lg:
        for i in range(1, 601):
            if i == 301:
                clock.now += 3600  # the second half an hour later
            lg.append("acme", "dev1", "r", i, env("r", i, "z" * 300), conv="c")
        lg.append("other", "dev1", "r", 1, env("r", 1))
        lg.sync()
        segs = backend.segments("acme")
        before = lg.tenant_bytes("acme")
        # By age: what is older than 30 minutes goes.
        gone = lg.retain("acme", max_age_s=1800)
        assert gone >= 1
        first = lg.events("acme", "dev1", "r")[0].i
        assert 1 < first <= 301
        span = lg.run("acme", "dev1", "r")
        assert span is not None and span.first == first and span.last == 600
        # By bytes: down to about one segment; never the newest.
        lg.retain("acme", max_bytes=MAX_RECORD_BYTES)
        left = lg.events("acme", "dev1", "r")
        assert left and left[-1].i == 600 and lg.tenant_bytes("acme") < before
        if segs is not None:
            assert (backend.segments("acme") or 0) < segs
        # However small the limit, the newest stays: appends go on there.
        lg.retain("acme", max_bytes=0)
        assert backend.segments("acme") in (None, 1)
        assert lg.events("acme", "dev1", "r")[-1].i == 600
        kept = [e.i for e in lg.events("acme", "dev1", "r")]
        assert lg.runs_of("acme", "c") == [("dev1", "r")]
        # Another tenant's log is untouched.
        assert [e.i for e in lg.events("other", "dev1", "r")] == [1]
        assert sorted(lg.tenants()) == ["acme", "other"]
    # What retention dropped stays dropped after a reopen.
    with backend.open(segment_bytes=MAX_RECORD_BYTES) as lg:
        assert [e.i for e in lg.events("acme", "dev1", "r")] == kept


def test_a_run_that_retention_empties_leaves_its_conversation(backend: Backend) -> None:
    clock = Clock()
    with backend.open(segment_bytes=MAX_RECORD_BYTES, clock=clock) as lg:
        for i in range(1, 301):
            lg.append("acme", "dev1", "old", i, env("old", i, "z" * 300), conv="c")
        clock.now += 7200
        for i in range(1, 301):
            lg.append("acme", "dev1", "new", i, env("new", i, "z" * 300), conv="c")
        lg.sync()
        assert lg.runs_of("acme", "c") == [("dev1", "old"), ("dev1", "new")]
        # As small as it goes: what stays is the newest (the current segment, which
        # "new" alone fills; the newest minute), so "old" goes whole.
        lg.retain("acme", max_bytes=0)
        assert lg.run("acme", "dev1", "old") is None
        assert lg.events("acme", "dev1", "old") == []
        assert lg.conversations("acme") == [("c", [("dev1", "new")])]
        assert lg.runs_of("acme", "c") == [("dev1", "new")]
        new = lg.run("acme", "dev1", "new")
        left = [e.i for e in lg.events("acme", "dev1", "new")]
        assert new is not None and left and left[-1] == 300
        assert (new.first, new.last, new.count) == (left[0], 300, len(left))


def test_bad_input_is_refused_by_name_and_nothing_is_written(
    backend: Backend, tmp_path: Path
) -> None:
    with backend.open() as lg:
        lg.append("acme", "dev1", "r", 1, env("r", 1))
        lg.sync()
        size = lg.tenant_bytes("acme")
        with pytest.raises(RecordTooLarge):
            lg.append("acme", "dev1", "r", 2, b"x" * (MAX_RECORD_BYTES + 1))
        for tenant in ("../etc", "ACME", "", "a/b"):
            with pytest.raises(EventLogError):
                lg.append(tenant, "dev1", "r", 1, b"x")
        lg.sync()
        assert lg.tenant_bytes("acme") == size and lg.tenants() == ["acme"]
        assert [e.i for e in lg.events("acme", "dev1", "r")] == [1]
        assert not (tmp_path / "etc").exists()


def test_appends_are_fsynced_in_batches(tmp_path: Path) -> None:
    with EventLog(tmp_path / "log", sync_s=3600) as lg:  # the thread never comes round
        for i in range(1, 101):
            lg.append("acme", "dev1", "r", i, env("r", i))
        assert lg.syncs == 0  # written (os.write) but not yet fsynced
        lg.sync()
        lg.sync()  # nothing new: no second round
        assert lg.syncs == 1
        fd = os.open(next((tmp_path / "log" / "acme").glob("*.seg")), os.O_RDONLY)
        try:
            assert os.fstat(fd).st_size == lg.tenant_bytes("acme")
        finally:
            os.close(fd)
