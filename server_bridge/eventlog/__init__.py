"""The durable event log: every event hosts receive, appended per tenant to segmented
files, so a run can be replayed after the bridge's in-memory window has let it go
(issue "Hosts over HTTP"; DESIGN.md "Events"). The bridge appends every event it
sends hosts (intake.py) and answers a host's replay from it where its in-memory window
no longer holds the run (bridge.py)."""

from .log import (
    DEFAULT_SEGMENT_BYTES,
    DEFAULT_SYNC_S,
    MAX_RECORD_BYTES,
    EventLog,
    EventLogError,
    LoggedEvent,
    LoggedRun,
    RecordTooLarge,
)
from .store import EventStore

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "DEFAULT_SYNC_S",
    "MAX_RECORD_BYTES",
    "EventLog",
    "EventLogError",
    "EventStore",
    "LoggedEvent",
    "LoggedRun",
    "RecordTooLarge",
]
