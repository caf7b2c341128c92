"""In-process batches built ahead on a background thread, and by the consumer when it is waiting.

In: an epoch's batch jobs (:mod:`epochcache.train.jobs`: planned on the background thread, built
on any) and a thread pool; out: the batches, in the jobs' order, at most ``depth`` planned beyond the
one the consumer holds. An exception in planning or building a batch is raised in the consumer, at
that batch.

The batch thread plans each job as a place frees up (``depth + 1`` places, the held batch's
included; the consumer gives its place back when it comes for the next batch) and builds the oldest
planned job nobody has claimed. The consumer, coming for batch k: takes it if built; builds it
itself, inline, if nobody has claimed it (no hand-off, no wake-up); if the thread is building it,
builds the next unclaimed job meanwhile, then takes batch k. The copy releases the GIL
(:mod:`epochcache.train.rowspace`), so a consumer faster than the thread gathers every other batch
on its own core; a trainer slower than the thread (a GPU step) finds each batch built and builds
none. (A thread alone, handing over every batch, ran one batch at a time: the consumer woke to take
a batch while the thread held the GIL in the next gather, and they alternated in bursts.)

Invariants: a job is claimed once (a lock taken without blocking), so each batch is built once;
the planning (the iterator of jobs, which maps and drops shards) runs on the batch thread alone; at
a :data:`~epochcache.train.jobs.FENCE` the thread plans nothing more until every job before it is
built, by whichever thread claimed it; :meth:`BatchThread.close` returns once the thread has
stopped, and the thread builds nothing after it (nor does the consumer, which calls it), so the
shards can then be unmapped.

The hand-offs block in C, without the GIL (``queue.SimpleQueue`` and raw locks): a ``queue.Queue``
or ``threading.Condition`` cost a few microseconds of Python per batch on both threads, which with
~60 µs batches was most of what the loader added to the gather. The place is given back when the
consumer comes back, not as it takes a batch: that wakes the thread, and a thread woken as an
epoch's first batch was handed out delayed it by ~0.2 ms (the median gap of 37 epoch boundaries).
The thread comes from a pool that outlives the epoch: a thread that ends stalled the consumer for
~10 ms here (measured on each epoch's last batch), right at the epoch boundary.

At exit (:func:`_stop_at_exit`, an ``atexit`` hook, which runs before Python finalizes), every batch
thread still running is stopped after the job it is on, and waited for. The pool's threads are
daemons, which Python does not join; one still in Arrow's or numpy's code without the GIL when Python
finalizes is ended by ``pthread_exit`` as it takes the GIL back, and a C++ frame on its stack turns
that into ``std::terminate`` (the mechanism public reports of this abort trace): a script that
finished, leaving its loader open, aborted (exit 134, "terminate called without an active
exception"; 2 of 150 runs under load on this machine).
"""

from __future__ import annotations

import _thread
import atexit
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor, wait
from typing import Any, Union

from epochcache.threads import interpreter_exiting
from epochcache.train.jobs import Fence, Job, Planned

# A fence's wait list of jobs others claimed is pruned of the built ones beyond this many.
_PRUNE_AT = 16

# At exit, the longest wait for the batch threads to finish their jobs: a job takes milliseconds, but
# a transform may take longer, and one that never returns must not keep the process from exiting.
EXIT_WAIT_S = 10.0


class _Slot:
    """One batch: its job, claimed by the first thread to take ``claimed``; ``built`` is held until done."""

    __slots__ = ("job", "claimed", "built", "batch", "error")

    def __init__(self, job: Job | None, error: BaseException | None = None):
        self.job, self.batch, self.error = job, None, error
        self.claimed = _thread.allocate_lock()
        self.built = _thread.allocate_lock()
        if job is not None:
            self.built.acquire()
        else:  # a failure in planning: nothing to build
            self.claimed.acquire()

    def claim(self) -> bool:
        return self.claimed.acquire(False)

    def build(self) -> None:
        """Run the job (claimed by the caller) and keep its batch or its exception."""
        try:
            self.batch = self.job()  # type: ignore[misc]
        except BaseException as exc:  # not swallowed: raised in the consumer at this batch
            self.error = exc
            if not isinstance(exc, Exception):
                raise
        finally:
            self.job = None
            self.built.release()

    def wait(self) -> None:
        self.built.acquire()
        self.built.release()

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.batch


_DONE = object()
_Item = Union[_Slot, object]


