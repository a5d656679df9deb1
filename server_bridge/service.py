"""The bridge as a service: its command line and the process that runs it.

`python -m server_bridge` is this module's `main`; `wren bridge` is the same options
(`add_arguments`) and the same loop (`run`) under the `wren` command line, which also
reuses the broker options (`add_broker_arguments`) for its other commands.

    python -m server_bridge --broker 127.0.0.1:1883 --device thermo1

The registry is provisioned at start (the tenant and each --device when missing, see
`registry.provision`), the model is the scripted demo script unless --script or
--openai-base-url names another, and the process runs until SIGTERM or Ctrl-C, either
of which stops the bridge cleanly in a second or two, model streams and all (its calls
in flight answered `bridge_stopping`, PROTOCOL.md "RPC"; it says offline at the broker)
and exits 130. With --metrics HOST:PORT it also serves the counters at
http://HOST:PORT/metrics (metrics_http.py) while it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, NoReturn, TextIO

from server_bridge.brokerconf import LINKS
from server_bridge.config import DEFAULT_CLIENT_ID, EVERY_TENANT, BridgeConfig
from server_bridge.metrics import write_text_file
from server_bridge.models.base import Provider, check_base_url
from server_bridge.models.policy import ModelPolicy, merge_allowed, parse_allow
from server_bridge.models.scripted import DEMO_SCRIPT, ScriptedProvider
from server_bridge.pgstore import describe, is_dsn, location
from server_bridge.registry import RegistryStore, provision
from server_bridge.tls import TLS_PORT, BrokerTLS, TLSConfigError
from server_bridge.topics import is_id

if TYPE_CHECKING:
    from server_bridge.bridge import Bridge
    from server_bridge.eventlog import EventStore
    from server_bridge.http.server import HttpServer
    from server_bridge.knowledge import KnowledgeBase
    from server_bridge.memory import MemoryService
    from server_bridge.metrics_http import MetricsServer

__all__ = [
    "DEFAULT_AGENT",
    "DEFAULT_BROKER",
    "STOP_EXIT_CODE",
    "ServiceError",
    "add_arguments",
    "add_broker_arguments",
    "add_tls_arguments",
    "bridge_config",
    "broker_address",
    "broker_tls",
    "build_parser",
    "main",
    "metrics_address",
    "milliseconds",
    "model_policy",
    "model_provider",
    "run",
    "setup_logging",
    "stop_on_sigterm",
]

DEFAULT_BROKER = ("127.0.0.1", 1883)
# The agent `--device DEVICE` registers when no `:AGENT` follows: the one the demo board
# runs (edge_runtime/demo.py).
DEFAULT_AGENT = "thermostat"
STOP_EXIT_CODE = 130  # what a shell reports for a process ended by Ctrl-C
# The counters' export for node_exporter's textfile collector and `--stats`: a file
# beside the registry, rewritten every few seconds (a scraper's usual interval is 15 s
# or more). --metrics serves the same text over HTTP.
DEFAULT_STATS_FILE = Path(".wren/bridge.prom")
STATS_EVERY_S = 5.0
# A model's silence past which a call fails `stalled` (--model-idle-timeout): the OpenAI
# provider's own default (models/openai.py IDLE_TIMEOUT_S), written here so that reading
# --help does not import the provider.
MODEL_IDLE_TIMEOUT_S = 60.0
# Where --metrics binds when its HOST is left out: loopback, as the counters name the
# tenants; every interface only when asked for (0.0.0.0).
METRICS_HOST = "127.0.0.1"

log = logging.getLogger("wren.service")


class ServiceError(RuntimeError):
    """The bridge could not start; the message says why (one line for the user)."""


# --- the command line ---------------------------------------------------------------------


def broker_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` as (host, port); an argparse type."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or any(c.isspace() for c in host):
        raise argparse.ArgumentTypeError(f"expected HOST:PORT such as 127.0.0.1:1883, got {text!r}")
    if not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"the port must be 1..65535, got {text!r}")
    return host, int(port)


def metrics_address(text: str) -> tuple[str, int]:
    """`[HOST]:PORT` as (host, port), METRICS_HOST when HOST is left out; port 0 is any
    free one. An IPv6 host in brackets, `[::1]:9464`. An argparse type."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not (port.isascii() and port.isdigit()) or any(c.isspace() for c in host):
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT or :PORT such as 127.0.0.1:9464, got {text!r}"
        )
    if int(port) > 65535:
        raise argparse.ArgumentTypeError(f"the port must be 0..65535, got {text!r}")
    return host or METRICS_HOST, int(port)


