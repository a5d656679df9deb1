"""The HTTP API served by uvicorn on a thread of the bridge's process (`wren bridge
--http HOST:PORT`, loopback unless told otherwise; TLS with --http-cert and
--http-key)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server_bridge.bridge import Bridge

__all__ = ["HttpServer"]

log = logging.getLogger("wren.bridge.http")

# How long start() waits for the socket to be bound, and stop() for the thread.
_START_S = 10.0
_STOP_S = 5.0


class HttpServer:
    def __init__(
        self,
        bridge: Bridge,
        host: str = "127.0.0.1",
        port: int = 0,
        certfile: str | None = None,
        keyfile: str | None = None,
        heartbeat_s: float | None = None,
    ) -> None:
        # Imported here: the ASGI stack is an optional part (the `http` extra).
        import uvicorn

        from .app import HEARTBEAT_S, build_app

        app = build_app(bridge, HEARTBEAT_S if heartbeat_s is None else heartbeat_s)
        self._config = uvicorn.Config(
            app,
            host=host,
            port=port,
            ssl_certfile=certfile,
            ssl_keyfile=keyfile,
            log_level="warning",
            access_log=False,
            # Streams end promptly at a stop: a heartbeat-only SSE stream would keep
            # the graceful shutdown waiting otherwise.
            timeout_graceful_shutdown=1,
            lifespan="off",
        )
        self._server = uvicorn.Server(self._config)
        self._thread: threading.Thread | None = None
        self.scheme = "https" if certfile else "http"
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def start(self) -> None:
        """Bind and serve; returns once the socket listens (its port in `port`).
        Raises OSError when it cannot bind (a port in use)."""
        failed: list[BaseException] = []

        def serve() -> None:
            try:
                asyncio.run(self._server.serve())
            except BaseException as e:  # reported to start(), or logged once running
                failed.append(e)
                if self._server.started:
                    log.exception("the HTTP server stopped")

        self._thread = threading.Thread(target=serve, name="wren-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + _START_S
        while not self._server.started:
            if failed or not self._thread.is_alive():
                raise OSError(f"the HTTP server could not listen on {self.host}:{self.port}"
                              + (f": {failed[0]}" if failed else ""))  # fmt: skip
            if time.monotonic() > deadline:
                raise OSError("the HTTP server did not start in time")
            time.sleep(0.01)
        sockets = [s for server in self._server.servers for s in server.sockets]
        if sockets:
            self.port = sockets[0].getsockname()[1]

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=_STOP_S)
            self._thread = None
