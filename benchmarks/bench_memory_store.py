"""Memory store write and load cost at 10k and 100k rows, in one scope and spread.

TinyDB rewrites a whole file per write, so `TinyMemoryStore` keeps one file per
collection per scope instance (server_bridge/memory/store.py). This measures what that
buys and where it stops:

- one scope: every row in one collection of one agent scope (one file).
- spread: the same rows over user scopes of 100 rows each (one file per user).

For each: a write through `MemoryService` (`mem.remember`, an upsert of an existing key
with a new write id: merge, limits, ledger, temp file, fsync, rename) p50 / p99; the
full load (a fresh store parses every shard); the bytes on disk and the largest file.
The rows are built with one commit per shard, as a restore would write them, since
100,000 single writes to one file would take hours (which is the point).

    python benchmarks/bench_memory_store.py            # 10k and 100k rows, about a minute
    python benchmarks/bench_memory_store.py --quick    # 1k and 10k rows, seconds
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack  # noqa: E402

from server_bridge.memory import Caller, MemoryService, ScopeRef, TinyMemoryStore  # noqa: E402
from server_bridge.store import AtomicJSONStorage  # noqa: E402
from tools.steps import Steps  # noqa: E402

COMMAND = "python benchmarks/bench_memory_store.py"
PER_USER = 100
TEXT = "the quick brown fox jumps over the lazy dog and remembers where it left the keys "


def caller(user: str, rows: int) -> Caller:
    fields = [
        {"name": "facts", "dur": "agent", "kind": "collection", "max": rows + 10},
        {"name": "notes", "dur": "user", "kind": "collection", "max": PER_USER + 10},
    ]
    return Caller("acme", "dev1", "kiosk", user=user, run="bench", fields=fields)


def record(key: str, i: int, now: float) -> dict[str, object]:
    value = {"text": TEXT[: 40 + i % 40], "n": i}
    sz = len(msgpack.packb([value, []]))
    prov = {"dev": "dev1", "run": "bench", "tool": None, "at": now, "agent": "kiosk", "ver": 1}
    return {
        "key": key, "value": value, "ver": 1, "links": [], "prov": prov, "at": now,
        "created": now, "exp": None, "sz": sz, "seq": i + 1,
    }  # fmt: skip


def build(store: TinyMemoryStore, refs: list[tuple[ScopeRef, str]], per: int) -> None:
    now = time.time()
    for ref, field in refs:
        rows = {f"k{i}": record(f"k{i}", i, now) for i in range(per)}
        with store.scope(ref) as tx:
            tx.commit(field, {"rows": rows}, {"seq": per, "next": per, "own": "kiosk"})


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def measure(rows: int, layout: str, tmp: Path, samples: int) -> dict[str, float]:
    d = tmp / f"{layout}-{rows}"
    store = TinyMemoryStore(d, max_scopes=rows)
    if layout == "one scope":
        refs = [(ScopeRef("acme", "agent", "kiosk"), "facts")]
        per, users = rows, ["u0"]
    else:
        users = [f"u{i}" for i in range(rows // PER_USER)]
        refs = [(ScopeRef("acme", "user", f"kiosk/{u}"), "notes") for u in users]
        per = PER_USER
    t0 = time.perf_counter()
    build(store, refs, per)
    built = time.perf_counter() - t0
    svc = MemoryService(store, scope_limit=1 << 40)
    rng = random.Random(rows)
    field = refs[0][1]
    lat = []
    for s in range(samples):
        who = caller(rng.choice(users), rows)
        args = {
            "field": field,
            "key": f"k{rng.randrange(per)}",
            "value": {"text": TEXT},
            "w": f"w{s}",
        }
        t = time.perf_counter()
        svc.handle(who, "mem.remember", args)
        lat.append((time.perf_counter() - t) * 1000)
    files = [p for p in d.rglob("*.json")]
    fresh = TinyMemoryStore(d, max_scopes=rows)
    t = time.perf_counter()
    loaded = 0
    for ref, f in refs:
        with fresh.scope(ref) as tx:
            loaded += len(tx.table(f, "rows"))
    load_s = time.perf_counter() - t
    assert loaded == rows, (loaded, rows)
    return {
        "built_s": built,
        "p50": pct(lat, 0.5),
        "p99": pct(lat, 0.99),
        "load_s": load_s,
        "bytes": sum(p.stat().st_size for p in files),
        "largest": max(p.stat().st_size for p in files),
        "files": len(files),
        "per_file_rows": per,
    }


def floor_ms(tmp: Path, samples: int = 100) -> tuple[float, float]:
    """p50/p99 of a bare AtomicJSONStorage write of a tiny file: the fsync floor of this
    disk right now, to read the rows above against."""
    storage = AtomicJSONStorage(tmp / "floor.json")
    lat = []
    for i in range(samples):
        t = time.perf_counter()
        storage.write({"t": {"1": {"v": i}}})
        lat.append((time.perf_counter() - t) * 1000)
    return pct(lat, 0.5), pct(lat, 0.99)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1k and 10k rows instead of 10k and 100k")
    ap.add_argument("--dir", help="where to put the store (default: a temporary directory)")
    args = ap.parse_args()
    sizes = (1_000, 10_000) if args.quick else (10_000, 100_000)
    print(f"command: {COMMAND}{' --quick' if args.quick else ''}")
    print(f"python {platform.python_version()} on {platform.platform()}")
    base = Path(args.dir) if args.dir else None
    with tempfile.TemporaryDirectory(dir=base) as d:
        print(
            f"\n{'rows':>8} {'layout':10} {'files':>6} {'rows/file':>9} {'write p50 ms':>12} "
            f"{'p99 ms':>8} {'load s':>7} {'total MB':>9} {'largest MB':>10}"
        )
        one: list[tuple[int, float]] = []
        steps = Steps("bench_memory_store")
        for rows in sizes:
            for layout in ("one scope", "spread"):
                steps(f"{rows:,} rows, {layout}: filling the store and timing writes")
                # A write to a 100k-row file costs a second; fewer samples keep it short.
                samples = 200 if layout == "spread" or rows <= 10_000 else 20
                r = measure(rows, layout, Path(d), samples)
                if layout == "one scope":
                    one.append((rows, r["p50"]))
                print(
                    f"{rows:8,} {layout:10} {r['files']:6,} {r['per_file_rows']:9,} "
                    f"{r['p50']:12.2f} {r['p99']:8.2f} {r['load_s']:7.2f} "
                    f"{r['bytes'] / 1e6:9.1f} {r['largest'] / 1e6:10.2f}"
                )
        f50, f99 = floor_ms(Path(d))
        print(f"{'floor':>8} {'tiny file':10} {1:6} {0:9} {f50:12.2f} {f99:8.2f}")
        (r0, t0), (r1, t1) = one
        per_row_us = (t1 - t0) / (r1 - r0) * 1000
        print(
            f"\nA write costs about {per_row_us:.1f} us per row of its own file: the write "
            f"cost follows the rows of the one collection written, not the store's size."
        )
        if per_row_us > 0:
            # Where a write costs 10 ms: the fsync floor plus the rows of its file.
            limit_rows = max(0.0, 10 - f50) / per_row_us * 1000
            print(
                f"Past about {limit_rows:,.0f} rows in one collection a write takes over "
                "10 ms: there the one-file-per-collection layout stops scaling (keep a "
                "field's max below it, or move to a database-server backend)."
            )
    print(f"\n(reproduce: {COMMAND}{' --quick' if args.quick else ''})")


if __name__ == "__main__":
    main()
