# The board runtime over a real broker, on both runtimes: a Runtime wired to a real Link,
# and a second Link playing the bridge from a script (it answers llm.complete, collects
# events and sends ctl). Nothing of the runtime is replaced.
import json

from edge_runtime import codec
from edge_runtime import platform
from edge_runtime.agent import Agent
from edge_runtime.link import Link
from edge_runtime.runs import Runtime
from firmware_tests.support import broker_address, run

P = "wren/v1/d/"


def _agent():
    agent = Agent("thermostat", "0.1.0", "You watch a room.")

    @agent.tool("read_temperature", "Read the room in C")
    def read_temperature(args):
        return 21.5

    @agent.tool("explode", "Always fails")
    def explode(args):
        raise ValueError("sensor unplugged")

    return agent


# Turn n of the scripted model is chosen by how many assistant messages it was sent.
SCRIPT = [
    [{"text": "Let me "}, {"text": "check."}, {"tool": {"call": "c1", "name": "read_temperature", "input": "{}"}}],
    [{"text": "It is 21.5 C."}],
]


class ScriptedBridge:
    # Plays the bridge's side of the contract: numbered chunks, never more than the
    # board's window past its acks, the final answer counting the chunks.
    def __init__(self, device, script, answer_rpc=True):
        host, port = broker_address()
        self.base = P + device + "/"
        self.script = script
        self.answer_rpc = answer_rpc
        self.events = []
        self.calls = []
        self.acks = {}  # call id -> the highest chunk the board acknowledged
        self.sent = {}  # call id -> chunks sent
        self.link = Link("bridge-" + device, host, port, on_message=self.on_message,
                         rx_size=4096, outbox_size=32, max_packet=40000)
        self.link.subscribe(self.base + "evt", 1)
        self.link.subscribe(self.base + "rpc", 1)
        self.link.subscribe(self.base + "hello", 1)
        self.hellos = []

    @property
    def hello(self):
        return self.hellos[-1] if self.hellos else None

    def on_message(self, topic, payload):
        msg = codec.decode(payload)
        if topic.endswith("/evt"):
            self.events.extend(msg if isinstance(msg, list) else [msg])
        elif topic.endswith("/hello"):
            self.hellos.append(msg)
        elif topic.endswith("/rpc"):
            if "ack" in msg and "m" not in msg:
                self.acks[msg["c"]] = max(self.acks.get(msg["c"], 0), msg["ack"])
                return
            self.calls.append(msg)
            if self.answer_rpc:
                self.answer(msg)

    def answer(self, call):
        platform.asyncio.create_task(self._answer(call))

    async def _answer(self, call):
        turn = sum(1 for m in call["a"]["messages"] if m["role"] == "assistant")
        c = call["c"]
        if turn >= len(self.script):
            await self.put("rpc/res", {"c": c, "s": 0, "err": {"kind": "llm", "msg": "script exhausted"}})
            return
        finish = "tool_calls" if any("tool" in s for s in self.script[turn]) else "stop"
        window = self.hello["limits"]["window"]
        n = 0
        for step in self.script[turn]:
            if "finish" in step:  # a step that only sets the final answer's finish
                finish = step["finish"]
                continue
            n += 1
            await self.wait_for(lambda: n - self.acks.get(c, 0) <= window)
            await self.put("rpc/res", {"c": c, "s": n, "ch": step})
            self.sent[c] = n
        await self.put("rpc/res", {"c": c, "s": n, "ok": {"usage": {"in": 10, "out": 5, "reason": 0},
                                                         "finish": finish}})

    async def put_status(self, st):
        assert self.link.publish("wren/v1/b/status", codec.encode({"st": st, "id": "test"}), 1, True)
        await self.wait_for(lambda: self.link.pending == 0)

    async def put(self, leaf, msg_or_bytes):
        # Waits for room in the outbox: a long script is more than it holds.
        assert await self.link.wait_room(10000), "the scripted bridge's outbox stayed full"
        self.send(leaf, msg_or_bytes)

    def send(self, leaf, msg_or_bytes):
        data = msg_or_bytes if isinstance(msg_or_bytes, bytes) else codec.encode(msg_or_bytes)
        assert self.link.publish(self.base + leaf, data, 1), "the scripted bridge's outbox is full"

    def of_run(self, run_id):
        # By id, each once: a resend after a reconnect may deliver an event twice.
        seen = {}
        for e in self.events:
            if e["r"] == run_id:
                seen[e["i"]] = e
        return [seen[i] for i in sorted(seen)]

    def ended(self, t="run.done"):
        return [e for e in self.events if e["t"] == t]

    async def wait_for(self, pred, ms=10000):
        waited = 0
        while not pred():
            if waited >= ms:
                raise AssertionError("timed out; events: %r" % (self.events[-20:],))
            await platform.sleep_ms(20)
            waited += 20


