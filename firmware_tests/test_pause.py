# Runs that pause (PROTOCOL.md "Runs that pause"), over a real broker on both runtimes:
# a client tool answered by the host, approvals granted and denied, answers in any order,
# answers no run waits for, cancel while paused, and a board that reboots while paused.
import json

from edge_runtime import platform
from edge_runtime.agent import Agent
from edge_runtime.link import Link
from edge_runtime.runs import Runtime
from firmware_tests.scripted_bridge import device_errors, with_board
from firmware_tests.support import broker_address, checkpoints, remove, run, scratch, topic_root


def _agent():
    agent = Agent("valves", "1.0", "You run the valves.")

    @agent.tool("read_pressure", "Read the line pressure in bar")
    def read_pressure(args):
        return 2.5

    agent.opened = []

    @agent.tool("open_valve", "Open a valve", approval=True)
    def open_valve(args):
        agent.opened.append(args.get("valve"))
        return "valve %s is open" % args.get("valve")

    agent.tool("ask_user", "Ask the user a question",
               {"type": "object", "properties": {"q": {"type": "string"}}})(None)
    return agent


def _tool(call, name, args):
    return {"tool": {"call": call, "name": name, "input": json.dumps(args)}}


def _types(bridge, run_id):
    return [(e["i"], e["t"]) for e in bridge.of_run(run_id)]


def _node(e):
    return e["t"], e.get("n"), e.get("a"), e.get("k")


# Files beside a board's checkpoints in test_a_board_that_reboots_while_paused_...: a
# list of all their names is a block the test's heap does not have.
_CROWD = 1500


def _board(device, body, script):
    prefix = scratch(device)
    remove(*checkpoints(prefix))
    agent = _agent()

    async def wrapped(bridge, runtime):
        await body(bridge, runtime, prefix, agent)

    run(with_board(device, wrapped, script, settings={"flash_dir": prefix}, agent=agent))


def _paused(bridge):
    return [e for e in bridge.events if e["t"] == "run.paused"]


def _ended(bridge):
    return [e for e in bridge.events if e["t"] in ("run.done", "run.failed", "run.cancelled")]


def _answers(bridge):
    # The tool messages the model was sent in its last call, by call id.
    out = {}
    for m in bridge.llm_calls()[-1]["a"]["messages"]:
        if m["role"] == "tool":
            out[m["call"]] = m["content"]
    return out


def test_a_client_tool_pauses_the_run_and_its_answer_resumes_it():
    script = [[_tool("c1", "read_pressure", {}), _tool("c2", "ask_user", {"q": "Open valve 3?"})],
              [{"text": "Opening it."}]]

    async def body(bridge, runtime, prefix, agent):
        bridge.send("req", {"req": "p1", "input": "check the line"})
        await bridge.wait_for(lambda: _paused(bridge))
        paused = _paused(bridge)[0]
        rid = paused["r"]
        assert paused["d"] == {"reason": "tool", "calls": ["c2"], "usr": None}
        # The local tool ran; the client tool was announced; the run left memory and
        # its slot, and its state is on flash.
        assert [t for _, t in _types(bridge, rid)] == [
            "run.started", "node.start", "msg.start", "msg.end", "usage", "node.end",
            "node.start", "tool.call", "tool.result", "node.end", "node.start", "tool.call",
            "run.paused"]
        call = bridge.of_run(rid)[11]["d"]
        assert call == {"call": "c2", "name": "ask_user", "input": '{"q": "Open valve 3?"}',
                        "client": True}
        # The waiting call's node starts with its announcement and stays open.
        assert _node(bridge.of_run(rid)[10]) == ("node.start", "/tool/ask_user", 1, 1)
        assert runtime.active == {} and rid in runtime.paused
        assert len(checkpoints(prefix)) == 1
        bridge.send("ctl", {"op": "tool", "r": rid, "call": "c2", "output": "yes, open it"})
        await bridge.wait_for(lambda: _ended(bridge))
        assert _ended(bridge)[0]["t"] == "run.done"
        events = bridge.of_run(rid)
        # Each id once, in order, from 1 to the end.
        assert [e["i"] for e in events] == list(range(1, len(events) + 1))
        assert [e["t"] for e in events[13:17]] == ["tool.result", "node.end", "run.resumed",
                                                   "node.start"]
        assert events[13]["d"] == {"call": "c2", "output": "yes, open it", "failed": False}
        assert _node(events[14]) == ("node.end", "/tool/ask_user", 1, 1)
        assert events[14]["d"] == {"status": "completed"}
        assert events[15]["d"]["ckpt"] >= 2
        # The model's second step goes on counting from the checkpoint's activations.
        assert _node(events[16]) == ("node.start", "/model", 2, 2)
        assert _answers(bridge) == {"c1": "2.5", "c2": "yes, open it"}
        assert len(bridge.llm_calls()) == 2
        assert checkpoints(prefix) == [] and runtime.paused == {}

    _board("tp-client", body, script)


