"""RPC from boards: `{c, m, a, r}` on P/d/D/rpc, answers on P/d/D/rpc/res.

Table-driven: `RpcServer.methods` maps a method name to its `Method` (argument check,
handler, timeout, error kind). The argument check runs on paho's network thread (cheap,
and a refusal is answered at once); the handler runs on a worker pool, because a model
call can take a minute and paho's network thread must keep reading the socket — keepalive,
other boards' events and other calls all depend on it.

A handler streams chunks through `emit` (each sent as `{c, s, ch}`, s = 1, 2, 3 ... per
call) and returns the final answer (sent as `{c, s, ok}`, s = the chunks sent before it);
it raises `RpcError(kind, msg)` for an answer `{c, s, err}`. Each call gets exactly one
final answer: the handler's, or a timeout error if it is too slow, never both — and no
chunk is sent after the final answer. A call that waited in the pool's queue past its
deadline is answered with the timeout error without running: its board has given up on
it, and running the model would only spend money and a worker. Refusals before a call
starts (undecodable, unknown method, bad arguments, `busy`) carry no `s`.

Pacing (PROTOCOL.md "RPC"). A provider may stream thousands of one-token chunks faster
than a board reads them; sent as they come, they pile up in the broker's queue for the
board until it drops some. So:
- The board acknowledges what it has consumed with `{c, ack: s}`, and a call never has
  more than the board's `window` chunks beyond the last acknowledged one: the worker
  waits (bounded by the call's deadline) and the board sets the pace.
- Text and reasoning are merged: held per call, one kind at a time, and sent when the
  board's `chunk` bytes are pending, when the oldest held piece has waited `merge_s`,
  before any other chunk and before the final answer. The call's first chunk is not
  held: it goes as soon as the provider sends it. `tick()` does the time-based flush
  for a provider that has gone quiet; it runs on the housekeeping thread and so never
  waits — held text that finds the window full waits for the worker's next emit or end.
Only workers ever wait for the window. Paho's network thread (acks, calls, device_gone)
and the housekeeping thread (expire, tick) only take short locks.

A method may begin a call's work on the network thread, as long as that never blocks
(`Method.early`): llm.complete sends its HTTP request there when the provider keeps an
idle connection to the model server (`OpenAIProvider.send_early`), and the worker only
reads the answer. A worker woken for a call took 0.4 ms at the median to run on a busy
machine, more in the tail (bench_bridge figure 1, with time stamps); the model now has
the request while the worker wakes. Only calls up to _EARLY_MAX_PAYLOAD bytes, so the
network thread's share stays under 0.1 ms a call, and only when a worker is free: a call
that must queue gains nothing from it, and one that expires in the queue must never have
reached the model (above).

A method may also decide, as a call arrives, whether it runs and with what arguments
(`Method.admit`, on the network thread, before `early`): llm.complete is admitted by
models/policy.py, which holds a board to the models the bridge allows and caps its
max_tokens and its run's calls, tokens and model time; a refused call is answered
`{c, err:{kind:"llm", cause, retryable:false, msg}}` without `s` and never reaches the
model. The call's own limit (BridgeConfig.llm_timeout_s, `--model-timeout`) is its RPC
deadline; a model that outlives it is answered cause `timeout`, not retryable, since the
same call would take as long again.

A QoS 1 call may arrive twice (resent with DUP after a reconnect). A call id of a device
that is in flight or finished recently is ignored, not run twice — a second model call
would cost money and answer a call nobody waits for. `device_gone` ends a device's calls
when it restarts or goes offline, and forgets its call ids on a new boot.

Every chunk is sized for the board that receives it: the limits from the device's hello
(the contract's defaults before one arrives). Text is cut at the board's `chunk` bytes or
what its payload and string limits allow, whichever is less; a tool call whose input the
board could not decode ends the call with `too_large`, since splitting it would change its
meaning.

Calls in flight are bounded in total, per tenant and per device: a device that floods
the bridge with calls gets `busy`, and so does a tenant whose devices together hold
`tenant_share` of the bridge's room (three quarters by default), while the other
devices' and tenants' calls still find room.

Tenants take turns for the workers (_FairPool), not first come first served: a free
worker takes the oldest waiting call of the next tenant in the round, and a tenant runs
on at most `tenant_share` of the workers, so a neighbour whose devices keep their
workers busy with slow model calls leaves a worker free for a quiet tenant's call, which
waits at most for the calls ahead of it in the round, not for the neighbour's queue. (With
ThreadPoolExecutor's one queue, a tenant with enough devices could hold every worker and
queue calls in every other slot the bridge has, ahead of another tenant's call.)

A refusal made on paho's network thread (a call refused before it started) goes out
through `send_refusal` when the bridge gives one: it may find its tenant's board lane
full and not be queued (lanes.py, counted there), so a tenant's flood of junk calls fills
only its own lane. Nothing that answers a call that started is ever refused so.

Failures are logged as their type and a scrubbed message (server_bridge/redact.py); the
scrubbed traceback goes to DEBUG. A provider's exception text can hold URLs with
credentials or API keys, and the default log line must not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from server_bridge.config import BridgeConfig
from server_bridge.models.base import TOO_SLOW, Cancelled, Chunk, ModelError, Provider
from server_bridge.models.policy import ModelGate, ModelPolicy
from server_bridge.redact import describe, scrubbed_traceback
from server_bridge.registry import DeviceRecord
from server_bridge.wire import (
    BOARD_DEFAULTS,
    DEFAULT_LIMITS,
    MAX_ERROR_MSG,
    MAX_ID,
    BadEnvelope,
    Call,
    Limits,
    UnknownMethod,
    WireError,
    call_id,
    check_ack,
    check_call,
    decode,
    encode,
    is_ack,
)

if TYPE_CHECKING:
    from server_bridge.conversations import History

__all__ = [
    "BRIDGE_STOPPING",
    "CallContext",
    "Method",
    "RpcError",
    "RpcServer",
    "chunk_budget",
    "err",
    "fit_chunk",
    "split_utf8",
    "text_budget",
]

log = logging.getLogger("wren.bridge.rpc")

Emit = Callable[[Chunk], None]
Handler = Callable[["CallContext", dict[str, Any], Emit], Any]
# The `before` knowledge rule (knowledge/augment.py's Augmenter): a call's messages with
# the passages in, and the `cite` chunk to send the board ahead of the model's text.
Augment = Callable[[DeviceRecord, dict[str, Any]], tuple[list[dict[str, Any]], dict[str, Any]]]
ArgCheck = Callable[[dict[str, Any]], dict[str, Any]]
# (device, call, checked args) -> the args the call runs with; raises RpcError to refuse
# the call (answered without `s`: it never started). Paho's network thread: never waits.
Admit = Callable[[DeviceRecord, "Call", dict[str, Any]], dict[str, Any]]
# (device, answer map, wait_until) -> publish on rpc/res. `wait_until` (time.monotonic())
# is set by the worker threads only: they may wait for room in a full outgoing queue
# until then, where paho's network thread and the housekeeping thread must never wait.
Send = Callable[[str, dict[str, Any], "float | None"], None]
# (device, answer map) -> queued: a refusal made on the network thread (never waits).
SendRefusal = Callable[[str, dict[str, Any]], bool]
Refuse = Callable[[str, str, str], None]  # (kind, topic, msg)
Count = Callable[[str, int], None]
LimitsOf = Callable[[str], "Limits | None"]  # device -> limits from its hello, if any

_LLM_FAILED = "the model call failed"
# What a call in flight when the bridge stops is answered (PROTOCOL.md "Errors").
BRIDGE_STOPPING = "bridge_stopping"
_STOPPING_MSG = "the bridge stopped during the call: ask again once it is back"
_STOPPING_LLM_MSG = "the bridge stopped during the model call: ask again once it is back"
# What a call is answered when its bridge died and another bridge of the fleet took its
# device over (fleet mode: server_bridge/fleet/calls.py; PROTOCOL.md "Errors").
BRIDGE_RESTARTED = "bridge_restarted"
_RESTARTED_MSG = "the bridge serving the call stopped: ask again"
_RESTARTED_LLM_MSG = "the bridge serving the model call stopped: ask again"
# How long stop_calls() waits for a worker that is sending a chunk of its call before
# it leaves that call unanswered (its board then fails it on the bridge's offline).
_STOP_LOCK_S = 0.5

# Call ids remembered to spot a repeated call (QoS 1 resends it with DUP after a
# reconnect, seconds later, not hours): the last ones of each device, and the devices
# that called most recently. Beyond these a repeat would run again — the board's answer
# matching then drops the extra answer — so the bounds cost money at worst, never memory.
_RECENT_CALLS_PER_DEVICE = 64
_RECENT_DEVICES = 1024

# The largest call a method starts early on paho's network thread. Building and sending
# an llm.complete request took 40 us there for a call of 1 KiB and 56-75 us for 4 KiB
# (timeit), against the 0.4 ms a worker took to wake; 17 KiB took 190 us, and a call
# that large is left to its worker, so the messages waiting behind it wait no longer.
_EARLY_MAX_PAYLOAD = 4096
# The share of the workers, and of the calls in flight, that one tenant may hold while
# others wait or call (module docstring): 6 of the default 8 workers and 48 of the 64
# calls, so two always remain for the others however slow the busy tenant's calls are.
_TENANT_SHARE = 0.75


def tenant_share(n: int) -> int:
    """How many of `n` workers or call slots one tenant may hold: at least one, and
    fewer than all when there are two or more."""
    return max(1, min(n - 1, int(n * _TENANT_SHARE))) if n > 1 else n


class _Job:
    """A call waiting for a worker of a _FairPool, or run by one."""

    __slots__ = ("fn", "args", "tenant", "state")

    def __init__(self, tenant: str, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.tenant = tenant
        self.fn = fn
        self.args = args
        self.state = "queued"  # then "running", "done", or "cancelled"

    def cancelled(self) -> bool:
        return self.state == "cancelled"


class _FairPool:
    """Worker threads that take calls tenant by tenant (module docstring).

    Each tenant's calls wait in a queue of its own, oldest first; tenants with a call
    waiting take turns in `_turn`. A worker that frees up takes the next tenant's oldest
    call, skipping a tenant that already runs `cap` calls.
    The queues are bounded where calls are admitted (RpcServer._start: calls in flight,
    per device and per tenant), so nothing here refuses. Threads start as calls need
    them, up to `workers`, and live until shutdown."""

    def __init__(self, workers: int, name: str = "wren-rpc") -> None:
        self.workers = workers
        self.cap = tenant_share(workers)
        self._name = name
        self._cond = threading.Condition()
        self._queues: dict[str, deque[_Job]] = {}
        self._turn: OrderedDict[str, None] = OrderedDict()
        self._running: Counter[str] = Counter()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._shutdown = False

    def submit(self, tenant: str, fn: Callable[..., None], *args: Any) -> _Job:
        job = _Job(tenant, fn, args)
        with self._cond:
            if self._shutdown:
                raise RuntimeError("the pool is shut down")
            self._queues.setdefault(tenant, deque()).append(job)
            self._turn.setdefault(tenant, None)
            if self._idle:
                self._cond.notify()
            elif len(self._threads) < self.workers:
                t = threading.Thread(
                    target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True
                )
                self._threads.append(t)
                t.start()
        return job

    def _next(self) -> _Job | None:
        """The next call by the tenants' turns (the lock is held), or None when every
        waiting tenant is at its cap or nothing waits."""
        for tenant in self._turn:
            # At its cap even when alone: a quiet tenant's call that comes while a busy
            # tenant's slow calls hold the workers finds one free, instead of waiting
            # for one of those calls to end (a model call may take minutes).
            if self._running[tenant] >= self.cap:
                continue
            q = self._queues[tenant]
            job = q.popleft()
            del self._turn[tenant]
            if q:
                self._turn[tenant] = None  # to the back of the round
            else:
                del self._queues[tenant]
            return job
        return None

    def _work(self) -> None:
        while True:
            with self._cond:
                job = self._next()
                while job is None:
                    if self._shutdown:
                        return
                    self._idle += 1
                    try:
                        self._cond.wait()
                    finally:
                        self._idle -= 1
                    job = self._next()
                job.state = "running"
                self._running[job.tenant] += 1
            try:
                job.fn(*job.args)
            except Exception:
                # The calls' own code logs what it can; this is what escaped it.
                log.exception("rpc worker: a call raised")
            finally:
                with self._cond:
                    job.state = "done"
                    self._running[job.tenant] -= 1
                    if self._running[job.tenant] <= 0:
                        del self._running[job.tenant]
                    # A tenant skipped at its cap may go now: wake every idle worker.
                    if self._turn:
                        self._cond.notify_all()

    def shutdown(self, wait: bool = True, cancel_futures: bool = True) -> None:
        with self._cond:
            self._shutdown = True
            if cancel_futures:
                for q in self._queues.values():
                    for job in q:
                        job.state = "cancelled"
                self._queues.clear()
                self._turn.clear()
            self._cond.notify_all()
            threads = list(self._threads)
        if wait:
            for t in threads:
                if t is not threading.current_thread():
                    t.join()


class RpcError(Exception):
    """Raised by a handler: the call is answered `{c, err:{kind, msg}}`; msg is customer-safe.

    `extra` goes into the error map beside them (a `conflict` carries the current value
    and version, PROTOCOL.md "Memory and durable state"); it never replaces kind or msg.
    """

    def __init__(self, kind: str, msg: str, extra: dict[str, Any] | None = None):
        super().__init__(f"{kind}: {msg}")
        self.kind = kind
        self.msg = msg
        self.extra = dict(extra or {})


class _CallOver(Exception):
    """Raised into a handler's emit once its call has ended (answered — timed out, or a
    chunk the board could not accept — or ended unanswered by device_gone or close):
    the handler stops streaming."""


class _Late(Exception):
    """A worker waited for the board's acks until the call's deadline."""


def err(
    c: int | str | None, kind: str, msg: str, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"c": c, "err": {**(extra or {}), "kind": kind, "msg": msg}}


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
    # The answer without its text, plus the largest str header (str32: 5 bytes): under
    # the margin for any int id and any str id the wire lets through (MAX_ID characters,
    # at most 4 bytes each), so only a longer one is encoded to be measured (an encode
    # per call was 16 us of a call's start with the caches cold).
    if isinstance(c, int) or len(c) <= MAX_ID:
        overhead = 0
    else:
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


def text_budget(c: int | str, limits: Limits) -> int:
    """Bytes of text one `text` or `reason` chunk of call `c` carries for a board with
    `limits`: its `chunk`, and never more than chunk_budget (what it can decode).

    At least 4 bytes, like chunk_budget: a board announcing a smaller `chunk` still gets
    whole characters, one at a time, rather than none.
    """
    return max(_MIN_BUDGET, min(limits.chunk, chunk_budget(c, limits)))


def _text_kind(chunk: Chunk) -> str | None:
    """The kind, text or reason, of a chunk the bridge may merge and cut; else None."""
    if len(chunk) == 1:
        ((key, value),) = chunk.items()
        if key in ("text", "reason") and isinstance(value, str):
            return key
    return None


def fit_chunk(c: int | str, chunk: Chunk, limits: Limits) -> list[Chunk]:
    """The chunk as pieces a board with `limits` can decode; raises _TooLarge if it has
    no such form (a tool call whose input is over the limit)."""
    kind = _text_kind(chunk)
    if kind is not None:
        return [{kind: piece} for piece in split_utf8(chunk[kind], text_budget(c, limits))]
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


class Started(Protocol):
    """What a method's `early` began for a call, handed to its handler."""

    def close(self) -> None:
        """Let go of it, if the handler has not taken it (the call never ran)."""
        ...


