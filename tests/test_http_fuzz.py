"""The HTTP API fuzzed from its own OpenAPI document with schemathesis: every operation,
with generated paths, queries, headers and bodies, against a real Bridge (on its own
Mosquitto) served by the real uvicorn server over a socket. No answer may be a 500, or
carry a traceback; each must be one the document allows (status code, content type,
schema); and the bridge's memory stays bounded (no stream left open, RSS within a
ceiling)."""

from __future__ import annotations

import gc
import os
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
from tools.broker import MosquittoProcess

# The document's operations, by label ("GET /v1/devices", ...): one test each.
OPERATIONS = [r.ok() for r in schemathesis.openapi.from_dict(document()).get_all_operations()]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[World, HttpServer]]:
    from tools.broker import start_mosquitto

    tmp = tmp_path_factory.mktemp("fuzz")
    broker: MosquittoProcess = start_mosquitto(tmp / "broker")
    world = World(broker, tmp, ScriptedProvider())
    http = HttpServer(world.bridge, "127.0.0.1", 0)
    http.start()
    try:
        yield world, http
    finally:
        http.stop()
        world.close()
        broker.stop()


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


@pytest.mark.parametrize("auth", ["valid", "generated"])
@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.label for op in OPERATIONS])
def test_the_api_answers_what_its_document_says(
    operation: Any, auth: str, served: tuple[World, HttpServer], rss_before: int
) -> None:
    _, http = served
    alice = token("alice")
    statuses: set[int] = set()

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck),
              database=None)  # fmt: skip
    @given(case=operation.as_strategy())
    def call(case: Any) -> None:
        # A valid token of the tenant, so the fuzzing reaches past the door; or the
        # bearer tokens schemathesis makes up, which must all be 401 (or a path that
        # needs none).
        if auth == "valid":
            case.headers = {**(case.headers or {}), "Authorization": f"Bearer {alice}"}
        response = case.call(base_url=http.url, timeout=10)
        statuses.add(response.status_code)
        assert response.status_code < 500, (case.method, case.path, response.text[:300])
        case.validate_response(
            response,
            checks=[status_code_conformance, content_type_conformance,
                    response_schema_conformance],
            additional_checks=[_no_traceback],
        )  # fmt: skip

    call()
    if auth == "generated" and operation.definition.raw.get("security") != []:
        assert statuses <= {401}, statuses
    elif auth == "valid":
        assert statuses and 401 not in statuses, statuses


def test_after_the_fuzzing_no_stream_is_open_and_memory_is_bounded(
    served: tuple[World, HttpServer], rss_before: int
) -> None:
    world, _ = served
    assert world.bridge.hub.following == 0
    grown_kib = _resident_kib() - rss_before
    assert grown_kib < 200 * 1024, f"the process grew {grown_kib} KiB while fuzzed"

