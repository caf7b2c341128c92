"""CommitMarks: whether any connection has committed to the ledger since a mark, read from shared memory.

In: the ledger's database path (SQLite in WAL mode). Out: :meth:`CommitMarks.now`, the WAL-index
header: the first 96 bytes (two copies of a 48-byte header) of the ``-shm`` file SQLite keeps beside
the database while it is open, mapped read-only. Every commit of any connection, this process's
included, rewrites it (the WAL's frame count, checksums and change counter; a WAL restart its salt),
so a mark read again unchanged proves that nothing was committed in between: a memory read, where
``PRAGMA data_version`` at an epoch boundary (cold caches, after the gathers) took 60-90 µs. A
changed mark proves nothing: ask the ledger. A read that overlaps a commit sees bytes changed, never
the old header whole.

Invariants: marks are read only while this process's own ledger connection is open: SQLite truncates
the file only when a first connection opens it, and an open one keeps any other from being first,
so the mapped page never goes away under a read. That holds only while the process keeps SQLite's
read lock on the file, a POSIX lock, which the kernel drops when the process closes *any*
descriptor of the file: so this module never closes one while the file is in use. Each ``-shm``
file (by inode) is opened and mapped once per process and kept (:func:`_header_of`); only once it is
deleted (SQLite deletes it when the last connection anywhere closes, and then no connection can use
it) are its descriptor and map closed. (Opening and closing it per loader let another process, a
second rank or ``epochcache status``, take itself for the first connection, truncate the file under
this process's live connection and end it with SIGBUS in SQLite.)
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

# Two copies of the WAL-index header (SQLite's file format, "the wal-index"): what a commit rewrites.
_HEADER_BYTES = 96

# (device, inode) of each -shm file opened -> the descriptors opened of it (one, but for a race) and its
# header's map (None: the file was shorter than a header when last tried), kept for the process's
# life while the file exists.
_OPEN: dict[tuple[int, int], tuple[list[int], mmap.mmap | None]] = {}
_OPEN_LOCK = threading.Lock()


def _header_of(shm: Path) -> mmap.mmap | None:
    """The map of ``shm``'s WAL-index header, opened once per file per process and never closed while
    the file exists; None if there is no such file or it holds no header yet."""
    with _OPEN_LOCK:
        for key, (fds, header) in list(_OPEN.items()):  # deleted since: nothing can use them any more
            if os.fstat(fds[0]).st_nlink == 0:
                if header is not None:
                    header.close()
                for fd in fds:
                    os.close(fd)
                del _OPEN[key]
        try:
            known = os.stat(shm)  # (a look that opens nothing: see the module docstring)
            fds, header = _OPEN.get((known.st_dev, known.st_ino), ([], None))
            if not fds:
                fd = os.open(shm, os.O_RDONLY)
                opened = os.fstat(fd)
                fds, header = _OPEN.get((opened.st_dev, opened.st_ino), ([], None))
                fds.append(fd)  # (to a file opened already only if it was replaced between the two looks)
                known = opened
        except OSError:  # no WAL index (another journal mode), or not there yet
            return None
        if header is None:
            try:
                header = mmap.mmap(fds[0], _HEADER_BYTES, access=mmap.ACCESS_READ)
            except ValueError:  # shorter than a header: not yet initialised
                header = None
        _OPEN[(known.st_dev, known.st_ino)] = (fds, header)
        return header


class CommitMarks:
    """Marks of the ledger at ``database``; :meth:`now` is None where there is no WAL index to read."""

    def __init__(self, database: str | os.PathLike[str]):
        self._map = _header_of(Path(f"{os.fspath(database)}-shm"))

    def now(self) -> bytes | None:
        """The current mark: equal to an earlier one only if no connection committed in between; None
        (ask the ledger) without one, as once the file was deleted under a live connection (a ledger
        rebuilt by another process) and its map closed here."""
        if self._map is None:
            return None
        try:
            return self._map[:_HEADER_BYTES]
        except ValueError:  # the map was closed: its file is gone
            return None

    def close(self) -> None:
        """No more marks from this object (the map stays open for the process: see the module docstring)."""
        self._map = None
