"""Request -> first `msg.delta` while `wren kb ingest` embeds a large folder on the same
machine, next to the same figure without it, in one run (issue 26: within 1.5x).

One real stack (tests/stack.py: Mosquitto, `wren bridge`, the board's .mpy on the
MicroPython unix port) whose model is tests/model_server.py streaming a few hundred
characters in small chunks. A folder of generated Markdown is written once (by default
1,000 files of about 10 chunks: 10,000 chunks at the default chunk size). Then, in
rounds, blocks of N requests, one at a time, each timed from the host's publish to its
first `msg.delta` at the host: a block without an ingest, then a block while a fresh
`wren kb ingest` subprocess (embedding, a store of its own so nothing is skipped as
unchanged) works on the folder; once for each politeness mode:

  polite   the defaults: the ingest lowers its priority by 10 (`--nice 10`) and
           embeds on 2 onnxruntime threads (`--threads 2`)
  idle     `--idle` too (Linux SCHED_IDLE: CPU time nothing else wants)
  off      `--nice 0`: the same ingest at the bridge's priority
  1thread, 1thread-off   polite and off with `--threads 1` (not run by default)

Baseline and ingest blocks alternate, so the machine's noise hits both. Each ingest is
given WARM_S to load its model, then runs through its block (about 15 s) and is
stopped: at 17-27 chunks/s on a 2-core machine a whole 10,000-chunk ingest takes 6-10
minutes per mode, so each block measures the first seconds of an ingest of the
10,000-chunk folder, a fresh one each time (the work is the same from the first file to
the last: read, chunk, embed, a write every WRITE_BATCH_CHUNKS).
It runs on a pseudo-terminal, as from a shell, so it draws its progress line;
its chunks/s during a block is the growth of that line's "embedded" count over the
block, and its CPU share user + system seconds over the block's (1.0 = one core).

    python benchmarks/bench_ingest_load.py                  # about 3 minutes
    python benchmarks/bench_ingest_load.py --rounds 3 --requests 15 --modes polite,off

Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import logging
import os
import pty
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from server_bridge.host.reducer import RunSnapshot  # noqa: E402
from tests.model_server import ModelServer, Turn  # noqa: E402
from tests.stack import Stack, assistant_text  # noqa: E402

# The answer: a few hundred characters in 8-character chunks, 5 ms apart, as a model's
# tokens come.
ANSWER = (
    "The greenhouse is at 21.5 degrees and the humidity is 64 percent. The vents are "
    "closed and the heater is idle; the soil sensors in beds two and four read dry, so "
    "the drip line will open at six as scheduled. Nothing needs your attention now, "
    "and I will tell you if the temperature leaves the range you set this morning."
)
CHUNK_CHARS = 8
CHUNK_DELAY_S = 0.005
MODES: dict[str, list[str]] = {
    "polite": [],  # the defaults: --nice 10 --threads 2
    "idle": ["--idle"],
    "off": ["--nice", "0"],
    "1thread": ["--threads", "1"],
    "1thread-off": ["--threads", "1", "--nice", "0"],
}# Seconds for an ingest to import, load the model and start embedding before its block.
WARM_S = 5.0
# A generated file's paragraphs: about 10 chunks of the default 1,000 characters.
PARAGRAPHS = 20
_EMBEDDED = re.compile(r"embedded (\d+)")
WORDS = (
    "valve sensor reading humidity pressure board relay firmware greenhouse pump "
    "calibrate schedule threshold alarm battery voltage current kiosk manual reagent "
    "sample gloves reset button display network broker topic message retry interval "
    "soil moisture light window heater fan filter water tank level flow meter log"
).split()


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_folder(root: Path, files: int, seed: int = 26) -> None:
    """`files` Markdown files of PARAGRAPHS paragraphs under headings (deterministic)."""
    rng = random.Random(seed)
    for f in range(files):
        sub = root / f"part{f // 100:02d}"
        sub.mkdir(parents=True, exist_ok=True)
        lines = [f"# Document {f}\n"]
        for p in range(PARAGRAPHS):
            if p % 5 == 0:
                lines.append(f"## Section {p // 5}\n")
            sentences = []
            for _ in range(5):
                words = rng.choices(WORDS, k=rng.randint(8, 14))
                sentences.append(" ".join(words).capitalize() + ".")
            lines.append(" ".join(sentences) + "\n")
        (sub / f"doc{f:04d}.md").write_text("\n".join(lines))


class Ingest:
    """`wren kb ingest` as a subprocess on a pseudo-terminal, so it draws its live
    progress line (embedded chunks so far), which a thread reads."""

    def __init__(self, folder: Path, store: Path, extra: Sequence[str]) -> None:
        self.started = time.monotonic()
        master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tools.cli", "kb", "ingest", str(folder), "--tenant",
             "bench", "--collection", "load", "--store", str(store), *extra],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
        )
        os.close(slave)
        self._master = master
        self.embedded = 0
        self.tail = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buf = ""
        while True:
            try:
                data = os.read(self._master, 4096)
            except OSError:  # the child closed the terminal
                return
            if not data:
                return
            buf = (buf + data.decode(errors="replace"))[-2000:]
            found = _EMBEDDED.findall(buf)
            if found:
                self.embedded = int(found[-1])
            self.tail = buf[-300:]

    def cpu_s(self) -> float:
        """User + system seconds of the ingest so far (/proc)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def mark(self) -> tuple[float, int, float]:
        """(now, chunks embedded so far, CPU seconds so far)."""
        return time.monotonic(), self.embedded, self.cpu_s()

    def stop(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the ingest ended before its block did: {self.tail!r}")
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        os.close(self._master)


@dataclass
class Mode:
    without: list[float] = field(default_factory=list)
    during: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def first_deltas(s: Stack, n: int) -> list[float]:
    """N requests one at a time: each one's milliseconds to its first msg.delta."""
    first: dict[str, float] = {}

    def on_event(event: dict[str, Any], snap: RunSnapshot) -> None:
        if event["t"] == "msg.delta" and snap.req is not None:
            first.setdefault(snap.req, time.monotonic())

    assert s.client is not None
    s.client.on_event = on_event
    out = []
    try:
        for _ in range(n):
            t0 = time.monotonic()
            req = s.request("How is the greenhouse?")
            snap = s.wait_run(req, timeout=60)
            if snap.status != "done" or assistant_text(snap) != ANSWER or req not in first:
                raise RuntimeError(f"run {snap.run}: {snap.status} {snap.error}\n{s.describe()}")
            out.append((first[req] - t0) * 1000)
            time.sleep(0.05)
    finally:
        s.client.on_event = None
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every mode (2)")
    parser.add_argument("--requests", type=int, default=40, help="requests a block (40)")
    parser.add_argument("--files", type=int, default=1000,
                        help="generated files of about 10 chunks each (1000)")
    parser.add_argument("--modes", default="polite,idle,off",
                        help=f"comma-separated, of {', '.join(MODES)} (polite,idle,off)")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes from {', '.join(MODES)}")
    logging.basicConfig(level=logging.ERROR, format="%(name)s: %(message)s")
    command = "python benchmarks/bench_ingest_load.py " + " ".join(sys.argv[1:])
    started = time.monotonic()
    results = {m: Mode() for m in modes}
    turn = Turn(text=ANSWER, chunk_chars=CHUNK_CHARS, delay_s=CHUNK_DELAY_S)
    with tempfile.TemporaryDirectory(prefix="wren-bench-ingest-") as tmp:
        work = Path(tmp)
        folder = work / "docs"
        progress(f"writing {args.files} files ...")
        make_folder(folder, args.files)
        with ModelServer(script=[turn]) as server, Stack(work / "stack",
                                                         model_url=server.url) as s:
            first_deltas(s, 3)  # warm-up
            k = 0
            for r in range(args.rounds):
                for m in modes:
                    res = results[m]
                    progress(f"round {r + 1}: without an ingest ...")
                    res.without += first_deltas(s, args.requests)
                    k += 1
                    ingest = Ingest(folder, work / f"store{k}.sqlite3", MODES[m])
                    try:
                        time.sleep(WARM_S)
                        progress(f"round {r + 1}: during an ingest ({m}) ...")
                        t0, e0, c0 = ingest.mark()
                        res.during += first_deltas(s, args.requests)
                        t1, e1, c1 = ingest.mark()
                    finally:
                        ingest.stop()
                    res.rates.append((e1 - e0) / (t1 - t0))
                    res.cpu.append((c1 - c0) / (t1 - t0))
    print(f"\n$ {command}")
    print(f"{os.cpu_count()} cores; {args.files} files (about {args.files * 10:,} chunks); "
          f"{args.rounds} rounds x {args.requests} requests a block; "
          f"{time.monotonic() - started:.0f} s in all")
    print("request -> first msg.delta (ms)             p50     p95   ratio p50  ingest chunks/s  "
          "ingest CPU")
    for m in modes:
        res = results[m]
        w50, d50 = statistics.median(res.without), statistics.median(res.during)
        print(f"  {m:<12} without an ingest  {w50:7.1f} {pct(res.without, 0.95):7.1f}")
        print(f"  {m:<12} during the ingest  {d50:7.1f} {pct(res.during, 0.95):7.1f}"
              f"   {d50 / w50:5.2f}x   {statistics.mean(res.rates):10.1f}"
              f"      {statistics.mean(res.cpu) * 100:5.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
