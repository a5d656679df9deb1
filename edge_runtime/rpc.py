# Calls from the board to the bridge: `{c, m, a, r}` out on P/d/D/rpc, answers back on
# P/d/D/rpc/res as `{c, s, ch}` stream chunks and then `{c, s, ok}` or `{c, s, err}`.
#
# The link's reader only queues what arrives (on_answer never waits); the run that made
# the call takes the chunks from the call's queue in its own task (Call.next), where it
# may wait for the outbox. It acknowledges what it took with `{c, ack: s}`, and the
# bridge never sends more than `window` chunks past the last ack, so the queue is
# bounded by the window, and a run that cannot send its events slows the model stream
# down instead of piling its chunks up on the heap.
#
# Chunk numbers `s` make a chunk the broker delivers twice (resent after a reconnect)
# harmless, and the final answer's `s` (how many chunks the bridge sent) shows when
# one never arrived: the call then fails as retryable instead of ending with text
# missing. Every wait is bounded: a call fails when nothing arrived for timeout_ms.
from edge_runtime import platform

try:
    from micropython import const
except ImportError:
    # CPython has no const(); every const() here is an int, which int() returns as is.
    const = int

_QOS_CALL = const(1)
_DEFAULT_TIMEOUT_MS = const(120000)
# The flow-control defaults a board announces in hello (settings `window`, `chunk`): RPC
# chunks the bridge may send ahead of the board's acks, and text bytes per chunk. What a
# burst of model text can queue on the board is their product, 1 KiB. Public: the
# runtime and the bridge (for a hello without them) read them.
WINDOW = 4
CHUNK = 256


class RpcError(Exception):
    # The bridge answered with `err`, the call could not go on (kind "timeout", "gap",
    # "link", "bridge_offline"), or could not be sent ("unsendable"). `detail` is the
    # bridge's whole `err` map, for refusals that carry more (a core backup's `conflict`
    # carries the stored `ver` and `doc`).

    def __init__(self, kind, msg, detail=None):
        super().__init__("%s: %s" % (kind, msg))
        self.kind = kind
        self.msg = msg
        self.detail = detail


class Call:
    # One call in flight: the chunks the reader queued, the final answer once it came.

    def __init__(self, client, cid, epoch):
        self._client = client
        self.c = cid
        self.epoch = epoch
        self.bridge = client.bridge  # the bridge process it was made to, if known
        self.chunks = []
        self.got = 0  # chunks received in order (the highest s)
        self.taken = 0  # chunks the caller took
        self.acked = 0  # the highest s acknowledged to the bridge
        self.result = None
        self.error = None
        self.finished = False  # the final answer came, or the call failed
        self.answered = False  # the bridge's final answer came
        self.last = platform.ticks_ms()  # when the call was made or last heard of
        self.ready = platform.Bell()

    @property
    def done(self):
        # Answered and every chunk taken: result (or error) is final.
        return self.finished and not self.chunks

    def fail(self, error):
        if not self.finished:
            self.error = error
            self.finished = True
            self.chunks = []
            self.ready.set()

    async def next(self, wait_ms):
        # The next chunk; None when nothing came within wait_ms (the caller's chance to
        # do timed work) or once done. Raises the call's RpcError.
        while True:
            if self.chunks:
                ch = self.chunks.pop(0)
                self.taken += 1
                self._client.ack(self)
                return ch
            if self.error is not None:
                raise self.error
            if self.finished:
                return None
            self._client.ack(self)  # one that could not be sent before, if any
            idle = self._client.timeout_ms - platform.ticks_diff(platform.ticks_ms(), self.last)
            if idle <= 0:
                raise RpcError("timeout", "no answer within %d ms" % self._client.timeout_ms)
            self.ready.clear()
            # Unless the call moved on as the wait ran out (a chunk, the answer, a
            # failure set ready): the loop's top reports that, not "nothing came".
            if not await self.ready.wait(min(wait_ms, idle)) and wait_ms < idle:
                return None


