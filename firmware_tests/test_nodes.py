# Nodes (PROTOCOL.md "Nodes") on both runtimes, over a real broker: a handler of an
# app's own marks its steps with edge_runtime.nodes (paths, activations, iterations,
# edges, usage; a node that raises or is cancelled), hands its run to the model loop,
# which goes on counting; node paths are checked where they are written.
from edge_runtime import nodes, platform
from edge_runtime.agent import Agent
from edge_runtime.toolloop import model_loop
from firmware_tests.scripted_bridge import with_board
from firmware_tests.support import raises, run


def _marks(bridge, run_id):
    # The node-related events of a run: (type, n, a, k, d); k is None when absent.
    return [(e["t"], e.get("n"), e.get("a"), e.get("k"), e["d"]) for e in bridge.of_run(run_id)
            if e["t"] in ("node.start", "node.end", "edge", "usage")]


def _run_id(bridge):
    return [e for e in bridge.events if e["t"] == "run.started"][0]["r"]


def _ended(bridge):
    return [e for e in bridge.events if e["t"] in ("run.done", "run.failed", "run.cancelled")]


def test_node_paths_are_absolute_named_parts():
    for bad in ("plan", "/", "/plan/", "//plan", "/plan//search", "", None, 3, "/" + "x" * 128):
        raises(ValueError, nodes.check, bad)
    for good in ("/plan", "/plan/search", "/tool/memory.recall", "/" + "x" * 127):
        nodes.check(good)


def test_a_handler_marks_its_nodes_edges_and_usage():
    async def handle(run):
        async with nodes.Node(run, "/plan", "planner") as plan:
            plan.port = "search"
        await nodes.edge(run, "/plan", "search", "/search")
        for k in (1, 2):
            async with nodes.Node(run, "/search", k=k) as search:
                key = await nodes.start(run, "/search/fetch", "http")
                await nodes.usage(run, key, {"in": 7, "out": 3})
                await nodes.end(run, key, "completed", "found")
                search.port = "found" if k == 2 else "retry"
        try:
            async with nodes.Node(run, "/answer"):
                raise ValueError("no answer")
        except ValueError:
            pass
        return {"in": 14, "out": 6, "reason": 0}

    agent = Agent("planner", "1.0", "Plans.", handler=handle)

    async def body(bridge, runtime):
        bridge.send("req", {"req": "n1", "input": "find it"})
        await bridge.wait_for(lambda: _ended(bridge))
        assert _ended(bridge)[0]["t"] == "run.done"
        rid = _run_id(bridge)
        assert _marks(bridge, rid) == [
            ("node.start", "/plan", 1, None, {"kind": "planner"}),
            ("node.end", "/plan", 1, None, {"status": "completed", "port": "search"}),
            ("edge", None, None, None, {"from": "/plan", "port": "search", "to": "/search"}),
            ("node.start", "/search", 1, 1, {}),
            ("node.start", "/search/fetch", 1, None, {"kind": "http"}),
            ("usage", "/search/fetch", 1, None, {"in": 7, "out": 3, "reason": 0}),
            ("node.end", "/search/fetch", 1, None, {"status": "completed", "port": "found"}),
            ("node.end", "/search", 1, 1, {"status": "completed", "port": "retry"}),
            ("node.start", "/search", 2, 2, {}),
            ("node.start", "/search/fetch", 2, None, {"kind": "http"}),
            ("usage", "/search/fetch", 2, None, {"in": 7, "out": 3, "reason": 0}),
            ("node.end", "/search/fetch", 2, None, {"status": "completed", "port": "found"}),
            ("node.end", "/search", 2, 2, {"status": "completed", "port": "found"}),
            ("node.start", "/answer", 1, None, {}),
            ("node.end", "/answer", 1, None, {"status": "failed"}),
        ]
        events = bridge.of_run(rid)
        assert [e["i"] for e in events] == list(range(1, len(events) + 1))

    run(with_board("tn-marks", body, agent=agent))


def test_a_cancelled_run_ends_its_open_nodes_cancelled():
    async def handle(run):
        async with nodes.Node(run, "/wait"):
            async with nodes.Node(run, "/wait/sensor"):
                await platform.sleep_ms(10000)

    agent = Agent("waiter", "1.0", "Waits.", handler=handle)

    async def body(bridge, runtime):
        bridge.send("req", {"req": "n2", "input": "wait"})
        await bridge.wait_for(lambda: len(_marks_all(bridge)) == 2)
        rid = _run_id(bridge)
        bridge.send("ctl", {"op": "cancel", "r": rid, "reason": "enough"})
        await bridge.wait_for(lambda: _ended(bridge))
        assert _ended(bridge)[0]["t"] == "run.cancelled"
        assert _marks(bridge, rid)[2:] == [
            ("node.end", "/wait/sensor", 1, None, {"status": "cancelled"}),
            ("node.end", "/wait", 1, None, {"status": "cancelled"})]

    run(with_board("tn-cancel", body, agent=agent))


def _marks_all(bridge):
    return [e for e in bridge.events if e["t"].startswith("node.")]


def test_a_handler_hands_its_run_to_the_model_loop_which_goes_on_counting():
    script = [[{"tool": {"call": "c1", "name": "read_temperature", "input": "{}"}}],
              [{"text": "It is 21.5 C."}]]

    async def handle(run):
        async with nodes.Node(run, "/triage", "rule") as triage:
            triage.port = "model"
        # A node of the handler's own under the model loop's name: the loop counts on.
        key = await nodes.start(run, "/model", "warmup")
        await nodes.end(run, key)
        await nodes.edge(run, "/triage", "model", "/model")
        return await model_loop(run)

    agent = Agent("triage", "1.0", "Triage, then the model.", handler=handle)

    @agent.tool("read_temperature", "Read the room in C")
    def read_temperature(args):
        return 21.5

    async def body(bridge, runtime):
        bridge.send("req", {"req": "n3", "input": "how warm?"})
        await bridge.wait_for(lambda: _ended(bridge))
        assert _ended(bridge)[0]["t"] == "run.done"
        rid = _run_id(bridge)
        starts = [(n, a, k) for t, n, a, k, d in _marks(bridge, rid) if t == "node.start"]
        assert starts == [("/triage", 1, None), ("/model", 1, None), ("/model", 2, 1),
                          ("/tool/read_temperature", 1, 1), ("/model", 3, 2)]

    run(with_board("tn-handoff", body, script, agent=agent))
