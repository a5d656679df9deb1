"""Where the JSON mirror publishes (PROTOCOL.md "JSON mirror").

Each JSON topic sits beside the msgpack topic of the same events, with `json` in place
of `evt`, so whoever may read the one may read the other and no one else: the broker's
rights for both come from the same lines (brokerconf.HOST_READ and USER_READ grant
`evt` and `json/#` together).

- `P/h/T/D/json`: the device's own stream `"_"` (the board's refusals), as JSON;
- `P/h/T/D/json/presence` (retained): the device's presence as the bridge tells it;
- `P/h/T/D/json/status` (retained): the device's last status as the bridge keeps it;
- `P/h/T/D/u/U/json`: the events of user U's runs on D, as JSON (U `_`: the runs whose
  user the bridge does not know, for watchers only);
- `P/h/T/D/u/U/json/answer` (retained): the answer of U's latest run on D that ended
  `run.done`. Per user, never per device: an answer is its run's, and a device's
  other users may not read it.

The layout is built from topics.host_event_topic (which checks every level), never
written out again here.
"""

from __future__ import annotations

from server_bridge.topics import BadTopic, host_event_topic

__all__ = ["ANSWER", "JSON", "PRESENCE", "STATUS", "device_json_topic", "user_json_topic"]

JSON = "json"
PRESENCE = "presence"
STATUS = "status"
ANSWER = "answer"
_EVT = "evt"
_DEVICE_LEAVES = (None, PRESENCE, STATUS)
_USER_LEAVES = (None, ANSWER)


def _json(evt_topic: str, leaf: str | None) -> str:
    assert evt_topic.endswith("/" + _EVT)
    base = evt_topic[: -len(_EVT)] + JSON
    return base if leaf is None else f"{base}/{leaf}"


def device_json_topic(prefix: str, tenant: str, device: str, leaf: str | None = None) -> str:
    """P/h/T/D/json, or P/h/T/D/json/<leaf> (`presence`, `status`)."""
    if leaf not in _DEVICE_LEAVES:
        raise BadTopic(f"unknown device JSON leaf {leaf!r}")
    return _json(host_event_topic(prefix, tenant, device, None), leaf)


def user_json_topic(
    prefix: str, tenant: str, device: str, user: str, leaf: str | None = None
) -> str:
    """P/h/T/D/u/U/json, or P/h/T/D/u/U/json/answer; `user` a user id or UNOWNED."""
    if leaf not in _USER_LEAVES:
        raise BadTopic(f"unknown user JSON leaf {leaf!r}")
    return _json(host_event_topic(prefix, tenant, device, user), leaf)
