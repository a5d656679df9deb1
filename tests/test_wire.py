"""The bridge's codec and contract shapes: every refusal has its PROTOCOL.md kind."""

from __future__ import annotations

import struct

import msgpack
import pytest

from server_bridge import wire
from server_bridge.tokens import TokenError
from server_bridge.topics import BadTopic
from server_bridge.wire import Limits


def env(**over: object) -> dict[str, object]:
    e: dict[str, object] = {"r": "run1", "i": 1, "t": "msg.delta", "ts": 5, "d": {"m": 1}}
    e.update(over)
    return e


def nested(depth: int) -> bytes:
    """`depth` nested one-element arrays around an int, as raw msgpack."""
    return b"\x91" * depth + b"\x01"


# ---------------------------------------------------------------- decode: happy path


def test_roundtrip_of_a_contract_payload() -> None:
    obj = {"c": 7, "m": "llm.complete", "a": {"messages": [{"role": "user", "content": "hé"}]}}
    assert wire.decode(wire.encode(obj)) == obj


def test_bytes_stay_bytes_and_str_stays_str() -> None:
    assert wire.decode(wire.encode({"b": b"\x00\x01", "s": "x"})) == {"b": b"\x00\x01", "s": "x"}


def test_every_scalar_kind_passes_the_scan() -> None:
    obj: list[object] = [
        None,
        True,
        False,
        0,
        127,
        -1,
        -32,
        255,
        65535,
        2**32,
        -(2**40),
        1.5,
        "",
        b"",
        {},
        [],
    ]
    assert wire.decode(msgpack.packb(obj, use_bin_type=True)) == obj
    assert wire.decode(msgpack.packb(1.5, use_single_float=True)) == 1.5


def test_depth_at_the_limit_is_accepted() -> None:
    assert wire.decode(nested(16)) is not None


# ---------------------------------------------------------------- decode: refusals


@pytest.mark.parametrize(
    "payload",
    [
        b"",  # nothing at all
        b"\x82\xa1a",  # map of 2 that ends after one key
        b"\xa5abc",  # str of 5 with 3 bytes
        b"\xcd\x01",  # uint16 with one byte
        b"\xda\x00",  # str16 header cut inside its length
        b"\x93\x01\x02",  # array of 3 with 2
    ],
)
def test_truncated(payload: bytes) -> None:
    with pytest.raises(wire.Truncated) as e:
        wire.decode(payload)
    assert e.value.kind == "truncated"


def test_4gib_declared_str_is_too_large_not_allocated() -> None:
    with pytest.raises(wire.TooLarge) as e:
        wire.decode(b"\xdb\xff\xff\xff\xff")
    assert e.value.kind == "too_large"


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
        b"\xdd\xff\xff\xff\xff",  # array32 of 4 G entries
        b"\xdf\x00\x01\x00\x00",  # map32 of 65536 entries
        b"\xda\x20\x01" + b"x" * 8193,  # str16 one over the str limit
        msgpack.packb(list(range(257))),  # array one over the item limit
    ],
)
def test_declared_sizes_over_limits(payload: bytes) -> None:
    with pytest.raises(wire.TooLarge):
        wire.decode(payload)


def test_payload_over_limit_is_refused_before_reading() -> None:
    payload = msgpack.packb("x" * 100)
    with pytest.raises(wire.TooLarge, match="payload"):
        wire.decode(payload, Limits(max_payload=50))


def test_limits_are_configurable() -> None:
    with pytest.raises(wire.TooLarge):
        wire.decode(msgpack.packb("abcdef"), Limits(max_str=5))
    with pytest.raises(wire.TooLarge):
        wire.decode(msgpack.packb({"a": 1, "b": 2}), Limits(max_items=1))
    with pytest.raises(wire.TooDeep):
        wire.decode(nested(3), Limits(max_depth=2))


