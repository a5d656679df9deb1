"""The knowledge store on PostgreSQL next to SQLite, in one run: ranking quality of
keyword search, ingest throughput and retrieval latency.

PostgreSQL is a server of the benchmark's own (tools/pg_server.py), fsync on
(`durable=True`), as SQLite's synchronous=FULL is: each write batch is flushed on
both.

1. *Keyword ranking, by quality* (what chose pgstore/knowledge.py's keyword search):
   the evaluation set of bench_knowledge_quality.py (MicroPython's pages, 212
   questions, default chunking 1000/150, k 10) ingested into each store, every
   question asked by keyword and hybrid (MiniLM-L6 int8 for the dense half; without
   the model, keyword only): SQLite's FTS5 bm25(); the PostgreSQL store's BM25 in SQL
   over its postings table; and PostgreSQL's full-text search over a tsvector of the
   same analysed terms at their positions (a store of this benchmark's, `FtsStore`,
   never shipped), ranked by ts_rank_cd and ts_rank, with and without length
   normalisation. MRR@10, hit@5, hit@1, hit@8k as bench_knowledge_quality.py prints
   them, and the keyword search's p50 on that small store.
2. *Cost*: bench_knowledge.py's generated folder (default 1,000 Markdown files, about
   10k chunks), BM25 only: ingest chunks/s, and the unchanged folder again; then a
   store of two tenants with stored random vectors under MiniLM's name, and retrieve
   p50/p99 in process, k 5, per mode, with MiniLM embedding the query; the first dense
   search after opening (the vector cache loaded from the store); PostgreSQL's
   full-text search's keyword latency on the same chunks beside them. Ratios are
   PostgreSQL / SQLite.

    python benchmarks/bench_knowledge_pg.py                  # about 3 minutes on 2 cores
    python benchmarks/bench_knowledge_pg.py --ranks all      # the five rankings of FTS_RANKS
    python benchmarks/bench_knowledge_pg.py --skip-quality --docs 10000   # 100k chunks
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_knowledge import (  # noqa: E402
    RandomVectors,
    ms,
    pct,
    timed,
    vocabulary,
    write_corpus,
)
from bench_knowledge_quality import (  # noqa: E402
    COLLECTION,
    DEEP,
    SETS,
    TENANT,
    K,
    Question,
    Remembering,
    Score,
    first_right,
    load_questions,
    within_budget,
)

from server_bridge.knowledge import FileList, Folder, KnowledgeBase  # noqa: E402
from server_bridge.knowledge.service import MAX_CHARS_LIMIT, Mode  # noqa: E402
from server_bridge.memory.recall import Embedder, analyze, default_embedder  # noqa: E402
from server_bridge.pgstore.knowledge import PgKnowledgeStore, match_terms  # noqa: E402
from tools.pg_server import PgServer, start_postgres  # noqa: E402
from tools.steps import Steps  # noqa: E402

COMMAND = "python benchmarks/bench_knowledge_pg.py"

#: PostgreSQL's full-text rankings measured against BM25: (label, SQL of the rank).
#: Normalisation 1 divides by 1 + log(length), 2 by the length.
FTS_RANKS = {
    "ts_rank_cd": "ts_rank_cd(tsv, q)",
    "ts_rank_cd/1": "ts_rank_cd(tsv, q, 1)",
    "ts_rank_cd/2": "ts_rank_cd(tsv, q, 2)",
    "ts_rank": "ts_rank(tsv, q)",
    "ts_rank/1": "ts_rank(tsv, q, 1)",
}
#: Two of them by default, to keep a run near 3 minutes: the cover-density ranking
#: PostgreSQL documents for this, and the best of the five on a full run in MRR@10.
DEFAULT_RANKS = "ts_rank_cd,ts_rank/1"
#: A tsvector keeps at most 256 positions of a lexeme, each below 16,384.
_MAX_POSITIONS = 256
_MAX_POSITION = 16383


def tsvector(terms: Sequence[str]) -> str:
    """A tsvector literal of analysed terms at their positions: the terms as they are
    (recall.analyze's, the same as the postings), not re-parsed by a text search
    configuration. They are \\w+ runs, so quoting them needs no escapes."""
    at: dict[str, list[int]] = {}
    for i, term in enumerate(terms, start=1):
        spots = at.setdefault(term, [])
        if len(spots) < _MAX_POSITIONS:
            spots.append(min(i, _MAX_POSITION))
    return " ".join(f"'{t}':{','.join(map(str, p))}" for t, p in at.items())


class FtsStore(PgKnowledgeStore):
    """The alternative measured, not shipped: the keyword index a tsvector column of
    each chunk (a GIN index over it), a search `tsv @@ (t1 | t2 ...)` ranked by
    `rank_sql`. Added to a database of the benchmark's own."""

    def __init__(self, dsn: str, rank_sql: str) -> None:
        super().__init__(dsn)
        self.rank_sql = rank_sql
        with self._pool.connection() as conn:
            conn.execute("ALTER TABLE wren_kb_chunks ADD COLUMN IF NOT EXISTS tsv tsvector")
            conn.execute(
                "CREATE INDEX IF NOT EXISTS wren_kb_chunks_tsv ON wren_kb_chunks USING gin (tsv)"
            )

    def _write_terms(self, source_id: int, chunks: Sequence[tuple[int, list[str]]]) -> None:
        self._db().cursor().executemany(
            "UPDATE wren_kb_chunks SET tsv = %s::tsvector WHERE id = %s",
            [(tsvector(terms), chunk_id) for chunk_id, terms in chunks],
        )

    def _drop_terms(self, where: str, params: Sequence[object]) -> None:
        pass  # the column goes with its row

    def keyword(self, match: str, allowed: Sequence[int], limit: int) -> list[tuple[int, float]]:
        terms = match_terms(match)
        if not allowed or not terms:
            return []
        rows = self._rows(
            f"SELECT c.id, {self.rank_sql} AS rank FROM wren_kb_chunks c,"
            " to_tsquery('simple', %(q)s) q"
            " WHERE c.tsv @@ q AND c.source_id IN (SELECT unnest(%(allowed)s::bigint[]))"
            " ORDER BY rank DESC, c.id LIMIT %(limit)s",
            {"q": " | ".join(f"'{t}'" for t in terms), "allowed": list(allowed), "limit": limit},
        )
        return [(int(r[0]), float(r[1])) for r in rows]


class Databases:
    """A fresh database on the benchmark's server per store opened."""

    def __init__(self, server: PgServer) -> None:
        self.server = server
        self.n = 0

    def new(self) -> str:
        import psycopg
        import psycopg.conninfo

        self.n += 1
        name = f"bench_kb_{self.n}"
        with psycopg.connect(self.server.dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')
        return str(psycopg.conninfo.make_conninfo(self.server.dsn, dbname=name))


Opener = Callable[..., KnowledgeBase]


def openers(dbs: Databases, root: Path, ranks: Sequence[str]) -> dict[str, Opener]:
    """Each store by label: a function (embedder=..., **kw) -> a knowledge base over a
    new, empty store of that kind."""

    def sqlite(**kw: Any) -> KnowledgeBase:
        path = Path(tempfile.mkdtemp(dir=root)) / "kb.sqlite3"
        return KnowledgeBase(path, **kw)

    def pg(**kw: Any) -> KnowledgeBase:
        return KnowledgeBase(PgKnowledgeStore(dbs.new()), **kw)

    out: dict[str, Opener] = {"sqlite FTS5 bm25": sqlite, "pg BM25 (shipped)": pg}
    for label in ranks:
        def fts(label: str = label, **kw: Any) -> KnowledgeBase:
            return KnowledgeBase(FtsStore(dbs.new(), FTS_RANKS[label]), **kw)

        out[f"pg fts {label}"] = fts
    return out


def quality(
    open_kb: Opener,
    docs: Path,
    embedder: Embedder | None,
    questions: list[Question],
    modes: tuple[Mode, ...],
) -> tuple[dict[Mode, Score], list[float]]:
    """Scores per mode over the set, and the keyword searches' seconds."""
    with open_kb(embedder=embedder) as kb:
        summary = kb.ingest(Folder(docs), tenant=TENANT, collection=COLLECTION)
        if summary.failed:
            raise SystemExit(f"ingest failed: {summary.failed}")
        scores: dict[Mode, Score] = {m: Score() for m in modes}
        seconds: list[float] = []
        for q in questions:
            for mode in modes:
                t0 = time.perf_counter()
                got = kb.retrieve(TENANT, q.question, k=DEEP, mode=mode, max_chars=MAX_CHARS_LIMIT)
                if mode == "keyword":
                    seconds.append(time.perf_counter() - t0)
                if got.mode != mode:
                    raise SystemExit(f"asked {mode}, ranked by {got.mode}: {got.note}")
                scores[mode].add(first_right(q, got.hits[:K]), within_budget(q, got.hits))
    return scores, seconds


def ratio(pg: float, sqlite: float) -> str:
    return f"{pg / sqlite:5.2f}x" if sqlite > 0 else "  n/a"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--docs", type=int, default=1000,
                        help="documents of the cost corpus (about 10 chunks each)")
    parser.add_argument("--queries", type=int, default=200, help="queries per mode")
    parser.add_argument("--ranks", default=DEFAULT_RANKS,
                        help=f"PostgreSQL full-text rankings to measure, of {', '.join(FTS_RANKS)}"
                        f" (default {DEFAULT_RANKS}; all; '' for none)")
    parser.add_argument("--skip-quality", action="store_true", help="the cost part only")
    parser.add_argument("--no-embedding", action="store_true",
                        help="keyword only, without MiniLM (as without the [recall] extra)")
    args = parser.parse_args()
    ranks = list(FTS_RANKS) if args.ranks == "all" else [r for r in args.ranks.split(",") if r]
    for r in ranks:
        if r not in FTS_RANKS:
            parser.error(f"--ranks: {r!r} is not one of {', '.join(FTS_RANKS)}")

    print(f"# {COMMAND} {' '.join(sys.argv[1:])}".rstrip())
    print(f"# {platform.python_implementation()} {platform.python_version()}, "
          f"{platform.machine()}, {os.cpu_count()} cores")
    steps = Steps("bench_knowledge_pg")
    started = time.monotonic()
    embedder = None if args.no_embedding else default_embedder()
    with tempfile.TemporaryDirectory(prefix="wren-kbpg-") as tmp:
        root = Path(tmp)
        steps("starting PostgreSQL (fsync on)")
        server = start_postgres(root, durable=True)
        try:
            import psycopg

            with psycopg.connect(server.dsn) as conn:
                version = conn.execute("SHOW server_version").fetchone()[0]
            print(f"# PostgreSQL {version}, fsync on; SQLite synchronous=FULL, WAL")
            dbs = Databases(server)
            stores = openers(dbs, root, ranks)
            if not args.skip_quality:
                part_quality(stores, embedder, steps)
            part_cost(args, dbs, root, embedder, ranks, steps)
        finally:
            server.stop()
    print(f"\n# took {time.monotonic() - started:.0f} s")
    print(f"# reproduce: {COMMAND} {' '.join(sys.argv[1:])}".rstrip())


def part_quality(stores: dict[str, Opener], inner: Embedder | None, steps: Steps) -> None:
    data = SETS["micropython"]
    questions = load_questions(data / "questions.jsonl")
    embedder = Remembering(inner) if inner is not None else None
    modes: tuple[Mode, ...] = ("keyword", "hybrid") if embedder is not None else ("keyword",)
    print(f"\n## keyword ranking quality: {data.name}/, {len(questions)} questions, chunk "
          f"1000/150, k {K}" + ("" if embedder else " (no embedder: keyword only)"))
    print(f"{'store':<22}  {'mode':<8}  {'MRR@10':>6}  {'hit@5':>5}  {'hit@1':>5}  "
          f"{'hit@8k':>8}  keyword p50")
    for label, open_kb in stores.items():
        steps(f"quality: {label}")
        scores, seconds = quality(open_kb, data / "docs", embedder, questions, modes)
        for i, mode in enumerate(modes):
            lead = f"{label:<22}" if i == 0 else " " * 22
            tail = f"  {statistics.median(seconds) * 1e3:6.2f} ms" if i == 0 else ""
            print(f"{lead}  {mode:<8}  {scores[mode].cells()}{tail}", flush=True)


def part_cost(
    args: argparse.Namespace,
    dbs: Databases,
    root: Path,
    embedder: Embedder | None,
    ranks: Sequence[str],
    steps: Steps,
) -> None:
    rng = random.Random(7)
    words = vocabulary()
    corpus = root / "corpus"
    corpus.mkdir()
    size = write_corpus(corpus, args.docs, rng, words)
    print(f"\n## cost: {args.docs} generated Markdown files, {size / 1e6:.1f} MB")
    queries = [" ".join(rng.choices(words[20:], k=rng.randint(3, 6)))
               for _ in range(args.queries)]
    modes: tuple[Mode, ...] = ("keyword", "dense", "hybrid") if embedder else ("keyword",)
    search_dsn = dbs.new()
    pg_dsns = {"ingest": dbs.new(), "search": search_dsn}

    def sqlite_kb(name: str, **kw: Any) -> KnowledgeBase:
        return KnowledgeBase(root / f"{name}.sqlite3", **kw)

    def pg_kb(name: str, **kw: Any) -> KnowledgeBase:
        return KnowledgeBase(PgKnowledgeStore(pg_dsns[name]), **kw)

    rows = {
        kind: measure(kind, open_kb, corpus, embedder, queries, modes, steps,
                      after_ingest=(lambda: analyze_db(search_dsn)) if kind == "pg" else None)
        for kind, open_kb in (("sqlite", sqlite_kb), ("pg", pg_kb))
    }
    sq, pg = rows["sqlite"], rows["pg"]
    print(f"ingest, BM25 only ({sq['chunks']} chunks): sqlite {sq['ingest']:7.0f} chunks/s  "
          f"pg {pg['ingest']:7.0f} chunks/s  pg/sqlite {ratio(pg['ingest'], sq['ingest'])}")
    print(f"unchanged folder again:        sqlite {sq['again']:7.2f} s         "
          f"pg {pg['again']:7.2f} s         {ratio(pg['again'], sq['again'])}")
    print(f"open the store:                sqlite {sq['open'] * 1e3:7.1f} ms        "
          f"pg {pg['open'] * 1e3:7.1f} ms        {ratio(pg['open'], sq['open'])}")
    if "first dense" in sq:
        print(f"first dense search (loads the vectors): sqlite {sq['first dense'] * 1e3:.0f} ms"
              f"  pg {pg['first dense'] * 1e3:.0f} ms  "
              f"{ratio(pg['first dense'], sq['first dense'])}")
    print(f"retrieve, k 5, one tenant of two, {len(queries)} queries per mode:")
    for mode in modes:
        a, b = sq[mode], pg[mode]
        print(f"  {mode:<8} sqlite {ms(a)}   pg {ms(b)}   p50 "
              f"{ratio(statistics.median(b), statistics.median(a))}  p99 "
              f"{ratio(pct(b, 99), pct(a, 99))}")
    # The full-text alternative's keyword latency over the same chunks: its index
    # built on the search database's rows, then the same queries through its keyword().
    if ranks and search_dsn:
        steps("cost: pg full-text search over the same chunks")
        store = FtsStore(search_dsn, FTS_RANKS[ranks[0]])
        try:
            with store._pool.connection() as conn:
                cur = conn.execute("SELECT id, text FROM wren_kb_chunks")
                fills = [(_tsv_of(text), cid) for cid, text in cur.fetchall()]
                conn.cursor().executemany(
                    "UPDATE wren_kb_chunks SET tsv = %s::tsvector WHERE id = %s", fills
                )
                conn.commit()
            analyze_db(search_dsn)
            matches = [" OR ".join(f'"{t}"' for t in dict.fromkeys(analyze(q))) for q in queries]
            with store.transaction():
                allowed = store.allowed_sources("bench", ["docs"])
                fts = timed(lambda m: store.keyword(m, allowed, 5), matches)
            with PgKnowledgeStore(search_dsn) as bm25_store, bm25_store.transaction():
                allowed = bm25_store.allowed_sources("bench", ["docs"])
                bm25 = timed(lambda m: bm25_store.keyword(m, allowed, 5), matches)
        finally:
            store.close()
        print(f"keyword search alone (the store's keyword(), top 5, {len(allowed)} sources "
              "allowed):")
        print(f"  pg BM25 (shipped)     {ms(bm25)}")
        print(f"  pg fts {ranks[0]:<14} {ms(fts)}   p50 "
              f"{ratio(statistics.median(fts), statistics.median(bm25))} of BM25's")


def measure(
    kind: str,
    open_kb: Callable[..., KnowledgeBase],
    corpus: Path,
    embedder: Embedder | None,
    queries: list[str],
    modes: tuple[Mode, ...],
    steps: Steps,
    after_ingest: Callable[[], None] | None,
) -> dict[str, Any]:
    """One store's figures: ingest chunks/s (BM25 only) and the unchanged folder again
    into "ingest"; then "search" with random vectors under the embedder's name, two
    tenants, opened again and timed per mode."""
    got: dict[str, Any] = {}
    steps(f"cost: {kind}: ingest")
    with open_kb("ingest", embedder=None) as kb:
        s = kb.ingest(Folder(corpus), tenant="bench", collection="docs")
        again = kb.ingest(Folder(corpus), tenant="bench", collection="docs")
    got["chunks"], got["ingest"], got["again"] = s.chunks, s.chunks_per_s, again.seconds
    fake = RandomVectors(embedder.name, embedder.dim) if embedder is not None else None
    with open_kb("search", embedder=fake) as kb:
        kb.ingest(Folder(corpus), tenant="bench", collection="docs")
        kb.ingest(FileList(sorted(corpus.rglob("*.md"))[:100], root=corpus),
                  tenant="other", collection="docs")
    if after_ingest is not None:
        after_ingest()
    steps(f"cost: {kind}: retrieve")
    t0 = time.perf_counter()
    kb = open_kb("search", embedder=embedder)
    got["open"] = time.perf_counter() - t0
    with kb:
        if embedder is not None:
            embedder.embed([queries[0]])
            t0 = time.perf_counter()
            kb.retrieve("bench", queries[0], mode="dense")
            got["first dense"] = time.perf_counter() - t0
        for mode in modes:
            def retrieve(q: str, mode: Mode = mode) -> None:
                r = kb.retrieve("bench", q, mode=mode, k=5)
                assert all(h.collection == "docs" for h in r.hits)

            retrieve(queries[0])
            got[mode] = timed(retrieve, queries)
    return got


def analyze_db(dsn: str) -> None:
    """VACUUM ANALYZE, as autovacuum leaves a database a minute after a bulk write:
    the planner's statistics and the visibility map (index-only scans) current."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")


def _tsv_of(text: str) -> str:
    # The chunk's analysed text: its terms without the heading path, close enough for
    # a latency figure (the heading adds a few terms).
    return tsvector(analyze(text))


if __name__ == "__main__":
    main()
