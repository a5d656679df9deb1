"""The chunks, their vectors and their keyword index, in one SQLite file.

Why SQLite (the standard library's sqlite3) and not TinyDB or a file of our own:
- Atomic replacement of a source comes free: its old chunks out and its new ones in,
  the FTS rows and the version with them, in one transaction. In WAL mode a reader's
  transaction is a snapshot, so a search during an update sees the old version or the
  new, whichever committed before it began, never a mix and never neither; across
  processes too (a `wren kb ingest` while a bridge serves).
- Keyword ranking is FTS5's `bm25()`, in C, over an inverted index that SQLite keeps
  current row by row: no index to rebuild after a write.
- It writes pages, not files: TinyDB rewrites its whole JSON file on every write,
  which at 100k chunks of 1 kB is 100 MB per change.
- A delete is durable when its transaction returns (synchronous=FULL), so a restart
  does not bring a deleted source back.
Measured in benchmarks/bench_knowledge.py (ingest chunks/s, retrieve p50/p99).

FTS5 indexes not the text but its BM25 terms as recall.analyze makes them (lower-cased
words, Lucene's English stop words less no/not, Snowball stems): keyword search here
and in memory recall read a text the same way, and the query is analysed likewise.
FTS5's bm25 uses k1 1.2 and b 0.75. Its statistics (N, average length, df) are over
the whole file, all tenants, so a chunk's score depends a little on other tenants'
text, though never whether it is returned: every query is restricted to the caller's
sources in SQL.

This module holds no lock and begins no transaction of its own: the service runs each
method inside `transaction()` under its lock, and decides what one transaction holds.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import KnowledgeError

__all__ = ["ChunkRow", "HitRow", "SourceRow", "Store"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('schema', 1), ('generation', 0);
CREATE TABLE IF NOT EXISTS collections (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    tenant TEXT NOT NULL,
    name TEXT NOT NULL,
    created REAL NOT NULL,
    UNIQUE (tenant, name)
);
CREATE TABLE IF NOT EXISTS sources (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    collection_id INTEGER NOT NULL REFERENCES collections (id) ON DELETE CASCADE,
    source TEXT NOT NULL,
    version TEXT NOT NULL,
    recipe TEXT NOT NULL,
    embedder TEXT,
    tags TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    chunks INTEGER NOT NULL,
    ingested REAL NOT NULL,
    UNIQUE (collection_id, source)
);
CREATE TABLE IF NOT EXISTS source_tags (
    source_id INTEGER NOT NULL REFERENCES sources (id) ON DELETE CASCADE,
    tag TEXT NOT NULL,
    PRIMARY KEY (tag, source_id)
);
CREATE INDEX IF NOT EXISTS source_tags_source ON source_tags (source_id);
-- AUTOINCREMENT: a chunk id is never reused, so a cached vector keyed by it can
-- never be taken for another chunk's.
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    source_id INTEGER NOT NULL REFERENCES sources (id) ON DELETE CASCADE,
    idx INTEGER NOT NULL,
    headings TEXT NOT NULL,
    text TEXT NOT NULL,
    vec BLOB
);
CREATE INDEX IF NOT EXISTS chunks_source ON chunks (source_id);
CREATE VIRTUAL TABLE IF NOT EXISTS chunks_fts USING fts5 (terms, tokenize = 'unicode61');
"""


@dataclass(frozen=True)
class SourceRow:
    id: int
    collection: str
    source: str
    version: str
    recipe: str
    embedder: str | None
    tags: tuple[str, ...]
    bytes: int
    chunks: int
    ingested: float


@dataclass(frozen=True)
class ChunkRow:
    """A chunk to write: `terms` is its analysed text for FTS5, `vec` float32 bytes."""

    index: int
    headings: tuple[str, ...]
    text: str
    terms: str
    vec: bytes | None


@dataclass(frozen=True)
class HitRow:
    chunk_id: int
    collection: str
    source: str
    version: str
    index: int
    headings: tuple[str, ...]
    text: str
    tags: tuple[str, ...]


