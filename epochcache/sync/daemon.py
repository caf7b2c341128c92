"""The sync daemon: sampler -> fetch pool -> shard builder -> write -> publish -> evict.

Several sources (``config.sources``) are walked as streams, each with its own listing, passes and
cursor, merged by weight (:mod:`epochcache.sync.mixing`); the cursor published with a shard holds every
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

The parts live in :mod:`epochcache.sync` (walk, fetch window, skips, assembly, writer, identity,
vitals); :class:`_Run` wires them for one run.

Faults: every remote call goes through :class:`~epochcache.sources.retry.Retrier` (transient errors retried
with backoff, counted in the ledger). A unit (or an object's metadata) that still fails, or whose
object vanished, or whose bytes are bad (:class:`CorruptObjectError`, a unit of 0 rows), is recorded
in the ledger as skipped and the walk goes on, so neither an outage nor a bad object kills the
daemon; at the end of the pass the skipped units are read again, and those still failing are
reported (``SyncReport.units_unread``). Only errors of configuration (:class:`SourceError`: no
credentials, access denied, no such bucket, no files) and a config that would write rows of another
schema than the cache holds (:class:`DatasetMismatchError`) end the run.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from types import FrameType
from typing import Any

import pyarrow as pa
from tqdm import tqdm

from epochcache.cache.columns import shaped
from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import PUBLISH_GROWTH, Ledger, ShardRecord
from epochcache.cache.ledger_schema import Connect, connect
from epochcache.cache.lockfile import exclusive
from epochcache.cache.publisher import Publisher
from epochcache.cache.repair import reconcile
from epochcache.config import Config
from epochcache.sources import Unit, open_source
from epochcache.sources.footers import FooterStore, daemon_store
from epochcache.sources.retry import Retrier
from epochcache.sync.assembly import Building, screen
from epochcache.sync.claims import Claims
from epochcache.sync.digest_memory import LedgerDigests
from epochcache.sync.identity import DatasetBinding, resume_position
from epochcache.sync.intake import Intake, Throttle
from epochcache.sync.memory import frozen_heap
from epochcache.sync.mixing import MixCursor
from epochcache.sync.notes import note, until_written
from epochcache.sync.report import StopReason, SyncReport
from epochcache.sync.sampler import Cursor
from epochcache.sync.skips import SkipBook
from epochcache.sync.stream import Stream
from epochcache.sync.vitals import Vitals, settings_of
from epochcache.sync.walk import Walk
from epochcache.sync.window import FetchWindow
from epochcache.sync.writer import ShardWriter
from epochcache.threads import DaemonThreadPool

__all__ = ["StopReason", "SyncDaemon", "SyncReport"]

log = logging.getLogger(__name__)


class SyncDaemon:
    """Keeps ``config.cache.dir`` filled with shards sampled from ``config.sources`` by their weights."""

    def __init__(
        self,
        config: Config,
        *,
        progress: bool | None = None,
        on_fetch: Callable[[Unit], None] | None = None,
        on_publish: Callable[[ShardRecord], None] | None = None,
        connect: Connect = connect,
    ) -> None:
        """``progress``: a bar (None: only on a terminal). ``on_fetch`` / ``on_publish``: hooks
        called with each unit read from the remote (in the daemon's main thread) and each shard
        published (in its writer thread, before the next shard is written: setting the stop event
        there publishes nothing more). For metrics and audits; they must be quick. ``connect`` opens
        the ledger's database (tests inject one whose disk fills)."""
        self.config = config
        self.layout = CacheLayout.create(config.cache.dir)
        self.on_fetch, self.on_publish = on_fetch, on_publish
        self._progress = progress
        self._connect = connect

    def run(self, once: bool = False, stop: threading.Event | None = None) -> SyncReport:
        """Sync until ``stop`` is set (or SIGINT/SIGTERM in the main thread).

        With ``once``, return instead when the next shard would need an eviction (the budget is full)
        or when every source has completed one pass. Raises :class:`DaemonRunningError` if another
        daemon holds this cache dir, :class:`DatasetMismatchError` if the config would write rows of
        another schema than the cache holds, :class:`SourceError` on a permanent remote failure. A full
        disk under the ledger is waited out (see :mod:`epochcache.sync.notes`).
        Every thread it started has ended when it returns or raises.
        """
        stop = stop or threading.Event()
        with frozen_heap(), exclusive(self.layout.lock), _stop_on_signals(stop):
            ledger = Ledger(self.layout.ledger, self._connect)
            footers: FooterStore | None = None
            try:
                if until_written(lambda: reconcile(self.layout, ledger), stop, "start") is None:
                    return SyncReport()  # stopped before it began
                cache = self.config.cache
                footers = daemon_store(self.layout.footers, cache.footer_charge(),
                                       int(cache.max_bytes) - ledger.usage().total)
                # (the ledger's share is taken at the start: it grows a little as the cache fills, and
                # the publisher's own check stays the last word)
                unit_room = cache.shard_budget() - ledger.disk_bytes() - PUBLISH_GROWTH
                streams = [Stream(cfg, open_source(cfg, self.config.sampler, footers, LedgerDigests(ledger, cfg)),
                                  largest_unit=unit_room) for cfg in self.config.sources]
                return _Run(self, ledger, streams, stop, once).execute()
            finally:
                if footers is not None:
                    footers.close()
                ledger.close()


def _units_done(saved: dict[str, Any] | None, position: MixCursor) -> dict[str, int]:
    """Each stream's units put in shards this pass, as the last published cursor counted them (0 for
    a stream that resumes in another pass, or afresh)."""
    progress = (saved or {}).get("progress") or {}
    out = {}
    for name, cursor in position.cursors.items():
        prefix = f"{name}." if name else ""
        same_pass = progress.get(f"{prefix}pass") == cursor.pass_ and cursor != Cursor()
        out[name] = int(progress.get(f"{prefix}units_done") or 0) if same_pass else 0
    return out


class _Run:
    """One ``SyncDaemon.run``: wires the parts (walk -> fetch window -> assembly -> writer) and
    consumes the walk into shards; see the module docstring for the invariants."""

    def __init__(
        self, daemon: SyncDaemon, ledger: Ledger, streams: list[Stream], stop: threading.Event, once: bool
    ) -> None:
        self.cfg, self.daemon, self.ledger, self.streams = daemon.config, daemon, ledger, streams
        self.stop, self.once = stop, once
        self.report = SyncReport()
        self.claims = Claims(ledger.cached_units)
        usage = ledger.usage()
        self.had_shards = usage.shards > 0
        self.binding = DatasetBinding(ledger, self.cfg, self.had_shards)
        sampler = self.cfg.sampler
        self.vitals = Vitals(ledger)
        self.retrier = Retrier(sampler.max_attempts, sampler.backoff_s, sampler.backoff_max_s,
                               lambda name: note(ledger.counters.incr, name), stop, self.vitals.retrying)
        self.skips = SkipBook(ledger, self.retrier, self.claims, self.report, self.vitals, stop)
        # disable=None: a bar on a terminal, none when output goes to a file or pipe.
        show = daemon._progress
        # With once, the bar runs to the budget's free room: where the run ends, if the remote is larger.
        room = max(0, self.cfg.cache.shard_budget() - usage.total) if once else None
        self.bar = tqdm(desc="sync", total=room, unit="B", unit_scale=True, unit_divisor=1024,
                        disable=None if show is None else not show)
        self.intake = Intake(self.report, self.bar, Throttle(sampler.max_bytes_per_s, stop), daemon.on_fetch,
                             self.vitals)
        self.writer: ShardWriter  # set by execute(), with its thread
        self.units_done: dict[str, int] = {}  # set by execute(), from where it resumes

    def execute(self) -> SyncReport:
        self.vitals.start(settings_of(self.cfg, self.once))
        position = resume_position(self.cfg, self.ledger, self.streams)
        self.units_done = _units_done(self.ledger.daemon.cursor(), position)
        publisher = Publisher(self.daemon.layout, self.ledger, self.cfg.cache, self.stop, evict=not self.once)
        # Daemon threads (epochcache.threads): a daemon run in a thread of a program that ends must not
        # hold the exit up, waiting for room that only training makes.
        with _joined(DaemonThreadPool(self.cfg.sampler.concurrency, "fetch")) as pool, \
                _joined(DaemonThreadPool(1, "publish")) as writer:
            self.writer = ShardWriter(writer, publisher, self.claims, self.report, self.bar, self.daemon.on_publish,
                                      self.stop)
            walk = Walk(self.cfg, self.daemon.layout, self.ledger, self.streams, pool, self.retrier, self.claims,
                        self.skips, self.vitals, self.stop, self.once, settle=self.writer.settle)
            window = FetchWindow(pool, self.retrier, self.claims, self.skips, self.intake, self.cfg.sampler.concurrency,
                                 int(self.cfg.sampler.max_inflight_bytes), self._first_shard_pending, self.stop)
            try:
                # closing(): the window cancels its queued reads here, before the pool is joined.
                with closing(window.fetched(walk.merged(position))) as fetched:
                    self.report.reason = self._sync(fetched, position)
            finally:
                self.writer.settle()  # a shard already handed over is finished, never left half-written
                self.bar.close()
                self.report.units_unread = self.skips.unread
                self.vitals.flush()
        log.info("sync ended (%s): %d shards, %d samples published, %d units skipped and unread",
                 self.report.reason.value, self.report.shards_published, self.report.samples_published,
                 self.report.units_unread)
        return self.report

    def _sync(self, fetched: Iterator[tuple[Stream | None, Unit | None, MixCursor, pa.Table | None]],
              position: MixCursor) -> StopReason:
        """Consume the fetched walk from ``position`` into shards until stopped, the budget is full
        (``once``) or, with ``once``, every stream has completed a pass."""
        building = Building(position)
        for stream, unit, after, table in fetched:
            if self.claims.outdated:  # (a listing showed objects rewritten: see Claims)
                for key in building.drop(self.claims.outdated):
                    self.claims.drop(key)
            if stream is None:
                if building.tables and not self._publish(building):
                    return self._stop_reason()
                building.reset(after)
                continue
            if unit is None:  # the stream's pass ended: read what it skipped, then move to its next pass
                before = building.cursor.cursors[stream.name]
                for retried, rows in self.skips.retry(stream, before.pass_, self._read):
                    if not self._add(building, stream, retried, rows):
                        return self._stop_reason()
                self.units_done[stream.name] = 0
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
        if not self.writer.settle():
            return self._stop_reason()
        note(self.ledger.daemon.set_cursor, {**building.cursor.to_dict(), "progress": self._progress(building.cursor)})
        return StopReason.EXHAUSTED

    def _add(self, building: Building, stream: Stream, unit: Unit, table: pa.Table) -> bool:
        """Add a unit's rows, first publishing what is built if they would overflow the shard. Columns
        whose field metadata names a shape become tensor columns (:func:`shaped`); rows with a null
        in a fixed-width column are dropped (counted). Raises :class:`SourceError` if its
        columns differ from the rows before it, :class:`DatasetMismatchError` if from the rows cached."""
        if self.claims.drop(unit.key):  # read from a version the remote has replaced since
            return True
        self.binding.check(stream.name, unit.key, table.schema)
        table, dropped = screen(shaped(table))
        if dropped:
            log.warning("%s: dropped %d rows with a null in a fixed-width column", unit.key, dropped)
            self.report.rows_dropped += dropped
            note(self.ledger.counters.incr, "rows_dropped", dropped)
        if table.num_rows == 0:  # every row dropped: nothing to add (a shard never holds 0 rows)
            return True
        if building.tables and building.nbytes + table.nbytes > self.cfg.cache.shard_bytes:
            if not self._publish(building):
                return False
            building.reset(building.cursor)
        building.add(unit, table)
        self.units_done[stream.name] += 1
        return True

    def _read(self, stream: Stream, unit: Unit) -> pa.Table:
        return self.intake.take(stream, unit, self.retrier.call(stream.read, unit, what=f"{unit.key}"))

    def _publish(self, building: Building) -> bool:
        """Hand ``building`` to the writer as one shard with the cursor just past its last unit."""
        cursor = {**building.cursor.to_dict(), "progress": self._progress(building.cursor)}
        self.vitals.flush()  # the bytes fetched for this shard are counted before an epoch can hold it
        return self.writer.submit(building.rows, building.units, cursor)

    def _shard_target(self) -> int:
        """Bytes at which the shard being built is published: ``cache.shard_bytes``, except that an
        empty cache gets its first shard after one unit, so a trainer started with the daemon waits
        for one remote read, not for a whole shard's worth of them."""
        busy = self.had_shards or self.writer.pending or self.report.shards_published
        return self.cfg.cache.shard_bytes if busy else 1

    def _first_shard_pending(self) -> bool:
        """Whether an empty cache's first shard is not published yet: until then the fetch window keeps
        one unit in flight, so the first unit's read and then the shard's write and fsync have the
        machine to themselves rather than compete with ``concurrency`` reads (in the loader
        benchmark's local Parquet setting the first shard's write took 68-150 ms beside them)."""
        if self.had_shards or self.report.shards_published:
            return False
        return not any(write.done() for write in self.writer.pending)

    def _stop_reason(self) -> StopReason:
        return StopReason.STOPPED if self.stop.is_set() else StopReason.BUDGET_FULL

    def _progress(self, position: MixCursor) -> dict[str, int | None]:
        """What ``epochcache status`` shows as sampler progress (this node's share of each stream's
        pass): ``pass``, ``remote_rows`` (an estimate of the rows of this node's share, see
        :meth:`Stream.remote_rows`), ``units_done`` (units put in shards this pass), ``objects_done`` (objects
        whose every unit is behind the cursor: with ``mix_units`` interleaving, few until the end),
        ``objects_total``, prefixed by ``<source name>.`` when the config names several sources."""
        rank, nodes = self.cfg.sampler.partition()
        progress: dict[str, int | None] = {}
        for stream in self.streams:
            cursor, prefix = position.cursors[stream.name], f"{stream.name}." if stream.name else ""
            total = stream.totals.get(cursor.pass_)
            done = cursor.group * stream.mix
            progress |= {f"{prefix}pass": cursor.pass_,
                         f"{prefix}remote_rows": stream.remote_rows(cursor.pass_),
                         f"{prefix}units_done": self.units_done[stream.name],
                         f"{prefix}objects_done": done if total is None else min(done, total),
                         f"{prefix}objects_total": total}
        return {**progress, "node_rank": rank, "num_nodes": nodes,
                "units_skipped": self.report.units_skipped}


@contextmanager
def _joined(pool: DaemonThreadPool) -> Iterator[DaemonThreadPool]:
    """``pool``, shut down on the way out with its queued work cancelled and every thread joined:
    no read runs after ``run`` returns (a thread of ours, or a pyarrow/fsspec call it made, still
    running at interpreter exit aborts the process: exit 134)."""
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


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
