"""In-process batches built ahead on a background thread.

In: an iterable of batches (a generator that builds each one as it is asked for) and a thread pool;
out: the batches, in order, at most ``depth`` queued beyond the one the consumer holds (plus one
built, waiting for a place). An exception in the thread is raised in the consumer, at the batch
where it happened.

The handoff is two ``queue.SimpleQueue`` (implemented in C): the batches, and ``depth + 1`` places
(credits, the held batch's included) that the thread takes one of before handing over a batch and
the consumer gives back when it comes for the next batch. Either side blocks in C, without the GIL,
and a batch costs one put and one get on each: the Condition of a ``queue.Queue`` cost a few
microseconds of Python per batch on both threads, which with ~60 µs batches was most of what the
loader added to the gather. The place is given back when the consumer comes back, not as it takes a
batch: that wakes the thread, and a thread woken as an epoch's first batch was handed out delayed it
by ~0.2 ms (the median gap of 37 epoch boundaries, 0.37 -> 0.18 ms).

The thread comes from a pool that outlives the epoch: a thread that ends stalled the consumer for
~10 ms here (measured on each epoch's last batch), right at the epoch boundary.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor
from typing import Any

_DONE = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class BatchThread:
    """Iterator over ``batches``, which a task of ``pool`` (which must have a thread free for it)
    starts building at once, up to ``depth`` ahead."""

    def __init__(self, batches: Iterable[Any], depth: int, pool: Executor):
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._credits: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(depth + 1):
            self._credits.put(None)
        self._stop = threading.Event()
        self._holding = False
        # Held until close: dropping the dataset behind ``batches`` unmaps its shards, and a large
        # munmap blocks every page fault of the process (~10 ms here), so it must not happen when
        # the last batch is built but off the boundary, where the loader closes the epoch.
        self._batches: Iterable[Any] | None = batches
        self._task = pool.submit(self._run, batches)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._holding:  # the consumer is back: the batch it held frees a place
            self._credits.put(None)
        item = self._queue.get()
        if item is _DONE:
            self._queue.put(_DONE)  # later calls stop too
            raise StopIteration
        if isinstance(item, _Failure):
            raise item.exc
        self._holding = True
        return item

    def close(self) -> None:
        """Stop building and wait for the task; batches not yet taken are dropped."""
        self._stop.set()
        self._credits.put(None)  # wakes the thread if it waits for a credit: it then sees the stop
        self._task.result()
        self._batches = None

    def _run(self, batches: Iterable[Any]) -> None:
        take, put, stop = self._credits.get, self._queue.put, self._stop
        try:
            for batch in batches:
                take()
                if stop.is_set():
                    return
                put(batch)
        except Exception as exc:  # noqa: BLE001 - not swallowed: the consumer raises it at this batch
            put(_Failure(exc))
            return
        put(_DONE)
