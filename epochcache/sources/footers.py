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
from pathlib import Path

import diskcache
import xxhash

from epochcache.sources.base import RemoteObject

log = logging.getLogger(__name__)

# SQLite's write-ahead log is checkpointed every this many pages (and cut back to half this after):
# beyond a transaction's own pages, the most the log and its shared-memory index take.
_WAL_PAGES = 32
_WAL_BYTES = 256 * 1024
_DIGEST = 8  # bytes of xxh64 before the footer


class FooterStore:
    """Footers by object version in ``directory`` (made if missing), its files within ``budget`` bytes:
    the oldest stored go first; a footer over a sixteenth of the budget is not kept."""

    def __init__(self, directory: str | Path, budget: int) -> None:
        self._largest = budget // 16
        # diskcache culls once the database is over size_limit, after a store: over it by at most one
        # footer, with as much again in the log until the checkpoint (the page size aside).
        size_limit = budget - 2 * self._largest - _WAL_BYTES
        if size_limit <= 0:
            raise ValueError(f"a footer store of {budget} bytes has no room for footers: give it at least 1MiB")
        self._cache = diskcache.Cache(
            str(directory), size_limit=size_limit, eviction_policy="least-recently-stored",
            disk_min_file_size=2**31,  # every value in the database: its size is what the limit counts
            sqlite_cache_size=-1024,  # KiB per connection (a connection per thread): not diskcache's 32 MiB
            sqlite_mmap_size=0, sqlite_wal_autocheckpoint=_WAL_PAGES, sqlite_journal_size_limit=_WAL_BYTES // 2,
        )

    def get(self, kind: str, obj: RemoteObject) -> bytes | None:
        """The footer stored for this version of ``obj`` read as ``kind``, or None (none stored, no
        ETag, or an entry whose checksum no longer matches: dropped)."""
        key = _key(kind, obj)
        if key is None:
            return None
        value = self._cache.get(key)
        if not isinstance(value, bytes):
            return None
        footer = value[_DIGEST:]
        if xxhash.xxh64_digest(footer) != value[:_DIGEST]:
            log.warning("the stored footer of %s was damaged on disk: dropped, read from the remote again", obj.path)
            self._cache.delete(key)
            return None
        return footer

    def put(self, kind: str, obj: RemoteObject, footer: bytes) -> None:
        """Keep ``footer`` (checked by the caller) for this version of ``obj``; objects without an ETag
        and footers over a sixteenth of the limit are not kept."""
        key = _key(kind, obj)
        if key is not None and len(footer) <= self._largest:
            self._cache.set(key, xxhash.xxh64_digest(footer) + bytes(footer))

    def forget(self, kind: str, obj: RemoteObject) -> None:
        """Drop the footer of ``obj`` (suspected damaged: its next read goes to the remote)."""
        key = _key(kind, obj)
        if key is not None:
            self._cache.delete(key)

    def close(self) -> None:
        """Close the calling thread's connection (the others close with their threads)."""
        self._cache.close()


def _key(kind: str, obj: RemoteObject) -> str | None:
    return None if not obj.etag else f"{kind}\n{obj.path}\n{obj.etag}\n{obj.size}"
