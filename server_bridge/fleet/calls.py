"""The RPC calls a bridge of a fleet has open, as rows the next owner can read.

A board's call lives in the bridge that serves it (rpc.py): its window, its acks, its
model stream. If that bridge dies, the board would wait for an answer until its call
times out (a model call: minutes), because with several bridges the fleet's presence
(`P/b/status`, the fleet's id as boot) does not change and so tells the board nothing
(DESIGN "Where scale goes", "Bridge presence"). So each call is a row in PostgreSQL
from the moment a worker starts it to its final answer, one INSERT and one DELETE per
call (a call lasts seconds; this is not on any per-chunk path), written with the
partition's lease epoch. A bridge that takes a partition answers, by id, every row of
an earlier epoch with a retryable error (`bridge_restarted`; a model call as kind
`llm`, cause `unavailable`, as a stopping bridge does) and deletes it: the board ends
the run `run.failed`, retryable, within a lease and a round of the death.

The answer carries no `s`: the new owner cannot know how many chunks the dead one sent,
and a final answer without `s` ends the call at the board whatever it received
(PROTOCOL "RPC"). A row the dead owner had not yet written (it died between reading the
call and its worker starting it) leaves that call to its timeout at the board; the
call was acknowledged to the broker when it was read (paho acknowledges a QoS 1
message when its callback returns), so it does not come again from the session.
Acknowledging only once the row is written (paho's manual acks) would close that
window; not built.

A failed write of a row is logged and counted by the caller, never fatal: the call is
still served, only a failover would leave it to its timeout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server_bridge.pgstore import connect

__all__ = ["OpenCall", "OpenCalls"]


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
        self._conn = connect(dsn, autocommit=True)
        self._lock = threading.Lock()

    def opened(self, part: int, epoch: int, call: OpenCall) -> None:
        """A call started under partition `part` held at `epoch`."""
        cid, is_int = _key(call.c)
        with self._lock:
            self._conn.execute(
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
            self._conn.execute(
                "DELETE FROM wren_open_calls WHERE prefix = %s AND device = %s"
                " AND call_id = %s AND call_is_int = %s",
                (self.prefix, device, cid, is_int),
            )

    def left_open(self, part: int, epoch: int) -> list[OpenCall]:
        """The calls of partition `part` opened under an epoch before `epoch`: what the
        bridges that held it before left unanswered. Taken: the rows are deleted in the
        same statement, so two takers never both answer one."""
        with self._lock:
            rows = self._conn.execute(
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
            row: Any = self._conn.execute(
                "SELECT count(*) FROM wren_open_calls WHERE prefix = %s", (self.prefix,)
            ).fetchone()
        return int(row[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()
