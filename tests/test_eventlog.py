"""The durable event log (server_bridge/eventlog/): appends, reads by run after an id and
by conversation, a reopen that rebuilds the index, a torn tail cut back to the last whole
record, retention by bytes and age in whole segments, and the refusals. Real files in a
temporary directory; nothing is mocked."""

from __future__ import annotations

import os
from pathlib import Path

import msgpack
import pytest

from server_bridge.eventlog import MAX_RECORD_BYTES, EventLog, EventLogError, RecordTooLarge


def env(run: str, i: int, text: str = "x") -> bytes:
    return msgpack.packb({"r": run, "i": i, "t": "msg.delta", "ts": i, "d": {"m": 1, "text": text}})


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_runs_events_read_back_after_an_id_and_a_conversations_runs_in_order(
    tmp_path: Path,
) -> None:
    with EventLog(tmp_path / "log") as lg:
        for i in range(1, 6):
            lg.append("acme", "dev1", "b1.1", i, env("b1.1", i), usr="alice", conv="c1")
        lg.append("acme", "dev1", "b1.2", 1, env("b1.2", 1), usr="alice", conv="c1")
        lg.append("acme", "dev2", "b2.1", 1, env("b2.1", 1), usr="bob", conv="c2")
        lg.append("globex", "dev1", "b1.1", 1, env("b1.1", 1))  # another tenant, same ids
        got = lg.events("acme", "dev1", "b1.1", after=2)
        assert [e.i for e in got] == [3, 4, 5]
        assert got[0].payload == env("b1.1", 3) and got[0].usr == "alice" and got[0].conv == "c1"
        assert lg.runs_of("acme", "c1") == [("dev1", "b1.1"), ("dev1", "b1.2")]
        assert lg.runs_of("acme", "c2") == [("dev2", "b2.1")]
        # Tenants are apart: globex's run is its own, and acme's conversations are not.
        assert [e.i for e in lg.events("globex", "dev1", "b1.1")] == [1]
        assert lg.runs_of("globex", "c1") == []
        assert lg.events("acme", "dev9", "nope") == []


def test_a_reopened_log_has_every_record_and_appends_after_them(tmp_path: Path) -> None:
    with EventLog(tmp_path / "log", segment_bytes=MAX_RECORD_BYTES) as lg:
        for i in range(1, 301):  # several segments
            lg.append("acme", "dev1", "r", i, env("r", i, "y" * 300), conv="c")
        assert len(list((tmp_path / "log" / "acme").glob("*.seg"))) > 1
    with EventLog(tmp_path / "log", segment_bytes=MAX_RECORD_BYTES) as lg:
        assert [e.i for e in lg.events("acme", "dev1", "r")] == list(range(1, 301))
        lg.append("acme", "dev1", "r", 301, env("r", 301))
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


def test_retention_drops_whole_oldest_segments_by_bytes_and_by_age(tmp_path: Path) -> None:
    clock = Clock()
    with EventLog(tmp_path / "log", segment_bytes=MAX_RECORD_BYTES, clock=clock) as lg:
        for i in range(1, 601):
            if i == 301:
                clock.now += 3600  # the second half an hour later
            lg.append("acme", "dev1", "r", i, env("r", i, "z" * 300), conv="c")
        lg.append("other", "dev1", "r", 1, env("r", 1))
        segs = len(list((tmp_path / "log" / "acme").glob("*.seg")))
        before = lg.tenant_bytes("acme")
        # By age: what is older than 30 minutes goes, in whole segments.
        gone = lg.retain("acme", max_age_s=1800)
        assert gone >= 1
        first = lg.events("acme", "dev1", "r")[0].i
        assert 1 < first <= 301
        # By bytes: down to about one segment; never the current one.
        lg.retain("acme", max_bytes=MAX_RECORD_BYTES)
        left = lg.events("acme", "dev1", "r")
        assert left and left[-1].i == 600 and lg.tenant_bytes("acme") < before
        assert len(list((tmp_path / "log" / "acme").glob("*.seg"))) < segs
        # However small the limit, the current segment stays: appends go on there.
        lg.retain("acme", max_bytes=0)
        assert len(list((tmp_path / "log" / "acme").glob("*.seg"))) == 1
        assert lg.events("acme", "dev1", "r")[-1].i == 600
        kept = [e.i for e in lg.events("acme", "dev1", "r")]
        # Another tenant's log is untouched.
        assert [e.i for e in lg.events("other", "dev1", "r")] == [1]
    # What retention dropped stays dropped after a reopen.
    with EventLog(tmp_path / "log", segment_bytes=MAX_RECORD_BYTES) as lg:
        assert [e.i for e in lg.events("acme", "dev1", "r")] == kept


def test_bad_input_is_refused_by_name_and_nothing_is_written(tmp_path: Path) -> None:
    with EventLog(tmp_path / "log") as lg:
        lg.append("acme", "dev1", "r", 1, env("r", 1))
        size = lg.tenant_bytes("acme")
        with pytest.raises(RecordTooLarge):
            lg.append("acme", "dev1", "r", 2, b"x" * (MAX_RECORD_BYTES + 1))
        for tenant in ("../etc", "ACME", "", "a/b"):
            with pytest.raises(EventLogError):
                lg.append(tenant, "dev1", "r", 1, b"x")
        assert lg.tenant_bytes("acme") == size
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
