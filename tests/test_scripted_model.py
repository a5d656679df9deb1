"""The scripted provider: deterministic, stateless turns in the contract's chunk shapes."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from server_bridge.models.base import ModelError, Provider
from server_bridge.models.scripted import DEMO_SCRIPT, ScriptedProvider


def play(
    provider: ScriptedProvider, messages: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    chunks: list[dict[str, Any]] = []
    final = provider.complete(messages, [], chunks.append)
    return chunks, final


def text_of(chunks: list[dict[str, Any]], key: str = "text") -> str:
    return "".join(c[key] for c in chunks if key in c)


USER = {"role": "user", "content": "How warm is it?"}


def test_stops_at_the_deadline() -> None:
    # Called the way the RPC layer calls any Provider, deadline included.
    provider: Provider = ScriptedProvider(chunk_chars=1)
    chunks: list[dict[str, Any]] = []
    final = provider.complete([USER], [], chunks.append, deadline=time.monotonic() + 60)
    assert final["finish"] == "tool_calls" and chunks

    def slow_emit(chunk: dict[str, Any]) -> None:
        # An emit that blocks (a full outgoing queue, say) until past the deadline.
        time.sleep(0.02)
        chunks.append(chunk)

    chunks.clear()
    with pytest.raises(ModelError, match="did not finish in time"):
        provider.complete([USER], [], slow_emit, deadline=time.monotonic() + 0.05)
    assert 0 < len(chunks) < len("Let me check the sensor.")  # stopped part-way
    with pytest.raises(ModelError, match="did not finish in time"):
        provider.complete([USER], [], chunks.append, deadline=time.monotonic() - 1)


def test_demo_turn_0_streams_text_then_calls_the_tool() -> None:
    chunks, final = play(ScriptedProvider(chunk_chars=5), [USER])
    assert text_of(chunks) == "Let me check the sensor."
    text_chunks = [c for c in chunks if "text" in c]
    assert len(text_chunks) > 1 and all(len(c["text"]) <= 5 for c in text_chunks)
    assert chunks[-1] == {"tool": {"call": "c1", "name": "read_temperature", "input": "{}"}}
    assert final["finish"] == "tool_calls"
    assert set(final["usage"]) == {"in", "out", "reason"}


def test_demo_turn_1_echoes_the_tool_output() -> None:
    messages: list[dict[str, Any]] = [
        USER,
        {
            "role": "assistant",
            "content": "Let me check the sensor.",
            "tools": [{"call": "c1", "name": "read_temperature", "input": "{}"}],
        },
        {"role": "tool", "call": "c1", "content": "21.5"},
    ]
    chunks, final = play(ScriptedProvider(), messages)
    assert text_of(chunks) == "It is 21.5 °C in here."
    assert final["finish"] == "stop"
    assert not any("tool" in c for c in chunks)


def test_turn_choice_is_stateless_and_repeatable() -> None:
    provider = ScriptedProvider()
    first = play(provider, [USER])
    again = play(provider, [USER])  # a retried call plays the same turn
    assert first == again


def test_exhausted() -> None:
    messages = [USER, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(ModelError, match="script exhausted"):
        play(ScriptedProvider(), messages)


def test_reasoning_and_call_ids_continue_across_turns() -> None:
    script: list[list[dict[str, Any]]] = [
        [{"reason": "think first"}, {"tool": {"name": "a", "input": {"x": 1}}}],
        [{"tool": {"name": "b", "input": {}}}, {"tool": {"name": "c"}}],
        [{"text": "done: {last_tool_output}"}],
    ]
    provider = ScriptedProvider(script, chunk_chars=3)
    chunks, final = play(provider, [USER])
    assert text_of(chunks, "reason") == "think first"
    assert chunks[-1] == {"tool": {"call": "c1", "name": "a", "input": json.dumps({"x": 1})}}
    assert final["usage"]["reason"] == len("think first") // 4
    history: list[dict[str, Any]] = [
        USER,
        {"role": "assistant", "content": "", "tools": [{"call": "c1", "name": "a", "input": "{}"}]},
        {"role": "tool", "call": "c1", "content": "one"},
    ]
    chunks, _ = play(provider, history)
    assert [c["tool"]["call"] for c in chunks] == ["c2", "c3"]
    history += [
        {"role": "assistant", "content": "", "tools": [{"call": "c2"}, {"call": "c3"}]},
        {"role": "tool", "call": "c2", "content": "two"},
        {"role": "tool", "call": "c3", "content": "three"},
    ]
    chunks, final = play(provider, history)
    assert text_of(chunks) == "done: three"
    assert final["finish"] == "stop"


def test_placeholder_without_a_tool_message() -> None:
    chunks, _ = play(ScriptedProvider([[{"text": "got {last_tool_output}"}]]), [USER])
    assert text_of(chunks) == "got (no tool output)"


def test_usage_grows_with_the_conversation() -> None:
    provider = ScriptedProvider([[{"text": "ok"}], [{"text": "ok"}]])
    _, short = play(provider, [USER])
    _, long = play(provider, [{"role": "user", "content": "x" * 400}])
    assert long["usage"]["in"] > short["usage"]["in"]


@pytest.mark.parametrize(
    "script",
    [
        "text",
        [{"text": "not a turn"}],
        [[{"text": 3}]],
        [[{"text": "a", "reason": "b"}]],
        [[{"shout": "a"}]],
        [[{"tool": {"input": {}}}]],
        [[{"tool": {"name": "x", "input": [1]}}]],
    ],
)
def test_bad_scripts_are_refused_at_load(script: Any) -> None:
    with pytest.raises(ValueError):
        ScriptedProvider(script)


def test_from_file(tmp_path: Path) -> None:
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(DEMO_SCRIPT))
    provider = ScriptedProvider.from_file(path)
    assert provider.script == DEMO_SCRIPT
    path.write_text(json.dumps({"turns": [[{"text": "abcdef"}]], "chunk_chars": 2}))
    chunks, _ = play(ScriptedProvider.from_file(path), [USER])
    assert chunks == [{"text": "ab"}, {"text": "cd"}, {"text": "ef"}]


DIALOGUES: list[dict[str, Any]] = [
    {
        "when": "my usual",
        "turns": [
            [{"tool": {"name": "memory.recall", "input": {"query": "usual temperature"}}}],
            [{"tool": {"name": "set_temperature", "input": {"celsius": "{last_tool_number}"}}}],
            [{"text": "Set to your usual, {last_tool_output}."}],
        ],
    },
    {"turns": [[{"text": "Hello."}]]},
]


def test_the_dialogue_is_chosen_by_the_user_messages() -> None:
    p = ScriptedProvider(DIALOGUES)
    usual = {"role": "user", "content": "Set it to MY USUAL, please"}
    chunks, final = play(p, [usual])
    assert chunks == [
        {"tool": {"call": "c1", "name": "memory.recall", "input": '{"query": "usual temperature"}'}}
    ]
    assert final["finish"] == "tool_calls"
    chunks, _ = play(p, [{"role": "user", "content": "Hi"}])
    assert text_of(chunks) == "Hello."


def test_a_tool_input_takes_the_last_number_of_the_last_tool_output() -> None:
    p = ScriptedProvider(DIALOGUES)
    convo = [
        {"role": "user", "content": "my usual"},
        {"role": "assistant", "content": "", "tools": [{"call": "c1", "name": "memory.recall"}]},
        {"role": "tool", "call": "c1", "content": "[recalled data] usual_celsius: 22"},
    ]
    chunks, _ = play(p, convo)
    assert json.loads(chunks[0]["tool"]["input"]) == {"celsius": 22}  # a number, not "22"
    convo[-1]["content"] = "[recalled data] usual_celsius: 22.5"
    chunks, _ = play(p, convo)
    assert json.loads(chunks[0]["tool"]["input"]) == {"celsius": 22.5}
    assert chunks[0]["tool"]["call"] == "c2"


def test_a_script_with_no_dialogue_for_the_request_fails_the_call_by_name() -> None:
    p = ScriptedProvider([{"when": "only this", "turns": [[{"text": "x"}]]}])
    with pytest.raises(ModelError, match="no scripted dialogue"):
        play(p, [USER])


@pytest.mark.parametrize(
    "bad",
    [
        [{"when": "", "turns": [[{"text": "x"}]]}],
        [{"when": 3, "turns": [[{"text": "x"}]]}],
        [{"when": "a", "turns": [[{"nope": "x"}]]}],
    ],
)
def test_malformed_dialogues_are_refused_at_load(bad: list[dict[str, Any]]) -> None:
    with pytest.raises(ValueError):
        ScriptedProvider(bad)
