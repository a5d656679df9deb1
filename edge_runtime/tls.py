# TLS for the board's link to the broker: loaded only by a board whose settings have a
# `tls` entry ({"ca": a certificate file on flash, DER or PEM; "server_hostname":
# optional, the link's host by default}), so a board without TLS carries none of it.
# The broker's certificate is checked against that CA and the host name; a refusal (a
# wrong CA, an expired certificate, another name) fails the connection with the TLS
# library's reason, which the link logs in its one line per failed connection and then
# retries with its bounded, jittered backoff.
from edge_runtime import platform
from edge_runtime.platform import IS_MICROPYTHON, asyncio


if IS_MICROPYTHON:
    class _Stream(asyncio.StreamWriter):
        # MicroPython's stream, for a TLS socket. mbedTLS, told by the socket to wait,
        # keeps the record it made of a write and, called again, sends it and answers
        # with the length it was asked to write *that* time. The stock stream, told to
        # wait, asks again for what it held plus what came since: the difference would
        # be counted as sent, and lost. So what a write left is asked for again alone
        # (out_buf), and what comes meanwhile waits behind it (more) for the next round.
        # A write the socket takes whole, the usual case, costs no copy.
        more = b""

        def write(self, buf):
            if self.out_buf:
                self.more += buf
            else:
                super().write(buf)

        async def drain(self):
            await super().drain()
            while self.more:
                self.out_buf = self.more
                self.more = b""
                await super().drain()


def open(link):
    # -> the connection's coroutine, for the link's dial task: (reader, writer) of a TLS
    # connection to link.host:link.port. The context is made here, at the first attempt,
    # and kept on the link (link.tls becomes (context, host name)); one that could not be
    # made is raised here, in the link's own code (in the task, MicroPython would print a
    # traceback besides the link's line), and tried again at the next attempt.
    cfg = link.tls
    if type(cfg) is dict:
        from edge_runtime import tlsctx

        try:
            ctx = tlsctx.context(cfg)
        finally:
            platform.unload("tlsctx")
        cfg = link.tls = (ctx, cfg.get("server_hostname") or link.host)
    return _open(link.host, link.port, cfg[0], cfg[1])


async def _open(host, port, ctx, name):
    if not IS_MICROPYTHON:
        # The handshake is part of the connection here: a refusal is raised from it.
        return await asyncio.open_connection(host, port, ssl=ctx, server_hostname=name)
    # Plain TCP first, then TLS over it, rather than open_connection(ssl=...): the link
    # turns Nagle off on the TCP socket (get_extra_info("socket")), which the TLS socket
    # has no option for. The handshake happens in the first write and read (the
    # CONNECT), where a refusal is raised.
    w = (await asyncio.open_connection(host, port))[1]
    sock = w.s
    try:
        s = ctx.wrap_socket(sock, server_hostname=name, do_handshake_on_connect=False)
        s.setblocking(False)
    except Exception as e:
        # Closed here: the unix port's sockets have no finaliser (mqttopen.py, _dial).
        sock.close()
        # mbedTLS's buffers come from the heap on a bare-metal port: short of it, this is
        # a connection that found no heap, which the link counts as such.
        if getattr(e, "errno", 0) == 12:  # ENOMEM
            raise MemoryError("tls buffers")
        raise
    w = _Stream(s, {"socket": sock})
    return w, w
