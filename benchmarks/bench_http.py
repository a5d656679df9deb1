"""The hosts' HTTP side (server_bridge/http/), measured against baselines in the same run:

1. Board event -> reader, one way, p50/p99: a board publishes `msg.delta` events (its
   send time in the text) at a steady rate; an SSE client of the bridge's HTTP API reads
   them, next to an MQTT host reading the same events through the bridge, next to a
   raw paho relay (a process of its own that republishes the board's topic at once, as
   the bridge's one hop does, read by a paho subscriber: the baseline the ratio is
   taken against), and next to a raw paho subscriber reading the board's topic straight
   from the broker (no hop at all).
2. Bytes per text delta: the same 8-character delta as the board's MQTT event, as a
   native SSE frame, and as an AG-UI frame.
3. Replay from the event log: a finished run of N events read back over HTTP (SSE, from
   the log after a bridge restart) and by EventLog.events directly, events/s.
4. Request -> first text delta, p50/p99, with the real board (the demo thermostat on
   the MicroPython unix port, tests/stack.py) and the scripted model: a request over
   HTTP (POST, then the request's SSE stream) against the same request over MQTT (the
   Python host client), alternating, in one run.

The broker is a Mosquitto of its own; the bridge runs in this process with its HTTP
server on a thread, as `wren bridge --http` runs it.

    python benchmarks/bench_http.py [--events 2000] [--rate 500] [--replay 20000]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import msgpack  # noqa: E402
import paho.mqtt.client as paho  # noqa: E402

from server_bridge.bridge import Bridge  # noqa: E402
from server_bridge.config import BridgeConfig  # noqa: E402
from server_bridge.eventlog import EventLog  # noqa: E402
from server_bridge.http.agui import Mapper  # noqa: E402
from server_bridge.http.server import HttpServer  # noqa: E402
from server_bridge.http.views import sse_frame  # noqa: E402
from server_bridge.models.scripted import ScriptedProvider  # noqa: E402
from server_bridge.registry import Registry  # noqa: E402
from server_bridge.tokens import sign  # noqa: E402
from tools.broker import start_mosquitto  # noqa: E402

COMMAND = "python benchmarks/bench_http.py"
PREFIX = "benchhttp/v1"
SECRET = b"s" * 32


def env(run: str, i: int, t: str, d: dict[str, Any]) -> dict[str, Any]:
    return {"r": run, "i": i, "t": t, "ts": int(time.time() * 1000), "d": d}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Board:
    """The device's MQTT client: publishes envelopes on P/d/D/evt at QoS 1."""

    def __init__(self, host: str, port: int) -> None:
        self.c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="bench-board")
        self.c.connect(host, port)
        self.c.loop_start()

    def send(self, envelopes: list[dict[str, Any]]) -> None:
        self.c.publish(f"{PREFIX}/d/dev1/evt", msgpack.packb(envelopes), qos=1)

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


class Listener:
    """A paho subscriber that notes, for each event's send stamp, when it arrived."""

    def __init__(self, host: str, port: int, topic: str, name: str) -> None:
        self.lat: list[float] = []
        self.bytes: list[int] = []
        self.done = threading.Event()
        self.want = 0
        self.c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=name)
        self.c.on_message = self._on
        self.c.connect(host, port)
        self.c.subscribe(topic, qos=1)
        self.c.loop_start()

    def _on(self, _c: Any, _u: Any, msg: paho.MQTTMessage) -> None:
        now = time.perf_counter()
        obj = msgpack.unpackb(msg.payload, raw=False)
        for e in obj if isinstance(obj, list) else [obj]:
            text = e.get("d", {}).get("text", "")
            if text.startswith("@"):
                self.lat.append(now - float(text[1:]))
                self.bytes.append(len(msg.payload))
        if len(self.lat) >= self.want:
            self.done.set()

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def raw_relay(host: str, port: int, src: str, dst: str, ready: Any, stop: Any) -> None:
    """A one-hop relay as small as paho allows: each message on `src` republished on
    `dst` at QoS 1 from the network thread, in a process of its own, as the bridge is."""
    c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="bench-relay")
    c.on_message = lambda _c, _u, m: c.publish(dst, m.payload, qos=1)
    c.on_subscribe = lambda *_a: ready.set()
    c.connect(host, port)
    c.subscribe(src, qos=1)
    c.loop_start()
    stop.wait(600)
    c.loop_stop()
    c.disconnect()


