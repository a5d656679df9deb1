"""The bridge's registry: tenants (with their token secrets), devices, broker users and
grants.

A device's identity is its broker-authenticated MQTT user, which the broker's ACL binds
to its topic subtree; the registry maps that device id to the tenant that owns it and
the agent it runs. Nothing in a payload is consulted for that mapping.

The broker's users are kept here too (`users`: name, role, tenant and the `$7$` hash of
the password, never the password), so that Mosquitto's password file and ACL follow
from the registry (`wren broker-files`): a device's user is its device id, a tenant's
host users are `host-<tenant>` and others, and the bridge has users of its own. User
names and device ids share one name space, since the ACL's device rules apply to any
user whose name is a device id. Each bridge user's sibling users (`<user>.ctl`, its
control connection's login, and `<user>.l1` to `.l3`, its links', with its password:
brokerconf.sibling_users) are not stored but are in that name space too: no one else
may be given their names.

Grants (`grants`: tenant, agent, field, access) say which agents of a tenant may use
which of its `tenant` memory fields: `field` is a field name or `*` (every tenant
field), `access` is `read` or `write` (read and write). One record per (tenant, agent,
field); adding it again changes its access. The rule they follow (a field's own grant
wins over `*`) is server_bridge/memory/grants.py's. A grant may name an agent no device
runs yet: it applies once one does. The bridge looks up the calling agent's grants on
every memory call, from the parsed snapshot below, already grouped per agent.

Every change is one write of the file, whatever it touches (a device and its user are
added together or not at all).

Every bridge message looks up its device (and a session token its tenant) on paho's
single network thread, so lookups are served from records parsed once per version of
the file: a lookup costs one `stat`, and the file is parsed again only when another
version is at the path (another process, such as the provisioning CLI, renamed a new
file over it) or when this registry wrote it. For two seconds after a file is written
its version does not yet prove its bytes (`store.settled`), so a lookup then also reads
the file and compares the bytes; it parses only if they differ.
"""

from __future__ import annotations

import copy
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from tinydb import Query, TinyDB

from edge_runtime.events import MAX_ID
from server_bridge.brokerconf import (
    SIBLING_SUFFIXES,
    check_entry,
    check_user,
    sibling_users,
)
from server_bridge.memory.grants import (
    ALL_FIELDS,
    KNOWLEDGE_FIELD,
    KNOWLEDGE_PREFIX,
    NO_GRANTS,
    WRITE,
    Grants,
    check_access,
    check_grant_field,
    lesser,
)
from server_bridge.store import (
    AtomicJSONStorage,
    FileVersion,
    parse_document,
    settled,
)
from server_bridge.topics import check_id, check_user_id, is_user_id

__all__ = [
    "BRIDGE",
    "DEVICE",
    "HOST",
    "RECHECK_S",
    "ROLES",
    "BrokerUser",
    "DeviceRecord",
    "Grant",
    "Registry",
    "RegistryStore",
    "UserGrant",
    "RegistryError",
    "host_user",
    "provision",
]

# The roles of a broker user: what the ACL grants it (server_bridge/brokerconf.py).
BRIDGE = "bridge"
HOST = "host"
DEVICE = "device"
ROLES = (BRIDGE, HOST, DEVICE)

# An agent name is an id like any other (the board sends it in hello and status).
MAX_AGENT = MAX_ID
# What another process writes to the registry (a `wren device add`) reaches a running
# bridge within this many seconds (Registry.recheck_s).
RECHECK_S = 0.25


class RegistryError(ValueError):
    """A registry change that would make the registry inconsistent."""


@dataclass(frozen=True)
class DeviceRecord:
    device: str
    tenant: str
    agent: str


@dataclass(frozen=True)
class BrokerUser:
    """A broker user: `tenant` is None for a bridge user; `password_hash` is the `$7$`
    entry of Mosquitto's password file (kept out of the repr all the same). A host user
    with `usr` reads only that end user's runs; one without is a watcher, which reads
    every user's runs of its tenant (PROTOCOL.md "Who sees what"; brokerconf.py writes
    the rights)."""

    user: str
    role: str
    tenant: str | None
    password_hash: str = field(repr=False)
    usr: str | None = None


