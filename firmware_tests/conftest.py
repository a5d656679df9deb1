"""Board tests under pytest on CPython: modules that talk to a broker get the session's
Mosquitto (its address reaches them through WREN_TEST_BROKER, as on the unix port)."""

from __future__ import annotations

import pytest

from firmware_tests.test_on_unix_port import NEEDS_BROKER


@pytest.fixture(autouse=True)
def _broker_for_board_tests(request: pytest.FixtureRequest) -> None:
    # One list (NEEDS_BROKER) decides for both runtimes which modules need the broker.
    module = request.module.__name__.rsplit(".", 1)[-1]
    if module in NEEDS_BROKER:
        request.getfixturevalue("broker")
