"""Unit vectors by id in one float32 matrix, searched exactly: the bridge's one vector
index, under memory recall (`memory/recall.py`, ids are document ids) and document
knowledge (`knowledge/index.py`, ids are chunk ids, grouped by source).

Here, beside the packages that use it and in neither, because it is neither's: it knows
vectors and ids, nothing of fields, tenants, sources or stores. What may be returned is
its callers' rule: recall filters the ranked ids by each document's meta (`top`, in
windows), and knowledge, whose filters come down to a set of source ids, gives each row
a group (`grouped=True`) and searches only the rows of the groups allowed (`search`).

Rows stay dense: a removed row is filled by the last one, so the matrix product runs
over `len(self)` rows and nothing else, and the matrix doubles when full (appends stay
amortised O(dim)). Memory is 1.5 kB per row at 384 float32 dimensions (150 MB at 100k
rows), plus 8 bytes for a group. Exact, not an approximate index: at these sizes the
product is milliseconds (benchmarks/bench_recall.py, bench_knowledge.py), and an ANN
library would cost recall and a dependency.

Not thread-safe: each caller holds its own lock around every call (recall its index's,
knowledge the lock it commits under). Nothing imports numpy until a Vectors is made.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

__all__ = ["Vectors"]

#: A row's id: recall's document ids are strings, knowledge's chunk ids integers.
Key = TypeVar("Key", str, int)

# Rows a new matrix has room for; it doubles from there.
_FIRST_ROWS = 64


class Vectors(Generic[Key]):
    """Unit vectors by id, each row optionally in a group (an int64 column)."""

    def __init__(self, dim: int, *, grouped: bool = False) -> None:
        import numpy as np

        self.np = np
        self.mat = np.zeros((_FIRST_ROWS, dim), dtype=np.float32)
        self.group = np.zeros(_FIRST_ROWS, dtype=np.int64) if grouped else None
        self.ids: list[Key] = []
        self.row: dict[Key, int] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def put(self, key: Key, vec: bytes | NDArray[np.float32], group: int = 0) -> None:
        """Set `key`'s vector (float32 bytes, as a store keeps them, or an array) and,
        in a grouped index, its group; a new key takes the next row."""
        np = self.np
        r = self.row.get(key)
        if r is None:
            r = len(self.ids)
            if r == len(self.mat):
                grown = np.zeros((2 * r, self.mat.shape[1]), dtype=np.float32)
                grown[:r] = self.mat
                self.mat = grown
                if self.group is not None:
                    groups = np.zeros(2 * r, dtype=np.int64)
                    groups[:r] = self.group
                    self.group = groups
            self.ids.append(key)
            self.row[key] = r
        self.mat[r] = np.frombuffer(vec, dtype=np.float32) if isinstance(vec, bytes) else vec
        if self.group is not None:
            self.group[r] = group

    def drop(self, key: Key) -> None:
        """Forget `key` (nothing happens if it has no row)."""
        r = self.row.pop(key, None)
        if r is None:
            return
        last = len(self.ids) - 1
        if r != last:
            moved = self.ids[last]
            self.mat[r] = self.mat[last]
            if self.group is not None:
                self.group[r] = self.group[last]
            self.ids[r] = moved
            self.row[moved] = r
        self.ids.pop()

    def scores(self, query: NDArray[np.float32]) -> NDArray[np.float32]:
        """Every row's cosine with the unit vector `query`, in row order."""
        sims: NDArray[np.float32] = self.mat[: len(self.ids)] @ query
        return sims

    def top(self, sims: NDArray[np.float32], n: int) -> list[tuple[Key, float]]:
        """The `n` best rows of `sims` (a `scores` answer, perhaps masked) as (id,
        score), best first, ties by id so a ranking never depends on row order."""
        total = len(self.ids)
        n = min(n, total)
        if n <= 0:
            return []
        np = self.np
        rows: Any = np.argpartition(-sims, n - 1)[:n] if n < total else np.arange(total)
        return sorted(
            ((self.ids[r], float(sims[r])) for r in rows.tolist()),
            key=lambda item: (-item[1], item[0]),
        )

    def search(
        self, query: NDArray[np.float32], groups: Iterable[int], k: int
    ) -> list[tuple[Key, float]]:
        """The best `k` rows of the given groups (a grouped index), best first."""
        if self.group is None:
            raise TypeError("search by group needs Vectors(..., grouped=True)")
        np = self.np
        n = len(self.ids)
        allowed = np.fromiter(groups, dtype=np.int64)
        if not n or not len(allowed):
            return []
        mask = np.isin(self.group[:n], allowed)
        take = min(k, int(mask.sum()))
        if not take:
            return []
        # The other groups' rows can never rank: at least `take` allowed rows beat them.
        return self.top(np.where(mask, self.scores(query), -np.inf), take)
