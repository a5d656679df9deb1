"""Which connection of the bridge reads which board: tenants dealt to links.

Mosquitto keeps one queue per client connection, first in first out. With one
connection reading every board, a tenant whose devices flood (valid runs, junk events,
junk RPC calls: tens of thousands of messages a second) filled that queue, up to the
broker's max_queued_messages (100,000), and a quiet tenant's model call and events
waited behind all of it: 7.6 s to the first words of a request, against 5 ms unloaded
(bench_bridge figure 4, the mixed flood). Nothing the bridge does after it has read a
message can win that back: the wait is in the broker, before the bridge sees anything.

So the bridge reads boards on up to `tenant_links` connections (links), each a queue of
its own at the broker, and deals the tenants to them in turn (sorted by name: tenant k
on link k mod L). A flood then fills only its own link's queue; the tenants on the
other links are read as they come. Up to L tenants each have a link of their own; past
that, tenants share links, and a flood slows the tenants sharing its link (a fleet
with more tenants than that needs more bridge processes: issue "Past one machine").

Each link also publishes its tenants' events to hosts (an event channel of its own in the
outbox, lanes.py). What the bridge says to boards and on `_b`, and the bridge's
presence, stay on the control connection; hosts' `req` and `ctl` are read there too.

A link subscribes to its tenants' boards by name (P/d/<device>/rpc, evt, hello and
status), since a board's topics do not name its tenant. So the bridge reads only the
boards the registry has: a device the registry does not know is not read at all (its
calls time out at the board), where the one-link layout (`tenant_links` 1, wildcards)
refuses it `unknown_device`. The registry is read again every second and whenever a
host asks for a device the links do not read yet; a device added, moved (a tenant added
before it shifts the deal) or removed is subscribed on its new link before it is
unsubscribed from its old one, so nothing falls between the two: a message may come on
both once, which everything the bridge reads survives (PROTOCOL.md "At least once"). A
board's hello and status are retained, so a board that came online just before its
link subscribed is known at once.

The sessions are persistent, so a link's session may hold subscriptions its link no
longer wants (a deal changed while the bridge was stopped, the one-link layout's
wildcards): each link unsubscribes at every connect all the topics that are not its own
(`LinkPlan.not_for`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import paho.mqtt.client as mqtt

from server_bridge.fleet.partitions import check_partitions, partition_of
from server_bridge.registry import DeviceRecord

__all__ = ["DEVICE_LEAVES", "HOST_INPUT", "LinkPlan", "PartitionLinks", "PartitionPlan"]

log = logging.getLogger("wren.bridge.links")

# What the bridge reads of each board.
DEVICE_LEAVES = ("rpc", "evt", "hello", "status")
# What the bridge reads of a device's hosts (their input), in fleet mode per device.
HOST_INPUT = ("req", "ctl")
# Topics per SUBSCRIBE or UNSUBSCRIBE packet: a fleet's worth in one packet is large.
BATCH = 512


class LinkPlan:
    """The topics each link reads, from the registry's devices. Pure: the bridge keeps
    what it has subscribed and asks for the difference."""

    def __init__(self, prefix: str, links: int, share: bool) -> None:
        if links < 1:
            raise ValueError("links must be >= 1")
        self.prefix = prefix
        self.links = links
        # With several bridge processes sharing the calls (config.shared_subscription),
        # a board's rpc is read through the shared group.
        self._share = "$share/bridge/" if share else ""

    def device_topics(self, device: str) -> list[str]:
        p = self.prefix
        return [
            f"{self._share}{p}/d/{device}/rpc" if leaf == "rpc" else f"{p}/d/{device}/{leaf}"
            for leaf in DEVICE_LEAVES
        ]

    def wildcards(self) -> list[str]:
        """The one-link layout's board subscriptions, in both forms of rpc."""
        p = self.prefix
        return [f"$share/bridge/{p}/d/+/rpc", *(f"{p}/d/+/{leaf}" for leaf in DEVICE_LEAVES)]

    def link_of(self, devices: Iterable[DeviceRecord]) -> dict[str, int]:
        """Each tenant's link: tenant k (sorted by name, of those with devices) on link
        k mod links."""
        tenants = sorted({d.tenant for d in devices})
        return {tenant: k % self.links for k, tenant in enumerate(tenants)}

    def deal(self, devices: Iterable[DeviceRecord]) -> list[set[str]]:
        """Each link's topics: its tenants' boards (link_of)."""
        devices = list(devices)
        link_of = self.link_of(devices)
        out: list[set[str]] = [set() for _ in range(self.links)]
        for d in devices:
            out[link_of[d.tenant]].update(self.device_topics(d.device))
        return out

    def not_for(self, link: int, deal: list[set[str]]) -> list[str]:
        """What link `link` unsubscribes at connect: the wildcards and every other
        link's topics (module docstring)."""
        others = {topic for k, topics in enumerate(deal) if k != link for topic in topics}
        return [*self.wildcards(), *sorted(others - deal[link])]