def test_approvals_granted_and_denied_answered_out_of_order():
    script = [[_tool("a1", "open_valve", {"valve": 1}), _tool("a2", "open_valve", {"valve": 2}),
               _tool("q1", "ask_user", {"q": "Which line?"})],
              [{"text": "Done."}]]

    async def body(bridge, runtime, prefix, agent):
        bridge.send("req", {"req": "p2", "input": "open valves 1 and 2"})
        await bridge.wait_for(lambda: _paused(bridge))
        rid = _paused(bridge)[0]["r"]
        assert _paused(bridge)[0]["d"] == {"reason": "tool", "calls": ["a1", "a2", "q1"], "usr": None}
        asked = [e["d"] for e in bridge.of_run(rid) if e["t"] == "approval.request"]
        assert asked == [{"call": "a1", "name": "open_valve"}, {"call": "a2", "name": "open_valve"}]
        assert agent.opened == []  # nothing runs before its yes
        # The last first: the client tool, then a denial, then the grant.
        bridge.send("ctl", {"op": "tool", "r": rid, "call": "q1", "output": "line B"})
        await bridge.wait_for(lambda: [e for e in bridge.of_run(rid) if e["t"] == "tool.result"])
        bridge.send("ctl", {"op": "approve", "r": rid, "call": "a2", "ok": False, "by": "ops-ann"})
        await bridge.wait_for(lambda: [e for e in bridge.of_run(rid) if e["t"] == "approval.denied"])
        assert not _ended(bridge) and rid in runtime.paused
        bridge.send("ctl", {"op": "approve", "r": rid, "call": "a1", "ok": True, "by": "ops-bob"})
        await bridge.wait_for(lambda: _ended(bridge))
        assert _ended(bridge)[0]["t"] == "run.done"
        assert agent.opened == [1]
        d = {e["t"]: e["d"] for e in bridge.of_run(rid) if e["t"].startswith("approval.")}
        assert d["approval.denied"] == {"call": "a2", "name": "open_valve", "by": "ops-ann"}
        assert d["approval.granted"] == {"call": "a1", "name": "open_valve", "by": "ops-bob"}
        assert _answers(bridge) == {"q1": "line B", "a2": "denied by ops-ann",
                                    "a1": "valve 1 is open"}
        # Each waiting call is a node from its announcement to its answer: two calls of
        # one tool are its activations 1 and 2; a denial ends its node failed.
        marks = [_node(e) + (e["d"],) for e in bridge.of_run(rid)
                 if e["t"].startswith("node.") and e["n"].startswith("/tool/")]
        assert marks == [
            ("node.start", "/tool/open_valve", 1, 1, {"kind": "tool"}),
            ("node.start", "/tool/open_valve", 2, 1, {"kind": "tool"}),
            ("node.start", "/tool/ask_user", 1, 1, {"kind": "tool"}),
            ("node.end", "/tool/ask_user", 1, 1, {"status": "completed"}),
            ("node.end", "/tool/open_valve", 2, 1, {"status": "failed"}),
            ("node.end", "/tool/open_valve", 1, 1, {"status": "completed"})]
        assert len([e for e in bridge.of_run(rid) if e["t"] == "run.resumed"]) == 1

    _board("tp-approve", body, script)


