"""Document knowledge on the bridge: ingest, update, delete and retrieve, per tenant.

The public face is `KnowledgeBase` (service.py) and the connectors (sources.py);
extract, chunk, store and index are its parts, one module each. DESIGN "Knowledge"
says what is built and what is planned.
"""

from .errors import (
    InvalidK,
    InvalidName,
    InvalidOption,
    KnowledgeError,
    NotFound,
    QueryTooLarge,
    SkipFile,
)
from .service import (
    DEFAULT_MAX_CHARS,
    DEFAULT_MAX_FILE_BYTES,
    MAX_K,
    MAX_QUERY_CHARS,
    CollectionInfo,
    FileResult,
    Hit,
    IngestSummary,
    KnowledgeBase,
    Mode,
    Progress,
    Retrieval,
)
from .sources import (
    DEFAULT_EXTENSIONS,
    Connector,
    Document,
    FileList,
    Folder,
    Item,
    Query,
    Record,
    Records,
    Skipped,
)

__all__ = [
    "DEFAULT_EXTENSIONS",
    "DEFAULT_MAX_CHARS",
    "DEFAULT_MAX_FILE_BYTES",
    "MAX_K",
    "MAX_QUERY_CHARS",
    "CollectionInfo",
    "Connector",
    "Document",
    "FileList",
    "FileResult",
    "Folder",
    "Hit",
    "IngestSummary",
    "InvalidK",
    "InvalidName",
    "InvalidOption",
    "Item",
    "KnowledgeBase",
    "KnowledgeError",
    "Mode",
    "NotFound",
    "Progress",
    "Query",
    "QueryTooLarge",
    "Record",
    "Records",
    "Retrieval",
    "SkipFile",
    "Skipped",
]
