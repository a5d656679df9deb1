"""Recall quality and cost: MiniLM (int8, onnxruntime) against BM25.

- Quality: MRR@10 and hit@1 on benchmarks/data/recall_home_*.tsv, 200 short passages
  about one household's devices, sensors, routines and preferences with 157 queries
  whose answer passage is known (written for this benchmark). Most queries paraphrase
  their passage; the last few are bare device ids and brand names.
- Model: sha256 check and session load time; embed throughput (chunks/s) by batch
  size and onnxruntime thread count.
- Index: build time (rebuild) and search latency p50/p99 at each size (default 1,000
  and 10,000 generated rows over 10 tenants), for a search over everything and one
  restricted to one tenant; in embedding mode split into the query's embedding and
  the index's own work. BM25 upsert cost, and bm25s's full re-index for comparison
  (the cost an index on bm25s would pay after each write; recall.py says why).

    python benchmarks/bench_recall.py

Takes about two minutes on 2 cores (embedding 10,000 rows is most of it).
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server_bridge.memory.recall import (  # noqa: E402
    MODEL_SHA256,
    MiniLMEmbedder,
    RecallIndex,
    analyze,
    installed_model_path,
)
from tools.steps import Steps  # noqa: E402

COMMAND = "python benchmarks/bench_recall.py"
DATA = Path(__file__).resolve().parent / "data"
TENANTS = 10


def load_set() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    def rows(name: str) -> list[tuple[str, str]]:
        out = []
        for line in (DATA / name).read_text(encoding="utf-8").splitlines():
            if line.strip():
                a, b = line.split("\t", 1)
                out.append((a, b.strip()))
        return out

    return rows("recall_home_passages.tsv"), rows("recall_home_queries.tsv")


def quality(
    index: RecallIndex, queries: list[tuple[str, str]], keyword: bool
) -> tuple[float, float]:
    rr = hit1 = 0.0
    for answer, query in queries:
        ids = [d for d, _ in index.search(query, 10, lambda m: True, keyword=keyword)]
        if answer in ids:
            rr += 1 / (ids.index(answer) + 1)
            hit1 += ids[0] == answer
    return rr / len(queries), hit1 / len(queries)


ROOMS = "kitchen hallway bedroom nursery garage attic basement office bathroom terrace".split()
DEVICES = [
    "motion sensor", "thermostat", "smart plug", "door lock", "window sensor", "camera",
    "humidity sensor", "ceiling light", "blind", "speaker", "leak sensor", "smoke alarm",
]  # fmt: skip
EVENTS = [
    "reported a low battery", "went offline for {n} minutes", "was set to {n} percent",
    "triggered {n} times since noon", "was renamed by {who}", "needs a firmware update",
    "read {n} degrees", "was switched off by {who}", "was paired again after a power cut",
]  # fmt: skip
PEOPLE = "Mia Tom Rosa Jonas Lena Omar Ines Pavel".split()


def corpus(n: int, seed: int = 1) -> list[tuple[str, str, dict[str, Any]]]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        event = rng.choice(EVENTS).format(n=rng.randrange(1, 99), who=rng.choice(PEOPLE))
        text = (
            f"The {rng.choice(ROOMS)} {rng.choice(DEVICES)} ({rng.choice('abcdef')}{i}) "
            f"{event} at {rng.randrange(24):02d}:{rng.randrange(60):02d}."
        )
        docs.append((f"row{i}", text, {"tenant": f"t{i % TENANTS}"}))
    return docs


def query_texts(n: int, seed: int = 2) -> list[str]:
    rng = random.Random(seed)
    forms = [
        "which {d} in the {r} has a weak battery",
        "when did the {r} {d} go offline",
        "what did {who} change",
        "{r} temperature",
        "is the {d} up to date",
    ]
    return [
        rng.choice(forms).format(d=rng.choice(DEVICES), r=rng.choice(ROOMS), who=rng.choice(PEOPLE))
        for _ in range(n)
    ]


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def ms(samples: list[float]) -> str:
    return f"p50 {pct(samples, 0.5):7.3f} ms  p99 {pct(samples, 0.99):7.3f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default="1000,10000", help="index sizes for latency, comma-separated"
    )
    parser.add_argument("--queries", type=int, default=200, help="searches timed per size and mode")
    parser.add_argument(
        "--no-embedding", action="store_true", help="BM25 only (as without the [recall] extra)"
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]

    print(f"# {COMMAND} {' '.join(sys.argv[1:])}".rstrip())
    print(f"# {platform.python_implementation()} {platform.python_version()}, {platform.machine()}")
    steps = Steps("bench_recall")
    steps("loading the labeled set and the embedding model")
    passages, queries = load_set()
    print(f"# labeled set: {len(passages)} passages, {len(queries)} queries")

    embedder: MiniLMEmbedder | None = None
    if not args.no_embedding:
        try:
            import onnxruntime

            t = time.perf_counter()
            embedder = MiniLMEmbedder()
            load = time.perf_counter() - t
            print(f"# onnxruntime {onnxruntime.__version__}, model {installed_model_path()}")
            print(f"# model sha256 {MODEL_SHA256}")
            print(f"model load (sha256 check + tokenizer + session): {load * 1e3:.0f} ms")
        except ImportError as e:
            print(f"# embedding stack not installed ({e.name}): BM25 only")

    steps("quality: indexing the passages and running the queries")
    print("\n## quality (MRR@10, hit@1)")
    bm25 = RecallIndex(None)
    bm25.rebuild((pid, text, {}) for pid, text in passages)
    mrr, h1 = quality(bm25, queries, keyword=True)
    print(f"BM25 (Snowball stems)   MRR@10 {mrr:.3f}  hit@1 {h1:.3f}")
    if embedder is not None:
        semantic = RecallIndex(embedder)
        semantic.rebuild((pid, text, {}) for pid, text in passages)
        mrr, h1 = quality(semantic, queries, keyword=False)
        print(f"MiniLM-L6 int8          MRR@10 {mrr:.3f}  hit@1 {h1:.3f}")

    if embedder is not None:
        print("\n## embed throughput (chunks/s; 512 generated rows of ~20 words)")
        texts = [text for _, text, _ in corpus(512, seed=5)]
        for threads in (1, 2):
            e = embedder if threads == 1 else MiniLMEmbedder(threads=threads)
            for batch in (1, 32):
                t = time.perf_counter()
                for i in range(0, len(texts), batch):
                    e.embed(texts[i : i + batch])
                rate = len(texts) / (time.perf_counter() - t)
                print(f"threads {threads}, batch {batch:2d}: {rate:6.0f} chunks/s")
    bulk = MiniLMEmbedder(threads=2) if embedder is not None else None
    print("\n## index cost")
    for n in sizes:
        index_cost(n, query_texts(args.queries), bulk if embedder is not None else None)


def row(n: int, label: str, value: str) -> None:
    print(f"{n:6d} rows  {label:<26} {value}")


def index_cost(n: int, qs: list[str], bulk: MiniLMEmbedder | None) -> None:
    docs = corpus(n)
    one = {"tenant": "t3"}

    def everyone(m: dict[str, Any]) -> bool:
        return True

    def only(m: dict[str, Any]) -> bool:
        return m["tenant"] == "t3"

    def searches(index: RecallIndex, allowed: Callable[[dict[str, Any]], bool]) -> str:
        it = iter(qs)
        return ms(timed(lambda: index.search(next(it), 5, allowed), len(qs)))

    kw = RecallIndex(None)
    t = time.perf_counter()
    kw.rebuild(docs)
    row(n, "BM25 rebuild", f"{time.perf_counter() - t:7.2f} s")
    extra = corpus(200, seed=9)
    ups = timed(lambda: [kw.upsert(f"x{d}", text, one) for d, text, _ in extra], 1)[0]
    rms = timed(lambda: [kw.remove(f"x{d}") for d, _, _ in extra], 1)[0]
    row(
        n,
        "BM25 upsert / remove",
        f"{ups / len(extra) * 1e3:.1f} us / {rms / len(extra) * 1e3:.1f} us",
    )
    row(n, "BM25 search, all", searches(kw, everyone))
    row(n, "BM25 search, 1 tenant", searches(kw, only))
    try:
        import bm25s

        tokens = [analyze(text) for _, text, _ in docs]
        t = time.perf_counter()
        bm25s.BM25(method="lucene").index(tokens, show_progress=False)
        row(n, "bm25s re-index (tokenised)", f"{(time.perf_counter() - t) * 1e3:.0f} ms")
    except ImportError:
        pass
    if bulk is None:
        return
    sem = RecallIndex(bulk)
    t = time.perf_counter()
    sem.rebuild(docs)
    took = time.perf_counter() - t
    row(n, "MiniLM rebuild", f"{took:7.2f} s ({n / took:.0f} rows/s, 2 threads)")
    # Searches embed their query with the same 2-thread embedder.
    row(n, "MiniLM query embed", ms(timed(lambda: bulk.embed([qs[0]]), len(qs))))
    row(n, "MiniLM search, all", searches(sem, everyone))
    row(n, "MiniLM search, 1 tenant", searches(sem, only))
    vectors = sem._state.vectors  # the index's own share of a search: the product
    assert vectors is not None
    qv = bulk.embed([qs[0]])[0]
    row(n, "MiniLM dot product only", ms(timed(lambda: vectors.scores(qv), len(qs))))


if __name__ == "__main__":
    main()
