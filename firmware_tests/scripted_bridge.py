# The bridge's side of the contract, played from a script, and a board wired as board.py
# wires one, for the board tests that need both (test_runs, test_flow). A second Link
# plays the bridge: it answers llm.complete from the script, collects events and sends
# ctl; nothing of the runtime is replaced. Not a test module: it holds no tests.
from edge_runtime import codec
from edge_runtime import platform
from edge_runtime.agent import Agent
from edge_runtime.link import Link
from edge_runtime.platform import ticks_diff, ticks_ms, wait_for_ms
from edge_runtime.runs import Runtime
from firmware_tests.support import broker_address

P = "wren/v1/d/"


def make_agent():
    agent = Agent("thermostat", "0.1.0", "You watch a room.")

    @agent.tool("read_temperature", "Read the room in C")
    def read_temperature(args):
        return 21.5

    @agent.tool("explode", "Always fails")
    def explode(args):
        raise ValueError("sensor unplugged")

    return agent


# Turn n of the scripted model is chosen by how many assistant messages it was sent.
SCRIPT = [
    [{"text": "Let"}, {"text": " me "}, {"text": "check."}, {"tool": {"call": "c1", "name": "read_temperature", "input": "{}"}}],
    [{"text": "It is 21.5 C."}],
]


class ScriptedBridge:
    # Plays the bridge's side of the contract: numbered chunks, never more than the
    # board's window past its acks, the final answer counting the chunks. A script step
    # may also misbehave as a broker or a bridge can: {"dup": 1} sends the last chunk
    # again, {"skip": 1} spends a number without sending it, {"hold": 1} stops sending
    # (the stream hangs until the test ends). {"stream": [text, n]} is `text` sent in
    # chunks of n characters, cut as they go (a script of 500 small dicts would fill
    # the test heap the board shares).
    def __init__(self, device, script, answer_rpc=True):
        host, port = broker_address()
        self.base = P + device + "/"
        self.script = script
        self.answer_rpc = answer_rpc
        self.events = []
        self.calls = []
        self.acks = {}  # call id -> the highest chunk the board acknowledged
        self.stops = []  # call ids the board said stop for
        self.sent = {}  # call id -> chunks sent
        self.link = Link("bridge-" + device, host, port, on_message=self.on_message,
                         rx_size=4096, outbox_size=32, max_packet=40000)
        self.link.subscribe(self.base + "evt", 1)
        self.link.subscribe(self.base + "rpc", 1)
        self.link.subscribe(self.base + "hello", 1)
        self.hellos = []
        self._news = platform.asyncio.Event()  # set by every message the bridge takes

    @property
    def hello(self):
        return self.hellos[-1] if self.hellos else None

    def on_message(self, topic, payload):
        self._news.set()
        msg = codec.decode(payload)
        if topic.endswith("/evt"):
            self.events.extend(msg if isinstance(msg, list) else [msg])
        elif topic.endswith("/hello"):
            self.hellos.append(msg)
        elif topic.endswith("/rpc"):
            if "ack" in msg and "m" not in msg:
                self.acks[msg["c"]] = max(self.acks.get(msg["c"], 0), msg["ack"])
                if msg.get("stop"):
                    self.stops.append(msg["c"])
                return
            self.calls.append(msg)
            if self.answer_rpc:
                self.answer(msg)

    def answer(self, call):
        platform.asyncio.create_task(self._answer(call))

    async def _answer(self, call):
        turn = sum(1 for m in call["a"]["messages"] if m["role"] == "assistant")
        c = call["c"]
        if turn >= len(self.script):
            await self.put("rpc/res", {"c": c, "s": 0, "err": {"kind": "llm", "msg": "script exhausted"}})
            return
        finish = "tool_calls" if any("tool" in s for s in self.script[turn]) else "stop"
        window = self.hello["limits"]["window"]
        n = 0
        last = None
        for step in self._steps(self.script[turn]):
            if "finish" in step:  # a step that only sets the final answer's finish
                finish = step["finish"]
                continue
            if "hold" in step:
                return
            if "dup" in step:
                await self.put("rpc/res", last)
                continue
            n += 1
            if "skip" in step:
                continue
            await self.wait_for(lambda: n - self.acks.get(c, 0) <= window)
            last = {"c": c, "s": n, "ch": step}
            await self.put("rpc/res", last)
            self.sent[c] = n
        await self.put("rpc/res", {"c": c, "s": n, "ok": {"usage": {"in": 10, "out": 5, "reason": 0},
                                                         "finish": finish}})

    def _steps(self, turn):
        for step in turn:
            if "stream" in step:
                text, n = step["stream"]
                for k in range(0, len(text), n):
                    yield {"text": text[k:k + n]}
            else:
                yield step

    async def put_status(self, st, boot="b1"):
        msg = {"st": st, "id": "test", "boot": boot}
        assert self.link.publish("wren/v1/b/status", codec.encode(msg), 1, True)
        await self.wait_for(lambda: self.link.pending == 0)

    async def put(self, leaf, msg_or_bytes):
        # Waits for room in the outbox: a long script is more than it holds.
        assert await self.link.wait_room(10000), "the scripted bridge's outbox stayed full"
        self.send(leaf, msg_or_bytes)

    def send(self, leaf, msg_or_bytes):
        data = msg_or_bytes if isinstance(msg_or_bytes, bytes) else codec.encode(msg_or_bytes)
        assert self.link.publish(self.base + leaf, data, 1), "the scripted bridge's outbox is full"

    def of_run(self, run_id):
        # By id, each once: a resend after a reconnect may deliver an event twice.
        seen = {}
        for e in self.events:
            if e["r"] == run_id:
                seen[e["i"]] = e
        return [seen[i] for i in sorted(seen)]

    def ended(self, t="run.done"):
        return [e for e in self.events if e["t"] == t]

    async def wait_for(self, pred, ms=10000):
        # Looks again as soon as a message comes (what most conditions wait for: an
        # ack, an event) and every 20 ms besides (the runtime's own state). The bound
        # is on the machine's clock (ticks_ms and wait_for_ms bound at import), whatever
        # clock the board is given.
        start = ticks_ms()
        while not pred():
            if ticks_diff(ticks_ms(), start) >= ms:
                raise AssertionError("timed out; events: %r" % (self.events[-20:],))
            self._news.clear()
            try:
                await wait_for_ms(self._news.wait(), 20)
            except platform.asyncio.TimeoutError:
                pass


