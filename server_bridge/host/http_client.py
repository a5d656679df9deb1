"""A Python host over the bridge's HTTP API (PROTOCOL.md "HTTP"), standard library only.

    host = HttpHost("http://127.0.0.1:8080", token)
    req = host.request("thermo1", "How warm is it?")["req"]
    for event in host.follow_request("thermo1", req):
        print(event["t"], event["d"])

What it offers: the devices, a request and its run, a run's snapshot, conversations
listed and read as a window from the tail (ConversationWindow, load_earlier), tool
answers, approvals and cancels, and a run's events as they happen (`follow`,
`follow_request`): the SSE stream read by hand (`SseParser`: `id:`, `event:`, `data:`
lines, LF line ends, `:` comments the heartbeats), one event dict per frame.

Following survives a dropped connection: the stream is opened again with
`Last-Event-ID: <run>:<last id given>`, so each event is given once and in order; ids
the bridge no longer holds come as one gap dict `{kind: "gap", r, from, to}` where they
are missing. Every wait is bounded: the connect and each read of a call by `timeout`, a
stream's silence by `idle_timeout_s` (the bridge sends a heartbeat every 15 s), the
reconnects by `max_retries` tries in a row that bring nothing, with doubling waits up
to `max_backoff_s`. A follow can fold its events into a snapshot (`RunFollow.snapshot`,
the Reducer the MQTT client uses) and answer client tools with a ToolHandlers, as
HostClient does (tools.py).

A refusal is an HttpError carrying the API's kind and message, one class per family:
HttpAuthError (401: the token proves nothing), HttpForbidden (403), HttpNotFound (404),
HttpRateLimited (429, with `retry_after_s`), HttpBusy (503); HttpUnavailable when
nothing answered (the bridge away, retries spent); a board's refusal of a followed
request is the MQTT client's RequestRefused. The token goes in the Authorization
header only, never in a URL (which logs keep).
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import ssl
import threading
import time
import urllib.parse
import uuid
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from edge_runtime.events import TERMINAL
from server_bridge.host.client import RequestRefused
from server_bridge.host.reducer import BadEnvelope, Reducer, RunSnapshot
from server_bridge.host.tools import Delivery, ToolHandlers, ToolRunner, offer_of

__all__ = [
    "ConversationWindow",
    "HttpAuthError",
    "HttpBusy",
    "HttpError",
    "HttpForbidden",
    "HttpHost",
    "HttpNotFound",
    "HttpRateLimited",
    "HttpUnavailable",
    "RunFollow",
    "SseFrame",
    "SseParser",
    "StreamError",
]

log = logging.getLogger(__name__)

# Seconds: a call's connect and each read; a stream's silence before it is taken for
# dropped (three of the bridge's 15 s heartbeats); the first wait before a reconnect,
# doubling up to the last.
TIMEOUT_S = 30.0
IDLE_TIMEOUT_S = 45.0
BACKOFF_S = 0.25
MAX_BACKOFF_S = 5.0
# Reconnects in a row that bring no event before a follow gives up (HttpUnavailable):
# with the waits above, about half a minute of a bridge that does not come back.
MAX_RETRIES = 8
# The largest answer body read (a conversation window of 500 rows is well under it) and
# the longest SSE line and frame (an event is at most the bridge's 16 KiB payload,
# larger as JSON; these bound what a misbehaving server can make this process hold).
MAX_BODY = 16 << 20
MAX_LINE = 1 << 20
MAX_FRAME = 4 << 20
_READ = 64 << 10
# Statuses a follow waits out and tries again: the API busy or rate limited, a proxy
# in front of it restarting.
_PASSING = frozenset({429, 502, 503, 504})


class HttpError(Exception):
    """The API answered with a refusal: `status`, `kind` (the contract's error kind,
    PROTOCOL.md "Errors") and `msg` (customer-safe)."""

    def __init__(self, status: int, kind: str, msg: str) -> None:
        super().__init__(f"HTTP {status} {kind}: {msg}")
        self.status = status
        self.kind = kind
        self.msg = msg


class HttpAuthError(HttpError):
    """401: the token proves nothing (forged, expired, another tenant's, none)."""


class HttpForbidden(HttpAuthError):
    """403: the token is good, but not for this (another user's run, say)."""


class HttpNotFound(HttpError):
    """404: no such device (or one of another tenant), run, request or conversation."""


class HttpRateLimited(HttpError):
    """429: the tenant's host requests are over their rate; `retry_after_s` when said."""

    def __init__(self, status: int, kind: str, msg: str, retry_after_s: float | None) -> None:
        super().__init__(status, kind, msg)
        self.retry_after_s = retry_after_s


class HttpBusy(HttpError):
    """503: the bridge could not take it now (its host lane full); try again later."""


class HttpUnavailable(ConnectionError):
    """Nothing answered: the bridge could not be reached, or a followed stream kept
    dropping (`max_retries` reconnects in a row that brought nothing). `req`, for a
    request: its id, under which it may be sent again (it starts one run)."""

    def __init__(self, msg: str, req: str | None = None) -> None:
        super().__init__(msg)
        self.req = req


class StreamError(ValueError):
    """The SSE stream broke its own rules (a line or frame over its limit)."""


_BY_STATUS: dict[int, type[HttpError]] = {
    401: HttpAuthError,
    403: HttpForbidden,
    404: HttpNotFound,
    503: HttpBusy,
}


def _refusal(status: int, raw: bytes, retry_after: str | None = None) -> HttpError:
    """The error of a refusal's answer: its JSON `{error, message}` (the API's), read
    as `{kind, msg}` too; a body that is neither (a proxy's page) keeps the status."""
    kind, msg = "http", raw[:200].decode("utf-8", "replace")
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict):
        kind = str(body.get("error") or body.get("kind") or kind)
        msg = str(body.get("message") or body.get("msg") or "")
    if status == 429:
        digits = retry_after is not None and retry_after.replace(".", "", 1).isdigit()
        seconds = float(retry_after) if digits and retry_after is not None else None
        return HttpRateLimited(status, kind, msg, seconds)
    return _BY_STATUS.get(status, HttpError)(status, kind, msg)


