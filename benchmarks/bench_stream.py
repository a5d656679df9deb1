"""Streamed model text through the whole of Wren, on real processes (tests/stack.py:
Mosquitto with Wren's password file and ACL, `wren bridge` against the OpenAI-compatible
test server of tests/model_server.py, the board as .mpy on the MicroPython unix port, a
host client), in three figures:

1. What coalescing saves: msg.delta events at the host, MQTT messages and bytes per
   1,000 characters, for (a) 2,000 characters in 4-character model chunks and (b) 3,000
   one-character chunks at full speed; coalescing off ("before") next to the defaults
   ("after"), each answer checked to arrive exactly.
2. What the pipeline adds after the model: from the model server's last write to
   `run.done` at the host (one clock: the model server and the host client run in this
   process), next to a raw paho relay over the same three broker legs; again with
   Nagle left on at the broker (`set_tcp_nodelay false`; Wren's generated config turns
   it off, as the bridge, host and board turn it off on their sockets).
3. Recovery after a broker restart (Mosquitto with persistence): from the moment the new
   broker accepts connections to the board's `link: up` and to the next request's
   `run.done` at the host.

    python benchmarks/bench_stream.py                   # under 3 minutes
    python benchmarks/bench_stream.py --runs 20 --restarts 10

A paho "sniffer" logged in as the bridge user (which may read every device topic) counts
what crosses the broker on P/d/D/evt (board -> bridge), P/d/D/rpc/res (bridge -> board)
and, for the board's acks, P/d/D/rpc. Progress goes to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import logging
import math
import queue
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_wire import mqtt_publish_overhead  # noqa: E402

from server_bridge.host.client import HostConnectError  # noqa: E402
from server_bridge.host.reducer import RunSnapshot  # noqa: E402
from server_bridge.wire import DEFAULT_LIMITS  # noqa: E402
from tests.model_server import ModelServer, Turn  # noqa: E402
from tests.stack import Stack, StackError, assistant_text  # noqa: E402
from tools.broker import start_mosquitto  # noqa: E402
from tools.demo import PREFIX  # noqa: E402
from tools.steps import Steps  # noqa: E402

# Each position checkable: a lost, doubled or swapped piece changes the text.
LONG = "".join(f"{i:04d}," for i in range(400))  # 2,000 characters
SINGLES = "".join(chr(0x61 + i % 26) for i in range(3000))
SCENARIOS = [
    ("a", "2,000 chars in 4-char chunks", LONG, 4),
    ("b", "3,000 one-char chunks", SINGLES, 1),
]
# Coalescing off. The board: one msg.delta per model chunk (delta_chars = the chunk's
# characters; delta_chars=1 would cut a 4-character chunk into 4 events). The bridge: no
# merge time, and the smallest `chunk` a hello may announce (1; the bridge never cuts text
# below 4 bytes, so a 4-character chunk still goes whole and one character alone).
BEFORE_CHUNK = 1
BEFORE_MERGE_MS = "0"
# Each 1-character msg.delta is its own str in the board's kept text of the turn (its
# first 1,024 characters): ~54 KB on the 64-bit port, and a 128 KiB board ran out of
# memory after ~490 such events. So the "before" boards get more heap; it changes no
# count.
BEFORE_HEAP = "256K"
# Pacing of the latency answer: an SSE event every 4 ms (250 chunks, 1,000 characters a
# second: faster than hosted models stream), so the board keeps up and the figure is
# what follows the model's last chunk, not a backlog of text the model sent ahead.
PACE_S = 0.004
RUN_TIMEOUT_S = 180.0  # (b) before: 3,000 chunks through the window, about a minute here
SETTLE_TIMEOUT_S = 10.0
POLL_S = 0.002
RELAY_MESSAGES = 50
RELAY_WARMUP = 5
# A latency knob outside Wren's code: Mosquitto leaves Nagle's algorithm on unless told
# otherwise. Measured as a second latency row.
NAGLE_CONF = "set_tcp_nodelay false\n"


class BenchError(RuntimeError):
    """A run did not end `done` with the exact text, or a wait ran out."""


progress = Steps("bench_stream")


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (with 10 values, p95 is the largest)."""
    xs = sorted(values)
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


# --------------------------------------------------------------------------- the sniffer


