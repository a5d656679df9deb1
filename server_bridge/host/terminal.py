"""A plain-text view of runs: a transcript renderer and a live, incremental printer.

No curses and no cursor movement: lines are only ever appended, so the output reads the
same in a terminal, a CI log or a file. Streamed text (assistant turns, outputs built
from deltas) is printed as it arrives on one open line that is closed with a newline
when the stream ends.

A run that ended with events missing (stepped over by the reducer, never to arrive) is
never shown as whole: the transcript has a `[missing: events a..b]` line where the text
is missing, and the status line says `(incomplete: events a..b missing)`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from server_bridge.host.reducer import (
    Budget,
    Envelope,
    Presence,
    Reducer,
    Row,
    RunSnapshot,
    presence_of,
)

# Row statuses that mean "more text may still be appended to this row".
_OPEN_STATUSES = frozenset({"streaming", "building"})


def _value_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    # default=str: msgpack may deliver bytes or other non-JSON values; show them anyway.
    return json.dumps(value, ensure_ascii=False, default=str)


def render_row(row: Row) -> str:
    """One row as text. A row that is still streaming renders as a prefix of what it will
    render as when finished, which is what lets LiveView print only the new part."""
    if row.kind == "user":
        return f"you: {row.text}"
    if row.kind == "assistant":
        if row.finish == "length":
            # Said after the text, once it has ended: a streaming row stays a prefix.
            return f"assistant: {row.text} [cut short: the answer reached its token limit]"
        return f"assistant: {row.text}"
    if row.kind == "tool_call":
        line = f"tool call {row.name or '?'} {row.input or '{}'}"
        return line + " (client)" if row.client else line
    if row.kind == "tool_result":
        label = "tool result (failed)" if row.failed else "tool result"
        return f"{label}: {_value_text(row.output)}"
    if row.kind == "output":
        return f"output {row.name or ''}: {_value_text(row.output)}"
    if row.kind == "missing":
        return row.text
    return f"{row.kind}: {row.text}"


def render_table_row(row: Row) -> str:
    """One row of a table field: `row notes/k1 = value (final)`."""
    line = f"row {row.name or '?'}/{row.key or '?'} = {_value_text(row.output) or '-'}"
    if row.failed and row.error is not None:
        return f"{line} (failed: {row.error['kind']}: {row.error['msg']})"
    return f"{line} ({'stored' if row.stored else row.status or 'final'})"


def render_citation(c: dict[str, Any]) -> str:
    """`source [1] manual.md — Setup > Wi-Fi (manuals, chunk 2, version 3f2a…, score 0.031)`."""
    n = f"[{c['n']}] " if "n" in c else ""
    where = f" — {c['h']}" if c.get("h") else ""
    about = [c.get("col") or "?"]
    if "chunk" in c:
        about.append(f"chunk {c['chunk']}")
    if c.get("ver"):
        about.append(f"version {c['ver'][:8]}")
    if "score" in c:
        about.append(f"score {c['score']:.3g}")
    return f"source {n}{c.get('src', '?')}{where} ({', '.join(about)})"


def render_error(err: dict[str, Any]) -> str:
    return f"error {err.get('kind', '?')}: {err.get('msg', '')}"


# Missing ranges a status line names; past it, how many more there are.
_STATUS_RANGES = 5


def _incomplete(snap: RunSnapshot) -> str:
    """The suffix of a finished run's status line when events are missing, else ""."""
    if not snap.gaps:
        return ""
    ranges = ", ".join(f"{lo}..{hi}" for lo, hi in snap.gaps[:_STATUS_RANGES])
    more = len(snap.gaps) - _STATUS_RANGES
    if more > 0:
        ranges += f" and {more} more"
    return f" (incomplete: events {ranges} missing)"


def render_status(snap: RunSnapshot) -> str:
    """The run's status line. A finished run with missing events says so: it must not
    read as a whole answer."""
    line = _status(snap)
    return line + _incomplete(snap) if snap.terminal else line


