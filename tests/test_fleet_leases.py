"""Partitions leased in PostgreSQL (server_bridge/fleet): keepers on a real server of the
test's own, with short rounds (0.2 s, lease 1 s), so a failover takes about a second.

Bounds on time are derived from the lease and generous (a loaded 2-core machine); what
each test proves is the order of things: no partition acted for by two keepers at once,
a take only after a lease ran out or was given back, a write refused after a takeover.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

from server_bridge.fleet import (
    DEFAULT_PARTITIONS,
    Fenced,
    LeaseKeeper,
    PartitionCountMismatch,
    check_partitions,
    devices_in,
    fence,
    join_fleet,
    partition_client_id,
    partition_of,
    release,
    take,
)
from server_bridge.pgstore import apply, connect

ROUND_S = 0.2
LEASE_S = 1.0
# How many kills the failover test measures (each about 3 s with its rejoin).
KILLS = 3


def wait_until(what: Callable[[], bool], timeout: float, step: float = 0.02) -> float:
    """Seconds until `what()` held; fails the test after `timeout`."""
    start = time.monotonic()
    while not what():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(step)
    return time.monotonic() - start


class Keepers:
    """The keepers of one test, stopped (as if killed) at its end whatever happened."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.made: list[LeaseKeeper] = []

    def __call__(self, prefix: str = "wren", partitions: int = DEFAULT_PARTITIONS,
                 **kw: object) -> LeaseKeeper:  # fmt: skip
        kw.setdefault("round_s", ROUND_S)
        kw.setdefault("lease_s", LEASE_S)
        k = LeaseKeeper(self.dsn, prefix, partitions=partitions, **kw)  # type: ignore[arg-type]
        self.made.append(k)
        return k

    def stop_all(self) -> None:
        for k in self.made:
            k.stop(release=False)


@pytest.fixture
def keepers(pg_dsn: str) -> Iterator[Keepers]:
    ks = Keepers(pg_dsn)
    yield ks
    ks.stop_all()


