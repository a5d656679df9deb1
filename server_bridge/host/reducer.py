"""The snapshot reducer: folds a run's event stream into what a UI renders.

Events are the envelopes of docs/PROTOCOL.md (`{r, i, t, ts, n?, a?, k?, d}`). The
reducer keeps one `RunSnapshot` per run id and applies each event through one table of
event type -> handler (`HANDLERS`). Rules that every host shares (the dashboard's
JavaScript folds by the same rules):

* Idempotent by event id: an event whose `i` is at or below the last applied id of its
  run is ignored, so a replay after a reconnect, a duplicate QoS 1 delivery or a late
  lower id never doubles text or rows. Hosts receive a run's events in id order (the
  bridge fills gaps before fan-out); what the board could not resend arrives as an
  `error` event of kind `gap` and is recorded in `gaps`.
* Unknown event types are ignored (forward compatible) but still advance `last_id`.
* A terminal status (done, failed, cancelled) is final: nothing after it reopens the run.
* `error` on a failed run is customer-safe: only the contract's `kind` and `msg` are kept.
* An envelope is checked by server_bridge.wire.check_envelope, the bridge's own check
  (any event type accepted), so the reducer folds exactly what a bridge forwards.
* Bounded: a Reducer keeps at most `max_runs` snapshots (finished runs are forgotten
  first), and a snapshot at most the last MAX_ERRORS errors and gaps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from edge_runtime.events import TERMINAL
from server_bridge.wire import BadEnvelope, check_envelope

__all__ = [
    "HANDLERS",
    "MAX_ERRORS",
    "BadEnvelope",
    "Reducer",
    "Row",
    "RunSnapshot",
    "Usage",
    "apply_event",
    "safe_error",
]

Status = Literal["running", "paused", "done", "failed", "cancelled"]
RowKind = Literal["user", "assistant", "output", "tool_call", "tool_result"]
Envelope = Mapping[str, Any]

TERMINAL_STATUSES: frozenset[str] = frozenset({"done", "failed", "cancelled"})

# The failure kinds of the contract (`run.failed` err.kind). Anything else is reported as
# `internal`, so a UI can switch on the kind without meeting a value it does not know.
FAILURE_KINDS = frozenset({"llm", "tool", "condition", "internal"})

# A customer-safe message is short; a board that sent a long one (a stack trace, say)
# should not be able to fill a UI with it.
_MAX_ERROR_MSG = 500
# Errors (and gaps) kept per snapshot: the device and bridge streams never end, and a
# host that watches one for days must not keep every refusal it ever saw.
MAX_ERRORS = 100


@dataclass
class Usage:
    """Token totals of a run."""

    tokens_in: int = 0
    tokens_out: int = 0
    tokens_reason: int = 0

    def add(self, d: Mapping[str, Any]) -> None:
        self.tokens_in += _int(d.get("in"))
        self.tokens_out += _int(d.get("out"))
        self.tokens_reason += _int(d.get("reason"))


@dataclass
class Row:
    """One rendered row of a run, in event order.

    kind user / assistant: `text` (assistant rows also collect `reasoning`, keyed by `key`,
    the message id `m`); output: `name`, `output` (the value; deltas concatenate), `format`;
    tool_call: `call`, `name`, `input` (a JSON string), `client`; tool_result: `call`, `name`
    (from its call), `output`, `failed`. `status` is `streaming`/`done` for assistant rows,
    `building`/`final` for outputs, `pending`/`running`/`done`/`failed` for tool calls.
    """

    kind: RowKind
    text: str = ""
    name: str | None = None
    input: str | None = None
    output: Any = None
    call: str | None = None
    failed: bool = False
    status: str | None = None
    key: str | None = None
    reasoning: str = ""
    client: bool = False
    format: str | None = None


@dataclass
class RunSnapshot:
    """What a UI renders for one run. `rows` is ordered; `pending` holds the client tool
    calls still waiting for an answer, keyed by call id (the same Row objects as in rows)."""

    run: str
    device: str | None = None
    req: str | None = None
    conv: str | None = None
    agent: str | None = None
    version: str | None = None
    status: Status = "running"
    error: dict[str, str] | None = None
    retryable: bool = False
    reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    rows: list[Row] = field(default_factory=list)
    pending: dict[str, Row] = field(default_factory=dict)
    last_id: int = 0
    gaps: list[tuple[int, int]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    # Indexes into rows, so deltas and results find their row without a scan.
    _messages: dict[str, Row] = field(default_factory=dict, repr=False)
    _calls: dict[str, Row] = field(default_factory=dict, repr=False)
    _outputs: dict[str, Row] = field(default_factory=dict, repr=False)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _int(value: Any) -> int:
    # bool is an int subclass; a `true` token count is wrong data, not 1 token.
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _key(value: Any) -> str | None:
    """Message and call ids may be ints or strings on the wire; key rows by their text."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (str, int)):
        return str(value)
    return None


