"""EpochTurnover: the epochs on either side of the one being iterated.

In: how to build an epoch (a function of epoch, whether ahead, and a resume point), the builder's
checks of an epoch prepared ahead, the ranks that build theirs alongside (:class:`Peers`), the
leases, the verifier and how to record an epoch. Out: the
next epoch, prepared ahead on a background thread (:meth:`EpochTurnover.prepare_ahead`) and taken
at its start (:meth:`EpochTurnover.take`); the last one, retired (its batch source stopped, its
lease released) on a cleanup thread once the next one's first batch is out
(:meth:`EpochTurnover.first_batch_out`), so neither the build nor the retirement delays a batch;
or as soon as the next one must be waited for, so that its snapshot never waits on a daemon that
waits on the last one's lease (the shards it retired for room).

Invariants: at most one epoch is prepared ahead and one waits to be retired; an epoch prepared
ahead is handed out only if still usable and no shard may have been quarantined since its snapshot
(else it is finished and built again, on every rank of a torch.distributed job alike: a build's
agreements are collective calls, and a build on some ranks only would pair theirs with the other
ranks' next epoch's); every epoch built is finished (its lease released) exactly
once, by whoever drops it; once :meth:`EpochTurnover.close` returns, no thread of it runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from epochcache.cache.verifier import BackgroundVerifier
from epochcache.threads import DaemonThreadPool
from epochcache.train.distributed import Peers
from epochcache.train.epochs import EpochBuilder, EpochInfo, PreparedEpoch
from epochcache.train.leases import HeldLeases
from epochcache.train.resume import Progress

# (epoch, ahead, resume) -> the epoch built under the loader's config of the moment
Build = Callable[[int, bool, Progress | None], PreparedEpoch]
Record = Callable[[PreparedEpoch, EpochInfo], None]


class EpochTurnover:
    """The next epoch and the last one of a loader (see the module docstring). ``build`` makes an
    epoch, ``builder`` rechecks one prepared ahead, ``peers`` rebuild along, ``leases`` releases a finished one's lease,
    ``verifier`` (local rank 0 only) checksums an epoch's new shards after its first batch,
    ``record`` records a started epoch (on the cleanup thread), ``closed`` is set as the loader
    closes, ``queued``: the next epoch is queued on worker processes from the main thread
    (:meth:`start_if_built`) rather than starting itself."""

    def __init__(
        self, build: Build, builder: EpochBuilder, peers: Peers, leases: HeldLeases,
        verifier: BackgroundVerifier | None, record: Record, closed: threading.Event, queued: bool,
    ) -> None:
        self._build, self._builder, self._peers, self._leases, self._verifier = build, builder, peers, leases, verifier
        self._record, self._closed, self._queued = record, closed, queued
        # the next epoch, being prepared (read on every batch: see EpochCachedLoader.__iter__)
        self.next: tuple[int, Future[PreparedEpoch]] | None = None
        self.unstarted: Future[PreparedEpoch] | None = None  # the next epoch, until queued on the worker pool
        self._retiring: PreparedEpoch | None = None  # the last epoch, done but its batch source not yet stopped
        # DaemonThreadPools, whose threads keep their pool: a ThreadPoolExecutor collected with an
        # abandoned loader tells its thread to exit, and the epoch the collector finalizes next hands
        # that thread its record and waits for it, hanging the collection (and exit) for good.
        self._prepare_pool = DaemonThreadPool(1, "epochcache-prepare")
        self._cleanup_pool = DaemonThreadPool(1, "epochcache-cleanup")

    def take(self, epoch: int, resume: Progress | None) -> PreparedEpoch:
        """Epoch ``epoch``: the one prepared ahead if it is that one and still good to read (on every
        rank), else built now."""
        if resume is None and self.next is not None and self.next[0] == epoch:
            future = self.next[1]
            self.next = self.unstarted = None
            if not future.done():
                # Not ready: its snapshot may be waiting for shards that the daemon can publish only
                # once the last epoch's lease lets its retiring shards go. Nothing is handed out
                # meanwhile, so nothing is delayed by retiring that epoch now.
                self._retire_previous()
            prepared = future.result()
            # A shard quarantined since its snapshot (the verifier found it damaged; its mapping
            # may still be open here) must not be read by an epoch that starts now: build it again.
            stale = not prepared.usable or self._builder.quarantined_since(prepared)
        else:
            self.drop()
            self._retire_previous()  # (a build now waits as well: see above)
            prepared, stale = self._build(epoch, False, resume), False
        if not self._peers.any_rank(stale):
            return prepared
        self.finish(prepared)  # its worker pool was closed by an epoch left early, or a shard left (here or elsewhere)
        return self._build(epoch, False, resume)

    def drop(self) -> None:
        """Forget the epoch prepared ahead (a resume changes what comes next), finishing it if built."""
        if self.next is not None:
            _, future = self.next
            self.next = self.unstarted = None
            if not future.cancel() and future.exception() is None:
                self.finish(future.result())

    def prepare_ahead(self, epoch: int) -> None:
        """Start building epoch ``epoch`` on the background thread, unless one is already (or the loader closed)."""
        if self.next is None and not self._closed.is_set():
            self.next = (epoch, self._prepare_pool.submit(self._build, epoch, True, None))
            # (the cleanup thread's commits may land while it is prepared: check it again after them)
            self.next[1].add_done_callback(self._recheck_later)
            if self._queued:  # (a batch thread starts itself)
                self.unstarted = self.next[1]

    def start_if_built(self) -> None:
        """Queue the prepared next epoch on the worker pool, from this (the main) thread, once it is built."""
        unstarted = self.unstarted
        if unstarted is not None and unstarted.done():
            self.unstarted = None
            if unstarted.exception() is None:
                unstarted.result().start()

    def retire(self, done: PreparedEpoch) -> None:
        """``done`` has handed out its last batch: it is retired after the next epoch's first batch."""
        self._retire_previous()
        self._retiring = done

    def first_batch_out(self, current: PreparedEpoch, info: EpochInfo) -> Future[None]:
        """Once the trainer comes back from an epoch's first batch: one task for the cleanup thread (to
        retire the last epoch, then record this one). Not earlier: waking that thread as the first batch
        was handed out delayed it by ~0.2 ms (median of 37 epoch starts, the thread's wake-up alone)."""
        retiring, self._retiring = self._retiring, None
        return self._cleanup_pool.submit(self._after_first_batch, current, info, retiring)

    def finish(self, epoch: PreparedEpoch) -> None:
        """Stop ``epoch``'s batch source and release its lease."""
        epoch.close()
        self._leases.release(epoch.lease.id)

    def close(self) -> None:
        """Drop the epoch prepared ahead, retire the last one and stop both threads (the loader's
        ``closed`` is set first, so nothing is prepared ahead any more)."""
        self.drop()
        self._retire_previous()
        self._prepare_pool.shutdown(wait=True)
        self._cleanup_pool.shutdown(wait=True)

    def _after_first_batch(self, current: PreparedEpoch, info: EpochInfo, retiring: PreparedEpoch | None) -> None:
        """On the cleanup thread, once an epoch's first batch is out: queue its unverified shards for
        checksumming (never before the first batch, see :mod:`epochcache.cache.verifier`; queued here,
        not on the boundary, where it took 3-4 µs of the trainer's), stop the last epoch's batch source
        and release its lease, then record this epoch."""
        if self._verifier is not None:
            self._verifier.submit(current.unverified)
        if retiring is not None:
            self.finish(retiring)
        self._record(current, info)
        self._recheck()

    def _recheck_later(self, _: Future[PreparedEpoch]) -> None:
        """Once the next epoch is prepared: :meth:`_recheck` it on the cleanup thread, unless that
        pool takes no more work (the loader closed, or Python exiting: no epoch starts any more)."""
        try:
            self._cleanup_pool.submit(self._recheck)
        except RuntimeError:  # submit's refusal once shut down: there is nothing to recheck for
            return

    def _recheck(self) -> None:
        """On the cleanup thread, after this loader's own commits and once the next epoch is prepared
        (whichever comes last): :meth:`EpochBuilder.recheck` the prepared epoch."""
        pending = self.next
        future = pending[1] if pending is not None else None
        if future is None or not future.done() or future.cancelled() or future.exception() is not None:
            return
        self._builder.recheck(future.result())

    def _retire_previous(self) -> None:
        """Stop the finished epoch's batch source and release its lease, in the background."""
        if self._retiring is not None:
            self._cleanup_pool.submit(self.finish, self._retiring)
            self._retiring = None
