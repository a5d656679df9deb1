# Boot a board: read settings from flash, join the network, wire the runtime to the
# link and hand control to the link's supervisor for the life of the board.
from edge_runtime import platform
# The link, a collection, then the runtime: from source, the compiler's peak is the
# parse of a large module on top of everything loaded before it, and link.py is now the
# largest source; parsed first and collected after, `import edge_runtime.board` needs
# 120 KiB (64-bit unix port), where runtime-first needed 130 and failed at some sizes
# above that (a fragmented heap).
from edge_runtime.link import Link

platform.collect()
from edge_runtime.runs import Runtime  # noqa: E402


async def run_board(agent, settings):
    device = settings["device"]
    runtime = Runtime(agent, device, settings)
    # A stable client id and a persistent session: what the bridge sends while the
    # board is away waits for it at the broker.
    link = Link(
        settings.get("client_id", device),
        settings.get("host", "127.0.0.1"),
        settings.get("port", 1883),
        user=settings.get("user", device),
        password=settings.get("password"),
        keepalive=settings.get("keepalive", 30),
        outbox_size=settings.get("outbox", 16),
        inflight=settings.get("inflight", 8),
        **runtime.link_settings()
    )
    runtime.attach(link)
    platform.collect_often()
    platform.log("board", device, "agent", agent.name, agent.version, "broker",
                 settings.get("host", "127.0.0.1"), settings.get("port", 1883))
    await link.run()


def start(agent, settings=None):
    settings = settings if settings is not None else platform.load_settings()
    if "device" not in settings:
        platform.log("settings.json has no device id; nothing to start")
        return
    if settings.get("wifi"):
        from edge_runtime import wifi
        wifi.connect(settings)
    platform.asyncio.run(run_board(agent, settings))
