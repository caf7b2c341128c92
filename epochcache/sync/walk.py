"""The walk: every stream's units, pass after pass, merged by weight into one sequence of positions.

In: the streams, the position to start from, the ledger (listings, skips). Out: ``(stream, unit,
position just past it)`` items; ``unit`` None ends the stream's pass; ``stream`` None pauses the
walk (every stream idle). Each stream's listing is streamed into the ledger once per pass and
reopened from it across restarts, so a restart walks the same order. A pass's listing is compared
with the last pass's: the shards holding rows of an object rewritten in between are retired for good
(``Ledger.retire_rewritten``), so the cache never keeps serving a version the remote replaced.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future
from typing import overload

from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import Ledger
from epochcache.config import Config
from epochcache.errors import FetchFailedError
from epochcache.sources import RemoteObject, Unit
from epochcache.sources.retry import Retrier, describe
from epochcache.sync.claims import Claims
from epochcache.sync.identity import stream_order
from epochcache.sync.listing import PagedListing, store_listing
from epochcache.sync.mixing import MixCursor, pick
from epochcache.sync.notes import until_written
from epochcache.sync.sampler import Cursor, Sampler
from epochcache.sync.skips import SKIPPABLE, SkipBook, what_failed
from epochcache.sync.slicing import Slicer, cached_per_listed, pass_shape
from epochcache.sync.stream import Stream
from epochcache.sync.vitals import Vitals

log = logging.getLogger(__name__)

# A stream whose pass found every unit cached lists the remote again after IDLE_POLL_S, twice that
# after a second such pass, and so on up to IDLE_POLL_MAX_S: a fully cached remote of a million
# objects is not listed (a thousand LIST requests) every few seconds for as long as the daemon runs.
IDLE_POLL_S = 5.0
IDLE_POLL_MAX_S = 300.0
_IDLE_CHECK_S = 1.0  # how often an idle walk looks whether the cache let shards go (one O(1) query)
# The listing header's key for the bytes a cache holds per listed byte of the stream (auto's shape).
CACHED_PER_LISTED = "cached_per_listed"

# A walk item: the stream, its unit (None: the stream's pass ended; its cursor moves to the next
# pass) and the merged position just past it. Stream None: the walk pauses (every stream idle), so
# what is built is published now rather than after the pause.
Item = tuple[Stream | None, Unit | None, MixCursor]


class Walk:
    """Walks ``streams`` from a position; see the module docstring."""

    def __init__(self, config: Config, layout: CacheLayout, ledger: Ledger, streams: Sequence[Stream], pool: Executor,
                 retrier: Retrier, claims: Claims, skips: SkipBook, vitals: Vitals, stop: threading.Event,
                 once: bool, settle: Callable[[], object]) -> None:
        """``settle``: wait until the shards handed to the writer are published (see :meth:`_list`)."""
        self.config, self.ledger, self.streams, self.pool, self.vitals = config, ledger, streams, pool, vitals
        self._layout, self._settle = layout, settle  # (see _list)
        self.retrier, self.claims, self.skips, self.stop, self.once = retrier, claims, skips, stop, once

    def merged(self, position: MixCursor) -> Iterator[Item]:
        """The streams' walks merged by weight (:func:`~epochcache.sync.mixing.pick`) from ``position``.

        A stream whose last pass found every unit cached gives nothing for a while (:func:`idle_wait`:
        its share goes to the others, and it comes back at its share rather than catching up on the
        rows it could not give); with ``once`` a stream stops after one pass. Ends when stopped or
        when every stream stopped."""
        walks = {s.name: self._stream_walk(s, position.cursors[s.name]) for s in self.streams}
        weights = {s.name: s.config.weight for s in self.streams}
        live = list(self.streams)
        while live and not self.stop.is_set():
            now = time.monotonic()
            for back in (s for s in live if 0 < s.idle_until <= now):
                back.idle_until = 0.0
                position = position.caught_up(back.name, weights)
            ready = {s.name: s.config.weight for s in live if s.idle_until <= now}
            if not ready:
                yield None, None, position
                self._idle(live)
                continue
            stream = next(s for s in live if s.name == pick(ready, position.rows))
            item = next(walks[stream.name], None)
            if item is None:
                live.remove(stream)
                continue
            unit, cursor = item
            # Only rows to be written count: a unit already cached (or on its way) adds none.
            fresh = stream.rows_of(unit) if unit is not None and not self.claims.taken(unit.key) else 0
            rows, stream.unaccounted = stream.unaccounted + fresh, 0
            position = position.advance(stream.name, cursor, rows)
            yield stream, unit, position

    def _idle(self, streams: Sequence[Stream]) -> None:
        """Wait while every stream is idle: until the first is due to list again, or the cache lets
        shards go (quarantined, deleted by ``verify --fix``): then every stream walks again at once,
        to fill the room, without waiting for the next listing."""
        due = min(s.idle_until for s in streams)
        log.info("every unit of the remote is cached; listing it again in %.0fs", due - time.monotonic())
        held = self.ledger.usage().shards
        while not self.stop.wait(min(_IDLE_CHECK_S, max(0.0, due - time.monotonic()))) and time.monotonic() < due:
            shards = self.ledger.usage().shards
            if shards < held:
                log.info("the cache let %d shards go: walking the remote again now", held - shards)
                for stream in streams:
                    stream.idle_until = time.monotonic()
                return
            held = max(held, shards)

    def _stream_walk(self, stream: Stream, cursor: Cursor) -> Iterator[tuple[Unit | None, Cursor]]:
        """``stream``'s units from ``cursor`` on, pass after pass, each pass ended by ``(None, the
        next pass's cursor)``; ends when stopped, or after one pass with ``once``."""
        sampler_config = self.config.sampler
        rank, nodes = sampler_config.partition()
        while True:
            objects = self._objects(stream, cursor.pass_)
            if objects is None:
                return
            pass_ = cursor.pass_
            node_objects = len(range(rank, len(objects), nodes))
            stream.node_bytes = None if objects.nbytes is None else objects.nbytes // nodes
            self._shape(stream, pass_, objects, node_objects)
            sampler = Sampler(functools.partial(self._units_of, stream, pass_), objects, sampler_config.seed,
                              mix=stream.mix, node_rank=rank, num_nodes=nodes, same_order=stream.slicer.parts > 1)
            # The pass before stays known: its last units are still consumed while this one is walked.
            stream.totals = {p: n for p, n in stream.totals.items() if p == pass_ - 1}
            stream.totals[pass_] = len(sampler.node_objects(pass_))
            fetching = False
            for unit, after in sampler.walk(cursor):
                # (a unit that failed for good is read again each pass, but would keep an idle remote
                # listed every few seconds: it waits for the next listing like the cached ones)
                fetching = fetching or not (self.claims.taken(unit.key) or self.skips.failing(unit.key))
                yield unit, after
            cursor = cursor.next_pass()
            # (set before the pass end is handed on: the walk waits before this generator lists the
            # next pass, not after, which would have it act on each listing one wait late)
            stream.idle_passes = 0 if fetching else stream.idle_passes + 1
            if not fetching and not self.once:
                stream.idle_until = time.monotonic() + idle_wait(stream.idle_passes)
            yield None, cursor
            if self.once:
                return

    def _shape(self, stream: Stream, pass_: int, listing: PagedListing, objects: int) -> None:
        """Set the pass's row slices and mixing window (:func:`pass_shape`) for this node's ``objects``
        of ``listing``, saying what ``auto`` chose."""
        sampler = self.config.sampler
        weights = sum(source.weight for source in self.config.sources)
        budget = max(1, int(self.config.cache.shard_budget() * stream.config.weight / weights))
        remote_bytes = None
        if "auto" in (sampler.row_fraction, sampler.mix_units) and stream.node_bytes:
            ratio = self._cached_per_listed(stream, listing)
            remote_bytes = round(stream.node_bytes * (ratio or 1.0))
        shape = pass_shape(sampler, budget, remote_bytes, objects)
        stream.slicer, stream.mix = Slicer(shape.parts, sampler.seed), shape.mix
        if "auto" in (sampler.row_fraction, sampler.mix_units):
            log.info("source %r, pass %d: %d objects, %s listed, about %s as cached, for a budget of %d bytes: "
                     "row_fraction 1/%d, mix_units %d", stream.name or stream.config.url, pass_, objects,
                     stream.node_bytes, remote_bytes, budget, shape.parts, shape.mix)

    def _cached_per_listed(self, stream: Stream, listing: PagedListing) -> float | None:
        """Bytes cached per listed byte of ``stream`` (:func:`cached_per_listed`): measured once on
        the listing's first object and kept in the listing's header (carried from pass to pass), so
        every pass and restart shapes from the same value. None (not kept: measured again next pass)
        if the listing is empty or the read fails."""
        header = self.ledger.daemon.listing(stream.name) or {}
        if header.get(CACHED_PER_LISTED) is not None:
            return float(header[CACHED_PER_LISTED])
        if not len(listing):
            return None
        first = listing[0]
        try:
            ratio, read = self.retrier.call(cached_per_listed, stream.source, first,
                                            what=f"cached size of {first.path}")
        except SKIPPABLE as exc:
            log.warning("cannot measure the cached size of %s (%s): auto shapes this pass from the listed size",
                        first.path, describe(exc))
            return None
        self.vitals.fetched(read)  # egress like any read
        until_written(lambda: self.ledger.daemon.set_listing(stream.name, {**header, CACHED_PER_LISTED: ratio}),
                      self.stop, "keeping the cached size per listed byte")
        return ratio

    def _units_of(self, stream: Stream, pass_: int, objects: Sequence[RemoteObject]) -> Sequence[Sequence[Unit]]:
        """The units of ``objects``, their metadata read as :class:`_Arriving` says: the first object's
        alone, the others' concurrently. An object whose metadata keeps failing (or is gone, or
        damaged) counts as empty for this pass and is recorded, so a restart walks the same order; it
        is retried at the end of the pass."""
        skipped = self.skips.skipped_objects(pass_)

        def read(obj: RemoteObject) -> Future[Sequence[Unit]] | None:
            if f"{obj.path}#*" in skipped:
                return None
            return self.pool.submit(self.retrier.call, stream.source.units, obj, what=f"metadata of {obj.path}")

        return _Arriving(objects, read, functools.partial(self._units_or_skip, stream, pass_))

    def _units_or_skip(self, stream: Stream, pass_: int, obj: RemoteObject,
                       future: Future[Sequence[Unit]] | None) -> Sequence[Unit]:
        if future is None:
            return []
        try:
            units = future.result()
        except SKIPPABLE as exc:
            self.skips.skip(stream, pass_, f"{obj.path}#*", obj, None, exc)
            return []
        stream.count_rows(units)
        return stream.slicer.units(units, pass_)

    def _objects(self, stream: Stream, pass_: int) -> PagedListing | None:
        """The listing this pass of ``stream`` walks: streamed into the ledger once per pass and
        reopened from it across restarts. A listing that keeps failing is tried again after a pause
        (shown in the daemon's vitals); with ``once`` its :class:`FetchFailedError` (naming the URL
        and the error, which names the host) ends the run. None once stopped."""
        header = self.ledger.daemon.listing(stream.name)
        if header and header.get("pass") == pass_:
            stored = PagedListing.open(self.ledger, header, stream.name)
            if stored is not None:
                return stored
        while not self.stop.is_set():
            try:
                what = f"listing of {stream.source.url}"
                return until_written(lambda: self.retrier.call(self._list, stream, pass_, what=what), self.stop, what)
            except FetchFailedError as exc:
                self.vitals.failed(what_failed(exc), describe(exc))
                if self.once:
                    raise
                log.warning("%s; trying again in %.0fs", exc, self.config.sampler.backoff_max_s)
                self.stop.wait(self.config.sampler.backoff_max_s)
        return None

    def _list(self, stream: Stream, pass_: int) -> PagedListing:
        """A fresh listing for pass ``pass_``; rows of objects rewritten since the last listing leave
        the cache, so this pass (or the next, for units on their way now) reads their new version:
        the shards handed to the writer are published, then those of the ledger holding such rows
        are retired (``Ledger.retire_rewritten``) and the units claimed, read and not yet published,
        outdated (:meth:`Claims.outdate`: the daemon drops their rows)."""
        last = self.ledger.daemon.listing(stream.name) or {}
        header = {"order": stream_order(self.config, stream), "pass": pass_,
                  CACHED_PER_LISTED: last.get(CACHED_PER_LISTED)}
        if last.get("count") is not None:  # a whole listing (not one cut short, retried here) to compare with
            self.ledger.daemon.keep_previous_listing(stream.name)
        url = stream.source.url
        try:
            listing = store_listing(self.ledger, stream.source.scan_objects(), header, stream.name,
                                    lambda objects: self.vitals.listing(url, objects))
        finally:
            self.vitals.listing(None)
        log.info("listed %d objects under %s for pass %d", len(listing), stream.source.url, pass_)
        rewritten = self.ledger.daemon.rewritten(stream.name)
        if rewritten:
            self._settle()
            outdated = self.claims.outdate(rewritten)
            removed, held = self.ledger.retire_rewritten(rewritten)
            for record in removed:  # (their records are gone first: see the ledger's invariants)
                self._layout.remove(record.filename)
            log.warning("%d objects under %s were rewritten since the last pass (e.g. %s): this pass reads them "
                        "again; %d shards holding their old rows deleted, %d more leave the epochs to come and "
                        "are deleted once no epoch holds them, %d units of them read and not yet cached dropped",
                        len(rewritten), stream.source.url, rewritten[0], len(removed), held, outdated)
        self.ledger.daemon.drop_previous_listing(stream.name)
        return listing


