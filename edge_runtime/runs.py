# Runs in the request domain: every request on P/d/D/req gets a fresh Run with its own
# event ids. Admission is bounded (concurrency + a short queue); past that a request is
# refused with a `busy` error event, never dropped silently. This module also routes
# everything that arrives on the board's topics, so bad input is refused in one place,
# and keeps every event ring moving: an event the link could not take waits in its
# run's ring and goes out when the link has room (pump_all).

# Names used once are read from their modules (events.RING): a name imported into this
# module is one more entry in its globals for the board's life.
from edge_runtime import codec, events, platform, rpc
from edge_runtime.events import MAX_ID, Emitter
from edge_runtime.ring import Ring
from edge_runtime.agent import RunFailed

try:
    from micropython import const
except ImportError:
    def const(x):
        return x

_QOS1 = const(1)
_DEFAULT_CONCURRENCY = const(1)
_DEFAULT_QUEUE = const(2)
_DEVICE_RING = const(8)
# run.started echoes the request's text so a host can draw the user's row; a long one
# is echoed cut to this many characters (with input_len, the whole length): the host
# that sent it has it, and a second copy of it on a small heap can fail the run.
_ECHO = const(512)
# What the board sends: its encode buffer. An llm.complete call carries the whole
# conversation, so it is larger than what the board receives.
_DEFAULT_TX = const(16384)
_DEFAULT_DELTA_CHARS = const(256)  # streamed text per msg.delta / reason.delta
_DEFAULT_DELTA_MS = const(100)  # ...or after the oldest pending character waited this
_DEFAULT_STALL_MS = const(30000)  # a run that cannot send its events this long fails
# How long the bridge's presence must say offline before the board fails the calls it
# has in flight: a broker that shuts down sends every client's will, the bridge's too,
# and then the bridge is back a moment later with its calls still running.
_DEFAULT_BRIDGE_GRACE_MS = const(5000)
# Outbox slots an event leaves free: room for RPC acks and calls, hello and status,
# which keep the run and the link going while events wait.
_EVENT_SPARE = const(4)
# Finished runs whose event ring the board keeps for the bridge's replays: the last
# one. A second ring (up to ring_bytes, 1.5 KiB) held through every run was heap the
# valves agent's resumed run and the memory demo's third request lacked at 128K.
_RECENT_RUNS = const(1)
# The room a request's envelope takes beside its text (ids, the scope ticket): the hello
# announces strings this much shorter than the payload, so a request whose text is as
# long as announced arrives (server_bridge/wire.py BOARD_DEFAULTS says the same).
_REQ_ENVELOPE = const(512)
# How long a model call short of memory (or a board done with its runs) waits for the
# link's messages in flight to be acknowledged (Runtime._call_room), and how often it
# looks: often, as a sleep allocates nothing, and a request may come soon after a run.
_DRAIN_MS = const(2000)
_DRAIN_POLL_MS = const(2)
_SEEN_REQS = const(16)
# The topic leaves the board subscribes to under its base. Read by if-chains rather than
# dicts of bound methods: those cost a dict and an object per entry on the board heap
# for the board's life.
_LEAVES = const(("req", "ctl", "rpc/res"))



