"""OpenAIProvider against a loopback HTTP server that plays the chat-completions SSE wire."""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from server_bridge.models.base import ModelError
from server_bridge.models.openai import OpenAIProvider
from tools.broker import free_port

KEY = "sk-test-0123456789abcdef"


@dataclass
class Reply:
    status: int = 200
    parts: list[bytes] = field(default_factory=list)
    content_type: str = "text/event-stream"
    # After the parts: send this every 50 ms (None: send nothing) until the client goes
    # away or the test ends; with `hold` the server keeps the response open meanwhile.
    repeat: bytes | None = None
    hold: bool = False


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


class Peer:
    """A scripted OpenAI-compatible server: records each request, plays the next reply.
    Each reply part is written and flushed on its own, so SSE lines arrive split."""

    def __init__(self) -> None:
        self.replies: list[Reply] = []
        self.seen: list[Seen] = []
        self.done = threading.Event()
        peer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length))
                peer.seen.append(Seen(self.path, dict(self.headers.items()), body))
                reply = peer.replies.pop(0)
                self.send_response(reply.status)
                self.send_header("Content-Type", reply.content_type)
                self.end_headers()
                for part in reply.parts:
                    self.wfile.write(part)
                    self.wfile.flush()
                while reply.hold and not peer.done.wait(0.05):
                    if reply.repeat is not None:
                        try:
                            self.wfile.write(reply.repeat)
                            self.wfile.flush()
                        except OSError:
                            return  # the client hung up

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.done.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer()
    yield p
    p.close()


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "gpt-test",
        "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}],
    }


MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a thermostat."},
    {"role": "user", "content": "How warm is it?"},
    {
        "role": "assistant",
        "content": "",
        "tools": [
            {"call": "call_0", "name": "read_temperature", "input": "{}"},
            {"call": "call_1", "name": "memory.recall", "input": '{"q": "warm"}'},
        ],
    },
    {"role": "tool", "call": "call_0", "content": "21.5"},
    {"role": "tool", "call": "call_1", "content": "[]"},
]
TOOLS: list[dict[str, Any]] = [
    {
        "name": "read_temperature",
        "description": "Read the sensor",
        "args": {"type": "object", "properties": {}},
    },
    {
        "name": "memory.recall",
        "description": "Recall memories",
        "args": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
    {"name": "weather", "description": "Weather for a city", "args": None},
]


def full_stream() -> list[bytes]:
    first_text = sse(chunk({"content": "Hel"}))
    return [
        b": keep-alive\n\n",
        sse(chunk({"role": "assistant", "content": ""})),
        sse(chunk({"reasoning_content": "Checking first."})),
        first_text[:17],  # one SSE line split across two writes
        first_text[17:],
        sse(chunk({"content": "lo"})),
        sse(
            chunk(
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_A",
                            "type": "function",
                            "function": {"name": "weather", "arguments": ""},
                        }
                    ]
                }
            )
        ),
        sse(chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]})),
        sse(
            chunk(
                {
                    "tool_calls": [
                        {
                            "index": 1,
                            "id": "call_B",
                            "type": "function",
                            "function": {"name": "memory_recall", "arguments": '{"q":'},
                        }
                    ]
                }
            )
        ),
        sse(chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]})),
        sse(chunk({"tool_calls": [{"index": 1, "function": {"arguments": ' "oslo"}'}}]})),
        sse(chunk({}, finish="tool_calls")),
        sse(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "choices": [],
                "usage": {
                    "prompt_tokens": 42,
                    "completion_tokens": 17,
                    "total_tokens": 59,
                    "completion_tokens_details": {"reasoning_tokens": 5},
                },
            }
        ),
        b"data: [DONE]\n\n",
    ]


