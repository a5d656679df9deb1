"""The HTTP API's refusal: an HTTP status, the kind of docs/PROTOCOL.md "Errors" and a
message, answered as `{error: kind, message}` by the app's handler (app.py)."""

from __future__ import annotations

__all__ = ["Refused"]


class Refused(Exception):
    def __init__(self, status: int, kind: str, msg: str) -> None:
        super().__init__(msg)
        self.status, self.kind, self.msg = status, kind, msg
