"""Knowledge on PostgreSQL: `PgKnowledgeStore`, the knowledge store several bridges share.

It has the interface of the SQLite store (server_bridge/knowledge/store.py, `Store`),
so `KnowledgeBase(PgKnowledgeStore(dsn))` is the same knowledge base on a database
every bridge and every `wren kb ingest` reaches. Tables: migrations/0005_knowledge.sql.

Transactions, and why each isolation level:
- A read (`transaction()`) is REPEATABLE READ, READ ONLY: one snapshot for all its
  statements. A search runs several (the allowed sources, the generation and the
  vectors when its cache is stale, the keyword ranking, the hits' rows); under READ
  COMMITTED each statement takes a new snapshot, so an update committing between the
  ranking and the rows' fetch would hand the search chunk ids that no longer exist
  (neither version) or rows of the new version ranked by the old (a mix). A read-only
  REPEATABLE READ transaction is never refused for a serialization failure: only
  writers are.
- A write (`transaction(write=True)`) is READ COMMITTED and locks the one
  wren_kb_meta row first (`FOR UPDATE`), as SQLite's BEGIN IMMEDIATE takes its write
  lock: writers of every bridge take turns, so the statistics and the generation they
  bump are never lost to a race, and no two writers deadlock (the one lock is always
  taken first). READ COMMITTED because each statement after the lock then sees what
  the writer before it committed; a REPEATABLE READ writer would have taken its
  snapshot before waiting and be refused ("could not serialize access") for updating
  the row the other writer changed. A source's update (its old chunks and postings
  out, the new ones, its version and tags in) is one transaction, so a search sees the
  old version or the new, never a mix, never neither; a delete is durable when it
  returns (synchronous_commit, the server's default).
- `generation()` is the meta row's, read in the search's own snapshot: another
  bridge's write changes it, and the next search here reloads its vector cache from
  that same snapshot (service.py `_current_cache`).

Keyword search is Wren's BM25 computed in SQL over a table of postings (term, chunk,
term count, the chunk's length and source), with FTS5's formula (k1 1.2, b 0.75,
idf log((N - df + 0.5) / (df + 0.5)) floored at 1e-6; N and the average length over
the whole database, df counted in the search's snapshot), over the terms
`recall.analyze` makes, as the SQLite store's FTS5 index holds them. Chosen over
PostgreSQL's full-text search (a tsvector of the same terms at their positions, a GIN
index, ranked by ts_rank_cd or ts_rank) by measurement: `python
benchmarks/bench_knowledge_pg.py` (`--ranks all` for the five rankings; the 212
questions of bench_knowledge_quality.py over its 398 chunks at 1000/150, k 10, MiniLM
for hybrid; PostgreSQL 15, 2 shared cores):

    store / ranking          keyword MRR@10 hit@5 hit@8k   hybrid MRR@10 hit@5 hit@8k
    SQLite FTS5 bm25()               0.538  0.689  0.788          0.617  0.825  0.939
    PostgreSQL, BM25 in SQL          0.541  0.698  0.802          0.622  0.821  0.934
    ts_rank_cd                       0.294  0.434  0.571          0.532  0.788  0.901
    ts_rank_cd, norm 1 (log len)     0.304  0.472  0.623          0.539  0.797  0.901
    ts_rank_cd, norm 2 (length)      0.250  0.377  0.651          0.490  0.745  0.901
    ts_rank                          0.441  0.613  0.717          0.596  0.807  0.901
    ts_rank, norm 1                  0.449  0.608  0.726          0.570  0.802  0.915

BM25 here ranks as FTS5 does (the small differences: FTS5's tokenizer splits a term
such as `value_x` that analyze keeps whole), and every full-text ranking is 0.09 to
0.29 behind it in keyword MRR@10 and behind in hybrid too: ts_rank and ts_rank_cd
weigh a term by its count in the chunk and not by its rarity (no inverse document
frequency), so a question's commonest word counts as much as its rarest. Latency
decided nothing against it: at 10k chunks (bench_knowledge.py's generated corpus, a
query's terms matching about a third of the chunks) the store's keyword search
alone is p50 4.0 ms, p99 11.9 ms, and the same queries through the tsvector's GIN
index ranked by ts_rank_cd 28.8 / 66.1 ms (each matching row's tsvector is read and
ranked); a whole keyword retrieve 5.6 / 14.0 ms against SQLite's 8.5 / 19.9.
The price is paid at ingest: a posting row per distinct term of a chunk (about 64
per 1,000 characters) is written where FTS5 appends to compressed lists, so an
ingest without embedding runs at 1,500 chunks/s against SQLite's 10,500 (fsync on
for both); with the embedder, which makes 20 chunks/s, that is under 2 % of it.

psycopg is imported lazily (connect.py): a bridge without PostgreSQL never loads it.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from server_bridge.knowledge.errors import KnowledgeError
from server_bridge.knowledge.store import ChunkRow, HitRow, SourceRow
from server_bridge.pgstore.connect import store_pool
from server_bridge.pgstore.memory import _dec, _enc

__all__ = ["BM25_B", "BM25_K1", "PgKnowledgeStore"]

#: FTS5's bm25() constants, so a score means what it means on SQLite.
BM25_K1 = 1.2
BM25_B = 0.75
#: The service serialises use of one store under its lock, so a knowledge base needs
#: one connection at a time; the second is for a pool that is replacing a broken one.
POOL_SIZE = 2
#: How long a writer waits for another bridge's write batch before it fails (SQLite's
#: busy_timeout is the same 30 s): a batch is at most 512 chunks, a second or so.
LOCK_TIMEOUT = "30s"
#: Vectors fetched per round trip while a cache loads: 1.5 kB each, so 3 MB at a time.
VECTOR_BATCH = 2000

# jit off: these are short queries, and on a table the planner has no statistics for
# yet its estimates run to billions of rows, past jit_above_cost, and compiling took
# 365 of a 395 ms search of 398 chunks (EXPLAIN ANALYZE; 0.6 ms on SQLite).
_READ = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY; SET LOCAL jit = off"
_WRITE = (
    "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; SET LOCAL jit = off;"
    f" SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"
)
# An FTS5 MATCH expression as the service builds it: quoted terms joined by OR, a quote
# inside a term doubled.
_PHRASE = re.compile(r'"((?:[^"]|"")*)"')

_SOURCE_COLUMNS = (
    "SELECT s.id, c.name, s.source, s.version, s.recipe, s.embedder, s.tags, s.bytes,"
    " s.chunks, s.ingested FROM wren_kb_sources s"
    " JOIN wren_kb_collections c ON c.id = s.collection_id"
)

# BM25 in one statement, driven by the query's terms: their postings are read once
# (the primary key's range per term, its INCLUDE columns: an index-only scan), df
# counted over all of them (every tenant's, as FTS5's statistics are over its whole
# file), then only the allowed sources' are scored. `allowed` is a constant array
# compared by hash (prepare=False keeps it a constant): a plan that starts from the
# allowed sources' postings instead read 640k rows for 5k at 10k chunks (279 ms).
_BM25 = f"""
WITH p AS MATERIALIZED (
    SELECT term, chunk_id, source_id, tf, dl FROM wren_kb_terms
    WHERE term = ANY(%(terms)s::text[])
), w AS MATERIALIZED (
    SELECT d.term, greatest(ln((st.n - d.df + 0.5) / (d.df + 0.5)), 1e-6) AS idf, st.avgdl
    FROM (SELECT term, count(*)::float8 AS df FROM p GROUP BY term) d, (
        SELECT chunks::float8 AS n, greatest(terms, 1)::float8 / greatest(chunks, 1) AS avgdl
        FROM wren_kb_meta WHERE one
    ) st
)
SELECT p.chunk_id,
       sum(w.idf * p.tf * {BM25_K1 + 1}::float8 / (
           p.tf + {BM25_K1}::float8 * ({1 - BM25_B}::float8 + {BM25_B}::float8 * p.dl / w.avgdl)
       )) AS score
