"""The bridge's registry: tenants (with their token secrets) and devices.

A device's identity is its broker-authenticated MQTT user, which the broker's ACL binds
to its topic subtree; the registry maps that device id to the tenant that owns it and
the agent it runs. Nothing in a payload is consulted for that mapping.

Every bridge message looks up its device (and a session token its tenant) on paho's
single network thread, so lookups are served from records parsed once per version of
the file: a lookup costs one `stat`, and the file is parsed again only when another
version is at the path (another process, such as the provisioning CLI, renamed a new
file over it) or when this registry wrote it. For two seconds after a file is written
its version does not yet prove its bytes (`store.settled`), so a lookup then also reads
the file and compares the bytes; it parses only if they differ.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tinydb import Query

from edge_runtime.events import MAX_ID
from server_bridge.store import (
    AtomicJSONStorage,
    FileVersion,
    open_db,
    parse_document,
    settled,
)
from server_bridge.topics import check_id

__all__ = ["DeviceRecord", "Registry", "RegistryError", "provision"]

# An agent name is an id like any other (the board sends it in hello and status).
MAX_AGENT = MAX_ID


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


def _parse(version: FileVersion, data: bytes, seen_at_ns: int, path: object) -> _Snapshot:
    doc = parse_document(data, str(path))
    if doc is None:
        return replace(_EMPTY, version=version, data=data, settled=settled(version, seen_at_ns))
    tenant_docs = _table_docs(doc, "tenants", path)
    device_docs = _table_docs(doc, "devices", path)
    return _Snapshot(
        version,
        data,
        settled(version, seen_at_ns),
        tenant_docs,
        device_docs,
        _index(tenant_docs, "tenant"),
        _index(device_docs, "device"),
    )


class Registry:
    """Tenants {tenant, secret (hex)} and devices {device, tenant, agent} in one TinyDB file."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = path
        self._db = open_db(path)
        # cache_size=0: TinyDB's per-table query cache would keep serving results after
        # another process (the provisioning CLI) changed the file.
        self._tenants = self._db.table("tenants", cache_size=0)
        self._devices = self._db.table("devices", cache_size=0)
        storage = self._db.storage
        if not isinstance(storage, AtomicJSONStorage):
            raise TypeError("the registry needs its file on an AtomicJSONStorage")
        self._storage = storage
        # The parsed file behind every lookup; None until the first lookup and after a
        # write through this registry.
        self._snap: _Snapshot | None = None
        # TinyDB is not thread-safe, and the bridge reads (and so may re-parse) from
        # paho's network thread while tools/tests write: one lock for the TinyDB file and
        # the snapshot, so a lookup never sees a snapshot half replaced.
        self._lock = threading.Lock()

    def _current(self) -> _Snapshot:
        """The snapshot of the file now at the path. The caller holds the lock."""
        version = self._storage.version()
        snap = self._snap
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
        with self._lock:
            try:
                yield
            finally:
                # Written or not (a failed rename leaves the old file), the next lookup
                # reads the file as it now is rather than trust a version compare.
                self._snap = None

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
        with self._writing():
            if self._tenants.get(q.tenant == tenant) is not None:
                # Replacing a secret silently would void every live session token.
                raise RegistryError(f"tenant {tenant!r} already exists")
            self._tenants.insert({"tenant": tenant, "secret": secret_hex})
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
            self._devices.upsert(
                {"device": device, "tenant": tenant, "agent": agent}, q.device == device
            )
        return DeviceRecord(device, tenant, agent)

    def remove_device(self, device: str) -> bool:
        check_id(device, "device")
        q = Query()
        with self._writing():
            return bool(self._devices.remove(q.device == device))

    def device(self, device: str) -> DeviceRecord | None:
        """The record of a device, or None when the registry does not know it."""
        check_id(device, "device")
        with self._lock:
            doc = self._current().by_device.get(device)
        return None if doc is None else _record(doc)

    def devices_of(self, tenant: str) -> list[DeviceRecord]:
        check_id(tenant, "tenant")
        with self._lock:
            docs = self._current().device_docs
        return sorted(
            (_record(d) for d in docs if d.get("tenant") == tenant), key=lambda r: r.device
        )

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
