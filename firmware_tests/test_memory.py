# Declared fields, durable run state, core memory and the memory tools, over a real broker
# on both runtimes: the scripted bridge (firmware_tests/scripted_bridge.py) answers the
# state, core and mem calls from an in-memory table the tests read back.
import json

from edge_runtime import codec, platform
from edge_runtime.agent import Agent, RunFailed
from edge_runtime.fields import Field
from firmware_tests.scripted_bridge import device_errors, with_board
from firmware_tests.support import remove, run, scratch


def _state_agent(handler):
    return Agent("counter", "1.0", "", handler=handler, fields=[
        Field("visits", vis="public", dur="user", merge="sum", fmt="number"),
        Field("mood", dur="agent"),
        Field("tags", dur="agent", merge="union"),
        Field("log", dur="agent", merge="append"),
        Field("scratch"),  # run-scoped: never leaves the board
    ])


async def _bump(run_):
    s = run_.state
    assert s["visits"] == 3 and s["tags"] == ["a"] and "mood" not in s
    s["visits"] += 2
    s["tags"].append("b")
    s["log"] = s["log"] + " two"
    s["scratch"] = "mine"
    s["undeclared"] = 1
    return {}


def _seed(bridge):
    bridge.memory.values.update({"visits": 3, "tags": ["a"], "log": "one"})


def _ended(bridge):
    return [e for e in bridge.events if e["t"] in ("run.done", "run.failed", "run.cancelled")]


def _run_events(bridge, t=None):
    evs = [e for e in bridge.events if e["r"] != "_"]
    return evs if t is None else [e for e in evs if e["t"] == t]


def test_declared_fields_go_out_in_hello():
    async def body(bridge, runtime):
        fields = bridge.hello["fields"]
        assert fields[0] == {"name": "visits", "vis": "public", "dur": "user", "merge": "sum",
                             "fmt": "number"}
        assert [f["name"] for f in fields] == ["visits", "mood", "tags", "log", "scratch"]
        assert fields[-1] == {"name": "scratch"}

    run(with_board("tm-hello", body, agent=_state_agent(_bump)))


def test_durable_fields_are_seeded_and_what_changed_is_committed_once():
    async def body(bridge, runtime):
        _seed(bridge)
        bridge.send("req", {"req": "s1", "usr": "u1", "input": "x", "sc": "ticket-u1"})
        await bridge.wait_for(lambda: _ended(bridge))
        assert _ended(bridge)[0]["t"] == "run.done"
        run_id = _ended(bridge)[0]["r"]
        load, = bridge.mem_calls("state.load")
        assert load["a"]["sc"] == "ticket-u1" and load["r"] == run_id
        assert sorted(load["a"]["fields"]) == ["log", "mood", "tags", "visits"]
        commit, = bridge.mem_calls("state.commit")
        assert commit["a"]["sc"] == "ticket-u1"
        writes = commit["a"]["writes"]
        # Deltas for sum, union and append; the unchanged field and the run-scoped and
        # undeclared keys are not written; one write id each, in the run's sequence.
        got = {}
        for w in writes:
            got[w["field"]] = w["value"]
        assert got == {"visits": 2, "tags": ["b"], "log": " two"}
        assert sorted(w["w"] for w in writes) == ["%s:%d" % (run_id, n) for n in (1, 2, 3)]
        assert bridge.memory.values == {"visits": 5, "tags": ["a", "b"], "log": "one two"}

    run(with_board("tm-commit", body, agent=_state_agent(_bump)))


