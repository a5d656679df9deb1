"""Connections to the shared database: one for a caller that needs its own, a pool for
the bridge's threads. psycopg is imported lazily, so its absence is a named error."""

from __future__ import annotations

from typing import Any

__all__ = ["PgUnavailable", "connect", "describe", "open_pool", "store_pool"]

# A bridge's threads that touch the store at once: the network thread's seeds, the
# RPC workers, the lease keeper. More would queue in the pool, not fail.
POOL_MAX = 16
CONNECT_TIMEOUT_S = 5


class PgUnavailable(RuntimeError):
    """psycopg is not installed, or the server cannot be reached."""


def describe(dsn: str) -> str:
    """A database's name for a log line or a message, without its password: a URL as
    `postgresql://user@host:port/db`, a keyword string as `host:port/db`."""
    if "://" in dsn:
        from urllib.parse import urlsplit, urlunsplit

        try:
            parts = urlsplit(dsn)
            netloc = (f"{parts.username}@" if parts.username else "") + (parts.hostname or "")
            if parts.port:
                netloc += f":{parts.port}"
        except ValueError:
            return "a PostgreSQL database"
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    # key=value pairs (libpq's other form); a value with spaces is quoted, which a
    # name for a message can do without.
    pairs = dict(p.split("=", 1) for p in dsn.split() if "=" in p)
    where = pairs.get("host", "localhost") + (f":{pairs['port']}" if "port" in pairs else "")
    return f"{where}/{pairs.get('dbname', '')}"


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError as e:
        raise PgUnavailable(
            "the PostgreSQL store needs psycopg 3: pip install 'wren[pg]'"
        ) from e
    return psycopg


def connect(
    dsn: str, *, autocommit: bool = False, timeout_s: float = CONNECT_TIMEOUT_S, **kw: Any
) -> Any:
    """A new connection; PgUnavailable when the server does not answer within
    `timeout_s` (libpq counts whole seconds, at least 2). `kw` goes to psycopg (libpq's
    `options`, say)."""
    psycopg = _psycopg()
    try:
        return psycopg.connect(
            dsn, autocommit=autocommit, connect_timeout=max(2, round(timeout_s)), **kw
        )
    except psycopg.OperationalError as e:
        # libpq's message has its hint on a line of its own: one line, for a log or a
        # command's error.
        why = " ".join(str(e).split())
        raise PgUnavailable(f"cannot reach PostgreSQL ({describe(dsn)}): {why}") from None


def open_pool(dsn: str, *, max_size: int = POOL_MAX) -> Any:
    """A psycopg_pool.ConnectionPool, open, its first connection made (so a wrong DSN
    fails here, not at the first write)."""
    # One connection first: a server that refuses is said at once, where the pool would
    # retry in the background (logging each try) until its timeout.
    connect(dsn).close()
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
        # libpq's message has its hint on a line of its own: one line, for a log or a
        # command's error.
        why = " ".join(str(e).split())
        raise PgUnavailable(f"cannot reach PostgreSQL ({describe(dsn)}): {why}") from None
    return pool


def store_pool(dsn_or_pool: str | Any, *, max_size: int) -> tuple[Any, bool]:
    """The pool a store works on, its schema brought up to date (migrate.apply): a pool
    of its own opened on a DSN (True: the store closes it), or a pool the caller shares
    between stores (False: left open). A migration that fails closes what was opened."""
    from server_bridge.pgstore import migrate

    own = isinstance(dsn_or_pool, str)
    pool: Any = open_pool(dsn_or_pool, max_size=max_size) if own else dsn_or_pool
    try:
        with pool.connection() as conn:
            migrate.apply(conn)
    except BaseException:
        if own:
            pool.close()
        raise
    return pool, own
