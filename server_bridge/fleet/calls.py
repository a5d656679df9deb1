"""The RPC calls a bridge of a fleet has open, as rows the next owner can read.

A board's call lives in the bridge that serves it (rpc.py): its window, its acks, its
model stream. If that bridge dies, the board would wait for an answer until its call
times out (a model call: minutes), because with several bridges the fleet's presence
(`P/b/status`, the fleet's id as boot) does not change and so tells the board nothing
(DESIGN "Where scale goes", "Bridge presence"). So each call is a row in PostgreSQL
from the moment it is admitted (on paho's network thread, before the message is
acknowledged to the broker) to its final answer, one INSERT and one DELETE per call (a
call lasts seconds; this is not on any per-chunk path), written with the partition's
lease epoch. A bridge that takes a partition answers, by id, every row of
an earlier epoch with a retryable error (`bridge_restarted`; a model call as kind
`llm`, cause `unavailable`, as a stopping bridge does) and deletes it: the board ends
the run `run.failed`, retryable, within a lease and a round of the death.

The answer carries no `s`: the new owner cannot know how many chunks the dead one sent,
and a final answer without `s` ends the call at the board whatever it received
(PROTOCOL "RPC"). The row is written before paho acknowledges the call's message (when
the callback returns), so a call the broker took as delivered has its row; a bridge
that dies before the row leaves the message unacknowledged, and the session gives it
to the next owner. The price is a round trip to the database on the network thread
per call (about a millisecond; a call is seconds of model work), bounded by
STATEMENT_TIMEOUT_MS and skipped for a while after a failure.

A failed write of a row is logged and counted by the caller, never fatal: the call is
still served, only a failover would leave it to its timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server_bridge.fleet.partitions import partition_of
from server_bridge.pgstore import connect

__all__ = ["FleetCallRows", "OpenCall", "OpenCalls"]

# `opened` runs on paho's network thread, which every message of the partitions waits
# for: a statement is cut after this, a connect gives up after libpq's least (2 s), and
# after a failure the rows are skipped (each call counted by the caller) for a while
# rather than every call paying the wait again.
STATEMENT_TIMEOUT_MS = 500
SKIP_AFTER_FAILURE_S = 10.0

log = logging.getLogger("wren.bridge.fleet")


@dataclass(frozen=True)
class OpenCall:
    """A call a bridge had open: enough to answer it by id on the device's rpc/res."""

    device: str
    c: int | str
    method: str
    run: str | None
    fail_kind: str
    epoch: int


def _key(c: int | str) -> tuple[str, bool]:
    return str(c), isinstance(c, int) and not isinstance(c, bool)