def run(provider: OpenAIProvider, **kw: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    chunks: list[dict[str, Any]] = []
    final = provider.complete(
        kw.pop("messages", MESSAGES), kw.pop("tools", TOOLS), chunks.append, **kw
    )
    return chunks, final


def test_request_mapping_and_streamed_answer(peer: Peer) -> None:
    peer.replies.append(Reply(parts=full_stream()))
    provider = OpenAIProvider(peer.url, "gpt-test", api_key=KEY)
    chunks, final = run(provider)

    seen = peer.seen[0]
    assert seen.path == "/v1/chat/completions"
    assert seen.headers["Authorization"] == f"Bearer {KEY}"
    body = seen.body
    assert body["model"] == "gpt-test" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert "max_tokens" not in body
    assert body["messages"] == [
        {"role": "system", "content": "You are a thermostat."},
        {"role": "user", "content": "How warm is it?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "read_temperature", "arguments": "{}"},
                },
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "memory_recall", "arguments": '{"q": "warm"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "21.5"},
        {"role": "tool", "tool_call_id": "call_1", "content": "[]"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "read_temperature",
                "description": "Read the sensor",
                "parameters": {"type": "object", "properties": {}},
            },
        },
        # A dotted name is not a valid OpenAI function name; it goes out mapped ...
        {
            "type": "function",
            "function": {
                "name": "memory_recall",
                "description": "Recall memories",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
        },
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Weather for a city",
                "parameters": {"type": "object", "properties": {}},
            },
        },
    ]

    assert chunks == [
        {"reason": "Checking first."},
        {"text": "Hel"},
        {"text": "lo"},
        {"tool": {"call": "call_A", "name": "weather", "input": '{"city": "Oslo"}'}},
        # ... and comes back under its own name.
        {"tool": {"call": "call_B", "name": "memory.recall", "input": '{"q": "oslo"}'}},
    ]
    assert final == {"usage": {"in": 42, "out": 17, "reason": 5}, "finish": "tool_calls"}


