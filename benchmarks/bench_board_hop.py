"""The board's own share of a request's way to its first words: how long the board takes
from a request to its model call, and from the model's first chunk to its `msg.delta`,
each against the same board's link echoing a message back, in the same run.

    .venv/bin/python benchmarks/bench_board_hop.py [--requests N] [--heap 128K]

A real Mosquitto (its own, on a free loopback port) and a peer in this process playing
the bridge with paho: it says the bridge is online, sends the request, answers the
board's llm.complete with one chunk of text and then the final, and stamps what comes
back. So each hop below is two broker legs (peer -> broker -> board, board -> broker ->
peer) plus the board's own work:

  request -> llm.complete   the request read and decoded, the run admitted and started,
                            the model call built, encoded and sent;
  llm.complete -> msg.start what the board does after its call is out, before it reads
                            the answer: run.started, the step's collection, node.start
                            and msg.start (a model answering faster finds it busy);
  chunk -> msg.delta        the chunk read and decoded, handed to the waiting run, the
                            text coalesced and emitted as an event (the chunk is sent
                            once the board's msg.start is in: a real model's first
                            words come after the work that follows the call).

The baseline is the echo: a program on the same runtime and heap whose edge_runtime Link
publishes each message it receives straight back (the same two legs, the link's own
reading and writing, no runtime). What is over the echo is the runtime's work on the
board. The board runs the demo's thermostat without its memory field, as .mpy on the
MicroPython unix port and as .py on CPython; the echo likewise. Nothing asserts on time:
these are figures, and on this shared machine only the ratios within one run count.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import msgpack  # noqa: E402
import paho.mqtt.client as paho  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402

from server_bridge.tcp import no_delay  # noqa: E402
from tools.broker import start_mosquitto  # noqa: E402
from tools.virtual_board import VirtualBoard, lay_out_flash, micropython_binary  # noqa: E402

PREFIX = "wren/v1"
DEVICE = "hop1"
ANSWER = "Hello from the model: the room is 21.5 degrees."
WAIT_S = 10.0

# The echo: the board's own Link, publishing back what it receives.
ECHO_PY = """
import json
from edge_runtime import platform
from edge_runtime.link import Link

s = json.load(open("settings.json"))
base = "%s/d/%s/" % (s["prefix"], s["device"])


async def main():
    link = Link(s["device"], s["host"], s["port"])

    def on_message(topic, payload):
        link.publish(base + "evt", bytes(payload), 1)

    link.on_message = on_message
    link.subscribe(base + "req", 1)
    platform.asyncio.create_task(link.run())
    while True:
        await platform.sleep_ms(1000)


