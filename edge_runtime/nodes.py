# Nodes for a handler of an app's own (PROTOCOL.md "Nodes"): the named steps of a run,
# which hosts see as node.start / node.end carrying the node's path (envelope n), its
# activation (a: the how-many-th start of that path in the run, from 1) and, when the
# handler gives one, its iteration (k); the edges the run takes between them; usage per
# node. The model loop marks its own (/model, /tool/<name>: toolloop.node) without this
# module, which only an app that imports it loads.
#
#     from edge_runtime import nodes
#
#     async def handle(run):
#         async with nodes.Node(run, "/sense", "sensor") as sense:
#             level = read_level()
#             sense.port = "low" if level < 20 else "ok"   # the way out it took
#         if sense.port == "low":
#             await nodes.edge(run, "/sense", "low", "/refill")
#             async with nodes.Node(run, "/refill", "valve"):
#                 ...
#
# A node whose block raises ends `failed` (`cancelled` when the run is cancelled) and the
# exception goes on. The run's budget (budget.py) is checked as each node starts: a node
# past it raises RunFailed there, and the run ends run.failed (kind budget). A handler
# may end by handing its run to the model loop (`return await toolloop.model_loop(run)`),
# which goes on counting activations; a run that pauses there resumes in the model loop.
from edge_runtime import platform

try:
    from micropython import const
except ImportError:
    def const(x):
        return x

_MAX_PATH = const(128)  # characters of a node path: it rides on each of its events
# A const tuple, not literals: its strs are not names in the board's qstr pool, which an
# app's own names (its main.py, compiled on the board) bring near its next doubling, 7
# KiB at once on a 64-bit board; every name here is one an app cannot have.
_STATUSES = const(("completed", "failed", "cancelled"))


def check(path):
    # An absolute path of named parts: "/plan", "/plan/search". Raises ValueError (the
    # app's mistake, raised where it is made) for anything else.
    if not isinstance(path, str) or not 1 < len(path) <= _MAX_PATH or path[0] != "/" \
            or "" in path[1:].split("/"):
        raise ValueError("a node path is /name or /name/name..., at most %d characters: %r"
                         % (_MAX_PATH, path))


async def start(run, path, kind=None, k=None):
    # Starts node `path` (node.start {kind}): counted, then allowed by the run's budget.
    # Returns the node's key, (path, a) or (path, a, k), for end() and usage().
    check(path)
    a = run.nodes[path] = run.nodes.get(path, 0) + 1
    if run.agent.budget:
        from edge_runtime import budget
        await budget.step(run, path, None)
    key = (path, a) if k is None else (path, a, k)
    await run.event("node.start", {"kind": kind} if kind is not None else {}, key)
    return key


async def end(run, key, status="completed", port=None):
    # Ends the node start() returned: node.end {status, port}; `port` names the way out
    # it took, when it branches.
    if status not in _STATUSES:
        raise ValueError("a node ends completed, failed or cancelled, not %r" % (status,))
    d = {"status": status}
    if port is not None:
        d["port"] = port
    await run.event("node.end", d, key)


async def edge(run, node, port, to):
    # The run goes from `node` by its port `port` to node `to`: edge {from, port, to}.
    # (Parameters named with names the board has already: see _STATUSES.)
    check(node)
    check(to)
    await run.event("edge", {"from": node, "port": port, "to": to})


async def usage(run, key, d):
    # Model tokens a node spent, {in, out, reason} (a handler that called a model
    # itself): usage on the node. Progress only: run.done's usage is the run's total.
    out = {}
    for name in ("in", "out", "reason"):
        value = d.get(name) if isinstance(d, dict) else None
        out[name] = value if isinstance(value, int) and not isinstance(value, bool) else 0
    await run.event("usage", out, key)


class Node:
    # `async with Node(run, path, kind, k) as n:` starts the node and ends it with the
    # block: completed (with `n.port`, when the block set one), or failed / cancelled
    # when it raised. `n.a` is its activation once started.

    def __init__(self, run, path, kind=None, k=None):
        check(path)
        self.run = run
        self.path = path
        self.kind = kind
        self.k = k
        self.port = None
        self.key = None

    @property
    def a(self):
        return self.key[1] if self.key is not None else None

    async def __aenter__(self):
        self.key = await start(self.run, self.path, self.kind, self.k)
        return self

    async def __aexit__(self, t, exc, tb):
        if t is None:
            await end(self.run, self.key, "completed", self.port)
            return False
        # Emitted without waiting for the link: an exception, a cancel above all, must
        # not wait here; the event waits in the run's ring instead.
        cancelled = isinstance(exc, platform.asyncio.CancelledError) or \
            t is platform.asyncio.CancelledError
        self.run.emit("node.end", {"status": "cancelled" if cancelled else "failed"}, self.key)
        return False
