"""Who may see and act on which run (PROTOCOL.md "Who sees what"): the rule in one place.

A run belongs to the user its request came from: the `usr` the bridge set from the
session token (the board echoes it in `run.started`). A session may see a run, replay
it, cancel it, answer its client tools and approve its calls when it is that user's, or
when its token is a watcher's (`role: "watch"`: a dashboard, an operator), which reaches
every run of its tenant. A run whose user the bridge does not know (it met the run
mid-way, after its own restart) is a watcher's only: not knowing is never a reason to
let someone in. An act on it waits a moment (AwaitingOwner) while the board is asked
to replay the run, whose run.paused or run.started names its user.

The broker enforces the seeing (each user's runs go to a topic of their own, which a
host user bound to another user cannot read, brokerconf.py); this module decides the
acting, for every path a host comes in by: MQTT now, HTTP later. A refusal is
`forbidden` on the sender's `_b` stream, and nothing is acted on.

Also here: who asked for which request, since a cancel may name a request whose run has
not started (the board names no user before `run.started`). Bounded, in memory: after
a bridge restart a request it did not forward is a watcher's to cancel only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from server_bridge.tokens import Session
from server_bridge.wire import WireError

__all__ = ["AwaitingOwner", "Forbidden", "RequestOwners", "check_run", "may_act"]

Act = TypeVar("Act")


class Forbidden(WireError):
    """A host request about a run (or a request) of another user, from a session that
    may not watch it."""

    kind = "forbidden"


def may_act(session: Session, owner: str | None) -> bool:
    """Whether `session` may see and act on a run of user `owner` (None: unknown)."""
    return session.watch or (owner is not None and owner == session.user)


def check_run(session: Session, owner: str | None, what: str) -> None:
    """Forbidden unless `session` may act on the run (or request) `what` names; the
    message names neither the owner nor anything of the run (the sender may not know
    them)."""
    if not may_act(session, owner):
        why = "another user's" if owner is not None else "not known to be yours"
        raise Forbidden(f"{what} is {why}: only its own user or a watcher may act on it")


class RequestOwners:
    """Which user each recent host request (device, req id) came from, for a cancel by
    request id. Bounded: the oldest are forgotten past `max_entries` (a cancel of one
    that old is a watcher's only), 65,536 by default, ~15 MiB at the longest ids."""

    def __init__(self, max_entries: int = 65_536) -> None:
        self._max = max_entries
        self._owners: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, device: str, req: str, user: str) -> None:
        # The first user to send a req id keeps it: the board starts nothing for a
        # repeat, so another user sending the same id (read off the device stream,
        # say) must not become the owner of the first one's request.
        with self._lock:
            self._owners.setdefault((device, req), user)
            self._owners.move_to_end((device, req))
            while len(self._owners) > self._max:
                self._owners.popitem(last=False)

    def owner(self, device: str, req: str) -> str | None:
        with self._lock:
            return self._owners.get((device, req))


class AwaitingOwner(Generic[Act]):
    """Host acts on runs whose user the bridge does not know yet, held while it asks.

    After its own restart the bridge knows no run until the run's board sends it
    something; a paused run sends nothing until answered, so its owner's answer would be
    refused for good. Instead the act waits here (not acted on) while the bridge asks
    the board to replay the run, whose `run.paused` (or `run.started`) names its user;
    then it is checked like any act. Bounded: at most `max_runs` runs waiting (a full
    holder refuses at once), each for `wait_s`; past that the act is refused as one on
    a run not known to be the sender's.
    """

    def __init__(self, max_runs: int = 1024, wait_s: float = 10.0) -> None:
        self._max = max_runs
        self._wait_s = wait_s
        self._acts: dict[tuple[str, str], tuple[float, list[Act]]] = {}
        self._lock = threading.Lock()

    def hold(self, device: str, run: str, act: Act, now: float) -> bool | None:
        """Hold `act` on (device, run): True when it is the run's first (ask the board
        now), False when others wait already, None when the holder is full (refuse)."""
        key = (device, run)
        with self._lock:
            waiting = self._acts.get(key)
            if waiting is not None:
                waiting[1].append(act)
                return False
            if len(self._acts) >= self._max:
                return None
            self._acts[key] = (now + self._wait_s, [act])
            return True

    def settle(self, known: Callable[[str, str], bool], now: float) -> tuple[list[Act], list[Act]]:
        """Take out the acts whose run's user is now known (to check and act on) and
        those that waited out `wait_s` (to refuse), in the order they came."""
        ready: list[Act] = []
        expired: list[Act] = []
        with self._lock:
            for key, (deadline, acts) in list(self._acts.items()):
                if known(*key):
                    ready += acts
                elif now >= deadline:
                    expired += acts
                else:
                    continue
                del self._acts[key]
        return ready, expired