def sse_reader(url: str, tok: str, want: int, out: list[float], ready: threading.Event) -> None:
    with httpx.stream("GET", url, headers={"Authorization": f"Bearer {tok}"}, timeout=120) as r:
        ready.set()
        for line in r.iter_lines():
            if line.startswith("data: "):
                now = time.perf_counter()
                e = json.loads(line[6:])
                text = e.get("d", {}).get("text", "")
                if text.startswith("@"):
                    out.append(now - float(text[1:]))
                if e.get("t") == "run.done" or len(out) >= want:
                    return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=2000, help="figure 1 events (default 2000)")
    ap.add_argument("--rate", type=int, default=500, help="figure 1 events/s (default 500)")
    ap.add_argument("--replay", type=int, default=20000, help="figure 3 run length")
    ap.add_argument("--requests", type=int, default=30, help="figure 4 requests per path")
    args = ap.parse_args()
    print(f"# {COMMAND} {' '.join(sys.argv[1:])}".rstrip())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        broker = start_mosquitto(root / "broker")
        registry = Registry(root / "registry.json")
        registry.add_tenant("acme", SECRET)
        registry.add_device("dev1", "acme", "thermostat")
        config = BridgeConfig(host=broker.host, port=broker.port, username=None,
                              password=None, prefix=PREFIX, client_id="bench-bridge",
                              offline_grace_s=0)  # fmt: skip
        log = EventLog(root / "events")
        bridge = Bridge(config, registry, ScriptedProvider(), None, None, log)
        bridge.start()
        http = HttpServer(bridge, "127.0.0.1", 0)
        http.start()
        tok = sign(SECRET, "acme", "alice")
        board = Board(broker.host, broker.port)
        try:
            figure1(args, broker, bridge, http, board, tok)
            figure2()
            figure3(args, broker, bridge, http, board, tok, config, registry, root)
        finally:
            board.close()
            http.stop()
            bridge.stop()
            log.close()
            registry.close()
            broker.stop()
        figure4(args, root)


def started(run: str) -> dict[str, Any]:
    return env(run, 1, "run.started", {"agent": "thermostat", "ver": "1", "req": run,
                                       "conv": None, "usr": "alice", "domain": "request",
                                       "input": "hi"})  # fmt: skip


def figure1(args: argparse.Namespace, broker: Any, bridge: Bridge, http: HttpServer,
            board: Board, tok: str) -> None:  # fmt: skip
    n, run = args.events, "b1.1"
    raw = Listener(broker.host, broker.port, f"{PREFIX}/d/dev1/evt", "bench-raw")
    spawn = multiprocessing.get_context("spawn")
    relay_ready, relay_stop = spawn.Event(), spawn.Event()
    relay_proc = spawn.Process(target=raw_relay, args=(
        broker.host, broker.port, f"{PREFIX}/d/dev1/evt", "benchraw/relayed", relay_ready,
        relay_stop), daemon=True)  # fmt: skip
    relay_proc.start()
    relay_ready.wait(30)
    relayed = Listener(broker.host, broker.port, "benchraw/relayed", "bench-relayed")
    host = Listener(broker.host, broker.port, f"{PREFIX}/h/acme/dev1/u/alice/evt", "bench-host")
    raw.want = host.want = relayed.want = n
    board.send([started(run)])
    sse: list[float] = []
    ready = threading.Event()
    reader = threading.Thread(target=sse_reader, args=(
        f"{http.url}/v1/devices/dev1/runs/{run}/events", tok, n, sse, ready), daemon=True)
    deadline = time.monotonic() + 10
    while bridge.intake.window("dev1", run) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    reader.start()
    ready.wait(10)
    time.sleep(0.2)
    gap = 1.0 / args.rate
    t0 = time.perf_counter()
    for k in range(n):
        while time.perf_counter() < t0 + k * gap:
            time.sleep(gap / 4)
        board.send([env(run, k + 2, "msg.delta", {"m": 1, "text": f"@{time.perf_counter():.9f}"})])
    board.send([env(run, n + 2, "run.done", {"usage": {}})])
    reader.join(60)
    raw.done.wait(30)
    host.done.wait(30)
    relayed.done.wait(30)
    relay_stop.set()
    relay_proc.join(10)
    raw.close()
    host.close()
    relayed.close()
    print(f"\n## Figure 1: board event -> reader, one way ({n} events at {args.rate}/s)")
    print("| reader | received | p50 ms | p99 ms | p50 / raw relay | p99 / raw relay |")
    print("|---|---|---|---|---|---|")
    base50, base99 = (pct(relayed.lat, 0.5), pct(relayed.lat, 0.99)) if relayed.lat else (0, 0)
    for name, lat in (("raw paho, from the broker (no hop)", raw.lat),
                      ("raw paho relay, one hop in a process of its own", relayed.lat),
                      ("MQTT host, through the bridge", host.lat),
                      ("SSE client of the HTTP API", sse)):  # fmt: skip
        if lat and base50:
            print(f"| {name} | {len(lat)} | {pct(lat, .5) * 1e3:.2f} | "
                  f"{pct(lat, .99) * 1e3:.2f} | {pct(lat, .5) / base50:.1f}x | "
                  f"{pct(lat, .99) / base99:.1f}x |")
        else:
            print(f"| {name} | {len(lat)} | - | - | - | - |")


