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

# The contract's tables, space-separated with a space at each end (" word " in it).
_VIS = " public private "
_DUR = " run session user agent tenant subject "
_MERGE = " replace append sum max min union deep "
_KIND = " slot collection "
# Core memory is one document per scope, and only these scopes have one.
_CORE_DUR = " agent user "
_NAME_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"
_MAX_NAME = const(64)
_MAX_FMT = const(32)
_DEFAULT_MAX = const(4096)


def _one_of(what, value, table):
    if not isinstance(value, str) or " %s " % value not in table:
        raise ValueError("field %s must be one of%s" % (what, table.rstrip()))


def _is_name(value):
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_NAME:
        return False
    for ch in value:
        if ch not in _NAME_CHARS:
            return False
    return True


def _count(what, value, none_ok):
    if value is None and none_ok:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError("field %s must be a positive int" % what)


class Field:
    # `max` shadows the builtin inside __init__ only: it is the contract's key name.
    def __init__(self, name, vis="private", dur="run", merge="replace", kind="slot",
                 fmt=None, stream=False, core=False, max=_DEFAULT_MAX, ttl=None, key=None):
        if not _is_name(name):
            raise ValueError("field name %r must be 1-%d characters of [a-z0-9_]"
                             % (name, _MAX_NAME))
        _one_of("vis", vis, _VIS)
        _one_of("dur", dur, _DUR)
        _one_of("merge", merge, _MERGE)
        _one_of("kind", kind, _KIND)
        if fmt is not None and not (isinstance(fmt, str) and 0 < len(fmt) <= _MAX_FMT):
            raise ValueError("field fmt must be a string of 1-%d characters" % _MAX_FMT)
        if not isinstance(stream, bool) or not isinstance(core, bool):
            raise ValueError("field stream and core must be bools")
        _count("max", max, False)
        _count("ttl", ttl, True)
        if core and (" %s " % dur not in _CORE_DUR or kind != "slot"):
            raise ValueError("a core field is a slot with dur agent or user")
        if key is not None and (kind != "collection" or not isinstance(key, str) or not key):
            raise ValueError("field key is a property name, for a collection only")
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

    def describe(self):
        # The hello map: the name and what differs from the contract's defaults (a
        # missing key means its default), so hello stays small.
        d = {"name": self.name}
        if self.vis != "private":
            d["vis"] = self.vis
        if self.dur != "run":
            d["dur"] = self.dur
        if self.merge != "replace":
            d["merge"] = self.merge
        if self.kind != "slot":
            d["kind"] = self.kind
        if self.fmt is not None:
            d["fmt"] = self.fmt
        if self.stream:
            d["stream"] = True
        if self.core:
            d["core"] = True
        if self.max != _DEFAULT_MAX:
            d["max"] = self.max
        if self.ttl is not None:
            d["ttl"] = self.ttl
        if self.key is not None:
            d["key"] = self.key
        return d
