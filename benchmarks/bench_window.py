"""How much memory the intake's replay window pins while devices flood legal events.

    python benchmarks/bench_window.py --devices 1 --runs 16 --shape items

Each device sends `--runs` runs of `events_per_run` events (the window's per-run count)
through EventIntake.handle_evt, as the bridge's network thread does, every event as
large as the bridge's default limits allow (16 KiB encoded). `--shape text` fills an
event with two 8,000-character strings; `--shape items` with small maps (the most
Python objects per encoded byte the limits allow). Printed: the growth of the process's
resident set (VmRSS, /proc/self/status) from before the flood, once the flood is over,
and the intake's own account of the window's bytes where it keeps one. Run it against
another checkout with PYTHONPATH pointing there to compare.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server_bridge.config import BridgeConfig
from server_bridge.intake import EventIntake
from server_bridge.registry import DeviceRecord


def rss() -> int:
    """The resident set of this process, in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def payload(run: str, i: int, shape: str, limit: int) -> bytes:
    """One legal event of about `limit` bytes, encoded as a board sends it."""
    env: dict[str, Any] = {"r": run, "i": i, "t": "msg.delta", "ts": 1000 + i, "d": {"m": 1}}
    if shape == "text":
        env["d"]["text"] = "x" * 8000
        env["d"]["more"] = "y" * 8000
    else:
        # Maps of 200 two-character keys: ~4 encoded bytes per entry.
        keys = [f"{a}{b}" for a in "abcdefghij" for b in "abcdefghijklmnopqrst"]
        env["d"]["x"] = [dict.fromkeys(keys, 1) for _ in range((limit - 200) // 803)]
    data = msgpack.packb(env)
    assert len(data) <= limit, len(data)
    return bytes(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--runs", type=int, default=16, help="runs each device floods")
    ap.add_argument("--shape", choices=("text", "items"), default="items")
    args = ap.parse_args()
    cfg = BridgeConfig()
    kw: dict[str, Any] = {}
    if hasattr(cfg, "window_bytes"):
        kw["window_bytes"] = cfg.window_bytes
    it = EventIntake(
        cfg.prefix,
        lambda topic, data: None,
        limits=cfg.limits,
        keep=cfg.events_per_run,
        hold=cfg.hold_per_run,
        max_runs=cfg.max_runs,
        max_runs_per_device=cfg.max_runs_per_device,
        **kw,
    )
    one = {i: payload("0a1b2c3d.1", i, args.shape, cfg.limits.max_payload) for i in (1, 2)}
    print(f"event: {len(one[2])} bytes encoded, shape {args.shape}")
    gc.collect()
    base = rss()
    for d in range(args.devices):
        dev = DeviceRecord(f"dev{d}", f"tenant{d}", "x")
        for n in range(args.runs):
            run = f"0a1b2c3d.{n + 1}"
            for i in range(1, cfg.events_per_run + 1):
                # A fresh payload per event, as from the network: nothing shared.
                it.handle_evt(dev, payload(run, i, args.shape, cfg.limits.max_payload))
    gc.collect()
    grown = rss() - base
    print(
        f"{args.devices} device(s) x {args.runs} runs x {cfg.events_per_run} events: "
        f"RSS +{grown / 2**20:.1f} MiB"
    )
    used = getattr(it, "window_used", None)
    if used is not None:
        print(f"window: {used / 2**20:.1f} MiB held of {kw['window_bytes'] / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
