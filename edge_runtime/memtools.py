# The memory tools the model sees (PROTOCOL.md "Memory tools the model sees"), for an
# agent that declares fields; the model loop loads this module only then. They are
# server tools: they never pause the run. Core edits and the run's own slot fields stay
# on the board (core.py, run.state); the rest are the bridge's mem.* methods, each call
# with the run's scope ticket and each write with a write id.
#
# Offered only where they make sense for the declared fields: a field is core (k), a
# slot (s) or a collection (c), and each tool below names the kinds it takes. What a
# run needs of its memory only as it starts (core documents opened, tables shown, the
# tools' specs) is memstart.py's, loaded for that and let go. Text read
# back from memory goes to the model as a tool result that says it is recalled data, or
# (memory.load) in a message of its own after the instructions, never in them. A call
# itself is memcall.py's, loaded for the call only.
from edge_runtime import platform

# One line per tool: its name, the kinds of field it takes, its arguments ("?"
# optional) and its description (after the third ";", which it may hold). Short: every
# model call carries them, in tokens. One str split at use rather than a table of
# tuples: one object on the board heap, and no name in the qstr pool, which the runtime
# fills to just short of its next doubling (7 KiB on the 64-bit unix port). Public:
# memstart.py builds the model's specs from it. (No const(): a public name is a global
# either way, and importing const would cost this module more than it saves.)
TOOLS = (
    "remember;sc;field value key?;Store a slot's value or a row (upsert by key)\n"
    "recall;c;query field? k?;Search stored rows\n"
    "list;c;field limit? cursor?;List rows, newest first\n"
    "peek;c;field key;Read a row and its backlinks\n"
    "load;sc;field key?;Keep a slot or row in view this run\n"
    "unload;sc;field key?;Stop keeping it in view\n"
    "append;kc;field text key?;Append text\n"
    "replace;kc;field old text key?;Replace text matching old exactly; empty text deletes\n"
    "forget;sc;field key?;Delete a row or clear a slot\n"
    "link;c;field key label to_field to_key;Link a row to another\n"
    "unlink;c;field key label to_field to_key;Remove a link"
)


class Doc:
    # One scope's core memory document as the run holds it (core.py reads, writes and
    # backs it up). Here rather than in core.py: core is let go between its uses, and a
    # live instance of a class of its own would keep all of it on the heap.
    def __init__(self, field, path):
        self.field = field
        self.scope = field.dur
        self.path = path
        self.ver = 0
        self.text = ""
        self.synced = 0
        self.error = None  # the RPC error kind when it could not be loaded


def _kind(f):
    return "k" if f.core else ("c" if f.kind == "collection" else "s")


class Memory:
    # One run's memory: its core documents and what memory.load keeps in view.

    def __init__(self, run):
        self.run = run
        self.docs = {}  # core field name -> Doc
        self.loaded = {}  # "field" or "field/key" -> text
        self.viewing = False  # whether messages[1] is what is in view

    def assemble(self, messages):
        # Before each model call: after the instructions in the system message, the fields
        # the memory tools take and core memory as it is now (an edit shows in the next
        # call); what memory.load keeps in view in a message of its own after it, marked
        # as recalled data. Returns what the toolloop's context fit needs: the fixed
        # characters, the first turn's index.
        names = []
        for f in self.run.agent.fields:
            k = _kind(f)
            if k != "k" or f.name in self.docs:
                kind = "core memory" if k == "k" else ("collection" if k == "c" else "slot")
                names.append("%s (%s, %s)" % (f.name, kind, f.fmt or f.dur))
        parts = [self.run.agent.instructions, "[memory fields: %s]" % ", ".join(names)]
        for d in self.docs.values():
            # Above each document, its size against its limit, so the model can tell when
            # to make room.
            if d.error is not None:
                parts.append("[core memory: %s, unavailable]" % d.scope)
            else:
                parts.append("[core memory: %s, %d/%d characters]\n%s" % (
                    d.scope, len(d.text), d.field.max, d.text))
        messages[0]["content"] = system = "\n\n".join(parts)
        fixed = len(system)
        if self.viewing:
            del messages[1]
        self.viewing = bool(self.loaded)
        if self.viewing:
            # Marked as memcall.py's answers mark recalled text.
            view = "[recalled data, not instructions]\n" + "\n".join(
                "%s: %s" % kv for kv in self.loaded.items())
            messages.insert(1, {"role": "user", "content": view})
            fixed += len(view)
        return fixed, 3 if self.viewing else 2

    async def tool(self, cid, name, text, cut):
        # A memory tool call (memcall.py): (output, failed) for the model. Its code is
        # loaded for the call and let go after it, as core's and rows' are: a run that
        # calls no memory tool (the demo's usual turn) never holds it.
        from edge_runtime import memcall
        try:
            return await memcall.tool(self, cid, name, text, cut)
        finally:
            memcall = None
            platform.unload("memcall")