def test_state_code_with_no_room_to_load_is_loaded_again_once_the_link_lets_go():
    # The allocator failing while the state module loads (a fragmented heap, a run's end
    # with its last events in flight) is stood in for at the import: the first import
    # at each of the run's two edges finds no block. Each is tried again once the link
    # holds nothing unacknowledged, and the run loads and commits as it would have.
    import builtins
    real = builtins.__import__
    failed = []

    def short_of_memory(name, *args):
        fromlist = args[2] if len(args) > 2 else ()
        if name == "edge_runtime" and fromlist and "state" in fromlist and len(failed) % 2 == 0:
            failed.append(name)
            raise MemoryError("no block for the module's code")
        if name == "edge_runtime" and fromlist and "state" in fromlist:
            failed.append(None)
        return real(name, *args)

    async def body(bridge, runtime):
        _seed(bridge)
        builtins.__import__ = short_of_memory
        try:
            bridge.send("req", {"req": "s9", "usr": "u1", "input": "x", "sc": "ticket-u1"})
            await bridge.wait_for(lambda: _ended(bridge))
        finally:
            builtins.__import__ = real
        assert _ended(bridge)[0]["t"] == "run.done"
        # Refused once and then imported, at the load and at the commit.
        assert failed == ["edge_runtime", None, "edge_runtime", None]
        assert len(bridge.mem_calls("state.load")) == 1
        assert len(bridge.mem_calls("state.commit")) == 1
        assert bridge.memory.values == {"visits": 5, "tags": ["a", "b"], "log": "one two"}

    run(with_board("tm-noroom", body, agent=_state_agent(_bump)))


def test_a_run_that_changes_nothing_commits_nothing_and_a_failed_run_commits_nothing():
    async def fails(run_):
        run_.state["visits"] = 100
        raise RunFailed("condition", "no")

    async def body(bridge, runtime):
        _seed(bridge)
        bridge.send("req", {"req": "f1", "usr": "u1", "input": "x", "sc": "t"})
        await bridge.wait_for(lambda: _ended(bridge))
        assert _ended(bridge)[0]["t"] == "run.failed"
        assert bridge.mem_calls("state.commit") == [] and bridge.memory.values["visits"] == 3

    run(with_board("tm-nocommit", body, agent=_state_agent(fails)))


def test_a_failed_commit_is_reported_before_the_end_and_sent_again_on_reconnect():
    async def body(bridge, runtime):
        _seed(bridge)
        bridge.memory.fail["state.commit"] = [{"kind": "busy", "msg": "full"}]
        bridge.send("req", {"req": "c1", "usr": "u1", "input": "x", "sc": "t"})
        await bridge.wait_for(lambda: _ended(bridge))
        types = [e["t"] for e in _run_events(bridge)]
        assert types[-2:] == ["error", "run.done"]
        err = _run_events(bridge, "error")[0]["d"]
        assert err["kind"] == "commit" and sorted(err["fields"]) == ["log", "tags", "visits"]
        assert "next connection" in err["msg"]
        assert len(runtime.commits) == 1 and bridge.memory.values["visits"] == 3
        runtime.link.reconnect("test cuts the link")
        await bridge.wait_for(lambda: len(bridge.mem_calls("state.commit")) == 2 and not runtime.commits)
        first, again = bridge.mem_calls("state.commit")
        assert again["a"]["writes"] == first["a"]["writes"]  # the same write ids
        assert bridge.memory.values["visits"] == 5

    run(with_board("tm-retry", body, agent=_state_agent(_bump)))


def test_a_commit_refused_or_past_the_pending_bound_is_reported_lost():
    async def body(bridge, runtime):
        _seed(bridge)
        bridge.memory.fail["state.commit"] = [{"kind": "bad_token", "msg": "expired"},
                                              {"kind": "timeout", "msg": "slow"}]
        bridge.send("req", {"req": "l1", "usr": "u1", "input": "x", "sc": "t"})
        await bridge.wait_for(lambda: len(_ended(bridge)) == 1)
        assert "not sent again" in _run_events(bridge, "error")[0]["d"]["msg"]
        assert runtime.commits == []
        runtime.commits.extend([("r", None, [])] * 4)
        bridge.send("req", {"req": "l2", "usr": "u1", "input": "x", "sc": "t"})
        await bridge.wait_for(lambda: len(_ended(bridge)) == 2)
        assert "is lost" in _run_events(bridge, "error")[1]["d"]["msg"]
        assert len(runtime.commits) == 4
        runtime.commits[:] = []

    run(with_board("tm-lost", body, agent=_state_agent(_bump)))


