"""The knowledge evaluation set is well formed (benchmarks/data/knowledge/): every
question names a document that exists and a phrase that document holds exactly once,
so benchmarks/bench_knowledge_quality.py scores what it claims to. No embedding, no
store: reads the files only."""

from __future__ import annotations

import json
import re
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "knowledge"
KEYS = {"id", "doc", "phrase", "question"}


def squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def questions() -> list[dict[str, str]]:
    lines = (DATA / "questions.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_every_question_has_its_fields_and_a_unique_id() -> None:
    rows = questions()
    assert 150 <= len(rows) <= 300, len(rows)
    for row in rows:
        assert set(row) == KEYS, row
        assert all(isinstance(row[k], str) and row[k].strip() for k in KEYS), row
    ids = [row["id"] for row in rows]
    assert len(set(ids)) == len(ids)


def test_every_phrase_is_in_its_document_exactly_once() -> None:
    docs = {p.name: squash(p.read_text(encoding="utf-8")) for p in (DATA / "docs").iterdir()}
    for row in questions():
        assert row["doc"] in docs, f"{row['id']}: no document {row['doc']!r}"
        count = docs[row["doc"]].count(squash(row["phrase"]))
        assert count == 1, f"{row['id']}: {row['phrase']!r} is {count} times in {row['doc']}"


def test_questions_are_not_the_passages_own_words() -> None:
    # The question is the user's, not a sentence lifted from the answer: it may not
    # contain its phrase, and no two questions are the same.
    rows = questions()
    for row in rows:
        assert squash(row["phrase"]).lower() not in squash(row["question"]).lower(), row["id"]
    texts = [squash(row["question"]).lower() for row in rows]
    assert len(set(texts)) == len(texts)


def test_every_document_is_asked_about_and_has_its_licence_listed() -> None:
    names = {p.name for p in (DATA / "docs").iterdir()}
    assert names == {row["doc"] for row in questions()}
    licences = (DATA / "LICENSES.md").read_text(encoding="utf-8")
    for name in names:
        assert f"| {name} |" in licences, f"{name} is not in LICENSES.md"
