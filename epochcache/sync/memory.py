"""The heap of a process while a daemon runs in it, or while a loader's worker processes run (from
their fork to the pool's close, :mod:`epochcache.train.workers`): the objects that exist when it starts
are left out of garbage collection, and collected again once it ends.

They live as long as the run (imports, config, or the heap of a trainer the daemon was forked from),
and a full collection visits every one of them. Forked from a process that imported torch (~200,000
objects), the S3 client's creation took 180 ms instead of 58 ms before the first request (its JSON
service model sets off full collections). A collection also writes to every object it scans: in a
daemon forked from a trainer that copies every page of the parent's heap it touches (PSS counts a
page shared with the parent half, a copied one whole). Invariant: only when memory is scanned
changes, never what is read or written.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[None]:
    """In the main thread (the daemon's own process: ``epochcache sync``, or a process forked to run
    it), :func:`frozen_objects` for the block. In another thread (a daemon run inside a larger
    program), nothing changes: the heap is not the daemon's to freeze."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with frozen_objects():
        yield


# frozen_objects blocks open in this process. Counted, not read off gc.get_freeze_count(): Python
# 3.12 keeps its immortal objects in the frozen generation (375 of them at start, back after each
# full collection), so that count is never 0 there and a heap frozen for workers was never unfrozen.
_depth = 0
_depth_lock = threading.Lock()
# Whether the program had frozen objects of its own when the first block began (told apart from
# immortal ones only before Python 3.12): they stay frozen when the last block ends.
_theirs = False


@contextmanager
def frozen_objects() -> Iterator[None]:
    """Leave the objects alive now out of garbage collection until the block ends; then they are
    collected as before (cyclic garbage among them waits until then), unless another block is still
    open (a loader's workers still running, a daemon's run): those objects stay frozen, and so do
    these, until the last block ends. A program's own earlier ``gc.freeze()`` is kept before Python
    3.12; from 3.12 on it is undone then too, as nothing tells it apart from the immortal objects."""
    global _depth, _theirs
    with _depth_lock:
        if not _depth:
            _theirs = sys.version_info < (3, 12) and gc.get_freeze_count() > 0
        _depth += 1
        gc.freeze()
    try:
        yield
    finally:
        with _depth_lock:
            _depth -= 1
            if not _depth and not _theirs:
                gc.unfreeze()