def model_url(text: str) -> str:
    """An OpenAI-compatible server's base URL, checked at start-up; an argparse type."""
    try:
        check_base_url(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def milliseconds(text: str) -> float:
    """A finite, non-negative number of milliseconds; an argparse type."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):  # `not >=` also refuses nan
        raise argparse.ArgumentTypeError(f"expected milliseconds >= 0, got {text!r}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def count(text: str) -> int:
    """A whole number >= 1; an argparse type."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}")
    return value


def temperature(text: str) -> float:
    """A sampling temperature, 0 to 2 as the OpenAI API takes it; an argparse type."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value <= 2:  # `not` also refuses nan
        raise argparse.ArgumentTypeError(f"expected a temperature from 0 to 2, got {text!r}")
    return value


def partition_count(text: str) -> int:
    """--partitions: a count a fleet can have (1 to MAX_PARTITIONS)."""
    from server_bridge.fleet.partitions import check_partitions

    try:
        return check_partitions(int(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def mirror_tenant(text: str) -> str:
    """A tenant id, or `*` (every tenant); an argparse type."""
    if text != EVERY_TENANT and not is_id(text):
        raise argparse.ArgumentTypeError(
            f"expected a tenant id ([a-z0-9][a-z0-9_-]*) or * for every tenant, got {text!r}"
        )
    return text


def allow_model(text: str) -> tuple[str, frozenset[str]]:
    """`[*|TENANT|TENANT/AGENT=]MODEL[,MODEL...]`; an argparse type."""
    try:
        return parse_allow(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_broker_arguments(p: argparse.ArgumentParser, user_env: str, password_env: str) -> None:
    """--broker, --user and --password, the credentials defaulting from the environment
    so they stay out of command lines (and so out of `ps`)."""
    p.add_argument("--broker", type=broker_address, metavar="HOST:PORT", help="MQTT broker to use")
    p.add_argument("--user", default=os.environ.get(user_env), help=f"MQTT user (env {user_env})")
    p.add_argument(
        "--password",
        default=os.environ.get(password_env),
        help=f"MQTT password (env {password_env})",
    )


def add_tls_arguments(p: argparse.ArgumentParser) -> None:
    """--broker-tls, --broker-ca, --broker-cert and --broker-key: TLS to the broker
    (server_bridge/tls.py; `broker_tls` reads them)."""
    p.add_argument(
        "--broker-tls",
        action="store_true",
        help="connect to the broker over TLS, checked against the system's CAs unless "
        f"--broker-ca names one (port {TLS_PORT} unless --broker says)",
    )
    p.add_argument(
        "--broker-ca",
        type=Path,
        metavar="PEM",
        help="the CA the broker's certificate is checked against (implies TLS)",
    )
    p.add_argument(
        "--broker-cert",
        type=Path,
        metavar="PEM",
        help="a client certificate, for a broker that asks for one (implies TLS)",
    )
    p.add_argument(
        "--broker-key", type=Path, metavar="PEM", help="the key of --broker-cert, if not in it"
    )


def broker_tls(args: argparse.Namespace) -> BrokerTLS | None:
    """The BrokerTLS of add_tls_arguments' options, None when none asks for TLS; a file
    that cannot be used is a ServiceError naming it."""
    if not (args.broker_tls or args.broker_ca or args.broker_cert or args.broker_key):
        return None
    try:
        return BrokerTLS(args.broker_ca, args.broker_cert, args.broker_key)
    except TLSConfigError as e:
        raise ServiceError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every option of the bridge service, on `p`."""
    add_broker_arguments(p, "WREN_BRIDGE_USER", "WREN_BRIDGE_PASSWORD")
    add_tls_arguments(p)
    p.add_argument(
        "--registry",
        type=location,
        default=Path(".wren/registry.json"),
        help="the registry file, or a PostgreSQL URL (postgresql://...) that several bridges share",
    )
    p.add_argument(
        "--memory-dir",
        type=Path,
        default=None,
        help="where durable memory is kept (default: memory/ beside --registry)",
    )
    p.add_argument(
        "--knowledge",
        type=location,
        default=None,
        metavar="PATH",
        help="the knowledge store boards reach by kb.retrieve, kb.add and kb.delete "
        "(default: knowledge.sqlite3 beside --registry when that file exists; without "
        "one those methods are unknown_method)",
    )
    p.add_argument(
        "--event-log",
        type=Path,
        default=None,
        metavar="DIR",
        help="the durable event log: every event hosts are sent, for replays after the "
        "bridge's in-memory window and its restarts (default: events/ beside --registry)",
    )
    p.add_argument(
        "--no-event-log",
        action="store_true",
        help="keep no event log: a replay reaches only as far back as the window",
    )
    p.add_argument(
        "--event-log-days",
        type=float,
        default=BridgeConfig.event_log_max_age_s / 86400,
        help="drop a tenant's logged events older than this many days (default: %(default)s)",
    )
    p.add_argument(
        "--event-log-mib",
        type=int,
        default=BridgeConfig.event_log_max_bytes >> 20,
        help="keep at most this many MiB of logged events per tenant, oldest dropped "
        "first (default: %(default)s)",
    )
    p.add_argument(
        "--history-turns",
        type=int,
        default=BridgeConfig.history_turns,
        help="earlier runs of a conversation a follow-up's model calls are given, "
        "from the event log (0: none; default: %(default)s)",
    )
    p.add_argument(
        "--history-chars",
        type=int,
        default=BridgeConfig.history_chars,
        help="characters those earlier runs may take, within the model's context "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--client-id",
        default=BridgeConfig.client_id,
        help="MQTT client id of this bridge's persistent session (default: the --user, "
        f"else {DEFAULT_CLIENT_ID}; a second bridge process on the same broker needs its "
        "own, and on a broker that binds client ids to users, a user of its own)",
    )
    p.add_argument("--tenant", default="demo", help="tenant to create when the registry is new")
    p.add_argument(
        "--device", action="append", default=[], help="register DEVICE[:AGENT] in --tenant"
    )
    p.add_argument(
        "--script", type=Path, help="scripted model: a JSON script file (default: the demo script)"
    )
    p.add_argument(
        "--openai-base-url",
        type=model_url,
        metavar="URL",
        help="use an OpenAI-compatible server, e.g. http://127.0.0.1:11434/v1",
    )
    p.add_argument(
        "--model",
        default=os.environ.get("WREN_MODEL", "gpt-4o-mini"),
        help="the model server's model: what a call naming none gets, always allowed "
        "(default %(default)s, env WREN_MODEL)",
    )
    p.add_argument(
        "--api-key-env", default="OPENAI_API_KEY", help="environment variable holding the API key"
    )
    # What a model call may cost is the bridge's to decide, not the board's (PROTOCOL.md
    # "Model calls", models/policy.py).
    p.add_argument(
        "--allow-model",
        type=allow_model,
        action="append",
        default=[],
        metavar="[SCOPE=]MODEL[,MODEL...]",
        help="a model boards may name besides --model (which is always allowed and the "
        "default); SCOPE is * (every tenant, the default), TENANT or TENANT/AGENT, and the "
        "lists add up; MODEL * allows any. A board naming another model is refused "
        "(model_not_allowed). Repeatable",
    )
    p.add_argument(
        "--max-tokens",
        type=count,
        metavar="N",
        help="the most tokens one model call may answer with, and what a call naming none "
        f"gets (default {BridgeConfig.llm_max_tokens}); a board's larger ask is cut to it",
    )
    p.add_argument(
        "--temperature",
        type=temperature,
        metavar="T",
        help="the sampling temperature of every model call (default: the model server's)",
    )
    p.add_argument(
        "--model-timeout",
        type=seconds,
        metavar="S",
        help="the most one model call may take from request to last token (default "
        f"{BridgeConfig.llm_timeout_s:g}); past it the call fails, cause timeout, not retryable",
    )
    p.add_argument(
        "--model-idle-timeout",
        type=seconds,
        default=MODEL_IDLE_TIMEOUT_S,
        metavar="S",
        help="the longest a model may be silent, before its first token or between two "
        "(default %(default)g); past it the call fails, cause stalled. Keep it under the "
        "board's 120 s wait for a call",
    )
    p.add_argument(
        "--run-model-calls",
        type=count,
        default=ModelPolicy.run_calls,
        metavar="N",
        help="the most model calls one run may make (default %(default)s)",
    )
    p.add_argument(
        "--run-model-tokens",
        type=count,
        default=ModelPolicy.run_tokens,
        metavar="N",
        help="the most model tokens, in and out, one run may use (default %(default)s)",
    )
    p.add_argument(
        "--run-model-time",
        type=seconds,
        default=ModelPolicy.run_s,
        metavar="S",
        help="the most seconds of model calls one run may spend (default %(default)g)",
    )
    p.add_argument(
        "--merge-ms",
        type=milliseconds,
        metavar="MS",
        help="hold a model's small text chunks up to MS before sending them to a board "
        f"(default {BridgeConfig.rpc_merge_s * 1000:g}; 0 sends each chunk as it comes)",
    )
    p.add_argument(
        "--run-probe",
        type=seconds,
        metavar="S",
        help="seconds an open run of an online device may stay quiet before the bridge "
        "asks its board for what followed (run liveness, PROTOCOL.md; default "
        f"{BridgeConfig.run_probe_s:g}, the wait doubling up to "
        f"{BridgeConfig.run_probe_max_s:g})",
    )
    p.add_argument(
        "--model-context-chars",
        type=int,
        metavar="N",
        help="characters one model call may carry: knowledge passages an agent asks for "
        "before its calls get what its messages leave (default "
        f"{BridgeConfig.model_context_chars:,})",
    )
    p.add_argument(
        "--tenant-links",
        type=int,
        choices=range(1, LINKS + 1),
        metavar="N",
        help="connections that read the boards, tenants dealt to them in turn, so that "
        "one tenant's flood never queues another's calls at the broker (default "
        f"{LINKS}; 1 reads every board on one connection by wildcard; "
        "PROTOCOL.md \"The bridge's connections\")",
    )
    p.add_argument(
        "--stats-file",
        type=Path,
        default=DEFAULT_STATS_FILE,
        help="where the running bridge writes its counters in Prometheus text format "
        "(node_exporter's textfile collector reads it; default %(default)s)",
    )
    p.add_argument(
        "--stats-every",
        type=seconds,
        default=STATS_EVERY_S,
        metavar="S",
        help="seconds between two writes of --stats-file (default %(default)s)",
    )
    p.add_argument(
        "--stats",
        action="store_true",
        help="print the counters the running bridge last wrote to --stats-file, and exit",
    )
    p.add_argument(
        "--metrics",
        type=metrics_address,
        metavar="HOST:PORT",
        help="serve the counters at http://HOST:PORT/metrics for Prometheus (default: off; "
        f"HOST defaults to {METRICS_HOST}, 0.0.0.0 is every interface; port 0 picks one)",
    )
    p.add_argument(
        "--http",
        type=metrics_address,
        metavar="HOST:PORT",
        help="serve the hosts' HTTP API (devices, requests, runs and their events as SSE, "
        f"conversations) at HOST:PORT (default: off; HOST defaults to {METRICS_HOST}; "
        "port 0 picks one); needs the `http` extra (starlette, uvicorn)",
    )
    p.add_argument(
        "--json-mirror",
        type=mirror_tenant,
        action="append",
        default=[],
        metavar="TENANT",
        help="also publish TENANT's run events, its devices' presence and status, and each "
        "user's last answer as JSON under its host topics (P/h/TENANT/D/json..., the same "
        "rights as its events; PROTOCOL.md \"JSON mirror\"), for dashboards such as "
        "Node-RED and Home Assistant. Repeatable; * for every tenant (default: none)",
    )
    # Fleet mode (DESIGN "Where scale goes"): several bridges on one prefix.
    p.add_argument(
        "--fleet-dsn",
        default=os.environ.get("WREN_FLEET_DSN"),
        metavar="DSN",
        help="run as one bridge of a fleet sharing the prefix: devices are dealt to "
        "partitions leased in this PostgreSQL database (a libpq connection string; env "
        "WREN_FLEET_DSN, which keeps its password off the command line), each served by "
        "the bridge holding its lease; memory, the event log and knowledge are kept "
        "there too (default: off, one bridge process per prefix)",
    )
    p.add_argument(
        "--partitions",
        type=partition_count,
        default=BridgeConfig.partitions,
        metavar="P",
        help="the fleet's partition count, fixed for its life: a bridge started with "
        "another is refused (default %(default)s)",
    )
    p.add_argument(
        "--fleet-round",
        type=seconds,
        default=BridgeConfig.fleet_round_s,
        metavar="S",
        help="how often a fleet bridge renews its leases and takes or gives back "
        "partitions (default %(default)g)",
    )
    p.add_argument(
        "--fleet-lease",
        type=seconds,
        default=BridgeConfig.fleet_lease_s,
        metavar="S",
        help="how long a renewal holds a partition: a killed bridge's devices are served "
        "again within about this and a round (default %(default)g)",
    )
    p.add_argument("--http-cert", default=None, metavar="PEM",
                   help="serve --http over TLS with this certificate chain")  # fmt: skip
    p.add_argument("--http-key", default=None, metavar="PEM",
                   help="the private key of --http-cert")  # fmt: skip