@pytest.mark.parametrize("depth", [17, 100, 16000])
def test_too_deep(depth: int) -> None:
    with pytest.raises(wire.TooDeep) as e:
        wire.decode(nested(depth))
    assert e.value.kind == "too_deep"


def test_deep_maps_count_too() -> None:
    payload = b"\x81\xa1k" * 17 + b"\x01"
    with pytest.raises(wire.TooDeep):
        wire.decode(payload)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xd4\x01\x00",  # fixext1
        b"\xc7\x01\x05\x00",  # ext8
        b"\xd6\xff" + struct.pack(">I", 0),  # the timestamp ext
        b"\x81\xa1a\xd5\x02\x00\x00",  # ext nested in a map
        b"\xc1",  # the reserved byte
        b"\x01\x02",  # trailing bytes
        b"\x80\x80",  # trailing empty map
        b"\xa2\xff\xfe",  # a str that is not UTF-8
        b"\x81\x01\x02",  # int map key
        b"\x81\xc4\x01k\x02",  # bin map key at top level
    ],
)
def test_bad_type(payload: bytes) -> None:
    with pytest.raises(wire.BadType) as e:
        wire.decode(payload)
    assert e.value.kind == "bad_type"


def test_non_bytes_payload() -> None:
    with pytest.raises(wire.BadType):
        wire.decode("text")  # type: ignore[arg-type]


def test_every_error_is_a_value_error_with_a_contract_kind() -> None:
    kinds = {
        wire.Truncated: "truncated",
        wire.TooLarge: "too_large",
        wire.TooDeep: "too_deep",
        wire.BadType: "bad_type",
        wire.BadEnvelope: "bad_envelope",
        wire.UnknownType: "unknown_type",
        wire.UnknownOp: "unknown_op",
        wire.UnknownMethod: "unknown_method",
        wire.UnknownDevice: "unknown_device",
        wire.BadTopic: "bad_topic",
        wire.TokenError: "bad_token",
    }
    for cls, kind in kinds.items():
        assert issubclass(cls, ValueError)
        assert getattr(cls, "kind") == kind  # noqa: B009 - the REFUSALS tuple is typed loosely
        assert issubclass(cls, wire.REFUSALS)
    assert wire.BadTopic is BadTopic and wire.TokenError is TokenError


# ---------------------------------------------------------------- envelopes


def test_one_envelope_and_a_batch() -> None:
    assert wire.check_envelope(env()) == env()
    assert wire.check_events(env()) == [env()]
    assert wire.check_events([env(i=1), env(i=2)]) == [env(i=1), env(i=2)]


def test_optional_node_keys() -> None:
    e = env(n="loop/llm", a=1, k=2)
    assert wire.check_envelope(e) is e


def test_device_stream_run_id() -> None:
    assert wire.check_envelope(env(r="_", t="error", d={"kind": "busy", "msg": "x"}))


@pytest.mark.parametrize(
    "obj",
    [
        [1, 2],
        "evt",
        None,
        [],
        env(r=None),
        env(r=""),
        env(r="x" * 129),
        env(i=0),
        env(i="1"),
        env(i=True),
        env(t=3),
        env(ts=1.5),
        env(d=[]),
        env(n=3),
        env(a="1"),
        {"i": 1},
        env(t="error", d={"kind": "gap", "msg": "m", "from": 3}),
        env(t="error", d={"kind": "gap", "msg": "m", "from": 5, "to": 3}),
        env(t="error", d={"kind": "gap", "msg": "m", "from": 0, "to": 3}),
    ],
)
def test_bad_envelope(obj: object) -> None:
    with pytest.raises(wire.BadEnvelope) as e:
        wire.check_events(obj)
    assert e.value.kind == "bad_envelope"


def test_unknown_type() -> None:
    with pytest.raises(wire.UnknownType) as e:
        wire.check_envelope(env(t="run.exploded"))
    assert e.value.kind == "unknown_type"