StartEarly = Callable[[dict[str, Any]], "Started | None"]


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
    # What the method's `early` started for the call, if anything.
    early: Started | None = None


@dataclass(frozen=True)
class Method:
    handler: Handler
    check: ArgCheck = field(default=lambda args: args)
    timeout_s: float = 30.0
    # The error kind of an unexpected failure or a timeout of this method.
    fail_kind: str = "internal"
    # Work begun on paho's network thread, without blocking, before a worker takes the
    # call (see the module's docstring): it reaches the handler as ctx.early, and its
    # close() is called once the handler is done, or instead of it.
    early: StartEarly | None = None
    # Decides, as the call arrives, whether it runs and with what (llm.complete: the
    # model and max_tokens the bridge allows, models/policy.py); before `early`.
    admit: Admit | None = None


@dataclass(eq=False)  # identity hashing: kept in a set while in flight
class _Call:
    """One call in flight and its stream.

    Two locks, so that nobody but a worker ever waits on a call:
    - `flow` (a Condition) guards `done`, `sent` and `acked`: short sections, never held
      across a publish. Paho's network thread takes it to record an ack, device_gone to
      end the call; a worker waits on it for room in the window.
    - `send_lock` serialises what goes out for the call — chunks in `s` order, then the
      final answer — and guards the held text. A worker holds it while it sends, and
      across a window wait; tick() only tries it; expire() takes it after marking the
      call done (which wakes a waiting worker, who then lets go).
    A chunk's `s` is taken under `flow` while `send_lock` is held and only if the call is
    not done; the final answer goes out under `send_lock` after `done` is set. So every
    chunk numbered goes out before the final, none after, and the final's `s` counts them.
    """

    device: str
    c: int | str
    method: str
    deadline: float  # in the server's clock
    run: str | None  # the run id the call names (`<boot>.<n>` from a board)
    fail_kind: str
    wait_until: float  # time.monotonic() twin of deadline: bounds every wait of the call
    limits: Limits = BOARD_DEFAULTS  # the board's, as known when the call arrived
    piece: int = BOARD_DEFAULTS.chunk  # text bytes per chunk (text_budget)
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    flow: threading.Condition = field(default_factory=threading.Condition)
    done: bool = False
    sent: int = 0  # chunks numbered so far: the `s` of the last one
    acked: int = 0  # the board's highest ack, never above `sent`
    # Text held for merging (under send_lock): one kind at a time, since when.
    held: list[str] = field(default_factory=list)
    held_kind: str = "text"
    held_bytes: int = 0
    held_since: float = 0.0
    # What the method began early, and the worker's job: a job close() cancels never
    # runs, so close() lets go of what it began.
    early: Started | None = None
    job: _Job | None = None
    # Set by the worker as it runs the handler: a call that times out after this was the
    # method's own work being too slow; before it, the call waited for a worker.
    started: bool = False
    tenant: str = ""  # the device's tenant when the call was admitted (its share)
    rowed: bool = False  # its row is in the fleet's open calls (call_rows)

    @property
    def key(self) -> tuple[str, int | str]:
        return (self.device, self.c)


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
    out: dict[str, Any] = {
        "messages": messages, "tools": tools, "model": model, "max_tokens": max_tokens
    }
    kb = args.get("kb")
    if kb is not None:
        # The agent's `before` knowledge rule (knowledge/augment.py checks the rest).
        if not isinstance(kb, dict):
            raise BadEnvelope("llm.complete kb must be a map")
        out["kb"] = kb
    if args.get("sc") is not None:
        # The run's scope ticket: whose conversation it is, for its earlier turns
        # (conversations/calls.py verifies it at admission).
        out["sc"] = args["sc"]
    return out