class BatchThread:
    """Iterator over the batches of ``jobs``, which a task of ``pool`` (which must have a thread free for
    it) starts planning and building at once, up to ``depth`` ahead."""

    def __init__(self, jobs: Iterable[Planned], depth: int, pool: Executor):
        self._planned: queue.SimpleQueue[_Item] = queue.SimpleQueue()  # slots in order, then _DONE
        self._credits: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(depth + 1):
            self._credits.put(None)
        self._stop = threading.Event()
        self._holding = False
        self._ahead: deque[_Item] = deque()  # taken off _planned while helping, not yet handed out
        # Held until close: dropping the dataset behind ``jobs`` unmaps its shards, and a large munmap
        # blocks every page fault of the process (~10 ms here), so it must not happen when the last
        # batch is built but off the boundary, where the loader closes the epoch.
        self._jobs: Iterable[Planned] | None = jobs
        self._task = pool.submit(self._run, jobs)
        _RUNNING.add(self)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._holding:  # the consumer is back: the batch it held frees a place
            self._credits.put(None)
            self._holding = False
        slot = self._ahead.popleft() if self._ahead else self._planned.get()
        if not isinstance(slot, _Slot):
            self._ahead.appendleft(_DONE)  # later calls stop too
            raise StopIteration
        if slot.claim():
            slot.build()
        elif slot.built.locked():
            self._help(slot)
        self._holding = True
        return slot.result()

    def _help(self, slot: _Slot) -> None:
        """While the thread builds ``slot``: build the next jobs nobody has claimed, then wait for it."""
        while slot.built.locked() and not self._planned.empty():  # (only this thread takes from it)
            item = self._planned.get()
            self._ahead.append(item)
            if not isinstance(item, _Slot):
                break
            if item.claim():
                item.build()
        slot.wait()

    def close(self) -> None:
        """Stop planning and building and wait for the thread; batches not yet taken are dropped."""
        self.halt()
        if interpreter_exiting():  # collected as Python finalizes: the (daemon) thread runs no more
            return
        self._task.result()
        self._ahead.clear()
        self._jobs = None

    def halt(self) -> None:
        """Have the thread stop after the job it is on (it plans and builds nothing more)."""
        self._stop.set()
        self._credits.put(None)  # wakes the thread if it waits for a place: it then sees the stop

    def _run(self, jobs: Iterable[Planned]) -> None:
        """The thread: plan a job per free place, else build the oldest unclaimed one, else wait."""
        put, stop = self._planned.put, self._stop
        unbuilt: deque[_Slot] = deque()  # planned here, maybe claimed by the consumer
        others: list[Any] = []  # the ``built`` locks of slots the consumer claimed (for a fence)
        planning = iter(jobs)
        while True:
            if not self._place(unbuilt, others):
                return
            try:
                job = next(planning)
                while isinstance(job, Fence):
                    self._fence(unbuilt, others)
                    job = next(planning)
            except StopIteration:
                put(_DONE)
                while self._build_oldest(unbuilt, others) and not stop.is_set():
                    pass
                return
            except Exception as exc:  # noqa: BLE001 - not swallowed: the consumer raises it at this batch
                put(_Slot(None, exc))
                put(_DONE)  # (a consumer that goes on after the error: the epoch ends there)
                return
            slot = _Slot(job)
            unbuilt.append(slot)
            put(slot)

    def _place(self, unbuilt: deque[_Slot], others: list[Any]) -> bool:
        """Wait for a free place, building unclaimed jobs meanwhile; False once stopped."""
        while True:
            if self._stop.is_set():
                return False
            if self._credits.empty() and self._build_oldest(unbuilt, others):  # (only this thread takes places)
                continue
            self._credits.get()
            return not self._stop.is_set()

    def _build_oldest(self, unbuilt: deque[_Slot], others: list[Any]) -> bool:
        """Build the oldest planned job nobody has claimed; False if there is none."""
        while unbuilt:
            slot = unbuilt.popleft()
            if slot.claim():
                slot.build()
                return True
            others.append(slot.built)
            if len(others) > _PRUNE_AT:
                others[:] = [lock for lock in others if lock.locked()]
        return False

    def _fence(self, unbuilt: deque[_Slot], others: list[Any]) -> None:
        """Wait until every job planned so far is built (building those nobody has claimed)."""
        while self._build_oldest(unbuilt, others):
            pass
        for lock in others:
            lock.acquire()
            lock.release()
        others.clear()


# The batch threads made and not yet collected (a stopped one's task is done: waiting on it is free).
_RUNNING: weakref.WeakSet[BatchThread] = weakref.WeakSet()


def _stop_at_exit() -> None:
    """Halt every batch thread and wait, at most ``EXIT_WAIT_S`` in all, until each has stopped: no
    thread of ours is in native code when Python finalizes (see the module docstring)."""
    threads = list(_RUNNING)
    for thread in threads:
        thread.halt()
    deadline = time.monotonic() + EXIT_WAIT_S
    for thread in threads:
        wait([thread._task], timeout=max(0.0, deadline - time.monotonic()))


atexit.register(_stop_at_exit)
