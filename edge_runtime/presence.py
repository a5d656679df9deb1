# The board's presence (PROTOCOL.md "Topics", "Bridge presence"): what it says when it
# connects, its status (retained; its last will says offline) and its hello (retained:
# agent, tools, fields, limits), and what it does when the bridge's presence changes.
# These come with a connection and when the bridge restarts, not while a run runs, so
# the runtime (runs.py) imports this module for each and lets it go again
# (platform.unload): its code is not on the heap where a run peaks (bench_heap: the
# demo turn's and the memory turn's smallest heaps, 64-bit .mpy, each about 2 KiB less).
import sys

from edge_runtime import codec, platform

try:
    from micropython import const
except ImportError:
    def const(x):
        return x

_FW_VERSION = const("0.1.0")
_QOS1 = const(1)


def connected(runtime):
    # Presence first (retained, so a dashboard that connects later sees it), then the
    # capabilities the bridge needs to serve this board.
    agent = runtime.agent
    # The firmware, said in the status and the hello: ours and the Python it runs on.
    impl = sys.implementation
    v = impl.version
    fw = "wren-edge %s %s %d.%d.%d" % (_FW_VERSION, impl.name, v[0], v[1], v[2])
    status = {"st": "online", "fw": fw, "agent": agent.name, "ver": agent.version,
              "heap": platform.free_heap(), "boot": runtime.boot}
    if runtime.paused is None:
        # A boot's first connection says why the last boot reset itself (board.py
        # writes the note), once: it is removed as it is read.
        why = platform.read_file("wren_reset.txt")
        if why is not None:
            import os
            os.remove("wren_reset.txt")
            status["reset"] = why.decode()[:64]
    runtime.publish_msg(runtime._base + "status", status, _QOS1, True)
    # The hello is retained, so it is said once a boot (no paused runs read yet: the
    # first connection) and again only on a connection without our session, where the
    # broker may have lost it with its store. Said at every reconnection or bridge
    # restart, its build (1-2 KiB of dicts and their encoding) landed beside the start
    # of a run asked for just then, and a 128K board ran out of its fragmented heap.
    if runtime.paused is not None and runtime.link.session_present:
        return
    runtime.publish_msg(runtime._base + "hello", {
        "agent": agent.name, "ver": agent.version, "fw": fw, "boot": runtime.boot,
        "fields": agent.describe_fields(), "tools": agent.describe(),
        "limits": runtime.limits}, _QOS1, True)


def bridge(runtime, payload):
    # The bridge's status (P/b/status), as it changes.
    try:
        msg = codec.decode(payload, 256)
    except codec.CodecError:
        return  # not ours to refuse: the bridge writes this topic, not a host
    if not isinstance(msg, dict):
        return
    up = msg.get("st") == "online"
    was = runtime._bridge_up
    runtime._bridge_up = up
    rpc = runtime.rpc
    if up:
        boot = msg.get("boot")
        old = runtime._bridge_boot
        restarted = old is not None and boot != old
        runtime._bridge_boot = rpc.bridge = boot
        if restarted:
            # Another bridge process: what was in flight with the last one is gone.
            platform.log("bridge restarted")
            rpc.fail_all("bridge_restarted", "the bridge restarted during the call", old)
    else:
        rpc.bridge = None
        if was is not False:
            # The grace runs in the runtime's code: a task of this module's would keep
            # all of it on the heap for the grace, runs and all.
            platform.asyncio.create_task(runtime._bridge_gone(rpc.epoch))
