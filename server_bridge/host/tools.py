"""Client tools answered by the host's own code (PROTOCOL.md "Runs that pause").

A client tool is a tool the board declares without a function: its run pauses until a
host answers the call. `ToolHandlers` maps tool names to the host's functions; a host
(HostClient over MQTT, HttpHost over HTTP) gives it to a `ToolRunner`, which answers
each pending call of a handled tool as its run's snapshot shows it:

    tools = ToolHandlers()

    @tools.tool("ask_user")
    def ask_user(args):              # or `async def`
        return input(args["q"])      # a str is the output as is; anything else is JSON

    client = HostClient(..., tools=tools)

What a call goes through, its *delivery* (`DELIVERY_STATES`), per (device, run, call):

    pending     seen waiting; queued for a worker, or its handler running
    submitting  the handler returned; its answer is being sent
    submitted   the answer was accepted (the broker's PUBACK, the API's 202)
    failed      the handler raised, or the answer could not be sent: nothing was
                delivered, so the call still waits (answer it yourself, `answer()`)
    cancelled   the run ended (done, failed, cancelled) before the answer was sent

A handler's exception is a bug on the host, not an answer: it is logged with its
traceback, the delivery reads `failed`, and nothing is sent (its text may hold what the
model and the transcript should not see). The run stays paused, up to its `max_pause_s`,
for a person or a fixed handler to answer. A handler that wants the model told that the
tool failed raises `ToolError(text)`: the call is answered `failed: true` with `text`
as the output. A call whose input is not JSON is answered that way too (the model's
mistake, which it can mend), without calling the handler.

Bounds: at most `max_workers` handlers run at once, on worker threads of the runner's
own (never on paho's network thread or the thread that reads a stream); at most
`max_queued` more wait for one. A call that finds the queue full is refused by name
(`ToolsBusy`, logged and counted in `ToolRunner.refused`), stays `pending`, and is
offered again with its run's next snapshot. An async handler runs on one event loop
thread of the runner's; when its run ends first it is cancelled. A sync one cannot be
interrupted: its result is dropped. A handler runs once per (device, run, call), however
often the call is announced again: a replayed or duplicated event, a board that
rebooted while paused. Sending an answer is tried up to SEND_ATTEMPTS times while the
host reports a passing failure (the broker away, the API busy): a repeated answer is
harmless, the board refuses it `not_waiting`.

Threading: the runner's lock guards its table; it never calls out while holding it. A
host reads the snapshot under its own lock (`offer_of`, which touches nothing of the
runner's), then hands the offer over without it (`take`). `on_state` (the host's
mirror into its reducer) and `on_delivery` (the user's) are called after each change,
on the thread that made it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from server_bridge.host.reducer import DELIVERY_STATES, STREAMS, RunSnapshot

__all__ = [
    "DELIVERY_STATES",
    "MAX_QUEUED",
    "MAX_WORKERS",
    "Delivery",
    "ToolError",
    "ToolHandlers",
    "ToolOffer",
    "ToolRunner",
    "ToolsBusy",
    "offer_of",
]

log = logging.getLogger(__name__)

Delivery = Literal["pending", "submitting", "submitted", "failed", "cancelled"]
# The states are the reducer's (Row.delivery), which a host mirrors them into.
assert get_args(Delivery) == DELIVERY_STATES, "a delivery state the reducer does not know"
_FINAL = frozenset({"submitted", "failed", "cancelled"})

Handler = Callable[[Any], Any]
# (device, run, call, output, failed): sends one answer; raises when it was not sent.
Send = Callable[[str, str, str, str, bool], None]
# (device, run, call, state): told after each change of a call's delivery.
DeliveryCallback = Callable[[str, str, str, str], None]

# Handlers running at once, and calls waiting for one. A handler usually waits on I/O
# (a person, an API), so a few threads serve many runs; past the queue a flood of calls
# is refused by name rather than held without bound.
MAX_WORKERS = 4
MAX_QUEUED = 64
# Runs whose deliveries are remembered: past it, the oldest run whose calls are all
# settled goes first (then the oldest). A run forgotten and seen again later would have
# its handler called again, so this is well above the runs a host has open at once.
MAX_RUNS = 1000
# Sending an answer: tries while the host says the failure passes, waits between them.
SEND_ATTEMPTS = 4
_SEND_WAITS_S = (0.5, 1.0, 2.0)
# How long close() waits, in all, for the workers to finish what they are doing.
_JOIN_S = 2.0


class ToolError(Exception):
    """Raised by a handler to answer its call as failed: the message is the output the
    model sees (`failed: true`). Any other exception answers nothing (module docstring)."""


class ToolsBusy(RuntimeError):
    """A call was not queued: `max_workers` handlers run and `max_queued` calls wait.
    It stays pending and is offered again with its run's next snapshot."""


