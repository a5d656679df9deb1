# The board runtime over a real broker, on both runtimes: a Runtime wired to a real Link,
# and a second Link playing the bridge from a script (it answers llm.complete, collects
# events and sends ctl). Nothing of the runtime is replaced.
import json

from edge_runtime import codec
from edge_runtime import platform
from edge_runtime.agent import Agent
from edge_runtime.events import MAX_ID, MAX_REASON
from edge_runtime.runs import Runtime
from firmware_tests.scripted_bridge import P, device_errors, make_agent, with_board
from firmware_tests.support import run


def _types(events):
    return [e["t"] for e in events]


def test_one_request_runs_the_tool_loop_to_done():
    async def body(bridge, runtime):
        bridge.send("req", {"req": "q1", "conv": "c1", "usr": "u1", "input": "How warm is it?"})
        await bridge.wait_for(lambda: any(e["t"] == "run.done" for e in bridge.events))
        run_id = bridge.events[0]["r"]
        events = bridge.of_run(run_id)
        assert [e["i"] for e in events] == list(range(1, len(events) + 1))
        # The first turn's first text goes at once; its next two chunks are coalesced
        # into one msg.delta.
        assert _types(events) == [
            "run.started",
            "node.start", "msg.start", "msg.delta", "msg.delta", "msg.end", "usage", "node.end",
            "node.start", "tool.call", "tool.result", "node.end",
            "node.start", "msg.start", "msg.delta", "msg.end", "usage", "node.end",
            "run.done"]
        # Each model step's first events go together, one payload right behind its
        # call, and so do its last; a tool's node.start with its tool.call, its
        # tool.result with its node.end; every other event as it comes.
        assert bridge.evt_payloads == [
            ["run.started", "node.start", "msg.start"], ["msg.delta"], ["msg.delta"],
            ["msg.end", "usage", "node.end"], ["node.start", "tool.call"],
            ["tool.result", "node.end"], ["node.start", "msg.start"], ["msg.delta"],
            ["msg.end", "usage", "node.end"], ["run.done"]]
        started = events[0]["d"]
        assert started["req"] == "q1" and started["input"] == "How warm is it?"
        assert started["domain"] == "request" and started["agent"] == "thermostat"
        # The req's user: the bridge sends the run's events to that user's host topic.
        assert started["usr"] == "u1"
        assert events[3]["d"] == {"m": 1, "text": "Let"}
        assert events[4]["d"] == {"m": 1, "text": " me check."}
        assert events[9]["d"] == {"call": "c1", "name": "read_temperature", "input": "{}", "client": False}
        assert events[10]["d"] == {"call": "c1", "output": "21.5", "failed": False}
        assert events[-1]["d"]["usage"] == {"in": 20, "out": 10, "reason": 0}
        # The model loop's nodes: each model step and each tool, with its activation and
        # the model step as its iteration; a model step says which way it went on.
        nodes = [(e["t"], e["n"], e["a"], e["k"], e["d"]) for e in events if "n" in e]
        assert nodes == [
            ("node.start", "/model", 1, 1, {"kind": "model"}),
            ("usage", "/model", 1, 1, {"in": 10, "out": 5, "reason": 0}),
            ("node.end", "/model", 1, 1, {"status": "completed", "port": "tools"}),
            ("node.start", "/tool/read_temperature", 1, 1, {"kind": "tool"}),
            ("node.end", "/tool/read_temperature", 1, 1, {"status": "completed"}),
            ("node.start", "/model", 2, 2, {"kind": "model"}),
            ("usage", "/model", 2, 2, {"in": 10, "out": 5, "reason": 0}),
            ("node.end", "/model", 2, 2, {"status": "completed", "port": "done"})]
        # Events of the run as a whole carry no node.
        assert not [e for e in events if e["t"] in ("run.started", "msg.delta", "run.done")
                    and "n" in e]
        # The second model call carried the tool result back in the conversation.
        second = bridge.calls[1]["a"]["messages"]
        assert second[-1] == {"role": "tool", "call": "c1", "content": "21.5"}
        assert second[-2]["tools"][0]["name"] == "read_temperature"
        # MicroPython dicts keep no insertion order, so the tools are compared as a set.
        assert sorted(t["name"] for t in bridge.hello["tools"]) == ["explode", "read_temperature"]
        # Hello says what the board can receive and its boot, which run ids begin with.
        limits = bridge.hello["limits"]
        assert limits["payload"] == 4608 and limits["str"] == 4096
        assert limits["window"] == 4 and limits["chunk"] == 256
        assert run_id.split(".")[0] == bridge.hello["boot"] == runtime.boot

    run(with_board("tb-loop", body))


