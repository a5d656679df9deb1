"""The event log on PostgreSQL (server_bridge/pgstore/eventlog.py) next to the file log
(server_bridge/eventlog/) in the same run, on the same events.

- Append: N events of stream-shaped runs (a 64-character `msg.delta` envelope, about
  110 bytes; 50 events a run), one `append` each, then `sync()`: events/s from the first
  append to everything durable (file: written and fsynced; PostgreSQL: committed, the
  server with fsync and synchronous_commit on), and what one `append` call costs the
  caller (the relay's share: PostgreSQL's is a queue put, its writes are on its own
  thread).
- Read: "the events of run R after id X" (X = 10, so 40 events), one call each over
  runs spread across the log: p50 and p99 latency.
- Ratios: PostgreSQL over file.

The server is one of the benchmark's own (tools/pg_server.py, `durable=True`), on the
same machine, over loopback TCP.

    python benchmarks/bench_eventlog_pg.py [--events 200000] [--reads 2000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack  # noqa: E402

from server_bridge.eventlog import EventLog  # noqa: E402
from server_bridge.pgstore.eventlog import LogBehind, PgEventLog  # noqa: E402
from tools.pg_server import PgMissing, start_postgres  # noqa: E402

COMMAND = "python benchmarks/bench_eventlog_pg.py"
RUN_LEN = 50  # events per run
AFTER = 10  # reads ask for a run's events after this id


def envelope(run: str, i: int) -> bytes:
    return msgpack.packb({"r": run, "i": i, "t": "msg.delta", "ts": 1_765_000_000_000 + i,
                          "d": {"m": 1, "text": "x" * 64}})  # fmt: skip


def measure(lg: Any, payloads: list[bytes], reads: int) -> dict[str, float]:
    n = len(payloads)
    calls = 0.0
    behind = 0
    t0 = time.perf_counter()
    for k, p in enumerate(payloads):
        while True:
            c0 = time.perf_counter()
            try:
                lg.append("bench", "dev1", f"b1.{k // RUN_LEN}", k % RUN_LEN + 1, p,
                          usr="alice", conv=f"c{k // (RUN_LEN * 10)}")  # fmt: skip
            except LogBehind:
                # Appends outran the database (this loop offers far more than a relay):
                # wait for the queue to be written, as the rate is the writer's then.
                # The wait is not an append's cost.
                behind += 1
                lg.sync()
                continue
            calls += time.perf_counter() - c0
            break
    lg.sync()
    total = time.perf_counter() - t0
    runs = n // RUN_LEN
    step = max(1, runs // reads)
    lat = []
    got = 0
    for r in range(0, runs, step):
        c0 = time.perf_counter()
        got += len(lg.events("bench", "dev1", f"b1.{r}", after=AFTER))
        lat.append(time.perf_counter() - c0)
    assert got == len(lat) * (RUN_LEN - AFTER), "a read came back short"
    q = statistics.quantiles(lat, n=100)
    return {"rate": n / total, "call_us": calls / n * 1e6, "p50_ms": q[49] * 1e3,
            "p99_ms": q[98] * 1e3, "reads": len(lat), "behind": behind}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--reads", type=int, default=2_000)
    args = ap.parse_args()
    n = args.events
    print(f"# {COMMAND} {' '.join(sys.argv[1:])}".rstrip())
    payloads = [envelope(f"b1.{k // RUN_LEN}", k % RUN_LEN + 1) for k in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with EventLog(root / "log") as lg:
            file = measure(lg, payloads, args.reads)
        try:
            pg = start_postgres(root, durable=True)
        except PgMissing as e:
            sys.exit(f"no PostgreSQL to measure: {e}")
        try:
            with PgEventLog(pg.dsn) as lg:
                pgm = measure(lg, payloads, args.reads)
                batches = lg.flushes
        finally:
            pg.stop()
    print(
        f"append, {n:,} events to durable: file {file['rate']:,.0f}/s, PostgreSQL "
        f"{pgm['rate']:,.0f}/s ({pgm['rate'] / file['rate']:.2f}x; {batches:,} batches, "
        f"{n / max(batches, 1):,.0f} events each; the queue was full {pgm['behind']:,.0f}"
        " times, and the loop waited for it)"
    )
    print(
        f"append call (the relay's cost): file {file['call_us']:.1f} us, PostgreSQL "
        f"{pgm['call_us']:.1f} us ({pgm['call_us'] / file['call_us']:.2f}x)"
    )
    print(
        f"read run R after {AFTER} ({RUN_LEN - AFTER} events, {pgm['reads']:,.0f} reads): "
        f"p50 file {file['p50_ms']:.3f} ms, PostgreSQL {pgm['p50_ms']:.3f} ms "
        f"({pgm['p50_ms'] / file['p50_ms']:.1f}x); p99 file {file['p99_ms']:.3f} ms, "
        f"PostgreSQL {pgm['p99_ms']:.3f} ms ({pgm['p99_ms'] / file['p99_ms']:.1f}x)"
    )
    print(f"# reproduce: {COMMAND} {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
