# The board's MQTT 3.1.1 client. One supervisor (run) owns the connection: it
# connects, starts three tasks per connection (reader, keepalive watchdog, sender)
# and sleeps until one of them, or the application, calls reconnect(); then it
# cancels them, closes the socket, waits out a bounded, jittered backoff and starts
# over. Every task leaves through reconnect() however it ends — MemoryError and any
# other exception included — so no task can die and leave a connection that looks
# alive but reads or sends nothing.
#
# Memory: what arrives is read into one receive buffer allocated with the Link, so a
# message costs no allocation of its size while it is read; a message larger than
# that buffer is read past in buffer-sized pieces, acknowledged, and reported through
# on_refused, and the connection stays up. What is sent waits in a bounded outbox:
# publish() refuses (returns False) when it is full instead of dropping anything, and
# callers that must not lose a message hold it and wait for room (wait_room).
#
# Delivery: QoS 0 is sent once. QoS 1 gets a packet id and stays in a bounded
# in-flight list until its PUBACK; it goes again with DUP set after every reconnect,
# and once on the same connection if its PUBACK is late (a second late PUBACK means
# the connection is not working, whatever TCP says). At least once, then: the wire
# contract's ids (req ids, run/event ids, call ids, chunk numbers) make a repeat
# harmless. With clean_session=False the broker keeps our subscriptions and queues
# QoS 1 messages for us while we are away; session_present says whether it did.
#
# Every wait on the network is bounded: connect, CONNACK and each write go through
# platform.wait_for_ms; the reader's open-ended wait for the next packet is bounded
# by the keepalive watchdog, which pings after half a keepalive of silence and calls
# reconnect() when the ping goes unanswered.
from edge_runtime import mqtt, platform
# The clock (ticks_ms, sleep_ms, wait_for_ms) is read through platform at call time:
# a test can then swap its source (platform.use_clock) while this real Link runs.
from edge_runtime.platform import asyncio, log, read_some, ticks_diff
from edge_runtime.ring import Ring

try:
    from micropython import const
except ImportError:
    def const(x):
        return x

_OPEN_MS = const(10000)  # the SUBACK of the resubscribe (mqttopen: TCP connect, CONNACK)
_WRITE_MS = const(10000)  # one packet onto the socket
_BYE_MS = const(1000)  # DISCONNECT and close on stop()
_TICK_MS = const(500)  # watchdog period (shorter for tiny keepalives)
_FAIL = const(0x80)  # SUBACK failure code
# Receive buffer over the largest payload wanted: fixed header fields, the topic and
# the packet id of a PUBLISH.
_RX_HEAD = const(128)
# A Link's receive buffer unless told otherwise: a small client's. The board runtime
# passes the size its hello announces (runs.Runtime.link_settings).
_RX_SIZE = const(2048)

# In-flight entry: [pid, topic, payload, retain, sent_at or None (not yet sent on
# this connection), resent on this connection already]
_PID = const(0)
_SENT = const(4)
_RESENT = const(5)


def _size(payload):
    # A payload is one buffer or a list of parts written in turn.
    if isinstance(payload, list):
        n = 0
        for part in payload:
            n += len(part)
        return n
    return len(payload)


def _unsent(w):
    # Bytes a stream writer holds that its socket has not taken yet. MicroPython's
    # stream keeps them in out_buf (and writes to the socket at once when it is empty);
    # CPython's transport counts them.
    buf = getattr(w, "out_buf", None)
    if buf is not None:
        return len(buf)
    return w.transport.get_write_buffer_size()


