"""The ledger: the single source of truth about a cache directory, on diskcache (SQLite).

It records published shards (:class:`ShardRecord`, with how often and when epochs used them), the
bytes reserved for the shard being written, quarantined shards, the sampler's cursor and listing,
epoch leases, the daemon's state and counters. The daemon and any number of training
processes open the same ledger; every read-modify-write runs in one diskcache transaction (SQLite
``BEGIN IMMEDIATE``), so processes never see each other's half-done changes.

Invariants it keeps:

- a shard file is visible to readers only once its record is published, and a record is removed
  before its file is deleted (``make_room`` returns victims; the caller deletes their files after);
- a shard named by an unexpired lease is never deleted: the policy's picks are marked retiring,
  left out of new snapshots, and evicted once no lease holds them, so a trainer that always holds
  an epoch cannot stall the cache's rotation, and the daemon waits rather than break the budget;
- bytes are accounted here (shard records + reservation + quarantined files + the ledger's database,
  as much again for its journal and a fixed reserve), never by scanning the shard folder;
  quarantined files are the first bytes freed when room is needed.
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import diskcache
import tenacity

_SHARD = "shard:"
_LEASE = "lease:"
_RESERVED = "reserved"
_RETIRING = "retiring"
_CURSOR = "cursor"
_LISTING = "listing"
_COUNTER = "count:"
_QUARANTINE = "quarantine:"
_DAEMON = "daemon"

# SQLite runs with a rollback journal, not a WAL: a WAL only shrinks at checkpoints, which readers that
# hold old snapshots (trainers, status) hold off, so its size has no bound (860 KB seen in a 10 s test
# with two trainers). A rollback journal holds the original of each page a transaction changes once,
# so it never exceeds the database plus its headers, and it is deleted at each commit. The ledger is
# charged twice its database (the database and a journal as large) plus this reserve: the lock file,
# journal headers and the growth of the database between a reservation and its publish.
LEDGER_RESERVE = 256 * 1024
# Each reservation also leaves room for the database's growth by the publish that follows (a record
# and counters: a few pages, charged twice), so the charge itself, not only the bytes on disk, stays
# within the budget after the publish.
PUBLISH_GROWTH = 64 * 1024

# Victim chooser (an eviction policy): (shards not yet retiring, leased or not, bytes to free) ->
# shards to retire, in order. If it has a ``label(record) -> str`` method, evictions are counted per
# label (``evicted.fifo``, ``evicted.max_uses``...), else under its ``name``.
Chooser = Callable[[Sequence["ShardRecord"], int], Sequence["ShardRecord"]]


@dataclass(frozen=True)
class ShardRecord:
    """A published shard: its file name in the shard folder, size, rows and the units it holds.

    ``uses`` counts the epochs whose snapshot held it and ``last_used`` is when the latest began
    (None: never used); the ledger updates both in the transaction that takes a snapshot.
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
class Lease:
    """A training epoch's hold on an exact shard set; its shards are not evicted until it ends."""

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

    @property
    def total(self) -> int:
        return self.shard_bytes + self.reserved_bytes + self.ledger_bytes + self.quarantined_bytes


# How long opening the ledger keeps retrying while other processes hold its database locked.
OPEN_PATIENCE_S = 60.0


def _open_cache(directory: Path) -> diskcache.Cache:
    """Open the ledger's diskcache, retrying while the database is locked.

    diskcache runs schema statements on open. Under a rollback journal SQLite answers "database is
    locked" at once, without waiting, when another process is mid-write (its busy handler would risk a
    deadlock), so ranks and a daemon opening one cache together must retry rather than fail.
    """
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(_is_locked),
        wait=tenacity.wait_random_exponential(multiplier=0.01, max=0.5),
        stop=tenacity.stop_after_delay(OPEN_PATIENCE_S),
        reraise=True,
    )
    cache: diskcache.Cache = retrying(
        diskcache.Cache,
        str(directory),
        eviction_policy="none",  # diskcache must never cull our records on its own
        size_limit=2**62,
        disk_min_file_size=2**30,  # keep every value inside SQLite: no side files to account
        sqlite_journal_mode="delete",  # a bounded journal; see LEDGER_RESERVE
    )
    return cache


def _is_locked(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)