def build_parser(prog: str = "python -m server_bridge") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Run the Wren server bridge until SIGTERM or Ctrl-C."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    add_arguments(parser)
    return parser


# --- what the options make ------------------------------------------------------------------


def bridge_config(args: argparse.Namespace) -> BridgeConfig:
    """The BridgeConfig these parsed options describe."""
    tls = broker_tls(args)
    host, port = args.broker or (DEFAULT_BROKER[0], TLS_PORT if tls else DEFAULT_BROKER[1])
    config = BridgeConfig(
        host=host,
        port=port,
        username=args.user,
        password=args.password,
        client_id=args.client_id,
        tls=tls,
        fleet_dsn=args.fleet_dsn or None,
        partitions=args.partitions,
        fleet_round_s=args.fleet_round,
        fleet_lease_s=args.fleet_lease,
    )
    # Only an option given overrides the config's own default, so that default is
    # written once (BridgeConfig; the --merge-ms help reads it from there too).
    if args.merge_ms is not None:
        config = dataclasses.replace(config, rpc_merge_s=args.merge_ms / 1000)
    if args.max_tokens is not None:
        config = dataclasses.replace(config, llm_max_tokens=args.max_tokens)
    if args.model_timeout is not None:
        config = dataclasses.replace(config, llm_timeout_s=args.model_timeout)
    if args.model_context_chars is not None:
        config = dataclasses.replace(config, model_context_chars=args.model_context_chars)
    if args.tenant_links is not None:
        config = dataclasses.replace(config, tenant_links=args.tenant_links)
    config = dataclasses.replace(
        config,
        event_log_max_age_s=args.event_log_days * 86400,
        event_log_max_bytes=args.event_log_mib << 20,
        history_turns=max(args.history_turns, 0),
        history_chars=max(args.history_chars, 0),
        json_mirror=frozenset(args.json_mirror),
    )
    if args.run_probe is not None:
        most = max(args.run_probe, config.run_probe_max_s)
        config = dataclasses.replace(config, run_probe_s=args.run_probe, run_probe_max_s=most)
    return config


