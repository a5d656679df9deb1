"""An OpenAI-compatible chat-completions server for tests: the standard library's
ThreadingHTTPServer on 127.0.0.1 and a free port, in a daemon thread.

It answers `POST /v1/chat/completions` with `stream: true` the way the OpenAI API
streams: HTTP/1.1 with chunked transfer encoding, one SSE event per `data: {...}` line
and blank line, each a `chat.completion.chunk`:

    {"role": "assistant", "content": "", "refusal": null}   the first delta
    {"reasoning_content": "..."}                            reasoning, when the turn has any
    {"content": "..."}                                      the text, `chunk_chars` at a time
    {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}
    {"tool_calls": [{"index", "function": {"arguments": "..."}}]}   `args_chunk_chars` at a time
    {} with finish_reason "stop" or "tool_calls"
    choices [] and usage {prompt_tokens, completion_tokens, total_tokens, ...}
                                                            when stream_options.include_usage
    data: [DONE]

What it answers is a script: a list of Turns, chosen like server_bridge/models/scripted.py
by how many assistant messages the request's conversation already holds (turn 0 for a
new conversation, turn 1 once the model has answered once, ...), so a retried call plays
the same turn. `override_next` puts turns ahead of the script for the next requests,
whatever their conversation (a 500 for the first call only, say). A turn's text may
contain `{last_tool_output}`, replaced by the content of the conversation's last tool
message, as in the scripted provider. A conversation past the end of the script is
answered HTTP 500 with an OpenAI error body saying so.

A turn can also misbehave: answer an HTTP status with a body instead of a stream, hang
before answering, wait between chunks, or close the connection after some events (a
dropped connection mid-stream: the chunked body ends without its last chunk).

Connections are HTTP/1.1 keep-alive, as OpenAI's are: a connection carries request after
request (the stream chunked, other answers with a Content-Length) until the client asks
for `Connection: close`, or the server drops it on purpose (a turn that drops its stream,
a request it could not read). `connections` counts the connections accepted, so a test
can tell a reused connection from a new one. `idle_timeout_s` closes a connection idle
that long between requests, as servers do; `drop_next` makes the next requests find
their connection closed, unanswered and unrecorded (FIN, or RST with `reset`): on a
reused connection, a server whose idle timer fired just as the request came.
`pause_reading` leaves request bodies unread until `resume_reading`, so a large request
fills the socket buffers between client and server.

Every request body (parsed JSON) is recorded in `requests`, in arrival order, and the
time.monotonic() at which each complete stream's last byte was written in `stream_ends`
(by request number), so a benchmark in the same process can time what follows the model.
`GET /v1/models` lists the one model. Waits (hangs, delays) end early when the server
closes, and closing also shuts every open connection, so closing never waits out a hang
or an idle keep-alive connection.
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

__all__ = ["PLACEHOLDER", "ModelServer", "ToolCall", "Turn"]

PLACEHOLDER = "{last_tool_output}"
# A request body larger than this is not a chat request a test sends; refuse it rather
# than read without bound.
MAX_BODY = 8 << 20


@dataclass(frozen=True)
class ToolCall:
    """A tool call the model makes. `arguments` is JSON text, streamed exactly as given;
    `id` defaults to `call_<request number>_<index>`."""

    name: str
    arguments: str = "{}"
    id: str | None = None


@dataclass(frozen=True)
class Turn:
    """One answer of the model, and how the server delivers it."""

    text: str = ""
    chunk_chars: int = 4
    reasoning: str = ""
    tool_calls: Sequence[ToolCall] = ()
    args_chunk_chars: int = 8
    # Seconds to wait before each SSE event of the stream.
    delay_s: float = 0.0
    # Seconds to wait after the first text chunk, before the rest of the stream: a model's
    # first words leave before it has written the rest, which comes at its token rate.
    rest_after_s: float = 0.0
    # Default: "tool_calls" when the turn calls tools, else "stop".
    finish_reason: str | None = None
    # (prompt_tokens, completion_tokens); default: about four characters a token.
    usage: tuple[int, int] | None = None
    # Misbehaviour. `status` other than 200 answers that status with `body` (default: an
    # OpenAI error object) instead of a stream; `hang_s` waits before answering at all;
    # `drop_after` closes the connection once that many SSE events have been sent (the
    # role chunk is the first; `[DONE]` the last).
    status: int = 200
    body: str | None = None
    hang_s: float = 0.0
    drop_after: int | None = None

    def __post_init__(self) -> None:
        if self.chunk_chars < 1 or self.args_chunk_chars < 1:
            raise ValueError("chunk sizes must be >= 1")


def _pieces(text: str, size: int) -> Iterator[str]:
    for k in range(0, len(text), size):
        yield text[k : k + size]


def _tokens(text: str) -> int:
    return len(text) // 4


def _error_body(status: int, message: str) -> str:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}})


def _dumps(obj: Any) -> bytes:
    # Compact, and non-ASCII text as UTF-8 rather than \u escapes, as OpenAI sends it.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that reset its kept-alive connection while the handler waited for its
        # next request (a bridge cancelling a model call does) is no error of the
        # server's: socketserver would print its traceback to stderr, once per call.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Stopped(Exception):
    """The server is closing, or the client went away: stop writing this response."""


class ModelServer:
    """The server; a context manager. `url` is the base URL a provider is given: https
    when `tls` (a server-side SSLContext) is given."""

    def __init__(
        self,
        script: Sequence[Turn] = (),
        model: str = "wren-test-model",
        idle_timeout_s: float | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.script: list[Turn] = list(script)
        self.model = model
        self._overrides: deque[Turn] = deque()
        self._requests: list[dict[str, Any]] = []
        self._ends: dict[int, float] = {}
        self._first_words: dict[int, float] = {}
        self._starts: dict[int, float] = {}
        self._cond = threading.Condition()
        self._closing = threading.Event()
        self._accepted = 0
        self._open: set[socket.socket] = set()
        self._drops: deque[bool] = deque()  # one entry (reset?) per request to drop
        self._reading = threading.Event()  # cleared by pause_reading
        self._reading.set()
        server = self

        class Handler(_Handler):
            owner = server
            # StreamRequestHandler sets it on the socket: a wait for the next request
            # longer than this ends the connection (http.server closes it quietly).
            timeout = idle_timeout_s

        self._httpd = _Server(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._tls = tls
        if tls is not None:
            # The handshake in the handler's thread (setup), not in accept on the
            # server's: one slow client does not hold up the others.
            self._httpd.socket = tls.wrap_socket(
                self._httpd.socket, server_side=True, do_handshake_on_connect=False
            )
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="model-server",
            daemon=True,
        )

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> ModelServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closing.set()  # ends hangs and delays of responses still being written
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout=5)
        self._httpd.server_close()
        # Kept-alive connections: their handlers wait for a next request that no client
        # may ever send. Shut down, each handler's read ends and its thread with it.
        with self._cond:
            still_open = list(self._open)
        for sock in still_open:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the handler closed it meanwhile

    def __enter__(self) -> ModelServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        scheme = "https" if self._tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}/v1"

    # --- script and records ---------------------------------------------------------

    def drop_next(self, n: int = 1, reset: bool = False) -> None:
        """The next `n` chat requests find their connection closed: each is read, then
        neither recorded nor answered, and the connection closed (with a FIN; with
        `reset`, an RST)."""
        with self._cond:
            self._drops.extend([reset] * n)

    def pause_reading(self) -> None:
        """Until resume_reading(), a request's body is left unread once its head is: a
        server busy elsewhere, whose socket buffers fill, so a client's send of a large
        request takes only part of it."""
        self._reading.clear()

    def resume_reading(self) -> None:
        self._reading.set()

    @property
    def connections(self) -> int:
        """How many connections the server has accepted."""
        with self._cond:
            return self._accepted

    @property
    def open_connections(self) -> int:
        """How many of them are still open (the server's end)."""
        with self._cond:
            return len(self._open)

    def override_next(self, *turns: Turn) -> None:
        """Answer the next requests with these turns, in order, whatever their conversation."""
        with self._cond:
            self._overrides.extend(turns)

    @property
    def requests(self) -> list[dict[str, Any]]:
        """The chat-completions request bodies received so far, oldest first."""
        with self._cond:
            return list(self._requests)

    @property
    def request_starts(self) -> dict[int, float]:
        """time.monotonic() as each request's handling began (its request line read), by
        request number: with stream_ends, the model server's own time, which a benchmark
        can tell apart from the time of the client that called it."""
        with self._cond:
            return dict(self._starts)

    @property
    def stream_ends(self) -> dict[int, float]:
        """time.monotonic() just after the last byte of each complete stream (its `[DONE]`
        event and the end of the chunked body) was written, by request number (1, 2, ...).
        A stream dropped on purpose, or cut off by the client, has none."""
        with self._cond:
            return dict(self._ends)

    @property
    def first_words(self) -> dict[int, float]:
        """time.monotonic() just after the first text chunk of each stream was written, by
        request number: what a client waits for before it can show anything."""
        with self._cond:
            return dict(self._first_words)

    def wait_requests(self, n: int, timeout: float) -> list[dict[str, Any]]:
        """Wait until at least `n` requests have arrived; TimeoutError past `timeout`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._requests) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"the model server had {len(self._requests)} of {n} requests "
                        f"after {timeout}s"
                    )
                self._cond.wait(left)
            return list(self._requests)

    def _record(self, body: dict[str, Any], start: float) -> tuple[int, Turn | None]:
        """Record a request (handled from time.monotonic() `start`); its number (1, 2, ...)
        and the turn that answers it (None: the script has no turn for it)."""
        messages = body.get("messages")
        count = (
            sum(1 for m in messages if isinstance(m, Mapping) and m.get("role") == "assistant")
            if isinstance(messages, list)
            else 0
        )
        with self._cond:
            self._requests.append(body)
            self._cond.notify_all()
            number = len(self._requests)
            self._starts[number] = start
            if self._overrides:
                return number, self._overrides.popleft()
            return number, self.script[count] if count < len(self.script) else None

    def _opened(self, sock: socket.socket) -> None:
        with self._cond:
            self._accepted += 1
            self._open.add(sock)

    def _gone(self, sock: socket.socket) -> None:
        with self._cond:
            self._open.discard(sock)

    def _take_drop(self) -> bool | None:
        """None: answer this request; else drop it (with an RST?)."""
        with self._cond:
            return self._drops.popleft() if self._drops else None

    def _ended(self, number: int, at: float) -> None:
        with self._cond:
            self._ends[number] = at
            self._cond.notify_all()

    def _said_first_words(self, number: int, at: float) -> None:
        with self._cond:
            self._first_words[number] = at

    def _sleep(self, seconds: float) -> None:
        if seconds > 0 and self._closing.wait(seconds):
            raise _Stopped


class _Handler(BaseHTTPRequestHandler):
    owner: ModelServer
    # HTTP/1.1: streams sent with chunked transfer encoding, as OpenAI does, and the
    # connection kept for the next request unless the client asks otherwise
    # (`Connection: close`, or HTTP/1.0 without keep-alive; http.server reads both).
    protocol_version = "HTTP/1.1"
    # Each SSE event leaves when it is written, as from the servers this one stands for
    # (Go's net and Python's asyncio set TCP_NODELAY on every connection). With Nagle's
    # algorithm on, a small event written while the previous one is unacknowledged waits
    # for the client's delayed ACK (40 ms on Linux): the stream would arrive in bursts,
    # and the time of the last write would not be when the last event left.
    disable_nagle_algorithm = True

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(10)  # a client that never finishes its handshake
            self.request.do_handshake()
            self.request.settimeout(None)
        super().setup()
        self.owner._opened(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.owner._gone(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: a test's output is the test's

    def parse_request(self) -> bool:
        # A request's handling begins once its request line is read: parsing its headers
        # (http.server's email parser, 0.2 ms a request on the benchmark's machine) is
        # the server's own time, as the rest of this handler is.
        self._began = time.monotonic()
        return super().parse_request()

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.rstrip("/") != "/v1/models":
            self._answer(404, _error_body(404, f"no route {self.path}"))
            return
        model = {"id": self.owner.model, "object": "model", "created": 0, "owned_by": "wren-test"}
        self._answer(200, json.dumps({"object": "list", "data": [model]}))

    def do_POST(self) -> None:  # noqa: N802
        start = self._began
        if self.path.rstrip("/") != "/v1/chat/completions":
            # Whatever body came is not read: the connection cannot carry another request.
            self._answer(404, _error_body(404, f"no route {self.path}"), close=True)
            return
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY:
            # The body is not read, so the connection cannot carry another request.
            self._answer(400, _error_body(400, "a JSON body is required"), close=True)
            return
        while not self.owner._reading.wait(0.05):
            if self.owner._closing.is_set():
                self.close_connection = True
                return
        raw = self.rfile.read(length)
        if self._dropped():
            return
        try:
            body = json.loads(raw)
        except ValueError:
            self._answer(400, _error_body(400, "the body is not JSON"))
            return
        if not isinstance(body, dict):
            self._answer(400, _error_body(400, "the body is not a JSON object"))
            return
        number, turn = self.owner._record(body, start)
        try:
            if turn is None:
                self._answer(500, _error_body(500, "the test script has no turn for this call"))
            elif not body.get("stream"):
                self._answer(400, _error_body(400, "this test server only streams"))
            else:
                self.owner._sleep(turn.hang_s)
                if turn.status != 200:
                    msg = f"scripted HTTP {turn.status}"
                    self._answer(turn.status, turn.body or _error_body(turn.status, msg))
                else:
                    self._stream(body, number, turn)
        except (_Stopped, OSError):
            self.close_connection = True  # closing, or the client hung up: stop quietly

    def _dropped(self) -> bool:
        """Close the connection unanswered if drop_next asked for it."""
        reset = self.owner._take_drop()
        if reset is None:
            return False
        self.close_connection = True
        if reset:
            # An RST, not a FIN: with a zero linger the close resets, and closing here
            # means the close (when finish() drops the socket's files) comes before the
            # FIN the server would send on its way out.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        return True

    def _answer(self, status: int, text: str, close: bool = False) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close or self.close_connection:
            self.send_header("Connection", "close")  # sets close_connection
        self.end_headers()
        self.wfile.write(data)

    # --- the stream -------------------------------------------------------------------

    def _stream(self, body: dict[str, Any], number: int, turn: Turn) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        if self.close_connection:
            self.send_header("Connection", "close")  # the client asked for it
        self.end_headers()
        sent = 0
        # The role chunk, then the reasoning's chunks, then the text's (_events): the
        # index of the first text chunk, counted rather than the pieces cut twice.
        reasoning_chunks = -(-len(turn.reasoning) // turn.chunk_chars)
        first_text = 1 + reasoning_chunks if turn.text else -1
        for event in _events(body, number, turn, self.owner.model):
            if turn.drop_after is not None and sent >= turn.drop_after:
                # Mid-stream: the chunked body never gets its terminating chunk.
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self.owner._sleep(turn.delay_s)
            self._chunk(event)
            if sent == first_text:
                self.owner._said_first_words(number, time.monotonic())
                self.owner._sleep(turn.rest_after_s)
            sent += 1
        self.wfile.write(b"0\r\n\r\n")  # the end of the chunked body
        self.owner._ended(number, time.monotonic())

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))


def _last_tool_output(messages: Any) -> str:
    out = "(no tool output)"
    for m in messages if isinstance(messages, list) else []:
        if isinstance(m, Mapping) and m.get("role") == "tool":
            content = m.get("content")
            out = content if isinstance(content, str) else json.dumps(content)
    return out


def _prompt_tokens(body: Mapping[str, Any]) -> int:
    messages = body.get("messages")
    texts = [
        str(m.get("content") or "")
        for m in (messages if isinstance(messages, list) else [])
        if isinstance(m, Mapping)
    ]
    return sum(_tokens(t) for t in texts) + _tokens(json.dumps(body.get("tools") or []))


def _events(
    body: Mapping[str, Any], number: int, turn: Turn, default_model: str
) -> Iterator[bytes]:
    """The SSE events (`data: ...` and a blank line, as bytes) of one streamed answer."""
    options = body.get("stream_options")
    with_usage = isinstance(options, Mapping) and options.get("include_usage") is True
    model = body.get("model") if isinstance(body.get("model"), str) else default_model
    head = {
        "id": f"chatcmpl-wren{number}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": "fp_wren_test",
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        obj: dict[str, Any] = dict(head)
        obj["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        if with_usage:
            obj["usage"] = None  # OpenAI sends null on every chunk but the usage one
        return b"data: " + _dumps(obj) + b"\n\n"

    text = turn.text.replace(PLACEHOLDER, _last_tool_output(body.get("messages")))
    yield chunk({"role": "assistant", "content": "", "refusal": None})
    for piece in _pieces(turn.reasoning, turn.chunk_chars):
        yield chunk({"reasoning_content": piece})
    for piece in _pieces(text, turn.chunk_chars):
        yield chunk({"content": piece})
    for index, call in enumerate(turn.tool_calls):
        first = {
            "index": index,
            "id": call.id or f"call_{number}_{index}",
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        yield chunk({"tool_calls": [first]})
        for piece in _pieces(call.arguments, turn.args_chunk_chars):
            yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    finish = turn.finish_reason or ("tool_calls" if turn.tool_calls else "stop")
    yield chunk({}, finish)
    if with_usage:
        if turn.usage is not None:
            prompt, completion = turn.usage
        else:
            prompt = _prompt_tokens(body)
            calls = "".join(c.name + c.arguments for c in turn.tool_calls)
            completion = _tokens(text + turn.reasoning + calls)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": _tokens(turn.reasoning)},
        }
        yield b"data: " + _dumps({**head, "choices": [], "usage": usage}) + b"\n\n"
    yield b"data: [DONE]\n\n"
