"""The HTTP/1.1 the OpenAI provider speaks on its kept-alive connections: one POST at a
time, its answer read as it streams. Only that, so it costs a fraction of http.client.

Why not http.client: between the model server's first bytes and the first text handed
on, http.client parsed the headers through the email package, read each SSE line
through IOBase.readline over peek() and a chunk-size reader, and wrote a request as two
sends (headers, then body: two TCP segments the server reads apart). A model call to a
local server took 107 us to its first text on a warm cache and 300-350 us on a cold one
(a bridge idle between requests); the same exchange written directly took 33 and 186.
The user waits for that on every turn.

What it does: a request is one buffer, sent with one sendall. An answer is read into one
buffer: the status line, interim 1xx answers skipped, then the headers (at most
MAX_HEADERS lines of at most MAX_LINE bytes, as http.client bounds them), then a body
framed by `Transfer-Encoding: chunked`, by `Content-Length`, or by the end of the
connection. `Response.readline` and `Response.read` hand out the body; a chunked body cut
short reads as its end (as http.client's readline does), which leaves the connection
unusable. Anything else outside the grammar is a ProtocolError, an
http.client.HTTPException, so a caller catches both kinds of client alike.

A connection that closes or resets before the first byte of the answer raises
Unanswered: the server never read the request, so it may be sent again on another
connection (the provider does so once, for a connection it had kept). Once a byte came,
nothing is ever sent again.

Timeouts are the socket's (the caller sets them); nothing here waits without one.
"""

from __future__ import annotations

import http.client
import socket
import ssl
from collections.abc import Mapping

__all__ = ["MAX_HEADERS", "MAX_LINE", "Connection", "ProtocolError", "Response", "Unanswered"]

# http.client's own bounds on an answer's head.
MAX_LINE = 65536
MAX_HEADERS = 100
# What one recv asks for: a few SSE events, or a whole short answer.
_RECV = 65536


class ProtocolError(http.client.HTTPException):
    """An answer outside HTTP/1.1's grammar, or over the bounds above."""


class Unanswered(http.client.RemoteDisconnected):
    """The connection closed or was reset before a byte of the answer arrived."""


