"""Boot to presence on the MicroPython unix port: from the board's process being started
to its retained `online` status arriving at a reader on the broker (the status a
dashboard and the bridge take as "the board is here").

    .venv/bin/python benchmarks/bench_boot.py [--runs 5] [--heap 128K] [--agent PATH]

The parts are the pytest plugin's (tools/hil_lab.py): Mosquitto with Wren's password
file and ACL on a free loopback port, the bridge with the scripted model, and a board
on a fresh copy of its flash for each boot (edge_runtime as .mpy, the agent's main.py
compiled on the board, as a flashed board has it). What a boot includes: the unix port
starting, the runtime's import, the app's compile, the MQTT connection (a persistent
session, there since the first boot) and the status's way through the broker. Printed:
each boot's time, then the median, min and max in milliseconds. Figures from the unix
port on a PC; a board's flash and Wi-Fi add their own.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.hil_lab import Agent, Lab, Model, Target  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description="Boot to presence on the unix port.")
    parser.add_argument("--runs", type=int, default=5, help="boots to time (default 5)")
    parser.add_argument("--heap", default="128K", help="the board's heap (default 128K)")
    parser.add_argument(
        "--agent", type=Path, default=None, help="the board's main.py (default: the demo's)"
    )
    parser.add_argument("--micropython", default=None, help="another unix port binary")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    agent = Agent() if args.agent is None else Agent.at(args.agent)
    times: list[float] = []
    with Lab() as lab:
        lab.bridge(Model(), agent.name)
        for n in range(args.runs):
            board = lab.board(Target("unix"), agent, args.heap, args.micropython)
            board.stop()
            assert board.boot_s is not None
            times.append(board.boot_s * 1000)
            print(f"bench_boot: boot {n + 1}: {times[-1]:.0f} ms", file=sys.stderr, flush=True)
    print(f"boot to presence, unix port, {args.heap}, agent {agent.name}, {args.runs} boots")
    print(
        f"median {statistics.median(times):.0f} ms, min {min(times):.0f} ms, "
        f"max {max(times):.0f} ms"
    )


if __name__ == "__main__":
    main()