def figure2() -> None:
    e = env("b1.1", 15, "msg.delta", {"m": 2, "text": "It is 21"})
    mqtt = len(msgpack.packb(e))
    native = len(sse_frame("b1.1", e))
    mapper = Mapper("thread-1", "run-1", announce=False)
    mapper.map(env("b1.1", 14, "msg.delta", {"m": 2, "text": "x"}))  # the message is open
    agui = sum(len(("data: " + json.dumps(x, separators=(",", ":")) + "\n\n").encode())
               for x in mapper.map(e)) + len("id: b1.1:15\n")  # fmt: skip
    print("\n## Figure 2: bytes per text delta (`It is 21`, 8 characters)")
    print("| form | bytes | / MQTT event |")
    print("|---|---|---|")
    for name, size in (("MQTT event (msgpack envelope)", mqtt), ("native SSE frame", native),
                       ("AG-UI SSE frame", agui)):  # fmt: skip
        print(f"| {name} | {size} | {size / mqtt:.1f}x |")


def figure3(args: argparse.Namespace, broker: Any, bridge: Bridge, http: HttpServer,
            board: Board, tok: str, config: BridgeConfig, registry: Registry,
            root: Path) -> None:  # fmt: skip
    n, run = args.replay, "b1.2"
    board.send([started(run)])
    batch = [env(run, k, "msg.delta", {"m": 1, "text": "x" * 32}) for k in range(2, n + 2)]
    # Paced (about 5,000 events/s) and waited for: this board does not answer the
    # bridge's replay requests, so nothing may be deferred.
    for k in range(0, len(batch), 25):
        board.send(batch[k : k + 25])
        time.sleep(0.005)
        while (bridge.intake.expected("dev1", run) or 0) < k - 500:
            time.sleep(0.005)
    board.send([env(run, n + 2, "run.done", {"usage": {}})])
    deadline = time.monotonic() + 120
    while bridge.intake.finished("dev1", run) is not True and time.monotonic() < deadline:
        time.sleep(0.05)
    assert bridge.intake.finished("dev1", run), "the run did not reach the bridge whole"
    assert bridge.events is not None
    bridge.events.sync()
    t0 = time.perf_counter()
    got = bridge.events.events("acme", "dev1", run)
    direct = time.perf_counter() - t0
    count = 0
    t0 = time.perf_counter()
    with httpx.stream("GET", f"{http.url}/v1/devices/dev1/runs/{run}/events",
                      headers={"Authorization": f"Bearer {tok}"}, timeout=300) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: "):
                count += 1
    over_http = time.perf_counter() - t0
    print(f"\n## Figure 3: replaying a finished run of {n + 2} events from the event log")
    print("| reader | events | events/s |")
    print("|---|---|---|")
    print(f"| EventLog.events (seeks, decode) | {len(got)} | {len(got) / direct:,.0f} |")
    print(f"| SSE over HTTP (window + log, JSON frames) | {count} | {count / over_http:,.0f} |")
    print(f"\nmedian event size in the log: {statistics.median(len(e.payload) for e in got)} B")


def figure4(args: argparse.Namespace, root: Path) -> None:
    from tests.stack import Stack

    mqtt_ms: list[float] = []
    http_ms: list[float] = []
    with Stack(root / "stack", bridge_args=["--http", "127.0.0.1:0"]) as s:
        import re

        url = re.findall(r"^http at (\S+)$", s.bridge_log(), re.M)[-1]
        assert s.client is not None
        first: dict[str, float] = {}

        def on_event(e: dict[str, Any], snap: Any) -> None:
            if e.get("t") == "msg.delta" and snap.req not in first:
                first[snap.req] = time.perf_counter()

        s.client.on_event = on_event
        auth = {"Authorization": f"Bearer {s.token}"}
        with httpx.Client(timeout=60) as client:
            for k in range(args.requests):
                t0 = time.perf_counter()
                req = s.request("How warm is it in here?")
                s.wait_run(req)
                mqtt_ms.append((first[req] - t0) * 1e3)
                t0 = time.perf_counter()
                r = client.post(f"{url}/v1/devices/{s.device}/requests", headers=auth,
                                json={"input": "How warm is it in here?", "req": f"h{k}"})
                assert r.status_code == 202, r.text
                got = None
                with client.stream("GET", f"{url}/v1/devices/{s.device}/requests/h{k}/events",
                                   headers=auth) as sse:  # fmt: skip
                    for line in sse.iter_lines():
                        if got is None and line == "event: msg.delta":
                            got = time.perf_counter()
                assert got is not None
                http_ms.append((got - t0) * 1e3)
    print(f"\n## Figure 4: request -> first text delta, the real board ({args.requests} each)")
    print("| path | p50 ms | p99 ms | p50 / MQTT |")
    print("|---|---|---|---|")
    for name, ms in (("MQTT (HostClient)", mqtt_ms), ("HTTP (POST, then SSE)", http_ms)):
        print(f"| {name} | {statistics.median(ms):.1f} | {pct(ms, 0.99):.1f} | "
              f"{statistics.median(ms) / statistics.median(mqtt_ms):.2f}x |")


if __name__ == "__main__":
    main()
