"""The Python host over HTTP (server_bridge/host/http_client.py): its SSE parser on its
own, then HttpHost against the real `wren bridge --http` process, Mosquitto and a board
on the MicroPython unix port — conversations, following a run over SSE, resuming when a
proxy cuts the connection mid-stream, refusals by name, and a client tool answered by a
handler over HTTP."""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import subprocess
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from server_bridge.host.client import RequestRefused
from server_bridge.host.http_client import (
    HttpAuthError,
    HttpBusy,
    HttpForbidden,
    HttpHost,
    HttpNotFound,
    HttpUnavailable,
    SseFrame,
    SseParser,
    StreamError,
)
from server_bridge.host.tools import ToolHandlers
from server_bridge.tokens import sign
from tests.model_server import ModelServer, ToolCall, Turn
from tests.proxies import CuttingProxy
from tests.stack import TENANT, Stack
from tests.test_http_api import HTTP, http_url, token
from tests.test_runs_pause import VALVES

DEVICE = "thermo1"

# --- the SSE parser ------------------------------------------------------------------

STREAM = (
    b": heartbeat\n\n"
    b'id: r1:1\nevent: run.started\ndata: {"i":1}\n\n'
    b'event: gap\ndata: {"from":2,\n'
    b'data: "to":3}\n\n'
    b'id:r1:4\r\nevent:msg.delta\r\ndata:{"i":4}\r\n\r\n'
    b'id: r1:5\revent: run.done\rdata: {"i":5}\r\r'
    b'id: r1:6\nevent: msg.delta\ndata: {"cut'  # dropped here: never dispatched
)
FRAMES = [
    SseFrame("r1:1", "run.started", '{"i":1}'),
    SseFrame(None, "gap", '{"from":2,\n"to":3}'),
    SseFrame("r1:4", "msg.delta", '{"i":4}'),
    SseFrame("r1:5", "run.done", '{"i":5}'),
]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, len(STREAM)])
def test_sse_frames_whatever_the_chunks(size: int) -> None:
    parser = SseParser()
    got = []
    for k in range(0, len(STREAM), size):
        got += parser.feed(STREAM[k : k + size])
    assert got == FRAMES
    assert parser.comments == 1


def test_sse_limits_are_refused_by_name() -> None:
    with pytest.raises(StreamError):
        SseParser(max_line=100).feed(b"data: " + b"x" * 200)
    parser = SseParser(max_frame=100)
    with pytest.raises(StreamError):
        for _ in range(20):
            parser.feed(b"data: " + b"x" * 10 + b"\n")


# --- a scripted server: what the follow does with each thing a stream may do ---------


def frame(i: int | None, t: str, **d: Any) -> bytes:
    env = {"r": "r1", "i": i, "t": t, "ts": 1000, "d": d} if i is not None else d
    head = f"id: r1:{i}\n" if i is not None else ""
    return f"{head}event: {t}\ndata: {json.dumps(env)}\n\n".encode()


