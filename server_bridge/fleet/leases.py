"""Partitions leased in PostgreSQL: which bridge serves which devices, and until when.

Each partition of a fleet (one MQTT topic prefix) is one `wren_leases` row: the owner
bridge, an epoch that grows by one at every take, and an expiry from the database's
clock (`now()`), never a bridge's. A `LeaseKeeper` holds one bridge's share. Every
round (2 s, a third of the 6 s lease) it:

1. says the bridge is alive (`wren_bridges.seen_at`) and renews everything it holds,
   in one conditional UPDATE (`owner = me AND epoch = e`); a partition the UPDATE does
   not return was taken from it, and when the UPDATE fails (the database unreachable,
   a timeout) the keeper cannot know what it renewed: those partitions are lost
   (on_loss), and taken again under new epochs once the database answers;
2. works out its share, `ceil(P / live bridges)`, a bridge not seen for a lease not
   counted;
3. gives one partition back when over its share (so a bridge that joins gets its share
   as the others give back, one a round each), or takes expired and free partitions up
   to it, each take an `UPDATE ... WHERE epoch = e AND expires_at < now()`: when two
   bridges race for a row the database lets one through, and the other's WHERE no
   longer matches (epoch + 1).

Two clocks keep two owners from acting at once. The database's decides when a lease is
free to take. The bridge's own monotonic clock decides when it must stop acting: a
lease is held until `lease - margin` after the moment BEFORE the renewal (or take) was
sent, which is before the database's `now()` for it, so the bridge stops before the
row can expire and another take it, whatever the round trip took. `holds(part)` is
that rule; the callbacks say when a partition starts and stops being this bridge's,
and run on the keeper's thread, so a slow one delays the next round (which is why the
rule is the clock, not the callbacks).

A store write for a device carries its partition's epoch (`fence`), so a bridge paused
past its lease (a stopped VM, a long GC) cannot write after another has taken over.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from server_bridge.fleet.partitions import DEFAULT_PARTITIONS, check_partitions
from server_bridge.pgstore import apply, connect
from server_bridge.pgstore.connect import CONNECT_TIMEOUT_S

__all__ = [
    "LEASE_S",
    "ROUND_S",
    "Fenced",
    "FleetError",
    "LeaseKeeper",
    "LeaseSnapshot",
    "PartitionCountMismatch",
    "fence",
    "join_fleet",
    "release",
    "take",
]

log = logging.getLogger("wren.bridge.fleet")

#: How often a keeper renews, takes and gives back.
ROUND_S = 2.0
#: How long a renewal or take holds a partition, by the database's clock: three rounds,
#: so one slow or lost round costs nothing.
LEASE_S = 6.0
# The margin, as a share of the lease, by which a keeper stops before its lease may end:
# room for the bridge's clock running fast against the database's and for the act it
# has just allowed (a publish, a write) to finish. 1 s of a 6 s lease.
_MARGIN_SHARE = 1 / 6
# A bridge row not seen for this many leases is deleted when a bridge joins: every
# keeper's id is new (see LeaseKeeper), so the rows of killed bridges would pile up.
_FORGET_LEASES = 10
# SQLSTATEs of a statement that gave up waiting (lock_timeout, statement_timeout): a
# take blocked by a fenced write of the previous owner is tried again next round.
_GAVE_UP = frozenset({"55P03", "57014"})


class FleetError(RuntimeError):
    """Something about the fleet's partitions refused what was asked."""


class PartitionCountMismatch(FleetError):
    """The fleet on this prefix was made with another partition count: a bridge started
    with a different one would put devices in partitions the others do not."""


class Fenced(FleetError):
    """The partition's lease no longer has this owner and epoch: the write is refused
    (and the transaction it was in must roll back)."""


# ---------------------------------------------------------------------- the statements


