"""Memory store writes and reads on PostgreSQL (`PgMemoryStore`) against TinyDB files
(`TinyMemoryStore`), at 10k and 100k rows.

The rows are spread as real memory is: a user's `notes` collection of 100 rows per
user scope (TinyDB's file per collection is capped at 4,096 rows by the field's `max`,
so 100k rows are many scopes), built with one commit per scope as a restore would.
Both stores get the same rows, and the same calls through `MemoryService`:

- write: `mem.remember`, an upsert of an existing key of a random user with a new write
  id (the ledger check, the device ledger, the merge, limits, one durable commit);
- read: `mem.peek` of a random key of a random user, from a store that has every scope
  in memory (warm: TinyDB answers from its cache; PostgreSQL still takes the scope's
  lock and checks its version, a round trip; a peek locks the scope twice, once for
  the row and once for its backlinks) and from a fresh store (TinyDB parses a file,
  PostgreSQL reads the rows, the first time each scope is read: the p99).

PostgreSQL runs on this machine, started by tools/pg_server.py with fsync,
synchronous_commit and full_page_writes on (`durable=True`), so both stores wait for the
disk on each write; both stores run in this one process, one call at a time.

    python benchmarks/bench_store_pg.py            # 10k and 100k rows, under a minute
    python benchmarks/bench_store_pg.py --quick    # 1k and 10k rows, about 20 s
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack  # noqa: E402

from server_bridge.memory import Caller, MemoryService, ScopeRef, TinyMemoryStore  # noqa: E402
from tools.steps import Steps  # noqa: E402

COMMAND = "python benchmarks/bench_store_pg.py"
PER_USER = 100
TEXT = "the quick brown fox jumps over the lazy dog and remembers where it left the keys "
FIELDS = [{"name": "notes", "dur": "user", "kind": "collection", "max": PER_USER + 10}]


def caller(user: str) -> Caller:
    return Caller("acme", "dev1", "kiosk", user=user, run="bench", fields=FIELDS)


def record(key: str, i: int, now: float) -> dict[str, object]:
    value = {"text": TEXT[: 40 + i % 40], "n": i}
    sz = len(msgpack.packb([value, []]))
    prov = {"dev": "dev1", "run": "bench", "tool": None, "at": now, "agent": "kiosk", "ver": 1}
    return {
        "key": key, "value": value, "ver": 1, "links": [], "prov": prov, "at": now,
        "created": now, "exp": None, "sz": sz, "seq": i + 1,
    }  # fmt: skip


def build(store: Any, users: list[str]) -> None:
    now = time.time()
    for u in users:
        rows = {f"k{i}": record(f"k{i}", i, now) for i in range(PER_USER)}
        with store.scope(ScopeRef("acme", "user", f"kiosk/{u}")) as tx:
            tx.commit("notes", {"rows": rows}, {"seq": PER_USER, "next": PER_USER, "own": "kiosk"})


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def writes(svc: MemoryService, users: list[str], samples: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    lat = []
    for s in range(samples):
        args = {
            "field": "notes",
            "key": f"k{rng.randrange(PER_USER)}",
            "value": {"text": TEXT, "s": s},
            "w": f"bench.{seed}:{s + 1}",
        }
        who = caller(rng.choice(users))
        t = time.perf_counter()
        svc.handle(who, "mem.remember", args)
        lat.append((time.perf_counter() - t) * 1000)
    return lat


def reads(svc: MemoryService, users: list[str], samples: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    lat = []
    for _ in range(samples):
        args = {"field": "notes", "key": f"k{rng.randrange(PER_USER)}"}
        who = caller(rng.choice(users))
        t = time.perf_counter()
        svc.handle(who, "mem.peek", args)
        lat.append((time.perf_counter() - t) * 1000)
    return lat


def measure(kind: str, open_store: Any, rows: int, samples: int) -> dict[str, float]:
    users = [f"u{i}" for i in range(rows // PER_USER)]
    store = open_store()
    t0 = time.perf_counter()
    build(store, users)
    built = time.perf_counter() - t0
    svc = MemoryService(store, scope_limit=1 << 40)
    # Warm up the connection pool and the code paths before timing.
    writes(svc, users, 10, seed=rows + 1)
    w = writes(svc, users, samples, seed=rows)
    warm = reads(svc, users, samples, seed=rows)
    fresh = open_store()
    cold = reads(MemoryService(fresh, scope_limit=1 << 40), users, samples, seed=rows + 2)
    for s in (store, fresh):
        if hasattr(s, "close"):
            s.close()
    return {
        "built_s": built,
        "w50": pct(w, 0.5),
        "w99": pct(w, 0.99),
        "r50": pct(warm, 0.5),
        "r99": pct(warm, 0.99),
        "c50": pct(cold, 0.5),
        "c99": pct(cold, 0.99),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1k and 10k rows instead of 10k and 100k")
    ap.add_argument("--samples", type=int, default=1000, help="timed calls of each kind (1000)")
    ap.add_argument("--dir", help="where to put the stores (default: a temporary directory)")
    args = ap.parse_args()
    command = f"{COMMAND}{' --quick' if args.quick else ''}"
    if args.samples != 1000:
        command += f" --samples {args.samples}"
    print(f"command: {command}")
    print(f"python {platform.python_version()} on {platform.platform()}")

    from server_bridge.pgstore.memory import PgMemoryStore
    from tools.pg_server import PgMissing, start_postgres

    sizes = (1_000, 10_000) if args.quick else (10_000, 100_000)
    steps = Steps("bench_store_pg")
    base = Path(args.dir) if args.dir else None
    with tempfile.TemporaryDirectory(dir=base) as d:
        steps("starting PostgreSQL (fsync on)")
        try:
            pg = start_postgres(Path(d), durable=True)
        except PgMissing as e:
            print(f"no PostgreSQL to measure: {e}")
            return
        try:
            import psycopg
            import psycopg.conninfo

            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                version = conn.execute("SHOW server_version").fetchone()[0]
            print(f"PostgreSQL {version}, fsync on, on this machine (loopback TCP)")
            print(
                f"\n{'rows':>8} {'store':6} {'scopes':>6} {'build s':>8} {'write p50':>9} "
                f"{'p99':>7} {'warm read p50':>13} {'p99':>7} {'fresh read p50':>14} {'p99':>7}"
                "   (ms)"
            )
            results: dict[tuple[int, str], dict[str, float]] = {}
            for rows in sizes:
                for kind in ("tiny", "pg"):
                    steps(f"{rows:,} rows, {kind}: building and timing {args.samples} calls each")
                    if kind == "tiny":
                        where = Path(d) / f"tiny-{rows}"

                        def open_store(where: Path = where, n: int = rows) -> Any:
                            return TinyMemoryStore(where, max_scopes=n)

                    else:
                        dbname = f"bench_{rows}"
                        with psycopg.connect(pg.dsn, autocommit=True) as conn:
                            conn.execute(f'CREATE DATABASE "{dbname}"')
                        dsn = psycopg.conninfo.make_conninfo(pg.dsn, dbname=dbname)

                        def open_store(dsn: str = dsn, n: int = rows) -> Any:
                            return PgMemoryStore(dsn, max_scopes=n)

                    r = results[(rows, kind)] = measure(kind, open_store, rows, args.samples)
                    print(
                        f"{rows:8,} {kind:6} {rows // PER_USER:6,} {r['built_s']:8.1f} "
                        f"{r['w50']:9.2f} {r['w99']:7.2f} {r['r50']:13.2f} {r['r99']:7.2f} "
                        f"{r['c50']:14.2f} {r['c99']:7.2f}"
                    )
            print("\nPostgreSQL / TinyDB (above 1: PostgreSQL slower):")
            for rows in sizes:
                t, p = results[(rows, "tiny")], results[(rows, "pg")]
                print(
                    f"{rows:8,} rows: write p50 {p['w50'] / t['w50']:.2f}x, p99 "
                    f"{p['w99'] / t['w99']:.2f}x; warm read p50 {p['r50'] / t['r50']:.1f}x; "
                    f"fresh read p50 {p['c50'] / t['c50']:.1f}x, p99 {p['c99'] / t['c99']:.1f}x"
                )
        finally:
            pg.stop()
    print(f"\n(reproduce: {command})")


if __name__ == "__main__":
    main()