@dataclass(frozen=True)
class Grant:
    """Agent `agent` of tenant `tenant` may use tenant field `field` (`*`: every one):
    `access` `read`, or `write` (read and write)."""

    tenant: str
    agent: str
    field: str
    access: str


@dataclass(frozen=True)
class UserGrant:
    """End user `usr` of tenant `tenant` (a session token's user, PROTOCOL "Identity")
    may read (`read`) or read and write (`write`: ingest and delete) knowledge
    collection `field` (`kb:<collection>`) over the hosts' HTTP API. Knowledge only: a
    host never reaches memory fields."""

    tenant: str
    usr: str
    field: str
    access: str


def host_user(tenant: str) -> str:
    """The host user `wren tenant add` makes for a tenant (the name the demo uses too)."""
    return f"host-{check_id(tenant, 'tenant')}"


def _check_agent(agent: object) -> str:
    if not isinstance(agent, str) or not 0 < len(agent) <= MAX_AGENT or not agent.isprintable():
        raise RegistryError(f"agent must be a printable str of 1..{MAX_AGENT} chars")
    return agent


def _check_secret_hex(secret: str) -> str:
    try:
        raw = bytes.fromhex(secret)
    except ValueError as e:
        raise RegistryError("a tenant secret must be hex") from e
    if len(raw) < 16:
        raise RegistryError("a tenant secret must be at least 16 bytes")
    return raw.hex()


@dataclass(frozen=True)
class _Snapshot:
    """The registry as parsed from one version of its file (None: there was no file).

    Documents are kept as TinyDB stored them and turned into results per lookup, so a
    malformed record fails the lookups of that record, as it did when TinyDB served them.
    `by_tenant` and `by_device` keep the first document of each id in file order: the
    one TinyDB's `get` returned.
    """

    version: FileVersion | None
    data: bytes
    # Whether `version` alone identifies `data` (see store.settled); until then each
    # lookup re-reads the file and compares the bytes.
    settled: bool
    tenant_docs: tuple[dict[str, Any], ...]
    device_docs: tuple[dict[str, Any], ...]
    by_tenant: dict[str, dict[str, Any]]
    by_device: dict[str, dict[str, Any]]
    # A registry written before users were kept has no `users` table: none, then.
    user_docs: tuple[dict[str, Any], ...] = ()
    by_user: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Nor one written before grants were kept. `grants_by` holds each (tenant, agent)'s
    # grants built once per version of the file: a memory call's lookup is a dict get.
    grant_docs: tuple[dict[str, Any], ...] = ()
    grants_by: dict[tuple[str, str], Grants] = field(default_factory=dict)
    # End users' grants of knowledge collections, (tenant, usr) -> Grants, the same way.
    user_grant_docs: tuple[dict[str, Any], ...] = ()
    user_grants_by: dict[tuple[str, str], Grants] = field(default_factory=dict)


_EMPTY = _Snapshot(None, b"", True, (), (), {}, {})


def _table_docs(doc: dict[str, Any], table: str, path: object) -> tuple[dict[str, Any], ...]:
    rows = doc.get(table, {})
    if not isinstance(rows, dict) or not all(isinstance(r, dict) for r in rows.values()):
        raise ValueError(f"{path}: table {table!r} does not hold TinyDB documents")
    return tuple(rows.values())


def _index(docs: tuple[dict[str, Any], ...], key: str) -> dict[str, dict[str, Any]]:
    index: dict[str, dict[str, Any]] = {}
    for d in docs:
        value = d.get(key)
        if isinstance(value, str) and value not in index:
            index[value] = d
    return index


def _grants_index(
    docs: tuple[dict[str, Any], ...],
    read: Callable[[dict[str, Any]], Grant | UserGrant] | None = None,
) -> dict[tuple[str, str], Grants]:
    """Each agent's grants (each end user's, with `read` _user_grant). A malformed
    record grants nothing (and `Registry.grants` names it), rather than failing every
    lookup of the file; two records of one grant (a hand edit) give the lesser access."""
    by: dict[tuple[str, str], dict[str, str]] = {}
    for d in docs:
        try:
            g = (read or _grant)(d)
        except RegistryError:
            continue
        who = g.agent if isinstance(g, Grant) else g.usr
        fields = by.setdefault((g.tenant, who), {})
        old = fields.get(g.field)
        fields[g.field] = g.access if old is None else lesser(old, g.access)
    return {who: Grants(fields) for who, fields in by.items()}


