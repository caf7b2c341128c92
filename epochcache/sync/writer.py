"""The writer: shards written and published by one thread, in order, while the next are fetched.

In: a shard's rows, units and the cursor just past them. Out: published shards (ledger + file),
accounted in the report and in :class:`Claims`. Invariant: shards are published in order, one at a
time, each with the cursor just past its last unit; once one is refused (stopped, budget full) none
after it is published, so the cursor never jumps past a shard that is missing.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import pyarrow as pa
from tqdm import tqdm

from epochcache.cache.ledger import ShardRecord
from epochcache.cache.publisher import Published, Publisher
from epochcache.sources.pool import release_unused
from epochcache.sync.claims import Claims
from epochcache.sync.report import SyncReport

# Shards handed to the writer thread and not yet published: one is written while the next is built
# from the units being fetched, so memory holds at most two shards (the one written, the one built).
WRITES_QUEUED = 1


class ShardWriter:
    """Hands shards to one writer thread (``executor``) and accounts for them as they finish."""

    def __init__(self, executor: Executor, publisher: Publisher, claims: Claims, report: SyncReport,
                 bar: tqdm, on_publish: Callable[[ShardRecord], None] | None, stop: threading.Event) -> None:
        self.executor, self.publisher, self.claims, self.report = executor, publisher, claims, report
        self.bar, self.on_publish, self.stop = bar, on_publish, stop
        self.pending: deque[Future[Published | None]] = deque()
        self.refused = threading.Event()  # set by the writer thread once a shard was not published

    def submit(self, rows: Callable[[], pa.Table], units: list[str], cursor: dict[str, Any]) -> bool:
        """Hand one shard to the writer thread, once fewer than ``WRITES_QUEUED`` wait there; False if
        a shard before it was not published (stopped, or the budget is full). ``rows`` gives the
        shard's rows; it is called only then, so the copy it makes is never held while waiting."""
        while len(self.pending) >= WRITES_QUEUED:
            if not self._settle_one():
                return False
        self.pending.append(self.executor.submit(self._write, [rows()], units, cursor))
        return True

    def settle(self) -> bool:
        """Wait for every shard in the writer thread; False if one was not published (and then the
        ones after it are dropped unpublished)."""
        while self.pending:
            if not self._settle_one():
                return False
        return True

    def _write(self, held: list[pa.Table], units: list[str], cursor: dict[str, Any]) -> Published | None:
        """In the writer thread: publish one shard (``held``: its rows, taken out here), unless the
        daemon is stopping or a shard before it was refused (then none after it may be published
        either, or the cursor would jump past the refused shard's units)."""
        # Taken out of the list the executor holds until after this returns: the rows are let go as
        # soon as they are written, before the daemon, woken by the result, copies the next shard's.
        table = held.pop()
        if self.refused.is_set() or self.stop.is_set():  # stopped: queued shards are dropped, like the one built
            self.refused.set()
            return None
        published = self.publisher.publish(table, units, cursor)
        del table
        release_unused()
        if published is None:
            self.refused.set()
        elif self.on_publish is not None:  # here, before the next shard starts: a hook may stop the daemon
            self.on_publish(published.record)
        return published

    def _settle_one(self) -> bool:
        """Wait for the oldest shard in the writer thread and account for it; False if it was not published."""
        published = self.pending.popleft().result()
        if published is None:
            for later in self.pending:  # each returns None unpublished if it is already running
                later.cancel()
            self.pending.clear()
            return False
        record = published.record
        self.claims.published(record.units)
        report = self.report
        report.evicted += len(published.evicted)
        report.shards_published += 1
        report.bytes_published += record.nbytes
        report.samples_published += record.rows
        report.units_published += len(record.units)
        self.bar.set_postfix(shards=report.shards_published, samples=report.samples_published,
                             evicted=report.evicted, refresh=False)
        return True
