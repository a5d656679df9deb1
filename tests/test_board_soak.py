"""Issue 24's acceptance, "The board never wedges": 1,000 requests in a row (300 in the
suite, for its time; WREN_SOAK_RUNS=1000 runs the issue's count) to the
four-field memory agent (a user slot, a user `sum` slot, a user collection and a granted
tenant collection), one model stream in ten cut mid-answer and one link in twenty cut
mid-run, through the real bridge process and Mosquitto (tests/soak.py has the agent, the
model's answers and the relay), on the MicroPython unix port (64-bit) at 128K with the
runtime frozen into the binary, as a board's firmware holds it (tests/stack.py
frozen_binary, built by ../shared/micropython's kit; its flash holds no copy of the runtime,
which would come first on its path and be what runs); the same on the 32-bit build at
96K (200 requests in the suite; 1,000 passed with WREN_SOAK_RUNS_32=1000); and on the
kit's 32-bit binary with the runtime in a ROMFS image (`wren build --romfs`), at 72K
beyond it (100 requests in the suite).

The soak runs once for the module, and each test reads one property from its records:
every request ends; every failure is named and retryable; no MemoryError in a run that
was not forced; every answer that arrived is the model's, exactly; the free heap stays
level. The 1,000 requests took about 2 minutes on a 2-core machine (2 min 33 s with the
frozen build, cached). With the runtime loaded from .mpy instead, its code is on the
heap: a median 9.8 KiB free after a run against 25.4 KiB frozen, the largest free block
1.1 against 13.2 KiB, and this agent fails most requests at 128K (bench_soak, 200 runs
each). WREN_SOAK_RUNS sets another count.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.soak import (
    AGENT_PY,
    BALLAST_PY,
    PROBE_PY,
    Fault,
    RunRecord,
    Soak,
)
from tests.stack import frozen_binary, i686_binary
from tools.virtual_board import lay_out_flash, micropython_binary, run_on_flash

# 300 in the suite, for the suite's time (CI's budget: the 500 this was, with the 32-bit
# soak's 300, took 175 s of a 19-minute suite); the 1,000 pass with
# WREN_SOAK_RUNS=1000 (last run 2026-12-06, frozen with no flash copy, with
# WREN_SOAK_RUNS_32=1000: all 11 tests on both words, 858 s).
RUNS = int(os.environ.get("WREN_SOAK_RUNS", "300"))
# The runs a board's heap takes to settle, exempt from the level: the first loads the
# model loop's code for good, and the board keeps the ids of the last 16 requests
# (runs._SEEN_REQS, for refusing duplicates), a string each, and the event rings of its
# last two runs. A 256K board that never ran out of memory came down 3 KiB over its
# first 16 runs and stayed there.
WARMUP_RUNS = 20
LEVEL_BYTES = 1024
# How far below the level one run's idle heap may be: what a run leaves idle varies with
# how it ended. That was measured on .mpy from the flash (1,000 runs at 128K: level 30,336 B,
# 4 runs at 29.2 KiB), and the frozen board's runs spread as wide: 300 runs at 128K, 1,120 B
# above its level to 1,088 below; one CI rehearsal's run 2,112 B below, once in 280, the
# level's last quarter 256 B below it. The level's drift (LEVEL_BYTES) is what tells a leak.
FLOOR_BYTES = 3072
SHOWN = 5  # records shown in a failure message


# The word sizes the soak runs on, each at its heap: the README's 128K on the 64-bit unix
# port, and on the 32-bit build (what boards are) the heap its figures give, 96K
# (benchmarks/bench_heap.py: the memory turn needs 90K from .mpy there). The 32-bit soak
# runs fewer requests in the suite, for the suite's time; WREN_SOAK_RUNS_32 sets it (the
# issue's 1,000 were run so, and the note gives their figures).
WORDS = {
    "64-bit": ("x64", "128K", RUNS),
    "32-bit": ("i686", "96K", int(os.environ.get("WREN_SOAK_RUNS_32", "200"))),
}
# And the 32-bit build with the runtime's .mpy in a ROMFS image (`wren build --romfs`, for
# a firmware with a ROMFS partition), at the heap issue 29 asks of a memory turn from .mpy:
# 72K beyond the image (100 requests there kept 26.5-29.1 KiB free once idle, and at 64K
# 19.0-21.1 KiB, 2026-12-06). The kit's prebuilt 32-bit binary, no firmware to build.
# 100 requests in the suite, for its time (200 took 81 s in CI's rehearsal, beside the
# frozen soaks on the same worker); WREN_SOAK_RUNS_ROMFS sets another count (1,000
# passed every check so, in 251 s, 2026-12-06).
ROMFS_SOAK = ("32-bit romfs", "72K", int(os.environ.get("WREN_SOAK_RUNS_ROMFS", "100")))


@pytest.fixture(scope="module", params=[*sorted(WORDS), ROMFS_SOAK[0]])
def soak(request: pytest.FixtureRequest) -> Iterator[list[RunRecord]]:
    # The agent alone on the board: what these tests read is the runtime's own console
    # (its heap line after each run, its MemoryError reports), and the soak's probe
    # (the largest free block, for bench_soak) costs the board about 1 KiB of heap.
    # The runtime frozen into the board's firmware, as a board ships it: loaded from
    # .mpy files instead, its code is on the 128K heap, and this agent then fails most
    # requests (benchmarks/bench_soak.py, whose figures say so).
    if request.param == ROMFS_SOAK[0]:
        exe32 = i686_binary()
        if exe32 is None:
            if os.environ.get("CI"):
                pytest.fail("CI has ../shared/micropython's kit: its 32-bit binary must be there")
            pytest.skip("needs ../shared/micropython's 32-bit binary")
        _, heap, runs = ROMFS_SOAK
        with Soak(probe=False, micropython=exe32, heap=heap, runtime="romfs") as s:
            yield s.run(runs)
        return
    arch, heap, runs = WORDS[request.param]
    exe = frozen_binary(arch)
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("CI has ../shared/micropython's kit: the frozen board must build")
        pytest.skip("needs ../shared/micropython's build kit to freeze the runtime")
    with Soak(probe=False, micropython=exe, heap=heap, runtime="frozen") as s:
        yield s.run(runs)


def shown(records: list[RunRecord], lines: int = 12) -> str:
    """The first records of a failure, each with its last console lines."""
    out = []
    for r in records[:SHOWN]:
        out.append(
            f"request {r.number} ({r.fault or 'no fault'}): {r.status} {r.kind} "
            f"retryable={r.retryable} run={r.run} msg={r.msg!r}"
        )
        out += [f"    | {line}" for line in r.console[-lines:]]
    more = len(records) - SHOWN
    return "\n".join(out + ([f"... and {more} more"] if more > 0 else []))


def test_every_request_ends(soak: list[RunRecord]) -> None:
    # Done, failed or cancelled at the host, or refused by its own req id: never lost.
    assert len(soak) in (WORDS["64-bit"][2], WORDS["32-bit"][2], ROMFS_SOAK[2])
    lost = [r for r in soak if r.status == "lost"]
    assert len(lost) == 0, f"{len(lost)} of {len(soak)} requests never ended:\n{shown(lost)}"
    unnamed = [r for r in soak if r.status == "refused" and r.refused_req != r.req]
    assert len(unnamed) == 0, shown(unnamed)


def test_every_failure_is_named_and_retryable(soak: list[RunRecord]) -> None:
    bad = [r for r in soak if not r.named_and_retryable]
    kinds = Counter((r.status, r.kind, r.retryable) for r in bad)
    assert len(bad) == 0, (
        f"{len(bad)} of {len(soak)} failures not named and retryable {kinds}:\n{shown(bad)}"
    )
    # A cut stream fails its run (the bridge's `llm`, cause `unavailable`): a partial
    # answer is never shown as a whole one.
    cut = [r for r in soak if r.fault == Fault.STREAM_CUT and r.status == "done"]
    assert len(cut) == 0, shown(cut)


def test_no_memory_error_in_a_run_that_was_not_forced(soak: list[RunRecord]) -> None:
    hit = [r for r in soak if r.fault != Fault.FORCED and (r.memory_errors or r.resets)]
    places = Counter(m.place for r in hit for m in r.memory_errors)
    resets = sum(len(r.resets) > 0 for r in hit)
    assert len(hit) == 0, (
        f"{len(hit)} of {len(soak)} requests met a MemoryError (board resets: {resets}); "
        f"by place: {places.most_common()}\n{shown(hit, 20)}"
    )


def test_every_answer_served_is_the_models_exactly(soak: list[RunRecord]) -> None:
    # Text (1,000-2,000 characters naming its request) and tool results as the model
    # and the board made them: nothing lost, doubled or taken from another request.
    done = [r for r in soak if r.status == "done"]
    assert done, "no request was served"
    wrong = [r for r in done if not (r.text_ok and r.tools_ok)]
    assert len(wrong) == 0, shown(wrong)


def test_the_free_heap_stays_level(soak: list[RunRecord]) -> None:
    # Per boot (a board that reset itself starts over), past its first WARMUP_RUNS: the
    # free heap once idle after each run (collected, nothing in flight: the runtime's
    # "idle; heap free" line). A leak, or a heap that fragments, takes heap away run
    # after run: the last quarter's median may not have drifted more than LEVEL_BYTES
    # below the level (the median of the first quarter), and no run may fall more than
    # FLOOR_BYTES below it. Above it is no harm: what a run leaves idle varies by 1-3 KiB
    # with how it ended (29.2-32.4 KiB at 128K frozen). The line at a run's end is
    # no level: it is taken while the run's last events are in flight. A run followed so
    # closely by the next request that the board was never idle has no figure.
    boots: dict[str, list[int]] = {}
    for r in soak:
        if r.boot is not None and r.idle_free is not None:
            boots.setdefault(r.boot, []).append(r.idle_free)
    checked = 0
    for boot, all_free in boots.items():
        free = all_free[WARMUP_RUNS:]
        if len(free) < 8:
            continue
        quarter = len(free) // 4
        level = statistics.median(free[:quarter])
        low = [f for f in free if f < level - FLOOR_BYTES]
        last = statistics.median(free[-quarter:])
        assert not low and last >= level - LEVEL_BYTES, (
            f"boot {boot}: level {level} B (median of runs {WARMUP_RUNS + 1}-"
            f"{WARMUP_RUNS + quarter}), last quarter's median {last} B, {len(low)} of "
            f"{len(free)} runs more than {FLOOR_BYTES} B below it: {low[:20]}"
        )
        checked += len(free)
    # A board that reset itself every few runs never settles: that fails here too.
    assert checked >= (len(soak) - WARMUP_RUNS) // 2, f"only {checked} runs had a level to keep to"


def test_the_probes_intern_no_name_of_their_own() -> None:
    # The board's qstr pool is a few names short of its next doubling (7 KiB at once):
    # probes that interned names of their own would change what they measure. The
    # board's names after it has loaded the agent, with and without them, are the same.
    exe = micropython_binary()
    assert exe is not None, "the MicroPython unix port is not installed"
    names = {}
    for probes in (False, True):
        main = AGENT_PY + (PROBE_PY + BALLAST_PY if probes else "")
        main += "import micropython\nmicropython.qstr_info(1)\n"
        with tempfile.TemporaryDirectory(prefix="wren-soak-") as tmp:
            flash = lay_out_flash(Path(tmp) / "flash", {"device": "x"}, mpy=True, main_py=main)
            out = run_on_flash(exe, flash, heap="128K")
            assert out.returncode == 0, out.stdout + out.stderr
            # Module paths differ with the directory: compared without it.
            names[probes] = {
                line.strip().replace(tmp, "")
                for line in out.stdout.splitlines()
                if line.strip().startswith("Q(")
            }
    assert len(names[False]) > 400, len(names[False])
    assert names[True] == names[False], (names[True] - names[False], names[False] - names[True])
