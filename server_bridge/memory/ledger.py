"""The per-device write-id ledger: which write ids of a device were applied, kept in a
form compact enough to keep for as long as a replay could come (PROTOCOL "Write ids").

Each file's own ledger (store.py) keeps a write's first answer, but only the last 4,096
writes to that file for 7 days: a busy collection forgets an id within minutes, and a
replayed `mem.remember` of a forgotten row then wrote it again (issue 25). This ledger
answers a narrower question for every write id a board makes, `<boot>.<n>:<seq>` (run
`<boot>.<n>`, PROTOCOL "Boot id"): applied, never seen, or too old to tell.

Per device (one document, a table each):

    runs    "<n>/<boot>" -> {s: [[lo, hi], ...] applied seqs, at: last write (s)}
    boots   boot -> {floor, at, o}: every run n <= floor of the boot is closed
    closed  boot -> {at}: a boot whose every run is closed

A run is open while it writes; 7 days after its last write (as long as a scope ticket,
so a run waiting on a person is still open) it closes: its seqs are let go and its
boot's `floor` rises to it. A boot closes once all its runs have, 7 days after its last
write and after the device booted again (a later boot has written); then only its id is
kept. A write id of a closed run or boot is STALE: it may have been applied, and nothing
can tell, so it is refused and never applied. A replay is therefore either APPLIED
(answered, nothing done) or STALE (refused): a forgotten row cannot come back however
late it comes. The price is on the other side: a run's own first write, or a retry,
more than 7 days after the run (or, for a run not yet written, a later run of its boot)
last wrote is refused too, and must be written again under a new id.

Bounds, per device: RANGES_CAP seq ranges over the open runs (a run whose writes all
landed is one range; past the cap the runs written longest ago close early, counted in
`closed_early`) and CLOSED_CAP closed boots (past it the oldest id is let go, counted in
`closed_dropped`: a replay from a boot that many boots ago is the one the ledger can no
longer tell from a new boot). About 45 bytes a run and 27 a closed boot: at both caps
the file is 306 KiB (tests/test_memory_forget_replay.py measures it), a device with a
few dozen runs a week a few KiB; a device that boots once a day reaches the boot cap
after 11 years.

The cost: a second small file renamed (and fsynced) with each write. Measured on a shared
2-core machine, 2 writes a run to a 20-row collection: 1.2 ms a write without it, 2.5
with it at 100 open runs, 4-5 ms against 7 at 1,000 open runs (a 45 KiB file). Kept
apart from the data all the same: inside each data file it would be rewritten per
collection and multiplied by every device writing a shared (`tenant`) field.

A write id of another shape (no `:<seq>` integer) is not in this ledger: only its file's
ledger knows it, for as long as that keeps it.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "APPLIED",
    "CLOSED_CAP",
    "NEW",
    "RANGES_CAP",
    "RUN_TTL_S",
    "STALE",
    "parse",
    "record",
    "status",
]

NEW = "new"
APPLIED = "applied"
STALE = "stale"

# A run closes 7 days after its last write: as long as a scope ticket lives, so a run
# paused on a person is still open when it resumes (PROTOCOL "Scopes").
RUN_TTL_S = 7 * 24 * 3600
# Seq ranges kept over a device's open runs: 4,096 runs whose writes all landed, or
# fewer with holes (refused writes). The file is rewritten with every write of the
# device, so it must stay small next to the data it guards.
RANGES_CAP = 4096
# Closed boots whose id is kept (about 30 bytes each in the file).
CLOSED_CAP = 4096

_WID = re.compile(r"(.+):([0-9]{1,15})")
_RUN = re.compile(r"(.+)\.([0-9]{1,15})")

Doc = dict[str, Any]


def parse(w: str) -> tuple[str, int, int] | None:
    """(boot, n, seq) of a write id `<boot>.<n>:<seq>`; a run id without `.<n>` is a boot
    of its own with n 0. None for any other shape."""
    m = _WID.fullmatch(w)
    if m is None:
        return None
    run, seq = m.group(1), int(m.group(2))
    r = _RUN.fullmatch(run)
    if r is None:
        return run, 0, seq
    return r.group(1), int(r.group(2)), seq


def _rid(boot: str, n: int) -> str:
    return f"{n}/{boot}"


def _split(rid: str) -> tuple[str, int]:
    n, _, boot = rid.partition("/")
    return boot, int(n)


def status(doc: Doc, w: str) -> str:
    """NEW, APPLIED or STALE: what this device's ledger knows of write id `w`."""
    got = parse(w)
    if got is None:
        return NEW
    boot, n, seq = got
    if boot in doc.get("closed", {}):
        return STALE
    run = doc.get("runs", {}).get(_rid(boot, n))
    if run is not None:
        return APPLIED if any(lo <= seq <= hi for lo, hi in run["s"]) else NEW
    b = doc.get("boots", {}).get(boot)
    if b is not None and n <= b["floor"]:
        return STALE
    return NEW


