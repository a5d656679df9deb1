# MQTT 3.1.1 packets as pure functions: encoders return bytes, parsers take a packet
# body and return plain values, and one parser of fixed headers (parse_head) finds whole
# packets in what has been read. No sockets or tasks here, so the board's Link and the board tests (which play
# a broker's side too) share one byte layout. On a board every line and every public
# name here is loaded into a small heap, so only what a live client connection needs
# is here; its opening (CONNECT, CONNACK, SUBSCRIBE, SUBACK) is mqttopen.py's.
#
# Errors: wire data is refused with an MqttError, never an assert and never a
# half-built value. MqttError derives from Exception, not OSError, on purpose: a
# transport failure (OSError, EOFError, timeout) and a peer breaking the grammar both
# end the connection and lead to a reconnect (the Link catches both), but a log
# should say which of the two it was, and on MicroPython an OSError subclass would
# carry a message where callers expect an errno.

try:
    from micropython import const
except ImportError:
    def const(x):
        return x


# Packet types (the high nibble of the first byte).
_CONNACK = const(2)
_PUBLISH = const(3)
_PUBACK = const(4)
_SUBSCRIBE = const(8)
_SUBACK = const(9)
_UNSUBACK = const(11)
_PINGREQ = const(12)
_PINGRESP = const(13)
_DISCONNECT = const(14)

_DUP = const(0x08)  # PUBLISH fixed-header flags
_RETAIN = const(0x01)
_MAX_LEN = const(268435455)  # the most four varint bytes can say

# Public names for code that dispatches on parse_head's result: the packets a client
# reads, and SUBSCRIBE for the board tests' proxy. (Every public name is a slot in the
# module's dict on the board, so the types only a broker reads are not here.)
CONNACK = _CONNACK
PUBLISH = _PUBLISH
PUBACK = _PUBACK
SUBSCRIBE = _SUBSCRIBE
SUBACK = _SUBACK
PINGRESP = _PINGRESP
FROM_CLIENT = "c"  # parse_head(..., sender=FROM_CLIENT) on a broker
FROM_SERVER = "s"  # parse_head(..., sender=FROM_SERVER) on a client

# The protocol as one table and parse_head its one reader. Row t (16 characters) is
# packet type t: its name; who sends it (c client, s server, b both, - reserved type);
# the fixed-header flags the spec requires (MQTT-2.2.2-2; * where they carry meaning);
# the body length of a fixed-size packet (* variable). All of it is checked before a
# byte of the body is read. One string rather than tuples: on a board it is a single
# object, not sixteen.
_ROW = const(16)
_TABLE = const(
    #            who flags length
    "reserved    -**."
    "CONNECT     c0*."
    "CONNACK     s02."
    "PUBLISH     b**."
    "PUBACK      b02."
    "PUBREC      b02."
    "PUBREL      b22."
    "PUBCOMP     b02."
    "SUBSCRIBE   c2*."
    "SUBACK      s0*."
    "UNSUBSCRIBE c2*."
    "UNSUBACK    s02."
    "PINGREQ     c00."
    "PINGRESP    s00."
    "DISCONNECT  c00."
    "reserved    -**."
)

# Packets with no variable part are constants, never rebuilt.
PINGREQ_PACKET = b"\xc0\x00"
PINGRESP_PACKET = b"\xd0\x00"
DISCONNECT_PACKET = b"\xe0\x00"


class MqttError(Exception):
    # The peer broke MQTT 3.1.1 or refused us; this connection cannot go on.
    pass


class MalformedPacket(MqttError):
    # Bytes outside the grammar, or a packet the peer's side never sends.
    pass


class PacketTooLarge(MqttError):
    # A remaining length over our limit, refused before the body was read.
    pass


def packet_name(t):
    return _TABLE[(t & 15) * _ROW:(t & 15) * _ROW + 12].strip()


def read_u16(buf, off):
    # Returns (value, next offset); fields are checked against the body's end so a
    # lying length can never read past the packet.
    if off + 2 > len(buf):
        raise MalformedPacket("truncated")
    return buf[off] << 8 | buf[off + 1], off + 2


def check_topic(topic):
    # A topic name (what is published to) is non-empty and has no wildcard.
    if not topic or "+" in topic or "#" in topic:
        raise ValueError("bad topic name")


