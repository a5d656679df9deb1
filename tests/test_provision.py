"""`wren provision` and the settings table it checks (tools/board_settings.py).

The table refuses what the board could not use, each problem by name, before anything is
written. Provisioning a board on a pseudo-terminal (tools/pty_board.py) writes a
settings.json the board boots with: it reaches the broker and says so (its retained
status); with the broker's password file rewritten, it logs in with the new password
the registry now holds, and the old one is refused. Secrets never reach the output."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import paho.mqtt.client as mqtt
import pytest

from server_bridge.brokerconf import check_password
from server_bridge.registry import Registry
from tests.waiting import wait_for
from tools import board_settings as bs
from tools import leftovers
from tools.broker import MosquittoProcess, free_port, mosquitto_binary, wait_for_port
from tools.build import build
from tools.flash import soft_reset
from tools.pty_board import PtyBoard
from tools.virtual_board import micropython_binary

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300
BOOT_S = 30.0
on_unix_port = pytest.mark.skipif(
    micropython_binary() is None, reason="no MicroPython unix port on this platform"
)


# --- the settings table -------------------------------------------------------------------


def _kinds(doc: Any) -> list[tuple[str, str]]:
    return [(type(p).__name__, p.key) for p in bs.problems(doc)]


def test_a_provisioned_board_s_settings_pass() -> None:
    doc = {
        "device": "thermo1", "password": "pw", "host": "10.0.0.2", "port": 8883,
        "wifi": {"ssid": "home", "password": "wifi-pw", "backoff_ms": [500, 30000]},
        "tls": {"ca": "ca.pem", "server_hostname": "broker.lan"},
        "wdt_ms": 8000, "max_payload": 8192, "memory": False, "sim_celsius": 21.5,
    }  # fmt: skip
    assert bs.problems(doc) == []
    assert bs.check(doc) == doc
    assert json.loads(bs.dumps(doc)) == doc


def test_each_problem_is_named_and_every_one_is_found() -> None:
    doc = {
        "port": "1883",  # text, where the board wants a number
        "keepalive": True,  # a bool is no int here
        "max_paylaod": 9000,  # misspelt: the board would silently use its default
        "window": 0,
        "wifi": {"ssid": "", "passwd": "x", "backoff_ms": [9000, 10]},
        "tls": {"ca": "../ca.pem"},
        "prefix": None,
    }
    assert sorted(_kinds(doc)) == sorted([
        ("MissingKey", "device"),
        ("WrongType", "port"),
        ("WrongType", "keepalive"),
        ("UnknownKey", "max_paylaod"),
        ("OutOfRange", "window"),
        ("BadValue", "wifi.ssid"),
        ("UnknownKey", "wifi.passwd"),
        ("BadValue", "wifi.backoff_ms"),
        ("BadValue", "tls.ca"),
        ("WrongType", "prefix"),
    ])  # fmt: skip
    with pytest.raises(bs.SettingsInvalid) as e:
        bs.check(doc)
    assert len(e.value.problems) == 10
    assert all(isinstance(p, bs.SettingsProblem) for p in e.value.problems)


@pytest.mark.parametrize(
    ("doc", "kind", "key"),
    [
        ({"device": "a/b"}, bs.BadValue, "device"),
        ({"device": "d", "port": 0}, bs.OutOfRange, "port"),
        ({"device": "d", "port": 65536}, bs.OutOfRange, "port"),
        ({"device": "d", "wifi": {"password": "x"}}, bs.MissingKey, "wifi.ssid"),
        ({"device": "d", "wifi": "home"}, bs.WrongType, "wifi"),
        ({"device": "d", "tls": {}}, bs.MissingKey, "tls.ca"),
        ({"device": "d", "wdt_ms": 0}, bs.OutOfRange, "wdt_ms"),
        ({"device": "d", "sim_celsius": "warm"}, bs.WrongType, "sim_celsius"),
        ([], bs.WrongType, "settings"),
    ],
)
def test_one_problem(doc: Any, kind: type, key: str) -> None:
    [problem] = bs.problems(doc)
    assert type(problem) is kind and problem.key == key


def test_at_the_edges_of_a_range() -> None:
    assert bs.problems({"device": "d", "port": 1}) == []
    assert bs.problems({"device": "d", "port": 65535}) == []
    assert _kinds({"device": "d", "max_payload": 511}) == [("OutOfRange", "max_payload")]
    assert bs.problems({"device": "d", "max_payload": 512}) == []


def test_a_secret_never_appears_in_a_problem() -> None:
    doc = {"device": "d", "pasword": "hunter2-secret", "wifi": {"ssid": "s", "password": 42}}
    found = bs.problems(doc)
    assert _kinds(doc) == [("UnknownKey", "pasword"), ("WrongType", "wifi.password")]
    assert not any("hunter2" in str(p) or "42" in str(p) for p in found)


def test_a_file_that_is_not_json_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "settings.json"
    f.write_text("{device: d}")
    with pytest.raises(bs.SettingsInvalid) as e:
        bs.load(f)
    assert type(e.value.problems[0]) is bs.WrongType


# --- wren provision, against a board -----------------------------------------------------------


def wren(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ if env is None else env)
    full["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "tools.cli", *args],
        cwd=cwd, env=full, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip


def ok(cwd: Path, *args: str) -> str:
    done = wren(cwd, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("build") / "unix"
    build("unix", out)
    return out


@pytest.fixture
def board(tmp_path: Path, built: Path) -> Iterator[PtyBoard]:
    """A board with the demo flashed (its files copied, as `wren flash` leaves them) and
    no settings yet."""
    flash = tmp_path / "flash"
    shutil.copytree(built, flash, ignore=shutil.ignore_patterns("wren-build.json"))
    with PtyBoard(flash) as b:
        yield b


def registry_with(tmp_path: Path, device: str) -> tuple[Path, str]:
    """A registry with tenant `lab` and `device`; the password `device add` printed."""
    reg = tmp_path / "registry.json"
    ok(tmp_path, "tenant", "add", "lab", "--registry", str(reg))
    said = ok(tmp_path, "device", "add", device, "--tenant", "lab", "--registry", str(reg))
    [line] = [x.strip() for x in said.splitlines() if x.strip().startswith("{")]
    return reg, str(json.loads(line)["password"])


def retained_status(host: str, port: int, topic: str, user: str | None = None,
                    password: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The board's retained status, once it says online."""
    got: list[dict[str, Any]] = []
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=user or f"t-{secrets.token_hex(3)}")
    if user is not None:
        c.username_pw_set(user, password)

    def on_message(_c: object, _u: object, m: mqtt.MQTTMessage) -> None:
        if m.payload:
            got.append(msgpack.unpackb(m.payload, raw=False))

    c.on_message = on_message
    c.connect(host, port)
    c.subscribe(topic, qos=1)
    c.loop_start()
    try:
        return wait_for(lambda: next((s for s in got if s.get("st") == "online"), None),
                        what=f"an online status on {topic}", timeout=BOOT_S)  # fmt: skip
    finally:
        c.loop_stop()
        c.disconnect()


