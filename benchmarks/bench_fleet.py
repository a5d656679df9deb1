"""Fleet mode under load and failover (issue "Past one machine", DESIGN "Where scale
goes"): bridge processes of one fleet (`python -m server_bridge --fleet-dsn ...`) on one
Mosquitto, their leases in a PostgreSQL of the benchmark's own (tools/pg_server.py),
each figure next to the single bridge of the default layout in the same run (this
machine has 2 cores, shared by everything: ratios, not absolutes).

1. The highest lossless events/s from N simulated boards (bench_bridge's SimBoard: the
   board's own rings, replay answers and paced link) through 1, 2 and 3 fleet bridges,
   and through one bridge without --fleet-dsn (the baseline), to bench_bridge's host
   counter; the offered rate doubles until events are lost (bench_bridge's ramp). The
   claim is zero loss and a constant CPU cost per event, not speed-up: the bridges share
   2 cores with Mosquitto, the host counter and the load generator. CPU per event is
   summed over the bridge processes (/proc/PID/stat).
2. Request -> first `msg.delta` at the host, p50/p99, through the same configurations:
   scripted board peers (tests/test_fleet_bridges.py's BoardPeer: the request, the model
   call with its chunk acks, the run's events) answered by the bridges' scripted model.
3. Failover at the default lease settings (round 2 s, lease 6 s): two fleet bridges,
   one board peer in every partition; a bridge is killed (`kill -9`) and each of its
   devices is asked at once (the requests wait in the partitions' sessions); the time
   from the kill until every one of them has had its answer (`run.done`), p50 and max
   over --kills kills. The killed bridge is started again between kills, and the next
   kill takes the other (the one holding most partitions), so there are always two.

In figures 1 and 2 the fleet's rounds are short (0.3 s, lease 1.2 s) so that 3 bridges
settle their shares in seconds (a joining bridge gets one partition a round); a round is
one UPDATE per bridge, not a cost per event.

    python benchmarks/bench_fleet.py               # about 6 minutes
    python benchmarks/bench_fleet.py --quick       # a smoke run: 3 kills at a 1.5 s lease
    python benchmarks/bench_fleet.py --skip 1,2 --kills 20

Progress goes to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import paho.mqtt.client as paho

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_bridge import (  # noqa: E402
    BenchError,
    Child,
    SimBoard,
    Step,
    disconnect,
    highest_lossless,
    proc_cpu_s,
    ramp,
    sim_board,
    wait_published,
)
from bench_stream import pct  # noqa: E402

from server_bridge.fleet import partition_of  # noqa: E402
from server_bridge.fleet.leases import LEASE_S, ROUND_S  # noqa: E402
from server_bridge.fleet.partitions import DEFAULT_PARTITIONS  # noqa: E402
from server_bridge.registry import Registry, provision  # noqa: E402
from server_bridge.tokens import sign  # noqa: E402
from tests.test_cli import Proc  # noqa: E402
from tests.test_fleet_bridges import BoardPeer, Host, P, devices_across, owners  # noqa: E402
from tools.broker import BrokerError, MosquittoProcess, start_mosquitto  # noqa: E402
from tools.demo import AGENT, PREFIX  # noqa: E402
from tools.demo import TENANT as SIM_TENANT  # noqa: E402
from tools.pg_server import PgMissing, PgServer, start_postgres  # noqa: E402
from tools.steps import Steps  # noqa: E402

# The board peers' tenant (tests/test_fleet_bridges.py): figures 2 and 3.
PEER_TENANT = "acme"
PEER_AGENT = "thermostat"
ANSWER = "It is 21.5 °C in here."
SIM_PREFIX = "b"  # figure 1's simulated boards: b00, b01 ...
LATENCY_DEVICES = 4
# Figures 1 and 2: short rounds, so that shares settle in seconds.
LOAD_ROUND_S = 0.3
LOAD_LEASE_S = 1.2
QUICK_ROUND_S = 0.5
QUICK_LEASE_S = 1.5
SETTLE_S = 90.0
RUN_WAIT_S = 30.0
# The configurations of figures 1 and 2: (label, fleet bridges; 0 is the single bridge).
CONFIGS = (
    ("single bridge (default)", 0),
    ("fleet, 1 bridge", 1),
    ("fleet, 2 bridges", 2),
    ("fleet, 3 bridges", 3),
)

progress = Steps("bench_fleet")


def wait_for(what: Any, timeout: float, why: str, step: float = 0.05) -> float:
    start = time.monotonic()
    while not what():
        if time.monotonic() - start > timeout:
            raise BenchError(f"{why}: not within {timeout:.0f} s")
        time.sleep(step)
    return time.monotonic() - start


def shares(dsn: str) -> list[int]:
    """Partitions held by each live bridge, smallest first."""
    return sorted(Counter(owners(dsn).values()).values())


def balanced(parts: int, bridges: int) -> list[int]:
    return sorted(parts // bridges + (1 if k < parts % bridges else 0) for k in range(bridges))


class BridgeProcs(Child):
    """The bridge processes of one configuration, standing in for bench_bridge's relay
    child in its ramp: CPU summed over them, their logs counted together. Not a child
    of bench_bridge's own (none of its process is started), so Child's __init__ is not
    called; the ramp asks this only cpu_s, log_count and role."""

    def __init__(self, procs: Sequence[Proc]) -> None:
        self.role = "bridges"
        self.procs = list(procs)

    def cpu_s(self) -> float:
        return sum(proc_cpu_s(p.proc.pid) for p in self.procs)

    def log_count(self, text: str) -> int:
        n = 0
        for p in self.procs:
            while not p.lines.empty():
                p.seen.append(p.lines.get_nowait())
            n += sum(text in line for line in p.seen)
        return n

    def close(self) -> None:
        pass


class TimingHost(Host):
    """The counting host of tests/test_fleet_bridges.py, which also notes when each
    run's first msg.delta came."""

    def __init__(self, broker: MosquittoProcess, token: str) -> None:
        self.first_delta: dict[tuple[str, str], float] = {}
        super().__init__(broker, token)

    def _on_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        now = time.monotonic()
        super()._on_message(client, userdata, msg)
        if msg.topic.startswith(f"{P}/h/") and msg.payload:
            env = msgpack.unpackb(msg.payload, raw=False)
            if env.get("t") == "msg.delta":
                self.first_delta.setdefault((msg.topic.split("/")[4], env["r"]), now)

    def first_delta_at(self, req: str) -> float | None:
        key = self.runs.get(req)
        return None if key is None else self.first_delta.get(key)


