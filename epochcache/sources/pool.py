"""The Arrow memory pool the daemon's own copies of rows come from, and the default pool's release.

Rows the daemon copies (each row's key; a shard's columns other than fixed-size ones, which
:mod:`epochcache.sync.combine` copies into mappings of their own) come from the system allocator,
which unmaps a large block when it is freed. Arrow's default pool (mimalloc) keeps freed segments
for reuse, and gives every thread that allocates its own: with THP, 2 MiB per fetch thread for a
few KiB of keys, and the high-water mark of every shard so far. Invariant: which pool is used
changes only when memory goes back to the OS.
"""

from __future__ import annotations

import pyarrow as pa

ROWS_POOL = pa.system_memory_pool()


def release_unused() -> None:
    """Hand what the default pool keeps for reuse (Parquet decodes allocate there) back to the OS:
    with mimalloc, what the calling thread allocated and has been freed since (by any thread)."""
    pa.default_memory_pool().release_unused()
