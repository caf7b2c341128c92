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
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from epochcache.cache.layout import SHARD_SUFFIX
from epochcache.cache.ledger_daemon import DaemonState
from epochcache.cache.ledger_db import (
    Counters,
    LedgerDatabase,
    delete_shards,
    incr,
    kv,
    open_here,
    set_kv,
    unit_hash,
)
from epochcache.cache.ledger_leases import Leases, end_ended_leases, live_leases, unleased_retiring
from epochcache.cache.ledger_quarantine import QuarantineTable
from epochcache.cache.ledger_records import Lease, Quarantined, ShardRecord, Stage, Usage, by_age, take_until
from epochcache.cache.ledger_schema import DB_NAME, LEGACY_DB_NAME, OPEN_PATIENCE_S, Connect, connect, open_elsewhere
from epochcache.cache.ledger_uses import COLUMNS, choose_by_index, clock, record, retire
from epochcache.cache.shard_files import whole_shards
from epochcache.errors import CacheError
from epochcache.sources.base import unit_path

__all__ = ["LEDGER_RESERVE", "OPEN_PATIENCE_S", "PUBLISH_GROWTH", "Chooser", "Lease", "Ledger", "Quarantined",
           "ShardRecord", "Stage", "Usage", "by_age", "take_until"]

log = logging.getLogger(__name__)

# The ledger is charged twice its database plus this reserve: the WAL's shared-memory index and its
# growth between two checkpoints (32 pages, see ledger_schema.connect), with room to spare.
LEDGER_RESERVE = 256 * 1024
# Each reservation also leaves room for the database's growth by the publish that follows (a record,
# its units and counters: a few pages), so the charge stays within the budget after the publish.
PUBLISH_GROWTH = 64 * 1024

# Victim chooser (an eviction policy): (shards not yet retiring, leased or not, bytes to free) ->
# shards to retire, in order. If it has a ``label(record) -> str`` method, evictions are counted per
# label (``evicted.fifo``, ``evicted.max_uses``...), else under its ``name``. If its ``stages()``
# gives :class:`Stage` values, the ledger walks them in turn by index (a shard picked by one stage
# is not picked again) instead of loading every candidate.
Chooser = Callable[[Sequence[ShardRecord], int], Sequence[ShardRecord]]

# The kv key of the ids of shards retired because the remote rewrote an object they hold rows of.
_OUTDATED = "outdated"


