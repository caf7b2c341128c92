"""The shard records a lease hands to its reader, read once per process and reused.

A lease holds every shard published up to a row number less its excluded rows (see
:meth:`epochcache.cache.ledger_leases.Leases.snapshot`). Its records carry what a reader needs: file name,
bytes, rows, checksum, schema, whether the checksum was verified, creation time; neither unit keys
nor use counts (``units`` empty, ``uses`` 0, ``last_used`` None: the ledger's own records have them).
Those fields never change for a row (a row number is never reused in a database; only ``verified``
turns true), so a process that leases the cache epoch after epoch decodes each shard's record once:
each later lease of the same database (its ``database`` name in ``kv``: a rebuilt ledger has
another) reads two columns per shard and decodes only the rows that are new or newly verified.

In: a connection inside a read transaction. Out: a tuple of :class:`ShardRecord`, in row order.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from typing import Any

from epochcache.cache.ledger_records import ShardRecord
from epochcache.cache.ledger_uses import FILENAME

_STATIC = f"n, id, {FILENAME}, bytes, rows, created, checksum, schema, verified"
_new, _set = object.__new__, object.__setattr__


def _decode(rows: Iterable[tuple[Any, ...]]) -> dict[int, ShardRecord]:
    """Records of rows of :data:`_STATIC`, by row number."""
    out: dict[int, ShardRecord] = {}
    for n, sid, filename, nbytes, count, created, checksum, schema, verified in rows:
        # Given its __dict__ whole rather than through the frozen dataclass's __init__ (one
        # object.__setattr__ per field): a first lease decodes every record of the cache. ``uses`` and
        # ``last_used`` are left to the dataclass's defaults (class attributes: 0 and None).
        record: ShardRecord = _new(ShardRecord)
        _set(record, "__dict__", {"id": sid, "filename": filename, "nbytes": nbytes, "rows": count,
                                  "created": created, "checksum": checksum, "units": (), "schema": schema,
                                  "verified": verified == 1})
        out[n] = record
    return out


class LeasedRecords:
    """Reads a lease's records, keeping the last lease's by row number for the next (one per Ledger)."""

    def __init__(self) -> None:
        self._known: dict[int, ShardRecord] = {}
        self._database = ""  # the name of the database they were read from

    def read(self, con: sqlite3.Connection, lease_id: str, upto: int) -> tuple[ShardRecord, ...]:
        """The records of lease ``lease_id`` (rows ``<= upto`` less its excluded rows), in row order."""
        excluded = {n for (n,) in con.execute("SELECT shard FROM lease_excluded WHERE lease = ?", (lease_id,))}
        database = con.execute("SELECT value FROM kv WHERE key = 'database'").fetchone()[0]
        found = self._reuse(con, upto) if self._known and database == self._database else None
        if found is None:  # the first lease of this process, or most records changed: read every one
            found = _decode(con.execute(f"SELECT {_STATIC} FROM shards WHERE n <= ? ORDER BY n", (upto,)))
        self._known, self._database = found, database
        if not excluded:
            return tuple(found.values())
        return tuple(record for n, record in found.items() if n not in excluded)

    def _reuse(self, con: sqlite3.Connection, upto: int) -> dict[int, ShardRecord] | None:
        """Every row up to ``upto``: the known records whose ``verified`` is unchanged, the others read
        one by one; None if more than a quarter changed (one scan of them all is cheaper)."""
        known = self._known
        rows = con.execute("SELECT n, verified FROM shards WHERE n <= ? ORDER BY n", (upto,)).fetchall()
        stale = [n for n, verified in rows if n not in known or known[n].verified != (verified == 1)]
        if len(stale) * 4 > len(rows):
            return None
        fresh = _decode(row for n in stale for row in con.execute(f"SELECT {_STATIC} FROM shards WHERE n = ?", (n,)))
        return {n: fresh[n] if n in fresh else known[n] for n, _ in rows}
