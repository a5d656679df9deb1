"""One board's `kb.add` and `kb.retrieve` as the bridge's RPC worker runs them.

The handler of `server_bridge/knowledge/calls.py` called in process (no MQTT: what a
call costs the worker that takes it), with the embedder the bridge uses (MiniLM-L6
int8 when installed, else BM25 only, said in the output), for texts of 1, 4 and 8 KiB
(8 KiB is the most one call carries), each a new source, into a fresh store; then a
retrieval over what was ingested. The per-device budget is lifted for the run.

    python benchmarks/bench_knowledge_rpc.py [--runs 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from server_bridge.knowledge import KnowledgeBase
from server_bridge.knowledge.calls import DeviceBudget, _Handlers
from server_bridge.memory.grants import Grants
from server_bridge.registry import DeviceRecord
from server_bridge.wire import Limits

WORDS = (
    "the greenhouse north vent humidity soil moisture pump valve reading logged at "
    "morning evening sensor calibrated drift seal impeller flow rate alarm cleared"
).split()


def text(rng: random.Random, n: int) -> str:
    out: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="calls per text size")
    args = ap.parse_args()
    rng = random.Random(1)
    with tempfile.TemporaryDirectory() as tmp:
        kb = KnowledgeBase(Path(tmp) / "k.sqlite3")
        print("embedder:", kb.embedder.name if kb.embedder else "none (BM25 only)")
        registry: Any = SimpleNamespace(grants_of=lambda t, a: Grants({"kb:notes": "write"}))
        h = _Handlers(kb, registry, lambda d: Limits(), lambda n, k: None,
                      DeviceBudget(calls_burst=1e9, bytes_burst=1e12))  # fmt: skip
        ctx: Any = SimpleNamespace(device=DeviceRecord("dev1", "acme", "thermostat"))
        h.ingest(ctx, {"collection": "notes", "src": "warm", "text": text(rng, 500)}, None)
        for size in (1024, 4096, 8192):
            times, chunks = [], 0
            for i in range(args.runs):
                a = {"collection": "notes", "src": f"s{size}-{i}", "text": text(rng, size)}
                t = time.perf_counter()
                chunks = h.ingest(ctx, a, None)["chunks"]
                times.append(time.perf_counter() - t)
            print(f"kb.add {size:>5} B ({chunks} chunks): median "
                  f"{statistics.median(times) * 1000:.0f} ms, max {max(times) * 1000:.0f} ms")
        times = []
        for q in ("north vent humidity", "pump seal impeller", "sensor drift alarm"):
            t = time.perf_counter()
            got = h.retrieve(ctx, {"query": q, "k": 5}, None)
            times.append(time.perf_counter() - t)
        print(f"kb.retrieve k 5 ({got['mode']}): median {statistics.median(times) * 1000:.0f} ms")
        kb.close()


if __name__ == "__main__":
    main()
