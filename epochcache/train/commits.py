"""CommitMarks: whether any connection has committed to the ledger since a mark, read from shared memory.

In: the ledger's database path (SQLite in WAL mode). Out: :meth:`CommitMarks.now`, the WAL-index
header: the first 96 bytes (two copies of a 48-byte header) of the ``-shm`` file SQLite keeps beside
the database while it is open, mapped read-only once. Every commit of any connection, this process's
included, rewrites it (the WAL's frame count, checksums and change counter; a WAL restart its salt),
so a mark read again unchanged proves that nothing was committed in between: a memory read, where
``PRAGMA data_version`` at an epoch boundary (cold caches, after the gathers) took 60-90 µs. A
changed mark proves nothing: ask the ledger. A read that overlaps a commit sees bytes changed, never
the old header whole.

Invariant: marks are read only while this process's own ledger connection is open: SQLite truncates
the file only when a first connection opens it, and an open one keeps any other from being first,
so the mapped page never goes away under a read.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

# Two copies of the WAL-index header (SQLite's file format, "the wal-index"): what a commit rewrites.
_HEADER_BYTES = 96


class CommitMarks:
    """Marks of the ledger at ``database``; :meth:`now` is None where there is no WAL index to read."""

    def __init__(self, database: str | os.PathLike[str]):
        self._map: mmap.mmap | None = None
        try:
            with open(Path(f"{os.fspath(database)}-shm"), "rb") as file:
                self._map = mmap.mmap(file.fileno(), _HEADER_BYTES, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # no WAL index (another journal mode), or not yet initialised
            self._map = None

    def now(self) -> bytes | None:
        """The current mark: equal to an earlier one only if no connection committed in between."""
        return None if self._map is None else self._map[:_HEADER_BYTES]

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
