# Runs that pause (PROTOCOL.md "Runs that pause"): a run whose model called a client
# tool, or a tool a person must approve, waits without holding the board: its state is
# a checkpoint on flash, and the run comes back when the answers do, after a reboot too.
# Loaded only by an agent with such a tool (agent.pauses).
#
# A checkpoint is one file per run, the msgpack map
#   {v: version, st: "run" | "paused", q: the request, m: the conversation, s: the next
#    step, u: usage so far, e: the last event id, ring: the events the ring holds,
#    w: the calls that wait, left: ms of waiting left, sv: run state, ld: loaded state,
#    wr: write ids used}
# written whole (platform.write_file: temp file and rename). "run" is written at each
# step boundary, "paused" at the pause and with each answer.
#
# Events that go with a checkpoint are put in the run's ring first, the checkpoint is
# written, and only then do they go out: a board that loses power in between has sent
# nothing it did not record, so after a reboot no id is used twice.
import os

from edge_runtime import codec, platform

try:
    from micropython import const
except ImportError:
    def const(x):
        return x

_PREFIX = const("ck_")
_CUT = const(2048)  # characters of a client tool's answer the model gets (toolloop's cut)
# A checkpoint is at most this many bytes: the conversation is bounded by the agent's
# context_chars, and the ring by ring_bytes.
_MAX_CK = const(32768)
# How often the watcher looks for paused runs past their limit.
_TICK_MS = const(1000)


def _path(runtime, run_id):
    # Run ids may hold "." and other characters a file name should not: hex-encoded.
    return "%s%s%s.bin" % (runtime.flash_dir, _PREFIX, "".join("%02x" % b for b in run_id.encode()))


def _read(path):
    raw = platform.read_file(path) or platform.read_file(path + ".tmp")
    if not raw:
        return None
    try:
        ck = codec.decode(raw, len(raw), len(raw), len(raw))
    except codec.CodecError:
        platform.log("checkpoint", path, "is corrupt; its run is lost")
        return None
    return ck if isinstance(ck, dict) and isinstance(ck.get("q"), dict) else None


def remove(runtime, run_id):
    for path in (_path(runtime, run_id), _path(runtime, run_id) + ".tmp"):
        try:
            os.remove(path)
        except OSError:
            pass


def save(run, st, step, messages, usage, waiting, left=None):
    # The run as it is, on flash. Returns the bytes written (benchmarks read it).
    run.ckv += 1
    em = run.emitter
    first = em.last_id - len(em.ring) + 1
    ck = {"v": run.ckv, "st": st, "r": run.id,
          "q": {"req": run.req, "input": run.input, "conv": run.conv, "usr": run.user,
                "sc": run.sc, "ttl": run.ttl},
          "m": messages, "s": step, "u": usage, "e": em.last_id, "f": first,
          "ring": [bytes(em.ring.at(i)) for i in range(len(em.ring))],
          "w": waiting, "sv": run.state, "ld": run.loaded, "wr": run._writes}
    if left is not None:
        ck["left"] = left
    # One block of the exact size, written as it is (codec.encode would copy it).
    try:
        data = codec.encode_exact(ck, _MAX_CK)
    except MemoryError:
        platform.collect()
        data = codec.encode_exact(ck, _MAX_CK)
    ck = None
    platform.write_file(_path(run.runtime, run.id), data)
    return len(data)


def restore(runtime, ck):
    # A Run as the checkpoint left it: its event ids go on from where they were, its
    # ring holds what it held (a replay finds it), and it sends nothing until released.
    from edge_runtime.runs import Run
    run = Run(runtime, ck["r"], ck["q"])
    run.started = True
    run.started_d = None
    run.ckv = ck["v"]
    run.state = ck.get("sv") or {}
    run.loaded = ck.get("ld")
    run._writes = ck.get("wr") or 0
    em = run.emitter
    em.hold = True
    for data in ck.get("ring") or ():
        em.ring.push(data)
        em._held += len(data)
    em.last_id = em.sent = ck["e"]
    return run


def release(run):
    run.emitter.hold = False
    run.emitter.pump()


def _waiting_ids(waiting):
    return [w["call"] for w in waiting]


def _reason(waiting):
    for w in waiting:
        if w["kind"] == "tool":
            return "tool"
    return "approval"


async def suspend(run, step, messages, usage, waiting):
    # The model loop's turn left calls waiting: run.paused, then the checkpoint, then
    # the event goes out, and the run leaves memory (its task ends after this).
    runtime = run.runtime
    left = run.agent.max_pause_s * 1000
    ttl = run.ttl
    if isinstance(ttl, int) and ttl > 0:
        left = min(left, ttl * 1000)
    run.emitter.hold = True
    run.emit("run.paused", {"reason": _reason(waiting), "calls": _waiting_ids(waiting)})
    save(run, "paused", step, messages, usage, waiting, left)
    release(run)
    _wait(runtime, run.id, left, run.ckv)


def _wait(runtime, run_id, left, ver):
    # Paused, with a limit: the run's deadline on the board's clock. One watcher task
    # for all paused runs (a task per run would sit on the heap for as long as its run
    # may wait, answered or not).
    runtime.paused[run_id] = (ver, platform.ticks_add(platform.ticks_ms(), left))
    if runtime.watching is None:
        runtime.watching = platform.asyncio.create_task(_watch(runtime))


def _unwatch(runtime):
    # Nothing paused: the watcher goes now, not at its next look (it holds the runtime).
    task = runtime.watching
    if not runtime.paused and task is not None:
        runtime.watching = None
        task.cancel()


