"""RpcServer without a broker: chunk sizing for the board, calls that expire before they
run, the deadline a provider is given, per-device caps, and model requests sent early."""

from __future__ import annotations

import collections
import contextlib
import gc
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest

from server_bridge.models.base import Chunk, Final
from server_bridge.models.openai import OpenAIProvider
from server_bridge.registry import DeviceRecord
from server_bridge.rpc import RpcServer, chunk_budget, fit_chunk, split_utf8
from server_bridge.wire import MAX_ID, Limits, encode
from tests.model_server import ModelServer, Turn

WAIT = 5.0
DEV1 = DeviceRecord("dev1", "acme", "thermostat")
DEV2 = DeviceRecord("dev2", "globex", "kiosk")
FINAL: Final = {"usage": {"in": 0, "out": 0, "reason": 0}, "finish": "stop"}


def wait_for(pred: Callable[[], Any], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def call(c: int, text: str = "hi") -> bytes:
    return encode(
        {"c": c, "m": "llm.complete", "a": {"messages": [{"role": "user", "content": text}]}}
    )


# ---------------------------------------------------------------- chunk sizing


@pytest.mark.parametrize("budget", [4, 5, 7, 100, 8192])
def test_split_utf8_never_cuts_a_character(budget: int) -> None:
    text = "a°€🙂" * 500 + "end"
    pieces = split_utf8(text, budget)
    assert "".join(pieces) == text
    assert all(0 < len(p.encode()) <= budget for p in pieces)


def test_split_utf8_edges() -> None:
    assert split_utf8("", 10) == [""]
    assert split_utf8("short", 10) == ["short"]
    assert split_utf8("ab\ud800cd", 100) == ["ab?cd"]  # a lone surrogate msgpack cannot send
    with pytest.raises(ValueError):
        split_utf8("abc", 3)


def test_chunk_budget_follows_the_limits() -> None:
    assert chunk_budget(1, Limits()) == 8192  # the str limit binds
    assert chunk_budget(1, Limits(max_payload=4096, max_str=8192)) == 4096 - 512
    long_id = "c" * 2000  # a long str call id takes its own room from the payload
    room = chunk_budget(long_id, Limits(max_payload=4096, max_str=8192))
    assert room < 4096 - 2000
    piece = {"c": long_id, "ch": {"text": "x" * room}}
    assert len(encode(piece)) <= 4096
    assert chunk_budget(1, Limits(max_payload=100, max_str=100)) == 4  # still moves on


@pytest.mark.parametrize("c", [0, 2**64 - 1, -(2**63), "x" * MAX_ID, "\U0001f600" * MAX_ID])
def test_every_call_id_the_wire_lets_through_fits_the_margin_unmeasured(c: int | str) -> None:
    # chunk_budget measures only a str id longer than MAX_ID: any other leaves a chunk
    # of the full budget within the payload.
    limits = Limits(max_payload=4096, max_str=8192)
    room = chunk_budget(c, limits)
    assert room == 4096 - 512
    assert len(encode({"c": c, "ch": {"reason": "\U0001f600" * (room // 4)}})) <= 4096


def test_fit_chunk() -> None:
    # A board's `chunk` above its string limit: the string limit binds.
    limits = Limits(max_payload=2048, max_str=1000, chunk=4096)
    assert fit_chunk(1, {"text": "x" * 2500}, limits) == [
        {"text": "x" * 1000},
        {"text": "x" * 1000},
        {"text": "x" * 500},
    ]
    # Below it, `chunk` does (the board runtime's 256 by default).
    assert fit_chunk(1, {"reason": "x" * 600}, Limits(max_str=1000)) == [
        {"reason": "x" * 256},
        {"reason": "x" * 256},
        {"reason": "x" * 88},
    ]
    tool = {"tool": {"call": "c1", "name": "save", "input": '{"a": 1}'}}
    assert fit_chunk(1, tool, limits) == [tool]
    with pytest.raises(Exception, match="tool call"):
        fit_chunk(1, {"tool": {"call": "c1", "name": "save", "input": "x" * 1001}}, limits)


# ---------------------------------------------------------------- a server and providers


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.refused: list[str] = []
        self.counts: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def send(self, device: str, answer: dict[str, Any], wait_until: float | None) -> None:
        with self.lock:
            self.sent.append((device, answer))

    def finals(self) -> dict[Any, dict[str, Any]]:
        with self.lock:
            return {a["c"]: a for _, a in self.sent if "ch" not in a}


class GateProvider:
    """Records every call (its user text and deadline); the first blocks until released."""

    name = "gate"

    def __init__(self) -> None:
        self.calls: list[tuple[str, float | None]] = []
        self.started = threading.Event()
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
        self.calls.append((str(messages[0]["content"]), deadline))
        self.started.set()
        self.release.wait(WAIT)
        return FINAL


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


def server(rec: Recorder, provider: Any, **kw: Any) -> RpcServer:
    return RpcServer(
        provider,
        send=rec.send,
        refuse=lambda kind, topic, msg: rec.refused.append(kind),
        count=lambda name, n: rec.counts.update({name: n}),
        **kw,
    )


@pytest.fixture
def gate() -> Iterator[GateProvider]:
    g = GateProvider()
    yield g
    g.release.set()


def test_a_call_that_expired_in_the_queue_never_reaches_the_provider(
    rec: Recorder, gate: GateProvider
) -> None:
    now = [0.0]
    rpc = server(rec, gate, workers=1, llm_timeout_s=10.0, clock=lambda: now[0])
    try:
        rpc.handle(DEV1, "t", call(1, "first"))
        assert gate.started.wait(WAIT)
        rpc.handle(DEV1, "t", call(2, "queued"))  # waits for the one worker
        now[0] = 11.0  # both past their deadline; housekeeping has not run
        gate.release.set()
        wait_for(lambda: rpc.inflight == 0, "both calls to be done")
        assert [text for text, _ in gate.calls] == ["first"]
        assert rec.finals()[2]["err"] == {
            "kind": "llm",
            "msg": "llm.complete did not finish in time",
        }
        assert rec.counts["rpc.expired_queued"] == 1
    finally:
        rpc.close()


def test_a_call_expire_answered_is_not_run_either(rec: Recorder, gate: GateProvider) -> None:
    now = [0.0]
    rpc = server(rec, gate, workers=1, llm_timeout_s=10.0, clock=lambda: now[0])
    try:
        rpc.handle(DEV1, "t", call(1, "first"))
        assert gate.started.wait(WAIT)
        rpc.handle(DEV1, "t", call(2, "queued"))
        now[0] = 11.0
        assert rpc.expire() == 2  # the housekeeping thread answers both
        gate.release.set()
        wait_for(lambda: rpc.inflight == 0, "both calls to be done")
        assert [text for text, _ in gate.calls] == ["first"]
        answers = [a for _, a in rec.sent if a["c"] == 2]
        assert len(answers) == 1  # one answer per call, the timeout
    finally:
        rpc.close()


def test_the_provider_gets_the_calls_deadline(rec: Recorder, gate: GateProvider) -> None:
    gate.release.set()
    rpc = server(rec, gate, llm_timeout_s=30.0)
    try:
        before = time.monotonic()
        rpc.handle(DEV1, "t", call(1))
        wait_for(lambda: 1 in rec.finals(), "the answer")
        after = time.monotonic()
        (_, deadline), *_ = gate.calls
        assert deadline is not None and before + 30.0 <= deadline <= after + 30.0
    finally:
        rpc.close()


def test_per_device_cap(rec: Recorder, gate: GateProvider) -> None:
    rpc = server(rec, gate, workers=4, max_inflight=10, max_inflight_per_device=2)
    try:
        for c in (1, 2, 3):
            rpc.handle(DEV1, "t", call(c))
        assert rec.finals()[3]["err"]["kind"] == "busy" and rec.refused == ["busy"]
        rpc.handle(DEV2, "t", call(4))  # another device is not held back by dev1
        assert 4 not in rec.finals()
        assert (rpc.inflight_of("dev1"), rpc.inflight_of("dev2")) == (2, 1)
        gate.release.set()
        wait_for(lambda: rpc.inflight == 0, "all calls to finish")
        assert all("ok" in rec.finals()[c] for c in (1, 2, 4))
    finally:
        rpc.close()


# ---------------------------------------------------------------- sent early


def kept_alive(model: ModelServer) -> OpenAIProvider:
    """A provider with one idle connection to `model`, for a request to go early on."""
    provider = OpenAIProvider(model.url, "gpt-test", api_key="sk-test")
    provider.complete([{"role": "user", "content": "warm up"}], [], lambda chunk: None)
    assert provider.idle == 1
    return provider


class Holder:
    """A method handler that keeps its worker until `hold` is set (`held` once it has it)."""

    def __init__(self) -> None:
        self.held = threading.Event()
        self.hold = threading.Event()

    def __call__(self, ctx: Any, args: dict[str, Any], emit: Any) -> Any:
        self.held.set()
        self.hold.wait(WAIT)
        return {}


HOLD = encode({"c": 1, "m": "test.hold", "a": {}})


def test_only_a_call_of_at_most_4_kib_is_sent_early(rec: Recorder) -> None:
    with ModelServer([Turn(text="fine")]) as model:
        provider = kept_alive(model)
        rpc = server(rec, provider)
        try:
            rpc.handle(DEV1, "t", call(1, "x" * 5000))  # left to its worker
            wait_for(lambda: 1 in rec.finals(), "the long call's answer")
            assert rec.counts["rpc.sent_early"] == 0
            rpc.handle(DEV1, "t", call(2, "short"))
            wait_for(lambda: 2 in rec.finals(), "the short call's answer")
            assert rec.counts["rpc.sent_early"] == 1
            assert all("ok" in rec.finals()[c] for c in (1, 2))
            assert [m["messages"][0]["content"] for m in model.requests[1:]] == [
                "x" * 5000,
                "short",
            ]
            assert model.connections == 1 and provider.idle == 1
        finally:
            rpc.close()


@contextlib.contextmanager
def one_worker_busy(
    rec: Recorder, free_slot: bool, **kw: Any
) -> Iterator[tuple[ModelServer, OpenAIProvider, RpcServer, threading.Event]]:
    """An RPC server with one worker, busy with a held call until the Event yielded is
    set, and a provider with one idle connection to a model server. With `free_slot` the
    held call's board has restarted: its slot is free at once while its worker still runs
    it, so the next call counts a worker free, goes early, and then waits for that one."""
    holder = Holder()
    with ModelServer([Turn(text="an answer")]) as model:
        provider = kept_alive(model)
        rpc = server(rec, provider, workers=1, **kw)
        rpc.register("test.hold", holder)
        try:
            rpc.handle(DEV2, "t", HOLD)
            assert holder.held.wait(WAIT)
            if free_slot:
                assert rpc.device_gone("dev2", "restarted", new_boot=True) == 1
            yield model, provider, rpc, holder.hold
        finally:
            holder.hold.set()
            rpc.close()


@contextlib.contextmanager
def closed_not_collected() -> Iterator[None]:
    """Fails if a socket was left for the garbage collector to close (it says so with a
    ResourceWarning): CPython's reference counting would otherwise hide a missing close."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        yield
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


def test_a_call_that_waits_for_a_worker_is_not_sent_early_and_never_reaches_the_model(
    rec: Recorder,
) -> None:
    now = [0.0]
    with one_worker_busy(rec, False, llm_timeout_s=10.0, clock=lambda: now[0]) as busy:
        model, provider, rpc, release = busy
        rpc.handle(DEV1, "t", call(2, "queued"))
        assert rec.counts["rpc.sent_early"] == 0 and provider.idle == 1
        now[0] = 11.0  # it expires in the queue
        release.set()
        wait_for(lambda: 2 in rec.finals(), "the queued call's answer")
        assert rec.counts["rpc.expired_queued"] == 1
        assert rec.finals()[2]["err"]["msg"] == "llm.complete did not finish in time"
        assert len(model.requests) == 1  # the warm-up's: the model never had the call


def test_a_call_sent_early_that_expired_in_the_queue_lets_its_connection_go(
    rec: Recorder,
) -> None:
    now = [0.0]
    with closed_not_collected():
        with one_worker_busy(rec, True, llm_timeout_s=10.0, clock=lambda: now[0]) as busy:
            model, provider, rpc, release = busy
            rpc.handle(DEV1, "t", call(2, "queued"))
            assert rec.counts["rpc.sent_early"] == 1 and provider.idle == 0
            model.wait_requests(2, WAIT)  # at the model while the call waits
            now[0] = 11.0
            release.set()
            wait_for(lambda: 2 in rec.finals(), "the queued call's answer")
            assert rec.counts["rpc.expired_queued"] == 1
            assert rec.finals()[2]["err"]["msg"] == "llm.complete did not finish in time"
            # Its answer is never read: the connection is closed, not kept.
            wait_for(lambda: model.open_connections == 0, "the early request's socket to close")
            assert provider.idle == 0


def test_a_call_sent_early_still_queued_when_the_server_closes_lets_its_connection_go(
    rec: Recorder,
) -> None:
    with closed_not_collected(), one_worker_busy(rec, True) as (model, provider, rpc, _):
        rpc.handle(DEV1, "t", call(2, "queued"))
        assert rec.counts["rpc.sent_early"] == 1
        model.wait_requests(2, WAIT)
        rpc.close(wait=False)  # the queued call never runs
        wait_for(lambda: model.open_connections == 0, "the early request's socket to close")


def test_chunks_are_sized_by_the_devices_limits(rec: Recorder) -> None:
    class Long:
        name = "long"

        def complete(self, *args: Any, deadline: float | None = None, **kw: Any) -> Final:
            emit = args[2]
            emit({"text": "y" * 3000})
            return FINAL

    small = Limits(max_payload=2048, max_str=1000, chunk=4096)
    # dev2 has the defaults but for a window that holds its whole answer: this recorder
    # never acknowledges a chunk.
    wide = Limits(window=16)
    rpc = server(rec, Long(), device_limits=lambda d: small if d == "dev1" else wide)
    try:
        rpc.handle(DEV1, "t", call(1))
        rpc.handle(DEV2, "t", call(2))
        wait_for(lambda: {1, 2} <= set(rec.finals()), "both answers")
        by_dev = collections.defaultdict(list)
        for device, a in rec.sent:
            if "ch" in a:
                by_dev[device].append(len(a["ch"]["text"]))
        assert by_dev["dev1"] == [1000, 1000, 1000]
        # The defaults: 8 KiB strings, but the board runtime's `chunk` of 256 bytes.
        assert by_dev["dev2"] == [256] * 11 + [184]
    finally:
        rpc.close()
