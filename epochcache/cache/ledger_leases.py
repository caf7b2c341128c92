"""Epoch leases: the shard set an epoch reads, kept from eviction while its owner lives, and the
record of the epochs that ran.

In: the ledger's database (:class:`epochcache.cache.ledger_db.LedgerDatabase`). Out, through
:class:`Leases` (``Ledger.leases``): a :class:`Lease` on the current shard set (:meth:`Leases.snapshot`),
its renewal and release, the live leases, and each epoch's record for coverage and echo.

Invariants: a lease holds every shard published up to its row number ``upto`` less those retiring
when it was taken (``lease_excluded``), so taking one costs the same on any cache; a lease is live
while its owner process lives (same host: pid and start time) or, for an owner on another host,
until its TTL runs out; a shard a live lease holds is never evicted (:func:`unleased_retiring`).
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from typing import Any

from epochcache.cache.lease_owner import Owner, this_process
from epochcache.cache.ledger_db import LedgerDatabase, kv, set_kv
from epochcache.cache.ledger_leased import LeasedRecords
from epochcache.cache.ledger_records import Lease, ShardRecord, take_until
from epochcache.cache.ledger_uses import COLUMNS, advance, clock, record

# Epoch names a snapshot's ``use`` is checked against: enough for the trainers one cache serves at
# once (each rank of a node names its epoch once), few enough to keep in one ``kv`` value.
_USES_NAMED = 64


class Leases:
    """The leases and epoch records in ``db``; the records a lease hands out are decoded once per
    process (:class:`epochcache.cache.ledger_leased.LeasedRecords`)."""

    def __init__(self, db: LedgerDatabase) -> None:
        self._db = db
        self._leased = LeasedRecords()  # the last lease's records, reused by the next

    def snapshot(self, owner: str, ttl_s: float, holder: Owner | None = None, use: str | None = None) -> Lease:
        """Take the current shard set (less retiring shards) and a lease on exactly it.

        One write transaction (its cost does not grow with the cache) begins a use generation, which
        counts one use of each shard in the set and stamps its ``last_used`` (what ``lru``,
        ``most-used``, ``max_uses`` and ``min_uses`` decide by; see :mod:`epochcache.cache.ledger_uses`),
        unless ``use`` names an epoch an earlier snapshot named (the ranks of a node each take a
        snapshot for one epoch: it counts once), and records the lease: every shard published so
        far less the retiring ones. Its records are then read outside the write lock (the lease
        keeps them from eviction meanwhile), oldest published first, without unit keys or use
        counts (:mod:`epochcache.cache.ledger_leased`: decoded once per process). ``holder``: the
        process the lease lives with (default: this one); ``ttl_s`` bounds it only where that
        process's liveness cannot be checked (another host).
        """
        lease_id = uuid.uuid4().hex
        now = time.time()
        holder = holder or this_process()
        with self._db.write() as con:
            if _new_use(con, use):
                advance(con, now)
            upto = con.execute("SELECT coalesce(max(n), 0) FROM shards").fetchone()[0]
            con.execute("INSERT INTO lease_excluded SELECT ?, n FROM shards INDEXED BY shards_age WHERE state = 1",
                        (lease_id,))
            count = con.execute("SELECT shards FROM totals WHERE state = 0").fetchone()[0]
            con.execute("INSERT INTO leases VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (lease_id, owner, holder.host, holder.pid, holder.started, now + ttl_s, now, upto, count))
        return Lease(id=lease_id, owner=owner, shards=self._records(lease_id, upto), expires=now + ttl_s)

    def _records(self, lease_id: str, upto: int) -> tuple[ShardRecord, ...]:
        """The lease's records; if they cannot be read, the lease ends (no caller could release it)."""
        try:
            with self._db.read() as con:
                return self._leased.read(con, lease_id, upto)
        except BaseException:
            self.release(lease_id)
            raise

    def record_epoch(self, lease_id: str, samples: int) -> None:
        """Record that the epoch holding ``lease_id`` runs, training ``samples`` samples (once per node,
        for coverage and echo: :meth:`epochs`). The units of its shards that no epoch trained on
        before join ``trained_units`` (a walk of the untrained shards alone: the cost of the new
        shards, not of the cache); their rows count as distinct where no earlier shard held the unit.
        A lease that ended records nothing."""
        now = time.time()
        with self._db.write() as con:
            lease = con.execute("SELECT upto FROM leases WHERE id = ?", (lease_id,)).fetchone()
            if lease is None:
                return
            # Each unit of the untrained shards, with its share of its shard's rows; a unit in several
            # of them counts for the first (inserted in shard order, the later ones ignored). In SQL: a
            # first epoch on a cache of 100,000 shards took 1.8 s with a statement per shard, 1.1 s so
            # (benchmarks/ledger.py, run after each other).
            con.execute("CREATE TEMP TABLE IF NOT EXISTS fresh_units(h INTEGER PRIMARY KEY, share REAL NOT NULL) "
                        "WITHOUT ROWID")  # (empty: emptied below, and a failure rolls its rows back)
            untrained = ("trained = 0 AND n <= :upto "
                         "AND n NOT IN (SELECT shard FROM lease_excluded WHERE lease = :lease)")
            where = {"upto": lease[0], "lease": lease_id}
            con.execute("INSERT OR IGNORE INTO fresh_units SELECT unit_hash(unit.value), rows * 1.0 / "
                        "json_array_length(units) FROM shards INDEXED BY shards_untrained, json_each(units) AS unit "
                        f"WHERE {untrained} ORDER BY n", where)
            (distinct_new,) = con.execute("SELECT COALESCE(SUM(share), 0.0) FROM fresh_units "
                                          "WHERE h NOT IN (SELECT h FROM trained_units)").fetchone()
            con.execute("INSERT OR IGNORE INTO trained_units SELECT h FROM fresh_units")
            con.execute(f"UPDATE shards SET trained = 1 WHERE n IN (SELECT n FROM shards INDEXED BY shards_untrained "
                        f"WHERE {untrained})", where)
            con.execute("DELETE FROM fresh_units")
            _add_epoch(con, lease_id, now, samples, distinct_new)

    def epochs(self, last: int = 1) -> list[dict[str, Any]]:
        """The ``last`` epochs' records, oldest first: ``n`` (1 for the cache's first), ``at``, ``lease``,
        ``samples`` (that epoch),
        ``trained`` and ``distinct_trained`` (samples, every epoch so far; distinct at unit level,
        a unit's rows counted as its shard's rows per unit), ``fetched_bytes`` (so far), ``cache_bytes``
        (the shards') and ``remote_rows`` (the daemon's estimate then; None while unknown)."""
        with self._db.read() as con:
            rows = con.execute("SELECT n, at, lease, samples, trained, distinct_trained, fetched_bytes, cache_bytes, "
                               "remote_rows FROM epochs ORDER BY n DESC LIMIT ?", (last,)).fetchall()
        keys = ("n", "at", "lease", "samples", "trained", "distinct_trained", "fetched_bytes", "cache_bytes",
                "remote_rows")
        return [dict(zip(keys, row)) for row in reversed(rows)]

    def renew(self, lease_id: str, ttl_s: float) -> bool:
        """Push a lease's expiry ``ttl_s`` into the future; False if it had already ended."""
        with self._db.write() as con:
            if lease_id not in {lease["id"] for lease in live_leases(con)}:
                return False
            con.execute("UPDATE leases SET expires = ? WHERE id = ?", (time.time() + ttl_s, lease_id))
        return True

    def release(self, lease_id: str) -> None:
        with self._db.write() as con:
            _end_leases(con, [lease_id])

    def purge_expired(self) -> int:
        """Delete ended leases (owner dead, or TTL past for another host's) from the database; how many."""
        with self._db.write() as con:
            return end_ended_leases(con)

    def live(self, with_shards: bool = True) -> list[dict[str, Any]]:
        """Live leases as ``{"id", "owner", "host", "pid", "shards", "expires", "taken"}`` dicts;
        ``shards`` lists the shard ids, or with ``with_shards=False`` is their count (no shard read)."""
        with self._db.read() as con:
            leases = live_leases(con)
            for lease in leases:
                if with_shards:
                    lease["shards"] = [sid for (sid,) in con.execute(
                        "SELECT id FROM shards WHERE n <= ? AND n NOT IN "
                        "(SELECT shard FROM lease_excluded WHERE lease = ?) ORDER BY created, id",
                        (lease["upto"], lease["id"]))]
                del lease["upto"]
        return leases


