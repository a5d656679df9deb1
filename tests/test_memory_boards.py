"""Memory end to end, as users meet it: the demo thermostat (the board's real code on the
MicroPython unix port, 128K heap) remembers a user's usual temperature in one request,
and another board of the same tenant and agent uses it in a later one; another user's
request on that board finds nothing of it. Real Mosquitto, the real bridge service with
its memory, the scripted model."""

from __future__ import annotations

import json
import time
from pathlib import Path

from server_bridge.host.reducer import RunSnapshot
from server_bridge.registry import Registry
from server_bridge.tokens import sign
from tests.model_server import ModelServer, ToolCall, Turn
from tests.stack import TENANT, Stack, counters
from tests.waiting import wait_for
from tools.virtual_board import VirtualBoard, lay_out_flash

REMEMBER = "Make it 22 °C, and remember that is my usual."
USE = "Set it to my usual."
SECOND = "thermo2"


def calls(snap: RunSnapshot, name: str) -> list[tuple[str | None, object, bool]]:
    """(input, the result's output, failed) of each call of tool `name`, in order."""
    results = {r.call: r for r in snap.rows if r.kind == "tool_result"}
    out = []
    for row in snap.rows:
        if row.kind == "tool_call" and row.name == name:
            res = results.get(row.call)
            out.append((row.input, res.output if res else None, res.failed if res else True))
    return out


def test_a_users_usual_temperature_follows_them_to_another_board(tmp_path: Path) -> None:
    stats = tmp_path / "stats.prom"
    bridge_args = ["--stats-file", str(stats), "--stats-every", "0.2"]
    with Stack(tmp_path, extra_users={SECOND: "device"}, heap="128K", bridge_args=bridge_args) as s:
        first = s.ask(REMEMBER)
        assert first.status == "done", s.describe()
        assert calls(first, "memory.remember") == [
            ('{"field": "usual_celsius", "value": 22}', "usual_celsius is set", False)
        ]
        # The first board goes; a second board of the same tenant and agent comes.
        s.stop_board()
        settings = json.loads((s.flash / "settings.json").read_text())
        settings.update(device=SECOND, user=SECOND, password=s.users[SECOND])
        flash = lay_out_flash(tmp_path / "flash2", settings, mpy=True)
        s.board = VirtualBoard(flash, heap=s.heap)
        hellos = counters(stats).get("wren_hello_total", 0)
        s.start_board()
        assert s.client is not None
        # Once the bridge has the second board's status and hello (right behind its
        # start a request would go without state, as a first one after a start does).
        wait_for(lambda: counters(stats).get("wren_hello_total", 0) > hellos, "its hello")
        req = s.client.request(SECOND, s.token, USE)
        used = s.wait_run(req)
        assert used.status == "done", s.describe()
        (loaded,) = calls(used, "memory.load")
        assert "usual_celsius: 22" in str(loaded[1]) and "[recalled data" in str(loaded[1])
        assert calls(used, "set_temperature") == [('{"celsius": 22}', "set to 22 °C", False)]
        # Another user of the tenant asking the same board has no usual: nothing of the
        # first user's memory reaches their run.
        with Registry(s.registry_path) as registry:
            secret = registry.tenant_secret(TENANT)
        assert secret is not None
        other = sign(bytes.fromhex(secret), TENANT, "someone-else")
        snap = s.wait_run(s.client.request(SECOND, other, USE))
        ended_ns = time.time_ns()
        (loaded,) = calls(snap, "memory.load")
        assert "usual_celsius: null" in str(loaded[1])
        ((given, _, failed),) = calls(snap, "set_temperature")
        assert given == '{"celsius": null}' and failed
        # A run whose req brought its state asks for none: the second, the usual as the
        # first run left it. The first went before the bridge held that user's memory
        # (it reads no file on its network thread) and so did the third, another user's:
        # their runs loaded it.
        # From a snapshot the bridge made once the last run had ended: one written
        # during that run (they come every 0.2 s, and a run can be quicker) can hold its
        # request but not yet its state.load (a CI rehearsal read 1 so). The second file
        # written after the end, as the first may hold counters taken just before it.
        wait_for(lambda: stats.stat().st_mtime_ns > ended_ns, "a snapshot after the runs")
        first_ns = stats.stat().st_mtime_ns
        wait_for(lambda: stats.stat().st_mtime_ns > first_ns, "the next snapshot")
        got = counters(stats)
        assert got.get("wren_host_req_unseeded_total") == 2, got
        assert got.get("wren_host_req_seeded_total") == 1, got
        assert got.get("wren_rpc_calls_state_load_total") == 2, got


# A shopping list: a public table of the conversation whose rows hosts see build.
SHOPPER = """\
from edge_runtime import board
from edge_runtime.agent import Agent
from edge_runtime.fields import Field

agent = Agent("shopper", "1.0", "You keep the user's shopping list.", fields=[
    Field("shopping", vis="public", dur="session", kind="collection", key="item",
          stream=True)])
board.start(agent)
"""


def _remember(item: str, n: int) -> ToolCall:
    args = {"field": "shopping", "value": {"item": item, "n": n}}
    return ToolCall("memory.remember", json.dumps(args))


def test_a_table_builds_on_the_host_and_is_there_again_when_the_conversation_reopens(
    tmp_path: Path,
) -> None:
    # The model streams its tool arguments three characters at a time, as real ones
    # fragment them; the board runs at the demo's 128K from .mpy.
    script = [
        Turn(tool_calls=[_remember("milk", 2), _remember("eggs", 12)], args_chunk_chars=3),
        Turn(text="Milk and eggs are on the list."),
    ]
    with (
        ModelServer(script) as server,
        Stack(tmp_path, model_url=server.url, main_py=SHOPPER, heap="128K") as s,
    ):
        first = s.wait_run(s.request("Put milk and eggs on my list.", conv="list-1"))
        assert first.status == "done", s.describe()
        built = [(r.key, r.status, r.output, r.ver) for r in first.table("shopping")]
        assert built == [
            ("eggs", "final", {"item": "eggs", "n": 12}, 1),
            ("milk", "final", {"item": "milk", "n": 2}, 1),
        ]
        # The same conversation again: the table as stored is shown before anything else
        # happens, newest first, and an edit of a stored row moves it to the top.
        server.override_next(
            Turn(tool_calls=[_remember("milk", 3)], args_chunk_chars=3),
            Turn(text="Three milks now."),
        )
        second = s.wait_run(s.request("Make it three milks.", conv="list-1"))
        assert second.status == "done", s.describe()
        rows = [(r.key, r.status, r.output, r.ver, r.stored) for r in second.table("shopping")]
        assert rows == [
            ("milk", "final", {"item": "milk", "n": 3}, 2, False),
            ("eggs", "final", {"item": "eggs", "n": 12}, 1, True),
        ]
        # Another conversation has a table of its own.
        server.override_next(Turn(text="Your list is empty."))
        other = s.wait_run(s.request("What is on my list?", conv="list-2"))
        assert other.table("shopping") == []
