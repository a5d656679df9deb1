"""The terminal view: transcript lines and the live, incremental printer."""

from __future__ import annotations

import io
from typing import Any

from server_bridge.host.terminal import LiveView, print_transcript, render
from tests.eventdata import ev, fold


def full_run(run: str = "r1") -> list[dict[str, Any]]:
    return [
        ev(
            1,
            "run.started",
            run,
            agent="thermo",
            ver="1.0",
            req="q1",
            conv="c1",
            domain="request",
            input="How warm is it?",
        ),
        ev(2, "msg.start", run, m=1, role="assistant"),
        ev(3, "msg.delta", run, m=1, text="Let me "),
        ev(4, "msg.delta", run, m=1, text="check."),
        ev(5, "msg.end", run, m=1),
        ev(6, "tool.call", run, call="c-1", name="read_temperature", input="{}", client=False),
        ev(7, "tool.result", run, call="c-1", output="21.5", failed=False),
        ev(8, "msg.start", run, m=2, role="assistant"),
        ev(9, "msg.delta", run, m=2, text="It is "),
        ev(10, "msg.delta", run, m=2, text="21.5 °C."),
        ev(11, "msg.end", run, m=2),
        ev(12, "run.done", run, usage={"in": 12, "out": 8, "reason": 0}),
    ]


TRANSCRIPT = [
    "you: How warm is it?",
    "assistant: Let me check.",
    "tool call read_temperature {}",
    "tool result: 21.5",
    "assistant: It is 21.5 °C.",
    "status: done (in 12, out 8 tokens)",
]


def test_render_full_run() -> None:
    assert render(fold(full_run())) == TRANSCRIPT


def test_print_transcript_writes_the_rendered_lines() -> None:
    out = io.StringIO()
    print_transcript(fold(full_run()), out)
    assert out.getvalue() == "\n".join(TRANSCRIPT) + "\n"


def test_live_view_streams_text_and_ends_with_the_transcript() -> None:
    out = io.StringIO()
    view = LiveView(out)
    seen: list[str] = []
    for e in full_run():
        view.feed(e)
        seen.append(out.getvalue())
    # Streamed text appears as it arrives, on an open line ...
    assert seen[2] == "you: How warm is it?\nassistant: Let me "
    assert seen[3] == "you: How warm is it?\nassistant: Let me check."
    # ... which msg.end closes.
    assert seen[4].endswith("assistant: Let me check.\n")
    view.close()
    assert out.getvalue() == "\n".join(TRANSCRIPT) + "\n"


def test_live_view_ignores_duplicates_and_replays() -> None:
    out = io.StringIO()
    view = LiveView(out)
    events = full_run()
    for e in events:
        view.feed(e)
        view.feed(e)
    for e in events:
        view.feed(e)
    assert out.getvalue() == "\n".join(TRANSCRIPT) + "\n"


def test_live_view_pause_failure_and_errors() -> None:
    out = io.StringIO()
    view = LiveView(out)
    for e in [
        ev(1, "run.started", input="Water the plants?"),
        ev(2, "tool.call", call="k1", name="confirm", input='{"q":"ok?"}', client=True),
        ev(3, "run.paused", reason="client", calls=["k1"]),
        ev(4, "run.resumed", ckpt=2),
        ev(5, "tool.result", call="k1", output="yes", failed=False),
        # Ids 6 and 7 are lost; the report of it comes after them, numbered past them.
        ev(8, "error", kind="gap", msg="events 6..7 are no longer held", **{"from": 6, "to": 7}),
        ev(
            9,
            "run.failed",
            err={"kind": "llm", "msg": "the model server failed", "detail": "secret"},
            retryable=True,
        ),
    ]:
        view.feed(e)
    view.close()
    assert out.getvalue().splitlines() == [
        "you: Water the plants?",
        'tool call confirm {"q":"ok?"} (client)',
        "status: paused (waiting on confirm)",
        "status: running",
        "tool result: yes",
        "[missing: events 6..7]",
        "error gap: events 6..7 are no longer held",
        "status: failed: llm: the model server failed (retryable)"
        " (incomplete: events 6..7 missing)",
    ]


def test_open_line_is_closed_before_other_lines() -> None:
    out = io.StringIO()
    view = LiveView(out)
    view.feed(ev(1, "msg.start", m=1, role="assistant"))
    view.feed(ev(2, "msg.delta", m=1, text="Hel"))
    # A stream that never saw its end, interrupted by the run ending.
    view.feed(ev(3, "run.cancelled", reason="user"))
    view.close()
    assert out.getvalue() == "assistant: Hel\nstatus: cancelled (user)\n"


def test_live_view_output_and_failed_tool() -> None:
    out = io.StringIO()
    view = LiveView(out)
    for e in [
        ev(1, "tool.call", call="t", name="relay", input='{"on":true}', client=False),
        ev(2, "tool.result", call="t", output="relay stuck", failed=True),
        ev(3, "output", name="summary", delta="All ", status="building"),
        ev(4, "output", name="summary", delta="good.", status="building"),
        ev(5, "output", name="summary", status="final"),
        ev(6, "output", name="reading", value={"c": 21.5}, status="final"),
    ]:
        view.feed(e)
    view.close()
    assert out.getvalue().splitlines() == [
        'tool call relay {"on":true}',
        "tool result (failed): relay stuck",
        "output summary: All good.",
        'output reading: {"c": 21.5}',
    ]


def test_render_paused_and_running_status_lines() -> None:
    snap = fold([ev(1, "run.started", input="x"), ev(2, "run.paused", reason="approval")])
    assert render(snap) == ["you: x", "status: paused"]
    snap = fold([ev(1, "run.started", input="x")])
    assert render(snap) == ["you: x", "status: running"]