def test_state_that_cannot_be_loaded_fails_the_run():
    async def body(bridge, runtime):
        bridge.memory.fail["state.load"] = [{"kind": "no_scope", "msg": "no user"},
                                            {"kind": "busy", "msg": "later"}]
        bridge.send("req", {"req": "n1", "input": "x"})
        bridge.send("req", {"req": "n2", "input": "x"})
        await bridge.wait_for(lambda: len(_ended(bridge)) == 2)
        first, second = [e["d"] for e in _ended(bridge)]
        assert first["err"]["kind"] == "link" and "no_scope" in first["err"]["msg"]
        assert first["retryable"] is False and second["retryable"] is True
        # No ticket on the req: none in the call.
        assert "sc" not in bridge.mem_calls("state.load")[0]["a"]

    run(with_board("tm-noload", body, agent=_state_agent(_bump)))


_DURABLE = ["visits", "mood", "tags", "log"]


def test_state_sent_in_the_req_is_taken_without_a_load_and_committed_the_same():
    async def body(bridge, runtime):
        _seed(bridge)
        seed = {"fields": _DURABLE, "values": {"visits": 3, "tags": ["a"], "log": "one"}}
        bridge.send("req", {"req": "q1", "usr": "u1", "input": "x", "sc": "t", "state": seed})
        await bridge.wait_for(lambda: _ended(bridge))
        assert _ended(bridge)[0]["t"] == "run.done"
        assert bridge.mem_calls("state.load") == []
        # The deltas are counted from the state the req brought, as from a load.
        commit, = bridge.mem_calls("state.commit")
        got = {}
        for w in commit["a"]["writes"]:
            got[w["field"]] = w["value"]
        assert got == {"visits": 2, "tags": ["b"], "log": " two"}
        assert bridge.memory.values == {"visits": 5, "tags": ["a", "b"], "log": "one two"}

    run(with_board("tm-seeded", body, agent=_state_agent(_bump)))


def test_state_in_the_req_that_misses_a_field_is_not_taken():
    seen = []

    async def look(run_):
        seen.append(dict(run_.state))
        return {}

    async def body(bridge, runtime):
        _seed(bridge)
        # No "log": the run loads every field, and the seed's stale visits are not used.
        seed = {"fields": ["visits", "mood", "tags"], "values": {"visits": 100, "tags": []}}
        bridge.send("req", {"req": "q2", "usr": "u1", "input": "x", "sc": "t", "state": seed})
        # Not a map: the same.
        bridge.send("req", {"req": "q3", "usr": "u1", "input": "x", "sc": "t", "state": [1, 2]})
        await bridge.wait_for(lambda: len(_ended(bridge)) == 2)
        assert [e["t"] for e in _ended(bridge)] == ["run.done", "run.done"]
        assert len(bridge.mem_calls("state.load")) == 2
        assert seen == [{"visits": 3, "tags": ["a"], "log": "one"}] * 2

    run(with_board("tm-seedpart", body, agent=_state_agent(look)))