def model_policy(args: argparse.Namespace) -> ModelPolicy:
    """The model rules these options describe: the allow-list and the per-run caps."""
    return ModelPolicy(
        allowed=merge_allowed(args.allow_model),
        run_calls=args.run_model_calls,
        run_tokens=args.run_model_tokens,
        run_s=args.run_model_time,
    )


def model_provider(args: argparse.Namespace) -> tuple[Provider, str]:
    """The model these options name, and a few words saying which for the start line."""
    if args.openai_base_url:
        # Imported only when asked for, like any optional part.
        from server_bridge.models.openai import OpenAIProvider

        provider: Provider = OpenAIProvider(
            args.openai_base_url,
            args.model,
            api_key_env=args.api_key_env,
            timeout=args.model_idle_timeout,
            temperature=args.temperature,
        )
        return provider, f"OpenAI-compatible model {args.model} at {args.openai_base_url}"
    if args.script:
        return ScriptedProvider.from_file(args.script), f"scripted model from {args.script}"
    return ScriptedProvider(DEMO_SCRIPT), "scripted model (demo script)"


def _devices(specs: list[str]) -> list[tuple[str, str]]:
    devices = []
    for spec in specs:
        device, _, agent = spec.partition(":")
        devices.append((device, agent or DEFAULT_AGENT))
    return devices


