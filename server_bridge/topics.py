"""Topic names of the wire contract (docs/PROTOCOL.md, "Topics") and their validation.

Every topic the bridge reads or writes is built or parsed here, so a bad topic level
is refused in one place with one named error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import cast

from edge_runtime.events import MAX_ID, PREFIX

DEFAULT_PREFIX = PREFIX
# A device or tenant id: the contract's id bound (MAX_ID) in a topic-safe alphabet.
_ID = re.compile(rf"[a-z0-9][a-z0-9_-]{{0,{MAX_ID - 1}}}\Z")
# An end user's id (a session token's `usr`), a level of the host topic of that user's
# runs: wider than a device id, since user ids come from elsewhere (an e-mail address,
# a directory's name), but never an MQTT wildcard, a `/` or anything a broker's ACL line
# cannot hold, and never beginning with `_`, which is the bridge's (UNOWNED).
_USR = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.@-]{{0,{MAX_ID - 1}}}\Z")
USR_PATTERN = _USR.pattern[:-2]
# The user level of a run whose user the bridge does not know (a run it met mid-way,
# after its own restart, whose run.started it never saw; a board that did not say):
# no user id begins with `_`, so only the watchers' wildcard reads it.
UNOWNED = "_"

# Board-side leaves (after P/d/D/), host-side leaves (after P/h/T/D/) and the bridge's
# own (after P/b/: its presence, which boards and hosts read).
DEVICE_LEAVES = ("status", "hello", "req", "ctl", "evt", "rpc", "rpc/res")
HOST_LEAVES = ("evt", "req", "ctl")
BRIDGE_LEAVES = ("status",)


class BadTopic(ValueError):
    """A topic that does not match the contract: wrong shape or an invalid id level."""

    kind = "bad_topic"


def check_id(value: str, what: str = "id") -> str:
    if not isinstance(value, str) or not _ID.match(value):
        raise BadTopic(f"invalid {what} level {value!r}: must match {_ID.pattern[:-2]}")
    return value


def is_id(value: object) -> bool:
    """Whether `value` may be a device or tenant id (a topic level)."""
    return isinstance(value, str) and _ID.match(value) is not None


def is_user_id(value: object) -> bool:
    """Whether `value` may be an end user's id, so a level of a host topic."""
    return isinstance(value, str) and _USR.match(value) is not None


def check_user_id(value: object) -> str:
    if not is_user_id(value):
        raise BadTopic(f"invalid user id {value!r}: must match {USR_PATTERN}")
    return cast(str, value)


@dataclass(frozen=True)
class Topic:
    """A parsed topic: side is 'd' (board link) or 'h' (host stream); `user` is the
    user level of a host event topic of one user's runs (P/h/T/D/u/<user>/evt)."""

    side: str
    device: str
    leaf: str
    tenant: str | None = None
    user: str | None = None


def device_topic(prefix: str, device: str, leaf: str) -> str:
    check_id(device, "device")
    if leaf not in DEVICE_LEAVES:
        raise BadTopic(f"unknown device topic leaf {leaf!r}")
    return f"{prefix}/d/{device}/{leaf}"


def host_topic(prefix: str, tenant: str, device: str, leaf: str) -> str:
    check_id(tenant, "tenant")
    check_id(device, "device")
    if leaf not in HOST_LEAVES:
        raise BadTopic(f"unknown host topic leaf {leaf!r}")
    return f"{prefix}/h/{tenant}/{device}/{leaf}"


def host_event_topic(prefix: str, tenant: str, device: str, user: str | None) -> str:
    """Where hosts read an event (PROTOCOL.md "Who sees what"): P/h/T/D/u/<user>/evt for
    an event of `user`'s run or an answer to `user`'s request, P/h/T/D/u/_/evt (UNOWNED,
    watchers only) for a run whose user is unknown, and P/h/T/D/evt for the device's own
    (None: its stream "_", the bridge's presence reports)."""
    if user is None:
        return host_topic(prefix, tenant, device, "evt")
    check_id(tenant, "tenant")
    check_id(device, "device")
    if user != UNOWNED:
        check_user_id(user)
    return f"{prefix}/h/{tenant}/{device}/u/{user}/evt"


def bridge_topic(prefix: str, leaf: str = "status") -> str:
    """P/b/<leaf>: the bridge's presence, `{st:"online"/"offline", id}`, retained."""
    if leaf not in BRIDGE_LEAVES:
        raise BadTopic(f"unknown bridge topic leaf {leaf!r}")
    return f"{prefix}/b/{leaf}"


def parse(prefix: str, topic: str) -> Topic:
    """Split a topic into its levels, refusing anything the contract does not name."""
    if not topic.startswith(prefix + "/"):
        raise BadTopic(f"topic {topic!r} is outside prefix {prefix!r}")
    rest = topic[len(prefix) + 1 :].split("/")
    if len(rest) >= 3 and rest[0] == "d":
        leaf = "/".join(rest[2:])
        if leaf not in DEVICE_LEAVES:
            raise BadTopic(f"unknown device topic leaf {leaf!r}")
        return Topic("d", check_id(rest[1], "device"), leaf)
    if len(rest) == 4 and rest[0] == "h":
        if rest[3] not in HOST_LEAVES:
            raise BadTopic(f"unknown host topic leaf {rest[3]!r}")
        return Topic("h", check_id(rest[2], "device"), rest[3], check_id(rest[1], "tenant"))
    if len(rest) == 6 and rest[0] == "h" and rest[3] == "u" and rest[5] == "evt":
        user = rest[4] if rest[4] == UNOWNED else check_user_id(rest[4])
        return Topic("h", check_id(rest[2], "device"), "evt", check_id(rest[1], "tenant"), user)
    raise BadTopic(f"topic {topic!r} does not match P/d/D/..., P/h/T/D/... or P/h/T/D/u/U/evt")
