# Runs that pause (PROTOCOL.md "Runs that pause"): a run whose model called a client
# tool (a tool with no function: the host app answers it), or a tool a person must
# approve, waits without holding the board: its state is a checkpoint on flash, and the
# run comes back when the answers do, after a reboot too. Loaded only for an agent with
# such a tool, so a board that never pauses never holds this code or interns its names
# (the qstr pool is near its next doubling, test_on_small_heap).
#
# A checkpoint is one file per run, the msgpack map
#   {v: version, st: "run" | "paused", r: run id, q: the request, m: the conversation,
#    s: the next step, u: usage so far, e: the last event id, ring: the events the ring
#    holds, w: the calls that wait, left: ms of waiting left, sv: run state, ld: loaded
#    state, wr: write ids used, nd: node activations, bg: budget spent (budget.py)}
# written whole (platform.write_file: temp file and rename): "run" at each step
# boundary, "paused" at the pause and with each answer.
#
# Events that go with a checkpoint are put in the run's ring first, the checkpoint is
# written, and only then do they go out: a board that loses power in between has sent
# nothing it did not record, so after a reboot no event id is used twice.
import os

from edge_runtime import codec, platform

try:
    from micropython import const
except ImportError:
    def const(x):
        return x

_PREFIX = const("ck_")
_CUT = const(2048)  # characters of an answer the model gets (toolloop's cut)
# A checkpoint is at most this many bytes: the conversation is bounded by the agent's
# context_chars, the ring by ring_bytes.
_MAX_CK = const(32768)
_TICK_MS = const(1000)  # how often the watcher looks for runs past their limit
_MAX_PAUSE_S = const(86400)  # an agent's max_pause_s when it sets none

# Run id -> the version of its last checkpoint (a run's versions rise across its Run
# objects: each answer restores a new one).
_vers = {}
# The task that fails paused runs past their limit, while any run is paused.
_watcher = None


def _path(runtime, run_id):
    # Run ids may hold "." and other characters a file name should not: hex-encoded.
    return "%s%s%s.bin" % (runtime.flash_dir, _PREFIX,
                           "".join("%02x" % b for b in run_id.encode()))


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


def remove(run):
    # The run ended (not paused): its checkpoint goes with it.
    runtime = run.runtime
    if run.id in runtime.paused:
        return
    _vers.pop(run.id, None)
    for path in (_path(runtime, run.id), _path(runtime, run.id) + ".tmp"):
        try:
            os.remove(path)
        except OSError:
            pass


def _save(run, st, step, messages, usage, waiting, left=None):
    # The run as it is, on flash. Returns the bytes written (benchmarks read it).
    ver = _vers[run.id] = _vers.get(run.id, 0) + 1
    em = run.emitter
    ck = {"v": ver, "st": st, "r": run.id,
          "q": {"req": run.req, "input": run.input, "conv": run.conv, "usr": run.user,
                "sc": run.sc, "ttl": run.ttl},
          "m": messages, "s": step, "u": usage, "e": em.last_id,
          "ring": [em.held(i) for i in range(len(em.ring))],
          "w": waiting, "sv": run.state, "ld": run.loaded, "wr": run._writes, "nd": run.nodes}
    if left is not None:
        ck["left"] = left
    if run.agent.budget:
        from edge_runtime import budget
        ck["bg"] = budget.saved(run)
    # In parts: the conversation's long texts and the ring's events are lent, not
    # copied, so a checkpoint needs no block of its size (after a resume the heap may
    # have none: 2,151 B failed with 9.5 KiB free). A heap without a block for the rest
    # gets a collection and smaller parts.
    try:
        data = codec.encode_parts(ck, _MAX_CK)
    except MemoryError:
        platform.collect()
        data = codec.encode_parts(ck, _MAX_CK, lend=16)
    ck = None
    platform.write_file(_path(run.runtime, run.id), data)
    return sum(len(part) for part in data)


def _held(data):
    # An emitter's way out while its events wait for the checkpoint that records them.
    return False


def _restore(runtime, ck):
    # A Run as the checkpoint left it: its event ids go on from where they were, its
    # ring holds what it held (a replay finds it), and it sends nothing until released.
    from edge_runtime.runs import Run
    run = Run(runtime, ck["r"], ck["q"])
    run.started = True
    run.started_d = None
    _vers[run.id] = ck["v"]
    run.state = ck.get("sv") or {}
    run.loaded = ck.get("ld")
    run._writes = ck.get("wr") or 0
    run.nodes = ck.get("nd") or {}
    if run.agent.budget:
        # The wait is not the run's wall time: it goes on from what the checkpoint had.
        from edge_runtime import budget
        budget.restored(run, ck.get("bg"))
    em = run.emitter
    em._send = _held
    for data in ck.get("ring") or ():
        em.ring.push(data)
        em._held += len(data)
    em.last_id = em.sent = ck["e"]
    return run


