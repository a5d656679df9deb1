"""The bridge's counters over HTTP: `GET /metrics`, for a Prometheus scraper.

    server = MetricsServer(bridge.metrics_text, "127.0.0.1", 9464)
    server.start()  # serves from a daemon thread
    ...
    server.stop()

Only the standard library (`http.server`), and only this one resource: `GET` and `HEAD
/metrics` answer the text `render()` returns (Prometheus text format 0.0.4, see
metrics.py), any other path 404 and any other HTTP method 405. A request is handled on a
thread of its own, so a slow scraper holds up no other. A scrape is logged at debug,
not on stderr: a scraper comes every few seconds. A `render()` that raises is logged
with its traceback and answered 500; the server serves the next request as before.

The server binds where it is told: the bridge's `--metrics` binds loopback unless it is
given another address (service.py), as the counters name tenants.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import sys
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, cast
from urllib.parse import urlsplit

__all__ = ["CONTENT_TYPE", "PATH", "MetricsServer"]

PATH = "/metrics"
# What Prometheus asks for and expects of the text format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TEXT = "text/plain; charset=utf-8"
_ALLOW = "GET, HEAD"
# How often the serving loop looks for a stop: a bridge stop waits up to this long.
_POLL_S = 0.1
# A client that stops sending mid-request gives its thread back after this long.
_REQUEST_TIMEOUT_S = 10.0
# A refused request's body is read (up to this much) before the answer, so that closing
# the connection does not reset it under the client before the client has read the 405.
_DRAIN_MAX = 64 * 1024
_JOIN_S = 2.0

log = logging.getLogger("wren.metrics_http")


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a scrape in progress does not hold the process at exit

    def __init__(self, address: tuple[str, int], render: Callable[[], str]) -> None:
        # Before the socket is made: an IPv6 literal (`::1`) needs an IPv6 socket.
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.render = render
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer's own also looks up the host's fully qualified name, which may wait
        # on DNS; nothing here uses it.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # What escaped a handler (socketserver prints it to stderr by default).
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError):
            log.debug("metrics: %s went away: %s", client_address, error)
        else:
            log.error("metrics: request from %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    timeout = _REQUEST_TIMEOUT_S

    def version_string(self) -> str:
        return "wren-bridge"  # the Server header, without the Python version

    def do_GET(self) -> None:
        self._metrics(with_body=True)

    def do_HEAD(self) -> None:
        self._metrics(with_body=False)

    def _metrics(self, with_body: bool) -> None:
        if urlsplit(self.path).path != PATH:
            self._answer(404, f"not found: only {PATH} is served\n", with_body=with_body)
            return
        try:
            text = cast(_Server, self.server).render()
        except Exception:
            log.exception("metrics: could not make the text for %s", self.path)
            why = "the metrics could not be made; the bridge log says why\n"
            self._answer(500, why, with_body=with_body)
            return
        self._answer(200, text, content_type=CONTENT_TYPE, with_body=with_body)

    def _not_allowed(self) -> None:
        self._drain()
        if urlsplit(self.path).path != PATH:
            self._answer(404, f"not found: only {PATH} is served\n")
        else:
            self._answer(405, f"{PATH} is read with GET\n", headers=[("Allow", _ALLOW)])

    # Every other method of HTTP (RFC 9110, and PATCH): not this resource's. A method
    # HTTP does not define is http.server's 501.
    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _not_allowed

    def _drain(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return
        if 0 < length <= _DRAIN_MAX:
            self.rfile.read(length)

    def _answer(
        self,
        code: int,
        text: str,
        content_type: str = _TEXT,
        with_body: bool = True,
        headers: Iterable[tuple[str, str]] = (),
    ) -> None:
        body = text.encode("utf-8")
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics: %s %s", self.address_string(), format % args)


class MetricsServer:
    """`render()` served at http://HOST:PORT/metrics from a daemon thread, from start()
    until stop(); a context manager too.

    The socket is bound here: a port in use, or a host that is not this machine's, is
    an OSError now, before anything runs. Port 0 binds a free port (see `address`).
    """

    def __init__(self, render: Callable[[], str], host: str, port: int) -> None:
        self._server = _Server((host, port), render)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": _POLL_S},
            name="wren-metrics-http",
            daemon=True,
        )
        self._closed = False

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) bound: the port is the one chosen when 0 was asked for."""
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}{PATH}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop serving (within _POLL_S) and close the socket; idempotent. A scrape
        under way finishes on its own thread or ends with the process."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(_JOIN_S)
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
