# Boot a board: read settings from flash, join the network, wire the runtime to the
# link and hand control to the link's supervisor for the life of the board.
from edge_runtime import platform
# The runtime before the link: from source, the compiler's peak comes with the last
# large module it parses, and link.py is the smaller to parse with the rest loaded
# (bench_heap: a demo turn from .py 143 -> 133 KiB on the 64-bit unix port; .mpy 110).
from edge_runtime.runs import Runtime
from edge_runtime.link import Link


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
