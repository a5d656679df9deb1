"""A replay from the durable event log gives the snapshot hosts saw live (issue "Hosts over
HTTP"), on every recorded stream of tests/fixtures/streams/: holes filled out of order,
gaps the board declares, duplicate replays, refused envelopes, pauses, tables, nodes and
the real runs recorded from the demo and the greenhouse. Each stream goes through the
bridge's EventIntake with a real EventLog, as a board's `evt` payloads; what the intake
sent hosts and what the log holds once reopened (what a restarted bridge replays) are
folded by the host reducer, and must agree byte for byte once canonical.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

from server_bridge.eventlog import EventLog
from server_bridge.host.reducer import Reducer
from server_bridge.http.views import snapshot_json
from server_bridge.intake import EventIntake
from server_bridge.registry import DeviceRecord
from server_bridge.wire import WireError
from tests.test_reducer_fixtures import FIXTURES, canonical

TENANT = "acme"


def fold(device: str, events: list[dict[str, Any]]) -> str:
    """Every run's snapshot after `events`, canonical JSON (the reducers' comparison)."""
    reducer = Reducer(device)
    for env in events:
        reducer.apply(env)
    return canonical({snap.run: snapshot_json(snap) for snap in reducer.runs()})


def test_there_are_recorded_streams() -> None:
    assert len(FIXTURES) >= 10


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_the_log_replays_a_recorded_stream_to_the_snapshot_seen_live(
    path: Path, tmp_path: Path
) -> None:
    fixture = json.loads(path.read_text(encoding="utf-8"))
    device = DeviceRecord(fixture["device"], TENANT, "thermostat")
    published: list[tuple[str, bytes]] = []
    log = EventLog(tmp_path / "events")
    intake = EventIntake("wren/v1", lambda topic, payload: published.append((topic, payload)),
                         event_log=log, replay_retry_s=60, replay_retry_max_s=60)  # fmt: skip
    refused = 0
    try:
        for step in fixture["steps"]:
            if "event" not in step:
                continue  # markLost, delivery: a host's own steps, not the board's
            try:
                intake.handle_evt(device, msgpack.packb(step["event"], use_bin_type=True))
            except WireError:
                refused += 1
    finally:
        log.close()
    # What hosts were sent (not the replay requests to the board), by run.
    sent = [p for topic, p in published if f"/h/{TENANT}/" in topic and topic.endswith("/evt")]
    live: dict[str, list[bytes]] = {}
    for payload in sent:
        live.setdefault(msgpack.unpackb(payload, raw=False)["r"], []).append(payload)
    assert live, "the intake sent hosts nothing"
    if path.stem == "refused_envelopes":
        assert refused > 0

    reopened = EventLog(tmp_path / "events")
    try:
        logged = {run: [e.payload for e in reopened.events(TENANT, device.device, run)]
                  for run in live}  # fmt: skip
        # And nothing of a run hosts were never sent.
        named = {s["event"].get("r") for s in fixture["steps"]
                 if isinstance(s.get("event"), dict)}  # fmt: skip
        for run in named - set(live):
            if isinstance(run, str) and run:
                assert not reopened.events(TENANT, device.device, run), run
    finally:
        reopened.close()
    as_sent = [msgpack.unpackb(p, raw=False) for p in sent]
    from_log = [msgpack.unpackb(p, raw=False) for ps in logged.values() for p in ps]
    snapshot = fold(device.device, as_sent)
    assert json.loads(snapshot), "no run folded"
    assert fold(device.device, from_log) == snapshot
    assert logged == live  # and the same events, the same bytes, in the same order
