# Budgets per run (PROTOCOL.md "Budgets") on both runtimes, over a real broker: steps,
# tokens, memory reads and wall time each warn at 80 % and stop the run cleanly past
# their limit (run.failed, kind budget, not retryable); wall time leaves out the time a
# run waits paused, on a board clock the test moves on (firmware_tests/clock.py).
import json

from edge_runtime.agent import Agent
from edge_runtime.fields import Field
from firmware_tests.clock import Clock
from firmware_tests.scripted_bridge import with_board
from firmware_tests.support import checkpoints, raises, remove, run, scratch


def _tool(call, name, args=None):
    return {"tool": {"call": call, "name": name, "input": json.dumps(args or {})}}


def _agent(budget, **kw):
    agent = Agent("meter", "1.0", "You read the meter.", budget=budget, **kw)

    @agent.tool("read_meter", "Read the meter")
    def read_meter(args):
        return 7

    return agent


def _ended(bridge):
    return [e for e in bridge.events if e["t"] in ("run.done", "run.failed", "run.cancelled")]


def _budgets(bridge):
    return [e["d"] for e in bridge.events if e["t"] == "budget"]


def _failed_budget(bridge):
    end = _ended(bridge)[0]
    assert end["t"] == "run.failed", end
    assert end["d"]["err"]["kind"] == "budget" and end["d"]["retryable"] is False, end
    return end


def test_a_budget_is_checked_where_it_is_declared():
    for bad in ({"steps": 0}, {"steps": -1}, {"steps": 2.5}, {"steps": True}, {"tokens": "9"},
                {"turns": 3}, {"wall_s": 0}, [("steps", 3)]):
        raises(ValueError, _agent, bad)
    assert _agent({"steps": 3, "wall_s": 1.5, "reads": 2, "tokens": 100}).budget["wall_s"] == 1.5
    # None and an empty budget are no budget: nothing is loaded or checked.
    assert _agent(None).budget is None and _agent({}).budget is None


def test_a_steps_budget_warns_at_80_percent_then_stops_before_the_step_past_it():
    # Each node is a step: model, tool, model, tool (the 4th: warn), model (the 5th: stop).
    script = [[_tool("c1", "read_meter")], [_tool("c2", "read_meter")],
              [_tool("c3", "read_meter")], [{"text": "never"}]]

    async def body(bridge, runtime):
        bridge.send("req", {"req": "b1", "input": "read it"})
        await bridge.wait_for(lambda: _ended(bridge))
        end = _failed_budget(bridge)
        assert "steps" in end["d"]["err"]["msg"]
        assert _budgets(bridge) == [
            {"kind": "steps", "used": 4, "limit": 4, "level": "warn"},
            {"kind": "steps", "used": 5, "limit": 4, "level": "exceeded"}]
        types = [e["t"] for e in bridge.of_run(end["r"])]
        # The warning comes before the step it is about; the step past the limit never
        # starts, and the model is not asked a third time.
        warn = types.index("budget")
        assert types[warn:] == ["budget", "node.start", "tool.call", "tool.result", "node.end",
                                "budget", "run.failed"]
        assert len(bridge.llm_calls()) == 2

    run(with_board("tbg-steps", body, script, agent=_agent({"steps": 4})))


def test_a_tokens_budget_stops_before_a_model_call_with_none_left():
    # The scripted bridge reports 10 in and 5 out a call: 15, 30 (83 %: warn), 45 (past).
    script = [[_tool("c1", "read_meter")], [_tool("c2", "read_meter")],
              [_tool("c3", "read_meter")], [{"text": "never"}]]

    async def body(bridge, runtime):
        bridge.send("req", {"req": "b2", "input": "read it"})
        await bridge.wait_for(lambda: _ended(bridge))
        _failed_budget(bridge)
        assert _budgets(bridge) == [
            {"kind": "tokens", "used": 30, "limit": 36, "level": "warn"},
            {"kind": "tokens", "used": 45, "limit": 36, "level": "exceeded"}]
        assert len(bridge.llm_calls()) == 3

    run(with_board("tbg-tokens", body, script, agent=_agent({"tokens": 36})))


