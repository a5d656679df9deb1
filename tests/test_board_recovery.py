"""The board never wedges (issue 24), end to end: the real bridge process, Mosquitto, and
the demo thermostat (with its memory field) on the MicroPython unix port at the README's
128K, from .mpy.

- A flood of junk `ctl` at QoS 1 at the broker's speed leaves the board online, and a
  valid request after it runs: refusals that wait for the link are folded into one
  event that counts them (`more`), not held one apiece by the link.
- A `req` the board cannot decode is refused by its id, read from its bytes, so the host
  that sent it ends at once instead of waiting out its timeout.
- A board whose heap an app took (a task that takes every free block) loses no
  request: it resets itself when its link or its presence finds no heap time after
  time, or when idle it has less free heap than the request it announces (the harness
  boots it again as a board would, exit 75, and its status says why), or it comes back
  on a connection that found enough; either way each request after ends by name.
- A board whose heap an app cut into holes (free bytes in plenty, no block a run
  needs) ends each request by name and resets itself after four in a row ran out of
  memory (or when its link finds no heap), then serves again; a request it read as it
  stopped its link is left to the broker for the next boot, not lost.
"""

from __future__ import annotations

from pathlib import Path

import msgpack
import paho.mqtt.client as mqtt
import pytest

from server_bridge.host.client import RequestRefused
from tests.stack import DEVICE, PREFIX, Stack, i686_binary
from tests.waiting import wait_for
from tools.virtual_board import MAIN_PY

JUNK = "junk"
# The word sizes the acceptance tests run on: the README's 128K on the 64-bit unix port,
# and on the 32-bit build (what boards are) the 96K its figures give (bench_heap: the
# memory turn needs 91-92K there from .mpy); skipped where the 32-bit build is not (the
# project never needs it).
WORDS = ("32-bit", "64-bit")


def _words(word: str) -> dict[str, str]:
    if word == "64-bit":
        return {}
    exe = i686_binary()
    if exe is None:
        pytest.skip("no 32-bit MicroPython build here")
    return {"heap": "96K", "micropython": exe}
CTL = f"{PREFIX}/d/{DEVICE}/ctl"
REQ = f"{PREFIX}/d/{DEVICE}/req"


def _speaker(s: Stack) -> mqtt.Client:
    """A client with the bridge's rights (it may publish `req` and `ctl` to boards)."""
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=JUNK)
    c.username_pw_set(JUNK, s.users[JUNK])
    c.max_queued_messages_set(0)
    c.max_inflight_messages_set(1000)
    c.connect(s.host, s.port)
    c.loop_start()
    return c


def _device_errors(s: Stack) -> list[dict[str, object]]:
    """The error events of the board's device stream `_` that reached the host."""
    assert s.client is not None
    return [e["d"] for e in s.client.events if e["r"] == "_" and e["t"] == "error"]


def _retained_status(s: Stack) -> dict[str, object]:
    """The board's retained `status`, read from the broker as the bridge reads it."""
    got: list[bytes] = []
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=JUNK)
    c.username_pw_set(JUNK, s.users[JUNK])
    c.on_message = lambda _c, _u, m: got.append(m.payload)
    c.connect(s.host, s.port)
    c.subscribe(f"{PREFIX}/d/{DEVICE}/status", qos=1)
    c.loop_start()
    try:
        wait_for(lambda: got, timeout=10, what="the board's retained status")
    finally:
        c.loop_stop()
        c.disconnect()
    status = msgpack.unpackb(got[-1], raw=False)
    assert isinstance(status, dict)
    return status


