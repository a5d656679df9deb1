"""The bridge with its durable event log (issue "Hosts over HTTP"): every event hosts are
sent is appended, and a host's replay reads the log where the in-memory window no longer
holds the run, or after the bridge's restart; the replayed run folds to the same
snapshot as the live stream. The real bridge and Mosquitto; the board and the host are
MQTT peers (tests/test_bridge.py), so the events are exactly what a test sends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import server_bridge.bridge as bridge_module
from server_bridge.bridge import Bridge
from server_bridge.eventlog import EventLog
from server_bridge.host.client import HostClient
from server_bridge.models.scripted import ScriptedProvider
from tests.eventdata import fold
from tests.stack import DEVICE, HOST_USER, PREFIX, TENANT, Stack
from tests.test_bridge import World, token
from tests.waiting import wait_for
from tools.broker import MosquittoProcess

DELTAS = 300


def long_run(run: str = "r1", usr: str = "alice", conv: str = "c1") -> list[dict[str, Any]]:
    """A run shaped like a real model's answer: its run.started, then hundreds of tiny
    deltas, then its end; ids from 1 with no hole."""
    d_started = {"agent": "thermostat", "ver": "0.1.0", "req": "q1", "conv": conv, "usr": usr,
                 "domain": "request", "input": "How warm is it?"}  # fmt: skip
    body: list[tuple[str, dict[str, Any]]] = [("run.started", d_started), ("msg.start", {"m": 1})]
    body += [("msg.delta", {"m": 1, "text": f"w{k} "}) for k in range(DELTAS)]
    body += [("msg.end", {"m": 1}), ("run.done", {"usage": {"in": 12, "out": DELTAS}})]
    return [{"r": run, "i": i, "t": t, "ts": 1000 + i, "d": d}
            for i, (t, d) in enumerate(body, 1)]  # fmt: skip


def send(w: World, events: list[dict[str, Any]], batch: int = 25) -> None:
    # A board sends a few events per payload (its ring's batch).
    for k in range(0, len(events), batch):
        w.board.send(w.d("evt"), events[k : k + batch])


def take(w: World, n: int) -> list[dict[str, Any]]:
    return [w.host.get(w.h("evt")) for _ in range(n)]


def replay(w: World, tok: str, run: str = "r1", after: int = 0) -> None:
    w.host.send(w.h("ctl"), {"op": "replay", "r": run, "after": after, "tok": tok})


def restart(w: World, events: EventLog | None) -> None:
    """Stop the bridge and start another on the same config and registry: what it
    knows of earlier runs is only what the log kept."""
    config = w.bridge.config
    w.bridge.stop()
    w.bridge = Bridge(config, w.registry, ScriptedProvider(), None, None, events)
    w.bridge.start()


def test_a_restarted_bridge_replays_a_run_from_its_log(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    log = EventLog(tmp_path / "events")
    w = World(broker, tmp_path, ScriptedProvider(), events=log,
              replay_retry_s=60, replay_retry_max_s=60)  # fmt: skip
    second: EventLog | None = None
    try:
        run = long_run()
        send(w, run)
        live = take(w, len(run))
        assert live == run
        log.close()
        second = EventLog(tmp_path / "events")
        restart(w, second)
        assert w.bridge.intake.window("dev1", "r1") is None  # the window is gone

        replay(w, token("alice"))
        again = take(w, len(run))
        assert again == live
        assert fold(again) == fold(live)
        assert fold(again).status == "done"
        assert w.bridge.stats["host.replay_logged"] == len(run)
        assert w.bridge.stats["host.replay_gap"] == 0
        # The conversation's runs are a lookup in the log.
        assert second.runs_of("acme", "c1") == [("dev1", "r1")]

        # From the middle: only what comes after.
        replay(w, token("alice"), after=len(run) - 3)
        assert take(w, 3) == live[-3:]

        # Another user, not a watcher, may not replay alice's run from the log either.
        replay(w, token("bob"))
        w.refused("forbidden")
        (told,) = take(w, 1)  # bob's own topic, which this watching peer reads too
        assert (told["r"], told["d"]["kind"]) == ("_b", "forbidden")
        # A watcher may.
        replay(w, token("ops", watch=True), after=len(run) - 1)
        assert take(w, 1) == live[-1:]
    finally:
        w.close()
        for it in (log, second):
            if it is not None:
                it.close()


def test_a_replay_reads_the_log_below_the_window_with_no_gap(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    # A window of 3 events a run: the rest of the replay comes from the log, in order,
    # and the two parts meet without a hole or a repeat.
    log = EventLog(tmp_path / "events")
    w = World(broker, tmp_path, ScriptedProvider(), events=log, events_per_run=3,
              replay_retry_s=60, replay_retry_max_s=60)  # fmt: skip
    try:
        run = long_run()
        send(w, run)
        live = take(w, len(run))
        window = w.bridge.intake.window("dev1", "r1")
        assert window is not None and window.first == len(run) - 2

        replay(w, token("alice"))
        again = take(w, len(run))
        assert again == live
        assert w.bridge.stats["host.replay_logged"] == len(run) - 3
        assert w.bridge.stats["host.replay_gap"] == 0
    finally:
        w.close()
        log.close()


def test_events_the_log_could_not_take_still_go_live_and_replay_as_a_gap(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    # A log that refuses appends (closed here; a full disk in life) costs hosts nothing
    # live: the events go out, the misses are counted, and a replay after the window
    # let them go names them as a gap instead of skipping them in silence.
    log = EventLog(tmp_path / "events")
    w = World(broker, tmp_path, ScriptedProvider(), events=log, events_per_run=3,
              replay_retry_s=60, replay_retry_max_s=60)  # fmt: skip
    try:
        run = long_run()
        send(w, run[:100])
        assert take(w, 100) == run[:100]
        log.close()
        send(w, run[100:])
        assert take(w, len(run) - 100) == run[100:]
        assert w.bridge.stats["eventlog.failed"] == len(run) - 100

        replay(w, token("alice"))
        got = take(w, 100 + 1 + 3)
        assert got[:100] == run[:100]
        told = got[100]
        assert (told["r"], told["t"], told["d"]["kind"]) == ("_b", "error", "gap")
        assert (told["d"]["from"], told["d"]["to"]) == (101, len(run) - 3)
        assert got[101:] == run[-3:]
    finally:
        w.close()


def test_a_replay_past_its_cap_says_where_to_ask_again(
    broker: MosquittoProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bridge_module, "REPLAY_MAX_EVENTS", 100)
    log = EventLog(tmp_path / "events")
    w = World(broker, tmp_path, ScriptedProvider(), events=log, events_per_run=3,
              replay_retry_s=60, replay_retry_max_s=60)  # fmt: skip
    try:
        run = long_run()
        send(w, run)
        live = take(w, len(run))
        tok = token("alice")
        replay(w, tok)
        got = take(w, 101)
        assert got[:100] == live[:100]
        cut = got[100]
        assert (cut["r"], cut["d"]["kind"], cut["d"]["after"]) == ("_b", "replay_cut", 100)
        # Asked again after it, in steps, the host gets the whole run once.
        after, seen = 100, got[:100]
        while after < len(run):
            replay(w, tok, after=after)
            n = min(100, len(run) - after)
            part = take(w, n + (1 if len(run) - after > 100 else 0))
            seen += part[:n]
            after += n
        assert seen == live
    finally:
        w.close()
        log.close()


def test_a_recorded_run_replays_from_the_log_after_the_bridge_is_killed(tmp_path: Path) -> None:
    # The real board on the unix port, the `wren bridge` process with its default log
    # (events/ beside the registry), and a host that comes later: the bridge is killed
    # (-9: no stop, no last sync), started again, and a new host client reopens the run
    # by its id, from the log alone, to the same snapshot the first host saw live.
    with Stack(tmp_path) as s:
        live = s.ask("How warm is it in here?")
        assert live.status == "done", s.describe()
        segments = list((s.registry_path.parent / "events").glob("*/*.seg"))
        assert segments and all(p.stat().st_size for p in segments), s.describe()
        s.kill_bridge()
        s.start_bridge()
        later = HostClient(s.host, s.port, TENANT, username=HOST_USER,
                           password=s.users[HOST_USER], prefix=PREFIX)  # fmt: skip
        with later:
            later.connect(timeout=10)
            later.set_token(s.token, DEVICE)
            later.replay(DEVICE, live.run)
            again = later.wait_run(live.req, timeout=30)
        assert again == live
        assert [r.kind for r in again.rows] == [r.kind for r in live.rows]


def test_without_its_log_a_restarted_bridge_does_not_know_the_run(tmp_path: Path) -> None:
    # The same, with `--no-event-log`: the replay is refused unknown_run, and the run
    # the later host asked about stays unknown to it (what the log is for).
    with Stack(tmp_path, bridge_args=["--no-event-log"]) as s:
        live = s.ask("How warm is it in here?")
        assert live.status == "done", s.describe()
        assert not (s.registry_path.parent / "events").exists()
        s.kill_bridge()
        s.start_bridge()
        later = HostClient(s.host, s.port, TENANT, username=HOST_USER,
                           password=s.users[HOST_USER], prefix=PREFIX)  # fmt: skip
        with later:
            later.connect(timeout=10)
            later.set_token(s.token, DEVICE)
            later.replay(DEVICE, live.run)

            def unknown() -> list[str]:
                return [e["d"]["r"] for e in later.events if e["d"].get("kind") == "unknown_run"]

            wait_for(lambda: unknown(), "the bridge's answer to the replay", 30)
            assert unknown() == [live.run]
            assert later.find_run(live.req) is None
