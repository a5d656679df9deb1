"""An OpenAI-compatible chat-completions provider (OpenAI, Ollama, llama.cpp server, vLLM).

Stdlib only: one streaming POST to `{base_url}/chat/completions`, the SSE
reply parsed line by line and turned into the contract's chunks (see models/base.py).

Connections: HTTP/1.1 keep-alive, http and https. Each provider keeps a small pool of
idle connections to its server (at most `max_idle`, by default the bridge's RPC worker
count; each closed after `idle_s` unused). One call holds one connection; it goes back
to the pool only when its response was read to the end (the SSE `[DONE]` and the end of
the HTTP body), so the next request starts on a clean connection and skips the TCP and
TLS handshakes. A reused connection the server closed meanwhile (it fails before a byte
of the answer arrives) is dropped and the request sent once more on a new one; nothing
is ever sent again once any byte of the answer came, since a model call costs what it
costs whether or not its answer is read. The pooled connections speak HTTP/1.1 through
models/http11.py, which costs a fraction of http.client on the way to a call's first text
(its docstring says how much). Where a proxy applies (HTTP(S)_PROXY, minus no_proxy, as
urllib reads them), calls go through urllib's proxy handling instead, one connection per
call, as before pooling.

Errors: every failure becomes a ModelError whose message is safe to show a customer (it
names no key, no URL, no server text); the detail goes to the log, with the key
scrubbed from it.

Stopping: `cancel()` ends every call in flight at once (the bridge is stopping): it
shuts their sockets down, so a read blocked on a slow or silent server returns now, and
each call raises `Cancelled` (retryable) instead of streaming on until the model ends.

Time: `timeout` is the idle timeout (`--model-idle-timeout`, IDLE_TIMEOUT_S): it bounds
each wait on the socket — connecting, the answer's headers, and every gap in the stream —
so a model that streams slowly but steadily goes on for as long as it streams, and one
that goes silent ends the call (cause `stalled`). The call's `deadline` (its overall
limit, `--model-timeout`) bounds the whole call. A server that keeps a stream open without
finishing it (keep-alive comments, a slow trickle of tokens) would pass every per-read
timeout, so at the deadline a watchdog shuts the socket down and the call ends with a
ModelError (cause `timeout`), releasing its worker. A connection the watchdog shut is
closed, never pooled.

Retryable or not, as honestly as the provider can tell: past the overall limit, no (the
same call takes as long again); silent before the model began to answer, no (a model that
slow to start, a long prompt on a small machine, is as slow the next time); silent once it
had begun, yes (a stream that stops mid-answer is a server's trouble, which passes).
"""

from __future__ import annotations

import base64
import heapq
import http.client
import itertools
import json
import logging
import math
import os
import re
import select
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from server_bridge.config import BridgeConfig
from server_bridge.models import http11
from server_bridge.models.base import (
    TOO_SLOW,
    Cancelled,
    Chunk,
    Final,
    ModelError,
    check_base_url,
)
from server_bridge.redact import scrub

log = logging.getLogger(__name__)

# How long a model may be silent (connecting, before its answer's headers, between two
# pieces of its stream) before the call fails `stalled`: a local model's first token after
# a long prompt can take tens of seconds; past a minute of silence the server is stuck or
# far too slow. Under the board's own wait for its call (edge_runtime/rpc.py, 120 s
# without a chunk), so the board gets the bridge's named error rather than its own.
IDLE_TIMEOUT_S = 60.0
# One SSE line longer than this is not a chat-completions chunk; refuse it instead of
# buffering without bound.
MAX_LINE = 1 << 20
# How much of an HTTP error body is read for the log.
MAX_ERROR_BODY = 4096
# How long an idle connection is kept for the next call. Servers close idle keep-alive
# connections on timers of their own (uvicorn, under vLLM: 5 s; nginx: 75 s); one they
# closed is seen before it is used, and a close that races the request is retried once.
IDLE_S = 30.0
# After `[DONE]`, how long to wait for the end of the HTTP body (the chunked terminator)
# before giving up on reusing the connection: servers send it with the event or right
# after. One that holds the response open past `[DONE]` costs its call this much, and its
# connection is closed rather than pooled; the answer, already read, stands.
DRAIN_S = 0.25
# What may follow `[DONE]` before the body ends (a blank line, the chunked terminator).
# A server that sends more does not get its connection reused.
MAX_DRAIN = 4096

# OpenAI function names must match this; ours may not (`memory.remember` has a dot), so
# names are mapped on the way out and back on the way in.
_FN_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}\Z")
_FN_BAD_CHARS = re.compile(r"[^a-zA-Z0-9_-]")