def join_fleet(conn: Any, prefix: str, partitions: int) -> str:
    """Make the fleet of `prefix` with `partitions` (and its lease rows) unless it
    exists; its fleet id. PartitionCountMismatch when it was made with another count."""
    check_partitions(partitions)
    with conn.transaction():
        # Two first bridges at once: the second's INSERT waits on the key and does
        # nothing, and its SELECT (a new snapshot per statement) sees the first's row.
        conn.execute(
            "INSERT INTO wren_fleet (prefix, fleet_id, partitions) VALUES (%s, %s, %s)"
            " ON CONFLICT (prefix) DO NOTHING",
            (prefix, uuid.uuid4().hex[:8], partitions),
        )
        fleet_id, have = conn.execute(
            "SELECT fleet_id, partitions FROM wren_fleet WHERE prefix = %s", (prefix,)
        ).fetchone()
        if int(have) != partitions:
            raise PartitionCountMismatch(
                f"the fleet on prefix {prefix!r} has {have} partitions; this bridge was"
                f" started with {partitions} (a fleet's count is fixed for its life)"
            )
        conn.execute(
            "INSERT INTO wren_leases (prefix, part) SELECT %s, generate_series(0, %s - 1)"
            " ON CONFLICT DO NOTHING",
            (prefix, partitions),
        )
    return str(fleet_id)


def take(conn: Any, prefix: str, part: int, epoch: int, bridge: str, lease_s: float) -> int | None:
    """Take `part`, last seen at `epoch`, for `lease_s`: the new epoch, or None when
    another bridge took it first or its lease has not run out.

    A row still owned by `bridge` may be taken before it expires: the keeper takes
    again, under a new epoch, a partition it gave up on after a failed renewal, which
    no other bridge can hold meanwhile (it would have changed the owner). Keepers' ids
    are unique to the instance (LeaseKeeper), so no other process has this owner."""
    row = conn.execute(
        "UPDATE wren_leases SET owner = %s, epoch = epoch + 1,"
        " expires_at = now() + make_interval(secs => %s)"
        " WHERE prefix = %s AND part = %s AND epoch = %s"
        " AND (expires_at < now() OR owner = %s)"
        " RETURNING epoch",
        (bridge, lease_s, prefix, part, epoch, bridge),
    ).fetchone()
    return None if row is None else int(row[0])


def release(conn: Any, prefix: str, part: int, epoch: int, bridge: str) -> bool:
    """Give `part` back at once (owner none, expiry now) if it is still `bridge`'s at
    `epoch`; whether it was. The caller has stopped serving it first."""
    row = conn.execute(
        "UPDATE wren_leases SET owner = NULL, expires_at = now()"
        " WHERE prefix = %s AND part = %s AND owner = %s AND epoch = %s RETURNING part",
        (prefix, part, bridge, epoch),
    ).fetchone()
    return row is not None


def fence(conn: Any, prefix: str, part: int, epoch: int, owner: str) -> None:
    """Refuse (Fenced) the caller's transaction unless partition `part` is still
    `owner`'s at `epoch`. Call it inside the transaction that writes for the partition's
    devices, before it commits; raising rolls the transaction back.

    Why a write that passes cannot land after another bridge took over: the check locks
    the lease row FOR KEY SHARE until the caller's transaction ends, and a take changes
    the epoch, a key column (the UNIQUE (prefix, part, epoch) of 0001_leases.sql), so
    its UPDATE needs FOR UPDATE on the row and waits until that transaction has
    committed or rolled back. Either the take came first, and the check sees the new
    epoch and refuses, or the write commits first, and the new owner, whose take waited
    for it, reads it afterwards. A renewal changes only expires_at (FOR NO KEY UPDATE),
    so writes never hold up renewals (PostgreSQL documents the columns that make an
    UPDATE take FOR UPDATE as those of a unique index a foreign key could use; the tests
    check both halves). Expiry is not checked: a lease run out but not taken has had no
    other owner, and a late write then is no one else's loss. The price: a transaction
    left open holds the next owner off (its takes give up and retry every round), so
    keep fenced transactions short."""
    row = conn.execute(
        "SELECT owner, epoch FROM wren_leases WHERE prefix = %s AND part = %s FOR KEY SHARE",
        (prefix, part),
    ).fetchone()
    # An autocommit connection outside `with conn.transaction()` would drop the lock as
    # soon as it was taken, fencing nothing (psycopg's TransactionStatus.IDLE is 0).
    if int(conn.info.transaction_status) == 0:
        raise ValueError("fence() outside a transaction fences nothing")
    if row is None or row[0] != owner or int(row[1]) != epoch:
        now = "no row" if row is None else f"owner {row[0]!r}, epoch {row[1]}"
        raise Fenced(
            f"partition {part} of {prefix!r} is no longer {owner!r}'s at epoch {epoch} ({now})"
        )


