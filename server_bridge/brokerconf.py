"""Mosquitto's password and ACL files for Wren, or its dynamic security plugin's file.

The access rules (docs/PROTOCOL.md, "Broker ACL"), with P the topic prefix:

- the bridge user reads and writes all of `P/#`, and so do its sibling users
  (`sibling_users`): its control user (`control_user`: the bridge user's name and
  `.ctl`), the login of the bridge's control connection, which carries host requests
  and the bridge's presence apart from the boards' traffic, and its link users
  (`link_user`: the name and `.l1`, `.l2`, `.l3`), the logins of the connections that
  read the boards of the tenants beyond the first (server_bridge/links.py);
- a device, whose MQTT user name *is* its device id, reads only its own
  `P/d/<id>/req`, `P/d/<id>/ctl` and `P/d/<id>/rpc/res` and writes only its own
  `P/d/<id>/status`, `hello`, `evt` and `rpc` (so only the bridge can publish the
  requests, control messages and RPC answers a board acts on);
- a tenant's host users read its device topics `P/h/<tenant>/+/evt` and their JSON
  mirror `P/h/<tenant>/+/json/#` and write `P/h/<tenant>/+/req` and `P/h/<tenant>/+/ctl`,
  for that tenant only; a tenant may have several host users, one per host connection
  (see below). Each is either a watcher, which also reads every user's runs,
  `P/h/<tenant>/+/u/+/evt` and `.../u/+/json/#`, or bound to one end user (`bound`),
  which reads that user's runs only, `P/h/<tenant>/+/u/<usr>/evt` and
  `.../u/<usr>/json/#` (PROTOCOL.md "Who sees what"; the JSON mirror,
  server_bridge/mirror/, publishes only for the tenants that opt in, but the rights are
  the same for every tenant, so turning it on needs no new broker files). No host user
  reads `req` or `ctl`: they carry other users' tokens;
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

A bridge process has several connections (server_bridge/bridge.py and links.py say
why), so several users: its own, its control user `<user>.ctl` and its link users
`<user>.l1` to `<user>.l3`, all with the same password and the same rights. They are
one party with one secret, which is why the rights are the same: a narrower sibling
would guard nothing the others' password does not open. The rules below grant every
bridge user's siblings with it (`_parties`), and `with_control_users` adds their logins
(the bridge user's password or `$7$` entry) to a map of users. The names cannot be a
device's or a tenant's (`.` is not in their alphabet), so no `%u` pattern or device
role ever means them, and the registry refuses them to anyone else.

Device rules are Mosquitto `pattern` lines with `%u`, which apply to every user: a
bridge or host user name that is also a registered device id would share that
device's rights, so keep the names apart (e.g. `bridge`, `host-<tenant>`). The read of
`P/b/status` is a `pattern` line too (without `%u`), so it reaches devices and host
users alike.

The same rights can come from Mosquitto's dynamic security plugin instead
(`dynsec_config`; `wren broker-files --access dynsec`). It refuses a subscription
outside them in its SUBACK, which the `acl_file` grants and then serves nothing on
(PROTOCOL.md, "Broker ACL"). It has no `%u`, so each device gets a role of its own, and
it reads its file only when the broker starts.

Passwords are stored the way `mosquitto_passwd` (Mosquitto 2.x) stores them:
`$7$<iterations>$<base64 salt>$<base64 hash>`, PBKDF2-HMAC-SHA512 over the raw
12-byte salt, a 64-byte hash, 101 iterations by default.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import secrets
import sysconfig
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server_bridge.tls import TLS_PORT
from server_bridge.topics import bridge_topic, check_id, check_user_id

__all__ = [
    "BROKER_QUEUES",
    "CONTROL_SUFFIX",
    "LINKS",
    "SIBLING_SUFFIXES",
    "DEVICE_READ",
    "DEVICE_WRITE",
    "DYNSEC_PLUGIN",
    "DYNSEC_PLUGIN_ENV",
    "HOST_READ",
    "HOST_WRITE",
    "USER_READ",
    "TLSListener",
    "acl_text",
    "check_entry",
    "check_password",
    "check_user",
    "control_user",
    "link_user",
    "sibling_users",
    "dynsec_config",
    "dynsec_mosquitto_conf",
    "dynsec_plugin",
    "hash_password",
    "mosquitto_conf",
    "new_password",
    "secure_mosquitto_conf",
    "with_control_users",
    "write_broker_files",
    "write_dynsec_files",
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

# What makes a bridge user's control user of it (module docstring): a character no
# device or tenant id has, so the name can never be a device's.
CONTROL_SUFFIX = ".ctl"
# How many connections a bridge process reads boards on at most (server_bridge/links.py):
# its own user's and one per link user, `<user>.l1` ... Each is a queue of its own at
# the broker, so tenants on different links never wait behind each other's floods.
LINKS = 4
LINK_SUFFIX = ".l"
# Every suffix that makes a sibling of a bridge user.
SIBLING_SUFFIXES = (CONTROL_SUFFIX, *(f"{LINK_SUFFIX}{i}" for i in range(1, LINKS)))

DEVICE_READ = ("req", "ctl", "rpc/res")
DEVICE_WRITE = ("status", "hello", "evt", "rpc")
# What a host user reads of each device of its tenant, and of the end users' runs its
# role lets it read: the events (msgpack) and their JSON mirror (server_bridge/mirror/:
# `json` itself and the retained `json/presence`, `json/status`, `json/answer` below
# it; `#` matches its parent level too).
HOST_READ = ("evt", "json/#")
USER_READ = HOST_READ
HOST_WRITE = ("req", "ctl")
# What every user topic a watcher reads looks like (its user level a wildcard).
ALL_USERS = "+"


def _user_topics(prefix: str, tenant: str, usr: str) -> list[str]:
    """The host topics of one end user's runs on any device of `tenant` (usr a user id,
    or ALL_USERS: every user's, the watchers')."""
    return [f"{prefix}/h/{tenant}/+/u/{usr}/{leaf}" for leaf in USER_READ]


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


def control_user(user: str) -> str:
    """The control user of bridge user `user`: the login of that bridge process's
    control connection (module docstring). ValueError when it would not fit the files."""
    return check_user(check_user(user) + CONTROL_SUFFIX)


def link_user(user: str, link: int) -> str:
    """The login of link `link` (1 .. LINKS-1) of bridge user `user`'s process; link 0
    is the bridge user itself (server_bridge/links.py)."""
    if not 1 <= link < LINKS:
        raise ValueError(f"link {link} is not one of 1..{LINKS - 1}")
    return check_user(check_user(user) + f"{LINK_SUFFIX}{link}")


def sibling_users(user: str) -> list[str]:
    """The other logins of bridge user `user`'s process: its control user, then its
    link users (module docstring)."""
    return [check_user(check_user(user) + suffix) for suffix in SIBLING_SUFFIXES]


def with_control_users(users: Mapping[str, str], bridges: Collection[str]) -> dict[str, str]:
    """`users` (name -> password, or name -> `$7$` entry) with the sibling users of each
    of `bridges` (control and link users) added under that bridge user's own value,
    unless they have one already."""
    out = dict(users)
    for user in bridges:
        if user in users:
            for sibling in sibling_users(user):
                out.setdefault(sibling, users[user])
    return out


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


def _parties(
    prefix: str,
    bridge_user: str | Collection[str],
    tenants: Mapping[str, str | Collection[str]],
    bound: Mapping[str, str] | None = None,
) -> tuple[list[str], dict[str, list[str]]]:
    """The bridge users, each with its sibling users, and each tenant's host users,
    checked: sorted, at least one of each, and no user both; and every user `bound`
    binds a host user bound to a valid end-user id."""
    _check_prefix(prefix)
    named = _names(bridge_user, "the bridge")
    bridges = sorted({*named, *(sibling for user in named for sibling in sibling_users(user))})
    hosts: dict[str, list[str]] = {}
    for tenant, users in sorted(tenants.items()):
        check_id(tenant, "tenant")  # the contract's id rule, from topics.py; a ValueError
        hosts[tenant] = _names(users, f"tenant {tenant}")
        if set(hosts[tenant]) & set(bridges):
            raise ValueError("a host user cannot be a bridge user")
    every_host = {user for users in hosts.values() for user in users}
    for user, usr in (bound or {}).items():
        if user not in every_host:
            raise ValueError(f"{user!r} is bound to an end user but is no tenant's host user")
        check_user_id(usr)  # a topics.BadTopic, a ValueError
    return bridges, hosts


def acl_text(
    prefix: str,
    bridge_user: str | Collection[str],
    tenants: Mapping[str, str | Collection[str]],
    bound: Mapping[str, str] | None = None,
) -> str:
    """A Mosquitto `acl_file` for the rules in this module's docstring.

    `bridge_user` is the bridge's MQTT user, or several (one per bridge process: with
    client ids bound to users, two processes of one user would knock each other off);
    each one's control user gets the same rights.
    `tenants` maps a tenant id to the MQTT user its hosts connect as, or to several
    (one per host connection, for the same reason).
    `bound` maps a host user to the one end user whose runs it may read; a host user
    not in it is a watcher (every user's runs of its tenant).
    """
    bridges, hosts = _parties(prefix, bridge_user, tenants, bound)
    bound = bound or {}
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
            usr = bound.get(user)
            who = f"bound to user {usr}" if usr is not None else "a watcher"
            out += ["", f"# Hosts of tenant {tenant}: {who}.", f"user {user}"]
            out += [f"topic read {prefix}/h/{tenant}/+/{leaf}" for leaf in HOST_READ]
            out += [f"topic read {t}" for t in _user_topics(prefix, tenant, usr or ALL_USERS)]
            out += [f"topic write {prefix}/h/{tenant}/+/{leaf}" for leaf in HOST_WRITE]
    return "\n".join(out) + "\n"


# --- dynamic security -----------------------------------------------------------------------

DYNSEC_PLUGIN = "mosquitto_dynamic_security.so"
# The plugin to load, when it is not in one of the usual library directories.
DYNSEC_PLUGIN_ENV = "WREN_MOSQUITTO_DYNSEC"

# Every right not granted by a role is denied, unsubscribing too: a client may drop
# only a subscription it was allowed to make (and the bridge its `P/b/probe`).
_DENY_ALL = {
    "publishClientSend": False,
    "publishClientReceive": False,
    "subscribe": False,
    "unsubscribe": False,
}
# Role names; a device's and a tenant's carry the id after the dash, so none collide.
_BRIDGE_ROLE = "bridge"
_PRESENCE_ROLE = "presence"


def _reads(topic: str) -> list[dict[str, Any]]:
    """A read right: subscribing (and unsubscribing) to `topic` and getting what is
    published there. A filter with a wildcard is granted as a pattern, which allows it and
    any narrower filter; without one, as a literal, which allows that filter alone."""
    kind = "Pattern" if "+" in topic or "#" in topic else "Literal"
    return [
        {"acltype": "publishClientReceive", "topic": topic, "allow": True},
        {"acltype": f"subscribe{kind}", "topic": topic, "allow": True},
        {"acltype": f"unsubscribe{kind}", "topic": topic, "allow": True},
    ]


def _writes(topic: str) -> list[dict[str, Any]]:
    return [{"acltype": "publishClientSend", "topic": topic, "allow": True}]


def _stored(entry: str) -> dict[str, Any]:
    """A `$7$` entry in the plugin's own fields. The plugin skips, without a word, a
    client whose salt is not 12 bytes or whose hash is not 64: refuse such an entry
    here instead (mosquitto_passwd and hash_password write exactly those)."""
    _, _, iterations, salt64, hash64 = check_entry(entry).split("$")
    salt, digest = base64.b64decode(salt64), base64.b64decode(hash64)
    if len(salt) != SALT_BYTES or len(digest) != HASH_BYTES:
        raise ValueError(
            f"the dynamic security plugin takes a {SALT_BYTES}-byte salt and a "
            f"{HASH_BYTES}-byte hash"
        )
    return {
        "password": base64.b64encode(digest).decode(),
        "salt": base64.b64encode(salt).decode(),
        "iterations": int(iterations),
    }


def dynsec_config(
    prefix: str,
    bridge_user: str | Collection[str],
    tenants: Mapping[str, str | Collection[str]],
    entries: Mapping[str, str],
    bound: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The dynamic security plugin's file (as JSON data) for the rules in this module's
    docstring: the same rights as `acl_text(prefix, bridge_user, tenants)`, for the users
    of `entries` (user -> `$7$` entry; a user without one cannot log in).

    The plugin's ACLs have no `%u` (Mosquitto 2.0.11), so every device has a role of its
    own, `device-<id>`; each tenant's host users share `tenant-<id>`, and have besides
    `watch-<tenant>` (a watcher's: every user's runs) or `user-<tenant>-<usr>` (one bound
    to end user usr: that user's runs), the bridge users `bridge`, and devices and hosts
    `presence` (the read of `P/b/status`). As with the
    ACL's `%u` patterns, a user that is neither a bridge nor a host user is a device.
    Unlike them, a user has one part's rights only. The bridge may also subscribe to
    `P/#` as a shared subscription (`$share/<group>/...`).
    """
    bridges, hosts = _parties(prefix, bridge_user, tenants, bound)
    bound = bound or {}
    presence = bridge_topic(prefix)
    roles: dict[str, list[dict[str, Any]]] = {
        _BRIDGE_ROLE: _reads(f"{prefix}/#")
        + _writes(f"{prefix}/#")
        + [
            {"acltype": kind, "topic": f"$share/+/{prefix}/#", "allow": True}
            for kind in ("subscribePattern", "unsubscribePattern")
        ],
        _PRESENCE_ROLE: _reads(presence),
    }
    part: dict[str, list[str]] = {user: [_BRIDGE_ROLE] for user in bridges}
    for tenant, users in hosts.items():
        roles[f"tenant-{tenant}"] = [
            acl for leaf in HOST_READ for acl in _reads(f"{prefix}/h/{tenant}/+/{leaf}")
        ] + [acl for leaf in HOST_WRITE for acl in _writes(f"{prefix}/h/{tenant}/+/{leaf}")]
        for user in users:  # a host user of two tenants (the ACL allows it) has both
            usr = bound.get(user)
            sees = f"user-{tenant}-{usr}" if usr is not None else f"watch-{tenant}"
            roles[sees] = [
                acl for t in _user_topics(prefix, tenant, usr or ALL_USERS) for acl in _reads(t)
            ]
            own = part.setdefault(user, [_PRESENCE_ROLE])
            own[-1:-1] = [f"tenant-{tenant}", sees]
    clients = []
    for user, entry in sorted(entries.items()):
        check_user(user)
        if user not in part:
            role = f"device-{user}"
            roles[role] = [
                acl for leaf in DEVICE_READ for acl in _reads(f"{prefix}/d/{user}/{leaf}")
            ] + [acl for leaf in DEVICE_WRITE for acl in _writes(f"{prefix}/d/{user}/{leaf}")]
            part[user] = [role, _PRESENCE_ROLE]
        clients.append(
            {"username": user, **_stored(entry), "roles": [{"rolename": r} for r in part[user]]}
        )
    return {
        "defaultACLAccess": dict(_DENY_ALL),
        "clients": clients,
        "roles": [{"rolename": name, "acls": acls} for name, acls in sorted(roles.items())],
    }


def _plugin_dirs() -> list[Path]:
    """Where packages put Mosquitto's plugins: Debian's multiarch directory (this
    interpreter's first, then any other), other distributions', a source build's and
    Homebrew's."""
    multiarch = sysconfig.get_config_var("MULTIARCH")
    dirs = [Path("/usr/lib") / multiarch] if multiarch else []
    dirs += sorted(Path("/usr/lib").glob("*-linux-gnu*"))
    dirs += map(Path, ("/usr/lib", "/usr/lib64", "/usr/local/lib", "/opt/homebrew/lib"))
    return list(dict.fromkeys(dirs))


def dynsec_plugin(dirs: Sequence[Path | str] | None = None) -> Path:
    """Mosquitto's dynamic security plugin: the file $WREN_MOSQUITTO_DYNSEC names when it
    is set, else the first in `dirs` (the usual library directories by default). A
    FileNotFoundError in one line, naming the file and where it was looked for, if none."""
    named = os.environ.get(DYNSEC_PLUGIN_ENV)
    if named:
        if Path(named).is_file():
            return Path(named)
        raise FileNotFoundError(f"{DYNSEC_PLUGIN_ENV}={named}: no such file")
    looked = [Path(d) for d in dirs] if dirs is not None else _plugin_dirs()
    for directory in looked:
        if (directory / DYNSEC_PLUGIN).is_file():
            return directory / DYNSEC_PLUGIN
    raise FileNotFoundError(
        f"Mosquitto's dynamic security plugin {DYNSEC_PLUGIN} is not in "
        f"{', '.join(map(str, looked))}: install Mosquitto 2 (`apt-get install mosquitto`) "
        f"or name the file in {DYNSEC_PLUGIN_ENV}"
    )


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
    return _bound([f"password_file {pw.resolve()}", f"acl_file {acl_path.resolve()}"])


def write_dynsec_files(
    directory: Path | str, document: Mapping[str, Any], plugin: Path | str | None = None
) -> str:
    """Write `document` (dynsec_config's) into `directory` as `dynsec.json` and return the
    configuration lines that load Mosquitto's dynamic security plugin with it, to append
    as `secure_mosquitto_conf`'s are. `plugin` is the plugin's file, dynsec_plugin()'s
    by default (looked for before anything is written).

    The plugin reads its file once, at start: a running broker does not see it written
    again (SIGHUP reloads neither it nor the plugin; Mosquitto 2.0.11), so a change of
    users needs a restart. The plugin writes the file only on commands sent to its
    `$CONTROL` topic, which no user here may send.
    """
    plugin = Path(plugin) if plugin is not None else dynsec_plugin()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "dynsec.json"
    _write_private(path, json.dumps(document, indent=1) + "\n")
    return _bound([f"plugin {plugin}", f"plugin_opt_config_file {path.resolve()}"])


def _bound(lines: list[str]) -> str:
    """The access lines, then those that bind client ids to users and size the queues."""
    # Client ids bound to users (see the module docstring). A listener option: these
    # lines must follow the `listener` line they are for (start_mosquitto writes its
    # listener first), and a config with several listeners needs it under each.
    lines = [*lines, "use_username_as_clientid true"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # Started as root, Mosquitto switches to the `mosquitto` user before it reads
        # these files, which are the caller's and private (0600), often in a private
        # directory too. Keep the caller's identity rather than loosen the files.
        lines.append("user root")
    return "\n".join(lines) + "\n" + BROKER_QUEUES


@dataclass(frozen=True)
class TLSListener:
    """A TLS listener of Wren's broker, besides its plain one (`mosquitto_conf`'s `tls`):
    the broker's certificate and key, and the CA its clients' certificates are checked
    against when `require_certificate` (a client must then show one it signed, besides
    its user and password). PEM files, named by absolute path in the configuration;
    Mosquitto reads them again on SIGHUP (a renewed certificate needs no restart)."""

    certfile: Path
    keyfile: Path
    cafile: Path | None = None
    port: int = TLS_PORT
    bind: str | None = None
    require_certificate: bool = False

    def lines(self) -> str:
        """The listener's lines, ValueError naming a file that is missing."""
        if self.require_certificate and self.cafile is None:
            raise ValueError("require_certificate needs the CA of the clients' certificates")
        head = _check_listener(self.port, self.bind)
        out = [head]
        for option, path in (("certfile", self.certfile), ("keyfile", self.keyfile),
                             ("cafile", self.cafile)):  # fmt: skip
            if path is None:
                continue
            if not Path(path).is_file():
                raise ValueError(f"TLS listener: no {option} at {path}")
            out.append(f"{option} {Path(path).resolve()}")
        if self.require_certificate:
            out.append("require_certificate true")
        # Client ids bound to users is a listener's option (_bound): on this one too.
        out.append("use_username_as_clientid true")
        return "\n".join(out) + "\n"


def _check_listener(port: int, bind: str | None) -> str:
    if not 0 < port < 65536:
        raise ValueError(f"bad port {port}")
    if bind is not None and not re.fullmatch(r"[^\s#]+", bind):
        raise ValueError(f"bad listener address {bind!r}")
    return f"listener {port}" + (f" {bind}" if bind else "")


def mosquitto_conf(
    directory: Path | str,
    entries: Mapping[str, str],
    acl: str,
    port: int = 1883,
    bind: str | None = None,
    tls: TLSListener | None = None,
) -> Path:
    """Write a complete Mosquitto configuration into `directory`: `passwords` (from
    entries already hashed), `acl` and `mosquitto.conf`, which listens on `port` (on
    `bind`, or every interface), and over TLS as `tls` says too, authenticates every
    client and uses the other two. Returns the path of `mosquitto.conf`, for
    `mosquitto -c`.

    Written again with other users, the files are replaced whole (each by a rename), so
    a broker sent SIGHUP reloads either the old or the new ones, never half of each.
    """
    listener = _check_listener(port, bind)
    more = tls.lines() if tls is not None else ""
    lines = write_broker_files(directory, entries, acl) + more
    return _whole_conf(Path(directory), listener, lines, "then send Mosquitto SIGHUP to reload")


def dynsec_mosquitto_conf(
    directory: Path | str,
    document: Mapping[str, Any],
    port: int = 1883,
    bind: str | None = None,
    plugin: Path | str | None = None,
    tls: TLSListener | None = None,
) -> Path:
    """`mosquitto_conf` with the dynamic security plugin instead of the password file and
    the ACL: `dynsec.json` (dynsec_config's `document`) and `mosquitto.conf` in
    `directory`. Written again, it takes a restart of the broker (write_dynsec_files);
    with the persistence this config turns on, sessions and what waits in them survive it.
    """
    listener = _check_listener(port, bind)
    more = tls.lines() if tls is not None else ""
    lines = write_dynsec_files(directory, document, plugin) + more
    return _whole_conf(Path(directory), listener, lines, "then restart Mosquitto")


# The user Mosquitto switches to when started as root (its default `user`).
BROKER_USER = "mosquitto"


def _broker_owner(directory: Path) -> tuple[int, int] | None:
    """Run as root: the uid and gid of Mosquitto's own user when it exists and can reach
    `directory` (every directory above it searchable by others), else None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    import pwd

    try:
        entry = pwd.getpwnam(BROKER_USER)
    except KeyError:
        return None
    for parent in directory.resolve().parents:
        if not parent.stat().st_mode & 0o001:
            return None
    return entry.pw_uid, entry.pw_gid


def _whole_conf(directory: Path, listener: str, lines: str, reload: str) -> Path:
    # Started as root, Mosquitto warns when told to stay root (`user root`, which
    # `_bound` writes so that it can read these private files): where its own user can
    # reach the directory, that user owns the directory and the files instead (still
    # 0600), and Mosquitto switches to it as it does by default. Otherwise root it stays.
    owner = _broker_owner(directory) if "\nuser root\n" in f"\n{lines}" else None
    if owner is not None:
        lines = f"\n{lines}".replace("\nuser root\n", f"\nuser {BROKER_USER}\n", 1)[1:]
    text = (
        "# Wren's broker (written by server_bridge/brokerconf.py from the registry; written\n"
        f"# again after every change of its users: {reload}).\n"
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
    if owner is not None:
        # The persistence database is written into the directory, by that user.
        for path in (directory, *directory.iterdir()):
            os.chown(path, *owner)
    return conf
