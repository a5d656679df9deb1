"""Waiting in tests for what other threads and processes make true: bounded, and named
in the failure, so a test that waits says what never came."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# Long enough for a loaded 2-core machine; only a failing test waits it out.
WAIT = 10.0


def wait_for(pred: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    """pred()'s first true value, looked at every 20 ms; AssertionError naming `what`
    once `timeout` seconds have passed without one."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
