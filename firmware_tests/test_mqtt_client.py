# The Link against a real broker (the session's Mosquitto, address from
# WREN_TEST_BROKER): publish/subscribe, QoS 1 redelivery across a cut connection,
# the last will, a full outbox, the order of what the sender and a direct publish
# write, messages over the receive buffer, a persistent
# session, and a MemoryError in each of the link's tasks. The other MQTT clients here
# are Links too, so the module runs unchanged on the MicroPython unix port.
import random
import sys

from edge_runtime import mqtt, mqttopen
from edge_runtime.link import Link
from edge_runtime.platform import asyncio, sleep_ms, wait_for_ms
from firmware_tests.support import broker_address, client_id, read_packet, run, session_id, topic_root

WAIT_MS = 10000  # every wait here is bounded by this


def _broker():
    addr = broker_address()
    assert addr is not None, "WREN_TEST_BROKER is not set (the pytest fixture sets it)"
    return addr


def _base():
    # A topic subtree of this test's own: the broker outlives a single test.
    return "%s/test/%06x" % (topic_root(), random.getrandbits(24))


def _link(name, port=None, **kw):
    host, bport = _broker()
    kw.setdefault("backoff_ms", (20, 200))
    cid = client_id("%s-%06x" % (name, random.getrandbits(24)))
    return Link(cid, host, port or bport, **kw)


async def _until(pred, what, ms=WAIT_MS):
    waited = 0
    while not pred():
        assert waited < ms, "timed out waiting for " + what
        await sleep_ms(20)
        waited += 20


async def _with(links, body):
    # Runs the links' supervisors around body() and always stops them: on MicroPython a
    # task left behind would run on in the next test's event loop.
    tasks = [asyncio.create_task(k.run()) for k in links]
    try:
        for k in links:
            assert await k.wait_connected(WAIT_MS), "link did not connect"
        await body()
    finally:
        for k in links:
            k.stop()
        for t in tasks:
            try:
                await wait_for_ms(t, WAIT_MS)
            except asyncio.TimeoutError:
                t.cancel()


def _subscriber(topic):
    # A link that collects what arrives on `topic` (QoS 1) into `got`.
    got, on_message = _collector()
    sub = _link("sub", on_message=on_message)
    sub.subscribe(topic, 1)
    return got, sub


async def _after_subscribed(sub, dev, body):
    # sub runs and is subscribed before dev's link starts, so it misses nothing dev
    # sends; then body() runs with dev's link (_with), and sub is always stopped.
    sub_task = asyncio.create_task(sub.run())
    try:
        assert await sub.wait_connected(WAIT_MS)
        await _with([dev], body)
    finally:
        sub.stop()
        await wait_for_ms(sub_task, WAIT_MS)


def _collector():
    got = []

    def on_message(topic, payload):
        got.append((topic, bytes(payload)))  # a view of the receive buffer: copied

    return got, on_message


def test_publish_subscribe_round_trip_qos0_qos1_and_retained():
    base = _base()

    async def main():
        got, sub = _subscriber(base + "/+")
        pub = _link("pub")

        async def body():
            pub.publish(base + "/a", b"zero", 0)
            pub.publish(base + "/b", bytearray(b"one"), 1)
            pub.publish(base + "/c", memoryview(b"kept"), 1, True)
            await _until(lambda: len(got) == 3, "three messages")
            assert sorted(got) == [(base + "/a", b"zero"), (base + "/b", b"one"),
                                   (base + "/c", b"kept")]
            await _until(lambda: pub.pending == 0, "PUBACKs")
            assert pub.stats["sent"] == 3 and pub.stats["retransmits"] == 0
            assert sub.stats["received"] == 3

        await _with([sub, pub], body)

        # A subscriber that comes later gets the retained message.
        late_got, on_late = _collector()
        late = _link("late", on_message=on_late)
        late.subscribe(base + "/c", 0)
        clear = _link("clear")

        async def later():
            await _until(lambda: late_got == [(base + "/c", b"kept")], "the retained message")
            clear.publish(base + "/c", b"", 1, True)  # an empty retained message clears it
            await _until(lambda: clear.pending == 0, "the clearing PUBACK")

        await _with([late, clear], later)

    run(main())