async def _with_board(device, body, script=SCRIPT, settings=None, agent=None):
    host, port = broker_address()
    bridge = ScriptedBridge(device, script)
    runtime = Runtime(agent or _agent(), device, settings or {})
    # Wired as board.py wires a board: the runtime's receive buffer, callbacks, last will
    # and persistent session.
    link = Link(device, host, port, backoff_ms=(50, 200), **runtime.link_settings())
    runtime.attach(link)
    tasks = [platform.asyncio.create_task(bridge.link.run())]
    try:
        assert await bridge.link.wait_connected(5000)
        # Online, retained, as the real bridge says it: a board fails its calls at once
        # while the bridge's presence says offline (and a test bridge of another module
        # may have left that behind on the shared broker).
        await bridge.put_status("online")
        tasks.append(platform.asyncio.create_task(link.run()))
        assert await link.wait_connected(5000)
        await bridge.wait_for(lambda: bridge.hello is not None)
        await body(bridge, runtime)
    finally:
        link.stop()
        bridge.link.stop()
        for t in tasks:
            try:
                await platform.wait_for_ms(t, 3000)
            except Exception:
                t.cancel()
        # The board's session is persistent: leave none behind on the shared broker.
        clean = Link(device, host, port, clean_session=True)
        t = platform.asyncio.create_task(clean.run())
        await clean.wait_connected(5000)
        clean.stop()
        await platform.wait_for_ms(t, 3000)


def _types(events):
    return [e["t"] for e in events]


def test_one_request_runs_the_tool_loop_to_done():
    async def body(bridge, runtime):
        bridge.send("req", {"req": "q1", "conv": "c1", "usr": "u1", "input": "How warm is it?"})
        await bridge.wait_for(lambda: any(e["t"] == "run.done" for e in bridge.events))
        run_id = bridge.events[0]["r"]
        events = bridge.of_run(run_id)
        assert [e["i"] for e in events] == list(range(1, len(events) + 1))
        # The two text chunks of the first turn are coalesced into one msg.delta.
        assert _types(events) == ["run.started", "msg.start", "msg.delta", "msg.end",
                                  "tool.call", "tool.result", "msg.start", "msg.delta", "msg.end",
                                  "run.done"]
        started = events[0]["d"]
        assert started["req"] == "q1" and started["input"] == "How warm is it?"
        assert started["domain"] == "request" and started["agent"] == "thermostat"
        assert events[2]["d"] == {"m": 1, "text": "Let me check."}
        assert events[4]["d"] == {"call": "c1", "name": "read_temperature", "input": "{}", "client": False}
        assert events[5]["d"] == {"call": "c1", "output": "21.5", "failed": False}
        assert events[-1]["d"]["usage"] == {"in": 20, "out": 10, "reason": 0}
        # The second model call carried the tool result back in the conversation.
        second = bridge.calls[1]["a"]["messages"]
        assert second[-1] == {"role": "tool", "call": "c1", "content": "21.5"}
        assert second[-2]["tools"][0]["name"] == "read_temperature"
        # MicroPython dicts keep no insertion order, so the tools are compared as a set.
        assert sorted(t["name"] for t in bridge.hello["tools"]) == ["explode", "read_temperature"]
        # Hello says what the board can receive and its boot, which run ids begin with.
        limits = bridge.hello["limits"]
        assert limits["payload"] == 4096 and limits["str"] == 4096
        assert limits["window"] == 4 and limits["chunk"] == 256
        assert run_id.split(".")[0] == bridge.hello["boot"] == runtime.boot

    run(_with_board("tb-loop", body))


def test_failing_tool_is_reported_to_the_model_and_the_run_goes_on():
    script = [[{"tool": {"call": "c9", "name": "explode", "input": "{}"}}], [{"text": "Sorry."}]]

    async def body(bridge, runtime):
        bridge.send("req", {"req": "q2", "input": "boom"})
        await bridge.wait_for(lambda: any(e["t"] == "run.done" for e in bridge.events))
        result = [e for e in bridge.events if e["t"] == "tool.result"][0]["d"]
        assert result["failed"] is True and "sensor unplugged" in result["output"]

    run(_with_board("tb-toolfail", body, script))


def test_model_error_fails_the_run_retryable_with_a_safe_message():
    async def body(bridge, runtime):
        bridge.send("req", {"req": "q3", "input": "hi"})
        await bridge.wait_for(lambda: any(e["t"] == "run.failed" for e in bridge.events))
        failed = [e for e in bridge.events if e["t"] == "run.failed"][0]["d"]
        assert failed["err"]["kind"] == "llm" and failed["retryable"] is True

    run(_with_board("tb-llmerr", body, script=[]))


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

    run(_with_board("tb-idem", body))


