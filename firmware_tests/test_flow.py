# The board's side of a lossless stream, over a real broker on both runtimes: streamed
# text coalesced and paced by acks, chunks repeated or missing, a run cancelled mid-
# stream, the bridge's presence (gone, back, a new process), the persistent session,
# messages over the receive buffer, and a run faster than its link or cut off from it.
# The bridge is the scripted double of firmware_tests/scripted_bridge.py.
from edge_runtime import codec
from edge_runtime import platform
from edge_runtime.agent import Agent
from edge_runtime.events import RX_PAYLOAD
from edge_runtime.link import Link
from firmware_tests.clock import Clock
from firmware_tests.scripted_bridge import device_errors, with_board
from firmware_tests.support import broker_address, run

# The board's grace and stall bounds in the tests that move its clock: the defaults'
# size, and under the 10 s bound on a write in progress and half the scripted bridge's
# 30 s keepalive, which the same move also passes.
_GRACE_MS = 5000
_STALL_MS = 5000


def test_a_call_waits_across_a_reconnect_when_the_broker_kept_the_session():
    async def body(bridge, runtime):
        bridge.answer_rpc = False
        bridge.send("req", {"req": "keep1", "input": "x"})
        await bridge.wait_for(lambda: len(bridge.calls) == 1)
        runtime.link.reconnect("test cuts the link")
        # The answer is sent while the board may be away: it waits in its session.
        bridge.answer_rpc = True
        bridge.answer(bridge.calls[0])
        await bridge.wait_for(lambda: bridge.ended() or bridge.ended("run.failed"), 15000)
        assert bridge.ended() and not bridge.ended("run.failed")
        assert runtime.link.session_present

    run(with_board("tb-keep", body))


def test_a_call_fails_at_once_and_retryable_when_the_session_was_lost():
    async def body(bridge, runtime):
        bridge.answer_rpc = False
        bridge.send("req", {"req": "drop1", "input": "x"})
        await bridge.wait_for(lambda: len(bridge.calls) == 1)
        # Another client with the board's id and a clean session takes the connection
        # over and wipes the session: the answers the call waits for can never come.
        host, port = broker_address()
        thief = Link(runtime.device, host, port, clean_session=True)
        t = platform.asyncio.create_task(thief.run())
        assert await thief.wait_connected(5000)
        thief.stop()
        await platform.wait_for_ms(t, 3000)
        # Far sooner than the 120 s call timeout: the reconnect itself fails the call.
        await bridge.wait_for(lambda: bridge.ended("run.failed"), 15000)
        failed = bridge.ended("run.failed")[0]["d"]
        assert failed["err"]["kind"] == "llm" and failed["retryable"] is True
        assert "link" in failed["err"]["msg"]
        assert not runtime.link.session_present and runtime.active == {}

    run(with_board("tb-drop", body))


def _run_events(bridge, t=None):
    started = [e for e in bridge.events if e["t"] == "run.started"]
    if not started:
        return []
    run_id = started[-1]["r"]
    events = bridge.of_run(run_id)
    return events if t is None else [e for e in events if e["t"] == t]


def test_a_long_streamed_answer_is_coalesced_and_paced():
    # 2,000 characters in 4-character chunks, as models stream tokens: the board sends a
    # few events, not 500, and never lets the bridge run more than its window ahead.
    # (This scripted bridge sends each chunk on its own, paced by acks: with the default
    # delta_ms the time bound would decide how many; here the size bound does.)
    text = "".join("%04d," % i for i in range(400))
    script = [[{"stream": [text, 4]}]]

    async def body(bridge, runtime):
        bridge.send("req", {"req": "long1", "input": "count"})
        await bridge.wait_for(lambda: bridge.ended(), 30000)
        events = _run_events(bridge)
        assert [e["i"] for e in events] == list(range(1, len(events) + 1))
        deltas = [e["d"]["text"] for e in events if e["t"] == "msg.delta"]
        assert len(deltas) <= 2000 // 256 + 3 and max(len(d) for d in deltas) <= 256
        k = 0
        for d in deltas:  # the text, piece by piece (no second 2,000-character copy)
            assert text[k:k + len(d)] == d
            k += len(d)
        assert k == len(text)
        deltas = events = None
        # Acknowledged as it went: the last ack is the last chunk.
        call = bridge.calls[0]["c"]
        assert bridge.acks[call] == 500 and runtime.rpc.late == 0
        assert runtime.link.stats["reconnects"] == 0

    run(with_board("tb-long", body, script, settings={"delta_ms": 60000}))


