# The event vocabulary of the wire contract, the contract's shared names and bounds,
# and the per-run emitter.
# TYPE_NAMES names every event type of docs/PROTOCOL.md ("Event types", where each
# type's `d` fields are listed): the emitter refuses a type not in it, and the bridge
# refuses incoming events whose type is not in it (server_bridge imports it and splits
# it), so a new event type is one name here and one row in the protocol doc. Names
# rather than a table of fields: nothing on the board reads the fields, and on a
# 128 KiB heap a dict of tuples costs kilobytes. One str rather than a tuple of them:
# one object instead of thirty, 1.5 KiB less board heap (64-bit unix port).
from edge_runtime.ring import Ring

try:
    from micropython import const
except ImportError:
    # CPython has no const(); every const() here is an int, which int() returns as is.
    const = int

# The most events, and bytes of them, one payload carries when several wait (pump).
_BATCH_EVENTS = const(15)  # a msgpack fixarray's most
_BATCH_BYTES = const(1024)
_FIXARRAY = const(0x90)  # a msgpack fixarray's header for n items is _FIXARRAY | n

# Run id for events that belong to no run (refused input, a request that was never
# admitted). It has its own id sequence like any run.
DEVICE_RUN = "_"

# The contract's bounds that board, bridge and hosts must agree on, defined here once
# (server_bridge imports them): every id on the wire (req, conv, usr, run and call ids,
# device and tenant topic levels) is at most MAX_ID characters, because each is echoed
# and kept; a cancel's reason is cut to MAX_REASON characters.
MAX_ID = 64
MAX_REASON = 200
# The topic prefix P when settings name none.
PREFIX = "wren/v1"
# What a board receives by default (hello `payload`, setting `max_payload`): its receive
# buffer holds this much payload, and no string is longer. The bridge assumes it for a
# board whose hello leaves it out. Measured (tests/test_streams.py,
# benchmarks/bench_heap.py): with 4 KiB a 128 KiB board on the 64-bit unix port keeps
# about 14 KiB free at the bottom of a bursty streamed answer; with 8 KiB it runs out. A
# 32-bit board of 96 KiB runs a 7,000-character request with `max_payload` 8192.
# 4.5 KiB: a request's text of REQ_TEXT characters with its envelope (ids, the scope
# ticket: 300 B with everyday ids, 700 B with every id at MAX_ID), so that the text the
# hello announces (`str`) is a request that can arrive (issue 24: a 4,096-character
# request, inside the announced 4,096, used to be refused too_large at 4,266 B).
RX_PAYLOAD = 4608

# A ring's defaults (settings `ring` and `ring_bytes`): at most this many events, and at
# most this many bytes of them. The board keeps the rings of its active runs, of the
# last two finished ones and of the device stream, and streamed text makes events of
# 250-300 bytes (about five to a ring). Public: the runtime reads them.
RING = 16
RING_BYTES = 1536

# Space-separated, with a space at each end, so " name " is in it exactly when name is
# one of the types.
TYPE_NAMES = (
    " run.started run.paused run.resumed run.done run.failed run.cancelled"
    " msg.start msg.end msg.delta reason.delta output row row.delete"
    " tool.call tool.result approval.request approval.granted approval.denied"
    " mem.recall mem.write citation skill state.patch node.start node.end"
    " edge usage budget guard error presence "
)

TERMINAL = ("run.done", "run.failed", "run.cancelled")


