# The event vocabulary of the wire contract and the per-run emitter.
# TYPES is the one table of event type -> its `d` fields; the board builds events from
# it and the bridge checks incoming events against it (server_bridge imports it), so a
# new event type is one line here and one row in docs/PROTOCOL.md.
from edge_runtime.ring import Ring

try:
    from micropython import const
except ImportError:
    def const(x):
        return x

# Run id for events that belong to no run (refused input, a request that was never
# admitted). It has its own id sequence like any run.
DEVICE_RUN = "_"

_DEFAULT_RING = const(32)

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
    "error": ("kind", "msg"),
}

TERMINAL = ("run.done", "run.failed", "run.cancelled")


class Emitter:
    # Stamps events of one run with ids 1, 2, 3... and keeps the last `ring_size` of
    # them so the bridge can ask for a resend after a gap. `send(envelope)` is the
    # link's publish; it may drop (the outbox is a ring too) and the ring still has it.

    def __init__(self, run_id, send, clock, ring_size=_DEFAULT_RING):
        self.run_id = run_id
        self._send = send
        self._clock = clock
        self.last_id = 0
        self.ring = Ring(ring_size)

    def emit(self, etype, d=None, node=None):
        if etype not in TYPES:
            # A board-side bug, not wire input: fail loudly where it was written.
            raise ValueError("unknown event type " + etype)
        self.last_id += 1
        env = {"r": self.run_id, "i": self.last_id, "t": etype, "ts": self._clock(), "d": d or {}}
        if node is not None:
            env["n"] = node
        self.ring.push(env)
        self._send(env)
        return env

    def replay(self, after):
        # Resend what the ring still holds past `after`; report the rest as a gap
        # (an error event naming the ids that are gone), never pretend it was sent.
        held = [e for e in self.ring if e["i"] > after]
        first_held = held[0]["i"] if held else self.last_id + 1
        for env in held:
            self._send(env)
        if first_held > after + 1:
            lost_to = first_held - 1
            self.emit("error", {"kind": "gap", "msg": "events %d..%d are no longer held" % (after + 1, lost_to),
                                "from": after + 1, "to": lost_to})
        return len(held)