def _llm_admit(gate: ModelGate, history: Callable[[], History | None]) -> Admit:
    """The bridge's say over a call's cost (models/policy.py): the model it allows, the
    max_tokens within its caps, and what the call's run has left; a refusal is an `llm`
    error with its cause, not retryable. And whose conversation the call's run is in,
    from its scope ticket (`_scope`), and whether it has earlier turns (`_earlier`: then
    the call is not sent early, as its messages are not final until they are in)."""

    def admit(device: DeviceRecord, call: Call, args: dict[str, Any]) -> dict[str, Any]:
        try:
            ok = gate.admit(
                device.tenant,
                device.agent,
                device.device,
                call.r,
                args["model"],
                args["max_tokens"],
            )
        except ModelError as e:
            raise RpcError("llm", str(e), {"cause": e.cause, "retryable": e.retryable}) from None
        out = {**args, "model": ok.model, "max_tokens": ok.max_tokens, "run_left_s": ok.run_left_s}
        hist = history()
        if hist is not None and args.get("sc") is not None:
            scope = hist.scope(device, args["sc"])
            if scope is not None:
                out["_scope"] = scope
                out["_earlier"] = hist.has_earlier(device, call.r, scope)
        return out

    return admit


def _llm_early(provider: Provider) -> StartEarly | None:
    """The provider's `send_early`, for a provider that has one (models/openai.py); the
    call's args as admitted (_llm_admit)."""
    send_early = getattr(provider, "send_early", None)
    if send_early is None:
        return None

    def early(args: dict[str, Any]) -> Started | None:
        if args.get("kb") is not None or args.get("_earlier"):
            # Its messages are not final until the worker has retrieved the passages.
            return None
        started: Started | None = send_early(
            args["messages"], args["tools"], model=args["model"], max_tokens=args["max_tokens"]
        )
        return started

    return early