def publish_header(topic, size, qos=0, retain=False, dup=False, pid=0):
    # Fixed header, topic and packet id of a PUBLISH whose payload is `size` bytes.
    # A sender writes this and then the payload it already holds: a large payload is
    # never copied into a second buffer to prepend a few bytes. Written into one
    # bytearray of its size: built by concatenation it cost a dozen objects per message
    # (645 bytes allocated on the 64-bit unix port, now 257).
    if qos not in (0, 1, 2) or dup and not qos:  # MQTT-3.3.1-2
        raise ValueError("qos/dup")
    if qos and not 0 < pid <= 0xFFFF:
        raise ValueError("packet id")
    if isinstance(topic, str):
        topic = topic.encode()
    if len(topic) > 0xFFFF:
        raise ValueError("field over 65535 bytes")
    var = 2 + len(topic) + (2 if qos else 0)  # the variable header's size
    rest = var + size  # the remaining length
    if rest > _MAX_LEN:
        raise ValueError("remaining length")
    # Where the topic starts: after the first byte and the remaining length's digits.
    at = 2 if rest < 0x80 else 3 if rest < 0x4000 else 4 if rest < 0x200000 else 5
    out = bytearray(at + var)
    out[0] = _PUBLISH << 4 | qos << 1 | (_DUP if dup else 0) | (_RETAIN if retain else 0)
    i = 1
    while rest > 127:
        out[i] = rest & 127 | 128
        rest >>= 7
        i += 1
    out[i] = rest
    out[at] = len(topic) >> 8
    out[at + 1] = len(topic) & 255
    out[at + 2:at + 2 + len(topic)] = topic
    if qos:
        out[-2] = pid >> 8
        out[-1] = pid & 255
    return out


def encode_publish(topic, payload, qos=0, retain=False, dup=False, pid=0):
    return publish_header(topic, len(payload), qos, retain, dup, pid) + bytes(payload)


def parse_publish(flags, body):
    # Returns (topic, payload, qos, retain, dup, pid); pid is 0 at QoS 0.
    qos = flags >> 1 & 3
    if qos == 3 or flags & _DUP and not qos:  # MQTT-3.3.1-4, 3.3.1-2
        raise MalformedPacket("PUBLISH flags")
    # The topic: a length-prefixed UTF-8 string (1.5.3).
    n, off = read_u16(body, 0)
    off += n
    if off > len(body):
        raise MalformedPacket("field past the end")
    try:
        topic = str(body[2:off], "utf-8")  # body may be a memoryview, which has no decode()
    except UnicodeError:
        raise MalformedPacket("not UTF-8")
    if "\x00" in topic:
        raise MalformedPacket("U+0000 in a string")  # MQTT-1.5.3-2
    if not topic or "+" in topic or "#" in topic:
        raise MalformedPacket("PUBLISH topic")  # MQTT-3.3.2-2
    pid = 0
    if qos:
        pid, off = read_u16(body, off)
        if not pid:
            raise MalformedPacket("packet id 0")
    return topic, body[off:], qos, bool(flags & _RETAIN), bool(flags & _DUP), pid


def encode_puback(pid):
    return bytes((_PUBACK << 4, 2, pid >> 8, pid & 255))


def parse_packet_id(body):
    # PUBACK, UNSUBACK and the QoS 2 acks: the body is the packet id alone (the
    # table made parse_head check it is two bytes).
    return body[0] << 8 | body[1]


def parse_head(buf, start, end, sender="b"):
    # The fixed header of the packet at buf[start:end] -> (type, flags, remaining
    # length, the header's size), or None while the bytes there do not hold all of it.
    # The table's checks come before a byte of the body is looked at, each as soon as
    # its byte is there, so a peer announcing an impossible packet costs us at most five
    # bytes. `sender` is FROM_SERVER on a client (a broker never sends CONNECT...) and
    # FROM_CLIENT on a broker.
    if start >= end:
        return None
    first = buf[start]
    t = first >> 4
    row = t * _ROW
    who = _TABLE[row + 12]
    if who == "-" or who != "b" and sender != "b" and who != sender:
        raise MalformedPacket("%s from this side" % packet_name(t))
    want = _TABLE[row + 13]
    if want != "*" and first & 15 != ord(want) - 48:
        raise MalformedPacket(packet_name(t) + " flags")
    n = shift = 0
    i = start + 1
    while True:
        if i >= end:
            return None
        b = buf[i]
        i += 1
        n |= (b & 127) << shift
        if b < 128:
            break
        shift += 7
        if shift > 21:
            raise MalformedPacket("remaining length over four bytes")
    want = _TABLE[row + 14]
    if want != "*" and n != ord(want) - 48:
        raise MalformedPacket(packet_name(t) + " length")
    return t, first & 15, n, i - start
