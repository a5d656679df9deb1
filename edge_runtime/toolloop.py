# The default handler: the model tool loop. Ask the bridge's model (llm.complete) with
# the conversation so far, stream its text as msg.delta, run the local tools it calls,
# feed their results back, and stop when it answers without calling a tool.
import json

from edge_runtime import platform
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


def _tool_output(value):
    # The model reads text; a number or a map from a sensor becomes its JSON text.
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > _MAX_TOOL_OUTPUT:
        text = text[:_MAX_TOOL_OUTPUT] + " [cut: %d more characters]" % (len(text) - _MAX_TOOL_OUTPUT)
    return text


async def _run_tool(tool, input_text):
    if not isinstance(input_text, str):
        return "arguments must be a JSON object in a string", True
    try:
        args = json.loads(input_text) if input_text else {}
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


async def model_loop(run):
    agent = run.agent
    messages = [{"role": "system", "content": agent.instructions},
                {"role": "user", "content": run.input}]
    specs = [t.model_spec() for t in agent.tools.values()]
    usage = {"in": 0, "out": 0, "reason": 0}
    for step in range(agent.max_steps):
        run.check_cancelled()
        platform.collect()
        m = step + 1
        parts = []
        calls = []

        def on_chunk(ch):
            if not isinstance(ch, dict):
                return
            text = ch.get("text")
            if text:
                parts.append(text)
                run.emit("msg.delta", {"m": m, "text": text})
            elif ch.get("reason"):
                run.emit("reason.delta", {"m": m, "text": ch["reason"]})
            elif isinstance(ch.get("tool"), dict):
                calls.append(ch["tool"])

        run.emit("msg.start", {"m": m, "role": "assistant"})
        args = {"messages": messages, "tools": specs}
        if agent.model:
            args["model"] = agent.model
        if agent.max_tokens:
            args["max_tokens"] = agent.max_tokens
        try:
            final = await run.rpc.call("llm.complete", args, run.id, on_chunk)
        except RpcError as e:
            run.emit("msg.end", {"m": m})
            raise RunFailed("llm", "the model is unavailable (%s)" % e.kind, True)
        run.emit("msg.end", {"m": m})
        if not isinstance(final, dict):
            final = {}
        got = final.get("usage")
        if not isinstance(got, dict):
            got = {}
        for key in usage:
            value = got.get(key)
            if isinstance(value, int):
                usage[key] += value
        reply = {"role": "assistant", "content": "".join(parts)}
        if calls:
            reply["tools"] = calls
        messages.append(reply)
        if not calls:
            if final.get("finish") == "tool_calls":
                # The model called a tool but no call reached the board: ending "done"
                # would claim an answer that was never given.
                raise RunFailed("llm", "the model's tool call was lost on the way", True)
            return usage
        for call in calls:
            run.check_cancelled()
            name = call.get("name")
            cid = call.get("call")
            input_text = call.get("input") or "{}"
            tool = agent.tools.get(name) if isinstance(name, str) else None
            run.emit("tool.call", {"call": cid, "name": name, "input": input_text,
                                   "client": False})
            if tool is None:
                output, failed = "no tool named %s" % name, True
            else:
                output, failed = await _run_tool(tool, input_text)
            run.emit("tool.result", {"call": cid, "output": output, "failed": failed})
            messages.append({"role": "tool", "call": cid, "content": output})
    raise RunFailed("condition", "the model did not finish within %d steps" % agent.max_steps)