def _tokens(final: Any) -> int:
    """The tokens in and out a call's final answer reports (0 when it has none)."""
    usage = final.get("usage") if isinstance(final, Mapping) else None
    if not isinstance(usage, Mapping):
        return 0
    values = (usage.get("in"), usage.get("out"))
    return sum(v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0)


def _llm_complete(
    provider: Provider,
    gate: ModelGate,
    augment: Callable[[], Augment | None],
    history: Callable[[], History | None],
) -> Handler:
    def handler(ctx: CallContext, args: dict[str, Any], emit: Emit) -> Any:
        # Only a provider with send_early made ctx.early, and only its complete takes it.
        more: dict[str, Any] = {} if ctx.early is None else {"early": ctx.early}
        messages = own_messages = args["messages"]
        hist, scope = history(), args.get("_scope")
        if hist is None:
            scope = None
        if hist is not None and scope is not None:
            # The conversation's earlier turns, before the passages take what is left
            # (conversations/history.py says the rule).
            kb = args.get("kb")
            kb_chars = 0
            if isinstance(kb, dict):
                # (Here, not at the top: knowledge/augment.py imports this module.)
                from server_bridge.knowledge.augment import DEFAULT_MAX_CHARS

                want = kb.get("max_chars", DEFAULT_MAX_CHARS)
                kb_chars = want if isinstance(want, int) and want > 0 else DEFAULT_MAX_CHARS
            messages = hist.add(ctx.device, ctx.call.r, scope, messages, args["tools"], kb_chars)
            args = {**args, "messages": messages}
        said: list[str] = []
        calls: list[Any] = []
        if scope is not None:
            # The answer as the model gave it, for the run's turn (recorded below).
            board_emit = emit

            def emit(chunk: Chunk) -> None:
                if isinstance(chunk.get("text"), str):
                    said.append(chunk["text"])
                elif isinstance(chunk.get("tool"), dict):
                    calls.append(chunk["tool"])
                board_emit(chunk)

        if args.get("kb") is not None:
            # The agent's `before` rule: the passages go into the call, the board hears
            # which (one `cite` chunk, ahead of the model's text). Its refusals and its
            # `kb` failure are the call's answer (knowledge/augment.py).
            rule = augment()
            if rule is None:
                raise RpcError(
                    "kb",
                    "this bridge has no knowledge store (wren bridge --knowledge PATH)",
                    {"cause": "unavailable", "retryable": False},
                )
            messages, cite = rule(ctx.device, args)
            emit(cite)
        begun = time.monotonic()
        deadline, by_run = ctx.deadline, False
        left = args.get("run_left_s")
        if left is not None and (deadline is None or begun + left < deadline):
            # No more model time than the call's run has left (models/policy.py).
            deadline, by_run = begun + left, True
        final: Any = None
        try:
            final = provider.complete(
                messages,
                args["tools"],
                emit,
                model=args["model"],
                max_tokens=args["max_tokens"],
                deadline=deadline,
                **more,
            )
            if hist is not None and scope is not None:
                answer: dict[str, Any] = {"role": "assistant", "content": "".join(said)}
                if calls:
                    answer["tools"] = calls
                hist.record(ctx.device, ctx.call.r, scope, own_messages, answer)
            return final
        except _CallOver:
            raise
        except Cancelled as e:
            # The bridge is stopping: stop_calls() has answered the call already; this
            # answer only goes out if it has not (and nothing is logged: it is no fault).
            raise RpcError("llm", str(e), {"cause": e.cause, "retryable": e.retryable}) from e
        except ModelError as e:
            if by_run and e.cause == "timeout":
                # The run's model time ran out before the call's own limit.
                raise RpcError(
                    "llm",
                    "this run has spent the model time the bridge allows one run "
                    "(--run-model-time): start a new request, or ask for less",
                    {"cause": "run_limit", "retryable": False},
                ) from e
            # The provider's own failure report: its text is meant for the board (sent
            # capped); the log gets it scrubbed all the same, as a provider written
            # elsewhere may not be as careful.
            _log_failure(
                logging.WARNING,
                f"llm.complete for {ctx.device.device} (call {ctx.call.c!r}) failed in "
                f"provider {getattr(provider, 'name', '?')}",
                e,
            )
            raise RpcError(
                "llm",
                (str(e) or _LLM_FAILED)[:MAX_ERROR_MSG],
                {"cause": getattr(e, "cause", "unavailable"),
                 "retryable": getattr(e, "retryable", True)},
            ) from e
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
        finally:
            gate.spend(ctx.device.device, ctx.call.r, time.monotonic() - begun, _tokens(final))

    return handler


# --------------------------------------------------------------------------- server


class CallRows(Protocol):
    """Where a fleet bridge keeps the calls it is serving (fleet/calls.py), so that the
    next owner of a device's partition can answer them if this bridge dies. `opened` is
    called on paho's network thread, before the call's message is acknowledged, so it
    must be bounded (a database that does not answer is skipped for a while); `closed`
    on the call's worker."""

    def opened(
        self, device: str, c: int | str, method: str, run: str | None, fail_kind: str
    ) -> None:
        ...

    def closed(self, device: str, c: int | str) -> None: ...


def left_open_answer(c: int | str, fail_kind: str) -> dict[str, Any]:
    """The answer to a call another bridge left open when it died: retryable, as a
    stopping bridge's, and without `s` (how many chunks the dead bridge sent is not
    known; a final answer without `s` ends the call at the board whatever came)."""
    if fail_kind == "llm":
        return err(c, "llm", _RESTARTED_LLM_MSG, {"cause": "unavailable", "retryable": True})
    return err(c, BRIDGE_RESTARTED, _RESTARTED_MSG, {"retryable": True})


