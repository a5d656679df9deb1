"""The snapshot reducer against scripted event sequences."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from server_bridge.host.reducer import (
    BRIDGE_RUN,
    HANDLERS,
    MAX_ERRORS,
    MAX_HELD,
    MAX_NODES,
    BadEnvelope,
    Reducer,
    RunSnapshot,
    apply_event,
)
from server_bridge.wire import EVENT_TYPES
from tests.eventdata import ev, fold


def full_run(run: str = "r1") -> list[dict[str, Any]]:
    """A complete run: question, streamed answer with a tool call, second answer, done."""
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
        ev(6, "usage", run, **{"in": 10, "out": 4, "reason": 0}),
        ev(7, "tool.call", run, call="c-1", name="read_temperature", input="{}", client=False),
        ev(8, "tool.result", run, call="c-1", output="21.5", failed=False),
        ev(9, "msg.start", run, m=2, role="assistant"),
        ev(10, "msg.delta", run, m=2, text="It is 21.5 °C."),
        ev(11, "msg.end", run, m=2),
        ev(12, "usage", run, **{"in": 14, "out": 6, "reason": 0}),
        ev(13, "run.done", run, usage={"in": 24, "out": 10, "reason": 0}),
    ]


def test_full_run_folds_into_rows_status_and_usage() -> None:
    snap = fold(full_run())
    assert (snap.run, snap.req, snap.conv, snap.agent) == ("r1", "q1", "c1", "thermo")
    assert snap.status == "done" and snap.terminal and snap.error is None
    assert [(r.kind, r.text) for r in snap.rows if r.kind in ("user", "assistant")] == [
        ("user", "How warm is it?"),
        ("assistant", "Let me check."),
        ("assistant", "It is 21.5 °C."),
    ]
    assert [r.kind for r in snap.rows] == [
        "user",
        "assistant",
        "tool_call",
        "tool_result",
        "assistant",
    ]
    call, result = snap.rows[2], snap.rows[3]
    assert (call.name, call.input, call.call, call.status) == (
        "read_temperature",
        "{}",
        "c-1",
        "done",
    )
    assert (result.call, result.name, result.output, result.failed) == (
        "c-1",
        "read_temperature",
        "21.5",
        False,
    )
    assert all(r.status == "done" for r in snap.rows if r.kind == "assistant")
    # run.done's usage is the run's total: it replaces the per-node sum, not adds to it.
    assert (snap.usage.tokens_in, snap.usage.tokens_out) == (24, 10)
    assert snap.last_id == 13 and snap.pending == {} and snap.gaps == [] and snap.errors == []


def test_usage_events_add_up_while_running() -> None:
    snap = fold(full_run()[:12])
    assert snap.status == "running"
    assert (snap.usage.tokens_in, snap.usage.tokens_out) == (24, 10)


def test_duplicates_and_replays_do_not_double_text() -> None:
    events = full_run()
    once = fold(events)
    # Every event delivered twice in a row, then the whole run replayed from the start.
    twice = fold([e for e in events for _ in range(2)] + events)
    assert [(r.kind, r.text, r.output) for r in twice.rows] == [
        (r.kind, r.text, r.output) for r in once.rows
    ]
    assert twice.usage == once.usage and twice.last_id == 13


def test_out_of_order_lower_ids_are_ignored() -> None:
    events = full_run()
    reducer = Reducer()
    for e in events[:4]:  # ... msg.delta "check." (id 4)
        reducer.apply(e)
    snap = reducer.apply(events[2])  # id 3 again, late: "Let me "
    assert snap.rows[1].text == "Let me check."
    assert snap.last_id == 4


def test_client_tool_is_pending_until_its_result() -> None:
    reducer = Reducer()
    reducer.apply(ev(1, "run.started", input="Water the plants?"))
    reducer.apply(ev(2, "tool.call", call="k1", name="confirm", input='{"q": "ok?"}', client=True))
    snap = reducer.apply(ev(3, "run.paused", reason="client", calls=["k1"]))
    assert snap.status == "paused"
    assert list(snap.pending) == ["k1"] and snap.pending["k1"].name == "confirm"
    assert snap.pending["k1"] is snap.rows[1] and snap.rows[1].status == "pending"
    snap = reducer.apply(ev(4, "run.resumed", ckpt=3))
    assert snap.status == "running" and "k1" in snap.pending
    snap = reducer.apply(ev(5, "tool.result", call="k1", output="yes", failed=False))
    assert snap.pending == {} and snap.rows[1].status == "done"
    assert snap.rows[-1].kind == "tool_result" and snap.rows[-1].output == "yes"


def test_failed_tool_result_marks_row_and_call() -> None:
    reducer = Reducer()
    reducer.apply(ev(1, "tool.call", call=7, name="relay", input='{"on": true}', client=False))
    snap = reducer.apply(ev(2, "tool.result", call=7, output="relay stuck", failed=True))
    assert snap.rows[0].status == "failed"
    assert snap.rows[1].failed and snap.rows[1].output == "relay stuck"
    assert snap.rows[1].call == "7"


def test_delta_without_start_creates_the_row() -> None:
    reducer = Reducer()
    reducer.apply(ev(1, "run.started", input="hi"))
    # msg.start (id 2) was lost and reported as a gap.
    reducer.apply(
        ev(3, "error", kind="gap", msg="events 2..2 are no longer held", **{"from": 2, "to": 2})
    )
    snap = reducer.apply(ev(4, "msg.delta", m="a", text="hello"))
    snap = reducer.apply(ev(5, "msg.end", m="a"))
    assert [(r.kind, r.text, r.status) for r in snap.rows] == [
        ("user", "hi", "done"),
        ("missing", "[missing: events 2..2]", None),
        ("assistant", "hello", "done"),
    ]
    assert snap.gaps == [(2, 2)]
    assert snap.errors[0]["kind"] == "gap" and snap.status == "running"


def test_non_gap_errors_are_recorded_without_ending_the_run() -> None:
    reducer = Reducer()
    reducer.apply(ev(1, "run.started", input="x"))
    snap = reducer.apply(ev(2, "error", kind="too_large", msg="tool output over the limit"))
    assert snap.errors == [{"kind": "too_large", "msg": "tool output over the limit"}]
    assert snap.gaps == [] and snap.status == "running"


def test_failed_run_keeps_only_the_customer_safe_error() -> None:
    reducer = Reducer()
    reducer.apply(ev(1, "run.started", input="x"))
    snap = reducer.apply(
        ev(
            2,
            "run.failed",
            err={
                "kind": "llm",
                "msg": "the model server failed (HTTP 500)",
                "detail": "Traceback ... sk-secret",
                "url": "http://u:p@host",
            },
            retryable=True,
        )
    )
    assert snap.status == "failed" and snap.retryable is True
    assert snap.error == {"kind": "llm", "msg": "the model server failed (HTTP 500)"}


@pytest.mark.parametrize(
    "err, want",
    [
        (None, {"kind": "internal", "msg": "the run failed"}),
        ({"kind": "weird", "msg": 5}, {"kind": "internal", "msg": "the run failed"}),
        ({"kind": "tool", "msg": "x" * 2000}, {"kind": "tool", "msg": "x" * 500}),
    ],
)
def test_failed_run_with_odd_errors(err: Any, want: dict[str, str]) -> None:
    snap = fold([ev(1, "run.failed", err=err)])
    assert snap.error == want and snap.retryable is False


def test_terminal_status_is_final() -> None:
    reducer = Reducer()
    reducer.apply(ev(1, "run.cancelled", reason="user"))
    snap = reducer.apply(ev(2, "run.resumed", ckpt=1))
    snap = reducer.apply(ev(3, "run.failed", err={"kind": "llm", "msg": "late"}))
    assert snap.status == "cancelled" and snap.reason == "user" and snap.error is None


def test_unknown_event_type_is_ignored_but_advances_the_id() -> None:
    reducer = Reducer()
    reducer.apply(ev(1, "run.started", input="x"))
    snap = reducer.apply(ev(2, "hologram.beam", color="blue"))
    snap = reducer.apply(ev(3, "citation", src="manual", ver=1, chunk=2, score=0.9))
    assert snap.last_id == 3 and [r.kind for r in snap.rows] == ["user"]
    assert snap.status == "running"


def test_output_is_one_row_updated_in_place() -> None:
    reducer = Reducer()
    reducer.apply(ev(1, "output", name="summary", delta="Warm ", status="building"))
    reducer.apply(ev(2, "output", name="summary", delta="today.", status="building"))
    reducer.apply(ev(3, "output", name="reading", value={"c": 21.5}, status="final", format="json"))
    snap = reducer.apply(ev(4, "output", name="summary", value="Warm today.", status="final"))
    assert [(r.name, r.output, r.status) for r in snap.rows] == [
        ("summary", "Warm today.", "final"),
        ("reading", {"c": 21.5}, "final"),
    ]
    assert snap.rows[1].format == "json"


def test_reasoning_is_kept_on_the_assistant_row() -> None:
    snap = fold(
        [
            ev(1, "msg.start", m=1, role="assistant"),
            ev(2, "reason.delta", m=1, text="thinking"),
            ev(3, "msg.delta", m=1, text="answer"),
        ]
    )
    assert len(snap.rows) == 1
    assert (snap.rows[0].reasoning, snap.rows[0].text, snap.rows[0].status) == (
        "thinking",
        "answer",
        "streaming",
    )


def test_runs_are_kept_apart() -> None:
    reducer = Reducer(device="dev1")
    a = full_run("ra")
    b = full_run("rb")
    for x, y in zip(a, b, strict=True):
        reducer.apply(x)
        reducer.apply(y)
    assert [s.run for s in reducer.runs()] == ["ra", "rb"]
    assert all(s.device == "dev1" and s.status == "done" for s in reducer.runs())
    assert reducer.get("ra") is not None and reducer.get("nope") is None


@pytest.mark.parametrize(
    "bad",
    [
        "not a map",
        {"i": 1, "t": "run.started", "d": {}},
        {"r": "r1", "i": "1", "t": "run.started", "d": {}},
        {"r": "r1", "i": 0, "t": "run.started", "d": {}},
        {"r": "r1", "i": True, "t": "run.started", "d": {}},
        {"r": "r1", "i": 1, "t": 5, "d": {}},
        {"r": "r1", "i": 1, "t": "run.started", "d": [1]},
    ],
)
def test_bad_envelopes_are_refused(bad: Any) -> None:
    reducer = Reducer()
    with pytest.raises(BadEnvelope):
        reducer.apply(bad)
    assert reducer.runs() == []


def test_wrongly_typed_fields_do_not_crash() -> None:
    snap = fold(
        [
            ev(1, "run.started", input=42, req=["x"]),
            ev(2, "msg.delta", m=None, text=3),
            ev(3, "tool.call", call={"x": 1}, name=None, input=None, client="yes"),
            ev(4, "usage", **{"in": "many", "out": True}),
            ev(5, "error", kind=7, msg=None),
        ]
    )
    assert snap.req is None and snap.usage.tokens_in == 0 and snap.usage.tokens_out == 0
    assert [r.kind for r in snap.rows] == ["assistant", "tool_call"]
    assert snap.rows[1].client is False and snap.pending == {}
    assert snap.gaps == [] and snap.errors == [{"kind": "internal", "msg": ""}]


def test_a_gap_without_a_usable_range_is_refused_like_the_bridge_does() -> None:
    # The bridge would never forward it (wire.check_envelope), so the reducer, which
    # uses that same check, refuses it too instead of folding a gap it cannot place.
    reducer = Reducer()
    with pytest.raises(BadEnvelope):
        reducer.apply(ev(1, "error", kind="gap", msg="m", **{"from": "a", "to": 3}))


def test_reducer_refuses_what_the_bridge_refuses() -> None:
    reducer = Reducer()
    for bad in (
        {"r": "r1", "i": 1, "t": "run.started", "d": {}},  # no board clock ts
        {"r": "x" * 129, "i": 1, "t": "run.started", "ts": 1, "d": {}},  # run id too long
        {"r": "r1", "i": 1, "t": "run.started", "ts": 1, "d": {}, "n": 5},  # node not a str
    ):
        with pytest.raises(BadEnvelope):
            reducer.apply(bad)
    assert reducer.runs() == []


def test_runs_kept_are_bounded_finished_runs_first() -> None:
    reducer = Reducer(max_runs=3)
    reducer.apply(ev(1, "run.started", "live", input="x"))
    for run in ("a", "b"):
        reducer.apply(ev(1, "run.started", run, input="x"))
        reducer.apply(ev(2, "run.done", run, usage={}))
    reducer.apply(ev(1, "run.started", "c", input="x"))  # over: "a" finished first
    assert [s.run for s in reducer.runs()] == ["live", "b", "c"]
    reducer.apply(ev(1, "run.started", "d", input="x"))  # then "b"
    reducer.apply(ev(1, "run.started", "e", input="x"))  # none finished: the oldest
    assert [s.run for s in reducer.runs()] == ["c", "d", "e"]
    with pytest.raises(ValueError):
        Reducer(max_runs=0)


def test_errors_kept_per_snapshot_are_bounded() -> None:
    reducer = Reducer()
    for i in range(1, MAX_ERRORS + 51):
        snap = reducer.apply(ev(i, "error", "_", kind="busy", msg=f"m{i}", req=f"q{i}"))
    assert len(snap.errors) == MAX_ERRORS
    assert snap.errors[0]["msg"] == "m51" and snap.errors[-1] == {
        "kind": "busy",
        "msg": f"m{MAX_ERRORS + 50}",
        "req": f"q{MAX_ERRORS + 50}",
    }


def test_every_handled_type_is_in_the_contract() -> None:
    assert set(HANDLERS) <= EVENT_TYPES


# --- in-order folding, holes and gap reports --------------------------------------------


def texts(snap: RunSnapshot) -> list[tuple[str, str]]:
    return [(r.kind, r.text) for r in snap.rows if r.kind in ("user", "assistant", "missing")]


def gap(i: int, lo: int, hi: int, run: str = "r1") -> dict[str, Any]:
    return ev(
        i,
        "error",
        run,
        kind="gap",
        msg=f"events {lo}..{hi} are no longer held",
        **{
            "from": lo,
            "to": hi,
        },
    )


def test_events_out_of_order_are_applied_in_order() -> None:
    events = full_run()
    reducer = Reducer()
    reducer.apply(events[0])
    reducer.apply(events[1])
    snap = reducer.apply(events[3])  # "check." (id 4) before "Let me " (id 3)
    assert snap.last_id == 2 and snap.held == [4] and snap.rows[1].text == ""
    snap, applied = reducer.fold(events[2])
    assert [e["i"] for e in applied] == [3, 4] and snap.held == []
    assert snap.rows[1].text == "Let me check." and snap.last_id == 4
    for e in reversed(events[4:]):  # the rest backwards: applied when 5 comes, last
        snap = reducer.apply(e)
    assert texts(snap) == texts(fold(events)) and snap.complete and snap.held == []


def test_a_done_held_behind_a_hole_keeps_the_run_open_until_the_hole_fills() -> None:
    events = full_run()
    reducer = Reducer()
    for e in events[:9] + events[10:]:  # all but id 10, the second answer's text
        snap = reducer.apply(e)
    assert snap.status == "running" and not snap.terminal and not snap.complete
    assert snap.last_id == 9 and snap.held == [11, 12, 13]
    assert texts(snap)[-1] == ("assistant", "")
    snap = reducer.apply(events[9])
    assert snap.status == "done" and snap.complete and snap.held == [] and snap.gaps == []
    assert texts(snap)[-1] == ("assistant", "It is 21.5 °C.")


def answer_with_a_hole() -> list[dict[str, Any]]:
    """Ids 1..8 of a run whose id 4 is lost, with the gap report (id 7) that says so."""
    return [
        ev(1, "run.started", input="Say hello"),
        ev(2, "msg.start", m=1, role="assistant"),
        ev(3, "msg.delta", m=1, text="Hello "),
        ev(4, "msg.delta", m=1, text="big "),
        ev(5, "msg.delta", m=1, text="world."),
        ev(6, "msg.end", m=1),
        gap(7, 4, 4),
        ev(8, "run.done", usage={"in": 3, "out": 3}),
    ]


@pytest.mark.parametrize(
    "order",
    [
        [1, 2, 3, 5, 6, 7, 8],  # the report after the hole, as it usually comes
        [1, 7, 3, 2, 8, 6, 5],  # the report before the ids below the hole
        [8, 7, 6, 5, 3, 2, 1],  # everything backwards
    ],
)
def test_a_gap_report_steps_over_the_hole_with_a_missing_row_in_place(order: list[int]) -> None:
    events = {e["i"]: e for e in answer_with_a_hole()}
    reducer = Reducer()
    for i in order:
        snap = reducer.apply(events[i])
    assert texts(snap) == [
        ("user", "Say hello"),
        ("assistant", "Hello "),
        ("missing", "[missing: events 4..4]"),
        ("assistant", "world."),
    ]
    assert snap.rows[-1].status == "done"  # msg.end found the row the text went on in
    assert snap.status == "done" and snap.terminal and not snap.complete
    assert snap.gaps == [(4, 4)] and snap.missing == [(4, 4)]
    assert snap.held == [] and snap.last_id == 8
    # The report itself is recorded, in its place, like any error.
    assert snap.errors == [
        {"kind": "gap", "msg": "events 4..4 are no longer held", "from": 4, "to": 4}
    ]


def test_the_run_stays_open_while_ids_below_a_reported_range_are_missing() -> None:
    events = answer_with_a_hole()
    reducer = Reducer()
    for e in events[:2] + events[4:]:  # 3 is not lost, only late; 4 is lost
        snap = reducer.apply(e)
    assert not snap.terminal and snap.last_id == 2 and snap.held == [5, 6, 7, 8]
    assert snap.gaps == []
    snap = reducer.apply(events[2])
    assert snap.status == "done" and snap.gaps == [(4, 4)]


def test_an_id_of_a_reported_range_that_arrives_after_all_is_applied() -> None:
    events = answer_with_a_hole()
    wide = gap(7, 3, 5)  # the report says 3..5, but 5 will arrive
    reducer = Reducer()
    reducer.apply(events[0])  # 2 is still to come: nothing is stepped over yet
    reducer.apply(wide)
    reducer.apply(events[4])  # id 5, reported lost, arrives
    snap = reducer.apply(events[5])
    assert snap.last_id == 1 and snap.held == [5, 6, 7]
    snap = reducer.apply(events[1])  # id 2
    snap = reducer.apply(events[7])
    assert texts(snap) == [
        ("user", "Say hello"),
        ("assistant", ""),
        ("missing", "[missing: events 3..4]"),
        ("assistant", "world."),
    ]
    assert snap.gaps == [(3, 4)] and snap.status == "done" and not snap.complete
    # An id stepped over that arrives later still is a repeat, and changes nothing.
    before = texts(snap)
    assert reducer.fold(events[2])[1] == []
    assert texts(snap) == before and snap.last_id == 8


def test_mark_lost_releases_what_was_held_and_counts_as_missing() -> None:
    events = answer_with_a_hole()
    reducer = Reducer()
    for e in events[:3] + events[4:6]:  # 4 never comes, and no report says so
        reducer.apply(e)
    assert reducer.mark_lost("nope", 1, 9) == []  # a run it does not hold
    seen: list[tuple[int, int]] = []
    applied = reducer.mark_lost("r1", 2, 4, on_apply=lambda e, s: seen.append((e["i"], s.last_id)))
    assert [e["i"] for e in applied] == [5, 6] and seen == [(5, 5), (6, 6)]
    snap = reducer.get("r1")
    assert snap is not None and snap.gaps == [(4, 4)] and snap.last_id == 6
    assert texts(snap)[-2:] == [("missing", "[missing: events 4..4]"), ("assistant", "world.")]
    # Declared ahead of the next id: stepped over when reached.
    reducer.mark_lost("r1", 7, 7)
    snap = reducer.apply(events[7])
    assert snap.gaps == [(4, 4), (7, 7)] and snap.status == "done" and not snap.complete
    assert snap.errors == []  # the report (id 7) itself was lost
    assert reducer.mark_lost("r1", 9, 8) == []  # an empty range


def test_adjacent_lost_ranges_are_one_missing_row() -> None:
    reducer = Reducer()
    reducer.apply(ev(1, "run.started", input="x"))
    reducer.mark_lost("r1", 4, 5)
    reducer.mark_lost("r1", 2, 3)
    snap = reducer.apply(ev(6, "run.done", usage={}))
    assert snap.gaps == [(2, 5)] and [r.text for r in snap.rows][-1] == "[missing: events 2..5]"


def test_held_events_are_bounded_and_the_dropped_come_again() -> None:
    reducer = Reducer()
    over = 10
    for i in range(2, MAX_HELD + 2 + over):
        snap = reducer.apply(ev(i, "msg.delta", m=1, text="x"))
    assert snap.held == list(range(2, MAX_HELD + 2)) and snap.dropped == over
    snap = reducer.apply(ev(1, "msg.start", m=1, role="assistant"))
    assert snap.last_id == MAX_HELD + 1 and snap.held == []
    for i in range(MAX_HELD + 2, MAX_HELD + 2 + over):  # the replay brings them again
        snap = reducer.apply(ev(i, "msg.delta", m=1, text="x"))
    assert snap.rows[0].text == "x" * (MAX_HELD + over) and snap.dropped == over


def test_duplicates_of_held_events_and_gap_reports_change_nothing() -> None:
    events = answer_with_a_hole()
    once = fold(events[:3] + events[4:])
    reducer = Reducer()
    for e in events[:2]:
        reducer.apply(e)
    for e in events[4:] + events[4:]:  # held twice, the report twice
        assert reducer.fold(e)[1] == []
    for e in [events[2]] + events:
        snap = reducer.apply(e)
    assert texts(snap) == texts(once) and snap.gaps == once.gaps == [(4, 4)]
    assert len(snap.errors) == 1


def test_a_long_answer_shuffled_folds_to_exactly_its_text() -> None:
    rng = random.Random(20240611)
    text = "".join(rng.choice("abcdefghij klmnopqrstuvwxyz.,") for _ in range(2000))
    pieces = [text[k : k + 20] for k in range(0, 2000, 20)]
    events = [
        ev(1, "run.started", input="Tell me a long story"),
        ev(2, "msg.start", m=1, role="assistant"),
        *[ev(3 + n, "msg.delta", m=1, text=p) for n, p in enumerate(pieces)],
        ev(103, "msg.end", m=1),
        ev(104, "run.done", usage={"in": 5, "out": 500}),
    ]
    assert len(pieces) == 100
    order = list(range(len(events)))
    rng.shuffle(order)
    reducer = Reducer()
    for n, k in enumerate(order):
        snap = reducer.apply(events[k])
        # Terminal exactly when the last missing event arrives, never with text missing.
        assert snap.terminal == (n == len(order) - 1)
    assert snap.rows[1].text == text and snap.complete and snap.held == [] and snap.gaps == []


def test_on_apply_sees_each_event_with_the_snapshot_as_of_it() -> None:
    events = full_run()
    snap = RunSnapshot(run="r1")
    seen: list[tuple[int, int]] = []

    def note(e: dict[str, Any], s: RunSnapshot) -> None:
        seen.append((e["i"], s.last_id))

    for e in events[:2] + events[3:5]:
        apply_event(snap, e, note)
    assert seen == [(1, 1), (2, 2)]
    assert [e["i"] for e in apply_event(snap, events[2], note)] == [3, 4, 5]
    assert seen[2:] == [(3, 3), (4, 4), (5, 5)]


def test_streams_that_are_not_runs_fold_as_they_arrive() -> None:
    reducer = Reducer()
    for run in ("_", BRIDGE_RUN):
        reducer.apply(ev(3, "error", run, kind="busy", msg="three", req="q3"))
        reducer.apply(ev(1, "error", run, kind="busy", msg="one", req="q1"))
        reducer.apply(ev(3, "error", run, kind="busy", msg="three", req="q3"))  # a repeat
        snap = reducer.get(run)
        assert snap is not None and [e["msg"] for e in snap.errors] == ["three", "one"]
        assert snap.held == [] and snap.last_id == 3
    # The bridge's answer to a replay names the run it is about; it is not a hole of _b.
    answer = ev(4, "error", BRIDGE_RUN, kind="gap", r="x", msg="gone", **{"from": 1, "to": 2})
    snap = reducer.apply(answer)
    assert snap.gaps == [] and snap.held == []
    assert snap.errors[-1] == {"kind": "gap", "msg": "gone", "from": 1, "to": 2, "r": "x"}
    assert reducer.mark_lost(BRIDGE_RUN, 1, 9) == [] and snap.gaps == []


def test_a_long_request_echoed_cut_says_so_in_the_user_row() -> None:
    snap = fold([ev(1, "run.started", req="q", input="x" * 512, input_len=7000)])
    assert [r.text for r in snap.rows] == ["x" * 512 + " [cut: 6488 more characters]"]


def test_a_stream_starting_again_at_1_is_new_and_a_repeat_is_not() -> None:
    # After a board reboot its device stream begins again at id 1: a new refusal, with
    # its own time; a QoS 1 redelivery is the very same envelope.
    reducer = Reducer()
    first = ev(1, "error", "_", kind="busy", msg="before the reboot", req="q1")
    reducer.apply(first)
    reducer.apply(dict(first))
    after = ev(1, "error", "_", kind="busy", msg="after the reboot", req="q2")
    after["ts"] = first["ts"] + 5000
    reducer.apply(after)
    snap = reducer.get("_")
    assert snap is not None
    assert [e["msg"] for e in snap.errors] == ["before the reboot", "after the reboot"]


@pytest.mark.parametrize("kind", ["link", "device", "budget", "timeout"])
def test_link_and_device_failures_keep_their_kind(kind: str) -> None:
    snap = fold([ev(1, "run.failed", err={"kind": kind, "msg": "gone"}, retryable=True)])
    assert snap.error == {"kind": kind, "msg": "gone"} and snap.complete


def test_a_copy_equals_a_deepcopy_and_shares_nothing_that_changes() -> None:
    snap = RunSnapshot(run="r1")
    events = full_run()
    # A client tool pending, an output map, an error and a held event, so every part of
    # a snapshot has something in it.
    events[6] = ev(7, "tool.call", "r1", call="c-1", name="ask", input="{}", client=True)
    events[7] = ev(8, "output", "r1", name="plan", value={"steps": [1, 2]}, status="building")
    events[8] = ev(9, "error", "r1", kind="tool", msg="slow")
    for e in events[:9] + events[10:11]:
        apply_event(snap, e)
    c = snap.copy()
    assert c == copy.deepcopy(snap)
    # The copy's indexes point at its own rows.
    assert c.pending["c-1"] is c.rows[[r.call for r in c.rows].index("c-1")]
    assert all(c._messages[k] in c.rows for k in c._messages)
    # Nothing the reducer changes next reaches the copy, and the copy's changes stay put.
    before = copy.deepcopy(c)
    apply_event(snap, events[9])  # fills the hole: msg 2 and what was held
    snap._outputs["plan"].output["steps"].append(3)
    snap.usage.add({"in": 5})
    assert c == before
    c.rows[0].text = "changed"
    c.errors[0]["msg"] = "changed"
    c._outputs["plan"].output["steps"].clear()
    assert snap.rows[0].text == "How warm is it?"
    assert snap.errors[0]["msg"] == "slow"
    assert snap._outputs["plan"].output["steps"] == [1, 2, 3]


def node(
    i: int, t: str, path: str, a: int, k: int | None = None, run: str = "r1", **d: Any
) -> dict[str, Any]:
    """An envelope about node `path` (its activation a, iteration k)."""
    env = ev(i, t, run, **d)
    env["n"], env["a"] = path, a
    if k is not None:
        env["k"] = k
    return env


def model_loop_run() -> list[dict[str, Any]]:
    """A model loop's run with its nodes: model, tool, model; a budget warning."""
    return [
        ev(1, "run.started", input="How warm is it?"),
        node(2, "node.start", "/model", 1, 1, kind="model"),
        ev(3, "msg.start", m=1, role="assistant"),
        ev(4, "msg.end", m=1),
        node(5, "usage", "/model", 1, 1, **{"in": 10, "out": 4, "reason": 0}),
        node(6, "node.end", "/model", 1, 1, status="completed", port="tools"),
        ev(7, "budget", kind="steps", used=2, limit=2, level="warn"),
        node(8, "node.start", "/tool/read_temperature", 1, 1, kind="tool"),
        ev(9, "tool.call", call="c1", name="read_temperature", input="{}", client=False),
        ev(10, "tool.result", call="c1", output="21.5", failed=False),
        node(11, "node.end", "/tool/read_temperature", 1, 1, status="completed"),
        node(12, "node.start", "/model", 2, 2, kind="model"),
        ev(13, "msg.start", m=2, role="assistant"),
        ev(14, "msg.delta", m=2, text="It is 21.5 °C."),
        ev(15, "msg.end", m=2),
        node(16, "usage", "/model", 2, 2, **{"in": 14, "out": 6, "reason": 0}),
        node(17, "node.end", "/model", 2, 2, status="completed", port="done"),
        ev(18, "run.done", usage={"in": 24, "out": 10, "reason": 0}),
    ]


