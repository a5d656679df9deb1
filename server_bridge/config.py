"""Configuration of one bridge process."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from server_bridge.topics import DEFAULT_PREFIX
from server_bridge.wire import Limits

__all__ = ["BridgeConfig"]


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


@dataclass
class BridgeConfig:
    """Everything a Bridge needs besides its registry and model provider.

    Credentials default from WREN_BRIDGE_USER / WREN_BRIDGE_PASSWORD so they stay out of
    command lines and config files.
    """

    host: str = "127.0.0.1"
    port: int = 1883
    username: str | None = field(default_factory=lambda: _env("WREN_BRIDGE_USER"))
    password: str | None = field(default_factory=lambda: _env("WREN_BRIDGE_PASSWORD"))
    prefix: str = DEFAULT_PREFIX
    # Unique per process by default: two bridges with one client id would keep kicking
    # each other off the broker.
    client_id: str = field(default_factory=lambda: f"wren-bridge-{uuid.uuid4().hex[:12]}")
    keepalive_s: int = 30
    registry_path: Path = Path("wren-registry.json")
    limits: Limits = field(default_factory=Limits)
    # Bounded waits: connecting (start() raises past it), an llm.complete call, and any
    # other RPC method (answered with an error past it; the board has its own timeout).
    connect_timeout_s: float = 10.0
    llm_timeout_s: float = 120.0
    rpc_timeout_s: float = 30.0
    # RPC work runs on a pool so paho's network thread never waits on a model; calls
    # beyond max in flight are answered `busy` instead of queueing without bound.
    rpc_workers: int = 8
    rpc_max_inflight: int = 64
    # Several bridge processes share P/d/+/rpc and P/d/+/evt through $share/bridge/...
    shared_subscription: bool = False
    # Event intake: events kept per run for hosts, out-of-order events held per run,
    # runs tracked at once, and the replay request retry.
    events_per_run: int = 256
    hold_per_run: int = 64
    max_runs: int = 1024
    replay_retry_s: float = 2.0
    replay_max_attempts: int = 3
    # Recent refusals kept for diagnostics.
    refusals_kept: int = 100

    def __post_init__(self) -> None:
        self.registry_path = Path(self.registry_path)
        if not self.prefix or any(ch in self.prefix for ch in "+#") or self.prefix.endswith("/"):
            raise ValueError(f"bad topic prefix {self.prefix!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"bad broker port {self.port}")
        for name in ("connect_timeout_s", "llm_timeout_s", "rpc_timeout_s", "replay_retry_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        for name in (
            "rpc_workers",
            "rpc_max_inflight",
            "events_per_run",
            "hold_per_run",
            "max_runs",
            "replay_max_attempts",
            "refusals_kept",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
