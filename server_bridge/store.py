"""TinyDB behind a storage that survives a crash mid-write.

TinyDB rewrites its whole file on every write. Its stock JSONStorage truncates the file
and writes in place, so a crash (or a serialization error) halfway leaves a torn file
and the database is gone. `AtomicJSONStorage` serializes everything in memory first,
writes a temporary file in the same directory, fsyncs it, renames it over the old file
(atomic on POSIX within one file system) and fsyncs the directory so the rename itself
is durable. At every instant the path holds either the complete old or the complete new
document.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from tinydb import TinyDB
from tinydb.storages import Storage

__all__ = ["SETTLE_NS", "AtomicJSONStorage", "FileVersion", "open_db", "parse_document", "settled"]


def _fsync_dir(directory: Path) -> None:
    # Without this the rename can be lost on power failure even though the data blocks
    # were synced. Not every platform can open a directory (Windows); there the rename
    # is as durable as the OS makes it.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class FileVersion(NamedTuple):
    """What `stat` says about the file behind a path: which file, when written, how long.

    Writers here never change a file in place, they rename a new one over it, so a new
    version normally differs in `ino`. The inode number alone is not enough: once the
    old file is unlinked its number is free, and ext4 hands it to the very next temporary
    file (seen on the bridge's host: write A, write B, write A' gave A' the inode of A).
    Then `mtime_ns` must tell the two apart, which it does only once the file system's
    clock has moved on; see `settled`.
    """

    ino: int
    mtime_ns: int
    size: int


# How far the clock must have moved past a file's mtime before that mtime can no longer be
# given to a later write. Linux stamps files from a clock that ticks every 1-10 ms, FAT
# keeps 2 s; 2 s covers both, and costs only a re-read per lookup in the 2 s after a write.
SETTLE_NS = 2_000_000_000


def settled(version: FileVersion, seen_at_ns: int) -> bool:
    """Whether `version`, observed at wall-clock `seen_at_ns`, identifies its bytes.

    True once the clock is past the mtime by `SETTLE_NS`: any later write then gets a
    later mtime, so a file with the same (ino, mtime, size) is this very file. Before
    that, a reused inode written within the same clock tick at the same size would carry
    the same version with other bytes, and only reading the file tells.
    """
    return seen_at_ns - version.mtime_ns > SETTLE_NS


class AtomicJSONStorage(Storage):
    """A TinyDB storage writing JSON by temp file + fsync + rename.

    `read` parses the file every time: a cache belongs to whoever knows what it keeps
    (the registry keeps parsed records, keyed by `FileVersion`), and TinyDB mutates what
    `read` returns before it calls `write`, so a shared parsed copy would be corrupted.
    """

    def __init__(self, path: str | os.PathLike[str], create_dirs: bool = True, **json_kw: Any):
        self.path = Path(path)
        if create_dirs:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._json_kw = json_kw

    def version(self) -> FileVersion | None:
        """The version of the file at the path now (one stat), or None when there is none."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return FileVersion(st.st_ino, st.st_mtime_ns, st.st_size)

    def read_bytes(self) -> tuple[FileVersion, bytes] | None:
        """The file's bytes with the version of exactly those bytes, or None when absent.

        The version comes from `fstat` on the open file, not a separate `stat` of the
        path: a rename between the two would pair the old bytes with the new version,
        and a cache keyed by it would keep the old bytes for good.
        """
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return None
        with f:
            st = os.fstat(f.fileno())
            data = f.read()
        return FileVersion(st.st_ino, st.st_mtime_ns, st.st_size), data

    def read(self) -> dict[str, dict[str, Any]] | None:
        got = self.read_bytes()
        return None if got is None else parse_document(got[1], self.path)

    def write(self, data: dict[str, dict[str, Any]]) -> None:
        # Serialize completely before touching the disk: an unserializable value fails
        # here and the file on disk is untouched.
        text = json.dumps(data, **self._json_kw)
        fd, tmp = tempfile.mkstemp(
            prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent
        )
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            # The old file is intact; only the partial temporary goes.
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        _fsync_dir(self.path.parent)

    def close(self) -> None:
        pass


def parse_document(data: bytes, path: str | os.PathLike[str]) -> dict[str, dict[str, Any]] | None:
    """A TinyDB document from a file's bytes: None when blank, ValueError when corrupt.

    A corrupt file raises on purpose: silently starting empty would lose the registry.
    """
    if not data.strip():
        return None
    doc = json.loads(data)
    if not isinstance(doc, dict):
        raise ValueError(f"{path} does not hold a TinyDB document")
    return doc


def open_db(path: str | os.PathLike[str]) -> TinyDB:
    """Open (or create) a TinyDB file on the crash-safe storage."""
    return TinyDB(path, storage=AtomicJSONStorage)
