# The event vocabulary of the wire contract and the per-run emitter.
# TYPES is the one table of event type -> its `d` fields (docs/PROTOCOL.md, "Event
# types"): the emitter refuses a type not in it, and the bridge refuses incoming events
# whose type is not in it (server_bridge imports this table), so a new event type is one
# line here and one row in the protocol doc.
from edge_runtime.ring import Ring

try:
    from micropython import const
except ImportError:
    def const(x):
        return x

# Run id for events that belong to no run (refused input, a request that was never
# admitted). It has its own id sequence like any run.
DEVICE_RUN = "_"

_DEFAULT_RING = const(16)

TYPES = {
    "run.started": ("agent", "ver", "req", "conv", "domain", "input"),
    "run.paused": ("reason", "calls"),
    "run.resumed": ("ckpt",),
    "run.done": ("usage",),
    "run.failed": ("err", "retryable"),
    "run.cancelled": ("reason",),
    "msg.start": ("m", "role"),
    "msg.end": ("m",),
    "msg.delta": ("m", "text"),
    "reason.delta": ("m", "text"),
    "output": ("name", "value", "delta", "status", "format"),
    "row": ("field", "row", "key", "status", "value", "delta", "links"),
    "row.delete": ("field", "row", "key"),
    "tool.call": ("call", "name", "input", "client"),
    "tool.result": ("call", "output", "failed"),
    "approval.request": ("call", "name", "by"),
    "approval.granted": ("call", "name", "by"),
    "approval.denied": ("call", "name", "by"),
    "mem.recall": ("field", "query", "hits"),
    "mem.write": ("op", "field", "key", "w"),
    "citation": ("src", "ver", "chunk", "score"),
    "skill": ("name",),
    "state.patch": ("ops",),
    "node.start": ("kind",),
    "node.end": ("status", "port"),
    "edge": ("from", "port", "to"),
    "usage": ("in", "out", "reason"),
    "budget": ("kind", "used", "limit", "level"),
    "guard": ("name", "action", "detail"),
    "error": ("kind", "msg", "req", "from", "to"),
}

TERMINAL = ("run.done", "run.failed", "run.cancelled")


class Emitter:
    # Stamps events of one run with ids 1, 2, 3... and keeps the last `ring_size` of
    # them, encoded, so the bridge can ask for a resend after a gap. Encoded bytes are
    # a fifth of the size of the envelope dicts on the board heap, and a resend needs
    # no second encode. `encode(env) -> bytes` may raise; `send(data)` is the link's
    # publish, which may drop (its outbox is a ring too) while the ring still holds it.

    def __init__(self, run_id, encode, send, clock, ring_size=_DEFAULT_RING):
        self.run_id = run_id
        self._encode = encode
        self._send = send
        self._clock = clock
        self.last_id = 0
        self.ring = Ring(ring_size)

    def emit(self, etype, d=None, node=None):
        if etype not in TYPES:
            # A board-side bug, not wire input: fail loudly where it was written.
            raise ValueError("unknown event type " + etype)
        i = self.last_id + 1
        env = {"r": self.run_id, "i": i, "t": etype, "ts": self._clock(), "d": d or {}}
        if node is not None:
            env["n"] = node
        # Encoded before the id is spent: an event that cannot be encoded raises here
        # and leaves no hole in the ids.
        data = self._encode(env)
        self.last_id = i
        # The ring holds ids last_id-len+1 .. last_id in order, so no id is stored.
        self.ring.push(data)
        self._send(data)
        return env

    def replay(self, after):
        # Resend what the ring still holds past `after`; report the rest as a gap
        # (an error event naming the ids that are gone), never pretend it was sent.
        first_held = self.last_id - len(self.ring) + 1
        n = 0
        for data in self.ring:
            if first_held + n > after:
                self._send(data)
            n += 1
        if first_held > after + 1:
            lost_to = first_held - 1
            self.emit("error", {"kind": "gap", "msg": "events %d..%d are no longer held" % (after + 1, lost_to),
                                "from": after + 1, "to": lost_to})
        return max(0, self.last_id - max(after, first_held - 1))
