"""Wren runs as AG-UI events (https://docs.ag-ui.com; PROTOCOL.md "HTTP", "AG-UI").

An AG-UI client (its HttpAgent) POSTs a RunAgentInput (`threadId`, `runId`, `messages`,
...) and reads the answer as SSE `data:` frames of camelCase JSON events. Here the
thread is the Wren conversation, the client's run id is the request's id (so a repeat
POST of the same run starts nothing new on the board), the last user message is the
request's text, and `resume` answers what a run paused on: a client tool's result, or
an approval. Each Wren event of the run becomes the AG-UI events below (`Mapper`), in
the run's order; the last frame of each Wren event carries `id: <run>:<event id>`
(an event mapped to none sends no frame), so `Last-Event-ID` resumes a dropped stream
exactly after the last event it got.

| Wren | AG-UI |
|---|---|
| run.started | RUN_STARTED (then a STATE_SNAPSHOT of the run's public outputs and tables) |
| msg.start / msg.delta / msg.end | TEXT_MESSAGE_START / _CONTENT / _END |
| reason.delta | REASONING_START, REASONING_MESSAGE_START, _CONTENT (closed with the message) |
| tool.call | TOOL_CALL_START, TOOL_CALL_ARGS (its JSON input), TOOL_CALL_END |
| tool.result | TOOL_CALL_RESULT |
| node.start / node.end | STEP_STARTED / STEP_FINISHED (the node's path) |
| output, row, row.delete | STATE_DELTA (JSON Patch on /outputs and /tables) |
| run.paused | RUN_FINISHED, outcome interrupt (one per waiting call) |
| run.done | RUN_FINISHED, outcome success, with its token usage |
| run.failed / run.cancelled | RUN_ERROR (code: the failure's kind / `cancelled`) |
| anything else (citation, memory, budget, usage, guard, error) | CUSTOM (name: its type) |
"""

from __future__ import annotations

from typing import Any

__all__ = ["Mapper", "interrupt_id", "parse_interrupt_id"]

# An interrupt's id names the run and the call it waits on, so a resume finds both.
_SEP = "/"


def interrupt_id(run: str, call: str) -> str:
    return f"{run}{_SEP}{call}"


def parse_interrupt_id(value: str) -> tuple[str, str] | None:
    run, sep, call = value.partition(_SEP)
    return (run, call) if sep and run and call else None


def _pointer(key: str) -> str:
    # A JSON Pointer token (RFC 6901).
    return key.replace("~", "~0").replace("/", "~1")