def _add(ranges: list[list[int]], seq: int) -> list[list[int]]:
    out = sorted([*([lo, hi] for lo, hi in ranges), [seq, seq]])
    merged: list[list[int]] = []
    for lo, hi in out:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return merged


def record(
    doc: Doc,
    w: str,
    now: float,
    *,
    ranges_cap: int = RANGES_CAP,
    closed_cap: int = CLOSED_CAP,
) -> Doc | None:
    """The document with `w` recorded as applied at `now` (and what has aged out closed),
    or None when `w` is not of the ledger's shape. `doc` is not changed."""
    got = parse(w)
    if got is None:
        return None
    boot, n, seq = got
    runs: dict[str, dict[str, Any]] = dict(doc.get("runs", {}))
    boots: dict[str, dict[str, Any]] = dict(doc.get("boots", {}))
    closed: dict[str, dict[str, Any]] = dict(doc.get("closed", {}))
    m = dict(doc.get("meta", {}).get("m", {}))
    rid = _rid(boot, n)
    old = runs.get(rid)
    # Whole seconds: the file is rewritten with every write of the device.
    at = int(now) if old is None else max(int(now), old["at"])
    runs[rid] = {"s": _add(old["s"] if old else [], seq), "at": at}
    b = boots.get(boot)
    if b is None:
        m["o"] = int(m.get("o", 0)) + 1
        boots[boot] = {"floor": -1, "at": at, "o": m["o"]}
    else:
        boots[boot] = {**b, "at": max(b["at"], at)}

    def close(key: str) -> None:
        del runs[key]
        b, rn = _split(key)
        boots[b] = {**boots[b], "floor": max(boots[b]["floor"], rn)}

    cut = now - RUN_TTL_S
    for key in [k for k, r in runs.items() if r["at"] < cut]:
        close(key)
    total = sum(len(r["s"]) for r in runs.values())
    if total > ranges_cap:
        for key in sorted(runs, key=lambda k: runs[k]["at"]):
            if total <= ranges_cap:
                break
            if key == rid:
                continue
            total -= len(runs[key]["s"])
            close(key)
            m["closed_early"] = int(m.get("closed_early", 0)) + 1
    open_boots = {_split(k)[0] for k in runs}
    latest = max(x["o"] for x in boots.values())
    for name in [k for k, x in boots.items() if k not in open_boots and x["at"] < cut]:
        if boots[name]["o"] < latest:
            closed[name] = {"at": boots.pop(name)["at"]}
    if len(closed) > closed_cap:
        for name in sorted(closed, key=lambda k: closed[k]["at"])[: len(closed) - closed_cap]:
            del closed[name]
            m["closed_dropped"] = int(m.get("closed_dropped", 0)) + 1
    return {"meta": {"m": m}, "runs": runs, "boots": boots, "closed": closed}