def test_the_first_text_goes_at_once_and_later_text_waits_at_most_delta_ms():
    # A model that stops mid-answer: the turn's first words go as they come (the user
    # waits for them); what came after them is sent once it has waited delta_ms, not
    # held until more text comes.
    script = [[{"text": "The answer "}, {"text": "is"}, {"text": " 42"}, {"hold": 1}]]

    async def body(bridge, runtime):
        bridge.send("req", {"req": "wait1", "input": "x"})
        await bridge.wait_for(lambda: len(_run_events(bridge, "msg.delta")) >= 2)
        assert [e["d"]["text"] for e in _run_events(bridge, "msg.delta")] == ["The answer ",
                                                                             "is 42"]
        assert not bridge.ended()

    run(with_board("tb-wait", body, script, settings={"delta_ms": 200}))


def test_a_chunk_delivered_twice_is_taken_once():
    script = [[{"text": "ab"}, {"dup": 1}, {"text": "cd"}]]

    async def body(bridge, runtime):
        bridge.send("req", {"req": "dup1", "input": "x"})
        await bridge.wait_for(lambda: bridge.ended() or bridge.ended("run.failed"))
        assert bridge.ended()
        assert "".join(e["d"]["text"] for e in _run_events(bridge, "msg.delta")) == "abcd"
        assert runtime.rpc.duplicates == 1

    run(with_board("tb-dup", body, script))


def test_a_missing_chunk_fails_the_call_retryable_never_a_partial_answer():
    # A chunk that never came, seen from the next one or from the final's count.
    for name, steps in (("mid", [{"text": "ab"}, {"skip": 1}, {"text": "cd"}]),
                        ("end", [{"text": "ab"}, {"skip": 1}])):

        async def body(bridge, runtime):
            bridge.send("req", {"req": "gap-" + name, "input": "x"})
            await bridge.wait_for(lambda: bridge.ended() or bridge.ended("run.failed"))
            assert not bridge.ended(), name
            failed = bridge.ended("run.failed")[0]["d"]
            assert failed["retryable"] is True and "gap" in failed["err"]["msg"], failed
            assert runtime.active == {}

        run(with_board("tb-gap" + name, body, [steps]))


def test_a_run_cancelled_mid_stream_tells_the_bridge_to_stop():
    script = [[{"text": "one "}, {"text": "two "}, {"hold": 1}]]

    async def body(bridge, runtime):
        bridge.send("req", {"req": "stop1", "input": "x"})
        await bridge.wait_for(lambda: len(_run_events(bridge, "msg.delta")) == 1)
        run_id = _run_events(bridge)[0]["r"]
        bridge.send("ctl", {"op": "cancel", "r": run_id, "reason": "enough"})
        await bridge.wait_for(lambda: bridge.ended("run.cancelled"))
        await bridge.wait_for(lambda: bridge.stops)
        assert bridge.stops == [bridge.calls[0]["c"]] and runtime.active == {}

    run(with_board("tb-stop", body, script))


def _bridge_heard(runtime, up):
    # Whether the board has taken the bridge's presence: the boot id it keeps for its
    # calls is the bridge's while online, None once offline.
    return (runtime.rpc.bridge == "b1") == up


def test_a_bridge_offline_past_the_grace_fails_the_call_and_frees_the_slot():
    # The grace passes on the board's clock, moved on by the test (firmware_tests/clock.py).
    clock = Clock()

    async def body(bridge, runtime):
        bridge.answer_rpc = False
        bridge.send("req", {"req": "gone1", "input": "x"})
        await bridge.wait_for(lambda: len(bridge.calls) == 1)
        await bridge.put_status("offline")
        await bridge.wait_for(lambda: _bridge_heard(runtime, False))
        await clock.advance(_GRACE_MS)
        await bridge.wait_for(lambda: bridge.ended("run.failed"), 5000)
        failed = bridge.ended("run.failed")[0]["d"]
        assert failed["retryable"] is True and "bridge_offline" in failed["err"]["msg"]
        assert runtime.active == {}

    clock.run(with_board("tb-bgone", body, settings={"bridge_grace_ms": _GRACE_MS}))


def test_a_bridge_back_within_the_grace_keeps_the_call():
    # What a broker restart looks like: the bridge's will, then the same bridge again.
    clock = Clock()

    async def body(bridge, runtime):
        bridge.answer_rpc = False
        bridge.send("req", {"req": "blip1", "input": "x"})
        await bridge.wait_for(lambda: len(bridge.calls) == 1)
        await bridge.put_status("offline")
        await bridge.wait_for(lambda: _bridge_heard(runtime, False))
        await bridge.put_status("online")
        await bridge.wait_for(lambda: _bridge_heard(runtime, True))
        # Past the grace: the board has looked at the bridge's presence again (advance
        # returns once the grace's timer has run) and found it back.
        await clock.advance(_GRACE_MS)
        bridge.answer_rpc = True
        bridge.answer(bridge.calls[0])
        await bridge.wait_for(lambda: bridge.ended() or bridge.ended("run.failed"))
        assert bridge.ended() and not bridge.ended("run.failed")

    clock.run(with_board("tb-blip", body, settings={"bridge_grace_ms": _GRACE_MS}))


