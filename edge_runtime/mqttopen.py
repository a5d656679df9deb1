# A connection's opening, for the board's Link: the dial (TCP, or TLS by tls.py), CONNECT
# and its CONNACK, and the SUBSCRIBE packets and their SUBACKs that come right after.
# None of it is needed once the link is up, so the link imports this module to connect
# and lets it go once its subscriptions are acknowledged (Link._connected,
# platform.unload): a run, where the board's heap peaks, never holds it. mqtt.py keeps
# what every packet of a live connection needs (fixed headers, PUBLISH, PUBACK).
from edge_runtime import mqtt, platform
from edge_runtime.mqtt import MalformedPacket, MqttError, check_topic, read_u16
from edge_runtime.platform import asyncio, log

try:
    from micropython import const
except ImportError:
    def const(x):
        return x

_CONNECT = const(1)
_SUBSCRIBE = const(8)
_F_USER = const(0x80)  # CONNECT flags
_F_PASSWORD = const(0x40)
_F_WILL_RETAIN = const(0x20)
_F_WILL = const(0x04)
_F_CLEAN = const(0x02)
_LEVEL = const(4)  # protocol level of 3.1.1
_MAX_LEN = const(268435455)  # the most four varint bytes can say
_OPEN_MS = const(10000)  # TCP connect, and CONNACK
# setsockopt(IPPROTO_TCP, TCP_NODELAY): the numbers of lwIP and of Linux alike.
_IPPROTO_TCP = const(6)
_TCP_NODELAY = const(1)

# CONNACK return codes (3.2.2.3), index = code.
_REFUSALS = const(("accepted", "bad protocol version", "identifier rejected",
                   "server unavailable", "bad user name or password", "not authorized"))
# The reasons this module's refusals give: one tuple of strs, not a name each in the
# board's qstr pool (test_on_small_heap).
_SAY = const(("will qos", "password without user", "keepalive", "no filters",
              "CONNACK flags", "SUBACK code", "no CONNACK", "TCP_NODELAY not set:"))
_WILL_QOS = const(0)
_PASSWORD_ALONE = const(1)
_KEEPALIVE = const(2)
_NO_FILTERS = const(3)
_CONNACK_FLAGS = const(4)
_SUBACK_CODE = const(5)
_NO_CONNACK = const(6)
_NO_NODELAY = const(7)


class ConnectRefused(MqttError):
    # CONNACK with a non-zero return code, kept in .code.
    def __init__(self, code):
        super().__init__("refused: " + (_REFUSALS[code] if code < 6 else str(code)))
        self.code = code


def encode_length(n):
    # The remaining length: base-128 digits, low first, at most four (2.2.3).
    if not 0 <= n <= _MAX_LEN:
        raise ValueError("remaining length")
    out = bytearray()
    while n > 127:
        out.append(n & 127 | 128)
        n >>= 7
    out.append(n)
    return bytes(out)


def _packet(first, body):
    return bytes((first,)) + encode_length(len(body)) + body


def _str(s):
    # A length-prefixed field (1.5.3) from str or bytes.
    if isinstance(s, str):
        s = s.encode()
    if len(s) > 0xFFFF:
        raise ValueError("field over 65535 bytes")
    return bytes((len(s) >> 8, len(s) & 255)) + s


def encode_connect(client_id, clean=True, keepalive=60, user=None, password=None, will=None):
    # will = (topic, payload, qos, retain) or None.
    flags = _F_CLEAN if clean else 0
    tail = _str(client_id)
    if will:
        topic, payload, qos, retain = will
        check_topic(topic)
        if qos not in (0, 1, 2):
            raise ValueError(_SAY[_WILL_QOS])
        flags |= _F_WILL | qos << 3 | (_F_WILL_RETAIN if retain else 0)
        tail += _str(topic) + _str(bytes(payload))
    if user is not None:
        flags |= _F_USER
        tail += _str(user)
    if password is not None:
        if user is None:
            raise ValueError(_SAY[_PASSWORD_ALONE])  # MQTT-3.1.2-22
        flags |= _F_PASSWORD
        tail += _str(password)
    if not 0 <= keepalive <= 0xFFFF:
        raise ValueError(_SAY[_KEEPALIVE])
    head = b"\x00\x04MQTT" + bytes((_LEVEL, flags, keepalive >> 8, keepalive & 255))
    return _packet(_CONNECT << 4, head + tail)