def test_failing_tool_is_reported_to_the_model_and_the_run_goes_on():
    script = [[{"tool": {"call": "c9", "name": "explode", "input": "{}"}}], [{"text": "Sorry."}]]

    async def body(bridge, runtime):
        bridge.send("req", {"req": "q2", "input": "boom"})
        await bridge.wait_for(lambda: any(e["t"] == "run.done" for e in bridge.events))
        result = [e for e in bridge.events if e["t"] == "tool.result"][0]["d"]
        assert result["failed"] is True and "sensor unplugged" in result["output"]

    run(with_board("tb-toolfail", body, script))


def test_model_error_fails_the_run_retryable_with_a_safe_message():
    async def body(bridge, runtime):
        bridge.send("req", {"req": "q3", "input": "hi"})
        await bridge.wait_for(lambda: any(e["t"] == "run.failed" for e in bridge.events))
        failed = [e for e in bridge.events if e["t"] == "run.failed"][0]["d"]
        assert failed["err"]["kind"] == "llm" and failed["retryable"] is True

    run(with_board("tb-llmerr", body, script=[]))


def test_repeated_request_id_starts_nothing_new():
    async def body(bridge, runtime):
        bridge.send("req", {"req": "same", "input": "one"})
        await bridge.wait_for(lambda: any(e["t"] == "run.done" for e in bridge.events))
        bridge.send("req", {"req": "same", "input": "one"})
        bridge.send("req", {"req": "other", "input": "two"})
        await bridge.wait_for(lambda: len([e for e in bridge.events if e["t"] == "run.done"]) == 2)
        started = [e["d"]["req"] for e in bridge.events if e["t"] == "run.started"]
        assert started == ["same", "other"]
        assert runtime.stats["duplicate"] == 1

    run(with_board("tb-idem", body))


def test_bad_input_is_refused_by_name_and_the_board_keeps_serving():
    deep = b"\x91" * 40 + b"\xc0"
    bad = [
        ("req", b"\x85\xa3req", "truncated"),
        ("req", b"\xdb\xff\xff\xff\xff" + b"x" * 8, "too_large"),
        ("req", deep, "too_deep"),
        ("req", codec.encode([1, 2, 3]), "bad_envelope"),
        ("req", codec.encode({"req": 5, "input": "x"}), "bad_envelope"),
        ("ctl", codec.encode({"op": "explode", "r": "x"}), "unknown_op"),
        ("ctl", codec.encode({"op": "tool", "r": "x", "call": "c1", "output": "1"}), "not_waiting"),
        ("ctl", b"\xc1", "bad_type"),
    ]

    async def body(bridge, runtime):
        for leaf, payload, _ in bad:
            bridge.send(leaf, payload)
        await bridge.wait_for(lambda: len(device_errors(bridge)) == len(bad))
        kinds = [d["kind"] for d in device_errors(bridge)]
        assert kinds == [k for _, _, k in bad]
        ids = [e["i"] for e in bridge.of_run("_")]
        assert ids == list(range(1, len(bad) + 1))
        # and a valid request after all of that still runs to the end
        bridge.send("req", {"req": "after-bad", "input": "still there?"})
        await bridge.wait_for(lambda: any(e["t"] == "run.done" for e in bridge.events))

    run(with_board("tb-bad", body))


def test_a_req_that_cannot_be_decoded_is_refused_by_its_id():
    # The id is read from the payload's first bytes (the bridge writes `req` first):
    # a fixstr id and a str 8 one, each followed by something the decoder refuses; an
    # id past MAX_ID, or `req` not first, leaves the refusal without one.
    # Built key by key: MicroPython's dicts do not keep insertion order, so an encoded
    # dict could not say which key comes first. A map of three entries whose third
    # value is a reserved byte.
    def broken(*keys_values):
        parts = [b"\x83"] + [codec.encode(x) for x in keys_values]
        return b"".join(parts) + b"\xa1z\xc1"

    long_id = "r" * 40
    bad = [broken("req", "short-id", "input", "x"), broken("req", long_id, "input", "x"),
           broken("req", "r" * 65, "input", "x"), broken("input", "x", "req", "late")]

    async def body(bridge, runtime):
        for payload in bad:
            bridge.send("req", payload)
        await bridge.wait_for(lambda: len(device_errors(bridge)) == len(bad))
        errors = device_errors(bridge)
        assert [d["kind"] for d in errors] == ["bad_type"] * 4
        assert [d.get("req") for d in errors] == ["short-id", long_id, None, None]

    run(with_board("tb-named", body))