def test_a_reads_budget_counts_the_memory_tools_that_read_from_the_bridge():
    script = [[_tool("r1", "memory.recall", {"query": "meter", "field": "facts"}),
               _tool("r2", "memory.remember", {"field": "facts", "key": "m", "value": "7"}),
               _tool("r3", "memory.list", {"field": "facts"})],
              [_tool("r4", "memory.peek", {"field": "facts", "key": "m"})],
              [{"text": "never"}]]
    agent = _agent({"reads": 2}, fields=[Field("facts", dur="agent", kind="collection")])

    async def body(bridge, runtime):
        bridge.turn_by_calls = True
        bridge.send("req", {"req": "b3", "input": "what do you know?"})
        await bridge.wait_for(lambda: _ended(bridge))
        _failed_budget(bridge)
        # A write is not a read; the third read (peek) is past the limit and not made.
        assert _budgets(bridge) == [
            {"kind": "reads", "used": 2, "limit": 2, "level": "warn"},
            {"kind": "reads", "used": 3, "limit": 2, "level": "exceeded"}]
        assert [c["m"] for c in bridge.mem_calls()] == ["mem.recall", "mem.remember", "mem.list"]

    run(with_board("tbg-reads", body, script, agent=agent))


def test_wall_time_leaves_out_the_time_a_run_waits_paused():
    # Paused for a minute of board time against a 10 s budget: the run still finishes;
    # its steps went on counting from its checkpoint (the third warns).
    script = [[_tool("q1", "ask_user", {"q": "Go on?"})], [{"text": "Done."}]]
    prefix = scratch("tbg-pause")
    remove(*checkpoints(prefix))  # none of a run killed mid-test comes back paused
    agent = _agent({"wall_s": 10, "steps": 3})
    agent.tool("ask_user", "Ask the user")(None)
    clock = Clock()

    async def body(bridge, runtime):
        bridge.send("req", {"req": "b4", "input": "ask first"})
        await bridge.wait_for(lambda: [e for e in bridge.events if e["t"] == "run.paused"])
        rid = [e for e in bridge.events if e["t"] == "run.paused"][0]["r"]
        await clock.advance(60000)
        bridge.send("ctl", {"op": "tool", "r": rid, "call": "q1", "output": "yes"})
        await bridge.wait_for(lambda: _ended(bridge))
        assert _ended(bridge)[0]["t"] == "run.done", _ended(bridge)
        assert _budgets(bridge) == [{"kind": "steps", "used": 3, "limit": 3, "level": "warn"}]

    clock.run(with_board("tbg-pause", body, script, agent=agent, settings={"flash_dir": prefix}))


def test_a_run_past_its_wall_time_stops_at_its_next_step():
    # A tool that takes 9 s of board time: 90 % of the budget by the next model step
    # (warn), past it after the second (stop).
    script = [[_tool("s1", "slow")], [_tool("s2", "slow")], [{"text": "never"}]]
    agent = _agent({"wall_s": 10})
    clock = Clock()

    @agent.tool("slow", "Take a while")
    async def slow(args):
        await clock.advance(9000)
        return "done"

    async def body(bridge, runtime):
        bridge.send("req", {"req": "b5", "input": "take your time"})
        await bridge.wait_for(lambda: _ended(bridge))
        _failed_budget(bridge)
        got = _budgets(bridge)
        assert [(d["kind"], d["level"], d["limit"]) for d in got] == [
            ("wall_s", "warn", 10), ("wall_s", "exceeded", 10)]
        assert 9 <= got[0]["used"] < 10 and got[1]["used"] >= 18
        assert len(bridge.llm_calls()) == 2

    clock.run(with_board("tbg-wall", body, script, agent=agent))
