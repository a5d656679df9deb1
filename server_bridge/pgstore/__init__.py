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

from server_bridge.pgstore.connect import PgUnavailable, connect, open_pool
from server_bridge.pgstore.migrate import MigrationError, applied, apply

__all__ = ["MigrationError", "PgUnavailable", "applied", "apply", "connect", "open_pool"]
