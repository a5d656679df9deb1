"""Child processes that end with the process that owns them.

The parts the CLI and the tests start (a virtual board, a broker) run in sessions of
their own, so that Ctrl-C reaches their owner, which stops them in order. Nothing else
ends them: a SIGKILLed `wren board --virtual` left its board connected as the device,
serving requests (issue 25).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

# prctl(2): the signal the kernel sends a process when the thread that started it ends.
_PR_SET_PDEATHSIG = 1


def die_with_owner() -> Callable[[], None] | None:
    """A preexec_fn that makes the child die with the process starting it.

    The kernel's parent-death signal needs no code in the child (a board-side watch
    would cost the board's measured heap) and fires at once. Linux only; elsewhere the
    owner's own stop() is all there is. The "parent" is the thread that started the
    child: start it from one that outlives it.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    # Looked up here, in the owner: the child between fork and exec only calls it.
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    owner = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL))
        # The owner died before the prctl took: no signal will come.
        if os.getppid() != owner:
            os._exit(1)

    return preexec


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 5.0) -> bool:
    """SIGTERM `proc` (a broker then saves its state, a board's owner cleans up) and wait
    up to `timeout_s`; one that ignores it is SIGKILLed and waited for. Returns whether it
    had to be killed, for a caller that counts that as a fault. Nothing to do for a
    process that has ended. subprocess.TimeoutExpired if even SIGKILL did not end it in
    `timeout_s`."""
    if proc.poll() is not None:
        return False
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
        return False
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)
        return True
