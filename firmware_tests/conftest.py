"""Board tests under pytest on CPython: modules that talk to a broker get a Mosquitto of
the board tests' own (its address reaches them through WREN_TEST_BROKER, as on the unix
port)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from firmware_tests.test_on_unix_port import NEEDS_BROKER
from tools.broker import MosquittoProcess, start_mosquitto


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MosquittoProcess]:
    """Not the bridge tests' broker: the scripted bridge publishes a retained `online`
    on the runtime's default prefix (as a bridge does), which a real bridge started
    later on the same broker takes for a rival and refuses to start beside. Files run
    in any order on pytest-xdist's workers, so nothing may depend on who ran before."""
    b = start_mosquitto(tmp_path_factory.mktemp("board-mosquitto"))
    yield b
    b.stop()


@pytest.fixture(autouse=True)
def _broker_for_board_tests(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One list (NEEDS_BROKER) decides for both runtimes which modules need the broker.
    module = request.module.__name__.rsplit(".", 1)[-1]
    if module in NEEDS_BROKER:
        # Set per test: the bridge tests' broker fixture, made later on this worker,
        # sets the same variable for the process.
        monkeypatch.setenv("WREN_TEST_BROKER", request.getfixturevalue("broker").address)
