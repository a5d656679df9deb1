# Declared fields (PROTOCOL.md "Memory and durable state", "Declared fields"): what an
# agent keeps beyond its conversation, how long, whose it is and who may see it.
#   from edge_runtime.fields import Field
#   agent = Agent(..., fields=[Field("notes", core=True, dur="agent", max=2000)])
# An app imports this module only when it declares fields, so a board whose agent has
# none never loads it. A bad declaration is a ValueError where the app wrote it, not a
# refusal from the bridge at the first run.

try:
    from micropython import const
except ImportError:
    def const(x):
        return x

# The contract's tables: each key's choices, space-separated with a space at each end
# (" word " is in it), and the defaults a hello leaves out.
# const: no names of their own in the board's qstr pool (see memtools._TOOLS).
_CHOICES = const((
    ("vis", " public private "),
    ("dur", " run session user agent tenant subject "),
    ("merge", " replace append sum max min union deep "),
    ("kind", " slot collection "),
))
_DEFAULTS = const((("vis", "private"), ("dur", "run"), ("merge", "replace"), ("kind", "slot"),
                   ("fmt", None), ("stream", False), ("core", False), ("max", 4096),
                   ("ttl", None), ("key", None)))
_NAME_CHARS = const("abcdefghijklmnopqrstuvwxyz0123456789_")
_MAX_NAME = const(64)
_MAX_FMT = const(32)


def _count(value):
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


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
        if not isinstance(name, str) or not 0 < len(name) <= _MAX_NAME or [
                c for c in name if c not in _NAME_CHARS]:
            raise ValueError("field name %r must be 1-%d characters of [a-z0-9_]"
                             % (name, _MAX_NAME))
        for k, table in _CHOICES:
            v = getattr(self, k)
            if not isinstance(v, str) or " %s " % v not in table:
                raise ValueError("field %s: %s must be one of%s" % (name, k, table.rstrip()))
        if fmt is not None and not (isinstance(fmt, str) and 0 < len(fmt) <= _MAX_FMT):
            raise ValueError("field %s: fmt must be a string of 1-%d characters" % (name, _MAX_FMT))
        if not isinstance(stream, bool) or not isinstance(core, bool):
            raise ValueError("field %s: stream and core are bools" % name)
        if not _count(max) or not (ttl is None or _count(ttl)):
            raise ValueError("field %s: max and ttl are positive ints" % name)
        if core and (dur not in ("agent", "user") or kind != "slot"):
            # Core memory is one document per scope, and only these scopes have one.
            raise ValueError("field %s: a core field is a slot with dur agent or user" % name)
        if key is not None and (kind != "collection" or not isinstance(key, str) or not key):
            raise ValueError("field %s: key is a property name, for a collection only" % name)

    def describe(self):
        # The hello map: the name and what differs from the contract's defaults (a
        # missing key means its default), so hello stays small.
        d = {"name": self.name}
        for k, default in _DEFAULTS:
            v = getattr(self, k)
            if v != default:
                d[k] = v
        return d


def check(fields):
    # An agent's fields: declarations, names unique, at most one core field per scope.
    seen = {}
    for f in fields:
        if not isinstance(f, Field):
            raise ValueError("fields must be edge_runtime.fields.Field declarations")
        core = "core " + f.dur if f.core else None
        if f.name in seen or (core and core in seen):
            raise ValueError("field %s: names must be unique, and one core field per scope"
                             % f.name)
        seen[f.name] = 1
        if core:
            seen[core] = 1
