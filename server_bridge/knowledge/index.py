"""Dense ranking: the chunks' vectors in memory, kept equal to the store's.

The embedder is memory recall's (`recall.default_embedder()`: MiniLM-L6 int8 on
onnxruntime, verified by sha256, loaded once per process and shared with recall), so
the bridge holds one model, and the knowledge side follows recall's model pin. When
it is absent the knowledge base ranks by BM25 alone and says so in one logged line.

The vectors also live in the store (float32 bytes per chunk), so a restart or another
process costs a reload (about 0.1 s per 10k chunks, bench_knowledge), never a
re-embed. This cache is the matrix the search multiplies: recall's index
(`server_bridge/vectors.py`, one float32 row per chunk), with each row's source id as
its group for the tenant and filter mask. It is stamped with the store generation it
matches; the service changes it only under the lock it commits under, so a search sees
the cache and the store at one generation, and a write made by another process (a
generation this cache did not make) makes the next search reload it from its own
snapshot.

Exact search, as in recall: a matrix-vector product over at most a few 100k rows is
milliseconds, and an approximate index would cost recall and a dependency. Memory is
1.5 kB per chunk (384 float32): 150 MB at 100k chunks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal

from server_bridge.memory.recall import Embedder, default_embedder
from server_bridge.vectors import Vectors

if TYPE_CHECKING:
    pass

__all__ = ["VectorCache", "resolve_embedder"]

log = logging.getLogger("wren.bridge.knowledge")


def resolve_embedder(embedder: Embedder | Literal["auto"] | None) -> Embedder | None:
    """For "auto", recall's default embedder, or None with one logged line."""
    if embedder != "auto":
        return embedder
    found = default_embedder()
    if found is None:
        log.info("knowledge: no embedder installed: dense and hybrid search rank by BM25")
    return found


class VectorCache(Vectors[int]):
    """Unit vectors by chunk id, grouped by source id, at one store generation."""

    def __init__(self, dim: int, generation: int) -> None:
        super().__init__(dim, grouped=True)
        self.generation = generation