async def _fill_until_busy(bridge, prefix):
    # The model never answers, so the first run holds the only slot, two requests fill
    # the queue and the fourth is refused busy; returns that refusal.
    bridge.answer_rpc = False
    for n in range(4):
        bridge.send("req", {"req": "%s%d" % (prefix, n), "input": "x"})
    await bridge.wait_for(lambda: len(device_errors(bridge)) == 1)
    return device_errors(bridge)[0]


def test_requests_beyond_concurrency_and_queue_are_refused_busy():
    async def body(bridge, runtime):
        err = await _fill_until_busy(bridge, "b")
        assert err["kind"] == "busy" and err["req"] == "b3"
        assert len(runtime.active) == 1 and len(runtime._queue) == 2
        # Cancelling the running one admits the next from the queue. (Its run.started
        # follows its model call, so it may come after the refusal.)
        await bridge.wait_for(lambda: any(e["t"] == "run.started" for e in bridge.events))
        run_id = [e for e in bridge.events if e["t"] == "run.started"][0]["r"]
        bridge.send("ctl", {"op": "cancel", "r": run_id, "reason": "user stopped it"})
        await bridge.wait_for(lambda: any(e["t"] == "run.cancelled" for e in bridge.events))
        cancelled = [e for e in bridge.events if e["t"] == "run.cancelled"][0]
        assert cancelled["d"]["reason"] == "user stopped it" and cancelled["r"] == run_id
        await bridge.wait_for(lambda: len([e for e in bridge.events if e["t"] == "run.started"]) == 2)

    run(with_board("tb-busy", body))


def test_replay_resends_what_the_ring_holds_and_reports_the_rest_as_a_gap():
    async def body(bridge, runtime):
        bridge.send("req", {"req": "r1", "input": "x"})
        await bridge.wait_for(lambda: any(e["t"] == "run.done" for e in bridge.events))
        run_id = bridge.events[0]["r"]
        total = len(bridge.of_run(run_id))
        bridge.events = []
        # The ring holds 4 events: asking from 0 resends the last 4 and names the rest lost.
        bridge.send("ctl", {"op": "replay", "r": run_id, "after": 0})
        await bridge.wait_for(lambda: any(e["t"] == "error" for e in bridge.events))
        got = bridge.of_run(run_id)
        assert [e["i"] for e in got[:4]] == list(range(total - 3, total + 1))
        gap = got[-1]
        assert gap["t"] == "error" and gap["i"] == total + 1
        assert gap["d"]["kind"] == "gap" and gap["d"]["from"] == 1 and gap["d"]["to"] == total - 4
        # A run it no longer holds: refused, naming the run (the bridge stops asking).
        gone = "%s.99" % runtime.boot  # this boot's: another boot's is ignored, not refused
        bridge.send("ctl", {"op": "replay", "r": gone, "after": 0})
        bridge.send("ctl", {"op": "replay", "r": "x" * (MAX_ID + 1), "after": 0})
        await bridge.wait_for(lambda: len(device_errors(bridge)) == 2)
        named, unnamed = device_errors(bridge)
        assert named["kind"] == "unknown_run" and named["r"] == gone
        assert unnamed["kind"] == "unknown_run" and "r" not in unnamed  # not an id: not echoed

    run(with_board("tb-replay", body, settings={"ring": 4}))


def test_plain_async_handler_needs_no_model():
    async def handler(run_):
        run_.emit("output", {"name": "echo", "value": run_.input.upper(), "status": "final"})
        return {"in": 0, "out": 0, "reason": 0}

    agent = Agent("echo", "1.0", "", handler=handler)

    async def body(bridge, runtime):
        bridge.send("req", {"req": "e1", "input": "shout"})
        await bridge.wait_for(lambda: any(e["t"] == "run.done" for e in bridge.events))
        out = [e for e in bridge.events if e["t"] == "output"][0]["d"]
        assert out["value"] == "SHOUT"
        assert bridge.calls == []

    run(with_board("tb-plain", body, agent=agent))