def test_a_new_bridge_process_fails_calls_made_to_the_old_one_and_reads_the_retained_hello():
    async def body(bridge, runtime):
        bridge.answer_rpc = False
        bridge.send("req", {"req": "newb1", "input": "x"})
        await bridge.wait_for(lambda: len(bridge.calls) == 1)
        hellos = len(bridge.hellos)
        await bridge.put_status("online", boot="b2")
        await bridge.wait_for(lambda: bridge.ended("run.failed"), 3000)
        failed = bridge.ended("run.failed")[0]["d"]
        assert failed["retryable"] is True and "bridge_restarted" in failed["err"]["msg"]
        # The new bridge reads the board's hello retained at the broker: the board does
        # not build it again (a run starting just then would share the heap with it).
        assert len(bridge.hellos) == hellos

    run(with_board("tb-newb", body))


def test_a_ctl_for_a_run_of_an_earlier_boot_is_ignored_not_refused():
    async def body(bridge, runtime):
        bridge.send("ctl", {"op": "cancel", "r": "deadbeef.1", "reason": "the device went offline"})
        bridge.send("ctl", {"op": "cancel", "r": "nosuchrun"})  # no boot in it: refused
        await bridge.wait_for(lambda: device_errors(bridge))
        assert [d["kind"] for d in device_errors(bridge)] == ["unknown_run"]
        assert runtime.stats["stale_ctl"] == 1

    run(with_board("tb-stale", body))


def test_a_request_over_the_receive_buffer_is_refused_and_the_board_serves_on():
    async def body(bridge, runtime):
        bridge.send("req", codec.encode({"req": "huge", "input": "x" * 5000}))
        await bridge.wait_for(lambda: device_errors(bridge))
        err = device_errors(bridge)[0]
        assert err["kind"] == "too_large" and str(RX_PAYLOAD) in err["msg"]
        bridge.send("req", {"req": "after-huge", "input": "still there?"})
        await bridge.wait_for(lambda: bridge.ended())
        assert runtime.link.stats["reconnects"] == 0 and runtime.link.stats["oversized"] == 1

    run(with_board("tb-huge", body))


def test_a_run_faster_than_its_link_waits_for_room_and_loses_nothing():
    # A handler that reports 60 events as fast as it can: the outbox holds 16, so the
    # run waits for room again and again, and every event arrives once, in order.
    async def handler(run_):
        for n in range(60):
            await run_.event("output", {"name": "n", "value": n, "status": "building"})
        return {}

    agent = Agent("counter", "1.0", "", handler=handler)

    async def body(bridge, runtime):
        bridge.send("req", {"req": "fast1", "input": "go"})
        await bridge.wait_for(lambda: bridge.ended(), 20000)
        outs = [e["d"]["value"] for e in _run_events(bridge, "output")]
        assert outs == list(range(60))
        assert runtime.stats["stalled"] == 0

    run(with_board("tb-fast", body, agent=agent))


def test_a_run_that_cannot_send_fails_after_stall_ms_and_its_end_arrives_later():
    gate = platform.asyncio.Event()
    clock = Clock()

    async def handler(run_):
        await gate.wait()  # until the test has taken the link away
        for n in range(60):
            await run_.event("output", {"name": "n", "value": n, "status": "building"})
        return {}

    agent = Agent("counter", "1.0", "", handler=handler)

    async def body(bridge, runtime):
        bridge.send("req", {"req": "stall1", "input": "go"})
        await bridge.wait_for(lambda: _run_events(bridge))
        link = runtime.link
        port = link.port
        link.port = 1  # nothing listens there: the link stays down
        link.reconnect("test takes the link away")
        gate.set()
        # The run fills the outbox (all but the slots kept spare for calls and acks) and
        # then waits for room: from then on stall_ms passes on the board's clock.
        await bridge.wait_for(lambda: not link.room(4))
        await clock.advance(_STALL_MS)
        await bridge.wait_for(lambda: runtime.stats["stalled"] and not runtime.active)
        link.port = port  # back: what waited in the outbox and the ring goes out
        await bridge.wait_for(lambda: bridge.ended("run.failed"), 15000)
        events = _run_events(bridge)
        assert [e["i"] for e in events] == list(range(1, len(events) + 1))
        failed = events[-1]
        assert failed["t"] == "run.failed" and failed["d"]["err"]["kind"] == "link"
        assert failed["d"]["retryable"] is True

    clock.run(with_board("tb-stall", body, agent=agent, settings={"stall_ms": _STALL_MS}))