@pytest.mark.parametrize("word", WORDS)
def test_ten_thousand_junk_ctl_at_qos1_then_a_request_runs(tmp_path: Path, word: str) -> None:
    with Stack(tmp_path, extra_users={JUNK: "bridge"}, **_words(word)) as s:
        assert s.ask("How warm is it in here?").status == "done", s.describe()
        c = _speaker(s)
        try:
            # Three kinds of junk: a cancel of no run, an unknown op, and bytes that are
            # not msgpack at all.
            sent = []
            for i in range(10_000):
                if i % 3 == 0:
                    payload = msgpack.packb({"op": "cancel", "r": f"x{i}"})
                elif i % 3 == 1:
                    payload = b"\xc1junk%d" % i
                else:
                    payload = msgpack.packb({"op": "no-such-op"})
                sent.append(c.publish(CTL, payload, qos=1))
            for info in sent:
                info.wait_for_publish(60)
        finally:
            c.loop_stop()
            c.disconnect()
        # Every junk message was refused on the board's console, and the board kept up.
        wait_for(
            lambda: sum("refused" in line for line in s.console) >= 10_000,
            timeout=120,
            what="the board refusing every junk ctl",
        )
        snap = s.ask("How warm is it in here?", timeout=60)
        assert snap.status == "done", s.describe()
        assert "link: down" not in "\n".join(s.console), s.describe()
        # Folded, not dropped: an error event stands for the refusals that waited.
        errors = _device_errors(s)
        folded = [e for e in errors if isinstance(e.get("more"), int) and e["more"] > 0]
        assert folded, errors[-5:]
        assert s.board_resets == 0


def test_a_req_the_board_cannot_decode_is_refused_by_its_id(tmp_path: Path) -> None:
    with Stack(tmp_path, extra_users={JUNK: "bridge"}) as s:
        c = _speaker(s)
        try:
            # A well-formed map up to its last value, which is a byte msgpack never uses.
            good = msgpack.packb({"req": "bad-req-1", "input": "How warm is it?"})
            payload = bytes([good[0] + 1]) + good[1:] + msgpack.packb("zz") + b"\xc1"
            c.publish(REQ, payload, qos=1).wait_for_publish(10)
        finally:
            c.loop_stop()
            c.disconnect()
        wait_for(
            lambda: any(e.get("req") == "bad-req-1" for e in _device_errors(s)),
            timeout=30,
            what="the refusal naming bad-req-1",
        )
        refusal = next(e for e in _device_errors(s) if e.get("req") == "bad-req-1")
        assert refusal["kind"] == "bad_type", refusal
        # The board goes on.
        assert s.ask("How warm is it in here?").status == "done", s.describe()


def test_a_long_request_the_board_has_no_heap_for_ends_by_its_id(tmp_path: Path) -> None:
    # 3,900 characters within the announced 4,096: on a heap fragmented by the runs
    # before it, the decode may find no block of its size, or the run no heap to go on.
    # Either way the host learns it (refused no_memory by its id, or the run failed,
    # retryable), instead of waiting out its timeout as it did when the refusal named
    # no req: a wait_run that times out fails this test.
    with Stack(tmp_path) as s:
        for text in ("How warm is it?", "How warm is it? " * 125):
            assert s.ask(text).status == "done", s.describe()
        long_text = ("How warm is it? " * 300)[:3900]
        try:
            snap = s.ask(long_text, timeout=60)
        except RequestRefused as e:
            assert e.kind == "no_memory", e
        else:
            assert snap.status == "done" or (
                snap.status == "failed" and snap.error and snap.retryable
            ), s.describe()


def test_a_board_a_little_short_of_heap_ends_each_long_request_by_name(tmp_path: Path) -> None:
    # 125K, 3 KiB under the README's board: the long requests below run, or run out of
    # memory at their first events. A run whose run.started (the echoed 512 characters)
    # found no heap used to try it again on its way to run.failed, fail again, and end
    # nowhere: the host waited out its timeout (2 of 6 tries at 125K). Now each ends by
    # name (done, or failed and retryable, or refused no_memory by its id), and a short
    # request after them runs (after the board's reset, when all four ran out).
    ends = []
    with Stack(tmp_path, heap="125K") as s:
        for n in (4096, 3900, 4096, 3900, 4096, 3900):
            text = ("How warm is it? " * 300)[:n]
            try:
                snap = s.ask(text, timeout=60)
            except RequestRefused as e:
                assert e.kind == "no_memory", e
                ends.append("refused")
                continue
            assert snap.status == "done" or (
                snap.status == "failed" and snap.error and snap.retryable
            ), s.describe()
            ends.append(snap.status)
        # A short request then ends by name too, and runs within five: after four in a
        # row that ran out the board resets itself (refusing the next so: send it
        # again), and the one after runs on a new heap.
        for _ in range(5):
            try:
                snap = s.ask("How warm is it?", timeout=60)
            except RequestRefused as e:
                assert e.kind == "no_memory", e
                ends.append("refused")
                continue
            if snap.status == "done":
                break
            assert snap.status == "failed" and snap.retryable, s.describe()
            ends.append(snap.status)
        assert snap.status == "done", (ends, s.describe())


