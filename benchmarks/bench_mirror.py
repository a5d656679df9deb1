"""The JSON mirror's cost: bridge CPU per relayed event with `--json-mirror` against the
msgpack path alone (server_bridge/mirror/; PROTOCOL.md "JSON mirror").

The real Bridge runs in a child process of this script (as `wren bridge` does: its
switch interval, its lanes, four links), once without the mirror and once with it for
the tenant, in turn, `--rounds` times each; Mosquitto with the ACL the tooling writes.
Simulated boards (paho clients logged in as device users: status and hello, then runs
of `run.started` naming a user, `msg.delta`s of 64 characters and `run.done`, msgpack,
QoS 1) offer `--rate` events/s in all for `--seconds`; a watcher host subscribes to the
events and, with the mirror, to their JSON, and the round ends when every event (and
every JSON message the bridge counted) has arrived. The bridge's CPU (/proc/PID/stat,
user + system) from the first event offered to the last received, over the events
relayed, is its CPU per event; the mirror's cost is the difference, and the ratio.

Also, in this process: what the mirror's thread does per event before the lanes (the
msgpack envelope decoded and written as JSON) next to what the intake does per event
on the msgpack path before the lanes (the envelope decoded and checked, and encoded
again), and the bytes of an event as msgpack and as JSON.

With --inline, a third variant: the mirror's work done in the intake's hook on paho's
network thread, with no queue or thread of its own (the design not shipped: a thread
of its own lets the mirror fall behind and drop, counted, instead of slowing the relay
under a flood; this measures what that costs).

    python benchmarks/bench_mirror.py                       # about 2 minutes
    python benchmarks/bench_mirror.py --inline              # about 3 minutes
    python benchmarks/bench_mirror.py --rate 4000 --rounds 5 --seconds 8

Progress goes to stderr, the tables to stdout. The machine has 2 cores shared by
Mosquitto, the bridge, the boards and the host: the figure is the bridge process's own
CPU, which the others do not count in.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import timeit
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import paho.mqtt.client as paho

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_bridge import (  # noqa: E402
    connect,
    disconnect,
    paho_client,
    presence,
    proc_cpu_s,
)
from bench_stream import BenchError  # noqa: E402

from server_bridge import brokerconf  # noqa: E402
from server_bridge.mirror import payloads  # noqa: E402
from server_bridge.registry import provision  # noqa: E402
from server_bridge.wire import check_events, decode, encode  # noqa: E402
from tools.broker import start_mosquitto  # noqa: E402
from tools.demo import AGENT, BRIDGE_USER, PREFIX, TENANT  # noqa: E402

HOST_USER = f"host-{TENANT}"
END_USER = "alice"
DELTA_TEXT = "x" * 64  # a msg.delta's text: about 100 bytes an envelope (as bench_bridge)
RUN_LEN = 50  # run.started, 48 msg.delta, run.done
TICK_S = 0.01  # the boards' pacing
START_TIMEOUT_S = 30.0
DRAIN_MAX_S = 30.0
QUIET_S = 3.0
VARIANTS = ("msgpack", "json mirror")
# --inline adds it: the mirror's work done in the intake's hook, on paho's thread.
INLINE = "json inline (not shipped)"


# --------------------------------------------------------------------------- events


def envelope(run: str, i: int, t: str, d: dict[str, Any]) -> bytes:
    return msgpack.packb({"r": run, "i": i, "t": t, "ts": 1000 + i, "d": d})


def run_events(run: str, n: int = RUN_LEN) -> list[bytes]:
    """A whole run of END_USER's, as a board sends it."""
    started = {"agent": AGENT, "ver": "0.1.0", "req": run, "conv": None, "usr": END_USER,
               "domain": "request", "input": "How warm is it?"}  # fmt: skip
    out = [envelope(run, 1, "run.started", started),
           envelope(run, 2, "msg.start", {"m": 1, "role": "assistant"})]  # fmt: skip
    out += [envelope(run, i, "msg.delta", {"m": 1, "text": DELTA_TEXT}) for i in range(3, n)]
    out.append(envelope(run, n, "run.done", {"usage": {"in": 1, "out": n, "reason": 0}}))
    return out


