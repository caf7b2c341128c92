"""glibc's large-allocation thresholds, fixed for a process that builds batch-sized buffers.

In: the C library (injectable; this process's by default). Out: its mmap threshold fixed at 32 MiB and
its heap trim threshold at 64 MiB, the ceilings glibc's own adjustment rises to on 64-bit systems
(mallopt(3)), so that a freed batch buffer is reused by the next batch instead of returned to the
kernel and faulted in anew, page by page. Where the C library has no ``mallopt`` (not glibc),
nothing changes.

Why: glibc gives each allocation of 128 KiB or more a fresh mapping until a free raises that
threshold, and trims a thread's heap back to the kernel once its free top passes the trim threshold.
Batches of ~1 MB built on two threads (the batch thread and the consumer) and freed by the trainer
made it do both in some runs: 9-15 page faults and 77-110 µs per batch, against 0-2 and 60-80 µs
with the thresholds fixed (thread mode, 12 KB rows, batch 64, 4 epochs each); in other runs glibc
did not trim, and both settings ran alike. Worker processes always fix the thresholds (they are
ours); the training process does when ``loader.fixed_malloc_thresholds`` is on (the default), since
the setting is process-wide. The values are those glibc's own adjustment converges to, so the
process holds what it would after its first large free: up to 64 MiB freed at the top of a heap.
"""

from __future__ import annotations

import ctypes
from typing import Any

_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 2 * _MMAP_THRESHOLD
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


def keep_large_allocations(libc: Any = None) -> bool:
    """Fix ``libc``'s (default: this process's C library) mmap and trim thresholds; whether it could."""
    mallopt = getattr(libc if libc is not None else ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
