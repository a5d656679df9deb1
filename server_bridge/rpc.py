"""RPC from boards: `{c, m, a, r}` on P/d/D/rpc, answers on P/d/D/rpc/res.

Table-driven: `RpcServer.methods` maps a method name to its `Method` (argument check,
handler, timeout, error kind). The argument check runs on paho's network thread (cheap,
and a refusal is answered at once); the handler runs on a worker pool, because a model
call can take a minute and paho's network thread must keep reading the socket — keepalive,
other boards' events and other calls all depend on it.

A handler streams chunks through `emit` (each sent as `{c, ch}`) and returns the final
answer (sent as `{c, ok}`); it raises `RpcError(kind, msg)` for an answer `{c, err}`.
Each call gets exactly one final answer: the handler's, or a timeout error if it is too
slow, never both — and no chunk is sent after the final answer. A call that waited in the
pool's queue past its deadline is answered with the timeout error without running: its
board has given up on it, and running the model would only spend money and a worker.

Every chunk is sized for the board that receives it: the limits from the device's hello
(the contract's defaults before one arrives). A `text` or `reason` chunk longer than the
board can decode is split into several; a tool call whose input the board could not
decode ends the call with `too_large`, since splitting it would change its meaning.

Calls in flight are bounded in total and per device: a device that floods the bridge
with calls gets `busy`, while the other devices' calls still find room.

Failures are logged as their type and a scrubbed message (server_bridge/redact.py); the
scrubbed traceback goes to DEBUG. A provider's exception text can hold URLs with
credentials or API keys, and the default log line must not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from server_bridge.models.base import Chunk, ModelError, Provider
from server_bridge.redact import describe, scrubbed_traceback
from server_bridge.registry import DeviceRecord
from server_bridge.wire import (
    DEFAULT_LIMITS,
    BadEnvelope,
    Call,
    Limits,
    UnknownMethod,
    WireError,
    call_id,
    check_call,
    decode,
    encode,
)

__all__ = [
    "CallContext",
    "Method",
    "RpcError",
    "RpcServer",
    "chunk_budget",
    "err",
    "fit_chunk",
    "split_utf8",
]

log = logging.getLogger("wren.bridge.rpc")

Emit = Callable[[Chunk], None]
Handler = Callable[["CallContext", dict[str, Any], Emit], Any]
ArgCheck = Callable[[dict[str, Any]], dict[str, Any]]
# (device, answer map, wait_until) -> publish on rpc/res. `wait_until` (time.monotonic())
# is set by the worker threads only: they may wait for room in a full outgoing queue
# until then, where paho's network thread and the housekeeping thread must never wait.
Send = Callable[[str, dict[str, Any], "float | None"], None]
Refuse = Callable[[str, str, str], None]  # (kind, topic, msg)
Count = Callable[[str, int], None]
LimitsOf = Callable[[str], "Limits | None"]  # device -> limits from its hello, if any

# A ModelError's text is written by a provider for the board; still, cap what goes out.
_MAX_ERR_MSG = 200
_LLM_FAILED = "the model call failed"


class RpcError(Exception):
    """Raised by a handler: the call is answered `{c, err:{kind, msg}}`; msg is customer-safe."""

    def __init__(self, kind: str, msg: str):
        super().__init__(f"{kind}: {msg}")
        self.kind = kind
        self.msg = msg


class _CallOver(Exception):
    """Raised into a handler's emit once its call has been answered (timed out, or ended
    by a chunk the board could not accept): the handler stops streaming."""


def err(c: int | str | None, kind: str, msg: str) -> dict[str, Any]:
    return {"c": c, "err": {"kind": kind, "msg": msg}}


def _log_failure(level: int, what: str, exc: BaseException) -> None:
    """Log `exc` as its type and scrubbed message; its scrubbed traceback at DEBUG."""
    log.log(level, "%s: %s", what, describe(exc))
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s: traceback (scrubbed):\n%s", what, scrubbed_traceback(exc))


# --------------------------------------------------------------------------- chunk sizes

# Room in a `{c, ch}` answer for everything but the chunk's text: the map headers, the
# keys and the call id. 512 bytes covers any int id and any short str id; a longer str id
# is measured (chunk_budget).
_ANSWER_MARGIN = 512
# A UTF-8 character is at most 4 bytes: the smallest budget that still moves forward.
_MIN_BUDGET = 4
# Fewer, larger chunks gain nothing past this, and the broker's packet limit is 1 MiB.
_MAX_CHUNK_BYTES = 64 * 1024


class _TooLarge(Exception):
    """A chunk that cannot be split into pieces the board can decode."""


def chunk_budget(c: int | str, limits: Limits) -> int:
    """Bytes of UTF-8 text one chunk of call `c` may carry for a board with `limits`."""
    # The answer without its text, plus the largest str header (str32: 5 bytes).
    overhead = len(encode({"c": c, "ch": {"reason": ""}})) + 5
    room = limits.max_payload - max(_ANSWER_MARGIN, overhead)
    return max(_MIN_BUDGET, min(limits.max_str, room, _MAX_CHUNK_BYTES))


def split_utf8(text: str, budget: int) -> list[str]:
    """`text` cut into pieces of at most `budget` UTF-8 bytes, never inside a character.

    An unencodable character (a lone surrogate from a JSON `\\ud800`) becomes `?`: msgpack
    could not send it either, and one odd character must not fail the whole call.
    """
    if budget < _MIN_BUDGET:
        raise ValueError(f"a budget under {_MIN_BUDGET} bytes cannot hold every character")
    data = text.encode("utf-8", "replace")
    pieces: list[str] = []
    start = 0
    while start < len(data):
        end = min(start + budget, len(data))
        # Back off to the first byte of the character the cut would land in
        # (continuation bytes are 0b10xxxxxx); budget >= 4 keeps end > start.
        while end < len(data) and data[end] & 0xC0 == 0x80:
            end -= 1
        pieces.append(data[start:end].decode("utf-8"))
        start = end
    return pieces or [""]


def _strings_fit(value: Any, max_str: int, depth: int = 0) -> bool:
    if isinstance(value, str):
        return len(value.encode("utf-8", "replace")) <= max_str
    if depth > 8:
        return False  # chunks are flat; anything this deep is not one the board reads
    if isinstance(value, Mapping):
        return all(_strings_fit(v, max_str, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_strings_fit(v, max_str, depth + 1) for v in value)
    return True


def fit_chunk(c: int | str, chunk: Chunk, limits: Limits) -> list[Chunk]:
    """The chunk as pieces a board with `limits` can decode; raises _TooLarge if it has
    no such form (a tool call whose input is over the limit)."""
    if len(chunk) == 1:
        ((key, value),) = chunk.items()
        if key in ("text", "reason") and isinstance(value, str):
            return [{key: piece} for piece in split_utf8(value, chunk_budget(c, limits))]
    # Anything else goes whole or not at all: a tool call's input is a JSON document,
    # and half of one is not a smaller tool call.
    size = len(encode({"c": c, "ch": chunk}))
    if size > limits.max_payload or not _strings_fit(chunk, limits.max_str):
        what = "a tool call" if "tool" in chunk else "a chunk"
        raise _TooLarge(
            f"the model produced {what} of {size} bytes, over what the board accepts "
            f"(payload {limits.max_payload}, string {limits.max_str})"
        )
    return [chunk]


@dataclass(frozen=True)
class CallContext:
    """Who is calling (from the registry, never from the payload) and the call itself.

    `deadline` is when the bridge stops waiting for the call, as a time.monotonic()
    value: a handler passes it on so slow work (a model stream) ends when the call does
    instead of holding a worker after its answer has gone out.
    """

    device: DeviceRecord
    call: Call
    deadline: float | None = None


@dataclass(frozen=True)
class Method:
    handler: Handler
    check: ArgCheck = field(default=lambda args: args)
    timeout_s: float = 30.0
    # The error kind of an unexpected failure or a timeout of this method.
    fail_kind: str = "internal"


@dataclass(eq=False)  # identity hashing: kept in a set while in flight
class _Call:
    device: str
    c: int | str
    method: str
    deadline: float  # in the server's clock
    fail_kind: str
    limits: Limits = DEFAULT_LIMITS  # the board's, as known when the call arrived
    wait_until: float | None = None  # time.monotonic() twin of deadline, for the queue
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False


# --------------------------------------------------------------------------- llm.complete

_ROLES = ("system", "user", "assistant", "tool")


def _check_llm_args(args: dict[str, Any]) -> dict[str, Any]:
    messages = args.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadEnvelope("llm.complete needs messages: a non-empty list")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise BadEnvelope(f"llm.complete message {k} needs a role in {', '.join(_ROLES)}")
    tools = args.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadEnvelope("llm.complete tools must be a list of maps")
    model = args.get("model")
    if model is not None and not isinstance(model, str):
        raise BadEnvelope("llm.complete model must be a str")
    max_tokens = args.get("max_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise BadEnvelope("llm.complete max_tokens must be an int >= 1")
    return {"messages": messages, "tools": tools, "model": model, "max_tokens": max_tokens}


def _llm_complete(provider: Provider) -> Handler:
    def handler(ctx: CallContext, args: dict[str, Any], emit: Emit) -> Any:
        try:
            return provider.complete(
                args["messages"],
                args["tools"],
                emit,
                model=args["model"],
                max_tokens=args["max_tokens"],
                deadline=ctx.deadline,
            )
        except _CallOver:
            raise
        except ModelError as e:
            # The provider's own failure report: its text is meant for the board (sent
            # capped); the log gets it scrubbed all the same, as a provider written
            # elsewhere may not be as careful.
            _log_failure(
                logging.WARNING,
                f"llm.complete for {ctx.device.device} (call {ctx.call.c!r}) failed in "
                f"provider {getattr(provider, 'name', '?')}",
                e,
            )
            raise RpcError("llm", (str(e) or _LLM_FAILED)[:_MAX_ERR_MSG]) from e
        except Exception as e:
            # A bug or an unexpected library error: its text may hold internals (URLs,
            # keys, response bodies), so the board gets a fixed message and the log the
            # exception's type and scrubbed text.
            _log_failure(
                logging.ERROR,
                f"llm.complete for {ctx.device.device} (call {ctx.call.c!r}): provider "
                f"{getattr(provider, 'name', '?')} raised unexpectedly",
                e,
            )
            raise RpcError("llm", _LLM_FAILED) from e

    return handler


# --------------------------------------------------------------------------- server


class RpcServer:
    """Dispatches board RPC calls to the method table and answers them."""

    def __init__(
        self,
        provider: Provider,
        send: Send,
        refuse: Refuse,
        count: Count | None = None,
        limits: Limits = DEFAULT_LIMITS,
        workers: int = 8,
        max_inflight: int = 64,
        max_inflight_per_device: int = 4,
        llm_timeout_s: float = 120.0,
        rpc_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        device_limits: LimitsOf | None = None,
    ) -> None:
        self._send = send
        self._refuse = refuse
        self._count: Count = count or (lambda name, n: None)
        # What the bridge accepts from boards; what it sends a board is sized by that
        # board's own limits (device_limits, from its hello).
        self._limits = limits
        self._device_limits: LimitsOf = device_limits or (lambda device: None)
        self._max_inflight = max_inflight
        self._max_per_device = max_inflight_per_device
        self._clock = clock
        self.rpc_timeout_s = rpc_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="wren-rpc")
        self._lock = threading.Lock()
        self._inflight: set[_Call] = set()
        self._per_device: Counter[str] = Counter()
        self._closed = False
        self.methods: dict[str, Method] = {
            "llm.complete": Method(
                _llm_complete(provider), _check_llm_args, llm_timeout_s, fail_kind="llm"
            ),
        }

    def register(
        self,
        name: str,
        handler: Handler,
        check: ArgCheck | None = None,
        timeout_s: float | None = None,
        fail_kind: str = "internal",
    ) -> None:
        """Add a method to the table (later issues: state.*, mem.*, kb.*, core.sync)."""
        self.methods[name] = Method(
            handler,
            check or (lambda args: args),
            self.rpc_timeout_s if timeout_s is None else timeout_s,
            fail_kind,
        )

    @property
    def inflight(self) -> int:
        with self._lock:
            return len(self._inflight)

    def inflight_of(self, device: str) -> int:
        with self._lock:
            return self._per_device[device]

    # ------------------------------------------------------------------ intake

    def handle(self, device: DeviceRecord, topic: str, payload: bytes) -> None:
        """Handle one payload from P/d/D/rpc (paho's network thread; never blocks)."""
        c: int | str | None = None
        try:
            obj = decode(payload, self._limits)
            c = call_id(obj)
            call = check_call(obj)
            method = self.methods.get(call.m)
            if method is None:
                raise UnknownMethod(f"unknown rpc method {call.m[:64]!r}")
            args = method.check(call.a)
        except WireError as e:
            # The contract: a payload we cannot read is answered with c = nil.
            self.answer(device.device, err(c, e.kind, str(e)))
            self._refuse(e.kind, topic, str(e))
            return
        self._start(device, call, method, args, topic)

    def answer_refusal(self, device: str, topic: str, kind: str, msg: str) -> None:
        """Answer a call refused before it was read (e.g. an unknown device)."""
        self.answer(device, err(None, kind, msg))
        self._refuse(kind, topic, msg)

    def _start(
        self, device: DeviceRecord, call: Call, method: Method, args: dict[str, Any], topic: str
    ) -> None:
        wait_until = time.monotonic() + method.timeout_s
        state = _Call(
            device.device,
            call.c,
            call.m,
            self._clock() + method.timeout_s,
            method.fail_kind,
            limits=self._device_limits(device.device) or DEFAULT_LIMITS,
            wait_until=wait_until,
        )
        msg: str | None = None
        with self._lock:
            if self._closed:
                msg = "the bridge is shutting down"
            elif self._per_device[device.device] >= self._max_per_device:
                # Checked before the total: a device at its own cap is told so, and its
                # calls never take the room other devices' calls need.
                msg = f"device {device.device} has {self._max_per_device} calls in flight"
            elif len(self._inflight) >= self._max_inflight:
                msg = f"the bridge has {self._max_inflight} calls in flight"
            else:
                self._inflight.add(state)
                self._per_device[device.device] += 1
        if msg is not None:
            self.answer(device.device, err(call.c, "busy", msg))
            self._refuse("busy", topic, msg)
            return
        self._count("rpc.calls", 1)
        ctx = CallContext(device, call, deadline=wait_until)
        try:
            self._pool.submit(self._run, state, method, ctx, args)
        except RuntimeError:  # the pool was shut down between the check and here
            self._release(state)
            self._finish(state, err(call.c, "busy", "the bridge is shutting down"))

    # ------------------------------------------------------------------ worker

    def _run(self, state: _Call, method: Method, ctx: CallContext, args: dict[str, Any]) -> None:
        try:
            if state.done or self._clock() >= state.deadline:
                # Expired while queued behind other calls (expire() may have answered it
                # already): the board has stopped waiting, so the handler never runs.
                self._count("rpc.expired_queued", 1)
                if self._finish(state, self._timeout_answer(state), on_worker=True):
                    self._count("rpc.timeout", 1)
                return
            try:
                result = method.handler(ctx, args, lambda ch: self._chunk(state, ch))
            except _CallOver:
                return  # already answered (a timeout, or a chunk the board cannot take)
            except RpcError as e:
                self._count("rpc.err", 1)
                self._finish(state, err(state.c, e.kind, e.msg), on_worker=True)
                return
            except Exception as e:
                _log_failure(
                    logging.ERROR, f"rpc {state.method} for {state.device} (call {state.c!r})", e
                )
                self._count("rpc.err", 1)
                self._finish(
                    state, err(state.c, method.fail_kind, f"{state.method} failed"), on_worker=True
                )
                return
            if self._finish(state, {"c": state.c, "ok": result}, on_worker=True):
                self._count("rpc.ok", 1)
        except Exception as e:
            # Only reached if even the error answer could not be sent. The pool would
            # keep this exception in a Future nobody reads; log it instead.
            _log_failure(
                logging.ERROR,
                f"rpc {state.method} for {state.device} (call {state.c!r}): no answer sent",
                e,
            )
            self._count("rpc.unanswered", 1)
        finally:
            self._release(state)

    def _release(self, state: _Call) -> None:
        with self._lock:
            if state in self._inflight:
                self._inflight.discard(state)
                self._per_device[state.device] -= 1
                if self._per_device[state.device] <= 0:
                    del self._per_device[state.device]

    def _chunk(self, state: _Call, chunk: Chunk) -> None:
        try:
            pieces = fit_chunk(state.c, chunk, state.limits)
        except _TooLarge as e:
            # The board would refuse the chunk and then wait out its timeout for a call
            # that can no longer succeed; tell it now and stop the handler.
            if self._finish(state, err(state.c, "too_large", str(e)), on_worker=True):
                log.warning("rpc %s for %s (call %r): %s", state.method, state.device, state.c, e)
                self._count("rpc.too_large", 1)
            raise _CallOver() from None
        # Under the call's lock so a chunk can never follow the final answer.
        with state.lock:
            if state.done:
                raise _CallOver()
            for piece in pieces:
                self.answer(state.device, {"c": state.c, "ch": piece}, state.wait_until)
        self._count("rpc.chunks", len(pieces))
        if len(pieces) > 1:
            self._count("rpc.chunks_split", 1)

    def _timeout_answer(self, state: _Call) -> dict[str, Any]:
        return err(state.c, state.fail_kind, f"{state.method} did not finish in time")

    def _finish(self, state: _Call, answer: dict[str, Any], on_worker: bool = False) -> bool:
        # Only a worker may wait for room in the outgoing queue (on_worker); expire()
        # runs on the housekeeping thread and _start on paho's network thread.
        wait_until = state.wait_until if on_worker else None
        with state.lock:
            if state.done:
                return False
            state.done = True
            try:
                self.answer(state.device, answer, wait_until)
            except Exception as e:
                # An answer that cannot be encoded (a handler returned something msgpack
                # cannot carry) still must not leave the board waiting.
                _log_failure(
                    logging.ERROR, f"rpc {state.method} answer for {state.device} unsendable", e
                )
                failed = err(state.c, state.fail_kind, f"{state.method} failed")
                self.answer(state.device, failed, wait_until)
        return True

    def answer(self, device: str, obj: Mapping[str, Any], wait_until: float | None = None) -> None:
        self._send(device, dict(obj), wait_until)

    # ------------------------------------------------------------------ housekeeping

    def expire(self, now: float | None = None) -> int:
        """Answer every call past its deadline with an error; returns how many."""
        now = self._clock() if now is None else now
        with self._lock:
            late = [s for s in self._inflight if not s.done and s.deadline <= now]
        n = 0
        for s in late:
            if self._finish(s, self._timeout_answer(s)):
                log.warning("rpc %s for %s (call %r) timed out", s.method, s.device, s.c)
                self._count("rpc.timeout", 1)
                n += 1
        return n

    def close(self, wait: bool = True) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=wait, cancel_futures=True)
