"""Client tools answered by a host's own functions (server_bridge/host/tools.py): the
runner on its own, fed a real Reducer's snapshots, and then the MQTT HostClient end to
end: the real bridge, Mosquitto, a board on the MicroPython unix port pausing on its
client tool, and an OpenAI-compatible model server."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from server_bridge.host.client import HostClient, NotConnected
from server_bridge.host.reducer import Reducer, RunSnapshot
from server_bridge.host.tools import (
    ToolError,
    ToolHandlers,
    ToolRunner,
    offer_of,
)
from tests.model_server import ModelServer, ToolCall, Turn
from tests.stack import HOST_USER, Stack
from tests.test_runs_pause import VALVES
from tests.waiting import wait_for
from tools.demo import PREFIX, TENANT

# --- the runner on its own -----------------------------------------------------------

DEV = "dev1"


class Paused:
    """A run's events as a board sends them, folded by a real Reducer: a client tool's
    call (and an approval's, which no handler answers), the pause, the end."""

    def __init__(self, run: str = "r1") -> None:
        self.run = run
        self.reducer = Reducer(DEV)
        self.i = 0
        self.snap: RunSnapshot | None = None

    def event(self, t: str, **d: Any) -> RunSnapshot:
        self.i += 1
        self.snap = self.reducer.apply(
            {"r": self.run, "i": self.i, "t": t, "ts": 1000 + self.i, "d": d}
        )
        return self.snap

    def pause_on(self, *calls: tuple[str, str, dict[str, Any]]) -> RunSnapshot:
        self.event("run.started", req="q1", agent="valves")
        for call, name, args in calls:
            self.event("tool.call", call=call, name=name, input=json.dumps(args), client=True)
        return self.event("run.paused", reason="tool", calls=[c for c, _, _ in calls])


class Sent:
    """The host's side of sending an answer: records each; can fail the first ones."""

    def __init__(self, fail: list[Exception] | None = None) -> None:
        self.answers: list[tuple[str, str, str, str, bool]] = []
        self.fail = list(fail or [])
        self.lock = threading.Lock()

    def __call__(self, device: str, run: str, call: str, output: str, failed: bool) -> None:
        with self.lock:
            if self.fail:
                raise self.fail.pop(0)
            self.answers.append((device, run, call, output, failed))


def runner_of(handlers: ToolHandlers, sent: Sent, **kw: Any) -> tuple[ToolRunner, list[Any]]:
    told: list[tuple[str, str, str]] = []
    handlers.on_delivery = lambda d, r, c, state: told.append((r, c, state))
    return ToolRunner(handlers, sent, **kw), told


def offer(runner: ToolRunner, snap: RunSnapshot) -> None:
    o = offer_of(DEV, snap, runner.handlers)
    if o is not None:
        runner.take(o)


def test_offer_names_only_pending_client_calls_of_handled_tools() -> None:
    tools = ToolHandlers({"ask_user": lambda a: "yes"})
    run = Paused()
    run.event("run.started", req="q1")
    run.event("tool.call", call="c1", name="ask_user", input="{}", client=True)
    run.event("tool.call", call="c2", name="other", input="{}", client=True)
    run.event("tool.call", call="c3", name="ask_user", input="{}")  # a local tool
    snap = run.event("run.paused", reason="tool", calls=["c1", "c2"])
    got = offer_of(DEV, snap, tools)
    assert got is not None and got.calls == (("c1", "ask_user", "{}"),) and not got.ended
    ended = offer_of(DEV, run.event("run.cancelled"), tools)
    assert ended is not None and ended.ended
    assert offer_of(DEV, Paused("_").event("error", kind="busy", msg="x"), tools) is None


def test_a_sync_and_an_async_handler_answer_once_through_pending_submitting_submitted() -> None:
    calls: list[Any] = []

    def sync(args: Any) -> str:
        calls.append(args)
        return "yes"

    async def later(args: Any) -> dict[str, Any]:
        await asyncio.sleep(0.01)
        calls.append(args)
        return {"ok": True, "q": args["q"]}

    tools = ToolHandlers({"ask_user": sync, "ask_later": later})
    sent = Sent()
    runner, told = runner_of(tools, sent)
    try:
        run = Paused()
        snap = run.pause_on(("c1", "ask_user", {"q": "a?"}), ("c2", "ask_later", {"q": "b?"}))
        for _ in range(3):  # the same snapshot again: a replay, a duplicate
            offer(runner, snap)
        wait_for(lambda: len(sent.answers) == 2, "both answers")
        assert sorted(sent.answers) == [
            (DEV, "r1", "c1", "yes", False),
            (DEV, "r1", "c2", json.dumps({"ok": True, "q": "b?"}), False),
        ]
        wait_for(lambda: set(runner.deliveries(DEV, "r1").values()) == {"submitted"}, "submitted")
        for call in ("c1", "c2"):
            assert [s for r, c, s in told if c == call] == ["pending", "submitting", "submitted"]
        # Announced again by a board that rebooted while paused: the same call, not run.
        snap = run.event("tool.call", call="c1", name="ask_user", input="{}", client=True)
        offer(runner, snap)
        time.sleep(0.1)
        assert len(calls) == 2 and len(sent.answers) == 2
    finally:
        runner.close()


def test_a_handler_that_raises_answers_nothing_and_one_that_raises_tool_error_fails_the_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(args: Any) -> str:
        raise RuntimeError("the database password is hunter2")

    def refuses(args: Any) -> str:
        raise ToolError("the user is away")

    tools = ToolHandlers({"broken": broken, "refuses": refuses, "bad_input": lambda a: "x"})
    sent = Sent()
    runner, _ = runner_of(tools, sent)
    try:
        run = Paused()
        run.event("run.started", req="q1")
        run.event("tool.call", call="c1", name="broken", input="{}", client=True)
        run.event("tool.call", call="c2", name="refuses", input="{}", client=True)
        snap = run.event("tool.call", call="c3", name="bad_input", input="{not json", client=True)
        with caplog.at_level(logging.ERROR, "server_bridge.host.tools"):
            offer(runner, snap)
            settled = {"failed", "submitted"}
            wait_for(lambda: set(runner.deliveries(DEV, "r1").values()) == settled, "settled")
            wait_for(lambda: len(sent.answers) == 2, "two answers")
        assert runner.deliveries(DEV, "r1") == {
            "c1": "failed",
            "c2": "submitted",
            "c3": "submitted",
        }
        # The exception is logged with its traceback, never sent; the call still waits.
        assert any(r.exc_info and "hunter2" in str(r.exc_info[1]) for r in caplog.records)
        assert all("hunter2" not in a[3] for a in sent.answers)
        assert sorted(sent.answers) == [
            (DEV, "r1", "c2", "the user is away", True),
            (DEV, "r1", "c3", "the input of tool bad_input is not valid JSON", True),
        ]
        assert runner.errors(DEV, "r1") == {"c1": "RuntimeError: the database password is hunter2"}
        assert runner.handler_errors == 1
    finally:
        runner.close()


def test_a_run_that_ends_while_its_handlers_run_cancels_them() -> None:
    release = threading.Event()
    returned = threading.Event()
    started = threading.Event()

    def slow(args: Any) -> str:
        started.set()
        release.wait(10)
        returned.set()
        return "too late"

    cancelled = threading.Event()

    async def slow_async(args: Any) -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "too late"

    tools = ToolHandlers({"slow": slow, "slow_async": slow_async})
    sent = Sent()
    runner, told = runner_of(tools, sent)
    try:
        run = Paused()
        offer(runner, run.pause_on(("c1", "slow", {}), ("c2", "slow_async", {})))
        assert started.wait(5)
        time.sleep(0.05)  # the async handler is on its loop
        offer(runner, run.event("run.cancelled", reason="user"))
        assert runner.deliveries(DEV, "r1") == {"c1": "cancelled", "c2": "cancelled"}
        assert cancelled.wait(5)  # the coroutine was cancelled
        release.set()
        assert returned.wait(5)
        time.sleep(0.1)
        assert sent.answers == []  # the sync handler's result was dropped
        assert [s for _, c, s in told if c == "c1"] == ["pending", "cancelled"]
    finally:
        release.set()
        runner.close()


def test_a_full_queue_refuses_by_name_and_the_call_is_taken_at_its_runs_next_offer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = threading.Event()

    def slow(args: Any) -> str:
        release.wait(10)
        return "done"

    tools = ToolHandlers({"slow": slow}, max_workers=1, max_queued=1)
    sent = Sent()
    runner, _ = runner_of(tools, sent)
    try:
        run = Paused()
        with caplog.at_level(logging.WARNING, "server_bridge.host.tools"):
            snap = run.pause_on(("c1", "slow", {}), ("c2", "slow", {}), ("c3", "slow", {}))
            offer(runner, snap)
            # One runs, one waits in the queue: a third may have found it full.
            time.sleep(0.1)
            offer(runner, snap)  # the run's next snapshot: the refused one is taken now?
        assert runner.refused >= 1
        assert any("not queued" in r.getMessage() for r in caplog.records)
        assert set(runner.deliveries(DEV, "r1").values()) == {"pending"}
        release.set()
        for _ in range(50):  # its run's later snapshots, as events come
            offer(runner, snap)
            if len(sent.answers) == 3:
                break
            time.sleep(0.05)
        assert sorted(a[2] for a in sent.answers) == ["c1", "c2", "c3"]
    finally:
        release.set()
        runner.close()


def test_a_send_that_fails_in_passing_is_tried_again_and_one_that_does_not_fails() -> None:
    tools = ToolHandlers({"ask_user": lambda a: "yes"})
    sent = Sent([NotConnected("away"), NotConnected("still away")])
    runner, _ = runner_of(tools, sent, retryable=lambda e: isinstance(e, NotConnected))
    try:
        offer(runner, Paused().pause_on(("c1", "ask_user", {})))
        wait_for(lambda: runner.deliveries(DEV, "r1") == {"c1": "submitted"}, "submitted")
        assert len(sent.answers) == 1

        sent.fail = [ValueError("no token")]
        offer(runner, Paused("r2").pause_on(("c1", "ask_user", {})))
        wait_for(lambda: runner.deliveries(DEV, "r2") == {"c1": "failed"}, "failed")
        assert runner.errors(DEV, "r2") == {"c1": "not sent: no token"}
    finally:
        runner.close()


# --- end to end over MQTT ------------------------------------------------------------


def _ask_script() -> list[Turn]:
    # Chosen by how many assistant messages a conversation holds: each new request
    # (a conversation of its own) asks the user, and once answered says what it heard.
    return [
        Turn(tool_calls=[ToolCall("ask_user", json.dumps({"q": "Vent the tank as well?"}))]),
        Turn(text="You said: {last_tool_output}"),
    ]


def _with_tools(s: Stack, tools: ToolHandlers) -> HostClient:
    """The stack's host client again, with tool handlers (a host user has one
    connection: the first one goes)."""
    assert s.client is not None
    s.client.close()
    client = HostClient(s.host, s.port, TENANT, username=HOST_USER,
                        password=s.users[HOST_USER], prefix=PREFIX, tools=tools)  # fmt: skip
    client.connect(timeout=30)
    s.client = client
    return client


def _call_row(snap: RunSnapshot) -> Any:
    (row,) = [r for r in snap.rows if r.kind == "tool_call" and r.name == "ask_user"]
    return row


def test_mqtt_host_answers_client_tools_with_sync_and_async_handlers(tmp_path: Path) -> None:
    told: list[tuple[str, str, str]] = []
    asked: list[Any] = []

    def sync(args: Any) -> str:
        asked.append(args)
        return "yes, vent it"

    async def later(args: Any) -> dict[str, Any]:
        await asyncio.sleep(0.05)
        asked.append(args)
        return {"answer": "no", "asked": args["q"]}

    tools = ToolHandlers({"ask_user": sync},
                         on_delivery=lambda d, r, c, state: told.append((r, c, state)))  # fmt: skip
    with (
        ModelServer(_ask_script()) as server,
        Stack(tmp_path, model_url=server.url, main_py=VALVES) as s,
    ):
        client = _with_tools(s, tools)
        done = s.wait_run(s.request("Check the line."), 60)
        assert done.status == "done", (done.error, s.describe())
        call = _call_row(done)
        assert asked == [{"q": "Vent the tank as well?"}]
        assert client.deliveries(done.run) == {call.call: "submitted"}
        assert [st for r, c, st in told if c == call.call] == ["pending", "submitting", "submitted"]
        assert call.delivery == "submitted"  # the snapshot says so too
        results = [r.output for r in done.rows if r.kind == "tool_result"]
        assert results == ["yes, vent it"]
        assert [r.text for r in done.rows if r.kind == "assistant"][-1] == "You said: yes, vent it"

        # The events again (a replay): the call is not answered twice.
        seen = len(client.events)
        client.replay(s.device, done.run, 0)
        wait_for(lambda: len(client.events) >= seen + done.last_id, "the replay", 20)
        time.sleep(0.2)
        assert len(asked) == 1

        # An async handler, added on the client.
        client.on_tool("ask_user", later)
        done = s.wait_run(s.request("Check the line again."), 60)
        assert done.status == "done", (done.error, s.describe())
        out = json.dumps({"answer": "no", "asked": "Vent the tank as well?"})
        assert [r.output for r in done.rows if r.kind == "tool_result"] == [out]
        assert client.deliveries(done.run) == {_call_row(done).call: "submitted"}
        assert len(asked) == 2


def test_mqtt_host_a_raising_handler_fails_and_a_cancel_while_one_runs_cancels(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    started = threading.Event()
    release = threading.Event()
    returned = threading.Event()
    calls: list[Any] = []

    def broken(args: Any) -> str:
        raise RuntimeError("the handler's own bug")

    def slow(args: Any) -> str:
        calls.append(args)
        started.set()
        release.wait(30)
        returned.set()
        return "too late"

    told: list[tuple[str, str, str]] = []
    tools = ToolHandlers({"ask_user": broken},
                         on_delivery=lambda d, r, c, state: told.append((r, c, state)))  # fmt: skip
    with (
        ModelServer(_ask_script()) as server,
        Stack(tmp_path, model_url=server.url, main_py=VALVES) as s,
    ):
        client = _with_tools(s, tools)
        with caplog.at_level(logging.ERROR, "server_bridge.host.tools"):
            req = s.request("Check the line.")
            paused = client.wait_for(req, lambda x: x.status == "paused" and bool(x.pending), 60)
            (call,) = paused.pending
            wait_for(lambda: client.deliveries(paused.run) == {call: "failed"}, "failed")
        assert any("the handler's own bug" in str(r.exc_info[1]) for r in caplog.records
                   if r.exc_info)  # fmt: skip
        snap = client.find_run(req)
        assert snap is not None and snap.status == "paused" and call in snap.pending
        assert snap.pending[call].delivery == "failed"
        # Nothing was sent: the call waits for whoever answers it.
        client.answer(s.device, s.token, paused.run, call, "answered by a person")
        done = s.wait_run(req, 60)
        assert done.status == "done"
        assert [r.output for r in done.rows if r.kind == "tool_result"] == ["answered by a person"]
        assert client.deliveries(done.run) == {call: "failed"}  # what the handler did
        assert _call_row(done).delivery == "submitted"  # the board's word

        # A run cancelled while its handler runs: cancelled, and the late result dropped.
        tools.add("ask_user", slow)
        req = s.request("Check the line once more.")
        assert started.wait(60), s.describe()
        snap = client.find_run(req)
        assert snap is not None
        (call,) = snap.pending
        assert client.deliveries(snap.run) == {call: "pending"}
        # Its events again while the handler runs: not called a second time.
        seen = len(client.events)
        client.replay(s.device, snap.run, 0)
        wait_for(lambda: len(client.events) >= seen + snap.last_id, "the replay", 20)
        client.cancel(s.device, s.token, snap.run, reason="changed my mind")
        ended = s.wait_run(req, 30)
        assert ended.status == "cancelled"
        wait_for(lambda: client.deliveries(ended.run) == {call: "cancelled"}, "cancelled")
        release.set()
        assert returned.wait(10)
        time.sleep(0.3)
        assert client.deliveries(ended.run) == {call: "cancelled"}
        assert [st for r, c, st in told if c == call] == ["pending", "cancelled"]
        assert len(calls) == 1