class ToolHandlers:
    """Client-tool handlers by tool name: a function of the call's parsed input (its
    JSON arguments) returning the output (a str as is, anything else as JSON), or a
    coroutine function doing the same. One registry may serve several hosts.

    `on_delivery(device, run, call, state)` is told each change of a call's delivery,
    on the thread that made it (paho's network thread for `pending`): keep it quick."""

    def __init__(
        self,
        handlers: Mapping[str, Handler] | None = None,
        *,
        max_workers: int = MAX_WORKERS,
        max_queued: int = MAX_QUEUED,
        on_delivery: DeliveryCallback | None = None,
    ) -> None:
        if max_workers < 1 or max_queued < 1:
            raise ValueError("need max_workers >= 1 and max_queued >= 1")
        self.max_workers = max_workers
        self.max_queued = max_queued
        self.on_delivery = on_delivery
        self._handlers: dict[str, Handler] = {}
        for name, fn in (handlers or {}).items():
            self.add(name, fn)

    def add(self, name: str, fn: Handler) -> None:
        """Answer calls of tool `name` with `fn` (replacing a handler it had)."""
        if not isinstance(name, str) or not name:
            raise ValueError("a tool name is a non-empty str")
        if not callable(fn):
            raise TypeError(f"the handler of {name!r} is not callable")
        self._handlers[name] = fn

    def tool(self, name: str) -> Callable[[Handler], Handler]:
        """A decorator: `@tools.tool("ask_user")` adds the function it decorates."""

        def register(fn: Handler) -> Handler:
            self.add(name, fn)
            return fn

        return register

    def remove(self, name: str) -> None:
        self._handlers.pop(name, None)

    def get(self, name: str | None) -> Handler | None:
        return self._handlers.get(name) if name is not None else None

    def __contains__(self, name: object) -> bool:
        return name in self._handlers

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._handlers))

    def __len__(self) -> int:
        return len(self._handlers)


@dataclass(frozen=True)
class ToolOffer:
    """What a run's snapshot says to a ToolRunner: its pending calls of handled tools
    as (call, name, input JSON text), and whether it has ended."""

    device: str
    run: str
    calls: tuple[tuple[str, str, str], ...]
    ended: bool


def offer_of(device: str, snap: RunSnapshot, handlers: ToolHandlers) -> ToolOffer | None:
    """The offer of one snapshot, None when it has nothing for the runner (no pending
    call of a handled tool, not ended). Reads the snapshot only: call it under the lock
    that guards it, then hand the offer to ToolRunner.take without that lock."""
    if snap.run in STREAMS:
        return None
    if snap.terminal:
        return ToolOffer(device, snap.run, (), True)
    calls = tuple(
        (row.call, row.name, row.input or "{}")
        for row in snap.pending.values()
        if row.kind == "tool_call"
        and row.client
        and row.status == "pending"
        and row.call is not None
        and row.name is not None
        and row.name in handlers
    )
    return ToolOffer(device, snap.run, calls, False) if calls else None


@dataclass
class _Call:
    name: str
    input: str
    state: Delivery = "pending"
    queued: bool = False  # in the queue, or taken by a worker: not offered again
    refused: bool = False  # refused once for a full queue (logged once)
    error: str | None = None
    future: concurrent.futures.Future[Any] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class _Job:
    device: str
    run: str
    call: str


