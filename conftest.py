"""Shared fixtures: a real Mosquitto per test session, on a free loopback port."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.broker import MosquittoProcess, start_mosquitto  # noqa: E402
from tools.pg_server import PgMissing, PgServer, start_postgres  # noqa: E402

# A suite started in the background by a non-interactive shell (`sh -c '... &'`, nohup)
# inherits SIGINT ignored, and so would every process it starts: the tests that stop
# the demo and the bridge as Ctrl-C does would then find them deaf to it. Python's own
# handler, as in a terminal; the processes the tests start get the default after exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MosquittoProcess]:
    """An anonymous Mosquitto of the session's own; board tests read its address
    from WREN_TEST_BROKER, which is also what the unix-port runs are given."""
    # Nagle is off on it, as on every broker Wren starts (tools/broker.py).
    b = start_mosquitto(tmp_path_factory.mktemp("mosquitto"))
    old = os.environ.get("WREN_TEST_BROKER")
    os.environ["WREN_TEST_BROKER"] = b.address
    yield b
    if old is None:
        os.environ.pop("WREN_TEST_BROKER", None)
    else:
        os.environ["WREN_TEST_BROKER"] = old
    b.stop()


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PgServer]:
    """A PostgreSQL server of the session's own (tools/pg_server.py); the tests that
    need one skip, saying why, on a machine without PostgreSQL."""
    try:
        server = start_postgres(tmp_path_factory.mktemp("postgres"))
    except PgMissing as e:
        pytest.skip(f"PostgreSQL store tests need a PostgreSQL server: {e}")
    yield server
    server.stop()


@pytest.fixture
def pg_dsn(pg_server: PgServer) -> Iterator[str]:
    """A fresh, empty database on the session's server, dropped after the test."""
    import uuid

    import psycopg
    import psycopg.conninfo

    name = f"t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield psycopg.conninfo.make_conninfo(pg_server.dsn, dbname=name)
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
