"""The ledger: the single source of truth about a cache directory, in one SQLite database.

It records published shards (:class:`ShardRecord`, with how often and when epochs used them), the
bytes reserved for the shard being written, quarantined shards, the sampler's cursor and listing,
epoch leases, the daemon's state and counters, in the typed tables of :mod:`epochcache.cache.ledger_schema`
(``<dir>/ledger.sqlite3``, WAL mode). The daemon and any number of training processes open the same
ledger; every read-modify-write runs in one ``BEGIN IMMEDIATE`` transaction, so processes never see
each other's half-done changes. Costs do not grow with the cache: totals are kept by triggers,
eviction walks an index for as many victims as it needs, a lease stores a row-number bound instead
of its shard list.

Invariants it keeps:

- a shard file is visible to readers only once its record is published, and a record is removed
  before its file is deleted (``make_room`` returns victims; the caller deletes their files after);
- a shard named by a live lease is never deleted: the policy's picks are marked retiring,
  left out of new snapshots, and evicted once no lease holds them, so a trainer that always holds
  an epoch cannot stall the cache's rotation, and the daemon waits rather than break the budget;
- a lease is live while its owner process lives (same host: checked by pid and start time, so a
  stopped trainer keeps its shards and a killed one frees them at once) or, for owners on other
  hosts, until its TTL runs out;
- bytes are accounted here (shard records + reservation + quarantined files + the ledger's files and
  a fixed reserve), never by scanning the shard folder; quarantined files are the first bytes freed
  when room is needed;
- a damaged database surfaces as one :class:`LedgerError` line, a full disk as
  :class:`LedgerFullError` with nothing changed.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import xxhash

from epochcache.cache.layout import SHARD_SUFFIX
from epochcache.cache.lease_owner import Owner, this_process
from epochcache.cache.ledger_leased import LeasedRecords
from epochcache.cache.ledger_records import Lease, Quarantined, ShardRecord, Stage, Usage, by_age, take_until
from epochcache.cache.ledger_schema import (
    DB_NAME,
    LEGACY_DB_NAME,
    OPEN_PATIENCE_S,
    Connect,
    connect,
    open_database,
    readable_errors,
)
from epochcache.cache.ledger_uses import COLUMNS, FOLD, advance, choose_by_index, clock, record
from epochcache.cache.shard_files import whole_shards
from epochcache.errors import LedgerError

__all__ = ["LEDGER_RESERVE", "OPEN_PATIENCE_S", "PUBLISH_GROWTH", "Chooser", "Lease", "Ledger", "Quarantined",
           "ShardRecord", "Stage", "Usage", "by_age", "take_until"]

log = logging.getLogger(__name__)

# The ledger is charged twice its database plus this reserve: the WAL's shared-memory index and its
# growth between two checkpoints (32 pages, see ledger_schema.connect), with room to spare.
LEDGER_RESERVE = 256 * 1024
# Each reservation also leaves room for the database's growth by the publish that follows (a record,
# its units and counters: a few pages), so the charge stays within the budget after the publish.
PUBLISH_GROWTH = 64 * 1024
# Epoch names a snapshot's ``use`` is checked against: enough for the trainers one cache serves at
# once (each rank of a node names its epoch once), few enough to keep in one ``kv`` value.
_USES_NAMED = 64

# Victim chooser (an eviction policy): (shards not yet retiring, leased or not, bytes to free) ->
# shards to retire, in order. If it has a ``label(record) -> str`` method, evictions are counted per
# label (``evicted.fifo``, ``evicted.max_uses``...), else under its ``name``. If its ``stages()``
# gives :class:`Stage` values, the ledger walks them in turn by index (a shard picked by one stage
# is not picked again) instead of loading every candidate.
Chooser = Callable[[Sequence[ShardRecord], int], Sequence[ShardRecord]]


def _unit_hash(key: str) -> int:
    """A unit key's 64-bit hash as SQLite's signed integer."""
    value = xxhash.xxh3_64_intdigest(key.encode())
    return value - 2**64 if value >= 2**63 else value


class Ledger:
    """Process-safe record of a cache directory's contents (see module docstring).

    ``directory`` is the cache's ledger folder (``CacheLayout.ledger``); its parent holds ``shards/``.
    ``connect`` opens the SQLite connection (tests inject one whose writes fail with a full disk).
    A ledger left by the diskcache-based epochcache is rebuilt from the shard files on first open.
    """

    def __init__(self, directory: str | Path, connect: Connect = connect) -> None:
        self._dir = Path(directory)
        self._dir.mkdir(parents=True, exist_ok=True)
        self.path = self._dir / DB_NAME
        self._connect = connect
        self._lock = threading.RLock()  # one connection per process, shared by its threads
        legacy = self._dir / LEGACY_DB_NAME
        migrate = legacy.exists() and not self.path.exists()
        self._con = open_database(self.path, connect)
        self._pid = os.getpid()
        self._leased = LeasedRecords()  # the last lease's records, reused by the next
        if migrate:
            self._migrate(legacy)

    @classmethod
    def rebuild(cls, directory: str | Path, connect: Connect = connect) -> Ledger:
        """A new ledger built from the shard files next to ``directory``; the old database (damaged, or
        of another version) is deleted: its bytes are not charged to the budget, and every shard's
        record is in its file. Hold the cache's lock."""
        folder = Path(directory)
        for name in (DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm", LEGACY_DB_NAME):
            (folder / name).unlink(missing_ok=True)
        ledger = cls(folder, connect)
        ledger._adopt_files("rebuilt the ledger")
        return ledger

    def intact(self) -> bool:
        """Whether SQLite finds the database whole (``PRAGMA quick_check``, reads every page)."""
        try:
            with self._read() as con:
                return bool(con.execute("PRAGMA quick_check").fetchone()[0] == "ok")
        except LedgerError:
            return False

    def _migrate(self, legacy: Path) -> None:
        self._adopt_files(f"migrated the ledger {legacy} (diskcache) to {self.path}")
        for name in (LEGACY_DB_NAME, "cache.db-journal", "cache.db-wal", "cache.db-shm"):
            (self._dir / name).unlink(missing_ok=True)

    def _adopt_files(self, what: str) -> None:
        records = whole_shards(self._dir.parent / "shards")
        self.adopt(records)
        log.warning("%s from %d shard files (each carries its record)", what, len(records))

    def close(self) -> None:
        with self._lock:
            self._con.close()

    # -- plumbing -------------------------------------------------------------------------------

    def _db(self) -> sqlite3.Connection:
        if os.getpid() != self._pid:  # a forked child must not use its parent's SQLite connection
            self._con = open_database(self.path, self._connect)
            self._pid = os.getpid()
        return self._con

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (``BEGIN IMMEDIATE``): all of it or nothing."""
        with self._lock, readable_errors(self.path):
            con = self._db()
            con.execute("BEGIN IMMEDIATE")
            try:
                yield con
                con.execute("COMMIT")
            except BaseException:
                if con.in_transaction:
                    con.execute("ROLLBACK")
                raise

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """One read transaction: a consistent view across its statements, blocking no writer (WAL)."""
        with self._lock, readable_errors(self.path):
            con = self._db()
            con.execute("BEGIN")
            try:
                yield con
            finally:
                if con.in_transaction:
                    con.execute("COMMIT")

    def version(self) -> int:
        """A number that changes once another connection (the daemon's, another loader's) has committed
        to the ledger since the last call (SQLite's ``PRAGMA data_version``); this one's own commits do
        not change it. It reads no table and takes no transaction: a probe for waiters to poll often."""
        with self._lock, readable_errors(self.path):
            return int(self._db().execute("PRAGMA data_version").fetchone()[0])

    def _get(self, key: str) -> Any:
        with self._read() as con:
            return _kv(con, key)

    def _set(self, key: str, value: Any) -> None:
        with self._write() as con:
            _set_kv(con, key, value)

    # -- shards ---------------------------------------------------------------------------------

    def shards(self) -> list[ShardRecord]:
        """All published shards, oldest first."""
        with self._read() as con:
            return [record(r) for r in con.execute(f"SELECT {COLUMNS} FROM shards ORDER BY created, id", clock(con))]

    def shard(self, shard_id: str) -> ShardRecord | None:
        """The published shard ``shard_id`` (one index lookup), or None."""
        with self._read() as con:
            row = con.execute(f"SELECT {COLUMNS} FROM shards WHERE id = :id", {**clock(con), "id": shard_id}).fetchone()
        return None if row is None else record(row)

    def newest(self, n: int) -> list[ShardRecord]:
        """The ``n`` newest published shards, newest first (one index walk)."""
        with self._read() as con:
            rows = con.execute(f"SELECT {COLUMNS} FROM shards INDEXED BY shards_age WHERE state IN (0, 1) "
                               "ORDER BY created DESC, id DESC LIMIT :n", {**clock(con), "n": n}).fetchall()
        return [record(r) for r in rows]

    def cached_units(self, keys: Iterable[str]) -> set[str]:
        """Which of ``keys`` are units of a published shard."""
        out = set()
        with self._read() as con:
            for key in keys:
                for (units,) in con.execute("SELECT s.units FROM units u JOIN shards s ON s.n = u.shard "
                                            "WHERE u.h = ?", (_unit_hash(key),)):
                    if key in json.loads(units):  # a hash collision is not a hit
                        out.add(key)
                        break
        return out

    def schemas(self) -> set[str]:
        """The distinct schema fingerprints of the published shards (none recorded: not included)."""
        with self._read() as con:
            return {fp for (fp,) in con.execute("SELECT DISTINCT schema FROM shards WHERE schema != ''")}

    def filenames(self) -> set[str]:
        """The file names of all published shards (for joining against a directory listing)."""
        with self._read() as con:
            return {file or f"{sid}.{checksum}{SHARD_SUFFIX}"
                    for sid, file, checksum in con.execute("SELECT id, file, checksum FROM shards")}

    def publish(self, record: ShardRecord, cursor: dict[str, Any] | None = None) -> None:
        """Make ``record`` visible, move the cursor past its units and free the reservation, atomically."""
        with self._write() as con:
            _insert(con, [record])
            if cursor is not None:
                _set_kv(con, "cursor", cursor)
            _set_kv(con, "reserved", 0)
            _incr(con, "published", 1)

    def adopt(self, records: Sequence[ShardRecord]) -> None:
        """Record shards found whole on disk but unknown to the ledger (a crash before publish)."""
        with self._write() as con:
            _insert(con, records)
            _incr(con, "adopted", len(records))

    def drop(self, shard_ids: Sequence[str]) -> None:
        """Forget shards (used when their files are gone); their files are the caller's business."""
        with self._write() as con:
            _delete(con, shard_ids)

    def mark_verified(self, shard_ids: Sequence[str]) -> None:
        """Record that these shards' checksums were checked on this host (readers skip them after)."""
        with self._write() as con:
            con.executemany("UPDATE shards SET verified = 1 WHERE id = ?", ((sid,) for sid in shard_ids))

    # -- quarantine -----------------------------------------------------------------------------

    def quarantine(self, shard_id: str, reason: str) -> ShardRecord | None:
        """Move a shard's record to the quarantine, its bytes still charged; None if not published."""
        with self._write() as con:
            row = con.execute(f"SELECT {COLUMNS} FROM shards WHERE id = :id", {**clock(con), "id": shard_id}).fetchone()
            if row is None:
                return None
            found = record(row)
            _delete(con, [shard_id])
            data = {**found.__dict__, "units": list(found.units)}
            con.execute("INSERT OR REPLACE INTO quarantine VALUES (?, ?, ?, ?, ?)",
                        (shard_id, json.dumps(data), found.nbytes, reason, time.time()))
            _incr(con, "quarantined", 1)
        return found

    def quarantined(self) -> list[Quarantined]:
        """Quarantined shards, oldest quarantine first."""
        with self._read() as con:
            rows = con.execute("SELECT record, reason, at FROM quarantine ORDER BY at").fetchall()
        return [Quarantined(ShardRecord.from_dict(json.loads(data)), reason, at) for data, reason, at in rows]

    def forget_quarantined(self, shard_ids: Sequence[str]) -> None:
        """Stop charging quarantined shards (call once their files are gone)."""
        with self._write() as con:
            con.executemany("DELETE FROM quarantine WHERE id = ?", ((sid,) for sid in shard_ids))

    # -- budget ---------------------------------------------------------------------------------

    def usage(self) -> Usage:
        """Byte accounting from the kept totals: O(1) in the number of shards."""
        with self._read() as con:
            shards, nbytes, rows = con.execute(
                "SELECT sum(shards), sum(bytes), sum(rows) FROM totals").fetchone()
            retiring = con.execute("SELECT bytes FROM totals WHERE state = 1").fetchone()[0]
            reserved = int(_kv(con, "reserved") or 0)
            quarantined = con.execute("SELECT coalesce(sum(bytes), 0) FROM quarantine").fetchone()[0]
            leases = len(_live_leases(con))
        return Usage(shard_bytes=nbytes, reserved_bytes=reserved, ledger_bytes=self.disk_bytes(), shards=shards,
                     rows=rows, leases=leases, quarantined_bytes=quarantined, retiring_bytes=retiring)

    def disk_bytes(self) -> int:
        """Bytes charged to the ledger: twice its database (a transaction that rewrites every record, a
        first epoch's record marking every shard trained, puts as much in the WAL) plus
        :data:`LEDGER_RESERVE`. Charged whether or not the WAL is there now, so a closed ledger (WAL
        removed) never looks like free room."""
        try:
            return 2 * os.stat(self.path).st_size + LEDGER_RESERVE
        except FileNotFoundError:
            return LEDGER_RESERVE

    def make_room(
        self, nbytes: int, budget: int, choose: Chooser, evict_to: int | None = None
    ) -> list[ShardRecord] | None:
        """Reserve ``nbytes`` within ``budget`` (with :data:`PUBLISH_GROWTH` to spare), evicting the
        shards that ``choose`` picks.

        Quarantined files count as used bytes but are never picked here: the caller purges them
        (:func:`epochcache.cache.quarantine.purge_quarantine`) before asking for room it lacks.
        Eviction runs in batches: once room must be made, enough is picked to bring usage (with the
        reservation) down to ``evict_to`` bytes (default ``budget``), so a cache that trainers keep
        leased still rotates that fraction at each epoch boundary instead of one shard.

        ``choose`` orders all shards not yet retiring, leased or not, so a policy is never bent by
        leases. Picked shards become *retiring*: new snapshots leave them out, and each is evicted as
        soon as no lease holds it. Returns the evicted records (already removed from the ledger; the
        caller deletes their files), or None when the retiring shards free too little yet; then
        nothing is reserved and the caller waits. ``choose=lambda *_: []`` reserves only if the room
        is free and never retires anything. Cost: O(k log n) for k victims with an indexed chooser.
        """
        with self._write() as con:
            shard_bytes = con.execute("SELECT sum(bytes) FROM totals").fetchone()[0]
            quarantined = con.execute("SELECT coalesce(sum(bytes), 0) FROM quarantine").fetchone()[0]
            reserved = int(_kv(con, "reserved") or 0)
            used = shard_bytes + quarantined + reserved + self.disk_bytes()
            need = used + nbytes + PUBLISH_GROWTH - budget
            victims: list[ShardRecord] = []
            if need > 0:
                goal = max(need, used + nbytes + PUBLISH_GROWTH - (budget if evict_to is None else evict_to))
                retiring_bytes = con.execute("SELECT bytes FROM totals WHERE state = 1").fetchone()[0]
                if goal > retiring_bytes:
                    picks = _choose(con, choose, goal - retiring_bytes)
                    now = clock(con)  # their counts are folded in: snapshots leave retiring shards out
                    con.executemany(f"UPDATE shards SET {FOLD}, state = 1 WHERE id = :id",
                                    ({**now, "id": r.id} for r in picks))
                victims = take_until(_unleased_retiring(con), goal)
                if sum(v.nbytes for v in victims) < need:
                    return None
                _delete(con, [v.id for v in victims])
            _set_kv(con, "reserved", reserved + nbytes)
            if victims:
                _incr(con, "evicted", len(victims))
                label = getattr(choose, "label", None)
                for victim in victims:
                    name = label(victim) if label is not None else getattr(choose, "name", "unnamed")
                    _incr(con, f"evicted.{name}", 1)
        return victims

    def clear_reservation(self) -> None:
        """Forget the bytes reserved for a shard that will not be published."""
        self._set("reserved", 0)

    def clear_retiring(self) -> None:
        """Return retiring shards to snapshots (at daemon start: their retirement was never finished)."""
        with self._write() as con:
            con.execute("UPDATE shards SET state = 0 WHERE state = 1")

    # -- leases ---------------------------------------------------------------------------------

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
        with self._write() as con:
            if _new_use(con, use):
                advance(con, now)
            upto = con.execute("SELECT coalesce(max(n), 0) FROM shards").fetchone()[0]
            con.execute("INSERT INTO lease_excluded SELECT ?, n FROM shards INDEXED BY shards_age WHERE state = 1",
                        (lease_id,))
            count = con.execute("SELECT shards FROM totals WHERE state = 0").fetchone()[0]
            con.execute("INSERT INTO leases VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (lease_id, owner, holder.host, holder.pid, holder.started, now + ttl_s, now, upto, count))
        return Lease(id=lease_id, owner=owner, shards=self._read_lease(lease_id, upto), expires=now + ttl_s)

    def _read_lease(self, lease_id: str, upto: int) -> tuple[ShardRecord, ...]:
        """The lease's records; if they cannot be read, the lease ends (no caller could release it)."""
        try:
            with self._read() as con:
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
        with self._write() as con:
            lease = con.execute("SELECT upto FROM leases WHERE id = ?", (lease_id,)).fetchone()
            if lease is None:
                return
            fresh = con.execute(
                "SELECT n, units, rows FROM shards INDEXED BY shards_untrained WHERE trained = 0 AND n <= ? "
                "AND n NOT IN (SELECT shard FROM lease_excluded WHERE lease = ?)", (lease[0], lease_id)).fetchall()
            distinct_new = 0.0
            for _, units_json, rows in fresh:
                units = json.loads(units_json)
                before = con.total_changes
                con.executemany("INSERT OR IGNORE INTO trained_units VALUES (?)", ((_unit_hash(u),) for u in units))
                if units:
                    distinct_new += rows * (con.total_changes - before) / len(units)
            con.executemany("UPDATE shards SET trained = 1 WHERE n = ?", ((n,) for n, _, _ in fresh))
            _add_epoch(con, lease_id, now, samples, distinct_new)

    def epochs(self, last: int = 1) -> list[dict[str, Any]]:
        """The ``last`` epochs' records, oldest first: ``n`` (1 for the cache's first), ``at``, ``lease``,
        ``samples`` (that epoch),
        ``trained`` and ``distinct_trained`` (samples, every epoch so far; distinct at unit level,
        a unit's rows counted as its shard's rows per unit), ``fetched_bytes`` (so far), ``cache_bytes``
        (the shards') and ``remote_rows`` (the daemon's estimate then; None while unknown)."""
        with self._read() as con:
            rows = con.execute("SELECT n, at, lease, samples, trained, distinct_trained, fetched_bytes, cache_bytes, "
                               "remote_rows FROM epochs ORDER BY n DESC LIMIT ?", (last,)).fetchall()
        keys = ("n", "at", "lease", "samples", "trained", "distinct_trained", "fetched_bytes", "cache_bytes",
                "remote_rows")
        return [dict(zip(keys, row)) for row in reversed(rows)]

    def renew(self, lease_id: str, ttl_s: float) -> bool:
        """Push a lease's expiry ``ttl_s`` into the future; False if it had already ended."""
        with self._write() as con:
            if lease_id not in {lease["id"] for lease in _live_leases(con)}:
                return False
            con.execute("UPDATE leases SET expires = ? WHERE id = ?", (time.time() + ttl_s, lease_id))
        return True

    def release(self, lease_id: str) -> None:
        with self._write() as con:
            _end_leases(con, [lease_id])

    def purge_expired(self) -> int:
        """Delete ended leases (owner dead, or TTL past for another host's) from the database; how many."""
        with self._write() as con:
            live = {lease["id"] for lease in _live_leases(con)}
            ended = [lid for (lid,) in con.execute("SELECT id FROM leases") if lid not in live]
            _end_leases(con, ended)
        return len(ended)

    def leases(self, with_shards: bool = True) -> list[dict[str, Any]]:
        """Live leases as ``{"id", "owner", "host", "pid", "shards", "expires", "taken"}`` dicts;
        ``shards`` lists the shard ids, or with ``with_shards=False`` is their count (no shard read)."""
        with self._read() as con:
            leases = _live_leases(con)
            for lease in leases:
                if with_shards:
                    lease["shards"] = [sid for (sid,) in con.execute(
                        "SELECT id FROM shards WHERE n <= ? AND n NOT IN "
                        "(SELECT shard FROM lease_excluded WHERE lease = ?) ORDER BY created, id",
                        (lease["upto"], lease["id"]))]
                del lease["upto"]
        return leases

    # -- sampler state --------------------------------------------------------------------------

    def cursor(self) -> dict[str, Any] | None:
        return self._get("cursor")  # type: ignore[no-any-return]

    def set_cursor(self, cursor: dict[str, Any]) -> None:
        self._set("cursor", cursor)

    def listing(self) -> dict[str, Any] | None:
        return self.stream_listing("")

    def set_listing(self, listing: dict[str, Any]) -> None:
        self.set_stream_listing("", listing)

    # Each source (a stream, by its name) has its own listing header; ``""`` is the unnamed single source.

    def stream_listing(self, stream: str) -> dict[str, Any] | None:
        return self._get("listing:" + stream)  # type: ignore[no-any-return]

    def set_stream_listing(self, stream: str, listing: dict[str, Any]) -> None:
        self._set("listing:" + stream, listing)

    # The remote listing in pages, written as the listing streams in: (stream, page number) -> a
    # list of ``(path, size, etag)``; the stream's listing header holds which pass, how many objects
    # and the page starts.

    def listing_page(self, number: int, stream: str = "") -> list[tuple[str, int, str | None]] | None:
        """Page ``number`` of ``stream``'s listing as ``(path, size, etag)`` rows; None if absent."""
        with self._read() as con:
            row = con.execute("SELECT objects FROM listing_pages WHERE stream = ? AND number = ?",
                              (stream, number)).fetchone()
        return None if row is None else [(p[0], p[1], p[2] if len(p) > 2 else None) for p in json.loads(row[0])]

    def set_listing_page(self, number: int, objects: list[tuple[str, int, str | None]], stream: str = "") -> None:
        with self._write() as con:
            con.execute("INSERT OR REPLACE INTO listing_pages VALUES (?, ?, ?)",
                        (stream, number, json.dumps([list(o) for o in objects])))

    def drop_listing_pages(self, stream: str = "") -> None:
        with self._write() as con:
            con.execute("DELETE FROM listing_pages WHERE stream = ?", (stream,))

    # -- daemon state ---------------------------------------------------------------------------

    def daemon_state(self) -> dict[str, Any] | None:
        """What the sync daemon last said it is doing (``{"pid", "state", "since", ...}``), for status."""
        return self._get("daemon")  # type: ignore[no-any-return]

    def set_daemon_state(self, state: dict[str, Any]) -> None:
        self._set("daemon", state)

    def update_daemon_state(self, fields: dict[str, Any]) -> None:
        """Merge ``fields`` into the daemon's state (keys not named keep their values)."""
        with self._write() as con:
            _set_kv(con, "daemon", {**(_kv(con, "daemon") or {}), **fields})

    # -- dataset identity -----------------------------------------------------------------------

    def identity(self) -> dict[str, Any] | None:
        """The dataset this cache holds (each source's url, format, columns, and the schema its rows
        produced), as recorded by the first daemon that wrote it; None for a new cache."""
        return self._get("identity")  # type: ignore[no-any-return]

    def set_identity(self, identity: dict[str, Any] | None) -> None:
        """Bind the cache to ``identity`` (None: unbind, when the cache is emptied on purpose)."""
        with self._write() as con:
            if identity is None:
                con.execute("DELETE FROM kv WHERE key = 'identity'")
            else:
                _set_kv(con, "identity", identity)

    # Units the daemon skipped after their reads kept failing: unit key -> a dict
    # ``{"path", "size", "index", "pass", "error"}`` (``index`` None: the object's metadata failed).

    def skipped(self) -> dict[str, dict[str, Any]]:
        """Every recorded skipped unit, by unit key."""
        with self._read() as con:
            return {unit: json.loads(info) for unit, info in con.execute("SELECT unit, info FROM skipped")}

    def set_skipped(self, unit_key: str, info: dict[str, Any]) -> None:
        with self._write() as con:
            con.execute("INSERT OR REPLACE INTO skipped VALUES (?, ?)", (unit_key, json.dumps(info)))

    def drop_skipped(self, unit_key: str) -> None:
        with self._write() as con:
            con.execute("DELETE FROM skipped WHERE unit = ?", (unit_key,))

    # -- counters -------------------------------------------------------------------------------

    def incr(self, name: str, delta: int = 1) -> None:
        with self._write() as con:
            _incr(con, name, delta)

    def counters(self) -> dict[str, int]:
        with self._read() as con:
            return dict(con.execute("SELECT name, value FROM counters"))


# -- statements (inside a transaction) ------------------------------------------------------------


def _new_use(con: sqlite3.Connection, use: str | None) -> bool:
    """Whether a snapshot naming ``use`` counts a use: unnamed, or a name none of the last
    :data:`_USES_NAMED` snapshots gave (each of several trainers on one cache names its own epochs)."""
    if use is None:
        return True
    named = _kv(con, "uses_named") or []
    if use in named:
        return False
    _set_kv(con, "uses_named", [*named, use][-_USES_NAMED:])
    return True


def _kv(con: sqlite3.Connection, key: str) -> Any:
    row = con.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
    return None if row is None else json.loads(row[0])


def _set_kv(con: sqlite3.Connection, key: str, value: Any) -> None:
    con.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (key, json.dumps(value)))


def _incr(con: sqlite3.Connection, name: str, delta: int) -> None:
    con.execute("INSERT INTO counters VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
                (name, delta))


def _insert(con: sqlite3.Connection, records: Sequence[ShardRecord]) -> None:
    """Insert (or replace, by id) shard records and index their units."""
    _delete(con, [r.id for r in records])
    for r in records:
        canonical = f"{r.id}.{r.checksum}{SHARD_SUFFIX}"
        cur = con.execute(
            "INSERT INTO shards (id, file, bytes, rows, created, checksum, units, uses, last_used, recency, schema, "
            "verified, born) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, (SELECT g FROM generation))",
            (r.id, None if r.filename == canonical else r.filename, r.nbytes, r.rows, r.created, r.checksum,
             json.dumps(list(r.units)), r.uses, r.last_used, r.created if r.last_used is None else r.last_used,
             r.schema, int(r.verified)))
        con.executemany("INSERT OR IGNORE INTO units VALUES (?, ?)",
                        ((_unit_hash(unit), cur.lastrowid) for unit in r.units))


def _delete(con: sqlite3.Connection, shard_ids: Sequence[str]) -> None:
    for sid in shard_ids:
        row = con.execute("SELECT n, units FROM shards WHERE id = ?", (sid,)).fetchone()
        if row is None:
            continue
        n, units = row
        con.executemany("DELETE FROM units WHERE h = ? AND shard = ?", ((_unit_hash(u), n) for u in json.loads(units)))
        con.execute("DELETE FROM shards WHERE n = ?", (n,))


def _choose(con: sqlite3.Connection, choose: Chooser, short: int) -> list[ShardRecord]:
    """Live shards ``choose`` retires to free ``short`` bytes: by index walk if it has stages."""
    stages_of = getattr(choose, "stages", None)
    stages: list[Stage] | None = stages_of() if stages_of is not None else None
    if stages is None:  # an unindexed chooser sees every candidate
        rows = con.execute(f"SELECT {COLUMNS} FROM shards WHERE state = 0", clock(con)).fetchall()
        return list(choose([record(r) for r in rows], short))
    return choose_by_index(con, stages, short)


def _add_epoch(con: sqlite3.Connection, lease_id: str, now: float, samples: int, distinct_new: float) -> None:
    """Append an epoch row: the running totals go on from the last row."""
    trained, distinct = con.execute(
        "SELECT trained, distinct_trained FROM epochs ORDER BY n DESC LIMIT 1").fetchone() or (0, 0.0)
    fetched = con.execute("SELECT coalesce(max(value), 0) FROM counters WHERE name = 'fetched_bytes'").fetchone()[0]
    cache_bytes = con.execute("SELECT sum(bytes) FROM totals").fetchone()[0]
    progress = (_kv(con, "cursor") or {}).get("progress") or {}
    estimates = [value for key, value in progress.items() if key.endswith("remote_rows")]
    remote = sum(estimates) if estimates and all(isinstance(value, int) for value in estimates) else None
    con.execute("INSERT INTO epochs (at, lease, samples, trained, distinct_trained, fetched_bytes, cache_bytes, "
                "remote_rows) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (now, lease_id, samples, trained + samples, distinct + distinct_new, fetched, cache_bytes, remote))


def _unleased_retiring(con: sqlite3.Connection) -> list[ShardRecord]:
    """Retiring shards no live lease holds, oldest first."""
    live = _live_leases(con)
    rows = con.execute(f"SELECT {COLUMNS} FROM shards INDEXED BY shards_age WHERE state = 1 "
                       "ORDER BY created, id", clock(con)).fetchall()
    if not live:
        return [record(r) for r in rows]
    held: dict[str, set[int]] = {
        lease["id"]: {n for (n,) in con.execute("SELECT shard FROM lease_excluded WHERE lease = ?", (lease["id"],))}
        for lease in live
    }
    return [record(r) for r in rows
            if not any(r[0] <= lease["upto"] and r[0] not in held[lease["id"]] for lease in live)]


def _live_leases(con: sqlite3.Connection) -> list[dict[str, Any]]:
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


def _end_leases(con: sqlite3.Connection, lease_ids: Sequence[str]) -> None:
    for lid in lease_ids:
        con.execute("DELETE FROM lease_excluded WHERE lease = ?", (lid,))
        con.execute("DELETE FROM leases WHERE id = ?", (lid,))
