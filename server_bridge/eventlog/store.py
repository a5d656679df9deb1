"""What the bridge, the intake and the HTTP API use of an event log: `EventLog` (files
of the bridge's own) and `pgstore.eventlog.PgEventLog` (PostgreSQL, a fleet's bridges
together) both are one."""

from __future__ import annotations

from typing import Protocol

from .log import LoggedEvent, LoggedRun

__all__ = ["EventStore"]


class EventStore(Protocol):
    def append(
        self,
        tenant: str,
        device: str,
        run: str,
        i: int,
        payload: bytes,
        *,
        usr: str | None = None,
        conv: str | None = None,
        ts_ms: int | None = None,
    ) -> None: ...
    def events(self, tenant: str, device: str, run: str, after: int = 0) -> list[LoggedEvent]: ...
    def run(self, tenant: str, device: str, run: str) -> LoggedRun | None: ...
    def conversations(
        self, tenant: str, usr: str | None = None
    ) -> list[tuple[str, list[tuple[str, str]]]]: ...
    def runs_of(self, tenant: str, conv: str) -> list[tuple[str, str]]: ...
    def tenants(self) -> list[str]: ...
    def tenant_bytes(self, tenant: str) -> int: ...
    def retain(
        self, tenant: str, *, max_age_s: float | None = None, max_bytes: int | None = None
    ) -> int: ...
    def sync(self) -> None: ...
    def close(self) -> None: ...
