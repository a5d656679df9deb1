# The default handler: the model tool loop. Ask the bridge's model (llm.complete) with
# the conversation so far, stream its text as msg.delta, run the local tools it calls,
# feed their results back, and stop when it answers without calling a tool.
import json

from edge_runtime import codec, platform
from edge_runtime.agent import RunFailed
from edge_runtime.rpc import RpcError

try:
    from micropython import const
except ImportError:
    def const(x):
        return x

# A tool's output goes to the model and onto the event stream; past this many
# characters it is cut, and the cut is stated in the output itself.
_MAX_TOOL_OUTPUT = const(2048)
# A turn's text goes back to the model only when the turn called tools, and then it is
# a preamble ("Let me check."): the first this many characters are kept for that, not a
# long answer's every character for the whole run.
_KEEP_TEXT = const(1024)


def _tool_output(value):
    # The model reads text; a number or a map from a sensor becomes its JSON text.
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > _MAX_TOOL_OUTPUT:
        text = text[:_MAX_TOOL_OUTPUT] + " [cut: %d more characters]" % (len(text) - _MAX_TOOL_OUTPUT)
    return text


async def _run_tool(tool, text):
    if not isinstance(text, str):
        return "arguments must be a JSON object in a string", True
    try:
        args = json.loads(text) if text else {}
    except ValueError:
        return "invalid JSON arguments", True
    if not isinstance(args, dict):
        return "arguments must be a JSON object", True
    try:
        value = tool.fn(args)
        if hasattr(value, "send"):  # a coroutine (async tool) on either runtime
            value = await value
        return _tool_output(value), False
    except Exception as e:  # the model sees a failed tool as its error text
        return "%s: %s" % (type(e).__name__, e), True


class _Deltas:
    # One assistant turn's streamed text and reasoning, coalesced into msg.delta and
    # reason.delta events: sent when delta_chars are pending (in pieces of that size)
    # or once the oldest pending character has waited delta_ms, and before any other
    # event; the turn's first text goes at once. A model streams tokens of a few characters; an event per token would be
    # hundreds of events (and ring slots, and MQTT messages) per answer.

    def __init__(self, run, m):
        self.run = run
        self.m = m
        self.kind = None  # "msg.delta" or "reason.delta" while something is pending
        self.parts = []
        self.n = 0
        self.since = 0
        self.text = []  # the turn's first _KEEP_TEXT characters, for the conversation
        self.kept = 0
        self.more = 0  # characters of the turn past those
        self.sent = False  # whether an event of the turn's text has gone

    async def add(self, kind, text):
        if kind != self.kind:
            await self.flush()
            self.kind = kind
        if not self.n:
            self.since = platform.ticks_ms()
        self.parts.append(text)
        self.n += len(text)
        if len(self.parts) > 8:
            # Joined as they come, as the kept text is: a model at full speed sent 86
            # chunks of 3 characters between two pieces, each a str among the run's
            # allocations, and the list of them failed to grow (512-1,024 bytes) in 597
            # of a 1,000-request soak's MemoryErrors at 128K (tests/soak.py).
            self.parts = ["".join(self.parts)]
        if self.n >= self.run.delta_chars:
            await self.flush(False)
        elif not self.sent or platform.ticks_diff(platform.ticks_ms(), self.since) >= self.run.delta_ms:
            # The turn's first text goes at once: the user waits for the first words;
            # coalescing pays off once text is flowing.
            await self.flush()

    async def flush(self, end=True):
        # Full pieces of delta_chars go out; the rest too when the text ends here (`end`:
        # no more may come soon).
        if not self.n:
            return
        size = self.run.delta_chars
        text = "".join(self.parts) if len(self.parts) > 1 else self.parts[0]
        cut = len(text) if end else len(text) - len(text) % size
        self.parts = [text[cut:]] if cut < len(text) else []
        self.n = len(text) - cut
        for k in range(0, cut, size):
            piece = text[k:k + size]
            if self.kind == "msg.delta":
                keep = piece[:max(0, _KEEP_TEXT - self.kept)]
                if keep:
                    self.text.append(keep)
                    self.kept += len(keep)
                    if len(self.text) > 8:
                        # Small pieces (a small delta_chars) joined as they come: a
                        # thousand one-character strs would cost tens of KiB of heap.
                        self.text = ["".join(self.text)]
                self.more += len(piece) - len(keep)
            await self.run.event(self.kind, {"m": self.m, "text": piece})
            self.sent = True
        if self.n:
            self.since = platform.ticks_ms()