def _release(run):
    run.emitter._send = run.runtime.send_event
    run.emitter.pump()


def _gone(runtime, run):
    # The run leaves memory (paused again, or ended): only its ring stays, for replays.
    _forget(runtime, run.id)
    runtime.recent.push(run.emitter)
    run.emitter.settle()


def _forget(runtime, run_id):
    # The rings of a run the runtime keeps from its pause or an earlier answer: each holds
    # the same events as the run's latest (restored from the same checkpoint), a second
    # copy on the heap (1-2 KiB each), unless some still wait for the link.
    recent = runtime.recent
    keep = [e for e in recent if e.run_id != run_id or e.backlog]
    while len(recent):
        recent.pop()
    for e in keep:
        recent.push(e)


def _reason(waiting):
    for w in waiting:
        if w["kind"] == "tool":
            return "tool"
    return "approval"


def _node(w):
    # A waiting call's node: its tool's path, its activation, the model step that called it.
    return ("/tool/" + str(w["name"]), w.get("a") or 1, w.get("k") or 1)


def _announce(run, waiting, start=False):
    # What the run waits for, then run.paused: at the pause (each call's node starts
    # there), and again after a reboot.
    for w in waiting:
        if start:
            run.emit("node.start", {"kind": "tool"}, _node(w))
        run.emit("tool.call", {"call": w["call"], "name": w["name"], "input": w["input"],
                               "client": w["kind"] == "tool"})
        if w["kind"] == "approval":
            run.emit("approval.request", {"call": w["call"], "name": w["name"]})
    # usr, as in run.started: a bridge that meets the run here (after its restart) learns
    # whose run it is, whose answers it may take.
    run.emit("run.paused", {"reason": _reason(waiting), "calls": [w["call"] for w in waiting],
                            "usr": run.user})


async def write(run, step, messages, usage, calls):
    # The model loop at a step boundary (no calls wait: a "run" checkpoint), or after a
    # turn whose `calls` ({call, name, input}) wait on the host app or a person: they are
    # announced, the run pauses and leaves memory (its task ends after this).
    if not calls:
        _save(run, "run", step, messages, usage, ())
        return
    runtime = run.runtime
    waiting = []
    from edge_runtime.toolloop import node
    for c in calls:
        tool = run.agent.tools.get(c.get("name"))
        # Each call is a node of the run from now until its answer (counted, and allowed
        # by the run's budget, as the model loop's tools are); `step` is the model step
        # that called it.
        a = await node(run, "/tool/" + tool.name, None)
        waiting.append({"call": c.get("call"), "name": c.get("name"),
                        "input": c.get("input") or "{}",
                        "kind": "tool" if tool.fn is None else "approval", "a": a, "k": step})
    left = getattr(run.agent, "max_pause_s", _MAX_PAUSE_S) * 1000
    if isinstance(run.ttl, int) and run.ttl > 0:
        left = min(left, run.ttl * 1000)
    await runtime.flow(run.emitter)
    run.emitter._send = _held
    try:
        _announce(run, waiting, True)
        _save(run, "paused", step, messages, usage, waiting, left)
    except MemoryError:
        # No checkpoint, no pause: the run ends (runs.py), and its events, the end
        # included, must not stay held.
        _release(run)
        raise
    _wait(runtime, run.id, left)
    _release(run)


def _wait(runtime, run_id, left):
    # Paused, with a limit on the board's clock. One watcher for all paused runs (a
    # task per run would sit on the heap as long as its run may wait).
    global _watcher
    runtime.paused[run_id] = platform.ticks_add(platform.ticks_ms(), left)
    if _watcher is None:
        _watcher = platform.asyncio.create_task(_watch(runtime))


def _unwatch(runtime):
    # Nothing paused: the watcher goes now rather than at its next look (it holds the
    # runtime).
    global _watcher
    if not runtime.paused and _watcher is not None:
        _watcher.cancel()
        _watcher = None


def _left(runtime, run_id):
    deadline = runtime.paused.get(run_id)
    return 0 if deadline is None else max(0, platform.ticks_diff(deadline, platform.ticks_ms()))


async def _watch(runtime):
    global _watcher
    while runtime.paused:
        await platform.sleep_ms(_TICK_MS)
        now = platform.ticks_ms()
        for run_id, deadline in list(runtime.paused.items()):
            if deadline is not None and platform.ticks_diff(deadline, now) <= 0:
                _expire(runtime, run_id)
    _watcher = None


