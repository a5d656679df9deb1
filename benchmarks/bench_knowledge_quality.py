"""Knowledge retrieval quality: MRR@10 and hit@5 per ranking mode and chunking.

The evaluation set is benchmarks/data/knowledge/: 25 pages of MicroPython's
documentation (MIT; docs/ and LICENSES.md there say which and how they were
converted to Markdown) and questions.jsonl, 212 questions written for this benchmark
in a user's words, each naming its document and a short exact phrase of the passage
that answers it. A hit is correct when it comes from that document and its text holds
the phrase (whitespace runs read as one space), so the set does not depend on where
the chunker cuts: any chunk holding the answer counts, at any chunk size.

For each chunking (size/overlap) the documents are ingested with the library into a
temporary store (MiniLM-L6 int8, recall's embedder, one thread) and every question is
asked in each mode (dense, keyword = BM25, hybrid = reciprocal rank fusion of the
two). It prints MRR@10, hit@5 and hit@1 over the top 10 per chunking and mode, and
hit@8k: the answer within the first 8,000 characters of hits, a search's default
limit, which compares chunk sizes at equal text handed to a model (at equal k a
larger chunk hands it more). DESIGN "Knowledge" chose the library's defaults from it.

    python benchmarks/bench_knowledge_quality.py

A second set, of other kinds of text, is chosen with `--set manuals`
(benchmarks/data/knowledge_manuals/): eight of Mosquitto's manual pages and the 2.0
series of its changelog (EPL-2.0 OR BSD-3-Clause), and a week of a greenhouse board's
log made up for it, 16 documents, with 197 questions in the same format, scored the
same way:

    python benchmarks/bench_knowledge_quality.py --set manuals

Takes about two minutes on 2 cores (embedding the chunks of four chunkings is most
of it; a question's embedding is made once per run and reused across chunkings).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server_bridge.knowledge import Folder, Hit, KnowledgeBase  # noqa: E402
from server_bridge.knowledge import chunk as chunking  # noqa: E402
from server_bridge.knowledge.service import (  # noqa: E402
    DEFAULT_MAX_CHARS,
    MAX_CHARS_LIMIT,
    MODES,
    Mode,
)
from server_bridge.memory.recall import Embedder, default_embedder  # noqa: E402
from tools.steps import Steps  # noqa: E402

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

COMMAND = "python benchmarks/bench_knowledge_quality.py"
_DATA = Path(__file__).resolve().parent / "data"
#: The evaluation sets by name, each a folder of docs/ and questions.jsonl.
SETS = {"micropython": _DATA / "knowledge", "manuals": _DATA / "knowledge_manuals"}
DEFAULT_SET = "micropython"
DATA = SETS[DEFAULT_SET]
DOCS = DATA / "docs"
QUESTIONS = DATA / "questions.jsonl"
SETTINGS = "600/100,1000/150,1500/200,2000/250"
K = 10
#: Hits fetched per question: enough that the smallest chunks fill DEFAULT_MAX_CHARS.
DEEP = 30
TENANT = "eval"
COLLECTION = "micropython-docs"

_SPACE = re.compile(r"\s+")


def squash(text: str) -> str:
    return _SPACE.sub(" ", text).strip()


@dataclass(frozen=True)
class Question:
    id: str
    doc: str
    phrase: str
    question: str

    def answers(self, hit: Hit) -> bool:
        return hit.source == self.doc and squash(self.phrase) in squash(hit.text)


def load_questions(path: Path = QUESTIONS) -> list[Question]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            out.append(Question(row["id"], row["doc"], row["phrase"], row["question"]))
    return out


class Remembering:
    """The embedder, remembering every text's vector for the run: each question is
    embedded once for all modes and chunkings, not six or nine times."""

    def __init__(self, inner: Embedder) -> None:
        self._inner = inner
        self._seen: dict[str, NDArray[np.float32]] = {}

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def dim(self) -> int:
        return self._inner.dim

    def embed(self, texts: list[str]) -> NDArray[np.float32]:
        import numpy as np

        todo = list(dict.fromkeys(t for t in texts if t not in self._seen))
        if todo:
            for text, vec in zip(todo, self._inner.embed(todo), strict=True):
                self._seen[text] = vec
        return np.stack([self._seen[t] for t in texts]).astype(np.float32, copy=False)


@dataclass
class Score:
    rr: float = 0.0
    hit1: int = 0
    hit5: int = 0
    in_budget: int = 0
    n: int = 0

    def add(self, rank: int | None, in_budget: bool) -> None:
        self.n += 1
        self.in_budget += in_budget
        if rank is not None and rank <= K:
            self.rr += 1 / rank
            self.hit1 += rank == 1
            self.hit5 += rank <= 5

    def cells(self) -> str:
        n = self.n
        return (
            f"{self.rr / n:6.3f}  {self.hit5 / n:5.3f}  {self.hit1 / n:5.3f}  "
            f"{self.in_budget / n:8.3f}"
        )


def first_right(question: Question, hits: list[Hit]) -> int | None:
    for rank, hit in enumerate(hits, start=1):
        if question.answers(hit):
            return rank
    return None


def within_budget(question: Question, hits: list[Hit], budget: int = DEFAULT_MAX_CHARS) -> bool:
    """The answer is in what a search returns by default: hits best first until
    DEFAULT_MAX_CHARS characters, the last one cut, as `retrieve` cuts it. This is
    the figure that compares chunk sizes fairly: at equal k a larger chunk hands the
    model more text, at equal characters it does not."""
    for hit in hits:
        text = hit.text[:budget]
        if hit.source == question.doc and squash(question.phrase) in squash(text):
            return True
        budget -= len(text)
        if budget <= 0:
            break
    return False


def evaluate(
    docs: Path,
    size: int,
    overlap: int,
    embedder: Embedder | None,
    questions: list[Question],
    modes: tuple[Mode, ...],
    steps: Steps,
) -> tuple[int, float, dict[Mode, Score], dict[Mode, list[Question]]]:
    """Chunks, ingest seconds, a score per mode and the questions each mode missed."""
    with tempfile.TemporaryDirectory(prefix="wren-kbq-") as tmp:
        kb = KnowledgeBase(
            Path(tmp) / "kb.sqlite3", embedder=embedder, chunk_size=size, overlap=overlap
        )
        with kb:
            steps(f"{size}/{overlap}: ingesting {docs.name}/")
            summary = kb.ingest(Folder(docs), tenant=TENANT, collection=COLLECTION)
            if summary.failed:
                raise SystemExit(f"ingest failed: {summary.failed}")
            steps(
                f"{size}/{overlap}: {summary.chunks} chunks in {summary.seconds:.1f} s; "
                f"asking {len(questions)} questions x {len(modes)} modes"
            )
            scores: dict[Mode, Score] = {m: Score() for m in modes}
            missed: dict[Mode, list[Question]] = {m: [] for m in modes}
            for q in questions:
                for mode in modes:
                    got = kb.retrieve(
                        TENANT, q.question, k=DEEP, mode=mode, max_chars=MAX_CHARS_LIMIT
                    )
                    if got.mode != mode:
                        raise SystemExit(f"asked {mode}, ranked by {got.mode}: {got.note}")
                    rank = first_right(q, got.hits[:K])
                    scores[mode].add(rank, within_budget(q, got.hits))
                    if rank is None:
                        missed[mode].append(q)
    return summary.chunks, summary.seconds, scores, missed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--set",
        choices=sorted(SETS),
        default=DEFAULT_SET,
        help=f"the evaluation set (default {DEFAULT_SET}: benchmarks/data/knowledge/)",
    )
    parser.add_argument(
        "--settings",
        default=SETTINGS,
        help=f"chunk size/overlap pairs, comma-separated (default {SETTINGS})",
    )
    parser.add_argument(
        "--no-embedding",
        action="store_true",
        help="keyword (BM25) only, as without the [recall] extra",
    )
    parser.add_argument(
        "--misses", action="store_true", help="list the questions each mode missed in the top 10"
    )
    args = parser.parse_args()
    settings = []
    for pair in args.settings.split(","):
        size, _, overlap = pair.partition("/")
        settings.append((int(size), int(overlap or 0)))

    print(f"# {COMMAND} {' '.join(sys.argv[1:])}".rstrip())
    print(f"# {platform.python_implementation()} {platform.python_version()}, {platform.machine()}")
    steps = Steps("bench_knowledge_quality")
    data = SETS[args.set]
    questions = load_questions(data / "questions.jsonl")
    docs = sorted(p.name for p in (data / "docs").iterdir() if p.is_file())
    name = "" if args.set == DEFAULT_SET else f" {args.set}"
    print(f"# evaluation set{name}: {len(docs)} documents, {len(questions)} questions; k {K}")
    embedder: Embedder | None = None
    if not args.no_embedding:
        steps("loading the embedding model")
        inner = default_embedder()
        if inner is None:
            print("# embedding stack not installed: keyword (BM25) only")
        else:
            embedder = Remembering(inner)
            print(f"# embedder {inner.name}")
    modes: tuple[Mode, ...] = MODES if embedder is not None else ("keyword",)
    default = (chunking.DEFAULT_SIZE, chunking.DEFAULT_OVERLAP)
    print(f"# library defaults now: chunk {default[0]}/{default[1]}\n")

    print(
        f"{'chunk/overlap':>13}  {'chunks':>6}  {'ingest':>7}  {'mode':<8}  "
        f"{'MRR@10':>6}  {'hit@5':>5}  {'hit@1':>5}  {'hit@8k':>8}"
    )
    all_missed: dict[tuple[int, int], dict[Mode, list[Question]]] = {}
    start = time.monotonic()
    for size, overlap in settings:
        chunks, seconds, scores, missed = evaluate(
            data / "docs", size, overlap, embedder, questions, modes, steps
        )
        all_missed[(size, overlap)] = missed
        mark = " *" if (size, overlap) == default else ""
        for i, mode in enumerate(modes):
            lead = (
                f"{f'{size}/{overlap}{mark}':>13}  {chunks:6d}  {seconds:6.1f}s"
                if i == 0
                else " " * 30
            )
            print(f"{lead}  {mode:<8}  {scores[mode].cells()}", flush=True)
    print(
        f"\n* the library's default chunking. hit@8k: the answer is within the first "
        f"{DEFAULT_MAX_CHARS:,} characters of hits (a search's default limit)."
    )
    print(f"{time.monotonic() - start:.0f} s in all")
    print(f"reproduce: {COMMAND} {' '.join(sys.argv[1:])}".rstrip())
    if args.misses:
        for (size, overlap), missed in all_missed.items():
            for mode, qs in missed.items():
                print(f"\n## {size}/{overlap} {mode}: {len(qs)} missed in the top {K}")
                for q in qs:
                    print(f"{q.id} [{q.doc}] {q.question}")


if __name__ == "__main__":
    main()