# How long the loop waits for a chunk when no text is pending (the call's own timeout
# bounds the whole wait; this only paces checks for a cancel).
_IDLE_MS = const(1000)
# The loop's nodes (PROTOCOL "Nodes"): the two event types, a model step's path, a tool's
# path before its name, and a node's good end. A const tuple rather than five literals:
# its strs are not names in the board's qstr pool (five fewer, test_on_small_heap).
_NODES = const(("node.start", "node.end", "/model", "/tool/", "completed"))
# A model call's failures that are the agent's knowledge rule's, not the model's
# (docs.py): the run fails with the first as its kind. Strs of a const tuple, for
# the same reason as _NODES.
_KB = const(("kb", "forbidden"))


async def node(run, path, usage):
    # A node of the model loop about to start: counted, then allowed by the run's budget
    # (budget.py, which may end the run here; `usage`, the run's so far, before a model
    # step only). Returns its activation, the `a` of the events about it.
    a = run.nodes[path] = run.nodes.get(path, 0) + 1
    if run.agent.budget:
        from edge_runtime import budget
        await budget.step(run, path, usage)
    return a


def _chars(msg):
    n = len(msg.get("content") or "")
    for t in msg.get("tools") or ():
        n += len(t.get("name") or "") + len(t.get("input") or "")
    return n


async def _fit(run, messages, size, first):
    # The conversation within the agent's context_chars: instructions, core memory and
    # what is in view (`size` characters) are always sent, and so are the request and
    # the latest turn; past that, whole turns (an assistant message with its tool
    # results) are left out oldest first, for good (the heap gets them back), and a
    # guard event says how much. messages[first] is the oldest turn: before it come the
    # system message, what is in view (if anything) and the request.
    total = size
    for msg in messages[first - 1:]:
        total += _chars(msg)
    dropped = chars = 0
    budget = run.agent.context_chars
    while total > budget:
        end = first + 1
        while end < len(messages) and messages[end]["role"] == "tool":
            end += 1
        if end >= len(messages):
            break  # only the latest turn is left
        for msg in messages[first:end]:
            total -= _chars(msg)
            chars += _chars(msg)
        dropped += end - first
        del messages[first:end]
    if dropped:
        await run.event("guard", {"name": "context", "action": "trimmed",
                                  "detail": "%d messages, %d characters left out" % (dropped, chars)})


async def model_loop(run, state=None, pause=0):
    # `state`: (messages, next step, usage) of a paused run going on (pause.py). An agent
    # with a tool that pauses (a client tool, or one that needs approval) checkpoints
    # its runs (`pause`, the module), and its checkpoint goes when the run ends: the
    # first call decides, and calls itself with what it decided (no second function's
    # name in the board's qstr pool, which is near its next doubling).
    if pause == 0:
        for t in run.agent.tools.values():
            if t.fn is None or t.approval:
                from edge_runtime import pause
                try:
                    return await model_loop(run, state, pause)
                finally:
                    pause.remove(run)
        pause = None
    agent = run.agent
    messages = [{"role": "system", "content": agent.instructions},
                {"role": "user", "content": run.input}]
    first = 0
    usage = {"in": 0, "out": 0, "reason": 0}
    if state is not None:
        messages, first, usage = state
        state = None
    mem = None
    # The model's tools, encoded: an agent offers the same ones in every run, so they
    # are built at its first run and kept by the agent (877 bytes for the memory
    # thermostat), rather than built and encoded again on each request's way to the
    # model (0.17-0.19 ms of it on the unix port without fields, 0.39 ms with the
    # memory tools). Not kept for an agent with a core field or a table hosts watch:
    # those are opened as each run starts, and which memory tools apply hangs on what
    # opened (memstart.start; the test below is its own, kept here so that an agent
    # whose tools are kept never imports memstart).
    specs = agent.specs
    keep = True
    if agent.fields:
        # Loaded only for an agent that declares fields: the memory tools and core memory,
        # and (only as the run starts) what they need opened first.
        from edge_runtime.memtools import Memory
        mem = Memory(run)
        for f in agent.fields:
            if f.core or (f.stream and f.vis != "private" and f.kind == "collection"):
                keep = False
    if specs is None or not keep:
        tools = [t.describe(False) for t in agent.tools.values()]
        if agent.docs:
            agent.docs.extend(tools)  # kb.search, for a `tool` rule
        if mem is None:
            specs = codec.encode_exact(tools)
        else:
            from edge_runtime import memstart
            try:
                specs = await memstart.start(mem, tools)
            finally:
                memstart = None
                platform.unload("memstart")
        tools = None
        specs = codec.Raw(specs)
        if keep:
            agent.specs = specs
    for step in range(first, agent.max_steps):
        run.check_cancelled()
        if pause is not None:
            await pause.write(run, step, messages, usage, ())
        m = step + 1
        # A step as two functions of its own: what the model step no longer needs (its
        # call's args, its streamed text) goes with it before the tools run (a tool's own
        # calls are where a memory run peaks), and no block of code is 2 KiB that a
        # fragmented heap must find room for (the runtime's import, bench_heap's figure,
        # fits a 32-bit heap 384 bytes smaller, for 32 bytes more on it).
        calls = await _model_step(run, m, messages, usage, specs, mem)
        if not calls:
            return usage
        waiting = await _call_tools(run, calls, messages, mem, m)
        if waiting:
            if mem is not None and mem.viewing:
                # What memory.load keeps in view is this run's, not the checkpoint's.
                del messages[1]
                mem.viewing = False
            # The run's state to flash; the run leaves memory (the runtime sees it
            # paused and ends nothing).
            await pause.write(run, step + 1, messages, usage, waiting)
            return None
    raise RunFailed("condition", "the model did not finish within %d steps" % agent.max_steps)


