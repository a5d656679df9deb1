"""A model provider that plays a declared script: tests, demos, hardware-in-loop runs.

A script is a list of turns; a turn is a list of steps:

    {"text": "..."}                               assistant text, streamed in small chunks
    {"reason": "..."}                             reasoning text
    {"tool": {"name": "...", "input": {...}}}     a tool call

Which turn plays is derived from the conversation alone — the number of assistant
messages already in it — so the provider keeps no state between calls: a retried call
plays the same turn, and several boards can share one provider. A text step may contain
`{last_tool_output}`, replaced by the content of the conversation's last tool message,
so a scripted demo honestly repeats what the board's tool returned instead of inventing
a reading; a tool input's string value that is exactly `{last_tool_number}` becomes the
last number in that content (a remembered setting, say, read back from memory).

A script may also hold several dialogues, `{"when": "...", "turns": [...]}`: the first
whose `when` a user message of the conversation contains (case-insensitively) plays,
and one without `when` plays otherwise. So one scripted model can answer "set it to 22,
my usual" and, in a later request, "set it to my usual" differently.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from server_bridge.models.base import Chunk, Final, ModelError

__all__ = ["DEMO_SCRIPT", "PLACEHOLDER", "ScriptedProvider"]

PLACEHOLDER = "{last_tool_output}"
NUMBER = "{last_tool_number}"
NO_TOOL_OUTPUT = "(no tool output)"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

Step = Mapping[str, Any]
Turns = Sequence[Sequence[Step]]
Script = Turns | Sequence[Mapping[str, Any]]

# The demo's three conversations (tools/demo.py asks each in turn): a user's usual
# temperature remembered in one request (a durable user field on the bridge) and used in
# a later one, and the room's temperature otherwise.
DEMO_SCRIPT: list[dict[str, Any]] = [
    {
        "when": "remember",
        "turns": [
            [
                {"text": "Setting 22 °C, and noting it as your usual."},
                {"tool": {"name": "set_temperature", "input": {"celsius": 22}}},
                {
                    "tool": {
                        "name": "memory.remember",
                        "input": {"field": "usual_celsius", "value": 22},
                    }
                },
            ],
            [{"text": "Done: the thermostat is set to 22 °C, and I will remember it."}],
        ],
    },  # fmt: skip
    {
        "when": "my usual",
        "turns": [
            [
                {"text": "Let me look up your usual."},
                {"tool": {"name": "memory.load", "input": {"field": "usual_celsius"}}},
            ],
            [
                {"text": "Setting it."},
                {"tool": {"name": "set_temperature", "input": {"celsius": NUMBER}}},
            ],
            [{"text": "Done: the thermostat is {last_tool_output}, your usual."}],
        ],
    },
    {
        "turns": [
            [
                {"text": "Let me check the sensor."},
                {"tool": {"name": "read_temperature", "input": {}}},
            ],
            [
                {"text": "It is {last_tool_output} °C in here."},
            ],
        ]
    },
]


def _tokens(text: str) -> int:
    # Rough token count (about four characters a token): the script has no tokenizer
    # and usage only needs to be plausible and deterministic.
    return len(text) // 4


Dialogue = tuple[str | None, list[list[dict[str, Any]]]]


def _check_dialogues(script: object) -> list[Dialogue]:
    """A script as (when, turns) dialogues: a plain list of turns is one, with no `when`."""
    if not isinstance(script, Sequence) or isinstance(script, (str, bytes)):
        raise ValueError("a script is a list of turns or of dialogues")
    if not script or not all(isinstance(d, Mapping) and "turns" in d for d in script):
        return [(None, _check_script(script))]
    out: list[Dialogue] = []
    for k, d in enumerate(script):
        when = d.get("when")
        if when is not None and (not isinstance(when, str) or not when):
            raise ValueError(f"dialogue {k}: when must be a non-empty str")
        out.append((when.lower() if when else None, _check_script(d["turns"])))
    return out


def _number_in(text: str) -> int | float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    value = float(found[-1])
    return int(value) if value.is_integer() else value


def _fill(value: Any, number: int | float | None) -> Any:
    """A tool input with every string exactly NUMBER replaced (recursively)."""
    if value == NUMBER:
        return number
    if isinstance(value, dict):
        return {k: _fill(v, number) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, number) for v in value]
    return value


def _check_script(script: object) -> list[list[dict[str, Any]]]:
    if not isinstance(script, Sequence) or isinstance(script, (str, bytes)):
        raise ValueError("a script is a list of turns")
    turns: list[list[dict[str, Any]]] = []
    for t, turn in enumerate(script):
        if not isinstance(turn, Sequence) or isinstance(turn, (str, bytes)):
            raise ValueError(f"turn {t} must be a list of steps")
        steps: list[dict[str, Any]] = []
        for s, step in enumerate(turn):
            where = f"turn {t} step {s}"
            if not isinstance(step, Mapping) or len(step) != 1:
                raise ValueError(f"{where} must be a map with exactly one of text, reason, tool")
            ((key, value),) = step.items()
            if key in ("text", "reason"):
                if not isinstance(value, str):
                    raise ValueError(f"{where}: {key} must be a str")
            elif key == "tool":
                if not isinstance(value, Mapping) or not isinstance(value.get("name"), str):
                    raise ValueError(f"{where}: tool needs a name")
                args = value.get("input", {})
                if not isinstance(args, Mapping):
                    raise ValueError(f"{where}: tool input must be a map")
                json.dumps(args)  # refuse what could never be sent, at load time
                value = {"name": value["name"], "input": dict(args)}
            else:
                raise ValueError(f"{where}: unknown step kind {key!r}")
            steps.append({key: value})
        turns.append(steps)
    return turns


class ScriptedProvider:
    """Plays `script` (default: DEMO_SCRIPT); text is emitted in chunks of `chunk_chars`."""

    def __init__(
        self,
        script: Script = DEMO_SCRIPT,
        chunk_chars: int = 8,
        name: str = "scripted",
    ) -> None:
        if chunk_chars < 1:
            raise ValueError("chunk_chars must be >= 1")
        self.dialogues = _check_dialogues(script)
        self.chunk_chars = chunk_chars
        self.name = name

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], chunk_chars: int = 8) -> ScriptedProvider:
        """Load a script from JSON: a list of turns or of dialogues, or
        {"turns": [...], "chunk_chars": n}."""
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if isinstance(data, dict):
            chunk_chars = int(data.get("chunk_chars", chunk_chars))
            data = data.get("turns")
        return cls(data, chunk_chars=chunk_chars, name=f"scripted:{Path(path).name}")

    def complete(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        emit: Callable[[Chunk], None],
        model: str | None = None,
        max_tokens: int | None = None,
        *,
        deadline: float | None = None,
    ) -> Final:
        # The conversation's earlier turns the bridge put in (`hist`) are read by the
        # model, not by the script, which answers the run's own request.
        everything = [m for m in messages if isinstance(m, Mapping)]
        msgs = [m for m in everything if not m.get("hist")]
        script = self._dialogue(msgs)
        turn = sum(1 for m in msgs if m.get("role") == "assistant")
        if turn >= len(script):
            raise ModelError("script exhausted")
        # Call ids continue from the tool calls already in the conversation, so they are
        # unique within it (c1, c2, ...) and the same on every replay of the call.
        calls_so_far = sum(
            len(m.get("tools") or [])
            for m in msgs
            if m.get("role") == "assistant" and isinstance(m.get("tools") or [], list)
        )
        last_tool = NO_TOOL_OUTPUT
        for m in msgs:
            if m.get("role") == "tool":
                content = m.get("content")
                last_tool = content if isinstance(content, str) else json.dumps(content)

        usage_in = sum(_tokens(str(m.get("content") or "")) for m in everything)
        usage_in += sum(_tokens(json.dumps(t, default=str)) for t in tools)
        out = reason = 0
        called = False

        def send(chunk: Chunk) -> None:
            # Checked per chunk like a real stream would be: a script is fast, but the
            # emit it is given may block (a full outgoing queue) past the call's end.
            if deadline is not None and time.monotonic() >= deadline:
                # Past the call's limit, as a real model's would be: not retryable.
                raise ModelError("the scripted model did not finish in time", "timeout", False)
            emit(chunk)

        for step in script[turn]:
            if "text" in step:
                text = step["text"].replace(PLACEHOLDER, last_tool)
                for k in range(0, len(text), self.chunk_chars):
                    send({"text": text[k : k + self.chunk_chars]})
                out += _tokens(text)
            elif "reason" in step:
                text = step["reason"]
                for k in range(0, len(text), self.chunk_chars):
                    send({"reason": text[k : k + self.chunk_chars]})
                reason += _tokens(text)
            else:
                calls_so_far += 1
                args = json.dumps(_fill(step["tool"]["input"], _number_in(last_tool)))
                send(
                    {
                        "tool": {
                            "call": f"c{calls_so_far}",
                            "name": step["tool"]["name"],
                            "input": args,
                        }
                    }
                )
                out += _tokens(step["tool"]["name"] + args) + 1
                called = True
        return {
            "usage": {"in": usage_in, "out": out, "reason": reason},
            "finish": "tool_calls" if called else "stop",
        }

    def _dialogue(self, msgs: Sequence[Mapping[str, Any]]) -> list[list[dict[str, Any]]]:
        # Every user message, not the first: the board may put recalled data in a user
        # message of its own ahead of the request (memory.load).
        text = "\n".join(
            str(m.get("content") or "").lower() for m in msgs if m.get("role") == "user"
        )
        fallback = None
        for when, turns in self.dialogues:
            if when is None:
                fallback = fallback if fallback is not None else turns
            elif when in text:
                return turns
        if fallback is None:
            raise ModelError("no scripted dialogue for this request")
        return fallback
