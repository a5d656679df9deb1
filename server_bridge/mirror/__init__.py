"""The JSON mirror (`wren bridge --json-mirror TENANT`): each opted-in tenant's run
events, device presence and status, and each user's last answer, republished as JSON
under the tenant's host topics for the dashboards people already run (Node-RED, Home
Assistant). PROTOCOL.md "JSON mirror" is the contract; mirror.py says how it stays off
the relay's way; topics.py where it publishes; payloads.py what; runs.py what it keeps
of each run."""

from server_bridge.mirror.mirror import KIND, JsonMirror, both
from server_bridge.mirror.topics import (
    ANSWER,
    JSON,
    PRESENCE,
    STATUS,
    device_json_topic,
    user_json_topic,
)

__all__ = [
    "ANSWER",
    "JSON",
    "KIND",
    "PRESENCE",
    "STATUS",
    "JsonMirror",
    "both",
    "device_json_topic",
    "user_json_topic",
]
