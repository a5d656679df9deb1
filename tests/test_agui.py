"""Wren runs over AG-UI (server_bridge/http/agui.py): a RunAgentInput POSTed to the
bridge's `wren bridge --http`, the run read back as AG-UI events, each validated against
the published models (PyPI `ag-ui-protocol`). The real bridge process, Mosquitto, a
board on the MicroPython unix port and an OpenAI-compatible model server that streams
fragmented tool arguments.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from ag_ui.core import Event
from pydantic import TypeAdapter

from tests.model_server import ModelServer, ToolCall, Turn
from tests.stack import Stack
from tests.test_http_api import HTTP, bearer, frames, http_url, token
from tests.test_runs_pause import VALVES

EVENT = TypeAdapter(Event)


def run_input(text: str, thread: str = "t1", run: str | None = None) -> dict[str, Any]:
    return {"threadId": thread, "runId": run or uuid.uuid4().hex, "state": {},
            "messages": [{"id": "u1", "role": "user", "content": text}],
            "tools": [], "context": [], "forwardedProps": {}}  # fmt: skip


def post(base: str, tok: str, body: dict[str, Any],
         last: str | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """POST to the AG-UI endpoint; the events, each validated, with their SSE ids."""
    headers = bearer(tok) | {"Accept": "text/event-stream"}
    if last:
        headers["Last-Event-ID"] = last
    with httpx.stream("POST", f"{base}/v1/devices/thermo1/agui", headers=headers,
                      json=body, timeout=60) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        raw = r.read().decode()
    assert "\r" not in raw  # LF-only frames
    out = []
    for f in frames(iter(raw.split("\n"))):
        if "comment" in f:
            continue
        event = f["data"]
        EVENT.validate_python(event)  # the published models accept it
        out.append({**event, "_id": f.get("id")})
    return out


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def check_balanced(events: list[dict[str, Any]]) -> None:
    """Every message and tool call that starts ends, in order."""
    open_msgs: set[str] = set()
    open_calls: set[str] = set()
    for e in events:
        if e["type"] == "TEXT_MESSAGE_START":
            open_msgs.add(e["messageId"])
        elif e["type"] == "TEXT_MESSAGE_CONTENT":
            assert e["messageId"] in open_msgs
        elif e["type"] == "TEXT_MESSAGE_END":
            open_msgs.remove(e["messageId"])
        elif e["type"] == "TOOL_CALL_START":
            open_calls.add(e["toolCallId"])
        elif e["type"] in ("TOOL_CALL_ARGS", "TOOL_CALL_END"):
            assert e["toolCallId"] in open_calls
            if e["type"] == "TOOL_CALL_END":
                open_calls.remove(e["toolCallId"])
    assert not open_msgs and not open_calls


def test_a_run_with_a_tool_call_as_ag_ui_events(tmp_path: Path) -> None:
    with Stack(tmp_path, bridge_args=HTTP) as s:
        base, alice = http_url(s), token(s, "alice")
        body = run_input("How warm is it in here?")
        events = post(base, alice, body)
        kinds = types(events)
        assert kinds[0] == "RUN_STARTED" and kinds[-1] == "RUN_FINISHED"
        assert events[0]["threadId"] == "t1" and events[0]["runId"] == body["runId"]
        assert events[-1]["outcome"] == {"type": "success"}
        assert events[-1]["usage"][0]["outputTokens"] > 0
        for k in ("TOOL_CALL_START", "TOOL_CALL_ARGS", "TOOL_CALL_END", "TOOL_CALL_RESULT",
                  "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END",
                  "STEP_STARTED", "STEP_FINISHED", "STATE_SNAPSHOT"):  # fmt: skip
            assert k in kinds, (k, kinds)
        check_balanced(events)
        call = next(e for e in events if e["type"] == "TOOL_CALL_START")
        assert call["toolCallName"] == "read_temperature"
        text = "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT")
        assert "°C" in text, text

        # The same runId again starts nothing new: the same run, read back.
        again = post(base, alice, body)
        assert types(again) == kinds
        # Last-Event-ID resumes after any event: exactly the rest.
        ids = [e["_id"] for e in events if e["_id"]]
        middle = ids[len(ids) // 2]
        rest = post(base, alice, body, last=middle)
        at = next(k for k, e in enumerate(events) if e["_id"] == middle)
        strip = [{k: v for k, v in e.items() if k != "_id"} for e in events[at + 1 :]]
        assert [{k: v for k, v in e.items() if k != "_id"} for e in rest] == strip


def test_a_client_tool_interrupt_answered_and_resumed(tmp_path: Path) -> None:
    calls = [ToolCall("ask_user", json.dumps({"q": "Vent the tank as well?"}))]
    script = [Turn(tool_calls=calls, args_chunk_chars=3), Turn(text="Venting, as you said.")]
    with (
        ModelServer(script) as server,
        Stack(tmp_path, model_url=server.url, main_py=VALVES, bridge_args=HTTP) as s,
    ):
        base, alice = http_url(s), token(s, "alice")
        body = run_input("Check the line.")
        first = post(base, alice, body)
        end = first[-1]
        assert end["type"] == "RUN_FINISHED" and end["outcome"]["type"] == "interrupt"
        (interrupt,) = end["outcome"]["interrupts"]
        assert interrupt["reason"] == "tool"
        start = next(e for e in first if e["type"] == "TOOL_CALL_START")
        assert start["toolCallName"] == "ask_user"
        assert interrupt["toolCallId"] == start["toolCallId"]
        args = "".join(e["delta"] for e in first if e["type"] == "TOOL_CALL_ARGS")
        assert json.loads(args) == {"q": "Vent the tank as well?"}

        resumed = post(base, alice, {**body, "resume": [
            {"interruptId": interrupt["id"], "status": "resolved", "payload": "yes, vent it"}]})
        kinds = types(resumed)
        assert kinds[0] == "RUN_STARTED" and kinds[-1] == "RUN_FINISHED", kinds
        assert resumed[-1]["outcome"] == {"type": "success"}
        result = next(e for e in resumed if e["type"] == "TOOL_CALL_RESULT")
        assert (result["toolCallId"], result["content"]) == (start["toolCallId"], "yes, vent it")
        text = "".join(e["delta"] for e in resumed if e["type"] == "TEXT_MESSAGE_CONTENT")
        assert text == "Venting, as you said."
        check_balanced(resumed)


def test_a_failed_and_a_cancelled_run_are_run_errors(tmp_path: Path) -> None:
    # An empty script: every request is past its end, answered HTTP 500 (the model is
    # down, whatever the bridge's retries do); the cancelled run's turn is put ahead.
    with (
        ModelServer([]) as server,
        Stack(tmp_path, model_url=server.url, bridge_args=HTTP) as s,
    ):
        base, alice = http_url(s), token(s, "alice")
        events = post(base, alice, run_input("How warm is it?"))
        assert events[0]["type"] == "RUN_STARTED" and events[-1]["type"] == "RUN_ERROR"
        assert events[-1]["code"] == "llm" and events[-1]["message"]
        check_balanced(events)

        # A cancel while the model is slow: RUN_ERROR with code cancelled.
        server.override_next(Turn(text="slow " * 50, chunk_chars=5, delay_s=0.2))
        body = run_input("Tell me a long story.")
        with httpx.stream("POST", f"{base}/v1/devices/thermo1/agui", json=body, timeout=60,
                          headers=bearer(alice) | {"Accept": "text/event-stream"}) as r:
            got: list[dict[str, Any]] = []
            cancelled = False
            for f in frames(r.iter_lines()):
                if "data" not in f:
                    continue
                got.append(f["data"])
                EVENT.validate_python(f["data"])
                if f["data"]["type"] == "TEXT_MESSAGE_CONTENT" and not cancelled:
                    run = f["id"].rsplit(":", 1)[0] if f.get("id") else None
                    run = run or httpx.get(
                        f"{base}/v1/devices/thermo1/requests/{body['runId']}",
                        headers=bearer(alice)).json()["run"]
                    sent = httpx.post(f"{base}/v1/devices/thermo1/runs/{run}/cancel",
                                      headers=bearer(alice), json={"reason": "enough"})
                    assert sent.status_code == 202, sent.text
                    cancelled = True
        assert got[-1]["type"] == "RUN_ERROR" and got[-1]["code"] == "cancelled", got[-3:]
        check_balanced(got)


def test_the_mapping_alone_validates_for_every_kind_of_event() -> None:
    from server_bridge.http.agui import Mapper

    m = Mapper("t", "r")
    envs = [
        {"r": "x", "i": 1, "t": "run.started", "ts": 1, "d": {"req": "r"}},
        {"r": "x", "i": 2, "t": "node.start", "ts": 2, "n": "/model", "a": 1, "d": {}},
        {"r": "x", "i": 3, "t": "reason.delta", "ts": 3, "d": {"m": 1, "text": "hmm"}},
        {"r": "x", "i": 4, "t": "msg.delta", "ts": 4, "d": {"m": 1, "text": "Hi"}},
        {"r": "x", "i": 5, "t": "output", "ts": 5, "d": {"name": "a/b", "value": 3,
                                                        "status": "final"}},
        {"r": "x", "i": 6, "t": "row", "ts": 6, "d": {"field": "notes", "row": "k1",
                                                     "status": "final", "value": "v"}},
        {"r": "x", "i": 7, "t": "row.delete", "ts": 7, "d": {"field": "notes", "row": "k1"}},
        {"r": "x", "i": 8, "t": "citation", "ts": 8, "d": {"n": 1, "src": "a.md"}},
        {"r": "x", "i": 9, "t": "budget", "ts": 9, "d": {"kind": "steps", "used": 1}},
        {"r": "x", "i": 10, "t": "approval.request", "ts": 10, "d": {"call": "c1",
                                                                    "name": "open"}},
        {"r": "x", "i": 11, "t": "run.paused", "ts": 11, "d": {"reason": "approval",
                                                              "calls": ["c1"]}},
    ]
    out = [e for env in envs for e in m.map(env)]
    for e in out:
        EVENT.validate_python(e)
    assert out[-1]["outcome"]["interrupts"][0]["reason"] == "approval"
    # What was open is closed before the run's end: the message, then the step.
    assert [e["type"] for e in out[-3:]] == ["TEXT_MESSAGE_END", "STEP_FINISHED", "RUN_FINISHED"]
    deltas = [op for e in out if e["type"] == "STATE_DELTA" for op in e["delta"]]
    assert {"op": "add", "path": "/outputs/a~1b", "value": 3} in deltas
    assert deltas[-1] == {"op": "remove", "path": "/tables/notes/k1"}


JS = Path(__file__).resolve().parent / "js"


def node_client(url: str, tok: str, scenario: str, text: str) -> dict[str, Any]:
    """The official AG-UI client (tests/js, installed by tools/setup.sh) run by node."""
    if shutil.which("node") is None or not (JS / "node_modules" / "@ag-ui" / "client").is_dir():
        pytest.skip("node or tests/js/node_modules missing (tools/setup.sh installs them)")
    done = subprocess.run(["node", str(JS / "agui_client.mjs"), url, tok, scenario, text],
                          capture_output=True, text=True, timeout=120, cwd=JS)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_official_js_client_runs_text_tool_and_errors_without_a_warning(
    tmp_path: Path,
) -> None:
    with Stack(tmp_path, bridge_args=HTTP) as s:
        url = f"{http_url(s)}/v1/devices/thermo1/agui"
        got = node_client(url, token(s, "alice"), "run", "How warm is it in here?")
        assert got["logged"] == []
        (run,) = got["runs"]
        assert run["failed"] is None and run["outcome"]["type"] == "success", run
        assert run["events"][0] == "RUN_STARTED" and run["events"][-1] == "RUN_FINISHED"
        roles = [m["role"] for m in got["messages"]]
        assert roles[0] == "user" and "tool" in roles and roles[-1] == "assistant", roles
        call = next(m for m in got["messages"] if m["toolCalls"])["toolCalls"][0]
        assert call["name"] == "read_temperature"
        assert "°C" in got["messages"][-1]["content"]


def test_the_official_js_client_answers_an_interrupt_and_sees_a_cancel(tmp_path: Path) -> None:
    calls = [ToolCall("ask_user", json.dumps({"q": "Vent the tank as well?"}))]
    script = [Turn(tool_calls=calls, args_chunk_chars=3), Turn(text="Venting, as you said.")]
    with (
        ModelServer(script) as server,
        Stack(tmp_path, model_url=server.url, main_py=VALVES, bridge_args=HTTP) as s,
    ):
        url = f"{http_url(s)}/v1/devices/thermo1/agui"
        got = node_client(url, token(s, "alice"), "interrupt", "Check the line.")
        assert got["logged"] == []
        first, second = got["runs"]
        assert first["outcome"]["type"] == "interrupt", first
        assert second["failed"] is None and second["outcome"]["type"] == "success", second
        assert "TOOL_CALL_RESULT" in second["events"]
        assert got["messages"][-1] == {"role": "assistant", "content": "Venting, as you said.",
                                       "toolCalls": [], "toolCallId": None}  # fmt: skip

        server.override_next(Turn(text="slow " * 60, chunk_chars=5, delay_s=0.2))
        got = node_client(url, token(s, "alice"), "cancel", "Tell me a long story.")
        (run,) = got["runs"]
        assert run["events"][-1] == "RUN_ERROR", run
        assert run["error"]["code"] == "cancelled" and run["error"]["message"] == "enough", run
        assert got["logged"] == []


def test_the_official_js_client_sees_a_failed_run_as_a_run_error(tmp_path: Path) -> None:
    # Every model request answered HTTP 500 (an empty script): the run fails `llm`.
    with (
        ModelServer([]) as server,
        Stack(tmp_path, model_url=server.url, bridge_args=HTTP) as s,
    ):
        url = f"{http_url(s)}/v1/devices/thermo1/agui"
        got = node_client(url, token(s, "alice"), "run", "How warm is it?")
        (run,) = got["runs"]
        assert run["events"][0] == "RUN_STARTED" and run["events"][-1] == "RUN_ERROR", run
        assert run["error"]["code"] == "llm" and run["error"]["message"], run
        assert got["logged"] == []
