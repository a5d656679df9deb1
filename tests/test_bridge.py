"""The bridge against a real Mosquitto: RPC streaming, event intake with replay, host
requests with session tokens, and every refusal named, counted and survived.

The test plays the board and the host with plain paho clients; nothing of the bridge
is mocked. Every wait is bounded (queue.get(timeout=...), or polling with a deadline);
no assertion is about how long something took.
"""

from __future__ import annotations

import collections
import logging
import queue
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from server_bridge import tokens, wire
from server_bridge.bridge import Bridge, BridgeError
from server_bridge.config import BridgeConfig
from server_bridge.host.client import HostClient, RequestRefused
from server_bridge.intake import EventIntake
from server_bridge.models.base import Chunk, Final, ModelError
from server_bridge.models.scripted import ScriptedProvider
from server_bridge.registry import DeviceRecord, Registry
from server_bridge.wire import BOARD_DEFAULTS, MAX_ID, MAX_REASON
from tests.waiting import wait_for
from tools.broker import MosquittoProcess, free_port, start_mosquitto

SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(1, 33))
WAIT = 5.0

# ---------------------------------------------------------------- helpers


# A host's device topic P/h/T/D/evt, and the topics of that device's users' runs.
_HOST_EVT = re.compile(r"(?P<device>.*/h/[^/]+/[^/]+)(?P<user>/u/[^/]+)?/evt")


class Peer:
    """A paho client playing a board or a host: per-topic queues of decoded payloads.

    A host peer that subscribes to a device's P/h/T/D/evt reads as a watcher: it also
    subscribes to every user's runs of that device (P/h/T/D/u/+/evt) and reads all of
    them in one queue, the device topic's, in the order they came. Which topic an event
    goes to is tests/test_who_sees_what.py's; here it is what the bridge delivers.
    """

    def __init__(
        self,
        broker: MosquittoProcess,
        subscribe: Sequence[str] = (),
        client_id: str | None = None,
        clean_session: bool = True,
    ) -> None:
        # A plain dict behind a lock, not a defaultdict: paho's thread and the test's
        # thread may both be first to touch a topic, and must not get two queues.
        self._queues: dict[str, queue.Queue[Any]] = {}
        self._queues_lock = threading.Lock()
        self._subscribed = threading.Event()
        self._connected = threading.Event()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id or f"peer-{uuid.uuid4().hex[:10]}",
            protocol=mqtt.MQTTv311,
            clean_session=clean_session,
        )
        self.client.on_message = self._on_message
        self.client.on_connect = lambda *a: self._connected.set()
        self.client.on_disconnect = lambda *a: self._connected.clear()
        self.client.on_subscribe = lambda *a: self._subscribed.set()
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        assert self._connected.wait(WAIT), "peer did not connect"
        if subscribe:
            watched = [f"{m['device']}/u/+/evt" for t in subscribe if (m := _HOST_EVT.fullmatch(t))]
            self.client.subscribe([(t, 1) for t in [*subscribe, *watched]])
            assert self._subscribed.wait(WAIT), "peer subscription not acknowledged"

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def inbox(self, topic: str) -> queue.Queue[Any]:
        with self._queues_lock:
            return self._queues.setdefault(topic, queue.Queue())

    def _on_message(self, client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        m = _HOST_EVT.fullmatch(msg.topic)
        topic = f"{m['device']}/evt" if m else msg.topic
        self.inbox(topic).put(msgpack.unpackb(msg.payload, raw=False))

    def send(self, topic: str, obj: Any = None, raw: bytes | None = None) -> None:
        payload = raw if raw is not None else msgpack.packb(obj, use_bin_type=True)
        self.client.publish(topic, payload, qos=1).wait_for_publish(WAIT)

    def get(self, topic: str, timeout: float = WAIT) -> Any:
        try:
            return self.inbox(topic).get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"nothing arrived on {topic}") from None

    def empty(self, topic: str) -> bool:
        return self.inbox(topic).empty()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class World:
    """A running bridge, its registry, a board peer for dev1 and a host peer for acme."""

    def __init__(
        self,
        broker: MosquittoProcess,
        tmp: Path,
        provider: Any,
        memory: Any = None,
        knowledge: Any = None,
        events: Any = None,
        **config: Any,
    ) -> None:
        self.p = f"wren-test-{uuid.uuid4().hex[:8]}/v1"
        self.registry = Registry(tmp / "registry.json")
        self.registry.add_tenant("acme", SECRET)
        self.registry.add_tenant("globex", OTHER_SECRET)
        self.registry.add_device("dev1", "acme", "thermostat")
        self.registry.add_device("dev2", "globex", "kiosk")
        # Each World's bridge its own client id: its session is persistent, and bridges
        # of earlier tests (other prefixes) left theirs on the shared broker.
        config.setdefault("client_id", f"wren-bridge-{uuid.uuid4().hex[:8]}")
        # Runs end at once when their board's status says offline, unless a test is
        # about the grace (tests/test_bridge_lossless.py).
        config.setdefault("offline_grace_s", 0)
        cfg = BridgeConfig(
            host=broker.host,
            port=broker.port,
            username=None,
            password=None,
            prefix=self.p,
            **config,
        )
        self.bridge = Bridge(cfg, self.registry, provider, memory, knowledge, events)
        self.bridge.start()
        p = self.p
        self.board = Peer(broker, [f"{p}/d/dev1/rpc/res", f"{p}/d/dev1/req", f"{p}/d/dev1/ctl"])
        self.host = Peer(broker, [f"{p}/h/acme/dev1/evt"])

    # topics
    def d(self, leaf: str, device: str = "dev1") -> str:
        return f"{self.p}/d/{device}/{leaf}"

    def h(self, leaf: str, tenant: str = "acme", device: str = "dev1") -> str:
        return f"{self.p}/h/{tenant}/{device}/{leaf}"

    def call(self, c: Any, method: str, args: Mapping[str, Any], run: str = "run1") -> None:
        self.board.send(self.d("rpc"), {"c": c, "m": method, "a": dict(args), "r": run})

    def answers(self, device: str = "dev1") -> tuple[list[Any], dict[str, Any]]:
        """Chunks then the final answer of the next call on rpc/res.

        Acknowledges each chunk as a board does once it has consumed it: the bridge
        sends no more than the board's window of chunks beyond the last ack.
        """
        chunks = []
        while True:
            msg = self.board.get(self.d("rpc/res", device))
            if "ch" in msg:
                chunks.append(msg)
                self.board.send(self.d("rpc", device), {"c": msg["c"], "ack": msg["s"]})
            else:
                return chunks, msg

    def refused(self, kind: str, n: int = 1) -> None:
        wait_for(lambda: self.bridge.stats[f"refused.{kind}"] >= n, f"{n} refusal(s) of {kind}")

    def close(self) -> None:
        self.board.close()
        self.host.close()
        self.bridge.stop()
        self.registry.close()


@pytest.fixture
def world(broker: MosquittoProcess, tmp_path: Path) -> Iterator[World]:
    # A long replay retry: on a slow machine a retry must not add a replay request that
    # a test counting them does not expect (test_replay_keeps_asking sets its own).
    w = World(
        broker,
        tmp_path,
        ScriptedProvider(chunk_chars=6),
        replay_retry_s=60,
        replay_retry_max_s=60,
    )
    yield w
    w.close()


USER = {"role": "user", "content": "How warm is it?"}


def ev(i: int, t: str = "msg.delta", run: str = "r1", **d: Any) -> dict[str, Any]:
    """An event envelope; keyword arguments are its `d` fields."""
    return {"r": run, "i": i, "t": t, "ts": 1000 + i, "d": d or {"m": 1, "text": f"e{i}"}}


def check_valid_call_works(w: World, c: int = 99) -> None:
    w.call(c, "llm.complete", {"messages": [USER]})
    chunks, final = w.answers()
    assert final["c"] == c and final["ok"]["finish"] == "tool_calls"
    assert "".join(ch["ch"].get("text", "") for ch in chunks) == "Let me check the sensor."


# ---------------------------------------------------------------- RPC


