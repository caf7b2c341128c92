"""The daemon's vitals in the ledger's daemon state, for ``epochcache status``.

Out (``ledger.daemon.update_status``): ``started`` (epoch seconds), ``settings`` (budget, shard size,
sources without their storage options, concurrency, rate limit), ``fetched_bytes`` and
``fetch_bytes_per_s`` (over the last interval), ``listing`` (while a listing runs: its url, the
objects listed so far and since when), ``last_error`` / ``last_error_at``: the first failure
of the current outage ("remote unreachable since 12:03:11: <one line>"), cleared once a read works
again; and the ledger's ``fetched_bytes`` counter (every run's). Writes are at most one per
``interval_s`` while fetching, so the ledger is not a hot path.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from epochcache.cache.ledger import Ledger
from epochcache.config import Config
from epochcache.sync.notes import note

log = logging.getLogger(__name__)
_LISTING_LOG_S = 10.0


def settings_of(config: Config, once: bool) -> dict[str, Any]:
    """What the daemon runs with, as status shows it: no storage options (they hold secrets)."""
    cache, sampler = config.cache, config.sampler
    return {
        "cache": {"max_bytes": int(cache.max_bytes), "shard_bytes": int(cache.shard_bytes),
                  "eviction": cache.eviction},
        "sources": [{"name": s.name, "url": s.url, "format": s.format, "columns": s.columns, "weight": s.weight}
                    for s in config.sources],
        "sampler": {"concurrency": sampler.concurrency, "max_bytes_per_s": sampler.max_bytes_per_s,
                    "request_timeout_s": sampler.request_timeout_s, "max_attempts": sampler.max_attempts},
        "once": once,
    }


class Vitals:
    """Keeps the daemon's vitals in the ledger; ``clock`` gives epoch seconds (injected for tests).

    Every write carries all of its fields, so a writer that replaces the daemon state (the
    publisher's running/backpressure line) loses them for at most one interval."""

    def __init__(self, ledger: Ledger, clock: Callable[[], float] = time.time, interval_s: float = 1.0) -> None:
        self.ledger, self.clock, self.interval_s = ledger, clock, interval_s
        self.fetched_bytes = 0
        self._counted = 0  # of fetched_bytes, added to the ledger's fetched_bytes counter
        self._mark = (0.0, 0)  # (time, fetched_bytes) of the last write
        self._failing_since: float | None = None
        self._fields: dict[str, Any] = {}
        self._lock = threading.Lock()  # retries are reported from the fetch threads
        self._logged = clock()  # when a listing's progress was last logged

    def start(self, settings: dict[str, Any]) -> None:
        now = self.clock()
        self._mark = (now, 0)
        self._fields = {"pid": os.getpid(), "started": now, "settings": settings, "fetched_bytes": 0,
                        "fetch_bytes_per_s": 0.0, "last_error": None, "last_error_at": None}
        # The publisher's running/backpressure line starts as "starting" (status reads state/since).
        note(self.ledger.daemon.update_status, {**self._fields, "state": "starting", "since": now})

    def fetched(self, nbytes: int) -> None:
        """A read worked: count its bytes; a standing error is over."""
        with self._lock:
            self.fetched_bytes += nbytes
            now = self.clock()
            if self._failing_since is not None:
                self._failing_since = None
                self._fields |= {"last_error": None, "last_error_at": None}
                self._write(now)
            elif now - self._mark[0] >= self.interval_s:
                self._write(now)

    def failed(self, what: str, line: str) -> None:
        """A read failed for good (after its retries): ``what`` says what failed ("remote unreachable",
        "corrupt object"), ``line`` the error on one line. The outage's start time is kept."""
        with self._lock:
            self._fail(what, line, self.clock(), write=True)

    def retrying(self, line: str) -> None:
        """A read failed and will be tried again (any thread): shown as the last error at once, so a
        remote that never answers is visible before the retries run out; written at most once per
        interval, and cleared by the next read that works."""
        with self._lock:
            now = self.clock()
            self._fail("reads failing", line, now, write=now - self._mark[0] >= self.interval_s
                       or self._fields.get("last_error") is None)

    def _fail(self, what: str, line: str, now: float, write: bool) -> None:
        if self._failing_since is None:
            self._failing_since = now
        since = time.strftime("%H:%M:%S", time.localtime(self._failing_since))
        self._fields |= {"last_error": f"{what} since {since}: {line}", "last_error_at": now}
        if write:
            self._write(now)

    def listing(self, url: str | None, objects: int = 0) -> None:
        """A listing of ``url`` is under way, ``objects`` listed so far (written at its first page,
        then at most once per interval, and logged every :data:`_LISTING_LOG_S`: a remote of millions of
        objects takes minutes to list); ``url`` None: it is done."""
        with self._lock:
            now = self.clock()
            if url is None:
                self._fields["listing"] = None
                self._write(now)
                return
            before = self._fields.get("listing")
            self._fields["listing"] = {"url": url, "objects": objects, "since": (before or {}).get("since", now)}
            if now - self._logged >= _LISTING_LOG_S:
                self._logged = now
                log.info("listing %s: %d objects so far", url, objects)
            if before is None or now - self._mark[0] >= self.interval_s:  # (its first page at once)
                self._write(now)

    def flush(self) -> None:
        """Write the counts now (at each shard, and at the end of a run)."""
        with self._lock:
            self._write(self.clock())

    def _write(self, now: float) -> None:
        then, before = self._mark
        if now > then:
            self._fields["fetch_bytes_per_s"] = round((self.fetched_bytes - before) / (now - then), 1)
            self._mark = (now, self.fetched_bytes)
        self._fields["fetched_bytes"] = self.fetched_bytes
        note(self.ledger.daemon.update_status, self._fields)
        # The cache's lifetime total (this run's is in the state): what epochs' coverage is paid with.
        note(self.ledger.counters.incr, "fetched_bytes", self.fetched_bytes - self._counted)
        self._counted = self.fetched_bytes
