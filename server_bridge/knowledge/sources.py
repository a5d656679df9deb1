"""Where documents come from: connectors behind one small interface.

A connector yields `Item`s (a source id and a way to read the bytes within a size
limit) and `Skipped` entries (a source id and the reason it will not be read: a
symlink that leads outside the folder, an unsupported extension). Ingest reads each
item once, so a connector may stream: nothing here lists or holds more than names.

Source ids are paths relative to the root the caller gave, with `/` separators, so the
same file ingested again, from any working directory, is the same source.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .errors import SkipFile

__all__ = [
    "DEFAULT_EXTENSIONS",
    "Connector",
    "FileList",
    "Folder",
    "Item",
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


class Connector(Protocol):
    """A source of documents: `items()` yields what to ingest and what was skipped."""

    def items(self) -> Iterator[Item | Skipped]: ...


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
