"""The msgpack codec of the board link and the shapes of the wire contract.

docs/PROTOCOL.md, "Limits" and "Errors": every payload the bridge reads is decoded
here with explicit limits, checked before anything is allocated, and every refusal is
an exception whose `.kind` is the contract's error kind — the same names the board
uses, so a refusal reads the same on both sides.

Decoding is two passes. A structural scan walks the msgpack headers without building
any object: it checks the declared length of every str/bin/array/map against its limit
and the nesting depth against the depth limit, and refuses ext types, the reserved byte
and trailing bytes. Only input that passes is handed to `msgpack.unpackb`, which is
given the same limits again (defence in depth: a scan bug must not become an
allocation). The scan is what makes the error kinds exact: `msgpack.unpackb` alone
reports a 4 GiB declared string in a 5-byte payload as "incomplete input", while the
contract says a declared size over the limit is `too_large`, whatever follows it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import msgpack
from msgpack import exceptions as mp_exc

from edge_runtime.events import TYPES
from server_bridge.tokens import TokenError
from server_bridge.topics import BadTopic

__all__ = [
    "KINDS",
    "REFUSALS",
    "BadEnvelope",
    "BadTopic",
    "BadType",
    "Call",
    "HostCtl",
    "HostReq",
    "Limits",
    "TokenError",
    "TooDeep",
    "TooLarge",
    "Truncated",
    "UnknownDevice",
    "UnknownMethod",
    "UnknownOp",
    "UnknownType",
    "WireError",
    "check_call",
    "check_envelope",
    "check_events",
    "check_host_ctl",
    "check_host_req",
    "decode",
    "encode",
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


# Everything the bridge refuses carries `.kind`; BadTopic and TokenError live next to
# the code that raises them (topics.py, tokens.py) and are re-exported here so a caller
# catches one tuple.
REFUSALS: tuple[type[ValueError], ...] = (WireError, BadTopic, TokenError)

KINDS: tuple[str, ...] = (
    Truncated.kind,
    TooLarge.kind,
    TooDeep.kind,
    BadType.kind,
    BadEnvelope.kind,
    UnknownType.kind,
    UnknownOp.kind,
    UnknownMethod.kind,
    BadTopic.kind,
    TokenError.kind,
    UnknownDevice.kind,
)


# --------------------------------------------------------------------------- limits


@dataclass(frozen=True)
class Limits:
    """Decode limits (PROTOCOL.md "Limits"); the same numbers a board sends in hello."""

    max_payload: int = 16384
    max_str: int = 8192
    max_items: int = 256
    max_depth: int = 16

    def __post_init__(self) -> None:
        for name in ("max_payload", "max_str", "max_items", "max_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive int, not {value!r}")


DEFAULT_LIMITS = Limits()


# --------------------------------------------------------------------------- scan

# Header byte -> number of bytes of the big-endian length that follows, for the
# variable-length kinds; fixed-size scalars -> number of payload bytes to skip.
_STR_LEN = {0xD9: 1, 0xDA: 2, 0xDB: 4}
_BIN_LEN = {0xC4: 1, 0xC5: 2, 0xC6: 4}
_ARRAY_LEN = {0xDC: 2, 0xDD: 4}
_MAP_LEN = {0xDE: 2, 0xDF: 4}
_FIXED = {
    0xCA: 4, 0xCB: 8,  # float32/64
    0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,  # uint8..64
    0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,  # int8..64
}  # fmt: skip
_EXT = frozenset((0xC7, 0xC8, 0xC9, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8))


def _scan(buf: bytes, limits: Limits) -> None:
    """Walk the msgpack structure of `buf` without building objects; raise on refusal.

    Iterative on purpose: a hostile payload of nested 1-byte arrays must hit the depth
    limit, not Python's recursion limit.
    """
    n = len(buf)
    pos = 0
    # Stack of "items still to read" per open container; the bottom entry is the single
    # top-level object, so len(stack) - 1 is the current nesting depth.
    stack = [1]

    def length(width: int) -> int:
        nonlocal pos
        if pos + width > n:
            raise Truncated(f"payload ends inside a length header at byte {pos}")
        value = int.from_bytes(buf[pos : pos + width], "big")
        pos += width
        return value

    def skip(count: int) -> None:
        nonlocal pos
        if pos + count > n:
            raise Truncated(f"payload ends before its declared {count} bytes at byte {pos}")
        pos += count

    def open_container(count: int, what: str) -> None:
        if count > limits.max_items:
            raise TooLarge(f"{what} of {count} entries over the limit {limits.max_items}")
        stack.append(count * 2 if what == "map" else count)
        if len(stack) - 1 > limits.max_depth:
            raise TooDeep(f"nesting deeper than the limit {limits.max_depth}")

    while stack:
        if stack[-1] == 0:
            stack.pop()
            continue
        stack[-1] -= 1
        if pos >= n:
            raise Truncated(f"payload ends at byte {pos} before its declared contents")
        b = buf[pos]
        pos += 1
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
            continue  # fixint, nil, bool: the header is the whole value
        if 0x80 <= b <= 0x8F:
            open_container(b & 0x0F, "map")
        elif 0x90 <= b <= 0x9F:
            open_container(b & 0x0F, "array")
        elif 0xA0 <= b <= 0xBF:
            skip(b & 0x1F)
        elif b in _STR_LEN or b in _BIN_LEN:
            what = "str" if b in _STR_LEN else "bin"
            size = length(_STR_LEN.get(b) or _BIN_LEN[b])
            # The declared size is judged before the bytes are looked for: a 4 GiB
            # declaration is too_large, not merely truncated.
            if size > limits.max_str:
                raise TooLarge(f"{what} of {size} bytes over the limit {limits.max_str}")
            skip(size)
        elif b in _ARRAY_LEN:
            open_container(length(_ARRAY_LEN[b]), "array")
        elif b in _MAP_LEN:
            open_container(length(_MAP_LEN[b]), "map")
        elif b in _FIXED:
            skip(_FIXED[b])
        elif b in _EXT:
            raise BadType(f"msgpack ext type (byte 0x{b:02x}) is not used by the contract")
        else:  # 0xC1, the one reserved byte
            raise BadType(f"reserved msgpack byte 0x{b:02x}")
    if pos != n:
        raise BadType(f"{n - pos} trailing bytes after the payload's object")


def _no_ext(code: int, data: bytes) -> object:
    raise BadType(f"msgpack ext type {code} is not used by the contract")


# --------------------------------------------------------------------------- codec


def decode(payload: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode one msgpack payload within `limits`, or raise a WireError naming the kind."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise BadType(f"payload must be bytes, not {type(payload).__name__}")
    # Size first: nothing about an oversized payload is worth looking at.
    if len(payload) > limits.max_payload:
        raise TooLarge(f"payload of {len(payload)} bytes over the limit {limits.max_payload}")
    buf = bytes(payload)
    _scan(buf, limits)
    try:
        obj = msgpack.unpackb(
            buf,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=limits.max_str,
            max_bin_len=limits.max_str,
            max_array_len=limits.max_items,
            max_map_len=limits.max_items,
            max_ext_len=0,
            ext_hook=_no_ext,
        )
    # The scan should have caught all of these; they stay mapped so that a disagreement
    # between scan and library is still a named refusal, never an unhandled error.
    except WireError:
        raise
    except mp_exc.ExtraData as e:
        raise BadType("trailing bytes after the payload's object") from e
    except mp_exc.StackError as e:
        raise TooDeep("nesting too deep for the decoder") from e
    except mp_exc.FormatError as e:
        raise BadType("reserved msgpack byte") from e
    except UnicodeDecodeError as e:
        raise BadType("a str that is not valid UTF-8") from e
    except RecursionError as e:
        raise TooDeep("nesting too deep for the decoder") from e
    except ValueError as e:
        text = str(e)
        if "incomplete input" in text:
            raise Truncated("payload ends before its declared contents") from e
        if "exceeds max" in text:
            raise TooLarge(text) from e
        raise BadType(text) from e
    except TypeError as e:  # e.g. an unhashable map key
        raise BadType(str(e)) from e
    if isinstance(obj, dict):
        for key in obj:
            if not isinstance(key, str):
                raise BadType(f"map key {key!r} is not a str")
    return obj


def encode(obj: Any) -> bytes:
    """Encode one payload; str stays str and bytes stays bin on the wire."""
    data = msgpack.packb(obj, use_bin_type=True)
    assert isinstance(data, bytes)
    return data


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


MAX_RUN_ID = 128


def check_envelope(obj: object) -> dict[str, Any]:
    """Check one event envelope (PROTOCOL.md "Event envelope") and return it."""
    env = _need_map(obj, "event envelope")
    r, i, t, ts, d = (env.get(k) for k in ("r", "i", "t", "ts", "d"))
    if not isinstance(r, str) or not 0 < len(r) <= MAX_RUN_ID:
        raise BadEnvelope(f"event needs a run id r: a str of 1..{MAX_RUN_ID} chars")
    if not _is_int(i) or i < 1:
        raise BadEnvelope("event needs an id i: an int >= 1")
    if not isinstance(t, str):
        raise BadEnvelope("event needs a type t: a str")
    if t not in TYPES:
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


def check_events(obj: object) -> list[dict[str, Any]]:
    """An `evt` payload is one envelope or a non-empty list of them; return the list."""
    if isinstance(obj, list):
        if not obj:
            raise BadEnvelope("an empty event batch")
        return [check_envelope(e) for e in obj]
    return [check_envelope(obj)]


@dataclass(frozen=True)
class Call:
    """An RPC call `{c, m, a, r}` from a board."""

    c: int | str
    m: str
    a: dict[str, Any]
    r: str | None


def call_id(obj: object) -> int | str | None:
    """The call id of a payload, if it has a usable one (for answering a refusal)."""
    if isinstance(obj, dict):
        c = obj.get("c")
        if (_is_int(c) or isinstance(c, str)) and c is not None:
            return c
    return None


def check_call(obj: object) -> Call:
    m = _need_map(obj, "rpc call")
    c = call_id(m)
    if c is None:
        raise BadEnvelope("rpc call needs a call id c: an int or str")
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
class HostReq:
    """A host's `P/h/T/D/req`; `tok` is still unverified here."""

    req: str
    input: str
    tok: object
    conv: str | None = None
    ttl: int | None = None