def _left(runtime, run_id):
    w = runtime.paused.get(run_id)
    return max(0, platform.ticks_diff(w[1], platform.ticks_ms())) if w else 0


async def _watch(runtime):
    while runtime.paused:
        await platform.sleep_ms(_TICK_MS)
        now = platform.ticks_ms()
        for run_id, w in list(runtime.paused.items()):
            if w is not None and platform.ticks_diff(w[1], now) <= 0:
                _expire(runtime, run_id)
    runtime.watching = None


def _expire(runtime, run_id):
    ck = _read(_path(runtime, run_id))
    if ck is None:
        runtime.paused.pop(run_id, None)
        return
    run = restore(runtime, ck)
    _end(runtime, run, "run.failed", {
        "err": {"kind": "timeout", "msg": "no answer came within the time the run may wait"},
        "retryable": True})


def _end(runtime, run, etype, d):
    runtime.paused.pop(run.id, None)
    _unwatch(runtime)
    run.emit(etype, d)
    remove(runtime, run.id)
    release(run)
    runtime.ended(run)


async def answer(runtime, msg):
    # A ctl tool answer or approval for a paused run. Refused not_waiting when the run
    # does not wait on that call (or on nothing of that kind), with nothing changed.
    run_id = msg.get("r")
    cid = msg.get("call")
    op = msg.get("op")
    ck = _read(_path(runtime, run_id)) if run_id in runtime.paused else None
    entry = None
    if ck is not None and ck.get("st") == "paused":
        for w in ck["w"]:
            if w["call"] == cid and w["kind"] == ("tool" if op == "tool" else "approval"):
                entry = w
    if entry is None:
        runtime.not_waiting(run_id, cid)
        return
    # Taken: a second answer for this call while this one is applied is not_waiting.
    left = _left(runtime, run_id)
    runtime.paused[run_id] = None
    run = restore(runtime, ck)
    release(run)  # the approval's events go out as they come; the result waits below
    if op == "tool":
        output = msg.get("output")
        output = output if isinstance(output, str) else ""
        failed = msg.get("failed") is True
    else:
        by = msg.get("by") if isinstance(msg.get("by"), str) else "?"
        name = entry["name"]
        if msg.get("ok") is True:
            await run.event("approval.granted", {"call": cid, "name": name, "by": by})
            tool = run.agent.tools.get(name)
            from edge_runtime.toolloop import _run_tool
            output, failed = await _run_tool(tool, entry["input"])
        else:
            await run.event("approval.denied", {"call": cid, "name": name, "by": by})
            output, failed = "denied by %s" % by, True
    if len(output) > _CUT:
        output = output[:_CUT] + " [cut: %d more characters]" % (len(output) - _CUT)
    messages = ck["m"]
    messages.append({"role": "tool", "call": cid, "content": output})
    waiting = [w for w in ck["w"] if w is not entry]
    run.emitter.hold = True
    run.emit("tool.result", {"call": cid, "output": output, "failed": failed})
    if waiting:
        save(run, "paused", ck["s"], messages, ck["u"], waiting, left)
        release(run)
        runtime.ended(run)
        _wait(runtime, run_id, left, run.ckv)
        return
    # Nothing waits: the run goes on from this checkpoint.
    run.emit("run.resumed", {"ckpt": run.ckv + 1})
    save(run, "run", ck["s"], messages, ck["u"], ())
    release(run)
    runtime.paused.pop(run_id, None)
    _unwatch(runtime)
    runtime.resume(run, {"m": messages, "s": ck["s"], "u": ck["u"]})


async def cancel(runtime, run_id, reason):
    # A paused run cancelled: each waiting call is given a failed result, then the run
    # ends cancelled.
    ck = _read(_path(runtime, run_id))
    if ck is None or runtime.paused.get(run_id) is None:
        runtime.refuse("unknown_run", "no paused run %s to cancel" % run_id, {"r": run_id})
        return
    run = restore(runtime, ck)
    for w in ck["w"]:
        run.emit("tool.result", {"call": w["call"], "output": "cancelled", "failed": True})
    _end(runtime, run, "run.cancelled", {"reason": reason})


def boot(runtime):
    # At boot: the checkpoints on flash. A paused run comes back and announces again
    # what it waits for; a run that was running fails once, retryable.
    # flash_dir is a prefix of paths: a folder, and the start of the file names.
    fd = runtime.flash_dir
    cut = fd.rfind("/") + 1
    head = fd[cut:] + _PREFIX
    try:
        names = os.listdir(fd[:cut] or ".")
    except OSError:
        return
    for name in names:
        if not (name.startswith(head) and name.endswith(".bin")):
            continue
        ck = _read(fd[:cut] + name)
        if ck is None:
            continue
        run = restore(runtime, ck)
        if ck.get("st") != "paused":
            _end(runtime, run, "run.failed", {
                "err": {"kind": "device", "msg": "the device restarted during the run"},
                "retryable": True})
            continue
        waiting = ck["w"]
        run.emit("run.resumed", {"ckpt": ck["v"]})
        for w in waiting:
            tool = runtime.agent.tools.get(w["name"])
            client = tool is not None and tool.client
            run.emit("tool.call", {"call": w["call"], "name": w["name"], "input": w["input"],
                                   "client": client})
            if w["kind"] == "approval":
                run.emit("approval.request", {"call": w["call"], "name": w["name"]})
        run.emit("run.paused", {"reason": _reason(waiting), "calls": _waiting_ids(waiting)})
        left = ck.get("left") or 0
        save(run, "paused", ck["s"], ck["m"], ck["u"], waiting, left)
        release(run)
        runtime.ended(run)
        _wait(runtime, run.id, left, run.ckv)

