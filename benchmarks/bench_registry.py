"""Registry lookup latency, records parsed once per file version against a parse per lookup.

The bridge calls `Registry.device()` for every incoming message (and `tenant_secret()`
for every session token) on paho's single network thread. This measures both at 10 and
10,000 devices:

- cached: `Registry` as it is, once the file's version has settled (more than
  store.SETTLE_NS after the last write): one `stat` per lookup.
- fresh: the same lookups within store.SETTLE_NS of a write, while the version does
  not yet prove the bytes: a read of the file and a byte compare per lookup.
- reload: the first lookup after another process wrote the file: read, parse, index.
- baseline: the lookup as it was before the cache, measured in the same run: a TinyDB
  query on a cache_size=0 table, which parses the whole file per lookup. (The storage
  used to keep the file's text, so the baseline then skipped the read that it makes
  now; the "read file" row gives that share.)

    python benchmarks/bench_registry.py

Takes about 15 s.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tinydb import Query  # noqa: E402

from server_bridge.registry import DeviceRecord, Registry  # noqa: E402
from server_bridge.store import SETTLE_NS, AtomicJSONStorage, open_db  # noqa: E402
from server_bridge.topics import check_id  # noqa: E402

COMMAND = "python benchmarks/bench_registry.py"
SIZES = (10, 10_000)
CACHED_SAMPLES = 20_000
# A parse of the 10,000-device file takes milliseconds: fewer samples keep the run short.
BASELINE_SAMPLES = {10: 20_000, 10_000: 300}
FRESH_SAMPLES = 300
RELOADS = 30


def build(path: Path, devices: int) -> list[str]:
    """A registry file as the provisioning CLI leaves it: `devices` devices spread over
    one tenant per hundred. Written as one TinyDB document, since adding 10,000 devices
    one by one would parse the growing file 10,000 times."""
    tenants = [f"tenant{i}" for i in range(max(1, devices // 100))]
    doc = {
        "tenants": {
            str(i + 1): {"tenant": t, "secret": os.urandom(32).hex()} for i, t in enumerate(tenants)
        },
        "devices": {
            str(i + 1): {"device": f"dev{i}", "tenant": tenants[i % len(tenants)], "agent": "kiosk"}
            for i in range(devices)
        },
    }
    AtomicJSONStorage(path).write(doc)
    return tenants


class BaselineLookups:
    """The registry's lookups before it kept parsed records, line for line: a TinyDB
    query under a lock on cache_size=0 tables, so every call parses the file."""

    def __init__(self, path: Path):
        db = open_db(path)
        self._tenants = db.table("tenants", cache_size=0)
        self._devices = db.table("devices", cache_size=0)
        self._lock = threading.Lock()

    def tenant_secret(self, tenant: str) -> str | None:
        check_id(tenant, "tenant")
        q = Query()
        with self._lock:
            doc = self._tenants.get(q.tenant == tenant)
        if not isinstance(doc, dict):
            return None
        return str(doc["secret"])

    def device(self, device: str) -> DeviceRecord | None:
        check_id(device, "device")
        q = Query()
        with self._lock:
            doc = self._devices.get(q.device == device)
        if not isinstance(doc, dict):
            return None
        return DeviceRecord(str(doc["device"]), str(doc["tenant"]), str(doc["agent"]))


def sample(fn: Callable[[str], object], keys: list[str], count: int) -> list[int]:
    """Nanoseconds per call of fn over `count` keys; every call must find its key."""
    out = []
    for i in range(count):
        key = keys[i % len(keys)]
        t0 = time.perf_counter_ns()
        found = fn(key)
        out.append(time.perf_counter_ns() - t0)
        if found is None:
            raise SystemExit(f"lookup of {key!r} found nothing")
    return out


def pct(ns: list[int], q: float) -> float:
    """The q-quantile in microseconds (nearest rank)."""
    s = sorted(ns)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] / 1000


def wait_until_settled(path: Path) -> None:
    # The steady state of a running bridge: the file was last written more than
    # SETTLE_NS ago, so the version alone identifies it.
    left = os.stat(path).st_mtime_ns + SETTLE_NS - time.time_ns()
    if left > 0:
        time.sleep(left / 1e9 + 0.05)


def measure(devices: int, tmp: Path) -> list[tuple[str, str, list[int]]]:
    path = tmp / f"registry-{devices}.json"
    tenants = build(path, devices)
    rng = random.Random(devices)
    device_keys = [f"dev{rng.randrange(devices)}" for _ in range(1000)]
    tenant_keys = [rng.choice(tenants) for _ in range(1000)]
    rows: list[tuple[str, str, list[int]]] = []

    wait_until_settled(path)
    cached, base = Registry(path), BaselineLookups(path)
    storage = AtomicJSONStorage(path)
    for op, keys in (("device()", device_keys), ("tenant_secret()", tenant_keys)):
        fn_cached = getattr(cached, op[:-2])
        fn_base = getattr(base, op[:-2])
        # The one parse of this version, then a warm-up so the first row is not the
        # one that pays for cold caches.
        sample(fn_cached, keys, 2000)
        rows.append((op, "cached", sample(fn_cached, keys, CACHED_SAMPLES)))
        rows.append((op, "baseline", sample(fn_base, keys, BASELINE_SAMPLES[devices])))
    rows.append(
        ("read file", "open+fstat+read", sample(lambda _: storage.read_bytes(), ["x"], 300))
    )

    # Fresh: the same bytes rewritten (a new inode, a recent mtime), as just after a write.
    storage.write(storage.read() or {})
    written_ns = os.stat(path).st_mtime_ns
    cached.device(device_keys[0])
    fresh = sample(cached.device, device_keys, FRESH_SAMPLES)
    if time.time_ns() - written_ns >= SETTLE_NS:
        raise SystemExit("the fresh samples outlasted the settle window; lower FRESH_SAMPLES")
    rows.append(("device()", "fresh (<2 s after a write)", fresh))

    # Reload: another writer renames a new version in; time the first lookup after it.
    reloads = []
    other = AtomicJSONStorage(path)
    for i in range(RELOADS):
        data = other.read() or {}
        data["devices"]["1"]["agent"] = f"kiosk{i}"
        other.write(data)
        reloads.append(sample(cached.device, ["dev0"], 1)[0])
        if cached.device("dev0") != DeviceRecord("dev0", tenants[0], f"kiosk{i}"):
            raise SystemExit("a write by another storage was not seen")
    rows.append(("device()", "reload (1st after a write)", reloads))
    cached.close()
    return rows


def main() -> None:
    # No options; --help says what it measures.
    argparse.ArgumentParser(description=__doc__).parse_args()
    print(f"command: {COMMAND}")
    print(f"python {platform.python_version()} on {platform.platform()}")
    with tempfile.TemporaryDirectory() as d:
        for devices in SIZES:
            rows = measure(devices, Path(d))
            size = os.stat(Path(d) / f"registry-{devices}.json").st_size
            print(f"\n{devices:,} devices ({size:,} B file)")
            print(f"{'lookup':16} {'mode':28} {'n':>6} {'p50 us':>9} {'p99 us':>9}")
            p = {(op, mode): (pct(ns, 0.5), pct(ns, 0.99)) for op, mode, ns in rows}
            for op, mode, ns in rows:
                print(f"{op:16} {mode:28} {len(ns):6d} {p[op, mode][0]:9.1f} {p[op, mode][1]:9.1f}")
            for op in ("device()", "tenant_secret()"):
                (c50, c99), (b50, b99) = p[op, "cached"], p[op, "baseline"]
                print(f"{op:16} baseline / cached: p50 {b50 / c50:,.0f}x, p99 {b99 / c99:,.0f}x")
    print(f"\n(reproduce: {COMMAND})")


if __name__ == "__main__":
    main()