def _parse(version: FileVersion, data: bytes, seen_at_ns: int, path: object) -> _Snapshot:
    doc = parse_document(data, str(path))
    if doc is None:
        return replace(_EMPTY, version=version, data=data, settled=settled(version, seen_at_ns))
    tenant_docs = _table_docs(doc, "tenants", path)
    device_docs = _table_docs(doc, "devices", path)
    user_docs = _table_docs(doc, "users", path)
    grant_docs = _table_docs(doc, "grants", path)
    user_grant_docs = _table_docs(doc, "user_grants", path)
    return _Snapshot(
        version,
        data,
        settled(version, seen_at_ns),
        tenant_docs,
        device_docs,
        _index(tenant_docs, "tenant"),
        _index(device_docs, "device"),
        user_docs,
        _index(user_docs, "user"),
        grant_docs,
        _grants_index(grant_docs),
        user_grant_docs,
        _grants_index(user_grant_docs, _user_grant),
    )


class _OneWriteStorage(AtomicJSONStorage):
    """The registry's storage: while a change is open (`begin`), TinyDB's writes are
    held in memory and its reads see them; `commit` writes the result once.

    TinyDB writes the whole file once per table operation, so a change of two tables
    (a device and its broker user) would otherwise be two writes, and a crash or a full
    disk between them would leave one without the other.
    """

    def __init__(self, path: str | os.PathLike[str], create_dirs: bool = True, **json_kw: Any):
        super().__init__(path, create_dirs, **json_kw)
        self._open = False
        self._pending: dict[str, dict[str, Any]] | None = None

    def begin(self) -> None:
        self._open, self._pending = True, None

    def commit(self) -> None:
        pending = self._pending
        self.abort()
        if pending is not None:
            super().write(pending)

    def abort(self) -> None:
        self._open, self._pending = False, None

    def read(self) -> dict[str, dict[str, Any]] | None:
        if self._pending is not None:
            # A copy: TinyDB changes what `read` returns before it writes it back.
            return copy.deepcopy(self._pending)
        return super().read()

    def write(self, data: dict[str, dict[str, Any]]) -> None:
        if self._open:
            self._pending = data
        else:
            super().write(data)


class RegistryStore(Protocol):
    """What the bridge, the services and the CLI use of a registry: `Registry` (one
    TinyDB file) and `pgstore.registry.PgRegistry` (PostgreSQL, several bridges) both
    are one."""

    def add_tenant(
        self,
        tenant: str,
        secret: bytes | str | None = None,
        *,
        host_password_hash: str | None = None,
    ) -> str: ...
    def tenant_secret(self, tenant: str) -> str | None: ...
    def tenants(self) -> list[str]: ...
    def add_device(self, device: str, tenant: str, agent: str) -> DeviceRecord: ...
    def enroll_device(
        self, device: str, tenant: str, agent: str, password_hash: str
    ) -> DeviceRecord: ...
    def remove_device(self, device: str) -> bool: ...
    def device(self, device: str) -> DeviceRecord | None: ...
    def devices(self) -> list[DeviceRecord]: ...
    def devices_token(self) -> object: ...
    def devices_of(self, tenant: str) -> list[DeviceRecord]: ...
    def add_user(
        self,
        user: str,
        role: str,
        tenant: str | None,
        password_hash: str,
        *,
        usr: str | None = None,
    ) -> BrokerUser: ...
    def set_password_hash(self, user: str, password_hash: str) -> BrokerUser: ...
    def set_device_password_hash(self, device: str, password_hash: str) -> BrokerUser: ...
    def user(self, user: str) -> BrokerUser | None: ...
    def users(self) -> list[BrokerUser]: ...
    def add_grant(
        self, tenant: str, agent: str, field: str = ALL_FIELDS, access: str = WRITE
    ) -> Grant: ...
    def remove_grant(self, tenant: str, agent: str, field: str = ALL_FIELDS) -> bool: ...
    def grants(self, tenant: str | None = None) -> list[Grant]: ...
    def grants_of(self, tenant: str, agent: str) -> Grants: ...
    def add_user_grant(
        self, tenant: str, usr: str, field: str, access: str = WRITE
    ) -> UserGrant: ...
    def remove_user_grant(self, tenant: str, usr: str, field: str) -> bool: ...
    def user_grants(self, tenant: str | None = None) -> list[UserGrant]: ...
    def user_grants_of(self, tenant: str, usr: str) -> Grants: ...
    def close(self) -> None: ...
    def __enter__(self) -> RegistryStore: ...
    def __exit__(self, *exc: object) -> None: ...



