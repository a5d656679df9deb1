"""The durable event log: every event hosts receive, appended per tenant to segmented
files, so a run can be replayed after the bridge's in-memory window has let it go
(issue "Hosts over HTTP"; DESIGN.md "Events"). [partly built: the log itself, tested
in tests/test_eventlog.py; the bridge does not append to it yet]"""

from .log import (
    DEFAULT_SEGMENT_BYTES,
    DEFAULT_SYNC_S,
    MAX_RECORD_BYTES,
    EventLog,
    EventLogError,
    LoggedEvent,
    RecordTooLarge,
)

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "DEFAULT_SYNC_S",
    "MAX_RECORD_BYTES",
    "EventLog",
    "EventLogError",
    "LoggedEvent",
    "RecordTooLarge",
]