def test_nodes_fold_into_one_state_per_path_with_usage_and_ports() -> None:
    snaps: list[list[tuple[str, int]]] = []
    reducer = Reducer()
    for e in model_loop_run():
        snaps.append(reducer.apply(e).active)
    snap = reducer.get("r1")
    assert snap is not None and snap.status == "done"
    assert list(snap.nodes) == ["/model", "/tool/read_temperature"]
    model = snap.nodes["/model"]
    assert (model.kind, model.activations, model.a, model.k) == ("model", 2, 2, 2)
    assert (model.status, model.port, model.open) == ("completed", "done", set())
    assert (model.usage.tokens_in, model.usage.tokens_out) == (24, 10)
    tool = snap.nodes["/tool/read_temperature"]
    assert (tool.kind, tool.status, tool.port, tool.activations) == ("tool", "completed", None, 1)
    # Which node is doing what, event by event.
    assert (
        snaps[1] == [("/model", 1)]
        and snaps[5] == []
        and snaps[8] == [("/tool/read_temperature", 1)]
    )
    assert snap.budgets["steps"].level == "warn" and snap.budgets["steps"].used == 2
    assert snap.usage.tokens_in == 24  # run.done's total, not the nodes' sum added to it


def test_edges_are_counted_and_budgets_keep_the_latest_per_kind() -> None:
    snap = fold(
        [
            ev(1, "run.started", input="go"),
            ev(2, "edge", **{"from": "/plan", "port": "retry", "to": "/plan"}),
            ev(3, "edge", **{"from": "/plan", "port": "retry", "to": "/plan"}),
            ev(4, "edge", **{"from": "/plan", "port": "done", "to": "/answer"}),
            ev(5, "edge", **{"from": "/plan", "to": "/answer"}),
            ev(6, "edge", to="/nowhere"),  # no from: not an edge
            ev(7, "budget", kind="wall_s", used=8.1, limit=10, level="warn"),
            ev(8, "budget", kind="wall_s", used=10.2, limit=10, level="exceeded"),
            ev(9, "budget", kind="reads", used="3", limit=2, level="exceeded"),  # not a count
            ev(10, "run.failed", err={"kind": "budget", "msg": "past its wall_s"}),
        ]
    )
    assert snap.edges == {
        ("/plan", "retry", "/plan"): 2,
        ("/plan", "done", "/answer"): 1,
        ("/plan", None, "/answer"): 1,
    }
    assert list(snap.budgets) == ["wall_s"]
    assert (snap.budgets["wall_s"].used, snap.budgets["wall_s"].level) == (10.2, "exceeded")
    assert snap.error == {"kind": "budget", "msg": "past its wall_s"} and not snap.retryable