def test_an_answer_no_run_waits_for_is_refused_and_changes_nothing():
    script = [[_tool("q1", "ask_user", {"q": "Sure?"})], [{"text": "Fine."}]]

    async def body(bridge, runtime, prefix, agent):
        bridge.send("ctl", {"op": "tool", "r": "nope.1", "call": "q1", "output": "x"})
        await bridge.wait_for(lambda: device_errors(bridge))
        refused = device_errors(bridge)[0]
        assert (refused["kind"], refused["r"], refused["call"]) == ("not_waiting", "nope.1", "q1")
        bridge.send("req", {"req": "p3", "input": "ask me"})
        await bridge.wait_for(lambda: _paused(bridge))
        rid = _paused(bridge)[0]["r"]
        # The wrong call, the wrong kind of answer: refused, the run still waits.
        bridge.send("ctl", {"op": "tool", "r": rid, "call": "q9", "output": "x"})
        bridge.send("ctl", {"op": "approve", "r": rid, "call": "q1", "ok": True})
        await bridge.wait_for(lambda: len(device_errors(bridge)) == 3)
        assert [e["kind"] for e in device_errors(bridge)] == ["not_waiting"] * 3
        assert device_errors(bridge)[1]["call"] == "q9"
        assert rid in runtime.paused and not _ended(bridge)
        bridge.send("ctl", {"op": "tool", "r": rid, "call": "q1", "output": "sure"})
        await bridge.wait_for(lambda: _ended(bridge))
        # A second answer for the call that was answered: not waiting any more.
        bridge.send("ctl", {"op": "tool", "r": rid, "call": "q1", "output": "again"})
        await bridge.wait_for(lambda: len(device_errors(bridge)) == 4)
        late = device_errors(bridge)[3]
        assert (late["kind"], late["r"], late["call"]) == ("not_waiting", rid, "q1")
        assert _ended(bridge)[0]["t"] == "run.done"
        assert len([e for e in bridge.of_run(rid) if e["t"] == "tool.result"]) == 1

    _board("tp-refuse", body, script)


def test_cancel_while_paused_ends_the_run_cancelled_and_its_calls_too():
    script = [[_tool("a1", "open_valve", {"valve": 4}), _tool("q1", "ask_user", {"q": "?"})],
              [{"text": "never"}]]

    async def body(bridge, runtime, prefix, agent):
        bridge.send("req", {"req": "p4", "input": "open 4"})
        await bridge.wait_for(lambda: _paused(bridge))
        rid = _paused(bridge)[0]["r"]
        bridge.send("ctl", {"op": "cancel", "r": rid, "reason": "changed my mind"})
        await bridge.wait_for(lambda: _ended(bridge))
        end = _ended(bridge)[0]
        assert end["t"] == "run.cancelled" and end["d"] == {"reason": "changed my mind"}
        results = [e["d"] for e in bridge.of_run(rid) if e["t"] == "tool.result"]
        assert results == [{"call": "a1", "output": "cancelled", "failed": True},
                           {"call": "q1", "output": "cancelled", "failed": True}]
        ends = [_node(e) + (e["d"]["status"],) for e in bridge.of_run(rid) if e["t"] == "node.end"]
        assert ends[-2:] == [("node.end", "/tool/open_valve", 1, 1, "cancelled"),
                             ("node.end", "/tool/ask_user", 1, 1, "cancelled")]
        assert agent.opened == [] and runtime.paused == {} and checkpoints(prefix) == []
        assert len(bridge.llm_calls()) == 1

    _board("tp-cancel", body, script)


def test_a_board_that_reboots_while_paused_comes_back_waiting_and_finishes():
    script = [[_tool("q1", "ask_user", {"q": "Vent now?"})], [{"text": "Venting."}]]

    async def body(bridge, runtime, prefix, agent):
        bridge.send("req", {"req": "p5", "input": "vent the tank"})
        await bridge.wait_for(lambda: _paused(bridge))
        rid = _paused(bridge)[0]["r"]
        before = len(bridge.of_run(rid))
        # Power lost: the board's link goes away without a word; a new runtime (a new
        # boot) starts from the same flash and takes over the device's session.
        runtime.link.stop()
        # The old boot's memory and tasks are gone with its power.
        from edge_runtime import pause
        runtime.paused.clear()
        pause._unwatch(runtime)
        host, port = broker_address()
        # The folder is shared with many other files (a board's root): the new boot
        # reads its checkpoints among them without a list of every name.
        for k in range(_CROWD):
            with open("%sother-%d" % (prefix, k), "w"):
                pass
        again = Runtime(agent, runtime.device, {"flash_dir": prefix, "prefix": topic_root()})
        link = Link(runtime.device, host, port, backoff_ms=(50, 200), **again.link_settings())
        again.attach(link)
        task = platform.asyncio.create_task(link.run())
        try:
            await bridge.wait_for(lambda: len(_paused(bridge)) == 2)
            events = bridge.of_run(rid)
            assert [e["t"] for e in events[before:]] == ["run.resumed", "tool.call", "run.paused"]
            assert events[before + 1]["d"]["call"] == "q1" and events[before + 1]["d"]["client"]
            assert [e["i"] for e in events] == list(range(1, len(events) + 1))
            assert rid in again.paused and not rid.startswith(again.boot)
            bridge.send("ctl", {"op": "tool", "r": rid, "call": "q1", "output": "yes"})
            await bridge.wait_for(lambda: _ended(bridge))
            assert _ended(bridge)[0]["t"] == "run.done"
            assert _answers(bridge) == {"q1": "yes"}
            assert checkpoints(prefix) == []
        finally:
            for k in range(_CROWD):
                remove("%sother-%d" % (prefix, k))
            link.stop()
            try:
                await platform.wait_for_ms(task, 3000)
            except Exception:
                task.cancel()

    _board("tp-reboot", body, script)


