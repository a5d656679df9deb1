"""Memory calls over real MQTT: `mem.remember` and `mem.recall` round trips through the
bridge service, next to a bare paho request/response through the same broker.

The bridge runs as the real service (`python -m server_bridge`, a child process, with
its memory in a temporary directory and the default recall index: MiniLM when the
`recall` extra is installed, BM25 otherwise). A board peer (paho, in this process) calls
it on P/d/D/rpc, QoS 1 as a board does, one call at a time, and waits for the answer on
P/d/D/rpc/res. The baseline is a paho responder in a child process of its own that
answers each request at once, through the same Mosquitto, same QoS. Calls alternate:
one Wren call, then one bare round trip, so both see the same moment of a noisy
machine (2 cores, shared by Mosquitto, the bridge, the responder and this process).

    python benchmarks/bench_memory_rpc.py                 # about a minute
    python benchmarks/bench_memory_rpc.py --calls 500 --rows 1000

Recall searches the rows `mem.remember` wrote (--rows of them, short sentences about a
home) with a query drawn from the same vocabulary.
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from server_bridge.memory.recall import default_embedder  # noqa: E402
from server_bridge.tcp import no_delay  # noqa: E402
from tools.broker import start_mosquitto  # noqa: E402
from tools.steps import Steps  # noqa: E402

P = "wren/v1"
DEVICE = "bench1"
HELLO = {
    "agent": "thermostat",
    "ver": "0.1.0",
    "fw": "bench",
    "boot": "00be0c01",
    "fields": [{"name": "notes", "vis": "public", "dur": "subject", "kind": "collection",
                "max": 1_000_000}],
    "tools": [],
    "limits": {"payload": 16384, "str": 4096},
}  # fmt: skip
WORDS = (
    "radiator window kitchen heater thermostat morning evening night loud quiet warm cold "
    "draft sensor battery humidity bedroom hallway door sunny shade fan boiler schedule"
).split()
RESPONDER = """
import sys, paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from server_bridge.tcp import no_delay
host, port, topic = sys.argv[1], int(sys.argv[2]), sys.argv[3]
c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-responder")
c.on_socket_open = no_delay
c.on_message = lambda cl, u, m: cl.publish(topic + "/res", m.payload, qos=1)
c.on_connect = lambda cl, u, f, rc, p: (cl.subscribe(topic, 1), print("ready", flush=True))
c.connect(host, port)
c.loop_forever()
"""


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


class Caller:
    """A paho client that publishes a request and waits for its answer."""

    def __init__(self, host: str, port: int, client_id: str, answers: str) -> None:
        self.got: queue.Queue[tuple[float, bytes]] = queue.Queue()
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id)
        self.c.on_socket_open = no_delay
        self.c.on_message = lambda cl, u, m: self.got.put((time.monotonic(), m.payload))
        self.c.connect(host, port)
        self.c.subscribe(answers, 1)
        self.c.loop_start()
        time.sleep(0.3)

    def round_trip(self, topic: str, payload: bytes) -> tuple[float, bytes]:
        t0 = time.monotonic()
        self.c.publish(topic, payload, qos=1)
        at, data = self.got.get(timeout=30)
        return (at - t0) * 1000, data

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300, help="timed calls of each kind")
    ap.add_argument("--rows", type=int, default=300, help="rows written before recall")
    args = ap.parse_args()
    rng = random.Random(1)
    steps = Steps("bench_memory_rpc")
    steps("starting a broker, the bridge and a raw responder")
    work = Path(tempfile.mkdtemp(prefix="wren-bench-mem-"))
    broker = start_mosquitto(work / "mosquitto")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    bridge = subprocess.Popen(
        [sys.executable, "-m", "server_bridge", "--broker", f"{broker.host}:{broker.port}",
         "--client-id", "bench-bridge", "--tenant", "bench", "--device", f"{DEVICE}:thermostat",
         "--registry", str(work / "registry.json"), "--memory-dir", str(work / "memory")],
        cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    responder = subprocess.Popen(
        [sys.executable, "-c", RESPONDER, broker.host, str(broker.port), f"{P}/bench/echo"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    board = raw = None
    try:
        assert bridge.stdout is not None and responder.stdout is not None
        for line in bridge.stdout:
            if line.startswith("bridge: "):
                break
        responder.stdout.readline()
        board = Caller(broker.host, broker.port, DEVICE, f"{P}/d/{DEVICE}/rpc/res")
        raw = Caller(broker.host, broker.port, "bench-raw", f"{P}/bench/echo/res")
        board.c.publish(f"{P}/d/{DEVICE}/hello", msgpack.packb(HELLO), qos=1).wait_for_publish()
        time.sleep(0.5)
        calls = iter(range(1, 10**9))

        def wren(method: str, a: dict[str, Any]) -> float:
            c = next(calls)
            msg = {"c": c, "m": method, "a": a, "r": "00be0c01.1"}
            ms, data = board.round_trip(f"{P}/d/{DEVICE}/rpc", msgpack.packb(msg))
            answer = msgpack.unpackb(data)
            if answer.get("c") != c or "ok" not in answer:
                raise SystemExit(f"bench: {method} answered {answer}")
            return ms

        def sentence() -> str:
            return " ".join(rng.choice(WORDS) for _ in range(8))

        results: dict[str, list[float]] = {"remember": [], "recall": [], "raw": []}
        payload = msgpack.packb({"c": 1, "m": "mem.remember", "a": {"value": "x" * 60}})
        steps(f"{max(args.rows, args.calls)} mem.remember calls (fsynced writes)")
        for n in range(max(args.rows, args.calls)):
            ms = wren("mem.remember", {"field": "notes", "value": sentence(), "w": f"w{n}"})
            if n < args.calls:
                results["remember"].append(ms)
                results["raw"].append(raw.round_trip(f"{P}/bench/echo", payload)[0])
        steps(f"{args.calls} mem.recall calls")
        for _ in range(args.calls):
            q = " ".join(rng.choice(WORDS) for _ in range(3))
            results["recall"].append(wren("mem.recall", {"query": q, "k": 5}))
            results["raw"].append(raw.round_trip(f"{P}/bench/echo", payload)[0])
    finally:
        for c in (board, raw):
            if c is not None:
                c.close()
        for p in (bridge, responder):
            p.terminate()
            p.wait(10)
        broker.stop()

    mode = "MiniLM-L6 int8 (onnxruntime)" if default_embedder() is not None else "BM25"
    print(f"command: python benchmarks/bench_memory_rpc.py --calls {args.calls} --rows {args.rows}")
    print("machine: 2 cores on loopback, shared by Mosquitto, the bridge service, the responder")
    print(f" and this process; recall index: {mode}, over {max(args.rows, args.calls)} rows\n")
    print(f"{'round trip, ms':40} {'p50':>8} {'p99':>8} {'max':>8}")
    for name, label in (
        ("remember", "mem.remember through the bridge"),
        ("recall", "mem.recall (k 5) through the bridge"),
        ("raw", "bare paho request/response"),
    ):
        xs = results[name]
        print(f"{label:40} {pct(xs, 0.5):8.2f} {pct(xs, 0.99):8.2f} {max(xs):8.2f}")
    base = results["raw"]
    for name in ("remember", "recall"):
        xs = results[name]
        print(
            f"ratio mem.{name}/bare: p50 {pct(xs, 0.5) / pct(base, 0.5):.1f}x, "
            f"p99 {pct(xs, 0.99) / pct(base, 0.99):.1f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