def check_host_req(obj: object) -> HostReq:
    m = _need_map(obj, "host req")
    req, text = m.get("req"), m.get("input")
    if not isinstance(req, str) or not req:
        raise BadEnvelope("host req needs a request id req: a non-empty str")
    if not isinstance(text, str):
        raise BadEnvelope("host req needs input: a str")
    return HostReq(
        req=req,
        input=text,
        tok=m.get("tok"),
        conv=_opt_str(m, "conv", "host req"),
        ttl=_opt_int(m, "ttl", "host req"),
    )


# The ctl ops a host may send and the keys each carries on to the board. Everything
# else in the payload (tok, usr, ten, device, ...) is dropped here, so nothing a host
# writes can reach the board except these fields. `replay` is the bridge's own op.
HOST_CTL_KEYS: dict[str, tuple[str, ...]] = {
    "cancel": ("r",),
    "tool": ("r", "call", "output", "failed"),
    "approve": ("r", "call", "ok"),
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
    if not isinstance(m.get("r"), str):
        raise BadEnvelope(f"ctl {op} needs a run id r: a str")
    if op in ("tool", "approve") and not isinstance(m.get("call"), str):
        raise BadEnvelope(f"ctl {op} needs a call id: a str")
    if op == "approve" and not isinstance(m.get("ok"), bool):
        raise BadEnvelope("ctl approve needs ok: a bool")
    fields = {"op": op}
    fields.update({k: m[k] for k in keys if k in m})
    return HostCtl(op, fields, m.get("tok"))
