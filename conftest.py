"""Shared fixtures: a real Mosquitto per test session, on a free loopback port."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.broker import MosquittoProcess, start_mosquitto  # noqa: E402


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MosquittoProcess]:
    """An anonymous Mosquitto of the session's own; board tests read its address
    from WREN_TEST_BROKER, which is also what the unix-port runs are given."""
    # Nagle off, as bench_stream's tuned stack has it: otherwise Mosquitto's small writes
    # (a PUBACK, a 4-character chunk) wait about 40 ms each for the peer's delayed ACK,
    # which a stream paced by acks pays on every window: seconds of sleeping per test
    # that says nothing about Wren (bench_stream measures the default separately).
    b = start_mosquitto(tmp_path_factory.mktemp("mosquitto"), extra_conf="set_tcp_nodelay true\n")
    old = os.environ.get("WREN_TEST_BROKER")
    os.environ["WREN_TEST_BROKER"] = b.address
    yield b
    if old is None:
        os.environ.pop("WREN_TEST_BROKER", None)
    else:
        os.environ["WREN_TEST_BROKER"] = old
    b.stop()
