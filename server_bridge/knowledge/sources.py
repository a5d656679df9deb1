"""Where documents come from: connectors behind one small interface.

A connector yields documents (a source id, a kind, and a way to read the bytes within
a size limit: an `Item`, a file; a `Record`, text already in hand, such as a database
row) and `Skipped` entries (a source id and the reason it will not be read: a symlink
that leads outside the folder, an unsupported extension, a row with no text). Ingest
reads each once, so a connector may stream: `Folder` and `FileList` hold only names,
and `Query` reads its rows from the cursor a batch at a time.

Source ids are paths relative to the root the caller gave, with `/` separators, so the
same file ingested again, from any working directory, is the same source.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .errors import SkipFile

__all__ = [
    "DEFAULT_EXTENSIONS",
    "Connector",
    "Document",
    "FileList",
    "Folder",
    "Item",
    "Query",
    "Record",
    "Records",
    "Skipped",
    "read_limited",
]

#: What a folder ingest picks up; other files in the folder are passed over silently.
DEFAULT_EXTENSIONS = frozenset({".txt", ".text", ".md", ".markdown", ".html", ".htm", ".pdf"})


@dataclass(frozen=True)
class Item:
    """One document to read. `path` is the real file (symlinks resolved)."""

    source_id: str
    path: Path

    @property
    def kind(self) -> str:
        return self.path.suffix.lower()

    def read(self, limit: int) -> bytes:
        return read_limited(self.path, limit)


@dataclass(frozen=True)
class Skipped:
    """A document the connector will not hand over, and why."""

    source_id: str
    reason: str


@dataclass(frozen=True)
class Record:
    """A document whose text the connector already holds (a database row). `kind` is
    how to read it, as a file's extension says: `.txt` or `.md`."""

    source_id: str
    text: str
    kind: str = ".txt"

    def read(self, limit: int) -> bytes:
        data = self.text.encode("utf-8")
        if len(data) > limit:
            raise SkipFile(f"over the size limit ({_mb(len(data))} > {_mb(limit)})")
        return data


# What ingest reads: a file, or text in hand.
Document = Item | Record


