"""The greenhouse example (examples/greenhouse/) end to end: its main.py on the
MicroPython unix port at the demo's 128K heap (.mpy), a real Mosquitto, the real bridge
playing the example's script.json, and the example's own host (host.py) answering the
gardener's question and approving the valve. What a host sees: the handler's node and
the edge it took, the model loop's steps and tools, the waiting calls' nodes across the
pause, and the run done within its budget."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path
from types import ModuleType

from tests.stack import Stack

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "greenhouse"


def _host() -> ModuleType:
    spec = importlib.util.spec_from_file_location("greenhouse_host", EXAMPLE / "host.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_greenhouse_waters_a_dry_bed_after_a_yes_and_an_answer(tmp_path: Path) -> None:
    host = _host()
    asked: list[tuple[str, str]] = []
    out = io.StringIO()
    # What the host had printed when it asked: a prompt comes once the run has paused.
    printed: list[str] = []

    def decide(kind: str, name: str, args: str) -> tuple[bool, str]:
        asked.append((kind, name))
        printed.append(out.getvalue())
        return True, "no feeding today"

    with Stack(
        tmp_path,
        main_py=(EXAMPLE / "main.py").read_text(),
        bridge_args=["--script", str(EXAMPLE / "script.json")],
        heap="144K",
    ) as s:
        assert s.client is not None
        snap = host.run_once(s.client, s.device, s.token, host.REQUEST, decide, out)
        assert snap.status == "done" and snap.complete, (snap.error, s.describe())
        assert sorted(asked) == [("approval", "open_valve"), ("tool", "ask_gardener")]
        # Both asked at the pause, before either answer went out (nothing printed between).
        assert printed[0] == printed[1] and printed[0].splitlines()[-1].startswith("run.paused")
        # The handler's node, the way it went, and the model loop's nodes after it.
        assert {p: (n.activations, n.status) for p, n in snap.nodes.items()} == {
            "/sense": (1, "completed"),
            "/model": (3, "completed"),
            "/tool/read_moisture": (1, "completed"),
            "/tool/open_valve": (1, "completed"),
            "/tool/ask_gardener": (1, "completed"),
        }
        assert snap.nodes["/sense"].port == "dry" and snap.nodes["/model"].port == "done"
        assert snap.edges == {("/sense", "dry", "/model"): 1}
        assert snap.nodes["/model"].usage.tokens_out > 0 and snap.active == []
        # 7 steps of a budget of 12: no warning; the valve ran once, after its yes.
        assert snap.budgets == {}
        assert s.console_count("valve 2 open for 10 min", 1) == 1
        text = "".join(r.text for r in snap.rows if r.kind == "assistant")
        # The host approved first, then answered: the answer is the last tool output.
        assert text.endswith("Bed 2 is being watered. The gardener says: no feeding today")
        # What the host prints as the answer: the run's three messages, apart.
        assert host.answer_text(snap) == (
            "Bed 2 looks dry; let me read every bed.\n\n"
            "Bed 2 is at 18 %. I will water it for 10 minutes, and ask about feeding.\n\n"
            "Bed 2 is being watered. The gardener says: no feeding today"
        )
        # The host's log of the run: what a dashboard draws.
        lines = out.getvalue().splitlines()
        assert lines[:3] == [
            "  > /sense#1 (sensor)",
            "  < /sense#1 completed -> dry",
            "  edge /sense --dry--> /model",
        ]
        # One pause for both calls, their nodes open across it, one resume.
        ends = [line.split()[0] for line in lines if line.startswith("run.")]
        assert ends == ["run.paused", "run.resumed", "run.done"]
        paused = lines.index(next(line for line in lines if line.startswith("run.paused")))
        assert lines[paused - 4 : paused] == [
            '    tool open_valve {"bed": "2", "minutes": 10} (answered by the board)',
            "    open_valve waits for approval",
            "  > /tool/ask_gardener#1 (tool)",
            "    tool ask_gardener "
            '{"q": "Feed the tomatoes in bed 2 as well?"} (answered by the host)',
        ]