class Ledger:
    """Process-safe record of a cache directory's contents (see module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        self._dir = Path(directory)
        self._cache = _open_cache(self._dir)

    def close(self) -> None:
        self._cache.close()

    # -- shards ---------------------------------------------------------------------------------

    def shards(self) -> list[ShardRecord]:
        """All published shards, oldest first."""
        return sorted(self._records(), key=by_age)

    def publish(self, record: ShardRecord, cursor: dict[str, Any] | None = None) -> None:
        """Make ``record`` visible, move the cursor past its units and free the reservation, atomically."""
        with self._cache.transact(retry=True):
            self._cache.set(_SHARD + record.id, asdict(record))
            if cursor is not None:
                self._cache.set(_CURSOR, dict(cursor))
            self._cache.set(_RESERVED, 0)
            self._cache.incr(_COUNTER + "published", 1, retry=True)

    def adopt(self, records: Sequence[ShardRecord]) -> None:
        """Record shards found whole on disk but unknown to the ledger (a crash before publish)."""
        with self._cache.transact(retry=True):
            for record in records:
                self._cache.set(_SHARD + record.id, asdict(record))
            self._cache.incr(_COUNTER + "adopted", len(records), retry=True)

    def drop(self, shard_ids: Sequence[str]) -> None:
        """Forget shards (used when their files are gone); their files are the caller's business."""
        with self._cache.transact(retry=True):
            for shard_id in shard_ids:
                self._cache.delete(_SHARD + shard_id)

    # -- quarantine -----------------------------------------------------------------------------

    def quarantine(self, shard_id: str, reason: str) -> ShardRecord | None:
        """Move a shard's record to the quarantine, its bytes still charged; None if not published."""
        with self._cache.transact(retry=True):
            data = self._cache.get(_SHARD + shard_id)
            if data is None:
                return None
            self._cache.delete(_SHARD + shard_id)
            self._cache.set(_QUARANTINE + shard_id, {"record": data, "reason": reason, "at": time.time()})
            self._cache.incr(_COUNTER + "quarantined", 1, retry=True)
        return ShardRecord.from_dict(data)

    def quarantined(self) -> list[Quarantined]:
        """Quarantined shards, oldest quarantine first."""
        with self._cache.transact(retry=True):
            entries = self._quarantined()
        return sorted(entries, key=lambda q: q.at)

    def forget_quarantined(self, shard_ids: Sequence[str]) -> None:
        """Stop charging quarantined shards (call once their files are gone)."""
        with self._cache.transact(retry=True):
            for shard_id in shard_ids:
                self._cache.delete(_QUARANTINE + shard_id)

    # -- budget ---------------------------------------------------------------------------------

    def usage(self) -> Usage:
        with self._cache.transact(retry=True):
            records = list(self._records())
            reserved = int(self._cache.get(_RESERVED, 0))
            leases = len(self._live_leases())
            quarantined = sum(q.record.nbytes for q in self._quarantined())
        return Usage(
            shard_bytes=sum(r.nbytes for r in records),
            reserved_bytes=reserved,
            ledger_bytes=self.disk_bytes(),
            shards=len(records),
            rows=sum(r.rows for r in records),
            leases=leases,
            quarantined_bytes=quarantined,
        )

    def disk_bytes(self) -> int:
        """Bytes charged to the ledger: twice its database file (it and its journal) plus :data:`LEDGER_RESERVE`."""
        return 2 * os.stat(self._dir / diskcache.core.DBNAME).st_size + LEDGER_RESERVE

    def make_room(
        self, nbytes: int, budget: int, choose: Chooser, evict_to: int | None = None
    ) -> list[ShardRecord] | None:
        """Reserve ``nbytes`` within ``budget`` (with :data:`PUBLISH_GROWTH` to spare), evicting the
        shards that ``choose`` picks.

        Quarantined files count as used bytes but are never picked here: the caller purges them
        (:func:`epochcache.quarantine.purge_quarantine`) before asking for room it lacks.
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
            quarantined = [q.record for q in self._quarantined()]
            used = (sum(r.nbytes for r in records + quarantined) + int(self._cache.get(_RESERVED, 0))
                    + self.disk_bytes())
            need = used + nbytes + PUBLISH_GROWTH - budget
            victims: list[ShardRecord] = []
            if need > 0:
                goal = max(need, used + nbytes + PUBLISH_GROWTH - (budget if evict_to is None else evict_to))
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
                label = getattr(choose, "label", None)
                for victim in victims:
                    name = label(victim) if label is not None else getattr(choose, "name", "unnamed")
                    self._cache.incr(f"{_COUNTER}evicted.{name}", 1, retry=True)
        return victims

    def clear_reservation(self) -> None:
        """Forget the bytes reserved for a shard that will not be published."""
        self._cache.set(_RESERVED, 0, retry=True)

    def clear_retiring(self) -> None:
        """Return retiring shards to snapshots (at daemon start: their retirement was never finished)."""
        self._cache.set(_RETIRING, [], retry=True)

    # -- leases ---------------------------------------------------------------------------------

    def snapshot(self, owner: str, ttl_s: float) -> Lease:
        """Take the current shard set (less retiring shards) and a lease on exactly it, atomically.

        The same transaction counts one use of each shard in the set and stamps its ``last_used``
        (what ``lru``, ``most-used`` and ``max_uses`` decide by); the lease's records carry the
        counts from before this use.
        """
        lease_id = uuid.uuid4().hex
        now = time.time()
        with self._cache.transact(retry=True):
            retiring = set(self._cache.get(_RETIRING, ()))
            live = (r for r in self._records() if r.id not in retiring)
            records = tuple(sorted(live, key=by_age))
            for r in records:
                self._cache.set(_SHARD + r.id, {**asdict(r), "uses": r.uses + 1, "last_used": now})
            self._cache.set(
                _LEASE + lease_id,
                {"owner": owner, "shards": [r.id for r in records], "expires": now + ttl_s, "taken": now},
                expire=ttl_s,
            )
        return Lease(id=lease_id, owner=owner, shards=records, expires=now + ttl_s)

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

    def purge_expired(self) -> int:
        """Delete expired leases from the database (they already protect nothing); returns how many."""
        return int(self._cache.expire(retry=True))

    def leases(self) -> list[dict[str, Any]]:
        """Unexpired leases as ``{"id", "owner", "shards", "expires", "taken"}`` dicts."""
        with self._cache.transact(retry=True):
            return self._live_leases()

    # -- sampler state --------------------------------------------------------------------------

    def cursor(self) -> dict[str, Any] | None:
        return self._cache.get(_CURSOR, retry=True)

    def set_cursor(self, cursor: dict[str, Any]) -> None:
        self._cache.set(_CURSOR, dict(cursor), retry=True)

    def listing(self) -> dict[str, Any] | None:
        return self._cache.get(_LISTING, retry=True)

    def set_listing(self, listing: dict[str, Any]) -> None:
        self._cache.set(_LISTING, listing, retry=True)

    # Each source (a stream, by its name) has its own listing header: ``listing`` for the unnamed
    # single source (what ``listing()`` returns, so caches made before ``sources:`` resume), else
    # ``"listing:<name>"``.

    def stream_listing(self, stream: str) -> dict[str, Any] | None:
        return self._cache.get(f"{_LISTING}:{stream}" if stream else _LISTING, retry=True)

    def set_stream_listing(self, stream: str, listing: dict[str, Any]) -> None:
        self._cache.set(f"{_LISTING}:{stream}" if stream else _LISTING, listing, retry=True)

    # -- daemon state ---------------------------------------------------------------------------

    def daemon_state(self) -> dict[str, Any] | None:
        """What the sync daemon last said it is doing (``{"pid", "state", "since", ...}``), for status."""
        return self._cache.get(_DAEMON, retry=True)

    def set_daemon_state(self, state: dict[str, Any]) -> None:
        self._cache.set(_DAEMON, dict(state), retry=True)

    def update_daemon_state(self, fields: dict[str, Any]) -> None:
        """Merge ``fields`` into the daemon's state (keys not named keep their values)."""
        with self._cache.transact(retry=True):
            self._cache.set(_DAEMON, {**(self._cache.get(_DAEMON) or {}), **fields})

    # -- dataset identity -----------------------------------------------------------------------

    def identity(self) -> dict[str, Any] | None:
        """The dataset this cache holds (each source's url, format, columns, and the schema its rows
        produced), as recorded by the first daemon that wrote it; None for a new cache."""
        return self._cache.get("identity", retry=True)

    def set_identity(self, identity: dict[str, Any] | None) -> None:
        """Bind the cache to ``identity`` (None: unbind, when the cache is emptied on purpose)."""
        if identity is None:
            self._cache.delete("identity", retry=True)
        else:
            self._cache.set("identity", dict(identity), retry=True)

    def mark_verified(self, shard_ids: Sequence[str]) -> None:
        """Record that these shards' checksums were checked on this host (readers skip them after)."""
        with self._cache.transact(retry=True):
            for shard_id in shard_ids:
                data = self._cache.get(_SHARD + shard_id)
                if data is not None:
                    self._cache.set(_SHARD + shard_id, {**data, "verified": True})

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

    # The remote listing in pages, written as the listing streams in: ``"listing_page:<n>"`` (the
    # unnamed single source) or ``"listing_page:<stream>:<n>"`` -> a list of ``(path, size)``; the
    # stream's listing header holds which pass, how many objects and the page starts.

    def listing_page(self, number: int, stream: str = "") -> list[tuple[str, int, str | None]] | None:
        """Page ``number`` of ``stream``'s listing as ``(path, size, etag)`` rows; None if absent."""
        page = self._cache.get(self._page_key(stream, number), retry=True)
        return None if page is None else [(row[0], row[1], row[2] if len(row) > 2 else None) for row in page]

    def set_listing_page(self, number: int, objects: list[tuple[str, int, str | None]], stream: str = "") -> None:
        self._cache.set(self._page_key(stream, number), objects, retry=True)

    def drop_listing_pages(self, stream: str = "") -> None:
        prefix = self._page_key(stream, "")
        for key in list(self._cache.iterkeys()):
            # An unnamed stream's prefix also matches named streams' keys: those end in ":<n>".
            if isinstance(key, str) and key.startswith(prefix) and key[len(prefix) :].isdigit():
                self._cache.delete(key, retry=True)

    @staticmethod
    def _page_key(stream: str, number: int | str) -> str:
        return f"listing_page:{stream}:{number}" if stream else f"listing_page:{number}"

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

    def _quarantined(self) -> list[Quarantined]:
        out = []
        for key in self._cache.iterkeys():
            if isinstance(key, str) and key.startswith(_QUARANTINE):
                data = self._cache.get(key)
                if data is not None:
                    out.append(Quarantined(ShardRecord.from_dict(data["record"]), data["reason"], data["at"]))
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
