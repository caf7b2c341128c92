"""The daemon's heap during a run: objects that exist when it starts are left out of garbage collection.

A collection writes to every object it scans; in a daemon forked from a trainer, that copies every
page of the parent's heap it touches (PSS counts a page shared with the parent half, a copied one
whole). Invariant: only when memory is scanned changes, never what is read or written.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Leave the objects alive now out of garbage collection until the block ends (then they are
    collected as before; cyclic garbage among them waits until then)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
