# The demo turn with memory, on a board of its own: the thermostat agent with a core field
# and a collection, served by a real MicroPython process at a given heap against the
# scripted bridge (scripted_bridge.py: the real bridge does not serve state, mem and core
# calls yet). One recall and one core append besides the demo's sensor read. Host-side
# (CPython) only: firmware_tests/test_on_small_heap.py checks the ceiling, and
# benchmarks/bench_heap.py bisects the smallest heap with it (figure `memory`).
import json

from firmware_tests.scripted_bridge import ScriptedBridge

# The board's main.py: the demo agent's instructions and tool, and fields.
MAIN_PY = """from edge_runtime import board, demo
from edge_runtime.agent import Agent
from edge_runtime.fields import Field

agent = Agent("thermostat", "0.1.0", demo.agent.instructions, fields=[
    Field("notes", dur="agent", core=True, max=2000),
    Field("facts", vis="public", dur="user", kind="collection"),
])
agent.tools = demo.agent.tools
board.start(agent)
"""

NOTE = "The user asked how warm it is."
ANSWER = "It is 21.5 °C in here, as you like it."


def _tool(call, name, args):
    return {"tool": {"call": call, "name": name, "input": json.dumps(args)}}


# Text in 8-character chunks, as the bridge's scripted model streams the demo.
SCRIPT = [
    [{"stream": ["Let me check the sensor and what I know.", 8]},
     _tool("c1", "memory.recall", {"query": "temperature preference", "field": "facts"}),
     _tool("c2", "read_temperature", {})],
    [_tool("c3", "memory.append", {"field": "notes", "text": NOTE})],
    [{"stream": [ANSWER, 8]}],
]


async def serve(device, proc, timeout_ms=20000):
    # Plays the bridge for the board process `proc` (started, device `device`) through one
    # memory turn; True when the run ended done, with the answer, the recall answered and
    # the core append backed up, and the board still running.
    bridge = ScriptedBridge(device, SCRIPT)
    bridge.turn_by_calls = True
    bridge.memory.rows["facts"] = {"pref": {"key": "pref", "ver": 1, "links": [],
                                            "value": "prefers 21 degrees: temperature preference"}}
    import asyncio

    task = asyncio.create_task(bridge.link.run())
    try:
        if not await bridge.link.wait_connected(5000):
            return False
        await bridge.put_status("online")
        try:
            await bridge.wait_for(lambda: bridge.hello is not None or proc.poll() is not None,
                                  timeout_ms)
            if proc.poll() is not None:
                return False
            bridge.send("req", {"req": "mem1", "usr": "u1", "sc": "ticket", "input": "How warm is it?"})
            await bridge.wait_for(lambda: proc.poll() is not None or any(
                e["t"] in ("run.done", "run.failed", "run.cancelled") for e in bridge.events),
                timeout_ms)
        except AssertionError:  # wait_for's time ran out
            return False
        done = [e for e in bridge.events if e["t"] == "run.done"]
        text = "".join(e["d"]["text"] for e in bridge.events if e["t"] == "msg.delta")
        syncs = bridge.mem_calls("core.sync")
        return (bool(done) and proc.poll() is None and ANSWER in text
                and len(bridge.mem_calls("mem.recall")) == 1
                and len(syncs) == 1 and syncs[0]["a"]["doc"].endswith(NOTE))
    finally:
        bridge.link.stop()
        try:
            await asyncio.wait_for(task, 3)
        except Exception:
            task.cancel()


def turn_ok(exe, heap_kib, mpy, broker, workdir, device, package=True, romfs=False):
    # One trial: a fresh flash for `device` under `workdir` (core memory starts empty, so
    # the board also restores it with core.load), the board at heap_kib KiB; without the
    # runtime on flash (package=False) for a binary that has it frozen in, or with it in a
    # ROMFS image (romfs=True: heap_kib is then the heap beyond the image).
    import asyncio

    from firmware_tests import support
    from tools.virtual_board import VirtualBoard, lay_out_flash

    host, port = broker
    support.BROKER = (host, port)
    settings = {"device": device, "host": host, "port": port}
    flash = lay_out_flash(workdir / device, settings, mpy=mpy, main_py=MAIN_PY, package=package,
                          romfs=romfs)
    board = VirtualBoard(flash, heap="%dK" % heap_kib, exe=exe)
    proc = board.start()
    try:
        return asyncio.run(serve(device, proc))
    finally:
        board.stop()
        # The board's session is persistent: clear it so the broker keeps nothing for it.
        asyncio.run(_clean(device, host, port))


async def _clean(device, host, port):
    import asyncio

    from edge_runtime.link import Link

    clean = Link(device, host, port, clean_session=True, rx_size=256)
    t = asyncio.create_task(clean.run())
    await clean.wait_connected(5000)
    clean.stop()
    await asyncio.wait_for(t, 3)
