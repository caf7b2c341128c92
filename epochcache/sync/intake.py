"""What enters from the remote: each read unit counted (report, progress bar, hook) and throttled."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pyarrow as pa
from tqdm import tqdm

from epochcache.sources import Unit
from epochcache.sync.report import SyncReport
from epochcache.sync.stream import Stream
from epochcache.sync.vitals import Vitals


class Throttle:
    """Keeps intake under ``rate`` bytes/s with at most one second of burst (interruptible sleeps).

    Credit does not pile up while the daemon waits (backpressure, idle): after a pause it resumes at
    ``rate``, not with a burst of everything it could have read meanwhile.
    """

    def __init__(self, rate: int | None, stop: threading.Event) -> None:
        self._rate, self._stop = rate, stop
        self._next_free = time.monotonic()

    def consume(self, nbytes: int) -> None:
        if not self._rate:
            return
        now = time.monotonic()
        self._next_free = max(self._next_free, now - 1.0) + nbytes / self._rate
        if self._next_free > now:
            self._stop.wait(self._next_free - now)


class Intake:
    """Takes in each unit read, in the daemon's main thread: counts it in ``report`` and
    the daemon's vitals, teaches its stream its rows, calls ``on_fetch``, moves the bar, throttles."""

    def __init__(self, report: SyncReport, bar: tqdm, throttle: Throttle,
                 on_fetch: Callable[[Unit], None] | None, vitals: Vitals) -> None:
        self.report, self.bar, self.throttle, self.on_fetch, self.vitals = report, bar, throttle, on_fetch, vitals

    def take(self, stream: Stream, unit: Unit, table: pa.Table) -> pa.Table:
        """Account for ``table`` (all of ``unit``'s rows, as read: what the remote was asked for) and
        return the rows to cache, the unit's slice (``sampler.row_fraction``; may be empty)."""
        kept = stream.slicer.rows(unit, table)
        self.report.units_fetched += 1
        self.vitals.fetched(table.nbytes)
        stream.learn(unit, table, kept.num_rows)
        if self.on_fetch is not None:
            self.on_fetch(unit)
        self.bar.update(table.nbytes)
        self.throttle.consume(table.nbytes)
        return kept