def _device_errors(bridge):
    return [e["d"] for e in bridge.of_run("_") if e["t"] == "error"]


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
        await bridge.wait_for(lambda: len(_device_errors(bridge)) == len(bad))
        kinds = [d["kind"] for d in _device_errors(bridge)]
        assert kinds == [k for _, _, k in bad]
        ids = [e["i"] for e in bridge.of_run("_")]
        assert ids == list(range(1, len(bad) + 1))
        # and a valid request after all of that still runs to the end
        bridge.send("req", {"req": "after-bad", "input": "still there?"})
        await bridge.wait_for(lambda: any(e["t"] == "run.done" for e in bridge.events))

    run(_with_board("tb-bad", body))


async def _fill_until_busy(bridge, prefix):
    # The model never answers, so the first run holds the only slot, two requests fill
    # the queue and the fourth is refused busy; returns that refusal.
    bridge.answer_rpc = False
    for n in range(4):
        bridge.send("req", {"req": "%s%d" % (prefix, n), "input": "x"})
    await bridge.wait_for(lambda: len(_device_errors(bridge)) == 1)
    return _device_errors(bridge)[0]


def test_requests_beyond_concurrency_and_queue_are_refused_busy():
    async def body(bridge, runtime):
        err = await _fill_until_busy(bridge, "b")
        assert err["kind"] == "busy" and err["req"] == "b3"
        assert len(runtime.active) == 1 and len(runtime._queue) == 2
        # Cancelling the running one admits the next from the queue.
        run_id = [e for e in bridge.events if e["t"] == "run.started"][0]["r"]
        bridge.send("ctl", {"op": "cancel", "r": run_id, "reason": "user stopped it"})
        await bridge.wait_for(lambda: any(e["t"] == "run.cancelled" for e in bridge.events))
        cancelled = [e for e in bridge.events if e["t"] == "run.cancelled"][0]
        assert cancelled["d"]["reason"] == "user stopped it" and cancelled["r"] == run_id
        await bridge.wait_for(lambda: len([e for e in bridge.events if e["t"] == "run.started"]) == 2)

    run(_with_board("tb-busy", body))


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

    run(_with_board("tb-replay", body, settings={"ring": 4}))


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

    run(_with_board("tb-plain", body, agent=agent))


def test_tool_input_must_be_a_json_object():
    script = [[{"tool": {"call": "c1", "name": "read_temperature", "input": "[1,2]"}}], [{"text": "ok"}]]

    async def body(bridge, runtime):
        bridge.send("req", {"req": "j1", "input": "x"})
        await bridge.wait_for(lambda: any(e["t"] == "run.done" for e in bridge.events))
        result = [e for e in bridge.events if e["t"] == "tool.result"][0]["d"]
        assert result["failed"] is True
        assert json.loads('"%s"' % result["output"]) == "arguments must be a JSON object"

    run(_with_board("tb-json", body, script))


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

    run(_with_board("tb-keep", body))


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

    run(_with_board("tb-drop", body))


def test_ids_over_64_chars_are_refused_and_echoes_are_clipped():
    async def body(bridge, runtime):
        bridge.send("req", {"req": "q" * 65, "input": "x"})
        bridge.send("ctl", {"op": "cancel", "r": "r" * 1000})
        await bridge.wait_for(lambda: len(_device_errors(bridge)) == 2)
        first, second = _device_errors(bridge)
        assert first["kind"] == "bad_envelope" and second["kind"] == "unknown_run"
        # The refusal names the run, but never echoes 1000 characters back.
        assert len(second["msg"]) < 100 and "rrr" in second["msg"]

    run(_with_board("tb-ids", body))


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

    run(_with_board("tb-retry", body))


def test_a_tool_call_announced_but_never_received_fails_the_run():
    # finish says tool_calls, but no tool chunk came: "done" would be a false answer.
    async def body(bridge, runtime):
        bridge.send("req", {"req": "lost", "input": "x"})
        await bridge.wait_for(lambda: any(e["t"] == "run.failed" for e in bridge.events))
        failed = [e for e in bridge.events if e["t"] == "run.failed"][0]["d"]
        assert failed["err"]["kind"] == "llm" and failed["retryable"] is True

    run(_with_board("tb-lost", body, script=[[{"finish": "tool_calls"}]]))


def test_a_call_too_large_to_send_fails_at_once():
    # With a 600-byte payload limit the first llm.complete (instructions + input) cannot
    # be encoded; the run fails without waiting for the call's timeout.
    async def body(bridge, runtime):
        bridge.send("req", {"req": "big", "input": "y" * 400})
        await bridge.wait_for(lambda: any(e["t"] == "run.failed" for e in bridge.events), 5000)
        assert bridge.calls == []
        assert runtime.active == {}

    run(_with_board("tb-big", body, settings={"max_send": 600}))


def test_cancel_before_the_run_begins_still_frees_its_slot():
    # No link here: the runtime keeps its events in the run's ring all the same.
    async def body():
        runtime = Runtime(_agent(), "tb-local", {})
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
        ring = list(runtime._recent)[-1].ring
        got = [codec.decode(b) for b in ring]
        assert [e["t"] for e in got] == ["run.started", "run.cancelled"]
        assert got[1]["d"]["reason"] == "early"

    run(body())