# --- the process ----------------------------------------------------------------------------


def memory_service(args: argparse.Namespace) -> MemoryService:
    """The durable memory at --memory-dir (memory/ beside the registry), with the recall
    index (MiniLM when installed, else BM25), which the bridge rebuilds as it starts.
    In a fleet (--fleet-dsn), the memory on PostgreSQL that every bridge of it shares:
    a device's memory must not depend on which bridge serves it this minute."""
    if args.fleet_dsn:
        from server_bridge.memory import MemoryService
        from server_bridge.memory.recall import RecallIndex
        from server_bridge.pgstore import PgUnavailable
        from server_bridge.pgstore.memory import PgMemoryStore

        try:
            store = PgMemoryStore(args.fleet_dsn)
        except PgUnavailable as e:
            raise ServiceError(f"the fleet's memory store: {e}") from e
        return MemoryService(store, index=RecallIndex("auto"))
    from server_bridge.memory import open_memory

    return open_memory(args.memory_dir or _beside_registry(args) / "memory")


def _named(store: Path | str) -> str:
    """A store for a log line: a file's path, a database's URL without its password."""
    return describe(store) if isinstance(store, str) else str(store)


def _beside_registry(args: argparse.Namespace) -> Path:
    """Where the files that default to the registry's directory go: that directory, or
    the current one when the registry is a database."""
    return Path(".") if is_dsn(args.registry) else Path(args.registry).parent


