# platform.Bell: the bounded wait an RPC call's reader sleeps in. On the unix port the
# waiting task sleeps and set() brings it forward (the scheduler's own queue); on
# CPython it is an Event under wait_for. The same assertions hold on both, and none is
# about time: each says which of two things happened first.
from edge_runtime import platform
from firmware_tests.support import run

asyncio = platform.asyncio


async def _later(ms, fn):
    await platform.sleep_ms(ms)
    fn()


def test_a_set_wakes_the_waiter_before_its_wait_runs_out():
    async def body():
        bell = platform.Bell()
        seen = []
        asyncio.create_task(_later(5, bell.set))
        # A long wait, and a marker far short of it: the waiter must be back first.
        asyncio.create_task(_later(2000, lambda: seen.append("marker")))
        assert await bell.wait(60000) is True
        seen.append("woken")
        assert seen == ["woken"]
        assert bell.waiting is None and bell.is_set()

    run(body())


def test_a_wait_that_runs_out_says_false():
    async def body():
        bell = platform.Bell()
        assert await bell.wait(5) is False
        assert bell.waiting is None and not bell.is_set()

    run(body())


def test_a_bell_set_before_the_wait_returns_at_once_and_clear_rearms_it():
    async def body():
        bell = platform.Bell()
        bell.set()
        assert await bell.wait(60000) is True
        bell.clear()
        assert await bell.wait(5) is False

    run(body())


def test_a_waiter_cancelled_in_its_wait_is_cancelled_and_leaves_the_bell_clean():
    async def body():
        bell = platform.Bell()
        outcome = []

        async def waiter():
            try:
                await bell.wait(60000)
                outcome.append("returned")
            except asyncio.CancelledError:
                outcome.append("cancelled")
                raise

        task = asyncio.create_task(waiter())
        await platform.sleep_ms(5)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        assert outcome == ["cancelled"]
        assert bell.waiting is None
        # A set with nobody waiting touches no task.
        bell.set()
        assert await bell.wait(60000) is True

    run(body())


def test_a_hundred_rounds_of_ping_and_pong_lose_no_wake_up():
    # Each side waits for the other's set before it sets again: one lost wake-up and a
    # wait runs out (False) instead of the round going on.
    async def body():
        ping, pong = platform.Bell(), platform.Bell()
        answers = []

        async def ponger():
            for _ in range(100):
                answers.append(await ping.wait(10000))
                ping.clear()
                pong.set()

        task = asyncio.create_task(ponger())
        waits = []
        for _ in range(100):
            ping.set()
            waits.append(await pong.wait(10000))
            pong.clear()
        await task
        assert answers == [True] * 100 and waits == [True] * 100
        assert ping.waiting is None and pong.waiting is None

    run(body())