class Scripted:
    """An HTTP server answering each GET with the next (status, body) of a script and
    closing the connection after it (an SSE stream that ends: dropped, or cut); the
    Last-Event-ID of each request recorded."""

    def __init__(self, answers: list[tuple[int, bytes]]) -> None:
        self.answers = list(answers)
        self.last_ids: list[str | None] = []
        self.paths: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                outer.last_ids.append(self.headers.get("Last-Event-ID"))
                outer.paths.append(self.path)
                status, body = outer.answers.pop(0) if outer.answers else (503, b"{}")
                self.send_response(status)
                kind = "text/event-stream" if status == 200 else "application/json"
                self.send_header("Content-Type", kind)
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)
                self.close_connection = True

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_follow_resumes_after_each_drop_with_the_last_id_it_gave() -> None:
    busy = json.dumps({"error": "busy", "message": "the host lane is full"}).encode()
    gap = json.dumps({"kind": "gap", "r": "r1", "from": 3, "to": 4}).encode()
    slow = json.dumps({"kind": "too_slow", "r": "r1", "after": 5, "msg": "resume"}).encode()
    server = Scripted([
        (503, busy),
        (200, b": heartbeat\n\n" + frame(1, "run.started", req="q1") + frame(2, "msg.start", m=1)
         + b"event: gap\ndata: " + gap + b"\n\n" + b"id: r1:5\nevent: msg.de"),
        (200, frame(3, "msg.delta", m=1, text="x") + frame(5, "msg.delta", m=1, text="late")
         + b"event: error\ndata: " + slow + b"\n\n" + frame(6, "msg.end", m=1)),
        (200, frame(5, "msg.delta", m=1, text="late") + frame(6, "msg.end", m=1)
         + frame(7, "run.done")),
    ])  # fmt: skip
    try:
        host = HttpHost(server.url, "tok", backoff_s=0.01, max_backoff_s=0.02)
        follow = host.follow("dev1", "r1")
        got = list(follow)
        assert [e.get("i", ("gap", e.get("from"), e.get("to"))) for e in got] == [
            1, 2, ("gap", 3, 4), 5, 6, 7]  # fmt: skip
        # After a drop mid-frame, and after the bridge's cut: the last id given.
        assert server.last_ids == ["r1:0", "r1:0", "r1:4", "r1:5"]
        assert all(p == "/v1/devices/dev1/runs/r1/events" for p in server.paths)
        assert follow.reconnects == 2
        snap = follow.snapshot
        assert snap is not None and snap.status == "done" and snap.gaps == [(3, 4)]
        assert not snap.complete

        # Refusals that do not pass end it at once; passing ones, after max_retries.
        with pytest.raises(HttpBusy):
            HttpHost(server.url, "tok", max_retries=0).run("dev1", "r1")
        server.answers = []  # 503 from now on
        with pytest.raises(HttpUnavailable, match="2 reconnects in a row"):
            list(HttpHost(server.url, "tok", max_retries=2, backoff_s=0.01).follow("dev1", "r1"))
        server.answers = [(404, json.dumps({"error": "unknown_run", "message": "no"}).encode())]
        with pytest.raises(HttpNotFound):
            list(host.follow("dev1", "r1"))
        refusal = {"kind": "busy", "msg": "the board is busy", "req": "q1"}
        server.answers = [(200, b"event: error\ndata: " + json.dumps(refusal).encode() + b"\n\n")]
        with pytest.raises(RequestRefused) as refused:
            list(host.follow_request("dev1", "q1"))
        assert (refused.value.kind, refused.value.req) == ("busy", "q1")
    finally:
        server.close()


# --- against the real bridge ---------------------------------------------------------


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with Stack(tmp_path, bridge_args=HTTP) as s:
        yield s


def test_requests_runs_and_conversations_over_http(stack: Stack) -> None:
    base = http_url(stack)
    with HttpHost(base, token(stack, "alice")) as host:
        assert [d["device"] for d in host.devices()] == [DEVICE]
        runs = []
        for text in ("How warm is it in here?", "And now?", "And in the hall?"):
            req = host.request(DEVICE, text, conv="kitchen")["req"]
            follow = host.follow_request(DEVICE, req)
            events = list(follow)
            assert [e["i"] for e in events] == list(range(1, len(events) + 1))
            assert events[0]["t"] == "run.started" and events[-1]["t"] == "run.done"
            assert follow.run is not None and follow.snapshot is not None
            assert follow.snapshot.status == "done" and follow.snapshot.complete
            runs.append(follow.run)
            assert host.request_run(DEVICE, req) == follow.run
            # The bridge's snapshot says what the follow folded.
            snap = host.run(DEVICE, follow.run)
            assert snap["status"] == "done" and snap["lastId"] == events[-1]["i"]
            assert len(snap["rows"]) == len(follow.snapshot.rows)

        # After any id: exactly the rest.
        whole = list(host.follow(DEVICE, runs[0]))
        assert list(host.follow(DEVICE, runs[0], after=3)) == whole[3:]

        page = host.conversations()
        assert page["total"] == 1
        (conv,) = page["conversations"]
        assert conv["conv"] == "kitchen" and conv["runs"] == runs
        assert host.conversations(device="nosuch")["total"] == 0

        everything = host.conversation("kitchen", limit=500)
        assert not everything.has_earlier and everything.start == 0
        window = host.conversation("kitchen", limit=2)
        assert window.has_earlier and window.rows == everything.rows[-2:]
        while window.has_earlier:
            before = window.start
            window = host.load_earlier(window, limit=2)
            assert window.start == max(0, before - 2)
            assert window.rows == everything.rows[window.start :]
        assert window.rows == everything.rows
        assert host.load_earlier(window) is window
        users = [r["text"] for r in window.rows if r["kind"] == "user"]
        assert users == ["How warm is it in here?", "And now?", "And in the hall?"]