@pytest.mark.parametrize("word", WORDS)
def test_requests_up_to_the_announced_text_each_run(tmp_path: Path, word: str) -> None:
    # The acceptance: 4,096, 3,900, 2,000 and 1 bytes of text, each runs, in a
    # row on one board from .mpy. The hello announces 4,096 (`str`) and a payload with
    # room for the request's envelope beside it; a 4,096-character request used to be
    # 4,266 B against an announced payload of 4,096, refused too_large. Longest first:
    # the text is one block of its size on the heap, and after other long requests a
    # 128K board from .mpy may have no free block of 4 KiB (its code shares the heap);
    # that request is then refused no_memory by its id (the test below).
    # Frozen, the same board took them in either order.
    # On the 64-bit unix port at 128K the margin is about 2 KiB, and how much of it the
    # link holds (QoS 1 events waiting for their acks) depends on timing: a loaded CI
    # machine once ran the board out of heap in the 3,900-character run (it reset and
    # the run failed, retryable). There, and only there, a run that failed retryable
    # is asked again as a host would, and must then be done; the 32-bit build (what
    # boards are) must run each at the first try.
    with Stack(tmp_path, **_words(word)) as s:
        for n in (4096, 3900, 2000, 1):
            text = ("How warm is it? " * 300)[:n]
            snap = s.ask(text, timeout=60)
            if word == "64-bit" and snap.status == "failed":
                assert snap.retryable, f"{n} characters: {s.describe()}"
                snap = s.ask(text, timeout=60)
            assert snap.status == "done", f"{n} characters: {s.describe()}"
            # The user row: the text as the board echoed it, cut to 512 and saying so.
            user = [r.text for r in snap.rows if r.kind == "user"]
            cut = f" [cut: {n - 512} more characters]" if n > 512 else ""
            assert user == [text[:512] + cut], s.describe()


HOG_MAIN_PY = (
    MAIN_PY.replace("main()\n", "")
    + '''
# A leak of the app's own: once the test leaves a file named "hog" on the flash, a
# task takes every free block and holds it.
import gc, os
from edge_runtime import platform
held = []

async def hog():
    while True:
        await platform.asyncio.sleep_ms(50)
        try:
            os.stat("hog")
        except OSError:
            continue
        os.remove("hog")
        gc.collect()
        size = 4096
        while size >= 16:
            try:
                held.append(bytearray(size))
            except MemoryError:
                size //= 2
        print("hog: holding", len(held), "blocks")

platform.asyncio.create_task(hog())
main()
'''
)


def test_a_board_whose_heap_an_app_took_loses_no_request(
    tmp_path: Path,
) -> None:
    # The demo's main.py creates the hog task before asyncio runs: board.start runs
    # the loop, which then runs both.
    main_py = HOG_MAIN_PY.replace(
        "platform.asyncio.create_task(hog())\nmain()\n",
        "_run = platform.asyncio.run\n"
        "async def _both(coro):\n"
        "    platform.asyncio.create_task(hog())\n"
        "    return await coro\n"
        "platform.asyncio.run = lambda coro: _run(_both(coro))\n"
        "main()\n",
    )
    with Stack(tmp_path, main_py=main_py, extra_users={JUNK: "bridge"}) as s:
        assert s.ask("How warm is it in here?").status == "done", s.describe()
        mark = s.console_mark()
        (s.flash / "hog").write_text("")
        s.wait_console("hog: holding", after=mark)
        # The connection it has goes with the broker; the board comes back, by a reset
        # (its link, or its presence, found no heap time after time; or, idle, it had
        # less than the request it announces) or on a connection that found enough.
        s.restart_broker(wait_clients=False)
        s.wait_console("link: up", after=mark, timeout=60)
        wait_for(lambda: s.client is not None and s.client.connected, "the host back")
        # Whichever way, no request is lost: each ends, done, failed retryable or
        # refused by its id (a wait that times out fails the test).
        for _ in range(3):
            try:
                snap = s.ask("How warm is it in here?", timeout=60)
            except RequestRefused as e:
                assert e.kind in ("no_memory", "device_offline"), e
            else:
                assert snap.status == "done" or (
                    snap.status == "failed" and snap.retryable
                ), s.describe()
        if s.board_resets:
            # A board that reset itself says why in its next boot's status.
            assert any("the board resets: no heap for " in line for line in s.console)
            status = _retained_status(s)
            assert status["st"] == "online" and "no heap for " in str(status["reset"])


