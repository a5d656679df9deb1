"""The snapshot reducer: folds a run's event stream into what a UI renders.

Events are the envelopes of docs/PROTOCOL.md (`{r, i, t, ts, n?, a?, k?, d}`). The
reducer keeps one `RunSnapshot` per run id and applies each event through one table of
event type -> handler (`HANDLERS`). Rules that every host shares (the dashboard's
JavaScript folds by the same rules):

* In id order, never with a hole papered over. MQTT keeps a run's order on one topic,
  but a replay after a reconnect, a repaired hole or a second bridge process can still
  deliver a later id before an earlier one, and text folded past a hole is text shown
  with a piece cut out of it. So a run's event is applied only when its id is the last
  applied + 1; one further ahead is held (at most MAX_HELD per run) until the hole
  below it fills, and the client asks the bridge to replay what is missing.
* Holes that can never fill are declared, not guessed: a gap report (an `error` of
  kind `gap` with `from`, `to`) is read as soon as it arrives, whatever its own id (it
  is numbered past the hole it reports), and a host client declares the ranges the
  bridge no longer holds with `Reducer.mark_lost`. When the next id to apply is in such
  a range, the reducer steps over the ids that did not arrive, with a `missing` row at
  that point of the transcript and the range in `gaps`; text after it goes on in new
  rows, so the marker sits where the text is missing.
* So a terminal status (done, failed, cancelled) is reached only in order: a snapshot is
  terminal only when every id below its terminal event was applied or declared lost,
  and `complete` only when none was lost. A host never shows part of an answer as all
  of it. A terminal status is final: nothing after it reopens the run.
* Idempotent by event id: an id already applied, stepped over or held is ignored, so a
  replay, a duplicate QoS 1 delivery or a late copy never doubles text or rows.
* The streams that are not runs — the board's device stream `_` and the bridge's `_b`
  — are folded as events arrive: they never end, their ids begin again at 1 when the
  board reboots or the bridge restarts, and each of their events (a refusal) stands
  alone, so nothing is gained by holding one for another.
* Unknown event types are ignored (forward compatible) but still take their id.
* `error` on a failed run is customer-safe: only the contract's `kind` and `msg` are kept.
* An envelope is checked by server_bridge.wire.check_envelope, the bridge's own check
  (any event type accepted), so the reducer folds exactly what a bridge forwards.
* Nodes (PROTOCOL.md "Nodes"): an event's `n`, `a`, `k` say which node it is about.
  `nodes` keeps one NodeState per path (its latest activation, status, port, usage),
  `edges` how often each edge was taken, `budgets` the latest `budget` event per kind:
  what a dashboard draws as the run's graph and meters. A terminal event ends the
  nodes still open with the run (done: completed; failed; cancelled).
* Where each row happened: events between a node's start and its end that carry no
  `n` happen in it, so a row takes the innermost activation open when it is made
  (`Row.node`, `Row.act`); a tool result takes its call's, because two waiting calls
  may be open at once and are answered in any order. A hole ends that knowledge: a
  node.end may be among the lost events, so the rows after a `missing` row, and the
  activations started after it, belong to no node until one starts after the hole
  (and its rows, and its children, are known again).
* Nesting is by path: an activation is within the innermost open activation whose
  path is an ancestor of its own (`/plan/search` within `/plan`), and at the top when
  none is; two calls waiting for a person are open at once side by side, not one in
  the other. An activation's rows are its own and those of the activations within it.
* Composite rows (`composites`) are derived from that evidence, never stored; each has
  a stable key, and lists its rows as indexes into `rows`:
  - a fan-out: an activation with activations of at least two distinct direct child
    paths within it (`/plan` -> `/plan/search`, `/plan/rank`); a track per branch path,
    with the status of that branch's latest activation. Key `fanout:<path>#<a>`.
  - a subagent: an activation whose node.start `kind` is `agent` or `subagent` (the
    app's word for a step that runs an agent of its own: PROTOCOL.md "Nodes" leaves
    kinds other than model and tool to the app); its rows, with how many are running,
    done and failed (a tool call and its result count once, as the call; in a run that
    has ended, a row left running counts as the run ended: done, or failed). Key
    `subagent:<path>#<a>`.
  - a repeat: activations that carry an iteration `k`, in one enclosing activation (or
    at the top): an activation whose `k` differs from the iteration open at its level
    opens a new one, headed by its path, and one with the same `k` joins it (so the
    model loop's `/model` and `/tool/<name>` of one step make one track). The
    iterations with the same head make a repeat, a track per iteration, from its
    first. Key `repeat:<head path>`, or `repeat:<enclosing path>#<a>><head path>`.
  Nothing is grouped by guess: with no node events, in an activation without `a`, or
  after a hole outside any activation started after it, the rows stay flat, and an
  activation whose parent is not known is in no fan-out and no repeat.
* Tool delivery (`Row.delivery`): a call a host answers (a client tool, a call waiting
  for approval) shows how its answer is getting to the board. It starts `pending`; the
  host client says `submitting`, `submitted` or `failed` (`Reducer.set_delivery`); the
  board's answer (its tool.result, approval.granted or denied) makes it `submitted`,
  but the result the board gives each waiting call when its run is cancelled (failed,
  output `cancelled`) makes a `pending` or `submitting` one `cancelled`, as the run's
  end does. Once the board has
  answered, or the run has ended, it no longer changes: the board's word outranks the
  host's.
* Windows: `window_rows` reads a snapshot's rows (its JSON) from the tail, `{rows,
  from, hasEarlier}`, as the HTTP API reads a conversation.
* The dashboard's twin: server_bridge/host/reducer.mjs folds by the same rules in plain
  JavaScript, and tests/test_reducer_fixtures.py holds both to the recorded streams in
  tests/fixtures/streams/ (the same snapshot JSON, byte for byte once canonical).
* Bounded: a Reducer keeps at most `max_runs` snapshots (finished runs are forgotten
  first), a snapshot at most the last MAX_ERRORS errors, MAX_HELD held events and
  MAX_HELD lost ranges ahead of what it applied, MAX_NODES node paths and MAX_NODES
  edges, MAX_ACTS activations with what opened them (past it, rows stay flat).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from edge_runtime.events import DEVICE_RUN, TERMINAL
from server_bridge.models.base import CAUSES
from server_bridge.wire import BRIDGE_RUN, BadEnvelope, check_envelope

__all__ = [
    "BRIDGE_RUN",
    "DEVICE_RUN",
    "FAILURE_KINDS",
    "HANDLERS",
    "MAX_ERRORS",
    "MAX_HELD",
    "MAX_NODES",
    "STREAMS",
    "DELIVERY_STATES",
    "MAX_ACTS",
    "SUBAGENT_KINDS",
    "BadEnvelope",
    "Budget",
    "NodeState",
    "Presence",
    "Reducer",
    "Row",
    "RunSnapshot",
    "Usage",
    "apply_event",
    "composites",
    "safe_error",
    "window_rows",
]

Status = Literal["running", "paused", "done", "failed", "cancelled"]
RowKind = Literal["user", "assistant", "output", "tool_call", "tool_result", "missing", "table_row"]
Envelope = Mapping[str, Any]
# Called after each event is applied, with that event and the snapshot as of it.
OnApply = Callable[[dict[str, Any], "RunSnapshot"], None]

# Streams that are not runs, folded as their events arrive (see the module docstring).
STREAMS: frozenset[str] = frozenset({DEVICE_RUN, BRIDGE_RUN})

TERMINAL_STATUSES: frozenset[str] = frozenset({"done", "failed", "cancelled"})


@dataclass(frozen=True)
class Presence:
    """Whether a device or the bridge is online, as a host learned it (PROTOCOL.md
    "Presence at the host"). `since`: Unix seconds of the change to `st`, None when it
    is not known (a bridge's last will kept retained by the broker says no time); `seen`:
    when this host learned it."""

    st: str  # "online", "offline", or "unseen": the bridge has never seen its status
    since: float | None
    seen: float

    @property
    def offline(self) -> bool:
        return self.st == "offline"


def presence_of(t: str, d: Mapping[str, Any], seen: float) -> Presence | None:
    """A device's presence from what the bridge sends on `_b`: a `presence` event
    `{st, since}`, or an `error` refusing a request `device_offline` (`since`); Unix ms
    on the wire. None for any other."""
    if t == "presence" and d.get("st") in ("online", "offline", "unseen"):
        st = d["st"]
    elif t == "error" and d.get("kind") == "device_offline":
        st = "offline"
    else:
        return None
    since = d.get("since")
    if not isinstance(since, (int, float)) or isinstance(since, bool) or not since > 0:
        return Presence(st, None, seen)
    return Presence(st, since / 1000, seen)


# The failure kinds of the contract (`run.failed` err.kind). Anything else is reported as
# `internal`, so a UI can switch on the kind without meeting a value it does not know.
# `link`: the board could not reach the bridge; `device`: the bridge ended the run for
# its board (the device restarted or went offline); `budget`: the run went past a limit
# its agent declared (see `budgets`).
# Why a model call failed (run.failed `err.cause` with kind llm; server_bridge/models/base.py).
MODEL_CAUSES = frozenset(CAUSES)
# `kb`: an agent's knowledge was unavailable or refused before its model call (PROTOCOL
# "Knowledge in runs").
FAILURE_KINDS = frozenset(
    {"llm", "tool", "condition", "internal", "link", "device", "timeout", "budget", "kb"}
)
# Citations kept per run: a run cites the passages of its model calls, a handful each.
MAX_CITATIONS = 32

# A customer-safe message is short; a board that sent a long one (a stack trace, say)
# should not be able to fill a UI with it.
_MAX_ERROR_MSG = 500
# Errors kept per snapshot: the device and bridge streams never end, and a host that
# watches one for days must not keep every refusal it ever saw.
MAX_ERRORS = 100
# Events held above a hole per run, and lost ranges recorded ahead of the next id. Past
# it the highest is dropped (and counted): it is the one furthest from being applied,
# and the replay that fills the hole brings it again. The bridge's window is 256 events
# per run, so a hole it can fill never needs more.
MAX_HELD = 1024
# Events of a stream (`_`, `_b`) remembered to drop repeats.
_STREAM_SEEN = 1024
# Node paths, and distinct edges, kept per snapshot: a handler's graph is small, and a
# board that sent more should not grow a dashboard without bound (counted in
# `nodes_dropped`).
MAX_NODES = 256
# A node's end status, and a budget's level, as the contract names them; anything else
# is shown as the nearest safe value (failed, warn).
_NODE_STATUSES = frozenset({"completed", "failed", "cancelled"})
_BUDGET_LEVELS = frozenset({"warn", "exceeded"})
# What the open nodes of a run become when the run ends.
_END_OF_RUN = {"done": "completed", "failed": "failed", "cancelled": "cancelled"}
# Activations kept per snapshot with what opened them (for composites and each row's
# node): a model loop of 20 steps with tools starts a hundred; past it, rows stay flat.
MAX_ACTS = 1024
# What is open after a hole (a node.end may have been lost), or in an activation not
# recorded (no `a`, or past MAX_ACTS): rows made there, and the activations started
# there, belong to no known node. Not a key: a key begins with a path's "/".
_UNKNOWN = "?"
# Node kinds read as a subagent (see the module docstring).
SUBAGENT_KINDS = frozenset({"agent", "subagent"})
# How a host's answer to a waiting call is getting to the board (Row.delivery).
DELIVERY_STATES = ("pending", "submitting", "submitted", "failed", "cancelled")
# A delivery the run's end turns `cancelled`: nothing reached the board and now nothing will.
_UNDELIVERED = frozenset({"pending", "submitting"})
# The output the board gives each call still waiting when its run is cancelled.
_CANCELLED = "cancelled"
# A call row's statuses while it waits for a host: past them, the board has answered.
_WAITING = frozenset({"pending", "approval"})
# Row statuses as a subagent rolls them up.
_ROLLUP = {
    "streaming": "running",
    "building": "running",
    "pending": "running",
    "running": "running",
    "approval": "running",
    "done": "done",
    "final": "done",
    "failed": "failed",
    "denied": "failed",
}


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
class NodeState:
    """One node path of a run (PROTOCOL.md "Nodes"): `activations` how many times it
    started, `a` and `k` its latest activation and iteration, `status` that activation's
    (`running` until its node.end, then completed / failed / cancelled), `port` the way
    out it took, `kind` as its node.start said, `usage` the tokens of all its
    activations, and `open` the activations started and not yet ended."""

    path: str
    kind: str | None = None
    status: str = "running"
    port: str | None = None
    activations: int = 0
    a: int | None = None
    k: int | None = None
    usage: Usage = field(default_factory=Usage)
    open: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class _Act:
    """One node activation as it started: its path, `a`, iteration `k`, `kind`, and
    `parent`, the key of the activation it is within (None at the top, _UNKNOWN when
    that is not known; see _parent). Never changed, so snapshot copies share it."""

    path: str
    a: int
    k: int | None
    kind: str | None
    parent: str | None


@dataclass
class Budget:
    """The latest `budget` event of one kind (steps, tokens, wall_s, reads)."""

    kind: str
    used: float
    limit: float
    level: str


@dataclass
class Row:
    """One rendered row of a run, in event order.

    kind user / assistant: `text` (assistant rows also collect `reasoning`, keyed by `key`,
    the message id `m`); output: `name`, `output` (the value; deltas concatenate), `format`;
    tool_call: `call`, `name`, `input` (a JSON string), `client`; tool_result: `call`, `name`
    (from its call), `output`, `failed`; missing: `text` `[missing: events a..b]`, where
    events that will never arrive were stepped over. `status` is `streaming`/`done` for
    assistant rows, `building`/`final` for outputs, `pending`/`running`/`done`/`failed`
    for tool calls, and `approval` (waiting for a person) / `denied` for a call that
    needs approval (`text` then says who decided). table_row (in `tables`, not `rows`):
    `name` the field, `key` the row, `output` its value, `links`, `ver`, `status`
    `building`/`final`/`failed` (`failed` with `error`), `stored` when it was shown as
    stored before the run. `delivery`: see the module docstring; `node`, `act`: the node
    activation the row happened in, when known.
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
    # An assistant row's end as the model gave it (msg.end `finish`): `length` says its
    # token limit cut the answer short.
    finish: str | None = None
    links: list[Any] = field(default_factory=list)
    ver: int | None = None
    stored: bool = False
    error: dict[str, str] | None = None
    # A table's order: this run's writes (positive, latest highest) before the stored
    # rows shown at run start (negative, in the order shown: newest first).
    order: int = 0
    # A call a host answers: how its answer is getting to the board (DELIVERY_STATES).
    delivery: str | None = None
    # The node activation the row happened in (path, a); None when not known.
    node: str | None = None
    act: int | None = None


@dataclass
class RunSnapshot:
    """What a UI renders for one run. `rows` is ordered; `pending` holds the client tool
    calls still waiting for an answer, keyed by call id (the same Row objects as in rows).

    `last_id` is the id up to which every event was applied or declared lost (the next
    one applied is last_id + 1); `held` the ids that arrived above a hole and wait for
    it; `gaps` (also `missing`) the ranges stepped over, each with its `missing` row;
    `dropped` the held events dropped over MAX_HELD (a replay brings them again)."""

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
    # The passages the run used, as `citation` events name them (n, col, src, ver,
    # chunk, h, score), in order; at most MAX_CITATIONS.
    citations: list[dict[str, Any]] = field(default_factory=list)
    dropped: int = 0
    # Table rows not kept past MAX_TABLE_ROWS of one table.
    rows_dropped: int = 0
    # The run's nodes by path, in the order first started; each edge (from, port, to)
    # with how many times it was taken; the latest budget event per kind; node events
    # (and edges) not kept past MAX_NODES paths (edges).
    nodes: dict[str, NodeState] = field(default_factory=dict)
    edges: dict[tuple[str, str | None, str], int] = field(default_factory=dict)
    budgets: dict[str, Budget] = field(default_factory=dict)
    nodes_dropped: int = 0
    # Indexes into rows, so deltas and results find their row without a scan.
    _messages: dict[str, Row] = field(default_factory=dict, repr=False)
    _calls: dict[str, Row] = field(default_factory=dict, repr=False)
    _outputs: dict[str, Row] = field(default_factory=dict, repr=False)
    # Activations by key `<path>#<a>`, in the order they started (what composites are
    # derived from); each one's status (running, completed, failed, cancelled); the
    # keys open now, innermost last (_UNKNOWN for what is not known).
    _acts: dict[str, _Act] = field(default_factory=dict, repr=False)
    _act_status: dict[str, str] = field(default_factory=dict, repr=False)
    _open: list[str] = field(default_factory=list, repr=False)
    # Tables: field -> row key -> its table_row (read them with `table`).
    tables: dict[str, dict[str, Row]] = field(default_factory=dict)
    _table_events: int = field(default=0, repr=False)
    # Events that arrived above a hole, by id; ranges declared lost that lie ahead of
    # last_id (sorted, disjoint, not adjacent); a stream's recently seen ids.
    _held: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False)
    _lost: list[tuple[int, int]] = field(default_factory=list, repr=False)
    _seen: dict[tuple[Any, ...], None] = field(default_factory=dict, repr=False)

    def table(self, name: str) -> list[Row]:
        """A table field's rows as a dashboard lists them: most recent first."""
        rows = self.tables.get(name, {})
        return sorted(rows.values(), key=lambda r: r.order, reverse=True)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def active(self) -> list[tuple[str, int]]:
        """The node activations started and not ended, (path, a), in path order of first
        start: which node is doing what now."""
        return [(n.path, a) for n in self.nodes.values() for a in sorted(n.open)]

    @property
    def held(self) -> list[int]:
        """Ids that arrived above a hole and wait for it to fill, lowest first."""
        return sorted(self._held)

    @property
    def missing(self) -> list[tuple[int, int]]:
        """The id ranges stepped over because they will never arrive (= `gaps`)."""
        return list(self.gaps)

    @property
    def complete(self) -> bool:
        """Terminal, and every id below the terminal event was applied: nothing missing."""
        return self.terminal and not self.gaps

    def copy(self) -> RunSnapshot:
        """A copy that shares nothing the reducer changes later, nor anything a caller
        could change under the reducer: what copy.deepcopy gives, in a seventh of its
        time. A host client hands one to its callback for every event it applies, on the
        way to the user's first words (a run's first rows: 25 us with deepcopy, 3.7 us
        with this, on a warm cache).

        Rows are copied (the indexes point at the copies), values a row or an error
        holds are deep-copied when they are containers (an output's map), and held
        events, whose dicts the reducer never changes, are shared."""
        rows = [_copy_row(row) for row in self.rows]
        by_id = {id(old): new for old, new in zip(self.rows, rows, strict=True)}

        def index(d: dict[str, Row]) -> dict[str, Row]:
            return {k: by_id.get(id(row)) or _copy_row(row) for k, row in d.items()}

        out = _shallow(self)
        out.error = dict(self.error) if self.error is not None else None
        out.usage = _shallow(self.usage)
        out.rows = rows
        out.pending = index(self.pending)
        out.gaps = list(self.gaps)
        out.errors = copy.deepcopy(self.errors) if self.errors else []
        out._messages = index(self._messages)
        out._calls = index(self._calls)
        out._outputs = index(self._outputs)
        out._held = dict(self._held)
        out._lost = list(self._lost)
        out._seen = dict(self._seen)
        # Tables, nodes, edges and budgets: the reducer changes each in place.
        out.tables = {
            name: {k: _copy_row(r) for k, r in t.items()} for name, t in self.tables.items()
        }
        out.nodes = {k: _copy_node(n) for k, n in self.nodes.items()}
        out.edges = dict(self.edges)
        out.budgets = {k: _shallow(b) for k, b in self.budgets.items()}
        out._acts = dict(self._acts)  # the _Act records are never changed: shared
        out._act_status = dict(self._act_status)
        out._open = list(self._open)
        return out