def test_refusals_are_named_errors(stack: Stack) -> None:
    base = http_url(stack)
    alice = HttpHost(base, token(stack, "alice"))
    req = alice.request(DEVICE, "How warm is it in here?")["req"]
    run = list(alice.follow_request(DEVICE, req))[0]["r"]

    forged = sign(secrets.token_bytes(32), TENANT, "alice")
    for bad in (forged, token(stack, "alice", ttl=-10), "x.y"):
        with pytest.raises(HttpAuthError) as e:
            HttpHost(base, bad).run(DEVICE, run)
        assert (e.value.status, e.value.kind) == (401, "bad_token")
        assert not isinstance(e.value, HttpForbidden)
    with pytest.raises(HttpAuthError):
        list(HttpHost(base, forged).follow(DEVICE, run))  # a stream refused at once

    bob = HttpHost(base, token(stack, "bob"))
    with pytest.raises(HttpForbidden) as f:
        bob.run(DEVICE, run)
    assert (f.value.status, f.value.kind) == (403, "forbidden")
    with pytest.raises(HttpForbidden):
        list(bob.follow(DEVICE, run))
    with pytest.raises(HttpForbidden):
        bob.conversations(user="alice")

    with pytest.raises(HttpNotFound) as n:
        alice.run("nosuch", run)
    assert n.value.kind == "unknown_device"
    with pytest.raises(HttpNotFound) as n:
        alice.run(DEVICE, "no-such-run")
    assert n.value.kind == "unknown_run"
    with pytest.raises(HttpNotFound) as n:
        alice.conversation("nosuch")
    assert n.value.kind == "unknown_conversation"

    # Nothing listening: HttpUnavailable, with the request's id to send it again under.
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    gone = HttpHost(f"http://127.0.0.1:{port}", token(stack, "alice"), timeout=2)
    with pytest.raises(HttpUnavailable) as u:
        gone.request(DEVICE, "hello", req="my-req-1")
    assert u.value.req == "my-req-1"


def test_a_long_streamed_answer_followed_through_cuts_arrives_once_in_order(
    tmp_path: Path,
) -> None:
    # A model that streams 2,400 characters in 4-character chunks, 5 ms apart: a few
    # hundred deltas, merged by the bridge into some dozens of events, while a proxy
    # drops the SSE connection every few kilobytes.
    answer = "".join(f"Reading {k}: the greenhouse is {18 + k % 7} degrees. " for k in range(60))
    answer = answer[:2400]
    script = [Turn(tool_calls=[ToolCall("read_temperature", "{}")]),
              Turn(text=answer, chunk_chars=4, delay_s=0.005)]  # fmt: skip
    with (
        ModelServer(script) as server,
        Stack(tmp_path, model_url=server.url, bridge_args=HTTP) as s,
    ):
        base = http_url(s)
        target = urllib.parse.urlsplit(base)
        assert target.hostname is not None and target.port is not None
        proxy = CuttingProxy((target.hostname, target.port), [1500, 2600, 900, 4000])
        try:
            alice = token(s, "alice")
            cut = HttpHost(f"http://127.0.0.1:{proxy.port}", alice, backoff_s=0.05,
                           max_backoff_s=0.2)  # fmt: skip
            req = HttpHost(base, alice).request(DEVICE, "How warm is it in here?")["req"]
            follow = cut.follow_request(DEVICE, req)
            got = list(follow)
            assert follow.reconnects >= 3 and proxy.cuts >= 3, (follow.reconnects, proxy.cuts)
        finally:
            proxy.close()
        whole = list(HttpHost(base, alice).follow(DEVICE, got[0]["r"]))
        assert got == whole  # no repeat, no hole, same order, same events
        assert [e["i"] for e in got] == list(range(1, len(got) + 1))
        deltas = [e for e in got if e["t"] == "msg.delta"]
        assert len(deltas) >= 20
        text = "".join(e["d"].get("text", "") for e in deltas)
        assert text.endswith(answer)
        assert follow.snapshot is not None and follow.snapshot.status == "done"
        assert follow.snapshot.complete


