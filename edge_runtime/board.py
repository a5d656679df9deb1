# Boot a board: read settings from flash, start the watchdog and join the network
# (wifi.py), wire the runtime to the link and hand control to the link's supervisor for
# the life of the board.
from edge_runtime import platform

# The link, a collection, then the runtime: from source, the compiler's peak is the
# parse of a large module on top of everything loaded before it, and link.py is now the
# largest source; parsed first and collected after, `import edge_runtime.board` needed
# 120-122 KiB (64-bit unix port), where runtime-first needed 130 and failed at some
# sizes above that (a fragmented heap). Issue 24's recovery code took it to 134 KiB
# (from .mpy, what a board runs, it needs 92): runs.py's compile is the peak.
from edge_runtime.link import Link

platform.collect()
from edge_runtime.runs import Runtime  # noqa: E402


async def run_board(agent, settings):
    # Returns why the board must reset (None when it stopped): its link found no heap to
    # connect, one connection after another (Link.run), or the runtime found an idle
    # board's heap too low to take a request (Runtime._call_room).
    device = settings["device"]
    runtime = Runtime(agent, device, settings)
    # TLS (tls.py) when the settings name a CA: MQTT's TLS port unless told otherwise.
    tls = settings.get("tls")
    port = settings.get("port", 8883 if tls else 1883)
    # A stable client id and a persistent session: what the bridge sends while the
    # board is away waits for it at the broker.
    link = Link(
        settings.get("client_id", device),
        settings.get("host", "127.0.0.1"),
        port,
        user=settings.get("user", device),
        password=settings.get("password"),
        keepalive=settings.get("keepalive", 30),
        outbox_size=settings.get("outbox", 16),
        inflight=settings.get("inflight", 8),
        tls=tls,
        **runtime.link_settings()
    )
    runtime.attach(link)
    # The watchdog and Wi-Fi, for a board whose settings name either (wifi.py, loaded
    # only then), once the runtime's and the link's buffers are made in a whole heap (a
    # join's garbage before them left no block for the link's at 128K): the network is
    # joined before the link dials, and again by the link before a dial that finds it
    # gone (wifi.start sets Link.wifi).
    if settings.get("wifi") or settings.get("wdt_ms"):
        from edge_runtime import wifi
        await wifi.start(settings, link)
    platform.collect_often()
    # One string, not words: "broker" alone would be a name in the board's pool.
    platform.log("board %s agent %s %s broker %s:%s" % (
        device, agent.name, agent.version, settings.get("host", "127.0.0.1"), port))
    try:
        await link.run()
    except MemoryError:
        # A board that never connected is too small for its app: that is said as it
        # is, not hidden in a loop of resets.
        if not link.stats["connects"]:
            raise
        return "no heap for the link"
    return runtime.reset


def start(agent, settings=None):
    settings = settings if settings is not None else platform.load_settings()
    if "device" not in settings:
        platform.log("settings.json has no device id; nothing to start")
        return
    # Made before the heap can run out: raising it then must not need the heap.
    # Its status, 75, is how a virtual board (the unix port, or CPython) that reset
    # itself ends: tools/virtual_board.py's EXIT_RESET, which `wren board --virtual`,
    # the demo and the test harness start again, as a board boots again after a reset
    # (EX_TEMPFAIL of sysexits.h: a temporary failure, to be tried again). A literal:
    # a name here would be one more in the pool of a board that compiles this file.
    stop = SystemExit(75)
    why = platform.asyncio.run(run_board(agent, settings))
    if not why:
        return
    # The last resort, rather than stay up and deaf: start over with a whole heap.
    # Paused runs are on flash and come back; a run in flight ends as any run cut by a
    # restart does (the bridge fails it, retryable). Why is left on flash for the next
    # boot's status (presence.connected reads the same file). A board resets here; on
    # the unix port, which cannot, the process exits 75. Nothing is imported
    # on the way: a heap an app's leak still holds may not have room for it.
    try:
        platform.log("the board resets:", why)
        platform.write_file("wren_reset.txt", why.encode())
        import machine
        machine.reset()
    except Exception:  # out of heap or flash, or no machine.reset: exit all the same
        pass
    raise stop
