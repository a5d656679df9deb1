# The ctl ops on P/d/D/ctl: cancel a run, replay its events; a paused run's answers,
# approvals and cancel go to pause.py. They come seldom next to requests and answers, so the
# runtime (runs.py) imports this module for each ctl and lets it go again
# (platform.unload): its code is not on the heap while a run runs, where a run peaks,
# and a board that is never sent a ctl never interns its names (the qstr pool is near
# its next doubling, test_on_small_heap).
from edge_runtime import platform
from edge_runtime.events import DEVICE_RUN, MAX_REASON
from edge_runtime.runs import clip, is_id

try:
    from micropython import const
except ImportError:
    def const(x):
        return x

_CTL_OPS = const(("cancel", "replay", "tool", "approve"))


def ctl(runtime, msg):
    op = msg.get("op")
    if op not in _CTL_OPS:
        runtime.refuse("unknown_op", "unknown ctl op %s" % clip(op))
        return
    run_id = msg.get("r")
    paused = runtime.paused and run_id in runtime.paused
    if op != "replay" and paused:
        from edge_runtime import pause
        platform.asyncio.create_task(pause.ctl(runtime, msg))
        return
    if (op == "cancel" or op == "replay") and not paused and isinstance(run_id, str) \
            and "." in run_id and not run_id.startswith(runtime.boot + "."):
        # A run of an earlier boot, which ended with it: the bridge's cancel of a run
        # whose board went away waits in the session and reaches the next boot. (A run
        # paused before this boot came back with it.)
        runtime.stats["stale_ctl"] = runtime.stats.get("stale_ctl", 0) + 1
        return
    if op == "cancel":
        _cancel(runtime, msg)
    elif op == "replay":
        _replay(runtime, msg)
    else:
        # A tool answer or approval for a run that is not paused (it ended, or never
        # was): named by run and call, as a paused run's refusal is (pause.py), so the
        # host that answered can tell which of its answers came too late.
        r = msg.get("r")
        call = msg.get("call")
        more = {"r": r} if is_id(r) else {}
        if is_id(call):
            more["call"] = call
        runtime.refuse("not_waiting", "run %s is not waiting on call %s" % (clip(r), clip(call)),
                       more)


def _cancel(runtime, msg):
    run_id = msg.get("r")
    req = msg.get("req")
    if run_id is None and is_id(req):
        # A cancel by request: its host does not know the run yet (none had started when
        # it gave up, PROTOCOL "Requests and control").
        for run in runtime.active.values():
            if run.req == req:
                run_id = run.id
        if run_id is None:
            _cancel_waiting(runtime, req)
            return
    run = runtime.active.get(run_id) if isinstance(run_id, str) else None
    if run is None:
        runtime.refuse("unknown_run", "no active run %s to cancel" % clip(run_id))
        return
    reason = msg.get("reason")
    run.cancel_reason = reason[:MAX_REASON] if isinstance(reason, str) and reason else "cancelled"
    # A task that has not begun is never cancelled from outside: its body (and the
    # clean-up in it) would not run at all. It sees cancel_reason when it begins.
    if run.started and run.task is not None:
        run.task.cancel()


def _cancel_waiting(runtime, req):
    # A request with no run: taken out of the queue, or, not come yet, remembered as
    # seen, so that it starts nothing when it comes. Either way it ends now, by its id,
    # and its host stops waiting. One seen and not queued or running has run already.
    queue = runtime._queue
    for i in range(len(queue)):
        if isinstance(queue[i], dict) and queue[i].get("req") == req:
            queue.pop(i)
            break
    else:
        if req in runtime._seen:
            runtime.refuse("unknown_run", "request %s has no run to cancel" % req, {"req": req})
            return
        runtime._seen.push(req)
    runtime.refuse("cancelled", "request %s was cancelled before its run started" % req,
                   {"req": req})


def _emitter(runtime, run_id):
    # The event ring of an active run or of one of the last that ended, or None.
    if run_id == DEVICE_RUN:
        return runtime.device_stream
    if not isinstance(run_id, str):
        return None
    run = runtime.active.get(run_id)
    if run is not None:
        return run.emitter
    for emitter in runtime.recent:
        if emitter.run_id == run_id:
            return emitter
    return None


def _replay(runtime, msg):
    after = msg.get("after")
    if not isinstance(after, int) or after < 0:
        runtime.refuse("bad_envelope", "replay needs an integer after >= 0")
        return
    run_id = msg.get("r")
    if runtime.paused and run_id in runtime.paused:
        # A paused run's events are replayed from its checkpoint, which records the id
        # a gap report takes (pause.py); not from a ring of it the runtime still has.
        from edge_runtime import pause
        if pause.replay(runtime, run_id, after):
            return
    emitter = _emitter(runtime, run_id)
    if emitter is None:
        # Naming the run (an id within the bound only): the bridge then knows the
        # events it asked for are gone, and stops asking.
        runtime.refuse("unknown_run", "run %s is no longer held" % clip(run_id),
                       {"r": run_id} if is_id(run_id) else None)
        return
    emitter.replay(after)