@dataclass(frozen=True)
class Seen:
    at: float  # time.monotonic() at arrival
    leaf: str  # "evt", "rpc" or "rpc/res"
    wire: int  # the PUBLISH packet's bytes (header, topic, packet id, payload)
    body: dict[str, Any]


# The sniffer's user, with the bridge's rights. Not the bridge's own user: the broker
# binds client ids to users, so a second connection as the bridge would take over the
# bridge's session.
SNIFFER_USER = "bridge-sniffer"


class Sniffer:
    """A paho client with the bridge's rights (SNIFFER_USER), recording every message on
    the device topics it counts."""

    LEAVES = ("evt", "rpc", "rpc/res")

    def __init__(self, s: Stack) -> None:
        self._seen: list[Seen] = []
        self._cond = threading.Condition()
        self._subscribed = threading.Event()
        self._client = paho.Client(
            CallbackAPIVersion.VERSION2, client_id=SNIFFER_USER, protocol=paho.MQTTv311
        )
        self._client.username_pw_set(SNIFFER_USER, s.users[SNIFFER_USER])
        self._client.on_message = self._on_message
        self._client.on_subscribe = lambda *a: self._subscribed.set()
        self._client.connect(s.host, s.port)
        self._client.subscribe([(f"{PREFIX}/d/+/{leaf}", 1) for leaf in self.LEAVES])
        self._client.loop_start()
        if not self._subscribed.wait(10):
            self.close()
            raise BenchError("sniffer: no SUBACK within 10 s")

    def _on_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        now = time.monotonic()
        leaf = msg.topic.split("/", 4)[-1]
        try:
            body = msgpack.unpackb(msg.payload)
        except Exception:  # noqa: BLE001 - counted, not read
            body = {}
        wire = len(msg.payload) + mqtt_publish_overhead(msg.topic, len(msg.payload), msg.qos)
        with self._cond:
            self._seen.append(Seen(now, leaf, wire, body if isinstance(body, dict) else {}))
            self._cond.notify_all()

    def seen(self) -> list[Seen]:
        with self._cond:
            return list(self._seen)

    def wait(self, pred: Callable[[list[Seen]], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not pred(self._seen):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BenchError(f"sniffer: {what} not seen within {timeout} s")
                self._cond.wait(left)

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


@dataclass(frozen=True)
class RunTraffic:
    """What one run put on the broker, as the sniffer saw it."""

    evt: list[Seen]  # the run's events, board -> bridge
    res: list[Seen]  # chunks and final answers of the run's calls, bridge -> board
    acks: list[Seen]  # the board's acks of those chunks


def traffic(sniffer: Sniffer, run: str) -> RunTraffic:
    """The run's messages, once the sniffer has its run.done and every final answer of
    its calls (an ack may follow a chunk by a moment: quiet for 0.2 s as well)."""

    def calls(seen: list[Seen]) -> set[Any]:
        return {m.body.get("c") for m in seen if m.leaf == "rpc" and m.body.get("r") == run}

    def complete(seen: list[Seen]) -> bool:
        ids = calls(seen)
        finals = {
            m.body.get("c")
            for m in seen
            if m.leaf == "rpc/res" and ("ok" in m.body or "err" in m.body)
        }
        done = any(
            m.leaf == "evt" and m.body.get("r") == run and m.body.get("t") == "run.done"
            for m in seen
        )
        return done and bool(ids) and ids <= finals

    sniffer.wait(complete, SETTLE_TIMEOUT_S, f"the end of run {run}")
    last = -1
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        n = len(sniffer.seen())
        if n == last:
            break
        last = n
        time.sleep(0.2)
    seen = sniffer.seen()
    ids = calls(seen)
    return RunTraffic(
        evt=[m for m in seen if m.leaf == "evt" and m.body.get("r") == run],
        res=[m for m in seen if m.leaf == "rpc/res" and m.body.get("c") in ids],
        acks=[m for m in seen if m.leaf == "rpc" and "ack" in m.body and m.body.get("c") in ids],
    )


# --------------------------------------------------------------------------- runs


def run_whole(s: Stack, server: ModelServer, text: str, turn: Turn) -> tuple[RunSnapshot, int]:
    """One request answered by `turn`; the snapshot and the model request's number.
    Raises BenchError unless it ends done with exactly `text`."""
    server.script[:] = [turn]
    before = len(server.requests)
    snap = s.ask("Stream it", timeout=RUN_TIMEOUT_S)
    if snap.status != "done" or assistant_text(snap) != text:
        raise BenchError(
            f"run {snap.run}: {snap.status} {snap.error}, text "
            f"{'exact' if assistant_text(snap) == text else 'wrong'}\n{s.describe()}"
        )
    if len(server.requests) != before + 1:
        raise BenchError(f"run {snap.run}: {len(server.requests) - before} model calls, not 1")
    return snap, before + 1


@dataclass(frozen=True)
class Counts:
    chars: int
    seconds: float  # request to run.done at the host
    deltas: int
    evt_msgs: int
    evt_bytes: int
    res_msgs: int
    res_bytes: int
    ack_msgs: int
    ack_bytes: int


def measure_counts(
    s: Stack, server: ModelServer, sniffer: Sniffer, text: str, chunk_chars: int
) -> Counts:
    start = time.monotonic()
    snap, _ = run_whole(s, server, text, Turn(text=text, chunk_chars=chunk_chars))
    seconds = time.monotonic() - start
    assert s.client is not None
    deltas = {e["i"] for e in s.client.events if e["r"] == snap.run and e["t"] == "msg.delta"}
    t = traffic(sniffer, snap.run)
    return Counts(
        len(text),
        seconds,
        len(deltas),
        len(t.evt),
        sum(m.wire for m in t.evt),
        len(t.res),
        sum(m.wire for m in t.res),
        len(t.acks),
        sum(m.wire for m in t.acks),
    )


def stack(workdir: Path, server: ModelServer, micropython: str | None, **kw: Any) -> Stack:
    """A Stack (started by `with`) whose bridge calls the test model server, with a user
    for the Sniffer."""
    kw.setdefault("extra_users", {SNIFFER_USER: "bridge"})
    return Stack(workdir, model_url=server.url, micropython=micropython, **kw)


def before_stack(
    workdir: Path, server: ModelServer, micropython: str | None, chunk_chars: int
) -> Stack:
    """Coalescing off (see BEFORE_*)."""
    return stack(
        workdir,
        server,
        micropython,
        heap=BEFORE_HEAP,
        board_settings={"delta_chars": chunk_chars, "chunk": BEFORE_CHUNK},
        bridge_args=["--merge-ms", BEFORE_MERGE_MS],
    )


# --------------------------------------------------------------------------- latency


@dataclass(frozen=True)
class Latency:
    total_ms: float  # the model's last write -> run.done at the host
    bridge_ms: float  # -> the bridge's final answer to the board on the broker
    board_ms: float  # final answer -> the board's run.done on the broker
    host_ms: float  # board's run.done -> the host's run.done


def measure_latency(s: Stack, server: ModelServer, sniffer: Sniffer, runs: int) -> list[Latency]:
    done_at: dict[str, float] = {}

    def on_event(event: dict[str, Any], snap: RunSnapshot) -> None:
        if event["t"] == "run.done":
            done_at.setdefault(event["r"], time.monotonic())

    assert s.client is not None
    s.client.on_event = on_event
    out = []
    try:
        for k in range(runs):
            snap, number = run_whole(
                s, server, LONG, Turn(text=LONG, chunk_chars=4, delay_s=PACE_S)
            )
            deadline = time.monotonic() + SETTLE_TIMEOUT_S
            while number not in server.stream_ends or snap.run not in done_at:
                if time.monotonic() > deadline:
                    raise BenchError(f"run {snap.run}: no stream end or run.done stamp")
                time.sleep(POLL_S)
            end = server.stream_ends[number]
            t = traffic(sniffer, snap.run)
            final = min(m.at for m in t.res if "ok" in m.body or "err" in m.body)
            board_done = min(m.at for m in t.evt if m.body.get("t") == "run.done")
            host = done_at[snap.run]
            out.append(
                Latency(
                    (host - end) * 1000,
                    (final - end) * 1000,
                    (board_done - final) * 1000,
                    (host - board_done) * 1000,
                )
            )
            progress(f"latency run {k + 1}/{runs}: {out[-1].total_ms:.1f} ms")
    finally:
        s.client.on_event = None
    return out


def relay_baseline(workdir: Path, n: int) -> list[float]:
    """A raw paho relay over three broker legs, QoS 1 like Wren's messages, one message
    at a time: source -> relay 1 -> relay 2 -> sink (as bridge -> board -> bridge ->
    host). Milliseconds from the source's publish to the sink's arrival."""
    broker = start_mosquitto(workdir / "relay-broker")
    clients: list[paho.Client] = []
    arrivals: queue.Queue[float] = queue.Queue()
    payload = bytes(range(100))  # about a run.done envelope

    def client(name: str, sub: str | None, forward: str | None) -> paho.Client:
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id=name, protocol=paho.MQTTv311)
        ready = threading.Event()

        def on_message(cl: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
            if forward is not None:
                cl.publish(forward, msg.payload, qos=1)
            else:
                arrivals.put(time.monotonic())

        c.on_message = on_message
        c.on_subscribe = lambda *a: ready.set()
        c.connect(broker.host, broker.port)
        c.loop_start()
        clients.append(c)
        if sub is not None:
            c.subscribe(sub, qos=1)
            if not ready.wait(10):
                raise BenchError(f"relay: {name} not subscribed within 10 s")
        return c

    try:
        client("relay-sink", "leg/3", None)
        client("relay-2", "leg/2", "leg/3")
        client("relay-1", "leg/1", "leg/2")
        source = client("relay-source", None, None)
        out = []
        for k in range(RELAY_WARMUP + n):
            start = time.monotonic()
            source.publish("leg/1", payload, qos=1)
            try:
                arrived = arrivals.get(timeout=10)
            except queue.Empty:
                raise BenchError("relay: a message did not arrive within 10 s") from None
            if k >= RELAY_WARMUP:
                out.append((arrived - start) * 1000)
            time.sleep(0.02)  # one at a time, as a run.done is
        return out
    finally:
        for c in clients:
            c.disconnect()
            c.loop_stop()
        broker.stop()


# --------------------------------------------------------------------------- recovery


@dataclass(frozen=True)
class Recovery:
    down_ms: float  # SIGTERM sent -> the new broker accepts connections
    link_ms: float  # -> the board's `link: up`
    host_ms: float  # -> the host client connected again (paho)
    done_ms: float  # -> run.done of a request sent as soon as the host could send it


def _accepting_again(host: str, port: int, out: list[float], stop: threading.Event) -> None:
    """Record when host:port accepts a connection after having refused one."""
    refused = False
    deadline = time.monotonic() + 30
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                if refused:
                    out.append(time.monotonic())
                    return
        except OSError:
            refused = True
        time.sleep(POLL_S)


def measure_recovery(s: Stack, server: ModelServer, restarts: int) -> list[Recovery]:
    server.script[:] = [Turn(text="Back.")]
    done_at: dict[str, float] = {}

    def on_event(event: dict[str, Any], snap: RunSnapshot) -> None:
        if event["t"] == "run.done" and snap.req is not None:
            done_at.setdefault(snap.req, time.monotonic())

    assert s.client is not None
    s.client.on_event = on_event
    out = []
    try:
        for k in range(restarts):
            mark = s.console_mark()
            up: list[float] = []
            stop = threading.Event()
            poller = threading.Thread(target=_accepting_again, args=(s.host, s.port, up, stop))
            poller.start()
            sent = time.monotonic()
            try:
                s.restart_broker(wait_clients=False)
            finally:
                poller.join(timeout=35)
                stop.set()
            if not up:
                raise BenchError("recovery: never saw the broker refuse, then accept")
            t0 = up[0]
            link = host = None
            req: str | None = None
            deadline = time.monotonic() + 30
            while req is None or req not in done_at or link is None:
                now = time.monotonic()
                if now > deadline:
                    raise BenchError(f"recovery {k + 1}: not back within 30 s\n{s.describe()}")
                if link is None and any("link: up" in line for line in s.console[mark:]):
                    link = now
                if host is None and s.client.connected:
                    host = now
                if host is not None and req is None:
                    try:
                        req = s.request("Are you back?")
                    except HostConnectError:
                        host = None  # connected, then lost again: wait for it
                time.sleep(POLL_S)
            snap = s.wait_run(req, timeout=30)
            if snap.status != "done" or assistant_text(snap) != "Back.":
                raise BenchError(f"recovery {k + 1}: {snap.status} {snap.error}\n{s.describe()}")
            assert host is not None
            out.append(
                Recovery(
                    (t0 - sent) * 1000,
                    (link - t0) * 1000,
                    (host - t0) * 1000,
                    (done_at[req] - t0) * 1000,
                )
            )
            r = out[-1]
            progress(
                f"restart {k + 1}/{restarts}: link up {r.link_ms:.0f} ms, "
                f"run.done {r.done_ms:.0f} ms"
            )
    finally:
        s.client.on_event = None
    return out


# --------------------------------------------------------------------------- report


def per_k(value: float, chars: int) -> float:
    return value * 1000 / chars


def print_counts(results: dict[str, tuple[Counts, Counts]]) -> None:
    print()
    print("1. Coalescing: per 1,000 characters streamed (one run each; counts are exact)")
    rows: list[tuple[str, Callable[[Counts], float], str]] = [
        ("msg.delta events at the host", lambda c: c.deltas, ".1f"),
        ("MQTT msgs board->bridge P/d/D/evt", lambda c: c.evt_msgs, ".1f"),
        ("MQTT msgs bridge->board P/d/D/rpc/res", lambda c: c.res_msgs, ".1f"),
        ("wire bytes P/d/D/evt", lambda c: c.evt_bytes, ".0f"),
        ("wire bytes P/d/D/rpc/res", lambda c: c.res_bytes, ".0f"),
        ("(also) board acks on P/d/D/rpc, msgs", lambda c: c.ack_msgs, ".1f"),
        ("(also) board acks, wire bytes", lambda c: c.ack_bytes, ".0f"),
    ]
    head = f"{'':40}"
    for key, what, _, _ in SCENARIOS:
        head += f" | ({key}) {what:29}"
    print(head)
    sub = f"{'':40}" + " | {:>10} {:>10} {:>12}".format("before", "after", "after/before") * len(
        SCENARIOS
    )
    print(sub)
    for name, get, fmt in rows:
        line = f"{name:40}"
        for key, *_ in SCENARIOS:
            b, a = results[key]
            vb, va = per_k(get(b), b.chars), per_k(get(a), a.chars)
            ratio = f"{va / vb:.3f}" if vb else "-"
            line += f" | {vb:>10{fmt}} {va:>10{fmt}} {ratio:>12}"
        print(line)
    line = f"{'run time, request -> run.done (s)':40}"
    for key, *_ in SCENARIOS:
        b, a = results[key]
        line += f" | {b.seconds:>10.2f} {a.seconds:>10.2f} {a.seconds / b.seconds:>12.3f}"
    print(line)
    print(
        f"before: board delta_chars = the model chunk's characters (4 in a, 1 in b), board "
        f"`chunk` {BEFORE_CHUNK} (the bridge\n floors text pieces at 4 bytes), `wren bridge "
        f"--merge-ms {BEFORE_MERGE_MS}`, board heap {BEFORE_HEAP}; after: the defaults "
        f"(delta_chars 256,\n delta_ms 100, chunk {DEFAULT_LIMITS.chunk}, merge 50 ms, "
        f"window {DEFAULT_LIMITS.window}), heap 128K."
    )
    print(
        "wire bytes: MQTT PUBLISH packets (fixed header, topic, packet id, payload) on one "
        "leg, publisher -> broker;\n PUBACKs not counted. Messages of the run only (its run "
        "id, its calls' ids)."
    )


def print_latency(
    lat: list[Latency], nodelay: list[Latency], relay: list[float], runs: int
) -> None:
    print()
    print(
        f"2. Model's last chunk -> run.done at the host, ms ({runs} runs of a 2,000-character "
        f"answer in 4-char chunks, one SSE event every {PACE_S * 1000:g} ms)"
    )
    print(f"{'':54} {'min':>8} {'p50':>8} {'p95':>8} {'max':>8}")

    def row(name: str, xs: Sequence[float]) -> None:
        print(f"{name:54} {min(xs):8.1f} {pct(xs, 0.5):8.1f} {pct(xs, 0.95):8.1f} {max(xs):8.1f}")

    for name, xs in (("wren", lat), (f"wren, Mosquitto with {NAGLE_CONF.strip()}", nodelay)):
        print(name)
        row("  model end -> host run.done", [x.total_ms for x in xs])
        row("  model end -> bridge's final answer (sniffer)", [x.bridge_ms for x in xs])
        row("  final answer -> board's run.done (sniffer)", [x.board_ms for x in xs])
        row("  board's run.done (sniffer) -> host's run.done", [x.host_ms for x in xs])
    row(f"baseline: raw paho relay, 3 legs ({len(relay)} msgs)", relay)
    for name, xs in (("wren", lat), ("wren, Nagle at the broker", nodelay)):
        w = [x.total_ms for x in xs]
        print(
            f"ratio {name}/baseline: p50 {pct(w, 0.5) / pct(relay, 0.5):.1f}x, "
            f"p95 {pct(w, 0.95) / pct(relay, 0.95):.1f}x"
        )
    print(
        "(percentiles nearest-rank. The split is stamped where the sniffer receives each "
        "message through the same broker:\n its own delivery can stall too, most with "
        "Mosquitto's default Nagle, so the parts need not add up exactly)"
    )


def print_recovery(rec: list[Recovery]) -> None:
    print()
    print(
        f"3. Broker restart (Mosquitto with persistence, SIGTERM then start): ms from the new "
        f"broker accepting connections, {len(rec)} restarts"
    )
    print(f"{'':46} {'min':>8} {'median':>8} {'max':>8}")

    def row(name: str, xs: Sequence[float]) -> None:
        print(f"{name:46} {min(xs):8.0f} {statistics.median(xs):8.0f} {max(xs):8.0f}")

    row("(a) board's `link: up`", [r.link_ms for r in rec])
    row("    host client connected again (paho)", [r.host_ms for r in rec])
    row("(b) next request's run.done at the host", [r.done_ms for r in rec])
    row("(broker down: SIGTERM -> accepting again)", [r.down_ms for r in rec])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=12, help="latency runs (default 12)")
    parser.add_argument("--restarts", type=int, default=5, help="broker restarts (default 5)")
    parser.add_argument(
        "--micropython",
        metavar="PATH",
        help="the board's MicroPython binary (default: the unix port)",
    )
    args = parser.parse_args()
    if args.runs < 10 or args.restarts < 1:
        parser.error("need --runs >= 10 and --restarts >= 1")
    logging.basicConfig(level=logging.ERROR, format="%(name)s: %(message)s")
    command = "python benchmarks/bench_stream.py"
    if args.runs != 12 or args.restarts != 5:
        command += f" --runs {args.runs} --restarts {args.restarts}"
    if args.micropython:
        command += f" --micropython {args.micropython}"
    started = time.monotonic()
    results: dict[str, tuple[Counts, Counts]] = {}
    with tempfile.TemporaryDirectory(prefix="wren-bench-stream-") as tmp, ModelServer() as server:
        work = Path(tmp)
        before: dict[str, Counts] = {}
        for key, what, text, chunk_chars in SCENARIOS:
            progress(f"({key}) {what}, coalescing off ...")
            with before_stack(work / f"before-{key}", server, args.micropython, chunk_chars) as s:
                sniffer = Sniffer(s)
                try:
                    before[key] = measure_counts(s, server, sniffer, text, chunk_chars)
                finally:
                    sniffer.close()
            progress(f"({key}) before: {before[key].seconds:.1f} s")
        # The defaults, with persistence for the restarts (it changes nothing else:
        # Mosquitto saves its database at SIGTERM only).
        with stack(work / "after", server, args.micropython, persistence=True) as s:
            sniffer = Sniffer(s)
            try:
                for key, what, text, chunk_chars in SCENARIOS:
                    progress(f"({key}) {what}, defaults ...")
                    results[key] = (
                        before[key],
                        measure_counts(s, server, sniffer, text, chunk_chars),
                    )
                progress(f"latency, {args.runs} runs ...")
                lat = measure_latency(s, server, sniffer, args.runs)
            finally:
                sniffer.close()
            progress(f"broker restarts, {args.restarts} ...")
            rec = measure_recovery(s, server, args.restarts)
        with stack(work / "nodelay", server, args.micropython, broker_conf=NAGLE_CONF) as s:
            sniffer = Sniffer(s)
            try:
                progress(f"latency, Mosquitto {NAGLE_CONF.strip()}, {args.runs} runs ...")
                nodelay = measure_latency(s, server, sniffer, args.runs)
            finally:
                sniffer.close()
        progress("raw paho relay ...")
        relay = relay_baseline(work, RELAY_MESSAGES)
    print(f"command: {command}")
    print(
        "machine: 2 cores, shared and noisy; each baseline measured in the same run; "
        f"board .mpy on {args.micropython or 'the MicroPython unix port (64-bit)'}"
    )
    print_counts(results)
    print_latency(lat, nodelay, relay, args.runs)
    print_recovery(rec)
    print(f"\n(total {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    try:
        main()
    except (BenchError, StackError) as e:
        sys.exit(f"bench_stream: {e}")
