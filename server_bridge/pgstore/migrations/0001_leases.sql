-- Partitions of a fleet's devices and who serves each (DESIGN "Where scale goes";
-- server_bridge/fleet/leases.py). expires_at is the database's clock, never a bridge's;
-- epoch grows at every take and fences every write made for the partition's devices.

-- One row per fleet (an MQTT topic prefix), made by its first bridge. The partition
-- count is fixed for the fleet's life: a device never changes partition.
CREATE TABLE wren_fleet (
    prefix text PRIMARY KEY,
    fleet_id text NOT NULL,
    partitions integer NOT NULL CHECK (partitions > 0),
    created_at timestamptz NOT NULL DEFAULT now()
);

-- One row per partition, made with the fleet. owner is NULL when released; a row whose
-- expires_at has passed is free to take whatever its owner says.
CREATE TABLE wren_leases (
    prefix text NOT NULL REFERENCES wren_fleet (prefix),
    part integer NOT NULL CHECK (part >= 0),
    owner text,
    epoch bigint NOT NULL DEFAULT 0 CHECK (epoch >= 0),
    expires_at timestamptz NOT NULL DEFAULT '-infinity',
    PRIMARY KEY (prefix, part),
    -- Not for lookups: it makes epoch a key column, so an UPDATE that changes it (a
    -- take) needs the row's FOR UPDATE lock, which waits for every transaction holding
    -- FOR KEY SHARE on it (the store's fence), while a renewal, changing expires_at
    -- only, takes FOR NO KEY UPDATE and waits for none of them.
    UNIQUE (prefix, part, epoch)
);

-- The bridges of a fleet that are alive: seen_at is renewed every round, and a bridge
-- not seen for a lease is not counted when shares are worked out.
CREATE TABLE wren_bridges (
    prefix text NOT NULL REFERENCES wren_fleet (prefix),
    bridge text NOT NULL,
    seen_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (prefix, bridge)
);
