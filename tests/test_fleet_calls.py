"""The open-call rows a fleet's next owner answers by id (server_bridge/fleet/calls.py),
on a PostgreSQL server of the test's own."""

from __future__ import annotations

import threading

from server_bridge.fleet.calls import OpenCall, OpenCalls
from server_bridge.pgstore import apply, connect


def _calls(dsn: str) -> OpenCalls:
    with connect(dsn) as conn:
        apply(conn)
    return OpenCalls(dsn, "wren/v1")


def test_a_call_open_under_an_old_epoch_is_handed_to_the_next_owner_once(pg_dsn: str) -> None:
    old, new = _calls(pg_dsn), _calls(pg_dsn)
    try:
        llm = OpenCall("dev1", 7, "llm.complete", "0a0b0c0d.3", "llm", 4)
        mem = OpenCall("dev2", "x9", "mem.remember", None, "internal", 4)
        done = OpenCall("dev1", 8, "tool.call", "0a0b0c0d.3", "internal", 4)
        for call in (llm, mem, done):
            old.opened(3, 4, call)
        old.closed("dev1", 8)  # answered before the owner died
        other_part = OpenCall("dev3", 1, "llm.complete", "r", "llm", 4)
        old.opened(5, 4, other_part)
        # The new owner took partition 3 at epoch 5: what epoch 4 left open, by id and
        # with the types the board sent (an int id stays an int).
        left = new.left_open(3, 5)
        assert left == [llm, mem]
        assert isinstance(left[0].c, int) and isinstance(left[1].c, str)
        # Taken once: a second look (or a second taker) finds nothing.
        assert new.left_open(3, 5) == []
        # Its own calls (epoch 5) and other partitions' are not handed over.
        new.opened(3, 5, OpenCall("dev1", 9, "llm.complete", "r2", "llm", 5))
        assert new.left_open(3, 5) == []
        assert new.count() == 2
    finally:
        old.close()
        new.close()


def test_two_takers_racing_answer_each_call_once(pg_dsn: str) -> None:
    writer = _calls(pg_dsn)
    takers = [_calls(pg_dsn) for _ in range(2)]
    try:
        for n in range(200):
            writer.opened(1, 1, OpenCall(f"dev{n % 7}", n, "llm.complete", None, "llm", 1))
        got: list[list[OpenCall]] = [[], []]

        def take(k: int) -> None:
            got[k] = takers[k].left_open(1, 2)

        threads = [threading.Thread(target=take, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        ids = sorted(c.c for c in got[0] + got[1] if isinstance(c.c, int))
        assert ids == list(range(200))
    finally:
        writer.close()
        for t in takers:
            t.close()


def test_an_id_used_again_after_a_board_reboot_replaces_the_old_row(pg_dsn: str) -> None:
    calls = _calls(pg_dsn)
    try:
        calls.opened(2, 1, OpenCall("dev1", 1, "llm.complete", "aaaa0000.1", "llm", 1))
        calls.opened(2, 3, OpenCall("dev1", 1, "tool.call", "bbbb0000.1", "internal", 3))
        assert calls.count() == 1
        assert calls.left_open(2, 4) == [OpenCall("dev1", 1, "tool.call", "bbbb0000.1",
                                                  "internal", 3)]  # fmt: skip
    finally:
        calls.close()
