-- The registry (server_bridge/pgstore/registry.py; the rules are server_bridge/registry.py's):
-- tenants, devices, broker users, agents' and end users' grants. The rules that keep it
-- consistent are constraints here, so two bridges writing at once cannot break them
-- whatever the code above does; the code checks first only to say what is wrong in the
-- words the file registry uses.

-- One row, its `ver` bumped by every write transaction, first: the row lock makes
-- writes take turns, and a reader compares one bigint to know whether its snapshot is
-- still the database's.
CREATE TABLE wren_reg_version (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    ver bigint NOT NULL DEFAULT 0
);
INSERT INTO wren_reg_version (one, ver) VALUES (true, 0);

-- Token secrets, hex. A tenant name is not in the broker's name space (below).
CREATE TABLE wren_reg_tenants (
    tenant text PRIMARY KEY,
    secret text NOT NULL
);

-- The broker's one name space: device ids, broker user names and the names of a bridge
-- user's sibling users (`<user>.ctl`, `<user>.l1`...), which are not users of their own
-- but must not be anyone else's (the ACL written for the bridge would apply to them).
-- A device and its own broker user share one row (kind 'device'). `owner` is the name
-- itself, or for a sibling the bridge user it belongs to.
CREATE TABLE wren_reg_names (
    name text PRIMARY KEY,
    kind text NOT NULL CHECK (kind IN ('device', 'user', 'sibling')),
    owner text NOT NULL,
    UNIQUE (name, kind),
    CHECK ((kind = 'sibling') = (owner <> name))
);

-- Devices. Their name row goes with them (deleting the name deletes the device).
CREATE TABLE wren_reg_devices (
    device text PRIMARY KEY,
    kind text NOT NULL DEFAULT 'device' CHECK (kind = 'device'),
    tenant text NOT NULL REFERENCES wren_reg_tenants (tenant),
    agent text NOT NULL,
    FOREIGN KEY (device, kind) REFERENCES wren_reg_names (name, kind) ON DELETE CASCADE,
    -- For the device users' foreign key below.
    UNIQUE (device, tenant)
);

-- Broker users: `kind` says which name row is theirs (a device user shares its
-- device's); a device user exists only with its device, in the device's tenant, and
-- goes when the device goes (`dev` is its name for that key, NULL for other roles).
CREATE TABLE wren_reg_users (
    "user" text PRIMARY KEY,
    role text NOT NULL CHECK (role IN ('bridge', 'host', 'device')),
    kind text NOT NULL CHECK (kind = CASE WHEN role = 'device' THEN 'device' ELSE 'user' END),
    tenant text REFERENCES wren_reg_tenants (tenant),
    hash text NOT NULL,
    usr text CHECK (usr IS NULL OR role = 'host'),
    dev text GENERATED ALWAYS AS (CASE WHEN role = 'device' THEN "user" END) STORED,
    CHECK ((role = 'bridge') = (tenant IS NULL)),
    FOREIGN KEY ("user", kind) REFERENCES wren_reg_names (name, kind) ON DELETE CASCADE,
    FOREIGN KEY (dev, tenant) REFERENCES wren_reg_devices (device, tenant) ON DELETE CASCADE
);

-- A sibling's name row goes with its bridge user.
ALTER TABLE wren_reg_names ADD CONSTRAINT wren_reg_names_owner
    FOREIGN KEY (owner) REFERENCES wren_reg_names (name) ON DELETE CASCADE;

-- Which agents of a tenant may use which of its memory fields: one row per field.
CREATE TABLE wren_reg_grants (
    tenant text NOT NULL REFERENCES wren_reg_tenants (tenant),
    agent text NOT NULL,
    field text NOT NULL,
    access text NOT NULL CHECK (access IN ('read', 'write')),
    PRIMARY KEY (tenant, agent, field)
);

-- Which end users of a tenant may read or write which knowledge collections.
CREATE TABLE wren_reg_user_grants (
    tenant text NOT NULL REFERENCES wren_reg_tenants (tenant),
    usr text NOT NULL,
    field text NOT NULL,
    access text NOT NULL CHECK (access IN ('read', 'write')),
    PRIMARY KEY (tenant, usr, field)
);