def _status(snap: RunSnapshot) -> str:
    u = snap.usage
    if snap.status == "done":
        tokens = f"in {u.tokens_in}, out {u.tokens_out}"
        if u.tokens_reason:
            tokens += f", reason {u.tokens_reason}"
        return f"status: done ({tokens} tokens)"
    if snap.status == "failed":
        err = snap.error or {"kind": "internal", "msg": "the run failed"}
        retry = " (retryable)" if snap.retryable else ""
        return f"status: failed: {err['kind']}: {err['msg']}{retry}"
    if snap.status == "cancelled":
        return f"status: cancelled ({snap.reason})" if snap.reason else "status: cancelled"
    if snap.status == "paused":
        waiting = ", ".join(r.name or r.call or "?" for r in snap.pending.values())
        return f"status: paused (waiting on {waiting})" if waiting else "status: paused"
    if snap.active:
        # Which node is doing what: the latest started of those open.
        return f"status: {snap.status} (in {snap.active[-1][0]})"
    return f"status: {snap.status}"


def clock_time(t: float, now: float | None = None) -> str:
    """Local wall-clock time: `12:03:07`, with the date when it is not today's."""
    local = time.localtime(t)
    today = time.localtime(time.time() if now is None else now)
    same_day = local[:3] == today[:3]
    return time.strftime("%H:%M:%S" if same_day else "%Y-%m-%d %H:%M:%S", local)


def render_presence(who: str, presence: Presence) -> str:
    """`device thermo1 is offline since 12:03:07`, `the bridge is online since ...`;
    with no known time, since before the moment this host learned it."""
    if presence.since is not None:
        return f"{who} is {presence.st} since {clock_time(presence.since)}"
    return f"{who} is {presence.st} (since before {clock_time(presence.seen)})"


def render_refusal(device: str, tenant: str, kind: str, msg: str, detail: dict[str, Any]) -> str:
    """One line for a request refused before a run started (HostClient's
    RequestRefused): the common ones in words, the rest as the contract's kind and the
    bridge's or board's message."""
    if kind == "device_offline":
        presence = presence_of("error", {"kind": kind, **detail}, time.time())
        assert presence is not None  # a device_offline is always a presence
        return render_presence(f"device {device}", presence)
    if kind == "unknown_device":
        return (
            f"device {device} is not a device of tenant {tenant} "
            "(`wren device list` shows the registry's devices)"
        )
    if kind == "no_scope":
        # The agent keeps state per conversation, and the request named none.
        return f"the request was refused: no_scope: {msg} (`wren ask --conv ID` names one)"
    return f"the request was refused: {kind}: {msg}"


def render_budget(budget: Budget) -> str:
    """A budget the run came near or went past: `budget: steps 4 of 4 (warn)`."""
    unit = " s" if budget.kind == "wall_s" else ""
    kind = "wall time" if budget.kind == "wall_s" else budget.kind
    return f"budget: {kind} {budget.used:g}{unit} of {budget.limit:g}{unit} ({budget.level})"


def render(snapshot: RunSnapshot) -> list[str]:
    """The whole run as lines: rows in order, non-terminal errors, then the status."""
    lines = [render_row(row) for row in snapshot.rows]
    for name in snapshot.tables:
        lines.extend(render_table_row(row) for row in snapshot.table(name))
    lines.extend(render_citation(c) for c in snapshot.citations)
    lines.extend(render_error(e) for e in snapshot.errors)
    lines.extend(render_budget(b) for b in snapshot.budgets.values())
    lines.append(render_status(snapshot))
    return lines


def print_transcript(snapshot: RunSnapshot, stream: TextIO) -> None:
    for line in render(snapshot):
        stream.write(line + "\n")
    stream.flush()


