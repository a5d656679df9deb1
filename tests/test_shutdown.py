"""Stopping the bridge, and a second bridge on one broker, against real processes:
Mosquitto, `wren bridge` (tests/stack.py), the board on the MicroPython unix port and a
real HTTP model server (tests/model_server.py) that streams slowly.

A stop mid-stream (SIGTERM, or SIGINT as Ctrl-C sends it) ends the bridge in a moment,
not when the model's stream ends: the call in flight is answered `llm` / `unavailable`,
retryable, the board ends the run with the bridge's words, and the host sees them
(PROTOCOL.md "Errors", "Bridge presence"). The only timed bound is a generous one on the
exit, far below the stream's length.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from server_bridge.bridge import _PahoLog
from tests.model_server import ModelServer, Turn
from tests.stack import ROOT, Stack

# A model that trickles: 400 events, 0.25 s apart, about 100 s in all.
TRICKLE = Turn(text="warm " * 400, chunk_chars=5, delay_s=0.25)
# A model that says nothing for 100 s, then answers.
SILENT = Turn(text="warm", hang_s=100.0)
# Far below the model's 100 s; the stop itself takes a second or two.
EXIT_BOUND_S = 10.0


def _stop_during_the_model_call(tmp_path: Path, sig: int, turn: Turn) -> None:
    with ModelServer([turn]) as server, Stack(tmp_path, model_url=server.url) as s:
        req = s.request("How warm is it?")
        assert s.client is not None
        deadline = time.monotonic() + 30
        if turn.hang_s:
            # The request is at the model server, which has not answered.
            while not server.requests:
                assert time.monotonic() < deadline, s.describe()
                time.sleep(0.05)
        else:
            # Mid-stream: the model's first words have reached the host.
            while not any(e.get("t") == "msg.delta" for e in s.client.events):
                assert time.monotonic() < deadline, s.describe()
                time.sleep(0.05)
        began = time.monotonic()
        code = s.signal_bridge(sig, timeout=EXIT_BOUND_S * 3)
        took = time.monotonic() - began
        snap = s.wait_run(req, timeout=10)
        log = s.bridge_log()
    assert took < EXIT_BOUND_S, f"the bridge took {took:.1f} s to stop\n{log}"
    # Ctrl-C and SIGTERM alike: the CLI's "stopped", exit 130 (tools/entry.py, service.py).
    assert code == 130, log
    assert "Traceback" not in log and " ERROR " not in log, log
    assert "stopped" in log
    # The run ends with the cause, and asking again may help.
    assert snap.status == "failed", snap
    assert snap.error is not None and snap.error.get("kind") == "llm", snap.error
    assert snap.error.get("cause") == "unavailable", snap.error
    assert "the bridge stopped during the model call" in snap.error.get("msg", ""), snap.error
    assert snap.retryable


@pytest.mark.parametrize(
    ("sig", "turn"),
    [(signal.SIGTERM, TRICKLE), (signal.SIGTERM, SILENT), (signal.SIGINT, SILENT)],
    ids=["sigterm-mid-stream", "sigterm-model-silent", "sigint-model-silent"],
)
def test_stopping_the_bridge_during_a_model_call_ends_it_at_once_and_the_run_by_name(
    tmp_path: Path, sig: int, turn: Turn
) -> None:
    _stop_during_the_model_call(tmp_path, sig, turn)


def _bridge_as(s: Stack, user: str) -> list[str]:
    """`wren bridge` as the Stack starts it, but logged in as `user`."""
    out = []
    for arg in s.bridge_command():
        if arg.startswith("--user="):
            arg = f"--user={user}"
        elif arg.startswith("--password="):
            arg = f"--password={s.users[user]}"
        out.append(arg)
    return out


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def test_a_second_bridge_on_the_prefix_refuses_to_start_and_the_first_serves_on(
    tmp_path: Path,
) -> None:
    with Stack(tmp_path, extra_users={"bridge2": "bridge"}) as s:
        second = subprocess.run(
            _bridge_as(s, "bridge2"), cwd=s.workdir, env=_env(), capture_output=True,
            text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode == 1, second.stdout + second.stderr
        assert second.stdout == "" and "Traceback" not in second.stderr, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        line = lines[0]
        assert line.startswith("wren bridge: another bridge (client id bridge, boot "), line
        assert line.endswith(
            f"is online on 127.0.0.1:{s.port} for prefix wren/v1: one bridge process per "
            "prefix; stop it first"
        ), line
        # The first never noticed: it serves the next run.
        assert s.ask("How warm is it?").status == "done", s.describe()

        # SIGKILLed, the first leaves its will: a bridge started after it serves, of the
        # same user (a restart after a crash) ...
        s.kill_bridge()
        s.start_bridge()
        assert s.ask("How warm is it?").status == "done", s.describe()
        # ... or of another.
        s.kill_bridge()
        other = subprocess.Popen(
            _bridge_as(s, "bridge2"), cwd=s.workdir, env=_env(), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            assert other.stdout is not None
            first = other.stdout.readline()
            assert first.startswith("bridge: "), first + other.stdout.read()
            assert s.ask("How warm is it?").status == "done", s.describe()
        finally:
            other.terminate()
            assert other.wait(timeout=15) == 130


def test_paho_errors_are_errors_until_the_stop_and_quiet_during_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What paho's network thread logs at ERROR as an orderly stop closes its socket
    ("Client is not connected", "failed to receive on socket") is DEBUG once the bridge
    is stopping; before, a real error is still an ERROR."""
    stopping, undoing = threading.Event(), threading.Event()
    paho_log = _PahoLog(stopping, undoing)
    caplog.set_level(logging.DEBUG, logger="wren.bridge.paho")
    paho_log.log(logging.ERROR, "failed to receive on socket: %s", "reset")
    # While a failed start is undone (another bridge serves the prefix), as at a stop.
    undoing.set()
    paho_log.log(logging.ERROR, "Client is not connected. Socket: %r", None)
    undoing.clear()
    paho_log.log(logging.ERROR, "failed to receive on socket: %s", "again")
    stopping.set()
    paho_log.log(logging.ERROR, "Client is not connected. Socket: %r", None)
    paho_log.log(logging.DEBUG, "Sending DISCONNECT")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ERROR", "failed to receive on socket: reset"),
        ("DEBUG", "Client is not connected. Socket: None"),
        ("ERROR", "failed to receive on socket: again"),
        ("DEBUG", "Client is not connected. Socket: None"),
        ("DEBUG", "Sending DISCONNECT"),
    ]


def test_demo_once_exits_without_an_error_line(tmp_path: Path) -> None:
    # At the demo's own 128K from .mpy: its third request (a memory turn) ran out of
    # memory, retryable, in 3 of 10 of these tests until the .mpy files dropped their
    # line-number tables (tools/virtual_board.py); 24 of 24 `--once` passed after.
    for k in range(3):
        proc = subprocess.run(
            [sys.executable, "-m", "tools.cli", "demo", "--once", "--heap", "128K",
             "--workdir", str(tmp_path / f"run{k}")],
            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-2000:]
        assert " ERROR " not in out and "Traceback" not in out, out[-2000:]