def test_a_subscribe_once_the_link_is_up_lets_the_opening_code_go_after_its_suback():
    # subscribe() on a link that is up sends its SUBSCRIBE at once; the packet and its
    # SUBACK are mqttopen.py's, loaded for them. Once the SUBACK is in, that code goes
    # again (from .mpy, as on a board), as it goes when a link comes up; and the link,
    # up already, does not come up a second time (it did once: a link that connected
    # with no subscription took the first later SUBACK for its connect-time one).
    async def main():
        base = _base()
        got, on_msg = _collector()
        ups = []
        link = _link("upsub", on_message=on_msg, on_connect=lambda: ups.append(1))
        keep = _link("keep")

        async def body():
            keep.publish(base + "/r", b"retained", 1, True)
            await _until(lambda: keep.pending == 0, "the retained message's PUBACK")
            assert link.connected
            link.subscribe(base + "/r", 1)
            # The broker sends the SUBACK, then the retained message, on one connection.
            await _until(lambda: got == [(base + "/r", b"retained")], "the retained message")
            if getattr(mqttopen, "__file__", "").endswith(".mpy"):
                assert "edge_runtime.mqttopen" not in sys.modules
            assert len(ups) == 1 and link.stats["connects"] == 1
            keep.publish(base + "/r", b"", 1, True)
            await _until(lambda: keep.pending == 0, "the clearing PUBACK")

        await _with([link, keep], body)

    run(main())


class CutProxy:
    # Sits between a Link and the broker and forwards whole packets both ways, except
    # that it swallows the first PUBLISH on `topic` from the client and cuts both
    # connections right there: the broker never got that message and the client never
    # got its PUBACK. Whatever comes later is forwarded, and the flags of every PUBLISH
    # on `topic` are kept in `seen`.
    def __init__(self, topic):
        self.topic = topic
        self.seen = []
        self.pairs = []
        self.cut = False

    async def start(self):
        if sys.implementation.name != "micropython":
            self.server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]
            return self
        for _ in range(20):  # the unix port cannot report a kernel-chosen port
            self.port = 20000 + random.getrandbits(15)
            try:
                self.server = await asyncio.start_server(self._accepted, "127.0.0.1", self.port)
                return self
            except OSError:
                pass
        raise OSError("no free port for the proxy")

    async def _accepted(self, cr, cw):
        host, port = _broker()
        br, bw = await asyncio.open_connection(host, port)
        pair = [cw, bw, None, None]
        self.pairs.append(pair)
        pair[2] = asyncio.create_task(self._pump(pair, cr, bw, mqtt.FROM_CLIENT, 3))
        pair[3] = asyncio.create_task(self._pump(pair, br, cw, mqtt.FROM_SERVER, 2))

    async def _pump(self, pair, r, w, side, other):
        try:
            while True:
                t, flags, body = await read_packet(r, 1 << 20, side)
                if side == mqtt.FROM_CLIENT and t == mqtt.PUBLISH:
                    if mqtt.parse_publish(flags, body)[0] == self.topic:
                        self.seen.append(flags)
                        if not self.cut:
                            self.cut = True
                            await self._drop(pair, other)
                            return
                w.write(bytes((t << 4 | flags,)) + mqttopen.encode_length(len(body)) + body)
                await w.drain()
        except (OSError, EOFError, mqtt.MqttError):
            await self._drop(pair, other)

    async def _drop(self, pair, other=None):
        # The other direction's task first: on MicroPython a socket must not be closed
        # under a task that is waiting on it.
        for i in (2, 3):
            if pair[i] is not None and (other is None or i == other):
                pair[i].cancel()
        for w in pair[:2]:
            w.close()
            try:
                await w.wait_closed()
            except OSError:
                pass

    async def close(self):
        for pair in self.pairs:
            await self._drop(pair)
        self.server.close()
        await self.server.wait_closed()


def test_qos1_message_is_redelivered_after_the_connection_is_cut():
    base = _base()
    topic = base + "/evt"

    async def main():
        proxy = await CutProxy(topic).start()
        got, sub = _subscriber(topic)
        dev = _link("dev", proxy.port)

        async def body():
            dev.publish(topic, b"must arrive", 1)
            await _until(lambda: got, "the redelivered message")
            await _until(lambda: dev.pending == 0, "the PUBACK")
            assert got == [(topic, b"must arrive")]
            # First try QoS 1 (flags 0010), cut; the retry carries DUP (1010).
            assert proxy.seen == [0x02, 0x0A], proxy.seen
            assert dev.stats["reconnects"] == 1 and dev.stats["retransmits"] == 1

        try:
            await _with([sub, dev], body)
        finally:
            await proxy.close()

    run(main())