def _seen(conn: Any, prefix: str, bridge: str) -> None:
    conn.execute(
        "INSERT INTO wren_bridges (prefix, bridge) VALUES (%s, %s)"
        " ON CONFLICT (prefix, bridge) DO UPDATE SET seen_at = now()",
        (prefix, bridge),
    )


def _renew(
    conn: Any, prefix: str, bridge: str, held: Mapping[int, int], lease_s: float
) -> dict[int, int]:
    """Say the bridge is alive and renew every (part, epoch) held, in one statement;
    those renewed.

    One statement, so one transaction: seen_at and the new expiry are the same `now()`,
    and a bridge that stops renewing stops being counted (seen_at + lease) at the very
    moment its leases run out (expires_at), neither before nor after."""
    rows = conn.execute(
        "WITH seen AS (INSERT INTO wren_bridges (prefix, bridge) VALUES (%s, %s)"
        "  ON CONFLICT (prefix, bridge) DO UPDATE SET seen_at = now())"
        " UPDATE wren_leases AS l SET expires_at = now() + make_interval(secs => %s)"
        " FROM unnest(%s::integer[], %s::bigint[]) AS h(part, epoch)"
        " WHERE l.prefix = %s AND l.owner = %s AND l.part = h.part AND l.epoch = h.epoch"
        " RETURNING l.part, l.epoch",
        (prefix, bridge, lease_s, list(held), list(held.values()), prefix, bridge),
    ).fetchall()
    return {int(p): int(e) for p, e in rows}


def _live(conn: Any, prefix: str, lease_s: float) -> list[str]:
    rows = conn.execute(
        "SELECT bridge FROM wren_bridges"
        " WHERE prefix = %s AND seen_at > now() - make_interval(secs => %s) ORDER BY bridge",
        (prefix, lease_s),
    ).fetchall()
    return [str(r[0]) for r in rows]


def _takeable(conn: Any, prefix: str, bridge: str) -> list[tuple[int, int]]:
    rows = conn.execute(
        "SELECT part, epoch FROM wren_leases"
        " WHERE prefix = %s AND (expires_at < now() OR owner = %s)",
        (prefix, bridge),
    ).fetchall()
    return [(int(p), int(e)) for p, e in rows]


# ---------------------------------------------------------------------- the keeper


@dataclass
class _Hold:
    epoch: int
    until: float  # the keeper's monotonic clock: acting stops here


@dataclass(frozen=True)
class LeaseSnapshot:
    """A keeper's state for status and metrics."""

    bridge: str
    prefix: str
    fleet_id: str
    partitions: int
    held: dict[int, int]  # partition -> epoch, held safely at the snapshot
    share: int
    live_bridges: tuple[str, ...]
    rounds: int
    gains: int
    losses: int
    db_errors: int
    callback_errors: int


Callback = Callable[[int, int], None]


