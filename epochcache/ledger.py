"""The ledger: the single source of truth about a cache directory, on diskcache (SQLite).

It records published shards (:class:`ShardRecord`), the bytes reserved for the shard being written,
the sampler's cursor and listing, epoch leases and counters. The daemon and any number of training
processes open the same ledger; every read-modify-write runs in one diskcache transaction (SQLite
``BEGIN IMMEDIATE``), so processes never see each other's half-done changes.

Invariants it keeps:

- a shard file is visible to readers only once its record is published, and a record is removed
  before its file is deleted (``make_room`` returns victims; the caller deletes their files after);
- a shard named by an unexpired lease is never deleted: the policy's picks are marked retiring,
  left out of new snapshots, and evicted once no lease holds them, so a trainer that always holds
  an epoch cannot stall the cache's rotation, and the daemon waits rather than break the budget;
- bytes are accounted here (shard records + reservation + the ledger's database and a fixed
  reserve for its WAL and the lock file), never by scanning the shard folder.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import diskcache

_SHARD = "shard:"
_LEASE = "lease:"
_RESERVED = "reserved"
_RETIRING = "retiring"
_CURSOR = "cursor"
_LISTING = "listing"
_COUNTER = "count:"

# SQLite deletes the WAL when the last connection closes and regrows it later, so charging its size of
# the moment would let a restarted daemon hand those bytes to shards. The WAL (truncated to WAL_BYTES
# at each checkpoint), the shared-memory index and daemon.lock are charged as this fixed reserve; the
# database file at its real size.
WAL_BYTES = 256 * 1024
LEDGER_RESERVE = 2 * WAL_BYTES + 64 * 1024

# Victim chooser (an eviction policy): (shards not yet retiring, leased or not, bytes to free) ->
# shards to retire, in order.
Chooser = Callable[[Sequence["ShardRecord"], int], Sequence["ShardRecord"]]


@dataclass(frozen=True)
class ShardRecord:
    """A published shard: its file name in the shard folder, size, rows and the units it holds."""

    id: str
    filename: str
    nbytes: int
    rows: int
    created: float
    checksum: str
    units: tuple[str, ...]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardRecord:
        return cls(**{**data, "units": tuple(data["units"])})


@dataclass(frozen=True)
class Lease:
    """A training epoch's hold on an exact shard set; its shards are not evicted until it ends."""

    id: str
    owner: str
    shards: tuple[ShardRecord, ...]
    expires: float


@dataclass(frozen=True)
class Usage:
    """Byte accounting of a cache directory at one moment."""

    shard_bytes: int
    reserved_bytes: int
    ledger_bytes: int
    shards: int
    rows: int
    leases: int

    @property
    def total(self) -> int:
        return self.shard_bytes + self.reserved_bytes + self.ledger_bytes


