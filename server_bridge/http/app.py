"""The hosts' HTTP API as a Starlette app over a running Bridge (PROTOCOL.md "HTTP").

Every call but /v1/health and /openapi.json carries the session token the MQTT path
uses, as `Authorization: Bearer <token>` (or `?access_token=`, for a browser's
EventSource, which cannot set headers): the tenant and the user are the verified
token's, never a field of the call. A token that proves nothing is 401 with the same
words whatever was wrong with it, and a device of another tenant is the same 404 as one
that does not exist. What the bridge refuses over MQTT it refuses here, by the same
checks (Bridge.http_request, http_control), with the refusal's kind in the body.

A run's events stream as SSE (`text/event-stream`): one frame per event, `id:
<run>:<event id>`, the envelope as JSON; `Last-Event-ID` (or `?after=`) resumes just
after it, from the bridge's window and its event log, so a stream picks up after a
bridge restart too; ids neither holds come as one `gap` frame where they are missing.
A stream ends after its run's terminal event; an idle one gets a comment every
`heartbeat_s`; one whose reader falls QUEUE_EVENTS behind is cut with an `error` frame
(hub.py) and resumes with Last-Event-ID.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from edge_runtime import codec
from edge_runtime.events import TERMINAL
from server_bridge import access, tokens
from server_bridge.host.reducer import STREAMS, Reducer
from server_bridge.wire import REFUSALS, UnknownDevice

from . import agui as agui_module
from . import knowledge as knowledge_module
from .errors import Refused as _Refused
from .openapi import document
from .views import STATUS, event_json, snapshot_json, sse_comment, sse_frame

if TYPE_CHECKING:
    from server_bridge.bridge import Bridge

__all__ = ["build_app"]

log = logging.getLogger("wren.bridge.http")

#: Seconds between heartbeats on an idle stream.
HEARTBEAT_S = 15.0
# Held events (window and log) sent in one write.
_BATCH = 256
# The largest JSON body a call may send (a request's text is at most a board's payload).
_MAX_BODY = 64 << 10
_RUN_STATUSES = ("running", "paused", "done", "failed", "cancelled")
_UNAUTHORIZED = "a valid session token is needed (Authorization: Bearer <token>)"
# What a body may hold to go on as msgpack (server_bridge/wire.py): JSON allows any
# integer and any nesting, msgpack carries 64-bit integers, and a board decodes at most
# codec.MAX_DEPTH levels (a body nested deeper could never be taken). Checked as the body
# is read, so such a value is refused by name rather than failing its encode (500).
_WIRE_INTS = range(-(1 << 63), 1 << 64)
_MAX_DEPTH = codec.MAX_DEPTH


class _OffTheWire(ValueError):
    """A JSON value that msgpack, or a board, cannot carry."""


def _wire_int(text: str) -> int:
    n = int(text)
    if n not in _WIRE_INTS:
        raise _OffTheWire(f"an integer of {len(text)} digits: msgpack carries 64 bits")
    return n


def _check_depth(obj: Any) -> None:
    # Iterative: a walk by recursion would be what a deep body breaks.
    todo = [(obj, 1)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, dict | list):
            if depth > _MAX_DEPTH:
                raise _OffTheWire(f"nested deeper than {_MAX_DEPTH} levels")
            items = value.values() if isinstance(value, dict) else value
            todo.extend((v, depth + 1) for v in items)


def _error(status: int, kind: str, msg: str) -> JSONResponse:
    return JSONResponse({"error": kind, "message": msg}, status_code=status)


def _refusal(e: Exception) -> _Refused:
    kind = getattr(e, "kind", "bad_envelope")
    if kind == "bad_token":
        return _Refused(401, kind, _UNAUTHORIZED)
    return _Refused(STATUS.get(kind, 400), kind, str(e)[:300])


def build_app(bridge: Bridge, heartbeat_s: float = HEARTBEAT_S) -> Starlette:
    def token_of(request: Request) -> str:
        auth = request.headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            return auth[7:].strip()
        return request.query_params.get("access_token", "")

    def session(request: Request) -> tuple[str, tokens.Session]:
        tok = token_of(request)
        try:
            return tok, bridge.session_of(tok)
        except tokens.TokenError:
            raise _Refused(401, "bad_token", _UNAUTHORIZED) from None

    def device(request: Request, sess: tokens.Session) -> str:
        try:
            return bridge.device_of(sess, request.path_params["device"]).device
        except UnknownDevice as e:
            raise _Refused(404, "unknown_device", str(e)) from None

    async def body_of(request: Request, limit: int = _MAX_BODY) -> dict[str, Any]:
        # Read up to the limit and no further: a body is refused before it is all held.
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise _Refused(413, "too_large", f"a body over {limit:,} bytes")
            parts.append(part)
        raw = b"".join(parts)
        if not raw:
            return {}
        try:
            obj = json.loads(raw, parse_int=_wire_int)
            _check_depth(obj)
        except _OffTheWire as e:
            raise _Refused(400, "bad_envelope", f"the body holds {e}") from None
        except RecursionError:
            raise _Refused(400, "bad_envelope", f"nested deeper than {_MAX_DEPTH} levels") from None
        except ValueError:
            raise _Refused(400, "bad_envelope", "the body is not JSON") from None
        if not isinstance(obj, dict):
            raise _Refused(400, "bad_envelope", "the body is a JSON object")
        return obj

    owned = _owned

    async def health(request: Request) -> Response:
        return JSONResponse({"bridge": "online" if bridge.connected else "connecting"})

    async def openapi(request: Request) -> Response:
        return JSONResponse(document())

    async def devices(request: Request) -> Response:
        # Each device with its presence (its last status: st, boot, heap, fw, agent,
        # ver, seen, since), the runs in flight the token may read (its user's; a
        # watcher's: all), and the tools its hello announced (name, description, args
        # schema, client, approval), from which the dashboard builds its answer forms:
        # a tool.call carries no schema. Read-only; what the bridge already holds.
        _, sess = session(request)
        intake = bridge.intake

        def listed() -> list[dict[str, Any]]:
            # On a worker: a tenant may have a thousand devices.
            out = []
            for record, presence in bridge.devices_of(sess):
                dev = record.device
                runs = [r for r in intake.runs(dev)
                        if r not in STREAMS and intake.finished(dev, r) is False
                        and (sess.watch or intake.owner(dev, r) == sess.user)]  # fmt: skip
                out.append({"device": dev, "agent": record.agent, "presence": presence,
                            "runs": runs, "tools": intake.tools(dev)})  # fmt: skip
            return out

        return JSONResponse({"devices": await run_in_threadpool(listed)})

    async def start_request(request: Request) -> Response:
        tok, sess = session(request)
        dev = device(request, sess)
        body = await body_of(request)
        fields: dict[str, Any] = {k: body[k] for k in ("input", "conv", "req", "ttl") if k in body}
        try:
            req = await run_in_threadpool(bridge.http_request, tok, dev, fields)
        except REFUSALS as e:
            raise _refusal(e) from None
        return JSONResponse({"req": req, "device": dev}, status_code=202)

    async def request_status(request: Request) -> Response:
        _, sess = session(request)
        dev = device(request, sess)
        req = request.path_params["req"]
        owned(sess, bridge.request_owner(dev, req), f"request {req}")
        return JSONResponse({"req": req, "run": bridge.intake.run_of_request(dev, req)})

    def _control(op: str, keys: tuple[str, ...]) -> Any:
        async def act(request: Request) -> Response:
            tok, sess = session(request)
            dev = device(request, sess)
            body = await body_of(request)
            fields = {k: body[k] for k in keys if k in body}
            fields.update(op=op, r=request.path_params["run"])
            try:
                await run_in_threadpool(bridge.http_control, tok, dev, fields)
            except REFUSALS as e:
                raise _refusal(e) from None
            return JSONResponse({"sent": op}, status_code=202)

        return act

    async def run_snapshot(request: Request) -> Response:
        _, sess = session(request)
        dev = device(request, sess)
        run = request.path_params["run"]
        events, usr = await run_in_threadpool(_all_events, bridge, sess.tenant, dev, run)
        if events is None:
            raise _Refused(404, "unknown_run", f"no run {run[:64]!r} is held")
        owned(sess, usr, f"run {run}")
        reducer = Reducer(dev)
        snap = None
        for env in events:
            snap = reducer.apply(env)
        if snap is None:
            raise _Refused(404, "unknown_run", f"no run {run[:64]!r} is held")
        return JSONResponse(snapshot_json(snap))

    async def run_stream(request: Request) -> Response:
        _, sess = session(request)
        dev = device(request, sess)
        run = request.path_params["run"]
        after = _resume_point(request, run)
        follower = bridge.hub.follow(sess.tenant, dev, run)
        try:
            held = await run_in_threadpool(bridge.run_events, sess.tenant, dev, run, after)
            if held is None:
                raise _Refused(404, "unknown_run", f"no run {run[:64]!r} is held")
            owned(sess, held.usr, f"run {run}")
        except BaseException:
            bridge.hub.leave(follower)
            raise
        items = _run_items(bridge, sess.tenant, dev, run, after, held, follower, heartbeat_s)
        return _sse(_run_frames(items, run))

    async def request_stream(request: Request) -> Response:
        # The events of the run a request started, as run_stream sends them, waiting
        # for its run.started first (or the board's refusal of it): what a host that
        # knows only its request id follows (curl, after its POST).
        _, sess = session(request)
        dev = device(request, sess)
        req = request.path_params["req"]
        owner = bridge.request_owner(dev, req)
        if owner is None and bridge.intake.run_of_request(dev, req) is None:
            # Not one the bridge sent (or remembers): nothing to wait for.
            raise _Refused(404, "unknown_request", f"no request {req[:64]!r} is known")
        owned(sess, owner, f"request {req}")
        after = _int_param(request.query_params.get("after"), 0, 0, (1 << 31) - 1)
        follower = bridge.hub.follow(sess.tenant, dev, "")

        async def frames() -> AsyncIterator[bytes]:
            run = None
            while run is None:
                found = await _agui_await_run(bridge, follower, dev, req, heartbeat_s)
                if found is None:
                    yield sse_comment("heartbeat")
                elif isinstance(found, dict):
                    bridge.hub.leave(follower)
                    yield sse_frame("_", {**found, "req": req}, "error")
                    return
                else:
                    run = found
            last = request.headers.get("last-event-id")
            start = after
            if last:
                head, _, tail = last.rpartition(":")
                start = int(tail) if head == run and tail.isdigit() and len(tail) < 10 else 0
            held = await run_in_threadpool(bridge.run_events, sess.tenant, dev, run, start)
            if held is None:
                bridge.hub.leave(follower)
                return
            items = _run_items(bridge, sess.tenant, dev, run, start, held, follower, heartbeat_s)
            async for frame in _run_frames(items, run):
                yield frame

        return _sse(frames())

    async def agui(request: Request) -> Response:
        # AG-UI (agui.py): a RunAgentInput in, the run as AG-UI events out.
        tok, sess = session(request)
        dev = device(request, sess)
        body = await body_of(request)
        thread, client_run = body.get("threadId"), body.get("runId")
        for name, value in (("threadId", thread), ("runId", client_run)):
            if not isinstance(value, str) or not 0 < len(value) <= 64:
                raise _Refused(400, "bad_envelope", f"{name} must be a str of 1..64 chars")
        assert isinstance(thread, str) and isinstance(client_run, str)
        mapper = agui_module.Mapper(thread, client_run,
                                    announce=not request.headers.get("last-event-id"))
        follower = bridge.hub.follow(sess.tenant, dev, "")
        held: Any = None
        try:
            run, after = await _agui_start(bridge, request, tok, sess, dev, body, client_run)
            if run is not None:
                held = await run_in_threadpool(bridge.run_events, sess.tenant, dev, run, after)
                if held is None:
                    raise _Refused(404, "unknown_run", f"no run {run[:64]!r} is held")
                owned(sess, held.usr, f"run {run}")
        except BaseException:
            bridge.hub.leave(follower)
            raise

        async def frames() -> AsyncIterator[bytes]:
            nonlocal run, held
            if run is None:
                # Its run.started has not come yet: wait for it (or for the board's
                # refusal of the request, on the device's stream), beating meanwhile.
                while run is None:
                    found = await _agui_await_run(bridge, follower, dev, client_run, heartbeat_s)
                    if found is None:
                        yield sse_comment("heartbeat")
                    elif isinstance(found, dict):
                        bridge.hub.leave(follower)
                        for e in ({"type": "RUN_STARTED", "threadId": thread,
                                   "runId": client_run},
                                  {"type": "RUN_ERROR", "code": str(found.get("kind")),
                                   "message": str(found.get("msg"))}):  # fmt: skip
                            yield _agui_frame(e)
                        return
                    else:
                        run = found
                held = await run_in_threadpool(bridge.run_events, sess.tenant, dev, run, 0)
                if held is None:  # cannot be: its run.started was just delivered
                    bridge.hub.leave(follower)
                    return
            items = _run_items(bridge, sess.tenant, dev, run, after, held, follower, heartbeat_s)
            async for item in _single(items):
                if item[0] == "event":
                    events = mapper.map(item[2])
                    for k, e in enumerate(events):
                        last = k == len(events) - 1
                        yield _agui_frame(e, f"{run}:{item[1]}" if last else None)
                    if mapper.ended:
                        return
                elif item[0] == "gap":
                    yield _agui_frame({"type": "CUSTOM", "name": "gap",
                                       "value": {"from": item[1], "to": item[2]}})  # fmt: skip
                elif item[0] == "beat":
                    yield sse_comment("heartbeat")
                else:
                    yield _agui_frame({"type": "RUN_ERROR", "code": "too_slow",
                                       "message": str(item[2])})  # fmt: skip
                    return

        return _sse(frames())

    def subject(request: Request, sess: tokens.Session, what: str) -> str:
        # Whose conversations: the token's user, or (a watcher only) the one named.
        named = request.query_params.get("user")
        if named and named != sess.user:
            if not sess.watch:
                raise _Refused(403, "forbidden", f"only a watcher may {what} another user's")
            return named
        return sess.user

    async def conversations(request: Request) -> Response:
        _, sess = session(request)
        q = request.query_params
        limit = _int_param(q.get("limit"), 20, 1, 200)
        offset = _int_param(q.get("offset"), 0, 0, 1 << 30)
        status = q.get("status")
        if status is not None and status not in _RUN_STATUSES:
            raise _Refused(400, "bad_envelope", f"status is one of {', '.join(_RUN_STATUSES)}")
        since = _int_param(q.get("since"), -1, 0, 1 << 62) if "since" in q else None
        until = _int_param(q.get("until"), -1, 0, 1 << 62) if "until" in q else None
        user = subject(request, sess, "list")
        items = await run_in_threadpool(
            bridge.conversations_of, sess.tenant, user, q.get("device"), q.get("agent"),
            status, since, until,
        )  # fmt: skip
        page = items[offset : offset + limit]
        return JSONResponse({"conversations": page, "total": len(items)})

    async def conversation(request: Request) -> Response:
        _, sess = session(request)
        conv = request.path_params["conv"]
        q = request.query_params
        limit = _int_param(q.get("limit"), 50, 1, 500)
        before = _int_param(q.get("before"), -1, -1, 1 << 30)
        user = subject(request, sess, "read")
        view = await run_in_threadpool(bridge.conversation_rows, sess.tenant, user, conv)
        if view is None:
            raise _Refused(404, "unknown_conversation", f"no conversation {conv[:64]!r}")
        rows, runs = view
        end = len(rows) if before < 0 else min(before, len(rows))
        start = max(0, end - limit)
        return JSONResponse({
            "conv": conv,
            "runs": runs,
            "rows": rows[start:end],
            "from": start,
            "hasEarlier": start > 0,
        })  # fmt: skip

    async def conversation_stream(request: Request) -> Response:
        # Every event of a conversation's runs, oldest run first, then its new runs
        # live: one stream a chat view keeps open (_conversation_items).
        _, sess = session(request)
        conv = request.path_params["conv"]
        user = subject(request, sess, "follow")
        runs = await run_in_threadpool(bridge.conversation_runs, sess.tenant, user, conv)
        if not runs:
            raise _Refused(404, "unknown_conversation", f"no conversation {conv[:64]!r}")
        # Followed before the runs are read again, so no run starts unseen between.
        dev = runs[-1][0]
        follower = bridge.hub.follow(sess.tenant, dev, "")
        try:
            runs = await run_in_threadpool(bridge.conversation_runs, sess.tenant, user, conv)
        except BaseException:
            bridge.hub.leave(follower)
            raise
        resume = _conversation_resume(request.headers.get("last-event-id"), runs)
        items = _conversation_items(bridge, sess.tenant, user, conv, dev, runs, resume,
                                    follower, heartbeat_s)  # fmt: skip
        return _sse(_conversation_frames(items))

    routes = [
        Route("/v1/health", health),
        Route("/openapi.json", openapi),
        Route("/v1/devices", devices),
        Route("/v1/devices/{device}/requests", start_request, methods=["POST"]),
        Route("/v1/devices/{device}/requests/{req}", request_status),
        Route("/v1/devices/{device}/requests/{req}/events", request_stream),
        Route("/v1/devices/{device}/runs/{run}", run_snapshot),
        Route("/v1/devices/{device}/runs/{run}/events", run_stream),
        Route("/v1/devices/{device}/runs/{run}/cancel", _control("cancel", ("reason",)),
              methods=["POST"]),  # fmt: skip
        Route("/v1/devices/{device}/runs/{run}/tool", _control("tool", ("call", "output",
              "failed")), methods=["POST"]),  # fmt: skip
        Route("/v1/devices/{device}/runs/{run}/approve", _control("approve", ("call", "ok")),
              methods=["POST"]),  # fmt: skip
        Route("/v1/devices/{device}/agui", agui, methods=["POST"]),
        Route("/v1/conversations", conversations),
        Route("/v1/conversations/{conv}", conversation),
        Route("/v1/conversations/{conv}/events", conversation_stream),
        *knowledge_module.routes(bridge, session, body_of),
    ]

    async def refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, _Refused)
        return _error(exc.status, exc.kind, exc.msg)

    async def failed(request: Request, exc: Exception) -> Response:
        # A bug: logged with its traceback here, never sent (it may hold internals).
        log.error("HTTP %s %s failed", request.method, request.url.path, exc_info=exc)
        return _error(500, "internal", "the bridge hit an internal error")

    async def unrouted(request: Request, exc: Exception) -> Response:
        # A path no route takes (a source id with a line break in it, say), or a method
        # a path does not take: the API's JSON refusal, as for everything else.
        code = getattr(exc, "status_code", 404)
        try:
            bridge.session_of(token_of(request))
        except tokens.TokenError:
            # Without a valid token every path is the same 401: nothing is told apart.
            return _error(401, "bad_token", _UNAUTHORIZED)
        if code == 405:
            return _error(405, "bad_envelope", f"{request.method} is not served here")
        return _error(404, "not_found", "no such path")

    routes += _dashboard_routes()
    return Starlette(
        routes=routes,
        exception_handlers={_Refused: refused, 404: unrouted, 405: unrouted, Exception: failed},
    )


#: The dashboard's files (HTML, CSS, ES modules; no build step), served as they are.
STATIC = Path(__file__).resolve().parent / "static"
_REDUCER = Path(__file__).resolve().parent.parent / "host" / "reducer.mjs"
# The page loads nothing but its own files, and talks to this bridge alone.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "style-src 'self'; script-src 'self'; connect-src 'self'; frame-ancestors 'none'; "
    "base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
          ".js": "text/javascript; charset=utf-8", ".mjs": "text/javascript; charset=utf-8",
          ".svg": "image/svg+xml", ".png": "image/png", ".json": "application/json"}  # fmt: skip


def _dashboard_routes() -> list[Route]:
    """The dashboard (docs/DESIGN.md "Host"): `/` leads to `/ui/`, and `/ui/<file>` is a
    file of `static/` (the snapshot reducer at `/ui/reducer.mjs`, shared with the
    host client's rules). The files are code, not data: no token is needed to load
    them; everything they show comes from the API, which asks for one."""
    files = {p.name: p for p in STATIC.iterdir() if p.suffix in _TYPES} if STATIC.is_dir() else {}
    files["reducer.mjs"] = _REDUCER

    async def home(request: Request) -> Response:
        return RedirectResponse("/ui/", status_code=307)

    async def page(request: Request) -> Response:
        name = request.path_params.get("name") or "index.html"
        path = files.get(name)
        if path is None:
            return _error(404, "not_found", "no such file")
        return FileResponse(path, media_type=_TYPES[path.suffix], headers=_PAGE_HEADERS)

    return [Route("/", home), Route("/ui/", page), Route("/ui/{name}", page)]


def _sse(frames: AsyncIterator[bytes]) -> StreamingResponse:
    # Not stored by a cache; not buffered by a proxy (nginx reads X-Accel-Buffering).
    return StreamingResponse(
        frames,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


def _owned(sess: tokens.Session, owner: str | None, what: str) -> None:
    """Only the run's (or request's) user, or a watcher (access.py): else 403."""
    try:
        access.check_run(sess, owner, what)
    except access.Forbidden as e:
        raise _Refused(403, "forbidden", str(e)) from None


def _int_param(raw: str | None, default: int, lo: int, hi: int) -> int:
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise _Refused(400, "bad_envelope", f"not an integer: {raw[:32]!r}") from None
    if not lo <= value <= hi:
        raise _Refused(400, "bad_envelope", f"{value} is outside {lo}..{hi}")
    return value


def _resume_point(request: Request, run: str) -> int:
    """The id to resume after: Last-Event-ID `<run>:<id>` (an id of another run, or
    none, is 0: from the start), else `?after=`."""
    last = request.headers.get("last-event-id")
    if last:
        head, _, tail = last.rpartition(":")
        if head == run and tail.isdigit() and len(tail) < 10:
            return int(tail)
        return 0
    return _int_param(request.query_params.get("after"), 0, 0, (1 << 31) - 1)


def _all_events(
    bridge: Bridge, tenant: str, device: str, run: str
) -> tuple[list[dict[str, Any]] | None, str | None]:
    """Every event the bridge holds of a run, decoded, and its user; (None, None) for a
    run it does not know. In steps of the replay cap."""
    out: list[dict[str, Any]] = []
    after, usr = 0, None
    while True:
        held = bridge.run_events(tenant, device, run, after)
        if held is None:
            return (None, None) if not out else (out, usr)
        usr = usr or held.usr
        out += [event_json(p) for _, p in held.found]
        if not held.cut or not held.found:
            return out, usr
        after = held.found[-1][0]


async def _run_items(
    bridge: Bridge,
    tenant: str,
    device: str,
    run: str,
    after: int,
    held: Any,
    follower: Any,
    heartbeat_s: float,
) -> AsyncIterator[tuple[Any, ...]]:
    """A run's events after `after`, as ("event", id, envelope), ("gap", lo, hi),
    ("beat",) on an idle stretch, and ("cut", last id, why) when the follower fell
    behind; ends after the run's terminal event. What the bridge holds first (window
    and log), then what comes live: the follower was made before `held` was read, so
    nothing falls between the two; ids already given are skipped. What is held comes
    in ("many", [event and gap items]) of up to _BATCH: one write for many frames,
    where a replay from the log is bound by the writes, not the reading."""
    last = after
    try:
        while True:
            batch: list[tuple[Any, ...]] = []
            ended = False
            for i, payload in held.found:
                if i <= last:
                    continue
                if i > last + 1:
                    batch.append(("gap", last + 1, i - 1))
                env = event_json(payload)
                batch.append(("event", i, env))
                last = i
                if env.get("t") in TERMINAL:
                    ended = True
                    break
                if len(batch) >= _BATCH:
                    yield ("many", batch)
                    batch = []
            if batch:
                yield ("many", batch)
            if ended:
                return
            if not held.cut:
                break
            held = await run_in_threadpool(bridge.run_events, tenant, device, run, last)
            if held is None:
                break
        if held is not None and not held.cut and held.last > last:
            # The run went on past what the bridge still holds of it.
            yield ("gap", last + 1, held.last)
            last = held.last
        if last == after and after > 0 and await run_in_threadpool(
            _ended_at, bridge, tenant, device, run, after
        ):
            return  # resumed after the run's terminal event: nothing more will come
        while True:
            if not await follower.wait(heartbeat_s):
                yield ("beat",)
                continue
            for r, i, payload in follower.take():
                if r != run:
                    continue
                if i <= last:
                    # A reader resumed past where a live run then ended (a stale or
                    # made-up id): its end, though not new to it, ends the stream.
                    if event_json(payload).get("t") in TERMINAL:
                        return
                    continue
                if i > last + 1:
                    yield ("gap", last + 1, i - 1)
                env = event_json(payload)
                yield ("event", i, env)
                last = i
                if env.get("t") in TERMINAL:
                    return
            if follower.cut:
                yield ("cut", last, follower.cut)
                return
    finally:
        bridge.hub.leave(follower)


def _ended_at(bridge: Bridge, tenant: str, device: str, run: str, i: int) -> bool:
    """Whether the run, as the bridge holds it, ended at event `i` or before it."""
    held = bridge.run_events(tenant, device, run, i - 1, limit=1)
    at = i
    if held is not None and (not held.found or held.found[0][0] != i):
        # Not held: a resume point past the run's last id (a stale or made-up one).
        # Ended if that last event is the terminal one: else such a stream of a
        # finished run would wait, beating, for events that never come.
        whole = bridge.run_events(tenant, device, run, 0, limit=1)
        at = whole.last if whole is not None else 0
        held = bridge.run_events(tenant, device, run, at - 1, limit=1) if 0 < at < i else None
    if held is None or not held.found or held.found[0][0] != at:
        return False
    return event_json(held.found[0][1]).get("t") in TERMINAL


async def _single(items: AsyncIterator[tuple[Any, ...]]) -> AsyncIterator[tuple[Any, ...]]:
    """`_run_items` with its batches taken apart, for readers that map event by event."""
    async for item in items:
        if item[0] == "many":
            for one in item[1]:
                yield one
        else:
            yield item


def _run_frame(item: tuple[Any, ...], run: str) -> bytes:
    if item[0] == "event":
        return sse_frame(run, item[2])
    if item[0] == "gap":
        return _gap(run, item[1], item[2])
    if item[0] == "beat":
        return sse_comment("heartbeat")
    return sse_frame(run, {"kind": "too_slow", "r": run, "after": item[1], "msg": item[2]},
                     "error")  # fmt: skip


async def _run_frames(items: AsyncIterator[tuple[Any, ...]], run: str) -> AsyncIterator[bytes]:
    """Native SSE: one frame per event (module docstring); a batch in one write."""
    async for item in items:
        if item[0] == "many":
            yield b"".join(_run_frame(one, run) for one in item[1])
        else:
            yield _run_frame(item, run)


def _agui_frame(event: dict[str, Any], event_id: str | None = None) -> bytes:
    # LF-only `data:` frames of camelCase JSON, as AG-UI's HttpAgent parses them.
    head = f"id: {event_id}\n" if event_id else ""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False, default=str)
    return f"{head}data: {data}\n\n".encode()


def _user_text(messages: Any) -> str | None:
    """The text of the last user message of an AG-UI input (a str, or text parts)."""
    if not isinstance(messages, list):
        return None
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                parts = [str(p["text"]) for p in content
                         if isinstance(p, dict) and isinstance(p.get("text"), str)]  # fmt: skip
                return "".join(parts) if parts else None
    return None


async def _agui_start(
    bridge: Bridge,
    request: Request,
    tok: str,
    sess: tokens.Session,
    dev: str,
    body: dict[str, Any],
    client_run: str,
) -> tuple[str | None, int]:
    """Where an AG-UI POST's stream starts: (the Wren run, the id to go on after), or
    (None, 0) for a request just sent whose run has not started. A `resume` answers
    the interrupts it names (tool results, approvals) and goes on with their run after
    what the client has; Last-Event-ID `<run>:<id>` goes on after that id; a runId the
    bridge has seen start a run is that run (a repeat POST starts nothing new)."""
    resume = body.get("resume")
    if resume is not None:
        if not isinstance(resume, list) or not resume:
            raise _Refused(400, "bad_envelope", "resume must be a non-empty list")
        targets = []
        for entry in resume:
            target = agui_module.parse_interrupt_id(
                entry.get("interruptId", "") if isinstance(entry, dict) else "")
            if target is None:
                raise _Refused(400, "bad_envelope", "resume names an interrupt that is not ours")
            targets.append((target, entry))
        run = targets[0][0][0]
        # Where the answered run goes on from: read before the answers go, so its
        # run.resumed and what follows are all in this stream.
        held = await run_in_threadpool(bridge.run_events, sess.tenant, dev, run, 0)
        if held is None:
            raise _Refused(404, "unknown_run", f"no run {run[:64]!r} is held")
        _owned(sess, held.usr, f"run {run}")
        for (target_run, call), entry in targets:
            await run_in_threadpool(_answer_interrupt, bridge, tok, sess, dev, target_run,
                                    call, entry)  # fmt: skip
        return run, held.last
    last = request.headers.get("last-event-id")
    if last:
        run, _, tail = last.rpartition(":")
        if run and tail.isdigit() and len(tail) < 10:
            return run, int(tail)
        raise _Refused(400, "bad_envelope", "Last-Event-ID is <run>:<event id>")
    known = bridge.intake.run_of_request(dev, client_run)
    if known is not None:
        return known, 0
    text = _user_text(body.get("messages"))
    if text is None:
        raise _Refused(400, "bad_envelope", "messages hold no user message with text")
    fields = {"input": text, "conv": body["threadId"], "req": client_run}
    try:
        await run_in_threadpool(bridge.http_request, tok, dev, fields)
    except REFUSALS as e:
        raise _refusal(e) from None
    return None, 0


def _answer_interrupt(
    bridge: Bridge, tok: str, sess: tokens.Session, dev: str, run: str, call: str,
    entry: dict[str, Any],
) -> None:  # fmt: skip
    """Answer what the run waits on: a client tool's result (payload; `cancelled`: a
    failed call) or an approval (resolved with a payload that is not false: granted)."""
    held = bridge.run_events(sess.tenant, dev, run, 0)
    approval = False
    for _, event in held.found if held is not None else ():
        env = event_json(event)
        if env.get("t") == "approval.request" and (env.get("d") or {}).get("call") == call:
            approval = True
    resolved = entry.get("status") == "resolved"
    payload = entry.get("payload")
    try:
        if approval:
            ok = resolved and payload is not False and payload != {"approved": False}
            bridge.http_control(tok, dev, {"op": "approve", "r": run, "call": call, "ok": ok})
        else:
            output = payload if isinstance(payload, str) else json.dumps(payload)
            bridge.http_control(tok, dev, {"op": "tool", "r": run, "call": call,
                                           "output": output, "failed": not resolved})  # fmt: skip
    except REFUSALS as e:
        raise _refusal(e) from None


async def _agui_await_run(
    bridge: Bridge, follower: Any, dev: str, req: str, heartbeat_s: float
) -> str | dict[str, Any] | None:
    """The run request `req` started (a str), the board's refusal of it (its `error`
    map), or None after `heartbeat_s` of neither. What the follower took here is let
    go: the run's stream reads its events from the window from its first on."""
    known = bridge.intake.run_of_request(dev, req)
    if known is not None:
        return known
    if not await follower.wait(heartbeat_s):
        return None
    taken = follower.take()
    found: str | dict[str, Any] | None = None
    for run, _, payload in taken:
        env = event_json(payload)
        d = env.get("d") or {}
        if env.get("t") == "run.started" and d.get("req") == req:
            found = run
        elif env.get("t") == "error" and d.get("req") == req and found is None:
            found = d
    return found


