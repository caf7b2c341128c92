"""WorkerPool: DataLoader worker processes kept from epoch to epoch, fed one epoch after another.

In: per epoch, its :class:`ShardSetDataset` and batch sampler (:meth:`WorkerPool.queue`); out: per
epoch, exactly its batches, in order (:meth:`WorkerPool.batches`), as the training process's own
tensors (through the shared-memory slots of :mod:`epochcache.train.slots`, or the pipe).

One DataLoader with persistent workers reads a :class:`_Feed`: a batch sampler whose items, ``(epoch
tag, serial, indices)``, are queued epoch after epoch. The next epoch is queued while the current
one's last batches are still being read, so the DataLoader's one iteration runs on across the
boundary: the workers start on the next epoch as soon as they are free, with no fork and no new
iterator (forking 2 workers took 27-68 ms of the main thread at every epoch start). An epoch's
dataset reaches each worker through that worker's own queue (a pipe made before the fork, fed by a
thread so a large dataset never blocks the trainer), where a thread of the worker opens it ahead of
its first item; the worker drops an epoch's dataset (unmapping its shards) at the next epoch's first item.
Only paths travel; the user's transforms reached the workers once, through the fork.

At the boundary itself the trainer receives nothing: the next epoch's first batch, when it is queued
in time, is received (copied out of its slot, pinned when pinning) before the current epoch's last
batch is handed out, and waits in the pool (:meth:`WorkerPool.batches`). A trace of the boundary
(benchmarks/loader.py's cache, 2 workers) had that receive at 110-250 µs of a 0.3-0.5 ms gap: the
DataLoader's ``next`` and the copy out of the slot, both slower there than mid-epoch (50 + 30 µs).

The workers may fork before any epoch exists (:meth:`WorkerPool.start`: the loader starts them while
it waits for the first shard), so the pool learns its slots' layout later, makes the slot ring then
in shared memory the workers inherited (made with the pool), and sends it to them on their dataset
queues, for the batches not yet handed to the DataLoader. Without a transform the layout is the
dataset's fixed-width columns, known with the first epoch (:meth:`WorkerPool.fit`). With one, the
batches are what the transform makes of them, so the layout is learned from the first batch
received (through the pipe, as every batch is until the ring reaches the workers, a few batches
into the first epoch): its tensors' dtypes and item shapes. A transform that turns binary rows into
an image tensor otherwise sent every image through the pipe, pickled: 55,000 samples/s with 2
workers against 220,000 through the slots (64 x 12 KB per batch, benchmarks/peers.py's "bytes" layout).

Invariant: every item queued is read back, in order, before the pool is used again (``serial`` is the
slot number, which the slot ring needs in order, and the items of an epoch left unread would be
handed out as the next epoch's batches); a batch received ahead belongs to the next epoch read, and
is dropped with the pool if that epoch is (a shard quarantined meanwhile, see the loader). So an
epoch left early, or queued and dropped, closes the pool (``WorkerPool.closed``), and the loader
makes a new one for the next epoch.
"""

from __future__ import annotations

import functools
import itertools
import multiprocessing
import os
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any, cast

import numpy as np
from torch.utils.data import DataLoader, Dataset, get_worker_info
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from epochcache.sync.memory import frozen_objects
from epochcache.train.dataset import ShardSetDataset
from epochcache.train.device import pin_batch
from epochcache.train.held import Views
from epochcache.train.malloc import keep_large_allocations
from epochcache.train.mappings import ShardMaps
from epochcache.train.order import EpochBatches
from epochcache.train.orphans import end_with_parent
from epochcache.train.slots import Layout, SlotRing, free_shared_memory, layout_of, shared_memory
from epochcache.train.transform import BatchTransform, SampleTransform, TransformedDataset
from epochcache.train.wire import from_wire, to_wire

Item = tuple[int, int, np.ndarray]  # (epoch tag, serial number of the batch in the pool, indices)


class _Feed:
    """The DataLoader's batch sampler: the items queued, in order. It runs dry (StopIteration) while
    nothing is queued and hands out items again once more are: the DataLoader asks again at each batch."""

    def __init__(self) -> None:
        self._epochs: deque[Iterator[Item]] = deque()
        self.handed = 0  # items given to the DataLoader so far

    def extend(self, items: Iterator[Item]) -> None:
        self._epochs.append(items)

    def __iter__(self) -> _Feed:
        return self

    def __next__(self) -> Item:
        while self._epochs:
            item = next(self._epochs[0], None)
            if item is not None:
                self.handed += 1
                return item
            self._epochs.popleft()
        raise StopIteration


