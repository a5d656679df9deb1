# Calls from the board to the bridge: `{c, m, a, r}` out on P/d/D/rpc, answers back on
# P/d/D/rpc/res as `{c, ch}` stream chunks and then `{c, ok}` or `{c, err}`.
# Each call waits a bounded time; a late answer for a call no one waits on is dropped.
from edge_runtime import platform

try:
    from micropython import const
except ImportError:
    def const(x):
        return x

_QOS_CALL = const(1)
_DEFAULT_TIMEOUT_MS = const(120000)


class RpcError(Exception):
    # The bridge answered with `err`, or no answer came in time (kind "timeout").

    def __init__(self, kind, msg):
        super().__init__("%s: %s" % (kind, msg))
        self.kind = kind
        self.msg = msg


class _Pending:
    def __init__(self, on_chunk, epoch):
        self.on_chunk = on_chunk
        self.epoch = epoch
        self.done = platform.asyncio.Event()
        self.result = None
        self.error = None


class RpcClient:
    def __init__(self, publish, topic, online, timeout_ms=_DEFAULT_TIMEOUT_MS):
        # publish(topic, msg_dict, qos) encodes and queues on the link, False when it
        # cannot; online() says whether the link is up right now.
        self._publish = publish
        self._online = online
        # Connection count as the client sees it: a call belongs to the connection its
        # request goes out on (the next one, when made while the link is down).
        self.epoch = 0
        self._topic = topic
        self._timeout_ms = timeout_ms
        self._next_id = 0
        self._pending = {}
        self.late = 0  # answers that arrived for no waiting call

    async def call(self, method, args, run_id=None, on_chunk=None, timeout_ms=None):
        self._next_id += 1
        cid = self._next_id
        pending = _Pending(on_chunk, self.epoch if self._online() else self.epoch + 1)
        self._pending[cid] = pending
        msg = {"c": cid, "m": method, "a": args}
        if run_id is not None:
            msg["r"] = run_id
        try:
            if not self._publish(self._topic, msg, _QOS_CALL):
                # Too large to encode or send: waiting would only run out the timeout.
                raise RpcError("unsendable", "the call to %s could not be sent" % method)
            try:
                await platform.wait_for_ms(pending.done.wait(), timeout_ms or self._timeout_ms)
            except platform.asyncio.TimeoutError:
                raise RpcError("timeout", "no answer to %s within %d ms" % (method, timeout_ms or self._timeout_ms))
        finally:
            self._pending.pop(cid, None)
        if pending.error is not None:
            raise pending.error
        return pending.result

    def on_answer(self, msg):
        # Called by the runtime for each decoded rpc/res payload (already a dict).
        cid = msg.get("c")
        pending = self._pending.get(cid) if isinstance(cid, int) else None
        if pending is None:
            self.late += 1
            return
        if "ch" in msg:
            if pending.on_chunk is not None:
                try:
                    pending.on_chunk(msg["ch"])
                except Exception as e:  # a handler bug fails this call, not the link
                    pending.error = RpcError("internal", "chunk handler failed: %r" % (e,))
                    pending.done.set()
            return
        err = msg.get("err")
        if err is not None:
            kind = err.get("kind", "internal") if isinstance(err, dict) else "internal"
            text = err.get("msg", "") if isinstance(err, dict) else str(err)
            pending.error = RpcError(kind, text)
        else:
            pending.result = msg.get("ok")
        pending.done.set()

    def new_connection(self, kind, msg):
        # The session is clean, so answers sent while the link was down are gone: a
        # call sent on an earlier connection fails now (the caller may retry) instead
        # of at its timeout. Calls queued while the link was down go out on this one.
        self.epoch += 1
        for pending in self._pending.values():
            if pending.epoch < self.epoch:
                pending.error = RpcError(kind, msg)
                pending.done.set()