@dataclass(frozen=True)
class SseFrame:
    """One dispatched SSE event: its `id` (None when the frame had none), `event` type
    ("message" by default) and `data` (its data lines joined with LF)."""

    id: str | None
    event: str
    data: str


class SseParser:
    """Server-sent events from bytes as they come (the WHATWG rules, with limits): a
    frame is dispatched at a blank line; `data:` lines join with LF; a line that starts
    with ":" is a comment (counted in `comments`: the heartbeats); one space after the
    colon is dropped; CRLF and CR end lines too. A line or frame past its limit is a
    StreamError. What is left unterminated when the stream drops is never dispatched."""

    def __init__(self, max_line: int = MAX_LINE, max_frame: int = MAX_FRAME) -> None:
        self.max_line = max_line
        self.max_frame = max_frame
        self.comments = 0
        self._buf = bytearray()
        self._id: str | None = None
        self._event = ""
        self._data: list[str] = []
        self._size = 0
        self._cr = False  # the last chunk ended with CR: an LF next is its pair

    def feed(self, chunk: bytes) -> list[SseFrame]:
        if self._cr and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._cr = chunk[-1:] == b"\r"
        buf = self._buf
        buf += chunk
        out: list[SseFrame] = []
        start = 0
        n = len(buf)
        # Where the next CR is, found again only once passed: a stream of LF line ends
        # (what the bridge sends) is scanned once, not once per line.
        cr = buf.find(b"\r")
        while start < n:
            lf = buf.find(b"\n", start)
            if 0 <= cr < start:
                cr = buf.find(b"\r", start)
            end = lf if cr < 0 or 0 <= lf < cr else cr
            if end < 0:
                break
            line = bytes(buf[start:end])
            start = end + 1
            if buf[end] == 0x0D and start < n and buf[start] == 0x0A:
                start += 1  # CRLF
            frame = self._line(line.decode("utf-8", "replace"))
            if frame is not None:
                out.append(frame)
        del buf[:start]
        if len(buf) > self.max_line:
            raise StreamError(f"an SSE line over {self.max_line} bytes")
        return out

    def _line(self, line: str) -> SseFrame | None:
        if not line:
            return self._dispatch()
        if line[0] == ":":
            self.comments += 1
            return None
        name, colon, value = line.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        self._size += len(value)
        if self._size > self.max_frame:
            raise StreamError(f"an SSE frame over {self.max_frame} bytes")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        return None  # `retry` and unknown fields: ignored (the waits here are our own)

    def _dispatch(self) -> SseFrame | None:
        frame = None
        if self._data or self._id is not None or self._event:
            frame = SseFrame(self._id, self._event or "message", "\n".join(self._data))
        self._id, self._event, self._data, self._size = None, "", [], 0
        return frame