class _ToolNames:
    """A two-way map between our tool names and names the API accepts, stable within
    one call (tools and the conversation's earlier calls map the same way)."""

    def __init__(self) -> None:
        self.out: dict[str, str] = {}
        self.back: dict[str, str] = {}

    def wire(self, name: str) -> str:
        if name in self.out:
            return self.out[name]
        wire = name if _FN_NAME.match(name) else (_FN_BAD_CHARS.sub("_", name)[:64] or "tool")
        base, n = wire, 1
        while wire in self.back and self.back[wire] != name:
            n += 1
            suffix = f"_{n}"
            wire = base[: 64 - len(suffix)] + suffix
        self.out[name], self.back[wire] = wire, name
        return wire

    def ours(self, wire: str) -> str:
        return self.back.get(wire, wire)


@dataclass
class _CallParts:
    """A streamed tool call being assembled from its deltas."""

    id: str = ""
    name: str = ""
    args: list[str] = field(default_factory=list)


def _safe_url(url: str) -> str:
    """The URL without user:password@, for logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=host))


_MALFORMED = "the model server sent a malformed stream"

# A 200 that is a web page (a wrong path, a proxy's or router's login page, the server's
# own home page) is a wrong URL, not a stream cut short: asking again gets the same page.
_NOT_AN_ENDPOINT = (
    "the model server's URL (the bridge's --openai-base-url) does not look like an "
    "OpenAI-compatible endpoint: it answered with a web page; such a URL usually ends in /v1"
)
_PAGE_TYPES = ("text/html", "application/xhtml+xml")


def _is_page(content_type: str | None) -> bool:
    """Whether a Content-Type says the answer is a web page, not a stream or JSON."""
    media = (content_type or "").partition(";")[0].strip().lower()
    return media in _PAGE_TYPES


def _too_slow() -> ModelError:
    return ModelError(TOO_SLOW, "timeout", False)


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _socket_of(response: Any) -> socket.socket | None:
    """The socket under an http.client response, if it can be reached.

    http.client reads through `sock.makefile("rb")`: a BufferedReader over a SocketIO
    that keeps the socket as `_sock`. Reached by getattr, so another layout only loses
    the watchdog (the deadline is still checked between lines), never the call.
    """
    raw = getattr(getattr(response, "fp", None), "raw", None)
    sock = getattr(raw, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


class _Timed:
    """Something the timer thread (_Timers) fires at `deadline`. `fire` returns when to
    fire again, or None; `cancelled` is true while it is not waiting to fire."""

    deadline: float = 0.0
    cancelled: bool = True

    def fire(self) -> float | None:
        raise NotImplementedError


class _Watchdog(_Timed):
    """Shuts a response's socket down at the deadline: a read blocked on a server that
    stopped sending then returns at once instead of at the socket timeout, and one that
    keeps sending is stopped too. `fired` says why the stream ended, and that the
    connection must not be reused.

    Every call's watchdog is kept by one thread (_Timers), not a timer thread of its
    own: starting a thread per call cost more than the rest of the provider's work
    between the model's headers and its first text."""

    def __init__(self, sock: socket.socket | None, deadline: float | None) -> None:
        self.fired = False
        self._sock = sock
        if deadline is not None and sock is not None:
            self.deadline = deadline
            _TIMERS.add(self)

    def fire(self) -> float | None:
        """Called by _Timers with its lock held, so never after cancel() returned."""
        self.fired = True
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed: the call ended on its own
        return None

    def cancel(self) -> None:
        if not self.cancelled:
            _TIMERS.cancel(self)


