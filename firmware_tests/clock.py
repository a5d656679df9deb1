# A board clock a test moves forward, for the timing tests (keepalive pings, a late
# PUBACK, the bridge's grace, a run's stall bound): the board's time jumps ahead instead
# of the test sleeping through it for real. Not a test module: it holds no tests.
#
# The clock runs at the machine's pace plus an offset, so the network, the broker and
# every bounded wait behave as they always do; advance(ms) adds to the offset and wakes
# whatever sleeps on it. It only stands in for the clock source (platform.use_clock):
# the Link and the Runtime under test are the real ones, reading the time through
# platform as on a board. Runs on CPython and on MicroPython alike.
#
# A test's own bounds stay on the machine's clock: the test modules and the scripted
# bridge bind sleep_ms and wait_for_ms from platform by name at import, before any
# clock is swapped in.
import sys

from edge_runtime import platform
from edge_runtime.platform import asyncio, ticks_add, ticks_diff
from firmware_tests.support import run

# The machine's clock, whatever stands in for it: the real-time part of every wait here.
_ticks_ms, _sleep_ms = platform._MACHINE[:2]
# A sleep on this clock looks at it again at least this often (machine time), so a move
# reaches it within this long. Polled rather than woken: on MicroPython a sleep may not
# wait in a wait_for of its own, or the wait_for it serves (platform.wait_for_ms) would
# take the cancel that ends it for the inner one's.
_LOOK_MS = 5
# advance() gives the sleeps that fell due this long (machine time) to return.
_SETTLE_MS = 5000


class Clock:
    def __init__(self):
        self.offset = 0
        self._sleeps = []  # the deadline (a one-item list each) of every sleep on it now

    def run(self, coro):
        # support.run(coro) with this clock as the board's; the machine's comes back
        # however coro ends.
        platform.use_clock(self)
        try:
            return run(coro)
        finally:
            platform.use_clock(None)

    def ticks_ms(self):
        return ticks_add(_ticks_ms(), self.offset)

    async def sleep_ms(self, ms):
        if ms <= 0:
            await _sleep_ms(0)  # a turn for the others, as the machine's sleep gives
            return
        s = [ticks_add(self.ticks_ms(), ms)]
        self._sleeps.append(s)
        try:
            while True:
                left = ticks_diff(s[0], self.ticks_ms())
                if left <= 0:
                    return
                await _sleep_ms(min(left, _LOOK_MS))
        finally:
            for i in range(len(self._sleeps)):
                if self._sleeps[i] is s:  # by identity: two sleeps may share a deadline
                    self._sleeps.pop(i)
                    break

    if sys.implementation.name == "micropython":
        def wait_for_ms(self, aw, ms):
            # MicroPython's own wait_for, timed by this clock's sleep.
            return asyncio.wait_for(aw, ms, self.sleep_ms)
    else:
        async def wait_for_ms(self, aw, ms):
            # asyncio.wait_for's contract with the deadline on this clock: the result,
            # or the awaited cancelled and TimeoutError; cancelled from outside, the
            # awaited is cancelled too.
            task = asyncio.ensure_future(aw)
            timer = asyncio.ensure_future(self.sleep_ms(ms))
            try:
                await asyncio.wait((task, timer), return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                task.cancel()
                raise
            finally:
                timer.cancel()
            if not task.done():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    raise asyncio.TimeoutError() from None
            return task.result()

    async def advance(self, ms):
        # Moves the clock on by ms and returns once every sleep that fell due has
        # returned to its caller, which has run on to its next wait: the test can then
        # look at what the timer did. Tasks created just before get their first turn
        # (and start their sleeps) before the time moves.
        await _sleep_ms(0)
        self.offset += ms
        now = self.ticks_ms()
        due = [s for s in self._sleeps if ticks_diff(s[0], now) <= 0]
        start = _ticks_ms()
        while [s for s in due if self._sleeping(s)]:
            assert ticks_diff(_ticks_ms(), start) < _SETTLE_MS, "a sleep due did not return"
            await _sleep_ms(1)

    def _sleeping(self, s):
        # By identity: two sleeps may share a deadline.
        for t in self._sleeps:
            if t is s:
                return True
        return False
