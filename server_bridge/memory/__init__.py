"""Durable memory on the bridge: declared fields, collections of rows, core-memory
backups, the write-id ledger and recall (docs/PROTOCOL.md, "Memory and durable state").

- `errors`: the refusals, one exception per contract error kind.
- `merge`: the merge policies as one table of pure functions.
- `store`: the persistence interface and its TinyDB default, sharded per scope.
- `service`: the `state.*`, `mem.*` and `core.*` methods over a store.
- `recall`: the search index beside the store (BM25, MiniLM when installed), rebuilt
  from it, never the source of truth.
- `calls`: the methods as RPC handlers: who is calling, from the registry, the
  device's hello and the request's scope ticket.
"""

from server_bridge.memory.errors import MemoryFault
from server_bridge.memory.service import Caller, FieldDecl, MemoryService, SearchIndex
from server_bridge.memory.store import MemoryStore, ScopeRef, TinyMemoryStore

__all__ = [
    "Caller",
    "FieldDecl",
    "MemoryFault",
    "MemoryService",
    "MemoryStore",
    "ScopeRef",
    "SearchIndex",
    "TinyMemoryStore",
]
