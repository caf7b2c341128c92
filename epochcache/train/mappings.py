"""ShardMaps: a bounded least-recently-used set of open shard mappings, per process.

In: a key (shard path and column selection) and a function that maps the shard; out: its column
views, mapped once and reused while they stay among the ``capacity`` most recently used.

Invariants: this object holds at most ``capacity`` mappings, so an epoch over any number of shards
stays under the kernel's ``vm.max_map_count`` (65,530 by default; each mapping is one map area);
it holds none of a shard that the newest epoch does not read (:meth:`ShardMaps.retain`), because a
shard's file, once evicted and deleted, keeps its blocks on disk for as long as it is mapped.
Dropping an entry drops only this reference: a batch still holding buffers or tensors of that shard
keeps its pages mapped until it is freed, so eviction never invalidates data already handed out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")

DEFAULT_MAX_OPEN_SHARDS = 1024


class ShardMaps(Generic[V]):
    """Up to ``capacity`` values by key, the least recently used dropped first; thread-safe."""

    def __init__(self, capacity: int = DEFAULT_MAX_OPEN_SHARDS):
        if capacity < 1:
            raise ValueError(f"max_open_shards = {capacity}: give at least 1")
        self.capacity = capacity
        self._values: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: Hashable, open_one: Callable[[], V]) -> V:
        """The value of ``key``, made with ``open_one`` (outside the lock: mapping does I/O) if absent."""
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                return self._values[key]
        value = open_one()
        with self._lock:
            self._values[key] = value
            self._values.move_to_end(key)
            while len(self._values) > self.capacity:
                self._values.popitem(last=False)
        return value

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
