"""Nodes and budgets: what they cost (PROTOCOL.md "Nodes", "Budgets").

Two figures, each next to its baseline measured in the same run:
1. events and bytes per model step of the demo turn ("How warm is it in here?": two
   model steps and a tool), all of them as a host receives them, against the same
   run without the model loop's node marking (the node.start, node.end and usage
   events that carry a node, taken out): what marking adds on the wire (each event is
   one MQTT message; bytes are its msgpack envelope);
2. the model loop's node start on the MicroPython unix port (64-bit, .mpy), µs each:
   counting the node alone, against the same with a budget of every kind to check
   (budget.py, no warning due).

The board is the real runtime (.mpy) on the unix port at 128K, the bridge the real
service with its scripted demo model, the host the real client.

    python benchmarks/bench_nodes.py              # about 20 seconds
    python benchmarks/bench_nodes.py --runs 50
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from server_bridge.wire import encode  # noqa: E402
from tests.stack import Stack  # noqa: E402
from tools.steps import Steps  # noqa: E402
from tools.virtual_board import install_package, micropython_binary  # noqa: E402

ASK = "How warm is it in here?"
NODE_EVENTS = ("node.start", "node.end", "usage")

# On the unix port: the model loop's node start (toolloop.node) timed without and with
# a budget of every kind. Run at 256K: a time, not a heap figure.
NODE_START = """\
import time
from edge_runtime.agent import Agent
from edge_runtime.runs import Runtime, Run
from edge_runtime.toolloop import node
from edge_runtime import budget, platform
N = %d

async def quiet(t, d=None, n=None):
    pass

def timed(agent):
    runtime = Runtime(agent, "bench", {})
    run = Run(runtime, "b.1", {"req": "q", "input": "x"})
    run.event = quiet
    budget.start(run)
    usage = {"in": 0, "out": 0, "reason": 0}
    paths = ["/model", "/tool/read_temperature", "/tool/memory.recall"]
    async def go():
        t0 = time.ticks_us()
        for i in range(N):
            run.nodes.clear()  # every start counts from 1: never near a limit
            await node(run, paths[i %% 3], usage)
        return time.ticks_diff(time.ticks_us(), t0)
    return platform.asyncio.run(go()) / N

plain = timed(Agent("a", "1", "x"))
limit = 10 ** 9
checked = timed(Agent("a", "1", "x", budget={"steps": limit, "tokens": limit,
                                               "wall_s": limit, "reads": limit}))
print("node_us", plain, checked)
"""


def per_step(events: list[dict[str, Any]], steps: int) -> tuple[float, float, float, float]:
    """(events, bytes) a model step, all and without node marking."""
    every = [len(encode(e)) for e in events]
    off = [len(encode(e)) for e in events if not (e["t"] in NODE_EVENTS and "n" in e)]
    return len(every) / steps, sum(every) / steps, len(off) / steps, sum(off) / steps


def wire_figures(runs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="wren-bench-nodes-") as tmp, Stack(Path(tmp)) as s:
        assert s.client is not None
        steps = 0
        events: list[dict[str, Any]] = []
        kinds: Counter[str] = Counter()
        for _ in range(runs):
            snap = s.ask(ASK)
            assert snap.status == "done", s.describe()
            mine = [e for e in s.client.events if e["r"] == snap.run]
            steps += sum(1 for e in mine if e["t"] == "node.start" and e.get("n") == "/model")
            events += mine
            kinds.update(e["t"] for e in mine if e["t"] in NODE_EVENTS and "n" in e)
    ev_on, by_on, ev_off, by_off = per_step(events, steps)
    return {
        "steps": steps,
        "events_on": ev_on,
        "bytes_on": by_on,
        "events_off": ev_off,
        "bytes_off": by_off,
        "kinds": {k: v / steps for k, v in sorted(kinds.items())},
    }


def node_start_us(n: int) -> tuple[float, float] | None:
    exe = micropython_binary()
    if exe is None:
        return None
    with tempfile.TemporaryDirectory(prefix="wren-bench-nodes-") as tmp:
        install_package(Path(tmp), mpy=True)
        samples = []
        for _ in range(5):
            out = subprocess.run(
                [exe, "-X", "heapsize=256K", "-c", NODE_START % n],
                cwd=tmp,
                env={"MICROPYPATH": ".frozen:" + tmp},
                capture_output=True,
                text=True,
                timeout=120,
            )
            line = [x for x in out.stdout.splitlines() if x.startswith("node_us")]
            assert line, out.stdout + out.stderr
            _, plain, checked = line[0].split()
            samples.append((float(plain), float(checked)))
    return (
        statistics.median(p for p, _ in samples),
        statistics.median(c for _, c in samples),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="demo turns (default 10)")
    parser.add_argument("--starts", type=int, default=2000, help="node starts timed")
    args = parser.parse_args()
    print(f"command: python benchmarks/bench_nodes.py --runs {args.runs} --starts {args.starts}")
    steps = Steps("bench_nodes")
    steps(f"{args.runs} demo turns with node marking and {args.runs} without")
    w = wire_figures(args.runs)
    print(f"demo turns: {args.runs}, model steps: {w['steps']}")
    print("per model step            events   bytes")
    print(f"  with node marking       {w['events_on']:6.1f}  {w['bytes_on']:6.0f}")
    print(f"  without (baseline)      {w['events_off']:6.1f}  {w['bytes_off']:6.0f}")
    added = w["events_on"] - w["events_off"], w["bytes_on"] - w["bytes_off"]
    print(f"  marking adds            {added[0]:6.1f}  {added[1]:6.0f}")
    print("  of which: " + ", ".join(f"{k} {v:.1f}" for k, v in w["kinds"].items()))
    steps(f"{args.starts} node starts on the unix port")
    us = node_start_us(args.starts)
    if us is None:
        print("node start: no MicroPython unix port here")
    else:
        print(
            f"node start on the unix port (64-bit .mpy): {us[0]:.1f} us; "
            f"with a budget of every kind to check: {us[1]:.1f} us"
        )


if __name__ == "__main__":
    main()