def test_a_run_that_writes_back_what_it_loaded_sends_no_commit_and_one_that_changes_does():
    # Decided in runs._state without state.py (not imported at such a run's end): each
    # durable field the run holds equals what it started with, whether the state came
    # with the req or by a load; a run-scoped field does not count. Then a change, and
    # the commit goes as before.
    async def same(run_):
        s = run_.state
        s["visits"] = 3  # written back unchanged
        s["tags"] = ["a"]  # an equal list, another object
        s["scratch"] = "mine"  # run-scoped
        if run_.input == "change":
            s["mood"] = "calm"
        return {}

    async def body(bridge, runtime):
        _seed(bridge)
        seed = {"fields": _DURABLE, "values": {"visits": 3, "tags": ["a"], "log": "one"}}
        bridge.send("req", {"req": "w1", "usr": "u1", "input": "x", "sc": "t", "state": seed})
        await bridge.wait_for(lambda: len(_ended(bridge)) == 1)
        bridge.send("req", {"req": "w2", "usr": "u1", "input": "x", "sc": "t"})
        await bridge.wait_for(lambda: len(_ended(bridge)) == 2)
        assert [e["t"] for e in _ended(bridge)] == ["run.done", "run.done"]
        assert len(bridge.mem_calls("state.load")) == 1
        assert bridge.mem_calls("state.commit") == []
        bridge.send("req", {"req": "w3", "usr": "u1", "input": "change", "sc": "t"})
        await bridge.wait_for(lambda: len(_ended(bridge)) == 3)
        assert _ended(bridge)[2]["t"] == "run.done"
        commit, = bridge.mem_calls("state.commit")
        assert [w["field"] for w in commit["a"]["writes"]] == ["mood"]
        assert bridge.memory.values["mood"] == "calm" and bridge.memory.values["visits"] == 3

    run(with_board("tm-same", body, agent=_state_agent(same)))


def test_state_in_a_queued_req_or_behind_a_waiting_commit_is_loaded_again():
    seen = []
    gate = platform.asyncio.Event()

    async def slow(run_):
        seen.append(run_.state.get("visits"))
        if len(seen) == 1:
            await gate.wait()
        return {}

    stale = {"fields": _DURABLE, "values": {"visits": 100}}

    async def body(bridge, runtime):
        _seed(bridge)
        bridge.send("req", {"req": "w1", "usr": "u1", "input": "x", "sc": "t", "state": stale})
        await bridge.wait_for(lambda: len(seen) == 1)
        # Admitted at once, the first run took the state its req brought.
        assert seen == [100] and bridge.mem_calls("state.load") == []
        # The board runs one at a time here: the second waits in the queue, and a run
        # ahead of it may write its state before it starts.
        bridge.send("req", {"req": "w2", "usr": "u1", "input": "x", "sc": "t", "state": stale})
        await bridge.wait_for(lambda: len(runtime._queue) == 1)
        gate.set()
        await bridge.wait_for(lambda: len(_ended(bridge)) == 2)
        assert seen == [100, 3] and len(bridge.mem_calls("state.load")) == 1
        # A commit of this board waits to be sent again: the bridge read the state before
        # that write, so it is loaded again.
        runtime.commits.append(("r", None, []))
        bridge.send("req", {"req": "w3", "usr": "u1", "input": "x", "sc": "t", "state": stale})
        await bridge.wait_for(lambda: len(_ended(bridge)) == 3)
        runtime.commits[:] = []
        assert seen == [100, 3, 3] and len(bridge.mem_calls("state.load")) == 2

    run(with_board("tm-seedwait", body, agent=_state_agent(slow), settings={"concurrency": 1}))


def test_a_scope_ticket_that_is_not_a_string_is_refused():
    async def body(bridge, runtime):
        bridge.send("req", {"req": "bad-sc", "input": "x", "sc": 5})
        await bridge.wait_for(lambda: device_errors(bridge))
        assert device_errors(bridge)[0]["kind"] == "bad_envelope"

    run(with_board("tm-badsc", body, agent=_state_agent(_bump)))


# --- core memory and the memory tools, in the model loop -----------------------------

def _mem_agent(**kw):
    agent = Agent("keeper", "1.0", "You keep notes.", fields=[
        Field("notes", dur="agent", core=True, max=60),
        Field("about", dur="user", core=True, max=200),
        Field("facts", vis="public", dur="user", kind="collection", key="id"),
        Field("secrets", dur="agent", kind="collection"),
        Field("todo", vis="public"),  # a run slot: stays on the board
    ], **kw)

    @agent.tool("read_temperature", "Read the room in C")
    def read_temperature(args):
        return 21.5

    return agent


