-- The durable event log (server_bridge/pgstore/eventlog.py; the file log it stands in
-- for is server_bridge/eventlog/log.py). Keys are text as the bridge names them (a NUL
-- or a '%' escaped, see _key in eventlog.py); times are Unix ms, the record's own.

-- One row per event. The key is the event's identity: a bridge that relays an event
-- another already stored (a failover) inserts nothing. `rec` is the msgpack record the
-- file log frames, [ts_ms, device, run, i, usr, conv, payload], so both backends read
-- one format.
CREATE TABLE wren_events (
    tenant text NOT NULL,
    device text NOT NULL,
    run text NOT NULL,
    i bigint NOT NULL,
    at_ms bigint NOT NULL,
    rec bytea NOT NULL,
    PRIMARY KEY (tenant, device, run, i)
);
-- Retention drops a tenant's oldest time range, and finds its newest event.
CREATE INDEX wren_events_age ON wren_events (tenant, at_ms);

-- What the file log's in-memory index knows of a run, kept by each flush in the
-- transaction that inserts its events (and recomputed by retention for the runs it
-- cuts): its user and conversation (the first its events named), lowest and highest
-- id, count, first and latest record time, bytes. `joined` and `active` say when the
-- run joined its conversation (a conversation's runs in that order) and when its latest
-- record came (conversations, the most recently active first): a flush's value of
-- wren_event_seq shifted left 20 bits, plus the record's place in the flush's batch.
CREATE TABLE wren_event_runs (
    tenant text NOT NULL,
    device text NOT NULL,
    run text NOT NULL,
    usr text,
    conv text,
    lo bigint NOT NULL,
    hi bigint NOT NULL,
    n bigint NOT NULL,
    first_ms bigint NOT NULL,
    last_ms bigint NOT NULL,
    bytes bigint NOT NULL,
    joined bigint,
    active bigint NOT NULL,
    PRIMARY KEY (tenant, device, run)
);
CREATE INDEX wren_event_runs_conv ON wren_event_runs (tenant, conv, joined)
    WHERE conv IS NOT NULL;

-- The tenants the log holds and the bytes of their records: tenants() and
-- tenant_bytes() without a scan, and the total retention by bytes starts from.
CREATE TABLE wren_event_tenants (
    tenant text PRIMARY KEY,
    bytes bigint NOT NULL DEFAULT 0
);

CREATE SEQUENCE wren_event_seq;
