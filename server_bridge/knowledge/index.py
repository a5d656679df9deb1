"""Dense ranking: the chunks' vectors in memory, kept equal to the store's.

The embedder is memory recall's (`recall.default_embedder()`: MiniLM-L6 int8 on
onnxruntime, verified by sha256, loaded once per process and shared with recall), so
the bridge holds one model, and the knowledge side follows recall's model pin. When
it is absent the knowledge base ranks by BM25 alone and says so in one logged line.

The vectors also live in the store (float32 bytes per chunk), so a restart or another
process costs a reload (about 0.1 s per 10k chunks, bench_knowledge), never a
re-embed. This cache is the matrix the search multiplies: one float32 row per chunk,
with each row's source id beside it for the tenant and filter mask. It is stamped
with the store generation it matches; the service changes it only under the lock it
commits under, so a search sees the cache and the store at one generation, and a
write made by another process (a generation this cache did not make) makes the next
search reload it from its own snapshot.

Exact search, as in recall: a matrix-vector product over at most a few 100k rows is
milliseconds, and an approximate index would cost recall and a dependency. Memory is
1.5 kB per chunk (384 float32): 150 MB at 100k chunks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from server_bridge.memory.recall import Embedder, default_embedder

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

__all__ = ["VectorCache", "resolve_embedder"]

log = logging.getLogger("wren.bridge.knowledge")


def resolve_embedder(embedder: Embedder | Literal["auto"] | None) -> Embedder | None:
    """"auto": recall's default embedder, or None with one logged line."""
    if embedder != "auto":
        return embedder
    found = default_embedder()
    if found is None:
        log.info("knowledge: no embedder installed: dense and hybrid search rank by BM25")
    return found


class VectorCache:
    """Unit vectors by chunk id; a removed row is filled by the last one."""

    def __init__(self, dim: int, generation: int) -> None:
        import numpy as np

        self.np = np
        self.generation = generation
        self.mat = np.zeros((256, dim), dtype=np.float32)
        self.src = np.zeros(256, dtype=np.int64)
        self.ids: list[int] = []
        self.row: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, chunk_id: int, source_id: int, vec: bytes | NDArray[np.float32]) -> None:
        np = self.np
        r = len(self.ids)
        if r == len(self.mat):
            # Doubling keeps appends amortised O(dim).
            grown = np.zeros((2 * r, self.mat.shape[1]), dtype=np.float32)
            grown[:r] = self.mat
            self.mat = grown
            src = np.zeros(2 * r, dtype=np.int64)
            src[:r] = self.src
            self.src = src
        self.mat[r] = np.frombuffer(vec, dtype=np.float32) if isinstance(vec, bytes) else vec
        self.src[r] = source_id
        self.ids.append(chunk_id)
        self.row[chunk_id] = r

    def remove(self, chunk_ids: Iterable[int]) -> None:
        for chunk_id in chunk_ids:
            r = self.row.pop(chunk_id, None)
            if r is None:
                continue
            last = len(self.ids) - 1
            if r != last:
                moved = self.ids[last]
                self.mat[r] = self.mat[last]
                self.src[r] = self.src[last]
                self.ids[r] = moved
                self.row[moved] = r
            self.ids.pop()

    def search(
        self, query: NDArray[np.float32], allowed: Iterable[int], k: int
    ) -> list[tuple[int, float]]:
        """The best `k` rows among the allowed sources' chunks: (chunk id, cosine)."""
        np = self.np
        n = len(self.ids)
        allowed_arr = np.fromiter(allowed, dtype=np.int64)
        if not n or not len(allowed_arr):
            return []
        sims = self.mat[:n] @ query
        mask = np.isin(self.src[:n], allowed_arr)
        sims = np.where(mask, sims, -np.inf)
        count = int(mask.sum())
        take = min(k, count)
        if not take:
            return []
        rows: Any = np.argpartition(-sims, take - 1)[:take] if take < n else np.arange(n)
        ranked = sorted(
            ((self.ids[r], float(sims[r])) for r in rows.tolist() if mask[r]),
            key=lambda item: (-item[1], item[0]),
        )
        return ranked[:take]
