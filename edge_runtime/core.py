# Core memory (DESIGN.md "Core memory"): one document per scope, the agent's and the
# calling user's, each limited to its core field's `max` characters. The board is where
# it lives: on flash, one file per document, rewritten whole (temp file + rename) at
# each edit; the bridge keeps a backup (core.sync after each edit, `ver` one higher each
# time) that restores it (core.load) to a board whose flash has none. It goes to the
# model in every call's system message with its size and limit, and never onto the event
# stream. Loaded by the memory tools only when the agent declares a core field.
#
# A flash file is the msgpack map {v: ver, d: doc, s: the last ver the bridge took}: an
# edit whose backup did not get through (s < v) is backed up at the next run's start.
from edge_runtime import codec, platform
# A document is memtools' Doc: it lives as long as the run, and this module does not
# (memtools lets it go after each open and edit, see platform.unload).
from edge_runtime.memtools import Doc
from edge_runtime.rpc import RpcError


def _args(run, args):
    if run.sc is not None:
        args["sc"] = run.sc
    return args


def _path(run, scope):
    # The user's document is named by the user id, hex-encoded: an id may hold any
    # character, a file name may not.
    name = "agent"
    if scope == "user":
        name = "u_" + "".join("%02x" % b for b in run.user.encode())
    return "%score_%s.bin" % (run.runtime.flash_dir, name)


def _read(path):
    # A reset between removing the old file and renaming the new one (FAT) leaves the
    # new one under its temporary name.
    raw = platform.read_file(path) or platform.read_file(path + ".tmp")
    if not raw:
        return None
    try:
        rec = codec.decode(raw, len(raw), len(raw))
    except codec.CodecError:
        platform.log("core memory file", path, "is corrupt; restoring it from the bridge")
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("d"), str):
        return None
    return rec


def _write(d):
    platform.write_file(d.path, codec.encode({"v": d.ver, "d": d.text, "s": d.synced},
                                             len(d.text) * 4 + 64))


async def open_doc(run, field):
    # The run's copy of a scope's document, from flash or else the bridge's backup.
    # None for the user scope of a run without a user.
    if field.dur == "user" and not run.user:
        return None
    d = Doc(field, _path(run, field.dur))
    rec = _read(d.path)
    if rec is not None:
        d.ver, d.text = rec.get("v", 0), rec["d"]
        d.synced = rec.get("s", d.ver)
        if d.synced < d.ver:
            await _sync(run, d)
        return d
    try:
        ok = await run.rpc.call("core.load", _args(run, {"scope": d.scope}), run.id)
    except RpcError as e:
        # The run goes on without it: the model is told it is unavailable, and edits are
        # refused (a document started empty would overwrite the backup at its first edit).
        d.error = e.kind
        await run.event("error", {"kind": e.kind, "msg": "core memory %s could not be loaded"
                                  % d.scope})
        return d
    if isinstance(ok, dict) and isinstance(ok.get("ver"), int) and ok["ver"] > 0:
        d.ver = d.synced = ok["ver"]
        d.text = ok.get("doc") if isinstance(ok.get("doc"), str) else ""
        _write(d)
    return d


async def _sync(run, d):
    # The backup of this version; True when the bridge took it. A newer backup (another
    # board of the same user, say) wins: the board takes it, and the caller says so.
    try:
        await run.rpc.call("core.sync", _args(run, {"scope": d.scope, "ver": d.ver,
                                                    "doc": d.text, "w": run.w()}), run.id)
    except RpcError as e:
        got = e.detail or {}
        if e.kind == "conflict" and isinstance(got.get("ver"), int) and got["ver"] >= d.ver \
                and isinstance(got.get("doc"), str):
            if got["ver"] == d.ver and got["doc"] == d.text:
                d.synced = d.ver  # a backup that did arrive, answered again
                _write(d)
                return True
            d.ver = d.synced = got["ver"]
            d.text = got["doc"]
            _write(d)
            return False
        platform.log("core memory", d.scope, "not backed up:", e.kind)
        return True
    d.synced = d.ver
    _write(d)
    return True


async def edit(run, d, old, text):
    # memory.append (old None) or memory.replace: (output, failed) for the model. An edit
    # past the limit is refused with what it would take, never cut.
    if d.error is not None:
        return "core memory %s is unavailable (it could not be loaded: %s)" % (d.scope, d.error), True
    if not isinstance(text, str) or (old is not None and not isinstance(old, str)):
        return "text and old must be strings", True
    doc = d.text
    if old is None:
        if not text:
            return "nothing to append", True
        # Entries on lines of their own.
        new = doc + "\n" + text if doc else text
    else:
        n = doc.count(old) if old else 0
        if n != 1:
            if n:
                return "old occurs %d times in core memory %s; quote more of it" % (n, d.scope), True
            return "old must match text in core memory %s exactly" % d.scope, True
        new = doc.replace(old, text, 1)
    limit = d.field.max
    if len(new) > limit:
        return ("core memory %s is %d/%d characters; this edit needs %d more; replace or "
                "remove something first" % (d.scope, len(doc), limit, len(new) - limit)), True
    d.text = new
    d.ver += 1
    _write(d)
    if not await _sync(run, d):
        return ("core memory %s was changed elsewhere and now reads as in the next system "
                "message; make the edit again if it is still needed" % d.scope), True
    return "core memory %s is now %d/%d characters" % (d.scope, len(d.text), limit), False
