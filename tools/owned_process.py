"""Child processes that end with the process that owns them.

The parts the CLI and the tests start (a virtual board, a broker) run in sessions of
their own, so that Ctrl-C reaches their owner, which stops them in order. Nothing else
ends them: a SIGKILLed `wren board --virtual` left its board connected as the device,
serving requests (issue 25).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

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
