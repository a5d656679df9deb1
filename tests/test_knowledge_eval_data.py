"""The knowledge evaluation sets are well formed (benchmarks/data/knowledge/, the
MicroPython pages, and benchmarks/data/knowledge_manuals/, manual pages, a changelog
and a board's log): every question names a document that exists and a phrase that
document holds exactly once, so benchmarks/bench_knowledge_quality.py scores what it
claims to. No embedding, no store: reads the files only."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "benchmarks" / "data"
SETS = [ROOT / "knowledge", ROOT / "knowledge_manuals"]
KEYS = {"id", "doc", "phrase", "question"}

each_set = pytest.mark.parametrize("data", SETS, ids=[p.name for p in SETS])


def squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def questions(data: Path) -> list[dict[str, str]]:
    lines = (data / "questions.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@each_set
def test_every_question_has_its_fields_and_a_unique_id(data: Path) -> None:
    rows = questions(data)
    assert 150 <= len(rows) <= 300, len(rows)
    for row in rows:
        assert set(row) == KEYS, row
        assert all(isinstance(row[k], str) and row[k].strip() for k in KEYS), row
    ids = [row["id"] for row in rows]
    assert len(set(ids)) == len(ids)


@each_set
def test_every_phrase_is_in_its_document_exactly_once(data: Path) -> None:
    docs = {p.name: squash(p.read_text(encoding="utf-8")) for p in (data / "docs").iterdir()}
    for row in questions(data):
        assert row["doc"] in docs, f"{row['id']}: no document {row['doc']!r}"
        count = docs[row["doc"]].count(squash(row["phrase"]))
        assert count == 1, f"{row['id']}: {row['phrase']!r} is {count} times in {row['doc']}"


@each_set
def test_questions_are_not_the_passages_own_words(data: Path) -> None:
    # The question is the user's, not a sentence lifted from the answer: it may not
    # contain its phrase, and no two questions are the same.
    rows = questions(data)
    for row in rows:
        assert squash(row["phrase"]).lower() not in squash(row["question"]).lower(), row["id"]
    texts = [squash(row["question"]).lower() for row in rows]
    assert len(set(texts)) == len(texts)


@each_set
def test_every_document_is_asked_about_and_has_its_licence_listed(data: Path) -> None:
    names = {p.name for p in (data / "docs").iterdir()}
    assert names == {row["doc"] for row in questions(data)}
    licences = (data / "LICENSES.md").read_text(encoding="utf-8")
    for name in names:
        assert f"| {name} |" in licences, f"{name} is not in LICENSES.md"


def test_the_sets_ids_do_not_collide() -> None:
    # A miss list names questions by id alone: an id says which set it is from.
    ids = [{row["id"] for row in questions(data)} for data in SETS]
    assert not ids[0] & ids[1]
