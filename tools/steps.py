"""Step lines on stderr for work that takes more than a couple of seconds.

The project shows progress as plain lines, not a bar (no rich, no tqdm: see
tools/setup.sh): they read the same in a terminal, a CI log and a file, and stdout
stays for the figures or the answer. Each line names the program, says what starts or
what came of it, and how long the program has been running:

    bench_heap: one demo turn (.mpy) [1: 64-bit]: bisecting 8K..256K  (12.4 s)
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Steps:
    """`Steps("bench_heap")("laying out the flash")` prints one step line."""

    def __init__(self, prog: str, out: TextIO | None = None) -> None:
        self.prog = prog
        self._out = out
        self._start = time.monotonic()

    def __call__(self, msg: str) -> None:
        out = self._out if self._out is not None else sys.stderr
        elapsed = time.monotonic() - self._start
        print(f"{self.prog}: {msg}  ({elapsed:.1f} s)", file=out, flush=True)
