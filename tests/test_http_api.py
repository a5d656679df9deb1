"""The hosts' HTTP API (issue "Hosts over HTTP"; server_bridge/http/), against the real
`wren bridge --http` process, Mosquitto and the demo thermostat on the MicroPython unix
port, called with a real HTTP client (httpx) over a socket.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_bridge.http.app import build_app
from server_bridge.http.openapi import document
from server_bridge.registry import Registry
from server_bridge.tokens import sign
from tests.model_server import ModelServer, ToolCall, Turn
from tests.stack import TENANT, Stack
from tests.waiting import wait_for

HTTP = ["--http", "127.0.0.1:0"]


def http_url(s: Stack) -> str:
    """The URL the bridge's latest start printed."""
    found = re.findall(r"^http at (\S+)$", s.bridge_log(), re.M)
    assert found, s.describe()
    return found[-1]


def tenant_secret(s: Stack, tenant: str = TENANT) -> bytes:
    registry = Registry(s.registry_path)
    try:
        secret = registry.tenant_secret(tenant)
    finally:
        registry.close()
    assert secret is not None
    return bytes.fromhex(secret)


def token(s: Stack, user: str, watch: bool = False, ttl: int = 600) -> str:
    return sign(tenant_secret(s), TENANT, user, ttl_s=ttl, watch=watch)