@dataclass
class Setup:
    """One broker, one fleet database and one registry: what a configuration runs on."""

    work: Path
    broker: MosquittoProcess
    dsn: str
    registry: Path
    script: Path
    token: str
    sims: list[str]
    peers_devices: list[str]
    procs: dict[str, Proc] = field(default_factory=dict)

    def start_bridge(
        self, name: str, fleet: bool, round_s: float, lease_s: float, parts: int
    ) -> Proc:
        cwd = self.work / name
        cwd.mkdir(parents=True, exist_ok=True)
        args = [
            sys.executable,
            "-m",
            "server_bridge",
            "--broker",
            self.broker.address,
            "--client-id",
            name,
            "--registry",
            str(self.registry),
            "--tenant",
            PEER_TENANT,
            "--script",
            str(self.script),
            "--no-event-log",
        ]
        if fleet:
            args += [
                "--fleet-dsn",
                self.dsn,
                "--partitions",
                str(parts),
                "--fleet-round",
                str(round_s),
                "--fleet-lease",
                str(lease_s),
            ]
        proc = Proc(args, cwd)
        try:
            proc.wait_for("bridge: ")
        except AssertionError as e:
            raise BenchError(f"bridge {name} did not start: {e}") from None
        self.procs[name] = proc
        return proc

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.proc.poll() is None:
                proc.proc.kill()
                proc.proc.wait(10)


