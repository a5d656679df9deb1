"""The msgpack codec of the board link and the shapes of the wire contract.

docs/PROTOCOL.md, "Limits" and "Errors": every payload the bridge reads is decoded
here with explicit limits, checked before anything is allocated, and every refusal is
an exception whose `.kind` is the contract's error kind — the same names the board
uses, so a refusal reads the same on both sides.

Decoding uses the board's own codec rather than `msgpack.unpackb`: the library cannot
bound nesting depth below its stack size and reports a 4 GiB declared string as
"incomplete input", while the contract calls a declared size over the limit
`too_large` whatever follows it. Encoding uses the `msgpack` library.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard, cast

import msgpack

from edge_runtime import codec
from edge_runtime.events import DEVICE_RUN, MAX_ID, MAX_REASON, RX_PAYLOAD, TYPE_NAMES
from edge_runtime.rpc import CHUNK, WINDOW
from server_bridge.tokens import TokenError
from server_bridge.topics import BadTopic

__all__ = [
    "BOARD_DEFAULTS",
    "BRIDGE_RUN",
    "DEFAULT_LIMITS",
    "DEVICE_RUN",
    "EVENT_TYPES",
    "MAX_BOOT",
    "MAX_ERROR_MSG",
    "MAX_ID",
    "MAX_REASON",
    "REFUSALS",
    "RETAINED",
    "Ack",
    "BadEnvelope",
    "BadTopic",
    "BadType",
    "Call",
    "DeviceOffline",
    "HostCtl",
    "HostReq",
    "Limits",
    "NoScope",
    "TokenError",
    "TooDeep",
    "TooLarge",
    "Truncated",
    "UnknownDevice",
    "UnknownMethod",
    "UnknownOp",
    "UnknownType",
    "WireError",
    "call_id",
    "check_ack",
    "check_boot",
    "check_call",
    "check_envelope",
    "check_events",
    "check_host_ctl",
    "check_host_req",
    "decode",
    "encode",
    "is_ack",
    "is_bridge_run",
]


# --------------------------------------------------------------------------- errors


class WireError(ValueError):
    """Input refused by the contract; `kind` is its name in PROTOCOL.md "Errors"."""

    kind = "bad_envelope"


class Truncated(WireError):
    kind = "truncated"


class TooLarge(WireError):
    kind = "too_large"


class TooDeep(WireError):
    kind = "too_deep"


class BadType(WireError):
    kind = "bad_type"


class BadEnvelope(WireError):
    kind = "bad_envelope"


class UnknownType(WireError):
    kind = "unknown_type"


class UnknownOp(WireError):
    kind = "unknown_op"


class UnknownMethod(WireError):
    kind = "unknown_method"


class UnknownDevice(WireError):
    kind = "unknown_device"


class DeviceOffline(WireError):
    """A host request for a device whose last status says offline: not sent on, and
    `detail` (`since`, Unix ms) goes to the host with the refusal."""

    kind = "device_offline"

    def __init__(self, msg: str, since_ms: int) -> None:
        super().__init__(msg)
        self.detail = {"since": since_ms}


class NoScope(WireError):
    """A host request its scope ticket could not serve: the device's agent keeps state
    per conversation and the request names none (`conv`). Refused before it is sent on,
    where its run would fail loading that state."""

    kind = "no_scope"


# Everything the bridge refuses carries `.kind`; BadTopic and TokenError live next to
# the code that raises them (topics.py, tokens.py) and are re-exported here so a caller
# catches one tuple.
REFUSALS: tuple[type[ValueError], ...] = (WireError, BadTopic, TokenError)

# The kind of a refusal that is not about the payload: a retained message on a topic the
# bridge acts on (PROTOCOL.md "Errors"); refused before anything is decoded.
RETAINED = "retained"


# --------------------------------------------------------------------------- limits


@dataclass(frozen=True)
class Limits:
    """Decode limits (PROTOCOL.md "Limits"); the same numbers a board sends in hello.

    `window` and `chunk` are not decode limits but how a board takes an RPC stream
    (PROTOCOL.md "RPC"): how many chunks of one call the bridge may have unacknowledged,
    and the most text bytes one chunk carries. They ride here because they come from the
    same hello and reach the RPC layer by the same path; decoding ignores them.
    """

    # The contract's decode limits, defined once in the board's codec.
    max_payload: int = codec.MAX_PAYLOAD
    max_str: int = codec.MAX_STR
    max_items: int = codec.MAX_ITEMS
    max_depth: int = codec.MAX_DEPTH
    # A board that leaves them out of its hello gets the board runtime's own defaults.
    window: int = WINDOW
    chunk: int = CHUNK

    def __post_init__(self) -> None:
        for name in ("max_payload", "max_str", "max_items", "max_depth", "window", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive int, not {value!r}")

    @classmethod
    def from_hello(cls, limits: Mapping[str, Any]) -> Limits:
        """The limits a board announced in its hello
        (`{payload, str, items, depth, ring, window, chunk}`).

        A key the board left out keeps what the board runtime receives by default
        (BOARD_DEFAULTS: a 4.5 KiB payload, strings 512 bytes shorter, the room of a
        request's envelope, as edge_runtime/runs.py announces them); a value that is not a
        positive int makes the hello malformed (BadEnvelope) rather than being guessed at.
        `ring` is the board's replay window, not a decode limit, and is not kept here.
        """
        values: dict[str, int] = {"max_payload": BOARD_DEFAULTS.max_payload}
        for key, name in _HELLO_LIMIT_KEYS:
            if key in limits:
                value = limits[key]
                if not _is_int(value) or value < 1:
                    raise BadEnvelope(f"hello limits {key} must be an int >= 1")
                values[name] = value
        # The board's own rule (runs.py): strings leave a request's envelope room in
        # its buffer, and never less than half of it.
        payload = values["max_payload"]
        values.setdefault("max_str", min(max(payload - 512, payload // 2), codec.MAX_STR))
        return cls(**values)


# Hello's `limits` keys and the Limits fields they set.
_HELLO_LIMIT_KEYS = (
    ("payload", "max_payload"),
    ("str", "max_str"),
    ("items", "max_items"),
    ("depth", "max_depth"),
    ("window", "window"),
    ("chunk", "chunk"),
)

# What the bridge reads from a board (the contract's decode limits).
DEFAULT_LIMITS = Limits()
# What a board receives when its hello has not said (edge_runtime.events.RX_PAYLOAD): the
# limits the bridge sizes its answers to for a board it has no hello from.
# Its strings leave 512 bytes of the payload for a request's envelope (edge_runtime/runs.py
# _REQ_ENVELOPE; tests/test_wire.py checks the two agree).
BOARD_DEFAULTS = Limits(max_payload=RX_PAYLOAD, max_str=min(RX_PAYLOAD - 512, codec.MAX_STR))
# An error message the bridge writes (a refusal to a host, a failed model call to a
# board) is short and customer-safe.
MAX_ERROR_MSG = 200


# --------------------------------------------------------------------------- codec

# The board's codec (edge_runtime/codec.py, which runs unchanged on CPython) is the one
# implementation of the limits: it checks every declared size and the depth before it
# allocates, so board and bridge refuse the same bytes with the same kind.
_BY_KIND: dict[str, type[WireError]] = {
    cls.kind: cls for cls in (Truncated, TooLarge, TooDeep, BadType)
}
# What the C decoder could not or would not take: decided again by the board's codec.
_ASK_THE_CODEC = object()


def decode(payload: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode one msgpack payload within `limits`, or raise a WireError naming the kind."""
    obj = _c_decode(payload, limits)
    if obj is _ASK_THE_CODEC:
        try:
            obj = codec.decode(
                payload, limits.max_payload, limits.max_str, limits.max_items, limits.max_depth
            )
        except codec.CodecError as e:
            raise _BY_KIND.get(e.kind, BadType)(str(e)) from e
    if isinstance(obj, dict):
        for key in obj:
            if not isinstance(key, str):
                raise BadType(f"map key {key!r} is not a str")
    return obj


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError("ext types are not part of the contract")


def _c_decode(payload: bytes | bytearray | memoryview, limits: Limits) -> Any:
    """The C msgpack decoder held to the codec's limits, for the bridge's hot path.

    The pure-Python codec costs about 10 us per event on CPython against 1 us for the C
    one (benchmarks/bench_codec.py). The C decoder checks each declared length against
    the same limits before it allocates, and the payload size bounds the rest; nesting
    it does not bound below its own stack, so depth is checked after. Whatever it
    refuses, or decodes deeper than the limit, is handed to the board's codec, which
    names the kind: a refusal reads the same on board and bridge
    (tests/test_codec_crosscheck.py checks the two agree on mangled payloads).
    """
    if len(payload) > limits.max_payload:
        return _ASK_THE_CODEC
    try:
        obj = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=False,
            ext_hook=_no_ext,
            timestamp=0,
            max_str_len=limits.max_str,
            max_bin_len=limits.max_str,
            max_array_len=limits.max_items,
            max_map_len=limits.max_items,
            max_ext_len=0,
        )
    except (ValueError, TypeError):  # msgpack's refusals; an unhashable map key
        return _ASK_THE_CODEC
    # Nesting needs a container header byte per level, so a payload with no more bytes
    # that could be one than the limit cannot be too deep: one C pass instead of a walk
    # of every container (a tenth of an event's cost), for nearly every event.
    if len(bytes(payload).translate(None, _NOT_CONTAINER_HEADS)) <= limits.max_depth:
        return obj
    return _ASK_THE_CODEC if _deeper_than(obj, limits.max_depth) else obj


