"""The registry and the crash-safe TinyDB storage under it.

The registry's behaviour is tested on both backends through `backend` (ids `[file]`,
the TinyDB file of server_bridge/registry.py, and `[pg]`, PgRegistry of
server_bridge/pgstore/registry.py; PostgreSQL's skip, saying why, on a machine without
it). What only a file has (torn files, versions, inodes, hand-edited documents, the
write counts) is tested on the file alone; what only several bridges on one database
show is in test_pg_registry.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tinydb import Query

from server_bridge.brokerconf import hash_password
from server_bridge.memory.grants import ALL_FIELDS, NO_GRANTS, READ, WRITE, Grants
from server_bridge.pgstore.registry import RegistryStore
from server_bridge.registry import (
    BRIDGE,
    DEVICE,
    HOST,
    BrokerUser,
    DeviceRecord,
    Grant,
    Registry,
    RegistryError,
    UserGrant,
    host_user,
    provision,
)
from server_bridge.store import AtomicJSONStorage, open_db
from server_bridge.topics import BadTopic

SECRET = bytes(range(32))

# Every table of the PostgreSQL registry (migrations/0003_registry.sql), emptied between
# tests; the version row is set back to 0.
PG_TABLES = (
    "wren_reg_grants",
    "wren_reg_user_grants",
    "wren_reg_users",
    "wren_reg_devices",
    "wren_reg_names",
    "wren_reg_tenants",
)


@pytest.fixture(scope="session")
def registry_db(pg_server: Any) -> Iterator[str]:
    """A database for the `[pg]` registry tests, emptied before each test (a fresh
    database per test, conftest's pg_dsn, costs 0.2-0.3 s; emptying, a few ms)."""
    import uuid

    import psycopg
    import psycopg.conninfo

    from server_bridge.pgstore import migrate

    name = f"r_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    dsn = psycopg.conninfo.make_conninfo(pg_server.dsn, dbname=name)
    with psycopg.connect(dsn) as conn:
        migrate.apply(conn)
    yield dsn
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Backend:
    """Registries of one backend on one store (a file, or a database): each `open()`
    is another process's registry, as a bridge's and the CLI's are."""

    def __init__(self, kind: str, path: Path, dsn: str | None):
        self.kind = kind
        self.path = path
        self.dsn = dsn
        self.opened: list[RegistryStore] = []

    def open(
        self, recheck_s: float = 0, clock: Callable[[], float] = time.monotonic
    ) -> RegistryStore:
        if self.dsn is None:
            reg: RegistryStore = Registry(self.path, recheck_s=recheck_s, clock=clock)
        else:
            from server_bridge.pgstore.registry import PgRegistry

            # A lookup that misses asks the database sooner than recheck_s
            # (MISS_RECHECK_S): PgRegistry's own promise, tested in test_pg_registry.py.
            # Here both backends keep to recheck_s.
            reg = PgRegistry(self.dsn, recheck_s=recheck_s, clock=clock, miss_recheck_s=recheck_s)
        self.opened.append(reg)
        return reg

    def provision(self, tenant: str, devices: list[tuple[str, str]]) -> RegistryStore:
        if self.dsn is None:
            reg: RegistryStore = provision(self.path, tenant, devices)
        else:
            from server_bridge.pgstore.registry import provision as pg_provision

            reg = pg_provision(self.dsn, tenant, devices)
        self.opened.append(reg)
        return reg

    def stored(self) -> object:
        """Everything stored, to show that a refusal changed nothing (the file's bytes;
        every row of every table and the version)."""
        if self.dsn is None:
            return self.path.read_bytes()
        import psycopg

        with psycopg.connect(self.dsn) as conn:
            rows = {
                t: conn.execute(f"SELECT * FROM {t} ORDER BY 1, 2").fetchall() for t in PG_TABLES
            }
            rows["ver"] = conn.execute("SELECT ver FROM wren_reg_version").fetchall()
        return rows

    def records(self, table: str) -> int:
        """How many records a table holds (`grants`, ...)."""
        if self.dsn is None:
            return len(json.loads(self.path.read_text()).get(table, {}))
        import psycopg

        with psycopg.connect(self.dsn) as conn:
            row = conn.execute(f"SELECT count(*) FROM wren_reg_{table}").fetchone()
            assert row is not None
            return int(row[0])

    def close(self) -> None:
        for reg in self.opened:
            reg.close()


@pytest.fixture(params=["file", "pg"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    dsn = None
    if request.param == "pg":
        import psycopg

        dsn = request.getfixturevalue("registry_db")
        with psycopg.connect(dsn) as conn:
            conn.execute(f"TRUNCATE {', '.join(PG_TABLES)}")
            conn.execute("UPDATE wren_reg_version SET ver = 0")
    got = Backend(request.param, tmp_path / "reg.json", dsn)
    yield got
    got.close()


def test_tenants_and_devices(backend: Backend) -> None:
    reg = backend.open()
    assert reg.add_tenant("acme", SECRET) == SECRET.hex()
    generated = reg.add_tenant("globex")
    assert len(bytes.fromhex(generated)) == 32 and generated != SECRET.hex()
    assert reg.tenant_secret("acme") == SECRET.hex()
    assert reg.tenant_secret("nobody") is None
    assert reg.add_device("dev1", "acme", "thermostat") == DeviceRecord(
        "dev1", "acme", "thermostat"
    )
    reg.add_device("dev2", "acme", "kiosk")
    reg.add_device("dev3", "globex", "kiosk")
    assert reg.device("dev1") == DeviceRecord("dev1", "acme", "thermostat")
    assert reg.device("ghost") is None
    assert [r.device for r in reg.devices_of("acme")] == ["dev1", "dev2"]
    assert reg.devices_of("nobody") == []
    assert reg.tenants() == ["acme", "globex"]


def test_secret_is_stored_as_hex(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg.json", recheck_s=0)
    reg.add_tenant("acme", SECRET.hex())
    reg.close()
    data = json.loads((tmp_path / "reg.json").read_text())
    assert list(data["tenants"].values()) == [{"tenant": "acme", "secret": SECRET.hex()}]


def test_persists_across_reopen(backend: Backend) -> None:
    with backend.open() as reg:
        reg.add_tenant("acme", SECRET)
        reg.add_device("dev1", "acme", "thermostat")
    reg2 = backend.open()
    assert reg2.tenant_secret("acme") == SECRET.hex()
    assert reg2.device("dev1") == DeviceRecord("dev1", "acme", "thermostat")


def test_another_process_writing_is_seen(backend: Backend) -> None:
    # The provisioning CLI adds a device while the bridge runs: the bridge's open
    # registry must see it without a restart.
    running = backend.open()
    running.add_tenant("acme", SECRET)
    assert running.device("dev9") is None
    backend.open().add_device("dev9", "acme", "kiosk")
    assert running.device("dev9") == DeviceRecord("dev9", "acme", "kiosk")


def test_ids_are_checked(backend: Backend) -> None:
    reg = backend.open()
    with pytest.raises(BadTopic):
        reg.add_tenant("Acme")
    reg.add_tenant("acme", SECRET)
    for bad in ("dev/1", "+", "#", "", "a" * 65, "Dev1"):
        with pytest.raises(BadTopic):
            reg.add_device(bad, "acme", "x")
    with pytest.raises(BadTopic):
        reg.device("dev+")


def test_consistency_rules(backend: Backend) -> None:
    reg = backend.open()
    reg.add_tenant("acme", SECRET)
    reg.add_tenant("globex", SECRET)
    with pytest.raises(RegistryError):
        reg.add_tenant("acme", SECRET)  # would void live tokens
    with pytest.raises(RegistryError):
        reg.add_device("dev1", "nobody", "x")
    with pytest.raises(RegistryError):
        reg.add_tenant("weak", b"short")
    with pytest.raises(RegistryError):
        reg.add_tenant("nothex", "zz" * 16)
    reg.add_device("dev1", "acme", "thermostat")
    reg.add_device("dev1", "acme", "kiosk")  # re-provisioned with a new agent
    assert reg.device("dev1") == DeviceRecord("dev1", "acme", "kiosk")
    with pytest.raises(RegistryError):
        reg.add_device("dev1", "globex", "kiosk")  # no silent move between tenants
    assert reg.remove_device("dev1")
    reg.add_device("dev1", "globex", "kiosk")
    assert reg.device("dev1") == DeviceRecord("dev1", "globex", "kiosk")


# ---------------------------------------------------------------- crash-safe storage


class Unserializable:
    """A value json cannot write: serialization fails partway through the document."""


def test_failed_serialization_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "db.json"
    db = open_db(path)
    db.insert({"k": "before"})
    before = path.read_bytes()
    with pytest.raises(TypeError):
        db.insert({"k": "after", "bad": Unserializable()})
    assert path.read_bytes() == before
    assert [d["k"] for d in db.all()] == ["before"]
    assert [p.name for p in tmp_path.iterdir()] == ["db.json"]


def test_crash_between_write_and_rename_leaves_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "db.json"
    reg = Registry(path, recheck_s=0)
    reg.add_tenant("acme", SECRET)
    before = path.read_bytes()

    def crash(*args: object) -> None:
        raise OSError("power cut")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="power cut"):
        reg.add_tenant("globex", SECRET)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["db.json"]  # temp file cleaned up
    reopened = Registry(path, recheck_s=0)
    assert reopened.tenants() == ["acme"]


def test_fsync_failure_leaves_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "db.json"
    db = open_db(path)
    db.insert({"k": 1})
    before = path.read_bytes()

    def failing_fsync(fd: int) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError):
        db.insert({"k": 2})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert open_db(path).all() == [{"k": 1}]


def test_a_corrupt_file_is_an_error_not_an_empty_registry(tmp_path: Path) -> None:
    path = tmp_path / "reg.json"
    path.write_text('{"tenants": {"1": {"tenant": "acme"')
    with pytest.raises(ValueError):
        Registry(path, recheck_s=0).tenants()


def test_storage_reads_none_for_a_new_file(tmp_path: Path) -> None:
    storage = AtomicJSONStorage(tmp_path / "new" / "x.json")
    assert storage.read() is None
    storage.write({"_default": {}})
    assert storage.read() == {"_default": {}}


# ------------------------------------------------ lookups from the parsed file, and its changes

REPO = Path(__file__).resolve().parent.parent


def _forge_in_place(path: Path, old: bytes, new: bytes) -> None:
    """Rewrite the file in place, keeping its inode, size and mtime: the version a
    `stat` shows is unchanged, as after a write that reused the inode within one
    timestamp tick."""
    assert len(old) == len(new)
    st = os.stat(path)
    data = path.read_bytes()
    assert data.count(old) == 1
    with open(path, "r+b") as f:
        f.write(data.replace(old, new))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (
        st.st_ino,
        st.st_mtime_ns,
        st.st_size,
    )


def _backdate(path: Path, seconds: float) -> None:
    mtime_ns = os.stat(path).st_mtime_ns - int(seconds * 1e9)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_two_registries_on_one_file_see_each_others_writes(backend: Backend) -> None:
    bridge, cli = backend.open(), backend.open()
    assert bridge.device("dev1") is None and bridge.tenants() == []
    cli.add_tenant("acme", SECRET)
    assert bridge.tenant_secret("acme") == SECRET.hex()
    cli.add_device("dev1", "acme", "kiosk")
    assert bridge.device("dev1") == DeviceRecord("dev1", "acme", "kiosk")
    # Same size as before ("kiosk" -> "panel") and within the same clock tick: the new
    # inode (or, were it reused, the unsettled mtime) makes the change visible.
    cli.add_device("dev1", "acme", "panel")
    assert bridge.device("dev1") == DeviceRecord("dev1", "acme", "panel")
    cli.add_tenant("bobco", SECRET)
    cli.remove_device("dev1")
    cli.add_device("dev1", "bobco", "panel")  # moved between tenants of equal name length
    assert bridge.device("dev1") == DeviceRecord("dev1", "bobco", "panel")
    assert bridge.devices_of("acme") == [] and bridge.tenants() == ["acme", "bobco"]
    # And the other way round: the bridge's own write is seen by the CLI's registry.
    bridge.remove_device("dev1")
    assert cli.device("dev1") is None and bridge.device("dev1") is None


def test_a_write_by_another_process_is_seen_on_the_next_lookup(tmp_path: Path) -> None:
    path = tmp_path / "reg.json"
    bridge = Registry(path, recheck_s=0)
    bridge.add_tenant("acme", SECRET)
    bridge.add_device("dev1", "acme", "kiosk")
    _backdate(path, 3600)  # a settled version: lookups trust it without reading
    for _ in range(3):
        assert bridge.device("dev2") is None
        assert bridge.device("dev1") == DeviceRecord("dev1", "acme", "kiosk")

    def in_child(code: str) -> None:
        script = (
            "from server_bridge.registry import Registry\n"
            f"reg = Registry({str(path)!r}, recheck_s=0)\n"
        )
        subprocess.run([sys.executable, "-c", script + code], cwd=REPO, check=True, timeout=60)

    in_child("reg.add_device('dev2', 'acme', 'panel')")
    assert bridge.device("dev2") == DeviceRecord("dev2", "acme", "panel")
    in_child("reg.remove_device('dev1')")
    assert bridge.device("dev1") is None
    assert [r.device for r in bridge.devices_of("acme")] == ["dev2"]


def test_an_unsettled_version_is_checked_against_the_bytes(tmp_path: Path) -> None:
    # The hole a version-only cache has: same inode, mtime and size, other bytes. While
    # the mtime is recent such a file can exist, so the lookup reads and compares.
    path = tmp_path / "reg.json"
    Registry(path, recheck_s=0).add_tenant("acme", SECRET)
    Registry(path, recheck_s=0).add_device("dev1", "acme", "kiosk")
    bridge = Registry(path, recheck_s=0)
    assert bridge.device("dev1") == DeviceRecord("dev1", "acme", "kiosk")
    _forge_in_place(path, b'"kiosk"', b'"panel"')
    assert bridge.device("dev1") == DeviceRecord("dev1", "acme", "panel")


def test_a_settled_version_is_trusted_without_reading(tmp_path: Path) -> None:
    # Once the clock is past the mtime by store.SETTLE_NS no write can produce the same
    # version, so the lookup trusts it. Shown by a forged in-place rewrite (not something
    # our storage ever does) going unseen, until a real write renames a new file in.
    path = tmp_path / "reg.json"
    cli = Registry(path, recheck_s=0)
    cli.add_tenant("acme", SECRET)
    cli.add_device("dev1", "acme", "kiosk")
    _backdate(path, 3600)
    bridge = Registry(path, recheck_s=0)
    assert bridge.device("dev1") == DeviceRecord("dev1", "acme", "kiosk")
    _forge_in_place(path, b'"kiosk"', b'"panel"')
    assert bridge.device("dev1") == DeviceRecord("dev1", "acme", "kiosk")
    cli.add_device("dev2", "acme", "kiosk")
    assert bridge.device("dev1") == DeviceRecord("dev1", "acme", "panel")
    assert bridge.device("dev2") == DeviceRecord("dev2", "acme", "kiosk")


def test_a_file_turning_corrupt_or_missing_is_not_served_from_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "reg.json"
    bridge = Registry(path, recheck_s=0)
    bridge.add_tenant("acme", SECRET)
    bridge.add_device("dev1", "acme", "kiosk")
    assert bridge.device("dev1") is not None
    tmp = tmp_path / "torn.json"
    tmp.write_text('{"devices": {"1": {"device": "dev1"')
    os.replace(tmp, path)
    with pytest.raises(ValueError):
        bridge.device("dev1")
    path.unlink()
    assert bridge.device("dev1") is None and bridge.tenants() == []


def _outcome(fn: Callable[..., object], *args: object) -> object:
    """What a call returned, or the type of what it raised."""
    try:
        return fn(*args)
    except Exception as e:
        return type(e)


@pytest.mark.parametrize("malformed", [False, True])
def test_lookups_answer_as_tinydb_queries_did(tmp_path: Path, malformed: bool) -> None:
    # Every read against the TinyDB queries the registry made before it kept parsed
    # records, on the same file, including documents only a hand edit makes: duplicates
    # (the first in the file wins), non-str ids, a table TinyDB never wrote, and (with
    # `malformed`) documents missing fields, which fail the reads that reach them.
    path = tmp_path / "reg.json"
    tenant_docs: list[dict[str, object]] = [
        {"tenant": "acme", "secret": "aa" * 16},
        {"tenant": "acme", "secret": "bb" * 16},
        {"tenant": 7, "secret": "dd" * 16},
        {"tenant": "globex", "secret": "ee" * 16},
    ]
    device_docs: list[dict[str, object]] = [
        {"device": "dev1", "tenant": "acme", "agent": "a"},
        {"device": "dev1", "tenant": "acme", "agent": "b"},
        {"device": 5, "tenant": "acme", "agent": "d"},
        {"device": "dev2", "tenant": "globex", "agent": "e"},
        {"device": "dev3", "tenant": 7, "agent": "f"},
    ]
    if malformed:
        tenant_docs.insert(1, {"secret": "cc" * 16})
        tenant_docs.append({"tenant": "initech"})
        device_docs.insert(2, {"tenant": "acme", "agent": "c"})
        device_docs.append({"device": "dev4", "tenant": "globex"})
    doc = {
        "tenants": {str(i): d for i, d in enumerate(tenant_docs, 1)},
        "devices": {str(i): d for i, d in enumerate(device_docs, 1)},
        "other": {"1": {"k": 1}},
    }
    path.write_text(json.dumps(doc))
    reg = Registry(path, recheck_s=0)
    db = open_db(path)
    tenants, devices = db.table("tenants", cache_size=0), db.table("devices", cache_size=0)
    q = Query()

    def secret_before(t: str) -> str | None:
        d = tenants.get(q.tenant == t)
        return None if not isinstance(d, dict) else str(d["secret"])

    def record(d: dict[str, object]) -> DeviceRecord:
        return DeviceRecord(str(d["device"]), str(d["tenant"]), str(d["agent"]))

    def device_before(name: str) -> DeviceRecord | None:
        d = devices.get(q.device == name)
        return record(d) if isinstance(d, dict) else None

    def devices_of_before(t: str) -> list[DeviceRecord]:
        return sorted((record(d) for d in devices.search(q.tenant == t)), key=lambda r: r.device)

    def tenants_before() -> list[str]:
        return sorted(str(d["tenant"]) for d in tenants.all())

    for i in ["acme", "globex", "initech", "nobody", "dev1", "dev2", "dev3", "dev4", "5", "7"]:
        assert _outcome(reg.tenant_secret, i) == _outcome(secret_before, i)
        assert _outcome(reg.device, i) == _outcome(device_before, i)
        assert _outcome(reg.devices_of, i) == _outcome(devices_of_before, i)
    assert _outcome(reg.tenants) == _outcome(tenants_before)


def test_lookups_from_many_threads_while_another_registry_writes(backend: Backend) -> None:
    # The bridge looks up from paho's network thread (and RPC threads) while the
    # provisioning CLI writes: every answer is either "not yet" or the right record.
    writer = backend.open()
    writer.add_tenant("acme", SECRET)
    bridge = backend.open()
    n = 40
    wrong: list[object] = []
    done = threading.Event()

    def look() -> None:
        while not done.is_set():
            for i in range(n):
                try:
                    got = bridge.device(f"dev{i}")
                except Exception as e:  # any error is a failure of the test
                    wrong.append(e)
                    return
                if got not in (None, DeviceRecord(f"dev{i}", "acme", "kiosk")):
                    wrong.append(got)

    threads = [threading.Thread(target=look) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for i in range(n):
            writer.add_device(f"dev{i}", "acme", "kiosk")
    finally:
        done.set()
        for t in threads:
            t.join(timeout=30)
    assert wrong == []
    assert [r.device for r in bridge.devices_of("acme")] == sorted(f"dev{i}" for i in range(n))


def test_provision_adds_only_what_is_missing(backend: Backend) -> None:
    if backend.dsn is None:
        backend.path = backend.path.parent / "new" / "dir" / "reg.json"
    with backend.provision("acme", [("dev1", "thermostat")]) as reg:
        secret = reg.tenant_secret("acme")
        assert secret is not None and len(bytes.fromhex(secret)) == 32
        assert reg.device("dev1") == DeviceRecord("dev1", "acme", "thermostat")
        reg.add_tenant("globex")
        reg.add_device("dev9", "globex", "kiosk")
    # Run again, as a service does at every start: the secret (and so every live session
    # token) survives, a known device keeps its agent and tenant, a new one is added.
    again = [("dev1", "kiosk"), ("dev2", "kiosk"), ("dev9", "thermostat")]
    with backend.provision("acme", again) as reg:
        assert reg.tenant_secret("acme") == secret
        assert reg.device("dev1") == DeviceRecord("dev1", "acme", "thermostat")
        assert reg.device("dev2") == DeviceRecord("dev2", "acme", "kiosk")
        assert reg.device("dev9") == DeviceRecord("dev9", "globex", "kiosk")
    with pytest.raises(BadTopic):
        backend.provision("acme", [("no/slash", "kiosk")])


# ---------------------------------------------------------------- broker users

# `$7$` entries (brokerconf.hash_password with a fixed salt, so the tests stay fast).
HASH_A = hash_password("password-a", salt=b"\x01" * 12)
HASH_B = hash_password("password-b", salt=b"\x02" * 12)


def test_broker_users_by_role(backend: Backend) -> None:
    reg = backend.open()
    reg.add_tenant("acme", SECRET, host_password_hash=HASH_A)
    assert host_user("acme") == "host-acme"
    reg.add_user("bridge", BRIDGE, None, HASH_B)
    reg.add_user("host-acme-2", HOST, "acme", HASH_B)
    assert reg.enroll_device("dev1", "acme", "kiosk", HASH_A) == DeviceRecord(
        "dev1", "acme", "kiosk"
    )
    assert reg.users() == [
        BrokerUser("bridge", BRIDGE, None, HASH_B),
        BrokerUser("dev1", DEVICE, "acme", HASH_A),
        BrokerUser("host-acme", HOST, "acme", HASH_A),
        BrokerUser("host-acme-2", HOST, "acme", HASH_B),
    ]
    assert reg.user("dev1") == BrokerUser("dev1", DEVICE, "acme", HASH_A)
    assert reg.user("nobody") is None
    assert HASH_A not in repr(reg.users())  # not a password, but not for logs either
    assert reg.devices() == [DeviceRecord("dev1", "acme", "kiosk")]
    # A new password: the entry changes, nothing else.
    assert reg.set_password_hash("host-acme", HASH_B) == BrokerUser(
        "host-acme", HOST, "acme", HASH_B
    )
    assert reg.user("host-acme") == BrokerUser("host-acme", HOST, "acme", HASH_B)
    # Removing a device removes its login.
    assert reg.remove_device("dev1")
    assert reg.user("dev1") is None and reg.device("dev1") is None


def test_broker_user_names_and_device_ids_share_one_name_space(backend: Backend) -> None:
    # The ACL's device rules apply to any user named like a device: a bridge or host
    # user that is also a device id would get that device's topics.
    reg = backend.open()
    reg.add_tenant("acme", SECRET, host_password_hash=HASH_A)
    reg.add_tenant("globex", SECRET)
    reg.add_user("bridge", BRIDGE, None, HASH_A)
    reg.enroll_device("dev1", "acme", "kiosk", HASH_A)
    reg.add_device("legacy", "acme", "kiosk")  # no broker user (as `wren bridge` adds one)
    before = backend.stored()
    refusals: list[tuple[Callable[..., object], tuple[object, ...]]] = [
        (reg.enroll_device, ("dev1", "acme", "kiosk", HASH_B)),  # exists
        (reg.enroll_device, ("legacy", "acme", "kiosk", HASH_B)),  # exists, without login
        (reg.enroll_device, ("bridge", "acme", "kiosk", HASH_B)),  # a bridge user's name
        (reg.enroll_device, ("host-acme", "acme", "kiosk", HASH_B)),
        (reg.enroll_device, ("dev2", "nobody", "kiosk", HASH_B)),  # unknown tenant
        (reg.add_device, ("bridge", "acme", "kiosk")),
        (reg.add_user, ("dev1", BRIDGE, None, HASH_B)),  # a device's name
        (reg.add_user, ("legacy", HOST, "acme", HASH_B)),
        (reg.add_user, ("bridge", BRIDGE, None, HASH_B)),  # exists
        (reg.add_user, ("host-x", HOST, "nobody", HASH_B)),  # unknown tenant
        (reg.add_user, ("host-x", HOST, None, HASH_B)),
        (reg.add_user, ("b2", BRIDGE, "acme", HASH_B)),
        (reg.add_user, ("d9", DEVICE, "acme", HASH_B)),  # devices come with their device
        (reg.add_user, ("b2", BRIDGE, None, "plain password")),  # never a password
        (reg.add_user, ("bad name", BRIDGE, None, HASH_B)),
        (reg.add_tenant, ("acme",)),
        (reg.set_password_hash, ("nobody", HASH_B)),
        (reg.set_password_hash, ("bridge", "plain password")),
        (reg.set_device_password_hash, ("ghost", HASH_B)),
    ]
    for method, args in refusals:
        with pytest.raises(ValueError):  # RegistryError, BadTopic: ValueErrors
            method(*args)
    assert backend.stored() == before
    # A tenant's host user is refused with the tenant when its name is taken.
    reg.add_user("host-initech", BRIDGE, None, HASH_A)
    with pytest.raises(RegistryError):
        reg.add_tenant("initech", host_password_hash=HASH_B)
    assert reg.tenant_secret("initech") is None


def test_a_device_and_its_login_are_written_together_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "reg.json"
    reg = Registry(path, recheck_s=0)
    reg.add_tenant("acme", SECRET)
    writes: list[dict[str, object]] = []
    real_write = AtomicJSONStorage.write

    def counted(self: AtomicJSONStorage, data: dict[str, dict[str, object]]) -> None:
        writes.append(json.loads(json.dumps(data)))
        real_write(self, data)

    monkeypatch.setattr(AtomicJSONStorage, "write", counted)
    reg.enroll_device("dev1", "acme", "kiosk", HASH_A)
    assert len(writes) == 1 and set(writes[0]) == {"tenants", "devices", "users"}
    # The second table's insert fails after the first table changed: the file keeps
    # neither, and the registry goes on as before.
    before = path.read_bytes()

    def broken_insert(document: object) -> int:
        raise OSError("the disk is full")

    monkeypatch.setattr(reg._users, "insert", broken_insert)
    with pytest.raises(OSError):
        reg.enroll_device("dev2", "acme", "kiosk", HASH_A)
    assert path.read_bytes() == before and len(writes) == 1
    monkeypatch.undo()
    assert reg.device("dev2") is None
    reg.enroll_device("dev2", "acme", "kiosk", HASH_B)
    assert Registry(path, recheck_s=0).user("dev2") == BrokerUser("dev2", DEVICE, "acme", HASH_B)


def test_a_registry_without_the_users_table_still_loads(tmp_path: Path) -> None:
    # A file written before broker users were kept: tenants and devices only.
    path = tmp_path / "reg.json"
    doc = {
        "tenants": {"1": {"tenant": "acme", "secret": SECRET.hex()}},
        "devices": {"1": {"device": "dev1", "tenant": "acme", "agent": "thermostat"}},
    }
    path.write_text(json.dumps(doc))
    reg = Registry(path, recheck_s=0)
    assert reg.device("dev1") == DeviceRecord("dev1", "acme", "thermostat")
    assert reg.users() == [] and reg.user("dev1") is None
    # The old device gets its login; the old tables are as they were.
    reg.set_device_password_hash("dev1", HASH_A)
    assert reg.user("dev1") == BrokerUser("dev1", DEVICE, "acme", HASH_A)
    reg.set_device_password_hash("dev1", HASH_B)
    assert reg.users() == [BrokerUser("dev1", DEVICE, "acme", HASH_B)]
    data = json.loads(path.read_text())
    assert data["tenants"] == doc["tenants"] and data["devices"] == doc["devices"]


def test_another_process_adding_a_user_is_seen(backend: Backend) -> None:
    running = backend.open()
    running.add_tenant("acme", SECRET)
    assert running.users() == []
    backend.open().enroll_device("dev9", "acme", "kiosk", HASH_A)
    assert running.user("dev9") == BrokerUser("dev9", DEVICE, "acme", HASH_A)
    assert running.device("dev9") == DeviceRecord("dev9", "acme", "kiosk")


def test_another_processs_write_is_seen_within_recheck_s_and_this_ones_at_once(
    backend: Backend,
) -> None:
    # The bridge looks a device up for every message; between checks of the file it
    # trusts its snapshot for recheck_s. Its own writes are seen at once.
    backend.open().add_tenant("acme", SECRET)
    now = [100.0]
    bridge = backend.open(recheck_s=0.25, clock=lambda: now[0])
    assert bridge.device("dev9") is None
    backend.open().add_device("dev9", "acme", "kiosk")
    now[0] += 0.2
    assert bridge.device("dev9") is None  # not looked at again yet
    now[0] += 0.1
    assert bridge.device("dev9") == DeviceRecord("dev9", "acme", "kiosk")
    bridge.add_device("dev10", "acme", "kiosk")
    assert bridge.device("dev10") is not None  # no wait for its own write


# ---------------------------------------------------------------- grants


def test_grants_say_which_agent_may_use_which_tenant_field(backend: Backend) -> None:
    reg = backend.open()
    reg.add_tenant("acme", SECRET)
    reg.add_tenant("globex", SECRET)
    assert reg.grants() == [] and reg.grants_of("acme", "kiosk") is NO_GRANTS
    assert reg.add_grant("acme", "kiosk") == Grant("acme", "kiosk", ALL_FIELDS, WRITE)
    reg.add_grant("acme", "till", "menu", READ)
    reg.add_grant("acme", "till", "orders")
    reg.add_grant("globex", "kiosk", "menu", READ)
    kiosk = reg.grants_of("acme", "kiosk")
    assert kiosk.may_write("menu") and kiosk.may_write("anything")
    till = reg.grants_of("acme", "till")
    assert till.access("menu") == READ and till.access("orders") == WRITE
    assert till.access("prices") is None and not till.may_read("prices")
    # Grants key on the tenant: globex's kiosk is not acme's.
    assert reg.grants_of("globex", "kiosk") == Grants({"menu": READ})
    assert reg.grants_of("globex", "till") is NO_GRANTS
    assert reg.grants() == [
        Grant("acme", "kiosk", "*", WRITE),
        Grant("acme", "till", "menu", READ),
        Grant("acme", "till", "orders", WRITE),
        Grant("globex", "kiosk", "menu", READ),
    ]
    assert [g.tenant for g in reg.grants("globex")] == ["globex"]
    assert reg.grants("nobody") == []


def test_a_fields_own_grant_wins_over_the_agents_star_grant(backend: Backend) -> None:
    reg = backend.open()
    reg.add_tenant("acme", SECRET)
    reg.add_grant("acme", "kiosk", ALL_FIELDS, WRITE)
    reg.add_grant("acme", "kiosk", "ledger", READ)
    reg.add_grant("acme", "till", ALL_FIELDS, READ)
    reg.add_grant("acme", "till", "notes", WRITE)
    kiosk, till = reg.grants_of("acme", "kiosk"), reg.grants_of("acme", "till")
    assert kiosk.access("ledger") == READ and kiosk.access("notes") == WRITE
    assert till.access("ledger") == READ and till.access("notes") == WRITE


def test_adding_a_grant_again_changes_its_access_and_removing_takes_it_back(
    backend: Backend,
) -> None:
    reg = backend.open()
    reg.add_tenant("acme", SECRET)
    reg.add_grant("acme", "kiosk", "menu", WRITE)
    reg.add_grant("acme", "kiosk", "menu", READ)
    assert reg.grants() == [Grant("acme", "kiosk", "menu", READ)]
    assert backend.records("grants") == 1  # one record, changed
    reg.add_grant("acme", "kiosk")
    before = backend.stored()
    assert not reg.remove_grant("acme", "kiosk", "other")
    assert not reg.remove_grant("acme", "till")
    assert backend.stored() == before  # nothing to remove: not written
    assert reg.remove_grant("acme", "kiosk")  # the * grant; menu's stays
    assert reg.grants() == [Grant("acme", "kiosk", "menu", READ)]
    assert reg.grants_of("acme", "kiosk").access("notes") is None
    assert reg.remove_grant("acme", "kiosk", "menu")
    assert reg.grants() == [] and reg.grants_of("acme", "kiosk") is NO_GRANTS


def test_bad_grants_are_refused_and_change_nothing(backend: Backend) -> None:
    reg = backend.open()
    reg.add_tenant("acme", SECRET)
    reg.add_grant("acme", "kiosk", "menu", READ)
    before = backend.stored()
    refused: list[tuple[tuple[object, ...], type[Exception], str]] = [
        (("nobody", "kiosk"), RegistryError, "unknown tenant 'nobody'"),
        (("Acme", "kiosk"), BadTopic, "invalid tenant level"),
        (("acme", ""), RegistryError, "agent must be"),
        (("acme", "a" * 65), RegistryError, "agent must be"),
        (("acme", "kiosk", "Menu"), RegistryError, "field must be '*' or"),
        (("acme", "kiosk", "**"), RegistryError, "field must be '*' or"),
        (("acme", "kiosk", "m" * 65), RegistryError, "field must be '*' or"),
        (("acme", "kiosk", "menu", "admin"), RegistryError, "access must be one of"),
    ]
    for args, error, says in refused:
        with pytest.raises(error, match=re.escape(says)):
            reg.add_grant(*args)  # type: ignore[arg-type]
    with pytest.raises(RegistryError, match="field must be"):
        reg.remove_grant("acme", "kiosk", "Menu")
    assert backend.stored() == before
    assert reg.grants() == [Grant("acme", "kiosk", "menu", READ)]


def test_a_malformed_grant_record_grants_nothing_and_is_named(tmp_path: Path) -> None:
    # A hand-edited file: a record with a bad access, one without a field, and two
    # records of one grant. Lookups fail closed; the listing says what is wrong.
    path = tmp_path / "reg.json"
    doc = {
        "tenants": {"1": {"tenant": "acme", "secret": SECRET.hex()}},
        "devices": {"1": {"device": "dev1", "tenant": "acme", "agent": "kiosk"}},
        "grants": {
            "1": {"tenant": "acme", "agent": "kiosk", "field": "menu", "access": "root"},
            "2": {"tenant": "acme", "agent": "kiosk", "access": "write"},
            "3": {"tenant": "acme", "agent": "till", "field": "*", "access": "write"},
            "4": {"tenant": "acme", "agent": "till", "field": "*", "access": "read"},
        },
    }
    path.write_text(json.dumps(doc))
    reg = Registry(path, recheck_s=0)
    assert reg.grants_of("acme", "kiosk") is NO_GRANTS
    assert reg.grants_of("acme", "till") == Grants({"*": READ})
    assert reg.device("dev1") == DeviceRecord("dev1", "acme", "kiosk")  # the rest works
    with pytest.raises(RegistryError, match="a malformed grant in the registry"):
        reg.grants()


def test_a_registry_without_the_grants_table_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "reg.json"
    doc = {"tenants": {"1": {"tenant": "acme", "secret": SECRET.hex()}}}
    path.write_text(json.dumps(doc))
    reg = Registry(path, recheck_s=0)
    assert reg.grants() == [] and reg.grants_of("acme", "kiosk") is NO_GRANTS
    reg.add_grant("acme", "kiosk")
    assert json.loads(path.read_text())["tenants"] == doc["tenants"]
    assert reg.grants_of("acme", "kiosk").may_write("menu")


def test_another_processs_grant_is_seen_within_recheck_s(backend: Backend) -> None:
    # `wren grant add/remove` runs while the bridge does: the bridge's registry sees the
    # change on a lookup at most recheck_s later.
    backend.open().add_tenant("acme", SECRET)
    now = [100.0]
    bridge = backend.open(recheck_s=0.25, clock=lambda: now[0])
    assert bridge.grants_of("acme", "kiosk") is NO_GRANTS
    backend.open().add_grant("acme", "kiosk", "menu")
    now[0] += 0.2
    assert bridge.grants_of("acme", "kiosk") is NO_GRANTS  # not looked at again yet
    now[0] += 0.1
    assert bridge.grants_of("acme", "kiosk").may_write("menu")
    backend.open().remove_grant("acme", "kiosk", "menu")
    now[0] += 0.3
    assert bridge.grants_of("acme", "kiosk") is NO_GRANTS


def test_grants_of_is_served_from_the_snapshot(backend: Backend) -> None:
    # The bridge asks on every memory call: the same parsed object until the file changes.
    reg = backend.open()
    reg.add_tenant("acme", SECRET)
    reg.add_grant("acme", "kiosk")
    first = reg.grants_of("acme", "kiosk")
    assert all(reg.grants_of("acme", "kiosk") is first for _ in range(100))
    with pytest.raises(TypeError):
        first.by_field["menu"] = READ  # type: ignore[index]


def test_end_users_grants_of_knowledge_collections(backend: Backend) -> None:
    reg = backend.open()
    reg.add_tenant("acme", SECRET)
    assert reg.user_grants() == [] and reg.user_grants_of("acme", "alice") is NO_GRANTS
    assert reg.add_user_grant("acme", "alice", "kb:manuals") == UserGrant(
        "acme", "alice", "kb:manuals", WRITE
    )
    reg.add_user_grant("acme", "alice", "kb:manuals", READ)  # changed, not added
    reg.add_user_grant("acme", "bob@example.com", "kb:faq", READ)
    assert reg.user_grants() == [
        UserGrant("acme", "alice", "kb:manuals", READ),
        UserGrant("acme", "bob@example.com", "kb:faq", READ),
    ]
    assert reg.user_grants_of("acme", "alice").knowledge("manuals") == READ
    before = backend.stored()
    for args, says in [
        (("nobody", "alice", "kb:manuals"), "unknown tenant"),
        (("acme", "_alice", "kb:manuals"), "a user id is"),
        (("acme", "alice", "menu"), "an end user is granted a knowledge collection"),
        (("acme", "alice", "kb:manuals", "admin"), "access must be one of"),
    ]:
        with pytest.raises(RegistryError, match=re.escape(says)):
            reg.add_user_grant(*args)
    assert not reg.remove_user_grant("acme", "carol", "kb:manuals")
    assert backend.stored() == before
    assert reg.remove_user_grant("acme", "alice", "kb:manuals")
    assert reg.user_grants("acme") == [UserGrant("acme", "bob@example.com", "kb:faq", READ)]
    assert reg.user_grants_of("acme", "alice") is NO_GRANTS


def test_a_device_added_without_a_login_gets_one(backend: Backend) -> None:
    reg = backend.open()
    reg.add_tenant("acme", SECRET)
    reg.add_device("legacy", "acme", "kiosk")
    assert reg.user("legacy") is None
    assert reg.set_device_password_hash("legacy", HASH_A) == BrokerUser(
        "legacy", DEVICE, "acme", HASH_A
    )
    reg.set_device_password_hash("legacy", HASH_B)
    assert reg.users() == [BrokerUser("legacy", DEVICE, "acme", HASH_B)]
    reg.add_device("legacy", "acme", "panel")  # a new agent keeps the login
    assert backend.open().user("legacy") == BrokerUser("legacy", DEVICE, "acme", HASH_B)
    assert reg.remove_device("legacy") and reg.users() == []
    assert not reg.remove_device("legacy")