class Connection:
    """One TCP (or TLS) connection to a server, carrying one request at a time."""

    def __init__(
        self, host: str, port: int, timeout: float, tls: ssl.SSLContext | None = None
    ) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self.tls = tls
        self.sock: socket.socket | None = None
        # The Host header as http.client writes it: brackets for an IPv6 literal, the
        # port only when it is not the scheme's.
        name = f"[{host}]" if ":" in host else host
        default = 443 if tls is not None else 80
        self._host_header = name if port == default else f"{name}:{port}"

    def connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), self.timeout)
        try:
            # Each request and each SSE event is sent as soon as it is written.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def request(self, path: str, headers: Mapping[str, str], body: bytes) -> None:
        """Send `POST path` with `headers` and `body`, in one write."""
        if self.sock is None:
            raise http.client.NotConnected()
        self.sock.sendall(self.message(path, headers, body))

    def message(self, path: str, headers: Mapping[str, str], body: bytes) -> bytes:
        """The bytes of `POST path` with `headers` and `body`."""
        lines = [f"POST {path} HTTP/1.1", f"Host: {self._host_header}"]
        # Not compressed: an SSE stream is read as it comes, line by line.
        lines.append("Accept-Encoding: identity")
        lines += [f"{k}: {v}" for k, v in headers.items()]
        lines.append(f"Content-Length: {len(body)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        return head + body

    def response(self) -> Response:
        """Read the answer's status and headers (interim 1xx answers skipped)."""
        if self.sock is None:
            raise http.client.NotConnected()
        return Response(self.sock)

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()


class Response:
    """An answer: `status`, `reason`, `headers` (lower-case names, the last of a
    repeated one), `will_close`, and its body through `readline` and `read`."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()
        self._pos = 0
        self._eof = False  # the connection ended
        self.status = 0
        self.reason = ""
        self.version = 11
        self.headers: dict[str, str] = {}
        self._first = True
        while True:
            self._head()
            if not 100 <= self.status < 200:
                break
        self.will_close = self._closes()
        # Body framing: chunked, by length, or to the end of the connection.
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        self._left: int | None = None  # bytes left of the body (length) or chunk
        self._done = False  # the whole body was read: the connection may carry more
        if self.status in (204, 304) or (not self._chunked and self._length() == 0):
            self._done = True
        elif self._chunked:
            self._left = 0  # the next thing is a chunk-size line
        else:
            self._left = self._length()
            if self._left is None:
                self.will_close = True  # framed by the end of the connection

    # --- the head --------------------------------------------------------------------

    def _head(self) -> None:
        line = self._line(MAX_LINE)
        try:
            version, status, *reason = line.decode("latin-1").rstrip("\r\n").split(None, 2)
            code = int(status)
        except ValueError:
            raise ProtocolError(f"bad status line {line[:80]!r}") from None
        if version not in ("HTTP/1.1", "HTTP/1.0") or not 100 <= code <= 999:
            raise ProtocolError(f"bad status line {line[:80]!r}")
        self.version = 11 if version == "HTTP/1.1" else 10
        self.status, self.reason = code, reason[0] if reason else ""
        headers: dict[str, str] = {}
        name = ""
        for _ in range(MAX_HEADERS + 1):
            raw = self._line(MAX_LINE)
            if raw in (b"\r\n", b"\n"):
                self.headers = headers
                return
            if not raw.endswith(b"\n"):
                raise ProtocolError("the answer's head ended early")
            text = raw.decode("latin-1").rstrip("\r\n")
            if text[:1] in (" ", "\t") and name:
                headers[name] += " " + text.strip()  # an obsolete folded line
                continue
            key, colon, value = text.partition(":")
            if not colon:
                raise ProtocolError(f"bad header line {text[:80]!r}")
            name = key.strip().lower()
            headers[name] = value.strip()
        raise ProtocolError(f"more than {MAX_HEADERS} header lines")

    def _closes(self) -> bool:
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if "close" in tokens:
            return True
        return self.version == 10 and "keep-alive" not in tokens

    def _length(self) -> int | None:
        value = self.headers.get("content-length")
        if value is None:
            return None
        try:
            n = int(value)
        except ValueError:
            raise ProtocolError(f"bad Content-Length {value[:40]!r}") from None
        if n < 0:
            raise ProtocolError(f"bad Content-Length {value[:40]!r}")
        return n

    # --- the buffer ------------------------------------------------------------------

    def _fill(self) -> bool:
        """Read more from the socket; False at the end of the connection."""
        if self._eof:
            return False
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        try:
            data = self._sock.recv(_RECV)
        except (ConnectionResetError, ConnectionAbortedError) as e:
            if self._first:
                raise Unanswered(f"reset before answering: {e}") from e
            raise
        if not data:
            self._eof = True
            if self._first:
                raise Unanswered("closed without answering")
            return False
        self._first = False
        self._buf += data
        return True

    def _line(self, limit: int) -> bytes:
        """The next line of the connection (with its newline), at most `limit` bytes;
        shorter without a newline only at the end of the connection."""
        while True:
            end = self._buf.find(b"\n", self._pos, self._pos + limit)
            if end >= 0:
                return self._take(end + 1 - self._pos)
            if len(self._buf) - self._pos >= limit:
                raise ProtocolError(f"a line over {limit} bytes")
            if not self._fill():
                return self._take(len(self._buf) - self._pos)

    def _take(self, n: int) -> bytes:
        out = bytes(self._buf[self._pos : self._pos + n])
        self._pos += n
        return out

    # --- the body --------------------------------------------------------------------

    def _room(self) -> int:
        """Body bytes that may be handed out next without crossing a frame: the rest of
        the chunk or of the length, or any (to the end of the connection); 0 at the end
        of the body. Reads the next chunk-size line (and the trailer after the last)."""
        if self._done:
            return 0
        if self._left is None:
            return MAX_LINE  # to the end of the connection: no frame to cross
        if self._left or not self._chunked:
            if not self._left:
                self._done = True
            return self._left
        # Between chunks: the CRLF that ends the previous one (none before the first),
        # then the next chunk's size.
        line = self._line(MAX_LINE)
        if line in (b"\r\n", b"\n"):
            line = self._line(MAX_LINE)
        if not line.endswith(b"\n"):
            return self._cut()
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise ProtocolError(f"bad chunk size line {line[:40]!r}") from None
        if size < 0:
            raise ProtocolError(f"bad chunk size line {line[:40]!r}")
        if size == 0:
            # The last chunk: trailer lines up to a blank one, then the body is whole.
            for _ in range(MAX_HEADERS + 1):
                trailer = self._line(MAX_LINE)
                if trailer in (b"\r\n", b"\n"):
                    self._done = True
                    return 0
                if not trailer.endswith(b"\n"):
                    return self._cut()
            raise ProtocolError(f"more than {MAX_HEADERS} trailer lines")
        self._left = size
        return size

    def _cut(self) -> int:
        """The connection ended inside the body: the body ends here, and the connection
        carries nothing more."""
        self._left = 0
        self._done = True
        self.will_close = True
        self._eof = True
        return 0

    def _available(self) -> bool:
        """Buffered bytes past the read position, or more read into the buffer; False
        at the end of the connection (for a length-framed body: cut short)."""
        if self._pos < len(self._buf):
            return True
        if self._fill():
            return True
        if self._left is None:
            self._done = True  # a body framed by the end of the connection: ended
        else:
            self._cut()
        return False

    def _hand(self, n: int) -> bytes:
        out = self._take(n)
        if self._left is not None:
            self._left -= n
        return out

    def readline(self, limit: int = -1) -> bytes:
        """The next line of the body (with its newline), at most `limit` bytes (all of
        it for -1); b"" at the end of the body."""
        parts: list[bytes] = []
        want = limit if limit >= 0 else MAX_LINE * 1024
        while want > 0:
            room = self._room()
            if not room or not self._available():
                break
            span = min(room, want, len(self._buf) - self._pos)
            end = self._buf.find(b"\n", self._pos, self._pos + span)
            if end >= 0:
                parts.append(self._hand(end + 1 - self._pos))
                break
            parts.append(self._hand(span))
            want -= span
        return b"".join(parts)

    def read(self, amt: int | None = None) -> bytes:
        """Up to `amt` bytes of the body (the rest of it for None), fewer only at its end."""
        parts: list[bytes] = []
        want = amt if amt is not None else -1
        while want:
            room = self._room()
            if not room or not self._available():
                break
            span = len(self._buf) - self._pos
            span = min(room, span) if want < 0 else min(room, span, want)
            parts.append(self._hand(span))
            if want > 0:
                want -= span
        return b"".join(parts)

    def isclosed(self) -> bool:
        """The whole body was read (the connection may carry another request unless
        `will_close`)."""
        return self._done