class Store:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit mode: transactions are begun and ended explicitly below. The
        # service serialises use of this connection with its lock.
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.execute("PRAGMA synchronous = FULL")
        self.db.execute("PRAGMA foreign_keys = ON")
        # Another process's write transaction (a CLI ingest) holds the write lock for
        # one batch at a time: wait for it rather than fail.
        self.db.execute("PRAGMA busy_timeout = 30000")
        # executescript commits what is pending and runs each statement on its own;
        # every statement is idempotent, so two processes opening a new file both
        # end with the same schema.
        try:
            self.db.executescript(_SCHEMA)
        except sqlite3.OperationalError as e:
            self.db.close()
            if "fts5" in str(e):
                raise KnowledgeError(
                    f"this Python's SQLite ({sqlite3.sqlite_version}) has no FTS5, which "
                    "keyword search needs"
                ) from e
            raise

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def transaction(self, write: bool = False) -> Iterator[None]:
        # IMMEDIATE takes the write lock at once, so a write never fails half-way on
        # another writer; a read's snapshot starts with its first SELECT.
        self.db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # --- reads ---------------------------------------------------------------------

    def generation(self) -> int:
        """Bumped by every write transaction: a cache at this number is current."""
        row = self.db.execute("SELECT value FROM meta WHERE key = 'generation'").fetchone()
        return int(row[0])

    def collection_id(self, tenant: str, name: str) -> int | None:
        row = self.db.execute(
            "SELECT id FROM collections WHERE tenant = ? AND name = ?", (tenant, name)
        ).fetchone()
        return None if row is None else int(row[0])

    def source(self, collection_id: int, source: str) -> SourceRow | None:
        rows = self._sources("s.collection_id = ? AND s.source = ?", (collection_id, source))
        return rows[0] if rows else None

    def sources(self, tenant: str, collection: str | None = None) -> list[SourceRow]:
        if collection is None:
            return self._sources("c.tenant = ?", (tenant,))
        return self._sources("c.tenant = ? AND c.name = ?", (tenant, collection))

    def _sources(self, where: str, params: Sequence[object]) -> list[SourceRow]:
        rows = self.db.execute(
            "SELECT s.id, c.name, s.source, s.version, s.recipe, s.embedder, s.tags, s.bytes,"
            " s.chunks, s.ingested FROM sources s JOIN collections c ON c.id = s.collection_id"
            f" WHERE {where} ORDER BY c.name, s.source",
            params,
        ).fetchall()
        return [SourceRow(r[0], r[1], r[2], r[3], r[4], r[5], tuple(json.loads(r[6])), *r[7:])
                for r in rows]

    def collections(self, tenant: str) -> list[tuple[str, int, int, int]]:
        """(name, sources, chunks, bytes) of each of the tenant's collections."""
        rows = self.db.execute(
            "SELECT c.name, count(s.id), coalesce(sum(s.chunks), 0), coalesce(sum(s.bytes), 0)"
            " FROM collections c LEFT JOIN sources s ON s.collection_id = c.id"
            " WHERE c.tenant = ? GROUP BY c.id ORDER BY c.name",
            (tenant,),
        ).fetchall()
        return [(r[0], int(r[1]), int(r[2]), int(r[3])) for r in rows]

    def allowed_sources(
        self,
        tenant: str,
        collections: Sequence[str] = (),
        sources: Sequence[str] = (),
        tags: Sequence[str] = (),
        since: float | None = None,
    ) -> list[int]:
        """The ids of the sources a search may return: the tenant's always, narrowed by
        collection, source id and tags (a source must carry every tag given), and to
        those whose current version was ingested at `since` (Unix s) or later."""
        sql = ["SELECT s.id FROM sources s JOIN collections c ON c.id = s.collection_id"
               " WHERE c.tenant = ?"]
        params: list[object] = [tenant]
        if collections:
            sql.append(f" AND c.name IN ({','.join('?' * len(collections))})")
            params += collections
        if sources:
            sql.append(f" AND s.source IN ({','.join('?' * len(sources))})")
            params += sources
        if tags:
            sql.append(
                " AND s.id IN (SELECT source_id FROM source_tags WHERE tag IN"
                f" ({','.join('?' * len(tags))}) GROUP BY source_id HAVING count(*) = ?)"
            )
            params += [*tags, len(set(tags))]
        if since is not None:
            sql.append(" AND s.ingested >= ?")
            params.append(since)
        return [int(r[0]) for r in self.db.execute("".join(sql), params)]

    def keyword(self, match: str, allowed: Sequence[int], limit: int) -> list[tuple[int, float]]:
        """The best `limit` chunks of the allowed sources for an FTS5 MATCH expression,
        as (chunk id, BM25 score), best first. FTS5 scores lower-is-better: negated."""
        if not allowed:
            return []
        self.db.execute("CREATE TEMP TABLE IF NOT EXISTS allowed (id INTEGER PRIMARY KEY)")
        self.db.execute("DELETE FROM temp.allowed")
        self.db.executemany("INSERT INTO temp.allowed VALUES (?)", ((i,) for i in allowed))
        rows = self.db.execute(
            "SELECT chunks_fts.rowid, bm25(chunks_fts) FROM chunks_fts"
            " JOIN chunks ON chunks.id = chunks_fts.rowid"
            " WHERE chunks_fts MATCH ? AND chunks.source_id IN (SELECT id FROM temp.allowed)"
            " ORDER BY bm25(chunks_fts), chunks_fts.rowid LIMIT ?",
            (match, limit),
        ).fetchall()
        return [(int(r[0]), -float(r[1])) for r in rows]

    def vectors(self, embedder: str) -> Iterator[tuple[int, int, bytes]]:
        """(chunk id, source id, vector bytes) of every chunk embedded by `embedder`."""
        cur = self.db.execute(
            "SELECT c.id, c.source_id, c.vec FROM chunks c JOIN sources s ON s.id = c.source_id"
            " WHERE s.embedder = ? AND c.vec IS NOT NULL",
            (embedder,),
        )
        for r in cur:
            yield int(r[0]), int(r[1]), bytes(r[2])

    def hits(self, chunk_ids: Sequence[int]) -> dict[int, HitRow]:
        if not chunk_ids:
            return {}
        rows = self.db.execute(
            "SELECT ch.id, c.name, s.source, s.version, ch.idx, ch.headings, ch.text, s.tags"
            " FROM chunks ch JOIN sources s ON s.id = ch.source_id"
            " JOIN collections c ON c.id = s.collection_id"
            f" WHERE ch.id IN ({','.join('?' * len(chunk_ids))})",
            list(chunk_ids),
        ).fetchall()
        return {
            int(r[0]): HitRow(int(r[0]), r[1], r[2], r[3], int(r[4]), tuple(json.loads(r[5])),
                              r[6], tuple(json.loads(r[7])))
            for r in rows
        }

    def source_chunks(self, source_id: int) -> list[HitRow]:
        """A source's chunks as stored, in order."""
        ids = self._chunk_ids("source_id = ? ORDER BY idx", (source_id,))
        got = self.hits(ids)
        return [got[i] for i in ids if i in got]

    def stats(self) -> tuple[int, int]:
        """(sources, chunks) in the whole file."""
        s = self.db.execute("SELECT count(*) FROM sources").fetchone()[0]
        c = self.db.execute("SELECT count(*) FROM chunks").fetchone()[0]
        return int(s), int(c)

    # --- writes (inside transaction(write=True)) -------------------------------------

    def bump(self) -> tuple[int, int]:
        """Count this write transaction: (the generation before, the one after)."""
        old = self.generation()
        self.db.execute("UPDATE meta SET value = ? WHERE key = 'generation'", (old + 1,))
        return old, old + 1

    def ensure_collection(self, tenant: str, name: str, now: float) -> int:
        cid = self.collection_id(tenant, name)
        if cid is not None:
            return cid
        cur = self.db.execute(
            "INSERT INTO collections (tenant, name, created) VALUES (?, ?, ?)", (tenant, name, now)
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    def _chunk_ids(self, where: str, params: Sequence[object]) -> list[int]:
        return [int(r[0]) for r in self.db.execute(f"SELECT id FROM chunks WHERE {where}", params)]

    def _drop_chunks(self, where: str, params: Sequence[object]) -> list[int]:
        ids = self._chunk_ids(where, params)
        self.db.execute(
            f"DELETE FROM chunks_fts WHERE rowid IN (SELECT id FROM chunks WHERE {where})", params
        )
        self.db.execute(f"DELETE FROM chunks WHERE {where}", params)
        return ids

    def replace_source(
        self,
        collection_id: int,
        source: str,
        *,
        version: str,
        recipe: str,
        embedder: str | None,
        tags: Sequence[str],
        size: int,
        chunks: Sequence[ChunkRow],
        now: float,
    ) -> tuple[int, list[int], list[int]]:
        """Write a source's new version in place of its old one:
        (source id, chunk ids removed, chunk ids added in chunk order)."""
        old = self.source(collection_id, source)
        removed: list[int] = []
        if old is None:
            cur = self.db.execute(
                "INSERT INTO sources (collection_id, source, version, recipe, embedder, tags,"
                " bytes, chunks, ingested) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (collection_id, source, version, recipe, embedder, json.dumps(list(tags)),
                 size, len(chunks), now),
            )
            assert cur.lastrowid is not None
            sid = cur.lastrowid
        else:
            sid = old.id
            removed = self._drop_chunks("source_id = ?", (sid,))
            self.db.execute(
                "UPDATE sources SET version = ?, recipe = ?, embedder = ?, bytes = ?, chunks = ?,"
                " ingested = ? WHERE id = ?",
                (version, recipe, embedder, size, len(chunks), now, sid),
            )
        self.set_tags(sid, tags)
        added: list[int] = []
        for c in chunks:
            cur = self.db.execute(
                "INSERT INTO chunks (source_id, idx, headings, text, vec) VALUES (?, ?, ?, ?, ?)",
                (sid, c.index, json.dumps(list(c.headings)), c.text, c.vec),
            )
            assert cur.lastrowid is not None
            added.append(cur.lastrowid)
        self.db.executemany(
            "INSERT INTO chunks_fts (rowid, terms) VALUES (?, ?)",
            zip(added, (c.terms for c in chunks), strict=True),
        )
        return sid, removed, added

    def set_tags(self, source_id: int, tags: Sequence[str]) -> None:
        self.db.execute(
            "UPDATE sources SET tags = ? WHERE id = ?", (json.dumps(list(tags)), source_id)
        )
        self.db.execute("DELETE FROM source_tags WHERE source_id = ?", (source_id,))
        self.db.executemany(
            "INSERT OR IGNORE INTO source_tags VALUES (?, ?)", ((source_id, t) for t in tags)
        )

    def delete_source(self, source_id: int) -> list[int]:
        removed = self._drop_chunks("source_id = ?", (source_id,))
        self.db.execute("DELETE FROM sources WHERE id = ?", (source_id,))
        return removed

    def delete_collection(self, collection_id: int) -> list[int]:
        where = "source_id IN (SELECT id FROM sources WHERE collection_id = ?)"
        removed = self._drop_chunks(where, (collection_id,))
        self.db.execute("DELETE FROM collections WHERE id = ?", (collection_id,))
        return removed
