"""Durable memory on the bridge: declared fields, collections of rows, core-memory
backups and the write-id ledger (docs/PROTOCOL.md, "Memory and durable state").

- `errors`: the refusals, one exception per contract error kind.
- `merge`: the merge policies as one table of pure functions.
- `store`: the persistence interface and its TinyDB default, sharded per scope.
- `service`: the `state.*`, `mem.*` and `core.*` methods over a store.
"""

from server_bridge.memory.errors import MemoryFault
from server_bridge.memory.service import Caller, FieldDecl, MemoryService, RecallIndex
from server_bridge.memory.store import MemoryStore, ScopeRef, TinyMemoryStore

__all__ = [
    "Caller",
    "FieldDecl",
    "MemoryFault",
    "MemoryService",
    "MemoryStore",
    "RecallIndex",
    "ScopeRef",
    "TinyMemoryStore",
]