async def _model_step(run, m, messages, usage, specs, mem):
    # One model step, the node /model: the conversation fitted to the context, the call,
    # the model's text streamed as it comes, and the step's end. Returns the tool calls
    # the model made, its turn appended to `messages` with them; none: it answered.
    agent = run.agent
    emitter = run.emitter  # the run's own, for its whole life
    start, end, model, _, completed = _NODES
    here = (model, await node(run, model, usage), m)
    if mem is None:
        await _fit(run, messages, len(agent.instructions), 2)
    else:
        # Core memory as it is now, and what is in view (memtools).
        await _fit(run, messages, *mem.assemble(messages))
    args = {"messages": messages, "tools": specs}
    if run.conv and run.sc:
        # Whose conversation this is, signed by the bridge: it gives the model the
        # conversation's earlier turns, which the board never holds.
        args["sc"] = run.sc
    if agent.model:
        args["model"] = agent.model
    if agent.max_tokens:
        args["max_tokens"] = agent.max_tokens
    if agent.docs:
        # A `before` rule: the bridge retrieves for the latest user text and adds the
        # passages to the call; they never come here, only which they were (a
        # `cite` chunk, below). The docs Rule's methods carry names the
        # firmware already has (update, send, extend, call): no new ones in the
        # board's qstr pool for every agent (test_on_small_heap).
        agent.docs.update(args)
    deltas = _Deltas(run, m)
    calls = []
    begun = False
    try:
        # The call goes out first: the model's answer is what the run waits for, and
        # whatever is queued ahead of it on the link (msg.start) or read ahead of it
        # at the bridge holds it up. msg.start still comes before the turn's text.
        call = await run.rpc.start("llm.complete", args, run.id)
        try:
            # Right behind the call, as one payload (Emitter.pump): run.started on
            # the first step, node.start and msg.start. Three messages arriving one
            # after another held up the bridge as it started the model call (figure
            # 1 of benchmarks/bench_bridge.py, 0.2-0.5 ms at p50). Waiting (flow) as
            # run.event does: before, for events of the run still waiting; after,
            # when the link had no room for these.
            if emitter.backlog:
                await run.runtime.flow(emitter)
            run.begin()
            emitter.emit(start, {"kind": "model"}, here)
            emitter.emit("msg.start", {"m": m, "role": "assistant"})
            begun = True
            if not emitter.pump():
                await run.runtime.flow(emitter)
            # A turn for the link, then the step's collection while the model
            # works, rather than between the request and the call.
            await platform.sleep_ms(0)
            platform.collect()
            while True:
                # The wait for a chunk: until pending text is due (delta_ms after its
                # oldest character came), or _IDLE_MS when none is pending.
                wait = _IDLE_MS
                if deltas.n:
                    wait = max(1, run.delta_ms - platform.ticks_diff(platform.ticks_ms(),
                                                                     deltas.since))
                ch = await call.next(wait)
                if ch is None:
                    if call.done:
                        break
                    if deltas.n:
                        await deltas.flush()
                    continue
                if not isinstance(ch, dict):
                    continue
                if isinstance(ch.get("text"), str) and ch["text"]:
                    await deltas.add("msg.delta", ch["text"])
                elif isinstance(ch.get("reason"), str) and ch["reason"]:
                    await deltas.add("reason.delta", ch["reason"])
                elif isinstance(ch.get("tool"), dict):
                    await deltas.flush()
                    calls.append(ch["tool"])
                elif agent.docs:
                    # Which passages the bridge added to the call (`cite`).
                    await deltas.flush()
                    await agent.docs.send(run, ch)
            if deltas.n:
                await deltas.flush()
                # A turn for the link to send the turn's last text before msg.end,
                # run.done and the run's collection are made: the host is waiting
                # for the text, not for them.
                await platform.sleep_ms(0)
            final = call.result
        finally:
            run.rpc.end(call)
    except RpcError as e:
        if not begun:
            run.emit(start, {"kind": "model"}, here)
            run.emit("msg.start", {"m": m, "role": "assistant"})
        await deltas.flush()
        run.emit("msg.end", {"m": m})
        run.emit(end, {"status": "failed"}, here)
        # The bridge's own words for a model's failure (what to do about it, and
        # whether asking again can help); anything else failed on the way to it.
        # A `before` agent's knowledge failing is its own kind: the model was never
        # asked (docs.py), and so is its refusal of a collection (`forbidden`).
        kb = e.kind in _KB
        d = e.detail if (kb or e.kind == "llm") and isinstance(e.detail, dict) else {}
        msg = d.get("msg")
        raise RunFailed(_KB[0] if kb else "llm", msg[:200] if isinstance(msg, str) and msg
                        else "the model is unavailable (%s)" % e.kind,
                        d.get("retryable") is True if kb else d.get("retryable") is not False,
                        d.get("cause"))
    # The step's end, msg.end, usage and node.end, goes as one payload too, waiting
    # (flow) as run.event does: before, for the turn's text still waiting; after,
    # when the link had no room for these.
    if emitter.backlog:
        await run.runtime.flow(emitter)
    if not isinstance(final, dict):
        final = {}
    # How the model ended the turn, as the bridge says (`length`: its token limit cut
    # the answer short), so a host can say so.
    finish = final.get("finish")
    emitter.emit("msg.end", {"m": m, "finish": finish} if isinstance(finish, str) else {"m": m})
    got = final.get("usage")
    if not isinstance(got, dict):
        got = {}
    # The step's tokens, on its node; the run's total is run.done's.
    for key in usage:
        value = got.get(key)
        if isinstance(value, int):
            usage[key] += value
    emitter.emit("usage", got, here)
    if not calls and finish == "tool_calls":
        # The model called a tool but no call reached the board: ending "done"
        # would claim an answer that was never given.
        run.emit(end, {"status": "failed"}, here)
        raise RunFailed("llm", "the model's tool call was lost on the way", True)
    # Its way out: to the tools it called, or done with its answer.
    emitter.emit(end, {"status": completed, "port": "tools" if calls else "done"}, here)
    if not emitter.pump():
        await run.runtime.flow(emitter)
    if calls:
        # The turn's text goes back to the model with its tool calls. Joined only now:
        # a long answer that ends the run never needs its text in one piece on the heap.
        text = "".join(deltas.text)
        if deltas.more:
            text += " [cut: %d more characters]" % deltas.more
        messages.append({"role": "assistant", "content": text, "tools": calls})
    return calls