def _expire(runtime, run_id):
    ck = _read(_path(runtime, run_id))
    if ck is None:
        runtime.paused.pop(run_id, None)
        return
    # From the watcher itself, which ends by its own loop (a task cannot cancel itself).
    _end(runtime, _restore(runtime, ck), "run.failed", {
        "err": {"kind": "timeout", "msg": "no answer came within the time the run may wait"},
        "retryable": True}, False)


def _end(runtime, run, etype, d, unwatch=True):
    runtime.paused.pop(run.id, None)
    if unwatch:
        _unwatch(runtime)
    run.emit(etype, d)
    remove(run)
    _release(run)
    _gone(runtime, run)


def _not_waiting(runtime, run_id, cid):
    runtime.refuse("not_waiting", "run %s is not waiting on call %s" % (run_id, cid),
                   {"r": run_id, "call": cid} if isinstance(cid, str) and len(cid) <= 64
                   else {"r": run_id})


async def ctl(runtime, msg):
    # A ctl for a paused run: a tool answer, an approval, or a cancel.
    run_id = msg.get("r")
    if msg.get("op") == "cancel":
        await _cancel(runtime, run_id, msg.get("reason"))
        return
    cid = msg.get("call")
    kind = "tool" if msg.get("op") == "tool" else "approval"
    ck = None
    if runtime.paused.get(run_id) is not None:
        # The checkpoint is the largest thing an answer needs on the heap: a heap too
        # fragmented for it gets one more try, and without it the answer is refused and
        # the run goes on waiting for it (nothing has changed yet).
        try:
            try:
                ck = _read(_path(runtime, run_id))
            except MemoryError:
                # Collected once what the link holds is acknowledged (_call_room): after
                # a reboot the answer comes right behind the run's replay, whose events
                # the link keeps until then (2 KiB found no block in a CI run at 128K).
                await runtime._call_room(True)
                # Meanwhile another answer may have taken the run (or a cancel ended it).
                if runtime.paused.get(run_id) is not None:
                    ck = _read(_path(runtime, run_id))
        except MemoryError:
            runtime.refuse("no_memory", "no free heap to apply the answer; send it again",
                           {"r": run_id})
            return
    entry = None
    if ck is not None and ck.get("st") == "paused":
        for w in ck["w"]:
            if w["call"] == cid and w["kind"] == kind:
                entry = w
    if entry is None:
        # Not waiting on that call (or on that kind of answer), or answered already.
        _not_waiting(runtime, run_id, cid)
        return
    # Taken: a second answer while this one is applied is not_waiting.
    left = _left(runtime, run_id)
    runtime.paused[run_id] = None
    run = None
    try:
        run = _restore(runtime, ck)
        await _apply(runtime, run, ck, entry, msg, left)
    except MemoryError:
        platform.collect()
        if run is None:
            # Nothing has happened yet: the run waits for the answer again.
            _wait(runtime, run_id, left)
            runtime.refuse("no_memory", "no free heap to apply the answer; send it again",
                           {"r": run_id})
        else:
            # Part of it happened (an approved tool may have run): the run cannot go on
            # from its checkpoint as if it had not, so it ends, as a run that ran out of
            # memory does, rather than wait for ever.
            platform.log("run", run_id, "ran out of memory applying an answer")
            _end(runtime, run, "run.failed", {
                "err": {"kind": "internal", "msg": "the board ran out of memory"},
                "retryable": True})


async def _apply(runtime, run, ck, entry, msg, left):
    # The answer to the waiting call `entry` of the run restored from `ck`: recorded, and
    # the run paused again, or (when nothing else waits) going on.
    run_id = run.id
    cid = entry["call"]
    _release(run)  # an approval's events go out as they come; the result waits below
    if entry["kind"] == "tool":
        output = msg.get("output") if isinstance(msg.get("output"), str) else ""
        failed = msg.get("failed") is True
    else:
        by = msg.get("by") if isinstance(msg.get("by"), str) else "?"
        name = entry["name"]
        if msg.get("ok") is True:
            await run.event("approval.granted", {"call": cid, "name": name, "by": by})
            from edge_runtime.toolloop import _run_tool
            output, failed = await _run_tool(run.agent.tools.get(name), entry["input"])
        else:
            await run.event("approval.denied", {"call": cid, "name": name, "by": by})
            output, failed = "denied by %s" % by, True
    if len(output) > _CUT:
        output = output[:_CUT] + " [cut: %d more characters]" % (len(output) - _CUT)
    messages = ck["m"]
    messages.append({"role": "tool", "call": cid, "content": output})
    waiting = [w for w in ck["w"] if w is not entry]
    await runtime.flow(run.emitter)
    run.emitter._send = _held
    run.emit("tool.result", {"call": cid, "output": output, "failed": failed})
    run.emit("node.end", {"status": "failed" if failed else "completed"}, _node(entry))
    if waiting:
        _save(run, "paused", ck["s"], messages, ck["u"], waiting, left)
        _wait(runtime, run_id, left)
        _release(run)
        _gone(runtime, run)
        return
    # Nothing waits: the run goes on from this checkpoint, in a slot like any run, ahead
    # of the requests that wait (it was admitted long ago).
    run.emit("run.resumed", {"ckpt": _vers[run_id] + 1})
    _save(run, "run", ck["s"], messages, ck["u"], ())
    runtime.paused.pop(run_id, None)
    _unwatch(runtime)
    _release(run)
    _forget(runtime, run_id)
    job = (run, (messages, ck["s"], ck["u"]))
    # What the answer needed goes before the run's first step, which writes a checkpoint
    # of its own at once (the largest block it needs).
    ck = entry = waiting = None
    platform.collect()
    if len(runtime.active) < runtime.concurrency:
        runtime._start(job)
    else:
        runtime._queue.insert(0, job)


