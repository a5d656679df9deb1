"""PgKnowledgeStore (server_bridge/pgstore/knowledge.py) where a database differs from a
file: two bridges, each with its own KnowledgeBase (its own pool, lock and vector
cache), on one database. What both stores share is tested on both by
test_knowledge.py (its `[pg]` ids); the database here is its module's, emptied before
each test, and the tests skip, saying why, on a machine without PostgreSQL.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from server_bridge.knowledge import (
    MAX_QUERY_CHARS,
    InvalidK,
    InvalidName,
    InvalidOption,
    KnowledgeBase,
    NotFound,
    QueryTooLarge,
    Record,
    Records,
)
from server_bridge.pgstore.knowledge import PgKnowledgeStore, match_terms
from tests.kbfiles import HashEmbedder
from tests.test_knowledge import empty_knowledge_db, knowledge_db

__all__ = ["knowledge_db"]  # a fixture of this module too (pytest finds it by name)

MODES = ("keyword", "dense", "hybrid")


def doc(source: str, text: str) -> Records:
    return Records([Record(source, text, ".md")])


@pytest.fixture
def bridges(knowledge_db: str) -> Iterator[tuple[KnowledgeBase, KnowledgeBase]]:
    """Two knowledge bases on one database, as two bridge processes have."""
    empty_knowledge_db(knowledge_db)
    a = KnowledgeBase(PgKnowledgeStore(knowledge_db), embedder=HashEmbedder())
    b = KnowledgeBase(PgKnowledgeStore(knowledge_db), embedder=HashEmbedder())
    yield a, b
    a.close()
    b.close()


def test_a_source_ingested_through_one_bridge_is_found_through_the_other(
    bridges: tuple[KnowledgeBase, KnowledgeBase],
) -> None:
    a, b = bridges
    assert a.path is None  # a database, not a file
    # b's vector cache is built (empty) before a writes: a's write must make it stale.
    assert b.retrieve("acme", "pump primes", mode="dense").hits == []
    text = "# Pump\n\nThe pump primes in thirty seconds.\n\n# Vents\n\nVents open at 28 C."
    s = a.ingest(doc("manual.md", text), tenant="acme", collection="m", tags=["v1"])
    assert s.count("new") == 1
    for mode in MODES:
        top = b.retrieve("acme", "how long does the pump prime", mode=mode, k=1).hits[0]
        assert (top.collection, top.source, top.headings, top.tags) == (
            "m", "manual.md", ("Pump",), ("v1",)
        )
        assert top.version == hashlib.sha256(text.encode()).hexdigest()
    assert [c.name for c in b.collections("acme")] == ["m"]
    row, chunks = b.show("acme", "m", "manual.md")
    assert row.chunks == len(chunks) == 2
    # Unchanged for the other bridge too: it reads the version a stored.
    assert b.ingest(doc("manual.md", text), tenant="acme", collection="m",
                    tags=["v1"]).count("unchanged") == 1


def test_text_and_ids_postgresql_cannot_hold_as_such_come_back_as_they_went_in(
    bridges: tuple[KnowledgeBase, KnowledgeBase],
) -> None:
    # `%` is the escape character of what PostgreSQL text cannot hold (NUL, lone
    # surrogates): a literal one, and something that looks like an escape, survive.
    a, b = bridges
    source = "notes/50%25 of 100%.md"
    text = "Dosing: 50% of the tank, %00 is not a NUL and %u0041 is not an A."
    a.ingest(doc(source, text), tenant="t", collection="c")
    [hit] = b.retrieve("t", "dosing tank", mode="keyword", sources=[source]).hits
    assert (hit.source, hit.text) == (source, text)
    assert [r.source for r in b.sources("t", "c")] == [source]
    assert b.delete_source("t", "c", source) == 1


@pytest.mark.parametrize("mode", ["keyword", "dense", "hybrid"])
def test_an_update_through_one_bridge_is_seen_whole_or_not_at_all_by_the_other(
    bridges: tuple[KnowledgeBase, KnowledgeBase], mode: str
) -> None:
    """The other bridge retrieves in a loop while one re-ingests a source between
    version A (6 chunks) and B (3): every answer is all of A or all of B, never a mix,
    never nothing, and both are seen."""
    writer, reader = bridges
    versions = {
        "A": "\n\n".join(f"# A{i}\n\ncommon alpha part {i}" for i in range(6)),
        "B": "\n\n".join(f"# B{i}\n\ncommon beta part {i}" for i in range(3)),
    }
    expected = {
        hashlib.sha256(text.encode()).hexdigest(): n
        for text, n in zip(versions.values(), (6, 3), strict=True)
    }
    writer.ingest(doc("doc.md", versions["A"]), tenant="t", collection="c")
    stop = threading.Event()
    seen: dict[str, int] = {}
    bad: list[str] = []

    def read() -> None:
        while not stop.is_set():
            hits = reader.retrieve("t", "common part", mode=mode, k=100).hits  # type: ignore[arg-type]
            got = {h.version for h in hits}
            if len(got) != 1 or len(hits) != expected[next(iter(got))]:
                bad.append(f"{len(hits)} hits of versions {sorted(v[:8] for v in got)}")
            else:
                v = got.pop()
                seen[v] = seen.get(v, 0) + 1

    t = threading.Thread(target=read)
    t.start()
    try:
        # Until the reader has read 40 times (a write here, without fsync, takes a
        # few ms, and the reader shares the GIL), at most 1,000 updates.
        for n in range(1000):
            text = versions["B" if n % 2 == 0 else "A"]
            s = writer.ingest(doc("doc.md", text), tenant="t", collection="c")
            assert s.count("changed") == 1
            if n % 2 and sum(seen.values()) + len(bad) >= 40:
                break
    finally:
        stop.set()
        t.join()
    assert not bad, bad[:5]
    assert len(seen) == 2 and sum(seen.values()) >= 20, seen


def test_a_delete_through_one_bridge_is_gone_from_both_and_stays_gone(
    bridges: tuple[KnowledgeBase, KnowledgeBase], knowledge_db: str
) -> None:
    a, b = bridges
    a.ingest(doc("pump.md", "The pump primes in thirty seconds."), tenant="acme",
             collection="m")
    a.ingest(doc("vents.md", "The vents open at noon."), tenant="acme", collection="m")
    a.ingest(doc("hose.md", "Check the hose for leaks."), tenant="acme", collection="other")
    for kb in bridges:  # both vector caches hold every chunk
        assert len(kb.retrieve("acme", "pump vents hose", mode="dense", k=10).hits) == 3
    assert b.delete_source("acme", "m", "pump.md") == 1
    assert a.delete_collection("acme", "other") == 1
    for kb in bridges:
        for mode in MODES:
            hits = kb.retrieve("acme", "pump primes hose leaks vents", mode=mode, k=10).hits  # type: ignore[arg-type]
            assert [h.source for h in hits] == ["vents.md"], (mode, hits)
        assert [c.name for c in kb.collections("acme")] == ["m"]
        with pytest.raises(NotFound):
            kb.delete_source("acme", "m", "pump.md")
        with pytest.raises(NotFound):
            kb.delete_collection("acme", "other")
    # Gone from the database, not only from the answers: a third bridge opened now,
    # and the rows themselves.
    with KnowledgeBase(PgKnowledgeStore(knowledge_db), embedder=HashEmbedder()) as c:
        assert [r.source for r in c.sources("acme")] == ["vents.md"]
    with psycopg.connect(knowledge_db) as conn:
        left = conn.execute(
            "SELECT (SELECT count(*) FROM wren_kb_chunks), (SELECT count(*) FROM wren_kb_sources),"
            " (SELECT count(DISTINCT chunk_id) FROM wren_kb_terms),"
            " (SELECT chunks FROM wren_kb_meta)"
        ).fetchone()
    assert left == (1, 1, 1, 1)


def test_two_bridges_writing_at_once_both_land_and_the_statistics_add_up(
    bridges: tuple[KnowledgeBase, KnowledgeBase], knowledge_db: str
) -> None:
    # Writers take turns on the meta row: each bridge's 20 ingests and 10 deletes land,
    # none lost, and BM25's N and total length equal the rows'.
    errors: list[BaseException] = []

    def work(kb: KnowledgeBase, who: str) -> None:
        try:
            for i in range(20):
                kb.ingest(doc(f"{who}{i}.md", f"Valve {who} {i} opens at dawn. " * (i + 1)),
                          tenant="t", collection="c")
            for i in range(0, 20, 2):
                kb.delete_source("t", "c", f"{who}{i}.md")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(kb, who))
               for kb, who in zip(bridges, ("a", "b"), strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    for kb in bridges:
        assert len(kb.sources("t", "c")) == 20
        assert len(kb.retrieve("t", "valve opens at dawn", mode="keyword", k=100).hits) == 20
    with psycopg.connect(knowledge_db) as conn:
        meta, rows = conn.execute(
            "SELECT (SELECT (chunks, terms)::text FROM wren_kb_meta),"
            " (SELECT (count(*), coalesce(sum(dl), 0))::text FROM wren_kb_chunks)"
        ).fetchone()
    assert meta == rows


def test_bad_input_is_refused_by_name_on_either_bridge(
    bridges: tuple[KnowledgeBase, KnowledgeBase],
) -> None:
    for kb in bridges:
        with pytest.raises(InvalidK, match="outside 1..100"):
            kb.retrieve("t", "anything", k=101)
        with pytest.raises(QueryTooLarge, match="refused, not cut"):
            kb.retrieve("t", "word " * MAX_QUERY_CHARS)
        with pytest.raises(InvalidName):
            kb.retrieve("../etc", "q")
        with pytest.raises(InvalidName):
            kb.ingest(doc("a.md", "text"), tenant="t", collection="no/slash")
        with pytest.raises(InvalidName):
            kb.ingest(doc("a.md", "text"), tenant="t", collection="c", tags=["bad tag"])
        with pytest.raises(InvalidOption):
            kb.retrieve("t", "q", mode="fuzzy")  # type: ignore[arg-type]
        with pytest.raises(InvalidOption):
            kb.retrieve("t", "q", max_chars=0)
        with pytest.raises(NotFound):
            kb.delete_collection("t", "nothing")
        failed = kb.ingest(doc("empty.md", "   "), tenant="t", collection="c")
        assert [f.reason for f in failed.failed] == ["empty file"]
        assert kb.sources("t") == []


def test_match_terms_reads_back_what_the_service_writes() -> None:
    assert match_terms('"pump" OR "prime" OR "pump"') == ["pump", "prime"]
    assert match_terms('"a""b"') == ['a"b']
    assert match_terms("") == []


def test_a_store_outside_a_transaction_says_so(knowledge_db: str) -> None:
    from server_bridge.knowledge.errors import KnowledgeError

    store: Any = PgKnowledgeStore(knowledge_db)
    try:
        with pytest.raises(KnowledgeError, match="outside a transaction"):
            store.generation()
        with store.transaction(), pytest.raises(KnowledgeError, match="already open"):
            with store.transaction():
                pass
    finally:
        store.close()