async def _call_tools(run, calls, messages, mem, m):
    # The model step's tool calls in their order, each a node /tool/<name>, its result
    # appended to `messages`. Returns the calls answered later (a client tool, or one that
    # needs approval), for the run's pause.
    agent = run.agent
    start, end, _, tool_path, completed = _NODES
    waiting = []
    for call in calls:
        run.check_cancelled()
        name = call.get("name")
        cid = call.get("call")
        input_text = call.get("input") or "{}"
        tool = agent.tools.get(name) if isinstance(name, str) else None
        if tool is not None and (tool.fn is None or tool.approval):
            # Answered later: announced, with the run's pause, once the turn's other
            # calls have run (pause.py).
            waiting.append(call)
            continue
        path = tool_path + str(name)
        here = (path, await node(run, path, None), m)
        starting = (start, {"kind": "tool"}, here)
        result = None
        if mem is not None and tool is None and isinstance(name, str) and name.startswith("memory."):
            await run.event(*starting)
            output, failed = await mem.tool(cid, name, input_text, _tool_output)
        else:
            # The tool's node.start goes with its tool.call, and its tool.result with
            # its node.end: one payload each (Run.event's `held`).
            await run.event("tool.call", {"call": cid, "name": name, "input": input_text,
                                          "client": False}, None, starting)
            answer = None
            if tool is None and agent.docs:
                # kb.search, for a `tool` rule (None: not its tool).
                answer = await agent.docs.call(run, name, input_text)
            if answer is not None:
                output, failed = answer
            elif tool is None:
                output, failed = "no tool named %s" % name, True
            else:
                output, failed = await _run_tool(tool, input_text)
            result = ("tool.result", {"call": cid, "output": output, "failed": failed}, None)
        await run.event(end, {"status": "failed" if failed else completed}, here, result)
        messages.append({"role": "tool", "call": cid, "content": output})
    return waiting