# A heap the app cut into holes: once the test leaves a file named "frag" on the flash,
# a task fills the free heap with pairs of blocks, a small one it keeps and one of
# HOLE bytes it lets go, so most of the heap stays free, none of it in a piece longer
# than HOLE bytes (plus a gap beside it). 96: with holes of 256 a board whose runtime
# holds less code (memcall.py, mqttopen.py let go) served every run in them.
HOLE = 96
FRAG_MAIN_PY = (
    MAIN_PY.replace("main()\n", "")
    + f"""
import gc, os
from edge_runtime import platform

async def frag():
    global held
    while True:
        await platform.asyncio.sleep_ms(50)
        try:
            os.stat("frag")
        except OSError:
            continue
        os.remove("frag")
        gc.collect()
        # As many pairs as the free heap holds, with no collection among them: one
        # (the runtime sets a threshold, platform.collect_often) freed the holes made
        # so far and the next pairs went into them, which left a piece of the heap
        # whole once the runtime's footprint shrank under the fixed count this had.
        held = [None] * (gc.mem_free() // ({HOLE} + 16))
        n = 0
        gc.disable()
        try:
            while n < len(held):
                bytearray({HOLE})
                held[n] = bytearray(1)
                n += 1
        except MemoryError:
            pass
        gc.enable()
        gc.collect()
        print("frag: holding", n, "blocks; heap free", gc.mem_free())

_run = platform.asyncio.run
async def _both(coro):
    platform.asyncio.create_task(frag())
    return await coro
platform.asyncio.run = lambda coro: _run(_both(coro))
main()
"""
)


def test_a_board_whose_heap_is_all_holes_resets_and_serves_again(tmp_path: Path) -> None:
    # Free heap in plenty but in pieces too small for a run: each request ends by name
    # (failed retryable, or refused), and the board resets, whichever finds it first:
    # four requests in a row out of memory, once idle (firmware_tests/test_runs.py
    # has that rule alone), or its link finding no heap time after time. It is booted
    # again by the harness (exit 75), as a board would be, and serves on a whole heap.
    with Stack(tmp_path, main_py=FRAG_MAIN_PY, extra_users={JUNK: "bridge"}) as s:
        assert s.ask("How warm is it in here?").status == "done", s.describe()
        mark = s.console_mark()
        (s.flash / "frag").write_text("")
        s.wait_console("frag: holding", after=mark)
        ends: list[str] = []
        for _ in range(8):
            try:
                snap = s.ask("How warm is it in here?", timeout=60)
            except RequestRefused as e:
                assert e.kind in ("no_memory", "device_offline"), e
                ends.append(e.kind)
            else:
                ends.append(snap.status)
                assert snap.status == "done" or (
                    snap.status == "failed" and snap.retryable
                ), s.describe()
            if ends[-1] == "done" and s.board_resets:
                break
        assert s.board_resets == 1 and ends[-1] == "done", (ends, s.describe())
        # The three rules' reasons (the idle one names the free bytes it found): which
        # comes first depends on where the holes meet the next allocation.
        why = ("4 requests in a row ran out of memory", "no heap for the link",
               "no heap for a request (")
        assert any(f"the board resets: {w}" in line for line in s.console for w in why)
        status = _retained_status(s)
        assert status["st"] == "online" and status["reset"].startswith(why), status


@pytest.fixture(autouse=True)
def _no_leftover_reset_file(tmp_path: Path) -> None:
    # The reset file is read and removed by the next boot: none may outlive a test.
    yield
    leftover = tmp_path / "flash" / "wren_reset.txt"
    assert not leftover.exists()
