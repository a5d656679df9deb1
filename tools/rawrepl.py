"""Drive a MicroPython target through its raw REPL: the path a USB serial console
takes to a real board, and the one the hardware-in-loop tests take to the unix port
through a pty when no board is attached.

Raw REPL, as MicroPython speaks it: Ctrl-C stops whatever runs, Ctrl-A enters raw mode
(the board answers "raw REPL; CTRL-B to exit" and ">"); code is written followed by
Ctrl-D; the board answers "OK", then the code's output, Ctrl-D, its exception text (if
any), Ctrl-D and ">" again. Every read here has a deadline.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time
import tty
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tools.owned_process import stop_process

CTRL_A, CTRL_B, CTRL_C, CTRL_D = b"\x01", b"\x02", b"\x03", b"\x04"
RAW_BANNER = b"raw REPL; CTRL-B to exit\r\n>"
# Real boards' USB CDC buffers are small; code goes out in pieces this size.
WRITE_CHUNK = 256


class ReplError(RuntimeError):
    """The target did not answer as the raw REPL protocol says, or not in time."""


class Transport(Protocol):
    def read(self, timeout_s: float) -> bytes: ...

    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...


@dataclass
class ExecResult:
    out: str
    err: str

    @property
    def ok(self) -> bool:
        return not self.err


class RawRepl:
    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._buf = b""

    def _read_until(self, marker: bytes, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        while marker not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                tail = self._buf[-200:]
                raise ReplError(f"no {marker!r} from the target within {timeout_s}s; got {tail!r}")
            try:
                self._buf += self.transport.read(min(left, 0.2))
            except ReplError as e:
                raise ReplError(f"{e}; got {self._buf[-200:]!r}") from None
        head, _, self._buf = self._buf.partition(marker)
        return head

    def enter(self, timeout_s: float = 10.0) -> None:
        """Interrupt whatever runs and switch to raw mode."""
        self.transport.write(b"\r" + CTRL_C + CTRL_C)
        time.sleep(0.1)
        self._buf = b""
        self.transport.write(b"\r" + CTRL_A)
        self._read_until(RAW_BANNER, timeout_s)

    def exec(self, code: str, timeout_s: float = 60.0) -> ExecResult:
        data = code.encode()
        for i in range(0, len(data), WRITE_CHUNK):
            self.transport.write(data[i : i + WRITE_CHUNK])
        self.transport.write(CTRL_D)
        self._read_until(b"OK", 10.0)
        out = self._read_until(CTRL_D, timeout_s)
        err = self._read_until(CTRL_D, 10.0)
        self._read_until(b">", 10.0)
        return ExecResult(out.decode(errors="replace"), err.decode(errors="replace"))

    def close(self) -> None:
        try:
            self.transport.write(b"\r" + CTRL_B)
        except OSError:
            pass  # a target that has exited has no console to leave raw mode on
        finally:
            self.transport.close()


class PtyTransport:
    """The unix port on a pseudo-terminal: a board-like serial console on this machine."""

    def __init__(self, argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None):
        master, slave = pty.openpty()
        # Raw mode, as a UART or USB CDC line is: no echo and no "\n" -> "\r\n" rewriting
        # by the terminal driver, so the target's bytes arrive exactly as sent.
        tty.setraw(slave)
        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env, close_fds=True
        )
        os.close(slave)
        self.fd = master

    def read(self, timeout_s: float) -> bytes:
        ready, _, _ = select.select([self.fd], [], [], max(timeout_s, 0))
        if not ready:
            return b""
        try:
            return os.read(self.fd, 4096)
        except OSError:  # the pty reads as EIO once the target has closed it
            if self.proc.poll() is not None:
                # Said at once: no answer can come, so no deadline needs waiting out.
                raise ReplError(f"the target exited (status {self.proc.returncode})") from None
            time.sleep(timeout_s)
            return b""

    def write(self, data: bytes) -> None:
        os.write(self.fd, data)

    def close(self) -> None:
        stop_process(self.proc)
        os.close(self.fd)


class SerialTransport:
    """A real board on a serial port (USB CDC or UART), through pyserial."""

    def __init__(self, port: str, baud: int = 115200) -> None:
        import serial  # lazy: only a real board needs it

        self.serial = serial.Serial(port, baud, timeout=0)

    def read(self, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        while True:
            data = bytes(self.serial.read(4096))
            if data or time.monotonic() >= deadline:
                return data
            time.sleep(0.01)

    def write(self, data: bytes) -> None:
        self.serial.write(data)
        self.serial.flush()

    def close(self) -> None:
        self.serial.close()


def unix_port_console(
    exe: str, heap: str, path: list[Path], env: dict[str, str] | None = None
) -> RawRepl:
    """Start the unix port's interactive REPL on a pty and enter raw mode.

    path[0] is the board's flash root, and the process runs there: the REPL's sys.path
    starts with "" (the working directory), as a board's does, so run from a Wren
    checkout it would import edge_runtime/*.py, compiled in the target's own heap, ahead
    of the .mpy package in path[0], and run out of memory where a board does not.
    """
    full_env = dict(os.environ if env is None else env)
    full_env["MICROPYPATH"] = ":".join(str(p) for p in path) + ":.frozen"
    argv = [exe, "-X", f"heapsize={heap}", "-i"]
    repl = RawRepl(PtyTransport(argv, cwd=path[0], env=full_env))
    try:
        repl.enter()
    except ReplError:
        repl.transport.close()
        raise
    return repl


def run_test_module(
    repl: RawRepl,
    module: str,
    setup: dict[str, object] | None = None,
    timeout_s: float = 300.0,
) -> ExecResult:
    """Run one firmware test module on the target with firmware_tests/runner.py;
    `setup` (names for firmware_tests.support, as Python literals) is set once the module
    is imported."""
    call = f"report({module!r}, None, {setup!r})" if setup else f"report({module!r})"
    return repl.exec(f"from firmware_tests.runner import report\n{call}\n", timeout_s=timeout_s)


def summary(result: ExecResult) -> tuple[int, int] | None:
    """(passed, failed) from the runner's closing line, None when there is none."""
    lines = [line.strip() for line in result.out.splitlines() if line.strip()]
    if not lines:
        return None
    words = lines[-1].split()
    if len(words) == 4 and words[1] == "passed," and words[3] == "failed":
        return int(words[0]), int(words[2])
    return None


Opener = Callable[[], RawRepl]
