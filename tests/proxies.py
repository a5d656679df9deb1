"""TCP proxies the tests put between a real client and a real server, to make what a
network and a broker do to order: drop every connection and keep new ones out for a
while (a host away, `hold`/`release`), cut a stream after so many bytes (a drop
mid-frame, `CuttingProxy`), or refuse subscriptions on the wire (`SubackProxy`: a
broker's SUBACK codes rewritten to 0x80; Mosquitto grants what its ACL denies, 2.0.11
filters at delivery instead, and a NATS node's refusal, a JetStream consumer it could
not make in time, cannot be made to order).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from itertools import cycle
from typing import Any

import paho.mqtt.client as mqtt

from tests.waiting import wait_for

_SUBACK = 0x90


def shut(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


class TcpProxy:
    """Each accepted connection is dialled through to `target` and pumped both ways by
    two threads (to the server as it comes; back by `_down`, which a subclass may read
    as it likes). `hold()` drops every connection and closes new ones at once until
    `release()`; `cut()` only drops."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._lock = threading.Lock()
        self._held = False
        self._socks: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                held = self._held
            if held:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, upstream]
            self._start_pumps(client, upstream)

    def _start_pumps(self, client: socket.socket, upstream: socket.socket, *down: Any) -> None:
        threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
        threading.Thread(target=self._down, args=(upstream, client, *down), daemon=True).start()

    def _down(self, src: socket.socket, dst: socket.socket) -> None:
        self._pump(src, dst)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        shut(src, dst)

    def cut(self) -> None:
        with self._lock:
            socks, self._socks = self._socks, []
        shut(*socks)

    def hold(self) -> None:
        with self._lock:
            self._held = True
        self.cut()

    def release(self) -> None:
        with self._lock:
            self._held = False

    def close(self) -> None:
        self._listener.close()
        self.hold()


class CuttingProxy(TcpProxy):
    """Drops each connection once its budget of bytes has gone from the server to the
    client (the budgets taken in turn): a stream cut mid-frame, mid-chunk, as a network
    drops it. `cuts` counts the connections it cut."""

    def __init__(self, target: tuple[str, int], budgets: Iterable[int]) -> None:
        self._budgets = cycle(budgets)
        self.cuts = 0
        super().__init__(target)

    def _start_pumps(self, client: socket.socket, upstream: socket.socket, *down: Any) -> None:
        with self._lock:
            budget = next(self._budgets)  # in the order the connections came
        super()._start_pumps(client, upstream, budget)

    def _down(self, src: socket.socket, dst: socket.socket, budget: int = 0) -> None:
        try:
            while data := src.recv(65536):
                if len(data) >= budget:
                    dst.sendall(data[:budget])
                    with self._lock:
                        self.cuts += 1
                    break
                budget -= len(data)
                dst.sendall(data)
        except OSError:
            pass
        shut(src, dst)


class SubackProxy(TcpProxy):
    """Reads the broker's side as MQTT packets: while `refusing`, each SUBACK goes on
    with every return code 0x80 (failure). `subacks` counts the SUBACKs it passed."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.refusing = False
        self.subacks = 0
        super().__init__(target)

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
            shut(src, dst)


def suback_read_first(client: mqtt.Client, thread: str, timeout: float) -> Callable[[], None]:
    """Make each subscription that `client` makes on the thread named `thread` have its
    SUBACK read, and handled, before subscribe() returns its mid: the real subscribe, then
    a bounded wait until that SUBACK has been handled. (A subscription made again from a
    thread of its own goes out at once, so its answer may come first.) Returns what puts
    the client back as it was."""
    handled: set[int] = set()
    on_subscribe, subscribe = client.on_subscribe, client.subscribe
    assert on_subscribe is not None, "the client's own on_subscribe is what is wrapped"

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
