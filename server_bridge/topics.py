"""Topic names of the wire contract (docs/PROTOCOL.md, "Topics") and their validation.

Every topic the bridge reads or writes is built or parsed here, so a bad topic level
is refused in one place with one named error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from edge_runtime.events import MAX_ID, PREFIX

DEFAULT_PREFIX = PREFIX
# A device or tenant id: the contract's id bound (MAX_ID) in a topic-safe alphabet.
_ID = re.compile(rf"[a-z0-9][a-z0-9_-]{{0,{MAX_ID - 1}}}\Z")

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


@dataclass(frozen=True)
class Topic:
    """A parsed topic: side is 'd' (board link) or 'h' (host stream)."""

    side: str
    device: str
    leaf: str
    tenant: str | None = None


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
    raise BadTopic(f"topic {topic!r} does not match P/d/D/... or P/h/T/D/...")