def test_last_will_is_published_when_the_connection_drops():
    base = _base()
    will_topic = base + "/status"

    async def main():
        got, on_message = _collector()
        watcher = _link("watch", on_message=on_message)
        watcher.subscribe(will_topic, 1)
        dev = _link("dev", will=(will_topic, b"offline", 1, False))

        async def body():
            # Gone without a DISCONNECT, as when a board loses power or Wi-Fi: the
            # broker publishes the will.
            dev.reconnect("test: connection cut")
            await _until(lambda: got, "the will")
            assert got == [(will_topic, b"offline")]
            assert await dev.wait_connected(WAIT_MS)  # and the link came back by itself

        await _with([watcher, dev], body)

    run(main())


def test_a_stop_without_a_clean_end_lets_the_broker_publish_the_will():
    # stop() says DISCONNECT: no will. stop(False), a board about to reset (board.py),
    # drops the connection, and the broker says offline for it.
    base = _base()

    async def main():
        got, on_message = _collector()
        watcher = _link("watch", on_message=on_message)
        watcher.subscribe(base + "/+", 1)
        clean = _link("clean", will=(base + "/clean", b"offline", 1, False))
        dropped = _link("dropped", will=(base + "/dropped", b"offline", 1, False))

        async def body():
            # The clean stop ends first, whole (its run() returns once it has said
            # DISCONNECT and closed): had the broker a will to send for it, it would
            # come before the dropped link's.
            task = asyncio.create_task(clean.run())
            assert await clean.wait_connected(WAIT_MS)
            clean.stop()
            await wait_for_ms(task, WAIT_MS)
            dropped.stop(False)
            await _until(lambda: got, "the dropped link's will")
            assert got == [(base + "/dropped", b"offline")]

        await _with([watcher, dropped], body)

    run(main())


def test_a_full_outbox_refuses_and_loses_nothing_it_took():
    base = _base()
    topic = base + "/evt"

    async def main():
        got, sub = _subscriber(topic)
        dev = _link("dev", outbox_size=4)
        # While the link is not running, four wait; the rest are refused, not dropped
        # in place of older ones. `spare` keeps slots for others.
        taken = [dev.publish(topic, ("m%d" % i).encode(), 1) for i in range(6)]
        assert taken == [True, True, True, True, False, False]
        assert dev.stats["refused"] == 2 and dev.pending == 4
        assert not dev.room() and not dev.publish(topic, b"x", 1, spare=2)
        rooms = []
        dev.on_room = lambda: rooms.append(1)

        async def body():
            assert await dev.wait_room(WAIT_MS, spare=3)  # the sender empties it
            await _until(lambda: len(got) == 4, "four messages")
            assert [p for _, p in got] == [b"m0", b"m1", b"m2", b"m3"]
            assert rooms, "on_room was not called after a refusal"
            await _until(lambda: dev.pending == 0, "PUBACKs")

        await _after_subscribed(sub, dev, body)

    run(main())


def test_a_publish_made_while_the_sender_writes_a_message_goes_out_behind_it():
    # The sender took m0 from the outbox and tells on_room before it writes it; a
    # publish from on_room (the runtime pumps its rings there) found the outbox empty
    # and the socket free, went straight onto it and overtook m0. So did a run's next
    # event while the write lock passed to the sender (on MicroPython a lock handed to
    # a waiting task is not locked() until it runs): the bridge then read the board's
    # events out of order.
    base = _base()
    topic = base + "/order"

    async def main():
        got, sub = _subscriber(topic)
        dev = _link("dev", outbox_size=1)
        assert dev.publish(topic, b"m0", 1)  # waits: the link is not running yet
        assert not dev.publish(topic, b"m1", 1)  # refused: on_room will be told
        late = []
        dev.on_room = lambda: late.append(dev.publish(topic, b"late", 1))

        async def body():
            await _until(lambda: len(got) == 2, "both messages")
            assert late == [True] and [p for _, p in got] == [b"m0", b"late"]

        await _after_subscribed(sub, dev, body)

    run(main())


def test_acks_wake_the_sender_for_what_waits_and_a_message_allocates_little():
    # With one message in flight at a time, each PUBACK must wake the sender for the next
    # one waiting. With none waiting it leaves the sender asleep, and the sender's wait
    # allocates nothing (a Bell). On the unix port (64-bit) a QoS 1 message, its ack, its
    # delivery to the subscriber here (a Link in the same heap) and the test's waiting
    # allocated 4,851 bytes when the sender waited on an Event under wait_for and every
    # ack woke it; 3,699 now.
    base = _base()
    topic = base + "/acks"

    async def main():
        got, sub = _subscriber(topic)
        dev = _link("dev", inflight=1, outbox_size=8)

        async def one(payload):
            assert dev.publish(topic, payload, 1)
            await _until(lambda: dev.pending == 0, "the PUBACK")
            await sleep_ms(5)  # the ack handled, the sender's turn over

        async def body():
            for i in range(5):
                assert dev.publish(topic, b"w%d" % i, 1)
            await _until(lambda: len(got) == 5, "five messages, one in flight at a time")
            assert [p for _, p in got] == [b"w0", b"w1", b"w2", b"w3", b"w4"]
            payload = bytearray(120)
            for _ in range(3):
                await one(payload)
            if sys.implementation.name == "micropython":
                import gc
                n = 10  # as `measured` below
                gc.collect()
                gc.disable()
                try:
                    before = gc.mem_alloc()
                    for _ in range(n):
                        await one(payload)
                    each = (gc.mem_alloc() - before) // n
                finally:
                    gc.enable()
                assert each <= 4200, "%d bytes allocated per message and its ack" % each
            measured = 10 if sys.implementation.name == "micropython" else 0
            await _until(lambda: len(got) == 5 + 3 + measured, "every message")

        await _after_subscribed(sub, dev, body)

    run(main())