def test_model_and_max_tokens_override_and_key_from_named_env(
    peer: Peer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WREN_TEST_LLM_KEY", "sk-from-env")
    peer.replies.append(
        Reply(
            parts=[
                sse(chunk({"reasoning": "hmm"})),  # Ollama's name for reasoning text
                sse(chunk({"content": "ok"}, finish="length")),
                b"data: [DONE]\n\n",
            ]
        )
    )
    provider = OpenAIProvider(peer.url + "/", "default-model", api_key_env="WREN_TEST_LLM_KEY")
    chunks, final = run(
        provider,
        messages=[{"role": "user", "content": "hi"}],
        tools=[],
        model="other-model",
        max_tokens=64,
    )
    body = peer.seen[0].body
    assert body["model"] == "other-model" and body["max_tokens"] == 64 and "tools" not in body
    assert peer.seen[0].path == "/v1/chat/completions"
    assert peer.seen[0].headers["Authorization"] == "Bearer sk-from-env"
    assert chunks == [{"reason": "hmm"}, {"text": "ok"}]
    # No usage chunk (a server that ignores stream_options): zeros, not a failure.
    assert final == {"usage": {"in": 0, "out": 0, "reason": 0}, "finish": "length"}


def test_no_key_sends_no_authorization(peer: Peer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    peer.replies.append(Reply(parts=[sse(chunk({"content": "hi"}, finish="stop"))]))
    # No [DONE] either (a terse local server): a finish_reason is enough to end cleanly.
    chunks, final = run(OpenAIProvider(peer.url, "llama3"), tools=[])
    assert "Authorization" not in peer.seen[0].headers
    assert chunks == [{"text": "hi"}] and final["finish"] == "stop"


def test_url_credentials_become_basic_auth_and_stay_out_of_errors(
    peer: Peer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    url = peer.url.replace("http://", "http://bob:hunter2@")
    peer.replies.append(Reply(parts=[sse(chunk({"content": "x"}, finish="stop"))]))
    provider = OpenAIProvider(url, "m")
    run(provider, tools=[])
    want = base64.b64encode(b"bob:hunter2").decode()
    assert peer.seen[0].headers["Authorization"] == f"Basic {want}"
    assert "hunter2" not in repr(provider) and "hunter2" not in provider.base_url


def test_stop_with_tool_calls_is_reported_as_tool_calls(peer: Peer) -> None:
    # Ollama's shape: a whole call in one chunk, CRLF line ends, finish "stop".
    peer.replies.append(
        Reply(
            parts=[
                b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"id":"c9","type":"function",'
                b'"function":{"name":"read_temperature","arguments":"{}"}}]},"finish_reason":null}]}'
                b"\r\n\r\n",
                b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\r\n\r\n',
                b"data: [DONE]\r\n\r\n",
            ]
        )
    )
    chunks, final = run(OpenAIProvider(peer.url, "m", api_key=KEY))
    assert chunks == [{"tool": {"call": "c9", "name": "read_temperature", "input": "{}"}}]
    assert final["finish"] == "tool_calls"


def test_http_401_is_a_model_error_without_the_key(
    peer: Peer, caplog: pytest.LogCaptureFixture
) -> None:
    body = json.dumps(
        {
            "error": {
                "message": f"Incorrect API key provided: {KEY}",
                "type": "invalid_request_error",
            }
        }
    ).encode()
    peer.replies.append(Reply(status=401, parts=[body], content_type="application/json"))
    provider = OpenAIProvider(peer.url, "gpt-test", api_key=KEY)
    with caplog.at_level(logging.WARNING, logger="server_bridge.models.openai"):
        with pytest.raises(ModelError) as info:
            run(provider)
    msg = str(info.value)
    assert "401" in msg and "credentials" in msg
    assert KEY not in msg and "127.0.0.1" not in msg
    assert info.value.kind == "llm"
    # The detail is logged for the operator, with the key scrubbed.
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "Incorrect API key" in logged and KEY not in logged


def test_http_500_is_a_model_error(peer: Peer) -> None:
    peer.replies.append(Reply(status=500, parts=[b"boom"], content_type="text/plain"))
    with pytest.raises(ModelError, match=r"failed \(HTTP 500\)"):
        run(OpenAIProvider(peer.url, "m", api_key=KEY))


def test_malformed_sse_line_is_a_model_error(peer: Peer) -> None:
    peer.replies.append(
        Reply(
            parts=[
                sse(chunk({"content": "fine so far"})),
                b"data: {this is not json\n\n",
                b"data: [DONE]\n\n",
            ]
        )
    )
    chunks: list[dict[str, Any]] = []
    with pytest.raises(ModelError, match="malformed stream"):
        OpenAIProvider(peer.url, "m", api_key=KEY).complete(MESSAGES, TOOLS, chunks.append)
    assert chunks == [{"text": "fine so far"}]


def test_error_object_in_the_stream_is_a_model_error(peer: Peer) -> None:
    peer.replies.append(Reply(parts=[sse({"error": {"message": "CUDA out of memory"}})]))
    with pytest.raises(ModelError, match="reported an error") as info:
        run(OpenAIProvider(peer.url, "m", api_key=KEY))
    assert "CUDA" not in str(info.value)


def test_stream_that_ends_early_is_a_model_error(peer: Peer) -> None:
    peer.replies.append(Reply(parts=[sse(chunk({"content": "half an ans"}))]))
    with pytest.raises(ModelError, match="ended the stream early"):
        run(OpenAIProvider(peer.url, "m", api_key=KEY))


HTML = b"<!DOCTYPE html>\n<html><head><title>Welcome</title></head><body>It works</body></html>\n"


@pytest.mark.parametrize("content_type", ["text/html; charset=utf-8", "text/plain"])
def test_web_page_with_200_is_a_wrong_endpoint_not_retryable(peer: Peer, content_type: str) -> None:
    # A base URL without /v1 (or a proxy's page) answers 200 with HTML: the same page
    # comes the next time, so it is not "ended the stream early (retryable)". Told by its
    # Content-Type, or, without one that says so, by its first byte.
    peer.replies.append(Reply(parts=[HTML], content_type=content_type))
    with pytest.raises(ModelError) as info:
        run(OpenAIProvider(peer.url, "m", api_key=KEY))
    assert (info.value.cause, info.value.retryable) == ("bad_endpoint", False)
    assert "does not look like an OpenAI-compatible endpoint" in str(info.value)
    assert "--openai-base-url" in str(info.value)


def test_connection_refused_is_a_model_error() -> None:
    port = free_port()
    provider = OpenAIProvider(f"http://bob:hunter2@127.0.0.1:{port}/v1", "m", api_key=KEY)
    with pytest.raises(ModelError, match="could not reach the model server") as info:
        run(provider)
    assert KEY not in str(info.value) and "hunter2" not in str(info.value)


def test_unsupported_role_is_a_model_error() -> None:
    provider = OpenAIProvider("http://127.0.0.1:9/v1", "m", api_key=KEY)
    with pytest.raises(ModelError, match="unsupported message role"):
        run(provider, messages=[{"role": "wizard", "content": "x"}])


def test_bad_base_url_is_refused() -> None:
    with pytest.raises(ValueError):
        OpenAIProvider("ftp://example.com", "m")


def complete_in_thread(
    provider: OpenAIProvider, deadline: float
) -> tuple[threading.Thread, list[Any], list[dict[str, Any]]]:
    """Run one call on a thread of its own; the outcome (final or exception) lands in
    the first list, the chunks in the second."""
    outcome: list[Any] = []
    chunks: list[dict[str, Any]] = []

    def call() -> None:
        try:
            outcome.append(provider.complete(MESSAGES, TOOLS, chunks.append, deadline=deadline))
        except Exception as e:  # noqa: BLE001 - the test inspects whatever it was
            outcome.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    return t, outcome, chunks


def test_a_stream_that_never_finishes_ends_at_the_deadline(peer: Peer) -> None:
    # Tokens, then keep-alive comments forever: every read succeeds, so no per-read
    # timeout ever fires; only the call's deadline can end it.
    peer.replies.append(
        Reply(parts=[sse(chunk({"content": "Thinking"}))], repeat=b": keep-alive\n\n", hold=True)
    )
    provider = OpenAIProvider(peer.url, "m", api_key=KEY, timeout=60)
    t, outcome, chunks = complete_in_thread(provider, time.monotonic() + 0.5)
    t.join(timeout=10)  # a bound for the test, far past the deadline: not a timing claim
    assert not t.is_alive(), "the call outlived its deadline: its worker is never released"
    assert isinstance(outcome[0], ModelError) and "did not finish in time" in str(outcome[0])
    assert chunks == [{"text": "Thinking"}]


def test_a_stalled_stream_ends_at_the_deadline_not_the_read_timeout(peer: Peer) -> None:
    # Headers, one token, then silence: a read blocks; the per-read timeout is 60 s.
    peer.replies.append(Reply(parts=[sse(chunk({"content": "Hm"}))], hold=True))
    provider = OpenAIProvider(peer.url, "m", api_key=KEY, timeout=60)
    t, outcome, _ = complete_in_thread(provider, time.monotonic() + 0.5)
    t.join(timeout=10)
    assert not t.is_alive(), "the call waited for the 60 s read timeout"
    assert isinstance(outcome[0], ModelError) and "did not finish in time" in str(outcome[0])


def test_a_call_past_its_deadline_sends_nothing(peer: Peer) -> None:
    provider = OpenAIProvider(peer.url, "m", api_key=KEY)
    with pytest.raises(ModelError, match="did not finish in time"):
        run(provider, deadline=time.monotonic() - 1)
    assert peer.seen == []


def test_a_deadline_far_off_changes_nothing(peer: Peer) -> None:
    peer.replies += [Reply(parts=full_stream()), Reply(parts=full_stream())]
    provider = OpenAIProvider(peer.url, "m", api_key=KEY)
    with_deadline = run(provider, deadline=time.monotonic() + 60)
    assert with_deadline == run(provider) and with_deadline[0]


def test_other_credentials_in_server_errors_are_scrubbed_from_the_log(
    peer: Peer, caplog: pytest.LogCaptureFixture
) -> None:
    body = b"upstream https://svc:pa55word@10.1.1.1/ said: key sk-live-999 is revoked"
    peer.replies.append(Reply(status=502, parts=[body], content_type="text/plain"))
    with caplog.at_level(logging.WARNING, logger="server_bridge.models.openai"):
        with pytest.raises(ModelError):
            run(OpenAIProvider(peer.url, "m", api_key=KEY))
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "revoked" in logged and "pa55word" not in logged and "sk-live-999" not in logged


def test_a_proxy_keeps_the_urllib_path_and_no_proxy_or_loopback_pools(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    # Nothing is connected at construction: these hosts are never reached.
    assert OpenAIProvider("https://models.example/v1", "m").pooled
    monkeypatch.setenv("https_proxy", "http://proxy.example:3128")
    monkeypatch.setenv("http_proxy", "http://proxy.example:3128")
    # Through the proxy, by urllib, one connection per call.
    assert not OpenAIProvider("https://models.example/v1", "m").pooled
    assert not OpenAIProvider("http://models.example:8000/v1", "m").pooled
    # A loopback server never goes through the proxy; nor a host no_proxy names.
    assert OpenAIProvider("http://127.0.0.1:11434/v1", "m").pooled
    monkeypatch.setenv("no_proxy", "models.example")
    assert OpenAIProvider("https://models.example/v1", "m").pooled


def test_a_proxied_provider_still_streams(peer: Peer, monkeypatch: pytest.MonkeyPatch) -> None:
    # The proxy is the peer itself (an absolute-URI request line); the base URL's host is
    # not loopback, so the proxy applies and urllib carries the call.
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{peer.server.server_address[1]}")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    peer.replies.append(Reply(parts=full_stream()))
    provider = OpenAIProvider("http://models.example/v1", "m", api_key=KEY)
    assert not provider.pooled
    chunks, final = run(provider)
    assert peer.seen[0].path == "http://models.example/v1/chat/completions"
    assert final["finish"] == "tool_calls" and chunks[0] == {"reason": "Checking first."}
