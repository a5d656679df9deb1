-- Durable memory (server_bridge/pgstore/memory.py; why this layout is in its docstring).
-- Records, metas, ledger entries and device ledgers are JSON held as text: the exact
-- text Python's json module wrote, as a TinyDB shard file holds it (NaN, key order and
-- \u0000 come back as they went in; jsonb refuses the first and the last and reorders
-- keys). `rec::jsonb` reads them in SQL where none of that occurs.

-- One row per scope instance. `sid` keys everything else (8 bytes in place of three
-- strings in every index); `ver` grows by one with every commit to the scope, so a
-- bridge knows whether the shards it holds in memory are still the database's.
CREATE TABLE wren_mem_scopes (
    sid bigint GENERATED ALWAYS AS IDENTITY UNIQUE,
    tenant text NOT NULL,
    scope text NOT NULL,
    scope_id text NOT NULL,
    ver bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, scope, scope_id)
);

-- One row per shard (the scope's slots, or one collection field): its meta record,
-- the bytes its sized records hold, how many ledger entries it keeps and a lower bound
-- of their `at` (so the ledger is searched for expired entries only when one may be).
CREATE TABLE wren_mem_shards (
    sid bigint NOT NULL,
    shard text NOT NULL,
    meta text NOT NULL,
    usage bigint NOT NULL DEFAULT 0,
    nw integer NOT NULL DEFAULT 0,
    w_min_at double precision,
    PRIMARY KEY (sid, shard)
);

-- Every record of every table of a shard (slots, rows, core, tomb, ...). `n` is the
-- order of the last write to it (the scope's ver << 20, plus its place in the commit),
-- which is the order a TinyDB table keeps.
CREATE TABLE wren_mem_records (
    sid bigint NOT NULL,
    shard text NOT NULL,
    tbl text NOT NULL,
    id text NOT NULL,
    n bigint NOT NULL,
    rec text NOT NULL,
    PRIMARY KEY (sid, shard, tbl, id)
);

-- Each shard's write-id ledger. The key starts with (tenant, device, w): a write id is
-- found whatever shard it was applied to; the second index is the shard's ledger in
-- order, oldest first, for the cap.
CREATE TABLE wren_mem_writes (
    tenant text NOT NULL,
    device text NOT NULL,
    w text NOT NULL,
    sid bigint NOT NULL,
    shard text NOT NULL,
    n bigint NOT NULL,
    at double precision NOT NULL,
    entry text NOT NULL,
    PRIMARY KEY (tenant, device, w, sid, shard)
);
CREATE INDEX wren_mem_writes_order ON wren_mem_writes (sid, shard, n);

-- The per-device ledger (server_bridge/memory/ledger.py), one document per device,
-- rewritten whole by the transaction of each write of the device.
CREATE TABLE wren_mem_devices (
    tenant text NOT NULL,
    device text NOT NULL,
    ver bigint NOT NULL DEFAULT 0,
    doc text NOT NULL,
    PRIMARY KEY (tenant, device)
);