class RpcClient:
    def __init__(self, publish, topic, online, timeout_ms=_DEFAULT_TIMEOUT_MS,
                 window=WINDOW, room=None):
        # publish(topic, msg_dict, qos) encodes and queues on the link, False when it
        # cannot; online() says whether the link is up right now; room(), when given,
        # is awaited before a call is published (the run waits for outbox room), and
        # room(True) before it is tried again short of memory.
        self._publish = publish
        self._online = online
        self._room = room
        # Connection count as the client sees it: a call belongs to the connection its
        # request goes out on (the next one, when made while the link is down).
        self.epoch = 0
        self._topic = topic
        self.timeout_ms = timeout_ms
        self.window = window
        # Call ids start at a random number each boot: answers an older boot left in
        # the broker's session for this board never match a call of this one.
        self._next_id = random_bits(30)
        self._pending = {}
        # The boot id of the bridge process the board last heard online (None while it
        # is away or unknown): calls made to it die with it; calls made while it was
        # away wait in the bridge's session for whichever process comes.
        self.bridge = None
        self.late = 0  # answers that arrived for no waiting call
        self.duplicates = 0  # chunks that arrived twice

    async def start(self, method, args, run_id=None):
        # Sends the call and returns its Call; the caller reads it with next() and must
        # end() it. Raises RpcError("unsendable") when it cannot be sent.
        if self._room is not None:
            await self._room()
        self._next_id = self._next_id % 0x3FFFFFFF + 1
        cid = self._next_id
        epoch = self.epoch if self._online() else self.epoch + 1
        msg = {"c": cid, "m": method, "a": args}
        if run_id is not None:
            msg["r"] = run_id
        try:
            call = Call(self, cid, epoch)
            sent = self._publish(self._topic, msg, _QOS_CALL)
        except MemoryError:
            if self._room is None:
                raise
            # No block for the call or its encoding even after a collection (a model
            # call, a run's largest message; a state.commit's call, 272 B, in a CI run):
            # room(True) waits until what the link holds until the broker acknowledges
            # it is let go, and the call goes once more.
            await self._room(True)
            call = Call(self, cid, epoch)
            sent = self._publish(self._topic, msg, _QOS_CALL)
        if not sent:
            # Too large to encode, or no room: waiting would only run out the timeout.
            raise RpcError("unsendable", "the call to %s could not be sent" % method)
        self._pending[cid] = call
        return call

    def end(self, call):
        # A call ended before the bridge answered it (its run was cancelled or failed):
        # say so, so the bridge stops the model stream instead of holding it until a
        # window nobody acknowledges times out. Best effort: the bridge's deadline is
        # the bound when the outbox has no room for it.
        if self._pending.pop(call.c, None) is not None and not call.answered:
            self._publish(self._topic, {"c": call.c, "ack": call.taken, "stop": True}, _QOS_CALL)

    async def call(self, method, args, run_id=None, on_chunk=None):
        # The whole call in one await, for callers that need no flow of their own.
        call = await self.start(method, args, run_id)
        try:
            while True:
                ch = await call.next(self.timeout_ms)
                if ch is not None:
                    if on_chunk is not None:
                        on_chunk(ch)
                elif call.done:
                    return call.result
        finally:
            self.end(call)

    def ack(self, call):
        # At the latest when half the window is unacknowledged; an ack the outbox
        # cannot take now goes with the next chunk taken or the next wait.
        if call.taken - call.acked >= max(1, self.window // 2):
            if self._publish(self._topic, {"c": call.c, "ack": call.taken}, _QOS_CALL):
                call.acked = call.taken

    def on_answer(self, msg):
        # Called by the runtime for each decoded rpc/res payload (already a dict), on
        # the link's reader: it only queues, never waits.
        cid = msg.get("c")
        call = self._pending.get(cid) if isinstance(cid, int) else None
        if call is None or call.finished:
            self.late += 1
            return
        s = msg.get("s")
        if not isinstance(s, int):
            s = None
        if "ch" in msg:
            if s is not None and s <= call.got:
                self.duplicates += 1
                return
            if s is not None and s != call.got + 1:
                call.fail(RpcError("gap", "chunk %d came after chunk %d" % (s, call.got)))
                return
            if len(call.chunks) >= self.window:
                # The bridge sent past the window it was given: the queue's bound.
                call.fail(RpcError("overflow", "more chunks than the window of %d" % self.window))
                return
            call.got += 1
            call.chunks.append(msg["ch"])
            call.last = platform.ticks_ms()
            call.ready.set()
            return
        call.answered = True  # a final answer: the bridge has finished with the call
        if s is not None and s > call.got:
            call.fail(RpcError("gap", "%d of %d chunks arrived" % (call.got, s)))
            return
        err = msg.get("err")
        if isinstance(err, dict):
            call.fail(RpcError(err.get("kind", "internal"), err.get("msg", ""), err))
            return
        if err is not None:
            call.fail(RpcError("internal", str(err)))
            return
        call.result = msg.get("ok")
        call.finished = True
        call.ready.set()

    def new_connection(self, kept):
        # Calls made on an earlier connection wait on when the broker kept our session
        # (their answers were queued for us); otherwise those answers are gone and the
        # calls fail now, as retryable, instead of at their timeout. Calls made while
        # the link was down go out on this connection either way.
        self.epoch += 1
        if kept:
            return
        for call in self._pending.values():
            if call.epoch < self.epoch:
                call.fail(RpcError("link", "the link to the bridge dropped during the call"))

    def fail_all(self, kind, msg, bridge=None):
        # The bridge went away: no call of ours will be answered (with `bridge`: none
        # made to that bridge process).
        for call in self._pending.values():
            if bridge is None or call.bridge == bridge:
                call.fail(RpcError(kind, msg))


def random_bits(n):
    # n (up to 32) random bits, from os.urandom where the port has it. The board's one
    # source of them: call ids here, the boot id in runs.
    try:
        import os
        return int.from_bytes(os.urandom(4), "big") >> (32 - n)
    except (ImportError, AttributeError, OSError):
        import random
        return random.getrandbits(n)
