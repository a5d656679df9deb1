"""Bytes on the wire for one streamed-text event: Wren's msgpack envelope next to the
same event as AG-UI JSON (TEXT_MESSAGE_CONTENT), with and without the MQTT framing.

    python benchmarks/bench_wire.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edge_runtime import codec  # noqa: E402

TEXT = "hello, world"  # 12 characters
RUN_ID = "5f0c9a1e.1"  # the board's run id shape: <boot id>.<n>
TOPIC_EVT = "wren/v1/d/thermo1/evt"


def mqtt_publish_overhead(topic: str, payload_len: int, qos: int) -> int:
    # Fixed header (1 byte + remaining-length varint) + topic (2 + len) + packet id.
    body = 2 + len(topic.encode()) + (2 if qos else 0) + payload_len
    varint = 1 if body < 128 else 2 if body < 16384 else 3
    return 1 + varint + body - payload_len


def main() -> None:
    # No options; --help says what it measures.
    argparse.ArgumentParser(description=__doc__).parse_args()
    assert len(TEXT) == 12
    envelope = {
        "r": RUN_ID,
        "i": 42,
        "t": "msg.delta",
        "ts": 1764470000123,
        "d": {"m": 1, "text": TEXT},
    }
    wren = codec.encode(envelope)
    agui = {"type": "TEXT_MESSAGE_CONTENT", "messageId": f"{RUN_ID}:1", "delta": TEXT}
    agui_compact = json.dumps(agui, separators=(",", ":")).encode()
    agui_ts = dict(agui, timestamp=1764470000123)
    agui_ts_compact = json.dumps(agui_ts, separators=(",", ":")).encode()
    envelope_json = json.dumps(envelope, separators=(",", ":")).encode()
    print("command: python benchmarks/bench_wire.py")
    print(f"msg.delta with {len(TEXT)} characters of text")
    print(f"{'encoding':44} {'payload B':>9} {'+MQTT QoS1 B':>12} {'ratio':>6}")
    rows = [
        ("wren msgpack envelope", len(wren)),
        ("same envelope as compact JSON", len(envelope_json)),
        ("AG-UI TEXT_MESSAGE_CONTENT JSON (compact)", len(agui_compact)),
        ("AG-UI ... with timestamp (compact)", len(agui_ts_compact)),
    ]
    base = len(wren)
    for name, size in rows:
        framed = size + mqtt_publish_overhead(TOPIC_EVT, size, 1)
        print(f"{name:44} {size:9d} {framed:12d} {size / base:6.2f}")
    print(f"(ratio: payload bytes relative to the wren msgpack envelope; topic {TOPIC_EVT!r})")


if __name__ == "__main__":
    main()
