"""How the bridge paces an RPC stream to a board (PROTOCOL.md "RPC"): chunk sequence
numbers, the board's window of unacknowledged chunks, merged text, repeated calls, and
devices that go away mid-stream.

Against a real Mosquitto, with a paho client playing the board: it records every answer
and acknowledges chunks as it consumes them (at half its window, as the contract asks),
or stops acknowledging when a test says so. A few rules are shown on the RpcServer alone
where the test needs a clock it moves or a send it watches. Every wait is bounded; no
assertion is about how long something took.
"""

from __future__ import annotations

import collections
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from server_bridge import rpc as rpc_module
from server_bridge.bridge import Bridge
from server_bridge.config import BridgeConfig
from server_bridge.models.base import TOO_SLOW, Chunk, Final, ModelError
from server_bridge.registry import DeviceRecord, Registry
from server_bridge.rpc import RpcServer
from server_bridge.wire import Limits, encode
from tests.waiting import wait_for
from tools.broker import MosquittoProcess

WAIT = 5.0
FINAL: Final = {"usage": {"in": 0, "out": 0, "reason": 0}, "finish": "stop"}
USER = {"role": "user", "content": "Tell me everything."}
Play = Callable[[Callable[[Chunk], None]], None]


class PlayProvider:
    """A provider that plays `play(emit)` for each call and counts the calls."""

    name = "play"

    def __init__(self, play: Play) -> None:
        self.play = play
        self.calls = 0
        self._lock = threading.Lock()

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
        with self._lock:
            self.calls += 1
        self.play(emit)
        return FINAL


# ---------------------------------------------------------------- a board and a bridge


@dataclass
class Stream:
    """What the board received for one call."""

    chunks: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, Any] | None = None
    last_ack: int = 0  # the last ack the board sent
    most_unacked: int = 0  # the most of s - last_ack seen at any chunk

    def text(self, kind: str = "text") -> str:
        return "".join(ch["ch"].get(kind, "") for ch in self.chunks)