def event_log(args: argparse.Namespace) -> EventStore | None:
    """The event log at --event-log (events/ beside the registry); None with
    --no-event-log. In a fleet (--fleet-dsn), the log on PostgreSQL that every bridge
    of it shares: the bridge that takes a device over replays its runs from it."""
    if args.no_event_log:
        return None
    if args.fleet_dsn:
        from server_bridge.pgstore import PgUnavailable
        from server_bridge.pgstore.eventlog import PgEventLog

        try:
            return PgEventLog(args.fleet_dsn)
        except PgUnavailable as e:
            raise ServiceError(f"the fleet's event log: {e}") from e
    from server_bridge.eventlog import EventLog

    return EventLog(args.event_log or _beside_registry(args) / "events")


def knowledge_base(args: argparse.Namespace) -> KnowledgeBase | None:
    """The knowledge store at --knowledge, else knowledge.sqlite3 beside the registry
    when `wren kb ingest` has made one; None (no kb.* methods) otherwise."""
    from server_bridge.knowledge import KnowledgeBase

    path = args.knowledge
    if path is None and args.fleet_dsn:
        # A fleet's knowledge is its database's (`wren kb ingest --store URL`).
        path = args.fleet_dsn
    if is_dsn(path) or (path is not None and path == args.fleet_dsn):
        from server_bridge.pgstore import PgUnavailable
        from server_bridge.pgstore.knowledge import PgKnowledgeStore

        try:
            return KnowledgeBase(PgKnowledgeStore(str(path)))
        except PgUnavailable as e:
            raise ServiceError(f"the knowledge store: {e}") from e
    if path is None:
        path = _beside_registry(args) / "knowledge.sqlite3"
        if not path.exists():
            return None
    return KnowledgeBase(path)


# The interpreter's switch interval in the bridge process: 1 ms, not Python's 5 ms.
# bench_bridge figure 4 (40 requests, this 2-core machine), request -> first delta
# during a neighbour's flood of valid events over the same without: 2.7x and 3.1x at
# 5 ms, 2.2x, 2.2x and 2.3x at 1 ms; CPU per relayed event (figure 3) is in DESIGN.md.
SWITCH_INTERVAL_S = 0.001


