"""The registry on PostgreSQL: `PgRegistry`, the `Registry` several bridges share.

It keeps what server_bridge/registry.py's `Registry` keeps (tenants and their token
secrets, devices, broker users, agents' and end users' grants), refuses the same bad
input with the same errors, and answers lookups the same way. The rules are that
module's: ids, agents, secrets, `$7$` entries and grants are checked by its functions,
and lookups build their results with them.

Tables (migrations/0003_registry.sql): `wren_reg_tenants`, `wren_reg_devices`,
`wren_reg_users`, `wren_reg_grants`, `wren_reg_user_grants`, and `wren_reg_names`, the
broker's one name space (device ids, user names and a bridge user's sibling names), so
"a name is taken once" is a primary key, not a check two bridges could both pass. A
device user shares its device's name row and has a foreign key to the device: it goes
with the device, in the device's tenant.

Writes. Every write transaction first bumps the one row of `wren_reg_version`: its row
lock makes registry writes take turns across every bridge and CLI, so the checks that
follow (READ COMMITTED: each statement sees what committed before it) see every earlier
write and refuse with the file registry's words ("device 'dev1' already exists"). The
constraints hold all the same for a writer that does not take the lock; their refusal
is a RegistryError too. Two bridges adding one name at once: the second waits for the
first's commit, then finds the name taken. A change that turns out to change nothing
(removing what is not there) rolls back, so the version does not move.

Reads. Every bridge message looks up its device on paho's network thread, so lookups
are served from a snapshot of every table held in this process, tagged with the
version it was read at. A lookup asks the database for the version at most every
`recheck_s` (RECHECK_S, 0.25 s, as the file registry stats its file) and reloads the
tables (one REPEATABLE READ transaction, so the snapshot is one version's) only when
the version moved. A lookup that misses (an unknown device, tenant or user: perhaps
one just enrolled by another process) asks at most every `miss_recheck_s` instead. So
another process's write is seen within recheck_s (a miss, within miss_recheck_s) plus a
round trip, and this registry's own writes at once: the version its write committed is
the least a following lookup accepts. While one thread checks, the others are served
the snapshot they have (within the same staleness), so the network thread never queues
behind another thread's round trip; it waits only for its own check.

Why a polled version row, not LISTEN/NOTIFY: a notification needs a connection held
open per process and a thread to read it, and one lost with its connection must be
made good by reading anyway; a version read is one indexed row, ~0.1 ms, four times a
second per process, and has no state to lose. NOTIFY could be added on top to shorten
the staleness below recheck_s; nothing here would change.

The database away: a check that fails (no connection within READ_POOL_S) serves the
snapshot held and tries again after FAIL_BACKOFF_S, for at most MAX_STALE_S since the
snapshot was last confirmed; after that, and when there is no snapshot, or this
registry's own write is not in it, the lookup raises PgUnavailable. The file registry
has no such case (a missing file is an empty registry; a torn one, an error).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from server_bridge.brokerconf import SIBLING_SUFFIXES, check_entry, check_user, sibling_users
from server_bridge.memory.grants import ALL_FIELDS, NO_GRANTS, WRITE, Grants
from server_bridge.pgstore.connect import PgUnavailable, _psycopg, store_pool

# The file registry's rules and record builders, used as they are so the two backends
# cannot drift (private there: they would be better a small public module of rules).
from server_bridge.registry import (
    BRIDGE,
    DEVICE,
    HOST,
    RECHECK_S,
    BrokerUser,
    DeviceRecord,
    Grant,
    RegistryError,
    RegistryStore,
    UserGrant,
    _check_agent,
    _check_secret_hex,
    _checked_grant,
    _checked_user_grant,
    _grant,
    _grants_index,
    _user_grant,
    host_user,
)
from server_bridge.topics import check_id, check_user_id

if TYPE_CHECKING:
    from server_bridge.registry import Registry

__all__ = [
    "FAIL_BACKOFF_S",
    "MAX_STALE_S",
    "MISS_RECHECK_S",
    "PgRegistry",
    "RegistryStore",
    "provision",
]

log = logging.getLogger(__name__)

# A lookup that misses asks the database again if it has not for this long: a device
# enrolled by another process is found at its first message, while a stranger sending
# messages costs this process at most 1 / MISS_RECHECK_S version reads a second.
MISS_RECHECK_S = 0.02
# How long a lookup waits for a pooled connection to check the version: the network
# thread would wait as long, so briefly; a write waits the pool's default.
READ_POOL_S = 1.0
# After a failed check, lookups serve the snapshot without asking for this long, so a
# database that is away costs the network thread one READ_POOL_S wait per FAIL_BACKOFF_S.
FAIL_BACKOFF_S = 2.0
# How long a snapshot is served after the database stopped answering: long enough for
# a failover or a restart of PostgreSQL, short enough that a device removed meanwhile
# (through a bridge that still reaches it) is not served for long.
MAX_STALE_S = 30.0
# Readers and the odd writer: more would queue in the pool, not fail.
POOL_SIZE = 4


@dataclass(frozen=True)
class _Snap:
    """Every table as of version `ver`, indexed for the lookups."""

    ver: int
    secrets: dict[str, str]
    # By id; the devices_token (kept from the previous snapshot when equal, so a
    # change of anything but the devices does not make the bridge re-deal its links).
    devices: tuple[DeviceRecord, ...]
    by_device: dict[str, DeviceRecord]
    users: tuple[BrokerUser, ...]
    by_user: dict[str, BrokerUser]
    # Grants as the file registry's documents, so its functions build and check them.
    grant_docs: tuple[dict[str, Any], ...]
    grants_by: dict[tuple[str, str], Grants]
    user_grant_docs: tuple[dict[str, Any], ...]
    user_grants_by: dict[tuple[str, str], Grants]


_VERSION = "SELECT ver FROM wren_reg_version"
_BUMP = "UPDATE wren_reg_version SET ver = ver + 1 RETURNING ver"
_READ_ONLY = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"
_TENANTS = "SELECT tenant, secret FROM wren_reg_tenants"
_DEVICES = "SELECT device, tenant, agent FROM wren_reg_devices"
_USERS = 'SELECT "user", role, tenant, hash, usr FROM wren_reg_users'
_GRANTS = "SELECT tenant, agent, field, access FROM wren_reg_grants"
_USER_GRANTS = "SELECT tenant, usr, field, access FROM wren_reg_user_grants"


class _Change:
    """One write transaction: `conn` inside it, the version row locked."""

    def __init__(self, conn: Any):
        self.conn = conn
        self.changed = True

    def row(self, sql: str, args: tuple[object, ...]) -> tuple[Any, ...] | None:
        got = self.conn.execute(sql, args).fetchone()
        return None if got is None else tuple(got)

    def tenant_known(self, tenant: str) -> None:
        if self.row("SELECT 1 FROM wren_reg_tenants WHERE tenant = %s", (tenant,)) is None:
            raise RegistryError(f"unknown tenant {tenant!r}")

    def name_free(self, name: str) -> None:
        """Refuse a new broker user or device named like an existing device, user or a
        bridge user's sibling (Registry._check_name_free, in its words)."""
        got = self.row("SELECT kind, owner FROM wren_reg_names WHERE name = %s", (name,))
        if got is None:
            return
        kind, owner = got
        if kind == "device":
            raise RegistryError(f"{name!r} is a device")
        if kind == "user":
            raise RegistryError(f"broker user {name!r} already exists")
        suffix = name[len(owner) :]
        raise RegistryError(
            f"{name!r} is bridge user {owner!r}'s "
            + ("control user" if suffix == SIBLING_SUFFIXES[0] else "link user")
        )