# -- statements (inside a transaction) ------------------------------------------------------------


def live_leases(con: sqlite3.Connection) -> list[dict[str, Any]]:
    """Leases whose owner lives (this host) or whose TTL has not run out (other hosts)."""
    now = time.time()
    out = []
    for lid, owner, host, pid, started, expires, taken, upto, count in con.execute(
            "SELECT id, owner, host, pid, started, expires, taken, upto, shards FROM leases ORDER BY taken"):
        alive = Owner(host, pid, started).alive()
        if alive or (alive is None and expires >= now):
            out.append({"id": lid, "owner": owner, "host": host, "pid": pid, "shards": count, "expires": expires,
                        "taken": taken, "upto": upto})
    return out


def end_ended_leases(con: sqlite3.Connection) -> int:
    """Delete the leases that ended without a release (owner dead, or TTL past for another host's)
    and their excluded rows; how many."""
    live = {lease["id"] for lease in live_leases(con)}
    ended = [lid for (lid,) in con.execute("SELECT id FROM leases") if lid not in live]
    _end_leases(con, ended)
    return len(ended)


def unleased_retiring(con: sqlite3.Connection, need: int | None) -> list[ShardRecord]:
    """The oldest retiring shards no live lease holds, the fewest that free ``need`` bytes (all of
    them if they free less, or ``need`` is None). One statement walks the retiring shards by index and skips the held
    ones (each live lease's excluded rows read once), and only the records taken are decoded (without
    units: :func:`~epochcache.cache.ledger_uses.record`): the daemon asks this at every poll while
    leases hold its evictions back, whatever the cache's size."""
    live = live_leases(con)
    held = " OR ".join(f"(n <= :upto{i} AND n NOT IN (SELECT shard FROM lease_excluded WHERE lease = :id{i}))"
                       for i in range(len(live)))
    params = {f"{key}{i}": lease[key] for i, lease in enumerate(live) for key in ("id", "upto")}
    rows = con.execute(f"SELECT {COLUMNS} FROM shards INDEXED BY shards_age WHERE state = 1"
                       f"{f' AND NOT ({held})' if live else ''} ORDER BY created, id", {**clock(con), **params})
    try:
        return take_until((record(r, with_units=False) for r in rows), need)
    finally:
        rows.close()