class _Timers:
    """The watchdogs of the calls in flight and the pools' idle sweeps, by deadline, and
    the one thread that fires them (started at the first, a daemon). Bounded: a
    cancelled entry is dropped when it reaches the top, and the heap is rebuilt without
    them once they are half of it, so it holds at most about twice the calls in flight
    (plus one sweep per pool)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, _Timed]] = []
        self._seq = itertools.count()
        self._cancelled = 0
        self._thread: threading.Thread | None = None

    def add(self, entry: _Timed) -> None:
        with self._cond:
            entry.cancelled = False
            heapq.heappush(self._heap, (entry.deadline, next(self._seq), entry))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="wren-model-watchdog", daemon=True
                )
                self._thread.start()
            elif self._heap[0][2] is entry:
                self._cond.notify()  # an earlier deadline than the thread waits for

    def cancel(self, entry: _Timed) -> None:
        with self._cond:
            if entry.cancelled:
                return
            entry.cancelled = True
            self._cancelled += 1
            if self._cancelled * 2 > len(self._heap):
                self._heap = [e for e in self._heap if not e[2].cancelled]
                heapq.heapify(self._heap)
                self._cancelled = 0

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][2].cancelled:
                    heapq.heappop(self._heap)
                    self._cancelled -= 1
                if not self._heap:
                    self._cond.wait()
                    continue
                left = self._heap[0][0] - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                entry = heapq.heappop(self._heap)[2]
                entry.cancelled = True
                again = entry.fire()
                if again is not None:
                    entry.deadline, entry.cancelled = again, False
                    heapq.heappush(self._heap, (again, next(self._seq), entry))


_TIMERS = _Timers()


# The connection closed or was reset before a byte of the response arrived: the server
# never answered, so the request may be sent again on another connection.
_Unanswered = http11.Unanswered


# What sending on a connection the server has closed raises; no byte of an answer can
# have been read yet. (SSLEOFError: the same, under TLS.)
_SEND_STALE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, ssl.SSLEOFError)


def _usable(sock: socket.socket | None) -> bool:
    """Whether an idle connection can still carry a request: not once the server closed
    it (the socket reads as ready: EOF) or sent something nobody asked for. One that
    passes may still be closed by the time the request arrives; the retry covers that."""
    if sock is None:
        return False
    try:
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            ready = bool(poller.poll(0))
        else:
            ready = bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return False
    if not ready:
        return True
    if isinstance(sock, ssl.SSLSocket):
        # Ready may be only TLS records with nothing for us (a TLS 1.3 session ticket).
        try:
            sock.settimeout(0)
            sock.recv(1)
        except ssl.SSLWantReadError:
            return True
        except OSError:
            return False
    return False


class _Live:
    """One call in flight, for cancel(): its socket once it has one, and whether it was
    cancelled (then its failure is the cancel's, whatever the read raised)."""

    __slots__ = ("cancelled", "sock")

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.cancelled = False


def _shut(sock: socket.socket | None) -> None:
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed: the call ended on its own


class _Pool(_Timed):
    """A provider's idle keep-alive connections to its server.

    A call takes one (the most recently used, the least likely to have been closed by the
    server's own idle timer) or makes one, and puts it back only once its response was
    read to the end. At most `max_idle` wait here (the newest kept); the timer thread
    closes each once idle for `idle_s`, so an idle bridge holds no sockets."""

    def __init__(self, max_idle: int, idle_s: float) -> None:
        self.max_idle = max(0, max_idle)
        self.idle_s = idle_s
        self._lock = threading.Lock()
        # (time put back, connection), oldest first.
        self._idle: list[tuple[float, http11.Connection]] = []
        self._armed = False  # the sweep waits in _TIMERS
        self._closed = False

    def take(self) -> http11.Connection | None:
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._idle:
                    return None
                since, conn = self._idle.pop()
            if now - since < self.idle_s and _usable(conn.sock):
                return conn
            conn.close()

    def put(self, conn: http11.Connection) -> None:
        drop: list[http11.Connection] = []
        arm = False
        with self._lock:
            if self._closed or self.max_idle == 0:
                drop.append(conn)
            else:
                self._idle.append((time.monotonic(), conn))
                while len(self._idle) > self.max_idle:
                    drop.append(self._idle.pop(0)[1])
                arm, self._armed = not self._armed, True
        for c in drop:
            c.close()
        if arm:
            # Outside our lock: the timer thread takes its lock, then ours (fire).
            self.deadline = time.monotonic() + self.idle_s
            _TIMERS.add(self)

    def fire(self) -> float | None:
        """The sweep, on the timer thread (its lock held): close the connections idle for
        `idle_s`; when to look again, if any are left."""
        now = time.monotonic()
        with self._lock:
            cut = 0
            while cut < len(self._idle) and now - self._idle[cut][0] >= self.idle_s:
                cut += 1
            expired = self._idle[:cut]
            del self._idle[:cut]
            again = self._idle[0][0] + self.idle_s if self._idle else None
            self._armed = again is not None
        for _, conn in expired:
            conn.close()
        return again

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for _, conn in idle:
            conn.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._idle)


def _drained(response: http11.Response, sock: socket.socket | None) -> bool:
    """After `[DONE]`: read what is left of the body (a blank line, the chunked
    terminator), waiting at most DRAIN_S; whether it ended cleanly, so the connection
    may carry the next request. Never raises: the answer is already read, and a
    connection that cannot be drained is only closed instead of pooled."""
    if response.will_close or sock is None:
        return False
    try:
        sock.settimeout(DRAIN_S)
        response.read(MAX_DRAIN)
    except (OSError, ValueError, http.client.HTTPException):
        return False
    return response.isclosed()


def _tls_context() -> ssl.SSLContext:
    """The context urllib would use: the system's CAs, hostname checked; HTTP/1.1 over
    ALPN, as http.client asks for it."""
    context = ssl.create_default_context()
    context.set_alpn_protocols(["http/1.1"])
    return context


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _json_text(value: Any) -> str:
    """Tool-call input is a JSON string on our wire; accept a map too and encode it."""
    if isinstance(value, str):
        return value or "{}"
    if value is None:
        return "{}"
    return json.dumps(value, ensure_ascii=False)


