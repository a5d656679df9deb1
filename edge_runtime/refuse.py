# Input the board refuses by name: a message on no topic of this board's, a payload that
# does not decode or is not a map, one over the receive buffer, a request with no room
# left (each function named by a name the board's qstr pool has already). Such
# input comes seldom next to requests and answers, so the runtime (runs.py) imports this
# module when some comes and lets it go when the next run starts, as it does control.py:
# its code and its messages (600 bytes of the runtime's heap, 32-bit) are not on the heap of
# a board that is sent none, and a flood of junk between two runs costs one import.
# What is said while the heap may be short stays in runs.py (a run that cannot start,
# the board about to reset, the refusals held during a flood): an import then may find
# no heap either.
from edge_runtime import codec
from edge_runtime.events import MAX_ID
from edge_runtime.runs import clip, is_id

try:
    from micropython import const
except ImportError:
    def const(x):
        return x

# The str headers a req's id may have (payload): fixstr (under 32 bytes), str 8.
_FIXSTR = const(0xa0)
_FIXSTR_END = const(0xc0)
_STR8 = const(0xd9)


def bad_topic(runtime, topic, leaf):
    # A topic the board did not subscribe to in this boot (a session of an earlier
    # firmware may still hold other subscriptions): its base, or its leaf, is not ours.
    if not topic.startswith(runtime._base):
        runtime.refuse("bad_topic", "not this board's topic")
    else:
        runtime.refuse("bad_topic", "no such topic leaf: " + leaf)


def payload(runtime, leaf, data, e):
    # A payload (`data`) that is no message: `e` the decode's error, or None for one
    # that decoded to no map.
    if e is None:
        runtime.refuse("bad_envelope", "payload on %s is not a map" % leaf)
        return
    # A req that cannot be decoded is still refused by its id: the bridge writes it
    # first (PROTOCOL "Requests and control"), so it is the str after a map header and
    # "req" (a fixstr of 3 bytes), decoded alone (a fixstr or a str 8 header, then its
    # bytes). The host waiting on it then ends at once, rather than at its timeout. No
    # heap even for that leaves the refusal without it.
    more = None
    if leaf == "req" and len(data) > 6 and data[1:5] == b"\xa3req":
        head = data[5]
        end = (6 + head - _FIXSTR if _FIXSTR <= head < _FIXSTR_END
               else 7 + data[6] if head == _STR8 else 0)
        try:
            req = codec.decode(data[5:end], end, MAX_ID) if end else None
            if is_id(req):
                more = {"req": req}
        except (codec.CodecError, MemoryError):
            pass
    if isinstance(e, codec.CodecError):
        runtime.refuse(e.kind, "%s on %s" % (e, leaf), more)
    else:
        runtime.refuse("no_memory", "no free heap to decode %d bytes on %s" % (len(data), leaf),
                       more)


def too_large(runtime, topic, size):
    base = runtime._base
    leaf = topic[len(base):] if topic.startswith(base) else topic
    runtime.refuse("too_large", "a message of %d bytes on %s is over the %d-byte limit"
                   % (size, clip(leaf), runtime.limits["payload"]))


def busy(runtime, req):
    # Not remembered as seen (runs.py): the same request may be sent again later.
    runtime.stats["busy"] += 1
    runtime.refuse("busy", "the board is running %d requests and has %d queued"
                   % (len(runtime.active), len(runtime._queue)), {"req": req})

