# The board's view of its machine: clocks, sleeping, the flash file system, settings
# and the log. MicroPython and CPython differ here and nowhere else (but for joining
# Wi-Fi, wifi.py, loaded only by a board whose settings name a network), so every other
# board module imports its clock and file helpers from this one.
import sys
import time

try:
    import asyncio
except ImportError:  # pragma: no cover - very old MicroPython ports
    import uasyncio as asyncio  # type: ignore

IS_MICROPYTHON = sys.implementation.name == "micropython"

if IS_MICROPYTHON:
    ticks_ms = time.ticks_ms
    ticks_diff = time.ticks_diff
    ticks_add = time.ticks_add
else:
    _start = time.monotonic()

    def ticks_ms():
        return int((time.monotonic() - _start) * 1000)

    def ticks_diff(a, b):
        return a - b

    def ticks_add(a, b):
        return a + b


def time_ms():
    # Wall clock in ms for event timestamps. On a board without RTC sync this is
    # seconds since its epoch; the bridge stamps its own receive time anyway.
    if hasattr(time, "time_ns"):
        return time.time_ns() // 1000000
    return int(time.time() * 1000)


# On MicroPython, asyncio's own sleep_ms rather than a coroutine around it: every call
# of an async function allocates its generator (240 bytes on the 64-bit unix port), and
# the link's reader sleeps for each packet that came with others.
if IS_MICROPYTHON:
    sleep_ms = asyncio.sleep_ms
else:
    async def sleep_ms(ms):
        await asyncio.sleep(ms / 1000)


async def wait_for_ms(aw, ms):
    # Every wait on the board is bounded; this raises asyncio.TimeoutError past ms. A
    # coroutine of its own: asyncio.wait_for_ms is loaded (asyncio.funcs) when a wait
    # first needs it.
    if IS_MICROPYTHON:
        return await asyncio.wait_for_ms(aw, ms)
    return await asyncio.wait_for(aw, ms / 1000)


# The machine's clock, kept to put back after a test swapped it.
_MACHINE = (ticks_ms, sleep_ms, wait_for_ms)


def use_clock(clock=None):
    # Tests only: board modules read the clock as platform.ticks_ms(), platform.sleep_ms()
    # and platform.wait_for_ms() at call time, so a clock a test drives
    # (firmware_tests/clock.py) can stand in for the machine's while the real Link and
    # Runtime run; None puts the machine's back. ticks_diff and ticks_add stay: the
    # stand-in keeps to the machine's ticks arithmetic. Nothing changes until it is called.
    global ticks_ms, sleep_ms, wait_for_ms
    if clock is None:
        ticks_ms, sleep_ms, wait_for_ms = _MACHINE
    else:
        ticks_ms, sleep_ms, wait_for_ms = clock.ticks_ms, clock.sleep_ms, clock.wait_for_ms


class Bell:
    # An asyncio Event for one waiting task, whose wait(ms) is bounded by itself: True
    # once set, False when ms ran out first. Under asyncio.wait_for each wait made two
    # tasks and took three turns of the scheduler to wake (28 us p50 on the unix port,
    # for every chunk of a streamed answer); on MicroPython the task here sleeps, and
    # set() brings its wake-up forward to now, as the scheduler's own Task.cancel does
    # for a sleeping task: one turn (9 us), nothing allocated. Elsewhere (CPython, or a
    # test's clock) it is an Event under wait_for_ms.

    def __init__(self):
        self.state = False
        self.waiting = None  # the task asleep in wait() (MicroPython)
        self.data = asyncio.Event()

    def set(self):
        self.state = True
        self.data.set()
        t = self.waiting
        if t is not None and ticks_diff(t.ph_key, ticks_ms()) > 0:
            queue = asyncio.core._task_queue
            queue.remove(t)
            queue.push(t)

    def clear(self):
        self.state = False
        self.data.clear()

    def is_set(self):
        return self.state

    async def wait(self, ms):
        if self.state:
            return True
        if IS_MICROPYTHON and wait_for_ms is _MACHINE[2]:
            self.waiting = asyncio.current_task()
            try:
                await asyncio.sleep_ms(ms)
            finally:
                self.waiting = None
        else:
            try:
                await wait_for_ms(self.data.wait(), ms)
            except asyncio.TimeoutError:
                pass
        return self.state


