"""Mosquitto password and ACL files for Wren.

The access rules (docs/PROTOCOL.md, "Broker ACL"), with P the topic prefix:

- the bridge user reads and writes all of `P/#`;
- a device, whose MQTT user name *is* its device id, reads only its own
  `P/d/<id>/req`, `P/d/<id>/ctl` and `P/d/<id>/rpc/res` and writes only its own
  `P/d/<id>/status`, `hello`, `evt` and `rpc` (so only the bridge can publish the
  requests, control messages and RPC answers a board acts on);
- a tenant's host users read `P/h/<tenant>/+/evt` and write `P/h/<tenant>/+/req` and
  `P/h/<tenant>/+/ctl`, for that tenant only; a tenant may have several host users,
  one per host connection (see below);
- devices and host users read `P/b/status`, the bridge's presence (a board fails its
  waiting RPC calls when the bridge goes offline); only the bridge writes it.

Client ids are bound to users: the configuration says `use_username_as_clientid true`,
so Mosquitto replaces whatever client id a client sends with its user name. Without it
any authenticated user (another tenant's host, say) could connect with a board's client
id (its device id) and knock the board off the broker, again and again. With it, a
client id can only be taken over by a second connection of the same user, so every
connection that must stay up needs a user of its own: the bridge process has its own
(a second bridge process, another), each board is its own user already, and each host
connection of a tenant gets a host user of its own (`acl_text` takes several per
tenant). The persistent sessions of the bridge and the boards are kept under their
user names.

Device rules are Mosquitto `pattern` lines with `%u`, which apply to every user: a
bridge or host user name that is also a registered device id would share that
device's rights, so keep the names apart (e.g. `bridge`, `host-<tenant>`). The read of
`P/b/status` is a `pattern` line too (without `%u`), so it reaches devices and host
users alike.

Passwords are stored the way `mosquitto_passwd` (Mosquitto 2.x) stores them:
`$7$<iterations>$<base64 salt>$<base64 hash>`, PBKDF2-HMAC-SHA512 over the raw
12-byte salt, a 64-byte hash, 101 iterations by default.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import secrets
from collections.abc import Collection, Mapping
from pathlib import Path

from server_bridge.topics import bridge_topic, check_id

__all__ = [
    "BROKER_QUEUES",
    "DEVICE_READ",
    "DEVICE_WRITE",
    "HOST_READ",
    "HOST_WRITE",
    "acl_text",
    "check_entry",
    "check_password",
    "check_user",
    "hash_password",
    "mosquitto_conf",
    "new_password",
    "secure_mosquitto_conf",
    "write_broker_files",
    "write_password_entries",
    "write_password_file",
]

SALT_BYTES = 12
HASH_BYTES = 64
DEFAULT_ITERATIONS = 101  # mosquitto_passwd's default for $7$ (sha512-pbkdf2)

# A user name that fits on a password-file line and in an ACL `user` line.
_USER = re.compile(r"[^\s:#+/]{1,128}")
# A `$7$` entry as hash_password and mosquitto_passwd write it.
_ENTRY = re.compile(r"\$7\$[1-9][0-9]{0,9}\$[A-Za-z0-9+/]+={0,2}\$[A-Za-z0-9+/]+={0,2}")
# A prefix of plain topic levels (no wildcards, no empty level).
_PREFIX = re.compile(r"[^/+#\s]+(/[^/+#\s]+)*")

DEVICE_READ = ("req", "ctl", "rpc/res")
DEVICE_WRITE = ("status", "hello", "evt", "rpc")
HOST_READ = ("evt",)
HOST_WRITE = ("req", "ctl")


# --- passwords --------------------------------------------------------------------------


def hash_password(
    password: str, salt: bytes | None = None, iterations: int = DEFAULT_ITERATIONS
) -> str:
    """A Mosquitto 2.x `$7$` password entry (the part after `user:`)."""
    if salt is None:
        salt = os.urandom(SALT_BYTES)
    if len(salt) != SALT_BYTES:
        raise ValueError(f"the salt must be {SALT_BYTES} bytes")
    if iterations < 1:
        raise ValueError("iterations must be positive")
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations, HASH_BYTES)
    salt64 = base64.b64encode(salt).decode()
    digest64 = base64.b64encode(digest).decode()
    return f"$7${iterations}${salt64}${digest64}"


def new_password() -> str:
    """A new random broker password: 32 characters of [A-Za-z0-9_-] (192 bits), which
    need no quoting in JSON, a shell or a password-file line."""
    return secrets.token_urlsafe(24)


def check_entry(entry: str) -> str:
    """`entry` if it is a `$7$` password entry, else ValueError: what is stored for the
    broker must be a hash, never a password by mistake."""
    if not isinstance(entry, str) or not _ENTRY.fullmatch(entry):
        raise ValueError("not a $7$ password entry")
    return entry


def check_password(password: str, entry: str) -> bool:
    """Does `password` match a `$7$` entry (ours or mosquitto_passwd's)?"""
    parts = check_entry(entry).split("$")
    iterations = int(parts[2])
    salt = base64.b64decode(parts[3])
    expected = base64.b64decode(parts[4])
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations, len(expected))
    return hmac.compare_digest(digest, expected)


