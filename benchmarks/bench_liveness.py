"""How long a run whose end was lost takes to end at its hosts (run liveness).

    python benchmarks/bench_liveness.py --devices 10 --runs 5 --probe 2

A real Mosquitto (its own, on a free loopback port) and the bridge (in this process,
`--run-probe` as `--probe`). Each of `--devices` scripted boards (paho clients with a
device's topics) says it is online, then runs `--runs` runs one after another: a
run.started and three deltas, then its end. Three ways, each device taking each in
turn:

- `sent`: the board sends run.done (the baseline: an end that is not lost);
- `resent`: the board drops run.done, as a broker that lost it would, and sends it
  only when asked for what follows the run's last id (the bridge's probe);
- `not_held`: the board drops run.done and, asked, answers `unknown_run` (it let the
  run go): the bridge ends the run `run.failed`.

Printed per way: from the moment the board sent (or would have sent) the end to the
run's end at a host subscriber, p50, p95 and max in seconds, and the p50 as a multiple
of the probe interval. Each run waits for the one before to end, so every probe comes
from a quiet run, never from a newer run's start (which asks at once).
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server_bridge.bridge import Bridge
from server_bridge.config import BridgeConfig
from server_bridge.models.scripted import ScriptedProvider
from server_bridge.registry import Registry
from tools.broker import start_mosquitto

WAYS = ("sent", "resent", "not_held")
TENANT = "bench"
WAIT_S = 60.0


def _client(host: str, port: int) -> mqtt.Client:
    c = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id=f"bench-{uuid.uuid4().hex[:10]}",
        protocol=mqtt.MQTTv311,
    )
    c.connect(host, port)
    c.loop_start()
    return c


class Host:
    """Every host event of the prefix: the time each run's end arrived."""

    def __init__(self, host: str, port: int, prefix: str) -> None:
        self.ends: dict[str, float] = {}
        self.cond = threading.Condition()
        self.client = _client(host, port)
        self.client.on_message = self._on_message
        done = threading.Event()
        self.client.on_subscribe = lambda *a: done.set()
        self.client.subscribe(f"{prefix}/h/#", 1)
        if not done.wait(WAIT_S):
            raise RuntimeError("host subscription not acknowledged")

    def _on_message(self, client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        if not msg.topic.endswith("/evt"):
            return
        env = msgpack.unpackb(msg.payload, raw=False)
        if env["t"] in ("run.done", "run.failed", "run.cancelled"):
            with self.cond:
                self.ends.setdefault(env["r"], time.monotonic())
                self.cond.notify_all()

    def wait_end(self, run: str) -> float:
        deadline = time.monotonic() + WAIT_S
        with self.cond:
            while run not in self.ends:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"run {run} never ended at the host")
                self.cond.wait(left)
            return self.ends[run]


class Board:
    """A scripted board: its runs, and its answers to the bridge's replays."""

    def __init__(self, host: str, port: int, prefix: str, device: str) -> None:
        self.topic = f"{prefix}/d/{device}"
        self.boot = uuid.uuid4().hex[:8]
        self.asks: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stream_ids = 0  # the device stream "_" numbers its events apart
        self.client = _client(host, port)
        self.client.on_message = lambda c, u, m: self.asks.put(msgpack.unpackb(m.payload))
        done = threading.Event()
        self.client.on_subscribe = lambda *a: done.set()
        self.client.subscribe(f"{self.topic}/ctl", 1)
        if not done.wait(WAIT_S):
            raise RuntimeError("board subscription not acknowledged")
        self.send("status", {"st": "online", "boot": self.boot})

    def send(self, leaf: str, obj: Any) -> None:
        self.client.publish(f"{self.topic}/{leaf}", msgpack.packb(obj), qos=1).wait_for_publish()

    def run(self, n: int, way: str, host: Host) -> float:
        run = f"{self.boot}.{n}"

        def ev(i: int, t: str, **d: Any) -> dict[str, Any]:
            return {"r": run, "i": i, "t": t, "ts": 1000 + i, "d": d}

        self.send("evt", [ev(1, "run.started", req=f"q{n}", conv=None, usr="u1", input="hi"),
                          *(ev(i, "msg.delta", m=1, text="word ") for i in (2, 3, 4))])  # fmt: skip
        end = ev(5, "run.done", usage={"in": 1, "out": 3})
        t0 = time.monotonic()
        if way == "sent":
            self.send("evt", end)
        else:
            ask = self.asks.get(timeout=WAIT_S)
            if (ask.get("op"), ask.get("r"), ask.get("after")) != ("replay", run, 4):
                raise RuntimeError(f"unexpected ask {ask}")
            if way == "resent":
                self.send("evt", end)
            else:
                refusal = {"kind": "unknown_run", "msg": "no longer held", "r": run}
                self.stream_ids += 1
                i = self.stream_ids
                self.send("evt", {"r": "_", "i": i, "t": "error", "ts": 1000, "d": refusal})
        return host.wait_end(run) - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=10)
    ap.add_argument("--runs", type=int, default=6, help="runs per device (taking each way in turn)")
    ap.add_argument("--probe", type=float, default=2.0, help="the bridge's run_probe_s")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        broker = start_mosquitto(Path(tmp) / "broker")
        prefix = f"bench-{uuid.uuid4().hex[:6]}/v1"
        registry = Registry(Path(tmp) / "registry.json")
        registry.add_tenant(TENANT, "00" * 32)
        devices = [f"dev{k}" for k in range(args.devices)]
        for d in devices:
            registry.add_device(d, TENANT, "bench")
        cfg = BridgeConfig(
            host=broker.host, port=broker.port, username=None, password=None, prefix=prefix,
            run_probe_s=args.probe, run_probe_max_s=max(60.0, args.probe),
        )  # fmt: skip
        bridge = Bridge(cfg, registry, ScriptedProvider())
        bridge.start()
        try:
            host = Host(broker.host, broker.port, prefix)
            boards = [Board(broker.host, broker.port, prefix, d) for d in devices]
            times: dict[str, list[float]] = {w: [] for w in WAYS}
            lock = threading.Lock()

            def device(k: int, board: Board) -> None:
                for n in range(1, args.runs + 1):
                    way = WAYS[(k + n) % len(WAYS)]
                    took = board.run(n, way, host)
                    with lock:
                        times[way].append(took)

            threads = [threading.Thread(target=device, args=(k, b)) for k, b in enumerate(boards)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            bridge.stop()
            registry.close()
            broker.stop()

    print(f"run liveness: {args.devices} boards x {args.runs} runs, run_probe_s {args.probe:g}")
    print(f"{'end':<10}{'runs':>6}{'p50 s':>9}{'p95 s':>9}{'max s':>9}{'p50/probe':>11}")
    for way in WAYS:
        xs = sorted(times[way])
        p95 = xs[min(len(xs) - 1, int(0.95 * len(xs)))]
        p50 = statistics.median(xs)
        print(f"{way:<10}{len(xs):>6}{p50:>9.3f}{p95:>9.3f}{xs[-1]:>9.3f}{p50 / args.probe:>11.2f}")


if __name__ == "__main__":
    main()