@on_unix_port
def test_provision_writes_settings_the_board_boots_with_and_prints_no_secret(
    tmp_path: Path, board: PtyBoard, broker: MosquittoProcess
) -> None:
    device = f"prov-{secrets.token_hex(3)}"
    prefix = f"wren-prov/{secrets.token_hex(3)}"
    reg, _ = registry_with(tmp_path, device)
    before = Registry(reg).user(device)
    wifi_file = tmp_path / "wifi.txt"
    wifi_secret = f"wifi-{secrets.token_hex(8)}"
    wifi_file.write_text(wifi_secret + "\n")
    port = board.start()
    try:
        done = wren(
            tmp_path, "provision", "--port", port, "--device", device, "--host", broker.host,
            "--port-mqtt", str(broker.port), "--wifi-ssid", "lab-net", "--wifi-password-file",
            str(wifi_file), "--prefix", prefix, "--agent", "edge_runtime.demo",
            "--registry", str(reg),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        settings = json.loads((board.flash / "settings.json").read_text())
        assert bs.check(settings) == settings
        assert settings["device"] == device and settings["port"] == broker.port
        assert settings["wifi"] == {"ssid": "lab-net", "password": wifi_secret}
        password = settings["password"]
        # A new password: its hash in the registry, the one `device add` made replaced.
        after = Registry(reg).user(device)
        assert after is not None and before is not None
        assert after.password_hash != before.password_hash
        assert check_password(password, after.password_hash)
        # Never printed, nor echoed by the board's console.
        for secret in (password, wifi_secret):
            assert secret not in done.stdout + done.stderr
            assert secret not in board.log
        assert '"password": "(set, not shown)"' in done.stdout
        # The board, soft-reset, boots main.py with these settings and reaches the broker.
        status = retained_status(broker.host, broker.port, f"{prefix}/d/{device}/status")
        assert status["st"] == "online"
        board.wait_for(f"board {device} agent")
        assert "no network module" in board.log  # the unix port: wifi set, host network used
    finally:
        board.stop()
        leftovers.clear(broker.host, broker.port, prefix, [device])


@on_unix_port
def test_invalid_settings_are_refused_by_name_and_nothing_is_written(
    tmp_path: Path, board: PtyBoard
) -> None:
    reg, _ = registry_with(tmp_path, "d1")
    registry_before = reg.read_bytes()
    port = board.start()
    done = wren(
        tmp_path, "provision", "--port", port, "--device", "d1", "--host", "",
        "--port-mqtt", "70000", "--wifi-ssid", "", "--registry", str(reg),
    )  # fmt: skip
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert "wren provision: BadValue: host: is empty" in lines
    assert any(
        x.startswith("wren provision: OutOfRange: port: 70000 is outside 1..65535") for x in lines
    )
    assert "wren provision: BadValue: wifi.ssid: is empty" in lines
    assert lines[-1] == "wren provision: nothing was written"
    assert not (board.flash / "settings.json").exists()
    assert reg.read_bytes() == registry_before

    unknown = wren(tmp_path, "provision", "--port", port, "--device", "nobody", "--host", "h",
                   "--registry", str(reg))  # fmt: skip
    assert unknown.returncode == 1
    assert unknown.stderr.startswith("wren provision: unknown device 'nobody'")
    missing = wren(tmp_path, "provision", "--port", "/dev/ttyWREN-NONE0", "--device", "d1",
                   "--host", "h", "--registry", str(reg))  # fmt: skip
    assert missing.returncode == 1
    assert missing.stderr.strip() == ("wren provision: cannot open port /dev/ttyWREN-NONE0: no "
                                      "such port (is the board plugged in? ls /dev/ttyACM* "
                                      "/dev/ttyUSB*)")  # fmt: skip
    assert reg.read_bytes() == registry_before

    # And a valid one: the CA goes to the board beside the settings that name it.
    ca = tmp_path / "lab-ca.pem"
    ca.write_bytes(b"-----BEGIN CERTIFICATE-----\nnot checked here\n-----END CERTIFICATE-----\n")
    done = wren(tmp_path, "provision", "--port", port, "--device", "d1", "--host", "10.0.0.2",
                "--tls-ca", str(ca), "--tls-server-hostname", "broker.lan", "--registry",
                str(reg), "--no-reset")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (board.flash / "lab-ca.pem").read_bytes() == ca.read_bytes()
    settings = json.loads((board.flash / "settings.json").read_text())
    assert settings["tls"] == {"ca": "lab-ca.pem", "server_hostname": "broker.lan"}
    assert "port" not in settings  # the board's default with tls: 8883
    assert reg.read_bytes() != registry_before


class _Mosquitto:
    """`mosquitto -c` on the config `wren broker-files` wrote, as a user starts it."""

    def __init__(self, conf: Path, port: int) -> None:
        exe = mosquitto_binary()
        assert exe is not None  # the suite needs Mosquitto (tools/setup.sh installs it)
        self.log = conf.parent / "mosquitto.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([exe, "-c", str(conf)], stdout=log, stderr=log)
        wait_for_port("127.0.0.1", port)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=15)


