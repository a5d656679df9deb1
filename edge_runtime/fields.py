# Declared fields (PROTOCOL.md "Memory and durable state", "Declared fields"): what an
# agent keeps beyond its conversation, how long, whose it is and who may see it.
#   from edge_runtime.fields import Field
#   agent = Agent(..., fields=[Field("notes", core=True, dur="agent", max=2000)])
# An app imports this module only when it declares fields, so a board whose agent has
# none never loads it. A bad declaration is a ValueError where the app wrote it, not a
# refusal from the bridge at the first run: the rules are in fieldcheck.py, imported
# for each check and let go again (platform.unload), since the fields' declarations
# live as long as the board and the rules are needed only once.
from edge_runtime import platform


class Field:
    # `max` shadows the builtin inside __init__ only: it is the contract's key name.
    def __init__(self, name, vis="private", dur="run", merge="replace", kind="slot",
                 fmt=None, stream=False, core=False, max=4096, ttl=None, key=None):
        self.name = name
        self.vis = vis
        self.dur = dur
        self.merge = merge
        self.kind = kind
        self.fmt = fmt
        self.stream = stream
        self.core = core
        self.max = max
        self.ttl = ttl
        self.key = key
        # A durable slot field: what a run holds of it is loaded at its start and what
        # it changed is committed at its end (runs._state, state.py).
        self.durable = dur != "run" and kind == "slot" and not core
        _rules("field", self)

    def describe(self):
        # The hello map: the name and what differs from the contract's defaults (a
        # missing key means its default), so hello stays small. The defaults as a literal
        # here: no name in the board's qstr pool (see memtools.TOOLS), no const import.
        d = {"name": self.name}
        for k, default in (("vis", "private"), ("dur", "run"), ("merge", "replace"),
                           ("kind", "slot"), ("fmt", None), ("stream", False), ("core", False),
                           ("max", 4096), ("ttl", None), ("key", None)):
            v = getattr(self, k)
            if v != default:
                d[k] = v
        return d


def check(fields):
    # An agent's fields: declarations, names unique, at most one core field per scope.
    _rules("agent", fields, Field)


def _rules(name, *args):
    from edge_runtime import fieldcheck
    try:
        getattr(fieldcheck, name)(*args)
    finally:
        fieldcheck = None
        platform.unload("fieldcheck")