def _end_leases(con: sqlite3.Connection, lease_ids: list[str]) -> None:
    for lid in lease_ids:
        con.execute("DELETE FROM lease_excluded WHERE lease = ?", (lid,))
        con.execute("DELETE FROM leases WHERE id = ?", (lid,))


def _new_use(con: sqlite3.Connection, use: str | None) -> bool:
    """Whether a snapshot naming ``use`` counts a use: unnamed, or a name none of the last
    :data:`_USES_NAMED` snapshots gave (each of several trainers on one cache names its own epochs)."""
    if use is None:
        return True
    named = kv(con, "uses_named") or []
    if use in named:
        return False
    set_kv(con, "uses_named", [*named, use][-_USES_NAMED:])
    return True


def _add_epoch(con: sqlite3.Connection, lease_id: str, now: float, samples: int, distinct_new: float) -> None:
    """Append an epoch row: the running totals go on from the last row."""
    trained, distinct = con.execute(
        "SELECT trained, distinct_trained FROM epochs ORDER BY n DESC LIMIT 1").fetchone() or (0, 0.0)
    fetched = con.execute("SELECT coalesce(max(value), 0) FROM counters WHERE name = 'fetched_bytes'").fetchone()[0]
    cache_bytes = con.execute("SELECT sum(bytes) FROM totals").fetchone()[0]
    progress = (kv(con, "cursor") or {}).get("progress") or {}
    estimates = [value for key, value in progress.items() if key.endswith("remote_rows")]
    remote = sum(estimates) if estimates and all(isinstance(value, int) for value in estimates) else None
    con.execute("INSERT INTO epochs (at, lease, samples, trained, distinct_trained, fetched_bytes, cache_bytes, "
                "remote_rows) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (now, lease_id, samples, trained + samples, distinct + distinct_new, fetched, cache_bytes, remote))
