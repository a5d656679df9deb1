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
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_bridge.eventlog import EventLog
from server_bridge.http.app import HEARTBEAT_S, build_app
from server_bridge.http.openapi import document
from server_bridge.http.server import HttpServer
from server_bridge.models.scripted import ScriptedProvider
from server_bridge.registry import Registry
from server_bridge.tokens import sign
from tests import dashboard_stack
from tests.model_server import ModelServer, ToolCall, Turn
from tests.stack import TENANT, Stack
from tests.test_bridge import World
from tests.test_bridge import token as world_token
from tests.waiting import wait_for
from tools.broker import MosquittoProcess

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
    # The demo's answer: the sensor read by its tool (the unix port's simulated 21.5),
    # then said back.
    texts = [r.get("text", "") for r in snap["rows"] if r["kind"] == "assistant"]
    assert texts[-1] == "It is 21.5 °C in here.", snap
    results = [r for r in snap["rows"] if r["kind"] == "tool_result"]
    assert [r["output"] for r in results] == ["21.5"], snap
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
        # Values JSON allows and the wire does not: an integer past 64 bits, and nesting
        # deeper than a board decodes (the second past the JSON parser's own recursion).
        (json.dumps({"input": "hi", "ttl": 10**30}).encode(), 400, "bad_envelope"),
        (b'{"input": "hi", "x": ' + b"[" * 16 + b"]" * 16 + b"}", 400, "bad_envelope"),
        (b'{"input": "hi", "x": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", 400, "bad_envelope"),
    ]
    # A client tool's answer goes on to the board as it came: an output past 64 bits once
    # failed its encode (found by tests/test_http_fuzz.py, answered 500).
    tool = f"{base}/v1/devices/thermo1/runs/r1/tool"
    cases += [(json.dumps({"call": "c1", "output": -(2**64)}).encode(), 400, "bad_envelope")]
    for body, status, kind in cases:
        r = httpx.post(tool if b'"call"' in body else url,
                       headers=bearer(alice) | {"content-type": "application/json"},
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


def test_conversations_page_keep_their_tables_and_read_the_same_after_a_restart(
    tmp_path: Path,
) -> None:
    # The dashboard's board agent: a request "table N" fills the public table `plants`
    # with N rows (tests/dashboard_stack.py).
    with Stack(tmp_path, main_py=dashboard_stack.MAIN_PY, heap=dashboard_stack.HEAP,
               bridge_args=HTTP) as s:  # fmt: skip
        base, alice = http_url(s), token(s, "alice")
        asked = [("beds", "table 3"), ("beds", "table 5"), ("pots", "table 2"),
                 ("herbs", "table 1")]  # fmt: skip
        runs: dict[str, list[str]] = {}
        for conv, text in asked:
            _, run = start(base, alice, text, conv=conv)
            assert stream(f"{base}/v1/devices/thermo1/runs/{run}/events", alice)[-1][
                "event"] == "run.done", s.describe()  # fmt: skip
            runs.setdefault(conv, []).append(run)

        def get(url: str) -> Any:
            got = httpx.get(url, headers=bearer(alice), timeout=30)
            assert got.status_code == 200, got.text
            return got.json()

        def read_all(base: str) -> tuple[Any, dict[str, Any], dict[str, Any]]:
            """The list, each conversation read whole, and each run's snapshot."""
            convs = {c: get(f"{base}/v1/conversations/{c}?limit=500") for c in runs}
            snaps = {r: get(f"{base}/v1/devices/thermo1/runs/{r}")
                     for rs in runs.values() for r in rs}  # fmt: skip
            return get(f"{base}/v1/conversations"), convs, snaps

        listed, convs, snaps = before = read_all(base)
        # The most recently active first, each with its runs in order.
        assert listed["total"] == 3
        assert [(c["conv"], c["runs"]) for c in listed["conversations"]] == [
            ("herbs", runs["herbs"]), ("pots", runs["pots"]), ("beds", runs["beds"])]  # fmt: skip
        # Pages of two: together the whole list, once, in its order.
        pages = [get(f"{base}/v1/conversations?limit=2&offset={k}") for k in (0, 2, 4)]
        assert [p["total"] for p in pages] == [3, 3, 3]
        assert [len(p["conversations"]) for p in pages] == [2, 1, 0]
        assert pages[0]["conversations"] + pages[1]["conversations"] == listed["conversations"]
        assert get(f"{base}/v1/conversations?limit=1&offset=1")["conversations"] == [
            listed["conversations"][1]]  # fmt: skip
        # A conversation read gives each run's tables as its snapshot has them.
        for conv, read in convs.items():
            assert [r["run"] for r in read["runs"]] == runs[conv]
            for about in read["runs"]:
                assert about["tables"] == snaps[about["run"]]["tables"]
        plants = [convs["beds"]["runs"][k]["tables"]["plants"] for k in (0, 1)]
        assert [sorted(r["key"] for r in p) for p in plants] == [
            [f"p{k}" for k in range(n)] for n in (3, 5)]  # fmt: skip
        assert {r["output"]["name"] for r in plants[1]} == {f"plant {k}" for k in range(5)}

        # A restarted bridge (killed: no clean stop) reads them all from its log alike.
        s.kill_bridge()
        s.start_bridge()
        assert read_all(http_url(s)) == before


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


# --- heartbeats and a reader too slow for its stream, on a bridge of this process ------
# (tests/test_bridge.py's World: the real Bridge on the session's Mosquitto, its board a
# paho peer, so the events are exactly what a test sends; served by the real uvicorn.)


@contextmanager
def served(
    broker: MosquittoProcess, tmp_path: Path, heartbeat_s: float = HEARTBEAT_S
) -> Iterator[tuple[World, str]]:
    """A World with an event log, and the URL its HTTP API is served at."""
    log = EventLog(tmp_path / "events")
    w = World(broker, tmp_path, ScriptedProvider(), events=log, replay_retry_s=60,
              replay_retry_max_s=60)  # fmt: skip
    http = HttpServer(w.bridge, "127.0.0.1", 0, heartbeat_s=heartbeat_s)
    http.start()
    try:
        yield w, http.url
    finally:
        http.stop()
        w.close()
        log.close()


def board_event(i: int, t: str, run: str = "r1", **d: Any) -> dict[str, Any]:
    return {"r": run, "i": i, "t": t, "ts": 1000 + i, "d": d}


def started(w: World, run: str = "r1", conv: str = "c1") -> dict[str, Any]:
    """The board starts `run` for alice in `conv`; returned once hosts have it."""
    env = board_event(1, "run.started", run, agent="thermostat", ver="0.1.0",
                      req=f"q-{run}", conv=conv, usr="alice", domain="request",
                      input="How warm is it?")  # fmt: skip
    w.board.send(w.d("evt"), env)
    assert w.host.get(w.h("evt")) == env
    return env


def until_beats(lines: Iterator[str], beats: int) -> list[dict[str, Any]]:
    """An SSE stream's frames (comments as {"comment": ...}) until `beats` heartbeats."""
    got: list[dict[str, Any]] = []
    for f in frames(lines):
        got.append(f)
        if sum(g.get("comment") == "heartbeat" for g in got) == beats:
            return got
    raise AssertionError(f"the stream ended after {got}")


def test_idle_run_and_conversation_streams_get_heartbeats(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    # A heartbeat of 0.1 s: each stream below is idle after its run.started, so only
    # heartbeats can come, and a stream without them would wait out the read timeout.
    with served(broker, tmp_path, heartbeat_s=0.1) as (w, base):
        first = started(w)
        alice = bearer(world_token("alice"))
        run_url = f"{base}/v1/devices/dev1/runs/r1/events"
        conv_url = f"{base}/v1/conversations/c1/events"
        with (
            httpx.stream("GET", run_url, headers=alice, timeout=10) as run_stream,
            httpx.stream("GET", conv_url, headers=alice, timeout=10) as conv_stream,
        ):
            for r in (run_stream, conv_stream):
                assert r.status_code == 200, r.read()
            run_lines, conv_lines = run_stream.iter_lines(), conv_stream.iter_lines()
            for lines in (run_lines, conv_lines):
                got = until_beats(lines, 2)
                assert got[0]["id"] == "r1:1" and got[0]["data"] == first
                assert got[1:] == [{"comment": "heartbeat"}] * (len(got) - 1)
            # Kept open by them, each stream still has the run live.
            done = board_event(2, "run.done", usage={"in": 1, "out": 1})
            w.board.send(w.d("evt"), done)
            for lines in (run_lines, conv_lines):
                event = next(f for f in frames(lines) if "comment" not in f)
                assert event["id"] == "r1:2" and event["data"] == done
            # The run's stream ends with its run; a conversation's never does by itself.
            assert [f for f in frames(run_lines) if "comment" not in f] == []


def to_the_end(lines: Iterator[str], beats: int = 20) -> list[dict[str, Any]]:
    """A stream's event frames until it ends; fails after `beats` heartbeats, which a
    stream that never ends would send for ever."""
    got: list[dict[str, Any]] = []
    for f in frames(lines):
        if "comment" not in f:
            got.append(f)
            continue
        beats -= 1
        assert beats > 0, f"the stream did not end: {got}"
    return got


def test_a_stream_resumed_past_a_runs_end_ends_with_the_run(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    # A resume point past the run's last id (a stale or made-up Last-Event-ID): the
    # stream has nothing to give, and must end when the run has ended or once it ends,
    # not beat for ever. Heartbeats every 0.1 s, so a stream that waits shows them.
    with served(broker, tmp_path, heartbeat_s=0.1) as (w, base):
        started(w)
        alice = bearer(world_token("alice"))
        url = f"{base}/v1/devices/dev1/runs/r1/events"
        # Live: resumed at 9 while the run has sent only id 1; the run ends at 3.
        with httpx.stream("GET", url, headers={**alice, "Last-Event-ID": "r1:9"},
                          timeout=10) as live:  # fmt: skip
            assert live.status_code == 200, live.read()
            lines = live.iter_lines()
            assert until_beats(lines, 1) == [{"comment": "heartbeat"}]
            ends = [board_event(2, "msg.delta", m=1, text="It is warm."),
                    board_event(3, "run.done", usage={"in": 1, "out": 1})]  # fmt: skip
            w.board.send(w.d("evt"), ends)
            assert [w.host.get(w.h("evt")) for _ in ends] == ends
            # Nothing past 9 comes, and the stream ends with the run.
            assert to_the_end(lines) == []
        # Finished: resumed past its end, by header and by query, the stream ends at once.
        for params, headers in (({"after": 4}, alice),
                                ({}, {**alice, "Last-Event-ID": "r1:1000"})):  # fmt: skip
            with httpx.stream("GET", url, params=params, headers=headers, timeout=10) as r:
                assert r.status_code == 200, r.read()
                assert to_the_end(r.iter_lines()) == []

TEXT = "The living room reads twenty one degrees and the hall a little less. " * 14


def flood(w: World, run: str, first: int, until: Any, most: int = 20_000) -> list[dict[str, Any]]:
    """Deltas of `run` from id `first` on, ten a payload as a board batches them, each
    payload once the host peer has the one before (a board's pace: the bridge's host
    lanes defer what they have no room for, to ask the board again later, which this
    peer would not answer), until `until()` holds; what was sent."""
    sent: list[dict[str, Any]] = []
    i = first
    while not until() and len(sent) < most:
        batch = [board_event(i + k, "msg.delta", run, m=1, text=f"{i + k}: {TEXT}")
                 for k in range(10)]  # fmt: skip
        w.board.send(w.d("evt"), batch)
        assert [w.host.get(w.h("evt")) for _ in batch] == batch
        sent += batch
        i += len(batch)
    assert until(), (len(sent), w.bridge.hub.following, w.bridge.stats)
    return sent


def test_a_reader_too_slow_for_its_run_is_cut_with_a_reason_and_resumes_exactly(
    broker: MosquittoProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with served(broker, tmp_path) as (w, base):
        # A stream may fall 64 events behind its run, not 4,096: a reader that stops
        # reading fills the sockets' buffers, then the hub's queue (after 0.5 to 3 MB
        # of kilobyte events here).
        monkeypatch.setattr(w.bridge.hub, "limit", 64)
        alice = world_token("alice")
        url = f"{base}/v1/devices/dev1/runs/r1/events"
        run = [started(w), board_event(2, "msg.start", m=1, role="assistant")]
        w.board.send(w.d("evt"), run[1])
        assert w.host.get(w.h("evt")) == run[1]
        with httpx.stream("GET", url, headers=bearer(alice), timeout=30) as r:
            assert r.status_code == 200, r.read()
            # Not read while the run goes on.
            run += flood(w, "r1", 3, lambda: w.bridge.hub.cut >= 1)
            run += [board_event(len(run) + 1, "msg.end", m=1),
                    board_event(len(run) + 2, "run.done", usage={"in": 1, "out": 1})]  # fmt: skip
            w.board.send(w.d("evt"), run[-2:])
            assert [w.host.get(w.h("evt")) for _ in range(2)] == run[-2:]
            got = [f for f in frames(r.iter_lines()) if "comment" not in f]
        # The stream ended with the reason, after the last event it gave, and gave
        # every event up to it once, in order.
        *given, cut = got
        assert cut["event"] == "error" and cut["data"]["kind"] == "too_slow", cut
        after = cut["data"]["after"]
        assert cut["data"]["r"] == "r1" and "resume" in cut["data"]["msg"]
        assert 2 <= after < len(run) - 1
        assert [f["id"] for f in given] == [f"r1:{i}" for i in range(1, after + 1)]
        assert [f["data"] for f in given] == run[:after]
        # Resumed after it (Last-Event-ID, or ?after=): the rest, no repeat, no hole.
        for rest in (stream(url, alice, last=cut["data"]["r"] + f":{after}"),
                     stream(f"{url}?after={after}", alice)):  # fmt: skip
            assert [f["id"] for f in rest] == [f"r1:{i}" for i in range(after + 1, len(run) + 1)]
            assert [f["data"] for f in rest] == run[after:]
        assert w.bridge.hub.following == 0


def test_an_agui_reader_too_slow_for_its_run_gets_run_error_too_slow_and_resumes(
    broker: MosquittoProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with served(broker, tmp_path) as (w, base):
        monkeypatch.setattr(w.bridge.hub, "limit", 64)  # as above
        alice = bearer(world_token("alice"))
        url = f"{base}/v1/devices/dev1/agui"
        body = {"threadId": "c2", "runId": "q-r2", "state": {}, "messages": [], "tools": [],
                "context": [], "forwardedProps": {}}  # fmt: skip
        started(w, "r2", conv="c2")
        run = [board_event(2, "msg.start", "r2", m=1, role="assistant")]
        w.board.send(w.d("evt"), run[0])
        assert w.host.get(w.h("evt")) == run[0]
        # Going on after run.started, as a client whose first stream dropped there.
        with httpx.stream("POST", url, headers=alice | {"Last-Event-ID": "r2:1"}, json=body,
                          timeout=30) as r:  # fmt: skip
            assert r.status_code == 200, r.read()
            run += flood(w, "r2", 3, lambda: w.bridge.hub.cut >= 1)
            usage = {"in": 1, "out": 1}
            run += [board_event(len(run) + 2, "msg.end", "r2", m=1),
                    board_event(len(run) + 3, "run.done", "r2", usage=usage)]  # fmt: skip
            w.board.send(w.d("evt"), run[-2:])
            assert [w.host.get(w.h("evt")) for _ in range(2)] == run[-2:]
            got = [f for f in frames(r.iter_lines()) if "comment" not in f]
        *given, cut = got
        assert cut["data"]["type"] == "RUN_ERROR" and cut["data"]["code"] == "too_slow", cut
        # Each frame that ends a Wren event's AG-UI events carries its id (msg.start,
        # event 2, has none: a message starts with its first text).
        ids = [f["id"] for f in given if "id" in f]
        after = int(ids[-1].rsplit(":", 1)[1])
        assert ids == [f"r2:{i}" for i in range(3, after + 1)]
        assert given[0]["data"]["type"] == "TEXT_MESSAGE_START"
        with httpx.stream("POST", url, headers=alice | {"Last-Event-ID": ids[-1]}, json=body,
                          timeout=30) as r:  # fmt: skip
            assert r.status_code == 200, r.read()
            rest = [f for f in frames(r.iter_lines()) if "comment" not in f]
        assert [f["id"] for f in rest if "id" in f] == [
            f"r2:{i}" for i in range(after + 1, len(run) + 2)]  # fmt: skip
        assert [f["data"]["type"] for f in rest[-2:]] == ["TEXT_MESSAGE_END", "RUN_FINISHED"]
        # Between the two streams, the whole text, once, in order.
        said = [f["data"]["delta"] for f in given + rest
                if f["data"]["type"] == "TEXT_MESSAGE_CONTENT"]  # fmt: skip
        assert said == [e["d"]["text"] for e in run if e["t"] == "msg.delta"]
