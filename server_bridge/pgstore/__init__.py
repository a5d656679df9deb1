"""The store on PostgreSQL (DESIGN "Where scale goes"): what several bridges share.

One database holds what the single-process default keeps in TinyDB files, log segments
and SQLite: memory (`memory.py`), the partitions' leases, and later the registry, the
event log and knowledge. Each backend implements the interface its embedded
counterpart does, so the same tests run against both. The schema is numbered SQL files
in `migrations/`, applied at start by `migrate.apply` (once, under an advisory lock,
whatever number of bridges start together).

psycopg is imported here only: a bridge without PostgreSQL never loads it.
"""

from __future__ import annotations

from pathlib import Path

from server_bridge.pgstore.connect import PgUnavailable, connect, describe, open_pool
from server_bridge.pgstore.migrate import MigrationError, applied, apply

__all__ = [
    "MigrationError",
    "PgUnavailable",
    "applied",
    "apply",
    "connect",
    "describe",
    "is_dsn",
    "location",
    "open_pool",
]

_SCHEMES = ("postgresql://", "postgres://")


def is_dsn(text: object) -> bool:
    """Whether a store option names a PostgreSQL database (a `postgresql://` URL)
    rather than a file."""
    return isinstance(text, str) and text.startswith(_SCHEMES)


def location(text: str) -> Path | str:
    """An argparse type for a store option (`--registry`, `--store`): a PostgreSQL URL
    stays the string it is (a Path would fold its `//`), anything else is a file."""
    return text if is_dsn(text) else Path(text)