def test_a_message_over_the_receive_buffer_is_read_past_and_the_link_stays_up():
    base = _base()
    topic = base + "/req"

    async def main():
        got, on_message = _collector()
        refused = []
        small = _link("small", rx_size=1024, on_message=on_message,
                      on_refused=lambda t, n: refused.append((t, n)))
        small.subscribe(topic, 1)
        pub = _link("pub", max_packet=40000)

        async def body():
            # Several receive buffers' worth, but no block a fragmented 128K heap (the
            # pty pass: the raw REPL's own allocations) cannot give.
            pub.publish(topic, b"A" * 6000, 1)
            pub.publish(topic, b"after", 1)
            await _until(lambda: got, "the message after the oversized one")
            assert got == [(topic, b"after")]
            assert len(refused) == 1 and refused[0][0] == topic and refused[0][1] > 6000
            assert small.stats["oversized"] == 1 and small.stats["reconnects"] == 0
            assert small.max_payload < 1024

        await _with([small, pub], body)

    run(main())


def test_a_persistent_session_keeps_what_was_sent_while_away():
    base = _base()
    topic = base + "/req"
    cid = session_id("persist-%06x" % random.getrandbits(24))

    async def main():
        host, port = _broker()
        got, on_message = _collector()
        first = Link(cid, host, port, clean_session=False, on_message=on_message)
        first.subscribe(topic, 1)
        pub = _link("pub")
        await _with([first], _nothing)
        # `first` is gone (its session kept by the broker); this waits for it there.
        await _with([pub], lambda: _publish_acked(pub, topic, b"while away"))
        again = Link(cid, host, port, clean_session=False, on_message=on_message)
        again.subscribe(topic, 1)

        async def body():
            assert again.session_present
            await _until(lambda: got, "the message queued while away")
            assert got == [(topic, b"while away")]

        await _with([again], body)
        # Leave no session behind on the shared test broker.
        await _with([Link(cid, host, port, clean_session=True)], _nothing)

    run(main())


async def _nothing():
    pass


async def _publish_acked(link, topic, payload):
    link.publish(topic, payload, 1)
    await _until(lambda: link.pending == 0, "the PUBACK")


def test_a_memory_error_in_any_link_task_ends_the_connection_and_it_comes_back():
    base = _base()
    topic = base + "/x"

    async def main():
        got, on_message = _collector()
        dev = _link("dev", keepalive=1, on_message=on_message)
        dev.subscribe(topic, 1)

        async def body():
            for n, task in enumerate(("read", "watch", "send")):
                dev.fault = task
                # The reader meets its fault at the next packet: a PINGRESP within a
                # keepalive, or this message; the sender at its next wake-up.
                dev.publish(topic, ("before %s" % task).encode(), 1)
                await _until(lambda: dev.stats["reconnects"] == n + 1, "a reconnect after " + task)
                assert dev.fault is None
                assert await dev.wait_connected(WAIT_MS), "no reconnect after " + task
                dev.publish(topic, ("after %s" % task).encode(), 1)
                await _until(lambda: (topic, ("after %s" % task).encode()) in got,
                             "a round trip after " + task)

        await _with([dev], body)

    run(main())


def test_the_link_turns_nagle_off_on_its_socket():
    # Each of the link's small messages waits on the one before; with Nagle on, each
    # small write waits up to 40 ms for the broker's delayed ACK. MicroPython's socket
    # cannot read the option back, so the Link says whether setsockopt took it; on
    # CPython the socket itself is asked too.
    link = _link("nodelay")

    async def body():
        assert link.stats["nodelay"] == 1
        if sys.implementation.name == "cpython":
            import socket
            sock = link._conn[1].get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0

    run(_with([link], body))
