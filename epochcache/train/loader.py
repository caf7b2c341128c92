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
across epochs: :mod:`epochcache.train.workers`), so the next epoch starts without a stall: its first
batches are built by then and, with workers, the first one already received in this process (the
pool takes it in as it hands out the current epoch's last batch).

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

This module is the epoch loop; its parts: :mod:`epochcache.train.epochs` builds an epoch (snapshot,
shards, dataset, order), :mod:`epochcache.train.turnover` prepares the next one ahead and retires the
last, :mod:`epochcache.train.batch_sources` makes its batch source (thread or worker pool),
:mod:`epochcache.train.leases` holds and renews the leases.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Generator, Iterator
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from epochcache.cache.coverage import coverage_of
from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import Ledger
from epochcache.cache.verifier import BackgroundVerifier
from epochcache.config import LoaderConfig, format_validation_error, load_config
from epochcache.errors import ConfigError, LedgerFullError, LoaderError
from epochcache.threads import interpreter_exiting
from epochcache.train.batch_sources import BatchSources, choose_workers
from epochcache.train.commits import CommitMarks
from epochcache.train.device import pinning_available, to_device
from epochcache.train.distributed import Peers
from epochcache.train.epochs import EpochBuilder, EpochInfo, PreparedEpoch
from epochcache.train.leases import HeldLeases
from epochcache.train.malloc import keep_large_allocations
from epochcache.train.mappings import ShardMaps
from epochcache.train.resume import Progress, read_state
from epochcache.train.timing import PrepareClock
from epochcache.train.transform import BatchTransform, SampleTransform
from epochcache.train.turnover import EpochTurnover
from epochcache.train.waiting import wait_for_samples

log = logging.getLogger(__name__)


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
        # shard mappings the batch thread reuses from epoch to epoch, at most max_open_shards of them
        # (made first: a bound this platform cannot keep is a ConfigError before anything is opened)
        self._maps: ShardMaps[Any] = ShardMaps(self.config.max_open_shards, self.config.max_mapped_bytes)
        self._layout = CacheLayout(Path(cache_dir).resolve())
        if not self._layout.shards.is_dir():  # only the daemon creates a cache: a typo must not make one
            raise LoaderError(
                f"no cache at {str(cache_dir)!r} ({self._layout.shards} does not exist): check cache.dir, "
                "or start `epochcache sync` with it first (the daemon creates the cache)"
            )
        self._ledger = Ledger(self._layout.ledger)
        self._commits = CommitMarks(self._ledger.path)  # (the ledger's connection, just opened, made its WAL index)
        self._peers = Peers.discover(self._layout.root, self._ledger)
        self._owner = f"{socket.gethostname()}:{os.getpid()}"
        if self.config.fixed_malloc_thresholds:
            keep_large_allocations()
        pin = self.config.pin_memory and pinning_available()
        workers = choose_workers(self.config.num_workers, transform is not None or sample_transform is not None)
        self._sources = BatchSources(workers, self.config.prefetch_batches, self.config.batch_size,
                                     transform, sample_transform, pin)
        self._device = torch.device(self.config.device) if self.config.device else None
        self._progress_bar = progress and self._peers.rank == 0
        self._waited = self.config.min_samples == 0
        self._epoch = 0
        self._last: EpochInfo | None = None
        self._progress: Progress | None = None
        self._resume: Progress | None = None
        # one checksumming thread per host (local rank 0), started on each epoch's first batch
        self._verifier = BackgroundVerifier(self._layout) if self._peers.local_rank == 0 else None
        self._closed = threading.Event()
        # the epochs being iterated (epoch -> its prepared epoch and batches), for close() to end them:
        # kept by the epoch itself, a dict entry costs its start nothing (a weak reference to each
        # iterator, taken in __iter__, cost ~5 µs of the epoch gap, measured)
        self._iterated: dict[int, tuple[PreparedEpoch, Generator[Any, None, None]]] = {}
        ahead = self.config.prefetch_batches * max(self._sources.workers, 1)
        self._clock = PrepareClock(ahead, self.config.prepare_next_at)
        self._leases = HeldLeases(self._ledger, self.config.lease_ttl_s)
        self._builder = EpochBuilder(self._layout, self._ledger, self._peers, self._leases, self._maps, self._owner,
                                     self._closed, self._clock, self._commits)
        self._turnover = EpochTurnover(self._prepare, self._builder, self._peers, self._leases, self._verifier,
                                       self._record, self._closed, queued=bool(self._sources.workers))

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
        return self._sources.workers

    @property
    def last_epoch(self) -> EpochInfo | None:
        """Facts about the epoch most recently started."""
        return self._last

    def __iter__(self) -> Iterator[Any]:
        if self._closed.is_set():
            raise LoaderError("this EpochCachedLoader is closed (its leases are released and its ledger connection "
                              "closed): make a new one to train on")
        started = time.monotonic()
        self._sources.start_workers()
        self._wait_for_samples()
        epoch = self._epoch
        self._epoch += 1
        resume, self._resume = self._resume, None
        turnover = self._turnover
        current = turnover.take(epoch, resume)
        info = self._last = current.info
        self._progress = Progress(epoch, info.start_batch, info.batches, current.shards)
        self._clock.begin(info.batches)
        batches, completed = current.batches(), False
        recorded: Future[None] | None = None
        stream = self._on_device(batches)
        self._iterated[epoch] = (current, stream)  # for close(), should it come first
        try:
            for number, batch in enumerate(stream, start=info.start_batch):
                self._progress.position = number + 1
                if number == info.start_batch:
                    self._last = first = current.first_batch_out(time.monotonic() - started)
                    try:
                        yield batch
                    finally:  # (also when the first batch is the last one taken; not once closed)
                        if epoch in self._iterated and not interpreter_exiting():
                            recorded = turnover.first_batch_out(current, first)
                else:
                    yield batch
                if turnover.next is None and self._clock.due(number):
                    turnover.prepare_ahead(epoch + 1)
                if turnover.unstarted is not None:
                    turnover.start_if_built()
            self._progress = None
            turnover.prepare_ahead(epoch + 1)
            completed = True
        finally:
            # Not when close() ended the epoch already (its batches closed, its lease released), nor when
            # collected as Python finalizes (the loader left open): the batch threads are stopped for
            # good, so nothing is waited for, and the lease lapses (see epochcache.threads).
            if self._iterated.pop(epoch, None) is not None and not interpreter_exiting():
                stream.close()
                batches.close()
                if recorded is not None:  # done long since: last_epoch then has its coverage, the lease its record
                    recorded.result()
                if completed:
                    # Off the path to the next epoch's first batch: stopping the batch thread and
                    # releasing the lease (a ledger write) wait until the trainer is back from that batch.
                    turnover.retire(current)
                else:
                    turnover.finish(current)

    def _record(self, current: PreparedEpoch, info: EpochInfo) -> None:
        """Record the running epoch in the ledger (local rank 0, for its node: the samples its batches
        hand out, a resumed epoch's skipped batches left out), then give ``last_epoch`` (``info``)
        the cache's coverage and echo, this epoch included. Runs on the cleanup thread after the
        first batch: the first epoch on a large cache adds the units of every shard to the record."""
        if self._peers.local_rank == 0:
            per_batch = self.config.batch_size * self._peers.local_world
            samples = min(self.config.epoch_samples or info.samples, (info.batches - info.start_batch) * per_batch)
            try:
                self._ledger.leases.record_epoch(current.lease.id, max(0, samples))
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
        self._turnover.drop()
        self._epoch, self._progress = resume.epoch, None
        self._resume = resume if resume.shards else None

    def close(self) -> None:
        """Release every lease, drop a prepared epoch and stop the background threads."""
        if self._closed.is_set():
            return
        for current, stream in self._iterated.values():  # an epoch still iterated: its batches end here
            stream.close()
            self._turnover.finish(current)
        self._iterated.clear()
        self._closed.set()
        self._turnover.close()
        self._sources.close()
        self._maps.clear()  # (unmapped now, not when the loader is collected: see ShardMaps)
        self._leases.close()
        if self._verifier is not None:
            self._verifier.close()
        self._commits.close()  # (before the ledger's connection: see CommitMarks' invariant)
        self._ledger.close()

    def __enter__(self) -> EpochCachedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- building epochs ------------------------------------------------------------------------

    def _wait_for_samples(self) -> None:
        if not self._waited:
            wait_for_samples(
                self._layout, self._ledger, self.config.min_samples, self.config.wait_timeout_s,
                self._closed, self._progress_bar,
            )
            self._waited = True

    def _on_device(self, batches: Generator[Any, None, None]) -> Generator[Any, None, None]:
        return batches if self._device is None else to_device(batches, self._device)

    def _prepare(self, epoch: int, ahead: bool, resume: Progress | None) -> PreparedEpoch:
        return self._builder.build(epoch, ahead, resume, self.config, self._sources.for_epoch)

