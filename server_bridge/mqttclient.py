"""paho's MQTT client, with what it has queued written by the thread that queued it.

paho's threaded mode (loop_start) writes only on its network thread: a publish from any
other thread queues the packet, wakes the network thread through a socket pair, and
returns. The bridge's RPC workers stream model text to boards that way, so each chunk
waited for the network thread to be free, which it is not while it relays a board's
events (the events a run sends as its model call starts arrive just then), and for the
interpreter's lock to pass between the two threads: 0.1 to 0.6 ms on a request's way to
its first words on this machine, measured per hop (bench_bridge figure 1). A host
client's request waited the same way for the host's network thread.

`Client.flush()` writes paho's queue from the calling thread instead. Every write of the
client then holds one lock: the network thread's own (`loop_write`, which its loop
calls) and a flush, so packets never interleave and a packet a send took only part of
is finished, from where it stopped, by whichever thread writes next. A flush that finds
the lock taken waits for it a moment (the holder may be the network thread, waiting for
the interpreter's lock the flushing thread holds), then writes what is left; past
_FLUSH_WAIT_S it leaves its packet to the network thread, which paho's own wake-up
reaches, as before. A reconnect holds the lock too, so no packet of the old connection
is written on the new one ahead of its CONNECT.

A thread that publishes and then flushes needs no wake-up of the network thread either:
`publish_quiet()` queues without one, and its `flush()` wakes the network thread only
for what it leaves (all of it, when it could not take the lock; the rest of a packet
the socket took part of). Woken for nothing, the network thread took the interpreter's
lock from the writing thread just as it wrote: an RPC worker's chunk on its way to the
board, a host's request on its way to the broker.

What a flush does not do is handle a failure: a send that fails leaves its packet at
the front of paho's queue, and the network thread, which paho woke for the packet
anyway, meets the failure on its next read or write and reconnects as it always does.
Never on the network thread (paho writes there when its callback returns) and never
over TLS (an OpenSSL connection must not be written by one thread while another reads
it).

The flush calls paho's own writer, `Client._packet_write`: not public API, but the one
function paho's `loop_write` wraps, and the only place paho takes packets off its queue.
`tests/test_mqttclient.py` checks it is there, so an upgrade that moves it fails a test
instead of quietly ending the flush (`flush` then returns False and paho writes as
before).

Two costs of paho's network thread go too, measured under a device's flood (py-spy: the
network thread is what limits the bridge's intake there). A packet the network thread
queues itself (the PUBACK of each message it reads) no longer writes a byte to paho's
wake-up socket pair, which only ends a select the thread is not in: its loop writes the
queue on its next turn anyway (8 % of its time). And paho's debug line for every packet
read or written is dropped before it is formatted when nothing logs at debug (4 %).

A PUBACK under MQTT 3.1.1 is read as its packet id alone: paho builds a ReasonCode
and a Properties for each, its MQTT 5 way, 14 % of the bridge's CPU as it relayed a
board's runs, since every message it publishes is acknowledged.

A reconnect keeps the order of QoS 1 messages. paho sends again what the last connection
left unacknowledged (and what was published while it was down) only once it has read the
new CONNACK, said it is connected and called on_connect; a publish of another thread
in that moment, or between the new socket and its CONNACK, went out at once, ahead of
those: an RPC worker's next model chunk overtook the ones before it, and the board
failed the call (`gap`; tests/test_streams.py, a broker restarted mid-answer, once the
board's acks came on another connection than its chunks). So until paho has handled
the CONNACK (`_resent`), a QoS 1 publish of any other thread is kept, as while
disconnected, and that handling sends it after everything before it; the handling
holds paho's lock on its outgoing messages throughout, so no publish falls between.

And the network thread reads the broker's stream in blocks (_BufferedSocket): paho asks
its socket for each packet's first byte, its length bytes and its body in turn, a
system call each (14 % of the thread's time under the flood). The block's bytes not yet
asked for are what the socket's `pending()` says, which paho's loop already consults (for
TLS, where OpenSSL buffers the same way): with bytes pending it does not wait in select,
so nothing read ahead waits for the next packet to arrive. Plain TCP only; a TLS socket
is paho's as it was.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

__all__ = ["Client"]

log = logging.getLogger("wren.bridge.mqtt")

# How long a flush waits for another writer to finish; past it the packet is left to
# the network thread (paho's own wake-up reaches it).
_FLUSH_WAIT_S = 0.05
# The most the network thread reads from the broker at once: a socket's receive buffer
# on loopback holds about this much, and the block is copied once per packet read.
_RECV_BYTES = 65536
# What every MQTT 3.1.1 PUBACK tells on_publish: success, and no properties (that
# protocol has neither). Built once; the callbacks only read them.
_ACKED = ReasonCode(PacketTypes.PUBACK)
_NO_PROPERTIES = Properties(PacketTypes.PUBACK)


# CONNACK refusals that are about the login, not about reaching the broker: "Bad user
# name or password" and "Not authorized" (paho gives a 3.1.1 broker's 4 and 5 as these
# MQTT 5 codes; Mosquitto says "Not authorized" for a wrong password).
_LOGIN_REFUSED = frozenset({134, 135})


def connack_refusal(where: str, user: str | None, reason_code: Any) -> str:
    """What a CONNACK refusal from the broker at `where` means, in words: a refused
    login names the user whose credentials were refused, since the broker was reached."""
    if getattr(reason_code, "value", None) in _LOGIN_REFUSED:
        who = f"for user {user!r}" if user else "for an anonymous client (no user given)"
        return (
            f"the MQTT broker at {where} refused the credentials {who} ({reason_code}): "
            "check the user name and password"
        )
    return f"the MQTT broker at {where} refused the connection: {reason_code}"


class Client(mqtt.Client):
    """A paho client whose queued packets any thread may write (see the module
    docstring). Used like paho's: `loop_start()`, then publish from any thread and call
    `flush()` where waiting for the network thread would cost latency."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Reentrant: connect() before loop_start() writes its CONNECT from inside
        # reconnect() (paho writes at once while it has no network thread).
        self._flush_lock = threading.RLock()
        self._flush_net: int | None = None  # the network thread's ident, once it runs
        self._flush_on = True  # off from disconnect(): its DISCONNECT is paho's to write
        # Per thread: `quiet` while publish_quiet() queues, `owed` until its flush().
        self._local = threading.local()
        # Whether paho has handled this connection's CONNACK (and so sent again what an
        # earlier one left), and the thread handling it; both under _out_message_mutex.
        self._resent = False
        self._connack_thread: int | None = None

    def loop_forever(self, *args: Any, **kwargs: Any) -> mqtt.MQTTErrorCode:
        # loop_start()'s thread runs this: remember which thread it is.
        self._flush_net = threading.get_ident()
        return super().loop_forever(*args, **kwargs)

    def loop_write(self) -> mqtt.MQTTErrorCode:
        with self._flush_lock:
            return super().loop_write()

    def _create_socket(self) -> Any:
        sock = super()._create_socket()
        if type(sock) is socket.socket:
            return _BufferedSocket(sock)
        return sock

    def _packet_queue(
        self,
        command: int,
        packet: bytes | bytearray,
        mid: int,
        qos: int,
        info: mqtt.MQTTMessageInfo | None = None,
    ) -> mqtt.MQTTErrorCode:
        # On the network thread of loop_start(), queued without the wake-up byte (module
        # docstring): the loop computes what to write after the read that queued this.
        # So is publish_quiet()'s packet, which its own thread writes.
        if self._thread is None or (
            threading.get_ident() != self._flush_net and not getattr(self._local, "quiet", False)
        ):
            return super()._packet_queue(command, packet, mid, qos, info)
        queued: Any = {
            "command": command,
            "mid": mid,
            "qos": qos,
            "pos": 0,
            "to_process": len(packet),
            "packet": packet,
            "info": info,
        }
        self._out_packet.append(queued)
        self._call_socket_register_write()
        return mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS

    def _handle_pubackcomp(self, cmd: Any) -> mqtt.MQTTErrorCode:
        # An MQTT 3.1.1 PUBACK (the protocol Wren speaks) is its packet id alone. paho
        # builds a ReasonCode and a Properties for each one, its MQTT 5 way: 14 % of the
        # bridge's CPU while it relayed a board's runs (py-spy, bench_bridge figure 1),
        # as every message it publishes is acked. Anything else is paho's to handle.
        packet = self._in_packet["packet"]
        if cmd != "PUBACK" or self._protocol != mqtt.MQTTv311 or len(packet) != 2:
            return super()._handle_pubackcomp(cmd)
        mid = packet[0] << 8 | packet[1]
        self._easy_log(mqtt.MQTT_LOG_DEBUG, "Received %s (Mid: %d)", cmd, mid)
        with self._out_message_mutex:
            if mid in self._out_messages:
                # Only inform the client the message has been sent once.
                return self._do_on_publish(mid, _ACKED, _NO_PROPERTIES)
        return mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS

    def _easy_log(self, level: Any, fmt: str, *args: Any) -> None:
        if level == mqtt.MQTT_LOG_DEBUG and self.on_log is None:
            logger = self._logger
            if logger is None or not logger.isEnabledFor(logging.DEBUG):
                return
        super()._easy_log(level, fmt, *args)

    def reconnect(self) -> mqtt.MQTTErrorCode:
        with self._flush_lock:
            self._flush_on = True
            with self._out_message_mutex:
                self._resent = False
            return super().reconnect()

    def _handle_connack(self) -> mqtt.MQTTErrorCode:
        # Held throughout (an RLock): paho marks itself connected and calls on_connect
        # before it sends again what was left; no other thread's publish falls between.
        with self._out_message_mutex:
            self._connack_thread = threading.get_ident()
            try:
                return super()._handle_connack()
            finally:
                self._connack_thread = None
                self._resent = self.is_connected()

    def _send_publish(self, mid: int, topic: bytes, payload: Any = b"", qos: int = 0,
                      *args: Any, **kwargs: Any) -> mqtt.MQTTErrorCode:  # fmt: skip
        # Before the CONNACK has been handled, another thread's QoS 1 message is kept
        # (paho's publish leaves it queued, in order, as when disconnected) and the
        # handling sends it after what came before it (module docstring).
        if qos > 0 and not self._resent and self._connack_thread != threading.get_ident():
            return mqtt.MQTTErrorCode.MQTT_ERR_NO_CONN
        return super()._send_publish(mid, topic, payload, qos, *args, **kwargs)

    def disconnect(self, *args: Any, **kwargs: Any) -> mqtt.MQTTErrorCode:
        # Not under the lock: disconnect() may be called from a callback, which holds
        # paho's callback lock, and a flush holding ours may wait for that one.
        self._flush_on = False
        return super().disconnect(*args, **kwargs)

    def publish_quiet(
        self, topic: str, payload: bytes, qos: int = 0, retain: bool = False
    ) -> mqtt.MQTTMessageInfo:
        """publish(), without waking the network thread: for a thread that calls flush()
        next, which writes the message itself and wakes the network thread only for what
        it could not write (module docstring)."""
        local = self._local
        local.quiet = True
        try:
            return self.publish(topic, payload, qos=qos, retain=retain)
        finally:
            local.quiet = False
            local.owed = True

    def flush(self) -> bool:
        """Write what paho has queued, from this thread; True when this call wrote (or
        tried to), False when it left the writing to someone else. After publish_quiet()
        on this thread, what is left queued (all of it, when this call could not write)
        is the network thread's, woken for it."""
        local = self._local
        owed = getattr(local, "owed", False)
        local.owed = False
        wrote = self._flush()
        if owed and (not wrote or self._out_packet) and threading.get_ident() != self._flush_net:
            sockpair = self._sockpairW
            if sockpair is not None:
                try:
                    sockpair.send(b"0")  # paho's own wake-up (its _packet_queue)
                except BlockingIOError:
                    pass  # a wake-up is pending already
        return wrote

    def _flush(self) -> bool:
        if not self._flush_on or threading.get_ident() == self._flush_net:
            return False
        if isinstance(self.socket(), ssl.SSLSocket):
            return False
        write = getattr(self, "_packet_write", None)
        # Waited for, briefly: a worker that gave up at once left its chunk to a network
        # thread still waiting for the interpreter's lock, 0.1 ms and more (figure 1).
        if write is None or not self._flush_lock.acquire(timeout=_FLUSH_WAIT_S):
            return False
        try:
            if not self._flush_on:
                return False
            # Its result is not ours to act on: a failure is the network thread's
            # (module docstring).
            write()
            return True
        except Exception:
            # paho handles socket errors itself; anything else is a bug, logged, and the
            # packet is still queued for the network thread.
            log.exception("writing paho's queue from this thread failed")
            return False
        finally:
            self._flush_lock.release()


class _BufferedSocket:
    """A plain TCP socket whose reads come from blocks of up to _RECV_BYTES (module
    docstring); everything else is the socket's own. Read by one thread only, paho's
    network thread; written by any, under the client's flush lock."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._block = b""
        self._at = 0

    def recv(self, size: int) -> bytes:
        if self._at >= len(self._block):
            # Raises BlockingIOError when nothing has come, as the socket does; b""
            # is the end of the stream.
            self._block = self._sock.recv(_RECV_BYTES)
            self._at = 0
        end = self._at + size
        data = self._block[self._at : end]
        self._at = min(end, len(self._block))
        return data

    def pending(self) -> int:
        """Bytes read from the socket that no recv has asked for yet."""
        return len(self._block) - self._at

    def fileno(self) -> int:
        return self._sock.fileno()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)