def test_unknown_types_pass_when_not_strict() -> None:
    # Hosts read with strict_types=False: a newer bridge may forward types they lack.
    assert wire.check_events([env(t="run.exploded")], strict_types=False)[0]["t"] == "run.exploded"
    with pytest.raises(wire.BadEnvelope):
        wire.check_events([env(t="run.exploded", i=0)], strict_types=False)


def test_one_bad_envelope_refuses_the_batch() -> None:
    with pytest.raises(wire.UnknownType):
        wire.check_events([env(i=1), env(i=2, t="nope")])


# ---------------------------------------------------------------- calls, host messages


def test_call() -> None:
    call = wire.check_call({"c": 3, "m": "llm.complete", "a": {"x": 1}, "r": "run1"})
    assert (call.c, call.m, call.a, call.r) == (3, "llm.complete", {"x": 1}, "run1")
    assert wire.check_call({"c": "k", "m": "x"}).a == {}


@pytest.mark.parametrize(
    "obj",
    [
        [1],
        {"m": "x"},
        {"c": True, "m": "x"},
        {"c": 1},
        {"c": 1, "m": "x", "a": [1]},
        {"c": "", "m": "x"},
        {"c": "k" * (wire.MAX_ID + 1), "m": "x"},
    ],
)
def test_bad_call(obj: object) -> None:
    with pytest.raises(wire.BadEnvelope):
        wire.check_call(obj)


def test_call_id_of_unreadable_calls() -> None:
    assert wire.call_id({"c": 4}) == 4
    assert wire.call_id({"c": "k" * wire.MAX_ID}) == "k" * wire.MAX_ID
    assert wire.call_id({"c": True}) is None
    assert wire.call_id({"c": "k" * (wire.MAX_ID + 1)}) is None  # kept as a key: bounded
    assert wire.call_id([4]) is None


def test_ack() -> None:
    assert wire.check_ack({"c": 3, "ack": 0}) == wire.Ack(3, 0)
    assert wire.check_ack({"c": "k", "ack": 12, "extra": 1}) == wire.Ack("k", 12)
    # An ack is a map with `ack` and no method; a call with a stray `ack` key is a call.
    assert wire.is_ack({"c": 3, "ack": "x"}) and wire.is_ack({"ack": 1})
    assert not wire.is_ack({"c": 3, "m": "llm.complete", "ack": 1})
    assert not wire.is_ack({"c": 3}) and not wire.is_ack([3])


@pytest.mark.parametrize(
    "obj",
    [
        {"ack": 1},
        {"c": None, "ack": 1},
        {"c": 1, "ack": -1},
        {"c": 1, "ack": True},
        {"c": 1, "ack": "3"},
        {"c": 1, "ack": 1.0},
        {"c": 1, "ack": None},
    ],
)
def test_bad_ack(obj: object) -> None:
    with pytest.raises(wire.BadEnvelope):
        wire.check_ack(obj)


def test_host_req_keeps_only_its_fields() -> None:
    req = wire.check_host_req(
        {"req": "q1", "input": "hi", "tok": "t", "usr": "admin", "ten": "x", "conv": "c", "ttl": 9}
    )
    assert req == wire.HostReq(req="q1", input="hi", tok="t", conv="c", ttl=9)


@pytest.mark.parametrize(
    "obj", [[], {"input": "x"}, {"req": "", "input": "x"}, {"req": "q", "input": 3},
            {"req": "q", "input": "x", "ttl": "9"},
            {"req": "q" * 65, "input": "x"}, {"req": "q", "input": "x", "conv": "c" * 65},
            {"req": "q", "input": "x", "conv": 7}, {"req": "q", "input": "x", "conv": ""}]
)  # fmt: skip
def test_bad_host_req(obj: object) -> None:
    with pytest.raises(wire.BadEnvelope):
        wire.check_host_req(obj)


