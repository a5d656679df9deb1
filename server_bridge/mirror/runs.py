"""What the JSON mirror keeps of each run: whose it is, and the text of its answer.

The intake knows a run's user but tells its hook only (tenant, device, run, id, bytes),
under its own lock, where asking it would deadlock. So the mirror learns the user the
way the intake does, from the run's own events: the first `run.started` or `run.paused`
naming a user id a topic level can hold (PROTOCOL.md "Who sees what"); until then, or
for a run whose events it first meets mid-way (after a drop, or a run it forgot), the
run is nobody's it knows and goes to `u/_`, which only watchers read. It can be wrong
only towards the watchers, never towards another user.

The answer is the text of the run's last assistant message that had any (a model step
that only calls tools has none), from its `msg.delta` events, at most ANSWER_CHARS
characters of it.

Bounded: at most `max_runs` runs (the intake's own bound, BridgeConfig.max_runs), the
least recently active forgotten first; a run is forgotten at its terminal event.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from edge_runtime.events import TERMINAL
from server_bridge.topics import is_user_id

__all__ = ["ANSWER_CHARS", "Answer", "Runs"]

#: The most characters of a run's answer the mirror keeps (and publishes, `cut` past
#: it): a model's 1,024 tokens (the bridge's default --max-tokens) are about 4,000;
#: 1,024 runs at this bound are 8 MiB of text at most.
ANSWER_CHARS = 8192
# The events that name their run's user (intake.py's _NAMES_USER).
_NAMES_USER = ("run.started", "run.paused")


class Answer(NamedTuple):
    """A finished run's answer, for the retained `u/U/json/answer`."""

    usr: str | None
    run: str
    text: str
    cut: bool
    ts: object
    req: str | None
    conv: str | None
    input: str | None


@dataclass
class _Run:
    usr: str | None = None
    req: str | None = None
    conv: str | None = None
    input: str | None = None
    m: object = None  # the assistant message being streamed
    parts: list[str] = field(default_factory=list)
    size: int = 0
    cut: bool = False
    last: str = ""  # the text of the run's last earlier message with text
    last_cut: bool = False


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


class Runs:
    """The runs the mirror has met, by (tenant, device, run)."""

    def __init__(self, max_runs: int, answer_chars: int = ANSWER_CHARS) -> None:
        self.max_runs = max_runs
        self.answer_chars = answer_chars
        self._runs: OrderedDict[tuple[str, str, str], _Run] = OrderedDict()
        self.forgotten = 0  # runs let go before their end (over max_runs)

    def __len__(self) -> int:
        return len(self._runs)

    def see(
        self, tenant: str, device: str, run: str, env: dict[str, Any]
    ) -> tuple[str | None, Answer | None]:
        """Take one event of a run (in the order hosts got them): the run's user as known
        now (None: unknown), and its Answer when this event is its `run.done`."""
        key = (tenant, device, run)
        st = self._runs.get(key)
        if st is None:
            st = self._runs[key] = _Run()
            if len(self._runs) > self.max_runs:
                self._runs.popitem(last=False)
                self.forgotten += 1
        else:
            self._runs.move_to_end(key)
        t = env.get("t")
        d = env.get("d")
        if not isinstance(d, dict):
            d = {}
        if t == "msg.delta":
            self._text(st, d)
        elif t in _NAMES_USER:
            if st.usr is None and is_user_id(d.get("usr")):
                st.usr = d["usr"]
            if t == "run.started":
                st.req, st.conv, st.input = _str(d.get("req")), _str(d.get("conv")), _str(
                    d.get("input")
                )
        elif t == "msg.start" and d.get("role", "assistant") == "assistant":
            self._next_message(st, d.get("m"))
        elif t in TERMINAL:
            del self._runs[key]
            if t != "run.done":
                return st.usr, None
            text, cut = ("".join(st.parts), st.cut) if st.parts else (st.last, st.last_cut)
            return st.usr, Answer(st.usr, run, text, cut, env.get("ts"), st.req, st.conv,
                                  st.input)  # fmt: skip
        return st.usr, None

    def _next_message(self, st: _Run, m: object) -> None:
        if st.parts:
            st.last, st.last_cut = "".join(st.parts), st.cut
        st.m, st.parts, st.size, st.cut = m, [], 0, False

    def _text(self, st: _Run, d: dict[str, Any]) -> None:
        text = d.get("text")
        if not isinstance(text, str) or not text:
            return
        m = d.get("m")
        if m != st.m:
            # A delta of another message than the one started (its msg.start was not
            # met: the mirror met the run mid-way): a new message all the same.
            self._next_message(st, m)
        room = self.answer_chars - st.size
        if room <= 0:
            st.cut = True
            return
        if len(text) > room:
            text, st.cut = text[:room], True
        st.parts.append(text)
        st.size += len(text)