def test_tool_input_must_be_a_json_object():
    script = [[{"tool": {"call": "c1", "name": "read_temperature", "input": "[1,2]"}}], [{"text": "ok"}]]

    async def body(bridge, runtime):
        bridge.send("req", {"req": "j1", "input": "x"})
        await bridge.wait_for(lambda: any(e["t"] == "run.done" for e in bridge.events))
        result = [e for e in bridge.events if e["t"] == "tool.result"][0]["d"]
        assert result["failed"] is True
        assert json.loads('"%s"' % result["output"]) == "arguments must be a JSON object"

    run(with_board("tb-json", body, script))


def test_ids_past_the_bound_are_refused_and_echoes_are_clipped():
    # MAX_ID is the contract's one id bound (the bridge and its tokens import it too):
    # at the bound a request runs; one past it, in req or usr, is refused.
    async def body(bridge, runtime):
        bridge.send("req", {"req": "q" * (MAX_ID + 1), "input": "x"})
        bridge.send("req", {"req": "u1", "usr": "u" * (MAX_ID + 1), "input": "x"})
        bridge.send("ctl", {"op": "cancel", "r": "r" * 1000})
        await bridge.wait_for(lambda: len(device_errors(bridge)) == 3)
        first, second, third = device_errors(bridge)
        assert first["kind"] == "bad_envelope" and second["kind"] == "bad_envelope"
        assert second["req"] == "u1" and third["kind"] == "unknown_run"
        # The refusal names the run, but never echoes 1000 characters back.
        assert len(third["msg"]) < 100 and "rrr" in third["msg"]
        bridge.send("req", {"req": "q" * MAX_ID, "conv": "c" * MAX_ID, "usr": "u" * MAX_ID,
                            "input": "x"})
        await bridge.wait_for(lambda: any(e["t"] == "run.done" for e in bridge.events))
        started = [e for e in bridge.events if e["t"] == "run.started"]
        assert len(started) == 1 and started[0]["d"]["req"] == "q" * MAX_ID

    run(with_board("tb-ids", body))


def test_a_cancel_reason_is_cut_to_the_contracts_bound():
    async def body(bridge, runtime):
        bridge.answer_rpc = False  # the run waits on the model until it is cancelled
        bridge.send("req", {"req": "long-reason", "input": "x"})
        await bridge.wait_for(lambda: any(e["t"] == "run.started" for e in bridge.events))
        run_id = [e for e in bridge.events if e["t"] == "run.started"][0]["r"]
        bridge.send("ctl", {"op": "cancel", "r": run_id, "reason": "z" * (MAX_REASON + 50)})
        await bridge.wait_for(lambda: any(e["t"] == "run.cancelled" for e in bridge.events))
        cancelled = [e for e in bridge.events if e["t"] == "run.cancelled"][0]
        assert cancelled["d"]["reason"] == "z" * MAX_REASON

    run(with_board("tb-reason", body))


def test_a_request_refused_busy_can_be_sent_again_later():
    async def body(bridge, runtime):
        assert (await _fill_until_busy(bridge, "again"))["req"] == "again3"
        bridge.answer_rpc = True
        for call in bridge.calls:
            bridge.answer(call)
        await bridge.wait_for(lambda: len([e for e in bridge.events if e["t"] == "run.done"]) == 3)
        bridge.send("req", {"req": "again3", "input": "x"})
        await bridge.wait_for(lambda: len([e for e in bridge.events if e["t"] == "run.done"]) == 4)
        assert runtime.stats["duplicate"] == 0

    run(with_board("tb-retry", body))


def test_a_tool_call_announced_but_never_received_fails_the_run():
    # finish says tool_calls, but no tool chunk came: "done" would be a false answer.
    async def body(bridge, runtime):
        bridge.send("req", {"req": "lost", "input": "x"})
        await bridge.wait_for(lambda: any(e["t"] == "run.failed" for e in bridge.events))
        failed = [e for e in bridge.events if e["t"] == "run.failed"][0]["d"]
        assert failed["err"]["kind"] == "llm" and failed["retryable"] is True

    run(with_board("tb-lost", body, script=[[{"finish": "tool_calls"}]]))


def test_a_call_too_large_to_send_fails_at_once():
    # With a 600-byte payload limit the first llm.complete (instructions + input) cannot
    # be encoded; the run fails without waiting for the call's timeout.
    async def body(bridge, runtime):
        bridge.send("req", {"req": "big", "input": "y" * 400})
        await bridge.wait_for(lambda: any(e["t"] == "run.failed" for e in bridge.events), 5000)
        assert bridge.calls == []
        assert runtime.active == {}

    run(with_board("tb-big", body, settings={"max_send": 600}))


