"""The knowledge methods through a real Mosquitto and the real bridge: board peers call
kb.retrieve, kb.add and kb.delete on P/d/D/rpc, and who may do what comes from the
registry (the device's tenant, its agent's `kb:<collection>` grants) alone."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from server_bridge.knowledge import KnowledgeBase, Record
from server_bridge.knowledge.calls import MAX_TEXT_BYTES, DeviceBudget
from server_bridge.memory.grants import READ, WRITE, Grants
from server_bridge.models.scripted import ScriptedProvider
from server_bridge.registry import Registry, RegistryError
from tests.test_bridge import SECRET, Peer, World, wait_for
from tests.test_memory_rpc import kind, ok
from tools.broker import MosquittoProcess

_ids = itertools.count(1)


class One:
    """A connector of one document in hand."""

    def __init__(self, record: Record) -> None:
        self.record = record

    def items(self) -> Iterator[Record]:
        yield self.record


def hello(agent: str, payload: int = 4096) -> dict[str, Any]:
    return {
        "agent": agent, "ver": "0.1.0", "fw": "test", "boot": "b0000001", "fields": [],
        "tools": [], "limits": {"payload": payload, "str": payload, "window": 4, "chunk": 256},
    }  # fmt: skip


class KnowledgeWorld(World):
    """dev1 (acme, thermostat) on the World's board peer; dev3 (acme, thermostat) and
    dev2 (globex, kiosk) on peers of their own; a BM25-only store the test also reads."""

    def __init__(self, broker: MosquittoProcess, tmp: Path, payload: int = 4096) -> None:
        self.broker = broker
        self.kb = KnowledgeBase(tmp / "knowledge.sqlite3", embedder=None)
        super().__init__(broker, tmp, ScriptedProvider(), knowledge=self.kb)
        self.registry.add_device("dev3", "acme", "thermostat")
        # Added after the bridge started: read once the bridge has seen the registry
        # again, as a board registered and then booted is (links.py).
        wait_for(lambda: self.bridge.reads_device("dev3"), "the bridge to read dev3")
        self.peers = {"dev1": self.board}
        for dev in ("dev2", "dev3"):
            self.peers[dev] = Peer(broker, [self.d("rpc/res", dev)])
        for dev, agent in (("dev1", "thermostat"), ("dev2", "kiosk"), ("dev3", "thermostat")):
            self.peers[dev].send(self.d("hello", dev), hello(agent, payload))
            wait_for(lambda dev=dev: self.bridge.hello(dev) is not None, f"{dev}'s hello")

    def rpc(self, method: str, args: dict[str, Any], device: str = "dev1") -> dict[str, Any]:
        """One call and its final answer, as the board reads it."""
        c = next(_ids)
        peer = self.peers[device]
        peer.send(self.d("rpc", device), {"c": c, "m": method, "a": args, "r": "b0000001.1"})
        final = peer.get(self.d("rpc/res", device))
        assert "ch" not in final and final["c"] == c
        return dict(final)

    def close(self) -> None:
        for dev in ("dev2", "dev3"):
            self.peers[dev].close()
        super().close()
        self.kb.close()


@pytest.fixture
def kw(broker: MosquittoProcess, tmp_path: Path) -> Iterator[KnowledgeWorld]:
    w = KnowledgeWorld(broker, tmp_path)
    yield w
    w.close()


MANUAL = (
    "# Kiosk\n\n## Reset\n\nHold the power button for ten seconds to restart the kiosk.\n\n"
    "## Paper\n\nOpen the front flap and load the receipt roll with the shiny side down.\n"
)


def test_retrieve_needs_a_read_grant_and_answers_with_provenance(kw: KnowledgeWorld) -> None:
    kw.kb.ingest(One(Record("kiosk.md", MANUAL, ".md")), tenant="acme", collection="manuals")
    query = {"query": "how do I restart the kiosk", "k": 3, "collections": ["manuals"]}
    assert kind(kw.rpc("kb.retrieve", query)) == "forbidden"
    # Neither the tenant-field `*` grant nor another collection's grant reaches it.
    kw.registry.add_grant("acme", "thermostat")
    assert kind(kw.rpc("kb.retrieve", {"query": "restart"})) == "forbidden"  # no collection
    kw.registry.add_grant("acme", "thermostat", "kb:other", WRITE)
    assert kind(kw.rpc("kb.retrieve", query)) == "forbidden"
    assert kw.bridge.stats["kb.forbidden"] == 3
    kw.registry.add_grant("acme", "thermostat", "kb:manuals", READ)
    got = ok(kw.rpc("kb.retrieve", query))
    assert got["mode"] == "keyword"  # no embedder in this store: BM25, and said so
    top = got["hits"][0]
    assert top["collection"] == "manuals" and top["source"] == "kiosk.md"
    assert top["headings"] == ["Kiosk", "Reset"] and "ten seconds" in top["text"]
    assert len(top["version"]) == 64 and top["chunk"] >= 0 and top["score"] > 0
    # Without `collections`: every collection the agent may read.
    assert ok(kw.rpc("kb.retrieve", {"query": "receipt roll"}))["hits"][0]["source"] == "kiosk.md"
    # A read grant is not a write grant.
    put = {"collection": "manuals", "src": "n1", "text": "a note"}
    assert kind(kw.rpc("kb.add", put)) == "forbidden"


def test_ingest_then_retrieve_and_delete_only_its_own(kw: KnowledgeWorld) -> None:
    kw.registry.add_grant("acme", "thermostat", "kb:notes", WRITE)
    text = "Greenhouse log: the north vent stuck half open at 14:00; humidity 81 percent."
    got = ok(kw.rpc("kb.add", {"collection": "notes", "src": "log-1", "text": text,
                                  "tags": ["log"]}))  # fmt: skip
    assert got["src"] == "dev1/log-1" and got["status"] == "new" and got["chunks"] == 1
    assert len(got["ver"]) == 64
    again = ok(kw.rpc("kb.add", {"collection": "notes", "src": "log-1", "text": text,
                                    "tags": ["log"]}))  # fmt: skip
    assert again["status"] == "unchanged" and again["ver"] == got["ver"]
    hits = ok(kw.rpc("kb.retrieve", {"query": "vent stuck", "collections": ["notes"]}))["hits"]
    assert [h["source"] for h in hits] == ["dev1/log-1"] and hits[0]["version"] == got["ver"]
    # The device is a tag: a board can keep to its own text.
    mine = {"query": "vent", "collections": ["notes"], "tags": ["dev:dev1"]}
    assert len(ok(kw.rpc("kb.retrieve", mine))["hits"]) == 1
    # dev3, same tenant and agent (so the same grant), reaches only its own namespace.
    for src in ("log-1", "dev1/log-1"):
        assert kind(kw.rpc("kb.delete", {"collection": "notes", "src": src}, "dev3")) == "not_found"
    assert kind(kw.rpc("kb.add", {"collection": "notes", "src": "../dev1/log-1",
                                     "text": "x"}, "dev3")) == "bad_envelope"  # fmt: skip
    over = ok(kw.rpc("kb.add", {"collection": "notes", "src": "log-1", "text": "dev3's"},
                     "dev3"))  # fmt: skip
    assert over["src"] == "dev3/log-1"
    assert {s.source for s in kw.kb.sources("acme", "notes")} == {"dev1/log-1", "dev3/log-1"}
    assert ok(kw.rpc("kb.delete", {"collection": "notes", "src": "log-1"})) == {
        "src": "dev1/log-1", "chunks": 1}  # fmt: skip
    gone = ok(kw.rpc("kb.retrieve", {"query": "vent stuck", "collections": ["notes"]}))
    assert gone["hits"] == []
    assert kind(kw.rpc("kb.delete", {"collection": "notes", "src": "log-1"})) == "not_found"


def test_another_tenants_collection_is_invisible_and_args_name_no_tenant(
    kw: KnowledgeWorld,
) -> None:
    kw.kb.ingest(One(Record("kiosk.md", MANUAL, ".md")), tenant="acme", collection="manuals")
    kw.registry.add_grant("acme", "thermostat", "kb:manuals", WRITE)
    # globex's kiosk agent holds a grant of a collection of the same name, in globex.
    kw.registry.add_grant("globex", "kiosk", "kb:manuals", WRITE)
    query = {"query": "restart the kiosk power button", "collections": ["manuals"]}
    assert ok(kw.rpc("kb.retrieve", query, "dev2"))["hits"] == []
    forged = {**query, "tenant": "acme", "device": "dev1", "agent": "thermostat"}
    assert ok(kw.rpc("kb.retrieve", forged, "dev2"))["hits"] == []
    assert kind(kw.rpc("kb.delete", {"collection": "manuals", "src": "kiosk.md",
                                     "tenant": "acme"}, "dev2")) == "not_found"  # fmt: skip
    # A `tenant` key in dev1's arguments changes nothing either: its ingest is acme's.
    put = {"collection": "manuals", "src": "n1", "text": "the spare key is under the mat",
           "tenant": "globex"}  # fmt: skip
    ok(kw.rpc("kb.add", put))
    assert [s.source for s in kw.kb.sources("globex")] == []
    assert "dev1/n1" in {s.source for s in kw.kb.sources("acme", "manuals")}
    assert ok(kw.rpc("kb.retrieve", {"query": "spare key mat", "collections": ["manuals"]},
                     "dev2"))["hits"] == []  # fmt: skip
    plain = ok(kw.rpc("kb.retrieve", query))
    assert ok(kw.rpc("kb.retrieve", {**query, "tenant": "globex"})) == plain
    assert plain["hits"][0]["source"] == "kiosk.md"


def test_text_over_the_limit_is_refused_by_name_and_nothing_is_written(kw: KnowledgeWorld) -> None:
    kw.registry.add_grant("acme", "thermostat", "kb:notes", WRITE)
    # dev1's hello says 4,096 bytes: its own payload bounds a call's text below 8 KiB.
    limit = min(MAX_TEXT_BYTES, 4096)
    at = ok(kw.rpc("kb.add", {"collection": "notes", "src": "at", "text": "w " * (limit // 2)}))
    assert at["status"] == "new"
    over = kw.rpc("kb.add", {"collection": "notes", "src": "over", "text": "w" * (limit + 1)})
    assert kind(over) == "too_large" and "at most 4,096" in over["err"]["msg"]
    assert [s.source for s in kw.kb.sources("acme", "notes")] == ["dev1/at"]
    for bad in (
        {"collection": "notes", "src": "x"},
        {"collection": "no/pe", "src": "x", "text": "y"},
        {"collection": "notes", "src": "x", "text": "y", "kind": "pdf"},
    ):
        assert kind(kw.rpc("kb.add", bad)) == "bad_envelope", bad
    assert kind(kw.rpc("kb.retrieve", {"query": "w", "collections": ["notes"], "k": 0})) == (
        "bad_envelope")  # fmt: skip


def test_a_flood_of_ingests_is_rate_limited_and_what_was_accepted_is_kept(
    kw: KnowledgeWorld,
) -> None:
    kw.registry.add_grant("acme", "thermostat", "kb:notes", WRITE)
    accepted, refused = [], 0
    for n in range(60):
        text = f"reading {n}: soil moisture {n % 40} percent " + "x" * 2000
        got = kw.rpc("kb.add", {"collection": "notes", "src": f"r{n}", "text": text})
        if "ok" in got:
            accepted.append(got["ok"])
        else:
            assert kind(got) == "rate_limited" and got["err"]["retry_after_s"] > 0
            refused += 1
    # 64 KiB of burst at ~2 KiB a call, a little refill meanwhile: 30-odd pass, not 60.
    assert 20 <= len(accepted) < 60 and refused == 60 - len(accepted)
    assert kw.bridge.stats["kb.rate_limited"] == refused
    stored = {s.source: s.version for s in kw.kb.sources("acme", "notes")}
    assert stored == {a["src"]: a["ver"] for a in accepted}
    # Another device's budget is its own.
    ok(kw.rpc("kb.add", {"collection": "notes", "src": "r0", "text": "fine"}, "dev3"))


def test_device_budget_refills_and_counts_calls_and_bytes() -> None:
    now = [0.0]
    b = DeviceBudget(calls_burst=2, calls_per_s=1, bytes_burst=100, bytes_per_s=10,
                     clock=lambda: now[0])  # fmt: skip
    assert b.take("d", 60) == 0.0
    assert b.take("d", 60) == pytest.approx(2.0)  # 40 left, 20 short at 10/s
    assert b.take("d", 10) == 0.0
    assert b.take("d") == pytest.approx(1.0)  # no calls left
    assert b.take("e") == 0.0
    now[0] = 1.0
    assert b.take("d") == 0.0


def test_an_answer_fits_the_boards_payload(broker: MosquittoProcess, tmp_path: Path) -> None:
    w = KnowledgeWorld(broker, tmp_path, payload=2048)
    try:
        w.registry.add_grant("acme", "thermostat", "kb:manuals", READ)
        for n in range(6):
            body = f"Pump {n} maintenance. " + "Check the seal and the impeller. " * 60
            w.kb.ingest(One(Record(f"pump{n}.md", f"# Pump {n}\n\n{body}", ".md")),
                        tenant="acme", collection="manuals")  # fmt: skip
        c = next(_ids)
        w.board.send(w.d("rpc"), {"c": c, "m": "kb.retrieve", "r": "b0000001.1", "a": {
            "query": "pump seal impeller maintenance", "k": 6, "max_chars": 8000}})  # fmt: skip
        final = w.board.get(w.d("rpc/res"))
        got = ok(final)
        assert len(msgpack.packb(final, use_bin_type=True)) <= 2048
        assert got["cut"] is True and got["hits"] and got["hits"][-1]["truncated"] is True
        assert all(h["source"].startswith("pump") for h in got["hits"])
    finally:
        w.close()


def test_knowledge_grant_fields(tmp_path: Path) -> None:
    with Registry(tmp_path / "registry.json") as reg:
        reg.add_tenant("acme", SECRET)
        assert reg.add_grant("acme", "a", "kb:Manuals.v2", READ).field == "kb:Manuals.v2"
        for bad in ("kb:", "kb:-x", "kb:a/b", "kb:" + "x" * 65, "KB:x", "kb:*"):
            with pytest.raises(RegistryError):
                reg.add_grant("acme", "a", bad, READ)
        g = reg.grants_of("acme", "a")
        assert g.knowledge("Manuals.v2") == READ and g.knowledge("other") is None
    everything = Grants({"*": WRITE, "kb:w": WRITE, "kb:r": READ})
    assert everything.knowledge("x") is None
    assert everything.knowledge_collections() == ["r", "w"]
    assert everything.knowledge_collections(WRITE) == ["w"]


def test_the_bridge_serves_knowledge_only_with_a_store(tmp_path: Path) -> None:
    from server_bridge.service import build_parser, knowledge_base

    reg = tmp_path / "wren" / "registry.json"
    args = build_parser().parse_args(["--registry", str(reg)])
    assert knowledge_base(args) is None  # no store beside the registry: no kb.* methods
    beside = reg.parent / "knowledge.sqlite3"
    KnowledgeBase(beside, embedder=None).close()  # as `wren kb ingest` leaves it
    with knowledge_base(args) as kb:  # type: ignore[union-attr]
        assert kb.path == beside
    other = tmp_path / "elsewhere.sqlite3"
    args = build_parser().parse_args(["--registry", str(reg), "--knowledge", str(other)])
    with knowledge_base(args) as kb:  # type: ignore[union-attr]
        assert kb.path == other
