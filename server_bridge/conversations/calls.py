"""The conversation hook of `llm.complete` (rpc.py): who the call's run is for, from its
scope ticket (checked on the network thread, with the call's admission), the earlier
turns put into the call (on the worker), and the call's own turn recorded after it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from server_bridge import tokens
from server_bridge.eventlog import EventLogError
from server_bridge.registry import DeviceRecord, RegistryStore

from .history import Turns, turn_chars

__all__ = ["History", "Scope"]

log = logging.getLogger("wren.bridge.conversations")

# (user, conversation) of a run, as its scope ticket proves them.
Scope = tuple["str | None", str]
Count = Callable[[str, int], None]


class History:
    def __init__(
        self,
        turns: Turns,
        registry: RegistryStore,
        context_limit: int,
        count: Count | None = None,
    ) -> None:
        self.turns = turns
        self.registry = registry
        self.context_limit = context_limit
        self._count: Count = count or (lambda name, n: None)

    def scope(self, device: DeviceRecord, ticket: object) -> Scope | None:
        """The run's user and conversation, or None: no ticket, a ticket without a
        conversation, or one that proves nothing (counted `history.bad_ticket` and
        logged: the call goes on without history, as a model call does not need it)."""
        if ticket is None:
            return None
        secret = self.registry.tenant_secret(device.tenant)
        try:
            if secret is None:
                raise tokens.TokenError(f"no tenant {device.tenant!r}")
            sc = tokens.verify_scope(bytes.fromhex(secret), ticket, device.tenant, device.device)
        except (tokens.TokenError, ValueError) as e:
            self._count("history.bad_ticket", 1)
            log.info("llm.complete from %s: scope ticket not used for history: %s",
                     device.device, e)  # fmt: skip
            return None
        if sc.conv is None:
            return None
        return (sc.user, sc.conv)

    def has_earlier(self, device: DeviceRecord, run: str | None, scope: Scope) -> bool:
        return self.turns.has_earlier(device.tenant, device.device, scope[0], scope[1], run or "")

    def add(
        self,
        device: DeviceRecord,
        run: str | None,
        scope: Scope,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        kb_chars: int,
    ) -> list[dict[str, Any]]:
        """`messages` with the earlier turns that fit put in after the system
        message(s): the room is the model's context less the call's own messages, its
        tools and `kb_chars` (the passages' share, for a `before` knowledge rule)."""
        from server_bridge.knowledge.augment import context_chars

        room = self.context_limit - context_chars(messages, tools) - kb_chars
        earlier = self.turns.earlier(device.tenant, device.device, scope[0], scope[1],
                                     run or "", room)  # fmt: skip
        if not earlier:
            return messages
        self._count("history.turns_added", 1)
        self._count("history.chars_added", turn_chars(earlier))
        at = 0
        while at < len(messages) and messages[at].get("role") == "system":
            at += 1
        return messages[:at] + earlier + messages[at:]

    def record(
        self,
        device: DeviceRecord,
        run: str | None,
        scope: Scope,
        messages: list[dict[str, Any]],
        answer: dict[str, Any],
    ) -> None:
        """The call's turn, for the conversation's next runs; a log that cannot take it
        costs this call nothing (counted `history.not_recorded`, logged)."""
        if run is None:
            return
        try:
            self.turns.record(device.tenant, device.device, run, scope[0], scope[1],
                              messages, answer)  # fmt: skip
        except (EventLogError, OSError) as e:
            self._count("history.not_recorded", 1)
            log.error("conversation turn of run %s/%s not recorded: %s", device.device, run, e)