async def _cancel(runtime, run_id, reason):
    # Each waiting call is given a failed result, then the run ends cancelled.
    ck = _read(_path(runtime, run_id)) if runtime.paused.get(run_id) is not None else None
    if ck is None:
        runtime.refuse("unknown_run", "no paused run %s to cancel" % run_id, {"r": run_id})
        return
    run = _restore(runtime, ck)
    for w in ck["w"]:
        run.emit("tool.result", {"call": w["call"], "output": "cancelled", "failed": True})
        run.emit("node.end", {"status": "cancelled"}, _node(w))
    reason = reason[:200] if isinstance(reason, str) and reason else "cancelled"
    _end(runtime, run, "run.cancelled", {"reason": reason})


def replay(runtime, run_id, after):
    # A replay of a paused run (control.py), always from its checkpoint's ring. What the
    # ring no longer holds is reported as a gap, and the report takes the run's next
    # event id: so it goes into the checkpoint (written again, paused as it was) before
    # it goes out, or the run's next event after an answer would take that id too.
    # False when there is no such paused run. While an answer is applied, nothing: the
    # bridge asks again.
    if runtime.paused.get(run_id) is None:
        return run_id in runtime.paused
    ck = _read(_path(runtime, run_id))
    if ck is None or ck.get("st") != "paused":
        return False
    run = _restore(runtime, ck)
    em = run.emitter
    if after < em.last_id:
        # Ids after..lost are no longer held; a full ring also lets its oldest go for the
        # report itself, which then says so too (a second report would push out a third).
        first = em.last_id - len(em.ring) + 1
        lost = first - 1
        if after < lost and len(em.ring) == em.ring.capacity:
            lost = first
        em.sent = max(after, lost)  # held: what goes out once released
        if after < lost:
            em.emit("error", {"kind": "gap", "from": after + 1, "to": lost,
                              "msg": "events %d..%d are no longer held" % (after + 1, lost)})
            em.pump()
            _save(run, "paused", ck["s"], ck["m"], ck["u"], ck["w"], _left(runtime, run_id))
    _release(run)
    _gone(runtime, run)
    return True


def _names(entries):
    # ilistdir gives (name, type, inode[, size]) tuples, listdir names.
    for e in entries:
        yield e if isinstance(e, str) else e[0]


def boot(runtime):
    # At boot: the checkpoints on flash. A paused run comes back and announces again
    # what it waits for; a run that was running fails once, retryable.
    fd = runtime.flash_dir  # a prefix of paths: a folder, and the start of file names
    cut = fd.rfind("/") + 1
    head = fd[cut:] + _PREFIX
    # Only the checkpoints' names are kept, read one entry at a time where the port can
    # (ilistdir): a folder shared with many other files (a board's root, or /tmp on the
    # unix port) made a list of every name, a 4 KiB block a board may not have at boot.
    # Collected before any is handled, as handling one writes into the same folder.
    listing = getattr(os, "ilistdir", os.listdir)
    try:
        names = [n for n in _names(listing(fd[:cut] or "."))
                 if n.startswith(head) and n.endswith(".bin")]
    except OSError:
        return
    for name in names:
        ck = _read(fd[:cut] + name)
        if ck is None:
            continue
        run = _restore(runtime, ck)
        if ck.get("st") != "paused":
            _end(runtime, run, "run.failed", {
                "err": {"kind": "device", "msg": "the device restarted during the run"},
                "retryable": True})
            continue
        run.emit("run.resumed", {"ckpt": ck["v"]})
        _announce(run, ck["w"])
        left = ck.get("left") or 0
        _save(run, "paused", ck["s"], ck["m"], ck["u"], ck["w"], left)
        _wait(runtime, run.id, left)
        _release(run)
        _gone(runtime, run)
