"""The README read top to bottom: every command of its ```sh blocks, in order, run as a
reader runs them, in one fresh directory (a checkout in which nothing has run yet: no
`.wren/`, HOME and the XDG directories empty), each expected to work as written.

What the walk changes, and why (each applies to every command alike):

- `sh tools/setup.sh && ` is dropped: the test runs in the environment it made.
- The reader's anonymous broker on 127.0.0.1:1883 is a Mosquitto of the walk's own, and
  each port the commands name is a free port: one to one, so two commands that collide
  as written (two listeners on one port) collide here too.
- A command that runs until stopped (`LONG`) starts in the background, is waited for
  until it is up, and is stopped (SIGTERM) at the end of its block: it must still be
  running then. A host that asks on the terminal is answered on its stdin (`ANSWERS`).

The commands it does not run are in `SKIP`, each with the reason.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as paho
import pytest

from tools.broker import free_port, mosquitto_binary, start_mosquitto, wait_for_port
from tools.virtual_board import micropython_binary

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# What the fresh directory shares with the checkout: its code and its venv, read only.
CHECKOUT = (".venv", "tools", "examples", "edge_runtime", "firmware_tests", "benchmarks")
SETUP = "sh tools/setup.sh && "
# A piece of the command -> why the walk does not run it.
SKIP = {
    "python -m pytest": "the whole suite, of which this test is a part",
    "mqtt.example": "a broker on another host, and a password left as `...`",
    "wren hil --pty": "every board module on a pty, minutes (tests/test_cli.py runs hil)",
    "wren hil --port": "a real board on a serial port",
    "--port /dev/tty": "a real board on a serial port (tests/test_flash.py and "
    "tests/test_provision.py run `wren flash` and `wren provision` against a board on a pty)",
    "cd examples/hil": "the example's tests, which tests/test_hil_plugin.py runs as a user would",
    "benchmarks/": "a benchmark takes minutes (tests/test_benchmarks.py runs them small)",
    "WREN_FLEET_DSN": "a PostgreSQL server and a broker cluster of the reader's "
    "(tests/test_fleet_*.py run fleets on servers of their own)",
}
# Commands that run until stopped: a piece of the command -> how the walk knows it is up.
LONG = {
    "wren bridge --": "line:bridge: ",
    "wren board --virtual": "hello",
    "mosquitto -c": "port",
}
# What a reader types to a command that asks on the terminal (the README's own answers).
ANSWERS = {"examples/greenhouse/host.py": "y\nno feeding today\n"}
READER_BROKER = "127.0.0.1:1883"
COMMAND_TIMEOUT_S = 90.0
UP_TIMEOUT_S = 30.0


def readme_commands() -> list[list[str]]:
    """The README's ```sh blocks, each a list of commands (a line ending in a backslash
    goes on with the next)."""
    blocks = re.findall(r"^```sh\n(.*?)^```", README.read_text(), re.M | re.S)
    out = []
    for block in blocks:
        commands = []
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip():
                commands.append(line.strip())
        out.append(commands)
    return out


def kiosk_answer() -> list[str]:
    """What the README shows `wren ask` printing for the kiosk: its answer and its first
    citation, each up to where a run's own figures (score, tokens) begin."""
    m = re.search(r"^```\n(you: How do I reset the printer\?\n.*?)^```", README.read_text(),
                  re.M | re.S)  # fmt: skip
    assert m, "the README's kiosk answer"
    lines = m.group(1).splitlines()
    answer = next(x for x in lines if x.startswith("assistant: "))
    source = next(x for x in lines if x.startswith("source [1] "))
    assert ", score " in source, source
    return [answer, source.split(", score ")[0] + ", score "]


def skipped(command: str) -> str | None:
    return next((why for piece, why in SKIP.items() if piece in command), None)