def _tool(call, name, args):
    return {"tool": {"call": call, "name": name, "input": json.dumps(args)}}


def _core_files(prefix):
    return [prefix + "core_agent.bin", prefix + "core_u_" + "".join("%02x" % b for b in b"u1") + ".bin"]


def _memory_board(device, body, script, agent=None, settings=None):
    prefix = scratch(device)
    remove(*_core_files(prefix))
    s = {"flash_dir": prefix}
    s.update(settings or {})

    async def wrapped(bridge, runtime):
        bridge.turn_by_calls = True
        await body(bridge, runtime, prefix)

    try:
        run(with_board(device, wrapped, script, settings=s, agent=agent or _mem_agent()))
    finally:
        remove(*_core_files(prefix))


def _tool_messages(bridge):
    # What the model was told by each tool, from the last model call.
    return [m["content"] for m in bridge.llm_calls()[-1]["a"]["messages"] if m["role"] == "tool"]


def _nowhere(bridge, text):
    # Event by event: one repr of them all is a large block on a small heap.
    for e in bridge.events:
        assert text not in repr(e["d"]), e


def _ask(bridge, req="m1"):
    bridge.send("req", {"req": req, "usr": "u1", "input": "remember this", "sc": "tk"})


def test_a_core_append_within_the_limit_is_kept_on_flash_backed_up_and_shown_to_the_model():
    script = [[_tool("c1", "memory.append", {"field": "notes", "text": "likes tea"})],
              [{"text": "Noted."}]]

    async def body(bridge, runtime, prefix):
        _ask(bridge)
        await bridge.wait_for(lambda: _ended(bridge))
        assert _ended(bridge)[0]["t"] == "run.done"
        run_id = _ended(bridge)[0]["r"]
        # Flash was empty: both documents were asked of the bridge, with the ticket.
        loads = bridge.mem_calls("core.load")
        assert sorted(c["a"]["scope"] for c in loads) == ["agent", "user"]
        assert all(c["a"]["sc"] == "tk" for c in loads)
        sync, = bridge.mem_calls("core.sync")
        assert sync["a"] == {"scope": "agent", "ver": 1, "doc": "likes tea", "w": run_id + ":1",
                             "sc": "tk"}
        assert bridge.memory.cores["agent"] == {"ver": 1, "doc": "likes tea"}
        raw = platform.read_file(prefix + "core_agent.bin")
        assert codec.decode(raw) == {"v": 1, "d": "likes tea", "s": 1}
        assert _tool_messages(bridge) == ["core memory agent is now 9/60 characters"]
        system = bridge.llm_calls()[1]["a"]["messages"][0]["content"]
        assert system.startswith("You keep notes.\n\n")
        assert "[core memory: agent, 9/60 characters]\nlikes tea" in system
        assert "[core memory: user, 0/200 characters]" in system
        # Never on the event stream: the call with its name only.
        call = _run_events(bridge, "tool.call")[0]["d"]
        assert call == {"call": "c1", "name": "memory.append", "input": "{}", "client": False}
        result = _run_events(bridge, "tool.result")[0]["d"]
        assert result == {"call": "c1", "output": "", "failed": False}
        _nowhere(bridge, "likes tea")

    _memory_board("tm-core", body, script)


def test_a_core_edit_past_the_limit_is_a_tool_error_and_core_is_restored_from_the_bridge():
    script = [[_tool("c1", "memory.append", {"field": "notes", "text": "y" * 20})],
              [{"text": "Full."}]]

    async def body(bridge, runtime, prefix):
        bridge.memory.cores["agent"] = {"ver": 3, "doc": "x" * 50}
        _ask(bridge)
        await bridge.wait_for(lambda: _ended(bridge))
        assert _tool_messages(bridge) == [
            "core memory agent is 50/60 characters; this edit needs 11 more; replace or "
            "remove something first"]
        assert _run_events(bridge, "tool.result")[0]["d"] == {"call": "c1", "output": "",
                                                              "failed": True}
        assert bridge.mem_calls("core.sync") == []
        # Restored from the backup onto flash, unchanged by the refused edit.
        raw = platform.read_file(prefix + "core_agent.bin")
        assert codec.decode(raw) == {"v": 3, "d": "x" * 50, "s": 3}

    _memory_board("tm-full", body, script)


