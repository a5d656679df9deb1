"""A PostgreSQL server of its own, for the store tests and benchmarks of issue "Past one
machine" (DESIGN "Where scale goes"): `initdb` into a fresh directory, `postgres` on a
free loopback port with its socket in that directory, stopped (and the directory gone)
by `stop()`. Nothing of the machine's own PostgreSQL is touched, and each test session
starts from an empty database.

PostgreSQL refuses to run as root (CI runs as root): then the server runs as the
`postgres` user (`runuser`), which owns the directory. `WREN_PG_DSN` names an existing
server instead (a fresh database is made in it and dropped by `stop()`), for machines
where the server binaries are not installed but a server is reachable.

    pg = start_postgres(tmp_path)   # PgMissing says why when there is none
    pg.dsn                          # "host=127.0.0.1 port=... dbname=wren user=..."
    pg.stop()
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.broker import free_port
from tools.owned_process import die_with_owner, stop_process

__all__ = ["PgMissing", "PgServer", "pg_bindir", "start_postgres"]

READY_TIMEOUT_S = 30.0
DBNAME = "wren"


class PgMissing(RuntimeError):
    """No PostgreSQL to start or reach: the message says what was looked for."""


def pg_bindir() -> Path | None:
    """Where `initdb` and `postgres` are: WREN_PG_BIN, PATH, or Debian's versioned dirs."""
    if os.environ.get("WREN_PG_BIN"):
        return Path(os.environ["WREN_PG_BIN"])
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    # Debian keeps them out of PATH, one directory per major version: the newest wins.
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version_key)
    return Path(found[-1]).parent if found else None


def _version_key(path: str) -> tuple[int, ...]:
    part = Path(path).parent.parent.name
    return tuple(int(p) for p in part.split(".") if p.isdigit())


@dataclass
class PgServer:
    """A running server (or a database made in WREN_PG_DSN's) and how to reach it."""

    dsn: str
    directory: Path | None
    proc: subprocess.Popen[Any] | None = None
    admin_dsn: str | None = None
    dbname: str = DBNAME
    log_path: Path | None = None
    _stopped: bool = field(default=False, repr=False)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.proc is not None:
            # SIGTERM is PostgreSQL's "smart" shutdown, which waits for clients; SIGINT
            # ("fast") ends their sessions, which is what a test's end wants.
            self.proc.send_signal(2)
            stop_process(self.proc, timeout_s=10.0)
        elif self.admin_dsn is not None:
            _drop_database(self.admin_dsn, self.dbname)
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    def log_tail(self, n: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def start_postgres(workdir: Path, *, durable: bool = False) -> PgServer:
    """Start a server in `workdir/pg` (or a database in WREN_PG_DSN's server).

    `durable` keeps fsync on, for benchmarks that compare store writes; the tests run
    with it off (a crash of the test machine loses nothing a test needs).
    """
    external = os.environ.get("WREN_PG_DSN")
    if external:
        return _database_in(external)
    bindir = pg_bindir()
    if bindir is None or not (bindir / "postgres").exists():
        raise PgMissing(
            "no PostgreSQL server binaries (initdb, postgres): install Debian's "
            "postgresql package, set WREN_PG_BIN to their directory, or WREN_PG_DSN "
            "to a server the tests may make a database in"
        )
    as_user: list[str] = []
    run_as: str | None = None
    if os.geteuid() == 0:
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError as e:
            raise PgMissing("running as root and there is no postgres user to run as") from e
        run_as = "postgres"
        as_user = ["runuser", "-u", run_as, "--"]
        # The server's directories must be its own and the way to them open to it; a
        # root's pytest tmp_path is not (0700), so the directory goes in the system's
        # temporary directory then.
        if not _searchable(Path(workdir)):
            workdir = Path(tempfile.gettempdir())
    directory = Path(tempfile.mkdtemp(prefix="wren-pg-", dir=workdir))
    data = directory / "data"
    if run_as is not None:
        os.chown(directory, pw.pw_uid, pw.pw_gid)
    user = run_as or pwd.getpwuid(os.geteuid()).pw_name
    init = subprocess.run(
        [*as_user, str(bindir / "initdb"), "-D", str(data), "-U", user, "-A", "trust",
         "-E", "UTF8", "--locale=C", "--no-sync"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if init.returncode != 0:
        raise PgMissing(f"initdb failed ({init.returncode}): {init.stderr.strip()[-500:]}")
    port = free_port()
    log_path = directory / "postgres.log"
    settings = {
        "listen_addresses": "127.0.0.1",
        "port": str(port),
        "unix_socket_directories": str(directory),
        "max_connections": "200",
        "fsync": "on" if durable else "off",
        "synchronous_commit": "on" if durable else "off",
        "full_page_writes": "on" if durable else "off",
    }
    args = [*as_user, str(bindir / "postgres"), "-D", str(data)]
    for k, v in settings.items():
        args += ["-c", f"{k}={v}"]
    log = open(log_path, "wb")
    try:
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_owner(),
        )
    finally:
        log.close()
    server = PgServer(
        dsn=f"host=127.0.0.1 port={port} dbname={DBNAME} user={user}",
        directory=directory,
        proc=proc,
        log_path=log_path,
    )
    try:
        _wait_ready(server, f"host=127.0.0.1 port={port} dbname=postgres user={user}")
        _create_database(f"host=127.0.0.1 port={port} dbname=postgres user={user}", DBNAME)
    except BaseException:
        server.stop()
        raise
    return server


def _searchable(path: Path) -> bool:
    """Whether every directory down to `path` lets other users through."""
    for p in [path, *path.parents]:
        if p == Path("/"):
            return True
        if not p.stat().st_mode & 0o001:
            return False
    return True


def _connect(dsn: str) -> Any:
    import psycopg

    return psycopg.connect(dsn, autocommit=True, connect_timeout=5)


def _wait_ready(server: PgServer, admin: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    last: Exception | None = None
    while time.monotonic() < deadline:
        if server.proc is not None and server.proc.poll() is not None:
            raise PgMissing(f"postgres exited ({server.proc.returncode}):\n{server.log_tail()}")
        try:
            _connect(admin).close()
            return
        except Exception as e:  # not accepting connections yet
            last = e
            time.sleep(0.1)
    raise PgMissing(f"postgres not ready in {READY_TIMEOUT_S:.0f} s: {last}\n{server.log_tail()}")


def _create_database(admin_dsn: str, name: str) -> None:
    with _connect(admin_dsn) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')


def _drop_database(admin_dsn: str, name: str) -> None:
    try:
        with _connect(admin_dsn) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    except Exception:
        pass  # the server went away: nothing left to drop


def _database_in(admin_dsn: str) -> PgServer:
    name = f"wren_test_{uuid.uuid4().hex[:12]}"
    try:
        _create_database(admin_dsn, name)
    except Exception as e:
        raise PgMissing(f"WREN_PG_DSN={admin_dsn!r}: cannot make a database: {e}") from e
    import psycopg.conninfo

    dsn = psycopg.conninfo.make_conninfo(admin_dsn, dbname=name)
    return PgServer(dsn=dsn, directory=None, admin_dsn=admin_dsn, dbname=name)
