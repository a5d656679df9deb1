# Helpers shared by the board tests. They run under pytest on CPython and under
# firmware_tests/runner.py on the MicroPython unix port (or a board), so only the
# subset of Python both share is used here.
import os
import sys

try:
    import asyncio
except ImportError:  # pragma: no cover
    import uasyncio as asyncio  # type: ignore


def run(coro):
    # Board tests are plain functions; an async body goes through here so pytest needs
    # no plugin and MicroPython needs no special runner.
    try:
        return asyncio.run(coro)
    finally:
        if sys.implementation.name == "micropython":
            # MicroPython's asyncio.run returns with the tasks the body left still queued
            # (CPython's cancels them): a runtime's own background work, such as
            # Runtime._call_room polling a stopped link whose last messages the broker
            # had not acknowledged, ran on in the next test's loop and held this test's
            # runtime and link, two 4 KB receive buffers among them. A fresh loop drops
            # them, as a board's reset would.
            asyncio.new_event_loop()


def raises(exc_type, fn, *args):
    # pytest.raises does not exist on the board; this returns the exception so a test
    # can assert on its kind and message.
    try:
        fn(*args)
    except exc_type as e:
        return e
    raise AssertionError("expected %s" % exc_type.__name__)


# Set by `wren hil --broker` through the runner (tools/hil.py; a real board has no
# environment): the broker, and a topic root of the run's own ("wren-hil/<tag>"). With
# PREFIX set, the tests' topics live under it and their client ids end in "-<tag>", so
# on a broker of the user's they touch no topic, session or presence of theirs, and
# whatever they leave can be found and cleared. Unset, the runtime's default prefix.
BROKER = None
PREFIX = None
# The client ids that connected with a persistent session (session_id), which the
# harness clears however the test ended.
SESSIONS = []


def topic_root():
    # Read at each use, not bound at import: the runner sets PREFIX after the module's
    # import, whose compile is the heap's peak.
    if PREFIX is not None:
        return PREFIX
    from edge_runtime.events import PREFIX as default
    return default


def client_id(name):
    # Client ids are global on a broker, whatever the topics: tagged with the run's.
    if PREFIX is None:
        return name
    return "%s-%s" % (name, PREFIX[PREFIX.rfind("/") + 1:])


def session_id(name):
    # client_id for a link with a persistent session, noted for the harness to clear.
    cid = client_id(name)
    if cid not in SESSIONS:
        SESSIONS.append(cid)
    return cid


def broker_address():
    # Set by the pytest fixture that started Mosquitto (and passed on to the unix
    # port through the environment), or by `wren hil`. None when there is no broker.
    if BROKER is not None:
        return BROKER
    getenv = getattr(os, "getenv", None)
    spec = getenv("WREN_TEST_BROKER") if getenv else None
    if not spec:
        return None
    host, port = spec.rsplit(":", 1)
    return host, int(port)


def scratch(name):
    # A path prefix for the files a test's board writes (core memory, checkpoints): in a
    # folder of their own under /tmp where there is one (CPython, the unix port), not
    # /tmp itself, whose other files a board listing its folder would read too; else the
    # board's own flash root.
    try:
        os.stat("/tmp")
    except (OSError, AttributeError):
        return name + "-"
    try:
        os.mkdir("/tmp/wren-fw")
    except OSError:
        pass  # there already
    return "/tmp/wren-fw/%s-" % name


def checkpoints(prefix):
    # The paused-run checkpoints (pause.py, ck_<run id>) a board with this scratch prefix
    # left: a test of pausing starts without any, or one from a run killed mid-test
    # comes back as a paused run of its own.
    cut = prefix.rfind("/") + 1
    found = []
    for e in getattr(os, "ilistdir", os.listdir)(prefix[:cut] or "."):
        n = e if isinstance(e, str) else e[0]
        if n.startswith(prefix[cut:] + "ck_"):
            found.append(prefix[:cut] + n)
    return found


def remove(*paths):
    for p in paths:
        for path in (p, p + ".tmp"):
            try:
                os.remove(path)
            except OSError:
                pass


# A broker's (or a scripted peer's) way of reading packets off a stream. The board's
# Link parses what it has read in its buffer with mqtt.parse_head instead, so these
# live with the tests, not in the board's heap.
async def read_head(reader, sender="b"):
    # mqtt.parse_head over a stream, a byte at a time -> (type, flags, remaining length).
    from edge_runtime import mqtt
    head = bytearray(5)
    for i in range(5):
        head[i] = (await reader.readexactly(1))[0]
        got = mqtt.parse_head(head, 0, i + 1, sender)
        if got is not None:
            return got[0], got[1], got[2]


async def read_packet(reader, limit, sender="b"):
    # One whole packet -> (type, flags, body), the body a new bytes object. A packet
    # over `limit` bytes is refused before its body is read.
    from edge_runtime import mqtt
    t, flags, n = await read_head(reader, sender)
    if n > limit:
        raise mqtt.PacketTooLarge("%s of %d bytes" % (mqtt.packet_name(t), n))
    return t, flags, (await reader.readexactly(n) if n else b"")
