"""The two snapshot reducers, server_bridge/host/reducer.py and its JavaScript twin
reducer.mjs, against the recorded event streams of tests/fixtures/streams/: each must
give the fixture's expected snapshots, byte for byte once canonical. The expectations
are written once by tests/fixtures/streams/build.py and reviewed, so either reducer
drifting from them fails here. Also: delivery states, composite rows and windows."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from edge_runtime.events import MAX_ID
from server_bridge.host import reducer as py
from server_bridge.host.reducer import Reducer, composites, window_rows
from server_bridge.http.views import snapshot_json
from tests.eventdata import ev
from tests.fixtures.streams.build import fold

ROOT = Path(__file__).resolve().parent.parent
STREAMS = ROOT / "tests" / "fixtures" / "streams"
FIXTURES = sorted(STREAMS.glob("*.json"))
DRIVER = ROOT / "tests" / "js" / "reduce_fixtures.mjs"
# (limit, before) pairs each run's rows are read with; the same as the driver's WINDOWS.
WINDOWS = [(2, None), (3, 1), (0, None), (100, 5), (1, 0), (4, 1000)]


def js_number(x: float) -> str:
    """A float as JavaScript's Number#toString writes it: JSON has one kind of number,
    so 2.0 is `2` on both sides, and 1e-05 is `0.00001`. Digits from repr, the shortest
    that reads back the same, which is what JavaScript prints too."""
    if not math.isfinite(x):
        raise ValueError(f"no JSON for {x}")
    if x == 0:
        return "0"
    mantissa, _, exp = repr(abs(x)).partition("e")
    whole, _, frac = mantissa.partition(".")
    both = whole + frac
    digits = both.lstrip("0")
    # The value is 0.<digits> x 10**n.
    n = len(whole) + int(exp or 0) - (len(both) - len(digits))
    digits = digits.rstrip("0")
    k = len(digits)
    if k <= n <= 21:
        text = digits + "0" * (n - k)
    elif 0 < n <= 21:
        text = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        text = "0." + "0" * -n + digits
    else:
        e = n - 1
        text = (
            digits[0] + ("." + digits[1:] if k > 1 else "") + f"e{'+' if e >= 0 else '-'}{abs(e)}"
        )
    return ("-" if x < 0 else "") + text


def canonical(value: Any) -> str:
    """json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=False), but with
    floats written as JavaScript writes them (js_number)."""
    if isinstance(value, float):
        return js_number(value)
    if isinstance(value, dict):
        items = sorted(value.items())
        return (
            "{"
            + ",".join(f"{json.dumps(k, ensure_ascii=False)}:{canonical(v)}" for k, v in items)
            + "}"
        )
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(canonical(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def node() -> str:
    exe = shutil.which("node")
    if exe is None:
        pytest.skip("node is not installed")
    return exe


@pytest.fixture(scope="module")
def js_out() -> dict[str, dict[str, str]]:
    """What reducer.mjs makes of every fixture, by file name (one node process)."""
    done = subprocess.run(
        [node(), str(DRIVER), *map(str, FIXTURES)],
        capture_output=True, text=True, encoding="utf-8", timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    return {Path(line["file"]).name: line for line in lines}


def test_there_are_fixtures_of_every_kind() -> None:
    names = {p.stem for p in FIXTURES}
    assert {"real_demo_tool_round_trip", "real_greenhouse_pause", "real_nodes_composites",
            "holes_filled_out_of_order", "declared_gaps", "duplicate_replays", "tables",
            "nodes_missing_evidence", "cancelled_pause_deliveries"} <= names  # fmt: skip


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_python_reducer_gives_the_expected_snapshots(path: Path) -> None:
    fixture = load(path)
    assert canonical(fold(fixture)) == canonical(fixture["expected"])


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_javascript_reducer_gives_the_same_bytes(path: Path, js_out: dict[str, Any]) -> None:
    fixture = load(path)
    got = js_out[path.name]
    assert got["out"] == canonical(fixture["expected"])
    windows = {
        run: [window_rows(view, limit, before) for limit, before in WINDOWS]
        for run, view in fixture["expected"]["runs"].items()
    }
    assert got["windows"] == canonical(windows)


def test_the_limits_are_the_same_on_both_sides() -> None:
    done = subprocess.run([node(), str(DRIVER), "--limits"], capture_output=True, text=True,
                          timeout=30, check=True)  # fmt: skip
    assert json.loads(done.stdout) == {
        "MAX_ID": MAX_ID,
        "MAX_ERRORS": py.MAX_ERRORS,
        "MAX_HELD": py.MAX_HELD,
        "STREAM_SEEN": py._STREAM_SEEN,
        "MAX_NODES": py.MAX_NODES,
        "MAX_ACTS": py.MAX_ACTS,
        "MAX_TABLE_ROWS": py.MAX_TABLE_ROWS,
        "MAX_CITATIONS": py.MAX_CITATIONS,
        "MAX_ERROR_MSG": py._MAX_ERROR_MSG,
    }


@pytest.mark.parametrize(
    ("x", "text"),
    [(2.0, "2"), (0.5, "0.5"), (-1.25, "-1.25"), (1e-05, "0.00001"), (1e-07, "1e-7"),
     (1.5e-07, "1.5e-7"), (1e16, "10000000000000000"), (1.2345678901234567e19,
     "12345678901234567000"), (1e21, "1e+21"), (2.5e22, "2.5e+22"), (0.1 + 0.2,
     "0.30000000000000004"), (123.456, "123.456"), (-0.0, "0")],
)  # fmt: skip
def test_floats_are_written_as_javascript_writes_them(x: float, text: str) -> None:
    assert js_number(x) == text


# --- delivery -------------------------------------------------------------------------


def paused(client: bool = True) -> Reducer:
    reducer = Reducer()
    reducer.apply(ev(1, "run.started", input="hi"))
    if client:
        reducer.apply(ev(2, "tool.call", call="c1", name="ask", input="{}", client=True))
    else:
        reducer.apply(ev(2, "tool.call", call="c1", name="valve", input="{}", client=False))
        reducer.apply(ev(3, "approval.request", call="c1", name="valve"))
    return reducer


def delivery(reducer: Reducer) -> str | None:
    snap = reducer.get("r1")
    assert snap is not None
    return next(r.delivery for r in snap.rows if r.kind == "tool_call")


@pytest.mark.parametrize("client", [True, False])
def test_a_call_a_host_answers_goes_pending_submitting_submitted(client: bool) -> None:
    reducer = paused(client)
    assert delivery(reducer) == "pending"
    assert reducer.set_delivery("r1", "c1", "submitting") and delivery(reducer) == "submitting"
    assert reducer.set_delivery("r1", "c1", "failed") and delivery(reducer) == "failed"
    answer = (ev(3, "tool.result", call="c1", output="ok") if client
              else ev(4, "approval.granted", call="c1", name="valve", by="alice"))  # fmt: skip
    reducer.apply(answer)
    assert delivery(reducer) == "submitted"
    # The board's word outranks the host's: a late failure changes nothing.
    assert reducer.set_delivery("r1", "c1", "failed") and delivery(reducer) == "submitted"
    assert snapshot_json(reducer.get("r1"))["rows"][1]["delivery"] == "submitted"  # type: ignore[arg-type]


def test_the_runs_end_cancels_what_had_not_reached_the_board() -> None:
    reducer = paused()
    reducer.set_delivery("r1", "c1", "submitting")
    reducer.apply(ev(3, "run.failed", err={"kind": "timeout", "msg": "waited too long"}))
    assert delivery(reducer) == "cancelled"
    assert reducer.set_delivery("r1", "c1", "submitted") and delivery(reducer) == "cancelled"


def test_delivery_refuses_unknown_states_and_says_what_it_does_not_hold() -> None:
    reducer = paused()
    with pytest.raises(ValueError, match="delivery state"):
        reducer.set_delivery("r1", "c1", "sent")
    assert not reducer.set_delivery("r2", "c1", "submitting")
    assert not reducer.set_delivery("r1", "c2", "submitting")
    reducer.apply(ev(3, "tool.call", call="local", name="read", input="{}", client=False))
    assert not reducer.set_delivery("r1", "local", "submitting")  # no host answers it
    assert py.DELIVERY_STATES == ("pending", "submitting", "submitted", "failed", "cancelled")


# --- composites and windows -----------------------------------------------------------


def test_composites_of_the_recorded_handler() -> None:
    fixture = load(STREAMS / "real_nodes_composites.json")
    (view,) = (v for v in fixture["expected"]["runs"].values() if v["req"])
    by_type = {c["type"]: c for c in view["composites"]}
    fan = by_type["fanout"]
    assert (fan["key"], fan["status"]) == ("fanout:/plan#1", "completed")
    assert [(t["node"], t["status"]) for t in fan["tracks"]] == [
        ("/plan/search", "completed"), ("/plan/rank", "completed"), ("/plan/check", "failed")
    ]  # fmt: skip
    texts = [view["rows"][i].get("text") for i in fan["rows"]]
    assert texts == ["branch search done", "branch rank done"]
    sub = by_type["subagent"]
    assert (sub["key"], sub["counts"]) == (
        "subagent:/research#1",
        {"running": 0, "done": 2, "failed": 0},
    )
    assert [view["rows"][i]["kind"] for i in sub["rows"]] == [
        "tool_call",
        "tool_result",
        "assistant",
    ]
    rep = by_type["repeat"]
    assert rep["key"] == "repeat:/poll" and [t["k"] for t in rep["tracks"]] == [1, 2, 3]
    assert [view["rows"][t["rows"][0]]["text"] for t in rep["tracks"]] == [
        "reading 1", "reading 2", "reading 3"
    ]  # fmt: skip


def test_the_model_loop_repeats_by_step_with_its_tools() -> None:
    fixture = load(STREAMS / "real_greenhouse_pause.json")
    (view,) = (v for v in fixture["expected"]["runs"].values() if v["req"])
    (rep,) = view["composites"]
    assert rep["key"] == "repeat:/model" and rep["status"] == "completed"
    steps = [[n["node"] for n in t["nodes"]] for t in rep["tracks"]]
    assert steps == [["/model", "/tool/read_moisture"],
                     ["/model", "/tool/open_valve", "/tool/ask_gardener"], ["/model"]]  # fmt: skip
    # The approval's and the client tool's results sit in their own calls' nodes.
    for row in view["rows"]:
        if row["kind"] in ("tool_call", "tool_result"):
            assert row["node"] == f"/tool/{row['name']}", row


def test_no_node_evidence_no_composites() -> None:
    reducer = Reducer()
    for e in [ev(1, "run.started", input="hi"), ev(2, "msg.delta", m=1, text="hello"),
              ev(3, "run.done")]:  # fmt: skip
        reducer.apply(e)
    snap = reducer.get("r1")
    assert snap is not None and composites(snap) == [] and snapshot_json(snap)["composites"] == []
    assert all("node" not in row for row in snapshot_json(snap)["rows"])


def test_composites_keep_their_keys_as_the_run_goes_on() -> None:
    fixture = load(STREAMS / "real_nodes_composites.json")
    reducer = Reducer()
    first_seen: dict[str, int] = {}
    for n, step in enumerate(fixture["steps"]):
        snap = reducer.apply(step["event"])
        for c in composites(snap):
            first_seen.setdefault(c["key"], n)
    final = [c["key"] for c in composites(snap)]
    assert sorted(first_seen) == sorted(final)  # none came and went


def test_window_rows_reads_from_the_tail() -> None:
    view = {"rows": [{"i": n} for n in range(5)]}
    assert window_rows(view, 2) == {"rows": [{"i": 3}, {"i": 4}], "from": 3, "hasEarlier": True}
    assert window_rows(view, 2, before=3) == {
        "rows": [{"i": 1}, {"i": 2}],
        "from": 1,
        "hasEarlier": True,
    }
    assert window_rows(view, 10, before=2) == {
        "rows": [{"i": 0}, {"i": 1}],
        "from": 0,
        "hasEarlier": False,
    }
    assert window_rows(view, 0) == {"rows": [], "from": 5, "hasEarlier": True}
    assert window_rows({"rows": []}, 3) == {"rows": [], "from": 0, "hasEarlier": False}
    with pytest.raises(ValueError):
        window_rows(view, -1)


def test_activations_past_the_bound_leave_their_rows_flat() -> None:
    reducer = Reducer()
    reducer.apply(ev(1, "run.started", input="hi"))
    i = 1
    for a in range(1, py.MAX_ACTS + 3):
        i += 1
        reducer.apply({**ev(i, "node.start"), "n": "/step", "a": a, "k": a})
        i += 1
        reducer.apply(ev(i, "msg.delta", m=a, text="x"))
        i += 1
        reducer.apply({**ev(i, "node.end", status="completed"), "n": "/step", "a": a})
    snap = reducer.get("r1")
    assert snap is not None and snap.nodes_dropped == 2
    assert [r.act for r in snap.rows[-3:]] == [py.MAX_ACTS, None, None]
    (rep,) = composites(snap)
    assert len(rep["tracks"]) == py.MAX_ACTS