_T = TypeVar("_T")


def _shallow(obj: _T) -> _T:
    # copy.copy without its protocol lookups (plain dataclasses: their __dict__ is all).
    out = object.__new__(type(obj))
    out.__dict__.update(obj.__dict__)
    return out


def _copy_row(row: Row) -> Row:
    out = _shallow(row)
    if isinstance(out.output, (dict, list)):
        out.output = copy.deepcopy(out.output)
    if out.links:
        out.links = copy.deepcopy(out.links)
    if out.error is not None:
        out.error = dict(out.error)
    return out


def _copy_node(node: NodeState) -> NodeState:
    out = _shallow(node)
    out.usage = _shallow(node.usage)
    return out


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
        if snap.terminal:
            _end_open_nodes(snap)


def _end_open_nodes(snap: RunSnapshot) -> None:
    # The run ended: a node it left open ended with it, and an answer that had not
    # reached the board never will.
    end = _END_OF_RUN[snap.status]
    for node in snap.nodes.values():
        if node.open:
            node.open.clear()
            if node.status == "running":
                node.status = end
    for key, status in snap._act_status.items():
        if status == "running":
            snap._act_status[key] = end
    snap._open.clear()
    for row in snap._calls.values():
        if row.delivery in _UNDELIVERED:
            row.delivery = "cancelled"


