"""The sync daemon: sampler -> fetch pool -> shard builder -> write -> publish -> evict.

Several sources (``config.sources``) are walked as streams, each with its own listing, passes and
cursor, merged by weight (:mod:`epochcache.mixing`); the cursor published with a shard holds every
stream's position. A stream's pass end travels through the fetch window as an item of its own, so
its skipped units are retried in order and its cursor moves to the next pass only there.

One daemon per cache directory (an flock on ``daemon.lock``). At start it reconciles disk with the
ledger and resumes the sampler's cursor. Units are fetched concurrently but consumed in sampler order,
so the cursor published with a shard always marks a prefix of the order: a crash at any moment loses
at most the shard being built, and a restart neither repeats nor skips a unit. Units already held by a
cached shard are skipped, so no sample is ever cached twice, even across passes.

Before a shard is written its exact size is reserved in the ledger, evicting unleased shards by the
configured policy; if only leased shards could make room the daemon waits (backpressure) rather than
exceed ``cache.max_bytes``. Shards are written and published by one writer thread, in order, while
the next ones are fetched. SIGINT/SIGTERM stop it between units: the shard being built is dropped,
never published half-written (shards already handed to the writer are finished).

Faults: every remote call goes through :class:`~epochcache.retry.Retrier` (transient errors retried
with backoff, counted in the ledger). A unit (or an object's metadata) that still fails, or whose
object vanished, is recorded in the ledger as skipped and the walk goes on, so a transient outage
never kills the daemon; at the end of the pass the skipped units are read again. Permanent errors
(:class:`SourceError`) end the run.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from types import FrameType
from typing import Any

import pyarrow as pa
from tqdm import tqdm

from epochcache.config import Config, SourceConfig
from epochcache.errors import FetchFailedError, ObjectMissingError, SourceError
from epochcache.layout import CacheLayout
from epochcache.ledger import Ledger, ShardRecord
from epochcache.listing import PagedListing, store_listing
from epochcache.lockfile import exclusive
from epochcache.mixing import MixCursor, pick
from epochcache.repair import reconcile
from epochcache.retry import Retrier, describe
from epochcache.publisher import Published, Publisher
from epochcache.sampler import Cursor, Sampler
from epochcache.sources import RemoteObject, Source, Unit, open_source

log = logging.getLogger(__name__)

_IDLE_POLL_S = 5.0
# Shards handed to the writer thread and not yet published: enough to keep fetching while one is
# written and the next waits, few enough that memory stays ~ (2 + this) * cache.shard_bytes.
_WRITES_QUEUED = 2


class StopReason(str, Enum):
    STOPPED = "stopped"
    BUDGET_FULL = "budget full"
    EXHAUSTED = "remote exhausted"


@dataclass
class SyncReport:
    """What one ``SyncDaemon.run`` did, in counts (a daemon runs for days: no per-unit lists)."""

    reason: StopReason = StopReason.STOPPED
    shards_published: int = 0
    bytes_published: int = 0
    samples_published: int = 0
    evicted: int = 0
    units_fetched: int = 0
    units_published: int = 0
    units_skipped: int = 0  # skip events (a unit read later at the pass end counts here too)
    units_unread: int = 0  # units still skipped when the run ended: ``sync --once`` exits 3 if any


@dataclass
class _Building:
    """Units fetched in order and not yet published, with the cursor just past the last of them."""

    cursor: MixCursor
    tables: list[pa.Table] = field(default_factory=list)
    units: list[str] = field(default_factory=list)
    nbytes: int = 0

    def reset(self, cursor: MixCursor) -> None:
        """Start the next shard from ``cursor`` (the previous one was published)."""
        self.cursor, self.tables, self.units, self.nbytes = cursor, [], [], 0

    def add(self, unit: Unit, table: pa.Table) -> None:
        self.tables.append(table)
        self.units.append(unit.key)
        self.nbytes += table.nbytes


class _Throttle:
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


@dataclass
class _Stream:
    """One configured source as the daemon walks it: its own passes, listing and cursor.

    ``totals``: objects of this node's share of each pass listed so far (for progress);
    ``rows_per_byte``: seen in this source's reads, to estimate the rows of units whose metadata does
    not tell them (Arrow IPC, WebDataset); ``estimates``: those estimates for units not read yet;
    ``unaccounted``: rows read minus rows estimated, for the pick to count next; ``idle_until``:
    while every unit of its last pass was cached, it gives no unit until then (monotonic seconds).
    """

    config: SourceConfig
    source: Source
    totals: dict[int, int] = field(default_factory=dict)
    rows_per_byte: float | None = None
    estimates: dict[str, int] = field(default_factory=dict)
    unaccounted: int = 0
    idle_until: float = 0.0

    @property
    def name(self) -> str:
        return self.config.name

    def rows_of(self, unit: Unit) -> int:
        """The unit's rows from metadata, else estimated from its bytes (1 before any read) and
        remembered, so the read can correct the count."""
        if unit.rows is not None:
            return unit.rows
        estimate = max(1, round(unit.nbytes * self.rows_per_byte)) if self.rows_per_byte else 1
        self.estimates[unit.key] = estimate
        return estimate

    def learn(self, unit: Unit, table: pa.Table) -> None:
        """Take in a read unit's true rows: the estimate's error goes to ``unaccounted``."""
        if unit.rows is None:
            self.unaccounted += table.num_rows - self.estimates.pop(unit.key, table.num_rows)
            if unit.nbytes > 0:
                self.rows_per_byte = table.num_rows / unit.nbytes


# A walk item: the stream, its unit (None: the stream's pass ended; its cursor moves to the next
# pass) and the merged position just past it. Stream None: the walk pauses (every stream idle), so
# what is built is published now rather than after the pause.
_Item = tuple[_Stream | None, Unit | None, MixCursor]


class SyncDaemon:
    """Keeps ``config.cache.dir`` filled with shards sampled from ``config.sources`` by their weights."""

    def __init__(
        self,
        config: Config,
        *,
        progress: bool | None = None,
        on_fetch: Callable[[Unit], None] | None = None,
        on_publish: Callable[[ShardRecord], None] | None = None,
    ) -> None:
        """``progress``: a bar (None: only on a terminal). ``on_fetch`` / ``on_publish``: hooks
        called with each unit read from the remote (in the daemon's main thread) and each shard
        published (in its writer thread, before the next shard is written: setting the stop event
        there publishes nothing more). For metrics and audits; they must be quick."""
        self.config = config
        self.layout = CacheLayout.create(config.cache.dir)
        self.on_fetch, self.on_publish = on_fetch, on_publish
        self._progress = progress

    def run(self, once: bool = False, stop: threading.Event | None = None) -> SyncReport:
        """Sync until ``stop`` is set (or SIGINT/SIGTERM in the main thread).

        With ``once``, return instead when the next shard would need an eviction (the budget is full)
        or when every source has completed one pass. Raises :class:`DaemonRunningError` if another
        daemon holds this cache dir, :class:`SourceError` on a permanent remote failure.
        """
        stop = stop or threading.Event()
        with exclusive(self.layout.lock), _stop_on_signals(stop):
            ledger = Ledger(self.layout.ledger)
            try:
                reconcile(self.layout, ledger)
                timeout = self.config.sampler.request_timeout_s
                largest = int(self.config.sampler.max_sample_bytes)
                streams = [_Stream(cfg, open_source(cfg, timeout, largest)) for cfg in self.config.sources]
                return _Run(self, ledger, streams, stop, once).execute()
            finally:
                ledger.close()


class _Run:
    """The state of one ``SyncDaemon.run``; see the module docstring for the invariants."""

    def __init__(
        self, daemon: SyncDaemon, ledger: Ledger, streams: list[_Stream], stop: threading.Event, once: bool
    ) -> None:
        self.cfg, self.layout = daemon.config, daemon.layout
        self.on_fetch, self.on_publish = daemon.on_fetch, daemon.on_publish
        self.ledger, self.streams, self.stop, self.once = ledger, streams, stop, once
        self.report = SyncReport()
        self.cached = {unit for record in ledger.shards() for unit in record.units}
        # Units read (or being read) and not yet published: a stream that wraps while its last units
        # are still on their way must not read them again in its next pass.
        self.claimed: set[str] = set()
        self.schema: tuple[str, pa.Schema] | None = None  # the first rows' (source name, schema)
        self.throttle = _Throttle(self.cfg.sampler.max_bytes_per_s, stop)
        self.rank, self.nodes = self.cfg.sampler.partition()
        sampler = self.cfg.sampler
        self.retrier = Retrier(sampler.max_attempts, sampler.backoff_s, sampler.backoff_max_s, ledger.incr, stop)
        self.writer: ThreadPoolExecutor  # set by execute(): the one thread that writes and publishes shards
        self.pending: deque[Future[Published | None]] = deque()
        self.refused = threading.Event()  # set by the writer thread once a shard was not published
        self.publisher = Publisher(daemon.layout, ledger, self.cfg.cache, stop, evict=not once)
        # disable=None: a bar on a terminal, none when output goes to a file or pipe.
        show = daemon._progress
        self.bar = tqdm(desc="sync", unit="B", unit_scale=True, unit_divisor=1024,
                        disable=None if show is None else not show)

    def execute(self) -> SyncReport:
        position = self._resume()
        with ThreadPoolExecutor(self.cfg.sampler.concurrency, thread_name_prefix="fetch") as pool, \
                ThreadPoolExecutor(1, thread_name_prefix="publish") as self.writer:
            try:
                self.report.reason = self._sync(pool, position)
            finally:
                self._settle()  # a shard already handed over is finished, never left half-written
                self.bar.close()
        log.info("sync ended (%s): %d shards, %d samples published", self.report.reason.value,
                 self.report.shards_published, self.report.samples_published)
        return self.report

    def _sync(self, pool: ThreadPoolExecutor, position: MixCursor) -> StopReason:
        """Consume the merged walk from ``position`` into shards until stopped, the budget is full
        (``once``) or, with ``once``, every stream has completed a pass."""
        building = _Building(position)
        for stream, unit, after, table in self._fetched(pool, self._walk(pool, position)):
            if stream is None:
                if building.tables and not self._publish(building):
                    return self._stop_reason()
                building.reset(after)
                continue
            if unit is None:  # the stream's pass ended: read what it skipped, then move to its next pass
                before = building.cursor.cursors[stream.name]
                for retried, rows in self._retry_skipped(stream, before.pass_):
                    if not self._add(building, stream, retried, rows):
                        return self._stop_reason()
            elif table is not None and not self._add(building, stream, unit, table):
                return self._stop_reason()
            building.cursor = after
            if building.nbytes >= self._shard_target():
                if not self._publish(building):
                    return self._stop_reason()
                building.reset(after)
        if self.stop.is_set():
            return StopReason.STOPPED
        # Only ``once`` ends the walk unstopped: every stream completed its pass.
        if building.tables and not self._publish(building):
            return self._stop_reason()
        if not self._settle():
            return self._stop_reason()
        self.ledger.set_cursor({**building.cursor.to_dict(), "progress": self._progress(building.cursor)})
        return StopReason.EXHAUSTED

    def _walk(self, pool: ThreadPoolExecutor, position: MixCursor) -> Iterator[_Item]:
        """The streams' walks merged by weight (:func:`~epochcache.mixing.pick`) from ``position``.

        A stream whose last pass found every unit cached gives nothing for ``_IDLE_POLL_S`` (its
        share goes to the others, and it comes back at its share rather than catching up on the rows
        it could not give); with ``once`` a stream stops after one pass. Ends when stopped or when
        every stream stopped."""
        walks = {s.name: self._stream_walk(pool, s, position.cursors[s.name]) for s in self.streams}
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
                log.info("every unit of the remote is cached; checking again in %.0fs", _IDLE_POLL_S)
                self.stop.wait(min(s.idle_until for s in live) - now)
                continue
            stream = next(s for s in live if s.name == pick(ready, position.rows))
            item = next(walks[stream.name], None)
            if item is None:
                live.remove(stream)
                continue
            unit, cursor = item
            # Only rows to be written count: a unit already cached (or on its way) adds none.
            fresh = stream.rows_of(unit) if unit is not None and not self._taken(unit.key) else 0
            rows, stream.unaccounted = stream.unaccounted + fresh, 0
            position = position.advance(stream.name, cursor, rows)
            yield stream, unit, position

    def _stream_walk(
        self, pool: ThreadPoolExecutor, stream: _Stream, cursor: Cursor
    ) -> Iterator[tuple[Unit | None, Cursor]]:
        """``stream``'s units from ``cursor`` on, pass after pass, each pass ended by ``(None, the
        next pass's cursor)``; ends when stopped, or after one pass with ``once``."""
        while True:
            objects = self._objects(stream, cursor.pass_)
            if objects is None:
                return
            pass_ = cursor.pass_
            sampler = Sampler(functools.partial(self._units_of, pool, stream, pass_), objects,
                              self.cfg.sampler.seed, mix=self.cfg.sampler.mix_units,
                              node_rank=self.rank, num_nodes=self.nodes)
            # The pass before stays known: its last units are still consumed while this one is walked.
            stream.totals = {p: n for p, n in stream.totals.items() if p == pass_ - 1}
            stream.totals[pass_] = len(sampler.node_objects(pass_))
            fetching = False
            for unit, after in sampler.walk(cursor):
                fetching = fetching or not self._taken(unit.key)
                yield unit, after
            cursor = cursor.next_pass()
            yield None, cursor
            if self.once:
                return
            if not fetching:
                stream.idle_until = time.monotonic() + _IDLE_POLL_S

    def _shard_target(self) -> int:
        """Bytes at which the shard being built is published: ``cache.shard_bytes``, except that an
        empty cache gets its first shard after one unit, so a trainer started with the daemon waits
        for one remote read, not for a whole shard's worth of them."""
        return self.cfg.cache.shard_bytes if self.cached or self.pending or self.report.shards_published else 1

    def _add(self, building: _Building, stream: _Stream, unit: Unit, table: pa.Table) -> bool:
        """Add a unit's rows, first publishing what is built if they would overflow the shard.
        Raises :class:`SourceError` if its columns differ from the rows before it (shards mix sources)."""
        self._check_schema(stream, unit, table)
        if building.tables and building.nbytes + table.nbytes > self.cfg.cache.shard_bytes:
            if not self._publish(building):
                return False
            building.reset(building.cursor)
        building.add(unit, table)
        return True

    def _units_of(
        self, pool: ThreadPoolExecutor, stream: _Stream, pass_: int, objects: Sequence[RemoteObject]
    ) -> list[Sequence[Unit]]:
        """The units of ``objects``, their metadata read concurrently. An object whose metadata keeps
        failing (or is gone) counts as empty for this pass and is recorded, so a restart walks the
        same order; it is retried at the end of the pass."""
        skipped = {key for key, info in self.ledger.skipped().items() if info.get("pass") == pass_}
        futures = [
            None if f"{obj.path}#*" in skipped
            else pool.submit(self.retrier.call, stream.source.units, obj, what=f"metadata of {obj.path}")
            for obj in objects
        ]
        return [self._units_or_skip(stream, pass_, obj, future) for obj, future in zip(objects, futures)]

    def _units_or_skip(
        self, stream: _Stream, pass_: int, obj: RemoteObject, future: Future[Sequence[Unit]] | None
    ) -> Sequence[Unit]:
        if future is None:
            return []
        try:
            return future.result()
        except (FetchFailedError, ObjectMissingError) as exc:
            self._skip(stream, pass_, f"{obj.path}#*", obj, None, exc)
            return []

    def _skip(self, stream: _Stream, pass_: int, key: str, obj: RemoteObject, index: int | None,
              exc: Exception) -> None:
        """Record a unit (or a whole object: ``index`` None) that failed, for the retry at pass end."""
        log.warning("skipping %s for now: %s", key, describe(exc))
        self.report.units_skipped += 1
        self.ledger.incr("units_skipped")
        self.ledger.set_skipped(key, {"path": obj.path, "size": obj.size, "index": index, "pass": pass_,
                                      "stream": stream.name, "error": describe(exc)})

    def _retry_skipped(self, stream: _Stream, pass_: int) -> Iterator[tuple[Unit, pa.Table]]:
        """Yield the rows of ``stream``'s skipped units of this pass that read now; forget those whose
        object is gone; a unit failing again stays recorded and is counted, and the pass moves on
        without it."""
        for key, info in self.ledger.skipped().items():
            if (info.get("pass") != pass_ or info.get("stream", "") != stream.name or info.get("final")
                    or self.stop.is_set()):
                continue
            obj = RemoteObject(info["path"], info["size"])
            try:
                units = self.retrier.call(stream.source.units, obj, what=f"metadata of {obj.path}")
                wanted = units if info["index"] is None else [units[info["index"]]]
                for unit in wanted:
                    if not self._taken(unit.key):
                        table = self._read(stream, unit)
                        self.claimed.add(unit.key)
                        yield unit, table
            except ObjectMissingError as exc:
                log.warning("dropping %s: %s", key, describe(exc))
                self.ledger.incr("objects_missing")
            except FetchFailedError as exc:
                log.warning("%s failed again at the end of pass %d: %s", key, pass_, describe(exc))
                self.ledger.set_skipped(key, {**info, "final": True, "error": describe(exc)})
                continue
            self.ledger.drop_skipped(key)

    def _read(self, stream: _Stream, unit: Unit) -> pa.Table:
        table = self.retrier.call(stream.source.read, unit, what=f"{unit.key}")
        self._count_fetch(stream, unit, table)
        return table

    def _check_schema(self, stream: _Stream, unit: Unit, table: pa.Table) -> None:
        if self.schema is None:
            self.schema = (stream.name, table.schema)
            return
        first, schema = self.schema
        if not table.schema.equals(schema, check_metadata=False):
            raise SourceError(
                f"{unit.key} (source {stream.name!r}) has columns {_columns(table.schema)} but earlier rows "
                f"(source {first!r}) have {_columns(schema)}: shards mix every source's rows, so give all "
                "sources the same columns and types (select them with each source's columns key)"
            )

    def _taken(self, key: str) -> bool:
        """Whether the unit is cached or on its way there: it is not read again."""
        return key in self.cached or key in self.claimed

    def _stop_reason(self) -> StopReason:
        return StopReason.STOPPED if self.stop.is_set() else StopReason.BUDGET_FULL

    def _resume(self) -> MixCursor:
        """Where to go on from: the ledger's cursor, each stream's afresh if it was left by another
        remote order."""
        position = MixCursor.from_dict(self.ledger.cursor(), [s.name for s in self.streams])
        for stream in self.streams:
            listing = self.ledger.stream_listing(stream.name)
            if listing and listing.get("order") != self._order(stream):
                log.warning("source %r: url, format, columns, labels, sampler.seed, sampler.mix_units or the "
                            "node partition changed since the last run: starting a new order from its first "
                            "pass; cached shards rotate out as usual", stream.name or stream.config.url)
                self.ledger.set_stream_listing(stream.name, {})
                self.ledger.drop_listing_pages(stream.name)
                position = MixCursor({**position.cursors, stream.name: Cursor()}, position.rows)
        return position

    def _order(self, stream: _Stream) -> list[object]:
        """What fixes a stream's order; its cursor is meaningless under another one."""
        sampler, source = self.cfg.sampler, stream.config
        return ["v2", source.url, source.format, source.columns, source.labels, sampler.seed, sampler.mix_units,
                self.rank, self.nodes]

    def _objects(self, stream: _Stream, pass_: int) -> PagedListing | None:
        """The listing this pass of ``stream`` walks: streamed into the ledger once per pass and
        reopened from it across restarts. A listing that keeps failing is tried again after a pause;
        None once stopped."""
        header = self.ledger.stream_listing(stream.name)
        if header and header.get("pass") == pass_:
            stored = PagedListing.open(self.ledger, header, stream.name)
            if stored is not None:
                return stored
        while not self.stop.is_set():
            try:
                return self.retrier.call(self._list, stream, pass_, what=f"listing of {stream.source.url}")
            except FetchFailedError as exc:
                log.warning("%s; trying again in %.0fs", exc, self.cfg.sampler.backoff_max_s)
                self.stop.wait(self.cfg.sampler.backoff_max_s)
        return None

    def _list(self, stream: _Stream, pass_: int) -> PagedListing:
        header = {"order": self._order(stream), "pass": pass_}
        listing = store_listing(self.ledger, stream.source.scan_objects(), header, stream.name)
        log.info("listed %d objects under %s for pass %d", len(listing), stream.source.url, pass_)
        return listing

    def _fetched(
        self, pool: ThreadPoolExecutor, walk: Iterator[_Item]
    ) -> Iterator[tuple[_Stream | None, Unit | None, MixCursor, pa.Table | None]]:
        """Yield walk items in order with their table (None for units already cached and pass ends),
        keeping up to ``2 * concurrency`` reads in flight (one, until an empty cache's first shard is
        handed over: its unit then has the machine to itself); a pause of the walk drains the window."""
        window: deque[tuple[_Stream | None, Unit | None, MixCursor, Future[pa.Table] | None]] = deque()
        full = 2 * self.cfg.sampler.concurrency
        try:
            for stream, unit, after in walk:
                future = None
                if stream is not None and unit is not None and not self._taken(unit.key):
                    self.claimed.add(unit.key)
                    future = pool.submit(self.retrier.call, stream.source.read, unit, what=unit.key)
                window.append((stream, unit, after, future))
                limit = 1 if self._shard_target() == 1 else full
                while len(window) >= limit or (window and (window[0][3] is None or stream is None)):
                    yield self._complete(*window.popleft())
                if self.stop.is_set():
                    return
            while window and not self.stop.is_set():
                yield self._complete(*window.popleft())
        finally:
            for *_, future in window:
                if future is not None:
                    future.cancel()

    def _complete(
        self, stream: _Stream | None, unit: Unit | None, after: MixCursor, future: Future[pa.Table] | None
    ) -> tuple[_Stream | None, Unit | None, MixCursor, pa.Table | None]:
        """The unit's table; None if it is cached, or if it failed and was recorded as skipped."""
        if future is None or unit is None or stream is None:
            return stream, unit, after, None
        try:
            table = future.result()
        except (FetchFailedError, ObjectMissingError) as exc:
            self.claimed.discard(unit.key)
            self._skip(stream, after.cursors[stream.name].pass_, unit.key, unit.obj, unit.index, exc)
            return stream, unit, after, None
        self._count_fetch(stream, unit, table)
        return stream, unit, after, table

    def _count_fetch(self, stream: _Stream, unit: Unit, table: pa.Table) -> None:
        self.report.units_fetched += 1
        stream.learn(unit, table)
        if self.on_fetch is not None:
            self.on_fetch(unit)
        self.bar.update(table.nbytes)
        self.throttle.consume(table.nbytes)

    def _progress(self, position: MixCursor) -> dict[str, int | None]:
        """What ``epochcache status`` shows as sampler progress (this node's share of each stream's
        pass): ``pass``, ``objects_done``, ``objects_total``, prefixed by ``<source name>.`` when the
        config names several sources."""
        progress: dict[str, int | None] = {}
        for stream in self.streams:
            cursor, prefix = position.cursors[stream.name], f"{stream.name}." if stream.name else ""
            total = stream.totals.get(cursor.pass_)
            done = cursor.group * self.cfg.sampler.mix_units
            progress |= {f"{prefix}pass": cursor.pass_,
                         f"{prefix}objects_done": done if total is None else min(done, total),
                         f"{prefix}objects_total": total}
        return {**progress, "node_rank": self.rank, "num_nodes": self.nodes,
                "units_skipped": self.report.units_skipped}

    def _publish(self, building: _Building) -> bool:
        """Hand ``building`` to the writer thread as one shard, once fewer than ``_WRITES_QUEUED`` wait
        there; False if a shard before it was not published (stopped, or the budget is full). Writing
        shards thus overlaps fetching and decoding the next ones, and shards are still published in
        order, one at a time, each with the cursor just past its last unit."""
        while len(self.pending) >= _WRITES_QUEUED:
            if not self._settle_one():
                return False
        cursor = {**building.cursor.to_dict(), "progress": self._progress(building.cursor)}
        self.pending.append(self.writer.submit(self._write, pa.concat_tables(building.tables), building.units, cursor))
        return True

    def _write(self, table: pa.Table, units: list[str], cursor: dict[str, Any]) -> Published | None:
        """In the writer thread: publish one shard, unless the daemon is stopping or a shard before it
        was refused (then none after it may be published either, or the cursor would jump past the
        refused shard's units)."""
        if self.refused.is_set() or self.stop.is_set():  # stopped: queued shards are dropped, like the one built
            self.refused.set()
            return None
        published = self.publisher.publish(table, units, cursor)
        if published is None:
            self.refused.set()
        elif self.on_publish is not None:  # here, before the next shard starts: a hook may stop the daemon
            self.on_publish(published.record)
        return published

    def _settle(self) -> bool:
        """Wait for every shard in the writer thread; False if one was not published (and then the
        ones after it are dropped unpublished: the cursor never jumps past a shard that is missing)."""
        while self.pending:
            if not self._settle_one():
                return False
        return True

    def _settle_one(self) -> bool:
        """Wait for the oldest shard in the writer thread and account for it; False if it was not published."""
        published = self.pending.popleft().result()
        if published is None:
            for later in self.pending:  # each returns None unpublished if it is already running
                later.cancel()
            self.pending.clear()
            return False
        record = published.record
        for victim in published.evicted:
            self.cached.difference_update(victim.units)
        self.cached.update(record.units)
        self.claimed.difference_update(record.units)
        self.report.evicted += len(published.evicted)
        self.report.shards_published += 1
        self.report.bytes_published += record.nbytes
        self.report.samples_published += record.rows
        self.report.units_published += len(record.units)
        self.bar.set_postfix(shards=self.report.shards_published, samples=self.report.samples_published,
                             evicted=self.report.evicted, refresh=False)
        return True


def _columns(schema: pa.Schema) -> str:
    return "[" + ", ".join(f"{field.name}: {field.type}" for field in schema) + "]"


@contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """In the main thread, turn SIGINT/SIGTERM into ``stop.set()`` for the duration."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        log.info("received %s: finishing cleanly", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
