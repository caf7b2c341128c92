"""EpochCachedLoader: one epoch per ``iter()``, over the shards present when it starts.

Each epoch's shard set is a ledger snapshot taken together with a lease on exactly those shards, so
the daemon cannot evict them mid-epoch; a heartbeat thread renews the lease. A finished epoch's
lease is released, and its batch thread stopped, in the background once the trainer comes back from
the next epoch's first batch (or at :meth:`EpochCachedLoader.close`), so that work never delays that
batch; an epoch left early is released at once, and a killed trainer's lease simply expires. When
the time the epoch has left comes within reach of the measured preparation time
(:mod:`epochcache.train.timing`; or at ``loader.prepare_next_at`` of its batches, when set), a
background thread snapshots the next epoch, builds its dataset and order and starts its batches (the
batch thread, or, at the next batch boundary, queues it on the worker processes, which are kept
across epochs: :mod:`epochcache.train.workers`), so the next epoch starts without a stall.

Integrity: an epoch's shards must share one schema (else a :class:`LoaderError` naming both); a
shard whose file is missing or not at its recorded size is quarantined and left out; an epoch
prepared ahead is built again at its start if a shard may have been quarantined since its snapshot
(the ledger's commit mark changed, :mod:`epochcache.train.commits`, and its count says so); nothing is
checksummed before the first batch: shards not yet verified on this host are checksummed after it by
a :class:`~epochcache.cache.verifier.BackgroundVerifier` (local rank 0 only), which quarantines failures.

Two modes: without a user transform, batches are built in this process, planned on a background
thread that builds ahead, and by the consumer's thread when it comes for a batch not yet built
(:mod:`epochcache.train.prefetch`; the gathers release the GIL); with
one (``transform`` per batch, ``sample_transform`` per sample), DataLoader worker processes run it
and send fixed-shape batches back through shared-memory slots (:mod:`epochcache.train.slots`).
``loader.num_workers`` overrides the choice.

Under torch.distributed, ranks sharing a cache dir read one agreed snapshot, each a disjoint part of
its order, and all ranks of the job get the same number of batches (see :mod:`epochcache.train.distributed`).

``state_dict()`` / ``load_state_dict()`` resume mid-epoch: the order is a pure function of the
snapshot, seed and epoch, so a resumed epoch skips the batches already seen without reading them.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from epochcache.cache.coverage import coverage_of
from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import Lease, Ledger, ShardRecord
from epochcache.cache.quarantine import QuarantineUnreadable, quarantine_shard
from epochcache.cache.shards import open_shard
from epochcache.cache.verifier import BackgroundVerifier
from epochcache.config import LoaderConfig, format_validation_error, load_config
from epochcache.errors import CacheEmptyError, ConfigError, LedgerFullError, LoaderError, ShardCorruptError
from epochcache.sources.base import KEY_COLUMN
from epochcache.train.commits import CommitMarks
from epochcache.train.dataset import ShardSetDataset
from epochcache.train.device import pin_batch, pinning_available, to_device
from epochcache.train.distributed import Peers
from epochcache.train.jobs import then
from epochcache.train.mappings import ShardMaps
from epochcache.train.order import EpochBatches, batch_count, epoch_order, rank_part
from epochcache.train.prefetch import BatchThread
from epochcache.train.resume import Progress, read_state, snapshot_id
from epochcache.train.timing import PrepareClock
from epochcache.train.transform import BatchTransform, SampleTransform, TransformedDataset
from epochcache.train.waiting import LedgerChanges, Patience, wait_for_samples
from epochcache.train.workers import PoolEpoch, WorkerPool

log = logging.getLogger(__name__)

# Worker processes chosen when a transform is given and loader.num_workers is left unset.
_AUTO_WORKERS = 2


@dataclass(frozen=True)
class EpochInfo:
    """What an epoch was built from. ``snapshot`` identifies its shard set (a hash of the shard ids);
    ``start_batch`` > 0 for a resumed epoch; ``first_batch_wait_s`` is the time from ``iter()`` to its
    first batch, None until that batch exists. ``coverage`` and ``echo``: the cache's, this epoch
    included (see :mod:`epochcache.cache.coverage`; coverage None while the remote's size is unknown)."""

    epoch: int
    shards: int
    samples: int
    bytes: int
    batches: int
    skipped_shards: int
    prepared_ahead: bool = False
    first_batch_wait_s: float | None = None
    snapshot: str = ""
    start_batch: int = 0
    coverage: float | None = None
    echo: float | None = None


class _Epoch:
    """A built epoch: its lease, shard ids and batch source; ``start`` begins producing batches.

    Without workers the preparing thread starts the batch thread itself, which builds the first
    batches at once. With workers, ``start`` queues the epoch on the loader's worker pool (from the
    main thread, at a batch boundary once the preparation is done), behind the epoch being read, so
    the workers go on to it as soon as they are free (:mod:`epochcache.train.workers`).
    """

    def __init__(
        self, info: EpochInfo, lease: Lease, shards: tuple[str, ...], source: BatchThread | PoolEpoch | None,
        pin: bool, unverified: tuple[ShardRecord, ...] = (), quarantines: int = 0, version: int | None = None,
        mark: bytes | None = None,
    ):
        self.info, self.lease, self.shards, self._source, self._pin = info, lease, shards, source, pin
        self.unverified = unverified  # the epoch's shards not yet checksummed on this host
        self.quarantines = quarantines  # the ledger's count of quarantined shards before its snapshot
        # the ledger's version (Ledger.version: it changes with other connections' commits, quarantines
        # among them) once built, if that count was still the same
        self.version = version
        # its info once its first batch is out, made here, off the epoch boundary (see first_batch_out)
        self._first = replace(info, first_batch_wait_s=0.0)
        # the ledger's commit mark (epochcache.train.commits) read before a check found no quarantine
        # since the snapshot: while it is unchanged, none can have happened (moved on by _recheck)
        self.mark = mark

    def first_batch_out(self, wait_s: float) -> EpochInfo:
        """Its info with ``first_batch_wait_s``, as its first batch is handed out. (Made ahead: at an epoch
        boundary, with caches cold after the gathers, ``dataclasses.replace`` took 25-40 µs; the field is
        set before the info is published to anyone.)"""
        object.__setattr__(self._first, "first_batch_wait_s", wait_s)
        return self._first

    @property
    def usable(self) -> bool:
        """False once its worker pool was closed (by an epoch left early): it must be built again."""
        return not (isinstance(self._source, PoolEpoch) and self._source.pool.closed)

    def start(self) -> None:
        if isinstance(self._source, PoolEpoch):
            self._source.start()

    def batches(self) -> Generator[Any, None, None]:
        if isinstance(self._source, PoolEpoch):
            for batch in self._source.batches():
                yield pin_batch(batch) if self._pin else batch
        elif self._source is not None:
            yield from self._source

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
        self._source = None


class EpochCachedLoader:
    """Iterate it once per epoch; see the module docstring.

    ``cache_dir``: the daemon's ``cache.dir``. ``config``: a :class:`LoaderConfig`; keyword
    ``overrides`` replace its fields (``batch_size=128``). ``transform(batch)`` and
    ``sample_transform(sample)``: user functions run where batches are built (their presence selects
    worker processes unless ``num_workers`` is set). ``progress``: show the ``min_samples`` wait bar.
    Under torch.distributed every rank must construct its loader at the same point (a collective).
    Use as a context manager, or call :meth:`close`, to release leases and stop threads.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        config: LoaderConfig | None = None,
        *,
        transform: BatchTransform | None = None,
        sample_transform: SampleTransform | None = None,
        progress: bool = True,
        **overrides: Any,
    ):
        try:
            self.config = LoaderConfig.model_validate({**(config or LoaderConfig()).model_dump(), **overrides})
        except ValidationError as exc:
            raise ConfigError(f"EpochCachedLoader: {format_validation_error(exc)}") from None
        self._transform, self._sample_transform = transform, sample_transform
        self._layout = CacheLayout(Path(cache_dir).resolve())
        if not self._layout.shards.is_dir():  # only the daemon creates a cache: a typo must not make one
            raise LoaderError(
                f"no cache at {str(cache_dir)!r} ({self._layout.shards} does not exist): check cache.dir, "
                "or start `epochcache sync` with it first (the daemon creates the cache)"
            )
        self._ledger = Ledger(self._layout.ledger)
        self._commits = CommitMarks(self._ledger.path)  # (the ledger's connection, just opened, made its WAL index)
        self._peers = Peers.discover(self._layout.root)
        self._owner = f"{socket.gethostname()}:{os.getpid()}"
        self._workers = self._choose_workers()
        self._pin = self.config.pin_memory and pinning_available()
        self._device = torch.device(self.config.device) if self.config.device else None
        self._progress_bar = progress and self._peers.rank == 0
        self._waited = self.config.min_samples == 0
        self._epoch = 0
        self._last: EpochInfo | None = None
        self._progress: Progress | None = None
        self._resume: Progress | None = None
        self._next: tuple[int, Future[_Epoch]] | None = None
        self._unstarted: Future[_Epoch] | None = None  # the next epoch, until queued on the worker pool
        self._retiring: _Epoch | None = None  # the last epoch, done but its batch source not yet stopped
        self._present_ids: set[str] = set()  # shards whose file this loader found at its size
        # one checksumming thread per host (local rank 0), started on each epoch's first batch
        self._verifier = BackgroundVerifier(self._layout) if self._peers.local_rank == 0 else None
        # shard mappings the batch thread reuses from epoch to epoch, at most max_open_shards of them
        self._maps: ShardMaps[Any] = ShardMaps(self.config.max_open_shards)
        self._held: set[str] = set()
        self._held_lock = threading.Lock()
        self._closed = threading.Event()
        self._prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="epochcache-prepare")
        self._cleanup_pool = ThreadPoolExecutor(1, thread_name_prefix="epochcache-cleanup")
        # the batch threads of the current epoch and of the next one, prepared ahead
        self._build_pool = ThreadPoolExecutor(2, thread_name_prefix="epochcache-batches")
        # the worker processes, kept across epochs (made by the preparing thread, forked by the main one)
        self._pool: WorkerPool | None = None
        self._pool_lock = threading.Lock()
        ahead = self.config.prefetch_batches * max(self._workers, 1)
        self._clock = PrepareClock(ahead, self.config.prepare_next_at)
        self._heartbeat = threading.Thread(target=self._renew_leases, name="epochcache-lease", daemon=True)
        self._heartbeat.start()

    @classmethod
    def from_config(cls, path: str | os.PathLike[str], overrides: Any = (), **kwargs: Any) -> EpochCachedLoader:
        """Build from a config.yaml (``cache.dir`` and the ``loader`` section); ``kwargs`` as for the class."""
        config = load_config(path, overrides)
        return cls(config.cache.dir, config.loader, **kwargs)

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` will run."""
        return self._epoch

    @property
    def num_workers(self) -> int:
        """Worker processes per epoch: 0 is the in-process batch thread."""
        return self._workers

    @property
    def last_epoch(self) -> EpochInfo | None:
        """Facts about the epoch most recently started."""
        return self._last

    def __iter__(self) -> Iterator[Any]:
        started = time.monotonic()
        self._start_workers()
        self._wait_for_samples()
        epoch = self._epoch
        self._epoch += 1
        resume, self._resume = self._resume, None
        current = self._take_prepared(epoch, resume)
        info = self._last = current.info
        self._progress = Progress(epoch, info.start_batch, info.batches, current.shards)
        self._clock.begin(info.batches)
        batches, completed = current.batches(), False
        recorded: Future[None] | None = None
        stream = self._on_device(batches)
        try:
            for number, batch in enumerate(stream, start=info.start_batch):
                self._progress.position = number + 1
                if number == info.start_batch:
                    self._last = first = current.first_batch_out(time.monotonic() - started)
                    if self._verifier is not None:  # never before the first batch (see epochcache.cache.verifier)
                        self._verifier.submit(current.unverified)
                    try:
                        yield batch
                    finally:  # (also when the first batch is the last one taken)
                        recorded = self._after_first_batch_out(current, first)
                else:
                    yield batch
                if self._next is None and self._clock.due(number):
                    self._prepare_ahead(epoch + 1)
                if self._unstarted is not None:
                    self._start_prepared()
            self._progress = None
            self._prepare_ahead(epoch + 1)
            completed = True
        finally:
            stream.close()
            batches.close()
            if recorded is not None:  # done long since: last_epoch then has its coverage, the lease its record
                recorded.result()
            if completed:
                # Off the path to the next epoch's first batch: stopping the batch thread and
                # releasing the lease (a ledger write) wait until the trainer is back from that batch.
                self._retire_previous()
                self._retiring = current
            else:
                self._finish(current)

    def _after_first_batch_out(self, current: _Epoch, info: EpochInfo) -> Future[None]:
        """Once the trainer comes back from an epoch's first batch: one task for the cleanup thread (to
        retire the last epoch, then record this one). Not earlier: waking that thread as the first batch
        was handed out delayed it by ~0.2 ms (median of 37 epoch starts, the thread's wake-up alone)."""
        retiring, self._retiring = self._retiring, None
        return self._cleanup_pool.submit(self._after_first_batch, current, info, retiring)

    def _after_first_batch(self, current: _Epoch, info: EpochInfo, retiring: _Epoch | None) -> None:
        """On the cleanup thread, once an epoch's first batch is out: stop the last epoch's batch source
        and release its lease, then record this epoch."""
        if retiring is not None:
            self._finish(retiring)
        self._record(current, info)
        self._recheck()

    def _record(self, current: _Epoch, info: EpochInfo) -> None:
        """Record the running epoch in the ledger (local rank 0, for its node: the samples its batches
        hand out, a resumed epoch's skipped batches left out), then give ``last_epoch`` (``info``)
        the cache's coverage and echo, this epoch included. Runs on the cleanup thread after the
        first batch: the first epoch on a large cache adds the units of every shard to the record."""
        if self._peers.local_rank == 0:
            per_batch = self.config.batch_size * self._peers.local_world
            samples = min(self.config.epoch_samples or info.samples, (info.batches - info.start_batch) * per_batch)
            try:
                self._ledger.record_epoch(current.lease.id, max(0, samples))
            except LedgerFullError as exc:  # bookkeeping: training goes on without it
                log.warning("epoch %d not recorded for coverage and echo: %s", info.epoch, exc)
        covered = coverage_of(self._ledger)
        if covered is not None and self._last is info:  # this epoch's info, not yet replaced by the next
            self._last = replace(info, coverage=covered.coverage, echo=covered.echo)

    # -- resume ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where to resume: ``{"epoch", "position", "seed", "shards", "snapshot"}``.

        Inside an epoch ``position`` is the number of its batches already handed out (the one just
        received included) and ``shards``/``snapshot`` pin its shard set; between epochs it is the next
        epoch at position 0 with no shard set (that epoch takes a fresh snapshot).
        """
        pending = self._resume or self._progress
        if pending is None or not pending.unfinished:
            pending = Progress(self._epoch, 0, None, ())
        return pending.state(self.config.seed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next ``iter()`` yields exactly the batches ``state`` had not seen.

        The seed is taken from ``state``. If the saved epoch's shards are no longer in the cache, that
        ``iter()`` raises :class:`LoaderError` rather than train on another set under the same position.
        """
        resume, seed = read_state(state)
        self.config = self.config.model_copy(update={"seed": seed})
        self._drop_prepared()
        self._epoch, self._progress = resume.epoch, None
        self._resume = resume if resume.shards else None

    def close(self) -> None:
        """Release every lease, drop a prepared epoch and stop the background threads."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._drop_prepared()
        self._retire_previous()
        self._prepare_pool.shutdown(wait=True)
        self._cleanup_pool.shutdown(wait=True)
        self._build_pool.shutdown(wait=True)
        if self._pool is not None:
            self._pool.close()
        self._heartbeat.join()
        if self._verifier is not None:
            self._verifier.close()
        with self._held_lock:
            for lease_id in self._held:
                self._ledger.release(lease_id)
            self._held.clear()
        self._commits.close()  # (before the ledger's connection: see CommitMarks' invariant)
        self._ledger.close()

    def __enter__(self) -> EpochCachedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- building epochs ------------------------------------------------------------------------

    def _choose_workers(self) -> int:
        if self.config.num_workers is not None:
            return self.config.num_workers
        wants_processes = self._transform is not None or self._sample_transform is not None
        return min(_AUTO_WORKERS, os.cpu_count() or 1) if wants_processes else 0

    def _wait_for_samples(self) -> None:
        if not self._waited:
            wait_for_samples(
                self._layout, self._ledger, self.config.min_samples, self.config.wait_timeout_s,
                self._closed, self._progress_bar,
            )
            self._waited = True

    def _on_device(self, batches: Generator[Any, None, None]) -> Generator[Any, None, None]:
        return batches if self._device is None else to_device(batches, self._device)

    def _take_prepared(self, epoch: int, resume: Progress | None) -> _Epoch:
        if resume is None and self._next is not None and self._next[0] == epoch:
            future = self._next[1]
            self._next = self._unstarted = None
            prepared = future.result()
            # A shard quarantined since its snapshot (the verifier found it damaged; its mapping
            # may still be open here) must not be read by an epoch that starts now: build it again.
            if prepared.usable and not self._quarantined_since(prepared):
                return prepared
            self._finish(prepared)  # its worker pool was closed by an epoch left early, or a shard left
        self._drop_prepared()
        return self._prepare(epoch, ahead=False, resume=resume)

    def _drop_prepared(self) -> None:
        if self._next is not None:
            _, future = self._next
            self._next = self._unstarted = None
            if not future.cancel() and future.exception() is None:
                self._finish(future.result())

    def _start_prepared(self) -> None:
        """Queue the prepared next epoch on the worker pool, from this (the main) thread, once it is built."""
        unstarted = self._unstarted
        if unstarted is not None and unstarted.done():
            self._unstarted = None
            if unstarted.exception() is None:
                unstarted.result().start()

    def _prepare_ahead(self, epoch: int) -> None:
        if self._next is None and not self._closed.is_set():
            self._next = (epoch, self._prepare_pool.submit(self._prepare, epoch, True, None))
            # (the cleanup thread's commits may land while it is prepared: check it again after them)
            self._next[1].add_done_callback(lambda _: self._cleanup_pool.submit(self._recheck))
            if self._workers:  # (a batch thread starts itself)
                self._unstarted = self._next[1]

    def _quarantines(self) -> int:
        return self._ledger.counters().get("quarantined", 0)

    def _version_unless_quarantined(self, quarantines: int) -> int | None:
        """The ledger's version now, if no shard was quarantined since ``quarantines`` were counted
        (counted again after reading it: a quarantine in between changes the version); else None."""
        # every quarantine is another connection's commit (the verifier's, a worker's, the daemon's)
        version = self._ledger.version()
        return version if self._quarantines() == quarantines else None

    def _quarantined_since(self, prepared: _Epoch) -> bool:
        """Whether a shard may have been quarantined since ``prepared``'s snapshot: not if no connection
        committed to the ledger since its mark (a memory read), nor if no other one committed since it
        was built (one statement), else by counting again."""
        if prepared.mark is not None and self._commits.now() == prepared.mark:
            return False
        if prepared.version is not None and self._ledger.version() == prepared.version:
            return False
        return self._quarantines() != prepared.quarantines

    def _recheck(self) -> None:
        """On the cleanup thread, after this loader's own commits (a lease released, an epoch recorded)
        and once the next epoch is prepared (whichever comes last): check the prepared epoch now, off
        the epoch boundary, and if no shard was quarantined since its snapshot move its mark past
        those commits, so that at its start the mark alone decides."""
        pending = self._next
        future = pending[1] if pending is not None else None
        if future is None or not future.done() or future.cancelled() or future.exception() is not None:
            return
        prepared = future.result()
        mark = self._commits.now()  # read before the check: a commit after it changes the mark
        if mark is not None and not self._quarantined_since(prepared):
            prepared.mark = mark

    def _prepare(self, epoch: int, ahead: bool, resume: Progress | None) -> _Epoch:
        quarantines = self._quarantines()
        lease, started = self._snapshot(epoch)
        try:
            records = self._agreed_records(lease, resume)
            self._check_one_schema(records)
            dataset = ShardSetDataset(
                [self._layout.shards / r.filename for r in records], [r.rows for r in records], self.config.columns,
                self._maps, QuarantineUnreadable(self._layout.root),
            )
            sampler = self._sampler([r.rows for r in records], epoch, resume.position if resume else 0)
            info = EpochInfo(
                epoch=epoch, shards=len(records), samples=len(dataset), bytes=sum(r.nbytes for r in records),
                batches=sampler.count, skipped_shards=len(lease.shards) - len(records), prepared_ahead=ahead,
                snapshot=snapshot_id([r.id for r in records]), start_batch=min(sampler.start, sampler.count),
            )
            source = self._batch_source(dataset, sampler)
            unverified = tuple(r for r in records if not r.verified)
            mark = self._commits.now()  # read before the version: a commit after it changes the mark
            version = self._version_unless_quarantined(quarantines)
            self._clock.prepare_s = time.monotonic() - started
            return _Epoch(info, lease, tuple(r.id for r in records), source, self._pin, unverified, quarantines,
                          version, mark if version is not None else None)
        except BaseException:
            self._release(lease.id)
            raise

    def _agreed_records(self, lease: Lease, resume: Progress | None) -> list[ShardRecord]:
        """The epoch's shards, sorted by id: the node's agreed set, or the resumed epoch's exact set."""
        usable = {r.id: r for r in lease.shards if self._present(r)}
        common = self._peers.common_shards(list(usable))
        if resume is None:
            return [usable[i] for i in common]
        gone = sorted(set(resume.shards) - set(common))
        if gone:
            raise LoaderError(
                f"cannot resume epoch {resume.epoch} at batch {resume.position}: {len(gone)} of its "
                f"{len(resume.shards)} shards are no longer in {self._layout.root} (evicted or corrupt, e.g. "
                f"{gone[0]}); resume from the next epoch instead: load_state_dict({{**state, 'epoch': "
                f"{resume.epoch + 1}, 'position': 0, 'shards': None, 'snapshot': None}})"
            )
        return [usable[i] for i in sorted(resume.shards)]

    def _check_one_schema(self, records: list[ShardRecord]) -> None:
        """A :class:`LoaderError` if the records name two schema fingerprints (the ledger's, so this
        reads no shard unless there is a conflict to describe); shards of unknown schema ("") are
        checked by the dataset as it opens them."""
        first: dict[str, ShardRecord] = {}
        for record in records:
            if record.schema:
                first.setdefault(record.schema, record)
        if len(first) > 1:
            counts = {fp: sum(r.schema == fp for r in records) for fp in first}
            (a, one), (b, two) = list(first.items())[:2]
            raise LoaderError(
                f"the cache {self._layout.root} holds shards of {len(first)} schemas: {counts[a]} shards with "
                f"{_schema_of(self._layout, one)}, {counts[b]} with {_schema_of(self._layout, two)} (it was filled "
                "under different source columns or sources); empty it with `epochcache clear`, or give "
                "cache.dir a new directory"
            )

    def _sampler(self, shard_rows: list[int], epoch: int, start: int) -> EpochBatches:
        cfg, peers = self.config, self._peers
        # Half the open maps per window: a batch near a window's end also touches the next window.
        window = max(1, cfg.max_open_shards // 2)
        order = epoch_order(sum(shard_rows), cfg.seed, epoch, cfg.shuffle, cfg.epoch_samples, cfg.replacement,
                            shard_rows, window)
        part = rank_part(order, peers.local_rank, peers.local_world)
        count = peers.fewest_batches(batch_count(len(part), cfg.batch_size, cfg.drop_last))
        return EpochBatches(part, cfg.batch_size, count, start)

    def _batch_source(self, dataset: ShardSetDataset, sampler: EpochBatches) -> BatchThread | PoolEpoch | None:
        """The epoch's batches: a batch thread, or the loader's worker processes (kept across epochs,
        sending through a slot ring when the dataset has tensor columns, see epochcache.train.workers)."""
        if not len(sampler):
            return None
        if self._workers == 0:
            jobs = TransformedDataset(dataset, self._transform, self._sample_transform).jobs(sampler)
            if self._pin:
                jobs = then(jobs, pin_batch)
            return BatchThread(jobs, self.config.prefetch_batches, self._build_pool)
        layout = dataset.fixed_layout()
        with self._pool_lock:
            if self._pool is None or self._pool.closed or not self._pool.fit(layout):
                # (a pool replaced for another layout stops its workers once its last epoch is dropped)
                self._pool = self._new_pool()
                self._pool.fit(layout)
            return PoolEpoch(self._pool, dataset, sampler)

    def _start_workers(self) -> None:
        """With workers, at an epoch's start (on the main thread, see WorkerPool.start): fork them now
        if no pool runs (the first epoch, or after an epoch left early), so that they start while this
        epoch waits for its shards and is built, not after (~0.1 s of the first batch)."""
        if self._workers:
            with self._pool_lock:
                if self._pool is None or self._pool.closed:
                    self._pool = self._new_pool()
                pool = self._pool
            pool.start()

    def _new_pool(self) -> WorkerPool:
        return WorkerPool(self._workers, self.config.prefetch_batches, self.config.batch_size,
                          self._transform, self._sample_transform)

    def _snapshot(self, epoch: int) -> tuple[Lease, float]:
        """A lease on a shard set holding at least one row, waiting for it while a daemon runs (up to
        ``wait_timeout_s``; see :class:`epochcache.train.waiting.Patience`), and when the snapshot that
        gave it began (``time.monotonic()``: what came before was waiting, not preparing)."""
        patience = Patience(self._layout, self.config.wait_timeout_s)
        changes = LedgerChanges(self._ledger)  # an empty snapshot is taken again once the daemon published
        while True:
            attempt = time.monotonic()
            lease = self._ledger.snapshot(f"{self._owner}:epoch{epoch}", self.config.lease_ttl_s,
                                          use=f"{self._peers.node_key}:epoch{epoch}")
            with self._held_lock:
                self._held.add(lease.id)
            if any(r.rows for r in lease.shards):  # zero-row shards alone would make an epoch of no batches
                return lease, attempt
            self._release(lease.id)
            why = patience.over()
            # a change: the daemon published (or wrote its state); closed: the wait ends here
            if why is not None or (not changes.wait(self._closed) and self._closed.is_set()):
                if why == "no daemon":
                    raise CacheEmptyError(
                        f"no shard in {self._layout.root} after {patience.elapsed():.0f}s and no sync daemon runs "
                        "on it: start `epochcache sync` with this cache.dir"
                    )
                raise CacheEmptyError(
                    f"no shard appeared in {self._layout.root} within {self.config.wait_timeout_s:g}s while "
                    "`epochcache sync` runs on it (loader.wait_timeout_s sets the wait): check `epochcache status`"
                )

    def _present(self, record: ShardRecord) -> bool:
        """Whether a shard's file is there at its recorded size (one stat, the first time this loader
        uses it); if not, it is quarantined. Its checksum is the background verifier's business."""
        if record.id in self._present_ids:
            return True
        path = self._layout.shards / record.filename
        try:
            size = path.stat().st_size
        except FileNotFoundError as exc:
            quarantine_shard(self._layout, self._ledger, record, f"skipped by an epoch: {exc}")
            return False
        if size != record.nbytes:
            reason = f"skipped by an epoch: {path} holds {size} bytes, the ledger recorded {record.nbytes} (truncated?)"
            quarantine_shard(self._layout, self._ledger, record, reason)
            return False
        self._present_ids.add(record.id)
        return True

    def _retire_previous(self) -> None:
        """Stop the finished epoch's batch source and release its lease, in the background."""
        if self._retiring is not None:
            self._cleanup_pool.submit(self._finish, self._retiring)
            self._retiring = None

    def _finish(self, epoch: _Epoch) -> None:
        epoch.close()
        self._release(epoch.lease.id)

    # -- leases ---------------------------------------------------------------------------------

    def _release(self, lease_id: str) -> None:
        with self._held_lock:
            self._held.discard(lease_id)
        self._ledger.release(lease_id)

    def _renew_leases(self) -> None:
        interval = self.config.lease_ttl_s / 3
        while not self._closed.wait(interval):
            with self._held_lock:
                held = list(self._held)
            for lease_id in held:
                if not self._ledger.renew(lease_id, self.config.lease_ttl_s):
                    with self._held_lock:
                        lost = lease_id in self._held  # else it was released meanwhile: no loss
                    if lost:
                        log.warning("lease %s expired before renewal (process stalled longer than "
                                    "loader.lease_ttl_s?): its shards may be evicted", lease_id)


def _schema_of(layout: CacheLayout, record: ShardRecord) -> str:
    """A shard's columns as ``[name: type, ...]``, for a message."""
    try:
        schema = open_shard(layout.shards / record.filename).schema
    except (ShardCorruptError, OSError) as exc:
        return f"schema {record.schema} (shard {record.filename} unreadable: {exc})"
    return "[" + ", ".join(f"{f.name}: {f.type}" for f in schema if f.name != KEY_COLUMN) + "]"