@on_unix_port
def test_the_new_password_reaches_the_broker_s_files_and_the_old_one_stops_working(
    tmp_path: Path, board: PtyBoard
) -> None:
    device = "thermo9"
    reg, old_password = registry_with(tmp_path, device)
    said = ok(tmp_path, "bridge-user", "add", "bridge", "--registry", str(reg))
    [line] = [x for x in said.splitlines() if x.startswith("password for bridge: ")]
    bridge_pw = line.split(": ", 1)[1]
    mport = free_port()
    files = tmp_path / "broker"
    ok(tmp_path, "broker-files", "--registry", str(reg), "--out", str(files), "--port", str(mport))
    mosquitto = _Mosquitto(files / "mosquitto.conf", mport)
    port = board.start()
    try:
        done = wren(
            tmp_path, "provision", "--port", port, "--device", device, "--host", "127.0.0.1",
            "--port-mqtt", str(mport), "--registry", str(reg), "--broker-files", str(files),
            "--no-reset",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert f"broker password file written: {files / 'passwords'}" in done.stdout
        password = json.loads((board.flash / "settings.json").read_text())["password"]
        assert password not in done.stdout + done.stderr
        # The README's next step: Mosquitto reloads its password file on SIGHUP.
        os.kill(mosquitto.proc.pid, signal.SIGHUP)
        soft_reset(port)
        status = retained_status("127.0.0.1", mport, f"wren/v1/d/{device}/status", "bridge",
                                 bridge_pw)  # fmt: skip
        assert status["st"] == "online"
        # The password `device add` printed is refused now.
        said_back: list[Any] = []
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=device)
        c.username_pw_set(device, old_password)
        c.on_connect = lambda _c, _u, _f, rc, _p: said_back.append(rc)
        c.connect("127.0.0.1", mport)
        c.loop_start()
        try:
            wait_for(lambda: said_back, what="the broker's answer to the old password")
        finally:
            c.loop_stop()
        assert said_back[0].is_failure, said_back
    finally:
        board.stop()
        mosquitto.stop()
