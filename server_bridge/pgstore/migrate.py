"""Numbered schema migrations, applied in order at start.

Each file `migrations/NNNN_<what>.sql` runs once, in a transaction of its own together
with the row that records it in `wren_migrations`, so a migration is either applied and
recorded or neither. A transaction-level advisory lock makes bridges that start at the
same moment take turns: the second finds the work done. A database that records a
migration this code does not have (a newer Wren wrote it) is refused, not guessed at.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Any

__all__ = ["MigrationError", "applied", "apply", "migrations"]

# pg_advisory_xact_lock's key for "migrating Wren's schema" (any constant; this is
# crc32("wren-migrations")).
_LOCK_KEY = 0x5F3A61C2
_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


class MigrationError(RuntimeError):
    """The database's schema is not one this code can bring up to date."""


def migrations() -> list[tuple[int, str, str]]:
    """(number, file name, SQL) of every migration shipped, in order."""
    found: list[tuple[int, str, str]] = []
    for entry in resources.files("server_bridge.pgstore").joinpath("migrations").iterdir():
        m = _NAME.match(entry.name)
        if m:
            found.append((int(m.group(1)), entry.name, entry.read_text(encoding="utf-8")))
    found.sort()
    numbers = [n for n, _, _ in found]
    if len(set(numbers)) != len(numbers):
        raise MigrationError(f"two migrations share a number: {[f for _, f, _ in found]}")
    return found


_TABLE = (
    "CREATE TABLE IF NOT EXISTS wren_migrations ("
    " number integer PRIMARY KEY, name text NOT NULL,"
    " applied_at timestamptz NOT NULL DEFAULT now())"
)


def applied(conn: Any) -> dict[int, str]:
    """number -> file name of the migrations the database records (empty: none yet)."""
    with conn.transaction():
        if conn.execute("SELECT to_regclass('wren_migrations')").fetchone()[0] is None:
            return {}
        rows = conn.execute("SELECT number, name FROM wren_migrations").fetchall()
    return {int(n): str(name) for n, name in rows}


def apply(conn: Any) -> list[str]:
    """Bring the schema up to date; the file names applied now (empty: it was)."""
    shipped = migrations()
    known = {n for n, _, _ in shipped}
    done: list[str] = []
    with conn.transaction():
        # The lock first: even CREATE TABLE IF NOT EXISTS races with itself.
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
        conn.execute(_TABLE)
        have = {
            int(n): str(name)
            for n, name in conn.execute("SELECT number, name FROM wren_migrations").fetchall()
        }
        newer = sorted(set(have) - known)
        if newer:
            raise MigrationError(
                f"the database has migrations this Wren does not know ({[have[n] for n in newer]}):"
                " it was written by a newer version"
            )
        for number, name, sql in shipped:
            if number in have:
                continue
            with conn.transaction():
                conn.execute(sql)
                conn.execute(
                    "INSERT INTO wren_migrations (number, name) VALUES (%s, %s)", (number, name)
                )
            done.append(name)
    return done