class _WorkerData(Dataset[Any]):
    """In a worker: the batch of an item, from the dataset of its epoch (see the module docstring),
    as a :class:`~epochcache.train.slots.SlotBatch` when it fits its slot, else the batch itself.

    A thread of the worker receives each epoch's dataset as soon as it is queued and opens it (maps
    its shards, through this worker's mappings kept across epochs), while the worker still builds the
    last epoch's batches: the next epoch's first batch then costs no more than any other."""

    def __init__(self, datasets: list[Any], transform: BatchTransform | None, sample_transform: SampleTransform | None):
        self._datasets = datasets
        self._ring: SlotRing | None = None  # arrives once the pool knows its layout (none if no tensor columns)
        self._transform, self._sample_transform = transform, sample_transform
        self._loaded: dict[int, TransformedDataset] = {}  # by epoch tag: the current and the next
        self._ready = threading.Condition()
        self._receiver: threading.Thread | None = None

    def __len__(self) -> int:
        raise TypeError("a worker pool's dataset changes per epoch: it has no length")

    def __getitem__(self, index: int) -> Any:
        raise TypeError("a worker pool's dataset is read by batch: give it (tag, serial, indices) to __getitems__")

    def __getitems__(self, item: Item) -> Any:
        tag, serial, indices = item
        data = self._epoch(tag)  # (a ring sent before its dataset has arrived by then)
        if self._ring is None:
            return data.__getitems__(indices)
        slot = self._ring.claim(serial) if data.plain else None
        if slot is not None:  # straight from the shards into the slot: one copy, without the GIL
            rows, others = data.dataset.gather_into(indices, slot)
            return self._ring.sent(serial, rows, others)
        batch = data.__getitems__(indices)
        return self._ring.send(serial, batch) or batch

    def _epoch(self, tag: int) -> TransformedDataset:
        """Epoch ``tag``'s dataset, once received; the earlier epochs' are dropped (their shards unmapped)."""
        if self._receiver is None:
            info = get_worker_info()
            if info is None:
                raise RuntimeError("_WorkerData is read in DataLoader workers only")
            self._receiver = threading.Thread(
                target=self._receive, args=(self._datasets[info.id],), name="epochcache-datasets", daemon=True
            )
            self._receiver.start()
        with self._ready:
            self._ready.wait_for(lambda: tag in self._loaded)
            for old in [t for t in self._loaded if t < tag]:
                del self._loaded[old]
            return self._loaded[tag]

    def _receive(self, datasets: Any) -> None:
        """The receiving thread: what is queued for this worker, in order: the slot ring (once), and
        each epoch's dataset, opened, then made available."""
        maps: ShardMaps[Views] | None = None
        while True:
            tag, received = datasets.get()
            if isinstance(received, SlotRing):
                self._ring = received
                continue
            if maps is None:
                maps = ShardMaps(received.max_open_shards, received.max_mapped_bytes)
            received.use_maps(maps)
            received.open()
            with self._ready:
                self._loaded[tag] = TransformedDataset(received, self._transform, self._sample_transform)
                self._ready.notify_all()


class _Failed:
    """A batch received ahead whose building failed: ``exc``, to raise where it is handed out."""

    def __init__(self, exc: Exception):
        self.exc = exc


