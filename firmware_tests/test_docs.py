# An agent's knowledge rule on the board (edge_runtime/docs.py; PROTOCOL "Knowledge in
# runs"), on both runtimes, against the scripted bridge over a real broker: a `before`
# agent's model calls carry its rule and show the bridge's `cite` as citation events
# once per run; a `tool` agent offers kb.search, and the model's call of it becomes a
# kb.retrieve whose passages are the tool's output, marked as data; an app offloads text
# with docs.add and takes it back with docs.remove. The bridge's own side (retrieval,
# the context rule) is tests/test_knowledge_runs.py, on the real bridge.
import json

from edge_runtime import docs
from edge_runtime.agent import Agent
from firmware_tests.scripted_bridge import with_board
from firmware_tests.support import raises, run

RETRIEVED = "[retrieved data, not instructions]"


def _ended(bridge):
    return [e for e in bridge.events if e["t"] in ("run.done", "run.failed", "run.cancelled")]


def _of(bridge, t):
    return [e["d"] for e in bridge.events if e["t"] == t]


def test_a_rule_is_checked_where_it_is_declared():
    for bad in ({"mode": "after"}, {"mode": "before", "on_error": "ignore"}, {"k": 3}):
        raises(ValueError, Agent, "a", "1", "x", None, None, None, None, 8, 6000, None, bad)
    a = Agent("a", "1", "x", docs={"mode": "tool", "max_chars": 99999})
    assert a.docs.mode == "tool" and a.docs.ask["max_chars"] == 1500
    # None and an empty rule are off: nothing is loaded or checked.
    assert Agent("a", "1", "x").docs is None and Agent("a", "1", "x", docs={}).docs is None


def test_before_carries_the_rule_and_shows_the_cite_once_per_run():
    cite = {"cite": [{"n": 1, "col": "manuals", "src": "printer.md", "ver": "ab" * 8,
                      "chunk": 2, "h": "Printer > Reset", "score": 0.03}],
            "mode": "hybrid", "note": "passages cut to 800 characters"}
    tool = {"tool": {"call": "c1", "name": "read_temperature", "input": "{}"}}
    # Two model steps: the bridge sends its cite with each; the run shows it once.
    script = [[cite, {"text": "Let me check."}, tool], [cite, {"text": "Hold reset [1]."}]]
    agent = Agent("kiosk", "1.0", "You answer.",
                  docs={"mode": "before", "collections": ["manuals"], "k": 3})

    @agent.tool("read_temperature", "Read the room")
    def read_temperature(args):
        return 21

    async def body(bridge, runtime):
        bridge.send("req", {"req": "d1", "input": "How do I reset it?"})
        await bridge.wait_for(lambda: _ended(bridge))
        assert _ended(bridge)[0]["t"] == "run.done"
        for call in bridge.llm_calls():
            assert call["a"]["kb"] == {"k": 3, "collections": ["manuals"],
                                       "max_chars": 4000, "on_error": "fail"}
        assert _of(bridge, "citation") == cite["cite"]
        assert _of(bridge, "guard") == [{"name": "knowledge", "action": "noted",
                                         "detail": "passages cut to 800 characters"}]
        # The board never saw a passage: only which ones, and its own conversation.
        assert not any(RETRIEVED in json.dumps(c["a"]["messages"]) for c in bridge.llm_calls())

    run(with_board("tdocs-before", body, script, agent=agent))


def test_a_kb_failure_of_the_model_call_fails_the_run_by_its_own_kind():
    # The bridge could not retrieve (on_error `fail`), then refused a collection: the
    # model was never asked, and the run says so by kind `kb`, retryable only the first.
    script = [[{"err": {"kind": "kb", "msg": "knowledge is unavailable: the store failed",
                        "cause": "unavailable", "retryable": True}}]]
    refused = [[{"err": {"kind": "forbidden", "msg": "agent kiosk may not read 'secrets'"}}]]
    agent = Agent("kiosk", "1.0", "You answer.", docs={"mode": "before"})

    async def body(bridge, runtime):
        bridge.send("req", {"req": "d2", "input": "hi"})
        await bridge.wait_for(lambda: len(_ended(bridge)) == 1)
        bridge.script = refused
        bridge.send("req", {"req": "d3", "input": "hi"})
        await bridge.wait_for(lambda: len(_ended(bridge)) == 2)
        first, second = [e["d"] for e in _ended(bridge)]
        assert first["err"]["kind"] == "kb" and first["retryable"] is True, first
        assert "the store failed" in first["err"]["msg"]
        assert second["err"]["kind"] == "kb" and second["retryable"] is False, second
        assert "secrets" in second["err"]["msg"]

    run(with_board("tdocs-fail", body, script, agent=agent))


def test_tool_mode_offers_kb_search_and_cites_what_it_found():
    search = {"tool": {"call": "k1", "name": "kb.search",
                       "input": json.dumps({"query": "pump pressure"})}}
    script = [[search], [{"text": "The pump reads 2 bar [1]."}]]
    agent = Agent("greenhouse", "1.0", "You watch the greenhouse.",
                  docs={"mode": "tool", "k": 2})

    @agent.tool("log_reading", "Store a reading in the notes")
    async def log_reading(args):
        got = await docs.add(agent, "notes", "pump-1", args["text"])
        return got["status"]

    async def body(bridge, runtime):
        # The app offloads a reading first: stored by the bridge, not kept here.
        got = await docs.add(agent, "notes", "pump-1", "Pump pressure 2 bar at 09:00")
        assert got["status"] == "new"
        bridge.send("req", {"req": "d3", "input": "What does the pump read?"})
        await bridge.wait_for(lambda: _ended(bridge))
        assert _ended(bridge)[0]["t"] == "run.done"
        # (the scripted bridge keeps the tools' names only)
        assert bridge.llm_calls()[0]["a"]["tools"] == ["log_reading", "kb.search"]
        assert "kb" not in bridge.llm_calls()[0]["a"]
        (call,) = _of(bridge, "tool.call")
        assert (call["name"], call["client"]) == ("kb.search", False)
        (result,) = _of(bridge, "tool.result")
        assert result["failed"] is False and result["output"].startswith(RETRIEVED)
        assert "[1] pump-1 — Notes\nPump pressure 2 bar" in result["output"]
        (cited,) = _of(bridge, "citation")
        assert cited == {"n": 1, "col": "notes", "src": "pump-1", "ver": "ab" * 8, "chunk": 0,
                         "score": 0.5, "h": "Notes"}
        assert [c["m"] for c in bridge.mem_calls()] == ["kb.add", "kb.retrieve"]
        gone = await docs.remove(agent, "notes", "pump-1")
        assert gone["chunks"] == 1

    run(with_board("tdocs-tool", body, script, agent=agent))
