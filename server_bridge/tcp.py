"""TCP options for the MQTT sockets of the bridge and of host clients.

Every message on Wren's path is small (an event, a chunk, an ack) and each waits on the
one before it. With Nagle's algorithm on, a small write waits for the ACK of the last
one, and the peer delays that ACK by up to 40 ms: measured, a request's first delta took
180 ms where the same code with TCP_NODELAY on every socket takes about 10 ms. So every
socket in the stack turns Nagle off: these paho clients here, the board's link
(edge_runtime/link.py) and Mosquitto (`set_tcp_nodelay true`, brokerconf.py).
"""

from __future__ import annotations

import logging
import socket
from typing import Any

__all__ = ["no_delay"]

log = logging.getLogger("wren.tcp")


def no_delay(client: Any, userdata: Any, sock: Any) -> None:
    """paho's `on_socket_open` callback: Nagle off on the new connection's socket.

    A socket that is not TCP (a unix socket, a websocket wrapper) keeps its options; that
    is logged, not raised, so the connection still comes up.
    """
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError) as e:
        log.info("TCP_NODELAY not set on the MQTT socket (%s): small messages may wait", e)