class Ledger:
    """Process-safe record of a cache directory's contents (see module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        self._dir = Path(directory)
        self._cache = diskcache.Cache(
            str(self._dir),
            eviction_policy="none",  # diskcache must never cull our records on its own
            size_limit=2**62,
            disk_min_file_size=2**30,  # keep every value inside SQLite: no side files to account
            sqlite_wal_autocheckpoint=WAL_BYTES // 4096,  # pages of SQLite's default 4 KiB
            sqlite_journal_size_limit=WAL_BYTES,
        )

    def close(self) -> None:
        self._cache.close()

    # -- shards ---------------------------------------------------------------------------------

    def shards(self) -> list[ShardRecord]:
        """All published shards, oldest first."""
        return sorted(self._records(), key=by_age)

    def publish(self, record: ShardRecord, cursor: dict[str, int] | None = None) -> None:
        """Make ``record`` visible, move the cursor past its units and free the reservation, atomically."""
        with self._cache.transact(retry=True):
            self._cache.set(_SHARD + record.id, asdict(record))
            if cursor is not None:
                self._cache.set(_CURSOR, dict(cursor))
            self._cache.set(_RESERVED, 0)
            self._cache.incr(_COUNTER + "published", 1, retry=True)

    def drop(self, shard_ids: Sequence[str]) -> None:
        """Forget shards (used when their files are gone); their files are the caller's business."""
        with self._cache.transact(retry=True):
            for shard_id in shard_ids:
                self._cache.delete(_SHARD + shard_id)

    # -- budget ---------------------------------------------------------------------------------

    def usage(self) -> Usage:
        with self._cache.transact(retry=True):
            records = list(self._records())
            reserved = int(self._cache.get(_RESERVED, 0))
            leases = len(self._live_leases())
        return Usage(
            shard_bytes=sum(r.nbytes for r in records),
            reserved_bytes=reserved,
            ledger_bytes=self.disk_bytes(),
            shards=len(records),
            rows=sum(r.rows for r in records),
            leases=leases,
        )

    def disk_bytes(self) -> int:
        """Bytes charged to the ledger: its database file plus :data:`LEDGER_RESERVE`."""
        return os.stat(self._dir / diskcache.core.DBNAME).st_size + LEDGER_RESERVE

    def make_room(
        self, nbytes: int, budget: int, choose: Chooser, evict_to: int | None = None
    ) -> list[ShardRecord] | None:
        """Reserve ``nbytes`` within ``budget``, evicting the shards that ``choose`` picks.

        Eviction runs in batches: once room must be made, enough is picked to bring usage (with the
        reservation) down to ``evict_to`` bytes (default ``budget``), so a cache that trainers keep
        leased still rotates that fraction at each epoch boundary instead of one shard.

        ``choose`` orders all shards not yet retiring, leased or not, so a policy is never bent by
        leases (fifo never evicts a new shard because the old ones are in use, which would churn
        unread shards at wire speed). Picked shards become *retiring*: new snapshots leave them out,
        and each is evicted as soon as no lease holds it. Returns the evicted records (already removed
        from the ledger; the caller deletes their files), or None when the retiring shards free too
        little yet; then nothing is reserved and the caller waits. ``choose=lambda *_: []`` reserves
        only if the room is free and never retires anything.
        """
        with self._cache.transact(retry=True):
            records = list(self._records())
            used = sum(r.nbytes for r in records) + int(self._cache.get(_RESERVED, 0)) + self.disk_bytes()
            need = used + nbytes - budget
            victims: list[ShardRecord] = []
            if need > 0:
                goal = max(need, used + nbytes - (budget if evict_to is None else evict_to))
                retiring_ids = set(self._cache.get(_RETIRING, ()))
                retiring = [r for r in records if r.id in retiring_ids]
                short = goal - sum(r.nbytes for r in retiring)
                if short > 0:
                    retiring += choose([r for r in records if r.id not in retiring_ids], short)
                leased = {sid for lease in self._live_leases() for sid in lease["shards"]}
                victims = take_until([r for r in retiring if r.id not in leased], goal)
                if sum(v.nbytes for v in victims) < need:
                    self._cache.set(_RETIRING, sorted(r.id for r in retiring))
                    return None
                evicted = {v.id for v in victims}
                self._cache.set(_RETIRING, sorted(r.id for r in retiring if r.id not in evicted))
            for victim in victims:
                self._cache.delete(_SHARD + victim.id)
            self._cache.set(_RESERVED, int(self._cache.get(_RESERVED, 0)) + nbytes)
            if victims:
                self._cache.incr(_COUNTER + "evicted", len(victims), retry=True)
        return victims

    def clear_reservation(self) -> None:
        """Forget the bytes reserved for a shard that will not be published."""
        self._cache.set(_RESERVED, 0, retry=True)

    def clear_retiring(self) -> None:
        """Return retiring shards to snapshots (at daemon start: their retirement was never finished)."""
        self._cache.set(_RETIRING, [], retry=True)

    # -- leases ---------------------------------------------------------------------------------

    def snapshot(self, owner: str, ttl_s: float) -> Lease:
        """Take the current shard set (less retiring shards) and a lease on exactly it, atomically."""
        lease_id = uuid.uuid4().hex
        expires = time.time() + ttl_s
        with self._cache.transact(retry=True):
            retiring = set(self._cache.get(_RETIRING, ()))
            live = (r for r in self._records() if r.id not in retiring)
            records = tuple(sorted(live, key=by_age))
            self._cache.set(
                _LEASE + lease_id,
                {"owner": owner, "shards": [r.id for r in records], "expires": expires},
                expire=ttl_s,
            )
        return Lease(id=lease_id, owner=owner, shards=records, expires=expires)

    def renew(self, lease_id: str, ttl_s: float) -> bool:
        """Push a lease's expiry ``ttl_s`` into the future; False if it had already expired."""
        with self._cache.transact(retry=True):
            data = self._cache.get(_LEASE + lease_id)
            if data is None or data["expires"] < time.time():
                return False
            data["expires"] = time.time() + ttl_s
            self._cache.set(_LEASE + lease_id, data, expire=ttl_s)
        return True

    def release(self, lease_id: str) -> None:
        self._cache.delete(_LEASE + lease_id, retry=True)

    def leases(self) -> list[dict[str, Any]]:
        """Unexpired leases as ``{"id", "owner", "shards", "expires"}`` dicts."""
        with self._cache.transact(retry=True):
            return self._live_leases()

    # -- sampler state --------------------------------------------------------------------------

    def cursor(self) -> dict[str, int] | None:
        return self._cache.get(_CURSOR, retry=True)

    def set_cursor(self, cursor: dict[str, int]) -> None:
        self._cache.set(_CURSOR, dict(cursor), retry=True)

    def listing(self) -> dict[str, Any] | None:
        return self._cache.get(_LISTING, retry=True)

    def set_listing(self, listing: dict[str, Any]) -> None:
        self._cache.set(_LISTING, listing, retry=True)

    # Units the daemon skipped after their reads kept failing: ``"skipped:<unit key>"`` -> a dict
    # ``{"path", "size", "index", "pass", "error"}`` (``index`` None: the object's metadata failed).

    def skipped(self) -> dict[str, dict[str, Any]]:
        """Every recorded skipped unit, by unit key."""
        return {
            key[len("skipped:") :]: self._cache.get(key)
            for key in self._cache.iterkeys()
            if isinstance(key, str) and key.startswith("skipped:")
        }

    def set_skipped(self, unit_key: str, info: dict[str, Any]) -> None:
        self._cache.set("skipped:" + unit_key, dict(info), retry=True)

    def drop_skipped(self, unit_key: str) -> None:
        self._cache.delete("skipped:" + unit_key, retry=True)

    # The remote listing in pages, written as the listing streams in: ``"listing_page:<n>"`` -> a list
    # of ``(path, size)``; ``set_listing`` holds its header (which pass, how many objects, page starts).

    def listing_page(self, number: int) -> list[tuple[str, int]] | None:
        return self._cache.get(f"listing_page:{number}", retry=True)

    def set_listing_page(self, number: int, objects: list[tuple[str, int]]) -> None:
        self._cache.set(f"listing_page:{number}", objects, retry=True)

    def drop_listing_pages(self) -> None:
        for key in list(self._cache.iterkeys()):
            if isinstance(key, str) and key.startswith("listing_page:"):
                self._cache.delete(key, retry=True)

    # -- counters -------------------------------------------------------------------------------

    def incr(self, name: str, delta: int = 1) -> None:
        self._cache.incr(_COUNTER + name, delta, retry=True)

    def counters(self) -> dict[str, int]:
        return {
            key[len(_COUNTER) :]: int(self._cache.get(key, 0))
            for key in self._cache.iterkeys()
            if isinstance(key, str) and key.startswith(_COUNTER)
        }

    # -- internals (call inside a transaction) ---------------------------------------------------

    def _records(self) -> list[ShardRecord]:
        out = []
        for key in self._cache.iterkeys():
            if isinstance(key, str) and key.startswith(_SHARD):
                data = self._cache.get(key)
                if data is not None:
                    out.append(ShardRecord.from_dict(data))
        return out

    def _live_leases(self) -> list[dict[str, Any]]:
        now = time.time()
        out = []
        for key in self._cache.iterkeys():
            if isinstance(key, str) and key.startswith(_LEASE):
                data = self._cache.get(key)
                if data is not None and data["expires"] >= now:
                    out.append({"id": key[len(_LEASE) :], **data})
        return out


def by_age(record: ShardRecord) -> tuple[float, str]:
    """Sort key: oldest first, ties broken by id so every process agrees on the order."""
    return record.created, record.id


def take_until(ordered: Sequence[ShardRecord], need: int) -> list[ShardRecord]:
    """The shortest prefix of ``ordered`` whose bytes reach ``need`` (all of it if they never do)."""
    taken: list[ShardRecord] = []
    freed = 0
    for record in ordered:
        if freed >= need:
            break
        taken.append(record)
        freed += record.nbytes
    return taken
