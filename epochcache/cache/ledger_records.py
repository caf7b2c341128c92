"""The values the ledger hands out: shard records, leases, quarantine entries, byte usage.

Plain frozen dataclasses with no storage logic, so modules that only read records (eviction
policies, the shard-file reader that rebuilds a ledger) need not import the ledger itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class ShardRecord:
    """A published shard: its file name in the shard folder, size, rows and the units it holds.

    ``uses`` counts the epochs whose snapshot held it and ``last_used`` is when the latest began
    (None: never used); the ledger derives both from its use generations (see
    :mod:`epochcache.cache.ledger_uses`), so a snapshot writes no row per shard.
    """

    id: str
    filename: str
    nbytes: int
    rows: int
    created: float
    checksum: str
    units: tuple[str, ...]
    uses: int = 0
    last_used: float | None = None
    schema: str = ""  # fingerprint of the rows' Arrow schema (shards.schema_fingerprint); "" if unknown
    verified: bool = False  # its checksum was checked once on this host (at write, or lazily by a reader)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardRecord:
        return cls(**{**data, "units": tuple(data["units"])})


@dataclass(frozen=True)
class Stage:
    """One indexed pass of an eviction walk: the live shards used ``at_least`` times or more and fewer
    than ``below`` times (None: no bound), in ``order``: ``age`` (oldest first), ``recency`` (least
    recently used first; never used counts as used when created), ``uses`` (most used first), ties
    oldest first, or ``random`` (uniform; ``seed`` None: fresh entropy). A policy states its order
    as stages; the ledger walks each by an index."""

    order: Literal["age", "recency", "uses", "random"]
    at_least: int = 0
    below: int | None = None
    seed: int | None = None


@dataclass(frozen=True)
class Lease:
    """A training epoch's hold on an exact shard set; its shards are not evicted until it ends. Its
    records carry no unit keys and no use counts (``units`` empty, ``uses`` 0, ``last_used`` None):
    a reader needs files, rows and checksums; the ledger's records have the rest."""

    id: str
    owner: str
    shards: tuple[ShardRecord, ...]
    expires: float


@dataclass(frozen=True)
class Quarantined:
    """A shard moved to the quarantine folder: its record, why, and when (its bytes stay charged)."""

    record: ShardRecord
    reason: str
    at: float


@dataclass(frozen=True)
class Usage:
    """Byte accounting of a cache directory at one moment."""

    shard_bytes: int
    reserved_bytes: int
    ledger_bytes: int
    shards: int
    rows: int
    leases: int
    quarantined_bytes: int = 0
    retiring_bytes: int = 0  # part of shard_bytes: picked for eviction, waiting for their leases to end

    @property
    def total(self) -> int:
        return self.shard_bytes + self.reserved_bytes + self.ledger_bytes + self.quarantined_bytes


def by_age(record: ShardRecord) -> tuple[float, str]:
    """Sort key: oldest first, ties broken by id so every process agrees on the order."""
    return record.created, record.id


def take_until(ordered: Iterable[ShardRecord], need: int | None) -> list[ShardRecord]:
    """The shortest prefix of ``ordered`` whose bytes reach ``need`` (all of it if they never do, or
    ``need`` is None)."""
    taken: list[ShardRecord] = []
    freed = 0
    for record in ordered:
        if need is not None and freed >= need:
            break
        taken.append(record)
        freed += record.nbytes
    return taken