@dataclass
class Running:
    command: str
    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class Walk:
    """The fresh directory, the reader's broker, and the commands run in it."""

    def __init__(self, work: Path, broker_port: int) -> None:
        self.work = work
        self.broker_port = broker_port
        # Port as written -> the walk's port; the reader's broker is the walk's own.
        self.ports = {1883: broker_port}
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("WREN_", "OPENAI_"))}
        home = work.parent / "home"
        self.env.update(
            HOME=str(home),
            XDG_CONFIG_HOME=str(home / ".config"),
            XDG_CACHE_HOME=str(home / ".cache"),
            XDG_DATA_HOME=str(home / ".local/share"),
            PYTHONUNBUFFERED="1",
        )
        self.env.pop("PYTHONPATH", None)
        self.logs = 0

    def rewrite(self, command: str) -> str:
        command = command.removeprefix(SETUP)

        def port(m: re.Match[str]) -> str:
            written = int(m.group(2))
            if written not in self.ports:
                self.ports[written] = free_port()
            return f"{m.group(1)}{self.ports[written]}"

        # HOST:PORT, and --port N.
        return re.sub(r"((?:\d+\.){3}\d+:|--port )(\d{4,5})\b", port, command)

    def _log(self) -> Path:
        self.logs += 1
        return self.work.parent / f"command-{self.logs}.log"

    def run(self, command: str) -> str:
        """A command that ends: it must exit 0. Returns its output."""
        log = self._log()
        answers = next((a for piece, a in ANSWERS.items() if piece in command), "")
        with open(log, "wb") as f:
            proc = subprocess.run(
                ["bash", "-c", command],
                cwd=self.work,
                env=self.env,
                input=answers.encode(),
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=COMMAND_TIMEOUT_S,
                start_new_session=True,
            )
        text = log.read_text(errors="replace")
        assert proc.returncode == 0, f"`{command}` exited {proc.returncode}:\n{text}"
        return text

    def start(self, command: str, up: str) -> Running:
        """A command that runs until stopped, waited for until it is up."""
        log = self._log()
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                ["bash", "-c", command],
                cwd=self.work,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        running = Running(command, proc, log)
        deadline = time.monotonic() + UP_TIMEOUT_S
        while not self._up(running, up):
            assert proc.poll() is None, f"`{command}` exited {proc.returncode}:\n{running.output()}"
            assert time.monotonic() < deadline, f"`{command}` not up:\n{running.output()}"
            time.sleep(0.1)
        return running

    def _up(self, running: Running, up: str) -> bool:
        if up.startswith("line:"):
            return any(line.startswith(up[5:]) for line in running.output().splitlines())
        if up == "port":
            ports = [int(p) for p in re.findall(r"--port (\d+)", running.command)]
            try:
                wait_for_port("127.0.0.1", ports[0], timeout_s=0.2)
            except Exception:
                return False
            return True
        device = re.search(r"--device (\S+)", running.command)
        return device is not None and self._hello(device.group(1))

    def _hello(self, device: str) -> bool:
        """Whether the board's retained hello is at the walk's broker: it is connected."""
        got: list[bytes | bytearray] = []
        client = paho.Client(paho.CallbackAPIVersion.VERSION2)
        client.on_message = lambda _c, _u, msg: got.append(msg.payload)
        client.connect("127.0.0.1", self.broker_port)
        client.subscribe(f"wren/v1/d/{device}/hello", qos=1)
        client.loop_start()
        try:
            deadline = time.monotonic() + 1.0
            while not got and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            client.loop_stop()
            client.disconnect()
        return bool(got)

    def stop(self, running: Running) -> str:
        """Stop a command that runs until stopped: it must not have ended by itself."""
        text = running.output()
        assert running.proc.poll() is None, (
            f"`{running.command}` ended by itself ({running.proc.returncode}):\n{text}"
        )
        os.killpg(running.proc.pid, signal.SIGTERM)
        try:
            running.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(running.proc.pid, signal.SIGKILL)
            running.proc.wait()
            pytest.fail(f"`{running.command}` did not stop on SIGTERM:\n{text}")
        return running.output()


@pytest.fixture
def walk() -> Iterator[Walk]:
    if mosquitto_binary() is None or micropython_binary() is None:
        pytest.skip("needs Mosquitto and the MicroPython unix port (tools/setup.sh)")
    # Under /tmp and reachable by others, as a checkout usually is: Mosquitto started as
    # root switches to its own user, which must reach the broker files.
    top = Path(tempfile.mkdtemp(prefix="wren-readme-", dir="/tmp"))
    try:
        os.chmod(top, 0o755)
        work = top / "checkout"
        work.mkdir()
        for name in CHECKOUT:
            (work / name).symlink_to(ROOT / name)
        broker = start_mosquitto(top / "broker")
        try:
            yield Walk(work, broker.port)
        finally:
            broker.stop()
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_the_readme_commands_run_in_order_on_a_fresh_directory(walk: Walk) -> None:
    blocks = readme_commands()
    ran = []
    for block in blocks:
        running: list[Running] = []
        try:
            for written in block:
                if skipped(written):
                    continue
                command = walk.rewrite(written)
                up = next((u for piece, u in LONG.items() if piece in command), None)
                if up is not None:
                    running.append(walk.start(command, up))
                else:
                    out = walk.run(command)
                    if "examples/greenhouse/host.py" in command:
                        # The prompts come after the run's lines up to its pause, not
                        # among them, and the answer's messages stand apart.
                        lines = out.splitlines()
                        paused = next(i for i, x in enumerate(lines) if x.startswith("run.paused"))
                        assert lines[paused + 1].startswith("approve open_valve"), out
                        assert "ask about feeding.\n\nBed 2 is being watered." in out, out
                    if "wren ask" in command and "--device shop1" in command:
                        # The kiosk answers from its manuals, citing them as the README
                        # shows (the scores aside: they are the ranking's, not the page's).
                        lines = out.splitlines()
                        for want in kiosk_answer():
                            assert any(x.startswith(want) for x in lines), (want, out)
                ran.append(written)
        except BaseException:
            for r in running:  # the failure is the one to see, not the stops'
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(r.proc.pid, signal.SIGKILL)
                r.proc.wait()
            raise
        outputs = [walk.stop(r) for r in reversed(running)]
        for out in outputs:
            assert "should not be run as root" not in out, out
    # Everything the walk did not run, it skipped by name.
    assert ran and all(skipped(c) for b in blocks for c in b if c not in ran)


def test_the_walk_skips_only_what_it_names() -> None:
    commands = [c for b in readme_commands() for c in b]
    assert any("wren device add kiosk1" in c for c in commands)
    assert any("wren ask" in c and "--device shop1" in c for c in commands)
    assert kiosk_answer()[1].startswith("source [1] printer.md — ")
    for piece in SKIP:
        assert any(piece in c for c in commands), f"SKIP names {piece!r}, not in the README"
