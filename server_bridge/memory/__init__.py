"""Durable memory on the bridge: declared fields, collections of rows, core-memory
backups, the write-id ledger and recall (docs/PROTOCOL.md, "Memory and durable state").

- `errors`: the refusals, one exception per contract error kind.
- `merge`: the merge policies as one table of pure functions.
- `store`: the persistence interface and its TinyDB default, sharded per scope.
- `ledger`: each device's write-id ledger, which write ids were applied, bounded, so a
  replay however late applies nothing.
- `grants`: which agents of a tenant may read or write which `tenant` fields (the
  registry keeps them, the service checks them).
- `service`: the `state.*`, `mem.*` and `core.*` methods over a store.
- `recall`: the search index beside the store (BM25, MiniLM when installed), rebuilt
  from it, never the source of truth.
- `calls`: the methods as RPC handlers: who is calling, from the registry, the
  device's hello and the request's scope ticket.
"""

import os
from typing import Any

from server_bridge.memory.errors import MemoryFault
from server_bridge.memory.grants import Grants
from server_bridge.memory.service import Caller, FieldDecl, MemoryService, SearchIndex
from server_bridge.memory.store import MemoryStore, ScopeRef, TinyMemoryStore

__all__ = [
    "Caller",
    "FieldDecl",
    "Grants",
    "MemoryFault",
    "MemoryService",
    "MemoryStore",
    "ScopeRef",
    "SearchIndex",
    "TinyMemoryStore",
    "open_memory",
]


def open_memory(directory: str | os.PathLike[str], embedder: Any = "auto") -> MemoryService:
    """The durable memory kept under `directory`, with its recall index beside it
    (`embedder` as RecallIndex takes it: "auto" is MiniLM when installed, None BM25)."""
    from server_bridge.memory.recall import RecallIndex

    return MemoryService(TinyMemoryStore(directory), index=RecallIndex(embedder))
