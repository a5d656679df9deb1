"""Runs that pause: what pausing and coming back cost (PROTOCOL.md "Runs that pause").

Three figures, each next to a baseline measured in the same run:
1. answer -> run.resumed at the host, p50/p99, against request -> run.started at the
   host for the same runs (both: a host message through Mosquitto and the bridge to
   the board, and an event back);
2. board start -> run.resumed at the host for a run paused before a SIGKILL, against
   board start -> its `link: up` console line;
3. checkpoint bytes and write time per step on the MicroPython unix port (pause._save
   of a model loop's conversation and ring, 64-bit), against writing the same bytes
   with platform.write_file alone (the encode's share).

The board is the real runtime (.mpy) on the unix port at 128K, the bridge the real
service, the model an OpenAI-compatible server (tests/model_server.py) whose turns call
a client tool.

    python benchmarks/bench_pause.py              # about half a minute
    python benchmarks/bench_pause.py --runs 100 --boots 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from server_bridge.host.reducer import RunSnapshot  # noqa: E402
from tests.model_server import ModelServer, ToolCall, Turn  # noqa: E402
from tests.stack import Stack  # noqa: E402
from tools.steps import Steps  # noqa: E402
from tools.virtual_board import install_package, micropython_binary  # noqa: E402

ASKER = """\
from edge_runtime import board
from edge_runtime.agent import Agent

agent = Agent("asker", "1.0", "You ask before you act.")
agent.tool("ask_user", "Ask the user a question", {"type": "object", "properties": {
    "q": {"type": "string"}}})(None)
board.start(agent)
"""

# On the unix port: a run of 3 model turns, as the model loop holds it at a step
# boundary, and its ring full of events; pause._save timed against write_file alone.
# Run at 256K: a time, not a heap figure (the script's own compile shares the heap).
CHECKPOINT = """\
import time, gc
from edge_runtime import platform, pause
from edge_runtime.agent import Agent
from edge_runtime.runs import Runtime, Run
agent = Agent("asker", "1.0", "You ask before you act. " * 8)
rt = Runtime(agent, "bench", {"flash_dir": "%(dir)s/"})
run = Run(rt, "0badc0de.1", {"req": "q1", "input": "Open valve 3 and tell me the pressure."})
for n in range(16):
    run.emitter.emit("msg.delta", {"m": 1, "text": "streamed text of the answer " * 3})
messages = [{"role": "system", "content": agent.instructions},
            {"role": "user", "content": run.input}]
for n in range(3):
    messages.append({"role": "assistant", "content": "Let me check that for you.",
                     "tools": [{"call": "c%%d" %% n, "name": "read_pressure", "input": "{}"}]})
    messages.append({"role": "tool", "call": "c%%d" %% n, "content": "2.5 bar"})
usage = {"in": 900, "out": 120, "reason": 0}
N = %(n)d
size = 0
t = time.ticks_us()
for i in range(N):
    size = pause._save(run, "run", 3, messages, usage, ())
save_us = time.ticks_diff(time.ticks_us(), t) / N
names = [n for n in __import__("os").listdir("%(dir)s") if n.startswith("ck_")]
data = open("%(dir)s/" + names[0], "rb").read()
t = time.ticks_us()
for i in range(N):
    platform.write_file("%(dir)s/plain.bin", data)
