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
