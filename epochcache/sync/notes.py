"""A full disk under the ledger never stops the daemon.

Writes it needs (the start's reconciliation, a pass's listing) are retried with the publisher's
backoff until they go through (:func:`until_written`). Its bookkeeping writes (counters, skip
records, its state for ``status``, the cursor at a pass end) are dropped with a warning (:func:`note`).

Shards are what the disk is for; the publisher backs off while the ledger is full. A note lost to a
full disk costs little: a counter is low, a skip not recorded is not read again at the pass end (it
is still counted unread), a cursor not moved makes the next run walk units again that the ledger
shows cached (none is read twice), and a dataset binding not recorded is still checked against the
shards' schema fingerprints.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from epochcache.cache.publisher import DISK_FULL_FIRST_WAIT_S, DISK_FULL_MAX_WAIT_S
from epochcache.errors import LedgerFullError

log = logging.getLogger(__name__)

T = TypeVar("T")


def note(write: Callable[..., object], *args: Any) -> None:
    """``write(*args)``, a ledger write; a :class:`LedgerFullError` is logged, not raised."""
    try:
        write(*args)
    except LedgerFullError as exc:
        log.warning("not recorded (%s): %s", getattr(write, "__name__", write), exc)


def until_written(write: Callable[[], T], stop: threading.Event, what: str) -> T | None:
    """``write()``, tried again with a growing pause while it raises :class:`LedgerFullError`; None if
    ``stop`` is set meanwhile. ``what`` names the work in the warnings."""
    wait = DISK_FULL_FIRST_WAIT_S
    while True:
        try:
            return write()
        except LedgerFullError as exc:
            log.warning("%s: %s; trying again in %.1f s", what, exc, wait)
            if stop.wait(wait):
                return None
            wait = min(2 * wait, DISK_FULL_MAX_WAIT_S)
