"""The test model server (tests/model_server.py) against the real OpenAIProvider, no MQTT.

These pin the provider on streams shaped like OpenAI's (thousands of tiny deltas, tool
arguments in many fragments, a usage chunk, chunked HTTP) and the server's own wire
shape, which the end-to-end tests rely on.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from server_bridge.models.base import ModelError
from server_bridge.models.openai import OpenAIProvider
from tests.model_server import ModelServer, ToolCall, Turn

USER: list[dict[str, Any]] = [{"role": "user", "content": "How warm is it in here?"}]
TOOLS: list[dict[str, Any]] = [
    {
        "name": "read_temperature",
        "description": "Read the room temperature",
        "args": {"type": "object", "properties": {}},
    }
]
# A bound for waits on a thread, far past anything the calls need: not a timing claim.
JOIN_S = 20.0


@pytest.fixture
def server() -> Iterator[ModelServer]:
    with ModelServer() as s:
        yield s


def complete(
    server: ModelServer, messages: list[dict[str, Any]] = USER, **kw: Any
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    chunks: list[dict[str, Any]] = []
    provider = OpenAIProvider(server.url, "gpt-test", api_key="sk-test")
    final = provider.complete(messages, kw.pop("tools", TOOLS), chunks.append, **kw)
    return chunks, final


def long_text(n: int) -> str:
    # Every position distinct enough that a lost, doubled or swapped chunk shows.
    words = (f"w{k}°" for k in range(n))
    return " ".join(words)[:n]


def test_a_2000_character_answer_in_4_character_chunks_arrives_whole_and_in_order(
    server: ModelServer,
) -> None:
    text = long_text(2000)
    server.script = [Turn(text=text, chunk_chars=4)]
    chunks, final = complete(server)
    assert [c["text"] for c in chunks] == [text[k : k + 4] for k in range(0, 2000, 4)]
    assert "".join(c["text"] for c in chunks) == text
    assert final["finish"] == "stop"


def test_3000_one_character_chunks(server: ModelServer) -> None:
    text = long_text(3000)
    server.script = [Turn(text=text, chunk_chars=1)]
    chunks, _ = complete(server)
    assert len(chunks) == 3000
    assert "".join(c["text"] for c in chunks) == text


def test_tool_call_arguments_in_3_character_fragments_are_reassembled_exactly(
    server: ModelServer,
) -> None:
    args = json.dumps({"room": "kitchen", "unit": "°C", "nested": {"a": [1, 2.5, None]}})
    other = '{"q": "warm \\"rooms\\""}'
    server.script = [
        Turn(
            text="Let me check.",
            tool_calls=[
                ToolCall("read_temperature", args, id="call_A"),
                ToolCall("memory_recall", other),
            ],
            args_chunk_chars=3,
        )
    ]
    chunks, final = complete(server)
    assert chunks == [
        {"text": "Let "},
        {"text": "me c"},
        {"text": "heck"},
        {"text": "."},
        {"tool": {"call": "call_A", "name": "read_temperature", "input": args}},
        {"tool": {"call": "call_1_1", "name": "memory_recall", "input": other}},
    ]
    assert final["finish"] == "tool_calls"


def test_usage_is_read_from_the_usage_chunk(server: ModelServer) -> None:
    server.script = [Turn(text="21.5", reasoning="The sensor says so.", usage=(120, 34))]
    chunks, final = complete(server)
    # reasoning_tokens: the server's estimate for 19 characters of reasoning.
    assert final == {"usage": {"in": 120, "out": 34, "reason": 4}, "finish": "stop"}
    assert chunks[0] == {"reason": "The "} and chunks[-1] == {"text": "21.5"}
    body = server.requests[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_the_turn_follows_the_conversation(server: ModelServer) -> None:
    server.script = [
        Turn(tool_calls=[ToolCall("read_temperature")]),
        Turn(text="It is {last_tool_output} °C."),
    ]
    first, final = complete(server)
    assert first == [{"tool": {"call": "call_1_0", "name": "read_temperature", "input": "{}"}}]
    assert final["finish"] == "tool_calls"
    conversation: list[dict[str, Any]] = USER + [
        {"role": "assistant", "content": "", "tools": [first[0]["tool"]]},
        {"role": "tool", "call": "call_1_0", "content": "21.5"},
    ]
    second, _ = complete(server, conversation)
    assert "".join(c["text"] for c in second) == "It is 21.5 °C."
    # Past the end of the script: an error, never an invented answer.
    past = conversation + [{"role": "assistant", "content": "It is 21.5 °C."}]
    with pytest.raises(ModelError, match=r"HTTP 500"):
        complete(server, past + USER)
    assert [len(b["messages"]) for b in server.requests] == [1, 3, 5]


def test_http_500_is_a_model_error(server: ModelServer) -> None:
    server.script = [Turn(status=500)]
    with pytest.raises(ModelError, match=r"failed \(HTTP 500\)"):
        complete(server)


def test_override_next_answers_before_the_script(server: ModelServer) -> None:
    server.script = [Turn(text="fine")]
    server.override_next(Turn(status=429, body='{"error": {"message": "slow down"}}'))
    with pytest.raises(ModelError, match=r"rate limiting requests \(HTTP 429\)"):
        complete(server)
    chunks, _ = complete(server)  # the same conversation again: the script's turn
    assert chunks == [{"text": "fine"}]


def test_a_connection_dropped_mid_stream_is_a_model_error(server: ModelServer) -> None:
    # The role chunk and two text chunks, then the connection closes mid-body.
    server.script = [Turn(text="abcdefghijklmnop", chunk_chars=4, drop_after=3)]
    chunks: list[dict[str, Any]] = []
    provider = OpenAIProvider(server.url, "gpt-test", api_key="sk-test")
    with pytest.raises(ModelError) as info:
        provider.complete(USER, TOOLS, chunks.append)
    # http.client reads a chunked body cut short as its end (readline gives b""), so
    # the provider reports the missing finish rather than a broken connection.
    assert str(info.value) == "the model server ended the stream early"
    assert chunks == [{"text": "abcd"}, {"text": "efgh"}]


def test_the_end_of_each_complete_stream_is_timed_and_a_dropped_one_has_none(
    server: ModelServer,
) -> None:
    server.script = [Turn(text="abcdefgh", chunk_chars=4)]
    server.override_next(Turn(text="abcdefgh", chunk_chars=4, drop_after=2))
    with pytest.raises(ModelError):
        complete(server)
    before = time.monotonic()
    chunks, _ = complete(server)
    assert chunks == [{"text": "abcd"}, {"text": "efgh"}]
    # Stamped by the server's thread just after its last write, which the provider may
    # read before the stamp is taken: wait for it (bounded).
    deadline = time.monotonic() + JOIN_S
    while 2 not in server.stream_ends and time.monotonic() < deadline:
        time.sleep(0.01)
    ends = server.stream_ends
    assert list(ends) == [2]
    assert before < ends[2] <= time.monotonic()


def test_a_hung_server_ends_the_call_at_its_deadline(server: ModelServer) -> None:
    server.script = [Turn(text="too late", hang_s=60)]
    outcome: list[Any] = []

    def call() -> None:
        try:
            outcome.append(complete(server, deadline=time.monotonic() + 0.5))
        except ModelError as e:
            outcome.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(JOIN_S)
    assert not t.is_alive(), "the call waited for the hung server past its deadline"
    assert isinstance(outcome[0], ModelError)
    assert str(outcome[0]) in (
        "the model server timed out",
        "the model server did not finish in time",
    )


def test_the_wire_is_shaped_like_openai_chunks(server: ModelServer) -> None:
    server.script = [Turn(text="Hi!", tool_calls=[ToolCall("t", '{"x":1}', id="c1")])]
    body = {
        "model": "gpt-test",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": USER,
    }
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=JOIN_S)
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = conn.getresponse()
    assert response.status == 200 and response.version == 11
    assert response.getheader("Content-Type") == "text/event-stream; charset=utf-8"
    assert response.getheader("Transfer-Encoding") == "chunked"
    raw = response.read().decode()
    conn.close()
    assert raw.endswith("\n\ndata: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    objs = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert {o["id"] for o in objs} == {"chatcmpl-wren1"}
    assert all(o["object"] == "chat.completion.chunk" and o["model"] == "gpt-test" for o in objs)
    deltas = [o["choices"][0]["delta"] for o in objs[:-1]]
    finishes = [o["choices"][0]["finish_reason"] for o in objs[:-1]]
    assert deltas == [
        {"role": "assistant", "content": "", "refusal": None},
        {"content": "Hi!"},
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "t", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"x":1}'}}]},
        {},
    ]
    assert finishes == [None, None, None, None, "tool_calls"]
    assert all(o["usage"] is None for o in objs[:-1])
    last = objs[-1]
    assert last["choices"] == []
    assert (
        last["usage"]["total_tokens"]
        == last["usage"]["prompt_tokens"] + last["usage"]["completion_tokens"]
    )

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=JOIN_S)
    conn.request("GET", "/v1/models")
    models = json.loads(conn.getresponse().read())
    conn.close()
    assert models["data"][0]["id"] == "wren-test-model"


def test_closing_the_server_ends_a_hang_at_once() -> None:
    # A hanging response must not hold close(): the test that owns it would wait.
    server = ModelServer([Turn(hang_s=600)]).start()
    outcome: list[Any] = []

    def call() -> None:
        try:
            outcome.append(complete(server))
        except ModelError as e:
            outcome.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    server.wait_requests(1, timeout=JOIN_S)
    server.close()
    t.join(JOIN_S)
    assert not t.is_alive() and isinstance(outcome[0], ModelError)
