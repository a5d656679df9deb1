-- The RPC calls a fleet's bridges have open (DESIGN "Where scale goes", "Failover"):
-- a row from the moment a bridge starts serving a call to its final answer, written
-- under the partition's lease epoch, so the next owner of the partition can answer by
-- id the calls a dead owner left open.
CREATE TABLE wren_open_calls (
    prefix text NOT NULL,
    part integer NOT NULL CHECK (part >= 0),
    device text NOT NULL,
    -- A board's call id is an integer or a short string; kept as the msgpack it came
    -- in would be ambiguous, so as text with its type.
    call_id text NOT NULL,
    call_is_int boolean NOT NULL,
    method text NOT NULL,
    run text,
    fail_kind text NOT NULL,
    epoch bigint NOT NULL,
    opened_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (prefix, device, call_id, call_is_int)
);

-- The next owner's question at a take: the partition's rows of earlier epochs.
CREATE INDEX wren_open_calls_part ON wren_open_calls (prefix, part, epoch);