# --------------------------------------------------------------------------- the bridge child


def child_main(conf_path: str) -> None:
    """The real Bridge, as `wren bridge` runs it, the mirror on when `mirror` says so."""
    logging.basicConfig(level=logging.WARNING, format="bridge %(name)s: %(message)s")
    conf = json.loads(Path(conf_path).read_text())
    from server_bridge.bridge import Bridge
    from server_bridge.config import BridgeConfig
    from server_bridge.models.scripted import ScriptedProvider
    from server_bridge.registry import Registry
    from server_bridge.service import SWITCH_INTERVAL_S

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    config = BridgeConfig(host=conf["host"], port=conf["port"], username=conf["user"],
                          password=conf["password"], prefix=PREFIX,
                          json_mirror=frozenset(conf["mirror"]))  # fmt: skip
    bridge = Bridge(config, Registry(conf["registry"]), ScriptedProvider())
    mirror = bridge.mirror
    if mirror is not None and conf.get("inline"):
        # The variant not shipped: the mirror's work on paho's network thread, in the
        # intake's hook, with no queue or thread of its own (its retained messages are
        # not sent: they are a few per run and not what is measured).
        from server_bridge.mirror import both

        def inline(tenant: str, device: str, run: str, i: int, payload: bytes) -> None:
            mirror._mirror(tenant, device, run, payload)

        bridge.intake.on_delivered = both(bridge.hub.publish, inline)
    elif mirror is not None:
        mirror.start()
    bridge.start()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "stop":
            break
        print(json.dumps(dict(bridge.stats)), flush=True)
    if bridge.mirror is not None:
        bridge.mirror.stop()
    bridge.stop()
    print("stopped", flush=True)


