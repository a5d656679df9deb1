"""A TCP proxy in front of a real broker that refuses subscriptions on the wire: the
broker's SUBACKs go on with every return code 0x80 while told to. Mosquitto grants what
its ACL denies (2.0.11 filters at delivery instead), and a NATS node's refusal (a
JetStream consumer it could not make in time) cannot be made to order, so this is how
the tests of a refused subscription after a reconnect make one
(tests/test_host_resubscribe.py, tests/test_bridge_resubscribe.py).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt

from tests.waiting import wait_for

_SUBACK = 0x90


class SubackProxy:
    """A TCP proxy in front of the broker that reads the broker's side as MQTT packets:
    while `refusing`, each SUBACK goes on with every return code 0x80 (failure), and
    `cut()` drops the connections it carries. `subacks` counts the SUBACKs it passed."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.refusing = False
        self.subacks = 0
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                return
            with self._lock:
                self._socks += [client, upstream]
            threading.Thread(target=self._up, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client), daemon=True).start()

    def _up(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        self._shut(src, dst)

    def _down(self, src: socket.socket, dst: socket.socket) -> None:
        # The broker's packets one by one: the fixed header's type byte, the remaining
        # length (a varint of up to four bytes), the rest.
        reader = src.makefile("rb")
        try:
            while head := reader.read(1):
                length, shift, raw = 0, 0, b""
                while True:
                    b = reader.read(1)
                    if not b:
                        return
                    raw += b
                    length |= (b[0] & 0x7F) << shift
                    shift += 7
                    if not b[0] & 0x80:
                        break
                body = reader.read(length)
                if head[0] & 0xF0 == _SUBACK:
                    with self._lock:
                        self.subacks += 1
                        refusing = self.refusing
                    if refusing:  # the packet id, then each topic's code
                        body = body[:2] + b"\x80" * (len(body) - 2)
                dst.sendall(head + raw + body)
        except OSError:
            pass
        finally:
            reader.close()
            self._shut(src, dst)

    def _shut(self, *socks: socket.socket) -> None:
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def cut(self) -> None:
        with self._lock:
            socks, self._socks = self._socks, []
        self._shut(*socks)

    def close(self) -> None:
        self._listener.close()
        self.cut()


def suback_read_first(client: mqtt.Client, thread: str, timeout: float) -> Callable[[], None]:
    """Make each subscription that `client` makes on the thread named `thread` have its
    SUBACK read, and handled, before subscribe() returns its mid: the real subscribe, then
    a bounded wait until that SUBACK has been handled. (A subscription made again from a
    thread of its own goes out at once, so its answer may come first.) Returns what puts
    the client back as it was."""
    handled: set[int] = set()
    on_subscribe, subscribe = client.on_subscribe, client.subscribe

    def after_on_subscribe(c: Any, userdata: Any, mid: int, *args: Any) -> None:
        on_subscribe(c, userdata, mid, *args)
        handled.add(mid)

    def subscribe_then_wait(*args: Any, **kwargs: Any) -> Any:
        answer = subscribe(*args, **kwargs)
        if threading.current_thread().name == thread:
            wait_for(lambda: answer[1] in handled, "the broker's SUBACK read", timeout)
        return answer

    def restore() -> None:
        client.on_subscribe = on_subscribe
        client.subscribe = subscribe  # type: ignore[method-assign]

    client.on_subscribe = after_on_subscribe
    client.subscribe = subscribe_then_wait  # type: ignore[method-assign]
    return restore