def test_cancel_before_the_run_begins_still_frees_its_slot():
    # No link here: the runtime keeps its events in the run's ring all the same.
    async def body():
        runtime = Runtime(make_agent(), "tb-local", {})
        base = P + "tb-local/"
        runtime.on_message(base + "req", codec.encode({"req": "early", "input": "x"}))
        run_id = list(runtime.active)[0]
        # The run's task has not had a turn yet when its cancel arrives.
        runtime.on_message(base + "ctl", codec.encode({"op": "cancel", "r": run_id, "reason": "early"}))
        for _ in range(100):
            if not runtime.active:
                break
            await platform.sleep_ms(10)
        assert runtime.active == {}
        em = list(runtime.recent)[-1]
        got = [codec.decode(bytes(em.held(k))) for k in range(len(em.ring))]
        assert [e["t"] for e in got] == ["run.started", "run.cancelled"]
        assert got[1]["d"]["reason"] == "early"

    run(body())


def test_a_model_call_short_of_memory_waits_for_the_link_to_let_go_and_goes():
    # The allocator failing for the call's encoding even after a collection (a board's
    # fragmented heap) is stood in for at the runtime's publish: the second model call,
    # made right behind the first turn's events, finds no block once. The call then
    # waits until the broker has acknowledged what the link holds, and goes.
    async def body(bridge, runtime):
        publish = runtime.rpc._publish
        seen = []

        def short_once(topic, msg, qos):
            if msg.get("m") == "llm.complete":
                seen.append(runtime.link.pending)
                if len(seen) == 2:
                    raise MemoryError("no block for the encoding")
            return publish(topic, msg, qos)

        runtime.rpc._publish = short_once
        bridge.send("req", {"req": "q-short", "input": "How warm is it?"})
        await bridge.wait_for(lambda: any(e["t"] in ("run.done", "run.failed") for e in bridge.events))
        assert [e["t"] for e in bridge.events if e["t"].startswith("run.")] == ["run.started", "run.done"]
        # Tried again once, when the link held nothing unacknowledged.
        assert len(bridge.calls) == 2 and len(seen) == 3 and seen[2] == 0

    run(with_board("tb-short", body))


def test_a_board_done_with_its_runs_collects_once_its_last_events_are_acknowledged():
    # MicroPython collects after every threshold's worth of allocation: garbage left
    # from reading a finished run's acks counted towards the next request, and that
    # collection fell on its way to the model call. So once the last run's events are
    # acknowledged and no run is active, the board collects. (platform.collect is the
    # real one, called through; only its calls are noted.)
    async def body(bridge, runtime):
        collect = platform.collect
        seen = []

        def noting():
            seen.append((len(runtime.active), runtime.link.pending))
            collect()

        platform.collect = noting
        try:
            bridge.send("req", {"req": "q-idle", "input": "How warm is it?"})
            await bridge.wait_for(lambda: any(e["t"] == "run.done" for e in bridge.events))
            await bridge.wait_for(lambda: seen and seen[-1] == (0, 0))
        finally:
            platform.collect = collect
        # The run's end collected while its last events were still in flight; the
        # collection after them, with nothing active and nothing unacknowledged, came
        # once, last.
        assert seen.count((0, 0)) == 1 and seen[-1] == (0, 0), seen
        assert any(active == 0 and pending > 0 for active, pending in seen), seen

    run(with_board("tb-idle", body))


