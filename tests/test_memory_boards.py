"""Memory end to end, as users meet it: the demo thermostat (the board's real code on the
MicroPython unix port, 128K heap) remembers a user's usual temperature in one request,
and another board of the same tenant and agent uses it in a later one; another user's
request on that board finds nothing of it. Real Mosquitto, the real bridge service with
its memory, the scripted model."""

from __future__ import annotations

import json
from pathlib import Path

from server_bridge.host.reducer import RunSnapshot
from server_bridge.registry import Registry
from server_bridge.tokens import sign
from tests.stack import TENANT, Stack
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
    with Stack(tmp_path, extra_users={SECOND: "device"}, heap="128K") as s:
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
        s.start_board()
        assert s.client is not None
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
        (loaded,) = calls(snap, "memory.load")
        assert "usual_celsius: null" in str(loaded[1])
        ((given, _, failed),) = calls(snap, "set_temperature")
        assert given == '{"celsius": null}' and failed
