"""The HTTP API fuzzed from its own OpenAPI document with schemathesis: every operation,
with generated paths, queries, headers and bodies, against a real Bridge (on its own
Mosquitto) served by the real uvicorn server over a socket. No answer may be a 500, or
carry a traceback; each must be one the document allows (status code, content type,
schema; a stream's every frame); every stream ends by itself; and the bridge's memory
stays bounded (no stream left open, RSS within a ceiling).

A generated device id is almost never one the registry holds, so on its own the fuzzing
would stop at the device's 404. About half the cases of an operation on a device name
the tenant's real one (dev1), and half of those the run (and request) it finished, so
the bodies, queries and headers reach the handlers behind the lookup: the request,
control and AG-UI bodies are checked, a finished run is read and streamed. The device
said it is offline, so a request the bridge would accept is refused 409 by name rather
than left waiting for a board that never answers (an AG-UI stream would wait for its
run.started).
"""

from __future__ import annotations

import gc
import itertools
import json
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from server_bridge.http.openapi import document
from server_bridge.http.server import HttpServer
from server_bridge.models.scripted import ScriptedProvider
from tests.test_bridge import World, token
from tests.waiting import wait_for
from tools.broker import MosquittoProcess


# One frame of a stream as schemathesis parses it (Open API 3.1 has no `itemSchema`,
# so it reads an event stream's `schema` as one event's, and the document's
# `{"type": "string"}`, the whole body, fails every frame): a JSON object as its data;
# an AG-UI event has its type. Heartbeat comments are no frame.
def _frame(data: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["data", "event"], "properties": {
        "data": {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": data},
        "event": {"type": "string"}, "id": {"type": "string", "minLength": 1}}}  # fmt: skip


def _framed(doc: dict[str, Any]) -> dict[str, Any]:
    """The document with each event stream's schema that of one frame (the test's
    copy: what the API documents is its own)."""
    for methods in doc["paths"].values():
        for op in methods.values():
            data = {"type": "object"}
            if op["operationId"] == "agui":
                data = {"type": "object", "required": ["type"],
                        "properties": {"type": {"type": "string"}}}  # fmt: skip
            for answer in op["responses"].values():
                sse = answer.get("content", {}).get("text/event-stream")
                if sse is not None:
                    sse["schema"] = _frame(data)
    return doc


# The document's operations, by label ("GET /v1/devices", ...): one test each.
SCHEMA = schemathesis.openapi.from_dict(_framed(document()))
OPERATIONS = [r.ok() for r in SCHEMA.get_all_operations()]
EXAMPLES = 25
# The tenant's device (World registers dev1 for acme, alice's tenant), and the run the
# board finished on it for alice before the fuzzing, with the request that started it.
DEVICE, RUN, REQ = "dev1", "r1", "q-r1"
# The answers that stop at the door or at the lookup of the device (or of the path).
_STOPPED = {(401, "bad_token"), (404, "unknown_device"), (404, "not_found")}
# Per operation label, with a valid token: how many cases reached past the lookup of
# their device. The file runs on one worker (`--dist loadfile`), so one dict holds all.
REACHED: Counter[str] = Counter()
# Each device operation, with a valid token, reaches its handlers in at least this many
# of its EXAMPLES cases: the 6 of 25 that name every id real always do (_known); those
# naming the device alone do unless a generated run id routes nowhere (a slash in it).
# Typically 12 of 25; generated ids alone reached them in 0 (measured).
FLOOR = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[World, HttpServer]]:
    from tools.broker import start_mosquitto

    tmp = tmp_path_factory.mktemp("fuzz")
    broker: MosquittoProcess = start_mosquitto(tmp / "broker")
    world = World(broker, tmp, ScriptedProvider())
    http = HttpServer(world.bridge, "127.0.0.1", 0)
    http.start()
    try:
        finish_a_run_then_go_offline(world)
        yield world, http
    finally:
        http.stop()
        world.close()
        broker.stop()