def _row(snap: RunSnapshot, row: Row, at: Row | None = None) -> Row:
    # A row happens in the innermost activation open (see the module docstring), or
    # where `at` happened (a tool result: where its call did).
    if at is not None:
        row.node, row.act = at.node, at.act
    elif row.kind != "missing" and snap._open and snap._open[-1] != _UNKNOWN:
        act = snap._acts[snap._open[-1]]
        row.node, row.act = act.path, act.a
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
        # A long request is echoed cut (input_len is its whole length): say so.
        whole = _int(d.get("input_len"))
        if whole > len(text):
            text += f" [cut: {whole - len(text)} more characters]"
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
    _set_status(snap, "failed")


def _run_cancelled(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    if snap.terminal:
        return
    snap.reason = _str(d.get("reason"))
    _set_status(snap, "cancelled")


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
        row.finish = _str(d.get("finish"))


def _tool_call(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    call = _key(d.get("call"))
    client = d.get("client") is True
    known = snap._calls.get(call) if call is not None else None
    if known is not None:
        # Announced again (a board that rebooted while paused): the same call, still
        # waiting unless it has its result.
        if client and known.status == "pending" and call is not None:
            snap.pending[call] = known
        return
    row = _row(
        snap,
        Row(
            "tool_call",
            call=call,
            name=_str(d.get("name")),
            input=_str(d.get("input")) or "{}",
            client=client,
            status="pending" if client else "running",
            delivery="pending" if client else None,
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
        if call_row.delivery in _UNDELIVERED and failed and d.get("output") == _CANCELLED:
            # The board's own result for a call its run's cancel ended (edge_runtime/
            # pause.py): no answer got there.
            call_row.delivery = "cancelled"
        elif call_row.delivery is not None:
            call_row.delivery = "submitted"  # the board has the answer
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
        at=call_row,
    )


def _approval(snap: RunSnapshot, d: Mapping[str, Any], status: str) -> None:
    call = _key(d.get("call"))
    row = snap._calls.get(call) if call is not None else None
    if row is None or call is None or row.status in ("done", "failed"):
        return
    row.status = status
    if status == "approval":
        snap.pending[call] = row  # a host answers it (approve), like a client tool
        if row.delivery is None:
            row.delivery = "pending"
    else:
        snap.pending.pop(call, None)
        if row.delivery is not None:
            row.delivery = "submitted"  # the board has the decision
        by = _str(d.get("by"))
        if by is not None:
            row.text = f"{'approved' if status == 'running' else 'denied'} by {by}"


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


# Rows kept per table of a snapshot: a run shows at most 50 stored rows and writes
# what it writes; a board that sent more should not grow a dashboard without bound.
MAX_TABLE_ROWS = 1000


def _table_row(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    name, key = _str(d.get("field")), _key(d.get("row"))
    if name is None or key is None:
        return
    table = snap.tables.setdefault(name, {})
    row = table.get(key)
    stored = d.get("stored") is True
    if row is None:
        if len(table) >= MAX_TABLE_ROWS:
            snap.rows_dropped += 1
            return
        row = table[key] = Row("table_row", name=name, key=key)
    snap._table_events += 1
    if stored:
        row.order = -snap._table_events
    else:
        row.order = snap._table_events
    row.stored = stored
    # Updated in place: a failed or building event without a value keeps the last known.
    if "value" in d:
        row.output = d["value"]
    if isinstance(d.get("links"), list):
        row.links = list(d["links"])
    ver = d.get("ver")
    if isinstance(ver, int) and not isinstance(ver, bool):
        row.ver = ver
    status = _str(d.get("status"))
    if status is not None:
        row.status = status
    row.failed = status == "failed"
    err = d.get("err")
    row.error = None
    if row.failed:
        # An RPC error kind (PROTOCOL "Errors") or `device`/`cancelled`: shown as it is,
        # bounded like any message a board sends.
        err = err if isinstance(err, Mapping) else {}
        row.error = {
            "kind": (_str(err.get("kind")) or "internal")[:32],
            "msg": (_str(err.get("msg")) or "the write failed")[:_MAX_ERROR_MSG],
        }


def _table_delete(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    name, key = _str(d.get("field")), _key(d.get("row"))
    if name is not None and key is not None:
        snap.tables.get(name, {}).pop(key, None)


def _usage(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    # Progress toward run.done's total; the node's share is kept by _on_node.
    snap.usage.add(d)


def _edge(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    frm, to = _str(d.get("from")), _str(d.get("to"))
    if frm is None or to is None:
        return
    key = (frm, _str(d.get("port")), to)
    if key not in snap.edges and len(snap.edges) >= MAX_NODES:
        snap.nodes_dropped += 1
        return
    snap.edges[key] = snap.edges.get(key, 0) + 1


def _budget(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    kind = _str(d.get("kind"))
    used, limit = _number(d.get("used")), _number(d.get("limit"))
    if kind is None or used is None or limit is None:
        return
    level = _str(d.get("level"))
    snap.budgets[kind[:32]] = Budget(
        kind[:32], used, limit, level if level in _BUDGET_LEVELS else "warn"
    )


def _number(value: Any) -> float | None:
    # A count or seconds; bool is an int subclass, not a number here.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    return None


def _on_node(snap: RunSnapshot, env: Mapping[str, Any]) -> None:
    # The node an event names (its envelope's n, a, k): node.start opens an activation,
    # node.end closes it with its status and port, usage adds to its tokens.
    path, a = env["n"], env.get("a")
    if env["t"] == "node.start":
        _open_act(snap, path, a, env.get("k"), _str(env["d"].get("kind")))
    elif env["t"] == "node.end" and a is not None:
        _close_act(snap, f"{path}#{a}", _str(env["d"].get("status")))
    node = snap.nodes.get(path)
    if node is None:
        if len(snap.nodes) >= MAX_NODES:
            snap.nodes_dropped += 1
            return
        node = snap.nodes[path] = NodeState(path)
    t, d = env["t"], env["d"]
    if t == "node.start":
        node.activations += 1
        node.a, node.k = a, env.get("k")
        node.status, node.port = "running", None
        node.kind = _str(d.get("kind")) or node.kind
        if a is not None:
            node.open.add(a)
    elif t == "node.end":
        if a is not None:
            node.open.discard(a)
        if a is None or a == node.a:
            status = _str(d.get("status"))
            node.status = status if status in _NODE_STATUSES else "failed"
            node.port = _str(d.get("port"))
    elif t == "usage":
        node.usage.add(d)


def _open_act(snap: RunSnapshot, path: str, a: int | None, k: int | None, kind: str | None) -> None:
    # The activation's record, and it is now the innermost open. One without `a`, or
    # past MAX_ACTS, is open all the same but unknown: what happens in it stays flat.
    key = f"{path}#{a}"
    if key in snap._acts:
        return  # started twice: the first start stands
    if a is None or len(snap._acts) >= MAX_ACTS:
        if a is not None:
            snap.nodes_dropped += 1
        _push(snap, _UNKNOWN)
        return
    snap._acts[key] = _Act(path, a, k, kind, _parent(snap, path))
    snap._act_status[key] = "running"
    _push(snap, key)


def _push(snap: RunSnapshot, key: str) -> None:
    # At most MAX_ACTS open at once: past it (starts that never end), what is innermost
    # is not known.
    if len(snap._open) >= MAX_ACTS:
        snap._open[-1] = _UNKNOWN
    else:
        snap._open.append(key)


def _parent(snap: RunSnapshot, path: str) -> str | None:
    # Within the innermost open activation whose path is an ancestor of `path`: two
    # waiting calls are open at once side by side, not one in the other. Unknown when
    # what is open past a hole comes first.
    for key in reversed(snap._open):
        if key == _UNKNOWN:
            return _UNKNOWN
        if path.startswith(snap._acts[key].path + "/"):
            return key
    return None


def _close_act(snap: RunSnapshot, key: str, status: str | None) -> None:
    if key in snap._act_status:
        snap._act_status[key] = status if status in _NODE_STATUSES else "failed"
    # Not always the innermost: two waiting calls are answered in any order.
    for n in range(len(snap._open) - 1, -1, -1):
        if snap._open[n] == key:
            del snap._open[n]
            break


def _error(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    # A gap report's range was read when it arrived (see _gap_range); here, in its
    # place in the run, it is recorded like any other error.
    kind = _str(d.get("kind")) or "internal"
    entry: dict[str, Any] = {"kind": kind, "msg": (_str(d.get("msg")) or "")[:_MAX_ERROR_MSG]}
    gap = _gap_range(d) if kind == "gap" else None
    if gap is not None:
        entry["from"], entry["to"] = gap
    req = _str(d.get("req"))
    if req is not None:
        entry["req"] = req  # the request a refusal names (streams "_" and "_b")
    run = _str(d.get("r"))
    if run is not None:
        entry["r"] = run  # the run a bridge's answer to a replay names (stream "_b")
    snap.errors.append(entry)
    del snap.errors[:-MAX_ERRORS]


def _citation(snap: RunSnapshot, d: Mapping[str, Any]) -> None:
    if len(snap.citations) >= MAX_CITATIONS:
        return
    entry: dict[str, Any] = {}
    for key in ("col", "src", "ver", "h"):
        value = _str(d.get(key))
        if value is not None:
            entry[key] = value[:200]
    for key in ("n", "chunk"):
        value = d.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            entry[key] = value
    score = d.get("score")
    if isinstance(score, (int, float)) and not isinstance(score, bool):
        entry["score"] = float(score)
    if "src" in entry:
        snap.citations.append(entry)


Handler = Callable[[RunSnapshot, Mapping[str, Any]], None]

# The one dispatch table. Types of the contract not listed here (memory writes, ...)
# do not change what this snapshot renders; they are ignored like unknown ones. An event
# that names a node (`n`) is also folded into that node (_on_node).
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
    "approval.request": lambda snap, d: _approval(snap, d, "approval"),
    "approval.granted": lambda snap, d: _approval(snap, d, "running"),
    "approval.denied": lambda snap, d: _approval(snap, d, "denied"),
    "output": _output,
    "row": _table_row,
    "row.delete": _table_delete,
    "usage": _usage,
    "edge": _edge,
    "budget": _budget,
    "error": _error,
    "citation": _citation,
}

# The terminal event types must be the board's (edge_runtime/events.py); a mismatch is a
# bug in this module, caught at import rather than as a run that never finishes on screen.
assert set(TERMINAL) <= set(HANDLERS), "every terminal event type needs a handler"


def safe_error(err: Any) -> dict[str, str]:
    """The customer-safe part of a run.failed `err`: its kind and message, and for a
    model's failure its `cause` when it is one the contract names; nothing else."""
    if not isinstance(err, Mapping):
        return {"kind": "internal", "msg": "the run failed"}
    kind = _str(err.get("kind"))
    msg = _str(err.get("msg")) or "the run failed"
    out = {
        "kind": kind if kind in FAILURE_KINDS else "internal",
        "msg": msg[:_MAX_ERROR_MSG],
    }
    cause = _str(err.get("cause"))
    if cause in MODEL_CAUSES:
        out["cause"] = cause
    return out


def _checked(event: Envelope) -> dict[str, Any]:
    # The bridge's check, types unrestricted (see the module docstring). A Mapping that
    # is not a dict is copied: the wire check takes what msgpack decodes to.
    obj = dict(event) if isinstance(event, Mapping) and not isinstance(event, dict) else event
    return check_envelope(obj, strict_types=False)


def _gap_range(d: Mapping[str, Any]) -> tuple[int, int] | None:
    # check_envelope has refused a gap report without ints 1 <= from <= to already;
    # this is for the `d` of a map that did not pass through it.
    lo, hi = _int(d.get("from")), _int(d.get("to"))
    return (lo, hi) if 1 <= lo <= hi else None


def apply_event(
    snap: RunSnapshot, event: Envelope, on_apply: OnApply | None = None
) -> list[dict[str, Any]]:
    """Fold one event into its run's snapshot. Returns the events applied by this call,
    in id order: none when it was a duplicate or was held above a hole, several when it
    filled one (with the held events it released). `on_apply(event, snap)` is called
    after each. Raises BadEnvelope for something that is not an envelope."""
    return _apply_checked(snap, _checked(event), on_apply)


def _apply_checked(
    snap: RunSnapshot, env: dict[str, Any], on_apply: OnApply | None
) -> list[dict[str, Any]]:
    # apply_event for an envelope already checked (Reducer.fold checks it once).
    if snap.run in STREAMS:
        return _apply_stream(snap, env, on_apply)
    i: int = env["i"]
    if i <= snap.last_id or i in snap._held:
        return []
    if env["t"] == "error" and env["d"].get("kind") == "gap":
        gap = _gap_range(env["d"])
        if gap is not None:
            _record_lost(snap, *gap)
    applied: list[dict[str, Any]] = []
    if i == snap.last_id + 1:
        _apply_one(snap, env, applied, on_apply)
    else:
        _hold(snap, env)
    _advance(snap, applied, on_apply)
    return applied


def mark_lost(
    snap: RunSnapshot, lo: int, hi: int, on_apply: OnApply | None = None
) -> list[dict[str, Any]]:
    """Declare ids lo..hi of the run lost (they will never arrive); returns the held
    events this released, applied in order. An id of the range that arrives before the
    reducer reaches it is applied all the same. Nothing for a stream, or an empty range."""
    applied: list[dict[str, Any]] = []
    if snap.run in STREAMS or lo > hi:
        return applied
    _record_lost(snap, lo, hi)
    _advance(snap, applied, on_apply)
    return applied


def _apply_one(
    snap: RunSnapshot,
    env: dict[str, Any],
    applied: list[dict[str, Any]],
    on_apply: OnApply | None,
) -> None:
    snap.last_id = env["i"]
    handler = HANDLERS.get(env["t"])
    if handler is not None:
        handler(snap, env["d"])
    if env.get("n") is not None and not snap.terminal:
        _on_node(snap, env)
    applied.append(env)
    if on_apply is not None:
        on_apply(env, snap)


def _apply_stream(
    snap: RunSnapshot, env: dict[str, Any], on_apply: OnApply | None
) -> list[dict[str, Any]]:
    i: int = env["i"]
    # A repeat (a QoS 1 redelivery, a replay) is the same envelope. The id alone is not
    # enough: a stream's ids begin again at 1 when the board reboots or the bridge
    # restarts, and those events are new (their time and contents differ).
    key = (i, env["ts"], env["t"], repr(env["d"]))
    if key in snap._seen:
        return []
    snap._seen[key] = None
    while len(snap._seen) > _STREAM_SEEN:
        del snap._seen[next(iter(snap._seen))]
    # last_id is the highest id seen, applied before the event so on_apply sees it.
    snap.last_id = max(snap.last_id, i)
    applied = [env]
    handler = HANDLERS.get(env["t"])
    if handler is not None:
        handler(snap, env["d"])
    if on_apply is not None:
        on_apply(env, snap)
    return applied


def _hold(snap: RunSnapshot, env: dict[str, Any]) -> None:
    snap._held[env["i"]] = env
    if len(snap._held) > MAX_HELD:
        del snap._held[max(snap._held)]
        snap.dropped += 1


def _record_lost(snap: RunSnapshot, lo: int, hi: int) -> None:
    """Add lo..hi (only what lies past last_id) to the sorted, merged lost ranges."""
    lo = max(lo, snap.last_id + 1)
    if lo > hi:
        return
    merged: list[tuple[int, int]] = []
    for a, b in sorted([*snap._lost, (lo, hi)]):
        if merged and a <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    del merged[MAX_HELD:]  # past it, the highest: a replay reports them again
    snap._lost = merged


def _advance(snap: RunSnapshot, applied: list[dict[str, Any]], on_apply: OnApply | None) -> None:
    """Apply held events and step over lost ids for as long as the next id is either."""
    while True:
        nxt = snap.last_id + 1
        env = snap._held.pop(nxt, None)
        if env is not None:
            _apply_one(snap, env, applied, on_apply)
            continue
        while snap._lost and snap._lost[0][1] < nxt:
            snap._lost.pop(0)
        if not snap._lost or snap._lost[0][0] > nxt:
            return
        # Step over the lost ids up to the end of the range, or up to the first held id
        # inside it: an id reported lost that arrived after all is applied, not skipped.
        end = snap._lost[0][1]
        inside = [i for i in snap._held if i <= end]
        if inside:
            end = min(inside) - 1
        _step_over(snap, nxt, end)


def _step_over(snap: RunSnapshot, lo: int, hi: int) -> None:
    snap.last_id = hi
    snap.gaps.append((lo, hi))
    # What is open past a hole is not known (a node.end may be among the lost ids).
    snap._open[:] = [_UNKNOWN]
    _row(snap, Row("missing", text=f"[missing: events {lo}..{hi}]"))
    # Text of a message or an output that goes on past the hole starts a new row after
    # the marker, so the marker stands where the text is missing, not after all of it.
    snap._messages.clear()
    snap._outputs.clear()


def composites(snap: RunSnapshot) -> list[dict[str, Any]]:
    """The composite rows of a run, derived from its node activations (the rules are in
    the module docstring), in the order their first activation started; a fan-out before
    a subagent of the same activation. Each: `key` (stable while the run goes on),
    `type` (fanout, subagent, repeat), `node` (its path, or a repeat's head), `status`
    (running, completed, failed, cancelled), `rows` (indexes into `rows`, its own and
    those of the activations within it); a fan-out and a subagent also `act`, a fan-out
    `tracks` [{node, acts, status, rows}] (one per branch path), a subagent `counts`
    {running, done, failed}, a repeat `tracks` [{k, status, nodes: [{node, act,
    status}], rows}] (one per iteration). Recomputed from the snapshot on each call."""
    acts, status = snap._acts, snap._act_status
    if not acts:
        return []
    # Each activation's rows: those made in it and in the activations within it.
    inner: dict[str, list[int]] = {}
    for i, row in enumerate(snap.rows):
        key: str | None = f"{row.node}#{row.act}" if row.node is not None else None
        while key is not None and key in acts:
            inner.setdefault(key, []).append(i)
            key = acts[key].parent
    order = {key: n for n, key in enumerate(acts)}
    found: list[tuple[int, int, dict[str, Any]]] = []

    # Fan-outs: the direct children of each activation, by path in the order first started.
    branches: dict[str, dict[str, list[str]]] = {}
    for key, act in acts.items():
        parent = act.parent
        if parent is not None and parent in acts and _child_path(acts[parent].path, act.path):
            branches.setdefault(parent, {}).setdefault(act.path, []).append(key)
    for key, paths in branches.items():
        if len(paths) < 2:
            continue
        act = acts[key]
        branch_tracks = [
            {
                "node": path,
                "acts": [acts[k].a for k in keys],
                "status": status[keys[-1]],
                "rows": _union(inner, keys),
            }
            for path, keys in paths.items()
        ]
        found.append((order[key], 0, {
            "key": f"fanout:{key}", "type": "fanout", "node": act.path, "act": act.a,
            "status": status[key], "rows": inner.get(key, []), "tracks": branch_tracks,
        }))  # fmt: skip

    # Subagents: their rows, rolled up.
    for key, act in acts.items():
        if act.kind not in SUBAGENT_KINDS:
            continue
        counts = {"running": 0, "done": 0, "failed": 0}
        for i in inner.get(key, []):
            row = snap.rows[i]
            bucket = _ROLLUP.get(row.status or "") if row.kind != "tool_result" else None
            if bucket == "running" and snap.terminal:
                bucket = "done" if snap.status == "done" else "failed"
            if bucket is not None:
                counts[bucket] += 1
        found.append((order[key], 1, {
            "key": f"subagent:{key}", "type": "subagent", "node": act.path, "act": act.a,
            "status": status[key], "rows": inner.get(key, []), "counts": counts,
        }))  # fmt: skip

    # Repeats: iterations at each level (enclosing activation), grouped by their head.
    now: dict[str | None, tuple[int, list[str]]] = {}  # level -> (k, keys) open there
    repeats: dict[str, tuple[int, str, list[tuple[int, list[str]]]]] = {}
    for key, act in acts.items():
        if act.k is None or act.parent == _UNKNOWN:
            continue
        level = act.parent
        it = now.get(level)
        if it is None or it[0] != act.k:
            name = f"repeat:{level}>{act.path}" if level is not None else f"repeat:{act.path}"
            if name not in repeats:
                repeats[name] = (order[key], act.path, [])
            it = now[level] = (act.k, [])
            repeats[name][2].append(it)
        it[1].append(key)
    for name, (first, head, iterations) in repeats.items():
        tracks: list[dict[str, Any]] = [
            {
                "k": k,
                "status": _rollup_status(status[x] for x in keys),
                "nodes": [
                    {"node": acts[x].path, "act": acts[x].a, "status": status[x]} for x in keys
                ],
                "rows": _union(inner, keys),
            }
            for k, keys in iterations
        ]
        found.append((first, 2, {
            "key": name, "type": "repeat", "node": head,
            "status": _rollup_status(t["status"] for t in tracks),
            "rows": _union(inner, [x for _, keys in iterations for x in keys]), "tracks": tracks,
        }))  # fmt: skip
    found.sort(key=lambda f: (f[0], f[1]))
    return [c for _, _, c in found]


def _child_path(parent: str, path: str) -> bool:
    # `/plan/search` is a direct child of `/plan`; `/plan/a/b` and `/planner` are not.
    return path.startswith(parent + "/") and "/" not in path[len(parent) + 1 :]


def _union(inner: Mapping[str, list[int]], keys: Iterable[str]) -> list[int]:
    return sorted({i for key in keys for i in inner.get(key, ())})


def _rollup_status(statuses: Iterable[str]) -> str:
    # Running while any part runs; else failed, cancelled, completed, the worst first.
    seen = set(statuses)
    for status in ("running", "failed", "cancelled"):
        if status in seen:
            return status
    return "completed"


def window_rows(view: Mapping[str, Any], limit: int, before: int | None = None) -> dict[str, Any]:
    """A window of a snapshot's rows read from the tail, as the HTTP API reads a
    conversation (`GET /v1/conversations/C`): `view` is snapshot JSON (or any map with
    `rows`); the last `limit` rows before index `before` (the end when None). Returns
    `{rows, from, hasEarlier}`: `from` the index of its first row (composite row
    indexes are absolute: window row j is index from + j), `hasEarlier` whether rows
    come before it (from > 0)."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError("limit must be an int >= 0")
    if before is not None and (isinstance(before, bool) or not isinstance(before, int)):
        raise ValueError("before must be an int or None")
    rows = list(view.get("rows") or [])
    end = len(rows) if before is None else min(max(before, 0), len(rows))
    start = max(0, end - limit)
    return {"rows": rows[start:end], "from": start, "hasEarlier": start > 0}


class Reducer:
    """Snapshots of many runs, keyed by run id. Not thread-safe: callers that feed it
    from a network thread hold their own lock (HostClient does).

    Run ids are unique per board, so a host watching several boards keeps one Reducer
    per device (`device` is copied into each snapshot).

    At most `max_runs` snapshots are kept: past it the run that finished first is
    forgotten, or, when none has finished, the run seen first. A late event of a
    forgotten run starts a new snapshot of it (from that event on, held until the ids
    below it arrive or are declared lost)."""

    def __init__(self, device: str | None = None, max_runs: int = 1000) -> None:
        if max_runs < 1:
            raise ValueError("max_runs must be >= 1")
        self.device = device
        self.max_runs = max_runs
        self._runs: dict[str, RunSnapshot] = {}
        # Terminal runs in the order they finished: the first to go when over max_runs.
        self._finished: dict[str, None] = {}
        # The device's presence as the bridge last told it on `_b`: None when not told,
        # or since an event of one of its runs showed it back.
        self.presence: Presence | None = None

    def apply(self, event: Envelope) -> RunSnapshot:
        """Fold one envelope; returns the run's snapshot (unchanged for a duplicate or
        an event held above a hole). Raises BadEnvelope for something that is not an
        envelope."""
        return self.fold(event)[0]

    def fold(
        self, event: Envelope, on_apply: OnApply | None = None
    ) -> tuple[RunSnapshot, list[dict[str, Any]]]:
        """Fold one envelope; returns the run's snapshot and the events this applied, in
        id order (see apply_event; `on_apply` is called after each)."""
        env = _checked(event)
        r: str = env["r"]
        snap = self._runs.get(r)
        if snap is None:
            snap = self._runs[r] = RunSnapshot(run=r, device=self.device)
            self._evict(keep=r)
        applied = _apply_checked(snap, env, on_apply)
        self._note(snap)
        if r == BRIDGE_RUN and applied:
            presence = presence_of(env["t"], env["d"], time.time())
            if presence is not None:
                self.presence = presence
        elif r not in STREAMS and applied:
            self.presence = None
        return snap, applied

    def mark_lost(
        self, run: str, lo: int, hi: int, on_apply: OnApply | None = None
    ) -> list[dict[str, Any]]:
        """Declare ids lo..hi of `run` lost: the bridge no longer holds them (its answer
        to a replay), or nothing can fill the hole. Returns the held events this
        released, applied in order. Nothing for a run this reducer does not hold."""
        snap = self._runs.get(run)
        if snap is None:
            return []
        applied = mark_lost(snap, lo, hi, on_apply)
        self._note(snap)
        return applied

    def set_delivery(self, run: str, call: str, state: str) -> bool:
        """Say how a host's answer to call `call` of `run` is getting to the board: one
        of DELIVERY_STATES (ValueError for another). False when this reducer does not
        hold the run, or the call is not one a host answers (a client tool, a call
        waiting for approval). A call the board has answered, or of a run that ended,
        keeps its delivery (see the module docstring) and this is still True."""
        if state not in DELIVERY_STATES:
            raise ValueError(f"a delivery state is one of {', '.join(DELIVERY_STATES)}")
        snap = self._runs.get(run)
        row = snap._calls.get(call) if snap is not None else None
        if snap is None or row is None or row.delivery is None:
            return False
        if not snap.terminal and row.status in _WAITING:
            row.delivery = state
        return True

    def _note(self, snap: RunSnapshot) -> None:
        if snap.terminal and snap.run not in self._finished:
            self._finished[snap.run] = None

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
