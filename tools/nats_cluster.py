"""A NATS cluster that speaks MQTT 3.1.1, for the tests of issue "Past one machine"
(DESIGN "Where scale goes"): `nodes` nats-server processes on free loopback ports, each
with JetStream (where NATS keeps MQTT sessions, queued QoS 1 messages and retained
messages, replicated across the cluster) and an MQTT listener, joined by cluster
routes, with users and their rights in the config, as Mosquitto's ACL gives them in
the single-broker layout (PROTOCOL.md "Topics").

NATS maps an MQTT topic to a subject level by level (`/` becomes `.`, `+` is `*`, `#`
is `>`), so the rights below are written in subjects. A QoS 1 subscription of a
client also needs `$MQTT.sub.>` (where NATS keeps it). NATS 2.9 drops a client that
publishes at QoS 2 and refuses MQTT 5 connections: Wren uses neither. Measured on
this machine: `docs/research/broker-clusters.md`.

    cluster = start_nats_cluster(workdir, [bridge_user("b", pw), device_user(...)])
    cluster.mqtt_ports  # one per node
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from edge_runtime import mqttopen
from tools.broker import BrokerError, free_port
from tools.owned_process import die_with_owner, stop_process

__all__ = [
    "NatsCluster",
    "NatsMissing",
    "NatsUser",
    "bridge_user",
    "device_user",
    "host_user",
    "nats_binary",
    "start_nats_cluster",
    "subject",
]

# A cluster's JetStream needs a meta leader before the first MQTT CONNECT, or that
# connect stalls on a JetStream request for seconds; three nodes elect one in 1-3 s, and
# in up to half a minute on a loaded 2-core machine running two clusters at once.
READY_TIMEOUT_S = 60.0


class NatsMissing(BrokerError):
    """No nats-server binary: the message says how to install one."""


def nats_binary() -> str | None:
    found = shutil.which("nats-server")
    if found is None and Path("/usr/sbin/nats-server").is_file():
        found = "/usr/sbin/nats-server"
    return found


def subject(topic: str) -> str:
    """The NATS subject of an MQTT topic or filter: `wren/v1/d/+/evt` -> `wren.v1.d.*.evt`."""
    levels = []
    for level in topic.split("/"):
        levels.append("*" if level == "+" else ">" if level == "#" else level)
    return ".".join(levels)


@dataclass(frozen=True)
class NatsUser:
    """A user of the cluster and the subjects it may publish and subscribe to (None: all)."""

    name: str
    password: str
    publish: tuple[str, ...] | None = None
    subscribe: tuple[str, ...] | None = None
    deny_publish: tuple[str, ...] = ()

    def config(self) -> dict[str, object]:
        entry: dict[str, object] = {"user": self.name, "password": self.password}
        rights: dict[str, object] = {}
        if self.publish is not None:
            rights["publish"] = {"allow": list(self.publish), "deny": list(self.deny_publish)}
        if self.subscribe is not None:
            # Where NATS keeps a client's QoS 1 subscriptions.
            rights["subscribe"] = list(self.subscribe) + ["$MQTT.sub.>"]
        if rights:
            entry["permissions"] = rights
        return entry


def bridge_user(name: str, password: str) -> NatsUser:
    """A bridge's user: all of the prefix, as in Mosquitto's ACL."""
    return NatsUser(name, password)


def device_user(prefix: str, device: str, password: str) -> NatsUser:
    """A device's user: its own subtree, reading and writing, but never what only the
    bridge sends it (`req`, `ctl`, `rpc/res`), and the bridge's presence."""
    own = subject(f"{prefix}/d/{device}/#")
    return NatsUser(
        device,
        password,
        publish=(own,),
        subscribe=(own, subject(f"{prefix}/b/status")),
        deny_publish=tuple(
            subject(f"{prefix}/d/{device}/{leaf}") for leaf in ("req", "ctl", "rpc/res")
        ),
    )