def bearer(tok: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {tok}"}


def frames(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """SSE frames as {id, event, data (parsed), comment}: LF line ends, a blank line
    ends a frame."""
    frame: dict[str, Any] = {}
    for line in lines:
        if line == "":
            if frame:
                yield frame
            frame = {}
        elif line.startswith(":"):
            yield {"comment": line[1:].strip()}
        else:
            key, _, value = line.partition(": ")
            frame[key] = json.loads(value) if key == "data" else value


def stream(url: str, tok: str, last: str | None = None) -> list[dict[str, Any]]:
    """A run's SSE stream until it ends (the run's terminal event)."""
    headers = bearer(tok) | ({"Last-Event-ID": last} if last else {})
    with httpx.stream("GET", url, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return [f for f in frames(r.iter_lines()) if "comment" not in f]


def start(base: str, tok: str, text: str, **more: Any) -> tuple[str, str]:
    """POST a request, then wait for its run: (req, run)."""
    r = httpx.post(f"{base}/v1/devices/thermo1/requests", headers=bearer(tok),
                   json={"input": text, **more}, timeout=30)  # fmt: skip
    assert r.status_code == 202, r.text
    req = r.json()["req"]

    def run_of() -> str | None:
        got = httpx.get(f"{base}/v1/devices/thermo1/requests/{req}", headers=bearer(tok))
        assert got.status_code == 200, got.text
        return got.json()["run"]  # type: ignore[no-any-return]

    return req, wait_for(run_of, f"the run of request {req}", 60)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with Stack(tmp_path, bridge_args=HTTP) as s:
        yield s


def test_a_run_started_over_http_streams_to_done_and_resumes_after_any_id(
    stack: Stack,
) -> None:
    base, alice = http_url(stack), token(stack, "alice")
    _, run = start(base, alice, "How warm is it in here?")
    events_url = f"{base}/v1/devices/thermo1/runs/{run}/events"
    whole = stream(events_url, alice)
    ids = [f["id"] for f in whole]
    assert ids == [f"{run}:{i}" for i in range(1, len(whole) + 1)]
    assert whole[0]["event"] == "run.started" and whole[-1]["event"] == "run.done"
    assert all(f["data"]["r"] == run and f["event"] == f["data"]["t"] for f in whole)
    # From any id: exactly the rest, no repeat, no hole.
    for k in (1, len(whole) // 2, len(whole) - 1):
        rest = stream(events_url, alice, last=ids[k - 1])
        assert [f["id"] for f in rest] == ids[k:]
        assert [f["data"] for f in rest] == [f["data"] for f in whole[k:]]
    # Resumed after its terminal event, the stream ends at once, with nothing.
    assert stream(events_url, alice, last=ids[-1]) == []
    # ?after= does the same for a client that cannot set headers.
    assert [f["id"] for f in stream(events_url + "?after=2", alice)] == ids[2:]

    got = httpx.get(f"{base}/v1/devices/thermo1/runs/{run}", headers=bearer(alice))
    assert got.status_code == 200, got.text + stack.describe()
    snap = got.json()
    assert snap["status"] == "done" and snap["lastId"] == len(whole)
    texts = [r.get("text", "") for r in snap["rows"] if r["kind"] == "assistant"]
    assert any("°C" in t or "degrees" in t or t for t in texts), snap
    assert snap["rows"][0] == {"kind": "user", "text": "How warm is it in here?",
                               "status": "done"}  # fmt: skip


def test_a_stream_resumes_across_a_bridge_restart_from_the_log(stack: Stack) -> None:
    base, alice = http_url(stack), token(stack, "alice")
    _, run = start(base, alice, "How warm is it in here?")
    whole = stream(f"{base}/v1/devices/thermo1/runs/{run}/events", alice)
    stack.kill_bridge()
    stack.start_bridge()
    base = http_url(stack)
    rest = stream(f"{base}/v1/devices/thermo1/runs/{run}/events", alice, last=whole[2]["id"])
    assert [f["data"] for f in rest] == [f["data"] for f in whole[3:]]


def test_who_may_read_and_what_a_refusal_reveals(stack: Stack) -> None:
    base, alice = http_url(stack), token(stack, "alice")
    _, run = start(base, alice, "How warm is it in here?")
    stream(f"{base}/v1/devices/thermo1/runs/{run}/events", alice)
    snapshot = f"{base}/v1/devices/thermo1/runs/{run}"

    # No token, a forged one, an expired one, one of a tenant the bridge does not
    # know: 401, in the same words, whatever was wrong.
    forged = sign(secrets.token_bytes(32), TENANT, "alice")
    stranger = sign(secrets.token_bytes(32), "globex", "alice")
    expired = token(stack, "alice", ttl=-10)
    answers = [httpx.get(snapshot, headers=h) for h in
               ({}, bearer(forged), bearer(stranger), bearer(expired), bearer("x.y"))]  # fmt: skip
    assert {r.status_code for r in answers} == {401}
    assert len({r.text for r in answers}) == 1

    # Another user of the tenant: 403 on alice's run, its events and its request; a
    # watcher reads them.
    bob = token(stack, "bob")
    assert httpx.get(snapshot, headers=bearer(bob)).status_code == 403
    assert httpx.get(snapshot + "/events", headers=bearer(bob)).status_code == 403
    ops = token(stack, "ops", watch=True)
    assert httpx.get(snapshot, headers=bearer(ops)).json()["status"] == "done"

    # A device of another tenant is the same 404 as one that does not exist.
    registry = Registry(stack.registry_path)
    try:
        registry.add_tenant("globex", secrets.token_bytes(32))
        registry.add_device("kiosk9", "globex", "kiosk")
    finally:
        registry.close()
    time.sleep(0.1)
    theirs = httpx.get(f"{base}/v1/devices/kiosk9/runs/{run}", headers=bearer(alice))
    nothing = httpx.get(f"{base}/v1/devices/nosuch/runs/{run}", headers=bearer(alice))
    assert theirs.status_code == nothing.status_code == 404
    assert theirs.json()["error"] == nothing.json()["error"] == "unknown_device"
    listed = httpx.get(f"{base}/v1/devices", headers=bearer(alice)).json()["devices"]
    assert [d["device"] for d in listed] == ["thermo1"]
    assert listed[0]["presence"]["st"] == "online"


def test_bad_bodies_are_refused_by_name_and_the_bridge_serves_on(stack: Stack) -> None:
    base, alice = http_url(stack), token(stack, "alice")
    url = f"{base}/v1/devices/thermo1/requests"
    cases = [
        (b"not json", 400, "bad_envelope"),
        (b"[1, 2]", 400, "bad_envelope"),
        (json.dumps({"input": 5}).encode(), 400, "bad_envelope"),
        (json.dumps({"input": "hi", "req": "r" * 65}).encode(), 400, "bad_envelope"),
        (json.dumps({"input": "hi", "conv": 7}).encode(), 400, "bad_envelope"),
        (json.dumps({"input": "x" * 70_000}).encode(), 413, "too_large"),
        (json.dumps({"input": "x" * 6_000}).encode(), 413, "too_large"),
    ]
    for body, status, kind in cases:
        r = httpx.post(url, headers=bearer(alice) | {"content-type": "application/json"},
                       content=body)  # fmt: skip
        assert r.status_code == status, (body[:40], r.text)
        assert "Traceback" not in r.text
        if kind is not None:
            assert r.json()["error"] == kind, r.text
    bad_after = httpx.get(f"{base}/v1/devices/thermo1/runs/x/events?after=-1",
                          headers=bearer(alice))  # fmt: skip
    assert bad_after.status_code == 400
    # And a good one runs.
    _, run = start(base, alice, "How warm is it in here?")
    assert stream(f"{base}/v1/devices/thermo1/runs/{run}/events", alice)[-1]["event"] == "run.done"


def test_conversations_list_and_read_as_a_window_from_the_tail(stack: Stack) -> None:
    base, alice = http_url(stack), token(stack, "alice")
    for text in ("How warm is it in here?", "And now?"):
        _, run = start(base, alice, text, conv="kitchen")
        stream(f"{base}/v1/devices/thermo1/runs/{run}/events", alice)
    listed = httpx.get(f"{base}/v1/conversations", headers=bearer(alice)).json()
    assert listed["total"] == 1
    (conv,) = listed["conversations"]
    assert conv["conv"] == "kitchen" and conv["device"] == "thermo1"
    assert len(conv["runs"]) == 2 and conv["status"] == "done"
    assert conv["agent"] == "thermostat"
    # Bob has none, and may not list alice's.
    bob = token(stack, "bob")
    assert httpx.get(f"{base}/v1/conversations", headers=bearer(bob)).json()["total"] == 0
    assert httpx.get(f"{base}/v1/conversations?user=alice",
                     headers=bearer(bob)).status_code == 403  # fmt: skip

    whole = httpx.get(f"{base}/v1/conversations/kitchen?limit=500", headers=bearer(alice)).json()
    assert not whole["hasEarlier"] and whole["from"] == 0
    users = [r["text"] for r in whole["rows"] if r["kind"] == "user"]
    assert users == ["How warm is it in here?", "And now?"]
    tail = httpx.get(f"{base}/v1/conversations/kitchen?limit=2", headers=bearer(alice)).json()
    assert tail["hasEarlier"] and tail["rows"] == whole["rows"][-2:]
    earlier = httpx.get(f"{base}/v1/conversations/kitchen?limit=2&before={tail['from']}",
                        headers=bearer(alice)).json()  # fmt: skip
    assert earlier["rows"] == whole["rows"][tail["from"] - 2 : tail["from"]]
    assert [r["run"] for r in whole["runs"]] == conv["runs"]

    # Filters: the last run's device, agent and status; activity in a time range.
    def listed_with(query: str) -> int:
        got = httpx.get(f"{base}/v1/conversations?{query}", headers=bearer(alice))
        assert got.status_code == 200, got.text
        return got.json()["total"]  # type: ignore[no-any-return]

    assert conv["started"] <= conv["updated"] <= time.time() * 1000
    assert listed_with("device=thermo1&agent=thermostat&status=done") == 1
    assert listed_with("agent=greeter") == 0 and listed_with("status=running") == 0
    assert listed_with(f"since={conv['updated']}&until={conv['started']}") == 1
    assert listed_with(f"since={conv['updated'] + 1}") == 0
    assert listed_with(f"until={conv['started'] - 1}") == 0
    bad = httpx.get(f"{base}/v1/conversations?status=asleep", headers=bearer(alice))
    assert bad.status_code == 400 and bad.json()["error"] == "bad_envelope"


def conversation_frames(
    url: str, tok: str, until_done: int, last: str | None = None,
    into: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """A conversation's SSE stream (it never ends by itself) until `until_done` runs
    have ended in it; each frame is added to `into` as it comes."""
    headers = bearer(tok) | ({"Last-Event-ID": last} if last else {})
    got: list[dict[str, Any]] = [] if into is None else into
    with httpx.stream("GET", url, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for f in frames(r.iter_lines()):
            if "comment" in f:
                continue
            got.append(f)
            if sum(g["event"] in ("run.done", "run.failed") for g in got) == until_done:
                return got
    raise AssertionError(f"the stream ended after {len(got)} frames")


def test_a_conversation_streams_its_runs_in_order_then_new_ones_live_and_resumes(
    stack: Stack,
) -> None:
    import threading

    base, alice = http_url(stack), token(stack, "alice")
    runs = []
    for text in ("How warm is it in here?", "And now?"):
        _, run = start(base, alice, text, conv="kitchen")
        stream(f"{base}/v1/devices/thermo1/runs/{run}/events", alice)
        runs.append(run)
    _, other = start(base, alice, "What about the hall?", conv="hall")
    stream(f"{base}/v1/devices/thermo1/runs/{other}/events", alice)
    url = f"{base}/v1/conversations/kitchen/events"

    # Opened now, it gives both runs from the log, then a third as it happens.
    live: list[dict[str, Any]] = []
    reader = threading.Thread(target=conversation_frames, args=(url, alice, 3, None, live))
    reader.start()
    wait_for(lambda: sum(f["event"] == "run.done" for f in live) == 2, "the logged runs", 30)
    _, third = start(base, alice, "And in an hour?", conv="kitchen")
    runs.append(third)
    reader.join(90)
    assert not reader.is_alive()
    by_run = [f["id"].rsplit(":", 1)[0] for f in live]
    assert list(dict.fromkeys(by_run)) == runs  # in the order they began; not "hall"
    for run in runs:
        ids = [int(f["id"].rsplit(":", 1)[1]) for f in live if f["id"].startswith(run + ":")]
        assert ids == list(range(1, len(ids) + 1)), (run, ids)
    assert live[-1]["event"] == "run.done" and live[-1]["data"]["r"] == third

    # Resumed from the middle of the first run: the rest, exactly, and nothing else.
    k = by_run.index(runs[1]) // 2
    rest = conversation_frames(url, alice, 3, live[k]["id"])
    assert [f["id"] for f in rest] == [f["id"] for f in live[k + 1 :]]
    assert [f["data"] for f in rest] == [f["data"] for f in live[k + 1 :]]

    # Bob has no such conversation; a watcher may follow alice's by name.
    bob = token(stack, "bob")
    assert httpx.get(url, headers=bearer(bob)).status_code == 404
    assert httpx.get(url + "?user=alice", headers=bearer(bob)).status_code == 403
    watcher = token(stack, "ops", watch=True)
    seen = conversation_frames(url + "?user=alice", watcher, 3)
    assert [f["id"] for f in seen] == [f["id"] for f in live]


def test_the_openapi_document_names_exactly_the_apps_routes() -> None:
    app = build_app(object())  # type: ignore[arg-type]
    served = set()
    for route in app.routes:
        if not route.path.startswith(("/v1/", "/openapi")):  # type: ignore[attr-defined]
            continue  # the dashboard's files (/, /ui/...): not the API
        for method in getattr(route, "methods", None) or ():
            if method != "HEAD":
                # A path converter ({src:path}) is the document's plain parameter.
                path = re.sub(r":\w+}", "}", route.path)  # type: ignore[attr-defined]
                served.add((path, method.lower()))
    doc = document()
    documented = {(path, m) for path, ops in doc["paths"].items() for m in ops}
    assert served == documented
    assert doc["openapi"].startswith("3.1")


def test_a_stream_opened_mid_run_follows_it_live_without_a_repeat_or_a_hole(
    tmp_path: Path,
) -> None:
    # A model that streams 600 characters in 4-character chunks, 10 ms apart: the SSE
    # stream opens while the run is going, so its first events come from the window
    # and the rest live, through the hub.
    answer = "The living room reads twenty one degrees and the hall a little less. " * 9
    with (
        ModelServer([Turn(tool_calls=[ToolCall("read_temperature", "{}")]),
                     Turn(text=answer[:600], chunk_chars=4, delay_s=0.01)]) as server,
        Stack(tmp_path, model_url=server.url, bridge_args=HTTP) as s,
    ):  # fmt: skip
        base, alice = http_url(s), token(s, "alice")
        _, run = start(base, alice, "How warm is it in here?")
        got = stream(f"{base}/v1/devices/thermo1/runs/{run}/events", alice)
        ids = [int(f["id"].rsplit(":", 1)[1]) for f in got]
        assert ids == list(range(1, len(ids) + 1)) and got[-1]["event"] == "run.done"
        text = "".join(f["data"]["d"].get("text", "") for f in got
                       if f["event"] == "msg.delta")  # fmt: skip
        assert text.endswith(answer[:600]), text[-80:]
        snap = httpx.get(f"{base}/v1/devices/thermo1/runs/{run}", headers=bearer(alice)).json()
        assert snap["status"] == "done"


def test_a_follower_that_falls_behind_is_cut_with_a_reason() -> None:
    import asyncio

    from server_bridge.http.hub import EventHub

    async def main() -> tuple[str | None, int, int]:
        hub = EventHub(limit=5)
        f = hub.follow("acme", "dev1", "r1")
        other = hub.follow("acme", "dev1", "")  # every run of the device
        loop = asyncio.get_running_loop()
        # Published from another thread, as paho's network thread does.
        await loop.run_in_executor(None, lambda: [
            hub.publish("acme", "dev1", "r1", i, b"x") for i in range(1, 9)])  # fmt: skip
        assert await f.wait(1.0)
        taken = len(f.take()) + len(other.take())
        hub.leave(f)
        hub.leave(other)
        return f.cut, taken, hub.following

    cut, taken, following = asyncio.run(main())
    assert cut is not None and "resume" in cut
    assert taken == 10  # five each: then both were cut, and nothing more was queued
    assert following == 0
