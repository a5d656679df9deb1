"""Boards and hosts in bulk, as plain paho clients, for load and flood tests.

`FakeBoard` plays a board's event side: it publishes valid event envelopes as fast as
paho takes them (no pacing at all), keeps what it sent in a ring, and answers the
bridge's `ctl {op:"replay", r, after}` by resending from that ring — what a real board
does (PROTOCOL.md "Replay"), without a MicroPython process per board. `ring=None` keeps
everything it sent, so nothing is ever lost on the board side; a bounded ring reports
what it overwrote as a gap, as the real one does.

`HostTally` plays every host of a prefix, a watcher: it reads P/h/+/+/evt and
P/h/+/+/u/+/evt and keeps, per (tenant, device, run), the ids that arrived, so a test can
say "every id from 1 to n, no hole".
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgpack
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

WAIT = 10.0

__all__ = ["FakeBoard", "HostTally", "envelope"]


def envelope(run: str, i: int, text: str) -> dict[str, Any]:
    return {"r": run, "i": i, "t": "msg.delta", "ts": 1000 + i, "d": {"m": 1, "text": text}}


def _client(host: str, port: int, prefix: str) -> mqtt.Client:
    client = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id=f"{prefix.replace('/', '-')}-{uuid.uuid4().hex[:10]}",
        protocol=mqtt.MQTTv311,
    )
    return client


class FakeBoard:
    """One board's events: unpaced bursts, a ring, and replay answered from it."""

    def __init__(
        self,
        host: str,
        port: int,
        prefix: str,
        device: str,
        ring: int | None = None,
        inflight: int = 100,
    ) -> None:
        self.prefix, self.device = prefix, device
        self._ring_max = ring
        self._lock = threading.Lock()
        # (run, id) -> envelope, oldest first; `lost[run]` the highest id overwritten.
        self._ring: OrderedDict[tuple[str, int], dict[str, Any]] = OrderedDict()
        self._lost: dict[str, int] = {}
        self._next_gap: dict[str, int] = {}
        self.replays = 0
        self.reqs: list[dict[str, Any]] = []
        self.ctls: list[dict[str, Any]] = []
        self.on_req: Callable[[dict[str, Any]], None] | None = None
        self._connected = threading.Event()
        self._subscribed = threading.Event()
        self.client = _client(host, port, prefix)
        self.client.max_inflight_messages_set(inflight)
        self.client.on_connect = lambda *a: self._connected.set()
        self.client.on_subscribe = lambda *a: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect(host, port)
        self.client.loop_start()
        assert self._connected.wait(WAIT), f"board {device} did not connect"
        self.client.subscribe([(self._topic("ctl"), 1), (self._topic("req"), 1)])
        assert self._subscribed.wait(WAIT), f"board {device} subscription not acknowledged"

    def _topic(self, leaf: str) -> str:
        return f"{self.prefix}/d/{self.device}/{leaf}"

    def burst(self, run: str, n: int, text: str = "x" * 64, first: int = 1) -> None:
        """Publish events first..first+n-1 of `run`, one per message, without waiting."""
        topic = self._topic("evt")
        for i in range(first, first + n):
            env = envelope(run, i, text)
            with self._lock:
                self._keep(run, i, env)
            self.client.publish(topic, msgpack.packb(env), qos=1)

    def _keep(self, run: str, i: int, env: dict[str, Any]) -> None:
        self._ring[run, i] = env
        if self._ring_max is not None:
            while len(self._ring) > self._ring_max:
                (r, j), _ = self._ring.popitem(last=False)
                self._lost[r] = max(self._lost.get(r, 0), j)

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        obj = msgpack.unpackb(msg.payload, raw=False)
        if msg.topic.endswith("/req"):
            self.reqs.append(obj)
            if self.on_req is not None:
                self.on_req(obj)
            return
        self.ctls.append(obj)
        if obj.get("op") != "replay":
            return
        run, after = obj["r"], obj["after"]
        with self._lock:
            self.replays += 1
            again = [env for (r, i), env in self._ring.items() if r == run and i > after]
            lost = self._lost.get(run, 0)
            if lost > after:
                # What the ring overwrote is reported, as a real board does: an `error`
                # of kind gap, with the run's next id.
                nxt = max([i for (r, i) in self._ring if r == run], default=lost) + 1
                nxt = max(nxt, self._next_gap.get(run, 0))
                gap = {
                    "r": run, "i": nxt, "t": "error", "ts": 1000 + nxt,
                    "d": {"kind": "gap", "from": after + 1, "to": lost, "msg": "ring"},
                }  # fmt: skip
                self._keep(run, nxt, gap)
                self._next_gap[run] = nxt + 1
                again.append(gap)
        for env in again:
            client.publish(self._topic("evt"), msgpack.packb(env), qos=1)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class HostTally:
    """Every event on P/h/+/+/evt and P/h/+/+/u/+/evt (a watcher's view: the devices'
    topics and every user's runs), as ids per (tenant, device, run)."""

    def __init__(self, host: str, port: int, prefix: str) -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.ids: dict[tuple[str, str, str], set[int]] = {}
        self.events: list[dict[str, Any]] = []
        self.received = 0
        self._connected = threading.Event()
        self._subscribed = threading.Event()
        self.client = _client(host, port, prefix)
        self.client.on_connect = lambda *a: self._connected.set()
        self.client.on_subscribe = lambda *a: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect(host, port)
        self.client.loop_start()
        assert self._connected.wait(WAIT), "host did not connect"
        self.client.subscribe([(f"{prefix}/h/+/+/evt", 1), (f"{prefix}/h/+/+/u/+/evt", 1)])
        assert self._subscribed.wait(WAIT), "host subscription not acknowledged"

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        env = msgpack.unpackb(msg.payload, raw=False)
        _, tenant, device, _ = msg.topic[len(self.prefix) + 1 :].split("/")[:4]
        with self._cond:
            self.received += 1
            self.ids.setdefault((tenant, device, env["r"]), set()).add(env["i"])
            if env["r"] in ("_", "_b") or env["t"] == "error":
                self.events.append({"tenant": tenant, "device": device, **env})
            self._cond.notify_all()

    def holes(self, key: tuple[str, str, str], n: int) -> list[int]:
        """The ids of 1..n that have not arrived for `key`."""
        with self._lock:
            got = self.ids.get(key, set())
            return [i for i in range(1, n + 1) if i not in got]

    def wait_complete(self, want: dict[tuple[str, str, str], int], timeout: float) -> bool:
        """Wait (bounded) until every key has ids 1..n; False when the time is up."""
        deadline = time.monotonic() + timeout

        def done() -> bool:
            return all(len(self.ids.get(k, ())) >= n for k, n in want.items())

        with self._cond:
            while not done():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
            return True

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