@dataclass
class _Printed:
    """What LiveView has already written for one run."""

    rows: dict[int, str] = field(default_factory=dict)
    # Table rows by (field, key): the line last written for each.
    table_rows: dict[tuple[str, str], str] = field(default_factory=dict)
    errors: int = 0
    citations: int = 0
    # Budget lines by kind: one each time a kind's level changes.
    budgets: dict[str, str] = field(default_factory=dict)
    status: str = "running"


class LiveView:
    """Feed events one by one (`feed`); new and changed rows are written to `stream` as
    they happen. Owns its own Reducer, so it can be fed the raw stream, duplicates and
    replays included. Or show it snapshots folded elsewhere (`show`): a HostClient's
    on_event snapshot, which has the holes the client declared lost stepped over."""

    def __init__(self, stream: TextIO, reducer: Reducer | None = None) -> None:
        self.stream = stream
        self.reducer = reducer if reducer is not None else Reducer()
        self._printed: dict[str, _Printed] = {}
        # (run, row index) of the row whose line is open (written without its newline).
        self._open: tuple[str, int] | None = None

    def feed(self, event: Envelope) -> RunSnapshot:
        snap = self.reducer.apply(event)
        self.show(snap)
        return snap

    def show(self, snap: RunSnapshot) -> None:
        """Write whatever in `snap` has not been written yet."""
        printed = self._printed.setdefault(snap.run, _Printed())
        for index, row in enumerate(snap.rows):
            self._show_row(snap.run, printed, index, row)
        self._show_tables(snap, printed)
        if snap.terminal or snap.status == "paused":
            # The passages a run used, once its answer is there: they come before its
            # text (the bridge says which as the model starts), and a line between would
            # cut the answer's streaming line in two.
            for c in snap.citations[printed.citations :]:
                self._line(render_citation(c))
            printed.citations = len(snap.citations)
        for err in snap.errors[printed.errors :]:
            self._line(render_error(err))
        printed.errors = len(snap.errors)
        for kind, budget in snap.budgets.items():
            if printed.budgets.get(kind) != budget.level:
                printed.budgets[kind] = budget.level
                self._line(render_budget(budget))
        # Print a status only when it changes, and "running" only when coming back from
        # a pause: the first line of a run already says it is running.
        if snap.status != printed.status:
            printed.status = snap.status
            self._line(render_status(snap))
        self.stream.flush()

    def close(self) -> None:
        """End an open line (a stream that never saw its end)."""
        if self._open is not None:
            self.stream.write("\n")
            self._open = None
        self.stream.flush()

    def _line(self, text: str) -> None:
        self.close()
        self.stream.write(text + "\n")

    def _show_tables(self, snap: RunSnapshot, printed: _Printed) -> None:
        # A table row gets a line when it settles (final or failed) and again when it
        # changes after that; `building` is the moment between, not worth a line.
        seen = set()
        for name, rows in snap.tables.items():
            for key, row in rows.items():
                seen.add((name, key))
                if row.status == "building":
                    continue
                line = render_table_row(row)
                if printed.table_rows.get((name, key)) != line:
                    printed.table_rows[(name, key)] = line
                    self._line(line)
        for gone in [k for k in printed.table_rows if k not in seen]:
            del printed.table_rows[gone]
            self._line(f"row {gone[0]}/{gone[1]} deleted")

    def _show_row(self, run: str, printed: _Printed, index: int, row: Row) -> None:
        line = render_row(row)
        before = printed.rows.get(index)
        still_open = row.status in _OPEN_STATUSES
        is_open_line = self._open == (run, index)
        if before is not None and is_open_line and line.startswith(before):
            # The open line grew: write only the new text, end it when the stream ends.
            self.stream.write(line[len(before) :])
            printed.rows[index] = line
            if not still_open:
                self.stream.write("\n")
                self._open = None
            return
        if line == before:
            return
        # A new row, or one that changed in a way that is not an append (an output
        # whose value was replaced, a row interleaved with another open line): its
        # whole line, on a line of its own.
        self.close()
        self.stream.write(line)
        printed.rows[index] = line
        if still_open:
            self._open = (run, index)
        else:
            self.stream.write("\n")
