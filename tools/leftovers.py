"""What a test run leaves on a broker, found and cleared: the retained messages under its
topic prefix and the persistent sessions of its client ids.

`wren hil --broker` points the board tests at a broker that is not theirs. They publish
retained messages (a board's status and hello, the scripted bridge's online presence)
and connect boards with persistent sessions, so the run ends by clearing both: a session
by connecting once with a clean session under its client id, a retained message by
publishing an empty retained payload to its topic.

Every wait here is bounded (WAIT_S); a broker that does not answer in time is a
LeftoverError, never a hang.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

WAIT_S = 10.0


class LeftoverError(RuntimeError):
    """The broker could not be reached, or did not answer in time."""


@dataclass
class Cleared:
    retained: list[str] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)


class _Client:
    """A paho client on its network thread, connected once CONNACK has come."""

    def __init__(self, host: str, port: int, client_id: str, clean: bool) -> None:
        self.mqtt = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            clean_session=clean,
            protocol=mqtt.MQTTv311,
        )
        self.session_present = False
        self._messages: list[mqtt.MQTTMessage] = []
        self._news = threading.Condition()
        self._connack = threading.Event()
        self._suback = threading.Event()
        self.mqtt.on_connect = self._on_connect
        self.mqtt.on_subscribe = self._on_subscribe
        self.mqtt.on_message = self._on_message
        try:
            self.mqtt.connect(host, port)
        except OSError as e:
            raise LeftoverError(f"cannot reach the broker at {host}:{port}: {e}") from e
        self.mqtt.loop_start()
        if not self._connack.wait(WAIT_S):
            self.close()
            raise LeftoverError(f"no CONNACK from {host}:{port} for {client_id!r}")

    def _on_connect(
        self,
        client: mqtt.Client,
        userdata: object,
        flags: mqtt.ConnectFlags,
        reason: ReasonCode,
        properties: Properties | None,
    ) -> None:
        self.session_present = bool(flags.session_present)
        self._connack.set()

    def _on_subscribe(
        self,
        client: mqtt.Client,
        userdata: object,
        mid: int,
        reasons: list[ReasonCode],
        properties: Properties | None,
    ) -> None:
        self._suback.set()

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        with self._news:
            self._messages.append(msg)
            self._news.notify_all()

    def retained_under(self, prefix: str) -> dict[str, bytes]:
        """The retained messages under prefix/#, by topic.

        A broker sends a new subscription's retained messages before anything published
        after it, so a message this client publishes to the subscription once the
        SUBACK is in marks the end of them: no wait on a clock decides it.
        """
        marker = f"{prefix}/probe-{secrets.token_hex(4)}"
        self._suback.clear()
        self.mqtt.subscribe(f"{prefix}/#", qos=1)
        if not self._suback.wait(WAIT_S):
            raise LeftoverError(f"no SUBACK for {prefix}/#")
        self.mqtt.publish(marker, b"", qos=1)
        with self._news:
            if not self._news.wait_for(
                lambda: any(m.topic == marker for m in self._messages), WAIT_S
            ):
                raise LeftoverError(f"the marker published on {marker} never came back")
            got = {m.topic: bytes(m.payload) for m in self._messages if m.retain and m.payload}
            self._messages.clear()
        self.mqtt.unsubscribe(f"{prefix}/#")
        return got

    def clear(self, topics: Iterable[str]) -> None:
        """An empty retained message on each topic, each acknowledged."""
        infos = [self.mqtt.publish(t, b"", qos=1, retain=True) for t in topics]
        for info in infos:
            info.wait_for_publish(WAIT_S)
            if not info.is_published():
                raise LeftoverError("the broker did not acknowledge clearing a retained message")

    def close(self) -> None:
        self.mqtt.disconnect()
        self.mqtt.loop_stop()


def retained(host: str, port: int, prefix: str) -> dict[str, bytes]:
    """The retained messages under prefix/#, by topic."""
    c = _Client(host, port, f"wren-leftovers-{secrets.token_hex(4)}", clean=True)
    try:
        return c.retained_under(prefix)
    finally:
        c.close()


def end_session(host: str, port: int, client_id: str) -> None:
    """Connect once as client_id with a clean session, which ends the one kept."""
    _Client(host, port, client_id, clean=True).close()


def devices(prefix: str, topics: Iterable[str]) -> set[str]:
    """The device ids of retained board topics, prefix/d/<device>/...: a board's device id
    is its client id, and its session is persistent."""
    found = set()
    for t in topics:
        parts = t[len(prefix) + 1 :].split("/")
        if t.startswith(prefix + "/") and len(parts) >= 3 and parts[0] == "d":
            found.add(parts[1])
    return found


def clear(host: str, port: int, prefix: str, client_ids: Iterable[str]) -> Cleared:
    """End the sessions of client_ids, and of every board with a retained topic under
    prefix; then clear every retained message under prefix.

    Sessions first: taking over a client id that is still connected (a target that died
    mid-test) makes the broker publish its will, retained, which the clearing then finds.
    """
    done = Cleared()
    ids = set(client_ids) | devices(prefix, retained(host, port, prefix))
    for cid in sorted(ids):
        end_session(host, port, cid)
        done.sessions.append(cid)
    c = _Client(host, port, f"wren-leftovers-{secrets.token_hex(4)}", clean=True)
    try:
        left = c.retained_under(prefix)
        c.clear(left)
        done.retained = sorted(left)
    finally:
        c.close()
    return done