def new_database(pg: PgServer) -> str:
    import psycopg
    import psycopg.conninfo

    name = f"fleet_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return psycopg.conninfo.make_conninfo(pg.dsn, dbname=name)


@contextlib.contextmanager
def setup(work: Path, pg: PgServer, sims: int, peer_devices: list[str]) -> Iterator[Setup]:
    work.mkdir(parents=True, exist_ok=True)
    broker = start_mosquitto(work / "mosquitto")
    secret = secrets.token_hex(32)
    registry = work / "registry.json"
    reg = Registry(registry)
    reg.add_tenant(PEER_TENANT, secret)
    for d in peer_devices:
        reg.add_device(d, PEER_TENANT, PEER_AGENT)
    reg.close()
    sim_devices = [f"{SIM_PREFIX}{k:02d}" for k in range(sims)]
    provision(registry, SIM_TENANT, [(d, AGENT) for d in sim_devices]).close()
    script = work / "script.json"
    script.write_text(json.dumps([[{"text": ANSWER}]]))
    s = Setup(
        work,
        broker,
        new_database(pg),
        registry,
        script,
        sign(bytes.fromhex(secret), PEER_TENANT, "alice"),
        sim_devices,
        peer_devices,
    )
    try:
        yield s
    finally:
        s.close()
        broker.stop()


# --------------------------------------------------------------------------- figures 1, 2


@dataclass
class ConfigResult:
    label: str
    bridges: int
    steps: list[Step]
    deltas_ms: list[float]
    settle_s: float


def first_deltas(s: Setup, host: TimingHost, runs: int) -> list[float]:
    out: list[float] = []
    for k in range(runs + 1):  # the first is a warm-up
        device = s.peers_devices[k % len(s.peers_devices)]
        t0 = time.monotonic()
        req = host.ask(device)
        wait_for(lambda req=req: host.done(req), RUN_WAIT_S, f"request {req} to {device}", 0.002)
        at = host.first_delta_at(req)
        if host.answer(req) != ANSWER or at is None:
            raise BenchError(f"request {req}: answer {host.answer(req)!r}, first delta {at}")
        if k:
            out.append((at - t0) * 1000)
        time.sleep(0.02)
    return out


def measure_config(
    label: str, bridges: int, work: Path, pg: PgServer, args: argparse.Namespace
) -> ConfigResult:
    round_s, lease_s = (
        (QUICK_ROUND_S, QUICK_LEASE_S) if args.quick else (LOAD_ROUND_S, LOAD_LEASE_S)
    )
    with setup(work, pg, args.boards, [f"lat{k}" for k in range(LATENCY_DEVICES)]) as s:
        progress(f"{label}: starting ...")
        t0 = time.monotonic()
        if bridges == 0:
            s.start_bridge("single", False, round_s, lease_s, args.partitions)
        for k in range(bridges):
            s.start_bridge(f"fleet-{'abc'[k]}", True, round_s, lease_s, args.partitions)
        if bridges:
            want = balanced(args.partitions, bridges)
            wait_for(lambda: shares(s.dsn) == want, SETTLE_S, f"{label}: shares {want}", 0.1)
        settle_s = time.monotonic() - t0
        relay = BridgeProcs(list(s.procs.values()))
        counter = Child(
            "host",
            {
                "host": s.broker.host,
                "port": s.broker.port,
                "user": f"host-{SIM_TENANT}",
                "password": "x",
            },
            work / "children",
        )
        boards: list[SimBoard] = []
        peers: list[BoardPeer] = []
        host = TimingHost(s.broker, s.token)
        try:
            for d in s.sims:
                boards.append(sim_board(d, "x", s.broker.host, s.broker.port, replay=True))
            wait_published([i for b in boards for i in b.say_hello()], 30)
            peers = [BoardPeer(s.broker, d) for d in s.peers_devices]
            time.sleep(1.0)
            progress(f"{label}: request -> first delta, {args.latency_runs} requests ...")
            deltas = first_deltas(s, host, args.latency_runs)
            progress(f"  p50 {pct(deltas, 0.5):.1f} ms")
            steps = ramp(relay, counter, boards, rates(args), args.step_s, label)
            twice = host.twice()
            if twice:
                raise BenchError(f"{label}: the host was sent events twice: {twice[:5]}")
        finally:
            host.close()
            for peer in peers:
                peer.close()
            for b in boards:
                disconnect(b.client)
            counter.close()
            for proc in s.procs.values():
                proc.stop()
    return ConfigResult(label, bridges, steps, deltas, settle_s)


