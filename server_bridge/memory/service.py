"""The `state.*`, `mem.*` and `core.*` methods over a `MemoryStore`.

docs/PROTOCOL.md "Memory and durable state" is the contract; the decisions it leaves
open are taken here and named in the docstrings below ("Decided:").

Who is asking comes only from `Caller`, built by the bridge from its registry, the
device's hello and the verified scope ticket. A `tenant`, `user`, `device` or `grant`
key inside the arguments is data: no argument names a scope or grants a right. Scope
instances (`ScopeRef`):

| dur | scope id | Decided |
|---|---|---|
| `agent` | the agent | |
| `subject` | the device | |
| `tenant` | the tenant | shared by the tenant's agents, each needing a grant (grants.py) |
| `user` | agent/user | a user's memory is per agent: only `tenant` crosses agents |
| `session` | agent/conv | as `user` |
| `run` | none | never leaves the board: `no_scope` |

Private fields: every scope but `tenant` belongs to one agent, and its instance is
picked by the caller's own identity (its device, its ticket's user and conversation),
so another user's or another session's field cannot even be named. In the shared
`tenant` scope an agent reads a field only with a grant for it (or for `*`) and writes
it only with a `write` grant: else `forbidden` before any store is opened, and recall
and backlinks skip the field. On top of the grant, the agent that first wrote a field
owns it: a field written `private` by one agent is `forbidden` to the others (read and
write, whatever their grants), and never a recall hit.

Write ids: a write's content hash covers the method, its scope instance, the field and
the arguments but `sc` and `w`; a write id answered before is answered the same and
applies nothing, the same id with another hash is `w_reused`. A refused write is not
recorded: its retry is judged again. Past its file's ledger, the device's own ledger
(ledger.py) still knows a board's write id: one it applied is answered `{dup: true}` and
applies nothing (the first answer is gone), one of a run or boot it has closed is
`w_stale` and applies nothing. So a replayed write, however late, never brings back a
forgotten row or value; a write with a new id (a later run, the next seq) does.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import quote, unquote

import msgpack

from server_bridge.memory import errors as E
from server_bridge.memory import ledger as L
from server_bridge.memory.grants import FIELD_NAME, NO_GRANTS, Grants
from server_bridge.memory.merge import MISSING, merge
from server_bridge.memory.store import SLOTS, MemoryStore, ScopeRef, ScopeTxn, WouldWait

__all__ = [
    "DEFAULT_SCOPE_LIMIT",
    "Caller",
    "FieldDecl",
    "MemoryService",
    "SearchIndex",
    "parse_fields",
]

# A durable scope instance's storage limit (PROTOCOL "a storage limit (bytes, bridge
# config)"): the msgpack bytes of its slot values, rows (value and links) and core doc.
DEFAULT_SCOPE_LIMIT = 1 << 20

# Argument bounds (anything over them is bad_envelope). Keys and labels are ids a model
# or a board makes up; the bounds keep them from being documents in their own right.
MAX_KEY = 128
MAX_LABEL = 64
MAX_TOOL = 64
MAX_W = 160  # "<run id>:<seq>", a run id being at most 64 characters
MAX_QUERY = 2000
MAX_LINKS = 32  # forward links on one row
MAX_WRITES = 64  # writes in one state.commit
MAX_K = 20  # recall hits (PROTOCOL: default 5, at most 20)
DEFAULT_LIST = 20
MAX_LIST = 100

_NAME = FIELD_NAME
_TOKEN = re.compile(r"\w+")
_VIS = ("public", "private")
_DUR = ("run", "session", "user", "agent", "tenant", "subject")
_MERGES = ("replace", "append", "sum", "max", "min", "union", "deep")
_KINDS = ("slot", "collection")


# --------------------------------------------------------------------------- callers


@dataclass(frozen=True)
class FieldDecl:
    """One declared field of a hello's `fields` (PROTOCOL "Declared fields")."""

    name: str
    vis: str = "private"
    dur: str = "run"
    merge: str = "replace"
    kind: str = "slot"
    fmt: str | None = None
    stream: bool = False
    core: bool = False
    max: int = 4096
    ttl: float | None = None
    key: str | None = None

    @classmethod
    def parse(cls, raw: object) -> FieldDecl:
        """A declaration from its hello map; ValueError when malformed. Keys the contract
        does not name are ignored (a newer board may send more)."""
        if not isinstance(raw, Mapping):
            raise ValueError("a field declaration is a map")
        name = raw.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError("name must be 1-64 characters of [a-z0-9_]")
        kw: dict[str, Any] = {"name": name}
        for key, allowed in (("vis", _VIS), ("dur", _DUR), ("merge", _MERGES), ("kind", _KINDS)):
            if raw.get(key) is not None:
                if raw[key] not in allowed:
                    raise ValueError(f"{name}: {key} must be one of {allowed}")
                kw[key] = raw[key]
        for key in ("stream", "core"):
            if raw.get(key) is not None:
                if not isinstance(raw[key], bool):
                    raise ValueError(f"{name}: {key} must be a bool")
                kw[key] = raw[key]
        for key, limit in (("fmt", 32), ("key", MAX_LABEL)):
            if raw.get(key) is not None:
                if not isinstance(raw[key], str) or not 0 < len(raw[key]) <= limit:
                    raise ValueError(f"{name}: {key} must be a str of 1..{limit} chars")
                kw[key] = raw[key]
        if raw.get("max") is not None:
            if not _is_int(raw["max"]) or raw["max"] < 1:
                raise ValueError(f"{name}: max must be an int >= 1")
            kw["max"] = raw["max"]
        if raw.get("ttl") is not None:
            if not _is_number(raw["ttl"]) or raw["ttl"] <= 0:
                raise ValueError(f"{name}: ttl must be a number of seconds > 0")
            kw["ttl"] = raw["ttl"]
        decl = cls(**kw)
        if decl.core and decl.dur not in ("agent", "user"):
            raise ValueError(f"{name}: a core field has dur agent or user")
        return decl