class Exclusive:
    """Samples every keeper's `held()` until stopped and records any partition held by
    two at one instant. A sample that took long (the thread was descheduled) proves
    nothing and is dropped: two reads far apart could straddle a handover."""

    def __init__(self, keepers: list[LeaseKeeper]) -> None:
        self.keepers = keepers
        self.lock = threading.Lock()
        self.samples = 0
        self.violations: list[tuple[int, list[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Exclusive:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            with self.lock:
                ks = list(self.keepers)
            t0 = time.monotonic()
            helds = [(k.bridge_id, k.held()) for k in ks]
            if time.monotonic() - t0 > 0.02:
                continue
            owners: dict[int, list[str]] = {}
            for bridge, held in helds:
                for part in held:
                    owners.setdefault(part, []).append(bridge)
            self.samples += 1
            self.violations += [(p, b) for p, b in owners.items() if len(b) > 1]

    def set(self, keepers: list[LeaseKeeper]) -> None:
        with self.lock:
            self.keepers = list(keepers)


def owners(keepers: list[LeaseKeeper]) -> dict[int, tuple[str, int]]:
    """partition -> (bridge, epoch) of what the keepers hold now."""
    return {p: (k.bridge_id, e) for k in keepers for p, e in k.held().items()}


def shares(keepers: list[LeaseKeeper]) -> list[int]:
    return sorted(len(k.held()) for k in keepers)


def rows(dsn: str, prefix: str = "wren") -> dict[int, tuple[str | None, int]]:
    with connect(dsn, autocommit=True) as conn:
        got = conn.execute(
            "SELECT part, owner, epoch FROM wren_leases WHERE prefix = %s", (prefix,)
        ).fetchall()
    return {int(p): (o, int(e)) for p, o, e in got}


# ---------------------------------------------------------------------- the mapping


def test_partition_of_is_stable_and_spreads_devices_evenly() -> None:
    # Fixed values: the mapping is crc32, the same in every process and on every machine.
    assert [partition_of(d, 32) for d in ("board-1", "greenhouse-07", "ü-sensor", "")] == [
        30, 6, 4, 0,
    ]  # fmt: skip
    assert partition_of("board-1", 32) == zlib.crc32(b"board-1") % 32
    for ids in (
        [f"dev-{i}" for i in range(10_000)],
        [uuid.UUID(int=i * 7919 + 1).hex for i in range(10_000)],
    ):
        counts = Counter(partition_of(d, 32) for d in ids)
        assert len(counts) == 32
        mean = len(ids) / 32
        assert 0.75 * mean < min(counts.values()) <= max(counts.values()) < 1.25 * mean, counts
    devices = [f"dev-{i}" for i in range(100)]
    mine = devices_in(devices, [0, 1], 32)
    assert mine and all(partition_of(d, 32) in (0, 1) for d in mine)
    assert partition_client_id("wren-bridge", 7) == "wren-bridge-p7"
    for bad in (0, -1, 1025, True):
        with pytest.raises(ValueError):
            check_partitions(bad)


def test_round_lease_and_margin_are_checked() -> None:
    # Refused before anything is connected to.
    with pytest.raises(ValueError, match="round"):
        LeaseKeeper("host=nowhere.invalid", "wren", round_s=1.0, lease_s=1.0)
    with pytest.raises(ValueError, match="margin"):
        LeaseKeeper("host=nowhere.invalid", "wren", lease_s=1.0, margin_s=1.0)
    with pytest.raises(ValueError, match="partitions"):
        LeaseKeeper("host=nowhere.invalid", "wren", partitions=0)


# ---------------------------------------------------------------------- sharing and failover


def test_three_keepers_share_fail_over_rejoin_and_leave(pg_dsn: str, keepers: Keepers) -> None:
    ks = [keepers() for _ in range(3)]
    with Exclusive(ks) as excl:
        for k in ks:
            k.start()
        assert len({k.fleet_id for k in ks}) == 1
        # The first keeper takes all 32 alone and gives back one a round: ~21 rounds.
        wait_until(lambda: shares(ks) == [10, 11, 11], timeout=40 * ROUND_S + 10)
        assert all(len(k.snapshot().live_bridges) == 3 for k in ks)

        took: list[float] = []
        for _ in range(KILLS):
            victim, survivors = ks[0], ks[1:]
            lost = victim.held()
            assert len(lost) in (10, 11)
            start = time.monotonic()
            victim.stop(release=False)  # as kill -9: nothing said to the database
            assert victim.holds(next(iter(lost))) is None

            def taken(lost: dict[int, int] = lost, survivors: list[LeaseKeeper] = survivors
                      ) -> bool:  # fmt: skip
                held = owners(survivors)
                return all(p in held for p in lost)

            wait_until(taken, timeout=LEASE_S + 10 * ROUND_S + 5)
            took.append(time.monotonic() - start)
            held = owners(survivors)
            assert all(held[p][1] > e for p, e in lost.items()), (held, lost)
            # The dead bridge stopped counting once not seen for a lease: 16 each.
            wait_until(lambda s=survivors: shares(s) == [16, 16], timeout=10 * ROUND_S + 5)  # type: ignore[misc]

            # A bridge that joins later gets its share as the others give back.
            late = keepers()
            late.start()
            ks = [*survivors, late]
            excl.set(ks)
            wait_until(lambda k=ks: shares(k) == [10, 11, 11], timeout=20 * ROUND_S + 10)  # type: ignore[misc]

        print(f"\nfailover after kill -9 (lease {LEASE_S} s, round {ROUND_S} s):"
              f" {', '.join(f'{t:.2f}' for t in took)} s;"
              f" p50 {statistics.median(took):.2f} s, max {max(took):.2f} s")  # fmt: skip
        # Its leases run out at most a lease after its last renewal; a survivor's round
        # then takes them. Anything far past that is a bug, not load.
        assert max(took) < LEASE_S + 5 * ROUND_S + 1.5

        # A clean stop gives everything back at once: no row is its own any more, and
        # the others take them at their next round, not a lease later.
        leaving, rest = ks[0], ks[1:]
        gone = set(leaving.held())
        start = time.monotonic()
        leaving.stop()
        assert leaving.bridge_id not in {o for o, _ in rows(pg_dsn).values()}
        wait_until(lambda: gone <= set(owners(rest)), timeout=LEASE_S + 10 * ROUND_S)
        handed = time.monotonic() - start
        print(f"clean stop: its {len(gone)} partitions served by the others after {handed:.2f} s")
        assert handed < LEASE_S
        wait_until(lambda: shares(rest) == [16, 16], timeout=10 * ROUND_S + 5)
    assert excl.samples > 200
    assert excl.violations == []


def test_a_paused_keeper_stops_acting_and_its_late_write_is_fenced(
    pg_dsn: str, keepers: Keepers
) -> None:
    # The keeper's thread is stalled inside its first on_gain (a stopped VM, a long GC):
    # no renewal goes out while it is.
    unpause = threading.Event()
    lost: list[tuple[int, int]] = []
    first: list[tuple[int, int]] = []

    def stall(part: int, epoch: int) -> None:
        if not first:
            first.append((part, epoch))
            unpause.wait(10 * LEASE_S)

    a = keepers(partitions=4, on_gain=stall, on_loss=lambda p, e: lost.append((p, e)))
    a.start()
    wait_until(lambda: bool(first), timeout=5)
    part, epoch = first[0]
    assert a.holds(part) == epoch
    # Its own clock ends the hold before the database's lease runs out.
    wait_until(lambda: a.holds(part) is None, timeout=LEASE_S)
    b = keepers(partitions=4)
    with Exclusive([a, b]) as excl:
        b.start()
        wait_until(lambda: b.holds(part) is not None, timeout=LEASE_S + 10 * ROUND_S + 5)
        new = b.holds(part)
        assert new is not None and new > epoch
        with connect(pg_dsn) as conn:
            conn.execute("CREATE TABLE notes (part integer, body text)")
            conn.commit()
            # The paused bridge's late write, through the keeper and straight at the row.
            for late in (lambda: a.fence(conn, part, epoch),
                         lambda: fence(conn, a.prefix, part, epoch, a.bridge_id)):  # fmt: skip
                with pytest.raises(Fenced):
                    with conn.transaction():
                        conn.execute("INSERT INTO notes VALUES (%s, 'late')", (part,))
                        late()
            with conn.transaction():
                b.fence(conn, part, new)
                conn.execute("INSERT INTO notes VALUES (%s, 'on time')", (part,))
            assert conn.execute("SELECT body FROM notes").fetchall() == [("on time",)]
        unpause.set()
        # Awake again, its next renewal finds the row is another's: lost, not held.
        wait_until(lambda: (part, epoch) in lost, timeout=10 * ROUND_S + 5)
        assert a.holds(part) is None
        time.sleep(3 * ROUND_S)
    assert excl.violations == []


def test_fenced_writes_hold_off_a_take_but_not_a_renewal(pg_dsn: str, keepers: Keepers) -> None:
    a = keepers(partitions=2)
    a.start()
    wait_until(lambda: len(a.held()) == 2, timeout=5)
    e0 = a.holds(0)
    assert e0 is not None
    with connect(pg_dsn) as conn:
        conn.execute("CREATE TABLE notes (body text)")
        conn.commit()
        with conn.transaction():
            a.fence(conn, 0, e0)
            conn.execute("INSERT INTO notes VALUES ('slow write')")
            # Renewals go on while the write's transaction is open.
            time.sleep(1.5 * LEASE_S)
            assert a.holds(0) == e0
            a.stop(release=False)
            b = keepers(partitions=2)
            b.start()
            # b takes partition 1 once a's lease runs out; partition 0 waits for the
            # write that passed the fence to end.
            wait_until(lambda: b.holds(1) is not None, timeout=LEASE_S + 10 * ROUND_S + 5)
            time.sleep(3 * ROUND_S)
            assert b.holds(0) is None
        # Committed: now b takes it, under a new epoch, and reads what was written.
        wait_until(lambda: b.holds(0) is not None, timeout=10 * ROUND_S + 5)
        assert (b.holds(0) or 0) > e0
        assert conn.execute("SELECT body FROM notes").fetchall() == [("slow write",)]
    with connect(pg_dsn, autocommit=True) as conn, pytest.raises(ValueError):
        fence(conn, "wren", 0, 1, "x")  # no transaction: the lock would fence nothing


# ---------------------------------------------------------------------- races and errors


def test_two_bridges_racing_for_a_free_partition_one_wins(pg_dsn: str, keepers: Keepers) -> None:
    with connect(pg_dsn, autocommit=True) as setup:
        apply(setup)
        join_fleet(setup, "race", 1)
    conns = [connect(pg_dsn, autocommit=True) for _ in range(2)]
    try:
        epoch = 0
        for _ in range(150):
            barrier = threading.Barrier(2)
            won: list[tuple[str, int | None]] = [("", None)] * 2

            def race(i: int, won: list[tuple[str, int | None]], epoch: int,
                     barrier: threading.Barrier) -> None:  # fmt: skip
                barrier.wait(5)
                won[i] = (f"b{i}", take(conns[i], "race", 0, epoch, f"b{i}", 30.0))

            threads = [
                threading.Thread(target=race, args=(i, won, epoch, barrier)) for i in range(2)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            winners = [(b, e) for b, e in won if e is not None]
            assert len(winners) == 1, won
            bridge, new = winners[0]
            assert new == epoch + 1
            # The loser cannot take it now: the lease runs 30 s.
            other = "b1" if bridge == "b0" else "b0"
            assert take(conns[0], "race", 0, new, other, 30.0) is None
            assert release(conns[0], "race", 0, new, bridge)
            epoch = new
    finally:
        for c in conns:
            c.close()

    # The same through keepers started at one instant: one takes the only partition, and
    # it was taken once (epoch 1).
    for i in range(4):
        pair = [keepers(prefix=f"pair{i}", partitions=1) for _ in range(2)]
        barrier = threading.Barrier(2)

        def start(k: LeaseKeeper, barrier: threading.Barrier = barrier) -> None:
            barrier.wait(5)
            k.start()

        with Exclusive(pair) as excl:
            threads = [threading.Thread(target=start, args=(k,)) for k in pair]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            wait_until(lambda p=pair: sum(len(k.held()) for k in p) == 1, timeout=5)  # type: ignore[misc]
            time.sleep(3 * ROUND_S)
            assert sum(len(k.held()) for k in pair) == 1
        assert excl.violations == []
        assert [e for _, e in rows(pg_dsn, f"pair{i}").values()] == [1]


def test_a_callback_that_raises_is_logged_and_the_keeper_goes_on(
    pg_dsn: str, keepers: Keepers, caplog: pytest.LogCaptureFixture
) -> None:
    def boom(part: int, epoch: int) -> None:
        raise RuntimeError(f"boom {part}")

    caplog.set_level(logging.INFO, logger="wren.bridge.fleet")
    k = keepers(partitions=4, on_gain=boom, on_loss=boom)
    k.start()
    wait_until(lambda: len(k.held()) == 4, timeout=5)
    time.sleep(2 * LEASE_S)  # renewed all along, whatever the callbacks did
    assert len(k.held()) == 4
    snap = k.snapshot()
    assert snap.callback_errors == 4 and snap.gains == 4 and snap.losses == 0
    assert snap.rounds >= 5 and snap.share == 4 and snap.live_bridges == (k.bridge_id,)
    k.stop()
    assert k.snapshot().callback_errors == 8
    failed = [r for r in caplog.records if r.levelno == logging.ERROR and r.exc_info]
    assert len(failed) == 8
    assert {r.getMessage().split("(")[0] for r in failed} == {"on_gain", "on_loss"}
    # The raising on_loss did not keep the partitions from being given back.
    assert all(owner is None for owner, _ in rows(pg_dsn).values())


def test_a_failed_renewal_loses_everything_until_the_database_answers(
    pg_dsn: str, keepers: Keepers, caplog: pytest.LogCaptureFixture
) -> None:
    lost: list[tuple[int, int]] = []
    k = keepers(partitions=4, on_loss=lambda p, e: lost.append((p, e)))
    k.start()
    wait_until(lambda: len(k.held()) == 4, timeout=5)
    before = k.held()
    with connect(pg_dsn) as blocker:
        # The renewal waits on the table's lock past its lock_timeout: it fails, and the
        # keeper cannot know what it renewed.
        blocker.execute("LOCK TABLE wren_leases IN EXCLUSIVE MODE")
        wait_until(lambda: sorted(lost) == sorted(before.items()), timeout=10 * ROUND_S + 5)
        assert k.held() == {}
        blocker.rollback()
    # Taken back by the same keeper under new epochs, without waiting for the rows (still
    # its own) to expire.
    wait_until(lambda: len(k.held()) == 4, timeout=10 * ROUND_S + 5)
    assert all(e == before[p] + 1 for p, e in k.held().items())
    assert k.snapshot().db_errors >= 1
    assert any("lease round" in r.getMessage() and r.exc_info for r in caplog.records)


def test_the_keeper_survives_losing_its_connection(pg_dsn: str, keepers: Keepers) -> None:
    lost: list[tuple[int, int]] = []
    k = keepers(partitions=4, on_loss=lambda p, e: lost.append((p, e)))
    k.start()
    wait_until(lambda: len(k.held()) == 4, timeout=5)
    before = k.held()
    with connect(pg_dsn, autocommit=True) as admin:
        killed = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name = %s",
            (f"wren-lease {k.bridge_id}",),
        ).fetchone()[0]
    assert killed == 1
    wait_until(lambda: k.snapshot().db_errors >= 1, timeout=10 * ROUND_S + 5)
    # It connects again and holds all four. Usually the connection died between rounds
    # and the renewal was what failed: then lost and taken again under new epochs; if it
    # died mid-round, after the renewal, nothing was lost.
    wait_until(lambda: len(k.held()) == 4, timeout=LEASE_S + 10 * ROUND_S + 5)
    for p, e in k.held().items():
        assert e == before[p] + ((p, before[p]) in lost)


def test_a_bridge_with_another_partition_count_is_refused(pg_dsn: str, keepers: Keepers) -> None:
    first = keepers(partitions=32)
    first.start()
    odd = keepers(partitions=16)
    with pytest.raises(PartitionCountMismatch, match="32 partitions"):
        odd.start()
    assert odd.held() == {}
    # Another prefix is another fleet, with its own count and id.
    other = keepers(prefix="other", partitions=16)
    other.start()
    assert other.fleet_id != first.fleet_id