async def read_some(stream, mv):
    # What an asyncio stream has, at least one byte and at most len(mv), into mv -> the
    # count. MicroPython's streams read straight into a buffer the caller allocated
    # once; CPython's have no readinto, so there a read's bytes are copied in (CPython
    # is the simulation, not where the heap is small).
    if IS_MICROPYTHON:
        # None, though the socket was readable: a TLS record not all here yet (tls.py);
        # 0 is the end of the stream.
        k = None
        while k is None:
            k = await stream.readinto(mv)
    else:
        data = await stream.read(len(mv))
        k = len(data)
        mv[:k] = data
    if not k:
        raise EOFError("stream ended")
    return k


def collect():
    # Collect at the board's quiet points (a run's step boundary, its end) while little
    # is live: the small heap then stays in few large free blocks instead of fragments.
    # CPython manages its own memory; a full collection there would only cost time.
    if IS_MICROPYTHON:
        import gc
        gc.collect()


def collect_often(fraction=4):
    # Collect whenever 1/fraction of the free heap has been allocated since the last
    # collection, rather than only when an allocation fails (MicroPython only). A
    # quarter: a run collects at its own quiet points (after its model call is out, at
    # its end), and what a request allocates until its call is out (about 6 KB) then
    # stays under the threshold; at an eighth a collection landed on that path and on
    # a chunk's way to its msg.delta (0.2-0.3 ms each on the unix port; min heaps the
    # same, bench_heap).
    if IS_MICROPYTHON:
        import gc
        gc.collect()
        gc.threshold(gc.mem_free() // fraction)


def unload(name):
    # Lets the board module edge_runtime.<name> go: sys.modules and the package stop
    # holding it, so once no function, class or instance of it is alive, the heap gets
    # its code back (and the next import reads it from flash again; its names stay
    # interned, so nothing adds up). For modules a run needs only at its edges (state,
    # core), which then are not on the heap while the model loop runs, where a run's
    # heap peaks. Only a module loaded from .mpy: one compiled from its source on the
    # board would be parsed again at each import, each time with the parser's own heap
    # peak and its time (not measured here; bench_heap's .py turn is 163 KiB with or
    # without this check).
    import edge_runtime
    module = sys.modules.get("edge_runtime." + name)
    if module is None or not getattr(module, "__file__", "").endswith(".mpy"):
        return
    sys.modules.pop("edge_runtime." + name)
    try:
        delattr(edge_runtime, name)
    except AttributeError:
        pass


def log(*parts):
    # One line per event, prefixed so a serial console and the virtual board's
    # output read the same.
    print("wren:", *parts)


def print_exception(e):
    # Where an exception the board survives came from, on the console (a run out of
    # memory: which allocation, under which call), as MicroPython prints it.
    if IS_MICROPYTHON:
        sys.print_exception(e)
    else:
        import traceback
        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stdout)


def free_heap():
    # Free heap in bytes on MicroPython (None elsewhere: CPython's gc cannot say).
    if IS_MICROPYTHON:
        import gc
        return gc.mem_free()


def read_file(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def write_file(path, data):
    # Whole or not at all: written to a temporary file beside it, then renamed over it,
    # so a reset mid-write leaves the old file, never half of the new one. A FAT volume
    # will not rename onto an existing file; there the old one goes first (a reset in
    # that instant leaves the temporary file, and no file under the name).
    import os

    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        # data: bytes, or a list of parts written one after another (codec.encode_parts).
        for part in data if type(data) is list else (data,):
            f.write(part)
    try:
        os.rename(tmp, path)
    except OSError:
        os.remove(path)
        os.rename(tmp, path)


def load_settings(path="settings.json"):
    # Settings live on flash as JSON (device, broker host/port, user, password, limits);
    # `wren board --virtual` writes them for the simulation.
    import json

    raw = read_file(path)
    if raw is None:
        return {}
    return json.loads(raw)
