"""The ledger's quarantine: records of shards taken out of the shard set, their bytes still charged.

In: the ledger's database. Out, through :class:`QuarantineTable` (``Ledger.quarantine``): a shard's
record moved to the quarantine (:meth:`QuarantineTable.add`), the entries, and their end once the
files are gone. Moving the files is :mod:`epochcache.cache.quarantine`'s part; this keeps the
invariant that a quarantined file's bytes stay charged until :meth:`QuarantineTable.forget`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from epochcache.cache.ledger_db import LedgerDatabase, delete_shards, incr
from epochcache.cache.ledger_records import Quarantined, ShardRecord
from epochcache.cache.ledger_uses import COLUMNS, clock, record


class QuarantineTable:
    """The ``quarantine`` table of ``db``."""

    def __init__(self, db: LedgerDatabase) -> None:
        self._db = db

    def add(self, shard_id: str, reason: str) -> ShardRecord | None:
        """Move a shard's record to the quarantine, its bytes still charged; None if not published."""
        with self._db.write() as con:
            row = con.execute(f"SELECT {COLUMNS} FROM shards WHERE id = :id", {**clock(con), "id": shard_id}).fetchone()
            if row is None:
                return None
            found = record(row)
            delete_shards(con, [shard_id])
            data = {**found.__dict__, "units": list(found.units)}
            con.execute("INSERT OR REPLACE INTO quarantine VALUES (?, ?, ?, ?, ?)",
                        (shard_id, json.dumps(data), found.nbytes, reason, time.time()))
            incr(con, "quarantined", 1)
        return found

    def entries(self) -> list[Quarantined]:
        """Quarantined shards, oldest quarantine first."""
        with self._db.read() as con:
            rows = con.execute("SELECT record, reason, at FROM quarantine ORDER BY at").fetchall()
        return [Quarantined(ShardRecord.from_dict(json.loads(data)), reason, at) for data, reason, at in rows]

    def forget(self, shard_ids: Sequence[str]) -> None:
        """Stop charging quarantined shards (call once their files are gone)."""
        with self._db.write() as con:
            con.executemany("DELETE FROM quarantine WHERE id = ?", ((sid,) for sid in shard_ids))
