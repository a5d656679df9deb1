"""The PostgreSQL store's schema migrations on a real server of the test's own."""

from __future__ import annotations

import threading

import pytest

from server_bridge.pgstore import MigrationError, applied, apply, connect
from server_bridge.pgstore.migrate import migrations


def test_migrations_apply_once_and_record_themselves(pg_dsn: str) -> None:
    shipped = [name for _, name, _ in migrations()]
    assert shipped and shipped[0].startswith("0001_")
    with connect(pg_dsn) as conn:
        assert apply(conn) == shipped
        assert apply(conn) == []
        assert sorted(applied(conn).values()) == shipped
        tables = {
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
            ).fetchall()
        }
    assert {"wren_migrations", "wren_leases", "wren_fleet"} <= tables


def test_bridges_starting_together_apply_each_migration_once(pg_dsn: str) -> None:
    results: list[list[str]] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            with connect(pg_dsn) as conn:
                results.append(apply(conn))
        except BaseException as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    applied_now = [name for r in results for name in r]
    assert sorted(applied_now) == [name for _, name, _ in migrations()]


def test_a_schema_from_a_newer_wren_is_refused(pg_dsn: str) -> None:
    with connect(pg_dsn) as conn:
        apply(conn)
        with conn.transaction():
            conn.execute("INSERT INTO wren_migrations (number, name) VALUES (9999, '9999_x.sql')")
        with pytest.raises(MigrationError, match="newer version"):
            apply(conn)
