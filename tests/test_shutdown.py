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

import signal
import time
from pathlib import Path

import pytest

from tests.model_server import ModelServer, Turn
from tests.stack import Stack

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