class ToolRunner:
    """Runs a ToolHandlers' handlers for one host and records each call's delivery.

    `send(device, run, call, output, failed)` sends an answer (raising when it was not
    sent); `retryable(exc)` says whether a failure of it passes (another try then);
    `on_state(device, run, call)` is told after each change (a host's mirror into its
    reducer: it reads the state with `state()`, so whichever call comes last mirrors the
    latest). Threads start with the first call; `close()` stops them."""

    def __init__(
        self,
        handlers: ToolHandlers,
        send: Send,
        *,
        retryable: Callable[[Exception], bool] = lambda e: False,
        on_state: Callable[[str, str, str], None] | None = None,
        name: str = "wren-tool",
        max_runs: int = MAX_RUNS,
    ) -> None:
        self.handlers = handlers
        self._send = send
        self._retryable = retryable
        self._on_state = on_state
        self._name = name
        self._max_runs = max_runs
        self._lock = threading.Lock()
        # (device, run) -> call -> _Call, oldest run first.
        self._runs: OrderedDict[tuple[str, str], dict[str, _Call]] = OrderedDict()
        self._ended: set[tuple[str, str]] = set()
        self._queue: queue.Queue[_Job] = queue.Queue(maxsize=handlers.max_queued)
        self._workers: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        #: Calls refused for a full queue (each refusal counted).
        self.refused = 0
        #: Handlers that raised (not ToolError), and answers that could not be sent.
        self.handler_errors = 0
        self.send_errors = 0

    # --- what the host calls ------------------------------------------------------

    def take(self, offer: ToolOffer) -> None:
        """Queue each call of `offer` not yet taken; an ended run's open calls are
        cancelled. Never waits (it runs on paho's network thread)."""
        key = (offer.device, offer.run)
        if offer.ended:
            self._end_run(key)
            return
        for call, name, text in offer.calls:
            with self._lock:
                if self._closed or key in self._ended:
                    return
                calls = self._runs.get(key)
                if calls is None:
                    calls = self._runs[key] = {}
                    self._evict(keep=key)
                entry = calls.get(call)
                new = entry is None
                if entry is None:
                    entry = calls[call] = _Call(name, text)
                if entry.queued or entry.state != "pending":
                    continue  # taken already: never run twice
                entry.queued = True
                self._start_workers()
            if new:
                # Told before it is queued: a worker's `submitting` cannot come first.
                self._told(offer.device, offer.run, call, "pending")
            try:
                self._queue.put_nowait(_Job(offer.device, offer.run, call))
            except queue.Full:
                self._refuse(key, call)

    def state(self, device: str, run: str, call: str) -> Delivery | None:
        with self._lock:
            entry = self._runs.get((device, run), {}).get(call)
            return entry.state if entry is not None else None

    def deliveries(self, device: str, run: str) -> dict[str, Delivery]:
        """call -> delivery state, for the calls of `run` this runner has seen."""
        with self._lock:
            return {c: e.state for c, e in self._runs.get((device, run), {}).items()}

    def errors(self, device: str, run: str) -> dict[str, str]:
        """call -> why its delivery failed, for the failed calls of `run`."""
        with self._lock:
            calls = self._runs.get((device, run), {})
            return {c: e.error for c, e in calls.items() if e.error is not None}

    def runs(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._runs)

    def close(self) -> None:
        """Stop the workers and the event loop, waiting _JOIN_S in all: an async
        handler is cancelled, a sync one still running is abandoned (its thread is a
        daemon) and its result dropped. Calls queued stay pending; the table stays
        readable. reopen() takes calls again."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, []
            loop, thread = self._loop, self._loop_thread
            self._loop = self._loop_thread = None
            futures = [e.future for calls in self._runs.values() for e in calls.values()]
            stop = self._stop
        stop.set()
        for fut in futures:
            if fut is not None:
                fut.cancel()
        deadline = time.monotonic() + _JOIN_S
        for w in workers:
            w.join(timeout=max(deadline - time.monotonic(), 0))
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=max(deadline - time.monotonic(), 0.1))
            if not thread.is_alive():
                loop.close()
        # What was queued is not run by the next workers (their table says pending,
        # and the run's next offer queues it again).
        with self._lock:
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            for calls in self._runs.values():
                for entry in calls.values():
                    if entry.state == "pending":
                        entry.queued = False

    def reopen(self) -> None:
        """Take calls again after close() (a host that connects again): new workers
        start with the next call; one abandoned by close() ends with its handler."""
        with self._lock:
            if self._closed:
                self._closed = False
                self._stop = threading.Event()

    # --- internals ----------------------------------------------------------------

    def _start_workers(self) -> None:
        # Under the lock: the first call starts the pool, all of it (a few threads),
        # each ended by this generation's stop (close, then reopen, makes another).
        if self._workers:
            return
        for k in range(self.handlers.max_workers):
            t = threading.Thread(target=self._work_loop, args=(self._stop,),
                                 name=f"{self._name}-{k}", daemon=True)  # fmt: skip
            self._workers.append(t)
            t.start()

    def _refuse(self, key: tuple[str, str], call: str) -> None:
        with self._lock:
            entry = self._runs.get(key, {}).get(call)
            first = entry is not None and not entry.refused
            if entry is not None:
                entry.queued = False  # offered again with the run's next snapshot
                entry.refused = True
            self.refused += 1
        err = ToolsBusy(
            f"tool call {call} of run {key[1]} on {key[0]} not queued: "
            f"{self.handlers.max_workers} handlers run and {self.handlers.max_queued} wait; "
            "it stays pending and is offered again with its run's next event"
        )
        if first:
            log.warning("host tools: %s", err)

    def _end_run(self, key: tuple[str, str]) -> None:
        told: list[str] = []
        with self._lock:
            if key in self._ended:
                return
            calls = self._runs.get(key)
            if calls is None:
                return  # never had a call here: nothing to remember
            self._ended.add(key)
            self._runs.move_to_end(key)
            for call, entry in calls.items():
                if entry.state in ("pending", "submitting"):
                    entry.state = "cancelled"
                    told.append(call)
                    if entry.future is not None:
                        entry.future.cancel()  # an async handler stops here
        for call in told:
            self._told(key[0], key[1], call, "cancelled")

    def _evict(self, keep: tuple[str, str]) -> None:
        # Under the lock. Settled runs first (every call final), oldest first.
        while len(self._runs) > self._max_runs:
            old = next(
                (k for k, c in self._runs.items()
                 if k != keep and all(e.state in _FINAL for e in c.values())),
                None,
            )  # fmt: skip
            if old is None:
                old = next(k for k in self._runs if k != keep)
                log.warning("host tools: forgetting run %s with calls still open", old[1])
            del self._runs[old]
            self._ended.discard(old)

    def _move(
        self, job: _Job, to: Delivery, frm: tuple[str, ...], error: str | None = None
    ) -> bool:
        """Move a call to `to` if it is in one of `frm`; tells on success."""
        with self._lock:
            entry = self._runs.get((job.device, job.run), {}).get(job.call)
            if entry is None or entry.state not in frm:
                return False
            entry.state = to
            if error is not None:
                entry.error = error
            if to in _FINAL:
                entry.future = None
        self._told(job.device, job.run, job.call, to)
        return True

    def _told(self, device: str, run: str, call: str, state: str) -> None:
        # Outside the runner's lock: the host's mirror takes the host's own lock.
        try:
            if self._on_state is not None:
                self._on_state(device, run, call)
            if self.handlers.on_delivery is not None:
                self.handlers.on_delivery(device, run, call, state)
        except Exception:
            log.exception("host tools: a delivery callback raised")

    def _work_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                job = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                self._work(job)
            except Exception:  # a bug here must not end the worker
                log.exception("host tools: unexpected error running a tool call")

    def _work(self, job: _Job) -> None:
        with self._lock:
            entry = self._runs.get((job.device, job.run), {}).get(job.call)
            if entry is None or entry.state != "pending":
                return  # its run ended while it waited
            name, text = entry.name, entry.input
        handler = self.handlers.get(name)
        if handler is None:
            # Removed since it was queued: the call waits for someone else, as one
            # without a handler does.
            self._move(job, "failed", ("pending",), f"no handler for tool {name!r} any more")
            return
        try:
            args = json.loads(text)
        except ValueError:
            output, failed = f"the input of tool {name} is not valid JSON", True
        else:
            try:
                output, failed = self._run_handler(job, handler, args), False
            except concurrent.futures.CancelledError:
                return  # its run ended: _end_run said so
            except ToolError as e:
                output, failed = str(e) or f"tool {name} failed", True
            except Exception as e:
                with self._lock:
                    self.handler_errors += 1
                log.error(
                    "host tools: the handler of %s raised on call %s of run %s; the call "
                    "is not answered and still waits",
                    name,
                    job.call,
                    job.run,
                    exc_info=True,
                )
                self._move(job, "failed", ("pending",), f"{type(e).__name__}: {e}"[:300])
                return
        if not self._move(job, "submitting", ("pending",)):
            return  # its run ended while the handler ran: the result is dropped
        self._deliver(job, output, failed)

    def _run_handler(self, job: _Job, handler: Handler, args: Any) -> str:
        result = handler(args)
        if inspect.isawaitable(result):
            fut = asyncio.run_coroutine_threadsafe(_awaited(result), self._event_loop())
            with self._lock:
                entry = self._runs.get((job.device, job.run), {}).get(job.call)
                if entry is None or entry.state != "pending":
                    fut.cancel()  # its run ended as the handler started
                else:
                    entry.future = fut
            result = fut.result()  # CancelledError when its run ends first
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)

    def _deliver(self, job: _Job, output: str, failed: bool) -> None:
        for attempt in range(SEND_ATTEMPTS):
            if self.state(job.device, job.run, job.call) != "submitting":
                return  # its run ended meanwhile
            try:
                self._send(job.device, job.run, job.call, output, failed)
            except Exception as e:
                passing = self._retryable(e) and attempt + 1 < SEND_ATTEMPTS
                if passing and not self._stop.wait(_SEND_WAITS_S[attempt]):
                    log.info("host tools: answer to %s not sent (%s); again", job.call, e)
                    continue
                with self._lock:
                    self.send_errors += 1
                log.error(
                    "host tools: the answer to call %s of run %s was not sent: %s",
                    job.call,
                    job.run,
                    e,
                )
                self._move(job, "failed", ("submitting",), f"not sent: {e}"[:300])
                return
            self._move(job, "submitted", ("submitting",))
            return

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=loop.run_forever, name=f"{self._name}-loop", daemon=True
                )
                thread.start()
                self._loop, self._loop_thread = loop, thread
            return self._loop


async def _awaited(awaitable: Any) -> Any:
    # run_coroutine_threadsafe takes a coroutine; a handler may return any awaitable.
    return await awaitable