def check_user(user: str) -> str:
    """`user` if it can be written to the password file and the ACL, else ValueError."""
    if not isinstance(user, str) or not _USER.fullmatch(user):
        raise ValueError(f"user name {user!r} cannot be written to the broker's files")
    return user


def write_password_file(path: Path | str, users: Mapping[str, str]) -> Path:
    """Write `user:$7$...` lines for these users and passwords (hashed here), readable
    by the owner only (they guard every device)."""
    return write_password_entries(
        path, {check_user(user): hash_password(pw) for user, pw in users.items()}
    )


def write_password_entries(path: Path | str, entries: Mapping[str, str]) -> Path:
    """Write `user:$7$...` lines from entries already hashed (a registry keeps only
    those), readable by the owner only."""
    path = Path(path)
    lines = [
        f"{check_user(user)}:{check_entry(entry)}\n" for user, entry in sorted(entries.items())
    ]
    _write_private(path, "".join(lines))
    return path


def _write_private(path: Path, text: str) -> None:
    # Created 0600 from the start (no window in which another user could read it),
    # then renamed over the target so a reader never sees half a file.
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o600)  # O_CREAT's mode does not apply to a file that already existed
    os.replace(tmp, path)


# --- ACL ------------------------------------------------------------------------------------


def _check_prefix(prefix: str) -> None:
    if not _PREFIX.fullmatch(prefix):
        raise ValueError(f"bad topic prefix {prefix!r}")


def _names(users: str | Collection[str], what: str) -> list[str]:
    """One user name or several, as a sorted list of distinct names (at least one)."""
    names = sorted({users} if isinstance(users, str) else set(users))
    if not names:
        raise ValueError(f"{what} needs at least one user")
    for user in names:
        check_user(user)
    return names


def acl_text(
    prefix: str,
    bridge_user: str | Collection[str],
    tenants: Mapping[str, str | Collection[str]],
) -> str:
    """A Mosquitto `acl_file` for the rules in this module's docstring.

    `bridge_user` is the bridge's MQTT user, or several (one per bridge process: with
    client ids bound to users, two processes of one user would knock each other off).
    `tenants` maps a tenant id to the MQTT user its hosts connect as, or to several
    (one per host connection, for the same reason).
    """
    _check_prefix(prefix)
    bridges = _names(bridge_user, "the bridge")
    hosts: dict[str, list[str]] = {}
    for tenant, users in sorted(tenants.items()):
        check_id(tenant, "tenant")  # the contract's id rule, from topics.py; a ValueError
        hosts[tenant] = _names(users, f"tenant {tenant}")
        if set(hosts[tenant]) & set(bridges):
            raise ValueError("a host user cannot be a bridge user")
    out = [
        "# Wren broker ACL (written by server_bridge/brokerconf.py). Mosquitto denies whatever",
        "# is not granted here.",
        "",
        "# Devices: the MQTT user name is the device id.",
    ]
    out += [f"pattern read {prefix}/d/%u/{leaf}" for leaf in DEVICE_READ]
    out += [f"pattern write {prefix}/d/%u/{leaf}" for leaf in DEVICE_WRITE]
    out += [
        "",
        "# Devices and hosts: the bridge's presence.",
        f"pattern read {bridge_topic(prefix)}",
    ]
    for user in bridges:
        out += ["", "# The bridge.", f"user {user}", f"topic readwrite {prefix}/#"]
    for tenant, users in hosts.items():
        for user in users:
            out += ["", f"# Hosts of tenant {tenant}.", f"user {user}"]
            out += [f"topic read {prefix}/h/{tenant}/+/{leaf}" for leaf in HOST_READ]
            out += [f"topic write {prefix}/h/{tenant}/+/{leaf}" for leaf in HOST_WRITE]
    return "\n".join(out) + "\n"