write_us = time.ticks_diff(time.ticks_us(), t) / N
print(json.dumps({"bytes": size, "save_us": save_us, "write_us": write_us}))
"""


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _stamps(s: Stack) -> dict[tuple[str, str], float]:
    """(run, event type) -> when the host first had it, filled by on_event."""
    seen: dict[tuple[str, str], float] = {}
    lock = threading.Lock()

    def on_event(event: dict[str, Any], snap: RunSnapshot) -> None:
        with lock:
            seen.setdefault((event["r"], event["t"]), time.perf_counter())

    assert s.client is not None
    s.client.on_event = on_event
    return seen


def _wait(seen: dict[tuple[str, str], float], key: tuple[str, str], timeout: float = 30) -> float:
    end = time.monotonic() + timeout
    while key not in seen:
        if time.monotonic() > end:
            raise TimeoutError(f"no {key[1]} for run {key[0]}")
        time.sleep(0.0005)
    return seen[key]


def pause_figures(runs: int, boots: int) -> dict[str, Any]:
    turns = [
        Turn(tool_calls=[ToolCall("ask_user", json.dumps({"q": "Go on?"}))]),
        Turn(text="Done."),
    ]
    resume, start = [], []
    boot_resumed, boot_up = [], []
    ck_bytes: list[int] = []
    with tempfile.TemporaryDirectory() as tmp, ModelServer(turns) as server, Stack(
        Path(tmp), model_url=server.url, main_py=ASKER, heap="128K"
    ) as s:
        assert s.client is not None
        seen = _stamps(s)
        for n in range(runs + boots):
            sent = time.perf_counter()
            req = s.request(f"Job {n}")
            snap = s.client.wait_for(req, lambda x: x.status == "paused" and bool(x.pending), 30)
            start.append(_wait(seen, (snap.run, "run.started")) - sent)
            (call,) = snap.pending
            if n >= runs:
                # Power lost while paused; the board comes back from its flash.
                ck_bytes.extend(p.stat().st_size for p in s.flash.glob("ck_*.bin"))
                s.kill_board()
                began = time.perf_counter()
                mark = s.console_mark()
                s.start_board()
                up = s.wait_console("link: up", after=mark)
                boot_up.append(time.perf_counter() - began)
                boot_resumed.append(_wait(seen, (snap.run, "run.resumed")) - began)
                del up
                seen.pop((snap.run, "run.resumed"), None)
            answered = time.perf_counter()
            s.client.answer(s.device, s.token, snap.run, call, f"go {n}")
            resume.append(_wait(seen, (snap.run, "run.resumed")) - answered)
            if s.wait_run(req).status != "done":
                raise RuntimeError(s.describe())
    return {
        "resume": resume,
        "start": start,
        "boot_resumed": boot_resumed,
        "boot_up": boot_up,
        "ck_bytes": ck_bytes,
    }


def checkpoint_figures(n: int) -> dict[str, Any]:
    exe = micropython_binary()
    if exe is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        install_package(tree, mpy=True)
        flash = Path(tmp) / "flash"
        flash.mkdir()
        script = "import json\n" + CHECKPOINT % {"dir": flash, "n": n}
        out = subprocess.run(
            [exe, "-X", "heapsize=256K", "-c", script],
            env={"MICROPYPATH": f"{tree}:.frozen"},
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=40, help="paused runs answered (default 40)")
    ap.add_argument("--boots", type=int, default=5, help="of them, killed while paused (5)")
    ap.add_argument("--writes", type=int, default=200, help="checkpoint writes timed (200)")
    args = ap.parse_args()
    print(f"command: python benchmarks/bench_pause.py --runs {args.runs} --boots {args.boots} "
          f"--writes {args.writes}")
    steps = Steps("bench_pause")
    steps(f"{args.runs} paused runs answered, {args.boots} of them across a board kill")
    f = pause_figures(args.runs, args.boots)
    ms = 1000.0
    r, s0 = f["resume"], f["start"]
    print(f"1. answer -> run.resumed at host: p50 {statistics.median(r) * ms:.1f} ms, "
          f"p99 {_pct(r, 0.99) * ms:.1f} ms (n={len(r)}); baseline request -> run.started: "
          f"p50 {statistics.median(s0) * ms:.1f} ms, p99 {_pct(s0, 0.99) * ms:.1f} ms; "
          f"ratio p50 {statistics.median(r) / statistics.median(s0):.2f}")
    b, u = f["boot_resumed"], f["boot_up"]
    print(f"2. board start -> run.resumed at host: p50 {statistics.median(b) * ms:.0f} ms "
          f"(n={len(b)}); baseline start -> link up: p50 {statistics.median(u) * ms:.0f} ms; "
          f"ratio {statistics.median(b) / statistics.median(u):.2f}; checkpoint on flash "
          f"while paused: {statistics.median(f['ck_bytes']):.0f} bytes")
    steps(f"{args.writes} checkpoint writes on the unix port")
    c = checkpoint_figures(args.writes)
    if c:
        print(f"3. checkpoint per step (unix port, 64-bit): {c['bytes']} bytes, written in "
              f"{c['save_us']:.0f} us against write_file alone {c['write_us']:.0f} us "
              f"(ratio {c['save_us'] / c['write_us']:.2f})")
    else:
        print("3. skipped: no MicroPython unix port")


if __name__ == "__main__":
    main()
