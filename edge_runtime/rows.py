# Tables and outputs on the event stream (PROTOCOL.md "Tables"): a public slot declared
# with stream=True is an `output` each time it is set; the rows of a public collection
# declared so reach hosts as `row` events, so a dashboard shows the
# table as the run builds it. A write goes `building` (the write is on its way to the
# bridge) then `final` (stored, with its version) or `failed`; a forgotten row is a
# `row.delete`. At run start the table as the bridge holds it is shown again, newest
# first, each row `final` and `stored`: a later run of the same conversation reopens
# the table where the last one left it. Loaded by the memory tools only for such a
# field, and let go after each use (see platform.unload).
from edge_runtime.rpc import RpcError

try:
    from micropython import const
except ImportError:
    def const(x):
        return x

# Rows per mem.list page at run start: one page is one RPC answer, which must fit the
# board's receive buffer (4 KiB by default) with each row's value, links and provenance.
_PAGE = const(4)
# At most this many rows are shown again at run start: a dashboard's view of the table,
# not an export of it (memory.list reads further).
_REHYDRATE = const(50)


def _args(run, args):
    if run.sc is not None:
        args["sc"] = run.sc
    return args


def _final(f, row, stored):
    d = {"field": f.name, "row": row.get("key"), "status": "final", "value": row.get("value"),
         "ver": row.get("ver")}
    links = row.get("links")
    if links:
        d["links"] = links
    if stored:
        d["stored"] = True
    return d


async def start(run, f):
    # The stored table, newest first. A page the board cannot receive (rows too large
    # for its buffer) is asked for again one row at a time; a single row past the buffer
    # ends the showing with an error event that says so, and the run goes on.
    shown = 0
    cursor = None
    page = _PAGE
    while shown < _REHYDRATE:
        args = {"field": f.name, "limit": min(page, _REHYDRATE - shown)}
        if cursor is not None:
            args["cursor"] = cursor
        try:
            ok = await run.rpc.call("mem.list", _args(run, args), run.id)
        except RpcError as e:
            if e.kind == "too_large" and page > 1:
                page = 1
                continue
            await run.event("error", {"kind": e.kind, "msg": "table %s: %d rows shown, then: %s"
                                      % (f.name, shown, e.msg)})
            return
        rows = ok.get("rows") if isinstance(ok, dict) else None
        for row in rows if isinstance(rows, list) else ():
            if isinstance(row, dict):
                await run.event("row", _final(f, row, True))
                shown += 1
        cursor = ok.get("cursor") if isinstance(ok, dict) else None
        if not isinstance(cursor, str):
            return


def _row_id(f, args):
    # The row a write is about, known before the bridge answers: its key, or the value's
    # upsert-key property (as the bridge reads it). A keyless insert is given its write
    # id as key: unique, so still an insert, and a retry (same write id) is the same row.
    key = args.get("key")
    if key is None and f.key is not None and isinstance(args.get("value"), dict):
        prop = args["value"].get(f.key)
        if isinstance(prop, str) and prop:
            key = prop
        elif isinstance(prop, int) and not isinstance(prop, bool):
            key = str(prop)
    if key is None:
        key = args["key"] = args["w"]
    return key


async def write(run, f, op, args):
    # One mem.* write of the table's field, shown as it happens. Returns the bridge's
    # answer; a refusal is shown `failed` and raised on to the memory tool. A run that
    # is cancelled while the write is out shows it `failed` too, so no row stays
    # `building` (the bridge does the same for a run whose board is gone). A slot (the
    # run has set it already) is an `output`: set whole, so `final` at once.
    name = f.name
    if f.kind != "collection":
        d = {"name": name, "value": run.state.get(name), "status": "final"}
        if f.fmt:
            d["format"] = f.fmt
        await run.event("output", d)
        return None
    if op == "forget":
        ok = await run.rpc.call("mem.forget", args, run.id)
        await run.event("row.delete", {"field": name, "row": args["key"]})
        return ok
    row = _row_id(f, args)
    # The value written is the row's value only under `replace`; another merge's value
    # is known once stored.
    known = op == "remember" and f.merge == "replace"
    d = {"field": name, "row": row, "status": "building"}
    if known:
        d["value"] = args["value"]
    await run.event("row", d)
    try:
        ok = await run.rpc.call("mem." + op, args, run.id)
    except RpcError as e:
        await run.event("row", {"field": name, "row": row, "status": "failed",
                                "err": {"kind": e.kind, "msg": e.msg}})
        raise
    except BaseException:
        run.emit("row", {"field": name, "row": row, "status": "failed",
                         "err": {"kind": "cancelled", "msg": "the run ended during the write"}})
        raise
    ver = ok.get("ver") if isinstance(ok, dict) else None
    if known:
        await run.event("row", {"field": name, "row": row, "status": "final",
                                "value": args["value"], "ver": ver})
        return ok
    # Merged, edited or relinked: what is stored now, read back.
    try:
        peeked = await run.rpc.call("mem.peek", _args(run, {"field": name, "key": row}), run.id)
        stored = peeked.get("row") if isinstance(peeked, dict) else None
    except RpcError:
        stored = None
    if isinstance(stored, dict):
        await run.event("row", _final(f, stored, False))
    else:
        await run.event("row", {"field": name, "row": row, "status": "final", "ver": ver})
    return ok