class WorkerPool:
    """``workers`` processes building batches of ``batch_size`` rows, ``prefetch`` batches each ahead,
    for epochs of one layout (fixed-width columns, name -> dtype, item shape: the slots' columns), the
    first one's (:meth:`fit`); batches are pinned as they are received when ``pin``."""

    def __init__(self, workers: int, prefetch: int, batch_size: int,
                 transform: BatchTransform | None, sample_transform: SampleTransform | None, pin: bool = False):
        fork = multiprocessing.get_context("fork")
        self._datasets = [fork.Queue() for _ in range(workers)]
        self._batch_size = batch_size
        # The DataLoader asks for at most prefetch batches per worker ahead of the batch being handed
        # out; two slots more leave room for the batch being copied out and a worker running ahead.
        self._slots = prefetch * workers + 2
        self._memory = shared_memory()  # the ring's, sized later; made now so the workers inherit it
        # closed by close() (which frees it first), or when a pool replaced for another layout is collected
        self._release_memory = weakref.finalize(self, os.close, self._memory)
        self.layout: dict[str, Any] | None = None
        self._ring: SlotRing | None = None
        self._feed = _Feed()
        self._loader = DataLoader(
            # the queues reach the workers through fork (they cannot be pickled)
            _WorkerData(self._datasets, transform, sample_transform),  # type: ignore[arg-type]
            batch_sampler=self._feed, num_workers=workers, collate_fn=to_wire,  # type: ignore[arg-type]
            prefetch_factor=prefetch, persistent_workers=True, multiprocessing_context="fork",
            worker_init_fn=functools.partial(_start_worker, os.getpid()),
        )
        self._iterator: _MultiProcessingDataLoaderIter | None = None
        self._transformed = transform is not None or sample_transform is not None
        self._frozen = ExitStack()  # the heap, frozen from the workers' fork to close()
        self._tags = itertools.count()
        self._queued = 0  # items queued, which are the serial numbers so far
        self._taken = 0  # batches read back
        self._pin = pin
        # the first batch of the epoch queued next, received as the last one of an epoch is handed out
        self._held: deque[Any] = deque()
        self.closed = False

    def fit(self, layout: Layout) -> bool:
        """Whether the pool takes epochs of ``layout`` (a dataset's fixed-width columns): the first
        layout given is the pool's, any other is refused. Without a transform its slot ring is made
        for it now (none for an empty one); with one, from the first batch received (:meth:`_learn`)."""
        if self.layout is None:
            self.layout = dict(layout)
            if layout and not self._transformed:
                self._make_ring(layout, self._batch_size)
        return self.layout == dict(layout)

    def _make_ring(self, layout: Layout, rows: int) -> None:
        """The slot ring for batches of ``layout`` of up to ``rows`` rows, sent to the workers now
        (pickled by each queue's thread: its layout and the memory's descriptor, which they
        inherited). Its first batch is the next one handed to the DataLoader: a worker sends those
        before it through the pipe, even once the ring reached it, and so does one that builds a
        later batch before the ring arrives."""
        self._ring = SlotRing(layout, rows, self._slots, self._feed.handed, fd=self._memory)
        for datasets in self._datasets:
            datasets.put((None, self._ring))

    def _learn(self, batch: Any) -> None:
        """Make the slot ring for batches like ``batch``, the first one received of a transformed
        epoch (:func:`~epochcache.train.slots.layout_of`), if it has tensor columns: with room for
        ``batch_size`` rows, or for as many as it has (a transform may make more rows than it got)."""
        layout = layout_of(batch)
        if layout:
            self._make_ring(layout, max(self._batch_size, len(batch[next(iter(layout))])))

    def start(self) -> None:
        """Fork the workers now, if not yet (they wait for the first epoch queued)."""
        self._running()

    @property
    def running(self) -> bool:
        """Whether the workers were forked and the pool is not closed."""
        return self._iterator is not None and not self.closed

    def _running(self) -> Iterator[Any]:
        """The DataLoader's iteration, begun (the workers forked) if it was not. From the main thread
        only (forked from another thread, the workers exit with code 1 at shutdown under torch 2.x)."""
        if self._iterator is None:
            # The objects alive now are shared with the workers, page by page, until written. A full
            # collection writes to every object it visits (in any of the processes), so pages were
            # copied, epoch after epoch; frozen objects are never visited. Frozen only while the
            # workers run: the garbage among them (cycles only a collection frees) is kept until
            # close(), not for the process's life, once more at each pool started.
            self._frozen.enter_context(frozen_objects())
            self._iterator = self._iterate()
        return self._iterator

    def _iterate(self) -> _MultiProcessingDataLoaderIter:
        """A new iteration of the DataLoader (the first forks the workers; the next ones keep them)."""
        return cast(_MultiProcessingDataLoaderIter, iter(self._loader))

    def queue(self, dataset: ShardSetDataset, sampler: EpochBatches) -> None:
        """Queue an epoch: ``sampler``'s batches of ``dataset``, after every epoch queued before.
        The pool must :meth:`fit` the dataset's layout."""
        tag, first = next(self._tags), self._queued
        for datasets in self._datasets:
            datasets.put((tag, dataset))  # pickled by the queue's thread: only paths (see ShardSetDataset)
        self._queued += len(sampler)
        self._feed.extend((tag, first + k, indices) for k, indices in enumerate(sampler))

    def batches(self, count: int) -> Iterator[Any]:
        """The next ``count`` batches queued. Call from the main thread: the first call forks the workers.

        The last of them is handed out only once the next batch queued, if any (the next epoch's
        first), has been received too: that batch then waits in this process, copied out of its slot
        (and pinned), and the next call hands it out at once. The epoch boundary, between the two,
        is left the loader's bookkeeping alone (see :mod:`epochcache.train.loader`). An error in
        building that batch (a worker's, re-raised by the DataLoader) waits with it: it is raised
        where that batch would have been handed out, not in place of the last one."""
        for left in range(count - 1, -1, -1):
            batch = self._held.popleft() if self._held else self._receive()
            if isinstance(batch, _Failed):
                raise batch.exc
            if not left and self._taken < self._queued:
                try:
                    self._held.append(self._receive())
                except Exception as exc:  # noqa: BLE001 - not swallowed: raised at the batch it belongs to
                    self._held.append(_Failed(exc))
            yield batch

    def _receive(self) -> Any:
        """The next batch queued, as this process's own tensors: its slot is free again."""
        if self._iterator is not None and self._feed.handed == self._taken:
            # Nothing in flight: the DataLoader's iteration has ended (or the workers started
            # before anything was queued); a new one (the workers kept) takes the items queued since.
            self._iterator = self._iterate()
        message = next(self._running())
        number, self._taken = self._taken, self._taken + 1
        if self._ring is not None:
            batch = self._ring.receive(message, number, self._pin)
        else:
            batch = from_wire(message)
            if self._transformed:
                self._learn(batch)
        return pin_batch(batch) if self._pin else batch

    def close(self) -> None:
        """Stop the workers; batches not yet read are dropped."""
        self.closed = True
        self._held.clear()
        iterator, self._iterator = self._iterator, None
        if iterator is not None:
            # Stopped now, not when the iterator is collected: a worker's error raised from it keeps
            # it alive (its frame, in the traceback the caller may hold), workers and all.
            iterator._shutdown_workers()
        self._frozen.close()  # (the workers are gone: no page of the heap is shared any more)
        self._loader = None  # type: ignore[assignment]
        for datasets in self._datasets:
            datasets.cancel_join_thread()  # a worker gone may leave a dataset unread: never wait on it
            datasets.close()
        if self._release_memory.alive:  # (once: the descriptor's number may be another file's after)
            # Its workers are stopped: no process reads or writes the ring again. (Collected instead, at
            # exit say, a pool's workers may still be writing: its memory is only closed then.)
            free_shared_memory(self._memory)
            self._release_memory.detach()