def test_four_runs_in_a_row_out_of_memory_make_an_idle_board_reset():
    # A heap with bytes free in plenty but no block a run needs (fragmented) fails each
    # run out of memory, and looks healthy to a count of free bytes. Stood in for at the
    # runtime's publish: while `short` says so, each model call finds no block, even
    # after the wait for the link and a collection. Three such runs, one done, three
    # more: no reset (a done run says the heap still serves); the fourth in a row, once
    # the board is idle, stops the link for a reset, with why (board.py resets).
    async def body(bridge, runtime):
        publish = runtime.rpc._publish
        short = [True]

        def no_block(topic, msg, qos):
            if short[0] and msg.get("m") == "llm.complete":
                raise MemoryError("no block for the encoding")
            return publish(topic, msg, qos)

        runtime.rpc._publish = no_block
        ends = []

        async def ask(n):
            bridge.events.clear()
            bridge.send("req", {"req": "q-hole-%d" % n, "input": "How warm is it?"})
            await bridge.wait_for(lambda: any(e["t"] in ("run.done", "run.failed")
                                              for e in bridge.events))
            ends.append([e["t"] for e in bridge.events if e["t"] in ("run.done", "run.failed")][0])
            await bridge.wait_for(lambda: not runtime.active and not runtime.link.pending)

        for n in range(3):
            await ask(n)
        short[0] = False
        await ask(3)
        short[0] = True
        for n in range(4, 7):
            await ask(n)
        assert ends == ["run.failed"] * 3 + ["run.done"] + ["run.failed"] * 3, ends
        assert runtime.stats["no_memory"] == 3 and runtime.reset is None
        assert runtime.link.connected
        await ask(7)
        await bridge.wait_for(lambda: runtime.reset is not None)
        assert runtime.reset == "4 requests in a row ran out of memory"
        await bridge.wait_for(lambda: not runtime.link.connected)

    run(with_board("tb-holes", body))


def test_a_run_started_that_found_no_heap_still_goes_ahead_of_the_failure():
    # run.started names the request; the run's end does not. A run whose run.started
    # found no heap to encode (a long request's echo, 666 bytes, in a suite run) failed
    # without it, and its host waited out its timeout. Stood in for at the runtime's
    # encoder: run.started's first encoding finds no block.
    async def body(bridge, runtime):
        encode = runtime.encode
        short = [True]

        def no_block_once(msg):
            if short[0] and msg.get("t") == "run.started":
                short[0] = False
                raise MemoryError("no block for run.started")
            return encode(msg)

        runtime.encode = no_block_once
        bridge.send("req", {"req": "q-nostart", "input": "How warm is it?"})
        await bridge.wait_for(lambda: any(e["t"] == "run.failed" for e in bridge.events))
        events = [e for e in bridge.events if e["r"] != "_"]
        assert [e["t"] for e in events] == ["run.started", "run.failed"], events
        assert events[0]["d"]["req"] == "q-nostart" and [e["i"] for e in events] == [1, 2]
        assert events[1]["d"]["err"]["kind"] == "internal" and events[1]["d"]["retryable"]

    run(with_board("tb-nostart", body))


def test_a_request_cancelled_before_its_run_started_never_runs():
    # A host that gives up before its request's run started knows no run id: it cancels
    # by request. Queued: taken out of the queue. Not come yet: remembered, so that it
    # starts nothing when it comes. Running: cancelled as by its run. Each ends by its
    # id at once (the host stops waiting); one that ran already is no run to cancel.
    async def body(bridge, runtime):
        await _fill_until_busy(bridge, "c")  # c0 runs (its model never answers), c1 c2 wait
        bridge.send("ctl", {"op": "cancel", "req": "c2", "reason": "gave up"})
        bridge.send("ctl", {"op": "cancel", "req": "c9"})  # not come yet
        await bridge.wait_for(lambda: len(device_errors(bridge)) == 3)
        assert [(e["kind"], e["req"]) for e in device_errors(bridge)[1:]] == [
            ("cancelled", "c2"), ("cancelled", "c9")]
        assert [m["req"] for m in runtime._queue] == ["c1"]
        bridge.send("req", {"req": "c9", "input": "x"})  # comes after all: starts nothing
        bridge.send("ctl", {"op": "cancel", "req": "c0"})  # running: cancelled as a run
        await bridge.wait_for(lambda: any(e["t"] == "run.cancelled" for e in bridge.events))
        c0 = [e for e in bridge.events if e["t"] == "run.started" and e["d"]["req"] == "c0"]
        assert [e["r"] for e in bridge.events if e["t"] == "run.cancelled"] == [c0[0]["r"]]
        # c1 goes next, and only c1: neither c2 nor c9 ever starts.
        await bridge.wait_for(lambda: len(runtime.active) == 1 and not runtime._queue)
        bridge.send("ctl", {"op": "cancel", "req": "c0"})  # its run is over
        await bridge.wait_for(lambda: len(device_errors(bridge)) == 4)
        assert (device_errors(bridge)[3]["kind"], device_errors(bridge)[3]["req"]) == (
            "unknown_run", "c0")
        started = [e["d"]["req"] for e in bridge.events if e["t"] == "run.started"]
        assert "c2" not in started and "c9" not in started and runtime.stats["duplicate"] == 1

    run(with_board("tb-cancelreq", body))
