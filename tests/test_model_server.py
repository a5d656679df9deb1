"""The test model server (tests/model_server.py) against the real OpenAIProvider, no MQTT.

These pin the provider on streams shaped like OpenAI's (thousands of tiny deltas, tool
arguments in many fragments, a usage chunk, chunked HTTP) and the server's own wire
shape, which the end-to-end tests rely on.
"""

from __future__ import annotations

import http.client
import json
import logging
import shutil
import ssl
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from server_bridge.bridge import Bridge
from server_bridge.config import BridgeConfig
from server_bridge.models.base import TOO_SLOW, ModelError
from server_bridge.models.openai import OpenAIProvider
from server_bridge.registry import Registry
from tests.model_server import ModelServer, ToolCall, Turn
from tools.broker import MosquittoProcess

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


def test_the_first_words_are_timed_and_the_rest_of_the_stream_comes_later(
    server: ModelServer,
) -> None:
    # Each SSE event waits delay_s first: the role chunk, the reasoning, then "abcd", the
    # first words; then the stream holds the rest for rest_after_s. Lower bounds only,
    # each a wait the server itself makes.
    delay, rest = 0.05, 0.2
    server.script = [
        Turn(text="abcdefgh", chunk_chars=4, reasoning="hmm", delay_s=delay, rest_after_s=rest)
    ]
    chunks, final = complete(server)
    assert chunks == [{"reason": "hmm"}, {"text": "abcd"}, {"text": "efgh"}]
    assert final["finish"] == "stop"
    deadline = time.monotonic() + JOIN_S
    while 1 not in server.stream_ends and time.monotonic() < deadline:
        time.sleep(0.01)
    start, words, end = server.request_starts[1], server.first_words[1], server.stream_ends[1]
    assert start + 3 * delay <= words  # after the text's chunk, not the reasoning's
    assert words + rest + delay <= end  # the rest waited, then "efgh" waited its delay
    # A turn without text has no first words.
    server.override_next(Turn(tool_calls=[ToolCall("read_temperature", "{}")]))
    complete(server)
    assert list(server.first_words) == [1]


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
    # Its deadline, not the idle timeout, ended it: not retryable (issue 25).
    assert str(outcome[0]) == TOO_SLOW
    assert (outcome[0].cause, outcome[0].retryable) == ("timeout", False)


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


# --- keep-alive: the provider's pool against the server's connections --------------------


def provider_for(server: ModelServer, **kw: Any) -> OpenAIProvider:
    return OpenAIProvider(server.url, "gpt-test", api_key="sk-test", **kw)