def host_user(prefix: str, tenant: str, name: str, password: str) -> NatsUser:
    """A watching host user of a tenant (PROTOCOL.md "Who sees what"): its devices' and
    every user's event topics, its requests and controls, and the bridge's presence: the
    fleet's (`P/b/status`) and, in fleet mode, each bridge's own (`P/b/<bridge>/status`,
    its last will; DESIGN "Bridge presence")."""
    return NatsUser(
        name,
        password,
        publish=(subject(f"{prefix}/h/{tenant}/+/req"), subject(f"{prefix}/h/{tenant}/+/ctl")),
        subscribe=(
            subject(f"{prefix}/h/{tenant}/+/evt"),
            subject(f"{prefix}/h/{tenant}/+/u/+/evt"),
            subject(f"{prefix}/b/status"),
            subject(f"{prefix}/b/+/status"),
        ),
    )


@dataclass
class NatsNode:
    name: str
    mqtt_port: int
    http_port: int
    route_port: int
    conf: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, exe: str) -> None:
        self.proc = subprocess.Popen(
            [exe, "-c", str(self.conf), "-l", str(self.log)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_owner(),
        )

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        stop_process(self.proc, 10.0)


@dataclass
class NatsCluster:
    host: str
    nodes: list[NatsNode] = field(default_factory=list)

    @property
    def mqtt_ports(self) -> list[int]:
        return [n.mqtt_port for n in self.nodes]

    def log(self, i: int) -> str:
        try:
            return self.nodes[i].log.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> NatsCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _config(node: NatsNode, routes: list[int], workdir: Path, users: list[NatsUser]) -> str:
    # NATS reads JSON as its config syntax, so the users' rights need no quoting of ours.
    doc = {
        "server_name": node.name,
        "listen": f"127.0.0.1:{free_port()}",
        "http": f"127.0.0.1:{node.http_port}",
        "jetstream": {"store_dir": str(workdir / node.name / "js")},
        "cluster": {
            "name": "wren",
            "listen": f"127.0.0.1:{node.route_port}",
            "routes": [f"nats-route://127.0.0.1:{p}" for p in routes],
        },
        "mqtt": {"listen": f"127.0.0.1:{node.mqtt_port}"},
        "authorization": {"users": [u.config() for u in users]},
    }
    return json.dumps(doc, indent=1)


def _http_ok(port: int, path: str, needle: str = "") -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1) as r:
            return needle in r.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _mqtt_accepts(port: int, user: NatsUser) -> bool:
    # A CONNECT (the board's own encoder) answered by CONNACK 0.
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(mqttopen.encode_connect("wren-probe", True, 30, user.name, user.password))
            s.settimeout(5)
            ack = s.recv(4)
            return len(ack) == 4 and ack[0] == 0x20 and ack[3] == 0
    except OSError:
        return False


def start_nats_cluster(
    workdir: Path, users: list[NatsUser], nodes: int = 3, timeout_s: float = READY_TIMEOUT_S
) -> NatsCluster:
    """Start `nodes` nodes and wait until each serves MQTT to `users[0]`."""
    exe = nats_binary()
    if exe is None:
        raise NatsMissing("nats-server not found: apt-get install nats-server")
    if not users:
        raise ValueError("a cluster needs at least one user (the first is the readiness probe's)")
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = NatsCluster("127.0.0.1")
    for i in range(nodes):
        name = f"n{i + 1}"
        (workdir / name).mkdir(exist_ok=True)
        cluster.nodes.append(
            NatsNode(name, free_port(), free_port(), free_port(),
                     workdir / name / "nats.conf", workdir / name / "nats.log")  # fmt: skip
        )
    routes = [n.route_port for n in cluster.nodes]
    for node in cluster.nodes:
        node.conf.write_text(_config(node, routes, workdir, users))
        node.start(exe)
    deadline = time.monotonic() + timeout_s
    try:
        for node in cluster.nodes:
            # Healthy with JetStream, a meta leader elected, then MQTT served.
            while not (
                _http_ok(node.http_port, "/healthz?js-enabled-only=true")
                and _http_ok(node.http_port, "/jsz", '"leader"')
                and _mqtt_accepts(node.mqtt_port, users[0])
            ):
                if node.proc is not None and node.proc.poll() is not None:
                    raise BrokerError(f"nats-server {node.name} exited:\n{node.log.read_text()}")
                if time.monotonic() > deadline:
                    raise BrokerError(f"the NATS cluster was not ready within {timeout_s:.0f}s")
                time.sleep(0.1)
    except BaseException:
        cluster.stop()
        raise
    return cluster