class RpcServer:
    """Dispatches board RPC calls to the method table and answers them."""

    def __init__(
        self,
        provider: Provider,
        send: Send,
        refuse: Refuse,
        count: Count | None = None,
        limits: Limits = DEFAULT_LIMITS,
        workers: int = BridgeConfig.rpc_workers,
        max_inflight: int = BridgeConfig.rpc_max_inflight,
        max_inflight_per_device: int = BridgeConfig.rpc_max_inflight_per_device,
        llm_timeout_s: float = BridgeConfig.llm_timeout_s,
        rpc_timeout_s: float = BridgeConfig.rpc_timeout_s,
        clock: Callable[[], float] = time.monotonic,
        device_limits: LimitsOf | None = None,
        merge_s: float = BridgeConfig.rpc_merge_s,
        llm_max_tokens: int = BridgeConfig.llm_max_tokens,
        model_policy: ModelPolicy | None = None,
        send_refusal: SendRefusal | None = None,
    ) -> None:
        self._send = send
        self._send_refusal = send_refusal
        self._refuse = refuse
        self._count: Count = count or (lambda name, n: None)
        # What the bridge accepts from boards; what it sends a board is sized by that
        # board's own limits (device_limits, from its hello).
        self._limits = limits
        self._device_limits: LimitsOf = device_limits or (lambda device: None)
        self._max_inflight = max_inflight
        self._max_per_device = max_inflight_per_device
        self._clock = clock
        self._merge_s = merge_s
        self.rpc_timeout_s = rpc_timeout_s
        self._workers = workers
        self._pool = _FairPool(workers)
        self._max_per_tenant = tenant_share(max_inflight)
        self._lock = threading.Lock()
        self._inflight: set[_Call] = set()
        self._calls: dict[tuple[str, int | str], _Call] = {}  # the same calls, by key
        self._per_device: Counter[str] = Counter()
        self._per_tenant: Counter[str] = Counter()
        # Recently finished call ids per device, least recently calling device first.
        self._recent: OrderedDict[str, OrderedDict[int | str, None]] = OrderedDict()
        self._closed = False
        # What a model call may cost (models/policy.py): the provider's own model is the
        # default, llm_max_tokens the cap, and the policy (set_model_policy) the rest.
        own = getattr(provider, "model", None)
        self.models = ModelGate(own if isinstance(own, str) else None, llm_max_tokens, model_policy)
        # Knowledge before a model call (knowledge/augment.py), set by the bridge.
        self.augment: Augment | None = None
        # A conversation's earlier turns in a model call (conversations/), set by the
        # bridge when it keeps an event log.
        self.history: History | None = None
        # A fleet bridge's rows of the calls it serves (fleet/calls.py), set by the bridge.
        self.call_rows: CallRows | None = None
        self.methods: dict[str, Method] = {
            "llm.complete": Method(
                _llm_complete(provider, self.models, lambda: self.augment, lambda: self.history),
                _check_llm_args,
                llm_timeout_s,
                fail_kind="llm",
                early=_llm_early(provider),
                admit=_llm_admit(self.models, lambda: self.history),
            ),
        }

    def set_model_policy(self, policy: ModelPolicy) -> None:
        """The operator's model rules (allow-list, per-run caps) from now on: calls that
        arrive after this are admitted by them; what runs have spent is kept."""
        self.models.policy = policy

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

    def serving(self, device: str, c: int | str) -> bool:
        """Whether call `c` of `device` is in flight in this process."""
        with self._lock:
            return (device, c) in self._calls

    # ------------------------------------------------------------------ intake

    def handle(self, device: DeviceRecord, topic: str, payload: bytes) -> None:
        """Handle one payload from P/d/D/rpc (paho's network thread; never blocks)."""
        c: int | str | None = None
        obj: Any = None
        try:
            if not payload:
                # Not an ack, so a call: one with nothing in it, answered by name.
                raise BadEnvelope("an empty payload: an rpc call is a msgpack map {c, m, a, r}")
            obj = decode(payload, self._limits)
            if is_ack(obj):
                self._ack(device.device, obj)
                return
            c = call_id(obj)
            call = check_call(obj)
            method = self.methods.get(call.m)
            if method is None:
                raise UnknownMethod(f"unknown rpc method {call.m[:64]!r}")
            args = method.check(call.a)
        except WireError as e:
            if not is_ack(obj):
                # A call is answered (with c = nil when it has no readable id); an ack is
                # not a call, so a malformed one is refused and counted, never answered.
                self._answer_refusal(device.device, err(c, e.kind, str(e)))
            self._refuse(e.kind, topic, str(e))
            return
        self._start(device, call, method, args, topic, len(payload))

    def answer_refusal(self, device: str, topic: str, kind: str, msg: str) -> None:
        """Answer a call refused before it was read (e.g. an unknown device)."""
        self._answer_refusal(device, err(None, kind, msg))
        self._refuse(kind, topic, msg)

    def _ack(self, device: str, obj: object) -> None:
        """Record a board's `{c, ack}` and wake the worker waiting on that call's window."""
        ack = check_ack(obj)  # a malformed ack raises BadEnvelope: refused, not answered
        with self._lock:
            state = self._calls.get((device, ack.c))
        if state is None:
            # Late: the final answer crossed it, or device_gone() ended the call.
            self._count("rpc.ack_unknown", 1)
            return
        if ack.stop:
            # The board's run ended first (cancelled, failed): stop the model stream and
            # free the worker now, not when a window nobody acknowledges times out.
            if self._end_unanswered([state], remember=True):
                self._count("rpc.stopped", 1)
            return
        ahead = False
        with state.flow:
            if ack.s > state.sent:
                # The board cannot have consumed a chunk not yet numbered: believing it
                # would let the window run past what the board can hold.
                ahead = True
            state.acked = max(state.acked, min(ack.s, state.sent))
            state.flow.notify_all()
        if ahead:
            self._count("rpc.ack_ahead", 1)

    def _start(
        self,
        device: DeviceRecord,
        call: Call,
        method: Method,
        args: dict[str, Any],
        topic: str,
        size: int,
    ) -> None:
        # A board with no hello yet gets what the board runtime receives by default.
        limits = self._device_limits(device.device) or BOARD_DEFAULTS
        state = _Call(
            device.device,
            call.c,
            call.m,
            self._clock() + method.timeout_s,
            call.r,
            method.fail_kind,
            wait_until=time.monotonic() + method.timeout_s,
            limits=limits,
            piece=text_budget(call.c, limits),
        )
        msg: str | None = None
        repeat = False
        worker_free = False
        with self._lock:
            if state.key in self._calls or call.c in self._recent.get(device.device, ()):
                # A repeat (QoS 1 resends after a reconnect): the first one is answered
                # or being answered, and the board drops answers it has had.
                repeat = True
            elif self._closed:
                msg = "the bridge is shutting down"
            elif self._per_device[device.device] >= self._max_per_device:
                # Checked before the total: a device at its own cap is told so, and its
                # calls never take the room other devices' calls need.
                msg = f"device {device.device} has {self._max_per_device} calls in flight"
            elif self._per_tenant[device.tenant] >= self._max_per_tenant:
                # And a tenant at its share is told so before the total: one tenant's
                # devices together never take the room the other tenants' calls need.
                msg = f"tenant {device.tenant} has {self._max_per_tenant} calls in flight"
            elif len(self._inflight) >= self._max_inflight:
                msg = f"the bridge has {self._max_inflight} calls in flight"
            else:
                self._inflight.add(state)
                self._calls[state.key] = state
                self._per_device[device.device] += 1
                self._per_tenant[device.tenant] += 1
                state.tenant = device.tenant
                # No call waits for a worker ahead of this one: it runs at once. (A call
                # device_gone ended no longer counts while its worker may still run it;
                # then this one waits for that worker, and what it began is closed if it
                # expires meanwhile.)
                worker_free = (
                    len(self._inflight) <= self._workers
                    and self._per_tenant[device.tenant] <= self._pool.cap
                )
        if repeat:
            self._count("rpc.duplicate", 1)
            return
        if msg is not None:
            self._answer_refusal(device.device, err(call.c, "busy", msg))
            self._refuse("busy", topic, msg)
            return
        self._count("rpc.calls", 1)
        # And by method (the table's names only: an unknown one was refused before).
        self._count(f"rpc.calls.{call.m}", 1)
        if method.admit is not None:
            try:
                args = method.admit(device, call, args)
            except RpcError as e:
                # Refused as it arrived: answered without `s` (it never started), its id
                # remembered so a resend of it is not answered twice.
                with state.flow:
                    state.done = True
                self._release(state)
                cause = e.extra.get("cause")
                self._count(f"rpc.refused.{cause if isinstance(cause, str) else e.kind}", 1)
                log.info("rpc %s for %s (call %r): %s", call.m, device.device, call.c, e.msg)
                self._answer_refusal(device.device, err(call.c, e.kind, e.msg, e.extra))
                return
        # A fleet bridge's row of the call, before paho acknowledges the message (when
        # this returns): a call whose bridge dies from here on is answered by the next
        # owner of its device (fleet/calls.py). On this thread, so bounded there.
        state.rowed = self._row_opened(state)
        early = state.early = self._start_early(method, call, args, size) if worker_free else None
        ctx = CallContext(device, call, deadline=state.wait_until, early=early)
        try:
            state.job = self._pool.submit(device.tenant, self._run, state, method, ctx, args)
        except RuntimeError:  # the pool was shut down between the check and here
            if early is not None:
                early.close()
            # Not started: refused `busy` like the others (no `s`, not remembered), so
            # the board may send it again.
            self._release(state, remember=False)
            with state.flow:
                state.done = True
            if state.rowed:
                self._row_closed(state)
            self.answer(device.device, err(call.c, "busy", "the bridge is shutting down"))

    def _row_opened(self, state: _Call) -> bool:
        """The call's row (fleet mode), written as the call is admitted; a failure is
        logged and counted, and the call is served all the same."""
        rows = self.call_rows
        if rows is None:
            return False
        try:
            rows.opened(state.device, state.c, state.method, state.run, state.fail_kind)
        except Exception as e:
            _log_failure(logging.WARNING, f"rpc {state.method}: the call's row not written", e)
            self._count("rpc.call_row_failed", 1)
            return False
        return True

    def _row_closed(self, state: _Call) -> None:
        rows = self.call_rows
        if rows is None:
            return
        try:
            rows.closed(state.device, state.c)
        except Exception as e:
            _log_failure(logging.WARNING, f"rpc {state.method}: the call's row not deleted", e)
            self._count("rpc.call_row_failed", 1)

    def _start_early(
        self, method: Method, call: Call, args: dict[str, Any], size: int
    ) -> Started | None:
        """The method's early start, on this thread (paho's network thread), for a call a
        worker takes at once (the caller checks): only up to _EARLY_MAX_PAYLOAD bytes, so
        what it costs every other message waiting here stays small. A failure is the
        worker's to meet and answer."""
        if method.early is None or size > _EARLY_MAX_PAYLOAD:
            return None
        try:
            early = method.early(args)
        except Exception as e:
            _log_failure(logging.WARNING, f"rpc {call.m}: starting early (left to the worker)", e)
            return None
        if early is not None:
            self._count("rpc.sent_early", 1)
        return early

    # ------------------------------------------------------------------ worker

    def _run(self, state: _Call, method: Method, ctx: CallContext, args: dict[str, Any]) -> None:
        try:
            if state.done:
                return  # answered by expire(), or ended by device_gone(), while queued
            if self._clock() >= state.deadline:
                # Expired while queued behind other calls: the board has stopped
                # waiting, so the handler never runs.
                self._count("rpc.expired_queued", 1)
                self._time_out(state)
                return
            state.started = True
            try:
                result = method.handler(ctx, args, lambda ch: self._emit(state, ch))
            except _CallOver:
                return  # already ended (a timeout, a chunk the board cannot take, gone)
            except RpcError as e:
                self._count("rpc.err", 1)
                self._end(state, err(state.c, e.kind, e.msg, e.extra))
                return
            except Exception as e:
                _log_failure(
                    logging.ERROR, f"rpc {state.method} for {state.device} (call {state.c!r})", e
                )
                self._count("rpc.err", 1)
                self._end(state, err(state.c, method.fail_kind, f"{state.method} failed"))
                return
            self._end(state, {"c": state.c, "ok": result}, count="rpc.ok")
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
            if ctx.early is not None:
                ctx.early.close()
            self._release(state)
            if state.rowed:
                self._row_closed(state)

    def _release(self, state: _Call, remember: bool = True) -> None:
        """Free the call's slot (if device_gone has not already) and remember its id."""
        with self._lock:
            if state in self._inflight:
                self._forget_call(state)
                if remember:
                    self._remember(state)

    def _forget_call(self, state: _Call) -> None:  # under self._lock
        self._inflight.discard(state)
        if self._calls.get(state.key) is state:
            del self._calls[state.key]
        self._per_device[state.device] -= 1
        if self._per_device[state.device] <= 0:
            del self._per_device[state.device]
        self._per_tenant[state.tenant] -= 1
        if self._per_tenant[state.tenant] <= 0:
            del self._per_tenant[state.tenant]

    def answer_left_open(self, device: str, c: int | str, fail_kind: str) -> None:
        """Answer a call another bridge of the fleet left open when it died
        (fleet/calls.py), and remember its id: the dead bridge may have died before the
        broker had its acknowledgement of the call, and the partition's session then
        gives it to this bridge too, which must take it for the repeat it is, not run
        it (its board has ended the call on this answer)."""
        with self._lock:
            self._remember_id(device, c)
        self.answer(device, left_open_answer(c, fail_kind))
        self._count("rpc.left_open_answered", 1)

    def _remember(self, state: _Call) -> None:  # under self._lock
        self._remember_id(state.device, state.c)

    def _remember_id(self, device: str, c: int | str) -> None:  # under self._lock
        ids = self._recent.pop(device, None)
        if ids is None:
            ids = OrderedDict()
        self._recent[device] = ids  # now the most recent device
        ids[c] = None
        while len(ids) > _RECENT_CALLS_PER_DEVICE:
            ids.popitem(last=False)
        while len(self._recent) > _RECENT_DEVICES:
            self._recent.popitem(last=False)

    def _emit(self, state: _Call, chunk: Chunk) -> None:
        """The handler's emit (worker thread): merge, pace and send one provider chunk."""
        try:
            with state.send_lock:
                with state.flow:
                    if state.done:
                        raise _CallOver()
                kind = _text_kind(chunk)
                if kind is not None:
                    self._hold(state, kind, chunk[kind])
                    return
                # A tool call (or anything else) goes whole, after the text before it.
                self._flush(state, wait=True)
                for piece in fit_chunk(state.c, chunk, state.limits):
                    self._send_chunk(state, piece, wait=True)
        except _Late:
            self._time_out(state)
            raise _CallOver() from None
        except _TooLarge as e:
            # The board would refuse the chunk and then wait out its timeout for a call
            # that can no longer succeed; tell it now and stop the handler.
            answer = err(state.c, "too_large", str(e))
            if self._finish(state, answer, on_worker=True, count="rpc.too_large"):
                log.warning("rpc %s for %s (call %r): %s", state.method, state.device, state.c, e)
            raise _CallOver() from None

    def _hold(self, state: _Call, kind: str, text: str) -> None:
        """Add provider text to what the call holds, and send what is due (send_lock held)."""
        if not text:
            return
        if state.held and state.held_kind != kind:
            self._flush(state, wait=True)  # one kind at a time, in the provider's order
        now = self._clock()
        if state.held:
            self._count("rpc.chunks_merged", 1)
        else:
            state.held_kind = kind
            state.held_since = now
        size = len(text.encode("utf-8", "replace"))
        if size > state.piece:
            self._count("rpc.chunks_split", 1)
        state.held.append(text)
        state.held_bytes += size
        if state.held_bytes >= state.piece:
            self._flush(state, wait=True, full_only=True)
        if state.held and (not state.sent or now - state.held_since >= self._merge_s):
            # The call's first chunk goes at once: the user waits for the first words
            # (time to first token); merging pays off only once text is flowing.
            self._flush(state, wait=True)

    def _flush(self, state: _Call, wait: bool, full_only: bool = False) -> int:
        """Send held text as chunks of at most `piece` bytes (send_lock held); returns how
        many went out.

        `full_only` keeps a last piece shorter than `piece` held for more text to join.
        Without `wait` (housekeeping) it stops where the window is full and keeps the rest.
        """
        if not state.held:
            return 0
        kind = state.held_kind
        pieces = split_utf8("".join(state.held), state.piece)
        keep = ""
        if full_only and len(pieces[-1].encode("utf-8", "replace")) < state.piece:
            keep = pieces.pop()
        n = 0
        for piece in pieces:
            if not self._send_chunk(state, {kind: piece}, wait=wait):
                break
            n += 1
        rest = "".join(pieces[n:]) + keep
        state.held = [rest] if rest else []
        state.held_bytes = len(rest.encode("utf-8", "replace"))
        if rest and n:
            # A remainder after a chunk went out starts its own wait: the board has just
            # had text. Kept from the first piece, the clock would run out mid-stream and
            # every later emit would go out alone (a cut at a character boundary leaves a
            # remainder almost every time in non-ASCII text).
            state.held_since = self._clock()
        return n

    def _send_chunk(self, state: _Call, chunk: Chunk, wait: bool) -> bool:
        """Number and send one chunk (send_lock held).

        With `wait` (a worker) it waits for room in the window, raising _CallOver if the
        call ends meanwhile and _Late at its deadline; without, it returns False at once
        when the window is full.
        """
        with state.flow:
            if state.sent - state.acked >= state.limits.window and not state.done:
                if not wait:
                    return False
                # Counted as the wait begins, so a wait that never ends is seen too.
                self._count("rpc.window_waits", 1)
            while state.sent - state.acked >= state.limits.window and not state.done:
                remaining = state.wait_until - time.monotonic()
                if remaining <= 0:
                    raise _Late()
                state.flow.wait(remaining)
            if state.done:
                raise _CallOver()
            state.sent += 1
            s = state.sent
        wait_until = state.wait_until if wait else None
        self._count("rpc.chunks", 1)  # before it goes out, as _finish counts
        self.answer(state.device, {"c": state.c, "s": s, "ch": chunk}, wait_until)
        return True

    def _end(self, state: _Call, answer: dict[str, Any], count: str | None = None) -> bool:
        """The worker's final answer, after the text still held; True if it went out
        (`count` counted, as in _finish)."""
        try:
            with state.send_lock:
                self._flush(state, wait=True)
        except _CallOver:
            return False
        except _Late:
            self._time_out(state)
            return False
        return self._finish(state, answer, on_worker=True, count=count)

    def _time_out(self, state: _Call) -> None:
        answer = self._timeout_answer(state)
        if self._finish(state, answer, on_worker=True, count="rpc.timeout"):
            log.warning("rpc %s for %s (call %r) timed out", state.method, state.device, state.c)

    def _timeout_answer(self, state: _Call) -> dict[str, Any]:
        if state.fail_kind == "llm" and state.started:
            # The model call itself outlived its limit: asking again takes as long (a call
            # that timed out waiting for a worker keeps the generic, retryable answer).
            extra = {"cause": "timeout", "retryable": False}
            return err(state.c, "llm", TOO_SLOW, extra)
        return err(state.c, state.fail_kind, f"{state.method} did not finish in time")

    def _finish(
        self,
        state: _Call,
        answer: dict[str, Any],
        on_worker: bool = False,
        count: str | None = None,
        lock_s: float | None = None,
    ) -> bool:
        """Send the call's one final answer, with `s`; False if it had one already.

        `count` (the outcome's counter) is counted, and a worker's call releases its
        slot, before the answer goes out: the thread that sends it writes it to the
        socket itself (server_bridge/mqttclient.py), so a board, or a test, may read
        the answer before this call returns. With `lock_s` it waits at most that long
        for a worker that is sending a chunk of the call, and otherwise sends nothing
        (the call is done all the same: nothing more goes out for it)."""
        with state.flow:
            if state.done:
                return False
            # Done first: a worker waiting for the window (holding send_lock) wakes up,
            # sees it, and lets go of send_lock for the answer below.
            state.done = True
            state.flow.notify_all()
        if count is not None:
            self._count(count, 1)
        if on_worker:
            # The call's slot is free before its board can read the answer: a board that
            # keeps its calls in flight up to the per-device cap sends the next one the
            # moment it has this answer, and would find the slot still taken (`busy`).
            # The worker only sends the answer and returns now.
            self._release(state)
        # Only a worker may wait for room in the outgoing queue (on_worker); expire()
        # runs on the housekeeping thread.
        wait_until = state.wait_until if on_worker else None
        if not state.send_lock.acquire(timeout=-1 if lock_s is None else lock_s):
            log.info(
                "rpc %s for %s (call %r): ended unanswered", state.method, state.device, state.c
            )
            return True
        try:
            out = {"c": state.c, "s": state.sent}
            out.update(answer)
            try:
                self.answer(state.device, out, wait_until)
            except Exception as e:
                # An answer that cannot be encoded (a handler returned something msgpack
                # cannot carry) still must not leave the board waiting.
                _log_failure(
                    logging.ERROR, f"rpc {state.method} answer for {state.device} unsendable", e
                )
                failed = err(state.c, state.fail_kind, f"{state.method} failed")
                self.answer(state.device, {"c": state.c, "s": state.sent, **failed}, wait_until)
        finally:
            state.send_lock.release()
        return True

    def answer(self, device: str, obj: Mapping[str, Any], wait_until: float | None = None) -> None:
        self._send(device, dict(obj), wait_until)

    def _answer_refusal(self, device: str, obj: Mapping[str, Any]) -> None:
        """Answer a call refused before it started (network thread). Through
        send_refusal when there is one: not queued when the device's tenant's board lane
        is full (counted by the lanes, and here `rpc.refusal_unsent`)."""
        if self._send_refusal is None:
            self._send(device, dict(obj), None)
        elif not self._send_refusal(device, dict(obj)):
            self._count("rpc.refusal_unsent", 1)

    # ------------------------------------------------------------------ devices

    def device_gone(self, device: str, msg: str, *, new_boot: bool, boot: str | None = None) -> int:
        """End the calls in flight of `device` without answering them; return how many.

        For a device that restarted (`new_boot`: nobody waits for the answers) or went
        offline (the bridge cancels its runs separately). Each call's slot is free at
        once; its handler stops at its next emit, a worker waiting for its window wakes
        up, and nothing more is sent for it. `msg` says why, for the log. With
        `new_boot` the device's recent call ids are forgotten too, since a new boot
        numbers its calls afresh; otherwise they are kept, so a call the board resends
        when it comes back is not run a second time.

        `boot` narrows it by the boot a call's run id begins with (`<boot>.<n>`): after a
        restart (`boot` the new one) that boot's own calls go on — they may arrive before
        its status does, since the broker keeps order per topic only — and after an
        offline (`boot` the one its will named) only that boot's calls end.
        """

        def ends(s: _Call) -> bool:
            of = s.run.split(".", 1)[0] if s.run and "." in s.run else None
            if boot is None or of is None:
                return True
            return of != boot if new_boot else of == boot

        with self._lock:
            gone = [s for s in self._inflight if s.device == device and ends(s)]
        n = self._end_unanswered(gone, remember=not new_boot)
        if new_boot:
            with self._lock:
                self._recent.pop(device, None)
        if n:
            log.info("rpc: ended %d call(s) of %s unanswered: %s", n, device, msg)
            self._count("rpc.device_gone", n)
        return n

    def _end_unanswered(self, states: list[_Call], remember: bool) -> int:
        """End calls without an answer: free their slots, wake a worker waiting on their
        window, and stop their handlers at the next emit. `remember` keeps their ids,
        so a resend of one is not run again. Returns how many were still open."""
        with self._lock:
            # Only what is still in flight: a call may have finished since it was found.
            states = [s for s in states if s in self._inflight]
            for s in states:
                self._forget_call(s)
                if remember:
                    self._remember(s)
        n = 0
        for s in states:
            with s.flow:
                if s.done:
                    continue  # answered already (a timeout); its worker is still busy
                s.done = True
                s.flow.notify_all()
            n += 1
        return n

    # ------------------------------------------------------------------ housekeeping

    def expire(self, now: float | None = None) -> int:
        """Answer every call past its deadline with an error; returns how many."""
        now = self._clock() if now is None else now
        with self._lock:
            late = [s for s in self._inflight if not s.done and s.deadline <= now]
        n = 0
        for s in late:
            if self._finish(s, self._timeout_answer(s), count="rpc.timeout"):
                log.warning("rpc %s for %s (call %r) timed out", s.method, s.device, s.c)
                n += 1
        return n

    def tick(self, now: float | None = None) -> int:
        """Send text held past merge_s whose window has room now; returns the chunks sent.

        For the housekeeping thread, and so it never waits: a call whose worker is
        sending (or waiting for the window) is skipped — that worker flushes on its next
        emit or at the end — and so is held text that finds the window full.
        """
        now = self._clock() if now is None else now
        with self._lock:
            # `held` read without send_lock: only a hint, checked again under it.
            due = [s for s in self._inflight if s.held and now - s.held_since >= self._merge_s]
        n = 0
        for s in due:
            if not s.send_lock.acquire(blocking=False):
                continue
            try:
                if s.held and now - s.held_since >= self._merge_s:
                    n += self._flush(s, wait=False)
            except _CallOver:
                s.held = []  # ended meanwhile: nobody reads it now
            finally:
                s.send_lock.release()
        return n

    def stop_calls(self) -> list[tuple[str, str | None]]:
        """The bridge is stopping: refuse new calls (`busy`) and answer each call in
        flight now with a retryable error, `bridge_stopping` (an `llm.complete`: kind
        `llm`, cause `unavailable`, PROTOCOL.md "Errors"), so its board ends the run
        with the cause instead of waiting for the bridge's offline status. Never waits
        for the room in the outgoing lanes; the handlers stop at their next emit (a
        provider's cancel() ends a stream that is waiting on its server). Returns the
        (device, run) of each call answered."""
        with self._lock:
            self._closed = True
            running = [s for s in self._inflight if not s.done]
        answered: list[tuple[str, str | None]] = []
        for s in running:
            if s.fail_kind == "llm":
                answer = err(
                    s.c, "llm", _STOPPING_LLM_MSG, {"cause": "unavailable", "retryable": True}
                )
            else:
                answer = err(s.c, BRIDGE_STOPPING, _STOPPING_MSG, {"retryable": True})
            if self._finish(s, answer, count="rpc.bridge_stopping", lock_s=_STOP_LOCK_S):
                answered.append((s.device, s.run))
        if answered:
            log.info("rpc: answered %d call(s) in flight %s", len(answered), BRIDGE_STOPPING)
        return answered

    def close(self, wait: bool = True) -> None:
        """Refuse new calls and end the ones in flight without answers (the bridge is
        going away); `wait` waits for the workers to return."""
        with self._lock:
            self._closed = True
            running = list(self._inflight)
        for s in running:
            # A worker waiting for a board's acks would otherwise hold its thread (and
            # the interpreter's exit) until the call's deadline.
            with s.flow:
                s.done = True
                s.flow.notify_all()
        self._pool.shutdown(wait=wait, cancel_futures=True)
        for s in running:
            if s.early is not None and s.job is not None and s.job.cancelled():
                s.early.close()