FROM p JOIN w ON w.term = p.term
WHERE p.source_id = ANY(%(allowed)s::bigint[])
GROUP BY p.chunk_id
ORDER BY score DESC, p.chunk_id
LIMIT %(limit)s
"""


def match_terms(match: str) -> list[str]:
    """The terms of an FTS5 OR expression as KnowledgeBase.retrieve builds it
    (`"a" OR "b"`): the service's query language, read back into its terms."""
    return list(dict.fromkeys(m.replace('""', '"') for m in _PHRASE.findall(match)))


class PgKnowledgeStore:
    """The knowledge store on PostgreSQL (see above). `dsn_or_pool`: a libpq connection
    string (the store opens a pool of its own, closed by `close()`) or a psycopg_pool
    pool the caller owns. The schema is brought up to date on open.

    Like the SQLite store it holds no lock of its own: one transaction at a time, which
    the service's lock guarantees, and every method inside `transaction()`."""

    #: A database, not a file: KnowledgeBase.path is None.
    path: Path | None = None

    def __init__(self, dsn_or_pool: str | Any, *, pool_size: int = POOL_SIZE) -> None:
        self._pool, self._own_pool = store_pool(dsn_or_pool, max_size=pool_size)
        self._conn: Any = None

    def close(self) -> None:
        if self._own_pool:
            self._pool.close()

    def __enter__(self) -> PgKnowledgeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def transaction(self, write: bool = False) -> Iterator[None]:
        if self._conn is not None:
            raise KnowledgeError("a transaction is already open on this knowledge store")
        with self._pool.connection() as conn, conn.transaction():
            conn.execute(_WRITE if write else _READ)
            if write:
                conn.execute("SELECT 1 FROM wren_kb_meta FOR UPDATE")
            self._conn = conn
            try:
                yield
            finally:
                self._conn = None

    def _db(self) -> Any:
        conn = self._conn
        if conn is None:
            raise KnowledgeError("the knowledge store is used outside a transaction")
        return conn

    def _rows(self, sql: str, params: Sequence[object] | dict[str, object] = ()) -> list[Any]:
        # prepare=False: these queries carry arrays of ids whose length varies, and a
        # generic plan (what a prepared statement turns into) plans them blind.
        return list(self._db().execute(sql, params, prepare=False).fetchall())

    def _exec(self, sql: str, params: Sequence[object] = ()) -> None:
        self._db().execute(sql, params, prepare=False)

    # --- reads ---------------------------------------------------------------------

    def generation(self) -> int:
        """Bumped by every write transaction of any bridge: a cache at this number is
        current in this transaction's snapshot."""
        return int(self._rows("SELECT generation FROM wren_kb_meta")[0][0])

    def collection_id(self, tenant: str, name: str) -> int | None:
        rows = self._rows(
            "SELECT id FROM wren_kb_collections WHERE tenant = %s AND name = %s", (tenant, name)
        )
        return int(rows[0][0]) if rows else None

    def source(self, collection_id: int, source: str) -> SourceRow | None:
        rows = self._sources(
            "s.collection_id = %s AND s.source = %s", (collection_id, _enc(source))
        )
        return rows[0] if rows else None

    def sources(self, tenant: str, collection: str | None = None) -> list[SourceRow]:
        if collection is None:
            return self._sources("c.tenant = %s", (tenant,))
        return self._sources("c.tenant = %s AND c.name = %s", (tenant, collection))

    def _sources(self, where: str, params: Sequence[object]) -> list[SourceRow]:
        rows = self._rows(f"{_SOURCE_COLUMNS} WHERE {where} ORDER BY c.name, s.source", params)
        out = [
            SourceRow(int(r[0]), r[1], _dec(r[2]), r[3], r[4], None if r[5] is None else _dec(r[5]),
                      tuple(json.loads(r[6])), int(r[7]), int(r[8]), float(r[9]))
            for r in rows
        ]
        # By the decoded id, as SQLite orders them (an escaped %25 sorts elsewhere).
        out.sort(key=lambda s: (s.collection, s.source))
        return out

    def collections(self, tenant: str) -> list[tuple[str, int, int, int]]:
        """(name, sources, chunks, bytes) of each of the tenant's collections."""
        rows = self._rows(
            "SELECT c.name, count(s.id), coalesce(sum(s.chunks), 0), coalesce(sum(s.bytes), 0)"
            " FROM wren_kb_collections c LEFT JOIN wren_kb_sources s ON s.collection_id = c.id"
            " WHERE c.tenant = %s GROUP BY c.id, c.name ORDER BY c.name",
            (tenant,),
        )
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
        sql = ["SELECT s.id FROM wren_kb_sources s"
               " JOIN wren_kb_collections c ON c.id = s.collection_id WHERE c.tenant = %s"]
        params: list[object] = [tenant]
        if collections:
            sql.append(" AND c.name = ANY(%s::text[])")
            params.append(list(collections))
        if sources:
            sql.append(" AND s.source = ANY(%s::text[])")
            params.append([_enc(s) for s in sources])
        if tags:
            sql.append(
                " AND s.id IN (SELECT source_id FROM wren_kb_source_tags"
                " WHERE tag = ANY(%s::text[]) GROUP BY source_id HAVING count(*) = %s)"
            )
            params += [list(tags), len(set(tags))]
        if since is not None:
            sql.append(" AND s.ingested >= %s")
            params.append(since)
        return [int(r[0]) for r in self._rows("".join(sql), params)]

    def keyword(self, match: str, allowed: Sequence[int], limit: int) -> list[tuple[int, float]]:
        """The best `limit` chunks of the allowed sources for the terms of an FTS5 OR
        expression (as the service builds it), as (chunk id, BM25 score), best first."""
        terms = match_terms(match)
        if not allowed or not terms:
            return []
        rows = self._rows(_BM25, {"terms": terms, "allowed": list(allowed), "limit": limit})
        return [(int(r[0]), float(r[1])) for r in rows]

    def vectors(self, embedder: str) -> Iterator[tuple[int, int, bytes]]:
        """(chunk id, source id, vector bytes) of every chunk embedded by `embedder`,
        read a batch at a time through a server-side cursor, in binary (no hex text
        to decode: 1.5 kB per chunk, 150 MB at 100k chunks)."""
        with self._db().cursor(name="wren_kb_vectors", binary=True) as cur:
            cur.itersize = VECTOR_BATCH
            cur.execute(
                "SELECT c.id, c.source_id, c.vec FROM wren_kb_chunks c"
                " JOIN wren_kb_sources s ON s.id = c.source_id"
                " WHERE s.embedder = %s AND c.vec IS NOT NULL",
                (_enc(embedder),),
            )
            for r in cur:
                yield int(r[0]), int(r[1]), bytes(r[2])

    def hits(self, chunk_ids: Sequence[int]) -> dict[int, HitRow]:
        if not chunk_ids:
            return {}
        rows = self._rows(
            "SELECT ch.id, c.name, s.source, s.version, ch.idx, ch.headings, ch.text, s.tags"
            " FROM wren_kb_chunks ch JOIN wren_kb_sources s ON s.id = ch.source_id"
            " JOIN wren_kb_collections c ON c.id = s.collection_id"
            " WHERE ch.id = ANY(%s::bigint[])",
            (list(chunk_ids),),
        )
        return {
            int(r[0]): HitRow(int(r[0]), r[1], _dec(r[2]), r[3], int(r[4]),
                              tuple(json.loads(r[5])), _dec(r[6]), tuple(json.loads(r[7])))
            for r in rows
        }

    def source_chunks(self, source_id: int) -> list[HitRow]:
        """A source's chunks as stored, in order."""
        ids = [int(r[0]) for r in self._rows(
            "SELECT id FROM wren_kb_chunks WHERE source_id = %s ORDER BY idx", (source_id,)
        )]
        got = self.hits(ids)
        return [got[i] for i in ids if i in got]

    def stats(self) -> tuple[int, int]:
        """(sources, chunks) in the whole database."""
        row = self._rows(
            "SELECT (SELECT count(*) FROM wren_kb_sources), (SELECT count(*) FROM wren_kb_chunks)"
        )[0]
        return int(row[0]), int(row[1])

    # --- writes (inside transaction(write=True)) -------------------------------------

    def bump(self) -> tuple[int, int]:
        """Count this write transaction: (the generation before, the one after)."""
        new = int(self._rows(
            "UPDATE wren_kb_meta SET generation = generation + 1 RETURNING generation"
        )[0][0])
        return new - 1, new

    def ensure_collection(self, tenant: str, name: str, now: float) -> int:
        cid = self.collection_id(tenant, name)
        if cid is not None:
            return cid
        return int(self._rows(
            "INSERT INTO wren_kb_collections (tenant, name, created) VALUES (%s, %s, %s)"
            " RETURNING id",
            (tenant, name, now),
        )[0][0])

    def _drop_chunks(self, where: str, params: Sequence[object]) -> list[int]:
        """Delete the chunks of the sources `where` selects, and their postings; the
        statistics follow. The chunk ids removed."""
        gone = self._rows(f"DELETE FROM wren_kb_chunks WHERE source_id IN ({where})"
                          " RETURNING id, dl", params)
        if not gone:
            return []
        self._drop_terms(where, params)
        self._exec(
            "UPDATE wren_kb_meta SET chunks = chunks - %s, terms = terms - %s",
            (len(gone), sum(int(r[1]) for r in gone)),
        )
        return [int(r[0]) for r in gone]

    def _drop_terms(self, where: str, params: Sequence[object]) -> None:
        self._exec(f"DELETE FROM wren_kb_terms WHERE source_id IN ({where})", params)

    def _write_terms(self, source_id: int, chunks: Sequence[tuple[int, list[str]]]) -> None:
        """Index the chunks' terms: one posting per (term, chunk) with its count."""
        with self._db().cursor().copy(
            "COPY wren_kb_terms (term, chunk_id, source_id, tf, dl) FROM STDIN"
        ) as copy:
            for chunk_id, terms in chunks:
                dl = len(terms)
                for term, tf in Counter(terms).items():
                    copy.write_row((term, chunk_id, source_id, tf, dl))

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
        enc_embedder = None if embedder is None else _enc(embedder)
        old = self.source(collection_id, source)
        removed: list[int] = []
        if old is None:
            sid = int(self._rows(
                "INSERT INTO wren_kb_sources (collection_id, source, version, recipe, embedder,"
                " tags, bytes, chunks, ingested) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)"
                " RETURNING id",
                (collection_id, _enc(source), version, recipe, enc_embedder,
                 json.dumps(list(tags)), size, len(chunks), now),
            )[0][0])
        else:
            sid = old.id
            removed = self._drop_chunks("%s", (sid,))
            self._exec(
                "UPDATE wren_kb_sources SET version = %s, recipe = %s, embedder = %s,"
                " bytes = %s, chunks = %s, ingested = %s WHERE id = %s",
                (version, recipe, enc_embedder, size, len(chunks), now, sid),
            )
        self.set_tags(sid, tags)
        if not chunks:
            return sid, removed, []
        # COPY returns no ids: take them from the sequence first, in order.
        added = sorted(int(r[0]) for r in self._rows(
            "SELECT nextval(pg_get_serial_sequence('wren_kb_chunks', 'id'))"
            " FROM generate_series(1, %s)",
            (len(chunks),),
        ))
        terms = [c.terms.split() for c in chunks]
        with self._db().cursor().copy(
            "COPY wren_kb_chunks (id, source_id, idx, headings, text, vec, dl) FROM STDIN"
        ) as copy:
            for chunk_id, c, t in zip(added, chunks, terms, strict=True):
                copy.write_row((chunk_id, sid, c.index, json.dumps(list(c.headings)),
                                _enc(c.text), c.vec, len(t)))
        self._write_terms(sid, list(zip(added, terms, strict=True)))
        self._exec(
            "UPDATE wren_kb_meta SET chunks = chunks + %s, terms = terms + %s",
            (len(chunks), sum(len(t) for t in terms)),
        )
        return sid, removed, added

    def set_tags(self, source_id: int, tags: Sequence[str]) -> None:
        self._exec(
            "UPDATE wren_kb_sources SET tags = %s WHERE id = %s",
            (json.dumps(list(tags)), source_id),
        )
        self._exec("DELETE FROM wren_kb_source_tags WHERE source_id = %s", (source_id,))
        if tags:
            self._exec(
                "INSERT INTO wren_kb_source_tags (source_id, tag)"
                " SELECT %s, unnest(%s::text[]) ON CONFLICT DO NOTHING",
                (source_id, list(dict.fromkeys(tags))),
            )

    def delete_source(self, source_id: int) -> list[int]:
        removed = self._drop_chunks("%s", (source_id,))
        self._exec("DELETE FROM wren_kb_sources WHERE id = %s", (source_id,))
        return removed

    def delete_collection(self, collection_id: int) -> list[int]:
        removed = self._drop_chunks(
            "SELECT id FROM wren_kb_sources WHERE collection_id = %s", (collection_id,)
        )
        self._exec("DELETE FROM wren_kb_collections WHERE id = %s", (collection_id,))
        return removed
