# The bridge's side of the contract, played from a script, and a board wired as board.py
# wires one, for the board tests that need both (test_runs, test_flow). A second Link
# plays the bridge: it answers llm.complete from the script, collects events and sends
# ctl; nothing of the runtime is replaced. Not a test module: it holds no tests.
import json

from edge_runtime import codec
from edge_runtime import platform
from edge_runtime.agent import Agent
from edge_runtime.events import PREFIX
from edge_runtime.link import Link
from edge_runtime.platform import ticks_diff, ticks_ms, wait_for_ms
from edge_runtime.runs import Runtime
from firmware_tests.support import broker_address, session_id, topic_root

# The device topics of a runtime given no prefix (a board without a link); the scripted
# bridge and with_board's board use support.topic_root().
P = PREFIX + "/d/"


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


class Refused(Exception):
    def __init__(self, kind, msg, extra=None):
        super().__init__(msg)
        self.err = {"kind": kind, "msg": msg}
        if extra:
            self.err.update(extra)


def _merge(merge, old, value):
    if merge == "sum":
        return (old or 0) + value
    if merge in ("max", "min"):
        if old is None:
            return value
        return max(old, value) if merge == "max" else min(old, value)
    if merge == "append" and old is not None:
        return old + value
    if merge == "union" and old is not None:
        return old + [x for x in value if x not in old]
    if merge == "deep" and isinstance(old, dict) and isinstance(value, dict):
        out = dict(old)
        for k in value:
            if value[k] is None:
                out.pop(k, None)
            else:
                out[k] = _merge("deep", out.get(k), value[k])
        return out
    return value


