"""The registry and the crash-safe TinyDB storage under it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from server_bridge.registry import DeviceRecord, Registry, RegistryError, provision
from server_bridge.store import AtomicJSONStorage, open_db
from server_bridge.topics import BadTopic

SECRET = bytes(range(32))


def test_tenants_and_devices(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg.json")
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
    reg = Registry(tmp_path / "reg.json")
    reg.add_tenant("acme", SECRET.hex())
    reg.close()
    data = json.loads((tmp_path / "reg.json").read_text())
    assert list(data["tenants"].values()) == [{"tenant": "acme", "secret": SECRET.hex()}]


def test_persists_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "reg.json"
    with Registry(path) as reg:
        reg.add_tenant("acme", SECRET)
        reg.add_device("dev1", "acme", "thermostat")
    reg2 = Registry(path)
    assert reg2.tenant_secret("acme") == SECRET.hex()
    assert reg2.device("dev1") == DeviceRecord("dev1", "acme", "thermostat")


def test_another_process_writing_is_seen(tmp_path: Path) -> None:
    # The provisioning CLI adds a device while the bridge runs: the bridge's open
    # registry must see it without a restart.
    path = tmp_path / "reg.json"
    running = Registry(path)
    running.add_tenant("acme", SECRET)
    assert running.device("dev9") is None
    Registry(path).add_device("dev9", "acme", "kiosk")
    assert running.device("dev9") == DeviceRecord("dev9", "acme", "kiosk")


def test_ids_are_checked(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg.json")
    with pytest.raises(BadTopic):
        reg.add_tenant("Acme")
    reg.add_tenant("acme", SECRET)
    for bad in ("dev/1", "+", "#", "", "a" * 65, "Dev1"):
        with pytest.raises(BadTopic):
            reg.add_device(bad, "acme", "x")
    with pytest.raises(BadTopic):
        reg.device("dev+")


def test_consistency_rules(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg.json")
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
    reg = Registry(path)
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
    reopened = Registry(path)
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
        Registry(path).tenants()


def test_storage_reads_none_for_a_new_file(tmp_path: Path) -> None:
    storage = AtomicJSONStorage(tmp_path / "new" / "x.json")
    assert storage.read() is None
    storage.write({"_default": {}})
    assert storage.read() == {"_default": {}}


def test_provision_adds_only_what_is_missing(tmp_path: Path) -> None:
    path = tmp_path / "new" / "dir" / "reg.json"
    with provision(path, "acme", [("dev1", "thermostat")]) as reg:
        secret = reg.tenant_secret("acme")
        assert secret is not None and len(bytes.fromhex(secret)) == 32
        assert reg.device("dev1") == DeviceRecord("dev1", "acme", "thermostat")
        reg.add_tenant("globex")
        reg.add_device("dev9", "globex", "kiosk")
    # Run again, as a service does at every start: the secret (and so every live session
    # token) survives, a known device keeps its agent and tenant, a new one is added.
    again = [("dev1", "kiosk"), ("dev2", "kiosk"), ("dev9", "thermostat")]
    with provision(path, "acme", again) as reg:
        assert reg.tenant_secret("acme") == secret
        assert reg.device("dev1") == DeviceRecord("dev1", "acme", "thermostat")
        assert reg.device("dev2") == DeviceRecord("dev2", "acme", "kiosk")
        assert reg.device("dev9") == DeviceRecord("dev9", "globex", "kiosk")
    with pytest.raises(BadTopic):
        provision(path, "acme", [("no/slash", "kiosk")])