def test_llm_complete_streams_chunks_then_the_final(world: World) -> None:
    world.call(1, "llm.complete", {"messages": [USER], "tools": [], "max_tokens": 100})
    chunks, final = world.answers()
    assert all(ch["c"] == 1 for ch in chunks)
    assert [ch["s"] for ch in chunks] == list(range(1, len(chunks) + 1))
    texts = [ch["ch"]["text"] for ch in chunks if "text" in ch["ch"]]
    # The provider's 6-character chunks, merged: the bridge holds text until the board's
    # `chunk` bytes are pending, a tool call comes, or merge_s has passed.
    assert "".join(texts) == "Let me check the sensor."
    assert chunks[-1]["ch"] == {"tool": {"call": "c1", "name": "read_temperature", "input": "{}"}}
    assert final["c"] == 1 and final["s"] == len(chunks) and "err" not in final
    assert final["ok"]["finish"] == "tool_calls"
    assert set(final["ok"]["usage"]) == {"in", "out", "reason"}

    # The second turn repeats what the board's tool returned.
    world.call(
        2,
        "llm.complete",
        {
            "messages": [
                USER,
                {"role": "assistant", "content": "Let me check the sensor.",
                 "tools": [{"call": "c1", "name": "read_temperature", "input": "{}"}]},
                {"role": "tool", "call": "c1", "content": "21.5"},
            ]
        },
    )  # fmt: skip
    chunks, final = world.answers()
    assert "".join(ch["ch"]["text"] for ch in chunks) == "It is 21.5 °C in here."
    assert final == {"c": 2, "s": len(chunks), "ok": final["ok"]}
    assert final["ok"]["finish"] == "stop"
    assert world.bridge.stats["rpc.ok"] == 2