def rates(args: argparse.Namespace) -> list[int]:
    out, r = [], float(args.start_rate)
    while r <= args.max_rate:
        out.append(round(r))
        r *= 2
    return out


# --------------------------------------------------------------------------- figure 3


@dataclass
class Kill:
    victim: str
    devices: int  # the victim's devices (one a partition), each asked right after the kill
    taken_s: float  # until the database shows the survivor holding every partition
    served_s: float  # until every one of those requests had its run.done
    repeats: int  # requests a board was given more than once, runs answered twice


def failover(work: Path, pg: PgServer, args: argparse.Namespace) -> tuple[list[Kill], float, float]:
    round_s, lease_s = (QUICK_ROUND_S, QUICK_LEASE_S) if args.quick else (ROUND_S, LEASE_S)
    parts = args.partitions
    devices = devices_across(parts, 1)
    kills: list[Kill] = []
    with setup(work, pg, 0, devices) as s:
        names = ("fleet-a", "fleet-b")
        progress(
            f"figure 3: two bridges, round {round_s} s, lease {lease_s} s, {parts} "
            f"partitions, {len(devices)} board peers ..."
        )
        for name in names:
            s.start_bridge(name, True, round_s, lease_s, parts)
        host = TimingHost(s.broker, s.token)
        peers = {d: BoardPeer(s.broker, d) for d in devices}
        try:
            wait_for(
                lambda: len(shares(s.dsn)) == 2 and sum(shares(s.dsn)) == parts,
                SETTLE_S + parts * round_s,
                "both bridges holding partitions",
                0.2,
            )
            time.sleep(1.0)
            for k in range(args.kills):
                own = owners(s.dsn)
                held = Counter(own.values())
                if len(own) != parts or len(held) != 2:
                    raise BenchError(f"kill {k + 1}: partitions held {dict(held)} of {parts}")
                victim = held.most_common(1)[0][0]
                survivor = next(n for n in names if n != victim)
                mine = [d for d in devices if own[partition_of(d, parts)] == victim]
                proc = s.procs[victim]
                killed_at = time.monotonic()
                proc.proc.send_signal(signal.SIGKILL)
                proc.proc.wait(10)
                reqs = [host.ask(d) for d in mine]
                bound = lease_s + round_s + RUN_WAIT_S
                whole = {survivor: parts}
                taken = wait_for(
                    lambda whole=whole: Counter(owners(s.dsn).values()) == whole,
                    bound,
                    f"kill {k + 1}: {survivor} holding every partition",
                    0.02,
                )
                wait_for(
                    lambda reqs=reqs: all(host.done(r) for r in reqs),
                    bound,
                    f"kill {k + 1}: {len(reqs)} requests answered",
                    0.01,
                )
                served = max(host.ended_at[r] for r in reqs) - killed_at
                repeats = sum(n - 1 for p in peers.values() for n in p.reqs.values() if n > 1)
                repeats += sum(n - 1 for p in peers.values() for n in p.finals.values() if n > 1)
                kills.append(Kill(victim, len(mine), taken, served, repeats))
                progress(
                    f"  kill {k + 1}: {victim} ({len(mine)} devices): all held by "
                    f"{survivor} {taken:.2f} s after, all answered {served:.2f} s after"
                )
                s.start_bridge(victim, True, round_s, lease_s, parts)
                # The next kill takes the other: once this one holds a partition again.
                wait_for(
                    lambda v=victim: v in owners(s.dsn).values(),
                    SETTLE_S,
                    f"{victim} holding a partition again",
                    0.1,
                )
                time.sleep(round_s)
            twice = host.twice()
            if twice:
                raise BenchError(f"failover: the host was sent events twice: {twice[:5]}")
        finally:
            host.close()
            for peer in peers.values():
                peer.close()
    return kills, round_s, lease_s


