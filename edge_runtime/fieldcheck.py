# The rules a field declaration keeps (PROTOCOL.md "Declared fields"), checked where an
# app declares its fields (fields.py imports this module for that and lets it go
# again): a bad declaration is a ValueError there, not a refusal from the bridge at the
# first run, and the board's heap does not keep the rules for its life.

try:
    from micropython import const
except ImportError:
    def const(x):
        return x

# The contract's choices for each key, space-separated with a space at each end
# (" word " is in it). const: no names of their own in the board's qstr pool (see
# memtools.TOOLS).
_CHOICES = const((
    ("vis", " public private "),
    ("dur", " run session user agent tenant subject "),
    ("merge", " replace append sum max min union deep "),
    ("kind", " slot collection "),
))
_NAME_CHARS = const("abcdefghijklmnopqrstuvwxyz0123456789_")
_MAX_NAME = const(64)
_MAX_FMT = const(32)


def _count(value):
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def field(f):
    # One declaration on its own.
    name = f.name
    if not isinstance(name, str) or not 0 < len(name) <= _MAX_NAME or [
            c for c in name if c not in _NAME_CHARS]:
        raise ValueError("field name %r must be 1-%d characters of [a-z0-9_]"
                         % (name, _MAX_NAME))
    for k, table in _CHOICES:
        v = getattr(f, k)
        if not isinstance(v, str) or " %s " % v not in table:
            raise ValueError("field %s: %s must be one of%s" % (name, k, table.rstrip()))
    fmt = f.fmt
    if fmt is not None and not (isinstance(fmt, str) and 0 < len(fmt) <= _MAX_FMT):
        raise ValueError("field %s: fmt must be a string of 1-%d characters" % (name, _MAX_FMT))
    if not isinstance(f.stream, bool) or not isinstance(f.core, bool):
        raise ValueError("field %s: stream and core are bools" % name)
    if not _count(f.max) or not (f.ttl is None or _count(f.ttl)):
        raise ValueError("field %s: max and ttl are positive ints" % name)
    if f.core and (f.dur not in ("agent", "user") or f.kind != "slot"):
        # Core memory is one document per scope, and only these scopes have one.
        raise ValueError("field %s: a core field is a slot with dur agent or user" % name)
    key = f.key
    if key is not None and (f.kind != "collection" or not isinstance(key, str) or not key):
        raise ValueError("field %s: key is a property name, for a collection only" % name)


def agent(fields, kind):
    # An agent's fields: declarations (of class `kind`), names unique, at most one core
    # field per scope.
    seen = {}
    for f in fields:
        if not isinstance(f, kind):
            raise ValueError("fields must be edge_runtime.fields.Field declarations")
        core = "core " + f.dur if f.core else None
        if f.name in seen or (core and core in seen):
            raise ValueError("field %s: names must be unique, and one core field per scope"
                             % f.name)
        seen[f.name] = 1
        if core:
            seen[core] = 1