@dataclass
class ConversationWindow:
    """Rows of one conversation, a window from its tail (`GET /v1/conversations/C`):
    `rows` in order, each with its `run`; `start` the index of the first (the API's
    `from`); `has_earlier` whether rows before it remain (HttpHost.load_earlier)."""

    conv: str
    rows: list[dict[str, Any]]
    runs: list[dict[str, Any]]
    start: int
    has_earlier: bool
    user: str | None = field(default=None, repr=False)


class HttpHost:
    """The bridge's HTTP API for one session token (module docstring).

    `base_url` is the bridge's `--http` address (`http://` or `https://`, a path prefix
    allowed); `cafile` or `ssl_context` say whom to trust over https (the system's
    store by default). `tools` is the default ToolHandlers of follow(). Thread-safe: a
    connection per call. close() stops the tool runners."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = TIMEOUT_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_retries: int = MAX_RETRIES,
        backoff_s: float = BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        cafile: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        tools: ToolHandlers | None = None,
    ) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        if not 0 < backoff_s <= max_backoff_s or max_retries < 0 or timeout <= 0:
            raise ValueError("need 0 < backoff_s <= max_backoff_s, max_retries >= 0, timeout > 0")
        self.base_url = base_url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        self._ssl = ssl_context
        if self._https and ssl_context is None:
            self._ssl = ssl.create_default_context(cafile=cafile)
        self.token = token
        self.timeout = timeout
        self.idle_timeout_s = idle_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.tools = tools
        self._lock = threading.Lock()
        self._runners: dict[int, ToolRunner] = {}
        # (device, run) -> the follows folding it, for the runners' delivery mirror.
        self._following: dict[tuple[str, str], list[RunFollow]] = {}

    def __enter__(self) -> HttpHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            runners, self._runners = list(self._runners.values()), {}
        for runner in runners:
            runner.close()

    # --- calls --------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self._json("GET", "/v1/health")

    def devices(self) -> list[dict[str, Any]]:
        """The token's tenant's devices: `[{device, agent, presence}]`."""
        return self._json("GET", "/v1/devices")["devices"]

    def request(
        self,
        device: str,
        text: str,
        conv: str | None = None,
        req: str | None = None,
        ttl: int | None = None,
    ) -> dict[str, Any]:
        """Ask `device` to start a run; `{req, device}` once the bridge has taken it.
        The req id is chosen here when not given, so a POST whose answer was lost may
        be sent again under the same id (HttpUnavailable's `req`): it starts one run."""
        req_id = req or uuid.uuid4().hex
        body: dict[str, Any] = {"input": text, "req": req_id}
        if conv is not None:
            body["conv"] = conv
        if ttl is not None:
            body["ttl"] = ttl
        try:
            got = self._json("POST", f"/v1/devices/{_q(device)}/requests", body)
        except HttpUnavailable as e:
            raise HttpUnavailable(str(e), req_id) from e
        return got

    def request_run(self, device: str, req: str) -> str | None:
        """The run request `req` started; None until its run.started."""
        got = self._json("GET", f"/v1/devices/{_q(device)}/requests/{_q(req)}")
        return got.get("run") if isinstance(got, dict) else None

    def run(self, device: str, run: str) -> dict[str, Any]:
        """The run's snapshot as JSON (status, rows, tables, pending, lastId, ...)."""
        got = self._json("GET", f"/v1/devices/{_q(device)}/runs/{_q(run)}")
        return got

    def answer(self, device: str, run: str, call: str, output: str, failed: bool = False) -> None:
        """Answer a client tool call the run waits on."""
        body = {"call": call, "output": output, "failed": failed}
        self._json("POST", f"/v1/devices/{_q(device)}/runs/{_q(run)}/tool", body)

    def approve(self, device: str, run: str, call: str, ok: bool) -> None:
        """Grant (`ok`) or deny a call that waits for approval (by the token's user)."""
        self._json("POST", f"/v1/devices/{_q(device)}/runs/{_q(run)}/approve",
                   {"call": call, "ok": ok})  # fmt: skip

    def cancel(self, device: str, run: str, reason: str | None = None) -> None:
        body = {"reason": reason} if reason is not None else {}
        self._json("POST", f"/v1/devices/{_q(device)}/runs/{_q(run)}/cancel", body)

    def conversations(
        self, limit: int = 20, offset: int = 0, device: str | None = None, user: str | None = None
    ) -> dict[str, Any]:
        """`{conversations: [{conv, device, runs, agent, status}], total}`, the most
        recently active first; `user` another user's (a watcher's token only)."""
        query = {"limit": limit, "offset": offset, "device": device, "user": user}
        return self._json("GET", "/v1/conversations", query=query)

    def conversation(
        self, conv: str, limit: int = 50, before: int | None = None, user: str | None = None
    ) -> ConversationWindow:
        """The last `limit` rows of conversation `conv` before row `before` (the tail
        when None)."""
        query = {"limit": limit, "before": before, "user": user}
        got = self._json("GET", f"/v1/conversations/{_q(conv)}", query=query)
        return ConversationWindow(
            conv=got["conv"],
            rows=list(got["rows"]),
            runs=list(got["runs"]),
            start=int(got["from"]),
            has_earlier=bool(got["hasEarlier"]),
            user=user,
        )

    def load_earlier(self, window: ConversationWindow, limit: int = 50) -> ConversationWindow:
        """The window with up to `limit` earlier rows before it (a UI scrolled up):
        a new window; the same one when none remain. Row indexes count from the
        conversation's first row, so rows added at its tail meanwhile shift nothing."""
        if not window.has_earlier:
            return window
        earlier = self.conversation(window.conv, limit, before=window.start, user=window.user)
        return ConversationWindow(
            conv=window.conv,
            rows=earlier.rows + window.rows,
            runs=earlier.runs,
            start=earlier.start,
            has_earlier=earlier.has_earlier,
            user=window.user,
        )

    # --- following ------------------------------------------------------------------

    def follow(
        self,
        device: str,
        run: str,
        after: int = 0,
        *,
        tools: ToolHandlers | None = None,
        fold: bool = True,
    ) -> RunFollow:
        """The run's events after id `after`, live, until its terminal event (an
        iterator of event dicts: the envelopes `{r, i, t, ts, d, ...}`, and a gap dict
        `{kind: "gap", r, from, to}` where ids are no longer held). Resumes by itself
        (module docstring). With `fold` the events build `RunFollow.snapshot` (from the
        run's start: with `after` > 0 only when `tools` asks for it); with `tools` (else
        this host's) the pending calls of handled tools are answered as they appear,
        and the stream is read from the run's start so that none is missed."""
        return RunFollow(self, device, run, None, after, tools or self.tools, fold)

    def follow_request(
        self, device: str, req: str, *, tools: ToolHandlers | None = None, fold: bool = True
    ) -> RunFollow:
        """follow() of the run request `req` starts, from its first event, waiting for
        its run.started; RequestRefused when the board refuses it instead."""
        return RunFollow(self, device, None, req, 0, tools or self.tools, fold)

    def deliveries(self, device: str, run: str) -> dict[str, Delivery]:
        """call id -> delivery of the answers tool handlers gave `run` (tools.py)."""
        with self._lock:
            runners = list(self._runners.values())
        out: dict[str, Delivery] = {}
        for runner in runners:
            out.update(runner.deliveries(device, run))
        return out

    def _runner(self, tools: ToolHandlers) -> ToolRunner:
        with self._lock:
            runner = self._runners.get(id(tools))
            if runner is None or runner.handlers is not tools:
                runner = self._runners[id(tools)] = ToolRunner(
                    tools,
                    self.answer,
                    retryable=_passing,
                    on_state=self._mirror,
                    name="wren-http-tool",
                )
            return runner

    def _mirror(self, device: str, run: str, call: str) -> None:
        with self._lock:
            follows = list(self._following.get((device, run), ()))
        for f in follows:
            f._mirror(call)

    def _watch(self, f: RunFollow, on: bool) -> None:
        assert f.run is not None
        key = (f.device, f.run)
        with self._lock:
            follows = self._following.setdefault(key, [])
            if on:
                follows.append(f)
            elif f in follows:
                follows.remove(f)
            if not follows:
                del self._following[key]

    # --- transport ------------------------------------------------------------------

    def _path(self, path: str, query: Mapping[str, Any] | None = None) -> str:
        q = {k: v for k, v in (query or {}).items() if v is not None}
        return self._prefix + path + (f"?{urllib.parse.urlencode(q)}" if q else "")

    def _connection(self) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=self.timeout, context=self._ssl
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)

    def _headers(self, accept: str, last_id: str | None = None) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.token}", "Accept": accept,
                   "User-Agent": "wren-host"}  # fmt: skip
        if last_id is not None:
            headers["Last-Event-ID"] = last_id
        return headers

    def _json(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        query: Mapping[str, Any] | None = None,
    ) -> Any:
        """One call: the answer's JSON; HttpError for a refusal, HttpUnavailable when
        nothing answered."""
        headers = self._headers("application/json")
        data = None
        if body is not None:
            data = json.dumps(body, ensure_ascii=False).encode()
            headers["Content-Type"] = "application/json"
        conn = self._connection()
        try:
            try:
                conn.request(method, self._path(path, query), body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read(MAX_BODY + 1)
            except (OSError, http.client.HTTPException) as e:
                raise HttpUnavailable(f"{method} {self.base_url}{path}: {e}") from e
        finally:
            conn.close()
        if len(raw) > MAX_BODY:
            raise HttpUnavailable(f"{method} {path}: an answer over {MAX_BODY} bytes")
        if resp.status >= 400:
            raise _refusal(resp.status, raw, resp.getheader("retry-after"))
        return json.loads(raw) if raw else None

    def _open_stream(
        self, path: str, last_id: str | None, query: Mapping[str, Any] | None = None
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """GET an SSE stream; its connection and response once it answered 200 (the
        socket's timeout then the stream's idle limit)."""
        conn = self._connection()
        try:
            conn.request("GET", self._path(path, query),
                         headers=self._headers("text/event-stream", last_id))  # fmt: skip
            resp = conn.getresponse()
            if resp.status != 200:
                raw = resp.read(64 << 10)
                raise _refusal(resp.status, raw, resp.getheader("retry-after"))
            if conn.sock is not None:
                conn.sock.settimeout(self.idle_timeout_s)
            return conn, resp
        except BaseException:
            conn.close()
            raise


def _q(segment: str) -> str:
    # A path segment: every reserved character escaped ("/" too).
    return urllib.parse.quote(segment, safe="")


def _passing(e: Exception) -> bool:
    """A failure that passes: nothing answered, or the API busy or rate limited."""
    return isinstance(e, HttpUnavailable) or (isinstance(e, HttpError) and e.status in _PASSING)


class RunFollow(Iterator[dict[str, Any]]):
    """One run's events, as HttpHost.follow / follow_request give them (an iterator).

    `run` (None until a followed request's run.started), `last_id` the last event id
    given, `reconnects` how many times the stream was opened again, `snapshot` a copy
    of the run folded so far (None without folding). close() ends it early."""

    def __init__(
        self,
        host: HttpHost,
        device: str,
        run: str | None,
        req: str | None,
        after: int,
        tools: ToolHandlers | None,
        fold: bool,
    ) -> None:
        if after < 0:
            raise ValueError("after is an event id >= 0")
        self.host = host
        self.device = device
        self.run = run
        self.req = req
        self.after = after
        self.tools = tools
        self.last_id = 0
        self.reconnects = 0
        self._lock = threading.Lock()
        # Read from the run's start when a reducer must see every event: a snapshot
        # (fold) for a follow from the start, and always for tools (a call announced
        # before `after` still waits).
        self._from = 0 if tools is not None or (fold and after == 0) else after
        self._reducer = Reducer(device) if tools is not None or (fold and after == 0) else None
        self._runner = host._runner(tools) if tools is not None else None
        self._watched = False
        self._ended = False  # its terminal event given
        self._conn: http.client.HTTPConnection | None = None
        self._gen = self._events()

    def __iter__(self) -> RunFollow:
        return self

    def __next__(self) -> dict[str, Any]:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()

    @property
    def snapshot(self) -> RunSnapshot | None:
        with self._lock:
            if self._reducer is None or self.run is None:
                return None
            snap = self._reducer.get(self.run)
            return snap.copy() if snap is not None else None

    def deliveries(self) -> dict[str, Delivery]:
        """How this follow's tool handlers' answers are getting to the board."""
        if self._runner is None or self.run is None:
            return {}
        return self._runner.deliveries(self.device, self.run)

    def _mirror(self, call: str) -> None:
        runner, run = self._runner, self.run
        if runner is None or run is None or self._reducer is None:
            return
        with self._lock:
            state = runner.state(self.device, run, call)
            if state is not None:
                self._reducer.set_delivery(run, call, state)

    def _events(self) -> Generator[dict[str, Any], None, None]:
        self.last_id = self._from
        try:
            yield from self._stream()
        finally:
            if self._conn is not None:
                self._conn.close()
            if self._watched:
                self.host._watch(self, False)

    def _stream(self) -> Iterator[dict[str, Any]]:
        failures = 0
        while True:
            try:
                conn, resp = self._open()
            except (HttpUnavailable, HttpError) as e:
                if not _passing(e):
                    raise
                failures += 1
                self._backoff(failures, e)
                continue
            self._conn = conn
            progressed = False
            parser = SseParser()
            why = "the stream ended before the run did"
            try:
                while True:
                    chunk = resp.read1(_READ)
                    if not chunk:
                        break
                    for frame in parser.feed(chunk):
                        for event in self._take(frame):
                            progressed = True
                            yield event
                        if self._ended:
                            return
            except (OSError, http.client.HTTPException) as e:
                why = f"the stream dropped: {e}"
            except _Cut as e:
                why = str(e)
            finally:
                conn.close()
                self._conn = None
            self.reconnects += 1
            if progressed:
                failures = 0
            else:
                failures += 1
            log.info("http host: %s (run %s, after id %s); again", why, self.run, self.last_id)
            if failures:
                self._backoff(failures, HttpUnavailable(why))

    def _open(self) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        dev = _q(self.device)
        if self.run is None:
            assert self.req is not None
            return self.host._open_stream(f"/v1/devices/{dev}/requests/{_q(self.req)}/events",
                                          None, {"after": 0})  # fmt: skip
        last = f"{self.run}:{self.last_id}"
        return self.host._open_stream(f"/v1/devices/{dev}/runs/{_q(self.run)}/events", last)

    def _backoff(self, failures: int, e: Exception) -> None:
        if failures > self.host.max_retries:
            raise HttpUnavailable(
                f"following run {self.run or self.req} on {self.device}: {failures - 1} "
                f"reconnects in a row brought nothing; the last: {e}"
            ) from e
        wait = min(self.host.backoff_s * 2 ** (failures - 1), self.host.max_backoff_s)
        if isinstance(e, HttpRateLimited) and e.retry_after_s is not None:
            wait = min(max(wait, e.retry_after_s), self.host.max_backoff_s)
        time.sleep(wait * random.uniform(0.5, 1.0))

    def _take(self, frame: SseFrame) -> list[dict[str, Any]]:
        """What one frame gives the caller: an event not given yet, a gap; folded and
        offered to the tool runner on the way. Raises _Cut for a stream the bridge cut
        (the reader too slow), RequestRefused for a board's refusal of the request."""
        try:
            data = json.loads(frame.data) if frame.data else None
        except ValueError:
            log.warning("http host: a frame that is not JSON: %.80r", frame.data)
            return []
        if not isinstance(data, dict):
            return []
        if frame.event == "error" and "i" not in data:
            if data.get("kind") == "too_slow":
                raise _Cut(f"the bridge cut the stream: {data.get('msg')}")
            req = data.get("req")
            if isinstance(req, str) and self.run is None:
                raise RequestRefused(str(data.get("kind")), str(data.get("msg") or ""), req,
                                     {k: v for k, v in data.items()
                                      if k not in ("kind", "msg", "req")})  # fmt: skip
            return []
        if frame.event == "gap" and "i" not in data:
            lo, hi = data.get("from"), data.get("to")
            if not isinstance(lo, int) or not isinstance(hi, int) or hi <= self.last_id:
                return []
            self._learn_run(data.get("r"))
            self.last_id = hi
            self._fold_gap(max(lo, 1), hi)
            # Only what lies past `after` is the caller's.
            return [{**data, "from": max(lo, self.after + 1)}] if hi > self.after else []
        i = data.get("i")
        if not isinstance(i, int) or i <= self.last_id:
            return []  # a repeat after a resume
        self._learn_run(data.get("r"))
        if data.get("r") != self.run:
            return []
        self.last_id = i
        self._fold(data)
        if data.get("t") in TERMINAL:
            self._ended = True
        return [data] if i > self.after else []

    def _learn_run(self, run: Any) -> None:
        if self.run is None and isinstance(run, str):
            self.run = run
        if self.run is not None and self._runner is not None and not self._watched:
            self._watched = True
            self.host._watch(self, True)

    def _fold(self, event: dict[str, Any]) -> None:
        if self._reducer is None:
            return
        with self._lock:
            try:
                snap = self._reducer.apply(event)
            except BadEnvelope as e:
                log.warning("http host: an event the reducer refuses: %s", e)
                return
            offer = offer_of(self.device, snap, self.tools) if self.tools is not None else None
        if offer is not None and self._runner is not None:
            self._runner.take(offer)

    def _fold_gap(self, lo: int, hi: int) -> None:
        if self._reducer is None or self.run is None:
            return
        with self._lock:
            self._reducer.mark_lost(self.run, lo, hi)


class _Cut(Exception):
    """The bridge cut the stream (its reader fell behind): resume at once."""
