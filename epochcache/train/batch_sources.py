"""Where an epoch's batches are built: a batch thread in this process, or worker processes kept
across epochs.

In: an epoch's dataset and sampler. Out: its batch source (:meth:`BatchSources.for_epoch`): without
workers a :class:`~epochcache.train.prefetch.BatchThread` over the dataset's batch jobs (the
transforms, if any, and pinning run inside each job, on whichever thread builds it), with workers a
:class:`~epochcache.train.workers.PoolEpoch` on the loader's one
:class:`~epochcache.train.workers.WorkerPool` (a new pool when the dataset's tensor layout no longer
fits the old one's slots, or after one was closed by an epoch left early).

Invariant: at most one live worker pool per loader, forked from the main thread only
(:meth:`BatchSources.start_workers`; a pool made on the preparing thread forks when first started).
"""

from __future__ import annotations

import os
import threading

from epochcache.threads import DaemonThreadPool
from epochcache.train.dataset import ShardSetDataset
from epochcache.train.device import pin_batch
from epochcache.train.jobs import then
from epochcache.train.order import EpochBatches
from epochcache.train.prefetch import BatchThread
from epochcache.train.transform import BatchTransform, SampleTransform, TransformedDataset
from epochcache.train.workers import PoolEpoch, WorkerPool

# Worker processes chosen when a transform is given and loader.num_workers is left unset.
_AUTO_WORKERS = 2


def choose_workers(num_workers: int | None, transforms: bool) -> int:
    """``loader.num_workers`` if set; else worker processes when there are user ``transforms`` to run
    (:data:`_AUTO_WORKERS`, at most one per CPU), the batch thread (0) when there are none."""
    if num_workers is not None:
        return num_workers
    return min(_AUTO_WORKERS, os.cpu_count() or 1) if transforms else 0


class BatchSources:
    """Batch sources with ``workers`` processes (0: a batch thread), ``prefetch`` batches ahead each,
    of ``batch_size`` rows, through ``transform``/``sample_transform``; ``pin``: batches in pinned memory."""

    def __init__(self, workers: int, prefetch: int, batch_size: int, transform: BatchTransform | None,
                 sample_transform: SampleTransform | None, pin: bool):
        self.workers = workers
        self._prefetch, self._batch_size, self._pin = prefetch, batch_size, pin
        self._transform, self._sample_transform = transform, sample_transform
        # the batch threads of the current epoch and of the next one, prepared ahead (daemon threads:
        # one waiting for a consumer that is gone never holds up the exit, see epochcache.threads)
        self._build_pool = DaemonThreadPool(2, "epochcache-batches")
        # the worker processes, kept across epochs (made by the preparing thread, forked by the main one)
        self._pool: WorkerPool | None = None
        self._pool_lock = threading.Lock()

    def for_epoch(self, dataset: ShardSetDataset, sampler: EpochBatches) -> BatchThread | PoolEpoch | None:
        """The epoch's batches: a batch thread, or the loader's worker processes (kept across epochs,
        sending through a slot ring when the dataset has tensor columns, see epochcache.train.workers)."""
        if not len(sampler):
            return None
        if self.workers == 0:
            jobs = TransformedDataset(dataset, self._transform, self._sample_transform).jobs(sampler)
            if self._pin:
                jobs = then(jobs, pin_batch)
            if dataset.max_mapped_bytes is not None:
                jobs = then(jobs, dataset.trimmed)
            return BatchThread(jobs, self._prefetch, self._build_pool)
        layout = dataset.fixed_layout()
        with self._pool_lock:
            if self._pool is None or self._pool.closed or not self._pool.fit(layout):
                # (a pool replaced for another layout stops its workers once its last epoch is dropped)
                self._pool = self._new_pool()
                self._pool.fit(layout)
            return PoolEpoch(self._pool, dataset, sampler)

    def start_workers(self) -> None:
        """With workers, at an epoch's start (on the main thread, see WorkerPool.start): fork them now
        if no pool runs (the first epoch, or after an epoch left early), so that they start while this
        epoch waits for its shards and is built, not after (~0.1 s of the first batch)."""
        if self.workers and not (self._pool is not None and self._pool.running):  # (running: every later epoch)
            with self._pool_lock:
                if self._pool is None or self._pool.closed:
                    self._pool = self._new_pool()
                pool = self._pool
            pool.start()

    def close(self) -> None:
        """Wait for the batch threads (their epochs closed first) and stop the worker processes."""
        self._build_pool.shutdown(wait=True)
        if self._pool is not None:
            self._pool.close()

    def _new_pool(self) -> WorkerPool:
        return WorkerPool(self.workers, self._prefetch, self._batch_size, self._transform, self._sample_transform,
                          self._pin)
