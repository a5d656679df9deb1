"""The host side: the snapshot reducer, a terminal view and a Python host client."""

from server_bridge.host.client import (
    BrokerRefused,
    HostClient,
    HostConnectError,
    NotConnected,
    RequestRefused,
    Unacknowledged,
)
from server_bridge.host.reducer import BadEnvelope, Reducer, Row, RunSnapshot, Usage
from server_bridge.host.terminal import LiveView, print_transcript, render

__all__ = [
    "BadEnvelope",
    "BrokerRefused",
    "HostClient",
    "HostConnectError",
    "LiveView",
    "NotConnected",
    "Reducer",
    "RequestRefused",
    "Row",
    "RunSnapshot",
    "Unacknowledged",
    "Usage",
    "print_transcript",
    "render",
]
