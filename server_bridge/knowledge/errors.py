"""Every refusal of the knowledge API, each its own exception.

All are ValueErrors, each mapped once by the layer that answers for it: `wren kb`
(tools/kb.py) prints one line and exits 1; the boards' RPC (calls.py `_fault`) answers
NotFound `not_found`, QueryTooLarge `too_large`, InvalidK, InvalidName and InvalidOption
`bad_envelope`; the HTTP API (server_bridge/http/knowledge.py) 404, 413 and 400. A file
that cannot be ingested is not an exception to the caller but a `SkipFile` caught per
file and listed in the ingest summary with its reason.
"""

from __future__ import annotations

__all__ = [
    "InvalidK",
    "InvalidName",
    "InvalidOption",
    "KnowledgeError",
    "NotFound",
    "QueryTooLarge",
    "SkipFile",
]


class KnowledgeError(ValueError):
    """Base of the knowledge API's refusals."""


class InvalidName(KnowledgeError):
    """A tenant, collection, source id or tag that is empty, too long or malformed."""


class InvalidK(KnowledgeError):
    """`k` outside 1..MAX_K."""


class QueryTooLarge(KnowledgeError):
    """A query longer than MAX_QUERY_CHARS: refused, not cut, so no caller is answered
    for a question it did not ask."""


class InvalidOption(KnowledgeError):
    """Another argument out of range (a mode, a character limit, a chunk size)."""


class NotFound(KnowledgeError):
    """The collection or source named does not exist for this tenant."""


class SkipFile(Exception):  # noqa: N818 - a reason, not a failure of the caller
    """This file is not ingested; `str(e)` is the reason the summary shows."""