def parse_connack(body):
    # Returns session_present; a refusal raises ConnectRefused naming the code.
    if body[0] > 1:
        raise MalformedPacket(_SAY[_CONNACK_FLAGS])
    if body[1]:
        raise ConnectRefused(body[1])
    return body[0] == 1


def encode_subscribe(pid, topics):
    # topics: (filter, qos) pairs, at least one (MQTT-3.8.3-3).
    if not topics:
        raise ValueError(_SAY[_NO_FILTERS])
    body = bytes((pid >> 8, pid & 255))
    for topic, qos in topics:
        body += _str(topic) + bytes((qos,))
    return _packet(_SUBSCRIBE << 4 | 2, body)


def parse_suback(body):
    # Returns (pid, codes); code 0x80 refused that filter.
    pid, off = read_u16(body, 0)
    codes = bytes(body[off:])  # a body may be a memoryview, which has no `in` on MicroPython
    for c in codes:
        if c > 2 and c != 0x80:
            raise MalformedPacket(_SAY[_SUBACK_CODE])
    return pid, codes


async def _close_late(t):
    try:
        w = (await t)[1]
        w.close()
        await w.wait_closed()
    except Exception:  # the attempt failed after all: nothing to close
        pass


async def _dial(link):
    # Not wait_for(open_connection(...)): on MicroPython a cancelled open_connection
    # leaves its socket open (the unix port's sockets have no finaliser), one per
    # timed-out attempt until the board runs out. A late attempt is left to end on
    # its own (the OS bounds a TCP connect) and its stream is closed then.
    if link.tls:
        from edge_runtime import tls
        t = asyncio.create_task(tls.open(link))
    else:
        t = asyncio.create_task(asyncio.open_connection(link.host, link.port))
    waited = 0
    while not t.done():
        if waited >= _OPEN_MS or link._stopping:
            asyncio.create_task(_close_late(t))
            raise asyncio.TimeoutError()
        await platform.sleep_ms(20)
        waited += 20
    return await t


async def open(link):
    # The link's new connection, up to its CONNACK: (reader, writer, write lock), and
    # link.session_present set. The caller starts the connection's tasks.
    r, w = await _dial(link)
    # Nagle off: each of the link's messages is small and waits on the one before (an
    # ack, a chunk, an event), and with Nagle on each small write waits up to 40 ms
    # for the broker's delayed ACK. MicroPython's stream keeps its socket in `s`;
    # CPython's asyncio's socket is behind get_extra_info. A port without the option
    # keeps working, slower; stats["nodelay"] says whether it is set (for tests and
    # a board's status).
    try:
        # (Over TLS, tls.py's stream names its TCP socket as CPython's does.)
        sock = w.s if hasattr(w, "s") and not link.tls else w.get_extra_info("socket")
        sock.setsockopt(_IPPROTO_TCP, _TCP_NODELAY, 1)
        link.stats["nodelay"] = 1
    except (OSError, AttributeError, TypeError, KeyError) as e:
        log("link", _SAY[_NO_NODELAY], e)
        link.stats["nodelay"] = 0
    sock = None
    # Everything that belongs to this connection, handed to its tasks: a task whose
    # connection is no longer link._conn stops, whatever it was doing.
    conn = link._conn = (r, w, asyncio.Lock())
    link._rxn[0] = link._rxn[1] = 0  # nothing of an earlier connection's is read
    await link._write(conn, link._connect_pkt)
    t, _, body = await platform.wait_for_ms(link._read_packet(r), _OPEN_MS)
    if t != mqtt.CONNACK:
        raise MalformedPacket(_SAY[_NO_CONNACK])
    link.session_present = parse_connack(body)
    return conn