# --- Mosquitto configuration -------------------------------------------------------------------


# Mosquitto's queues, per client (the defaults are 20 in flight and 1,000 queued, past
# which it drops QoS 1 messages without telling anyone). The client that matters is the
# bridge: every board's events queue for it, and an unpaced burst of 10 boards of 2,000
# events each lost 12-34 % of them at 1,000 on the 2-core test machine, 0.2-1 % at
# 10,000 and none at 100,000 (the drops were the queues of the bridge and of the host).
# The bytes bound keeps a flood of full 16 KiB events from taking the broker's memory
# (a slow host's queue is bounded by it too; a host repairs what it lost by a replay).
BROKER_QUEUES = (
    "max_inflight_messages 100\nmax_queued_messages 100000\nmax_queued_bytes 268435456\n"
)


def secure_mosquitto_conf(directory: Path | str, users: Mapping[str, str], acl: str) -> str:
    """Write `passwords` and `acl` into `directory` and return the configuration lines
    that use them, to append to a Mosquitto config with `allow_anonymous false` (as
    `tools.broker.start_mosquitto(extra_conf=..., allow_anonymous=False)` does), after
    its `listener` line: they also bind each client id to its user.
    """
    return write_broker_files(
        directory, {check_user(user): hash_password(pw) for user, pw in users.items()}, acl
    )


def write_broker_files(directory: Path | str, entries: Mapping[str, str], acl: str) -> str:
    """`secure_mosquitto_conf` for password entries already hashed (`user` -> `$7$...`)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pw = write_password_entries(directory / "passwords", entries)
    acl_path = directory / "acl"
    _write_private(acl_path, acl)
    lines = [f"password_file {pw.resolve()}", f"acl_file {acl_path.resolve()}"]
    # Client ids bound to users (see the module docstring). A listener option: these
    # lines must follow the `listener` line they are for (start_mosquitto writes its
    # listener first), and a config with several listeners needs it under each.
    lines.append("use_username_as_clientid true")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # Started as root, Mosquitto switches to the `mosquitto` user before it reads
        # these files, which are the caller's and private (0600), often in a private
        # directory too. Keep the caller's identity rather than loosen the files.
        lines.append("user root")
    return "\n".join(lines) + "\n" + BROKER_QUEUES


def mosquitto_conf(
    directory: Path | str,
    entries: Mapping[str, str],
    acl: str,
    port: int = 1883,
    bind: str | None = None,
) -> Path:
    """Write a complete Mosquitto configuration into `directory`: `passwords` (from
    entries already hashed), `acl` and `mosquitto.conf`, which listens on `port` (on
    `bind`, or every interface), authenticates every client and uses the other two.
    Returns the path of `mosquitto.conf`, for `mosquitto -c`.

    Written again with other users, the files are replaced whole (each by a rename), so
    a broker sent SIGHUP reloads either the old or the new ones, never half of each.
    """
    if not 0 < port < 65536:
        raise ValueError(f"bad port {port}")
    if bind is not None and not re.fullmatch(r"[^\s#]+", bind):
        raise ValueError(f"bad listener address {bind!r}")
    directory = Path(directory)
    lines = write_broker_files(directory, entries, acl)
    listener = f"listener {port}" + (f" {bind}" if bind else "")
    text = (
        "# Wren's broker (written by server_bridge/brokerconf.py from the registry; written\n"
        "# again after every change of its users: then send Mosquitto SIGHUP to reload).\n"
        # The security options are the listener's own: they must follow its line.
        f"{listener}\n"
        "allow_anonymous false\n"
        # The boards' and the bridge's persistent sessions, and what waits in them,
        # survive a broker restart only when the broker saves them.
        "persistence true\n"
        f"persistence_location {directory.resolve()}/\n"
        # Nagle off, as on every socket of Wren's path (server_bridge/tcp.py says why).
        "set_tcp_nodelay true\n" + lines
    )
    conf = directory / "mosquitto.conf"
    _write_private(conf, text)
    return conf