def _conversation_resume(last: str | None, runs: list[tuple[str, str]]) -> tuple[int, int]:
    """Where a conversation stream resumes: (index of the run in `runs`, id after
    which); Last-Event-ID `<run>:<id>` of a run not in it, or none, is (0, 0)."""
    if last:
        head, _, tail = last.rpartition(":")
        if tail.isdigit() and len(tail) < 10:
            for k, (_, run) in enumerate(runs):
                if run == head:
                    return k, int(tail)
    return 0, 0


async def _conversation_items(
    bridge: Bridge,
    tenant: str,
    user: str,
    conv: str,
    device: str,
    runs: list[tuple[str, str]],
    resume: tuple[int, int],
    follower: Any,
    heartbeat_s: float,
) -> AsyncIterator[tuple[Any, ...]]:
    """A conversation's events as ("event", run, id, envelope), ("gap", run, lo, hi),
    ("beat",) and ("cut", run, id, why): what the bridge holds of each run from the
    resume point on, in the order the runs began, then live events of those runs and
    of runs of the conversation that start later on its device (a run joins when its
    run.started names the conversation and the user). Never ends by itself: a
    conversation can always have one more run."""
    last: dict[str, int] = {}
    try:
        for k, (dev, run) in enumerate(runs):
            if k < resume[0]:
                continue
            at = resume[1] if k == resume[0] else 0
            while True:
                held = await run_in_threadpool(bridge.run_events, tenant, dev, run, at)
                if held is None:
                    break
                for i, payload in held.found:
                    if i <= at:
                        continue
                    if i > at + 1:
                        yield ("gap", run, at + 1, i - 1)
                    yield ("event", run, i, event_json(payload))
                    at = i
                if not held.cut or not held.found:
                    break
            if dev == device:
                last[run] = at
        given = ("", 0)  # the last event sent live: where a cut stream resumes
        while True:
            if not await follower.wait(heartbeat_s):
                yield ("beat",)
                continue
            for run, i, payload in follower.take():
                seen = last.get(run)
                env = None
                if seen is None:
                    env = event_json(payload)
                    d = env.get("d") or {}
                    joins = d.get("conv") == conv and d.get("usr") == user
                    if env.get("t") != "run.started" or not joins:
                        continue
                    seen = 0
                elif i <= seen:
                    continue
                if i > seen + 1:
                    yield ("gap", run, seen + 1, i - 1)
                yield ("event", run, i, env if env is not None else event_json(payload))
                last[run] = i
                given = (run, i)
            if follower.cut:
                yield ("cut", given[0], given[1], follower.cut)
                return
    finally:
        bridge.hub.leave(follower)


async def _conversation_frames(items: AsyncIterator[tuple[Any, ...]]) -> AsyncIterator[bytes]:
    async for item in items:
        if item[0] == "event":
            yield sse_frame(item[1], item[3])
        elif item[0] == "gap":
            yield _gap(item[1], item[2], item[3])
        elif item[0] == "beat":
            yield sse_comment("heartbeat")
        else:
            yield sse_frame(item[1], {"kind": "too_slow", "r": item[1], "after": item[2],
                                      "msg": item[3]}, "error")  # fmt: skip


def _gap(run: str, lo: int, hi: int) -> bytes:
    return sse_frame(run, {"kind": "gap", "r": run, "from": lo, "to": hi,
                           "msg": f"events {lo}..{hi} are no longer held by the bridge"},
                     "gap")  # fmt: skip