@pytest.mark.parametrize(
    ("end", "status"),
    [
        (ev(5, "run.failed", err={"kind": "budget", "msg": "x"}), "failed"),
        (ev(5, "run.cancelled", reason="stop"), "cancelled"),
        (ev(5, "run.done", usage={}), "completed"),
    ],
)
def test_nodes_left_open_end_with_the_run(end: dict[str, Any], status: str) -> None:
    snap = fold(
        [
            ev(1, "run.started", input="go"),
            node(2, "node.start", "/plan", 1, kind="planner"),
            node(3, "node.start", "/plan/search", 1),
            node(4, "node.end", "/plan/search", 1, status="completed", port="found"),
            end,
        ]
    )
    assert snap.active == []
    assert snap.nodes["/plan"].status == status
    assert snap.nodes["/plan/search"].status == "completed"
    # Nothing after the run's end reopens a node.
    after = fold(
        [
            ev(1, "run.started", input="go"),
            end,
            node(6, "node.start", "/late", 1),
        ]
    )
    assert after.nodes == {}


def test_two_activations_of_a_path_open_at_once_end_apart() -> None:
    # Two waiting calls of one tool (a paused run's approvals) end in either order.
    snap = fold(
        [
            ev(1, "run.started", input="open both"),
            node(2, "node.start", "/tool/open_valve", 1, 1, kind="tool"),
            node(3, "node.start", "/tool/open_valve", 2, 1, kind="tool"),
            node(4, "node.end", "/tool/open_valve", 2, 1, status="failed"),
        ]
    )
    tool = snap.nodes["/tool/open_valve"]
    assert snap.active == [("/tool/open_valve", 1)]
    # The latest activation's status shows; an end for an earlier one only closes it.
    assert (tool.status, tool.a, tool.activations) == ("failed", 2, 2)
    more = fold(
        [
            ev(1, "run.started", input="open both"),
            node(2, "node.start", "/tool/open_valve", 1, 1, kind="tool"),
            node(3, "node.start", "/tool/open_valve", 2, 1, kind="tool"),
            node(4, "node.end", "/tool/open_valve", 2, 1, status="failed"),
            node(5, "node.end", "/tool/open_valve", 1, 1, status="weird"),
        ]
    )
    assert more.active == [] and more.nodes["/tool/open_valve"].status == "failed"


