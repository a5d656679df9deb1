-- Partitions of a fleet's devices and who serves each (DESIGN "Where scale goes").
-- expires_at is the database's clock, never a bridge's; epoch grows at every change of
-- owner and fences every write made for the partition's devices.
CREATE TABLE wren_fleet (
    prefix text PRIMARY KEY,
    fleet_id text NOT NULL,
    partitions integer NOT NULL CHECK (partitions > 0),
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE wren_leases (
    prefix text NOT NULL REFERENCES wren_fleet (prefix),
    part integer NOT NULL CHECK (part >= 0),
    owner text,
    epoch bigint NOT NULL DEFAULT 0,
    expires_at timestamptz NOT NULL DEFAULT '-infinity',
    PRIMARY KEY (prefix, part)
);

CREATE TABLE wren_bridges (
    prefix text NOT NULL REFERENCES wren_fleet (prefix),
    bridge text NOT NULL,
    seen_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (prefix, bridge)
);