def test_provider_error_is_an_llm_error(world: World) -> None:
    done = [USER, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    world.call(3, "llm.complete", {"messages": done})
    chunks, final = world.answers()
    assert chunks == []
    # A provider's failure carries its cause and whether asking again can help.
    err = {"kind": "llm", "msg": "script exhausted", "cause": "unavailable", "retryable": True}
    assert final == {"c": 3, "s": 0, "err": err}
    check_valid_call_works(world)


class LeakyProvider:
    """Fails with an exception whose text must not reach the board."""

    name = "leaky"

    def complete(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        emit: Callable[[Chunk], None],
        model: str | None = None,
        max_tokens: int | None = None,
        *,
        deadline: float | None = None,
    ) -> Final:
        emit({"text": "par"})
        raise LeakyError(
            "POST http://admin:hunter2@10.0.0.7/v1 with key sk-secret and "
            "Authorization: Bearer tok.en-42 failed"
        )


class LeakyError(RuntimeError):
    pass


def test_unexpected_provider_exception_is_logged_without_its_secrets(
    broker: MosquittoProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w = World(broker, tmp_path, LeakyProvider())
    try:
        # DEBUG: the traceback logged there is scrubbed too.
        with caplog.at_level(logging.DEBUG, logger="wren.bridge.rpc"):
            w.call(4, "llm.complete", {"messages": [USER]})
            chunks, final = w.answers()
        assert [ch["ch"] for ch in chunks] == [{"text": "par"}]
        assert final == {"c": 4, "s": 1, "err": {"kind": "llm", "msg": "the model call failed"}}
        for secret in ("sk-secret", "hunter2", "tok.en-42"):
            assert secret not in caplog.text
        # The operator still learns what failed, and where (at DEBUG) ...
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors and "LeakyError" in errors[0].getMessage()
        assert "10.0.0.7" in errors[0].getMessage()
        assert any("Traceback" in r.getMessage() for r in caplog.records if r.levelno == 10)
        # ... and no record carries the raw exception for a handler to format.
        assert not any(r.exc_info for r in caplog.records)
    finally:
        w.close()


class SlowProvider:
    """Blocks until released: shows paho's network thread is not the one waiting."""

    name = "slow"

    def __init__(self) -> None:
        self.release = threading.Event()

    def complete(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        emit: Callable[[Chunk], None],
        model: str | None = None,
        max_tokens: int | None = None,
        *,
        deadline: float | None = None,
    ) -> Final:
        if not self.release.wait(WAIT * 2):
            raise ModelError("never released")
        emit({"text": "too late"})
        return {"usage": {"in": 0, "out": 0, "reason": 0}, "finish": "stop"}


def test_slow_model_neither_blocks_the_link_nor_outlives_its_timeout(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    provider = SlowProvider()
    w = World(broker, tmp_path, provider, llm_timeout_s=0.5)
    try:
        w.call(5, "llm.complete", {"messages": [USER]})
        # While the model call hangs, events still flow.
        w.board.send(w.d("evt"), ev(1))
        assert w.host.get(w.h("evt"))["i"] == 1
        chunks, final = w.answers()
        assert chunks == []
        assert final["c"] == 5 and final["err"]["kind"] == "llm"
        provider.release.set()
        # The late chunk and answer of the released call are never sent.
        wait_for(lambda: w.bridge.rpc.inflight == 0, "the worker to finish")
        assert w.board.empty(w.d("rpc/res"))
        assert w.bridge.stats["rpc.timeout"] == 1
    finally:
        provider.release.set()
        w.close()


def test_unknown_method(world: World) -> None:
    world.call(6, "mem.teleport", {})
    _, final = world.answers()
    assert final["c"] == 6 and final["err"]["kind"] == "unknown_method"
    world.refused("unknown_method")
    check_valid_call_works(world)


@pytest.mark.parametrize(
    "payload, kind",
    [
        (b"\x84\xa1c\x01\xa1m", "truncated"),
        (b"\xdb\xff\xff\xff\xff", "too_large"),
        (b"\x81\xa1c" + b"\x91" * 40 + b"\x01", "too_deep"),
        (b"\x91" * 5000 + b"\x01", "too_deep"),
        (b"\xd4\x01\x00", "bad_type"),
        (b"\x80\x80", "bad_type"),
        (b"\xa0" * 20000, "too_large"),
        (msgpack.packb([1, "llm.complete"]), "bad_envelope"),
        (msgpack.packb({"m": "llm.complete", "a": {}}), "bad_envelope"),
        # Issue 25: an empty payload got no answer (taken for a retained message's clear).
        (b"", "bad_envelope"),
    ],
)
def test_undecodable_rpc_is_answered_with_c_nil(world: World, payload: bytes, kind: str) -> None:
    world.board.send(world.d("rpc"), raw=payload)
    _, final = world.answers()
    assert final["c"] is None
    assert final["err"]["kind"] == kind and final["err"]["msg"]
    world.refused(kind)
    assert any(r.kind == kind and r.topic == world.d("rpc") for r in world.bridge.refusals)
    check_valid_call_works(world)


def test_bad_arguments_keep_the_call_id(world: World) -> None:
    world.call(7, "llm.complete", {"messages": "hello"})
    _, final = world.answers()
    assert final["c"] == 7 and final["err"]["kind"] == "bad_envelope"
    world.call(8, "llm.complete", {"messages": [{"role": "wizard", "content": "x"}]})
    _, final = world.answers()
    assert final["c"] == 8 and final["err"]["kind"] == "bad_envelope"
    check_valid_call_works(world)


def test_unknown_device_is_refused_and_answered_with_one_link(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    # The one-link layout reads every board by wildcard: a device the registry does not
    # know is read, refused and answered.
    world = World(broker, tmp_path, ScriptedProvider(chunk_chars=6), tenant_links=1)
    ghost = Peer(broker, [world.d("rpc/res", "ghost")])
    try:
        ghost.send(
            world.d("rpc", "ghost"), {"c": 1, "m": "llm.complete", "a": {"messages": [USER]}}
        )
        msg = ghost.get(world.d("rpc/res", "ghost"))
        assert msg["c"] is None and msg["err"]["kind"] == "unknown_device"
        ghost.send(world.d("evt", "ghost"), ev(1))
        world.refused("unknown_device", 2)
        assert world.bridge.intake.runs("ghost") == []
    finally:
        ghost.close()
        world.close()


def test_links_read_only_the_registrys_devices_and_new_ones_within_a_check(
    world: World, broker: MosquittoProcess
) -> None:
    # With links (the default) boards are read by name: a device the registry does not
    # know is not read at all, neither answered nor refused (server_bridge/links.py).
    ghost = Peer(broker, [world.d("rpc/res", "ghost")])
    try:
        ghost.send(
            world.d("rpc", "ghost"), {"c": 1, "m": "llm.complete", "a": {"messages": [USER]}}
        )
        time.sleep(1.0)
        assert ghost.empty(world.d("rpc/res", "ghost"))
        assert world.bridge.stats["refused.unknown_device"] == 0
        assert f"{world.p}/d/dev2/rpc" in world.bridge.link_topics(1)  # globex's link
        # Registered while the bridge runs: read from the next check of the registry on,
        # on its tenant's link, and answered as any board is.
        world.registry.add_device("ghost", "globex", "kiosk")
        # Dealt to globex's link, and the broker's SUBACK for it read (the refresh's
        # own wait before it lets anything go).
        wait_for(
            lambda: f"{world.p}/d/ghost/rpc" in world.bridge.link_topics(1)
            and world.bridge._deal_acked.is_set(),
            "globex's link to read ghost",
        )
        ghost.send(world.d("rpc", "ghost"), {"c": 3, "m": "no.such", "a": {}})
        msg = ghost.get(world.d("rpc/res", "ghost"))
        assert msg["c"] == 3 and msg["err"]["kind"] == "unknown_method"
        assert world.bridge.stats["refused.unknown_device"] == 0
    finally:
        ghost.close()
    check_valid_call_works(world)


def test_a_deal_whose_suback_is_read_before_subscribe_returns_is_acknowledged(
    world: World, broker: MosquittoProcess
) -> None:
    # The link's SUBSCRIBE goes out on the refreshing thread at once, so the broker's
    # SUBACK can be read on the link's network thread before subscribe() has returned
    # its mid. Forced here: the real subscribe, then a wait (bounded) until the real
    # SUBACK has been handled, and only then the mid handed back.
    link = world.bridge._links[1]
    assert link is not None
    handled = threading.Event()
    on_subscribe, subscribe = link.on_subscribe, link.subscribe

    def after_on_subscribe(*args: Any) -> None:
        on_subscribe(*args)
        handled.set()

    def subscribe_then_wait(*args: Any, **kwargs: Any) -> Any:
        handled.clear()
        answer = subscribe(*args, **kwargs)
        assert handled.wait(WAIT), "the broker's SUBACK was not read"
        return answer

    link.on_subscribe = after_on_subscribe
    link.subscribe = subscribe_then_wait  # type: ignore[method-assign]
    try:
        world.registry.add_device("late", "globex", "kiosk")
        wait_for(
            lambda: f"{world.p}/d/late/rpc" in world.bridge.link_topics(1)
            and world.bridge._deal_acked.is_set(),
            "the deal acknowledged with its SUBACK read first",
        )
    finally:
        link.on_subscribe, link.subscribe = on_subscribe, subscribe  # type: ignore[method-assign]


def test_payload_identity_keys_change_nothing(world: World) -> None:
    # A board writing another tenant or device into its call is still dev1 of acme.
    world.board.send(
        world.d("rpc"),
        {"c": 9, "m": "llm.complete", "a": {"messages": [USER]}, "tenant": "globex",
         "device": "dev2", "user": "root", "usr": "root", "ten": "globex"},
    )  # fmt: skip
    chunks, final = world.answers()
    assert final["c"] == 9 and final["ok"]["finish"] == "tool_calls"
    world.board.send(world.d("evt"), dict(ev(1), tenant="globex", device="dev2"))
    got = world.host.get(world.h("evt"))  # acme's stream, not globex's
    assert got == ev(1)  # and the extra keys did not travel


def test_shared_subscription_shares_rpc_only(broker: MosquittoProcess, tmp_path: Path) -> None:
    w = World(broker, tmp_path, ScriptedProvider(), shared_subscription=True)
    try:
        p = w.p
        # RPC calls are spread over the processes; events stay whole per process (gap
        # tracking needs every id of a run), and so do hello, status and host input.
        assert w.bridge.subscriptions() == [
            f"$share/bridge/{p}/d/+/rpc",
            f"{p}/d/+/evt",
            f"{p}/d/+/hello",
            f"{p}/d/+/status",
            f"{p}/h/+/+/req",
            f"{p}/h/+/+/ctl",
        ]
        check_valid_call_works(w, c=1)
        w.board.send(w.d("evt"), ev(1))
        assert w.host.get(w.h("evt"))["i"] == 1
    finally:
        w.close()


def test_two_shared_bridges_each_see_every_event(broker: MosquittoProcess, tmp_path: Path) -> None:
    # Two bridge processes, as in production: whichever gets a run's events must get
    # all of them, or each would see holes, ask the board to replay, and give up.
    w = World(broker, tmp_path, ScriptedProvider(), shared_subscription=True)
    cfg = BridgeConfig(
        host=broker.host,
        port=broker.port,
        prefix=w.p,
        shared_subscription=True,
        client_id=f"{w.bridge.config.client_id}-2",  # a second process: an id of its own
    )
    other = Bridge(cfg, w.registry, ScriptedProvider())
    other.start()
    try:
        w.board.send(w.d("evt"), [ev(i) for i in range(1, 5)])
        for i in range(5, 9):
            w.board.send(w.d("evt"), ev(i))
        bridges = (w.bridge, other)
        wait_for(
            lambda: all(b.intake.expected("dev1", "r1") == 9 for b in bridges),
            "both bridges to see all 8 events",
        )
        assert [b.stats["replay.sent"] for b in bridges] == [0, 0]
    finally:
        other.stop()
        w.close()


# A long answer with 1-, 2-, 3- and 4-byte UTF-8 characters, so a cut at a byte budget
# would land inside characters if the splitter did not look.
LONG_TEXT = ("abc°€🙂" * 4000)[:20000]


def long_text_world(broker: MosquittoProcess, tmp_path: Path, script: Any) -> World:
    # chunk_chars larger than the text: the provider emits it as one chunk.
    return World(broker, tmp_path, ScriptedProvider(script, chunk_chars=100_000))


def test_a_long_text_chunk_is_split_to_the_default_limits(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    w = long_text_world(broker, tmp_path, [[{"text": LONG_TEXT}]])
    try:
        w.call(1, "llm.complete", {"messages": [USER]})  # no hello yet: the defaults
        chunks, final = w.answers()
        assert final["c"] == 1 and final["ok"]["finish"] == "stop"
        texts = [ch["ch"]["text"] for ch in chunks]
        assert len(texts) > 1 and "".join(texts) == LONG_TEXT
        for piece in texts:
            assert len(piece.encode()) <= 8192  # wire.Limits().max_str
        for ch in chunks:
            assert len(msgpack.packb(ch)) <= 16384  # wire.Limits().max_payload
        assert w.bridge.stats["rpc.chunks_split"] == 1
    finally:
        w.close()


def test_chunks_are_sized_by_the_boards_hello(broker: MosquittoProcess, tmp_path: Path) -> None:
    w = long_text_world(broker, tmp_path, [[{"reason": LONG_TEXT}, {"text": "ok"}]])
    try:
        limits = {"payload": 4096, "str": 1024, "items": 64, "depth": 8, "ring": 8}
        w.board.send(w.d("hello"), {"agent": "thermostat", "limits": limits})
        wait_for(lambda: w.bridge.hello("dev1"), "hello")
        w.call(2, "llm.complete", {"messages": [USER]})
        chunks, final = w.answers()
        assert final["c"] == 2 and "ok" in final
        reasons = [ch["ch"]["reason"] for ch in chunks if "reason" in ch["ch"]]
        assert "".join(reasons) == LONG_TEXT
        assert max(len(r.encode()) for r in reasons) <= 1024
        assert len(reasons) >= len(LONG_TEXT.encode()) // 1024
        assert chunks[-1]["ch"] == {"text": "ok"}
    finally:
        w.close()


def test_a_tool_call_the_board_cannot_decode_ends_the_call(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    script = [
        [
            {"text": "Saving."},
            {"tool": {"name": "save", "input": {"blob": "x" * 9000}}},  # over 8 KiB
            {"text": "never sent"},
        ]
    ]
    w = long_text_world(broker, tmp_path, script)
    try:
        w.call(3, "llm.complete", {"messages": [USER]})
        chunks, final = w.answers()
        assert [ch["ch"] for ch in chunks] == [{"text": "Saving."}]
        assert final["c"] == 3 and final["err"]["kind"] == "too_large"
        # This board sent no hello: it gets what the board runtime receives by default.
        assert f"string {BOARD_DEFAULTS.max_str}" in final["err"]["msg"]
        wait_for(lambda: w.bridge.rpc.inflight == 0, "the worker to stop")
        assert w.board.empty(w.d("rpc/res"))  # nothing after the answer
        assert w.bridge.stats["rpc.too_large"] == 1
    finally:
        w.close()


def test_bad_hello_limits_are_refused(world: World) -> None:
    world.board.send(world.d("hello"), {"agent": "thermostat", "limits": {"str": 0}})
    world.refused("bad_envelope")
    world.board.send(world.d("hello"), {"agent": "thermostat", "limits": {"payload": "big"}})
    world.refused("bad_envelope", 2)
    assert world.bridge.intake.device_limits("dev1") is None


# ---------------------------------------------------------------- events


def test_in_order_events_fan_out_one_per_message(world: World) -> None:
    world.board.send(
        world.d("evt"),
        ev(
            1,
            "run.started",
            agent="thermostat",
            ver="1",
            req="q1",
            conv="c1",
            domain="request",
            input="hi",
        ),
    )
    world.board.send(world.d("evt"), [ev(2), ev(3), ev(4, "run.done", usage={})])  # a batch
    got = [world.host.get(world.h("evt")) for _ in range(4)]
    assert [e["i"] for e in got] == [1, 2, 3, 4]
    assert got[3]["t"] == "run.done"
    assert [e["i"] for e in world.bridge.intake.events("dev1", "r1", after=2)] == [3, 4]
    assert world.bridge.intake.expected("dev1", "r1") == 5


def test_gap_asks_for_replay_and_hosts_see_strict_order(world: World) -> None:
    world.board.send(world.d("evt"), [ev(1), ev(2)])
    world.board.send(world.d("evt"), ev(5))  # 3 and 4 were lost on the way
    assert world.board.get(world.d("ctl")) == {"op": "replay", "r": "r1", "after": 2}
    world.board.send(world.d("evt"), ev(6))  # still the same hole: no second request
    wait_for(lambda: world.bridge.intake.held("dev1", "r1") == [5, 6], "5 and 6 held")
    # The board resends from its ring: 3, 4, 5, 6 (5 and 6 again).
    world.board.send(world.d("evt"), [ev(3), ev(4), ev(5), ev(6)])
    world.board.send(world.d("evt"), ev(7))
    got = [world.host.get(world.h("evt"))["i"] for _ in range(7)]
    assert got == [1, 2, 3, 4, 5, 6, 7]
    stats = world.bridge.stats
    assert stats["replay.sent"] == 1 and stats["evt.duplicate"] == 2
    assert world.board.empty(world.d("ctl"))


def test_lost_events_are_reported_not_papered_over(world: World) -> None:
    world.board.send(world.d("evt"), ev(1))
    world.board.send(world.d("evt"), [ev(5), ev(6)])
    assert world.board.get(world.d("ctl")) == {"op": "replay", "r": "r1", "after": 1}
    # The ring only had 5 and 6; it resends them and reports 2..4 as a gap (event 7).
    gap = ev(7, "error", kind="gap", msg="events 2..4 are no longer held")
    gap["d"].update({"from": 2, "to": 4})
    world.board.send(world.d("evt"), [ev(5), ev(6), gap])
    got = [world.host.get(world.h("evt")) for _ in range(4)]
    assert [e["i"] for e in got] == [1, 5, 6, 7]
    assert got[3]["d"]["kind"] == "gap" and (got[3]["d"]["from"], got[3]["d"]["to"]) == (2, 4)
    assert world.bridge.stats["evt.lost"] == 3
    world.board.send(world.d("evt"), ev(8))
    assert world.host.get(world.h("evt"))["i"] == 8


def test_replay_keeps_asking(broker: MosquittoProcess, tmp_path: Path) -> None:
    # The old contract gave up after replay_max_attempts; now the bridge asks for as long
    # as an id below the highest seen is missing (tests/test_bridge_lossless.py has more).
    w = World(broker, tmp_path, ScriptedProvider(), replay_retry_s=0.05, replay_retry_max_s=0.1)
    try:
        w.board.send(w.d("evt"), ev(3, run="r9"))
        asks = [w.board.get(w.d("ctl")) for _ in range(5)]
        assert asks == [{"op": "replay", "r": "r9", "after": 0}] * 5
        # A late resend completes the run in order, and the asking stops.
        w.board.send(w.d("evt"), [ev(1, run="r9"), ev(2, run="r9"), ev(3, run="r9")])
        assert [w.host.get(w.h("evt"))["i"] for _ in range(3)] == [1, 2, 3]
        sent = w.bridge.stats["replay.sent"]
        # Every request sent reaches the board; none follows once the hole is closed.
        wait_for(lambda: w.board.inbox(w.d("ctl")).qsize() == sent - 5, "the last requests")
        w.board.send(w.d("evt"), ev(4, run="r9"))  # a marker: the hole closed before it
        assert w.host.get(w.h("evt"))["i"] == 4
        assert w.bridge.stats["replay.sent"] == sent
    finally:
        w.close()


def test_runs_and_the_device_stream_are_separate(world: World) -> None:
    world.board.send(world.d("evt"), ev(1, run="a"))
    world.board.send(world.d("evt"), ev(1, "error", run="_", kind="busy", msg="full"))
    world.board.send(world.d("evt"), ev(2, run="a"))
    got = [world.host.get(world.h("evt")) for _ in range(3)]
    assert [(e["r"], e["i"]) for e in got] == [("a", 1), ("_", 1), ("a", 2)]


@pytest.mark.parametrize(
    "payload, kind",
    [
        (msgpack.packb(42), "bad_envelope"),
        (msgpack.packb("run.started"), "bad_envelope"),
        (msgpack.packb(ev(1, "run.exploded")), "unknown_type"),
        (msgpack.packb([ev(1), ev(2, "nope")]), "unknown_type"),
        (msgpack.packb({"r": "r1", "i": "1", "t": "msg.delta", "ts": 1, "d": {}}), "bad_envelope"),
        (b"\x85\xa1r\xa2r1", "truncated"),
        (b"\xdb\xff\xff\xff\xff", "too_large"),
        (b"\x91" * 17 + b"\x01", "too_deep"),
        (b"\xc1", "bad_type"),
    ],
)
def test_bad_events_are_refused_and_the_stream_goes_on(
    world: World, payload: bytes, kind: str
) -> None:
    world.board.send(world.d("evt"), raw=payload)
    world.refused(kind)
    assert world.bridge.refusals[-1].kind == kind
    world.board.send(world.d("evt"), ev(1))
    assert world.host.get(world.h("evt")) == ev(1)
    assert world.board.empty(world.d("ctl"))


def test_switching_layouts_leaves_no_session_that_reads_a_board_twice(
    broker: MosquittoProcess, tmp_path: Path
) -> None:
    # Links, then one link, then links again, one client id and prefix throughout: each
    # start clears what the persistent sessions of the last layout still hold, so every
    # call is read once and no unused link's session queues boards' messages.
    world = World(broker, tmp_path, ScriptedProvider(chunk_chars=6))
    cfg = world.bridge.config
    try:
        world.bridge.stop()
        one = Bridge(replace(cfg, tenant_links=1), world.registry, ScriptedProvider())
        one.start()
        one.stop()
        # An unused link's session is gone: a login with its client id finds none.
        present: list[bool] = []
        probe = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cfg.link_login(1)[0],
                            protocol=mqtt.MQTTv311, clean_session=False)  # fmt: skip
        probe.on_connect = lambda c, u, flags, rc, p: present.append(flags.session_present)
        probe.connect(broker.host, broker.port)
        probe.loop_start()
        wait_for(lambda: present, "the probe to connect")
        probe.disconnect()
        probe.loop_stop()
        assert present == [False]
        # One link's wildcard on the control connection is dropped by links: one answer.
        world.bridge = Bridge(replace(cfg, tenant_links=1), world.registry, ScriptedProvider())
        world.bridge.start()
        world.bridge.stop()
        world.bridge = Bridge(cfg, world.registry, ScriptedProvider())
        world.bridge.start()
        world.call(1, "no.such", {})
        _, final = world.answers()
        assert final["c"] == 1 and final["err"]["kind"] == "unknown_method"
        time.sleep(1.0)
        assert world.board.empty(world.d("rpc/res")), "a call was answered twice"
    finally:
        world.close()


@pytest.mark.parametrize("links", [1, 4])
def test_bad_topic_levels_are_refused(broker: MosquittoProcess, tmp_path: Path, links: int) -> None:
    # A host topic with a bad level is refused in both layouts; a board topic is too
    # where boards are read by wildcard (one link). With links, boards are read by their
    # registered names, which are good levels, so such a topic is not read at all.
    world = World(broker, tmp_path, ScriptedProvider(chunk_chars=6), tenant_links=links)
    try:
        world.board.send(f"{world.p}/d/DEV1/evt", ev(1))
        world.board.send(f"{world.p}/d/dev.1/rpc", {"c": 1, "m": "llm.complete", "a": {}})
        world.board.send(f"{world.p}/h/ACME/dev1/req", {"req": "q", "input": "x"})
        world.refused("bad_topic", 3 if links == 1 else 1)
        world.board.send(world.d("evt"), ev(1))
        assert world.host.get(world.h("evt"))["i"] == 1
        assert world.bridge.stats["refused.bad_topic"] == (3 if links == 1 else 1)
    finally:
        world.close()


def test_hello_and_status_are_kept(world: World) -> None:
    hello = {
        "agent": "thermostat", "ver": "1.0", "fw": "mp-1.24",
        "fields": [], "tools": [{"name": "read_temperature", "description": "°C",
                                 "args": {}, "client": False}],
        "limits": {"payload": 16384, "str": 8192, "items": 256, "depth": 16, "ring": 32},
    }  # fmt: skip
    world.board.send(world.d("hello"), hello)
    assert wait_for(lambda: world.bridge.hello("dev1"), "hello") == hello
    world.board.send(world.d("status"), {"st": "online", "fw": "mp-1.24", "heap": 90000})
    presence = wait_for(lambda: world.bridge.presence("dev1"), "status")
    assert presence["st"] == "online"
    world.board.send(world.d("status"), {"st": "asleep"})
    world.refused("bad_envelope")
    world.board.send(world.d("hello"), [1, 2])
    world.refused("bad_envelope", 2)
    assert (world.bridge.presence("dev1") or {}).get("st") == "online"


# ---------------------------------------------------------------- host requests


def token(
    user: str, tenant: str = "acme", secret: bytes = SECRET, ttl: int = 600, watch: bool = False
) -> str:
    return tokens.sign(secret, tenant, user, ttl_s=ttl, watch=watch)


def test_host_req_carries_the_tokens_user(world: World) -> None:
    world.host.send(
        world.h("req"),
        {"req": "q1", "conv": "c1", "input": "How warm is it?", "ttl": 60,
         "tok": token("alice"), "usr": "admin", "ten": "globex", "device": "dev2",
         "tenant": "globex", "user": "root"},
    )  # fmt: skip
    got = world.board.get(world.d("req"))
    ticket = got.pop("sc")
    assert got == {"req": "q1", "conv": "c1", "usr": "alice", "input": "How warm is it?",
                   "ttl": 60}  # fmt: skip
    assert world.bridge.stats["host.req"] == 1
    # The scope ticket names the token's user, the request's conversation and the
    # topic's device, whatever keys the payload carried.
    scope = tokens.verify_scope(SECRET, ticket, "acme", "dev1")
    assert (scope.user, scope.conv, scope.device) == ("alice", "c1", "dev1")


def test_host_req_refusals(world: World) -> None:
    def send(tok: object, tenant: str = "acme", device: str = "dev1", **extra: Any) -> None:
        world.host.send(
            world.h("req", tenant, device), {"req": "q", "input": "x", "tok": tok, **extra}
        )

    send(token("mallory", secret=OTHER_SECRET), usr="admin")  # forged: wrong secret
    send(token("alice", ttl=-10))  # expired
    send(token("alice", tenant="globex", secret=OTHER_SECRET))  # another tenant's token
    send("not-a-token")
    send(None)
    world.refused("bad_token", 5)
    send(token("alice"), device="dev2")  # dev2 is globex's
    send(token("bob", "globex", OTHER_SECRET), tenant="globex")  # dev1 is acme's
    send(token("alice"), device="ghost")
    world.refused("unknown_device", 3)
    world.host.send(world.h("req"), {"req": "q", "tok": token("alice")})  # no input
    world.host.send(world.h("req"), raw=b"\xdb\xff\xff\xff\xff")
    world.refused("bad_envelope")
    world.refused("too_large")
    assert world.board.empty(world.d("req"))
    # Afterwards a valid request goes through, and it is the first the board sees.
    send(token("alice"), usr="admin")
    got = world.board.get(world.d("req"))
    assert tokens.verify_scope(SECRET, got.pop("sc"), "acme", "dev1").user == "alice"
    assert got == {"req": "q", "usr": "alice", "input": "x"}


def test_req_without_conv_to_an_agent_with_session_state_is_refused_up_front(
    world: World,
) -> None:
    # Issue 25: such a request went on to the board, whose run then failed `link` (its
    # state.load refused no_scope: a ticket without a conversation reaches no session
    # field). Refused at the bridge by name, with the req, and never sent on.
    fields = [
        {"name": "mood", "dur": "user"},
        {"name": "topic", "dur": "session"},
        {"name": "notes", "dur": "session", "kind": "collection"},  # not loaded at start
    ]
    world.board.send(world.d("hello"), {"agent": "thermostat", "fields": fields})
    wait_for(lambda: world.bridge.hello("dev1"), "hello")
    world.host.send(world.h("req"), {"req": "q1", "input": "x", "tok": token("alice")})
    told = world.host.get(world.h("evt"))
    assert (told["r"], told["d"]["kind"], told["d"]["req"]) == ("_b", "no_scope", "q1")
    assert "topic" in told["d"]["msg"] and "needs a conv" in told["d"]["msg"], told
    assert "notes" not in told["d"]["msg"]
    world.refused("no_scope")
    assert world.board.empty(world.d("req"))
    # With a conversation it goes on, ticket and all.
    ok = {"req": "q2", "conv": "c1", "input": "x", "tok": token("alice")}
    world.host.send(world.h("req"), ok)
    got = world.board.get(world.d("req"))
    assert got["req"] == "q2" and got["conv"] == "c1" and "sc" in got


def host_ctl(w: World) -> Any:
    """The next ctl the board gets that is not the bridge's own replay request (it asks
    for what follows a run that went quiet)."""
    while (got := w.board.get(w.d("ctl")))["op"] == "replay":
        pass
    return got


def owned(w: World, user: str, *runs: str) -> None:
    """The board starts `runs` for `user` (their run.started says so, as a board's does)
    and the host has seen them: the bridge knows each run's user, whose it is to act on
    (server_bridge/access.py)."""
    for run in runs:
        w.board.send(w.d("evt"), ev(1, "run.started", run=run, req=f"q-{run}", usr=user))
        assert w.host.get(w.h("evt"))["r"] == run


def test_host_ctl(world: World) -> None:
    tok = token("alice")
    owned(world, "alice", "r1", "r2")
    world.host.send(world.h("ctl"), {"op": "cancel", "r": "r1", "tok": tok, "usr": "admin"})
    assert host_ctl(world) == {"op": "cancel", "r": "r1"}
    world.host.send(
        world.h("ctl"),
        {"op": "approve", "r": "r1", "call": "c1", "ok": True, "by": "admin", "tok": tok},
    )
    assert host_ctl(world) == {
        "op": "approve", "r": "r1", "call": "c1", "ok": True, "by": "alice"
    }  # fmt: skip
    world.host.send(
        world.h("ctl"),
        {"op": "tool", "r": "r1", "call": "c2", "output": "yes", "failed": False, "tok": tok},
    )
    assert host_ctl(world) == {
        "op": "tool", "r": "r1", "call": "c2", "output": "yes", "failed": False
    }  # fmt: skip
    world.host.send(world.h("ctl"), {"op": "reboot", "r": "r1", "tok": tok})
    world.refused("unknown_op")
    world.host.send(
        world.h("ctl"), {"op": "cancel", "r": "r1", "tok": token("x", secret=OTHER_SECRET)}
    )
    world.refused("bad_token")
    world.host.send(world.h("ctl"), {"op": "cancel", "r": "r2", "tok": tok})
    assert host_ctl(world) == {"op": "cancel", "r": "r2"}


def test_cancel_reason_reaches_the_board_cut_to_size(world: World) -> None:
    tok = token("alice")
    owned(world, "alice", "r1")
    world.host.send(world.h("ctl"), {"op": "cancel", "r": "r1", "reason": "user left", "tok": tok})
    assert host_ctl(world) == {"op": "cancel", "r": "r1", "reason": "user left"}
    world.host.send(world.h("ctl"), {"op": "cancel", "r": "r1", "reason": "z" * 5000, "tok": tok})
    got = host_ctl(world)
    assert got == {"op": "cancel", "r": "r1", "reason": "z" * MAX_REASON}


def test_overlong_host_ids_are_refused(world: World) -> None:
    tok = token("alice")
    long_id = "q" * (MAX_ID + 1)
    world.host.send(world.h("req"), {"req": long_id, "input": "x", "tok": tok})
    world.host.send(world.h("req"), {"req": "q", "conv": long_id, "input": "x", "tok": tok})
    world.host.send(world.h("ctl"), {"op": "cancel", "r": long_id, "tok": tok})
    world.host.send(world.h("ctl"), {"op": "tool", "r": "r1", "call": long_id, "tok": tok})
    world.refused("bad_envelope", 4)
    assert world.board.empty(world.d("req")) and world.board.empty(world.d("ctl"))
    # Each refusal is told to the host on the bridge stream, ids 1, 2, 3, 4; the one
    # whose req is usable names it, the one whose req was the problem does not.
    told = [world.host.get(world.h("evt")) for _ in range(4)]
    assert [(e["r"], e["i"], e["t"]) for e in told] == [("_b", i, "error") for i in (1, 2, 3, 4)]
    assert [e["d"]["kind"] for e in told] == ["bad_envelope"] * 4
    assert "req" not in told[0]["d"] and told[1]["d"]["req"] == "q"


# ---------------------------------------------------------------- refusals told to hosts


def test_refused_host_input_is_told_on_the_bridge_stream(
    world: World, broker: MosquittoProcess
) -> None:
    forged = token("mallory", secret=OTHER_SECRET)
    world.host.send(world.h("req"), {"req": "q1", "input": "x", "tok": forged})
    world.host.send(world.h("req"), raw=b"\xdb\xff\xff\xff\xff")  # undecodable: no req
    world.host.send(world.h("ctl"), {"op": "reboot", "r": "r1", "tok": forged})
    world.host.send(world.h("req"), {"req": "q2", "tok": token("alice")})  # no input
    told = [world.host.get(world.h("evt")) for _ in range(4)]
    assert [e["r"] for e in told] == ["_b"] * 4 and [e["i"] for e in told] == [1, 2, 3, 4]
    assert [(e["d"]["kind"], e["d"].get("req")) for e in told] == [
        ("bad_token", "q1"),
        ("too_large", None),
        ("unknown_op", None),
        ("bad_envelope", "q2"),
    ]
    for e in told:
        assert e["t"] == "error" and isinstance(e["ts"], int) and e["d"]["msg"]
        assert forged not in e["d"]["msg"] and forged.split(".")[1] not in e["d"]["msg"]
    assert world.bridge.stats["host.refusals_told"] == 4


def test_empty_host_req_and_ctl_are_refused_on_the_bridge_stream(world: World) -> None:
    # Issue 25: an empty host req got no answer at all (taken for a retained message's
    # clear): it is malformed input, refused and told like any other.
    world.host.send(world.h("req"), raw=b"")
    world.host.send(world.h("ctl"), raw=b"")
    told = [world.host.get(world.h("evt")) for _ in range(2)]
    assert [(e["r"], e["t"], e["d"]["kind"]) for e in told] == [("_b", "error", "bad_envelope")] * 2
    assert "empty payload" in told[0]["d"]["msg"] and "req" not in told[0]["d"]
    world.refused("bad_envelope", 2)
    assert world.bridge.stats.get("rx.empty", 0) == 0
    assert world.board.empty(world.d("req")) and world.board.empty(world.d("ctl"))


def test_refusals_go_to_the_senders_tenant_only(world: World, broker: MosquittoProcess) -> None:
    # acme asks for dev2, which is globex's: acme hears unknown_device on its own topic
    # for dev2; globex's hosts hear nothing.
    globex = Peer(broker, [world.h("evt", "globex", "dev2")])
    acme_dev2 = Peer(broker, [world.h("evt", "acme", "dev2")])
    try:
        world.host.send(
            world.h("req", "acme", "dev2"), {"req": "q", "input": "x", "tok": token("a")}
        )
        told = acme_dev2.get(world.h("evt", "acme", "dev2"))
        assert told["r"] == "_b" and told["d"]["kind"] == "unknown_device"
        assert told["d"]["req"] == "q"
        # A marker on globex's topic, sent after the refusal: it is the first thing there.
        world.board.send(world.d("evt", "dev2"), ev(1))
        assert globex.get(world.h("evt", "globex", "dev2")) == ev(1)
    finally:
        globex.close()
        acme_dev2.close()


def host_client(w: World, broker: MosquittoProcess) -> HostClient:
    client = HostClient(broker.host, broker.port, "acme", prefix=w.p)
    client.connect(timeout=WAIT)
    return client


def test_host_client_fails_fast_on_a_forged_token(world: World, broker: MosquittoProcess) -> None:
    with host_client(world, broker) as client:
        forged = token("mallory", secret=OTHER_SECRET)
        req = client.request("dev1", forged, "How warm is it?")
        # Far longer than the refusal takes: the point is that it raises RequestRefused
        # (at once, on the `_b` event), not TimeoutError at the end of the wait.
        with pytest.raises(RequestRefused) as info:
            client.wait_run(req, timeout=60)
        assert (info.value.kind, info.value.req) == ("bad_token", req)
        assert isinstance(info.value, RuntimeError)
        assert forged not in str(info.value)


def test_host_client_fails_fast_on_another_tenants_device(
    world: World, broker: MosquittoProcess
) -> None:
    with host_client(world, broker) as client:
        req = client.request("dev2", token("alice"), "hi")
        with pytest.raises(RequestRefused) as info:
            client.wait_run(req, timeout=60)
        assert info.value.kind == "unknown_device"
        # A valid request afterwards is not affected by the earlier refusal.
        ok = client.request("dev1", token("alice"), "hi", req="ok-1")
        assert world.board.get(world.d("req"))["req"] == ok
        with pytest.raises(TimeoutError):
            client.wait_run(ok, timeout=0.3)  # no board here: no run, but no refusal


# ---------------------------------------------------------------- resilience, lifecycle


def test_an_internal_error_is_logged_and_the_bridge_keeps_serving(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    # A corrupt registry file makes the device lookup raise inside the paho callback.
    path = Path(world.registry.path)
    good = path.read_bytes()
    path.write_text("{ not json")
    with caplog.at_level(logging.ERROR, logger="wren.bridge"):
        # The links' check of the registry (once a second) may be the read that meets
        # the corrupt file first; a lookup within the registry's recheck time after it
        # is served from the last good parse. So events until one lookup raises.
        def raised() -> bool:
            world.board.send(world.d("evt"), ev(1))
            return world.bridge.stats["callback_errors"] >= 1

        wait_for(raised, "the error to be counted")
    assert any(r.exc_info for r in caplog.records if "callback" in r.getMessage())
    path.write_bytes(good)
    world.board.send(world.d("evt"), ev(1))
    assert world.host.get(world.h("evt"))["i"] == 1
    check_valid_call_works(world)


def test_start_fails_clearly_without_a_broker(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "r.json")
    cfg = BridgeConfig(host="127.0.0.1", port=free_port(), connect_timeout_s=2)
    with pytest.raises(BridgeError, match="cannot reach the MQTT broker"):
        Bridge(cfg, registry, ScriptedProvider()).start()


def test_config_defaults_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WREN_BRIDGE_USER", "bridge")
    monkeypatch.setenv("WREN_BRIDGE_PASSWORD", "pw")
    cfg = BridgeConfig()
    assert (cfg.username, cfg.password, cfg.prefix) == ("bridge", "pw", "wren/v1")
    assert cfg.shared_subscription is False
    # Stable: the bridge's session is persistent and found again by this id. It follows
    # the user (a broker of brokerconf's makes it the user anyway), and is wren-bridge
    # without one.
    assert cfg.client_id == BridgeConfig().client_id == "bridge"
    assert BridgeConfig(username=None).client_id == "wren-bridge"
    assert BridgeConfig(client_id="mine").client_id == "mine"
    assert (cfg.replay_retry_s, cfg.replay_retry_max_s) == (2.0, 30.0)
    for bad in (
        {"prefix": "wren/#"},
        {"client_id": ""},
        {"replay_retry_s": 0},
        {"replay_retry_s": 5, "replay_retry_max_s": 4},
    ):
        with pytest.raises(ValueError):
            BridgeConfig(**bad)  # type: ignore[arg-type]


def test_broker_refusing_the_bridge_is_a_clear_error(tmp_path: Path) -> None:
    locked = start_mosquitto(tmp_path / "locked", allow_anonymous=False)
    try:
        registry = Registry(tmp_path / "r.json")
        cfg = BridgeConfig(host=locked.host, port=locked.port, username="who", password="x")
        with pytest.raises(BridgeError, match="refused"):
            Bridge(cfg, registry, ScriptedProvider()).start()
    finally:
        locked.stop()


def test_busy_beyond_max_inflight(broker: MosquittoProcess, tmp_path: Path) -> None:
    provider = SlowProvider()
    w = World(broker, tmp_path, provider, rpc_max_inflight=1)
    try:
        w.call(1, "llm.complete", {"messages": [USER]})
        wait_for(lambda: w.bridge.rpc.inflight == 1, "the first call to be running")
        w.call(2, "llm.complete", {"messages": [USER]})
        _, final = w.answers()
        assert final == {"c": 2, "err": {"kind": "busy", "msg": final["err"]["msg"]}}
        w.refused("busy")
        provider.release.set()
        chunks, final = w.answers()
        assert final["c"] == 1 and final["ok"]["finish"] == "stop"
    finally:
        provider.release.set()
        w.close()


def test_busy_is_per_device(broker: MosquittoProcess, tmp_path: Path) -> None:
    # dev1 at its own cap gets busy; dev2 (another tenant's board) still gets served.
    provider = SlowProvider()
    w = World(broker, tmp_path, provider, rpc_max_inflight_per_device=1, rpc_max_inflight=8)
    dev2 = Peer(broker, [w.d("rpc/res", "dev2")])
    try:
        w.call(1, "llm.complete", {"messages": [USER]})
        wait_for(lambda: w.bridge.rpc.inflight_of("dev1") == 1, "dev1's call to be running")
        w.call(2, "llm.complete", {"messages": [USER]})
        _, final = w.answers()
        assert final["c"] == 2 and final["err"]["kind"] == "busy"
        assert "dev1" in final["err"]["msg"]
        dev2.send(w.d("rpc", "dev2"), {"c": 7, "m": "llm.complete", "a": {"messages": [USER]}})
        wait_for(lambda: w.bridge.rpc.inflight_of("dev2") == 1, "dev2's call to be running")
        provider.release.set()
        _, final = w.answers()
        assert final["c"] == 1 and "ok" in final
        msg = dev2.get(w.d("rpc/res", "dev2"))
        while "ch" in msg:
            msg = dev2.get(w.d("rpc/res", "dev2"))
        assert msg["c"] == 7 and "ok" in msg
        wait_for(lambda: w.bridge.rpc.inflight == 0, "both calls to finish")
        assert w.bridge.rpc.inflight_of("dev1") == w.bridge.rpc.inflight_of("dev2") == 0
    finally:
        provider.release.set()
        dev2.close()
        w.close()


def test_nothing_is_dropped_while_the_broker_is_away(tmp_path: Path) -> None:
    own = start_mosquitto(tmp_path / "own")
    registry = Registry(tmp_path / "r.json")
    cfg = BridgeConfig(host=own.host, port=own.port, max_inflight_messages=3, max_queued_messages=4)
    bridge = Bridge(cfg, registry, ScriptedProvider())
    bridge.start()
    watcher: Peer | None = None
    try:
        # The start's own publishes (its presence) acknowledged first: one still in flight
        # when the broker goes would hold a place in the window of 3 until it is back.
        wait_for(lambda: bridge.outbox.depth()["outstanding"] == 0, "the start's PUBACKs")
        own.restart(down=lambda: _publish_while_down(bridge))
        # paho kept three for the reconnect; the lanes kept the other two; none refused.
        stats = bridge.stats
        assert stats["publish.queued_offline"] == 3
        assert stats["publish.queue_full"] == stats["publish.not_sent"] == 0
        # Back: all five (and the presence) reach the broker.
        wait_for(lambda: bridge.outbox.depth()["board"] == 0, "the lanes to empty", 40.0)
        wait_for(lambda: bridge.outbox.depth()["outstanding"] == 0, "every PUBACK", 40.0)
        assert bridge.stats["tx"] >= 6
    finally:
        if watcher is not None:
            watcher.close()
        bridge.stop()
        registry.close()
        own.stop()


def _publish_while_down(bridge: Bridge) -> None:
    # Both connections: `connected` is false once either has noticed, and paho takes a
    # publish as sent (not kept for the reconnect) while its socket is open still.
    wait_for(
        lambda: not (bridge.control_connected or bridge.events_connected), "the bridge to notice"
    )
    for _ in range(5):
        bridge._publish("p/h/acme/dev1/evt", b"x")
    wait_for(lambda: bridge.outbox.depth()["board"] == 2, "three messages handed to paho")
    # An RPC worker waits for room in the board lane only past its bound (1024).
    bridge._send_rpc("dev1", {"c": 1, "ok": {}}, time.monotonic() + 0.2)
    assert bridge.outbox.depth()["board"] == 3


def test_a_stopped_bridge_does_not_restart(world: World) -> None:
    world.bridge.stop()
    with pytest.raises(BridgeError):
        world.bridge.start()


# ---------------------------------------------------------------- intake rules, no broker
# The same EventIntake the bridge runs, fed directly, with a clock the test moves.

DEV = DeviceRecord("dev1", "acme", "thermostat")


class Sink:
    def __init__(self) -> None:
        self.now = 0.0
        self.sent: list[tuple[str, Any]] = []

    def publish(self, topic: str, payload: bytes) -> None:
        self.sent.append((topic.rsplit("/", 1)[-1], msgpack.unpackb(payload, raw=False)))

    def evts(self) -> list[int]:
        return [obj["i"] for leaf, obj in self.sent if leaf == "evt"]

    def ctls(self) -> list[dict[str, Any]]:
        return [obj for leaf, obj in self.sent if leaf == "ctl"]


def intake(sink: Sink, **kw: Any) -> EventIntake:
    counts: collections.Counter[str] = collections.Counter()
    # Runs end at once on an offline status unless a test is about the grace.
    kw.setdefault("offline_grace_s", 0)
    i = EventIntake(
        "p", sink.publish, lambda k, n: counts.update({k: n}), clock=lambda: sink.now, **kw
    )
    i.counts = counts  # type: ignore[attr-defined]
    return i


def test_hold_buffer_is_bounded_and_keeps_the_ids_nearest_the_hole() -> None:
    sink = Sink()
    it = intake(sink, hold=3)
    it.accept(DEV, [ev(9), ev(8), ev(7), ev(3)])
    assert it.held("dev1", "r1") == [3, 7, 8]
    assert sink.ctls() == [{"op": "replay", "r": "r1", "after": 0}]
    it.accept(DEV, [ev(i) for i in range(1, 10)])
    assert sink.evts() == list(range(1, 10))


def test_an_event_reported_lost_but_then_resent_is_delivered() -> None:
    sink = Sink()
    it = intake(sink)
    it.accept(DEV, [ev(1), ev(3), ev(6)])
    gap = ev(7, "error", kind="gap", msg="lost")
    gap["d"].update({"from": 2, "to": 5})
    it.accept(DEV, [gap])
    assert sink.evts() == [1, 3, 6, 7]
    assert it.counts["evt.lost"] == 3  # type: ignore[attr-defined]


def test_retry_wait_restarts_when_the_hole_moves() -> None:
    # Was test_retry_counts_restart_when_the_hole_moves, under the bounded-retry contract
    # (give up after replay_max_attempts). Now: the wait doubles up to its cap while the
    # hole stays, and is short again once the hole moved (the board is answering).
    sink = Sink()
    it = intake(sink, replay_retry_s=1.0, replay_retry_max_s=4.0)

    def asks_at(*times: float) -> list[int]:
        for t in times:
            sink.now = t
            it.tick()
        return [c["after"] for c in sink.ctls()]

    it.accept(DEV, [ev(1), ev(5)])
    assert asks_at(0.5) == [1]  # at once, then not yet due
    # Waits 1, 2, 4, 4, 4 ...: asked again at 1, 3, 7, 11, 15; never given up.
    assert asks_at(1.0, 2.9, 3.0, 6.9, 7.0, 10.9, 11.0, 15.0) == [1] * 6
    it.accept(DEV, [ev(2)])  # progress, but the retry is not yet due: no extra request
    assert asks_at(18.9) == [1] * 6
    assert asks_at(19.0, 19.9, 20.0) == [1] * 6 + [2, 2]  # the short wait again
    it.accept(DEV, [ev(3), ev(4)])
    assert sink.evts() == [1, 2, 3, 4, 5] and it.held("dev1", "r1") == []
    assert asks_at(100.0) == [1] * 6 + [2, 2]  # the hole is closed: nothing more to ask
    assert it.counts["replay.sent"] == 8  # type: ignore[attr-defined]


def test_runs_tracked_are_bounded() -> None:
    sink = Sink()
    it = intake(sink, max_runs=2, keep=2)
    for run in ("a", "b", "c"):
        it.accept(DEV, [ev(1, run=run), ev(2, run=run), ev(3, run=run)])
    assert sorted(it.runs("dev1")) == ["b", "c"]
    assert [e["i"] for e in it.events("dev1", "c")] == [2, 3]  # the window per run


DEV2 = DeviceRecord("dev2", "globex", "kiosk")


def test_a_device_over_its_run_cap_evicts_only_its_own_runs() -> None:
    sink = Sink()
    it = intake(sink, max_runs=4, max_runs_per_device=2)
    it.accept(DEV2, [ev(1, run="x"), ev(2, run="x")])  # globex's run, mid-way
    for run in ("a", "b", "c", "d", "e"):
        it.accept(DEV, [ev(1, run=run)])
    assert it.runs("dev2") == ["x"]
    assert sorted(it.runs("dev1")) == ["d", "e"]
    # dev2's run kept its place: its next event is in order, not a gap.
    it.accept(DEV2, [ev(3, run="x")])
    assert it.expected("dev2", "x") == 4 and sink.ctls() == []


def test_a_device_forgets_its_finished_runs_first() -> None:
    sink = Sink()
    it = intake(sink, max_runs_per_device=2)
    it.accept(DEV, [ev(1, run="live")])
    it.accept(DEV, [ev(1, run="old"), ev(2, "run.done", run="old", usage={})])
    it.accept(DEV, [ev(1, run="new")])
    assert sorted(it.runs("dev1")) == ["live", "new"]


def test_repeated_gap_reports_are_recorded_once() -> None:
    sink = Sink()
    it = intake(sink)
    it.accept(DEV, [ev(1), ev(6)])  # 2..5 missing
    gap = ev(7, "error", kind="gap", msg="lost")
    gap["d"].update({"from": 4, "to": 5})
    it.accept(DEV, [gap, gap, gap])  # the same report, delivered again (QoS 1, replay)
    assert it.lost("dev1", "r1") == [(4, 5)]
    wider = ev(8, "error", kind="gap", msg="lost")
    wider["d"].update({"from": 3, "to": 5})
    it.accept(DEV, [wider, wider])
    assert it.lost("dev1", "r1") == [(3, 5)]  # merged, not listed twice
    it.accept(DEV, [ev(2)])
    assert sink.evts() == [1, 2, 6, 7, 8] and it.lost("dev1", "r1") == []
    assert it.counts["evt.lost"] == 3  # type: ignore[attr-defined]


def test_a_gap_report_cannot_lose_ids_past_its_own() -> None:
    sink = Sink()
    it = intake(sink)
    it.accept(DEV, [ev(1)])
    lie = ev(3, "error", kind="gap", msg="lost")
    lie["d"].update({"from": 2, "to": 2**64 - 1})  # the widest uint64 the codec reads
    it.accept(DEV, [lie])
    # Only id 2 lay below the report: 1 lost, not 2**64 - 2, and the run goes on.
    assert it.counts["evt.lost"] == 1  # type: ignore[attr-defined]
    assert it.expected("dev1", "r1") == 4
    it.accept(DEV, [ev(4), ev(5, "run.done", usage={})])
    assert sink.evts() == [1, 3, 4, 5]


def test_a_run_the_bridge_stops_tracking_with_ids_missing_is_told_to_hosts() -> None:
    sink = Sink()
    it = intake(sink, max_runs_per_device=2)
    told: list[tuple[str, str, str, int, int, str, str | None]] = []
    it.on_ids_lost = lambda *notice: told.append(notice)
    # a: 2..3 missing, 4 held; alice's run, which the notice names after it is forgotten.
    it.accept(DEV, [ev(1, "run.started", run="a", usr="alice"), ev(4, run="a")])
    it.accept(DEV, [ev(1, run="b")])
    assert told == []
    it.accept(DEV, [ev(1, run="c")])  # over the device's cap: a, the oldest, goes
    assert it.runs("dev1") == ["b", "c"]
    assert [t[:5] for t in told] == [("acme", "dev1", "a", 2, 4)]
    assert "stopped tracking" in told[0][5] and told[0][6] == "alice"
    assert it.counts["evt.lost"] == 3  # type: ignore[attr-defined]
    # A finished run with nothing missing goes without a word.
    it.accept(DEV, [ev(2, "run.done", run="b", usage={})])
    it.accept(DEV, [ev(1, run="d")])
    assert len(told) == 1


def test_the_boards_unknown_run_answer_to_a_replay_ends_the_asking() -> None:
    sink = Sink()
    it = intake(sink)
    told: list[tuple[str, str, str, int, int, str]] = []
    it.on_ids_lost = lambda *notice: told.append(notice)
    it.accept(DEV, [ev(1), ev(5), ev(6, "run.done", usage={})])  # 2..4 missing
    assert sink.ctls() == [{"op": "replay", "r": "r1", "after": 1}]
    refusal = ev(1, "error", run="_", kind="unknown_run", msg="run r1 is no longer held")
    refusal["d"]["r"] = "r1"
    it.accept(DEV, [refusal])
    # Held 5 and 6 go out, 2..4 are told lost, and nothing is asked again.
    assert [t[:5] for t in told] == [("acme", "dev1", "r1", 2, 4)]
    assert sink.evts() == [1, 5, 6, 1] and it.lost("dev1", "r1") == []
    sink.now += 3600
    it.tick()
    assert len(sink.ctls()) == 1
    # The same answer again, or one about a run not being asked for, changes nothing.
    it.accept(DEV, [refusal])
    it.accept(DEV, [{**refusal, "i": 2, "d": {**refusal["d"], "r": "other"}}])
    assert len(told) == 1


def test_a_run_the_board_no_longer_holds_is_told_to_hosts_as_a_gap(world: World) -> None:
    world.board.send(world.d("evt"), ev(1))
    world.board.send(world.d("evt"), [ev(4), ev(5, "run.done", usage={})])
    assert world.board.get(world.d("ctl")) == {"op": "replay", "r": "r1", "after": 1}
    # The board rebooted its memory of r1 away: it answers unknown_run, naming the run.
    refusal = ev(1, "error", run="_", kind="unknown_run", msg="run r1 is no longer held")
    refusal["d"]["r"] = "r1"
    world.board.send(world.d("evt"), refusal)
    got = [world.host.get(world.h("evt")) for _ in range(5)]
    assert [(e["r"], e["i"]) for e in got[:3]] == [("r1", 1), ("r1", 4), ("r1", 5)]
    assert ("_", 1) in [(e["r"], e["i"]) for e in got]  # the board's refusal itself
    told = [e for e in got if e["r"] == "_b"]
    assert len(told) == 1 and told[0]["t"] == "error"
    assert {k: told[0]["d"][k] for k in ("kind", "r", "from", "to")} == {
        "kind": "gap",
        "r": "r1",
        "from": 2,
        "to": 3,
    }
    assert world.bridge.stats["host.gaps_told"] == 1
    assert world.board.empty(world.d("ctl"))  # and it stops asking


def _hello(tools: int) -> bytes:
    return msgpack.packb(
        {
            "agent": "thermostat",
            "boot": "0a0b0c0d",
            "tools": [{"name": f"t{k}", "description": "d" * 100} for k in range(tools)],
            "limits": {"payload": 8192, "str": 4096},
        }
    )


def test_hellos_are_kept_within_their_budget_and_their_limits_always() -> None:
    sink = Sink()
    one = len(_hello(10))
    it = intake(sink, hello_bytes=3 * one)
    devices = [DeviceRecord(f"d{k}", "acme", "thermostat") for k in range(5)]
    for device in devices:
        it.handle_hello(device, _hello(10))
        assert it.hello_used <= 3 * one
    # The two announced first were let go; every device's limits stay.
    assert [it.capabilities(d.device) is None for d in devices] == [True, True, False, False, False]
    assert all(it.device_limits(d.device) == wire.Limits.from_hello({"payload": 8192, "str": 4096})
               for d in devices)  # fmt: skip
    assert it.counts["hello.evicted"] == 2  # type: ignore[attr-defined]
    hello = it.capabilities("d4")
    assert hello is not None and len(hello["tools"]) == 10
    # A device saying hello again moves to the back and is charged once.
    it.handle_hello(devices[2], _hello(10))
    it.handle_hello(devices[0], _hello(10))
    assert it.capabilities("d2") is not None and it.capabilities("d3") is None
    assert it.hello_used == 3 * one


def test_a_status_keeps_only_what_presence_is() -> None:
    sink = Sink()
    it = intake(sink)
    status = {"st": "online", "fw": "f" * 5000, "heap": 90000, "boot": "0a0b0c0d",
              "junk": ["x" * 3000] * 3, "agent": True}  # fmt: skip
    it.handle_status(DEV, msgpack.packb(status))
    presence = it.presence("dev1")
    assert presence is not None
    assert set(presence) == {"st", "seen", "since", "fw", "heap", "boot"}
    assert presence["fw"] == "f" * 64 and presence["heap"] == 90000


def test_a_devices_tools_are_read_from_its_latest_hello() -> None:
    # What the HTTP device list gives the dashboard's forms: parsed once per hello.
    it = intake(Sink())
    assert it.tools("dev1") == []
    first = {"name": "open_valve", "description": "d", "args": {"type": "object"},
             "client": False, "approval": True, "extra": 1}  # fmt: skip
    it.handle_hello(DEV, msgpack.packb({"agent": "thermostat", "tools": [first, "junk"]}))
    got = it.tools("dev1")
    assert got == [{k: v for k, v in first.items() if k != "extra"}]
    assert it.tools("dev1") is got  # the same hello is not read again
    it.handle_hello(DEV, msgpack.packb({"agent": "thermostat", "tools": []}))
    assert it.tools("dev1") == []