def test_node_paths_and_edges_kept_are_bounded() -> None:
    events = [ev(1, "run.started", input="many")]
    for n in range(MAX_NODES + 5):
        events.append(node(len(events) + 1, "node.start", f"/n{n}", 1))
        events.append(ev(len(events) + 1, "edge", **{"from": f"/n{n}", "to": "/x"}))
    snap = fold(events)
    assert len(snap.nodes) == MAX_NODES and len(snap.edges) == MAX_NODES
    assert snap.nodes_dropped == 10


def test_a_copy_keeps_tables_nodes_and_budgets_apart_from_the_reducer() -> None:
    snap = RunSnapshot(run="r1")
    events = [
        ev(1, "run.started", "r1", input="x"),
        ev(
            2,
            "row",
            "r1",
            field="shop",
            row="milk",
            status="final",
            value={"n": 2},
            ver=1,
            links=[{"label": "about", "to_field": "shop", "to_key": "tea"}],
        ),
        node(3, "node.start", "/model", 1, 1, kind="model"),
        ev(4, "budget", "r1", kind="steps", used=2, limit=2, level="warn"),
    ]
    for e in events:
        apply_event(snap, e)
    c = snap.copy()
    assert c == copy.deepcopy(snap)
    apply_event(
        snap, ev(5, "row", "r1", field="shop", row="milk", status="building", value={"n": 3})
    )
    apply_event(snap, node(6, "node.end", "/model", 1, 1, status="completed"))
    snap.tables["shop"]["milk"].links.append({"label": "x"})
    assert c.tables["shop"]["milk"].output == {"n": 2}
    assert len(c.tables["shop"]["milk"].links) == 1
    assert snap.nodes["/model"].status == "completed"
    assert c.nodes["/model"].status == "running"
    assert c == copy.deepcopy(c)


def test_a_device_offline_refusal_is_the_devices_presence_until_a_run_shows_it_back() -> None:
    reducer = Reducer("thermo1")
    assert reducer.presence is None
    refusal = ev(1, "error", BRIDGE_RUN, kind="device_offline", msg="offline", req="q1",
                 since=1_700_000_000_123)  # fmt: skip
    reducer.apply(refusal)
    presence = reducer.presence
    assert presence is not None and presence.offline and presence.since == 1_700_000_000.123
    reducer.apply(ev(2, "error", BRIDGE_RUN, kind="busy", msg="full", req="q2"))
    assert reducer.presence is presence  # another refusal says nothing of presence
    reducer.apply(ev(3, "error", BRIDGE_RUN, kind="device_offline", msg="offline", req="q3",
                     since="soon"))  # fmt: skip
    later = reducer.presence
    assert later is not None and later.offline and later.since is None
    reducer.apply(full_run()[0])
    assert reducer.presence is None