class Emitter:
    # Stamps events of one run with ids 1, 2, 3... and keeps the last `ring_size` of
    # them, encoded: a resend needs no second encode, and encoded bytes are a fifth of
    # the size of the envelope dicts on the board heap.
    #
    # The ring, not the link, is where an event lives: `send(data) -> bool` is the
    # link's publish, which says False when its outbox is full, and then the event
    # simply waits in the ring. emit() only puts an event there; pump() hands the link
    # what it has not had, oldest first, now or when there is room again, so events
    # made one after another can go together. The link never drops an event. Only the ring
    # overwriting events the link never took loses anything (a run waits for room
    # before it emits, so only a burst of device-stream refusals can), and that loss is
    # reported as a gap, like ids a replay asks for that the ring no longer holds.

    def __init__(self, run_id, encode, send, clock, ring_size=RING, ring_bytes=RING_BYTES):
        self.run_id = run_id
        self._encode = encode
        self._send = send
        self._clock = clock
        self.last_id = 0
        self.sent = 0  # ids 1..sent have been handed to the link, in order
        self.lost = 0  # events overwritten before the link took them
        self.ring = Ring(ring_size)
        self._ring_bytes = ring_bytes
        self._held = 0  # bytes in the ring
        self._gaps = []  # (from, to) ranges to report once the backlog is sent
        self._block = None  # where a finished run's events are (settle)

    @property
    def backlog(self):
        return self.last_id - self.sent

    def emit(self, t, d=None, node=None):
        if " %s " % t not in TYPE_NAMES:
            # A board-side bug, not wire input: fail loudly where it was written.
            raise ValueError("unknown event type " + t)
        i = self.last_id + 1
        env = {"r": self.run_id, "i": i, "t": t, "ts": self._clock(), "d": d or {}}
        if node is not None:
            # The node the event is about (PROTOCOL "Nodes"): (path, activation) or
            # (path, activation, iteration), the envelope's n, a and k.
            env["n"], env["a"] = node[0], node[1]
            if len(node) > 2:
                env["k"] = node[2]
        # Encoded before the id is spent: an event that cannot be encoded raises here
        # and leaves no hole in the ids.
        data = self._encode(env)
        self.last_id = i
        # The ring holds ids last_id-len+1 .. last_id in order, so no id is stored.
        # Over its byte budget it lets go of its oldest events, but only those the link
        # has taken: an event waiting for room is never given up for a newer one.
        first = self.last_id - len(self.ring)
        while len(self.ring) and self._held + len(data) > self._ring_bytes and first < self.sent:
            self._held -= len(self.held(0))
            self.ring.pop()
            first += 1
        if len(self.ring) == self.ring.capacity:
            self._held -= len(self.held(0))
        self.ring.push(data)
        self._held += len(data)

    def held(self, k):
        # The k-th oldest event the ring holds, encoded: its own bytearray, or a view of
        # the block a finished run's events were moved into (settle).
        x = self.ring.at(k)
        if isinstance(x, int):
            return self._block[x >> 16:x & 0xffff]
        return x

    def settle(self):
        # A finished run's ring outlives the run (for replays), but its events, a
        # bytearray each, were allocated among the run's short-lived objects: where they
        # stay, they split the free heap into pieces, and each costs its own header and
        # rounding (about 48 bytes on the 64-bit unix port). Moved into one block, each
        # is its place in it, a small int (start << 16 | end): nothing allocated per
        # event. Without a free block that big they stay as they are.
        ring = self.ring
        if len(ring) < 2 or isinstance(ring.at(0), int) or self._held >= 0x8000:
            return
        try:
            block = bytearray(self._held)
        except MemoryError:
            return
        at = 0
        for _ in range(len(ring)):
            data = ring.pop()
            end = at + len(data)
            block[at:end] = data
            ring.push(at << 16 | end)
            at = end
        self._block = memoryview(block)

    def pump(self):
        # True when the link has had every event; False while it has no room.
        while True:
            first = self.last_id - len(self.ring) + 1
            if self.sent < first - 1:
                self.lost += first - 1 - self.sent
                self._gap(self.sent + 1, first - 1)
                self.sent = first - 1
            while self.sent < self.last_id:
                # Events waiting together go as one payload, a msgpack array of them
                # (PROTOCOL "Event envelope"): its header, then each event's bytes as the
                # ring holds them, a list of parts the link writes one after another.
                # A model step's run.started, node.start and msg.start then cost the
                # board, the broker and the bridge one message, not three, while the
                # bridge starts the model call. Within _BATCH_BYTES, far under the
                # smallest max_send a board can run with (a model call needs more).
                k = self.sent + 1 - first
                data = self.held(k)
                n = 1
                size = len(data)
                parts = None
                while k + n < len(self.ring) and n < _BATCH_EVENTS:
                    more = self.held(k + n)
                    size += len(more)
                    if size > _BATCH_BYTES:
                        break
                    if parts is None:
                        parts = [None, data]
                    parts.append(more)
                    n += 1
                if parts is not None:
                    parts[0] = bytes((_FIXARRAY | n,))
                    data = parts
                if not self._send(data):
                    return False
                self.sent += n
            # Reported only with nothing waiting: the report's own place in the ring then
            # holds an event already sent, so reporting can never cost another event.
            # One at a time, each sent before the next is made.
            if not self._gaps:
                return True
            lo, hi = self._gaps.pop(0)
            self.emit("error", {"kind": "gap", "msg": "events %d..%d are no longer held" % (lo, hi),
                                "from": lo, "to": hi})

    def _gap(self, a, b):
        # One report for ids a..b lost one after another, not one per event.
        if self._gaps and self._gaps[-1][1] + 1 >= a:
            self._gaps[-1] = (min(self._gaps[-1][0], a), max(self._gaps[-1][1], b))
        else:
            self._gaps.append((a, b))

    def replay(self, after):
        # Send again what the ring still holds past `after`; what it no longer holds is
        # reported as a gap, never pretended sent.
        first = self.last_id - len(self.ring) + 1
        if after >= self.last_id:
            return
        if after + 1 < first:
            self._gap(after + 1, first - 1)
        self.sent = min(self.sent, max(after, first - 1))
        self.pump()
