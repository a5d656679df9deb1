# A run's durable slot fields (PROTOCOL.md "Memory and durable state"): seeded into
# run.state from the bridge at the run's start (state.load), written back at its end
# (state.commit). Loaded by the runtime only when the agent declares a durable slot
# field (dur other than run, not core, not a collection), so other boards never hold
# this code.
#
# What a write carries, by the field's merge (the bridge applies it to what it stores):
#   replace, max, min: the run's final value;
#   sum: what the run added, final - loaded (a number);
#   append: what the run added at the end: the final string or list past the loaded one
#     (a run that changed the loaded part cannot be written by append: reported);
#   union: the items of the final list that the loaded one did not have;
#   deep: a map of what changed: changed or new keys with their value (maps diffed in
#     turn), removed keys as null.
# A delta, not the total: another run may have written the field since this one loaded
# it, and a total would undo that run's write. Only a run that ends done commits: a
# failed or cancelled run's changes are dropped (a retried run must not add twice).
#
# A commit that fails as a whole (link down, timeout, the bridge away) is reported on
# the run as an `error` {kind:"commit", fields} before its terminal event, and kept on
# the runtime to send again, with the same write ids, on the next connection. The bridge
# applies a write id once, so a commit that did arrive is not applied twice. The list
# is bounded; a commit it has no room for is reported as lost.
from edge_runtime import codec
from edge_runtime.rpc import RpcError

try:
    from micropython import const
except ImportError:
    def const(x):
        return x

# Failed commits the runtime keeps to send again: each holds its writes (values the
# size of the fields' max at worst), so only a few.
_PENDING = const(4)
# Failures worth sending the same commit again for: the call did not get through or
# was not answered. A refusal (bad_token, unknown_field ...) would only be refused again.
_RETRY = (" timeout link bridge_offline bridge_restarted bridge_stopping unsendable gap overflow"
          " busy no_memory ")


def durable(agent):
    return [f for f in agent.fields if f.durable]


def retryable(kind):
    return " %s " % kind in _RETRY


def _args(sc, args):
    # The scope ticket goes unchanged into every state, mem and core call (absent when
    # the request had none).
    if sc is not None:
        args["sc"] = sc
    return args


async def load(run):
    # Seeds run.state; a run whose state cannot be loaded does not run (it would answer
    # from, and then write back over, state it never saw).
    from edge_runtime.agent import RunFailed

    fields = durable(run.agent)
    # A seed the bridge sent that could be taken was taken (runs._state) before this.
    run.loaded = None
    try:
        ok = await run.rpc.call("state.load", _args(run.sc, {"fields": [f.name for f in fields]}),
                                run.id)
    except RpcError as e:
        raise RunFailed("link", "the run's state could not be loaded (%s)" % e.kind,
                        retryable(e.kind))
    values = ok.get("values") if isinstance(ok, dict) else None
    loaded = {}
    if isinstance(values, dict):
        for f in fields:
            if f.name in values:
                run.state[f.name] = loaded[f.name] = values[f.name]
    # What was loaded, encoded: a deep copy for the end's comparison that an app
    # changing a list in place cannot touch, and smaller than the values themselves.
    run.loaded = codec.encode(loaded)


def _delta(merge, old, new):
    # What a write of `new` over `old` sends (see the top); raises ValueError when the
    # change cannot be written by the field's merge.
    if merge == "sum":
        if not isinstance(new, (int, float)) or isinstance(new, bool):
            raise ValueError("a sum field holds a number")
        return new - (old if isinstance(old, (int, float)) else 0)
    if merge == "append":
        if old is None:
            return new
        if (isinstance(new, str) and isinstance(old, str)) or (
                isinstance(new, list) and isinstance(old, list)):
            if new[:len(old)] == old:
                return new[len(old):]
        raise ValueError("an append field can only grow at its end")
    if merge == "union":
        if not isinstance(new, list):
            raise ValueError("a union field holds a list")
        old = old if isinstance(old, list) else []
        return [x for x in new if x not in old]
    if merge == "deep":
        return _diff(old, new)
    return new