def finish_a_run_then_go_offline(w: World) -> None:
    """The board runs RUN for alice to its end, then says it is offline."""
    events = [
        {"t": "run.started", "d": {"agent": "thermostat", "ver": "0.1.0", "req": REQ,
                                   "conv": "c1", "usr": "alice", "domain": "request",
                                   "input": "How warm is it?"}},
        {"t": "msg.delta", "d": {"m": 1, "text": "21 °C"}},
        {"t": "run.done", "d": {"usage": {"in": 1, "out": 1}}},
    ]  # fmt: skip
    for i, e in enumerate(events, 1):
        env = {"r": RUN, "i": i, "ts": 1000 + i, **e}
        w.board.send(w.d("evt"), env)
        assert w.host.get(w.h("evt")) == env
    w.board.send(w.d("status"), {"st": "offline", "boot": "b0"})
    wait_for(lambda: (w.bridge.presence(DEVICE) or {}).get("st") == "offline", "offline")


def _resident_kib() -> int:
    # What the process holds now, after a collection: not the peak (ru_maxrss), which
    # depends on what the same process ran before (the suite runs files on several
    # workers in any order) and counts garbage not yet collected.
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


@pytest.fixture(scope="module")
def rss_before(served: tuple[World, HttpServer]) -> int:
    return _resident_kib()


def _no_traceback(ctx: Any, response: Any, case: Any) -> bool:
    text = response.text or ""
    assert "Traceback" not in text and 'File "' not in text, text[:300]
    return True


def _stopped(response: Any) -> bool:
    """Whether the answer is the door's 401 or the device's (or the path's) 404."""
    try:
        kind = json.loads(response.content).get("error")
    except (ValueError, AttributeError):
        return False
    return (response.status_code, kind) in _STOPPED


def _known(case: Any, n: int) -> None:
    """Case n, in turn: the generated ids twice, then the real device, then the device
    with its finished run and request (where the path has them; an AG-UI runId is the
    request's id, and names the run that request started)."""
    params = case.path_parameters
    if n % 4 < 2 or not params or "device" not in params:
        return
    params["device"] = DEVICE
    if n % 4 == 3:
        for name, value in (("run", RUN), ("req", REQ)):
            if name in params:
                params[name] = value
        if isinstance(case.body, dict) and "runId" in case.body:
            case.body["runId"] = REQ


@pytest.mark.parametrize("auth", ["valid", "generated"])
@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.label for op in OPERATIONS])
def test_the_api_answers_what_its_document_says(
    operation: Any, auth: str, served: tuple[World, HttpServer], rss_before: int
) -> None:
    _, http = served
    alice = token("alice")
    statuses: set[int] = set()
    cases = itertools.count()

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              database=None)  # fmt: skip
    @given(case=operation.as_strategy())
    def call(case: Any) -> None:
        # A valid token of the tenant, so the fuzzing reaches past the door; or the
        # bearer tokens schemathesis makes up, which must all be 401 (or a path that
        # needs none).
        _known(case, next(cases))
        if auth == "valid":
            case.headers = {**(case.headers or {}), "Authorization": f"Bearer {alice}"}
        response = case.call(base_url=http.url, timeout=10)
        statuses.add(response.status_code)
        assert response.status_code < 500, (case.method, case.path, response.text[:300])
        # Every stream here ends by itself: of a finished run, or a refusal (no board
        # answers, no event log holds a conversation). One read to the timeout is one
        # the bridge would hold open, a follower and a connection, for ever.
        assert not response.stream_cut_short, (case.method, case.path, case.query,
                                               case.headers, response.text[:300])  # fmt: skip
        case.validate_response(
            response,
            checks=[status_code_conformance, content_type_conformance,
                    response_schema_conformance],
            additional_checks=[_no_traceback],
        )  # fmt: skip
        if auth == "valid" and not _stopped(response):
            REACHED[operation.label] += 1

    call()
    if auth == "generated" and operation.definition.raw.get("security") != []:
        assert statuses <= {401}, statuses
    elif auth == "valid":
        assert statuses and 401 not in statuses, statuses
        if "{device}" in operation.path:
            assert REACHED[operation.label] >= FLOOR, (operation.label, REACHED)


def test_after_the_fuzzing_no_stream_is_open_and_memory_is_bounded(
    served: tuple[World, HttpServer], rss_before: int
) -> None:
    world, _ = served
    assert world.bridge.hub.following == 0
    grown_kib = _resident_kib() - rss_before
    assert grown_kib < 200 * 1024, f"the process grew {grown_kib} KiB while fuzzed"
    on_devices = {k: n for k, n in REACHED.items() if "{device}" in k}
    # The reach, shown with `pytest -s`: cases past the device's lookup, per operation.
    print(f"\nreached the handlers of a device in {sum(on_devices.values())} cases:",
          dict(sorted(on_devices.items())))  # fmt: skip