class LeaseKeeper:
    """One bridge's share of a fleet's partitions, kept on a thread of its own.

        keeper = LeaseKeeper(dsn, "wren", on_gain=serve, on_loss=stop_serving)
        keeper.start()            # joins the fleet; PartitionCountMismatch, PgUnavailable
        keeper.holds(7)           # the epoch while partition 7 is safely ours, else None
        keeper.stop()             # gives everything back; stop(release=False) leaves
                                  # the rows to expire, as a killed bridge does

    The bridge id is `<name>-<8 hex>`, new for every keeper: a lease row's owner is then
    one instance, never a restarted process that does not know what the old one held.
    """

    def __init__(
        self,
        dsn: str,
        prefix: str,
        *,
        partitions: int = DEFAULT_PARTITIONS,
        name: str | None = None,
        round_s: float = ROUND_S,
        lease_s: float = LEASE_S,
        margin_s: float | None = None,
        on_gain: Callback | None = None,
        on_loss: Callback | None = None,
    ) -> None:
        if not prefix:
            raise ValueError("a fleet's prefix is not empty")
        margin = lease_s * _MARGIN_SHARE if margin_s is None else margin_s
        if not 0 < margin < lease_s:
            raise ValueError(f"the margin ({margin} s) must be more than 0 and less than the lease")
        if not 0 < round_s < lease_s - margin:
            # A hold must be renewed before the keeper's own clock ends it, or every
            # partition would flicker out of `holds` between rounds.
            raise ValueError(
                f"a round ({round_s} s) must be shorter than the lease less the margin"
                f" ({lease_s - margin} s)"
            )
        self.prefix = prefix
        self.partitions = check_partitions(partitions)
        self.bridge_id = f"{name or socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.round_s = round_s
        self.lease_s = lease_s
        self.margin_s = margin
        self._dsn = dsn
        self._on_gain = on_gain
        self._on_loss = on_loss
        # Where this keeper starts looking for partitions to take: keepers of one fleet
        # start at different places, so after a bridge dies the others mostly try for
        # different rows instead of all racing for the lowest.
        self._offset = zlib.crc32(self.bridge_id.encode("utf-8")) % self.partitions
        self._lock = threading.Lock()
        self._held: dict[int, _Hold] = {}
        self._share = self.partitions
        self._live: tuple[str, ...] = ()
        self._counts = {"rounds": 0, "gains": 0, "losses": 0, "db_errors": 0,
                        "callback_errors": 0}  # fmt: skip
        self._conn: Any = None
        self.fleet_id = ""
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._release_at_stop = True
        self._failing = False
        self._busy: set[int] = set()  # partitions whose take gave up waiting last round

    # ------------------------------------------------------------------ public face

    def start(self) -> None:
        """Join the fleet (applying the schema's migrations first) and start the rounds.
        Raises PartitionCountMismatch, PgUnavailable or MigrationError, and then nothing
        has started."""
        if self._thread is not None or self._stopping.is_set():
            raise RuntimeError("a LeaseKeeper starts once")
        conn = self._open()
        try:
            apply(conn)
            self.fleet_id = join_fleet(conn, self.prefix, self.partitions)
            conn.execute(
                "DELETE FROM wren_bridges WHERE prefix = %s"
                " AND seen_at < now() - make_interval(secs => %s)",
                (self.prefix, self.lease_s * _FORGET_LEASES),
            )
            _seen(conn, self.prefix, self.bridge_id)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        log.info("bridge %s joined fleet %s (%s, %d partitions)",
                 self.bridge_id, self.fleet_id, self.prefix, self.partitions)  # fmt: skip
        self._thread = threading.Thread(target=self._run, name="wren-lease-keeper", daemon=True)
        self._thread.start()

    def stop(self, release: bool = True) -> None:
        """End the rounds. With `release`, every partition held is lost (on_loss, on the
        keeper's thread) and then given back, so the other bridges take them next round;
        without, nothing is said to the database or the callbacks (a killed bridge's
        leases run out by themselves) and `holds` answers None from now on."""
        thread = self._thread
        if thread is None or self._stopping.is_set():
            return
        self._release_at_stop = release
        self._stopping.set()
        if thread is threading.current_thread():
            return  # called from a callback: the loop ends when the callback returns
        # A round in progress ends within its statements' timeouts, plus a reconnect;
        # a callback that never returns is the caller's, and is not waited for.
        thread.join(self.round_s + 2 * self.lease_s + CONNECT_TIMEOUT_S)
        if thread.is_alive():
            log.warning("the lease keeper of %s did not stop in time (a callback blocked?)",
                        self.bridge_id)  # fmt: skip
        with self._lock:
            self._held.clear()

    def holds(self, part: int) -> int | None:
        """The epoch of `part` while this bridge may act for it, else None."""
        now = time.monotonic()
        with self._lock:
            h = self._held.get(part)
            return h.epoch if h is not None and now < h.until else None

    def held(self) -> dict[int, int]:
        """partition -> epoch of every partition this bridge may act for now."""
        now = time.monotonic()
        with self._lock:
            return {p: h.epoch for p, h in self._held.items() if now < h.until}

    def fence(self, conn: Any, part: int, epoch: int) -> None:
        """`fence` for this bridge, refusing too when its own clock already says the
        lease may have run out (DESIGN: no store write once it may have)."""
        if self.holds(part) != epoch:
            raise Fenced(f"partition {part} is not held at epoch {epoch} by {self.bridge_id}")
        fence(conn, self.prefix, part, epoch, self.bridge_id)

    def snapshot(self) -> LeaseSnapshot:
        held = self.held()
        with self._lock:
            return LeaseSnapshot(
                bridge=self.bridge_id, prefix=self.prefix, fleet_id=self.fleet_id,
                partitions=self.partitions, held=held, share=self._share,
                live_bridges=self._live, rounds=self._counts["rounds"],
                gains=self._counts["gains"], losses=self._counts["losses"],
                db_errors=self._counts["db_errors"],
                callback_errors=self._counts["callback_errors"],
            )  # fmt: skip

    # ------------------------------------------------------------------ the thread

    def _open(self) -> Any:
        conn = connect(_bounded_dsn(self._dsn, self.lease_s), autocommit=True)
        # Every wait of the keeper's own statements is bounded: a statement by the lease,
        # a lock wait (a take behind a fenced write) by half a round.
        conn.execute(
            "SELECT set_config('application_name', %s, false),"
            " set_config('statement_timeout', %s, false), set_config('lock_timeout', %s, false)",
            (f"wren-lease {self.bridge_id}"[:63], str(int(self.lease_s * 1000)),
             str(max(1, int(self.round_s * 500)))),
        )  # fmt: skip
        return conn

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stopping.is_set():
            try:
                self._round()
                if self._failing:
                    self._failing = False
                    log.info("the lease keeper of %s reaches the database again", self.bridge_id)
            except Exception as e:
                self._count("db_errors")
                if not self._failing:
                    log.exception("a lease round of %s failed; retrying every round",
                                  self.bridge_id)  # fmt: skip
                else:
                    log.warning("a lease round of %s failed again: %s", self.bridge_id, e)
                self._failing = True
                self._close()
            # Rounds keep their cadence; a late one is not followed by others back to back.
            next_at = max(next_at + self.round_s, time.monotonic())
            self._stopping.wait(next_at - time.monotonic())
        try:
            if self._release_at_stop:
                self._release_all()
        except Exception:
            log.exception("the lease keeper of %s could not give its partitions back;"
                          " they expire in a lease", self.bridge_id)  # fmt: skip
        finally:
            self._close()

    def _round(self) -> None:
        started = time.monotonic()
        if self._conn is None:
            conn = self._open()
            try:
                join_fleet(conn, self.prefix, self.partitions)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        conn = self._conn
        self._renew(conn)
        live = _live(conn, self.prefix, self.lease_s)
        share = math.ceil(self.partitions / max(1, len(live)))
        with self._lock:
            self._live = tuple(live)
            self._share = share
            have = len(self._held)
        if have > share:
            self._give_back(conn)
        elif have < share:
            self._take(conn, share, started)
        self._count("rounds")

    def _renew(self, conn: Any) -> None:
        with self._lock:
            held = {p: h.epoch for p, h in self._held.items()}
        sent = time.monotonic()
        try:
            renewed = _renew(conn, self.prefix, self.bridge_id, held, self.lease_s)
        except Exception:
            # Whether it reached the database is unknown: stop acting for all of them.
            # If the rows are still ours they are taken back under new epochs later.
            for part, epoch in sorted(held.items()):
                self._lose(part, epoch, "its renewal failed")
            raise
        until = sent + self.lease_s - self.margin_s
        with self._lock:
            for part, epoch in renewed.items():
                h = self._held.get(part)
                if h is not None and h.epoch == epoch:
                    h.until = until
        for part, epoch in sorted(held.items()):
            if renewed.get(part) != epoch:
                self._lose(part, epoch, "another bridge took it")

    def _give_back(self, conn: Any) -> None:
        with self._lock:
            if not self._held:
                return
            # The one farthest from where this keeper starts taking: it keeps the ones
            # it would take again.
            part = max(self._held, key=self._preference)
            epoch = self._held[part].epoch
        self._lose(part, epoch, "over its share")
        release(conn, self.prefix, part, epoch, self.bridge_id)

    def _take(self, conn: Any, share: int, started: float) -> None:
        rows = _takeable(conn, self.prefix, self.bridge_id)
        with self._lock:
            mine = set(self._held)
        # Partitions that were busy last time go last, so one held off by a long write
        # cannot use up every round's budget while others wait free.
        busy, self._busy = self._busy, set()
        order = sorted(rows, key=lambda r: (r[0] in busy, self._preference(r[0])))
        for part, epoch in order:
            if part in mine or part >= self.partitions:
                continue
            with self._lock:
                if len(self._held) >= share:
                    return
            # Takes blocked behind fenced writes must not push the next renewal late.
            if time.monotonic() - started > self.round_s / 2:
                return
            sent = time.monotonic()
            try:
                new = take(conn, self.prefix, part, epoch, self.bridge_id, self.lease_s)
            except Exception as e:
                if getattr(e, "sqlstate", None) in _GAVE_UP:
                    log.info("partition %d is busy (a write of its last owner?): next round",
                             part)  # fmt: skip
                    self._busy.add(part)
                    continue
                raise
            if new is None:
                continue
            with self._lock:
                self._held[part] = _Hold(new, sent + self.lease_s - self.margin_s)
            self._count("gains")
            log.info("bridge %s serves partition %d (epoch %d)", self.bridge_id, part, new)
            self._call(self._on_gain, part, new, "on_gain")

    def _release_all(self) -> None:
        with self._lock:
            held = {p: h.epoch for p, h in self._held.items()}
        for part, epoch in sorted(held.items()):
            self._lose(part, epoch, "the bridge stops")
        conn = self._conn
        if conn is None:
            conn = self._conn = self._open()
        # Every row still ours, whichever epoch: a take whose answer was lost is ours too.
        conn.execute(
            "UPDATE wren_leases SET owner = NULL, expires_at = now()"
            " WHERE prefix = %s AND owner = %s",
            (self.prefix, self.bridge_id),
        )
        conn.execute(
            "DELETE FROM wren_bridges WHERE prefix = %s AND bridge = %s",
            (self.prefix, self.bridge_id),
        )
        log.info("bridge %s left fleet %s", self.bridge_id, self.fleet_id)

    def _lose(self, part: int, epoch: int, why: str) -> None:
        """Stop acting for `part` (holds says None from here), then tell the bridge."""
        with self._lock:
            h = self._held.get(part)
            if h is None or h.epoch != epoch:
                return
            del self._held[part]
        self._count("losses")
        log.info("bridge %s no longer serves partition %d (epoch %d): %s",
                 self.bridge_id, part, epoch, why)  # fmt: skip
        self._call(self._on_loss, part, epoch, "on_loss")

    def _call(self, callback: Callback | None, part: int, epoch: int, what: str) -> None:
        if callback is None:
            return
        try:
            callback(part, epoch)
        except Exception:
            self._count("callback_errors")
            log.exception("%s(%d, %d) of bridge %s failed", what, part, epoch, self.bridge_id)

    def _preference(self, part: int) -> int:
        return (part - self._offset) % self.partitions

    def _count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                log.debug("closing the lease keeper's connection failed", exc_info=True)


def _bounded_dsn(dsn: str, lease_s: float) -> str:
    """The DSN with TCP timeouts: a database gone from the network (no RST) would
    otherwise leave a statement waiting for minutes, past any server-side timeout."""
    # Imported here, as pgstore does: a bridge without PostgreSQL never loads psycopg
    # (and without it, connect() says so by name).
    try:
        from psycopg.conninfo import make_conninfo
    except ImportError:
        return dsn

    return str(
        make_conninfo(
            dsn,
            keepalives=1,
            keepalives_idle=max(1, int(lease_s / 3)),
            keepalives_interval=1,
            keepalives_count=3,
            tcp_user_timeout=int(lease_s * 1000),
        )
    )

