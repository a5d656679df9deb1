# A run's memory as it starts (memtools.py holds the rest, for the run's steps): the core
# documents opened, the streamed tables shown as stored, and the model's tool specs with
# the memory tools that apply. Needed once a run, before its first model call, so the
# model loop imports this module for that and lets it go (platform.unload): its code is
# not on the heap while the steps run, where a memory run peaks (in a memory tool's own
# call to the bridge).
from edge_runtime import codec, platform
from edge_runtime.memtools import TOOLS, _kind


async def start(mem, tools):
    # Opens what the run's memory needs and returns the model's tools, encoded: `tools`,
    # the agent's own specs, then the memory tools that apply.
    run = mem.run
    for f in run.agent.fields:
        if f.core:
            # core.py only for the open, as for an edit (memtools): see platform.unload.
            from edge_runtime import core
            try:
                d = await core.open_doc(run, f)
            finally:
                core = None
                platform.unload("core")
            if d is not None:
                mem.docs[f.name] = d
        elif f.stream and f.vis != "private" and f.kind == "collection":
            # A table hosts watch: shown as stored (rows.py, loaded for it alone).
            from edge_runtime import rows
            try:
                await rows.start(run, f)
            finally:
                rows = None
                platform.unload("rows")
    # A msgpack array written one tool's dict at a time (the eleven schemas as dicts at
    # once are 7 KiB of heap, 64-bit unix port). Walked twice, counted and then written
    # into one buffer of the exact size (2 KiB for the eleven): encoded one by one and
    # joined, they were on the heap twice over at the run's start, where a memory run
    # peaked (bench_heap's memory figure).
    n = size = 0
    for d in _specs(mem, tools):
        n += 1
        size += codec.size(d)
    # An array header: fixarray below 16 items, else array 16.
    head = bytes([0x90 | n]) if n < 16 else bytes([0xdc, n >> 8, n & 0xff])
    buf = bytearray(len(head) + size)
    buf[:len(head)] = head
    mv = memoryview(buf)
    pos = len(head)
    for d in _specs(mem, tools):
        pos += len(codec.Encoder(buf=mv[pos:]).pack(d))
    return buf


def _specs(mem, tools):
    for t in tools:
        yield t
    fields = mem.run.agent.fields
    for line in TOOLS.split("\n"):
        name, kinds, args, desc = line.split(";", 3)
        for f in fields:
            if _kind(f) in kinds and (not f.core or f.name in mem.docs):
                break
        else:
            continue
        props = {}
        required = []
        for a in args.split():
            opt = a.endswith("?")
            a = a.rstrip("?")
            # A stored value may be any JSON; counts are integers; the rest text.
            props[a] = {} if a == "value" else {
                "type": "integer" if a in ("k", "limit") else "string"}
            if not opt:
                required.append(a)
        yield {"name": "memory." + name, "description": desc, "args": {
            "type": "object", "properties": props, "required": required}}
