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
    # A path prefix for the files a test's board writes (core memory): under /tmp where
    # there is one (CPython, the unix port), else the board's own flash root.
    try:
        os.stat("/tmp")
        return "/tmp/wren-fw-%s-" % name
    except (OSError, AttributeError):
        return name + "-"


def remove(*paths):
    for p in paths:
        for path in (p, p + ".tmp"):
            try:
                os.remove(path)
            except OSError:
                pass
