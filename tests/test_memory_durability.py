"""Acknowledged memory writes survive the bridge being killed (SIGKILL) again and again.

The real service (`python -m server_bridge`, a child process) serves a board peer on a
real Mosquitto. The peer streams writes, each with its own write id, as a board does:
a row per write (`mem.remember`) and a counter (`state.commit`, merge `sum`). The
bridge is killed at random moments mid-stream and started again; the peer sends every
write it has no answer for again, with the same write id, as a board does after a
reconnect. At the end every acknowledged row is there and the counter counts each write
once: nothing acknowledged is lost, and nothing retried is applied twice.
"""

from __future__ import annotations

import queue
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from tests.test_cli import Proc
from tools.broker import MosquittoProcess

P = "wren/v1"
DEVICE = "dur1"
FIELDS = [
    {"name": "log", "dur": "subject", "kind": "collection", "max": 100_000},
    {"name": "count", "dur": "agent", "merge": "sum"},
]
HELLO = {"agent": "thermostat", "ver": "0.1.0", "fw": "test", "boot": "0000d0d0",
         "fields": FIELDS, "tools": [], "limits": {"payload": 16384, "str": 4096}}  # fmt: skip
KILLS = 6
WRITES = 240
# A kill after every this many acknowledged calls (of 2 * WRITES): the last one comes
# half-way, with half the calls still to go.
KILL_EVERY = WRITES // KILLS
WAIT_S = 30.0


class BoardPeer:
    """A board's side of the calls: each write keeps its write id until answered."""

    def __init__(self, broker: MosquittoProcess) -> None:
        self.answers: queue.Queue[dict[str, Any]] = queue.Queue()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=DEVICE)
        self.client.on_message = lambda c, u, m: self.answers.put(msgpack.unpackb(m.payload))
        self.client.connect(broker.host, broker.port)
        self.client.subscribe(f"{P}/d/{DEVICE}/rpc/res", 1)
        self.client.loop_start()
        self._c = 0

    def call(self, method: str, args: dict[str, Any]) -> int:
        self._c += 1
        msg = {"c": self._c, "m": method, "a": args, "r": "0000d0d0.1"}
        self.client.publish(f"{P}/d/{DEVICE}/rpc", msgpack.packb(msg), qos=1)
        return self._c

    def hello(self) -> None:
        self.client.publish(f"{P}/d/{DEVICE}/hello", msgpack.packb(HELLO), qos=1).wait_for_publish(
            5
        )

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def start_bridge(broker: MosquittoProcess, tmp: Path) -> Proc:
    bridge = Proc(
        [sys.executable, "-m", "server_bridge", "--broker", broker.address,
         "--client-id", "durability", "--tenant", "acme", "--device", f"{DEVICE}:thermostat",
         "--registry", str(tmp / "registry.json"), "--memory-dir", str(tmp / "memory")],
        tmp,
    )  # fmt: skip
    bridge.wait_for("bridge: ")
    return bridge


def writes(n: int) -> list[tuple[str, dict[str, Any]]]:
    """Write n: its row and its counter increment, each with a write id of its own."""
    return [
        ("mem.remember", {"field": "log", "key": f"k{n}", "value": n, "w": f"0000d0d0.1:r{n}"}),
        ("state.commit", {"writes": [{"field": "count", "value": 1, "w": f"0000d0d0.1:c{n}"}]}),
    ]


def test_acknowledged_writes_survive_sigkill_of_the_bridge(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    rng = random.Random(7)
    peer = BoardPeer(broker)
    bridge = start_bridge(broker, tmp_path)
    acked: set[str] = set()  # write ids answered ok
    pending: dict[int, tuple[str, dict[str, Any]]] = {}  # call id -> the call, unanswered
    todo = [call for n in range(WRITES) for call in writes(n)]
    kills = resent = 0
    try:
        peer.hello()
        killer: threading.Timer | None = None
        deadline = time.monotonic() + 90
        while (todo or pending) and time.monotonic() < deadline:
            if killer is None and kills < KILLS and len(acked) >= (kills + 1) * KILL_EVERY:
                # Mid-stream, at a random moment of the next 0.1 s. Paced by the writes
                # answered, not by the clock: a machine that serves the 480 calls in a
                # couple of seconds still gets every kill in before the end.
                killer = threading.Timer(rng.uniform(0, 0.1), bridge.proc.send_signal,
                                         (signal.SIGKILL,))  # fmt: skip
                killer.start()
            # Keep a few calls in flight, as a board's window does.
            while todo and len(pending) < 4:
                method, args = todo.pop(0)
                pending[peer.call(method, args)] = (method, args)
            try:
                answer = peer.answers.get(timeout=0.5)
            except queue.Empty:
                answer = None
            if answer is not None and answer.get("c") in pending:
                method, args = pending.pop(answer["c"])
                if answer.get("err", {}).get("kind") == "busy":
                    # After a restart the broker hands the new bridge the calls the old
                    # one never acknowledged, beside the ones sent again: past the
                    # device's in-flight limit, which is refused `busy` and sent again
                    # later, as a board does.
                    todo.insert(0, (method, args))
                    continue
                assert "ok" in answer, answer  # nothing else here is ever refused
                w = args.get("w") or args["writes"][0]["w"]
                if method == "state.commit":
                    assert "err" not in answer["ok"]["results"][0], answer
                acked.add(w)
            if bridge.proc.poll() is not None:
                # Killed: start it again, tell it the hello again (it keeps hellos in
                # memory), and send again, with the same write ids, what got no answer.
                kills += 1
                killer = None
                bridge = start_bridge(broker, tmp_path)
                peer.hello()
                time.sleep(0.3)
                resent += len(pending)
                todo = list(pending.values()) + todo
                pending.clear()
        assert not todo and not pending, f"{len(todo)} writes not sent, {len(pending)} unanswered"
        # The kills came mid-stream: writes were in flight and went again.
        assert kills == KILLS and resent > 0
        # Every write acknowledged, each applied once, after all those kills.
        keys: set[str] = set()
        cursor = None
        while True:
            args: dict[str, Any] = {"field": "log", "limit": 100}
            if cursor is not None:
                args["cursor"] = cursor
            c = peer.call("mem.list", args)
            answer = peer.answers.get(timeout=WAIT_S)
            assert answer["c"] == c, answer
            keys.update(row["key"] for row in answer["ok"]["rows"])
            cursor = answer["ok"]["cursor"]
            if cursor is None:
                break
        assert keys == {f"k{n}" for n in range(WRITES)}
        c = peer.call("state.load", {"fields": ["count"]})
        answer = peer.answers.get(timeout=WAIT_S)
        assert answer["c"] == c and answer["ok"]["values"] == {"count": WRITES}, answer
        assert len(acked) == 2 * WRITES
    finally:
        peer.close()
        if bridge.proc.poll() is None:
            bridge.proc.kill()
            bridge.proc.wait(10)
