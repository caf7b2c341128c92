"""Footers of remote files kept on disk: each file's footer is read from the remote once per version,
not once per pass, per daemon start, or per unit once it has left the sources' memory.

In: the footer bytes a source read and checked (a Parquet or Arrow IPC file's tail, confirmed by a
second read or against the whole object), keyed by the object's listed version (path, ETag, size).
Out: those bytes for the same version, or None. Why on disk: a source keeps a few hundred parsed
footers in memory; a mixing window (``sampler.mix_units`` up to 1024 objects) interleaves more, and
every pass and every restart would read each footer again (two GETs over a network).

Invariants: a version is keyed by its ETag, so a rewritten object is never answered with its old
footer; bytes come back only if their xxh64, stored with them, still matches (a damaged entry is
dropped and read from the remote again); the store's files stay within the budget it is given, which
the daemon sets apart from ``cache.max_bytes`` (:meth:`epochcache.config.CacheConfig.footer_charge`).
Objects without an ETag (stores that give none) are not kept: nothing would pin them.
Values are raw bytes in diskcache's SQLite (no pickle); one connection per thread that uses it.
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import diskcache
import xxhash

from epochcache.sources.base import RemoteObject

log = logging.getLogger(__name__)

# SQLite's write-ahead log is checkpointed every this many pages (and cut back to half this after):
# beyond a transaction's own pages, the most the log and its shared-memory index take.
_WAL_PAGES = 32
_WAL_BYTES = 256 * 1024
_DIGEST = 8  # bytes of xxh64 before the footer
# What a store that cannot be used raises: SQLite's errors (a full disk, a damaged or locked database),
# the file system's, and diskcache's own for a database locked past its timeout.
_STORE_ERRORS = (sqlite3.Error, OSError, diskcache.Timeout)
_T = TypeVar("_T")


class FooterStore:
    """Footers by object version in ``directory`` (made if missing), its files within ``budget`` bytes:
    the oldest stored go first; a footer over a sixteenth of the budget is not kept.

    A store that fails (a full disk, a damaged database) costs requests, never a read: it is switched
    off for the rest of the run with one warning, and every footer is then read from the remote. A
    database damaged before it opens is emptied and made afresh."""

    def __init__(self, directory: str | Path, budget: int) -> None:
        self._largest = budget // 16
        # diskcache culls once the database is over size_limit, after a store: over it by at most one
        # footer, with as much again in the log until the checkpoint (the page size aside).
        self._size_limit = budget - 2 * self._largest - _WAL_BYTES
        if self._size_limit <= 0:
            raise ValueError(f"a footer store of {budget} bytes has no room for footers: give it at least 1MiB")
        self._directory = Path(directory)
        self._cache: diskcache.Cache | None = None
        self._said_off = False
        try:
            self._cache = self._open()
        except _STORE_ERRORS as exc:
            # (OperationalError, a full disk or a lock, is a DatabaseError too, but says nothing of the file)
            if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
                log.warning("the footer store %s is damaged (%s): emptied", self._directory, exc)
                self._cache = self._guarded(self._reopen_empty)
            else:
                self._switch_off(exc)

    def _reopen_empty(self) -> diskcache.Cache:
        shutil.rmtree(self._directory)
        return self._open()

    def _open(self) -> diskcache.Cache:
        return diskcache.Cache(
            str(self._directory), size_limit=self._size_limit, eviction_policy="least-recently-stored",
            disk_min_file_size=2**31,  # every value in the database: its size is what the limit counts
            sqlite_cache_size=-1024,  # KiB per connection (a connection per thread): not diskcache's 32 MiB
            sqlite_mmap_size=0, sqlite_wal_autocheckpoint=_WAL_PAGES, sqlite_journal_size_limit=_WAL_BYTES // 2,
        )

    def get(self, kind: str, obj: RemoteObject) -> bytes | None:
        """The footer stored for this version of ``obj`` read as ``kind``, or None (none stored, no
        ETag, the store off, or an entry whose checksum no longer matches: dropped)."""
        key = _key(kind, obj)
        cache = self._cache
        if key is None or cache is None:
            return None
        value = self._guarded(lambda: cache.get(key))
        if not isinstance(value, bytes):
            return None
        footer = value[_DIGEST:]
        if xxhash.xxh64_digest(footer) != value[:_DIGEST]:
            log.warning("the stored footer of %s was damaged on disk: dropped, read from the remote again", obj.path)
            self._guarded(lambda: cache.delete(key))
            return None
        return footer

    def put(self, kind: str, obj: RemoteObject, footer: bytes) -> None:
        """Keep ``footer`` (checked by the caller) for this version of ``obj``; objects without an ETag
        and footers over a sixteenth of the budget are not kept."""
        key = _key(kind, obj)
        cache = self._cache
        if key is not None and cache is not None and len(footer) <= self._largest:
            value = xxhash.xxh64_digest(footer) + bytes(footer)
            self._guarded(lambda: cache.set(key, value))

    def forget(self, kind: str, obj: RemoteObject) -> None:
        """Drop the footer of ``obj`` (suspected damaged: its next read goes to the remote)."""
        key = _key(kind, obj)
        cache = self._cache
        if key is not None and cache is not None:
            self._guarded(lambda: cache.delete(key))

    def close(self) -> None:
        """Close the calling thread's connection (the others close with their threads)."""
        if self._cache is not None:
            self._cache.close()

    def _guarded(self, operation: Callable[[], _T]) -> _T | None:
        """``operation()``; None, the store switched off, if it fails (a dropped footer not dropped
        must not be served again: nothing is, from then on)."""
        try:
            return operation()
        except _STORE_ERRORS as exc:
            self._switch_off(exc)
            return None

    def _switch_off(self, exc: BaseException) -> None:
        if not self._said_off:
            log.warning("footers are no longer kept in %s (each is read from the remote): %s", self._directory, exc)
        self._said_off, self._cache = True, None


def _key(kind: str, obj: RemoteObject) -> str | None:
    return None if not obj.etag else f"{kind}\n{obj.path}\n{obj.etag}\n{obj.size}"