def parse_fields(raw: object) -> tuple[dict[str, FieldDecl], int]:
    """The declarations of a hello's `fields` by name, and how many were skipped.

    A malformed declaration (or a second one of a name) is skipped, not fatal: the
    board's other fields keep working, and the count says something was wrong.
    """
    decls: dict[str, FieldDecl] = {}
    skipped = 0
    for item in raw if isinstance(raw, (list, tuple)) else ():
        try:
            decl = item if isinstance(item, FieldDecl) else FieldDecl.parse(item)
        except ValueError:
            skipped += 1
            continue
        if decl.name in decls:
            skipped += 1
            continue
        decls[decl.name] = decl
    return decls, skipped + (0 if isinstance(raw, (list, tuple)) or raw is None else 1)


@dataclass(frozen=True)
class Caller:
    """Who is asking, from trusted sources only: the registry (tenant, device, agent,
    grants), the device's hello (`fields`) and the verified scope ticket (user, conv).
    `run` is the call's run id, kept in provenance."""

    tenant: str
    device: str
    agent: str
    user: str | None = None
    conv: str | None = None
    run: str | None = None
    fields: Sequence[Mapping[str, Any] | FieldDecl] = ()
    # The agent's grants in its tenant (grants.py): which `tenant` fields it may read or
    # write. From the registry only, never from a call's arguments.
    grants: Grants = NO_GRANTS
    decls: dict[str, FieldDecl] = field(init=False, compare=False, repr=False)
    skipped_fields: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        decls, skipped = parse_fields(list(self.fields))
        object.__setattr__(self, "decls", decls)
        object.__setattr__(self, "skipped_fields", skipped)


class SearchIndex(Protocol):
    """A search index over rows' text (server_bridge/memory/recall.py implements it).

    Doc ids are `f"{tenant}/{scope}/{scope_id}/{field}/{key}"` (scope id and key
    percent-quoted, see `doc_id`); `meta` holds tenant, scope, scope_id, field, key, own
    (the agent owning a tenant field) and vis, and `allowed(meta)` says whether the
    caller may read a hit.
    """

    def upsert(self, doc_id: str, text: str, meta: dict[str, Any]) -> None: ...

    def remove(self, doc_id: str) -> None: ...

    def search(
        self, query: str, k: int, allowed: Callable[[dict[str, Any]], bool]
    ) -> list[tuple[str, float]]: ...


def doc_id(ref: ScopeRef, field_name: str, key: str) -> str:
    return f"{ref.tenant}/{ref.scope}/{ref.scope_id}/{field_name}/{quote(key, safe='')}"


# --------------------------------------------------------------------------- helpers


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _q(s: str) -> str:
    return quote(s, safe="")


def _size(value: Any, what: str) -> int:
    """The msgpack bytes of a value: what `max` and the scope limit count."""
    try:
        return len(msgpack.packb(value, use_bin_type=True))
    except (OverflowError, TypeError, ValueError) as e:
        raise E.BadEnvelope(f"{what}: a value msgpack cannot hold") from e


def _check_value(v: Any, what: str, depth: int = 0) -> None:
    # Values are stored as JSON: bin and non-str map keys would come back changed.
    if depth > 32:
        raise E.BadEnvelope(f"{what}: nested too deep")
    if v is None or isinstance(v, (bool, int, float, str)):
        return
    if isinstance(v, list):
        for item in v:
            _check_value(item, what, depth + 1)
        return
    if isinstance(v, dict):
        for k, item in v.items():
            if not isinstance(k, str):
                raise E.BadEnvelope(f"{what}: map keys must be strings")
            _check_value(item, what, depth + 1)
        return
    raise E.BadEnvelope(f"{what}: a {type(v).__name__} is not stored (use str, number, list, map)")


def _arg_str(args: Mapping[str, Any], key: str, limit: int, *, required: bool = True) -> Any:
    v = args.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, str) or not 0 < len(v) <= limit:
        raise E.BadEnvelope(f"{key} must be a str of 1..{limit} chars")
    return v


def _arg_text(args: Mapping[str, Any], key: str) -> str:
    v = args.get(key)
    if not isinstance(v, str):
        raise E.BadEnvelope(f"{key} must be a str")
    return v


def _arg_int(args: Mapping[str, Any], key: str, lo: int, hi: int, default: int | None) -> int:
    v = args.get(key)
    if v is None and default is not None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise E.BadEnvelope(f"{key} must be an int in {lo}..{hi}")
    return v


def _text_of(value: Any) -> str:
    """The searchable text of a value: a str, or the strings inside a list or map."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return " ".join(_text_of(v) for v in value.values())
    if isinstance(value, list):
        return " ".join(_text_of(v) for v in value)
    return "" if value is None else str(value)


def _live(rec: Mapping[str, Any], now: float) -> bool:
    exp = rec.get("exp")
    return exp is None or exp > now


def _row(rec: Mapping[str, Any]) -> dict[str, Any]:
    """A stored row as the wire has it (PROTOCOL "A row is ...")."""
    return {
        "key": rec["key"],
        "value": rec["value"],
        "ver": rec["ver"],
        "links": rec.get("links", []),
        "prov": rec["prov"],
        "at": rec["at"],
    }


# --------------------------------------------------------------------------- service


@dataclass
class _Plan:
    """What one write does to its shard, worked out under the scope's lock."""

    answer: dict[str, Any]
    changes: dict[str, dict[str, dict[str, Any] | None]]
    meta: dict[str, Any] = field(default_factory=dict)
    # Collections only: rows to put into (key -> value) or take out of the index.
    index_put: dict[str, Any] = field(default_factory=dict)
    index_drop: list[str] = field(default_factory=list)
    # Whether the write adds rows (then the field's row `max` is checked).
    grows: bool = False