class Registry:
    """Tenants {tenant, secret (hex)}, devices {device, tenant, agent}, broker users
    {user, role, tenant, hash} and grants {tenant, agent, field, access} in one TinyDB
    file."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        recheck_s: float = RECHECK_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.path = path
        # How long a lookup trusts the snapshot without asking the file system: the
        # bridge looks a device up for every message, and a stat costs 10-20 us here (a
        # sixth of what relaying an event costs). What another process writes is seen
        # within this long; what this registry writes, at once.
        self._recheck_s = recheck_s
        self._clock = clock
        self._recheck_at = 0.0
        self._db = TinyDB(path, storage=_OneWriteStorage)
        # cache_size=0: TinyDB's per-table query cache would keep serving results after
        # another process (the provisioning CLI) changed the file.
        self._tenants = self._db.table("tenants", cache_size=0)
        self._devices = self._db.table("devices", cache_size=0)
        self._users = self._db.table("users", cache_size=0)
        self._grants = self._db.table("grants", cache_size=0)
        self._user_grants = self._db.table("user_grants", cache_size=0)
        storage = self._db.storage
        if not isinstance(storage, _OneWriteStorage):
            raise TypeError("the registry needs its file on its own storage")
        self._storage = storage
        # The parsed file behind every lookup; None until the first lookup and after a
        # write through this registry.
        self._snap: _Snapshot | None = None
        # TinyDB is not thread-safe, and the bridge reads (and so may re-parse) from
        # paho's network thread while tools/tests write: one lock for the TinyDB file and
        # the snapshot, so a lookup never sees a snapshot half replaced.
        self._lock = threading.Lock()

    def _current(self) -> _Snapshot:
        """The snapshot of the file now at the path (as of at most recheck_s ago). The
        caller holds the lock."""
        snap = self._snap
        now = self._clock()
        if snap is not None and now < self._recheck_at:
            return snap
        self._recheck_at = now + self._recheck_s
        version = self._storage.version()
        if snap is not None and version == snap.version and (version is None or snap.settled):
            return snap
        # The clock is read before the file: `settled` needs a time no later than the
        # moment the bytes were seen, so that any write after it gets a later mtime.
        seen_at_ns = time.time_ns()
        got = self._storage.read_bytes()
        if got is None:
            snap = _EMPTY
        elif snap is not None and got[1] == snap.data:
            # Same bytes (a version not yet settled, or a rewrite of the same content):
            # keep the parse, and note the version these bytes now have.
            snap = replace(snap, version=got[0], settled=settled(got[0], seen_at_ns))
        else:
            snap = _parse(got[0], got[1], seen_at_ns, self.path)
        self._snap = snap
        return snap

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """One change: what it writes reaches the file in one write when it returns, and
        not at all when it raises (a refusal found after a first table was changed)."""
        with self._lock:
            self._storage.begin()
            try:
                yield
                self._storage.commit()
            finally:
                self._storage.abort()
                # Written or not (a failed rename leaves the old file), the next lookup
                # reads the file as it now is rather than trust a version compare.
                self._snap = None

    def _check_name_free(self, name: str) -> None:
        """Refuse a new broker user or device named like an existing one. The caller
        holds the lock, in a change."""
        q = Query()
        if self._devices.get(q.device == name) is not None:
            raise RegistryError(f"{name!r} is a device")
        if self._users.get(q.user == name) is not None:
            raise RegistryError(f"broker user {name!r} already exists")
        # A bridge user's sibling users (its control and link users) are not stored:
        # they are made from the name wherever the broker's files are written
        # (brokerconf.sibling_users). Anyone else taking such a name would log in with
        # the bridge's rights under the ACL written for it.
        for suffix in SIBLING_SUFFIXES:
            if name.endswith(suffix):
                owner = self._users.get(q.user == name[: -len(suffix)])
                if isinstance(owner, dict) and owner.get("role") == BRIDGE:
                    raise RegistryError(
                        f"{name!r} is bridge user {owner['user']!r}'s "
                        + ("control user" if suffix == SIBLING_SUFFIXES[0] else "link user")
                    )

    # ------------------------------------------------------------------ tenants

    def add_tenant(
        self,
        tenant: str,
        secret: bytes | str | None = None,
        *,
        host_password_hash: str | None = None,
    ) -> str:
        """Register a tenant; returns its token secret as hex (generated when not given).

        Secrets are hex strings at this API and in the file; `bytes.fromhex` gives the
        key for tokens.sign / tokens.verify. With `host_password_hash` (a `$7$` entry)
        the tenant's host user `host_user(tenant)` is added in the same write.
        """
        check_id(tenant, "tenant")
        if secret is None:
            secret_hex = secrets.token_hex(32)
        elif isinstance(secret, bytes):
            secret_hex = _check_secret_hex(secret.hex())
        else:
            secret_hex = _check_secret_hex(secret)
        q = Query()
        with self._writing():
            if self._tenants.get(q.tenant == tenant) is not None:
                # Replacing a secret silently would void every live session token.
                raise RegistryError(f"tenant {tenant!r} already exists")
            self._tenants.insert({"tenant": tenant, "secret": secret_hex})
            if host_password_hash is not None:
                self._insert_user(host_user(tenant), HOST, tenant, host_password_hash)
        return secret_hex

    def tenant_secret(self, tenant: str) -> str | None:
        """The tenant's token secret as hex, or None for an unknown tenant."""
        check_id(tenant, "tenant")
        with self._lock:
            doc = self._current().by_tenant.get(tenant)
        return None if doc is None else str(doc["secret"])

    def tenants(self) -> list[str]:
        with self._lock:
            docs = self._current().tenant_docs
        return sorted(str(doc["tenant"]) for doc in docs)

    # ------------------------------------------------------------------ devices

    def add_device(self, device: str, tenant: str, agent: str) -> DeviceRecord:
        """Register a device (or re-provision it with a new agent) for an existing tenant.

        A device already owned by another tenant is refused: moving hardware between
        tenants is a deliberate `remove_device` first, never a side effect.
        """
        check_id(device, "device")
        check_id(tenant, "tenant")
        _check_agent(agent)
        q = Query()
        with self._writing():
            if self._tenants.get(q.tenant == tenant) is None:
                raise RegistryError(f"unknown tenant {tenant!r}")
            old = self._devices.get(q.device == device)
            if isinstance(old, dict) and old.get("tenant") != tenant:
                raise RegistryError(f"device {device!r} belongs to another tenant")
            user = self._users.get(q.user == device)
            if isinstance(user, dict) and user.get("role") != DEVICE:
                # The ACL's device rules would give that user this device's topics.
                raise RegistryError(f"{device!r} is a broker user of role {user.get('role')!r}")
            self._devices.upsert(
                {"device": device, "tenant": tenant, "agent": agent}, q.device == device
            )
        return DeviceRecord(device, tenant, agent)

    def enroll_device(
        self, device: str, tenant: str, agent: str, password_hash: str
    ) -> DeviceRecord:
        """Register a new device with its broker user (the device id, with this `$7$`
        password entry), in one write. Unlike `add_device`, a device that exists is
        refused, as is a name a broker user already has."""
        check_id(device, "device")
        check_id(tenant, "tenant")
        _check_agent(agent)
        check_entry(password_hash)
        q = Query()
        with self._writing():
            if self._tenants.get(q.tenant == tenant) is None:
                raise RegistryError(f"unknown tenant {tenant!r}")
            if self._devices.get(q.device == device) is not None:
                raise RegistryError(f"device {device!r} already exists")
            self._check_name_free(device)
            self._devices.insert({"device": device, "tenant": tenant, "agent": agent})
            self._users.insert(
                {"user": device, "role": DEVICE, "tenant": tenant, "hash": password_hash}
            )
        return DeviceRecord(device, tenant, agent)

    def remove_device(self, device: str) -> bool:
        """Remove a device and its broker user; False when there was no such device."""
        check_id(device, "device")
        q = Query()
        with self._writing():
            self._users.remove((q.user == device) & (q.role == DEVICE))
            return bool(self._devices.remove(q.device == device))

    def device(self, device: str) -> DeviceRecord | None:
        """The record of a device, or None when the registry does not know it."""
        check_id(device, "device")
        with self._lock:
            doc = self._current().by_device.get(device)
        return None if doc is None else _record(doc)

    def devices(self) -> list[DeviceRecord]:
        """Every device, by id."""
        with self._lock:
            docs = self._current().device_docs
        return sorted((_record(d) for d in docs), key=lambda r: r.device)

    def devices_token(self) -> object:
        """Something that changes whenever the set of devices may have (the parsed
        file's device table): compared by identity, a check costs no copy."""
        with self._lock:
            return self._current().device_docs

    def devices_of(self, tenant: str) -> list[DeviceRecord]:
        check_id(tenant, "tenant")
        with self._lock:
            docs = self._current().device_docs
        return sorted(
            (_record(d) for d in docs if d.get("tenant") == tenant), key=lambda r: r.device
        )

    # ------------------------------------------------------------------ broker users

    def add_user(
        self,
        user: str,
        role: str,
        tenant: str | None,
        password_hash: str,
        *,
        usr: str | None = None,
    ) -> BrokerUser:
        """Add a bridge user (`tenant` None) or a host user of an existing tenant, with
        its `$7$` password entry; a host user with `usr` is bound to that end user (it
        reads that user's runs only), one without is a watcher. A device's user comes
        with the device (`enroll_device`). A name already taken, by a user or a device,
        is refused."""
        with self._writing():
            return self._insert_user(user, role, tenant, password_hash, usr)

    def _insert_user(
        self, user: str, role: str, tenant: str | None, password_hash: str, usr: str | None = None
    ) -> BrokerUser:
        """The caller holds the lock, in a change."""
        check_user(user)
        check_entry(password_hash)
        if usr is not None:
            if role != HOST:
                raise RegistryError("only a host user is bound to an end user")
            check_user_id(usr)
        if role == BRIDGE:
            if tenant is not None:
                raise RegistryError("a bridge user belongs to no tenant")
        elif role == HOST:
            if tenant is None:
                raise RegistryError("a host user belongs to a tenant")
            check_id(tenant, "tenant")
            if self._tenants.get(Query().tenant == tenant) is None:
                raise RegistryError(f"unknown tenant {tenant!r}")
        else:
            raise RegistryError(f"role must be {BRIDGE!r} or {HOST!r}, not {role!r}")
        self._check_name_free(user)
        if role == BRIDGE:
            # Its control and link users come with it, so those names must be free and
            # fit too.
            for sibling in sibling_users(user):
                self._check_name_free(sibling)
        doc = {"user": user, "role": role, "tenant": tenant, "hash": password_hash}
        if usr is not None:
            doc["usr"] = usr
        self._users.insert(doc)
        return BrokerUser(user, role, tenant, password_hash, usr)

    def set_password_hash(self, user: str, password_hash: str) -> BrokerUser:
        """Give an existing broker user a new `$7$` password entry (its old password stops
        working once the broker's files are written again and reloaded)."""
        check_user(user)
        check_entry(password_hash)
        q = Query()
        with self._writing():
            doc = self._users.get(q.user == user)
            if not isinstance(doc, dict):
                raise RegistryError(f"unknown broker user {user!r}")
            self._users.update({"hash": password_hash}, q.user == user)
        return replace(_user(doc), password_hash=password_hash)

    def set_device_password_hash(self, device: str, password_hash: str) -> BrokerUser:
        """A new `$7$` password entry for a registered device's broker user, which is
        added when the device has none (one registered before users were kept, or by
        `add_device`)."""
        check_id(device, "device")
        check_entry(password_hash)
        q = Query()
        with self._writing():
            record = self._devices.get(q.device == device)
            if not isinstance(record, dict):
                raise RegistryError(f"unknown device {device!r}")
            tenant = str(record["tenant"])
            doc = self._users.get(q.user == device)
            if doc is None:
                self._users.insert(
                    {"user": device, "role": DEVICE, "tenant": tenant, "hash": password_hash}
                )
            elif isinstance(doc, dict) and doc.get("role") == DEVICE:
                self._users.update({"hash": password_hash}, q.user == device)
            else:
                raise RegistryError(f"broker user {device!r} is not the device's")
        return BrokerUser(device, DEVICE, tenant, password_hash)

    def user(self, user: str) -> BrokerUser | None:
        """A broker user, or None when the registry does not know it."""
        with self._lock:
            doc = self._current().by_user.get(user)
        return None if doc is None else _user(doc)

    def users(self) -> list[BrokerUser]:
        """Every broker user, by name."""
        with self._lock:
            docs = self._current().user_docs
        return sorted((_user(d) for d in docs), key=lambda u: u.user)

    # ------------------------------------------------------------------ grants

    def add_grant(
        self, tenant: str, agent: str, field: str = ALL_FIELDS, access: str = WRITE
    ) -> Grant:
        """Let `agent` of an existing tenant use tenant field `field` (`*`: every one)
        with `access` (`read` or `write`); an existing grant of that field gets the new
        access. RegistryError when the tenant is unknown or a value is malformed."""
        grant = _checked_grant(tenant, agent, field, access)
        q = Query()
        with self._writing():
            if self._tenants.get(q.tenant == tenant) is None:
                raise RegistryError(f"unknown tenant {tenant!r}")
            self._grants.upsert(
                {"tenant": tenant, "agent": agent, "field": field, "access": access},
                (q.tenant == tenant) & (q.agent == agent) & (q.field == field),
            )
        return grant

    def remove_grant(self, tenant: str, agent: str, field: str = ALL_FIELDS) -> bool:
        """Take back `agent`'s grant of `field` in `tenant` (its `*` grant by default;
        grants of single fields stay); False when there was none."""
        _checked_grant(tenant, agent, field, WRITE)
        q = Query()
        which = (q.tenant == tenant) & (q.agent == agent) & (q.field == field)
        with self._writing():
            # Looked for first: TinyDB's remove writes the file even when nothing matches.
            if not self._grants.contains(which):
                return False
            self._grants.remove(which)
            return True

    def grants(self, tenant: str | None = None) -> list[Grant]:
        """Every grant (of one tenant), by tenant, agent and field. A malformed record is
        a RegistryError naming it (lookups skip it: it grants nothing)."""
        if tenant is not None:
            check_id(tenant, "tenant")
        with self._lock:
            docs = self._current().grant_docs
        got = [_grant(d) for d in docs if tenant is None or d.get("tenant") == tenant]
        return sorted(got, key=lambda g: (g.tenant, g.agent, g.field))

    def grants_of(self, tenant: str, agent: str) -> Grants:
        """What `agent` of `tenant` may do with the tenant's fields (the memory service
        asks on every call: one dict lookup in the parsed snapshot)."""
        with self._lock:
            return self._current().grants_by.get((tenant, agent), NO_GRANTS)

    # ------------------------------------------------------------------ end users' grants

    def add_user_grant(self, tenant: str, usr: str, field: str, access: str = WRITE) -> UserGrant:
        """Let end user `usr` of an existing tenant read (`read`) or also ingest into and
        delete from (`write`) knowledge collection `field` (`kb:<collection>`) over
        HTTP; an existing grant gets the new access."""
        grant = _checked_user_grant(tenant, usr, field, access)
        q = Query()
        with self._writing():
            if self._tenants.get(q.tenant == tenant) is None:
                raise RegistryError(f"unknown tenant {tenant!r}")
            self._user_grants.upsert(
                {"tenant": tenant, "usr": usr, "field": field, "access": access},
                (q.tenant == tenant) & (q.usr == usr) & (q.field == field),
            )
        return grant

    def remove_user_grant(self, tenant: str, usr: str, field: str) -> bool:
        """Take back `usr`'s grant of `field`; False when there was none."""
        _checked_user_grant(tenant, usr, field, WRITE)
        q = Query()
        which = (q.tenant == tenant) & (q.usr == usr) & (q.field == field)
        with self._writing():
            if not self._user_grants.contains(which):
                return False
            self._user_grants.remove(which)
            return True

    def user_grants(self, tenant: str | None = None) -> list[UserGrant]:
        """Every end user's grant (of one tenant), by tenant, user and field."""
        if tenant is not None:
            check_id(tenant, "tenant")
        with self._lock:
            docs = self._current().user_grant_docs
        got = [_user_grant(d) for d in docs if tenant is None or d.get("tenant") == tenant]
        return sorted(got, key=lambda g: (g.tenant, g.usr, g.field))

    def user_grants_of(self, tenant: str, usr: str) -> Grants:
        """What end user `usr` of `tenant` may do with the tenant's knowledge (the HTTP
        API asks on every knowledge call: one dict lookup in the parsed snapshot)."""
        with self._lock:
            return self._current().user_grants_by.get((tenant, usr), NO_GRANTS)

    def close(self) -> None:
        with self._lock:
            self._db.close()
            self._snap = None

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def provision(
    path: str | os.PathLike[str], tenant: str, devices: Iterable[tuple[str, str]]
) -> Registry:
    """Open the registry at `path` (creating the file and its directory) with `tenant`
    and each (device, agent) of `devices` in it; the caller closes it.

    Only what is missing is added, so a service may run this at every start: a tenant
    already there keeps its secret (a new one would void every live session token) and
    a device already there keeps its record, even one of another tenant (moving or
    re-provisioning a device is a deliberate `add_device` / `remove_device`).
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    registry = Registry(path)
    try:
        if registry.tenant_secret(tenant) is None:
            registry.add_tenant(tenant)
        for device, agent in devices:
            if registry.device(device) is None:
                registry.add_device(device, tenant, agent)
    except BaseException:
        registry.close()  # a bad id: the caller gets the error, not an open file
        raise
    return registry


def _record(doc: dict[str, Any]) -> DeviceRecord:
    return DeviceRecord(str(doc["device"]), str(doc["tenant"]), str(doc["agent"]))


def _checked_grant(tenant: str, agent: str, field: str, access: str) -> Grant:
    """The grant, its values checked: a bad tenant id is topics.BadTopic (as everywhere
    in the registry), anything else RegistryError."""
    check_id(tenant, "tenant")
    _check_agent(agent)
    try:
        return Grant(tenant, agent, check_grant_field(field), check_access(access))
    except ValueError as e:
        raise RegistryError(str(e)) from None


def _checked_user_grant(tenant: str, usr: str, field: str, access: str) -> UserGrant:
    check_id(tenant, "tenant")
    if not is_user_id(usr):
        raise RegistryError(f"a user id is 1-64 characters a topic level can hold, not {usr!r}")
    if not isinstance(field, str) or not KNOWLEDGE_FIELD.match(field):
        raise RegistryError(
            f"an end user is granted a knowledge collection ({KNOWLEDGE_PREFIX}<collection>), "
            f"not {field!r}"
        )
    try:
        return UserGrant(tenant, usr, field, check_access(access))
    except ValueError as e:
        raise RegistryError(str(e)) from None


def _user_grant(doc: dict[str, Any]) -> UserGrant:
    try:
        return _checked_user_grant(doc["tenant"], doc["usr"], doc["field"], doc["access"])
    except (KeyError, ValueError) as e:
        raise RegistryError(f"a malformed user grant in the registry: {doc!r} ({e})") from None


def _grant(doc: dict[str, Any]) -> Grant:
    try:
        return _checked_grant(doc["tenant"], doc["agent"], doc["field"], doc["access"])
    except (KeyError, ValueError) as e:
        raise RegistryError(f"a malformed grant in the registry: {doc!r} ({e})") from None


def _user(doc: dict[str, Any]) -> BrokerUser:
    tenant = doc.get("tenant")
    # A host user written before users were bound has no `usr`: a watcher, the reach
    # every host user had then.
    usr = doc.get("usr")
    return BrokerUser(
        str(doc["user"]),
        str(doc["role"]),
        None if tenant is None else str(tenant),
        str(doc["hash"]),
        None if usr is None else str(usr),
    )
