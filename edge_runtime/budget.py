# Budgets per run (PROTOCOL.md "Budgets"): what one run of an agent may spend, declared
# with it, any of
#   Agent(..., budget={"steps": 12, "tokens": 4000, "wall_s": 60, "reads": 20})
# Loaded only for an agent that declares one (and then kept: it is needed at every node),
# so a board whose agent has none never holds this code or interns its names (the qstr
# pool is near its next doubling, test_on_small_heap).
#
# A budget is checked where a node starts (the model loop's model steps and tools,
# toolloop.node; a handler's nodes, nodes.py), so a run stops between two steps, never
# inside one:
#   steps   the nodes the run has started, the one starting included;
#   reads   the memory tools that read from the bridge (memory.recall, memory.list,
#           memory.peek, memory.load), the one starting included;
#   tokens  the model's tokens in and out so far (as the bridge reports them), before
#           each model step: none left, no further call;
#   wall_s  seconds since the run started, the time it waited paused left out.
# At 80 % of a limit the run emits `budget {kind, used, limit, level: "warn"}`, once per
# kind. When the node would take the run past a limit (steps, reads: `used` counts the
# refused one; tokens: the limit is reached; wall_s: the time is up) it emits `budget
# {..., level: "exceeded"}` and ends `run.failed {err: {kind: "budget"}, retryable:
# false}`: asking again spends the same.
#
# The run's spending that is not in its node counts (run.nodes) or its usage is
# run.spent: [wall ms before this stretch, ticks when this stretch began, the kinds
# warned of]; a paused run's is in its checkpoint (pause.py: saved, restored).
#
# Few names of its own: what would be literals are const tuples and one str, split or
# indexed, because every name interned is one an app cannot have before the board's qstr
# pool doubles (7 KiB at once on a 64-bit board; an agent with a budget is an app's own,
# its main.py compiled on the board with its names).
from edge_runtime import platform
from edge_runtime.agent import RunFailed

try:
    from micropython import const
except ImportError:
    def const(x):
        return x

# The kinds, in the order checked; step() tells them by their place in it.
_KINDS = const("steps tokens wall_s reads")
_READS = const(" /tool/memory.recall /tool/memory.list /tool/memory.peek /tool/memory.load ")
_WARN_PERCENT = const(80)
_LEVELS = const(("warn", "exceeded"))
_EVENT = const(("kind", "used", "limit", "level"))  # a budget event's d, in this order


def check(d):
    # A declaration, at the agent's: a map of known kinds, each a positive integer
    # (wall_s any positive number). A mistake here is the app's, raised where it is made.
    if not isinstance(d, dict):
        raise ValueError("budget must be a dict of steps, tokens, wall_s, reads")
    kinds = _KINDS.split()
    for kind in d:
        limit = d[kind]
        if kind not in kinds:
            raise ValueError("unknown budget %r: steps, tokens, wall_s or reads" % (kind,))
        if isinstance(limit, bool) or not (isinstance(limit, int) or kind == kinds[2]
                                           and isinstance(limit, float)) or limit <= 0:
            raise ValueError("budget %s must be a positive integer (wall_s: any positive "
                             "number of seconds)" % kind)


def start(run):
    # A run begins (runs.py): its wall time counts from now.
    run.spent = [0, platform.ticks_ms(), []]


def saved(run):
    # For the run's checkpoint: the wall time so far (the wait that follows a pause is
    # not counted) and the kinds already warned of.
    spent = getattr(run, "spent", None)
    if spent is None:
        return None
    return [spent[0] + platform.ticks_diff(platform.ticks_ms(), spent[1]), spent[2]]


def restored(run, saved):
    # A run from its checkpoint: its wall time goes on from what it had.
    if not isinstance(saved, list) or len(saved) != 2:
        saved = [0, []]
    run.spent = [saved[0], platform.ticks_ms(), saved[1]]


async def step(run, path, usage):
    # Node `path` is about to start, already counted in run.nodes; `usage` is the run's
    # model usage so far before a model step, else None. Returns when the run may go on;
    # raises RunFailed when it may not.
    d = run.agent.budget
    spent = getattr(run, "spent", None)
    if spent is None:
        start(run)
        spent = run.spent
    i = -1
    for kind in _KINDS.split():
        i += 1
        limit = d.get(kind)
        if limit is None:
            continue
        if i == 0:  # steps: the nodes started, this one included
            used = sum(run.nodes.values())
            over = used > limit
        elif i == 1:  # tokens: before a model step, in and out so far
            if usage is None:
                continue
            used = usage.get("in", 0) + usage.get("out", 0)
            over = used >= limit
        elif i == 2:  # wall_s: seconds, this stretch and those before it
            used = round((spent[0] + platform.ticks_diff(platform.ticks_ms(), spent[1]))
                         / 1000, 1)
            over = used >= limit
        else:  # reads: the memory reads started, this one included
            if " %s " % path not in _READS:
                continue
            used = 0
            for p in _READS.split():
                used += run.nodes.get(p, 0)
            over = used > limit
        if not over and (used * 100 < limit * _WARN_PERCENT or kind in spent[2]):
            continue
        spent[2].append(kind)
        await run.event("budget", dict(zip(_EVENT, (kind, used, limit, _LEVELS[over]))))
        if over:
            raise RunFailed("budget", "the run reached its %s budget (%s used of %s)"
                            % (kind, used, limit))
