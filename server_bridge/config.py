"""Configuration of one bridge process."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field

from server_bridge.brokerconf import CONTROL_SUFFIX, LINK_SUFFIX, LINKS, control_user, link_user
from server_bridge.fleet.leases import LEASE_S, ROUND_S
from server_bridge.fleet.partitions import (
    DEFAULT_PARTITIONS,
    check_partitions,
    partition_client_id,
)
from server_bridge.tls import BrokerTLS
from server_bridge.topics import DEFAULT_PREFIX, is_id
from server_bridge.wire import Limits

__all__ = ["DEFAULT_CLIENT_ID", "EVERY_TENANT", "BridgeConfig"]

# The bridge's client id when it has no MQTT user to take it from.
DEFAULT_CLIENT_ID = "wren-bridge"
# `json_mirror`'s word for every tenant (no tenant id can be it: `*` is not in the
# alphabet).
EVERY_TENANT = "*"


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
    # Stable, because the bridge's MQTT session is persistent (clean session off): what
    # boards send while the bridge is away waits at the broker under this id, and a
    # restarted bridge with the same id receives it. A second bridge process on the same
    # broker needs an id of its own: two with one id keep kicking each other off the
    # broker (and would share one session's queue). None (the default) follows the
    # user: a broker configured by server_bridge/brokerconf.py uses the user name as
    # the client id whatever the client sends (so a second process needs a user of its
    # own there), and the id the bridge gives itself then matches the session it has;
    # without a user, DEFAULT_CLIENT_ID.
    client_id: str | None = None
    # The control connection's login and client id (bridge.py: RPC calls and host
    # requests on a connection of their own, never queued behind a flood of events).
    # None follows the bridge's user: its control user, `<user>.ctl`, with the same
    # password (brokerconf.py); without a user, the client id and `.ctl`.
    control_username: str | None = None
    control_password: str | None = None
    control_client_id: str | None = None
    # How many connections read the boards (server_bridge/links.py): tenants are dealt
    # to them in turn, so up to this many tenants each have a queue of their own at the
    # broker and never wait behind another's flood. 1 is the one-link layout: the event
    # connection reads every board's evt, hello and status by wildcard, and the control
    # connection every board's rpc (a device missing from the registry is then refused
    # `unknown_device`; with links it is not read at all). Link i >= 1 logs in as the
    # bridge user's link user `<user>.l<i>`, same password (brokerconf.link_user).
    tenant_links: int = LINKS
    # What one model call may carry, in characters (`--model-context-chars`): the
    # operator's word for the model's context window. Knowledge passages added before a
    # call (an agent's `before` rule) get what the board's messages and the tools leave
    # (knowledge/augment.py). 32,000 characters is about 8,000 tokens, the smallest
    # context of the local models people run.
    model_context_chars: int = 32_000
    keepalive_s: int = 30
    # The durable event log's retention per tenant (server_bridge/eventlog; `wren bridge
    # --event-log-days`, `--event-log-mib`): whole segments older than this, and the
    # oldest past this many bytes, are dropped (checked each minute). 30 days and
    # 1 GiB: at 159 bytes an event (bench_eventlog), 6.7 million events a tenant.
    event_log_max_age_s: float = 30 * 86400.0
    event_log_max_bytes: int = 1 << 30
    # A conversation's earlier turns in a follow-up's model calls (conversations/:
    # `--history-turns`, `--history-chars`): at most this many earlier runs and
    # characters, within what the model's context leaves. 0 turns: none.
    history_turns: int = 8
    history_chars: int = 8000
    # What the bridge accepts from boards and hosts. What it sends a board is sized by the
    # limits that board announced in its hello.
    limits: Limits = field(default_factory=Limits)
    # Bounded waits: connecting (start() raises past it), an llm.complete call, and any
    # other RPC method (answered with an error past it; the board has its own timeout).
    # llm_timeout_s is a model call's overall limit (`--model-timeout`; PROTOCOL.md
    # "Model calls"): generous, since a slow model is held to the idle timeout between
    # the pieces of its stream instead (models/openai.py IDLE_TIMEOUT_S,
    # `--model-idle-timeout`). A local model at 3 tokens a second writes 1,024 tokens in
    # under 6 minutes; 120 s cut it off and called that retryable (issue 25).
    connect_timeout_s: float = 10.0
    llm_timeout_s: float = 600.0
    rpc_timeout_s: float = 30.0
    # The most tokens one model call may answer with (`--max-tokens`), and what a call
    # gets when the board's agent names none (Agent max_tokens): a board's larger ask is
    # cut to it, so every model call is bounded by the bridge, not by the board or only
    # by a server's own cap (PROTOCOL.md "Model calls").
    llm_max_tokens: int = 1024
    # RPC work runs on a pool so paho's network thread never waits on a model; calls
    # beyond max in flight — in total, or of one device — are answered `busy` instead of
    # queueing without bound. The per-device cap keeps one device from taking the room
    # every other tenant's calls need.
    rpc_workers: int = 8
    rpc_max_inflight: int = 64
    rpc_max_inflight_per_device: int = 4
    # A provider's tiny text and reasoning chunks are merged before they go to a board:
    # held until the board's `chunk` bytes are pending or the oldest has waited this
    # long (PROTOCOL.md "RPC", merge_ms). Fewer, fuller messages for the board to read;
    # the wait is what a reader of a live stream does not notice.
    rpc_merge_s: float = 0.05
    # Several bridge processes share P/d/+/rpc through $share/bridge/...: an RPC call is
    # answered by whichever process gets it. Events are not shared: each process tracks
    # the ids of every run to find gaps, and events of one run spread over processes
    # would look like holes to each of them. hello and status are not shared either (each
    # process keeps its own presence table and the limits RPC answers are sized by).
    shared_subscription: bool = False
    # Event intake: events kept per run for hosts, out-of-order events held per run,
    # runs tracked at once (in total and per device: a device over its own cap forgets
    # its own oldest runs, never another device's), and the replay request retry: asked
    # at once, again after replay_retry_s, then with the wait doubling up to
    # replay_retry_max_s, for as long as an id below the highest seen is missing.
    events_per_run: int = 256
    # The replay windows of every run together, in bytes (each event its encoded length
    # plus 128 of bookkeeping): past it the oldest events are evicted, finished runs'
    # first, then the largest windows' (intake.py), and a host's replay of them is
    # answered `gap`. Without it the windows grow with the fleet: 16 runs of 256 legal
    # 16 KiB events pin 65 MiB of one device as decoded text, 520 MiB as small maps.
    # 64 MiB keeps every window whole for typical traffic (max_runs 1024 runs of 256
    # 64-character text deltas, 116 bytes each, is 61 MiB) and holds ~4,000 events at
    # the size limit. With memory_budget_bytes it bounds the events the bridge keeps.
    window_bytes: int = 64 << 20
    # Every device's last hello, as the bytes it came in, in all: past it the least
    # recently announced are let go (their limits stay; bridge.hello() reads None). A
    # board's hello with its tools is 1-2 KiB; 16 MiB keeps ~10,000 of them, or 1,000 at
    # the 16 KiB size limit.
    hello_bytes: int = 16 << 20
    hold_per_run: int = 64
    max_runs: int = 1024
    max_runs_per_device: int = 16
    replay_retry_s: float = 2.0
    replay_retry_max_s: float = 30.0
    # How long a device's offline status must stand before its open runs are ended: a
    # broker shutting down sends every client's will, so an offline status alone may be
    # a board that is back a moment later with its session and its runs (0: at once).
    offline_grace_s: float = 5.0
    # Run liveness (PROTOCOL.md "Runs that end without their board"): an open run of an
    # online device that has sent nothing for run_probe_s is asked for what follows its
    # last id (a replay); the board resends what the bridge lacks (the lost end of the
    # run) or answers that it no longer holds the run, and the bridge ends it. Asked
    # again with the wait doubling up to run_probe_max_s while the run stays quiet: a
    # run may be quiet for long (a slow model, a pause for an answer), and each probe
    # is one small message. 10 s: a lost end shows at hosts within about 10 s; a
    # model's silence of that length is common, and costs a probe the board ignores.
    run_probe_s: float = 10.0
    run_probe_max_s: float = 60.0
    # Recent refusals kept for diagnostics.
    refusals_kept: int = 100
    # What the bridge sends goes through lanes (lanes.py) and a forwarder that hands
    # paho at most max_inflight_messages QoS 1 messages the broker has not acknowledged;
    # paho puts them all on the wire at once (its default is 20). 64: an unpaced burst
    # from 10 boards (2,000 events each, loopback, 2 cores) went through whole at 5.2k
    # events/s with 20, 6.0k with 64, 5.2k with 256 and 4.2k with 1024; over a link with
    # a round trip of r the window allows 64/r messages a second (64k/s at 1 ms), and a
    # host request waits behind at most this many messages already handed to paho.
    # paho's own bound on what it keeps (max_queued_messages) is the safety net above
    # it, for the few publishes made outside the lanes (the presence at a stop).
    max_inflight_messages: int = 64
    max_queued_messages: int = 1000
    # The memory bound for events in the bridge: queued in the lanes plus held past a
    # hole, in bytes, across every tenant. An event that finds it spent is not taken
    # (deferred, `evt.deferred.budget`): its board sends it again on the intake's
    # replay request once there is room. Per device and per tenant the lanes take at
    # most device_queue_bytes and tenant_queue_bytes (`evt.deferred.device`,
    # `evt.deferred.tenant`), so one device's flood slows itself, then its tenant, and
    # the budget is what many busy tenants share. 64 MiB holds ~4,000 full 16 KiB
    # events, or ~0.5 M typical 64-byte text deltas; 1 MiB per device is 64 full
    # events, more than a board's ring (16) resends at once.
    memory_budget_bytes: int = 64 << 20
    device_queue_bytes: int = 1 << 20
    tenant_queue_bytes: int = 16 << 20
    # Host requests (req and ctl, replay included) of one tenant: at most host_rate a
    # second, in bursts of host_burst (past it: `rate_limited`), and at most host_lane
    # waiting to go out (past it: `busy`); both told to the tenant's hosts on `_b`.
    host_rate: float = 50.0
    host_burst: int = 100
    host_lane: int = 64
    # Messages of the bridge's own to boards waiting to go out (RPC answers, replay and
    # cancel requests) past which an RPC worker waits before queueing more.
    board_lane: int = 1024
    # The tenants whose runs, device presence and status the bridge also publishes as
    # JSON under their host topics (server_bridge/mirror/, `wren bridge --json-mirror`):
    # tenant ids, or EVERY_TENANT ("*") for all. Empty, the default: no mirror.
    json_mirror: frozenset[str] = frozenset()
    # TLS to the broker (server_bridge/tls.py: a CA, a client certificate and key), on
    # every connection of the process; None: plain TCP.
    tls: BrokerTLS | None = None
    # Fleet mode (`--fleet-dsn`, DESIGN "Where scale goes"): several bridge processes
    # share the prefix, each device served by the one that holds its partition's lease
    # in this PostgreSQL database. None (the default): one process per prefix. The
    # partition count is the fleet's, fixed for its life (a bridge started with another
    # is refused); round and lease are the lease keeper's (server_bridge/fleet/leases.py:
    # renew every round, a killed bridge's partitions taken within lease + round).
    fleet_dsn: str | None = None
    partitions: int = DEFAULT_PARTITIONS
    fleet_round_s: float = ROUND_S
    fleet_lease_s: float = LEASE_S

    @property
    def fleet(self) -> bool:
        """Whether this bridge is one of a fleet (fleet_dsn set)."""
        return self.fleet_dsn is not None

    @property
    def fleet_user(self) -> str:
        """The name the fleet's partition sessions are called by: the bridge user every
        bridge of the fleet logs its partitions in as, else DEFAULT_CLIENT_ID."""
        return self.username or DEFAULT_CLIENT_ID

    def partition_login(self, part: int) -> tuple[str, str | None, str | None]:
        """Client id, user and password of partition `part`'s connection: the same in
        every bridge of the fleet, so the next owner takes the session over."""
        return partition_client_id(self.fleet_user, part), self.username, self.password

    def link_login(self, link: int) -> tuple[str, str | None, str | None]:
        """Client id, user and password of link `link` (0 is the event connection's:
        `client_id`, `username`, `password`)."""
        assert self.client_id is not None
        if link == 0:
            return self.client_id, self.username, self.password
        if self.username is None:
            return f"{self.client_id}{LINK_SUFFIX}{link}", None, self.password
        user = link_user(self.username, link)
        return user, user, self.password

    def __post_init__(self) -> None:
        if not self.prefix or any(ch in self.prefix for ch in "+#") or self.prefix.endswith("/"):
            raise ValueError(f"bad topic prefix {self.prefix!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"bad broker port {self.port}")
        if self.fleet and self.client_id is None:
            # Each bridge of a fleet is one process among several of one user: its own
            # connections need ids of their own (they hold no session anyone needs:
            # bridge.py, fleet mode), and its last will a topic level of its own.
            self.client_id = f"{self.fleet_user}-{uuid.uuid4().hex[:8]}"
        if self.client_id is None:
            self.client_id = self.username or DEFAULT_CLIENT_ID
        if not isinstance(self.client_id, str) or not self.client_id:
            # A persistent session needs an id of its own (MQTT 3.1.1 refuses an empty one).
            raise ValueError("client_id must be a non-empty str")
        if self.control_username is None and self.username is not None:
            self.control_username = control_user(self.username)
        if self.control_password is None:
            self.control_password = self.password
        if self.control_client_id is None:
            # In a fleet the control user is every bridge's: the id follows the process.
            self.control_client_id = (
                self.client_id + CONTROL_SUFFIX
                if self.fleet
                else self.control_username or self.client_id + CONTROL_SUFFIX
            )
        if self.control_client_id == self.client_id:
            # One id for both connections: each would take the other's over, for ever.
            raise ValueError("control_client_id must differ from client_id")
        if not 1 <= self.tenant_links <= LINKS:
            raise ValueError(f"tenant_links must be 1..{LINKS}")
        for name in ("connect_timeout_s", "llm_timeout_s", "rpc_timeout_s", "replay_retry_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.llm_max_tokens < 1:
            raise ValueError("llm_max_tokens must be >= 1")
        if self.rpc_merge_s < 0:
            raise ValueError("rpc_merge_s must be >= 0")
        if self.offline_grace_s < 0:
            raise ValueError("offline_grace_s must be >= 0")
        if self.replay_retry_max_s < self.replay_retry_s:
            raise ValueError("replay_retry_max_s must be >= replay_retry_s")
        if self.run_probe_s <= 0 or self.run_probe_max_s < self.run_probe_s:
            raise ValueError("run_probe_s must be > 0 and run_probe_max_s >= run_probe_s")
        for name in (
            "rpc_workers",
            "rpc_max_inflight",
            "rpc_max_inflight_per_device",
            "events_per_run",
            "window_bytes",
            "hello_bytes",
            "hold_per_run",
            "max_runs",
            "max_runs_per_device",
            "refusals_kept",
            "max_queued_messages",
            "max_inflight_messages",
            "memory_budget_bytes",
            "device_queue_bytes",
            "tenant_queue_bytes",
            "host_burst",
            "host_lane",
            "board_lane",
            "model_context_chars",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.host_rate <= 0:
            raise ValueError("host_rate must be > 0")
        self.json_mirror = frozenset(self.json_mirror)
        for tenant in self.json_mirror:
            if tenant != EVERY_TENANT and not is_id(tenant):
                raise ValueError(f"json_mirror: {tenant!r} is neither a tenant id nor '*'")
        if self.fleet:
            check_partitions(self.partitions)
            if not 0 < self.fleet_round_s < self.fleet_lease_s:
                raise ValueError("fleet_round_s must be > 0 and < fleet_lease_s")
            if self.shared_subscription:
                raise ValueError("a fleet deals devices by partition: no shared_subscription")
            if any(ch in self.client_id for ch in "/+#"):
                # It names the topic of this bridge's last will, P/b/<client id>/status.
                raise ValueError(f"a fleet bridge's client id {self.client_id!r} has / + or #")
        if self.max_queued_messages <= self.max_inflight_messages:
            # paho's bound must leave room above what the lanes hand it.
            raise ValueError("max_queued_messages must be > max_inflight_messages")
