"""A conversation's earlier turns, for the model (issue "Hosts over HTTP"; DESIGN.md
"Conversations").

A turn is one earlier run of the conversation as the model saw it: the board's messages
of the run's last model call (the user's text, the assistant's tool calls and the tool
results; not the system message, which the next run sends afresh) and the answer that
call gave. The bridge records a turn after each model call (a run's later call
supersedes its earlier) in a log of its own (an EventLog beside the event log, so
retention and crash safety are the event log's), keyed by tenant, device, user and
conversation: the user and the conversation come from the run's scope ticket, which the
bridge signed from the host's session token, never from the call's payload. Another
user's run with the same conversation id is never a turn of this one.

Which turns go in (`earlier`): the latest that fit, at most `max_turns` runs and
`max_chars` characters, and never more than the model's context leaves once the run's
own messages, its tools and, for an agent with a `before` knowledge rule, the passages'
share are counted (core memory and recalled memory are in the run's own messages).
Oldest turns go first; a turn goes whole or not at all, so a tool call is never sent
without its result, and the model reads the earlier turns in the order they happened,
between the system message and the run's own messages. Each message the bridge adds
carries `hist: True` (a provider ignores the key; the scripted one answers the run's own
request by it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgpack

from server_bridge.eventlog import EventLog

__all__ = ["DEFAULT_MAX_CHARS", "DEFAULT_MAX_TURNS", "Turns", "turn_chars"]

log = logging.getLogger("wren.bridge.conversations")

#: Earlier runs a model call may be given (`wren bridge --history-turns`).
DEFAULT_MAX_TURNS = 8
#: Characters those turns may take at most (`--history-chars`), within the context.
DEFAULT_MAX_CHARS = 8000


def turn_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of messages as a call's context counts them (knowledge/augment.py):
    text and tool calls' names and inputs."""
    # Here, not at the top: augment.py imports rpc.py, which this package must not
    # need to import.
    from server_bridge.knowledge.augment import context_chars

    return context_chars(messages, [])


class Turns:
    """The recorded turns of every conversation (see the module docstring)."""

    def __init__(
        self,
        log_: EventLog,
        max_turns: int = DEFAULT_MAX_TURNS,
        max_chars: int = DEFAULT_MAX_CHARS,
    ) -> None:
        if max_turns < 0 or max_chars < 0:
            raise ValueError("max_turns and max_chars must be >= 0")
        self.log = log_
        self.max_turns = max_turns
        self.max_chars = max_chars

    def record(
        self,
        tenant: str,
        device: str,
        run: str,
        usr: str | None,
        conv: str,
        messages: list[dict[str, Any]],
        answer: dict[str, Any],
    ) -> None:
        """Record a run's turn after one of its model calls: `messages` as the board
        sent them (what the bridge added is left out), `answer` the assistant message
        the call gave. Raises EventLogError when the log cannot take it."""
        own = [_plain(m) for m in messages if m.get("role") != "system" and not m.get("hist")]
        body = msgpack.packb({"m": own, "a": _plain(answer)}, use_bin_type=True)
        known = self.log.run(tenant, device, run)
        step = known.last + 1 if known is not None else 1
        self.log.append(tenant, device, run, step, body, usr=usr, conv=conv)

    def has_earlier(self, tenant: str, device: str, usr: str | None, conv: str, run: str) -> bool:
        """Whether any earlier turn of the conversation is recorded (the log's index
        alone: no file is read)."""
        if not self.max_turns:
            return False
        for dev, other in self.log.runs_of(tenant, conv):
            if dev == device and other != run:
                known = self.log.run(tenant, dev, other)
                if known is not None and known.usr == usr:
                    return True
        return False

    def earlier(
        self, tenant: str, device: str, usr: str | None, conv: str, run: str, room: int
    ) -> list[dict[str, Any]]:
        """The messages of the latest earlier turns that fit in `room` characters (and
        the limits), oldest first, each marked `hist`."""
        budget = min(self.max_chars, room)
        if budget <= 0 or not self.max_turns:
            return []
        runs = [
            other
            for dev, other in self.log.runs_of(tenant, conv)
            if dev == device and other != run
        ]
        chosen: list[list[dict[str, Any]]] = []
        used = 0
        for other in reversed(runs):
            if len(chosen) >= self.max_turns:
                break
            known = self.log.run(tenant, device, other)
            if known is None or known.usr != usr:
                continue
            turn = self._turn(tenant, device, other)
            if turn is None:
                continue
            size = turn_chars(turn)
            if used + size > budget:
                break  # whole turns only, newest first: an older one would leave a hole
            chosen.append(turn)
            used += size
        out: list[dict[str, Any]] = []
        for turn in reversed(chosen):
            out += [{**m, "hist": True} for m in turn]
        return out

    def _turn(self, tenant: str, device: str, run: str) -> list[dict[str, Any]] | None:
        records = self.log.events(tenant, device, run)
        if not records:
            return None
        try:
            body = msgpack.unpackb(records[-1].payload, raw=False)
            messages = [m for m in body["m"] if isinstance(m, dict)]
            answer = body["a"]
        except (ValueError, TypeError, KeyError, msgpack.ExtraData) as e:
            log.warning("conversation turn of run %s/%s unreadable: %s", device, run, e)
            return None
        if isinstance(answer, dict) and (answer.get("content") or answer.get("tools")):
            messages.append(answer)
        return messages


def _plain(m: Mapping[str, Any]) -> dict[str, Any]:
    """What a turn keeps of a message: role, content, tool calls and the tool call id."""
    return {k: m[k] for k in ("role", "content", "tools", "call") if k in m}