def run(
    args: argparse.Namespace, stop: threading.Event | None = None, out: TextIO | None = None
) -> int:
    """Provision the registry, start the bridge and serve until `stop` is set (0), or
    until KeyboardInterrupt, which goes on to the caller once the bridge has stopped.

    A `bridge: ...` line on `out` (stdout) says the bridge is connected and subscribed;
    a broker that cannot be reached, or a --metrics address that cannot be bound, is a
    ServiceError. With --metrics, a `metrics at URL` line follows it.
    """
    out = out if out is not None else sys.stdout
    stop = stop if stop is not None else threading.Event()
    # The bridge's threads (a network thread per connection, the forwarders, the RPC
    # workers) pass the interpreter's lock among them; a thread with a quiet tenant's
    # message in hand waited up to the default 5 ms for it behind a link busy with a
    # neighbour's flood, at each hop (SWITCH_INTERVAL_S).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # numpy's BLAS on one thread, set before anything imports numpy (recall and
    # knowledge import it lazily): a search's matrix-vector product is memory-bound, and
    # OpenBLAS's second thread only adds a hand-off, 8 ms on a 10k product that takes
    # 0.3 ms on one (bench_knowledge: dense p50 13.2 -> 6.6 ms at 10k, 32 -> 22.5 at 100k).
    # An operator's own setting wins.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    config = bridge_config(args)
    # Imported here, not with this module: every `wren` command builds its parser from
    # this module, and the bridge (paho and all) is most of a command's start-up time.
    from server_bridge.bridge import Bridge, LoginRefused, RivalBridge

    registry: RegistryStore
    if is_dsn(args.registry):
        from server_bridge.pgstore import PgUnavailable
        from server_bridge.pgstore.registry import provision as provision_pg

        try:
            registry = provision_pg(args.registry, args.tenant, _devices(args.device))
        except PgUnavailable as e:
            raise ServiceError(f"the registry: {e}") from e
    else:
        registry = provision(args.registry, args.tenant, _devices(args.device))
    try:
        provider, what = model_provider(args)
        knowledge = knowledge_base(args)
        events = event_log(args)
        turns = None
        if events is not None:
            from server_bridge.conversations import Turns
            from server_bridge.eventlog import EventLog

            # Beside the events, in a directory no tenant's name can be. A fleet's
            # bridge keeps them in files of its own (the log on PostgreSQL has no
            # room for them yet): a follow-up served by another bridge after a
            # failover gets no earlier turns.
            root = args.event_log or _beside_registry(args) / "events"
            turns = Turns(EventLog(Path(root) / "_turns"), config.history_turns,
                          config.history_chars)  # fmt: skip
        memory = memory_service(args)
        bridge = Bridge(config, registry, provider, memory, knowledge, events, turns)
        # The allow-list and the per-run caps; the model timeout and the token cap came
        # with the config, the idle timeout and temperature with the provider.
        bridge.rpc.set_model_policy(model_policy(args))
        metrics: MetricsServer | None = None
        http: HttpServer | None = None
        # stop() also after a start that failed or was interrupted: it shuts down the
        # RPC pool the bridge made, and is a no-op for the connection it never had.
        try:
            # Before connecting: a port in use is said at once, whatever the broker does.
            if args.metrics is not None:
                metrics = _serve_metrics(bridge, *args.metrics)
            # Before the bridge connects: the retained statuses it reads first are mirrored.
            if bridge.mirror is not None:
                bridge.mirror.start()
            try:
                bridge.start()
            except (RivalBridge, LoginRefused) as e:
                # Reached, and answered: not a broker it "could not connect to".
                raise ServiceError(str(e)) from e
            except Exception as e:
                raise ServiceError(
                    f"could not connect to the broker at {config.host}:{config.port}: {e}"
                ) from e
            # One write, line and newline together: unbuffered (PYTHONUNBUFFERED), print()
            # writes the newline apart, and a log line on stderr may land in between.
            if args.http is not None:
                http = _serve_http(bridge, args)
            out.write(
                f"bridge: {config.host}:{config.port}, registry {_named(args.registry)}, {what};"
                " Ctrl-C stops\n" + (f"metrics at {metrics.url}\n" if metrics else "")
                + (f"http at {http.url}\n" if http else "")
                + (f"json mirror: {_mirrored(config)}\n" if config.json_mirror else "")
            )
            out.flush()
            # In one-second waits rather than one endless one, so that Ctrl-C (and
            # SIGTERM, see stop_on_sigterm) is seen on every platform.
            next_stats = 0.0
            while True:
                if time.monotonic() >= next_stats:
                    _write_stats(bridge, args.stats_file)
                    next_stats = time.monotonic() + args.stats_every
                if stop.wait(min(1.0, args.stats_every)):
                    return 0
        finally:
            # A second Ctrl-C (or SIGTERM) must not cut the stop short: it is bounded
            # (a couple of seconds) and what makes the boards' calls end by name.
            with _signals_held():
                try:
                    if http is not None:
                        http.stop()
                    if bridge.mirror is not None:
                        # First: what it holds goes to the lanes, which the bridge's stop
                        # hands to the broker (server_bridge/mirror/mirror.py).
                        bridge.mirror.stop()
                    bridge.stop()
                    # The last counters, after the stop: what a restart starts again
                    # from zero.
                    _write_stats(bridge, args.stats_file)
                finally:
                    if metrics is not None:
                        metrics.stop()
                    if knowledge is not None:
                        knowledge.close()
                    if events is not None:
                        events.close()
                    if turns is not None:
                        turns.log.close()
                    # The fleet's store on PostgreSQL has a pool to let go (TinyDB's
                    # files have nothing open between writes).
                    close_store = getattr(memory.store, "close", None)
                    if callable(close_store):
                        close_store()
    finally:
        registry.close()