def test_a_run_that_waits_past_its_limit_fails_retryable():
    script = [[_tool("q1", "ask_user", {"q": "Still there?"})], [{"text": "never"}]]

    async def body(bridge, runtime, prefix, agent):
        agent.max_pause_s = 1
        bridge.send("req", {"req": "p6", "input": "ask and wait"})
        await bridge.wait_for(lambda: _ended(bridge), 8000)
        end = _ended(bridge)[0]
        assert end["t"] == "run.failed" and end["d"]["retryable"] is True
        assert end["d"]["err"]["kind"] == "timeout"
        from edge_runtime import pause
        assert runtime.paused == {} and pause._watcher is None and checkpoints(prefix) == []
        # An answer after the end is not waited for.
        bridge.send("ctl", {"op": "tool", "r": end["r"], "call": "q1", "output": "late"})
        await bridge.wait_for(lambda: device_errors(bridge))
        refused = device_errors(bridge)[0]
        assert (refused["kind"], refused["r"], refused["call"]) == ("not_waiting", end["r"], "q1")

    _board("tp-limit", body, script)


def test_a_gap_reported_while_paused_takes_an_id_no_later_event_takes():
    # A ring of 6 events: asked for everything while paused, the run reports what its
    # ring lost; that report's id is the run's (recorded in its checkpoint), so the
    # events the answer brings follow it, each id once.
    script = [[_tool("c1", "read_pressure", {}), _tool("c2", "ask_user", {"q": "Go?"})],
              [{"text": "Gone."}]]
    prefix = scratch("tp-gap")
    remove(*checkpoints(prefix))
    agent = _agent()

    async def body(bridge, runtime):
        bridge.send("req", {"req": "p7", "input": "go"})
        await bridge.wait_for(lambda: _paused(bridge))
        rid = _paused(bridge)[0]["r"]
        last = _paused(bridge)[0]["i"]
        bridge.send("ctl", {"op": "replay", "r": rid, "after": 0})
        await bridge.wait_for(lambda: [e for e in bridge.of_run(rid) if e["t"] == "error"])
        gap = [e for e in bridge.of_run(rid) if e["t"] == "error"][0]
        # The ring held the last 6 (last-5..last); its oldest made room for the report.
        assert gap["i"] == last + 1 and gap["d"]["from"] == 1 and gap["d"]["to"] == last - 5
        assert [e["i"] for e in bridge.events if e["r"] == rid][-6:] == list(
            range(last - 4, last + 2))
        bridge.send("ctl", {"op": "tool", "r": rid, "call": "c2", "output": "yes"})
        await bridge.wait_for(lambda: _ended(bridge))
        assert _ended(bridge)[0]["t"] == "run.done"
        # Every id once (of_run keeps the last of a repeated id: compare all copies).
        seen = {}
        for e in bridge.events:
            if e["r"] == rid:
                assert seen.setdefault(e["i"], e["t"]) == e["t"], (e["i"], seen[e["i"]], e["t"])
        assert sorted(seen) == list(range(1, len(seen) + 1))
        assert seen[last + 2] == "tool.result"

    run(with_board("tp-gap", body, script, settings={"flash_dir": prefix, "ring": 6},
                   agent=agent))
