"""RPC from boards: `{c, m, a, r}` on P/d/D/rpc, answers on P/d/D/rpc/res.

Table-driven: `RpcServer.methods` maps a method name to its `Method` (argument check,
handler, timeout, error kind). The argument check runs on paho's network thread (cheap,
and a refusal is answered at once); the handler runs on a worker pool, because a model
call can take a minute and paho's network thread must keep reading the socket — keepalive,
other boards' events and other calls all depend on it.

A handler streams chunks through `emit` (each sent as `{c, ch}`) and returns the final
answer (sent as `{c, ok}`); it raises `RpcError(kind, msg)` for an answer `{c, err}`.
Each call gets exactly one final answer: the handler's, or a timeout error if it is too
slow, never both — and no chunk is sent after the final answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from server_bridge.models.base import Chunk, ModelError, Provider
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
)

__all__ = ["CallContext", "Method", "RpcError", "RpcServer", "err"]

log = logging.getLogger("wren.bridge.rpc")

Emit = Callable[[Chunk], None]
Handler = Callable[["CallContext", dict[str, Any], Emit], Any]
ArgCheck = Callable[[dict[str, Any]], dict[str, Any]]
Send = Callable[[str, dict[str, Any]], None]  # (device, answer map) -> publish on rpc/res
Refuse = Callable[[str, str, str], None]  # (kind, topic, msg)
Count = Callable[[str, int], None]

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
    """Raised into a handler's emit once its call has been answered (timed out)."""


def err(c: int | str | None, kind: str, msg: str) -> dict[str, Any]:
    return {"c": c, "err": {"kind": kind, "msg": msg}}


@dataclass(frozen=True)
class CallContext:
    """Who is calling (from the registry, never from the payload) and the call itself."""

    device: DeviceRecord
    call: Call


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
    deadline: float
    fail_kind: str
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
            )
        except _CallOver:
            raise
        except ModelError as e:
            # The provider's own failure report: logged in full, sent capped.
            log.warning(
                "llm.complete for %s (call %r) failed in provider %s: %s",
                ctx.device.device,
                ctx.call.c,
                getattr(provider, "name", "?"),
                e,
                exc_info=True,
            )
            raise RpcError("llm", (str(e) or _LLM_FAILED)[:_MAX_ERR_MSG]) from e
        except Exception as e:
            # A bug or an unexpected library error: its text may hold internals (URLs,
            # response bodies), so the board gets a fixed message and the log the detail.
            log.exception(
                "llm.complete for %s (call %r): provider %s raised unexpectedly",
                ctx.device.device,
                ctx.call.c,
                getattr(provider, "name", "?"),
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
        llm_timeout_s: float = 120.0,
        rpc_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._send = send
        self._refuse = refuse
        self._count: Count = count or (lambda name, n: None)
        self._limits = limits
        self._max_inflight = max_inflight
        self._clock = clock
        self.rpc_timeout_s = rpc_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="wren-rpc")
        self._lock = threading.Lock()
        self._inflight: set[_Call] = set()
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
        state = _Call(
            device.device, call.c, call.m, self._clock() + method.timeout_s, method.fail_kind
        )
        with self._lock:
            busy = len(self._inflight) >= self._max_inflight
            if not busy and not self._closed:
                self._inflight.add(state)
        if busy or self._closed:
            msg = (
                f"the bridge has {self._max_inflight} calls in flight"
                if busy
                else "the bridge is shutting down"
            )
            self.answer(device.device, err(call.c, "busy", msg))
            self._refuse("busy", topic, msg)
            return
        self._count("rpc.calls", 1)
        ctx = CallContext(device, call)
        try:
            self._pool.submit(self._run, state, method, ctx, args)
        except RuntimeError:  # the pool was shut down between the check and here
            self._release(state)
            self._finish(state, err(call.c, "busy", "the bridge is shutting down"))

    # ------------------------------------------------------------------ worker

    def _run(self, state: _Call, method: Method, ctx: CallContext, args: dict[str, Any]) -> None:
        try:
            try:
                result = method.handler(ctx, args, lambda ch: self._chunk(state, ch))
            except _CallOver:
                return  # already answered with a timeout
            except RpcError as e:
                self._count("rpc.err", 1)
                self._finish(state, err(state.c, e.kind, e.msg))
                return
            except Exception:
                log.exception("rpc %s for %s (call %r) failed", state.method, state.device, state.c)
                self._count("rpc.err", 1)
                self._finish(state, err(state.c, method.fail_kind, f"{state.method} failed"))
                return
            if self._finish(state, {"c": state.c, "ok": result}):
                self._count("rpc.ok", 1)
        except Exception:
            # Only reached if even the error answer could not be sent. The pool would
            # keep this exception in a Future nobody reads; log it instead.
            log.exception(
                "rpc %s for %s (call %r): no answer sent", state.method, state.device, state.c
            )
            self._count("rpc.unanswered", 1)
        finally:
            self._release(state)

    def _release(self, state: _Call) -> None:
        with self._lock:
            self._inflight.discard(state)

    def _chunk(self, state: _Call, chunk: Chunk) -> None:
        # Under the call's lock so a chunk can never follow the final answer.
        with state.lock:
            if state.done:
                raise _CallOver()
            self.answer(state.device, {"c": state.c, "ch": chunk})
        self._count("rpc.chunks", 1)

    def _finish(self, state: _Call, answer: dict[str, Any]) -> bool:
        with state.lock:
            if state.done:
                return False
            state.done = True
            try:
                self.answer(state.device, answer)
            except Exception:
                # An answer that cannot be encoded (a handler returned something msgpack
                # cannot carry) still must not leave the board waiting.
                log.exception("rpc %s answer for %s could not be sent", state.method, state.device)
                self.answer(state.device, err(state.c, state.fail_kind, f"{state.method} failed"))
        return True

    def answer(self, device: str, obj: Mapping[str, Any]) -> None:
        self._send(device, dict(obj))

    # ------------------------------------------------------------------ housekeeping

    def expire(self, now: float | None = None) -> int:
        """Answer every call past its deadline with an error; returns how many."""
        now = self._clock() if now is None else now
        with self._lock:
            late = [s for s in self._inflight if not s.done and s.deadline <= now]
        n = 0
        for s in late:
            msg = f"{s.method} did not finish in time"
            if self._finish(s, err(s.c, s.fail_kind, msg)):
                log.warning("rpc %s for %s (call %r) timed out", s.method, s.device, s.c)
                self._count("rpc.timeout", 1)
                n += 1
        return n

    def close(self, wait: bool = True) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=wait, cancel_futures=True)
