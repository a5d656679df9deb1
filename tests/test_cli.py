"""The `wren` command line as a user runs it: each part as its own process against a
broker of the test's own, and `wren demo` failing loudly when a part cannot start."""

from __future__ import annotations

import json
import os
import pty
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from server_bridge import service, tokens
from server_bridge.brokerconf import check_password, secure_mosquitto_conf
from server_bridge.config import BridgeConfig
from server_bridge.host.client import HostClient, RequestRefused
from server_bridge.registry import DeviceRecord, Registry
from tests.stack import Stack, forget_bridge_status
from tests.test_brokerconf import Client, P
from tools.broker import (
    MosquittoMissing,
    MosquittoProcess,
    free_port,
    mosquitto_binary,
    start_mosquitto,
    wait_for_port,
)
from tools.cli import build_parser
from tools.virtual_board import (
    PY_HEAP,
    TRACEBACK,
    Console,
    micropython_binary,
    out_of_heap,
)

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 60.0


def wren(*args: str) -> list[str]:
    return [sys.executable, "-m", "tools.cli", *args]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    return env


class Proc:
    """A long-running `wren` process whose output lines are read on a thread."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.proc = subprocess.Popen(
            args, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip())

    def wait_for(self, needle: str) -> str:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None, "exited early:\n" + "\n".join(self.seen)
                continue
            self.seen.append(line)
            if needle in line:
                return line
        raise AssertionError(f"no line with {needle!r}:\n" + "\n".join(self.seen))

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout=15)


@pytest.fixture
def parts(broker: MosquittoProcess, tmp_path: Path) -> Iterator[tuple[Proc, Proc, str]]:
    address = broker.address
    bridge = Proc(wren("bridge", "--broker", address, "--device", "cli1"), tmp_path)
    bridge.wait_for("bridge: ")
    board = Proc(wren("board", "--virtual", "--broker", address, "--device", "cli1"), tmp_path)
    yield bridge, board, address
    for p in (board, bridge):
        if p.proc.poll() is None:
            p.stop()


def test_bridge_board_and_ask_as_separate_processes(
    parts: tuple[Proc, Proc, str], tmp_path: Path
) -> None:
    bridge, board, address = parts
    board.wait_for("link: up")
    ask = subprocess.run(
        wren("ask", "--broker", address, "--device", "cli1", "How warm is it in here?"),
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert ask.returncode == 0, ask.stdout + ask.stderr
    assert "assistant: It is 21.5 °C in here." in ask.stdout
    assert "status: done" in ask.stdout
    assert any(line.startswith("board: cli1 on micropython") for line in board.seen), board.seen
    # SIGTERM stops `wren board` like Ctrl-C (exit 130), and its MicroPython process
    # goes with it: nothing keeps running in the board's flash directory.
    assert board.stop() == 130
    flash = (tmp_path / ".wren" / "boards" / "cli1").resolve()
    deadline = time.monotonic() + 10
    while _processes_in(flash):
        assert time.monotonic() < deadline, f"still running in {flash}: {_processes_in(flash)}"
        time.sleep(0.1)


def test_the_greenhouse_example_runs_as_the_readme_says(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    # README "An example: the greenhouse": the bridge with the example's script, the
    # board with its main.py, and its host answering and approving on its own.
    address = broker.address
    example = ROOT / "examples" / "greenhouse"
    bridge = Proc(
        wren(
            "bridge",
            "--broker",
            address,
            "--device",
            "greenhouse1:greenhouse",
            "--script",
            str(example / "script.json"),
        ),
        tmp_path,
    )
    board = Proc(
        wren(
            "board",
            "--virtual",
            "--broker",
            address,
            "--device",
            "greenhouse1",
            "--heap",
            "144K",
            "--main",
            str(example / "main.py"),
        ),
        tmp_path,
    )
    try:
        bridge.wait_for("bridge: ")
        board.wait_for("link: up")
        host = subprocess.run(
            [sys.executable, str(example / "host.py"), "--broker", address, "--yes"]
            + ["--answer", "no feeding today"],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert host.returncode == 0, host.stdout + host.stderr
        lines = host.stdout.splitlines()
        assert "  edge /sense --dry--> /model" in lines
        assert lines[-2].endswith("The gardener says: no feeding today")
        assert lines[-1].startswith("nodes: /sense x1 completed, /model x3 completed")
        assert any("agent greenhouse" in line for line in board.seen), board.seen
    finally:
        for p in (board, bridge):
            if p.proc.poll() is None:
                p.stop()


def _processes_in(directory: Path) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "cwd").resolve() == directory:
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to look at
            continue
    return found


def _demo(*extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        wren("demo", "--once", *extra),
        cwd=ROOT,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_demo_with_the_board_on_cpython() -> None:
    proc = _demo("--cpython")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "on CPython" in proc.stdout and ".py files" in proc.stdout
    # Two turns: run.started, per turn msg.start, the first words at once, the rest
    # coalesced, msg.end; the tool call and its result; run.done (12), and the model
    # loop's nodes: per turn /model's node.start, usage and node.end, the tool's
    # node.start and node.end (8).
    assert "events: 20 " in proc.stdout


def test_demo_with_the_runtime_in_a_romfs_image_serves_every_turn_on_a_smaller_heap() -> None:
    # 96K beyond the image: the 64-bit memory turn from ROMFS needs 84 (bench_heap
    # --romfs), from .mpy on the heap 122.
    proc = _demo("--romfs", "--heap", "96K")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "heap 96K, the runtime in romfs.img (the heap is beyond it)" in proc.stdout
    statuses = [line for line in proc.stdout.splitlines() if line.startswith("status: ")]
    assert statuses and all(line.startswith("status: done") for line in statuses), proc.stdout
    refused = _demo("--romfs", "--py")
    assert refused.returncode == 1
    assert refused.stderr.strip() == (
        "wren demo: --romfs runs .mpy on the MicroPython unix port: not with --py or --cpython"
    )


def test_demo_says_which_part_failed_when_the_broker_is_unreachable() -> None:
    proc = _demo("--broker", f"127.0.0.1:{free_port()}")
    assert proc.returncode == 1
    assert "wren demo: the bridge did not start" in proc.stderr


def test_demo_says_how_to_get_mosquitto_when_it_is_missing(tmp_path: Path) -> None:
    # WREN_MOSQUITTO names the only binary to try (see tools/broker.py mosquitto_binary),
    # and the PATH it is looked up on holds no Mosquitto: as on a machine without one.
    env = _env()
    env["PATH"] = str(tmp_path)
    env["WREN_MOSQUITTO"] = "mosquitto"
    proc = _demo(env=env)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "wren demo: Mosquitto is not installed (WREN_MOSQUITTO=mosquitto: not found):"
        " run `sh tools/setup.sh` (or `apt-get install mosquitto` / `brew install mosquitto`),"
        " or pass --broker HOST:PORT"
    ]


def test_wren_mosquitto_names_the_one_binary_to_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("WREN_MOSQUITTO", raising=False)
    found = mosquitto_binary()
    assert found is not None  # the tests need Mosquitto (tools/setup.sh installs it)
    monkeypatch.setenv("WREN_MOSQUITTO", found)
    assert mosquitto_binary() == found
    monkeypatch.setenv("WREN_MOSQUITTO", str(tmp_path / "no-mosquitto"))
    assert mosquitto_binary() is None  # not some other Mosquitto found elsewhere
    with pytest.raises(MosquittoMissing, match=r"^Mosquitto is not installed \(WREN_MOSQUITTO="):
        start_mosquitto(tmp_path)


def test_demo_says_the_board_died_when_its_heap_is_too_small() -> None:
    proc = _demo("--heap", "40K")
    assert proc.returncode == 1
    assert "the virtual board exited" in proc.stderr
    assert "MemoryError" in proc.stdout
    assert "it needs about 128K: pass --heap 128K" in proc.stderr


@pytest.mark.skipif(micropython_binary() is None, reason="needs the MicroPython unix port")
def test_board_from_sources_at_the_default_heap_says_which_heap_in_one_line(
    tmp_path: Path,
) -> None:
    # It dies importing the runtime (the compiler's working memory), before any broker.
    proc = subprocess.run(
        wren("board", "--virtual", "--py", "--broker", "127.0.0.1:1"),
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr == (
        "wren board: the board ran out of heap (128K) running from .py sources (--py): "
        f"it needs about {PY_HEAP}: pass --heap {PY_HEAP}\n"
    )


def test_the_console_holds_a_traceback_until_it_knows_whether_it_ended_the_board() -> None:
    console = Console()
    assert console.feed("boot\n") == ["boot\n"]
    assert console.feed(TRACEBACK + "\n") == []
    assert console.feed('  File "main.py", line 2, in <module>\n') == []
    assert console.feed("ValueError: x\n") == []
    # A line after it: the board went on, the traceback is printed as it was.
    assert console.feed("still here\n") == [
        TRACEBACK + "\n", '  File "main.py", line 2, in <module>\n', "ValueError: x\n",
        "still here\n",
    ]  # fmt: skip
    for line in (TRACEBACK, '  File "main.py", line 2, in <module>', "MemoryError: alloc"):
        assert console.feed(line + "\n") == []
    assert console.fatal_memory_error()
    assert out_of_heap("150K", py=True) == (
        "the board ran out of heap (150K) running from .py sources (--py): "
        f"it needs about {PY_HEAP}: pass --heap {PY_HEAP}"
    )
    assert out_of_heap("1M", py=False).endswith("pass a --heap above 1M")


def test_hil_on_the_pty_runs_board_tests_through_the_raw_repl() -> None:
    proc = subprocess.run(
        wren("hil", "--pty", "test_ring", "test_events"),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hil: test_ring: 4 passed, 0 failed" in proc.stdout
    assert "hil: test_events: " in proc.stdout and " 0 failed" in proc.stdout


def test_hil_fails_when_a_module_does_not_run_on_the_target() -> None:
    proc = subprocess.run(
        wren("hil", "--pty", "test_no_such_module"),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 1
    assert "hil: test_no_such_module: no summary" in proc.stdout
    assert "ImportError" in proc.stdout


@pytest.mark.parametrize("deploy", [[], ["--deploy"]])
def test_hil_on_a_missing_serial_port_is_one_line_naming_it(
    tmp_path: Path, deploy: list[str]
) -> None:
    # Issue 25: a missing --port printed pyserial's 40-line traceback.
    port = str(tmp_path / "ttyACM9")
    proc = subprocess.run(
        wren("hil", *deploy, "--port", port, "test_ring"),
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"wren hil: cannot open serial port {port}: no such port (is the board plugged in? "
        "ls /dev/ttyACM* /dev/ttyUSB*)"
    ]


def test_bridge_merge_ms_sets_the_rpc_merge_time_and_refuses_a_negative_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def config(*extra: str) -> BridgeConfig:
        return service.bridge_config(build_parser().parse_args(["bridge", *extra]))

    assert config().rpc_merge_s == BridgeConfig().rpc_merge_s
    assert config("--merge-ms", "0").rpc_merge_s == 0.0
    assert config("--merge-ms", "12.5").rpc_merge_s == pytest.approx(0.0125)
    for bad in ("-1", "soon", "nan"):
        with pytest.raises(SystemExit):
            config("--merge-ms", bad)
        assert "--merge-ms" in capsys.readouterr().err


# Every option of the bridge service, each with a value that is not its default.
BRIDGE_ARGV = [
    "--broker", "broker.example:8883", "--user", "svc", "--password=-pw",
    "--registry", "reg.json", "--client-id", "bridge-2", "--tenant", "acme",
    "--device", "d1", "--device", "d2:kiosk", "--script", "script.json",
    "--openai-base-url", "http://127.0.0.1:11434/v1", "--model", "llama3.2",
    "--api-key-env", "MY_KEY", "--merge-ms", "5",
]  # fmt: skip


def test_wren_bridge_and_python_m_server_bridge_take_the_same_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def both(argv: list[str]) -> tuple[dict[str, object], dict[str, object]]:
        ours = vars(service.build_parser().parse_args(argv))
        wren = vars(build_parser().parse_args(["bridge", *argv]))
        assert wren.pop("command") == "bridge"
        return ours, wren

    ours, wren = both(BRIDGE_ARGV)
    assert ours == wren
    assert service.bridge_config(service.build_parser().parse_args(BRIDGE_ARGV)) == BridgeConfig(
        host="broker.example",
        port=8883,
        username="svc",
        password="-pw",
        client_id="bridge-2",
        rpc_merge_s=0.005,
    )
    # The credentials' defaults come from the environment, read when the parser is built.
    monkeypatch.setenv("WREN_BRIDGE_USER", "env-user")
    monkeypatch.setenv("WREN_BRIDGE_PASSWORD", "env-pw")
    ours, wren = both([])
    assert ours == wren
    assert (ours["user"], ours["password"], ours["broker"]) == ("env-user", "env-pw", None)


def test_python_m_server_bridge_provisions_serves_and_stops_on_sigterm(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    bridge = Proc(
        [sys.executable, "-m", "server_bridge", "--broker", broker.address,
         "--client-id", "service-test", "--tenant", "acme", "--device", "svc1:kiosk"],
        tmp_path,
    )  # fmt: skip
    line = bridge.wait_for("bridge: ")
    assert line == (
        f"bridge: {broker.address}, registry .wren/registry.json, scripted model (demo script);"
        " Ctrl-C stops"
    )
    # SIGTERM stops the service like Ctrl-C: the bridge stops cleanly, exit 130.
    assert bridge.stop() == 130
    with Registry(tmp_path / ".wren" / "registry.json") as registry:
        assert registry.device("svc1") == DeviceRecord("svc1", "acme", "kiosk")
        assert registry.tenant_secret("acme") is not None


def test_python_m_server_bridge_says_when_the_broker_is_unreachable(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [sys.executable, "-m", "server_bridge", "--broker", address],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith(
        f"python -m server_bridge: could not connect to the broker at {address}: "
    ), proc.stderr


def test_python_m_server_bridge_with_a_wrong_password_says_whose_login_was_refused(
    tmp_path: Path,
) -> None:
    # Issue 25: refused credentials read as a broker it "could not connect to".
    users = {"bridge1": "right-password", "bridge1.ctl": "right-password"}
    conf = secure_mosquitto_conf(tmp_path / "mosquitto", users, "")
    locked = start_mosquitto(tmp_path / "mosquitto", extra_conf=conf, allow_anonymous=False)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "server_bridge", "--broker", locked.address, "--user",
             "bridge1", "--password=wrong-password"],
            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
    finally:
        locked.stop()
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m server_bridge: bridge could not start on "), last
    assert "refused the credentials for user 'bridge1.ctl' (Not authorized)" in last, last
    assert "could not connect" not in last and "wrong-password" not in proc.stderr


def test_the_bridge_service_exports_its_counters_and_wren_bridge_stats_prints_them(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    """The counters in Prometheus text, per tenant where one is known, rewritten while
    the service runs and once more when it stops; `--stats` reads them back."""
    stats = tmp_path / "bridge.prom"
    options = ["--broker", broker.address, "--client-id", "stats-test", "--tenant", "acme",
               "--device", "st1", "--stats-file", str(stats), "--stats-every", "0.2"]  # fmt: skip
    bridge = Proc([sys.executable, "-m", "server_bridge", *options], tmp_path)
    bridge.wait_for("bridge: ")
    # A host request with a forged token: refused bad_token, on tenant acme's topic.
    with HostClient(broker.host, broker.port, "acme") as host:
        host.connect(timeout=TIMEOUT_S)
        req = host.request("st1", "not.a-token", "hi")
        with pytest.raises(RequestRefused):
            host.wait_run(req, timeout=TIMEOUT_S)
    deadline = time.monotonic() + TIMEOUT_S
    while 'wren_refused_bad_token_total{tenant="acme"} 1' not in _read(stats):
        assert time.monotonic() < deadline, _read(stats)
        time.sleep(0.05)
    text = _read(stats)
    assert "wren_refused_bad_token_total 1\n" in text
    assert "# TYPE wren_bridge_budget_bytes gauge\nwren_bridge_budget_bytes " in text
    assert "wren_bridge_connected 1\n" in text
    printed = subprocess.run(
        wren("bridge", "--stats", "--stats-file", str(stats)),
        env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.startswith(f"# {stats}, written ")
    assert 'wren_refused_bad_token_total{tenant="acme"} 1' in printed.stdout
    assert bridge.stop() == 130
    assert "wren_bridge_connected 0\n" in _read(stats)  # the last export, after the stop


def test_wren_bridge_stats_without_a_running_bridge_says_so(tmp_path: Path) -> None:
    missing = tmp_path / "none.prom"
    printed = subprocess.run(
        wren("bridge", "--stats", "--stats-file", str(missing)),
        env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert printed.returncode == 1
    assert f"no bridge stats at {missing}" in printed.stderr
    assert f"is a bridge running with --stats-file {missing}?" in printed.stderr


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


# --- the registry from the command line -------------------------------------------------------


def _registry_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        wren(*args), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )


def _ok(cwd: Path, *args: str) -> str:
    proc = _registry_cli(cwd, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _printed_password(stdout: str, user: str) -> str:
    """The password `tenant add`, `bridge-user add` and `host-user add` print once."""
    [line] = [x for x in stdout.splitlines() if x.startswith(f"password for {user}: ")]
    return line.split(": ", 1)[1]


def _printed_settings(stdout: str) -> dict[str, object]:
    """The settings.json line `device add` prints, the password in it."""
    [line] = [x.strip() for x in stdout.splitlines() if x.strip().startswith("{")]
    settings: dict[str, object] = json.loads(line)
    return settings


class _Mosquitto:
    """`mosquitto -c` on the config `wren broker-files` wrote, as a user starts it."""

    def __init__(self, conf: Path, port: int) -> None:
        self.conf, self.port = conf, port
        self.log_path = conf.parent / "mosquitto.log"
        self.start()

    def start(self) -> None:
        exe = mosquitto_binary()
        assert exe is not None  # the tests need Mosquitto (tools/setup.sh installs it)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([exe, "-c", str(self.conf)], stdout=log, stderr=log)
        wait_for_port("127.0.0.1", self.port)
        assert self.proc.poll() is None, self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=15)


@pytest.mark.parametrize("access", ["acl_file", "dynsec"])
def test_a_device_added_by_the_cli_logs_in_with_its_printed_password_and_only_as_itself(
    tmp_path: Path, access: str
) -> None:
    watcher_pw = _printed_password(_ok(tmp_path, "tenant", "add", "acme"), "host-acme")
    _ok(tmp_path, "tenant", "add", "other")
    bridge_pw = _printed_password(_ok(tmp_path, "bridge-user", "add", "bridge"), "bridge")
    # A host connection bound to end user bob (PROTOCOL.md "Who sees what").
    bobs = _ok(tmp_path, "host-user", "add", "host-bob", "--tenant", "acme", "--usr", "bob")
    assert "host user host-bob (tenant acme, reads user bob's runs): added" in bobs
    bob_pw = _printed_password(bobs, "host-bob")
    dev1 = _printed_settings(_ok(tmp_path, "device", "add", "dev1", "--tenant", "acme"))
    dev2 = _printed_settings(_ok(tmp_path, "device", "add", "dev2", "--tenant", "other"))
    assert dev1["device"] == "dev1" and dev1["port"] == 1883
    port = free_port()
    out = tmp_path / "broker"
    files = ["broker-files", "--out", str(out), "--port", str(port), "--bind", "127.0.0.1",
             "--access", access]  # fmt: skip
    said = _ok(tmp_path, *files)
    assert f"start Mosquitto:  mosquitto -c {(out / 'mosquitto.conf').resolve()}" in said
    broker = _Mosquitto(out / "mosquitto.conf", port)
    clients: list[Client] = []

    def connect(user: str, password: object) -> Client:
        c = Client("127.0.0.1", port, user, str(password))
        clients.append(c)
        return c

    try:
        bridge = connect("bridge", bridge_pw)
        assert not bridge.rc.is_failure
        # The bridge's control connection logs in as its control user, with its password,
        # and no other.
        assert not connect("bridge.ctl", bridge_pw).rc.is_failure
        assert connect("bridge.ctl", dev1["password"]).rc.is_failure
        bridge.subscribe(f"{P}/#")
        device = connect("dev1", dev1["password"])
        assert not device.rc.is_failure
        # Its own topics: what it writes reaches the bridge, what the bridge sends it
        # reaches it. Another device's topics: neither.
        device.subscribe(f"{P}/d/dev1/req")
        # Refused in SUBACK by the dynamic security plugin; granted by the acl_file.
        [other] = device.subscribe(f"{P}/d/dev2/req")
        assert other.is_failure == (access == "dynsec")
        device.publish(f"{P}/d/dev1/evt", b"own evt")
        device.publish(f"{P}/d/dev2/evt", b"forged evt")
        device.publish(f"{P}/d/dev1/hello", b"marker")
        assert bridge.until(b"marker") == [
            (f"{P}/d/dev1/evt", b"own evt"),
            (f"{P}/d/dev1/hello", b"marker"),
        ]
        bridge.publish(f"{P}/d/dev2/req", b"for dev2")
        bridge.publish(f"{P}/d/dev1/req", b"for dev1")
        assert device.until(b"for dev1") == [(f"{P}/d/dev1/req", b"for dev1")]
        # Who sees what: the tenant's own host user (`tenant add`) is a watcher and reads
        # alice's run; host-bob reads bob's and the device's topic, never alice's.
        watcher = connect("host-acme", watcher_pw)
        bob = connect("host-bob", bob_pw)
        assert watcher.subscribe(f"{P}/h/acme/+/u/+/evt")[0].is_failure is False
        [wide] = bob.subscribe(f"{P}/h/acme/+/u/+/evt")
        assert wide.is_failure == (access == "dynsec")
        assert not bob.subscribe(f"{P}/h/acme/+/u/bob/evt")[0].is_failure
        assert not bob.subscribe(f"{P}/h/acme/+/evt")[0].is_failure
        bridge.publish(f"{P}/h/acme/dev1/u/alice/evt", b"alice's")
        bridge.publish(f"{P}/h/acme/dev1/u/bob/evt", b"bob's")
        bridge.publish(f"{P}/h/acme/dev1/evt", b"the device's")
        assert bob.until(b"the device's") == [
            (f"{P}/h/acme/dev1/u/bob/evt", b"bob's"),
            (f"{P}/h/acme/dev1/evt", b"the device's"),
        ]
        assert watcher.until(b"bob's") == [
            (f"{P}/h/acme/dev1/u/alice/evt", b"alice's"),
            (f"{P}/h/acme/dev1/u/bob/evt", b"bob's"),
        ]
        # A wrong password, and another device's, are refused.
        assert connect("dev1", "not-the-password").rc.is_failure
        assert connect("dev1", dev2["password"]).rc.is_failure
        # A device added and one removed: written again, and reloaded (SIGHUP; a restart
        # with the dynamic security plugin, as broker-files says), the broker takes the
        # new one and refuses the removed one.
        dev3 = _printed_settings(_ok(tmp_path, "device", "add", "dev3", "--tenant", "acme"))
        _ok(tmp_path, "device", "remove", "dev2")
        said = _ok(tmp_path, *files)
        if access == "dynsec":
            assert "restart it after a change" in said
            broker.stop()
            broker.start()
        else:
            assert "kill -HUP <its pid>" in said
            broker.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + TIMEOUT_S
        while connect("dev3", dev3["password"]).rc.is_failure:
            assert time.monotonic() < deadline, broker.log_path.read_text()
            time.sleep(0.1)
        assert connect("dev2", dev2["password"]).rc.is_failure
    finally:
        for c in clients:
            c.close()
        broker.stop()


def test_passwords_are_never_shown_again_nor_stored(tmp_path: Path) -> None:
    tenant_out = _ok(tmp_path, "tenant", "add", "acme")
    host_pw = _printed_password(tenant_out, "host-acme")
    assert "shown this once: it cannot be shown again" in tenant_out
    printed = _ok(tmp_path, "device", "add", "dev1", "--tenant", "acme", "--agent", "kiosk",
                  "--broker", "192.168.1.10:1884")  # fmt: skip
    settings = _printed_settings(printed)
    password = str(settings["password"])
    assert settings == {"device": "dev1", "password": password, "host": "192.168.1.10",
                        "port": 1884}  # fmt: skip
    assert printed.count(password) == 1  # printed once, in the settings.json line
    assert "the password is shown this once: it cannot be shown again" in printed
    _ok(tmp_path, "tenant", "add", "globex")
    _ok(tmp_path, "device", "add", "dev2", "--tenant", "globex")
    listed = _ok(tmp_path, "device", "list")
    assert listed.splitlines() == [
        "DEVICE  TENANT  AGENT",
        "dev1    acme    kiosk",
        "dev2    globex  thermostat",
    ]
    assert _ok(tmp_path, "device", "list", "--tenant", "globex").splitlines() == [
        "DEVICE  TENANT  AGENT",
        "dev2    globex  thermostat",
    ]
    stored = (tmp_path / ".wren" / "registry.json").read_text()
    with Registry(tmp_path / ".wren" / "registry.json") as registry:
        entry = registry.user("dev1")
        assert entry is not None and check_password(password, entry.password_hash)
    for secret in (password, host_pw):
        assert secret not in stored and secret not in listed
    assert entry.password_hash not in listed and "$7$" not in listed
    # A new password for the device: the old one no longer matches.
    rotated = _printed_settings(_ok(tmp_path, "device", "add", "dev1", "--tenant", "acme",
                                    "--rotate"))  # fmt: skip
    with Registry(tmp_path / ".wren" / "registry.json") as registry:
        entry = registry.user("dev1")
        assert entry is not None and check_password(str(rotated["password"]), entry.password_hash)
        assert not check_password(password, entry.password_hash)
        assert registry.device("dev1") == DeviceRecord("dev1", "acme", "kiosk")


def test_wren_token_signs_a_users_or_a_watchers_session_token(tmp_path: Path) -> None:
    _ok(tmp_path, "tenant", "add", "acme")
    with Registry(tmp_path / ".wren" / "registry.json") as registry:
        secret = bytes.fromhex(registry.tenant_secret("acme") or "")
    plain = _ok(tmp_path, "token", "--tenant", "acme", "--user-id", "bob.b@example.com")
    watch = _ok(tmp_path, "token", "--tenant", "acme", "--user-id", "ops", "--watch")
    assert tokens.verify(secret, plain.strip(), "acme") == tokens.Session(
        "acme", "bob.b@example.com", tokens.verify(secret, plain.strip(), "acme").expires
    )
    session = tokens.verify(secret, watch.strip(), "acme")
    assert (session.user, session.watch) == ("ops", True)


def test_wren_token_link_prints_the_dashboard_signed_in(tmp_path: Path) -> None:
    # `--link URL`: the dashboard at the bridge's --http address, the token in the
    # fragment (no server sees it), a token that verifies for the user it names.
    _ok(tmp_path, "tenant", "add", "acme")
    with Registry(tmp_path / ".wren" / "registry.json") as registry:
        secret = bytes.fromhex(registry.tenant_secret("acme") or "")
    for base in ("http://127.0.0.1:8080", "http://127.0.0.1:8080/"):
        printed = _ok(tmp_path, "token", "--tenant", "acme", "--user-id", "alice",
                      "--link", base)  # fmt: skip
        link = re.fullmatch(r"http://127\.0\.0\.1:8080/ui/#token=([^\s#?&/]+)\n", printed)
        assert link is not None, printed
        session = tokens.verify(secret, link.group(1), "acme")
        assert (session.tenant, session.user, session.watch) == ("acme", "alice", False)
    watch = _ok(tmp_path, "token", "--tenant", "acme", "--user-id", "ops", "--watch",
                "--link", "https://wren.example/")  # fmt: skip
    assert watch.startswith("https://wren.example/ui/#token="), watch
    session = tokens.verify(secret, watch.strip().split("#token=", 1)[1], "acme")
    assert (session.user, session.watch) == ("ops", True)


def test_registry_commands_refuse_bad_input_in_one_line_and_change_nothing(
    tmp_path: Path,
) -> None:
    missing = _registry_cli(tmp_path, "device", "list")
    assert (missing.returncode, missing.stdout) == (1, "")
    assert missing.stderr == (
        "wren device list: no registry at .wren/registry.json (`wren tenant add` creates one)\n"
    )
    assert not (tmp_path / ".wren").exists()
    _ok(tmp_path, "tenant", "add", "acme")
    _ok(tmp_path, "tenant", "add", "globex")
    _ok(tmp_path, "device", "add", "dev1", "--tenant", "acme")
    no_bridge = _registry_cli(tmp_path, "broker-files")
    assert no_bridge.stderr == (
        "wren broker-files: the registry has no bridge user: add one with "
        "`wren bridge-user add bridge`\n"
    )
    _ok(tmp_path, "bridge-user", "add", "bridge")
    registry = tmp_path / ".wren" / "registry.json"
    before = registry.read_bytes()
    bad = {
        ("tenant", "add", "acme"): "tenant 'acme' already exists",
        ("tenant", "add", "Acme"): "invalid tenant level 'Acme'",
        ("tenant", "add", "nobody", "--rotate"): "unknown tenant 'nobody'",
        ("device", "add", "dev2", "--tenant", "nobody"): "unknown tenant 'nobody'",
        ("device", "add", "dev/2", "--tenant", "acme"): "invalid device level 'dev/2'",
        ("device", "add", "Dev2", "--tenant", "acme"): "invalid device level 'Dev2'",
        ("device", "add", "dev1", "--tenant", "acme"): "device 'dev1' already exists",
        ("device", "add", "dev1", "--tenant", "globex"): "device 'dev1' already exists",
        ("device", "add", "host-acme", "--tenant", "acme"): "broker user 'host-acme' already",
        ("device", "add", "bridge", "--tenant", "acme"): "broker user 'bridge' already exists",
        ("device", "add", "dev2", "--tenant", "acme", "--rotate"): "unknown device 'dev2'",
        ("device", "add", "dev1", "--tenant", "globex", "--rotate"): "another tenant",
        ("device", "remove", "dev2"): "unknown device 'dev2'",
        ("bridge-user", "add", "bridge"): "broker user 'bridge' already exists",
        ("bridge-user", "add", "dev1"): "'dev1' is a device",
        ("bridge-user", "add", "a:b"): "cannot be written to the broker's files",
        ("bridge-user", "add", "b2", "--rotate"): "unknown broker user 'b2'",
        ("host-user", "add", "h2", "--tenant", "nobody", "--watch"): "unknown tenant 'nobody'",
        # Whose runs a new host user reads is said, never defaulted (PROTOCOL "Who sees
        # what"), and only as an id a topic level can hold.
        ("host-user", "add", "h2", "--tenant", "acme"): "--usr USER",
        ("host-user", "add", "h2", "--tenant", "acme", "--usr", "a/b"): "invalid user id",
        ("host-user", "add", "h2", "--tenant", "acme", "--usr", "+"): "invalid user id",
        ("token", "--tenant", "nobody", "--user-id", "bob"): "unknown tenant 'nobody'",
        ("token", "--tenant", "acme", "--user-id", "bob/#"): "user id must match",
        ("host-user", "add", "host-acme", "--tenant", "globex", "--rotate"): "not a host user of",
        ("bridge-user", "add", "host-acme", "--rotate"): "is not a bridge user",
        ("grant", "add", "--tenant", "nobody", "--agent", "kiosk"): "unknown tenant 'nobody'",
        ("grant", "add", "--tenant", "acme", "--agent", "kiosk", "--field", "Menu"): "field must",
        ("grant", "add", "--tenant", "Acme", "--agent", "kiosk"): "invalid tenant level 'Acme'",
        ("grant", "remove", "--tenant", "acme", "--agent", "kiosk"): "has no grant of every",
        ("grant", "remove", "--tenant", "nobody", "--agent", "kiosk"): "unknown tenant 'nobody'",
    }
    # All at once (each is a process of its own): each must refuse, so the file is the
    # same at the end only if none of them wrote it.
    with ThreadPoolExecutor(8) as pool:
        procs = dict(zip(bad, pool.map(lambda a: _registry_cli(tmp_path, *a), bad), strict=True))
    for args, says in bad.items():
        proc = procs[args]
        assert proc.returncode == 1, (args, proc.stdout, proc.stderr)
        assert proc.stdout == "", args
        [line] = proc.stderr.splitlines()
        name = f"wren {args[0]} {args[1]}: " if args[0] != "token" else "wren token: "
        assert line.startswith(name) and says in line, (args, line)
    assert registry.read_bytes() == before
    # A usage error is argparse's (exit 2): --agent is what --rotate keeps.
    usage = _registry_cli(tmp_path, "device", "add", "dev1", "--tenant", "acme", "--rotate",
                          "--agent", "x")  # fmt: skip
    assert usage.returncode == 2 and "not allowed with argument --rotate" in usage.stderr
    assert registry.read_bytes() == before


def test_grants_from_the_command_line(tmp_path: Path) -> None:
    missing = _registry_cli(tmp_path, "grant", "list")
    assert (missing.returncode, missing.stderr) == (
        1,
        "wren grant list: no registry at .wren/registry.json (`wren tenant add` creates one)\n",
    )
    _ok(tmp_path, "tenant", "add", "acme")
    _ok(tmp_path, "tenant", "add", "globex")
    _ok(tmp_path, "device", "add", "dev1", "--tenant", "acme", "--agent", "kiosk")
    assert _ok(tmp_path, "grant", "list").splitlines() == ["TENANT  AGENT  FIELD  ACCESS"]
    added = _registry_cli(tmp_path, "grant", "add", "--tenant", "acme", "--agent", "kiosk")
    assert added.returncode == 0 and added.stderr == ""
    assert added.stdout.splitlines() == [
        "grant: agent kiosk of tenant acme may read and write every tenant field",
        "a running bridge applies it within 0.25 s (no broker reload: the broker's files do "
        "not hold grants)",
    ]
    # An agent no device runs yet: granted, with a note (a typo would grant nothing).
    till = _registry_cli(tmp_path, "grant", "add", "--tenant", "acme", "--agent", "till",
                         "--field", "menu", "--read-only")  # fmt: skip
    assert till.returncode == 0
    assert (
        till.stdout.splitlines()[0] == "grant: agent till of tenant acme may read tenant field menu"
    )
    assert till.stderr == (
        "note: no device of tenant acme runs agent till yet (`wren device list` shows the agents)\n"
    )
    _ok(tmp_path, "grant", "add", "--tenant", "globex", "--agent", "kiosk", "--field", "menu")
    changed = _ok(tmp_path, "grant", "add", "--tenant", "acme", "--agent", "kiosk", "--read-only")
    assert changed.splitlines()[0] == (
        "grant: agent kiosk of tenant acme may read every tenant field (was read-write)"
    )
    assert _ok(tmp_path, "grant", "list").splitlines() == [
        "TENANT  AGENT  FIELD  ACCESS",
        "acme    kiosk  *      read-only",
        "acme    till   menu   read-only",
        "globex  kiosk  menu   read-write",
    ]
    assert _ok(tmp_path, "grant", "list", "--tenant", "globex").splitlines() == [
        "TENANT  AGENT  FIELD  ACCESS",
        "globex  kiosk  menu   read-write",
    ]
    # What the bridge reads: the registry's grants for (tenant, agent).
    with Registry(tmp_path / ".wren" / "registry.json") as registry:
        assert registry.grants_of("acme", "kiosk").access("anything") == "read"
        assert registry.grants_of("acme", "till").access("menu") == "read"
        assert registry.grants_of("acme", "till").access("orders") is None
        assert registry.grants_of("globex", "till").access("menu") is None
    # Removing takes back exactly the grant `add` with the same options made.
    _ok(tmp_path, "grant", "add", "--tenant", "acme", "--agent", "till", "--field", "orders")
    wrong = _registry_cli(tmp_path, "grant", "remove", "--tenant", "acme", "--agent", "till")
    assert (wrong.returncode, wrong.stdout) == (1, "")
    assert wrong.stderr == (
        "wren grant remove: agent 'till' of tenant 'acme' has no grant of every tenant field "
        "(its grants: --field menu, --field orders)\n"
    )
    removed = _ok(tmp_path, "grant", "remove", "--tenant", "acme", "--agent", "till",
                  "--field", "menu")  # fmt: skip
    assert removed.splitlines()[:2] == [
        "grant: agent till of tenant acme no longer has tenant field menu",
        "  its grants of orders stay",
    ]
    _ok(tmp_path, "grant", "remove", "--tenant", "acme", "--agent", "kiosk")
    assert _ok(tmp_path, "grant", "list", "--tenant", "acme").splitlines() == [
        "TENANT  AGENT  FIELD   ACCESS",
        "acme    till   orders  read-write",
    ]


@pytest.mark.parametrize("heap", ["lots", "12", "128KB", "2G"])
def test_a_heap_the_unix_port_cannot_take_is_one_line_and_exit_2(heap: str) -> None:
    for command in (["demo"], ["board", "--virtual"], ["hil", "--pty"]):
        proc = subprocess.run(
            wren(*command, "--heap", heap),
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert proc.returncode == 2, (command, proc.stderr)
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"wren {command[0]}: error: argument --heap: "), last
        assert "Traceback" not in proc.stderr


def test_version_is_the_package_metadata_or_else_pyproject(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from importlib import metadata

    import tools.cli

    proc = subprocess.run(
        wren("--version"), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"wren {metadata.version('wren')}\n"
    # A checkout run without installing it: pyproject.toml's version.
    pyproject = (ROOT / "pyproject.toml").read_text()
    declared = next(
        line.split('"')[1] for line in pyproject.splitlines() if line.startswith("version = ")
    )

    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert tools.cli.version() == declared


def test_help_names_the_defaults() -> None:
    proc = subprocess.run(
        wren("demo", "--help"), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0
    assert "(default: 128K)" in proc.stdout and "(default: thermo1)" in proc.stdout
    ask = subprocess.run(
        wren("ask", "--help"), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60
    )
    assert "(default: 150.0)" in ask.stdout and "(default: demo)" in ask.stdout


def _ctrl_c_demo(
    workdir: Path, after: bytes, how: str = "ctrl-c", delay: float = 0.3
) -> tuple[int, str]:
    """`wren demo` on a pseudo-terminal, as a person runs it; Ctrl-C (the terminal's
    SIGINT to the foreground group), or `how` "sigterm" (a service manager's SIGTERM to
    the demo's process alone), `delay` seconds after `after` has been printed.
    (exit code, output)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the command, with the terminal as its controlling tty
        os.environ["PYTHONPATH"] = str(ROOT)
        os.execv(
            sys.executable, [sys.executable, "-m", "tools.cli", "demo", "--workdir", str(workdir)]
        )
    out = b""
    deadline = time.monotonic() + TIMEOUT_S
    code = None
    seen: float | None = None
    sent = False
    while time.monotonic() < deadline:
        if seen is None and after in out:
            seen = time.monotonic()
        # A moment after: Python's readline prints the prompt before it waits for input,
        # and a SIGINT in between waits for the next key (a person is never that fast).
        if not sent and seen is not None and time.monotonic() - seen >= delay:
            if how == "sigterm":
                os.kill(pid, signal.SIGTERM)
            else:
                os.write(fd, b"\x03")
            sent = True
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                chunk = b""
            out += chunk
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            break
    os.close(fd)
    if code is None:
        # Stuck: stop it as a service manager would, so its parts do not outlive the test.
        os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + 10
        reaped = False
        while not reaped and time.monotonic() < end:
            reaped = os.waitpid(pid, os.WNOHANG)[0] != 0
            time.sleep(0.1)
        if not reaped:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert code is not None, out.decode(errors="replace")[-2000:]
    return code, out.decode(errors="replace")


def _leftovers(workdir: Path) -> list[str]:
    # The demo's broker and board run with paths under its workdir.
    proc = subprocess.run(["pgrep", "-af", str(workdir)], capture_output=True, text=True)
    return [line for line in proc.stdout.splitlines() if "pgrep" not in line]


@pytest.mark.parametrize(
    ("after", "how", "delay"),
    [
        (b"broker: ", "ctrl-c", 0.3),
        (b"you>", "ctrl-c", 0.3),
        # The first request's run has begun (its first words are on the screen): the
        # stop lands while the run and its tool call go on.
        (b"assistant:", "ctrl-c", 0.0),
        (b"broker: ", "sigterm", 0.3),
        (b"assistant:", "sigterm", 0.0),
    ],
    ids=["starting", "at-the-prompt", "mid-run", "sigterm-starting", "sigterm-mid-run"],
)
def test_ctrl_c_stops_the_demo_cleanly(
    tmp_path: Path, after: bytes, how: str, delay: float
) -> None:
    code, out = _ctrl_c_demo(tmp_path, after, how, delay)
    assert code == 130, out[-2000:]
    assert "Traceback" not in out and "stopped" in out, out[-2000:]
    assert " ERROR " not in out, out[-2000:]
    # Every part stopped with it: the broker and the board run in sessions of their own,
    # so only the demo's own clean-up can have stopped them.
    end = time.monotonic() + 10
    while _leftovers(tmp_path) and time.monotonic() < end:
        time.sleep(0.1)
    assert _leftovers(tmp_path) == []


def _ask_alone(cwd: Path, address: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """`wren ask` of a tenant's registry in `cwd`, with no bridge or board behind it."""
    _ok(cwd, "tenant", "add", "demo")
    args = ("--broker", address, "--registry", ".wren/registry.json", *extra, "Hello?")
    return subprocess.run(
        wren("ask", *args), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )


def test_ask_says_in_one_line_when_it_cannot_reach_the_broker(tmp_path: Path) -> None:
    proc = _ask_alone(tmp_path, f"127.0.0.1:{free_port()}")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "wren ask: cannot reach the broker at 127.0.0.1:"
    )
    assert "Traceback" not in proc.stderr + proc.stdout


def test_ask_with_a_wrong_password_says_the_broker_refused_the_user(tmp_path: Path) -> None:
    # Issue 25: bad credentials read "cannot reach the broker ... Not authorized". The
    # broker was reached; it refused the login, and the line says whose.
    conf = secure_mosquitto_conf(tmp_path / "mosquitto", {"host-demo": "right-password"}, "")
    locked = start_mosquitto(tmp_path / "mosquitto", extra_conf=conf, allow_anonymous=False)
    try:
        env = _env()
        env["WREN_HOST_USER"], env["WREN_HOST_PASSWORD"] = "host-demo", "wrong-password"
        _ok(tmp_path, "tenant", "add", "demo")
        proc = subprocess.run(
            wren("ask", "--broker", locked.address, "--registry", ".wren/registry.json", "Hi?"),
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
    finally:
        locked.stop()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        f"wren ask: the MQTT broker at {locked.address} refused the credentials for user "
        "'host-demo' (Not authorized)"
    ), lines[0]
    assert "cannot reach" not in lines[0] and "wrong-password" not in lines[0]


def test_ask_for_a_device_that_never_connected_says_so_and_stops_soon(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    # Issue 25: `wren ask` waited its whole --timeout in silence for a device that never
    # connected. The bridge says it never saw the device online; the ask says what it
    # waits for, and stops after a short grace, exit 1.
    bridge = Proc(wren("bridge", "--broker", broker.address, "--device", "ghost1"), tmp_path)
    try:
        bridge.wait_for("bridge: ")
        began = time.monotonic()
        proc = subprocess.run(
            wren("ask", "--broker", broker.address, "--device", "ghost1", "--timeout", "120",
                 "Anyone there?"),
            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        took = time.monotonic() - began
    finally:
        bridge.stop()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line]
    assert lines == [
        "wren ask: waiting for device ghost1 to connect (it has never been seen online; at "
        "most 10 s)",
        "wren ask: device ghost1 did not connect within 10 s and has never been seen online: "
        "nothing ran (start the board, then ask again)",
    ], proc.stderr
    assert took < 25, took


def test_ask_gives_up_on_silence_with_what_may_be_down(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    # A broker with no bridge and no board: nothing answers, and the wait is for progress.
    forget_bridge_status(broker)  # no bridge ever: none said it went offline either
    proc = _ask_alone(tmp_path, f"{broker.host}:{broker.port}", "--timeout", "1.5")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "wren ask: nothing from device thermo1 for 1.5 s (the board, the bridge or the broker "
        "may be down)"
    ]


# --- presence told to `wren ask`: a board or a bridge that is down is said in one line ---

ASK_USER = "host-ask"  # `wren ask` is a host connection of its own (PROTOCOL "Identity")


def _ask_in(s: Stack, *extra: str) -> subprocess.CompletedProcess[str]:
    """`wren ask` as a user runs it, against the stack's broker and registry."""
    env = _env()
    env["WREN_HOST_USER"] = ASK_USER
    env["WREN_HOST_PASSWORD"] = s.users[ASK_USER]
    args = ("--broker", f"{s.host}:{s.port}", "--registry", str(s.registry_path), "--timeout",
            "20", *extra, "How warm is it in here?")  # fmt: skip
    return subprocess.run(
        wren("ask", *args), cwd=s.workdir, env=env, capture_output=True, text=True,
        timeout=TIMEOUT_S,
    )  # fmt: skip


def _clock_near(line: str, when: float) -> None:
    """The HH:MM:SS at the end of `line` is the local time `when`, give or take 3 s."""
    said = line.rsplit(" ", 1)[-1]
    day = time.localtime(when)
    t = time.mktime(time.strptime(f"{day.tm_year}-{day.tm_yday} {said}", "%Y-%j %H:%M:%S"))
    assert abs(t - when) <= 3, (line, time.strftime("%H:%M:%S", day))


def _one_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_ask_says_in_one_line_that_the_device_is_offline_since_when_or_unknown(
    tmp_path: Path,
) -> None:
    with Stack(tmp_path, extra_users={ASK_USER: "demo"}) as s:
        line = _one_line(_ask_in(s, "--device", "nosuch"))
        assert line == (
            "wren ask: device nosuch is not a device of tenant demo (`wren device list` "
            "shows the registry's devices)"
        )
        assert s.client is not None
        stopped = time.time()
        s.stop_board()
        # The board's last will reaches the bridge: a request is then refused by name,
        # with since when, and not sent on to run whenever the board is back.
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            req = s.request("Still there?")
            try:
                s.client.wait_run(req, timeout=2)
            except RequestRefused as e:
                assert e.kind == "device_offline", e
                assert abs(e.detail["since"] / 1000 - stopped) < 3, e.detail
                break
            except TimeoutError:
                assert time.monotonic() < deadline, s.describe()
        presence = s.client.device_presence(s.device)
        assert presence is not None and presence.offline
        line = _one_line(_ask_in(s))
        assert line.startswith("wren ask: device thermo1 is offline since "), line
        _clock_near(line, stopped)
        # Back, and asked again: answered.
        s.start_board()
        deadline = time.monotonic() + TIMEOUT_S
        while (proc := _ask_in(s)).returncode != 0:
            assert "is offline since" in proc.stderr and time.monotonic() < deadline, proc.stderr
            time.sleep(0.5)
        assert "Traceback" not in proc.stderr


def test_ask_sent_as_the_board_went_away_says_so_and_gets_its_answer_when_it_is_back(
    tmp_path: Path,
) -> None:
    # A board rebooting for longer than the bridge's 5 s grace: the request went out
    # within the grace, so it waits in the board's session; `wren ask` says the device
    # is offline instead of waiting in silence, and the answer comes once it is back.
    with Stack(tmp_path, extra_users={ASK_USER: "demo"}) as s:
        stopped = time.time()
        s.stop_board()
        env = _env()
        env["WREN_HOST_USER"] = ASK_USER
        env["WREN_HOST_PASSWORD"] = s.users[ASK_USER]
        args = ("--broker", f"{s.host}:{s.port}", "--registry", str(s.registry_path),
                "--timeout", "60", "How warm is it in here?")  # fmt: skip
        proc = subprocess.Popen(
            wren("ask", *args), cwd=s.workdir, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert proc.stderr is not None
            notice = ""
            while "offline" not in notice:
                notice = proc.stderr.readline()
                assert notice, "wren ask ended without the notice"
            assert "wren ask: device thermo1 is offline since " in notice, notice
            assert notice.rstrip().endswith("the request waits for it (at most 60 s without news)")
            _clock_near(notice.split("; ")[0], stopped)
            s.start_board()
            out, err = proc.communicate(timeout=TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, err
        assert "wren ask: device thermo1 is back" in err and "Traceback" not in err
        assert "It is 21.5 °C in here." in out


def test_ask_says_in_one_line_that_the_bridge_is_offline_since_when(tmp_path: Path) -> None:
    with Stack(tmp_path, extra_users={ASK_USER: "demo"}) as s:
        stopped = time.time()
        s.stop_bridge()  # a clean stop: its offline status says when
        line = _one_line(_ask_in(s))
        assert line.startswith("wren ask: the bridge is offline since "), line
        _clock_near(line, stopped)
        s.start_bridge()
        killed = time.time()
        s.kill_bridge()  # its last will, which cannot know the time: since before now
        line = _one_line(_ask_in(s))
        assert line.startswith("wren ask: the bridge is offline (since before "), line
        _clock_near(line.rstrip(")"), killed)


# --- argument mistakes: one line, exit 2, before anything starts ---------------------------


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("localhost", "expected HOST:PORT such as 127.0.0.1:1883, got 'localhost'"),
        ("localhost:mqtt", "expected HOST:PORT such as 127.0.0.1:1883, got 'localhost:mqtt'"),
        (":1883", "expected HOST:PORT such as 127.0.0.1:1883, got ':1883'"),
        ("localhost:99999", "the port must be 1..65535, got 'localhost:99999'"),
        ("localhost:0", "the port must be 1..65535, got 'localhost:0'"),
    ],
)
def test_a_bad_broker_address_is_one_line_and_exit_2(value: str, said: str) -> None:
    for command in (["bridge"], ["ask", "Hello?"], ["board", "--virtual"], ["demo"]):
        proc = subprocess.run(
            wren(*command, f"--broker={value}"), cwd=ROOT, env=_env(), capture_output=True,
            text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
        assert proc.returncode == 2, (command, proc.stderr)
        assert proc.stderr.splitlines() == [
            f"wren {command[0]}: error: argument --broker: {said} (see wren {command[0]} --help)"
        ]


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("not-a-url", "expected an http:// or https:// URL such as http://127.0.0.1:11434/v1, "
         "got 'not-a-url'"),
        ("ftp://models.example/v1", "expected an http:// or https:// URL such as "
         "http://127.0.0.1:11434/v1, got 'ftp://models.example/v1'"),
        ("http://127.0.0.1:99999/v1", "the port of 'http://127.0.0.1:99999/v1' is not a number "
         "in 0..65535"),
    ],
)  # fmt: skip
def test_a_bad_model_base_url_is_refused_at_start_up_in_one_line(
    url: str, said: str, tmp_path: Path
) -> None:
    # Refused before the bridge connects anywhere or writes anything.
    proc = subprocess.run(
        wren("bridge", "--openai-base-url", url, "--registry", str(tmp_path / "r.json")),
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"wren bridge: error: argument --openai-base-url: {said} (see wren bridge --help)"
    ]
    assert not (tmp_path / "r.json").exists()


def test_the_interactive_demo_prints_the_status_line_before_the_next_prompt(
    tmp_path: Path,
) -> None:
    # Issue 10 saw `status: done` after `you>`: the run's last lines must be out first.
    pid, fd = pty.fork()
    if pid == 0:  # the child: the demo, with the terminal as its controlling tty
        os.environ["PYTHONPATH"] = str(ROOT)
        os.execv(
            sys.executable, [sys.executable, "-m", "tools.cli", "demo", "--workdir", str(tmp_path)]
        )
    out = b""

    def read_until(needle: bytes, count: int) -> None:
        nonlocal out
        deadline = time.monotonic() + TIMEOUT_S
        while out.count(needle) < count and time.monotonic() < deadline:
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    out += os.read(fd, 4096)
                except OSError:
                    return

    try:
        read_until(b"you> ", 1)
        os.write(fd, b"Set it to my usual.\r")
        read_until(b"you> ", 2)
        text = out.decode(errors="replace")
        assert text.count("you> ") == 2, text[-2000:]
        second = text[text.index("you> ") :]
        assert "status: done" in second[: second.rindex("you> ")], second
        assert "status:" not in second[second.rindex("you> ") :], second
        os.write(fd, b"\r")  # an empty line ends the demo
        deadline = time.monotonic() + TIMEOUT_S
        while os.waitpid(pid, os.WNOHANG)[0] == 0:
            assert time.monotonic() < deadline, "the demo did not end on an empty line"
            read_until(b"\0", 1)  # keep the terminal drained while it stops
        pid = 0
    finally:
        os.close(fd)
        if pid:
            os.kill(pid, signal.SIGTERM)
            os.waitpid(pid, 0)
