"""Footers of remote files kept on disk: each file's footer is read from the remote once per version,
not once per pass, per daemon start, or per unit once it has left the sources' memory.

In: the footer bytes a source read and checked (a Parquet or Arrow IPC file's tail, confirmed by a
second read or against the whole object), keyed by the object's listed version (path, ETag, size).
Out: those bytes for the same version, or None. Why on disk: a source keeps a few hundred parsed
footers in memory; a mixing window (``sampler.mix_units`` up to 1024 objects) interleaves more, and
every pass and every restart would read each footer again (two GETs over plain HTTP, one over TLS).

Invariants: a version is keyed by its ETag, so a rewritten object is never answered with its old
footer; bytes come back only if their xxh64, stored with them, still matches (a damaged entry is
dropped and read from the remote again); the store's files stay within the budget it is given, which
the daemon sets apart from ``cache.max_bytes`` (:meth:`epochcache.config.CacheConfig.footer_charge`).
Objects without an ETag are not kept, and the sources keep footers only of objects read over S3,
where every read is pinned to the listed ETag: elsewhere a rewrite in the same second at the same
size could keep the same version tag (``<mtime>-<size>``).
Values are raw bytes in diskcache's SQLite (no pickle); one connection per thread that uses it.
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import diskcache
import xxhash

from epochcache.config import FOOTER_STORE_LEAST
from epochcache.errors import CacheError
from epochcache.sources.base import RemoteObject, bare_etag

log = logging.getLogger(__name__)

# Beyond the footers' pages: the journal's header and the b-tree pages a store and a cull rewrite.
_SPARE_BYTES = 256 * 1024
# The least budget a store takes: half the least share (cache.footer_bytes), as a full cache's ledger
# may have grown a little since the share was set apart.
STORE_LEAST = FOOTER_STORE_LEAST // 2
_DIGEST = 8  # bytes of xxh64 before the footer
_LARGEST_SHARE = 32  # a footer over this fraction of the budget is not kept
_LOCK_WAIT_S = 5.0  # a store locked longer (only the daemon's threads write it) is switched off
# What a store that cannot be used raises: SQLite's errors (a full disk, a damaged or locked database,
# a row that is not a footer), the file system's, and diskcache's own for a database locked past its timeout.
_STORE_ERRORS = (sqlite3.Error, OSError, diskcache.Timeout)
_T = TypeVar("_T")


class FooterStore:
    """Footers by object version in ``directory`` (made if missing), its files within ``budget`` bytes:
    the oldest stored go first; a footer over 1/:data:`_LARGEST_SHARE` of the budget is not kept.

    One operation at a time (a lock: footers are read once per object per pass, so it costs nothing),
    each its own transaction under a rollback journal: no reader can hold a write-ahead log open
    while it grows, so the files' most is the database over its size limit by one footer plus one
    transaction's journal. A store that fails (a full disk, a damaged database) costs requests, never
    a read: it is switched off for the rest of the run with one warning, and every footer is then read
    from the remote; one found damaged is deleted, to be made afresh by the next run."""

    def __init__(self, directory: str | Path, budget: int) -> None:
        self._largest = budget // _LARGEST_SHARE
        # The files' most, after a store and its cull: the database over its limit by one footer, and
        # a transaction's journal (the pages of one footer, and one footer's pages moved by auto-vacuum).
        self._size_limit = budget - 3 * self._largest - _SPARE_BYTES
        if self._size_limit <= 0:
            raise ValueError(f"a footer store of {budget} bytes has no room for footers: give it at least "
                             f"{STORE_LEAST}")
        self._directory = Path(directory)
        self._lock = threading.Lock()
        self._cache: diskcache.Cache | None = None
        self._said_off = False
        with self._lock:
            try:
                self._cache = self._open()
            except _STORE_ERRORS as exc:
                if not _damaged(exc):
                    self._switch_off(exc)
                    return
                log.warning("the footer store %s is damaged (%s): emptied", self._directory, exc)
                self._cache = self._guarded(self._reopen_empty)

    def _reopen_empty(self) -> diskcache.Cache:
        shutil.rmtree(self._directory)
        return self._open()

    def _open(self) -> diskcache.Cache:
        cache = diskcache.Cache(
            str(self._directory), disk=_Footers, size_limit=self._size_limit, timeout=_LOCK_WAIT_S,
            eviction_policy="least-recently-stored",
            cull_limit=0,  # culled by _trim, one footer per transaction: diskcache's 10 at once journal 10
            disk_min_file_size=2**31,  # every value in the database: its size is what the limit counts
            sqlite_journal_mode="delete", sqlite_synchronous=0,  # (a cache: a damaged one is made afresh)
            sqlite_cache_size=-1024,  # KiB per connection (a connection per thread): not diskcache's 32 MiB
            sqlite_mmap_size=0,
        )
        _trim(cache)  # (a store kept under a larger share than this run's)
        return cache

    def get(self, kind: str, obj: RemoteObject) -> bytes | None:
        """The footer stored for this version of ``obj`` read as ``kind``, or None (none stored, no
        ETag, the store off, or an entry whose checksum no longer matches: dropped)."""
        key = _key(kind, obj)
        if key is None:
            return None
        with self._lock:
            cache = self._cache
            if cache is None:
                return None
            value = self._guarded(lambda: cache.get(key))
            if not isinstance(value, bytes):
                return None
            footer = value[_DIGEST:]
            if xxhash.xxh64_digest(footer) == value[:_DIGEST]:
                return footer
            log.warning("the stored footer of %s was damaged on disk: dropped, read from the remote again", obj.path)
            self._guarded(lambda: cache.delete(key))
            return None

    def put(self, kind: str, obj: RemoteObject, footer: bytes) -> None:
        """Keep ``footer`` (checked by the caller) for this version of ``obj``, unless kept already;
        objects without an ETag and footers over 1/:data:`_LARGEST_SHARE` of the budget are not kept."""
        key = _key(kind, obj)
        if key is None or len(footer) > self._largest:
            return
        value = xxhash.xxh64_digest(footer) + bytes(footer)
        with self._lock:
            cache = self._cache
            if cache is not None:
                self._guarded(lambda: _store(cache, key, value))

    def forget(self, kind: str, obj: RemoteObject) -> None:
        """Drop the footer of ``obj`` (suspected damaged: its next read goes to the remote)."""
        key = _key(kind, obj)
        with self._lock:
            cache = self._cache
            if key is not None and cache is not None:
                self._guarded(lambda: cache.delete(key))

    def close(self) -> None:
        """Close the calling thread's connection (the others close with their threads)."""
        with self._lock:
            if self._cache is not None:
                self._cache.close()

    def _guarded(self, operation: Callable[[], _T]) -> _T | None:
        """``operation()`` (under the lock); None, the store switched off, if it fails (a dropped
        footer not dropped must not be served again: nothing is, from then on)."""
        try:
            return operation()
        except _STORE_ERRORS as exc:
            self._switch_off(exc)
            return None

    def _switch_off(self, exc: BaseException) -> None:
        if not self._said_off:
            log.warning("footers are no longer kept in %s (each is read from the remote): %s", self._directory, exc)
        self._said_off, self._cache = True, None
        if _damaged(exc):  # made afresh by the next run, not found damaged by each
            try:
                shutil.rmtree(self._directory)
            except FileNotFoundError:
                pass
            except OSError as gone:
                log.warning("cannot delete the damaged footer store %s: %s", self._directory, gone)