# --------------------------------------------------------------------------- report


def print_load(results: list[ConfigResult], args: argparse.Namespace) -> None:
    base = results[0]
    base_best = highest_lossless(base.steps)
    print(
        f"\nfigure 1: highest lossless events/s from {args.boards} simulated boards "
        f"(runs of 50 events, QoS 1; rates doubling from {args.start_rate}/s, "
        f"{args.step_s:g} s a step), CPU per event summed over the bridge processes "
        "at that rate; ratios to the single bridge"
    )
    print(
        f"{'configuration':26} {'lossless/s':>10} {'ratio':>6} {'delivered/s':>11} "
        f"{'CPU us/evt':>10} {'ratio':>6} {'lost':>5} {'repeats':>7} {'settled':>8}"
    )
    for r in results:
        best = highest_lossless(r.steps)
        lost = sum(st.silent + st.reported for st in r.steps)
        repeats = sum(st.repeats for st in r.steps)
        if best is None:
            print(f"{r.label:26} {'none':>10}  (lossy from the first step)")
            continue
        ratio = best.asked / base_best.asked if base_best else float("nan")
        cpu_ratio = (
            best.cpu_us_per_event / base_best.cpu_us_per_event if base_best else float("nan")
        )
        settled = f"{r.settle_s:.1f} s" if r.bridges else "-"
        print(
            f"{r.label:26} {best.asked:10d} {ratio:6.2f} {best.delivered_per_s:11.0f} "
            f"{best.cpu_us_per_event:10.0f} {cpu_ratio:6.2f} {lost:5d} {repeats:7d} "
            f"{settled:>8}"
        )
    print("  CPU per event at every rate step (us, summed over bridges):")
    for r in results:
        row = ", ".join(
            f"{st.asked}/s {st.cpu_us_per_event:.0f}" + ("" if st.lossless else " (lossy)")
            for st in r.steps
        )
        print(f"    {r.label:26} {row}")
    print(
        "  (lost: ids that never reached the host, past the highest lossless step too; "
        "repeats: ids it was sent twice, which hosts drop by (run, id); settled: start "
        "until the shares were even)"
    )
    print(
        f"\nfigure 2: request -> first msg.delta at the host (ms), {args.latency_runs} "
        f"requests over {LATENCY_DEVICES} board peers, before figure 1's load"
    )
    print(f"{'configuration':26} {'min':>7} {'p50':>7} {'p99':>7} {'max':>7} {'p50 ratio':>9}")
    b50 = pct(base.deltas_ms, 0.5)
    for r in results:
        xs = r.deltas_ms
        print(
            f"{r.label:26} {min(xs):7.2f} {pct(xs, 0.5):7.2f} {pct(xs, 0.99):7.2f} "
            f"{max(xs):7.2f} {pct(xs, 0.5) / b50:9.2f}"
        )