def idle_wait(passes: int) -> float:
    """Seconds a stream waits before listing again after ``passes`` passes in a row found every unit cached."""
    return min(IDLE_POLL_S * 2 ** min(passes - 1, 16), IDLE_POLL_MAX_S)


class _Arriving(Sequence[Sequence[Unit]]):
    """Each object's units, read when first wanted: the first object wanted is read alone, and when a
    second is wanted every other one is read at once (concurrently, in the pool). The sampler wants
    them in order, so a group's first unit (an empty cache's first shard) waits for one metadata read
    rather than for all of them at once, competing; the rest are read while that unit is fetched and
    written. Each is taken (``take(obj, its read)``) once."""

    def __init__(self, objects: Sequence[RemoteObject],
                 read: Callable[[RemoteObject], Future[Sequence[Unit]] | None],
                 take: Callable[[RemoteObject, Future[Sequence[Unit]] | None], Sequence[Unit]]) -> None:
        self._objects, self._read, self._take = objects, read, take
        self._reads: dict[int, Future[Sequence[Unit]] | None] = {}
        self._taken: dict[int, Sequence[Unit]] = {}

    def __len__(self) -> int:
        return len(self._objects)

    @overload
    def __getitem__(self, index: int) -> Sequence[Unit]: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Sequence[Unit]]: ...

    def __getitem__(self, index: int | slice) -> Sequence[Unit] | Sequence[Sequence[Unit]]:
        if isinstance(index, slice):
            return [self[k] for k in range(*index.indices(len(self)))]
        index = range(len(self))[index]  # an IndexError out of range, a negative index counted from the end
        if index not in self._taken:
            for k in [index] if not self._reads else range(len(self)):
                if k not in self._reads:
                    self._reads[k] = self._read(self._objects[k])
            self._taken[index] = self._take(self._objects[index], self._reads[index])
        return self._taken[index]
