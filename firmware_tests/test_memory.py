# Declared fields, durable run state, core memory and the memory tools, over a real broker
# on both runtimes: the scripted bridge (firmware_tests/scripted_bridge.py) answers the
# state, core and mem calls from an in-memory table the tests read back.
from edge_runtime.agent import Agent, RunFailed
from edge_runtime.fields import Field
from firmware_tests.scripted_bridge import device_errors, with_board
from firmware_tests.support import run


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


def test_a_scope_ticket_that_is_not_a_string_is_refused():
    async def body(bridge, runtime):
        bridge.send("req", {"req": "bad-sc", "input": "x", "sc": 5})
        await bridge.wait_for(lambda: device_errors(bridge))
        assert device_errors(bridge)[0]["kind"] == "bad_envelope"

    run(with_board("tm-badsc", body, agent=_state_agent(_bump)))