class Run:
    # One request's run state: fresh per request, owned by one task.

    def __init__(self, runtime, run_id, msg):
        self.id = run_id
        self.runtime = runtime
        self.agent = runtime.agent
        self.rpc = runtime.rpc
        self.req = msg["req"]
        self.input = msg["input"]
        self.conv = msg.get("conv")
        self.user = msg.get("usr")
        # The scope ticket the bridge added to the req: copied unchanged into every
        # state, mem and core call of the run (None when the req had none).
        self.sc = msg.get("sc")
        self.ttl = msg.get("ttl")  # seconds a paused run may wait (pause.py)
        # The run's field values, declared or not: a key no declaration names is private
        # and stays on the board with the run. Durable slot fields are seeded here at the
        # start and what the run changed of them is committed at its end (state.py).
        self.state = {}
        # What the run's durable fields held as it started, encoded (_state, state.py).
        # Until the run starts, the state the bridge read for it and sent in the req
        # (`state`: {fields, values}; see _state), or None.
        self.loaded = msg.get("state")
        self._writes = 0
        # Node path -> how many times the run has started it (toolloop, nodes.py): an
        # event's `a`. A paused run's are in its checkpoint (pause.py).
        self.nodes = {}
        self.delta_chars = runtime.delta_chars
        self.delta_ms = runtime.delta_ms
        self.emitter = Emitter(run_id, runtime.encode, runtime.send_event, platform.time_ms,
                               runtime.ring_size, runtime.ring_bytes)
        self.task = None
        self.started = False
        self.cancel_reason = None
        self.started_d = None  # run.started's fields until it is emitted (begin)

    def begin(self):
        # Puts run.started in the ring, once: the run's first event, whatever comes
        # next, and sent with it. The model loop calls it just after its model call has
        # gone, so the call does not wait behind it; every other way to emit calls it
        # first. Kept until it is in the ring: a run.started that found no heap goes
        # ahead of the run.failed that follows, which the host could not match to its
        # request without it (it names the req).
        d = self.started_d
        if d is not None:
            self.emitter.emit("run.started", d)
            self.started_d = None

    def emit(self, t, d=None, node=None):
        # Without waiting: a terminal event, say. What the link cannot take now waits
        # in the ring and goes out later.
        self.begin()
        self.emitter.emit(t, d, node)
        self.emitter.pump()

    async def event(self, t, d=None, node=None, held=None):
        # The way a run reports progress: wait (bounded) until the link can take the
        # event and nothing of this run waits ahead of it, then emit. Back-pressure
        # instead of loss: a slow link slows the run down. Most events find room at
        # once, and then no flow() coroutine is made for them (each call of an async
        # function allocates its generator on MicroPython). `held`, a (t, d, node)
        # event made just before this one, goes first, in the same payload.
        link = self.runtime.link
        if link is not None and (self.emitter.backlog or not link.room(_EVENT_SPARE)):
            await self.runtime.flow(self.emitter)
        if held:
            self.begin()
            self.emitter.emit(*held)
        self.emit(t, d, node)

    def w(self):
        # The next write id of the run, "<run id>:<seq>": the bridge applies each once.
        self._writes += 1
        return "%s:%d" % (self.id, self._writes)

    def check_cancelled(self):
        if self.cancel_reason is not None:
            raise platform.asyncio.CancelledError()


