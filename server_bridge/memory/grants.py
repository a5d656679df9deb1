"""Grants: which agents of a tenant may use which of its `tenant` fields, and how.

A `tenant` field is one store shared by every agent of the tenant that declares a field
of that name (docs/PROTOCOL.md, "Scopes"), so an agent reaches it only with a grant in
the registry: agent A of tenant T may read (`read`) or read and write (`write`) tenant
field F, or every tenant field (F is `*`). The registry keeps them (registry.py, table
`grants`); the bridge looks up the calling agent's on every memory call (calls.py) and
the service checks them before it touches the store (service.py). Nothing in a call's
arguments adds, widens or names one.

Decided: a grant naming the field wins over the agent's `*` grant, in either direction,
so "everything read-write but `ledger` read-only" and "everything read-only but `notes`"
can both be said. A grant keys on the tenant and the agent name, so an agent of the same
name in another tenant gets nothing from it, and the store keeps each tenant's `tenant`
fields apart anyway.

This module is the one place the vocabulary and the rule are written: the registry
imports it to check what it stores, the service to decide.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = [
    "ACCESS",
    "ALL_FIELDS",
    "FIELD_NAME",
    "KNOWLEDGE_FIELD",
    "KNOWLEDGE_PREFIX",
    "NO_GRANTS",
    "READ",
    "WRITE",
    "Grants",
    "check_access",
    "check_grant_field",
    "lesser",
]

READ = "read"
WRITE = "write"
# Ordered from least to most: `lesser` and duplicate records rely on it.
ACCESS = (READ, WRITE)
# The grant of every tenant field the agent declares.
ALL_FIELDS = "*"
# A declared field's name (PROTOCOL "Declared fields"; edge_runtime/fields.py checks the
# same on the board).
FIELD_NAME = re.compile(r"[a-z0-9_]{1,64}\Z")
# A knowledge collection's grant (server_bridge/knowledge/calls.py): `kb:` and the
# collection's name as the knowledge store spells it. A namespace of its own, so no
# memory field can be named by it (FIELD_NAME has no `:`), and `*` (every tenant
# field) does not reach it: knowledge is granted collection by collection.
KNOWLEDGE_PREFIX = "kb:"
KNOWLEDGE_FIELD = re.compile(r"kb:[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")


def check_grant_field(name: object) -> str:
    """`*`, a field name or `kb:<collection>`; ValueError otherwise."""
    if name == ALL_FIELDS or (
        isinstance(name, str) and (FIELD_NAME.match(name) or KNOWLEDGE_FIELD.match(name))
    ):
        return str(name)
    raise ValueError(
        f"a grant's field must be {ALL_FIELDS!r} or 1-64 characters of [a-z0-9_] (a tenant "
        f"field) or {KNOWLEDGE_PREFIX}<collection> (a knowledge collection), not {name!r}"
    )


def check_access(access: object) -> str:
    if access not in ACCESS:
        raise ValueError(f"a grant's access must be one of {ACCESS}, not {access!r}")
    return str(access)


def lesser(a: str, b: str) -> str:
    """The narrower of two accesses (two records for one grant: the file was edited by
    hand; a doubt about a right resolves to less of it)."""
    return a if ACCESS.index(a) <= ACCESS.index(b) else b


@dataclass(frozen=True)
class Grants:
    """One agent's grants in its tenant: field name (or `*`) -> `read` | `write`.

    Immutable and shared: the registry builds one per agent once per version of its file,
    and every memory call of that agent's devices reads it.
    """

    by_field: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, access in self.by_field.items():
            check_grant_field(name)
            check_access(access)
        object.__setattr__(self, "by_field", MappingProxyType(dict(self.by_field)))

    def access(self, name: str) -> str | None:
        """`read`, `write`, or None (no grant) for the tenant field `name`."""
        got = self.by_field.get(name)
        return got if got is not None else self.by_field.get(ALL_FIELDS)

    def may_read(self, name: str) -> bool:
        return self.access(name) is not None

    def may_write(self, name: str) -> bool:
        return self.access(name) == WRITE

    def knowledge(self, collection: str) -> str | None:
        """`read`, `write`, or None for the knowledge collection `collection`: only its
        own `kb:` grant counts, never the `*` of tenant fields."""
        return self.by_field.get(KNOWLEDGE_PREFIX + collection)

    def knowledge_collections(self, access: str = READ) -> list[str]:
        """The collections granted with at least `access`, by name."""
        need = ACCESS.index(access)
        return sorted(
            name[len(KNOWLEDGE_PREFIX) :]
            for name, got in self.by_field.items()
            if name.startswith(KNOWLEDGE_PREFIX) and ACCESS.index(got) >= need
        )

    def __bool__(self) -> bool:
        return bool(self.by_field)


NO_GRANTS = Grants()
