"""Which partition a device is in, and what a partition is called at the broker.

A device's partition is `crc32(device id, UTF-8) mod P`: stable across processes,
machines and Python versions (unlike `hash()`), cheap, and even enough for ids that
differ only in a counter. P is fixed for a fleet's life (the `wren_fleet` row keeps
it), so a device never changes partition and its state never has to move because the
fleet grew.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

__all__ = [
    "DEFAULT_PARTITIONS",
    "MAX_PARTITIONS",
    "check_partitions",
    "devices_in",
    "partition_client_id",
    "partition_of",
]

#: Partitions of a fleet unless it says otherwise: 3 bridges hold 11 each, 8 hold 4.
DEFAULT_PARTITIONS = 32
# Each partition is an MQTT session and a lease row its owner renews every round: a
# fleet is not served better by more partitions than it will ever have bridges times a
# few, and this bounds the rows and connections a mistyped count would make.
MAX_PARTITIONS = 1024


def check_partitions(partitions: int) -> int:
    """The count itself, or ValueError when it is not one a fleet can have."""
    if isinstance(partitions, bool) or not isinstance(partitions, int):
        raise ValueError(f"a partition count is an int, not {type(partitions).__name__}")
    if not 1 <= partitions <= MAX_PARTITIONS:
        raise ValueError(f"a fleet has 1 to {MAX_PARTITIONS} partitions, not {partitions}")
    return partitions


def partition_of(device: str, partitions: int) -> int:
    """The partition (0 to partitions - 1) that serves `device`."""
    return zlib.crc32(device.encode("utf-8")) % check_partitions(partitions)


def devices_in(devices: Iterable[str], parts: Iterable[int], partitions: int) -> list[str]:
    """The devices, of those given, that fall in `parts` (in the order given)."""
    wanted = set(parts)
    return [d for d in devices if partition_of(d, partitions) in wanted]


def partition_client_id(user: str, part: int) -> str:
    """The MQTT client id of a partition's session (`<bridge user>-p<k>`): the same
    whichever bridge holds the partition, so the next owner takes the session over."""
    return f"{user}-p{part}"
