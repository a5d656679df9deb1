"""The knowledge API: ingest, update, delete and retrieve, per tenant and collection.

`KnowledgeBase` is the one public face; sources, extraction, chunking, the store and
the vector cache are its parts. Every method may be called from any thread: reading
files, extracting, chunking and embedding run outside the lock, and only store
transactions and the cache change under it (so a search waits at most for one write
batch, never for an embedding).

Guarantees, and where they come from:
- A source whose content hash, chunking and embedder are unchanged costs one read
  and one hash: nothing is extracted, chunked or embedded.
- A changed source's chunks are replaced in one transaction (store.py says why a
  search then sees the old version or the new, never a mix or neither). Sources are
  written in batches (at most WRITE_BATCH_CHUNKS chunks), one transaction each: a
  batch is all or nothing, and a failure leaves every earlier batch in place.
- A file that cannot be read or understood is not written at all, and is listed in
  the summary with its reason; memory stays bounded by the file size limit and one
  write batch.
- Every search is restricted to the caller's tenant in SQL before ranking, whatever
  else its filters say: another tenant's collections cannot be named, listed or hit.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from server_bridge.memory.recall import Embedder, analyze

from . import chunk as chunking
from .errors import InvalidK, InvalidName, InvalidOption, NotFound, QueryTooLarge, SkipFile
from .extract import extract
from .index import VectorCache, resolve_embedder
from .sources import Connector, Document, Skipped
from .store import ChunkRow, HitRow, SourceRow, Store

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

__all__ = [
    "DEFAULT_MAX_CHARS",
    "DEFAULT_MAX_FILE_BYTES",
    "MAX_K",
    "MAX_QUERY_CHARS",
    "CollectionInfo",
    "FileResult",
    "Hit",
    "IngestSummary",
    "KnowledgeBase",
    "KnowledgeStore",
    "Mode",
    "Progress",
    "Retrieval",
]

log = logging.getLogger("wren.bridge.knowledge")

Mode = Literal["dense", "keyword", "hybrid"]
MODES: tuple[Mode, ...] = ("dense", "keyword", "hybrid")

#: Hits per search: past 100 a caller wants an export, not a search.
MAX_K = 100
#: A query is a question, not a document: the embedder reads its first 256 tokens
#: (about 1,000 characters) and BM25 walks a posting list per term. Longer is refused
#: (QueryTooLarge), not cut, so nobody is answered for a question they did not ask.
MAX_QUERY_CHARS = 8192
#: Characters of hit text one search returns by default (about 2,000 tokens: room for
#: the passages in a model call beside its history), and at most.
DEFAULT_MAX_CHARS = 8000
MAX_CHARS_LIMIT = 1_000_000
#: A file over this is skipped before it is read. 20 MB of text is about 20,000 chunks,
#: a couple of minutes of embedding on two cores; a larger corpus is many files.
DEFAULT_MAX_FILE_BYTES = 20_000_000
#: Chunks written per transaction: large enough that the fsync per commit is a small
#: share of the cost, small enough that a search waits a few ms at most for one.
WRITE_BATCH_CHUNKS = 512
#: Texts embedded per call during an ingest (progress is reported between calls).
EMBED_SLICE = 64
#: Reciprocal rank fusion's constant (Cormack et al. 2009's 60): ranks, not scores,
#: are fused, so cosine and BM25 need no common scale.
RRF_K = 60

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:=/-]{0,63}")
_MAX_TAGS = 32
_MAX_SOURCE_ID = 1024


def _check_name(what: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise InvalidName(
            f"{what} {value!r}: 1-64 characters of letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )
    return value


def _check_tags(tags: Iterable[str]) -> tuple[str, ...]:
    out = tuple(dict.fromkeys(tags))
    if len(out) > _MAX_TAGS:
        raise InvalidName(f"{len(out)} tags: at most {_MAX_TAGS}")
    for t in out:
        if not isinstance(t, str) or not _TAG.fullmatch(t):
            raise InvalidName(f"tag {t!r}: 1-64 characters of letters, digits and . _ : = / -")
    return out


@dataclass(frozen=True)
class Hit:
    """One retrieved chunk and where it came from."""

    collection: str
    source: str
    version: str
    chunk: int
    headings: tuple[str, ...]
    score: float
    text: str
    tags: tuple[str, ...] = ()
    #: The text was cut to keep the search within its character limit.
    truncated: bool = False


@dataclass(frozen=True)
class Retrieval:
    hits: list[Hit]
    #: The ranking that ran: "keyword" when dense or hybrid was asked without an embedder.
    mode: Mode
    note: str = ""


@dataclass(frozen=True)
class FileResult:
    source: str
    status: Literal["new", "changed", "unchanged", "failed", "removed"]
    chunks: int = 0
    reason: str = ""


@dataclass
class IngestSummary:
    files: list[FileResult] = field(default_factory=list)
    chunks: int = 0
    embedded: int = 0
    seconds: float = 0.0

    def count(self, status: str) -> int:
        return sum(1 for f in self.files if f.status == status)

    @property
    def failed(self) -> list[FileResult]:
        return [f for f in self.files if f.status == "failed"]

    @property
    def chunks_per_s(self) -> float:
        return self.chunks / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        return (
            f"sources: {self.count('new')} new, {self.count('changed')} changed, "
            f"{self.count('unchanged')} unchanged, {self.count('failed')} failed"
            + (f", {self.count('removed')} removed" if self.count("removed") else "")
            + "; "
            f"{self.chunks} chunks in {self.seconds:.1f} s ({self.chunks_per_s:.0f} chunks/s)"
        )


@dataclass(frozen=True)
class Progress:
    files_done: int
    files_total: int
    chunks: int
    embedded: int
    seconds: float
    current: str
    #: Set when a file has just been dealt with.
    result: FileResult | None = None


@dataclass(frozen=True)
class CollectionInfo:
    name: str
    sources: int
    chunks: int
    bytes: int


class KnowledgeStore(Protocol):
    """What the knowledge base asks of its store: `store.Store` (SQLite, one file) and
    `server_bridge.pgstore.knowledge.PgKnowledgeStore` (PostgreSQL, shared by bridges).
    Every method runs inside `transaction()`, one at a time (the service's lock); a
    read transaction is one snapshot, and `generation()` changes with every write
    transaction of any process, so a vector cache at that number is current."""

    @property
    def path(self) -> Path | None: ...
    def close(self) -> None: ...
    def transaction(self, write: bool = False) -> AbstractContextManager[None]: ...
    def generation(self) -> int: ...
    def collection_id(self, tenant: str, name: str) -> int | None: ...
    def source(self, collection_id: int, source: str) -> SourceRow | None: ...
    def sources(self, tenant: str, collection: str | None = None) -> list[SourceRow]: ...
    def collections(self, tenant: str) -> list[tuple[str, int, int, int]]: ...
    def allowed_sources(
        self,
        tenant: str,
        collections: Sequence[str] = (),
        sources: Sequence[str] = (),
        tags: Sequence[str] = (),
        since: float | None = None,
    ) -> list[int]: ...
    def keyword(
        self, match: str, allowed: Sequence[int], limit: int
    ) -> list[tuple[int, float]]: ...
    def vectors(self, embedder: str) -> Iterator[tuple[int, int, bytes]]: ...
    def hits(self, chunk_ids: Sequence[int]) -> dict[int, HitRow]: ...
    def source_chunks(self, source_id: int) -> list[HitRow]: ...
    def bump(self) -> tuple[int, int]: ...
    def ensure_collection(self, tenant: str, name: str, now: float) -> int: ...
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
    ) -> tuple[int, list[int], list[int]]: ...
    def set_tags(self, source_id: int, tags: Sequence[str]) -> None: ...
    def delete_source(self, source_id: int) -> list[int]: ...
    def delete_collection(self, collection_id: int) -> list[int]: ...


@dataclass
class _Pending:
    source: str
    status: Literal["new", "changed"]
    version: str
    size: int
    rows: list[ChunkRow]
    vecs: Any  # NDArray[np.float32] | None
    tags_only: bool = False


class KnowledgeBase:
    """Documents of every tenant in one store: a SQLite file (`path`, ":memory:" for
    tests), or a store object (a `KnowledgeStore`, e.g. PostgreSQL's PgKnowledgeStore),
    which the knowledge base then owns: `close()` closes it.

    `embedder`: "auto" (recall's MiniLM when installed, else BM25 only), an Embedder,
    or None for BM25 only.
    """

    def __init__(
        self,
        path: Path | str | KnowledgeStore,
        *,
        embedder: Embedder | Literal["auto"] | None = "auto",
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        chunk_size: int = chunking.DEFAULT_SIZE,
        overlap: int = chunking.DEFAULT_OVERLAP,
    ) -> None:
        chunking.check(chunk_size, overlap)
        if max_file_bytes < 1:
            raise InvalidOption(f"max_file_bytes {max_file_bytes} must be positive")
        self._embedder = resolve_embedder(embedder)
        self.max_file_bytes = max_file_bytes
        self.chunk_size = chunk_size
        self.overlap = overlap
        self._recipe = chunking.recipe(chunk_size, overlap)
        self._store: KnowledgeStore = Store(Path(path)) if isinstance(path, (str, Path)) else path
        self._lock = threading.Lock()
        self._cache: VectorCache | None = None

    @property
    def embedder(self) -> Embedder | None:
        return self._embedder

    @property
    def path(self) -> Path | None:
        """The SQLite file; None for a store that is not a file (a database)."""
        return self._store.path

    def close(self) -> None:
        with self._lock:
            self._store.close()

    def __enter__(self) -> KnowledgeBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- ingest ------------------------------------------------------------------------

    def ingest(
        self,
        connectors: Connector | Sequence[Connector],
        *,
        tenant: str,
        collection: str,
        tags: Iterable[str] = (),
        progress: Callable[[Progress], None] | None = None,
        prune: bool = False,
    ) -> IngestSummary:
        """Ingest every document the connectors give into the tenant's collection.

        With `prune` the collection then mirrors what was given: its sources that no
        connector named (a file deleted from the folder since the last ingest) are
        removed. A source that was named but failed (unreadable, now too large) keeps
        its last good version: a passing fault never deletes knowledge."""
        _check_name("tenant", tenant)
        _check_name("collection", collection)
        tag_set = _check_tags(tags)
        if not isinstance(connectors, Sequence):
            connectors = [connectors]
        start = time.monotonic()
        summary = IngestSummary()
        # Names only: a folder of 100k files is a list of 100k short strings.
        entries: list[Document | Skipped] = [e for c in connectors for e in c.items()]
        seen: set[str] = set()
        pending: list[_Pending] = []
        pending_chunks = 0
        embedder_name = self._embedder.name if self._embedder is not None else None

        def report(current: str, result: FileResult | None = None) -> None:
            if result is not None:
                summary.files.append(result)
            if progress is not None:
                progress(
                    Progress(
                        len(summary.files),
                        len(entries),
                        summary.chunks,
                        summary.embedded,
                        time.monotonic() - start,
                        current,
                        result,
                    )
                )

        def flush() -> None:
            nonlocal pending, pending_chunks
            batch, pending, pending_chunks = pending, [], 0
            if not batch:
                return
            try:
                self._write(tenant, collection, tag_set, batch, embedder_name)
            except Exception as e:  # noqa: BLE001 - the whole batch is rolled back; say so
                log.warning("knowledge: a write batch failed and was rolled back: %s", e)
                for p in batch:
                    summary.chunks -= len(p.rows)
                    report(p.source, FileResult(p.source, "failed", 0, f"write failed: {e}"))
                return
            for p in batch:
                report(p.source, FileResult(p.source, p.status, len(p.rows)))

        given = {entry.source_id for entry in entries}
        for entry in entries:
            sid = entry.source_id
            if isinstance(entry, Skipped):
                report(sid, FileResult(sid, "failed", 0, entry.reason))
                continue
            if sid in seen or len(sid) > _MAX_SOURCE_ID:
                why = "duplicate source id in this ingest" if sid in seen else "source id too long"
                report(sid, FileResult(sid, "failed", 0, why))
                continue
            seen.add(sid)
            try:
                prepared = self._prepare(
                    entry, tenant, collection, tag_set, embedder_name, summary, report
                )
            except SkipFile as e:
                report(sid, FileResult(sid, "failed", 0, str(e)))
                continue
            if prepared is None:
                report(sid, FileResult(sid, "unchanged"))
                continue
            pending.append(prepared)
            pending_chunks += len(prepared.rows)
            if pending_chunks >= WRITE_BATCH_CHUNKS:
                flush()
        flush()
        if prune:
            for row in self.sources(tenant, collection):
                if row.source not in given:
                    try:
                        gone = self._delete(tenant, collection, row.source)
                    except NotFound:
                        continue  # removed meanwhile by another writer
                    report(row.source, FileResult(row.source, "removed", gone))
        summary.seconds = time.monotonic() - start
        return summary

    def _prepare(
        self,
        item: Document,
        tenant: str,
        collection: str,
        tags: tuple[str, ...],
        embedder_name: str | None,
        summary: IngestSummary,
        report: Callable[[str], None],
    ) -> _Pending | None:
        """Read, hash and (when changed) extract, chunk and embed one file; None when
        it is unchanged."""
        data = item.read(self.max_file_bytes)
        size = len(data)
        version = hashlib.sha256(data).hexdigest()
        with self._lock, self._store.transaction():
            cid = self._store.collection_id(tenant, collection)
            old = self._store.source(cid, item.source_id) if cid is not None else None
        if (
            old is not None
            and old.version == version
            and old.recipe == self._recipe
            # No embedder now: vectors made earlier are kept, not thrown away.
            and (old.embedder == embedder_name or embedder_name is None)
        ):
            if old.tags == tags:
                return None
            return _Pending(item.source_id, "changed", version, size, [], None, True)
        doc = extract(data, item.kind, max_chars=self.max_file_bytes)
        del data
        chunks = chunking.chunk(doc, self.chunk_size, self.overlap)
        if not chunks:
            raise SkipFile("no text in it")
        contexts = [c.context() for c in chunks]
        vecs = None
        if self._embedder is not None:
            import numpy as np

            parts = []
            for i in range(0, len(contexts), EMBED_SLICE):
                parts.append(self._embedder.embed(contexts[i : i + EMBED_SLICE]))
                summary.embedded += len(parts[-1])
                report(item.source_id)
            vecs = _unit(np.concatenate(parts).astype(np.float32, copy=False))
        rows = [
            ChunkRow(
                c.index,
                c.headings,
                c.text,
                " ".join(analyze(ctx)),
                None if vecs is None else vecs[i].tobytes(),
            )
            for i, (c, ctx) in enumerate(zip(chunks, contexts, strict=True))
        ]
        summary.chunks += len(rows)
        return _Pending(
            item.source_id, "new" if old is None else "changed", version, size, rows, vecs
        )

    def _write(
        self,
        tenant: str,
        collection: str,
        tags: tuple[str, ...],
        batch: list[_Pending],
        embedder_name: str | None,
    ) -> None:
        now = time.time()
        changes: list[tuple[int, list[int], list[int], Any]] = []
        with self._lock:
            with self._store.transaction(write=True):
                old_gen, new_gen = self._store.bump()
                cid = self._store.ensure_collection(tenant, collection, now)
                for p in batch:
                    if p.tags_only:
                        row = self._store.source(cid, p.source)
                        if row is not None:
                            self._store.set_tags(row.id, tags)
                        continue
                    sid, removed, added = self._store.replace_source(
                        cid,
                        p.source,
                        version=p.version,
                        recipe=self._recipe,
                        embedder=embedder_name,
                        tags=tags,
                        size=p.size,
                        chunks=p.rows,
                        now=now,
                    )
                    changes.append((sid, removed, added, p.vecs))
            # Committed: bring the cache to the same generation while still holding
            # the lock, so no search sees one without the other.
            cache = self._cache
            if cache is None:
                return
            if cache.generation != old_gen:
                self._cache = None  # another process wrote meanwhile: reload on demand
                return
            for sid, removed, added, vecs in changes:
                for chunk_id in removed:
                    cache.drop(chunk_id)
                if vecs is not None:
                    for chunk_id, vec in zip(added, vecs, strict=True):
                        cache.put(chunk_id, vec, sid)
            cache.generation = new_gen

    # --- delete --------------------------------------------------------------------------

    def delete_source(self, tenant: str, collection: str, source: str) -> int:
        """Remove one source; returns how many chunks went. NotFound if absent."""
        _check_name("tenant", tenant)
        _check_name("collection", collection)
        return self._delete(tenant, collection, source)

    def delete_collection(self, tenant: str, collection: str) -> int:
        """Remove a collection and all its sources; returns how many chunks went."""
        _check_name("tenant", tenant)
        _check_name("collection", collection)
        return self._delete(tenant, collection, None)

    def _delete(self, tenant: str, collection: str, source: str | None) -> int:
        with self._lock:
            with self._store.transaction(write=True):
                cid = self._store.collection_id(tenant, collection)
                if cid is None:
                    raise NotFound(f"no collection {collection!r} for tenant {tenant!r}")
                if source is None:
                    removed = self._store.delete_collection(cid)
                else:
                    row = self._store.source(cid, source)
                    if row is None:
                        raise NotFound(f"no source {source!r} in collection {collection!r}")
                    removed = self._store.delete_source(row.id)
                old_gen, new_gen = self._store.bump()
            cache = self._cache
            if cache is not None:
                if cache.generation != old_gen:
                    self._cache = None
                else:
                    for chunk_id in removed:
                        cache.drop(chunk_id)
                    cache.generation = new_gen
        return len(removed)

    # --- read ----------------------------------------------------------------------------

    def collections(self, tenant: str) -> list[CollectionInfo]:
        _check_name("tenant", tenant)
        with self._lock, self._store.transaction():
            return [CollectionInfo(*row) for row in self._store.collections(tenant)]

    def sources(self, tenant: str, collection: str | None = None) -> list[SourceRow]:
        _check_name("tenant", tenant)
        if collection is not None:
            _check_name("collection", collection)
        with self._lock, self._store.transaction():
            return self._store.sources(tenant, collection)

    def show(self, tenant: str, collection: str, source: str) -> tuple[SourceRow, list[HitRow]]:
        """A source as stored: its row (version, tags, chunks, when) and its chunks in
        order, each with its heading path and text. NotFound if absent."""
        _check_name("tenant", tenant)
        _check_name("collection", collection)
        with self._lock, self._store.transaction():
            cid = self._store.collection_id(tenant, collection)
            row = self._store.source(cid, source) if cid is not None else None
            if row is None:
                raise NotFound(f"no source {source!r} in collection {collection!r}")
            return row, self._store.source_chunks(row.id)

    def retrieve(
        self,
        tenant: str,
        query: str,
        *,
        k: int = 5,
        # Hybrid by the quality table (DESIGN "Knowledge"): at the default chunking it
        # leads dense and BM25 in MRR@10 (0.617, 0.615, 0.538), hit@5 (0.825, 0.797,
        # 0.689) and answers within 8,000 characters (0.939, 0.929, 0.788).
        mode: Mode = "hybrid",
        collections: Sequence[str] = (),
        sources: Sequence[str] = (),
        tags: Sequence[str] = (),
        max_chars: int = DEFAULT_MAX_CHARS,
        max_age_s: float | None = None,
    ) -> Retrieval:
        """The best `k` chunks of the tenant's documents for `query`, best first, with
        at most `max_chars` characters of text in all (the last hit cut to fit); with
        `max_age_s`, only from sources whose current version was ingested that recently
        (a board's readings of the last week; an unchanged re-ingest keeps the age)."""
        _check_name("tenant", tenant)
        for c in collections:
            _check_name("collection", c)
        tag_set = _check_tags(tags)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
            raise InvalidK(f"k {k!r} is outside 1..{MAX_K}")
        if mode not in MODES:
            raise InvalidOption(f"mode {mode!r}: one of {', '.join(MODES)}")
        if not isinstance(max_chars, int) or not 1 <= max_chars <= MAX_CHARS_LIMIT:
            raise InvalidOption(f"max_chars {max_chars!r} is outside 1..{MAX_CHARS_LIMIT:,}")
        if max_age_s is not None and (
            isinstance(max_age_s, bool) or not isinstance(max_age_s, (int, float)) or max_age_s <= 0
        ):
            raise InvalidOption(f"max_age_s {max_age_s!r} must be a positive number of seconds")
        since = None if max_age_s is None else time.time() - max_age_s
        if len(query) > MAX_QUERY_CHARS:
            raise QueryTooLarge(
                f"query of {len(query):,} characters: at most {MAX_QUERY_CHARS:,} (it is "
                "refused, not cut; ask a shorter question)"
            )
        if not query.strip():
            raise InvalidOption("empty query")
        used: Mode = mode
        note = ""
        if mode != "keyword" and self._embedder is None:
            used, note = "keyword", "no embedder installed: ranked by BM25"
        qvec = None
        if used != "keyword" and self._embedder is not None:
            qvec = _unit(self._embedder.embed([query]))[0]
        terms = dict.fromkeys(analyze(query)) if used != "dense" else {}
        match = " OR ".join(f'"{t}"' for t in terms)
        # Hybrid fuses two candidate lists deeper than k, so a chunk second in both
        # can beat one first in only one.
        depth = k if used != "hybrid" else max(2 * k, 50)
        with self._lock, self._store.transaction():
            allowed = self._store.allowed_sources(tenant, collections, sources, tag_set, since)
            dense: list[tuple[int, float]] = []
            keyword: list[tuple[int, float]] = []
            if qvec is not None and allowed:
                dense = self._current_cache().search(qvec, allowed, depth)
            if match and allowed:
                keyword = self._store.keyword(match, allowed, depth)
            if used == "dense":
                ranked = dense
            elif used == "keyword":
                ranked = keyword
            else:
                ranked = _fuse(dense, keyword)[:k]
            rows = self._store.hits([cid for cid, _ in ranked])
        hits: list[Hit] = []
        budget = max_chars
        for chunk_id, score in ranked:
            row = rows[chunk_id]
            text, cut = row.text, False
            if len(text) > budget:
                text, cut = text[:budget], True
            hits.append(
                Hit(
                    row.collection,
                    row.source,
                    row.version,
                    row.index,
                    row.headings,
                    score,
                    text,
                    row.tags,
                    cut,
                )
            )
            budget -= len(text)
            if budget <= 0:
                break
        return Retrieval(hits, used, note)

    def _current_cache(self) -> VectorCache:
        # Called under the lock, inside the search's read transaction: a cache built
        # here is built from the same snapshot the search reads.
        assert self._embedder is not None
        generation = self._store.generation()
        cache = self._cache
        if cache is None or cache.generation != generation:
            cache = VectorCache(self._embedder.dim, generation)
            for chunk_id, source_id, vec in self._store.vectors(self._embedder.name):
                cache.put(chunk_id, vec, source_id)
            self._cache = cache
        return cache


def _fuse(*lists: list[tuple[int, float]]) -> list[tuple[int, float]]:
    scores: dict[int, float] = {}
    for ranked in lists:
        for rank, (chunk_id, _) in enumerate(ranked, start=1):
            scores[chunk_id] = scores.get(chunk_id, 0.0) + 1.0 / (RRF_K + rank)
    return sorted(scores.items(), key=lambda item: (-item[1], item[0]))


def _unit(vecs: NDArray[np.float32]) -> NDArray[np.float32]:
    # A pluggable embedder need not normalise; the cache's dot product assumes it.
    import numpy as np

    vecs = np.asarray(vecs, dtype=np.float32)
    out: NDArray[np.float32] = vecs / np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)
    return out