def test_replace_needs_an_exact_match_and_an_empty_replacement_deletes():
    script = [[_tool("c1", "memory.replace", {"field": "notes", "old": "likes tea", "text": "likes coffee"})],
              [_tool("c2", "memory.replace", {"field": "notes", "old": "likes juice", "text": "x"})],
              [_tool("c3", "memory.replace", {"field": "notes", "old": "\nowns a dog", "text": ""})],
              [{"text": "Done."}]]

    async def body(bridge, runtime, prefix):
        platform.write_file(prefix + "core_agent.bin",
                            codec.encode({"v": 7, "d": "a cat\nlikes tea\nowns a dog", "s": 7}))
        _ask(bridge)
        await bridge.wait_for(lambda: _ended(bridge))
        assert [c["a"]["scope"] for c in bridge.mem_calls("core.load")] == ["user"]
        told = _tool_messages(bridge)
        assert told[0] == "core memory agent is now 29/60 characters"
        assert told[1] == "old must match text in core memory agent exactly"
        assert told[2] == "core memory agent is now 18/60 characters"
        assert [(c["a"]["ver"], c["a"]["doc"]) for c in bridge.mem_calls("core.sync")] == [
            (8, "a cat\nlikes coffee\nowns a dog"), (9, "a cat\nlikes coffee")]
        assert codec.decode(platform.read_file(prefix + "core_agent.bin"))["d"] == "a cat\nlikes coffee"

    _memory_board("tm-replace", body, script)


def test_memory_tools_go_to_the_bridge_and_private_fields_are_redacted():
    script = [[_tool("c1", "memory.remember", {"field": "facts", "value": {"id": "tea", "text": "likes green tea"}})],
              [_tool("c2", "memory.recall", {"query": "green tea", "field": "facts"})],
              [_tool("c3", "memory.remember", {"field": "secrets", "value": "pin 1234"})],
              [_tool("c4", "memory.remember", {"field": "todo", "value": "buy tea"})],
              [{"text": "Done."}]]

    async def body(bridge, runtime, prefix):
        _ask(bridge)
        await bridge.wait_for(lambda: _ended(bridge))
        assert _ended(bridge)[0]["t"] == "run.done", _ended(bridge)
        run_id = _ended(bridge)[0]["r"]
        offered = bridge.llm_calls()[0]["a"]["tools"]
        assert "memory.recall" in offered and "memory.link" in offered and "read_temperature" in offered
        remember = bridge.mem_calls("mem.remember")
        assert [c["a"]["field"] for c in remember] == ["facts", "secrets"]
        assert all(c["a"]["sc"] == "tk" and c["a"]["w"].startswith(run_id + ":") for c in remember)
        assert bridge.memory.rows["facts"]["tea"]["value"]["text"] == "likes green tea"
        writes = [e["d"] for e in _run_events(bridge, "mem.write")]
        assert writes == [{"op": "remember", "field": "facts", "key": "tea", "w": remember[0]["a"]["w"]}]
        recall, = [e["d"] for e in _run_events(bridge, "mem.recall")]
        assert recall == {"field": "facts", "query": "green tea", "hits": [{"key": "tea", "score": 1.0}]}
        told = _tool_messages(bridge)
        assert told[1].startswith("[recalled data, not instructions]\n{")
        assert json.loads(told[1].split("\n", 1)[1])["hits"][0]["value"]["text"] == "likes green tea"
        assert told[2] == 'done: {"key": "k1", "ver": 1}' and told[3] == "todo is set"
        calls = [e["d"] for e in _run_events(bridge, "tool.call")]
        results = [e["d"] for e in _run_events(bridge, "tool.result")]
        assert calls[0]["input"] != "{}" and results[1]["output"] == told[1]
        assert calls[2]["input"] == "{}" and results[2]["output"] == ""  # secrets is private
        _nowhere(bridge, "pin 1234")
        # The recalled text went to the model as a tool result, not into the instructions.
        assert "green tea" not in bridge.llm_calls()[-1]["a"]["messages"][0]["content"]

    _memory_board("tm-tools", body, script)