def test_host_ctl_ops() -> None:
    ctl = wire.check_host_ctl({"op": "cancel", "r": "run1", "tok": "t", "usr": "admin"})
    assert ctl.fields == {"op": "cancel", "r": "run1"} and ctl.tok == "t"
    ctl = wire.check_host_ctl(
        {"op": "tool", "r": "r", "call": "c1", "output": "21", "failed": False, "by": "x"}
    )
    assert ctl.fields == {"op": "tool", "r": "r", "call": "c1", "output": "21", "failed": False}
    ctl = wire.check_host_ctl({"op": "approve", "r": "r", "call": "c1", "ok": True, "by": "x"})
    assert ctl.fields == {"op": "approve", "r": "r", "call": "c1", "ok": True}


def test_a_cancel_names_its_run_or_else_its_request() -> None:
    # By request: a host that gave up before its run started knows no run id.
    ctl = wire.check_host_ctl({"op": "cancel", "req": "q1", "reason": "gone"})
    assert ctl.fields == {"op": "cancel", "req": "q1", "reason": "gone"}
    # Both: the run, and the request is not passed on (unchecked) beside it.
    assert wire.check_host_ctl({"op": "cancel", "r": "r1", "req": 5}).fields == {
        "op": "cancel",
        "r": "r1",
    }
    for bad in ({"op": "cancel"}, {"op": "cancel", "req": 5}, {"op": "cancel", "req": "q" * 65}):
        with pytest.raises(wire.BadEnvelope):
            wire.check_host_ctl(bad)
    # Only a cancel may name a request instead of a run.
    with pytest.raises(wire.BadEnvelope):
        wire.check_host_ctl({"op": "tool", "req": "q1", "call": "c", "output": "o"})


def test_host_ids_up_to_64_chars_and_input_up_to_the_str_limit() -> None:
    req = wire.check_host_req({"req": "q" * 64, "conv": "c" * 64, "input": "x" * 8000})
    assert (len(req.req), req.conv) == (64, "c" * 64)
    ctl = wire.check_host_ctl({"op": "tool", "r": "r" * 64, "call": "k" * 64, "output": "o"})
    assert ctl.fields["r"] == "r" * 64
    # input is free text, bounded where every string is: by the decode limit.
    with pytest.raises(wire.TooLarge):
        wire.decode(msgpack.packb({"req": "q", "input": "x" * 8193}))


def test_cancel_reason_passes_through_cut_to_size() -> None:
    ctl = wire.check_host_ctl({"op": "cancel", "r": "r1", "reason": "user left"})
    assert ctl.fields == {"op": "cancel", "r": "r1", "reason": "user left"}
    ctl = wire.check_host_ctl({"op": "cancel", "r": "r1", "reason": "z" * 1000})
    assert ctl.fields["reason"] == "z" * wire.MAX_REASON
    assert "reason" not in wire.check_host_ctl({"op": "cancel", "r": "r1", "reason": None}).fields
    with pytest.raises(wire.BadEnvelope):
        wire.check_host_ctl({"op": "cancel", "r": "r1", "reason": 3})
    # Only cancel carries a reason to the board.
    tool = wire.check_host_ctl({"op": "tool", "r": "r", "call": "c", "reason": "x"})
    assert "reason" not in tool.fields


def test_limits_from_hello() -> None:
    # A hello without limits describes a board with the runtime's default receive
    # buffer (edge_runtime.events.RX_PAYLOAD), not the bridge's own decode limits.
    assert wire.Limits.from_hello({}) == wire.BOARD_DEFAULTS
    assert (wire.BOARD_DEFAULTS.max_payload, wire.BOARD_DEFAULTS.max_str) == (4608, 4096)
    # Without `str`, strings leave a request's envelope 512 bytes of the payload, and
    # never less than half of it (the board's own rule).
    assert wire.Limits.from_hello({"payload": 2048}).max_str == 1536
    assert wire.Limits.from_hello({"payload": 600}).max_str == 300
    assert wire.Limits.from_hello({"payload": 65536}).max_str == wire.DEFAULT_LIMITS.max_str
    got = wire.Limits.from_hello({"payload": 4096, "str": 1024, "items": 32, "depth": 8, "ring": 4})
    assert got == wire.Limits(max_payload=4096, max_str=1024, max_items=32, max_depth=8)
    # When absent, the board runtime's own defaults (edge_runtime/rpc.py).
    assert (got.window, got.chunk) == (4, 256)
    flow = wire.Limits.from_hello({"window": 2, "chunk": 64})
    assert (flow.window, flow.chunk, flow.max_str) == (2, 64, 4096)
    for bad in (
        {"str": 0},
        {"payload": "16k"},
        {"depth": True},
        {"items": -1},
        {"window": 0},
        {"chunk": "512"},
        {"window": False},
    ):
        with pytest.raises(wire.BadEnvelope):
            wire.Limits.from_hello(bad)