class _DamagedEntry(sqlite3.DatabaseError):
    """A row of the store that is not a footer as :class:`FooterStore` keeps them."""


class _Footers(diskcache.Disk):  # type: ignore[misc]
    """diskcache's values, as the store keeps them: bytes in the database. Any other mode is a damaged
    row (never unpickled, never read from a file)."""

    def fetch(self, mode: int, filename: str | None, value: Any, read: bool) -> bytes:
        if mode != diskcache.core.MODE_RAW or not isinstance(value, bytes):
            raise _DamagedEntry(f"a stored value of mode {mode} ({type(value).__name__}), not bytes")
        return value


def _damaged(exc: BaseException) -> bool:
    """Whether ``exc`` says the database file is damaged (not a database, malformed, a row that is not
    a footer). OperationalError, a full disk or a lock, is a DatabaseError too, but says nothing of the file."""
    return isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError)


def daemon_store(directory: Path, share: int, free: int) -> FooterStore | None:
    """The sync daemon's store in ``directory``: within ``share`` (``cache.footer_bytes`` resolved) and
    within ``free`` (the bytes of ``cache.max_bytes`` that shards and the ledger leave now: less than
    the share where a cache was filled before it was set apart, or under a larger budget). None, with
    what an earlier run kept deleted, where that leaves under :data:`STORE_LEAST` (half the least
    share: a full cache's ledger may have grown a little since the share was set apart): the budget
    holds, and footers are read from the remote. :class:`CacheError` if they cannot be deleted."""
    budget = min(share, free)
    if budget >= STORE_LEAST:
        return FooterStore(directory, budget)
    try:
        shutil.rmtree(directory)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise CacheError(f"cannot delete the footers kept in {str(directory)!r}, which this run has no room for: "
                         f"{exc.strerror}; delete that folder") from exc
    return None


def _store(cache: diskcache.Cache, key: str, value: bytes) -> None:
    if key not in cache:  # (a whole object's footer is checked at each read of it)
        cache.set(key, value)
        _trim(cache)


def _trim(cache: diskcache.Cache) -> None:
    """Drop the oldest footers, one per transaction, until the database is within its size limit."""
    while cache.volume() > cache.size_limit:
        try:
            oldest, _ = cache.peekitem(last=False)
        except KeyError:  # empty: what is left is the database's own pages
            return
        cache.delete(oldest)


def _key(kind: str, obj: RemoteObject) -> str | None:
    """The version's key: its ETag as reads compare it (a store may spell it otherwise in its next listing)."""
    return None if not obj.etag else f"{kind}\n{obj.path}\n{bare_etag(obj.etag)}\n{obj.size}"
