"""Several bridges sharing one fleet (DESIGN "Where scale goes"): devices hashed into
partitions (`partitions.py`), and each partition leased in PostgreSQL to the one bridge
that serves it (`leases.py`: the lease keeper, and the fence every store write for a
device carries). What a bridge does with the partitions it holds (their MQTT sessions,
their devices' state) is the bridge's; this package only says which ones, and until
when it may act for them.
"""

from server_bridge.fleet.leases import (
    LEASE_S,
    ROUND_S,
    Fenced,
    FleetError,
    LeaseKeeper,
    LeaseSnapshot,
    PartitionCountMismatch,
    fence,
    join_fleet,
    release,
    take,
)
from server_bridge.fleet.partitions import (
    DEFAULT_PARTITIONS,
    MAX_PARTITIONS,
    check_partitions,
    devices_in,
    partition_client_id,
    partition_of,
)

__all__ = [
    "DEFAULT_PARTITIONS",
    "LEASE_S",
    "MAX_PARTITIONS",
    "ROUND_S",
    "Fenced",
    "FleetError",
    "LeaseKeeper",
    "LeaseSnapshot",
    "PartitionCountMismatch",
    "check_partitions",
    "devices_in",
    "fence",
    "join_fleet",
    "partition_client_id",
    "partition_of",
    "release",
    "take",
]