def print_failover(kills: list[Kill], round_s: float, lease_s: float, parts: int) -> None:
    served = [k.served_s for k in kills]
    taken = [k.taken_s for k in kills]
    print(
        f"\nfigure 3: failover, 2 fleet bridges (round {round_s:g} s, lease {lease_s:g} s, "
        f"{parts} partitions, a board peer in each), {len(kills)} kills (kill -9 of the "
        "bridge holding most partitions, started again after)"
    )
    print(f"{'':44} {'p50':>7} {'max':>7} {'min':>7}")
    print(
        f"{'kill -> every partition held by the survivor':44} {pct(taken, 0.5):7.2f} "
        f"{max(taken):7.2f} {min(taken):7.2f}  s"
    )
    print(
        f"{'kill -> every device of the killed answered':44} {pct(served, 0.5):7.2f} "
        f"{max(served):7.2f} {min(served):7.2f}  s"
    )
    bound = lease_s + round_s
    print(
        f"  the design's bound: lease + round = {bound:g} s; served max / bound "
        f"{max(served) / bound:.2f}; devices a kill: "
        f"{', '.join(str(k.devices) for k in kills)}; requests or answers given twice: "
        f"{sum(k.repeats for k in kills)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10, help="figure 3 (default 10)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run: 3 kills (unless --kills), round {QUICK_ROUND_S} s and lease "
        f"{QUICK_LEASE_S} s everywhere, 10 requests, two short rate steps",
    )
    parser.add_argument("--boards", type=int, default=10, help="figure 1 (default 10)")
    parser.add_argument("--latency-runs", type=int, default=50, help="figure 2 (default 50)")
    parser.add_argument("--step-s", type=float, default=2.0, help="figure 1 step (default 2)")
    parser.add_argument("--start-rate", type=int, default=500, help="figure 1 (default 500/s)")
    parser.add_argument("--max-rate", type=int, default=16000, help="figure 1 (default 16000/s)")
    parser.add_argument(
        "--partitions",
        type=int,
        default=DEFAULT_PARTITIONS,
        help=f"the fleet's partitions (default {DEFAULT_PARTITIONS})",
    )
    parser.add_argument("--skip", default="", help="figures to skip, e.g. 1,2")
    parser.add_argument("--workdir", type=Path, help="keep logs and configs here")
    args = parser.parse_args()
    if args.quick:
        if "--kills" not in sys.argv:
            args.kills = 3
        args.latency_runs = min(args.latency_runs, 10)
        args.step_s = min(args.step_s, 1.0)
        args.max_rate = min(args.max_rate, args.start_rate * 2)
    if args.kills < 1 or args.boards < 1 or args.latency_runs < 2 or args.step_s <= 0:
        parser.error("need --kills >= 1, --boards >= 1, --latency-runs >= 2, --step-s > 0")
    skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    command = "python " + " ".join(
        [Path(sys.argv[0]).as_posix().split(str(ROOT) + "/")[-1], *sys.argv[1:]]
    )
    assert PREFIX == P, (PREFIX, P)  # the peers' and the simulated boards' prefix
    started = time.monotonic()
    results: list[ConfigResult] = []
    kills: list[Kill] = []
    round_s = lease_s = 0.0
    with contextlib.ExitStack() as stack:
        if args.workdir is not None:
            work = args.workdir
            work.mkdir(parents=True, exist_ok=True)
        else:
            import tempfile

            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="wren-fleet-")))
        progress("PostgreSQL ...")
        (work / "pg").mkdir(parents=True, exist_ok=True)
        pg = start_postgres(work / "pg")
        stack.callback(pg.stop)
        if not {"1", "2"} <= skip:
            for label, n in CONFIGS:
                results.append(measure_config(label, n, work / f"config{n}", pg, args))
        if "3" not in skip:
            kills, round_s, lease_s = failover(work / "failover", pg, args)
    print(f"command: {command}")
    print(
        f"machine: {os.cpu_count()} cores on loopback, shared by Mosquitto, PostgreSQL, the "
        "bridges, the host counter and the load generator (this process)"
    )
    if results:
        print_load(results, args)
    if kills:
        print_failover(kills, round_s, lease_s, args.partitions)
    print(f"\n(total {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    try:
        main()
    except (BenchError, BrokerError, PgMissing) as e:
        sys.exit(f"bench_fleet: {e}")
