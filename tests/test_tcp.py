"""Nagle is off on every socket of Wren's path (server_bridge/tcp.py says why): the
bridge's and a host's MQTT connections, the board's link (on CPython and on the unix
port) and the Mosquitto config Wren writes."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

from server_bridge.bridge import Bridge
from server_bridge.config import BridgeConfig
from server_bridge.host.client import HostClient
from server_bridge.models.scripted import DEMO_SCRIPT, ScriptedProvider
from server_bridge.registry import Registry
from tools.broker import MosquittoProcess, start_mosquitto


def _nodelay(sock: object) -> int:
    # The bridge's and hosts' clients read through mqttclient._BufferedSocket, which
    # holds the TCP socket the option is on.
    tcp = getattr(sock, "_sock", sock)
    assert isinstance(tcp, socket.socket), sock
    return tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_the_bridge_and_a_host_connect_with_nagle_off(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    cfg = BridgeConfig(
        host=broker.host,
        port=broker.port,
        username=None,
        password=None,
        prefix=f"wren-tcp-{tag}/v1",
        client_id=f"wren-bridge-{tag}",
    )
    bridge = Bridge(cfg, Registry(tmp_path / "registry.json"), ScriptedProvider(DEMO_SCRIPT))
    bridge.start()
    host = HostClient(broker.host, broker.port, "acme", prefix=cfg.prefix)
    try:
        host.connect(timeout=10)
        # Both of the bridge's connections: the control one and the event one.
        assert bridge._client is not None and bridge._events is not None
        assert _nodelay(bridge._client.socket()) != 0
        assert _nodelay(bridge._events.socket()) != 0
        assert _nodelay(host._client.socket()) != 0
    finally:
        host.close()
        bridge.stop()


def test_wrens_broker_config_turns_nagle_off_unless_told_otherwise(tmp_path: Path) -> None:
    shipped = start_mosquitto(tmp_path / "shipped")
    try:
        conf = (shipped.workdir / "mosquitto.conf").read_text().splitlines()
        assert conf.count("set_tcp_nodelay true") == 1
    finally:
        shipped.stop()
    # A benchmark's baseline may turn it back on; the caller's line is the only one.
    nagle = start_mosquitto(tmp_path / "nagle", extra_conf="set_tcp_nodelay false\n")
    try:
        conf = (nagle.workdir / "mosquitto.conf").read_text().splitlines()
        assert [line for line in conf if line.startswith("set_tcp_nodelay")] == [
            "set_tcp_nodelay false"
        ]
    finally:
        nagle.stop()