def call(provider: OpenAIProvider, **kw: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    chunks: list[dict[str, Any]] = []
    final = provider.complete(USER, TOOLS, chunks.append, **kw)
    return chunks, final


def wait_until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + JOIN_S
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_second_call_reuses_the_connection(server: ModelServer) -> None:
    server.script = [Turn(text="Hello there")]
    provider = provider_for(server)
    assert provider.pooled
    for _ in range(3):
        chunks, final = call(provider)
        assert "".join(c["text"] for c in chunks) == "Hello there" and final["finish"] == "stop"
    assert server.connections == 1 and len(server.requests) == 3
    assert provider.idle == 1
    provider.close()
    assert provider.idle == 0
    wait_until(lambda: server.open_connections == 0, "the closed pool left its socket open")


def test_an_error_answer_costs_its_connection_not_the_next_call(server: ModelServer) -> None:
    server.script = [Turn(text="fine")]
    provider = provider_for(server)
    call(provider)
    server.override_next(Turn(status=503))
    with pytest.raises(ModelError, match=r"HTTP 503"):
        call(provider)
    assert provider.idle == 0  # the error body was not read to its end
    assert call(provider)[0] == [{"text": "fine"}]
    assert server.connections == 2


def test_a_connection_the_server_closed_while_idle_is_not_used(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The server's idle timer closed the connection between calls: the provider sees the
    # close before sending, and the call goes out on a new connection, once.
    with ModelServer([Turn(text="again", chunk_chars=8)], idle_timeout_s=0.05) as server:
        provider = provider_for(server)
        call(provider)
        wait_until(lambda: server.open_connections == 0, "the server never closed it")
        with caplog.at_level(logging.INFO, logger="server_bridge.models.openai"):
            assert call(provider)[0] == [{"text": "again"}]
        assert server.connections == 2 and len(server.requests) == 2
        assert "sending again" not in caplog.text  # seen before sending: no retry


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
def test_a_reused_connection_closed_as_the_request_arrives_is_retried_once(
    server: ModelServer, reset: bool
) -> None:
    server.script = [Turn(text="Hello")]
    provider = provider_for(server)
    call(provider)
    server.drop_next(1, reset=reset)  # the close races the request: it looks alive
    chunks, final = call(provider)
    assert "".join(c["text"] for c in chunks) == "Hello" and final["finish"] == "stop"
    # The dropped request was never recorded: the model ran once per call.
    assert server.connections == 2 and len(server.requests) == 2
    assert provider.idle == 1


def test_the_retry_is_one_and_only_for_a_reused_connection(server: ModelServer) -> None:
    server.script = [Turn(text="Hello")]
    provider = provider_for(server)
    # A new connection closed unanswered: not retried (a retry would have succeeded).
    server.drop_next(1)
    with pytest.raises(ModelError, match="could not reach the model server"):
        call(provider)
    assert server.connections == 1 and server.requests == []
    call(provider)
    # Reused, dropped, and the one retry dropped too: the call fails; a second retry
    # would have been answered.
    server.drop_next(2)
    with pytest.raises(ModelError, match="could not reach the model server"):
        call(provider)
    assert server.connections == 3 and len(server.requests) == 1
    assert call(provider)[0] == [{"text": "Hell"}, {"text": "o"}]
    assert server.connections == 4


# --- a request sent early (on the thread that received the call), answered by the call


def test_a_request_sent_early_is_at_the_server_before_the_call_and_answered_once(
    server: ModelServer,
) -> None:
    server.script = [Turn(text="Hello there")]
    provider = provider_for(server)
    # No idle connection yet: nothing goes early, and the call sends its own request.
    assert provider.send_early(USER, TOOLS) is None and server.requests == []
    call(provider)
    early = provider.send_early(USER, TOOLS)
    assert early is not None and early.rest == b"" and provider.idle == 0
    # Nothing but the early send can have made the second request.
    server.wait_requests(2, JOIN_S)
    chunks, final = call(provider, early=early)
    assert "".join(c["text"] for c in chunks) == "Hello there" and final["finish"] == "stop"
    # Sent once, on the kept connection, which is kept again for the next call.
    assert server.connections == 1 and len(server.requests) == 2 and provider.idle == 1


def test_what_the_socket_had_no_room_for_is_sent_by_the_call(server: ModelServer) -> None:
    server.script = [Turn(text="Read it all")]
    provider = provider_for(server)
    call(provider)
    long_question = [{"role": "user", "content": "x" * (7 << 20)}]  # under MAX_BODY
    server.pause_reading()  # so the socket buffers fill before all of it is sent
    early = provider.send_early(long_question, TOOLS)
    assert early is not None and early.rest  # a non-blocking send took only a part
    server.resume_reading()
    assert call(provider, early=early)[0] == [{"text": "Read"}, {"text": " it "}, {"text": "all"}]
    assert server.requests[1]["messages"] == long_question
    assert server.connections == 1 and provider.idle == 1


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
def test_an_early_request_the_server_closed_unanswered_is_sent_again_once(
    server: ModelServer, reset: bool
) -> None:
    server.script = [Turn(text="Hello")]
    provider = provider_for(server)
    call(provider)
    server.drop_next(1, reset=reset)
    early = provider.send_early(USER, TOOLS)
    assert early is not None
    chunks, final = call(provider, early=early)
    assert "".join(c["text"] for c in chunks) == "Hello" and final["finish"] == "stop"
    assert server.connections == 2 and len(server.requests) == 2 and provider.idle == 1


def test_an_early_request_whose_call_never_runs_costs_its_connection(
    server: ModelServer,
) -> None:
    server.script = [Turn(text="abcdefgh")]
    provider = provider_for(server)
    call(provider)
    early = provider.send_early(USER, TOOLS)
    assert early is not None
    server.wait_requests(2, JOIN_S)
    early.close()
    early.close()  # and again, as the RPC layer may: nothing more happens
    wait_until(lambda: server.open_connections == 0, "the unread answer's socket stayed open")
    assert provider.idle == 0
    # The next call reads its own answer, on a new connection: no byte of the other's.
    assert call(provider)[0] == [{"text": "abcd"}, {"text": "efgh"}]
    assert server.connections == 2 and len(server.requests) == 3


@pytest.mark.parametrize("drop_after", [0, 2], ids=["after-headers", "mid-stream"])
def test_a_failure_after_the_first_byte_is_not_retried(
    server: ModelServer, drop_after: int
) -> None:
    # On a reused connection: the answer had begun, so the call is not sent again (the
    # model's work is paid for whether or not its answer is read).
    server.script = [Turn(text="abcdefgh")]
    provider = provider_for(server)
    call(provider)
    server.override_next(Turn(text="abcdefgh", drop_after=drop_after))
    with pytest.raises(ModelError, match="ended the stream early"):
        call(provider)
    assert len(server.requests) == 2 and provider.idle == 0
    assert call(provider)[0] == [{"text": "abcd"}, {"text": "efgh"}]
    assert server.connections == 2


def test_a_call_cut_by_the_deadline_does_not_poison_the_pool(server: ModelServer) -> None:
    server.script = [Turn(text="abcdefgh")]
    provider = provider_for(server)
    call(provider)  # one idle connection, which the slow call below takes
    server.override_next(Turn(text="x" * 400, chunk_chars=1, delay_s=0.01))
    chunks: list[dict[str, Any]] = []
    with pytest.raises(ModelError, match="did not finish in time"):
        provider.complete(USER, TOOLS, chunks.append, deadline=time.monotonic() + 0.3)
    assert chunks and provider.idle == 0  # shut by the watchdog: closed, not pooled
    # The next call starts clean, on a new connection: no byte of the cut stream in it.
    assert call(provider)[0] == [{"text": "abcd"}, {"text": "efgh"}]
    assert server.connections == 2 and provider.idle == 1


def test_idle_connections_are_bounded_and_closed_after_the_idle_time() -> None:
    with ModelServer([Turn(text="slow", delay_s=0.05)]) as server:
        provider = provider_for(server, max_idle=2, idle_s=0.2)
        threads = [threading.Thread(target=call, args=(provider,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_S)
        # Four calls at once: four connections, one each; two kept.
        assert server.connections == 4 and len(server.requests) == 4
        assert provider.idle == 2
        wait_until(lambda: server.open_connections == 2, "the extra two were not closed")
        # Past the idle time, the timer thread closes the other two.
        wait_until(lambda: provider.idle == 0, "idle connections outlived idle_s")
        wait_until(lambda: server.open_connections == 0, "the swept sockets stayed open")
        call(provider)  # and the pool goes on working after a sweep
        assert server.connections == 5 and provider.idle == 1


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = str(d / "cert.pem"), str(d / "key.pem")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            key,
            "-out",
            cert,
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_https_connections_are_reused_too(
    tls_files: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = tls_files
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    # The client trusts the test certificate the way it trusts the system's CAs.
    monkeypatch.setenv("SSL_CERT_FILE", cert)
    with ModelServer([Turn(text="secret")], tls=context) as server:
        assert server.url.startswith("https://")
        provider = provider_for(server)
        for _ in range(3):
            assert call(provider)[0] == [{"text": "secr"}, {"text": "et"}]
        assert server.connections == 1
        # Nothing goes early over TLS (send_early says why): the idle connection stays.
        assert provider.send_early(USER, TOOLS) is None and provider.idle == 1
        server.drop_next(1)
        assert call(provider)[0] == [{"text": "secr"}, {"text": "et"}]
        assert server.connections == 2 and len(server.requests) == 4


def test_the_server_keeps_a_connection_alive_until_the_client_asks_to_close(
    server: ModelServer,
) -> None:
    server.script = [Turn(text="a"), Turn(text="b")]
    body = json.dumps({"model": "m", "stream": True, "messages": USER})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=JOIN_S)
    for headers in ({}, {"Connection": "close"}):
        conn.request("POST", "/v1/chat/completions", body, headers)
        response = conn.getresponse()
        raw = response.read()
        assert raw.endswith(b"data: [DONE]\n\n")
    assert response.getheader("Connection") == "close" and response.will_close
    conn.request("GET", "/v1/models")  # http.client opens a new connection
    assert conn.getresponse().read()
    conn.close()
    assert server.connections == 2


def test_a_stopping_bridge_lets_its_providers_connections_go(
    server: ModelServer, broker: MosquittoProcess, tmp_path: Path
) -> None:
    server.script = [Turn(text="Hello there")]
    provider = provider_for(server)
    call(provider)
    assert provider.idle == 1
    tag = uuid.uuid4().hex[:8]
    config = BridgeConfig(
        host=broker.host, port=broker.port, username=None, password=None,
        prefix=f"wren-pool-{tag}/v1", client_id=f"wren-bridge-{tag}",
    )  # fmt: skip
    bridge = Bridge(config, Registry(tmp_path / "registry.json"), provider)
    bridge.start()
    bridge.stop()
    assert provider.idle == 0
    wait_until(lambda: server.open_connections == 0, "the stopped bridge left a socket open")