def batches(topics: list[str]) -> list[list[str]]:
    """`topics` in packets of at most BATCH."""
    return [topics[i : i + BATCH] for i in range(0, len(topics), BATCH)]


# ---------------------------------------------------------------------- fleet mode
#
# With several bridge processes on one prefix (`BridgeConfig.fleet_dsn`, DESIGN "Where
# scale goes") the links are the fleet's partitions, not tenants: link k reads the
# devices with `partition_of(device, P) == k`, and connects only while this bridge holds
# partition k's lease (server_bridge/fleet). Its client id is the partition's, the same
# in every bridge of the fleet, and its session persistent, so what arrives while the
# partition changes hands, or while no bridge holds it, waits in that session at the
# broker and the next owner takes it over. That includes the hosts' `req` and `ctl` of
# those devices (`P/h/<tenant>/<device>/req`, `ctl`): read by the partition, a host's
# request waits with the board's traffic instead of reaching a bridge that does not
# serve the board. A device never changes partition (P is fixed for a fleet's life), so
# a registry change only adds or removes a device's topics on its one partition.


class PartitionPlan:
    """The topics each partition's link reads, from the registry's devices. Pure."""

    def __init__(self, prefix: str, partitions: int) -> None:
        self.prefix = prefix
        self.partitions = check_partitions(partitions)

    def device_topics(self, device: DeviceRecord) -> list[str]:
        """A device's board topics (DEVICE_LEAVES) and its tenant's host input for it."""
        p, d = self.prefix, device.device
        return [
            *(f"{p}/d/{d}/{leaf}" for leaf in DEVICE_LEAVES),
            *(f"{p}/h/{device.tenant}/{d}/{leaf}" for leaf in HOST_INPUT),
        ]

    def deal(self, devices: Iterable[DeviceRecord]) -> list[set[str]]:
        """Each partition's topics."""
        out: list[set[str]] = [set() for _ in range(self.partitions)]
        for d in devices:
            out[partition_of(d.device, self.partitions)].update(self.device_topics(d))
        return out


# How long after a partition's connection dropped (the broker closed it, or the network)
# its link waits before connecting again while the lease is still this bridge's. The
# broker closes a session's connection when another connects with its client id: if that
# was another bridge, the lease has moved and the next renewal says so (on_loss) well
# within this; if not (a network blip), the partition is back in a second.
RECONNECT_AFTER_S = 1.0
# A partition's subscriptions that the broker refused (a cluster node that cannot make
# them yet: NATS answers a JetStream consumer it could not create in time so) are made
# again after RESUBSCRIBE_S, then with doubling waits up to MAX_RESUBSCRIBE_S, each
# refusal logged: the partition's boards would otherwise go unread until a reconnect.
RESUBSCRIBE_S = 1.0
MAX_RESUBSCRIBE_S = 30.0


class _Part:
    """One held partition's connection."""

    __slots__ = ("client", "epoch", "up", "down_at", "subscribed", "again_at", "again_wait")

    def __init__(self, client: mqtt.Client, epoch: int) -> None:
        self.client = client
        self.epoch = epoch
        self.up = False
        self.down_at: float | None = None  # when the broker closed it, if it did
        self.subscribed: set[str] = set()
        # After a refused subscription: when to subscribe again, and the wait after that.
        self.again_at: float | None = None
        self.again_wait = RESUBSCRIBE_S


