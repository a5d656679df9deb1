"""The bridge's registry: tenants (with their token secrets) and devices.

A device's identity is its broker-authenticated MQTT user, which the broker's ACL binds
to its topic subtree; the registry maps that device id to the tenant that owns it and
the agent it runs. Nothing in a payload is consulted for that mapping.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinydb import Query

from server_bridge.store import open_db
from server_bridge.topics import check_id

__all__ = ["DeviceRecord", "Registry", "RegistryError", "provision"]

MAX_AGENT = 64


class RegistryError(ValueError):
    """A registry change that would make the registry inconsistent."""


@dataclass(frozen=True)
class DeviceRecord:
    device: str
    tenant: str
    agent: str


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


class Registry:
    """Tenants {tenant, secret (hex)} and devices {device, tenant, agent} in one TinyDB file."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = path
        self._db = open_db(path)
        # cache_size=0: TinyDB's per-table query cache would keep serving results after
        # another process (the provisioning CLI) changed the file.
        self._tenants = self._db.table("tenants", cache_size=0)
        self._devices = self._db.table("devices", cache_size=0)
        # TinyDB is not thread-safe and the bridge reads from paho's network thread and
        # writes from tools/tests.
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ tenants

    def add_tenant(self, tenant: str, secret: bytes | str | None = None) -> str:
        """Register a tenant; returns its token secret as hex (generated when not given).

        Secrets are hex strings at this API and in the file; `bytes.fromhex` gives the
        key for tokens.sign / tokens.verify.
        """
        check_id(tenant, "tenant")
        if secret is None:
            secret_hex = secrets.token_hex(32)
        elif isinstance(secret, bytes):
            secret_hex = _check_secret_hex(secret.hex())
        else:
            secret_hex = _check_secret_hex(secret)
        q = Query()
        with self._lock:
            if self._tenants.get(q.tenant == tenant) is not None:
                # Replacing a secret silently would void every live session token.
                raise RegistryError(f"tenant {tenant!r} already exists")
            self._tenants.insert({"tenant": tenant, "secret": secret_hex})
        return secret_hex

    def tenant_secret(self, tenant: str) -> str | None:
        """The tenant's token secret as hex, or None for an unknown tenant."""
        check_id(tenant, "tenant")
        q = Query()
        with self._lock:
            doc = self._tenants.get(q.tenant == tenant)
        if not isinstance(doc, dict):
            return None
        return str(doc["secret"])

    def tenants(self) -> list[str]:
        with self._lock:
            return sorted(str(doc["tenant"]) for doc in self._tenants.all())

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
        with self._lock:
            if self._tenants.get(q.tenant == tenant) is None:
                raise RegistryError(f"unknown tenant {tenant!r}")
            old = self._devices.get(q.device == device)
            if isinstance(old, dict) and old.get("tenant") != tenant:
                raise RegistryError(f"device {device!r} belongs to another tenant")
            self._devices.upsert(
                {"device": device, "tenant": tenant, "agent": agent}, q.device == device
            )
        return DeviceRecord(device, tenant, agent)

    def remove_device(self, device: str) -> bool:
        check_id(device, "device")
        q = Query()
        with self._lock:
            return bool(self._devices.remove(q.device == device))

    def device(self, device: str) -> DeviceRecord | None:
        """The record of a device, or None when the registry does not know it."""
        check_id(device, "device")
        q = Query()
        with self._lock:
            doc = self._devices.get(q.device == device)
        return _record(doc) if isinstance(doc, dict) else None

    def devices_of(self, tenant: str) -> list[DeviceRecord]:
        check_id(tenant, "tenant")
        q = Query()
        with self._lock:
            docs = self._devices.search(q.tenant == tenant)
        return sorted((_record(d) for d in docs), key=lambda r: r.device)

    def close(self) -> None:
        with self._lock:
            self._db.close()

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