platform.asyncio.run(main())
"""


class Peer:
    """paho, as the bridge: everything the board publishes lands in one queue."""

    def __init__(self, host: str, port: int) -> None:
        self.inbox: queue.Queue[tuple[float, str, Any]] = queue.Queue()
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2, client_id=f"peer-{uuid.uuid4().hex[:6]}"
        )
        self.client.on_message = self._on_message
        # Nagle off, as on every socket of Wren's (server_bridge/tcp.py).
        self.client.on_socket_open = no_delay
        ready = threading.Event()
        self.client.on_subscribe = lambda *a: ready.set()
        self.client.on_connect = lambda c, *a: c.subscribe(f"{PREFIX}/d/{DEVICE}/+", 1)
        self.client.connect(host, port)
        self.client.loop_start()
        if not ready.wait(WAIT_S):
            raise SystemExit("bench_board_hop: the peer could not subscribe")

    def _on_message(self, c: Any, u: Any, msg: paho.MQTTMessage) -> None:
        now = time.perf_counter()
        leaf = msg.topic.rsplit("/", 1)[-1]
        try:
            obj = msgpack.unpackb(msg.payload, raw=False)
        except ValueError:
            obj = None
        self.inbox.put((now, leaf, obj))

    def send(self, leaf: str, obj: Any, retain: bool = False) -> float:
        topic = f"{PREFIX}/b/status" if leaf == "bridge" else f"{PREFIX}/d/{DEVICE}/{leaf}"
        t = time.perf_counter()
        self.client.publish(topic, msgpack.packb(obj), qos=1, retain=retain)
        return t

    def wait(self, match: Callable[[str, Any], bool]) -> tuple[float, Any]:
        deadline = time.monotonic() + WAIT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SystemExit("bench_board_hop: the board did not answer in time")
            try:
                at, leaf, obj = self.inbox.get(timeout=left)
            except queue.Empty:
                continue
            if match(leaf, obj):
                return at, obj

    def drain(self) -> None:
        while not self.inbox.empty():
            self.inbox.get_nowait()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _is_call(leaf: str, obj: Any) -> bool:
    return leaf == "rpc" and isinstance(obj, dict) and obj.get("m") == "llm.complete"


def _is_event(kind: str) -> Callable[[str, Any], bool]:
    def match(leaf: str, obj: Any) -> bool:
        return leaf == "evt" and isinstance(obj, dict) and obj.get("t") == kind

    return match


def _board(
    work: Path, host: str, port: int, heap: str, cpython: bool, main_py: str | None
) -> VirtualBoard:
    settings = {"device": DEVICE, "host": host, "port": port, "prefix": PREFIX, "memory": False}
    flash = work / ("cpython" if cpython else "mpy") / ("echo" if main_py else "board")
    board = VirtualBoard(flash, heap=heap, force_cpython=cpython)
    kw = {"main_py": main_py} if main_py else {}
    lay_out_flash(flash, settings, mpy=board.runs_mpy(True), **kw)
    return board


def _started(board: VirtualBoard) -> subprocess.Popen[str]:
    proc = board.start()
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    for line in proc.stdout:
        if "link: up" in line:
            # The rest of the console is read (and dropped) so the board never blocks on it.
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc
        if time.monotonic() > deadline:
            break
    board.stop()
    raise SystemExit("bench_board_hop: the board did not come up")


def run_board(peer: Peer, n: int) -> tuple[list[float], list[float], list[float]]:
    """n requests (and one warm-up): ms request -> llm.complete, llm.complete -> msg.start
    (what the board does after its call), chunk -> msg.delta."""
    to_call: list[float] = []
    after_call: list[float] = []
    to_delta: list[float] = []
    for k in range(n + 1):
        peer.drain()
        t0 = peer.send("req", {"req": uuid.uuid4().hex, "input": "What is the temperature?"})
        t1, call = peer.wait(_is_call)
        c = call["c"]
        # The chunk once the board has done what follows its call (run.started, its
        # collection, node.start, msg.start), as a real model's first words come after
        # that: sent at once, it would wait behind that work and time it too.
        ready, _ = peer.wait(_is_event("msg.start"))
        t2 = peer.send("rpc/res", {"c": c, "s": 1, "ch": {"text": ANSWER}})
        t3, _ = peer.wait(_is_event("msg.delta"))
        peer.send(
            "rpc/res", {"c": c, "s": 1, "ok": {"usage": {"in": 10, "out": 9}, "finish": "stop"}}
        )
        peer.wait(_is_event("run.done"))
        if k:
            to_call.append((t1 - t0) * 1000)
            after_call.append((ready - t1) * 1000)
            to_delta.append((t3 - t2) * 1000)
        time.sleep(0.02)
    return to_call, after_call, to_delta


def run_echo(peer: Peer, n: int) -> tuple[list[float], list[float]]:
    """n rounds (and one warm-up) of two request-sized messages through the echo, ms: the
    first after a pause, as a request comes; the second at once after the first came
    back, as a chunk follows the model call (each hop of the board is compared with the
    echo in the same state: a process woken from idle answers slower)."""
    cold: list[float] = []
    warm: list[float] = []
    body = {"req": "", "input": "What is the temperature?", "conv": "c1", "usr": "alice"}
    for k in range(n + 1):
        for out in (cold, warm):
            peer.drain()
            body["req"] = uuid.uuid4().hex
            t0 = peer.send("req", body)
            t1, _ = peer.wait(lambda leaf, obj: leaf == "evt" and obj == body)
            if k:
                out.append((t1 - t0) * 1000)
        time.sleep(0.02)
    return cold, warm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40, help="timed requests per board")
    ap.add_argument("--heap", default="128K", help="the unix port's heap")
    args = ap.parse_args()
    print(
        f"command: python benchmarks/bench_board_hop.py --requests {args.requests} "
        + f"--heap {args.heap}"
    )
    runtimes = [False, True] if micropython_binary() else [True]
    with tempfile.TemporaryDirectory(prefix="wren-hop-") as tmp:
        work = Path(tmp)
        broker = start_mosquitto(work / "mosquitto")
        peer = Peer(broker.host, broker.port)
        peer.send("bridge", {"st": "online", "id": "bench", "boot": "b0000001"}, retain=True)
        try:
            for cpython in runtimes:
                label = (
                    "board .py, CPython"
                    if cpython
                    else f"board .mpy, MicroPython unix port, {args.heap}"
                )
                echo = _board(work, broker.host, broker.port, args.heap, cpython, ECHO_PY)
                _started(echo)
                try:
                    cold, warm = run_echo(peer, args.requests)
                finally:
                    echo.stop()
                board = _board(work, broker.host, broker.port, args.heap, cpython, None)
                _started(board)
                try:
                    to_call, after_call, to_delta = run_board(peer, args.requests)
                finally:
                    board.stop()
                _report(label, cold, warm, to_call, after_call, to_delta)
        finally:
            peer.close()
            broker.stop()


def _report(
    label: str,
    cold: list[float],
    warm: list[float],
    to_call: list[float],
    after_call: list[float],
    to_delta: list[float],
) -> None:
    def p(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    print(f"\n{label} (ms; p50 and p90 of {len(cold)} each)")
    rows = (
        ("echo after a pause", cold, None),
        ("request -> llm.complete", to_call, cold),
        ("llm.complete -> msg.start", after_call, None),
        ("echo at once after another", warm, None),
        ("chunk -> msg.delta", to_delta, warm),
    )
    for name, xs, base in rows:
        line = f"  {name:30s} p50 {p(xs, 0.5):6.2f}  p90 {p(xs, 0.9):6.2f}"
        if base is not None:
            own = statistics.median(xs) - statistics.median(base)
            line += f"   {p(xs, 0.5) / p(base, 0.5):4.1f}x its echo, the board's own {own:5.2f}"
        print(line)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