class PoolEpoch:
    """One epoch's batches from ``pool``: queued by :meth:`start` (once, from any thread), read by
    :meth:`batches` (the main thread)."""

    def __init__(self, pool: WorkerPool, dataset: ShardSetDataset, sampler: EpochBatches):
        self.pool, self._dataset, self._sampler = pool, dataset, sampler
        self._started = False
        self._left = len(sampler)

    def start(self) -> None:
        if not self._started:
            self._started = True
            self.pool.queue(self._dataset, self._sampler)

    def batches(self) -> Iterator[Any]:
        self.start()
        for batch in self.pool.batches(self._left):
            self._left -= 1
            yield batch

    def close(self) -> None:
        """Close the pool if this epoch was queued and not read to its end (see the module docstring)."""
        if self._started and self._left:
            self.pool.close()


def _start_worker(trainer: int, _worker_id: int) -> None:
    """In each worker as it starts: it ends with ``trainer``, the process that forked it
    (:func:`epochcache.train.orphans.end_with_parent`), and keeps its large allocations
    (:func:`epochcache.train.malloc.keep_large_allocations`).

    A worker allocates a few batch-sized buffers per batch (the transform's output, the pickled message
    of what misses the slots). Workers forked from a trainer that had already freed large buffers
    inherit glibc's raised thresholds, workers forked early (see WorkerPool.start) do not: measured
    171k page faults per worker against 5k, and twice the CPU per sample (benchmarks/peers.py, 2
    workers, bytes + transform). Fixed thresholds make every worker reuse its heap, whenever it forked."""
    end_with_parent(trainer)
    keep_large_allocations()