class Ledger:
    """Process-safe record of a cache directory's contents (see module docstring).

    ``directory`` is the cache's ledger folder (``CacheLayout.ledger``); its parent holds ``shards/``.
    ``connect`` opens the SQLite connection (tests inject one whose writes fail with a full disk).
    A ledger left by the diskcache-based epochcache is rebuilt from the shard files on first open.

    The shard records and the bytes they charge are its own methods; its parts, each on the same
    database: ``db`` (transactions, the change probe ``db.version()``), ``leases`` (epoch leases
    and epoch records), ``quarantine``, ``daemon`` (the sync daemon's state between runs) and
    ``counters`` (named totals).
    """

    def __init__(self, directory: str | Path, connect: Connect = connect) -> None:
        self._dir = Path(directory)
        self._dir.mkdir(parents=True, exist_ok=True)
        self.path = self._dir / DB_NAME
        legacy = self._dir / LEGACY_DB_NAME
        migrate = legacy.exists() and not self.path.exists()
        self.db = LedgerDatabase(self.path, connect)
        self.leases = Leases(self.db)
        self.quarantine = QuarantineTable(self.db)
        self.daemon = DaemonState(self.db)
        self.counters = Counters(self.db)
        if migrate:
            self._migrate(legacy)

    @classmethod
    def rebuild(cls, directory: str | Path, connect: Connect = connect, progress: bool | None = False) -> Ledger:
        """A new ledger built from the shard files next to ``directory``; the old database (damaged, or
        of another version) is deleted: its bytes are not charged to the budget, and every shard's
        record is in its file. Hold the cache's lock, with no connection of this process open on it.
        Reads every file (``progress``: a bar, see :mod:`epochcache.cache.progress`). Raises
        :class:`CacheError`, deleting nothing, while this or another process has the database open."""
        folder = Path(directory)
        # Deleted under them, its users would go on with the old database: their leases unseen by the
        # new one (so a daemon could evict what they read), their epochs blind to new shards. (A user
        # opening it while the rebuild runs is not seen: trainers take no lock on the cache.)
        if open_here(folder / DB_NAME):
            raise CacheError(f"the ledger {folder / DB_NAME} is open in this process (a loader or Ledger): close "
                             "it before rebuilding the ledger")
        if open_elsewhere(folder / DB_NAME):
            raise CacheError(
                f"the ledger {folder / DB_NAME} is open in another process (a trainer, `epochcache status`), or "
                "its -shm file is not this user's to lock: stop every process using this cache, then run "
                "`epochcache verify --fix` again (as the cache's owner)"
            )
        for name in (DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm", LEGACY_DB_NAME):
            (folder / name).unlink(missing_ok=True)
        ledger = cls(folder, connect)
        ledger._adopt_files("rebuilt the ledger", progress)
        return ledger

    def _migrate(self, legacy: Path) -> None:
        self._adopt_files(f"migrated the ledger {legacy} (diskcache) to {self.path}")
        for name in (LEGACY_DB_NAME, "cache.db-journal", "cache.db-wal", "cache.db-shm"):
            (self._dir / name).unlink(missing_ok=True)

    def _adopt_files(self, what: str, progress: bool | None = False) -> None:
        records = whole_shards(self._dir.parent / "shards", progress)
        self.adopt(records)
        log.warning("%s from %d shard files (each carries its record)", what, len(records))

    def close(self) -> None:
        self.db.close()

    # -- shards ---------------------------------------------------------------------------------

    def shards(self) -> list[ShardRecord]:
        """All published shards, oldest first."""
        with self.db.read() as con:
            return [record(r) for r in con.execute(f"SELECT {COLUMNS} FROM shards ORDER BY created, id", clock(con))]

    def pages(self, size: int = 1000) -> Iterator[list[ShardRecord]]:
        """All published shards, ``size`` at a time in publishing order (row number), each page in a
        read transaction of its own: a pass over a whole cache (a verify hashing every byte) holds
        neither every record in memory nor one long snapshot (it would keep WAL checkpoints from
        finishing). A shard published or removed while the pages are read may be left out."""
        after = 0
        while True:
            with self.db.read() as con:
                rows = con.execute(f"SELECT {COLUMNS} FROM shards WHERE n > :after ORDER BY n LIMIT :size",
                                   {**clock(con), "after": after, "size": size}).fetchall()
            if not rows:
                return
            yield [record(r) for r in rows]
            after = rows[-1][0]  # COLUMNS begins with the row number

    def shard(self, shard_id: str) -> ShardRecord | None:
        """The published shard ``shard_id`` (one index lookup), or None."""
        with self.db.read() as con:
            row = con.execute(f"SELECT {COLUMNS} FROM shards WHERE id = :id", {**clock(con), "id": shard_id}).fetchone()
        return None if row is None else record(row)

    def newest(self, n: int) -> list[ShardRecord]:
        """The ``n`` newest published shards, newest first (one index walk)."""
        with self.db.read() as con:
            rows = con.execute(f"SELECT {COLUMNS} FROM shards INDEXED BY shards_age WHERE state IN (0, 1) "
                               "ORDER BY created DESC, id DESC LIMIT :n", {**clock(con), "n": n}).fetchall()
        return [record(r) for r in rows]

    def cached_units(self, keys: Iterable[str]) -> set[str]:
        """Which of ``keys`` are units of a published shard (one retired as outdated does not count:
        see :meth:`retire_rewritten`)."""
        out = set()
        with self.db.read() as con:
            outdated = set(kv(con, _OUTDATED) or ())
            for key in keys:
                for sid, units in con.execute("SELECT s.id, s.units FROM units u JOIN shards s ON s.n = u.shard "
                                              "WHERE u.h = ?", (unit_hash(key),)):
                    if key in json.loads(units) and sid not in outdated:  # a hash collision is not a hit
                        out.add(key)
                        break
        return out

    def schemas(self) -> set[str]:
        """The distinct schema fingerprints of the published shards (none recorded: not included)."""
        with self.db.read() as con:
            return {fp for (fp,) in con.execute("SELECT DISTINCT schema FROM shards WHERE schema != ''")}

    def filenames(self) -> set[str]:
        """The file names of all published shards (for joining against a directory listing)."""
        with self.db.read() as con:
            return {file or f"{sid}.{checksum}{SHARD_SUFFIX}"
                    for sid, file, checksum in con.execute("SELECT id, file, checksum FROM shards")}

    def publish(self, record: ShardRecord, cursor: dict[str, Any] | None = None) -> None:
        """Make ``record`` visible, move the cursor past its units and free the reservation, atomically."""
        with self.db.write() as con:
            _insert(con, [record])
            if cursor is not None:
                set_kv(con, "cursor", cursor)
            set_kv(con, "reserved", 0)
            incr(con, "published", 1)

    def adopt(self, records: Sequence[ShardRecord]) -> None:
        """Record shards found whole on disk but unknown to the ledger (a crash before publish)."""
        with self.db.write() as con:
            _insert(con, records)
            incr(con, "adopted", len(records))

    def drop(self, shard_ids: Sequence[str]) -> None:
        """Forget shards (used when their files are gone); their files are the caller's business."""
        with self.db.write() as con:
            delete_shards(con, shard_ids)

    def mark_verified(self, shard_ids: Sequence[str]) -> None:
        """Record that these shards' checksums were checked on this host (readers skip them after)."""
        with self.db.write() as con:
            con.executemany("UPDATE shards SET verified = 1 WHERE id = ?", ((sid,) for sid in shard_ids))

    # -- budget ---------------------------------------------------------------------------------

    def usage(self) -> Usage:
        """Byte accounting from the kept totals: O(1) in the number of shards."""
        with self.db.read() as con:
            shards, nbytes, rows = con.execute(
                "SELECT sum(shards), sum(bytes), sum(rows) FROM totals").fetchone()
            retiring = con.execute("SELECT bytes FROM totals WHERE state = 1").fetchone()[0]
            reserved = int(kv(con, "reserved") or 0)
            quarantined = con.execute("SELECT coalesce(sum(bytes), 0) FROM quarantine").fetchone()[0]
            leases = len(live_leases(con))
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
        soon as no lease holds it. Returns the evicted records (their units left out; already removed
        from the ledger; the caller deletes their files), or None when the retiring shards free too
        little yet; then nothing is reserved and the caller waits. ``choose=lambda *_: []`` reserves only if the room
        is free and never retires anything. Cost: O(k log n) for k victims with an indexed chooser.
        Leases that ended unreleased (their owner killed) are deleted first, as ``epochcache gc`` does.
        """
        with self.db.write() as con:
            # A killed trainer's leases (no release) would be read by every later look at the leases.
            end_ended_leases(con)
            shard_bytes = con.execute("SELECT sum(bytes) FROM totals").fetchone()[0]
            quarantined = con.execute("SELECT coalesce(sum(bytes), 0) FROM quarantine").fetchone()[0]
            reserved = int(kv(con, "reserved") or 0)
            used = shard_bytes + quarantined + reserved + self.disk_bytes()
            need = used + nbytes + PUBLISH_GROWTH - budget
            victims: list[ShardRecord] = []
            if need > 0:
                goal = max(need, used + nbytes + PUBLISH_GROWTH - (budget if evict_to is None else evict_to))
                retiring_bytes = con.execute("SELECT bytes FROM totals WHERE state = 1").fetchone()[0]
                if goal > retiring_bytes:
                    picks = _choose(con, choose, goal - retiring_bytes)
                    retire(con, picks)
                victims = unleased_retiring(con, goal)
                if sum(v.nbytes for v in victims) < need:
                    return None
                delete_shards(con, [v.id for v in victims])
            set_kv(con, "reserved", reserved + nbytes)
            if victims:
                incr(con, "evicted", len(victims))
                label = getattr(choose, "label", None)
                names = Counter(label(v) for v in victims) if label is not None else \
                    Counter({getattr(choose, "name", "unnamed"): len(victims)})
                for name, count in names.items():  # (one statement a name, not a victim: batches run to 100,000)
                    incr(con, f"evicted.{name}", count)
        return victims

    def clear_reservation(self) -> None:
        """Forget the bytes reserved for a shard that will not be published."""
        self.db.set("reserved", 0)

    def clear_retiring(self) -> None:
        """Return retiring shards to snapshots (at daemon start: their retirement was never finished),
        except those retired as outdated (:meth:`retire_rewritten`), which never return."""
        with self.db.write() as con:
            con.execute("UPDATE shards SET state = 0 WHERE state = 1 AND id NOT IN (SELECT value FROM json_each(?))",
                        (json.dumps(kv(con, _OUTDATED) or []),))

    def retire_rewritten(self, paths: Collection[str]) -> tuple[list[ShardRecord], int]:
        """Retire for good the shards holding rows of ``paths``, objects the remote has rewritten since
        their rows were read. Those no lease holds are removed at once: their records are returned
        (the caller deletes their files). The others, held by a running epoch (which reads them to its
        end), leave new snapshots at once, never return to them (not at a daemon restart either:
        :meth:`clear_retiring`) and are evicted first, as any retiring shard, once no lease holds them.
        Either way their units no longer count as cached (:meth:`cached_units`): the next reads take
        the new version. Returns the records removed and how many shards wait for their leases.
        Reads every shard's unit list (only when a listing shows rewritten objects): O(units cached)."""
        wanted = set(paths)
        if not wanted:
            return [], 0
        with self.db.read() as con:
            hit = {sid for sid, units in con.execute("SELECT id, units FROM shards")
                   if any(unit_path(unit) in wanted for unit in json.loads(units))}
        if not hit:
            return [], 0
        with self.db.write() as con:
            retire(con, sorted(hit))
            removed = [r for r in unleased_retiring(con, need=None) if r.id in hit]
            delete_shards(con, [r.id for r in removed])
            # (the list keeps the retiring shards of earlier rewrites: any evicted since are dropped from it)
            retiring = {sid for (sid,) in con.execute("SELECT id FROM shards WHERE state = 1")}
            set_kv(con, _OUTDATED, sorted(retiring & (set(kv(con, _OUTDATED) or ()) | hit)))
            incr(con, "outdated", len(hit))
        return removed, len(hit) - len(removed)


def _choose(con: sqlite3.Connection, choose: Chooser, short: int) -> list[str]:
    """The ids of the live shards ``choose`` retires to free ``short`` bytes: by index walk if it has stages."""
    stages_of = getattr(choose, "stages", None)
    stages: list[Stage] | None = stages_of() if stages_of is not None else None
    if stages is None:  # an unindexed chooser sees every candidate
        rows = con.execute(f"SELECT {COLUMNS} FROM shards WHERE state = 0", clock(con)).fetchall()
        return [r.id for r in choose([record(r) for r in rows], short)]
    return choose_by_index(con, stages, short)


def _insert(con: sqlite3.Connection, records: Sequence[ShardRecord]) -> None:
    """Insert (or replace, by id) shard records and index their units."""
    delete_shards(con, [r.id for r in records])
    for r in records:
        canonical = f"{r.id}.{r.checksum}{SHARD_SUFFIX}"
        cur = con.execute(
            "INSERT INTO shards (id, file, bytes, rows, created, checksum, units, uses, last_used, recency, schema, "
            "verified, born) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, (SELECT g FROM generation))",
            (r.id, None if r.filename == canonical else r.filename, r.nbytes, r.rows, r.created, r.checksum,
             json.dumps(list(r.units)), r.uses, r.last_used, r.created if r.last_used is None else r.last_used,
             r.schema, int(r.verified)))
        con.executemany("INSERT OR IGNORE INTO units VALUES (?, ?)",
                        ((unit_hash(unit), cur.lastrowid) for unit in r.units))
