"""The knowledge methods as RPC handlers: `kb.retrieve`, `kb.add`, `kb.delete`.

A board asks the bridge's KnowledgeBase (service.py) over its RPC link, and everything
about who is asking comes from trusted sources only, as for memory (memory/calls.py):
- the tenant from the registry record of the call's MQTT user: every store call is made
  with it, and no argument names one (a `tenant` key in the arguments is data), so a
  collection of another tenant cannot be named, searched, written or deleted;
- the rights from the registry's grants of the device's agent in that tenant: a grant of
  field `kb:<collection>` (memory/grants.py), `read` for kb.retrieve, `write` for
  kb.add and kb.delete (write includes read). The `*` grant of tenant memory fields
  does not reach knowledge. No grant: `forbidden`.

A board's sources are namespaced by its device: `src` "readings" of dev1 is stored as
"dev1/readings", so one board can neither overwrite nor delete another's (it reaches
only its own namespace; another's is `not_found`), while retrieval reads the whole
collection, as the grant says.

Bounds, each refused by name:
- `text` at most MAX_TEXT_BYTES of UTF-8 and never more than the board's own payload
  (it came in one message): over it, `too_large`;
- a per-device budget (DeviceBudget): calls per second for every kb.* method and ingested
  bytes per minute; past either, `rate_limited` with `retry_after_s`, counted
  (`kb.rate_limited`), and nothing of the refused call is done;
- the work runs on the RPC worker that took the call, so ingests share the bridge's
  bounded pool and per-device in-flight cap with every other call (a flood past that
  cap is `busy` before it reaches here);
- an answer is sized to the payload the board's hello announced: kb.retrieve cuts its
  passages to fit (decided: cut, not refuse, since a board asking for 8,000 characters
  wants as much as it can read; the answer says `cut: true` and each cut hit
  `truncated: true`), and drops trailing hits whose text is gone.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, cast

from server_bridge.memory.grants import READ, WRITE
from server_bridge.registry import RegistryStore
from server_bridge.rpc import CallContext, Emit, RpcError, RpcServer
from server_bridge.wire import BOARD_DEFAULTS, Limits, encode

from .errors import InvalidK, InvalidName, InvalidOption, KnowledgeError, NotFound, QueryTooLarge
from .service import DEFAULT_MAX_CHARS, KnowledgeBase, Mode, Retrieval, _check_name
from .sources import Record, Records

__all__ = [
    "MAX_TEXT_BYTES",
    "METHODS",
    "DeviceBudget",
    "register",
]

log = logging.getLogger("wren.bridge.knowledge")

LimitsOf = Callable[[str], Limits | None]
Count = Callable[[str, int], None]

METHODS = ("kb.retrieve", "kb.add", "kb.delete")
#: Text one kb.add carries: a board offloads a few KiB at a time (its payload is
#: 4.5 KiB by default), and 8 KiB is eight chunks, about half a second of embedding.
MAX_TEXT_BYTES = 8192
#: A board's own source id, before the bridge puts its device in front.
_SRC = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
_KINDS = {"txt": ".txt", "text": ".txt", "md": ".md", "markdown": ".md"}
# What an answer's envelope adds around `ok`: {c, s, ok} with a call id of up to 64
# (as memory/calls.py).
_ENVELOPE = 96


class DeviceBudget:
    """Per device, two token buckets: calls (every kb.* method) and ingested bytes.

    Defaults: bursts of 20 calls refilled at 5 a second, and of 64 KiB refilled at
    1 KiB a second (60 KiB a minute): a board sending a reading a second never meets
    them, a board flooding its link does at once. Bounded at `max_devices` buckets,
    the least recently used dropped first (a dropped device starts again full: the
    registry's devices are far fewer than the cap, so only churn reaches it)."""

    def __init__(
        self,
        calls_burst: float = 20,
        calls_per_s: float = 5,
        bytes_burst: float = 65536,
        bytes_per_s: float = 1024,
        max_devices: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.calls_burst, self.calls_per_s = calls_burst, calls_per_s
        self.bytes_burst, self.bytes_per_s = bytes_burst, bytes_per_s
        self.max_devices = max_devices
        self._clock = clock
        self._lock = threading.Lock()
        # device -> [call tokens, byte tokens, when last refilled]
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()

    def take(self, device: str, nbytes: int = 0) -> float:
        """Spend one call and `nbytes`; 0.0 when done, else the seconds to wait (and
        nothing is spent)."""
        now = self._clock()
        with self._lock:
            b = self._buckets.get(device)
            if b is None:
                b = [self.calls_burst, self.bytes_burst, now]
                self._buckets[device] = b
                while len(self._buckets) > self.max_devices:
                    self._buckets.popitem(last=False)
            self._buckets.move_to_end(device)
            dt = max(0.0, now - b[2])
            b[0] = min(self.calls_burst, b[0] + dt * self.calls_per_s)
            b[1] = min(self.bytes_burst, b[1] + dt * self.bytes_per_s)
            b[2] = now
            wait = 0.0
            if b[0] < 1:
                wait = (1 - b[0]) / self.calls_per_s
            if nbytes > b[1]:
                # A call larger than the burst can never pass: MAX_TEXT_BYTES is below it.
                wait = max(wait, (nbytes - b[1]) / self.bytes_per_s)
            if wait > 0:
                return wait
            b[0] -= 1
            b[1] -= nbytes
            return 0.0



def register(
    rpc: RpcServer,
    kb: KnowledgeBase,
    registry: RegistryStore,
    limits_of: LimitsOf,
    count: Count,
    budget: DeviceBudget | None = None,
) -> None:
    """Add kb.retrieve, kb.add and kb.delete to the RPC table."""
    h = _Handlers(kb, registry, limits_of, count, budget or DeviceBudget())
    rpc.register("kb.retrieve", h.retrieve)
    rpc.register("kb.add", h.ingest)
    rpc.register("kb.delete", h.delete)


def _bad(msg: str) -> RpcError:
    return RpcError("bad_envelope", msg)


def _str(args: Mapping[str, Any], key: str, required: bool = True) -> str | None:
    v = args.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, str):
        raise _bad(f"{key} must be a string")
    return v


def _str_list(args: Mapping[str, Any], key: str) -> list[str]:
    v = args.get(key)
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _bad(f"{key} must be a list of strings")
    return list(v)


def _fault(e: KnowledgeError) -> RpcError:
    if isinstance(e, NotFound):
        return RpcError("not_found", str(e))
    if isinstance(e, QueryTooLarge):
        return RpcError("too_large", str(e))
    if isinstance(e, (InvalidK, InvalidName, InvalidOption)):
        return _bad(str(e))
    return RpcError("internal", str(e))


class _Handlers:
    def __init__(
        self,
        kb: KnowledgeBase,
        registry: RegistryStore,
        limits_of: LimitsOf,
        count: Count,
        budget: DeviceBudget,
    ) -> None:
        self.kb = kb
        self.registry = registry
        self.limits_of = limits_of
        self.count = count
        self.budget = budget

    def _limits(self, ctx: CallContext) -> Limits:
        return self.limits_of(ctx.device.device) or BOARD_DEFAULTS

    def _spend(self, ctx: CallContext, nbytes: int = 0) -> None:
        wait = self.budget.take(ctx.device.device, nbytes)
        if wait > 0:
            self.count("kb.rate_limited", 1)
            raise RpcError(
                "rate_limited",
                f"device {ctx.device.device} is over its knowledge budget "
                f"({self.budget.calls_per_s:g} calls/s, "
                f"{self.budget.bytes_per_s * 60 / 1024:g} KiB/min): try again in {wait:.1f} s",
                {"retry_after_s": max(0.01, round(wait, 2))},
            )

    def _may(self, ctx: CallContext, collection: str, access: str) -> None:
        grants = self.registry.grants_of(ctx.device.tenant, ctx.device.agent)
        got = grants.knowledge(collection)
        if got is None or (access == WRITE and got != WRITE):
            self.count("kb.forbidden", 1)
            raise RpcError(
                "forbidden",
                f"agent {ctx.device.agent} may not {access} knowledge collection "
                f"{collection!r} (no grant kb:{collection} with {access})",
            )

    def _collection(self, args: Mapping[str, Any]) -> str:
        c = cast(str, _str(args, "collection"))
        try:
            return _check_name("collection", c)
        except InvalidName as e:
            raise _bad(str(e)) from None

    def _source(self, ctx: CallContext, args: Mapping[str, Any]) -> str:
        src = cast(str, _str(args, "src"))
        if not _SRC.fullmatch(src):
            raise _bad(
                f"src {src!r}: 1-128 characters of letters, digits and . _ : / -, "
                "starting with a letter or digit"
            )
        return f"{ctx.device.device}/{src}"

    # --- kb.retrieve -------------------------------------------------------------------

    def retrieve(self, ctx: CallContext, args: dict[str, Any], emit: Emit) -> Any:
        query = cast(str, _str(args, "query"))
        k = args.get("k", 5)
        if isinstance(k, bool) or not isinstance(k, int):
            raise _bad("k must be an int")
        asked = _str_list(args, "collections")
        grants = self.registry.grants_of(ctx.device.tenant, ctx.device.agent)
        if asked:
            for c in asked:
                self._may(ctx, c, READ)
            collections = asked
        else:
            collections = grants.knowledge_collections(READ)
            if not collections:
                self.count("kb.forbidden", 1)
                raise RpcError(
                    "forbidden", f"agent {ctx.device.agent} may read no knowledge collection"
                )
        max_chars = args.get("max_chars", DEFAULT_MAX_CHARS)
        if isinstance(max_chars, bool) or not isinstance(max_chars, int):
            raise _bad("max_chars must be an int")
        max_age = args.get("max_age_s")
        mode = args.get("mode", "hybrid")
        limits = self._limits(ctx)
        # Never more characters than the board can read in one answer (a character is
        # at least a byte): the cut below then trims, not the store's whole default.
        max_chars = min(max_chars, limits.max_payload) if max_chars >= 1 else max_chars
        self._spend(ctx)
        try:
            got = self.kb.retrieve(
                ctx.device.tenant,
                query,
                k=k,
                mode=cast(Mode, mode),
                collections=collections,
                sources=_str_list(args, "sources"),
                tags=_str_list(args, "tags"),
                max_chars=max_chars,
                max_age_s=max_age,
            )
        except KnowledgeError as e:
            raise _fault(e) from None
        return _fit(got, limits)

    # --- kb.add ------------------------------------------------------------------------

    def ingest(self, ctx: CallContext, args: dict[str, Any], emit: Emit) -> Any:
        collection = self._collection(args)
        source = self._source(ctx, args)
        text = cast(str, _str(args, "text"))
        kind = _str(args, "kind", required=False) or "txt"
        if kind not in _KINDS:
            raise _bad(f"kind {kind!r}: one of {', '.join(_KINDS)}")
        tags = _str_list(args, "tags")
        data = text.encode("utf-8")
        limit = min(MAX_TEXT_BYTES, self._limits(ctx).max_payload)
        if len(data) > limit:
            self.count("kb.too_large", 1)
            raise RpcError(
                "too_large",
                f"text of {len(data):,} bytes: at most {limit:,} a call (send it in parts, "
                "each its own src)",
            )
        self._may(ctx, collection, WRITE)
        self._spend(ctx, len(data))
        # The device as a tag too: a retrieval can keep to one board's text.
        tags = [*tags, f"dev:{ctx.device.device}"]
        try:
            summary = self.kb.ingest(
                Records([Record(source, text, _KINDS[kind])]),
                tenant=ctx.device.tenant,
                collection=collection,
                tags=tags,
            )
        except KnowledgeError as e:
            raise _fault(e) from None
        (result,) = summary.files
        if result.status == "failed":
            if result.reason.startswith("write failed"):
                raise RpcError("internal", result.reason)
            raise _bad(f"{source}: {result.reason}")
        self.count("kb.ingested_bytes", len(data))
        return {
            "src": source,
            # The store's version: the sha256 of the text's bytes (service.py).
            "ver": hashlib.sha256(data).hexdigest(),
            "status": result.status,
            "chunks": result.chunks,
        }

    # --- kb.delete ---------------------------------------------------------------------

    def delete(self, ctx: CallContext, args: dict[str, Any], emit: Emit) -> Any:
        collection = self._collection(args)
        source = self._source(ctx, args)
        self._may(ctx, collection, WRITE)
        self._spend(ctx)
        try:
            gone = self.kb.delete_source(ctx.device.tenant, collection, source)
        except KnowledgeError as e:
            raise _fault(e) from None
        return {"src": source, "chunks": gone}


def _answer(got: Retrieval, hits: list[dict[str, Any]], cut: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"hits": hits, "mode": got.mode, "cut": cut}
    if got.note:
        out["note"] = got.note
    return out


def _fit(got: Retrieval, limits: Limits) -> dict[str, Any]:
    """The answer, its passages cut so that it fits the board's payload and each text
    its string limit: the last hit's text shortened first, a hit left without text
    dropped."""
    hits: list[dict[str, Any]] = [
        {
            "collection": h.collection,
            "source": h.source,
            "version": h.version,
            "chunk": h.chunk,
            "headings": list(h.headings),
            "score": round(float(h.score), 6),
            "text": h.text,
            "truncated": h.truncated,
        }
        for h in got.hits
    ]
    room = limits.max_payload - _ENVELOPE
    cut = any(h["truncated"] for h in hits)
    for h in hits:
        if len(h["text"].encode("utf-8")) > limits.max_str:
            h["text"] = _cut(h["text"], limits.max_str)
            h["truncated"] = cut = True
    # Bounded: each round shortens the last text by the excess or drops a hit.
    while hits:
        over = len(encode(_answer(got, hits, True))) - room
        if over <= 0:
            break
        last = hits[-1]
        size = len(last["text"].encode("utf-8"))
        if size <= over + 16:
            hits.pop()
        else:
            last["text"] = _cut(last["text"], size - over - 8)
            last["truncated"] = True
        cut = True
    return _answer(got, hits, cut)


def _cut(text: str, nbytes: int) -> str:
    """The longest prefix of `text` of at most `nbytes` UTF-8 bytes."""
    return text.encode("utf-8")[: max(0, nbytes)].decode("utf-8", errors="ignore")
