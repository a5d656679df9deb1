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
        ev(6, "error", kind="gap", msg="events 6..7 are no longer held", **{"from": 6, "to": 7}),
        ev(
            8,
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
        "error gap: events 6..7 are no longer held",
        "status: failed: llm: the model server failed (retryable)",
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