class MemoryService:
    """The memory methods of the contract; `handle` answers one call or raises
    MemoryFault. Thread-safe: the store serializes the writes of each scope."""

    def __init__(
        self,
        store: MemoryStore,
        *,
        index: SearchIndex | None = None,
        clock: Callable[[], float] = time.time,
        scope_limit: int = DEFAULT_SCOPE_LIMIT,
    ):
        self.store = store
        self.index = index
        self.clock = clock
        self.scope_limit = scope_limit
        self._methods: dict[str, Callable[[Caller, Mapping[str, Any]], dict[str, Any]]] = {
            "state.load": self.state_load,
            "state.commit": self.state_commit,
            "mem.remember": self.mem_remember,
            "mem.recall": self.mem_recall,
            "mem.list": self.mem_list,
            "mem.peek": self.mem_peek,
            "mem.forget": self.mem_forget,
            "mem.link": self.mem_link,
            "mem.unlink": self.mem_unlink,
            "mem.append": self.mem_append,
            "mem.replace": self.mem_replace,
            "mem.cas": self.mem_cas,
            "core.sync": self.core_sync,
            "core.load": self.core_load,
        }

    @property
    def methods(self) -> list[str]:
        return list(self._methods)

    def handle(self, caller: Caller, method: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """The `ok` answer of one call; MemoryFault names the refusal."""
        fn = self._methods.get(method)
        if fn is None:
            raise E.UnknownMethod(f"unknown method {method[:64]!r}")
        if not isinstance(args, Mapping):
            raise E.BadEnvelope("arguments must be a map")
        return fn(caller, args)

    # ------------------------------------------------------------------ scopes

    def _decl(self, caller: Caller, args: Mapping[str, Any], key: str = "field") -> FieldDecl:
        name = args.get(key)
        if not isinstance(name, str):
            raise E.BadEnvelope(f"{key} must be a field name (a str)")
        decl = caller.decls.get(name)
        if decl is None:
            raise E.UnknownField(f"no declared field {name[:64]!r}")
        return decl

    def _ref(self, caller: Caller, dur: str, what: str, *, write: bool) -> ScopeRef:
        """The scope instance a field of this `dur` is kept in for this caller; `what`
        is the field's name (core memory, never a tenant field, names its scope). A
        tenant field needs the caller's grant for it, `write` to change it: checked here,
        before any store is opened, so a refused call changes nothing."""
        if dur == "run":
            raise E.NoScope(f"{what} is run-scoped: it never leaves the board")
        if dur == "agent":
            return ScopeRef(caller.tenant, "agent", _q(caller.agent))
        if dur == "subject":
            return ScopeRef(caller.tenant, "subject", _q(caller.device))
        if dur == "tenant":
            access = caller.grants.access(what)
            if access is None:
                raise E.Forbidden(
                    f"{what} is a tenant field and agent {caller.agent[:64]!r} has no grant for it"
                )
            if write and not caller.grants.may_write(what):
                raise E.Forbidden(
                    f"{what} is a tenant field agent {caller.agent[:64]!r} may only read"
                )
            return ScopeRef(caller.tenant, "tenant", _q(caller.tenant))
        who = caller.user if dur == "user" else caller.conv
        if who is None:
            what_is = "user" if dur == "user" else "conversation"
            raise E.NoScope(f"{what} is a {dur} field and the call's ticket names no {what_is}")
        return ScopeRef(caller.tenant, dur, f"{_q(caller.agent)}/{_q(who)}")

    def _check_owner(
        self, caller: Caller, ref: ScopeRef, owner: Mapping[str, Any], name: str
    ) -> None:
        # Only the tenant scope is shared between agents; see the module docstring.
        if ref.scope != "tenant":
            return
        own = owner.get("own")
        if own is not None and own != caller.agent and owner.get("vis") == "private":
            raise E.Forbidden(f"{name} is another agent's private tenant field")

    def _readable(self, caller: Caller, decl: FieldDecl) -> ScopeRef | None:
        """The scope of a collection the caller may read, or None (recall and backlinks
        skip what a direct call would refuse)."""
        if decl.kind != "collection":
            return None
        try:
            return self._ref(caller, decl.dur, decl.name, write=False)
        except E.MemoryFault:
            return None

    # ------------------------------------------------------------------ writes

    def _hash(self, method: str, ref: ScopeRef, args: Mapping[str, Any]) -> str:
        body = {k: v for k, v in args.items() if k not in ("sc", "w")}
        text = json.dumps(
            [method, ref.scope, ref.scope_id, body],
            sort_keys=True,
            separators=(",", ":"),
            default=repr,
        )
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]

    def _prov(
        self, caller: Caller, args: Mapping[str, Any], now: float, ver: int
    ) -> dict[str, Any]:
        tool = args.get("tool")
        # `tool` is the caller's label for what wrote it: data, kept only if it is a short str.
        tool = tool if isinstance(tool, str) and 0 < len(tool) <= MAX_TOOL else None
        return {
            "dev": caller.device,
            "run": caller.run,
            "tool": tool,
            "at": now,
            "agent": caller.agent,
            "ver": ver,
        }

    def _write(
        self,
        caller: Caller,
        method: str,
        ref: ScopeRef,
        shard: str,
        args: Mapping[str, Any],
        plan: Callable[[ScopeTxn, float], _Plan],
        decl: FieldDecl | None = None,
    ) -> dict[str, Any]:
        """One write: the ledger check, the plan, the limits, then one atomic commit."""
        w = _arg_str(args, "w", MAX_W)
        h = self._hash(method, ref, args)
        with self.store.scope(ref) as tx:
            hit = tx.find_write(shard, caller.device, w)
            if hit is not None:
                if hit.h == h and hit.answer is not None:
                    return dict(hit.answer)
                raise E.WReused(f"write id {w[:64]!r} was used for another write")
            seen = tx.device_write(caller.device, w)
            if seen == L.APPLIED:
                # Applied before, its first answer let go with its file's ledger entry.
                return {"dup": True}
            if seen == L.STALE:
                raise E.WStale(
                    f"write id {w[:64]!r} belongs to a run the bridge has closed: nothing was"
                    " applied now (it may have been before); write again with a new id"
                )
            now = self.clock()
            p = plan(tx, now)
            self._check_limits(tx, shard, p, decl)
            entry = {"h": h, "ans": p.answer, "at": now}
            tx.commit(shard, p.changes, p.meta, ledger=(caller.device, w, entry))
            if self.index is not None and decl is not None:
                # Under the scope's lock, so two writes to a row reach the index in order.
                for key in p.index_drop:
                    self.index.remove(doc_id(ref, decl.name, key))
                for key, value in p.index_put.items():
                    self.index.upsert(
                        doc_id(ref, decl.name, key),
                        _text_of(value),
                        self._index_meta(ref, decl, key, tx.meta(shard)),
                    )
        return p.answer

    def _index_meta(
        self, ref: ScopeRef, decl: FieldDecl, key: str, m: Mapping[str, Any]
    ) -> dict[str, Any]:
        return {
            "tenant": ref.tenant,
            "scope": ref.scope,
            "scope_id": ref.scope_id,
            "field": decl.name,
            "key": key,
            "own": m.get("own"),
            "vis": m.get("vis"),
        }

    def _check_limits(self, tx: ScopeTxn, shard: str, p: _Plan, decl: FieldDecl | None) -> None:
        delta = 0
        for table in ("slots", "rows", "core"):
            current = tx.table(shard, table)
            for rid, rec in p.changes.get(table, {}).items():
                old = current.get(rid)
                delta += (int(rec["sz"]) if rec else 0) - (int(old["sz"]) if old else 0)
        # A write that frees bytes is let through even over the limit (a lowered limit
        # must not lock a scope's owner out of cleaning it up).
        if delta > 0 and tx.usage() + delta > self.scope_limit:
            raise E.OverLimit(f"the scope's storage limit of {self.scope_limit} bytes")
        if p.grows and decl is not None:
            rows = dict(tx.table(shard, "rows"))
            for rid, rec in p.changes.get("rows", {}).items():
                if rec is None:
                    rows.pop(rid, None)
                else:
                    rows[rid] = rec
            if len(rows) > decl.max:
                raise E.OverLimit(f"{decl.name} holds at most {decl.max} rows")

    # ------------------------------------------------------------------ slots

    def _slot_decl(self, caller: Caller, args: Mapping[str, Any]) -> FieldDecl:
        decl = self._decl(caller, args)
        if decl.kind != "slot":
            raise E.BadEnvelope(f"{decl.name} is a collection: use a key")
        return decl

    def _sweep_slots(self, tx: ScopeTxn, now: float, changes: dict[str, Any]) -> None:
        # Expired values go (with a tombstone keeping their version) on the next write
        # to the shard, which rewrites the file anyway.
        for name, rec in tx.table(SLOTS, "slots").items():
            if not _live(rec, now):
                changes.setdefault("slots", {})[name] = None
                changes.setdefault("tomb", {})[name] = {"ver": rec["ver"], "at": now}

    def _slot_plan(
        self,
        caller: Caller,
        decl: FieldDecl,
        ref: ScopeRef,
        args: Mapping[str, Any],
        compute: Callable[[Mapping[str, Any] | None], tuple[Any, dict[str, Any]]],
    ) -> Callable[[ScopeTxn, float], _Plan]:
        """A plan writing one slot: `compute(current record or None)` gives the new
        value and the answer's extra keys."""

        def plan(tx: ScopeTxn, now: float) -> _Plan:
            cur = tx.table(SLOTS, "slots").get(decl.name)
            if cur is not None:
                self._check_owner(caller, ref, cur, decl.name)
            live = cur if cur is not None and _live(cur, now) else None
            value, extra = compute(live)
            _check_value(value, decl.name)
            sz = _size(value, decl.name)
            if sz > decl.max:
                raise E.OverLimit(f"{decl.name} holds at most {decl.max} bytes")
            tomb = tx.table(SLOTS, "tomb").get(decl.name)
            base = cur["ver"] if cur is not None else tomb["ver"] if tomb is not None else 0
            ver = base + 1
            changes: dict[str, Any] = {}
            self._sweep_slots(tx, now, changes)
            changes.setdefault("slots", {})[decl.name] = {
                "value": value,
                "ver": ver,
                "at": now,
                "exp": None if decl.ttl is None else now + decl.ttl,
                "sz": sz,
                "prov": self._prov(caller, args, now, ver),
                "own": cur["own"] if cur is not None else caller.agent,
                "vis": cur["vis"] if cur is not None else decl.vis,
            }
            if tomb is not None:
                changes.setdefault("tomb", {})[decl.name] = None
            return _Plan({"ver": ver, **extra}, changes)

        return plan

    def state_load(self, caller: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
        names = args.get("fields")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise E.BadEnvelope("fields must be a list of field names")
        return self._read_slots(caller, names, wait=True)

    def state_seed(self, caller: Caller) -> dict[str, Any] | None:
        """What a run of `caller` would load (state.load of every durable slot field its
        hello declares), for the bridge to send in the run's `req` (PROTOCOL.md "req"):
        `{fields, values}`, None when the agent declares no such field, when a read is
        refused (the board's own state.load then says why) or when a read would wait
        (WouldWait: a scope being written, or not yet in memory; the caller is the
        bridge's network thread, which must wait for no fsync and read no file: the
        board then loads, and its load brings the scope into memory)."""
        names = [
            d.name
            for d in caller.decls.values()
            if d.kind == "slot" and d.dur != "run" and not d.core
        ]
        if not names:
            return None
        try:
            got = self._read_slots(caller, names, wait=False)
        except (E.MemoryFault, WouldWait):
            return None
        return {"fields": names, "values": got["values"]}

    def _read_slots(self, caller: Caller, names: list[str], *, wait: bool) -> dict[str, Any]:
        values: dict[str, Any] = {}
        vers: dict[str, int] = {}
        now = self.clock()
        for name in names:
            decl = self._slot_decl(caller, {"field": name})
            ref = self._ref(caller, decl.dur, name, write=False)
            with self.store.scope(ref, wait) as tx:
                rec = tx.table(SLOTS, "slots").get(name)
                if rec is None:
                    continue
                self._check_owner(caller, ref, rec, name)
                if _live(rec, now):
                    values[name] = rec["value"]
                    vers[name] = rec["ver"]
        return {"values": values, "vers": vers}

    def state_commit(self, caller: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
        writes = args.get("writes")
        if not isinstance(writes, list) or not 0 < len(writes) <= MAX_WRITES:
            raise E.BadEnvelope(f"writes must be a list of 1..{MAX_WRITES} maps")
        results: list[dict[str, Any]] = []
        for wr in writes:
            if not isinstance(wr, Mapping):
                results.append({"err": E.BadEnvelope("a write is a map").to_error()})
                continue
            head = {"field": wr.get("field"), "w": wr.get("w")}
            try:
                results.append({**head, **self._commit_one(caller, wr)})
            except E.MemoryFault as e:
                results.append({**head, "err": e.to_error()})
        return {"results": results}

    def _commit_one(self, caller: Caller, wr: Mapping[str, Any]) -> dict[str, Any]:
        decl = self._slot_decl(caller, wr)
        if "value" not in wr:
            raise E.BadEnvelope("a write needs a value")
        value = wr["value"]
        _check_value(value, decl.name)
        ref = self._ref(caller, decl.dur, decl.name, write=True)

        def compute(cur: Mapping[str, Any] | None) -> tuple[Any, dict[str, Any]]:
            old = MISSING if cur is None else cur["value"]
            return merge(decl.merge, old, value, decl.name), {}

        plan = self._slot_plan(caller, decl, ref, wr, compute)
        return self._write(caller, "state.commit", ref, SLOTS, wr, plan)

    # ------------------------------------------------------------------ rows

    def _collection(
        self, caller: Caller, args: Mapping[str, Any], *, write: bool
    ) -> tuple[FieldDecl, ScopeRef]:
        decl = self._decl(caller, args)
        if decl.kind != "collection":
            raise E.BadEnvelope(f"{decl.name} is a slot, not a collection")
        return decl, self._ref(caller, decl.dur, decl.name, write=write)

    def _rows(self, tx: ScopeTxn, caller: Caller, decl: FieldDecl) -> Mapping[str, dict[str, Any]]:
        self._check_owner(caller, tx.ref, tx.meta(decl.name), decl.name)
        return tx.table(decl.name, "rows")

    def _row_plan(
        self,
        caller: Caller,
        decl: FieldDecl,
        args: Mapping[str, Any],
        key: str | None,
        compute: Callable[[Mapping[str, Any] | None], tuple[Any, list[Any] | None, dict[str, Any]]],
        *,
        must_exist: bool = False,
        index: bool = True,
    ) -> Callable[[ScopeTxn, float], _Plan]:
        """A plan writing one row: `compute(current row or None)` gives the new value,
        the new links (None keeps them) and the answer's extra keys. `key` None inserts
        a row under a new key."""

        def plan(tx: ScopeTxn, now: float) -> _Plan:
            rows = self._rows(tx, caller, decl)
            m = tx.meta(decl.name)
            tombs = tx.table(decl.name, "tomb")
            changes: dict[str, dict[str, Any]] = {"rows": {}, "tomb": {}}
            meta: dict[str, Any] = {}
            drop: list[str] = []
            # Expired rows go on this write, which rewrites the file anyway; a tombstone
            # keeps their version so a later row of that key does not reuse it.
            for k, rec in rows.items():
                if not _live(rec, now):
                    changes["rows"][k] = None
                    changes["tomb"][k] = {"ver": rec["ver"], "at": now}
                    drop.append(k)
            row_key = key
            if row_key is None:
                n = int(m.get("next", 0))
                while True:
                    n += 1
                    row_key = f"r{n}"
                    if row_key not in rows and row_key not in tombs:
                        break
                meta["next"] = n
            cur = rows.get(row_key)
            if cur is not None and not _live(cur, now):
                cur = None
            if cur is None and must_exist:
                raise E.NotFound(f"no row {row_key[:64]!r} in {decl.name}")
            value, links, extra = compute(cur)
            _check_value(value, decl.name)
            if links is None:
                links = list(cur["links"]) if cur is not None else []
            tomb = tombs.get(row_key) or changes["tomb"].get(row_key)
            base = cur["ver"] if cur is not None else tomb["ver"] if tomb is not None else 0
            ver = base + 1
            seq = int(m.get("seq", 0)) + 1
            meta["seq"] = seq
            if "own" not in m:
                meta.update(own=caller.agent, vis=decl.vis)
            changes["rows"][row_key] = {
                "key": row_key,
                "value": value,
                "ver": ver,
                "links": links,
                "prov": self._prov(caller, args, now, ver),
                "at": now,
                "created": cur["created"] if cur is not None else now,
                "exp": None if decl.ttl is None else now + decl.ttl,
                "sz": _size([value, links], decl.name),
                "seq": seq,
            }
            changes["tomb"][row_key] = None
            p = _Plan({"ver": ver, **extra}, changes, meta, index_drop=drop)
            p.grows = cur is None
            if index:
                p.index_put[row_key] = value
            return p

        return plan

    def _opt_key(self, args: Mapping[str, Any]) -> str | None:
        key: str | None = _arg_str(args, "key", MAX_KEY, required=False)
        return key

    def _links(self, caller: Caller, raw: object) -> list[dict[str, str]]:
        if not isinstance(raw, list) or len(raw) > MAX_LINKS:
            raise E.BadEnvelope(f"links must be a list of at most {MAX_LINKS} maps")
        out: list[dict[str, str]] = []
        for link in raw:
            if not isinstance(link, Mapping):
                raise E.BadEnvelope("a link is a map {label, to_field, to_key}")
            out.append(self._link(caller, link))
        return out

    def _link(self, caller: Caller, args: Mapping[str, Any]) -> dict[str, str]:
        label = _arg_str(args, "label", MAX_LABEL)
        to = self._decl(caller, args, "to_field")
        if to.kind != "collection":
            raise E.BadEnvelope(f"{to.name} is a slot: links point at rows")
        return {"label": label, "to_field": to.name, "to_key": _arg_str(args, "to_key", MAX_KEY)}

    def mem_remember(self, caller: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
        decl, ref = self._collection(caller, args, write=True)
        if "value" not in args:
            raise E.BadEnvelope("mem.remember needs a value")
        value = args["value"]
        _check_value(value, decl.name)
        key = self._opt_key(args)
        if key is None and decl.key is not None and isinstance(value, dict):
            prop = value.get(decl.key)
            if isinstance(prop, str) and 0 < len(prop) <= MAX_KEY:
                key = prop
            elif _is_int(prop):
                key = str(prop)
        links = None if args.get("links") is None else self._links(caller, args["links"])

        def compute(cur: Mapping[str, Any] | None) -> tuple[Any, list[Any] | None, dict[str, Any]]:
            old = MISSING if cur is None else cur["value"]
            return merge(decl.merge, old, value, decl.name), links, {}

        plan = self._row_plan(caller, decl, args, key, compute)

        def keyed(tx: ScopeTxn, now: float) -> _Plan:
            p = plan(tx, now)
            p.answer["key"] = next(k for k, r in p.changes["rows"].items() if r is not None)
            return p

        return self._write(caller, "mem.remember", ref, decl.name, args, keyed, decl)

    def mem_cas(self, caller: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
        """Decided: at the current version the value is applied by the field's merge (for
        `replace` that is the compare-and-set); at another version a `replace` field is
        `conflict` and any other merges and answers `merged: true`. A missing row or a
        never-written slot is `not_found`."""
        decl = self._decl(caller, args)
        if "value" not in args:
            raise E.BadEnvelope("mem.cas needs a value")
        value = args["value"]
        _check_value(value, decl.name)
        if_ver = _arg_int(args, "if_ver", 0, 2**53, None)
        ref = self._ref(caller, decl.dur, decl.name, write=True)

        def apply(cur: Mapping[str, Any] | None) -> tuple[Any, dict[str, Any]]:
            if cur is None:
                raise E.NotFound(f"nothing stored in {decl.name} to compare")
            if cur["ver"] == if_ver:
                return merge(decl.merge, cur["value"], value, decl.name), {}
            if decl.merge == "replace":
                raise E.Conflict(
                    f"{decl.name} is at version {cur['ver']}", value=cur["value"], ver=cur["ver"]
                )
            return merge(decl.merge, cur["value"], value, decl.name), {"merged": True}

        def answered(
            plan: Callable[[ScopeTxn, float], _Plan],
        ) -> Callable[[ScopeTxn, float], _Plan]:
            def run(tx: ScopeTxn, now: float) -> _Plan:
                p = plan(tx, now)
                table = "slots" if decl.kind == "slot" else "rows"
                rec = next(
                    r for r in p.changes[table].values() if r and r["ver"] == p.answer["ver"]
                )
                p.answer["value"] = rec["value"]
                return p

            return run

        if decl.kind == "slot":
            if args.get("key") is not None:
                raise E.BadEnvelope(f"{decl.name} is a slot: no key")
            plan = self._slot_plan(caller, decl, ref, args, apply)
            return self._write(caller, "mem.cas", ref, SLOTS, args, answered(plan))
        key = _arg_str(args, "key", MAX_KEY)

        def row(cur: Mapping[str, Any] | None) -> tuple[Any, list[Any] | None, dict[str, Any]]:
            v, extra = apply(cur)
            return v, None, extra

        rplan = self._row_plan(caller, decl, args, key, row, must_exist=True)
        return self._write(caller, "mem.cas", ref, decl.name, args, answered(rplan), decl)

    def _text_edit(
        self,
        caller: Caller,
        args: Mapping[str, Any],
        method: str,
        edit: Callable[[str | None], str],
    ) -> dict[str, Any]:
        """mem.append / mem.replace: `edit(current text or None)` is the new text. A row's
        text is its value when that is a str, else the value's `text` key."""
        decl = self._decl(caller, args)
        ref = self._ref(caller, decl.dur, decl.name, write=True)

        def on_value(cur_value: Any) -> Any:
            if cur_value is MISSING:
                return edit(None)
            if isinstance(cur_value, str):
                return edit(cur_value)
            if isinstance(cur_value, dict) and isinstance(cur_value.get("text"), str):
                return {**cur_value, "text": edit(cur_value["text"])}
            raise E.BadEnvelope(f"{decl.name} does not hold text")

        if decl.kind == "slot":
            if args.get("key") is not None:
                raise E.BadEnvelope(f"{decl.name} is a slot: no key")

            def slot(cur: Mapping[str, Any] | None) -> tuple[Any, dict[str, Any]]:
                return on_value(MISSING if cur is None else cur["value"]), {}

            plan = self._slot_plan(caller, decl, ref, args, slot)
            return self._write(caller, method, ref, SLOTS, args, plan)
        key = _arg_str(args, "key", MAX_KEY)

        def row(cur: Mapping[str, Any] | None) -> tuple[Any, list[Any] | None, dict[str, Any]]:
            return on_value(MISSING if cur is None else cur["value"]), None, {}

        rplan = self._row_plan(caller, decl, args, key, row, must_exist=method == "mem.replace")
        return self._write(caller, method, ref, decl.name, args, rplan, decl)

    def mem_append(self, caller: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
        text = _arg_text(args, "text")
        return self._text_edit(caller, args, "mem.append", lambda cur: (cur or "") + text)

    def mem_replace(self, caller: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
        """Decided: `old` must occur in the text; its first occurrence is replaced."""
        old = _arg_text(args, "old")
        text = _arg_text(args, "text")
        if not old:
            raise E.BadEnvelope("old must not be empty")

        def edit(cur: str | None) -> str:
            if cur is None or old not in cur:
                raise E.NotFound("old is not in the text")
            return cur.replace(old, text, 1)

        return self._text_edit(caller, args, "mem.replace", edit)

    def _link_edit(self, caller: Caller, args: Mapping[str, Any], add: bool) -> dict[str, Any]:
        decl, ref = self._collection(caller, args, write=True)
        key = _arg_str(args, "key", MAX_KEY)
        link = self._link(caller, args)
        method = "mem.link" if add else "mem.unlink"
        if add:
            # The target is checked in its own scope before this one is locked: one scope
            # lock at a time, so two links in opposite directions cannot deadlock. A
            # target forgotten after this check leaves a link to nothing, which readers
            # tolerate.
            to = caller.decls[link["to_field"]]
            to_ref = self._ref(caller, to.dur, to.name, write=False)
            with self.store.scope(to_ref) as tx:
                target = self._rows(tx, caller, to).get(link["to_key"])
                if target is None or not _live(target, self.clock()):
                    raise E.NotFound(f"no row {link['to_key'][:64]!r} in {to.name}")

        def compute(cur: Mapping[str, Any] | None) -> tuple[Any, list[Any] | None, dict[str, Any]]:
            assert cur is not None  # must_exist
            links = [x for x in cur["links"] if x != link]
            if add:
                if len(links) >= MAX_LINKS:
                    raise E.OverLimit(f"a row has at most {MAX_LINKS} links")
                links.append(link)
            return cur["value"], links, {}

        plan = self._row_plan(caller, decl, args, key, compute, must_exist=True, index=False)
        return self._write(caller, method, ref, decl.name, args, plan, decl)

    def mem_link(self, caller: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
        return self._link_edit(caller, args, True)

    def mem_unlink(self, caller: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
        return self._link_edit(caller, args, False)

    def mem_forget(self, caller: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
        """Forget a row (a tombstone keeps its version), a slot's value (`key` absent), or
        a core field's text in its scope's core backup.

        Decided: forgetting a core field empties its scope's stored core document and
        raises the document's version by one, so a backup made before the forget (its
        `ver` not above the new one) is refused `conflict` by core.sync and cannot
        bring it back.
        """
        decl = self._decl(caller, args)
        ref = self._ref(caller, decl.dur, decl.name, write=True)
        key = self._opt_key(args)
        if decl.kind == "collection":
            if key is None:
                raise E.BadEnvelope("mem.forget of a row needs its key")
            return self._write(
                caller,
                "mem.forget",
                ref,
                decl.name,
                args,
                self._forget_row(caller, decl, key),
                decl,
            )
        if key is not None:
            raise E.BadEnvelope(f"{decl.name} is a slot: no key")

        def plan(tx: ScopeTxn, now: float) -> _Plan:
            changes: dict[str, dict[str, Any] | Any] = {}
            forgotten = False
            cur = tx.table(SLOTS, "slots").get(decl.name)
            if cur is not None:
                self._check_owner(caller, ref, cur, decl.name)
                forgotten = _live(cur, now)
                changes["slots"] = {decl.name: None}
                changes["tomb"] = {decl.name: {"ver": cur["ver"], "at": now}}
            core = tx.table(SLOTS, "core").get("doc")
            if decl.core and core is not None and core["doc"]:
                ver = core["ver"] + 1
                rec = {"ver": ver, "doc": "", "at": now, "sz": _size("", "doc")}
                changes["core"] = {"doc": rec}
                forgotten = True
            return _Plan({"key": None, "forgotten": forgotten}, changes)

        return self._write(caller, "mem.forget", ref, SLOTS, args, plan)

    def _forget_row(
        self, caller: Caller, decl: FieldDecl, key: str
    ) -> Callable[[ScopeTxn, float], _Plan]:
        def plan(tx: ScopeTxn, now: float) -> _Plan:
            rows = self._rows(tx, caller, decl)
            cur = rows.get(key)
            p = _Plan({"key": key, "forgotten": False}, {})
            if cur is not None:
                p.answer["forgotten"] = _live(cur, now)
                p.changes = {"rows": {key: None}, "tomb": {key: {"ver": cur["ver"], "at": now}}}
                p.index_drop.append(key)
            return p

        return plan

    # ------------------------------------------------------------------ row reads

    def mem_list(self, caller: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
        """Rows most recently written first. The cursor is the write sequence of the
        last row returned (an opaque str to the caller)."""
        decl, ref = self._collection(caller, args, write=False)
        limit = _arg_int(args, "limit", 1, MAX_LIST, DEFAULT_LIST)
        cursor = args.get("cursor")
        if cursor is not None and not (
            isinstance(cursor, str) and cursor.isdigit() and len(cursor) < 20
        ):
            raise E.BadEnvelope("cursor must be a str a previous mem.list returned")
        below = int(cursor) if cursor is not None else None
        now = self.clock()
        with self.store.scope(ref) as tx:
            rows = [
                r
                for r in self._rows(tx, caller, decl).values()
                if _live(r, now) and (below is None or r["seq"] < below)
            ]
        rows.sort(key=lambda r: r["seq"], reverse=True)
        page = rows[:limit]
        more = len(rows) > limit
        return {"rows": [_row(r) for r in page], "cursor": str(page[-1]["seq"]) if more else None}

    def mem_peek(self, caller: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
        decl, ref = self._collection(caller, args, write=False)
        key = _arg_str(args, "key", MAX_KEY)
        now = self.clock()
        with self.store.scope(ref) as tx:
            rec = self._rows(tx, caller, decl).get(key)
        if rec is None or not _live(rec, now):
            raise E.NotFound(f"no row {key[:64]!r} in {decl.name}")
        # Backlinks are found, not stored: every row the caller may read whose links
        # point here, one scope locked at a time.
        backlinks: list[dict[str, Any]] = []
        for other in caller.decls.values():
            oref = self._readable(caller, other)
            if oref is None:
                continue
            with self.store.scope(oref) as tx:
                try:
                    rows = self._rows(tx, caller, other)
                except E.Forbidden:
                    continue
                for r in rows.values():
                    if not _live(r, now):
                        continue
                    for link in r.get("links", []):
                        if link["to_field"] == decl.name and link["to_key"] == key:
                            backlinks.append(
                                {"field": other.name, "key": r["key"], "label": link["label"]}
                            )
        return {"row": _row(rec), "backlinks": backlinks}

    def mem_recall(self, caller: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
        """Ranked rows for a query, over one collection or every one the caller may read.

        With an index, its hits restricted by `allowed` to the caller's readable
        collections; without one, the fallback: rows ranked by the share of the query's
        words (case-insensitive `\\w+` tokens) they contain, ties most recent first.
        """
        query = _arg_str(args, "query", MAX_QUERY)
        k = _arg_int(args, "k", 1, MAX_K, 5)
        if args.get("field") is not None:
            decl, ref = self._collection(caller, args, write=False)
            readable = {(ref.scope, ref.scope_id, decl.name): (decl, ref)}
        else:
            readable = {}
            for d in caller.decls.values():
                r = self._readable(caller, d)
                if r is not None:
                    readable[(r.scope, r.scope_id, d.name)] = (d, r)
        now = self.clock()
        hits: list[dict[str, Any]] = []
        if self.index is not None:

            def allowed(meta: dict[str, Any]) -> bool:
                if meta.get("tenant") != caller.tenant:
                    return False
                if (meta.get("scope"), meta.get("scope_id"), meta.get("field")) not in readable:
                    return False
                return not (
                    meta.get("scope") == "tenant"
                    and meta.get("vis") == "private"
                    and meta.get("own") not in (None, caller.agent)
                )

            # Ask for more than k: a hit the store no longer holds (expired, forgotten
            # after a crash left the index behind) is skipped.
            for did, score in self.index.search(query, min(2 * k, 2 * MAX_K), allowed):
                parts = did.split("/")
                if len(parts) < 5:
                    continue
                name, key = parts[-2], unquote(parts[-1])
                scope_id = "/".join(parts[2:-2])
                got = readable.get((parts[1], scope_id, name))
                if got is None:
                    continue
                d, r = got
                with self.store.scope(r) as tx:
                    try:
                        rec = self._rows(tx, caller, d).get(key)
                    except E.Forbidden:
                        continue
                if rec is not None and _live(rec, now):
                    hits.append(_hit(name, rec, score))
                if len(hits) == k:
                    break
            return {"hits": hits}
        words = {t.lower() for t in _TOKEN.findall(query)}
        if not words:
            return {"hits": []}
        scored: list[tuple[float, int, str, dict[str, Any]]] = []
        for (_, _, name), (d, r) in readable.items():
            with self.store.scope(r) as tx:
                try:
                    rows = list(self._rows(tx, caller, d).values())
                except E.Forbidden:
                    continue
            for rec in rows:
                if not _live(rec, now):
                    continue
                have = {t.lower() for t in _TOKEN.findall(_text_of(rec["value"]))}
                score = len(words & have) / len(words)
                if score > 0:
                    scored.append((score, rec["seq"], name, rec))
        scored.sort(key=lambda s: (s[0], s[1]), reverse=True)
        return {"hits": [_hit(name, rec, score) for score, _, name, rec in scored[:k]]}

    def reindex(self) -> int:
        """Put every live row of the store into the index (after a crash or on a new
        index); returns how many."""
        if self.index is None:
            return 0
        now = self.clock()
        count = 0
        for ref, shard, doc in self.store.scan():
            if shard == SLOTS:
                continue
            m = doc.get("meta", {}).get("m", {})
            for key, rec in doc.get("rows", {}).items():
                if _live(rec, now):
                    meta = {
                        "tenant": ref.tenant,
                        "scope": ref.scope,
                        "scope_id": ref.scope_id,
                        "field": shard,
                        "key": key,
                        "own": m.get("own"),
                        "vis": m.get("vis"),
                    }
                    self.index.upsert(
                        f"{ref.tenant}/{ref.scope}/{ref.scope_id}/{shard}/{_q(key)}",
                        _text_of(rec["value"]),
                        meta,
                    )
                    count += 1
        return count

    # ------------------------------------------------------------------ core

    def _core_decl(self, caller: Caller, scope: str) -> FieldDecl:
        """The core field that declares a scope's document (its `max` is the limit)."""
        for decl in caller.decls.values():
            if decl.core and decl.dur == scope:
                return decl
        raise E.UnknownField(f"no core field declared for the {scope} scope")

    def _core_ref(self, caller: Caller, args: Mapping[str, Any], *, write: bool) -> ScopeRef:
        scope = args.get("scope")
        if scope not in ("agent", "user"):
            raise E.BadEnvelope("scope must be agent or user")
        return self._ref(caller, str(scope), f"core memory of the {scope}", write=write)

    def core_sync(self, caller: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
        ref = self._core_ref(caller, args, write=True)
        ver = _arg_int(args, "ver", 1, 2**53, None)
        doc = args.get("doc")
        if not isinstance(doc, str):
            raise E.BadEnvelope("doc must be a str")
        decl = self._core_decl(caller, ref.scope)
        if len(doc) > decl.max:
            raise E.OverLimit(f"core memory {decl.name} holds at most {decl.max} characters")

        def plan(tx: ScopeTxn, now: float) -> _Plan:
            cur = tx.table(SLOTS, "core").get("doc")
            if cur is not None and ver <= cur["ver"]:
                raise E.Conflict(
                    f"core memory is at version {cur['ver']}", ver=cur["ver"], doc=cur["doc"]
                )
            rec = {"ver": ver, "doc": doc, "at": now, "sz": _size(doc, "doc")}
            return _Plan({"ver": ver}, {"core": {"doc": rec}})

        return self._write(caller, "core.sync", ref, SLOTS, args, plan)

    def core_load(self, caller: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
        ref = self._core_ref(caller, args, write=False)
        with self.store.scope(ref) as tx:
            cur = tx.table(SLOTS, "core").get("doc")
        if cur is None:
            return {"ver": 0}
        return {"ver": cur["ver"], "doc": cur["doc"]}


def _hit(name: str, rec: Mapping[str, Any], score: float) -> dict[str, Any]:
    return {
        "field": name,
        "key": rec["key"],
        "score": round(float(score), 6),
        "value": rec["value"],
        "prov": rec["prov"],
    }