class Memory:
    # The bridge's durable store as an in-memory table the tests read: slot values and
    # versions, collection rows, core documents, and the write-id ledger (a write id is
    # applied once; a repeat gets the first answer). `fail` holds refusals to answer
    # instead, per method, first in first out: {"state.commit": [{"kind": "busy", ...}]}.
    # The user scope is told apart by the scope ticket, which the tests make up.
    def __init__(self):
        self.values = {}
        self.vers = {}
        self.rows = {}  # field -> {key: row}
        self.cores = {}  # scope (user scope: "user:" + sc) -> {"ver", "doc"}
        self.ledger = {}
        self.fail = {}
        self._keys = 0
        self._seq = 0

    def serve(self, m, a, decls):
        fails = self.fail.get(m)
        # A None in the list answers that call as usual.
        failure = fails.pop(0) if fails else None
        if failure is not None:
            raise Refused(**failure)
        w = a.get("w")
        if w is not None and w in self.ledger:
            return self.ledger[w]
        serve = getattr(self, "_" + m.replace(".", "_"), None)
        if serve is None:
            raise Refused("unknown_method", "no method %s" % m)
        ok = serve(a, decls)
        if w is not None:
            self.ledger[w] = ok
        return ok

    def _field(self, a, decls, name=None):
        name = name or a.get("field")
        if name not in decls:
            raise Refused("unknown_field", "no field %s" % name)
        if decls[name].get("dur") in ("user", "session") and not a.get("sc"):
            raise Refused("no_scope", "no user in the call's scope")
        return decls[name]

    def _state_load(self, a, decls):
        values, vers = {}, {}
        for name in a["fields"]:
            self._field(a, decls, name)
            if name in self.values:
                values[name], vers[name] = self.values[name], self.vers.get(name, 1)
        return {"values": values, "vers": vers}

    def _state_commit(self, a, decls):
        results = []
        for wr in a["writes"]:
            name = wr["field"]
            if wr["w"] in self.ledger:
                results.append(self.ledger[wr["w"]])
                continue
            try:
                d = self._field(a, decls, name)
            except Refused as e:
                results.append({"field": name, "w": wr["w"], "err": e.err})
                continue
            self.values[name] = _merge(d.get("merge", "replace"), self.values.get(name), wr["value"])
            self.vers[name] = self.vers.get(name, 0) + 1
            result = {"field": name, "w": wr["w"], "ver": self.vers[name]}
            self.ledger[wr["w"]] = result
            results.append(result)
        return {"results": results}

    def _table(self, a, decls):
        d = self._field(a, decls)
        return d, self.rows.setdefault(a["field"], {})

    def _row(self, a, decls):
        table = self._table(a, decls)[1]
        if a.get("key") not in table:
            raise Refused("not_found", "no row %s" % a.get("key"))
        return table[a["key"]]

    def _mem_remember(self, a, decls):
        d, table = self._table(a, decls)
        key = a.get("key")
        value = a["value"]
        if key is None and d.get("key") and isinstance(value, dict):
            key = value.get(d["key"])
        if key is None:
            self._keys += 1
            key = "k%d" % self._keys
        row = table.get(key) or {"key": key, "ver": 0, "links": []}
        row["value"] = _merge(d.get("merge", "replace"), row.get("value"), value)
        self._seq += 1
        row["seq"] = self._seq
        row["ver"] += 1
        table[key] = row
        return {"key": key, "ver": row["ver"]}

    def _mem_recall(self, a, decls):
        words = a["query"].lower().split()
        hits = []
        for name in ([a["field"]] if a.get("field") else list(self.rows)):
            for row in self.rows.get(name, {}).values():
                text = json.dumps(row["value"]).lower()
                score = sum(1 for w in words if w in text) / max(1, len(words))
                if score:
                    hits.append({"field": name, "key": row["key"], "score": score,
                                 "value": row["value"]})
        hits.sort(key=lambda h: -h["score"])
        return {"hits": hits[:a.get("k", 5)]}

    def _mem_list(self, a, decls):
        # Newest first by write sequence (a MicroPython dict keeps no insertion order);
        # the cursor is how many were skipped.
        rows = sorted(self._table(a, decls)[1].values(), key=lambda r: -r.get("seq", 0))
        start = int(a.get("cursor") or 0)
        end = start + a.get("limit", 10)
        return {"rows": rows[start:end], "cursor": str(end) if end < len(rows) else None}

    def _mem_peek(self, a, decls):
        return {"row": self._row(a, decls), "backlinks": []}

    def _mem_forget(self, a, decls):
        self._row(a, decls)
        del self.rows[a["field"]][a["key"]]
        return {"key": a["key"], "forgotten": True}

    def _mem_link(self, a, decls):
        row = self._row(a, decls)
        row["links"].append({"label": a["label"], "to_field": a["to_field"], "to_key": a["to_key"]})
        row["ver"] += 1
        return {"ver": row["ver"]}

    def _mem_unlink(self, a, decls):
        row = self._row(a, decls)
        row["links"] = [k for k in row["links"] if not (
            k["label"] == a["label"] and k["to_field"] == a["to_field"] and k["to_key"] == a["to_key"])]
        row["ver"] += 1
        return {"ver": row["ver"]}

    def _text(self, a, decls, edit):
        if a.get("key") is not None:
            row = self._row(a, decls)
            row["value"] = edit(row["value"] or "")
            row["ver"] += 1
            return {"ver": row["ver"]}
        self._field(a, decls)
        name = a["field"]
        self.values[name] = edit(self.values.get(name) or "")
        self.vers[name] = self.vers.get(name, 0) + 1
        return {"ver": self.vers[name]}

    def _mem_append(self, a, decls):
        return self._text(a, decls, lambda old: old + a["text"])

    def _mem_replace(self, a, decls):
        def edit(old):
            if a["old"] not in old:
                raise Refused("not_found", "no such text")
            return old.replace(a["old"], a["text"], 1)
        return self._text(a, decls, edit)

    def _scope(self, a):
        if a["scope"] == "user":
            if not a.get("sc"):
                raise Refused("no_scope", "no user in the call's scope")
            return "user:" + a["sc"]
        return a["scope"]

    def _core_sync(self, a, decls):
        scope = self._scope(a)
        held = self.cores.get(scope)
        if held is not None and a["ver"] <= held["ver"]:
            raise Refused("conflict", "a newer backup is stored", {"ver": held["ver"], "doc": held["doc"]})
        self.cores[scope] = {"ver": a["ver"], "doc": a["doc"]}
        return {"ver": a["ver"]}

    # Document knowledge (PROTOCOL "Knowledge in runs"): what boards added, by
    # collection and src, and a retrieval that finds every added text whose words
    # include one of the query's, first added first.
    def _kb_add(self, a, decls):
        docs = self.rows.setdefault("kb:" + a["collection"], {})
        status = "unchanged" if docs.get(a["src"]) == a["text"] else (
            "changed" if a["src"] in docs else "new")
        docs[a["src"]] = a["text"]
        return {"src": a["src"], "ver": "0" * 64, "status": status, "chunks": 1}

    def _kb_delete(self, a, decls):
        docs = self.rows.get("kb:" + a["collection"], {})
        return {"src": a["src"], "chunks": 1 if docs.pop(a["src"], None) is not None else 0}

    def _kb_retrieve(self, a, decls):
        words = a["query"].lower().split()
        hits = []
        for col in a.get("collections") or [k[3:] for k in self.rows if k.startswith("kb:")]:
            for src, text in self.rows.get("kb:" + col, {}).items():
                if any(w in text.lower() for w in words):
                    hits.append({"collection": col, "source": src, "version": "ab" * 32,
                                 "chunk": 0, "headings": ["Notes"], "score": 0.5,
                                 "text": text[:a.get("max_chars", 8000)], "truncated": False})
        return {"hits": hits[:a.get("k", 5)], "mode": "keyword", "cut": False}

    def _core_load(self, a, decls):
        held = self.cores.get(self._scope(a))
        return dict(held) if held else {"ver": 0}


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
        self.base = "%s/d/%s/" % (topic_root(), device)
        self.script = script
        self.answer_rpc = answer_rpc
        self.events = []
        # The event types of each evt payload, in order: a list of several when the
        # board sent events together (Emitter.pump).
        self.evt_payloads = []
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
        self.memory = Memory()
        # Turn n of the script: by how many assistant messages the call carries, or (when
        # the board trims its context, which drops old turns) by how many model calls of
        # its run came before it.
        self.turn_by_calls = False
        self._turns = {}
        self._news = platform.asyncio.Event()  # set by every message the bridge takes

    @property
    def hello(self):
        return self.hellos[-1] if self.hellos else None

    def on_message(self, topic, payload):
        self._news.set()
        msg = codec.decode(payload)
        if topic.endswith("/evt"):
            self.events.extend(msg if isinstance(msg, list) else [msg])
            self.evt_payloads.append([e["t"] for e in msg] if isinstance(msg, list) else [msg["t"]])
        elif topic.endswith("/hello"):
            self.hellos.append(msg)
        elif topic.endswith("/rpc"):
            if "ack" in msg and "m" not in msg:
                self.acks[msg["c"]] = max(self.acks.get(msg["c"], 0), msg["ack"])
                if msg.get("stop"):
                    self.stops.append(msg["c"])
                return
            self.calls.append(msg)
            if msg.get("m") == "llm.complete":
                # The tools by name only: kept for every call, their schemas would fill
                # the heap the test shares with the board.
                msg["a"]["tools"] = [t["name"] for t in msg["a"].get("tools") or ()]
                r = msg.get("r")
                self._turns[msg["c"]] = n = self._turns.get(r, 0)
                self._turns[r] = n + 1
            if self.answer_rpc:
                self.answer(msg)

    def answer(self, call):
        platform.asyncio.create_task(self._answer(call))

    def mem_calls(self, method=None):
        return [c for c in self.calls if c.get("m") != "llm.complete"
                and (method is None or c["m"] == method)]

    def llm_calls(self):
        return [c for c in self.calls if c.get("m") == "llm.complete"]

    async def _answer(self, call):
        c = call["c"]
        if call.get("m") != "llm.complete":
            decls = {}
            for d in self.hello.get("fields") or ():
                decls[d["name"]] = d
            try:
                ans = {"c": c, "s": 0, "ok": self.memory.serve(call["m"], call["a"], decls)}
            except Refused as e:
                ans = {"c": c, "s": 0, "err": e.err}
            await self.put("rpc/res", ans)
            return
        if self.turn_by_calls:
            turn = self._turns[c]
        else:
            turn = sum(1 for m in call["a"]["messages"] if m["role"] == "assistant")
        if turn >= len(self.script):
            await self.put("rpc/res", {"c": c, "s": 0, "err": {"kind": "llm", "msg": "script exhausted"}})
            return
        if self.script[turn] and "err" in self.script[turn][0]:
            # A turn the bridge refuses: its answer is that error (a `kb` failure, say).
            await self.put("rpc/res", {"c": c, "s": 0, "err": self.script[turn][0]["err"]})
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
        assert self.link.publish(topic_root() + "/b/status", codec.encode(msg), 1, True)
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
    # The board's id is its client id, and its session persistent.
    device = session_id(device)
    bridge = ScriptedBridge(device, script)
    s = {"prefix": topic_root()}
    s.update(settings or {})
    runtime = Runtime(agent or make_agent(), device, s)
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