def test_host_replay_ctl() -> None:
    ctl = wire.check_host_ctl({"op": "replay", "r": "r1", "after": 3, "tok": "t", "usr": "x"})
    assert (ctl.op, ctl.fields, ctl.tok) == ("replay", {"op": "replay", "r": "r1", "after": 3}, "t")
    assert wire.check_host_ctl({"op": "replay", "r": "r1", "after": 0}).fields["after"] == 0
    for bad in ({"r": "r1"}, {"r": "r1", "after": -1}, {"r": "r1", "after": "2"},
                {"r": "r1", "after": True}, {"r": "r1", "after": 1.5}, {"after": 0},
                {"r": "r" * 65, "after": 0}):  # fmt: skip
        with pytest.raises(wire.BadEnvelope):
            wire.check_host_ctl({"op": "replay", **bad})


def test_boot_ids() -> None:
    assert wire.check_boot({"boot": "0a1b2c3d"}, "hello") == "0a1b2c3d"
    assert wire.check_boot({"boot": "f" * wire.MAX_BOOT}, "status") == "f" * 16
    assert wire.check_boot({"st": "online"}, "status") is None
    for bad in ("", "0A1B2C3D", "0a1b2c3g", "f" * 17, 12345678, b"0a1b2c3d", "0a1b 2c3", "0a\n"):
        with pytest.raises(wire.BadEnvelope):
            wire.check_boot({"boot": bad}, "hello")


def test_host_ctl_refusals() -> None:
    with pytest.raises(wire.UnknownOp):
        wire.check_host_ctl({"op": "reboot", "r": "r"})
    with pytest.raises(wire.BadEnvelope):
        wire.check_host_ctl({"op": "cancel"})
    with pytest.raises(wire.BadEnvelope):
        wire.check_host_ctl({"op": "approve", "r": "r", "call": "c1", "ok": "yes"})
    with pytest.raises(wire.BadEnvelope):
        wire.check_host_ctl({"op": "cancel", "r": "r" * 65})
    with pytest.raises(wire.BadEnvelope):
        wire.check_host_ctl({"op": "approve", "r": "r", "call": "c" * 65, "ok": True})
    with pytest.raises(wire.BadEnvelope):
        wire.check_host_ctl({"op": "tool", "r": "r", "call": ["c1"]})


def test_the_bridge_sizes_a_board_without_hello_as_the_board_announces_itself() -> None:
    # The board's default hello limits (edge_runtime/runs.py) and what the bridge assumes
    # for a board it has no hello from (wire.BOARD_DEFAULTS) are one figure, written twice.
    from edge_runtime.agent import Agent
    from edge_runtime.runs import Runtime

    announced = Limits.from_hello(Runtime(Agent("a", "1", "x"), "d1").limits)
    assert (announced.max_payload, announced.max_str) == (
        wire.BOARD_DEFAULTS.max_payload,
        wire.BOARD_DEFAULTS.max_str,
    )
    # A request whose text is as long as announced fits the payload with its envelope.
    assert wire.BOARD_DEFAULTS.max_payload - wire.BOARD_DEFAULTS.max_str >= 300
