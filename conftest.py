"""Shared fixtures: a real Mosquitto per test session, on a free loopback port."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.broker import MosquittoProcess, start_mosquitto  # noqa: E402

# A suite started in the background by a non-interactive shell (`sh -c '... &'`, nohup)
# inherits SIGINT ignored, and so would every process it starts: the tests that stop
# the demo and the bridge as Ctrl-C does would then find them deaf to it. Python's own
# handler, as in a terminal; the processes the tests start get the default after exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MosquittoProcess]:
    """An anonymous Mosquitto of the session's own; board tests read its address
    from WREN_TEST_BROKER, which is also what the unix-port runs are given."""
    # Nagle is off on it, as on every broker Wren starts (tools/broker.py).
    b = start_mosquitto(tmp_path_factory.mktemp("mosquitto"))
    old = os.environ.get("WREN_TEST_BROKER")
    os.environ["WREN_TEST_BROKER"] = b.address
    yield b
    if old is None:
        os.environ.pop("WREN_TEST_BROKER", None)
    else:
        os.environ["WREN_TEST_BROKER"] = old
    b.stop()