class Link:
    def __init__(self, client_id, host, port, user=None, password=None, keepalive=30,
                 will=None, outbox_size=16, max_packet=20000, rx_size=_RX_SIZE,
                 on_message=None, on_connect=None, on_refused=None, on_room=None,
                 backoff_ms=(250, 8000), clean_session=True, inflight=8,
                 ack_timeout_ms=10000, tls=None):
        self.client_id = client_id
        self.host = host
        self.port = port
        # The settings' `tls` entry (tls.py, imported only when it is set), or None.
        self.tls = tls
        self.keepalive = keepalive
        self.max_packet = max_packet  # the largest packet we send
        # on_message(topic, payload): payload is a memoryview into the receive buffer,
        # valid only during the call; copy it (bytes(payload)) to keep it.
        self.on_message = on_message
        self.on_connect = on_connect
        # on_refused(topic, size): a PUBLISH too large for the receive buffer was read
        # past and acknowledged without being delivered.
        self.on_refused = on_refused
        # on_room(): the outbox has room again after a publish was refused.
        self.on_room = on_room
        self.backoff_ms = backoff_ms
        self.ack_timeout_ms = ack_timeout_ms
        self.connected = False
        self.session_present = False
        # Test hook: the name of a task ("read", "watch", "send") that raises
        # MemoryError at its next turn, to prove every task ends through reconnect().
        self.fault = None
        self.stats = {"refused": 0, "sent": 0, "received": 0, "retransmits": 0,
                      "reconnects": 0, "connects": 0, "failures": 0, "oversized": 0,
                      "nodelay": 0, "ended_short": 0}
        # The receive buffer, as a view: every read and every body handed on is a slice
        # of it, never a copy.
        self._rxv = memoryview(bytearray(rx_size))
        self._outbox = Ring(outbox_size)
        self._inflight = []
        self._inflight_max = inflight
        self._subs = []  # (topic, qos) in subscribe order, applied on every connect
        self._nsubs = 0  # how many of _subs went out on this connection
        self._sub_pid = 0  # the connect-time SUBSCRIBE until its SUBACK
        self._pid_next = 0
        self._conn = None  # (reader, writer, write lock) of the current connection
        self._tasks = []
        self._stopping = False
        # The sender has work. A Bell: its bounded wait allocates nothing, where an Event
        # under wait_for made two tasks each time the sender woke.
        self._wake = platform.Bell()
        self._up = asyncio.Event()  # connected and subscribed
        self._down = asyncio.Event()  # this connection is over, or stop()
        self._room = asyncio.Event()  # the sender took something out of the outbox
        self._wanted_room = False  # a publish was refused since on_room last ran
        self._opened = self._rx_at = self._tx_at = 0
        self._ping = None  # ticks_ms of an unanswered PINGREQ
        self._skipped = None  # (topic, pid, qos, size) of the PUBLISH _read_packet read past
        self._rxn = [0, 0]  # the receive buffer's unread bytes: _rxv[_rxn[0]:_rxn[1]]
        # Built once: CONNECT is the same bytes on every attempt (mqttopen.py, which the
        # first connection loads anyway).
        from edge_runtime import mqttopen
        self._connect_pkt = mqttopen.encode_connect(client_id, clean_session, keepalive,
                                                    user, password, will)

    # --- application API ------------------------------------------------------------

    @property
    def max_payload(self):
        # The largest payload a message to us may carry and still be delivered.
        return len(self._rxv) - _RX_HEAD

    def subscribe(self, topic, qos=1):
        # Recorded and re-applied on every connect; sent at once if connected. QoS is
        # capped at 1: this client never takes part in a QoS 2 exchange.
        self._subs.append((topic, 1 if qos else 0))
        self._wake.set()

    def room(self, spare=0):
        # Whether a publish would be taken now, leaving `spare` slots for others.
        return len(self._outbox) + spare < self._outbox.capacity

    def publish(self, topic, payload, qos=0, retain=False, spare=0):
        # Non-blocking: True when queued, False (counted) when the outbox lacks room
        # for it and `spare` more. Nothing queued is ever dropped. A memoryview payload
        # is copied; bytes and a bytearray are kept as given (the caller hands a
        # bytearray over and must not change it), and so is a list of such parts, which
        # are written one after another (codec.encode_parts). A message bigger
        # than max_packet raises ValueError: sent, it would make the broker drop us,
        # and as QoS 1 it would do so on every reconnect.
        mqtt.check_topic(topic)
        if qos not in (0, 1):
            raise ValueError("qos")
        if _size(payload) + len(topic) + 9 > self.max_packet:
            raise ValueError("message over max_packet")
        if not self.room(spare):
            self.stats["refused"] += 1
            self._wanted_room = True
            return False
        if isinstance(payload, memoryview):
            payload = bytes(payload)  # a view of a buffer its owner will reuse
        if self._send_now(topic, payload, qos, retain):
            return True
        self._outbox.push((topic, payload, qos, retain))
        self._wake.set()
        return True

    async def wait_room(self, ms, spare=0):
        # Wait (at most ms) until a publish leaving `spare` slots would be taken.
        start = platform.ticks_ms()
        while not self.room(spare):
            left = ms - ticks_diff(platform.ticks_ms(), start)
            if left <= 0:
                return False
            self._wanted_room = True
            self._room.clear()
            try:
                await platform.wait_for_ms(self._room.wait(), left)
            except asyncio.TimeoutError:
                pass
        return True

    async def wait_connected(self, timeout_ms):
        try:
            await platform.wait_for_ms(self._up.wait(), timeout_ms)
        except asyncio.TimeoutError:
            pass
        return self.connected

    def reconnect(self, reason):
        # Idempotent: the first call per connection marks it down and wakes the
        # supervisor, which ends the connection's tasks and closes the socket. Later
        # calls, and calls with no connection, do nothing. The flags go first: this may
        # run out of memory, and the log line is the one part that allocates.
        if self._conn is None or self._down.is_set():
            return
        self.connected = False
        self._up.clear()
        self.stats["reconnects"] += 1
        self._down.set()
        try:
            log("link: down:", reason)
        except MemoryError:
            pass

    def _lost(self, conn, task, reason):
        # Every connection task ends here, whatever ended it; one left over from an
        # older connection must not take the current one down.
        if conn is self._conn:
            if isinstance(reason, MemoryError):
                # For run(): this connection ended for want of heap. (A stats key over
                # ten characters: no name in the board's qstr pool.)
                self.stats["ended_short"] = 1
            self.reconnect(task if reason is None else "%s: %r" % (task, reason))

    def _fault_point(self, task):
        if self.fault == task:
            self.fault = None
            raise MemoryError("injected into " + task)

    def stop(self, clean=True):
        # clean: a DISCONNECT tells the broker to withhold our will. Without one (a board
        # about to reset) the connection is dropped and the broker publishes the will, as
        # it would for a board that lost power.
        self._stopping = True if clean else 2
        self.connected = False
        self._down.set()

    @property
    def pending(self):
        # Messages not acknowledged yet: outbox plus in flight.
        return len(self._outbox) + len(self._inflight)

    # --- supervisor -----------------------------------------------------------------

    # Awaited before each dial when set: wifi.py's connect (wifi.start sets it), which
    # joins the board's Wi-Fi again when it is gone, so the link never dials over no
    # network. A name the board's qstr pool holds already (board.py's "wifi").
    wifi = None

    async def run(self):
        # Returns on stop(). Raises MemoryError when four connections in a row found no
        # heap (`short`): to connect, or in one of their tasks, a collection before each:
        # the board's last resort (board.py resets it) rather than stay up and deaf.
        # (Its locals are names a board compiling this from source interns: existing
        # ones where they fit.)
        fails = short = 0
        try:
            while not self._stopping:
                try:
                    try:
                        self.stats["ended_short"] = 0
                        if self.wifi:
                            await self.wifi()
                        await self._open()
                        fails = 0
                        await self._down.wait()  # the connection's life: to reconnect()/stop()
                        # A connection that came up and then found no heap in a task
                        # counts as one that found none to connect: alternating, the two
                        # kept the board reconnecting for good (a leak of an app's).
                        if self.stats["ended_short"]:
                            short += 1
                        else:
                            short = 0
                    except Exception as e:  # the supervisor itself must never die
                        if isinstance(e, MemoryError):
                            short += 1
                        try:
                            log("link: connect %s:%s failed: %r" % (self.host, self.port, e))
                        except MemoryError:
                            pass
                        self.stats["failures"] += 1
                        fails += 1
                        e = None
                    await self._close()
                    if self._stopping:
                        break
                    # Doubling from the minimum up to the maximum; half of it random, so
                    # a fleet that lost the same broker does not return in lockstep.
                    # (Inline, not a function: each name counts against the board's
                    # qstr pool, test_on_small_heap.)
                    lo, hi = self.backoff_ms
                    d = min(lo << min(fails, 16), hi) // 2
                    try:
                        from random import getrandbits
                        d += getrandbits(16) % (d + 1)
                    except ImportError:
                        d += platform.ticks_ms() % (d + 1)
                    self._down.clear()
                    try:
                        await platform.wait_for_ms(self._down.wait(), d)  # only stop() sets it
                    except asyncio.TimeoutError:
                        pass
                except MemoryError:
                    # The supervisor's own steps (closing, the backoff) found no heap:
                    # counted as a connection that found none, and the loop goes on.
                    short += 1
                if short:
                    # A MemoryError leaves the garbage of what failed: collected before
                    # the next attempt. If that has not helped after four in a row,
                    # nothing will.
                    platform.collect()
                    if short >= 4:
                        raise MemoryError("no heap for the link")
        finally:
            # Also when run() itself is cancelled: that counts as stop().
            if not self._stopping:
                self._stopping = True
            try:
                await self._close()
            except Exception:  # whatever closing hit, run() ends as it was going to
                pass

    async def _open(self):
        self._down.clear()
        # The dial, CONNECT and CONNACK are mqttopen.py's, loaded for the opening and
        # let go once the link is up (_connected). Out of heap for it, the attempt fails
        # as any other does and counts as one that found no heap (run).
        from edge_runtime import mqttopen
        conn = await mqttopen.open(self)
        mqttopen = None
        self.stats["connects"] += 1
        self._opened = self._rx_at = platform.ticks_ms()
        self._ping = None
        self._nsubs = self._sub_pid = 0
        for e in self._inflight:
            e[_SENT] = None  # all of it goes again, with DUP
            e[_RESENT] = False
        self._wake.set()
        self._tasks = [asyncio.create_task(self._read_loop(conn)),
                       asyncio.create_task(self._watch_loop(conn)),
                       asyncio.create_task(self._send_loop(conn))]
        if not self._subs:
            self._connected()

    def _connected(self):
        # "Up" includes the subscriptions: whoever waited for it can rely on receiving.
        # The opening's code goes (a later subscribe() loads it again for its SUBSCRIBE
        # and SUBACK, and lets it go once that is in).
        platform.unload("mqttopen")
        self.connected = True
        self._up.set()
        log("link: up %s:%s as %s%s" % (self.host, self.port, self.client_id,
                                        " (session kept)" if self.session_present else ""))
        if self.on_connect:
            try:
                self.on_connect()
            except Exception as e:  # an application bug must not take the link down
                log("link: on_connect:", repr(e))

    async def _close(self):
        conn = self._conn
        self._conn = None  # from here on the connection's tasks end at their next check
        self.connected = False
        self._up.clear()
        # Cancelled, not awaited: CPython's wait_for can swallow a cancellation that
        # races with the awaited result, and awaiting a task that missed its
        # cancellation would hang; such a task finds _conn changed and ends. On
        # MicroPython cancel() also takes the task off the poller at once, so the
        # socket can be closed under it.
        for t in self._tasks:
            t.cancel()
        self._tasks = []
        if conn is None:
            return
        try:
            if self._stopping is True:
                # A clean DISCONNECT tells the broker not to publish our will.
                await platform.wait_for_ms(self._write(conn, mqtt.DISCONNECT_PACKET), _BYE_MS)
        except Exception:
            pass
        try:
            conn[1].close()
            await platform.wait_for_ms(conn[1].wait_closed(), _BYE_MS)
        except Exception:
            pass

    # --- sending --------------------------------------------------------------------

    def _write_now(self, conn, *parts):
        # Written at once, without a turn of the scheduler, when no other write is
        # under way on this connection and nothing is left unsent before it; else
        # False, and the caller goes the awaited way (_write). Latency: a board's
        # event or ack waited for the sender task's next turn, behind whatever else
        # the scheduler had ready (a run's next steps, a collection).
        w = conn[1]
        if conn is not self._conn or conn[2].locked() or _unsent(w):
            return False
        for p in parts:
            w.write(p)
        self._tx_at = platform.ticks_ms()
        if _unsent(w):
            self._wake.set()  # the socket took only part of it: the sender drains it
        return True

    def _send_now(self, topic, payload, qos, retain):
        # publish()'s fast way: straight onto the socket when the message would be the
        # sender's next anyway (connected and subscribed, nothing queued or waiting to
        # be sent again ahead of it, room in flight). A write that fails takes the
        # connection down; a QoS 1 message is then in flight and goes again, as it
        # would after any loss of the connection.
        conn = self._conn
        if (conn is None or not self.connected or len(self._outbox)
                or self._nsubs < len(self._subs) or len(self._inflight) >= self._inflight_max):
            return False
        for e in self._inflight:
            if e[_SENT] is None:
                return False
        e = [self._new_pid() if qos else 0, topic, payload, retain, platform.ticks_ms(), False]
        head = mqtt.publish_header(topic, _size(payload), qos, retain, False, e[0])
        try:
            if isinstance(payload, list):
                done = self._write_now(conn, head, *payload)
            else:
                done = self._write_now(conn, head, payload)
        except Exception as ex:
            if qos:
                e[_SENT] = None
                self._inflight.append(e)
            self._lost(conn, "send", ex)
            return True
        if not done:
            return False
        if qos:
            self._inflight.append(e)
        self.stats["sent"] += 1
        return True

    async def _write(self, conn, *parts):
        # One lock per connection for every write: packets must not interleave, and on
        # MicroPython two tasks may not wait to write on one stream at the same time.
        w = conn[1]
        async with conn[2]:
            for p in parts:
                w.write(p)
            await platform.wait_for_ms(w.drain(), _WRITE_MS)
        self._tx_at = platform.ticks_ms()

    async def _publish(self, conn, e, qos, dup):
        # e = (or starts like) [pid, topic, payload, retain]; the header is built apart
        # from the payload so a large payload is never copied to prepend a few bytes.
        p = e[2]
        head = mqtt.publish_header(e[1], _size(p), qos, e[3], dup, e[0])
        if isinstance(p, list):
            await self._write(conn, head, *p)
        else:
            await self._write(conn, head, p)
        self.stats["sent"] += 1

    def _new_pid(self):
        # 1..65535, skipping ids still waiting for their ack.
        while True:
            self._pid_next = self._pid_next % 0xFFFF + 1
            p = self._pid_next
            if p == self._sub_pid:
                continue
            for e in self._inflight:
                if e[_PID] == p:
                    break
            else:
                return p

    async def _send_loop(self, conn):
        why = None
        try:
            while conn is self._conn:
                self._fault_point("send")
                self._wake.clear()
                # Subscriptions first, then in-flight messages this connection has not
                # carried (retransmits, DUP set), then the outbox while there is room.
                if self._nsubs < len(self._subs):
                    pid = self._new_pid()
                    if not self._nsubs and not self.connected:
                        # The connect-time SUBSCRIBE: its SUBACK brings the link up.
                        self._sub_pid = pid
                    new = self._subs[self._nsubs:]
                    self._nsubs = len(self._subs)
                    from edge_runtime import mqttopen
                    await self._write(conn, mqttopen.encode_subscribe(pid, new))
                    mqttopen = None
                # A message's send time is set once it is written, on a connection
                # still current (a new one sends it again): until then _send_now writes
                # nothing straight to the socket, which would overtake it. The write
                # lock alone does not keep them in order: on MicroPython a lock handed
                # to a waiting task is not locked() until that task runs, and a run's
                # next event went out ahead of the one the sender held.
                for e in self._inflight:
                    if e[_SENT] is None and conn is self._conn:
                        self.stats["retransmits"] += 1
                        await self._publish(conn, e, 1, True)
                        if conn is self._conn:
                            e[_SENT] = platform.ticks_ms()
                while (len(self._outbox) and len(self._inflight) < self._inflight_max
                       and conn is self._conn):
                    topic, payload, qos, retain = self._outbox.pop()
                    e = [self._new_pid() if qos else 0, topic, payload, retain, None, False]
                    if qos:
                        self._inflight.append(e)
                    # Something left the outbox: wake whoever waits for room. (An
                    # application bug in on_room must not take the link down.)
                    self._room.set()
                    if self._wanted_room:
                        self._wanted_room = False
                        if self.on_room:
                            try:
                                self.on_room()
                            except Exception as ex:
                                log("link: on_room:", repr(ex))
                    await self._publish(conn, e, qos, False)
                    if conn is self._conn:
                        e[_SENT] = platform.ticks_ms()
                if _unsent(conn[1]) and conn is self._conn:
                    await self._write(conn)  # what a direct write left: drain it
                # Look again anyway once the wait runs out: a missed wake-up costs at
                # most this long.
                await self._wake.wait(4 * _TICK_MS)
        except Exception as e:
            why = e
        finally:
            self._lost(conn, "send", why)

    # --- receiving ------------------------------------------------------------------

    async def _read_packet(self, r):
        # The next packet -> (type, flags, body), the body a view of the receive
        # buffer, valid until the next read. The socket is read for as many bytes as
        # have come (up to the buffer's end) and each packet parsed where it lies, so
        # packets that came together (a message and the acks ahead of it) cost one read
        # and a turn of the scheduler each, where reading each packet's first byte,
        # length and body apart took three of each (and 1.1 KiB of heap a packet, in
        # a board's run on the unix port). A PUBLISH too large for the buffer is read
        # past: its topic and packet id are kept in _skipped and it comes back with
        # body None.
        buf = self._rxv
        size = len(buf)
        if self._rxn[0] < self._rxn[1]:
            # Still a turn of the scheduler for each packet, as a read would give: the
            # run that the last message woke takes it before the next is decoded. Taken
            # one after another, a chunk, its answer and the acks between them were all
            # on the heap at the memory thermostat's peak, and its turn at 128 KiB ran
            # out of memory 5 times in 16.
            await platform.sleep_ms(0)
        while True:
            at, end = self._rxn
            head = mqtt.parse_head(buf, at, end, mqtt.FROM_SERVER)
            if head is not None:
                t, flags, n, k = head
                if k + n <= size:
                    if at + k + n <= end:
                        self._rxn[0] = at + k + n
                        return t, flags, buf[at + k:at + k + n]
                elif t != mqtt.PUBLISH:
                    raise mqtt.PacketTooLarge("%s of %d bytes" % (mqtt.packet_name(t), n))
                elif end - at >= k + 2:
                    # Too large: once its topic and packet id are in, the rest is
                    # thrown away as it comes (the broker stops resending a message
                    # only once we acknowledge it, and an unread packet would leave
                    # the stream in the middle of it).
                    want = 2 + (buf[at + k] << 8 | buf[at + k + 1]) + (2 if flags & 6 else 0)
                    if want > n or k + want > size:
                        raise mqtt.MalformedPacket("PUBLISH topic")
                    if end - at >= k + want:
                        topic, _, qos, _, _, pid = mqtt.parse_publish(
                            flags, buf[at + k:at + k + want])
                        left = k + n - (end - at)  # the buffer holds nothing past it
                        self._rxn[0] = self._rxn[1] = 0
                        while left:
                            left -= await read_some(r, buf[:min(left, size)])
                        self._skipped = (topic, pid, qos, n)
                        return t, flags, None
            # More is needed: what is unread goes to the buffer's start (in pieces
            # that do not overlap), then the socket fills the room after it.
            if at:
                for i in range(0, end - at, at):
                    j = min(i + at, end - at)
                    buf[i:j] = buf[at + i:at + j]
                end -= at
                self._rxn[0] = 0
            self._rxn[1] = end + await read_some(r, buf[end:])

    async def _read_loop(self, conn):
        r = conn[0]
        why = None
        try:
            while conn is self._conn:
                self._fault_point("read")
                t, flags, body = await self._read_packet(r)
                self._rx_at = platform.ticks_ms()
                self._ping = None  # any packet shows the broker is there
                if t == mqtt.PUBLISH:
                    if flags & 4:
                        # QoS 2 (or 3, malformed): we never subscribe with 2. Refused
                        # before it is handed on: delivered, then the connection ended,
                        # it would come again on the next one.
                        raise mqtt.MalformedPacket("QoS 2")
                    if self._stopping:
                        # Read after stop(): neither taken nor acknowledged, so the
                        # broker keeps it for the session's next connection (a board
                        # about to reset took a request here, and lost it).
                        continue
                    if body is None:
                        topic, pid, qos, size = self._skipped
                        self.stats["oversized"] += 1
                        if self.on_refused:
                            try:
                                self.on_refused(topic, size)
                            except Exception as e:
                                log("link: on_refused", topic, repr(e))
                    else:
                        topic, payload, qos, _, _, pid = mqtt.parse_publish(flags, body)
                        self.stats["received"] += 1
                        if self.on_message:
                            try:
                                self.on_message(topic, payload)
                            except Exception as e:  # an application bug must not end the link
                                log("link: on_message", topic, repr(e))
                    if qos:
                        # After delivery: if we die first, the broker sends it again.
                        ack = mqtt.encode_puback(pid)
                        if not self._write_now(conn, ack):
                            await self._write(conn, ack)
                elif t == mqtt.PUBACK:
                    pid = mqtt.parse_packet_id(body)
                    for i in range(len(self._inflight)):
                        if self._inflight[i][_PID] == pid:
                            self._inflight.pop(i)
                            if len(self._outbox):
                                # Room in flight for what waits. With nothing waiting
                                # the sender is not woken for each ack of a run's events.
                                self._wake.set()
                            break
                    # else: the ack of a message acked already (we resent it); ignored.
                elif t == mqtt.SUBACK:
                    from edge_runtime import mqttopen
                    pid, codes = mqttopen.parse_suback(body)
                    mqttopen = None
                    if _FAIL in codes:
                        # Up but deaf to a topic would look healthy and lose what comes
                        # on it: the connection is given up, and the next one (after the
                        # backoff) subscribes to everything again. A cluster node that
                        # could not make the subscription yet grants it then.
                        raise mqtt.MqttError("broker refused a subscription")
                    if pid == self._sub_pid:
                        self._sub_pid = 0
                        self._connected()
                    elif self.connected:
                        # A subscribe() made once the link was up: its SUBACK is in,
                        # and the opening's code goes again, as when the link came up.
                        platform.unload("mqttopen")
                elif t != mqtt.PINGRESP:
                    # A second CONNACK, a QoS 2 flow or an UNSUBACK we never caused:
                    # the broker and we disagree about the session.
                    raise mqtt.MalformedPacket(mqtt.packet_name(t))
        except Exception as e:
            why = e
        finally:
            self._lost(conn, "read", why)

    # --- watchdog -------------------------------------------------------------------

    async def _watch_loop(self, conn):
        ka = self.keepalive * 1000
        half = ka // 2
        tick = min(_TICK_MS, max(ka // 4, 50)) if ka else _TICK_MS
        why = None
        try:
            while conn is self._conn:
                await platform.sleep_ms(tick)
                self._fault_point("watch")
                now = platform.ticks_ms()
                if not self.connected and ticks_diff(now, self._opened) > _OPEN_MS:
                    why = "no SUBACK"
                    return
                if ka:
                    # Ping after half a keepalive of silence either way: silence out lets
                    # the broker drop us, silence in may be a dead half-open connection.
                    if self._ping is not None:
                        if ticks_diff(now, self._ping) > half:
                            why = "no PINGRESP"
                            return
                    elif ticks_diff(now, self._tx_at) >= half or ticks_diff(now, self._rx_at) >= half:
                        self._ping = now
                        await self._write(conn, mqtt.PINGREQ_PACKET)
                for e in self._inflight:
                    s = e[_SENT]
                    if s is not None and ticks_diff(now, s) > self.ack_timeout_ms:
                        if e[_RESENT]:
                            why = "no PUBACK"
                            return
                        e[_SENT] = now
                        e[_RESENT] = True
                        self.stats["retransmits"] += 1
                        await self._publish(conn, e, 1, True)
        except Exception as e:
            why = e
        finally:
            self._lost(conn, "watch", why)