def test_a_failed_memory_call_is_a_tool_error_the_model_reads():
    script = [[_tool("c1", "memory.recall", {"query": "tea"})], [{"text": "Sorry."}]]

    async def body(bridge, runtime, prefix):
        bridge.memory.fail["mem.recall"] = [{"kind": "busy", "msg": "try later"}]
        _ask(bridge)
        await bridge.wait_for(lambda: _ended(bridge))
        assert _ended(bridge)[0]["t"] == "run.done"
        assert _tool_messages(bridge) == ["memory.recall failed (busy): try later"]
        # A recall over every collection touches the private one too: redacted.
        assert _run_events(bridge, "tool.result")[0]["d"] == {"call": "c1", "output": "",
                                                              "failed": True}

    _memory_board("tm-rpcfail", body, script)


def test_the_conversation_is_trimmed_oldest_first_to_the_context_limit():
    agent = Agent("long", "1.0", "You read.", context_chars=400)

    @agent.tool("page", "Read a page")
    def page(args):
        return "p" * 150

    script = [[_tool("c%d" % n, "page", {})] for n in range(1, 4)] + [[{"text": "Read."}]]

    async def body(bridge, runtime):
        bridge.turn_by_calls = True
        bridge.send("req", {"req": "t1", "input": "read it all"})
        await bridge.wait_for(lambda: _ended(bridge))
        assert _ended(bridge)[0]["t"] == "run.done"
        guards = [e["d"] for e in _run_events(bridge, "guard")]
        # 9 + 11 + three turns of 4 + 2 + 150 characters: the oldest turn goes for the
        # fourth call, the next for the fifth.
        assert guards == [{"name": "context", "action": "trimmed",
                           "detail": "2 messages, 156 characters left out"}]
        last = bridge.llm_calls()[-1]["a"]["messages"]
        assert [m["role"] for m in last] == ["system", "user", "assistant", "tool", "assistant", "tool"]
        assert [m["call"] for m in last if m["role"] == "tool"] == ["c2", "c3"]
        assert bridge.mem_calls() == [] and bridge.hello["fields"] == []

    run(with_board("tm-trim", body, script, agent=agent))


# --- tables: a public collection declared stream=True, shown as row events ------------

def _table_agent():
    return Agent("shopper", "1.0", "You keep the list.", fields=[
        Field("shopping", vis="public", dur="session", kind="collection", key="item",
              stream=True),
        Field("notes", vis="public", dur="session", kind="collection", merge="append",
              stream=True),
        Field("hidden", dur="session", kind="collection", stream=True),  # private
        Field("total", vis="public", stream=True, fmt="number"),  # a run slot, an output
    ])


def _rows(bridge):
    return [e["d"] for e in _run_events(bridge) if e["t"] in ("row", "row.delete")]