def _mirrored(config: BridgeConfig) -> str:
    """Which tenants the JSON mirror publishes, for the start lines."""
    if EVERY_TENANT in config.json_mirror:
        return "every tenant"
    return "tenant " + ", ".join(sorted(config.json_mirror))


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM ignored for the block (on the main thread only, where Python
    runs signal handlers), then as before."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _serve_metrics(bridge: Bridge, host: str, port: int) -> MetricsServer:
    """--metrics: the bridge's counters at http://host:port/metrics, served from now on."""
    from server_bridge.metrics_http import MetricsServer

    try:
        server = MetricsServer(bridge.metrics_text, host, port)
    except OSError as e:
        raise ServiceError(
            f"could not serve the metrics at {host}:{port}: {e.strerror or e}"
        ) from e
    server.start()
    return server


def _serve_http(bridge: Bridge, args: argparse.Namespace) -> HttpServer:
    """--http: the hosts' HTTP API, served from now on."""
    try:
        from server_bridge.http import server as http_server
    except ImportError as e:
        raise ServiceError(f"--http needs the `http` extra (pip install 'wren[http]'): {e}") from e
    if (args.http_cert is None) != (args.http_key is None):
        raise ServiceError("--http-cert and --http-key go together")
    host, port = args.http
    try:
        server = http_server.HttpServer(bridge, host, port, args.http_cert, args.http_key)
        server.start()
    except (OSError, ImportError) as e:
        raise ServiceError(f"could not serve HTTP at {host}:{port}: {e}") from e
    return server


def _write_stats(bridge: Bridge, path: Path) -> None:
    try:
        write_text_file(path, bridge.metrics_text())
    except OSError as e:
        # The counters are for watching the bridge; failing to write them must not
        # stop it serving. Logged at each attempt: a full disk should be seen.
        log.warning("could not write the stats to %s: %s", path, e)


def print_stats(path: Path, out: TextIO | None = None) -> int:
    """`--stats`: the counters a running bridge last wrote, with their age (1 when
    there are none to show)."""
    out = out if out is not None else sys.stdout
    try:
        text = path.read_text()
        age = time.time() - path.stat().st_mtime
    except OSError as e:
        print(
            f"no bridge stats at {path} ({e.strerror}): is a bridge running with "
            f"--stats-file {path}?",
            file=sys.stderr,
        )
        return 1
    out.write(f"# {path}, written {age:.0f} s ago\n{text}")
    out.flush()
    return 0


def stop_on_sigterm(signum: int, frame: FrameType | None) -> NoReturn:
    """A SIGTERM handler: `kill` (and service managers) stop us with SIGTERM; raising
    KeyboardInterrupt runs the same clean-up as Ctrl-C, so the bridge says offline and
    nothing we started (a broker, a board) outlives us."""
    raise KeyboardInterrupt


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    setup_logging(args.verbose)
    if args.stats:
        return print_stats(args.stats_file)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\nstopped", file=sys.stderr)
        return STOP_EXIT_CODE
    except ServiceError as e:
        print(f"{parser.prog}: {e}", file=sys.stderr)
        return 1
