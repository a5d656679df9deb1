"""Runs that pause, end to end (PROTOCOL.md "Runs that pause"): the board's real code on
the MicroPython unix port at the demo's 128K heap (.mpy), a real Mosquitto, the real
bridge service, an OpenAI-compatible model server streaming fragmented tool arguments,
and the host client. A run waits on a client tool and an approval while the board is
killed and started again, or while the bridge is; the answers still finish it, each
event id once and each tool run once."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from edge_runtime.events import RING_BYTES
from server_bridge.host.reducer import RunSnapshot
from tests.model_server import ModelServer, ToolCall, Turn
from tests.stack import Stack, counters

# A valve keeper: reading the pressure is local, opening a valve needs a person's yes,
# and asking the user is the host app's.
VALVES = """\
from edge_runtime import board, platform
from edge_runtime.agent import Agent

agent = Agent("valves", "1.0", "You run the valves.")


@agent.tool("read_pressure", "Read the line pressure in bar")
def read_pressure(args):
    platform.log("tool read_pressure ran")
    return 2.5


@agent.tool("open_valve", "Open a valve", {"type": "object", "properties": {
    "valve": {"type": "integer"}}}, approval=True)
def open_valve(args):
    platform.log("tool open_valve ran", args.get("valve"))
    return "valve %s is open" % args.get("valve")


agent.tool("ask_user", "Ask the user a question", {"type": "object", "properties": {
    "q": {"type": "string"}}})(None)
board.start(agent)
"""


def _script() -> list[Turn]:
    calls = [
        ToolCall("read_pressure", "{}"),
        ToolCall("open_valve", json.dumps({"valve": 3})),
        ToolCall("ask_user", json.dumps({"q": "Vent the tank as well?"})),
    ]
    return [Turn(tool_calls=calls, args_chunk_chars=3), Turn(text="Valve 3 is open; venting.")]


def _paused(snap: RunSnapshot) -> bool:
    return snap.status == "paused" and len(snap.pending) == 2


def _ids_once(s: Stack, run: str) -> list[int]:
    assert s.client is not None
    return [e["i"] for e in s.client.events if e["r"] == run]


def _check_finished(s: Stack, snap: RunSnapshot, ran_before: int) -> None:
    assert snap.status == "done", (snap.error, s.describe())
    assert snap.complete, s.describe()
    results = {r.call: r for r in snap.rows if r.kind == "tool_result"}
    outputs = sorted(str(r.output) for r in results.values())
    assert outputs == ["2.5", "valve 3 is open", "yes, vent it"]
    # Each tool ran once: the local one before the pause, the approved one after it.
    assert s.console_count("tool read_pressure ran", 1) == 1
    assert s.console_count("tool open_valve ran", 1) == 1
    assert ran_before == 0  # nothing ran before its approval
    texts = [r.text for r in snap.rows if r.kind == "assistant"]
    assert texts[-1] == "Valve 3 is open; venting."


def test_a_board_killed_while_paused_resumes_and_finishes(tmp_path: Path) -> None:
    with (
        ModelServer(_script()) as server,
        Stack(tmp_path, model_url=server.url, main_py=VALVES, heap="128K") as s,
    ):
        assert s.client is not None
        req = s.request("Open valve 3.")
        snap = s.client.wait_for(req, _paused, 30)
        run = snap.run
        ran_before = "\n".join(s.console).count("tool open_valve ran")
        assert sorted(snap.pending) == ["call_1_1", "call_1_2"]
        # Power lost while it waits; the board comes back from the same flash.
        s.kill_board()
        s.start_board()
        again = s.client.wait_for(
            req, lambda x: x.status == "paused" and x.last_id > snap.last_id, 30
        )
        assert sorted(again.pending) == ["call_1_1", "call_1_2"]
        s.client.approve(s.device, s.token, run, "call_1_1", True)
        s.client.answer(s.device, s.token, run, "call_1_2", "yes, vent it")
        done = s.wait_run(req)
        _check_finished(s, done, ran_before)
        ids = _ids_once(s, run)
        assert sorted(set(ids)) == list(range(1, done.last_id + 1))
        approved = [r for r in done.rows if r.kind == "tool_call" and r.name == "open_valve"]
        assert approved[0].text.startswith("approved by ")
        assert len(server.requests) == 2  # the model was asked once before, once after


def test_a_bridge_restarted_while_paused_still_delivers_the_answers(tmp_path: Path) -> None:
    # 136K, not the demo's 128K: after a bridge restart the board takes the new
    # bridge's replay of the paused run (control and pause loaded, the checkpoint read)
    # and then the answers, and applying one at 128K ran out of memory in 1 CI run of
    # 3 (0 of 25 here; at 125K 1 of 6, at 122K 2 of 2). The margin is what the note on
    # issue 9 reports; the other pause tests run at 128K.
    with (
        ModelServer(_script()) as server,
        Stack(tmp_path, model_url=server.url, main_py=VALVES, heap="136K",
              bridge_args=["--stats-file", str(tmp_path / "stats.prom"),
                           "--stats-every", "0.2"]) as s,
    ):  # fmt: skip
        assert s.client is not None
        req = s.request("Open valve 3.")
        snap = s.client.wait_for(req, _paused, 30)
        s.kill_bridge()
        s.start_bridge()
        # The new bridge has not seen the run, so it does not know whose it is: its own
        # user's answer waits at the bridge while the board replays the run, whose
        # run.paused names its user (PROTOCOL.md "Who sees what"), and is then delivered.
        s.client.approve(s.device, s.token, snap.run, "call_1_1", True)
        s.client.answer(s.device, s.token, snap.run, "call_1_2", "yes, vent it")
        _check_finished(s, s.wait_run(req), 0)
        # Neither answer was refused: the owner's own, though the new bridge had not seen
        # the run (before, each was `forbidden` and the run stayed paused). Most often
        # both waited for the board to say whose run it is; when the board's resend of
        # what the old bridge had not acknowledged came first, the bridge knew already.
        refused = [e for e in s.client.events if e["r"] == "_b" and e["t"] == "error"]
        assert not refused, refused
        time.sleep(0.5)  # the stats file is written every 0.2 s
        waited = counters(tmp_path / "stats.prom").get("wren_host_ctl_awaiting_owner_total", 0)
        print(f"answers that waited for the run's user: {waited} of 2")


# "run <id> ended; heap free <n>": the board's line when a run leaves memory (paused or
# finished).
_HEAP_LINE = re.compile(r"run (\S+) ended; heap free (\d+)")

ASKER = """\
from edge_runtime import board
from edge_runtime.agent import Agent