class BridgeChild:
    def __init__(self, conf: dict[str, Any], workdir: Path) -> None:
        path = workdir / f"bridge-{secrets.token_hex(3)}.json"
        path.write_text(json.dumps(conf))
        self.log_path = path.with_suffix(".log")
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "--child", str(path)], cwd=ROOT, env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1,
            )  # fmt: skip
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        if self._next(START_TIMEOUT_S) != "ready":
            self.close()
            raise BenchError(f"the bridge did not start:\n{self.log_path.read_text()[-2000:]}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def _next(self, timeout: float) -> str | None:
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            raise BenchError(f"the bridge said nothing in {timeout} s") from None

    def stats(self) -> dict[str, int]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        line = self._next(START_TIMEOUT_S)
        if line is None:
            raise BenchError(f"the bridge exited:\n{self.log_path.read_text()[-2000:]}")
        return dict(json.loads(line))

    def cpu_s(self) -> float:
        return proc_cpu_s(self.proc.pid)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("stop\n")
                self.proc.stdin.close()
                self.proc.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


# --------------------------------------------------------------------------- one round


class Host:
    """A watcher counting the events (msgpack) and their JSON as they arrive."""

    def __init__(self, host: str, port: int, password: str) -> None:
        self.events = 0
        self.json = 0
        self.json_bytes = 0
        self.evt_bytes = 0
        self.last = time.monotonic()
        self._lock = threading.Lock()
        self.c = paho_client(HOST_USER, password)
        self.c.on_message = self._on_message
        h = f"{PREFIX}/h/{TENANT}"
        connect(self.c, host, port, [f"{h}/+/u/+/evt", f"{h}/+/u/+/json"])

    def _on_message(self, c: paho.Client, u: Any, msg: paho.MQTTMessage) -> None:
        with self._lock:
            if msg.topic.endswith("/json"):
                self.json += 1
                self.json_bytes += len(msg.payload)
            else:
                self.events += 1
                self.evt_bytes += len(msg.payload)
            self.last = time.monotonic()

    def counts(self) -> tuple[int, int, float]:
        with self._lock:
            return self.events, self.json, self.last

    def close(self) -> None:
        disconnect(self.c)


@dataclass
class Round:
    variant: str
    events: int  # offered and relayed
    cpu_s: float
    seconds: float
    json: int
    dropped: int
    evt_bytes: int
    json_bytes: int

    @property
    def us_per_event(self) -> float:
        return self.cpu_s / self.events * 1e6


def one_round(
    variant: str, conf: dict[str, Any], users: dict[str, str], devices: Sequence[str],
    rate: int, seconds: float, workdir: Path,
) -> Round:  # fmt: skip
    mirror = variant != VARIANTS[0]
    bridge = BridgeChild({**conf, "mirror": [TENANT] if mirror else [],
                          "inline": variant == INLINE}, workdir)  # fmt: skip
    host = Host(conf["host"], conf["port"], users[HOST_USER])
    boards = []
    try:
        for d in devices:
            c = paho_client(d, users[d])
            connect(c, conf["host"], conf["port"])
            status, hello = presence(secrets.token_hex(4))
            c.publish(f"{PREFIX}/d/{d}/hello", hello, qos=1, retain=True)
            c.publish(f"{PREFIX}/d/{d}/status", status, qos=1, retain=True)
            boards.append(c)
        time.sleep(1.0)  # the statuses and hellos taken, the links subscribed
        # Whole runs, each device in turn, paced to `rate` in all.
        per_tick = max(1, round(rate * TICK_S))
        total = int(rate * seconds) // RUN_LEN * RUN_LEN
        queued: list[tuple[paho.Client, str, bytes]] = []
        n = 0
        while len(queued) < total:
            for d, c in zip(devices, boards, strict=True):
                queued += [(c, f"{PREFIX}/d/{d}/evt", e) for e in run_events(f"b{n}.{n}")]
                n += 1
                if len(queued) >= total:
                    break
        queued = queued[:total]
        cpu0 = bridge.cpu_s()
        t0 = time.monotonic()
        for k in range(0, total, per_tick):
            for c, topic, payload in queued[k : k + per_tick]:
                c.publish(topic, payload, qos=1)
            next_at = t0 + (k // per_tick + 1) * TICK_S
            time.sleep(max(0.0, next_at - time.monotonic()))
        deadline = time.monotonic() + DRAIN_MAX_S
        while True:
            events, js, last = host.counts()
            stats = bridge.stats()
            want_json = stats.get("mirror.events", 0) if mirror else 0
            if events >= total and js >= want_json:
                break
            if time.monotonic() > deadline or time.monotonic() - last > QUIET_S:
                raise BenchError(f"{variant}: the host got {events} of {total} events and "
                                 f"{js} of {want_json} JSON; bridge stats {stats}")  # fmt: skip
            time.sleep(0.05)
        cpu = bridge.cpu_s() - cpu0
        took = last - t0
        stats = bridge.stats()
        dropped = sum(v for k, v in stats.items() if k.startswith("mirror.dropped."))
        return Round(variant, total, cpu, took, js, dropped, host.evt_bytes, host.json_bytes)
    finally:
        for c in boards:
            disconnect(c)
        host.close()
        bridge.close()


# --------------------------------------------------------------------------- in process


def per_event_us(fn: Any, n: int) -> float:
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


def encode_figures() -> list[tuple[str, float]]:
    """µs per event of the work before the lanes on each path, in this process."""
    payload = envelope("b1.1", 7, "msg.delta", {"m": 1, "text": DELTA_TEXT})

    def msgpack_path() -> None:
        # What the intake does per event before the lanes: decode, check, encode again.
        check_events(decode(payload))
        encode(msgpack.unpackb(payload))

    def json_path() -> None:
        payloads.dumps(payloads.decode_event(payload))

    return [
        ("intake: decode, check, encode (msgpack path)", per_event_us(msgpack_path, 20_000)),
        ("mirror: decode, write JSON", per_event_us(json_path, 20_000)),
    ]


# --------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=int, default=2000, help="events/s offered in all")
    p.add_argument("--seconds", type=float, default=6.0, help="seconds of load a round")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each variant, in turn")
    p.add_argument("--boards", type=int, default=10, help="simulated boards")
    p.add_argument("--inline", action="store_true",
                   help="also measure the mirror's work done in the intake's hook, on paho's "
                   "network thread (the design not shipped: the figure that decided it)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child_main(args.child)
        return
    with tempfile.TemporaryDirectory(prefix="wren-bench-mirror-") as tmp:
        run(args, Path(tmp))


def run(args: argparse.Namespace, workdir: Path) -> None:
    devices = [f"mdev{i}" for i in range(args.boards)]
    users = {name: secrets.token_urlsafe(12) for name in (BRIDGE_USER, HOST_USER, *devices)}
    logins = brokerconf.with_control_users(users, [BRIDGE_USER])
    conf_lines = brokerconf.secure_mosquitto_conf(
        workdir / "broker", logins,
        brokerconf.acl_text(PREFIX, BRIDGE_USER, {TENANT: HOST_USER}),
    )  # fmt: skip
    broker = start_mosquitto(workdir / "broker", extra_conf=conf_lines + "set_tcp_nodelay true\n",
                             allow_anonymous=False)  # fmt: skip
    try:
        registry = workdir / "registry.json"
        provision(registry, TENANT, [(d, AGENT) for d in devices]).close()
        conf = {"host": broker.host, "port": broker.port, "user": BRIDGE_USER,
                "password": users[BRIDGE_USER], "registry": str(registry)}  # fmt: skip
        rounds: list[Round] = []
        variants = (*VARIANTS, INLINE) if args.inline else VARIANTS
        for k in range(args.rounds):
            for variant in variants:
                print(f"round {k + 1}/{args.rounds}: {variant}", file=sys.stderr, flush=True)
                rounds.append(one_round(variant, conf, users, devices, args.rate, args.seconds,
                                        workdir))  # fmt: skip
    finally:
        broker.stop()
    print_figures(args, rounds, encode_figures())


def print_figures(
    args: argparse.Namespace, rounds: Sequence[Round], encode: Sequence[tuple[str, float]]
) -> None:
    print(f"JSON mirror: bridge CPU per relayed event, {args.boards} boards, "
          f"{args.rate} events/s offered for {args.seconds:g} s, {args.rounds} rounds each "
          "(runs of 50 events: 48 msg.delta of 64 characters)")  # fmt: skip
    print()
    print("| variant | CPU µs/event (each round) | median | JSON messages | mirror drops |")
    print("|---|---|---|---|---|")
    med = {}
    for variant in dict.fromkeys(r.variant for r in rounds):
        mine = [r for r in rounds if r.variant == variant]
        each = ", ".join(f"{r.us_per_event:.0f}" for r in mine)
        med[variant] = statistics.median(r.us_per_event for r in mine)
        print(f"| {variant} | {each} | {med[variant]:.0f} | {sum(r.json for r in mine)} "
              f"| {sum(r.dropped for r in mine)} |")  # fmt: skip
    extra = med[VARIANTS[1]] - med[VARIANTS[0]]
    print()
    print(f"The mirror's cost: +{extra:.0f} µs of bridge CPU per event, "
          f"{med[VARIANTS[1]] / med[VARIANTS[0]]:.2f}x the msgpack path.")
    if INLINE in med:
        print(f"Done inline in the intake's hook: +{med[INLINE] - med[VARIANTS[0]]:.0f} µs, "
              f"{med[INLINE] / med[VARIANTS[0]]:.2f}x.")
    with_json = [r for r in rounds if r.json]
    if with_json:
        evt = sum(r.evt_bytes for r in with_json) / sum(r.events for r in with_json)
        js = sum(r.json_bytes for r in with_json) / sum(r.json for r in with_json)
        print(f"An event as msgpack {evt:.0f} B, as JSON {js:.0f} B ({js / evt:.2f}x).")
    print()
    print("In this process, per event before the lanes (best of 5):")
    print()
    print("| work | µs/event |")
    print("|---|---|")
    for name, us in encode:
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