class PartitionLinks:
    """The connections of the partitions this bridge holds (fleet mode).

    `gain` and `lose` are the lease keeper's callbacks (its thread); `refresh` and `tick`
    the housekeeping thread's; the paho callbacks each link's network thread's. State is
    under one lock, never held while paho is called (paho holds its own locks around our
    callbacks, which take this one). A callback of a client that is no longer the
    partition's (`client is part.client`) changes nothing: a stale connection ends by
    itself.

    A link's connection is never reconnected by paho (`make` builds it with
    reconnect_on_failure off): when the broker closes it, most likely because another
    bridge connected with the partition's client id, the link stops serving and the
    lease decides (`tick`): still held a round later, it connects again; taken, the
    keeper's on_loss ends it. paho's automatic reconnect made two bridges knock each
    other off in turn.
    """

    def __init__(
        self,
        plan: PartitionPlan,
        make: Callable[[int], mqtt.Client],
        connect: Callable[[mqtt.Client], None],
        devices: Callable[[], Iterable[DeviceRecord]],
        holds: Callable[[int], int | None],
        count: Callable[[str], None],
    ) -> None:
        self.plan = plan
        self._make = make
        self._connect = connect
        self._devices = devices
        self._holds = holds
        self._count = count
        self._lock = threading.Lock()
        self._parts: dict[int, _Part] = {}
        self._deal: list[set[str]] = [set() for _ in range(plan.partitions)]
        self._closed = False

    # ------------------------------------------------------------------ public face

    def held(self) -> list[int]:
        """The partitions this bridge serves now, sorted (connected or connecting)."""
        with self._lock:
            return sorted(self._parts)

    def up(self, part: int) -> bool:
        with self._lock:
            p = self._parts.get(part)
            return p is not None and p.up

    def reads(self, device: str) -> bool:
        """Whether a connection of this bridge reads `device` now."""
        return self.up(partition_of(device, self.plan.partitions))

    def topics(self, part: int) -> list[str]:
        """What partition `part`'s link reads, sorted."""
        with self._lock:
            return sorted(self._deal[part])

    def gain(self, part: int, epoch: int) -> None:
        """The keeper took `part`: connect its session (and subscribe, at CONNACK)."""
        self._refresh_deal()
        client = self._make(part)
        with self._lock:
            if self._closed:
                return
            old = self._parts.pop(part, None)
            self._parts[part] = _Part(client, epoch)
        if old is not None:
            _end(old.client)
        self._connect(client)
        self._count("fleet.partitions_gained")

    def lose(self, part: int, epoch: int) -> None:
        """The keeper lost `part` (or gives it back): stop reading it and DISCONNECT.
        The session stays at the broker with its subscriptions, and what arrives
        meanwhile waits there for the next owner."""
        with self._lock:
            p = self._parts.get(part)
            if p is None or p.epoch != epoch:
                return
            del self._parts[part]
        _end(p.client)
        self._count("fleet.partitions_lost")

    def close(self) -> None:
        """End every link (the bridge stops; the keeper has said on_loss already when it
        gives the leases back, so this ends what a failed start left)."""
        with self._lock:
            self._closed = True
            parts, self._parts = list(self._parts.values()), {}
        for p in parts:
            _end(p.client)

    def refresh(self) -> None:
        """Deal the registry's devices again and subscribe each connected link to what it
        gained, unsubscribe what it lost (a device removed, or moved to another
        tenant: its host topics change). A device never moves between partitions, so
        nothing is read on two links or on none."""
        self._refresh_deal()
        with self._lock:
            work = [(p.client, sorted(self._deal[k] - p.subscribed),
                     sorted(p.subscribed - self._deal[k]), p)
                    for k, p in self._parts.items() if p.up]  # fmt: skip
            for _, gained, lost, p in work:
                p.subscribed.update(gained)
                p.subscribed.difference_update(lost)
        for client, gained, lost, _ in work:
            for batch in batches(gained):
                client.subscribe([(topic, 1) for topic in batch])
            for batch in batches(lost):
                client.unsubscribe(batch)

    def tick(self, now: float) -> None:
        """Connect again a partition whose connection the broker closed, once
        RECONNECT_AFTER_S has passed and the lease is still this bridge's; subscribe
        again one whose subscriptions the broker refused, once its wait is over."""
        again: list[tuple[int, _Part]] = []
        resubscribe: list[tuple[mqtt.Client, list[str]]] = []
        with self._lock:
            for k, p in self._parts.items():
                if p.down_at is not None and now - p.down_at >= RECONNECT_AFTER_S:
                    again.append((k, p))
                elif p.up and p.again_at is not None and p.again_at <= now:
                    # Until its SUBACK says: refused again (a new wait) or granted.
                    p.again_at = now + MAX_RESUBSCRIBE_S
                    resubscribe.append((p.client, sorted(self._deal[k])))
        for client, wants in resubscribe:
            for batch in batches(wants):
                client.subscribe([(topic, 1) for topic in batch])
        for k, p in again:
            if self._holds(k) != p.epoch:
                continue  # the keeper's on_loss ends it (or has, meanwhile)
            client = self._make(k)
            with self._lock:
                # Only if it is still the same hold: a lose() meanwhile removed it, and
                # one after this swap ends the new client.
                if self._closed or self._parts.get(k) is not p:
                    continue
                self._parts[k] = _Part(client, p.epoch)
            _end(p.client)
            log.info("partition %d: connecting again (its lease is still ours)", k)
            self._count("fleet.reconnects")
            self._connect(client)

    # ------------------------------------------------------------------ paho callbacks

    def on_connect(
        self, client: mqtt.Client, part: int, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        if reason_code.is_failure:
            log.error("the broker refused partition %d's connection: %s", part, reason_code)
            self._dropped(client, part)
            return
        with self._lock:
            p = self._parts.get(part)
            if p is None or p.client is not client:
                return
            p.up = True
            p.down_at = None
            # Subscribed on every connect: a session taken over already holds them (and
            # the broker then only sends the retained hello and status again, which a new
            # owner needs), but a first owner's, or one the broker lost, does not.
            wants = sorted(self._deal[part])
            p.subscribed = set(wants)
        self._count("fleet.connects")
        if flags.session_present:
            self._count("fleet.sessions_taken_over")
        for batch in batches(wants):
            client.subscribe([(topic, 1) for topic in batch])

    def on_disconnect(
        self, client: mqtt.Client, part: int, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        if self._dropped(client, part):
            log.warning("partition %d's connection was closed (%s): another bridge took its "
                        "session over, or the network; not reconnected, the lease decides",
                        part, reason_code)  # fmt: skip
            self._count("fleet.dropped")

    def on_subscribe(
        self, client: mqtt.Client, part: int, mid: int, reason_codes: Any, properties: Any
    ) -> None:
        refused = [str(rc) for rc in reason_codes if rc.is_failure]
        with self._lock:
            p = self._parts.get(part)
            if p is None or p.client is not client:
                return  # a connection no longer the partition's
            wait = p.again_wait
            if refused:
                p.again_at = time.monotonic() + wait
                p.again_wait = min(wait * 2, MAX_RESUBSCRIBE_S)
            elif p.again_at is not None:
                p.again_at = None
                p.again_wait = RESUBSCRIBE_S
                log.info("the broker granted partition %d's subscriptions again", part)
        if refused:
            log.error("the broker refused partition %d's subscriptions: %s; subscribing again "
                      "in %.0f s", part, refused, wait)  # fmt: skip
            self._count("link.refused_subscriptions")

    def _dropped(self, client: mqtt.Client, part: int) -> bool:
        """Mark the partition's connection down, if `client` is still its; whether it was."""
        with self._lock:
            p = self._parts.get(part)
            if p is None or p.client is not client or p.down_at is not None:
                return False
            p.up = False
            p.down_at = time.monotonic()
            return True

    def _refresh_deal(self) -> None:
        deal = self.plan.deal(self._devices())
        with self._lock:
            self._deal = deal


def _end(client: mqtt.Client) -> None:
    """DISCONNECT (the session stays) and stop the network thread. Never from that
    thread itself: loop_stop would not wait for it, which is harmless."""
    client.disconnect()
    client.loop_stop()