class Board:
    """dev1's RPC side on a paho client: records every answer on rpc/res in order and
    acknowledges chunks, from paho's callback, whenever half its window is unacked."""

    def __init__(self, broker: MosquittoProcess, prefix: str, window: int, ack: bool) -> None:
        self.topic = f"{prefix}/d/dev1/rpc"
        self.window = window
        self.acking = ack
        self.cond = threading.Condition()
        self.streams: dict[Any, Stream] = collections.defaultdict(Stream)
        self.order: list[dict[str, Any]] = []  # every answer, in arrival order
        subscribed = threading.Event()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"board-{uuid.uuid4().hex[:10]}",
            protocol=mqtt.MQTTv311,
        )
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        self.client.subscribe(f"{self.topic}/res", 1)
        assert subscribed.wait(WAIT), "board subscription not acknowledged"

    def _on_message(self, client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        obj = msgpack.unpackb(msg.payload, raw=False)
        with self.cond:
            self.order.append(obj)
            st = self.streams[obj.get("c")]
            if "ch" in obj:
                st.chunks.append(obj)
                st.most_unacked = max(st.most_unacked, obj["s"] - st.last_ack)
                if self.acking and obj["s"] - st.last_ack >= max(1, self.window // 2):
                    self._ack(obj["c"], obj["s"])
            else:
                st.final = obj
            self.cond.notify_all()

    def _ack(self, c: Any, s: int) -> None:  # under self.cond
        self.streams[c].last_ack = s
        # No wait_for_publish: this may run on paho's own thread.
        self.client.publish(self.topic, msgpack.packb({"c": c, "ack": s}), qos=1)

    def ack_all(self, c: Any, resume: bool = False) -> None:
        """Acknowledge every chunk of call c received so far (and ack from now on)."""
        with self.cond:
            self.acking = self.acking or resume
            chunks = self.streams[c].chunks
            if chunks:
                self._ack(c, chunks[-1]["s"])

    def send(self, obj: Any, leaf: str = "rpc") -> None:
        topic = self.topic if leaf == "rpc" else self.topic.rsplit("/", 1)[0] + "/" + leaf
        self.client.publish(topic, msgpack.packb(obj), qos=1).wait_for_publish(WAIT)

    def call(self, c: Any, method: str = "llm.complete", run: str = "run1") -> None:
        self.send({"c": c, "m": method, "a": {"messages": [USER]}, "r": run})

    def wait(self, pred: Callable[[], Any], what: str, timeout: float = WAIT) -> None:
        with self.cond:
            if not self.cond.wait_for(pred, timeout):
                raise AssertionError(f"board: timed out waiting for {what}")

    def done(self, c: Any) -> Stream:
        """The call's stream once its final answer is in."""
        self.wait(lambda: self.streams[c].final is not None, f"the final answer of call {c}")
        with self.cond:
            return self.streams[c]

    def count(self, c: Any) -> int:
        with self.cond:
            return len(self.streams[c].chunks)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class Stack:
    """A bridge serving dev1, and the board, which has said hello with its window and
    chunk size."""

    def __init__(
        self,
        broker: MosquittoProcess,
        tmp: Path,
        play: Play,
        *,
        window: int = 8,
        chunk: int = 512,
        ack: bool = True,
        **config: Any,
    ) -> None:
        prefix = f"wren-flow-{uuid.uuid4().hex[:8]}/v1"
        self.registry = Registry(tmp / "registry.json")
        self.registry.add_tenant("acme", bytes(range(32)))
        self.registry.add_device("dev1", "acme", "thermostat")
        self.provider = PlayProvider(play)
        cfg = BridgeConfig(
            host=broker.host,
            port=broker.port,
            username=None,
            password=None,
            prefix=prefix,
            **config,
        )
        self.bridge = Bridge(cfg, self.registry, self.provider)
        self.bridge.start()
        self.board = Board(broker, prefix, window, ack)
        limits = {"payload": 8192, "str": 8192, "window": window, "chunk": chunk}
        self.board.send({"agent": "thermostat", "boot": "0a1b2c3d", "limits": limits}, "hello")
        wait_for(lambda: self.bridge.intake.device_limits("dev1"), "the hello")

    def stat(self, name: str) -> int:
        return self.bridge.stats[name]

    def close(self) -> None:
        self.board.close()
        self.bridge.stop()
        self.registry.close()


@pytest.fixture
def stacks(broker: MosquittoProcess, tmp_path: Path) -> Iterator[Callable[..., Stack]]:
    made: list[Stack] = []

    def make(play: Play, **kw: Any) -> Stack:
        made.append(Stack(broker, tmp_path, play, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def assert_numbered(st: Stream) -> None:
    """s = 1, 2, 3 ... and the final counts them all."""
    assert [ch["s"] for ch in st.chunks] == list(range(1, len(st.chunks) + 1))
    assert st.final is not None and st.final["s"] == len(st.chunks)


def gate_emit(released: threading.Event, then: Play | None = None) -> Play:
    """A play that waits (bounded) for `released`, then plays `then`."""

    def play(emit: Callable[[Chunk], None]) -> None:
        if not released.wait(WAIT * 2):
            raise ModelError("never released")
        if then is not None:
            then(emit)

    return play


# ---------------------------------------------------------------- merging and pacing

ASCII_3000 = ("The quick brown fox jumps over the lazy dog. " * 70)[:3000]


def test_a_fast_stream_of_one_character_chunks_is_merged_and_paced(
    stacks: Callable[..., Stack],
) -> None:
    def play(emit: Callable[[Chunk], None]) -> None:
        for ch in ASCII_3000:
            emit({"text": ch})

    s = stacks(play, window=8, chunk=512)
    s.board.call(1)
    st = s.board.done(1)
    assert st.text() == ASCII_3000
    assert_numbered(st)
    n = len(st.chunks)
    # ceil(3000 / 512) = 6 full-speed; a little slack for a time-based flush on a slow
    # machine, but nowhere near one message per character.
    assert n <= math.ceil(3000 / 512) + 4
    assert all(len(ch["ch"]["text"].encode()) <= 512 for ch in st.chunks)
    assert st.most_unacked <= 8
    assert st.final is not None and st.final["ok"] == FINAL
    wait_for(lambda: s.stat("rpc.ok") == 1, "the call to be counted")
    assert s.stat("rpc.chunks") == n
    # ASCII pieces are exactly full, so every message but its first character was merged.
    assert s.stat("rpc.chunks_merged") == 3000 - n


def test_a_board_with_a_small_chunk_paces_a_long_stream(stacks: Callable[..., Stack]) -> None:
    # 1-, 2-, 3- and 4-byte characters one at a time, 16 bytes a chunk: some 160 chunks
    # through a window of 8, never cut inside a character.
    text = "a°€🙂" * 250

    def play(emit: Callable[[Chunk], None]) -> None:
        for ch in text:
            emit({"reason": ch})

    s = stacks(play, window=8, chunk=16)
    s.board.call(1)
    st = s.board.done(1)
    assert st.text("reason") == text
    assert_numbered(st)
    # A cut at a character boundary leaves at most 3 bytes of a 16-byte chunk unused.
    assert len(text.encode()) // 16 <= len(st.chunks) <= math.ceil(len(text.encode()) / 13) + 4
    assert all(len(ch["ch"]["reason"].encode()) <= 16 for ch in st.chunks)
    assert st.most_unacked <= 8


def test_a_board_that_stops_acking_holds_the_stream_at_its_window(
    stacks: Callable[..., Stack],
) -> None:
    def play(emit: Callable[[Chunk], None]) -> None:
        for k in range(20):
            emit({"text": chr(ord("a") + k) * 512})  # one full chunk each

    s = stacks(play, window=8, chunk=512, ack=False)
    s.board.call(1)
    s.board.wait(lambda: len(s.board.streams[1].chunks) >= 8, "8 chunks")
    wait_for(lambda: s.stat("rpc.window_waits") >= 1, "the worker to wait for acks")
    time.sleep(0.3)  # room for a ninth chunk to arrive if the bridge were to send one
    assert s.board.count(1) == 8 and s.board.streams[1].final is None
    s.board.ack_all(1)  # 8 consumed: 8 more may come, and no more
    s.board.wait(lambda: len(s.board.streams[1].chunks) >= 16, "16 chunks")
    wait_for(lambda: s.stat("rpc.window_waits") >= 2, "the worker to wait again")
    assert s.board.count(1) == 16
    s.board.ack_all(1, resume=True)
    st = s.board.done(1)
    assert st.text() == "".join(chr(ord("a") + k) * 512 for k in range(20))
    assert_numbered(st)
    assert st.most_unacked == 8


def test_text_of_a_stalled_provider_goes_out_after_merge_s(stacks: Callable[..., Stack]) -> None:
    got_abc = threading.Event()

    def play(emit: Callable[[Chunk], None]) -> None:
        emit({"text": "a"})
        emit({"text": "bc"})
        # Nothing more until the board has "abc": only the bridge's housekeeping can
        # have sent it, as the worker is here and not in emit.
        if not got_abc.wait(WAIT * 2):
            raise ModelError("the held text never went out")
        emit({"text": "!"})

    s = stacks(play)
    s.board.call(1)
    s.board.wait(lambda: s.board.streams[1].text() == "abc", "the held text")
    got_abc.set()
    st = s.board.done(1)
    # The first chunk goes at once (time to first token); "bc" waits merge_s.
    assert [ch["ch"] for ch in st.chunks] == [{"text": "a"}, {"text": "bc"}, {"text": "!"}]
    assert_numbered(st)
    assert st.final is not None and "ok" in st.final


def test_held_text_goes_out_before_a_tool_call_and_another_kind(
    stacks: Callable[..., Stack],
) -> None:
    tool = {"tool": {"call": "c1", "name": "read_temperature", "input": "{}"}}

    def play(emit: Callable[[Chunk], None]) -> None:
        for piece in ("Let", " me", " think"):
            emit({"reason": piece})
        for piece in ("I will", " look."):
            emit({"text": piece})
        emit(tool)
        emit({"text": "Done"})
        emit({"text": "."})

    s = stacks(play)
    s.board.call(1)
    st = s.board.done(1)
    assert [ch["ch"] for ch in st.chunks] == [
        {"reason": "Let"},  # the call's first chunk: at once
        {"reason": " me think"},
        {"text": "I will look."},
        tool,
        {"text": "Done."},
    ]
    assert_numbered(st)


# ---------------------------------------------------------------- sequence numbers


def test_final_answers_count_the_chunks_before_them(stacks: Callable[..., Stack]) -> None:
    def play(emit: Callable[[Chunk], None]) -> None:
        if s.provider.calls == 2:
            emit({"text": "x" * 600})  # 512 + 88
            emit({"text": "y"})
            raise ModelError("the model gave up")

    s = stacks(play)
    s.board.call(1)  # no chunks at all
    assert s.board.done(1).final == {"c": 1, "s": 0, "ok": FINAL}
    s.board.call(2)  # an error after some chunks: they go out first, and are counted
    st = s.board.done(2)
    assert [ch["ch"] for ch in st.chunks] == [{"text": "x" * 512}, {"text": "x" * 88 + "y"}]
    err = {"kind": "llm", "msg": "the model gave up", "cause": "unavailable", "retryable": True}
    assert st.final == {"c": 2, "s": 2, "err": err}
    # A refusal before a call starts has no s.
    s.board.call(3, method="mem.teleport")
    final = s.board.done(3).final
    assert final is not None and final["err"]["kind"] == "unknown_method" and "s" not in final


# ---------------------------------------------------------------- duplicates


def test_a_repeated_call_runs_once(stacks: Callable[..., Stack]) -> None:
    released = threading.Event()
    s = stacks(gate_emit(released, lambda emit: emit({"text": "once"})))
    try:
        s.board.call(1)
        wait_for(lambda: s.provider.calls == 1, "the provider to start")
        s.board.call(1)  # again while in flight (a QoS 1 resend with DUP)
        wait_for(lambda: s.stat("rpc.duplicate") == 1, "the repeat to be counted")
        released.set()
        st = s.board.done(1)
        assert st.text() == "once"
        wait_for(lambda: s.bridge.rpc.inflight == 0, "the call to be over")
        s.board.call(1)  # again after it finished
        wait_for(lambda: s.stat("rpc.duplicate") == 2, "the second repeat to be counted")
        s.board.call(2)  # a marker: its answers come after anything the repeats made
        s.board.done(2)
        assert s.provider.calls == 2  # calls 1 and 2, each once
        with s.board.cond:
            assert [m["c"] for m in s.board.order] == [1, 1, 2, 2]  # chunk, final, each
    finally:
        released.set()


# ---------------------------------------------------------------- acks


def test_malformed_and_unknown_acks_are_counted_and_never_answered(
    stacks: Callable[..., Stack],
) -> None:
    s = stacks(lambda emit: emit({"text": "fine"}))
    bad_acks = (
        {"c": 1, "ack": "3"},
        {"c": 1, "ack": -1},
        {"c": 1, "ack": True},
        {"ack": 3},
        {"c": 1, "ack": 0, "stop": "yes"},
    )
    for bad in bad_acks:
        s.board.send(bad)
    wait_for(lambda: s.stat("refused.bad_envelope") == 5, "5 bad acks refused")
    assert {r.kind for r in s.bridge.refusals} == {"bad_envelope"}
    s.board.send({"c": 999, "ack": 1})
    wait_for(lambda: s.stat("rpc.ack_unknown") == 1, "the unknown ack counted")
    s.board.call(7)
    st = s.board.done(7)
    assert st.text() == "fine" and st.final is not None and "ok" in st.final
    with s.board.cond:
        assert [m["c"] for m in s.board.order] == [7, 7]  # nothing answered the acks


def test_a_stop_from_the_board_ends_its_call_at_once(stacks: Callable[..., Stack]) -> None:
    # The board's run was cancelled mid-stream: it says stop, and the bridge stops the
    # model and frees the worker instead of waiting for acks until the deadline.
    stopped = threading.Event()

    def play(emit: Callable[[Chunk], None]) -> None:
        try:
            for _ in range(50):
                emit({"text": "z" * 256})
        finally:
            stopped.set()

    s = stacks(play, window=2, ack=False)
    s.board.call(4)
    s.board.wait(lambda: len(s.board.streams[4].chunks) >= 2, "the window's 2 chunks")
    wait_for(lambda: s.stat("rpc.window_waits") >= 1, "the worker to wait for acks")
    s.board.send({"c": 4, "ack": 1, "stop": True})
    assert stopped.wait(WAIT), "the handler was not stopped"
    wait_for(lambda: s.bridge.rpc.inflight_of("dev1") == 0, "the slot to be freed")
    assert s.stat("rpc.stopped") == 1
    # Nothing more for the stopped call, no final answer; a resend of it does not run.
    s.board.call(4)
    wait_for(lambda: s.stat("rpc.duplicate") == 1, "the resend to be ignored")
    with s.board.cond:
        st = s.board.streams[4]
        assert [ch["s"] for ch in st.chunks] == [1, 2] and st.final is None
    assert s.provider.calls == 1


# ---------------------------------------------------------------- devices that go away


def test_device_gone_ends_a_call_waiting_for_its_window(stacks: Callable[..., Stack]) -> None:
    stopped = threading.Event()

    def play(emit: Callable[[Chunk], None]) -> None:
        if s.provider.calls == 1:
            emit({"text": "first"})
            return
        try:
            for _ in range(20):
                emit({"text": "z" * 512})
        finally:
            stopped.set()

    s = stacks(play, window=8, ack=False)
    s.board.call(1)  # done and remembered before the device goes
    assert s.board.done(1).text() == "first"
    s.board.call(2)
    s.board.wait(lambda: len(s.board.streams[2].chunks) >= 8, "the window's 8 chunks")
    wait_for(lambda: s.stat("rpc.window_waits") >= 1, "the worker to wait for acks")
    assert s.bridge.rpc.inflight_of("dev1") == 1
    assert s.bridge.rpc.device_gone("dev1", "the device restarted", new_boot=True) == 1
    assert s.bridge.rpc.inflight_of("dev1") == 0
    assert stopped.wait(WAIT), "the handler was not stopped"
    assert s.stat("rpc.device_gone") == 1
    s.board.ack_all(2, resume=True)  # an ack of the ended call changes nothing
    wait_for(lambda: s.stat("rpc.ack_unknown") == 1, "the late ack to be counted")
    with s.board.cond:
        s.board.streams.pop(1)
    # A new boot numbers its calls afresh: call 1 is a new call, not a repeat.
    s.board.call(1)
    st = s.board.done(1)
    assert_numbered(st)
    assert len(st.chunks) == 20 and st.text() == "z" * 512 * 20
    assert s.provider.calls == 3 and s.stat("rpc.duplicate") == 0
    with s.board.cond:
        ended = s.board.streams[2]
        # The ended call: its 8 chunks, nothing after them, and no final answer.
        assert [ch["s"] for ch in ended.chunks] == list(range(1, 9)) and ended.final is None


def test_device_gone_ends_only_the_calls_of_the_boots_that_are_gone(
    stacks: Callable[..., Stack],
) -> None:
    # Run ids begin with the board's boot. A new boot's first calls can arrive before
    # its status does (the broker keeps order per topic only): they go on.
    released = threading.Event()
    s = stacks(gate_emit(released))
    try:
        s.board.call(1, run="0a1b2c3d.1")
        s.board.call(2, run="99887766.1")
        wait_for(lambda: s.provider.calls == 2, "both calls to start")
        assert s.bridge.rpc.device_gone("dev1", "restarted", new_boot=True, boot="99887766") == 1
        assert s.bridge.rpc.inflight_of("dev1") == 1
        # A will names its boot: only that boot's calls end.
        assert s.bridge.rpc.device_gone("dev1", "offline", new_boot=False, boot="0a1b2c3d") == 0
        assert s.bridge.rpc.device_gone("dev1", "offline", new_boot=False, boot="99887766") == 1
        assert s.bridge.rpc.inflight_of("dev1") == 0
    finally:
        released.set()


def test_device_gone_offline_keeps_the_call_ids(stacks: Callable[..., Stack]) -> None:
    released = threading.Event()
    s = stacks(gate_emit(released))
    try:
        s.board.call(5)
        wait_for(lambda: s.provider.calls == 1, "the provider to start")
        assert s.bridge.rpc.device_gone("dev1", "the device went offline", new_boot=False) == 1
        assert s.bridge.rpc.device_gone("dev1", "again", new_boot=False) == 0
        s.board.call(5)  # the board's resend when it comes back: not run again
        wait_for(lambda: s.stat("rpc.duplicate") == 1, "the resend to be ignored")
        released.set()  # the ended call's handler returns; its answer goes nowhere
        s.board.call(6)  # a marker
        s.board.done(6)
        with s.board.cond:
            assert [m["c"] for m in s.board.order] == [6]  # call 5 was never answered
        assert s.provider.calls == 2
    finally:
        released.set()


# ---------------------------------------------------------------- the server alone
# The same RpcServer the bridge runs, with a send the test watches and a clock it moves.


class Sent:
    def __init__(self) -> None:
        self.answers: list[dict[str, Any]] = []
        self.counts: collections.Counter[str] = collections.Counter()
        self.refused: list[str] = []
        self.lock = threading.Lock()

    def send(self, device: str, answer: dict[str, Any], wait_until: float | None) -> None:
        with self.lock:
            self.answers.append(answer)

    def chunks(self, c: Any) -> list[dict[str, Any]]:
        with self.lock:
            return [a for a in self.answers if a["c"] == c and "ch" in a]

    def final(self, c: Any) -> dict[str, Any] | None:
        with self.lock:
            return next((a for a in self.answers if a["c"] == c and "ch" not in a), None)


DEV1 = DeviceRecord("dev1", "acme", "thermostat")


def server(sent: Sent, play: Play, **kw: Any) -> tuple[RpcServer, PlayProvider]:
    provider = PlayProvider(play)
    rpc = RpcServer(
        provider,
        send=sent.send,
        refuse=lambda kind, topic, msg: sent.refused.append(kind),
        count=lambda name, n: sent.counts.update({name: n}),
        **kw,
    )
    return rpc, provider


def call(c: Any) -> bytes:
    return encode({"c": c, "m": "llm.complete", "a": {"messages": [USER]}})


def test_tick_never_waits_for_the_window() -> None:
    now = [0.0]
    holding = threading.Event()
    released = threading.Event()

    def play(emit: Callable[[Chunk], None]) -> None:
        for _ in range(2):
            emit({"text": "f" * 16})  # fills the window of 2
        emit({"text": "tail"})  # held: neither full nor old yet
        holding.set()
        if not released.wait(WAIT * 2):
            raise ModelError("never released")

    sent = Sent()
    small = Limits(window=2, chunk=16)
    rpc, _ = server(sent, play, clock=lambda: now[0], device_limits=lambda d: small)
    try:
        rpc.handle(DEV1, "t", call(1))
        assert holding.wait(WAIT)
        assert len(sent.chunks(1)) == 2 and rpc.tick() == 0  # "tail" is not due yet
        now[0] = 1.0  # "tail" has waited past merge_s, but the window is full
        assert rpc.tick() == 0
        rpc.handle(DEV1, "t", encode({"c": 1, "ack": 1}))
        assert rpc.tick() == 1  # room for one: "tail" goes out from the housekeeping side
        assert [a["ch"] for a in sent.chunks(1)][-1] == {"text": "tail"}
        released.set()
        wait_for(lambda: sent.final(1) is not None, "the final")
        assert sent.final(1) == {"c": 1, "s": 3, "ok": FINAL}
    finally:
        released.set()
        rpc.close()


def test_merging_keeps_up_over_a_long_stream() -> None:
    # A stream far longer than merge_s, on a clock the provider moves 1 ms an emit:
    # chunks stay full all the way (time flushes only what stalls), including in text
    # whose cuts at character boundaries leave a remainder behind nearly every chunk.
    now = [0.0]
    text = "a°€🙂" * 250

    def play(emit: Callable[[Chunk], None]) -> None:
        for ch in text:
            now[0] += 0.001
            emit({"text": ch})

    sent = Sent()
    wide = Limits(window=1000, chunk=16)
    rpc, _ = server(sent, play, clock=lambda: now[0], device_limits=lambda d: wide)
    try:
        rpc.handle(DEV1, "t", call(1))
        wait_for(lambda: sent.final(1) is not None, "the final")
        pieces = [a["ch"]["text"] for a in sent.chunks(1)]
        assert "".join(pieces) == text
        # The first chunk goes at once, alone; every later chunk but the last is full up
        # to a character boundary (16 bytes less at most 3): none goes out short because
        # the stream has run longer than merge_s.
        assert pieces[0] == text[0]
        assert all(13 <= len(p.encode()) <= 16 for p in pieces[1:-1])
    finally:
        rpc.close()


def test_a_board_that_never_acks_times_the_call_out() -> None:
    stopped = threading.Event()

    def play(emit: Callable[[Chunk], None]) -> None:
        try:
            for _ in range(5):
                emit({"text": "w" * 16})
        finally:
            stopped.set()

    sent = Sent()
    small = Limits(window=2, chunk=16)
    rpc, _ = server(sent, play, llm_timeout_s=0.3, device_limits=lambda d: small)
    try:
        rpc.handle(DEV1, "t", call(1))  # no housekeeping here: the worker times it out
        wait_for(lambda: sent.final(1) is not None, "the timeout")
        # Past the call's overall limit: not retryable (issue 25), the same call would
        # take as long again.
        assert sent.final(1) == {
            "c": 1,
            "s": 2,
            "err": {"kind": "llm", "msg": TOO_SLOW, "cause": "timeout", "retryable": False},
        }
        assert stopped.wait(WAIT) and len(sent.chunks(1)) == 2
        wait_for(lambda: rpc.inflight == 0, "the slot to be free")
        assert sent.counts["rpc.timeout"] == 1 and sent.counts["rpc.window_waits"] == 1
    finally:
        rpc.close()


def test_close_wakes_a_worker_waiting_for_acks() -> None:
    sent = Sent()
    small = Limits(window=1, chunk=16)

    def play(emit: Callable[[Chunk], None]) -> None:
        for _ in range(3):
            emit({"text": "v" * 16})

    rpc, _ = server(sent, play, llm_timeout_s=60, device_limits=lambda d: small)
    rpc.handle(DEV1, "t", call(1))
    wait_for(lambda: sent.counts["rpc.window_waits"] == 1, "the worker to wait")
    closer = threading.Thread(target=rpc.close)  # waits for the workers to return
    closer.start()
    closer.join(WAIT)
    assert not closer.is_alive(), "close() is still waiting on a worker"
    assert sent.final(1) is None and len(sent.chunks(1)) == 1


def test_remembered_call_ids_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rpc_module, "_RECENT_CALLS_PER_DEVICE", 3)
    monkeypatch.setattr(rpc_module, "_RECENT_DEVICES", 2)
    sent = Sent()
    rpc, provider = server(sent, lambda emit: None)
    devices = [DeviceRecord(f"d{k}", "acme", "thermostat") for k in range(3)]

    def run(device: DeviceRecord, c: int) -> None:
        rpc.handle(device, "t", call(c))
        wait_for(lambda: rpc.inflight == 0, "the call to be over")

    try:
        for c in (1, 2, 3, 4):
            run(devices[0], c)
        run(devices[0], 4)  # remembered
        run(devices[0], 1)  # pushed out by 2, 3, 4: runs again
        assert (provider.calls, sent.counts["rpc.duplicate"]) == (5, 1)
        run(devices[1], 1)
        run(devices[2], 1)  # a third device: d0, the least recent, is forgotten
        run(devices[0], 4)
        assert (provider.calls, sent.counts["rpc.duplicate"]) == (8, 1)
        run(devices[2], 1)
        assert sent.counts["rpc.duplicate"] == 2
    finally:
        rpc.close()