# Every byte but those that may head a container: fixmap 0x80-0x8f, fixarray 0x90-0x9f,
# array 16/32 0xdc-0xdd, map 16/32 0xde-0xdf (string bytes in that range only make the
# count an overestimate).
_NOT_CONTAINER_HEADS = bytes(b for b in range(256) if not (0x80 <= b <= 0x9F or 0xDC <= b <= 0xDF))


def _deeper_than(obj: Any, limit: int) -> bool:
    # Containers only; a top-level one is depth 1, as in the codec.
    stack: list[tuple[Any, int]] = [(obj, 1)] if isinstance(obj, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def encode(obj: Any) -> bytes:
    """Encode one payload; str stays str and bytes stays bin on the wire."""
    return cast(bytes, msgpack.packb(obj, use_bin_type=True))


# --------------------------------------------------------------------------- shapes


def _is_int(value: object) -> TypeGuard[int]:
    # msgpack true/false decode to bool, which Python counts as int; the contract does not.
    return isinstance(value, int) and not isinstance(value, bool)


def _need_map(obj: object, what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise BadEnvelope(f"{what} must be a map, not {type(obj).__name__}")
    return obj


def _opt_str(m: Mapping[str, Any], key: str, what: str) -> str | None:
    value = m.get(key)
    if value is not None and not isinstance(value, str):
        raise BadEnvelope(f"{what} key {key!r} must be a str")
    return value


def _opt_int(m: Mapping[str, Any], key: str, what: str) -> int | None:
    value = m.get(key)
    if value is not None and not _is_int(value):
        raise BadEnvelope(f"{what} key {key!r} must be an int")
    return value


# The streams that are not runs: the board's device stream (DEVICE_RUN, "_", from
# edge_runtime.events) and the bridge's own stream of answers to hosts on P/h/T/D/evt.
BRIDGE_RUN = "_b"


def is_bridge_run(run: str) -> bool:
    """Is `run` a stream id of the bridge's own: `_b`, and every id that begins with "_"
    but the board's device stream "_" (a board's runs are `<boot>.<n>`). Events under
    them reach hosts from the bridge alone: a board's are refused."""
    return run.startswith("_") and run != DEVICE_RUN


# The event types of the contract, from the board's one space-separated str.
EVENT_TYPES = frozenset(TYPE_NAMES.split())


def check_envelope(obj: object, *, strict_types: bool = True) -> dict[str, Any]:
    """Check one event envelope (PROTOCOL.md "Event envelope") and return it.

    `strict_types=False` accepts an event type this code does not know (hosts: a host
    older than its bridge must still fold the stream; the bridge, which reads boards,
    is the one that refuses unknown types). Every other rule is the same on both sides.
    """
    env = _need_map(obj, "event envelope")
    r, i, t, ts, d = (env.get(k) for k in ("r", "i", "t", "ts", "d"))
    if not isinstance(r, str) or not 0 < len(r) <= MAX_ID:
        raise BadEnvelope(f"event needs a run id r: a str of 1..{MAX_ID} chars")
    if not _is_int(i) or i < 1:
        raise BadEnvelope("event needs an id i: an int >= 1")
    if not isinstance(t, str):
        raise BadEnvelope("event needs a type t: a str")
    if strict_types and t not in EVENT_TYPES:
        raise UnknownType(f"unknown event type {t[:64]!r}")
    if not _is_int(ts):
        raise BadEnvelope("event needs a board clock ts: an int")
    if not isinstance(d, dict):
        raise BadEnvelope("event needs its fields d: a map")
    _opt_str(env, "n", "event")
    _opt_int(env, "a", "event")
    _opt_int(env, "k", "event")
    if t == "error" and d.get("kind") == "gap":
        # A gap report moves the bridge's expected id; its range must be usable.
        lo, hi = d.get("from"), d.get("to")
        if not _is_int(lo) or not _is_int(hi) or not 1 <= lo <= hi:
            raise BadEnvelope("a gap error needs ints from and to with 1 <= from <= to")
    return env


def check_events(obj: object, *, strict_types: bool = True) -> list[dict[str, Any]]:
    """An `evt` payload is one envelope or a non-empty list of them; return the list."""
    if isinstance(obj, list):
        if not obj:
            raise BadEnvelope("an empty event batch")
        return [check_envelope(e, strict_types=strict_types) for e in obj]
    return [check_envelope(obj, strict_types=strict_types)]


@dataclass(frozen=True)
class Call:
    """An RPC call `{c, m, a, r}` from a board."""

    c: int | str
    m: str
    a: dict[str, Any]
    r: str | None


# A call id is kept as a key while its call is in flight and, for spotting a repeated
# call, some time after (server_bridge/rpc.py): bounded like every id (MAX_ID, from
# edge_runtime.events), so a board cannot make the bridge keep kilobytes per call.


def call_id(obj: object) -> int | str | None:
    """The call id of a payload, if it has a usable one (for answering a refusal)."""
    if isinstance(obj, dict):
        c = obj.get("c")
        if _is_int(c) or (isinstance(c, str) and 0 < len(c) <= MAX_ID):
            return c
    return None


def _need_call_id(m: Mapping[str, Any], what: str) -> int | str:
    c = call_id(m)
    if c is None:
        raise BadEnvelope(f"{what} needs a call id c: an int or a str of 1..{MAX_ID} chars")
    return c


def check_call(obj: object) -> Call:
    m = _need_map(obj, "rpc call")
    c = _need_call_id(m, "rpc call")
    method = m.get("m")
    if not isinstance(method, str):
        raise BadEnvelope("rpc call needs a method m: a str")
    args = m.get("a", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise BadEnvelope("rpc call arguments a must be a map")
    return Call(c, method, args, _opt_str(m, "r", "rpc call"))


@dataclass(frozen=True)
class Ack:
    """A board's `{c, ack}` on P/d/D/rpc: it has consumed chunks 1..s of call c; with
    `stop` it wants no more of it (its run ended before the call did)."""

    c: int | str
    s: int
    stop: bool = False


def is_ack(obj: object) -> bool:
    """Whether a decoded rpc payload is meant as an ack: an `ack` key and no method.

    Said before it is checked, so a malformed ack is refused as one (never answered:
    an ack is not a call, and answering it would be a message no call waits for).
    """
    return isinstance(obj, dict) and "ack" in obj and "m" not in obj


def check_ack(obj: object) -> Ack:
    m = _need_map(obj, "rpc ack")
    c = _need_call_id(m, "rpc ack")
    s = m.get("ack")
    if not _is_int(s) or s < 0:
        raise BadEnvelope("rpc ack needs ack: an int >= 0")
    stop = m.get("stop", False)
    if not isinstance(stop, bool):
        raise BadEnvelope("rpc ack stop must be a bool")
    return Ack(c, s, stop)


# A board's boot id (PROTOCOL.md "Boot id"): 8 hex digits drawn at each boot; up to 16
# accepted, lower case, so it can stay a plain string key and prefix of run ids.
MAX_BOOT = 16
_BOOT = re.compile(rf"[0-9a-f]{{1,{MAX_BOOT}}}\Z")


def check_boot(m: Mapping[str, Any], what: str) -> str | None:
    """The `boot` of a status or hello map: None when absent, else 1..16 chars [0-9a-f]."""
    boot = m.get("boot")
    if boot is None:
        return None
    if not isinstance(boot, str) or not _BOOT.match(boot):
        raise BadEnvelope(f"{what} boot must be a str of 1..{MAX_BOOT} chars [0-9a-f]")
    return boot


# Id-like strings a host sends (req, conv, r, call) are echoed into events, kept as keys
# (the board's idempotency ring, the bridge's refusal events) and matched on: they are
# bounded by the one MAX_ID the board checks too (edge_runtime.events), so a host cannot
# make either side store or echo kilobytes per id. Free text (`input`, a tool `output`)
# is bounded only by the decode limit on strings. A cancel's `reason` is free text the
# board puts into `run.cancelled`: cut to MAX_REASON, the board's own cut.


def _host_id(m: Mapping[str, Any], key: str, what: str) -> str:
    value = m.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID:
        raise BadEnvelope(f"{what} needs {key}: a str of 1..{MAX_ID} chars")
    return value


def _opt_host_id(m: Mapping[str, Any], key: str, what: str) -> str | None:
    return None if m.get(key) is None else _host_id(m, key, what)


@dataclass(frozen=True)
class HostReq:
    """A host's `P/h/T/D/req`; `tok` is still unverified here."""

    req: str
    input: str
    tok: object
    conv: str | None = None
    ttl: int | None = None


def check_host_req(obj: object) -> HostReq:
    m = _need_map(obj, "host req")
    req = _host_id(m, "req", "host req")
    text = m.get("input")
    if not isinstance(text, str):
        raise BadEnvelope("host req needs input: a str")
    return HostReq(
        req=req,
        input=text,
        tok=m.get("tok"),
        conv=_opt_host_id(m, "conv", "host req"),
        ttl=_opt_int(m, "ttl", "host req"),
    )


# The ctl ops a host may send and the keys each keeps. Everything else in the payload
# (tok, usr, ten, device, ...) is dropped here, so nothing a host writes can reach the
# board except these fields. `replay` never reaches the board: the bridge answers it
# from its own window of the run's events (PROTOCOL.md "Replay").
HOST_CTL_KEYS: dict[str, tuple[str, ...]] = {
    "cancel": ("r", "req", "reason"),
    "tool": ("r", "call", "output", "failed"),
    "approve": ("r", "call", "ok"),
    "replay": ("r", "after"),
}


@dataclass(frozen=True)
class HostCtl:
    op: str
    fields: dict[str, Any]
    tok: object


def check_host_ctl(obj: object) -> HostCtl:
    m = _need_map(obj, "host ctl")
    op = m.get("op")
    if not isinstance(op, str):
        raise BadEnvelope("host ctl needs an op: a str")
    keys = HOST_CTL_KEYS.get(op)
    if keys is None:
        raise UnknownOp(f"unknown ctl op {op[:64]!r}")
    if op == "cancel" and m.get("r") is None:
        # By request, for a host that gave up before its run started (it knows no run
        # id yet): the board takes it out of its queue, or starts nothing when it comes.
        _host_id(m, "req", "ctl cancel (without r)")
    else:
        _host_id(m, "r", f"ctl {op}")
    if op in ("tool", "approve"):
        _host_id(m, "call", f"ctl {op}")
    if op == "approve" and not isinstance(m.get("ok"), bool):
        raise BadEnvelope("ctl approve needs ok: a bool")
    if op == "replay":
        after = m.get("after")
        if not _is_int(after) or after < 0:
            raise BadEnvelope("ctl replay needs after: an int >= 0")
    fields = {"op": op}
    fields.update({k: m[k] for k in keys if k in m})
    if fields.get("r") is not None:
        fields.pop("req", None)  # a cancel names its run or its request, never both
    if op == "cancel" and "reason" in fields:
        reason = fields["reason"]
        if reason is None:
            del fields["reason"]
        elif not isinstance(reason, str):
            raise BadEnvelope("ctl cancel reason must be a str")
        else:
            # Cut, not refused: a cancel must not fail over the length of its prose.
            fields["reason"] = reason[:MAX_REASON]
    return HostCtl(op, fields, m.get("tok"))
