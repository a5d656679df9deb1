"""The command line on a fleet's database: `--registry postgresql://...` for the
registry commands and the bridge, `wren kb --store postgresql://...` for knowledge, on
a PostgreSQL server of the test's own."""

from __future__ import annotations

from pathlib import Path

import psycopg.conninfo

from server_bridge.knowledge import KnowledgeBase
from server_bridge.pgstore import describe
from server_bridge.pgstore.knowledge import PgKnowledgeStore
from server_bridge.pgstore.registry import PgRegistry
from tests.test_knowledge_cli import wren


def url(dsn: str) -> str:
    """The libpq keyword string the fixture gives, as the URL the options take."""
    d = psycopg.conninfo.conninfo_to_dict(dsn)
    return f"postgresql://{d['user']}@{d['host']}:{d['port']}/{d['dbname']}"


def test_registry_commands_write_the_fleets_database(pg_dsn: str, tmp_path: Path) -> None:
    db = url(pg_dsn)
    made = wren(tmp_path, "tenant", "add", "acme", "--registry", db)
    assert made.returncode == 0, made.stderr
    added = wren(tmp_path, "device", "add", "kiosk1", "--tenant", "acme", "--registry", db)
    assert added.returncode == 0, added.stderr
    listed = wren(tmp_path, "device", "list", "--registry", db)
    assert "kiosk1" in listed.stdout, listed.stdout + listed.stderr
    # What a bridge of the fleet reads: the same rows.
    with PgRegistry(pg_dsn) as reg:
        assert reg.device("kiosk1") is not None and reg.device("kiosk1").tenant == "acme"
        assert reg.tenant_secret("acme") is not None
    # Refused by name, nothing written: a device of a tenant that does not exist.
    bad = wren(tmp_path, "device", "add", "kiosk2", "--tenant", "nobody", "--registry", db)
    assert bad.returncode != 0 and "nobody" in bad.stderr
    with PgRegistry(pg_dsn) as reg:
        assert reg.device("kiosk2") is None
    # No file was made in place of the database.
    assert not (tmp_path / ".wren").exists()


def test_an_unreachable_database_is_one_line_without_its_password(tmp_path: Path) -> None:
    db = "postgresql://wren:s3cret@127.0.0.1:1/nowhere"
    got = wren(tmp_path, "device", "list", "--registry", db)
    assert got.returncode != 0
    assert "s3cret" not in got.stderr and describe(db) in got.stderr, got.stderr
    assert len(got.stderr.strip().splitlines()) == 1, got.stderr
    assert describe("host=h port=5 dbname=d password=s3cret") == "h:5/d"


def test_kb_ingest_into_the_fleets_database_is_what_the_bridges_retrieve(
    pg_dsn: str, tmp_path: Path
) -> None:
    db = url(pg_dsn)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "kiosk.md").write_text("# Kiosk\n\n## Reset\n\nHold the power button for 10 s.\n")
    ing = wren(tmp_path, "kb", "ingest", "docs", "--tenant", "acme", "--collection", "manuals",
               "--store", db, "--no-embed")  # fmt: skip
    assert ing.returncode == 0, ing.stdout + ing.stderr
    found = wren(tmp_path, "kb", "search", "how do I reset it", "--tenant", "acme",
                 "--store", db, "--mode", "keyword")  # fmt: skip
    assert found.returncode == 0, found.stderr
    assert "power button" in found.stdout
    # A bridge's knowledge base on the same database sees the source.
    kb = KnowledgeBase(PgKnowledgeStore(pg_dsn), embedder=None)
    try:
        assert [s.source for s in kb.sources("acme")] == ["kiosk.md"]
    finally:
        kb.close()
    assert not (tmp_path / ".wren").exists()