class Early:
    """A call's request sent ahead (`OpenAIProvider.send_early`), until the call takes
    it: the kept-alive connection it went on, the bytes of it the socket had no room
    for, the body (to send again on a new connection if the server closed that one),
    and the tool-name map to read the answer with."""

    __slots__ = ("conn", "data", "names", "rest")

    def __init__(
        self, conn: http11.Connection, data: bytes, names: _ToolNames, rest: bytes
    ) -> None:
        self.conn: http11.Connection | None = conn
        self.data = data
        self.names = names
        self.rest = rest

    def take(self) -> http11.Connection | None:
        conn, self.conn = self.conn, None
        return conn

    def close(self) -> None:
        """End a request whose call never ran: its answer is never read, so its
        connection is closed, never pooled. Nothing once the call took it."""
        conn = self.take()
        if conn is not None:
            conn.close()


class OpenAIProvider:
    """Provider for any server that speaks OpenAI's streaming chat completions."""

    name = "openai"

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        api_key_env: str = "OPENAI_API_KEY",
        timeout: float = IDLE_TIMEOUT_S,
        max_idle: int = BridgeConfig.rpc_workers,
        idle_s: float = IDLE_S,
        temperature: float | None = None,
    ) -> None:
        parts = check_base_url(base_url)
        self._basic: str | None = None
        if parts.username is not None:
            # http.client does not send URL credentials itself; turn them into a header
            # and keep them out of the URL that is logged or shown.
            user = urllib.parse.unquote(parts.username)
            pwd = urllib.parse.unquote(parts.password or "")
            self._basic = base64.b64encode(f"{user}:{pwd}".encode()).decode()
        self.base_url = _safe_url(base_url.rstrip("/"))
        self.model = model
        # Local servers (Ollama, llama.cpp) need no key; None then means no header.
        self._api_key = api_key if api_key is not None else os.environ.get(api_key_env) or None
        if not 0 < timeout < math.inf:
            raise ValueError(f"the idle timeout must be a number of seconds > 0, got {timeout!r}")
        self.timeout = timeout
        # Sent with every call when set (the bridge's --temperature); else the server's own.
        self.temperature = temperature
        host = parts.hostname or ""
        self._host = host
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._path = (parts.path or "") + "/chat/completions"
        if parts.query:
            self._path += "?" + parts.query
        # One TLS context for every connection: building one loads the CA store.
        self._tls = _tls_context() if parts.scheme == "https" else None
        # No proxy for loopback servers even when the environment names one: a local
        # Ollama or llama.cpp server is never behind the corporate proxy. Where a proxy
        # does apply, urllib speaks to it (CONNECT for https), one connection per call,
        # unpooled; the environment is read here, once, as urllib's opener does.
        netloc = host if parts.port is None else f"{host}:{parts.port}"
        proxied = (
            host not in ("localhost", "127.0.0.1", "::1")
            and parts.scheme in urllib.request.getproxies()
            and not urllib.request.proxy_bypass(netloc)
        )
        self._opener = urllib.request.build_opener() if proxied else None
        self._pool = None if proxied else _Pool(max_idle, idle_s)
        # The calls in flight, for cancel(); bounded by the bridge's RPC workers.
        self._live_lock = threading.Lock()
        self._live: set[_Live] = set()

    @property
    def pooled(self) -> bool:
        """Whether calls keep their connections for the next (no proxy applies)."""
        return self._pool is not None

    @property
    def idle(self) -> int:
        """How many idle connections the provider keeps for its next calls."""
        return len(self._pool) if self._pool is not None else 0

    def close(self) -> None:
        """Close the idle connections; calls after this still work, unpooled."""
        if self._pool is not None:
            self._pool.close()

    def cancel(self) -> int:
        """End every call in flight now: each raises Cancelled (retryable) within a
        moment, its connection closed, never pooled. For a bridge that is stopping; calls
        made after this are not affected. Returns how many calls there were."""
        with self._live_lock:
            live = list(self._live)
            for call in live:
                call.cancelled = True
        for call in live:
            _shut(call.sock)
        return len(live)

    def _track(self, live: _Live, sock: socket.socket | None) -> None:
        """The call's socket, for cancel(); raises Cancelled if it was cancelled before
        it had one."""
        with self._live_lock:
            live.sock = sock
            cancelled = live.cancelled
        if cancelled:
            _shut(sock)
            raise Cancelled()

    def __repr__(self) -> str:
        # Never show the key, even in a debugger or a log of the provider object.
        return f"OpenAIProvider(base_url={self.base_url!r}, model={self.model!r})"

    # --- request ------------------------------------------------------------------

    def build_request(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        model: str | None = None,
        max_tokens: int | None = None,
    ) -> tuple[dict[str, Any], _ToolNames]:
        """The JSON body for one call, and the tool-name map to read the answer with."""
        names = _ToolNames()
        body: dict[str, Any] = {
            "model": model or self.model,
            "messages": [self._message(m, names) for m in messages],
            "stream": True,
            # Without this the stream carries no token counts.
            "stream_options": {"include_usage": True},
        }
        if tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": names.wire(_text(t.get("name"))),
                        "description": _text(t.get("description")),
                        "parameters": t.get("args") or {"type": "object", "properties": {}},
                    },
                }
                for t in tools
            ]
        if max_tokens is not None:
            # `max_tokens` rather than `max_completion_tokens`: it is the one every
            # OpenAI-compatible server (Ollama, llama.cpp, vLLM) understands.
            body["max_tokens"] = max_tokens
        if self.temperature is not None:
            body["temperature"] = self.temperature
        return body, names

    @staticmethod
    def _message(m: Mapping[str, Any], names: _ToolNames) -> dict[str, Any]:
        role = m.get("role")
        content = _text(m.get("content"))
        if role in ("system", "user"):
            return {"role": role, "content": content}
        if role == "assistant":
            out: dict[str, Any] = {"role": "assistant", "content": content}
            calls = m.get("tools") or []
            if calls:
                out["tool_calls"] = [
                    {
                        "id": str(c.get("call")),
                        "type": "function",
                        "function": {
                            "name": names.wire(_text(c.get("name"))),
                            "arguments": _json_text(c.get("input")),
                        },
                    }
                    for c in calls
                ]
            return out
        if role == "tool":
            return {"role": "tool", "tool_call_id": str(m.get("call")), "content": content}
        raise ModelError(f"unsupported message role {role!r}")

    def _headers(self) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "User-Agent": "wren-bridge",
        }
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        elif self._basic:
            headers["Authorization"] = f"Basic {self._basic}"
        return headers

    def _scrub(self, text: str) -> str:
        # The key itself, whatever its shape, then anything else that looks like one.
        if self._api_key:
            text = text.replace(self._api_key, "***")
        return scrub(text)

    # --- the call -----------------------------------------------------------------

    def send_early(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        model: str | None = None,
        max_tokens: int | None = None,
    ) -> Early | None:
        """Send the call's request now, on the calling thread, when a kept-alive
        connection is idle, and without ever blocking: what the socket has no room
        for is sent by complete(). Passed to complete(early=), which then reads the
        answer. None (nothing sent) with no idle connection, and over TLS: a TLS write
        the socket has no room for must be repeated as it was, which this does not do.

        Why: the bridge's RPC worker, woken for the call, took 0.4 ms at the median to
        run on a busy machine (more in the tail); sent from the thread that received the
        call, the request reaches the model while the worker wakes (bench_bridge,
        figure 1)."""
        if self._pool is None or self._opener is not None or self._tls is not None:
            return None
        conn = self._pool.take()
        if conn is None or conn.sock is None:
            return None
        try:
            body, names = self.build_request(messages, tools, model, max_tokens)
            data = json.dumps(body).encode()
        except BaseException:
            self._pool.put(conn)  # complete() meets the same failure and reports it
            raise
        message = conn.message(self._path, self._headers(), data)
        try:
            conn.sock.settimeout(0)  # never blocks; complete() sets the call's timeout
            sent = conn.sock.send(message)
        except BlockingIOError:
            sent = 0
        except OSError:
            # Gone while idle: complete() sends the request on a new connection.
            conn.close()
            return None
        return Early(conn, data, names, message[sent:])

    def complete(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        emit: Callable[[Chunk], None],
        model: str | None = None,
        max_tokens: int | None = None,
        *,
        deadline: float | None = None,
        early: Early | None = None,
    ) -> Final:
        if early is not None:
            data, names = early.data, early.names
        else:
            body, names = self.build_request(messages, tools, model, max_tokens)
            data = json.dumps(body).encode()
        live = _Live()
        with self._live_lock:
            self._live.add(live)
        try:
            if self._opener is not None or self._pool is None:
                return self._complete_by_proxy(data, emit, names, deadline, live)
            conn, response = self._open(self._pool, data, deadline, live, early)
            reusable = False
            try:
                final, reusable = self._stream(
                    response, conn.sock, emit, names, deadline, True, live
                )
                return final
            finally:
                if reusable and not live.cancelled:
                    self._pool.put(conn)
                else:
                    conn.close()
        except Cancelled:
            raise
        except (ModelError, OSError, ValueError, http.client.HTTPException):
            if live.cancelled:
                # Whatever the shut socket made the read raise, the cause is the cancel.
                raise Cancelled() from None
            raise
        finally:
            with self._live_lock:
                self._live.discard(live)

    def _wait_bound(self, deadline: float | None) -> float:
        """The bound on one wait on the socket: the per-read timeout, no longer than the
        call has left (connecting and waiting for the headers included)."""
        if deadline is None:
            return self.timeout
        left = deadline - time.monotonic()
        if left <= 0:
            raise _too_slow()
        return min(self.timeout, left)

    def _connect(self, timeout: float) -> http11.Connection:
        conn = http11.Connection(self._host, self._port, timeout, self._tls)
        conn.connect()  # sets TCP_NODELAY
        return conn

    def _open(
        self,
        pool: _Pool,
        data: bytes,
        deadline: float | None,
        live: _Live,
        early: Early | None = None,
    ) -> tuple[http11.Connection, http11.Response]:
        """Send the request on an idle connection, or a new one; the connection and its
        response, status 2xx, headers read. A reused connection that fails before a byte
        of the answer (the server closed it meanwhile) is closed and the request sent
        once more on a new connection; a new connection is not retried."""
        # A request sent early needs only what its socket had no room for; should its
        # connection fail unanswered, the request goes out whole on a new one.
        conn = early.take() if early is not None else pool.take()
        rest = early.rest if early is not None and conn is not None else None
        while True:
            try:
                timeout = self._wait_bound(deadline)
            except ModelError:
                if conn is not None:
                    conn.close()  # an early request's answer is never read
                raise
            reused = conn is not None
            try:
                if conn is None:
                    conn = self._connect(timeout)
                elif conn.sock is not None:
                    conn.sock.settimeout(timeout)
                self._track(live, conn.sock)
                try:
                    if rest is None:
                        conn.request(self._path, self._headers(), data)
                    elif rest and conn.sock is not None:
                        conn.sock.sendall(rest)
                    rest = None
                except _SEND_STALE as e:
                    raise _Unanswered(f"send failed: {e}") from e
                response = conn.response()
            except Cancelled:
                if conn is not None:
                    conn.close()
                raise
            except _Unanswered as e:
                if conn is not None:
                    conn.close()
                if live.cancelled:
                    raise Cancelled() from None
                if not reused:
                    raise self._unreachable(e, deadline) from None
                log.info(
                    "model server %s closed a kept-alive connection before answering (%s); "
                    "sending again on a new one",
                    self.base_url,
                    e,
                )
                conn = None
                continue
            except (OSError, http.client.HTTPException) as e:
                if conn is not None:
                    conn.close()
                if live.cancelled:
                    raise Cancelled() from None
                raise self._unreachable(e, deadline) from None
            if not 200 <= response.status < 300:
                try:
                    detail = response.read(MAX_ERROR_BODY).decode("utf-8", "replace")
                except (OSError, http.client.HTTPException):
                    detail = ""
                conn.close()  # the rest of the error body is not read: not reusable
                raise self._status_error(response.status, detail)
            if _is_page(response.headers.get("content-type")):
                conn.close()  # the page is not read: not reusable
                raise self._not_an_endpoint(response.headers.get("content-type", ""))
            return conn, response

    def _not_an_endpoint(self, what: str) -> ModelError:
        log.warning(
            "model server %s answered a chat completion with a web page (%s): "
            "not an OpenAI-compatible endpoint",
            self.base_url,
            what,
        )
        return ModelError(_NOT_AN_ENDPOINT, "bad_endpoint", False)

    def _stalled(self, answering: bool) -> ModelError:
        """The model said nothing for the idle timeout: before it began to answer (not
        retryable: a model that slow to start is as slow the next time) or after."""
        if answering:
            return ModelError(
                f"the model stopped sending mid-answer for {self.timeout:g} s (the bridge's "
                "--model-idle-timeout): ask again",
                "stalled",
                True,
            )
        return ModelError(
            f"the model sent nothing for {self.timeout:g} s (the bridge's "
            "--model-idle-timeout): a model this slow to start needs a longer one",
            "stalled",
            False,
        )

    def _unreachable(self, e: BaseException, deadline: float | None) -> ModelError:
        if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
            # Connecting, or waiting for the answer's headers: nothing came yet. The wait
            # was the idle timeout, or what the call had left of its overall limit.
            log.warning("model server %s timed out: %s", self.base_url, e)
            return _too_slow() if _past(deadline) else self._stalled(False)
        log.warning("model server %s unreachable: %s", self.base_url, self._scrub(str(e)))
        return ModelError(
            "could not reach the model server: is it running at the bridge's "
            "--openai-base-url?",
            "unavailable",
        )

    def _complete_by_proxy(
        self,
        data: bytes,
        emit: Callable[[Chunk], None],
        names: _ToolNames,
        deadline: float | None,
        live: _Live,
    ) -> Final:
        """The call through urllib, which speaks to the proxy the environment names: a
        connection per call, closed at its end."""
        opener = self._opener or urllib.request.build_opener()
        url = f"{self.base_url}/chat/completions"
        request = urllib.request.Request(url, data=data, headers=self._headers(), method="POST")
        timeout = self._wait_bound(deadline)
        try:
            response = opener.open(request, timeout=timeout)
        except urllib.error.HTTPError as e:
            raise self._http_error(e) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise self._unreachable(e, deadline) from None
        with response:
            if _is_page(response.headers.get("Content-Type")):
                raise self._not_an_endpoint(response.headers.get("Content-Type", ""))
            sock = _socket_of(response)
            self._track(live, sock)
            return self._stream(response, sock, emit, names, deadline, False, live)[0]

    def _stream(
        self,
        response: Any,
        sock: socket.socket | None,
        emit: Callable[[Chunk], None],
        names: _ToolNames,
        deadline: float | None,
        drain: bool,
        live: _Live,
    ) -> tuple[Final, bool]:
        """Read the streamed answer under the deadline's watchdog; the final, and
        whether the connection may carry another request (with `drain`: the body was
        read to its end and the watchdog never touched the socket)."""
        watchdog = _Watchdog(sock, deadline)
        answering = False

        def said(chunk: Chunk) -> None:
            # Whether the model began to answer, for a stall's retryable (_stalled).
            nonlocal answering
            answering = True
            emit(chunk)

        try:
            final, done = self._read_stream(response, said, names, deadline)
            ended = drain and done and _drained(response, sock)
        except ModelError:
            if live.cancelled:
                raise Cancelled() from None
            raise
        except (OSError, ValueError, http.client.HTTPException) as e:
            if live.cancelled:
                raise Cancelled() from None
            if watchdog.fired or _past(deadline):
                # The watchdog shut the socket: whatever the read raised, the reason
                # is the deadline.
                log.warning("model stream from %s stopped at the call's deadline", self.base_url)
                raise _too_slow() from None
            if isinstance(e, TimeoutError):
                log.warning("model server %s went silent mid-stream: %s", self.base_url, e)
                raise self._stalled(answering) from None
            if isinstance(e, ValueError):
                raise  # not a connection failure: a bug, reported as one
            log.warning("model stream from %s broke: %s", self.base_url, self._scrub(str(e)))
            raise ModelError("the connection to the model server broke") from None
        finally:
            watchdog.cancel()
        # Read after cancel(), which waits out a firing in progress: a socket the
        # watchdog shut, even after the last byte was read, is never reused.
        return final, ended and not watchdog.fired

    def _http_error(self, e: urllib.error.HTTPError) -> ModelError:
        try:
            detail = e.read(MAX_ERROR_BODY).decode("utf-8", "replace")
        except (OSError, http.client.HTTPException):
            detail = ""
        finally:
            e.close()
        return self._status_error(e.code, detail)

    def _status_error(self, code: int, detail: str) -> ModelError:
        log.warning(
            "model server %s answered HTTP %s: %s", self.base_url, code, self._scrub(detail)
        )
        # What the status means for the person who runs the bridge, and whether the same
        # call can succeed later: a wrong key, model or request never will.
        if code in (401, 403):
            msg, cause, again = "refused the credentials: check the bridge's API key", "auth", False
        elif code == 404:
            msg, cause, again = (
                "has no such model or endpoint: check --model and --openai-base-url",
                "not_found",
                False,
            )
        elif code == 429:
            msg, cause, again = "is rate limiting requests", "rate_limited", True
        elif code in (502, 503, 504, 529):
            msg, cause, again = "is overloaded or restarting", "overloaded", True
        elif code >= 500:
            msg, cause, again = "failed", "unavailable", True
        else:
            msg, cause, again = "refused the request", "bad_response", False
        return ModelError(f"the model server {msg} (HTTP {code})", cause, again)

    def _read_stream(
        self,
        response: Any,
        emit: Callable[[Chunk], None],
        names: _ToolNames,
        deadline: float | None = None,
    ) -> tuple[Final, bool]:
        """The final, and whether the stream ended with `[DONE]`."""
        calls: dict[int, _CallParts] = {}
        usage = {"in": 0, "out": 0, "reason": 0}
        finish: str | None = None
        done = False
        data: list[str] = []
        # The first line that is not blank: a page sent without its Content-Type (or as
        # text/plain) is told from a stream cut short by its `<`.
        first = ""

        def dispatch() -> None:
            nonlocal finish
            payload = "\n".join(data)
            data.clear()
            try:
                obj = json.loads(payload)
            except ValueError:
                log.warning("malformed SSE data from %s: %.200r", self.base_url, payload)
                raise ModelError(_MALFORMED, "bad_response") from None
            if not isinstance(obj, dict):
                raise ModelError(_MALFORMED, "bad_response")
            if obj.get("error"):
                # vLLM and others report failures inside the stream after a 200.
                log.warning(
                    "model server %s streamed an error: %s",
                    self.base_url,
                    self._scrub(json.dumps(obj["error"])[:MAX_ERROR_BODY]),
                )
                raise ModelError("the model server reported an error")
            finish = self._chunk(obj, emit, calls, usage) or finish

        while True:
            if _past(deadline):
                # Between lines, so a server that keeps sending is stopped even where
                # the watchdog cannot reach the socket.
                raise _too_slow()
            raw = response.readline(MAX_LINE + 1)
            if not raw:
                break
            if len(raw) > MAX_LINE:
                raise ModelError("the model server sent an oversized stream line", "bad_response")
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            first = first or line.strip()
            if not line:
                # A blank line ends an SSE event.
                if data:
                    dispatch()
                continue
            if line.startswith(":"):
                continue  # an SSE comment (keep-alive)
            fieldname, _, value = line.partition(":")
            if fieldname != "data":
                continue  # event:, id:, retry: carry nothing for us
            value = value[1:] if value.startswith(" ") else value
            if value == "[DONE]":
                done = True
                break
            data.append(value)
        if not done and _past(deadline):
            # The end was (most likely) the watchdog's, not the server's; either way the
            # call is over and whatever is left unread is cut mid-way.
            raise _too_slow()
        if data:
            dispatch()
        if not done and finish is None:
            if first.startswith("<"):
                raise self._not_an_endpoint(f"a body that begins {first[:40]!r}")
            raise ModelError("the model server ended the stream early")

        for index in sorted(calls):
            parts = calls[index]
            emit(
                {
                    "tool": {
                        "call": parts.id or f"call_{index}",
                        "name": names.ours(parts.name),
                        "input": "".join(parts.args) or "{}",
                    }
                }
            )
        # Some servers (Ollama) say "stop" even when the turn ended in tool calls; the
        # tool loop on the board reads the finish, so say what actually happened.
        if calls and finish in (None, "stop"):
            finish = "tool_calls"
        return {"usage": usage, "finish": finish or "stop"}, done

    @staticmethod
    def _chunk(
        obj: Mapping[str, Any],
        emit: Callable[[Chunk], None],
        calls: dict[int, _CallParts],
        usage: dict[str, int],
    ) -> str | None:
        """Apply one chat.completion.chunk; returns its finish_reason, if any."""
        finish: str | None = None
        u = obj.get("usage")
        if isinstance(u, Mapping):
            usage["in"] = _count(u.get("prompt_tokens"))
            usage["out"] = _count(u.get("completion_tokens"))
            details = u.get("completion_tokens_details")
            if isinstance(details, Mapping):
                usage["reason"] = _count(details.get("reasoning_tokens"))
        choices = obj.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, Mapping):
                continue
            delta = choice.get("delta")
            if isinstance(delta, Mapping):
                content = delta.get("content")
                if isinstance(content, str) and content:
                    emit({"text": content})
                # DeepSeek and vLLM say reasoning_content; Ollama and OpenRouter reasoning.
                reason = delta.get("reasoning_content") or delta.get("reasoning")
                if isinstance(reason, str) and reason:
                    emit({"reason": reason})
                tool_calls = delta.get("tool_calls")
                for pos, tc in enumerate(tool_calls if isinstance(tool_calls, list) else []):
                    if isinstance(tc, Mapping):
                        _add_call_delta(calls, pos, tc)
            reason_end = choice.get("finish_reason")
            if isinstance(reason_end, str) and reason_end:
                finish = reason_end
        return finish


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _add_call_delta(calls: dict[int, _CallParts], pos: int, tc: Mapping[str, Any]) -> None:
    index = tc.get("index")
    parts = calls.setdefault(index if isinstance(index, int) else pos, _CallParts())
    call_id = tc.get("id")
    if isinstance(call_id, str) and call_id:
        # Set, not appended: some servers repeat the id in every fragment.
        parts.id = call_id
    fn = tc.get("function")
    if not isinstance(fn, Mapping):
        return
    name = fn.get("name")
    if isinstance(name, str) and name and name != parts.name:
        # The name normally comes whole in the first fragment; some servers repeat it
        # (ignored when equal) and a few split it (appended).
        parts.name += name
    args = fn.get("arguments")
    if isinstance(args, str):
        parts.args.append(args)
    elif isinstance(args, Mapping):
        # A server that sends the arguments as an object, whole, instead of JSON text.
        parts.args.append(json.dumps(args, ensure_ascii=False))