class Runtime:
    def __init__(self, agent, device, settings=None):
        settings = settings or {}
        self.agent = agent
        agent.runtime = self
        self.device = device
        prefix = settings.get("prefix", events.PREFIX)
        self._base = "%s/d/%s/" % (prefix, device)
        # Made once: every event of every run goes to it, and a topic made per event
        # was one more allocation each among the run's, for as long as it waited.
        self.evt = self._base + "evt"
        self._bridge_status = prefix + "/b/status"
        rx = settings.get("max_payload", events.RX_PAYLOAD)
        # What the board can receive (hello `limits`): the payload its receive buffer
        # holds (the Link allocates it from this figure), and strings that leave room
        # for a request's envelope, so a request whose text is as long still arrives.
        self.limits = {
            "payload": rx,
            "str": min(max(rx - _REQ_ENVELOPE, rx // 2), settings.get("max_str", codec.MAX_STR)),
            "items": settings.get("max_items", codec.MAX_ITEMS),
            "depth": settings.get("max_depth", codec.MAX_DEPTH),
            "ring": settings.get("ring", events.RING),
            "window": settings.get("window", rpc.WINDOW),
            "chunk": settings.get("chunk", rpc.CHUNK),
        }
        self.max_send = settings.get("max_send", _DEFAULT_TX)
        self.ring_size = self.limits["ring"]
        self.ring_bytes = settings.get("ring_bytes", events.RING_BYTES)
        self.concurrency = settings.get("concurrency", _DEFAULT_CONCURRENCY)
        self.max_queue = settings.get("queue", _DEFAULT_QUEUE)
        self.delta_chars = max(1, settings.get("delta_chars", _DEFAULT_DELTA_CHARS))
        self.delta_ms = max(1, settings.get("delta_ms", _DEFAULT_DELTA_MS))
        self.stall_ms = settings.get("stall_ms", _DEFAULT_STALL_MS)
        self.bridge_grace_ms = settings.get("bridge_grace_ms", _DEFAULT_BRIDGE_GRACE_MS)
        # Where the board keeps its files (core memory): a directory prefix on flash.
        self.flash_dir = settings.get("flash_dir", "")
        # Commits that failed, sent again on the next connection (state.py bounds them).
        self.commits = []
        self.resending = False
        self.link = None
        self.rpc = rpc.RpcClient(self.publish_msg, self._base + "rpc", self._online,
                                 window=self.limits["window"], room=self._call_room)
        self.device_stream = Emitter(events.DEVICE_RUN, self.encode, self.send_event,
                                     platform.time_ms, min(self.ring_size, _DEVICE_RING),
                                     self.ring_bytes)
        self.active = {}
        # Paused runs, their state on flash (pause.py): run id -> its deadline in ticks
        # (None while an answer is applied). None until the first connection, when the
        # checkpoints of an earlier boot are read.
        self.paused = None
        self.recent = Ring(_RECENT_RUNS)
        self._seen = Ring(_SEEN_REQS)
        self._queue = []
        self.boot = "%08x" % rpc.random_bits(32)
        # Why this board must reset (_call_room), for board.py once the link has stopped.
        self.reset = None
        self._bridge_up = None  # the bridge's presence as last heard: None, True, False
        self._bridge_boot = None  # the boot id of the bridge process last heard online
        self._runs_started = 0
        # Counters; control.py adds its own (stale_ctl) when it first counts.
        self.stats = {"refused": 0, "duplicate": 0, "unsendable": 0, "busy": 0, "stalled": 0,
                      "no_memory": 0, "no_presence": 0}
        # Refusals held into the next one while the device stream waits for the link
        # (refuse): [how many, the kind of the last]. A name the board has anyway (each
        # new name a module interns counts against the qstr pool's next doubling).
        self.more = [0, None]

    # --- wiring to the link -------------------------------------------------------

    def attach(self, link):
        self.link = link
        for leaf in _LEAVES:
            link.subscribe(self._base + leaf, _QOS1)
        link.subscribe(self._bridge_status, _QOS1)

    def link_settings(self):
        # What the Link needs from the runtime: its receive buffer holds the payload
        # announced in hello, and the outbox callbacks keep the rings moving.
        return {"rx_size": self.limits["payload"] + 128, "max_packet": self.max_send + 128,
                "on_message": self.on_message, "on_connect": self.on_connect,
                "on_refused": self.on_refused, "on_room": self.pump_all,
                "will": (self._base + "status", codec.encode({"st": "offline", "boot": self.boot}),
                         _QOS1, True),
                "clean_session": False}

    def _online(self):
        return self.link is not None and self.link.connected

    def on_connect(self):
        self.rpc.new_connection(self.link.session_present)
        # Status and hello (presence.py).
        self._presence(None)
        # The bridge's presence is heard again from its retained status.
        self._bridge_up = None
        self.pump_all()
        if self.paused is None:
            self.paused = {}
            for t in self.agent.tools.values():
                if t.fn is None or t.approval:
                    # Runs paused before this boot come back (or fail, if they were
                    # running): what they emit can go out now.
                    from edge_runtime import pause
                    pause.boot(self)
                    break
        if self.commits:
            from edge_runtime import state
            platform.asyncio.create_task(state.resend(self))
        self._check_heap()

    def _check_heap(self):
        # Collected, can an idle board still take the request it announced? Looked at
        # when its runs are done and its link quiet (_call_room), after a connection and
        # after input it had no heap for. One that cannot would stay connected and
        # refuse or lose every request (a leak of an app's, a heap that fragments): it
        # resets instead (board.py), its link dropped so the broker says its will.
        # Free heap in pieces too small to use looks like enough: four requests in a
        # row that ended out of memory (refused no_memory, or failed), with none done
        # between them, say the same.
        platform.collect()
        n = platform.free_heap()
        link = self.link
        if link is None or self.active or self._queue:
            return
        if not link.pending:
            # The heap's level, on a console: idle, collected and with nothing in flight
            # (the line at a run's end is taken while its last events still are), so a
            # leak or a heap that fragments shows as a trend (tests/test_board_soak.py).
            platform.log("idle; heap free", n)
        if n is not None and n < self.limits["payload"]:
            self.reset = "no heap for a request (%d bytes free)" % n
        elif self.stats["no_memory"] >= 4:
            self.reset = "4 requests in a row ran out of memory"
        else:
            return
        link.stop(False)

    def encode(self, msg):
        # Exactly the payload's size, kept as it is by the link (and a run's ring). A
        # payload within the limit that finds no free block of its size usually finds
        # one after a collection.
        try:
            return codec.encode_exact(msg, self.max_send)
        except MemoryError:
            platform.collect()
            return codec.encode_exact(msg, self.max_send)

    def publish_msg(self, topic, msg, qos=0, retain=False):
        # In parts (codec.encode_parts): a model call lends the conversation's texts to
        # the link instead of copying them into one block.
        try:
            try:
                data = codec.encode_parts(msg, self.max_send)
            except MemoryError:
                # No free block of the structure's size (a model call's: 0.5-1 KiB, all
                # but its long texts): collected, and with every str of 16 bytes or more
                # lent as well, it needs a smaller one. A fragmented heap has small
                # holes, and the memory thermostat at 128K failed its third request's
                # second model call here about once in 80 demos.
                platform.collect()
                data = codec.encode_parts(msg, self.max_send, lend=16)
        except codec.CodecError as e:
            self.stats["unsendable"] += 1
            platform.log("cannot encode message for", topic, e)
            return False
        return self._publish(topic, data, qos, retain)

    def _publish(self, topic, data, qos, retain=False, spare=0):
        if self.link is None:
            return False
        try:
            return self.link.publish(topic, data, qos, retain, spare)
        except ValueError as e:  # over the link's packet limit
            self.stats["unsendable"] += 1
            platform.log("cannot publish on", topic, e)
            return False

    def send_event(self, data):
        # The emitters' way out; False leaves the event waiting in its ring.
        return self._publish(self.evt, data, _QOS1, False, _EVENT_SPARE)

    def pump_all(self):
        # The link has room again (or a new connection): every ring with events the
        # link has not taken sends them, oldest run first.
        stream = self.device_stream
        if not stream.pump():
            return
        held = self.more
        if held[0]:
            # What was held while the device stream waited, said once it has gone.
            stream.emit("error", {
                "kind": held[1], "more": held[0] - 1,
                "msg": "%d input messages refused while the board's events waited for its"
                       " link (the last %s)" % (held[0], held[1])})
            held[0] = 0
            if not stream.pump():
                return
        for run in self.active.values():
            if not run.emitter.pump():
                return
        for emitter in self.recent:
            if not emitter.pump():
                return

    async def flow(self, emitter):
        # A run waits here before each event until its ring has nothing waiting and the
        # link can take one more. Bounded: a board that cannot publish for stall_ms
        # fails the run (retryable), and its run.failed waits in the ring.
        link = self.link
        if link is None:
            return
        start = platform.ticks_ms()
        while emitter.backlog or not link.room(_EVENT_SPARE):
            if emitter.backlog and emitter.pump() and link.room(_EVENT_SPARE):
                return
            left = self.stall_ms - platform.ticks_diff(platform.ticks_ms(), start)
            if left <= 0:
                self.stats["stalled"] += 1
                raise RunFailed("link", "the board could not send its events for %d s"
                                % (self.stall_ms // 1000), True)
            await link.wait_room(left, _EVENT_SPARE)

    async def _call_room(self, short=False):
        # An RPC call waits for outbox room like an event does (its own slots, though).
        # Short of memory, it waits (up to _DRAIN_MS) until the link holds nothing the
        # broker has not acknowledged: each message in flight keeps its payload and its
        # entry (the events sent just before a model call, eight or more); then it
        # collects. A board whose last run ended does the same (_drive).
        link = self.link
        if short:
            waited = 0
            while link is not None and link.pending and waited < _DRAIN_MS:
                await platform.sleep_ms(_DRAIN_POLL_MS)
                waited += _DRAIN_POLL_MS
            self._check_heap()
        elif link is not None and not link.room():
            await link.wait_room(self.stall_ms)

    # --- input --------------------------------------------------------------------

    def on_message(self, topic, payload):
        if topic == self._bridge_status:
            self._presence(payload)
            return
        leaf = topic[len(self._base):]
        if leaf not in _LEAVES or not topic.startswith(self._base):
            # Refusals of input the board does not take are in refuse.py, imported
            # only when some comes (why: at its top).
            from edge_runtime import refuse
            refuse.bad_topic(self, topic, leaf)
            return
        lim = self.limits
        try:
            try:
                msg = codec.decode(payload, lim["payload"], lim["str"], lim["items"],
                                   lim["depth"])
            except MemoryError:
                # Within the limits, so the heap is fragmented rather than short: one
                # collection usually gives back a block of the size the decode needs.
                platform.collect()
                msg = codec.decode(payload, lim["payload"], lim["str"], lim["items"],
                                   lim["depth"])
        except (codec.CodecError, MemoryError) as e:
            # An answer lost for want of heap also fails the calls in flight, even if
            # the refusal found no heap for its import: whichever call it was for
            # cannot finish whole, and their runs end retryable and give their memory
            # back, rather than wait for a chunk that will never come.
            lost = leaf == "rpc/res" and isinstance(e, MemoryError)
            try:
                from edge_runtime import refuse
                refuse.payload(self, leaf, payload, e)
            finally:
                if lost:
                    self.rpc.fail_all("no_memory", "the board had no memory for an answer")
            return
        if not isinstance(msg, dict):
            from edge_runtime import refuse
            refuse.payload(self, leaf, payload, None)
            return
        if leaf == "req":
            try:
                self._on_req(msg)
            except MemoryError:
                # No heap to start its run (the allocator collected before it gave up):
                # refused by its id, so the host ends and may ask again. Lost to the
                # link's on_message guard, it was acknowledged and never answered.
                req = msg.get("req")
                msg = None
                self.refuse("no_memory", "no free heap to start a run",
                            {"req": req} if is_id(req) else None)
        elif leaf == "ctl":
            self._on_ctl(msg)
        else:
            self.rpc.on_answer(msg)

    def on_refused(self, topic, size):
        # The link read past a message too large for its receive buffer.
        from edge_runtime import refuse
        refuse.too_large(self, topic, size)

    def _presence(self, payload):
        # presence.py, for a new connection (payload None) or the bridge's status: both
        # seldom, so it is imported for each and let go again (platform.unload), as
        # control.py is for a ctl. A heap too fragmented for the import gets one
        # collection first.
        try:
            try:
                from edge_runtime import presence
            except MemoryError:
                platform.collect()
                from edge_runtime import presence
            if payload is None:
                presence.connected(self)
                self.stats["no_presence"] = 0
            else:
                presence.bridge(self, payload)
        except MemoryError:
            presence = None
            platform.unload("presence")
            platform.collect()
            platform.log("no free heap for presence")
            if payload is None and self.link is not None:
                # A connection that could not say the board is online would leave it
                # up but shown offline (its last will stands at the broker): dropped
                # instead, and tried again by the link; four in a row, and the board
                # resets (board.py). (Counted in stats: a key over ten characters is no
                # name in the board's qstr pool.)
                n = self.stats["no_presence"] + 1
                self.stats["no_presence"] = n
                if n < 4:
                    self.link.reconnect("no heap for presence")
                else:
                    self.reset = "no heap for presence"
                    self.link.stop(False)
        finally:
            presence = None
            platform.unload("presence")

    async def _bridge_gone(self, epoch):
        # Only a bridge still offline after the grace, on a connection of ours that stayed
        # up all along, is gone (a broker shutting down sends its will and then drops us
        # too). Its calls then fail, retryable, and their runs end and free their slots.
        # (presence.py starts it.)
        await platform.sleep_ms(self.bridge_grace_ms)
        if self._bridge_up is False and self.rpc.epoch == epoch and self._online():
            platform.log("bridge offline")
            self.rpc.fail_all("bridge_offline", "the bridge went offline")

    def refuse(self, kind, msg, more=None):
        # Refused input becomes an error event on the device stream; the board goes on.
        # While that stream waits for the link (a flood of junk comes faster than the
        # broker takes our events), a refusal that names nothing a host waits on (no
        # req) is counted instead, and the next error event says how many were held
        # into it (`more`): one event per junk message, each held by the link with
        # its topic and entry, took a 128K board's heap (10,000 junk ctl at QoS 1).
        self.stats["refused"] += 1
        platform.log("refused", kind, msg)
        stream = self.device_stream
        held = self.more
        if stream.backlog and not (more and "req" in more):
            held[0] += 1
            held[1] = kind
            return
        d = {"kind": kind, "msg": msg}
        if more:
            d.update(more)
        if held[0]:
            d["more"] = held[0]
            held[0] = 0
        stream.emit("error", d)
        stream.pump()
        if kind == "no_memory":
            self.stats["no_memory"] += 1
            self._check_heap()

    def _on_req(self, msg):
        req = msg.get("req")
        if not is_id(req) or not isinstance(msg.get("input"), str):
            self.refuse("bad_envelope", "req needs an id req (1-%d chars) and a string input" % MAX_ID)
            return
        for key in ("conv", "usr"):
            if msg.get(key) is not None and not is_id(msg[key]):
                self.refuse("bad_envelope", "req field %s must be an id of 1-%d chars" % (key, MAX_ID),
                            {"req": req})
                return
        if msg.get("sc") is not None and not isinstance(msg["sc"], str):
            self.refuse("bad_envelope", "req field sc must be a string", {"req": req})
            return
        if req in self._seen:
            # The idempotency key: a repeated request starts nothing new.
            self.stats["duplicate"] += 1
            return
        if self.stats["no_memory"] >= 4:
            # Four in a row ran out of memory: this one would too. Refused by name, and
            # the refusal resets the board once it is idle (_check_heap); a request
            # that came while it waited to be idle would otherwise have kept it up.
            self.refuse("no_memory", "the board resets to get its heap back; send it again",
                        {"req": req})
            return
        if len(self.active) < self.concurrency:
            self._start(msg)
        elif len(self._queue) < self.max_queue:
            # Its state is read again when it starts: a run ahead of it may write it.
            msg.pop("state", None)
            self._queue.append(msg)
        else:
            # Not remembered as seen: the same request may be sent again later.
            from edge_runtime import refuse
            refuse.busy(self, req)
            return
        self._seen.push(req)

    def _on_ctl(self, msg):
        # ctl ops (control.py) come seldom: their code is not on the heap while a run
        # runs. Let go after a ctl that came during a run or with a run paused (whose
        # answer it may have started applying), and otherwise when the next run starts
        # (_start): a flood of ctl between runs then costs one import, where
        # an import and a release for each message, 10,000 junk ctl at QoS 1, split a
        # 128K board's heap until its link found no block to send with. A heap too
        # fragmented for the import gets one collection first, as a decode does.
        try:
            try:
                from edge_runtime import control
            except MemoryError:
                platform.collect()
                from edge_runtime import control
        except MemoryError:
            self.refuse("no_memory", "no free heap to act on a ctl")
            return
        try:
            control.ctl(self, msg)
        finally:
            control = None
            if self.active or self.paused:
                platform.unload("control")

    # --- runs ---------------------------------------------------------------------

    def _start(self, msg):
        state = None
        if isinstance(msg, tuple):
            # A paused run whose answers are in (pause.py): (run, where it goes on).
            run, state = msg
        else:
            self._runs_started += 1
            run = Run(self, "%s.%d" % (self.boot, self._runs_started), msg)
        # Kept between runs (_on_ctl), let go as one starts.
        platform.unload("control")
        platform.unload("refuse")
        self.active[run.id] = run
        try:
            run.task = platform.asyncio.create_task(self._drive(run, state))
        except MemoryError:
            # A slot held by a run that never started would make the board busy for good.
            self.active.pop(run.id, None)
            raise

    async def _drive(self, run, state=None):
        # A run from its start to its end (one function rather than two: each name
        # costs the board's qstr pool, near its next doubling). `state`: a paused run
        # going on from its checkpoint (pause.py). Everything happens inside the outer
        # try, so the run's slot is always given back, whatever the handler or an emit
        # raises.
        try:
            run.started = True
            agent = self.agent
            try:
                durable = False
                for f in agent.fields:
                    if f.durable:
                        # Only an agent with durable slot fields has state to load and
                        # commit.
                        durable = True
                        break
                if state is None:
                    # `usr`, the req's (the bridge set it from the session token): the
                    # bridge sends the run's events to that user's host topic alone, so
                    # it must learn it from the run, also after its own restart (a
                    # replay brings run.started again). 4 bytes and the id on the wire.
                    started = {"agent": agent.name, "ver": agent.version, "req": run.req,
                               "conv": run.conv, "usr": run.user, "domain": "request",
                               "input": run.input}
                    if len(run.input) > _ECHO:
                        started["input"] = run.input[:_ECHO]
                        started["input_len"] = len(run.input)
                    run.started_d = started
                    started = None
                    if agent.budget:
                        # The run's wall time counts from here (budget.py).
                        from edge_runtime import budget
                        budget.start(run)
                    handler = agent.handler
                    if handler is None:
                        # The model loop is loaded when first needed: a device whose
                        # agent has a plain handler never spends heap on it. It emits
                        # run.started itself, once its model call is out: the call is
                        # what the run waits for.
                        from edge_runtime.toolloop import model_loop as handler
                    else:
                        run.begin()
                        run.emitter.pump()
                    run.check_cancelled()
                    if durable:
                        await _state(run, False)
                    usage = await handler(run)
                else:
                    from edge_runtime.toolloop import model_loop
                    usage = await model_loop(run, state)
                    state = None
                if run.id in self.paused:
                    return  # it ends later, from its checkpoint (pause.py)
                if durable:
                    await _state(run, True)
                run.emit("run.done", {"usage": usage or {}})
                self.stats["no_memory"] = 0
            except platform.asyncio.CancelledError:
                run.emit("run.cancelled", {"reason": run.cancel_reason or "cancelled"})
            except Exception as e:
                # One run.failed for the three ways a run fails (one emit, not three).
                retryable = isinstance(e, MemoryError)
                if isinstance(e, RunFailed):
                    err = {"kind": e.kind, "msg": e.msg}
                    if e.cause:
                        err["cause"] = e.cause
                    retryable = e.retryable
                elif retryable:
                    # The run's state goes with the run; collected, the heap serves the
                    # next one, so asking again is worth it.
                    platform.collect()
                    self.stats["no_memory"] += 1
                    platform.log("run", run.id, "ran out of memory")
                    platform.print_exception(e)
                    e = None
                    # Its run.started, if it has not gone, goes without the echoed text
                    # (the large event, which found no heap: tried again as is, it left
                    # the run unended at the host); one that was not even made is made
                    # with the req and the user, so the host can match the run.failed to
                    # its request.
                    d = run.started_d
                    if d is None and not run.emitter.last_id:
                        d = run.started_d = {"req": run.req, "conv": run.conv, "usr": run.user}
                    if d is not None:
                        d["input_len"] = len(run.input)
                        d["input"] = ""
                    d = None
                    err = {"kind": "internal", "msg": "the board ran out of memory"}
                else:
                    # The detail goes to the console; the host sees a customer-safe message.
                    platform.log("run", run.id, "crashed:", repr(e))
                    err = {"kind": "internal", "msg": "the board hit an internal error"}
                run.emit("run.failed", {"err": err, "retryable": retryable})
        finally:
            self.active.pop(run.id, None)
            # Only the event ring outlives a run (for replays), not its state.
            emitter = run.emitter
            self.recent.push(emitter)
            run_id = run.id
            run = state = None
            platform.collect()
            # Into one block now that the run's own objects are free (Emitter.settle),
            # and collected again to free the events it moved.
            emitter.settle()
            emitter = None
            platform.collect()
            # One console line per run: on a serial console this is how heap trouble shows.
            platform.log("run", run_id, "ended; heap free", platform.free_heap())
            if self._queue and len(self.active) < self.concurrency:
                self._start(self._queue.pop(0))
            elif not self.active:
                # And once the run's last events are acknowledged, a collection while the
                # board has nothing to do. MicroPython collects after every threshold's
                # worth of allocation (platform.collect_often): with the garbage of
                # reading those acks counted, that collection fell on the next request's
                # way to its model call, which allocates about 9 KB of the 11 KB
                # threshold (64-bit unix port). The wait for the link is _call_room's
                # (no new name: the board's qstr pool is near its next doubling).
                platform.asyncio.create_task(self._call_room(True))


async def _state(run, commit):
    # state.py is needed at a run's two edges only, state.load before the handler and
    # state.commit after it, so it is imported for each and let go again
    # (platform.unload): its 4.6 KiB (64-bit .mpy) are not on the heap while the model
    # loop runs (the demo's third request at 128 KiB ran out by less than that).
    if not commit:
        # The state the bridge sent in the req (run.loaded until now) spares the run the
        # state.load round trip before its model call, and is taken here, without
        # state.py: its import (read from flash and built) was 0.44 ms of the memory
        # thermostat's way to its model call on the unix port. Taken only when it names
        # every durable field (a bridge with an older hello may not), the run was
        # admitted at once (a queued request has none: _on_req) and no commit of this
        # board waits to be sent again (the bridge read the state before that write).
        # Anything else: the run loads it (state.load).
        seed = run.loaded
        run.loaded = None
        if isinstance(seed, dict) and not run.runtime.commits:
            names = seed.get("fields")
            values = seed.get("values")
            seed = None
            if isinstance(names, list) and isinstance(values, dict):
                seed = {}
                for f in run.agent.fields:
                    if f.durable:
                        if f.name not in names:
                            seed = None
                            break
                        if f.name in values:
                            seed[f.name] = values[f.name]
            names = values = None
            if seed is not None:
                run.state.update(seed)  # empty until now: the run has not started
                # What was loaded, encoded: a deep copy for the end's comparison that an
                # app changing a list in place cannot touch (state.commit).
                run.loaded = codec.encode(seed)
                return
        seed = None
    elif run.loaded is not None:
        # Most runs change none of their durable fields: then there is nothing to
        # commit (state.commit would send nothing), and state.py is not imported at the
        # run's end either, the moment its import once found no block (below).
        seed = codec.decode(run.loaded, len(run.loaded), len(run.loaded))
        for f in run.agent.fields:
            if f.durable and f.name in run.state and not (
                    f.name in seed and seed[f.name] == run.state[f.name]):
                seed = None
                break
        if seed is not None:
            run.loaded = seed = None
            return
    try:
        from edge_runtime import state
    except MemoryError:
        # No block for a piece of its code, the heap fragmented (at a run's end, its
        # last events in flight beside it: the memory thermostat at 128K on a loaded
        # machine, 1 demo in 36). Tried again once what the link holds is acknowledged.
        platform.unload("state")
        await run.runtime._call_room(True)
        from edge_runtime import state
    try:
        if commit:
            await state.commit(run)
        else:
            await state.load(run)
    finally:
        state = None
        platform.unload("state")


def is_id(value):
    return isinstance(value, str) and 0 < len(value) <= MAX_ID


def clip(value):
    # Refusals name what was refused, but never echo more than a few bytes of it: an
    # echo of hostile input could itself become an event too large to send.
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
