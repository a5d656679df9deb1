# Helpers shared by the board tests. They run under pytest on CPython and under
# firmware_tests/runner.py on the MicroPython unix port (or a board), so only the
# subset of Python both share is used here.
import os

try:
    import asyncio
except ImportError:  # pragma: no cover
    import uasyncio as asyncio  # type: ignore


def run(coro):
    # Board tests are plain functions; an async body goes through here so pytest needs
    # no plugin and MicroPython needs no special runner.
    return asyncio.run(coro)


def raises(exc_type, fn, *args):
    # pytest.raises does not exist on the board; this returns the exception so a test
    # can assert on its kind and message.
    try:
        fn(*args)
    except exc_type as e:
        return e
    raise AssertionError("expected %s" % exc_type.__name__)


# Set over the raw REPL by `wren hil --broker` on a real board, which has no environment.
BROKER = None


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