class Connector(Protocol):
    """A source of documents: `items()` yields what to ingest and what was skipped."""

    def items(self) -> Iterator[Document | Skipped]: ...


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def read_limited(path: Path, limit: int) -> bytes:
    """The file's bytes, refusing one over `limit` before reading it (and reading at most
    limit + 1 bytes, should it grow meanwhile): memory stays bounded by the file's size
    and the limit."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise SkipFile(f"over the size limit ({_mb(size)} > {_mb(limit)})")
            # read(n) allocates n bytes before it reads: ask for the file's size (and
            # one more, to notice growth), not the limit, or every small file would cost
            # a limit-sized buffer (measured: 20 MB peak for a 4-byte file).
            data = f.read(size + 1)
            if len(data) > size and len(data) <= limit:
                data += f.read(limit + 1 - len(data))
    except OSError as e:
        raise SkipFile(f"cannot read: {e.strerror or e}") from e
    if len(data) > limit:
        raise SkipFile(f"over the size limit (more than {_mb(limit)})")
    return data


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


class Folder:
    """Every file under `root` (recursively) whose extension is in `extensions`.

    A symlink is followed only when its target is inside the folder too; one that
    leads outside is skipped with that reason (a folder of notes must not become a
    way to read the rest of the disk). Symlinked directories are not descended into:
    their files inside the folder are reached by their real path, and following them
    could loop.
    """

    def __init__(self, root: Path, extensions: Iterable[str] = DEFAULT_EXTENSIONS) -> None:
        self.root = Path(root)
        self.extensions = frozenset(e.lower() for e in extensions)

    def items(self) -> Iterator[Item | Skipped]:
        real_root = self.root.resolve()
        if not real_root.is_dir():
            yield Skipped(str(self.root), "not a folder")
            return
        for dirpath, dirnames, filenames in os.walk(real_root):
            # Sorted: the same folder is ingested in the same order each time.
            dirnames.sort()
            here = Path(dirpath)
            for name in list(dirnames):
                p = here / name
                if p.is_symlink():
                    dirnames.remove(name)
                    rel = p.relative_to(real_root).as_posix()
                    if not _inside(p.resolve(), real_root):
                        yield Skipped(rel, "symlink leads outside the folder")
            for name in sorted(filenames):
                p = here / name
                rel = p.relative_to(real_root).as_posix()
                if p.suffix.lower() not in self.extensions:
                    continue
                target = p.resolve()
                if not _inside(target, real_root):
                    yield Skipped(rel, "symlink leads outside the folder")
                    continue
                if not target.is_file():
                    yield Skipped(rel, "not a regular file")
                    continue
                yield Item(rel, target)


@dataclass(frozen=True)
class Records:
    """Documents whose text is in hand: a board's `kb.add`, a host's put over HTTP."""

    records: Sequence[Record]

    def items(self) -> Iterator[Record]:
        yield from self.records


class FileList:
    """The given files, each with its id relative to `root` (default: its own folder,
    so the id is its name). A file not under `root` is skipped."""

    def __init__(
        self,
        paths: Iterable[Path],
        root: Path | None = None,
        extensions: Iterable[str] = DEFAULT_EXTENSIONS,
    ) -> None:
        self.paths = [Path(p) for p in paths]
        self.root = root
        self.extensions = frozenset(e.lower() for e in extensions)

    def items(self) -> Iterator[Item | Skipped]:
        for p in self.paths:
            root = (self.root if self.root is not None else p.absolute().parent).absolute()
            try:
                rel = p.absolute().relative_to(root).as_posix()
            except ValueError:
                yield Skipped(str(p), f"not under the root {root}")
                continue
            if p.suffix.lower() not in self.extensions:
                yield Skipped(rel, f"unsupported extension {p.suffix or '(none)'!r}")
                continue
            target = p.resolve()
            if self.root is not None and not _inside(target, root.resolve()):
                yield Skipped(rel, "symlink leads outside the folder")
                continue
            if not target.is_file():
                yield Skipped(rel, "not a file" if target.exists() else "no such file")
                continue
            yield Item(rel, target)


class Query:
    """The rows of a database query, one document each: a DB-API 2 connection (the
    standard library's `sqlite3`, or a driver the user has, such as psycopg for
    PostgreSQL), a query and its parameters, the column holding each row's id (its
    source id, with `prefix` before it) and the columns of its text, joined by blank
    lines. With `title_column` the row reads as Markdown under that heading, so its
    chunks keep it as their heading path.

    The query runs when ingest asks for the items, and its rows are read from the
    cursor `batch` at a time. A row whose id is empty or whose text is empty is skipped
    with that reason. Re-ingesting the same query is an update by row: a changed row
    replaces its chunks, an unchanged one costs a hash, and `prune` removes the rows
    the query no longer returns.
    """

    def __init__(
        self,
        connection: Any,
        sql: str,
        params: Sequence[Any] = (),
        *,
        id_column: str = "id",
        text_columns: Sequence[str] = ("text",),
        title_column: str | None = None,
        prefix: str = "",
        batch: int = 500,
    ) -> None:
        if not text_columns:
            raise ValueError("a Query needs at least one text column")
        self.connection = connection
        self.sql = sql
        self.params = tuple(params)
        self.id_column = id_column
        self.text_columns = tuple(text_columns)
        self.title_column = title_column
        self.prefix = prefix
        self.batch = max(1, batch)

    def items(self) -> Iterator[Document | Skipped]:
        cursor = self.connection.cursor()
        try:
            cursor.execute(self.sql, self.params)
            names = [d[0] for d in cursor.description or ()]
            wanted = [self.id_column, *self.text_columns]
            if self.title_column is not None:
                wanted.append(self.title_column)
            missing = [c for c in wanted if c not in names]
            if missing:
                yield Skipped(self.sql[:80], f"the query has no column {', '.join(missing)}")
                return
            at = {name: i for i, name in enumerate(names)}
            while rows := cursor.fetchmany(self.batch):
                for row in rows:
                    yield self._document(row, at)
        finally:
            cursor.close()

    def _document(self, row: Sequence[Any], at: dict[str, int]) -> Document | Skipped:
        key = row[at[self.id_column]]
        sid = f"{self.prefix}{'' if key is None else key}"
        if key is None or str(key) == "":
            return Skipped(sid or "(no id)", "the row has no id")
        parts = [str(row[at[c]]) for c in self.text_columns if row[at[c]] not in (None, "")]
        text = "\n\n".join(p for p in parts if p.strip())
        if not text:
            return Skipped(sid, "the row has no text")
        if self.title_column is None:
            return Record(sid, text)
        title = row[at[self.title_column]]
        if title in (None, ""):
            return Record(sid, text, ".md")
        return Record(sid, f"# {str(title).strip()}\n\n{text}", ".md")
