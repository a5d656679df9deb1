"""Memory and durable state on the bridge: fields, rows, the write-id ledger and recall."""
