"""ShardMaps: a bounded least-recently-used set of open shard mappings, per process.

In: a key (shard path and column selection) and a function that maps the shard (its column views and
the mapping they lie in); out: its column views, mapped once and reused while they stay among the
``capacity`` most recently used.

Invariants: this object holds at most ``capacity`` mappings, so an epoch over any number of shards
stays under the kernel's ``vm.max_map_count`` (65,530 by default; each mapping is one map area);
it holds none of a shard that the newest epoch does not read (:meth:`ShardMaps.retain`), because a
shard's file, once evicted and deleted, keeps its blocks on disk for as long as it is mapped.
Dropping an entry drops only this reference: a batch still holding buffers or tensors of that shard
keeps its pages mapped until it is freed, so eviction never invalidates data already handed out.

With ``max_mapped_bytes``, :meth:`ShardMaps.trim` (called once per batch) measures the process's
resident file-backed and shared memory (:func:`mapped_file_bytes`: mostly shard pages, beside the
libraries) and, once it grew by more than that since the last release, lets the pages of every shard
mapping this set ever gave out and that is still alive go (``madvise(MADV_DONTNEED)`` on read-only
shared file mappings), those dropped from the set but still read by an epoch included. The data stays
in the page cache and stays valid: the next read maps the page again (a minor fault), so only the
process's resident set (RSS, PSS) shrinks, to what a reader that ``read()``s its files would show.
Without the bound, every shard page an epoch touched stays mapped, and counted in the process's RSS,
until it is unmapped.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable
from typing import Generic, TypeVar

from epochcache.errors import ConfigError

V = TypeVar("V")

DEFAULT_MAX_OPEN_SHARDS = 1024
STATM = "/proc/self/statm"


def mapped_file_bytes() -> int:
    """Bytes of file-backed and shared memory this process has resident (RssFile + RssShmem, Linux's
    ``/proc/self/statm``): libraries, mapped shards, shared memory. Read afresh each call, so a forked
    process measures itself."""
    with open(STATM, "rb") as f:
        return int(f.read().split()[2]) * mmap.PAGESIZE


class ShardMaps(Generic[V]):
    """Up to ``capacity`` values by key, the least recently used dropped first; thread-safe.
    ``max_mapped_bytes``: see the module docstring (None: no bound; a bound needs Linux's
    ``/proc/self/statm``, else :class:`ConfigError`); ``measure``: the process's resident mapped
    bytes (:func:`mapped_file_bytes`; a test gives its own)."""

    def __init__(self, capacity: int = DEFAULT_MAX_OPEN_SHARDS, max_mapped_bytes: int | None = None,
                 measure: Callable[[], int] = mapped_file_bytes):
        if capacity < 1:
            raise ValueError(f"max_open_shards = {capacity}: give at least 1")
        if max_mapped_bytes is not None and measure is mapped_file_bytes and not os.path.exists(STATM):
            raise ConfigError(
                f"loader.max_mapped_bytes = {max_mapped_bytes}: bounding the mapped shard pages needs Linux's "
                f"{STATM}, absent here; leave loader.max_mapped_bytes null on this platform"
            )
        self.capacity = capacity
        self.max_mapped_bytes = max_mapped_bytes
        self._values: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()
        self._measure = measure
        # Every mapping given out and still alive (held here, or only by a dataset or batch): a weak
        # reference, so holding it here never keeps a map, or an evicted shard's disk blocks, alive.
        self._alive: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()
        self._trimming = threading.Lock()  # one release at a time; other batches go on meanwhile
        # Measured before any shard is mapped through this set (made in the process that reads: the
        # loader's for its batch thread, each worker's own), so every shard page counts as growth.
        self._baseline = measure() if max_mapped_bytes is not None else 0

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: Hashable, open_one: Callable[[], tuple[V, mmap.mmap]]) -> V:
        """The value of ``key``, made with ``open_one`` (outside the lock: mapping does I/O) if absent;
        ``open_one`` gives the value and the mapping it lies in."""
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                return self._values[key]
        value, mapping = open_one()
        with self._lock:
            if self.max_mapped_bytes is not None:
                self._alive.add(mapping)
            self._values[key] = value
            self._values.move_to_end(key)
            while len(self._values) > self.capacity:
                self._values.popitem(last=False)
        return value

    def trim(self) -> bool:
        """Let go of the pages of every live mapping this set gave out if the process's mapped bytes
        grew by more than ``max_mapped_bytes`` since the last release (see the module docstring);
        whether it did. A call while another thread releases returns False at once."""
        if self.max_mapped_bytes is None or not self._trimming.acquire(blocking=False):
            return False
        try:
            if self._measure() - self._baseline <= self.max_mapped_bytes:
                return False
            with self._lock:
                mappings = list(self._alive)
            for mapping in mappings:  # (held by this list, so each is still mapped: never advice on freed memory)
                mapping.madvise(mmap.MADV_DONTNEED)
            del mappings
            self._baseline = self._measure()
            return True
        finally:
            self._trimming.release()

    def retain(self, keys: Collection[Hashable]) -> None:
        """Drop the values whose key is not in ``keys`` (a new epoch's shards): each is unmapped once
        no dataset or batch holds it (the epoch still reading it, until that epoch is done)."""
        with self._lock:
            for key in [key for key in self._values if key not in keys]:
                del self._values[key]

    def clear(self) -> None:
        """Drop every value (the loader is closed)."""
        with self._lock:
            self._values.clear()