def test_a_client_tool_answered_by_a_handler_over_http(tmp_path: Path) -> None:
    calls = [ToolCall("ask_user", json.dumps({"q": "Vent the tank as well?"}))]
    script = [Turn(tool_calls=calls, args_chunk_chars=3), Turn(text="Noted: {last_tool_output}")]
    told: list[tuple[str, str]] = []
    asked: list[Any] = []

    def ask_user(args: Any) -> dict[str, Any]:
        asked.append(args)
        return {"vent": True}

    tools = ToolHandlers({"ask_user": ask_user},
                         on_delivery=lambda d, r, c, state: told.append((c, state)))  # fmt: skip
    with (
        ModelServer(script) as server,
        Stack(tmp_path, model_url=server.url, main_py=VALVES, bridge_args=HTTP) as s,
        HttpHost(http_url(s), token(s, "alice"), tools=tools) as host,
    ):
        req = host.request(DEVICE, "Check the line.")["req"]
        follow = host.follow_request(DEVICE, req)
        events = list(follow)
        kinds = [e["t"] for e in events]
        assert kinds[-1] == "run.done", kinds
        assert "run.paused" in kinds and "run.resumed" in kinds
        snap = follow.snapshot
        assert snap is not None and snap.status == "done"
        (call,) = [r for r in snap.rows if r.kind == "tool_call" and r.name == "ask_user"]
        assert asked == [{"q": "Vent the tank as well?"}]
        assert follow.deliveries() == host.deliveries(DEVICE, snap.run) == {call.call: "submitted"}
        assert [st for c, st in told if c == call.call] == ["pending", "submitting", "submitted"]
        assert call.delivery == "submitted"
        results = [r.output for r in snap.rows if r.kind == "tool_result"]
        assert results == [json.dumps({"vent": True})]
        assert [r.text for r in snap.rows if r.kind == "assistant"][-1] == 'Noted: {"vent": true}'
        # Following it again: the call is answered, nothing is run again.
        assert list(host.follow(DEVICE, snap.run)) == events
        assert len(asked) == 1


def test_https_with_the_bridges_certificate_as_cafile(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:P-256", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "2", "-subj", "/CN=127.0.0.1", "-addext",
                    "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)  # fmt: skip
    tls = [*HTTP, "--http-cert", cert, "--http-key", key]
    with Stack(tmp_path / "stack", bridge_args=tls) as s:
        base = http_url(s)
        assert base.startswith("https://")
        alice = token(s, "alice")
        host = HttpHost(base, alice, cafile=cert)
        req = host.request(DEVICE, "How warm is it in here?")["req"]
        events = list(host.follow_request(DEVICE, req))
        assert events[-1]["t"] == "run.done"
        # Not trusting the certificate: refused before a byte of the call is sent.
        with pytest.raises(HttpUnavailable, match="certificate"):
            HttpHost(base, alice).devices()


def test_an_approval_denied_over_http_is_told_to_the_model_and_the_run_finishes(
    tmp_path: Path,
) -> None:
    calls = [ToolCall("open_valve", json.dumps({"valve": 3}))]
    script = [Turn(tool_calls=calls), Turn(text="Understood: {last_tool_output}.")]
    with (
        ModelServer(script) as server,
        Stack(tmp_path, model_url=server.url, main_py=VALVES, bridge_args=HTTP) as s,
        HttpHost(http_url(s), token(s, "alice")) as host,
    ):
        req = host.request(DEVICE, "Open valve 3.")["req"]
        follow = host.follow_request(DEVICE, req)
        events = []
        for e in follow:
            events.append(e)
            if e["t"] == "approval.request":
                assert follow.run is not None
                host.approve(DEVICE, follow.run, e["d"]["call"], ok=False)
        kinds = [e["t"] for e in events]
        assert kinds[-1] == "run.done", kinds
        assert "run.paused" in kinds and "run.resumed" in kinds
        assert "approval.denied" in kinds and "approval.granted" not in kinds
        (denied,) = [e for e in events if e["t"] == "approval.denied"]
        assert denied["d"]["by"] == "alice"
        (result,) = [e for e in events if e["t"] == "tool.result"]
        assert result["d"]["output"] == "denied by alice" and result["d"].get("failed"), result
        # The tool never ran; the model heard the denial and answered.
        assert "tool open_valve ran" not in "\n".join(s.console)
        snap = follow.snapshot
        assert snap is not None and snap.status == "done"
        assert [r.text for r in snap.rows if r.kind == "assistant"][-1] == (
            "Understood: denied by alice.")  # fmt: skip
        assert len(server.requests) == 2
        # The bridge's snapshot says the same.
        assert host.run(DEVICE, snap.run)["status"] == "done"
