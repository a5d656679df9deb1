"""The bridge's own redaction of private fields (server_bridge/privacy.py): whatever a
board sends, hosts, the replay window and the event log get a private field's data
blanked, by the fields the device's hello declares."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack

from server_bridge.eventlog import EventLog
from server_bridge.privacy import Redactor, declared
from tests.test_bridge import DEV, Sink, ev, intake

FIELDS = [
    {"name": "notes", "vis": "public", "kind": "collection", "stream": True},
    {"name": "diary", "vis": "private", "kind": "collection"},
    {"name": "plan", "vis": "public", "kind": "slot"},
    {"name": "persona", "vis": "public", "core": True},
]


def call(i: int, cid: str, name: str, args: Any) -> dict[str, Any]:
    text = args if isinstance(args, str) else json.dumps(args)
    return ev(i, "tool.call", call=cid, name=name, input=text, client=False)


def result(i: int, cid: str, output: str) -> dict[str, Any]:
    return ev(i, "tool.result", call=cid, output=output, failed=False)


def test_hosts_and_the_log_get_private_data_blanked_and_public_data_as_sent(
    tmp_path: Path,
) -> None:
    sink = Sink()
    with EventLog(tmp_path / "events") as log:
        it = intake(sink, event_log=log)
        it.handle_hello(DEV, msgpack.packb({"agent": "thermostat", "fields": FIELDS}))
        sent = [
            ev(1, "run.started", req="q1", usr="alice"),
            call(2, "c1", "memory.remember", {"field": "diary", "key": "d1", "value": "secret"}),
            result(3, "c1", "stored secret"),
            call(4, "c2", "memory.remember", {"field": "notes", "key": "n1", "value": "milk"}),
            result(5, "c2", "stored milk"),
            call(6, "c3", "memory.recall", {"query": "what did I say"}),  # every collection
            result(7, "c3", "secret"),
            call(8, "c4", "memory.append", {"field": "persona", "text": "likes tea"}),  # core
            result(9, "c4", "ok"),
            call(10, "c5", "memory.peek", "not json"),
            result(11, "c5", "?"),
            call(12, "c6", "read_temperature", {"room": "hall"}),  # not a memory tool
            result(13, "c6", "21 C"),
            ev(14, "mem.write", op="remember", field="diary", key="d1", w="w1"),
            ev(15, "mem.write", op="remember", field="notes", key="n1", w="w2"),
            ev(16, "row", field="diary", row="d1", status="final", value="secret"),
            ev(17, "row", field="notes", row="n1", status="final", value="milk"),
            ev(18, "output", name="diary", value="secret", status="final"),
            ev(19, "output", name="plan", value="water at 6", status="final"),
            ev(20, "mem.recall", field=None, query="q", hits=[{"key": "d1"}]),
            ev(21, "row.delete", field="diary", row="d1"),
            ev(22, "run.done", usage={}),
        ]
        it.accept(DEV, sent)
        hosts = [obj for leaf, obj in sink.sent if leaf == "evt"]
        assert [e["i"] for e in hosts] == list(range(1, 23))
        shown = {e["i"]: e["d"] for e in hosts}
        blanked_calls = (2, 6, 8, 10)
        for i in blanked_calls:
            assert shown[i]["input"] == "{}" and shown[i]["name"] == sent[i - 1]["d"]["name"]
            assert shown[i + 1]["output"] == "" and shown[i + 1]["call"] == sent[i]["d"]["call"]
        for i in (14, 16, 18, 20, 21):
            assert shown[i] == {"redacted": True}, i
        for i in (1, 4, 5, 12, 13, 15, 17, 19, 22):
            assert shown[i] == sent[i - 1]["d"], i
        assert it.counts["redacted.tool.call"] == 4  # type: ignore[attr-defined]
        assert it.counts["redacted.tool.result"] == 4  # type: ignore[attr-defined]
        # What a replay and the log give is what hosts got.
        assert it.events("dev1", "r1") == hosts
        logged = [msgpack.unpackb(e.payload, raw=False) for e in log.events("acme", "dev1", "r1")]
        assert logged == hosts
        assert b"secret" not in b"".join(e.payload for e in log.events("acme", "dev1", "r1"))


def test_a_device_without_a_hello_shows_no_memory_data_until_it_declares_some() -> None:
    sink = Sink()
    it = intake(sink)
    args = {"field": "notes", "key": "n1", "value": "milk"}
    it.accept(DEV, [ev(1, "run.started", req="q1"), call(2, "c1", "memory.remember", args),
                    ev(3, "row", field="notes", row="n1", status="building")])  # fmt: skip
    it.handle_hello(DEV, msgpack.packb({"agent": "thermostat", "fields": FIELDS}))
    it.accept(DEV, [call(4, "c2", "memory.remember", args),
                    ev(5, "row", field="notes", row="n1", status="building")])  # fmt: skip
    shown = {obj["i"]: obj["d"] for leaf, obj in sink.sent if leaf == "evt"}
    assert shown[2]["input"] == "{}" and shown[3] == {"redacted": True}
    assert json.loads(shown[4]["input"]) == args and shown[5]["field"] == "notes"


def test_malformed_declarations_declare_nothing_public() -> None:
    for junk in (None, "notes", [1, None, {"vis": "public"}, {"name": 3, "vis": "public"}],
                 [{"name": "notes", "vis": "PUBLIC"}]):  # fmt: skip
        assert not declared(junk).public
    # Core memory is never public, whatever its vis says.
    assert "persona" not in declared(FIELDS).public
    r = Redactor()
    r.declare("dev1", [{"name": "notes", "vis": "public", "kind": "collection"}])
    # Declared public but not streamed: its rows are not a table hosts are shown.
    row = ev(1, "row", field="notes", row="n1", status="final", value="milk")
    assert r.redact("dev1", row) == {**row, "d": {"redacted": True}}
    assert r.redact("dev1", ev(2, "msg.delta")) is None