def _set_status(snap: RunSnapshot, status: Status) -> None:
    # A terminal status is final; a late pause or resume (there should be none, ids are
    # ordered) must not bring a finished run back to life on screen.
    if not snap.terminal:
        snap.status = status


def _row(snap: RunSnapshot, row: Row) -> Row:
    snap.rows.append(row)
    return row


def _message_row(snap: RunSnapshot, m: str | None, role: str | None = None) -> Row:
    row = snap._messages.get(m) if m is not None else None
    if row is None:
        kind: RowKind = "user" if role == "user" else "assistant"
        row = _row(snap, Row(kind, status="streaming", key=m))
        if m is not None:
            snap._messages[m] = row
    return row


# --- handlers: one per event type; each gets the snapshot and the event's `d` ---------


def _run_started(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    snap.req = _str(d.get("req")) or snap.req
    snap.conv = _str(d.get("conv")) or snap.conv
    snap.agent = _str(d.get("agent")) or snap.agent
    snap.version = _str(d.get("ver")) or snap.version
    _set_status(snap, "running")
    text = _str(d.get("input"))
    if text:
        _row(snap, Row("user", text=text, status="done"))


def _run_paused(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    if not snap.terminal:
        snap.reason = _str(d.get("reason"))
    _set_status(snap, "paused")


def _run_resumed(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    if not snap.terminal:
        snap.reason = None
    _set_status(snap, "running")


def _run_done(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    usage = d.get("usage")
    if isinstance(usage, Mapping):
        # run.done carries the run's total; the per-node `usage` events were progress
        # toward it, so the total replaces their sum instead of adding to it.
        snap.usage = Usage()
        snap.usage.add(usage)
    _set_status(snap, "done")


def _run_failed(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    if snap.terminal:
        return
    snap.error = safe_error(d.get("err"))
    snap.retryable = d.get("retryable") is True
    snap.status = "failed"


def _run_cancelled(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    if snap.terminal:
        return
    snap.reason = _str(d.get("reason"))
    snap.status = "cancelled"


def _msg_start(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    _message_row(snap, _key(d.get("m")), _str(d.get("role")))


def _msg_delta(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    # Creates the row when msg.start was lost (a gap), so the text is never dropped.
    row = _message_row(snap, _key(d.get("m")))
    row.text += _str(d.get("text")) or ""


def _reason_delta(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    row = _message_row(snap, _key(d.get("m")))
    row.reasoning += _str(d.get("text")) or ""


def _msg_end(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    m = _key(d.get("m"))
    row = snap._messages.get(m) if m is not None else None
    if row is not None:
        row.status = "done"


def _tool_call(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    call = _key(d.get("call"))
    client = d.get("client") is True
    row = _row(
        snap,
        Row(
            "tool_call",
            call=call,
            name=_str(d.get("name")),
            input=_str(d.get("input")) or "{}",
            client=client,
            status="pending" if client else "running",
        ),
    )
    if call is not None:
        snap._calls[call] = row
        if client:
            snap.pending[call] = row


def _tool_result(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    call = _key(d.get("call"))
    failed = d.get("failed") is True
    call_row = snap._calls.get(call) if call is not None else None
    if call_row is not None:
        call_row.status = "failed" if failed else "done"
    if call is not None:
        snap.pending.pop(call, None)
    _row(
        snap,
        Row(
            "tool_result",
            call=call,
            name=call_row.name if call_row is not None else None,
            output=d.get("output"),
            failed=failed,
            status="failed" if failed else "done",
        ),
    )


def _output(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    name = _str(d.get("name")) or ""
    row = snap._outputs.get(name)
    if row is None:
        row = _row(snap, Row("output", name=name, status="building"))
        snap._outputs[name] = row
    # Updated in place: one row per declared output, whatever number of events build it.
    if "value" in d:
        row.output = d["value"]
    delta = _str(d.get("delta"))
    if delta is not None:
        row.output = (row.output if isinstance(row.output, str) else "") + delta
    status = _str(d.get("status"))
    if status is not None:
        row.status = status
    fmt = _str(d.get("format"))
    if fmt is not None:
        row.format = fmt


def _usage(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    snap.usage.add(d)


def _error(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    kind = _str(d.get("kind")) or "internal"
    entry: dict[str, Any] = {"kind": kind, "msg": (_str(d.get("msg")) or "")[:_MAX_ERROR_MSG]}
    if kind == "gap":
        lo, hi = _int(d.get("from")), _int(d.get("to"))
        if lo and hi >= lo:
            snap.gaps.append((lo, hi))
            del snap.gaps[:-MAX_ERRORS]
            entry["from"], entry["to"] = lo, hi
    req = _str(d.get("req"))
    if req is not None:
        entry["req"] = req  # the request a refusal names (streams "_" and "_b")
    snap.errors.append(entry)
    del snap.errors[:-MAX_ERRORS]


Handler = Callable[[RunSnapshot, Mapping[str, Any]], None]

# The one dispatch table. Types of the contract not listed here (rows, memory, citations,
# nodes, ...) do not change what this snapshot renders; they are ignored like unknown ones.
HANDLERS: dict[str, Handler] = {
    "run.started": _run_started,
    "run.paused": _run_paused,
    "run.resumed": _run_resumed,
    "run.done": _run_done,
    "run.failed": _run_failed,
    "run.cancelled": _run_cancelled,
    "msg.start": _msg_start,
    "msg.delta": _msg_delta,
    "msg.end": _msg_end,
    "reason.delta": _reason_delta,
    "tool.call": _tool_call,
    "tool.result": _tool_result,
    "output": _output,
    "usage": _usage,
    "error": _error,
}

# The terminal event types must be the board's (edge_runtime/events.py); a mismatch is a
# bug in this module, caught at import rather than as a run that never finishes on screen.
assert set(TERMINAL) <= set(HANDLERS), "every terminal event type needs a handler"


def safe_error(err: Any) -> dict[str, str]:
    """The customer-safe part of a run.failed `err`: its kind and message, nothing else."""
    if not isinstance(err, Mapping):
        return {"kind": "internal", "msg": "the run failed"}
    kind = _str(err.get("kind"))
    msg = _str(err.get("msg")) or "the run failed"
    return {
        "kind": kind if kind in FAILURE_KINDS else "internal",
        "msg": msg[:_MAX_ERROR_MSG],
    }


def _checked(event: Envelope) -> dict[str, Any]:
    # The bridge's check, types unrestricted (see the module docstring). A Mapping that
    # is not a dict is copied: the wire check takes what msgpack decodes to.
    obj = dict(event) if isinstance(event, Mapping) and not isinstance(event, dict) else event
    return check_envelope(obj, strict_types=False)


def apply_event(snap: RunSnapshot, event: Envelope) -> bool:
    """Fold one event into its run's snapshot; False if it was ignored as a duplicate
    or replay (id at or below the last applied). Raises BadEnvelope for something that
    is not an envelope."""
    env = _checked(event)
    i: int = env["i"]
    if i <= snap.last_id:
        return False
    snap.last_id = i
    handler = HANDLERS.get(env["t"])
    if handler is not None:
        handler(snap, env["d"])
    return True


class Reducer:
    """Snapshots of many runs, keyed by run id. Not thread-safe: callers that feed it
    from a network thread hold their own lock (HostClient does).

    Run ids are unique per board, so a host watching several boards keeps one Reducer
    per device (`device` is copied into each snapshot).

    At most `max_runs` snapshots are kept: past it the run that finished first is
    forgotten, or, when none has finished, the run seen first. A late event of a
    forgotten run starts a new snapshot of it (from that event on)."""

    def __init__(self, device: str | None = None, max_runs: int = 1000) -> None:
        if max_runs < 1:
            raise ValueError("max_runs must be >= 1")
        self.device = device
        self.max_runs = max_runs
        self._runs: dict[str, RunSnapshot] = {}
        # Terminal runs in the order they finished: the first to go when over max_runs.
        self._finished: dict[str, None] = {}

    def apply(self, event: Envelope) -> RunSnapshot:
        """Fold one envelope; returns the run's snapshot (unchanged for a duplicate).
        Raises BadEnvelope for something that is not an envelope."""
        env = _checked(event)
        r: str = env["r"]
        snap = self._runs.get(r)
        if snap is None:
            snap = self._runs[r] = RunSnapshot(run=r, device=self.device)
            self._evict(keep=r)
        apply_event(snap, env)
        if snap.terminal and r not in self._finished:
            self._finished[r] = None
        return snap

    def _evict(self, keep: str) -> None:
        while len(self._runs) > self.max_runs:
            if self._finished:
                old = next(iter(self._finished))
                del self._finished[old]
            else:
                old = next(r for r in self._runs if r != keep)
            del self._runs[old]

    def apply_all(self, events: Iterable[Envelope]) -> None:
        for event in events:
            self.apply(event)

    def get(self, run: str) -> RunSnapshot | None:
        return self._runs.get(run)

    def runs(self) -> list[RunSnapshot]:
        """Every run seen, in the order it was first seen."""
        return list(self._runs.values())