def _storable(name: str) -> str:
    """A broker user name PostgreSQL's text can hold. brokerconf's rule lets through a
    NUL and lone surrogates, which the file registry would store; here they are refused
    as malformed rather than failing in the driver."""
    if "\x00" in name:
        raise RegistryError(f"user name {name!r} cannot be stored")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise RegistryError(f"user name {name!r} cannot be stored") from None
    return name


class PgRegistry:
    """`Registry` on PostgreSQL (module docstring). `dsn_or_pool`: a libpq connection
    string (a pool of its own is opened, closed by `close()`) or a psycopg_pool pool the
    caller owns. The schema is brought up to date on open."""

    def __init__(
        self,
        dsn_or_pool: str | Any,
        recheck_s: float = RECHECK_S,
        clock: Callable[[], float] = time.monotonic,
        *,
        miss_recheck_s: float = MISS_RECHECK_S,
        max_stale_s: float = MAX_STALE_S,
        pool_size: int = POOL_SIZE,
    ):
        self._pg = _psycopg()
        self._pool, self._own_pool = store_pool(dsn_or_pool, max_size=pool_size)
        self._recheck_s = recheck_s
        self._miss_recheck_s = miss_recheck_s
        self._max_stale_s = max_stale_s
        self._clock = clock
        # The snapshot every lookup reads: replaced whole (one reference, so a reader
        # never sees half of one), by the thread holding `_refresh`.
        self._snap: _Snap | None = None
        # When the version was last read; when it last matched the snapshot; when a
        # failed check lets the next one be tried.
        self._checked_at = float("-inf")
        self._confirmed_at = float("-inf")
        self._retry_at = float("-inf")
        # The version this registry's last write committed: a lookup after it must be
        # served a snapshot at least as new (its own writes are seen at once).
        self._wrote_ver = 0
        self._refresh = threading.Lock()
        self._ver_lock = threading.Lock()

    # ------------------------------------------------------------------ reads

    def _current(self, miss: bool = False) -> _Snap:
        snap = self._snap
        if snap is not None and snap.ver >= self._wrote_ver:
            if not self._due(miss):
                return snap
            # A routine check: one thread asks, the others are served meanwhile.
            if not self._refresh.acquire(blocking=False):
                return snap
        else:
            # Nothing yet, or not this registry's own last write: wait for it.
            self._refresh.acquire()
        try:
            return self._refreshed(miss)
        finally:
            self._refresh.release()

    def _due(self, miss: bool) -> bool:
        now = self._clock()
        if now < self._retry_at:
            return False
        return now >= self._checked_at + (
            min(self._miss_recheck_s, self._recheck_s) if miss else self._recheck_s
        )

    def _refreshed(self, miss: bool) -> _Snap:
        """The snapshot, checked against the database's version. Holds `_refresh`."""
        snap = self._snap
        if snap is not None and snap.ver >= self._wrote_ver and not self._due(miss):
            return snap  # another thread checked while this one waited
        now = self._clock()
        try:
            with self._pool.connection(timeout=READ_POOL_S) as conn:
                # The check alone is one statement (~60 us here; a REPEATABLE READ
                # transaction around it costs two round trips more).
                ver = int(conn.execute(_VERSION).fetchone()[0])
                if snap is None or ver != snap.ver:
                    conn.commit()
                    with conn.transaction():
                        # One snapshot of the database for the version and the tables.
                        conn.execute(_READ_ONLY)
                        snap = self._load(conn, snap)
        except self._pg.OperationalError as e:
            if (
                snap is None
                or snap.ver < self._wrote_ver
                or now - self._confirmed_at > self._max_stale_s
            ):
                raise PgUnavailable(f"the registry's database does not answer: {e}") from e
            log.warning("registry: serving a snapshot %.1f s old: %s", now - self._confirmed_at, e)
            self._retry_at = now + FAIL_BACKOFF_S
            return snap
        self._snap = snap
        self._checked_at = self._confirmed_at = now
        return snap

    def _load(self, conn: Any, old: _Snap | None) -> _Snap:
        ver = int(conn.execute(_VERSION).fetchone()[0])
        secrets_ = {str(t): str(s) for t, s in conn.execute(_TENANTS).fetchall()}
        devices = tuple(
            sorted(
                (DeviceRecord(d, t, a) for d, t, a in conn.execute(_DEVICES).fetchall()),
                key=lambda r: r.device,
            )
        )
        if old is not None and old.devices == devices:
            devices = old.devices
        users = tuple(
            sorted(
                (BrokerUser(u, r, t, h, usr) for u, r, t, h, usr in conn.execute(_USERS)),
                key=lambda u: u.user,
            )
        )
        grant_docs = tuple(
            {"tenant": t, "agent": a, "field": f, "access": x}
            for t, a, f, x in conn.execute(_GRANTS).fetchall()
        )
        user_grant_docs = tuple(
            {"tenant": t, "usr": u, "field": f, "access": x}
            for t, u, f, x in conn.execute(_USER_GRANTS).fetchall()
        )
        return _Snap(
            ver,
            secrets_,
            devices,
            {r.device: r for r in devices},
            users,
            {u.user: u for u in users},
            grant_docs,
            _grants_index(grant_docs),
            user_grant_docs,
            _grants_index(user_grant_docs, _user_grant),
        )

    # ------------------------------------------------------------------ writes

    @contextmanager
    def _writing(self) -> Iterator[_Change]:
        """One change, in one transaction that first takes the version row (writes take
        turns); rolled back when it raises or `changed` is set False. A constraint's
        refusal (a writer that skipped the checks) is a RegistryError."""
        pg = self._pg
        change: _Change | None = None
        try:
            with self._pool.connection() as conn, conn.transaction() as tx:
                ver = int(conn.execute(_BUMP).fetchone()[0])
                change = _Change(conn)
                yield change
                if not change.changed:
                    raise pg.Rollback(tx)
        except pg.IntegrityError as e:
            diag = e.diag
            raise RegistryError(
                f"the registry refused the change ({diag.constraint_name}): {diag.message_primary}"
            ) from e
        finally:
            # Written or refused (a refusal may mean the snapshot is behind: a name
            # another bridge just took), the next lookup asks for the version.
            self._checked_at = float("-inf")
        if change is not None and change.changed:
            with self._ver_lock:
                self._wrote_ver = max(self._wrote_ver, ver)

    # ------------------------------------------------------------------ tenants

    def add_tenant(
        self,
        tenant: str,
        secret: bytes | str | None = None,
        *,
        host_password_hash: str | None = None,
    ) -> str:
        """Register a tenant; its token secret as hex (generated when not given); with
        `host_password_hash` its host user too, in the same transaction
        (Registry.add_tenant)."""
        check_id(tenant, "tenant")
        if secret is None:
            secret_hex = secrets.token_hex(32)
        elif isinstance(secret, bytes):
            secret_hex = _check_secret_hex(secret.hex())
        else:
            secret_hex = _check_secret_hex(secret)
        with self._writing() as ch:
            if ch.row("SELECT 1 FROM wren_reg_tenants WHERE tenant = %s", (tenant,)):
                # Replacing a secret silently would void every live session token.
                raise RegistryError(f"tenant {tenant!r} already exists")
            ch.conn.execute(
                "INSERT INTO wren_reg_tenants (tenant, secret) VALUES (%s, %s)",
                (tenant, secret_hex),
            )
            if host_password_hash is not None:
                self._insert_user(ch, host_user(tenant), HOST, tenant, host_password_hash)
        return secret_hex

    def tenant_secret(self, tenant: str) -> str | None:
        check_id(tenant, "tenant")
        got = self._current().secrets.get(tenant)
        if got is None:
            got = self._current(miss=True).secrets.get(tenant)
        return got

    def tenants(self) -> list[str]:
        return sorted(self._current().secrets)

    # ------------------------------------------------------------------ devices

    def add_device(self, device: str, tenant: str, agent: str) -> DeviceRecord:
        """Register a device (or give it a new agent) for an existing tenant; one of
        another tenant is refused (Registry.add_device)."""
        check_id(device, "device")
        check_id(tenant, "tenant")
        _check_agent(agent)
        with self._writing() as ch:
            ch.tenant_known(tenant)
            old = ch.row("SELECT tenant FROM wren_reg_devices WHERE device = %s", (device,))
            if old is not None and old[0] != tenant:
                raise RegistryError(f"device {device!r} belongs to another tenant")
            user = ch.row('SELECT role FROM wren_reg_users WHERE "user" = %s', (device,))
            if user is not None and user[0] != DEVICE:
                # The ACL's device rules would give that user this device's topics.
                raise RegistryError(f"{device!r} is a broker user of role {user[0]!r}")
            if old is None:
                ch.name_free(device)
                ch.conn.execute(
                    "INSERT INTO wren_reg_names (name, kind, owner) VALUES (%s, 'device', %s)",
                    (device, device),
                )
                ch.conn.execute(
                    "INSERT INTO wren_reg_devices (device, tenant, agent) VALUES (%s, %s, %s)",
                    (device, tenant, agent),
                )
            else:
                ch.conn.execute(
                    "UPDATE wren_reg_devices SET agent = %s WHERE device = %s", (agent, device)
                )
        return DeviceRecord(device, tenant, agent)

    def enroll_device(
        self, device: str, tenant: str, agent: str, password_hash: str
    ) -> DeviceRecord:
        """Register a new device with its broker user in one transaction; a device that
        exists, or a name taken, is refused (Registry.enroll_device)."""
        check_id(device, "device")
        check_id(tenant, "tenant")
        _check_agent(agent)
        check_entry(password_hash)
        with self._writing() as ch:
            ch.tenant_known(tenant)
            if ch.row("SELECT 1 FROM wren_reg_devices WHERE device = %s", (device,)):
                raise RegistryError(f"device {device!r} already exists")
            ch.name_free(device)
            ch.conn.execute(
                "INSERT INTO wren_reg_names (name, kind, owner) VALUES (%s, 'device', %s)",
                (device, device),
            )
            ch.conn.execute(
                "INSERT INTO wren_reg_devices (device, tenant, agent) VALUES (%s, %s, %s)",
                (device, tenant, agent),
            )
            ch.conn.execute(
                'INSERT INTO wren_reg_users ("user", role, kind, tenant, hash)'
                " VALUES (%s, 'device', 'device', %s, %s)",
                (device, tenant, password_hash),
            )
        return DeviceRecord(device, tenant, agent)

    def remove_device(self, device: str) -> bool:
        """Remove a device and its broker user; False when there was no such device."""
        check_id(device, "device")
        with self._writing() as ch:
            # The device user goes with the device (its foreign key cascades).
            gone = ch.row("DELETE FROM wren_reg_devices WHERE device = %s RETURNING 1", (device,))
            ch.conn.execute(
                "DELETE FROM wren_reg_names WHERE name = %s AND kind = 'device'", (device,)
            )
            ch.changed = gone is not None
        return gone is not None

    def device(self, device: str) -> DeviceRecord | None:
        """The record of a device, or None when the registry does not know it."""
        check_id(device, "device")
        got = self._current().by_device.get(device)
        if got is None:
            got = self._current(miss=True).by_device.get(device)
        return got

    def devices(self) -> list[DeviceRecord]:
        return list(self._current().devices)

    def devices_token(self) -> object:
        """Something that changes whenever the set of devices (or a device's record)
        has: compared by identity, a check costs no copy."""
        return self._current().devices

    def devices_of(self, tenant: str) -> list[DeviceRecord]:
        check_id(tenant, "tenant")
        return [r for r in self._current().devices if r.tenant == tenant]

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
        """Add a bridge user (`tenant` None) or a host user of an existing tenant
        (Registry.add_user)."""
        with self._writing() as ch:
            return self._insert_user(ch, user, role, tenant, password_hash, usr)

    def _insert_user(
        self,
        ch: _Change,
        user: str,
        role: str,
        tenant: str | None,
        password_hash: str,
        usr: str | None = None,
    ) -> BrokerUser:
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
            ch.tenant_known(tenant)
        else:
            raise RegistryError(f"role must be {BRIDGE!r} or {HOST!r}, not {role!r}")
        _storable(user)
        ch.name_free(user)
        siblings = sibling_users(user) if role == BRIDGE else []
        # Its control and link users come with a bridge user: their names are taken too.
        for sibling in siblings:
            ch.name_free(sibling)
        ch.conn.execute(
            "INSERT INTO wren_reg_names (name, kind, owner) VALUES (%s, 'user', %s)", (user, user)
        )
        for sibling in siblings:
            ch.conn.execute(
                "INSERT INTO wren_reg_names (name, kind, owner) VALUES (%s, 'sibling', %s)",
                (sibling, user),
            )
        ch.conn.execute(
            'INSERT INTO wren_reg_users ("user", role, kind, tenant, hash, usr)'
            " VALUES (%s, %s, 'user', %s, %s, %s)",
            (user, role, tenant, password_hash, usr),
        )
        return BrokerUser(user, role, tenant, password_hash, usr)

    def set_password_hash(self, user: str, password_hash: str) -> BrokerUser:
        """Give an existing broker user a new `$7$` password entry."""
        check_user(user)
        check_entry(password_hash)
        _storable(user)
        with self._writing() as ch:
            got = ch.row(
                'UPDATE wren_reg_users SET hash = %s WHERE "user" = %s RETURNING role, tenant, usr',
                (password_hash, user),
            )
            if got is None:
                raise RegistryError(f"unknown broker user {user!r}")
        role, tenant, usr = got
        return BrokerUser(user, role, tenant, password_hash, usr)

    def set_device_password_hash(self, device: str, password_hash: str) -> BrokerUser:
        """A new `$7$` entry for a registered device's broker user, added when the
        device has none (Registry.set_device_password_hash)."""
        check_id(device, "device")
        check_entry(password_hash)
        with self._writing() as ch:
            record = ch.row("SELECT tenant FROM wren_reg_devices WHERE device = %s", (device,))
            if record is None:
                raise RegistryError(f"unknown device {device!r}")
            tenant = str(record[0])
            user = ch.row('SELECT role FROM wren_reg_users WHERE "user" = %s', (device,))
            if user is None:
                ch.conn.execute(
                    'INSERT INTO wren_reg_users ("user", role, kind, tenant, hash)'
                    " VALUES (%s, 'device', 'device', %s, %s)",
                    (device, tenant, password_hash),
                )
            elif user[0] == DEVICE:
                ch.conn.execute(
                    'UPDATE wren_reg_users SET hash = %s WHERE "user" = %s',
                    (password_hash, device),
                )
            else:
                raise RegistryError(f"broker user {device!r} is not the device's")
        return BrokerUser(device, DEVICE, tenant, password_hash)

    def user(self, user: str) -> BrokerUser | None:
        got = self._current().by_user.get(user)
        if got is None:
            got = self._current(miss=True).by_user.get(user)
        return got

    def users(self) -> list[BrokerUser]:
        return list(self._current().users)

    # ------------------------------------------------------------------ grants

    def add_grant(
        self, tenant: str, agent: str, field: str = ALL_FIELDS, access: str = WRITE
    ) -> Grant:
        """Let `agent` of an existing tenant use tenant field `field` with `access`; an
        existing grant of that field gets the new access (Registry.add_grant)."""
        grant = _checked_grant(tenant, agent, field, access)
        with self._writing() as ch:
            ch.tenant_known(tenant)
            ch.conn.execute(
                "INSERT INTO wren_reg_grants (tenant, agent, field, access)"
                " VALUES (%s, %s, %s, %s) ON CONFLICT (tenant, agent, field)"
                " DO UPDATE SET access = EXCLUDED.access",
                (tenant, agent, field, access),
            )
        return grant

    def remove_grant(self, tenant: str, agent: str, field: str = ALL_FIELDS) -> bool:
        _checked_grant(tenant, agent, field, WRITE)
        with self._writing() as ch:
            gone = ch.row(
                "DELETE FROM wren_reg_grants WHERE tenant = %s AND agent = %s AND field = %s"
                " RETURNING 1",
                (tenant, agent, field),
            )
            ch.changed = gone is not None
        return gone is not None

    def grants(self, tenant: str | None = None) -> list[Grant]:
        if tenant is not None:
            check_id(tenant, "tenant")
        docs = self._current().grant_docs
        got = [_grant(d) for d in docs if tenant is None or d["tenant"] == tenant]
        return sorted(got, key=lambda g: (g.tenant, g.agent, g.field))

    def grants_of(self, tenant: str, agent: str) -> Grants:
        return self._current().grants_by.get((tenant, agent), NO_GRANTS)

    # ------------------------------------------------------------------ end users' grants

    def add_user_grant(self, tenant: str, usr: str, field: str, access: str = WRITE) -> UserGrant:
        grant = _checked_user_grant(tenant, usr, field, access)
        with self._writing() as ch:
            ch.tenant_known(tenant)
            ch.conn.execute(
                "INSERT INTO wren_reg_user_grants (tenant, usr, field, access)"
                " VALUES (%s, %s, %s, %s) ON CONFLICT (tenant, usr, field)"
                " DO UPDATE SET access = EXCLUDED.access",
                (tenant, usr, field, access),
            )
        return grant

    def remove_user_grant(self, tenant: str, usr: str, field: str) -> bool:
        _checked_user_grant(tenant, usr, field, WRITE)
        with self._writing() as ch:
            gone = ch.row(
                "DELETE FROM wren_reg_user_grants WHERE tenant = %s AND usr = %s AND field = %s"
                " RETURNING 1",
                (tenant, usr, field),
            )
            ch.changed = gone is not None
        return gone is not None

    def user_grants(self, tenant: str | None = None) -> list[UserGrant]:
        if tenant is not None:
            check_id(tenant, "tenant")
        docs = self._current().user_grant_docs
        got = [_user_grant(d) for d in docs if tenant is None or d["tenant"] == tenant]
        return sorted(got, key=lambda g: (g.tenant, g.usr, g.field))

    def user_grants_of(self, tenant: str, usr: str) -> Grants:
        return self._current().user_grants_by.get((tenant, usr), NO_GRANTS)

    # ------------------------------------------------------------------

    def close(self) -> None:
        self._snap = None
        if self._own_pool:
            self._pool.close()

    def __enter__(self) -> PgRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def provision(
    dsn_or_pool: str | Any, tenant: str, devices: Iterable[tuple[str, str]]
) -> PgRegistry:
    """The registry on `dsn_or_pool` with `tenant` and each (device, agent) of `devices`
    in it, adding only what is missing (registry.provision); the caller closes it.

    Bridges of a fleet may run this at the same start: a tenant or device another one
    added meanwhile is taken as found, not refused.
    """
    registry = PgRegistry(dsn_or_pool)
    try:
        if registry.tenant_secret(tenant) is None:
            try:
                registry.add_tenant(tenant)
            except RegistryError:
                if registry.tenant_secret(tenant) is None:
                    raise
        for device, agent in devices:
            if registry.device(device) is None:
                try:
                    registry.add_device(device, tenant, agent)
                except RegistryError:
                    if registry.device(device) is None:
                        raise
    except BaseException:
        registry.close()
        raise
    return registry


if TYPE_CHECKING:
    # Both registries are a RegistryStore: mypy says so here, where a drift would show.
    def _both(a: Registry, b: PgRegistry) -> tuple[RegistryStore, RegistryStore]:
        return a, b