class Mapper:
    """The AG-UI events of one Wren run, event by event (see the module docstring)."""

    def __init__(self, thread_id: str, run_id: str, announce: bool = True) -> None:
        # announce: this stream is an AG-UI run of its own (a POST), so it opens with
        # RUN_STARTED whatever Wren event it meets first (a resume meets the run
        # mid-way); False for a stream that goes on after Last-Event-ID.
        self.thread_id = thread_id
        self.run_id = run_id
        self.ended = False
        self._announce = announce
        self._goes_on = not announce
        # What state the client holds: snapshot sent, the outputs and tables in it.
        self._state_sent = False
        self._tables: set[str] = set()
        self._rows: set[tuple[str, str]] = set()
        self._outputs: set[str] = set()
        # Messages open, by Wren `m`: text, and reasoning.
        self._text_open: set[str] = set()
        self._reasoning_open: set[str] = set()
        # Calls waiting on a client ("tool") or on a person ("approval").
        self._waits: dict[str, str] = {}
        # Steps this stream started and has not finished, by name (a node path may be
        # active more than once): an AG-UI run ends with none active.
        self._steps: dict[str, int] = {}

    def _mid(self, run: str, m: Any) -> str:
        return f"{run}:m{m}"

    def map(self, env: dict[str, Any]) -> list[dict[str, Any]]:
        t, d, run = env.get("t"), env.get("d") or {}, str(env.get("r"))
        ts = env.get("ts")
        out = self._map(t, d, run, str(env.get("n") or "step"))
        if self._announce:
            self._announce = False
            if not out or out[0]["type"] != "RUN_STARTED":
                out.insert(0, {"type": "RUN_STARTED", "threadId": self.thread_id,
                               "runId": self.run_id})  # fmt: skip
        elif t == "run.resumed":
            out = []  # announced already (by this stream's RUN_STARTED)
        for e in out:
            if isinstance(ts, int):
                e.setdefault("timestamp", ts)
        return out

    def _map(self, t: Any, d: dict[str, Any], run: str, node: str) -> list[dict[str, Any]]:
        ids = {"threadId": self.thread_id, "runId": self.run_id}
        if t == "run.started":
            self._state_sent = True
            return [{"type": "RUN_STARTED", **ids},
                    {"type": "STATE_SNAPSHOT", "snapshot": {"outputs": {}, "tables": {}}}]
        if t == "run.resumed":
            return [{"type": "RUN_STARTED", **ids}]
        if t == "msg.start":
            # Started with its first text: a turn that only calls tools is no message.
            return []
        if t == "msg.delta":
            mid = self._mid(run, d.get("m"))
            out = []
            if mid not in self._text_open:
                self._text_open.add(mid)
                out.append({"type": "TEXT_MESSAGE_START", "messageId": mid, "role": "assistant"})
            text = d.get("text")
            if isinstance(text, str) and text:
                out.append({"type": "TEXT_MESSAGE_CONTENT", "messageId": mid, "delta": text})
            return out
        if t == "reason.delta":
            mid = self._mid(run, d.get("m")) + ":r"
            out = []
            if mid not in self._reasoning_open:
                self._reasoning_open.add(mid)
                out += [{"type": "REASONING_START", "messageId": mid},
                        {"type": "REASONING_MESSAGE_START", "messageId": mid,
                         "role": "reasoning"}]  # fmt: skip
            text = d.get("text")
            if isinstance(text, str) and text:
                out.append({"type": "REASONING_MESSAGE_CONTENT", "messageId": mid, "delta": text})
            return out
        if t == "msg.end":
            mid = self._mid(run, d.get("m"))
            out = self._close_reasoning(mid + ":r")
            if mid in self._text_open:
                self._text_open.discard(mid)
                out.append({"type": "TEXT_MESSAGE_END", "messageId": mid})
            return out
        if t == "tool.call":
            call = str(d.get("call"))
            if d.get("client"):
                self._waits[call] = "tool"
            args = d.get("input")
            out = [{"type": "TOOL_CALL_START", "toolCallId": call,
                    "toolCallName": str(d.get("name"))}]  # fmt: skip
            if isinstance(args, str) and args:
                out.append({"type": "TOOL_CALL_ARGS", "toolCallId": call, "delta": args})
            out.append({"type": "TOOL_CALL_END", "toolCallId": call})
            return out
        if t == "tool.result":
            call = str(d.get("call"))
            self._waits.pop(call, None)
            output = d.get("output")
            return [{"type": "TOOL_CALL_RESULT", "messageId": f"{run}:result:{call}",
                     "toolCallId": call, "role": "tool",
                     "content": output if isinstance(output, str) else _json(output)}]  # fmt: skip
        if t == "approval.request":
            self._waits[str(d.get("call"))] = "approval"
            return [_custom(t, d)]
        if t in ("approval.granted", "approval.denied"):
            self._waits.pop(str(d.get("call")), None)
            return [_custom(t, d)]
        if t == "node.start":
            self._steps[node] = self._steps.get(node, 0) + 1
            return [{"type": "STEP_STARTED", "stepName": node}]
        if t == "node.end":
            if not self._steps.get(node):
                if self._goes_on:
                    return [{"type": "STEP_FINISHED", "stepName": node}]
                # Started before this AG-UI run (a Wren run resumed after a pause):
                # finished here as a note, since this run never started it.
                return [_custom(t, {**d, "node": node})]
            self._steps[node] -= 1
            return [{"type": "STEP_FINISHED", "stepName": node}]
        if t in ("output", "row", "row.delete"):
            return self._state(t, d)
        if t == "run.paused":
            self.ended = True
            calls = [c for c in d.get("calls") or () if isinstance(c, str)]
            interrupts = [{"id": interrupt_id(run, c),
                           "reason": self._waits.get(c, str(d.get("reason") or "tool")),
                           "toolCallId": c} for c in calls]  # fmt: skip
            return [*self._close_all(), {"type": "RUN_FINISHED", **ids, "outcome": {
                "type": "interrupt", "interrupts": interrupts}}]
        if t == "run.done":
            self.ended = True
            usage = d.get("usage") or {}
            end: dict[str, Any] = {"type": "RUN_FINISHED", **ids, "outcome": {"type": "success"}}
            if isinstance(usage, dict) and usage:
                end["usage"] = [{"inputTokens": _n(usage.get("in")),
                                 "outputTokens": _n(usage.get("out")),
                                 "reasoningTokens": _n(usage.get("reason"))}]  # fmt: skip
            return [*self._close_all(), end]
        if t == "run.failed":
            self.ended = True
            err = d.get("err") or {}
            return [*self._close_all(), {"type": "RUN_ERROR",
                                         "message": str(err.get("msg") or "the run failed"),
                                         "code": str(err.get("kind") or "failed")}]  # fmt: skip
        if t == "run.cancelled":
            self.ended = True
            reason = str(d.get("reason") or "cancelled")
            return [*self._close_all(),
                    {"type": "RUN_ERROR", "code": "cancelled", "message": reason}]
        return [_custom(str(t), d)]

    def _close_reasoning(self, mid: str) -> list[dict[str, Any]]:
        if mid not in self._reasoning_open:
            return []
        self._reasoning_open.discard(mid)
        return [{"type": "REASONING_MESSAGE_END", "messageId": mid},
                {"type": "REASONING_END", "messageId": mid}]  # fmt: skip

    def _close_all(self) -> list[dict[str, Any]]:
        # A run that ends with a message open (a failure mid-answer) closes it first:
        # an AG-UI client expects every start to have its end.
        out = []
        for mid in sorted(self._reasoning_open):
            out += self._close_reasoning(mid)
        for mid in sorted(self._text_open):
            out.append({"type": "TEXT_MESSAGE_END", "messageId": mid})
        self._text_open.clear()
        # Steps still open (a tool the run waits on, a node a failure cut short).
        for name, n in self._steps.items():
            out += [{"type": "STEP_FINISHED", "stepName": name}] * n
        self._steps.clear()
        return out

    def _state(self, t: str, d: dict[str, Any]) -> list[dict[str, Any]]:
        ops: list[dict[str, Any]] = []
        if t == "output":
            name = str(d.get("name"))
            path = "/outputs/" + _pointer(name)
            if "value" in d:
                ops.append({"op": "replace" if name in self._outputs else "add", "path": path,
                            "value": d.get("value")})  # fmt: skip
                self._outputs.add(name)
            else:
                return [_custom(t, d)]  # a streamed delta: the final value comes as `value`
        else:
            field, key = str(d.get("field")), str(d.get("row"))
            table = "/tables/" + _pointer(field)
            if field not in self._tables:
                self._tables.add(field)
                ops.append({"op": "add", "path": table, "value": {}})
            path = table + "/" + _pointer(key)
            if t == "row.delete":
                if (field, key) not in self._rows:
                    return []
                self._rows.discard((field, key))
                ops.append({"op": "remove", "path": path})
            else:
                row = {k: d[k] for k in ("status", "value", "ver", "links", "err") if k in d}
                ops.append({"op": "replace" if (field, key) in self._rows else "add",
                            "path": path, "value": row})  # fmt: skip
                self._rows.add((field, key))
        out: list[dict[str, Any]] = []
        if not self._state_sent:
            # Met mid-way (a resume after the run.started): the client's state is built
            # from here.
            self._state_sent = True
            out.append({"type": "STATE_SNAPSHOT", "snapshot": {"outputs": {}, "tables": {}}})
        out.append({"type": "STATE_DELTA", "delta": ops})
        return out


def _custom(name: str, d: Any) -> dict[str, Any]:
    return {"type": "CUSTOM", "name": name, "value": d}


def _n(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def _json(value: Any) -> str:
    import json

    return json.dumps(value, ensure_ascii=False, default=str)
