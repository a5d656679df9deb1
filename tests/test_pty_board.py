"""The board on a pseudo-terminal (tools/pty_board.py) does what a board's serial
console does, for the clients a user points at a board: mpremote and pyserial."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import serial

from tools.pty_board import PtyBoard, PtyBoardError
from tools.virtual_board import micropython_binary

pytestmark = pytest.mark.skipif(
    micropython_binary() is None, reason="no MicroPython unix port on this platform"
)

MAIN = "import time\nprint('main.py runs')\nwhile True:\n    time.sleep_ms(50)\n"


def mpremote(port: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "mpremote", "connect", port, *args],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture
def board(tmp_path: Path) -> Iterator[PtyBoard]:
    (tmp_path / "main.py").write_text(MAIN)
    with PtyBoard(tmp_path) as b:
        yield b


def test_it_boots_main_py_and_mpremote_execs_lists_and_copies(
    board: PtyBoard, tmp_path: Path
) -> None:
    port = board.start()
    board.wait_for("main.py runs")
    assert mpremote(port, "exec", "print(6 * 7)") == "42\n"
    (tmp_path / "local.txt").write_text("on the host")
    mpremote(port, "cp", str(tmp_path / "local.txt"), ":copied.txt")
    assert (board.flash / "copied.txt").read_text() == "on the host"
    listing = mpremote(port, "fs", "ls")
    assert " main.py\n" in listing and " copied.txt\n" in listing
    # The same console over TCP, by pyserial's URL.
    assert mpremote(board.url, "exec", "print('by socket')") == "by socket\n"


def test_soft_resets_reboot_on_the_same_port_as_a_board_does(board: PtyBoard) -> None:
    port = board.start()
    mark = board.wait_for("main.py runs")
    assert board.boots == 1
    # mpremote's soft reset, from the raw REPL: a reboot that does not run main.py.
    mpremote(port, "soft-reset")
    assert board.boots == 2
    assert "main.py runs" not in board.log[mark:]
    # `mpremote reset` (its own soft reset first, then machine.reset()): a reboot that
    # runs main.py.
    mpremote(port, "reset")
    board.wait_for("main.py runs", since=mark)
    assert board.boots == 4
    # Ctrl-C, then Ctrl-D at the friendly REPL: a soft reboot that runs main.py again.
    mark = board.log_end()
    with serial.Serial(port, 115200, timeout=0.1) as s:
        s.write(b"\x03")
        board.wait_for(">>> ", since=mark)
        s.write(b"\x04")
        at = board.wait_for("MPY: soft reboot\r\n", since=mark)
        board.wait_for("main.py runs", since=at)
    assert board.boots == 5
    assert board.start() == port  # the same device path throughout


def test_a_client_that_never_reads_does_not_stop_the_board(tmp_path: Path) -> None:
    (tmp_path / "main.py").write_text("i = 0\nwhile True:\n    print('x' * 60, i)\n    i += 1\n")
    with PtyBoard(tmp_path) as board, serial.Serial(board.start(), timeout=0):
        # 20,000 lines is ~1.3 MB, far past what the terminal and the relay hold: a
        # board held back by the deaf client would stop at a few hundred.
        board.wait_for(" 20000\n", timeout_s=60)


def test_wait_for_says_what_the_console_printed_when_it_times_out(board: PtyBoard) -> None:
    board.start()
    board.wait_for("main.py runs")
    with pytest.raises(PtyBoardError, match="main.py runs"):
        board.wait_for("never printed", timeout_s=0.5)


def test_a_flash_directory_that_is_not_there_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PtyBoardError, match="no flash directory"):
        PtyBoard(tmp_path / "nothing").start()