agent = Agent("asker", "1.0", "You ask before you act.")
agent.tool("ask_user", "Ask the user a question", {"type": "object", "properties": {
    "q": {"type": "string"}}})(None)
board.start(agent)
"""


def test_fifty_runs_with_a_pause_each_leave_nothing_behind(tmp_path: Path) -> None:
    script = [
        Turn(tool_calls=[ToolCall("ask_user", json.dumps({"q": "Go on?"}))], args_chunk_chars=3),
        Turn(text="Done."),
    ]
    with (
        ModelServer(script) as server,
        Stack(tmp_path, model_url=server.url, main_py=ASKER, heap="128K") as s,
    ):
        assert s.client is not None
        for n in range(50):
            req = s.request(f"Job {n}")
            snap = s.client.wait_for(req, lambda x: x.status == "paused" and bool(x.pending), 30)
            (call,) = snap.pending
            s.client.answer(s.device, s.token, snap.run, call, f"go {n}")
            assert s.wait_run(req).status == "done", s.describe()

        # Two lines a run: when it paused and when it ended (the last may come just
        # after the host has run.done).
        def lines() -> dict[str, list[int]]:
            by_run: dict[str, list[int]] = {}
            for m in map(_HEAP_LINE.search, s.console):
                if m:
                    by_run.setdefault(m.group(1), []).append(int(m.group(2)))
            return by_run

        deadline = time.monotonic() + 20
        while not (len(lines()) == 50 and all(len(v) == 2 for v in lines().values())):
            assert time.monotonic() < deadline, s.describe()
            time.sleep(0.05)
        # The free heap after each run's end. The board's bounded tables fill over the
        # first runs (see tests/test_streams.py); from then on it is level, but for a
        # step or two of a few hundred bytes that test explains: within one ring's byte
        # budget, which thirty runs apart still shows 52 bytes a run.
        # The best of each window of four: a leak lowers every run's end, while what is
        # still waiting in the ring for the link's acks at a run's end depends on how
        # fast the bridge and broker take it (the medians moved 1.8 KiB once with the
        # suite on three workers on two cores).
        ends = [v[1] for v in lines().values()]
        settled, last = max(ends[16:20]), max(ends[46:50])
        assert last >= settled - RING_BYTES, (settled, last, ends)
        assert len(server.requests) == 100
