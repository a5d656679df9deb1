"""The virtual board dies with the process that owns it (issue 25, item 10).

`wren board --virtual` killed by SIGKILL once left its MicroPython process running in
a session of its own: it kept its link to the broker, served requests and shared the
device's identity with the next `wren board`. Here the real command runs against a
Mosquitto of the test's own, is killed, and its board must be gone and its connection
closed at the broker.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools.broker import MosquittoProcess, start_mosquitto
from tools.virtual_board import micropython_binary

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "owned1"
# Generous bounds for "it happened": the board ends within milliseconds of its owner.
START_TIMEOUT_S = 60.0
GONE_TIMEOUT_S = 10.0


def _wren() -> list[str]:
    # The installed console script, as a user runs it ([project.scripts] in pyproject).
    script = Path(sys.executable).parent / "wren"
    return [str(script)] if script.exists() else [sys.executable, "-m", "tools.cli"]


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        found += [int(c) for c in children.read_text().split()]
    return found


def _cwd(pid: int) -> Path | None:
    try:
        return (Path(f"/proc/{pid}") / "cwd").resolve(strict=True)
    except OSError:
        return None


def _alive(pid: int) -> bool:
    # A zombie has ended: an orphan is reaped by whoever adopted it, and in a container
    # that may be no one.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[MosquittoProcess]:
    b = start_mosquitto(tmp_path / "mosquitto")
    yield b
    b.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.skipif(micropython_binary() is None, reason="no MicroPython unix port")
def _gone_from(log: str) -> bool:
    """Whether Mosquitto's log says the device's connection went: "closed its
    connection" when the socket closed between packets, "disconnected: <reason>" when
    it closed in the middle of one (a board killed as it wrote its status, on a loaded
    machine: "disconnected: Success")."""
    return (
        f"Client {DEVICE} closed its connection" in log or f"Client {DEVICE} disconnected" in log
    )


def test_a_killed_wren_board_takes_its_micropython_board_with_it(
    own_broker: MosquittoProcess, tmp_path: Path
) -> None:
    flash = (tmp_path / "flash").resolve()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    args = ["board", "--virtual", "--broker", own_broker.address, "--device", DEVICE]
    wren = subprocess.Popen(
        [*_wren(), *args, "--flash", str(flash)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []

    def read() -> None:
        assert wren.stdout is not None
        for line in wren.stdout:
            lines.put(line.rstrip())

    threading.Thread(target=read, daemon=True).start()
    board: list[int] = []
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not any("link: up" in line for line in seen):
            assert time.monotonic() < deadline, "no `link: up`:\n" + "\n".join(seen)
            assert wren.poll() is None, "wren board exited:\n" + "\n".join(seen)
            try:
                seen.append(lines.get(timeout=0.5))
            except queue.Empty:
                continue
        # The MicroPython process: the child of `wren board` that runs in the flash.
        board = [pid for pid in _children(wren.pid) if _cwd(pid) == flash]
        assert len(board) == 1, (board, _children(wren.pid))
        assert not _gone_from(own_broker.log())

        wren.kill()
        wren.wait(timeout=10)

        deadline = time.monotonic() + GONE_TIMEOUT_S
        while _alive(board[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(board[0]), f"the board (pid {board[0]}) outlived its owner"
        # The broker saw the device's connection go: its identity is free for the next
        # `wren board`, and nothing of the old one answers for it.
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while not _gone_from(own_broker.log()):
            assert time.monotonic() < deadline, own_broker.log()[-2000:]
            time.sleep(0.05)
    finally:
        if wren.poll() is None:
            wren.kill()
            wren.wait()
        # Before the fix the board outlives the test: end it here, it is ours.
        for pid in board:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