class OpenCalls:
    """The open-call rows of one fleet (prefix), on one connection of its own.

    Thread-safe by a lock around the connection: the RPC workers write from several
    threads, and one connection keeps the cost to the database at one backend per
    bridge; each statement is short (one row).
    """

    def __init__(self, dsn: str, prefix: str) -> None:
        import threading

        self.prefix = prefix
        self._dsn = dsn
        # Connected at first use and again after a failure (the database restarted):
        # a bridge starts, and serves calls, while the database is away.
        self._conn: Any = None
        self._closed = False
        self._down_until = 0.0
        self._lock = threading.Lock()

    def _execute(self, sql: str, params: tuple[Any, ...]) -> Any:  # under self._lock
        if self._closed:
            raise RuntimeError("the open-call rows are closed (the bridge stopped)")
        now = time.monotonic()
        if now < self._down_until:
            raise RuntimeError(
                f"the open-call rows are skipped for {self._down_until - now:.1f} s more"
                " after a failure"
            )
        try:
            if self._conn is None:
                self._conn = connect(
                    self._dsn, autocommit=True, timeout_s=2,
                    options=f"-c statement_timeout={STATEMENT_TIMEOUT_MS}",
                )  # fmt: skip
            return self._conn.execute(sql, params)
        except Exception:
            self._down_until = time.monotonic() + SKIP_AFTER_FAILURE_S
            conn, self._conn = self._conn, None
            if conn is not None:
                try:
                    conn.close()
                except Exception:
                    pass
            raise

    def opened(self, part: int, epoch: int, call: OpenCall) -> None:
        """A call started under partition `part` held at `epoch`."""
        cid, is_int = _key(call.c)
        with self._lock:
            self._execute(
                "INSERT INTO wren_open_calls (prefix, part, device, call_id, call_is_int,"
                " method, run, fail_kind, epoch) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s)"
                " ON CONFLICT (prefix, device, call_id, call_is_int) DO UPDATE SET"
                " part = EXCLUDED.part, method = EXCLUDED.method, run = EXCLUDED.run,"
                " fail_kind = EXCLUDED.fail_kind, epoch = EXCLUDED.epoch, opened_at = now()",
                (self.prefix, part, call.device, cid, is_int, call.method, call.run,
                 call.fail_kind, epoch),
            )  # fmt: skip

    def closed(self, device: str, c: int | str) -> None:
        """The call was answered (or ended): its row goes."""
        cid, is_int = _key(c)
        with self._lock:
            self._execute(
                "DELETE FROM wren_open_calls WHERE prefix = %s AND device = %s"
                " AND call_id = %s AND call_is_int = %s",
                (self.prefix, device, cid, is_int),
            )

    def left_open(self, part: int, epoch: int) -> list[OpenCall]:
        """The calls of partition `part` opened under an epoch before `epoch`: what the
        bridges that held it before left unanswered. Taken: the rows are deleted in the
        same statement, so two takers never both answer one."""
        with self._lock:
            rows = self._execute(
                "DELETE FROM wren_open_calls WHERE prefix = %s AND part = %s AND epoch < %s"
                " RETURNING device, call_id, call_is_int, method, run, fail_kind, epoch",
                (self.prefix, part, epoch),
            ).fetchall()
        out = []
        for device, cid, is_int, method, run, fail_kind, ep in rows:
            out.append(
                OpenCall(str(device), int(cid) if is_int else str(cid), str(method),
                         None if run is None else str(run), str(fail_kind), int(ep))
            )  # fmt: skip
        out.sort(key=lambda c: (c.device, str(c.c)))
        return out

    def count(self) -> int:
        with self._lock:
            row: Any = self._execute(
                "SELECT count(*) FROM wren_open_calls WHERE prefix = %s", (self.prefix,)
            ).fetchone()
        return int(row[0])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class FleetCallRows:
    """A fleet bridge's call rows (rpc.CallRows): each call under its device's
    partition and the epoch this bridge holds it at, and, when the bridge takes a
    partition, the calls earlier owners left open answered by id.

    `holds(part)` is the lease keeper's; `serving(device, c)` whether this process has
    the call in flight; `answer(device, c, fail_kind)` sends the retryable answer."""

    def __init__(
        self,
        calls: OpenCalls,
        partitions: int,
        holds: Callable[[int], int | None],
        serving: Callable[[str, int | str], bool],
        answer: Callable[[str, int | str, str], None],
    ) -> None:
        self.calls = calls
        self.partitions = partitions
        self._holds = holds
        self._serving = serving
        self._answer = answer

    def opened(
        self, device: str, c: int | str, method: str, run: str | None, fail_kind: str
    ) -> None:
        part = partition_of(device, self.partitions)
        epoch = self._holds(part)
        if epoch is None:
            # Not this bridge's any more (or not yet): the call is served, but a failover
            # will leave it to the board's timeout. Rare: a call is read on the
            # partition's own link, which ends with the lease.
            log.info("call %r of %s: partition %d not held, no row", c, device, part)
            return
        self.calls.opened(part, epoch, OpenCall(device, c, method, run, fail_kind, epoch))

    def closed(self, device: str, c: int | str) -> None:
        self.calls.closed(device, c)

    def taken(self, part: int, epoch: int) -> int:
        """Partition `part` is this bridge's at `epoch`: answer what earlier owners left
        open; returns how many. A call this process still serves (it held the partition
        before, lost it for a failed renewal and took it back) is not answered: its row
        is written again under the new epoch."""
        answered = 0
        for call in self.calls.left_open(part, epoch):
            if self._serving(call.device, call.c):
                again = OpenCall(call.device, call.c, call.method, call.run, call.fail_kind, epoch)
                self.calls.opened(part, epoch, again)
                continue
            self._answer(call.device, call.c, call.fail_kind)
            answered += 1
        if answered:
            log.info("partition %d: answered %d call(s) an earlier owner left open", part, answered)
        return answered
