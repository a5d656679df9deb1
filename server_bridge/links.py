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

from collections.abc import Iterable

from server_bridge.registry import DeviceRecord

__all__ = ["DEVICE_LEAVES", "LinkPlan"]

# What the bridge reads of each board.
DEVICE_LEAVES = ("rpc", "evt", "hello", "status")
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