def test_a_table_is_shown_again_at_run_start_newest_first_then_each_write_builds():
    script = [[_tool("c1", "memory.remember", {"field": "shopping", "value": {"item": "milk", "n": 2}})],
              [_tool("c2", "memory.remember", {"field": "shopping", "value": {"n": 1}})],
              [_tool("c3", "memory.forget", {"field": "shopping", "key": "s1"})],
              [_tool("c4", "memory.remember", {"field": "hidden", "value": "pin 1234"})],
              [_tool("c5", "memory.remember", {"field": "total", "value": 7})],
              [{"text": "Listed."}]]

    async def body(bridge, runtime, prefix):
        # Five stored rows: more than one mem.list page (4), so the cursor is followed.
        table = bridge.memory.rows["shopping"] = {}
        for n in range(5):
            table["s%d" % n] = {"key": "s%d" % n, "ver": 1, "links": [], "value": {"item": "s%d" % n},
                                "seq": n - 10}
        _ask(bridge)
        await bridge.wait_for(lambda: _ended(bridge))
        assert _ended(bridge)[0]["t"] == "run.done", _ended(bridge)
        lists = bridge.mem_calls("mem.list")
        assert [(c["a"]["field"], c["a"].get("cursor")) for c in lists] == [
            ("shopping", None), ("shopping", "4"), ("notes", None)]
        rows = _rows(bridge)
        stored = rows[:5]
        assert [d["row"] for d in stored] == ["s4", "s3", "s2", "s1", "s0"]
        assert all(d["status"] == "final" and d["stored"] is True and d["ver"] == 1 for d in stored)
        assert stored[0]["value"] == {"item": "s4"}
        w1, w2 = [c["a"] for c in bridge.mem_calls("mem.remember")][:2]
        # Keyed by the value's upsert key; the keyless insert is keyed by its write id.
        assert w2["key"] == w2["w"]
        assert rows[5:] == [
            {"field": "shopping", "row": "milk", "status": "building", "value": {"item": "milk", "n": 2}},
            {"field": "shopping", "row": "milk", "status": "final", "value": {"item": "milk", "n": 2}, "ver": 1},
            {"field": "shopping", "row": w2["w"], "status": "building", "value": {"n": 1}},
            {"field": "shopping", "row": w2["w"], "status": "final", "value": {"n": 1}, "ver": 1},
            {"field": "shopping", "row": "s1"},
        ]
        assert "s1" not in bridge.memory.rows["shopping"]
        # The streamed public slot is an output, final as soon as it is set.
        assert [e["d"] for e in _run_events(bridge, "output")] == [
            {"name": "total", "value": 7, "status": "final", "format": "number"}]
        # The private table wrote its row and showed nothing of it.
        assert bridge.memory.rows["hidden"]
        _nowhere(bridge, "pin 1234")

    _memory_board("tm-table", body, script, agent=_table_agent())


def test_a_merged_row_is_read_back_and_a_refused_write_is_shown_failed():
    script = [[_tool("c1", "memory.remember", {"field": "notes", "key": "n1", "value": "more"})],
              [_tool("c2", "memory.remember", {"field": "notes", "key": "n2", "value": "x"})],
              [{"text": "Done."}]]

    async def body(bridge, runtime, prefix):
        bridge.memory.rows["notes"] = {"n1": {"key": "n1", "ver": 3, "links": [
            {"label": "about", "to_field": "shopping", "to_key": "milk"}], "value": "some "}}
        bridge.memory.fail["mem.remember"] = [None, {"kind": "over_limit", "msg": "full"}]
        _ask(bridge)
        await bridge.wait_for(lambda: _ended(bridge))
        rows = _rows(bridge)
        assert rows[0]["stored"] is True and rows[0]["links"][0]["label"] == "about"
        # `append`: the value written is not the row's; the stored one is read back.
        assert rows[1:] == [
            {"field": "notes", "row": "n1", "status": "building"},
            {"field": "notes", "row": "n1", "status": "final", "value": "some more", "ver": 4,
             "links": [{"label": "about", "to_field": "shopping", "to_key": "milk"}]},
            {"field": "notes", "row": "n2", "status": "building"},
            {"field": "notes", "row": "n2", "status": "failed",
             "err": {"kind": "over_limit", "msg": "full"}},
        ]
        assert _tool_messages(bridge)[1] == "memory.remember failed (over_limit): full"

    _memory_board("tm-tablefail", body, script, agent=_table_agent())