def _diff(old, new):
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    d = {}
    for k in new:
        if k not in old:
            d[k] = new[k]
        elif old[k] != new[k]:
            d[k] = _diff(old[k], new[k])
    for k in old:
        if k not in new:
            d[k] = None
    return d


async def commit(run):
    # The durable fields the run changed, each a write with its own id. Called between
    # the handler's return and run.done, so what fails is reported before it.
    loaded = codec.decode(run.loaded, len(run.loaded), len(run.loaded)) if run.loaded else {}
    run.loaded = None
    writes = []
    for f in durable(run.agent):
        name = f.name
        if name not in run.state:
            continue
        new = run.state[name]
        if name in loaded and loaded[name] == new:
            continue
        merge = f.merge
        try:
            delta = _delta(merge, loaded.get(name), new)
        except ValueError as e:
            await run.event("error", {"kind": "commit", "msg": "%s was not written: %s" % (name, e),
                                      "fields": [name]})
            continue
        # A delta that changes nothing (nothing added, no key changed) is not sent.
        if not ((merge == "sum" and delta == 0) or (merge in ("append", "union", "deep")
                                                    and not delta and delta is not None)):
            writes.append({"field": name, "value": delta, "w": run.w()})
    if not writes:
        return
    runtime = run.runtime
    try:
        ok = await run.rpc.call("state.commit", _args(run.sc, {"writes": writes}), run.id)
    except RpcError as e:
        names = [w["field"] for w in writes]
        if not retryable(e.kind):
            why = "refused (%s); not sent again" % e.kind
        elif len(runtime.commits) < _PENDING:
            runtime.commits.append((run.id, run.sc, writes))
            why = "failed (%s); it is sent again on the next connection" % e.kind
        else:
            why = "failed (%s) and is lost: %d earlier commits already wait to be sent" % (
                e.kind, len(runtime.commits))
        await run.event("error", {"kind": "commit", "msg": "the commit of %s %s"
                                  % (", ".join(names), why), "fields": names})
        return
    for name, kind in _refused(ok):
        await run.event("error", {"kind": "commit", "msg": "the write of %s was refused (%s)"
                                  % (name, kind), "fields": [name]})


def _refused(ok):
    # The writes the bridge refused one by one: (field, kind).
    out = []
    results = ok.get("results") if isinstance(ok, dict) else None
    for r in results if isinstance(results, list) else ():
        if isinstance(r, dict) and isinstance(r.get("err"), dict):
            out.append((r.get("field"), r["err"].get("kind")))
    return out


async def resend(runtime):
    # On a new connection: the commits that failed, oldest first, with their write ids.
    # Their runs have ended, so what happens to them is told on the device stream.
    if runtime.resending:
        return
    runtime.resending = True
    try:
        while runtime.commits:
            run_id, sc, writes = runtime.commits[0]
            names = [w["field"] for w in writes]
            try:
                ok = await runtime.rpc.call("state.commit", _args(sc, {"writes": writes}), run_id)
            except RpcError as e:
                if retryable(e.kind):
                    return  # kept for the next connection
                runtime.commits.pop(0)
                runtime.device_stream.emit("error", {
                    "kind": "commit", "r": run_id, "fields": names,
                    "msg": "the commit of %s was refused (%s) when sent again" % (
                        ", ".join(names), e.kind)})
                runtime.device_stream.pump()
                continue
            runtime.commits.pop(0)
            for name, kind in _refused(ok):
                runtime.device_stream.emit("error", {
                    "kind": "commit", "r": run_id, "fields": [name],
                    "msg": "the write of %s was refused (%s)" % (name, kind)})
                runtime.device_stream.pump()
    finally:
        runtime.resending = False