def run_with_lost_text(end: dict[str, Any]) -> list[dict[str, Any]]:
    """full_run's first answer with its second delta (id 4) lost, reported at id 6."""
    return [
        *full_run()[:3],
        ev(5, "msg.end", m=1),
        ev(6, "error", kind="gap", msg="events 4..4 are no longer held", **{"from": 4, "to": 4}),
        end | {"i": 7},
    ]


def test_render_marks_missing_text_and_an_incomplete_run() -> None:
    snap = fold(run_with_lost_text(ev(7, "run.done", usage={"in": 1, "out": 2})))
    assert render(snap) == [
        "you: How warm is it?",
        "assistant: Let me ",
        "[missing: events 4..4]",
        "error gap: events 4..4 are no longer held",
        "status: done (in 1, out 2 tokens) (incomplete: events 4..4 missing)",
    ]


def test_incomplete_status_lines_of_failed_and_cancelled_runs() -> None:
    failed = ev(7, "run.failed", err={"kind": "device", "msg": "the device restarted"})
    cancelled = ev(7, "run.cancelled", reason="user")
    assert render(fold(run_with_lost_text(failed)))[-1] == (
        "status: failed: device: the device restarted (incomplete: events 4..4 missing)"
    )
    assert render(fold(run_with_lost_text(cancelled)))[-1] == (
        "status: cancelled (user) (incomplete: events 4..4 missing)"
    )


def test_a_running_run_with_a_hole_stepped_over_is_not_yet_called_incomplete() -> None:
    snap = fold(run_with_lost_text(ev(7, "usage", **{"in": 1, "out": 1})))
    assert render(snap)[-1] == "status: running" and snap.gaps == [(4, 4)]


def test_many_missing_ranges_are_summed_up() -> None:
    events = [ev(1, "run.started", input="x")]
    events += [ev(i, "usage", **{"in": 1}) for i in range(3, 20, 2)]  # 2, 4, ... 18 lost
    events.append(ev(20, "error", kind="gap", msg="lost", **{"from": 2, "to": 18}))
    events.append(ev(21, "run.cancelled"))
    snap = fold(events)
    assert render(snap)[-1] == (
        "status: cancelled (incomplete: events 2..2, 4..4, 6..6, 8..8, 10..10 and 4 more missing)"
    )


def test_live_view_prints_the_missing_marker_where_the_text_is_missing() -> None:
    out = io.StringIO()
    view = LiveView(out)
    events = full_run()
    # "check." (id 4) is lost: ids 5 on arrive first and wait; the report releases them.
    for e in events[:3] + events[4:]:
        view.feed(e)
    assert out.getvalue() == "you: How warm is it?\nassistant: Let me "
    view.feed(ev(13, "error", kind="gap", msg="lost", **{"from": 4, "to": 4}))
    view.close()
    assert out.getvalue().splitlines() == [
        "you: How warm is it?",
        "assistant: Let me ",
        "[missing: events 4..4]",
        "tool call read_temperature {}",
        "tool result: 21.5",
        "assistant: It is 21.5 °C.",
        "error gap: lost",
        "status: done (in 12, out 8 tokens) (incomplete: events 4..4 missing)",
    ]


def test_live_view_shows_table_rows_as_they_settle_change_and_go() -> None:
    def row(i: int, key: str, status: str, **d: Any) -> dict[str, Any]:
        return ev(i, "row", "r1", field="shop", row=key, status=status, **d)

    out = io.StringIO()
    view = LiveView(out)
    events = [
        row(1, "tea", "final", value="1 box", ver=3, stored=True),
        row(2, "milk", "building", value={"n": 2}),
        row(3, "milk", "final", value={"n": 2}, ver=1),
        row(4, "eggs", "building"),
        row(5, "eggs", "failed", err={"kind": "over_limit", "msg": "the table is full"}),
        ev(6, "row.delete", "r1", field="shop", row="tea"),
    ]
    for e in events:
        view.feed(e)
    assert out.getvalue().splitlines() == [
        "row shop/tea = 1 box (stored)",
        'row shop/milk = {"n": 2} (final)',
        "row shop/eggs = - (failed: over_limit: the table is full)",
        "row shop/tea deleted",
    ]
    # The transcript lists the table most recent first.
    snap = fold(events)
    assert render(snap)[:2] == [
        "row shop/eggs = - (failed: over_limit: the table is full)",
        'row shop/milk = {"n": 2} (final)',
    ]


def test_a_running_node_and_budgets_show() -> None:
    start = ev(2, "node.start", kind="tool")
    start.update(n="/tool/read_temperature", a=1, k=1)
    events = [
        ev(1, "run.started", input="x"),
        start,
        ev(3, "budget", kind="steps", used=4, limit=5, level="warn"),
        ev(4, "budget", kind="wall_s", used=8.25, limit=10, level="warn"),
    ]
    snap = fold(events)
    assert render(snap) == [
        "you: x",
        "budget: steps 4 of 5 (warn)",
        "budget: wall time 8.25 s of 10 s (warn)",
        "status: running (in /tool/read_temperature)",
    ]
    out = io.StringIO()
    view = LiveView(out)
    for e in [*events, ev(5, "budget", kind="steps", used=6, limit=5, level="exceeded")]:
        view.feed(e)
    view.feed(ev(6, "run.failed", err={"kind": "budget", "msg": "past its steps budget"}))
    # A budget line each time its level changes; the failure names the budget.
    assert out.getvalue().splitlines() == [
        "you: x",
        "budget: steps 4 of 5 (warn)",
        "budget: wall time 8.25 s of 10 s (warn)",
        "budget: steps 6 of 5 (exceeded)",
        "status: failed: budget: past its steps budget",
    ]