async def with_board(device, body, script=SCRIPT, settings=None, agent=None):
    host, port = broker_address()
    bridge = ScriptedBridge(device, script)
    runtime = Runtime(agent or make_agent(), device, settings or {})
    # Wired as board.py wires a board: the runtime's receive buffer, callbacks, last will
    # and persistent session.
    link = Link(device, host, port, backoff_ms=(50, 200), **runtime.link_settings())
    runtime.attach(link)
    tasks = [platform.asyncio.create_task(bridge.link.run())]
    try:
        assert await bridge.link.wait_connected(5000)
        # Online, retained, as the real bridge says it: a board fails its calls at once
        # while the bridge's presence says offline (and a test bridge of another module
        # may have left that behind on the shared broker).
        await bridge.put_status("online")
        tasks.append(platform.asyncio.create_task(link.run()))
        assert await link.wait_connected(5000)
        await bridge.wait_for(lambda: bridge.hello is not None)
        await body(bridge, runtime)
    finally:
        link.stop()
        bridge.link.stop()
        for t in tasks:
            try:
                await wait_for_ms(t, 3000)
            except Exception:
                t.cancel()
        # The board's session is persistent: leave none behind on the shared broker.
        clean = Link(device, host, port, clean_session=True, rx_size=256)
        t = platform.asyncio.create_task(clean.run())
        await clean.wait_connected(5000)
        clean.stop()
        await wait_for_ms(t, 3000)


def device_errors(bridge):
    return [e["d"] for e in bridge.of_run("_") if e["t"] == "error"]
