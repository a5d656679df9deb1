"""Connections to the shared database: one for a caller that needs its own, a pool for
the bridge's threads. psycopg is imported lazily, so its absence is a named error."""

from __future__ import annotations

from typing import Any

__all__ = ["PgUnavailable", "connect", "open_pool"]

# A bridge's threads that touch the store at once: the network thread's seeds, the
# RPC workers, the lease keeper. More would queue in the pool, not fail.
POOL_MAX = 16
CONNECT_TIMEOUT_S = 5


class PgUnavailable(RuntimeError):
    """psycopg is not installed, or the server cannot be reached."""


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError as e:
        raise PgUnavailable(
            "the PostgreSQL store needs psycopg 3: pip install 'wren[pg]'"
        ) from e
    return psycopg


def connect(dsn: str, *, autocommit: bool = False) -> Any:
    """A new connection; PgUnavailable when the server does not answer."""
    psycopg = _psycopg()
    try:
        return psycopg.connect(dsn, autocommit=autocommit, connect_timeout=CONNECT_TIMEOUT_S)
    except psycopg.OperationalError as e:
        raise PgUnavailable(f"cannot reach PostgreSQL ({dsn}): {e}") from e


def open_pool(dsn: str, *, max_size: int = POOL_MAX) -> Any:
    """A psycopg_pool.ConnectionPool, open, its first connection made (so a wrong DSN
    fails here, not at the first write)."""
    _psycopg()
    try:
        from psycopg_pool import ConnectionPool
    except ImportError as e:
        raise PgUnavailable(
            "the PostgreSQL store needs psycopg-pool: pip install 'wren[pg]'"
        ) from e
    pool = ConnectionPool(
        dsn,
        min_size=1,
        max_size=max_size,
        kwargs={"connect_timeout": CONNECT_TIMEOUT_S},
        open=False,
    )
    try:
        pool.open(wait=True, timeout=CONNECT_TIMEOUT_S * 2)
    except Exception as e:
        pool.close()
        raise PgUnavailable(f"cannot reach PostgreSQL ({dsn}): {e}") from e
    return pool
