"""In-process batches built ahead on background threads.

In: a dataset with ``__getitems__``, a batch sampler and a thread pool; out: the batches, in order,
at most ``depth`` built ahead of the consumer per thread. The threads come from a pool that outlives
the epoch: a thread that ends stalls the consumer for ~10 ms here (measured on the epoch's last
batch), right at the epoch boundary. The gather is numpy/Arrow work that releases the
GIL, so it overlaps with the training step without worker processes; with ``threads`` > 1, thread k
builds batches k, k + threads, ... so the gathers of consecutive batches also overlap one another
(only their few Python steps take turns on the GIL). An exception in a thread is raised in the
consumer, at the batch where it happened.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, wait
from typing import Any

_POLL_S = 0.1
_DONE = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class BatchThread:
    """Iterator over ``build(indices)`` for each ``indices`` of ``sampler``; starts building at once,
    on ``threads`` tasks of ``pool`` (which must have that many threads free for them).

    ``sampler`` is iterated once per thread (each keeps every ``threads``-th batch), so it must be
    re-iterable, as a batch sampler is."""

    def __init__(
        self, build: Callable[[Any], Any], sampler: Iterable[Any], depth: int, pool: Executor, threads: int = 1
    ):
        self._queues: list[queue.Queue[Any]] = [queue.Queue(maxsize=depth) for _ in range(threads)]
        self._turn = itertools.cycle(self._queues)
        self._stop = threading.Event()
        # Held until close: dropping the dataset behind ``build`` unmaps its shards, and a large
        # munmap blocks every page fault of the process (~10 ms here), so it must not happen when
        # the last batch is built but off the boundary, where the loader closes the epoch.
        self._build: Callable[[Any], Any] | None = build
        self._tasks = [
            pool.submit(self._run, build, itertools.islice(sampler, k, None, threads), out)
            for k, out in enumerate(self._queues)
        ]

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        source = next(self._turn)
        item = source.get()
        if item is _DONE:
            source.put(_DONE)  # later calls stop too
            self._turn = itertools.repeat(source)
            raise StopIteration
        if isinstance(item, _Failure):
            raise item.exc
        return item

    def close(self) -> None:
        """Stop building and wait for the tasks; batches not yet taken are dropped."""
        self._stop.set()
        wait(self._tasks)
        self._build = None

    def _run(self, build: Callable[[Any], Any], batches: Iterable[Any], out: queue.Queue[Any]) -> None:
        try:
            for indices in batches:
                if not self._put(out, build(indices)):
                    return
        except Exception as exc:  # noqa: BLE001 - not swallowed: the consumer raises it at this batch
            self._put(out, _Failure(exc))
            return
        self._put(out, _DONE)

    def _put(self, out: queue.Queue[Any], item: Any) -> bool:
        while not self._stop.is_set():
            try:
                out.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False
