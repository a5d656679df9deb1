"""PgRegistry (server_bridge/pgstore/registry.py) where PostgreSQL differs from a file:
several bridges on one database, adding one name at once, the constraints holding on
their own, a change failing halfway, the database going away. What both backends share
is tested on both by test_registry.py (its `[pg]` ids).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from server_bridge.brokerconf import hash_password
from server_bridge.pgstore import PgUnavailable
from server_bridge.pgstore.registry import MISS_RECHECK_S, PgRegistry, _Change
from server_bridge.registry import BRIDGE, HOST, RECHECK_S, DeviceRecord, RegistryError
from server_bridge.topics import BadTopic

SECRET = bytes(range(32))
HASH_A = hash_password("password-a", salt=b"\x01" * 12)
HASH_B = hash_password("password-b", salt=b"\x02" * 12)
TABLES = (
    "wren_reg_version",
    "wren_reg_tenants",
    "wren_reg_names",
    "wren_reg_devices",
    "wren_reg_users",
    "wren_reg_grants",
    "wren_reg_user_grants",
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def open_registry(pg_dsn: str) -> Iterator[Callable[..., PgRegistry]]:
    """PgRegistry instances on one fresh database, each with its own pool, as separate
    bridge processes have; closed after the test."""
    opened: list[PgRegistry] = []

    def make(**kw: Any) -> PgRegistry:
        reg = PgRegistry(pg_dsn, **kw)
        opened.append(reg)
        return reg

    yield make
    for reg in opened:
        reg.close()


def stored(dsn: str) -> dict[str, list[tuple[Any, ...]]]:
    with psycopg.connect(dsn) as conn:
        return {t: conn.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in TABLES}


def run_together(targets: list[Callable[[], object]]) -> list[object]:
    """Start every target at one barrier; what each returned, or the exception's type."""
    barrier = threading.Barrier(len(targets))
    out: list[object] = [None] * len(targets)

    def one(i: int) -> None:
        barrier.wait()
        try:
            out[i] = targets[i]()
        except Exception as e:  # noqa: BLE001 - the outcome is the test's to judge
            out[i] = type(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return out


def test_a_device_added_through_one_bridge_is_seen_by_the_other_within_the_staleness(
    open_registry: Callable[..., PgRegistry],
) -> None:
    clock = Clock()
    a = open_registry(recheck_s=0)
    b = open_registry(clock=clock)  # RECHECK_S, MISS_RECHECK_S
    a.add_tenant("acme", SECRET)
    assert b.device("dev1") is None
    token = b.devices_token()
    a.add_device("dev1", "acme", "kiosk")
    # An unknown device asks again after MISS_RECHECK_S (a board just enrolled is
    # found at once), not at every message.
    clock.now += MISS_RECHECK_S / 2
    assert b.device("dev1") is None
    clock.now += MISS_RECHECK_S
    assert b.device("dev1") == DeviceRecord("dev1", "acme", "kiosk")
    assert b.devices_token() is not token
    token = b.devices_token()
    # A change of a known record is seen within RECHECK_S.
    a.add_device("dev1", "acme", "panel")
    clock.now += RECHECK_S / 2
    assert b.device("dev1") == DeviceRecord("dev1", "acme", "kiosk")
    clock.now += RECHECK_S
    assert b.device("dev1") == DeviceRecord("dev1", "acme", "panel")
    assert b.devices_token() is not token
    # A change of anything but the devices keeps the token: the bridge re-deals its
    # links only when the devices changed.
    token = b.devices_token()
    a.add_grant("acme", "panel")
    clock.now += RECHECK_S * 2
    assert b.grants_of("acme", "panel").may_write("menu")
    assert b.devices_token() is token


def test_with_the_real_clock_a_write_is_seen_within_recheck_s(
    open_registry: Callable[..., PgRegistry],
) -> None:
    import time

    a, b = open_registry(), open_registry()
    a.add_tenant("acme", SECRET)
    a.add_device("dev1", "acme", "kiosk")
    assert b.device("dev1") is not None
    a.add_device("dev1", "acme", "panel")
    start = time.monotonic()
    while b.device("dev1") != DeviceRecord("dev1", "acme", "panel"):
        assert time.monotonic() - start < RECHECK_S + 1.0
        time.sleep(0.005)
    assert time.monotonic() - start <= RECHECK_S + 0.1


def test_concurrent_adds_of_one_name_have_one_winner(
    open_registry: Callable[..., PgRegistry], pg_dsn: str
) -> None:
    bridges = [open_registry(recheck_s=0) for _ in range(4)]
    bridges[0].add_tenant("acme", SECRET)
    for round_ in range(5):
        tenant, device, user = f"t{round_}", f"dev{round_}", f"b{round_}"
        # One tenant name, four bridges: one secret is kept, the others refused.
        got = run_together([functools.partial(r.add_tenant, tenant) for r in bridges])
        assert sum(isinstance(x, str) for x in got) == 1 and got.count(RegistryError) == 3
        assert bridges[3].tenant_secret(tenant) in got
        # One device enrolled by two bridges while two others add a bridge and a host
        # user of that name: the one name space has one owner.
        got = run_together(
            [
                functools.partial(bridges[0].enroll_device, device, "acme", "kiosk", HASH_A),
                functools.partial(bridges[1].enroll_device, device, "acme", "kiosk", HASH_B),
                functools.partial(bridges[2].add_user, device, BRIDGE, None, HASH_A),
                functools.partial(bridges[3].add_user, device, HOST, "acme", HASH_A),
            ]
        )
        assert got.count(RegistryError) == 3, got
        # A bridge user against a user named like its control user.
        got = run_together(
            [
                functools.partial(bridges[0].add_user, user, BRIDGE, None, HASH_A),
                functools.partial(bridges[1].add_user, f"{user}.ctl", HOST, "acme", HASH_A),
            ]
        )
        assert got.count(RegistryError) == 1, got
    rows = stored(pg_dsn)
    assert len(rows["wren_reg_tenants"]) == 6
    names = [r[0] for r in rows["wren_reg_names"]]
    assert len(names) == len(set(names))
    users = [r[0] for r in rows["wren_reg_users"]]
    assert all(f"dev{i}" in users for i in range(5))
    for reg in bridges:
        assert [u.user for u in reg.users()] == sorted(users)


def test_a_removed_device_is_gone_from_both(open_registry: Callable[..., PgRegistry]) -> None:
    clock = Clock()
    a, b = open_registry(recheck_s=0), open_registry(clock=clock)
    a.add_tenant("acme", SECRET)
    a.enroll_device("dev1", "acme", "kiosk", HASH_A)
    a.add_device("dev2", "acme", "kiosk")
    clock.now += RECHECK_S
    assert b.device("dev1") is not None and b.user("dev1") is not None
    assert a.remove_device("dev1")
    assert a.device("dev1") is None and a.user("dev1") is None  # its own write: at once
    clock.now += RECHECK_S
    assert b.device("dev1") is None and b.user("dev1") is None
    assert [r.device for r in b.devices()] == ["dev2"]
    # Removed through the other bridge too, and the name is free again.
    assert b.remove_device("dev2") and not a.remove_device("dev2")
    assert a.devices() == [] and b.devices() == []
    a.add_user("dev1", BRIDGE, None, HASH_A)
    clock.now += MISS_RECHECK_S
    assert b.user("dev1") is not None


def test_bad_input_is_refused_by_name_and_changes_nothing(
    open_registry: Callable[..., PgRegistry], pg_dsn: str
) -> None:
    reg = open_registry(recheck_s=0)
    reg.add_tenant("acme", SECRET, host_password_hash=HASH_A)
    reg.add_user("bridge", BRIDGE, None, HASH_A)
    reg.enroll_device("dev1", "acme", "kiosk", HASH_A)
    reg.add_grant("acme", "kiosk", "menu")
    reg.add_user("host-initech", BRIDGE, None, HASH_A)
    refused: list[tuple[Callable[..., object], tuple[object, ...], type[Exception], str]] = [
        (reg.add_tenant, ("acme",), RegistryError, "tenant 'acme' already exists"),
        (reg.add_tenant, ("weak", b"short"), RegistryError, "at least 16 bytes"),
        (reg.add_tenant, ("nothex", "zz" * 16), RegistryError, "must be hex"),
        (reg.add_tenant, ("Acme",), BadTopic, "invalid tenant level"),
        (reg.add_device, ("dev1", "nobody", "x"), RegistryError, "unknown tenant"),
        (reg.add_device, ("bridge", "acme", "x"), RegistryError, "of role 'bridge'"),
        (reg.add_device, ("dev2", "acme", ""), RegistryError, "agent must be"),
        (reg.add_device, ("dev/2", "acme", "x"), BadTopic, "invalid device level"),
        (reg.enroll_device, ("dev1", "acme", "x", HASH_B), RegistryError, "already exists"),
        (reg.enroll_device, ("dev2", "acme", "x", "pw"), ValueError, "not a $7$"),
        (reg.add_user, ("dev1", BRIDGE, None, HASH_B), RegistryError, "'dev1' is a device"),
        (reg.add_user, ("bridge.ctl", BRIDGE, None, HASH_B), RegistryError, "control user"),
        (reg.add_user, ("bridge.l2", HOST, "acme", HASH_B), RegistryError, "link user"),
        (reg.add_user, ("host-acme", HOST, "acme", HASH_B), RegistryError, "already exists"),
        (reg.add_user, ("h", HOST, None, HASH_B), RegistryError, "belongs to a tenant"),
        (reg.add_user, ("d9", "device", "acme", HASH_B), RegistryError, "role must be"),
        (reg.add_user, ("a\x00b", BRIDGE, None, HASH_B), RegistryError, "cannot be stored"),
        (reg.set_password_hash, ("nobody", HASH_B), RegistryError, "unknown broker user"),
        (reg.set_device_password_hash, ("ghost", HASH_B), RegistryError, "unknown device"),
        (reg.add_grant, ("acme", "kiosk", "Menu"), RegistryError, "field must be"),
        (reg.add_grant, ("nobody", "kiosk"), RegistryError, "unknown tenant"),
    ]
    before = stored(pg_dsn)
    for method, args, error, says in refused:
        with pytest.raises(error) as got:
            method(*args)
        assert says in str(got.value), (method, args, got.value)
    # A tenant whose host user's name is taken is refused whole.
    with pytest.raises(RegistryError, match="already exists"):
        reg.add_tenant("initech", host_password_hash=HASH_B)
    assert not reg.remove_device("ghost") and not reg.remove_grant("acme", "till")
    assert stored(pg_dsn) == before  # the version did not move either
    assert reg.tenant_secret("initech") is None


def test_the_constraints_hold_without_the_code(pg_dsn: str, open_registry: Any) -> None:
    # Another writer (a hand edit, a future tool) that skips every check still cannot
    # store what the file registry's rules refuse.
    reg = open_registry()
    reg.add_tenant("acme", SECRET)
    reg.add_tenant("globex", SECRET)
    reg.add_user("bridge", BRIDGE, None, HASH_A)
    reg.enroll_device("dev1", "acme", "kiosk", HASH_A)
    bad = [
        "INSERT INTO wren_reg_tenants VALUES ('acme', 'aa')",
        # A device named like a user, or a sibling.
        "INSERT INTO wren_reg_names VALUES ('bridge', 'device', 'bridge')",
        "INSERT INTO wren_reg_devices (device, tenant, agent) VALUES ('bridge', 'acme', 'x')",
        "INSERT INTO wren_reg_names VALUES ('bridge.ctl', 'user', 'bridge.ctl')",
        # A host user with a device's name.
        'INSERT INTO wren_reg_users ("user", role, kind, tenant, hash)'
        " VALUES ('dev1', 'host', 'user', 'acme', 'h')",
        # A device user without its device, or in another tenant than its device.
        "INSERT INTO wren_reg_names VALUES ('dev9', 'device', 'dev9')",
        "UPDATE wren_reg_users SET tenant = 'globex' WHERE \"user\" = 'dev1'",
        'INSERT INTO wren_reg_users ("user", role, kind, tenant, hash)'
        " VALUES ('x', 'bridge', 'user', 'acme', 'h')",
        "INSERT INTO wren_reg_grants VALUES ('acme', 'kiosk', 'menu', 'root')",
        "INSERT INTO wren_reg_grants VALUES ('nobody', 'kiosk', 'menu', 'read')",
    ]
    for sql in bad:
        with psycopg.connect(pg_dsn) as conn, pytest.raises(psycopg.IntegrityError):
            conn.execute(sql)
            if "wren_reg_names VALUES ('dev9'" in sql:
                conn.execute(
                    'INSERT INTO wren_reg_users ("user", role, kind, tenant, hash)'
                    " VALUES ('dev9', 'device', 'device', 'acme', 'h')"
                )
    # Deleting a bridge user's name takes its siblings' names and the user with it.
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("DELETE FROM wren_reg_names WHERE name = 'bridge'")
        left = conn.execute("SELECT name FROM wren_reg_names ORDER BY name").fetchall()
        assert left == [("dev1",)]
        assert conn.execute('SELECT "user" FROM wren_reg_users').fetchall() == [("dev1",)]


def test_a_writer_that_skips_the_checks_gets_a_registry_error(
    open_registry: Callable[..., PgRegistry], monkeypatch: pytest.MonkeyPatch
) -> None:
    reg = open_registry()
    reg.add_tenant("acme", SECRET)
    reg.enroll_device("dev1", "acme", "kiosk", HASH_A)
    monkeypatch.setattr(_Change, "name_free", lambda self, name: None)
    with pytest.raises(RegistryError, match="wren_reg_names_pkey"):
        reg.add_user("dev1", BRIDGE, None, HASH_A)
    assert [u.user for u in reg.users()] == ["dev1"]


def test_a_change_failing_halfway_stores_nothing(
    open_registry: Callable[..., PgRegistry], pg_dsn: str
) -> None:
    reg = open_registry(recheck_s=0)
    reg.add_tenant("acme", SECRET)
    # The device's rows are written, then its user's insert fails (a full disk, say).
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            "CREATE FUNCTION fail() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN RAISE EXCEPTION 'disk full'; END $$"
        )
        conn.execute(
            "CREATE TRIGGER fail BEFORE INSERT ON wren_reg_users"
            " FOR EACH ROW EXECUTE FUNCTION fail()"
        )
    before = stored(pg_dsn)
    with pytest.raises(psycopg.Error, match="disk full"):
        reg.enroll_device("dev1", "acme", "kiosk", HASH_A)
    assert stored(pg_dsn) == before
    assert reg.device("dev1") is None
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("DROP TRIGGER fail ON wren_reg_users")
    reg.enroll_device("dev1", "acme", "kiosk", HASH_A)
    assert open_registry().user("dev1") is not None


def test_the_database_away_serves_the_snapshot_for_a_while(
    open_registry: Callable[..., PgRegistry], monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    reg = open_registry(clock=clock, max_stale_s=10.0)
    reg.add_tenant("acme", SECRET)
    reg.add_device("dev1", "acme", "kiosk")
    assert reg.device("dev1") is not None

    def away(*args: object, **kw: object) -> Any:
        raise psycopg.OperationalError("connection refused")

    monkeypatch.setattr(reg._pool, "connection", away)
    clock.now += RECHECK_S
    assert reg.device("dev1") == DeviceRecord("dev1", "acme", "kiosk")
    clock.now += 9.0
    assert reg.device("dev1") is not None
    clock.now += 2.0
    with pytest.raises(PgUnavailable):
        reg.device("dev1")
    monkeypatch.undo()
    assert reg.device("dev1") is not None
