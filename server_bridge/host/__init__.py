"""The host side: the snapshot reducer, a terminal view, a Python host client over MQTT
and one over HTTP, and client tools answered by the host's own functions."""

from server_bridge.host.client import (
    BrokerRefused,
    HostClient,
    HostConnectError,
    NotConnected,
    RequestRefused,
    Unacknowledged,
)
from server_bridge.host.http_client import (
    ConversationWindow,
    HttpAuthError,
    HttpBusy,
    HttpError,
    HttpForbidden,
    HttpHost,
    HttpNotFound,
    HttpRateLimited,
    HttpUnavailable,
    RunFollow,
    StreamError,
)
from server_bridge.host.reducer import BadEnvelope, Reducer, Row, RunSnapshot, Usage
from server_bridge.host.terminal import LiveView, print_transcript, render
from server_bridge.host.tools import (
    DELIVERY_STATES,
    ToolError,
    ToolHandlers,
    ToolRunner,
    ToolsBusy,
)

__all__ = [
    "DELIVERY_STATES",
    "BadEnvelope",
    "BrokerRefused",
    "ConversationWindow",
    "HostClient",
    "HostConnectError",
    "HttpAuthError",
    "HttpBusy",
    "HttpError",
    "HttpForbidden",
    "HttpHost",
    "HttpNotFound",
    "HttpRateLimited",
    "HttpUnavailable",
    "LiveView",
    "NotConnected",
    "Reducer",
    "RequestRefused",
    "Row",
    "RunFollow",
    "RunSnapshot",
    "StreamError",
    "ToolError",
    "ToolHandlers",
    "ToolRunner",
    "ToolsBusy",
    "Unacknowledged",
    "Usage",
    "print_transcript",
    "render",
]
