"""EpochCachedLoader: one torch DataLoader per epoch over the shards present when it starts.

Each ``iter(loader)`` is one epoch. Its shard set is a ledger snapshot taken together with a lease on
exactly those shards, so the daemon cannot evict them mid-epoch; a heartbeat thread renews the lease
and it is released when the epoch ends (a killed trainer's lease simply expires). When
``loader.prepare_next_at`` of an epoch's batches are consumed, a background thread snapshots the next
epoch and builds its dataset and DataLoader; its workers are started (or, without workers, its first
batch built) before the current epoch ends, so the next epoch starts without a stall and sees the
shards published until then.

Batches are dicts of column name -> tensor (see :class:`ShardSetDataset`); shuffling is seeded by
``(loader.seed, epoch)``.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from pydantic import ValidationError
from torch.utils.data import DataLoader

from epochcache.config import LoaderConfig, format_validation_error, load_config
from epochcache.dataset import Batch, ShardSetDataset
from epochcache.errors import CacheEmptyError, ConfigError, ShardCorruptError
from epochcache.layout import CacheLayout
from epochcache.ledger import Lease, Ledger, ShardRecord
from epochcache.seeding import permutation
from epochcache.shards import verify_shard

log = logging.getLogger(__name__)

_EMPTY_POLL_S = 0.1


@dataclass(frozen=True)
class EpochInfo:
    """What an epoch was built from; ``first_batch_wait_s`` is the time from ``iter()`` to its first
    batch, None until that batch exists."""

    epoch: int
    shards: int
    samples: int
    bytes: int
    batches: int
    skipped_shards: int
    prepared_ahead: bool = False
    first_batch_wait_s: float | None = None


class EpochBatches:
    """Batch sampler of one epoch: index arrays of ``batch_size``, order fixed by (seed, epoch)."""

    def __init__(self, n: int, batch_size: int, shuffle: bool, drop_last: bool, seed: int, epoch: int):
        self._n, self._batch_size, self._drop_last = n, batch_size, drop_last
        self._shuffle, self._seed, self._epoch = shuffle, seed, epoch

    def __len__(self) -> int:
        return self._n // self._batch_size if self._drop_last else math.ceil(self._n / self._batch_size)

    def __iter__(self) -> Iterator[np.ndarray]:
        order = permutation(self._n, self._seed, self._epoch) if self._shuffle else np.arange(self._n)
        for start in range(0, len(self) * self._batch_size, self._batch_size):
            yield order[start : start + self._batch_size]


class _Epoch:
    """A built epoch: its lease and DataLoader; ``start`` creates the iterator.

    Worker processes must be forked from the main thread: under torch 2.x, workers forked from a
    background thread exit with code 1 at shutdown, which the DataLoader reports as a crash. So the
    preparing thread does everything up to the DataLoader object, and the main thread calls ``start``
    (at a batch boundary once the preparation is done); the workers then prefetch on their own. With
    no workers the preparing thread starts the epoch itself and builds the first batch.
    """

    def __init__(self, info: EpochInfo, lease: Lease, loader: DataLoader[Batch] | None):
        self.info, self.lease, self._loader = info, lease, loader
        self._iterator: Iterator[Batch] | None = None
        self._first: list[Batch] = []
        if loader is not None and loader.num_workers == 0:
            self.start()

    def start(self) -> None:
        if self._iterator is not None or self._loader is None:
            return
        self._iterator = iter(self._loader)
        if self._loader.num_workers == 0:
            self._first = [batch for batch in [next(self._iterator, None)] if batch is not None]

    def batches(self) -> Iterator[Batch]:
        self.start()
        yield from self._first
        self._first = []
        if self._iterator is not None:
            yield from self._iterator

    def close(self) -> None:
        self._iterator = None  # drops the DataLoader iterator, which shuts its workers down
        self._loader = None
        self._first = []


def _pass_through(batch: Batch) -> Batch:
    """collate_fn: ``ShardSetDataset.__getitems__`` already returns a collated batch."""
    return batch


class EpochCachedLoader:
    """Iterate it once per epoch; see the module docstring.

    ``cache_dir``: the daemon's ``cache.dir``. ``config``: a :class:`LoaderConfig`; keyword
    ``overrides`` replace its fields (``batch_size=128``). Use as a context manager, or call
    :meth:`close`, to release leases and stop threads.
    """

    def __init__(self, cache_dir: str | os.PathLike[str], config: LoaderConfig | None = None, **overrides: Any):
        try:
            self.config = LoaderConfig.model_validate({**(config or LoaderConfig()).model_dump(), **overrides})
        except ValidationError as exc:
            raise ConfigError(f"EpochCachedLoader: {format_validation_error(exc)}") from None
        self._layout = CacheLayout.create(cache_dir)
        self._ledger = Ledger(self._layout.ledger)
        self._owner = f"{socket.gethostname()}:{os.getpid()}"
        self._epoch = 0
        self._last: EpochInfo | None = None
        self._next: tuple[int, Future[_Epoch]] | None = None
        self._verified: set[str] = set()
        self._held: set[str] = set()
        self._held_lock = threading.Lock()
        self._closed = threading.Event()
        self._prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="epochcache-prepare")
        self._heartbeat = threading.Thread(target=self._renew_leases, name="epochcache-lease", daemon=True)
        self._heartbeat.start()

    @classmethod
    def from_config(cls, path: str | os.PathLike[str], overrides: Any = ()) -> EpochCachedLoader:
        """Build from a config.yaml (``cache.dir`` and the ``loader`` section)."""
        config = load_config(path, overrides)
        return cls(config.cache.dir, config.loader)

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` will run."""
        return self._epoch

    @property
    def last_epoch(self) -> EpochInfo | None:
        """Facts about the epoch most recently started."""
        return self._last

    def __iter__(self) -> Iterator[Batch]:
        started = time.monotonic()
        epoch = self._epoch
        self._epoch += 1
        current = self._take_prepared(epoch)
        self._last = current.info
        n = current.info.batches
        trigger = min(max(n - 1, 0), int(n * self.config.prepare_next_at))
        try:
            for i, batch in enumerate(current.batches()):
                if i == 0:
                    self._last = replace(current.info, first_batch_wait_s=time.monotonic() - started)
                if i == trigger:
                    self._prepare_ahead(epoch + 1)
                if i >= trigger:
                    self._start_prepared()
                yield batch
            self._prepare_ahead(epoch + 1)
        finally:
            self._finish(current)

    def close(self) -> None:
        """Release every lease, drop a prepared epoch and stop the background threads."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._next is not None:
            _, future = self._next
            self._next = None
            if not future.cancel() and future.exception() is None:
                self._finish(future.result())
        self._prepare_pool.shutdown(wait=True)
        self._heartbeat.join()
        with self._held_lock:
            for lease_id in self._held:
                self._ledger.release(lease_id)
            self._held.clear()
        self._ledger.close()

    def __enter__(self) -> EpochCachedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- building epochs ------------------------------------------------------------------------

    def _take_prepared(self, epoch: int) -> _Epoch:
        if self._next is not None and self._next[0] == epoch:
            future = self._next[1]
            self._next = None
            return future.result()
        return self._prepare(epoch, ahead=False)

    def _start_prepared(self) -> None:
        """Start the prepared next epoch's workers, from this (the main) thread, once it is built."""
        if self._next is not None and self._next[1].done() and self._next[1].exception() is None:
            self._next[1].result().start()

    def _prepare_ahead(self, epoch: int) -> None:
        if self._next is None and not self._closed.is_set():
            self._next = (epoch, self._prepare_pool.submit(self._prepare, epoch, True))

    def _prepare(self, epoch: int, ahead: bool) -> _Epoch:
        lease = self._snapshot(epoch)
        try:
            usable = [r for r in lease.shards if self._verify(r)]
            dataset = ShardSetDataset(
                [self._layout.shards / r.filename for r in usable], [r.rows for r in usable], self.config.columns
            )
            cfg = self.config
            batches = EpochBatches(len(dataset), cfg.batch_size, cfg.shuffle, cfg.drop_last, cfg.seed, epoch)
            info = EpochInfo(
                epoch=epoch, shards=len(usable), samples=len(dataset), bytes=sum(r.nbytes for r in usable),
                batches=len(batches), skipped_shards=len(lease.shards) - len(usable), prepared_ahead=ahead,
            )
            loader = None
            if len(batches):
                loader = DataLoader(
                    dataset, batch_sampler=batches, num_workers=cfg.num_workers, collate_fn=_pass_through
                )
            return _Epoch(info, lease, loader)
        except BaseException:
            self._release(lease.id)
            raise

    def _snapshot(self, epoch: int) -> Lease:
        """A lease on a non-empty shard set, waiting up to ``wait_timeout_s`` for the first shard."""
        deadline = time.monotonic() + self.config.wait_timeout_s
        while True:
            lease = self._ledger.snapshot(f"{self._owner}:epoch{epoch}", self.config.lease_ttl_s)
            with self._held_lock:
                self._held.add(lease.id)
            if lease.shards:
                return lease
            self._release(lease.id)
            if time.monotonic() >= deadline or self._closed.wait(_EMPTY_POLL_S):
                raise CacheEmptyError(
                    f"no shard appeared in {self._layout.root} within {self.config.wait_timeout_s:g}s: "
                    "is `epochcache sync` running on this cache dir? (loader.wait_timeout_s sets the wait)"
                )

    def _verify(self, record: ShardRecord) -> bool:
        """Check a shard's checksum the first time this loader uses it; False (and a warning) if bad."""
        if record.id in self._verified:
            return True
        try:
            verify_shard(self._layout.shards / record.filename, record.checksum)
        except (ShardCorruptError, FileNotFoundError) as exc:
            from epochcache.quarantine import quarantine_shard  # issue 4: one function quarantines for all
            quarantine_shard(self._layout, self._ledger, record, f"skipped by an epoch: {exc}")
            return False
        self._verified.add(record.id)
        return True

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

