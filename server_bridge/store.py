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
import threading
from pathlib import Path
from typing import Any

from tinydb import TinyDB
from tinydb.storages import Storage

__all__ = ["AtomicJSONStorage", "open_db"]


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


class AtomicJSONStorage(Storage):
    """A TinyDB storage writing JSON by temp file + fsync + rename."""

    def __init__(self, path: str | os.PathLike[str], create_dirs: bool = True, **json_kw: Any):
        self.path = Path(path)
        if create_dirs:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._json_kw = json_kw
        # Cache of the file's text keyed by its identity: reads on the hot path (every
        # message looks up its device) skip the disk while the file is unchanged, and a
        # write by another process (os.replace gives a new inode) is still seen.
        self._cached: tuple[tuple[int, int, int], str] | None = None
        self._lock = threading.Lock()

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def read(self) -> dict[str, dict[str, Any]] | None:
        with self._lock:
            sig = self._signature()
            if sig is None:
                return None
            if self._cached is not None and self._cached[0] == sig:
                text = self._cached[1]
            else:
                text = self.path.read_text(encoding="utf-8")
                self._cached = (sig, text)
        if not text.strip():
            return None
        # A fresh parse every time: TinyDB mutates what read() returns before calling
        # write(), and a failed write must not leave the cache holding the new data.
        # A corrupt file raises here on purpose — silently starting empty would lose
        # the registry.
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"{self.path} does not hold a TinyDB document")
        return data

    def write(self, data: dict[str, dict[str, Any]]) -> None:
        # Serialize completely before touching the disk: an unserializable value fails
        # here and the file on disk is untouched.
        text = json.dumps(data, **self._json_kw)
        with self._lock:
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
            sig = self._signature()
            self._cached = (sig, text) if sig is not None else None

    def close(self) -> None:
        with self._lock:
            self._cached = None


def open_db(path: str | os.PathLike[str]) -> TinyDB:
    """Open (or create) a TinyDB file on the crash-safe storage."""
    return TinyDB(path, storage=AtomicJSONStorage)
