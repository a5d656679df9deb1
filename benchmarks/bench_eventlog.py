"""The durable event log's cost (server_bridge/eventlog/): appending an event, reading a
run back, and reopening (the index rebuilt from the segments), next to the same bytes
written raw in the same run.

- Append: N events of a stream-shaped run (a 64-character `msg.delta` envelope, about
  110 bytes), one `EventLog.append` each, fsynced by the log's own thread every 0.2 s;
  next to a raw `os.write` of the same encoded envelopes to one file, fsynced as often.
  µs per event and the ratio.
- Read back: a run's events after an id (seeks), events/s.
- Reopen: the index rebuilt from every segment, ms per 100k events.

    python benchmarks/bench_eventlog.py [--events 200000]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack  # noqa: E402

from server_bridge.eventlog import EventLog  # noqa: E402

COMMAND = "python benchmarks/bench_eventlog.py"
RUN_LEN = 50  # events per run


def envelope(run: str, i: int) -> bytes:
    return msgpack.packb({"r": run, "i": i, "t": "msg.delta", "ts": 1_765_000_000_000 + i,
                          "d": {"m": 1, "text": "x" * 64}})  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=200_000)
    args = ap.parse_args()
    n = args.events
    print(f"# {COMMAND} {' '.join(sys.argv[1:])}".rstrip())
    payloads = [envelope(f"b1.{k // RUN_LEN}", k % RUN_LEN + 1) for k in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # Raw: the same bytes, one write each, fsynced every 0.2 s.
        fd = os.open(root / "raw.bin", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        t0 = last = time.perf_counter()
        for p in payloads:
            os.write(fd, p)
            now = time.perf_counter()
            if now - last >= 0.2:
                os.fsync(fd)
                last = now
        os.fsync(fd)
        raw = time.perf_counter() - t0
        os.close(fd)

        lg = EventLog(root / "log")
        t0 = time.perf_counter()
        for k, p in enumerate(payloads):
            lg.append("bench", "dev1", f"b1.{k // RUN_LEN}", k % RUN_LEN + 1, p,
                      usr="alice", conv=f"c{k // (RUN_LEN * 10)}")  # fmt: skip
        lg.sync()
        logged = time.perf_counter() - t0
        size = lg.tenant_bytes("bench")
        runs = n // RUN_LEN
        t0 = time.perf_counter()
        read = 0
        for r in range(0, runs, max(1, runs // 1000)):
            read += len(lg.events("bench", "dev1", f"b1.{r}", after=10))
        reading = time.perf_counter() - t0
        lg.close()
        t0 = time.perf_counter()
        EventLog(root / "log").close()
        reopen = time.perf_counter() - t0
    print(f"append: {logged / n * 1e6:.1f} us/event ({n:,} events, {size / n:.0f} B/event "
          f"on disk); raw write of the same bytes {raw / n * 1e6:.1f} us/event "
          f"({logged / raw:.1f}x)")
    print(f"read back after an id: {read / reading:,.0f} events/s ({read:,} events)")
    print(f"reopen (index rebuilt): {reopen * 1e3:.0f} ms for {n:,} events "
          f"({reopen * 1e3 * 100_000 / n:.0f} ms per 100k)")
    print(f"# reproduce: {COMMAND} {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
