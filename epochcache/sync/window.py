"""The fetch window: units read concurrently, consumed in walk order.

In: walk items. Out: the same items, in order, each with its table (None for a unit already cached,
a pass end, a pause, or a unit whose read failed and was recorded as skipped). Invariant: a unit's
rows are handed on only after every unit before it in the walk, so the cursor published with a
shard always marks a prefix of the order.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Executor, Future

import pyarrow as pa

from epochcache.sources import Unit
from epochcache.sources.retry import Retrier
from epochcache.sync.claims import Claims
from epochcache.sync.intake import Intake
from epochcache.sync.mixing import MixCursor
from epochcache.sync.skips import SKIPPABLE, SkipBook
from epochcache.sync.stream import Stream
from epochcache.sync.walk import Item

Fetched = tuple[Stream | None, Unit | None, MixCursor, pa.Table | None]
_Slot = tuple[Stream | None, Unit | None, MixCursor, Future[pa.Table] | None]


class FetchWindow:
    """Keeps up to ``concurrency`` units in flight, and units of at most ``most_bytes`` together by
    their metadata's size (a larger one alone); one while ``first_shard()``: an empty cache's first
    unit, and its shard's write, then have the machine to themselves. A pause of the walk drains the
    window.

    A unit counts from its submission until the daemon takes its rows, so a read that finished out
    of order still holds its slot: the daemon's memory holds at most ``concurrency`` units' tables
    and about ``most_bytes`` of them (plus the shard being built), however slow the head of the
    window is and however large the remote's units are."""

    def __init__(self, pool: Executor, retrier: Retrier, claims: Claims, skips: SkipBook, intake: Intake,
                 concurrency: int, most_bytes: int, first_shard: Callable[[], bool], stop: threading.Event) -> None:
        self.pool, self.retrier, self.claims, self.skips, self.intake = pool, retrier, claims, skips, intake
        self.full, self.most_bytes, self.first_shard, self.stop = concurrency, most_bytes, first_shard, stop

    def fetched(self, walk: Iterator[Item]) -> Generator[Fetched, None, None]:
        """Yield walk items in order with their table; unread futures are cancelled on the way out."""
        window: deque[_Slot] = deque()
        held = 0  # the metadata's bytes of the units in the window being read or read
        try:
            for stream, unit, after in walk:
                future = None
                if stream is not None and unit is not None and not self.claims.taken(unit.key):
                    while window and held + unit.nbytes > self.most_bytes:  # room first, by taking the head
                        held -= _bytes(window[0])
                        yield self._complete(*window.popleft())
                    self.claims.claim(unit.key)
                    future = self.pool.submit(self.retrier.call, stream.read, unit, what=unit.key)
                    held += unit.nbytes
                window.append((stream, unit, after, future))
                limit = 1 if self.first_shard() else self.full
                while len(window) >= limit or (window and (window[0][3] is None or stream is None)):
                    held -= _bytes(window[0])
                    yield self._complete(*window.popleft())
                if self.stop.is_set():
                    return
            while window and not self.stop.is_set():
                yield self._complete(*window.popleft())
        finally:
            for *_, future in window:
                if future is not None:
                    future.cancel()

    def _complete(self, stream: Stream | None, unit: Unit | None, after: MixCursor,
                  future: Future[pa.Table] | None) -> Fetched:
        """The unit's table; None if it is cached, or if it failed and was recorded as skipped."""
        if future is None or unit is None or stream is None:
            return stream, unit, after, None
        try:
            table = future.result()
        except SKIPPABLE as exc:
            self.claims.release(unit.key)
            self.skips.skip(stream, after.cursors[stream.name].pass_, unit.key, unit.obj, unit.index, exc)
            return stream, unit, after, None
        self.skips.read(unit.key)
        return stream, unit, after, self.intake.take(stream, unit, table)


def _bytes(slot: _Slot) -> int:
    """The bytes a window slot counts: its unit's, while it is read or held (none for a unit cached)."""
    _, unit, _, future = slot
    return unit.nbytes if unit is not None and future is not None else 0
